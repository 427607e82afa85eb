//! Store mode on a pool shared with application code (`PgStore::from_pool`,
//! `SqliteStore::from_pool`, `MySqlStore::from_pool`): what code sharing the pool leaves on a
//! connection (a session setting, a temporary table) and the store's next
//! reservation or completion then runs under. Each test uses a pool of one
//! connection, so the connection the test leaves the state on is the one
//! the store is handed next.

use crate::common;

use common::servers::{
    fresh_tenant, mysql_create_database, mysql_drop_then_check, mysql_store_or_skip, mysql_url,
    mysql_url_of, pg_store_or_skip, pg_url,
};
use idempotent_runtime::{
    Completion, Fenced, Fingerprint, Identity, MySqlStore, OwnerToken, PgStore, RecordState,
    Reservation, ReserveRequest, SqliteStore, Store, StoredOutcome, TransactionalConnection,
};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::{Connection, Executor};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(3600);

fn fp(value: &str) -> Fingerprint {
    Fingerprint::of(value).expect("fingerprint")
}

fn ok(payload: &[u8]) -> StoredOutcome {
    StoredOutcome {
        is_error: false,
        payload: payload.to_vec(),
    }
}

fn request<'a>(
    identity: &'a Identity,
    fingerprint: &'a Fingerprint,
    token: &'a OwnerToken,
) -> ReserveRequest<'a> {
    ReserveRequest {
        identity,
        fingerprint: Some(fingerprint),
        token,
        lease: LONG,
        ttl: LONG,
    }
}

/// One call on `dirty` (whose only connection the test left in some state):
/// reserve, complete. Then, whatever `dirty` answered, a clean session
/// (`clean`) must either see the record that call wrote, under the same
/// identity, and replay it, or `dirty` must have refused to write at all (a
/// store error): never a record written where a clean session does not find
/// it, which lets a retry run the body again.
async fn a_call_on_the_dirty_pool_is_seen_by_a_clean_one(
    dirty: &dyn Store,
    clean: &dyn Store,
    identity: &Identity,
) {
    let f = fp("request");
    let token = OwnerToken::new();
    match dirty.reserve(request(identity, &f, &token)).await {
        Err(e) => {
            // A refusal: nothing may have been written.
            assert!(
                clean.fetch(identity).await.expect("fetch").is_none(),
                "refused ({e}), yet a record was written"
            );
            return;
        }
        Ok(reservation) => assert_eq!(reservation, Reservation::FRESH),
    }
    match dirty
        .complete(Completion::by_body(identity, &token, &ok(b"7"), LONG))
        .await
    {
        Ok(written) => assert_eq!(written, Fenced::Written, "the owner records its result"),
        Err(e) => panic!("the reservation was taken, but its completion failed: {e}"),
    }
    let seen = clean.fetch(identity).await.expect("fetch");
    assert!(
        seen.as_ref()
            .is_some_and(|r| r.state == RecordState::Complete),
        "a clean session finds the recorded result under the same identity (found {seen:?})"
    );
    let retry = OwnerToken::new();
    assert_eq!(
        clean
            .reserve(request(identity, &f, &retry))
            .await
            .expect("reserve"),
        Reservation::Completed(ok(b"7")),
        "a retry on a clean session replays, it does not run the body again"
    );
}

/// A PostgreSQL pool of one connection on `url`, and a store on it.
async fn pg_pool_of_one(url: &str) -> (sqlx::PgPool, PgStore) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .expect("pool");
    let store = PgStore::from_pool(pool.clone()).await.expect("store");
    (pool, store)
}

/// `SET client_encoding = 'LATIN1'` left on a connection of the shared pool
/// (a legacy import, a `COPY` of a Latin-1 file). sqlx sends UTF-8 whatever
/// the session says and does not notice the change; the server reads each
/// text parameter as Latin-1 and converts it: a key `café` arrives as
/// `cafÃ©`. The reservation and the completion, on that connection alike,
/// agree with each other, but the record is written under another identity
/// than a clean session looks for: a retry there finds nothing and runs the
/// body again.
#[tokio::test]
async fn pg_a_session_left_in_latin1_writes_under_the_callers_identity() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let identity = Identity::new(fresh_tenant(), "pool_state.encoding", "café").expect("identity");
    pool.execute("SET client_encoding = 'LATIN1'")
        .await
        .expect("set the encoding");
    a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
}

/// The same encoding, with a tenant and key in ASCII, which every client
/// encoding sends as it is: served as on a clean connection, not refused;
/// and a completion that matches nothing there is a takeover as anywhere.
#[tokio::test]
async fn pg_a_session_left_in_latin1_serves_ascii_identities() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    pool.execute("SET client_encoding = 'LATIN1'")
        .await
        .expect("set the encoding");
    let identity =
        Identity::new(fresh_tenant(), "pool_state.encoding_ascii", "cafe").expect("identity");
    let (f, token) = (fp("request"), OwnerToken::new());
    assert_eq!(
        dirty
            .reserve(request(&identity, &f, &token))
            .await
            .expect("an ASCII identity is served"),
        Reservation::FRESH
    );
    assert_eq!(
        dirty
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
    assert_eq!(
        clean
            .reserve(request(&identity, &f, &OwnerToken::new()))
            .await
            .expect("reserve"),
        Reservation::Completed(ok(b"7")),
        "a clean connection replays it"
    );
    let taken = Identity::new(fresh_tenant(), "pool_state.encoding_ascii", "k").expect("identity");
    let stale = OwnerToken::new();
    assert_eq!(
        clean
            .reserve(request(&taken, &f, &OwnerToken::new()))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    assert_eq!(
        dirty
            .complete(Completion::by_body(&taken, &stale, &ok(b"7"), LONG))
            .await
            .expect("a completion by a token that does not own the record"),
        Fenced::NotOwner
    );
}

/// The same encoding left on the connection after the reservation, before
/// the completion (the pool hands the store another connection for each
/// statement): the completion would name another record and match nothing,
/// which would read as a takeover (`LeaseLost`) and leave the record in
/// progress for the next caller to take over and run the body again. It is
/// told as the connection's fault instead (a store error, whose answer the
/// engine's worker records on connections of its own), and the record is
/// still the caller's to complete.
#[tokio::test]
async fn pg_a_completion_on_a_session_left_in_latin1_is_not_taken_for_a_takeover() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let identity =
        Identity::new(fresh_tenant(), "pool_state.encoding_late", "café").expect("identity");
    let f = fp("request");
    let token = OwnerToken::new();
    assert_eq!(
        dirty
            .reserve(request(&identity, &f, &token))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    pool.execute("SET client_encoding = 'LATIN1'")
        .await
        .expect("set the encoding");
    let refused = dirty
        .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
        .await
        .expect_err("a completion that names another record");
    assert!(refused.to_string().contains("client_encoding"), "{refused}");
    let refused = dirty
        .heartbeat(&identity, &token, LONG)
        .await
        .expect_err("a renewal that names another record");
    assert!(refused.to_string().contains("client_encoding"), "{refused}");
    pool.execute("RESET client_encoding")
        .await
        .expect("reset the encoding");
    assert_eq!(
        clean
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("complete"),
        Fenced::Written,
        "the record is still the caller's"
    );
}

/// Transactional mode on a connection in that encoding: the caller's own
/// writes are converted too, but the record must be found by every retry,
/// whatever encoding its connection has: refused, nothing written, the
/// transaction still usable.
#[tokio::test]
async fn pg_a_transactional_call_on_a_latin1_session_is_refused_with_nothing_written() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let mut conn = sqlx::PgConnection::connect(&pg_url())
        .await
        .expect("connect");
    conn.execute("SET client_encoding = 'LATIN1'")
        .await
        .expect("set the encoding");
    let identity =
        Identity::new(fresh_tenant(), "pool_state.encoding_tx", "café").expect("identity");
    let f = fp("request");
    let token = OwnerToken::new();
    let mut tx = conn.begin().await.expect("begin");
    let refused = tx
        .reserve_in_transaction(request(&identity, &f, &token), Duration::from_millis(100))
        .await
        .expect_err("a reservation that would name another record");
    assert!(refused.to_string().contains("client_encoding"), "{refused}");
    tx.execute("SELECT 1")
        .await
        .expect("the transaction is still usable");
    tx.commit().await.expect("commit");
    assert!(clean.fetch(&identity).await.expect("fetch").is_none());
}

/// A connection of the shared pool handed back inside a transaction the
/// application began and wrote in (a plain `BEGIN`, a write, then an early
/// return): the store's reservation and completion were written inside it,
/// seen by nobody else and rolled back with it, and a retry elsewhere ran
/// the body again. The reservation is refused there and the connection
/// closed (rolling that transaction back); the next call takes another.
/// (A transaction left open that wrote nothing is not seen: README.)
#[tokio::test]
async fn pg_a_connection_left_inside_a_written_transaction_takes_no_record() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN").await.expect("begin");
    // A write of the application's own: a transaction id is assigned.
    conn.execute("SELECT txid_current()").await.expect("write");
    drop(conn);
    let identity = Identity::new(fresh_tenant(), "pool_state.left_open", "k").expect("identity");
    a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
}

/// The same connection, when the record is there with its lease run out
/// (its owner crashed): the takeover goes to the plpgsql function, not to
/// the fresh key's insert. Written inside that transaction, the takeover
/// and the new owner's result are seen by nobody else and roll back with
/// it (the connection closed, the transaction ended by its code), and a
/// retry elsewhere takes the record over again and runs the body again.
#[tokio::test]
async fn pg_a_takeover_on_a_connection_left_inside_a_written_transaction_is_not_lost() {
    in_own_database(|url| async move {
        let clean = PgStore::connect(&url).await.expect("clean store");
        let identity =
            Identity::new(fresh_tenant(), "pool_state.left_open_takeover", "k").expect("identity");
        let f = fp("request");
        assert_eq!(
            clean
                .reserve(request(&identity, &f, &OwnerToken::new()))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        // The first owner's lease has run out (its own database: set by hand).
        clean
            .pool()
            .execute("UPDATE idempotency_records SET lease_expires_at = 0")
            .await
            .expect("expire the lease");
        let (pool, dirty) = pg_pool_of_one(&url).await;
        let mut conn = pool.acquire().await.expect("connection");
        conn.execute("BEGIN").await.expect("begin");
        conn.execute("SELECT txid_current()").await.expect("write");
        drop(conn);
        let token = OwnerToken::new();
        match dirty.reserve(request(&identity, &f, &token)).await {
            Err(e) => {
                let seen = clean.fetch(&identity).await.expect("fetch");
                assert!(
                    seen.is_some_and(|r| r.state == RecordState::InProgress),
                    "refused ({e}): the record is as it was"
                );
                return;
            }
            Ok(reservation) => assert!(
                matches!(reservation, Reservation::Acquired { .. }),
                "{reservation:?}"
            ),
        }
        assert_eq!(
            dirty
                .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
                .await
                .expect("complete"),
            Fenced::Written
        );
        let seen = clean.fetch(&identity).await.expect("fetch");
        assert!(
            seen.as_ref()
                .is_some_and(|r| r.state == RecordState::Complete),
            "a clean session finds the recorded result (found {seen:?})"
        );
        pool.close().await;
    })
    .await;
}

/// The same connection handed to the owner's completion (its reservation
/// took a clean one): the result written inside that transaction is seen by
/// nobody else and rolls back with it, the record stays in progress, and
/// once its lease runs out a retry takes it over and runs the body again.
/// The result is recorded where every session sees it, or the completion
/// fails (and the engine's worker records it on connections of its own).
#[tokio::test]
async fn pg_a_completion_on_a_connection_left_inside_a_written_transaction_is_not_lost() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let identity =
        Identity::new(fresh_tenant(), "pool_state.left_open_complete", "k").expect("identity");
    let (f, token) = (fp("request"), OwnerToken::new());
    assert_eq!(
        dirty
            .reserve(request(&identity, &f, &token))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN").await.expect("begin");
    conn.execute("SELECT txid_current()").await.expect("write");
    drop(conn);
    let completed = dirty
        .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
        .await;
    let seen = clean.fetch(&identity).await.expect("fetch");
    match completed {
        Ok(written) => {
            assert_eq!(written, Fenced::Written);
            assert!(
                seen.as_ref()
                    .is_some_and(|r| r.state == RecordState::Complete),
                "a clean session finds the recorded result (found {seen:?})"
            );
        }
        Err(e) => assert!(
            seen.as_ref()
                .is_some_and(|r| r.state == RecordState::InProgress
                    && r.owner_token.as_deref() == Some(token.as_str())),
            "refused ({e}): the record is still the caller's (found {seen:?})"
        ),
    }
    pool.close().await;
}

/// A duplicate waiting for a record in progress marks it as waited for (an
/// `UPDATE` of its row) on a connection of the shared pool: left inside a
/// transaction other code began and wrote in, the mark and its row lock
/// stayed in that transaction for as long as it was left open, the pool's
/// connection idle, and the owner's completion waited behind it (here,
/// until its `lock_timeout`: refused). The duplicate polls instead.
#[tokio::test]
async fn pg_a_duplicate_waiting_on_a_connection_left_inside_a_written_transaction_does_not_hold_the_record(
) {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    let owner_pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            pg_url()
                .parse::<sqlx::postgres::PgConnectOptions>()
                .expect("url")
                .options([("lock_timeout", "2s")]),
        )
        .await
        .expect("pool");
    let owner = PgStore::from_pool(owner_pool).await.expect("store");
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let identity =
        Identity::new(fresh_tenant(), "pool_state.left_open_wait", "k").expect("identity");
    let (f, token) = (fp("request"), OwnerToken::new());
    assert_eq!(
        owner
            .reserve(request(&identity, &f, &token))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN").await.expect("begin");
    conn.execute("SELECT txid_current()").await.expect("write");
    drop(conn);
    dirty
        .wait_for_change(&identity, Duration::from_secs(1), 0)
        .await;
    assert_eq!(
        owner
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("the owner's completion is not held up by the duplicate's wait"),
        Fenced::Written
    );
    pool.close().await;
}

/// A connection of the shared pool left inside a transaction that failed (a
/// plain `BEGIN`, a statement that failed, and the early return its error
/// took): PostgreSQL refuses every statement there until the transaction
/// ends, and the connection still answers the pool's ping. Every store call
/// the pool handed it failed, for as long as the pool kept it; the store
/// closes it (rolling that transaction back) and takes another, as it does a
/// connection left inside a transaction that wrote.
#[tokio::test]
async fn pg_a_connection_left_inside_a_failed_transaction_is_replaced() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let identity = Identity::new(fresh_tenant(), "pool_state.left_failed", "k").expect("identity");
    let (f, token) = (fp("request"), OwnerToken::new());
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN").await.expect("begin");
    conn.execute("SELECT 1/0")
        .await
        .expect_err("a failed statement");
    drop(conn);
    assert_eq!(
        dirty
            .reserve(request(&identity, &f, &token))
            .await
            .expect("the call is served on another connection"),
        Reservation::FRESH
    );
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN").await.expect("begin");
    conn.execute("SELECT 1/0")
        .await
        .expect_err("a failed statement");
    drop(conn);
    assert_eq!(
        dirty
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("the completion is written on another connection"),
        Fenced::Written
    );
    assert_eq!(
        clean
            .reserve(request(&identity, &f, &OwnerToken::new()))
            .await
            .expect("reserve"),
        Reservation::Completed(ok(b"7"))
    );
    pool.close().await;
}

/// The check that keeps the store's fenced writes out of a transaction left
/// open (a transaction id already assigned) must be made before the write
/// and not again: a completion that waits for the row while another
/// transaction updates it (a waiting duplicate's mark, committed) is checked
/// again on the row's new version, after its own update attempt has been
/// given a transaction id; asked again then, the check matched nothing, and
/// the owner was told its lease was lost.
#[tokio::test]
async fn pg_a_completion_that_waited_behind_an_update_of_its_row_is_written() {
    // A database of its own: the test updates the record by hand.
    in_own_database(|url| async move {
        let owner = PgStore::connect(&url).await.expect("store");
        let identity =
            Identity::new(fresh_tenant(), "pool_state.waited_complete", "k").expect("identity");
        let (f, token) = (fp("request"), OwnerToken::new());
        assert_eq!(
            owner
                .reserve(request(&identity, &f, &token))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        let mut holder = sqlx::PgConnection::connect(&url).await.expect("connect");
        holder.execute("BEGIN").await.expect("begin");
        holder
            .execute("UPDATE idempotency_records SET waiting = TRUE")
            .await
            .expect("a mark, uncommitted");
        let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut holder)
            .await
            .expect("pid");
        let completing = {
            let (owner, identity, token) = (owner.clone(), identity.clone(), token.clone());
            tokio::spawn(async move {
                owner
                    .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
                    .await
            })
        };
        // Until the completion waits for the holder's row lock.
        let mut observer = sqlx::PgConnection::connect(&url).await.expect("connect");
        let mut blocked = false;
        for _ in 0..500 {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(holder_pid)
            .fetch_one(&mut observer)
            .await
            .expect("blocked backends");
            if waiting > 0 {
                blocked = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(blocked, "the completion never waited for the row");
        holder.execute("COMMIT").await.expect("commit");
        assert_eq!(
            completing.await.expect("task").expect("complete"),
            Fenced::Written,
            "the owner's completion is written"
        );
        drop((holder, observer));
        owner.pool().close().await;
    })
    .await;
}

/// A TEMP table named like the store's, created on a connection of the
/// shared pool as a copy of its definition (`LIKE … INCLUDING ALL`, a
/// scratch copy for a report or a test fixture). PostgreSQL looks for a
/// table in `pg_temp` before any schema of the `search_path`: the store's
/// statements, and the functions they call, write to that session's
/// private copy, which no other session sees and which is gone when the
/// connection closes.
#[tokio::test]
async fn pg_a_temp_table_named_like_the_stores_does_not_take_the_records() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    pool.execute(
        "CREATE TEMP TABLE idempotency_records (LIKE public.idempotency_records INCLUDING ALL)",
    )
    .await
    .expect("temp table");
    let identity = Identity::new(fresh_tenant(), "pool_state.temp", "k").expect("identity");
    a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
}

/// The same TEMP table on the connection the store opens on: the store
/// cannot tell which table its records belong in, and refuses to open
/// rather than pick the session's private copy.
#[tokio::test]
async fn pg_a_store_does_not_open_on_a_connection_whose_temp_table_hides_the_records() {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&pg_url())
        .await
        .expect("pool");
    pool.execute(
        "CREATE TEMP TABLE idempotency_records (LIKE public.idempotency_records INCLUDING ALL)",
    )
    .await
    .expect("temp table");
    let refused = PgStore::from_pool(pool.clone())
        .await
        .expect_err("a store on the TEMP table");
    assert!(refused.to_string().contains("TEMP table"), "{refused}");
    pool.close().await;
}

/// A database of the test's own (schema experiments), dropped at the end.
struct OwnDatabase {
    admin: sqlx::PgConnection,
    name: String,
    url: String,
}

impl OwnDatabase {
    async fn create() -> Option<Self> {
        Self::create_with("").await
    }

    /// With `how` after `CREATE DATABASE name` (an encoding, say).
    async fn create_with(how: &str) -> Option<Self> {
        let admin_url = pg_url();
        let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url).await else {
            eprintln!("SKIPPED: PostgreSQL unreachable");
            return None;
        };
        let name = format!("pg_pool_state_{}", uuid::Uuid::new_v4().simple());
        admin
            .execute(format!("CREATE DATABASE {name} {how}").as_str())
            .await
            .expect("create database");
        let url = match admin_url.rsplit_once('/') {
            Some((base, _)) => format!("{base}/{name}"),
            None => panic!("url {admin_url}"),
        };
        Some(OwnDatabase { admin, name, url })
    }

    async fn drop(mut self) {
        let _ = self
            .admin
            .execute(format!("DROP DATABASE {} WITH (FORCE)", self.name).as_str())
            .await;
    }
}

/// `SET search_path` left on a connection of the shared pool by code that
/// switches schemas per request (schema-per-tenant), in a database where
/// another schema has the store's tables too (a store opened for that
/// schema, `PgConnectOptions::options([("search_path", "shadow")])`). The
/// store's statements name the table unqualified: the record lands in the
/// other schema's table, where the store's own sessions never look.
#[tokio::test]
async fn pg_a_search_path_left_on_the_pool_does_not_move_the_records() {
    let Some(db) = OwnDatabase::create().await else {
        return;
    };
    let mut setup = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    setup.execute("CREATE SCHEMA shadow").await.expect("schema");
    let shadow_options = db
        .url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .expect("url")
        .options([("search_path", "shadow")]);
    let shadow_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(shadow_options)
        .await
        .expect("pool");
    let shadow = PgStore::from_pool(shadow_pool).await.expect("shadow store");

    let url = db.url.clone();
    // Run apart, so the database is dropped whatever the check answers.
    let checked = tokio::spawn(async move {
        let (pool, dirty) = pg_pool_of_one(&url).await;
        let clean = PgStore::connect(&url).await.expect("clean store");
        let identity =
            Identity::new(fresh_tenant(), "pool_state.search_path", "k").expect("identity");
        pool.execute("SET search_path = shadow, public")
            .await
            .expect("set the search_path");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
        pool.close().await;
    })
    .await;
    drop((setup, shadow));
    db.drop().await;
    if let Err(e) = checked {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// A store opened on a connection other code had left with another
/// `search_path` (a shared pool of one) names the table it found there. A
/// completion handed to the store's worker (a call dropped while recording)
/// goes out on the worker's own connections, opened with the pool's
/// options, whose `search_path` finds another table: it matched nothing,
/// the record stayed in progress, and after the lease a retry would run the
/// body again. The worker names the store's schema too.
#[tokio::test]
async fn pg_a_completion_handed_to_the_worker_lands_where_the_store_reserved() {
    let Some(db) = OwnDatabase::create().await else {
        return;
    };
    let mut setup = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    setup.execute("CREATE SCHEMA shadow").await.expect("schema");
    let shadow_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(with_search_path(&db.url, "shadow"))
        .await
        .expect("pool");
    let shadow = PgStore::from_pool(shadow_pool).await.expect("shadow store");
    let public = PgStore::connect(&db.url).await.expect("public store");

    let url = db.url.clone();
    // Run apart, so the database is dropped whatever the check answers.
    let checked = tokio::spawn(async move {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .expect("pool");
        pool.execute("SET search_path = shadow, public")
            .await
            .expect("set the search_path");
        let store = PgStore::from_pool(pool.clone()).await.expect("store");
        let identity = Identity::new(fresh_tenant(), "pool_state.worker", "k").expect("identity");
        let (f, token) = (fp("request"), OwnerToken::new());
        assert_eq!(
            store
                .reserve(request(&identity, &f, &token))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        store.complete_detached(Completion::by_body(&identity, &token, &ok(b"7"), LONG));
        assert_eq!(
            store.finish_background_work(Duration::from_secs(30)).await,
            0,
            "the worker finished"
        );
        let seen = store.fetch(&identity).await.expect("fetch");
        assert!(
            seen.as_ref()
                .is_some_and(|r| r.state == RecordState::Complete),
            "the worker completed the record the store reserved (found {seen:?})"
        );
        pool.close().await;
    })
    .await;
    drop((setup, shadow, public));
    db.drop().await;
    if let Err(e) = checked {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// `url`'s connect options with `search_path` set at connect time, as an
/// application chooses the schema its store lives in.
fn with_search_path(url: &str, search_path: &str) -> sqlx::postgres::PgConnectOptions {
    url.parse::<sqlx::postgres::PgConnectOptions>()
        .expect("url")
        .options([("search_path", search_path)])
}

/// A pool of one connection on `options`, a store on it, and a clean store
/// (a pool of its own) in the same schema.
async fn pg_schema_stores(
    options: sqlx::postgres::PgConnectOptions,
) -> (sqlx::PgPool, PgStore, PgStore) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
        .expect("pool");
    let dirty = PgStore::from_pool(pool.clone()).await.expect("store");
    let clean = PgStore::from_pool(
        PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .expect("pool"),
    )
    .await
    .expect("clean store");
    (pool, dirty, clean)
}

/// Runs `check` on the URL of a database of its own, dropped whatever the
/// check answers.
pub(crate) async fn in_own_database<F, Fut>(check: F)
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    in_own_database_made(check, "").await;
}

/// [`in_own_database`], the database made with `how` (an encoding, say).
async fn in_own_database_made<F, Fut>(check: F, how: &str)
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let Some(db) = OwnDatabase::create_with(how).await else {
        return;
    };
    let checked = tokio::spawn(check(db.url.clone())).await;
    db.drop().await;
    if let Err(e) = checked {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// A store in a schema whose name must be quoted (capitals, `MyApp`, chosen
/// with `search_path = "MyApp"` in the connect options): it opens, and its
/// functions keep to that schema when a connection of its pool is left with
/// a TEMP table named like its table.
#[tokio::test]
async fn pg_a_store_opens_in_a_schema_whose_name_must_be_quoted() {
    in_own_database(|url| async move {
        let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
        setup
            .execute("CREATE SCHEMA \"MyApp\"")
            .await
            .expect("schema");
        let (pool, dirty, clean) = pg_schema_stores(with_search_path(&url, "\"MyApp\"")).await;
        pool.execute(
            "CREATE TEMP TABLE idempotency_records \
             (LIKE \"MyApp\".idempotency_records INCLUDING ALL)",
        )
        .await
        .expect("temp table");
        let identity = Identity::new(fresh_tenant(), "pool_state.quoted", "k").expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
        pool.close().await;
    })
    .await;
}

/// Two stores in one database, in schemas whose names differ only in case
/// (`myapp` and `"MyApp"`): opening the second must not point the first's
/// functions at the second's table (its name read as an identifier is the
/// first's). Each store's call is then seen by its own schema's stores.
#[tokio::test]
async fn pg_stores_in_schemas_named_alike_but_for_case_keep_their_own_records() {
    in_own_database(|url| async move {
        let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
        setup
            .execute("CREATE SCHEMA myapp; CREATE SCHEMA \"MyApp\"")
            .await
            .expect("schemas");
        let (lower_pool, lower, lower_clean) =
            pg_schema_stores(with_search_path(&url, "myapp")).await;
        let (upper_pool, upper, upper_clean) =
            pg_schema_stores(with_search_path(&url, "\"MyApp\"")).await;
        let identity = Identity::new(fresh_tenant(), "pool_state.case", "k").expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&lower, &lower_clean, &identity).await;
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&upper, &upper_clean, &identity).await;
        lower_pool.close().await;
        upper_pool.close().await;
    })
    .await;
}

/// A database migrated in `public` by the previous build (without 0009: its
/// history row gone, no function pinned), and then a schema `app` made, which
/// the application puts in front of `public` in its `search_path`.
async fn previous_builds_database_then_a_schema_in_front(url: &str) {
    let first = PgStore::connect(url).await.expect("store");
    let mut setup = sqlx::PgConnection::connect(url).await.expect("connect");
    setup
        .execute(
            "DELETE FROM idempotency_schema_migrations WHERE version = 9;
             DO $$ DECLARE f REGPROCEDURE; BEGIN
                 FOR f IN SELECT oid::REGPROCEDURE FROM pg_proc
                           WHERE proname LIKE 'idempotency%' AND proconfig IS NOT NULL LOOP
                     EXECUTE format('ALTER FUNCTION %s RESET ALL', f);
                 END LOOP;
             END $$;
             CREATE SCHEMA app;",
        )
        .await
        .expect("the previous build's database, and a schema of the application's");
    drop(first);
}

/// A database the previous build migrated (without 0009) while the
/// search_path's first schema did not exist: its table and functions are in
/// `public`. The application now puts a schema of its own first
/// (`search_path = app,public`, `app` holding none of the store's tables;
/// or a `"$user"` schema created later). The store finds its table in
/// `public` and names it there; the functions it calls must keep to
/// `public` too, or a TEMP table left on a connection of the pool still
/// takes the reservation.
#[tokio::test]
async fn pg_functions_of_a_table_further_down_the_search_path_keep_to_its_schema() {
    in_own_database(|url| async move {
        previous_builds_database_then_a_schema_in_front(&url).await;
        let (pool, dirty, clean) = pg_schema_stores(with_search_path(&url, "app,public")).await;
        pool.execute(
            "CREATE TEMP TABLE idempotency_records \
             (LIKE public.idempotency_records INCLUDING ALL)",
        )
        .await
        .expect("temp table");
        let identity =
            Identity::new(fresh_tenant(), "pool_state.further_down", "k").expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
        pool.close().await;
    })
    .await;
}

/// The same database: a call recorded before the deploy, then the new build
/// opened by two processes with `search_path = app,public` (the first applies
/// the pending migration). Each must find the records where they are: a
/// migration run under that search_path must not start a second, empty store
/// in `app` that the next process opens, where a retry of the recorded call
/// finds nothing and runs its body again.
#[tokio::test]
async fn pg_a_migration_under_a_schema_put_in_front_keeps_the_recorded_calls() {
    in_own_database(|url| async move {
        let before = PgStore::connect(&url).await.expect("store");
        let identity = Identity::new(fresh_tenant(), "pool_state.in_front", "k").expect("identity");
        let f = fp("request");
        let token = OwnerToken::new();
        assert_eq!(
            before
                .reserve(request(&identity, &f, &token))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        assert_eq!(
            before
                .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
                .await
                .expect("complete"),
            Fenced::Written
        );
        drop(before);
        previous_builds_database_then_a_schema_in_front(&url).await;
        for process in ["migrates", "opens next"] {
            let store = PgStore::from_pool(
                PgPoolOptions::new()
                    .max_connections(1)
                    .connect_with(with_search_path(&url, "app,public"))
                    .await
                    .expect("pool"),
            )
            .await
            .expect("store");
            let retry = OwnerToken::new();
            assert_eq!(
                store
                    .reserve(request(&identity, &f, &retry))
                    .await
                    .expect("reserve"),
                Reservation::Completed(ok(b"7")),
                "the process that {process} replays the call recorded before"
            );
        }
    })
    .await;
}

/// Transactional mode runs its statements on the caller's connection, by the
/// caller's `search_path`: a caller whose path names another schema holding
/// a store of its own (tables and functions, migrated there) reserves and
/// records there, and the functions it calls keep to that schema too. The
/// record is that schema's store's, never `public`'s.
#[tokio::test]
async fn pg_a_transactional_call_keeps_to_the_schema_its_search_path_names() {
    in_own_database(|url| async move {
        let public = PgStore::connect(&url).await.expect("store in public");
        let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
        setup.execute("CREATE SCHEMA b").await.expect("schema");
        let (pool, b, _) = pg_schema_stores(with_search_path(&url, "b")).await;
        let identity =
            Identity::new(fresh_tenant(), "pool_state.tx_schema", "k").expect("identity");
        let f = fp("request");
        let token = OwnerToken::new();
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
        conn.execute("SET search_path = b, public")
            .await
            .expect("search_path");
        let mut tx = conn.begin().await.expect("begin");
        assert_eq!(
            tx.reserve_in_transaction(request(&identity, &f, &token), Duration::from_millis(100))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        assert_eq!(
            tx.complete_in_transaction(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
                .await
                .expect("complete"),
            Fenced::Written
        );
        tx.commit().await.expect("commit");
        let retry = OwnerToken::new();
        assert_eq!(
            b.reserve(request(&identity, &f, &retry))
                .await
                .expect("reserve"),
            Reservation::Completed(ok(b"7")),
            "the schema's own store replays"
        );
        assert!(public.fetch(&identity).await.expect("fetch").is_none());
        pool.close().await;
    })
    .await;
}

/// A database whose encoding is neither UTF8 nor SQL_ASCII (`WIN1252`): a
/// clean connection's text (UTF-8, as sqlx sends it) is converted into it,
/// `café` stored as 4 bytes. A connection of the shared pool left in
/// `client_encoding = SQL_ASCII` has nothing converted: the UTF-8 bytes are
/// stored as they are, `cafÃ©`, a key a clean connection never looks for.
/// `SQL_ASCII` on the client side is faithful in a UTF8 database alone.
#[tokio::test]
async fn pg_a_session_left_in_sql_ascii_on_a_win1252_database_writes_under_the_callers_identity() {
    in_own_database_made(
        |url| async move {
            let clean = PgStore::connect(&url).await.expect("store");
            let (pool, dirty) = pg_pool_of_one(&url).await;
            pool.execute("SET client_encoding = 'SQL_ASCII'")
                .await
                .expect("set the encoding");
            let identity =
                Identity::new(fresh_tenant(), "pool_state.sql_ascii", "café").expect("identity");
            a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
            pool.close().await;
        },
        "ENCODING 'WIN1252' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    .await;
}

/// A LATIN1 database: the store opens (the server converts the whole text of
/// a migration, comments included, and migration 0008 has a `…` in a
/// comment, which LATIN1 cannot hold) and a call with an accented key is
/// replayed.
#[tokio::test]
async fn pg_a_store_opens_in_a_latin1_database() {
    in_own_database_made(
        |url| async move {
            let store = PgStore::connect(&url)
                .await
                .expect("a store in a LATIN1 database");
            let clean = PgStore::connect(&url).await.expect("store");
            let identity =
                Identity::new(fresh_tenant(), "pool_state.latin1_db", "café").expect("identity");
            a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&store, &clean, &identity).await;
        },
        "ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    .await;
}

/// A fresh SQLite database file (removed by [`remove`]).
fn sqlite_path() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join("idempotent-pool-state-tests");
    std::fs::create_dir_all(&dir).expect("create the temp dir");
    dir.join(format!("{}.db", uuid::Uuid::new_v4().simple()))
}

fn remove(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// A SQLite pool of one connection on `path`, a store on it, and a clean
/// store (a pool of its own) on the same file.
async fn sqlite_pool_of_one(
    path: &std::path::Path,
) -> (sqlx::SqlitePool, SqliteStore, SqliteStore) {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5));
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .expect("pool");
    let store = SqliteStore::from_pool(pool.clone()).await.expect("store");
    let clean = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("clean store");
    (pool, store, clean)
}

/// A TEMP table named like the store's, created on a connection of the
/// shared pool with the same definition (a copy for a report, a test
/// fixture). SQLite resolves an unqualified name to `temp` before `main`:
/// the store's writes on that connection land in the connection's private
/// copy, gone when it closes, and no other connection sees them.
#[tokio::test]
async fn sqlite_a_temp_table_named_like_the_stores_does_not_take_the_records() {
    let path = sqlite_path();
    let (pool, dirty, clean) = sqlite_pool_of_one(&path).await;
    let ddl: String = sqlx::query_scalar(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'idempotency_records'",
    )
    .fetch_one(&pool)
    .await
    .expect("the table's definition");
    let temp = ddl.replacen("CREATE TABLE", "CREATE TEMP TABLE", 1);
    pool.execute(temp.as_str()).await.expect("temp table");
    let identity = Identity::new(fresh_tenant(), "pool_state.temp", "k").expect("identity");
    a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
    drop((pool, dirty, clean));
    remove(&path);
}

/// `PRAGMA read_uncommitted = 1` left on a connection of a shared-cache
/// pool (an in-memory database shared by its connections, as sqlx opens
/// `sqlite::memory:`): reads on that connection skip the table locks of the
/// shared cache and see other connections' uncommitted writes. A
/// transactional-mode owner has reserved and recorded its result in a
/// transaction it has not committed; a store-mode duplicate on the dirty
/// connection must not replay that result, which the owner then rolls back
/// (the body's effects with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_read_uncommitted_on_a_shared_cache_does_not_replay_an_uncommitted_result() {
    use idempotent_runtime::TransactionalConnection;
    let url = format!(
        "sqlite:file:pool_state_{}?mode=memory&cache=shared",
        uuid::Uuid::new_v4().simple()
    );
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .expect("pool");
    let store = SqliteStore::from_pool(pool.clone()).await.expect("store");
    let identity = Identity::new(fresh_tenant(), "pool_state.uncommitted", "k").expect("identity");
    let f = fp("request");

    let mut owner = pool.acquire().await.expect("owner's connection");
    let mut dirty = pool.acquire().await.expect("the other connection");
    dirty
        .execute("PRAGMA read_uncommitted = 1")
        .await
        .expect("read_uncommitted");
    drop(dirty);

    owner.execute("BEGIN IMMEDIATE").await.expect("begin");
    let token = OwnerToken::new();
    assert_eq!(
        TransactionalConnection::reserve_in_transaction(
            &mut *owner,
            request(&identity, &f, &token),
            Duration::from_secs(5)
        )
        .await
        .expect("the owner reserves"),
        Reservation::FRESH
    );
    assert_eq!(
        TransactionalConnection::complete_in_transaction(
            &mut *owner,
            Completion::by_body(&identity, &token, &ok(b"7"), LONG)
        )
        .await
        .expect("the owner records"),
        Fenced::Written
    );

    // The duplicate is handed the dirty connection (the owner holds the
    // other). A clean one waits for the owner's table lock (without a bound
    // in sqlx, see `SqliteStore::from_pool`): the bound keeps such a wait
    // from hanging the test, and is not what is checked.
    let retry = OwnerToken::new();
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        store.reserve(request(&identity, &f, &retry)),
    )
    .await;
    owner.execute("ROLLBACK").await.expect("rollback");
    match &answer {
        Ok(Ok(Reservation::Completed(replayed))) => panic!(
            "the duplicate replayed {replayed:?}, a result of a transaction that then rolled back"
        ),
        Ok(Err(e)) => assert!(
            e.to_string().contains("read_uncommitted"),
            "a refusal says why: {e}"
        ),
        _ => {}
    }
    drop(owner);
    assert!(
        store.fetch(&identity).await.expect("fetch").is_none(),
        "the owner's rollback took its record"
    );
}

/// Session settings code sharing a PostgreSQL pool may leave on a connection
/// that must not change where or how the store's records are written: the
/// clock is read as milliseconds since the epoch (time zone and date styles
/// do not enter), results are binary (`bytea_output`), statements hold no
/// backslash escapes (`standard_conforming_strings`), a store-mode write is
/// its own transaction (sent again on a serialization failure), and
/// `session_replication_role = replica` only silences the trigger that wakes
/// waiting duplicates, who also look on their own. A read-only default is
/// refused with nothing written.
#[tokio::test]
async fn pg_session_settings_left_on_the_pool_change_no_record() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    for setting in [
        "SET TIME ZONE 'Pacific/Kiritimati'",
        "SET DateStyle = 'SQL, DMY'",
        "SET IntervalStyle = 'sql_standard'",
        "SET standard_conforming_strings = off",
        "SET bytea_output = 'escape'",
        "SET extra_float_digits = -15",
        "SET default_transaction_isolation = 'serializable'",
        "SET default_transaction_isolation = 'repeatable read'",
        "SET default_transaction_read_only = on",
        "SET session_replication_role = replica",
        "SET synchronous_commit = off",
        "SET application_name = 'somebody else'",
    ] {
        let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
        pool.execute(setting).await.expect(setting);
        let identity =
            Identity::new(fresh_tenant(), "pool_state.settings", setting).expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
        pool.close().await;
    }
}

/// The same for pragmas code sharing a SQLite pool may leave on a
/// connection. `query_only` is refused with nothing written.
#[tokio::test]
async fn sqlite_pragmas_left_on_the_pool_change_no_record() {
    for pragma in [
        "PRAGMA query_only = 1",
        "PRAGMA busy_timeout = 0",
        "PRAGMA recursive_triggers = 1",
        "PRAGMA foreign_keys = 1",
        "PRAGMA temp_store = MEMORY",
        "PRAGMA synchronous = OFF",
        "PRAGMA read_uncommitted = 1",
        "PRAGMA case_sensitive_like = 1",
        "PRAGMA reverse_unordered_selects = 1",
    ] {
        let path = sqlite_path();
        let (pool, dirty, clean) = sqlite_pool_of_one(&path).await;
        pool.execute(pragma).await.expect(pragma);
        let identity =
            Identity::new(fresh_tenant(), "pool_state.pragmas", pragma).expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
        drop((dirty, clean));
        pool.close().await;
        remove(&path);
    }
}

/// A MariaDB/MySQL pool of one connection on `url`, and a store on it.
async fn mysql_pool_of_one(url: &str) -> (sqlx::MySqlPool, MySqlStore) {
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    (pool, store)
}

/// Session state code sharing a MariaDB/MySQL pool may leave on a connection
/// (each row one or more statements, run on the pool's one connection) that
/// must not change where or how the store's records are written. The
/// store's statements bind the identity as bytes and read times as
/// milliseconds (`div_precision_increment` only rounds a millisecond),
/// quote nothing (`ANSI_QUOTES`, `NO_BACKSLASH_ESCAPES`, `ORACLE`), set each
/// assignment from the row as read (`SIMULTANEOUS_ASSIGNMENT`), set the one
/// session variable they read (`@idempotency_existed`) in the same
/// statement, run each write in autocommit (SERIALIZABLE reads lock
/// nothing there), and bound their own lock waits. `sql_select_limit`
/// leaves `RETURNING` alone. A read-only session, and `LOCK TABLES` of
/// other tables, are refused with nothing written.
#[tokio::test]
async fn mysql_session_state_left_on_the_pool_changes_no_record() {
    let Some(clean) = mysql_store_or_skip().await else {
        return;
    };
    let rows: &[&[&str]] = &[
        &["SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"],
        &["SET SESSION TRANSACTION READ ONLY"],
        &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',NO_BACKSLASH_ESCAPES')"],
        &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',PAD_CHAR_TO_FULL_LENGTH')"],
        &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',ANSI_QUOTES')"],
        &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',NO_ZERO_DATE,NO_ZERO_IN_DATE')"],
        &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',SIMULTANEOUS_ASSIGNMENT')"],
        &["SET SESSION sql_mode = 'ORACLE'"],
        &["SET SESSION sql_mode = 'ANSI'"],
        &["SET SESSION sql_mode = ''"],
        &["SET SESSION sql_mode = ''", "BEGIN"],
        &["SET SESSION sql_mode = 'TRADITIONAL'"],
        &["SET SESSION sql_mode = 'HIGH_NOT_PRECEDENCE,PIPES_AS_CONCAT,NO_UNSIGNED_SUBTRACTION'"],
        &[
            "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "SET SESSION autocommit = 0",
        ],
        &[
            "SET SESSION autocommit = 0",
            "SET SESSION completion_type = 'RELEASE'",
        ],
        &["SET SESSION max_statement_time = 10"],
        &["SET SESSION innodb_lock_wait_timeout = 1"],
        &["SET SESSION lock_wait_timeout = 1"],
        &["SET SESSION sql_select_limit = 0"],
        &["SET SESSION collation_connection = 'utf8mb4_bin'"],
        &["SET SESSION div_precision_increment = 0"],
        &["SET SESSION sql_safe_updates = 1"],
        &["SET SESSION max_join_size = 1"],
        &["SET SESSION unique_checks = 0"],
        &["SET SESSION foreign_key_checks = 0"],
        &["SET SESSION big_tables = 1"],
        &["SET SESSION max_sort_length = 64"],
        &["SET SESSION completion_type = 'CHAIN'"],
        &["SET SESSION session_track_state_change = ON"],
        &["SET SESSION session_track_system_variables = '*'"],
        &["SET SESSION session_track_transaction_info = 'CHARACTERISTICS'"],
        &["SET @idempotency_existed = 1"],
        &["SET SESSION max_error_count = 0"],
        &["LOCK TABLES idempotency_schema_migrations READ"],
        &["XA START 'pool_state'"],
    ];
    for statements in rows {
        let (pool, dirty) = mysql_pool_of_one(&mysql_url()).await;
        let mut conn = pool.acquire().await.expect("connection");
        for statement in *statements {
            // As text: `XA` is not taken as a prepared statement.
            conn.execute(sqlx::raw_sql(statement))
                .await
                .expect(statement);
        }
        drop(conn);
        let identity = Identity::new(fresh_tenant(), "pool_state.mysql", statements.join("; "))
            .expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
        pool.close().await;
    }
}

/// `USE another_database` left on a connection of the shared pool (code
/// that switches databases per tenant or per report), on a server where that
/// database has the store's tables too (another service's store, a
/// database per tenant). The store's statements named the table and the
/// procedure without a database: the reservation and the completion went to
/// the other database's table, where the store's own connections never
/// look, and a retry there ran the body again.
#[tokio::test]
async fn mysql_a_database_chosen_with_use_on_the_pool_does_not_move_the_records() {
    let Some(clean) = mysql_store_or_skip().await else {
        return;
    };
    let other = mysql_create_database(&clean, "pool_state_use").await;
    let other_url = mysql_url_of(&mysql_url(), &other);
    let use_other = format!("USE `{other}`");
    let checked = tokio::spawn(async move {
        // The other database gets the store's schema (a store opened there).
        let elsewhere = MySqlStore::connect(&other_url)
            .await
            .expect("the other store");
        let (pool, dirty) = mysql_pool_of_one(&mysql_url()).await;
        let clean = MySqlStore::connect(&mysql_url())
            .await
            .expect("clean store");
        pool.execute(use_other.as_str()).await.expect("use");
        let identity = Identity::new(fresh_tenant(), "pool_state.use", "k").expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
        pool.close().await;
        assert!(
            elsewhere.fetch(&identity).await.expect("fetch").is_none(),
            "nothing was written to the other database"
        );
    })
    .await;
    let _ = clean
        .pool()
        .execute(format!("DROP DATABASE `{other}`").as_str())
        .await;
    if let Err(e) = checked {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// A TEMPORARY table named like the store's, created on a connection of the
/// shared pool with its definition (a scratch copy for a report, a test
/// fixture stubbing the store's table). MariaDB and MySQL resolve a table
/// name to the session's temporary table first, even qualified by its
/// database, in plain statements and in stored procedures alike: the
/// store's writes on that connection land in the connection's private copy,
/// gone when it closes, and no other connection sees them. (A view does
/// not see a session's temporary tables: `INSERT … ON DUPLICATE KEY UPDATE
/// … RETURNING` through a view of the table writes the table itself on
/// MariaDB 10.11, but the store's statements and procedures naming such a
/// view needs a migration.)
#[tokio::test]
#[ignore = "not fixed: a temporary table shadows the store's table in every statement; writing through a view would need a migration"]
async fn mysql_a_temporary_table_named_like_the_stores_does_not_take_the_records() {
    let Some(clean) = mysql_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = mysql_pool_of_one(&mysql_url()).await;
    let (_, ddl): (String, String) = sqlx::query_as("SHOW CREATE TABLE idempotency_records")
        .fetch_one(&pool)
        .await
        .expect("the table's definition");
    let temp = ddl.replacen("CREATE TABLE", "CREATE TEMPORARY TABLE", 1);
    pool.execute(temp.as_str()).await.expect("temporary table");
    let identity = Identity::new(fresh_tenant(), "pool_state.temp", "k").expect("identity");
    a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&dirty, &clean, &identity).await;
    pool.close().await;
}

/// A transactional-mode charge on MariaDB/MySQL that counts its runs.
#[idempotent_runtime::idempotent(scope = "pool_state.mysql_tx", key = key, tenant = tenant,
                                 tx = tx, skip(runs))]
async fn mysql_counted_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
    runs: &std::sync::atomic::AtomicUsize,
) -> Result<u64, idempotent_runtime::Error> {
    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Ok(7)
}

/// `SET max_error_count = 0` left on a connection of the shared pool (code
/// that keeps no warnings): the server then records no condition for a
/// `SELECT … INTO` that finds no row, so the reservation procedure's `NOT
/// FOUND` handler never ran, and a key it did not find looked found with
/// every column `NULL`; it tried to take that record over fifty times and
/// refused the call ("the record kept changing under this reservation").
/// Every transactional call of a fresh key on such a connection was
/// refused (and on MySQL 8, whose store reserves a fresh key through the
/// procedure, every store-mode one too). A call is answered, and its retry
/// replays.
#[tokio::test]
async fn mysql_a_transactional_call_on_a_session_keeping_no_warnings_is_answered() {
    let Some(_admin) = mysql_store_or_skip().await else {
        return;
    };
    let (pool, _store) = mysql_pool_of_one(&mysql_url()).await;
    pool.execute("SET SESSION max_error_count = 0")
        .await
        .expect("max_error_count");
    let (tenant, runs) = (fresh_tenant(), std::sync::atomic::AtomicUsize::new(0));
    for round in 1..=2 {
        let mut tx = pool.begin().await.expect("begin");
        let answer = mysql_counted_charge(&mut tx, &tenant, "k", &runs).await;
        tx.commit().await.expect("commit");
        assert_eq!(answer.expect("answered"), 7, "round {round}");
    }
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the body ran once"
    );
    pool.close().await;
}

/// Rule 19 on MariaDB/MySQL: `SET sql_select_limit = 1` left on a connection
/// of the shared pool (the `--safe-updates` habit, with a small limit: a
/// console's "show me one row" default). Every `SELECT` without a `LIMIT`
/// of its own returns at most that many rows, so the audit's counts per
/// scope came back with one scope and left out the others (orphans, stuck
/// leases) without a word.
#[tokio::test]
async fn mysql_the_audit_counts_every_scope_whatever_select_limit_the_pool_was_left_with() {
    let Some(clean) = mysql_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let scopes = [
        format!("pool_state.audit_{tenant}_a"),
        format!("pool_state.audit_{tenant}_b"),
    ];
    let tokens = [OwnerToken::new(), OwnerToken::new()];
    let identities: Vec<Identity> = scopes
        .iter()
        .map(|scope| Identity::new(&tenant, scope.as_str(), "k").expect("identity"))
        .collect();
    let f = fp("request");
    for (identity, token) in identities.iter().zip(&tokens) {
        assert_eq!(
            clean
                .reserve(request(identity, &f, token))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
    }
    let (pool, dirty) = mysql_pool_of_one(&mysql_url()).await;
    pool.execute("SET SESSION sql_select_limit = 1")
        .await
        .expect("sql_select_limit");
    let stats = dirty.scope_stats().await.expect("scope stats");
    for (identity, token) in identities.iter().zip(&tokens) {
        assert_eq!(
            clean.release(identity, token).await.expect("release"),
            Fenced::Written
        );
    }
    pool.close().await;
    for scope in &scopes {
        assert!(
            stats
                .iter()
                .any(|s| &s.scope == scope && s.in_progress == 1),
            "the audit counts {scope} (it answered {} scopes)",
            stats.len()
        );
    }
}

/// `SET autocommit = 0` left on a connection of the shared pool (code that
/// manages its transactions by hand, an ORM's default): every statement
/// there opens a transaction that lasts until a `COMMIT`, and under
/// REPEATABLE READ its reads see the snapshot its first read took. The
/// store's record reads (`Store::fetch`: what the CLI shows, what a
/// consumer is told of the record that refused a mismatch) and the audit's
/// counts then answered from the snapshot their first read took on that
/// connection: a record completed since was still absent, or still in
/// progress.
#[tokio::test]
async fn mysql_reads_on_a_session_with_autocommit_off_see_the_latest_records() {
    let Some(clean) = mysql_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = mysql_pool_of_one(&mysql_url()).await;
    pool.execute("SET SESSION autocommit = 0")
        .await
        .expect("autocommit");
    let tenant = fresh_tenant();
    let scope = format!("pool_state.autocommit_off_{tenant}");
    let identity = Identity::new(&tenant, scope.as_str(), "k").expect("identity");
    assert!(dirty.fetch(&identity).await.expect("fetch").is_none());
    assert!(!dirty
        .scope_stats()
        .await
        .expect("scope stats")
        .iter()
        .any(|s| s.scope == scope));
    let (f, token) = (fp("request"), OwnerToken::new());
    assert_eq!(
        clean
            .reserve(request(&identity, &f, &token))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    assert_eq!(
        clean
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
    let seen = dirty.fetch(&identity).await.expect("fetch");
    let counted = dirty.scope_stats().await.expect("scope stats");
    pool.close().await;
    assert!(
        seen.as_ref()
            .is_some_and(|r| r.state == RecordState::Complete),
        "the read sees the record completed since (found {seen:?})"
    );
    assert!(
        counted.iter().any(|s| s.scope == scope && s.complete == 1),
        "the audit counts the record completed since"
    );
}

/// The same in transactional mode: a caller's transaction on a connection
/// of the shared pool that other code left in some state (each row one or
/// more statements). The call is answered and its retry replays, the body
/// having run once. (`sql_select_limit = 0` made every `SELECT` of the
/// session answer no row, the store's check of the session included: every
/// call was refused with "no rows returned".)
#[tokio::test]
async fn mysql_transactional_calls_on_session_state_left_on_the_pool_run_the_body_once() {
    let Some(_admin) = mysql_store_or_skip().await else {
        return;
    };
    let rows: &[&[&str]] = &[
        &["SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"],
        &["SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"],
        // (Not `ORACLE`: sqlx's `BEGIN` is a syntax error there.)
        &["SET SESSION sql_mode = 'ANSI'"],
        &["SET SESSION sql_mode = ''"],
        &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',NO_BACKSLASH_ESCAPES')"],
        &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',SIMULTANEOUS_ASSIGNMENT')"],
        &["SET SESSION innodb_lock_wait_timeout = 1"],
        &["SET SESSION sql_select_limit = 0"],
        &["SET SESSION sql_select_limit = 1"],
        &["SET SESSION div_precision_increment = 0"],
        &["SET SESSION sql_safe_updates = 1"],
        &["SET SESSION completion_type = 'CHAIN'"],
        &["SET SESSION max_statement_time = 10"],
        &["SET SESSION autocommit = 0"],
        &["SET @idempotency_outcome = 'completed', @idempotency_result = '1'"],
    ];
    for statements in rows {
        let (pool, _store) = mysql_pool_of_one(&mysql_url()).await;
        let mut conn = pool.acquire().await.expect("connection");
        for statement in *statements {
            conn.execute(sqlx::raw_sql(statement))
                .await
                .expect(statement);
        }
        drop(conn);
        let (tenant, runs) = (fresh_tenant(), std::sync::atomic::AtomicUsize::new(0));
        for round in 1..=2 {
            let mut tx = pool.begin().await.expect("begin");
            let answer = mysql_counted_charge(&mut tx, &tenant, "k", &runs).await;
            tx.commit().await.expect("commit");
            match answer {
                Ok(answer) => assert_eq!(answer, 7, "{statements:?}, round {round}"),
                Err(e) => panic!("{statements:?}: round {round} was refused: {e}"),
            }
        }
        assert_eq!(
            runs.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "{statements:?}: the body ran once"
        );
        pool.close().await;
    }
}

/// A store opened on a pool whose sessions return few rows per `SELECT`
/// (`sql_select_limit = 1` in `after_connect`, or left on the connection the
/// store opens on). The migration history came back cut to one row, so the
/// store took every later migration for pending and applied it again (each
/// drops a procedure and creates it again: other processes' calls meanwhile
/// found none, and an older version replaced a newer one), then failed to
/// record it twice, and did not open. (In a database of its own: it
/// changes the schema when it fails.)
#[tokio::test]
async fn mysql_a_store_opened_on_a_session_with_a_select_limit_applies_nothing_again() {
    store_opened_with_a_select_limit(1).await;
}

/// `SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED` (no `SESSION`: for
/// the session's next transaction only) left pending on connections of the
/// shared pool by code that returned before it began that transaction. The
/// session's `@@tx_isolation` does not show it, and the next statement that
/// reads a table (an autocommit read is a transaction) reads other
/// transactions' uncommitted writes. A transactional-mode owner has
/// recorded its result and not committed: a store-mode duplicate on such a
/// connection must not replay it, nor the store's record read report it,
/// since the owner then rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_pending_read_uncommitted_transaction_never_answers_an_uncommitted_result() {
    use idempotent_runtime::TransactionalConnection;
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let identity =
        Identity::new(fresh_tenant(), "pool_state.pending_isolation", "k").expect("identity");
    let f = fp("request");

    let mut owner = admin.pool().begin().await.expect("begin");
    let token = OwnerToken::new();
    assert_eq!(
        owner
            .reserve_in_transaction(request(&identity, &f, &token), Duration::from_secs(1))
            .await
            .expect("the owner reserves"),
        Reservation::FRESH
    );
    assert_eq!(
        owner
            .complete_in_transaction(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("the owner records"),
        Fenced::Written
    );

    // Both connections of the pool carry the pending isolation.
    let leave_it_pending = || async {
        let mut first = pool.acquire().await.expect("a connection");
        let mut second = pool.acquire().await.expect("the other connection");
        for conn in [&mut first, &mut second] {
            conn.execute("SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
                .await
                .expect("set the next transaction's isolation");
        }
    };
    leave_it_pending().await;
    let read = store.fetch(&identity).await;
    leave_it_pending().await;
    let duplicate = store
        .reserve(request(&identity, &f, &OwnerToken::new()))
        .await;
    owner.rollback().await.expect("rollback");
    pool.close().await;
    assert!(
        admin.fetch(&identity).await.expect("fetch").is_none(),
        "the owner's result was never committed"
    );
    assert!(
        !matches!(duplicate, Ok(Reservation::Completed(_))),
        "the duplicate replayed a result its owner then rolled back: {duplicate:?}"
    );
    assert!(
        !matches!(&read, Ok(Some(record)) if record.state == RecordState::Complete),
        "the record read reported a result its owner then rolled back: {read:?}"
    );
}

/// MariaDB's `max_statement_time` left on a connection of the shared pool
/// (an application's bound on its own queries, 0.5 s here): a
/// transactional-mode duplicate of a call whose owner has not committed
/// waits for the owner's row up to its own bound (`in_progress = wait`,
/// 1 s here), and the server cut that wait at the session's bound: the
/// caller got a store error ("Query execution was interrupted") instead of
/// `InProgress` (rule 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_statement_time_limit_left_on_the_pool_does_not_cut_a_duplicates_wait() {
    use idempotent_runtime::TransactionalConnection;
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let (pool, _store) = mysql_pool_of_one(&mysql_url()).await;
    let mariadb: Option<i64> = sqlx::query_scalar("SELECT @@max_statement_time IS NOT NULL")
        .fetch_one(&pool)
        .await
        .ok();
    if mariadb.is_none() {
        return; // MySQL has no max_statement_time
    }
    pool.execute("SET SESSION max_statement_time = 0.5")
        .await
        .expect("max_statement_time");
    let identity =
        Identity::new(fresh_tenant(), "pool_state.statement_time", "k").expect("identity");
    let f = fp("request");
    let mut owner = admin.pool().begin().await.expect("begin");
    assert_eq!(
        owner
            .reserve_in_transaction(
                request(&identity, &f, &OwnerToken::new()),
                Duration::from_secs(1)
            )
            .await
            .expect("the owner reserves"),
        Reservation::FRESH
    );
    let mut duplicate = pool.begin().await.expect("begin");
    let answer = duplicate
        .reserve_in_transaction(
            request(&identity, &f, &OwnerToken::new()),
            Duration::from_secs(1),
        )
        .await;
    duplicate.rollback().await.expect("rollback");
    owner.rollback().await.expect("rollback");
    pool.close().await;
    assert!(
        matches!(answer, Ok(Reservation::InProgress { .. })),
        "the duplicate is told the call is in progress: {answer:?}"
    );
}

/// A pool whose sessions run SERIALIZABLE with autocommit off (an ORM's
/// settings, here in `after_connect`, with a one-second lock wait), while a
/// transactional-mode owner of another key holds its uncommitted record (the
/// body running). InnoDB makes every read there a locking one; the check of
/// a session the store is about to use read "a row" of the records table
/// (whichever came first in the index it scanned: here the owner's), so it
/// waited for the owner's transaction and a reservation of an unrelated
/// fresh key was refused with a lock wait timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_serializable_autocommit_off_pool_is_not_held_up_by_another_keys_owner() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = mysql_create_database(&admin, "pool_state_serializable").await;
    let url = mysql_url_of(&mysql_url(), &db);
    let checked = tokio::spawn(async move {
        let clean = MySqlStore::connect(&url).await.expect("store");
        let f = fp("request");
        let theirs =
            Identity::new(fresh_tenant(), "pool_state.serializable", "theirs").expect("identity");
        let mut owner = clean.pool().begin().await.expect("begin");
        assert_eq!(
            owner
                .reserve_in_transaction(
                    request(&theirs, &f, &OwnerToken::new()),
                    Duration::from_secs(1)
                )
                .await
                .expect("the owner reserves"),
            Reservation::FRESH
        );
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                        .await?;
                    conn.execute("SET SESSION autocommit = 0").await?;
                    conn.execute("SET SESSION innodb_lock_wait_timeout = 1")
                        .await?;
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .expect("pool");
        let dirty = MySqlStore::from_pool(pool.clone()).await.expect("store");
        let ours =
            Identity::new(fresh_tenant(), "pool_state.serializable", "ours").expect("identity");
        let token = OwnerToken::new();
        let answer = dirty.reserve(request(&ours, &f, &token)).await;
        let read = dirty.fetch(&ours).await;
        owner.rollback().await.expect("rollback");
        pool.close().await;
        assert_eq!(
            answer.expect("a fresh key of its own is not held up by another key's owner"),
            Reservation::FRESH
        );
        assert!(
            read.expect("the read is not held up by another key's owner")
                .is_some_and(|r| r.state == RecordState::InProgress),
            "the read finds the reservation"
        );
    })
    .await;
    mysql_drop_then_check(&admin, &[&db], checked).await;
}

/// A store opened on a connection that code sharing the pool left on
/// another database (`USE other` on a pool of one): the store names its
/// table in the database the opening connection was on, and its calls go
/// there. The worker that finishes dropped calls' records (a completion
/// handed over) wrote with unqualified names on connections of its own,
/// fresh ones on the pool's database: the result went to the other
/// database's table (or nowhere), the record stayed in progress, and after
/// its lease a retry would run the body again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_completion_handed_to_the_worker_lands_where_the_store_reserved() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let home = mysql_create_database(&admin, "pool_state_worker_home").await;
    let other = mysql_create_database(&admin, "pool_state_worker_other").await;
    let (home_url, other_url) = (
        mysql_url_of(&mysql_url(), &home),
        mysql_url_of(&mysql_url(), &other),
    );
    let use_other = format!("USE `{other}`");
    let checked = tokio::spawn(async move {
        // Both databases have the store's schema.
        let in_home = MySqlStore::connect(&home_url).await.expect("home store");
        let in_other = MySqlStore::connect(&other_url).await.expect("other store");
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&home_url)
            .await
            .expect("pool");
        pool.execute(use_other.as_str()).await.expect("use");
        let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
        let identity = Identity::new(fresh_tenant(), "pool_state.worker", "k").expect("identity");
        let (f, token) = (fp("request"), OwnerToken::new());
        assert_eq!(
            store
                .reserve(request(&identity, &f, &token))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        let reserved_in_other = in_other.fetch(&identity).await.expect("fetch").is_some();
        store.complete_detached(Completion::by_body(&identity, &token, &ok(b"7"), LONG));
        store.finish_background_work(Duration::from_secs(60)).await;
        let seen = store.fetch(&identity).await.expect("fetch");
        let in_home_seen = in_home.fetch(&identity).await.expect("fetch");
        pool.close().await;
        assert!(
            reserved_in_other,
            "the store reserves in the opening connection's database"
        );
        assert!(
            seen.as_ref()
                .is_some_and(|r| r.state == RecordState::Complete),
            "the worker's completion lands on the store's record (found {seen:?})"
        );
        assert!(in_home_seen.is_none(), "nothing in the other database");
    })
    .await;
    mysql_drop_then_check(&admin, &[&home, &other], checked).await;
}

/// A database whose name holds a backtick and characters outside ASCII: the
/// store names its table and procedures with it, quoted, and a call on a
/// connection left on another database (`USE`) still lands there.
#[tokio::test]
async fn mysql_a_store_in_a_database_named_with_a_backtick_and_accents_records_there() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = format!("pool_state_b`q_café_{}", uuid::Uuid::new_v4().simple());
    admin
        .pool()
        .execute(format!("CREATE DATABASE `{}`", db.replace('`', "``")).as_str())
        .await
        .expect("create database");
    let name = db.clone();
    let checked = tokio::spawn(async move {
        use std::str::FromStr;
        let options = sqlx::mysql::MySqlConnectOptions::from_str(&mysql_url())
            .expect("options")
            .database(&name);
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .expect("pool");
        let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
        let found: String = sqlx::query_scalar("SELECT CONVERT(DATABASE() USING utf8mb4)")
            .fetch_one(&pool)
            .await
            .expect("database");
        assert_eq!(found, name);
        pool.execute("USE test").await.expect("use");
        let identity = Identity::new(fresh_tenant(), "pool_state.db_name", "k").expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&store, &store, &identity).await;
        let token = OwnerToken::new();
        let other = Identity::new(fresh_tenant(), "pool_state.db_name", "w").expect("identity");
        assert_eq!(
            store
                .reserve(request(&other, &fp("request"), &token))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        store.complete_detached(Completion::by_body(&other, &token, &ok(b"7"), LONG));
        store.finish_background_work(Duration::from_secs(60)).await;
        let seen = store.fetch(&other).await.expect("fetch");
        let in_test: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM test.idempotency_records WHERE tenant = ? LIMIT 1")
                .bind(identity.tenant().as_bytes())
                .fetch_optional(&pool)
                .await
                .expect("read test");
        pool.close().await;
        assert!(
            in_test.is_none(),
            "nothing landed in the database USE chose"
        );
        assert!(
            seen.is_some_and(|r| r.state == RecordState::Complete),
            "the worker's completion lands too"
        );
    })
    .await;
    mysql_drop_then_check(&admin, &[&db], checked).await;
}

/// A store opened on a pool whose sessions return no rows per `SELECT`
/// (`sql_select_limit = 0` in `after_connect`): the store opens, and its
/// calls (the worker's included) record and replay.
#[tokio::test]
async fn mysql_a_store_opened_on_a_session_with_a_select_limit_of_zero_works() {
    store_opened_with_a_select_limit(0).await;
}

/// A store opened on a pool of one whose `after_connect` sets
/// `sql_select_limit = limit`, in a database of its own: it opens, a call
/// is seen and replayed, and a completion handed to its worker lands.
async fn store_opened_with_a_select_limit(limit: u32) {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = mysql_create_database(&admin, "pool_state_select_limit").await;
    let url = mysql_url_of(&mysql_url(), &db);
    let checked = tokio::spawn(async move {
        // The schema, applied on a plain session.
        drop(MySqlStore::connect(&url).await.expect("store"));
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    conn.execute(format!("SET SESSION sql_select_limit = {limit}").as_str())
                        .await?;
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .expect("pool");
        let store = MySqlStore::from_pool(pool.clone())
            .await
            .expect("the store opens");
        let identity =
            Identity::new(fresh_tenant(), "pool_state.select_limit", "k").expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&store, &store, &identity).await;
        let other =
            Identity::new(fresh_tenant(), "pool_state.select_limit", "w").expect("identity");
        let token = OwnerToken::new();
        assert_eq!(
            store
                .reserve(request(&other, &fp("request"), &token))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        store.complete_detached(Completion::by_body(&other, &token, &ok(b"7"), LONG));
        store.finish_background_work(Duration::from_secs(60)).await;
        let seen = store.fetch(&other).await.expect("fetch");
        pool.close().await;
        assert!(
            seen.is_some_and(|r| r.state == RecordState::Complete),
            "the worker's completion lands"
        );
    })
    .await;
    mysql_drop_then_check(&admin, &[&db], checked).await;
}

/// `LOCK TABLES idempotency_records WRITE` left on the connection of a
/// pool of one (code that locked the store's table for a bulk fix and
/// returned without `UNLOCK TABLES`): the store's own calls on that
/// connection still work, reads included. A check of the session that read
/// a table the lock did not name was refused ("was not locked with LOCK
/// TABLES").
#[tokio::test]
async fn mysql_a_lock_of_the_records_table_left_on_the_pool_still_lets_the_store_read() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = mysql_create_database(&admin, "pool_state_lock_tables").await;
    let url = mysql_url_of(&mysql_url(), &db);
    let checked = tokio::spawn(async move {
        let (pool, dirty) = mysql_pool_of_one(&url).await;
        pool.execute("LOCK TABLES idempotency_records WRITE")
            .await
            .expect("lock tables");
        let identity =
            Identity::new(fresh_tenant(), "pool_state.lock_tables", "k").expect("identity");
        let (f, token) = (fp("request"), OwnerToken::new());
        let reserved = dirty.reserve(request(&identity, &f, &token)).await;
        let read = dirty.fetch(&identity).await;
        pool.execute("UNLOCK TABLES").await.expect("unlock");
        pool.close().await;
        assert_eq!(reserved.expect("reserve"), Reservation::FRESH);
        assert!(
            read.expect("the read is answered")
                .is_some_and(|r| r.state == RecordState::InProgress),
            "the read finds the reservation"
        );
    })
    .await;
    mysql_drop_then_check(&admin, &[&db], checked).await;
}

/// On MariaDB a replay whose row another session holds for the moment (a
/// concurrent duplicate's statement, for well under a millisecond; here a
/// transaction that locked it) is answered by a plain read on the
/// connection that met the lock: no session check and no procedure call,
/// which queues on the identity's `GET_LOCK` (a hot key replayed by many
/// callers at once sent a few in a hundred there).
#[tokio::test]
async fn mysql_a_replay_of_a_row_held_for_a_moment_calls_no_procedure() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let (pool, store) = mysql_pool_of_one(&mysql_url()).await;
    let mariadb: Option<i64> = sqlx::query_scalar("SELECT @@max_statement_time IS NOT NULL")
        .fetch_one(&pool)
        .await
        .ok();
    if mariadb.is_none() {
        pool.close().await;
        return; // MySQL reads first, no `INSERT … RETURNING`
    }
    let identity = Identity::new(fresh_tenant(), "pool_state.held_replay", "k").expect("identity");
    let (f, token) = (fp("request"), OwnerToken::new());
    assert_eq!(
        admin
            .reserve(request(&identity, &f, &token))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    assert_eq!(
        admin
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
    let mut holder = admin.pool().begin().await.expect("begin");
    sqlx::query(
        "SELECT 1 FROM idempotency_records WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE",
    )
    .bind(identity.tenant().as_bytes())
    .bind(identity.scope().as_bytes())
    .bind(identity.key().as_bytes())
    .fetch_optional(&mut *holder)
    .await
    .expect("hold the row");
    let calls = || async {
        let (_, n): (String, String) =
            sqlx::query_as("SHOW SESSION STATUS LIKE 'Com_call_procedure'")
                .fetch_one(&pool)
                .await
                .expect("status");
        n.parse::<u64>().expect("a count")
    };
    let before = calls().await;
    let replay = store
        .reserve(request(&identity, &f, &OwnerToken::new()))
        .await;
    let after = calls().await;
    holder.rollback().await.expect("rollback");
    pool.close().await;
    assert_eq!(replay.expect("replayed"), Reservation::Completed(ok(b"7")));
    assert_eq!(after, before, "the replay called no procedure");
}

/// A pool on a URL that names no database, whose `after_connect` chooses one
/// (`USE`): the store opens there, names its table there, and its calls
/// (the worker's included) record there. Without the `USE` the store does
/// not open, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_pool_without_a_database_in_its_url_records_where_after_connect_chose() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = mysql_create_database(&admin, "pool_state_no_db_in_url").await;
    let (bare, url) = (
        mysql_url_of(&mysql_url(), ""),
        mysql_url_of(&mysql_url(), &db),
    );
    let use_db = format!("USE `{db}`");
    let checked = tokio::spawn(async move {
        let refused = MySqlStore::connect(&bare).await;
        assert!(refused.is_err(), "no database, no store: {refused:?}");
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .after_connect(move |conn, _| {
                let use_db = use_db.clone();
                Box::pin(async move {
                    conn.execute(use_db.as_str()).await?;
                    Ok(())
                })
            })
            .connect(&bare)
            .await
            .expect("pool");
        let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
        let there = MySqlStore::connect(&url)
            .await
            .expect("a store on the database");
        let identity = Identity::new(fresh_tenant(), "pool_state.no_db", "k").expect("identity");
        a_call_on_the_dirty_pool_is_seen_by_a_clean_one(&store, &there, &identity).await;
        let other = Identity::new(fresh_tenant(), "pool_state.no_db", "w").expect("identity");
        let token = OwnerToken::new();
        assert_eq!(
            store
                .reserve(request(&other, &fp("request"), &token))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        store.complete_detached(Completion::by_body(&other, &token, &ok(b"7"), LONG));
        store.finish_background_work(Duration::from_secs(60)).await;
        let seen = there.fetch(&other).await.expect("fetch");
        pool.close().await;
        assert!(
            seen.is_some_and(|r| r.state == RecordState::Complete),
            "the worker's completion lands there too"
        );
    })
    .await;
    mysql_drop_then_check(&admin, &[&db], checked).await;
}

/// A schema holding the store renamed (`ALTER SCHEMA app RENAME TO app2`, or
/// a dump restored under another name), and the processes restarted with
/// the new name in their `search_path`: the store opens and replays, but
/// the functions migrations 0009 and 0010 made name the old schema (a
/// pinned `search_path`, a qualified table in the text), and every fresh
/// key and takeover fails with `relation "app.idempotency_records" does not
/// exist`, for good: no migration is left to run.
#[tokio::test]
async fn pg_a_store_in_a_renamed_schema_serves_fresh_keys_after_a_restart() {
    in_own_database(|url| async move {
        let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
        setup.execute("CREATE SCHEMA app").await.expect("schema");
        let (pool, before, _) = pg_schema_stores(with_search_path(&url, "app")).await;
        let f = fp("request");
        let recorded = Identity::new(fresh_tenant(), "pool_state.renamed", "k").expect("identity");
        assert_eq!(
            before
                .reserve(request(&recorded, &f, &OwnerToken::new()))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        setup
            .execute("ALTER SCHEMA app RENAME TO app2")
            .await
            .expect("rename");
        // A store still open names the old schema: its error says to restart.
        let stale = Identity::new(fresh_tenant(), "pool_state.renamed", "k3").expect("identity");
        match before
            .reserve(request(&stale, &f, &OwnerToken::new()))
            .await
        {
            Err(e) => assert!(e.to_string().contains("restart the service"), "{e}"),
            Ok(answer) => panic!("a store naming a renamed schema answered {answer:?}"),
        }
        pool.close().await;
        let (pool, after, _) = pg_schema_stores(with_search_path(&url, "app2")).await;
        let fresh = Identity::new(fresh_tenant(), "pool_state.renamed", "k2").expect("identity");
        assert_eq!(
            after
                .reserve(request(&fresh, &f, &OwnerToken::new()))
                .await
                .expect("a fresh key after the restart"),
            Reservation::FRESH
        );
        // The call recorded before the rename is still there, and every
        // function of the store now names the schema it is in.
        assert!(matches!(
            after
                .reserve(request(&recorded, &f, &OwnerToken::new()))
                .await
                .expect("the recorded call"),
            Reservation::InProgress { .. }
        ));
        let naming_the_old_name: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'app2' AND p.proname LIKE 'idempotency%'
                AND (array_to_string(p.proconfig, ' ') LIKE '%app,%'
                     OR p.prosrc LIKE '%app.idempotency%')",
        )
        .fetch_one(&pool)
        .await
        .expect("the functions");
        assert_eq!(naming_the_old_name, 0);
        pool.close().await;
    })
    .await;
}

/// A role of the cluster for the rename tests: may read and write the
/// records, owns none of the store's functions (it cannot re-make them).
const PG_RECORDS_WRITER: &str = "idempotent_rename_writer";

/// `url` with [`PG_RECORDS_WRITER`] as its user, granted what a store needs
/// on the records in `schema` (an identifier, quoted as needed).
async fn as_records_writer(url: &str, admin: &mut sqlx::PgConnection, schema: &str) -> String {
    // Roles are the cluster's: made once, granted again each run.
    let _ = admin
        .execute(format!("CREATE ROLE {PG_RECORDS_WRITER} LOGIN").as_str())
        .await;
    for grant in [
        format!("GRANT USAGE ON SCHEMA {schema} TO {PG_RECORDS_WRITER}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {PG_RECORDS_WRITER}"),
    ] {
        admin.execute(grant.as_str()).await.expect("grant");
    }
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{PG_RECORDS_WRITER}@{host}")
}

/// A store in a schema whose name must be quoted (`"My-App"`), renamed to
/// another such name: the first store opened after it re-makes the
/// functions for the new name (fresh keys are served), and a role that
/// owns none of the functions then opens a store there and is served too:
/// the functions are seen as right (nothing left to re-make).
#[tokio::test]
async fn pg_a_store_in_a_renamed_schema_whose_name_must_be_quoted_is_opened_by_any_role() {
    in_own_database(|url| async move {
        let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
        setup
            .execute("CREATE SCHEMA \"My-App\"")
            .await
            .expect("schema");
        let (pool, before, _) = pg_schema_stores(with_search_path(&url, "\"My-App\"")).await;
        let f = fp("request");
        let recorded = Identity::new(fresh_tenant(), "pool_state.renamed_quoted", "k").expect("id");
        assert_eq!(
            before
                .reserve(request(&recorded, &f, &OwnerToken::new()))
                .await
                .expect("reserve"),
            Reservation::FRESH
        );
        pool.close().await;
        setup
            .execute("ALTER SCHEMA \"My-App\" RENAME TO \"Our-App\"")
            .await
            .expect("rename");
        let (pool, after, _) = pg_schema_stores(with_search_path(&url, "\"Our-App\"")).await;
        let fresh = Identity::new(fresh_tenant(), "pool_state.renamed_quoted", "k2").expect("id");
        assert_eq!(
            after
                .reserve(request(&fresh, &f, &OwnerToken::new()))
                .await
                .expect("a fresh key after the restart"),
            Reservation::FRESH
        );
        pool.close().await;
        let writer = as_records_writer(&url, &mut setup, "\"Our-App\"").await;
        let store = PgStore::from_pool(
            PgPoolOptions::new()
                .max_connections(1)
                .connect_with(with_search_path(&writer, "\"Our-App\""))
                .await
                .expect("pool"),
        )
        .await
        .expect("a role that owns no function opens the store");
        let third = Identity::new(fresh_tenant(), "pool_state.renamed_quoted", "k3").expect("id");
        assert_eq!(
            store
                .reserve(request(&third, &f, &OwnerToken::new()))
                .await
                .expect("a fresh key for that role"),
            Reservation::FRESH
        );
        store.pool().close().await;
    })
    .await;
}

/// After a rename, a role that may not re-make the functions (it owns none)
/// opens a store first: the open fails, saying what it tried and what the
/// database answered; nothing is re-made halfway.
#[tokio::test]
async fn pg_a_role_that_may_not_remake_the_functions_is_refused_saying_why_after_a_rename() {
    in_own_database(|url| async move {
        let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
        setup.execute("CREATE SCHEMA app").await.expect("schema");
        let (pool, _, _) = pg_schema_stores(with_search_path(&url, "app")).await;
        pool.close().await;
        setup
            .execute("ALTER SCHEMA app RENAME TO app2")
            .await
            .expect("rename");
        let writer = as_records_writer(&url, &mut setup, "app2").await;
        let opened = PgStore::from_pool(
            PgPoolOptions::new()
                .max_connections(1)
                .connect_with(with_search_path(&writer, "app2"))
                .await
                .expect("pool"),
        )
        .await;
        let refused = match opened {
            Ok(_) => panic!("a store opened on functions naming the old schema"),
            Err(e) => e.to_string(),
        };
        assert!(
            refused.contains("re-make the functions after a schema rename")
                && refused.contains("must be owner"),
            "{refused}"
        );
        // The functions' owner opens a store next, and the role is served.
        let (pool, _, _) = pg_schema_stores(with_search_path(&url, "app2")).await;
        pool.close().await;
        let store = PgStore::from_pool(
            PgPoolOptions::new()
                .max_connections(1)
                .connect_with(with_search_path(&writer, "app2"))
                .await
                .expect("pool"),
        )
        .await
        .expect("the role opens a store once the functions were re-made");
        let id = Identity::new(fresh_tenant(), "pool_state.renamed_role", "k").expect("id");
        assert_eq!(
            store
                .reserve(request(&id, &fp("request"), &OwnerToken::new()))
                .await
                .expect("a fresh key"),
            Reservation::FRESH
        );
        store.pool().close().await;
    })
    .await;
}

/// Many stores opened at once after a rename (a deploy restarting every
/// process): each opens, and fresh keys are served.
#[tokio::test]
async fn pg_stores_opened_at_once_after_a_rename_all_open() {
    in_own_database(|url| async move {
        let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
        setup.execute("CREATE SCHEMA app").await.expect("schema");
        let (pool, _, _) = pg_schema_stores(with_search_path(&url, "app")).await;
        pool.close().await;
        setup
            .execute("ALTER SCHEMA app RENAME TO app2")
            .await
            .expect("rename");
        let opens = (0..8).map(|_| {
            let options = with_search_path(&url, "app2");
            tokio::spawn(async move {
                let pool = PgPoolOptions::new()
                    .max_connections(2)
                    .connect_with(options)
                    .await
                    .expect("pool");
                PgStore::from_pool(pool).await
            })
        });
        let f = fp("request");
        for (i, opened) in futures::future::join_all(opens)
            .await
            .into_iter()
            .enumerate()
        {
            let store = opened.expect("task").expect("every store opens");
            let id = Identity::new(fresh_tenant(), "pool_state.renamed_many", format!("k{i}"))
                .expect("id");
            assert_eq!(
                store
                    .reserve(request(&id, &f, &OwnerToken::new()))
                    .await
                    .expect("fresh"),
                Reservation::FRESH
            );
            store.pool().close().await;
        }
    })
    .await;
}

/// As [`pg_a_completion_that_waited_behind_an_update_of_its_row_is_written`],
/// for the owner's lease renewal and its release: each waits for the row
/// while another transaction marks it (a waiting duplicate), and is written
/// once that commits, not told its lease was lost.
#[tokio::test]
async fn pg_a_renewal_and_a_release_that_waited_behind_an_update_of_their_row_are_written() {
    for renewal in [true, false] {
        in_own_database(move |url| async move {
            let owner = PgStore::connect(&url).await.expect("store");
            let identity =
                Identity::new(fresh_tenant(), "pool_state.waited_fenced", "k").expect("identity");
            let (f, token) = (fp("request"), OwnerToken::new());
            assert_eq!(
                owner
                    .reserve(request(&identity, &f, &token))
                    .await
                    .expect("reserve"),
                Reservation::FRESH
            );
            let mut holder = sqlx::PgConnection::connect(&url).await.expect("connect");
            holder.execute("BEGIN").await.expect("begin");
            holder
                .execute("UPDATE idempotency_records SET waiting = TRUE")
                .await
                .expect("a mark, uncommitted");
            let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut holder)
                .await
                .expect("pid");
            let writing = {
                let (owner, identity, token) = (owner.clone(), identity.clone(), token.clone());
                tokio::spawn(async move {
                    if renewal {
                        owner.heartbeat(&identity, &token, LONG).await
                    } else {
                        owner.release(&identity, &token).await
                    }
                })
            };
            let mut observer = sqlx::PgConnection::connect(&url).await.expect("connect");
            let mut blocked = false;
            for _ in 0..500 {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                )
                .bind(holder_pid)
                .fetch_one(&mut observer)
                .await
                .expect("blocked backends");
                if waiting > 0 {
                    blocked = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(blocked, "the write never waited for the row");
            holder.execute("COMMIT").await.expect("commit");
            assert_eq!(
                writing.await.expect("task").expect("written"),
                Fenced::Written,
                "renewal: {renewal}"
            );
            drop((holder, observer));
            owner.pool().close().await;
        })
        .await;
    }
}

/// As [`pg_a_duplicate_waiting_on_a_connection_left_inside_a_written_transaction_does_not_hold_the_record`],
/// when the transaction left open has only read (a plain `BEGIN`, a
/// `SELECT`, an early return): no transaction id is assigned there yet, and
/// the mark (an `UPDATE` of the row) was the first write of that
/// transaction. Its row lock stayed for as long as the connection sat in
/// the pool, and the owner's completion waited behind it (here, until its
/// `lock_timeout`: refused), its renewals too, a takeover after the lease
/// as well: the key stuck until the pool closed that connection. The
/// duplicate polls instead.
#[tokio::test]
async fn pg_a_duplicate_waiting_on_a_connection_left_inside_a_transaction_that_only_read_does_not_hold_the_record(
) {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    let owner_pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            pg_url()
                .parse::<sqlx::postgres::PgConnectOptions>()
                .expect("url")
                .options([("lock_timeout", "2s")]),
        )
        .await
        .expect("pool");
    let owner = PgStore::from_pool(owner_pool).await.expect("store");
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let identity =
        Identity::new(fresh_tenant(), "pool_state.left_open_read_wait", "k").expect("identity");
    let (f, token) = (fp("request"), OwnerToken::new());
    assert_eq!(
        owner
            .reserve(request(&identity, &f, &token))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN").await.expect("begin");
    conn.execute("SELECT 1").await.expect("a read");
    drop(conn);
    dirty
        .wait_for_change(&identity, Duration::from_secs(1), 0)
        .await;
    assert_eq!(
        owner
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("the owner's completion is not held up by the duplicate's wait"),
        Fenced::Written
    );
    pool.close().await;
}

/// The owner's completion handed a connection of the shared pool left
/// inside a `REPEATABLE READ` transaction that only read (its snapshot taken
/// before the reservation was made elsewhere): the fenced `UPDATE` does not
/// see the record in that snapshot and matches nothing. That is not a
/// takeover: the record is still the caller's. The completion is written on
/// another connection, or fails; it is never told its lease was lost.
#[tokio::test]
async fn pg_a_completion_on_a_connection_left_inside_an_older_snapshot_is_not_told_its_lease_was_lost(
) {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let identity =
        Identity::new(fresh_tenant(), "pool_state.left_open_snapshot", "k").expect("identity");
    let (f, token) = (fp("request"), OwnerToken::new());
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .expect("begin");
    conn.execute("SELECT 1")
        .await
        .expect("a read: the snapshot");
    drop(conn);
    assert_eq!(
        clean
            .reserve(request(&identity, &f, &token))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    let completed = dirty
        .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
        .await;
    let seen = clean.fetch(&identity).await.expect("fetch");
    match completed {
        Ok(written) => {
            assert_eq!(
                written,
                Fenced::Written,
                "the record is the caller's ({seen:?})"
            );
            assert!(
                seen.as_ref()
                    .is_some_and(|r| r.state == RecordState::Complete),
                "a clean session finds the recorded result (found {seen:?})"
            );
        }
        Err(e) => assert!(
            seen.as_ref()
                .is_some_and(|r| r.state == RecordState::InProgress
                    && r.owner_token.as_deref() == Some(token.as_str())),
            "refused ({e}): the record is still the caller's (found {seen:?})"
        ),
    }
    pool.close().await;
}

/// A connection of the shared pool left inside a `REPEATABLE READ`
/// transaction that only read, its snapshot older than a call recorded
/// since: a retry of that call handed this connection does not see the
/// record, tries to insert it, and meets it (a serialization failure). The
/// retry is served (the recorded answer replayed), not refused for as long
/// as the pool keeps that connection.
#[tokio::test]
async fn pg_a_retry_on_a_connection_left_inside_an_older_snapshot_replays() {
    let Some(clean) = pg_store_or_skip().await else {
        return;
    };
    let (pool, dirty) = pg_pool_of_one(&pg_url()).await;
    let identity =
        Identity::new(fresh_tenant(), "pool_state.left_open_snapshot_retry", "k").expect("id");
    let (f, token) = (fp("request"), OwnerToken::new());
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .expect("begin");
    conn.execute("SELECT 1")
        .await
        .expect("a read: the snapshot");
    drop(conn);
    assert_eq!(
        clean
            .reserve(request(&identity, &f, &token))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    assert_eq!(
        clean
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
    assert_eq!(
        dirty
            .reserve(request(&identity, &f, &OwnerToken::new()))
            .await
            .expect("the retry is served"),
        Reservation::Completed(ok(b"7"))
    );
    pool.close().await;
}

/// A database an older build migrated up to 0008 (before the functions
/// named their schema), its schema renamed since: this build's open applies
/// 0009 and 0010 for the schema the table is in now, finds nothing stale,
/// and serves fresh keys and the calls recorded before.
#[tokio::test]
async fn pg_a_database_migrated_to_0008_by_an_older_build_and_renamed_serves_after_an_upgrade() {
    const UP_TO_0008: [(i64, &str, &str); 8] = [
        (1, "idempotency records", include_str!("../../idempotent-runtime/migrations/postgres/0001_idempotency_records.sql")),
        (2, "reserve autocommit", include_str!("../../idempotent-runtime/migrations/postgres/0002_reserve_autocommit.sql")),
        (3, "attempts", include_str!("../../idempotent-runtime/migrations/postgres/0003_attempts.sql")),
        (4, "one reservation body and waiters", include_str!("../../idempotent-runtime/migrations/postgres/0004_one_reservation_body_and_waiters.sql")),
        (5, "wake on ended lease", include_str!("../../idempotent-runtime/migrations/postgres/0005_wake_on_ended_lease.sql")),
        (6, "tx answers keep no lock", include_str!("../../idempotent-runtime/migrations/postgres/0006_tx_answers_keep_no_lock.sql")),
        (7, "tx stale snapshot is an answer", include_str!("../../idempotent-runtime/migrations/postgres/0007_tx_stale_snapshot_is_an_answer.sql")),
        (8, "store reads before it writes", include_str!("../../idempotent-runtime/migrations/postgres/0008_store_reads_before_it_writes.sql")),
    ];
    in_own_database(|url| async move {
        let mut setup = sqlx::PgConnection::connect(&url).await.expect("connect");
        setup.execute("CREATE SCHEMA app").await.expect("schema");
        setup.execute("SET search_path = app").await.expect("path");
        setup
            .execute(
                "CREATE TABLE idempotency_schema_migrations (
                     version BIGINT PRIMARY KEY, description TEXT NOT NULL,
                     checksum BYTEA NOT NULL,
                     applied_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
            )
            .await
            .expect("history");
        for (version, description, sql) in UP_TO_0008 {
            setup
                .execute(sqlx::raw_sql(sql))
                .await
                .unwrap_or_else(|e| panic!("migration {version}: {e}"));
            sqlx::query(
                "INSERT INTO idempotency_schema_migrations (version, description, checksum)
                 VALUES ($1, $2, sha384(convert_to($3, 'UTF8')))",
            )
            .bind(version)
            .bind(description)
            .bind(sql)
            .execute(&mut setup)
            .await
            .expect("history row");
        }
        setup
            .execute(
                "INSERT INTO idempotency_records
                     (tenant, scope, key, state, fingerprint, owner_token, is_error, result,
                      lease_expires_at, expires_at, created_at, updated_at)
                 VALUES ('t-before', 'pool_state.upgraded', 'k', 'complete', NULL, NULL, FALSE,
                         '7', NULL, idempotency_now_ms() + 3600000, idempotency_now_ms(),
                         idempotency_now_ms())",
            )
            .await
            .expect("a call recorded by the older build");
        setup.execute("RESET search_path").await.expect("reset");
        setup
            .execute("ALTER SCHEMA app RENAME TO app2")
            .await
            .expect("rename");
        let (pool, store, _) = pg_schema_stores(with_search_path(&url, "app2")).await;
        let fresh = Identity::new(fresh_tenant(), "pool_state.upgraded", "k2").expect("id");
        assert_eq!(
            store
                .reserve(ReserveRequest {
                    identity: &fresh,
                    fingerprint: None,
                    token: &OwnerToken::new(),
                    lease: LONG,
                    ttl: LONG,
                })
                .await
                .expect("a fresh key"),
            Reservation::FRESH
        );
        let before = Identity::new("t-before", "pool_state.upgraded", "k").expect("id");
        assert_eq!(
            store
                .reserve(ReserveRequest {
                    identity: &before,
                    fingerprint: None,
                    token: &OwnerToken::new(),
                    lease: LONG,
                    ttl: LONG,
                })
                .await
                .expect("the recorded call"),
            Reservation::Completed(ok(b"7"))
        );
        let applied: i64 =
            sqlx::query_scalar("SELECT count(*) FROM app2.idempotency_schema_migrations")
                .fetch_one(&pool)
                .await
                .expect("history");
        assert_eq!(applied, 11, "0009 to 0011 applied by the upgrade");
        pool.close().await;
    })
    .await;
}
