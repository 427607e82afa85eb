//! Operator actions racing live calls (DESIGN rules 10 and 16; the README's
//! "Auditing and retention" and `idempotent release`): an operator's release
//! or a purge made while an owner's body runs, with the owner then
//! finishing. Every step is a handshake: the body says when it has started
//! and waits to be let go, so the operator's action lands inside the body
//! on every run.
//!
//! - A purge never deletes the record of a body that runs (its lease is
//!   live, its ttl run out or not): the owner's answer is recorded and
//!   replayed.
//! - `release --end-lease`: an owner that finishes before anyone takes the
//!   record over records its answer (it is still the owner); one that
//!   finishes after a takeover is fenced (`LeaseLost`) and the new owner's
//!   answer stays the key's answer.
//! - `release --even-if-running`: the owner's completion is fenced
//!   (`LeaseLost`), and the answer of the call that ran after the release
//!   stays the key's answer.
//!
//! On memory, a SQLite file, PostgreSQL and MariaDB.

use crate::common;

use idempotent_runtime::purge::purge_all;
use idempotent_runtime::{
    idempotent, Completion, Error, ForcedRelease, Identity, MemoryStore, OwnerToken, RecordState,
    SqliteStore, Store, StoredOutcome,
};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

/// How long a step may wait for its handshake: reached only when the call
/// under test never got to its body (or never ended).
const BOUND: Duration = Duration::from_secs(60);

/// The bodies' shared state: how often they ran, and a hold for the first.
#[derive(Default)]
struct Gate {
    runs: AtomicU32,
    reached: Notify,
    go: Notify,
}

#[idempotent(scope = "ops_races.charge", key = key, tenant = tenant, store = store,
             skip(gate, hold), lease = "30s", ttl = "1h", in_progress = reject)]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
    hold: bool,
) -> Result<u32, Error> {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if hold {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    Ok(run)
}

/// A ttl far shorter than the body: it runs out while the body runs, the
/// lease does not.
#[idempotent(scope = "ops_races.long_body", key = key, tenant = tenant, store = store,
             skip(gate), lease = "30s", ttl = "50ms", in_progress = reject)]
async fn long_body(store: &dyn Store, tenant: &str, key: &str, gate: &Gate) -> Result<u32, Error> {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    gate.reached.notify_one();
    gate.go.notified().await;
    Ok(run)
}

fn fresh() -> (String, String) {
    (
        common::servers::fresh_tenant(),
        format!("k-{}", uuid::Uuid::new_v4().simple()),
    )
}

/// Starts `call` and drives it until its body has started (`gate.reached`).
async fn until_the_body_runs<F: std::future::Future + Unpin>(call: &mut F, gate: &Gate)
where
    F::Output: std::fmt::Debug,
{
    tokio::time::timeout(BOUND, async {
        tokio::select! {
            () = gate.reached.notified() => {}
            answer = call => panic!("the body holds until let go, yet the call ended: {answer:?}"),
        }
    })
    .await
    .expect("the first call reached its body");
}

/// The owner's token as the store has it (what `release --end-lease` reads).
async fn owner_of(store: &dyn Store, identity: &Identity) -> OwnerToken {
    let snapshot = store
        .fetch(identity)
        .await
        .expect("fetch")
        .expect("the record is there");
    assert_eq!(snapshot.state, RecordState::InProgress);
    OwnerToken::from_stored(snapshot.owner_token.expect("an owner token"))
}

/// `release --even-if-running` while the owner's body runs; then another
/// call runs the body (the documented cost), and then the first owner
/// finishes: its completion is fenced, the second call's answer is the key's.
async fn release_while_running_then_the_owner_finishes(store: &dyn Store) {
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, "ops_races.charge", &key).expect("identity");
    let gate = Gate::default();
    let mut first = Box::pin(charge(store, &tenant, &key, &gate, true));
    until_the_body_runs(&mut first, &gate).await;

    let refused = store.force_release(&identity, true).await.expect("release");
    assert!(
        matches!(refused, ForcedRelease::LeaseLive { .. }),
        "a live lease is refused without --even-if-running: {refused:?}"
    );
    assert!(matches!(
        store
            .force_release(&identity, false)
            .await
            .expect("release"),
        ForcedRelease::Released { attempt: 1 }
    ));
    let second = charge(store, &tenant, &key, &gate, false).await;
    assert_eq!(second.expect("the key is free again"), 2);

    gate.go.notify_one();
    let first = tokio::time::timeout(BOUND, first).await.expect("ended");
    assert!(
        matches!(first, Err(Error::LeaseLost(_))),
        "the released owner's completion is fenced: {first:?}"
    );
    assert_eq!(
        charge(store, &tenant, &key, &gate, false)
            .await
            .expect("replay"),
        2,
        "the second call's answer stays the key's answer ({})",
        store.name()
    );
    assert_eq!(gate.runs.load(Ordering::SeqCst), 2);
}

/// `release --end-lease --even-if-running` while the owner's body runs, and
/// the owner finishes before any other call: it is still the owner, its
/// answer is recorded and replayed, the body ran once.
async fn end_lease_then_the_owner_finishes_first(store: &dyn Store) {
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, "ops_races.charge", &key).expect("identity");
    let gate = Gate::default();
    let mut first = Box::pin(charge(store, &tenant, &key, &gate, true));
    until_the_body_runs(&mut first, &gate).await;

    let token = owner_of(store, &identity).await;
    assert!(store
        .heartbeat(&identity, &token, Duration::ZERO)
        .await
        .expect("end the lease")
        .is_written());

    gate.go.notify_one();
    let first = tokio::time::timeout(BOUND, first).await.expect("ended");
    assert_eq!(first.expect("the owner records its answer"), 1);
    assert_eq!(
        charge(store, &tenant, &key, &gate, false)
            .await
            .expect("replay"),
        1
    );
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "{}", store.name());
}

/// `release --end-lease --even-if-running` while the owner's body runs, then
/// a call takes the record over (attempt 2) and answers, then the first
/// owner finishes: fenced, the taker's answer stays.
async fn end_lease_then_a_takeover_then_the_owner_finishes(store: &dyn Store) {
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, "ops_races.charge", &key).expect("identity");
    let gate = Gate::default();
    let mut first = Box::pin(charge(store, &tenant, &key, &gate, true));
    until_the_body_runs(&mut first, &gate).await;

    let token = owner_of(store, &identity).await;
    assert!(store
        .heartbeat(&identity, &token, Duration::ZERO)
        .await
        .expect("end the lease")
        .is_written());
    let second = charge(store, &tenant, &key, &gate, false).await;
    assert_eq!(second.expect("the takeover runs"), 2);
    let snapshot = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(
        (snapshot.state, snapshot.attempt),
        (RecordState::Complete, 2)
    );

    gate.go.notify_one();
    let first = tokio::time::timeout(BOUND, first).await.expect("ended");
    assert!(
        matches!(first, Err(Error::LeaseLost(_))),
        "the first owner's completion is fenced: {first:?}"
    );
    assert_eq!(
        charge(store, &tenant, &key, &gate, false)
            .await
            .expect("replay"),
        2,
        "{}",
        store.name()
    );
}

/// A purge made while a body runs past its ttl (the lease live) leaves the
/// record: the owner's answer is recorded (not `LeaseLost`).
async fn purge_while_a_body_outlives_its_ttl(store: &dyn Store) {
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, "ops_races.long_body", &key).expect("identity");
    let gate = Gate::default();
    let mut first = Box::pin(long_body(store, &tenant, &key, &gate));
    until_the_body_runs(&mut first, &gate).await;
    // Bounded wait for the store's clock to pass the call's ttl (the record's
    // retention is kept up with its lease while the body runs).
    let mut passed = false;
    for _ in 0..2_000 {
        let s = store
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        if s.now_ms >= s.created_at_ms + 50 {
            passed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(passed, "the store's clock passed the call's ttl");
    purge_all(store, 1000).await.expect("purge");
    let s = store.fetch(&identity).await.expect("fetch");
    assert_eq!(
        s.map(|s| s.state),
        Some(RecordState::InProgress),
        "a purge keeps the record of a body that runs ({})",
        store.name()
    );
    gate.go.notify_one();
    let first = tokio::time::timeout(BOUND, first).await.expect("ended");
    assert_eq!(first.expect("the owner records its answer"), 1);
}

async fn all(store: &dyn Store) {
    release_while_running_then_the_owner_finishes(store).await;
    end_lease_then_the_owner_finishes_first(store).await;
    end_lease_then_a_takeover_then_the_owner_finishes(store).await;
    purge_while_a_body_outlives_its_ttl(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_actions_race_live_calls_on_memory() {
    all(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_actions_race_live_calls_on_sqlite() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("ops-races"))
        .await
        .expect("sqlite");
    all(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_actions_race_live_calls_on_postgres() {
    if let Some(store) = common::servers::pg_store_or_skip().await {
        all(&store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_actions_race_live_calls_on_mariadb() {
    if let Some(store) = common::servers::mysql_store_or_skip().await {
        all(&store).await;
    }
}

// ------------------------------------------------ transactional mode

#[idempotent(scope = "ops_races.pg_tx", key = key, tenant = tenant, tx = tx, skip(gate),
             lease = "30s", ttl = "1h", in_progress = reject)]
async fn pg_tx_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u32, Error> {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    gate.reached.notify_one();
    gate.go.notified().await;
    Ok(run)
}

#[idempotent(scope = "ops_races.my_tx", key = key, tenant = tenant, tx = tx, skip(gate),
             lease = "30s", ttl = "1h", in_progress = reject)]
async fn my_tx_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u32, Error> {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    gate.reached.notify_one();
    gate.go.notified().await;
    Ok(run)
}

/// Plants a record of `identity` completed with a ttl of 1 ms and waits
/// (bounded) until the store's clock counts it expired: a record a purge may
/// delete, and a new call replaces.
async fn expired(store: &dyn Store, identity: &Identity) {
    let blink = Duration::from_millis(1);
    let token =
        common::records::acquire(store, identity, None, Duration::from_secs(30), blink).await;
    let outcome = StoredOutcome {
        is_error: false,
        payload: b"0".to_vec(),
    };
    assert!(store
        .complete(Completion::by_body(identity, &token, &outcome, blink))
        .await
        .expect("complete")
        .is_written());
    for _ in 0..2_000 {
        match store.fetch(identity).await.expect("fetch") {
            Some(s) if !s.is_expired() => tokio::time::sleep(Duration::from_millis(5)).await,
            _ => return,
        }
    }
    panic!("the store's clock did not pass 1 ms in 10 s");
}

/// What a transactional-mode call that replaced an expired record, its
/// transaction open, leaves to a purge and an operator's release made
/// meanwhile: both return (neither waits for the transaction), neither
/// deletes the record, and the call's answer is recorded with its commit.
async fn tx_call_meets_purge_and_release<'g, F, Fut>(
    store: &dyn Store,
    scope: &str,
    gate: &'g Gate,
    commit_after: F,
) where
    F: FnOnce(&'g Gate, String, String) -> Fut,
    Fut: std::future::Future<Output = Result<u32, Error>>,
{
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, scope, &key).expect("identity");
    expired(store, &identity).await;
    let mut call = Box::pin(commit_after(gate, tenant.clone(), key.clone()));
    until_the_body_runs(&mut call, gate).await;

    tokio::time::timeout(BOUND, purge_all(store, 1000))
        .await
        .expect("a purge never waits for a transaction's row")
        .expect("purge");
    // Refused as held by a transaction, or (the caller's version not
    // committed) as the abandoned record's absence; never a wait for ever.
    let _ = tokio::time::timeout(BOUND, store.force_release(&identity, false))
        .await
        .expect("a release never waits for ever");

    gate.go.notify_one();
    let answer = tokio::time::timeout(BOUND, call).await.expect("ended");
    assert_eq!(answer.expect("the call commits its answer"), 1);
    let s = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(
        (s.state, gate.runs.load(Ordering::SeqCst)),
        (RecordState::Complete, 1),
        "{}",
        store.name()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_call_outlasts_a_purge_and_a_release_on_postgres() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    let gate = Gate::default();
    tx_call_meets_purge_and_release(&store, "ops_races.pg_tx", &gate, |gate, tenant, key| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            let answer = pg_tx_charge(&mut tx, &tenant, &key, gate).await;
            tx.commit().await.expect("commit");
            answer
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_call_outlasts_a_purge_and_a_release_on_mariadb() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    let gate = Gate::default();
    tx_call_meets_purge_and_release(&store, "ops_races.my_tx", &gate, |gate, tenant, key| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            let answer = my_tx_charge(&mut tx, &tenant, &key, gate).await;
            tx.commit().await.expect("commit");
            answer
        }
    })
    .await;
}

// ------------------------------------- a purge deleting as a call reserves

/// A purge's statement deletes an expired record (its transaction open, the
/// row locked, as each purge statement holds the rows it deletes until it
/// commits) at the moment a new call of that key reserves it: the call
/// waits for the statement, then finds the key free, runs the body once
/// and records its answer. Its wait is bounded by the store's lock wait
/// (PostgreSQL's `lock_wait`, 100 ms by default; MariaDB 1 s): a statement
/// that holds the row longer (here the test, as slow as the machine) gets
/// `InProgress`, and the retry after the purge committed runs the body.
/// Never a second run, an error or a wait for ever.
async fn a_call_meets_a_purge_deleting_its_expired_record<H, HFut, B, BFut, C, CFut>(
    store: std::sync::Arc<dyn Store>,
    begin_and_delete: H,
    blocked: B,
    commit: C,
) where
    H: Fn(Identity) -> HFut,
    HFut: std::future::Future<Output = bool>,
    B: Fn() -> BFut,
    BFut: std::future::Future<Output = bool>,
    C: FnOnce() -> CFut,
    CFut: std::future::Future<Output = ()>,
{
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, "ops_races.charge", &key).expect("identity");
    // A purge of another test on the same server may delete the planted
    // record first: then it is planted again (bounded).
    let mut held = false;
    for _ in 0..10 {
        expired(&*store, &identity).await;
        if begin_and_delete(identity.clone()).await {
            held = true;
            break;
        }
    }
    assert!(
        held,
        "the planted record was purged by others 10 times in a row"
    );

    let gate = std::sync::Arc::new(Gate::default());
    let call = tokio::spawn({
        let (store, gate, tenant, key) = (store.clone(), gate.clone(), tenant.clone(), key.clone());
        async move { charge(&*store, &tenant, &key, &gate, false).await }
    });
    // Until the call's reservation waits for the purge's row, or its wait's
    // bound ran out first (bounded).
    let mut seen = false;
    for _ in 0..6_000 {
        if blocked().await || call.is_finished() {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(seen, "the call's reservation met the purge's row");
    commit().await;

    let answer = tokio::time::timeout(BOUND, call)
        .await
        .expect("the call ends")
        .expect("no panic");
    let answer = match answer {
        // The purge held the row longer than the reservation's lock wait.
        Err(Error::InProgress { .. }) => {
            assert_eq!(gate.runs.load(Ordering::SeqCst), 0, "refused, not run");
            charge(&*store, &tenant, &key, &gate, false).await
        }
        other => other,
    };
    assert_eq!(
        answer.expect("the key is free once the purge committed"),
        1,
        "{}",
        store.name()
    );
    assert_eq!(
        charge(&*store, &tenant, &key, &gate, false)
            .await
            .expect("replay"),
        1
    );
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_meets_a_purge_deleting_its_record_on_postgres() {
    use sqlx::Connection;
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    let holder = std::sync::Arc::new(tokio::sync::Mutex::new(
        sqlx::PgConnection::connect(&common::servers::pg_url())
            .await
            .expect("connect"),
    ));
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder.lock().await)
        .await
        .expect("pid");
    let watcher = store.pool().clone();
    a_call_meets_a_purge_deleting_its_expired_record(
        std::sync::Arc::new(store),
        |identity| {
            let holder = holder.clone();
            async move {
                let mut c = holder.lock().await;
                sqlx::query("BEGIN").execute(&mut *c).await.expect("begin");
                let done = sqlx::query(
                    "DELETE FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3",
                )
                .bind(identity.tenant())
                .bind(identity.scope())
                .bind(identity.key())
                .execute(&mut *c)
                .await
                .expect("delete");
                if done.rows_affected() == 0 {
                    sqlx::query("ROLLBACK")
                        .execute(&mut *c)
                        .await
                        .expect("rollback");
                }
                done.rows_affected() == 1
            }
        },
        || {
            let watcher = watcher.clone();
            async move {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                )
                .bind(pid)
                .fetch_one(&watcher)
                .await
                .expect("blocked sessions");
                n > 0
            }
        },
        || {
            let holder = holder.clone();
            async move {
                sqlx::query("COMMIT")
                    .execute(&mut *holder.lock().await)
                    .await
                    .expect("commit");
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_meets_a_purge_deleting_its_record_on_mariadb() {
    use sqlx::Connection;
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let holder = std::sync::Arc::new(tokio::sync::Mutex::new(
        sqlx::MySqlConnection::connect(&common::servers::mysql_url())
            .await
            .expect("connect"),
    ));
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut *holder.lock().await)
        .await
        .expect("connection id");
    let watcher = store.pool().clone();
    a_call_meets_a_purge_deleting_its_expired_record(
        std::sync::Arc::new(store),
        |identity| {
            let holder = holder.clone();
            async move {
                let mut c = holder.lock().await;
                sqlx::query("START TRANSACTION")
                    .execute(&mut *c)
                    .await
                    .expect("begin");
                let done = sqlx::query(
                    "DELETE FROM idempotency_records WHERE tenant = ? AND scope = ? AND `key` = ?",
                )
                .bind(identity.tenant().as_bytes())
                .bind(identity.scope().as_bytes())
                .bind(identity.key().as_bytes())
                .execute(&mut *c)
                .await
                .expect("delete");
                if done.rows_affected() == 0 {
                    sqlx::query("ROLLBACK")
                        .execute(&mut *c)
                        .await
                        .expect("rollback");
                }
                done.rows_affected() == 1
            }
        },
        || {
            let watcher = watcher.clone();
            async move {
                // The reservation's statement waiting for the row (InnoDB
                // lists no lock wait of a procedure's statement in
                // INNODB_LOCK_WAITS): another test's statement may be
                // taken for it, which only commits the purge early.
                let n: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST
                      WHERE DB = DATABASE() AND ID <> CONNECTION_ID() AND ID <> ?
                        AND STATE = 'Updating' AND INFO LIKE 'UPDATE idempotency_records%'",
                )
                .bind(id)
                .fetch_one(&watcher)
                .await
                .expect("waiting statements");
                n > 0
            }
        },
        || {
            let holder = holder.clone();
            async move {
                sqlx::query("COMMIT")
                    .execute(&mut *holder.lock().await)
                    .await
                    .expect("commit");
            }
        },
    )
    .await;
}
