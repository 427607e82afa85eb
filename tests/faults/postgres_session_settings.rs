//! PostgreSQL sessions set up by the application: a `statement_timeout`
//! shorter than a transactional duplicate's wait, a database whose default
//! isolation is REPEATABLE READ, and a `search_path` set by the pool's
//! `after_connect` hook. Each test makes a database of its own (the settings
//! are the database's or the session's) and drops it.

use crate::common;

use common::servers::{fresh_tenant, pg_url};
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Identity, Outcome, PgStore, RecordState, Store,
};
use sqlx::{Connection, Executor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// A bound for polling loops (never a timing assertion: each loop ends on
/// the condition it waits for; the bound only keeps a broken run from hanging).
const GUARD: Duration = Duration::from_secs(40);

/// A brand-new database on the test server, dropped by [`drop_database`].
async fn fresh_database() -> Option<(sqlx::PgConnection, String, String)> {
    let admin_url = pg_url();
    let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url).await else {
        eprintln!("SKIPPED: PostgreSQL unreachable");
        return None;
    };
    let db = format!("pg_settings_{}", uuid::Uuid::new_v4().simple());
    admin
        .execute(format!("CREATE DATABASE {db}").as_str())
        .await
        .expect("create database");
    let url = match admin_url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{db}"),
        None => panic!("url {admin_url}"),
    };
    Some((admin, db, url))
}

/// The same, whose sessions' default isolation is REPEATABLE READ.
async fn fresh_repeatable_read_database() -> Option<(sqlx::PgConnection, String, String)> {
    let (admin, db, url) = fresh_database().await?;
    let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
    setup
        .execute(
            format!("ALTER DATABASE {db} SET default_transaction_isolation = 'repeatable read'")
                .as_str(),
        )
        .await
        .expect("alter database");
    Some((admin, db, url))
}

async fn drop_database(mut admin: sqlx::PgConnection, db: &str) {
    let _ = admin
        .execute(format!("DROP DATABASE {db} WITH (FORCE)").as_str())
        .await;
}

#[idempotent(scope = "pg_settings.tx_statement_timeout", key = key, tenant = tenant, tx = tx,
             skip(started, finish), in_progress = wait("2s"))]
async fn held_in_transaction(
    tx: &mut sqlx::PgConnection,
    tenant: &str,
    key: &str,
    started: &Notify,
    finish: &Notify,
) -> Result<u32, Error> {
    started.notify_one();
    finish.notified().await;
    Ok(1)
}

/// Rule 4 / 15 and the README ("A concurrent duplicate waits on that lock
/// within its `in_progress` bound, then gets `Error::InProgress`, and its own
/// transaction stays usable") on a session whose `statement_timeout` (a
/// common production setting, here 300 ms) is shorter than the wait bound
/// (2 s). The duplicate's reservation waits for the owner's row lock inside
/// one statement with `lock_timeout` = the whole bound; the server cancels
/// the statement first (57014, not caught by `idempotency_reserve`), so the
/// duplicate gets `Error::Store` and its transaction is aborted.
/// Deterministic: the owner's transaction stays open until the duplicate
/// has answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tx_duplicate_under_a_short_statement_timeout_gets_in_progress_and_a_usable_tx() {
    let Some((admin, db, url)) = fresh_database().await else {
        return;
    };
    drop(PgStore::connect(&url).await.expect("migrate"));
    let tenant = fresh_tenant();
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let owner = {
        let (url, tenant, started, finish) =
            (url.clone(), tenant.clone(), started.clone(), finish.clone());
        tokio::spawn(async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
            let mut tx = conn.begin().await.expect("begin");
            let answer = held_in_transaction(&mut tx, &tenant, "k", &started, &finish).await;
            tx.commit().await.expect("commit");
            answer
        })
    };
    started.notified().await; // the owner holds the reservation, uncommitted
    let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url)
        .expect("url")
        .options([("statement_timeout", "300ms")]);
    let mut conn = sqlx::PgConnection::connect_with(&options)
        .await
        .expect("connect");
    let mut tx = conn.begin().await.expect("begin");
    let never = Notify::new();
    let answer = held_in_transaction(&mut tx, &tenant, "k", &never, &never).await;
    let usable = sqlx::query_scalar::<_, i32>("SELECT 1")
        .fetch_one(&mut *tx)
        .await;
    let _ = tx.rollback().await;
    finish.notify_one();
    assert_eq!(owner.await.expect("owner").expect("owner's call"), 1);
    drop(conn);
    drop_database(admin, &db).await;
    assert!(
        matches!(answer, Err(Error::InProgress { .. })),
        "the duplicate should be refused in progress, got {answer:?}"
    );
    assert!(
        usable.is_ok(),
        "the duplicate's transaction should stay usable: {usable:?}"
    );
}

#[idempotent(scope = "pg_settings.rr_default", key = key, tenant = tenant, store = store,
             skip(runs), in_progress = wait("5s"), shared_scope)]
async fn rr_charge(
    store: &PgStore,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(9)
}

#[idempotent(scope = "pg_settings.rr_default", key = key, tenant = tenant, tx = tx,
             skip(runs, started, finish), in_progress = wait("5s"), shared_scope)]
async fn rr_charge_tx(
    tx: &mut sqlx::PgConnection,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    started: &Notify,
    finish: &Notify,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    started.notify_one();
    finish.notified().await;
    Ok(9)
}

/// Rule 4 (a duplicate waits and replays) in store mode on a database whose
/// default isolation is REPEATABLE READ (`ALTER DATABASE … SET
/// default_transaction_isolation`, or the same in a pool's options). The
/// store's reservation statement reads the record in its snapshot, finds
/// none, and inserts; the insert meets another caller's row, committed
/// after the snapshot, and under REPEATABLE READ `ON CONFLICT DO NOTHING`
/// raises 40001 (could not serialize access) instead of doing nothing. The
/// store answers `Error::Store` for a duplicate that should have replayed.
/// Deterministic: the other caller is a transactional call (a `shared_scope`
/// is not needed: the store does not know who holds the row) whose
/// uncommitted insert the store's statement waits for; it commits only once
/// the test has seen the statement blocked on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_mode_duplicate_replays_under_a_repeatable_read_default() {
    duplicate_replays_under_a_repeatable_read_default(Duration::from_secs(20), 1).await;
}

/// The same when the owner commits during the duplicate's third statement,
/// after two of its lock waits ran out (short `lock_wait`): the store tried
/// again after a serialization failure only while the count it shared with
/// lock timeouts allowed, so there it answered `Error::Store` (SQLSTATE
/// 40001) instead of replaying. The test lets the owner commit once it has
/// seen three of the duplicate's statements blocked on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_mode_duplicate_replays_when_the_owner_commits_after_lock_timeouts() {
    duplicate_replays_under_a_repeatable_read_default(Duration::from_millis(400), 3).await;
}

/// A store-mode duplicate (`lock_wait`) of a transactional owner, on a
/// REPEATABLE READ database; the owner commits once `statements` of the
/// duplicate's statements have been seen blocked on it.
async fn duplicate_replays_under_a_repeatable_read_default(lock_wait: Duration, statements: usize) {
    let Some((admin, db, url)) = fresh_repeatable_read_database().await else {
        return;
    };
    let store = PgStore::connect(&url)
        .await
        .expect("store")
        .with_lock_wait(lock_wait);
    let tenant = fresh_tenant();
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let mut owner_conn = sqlx::PgConnection::connect(&url).await.expect("connect");
    let owner_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut owner_conn)
        .await
        .expect("pid");
    let owner_runs = Arc::new(AtomicUsize::new(0));
    let owner = {
        let (tenant, started, finish, owner_runs) = (
            tenant.clone(),
            started.clone(),
            finish.clone(),
            owner_runs.clone(),
        );
        tokio::spawn(async move {
            // The owner's own transaction is READ COMMITTED (explicitly).
            let mut tx = owner_conn
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await
                .expect("begin");
            let answer = rr_charge_tx(&mut tx, &tenant, "k", &owner_runs, &started, &finish).await;
            tx.commit().await.expect("commit");
            answer
        })
    };
    started.notified().await; // the owner's insert is in, uncommitted
    let duplicate = {
        let (store, tenant) = (store.clone(), tenant.clone());
        tokio::spawn(async move {
            let runs = AtomicUsize::new(0);
            let answer = with_outcome(rr_charge(&store, &tenant, "k", &runs)).await;
            (answer, runs.load(Ordering::SeqCst))
        })
    };
    // Handshake: `statements` of the store's statements (each a backend
    // and its statement's start) have been seen blocked on the owner.
    let mut monitor = sqlx::PgConnection::connect(&url).await.expect("connect");
    let deadline = tokio::time::Instant::now() + GUARD;
    let mut seen = std::collections::BTreeSet::new();
    loop {
        let blocked: Vec<(i32, String)> = sqlx::query_as(
            "SELECT pid, query_start::TEXT FROM pg_stat_activity
              WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(owner_pid)
        .fetch_all(&mut monitor)
        .await
        .expect("pg_stat_activity");
        seen.extend(blocked);
        if seen.len() >= statements || duplicate.is_finished() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never blocked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    finish.notify_one();
    assert_eq!(owner.await.expect("owner").expect("owner's call"), 9);
    let ((answer, outcome), dup_runs) = duplicate.await.expect("duplicate");
    drop(monitor);
    drop(store);
    drop_database(admin, &db).await;
    assert_eq!(owner_runs.load(Ordering::SeqCst) + dup_runs, 1);
    assert!(
        matches!(answer, Ok(9)) && outcome == Some(Outcome::Replayed),
        "the duplicate should replay the owner's answer, got {answer:?} ({outcome:?})"
    );
}

#[idempotent(scope = "pg_settings.outage", key = key, tenant = tenant, store = store,
             skip(runs, started, go), lease = "30s")]
async fn charge_through_outage(
    store: &PgStore,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    started: &Notify,
    go: &Notify,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    started.notify_one();
    go.notified().await;
    Ok(11)
}

/// Rules 3 and 5 when recording the result fails for longer than the store's
/// worker first schedule of tries (about 9 s), as in a failover, and the
/// outage is over within the lease. The stand-in for the outage is
/// deterministic: the test holds the record's row lock in its own transaction
/// and the store's sessions (pool and worker alike) have a `lock_timeout` of
/// 50 ms, so every completion fails until the test lets go, 10 s after the
/// first one failed (by the database's clock). The record stays in progress
/// under the call's token, so the worker goes on trying and records the
/// result; the retry replays it. The worker used to give up after its
/// schedule, and the retry took the record over at the end of the lease and
/// ran the body again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_fails_through_a_longer_outage_is_still_recorded() {
    let Some((admin, db, url)) = fresh_database().await else {
        return;
    };
    let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url)
        .expect("url")
        .options([("lock_timeout", "50ms")]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool");
    let store = PgStore::from_pool(pool).await.expect("store");
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);
    let id = Identity::new(&tenant, "pg_settings.outage", "k").expect("identity");
    let mut locker = sqlx::PgConnection::connect(&url).await.expect("connect");
    let (started, go) = (Notify::new(), Notify::new());
    let call = charge_through_outage(&store, &tenant, "k", &runs, &started, &go);
    tokio::pin!(call);
    tokio::select! {
        answer = &mut call => panic!("answered before the body started: {answer:?}"),
        () = started.notified() => {}
    }
    // The record is committed in progress: lock its row, then let the body end.
    locker.execute("BEGIN").await.expect("begin");
    sqlx::query(
        "SELECT 1 FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE",
    )
    .bind(&tenant)
    .bind("pg_settings.outage")
    .bind("k")
    .execute(&mut locker)
    .await
    .expect("lock the row");
    go.notify_one();
    let first = call.await;
    assert!(
        matches!(first, Err(Error::Store(_))),
        "recording failed: {first:?}"
    );
    // The outage lasts 10 s by the database's clock.
    let failed_at = store
        .fetch(&id)
        .await
        .expect("fetch")
        .expect("record")
        .now_ms;
    let deadline = tokio::time::Instant::now() + GUARD;
    while store
        .fetch(&id)
        .await
        .expect("fetch")
        .expect("record")
        .now_ms
        < failed_at + 10_000
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the clock stood still"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    locker.execute("ROLLBACK").await.expect("rollback");
    // Over: the worker's next try records the result (or the lease runs out).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let r = store.fetch(&id).await.expect("fetch").expect("record");
        if r.state == RecordState::Complete
            || r.lease_expires_at_ms.is_some_and(|at| at <= r.now_ms)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "neither recorded nor expired"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let go_at_once = Notify::new();
    go_at_once.notify_one();
    let (again, outcome) = with_outcome(charge_through_outage(
        &store,
        &tenant,
        "k",
        &runs,
        &Notify::new(),
        &go_at_once,
    ))
    .await;
    let ran = runs.load(Ordering::SeqCst);
    drop_database(admin, &db).await;
    assert_eq!(ran, 1, "the body ran again: retry {again:?} ({outcome:?})");
    assert_eq!(again.expect("replayed"), 11);
    assert_eq!(outcome, Some(Outcome::Replayed));
}

#[idempotent(scope = "pg_settings.after_connect", key = key, tenant = tenant, store = store,
             skip(started), lease = "1h")]
async fn held_forever(
    store: &PgStore,
    tenant: &str,
    key: &str,
    started: &Notify,
) -> Result<u32, Error> {
    started.notify_one();
    std::future::pending::<()>().await;
    Ok(0)
}

/// Rule 14 on a pool whose `after_connect` hook sets the `search_path` (the
/// records table lives in schema `app`, not in `public`): a call dropped
/// while it holds its record is released by the store's background worker,
/// whose connections run the pool's hooks too; otherwise its release would
/// look for the record in `public` and the key would stay taken for the
/// whole lease (here an hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_call_is_released_in_the_schema_the_after_connect_hook_sets() {
    let Some((admin, db, url)) = fresh_database().await else {
        return;
    };
    {
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
        conn.execute("CREATE SCHEMA app").await.expect("schema");
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET search_path TO app").await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .expect("pool");
    let store = PgStore::from_pool(pool.clone()).await.expect("store");
    let in_app: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'app' AND tablename = 'idempotency_records'",
    )
    .fetch_one(&pool)
    .await
    .expect("catalog");
    assert_eq!(in_app, 1, "the migrations ran in the hook's schema");

    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, "pg_settings.after_connect", "k").expect("identity");
    let started = Notify::new();
    tokio::select! {
        answer = held_forever(&store, &tenant, "k", &started) => panic!("the held call answered: {answer:?}"),
        () = started.notified() => {} // the call holds its record; drop it now
    }
    let deadline = tokio::time::Instant::now() + GUARD;
    let released = loop {
        let fetched = tokio::time::timeout(GUARD, store.fetch(&id))
            .await
            .expect("fetch hung")
            .expect("fetch");
        match fetched {
            None => break true,
            Some(_) if tokio::time::Instant::now() >= deadline => break false,
            Some(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    drop(store);
    pool.close().await;
    drop_database(admin, &db).await;
    assert!(
        released,
        "the dropped call's record in schema app was not released within {GUARD:?}"
    );
}

/// Rules 3 and 4 in store mode on a database whose default isolation is
/// REPEATABLE READ: the owner's completion meets a row another session
/// changed after the statement's snapshot (a waiting duplicate marking the
/// record, `waiting = TRUE`, at that moment). PostgreSQL answers 40001, and
/// the owner, whose body had run, got `Error::Store`. The same statement
/// again has a new snapshot and records the result. Deterministic: the test
/// changes the row in a transaction of its own, and commits it only once the
/// completion is blocked on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_meeting_a_concurrent_mark_is_recorded_under_a_repeatable_read_default() {
    use idempotent_runtime::{Fenced, OwnerToken, ReserveRequest, StoredOutcome};
    let Some((admin, db, url)) = fresh_repeatable_read_database().await else {
        return;
    };
    let store = PgStore::connect(&url).await.expect("store");
    let identity = Identity::new(fresh_tenant(), "pg_settings.rr_complete", "k").expect("identity");
    let token = OwnerToken::new();
    let reserved = store
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &token,
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(matches!(
        reserved,
        idempotent_runtime::Reservation::Acquired { .. }
    ));

    // Another session changes the row, and holds it until the completion waits.
    let mut marker = sqlx::PgConnection::connect(&url).await.expect("connect");
    let marker_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut marker)
        .await
        .expect("pid");
    marker.execute("BEGIN").await.expect("begin");
    sqlx::query(
        "UPDATE idempotency_records SET waiting = TRUE
          WHERE tenant = $1 AND scope = $2 AND key = $3",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .execute(&mut marker)
    .await
    .expect("mark");
    let completion = {
        let (store, identity, token) = (store.clone(), identity.clone(), token.clone());
        tokio::spawn(async move {
            let outcome = StoredOutcome {
                is_error: false,
                payload: b"7".to_vec(),
            };
            store
                .complete(Completion::by_body(
                    &identity,
                    &token,
                    &outcome,
                    Duration::from_secs(3600),
                ))
                .await
        })
    };
    let mut monitor = sqlx::PgConnection::connect(&url).await.expect("connect");
    let deadline = tokio::time::Instant::now() + GUARD;
    loop {
        let blocked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(marker_pid)
        .fetch_one(&mut monitor)
        .await
        .expect("pg_stat_activity");
        if blocked > 0 || completion.is_finished() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never blocked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    marker.execute("COMMIT").await.expect("commit the mark");
    let answer = completion.await.expect("join");
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    drop((monitor, marker));
    drop(store);
    drop_database(admin, &db).await;
    assert_eq!(
        answer.expect("the owner's result is recorded, not an error"),
        Fenced::Written
    );
    assert_eq!(record.state, RecordState::Complete);
}
