//! Rule 14 at its edges: a call dropped while its reservation statement is
//! still in flight, and a call dropped because its runtime is shutting down,
//! both leave the key free: the store itself carries the release out.
//!
//! `Stalling` wraps a real store: its reservation reaches the real store (and
//! acquires) and then never answers, like a connection whose response is held
//! up after the server committed. The caller gives up (its future is
//! dropped); the record must then be released by the store, not left in
//! progress for the whole lease. With `Stall::Complete` the completion never
//! starts: the body has run, so the store must record the result (a retry
//! replays it) instead of freeing the key for a second run.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Fenced, Identity, MemoryStore, Outcome,
    OwnerToken, RecordSnapshot, RecordState, Reservation, ReserveRequest, ScopeStats, SqliteStore,
    Store, StoreError,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// How long a released record may take to disappear (the release runs in the
/// background); generous, and only ever waited for by polling.
const RELEASE_BOUND: Duration = Duration::from_secs(20);

#[derive(PartialEq)]
enum Stall {
    /// After the real reservation acquired.
    Reserve,
    /// Before the real completion is sent.
    Complete,
}

struct Stalling {
    inner: Arc<dyn Store>,
    stall: Stall,
    /// Notified once the call reached the stall.
    stalled: Notify,
}

#[async_trait::async_trait]
impl Store for Stalling {
    fn name(&self) -> &'static str {
        "stalling"
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let answer = self.inner.reserve(r).await;
        if self.stall == Stall::Reserve && matches!(answer, Ok(Reservation::Acquired { .. })) {
            // The answer never arrives.
            self.stalled.notify_one();
            std::future::pending::<()>().await;
        }
        answer
    }
    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        if self.stall == Stall::Complete {
            self.stalled.notify_one();
            std::future::pending::<()>().await;
        }
        self.inner.complete(completion).await
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        self.inner.release(i, t).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.heartbeat(i, t, lease).await
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.release_detached(i, t)
    }
    fn complete_detached(&self, completion: Completion<'_>) {
        self.inner.complete_detached(completion)
    }
    async fn force_release(
        &self,
        i: &Identity,
        require_expired_lease: bool,
    ) -> Result<idempotent_runtime::ForcedRelease, StoreError> {
        self.inner.force_release(i, require_expired_lease).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }
    async fn fetch(&self, i: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        self.inner.fetch(i).await
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.inner.scope_stats().await
    }
}

#[idempotent(scope = "cancel.charge", key = key, tenant = tenant, store = store, skip(runs),
             lease = "1h")]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

#[idempotent(scope = "cancel.forever", key = key, tenant = tenant, store = store, skip(started),
             lease = "1h")]
async fn runs_forever(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    started: &Notify,
) -> Result<u32, Error> {
    started.notify_one();
    std::future::pending::<()>().await;
    Ok(0)
}

async fn released_within_bound(store: &dyn Store, id: &Identity) {
    // A handshake, not a poll: the store says when the work it was handed
    // for the dropped call is done (`finish_background_work`).
    let left = tokio::time::timeout(
        RELEASE_BOUND + Duration::from_secs(5),
        store.finish_background_work(RELEASE_BOUND),
    )
    .await
    .expect("finish_background_work overran its own bound");
    assert_eq!(
        left, 0,
        "the store's work for the dropped call did not finish"
    );
    let fetched = tokio::time::timeout(RELEASE_BOUND, store.fetch(id))
        .await
        .expect("fetch hung")
        .expect("fetch");
    assert!(
        fetched.is_none(),
        "the dropped call's record was not released: {fetched:?}"
    );
}

/// The reservation acquired, its answer never came, the caller gave up: the
/// key is free again and the next call runs the body once.
async fn dropped_while_reserving(inner: Arc<dyn Store>) {
    let stalling = Stalling {
        inner: inner.clone(),
        stall: Stall::Reserve,
        stalled: Notify::new(),
    };
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);
    let id = Identity::new(&tenant, "cancel.charge", "k").expect("identity");
    tokio::select! {
        answer = charge(&stalling, &tenant, "k", &runs) => panic!("the stalled call answered: {answer:?}"),
        () = stalling.stalled.notified() => {} // the reservation landed; give up now
    }
    released_within_bound(inner.as_ref(), &id).await;
    assert_eq!(
        charge(inner.as_ref(), &tenant, "k", &runs)
            .await
            .expect("runs"),
        7
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the body ran once, after the release"
    );
}

/// The body ran, the completion never got going, the caller gave up: the
/// store records the result, so a retry replays it and the body ran once.
async fn dropped_while_completing(inner: Arc<dyn Store>) {
    let stalling = Stalling {
        inner: inner.clone(),
        stall: Stall::Complete,
        stalled: Notify::new(),
    };
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);
    let id = Identity::new(&tenant, "cancel.charge", "k").expect("identity");
    tokio::select! {
        answer = charge(&stalling, &tenant, "k", &runs) => panic!("the stalled call answered: {answer:?}"),
        () = stalling.stalled.notified() => {} // the body ran; give up while recording
    }
    let deadline = tokio::time::Instant::now() + RELEASE_BOUND;
    loop {
        let record = inner.fetch(&id).await.expect("fetch");
        match record {
            Some(r) if r.state == RecordState::Complete => break,
            other if tokio::time::Instant::now() >= deadline => {
                panic!("the dropped call's result was not recorded: {other:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let (answer, outcome) = with_outcome(charge(inner.as_ref(), &tenant, "k", &runs)).await;
    assert_eq!(answer.expect("replays"), 7);
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
}

/// A call holding its record on a runtime that is shut down: the release is
/// made by the store, not by the dead runtime. The record is read back
/// through the same store from a third runtime (the store gives each
/// runtime connections of its own, `tests/faults/runtimes.rs`).
fn dropped_by_runtime_shutdown(inner: Arc<dyn Store>, tenant: &str) {
    let id = Identity::new(tenant, "cancel.forever", "k").expect("identity");
    let doomed = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let started = Arc::new(Notify::new());
    let (store, who, notify) = (inner.clone(), tenant.to_owned(), started.clone());
    doomed.spawn(async move {
        let _ = runs_forever(store.as_ref(), &who, "k", &notify).await;
    });
    doomed.block_on(async {
        tokio::time::timeout(RELEASE_BOUND, started.notified())
            .await
            .expect("the call did not reach its body (its reservation hung or failed)")
    });
    drop(doomed); // shuts the runtime down: the call's future is dropped on it
    let checker = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    checker.block_on(released_within_bound(inner.as_ref(), &id));
}

async fn sqlite() -> Arc<dyn Store> {
    Arc::new(
        SqliteStore::connect(&crate::common::scratch::sqlite_url("cancel"))
            .await
            .expect("open"),
    )
}

#[tokio::test]
async fn memory_dropped_while_completing_is_recorded() {
    dropped_while_completing(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn sqlite_dropped_while_completing_is_recorded() {
    dropped_while_completing(sqlite().await).await;
}

#[tokio::test]
async fn postgres_dropped_while_completing_is_recorded() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    dropped_while_completing(Arc::new(store)).await;
}

#[tokio::test]
async fn mysql_dropped_while_completing_is_recorded() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    dropped_while_completing(Arc::new(store)).await;
}

#[tokio::test]
async fn memory_dropped_while_reserving_is_released() {
    dropped_while_reserving(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn sqlite_dropped_while_reserving_is_released() {
    dropped_while_reserving(sqlite().await).await;
}

#[tokio::test]
async fn postgres_dropped_while_reserving_is_released() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    dropped_while_reserving(Arc::new(store)).await;
}

#[tokio::test]
async fn mysql_dropped_while_reserving_is_released() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    dropped_while_reserving(Arc::new(store)).await;
}

/// The store is opened on one runtime and the call runs on another that is
/// shut down mid-call (a worker draining, a CLI exiting); the opening runtime
/// stays alive but idle meanwhile.
fn shutdown_case<F, Fut>(open: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Option<Arc<dyn Store>>>,
{
    let home = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let Some(store) = home.block_on(open()) else {
        return;
    };
    dropped_by_runtime_shutdown(store, &fresh_tenant());
    drop(home);
}

#[test]
fn memory_call_dropped_by_runtime_shutdown_is_released() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    shutdown_case(move || std::future::ready(Some(store)));
}

#[test]
fn sqlite_call_dropped_by_runtime_shutdown_is_released() {
    shutdown_case(|| async { Some(sqlite().await) });
}

#[test]
fn postgres_call_dropped_by_runtime_shutdown_is_released() {
    shutdown_case(|| async {
        pg_store_or_skip()
            .await
            .map(|s| Arc::new(s) as Arc<dyn Store>)
    });
}

#[test]
fn mysql_call_dropped_by_runtime_shutdown_is_released() {
    shutdown_case(|| async {
        mysql_store_or_skip()
            .await
            .map(|s| Arc::new(s) as Arc<dyn Store>)
    });
}

/// Starts a call that runs for ever, waits until its body runs, does
/// `before_the_drop`, then drops the call (aborts its task). Answers the
/// call's identity.
async fn drop_a_call_in_its_body<F, Fut>(store: &Arc<dyn Store>, before_the_drop: F) -> Identity
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, "cancel.forever", "k").expect("identity");
    let started = Arc::new(Notify::new());
    let call = {
        let (store, started) = (store.clone(), started.clone());
        tokio::spawn(async move { runs_forever(&*store, &tenant, "k", &started).await })
    };
    tokio::time::timeout(RELEASE_BOUND, started.notified())
        .await
        .expect("the call reached its body");
    before_the_drop().await;
    call.abort();
    let _ = call.await;
    id
}

/// A shutdown that closes the store's pool before (or just after) the calls
/// in flight are dropped: their records are released all the same, by the
/// store's background worker on connections of its own. On SQLite the
/// worker used the store's pool, so every release failed once it was closed
/// and the records stayed in progress for their lease (hunt finding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_call_dropped_after_the_stores_pool_closed_is_released() {
    let path = std::env::temp_dir().join(format!("idempotent-cancel-{}.db", uuid::Uuid::new_v4()));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let opened = SqliteStore::connect(&url).await.expect("open");
    let pool = opened.pool().clone();
    let store: Arc<dyn Store> = Arc::new(opened);
    let id = drop_a_call_in_its_body(&store, || pool.close()).await;
    let left = store.finish_background_work(RELEASE_BOUND).await;
    assert_eq!(
        left, 0,
        "the store's work for the dropped call did not finish"
    );
    let reopened = SqliteStore::connect(&url).await.expect("reopen");
    let fetched = reopened.fetch(&id).await.expect("fetch");
    assert!(
        fetched.is_none(),
        "the dropped call's record was not released: {fetched:?}"
    );
    drop((store, reopened));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// A private in-memory database (one pooled connection, kept open) is
/// reachable only through the store's own pool: a dropped call's record is
/// released through it. A worker pool of its own found a new, empty database
/// on each of its connections and gave every release up (review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_call_dropped_on_a_private_in_memory_database_is_released() {
    let options = sqlx::sqlite::SqliteConnectOptions::new().in_memory(true);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_with(options)
        .await
        .expect("pool");
    let store: Arc<dyn Store> = Arc::new(SqliteStore::from_pool(pool).await.expect("store"));
    let id = drop_a_call_in_its_body(&store, || async {}).await;
    released_within_bound(store.as_ref(), &id).await;
}
