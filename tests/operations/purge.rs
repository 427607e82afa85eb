//! Retention really runs: under a steady stream of short-lived keys the record
//! count stays bounded while the purger runs and grows without it; a purge
//! never deletes a live record; the purger stops cleanly.
//!
//! The streaming tests run on private stores (memory, an in-memory SQLite
//! database): on a shared server they would purge other tests' planted
//! expired records. The live-record test also runs on PostgreSQL and MariaDB.

use crate::common;

use idempotent_runtime::purge::{purge_all, Purger, PurgerConfig};
use idempotent_runtime::{
    metrics, Identity, MemoryStore, RecordState, SqliteStore, Store, StoreError,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(3600);
const BLINK: Duration = Duration::from_millis(1);
const SHORT_TTL: Duration = Duration::from_millis(40);
const STREAM_KEYS: u64 = 600;
const STREAM_BATCH: u64 = 50;
/// How long the purger may take to clear a batch's expired records: generous,
/// only ever reached when the purger stopped working.
const SETTLE_BOUND: Duration = Duration::from_secs(20);

fn unique(prefix: &str) -> String {
    format!("{prefix}.{}", uuid::Uuid::new_v4().simple())
}

/// Reserves a fresh identity; completes it with `complete_ttl` if given.
async fn plant(
    store: &dyn Store,
    scope: &str,
    lease: Duration,
    ttl: Duration,
    complete_ttl: Option<Duration>,
) -> Identity {
    common::records::plant(store, "purge-tenant", scope, lease, ttl, complete_ttl).await
}

/// All records of `scope`, whatever their state.
async fn records_in(store: &dyn Store, scope: &str) -> u64 {
    store
        .scope_stats()
        .await
        .expect("scope stats")
        .into_iter()
        .filter(|s| s.scope == scope)
        .map(|s| s.complete + s.in_progress + s.stuck + s.expired)
        .sum()
}

/// Completes `STREAM_KEYS` short-lived keys in batches of `STREAM_BATCH`;
/// returns the largest record count seen in the scope. With `settle`, after
/// each batch it waits (bounded by `SETTLE_BOUND`) until the scope holds no
/// more than one batch: the purger must keep removing what expired.
async fn stream(store: &dyn Store, scope: &str, settle: bool) -> u64 {
    let mut peak = 0;
    for _ in 0..STREAM_KEYS / STREAM_BATCH {
        for _ in 0..STREAM_BATCH {
            plant(store, scope, LONG, LONG, Some(SHORT_TTL)).await;
        }
        let mut count = records_in(store, scope).await;
        peak = peak.max(count);
        if settle {
            let since = Instant::now();
            while count > STREAM_BATCH {
                assert!(
                    since.elapsed() < SETTLE_BOUND,
                    "the purger left {count} records in the scope for {SETTLE_BOUND:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
                count = records_in(store, scope).await;
            }
        }
    }
    peak.max(records_in(store, scope).await)
}

async fn bounded_with_the_purger_and_growing_without(store: Arc<dyn Store>) {
    // Without a purger every record stays, expired or not.
    let scope = unique("purge.stream_unpurged");
    let peak = stream(&*store, &scope, false).await;
    assert_eq!(peak, STREAM_KEYS, "without a purger nothing is deleted");

    // With one, old records go while new ones arrive: the scope never holds
    // much more than the batch being written.
    purge_all(&*store, 1000).await.expect("clean slate");
    let scope = unique("purge.stream_purged");
    let purger = Purger::spawn(
        Arc::clone(&store),
        PurgerConfig {
            interval: Duration::from_millis(20),
            batch: 200,
        },
    );
    let peak = stream(&*store, &scope, true).await;
    let stats = purger.shutdown().await;
    assert!(
        peak <= 2 * STREAM_BATCH,
        "with the purger running the scope peaked at {peak} of {STREAM_KEYS} records"
    );
    assert!(stats.runs >= 2 && stats.deleted > 0, "{stats:?}");
    assert_eq!(stats.last_error, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_on_memory() {
    bounded_with_the_purger_and_growing_without(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_on_sqlite() {
    let store = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    bounded_with_the_purger_and_growing_without(Arc::new(store)).await;
}

/// Waits (bounded) until every one of `ids` counts as expired on the store's clock
/// (for `lease_only`, until their leases ran out). A record that is gone
/// counts: on a shared server another test's purge may have deleted it, which
/// it only does once the record expired.
async fn wait_for_clock(store: &dyn Store, ids: &[&Identity], lease_only: bool) {
    for _ in 0..500 {
        let mut all = true;
        for id in ids {
            let Some(snap) = store.fetch(id).await.expect("fetch") else {
                continue;
            };
            all &= if lease_only {
                snap.lease_expires_at_ms.is_some_and(|l| l <= snap.now_ms)
            } else {
                snap.is_expired()
            };
        }
        if all {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the store's clock did not pass the planted expiries within 2.5 s");
}

async fn never_deletes_a_live_record(store: Arc<dyn Store>) {
    let scope = unique("purge.live");
    let complete_live = plant(&*store, &scope, LONG, LONG, Some(LONG)).await;
    // ttl ran out but the lease is live: the owner is still working.
    let leased = plant(&*store, &scope, LONG, BLINK, None).await;
    // lease ran out but ttl is live: stuck, kept for takeover and audit.
    let stuck = plant(&*store, &scope, BLINK, LONG, None).await;
    let complete_expired = plant(&*store, &scope, LONG, LONG, Some(BLINK)).await;
    let abandoned = plant(&*store, &scope, BLINK, BLINK, None).await;
    wait_for_clock(&*store, &[&complete_expired, &abandoned], false).await;
    wait_for_clock(&*store, &[&stuck], true).await;

    let before = metrics::snapshot().purged;
    let deleted = purge_all(&*store, 1).await.expect("purge");
    // This test's store alone holds these records on memory and in-memory
    // SQLite: the two expired ones are this purge's to delete. On a shared
    // server another test's purge may delete them first, or hold them locked
    // (SKIP LOCKED), so there only what remains afterwards is asserted.
    if matches!(store.name(), "memory" | "sqlite") {
        assert!(deleted >= 2, "deleted {deleted}");
    }
    assert!(metrics::snapshot().purged >= before + deleted);
    // And a background purger on top of it, for a few runs. (Batches of 100:
    // on a shared server other tests' expired records are purged too, and
    // one-record batches would make each run slow; purge_all above already
    // exercised batches of one.)
    let purger = Purger::spawn(
        Arc::clone(&store),
        PurgerConfig {
            interval: Duration::from_millis(5),
            batch: 100,
        },
    );
    for _ in 0..2000 {
        if purger.stats().runs >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stats = purger.shutdown().await;
    assert!(stats.runs >= 3, "{stats:?}");

    let state = |id: &Identity| {
        let store = Arc::clone(&store);
        let id = id.clone();
        async move { store.fetch(&id).await.expect("fetch").map(|s| s.state) }
    };
    assert_eq!(state(&complete_live).await, Some(RecordState::Complete));
    assert_eq!(state(&leased).await, Some(RecordState::InProgress));
    assert_eq!(state(&stuck).await, Some(RecordState::InProgress));
    assert_eq!(state(&complete_expired).await, None);
    assert_eq!(state(&abandoned).await, None);
}

#[tokio::test]
async fn live_records_survive_on_memory() {
    never_deletes_a_live_record(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn live_records_survive_on_sqlite() {
    let store = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    never_deletes_a_live_record(Arc::new(store)).await;
}

#[tokio::test]
async fn live_records_survive_on_postgres() {
    if let Some(store) = common::servers::pg_store_or_skip().await {
        never_deletes_a_live_record(Arc::new(store)).await;
    }
}

#[tokio::test]
async fn live_records_survive_on_mysql() {
    if let Some(store) = common::servers::mysql_store_or_skip().await {
        never_deletes_a_live_record(Arc::new(store)).await;
    }
}

#[tokio::test]
async fn shutdown_stops_the_purger_and_so_does_drop() {
    let store = MemoryStore::new();
    let scope = unique("purge.stop");
    let purger = Purger::spawn(
        store.clone(),
        PurgerConfig {
            interval: Duration::from_millis(5),
            batch: 10,
        },
    );
    for _ in 0..400 {
        if purger.stats().runs >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stats = purger.shutdown().await;
    assert!(stats.runs >= 2, "{stats:?}");

    // Stopped: an expired record planted now stays through many intervals.
    let after_shutdown = plant(&store, &scope, LONG, LONG, Some(BLINK)).await;
    wait_for_clock(&store, &[&after_shutdown], false).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(store.fetch(&after_shutdown).await.expect("fetch").is_some());

    // Dropping the handle stops it as well.
    let purger = Purger::spawn(
        store.clone(),
        PurgerConfig {
            interval: Duration::from_millis(5),
            batch: 10,
        },
    );
    for _ in 0..400 {
        if purger.stats().runs >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(store.fetch(&after_shutdown).await.expect("fetch").is_none());
    drop(purger);
    tokio::task::yield_now().await;
    let after_drop = plant(&store, &scope, LONG, LONG, Some(BLINK)).await;
    wait_for_clock(&store, &[&after_drop], false).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(store.fetch(&after_drop).await.expect("fetch").is_some());
}

/// A store whose purge and counts never answer (a stalled server, a lock on
/// the whole records table); `purging` is told when a purge is in flight.
struct Stalled {
    purging: Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl common::hooked::Intercept for Stalled {
    async fn purge_expired(&self, _: &MemoryStore, _: u32) -> Result<u64, StoreError> {
        self.purging.notify_one();
        std::future::pending().await
    }
    async fn scope_stats(
        &self,
        _: &MemoryStore,
    ) -> Result<Vec<idempotent_runtime::ScopeStats>, StoreError> {
        std::future::pending().await
    }
}

/// A purger whose batch never ends still shuts down (after its grace), and
/// says in its statistics that it cut a run off; an audit of a store that
/// never answers ends with an error that says so (short bounds of real time
/// here; 10 s and 5 minutes by default).
#[tokio::test]
async fn a_stalled_database_holds_up_neither_shutdown_nor_an_audit() {
    let purging = Arc::new(tokio::sync::Notify::new());
    let store = Arc::new(common::hooked::Hooked::new(Stalled {
        purging: purging.clone(),
    }));
    let handle = Purger::spawn(
        store.clone(),
        PurgerConfig {
            interval: Duration::from_millis(100),
            batch: 10,
        },
    );
    tokio::time::timeout(LONG, purging.notified())
        .await
        .expect("the first run starts at once");
    let stats = tokio::time::timeout(LONG, handle.shutdown_within(Duration::from_millis(100)))
        .await
        .expect("shutdown ends although the batch in flight never does");
    assert_eq!((stats.runs, stats.failed_runs, stats.deleted), (1, 1, 0));
    let said = stats.last_error.expect("the cut-off run is reported");
    assert!(said.contains("stopped by shutdown"), "{said}");
    let audited = tokio::time::timeout(
        LONG,
        idempotent_runtime::audit::audit_within(store.as_ref(), &[], Duration::from_millis(100)),
    )
    .await
    .expect("the audit ends");
    let e = audited.expect_err("no answer is an error");
    assert!(e.to_string().contains("stalled"), "{e}");
}

/// A purge whose first batch deletes a full batch and whose second fails.
struct FailsOnTheSecondBatch {
    batches: std::sync::atomic::AtomicU32,
    failed: Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl common::hooked::Intercept for FailsOnTheSecondBatch {
    async fn purge_expired(&self, _: &MemoryStore, batch: u32) -> Result<u64, StoreError> {
        if self
            .batches
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            == 0
        {
            return Ok(u64::from(batch));
        }
        self.failed.notify_one();
        Err(StoreError::new("test", "purge", "connection reset"))
    }
}

/// A run that fails part way still counts what its earlier batches deleted.
#[tokio::test]
async fn a_failed_run_keeps_count_of_what_it_deleted() {
    let failed = Arc::new(tokio::sync::Notify::new());
    let store = Arc::new(common::hooked::Hooked::new(FailsOnTheSecondBatch {
        batches: Default::default(),
        failed: failed.clone(),
    }));
    let handle = Purger::spawn(
        store,
        PurgerConfig {
            interval: LONG,
            batch: 7,
        },
    );
    tokio::time::timeout(LONG, failed.notified())
        .await
        .expect("the first run starts at once");
    let stats = handle.shutdown().await;
    assert_eq!((stats.runs, stats.failed_runs, stats.deleted), (1, 1, 7));
    assert!(stats
        .last_error
        .is_some_and(|e| e.contains("connection reset")));
}

/// A purge whose batches always come back full (a backlog that never ends)
/// and whose first batch holds until let go.
struct EndlessBacklog {
    batches: Arc<std::sync::atomic::AtomicU32>,
    in_batch: Arc<tokio::sync::Notify>,
    go: Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl common::hooked::Intercept for EndlessBacklog {
    async fn purge_expired(&self, _: &MemoryStore, batch: u32) -> Result<u64, StoreError> {
        if self
            .batches
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            == 0
        {
            self.in_batch.notify_one();
            self.go.notified().await;
        }
        Ok(u64::from(batch))
    }
}

/// A shutdown asked while a batch runs lets that batch finish and starts no
/// other, although the backlog would fill many more.
#[tokio::test]
async fn shutdown_lets_the_batch_in_flight_finish_and_starts_no_other() {
    let batches = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let in_batch = Arc::new(tokio::sync::Notify::new());
    let go = Arc::new(tokio::sync::Notify::new());
    let store = Arc::new(common::hooked::Hooked::new(EndlessBacklog {
        batches: batches.clone(),
        in_batch: in_batch.clone(),
        go: go.clone(),
    }));
    let handle = Purger::spawn(
        store,
        PurgerConfig {
            interval: LONG,
            batch: 5,
        },
    );
    tokio::time::timeout(LONG, in_batch.notified())
        .await
        .expect("the first run starts at once");
    // The shutdown is asked (its first poll) before the batch is let go.
    let (stats, ()) = tokio::time::timeout(
        LONG,
        futures::future::join(handle.shutdown(), async {
            tokio::task::yield_now().await;
            go.notify_one();
        }),
    )
    .await
    .expect("the shutdown ends");
    assert_eq!(
        (stats.runs, stats.failed_runs, stats.deleted),
        (1, 0, 5),
        "{stats:?}"
    );
    assert_eq!(batches.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A purge that fails once, then works.
struct FailsOnce {
    calls: std::sync::atomic::AtomicU32,
}

#[async_trait::async_trait]
impl common::hooked::Intercept for FailsOnce {
    async fn purge_expired(&self, inner: &MemoryStore, batch: u32) -> Result<u64, StoreError> {
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            return Err(StoreError::new("test", "purge", "connection reset"));
        }
        inner.purge_expired(batch).await
    }
}

/// `last_error` is the latest failure only while no run has succeeded since.
#[tokio::test(start_paused = true)]
async fn a_successful_run_clears_the_last_error() {
    let handle = Purger::spawn(
        common::hooked::Hooked::new(FailsOnce {
            calls: Default::default(),
        }),
        PurgerConfig {
            interval: Duration::from_secs(60),
            batch: 10,
        },
    );
    // The paused clock moves on whenever the purger waits for its interval.
    for _ in 0..100 {
        if handle.stats().runs >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
    let stats = handle.shutdown().await;
    assert!(stats.runs >= 2, "{stats:?}");
    assert_eq!(stats.failed_runs, 1, "{stats:?}");
    assert_eq!(stats.last_error, None, "{stats:?}");
}

/// A store on a pool it shares with application code, which gave the one
/// connection back inside a transaction it began and never ended (`BEGIN`
/// sent as a query): the purge's deletes went into that transaction. They
/// were counted as deleted, yet nobody else saw them, they roll back when
/// the connection closes, and meanwhile the expired records stay locked
/// (a reservation of such a key waits). The purge deletes for good or fails
/// saying why. (In a schema of its own, so no other test's purge deletes
/// the planted record.)
#[tokio::test]
async fn a_purge_on_a_connection_left_in_a_transaction_deletes_for_good_on_postgres() {
    purge_beside_a_transaction_left_open("BEGIN", false).await;
}

/// As above, the transaction left failed (a statement of the application's
/// failed there): the purge's check for an open transaction was refused
/// there ("current transaction is aborted") and the run failed; such a
/// connection is closed and another taken, and the purge deletes for good.
#[tokio::test]
async fn a_purge_on_a_connection_left_in_a_failed_transaction_deletes_for_good_on_postgres() {
    purge_beside_a_transaction_left_open("BEGIN; SELECT 1 / 0", true).await;
}

/// A purge through a store whose pool's one connection application code gave
/// back inside the transaction `left_open` began; `must_delete`: the purge must
/// delete (not fail saying why).
async fn purge_beside_a_transaction_left_open(left_open: &str, must_delete: bool) {
    use sqlx::Executor;
    if common::servers::pg_store_or_skip().await.is_none() {
        return;
    }
    let (mut admin, schema, _) = common::servers::pg_schema_of_its_own("operations_purge").await;
    let pool = common::servers::pg_one_connection_pool_in(&schema).await;
    let store = idempotent_runtime::PgStore::from_pool(pool.clone())
        .await
        .expect("store");
    let id = plant(&store, "purge.left_open", LONG, LONG, Some(BLINK)).await;
    wait_for_clock(&store, &[&id], false).await;

    // The application's code leaves the pool's one connection in a transaction.
    let mut conn = pool.acquire().await.expect("connection");
    // (A failing statement fails the whole string; its transaction stays.)
    let _ = conn.execute(left_open).await;
    drop(conn);
    let purged = purge_all(&store, 100).await;

    let left: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.idempotency_records"
    ))
    .fetch_one(&mut admin)
    .await
    .expect("count");
    drop(store);
    pool.close().await; // rolls back what was left open
    admin
        .execute(format!("DROP SCHEMA {schema} CASCADE").as_str())
        .await
        .expect("drop schema");
    match purged {
        Ok(deleted) => assert_eq!(
            left, 0,
            "the purge answered {deleted} deleted, and others still see the record"
        ),
        Err(e) => assert!(
            !must_delete && left == 1 && e.to_string().contains("transaction"),
            "{e}"
        ),
    }
}

/// A PostgreSQL purge dropped while its statement waits (here for a table
/// lock; the purge's own time bound, a purge job's cancellation or a
/// purger's shutdown drop it the same way) is inside the transaction the
/// purge began for it: its connection is closed, never handed back to the
/// pool inside that transaction: no session of the store is left idle in a
/// transaction, and the next purge on the pool's one connection deletes for
/// good. (In a
/// schema of its own, so the table lock holds up no other test.)
#[tokio::test]
async fn a_purge_dropped_mid_statement_leaves_no_transaction_open_on_postgres() {
    use sqlx::{Connection, Executor};
    if common::servers::pg_store_or_skip().await.is_none() {
        return;
    }
    let (mut admin, schema, _) =
        common::servers::pg_schema_of_its_own("operations_purge_cut").await;
    let pool = common::servers::pg_one_connection_pool_in(&schema).await;
    let store = idempotent_runtime::PgStore::from_pool(pool.clone())
        .await
        .expect("store");
    let id = plant(&store, "purge.cut", LONG, LONG, Some(BLINK)).await;
    wait_for_clock(&store, &[&id], false).await;

    let mut locker = sqlx::PgConnection::connect(&common::servers::pg_url())
        .await
        .expect("connect");
    locker
        .execute(
            format!("BEGIN; LOCK TABLE {schema}.idempotency_records IN ACCESS EXCLUSIVE MODE")
                .as_str(),
        )
        .await
        .expect("lock the table");
    let waiting = async {
        for _ in 0..2000 {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE application_name = $1 AND wait_event_type = 'Lock'",
            )
            .bind(&schema)
            .fetch_one(&mut admin)
            .await
            .expect("pg_stat_activity");
            if n > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the purge never waited for the table lock");
    };
    tokio::select! {
        purged = store.purge_expired(100) => panic!("the purge answered through the lock: {purged:?}"),
        () = waiting => {} // the purge is dropped here, mid-statement
    }
    locker.execute("COMMIT").await.expect("unlock");

    // The cut session ends; none is left idle in a transaction.
    let mut open: i64 = -1;
    for _ in 0..2000 {
        open = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE application_name = $1 AND (state <> 'idle' OR xact_start IS NOT NULL)",
        )
        .bind(&schema)
        .fetch_one(&mut admin)
        .await
        .expect("pg_stat_activity");
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let kept: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.idempotency_records"
    ))
    .fetch_one(&mut admin)
    .await
    .expect("count");
    let purged = purge_all(&store, 100).await;
    let left: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.idempotency_records"
    ))
    .fetch_one(&mut admin)
    .await
    .expect("count");
    drop(store);
    pool.close().await;
    admin
        .execute(format!("DROP SCHEMA {schema} CASCADE").as_str())
        .await
        .expect("drop schema");
    assert_eq!(open, 0, "a session of the store stayed in a transaction");
    // The cut statement's deletes are rolled back by the server (or, had it
    // committed first, gone for good): the next purge deletes what is left.
    assert_eq!(
        (purged.expect("the next purge"), left),
        (u64::try_from(kept).expect("a count"), 0),
        "the next purge deletes for good"
    );
}
