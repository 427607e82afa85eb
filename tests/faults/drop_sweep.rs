//! Rule 14 at every await point: a call's future polled by hand `n` times
//! and then dropped, for every `n` from 0 until the call ends by itself, on
//! every store. Store mode goes through [`Yielding`], a wrapper that makes
//! every store operation yield once before and once after it runs, so even
//! the memory store (whose operations never wait) has a drop point before
//! and after each statement. Transactional mode runs on a pool of one
//! connection: the dropped call's transaction must not keep that connection
//! (inside a transaction, or holding a lock) from the next call.
//!
//! After each drop, and once the store's background work is done:
//! - store mode, no hook: the record is gone or complete (never left in
//!   progress); complete only when the body finished, and a body that
//!   finished is always recorded (a retry replays it, the body ran once);
//! - store mode, with a `recover` hook, the call a takeover: the record is
//!   never released for a blind re-run (it is in progress with its lease
//!   ended, or complete);
//! - transactional mode: the business write and the record commit together
//!   or not at all;
//! - always: a retry of the key is answered, within a bound, on the same
//!   pool.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Fenced, ForcedRelease, Identity, MemoryStore,
    Outcome, OwnerToken, RecordSnapshot, RecordState, Recovery, Reservation, ReserveRequest,
    ScopeStats, SqliteStore, Store, StoreError, Takeover,
};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

/// How long the store's work for a dropped call, or a retry, may take: only
/// reached when it hangs.
const BOUND: Duration = Duration::from_secs(40);

/// No call needs more polls than this to end by itself.
const MOST_POLLS: usize = 400;

/// Yields once (wakes itself, answers `Pending`).
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

/// A store whose every awaited operation yields once before and once after
/// it runs: a drop point on each side of each statement.
struct Yielding(Arc<dyn Store>);

#[async_trait::async_trait]
impl Store for Yielding {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn max_result_bytes(&self) -> usize {
        self.0.max_result_bytes()
    }
    fn database_id(&self) -> Option<&str> {
        self.0.database_id()
    }
    fn records_in_process_memory(&self) -> bool {
        self.0.records_in_process_memory()
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        yield_once().await;
        let answer = self.0.reserve(r).await;
        yield_once().await;
        answer
    }
    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        yield_once().await;
        let answer = self.0.complete(completion).await;
        yield_once().await;
        answer
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        yield_once().await;
        let answer = self.0.release(i, t).await;
        yield_once().await;
        answer
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        yield_once().await;
        let answer = self.0.heartbeat(i, t, lease).await;
        yield_once().await;
        answer
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.0.release_detached(i, t)
    }
    fn complete_detached(&self, completion: Completion<'_>) {
        self.0.complete_detached(completion)
    }
    fn end_lease_detached(&self, i: Identity, t: OwnerToken) {
        self.0.end_lease_detached(i, t)
    }
    async fn force_release(
        &self,
        i: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        self.0.force_release(i, require_expired_lease).await
    }
    async fn wait_for_change(&self, i: &Identity, max_wait: Duration, round: u32) {
        yield_once().await;
        self.0.wait_for_change(i, max_wait, round).await
    }
    async fn finish_background_work(&self, within: Duration) -> usize {
        self.0.finish_background_work(within).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.0.purge_expired(batch).await
    }
    async fn fetch(&self, i: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        yield_once().await;
        let answer = self.0.fetch(i).await;
        yield_once().await;
        answer
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.0.scope_stats().await
    }
}

/// Lets `call` be polled (by the runtime, when it is woken) at most `polls`
/// times, then drops it. Answers whether it ended by itself first.
async fn poll_then_drop<F: Future>(call: F, polls: usize) -> bool {
    let mut call = std::pin::pin!(call);
    let mut left = polls;
    std::future::poll_fn(|cx| {
        if left == 0 {
            return Poll::Ready(false);
        }
        left -= 1;
        call.as_mut().poll(cx).map(|_| true)
    })
    .await
}

/// A body's runs, and whether one got to its end.
#[derive(Default)]
struct Body {
    runs: AtomicUsize,
    finished: AtomicBool,
}

impl Body {
    /// The body's work: counted, three yields, then marked finished in the
    /// poll that answers.
    async fn run(&self) -> u32 {
        self.runs.fetch_add(1, Ordering::SeqCst);
        for _ in 0..3 {
            yield_once().await;
        }
        self.finished.store(true, Ordering::SeqCst);
        7
    }
}

#[idempotent(scope = "sweep.store", key = key, tenant = tenant, store = store, skip(body),
             lease = "1h", in_progress = wait("20s"))]
async fn charge(store: &dyn Store, tenant: &str, key: &str, body: &Body) -> Result<u32, Error> {
    Ok(body.run().await)
}

async fn ask_then_run(_: &Takeover) -> Result<Recovery<u32>, Error> {
    for _ in 0..3 {
        yield_once().await;
    }
    Ok(Recovery::Run)
}

#[idempotent(scope = "sweep.hooked", key = key, tenant = tenant, store = store, skip(body),
             lease = "1h", in_progress = wait("20s"), recover = ask_then_run)]
async fn charge_hooked(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    body: &Body,
) -> Result<u32, Error> {
    Ok(body.run().await)
}

async fn ask_then_find(_: &Takeover) -> Result<Recovery<u32>, Error> {
    for _ in 0..3 {
        yield_once().await;
    }
    Ok(Recovery::Completed(7))
}

#[idempotent(scope = "sweep.found", key = key, tenant = tenant, store = store, skip(body),
             lease = "1h", in_progress = wait("20s"), recover = ask_then_find)]
async fn charge_found(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    body: &Body,
) -> Result<u32, Error> {
    Ok(body.run().await)
}

/// The record of `id`: as it is now when `settled` says it is, otherwise
/// once the store's work for dropped calls is done.
async fn settled_record(
    store: &dyn Store,
    id: &Identity,
    what: &str,
    settled: impl Fn(&Option<RecordSnapshot>) -> bool,
) -> Option<RecordSnapshot> {
    let now = tokio::time::timeout(BOUND, store.fetch(id))
        .await
        .unwrap_or_else(|_| panic!("{what}: fetch hung"))
        .expect("fetch");
    if settled(&now) {
        return now;
    }
    let left = tokio::time::timeout(
        BOUND + Duration::from_secs(5),
        store.finish_background_work(BOUND),
    )
    .await
    .unwrap_or_else(|_| panic!("{what}: finish_background_work overran its own bound"));
    assert_eq!(
        left, 0,
        "{what}: the store's work for the dropped call did not finish"
    );
    tokio::time::timeout(BOUND, store.fetch(id))
        .await
        .unwrap_or_else(|_| panic!("{what}: fetch hung"))
        .expect("fetch")
}

/// A retry of the key, bounded; answers its outcome.
async fn retried<F: Future<Output = Result<u32, Error>>>(retry: F, what: &str) -> Option<Outcome> {
    let (answer, outcome) = tokio::time::timeout(BOUND, with_outcome(retry))
        .await
        .unwrap_or_else(|_| panic!("{what}: the retry hung"));
    assert_eq!(
        answer.unwrap_or_else(|e| panic!("{what}: the retry failed: {e}")),
        7
    );
    outcome
}

/// Store mode without a hook, dropped after each number of polls.
async fn sweep_store_mode(inner: Arc<dyn Store>) {
    let store = Yielding(inner);
    let tenant = fresh_tenant();
    for polls in 0..MOST_POLLS {
        let key = format!("k{polls}");
        let what = format!("{} store mode, dropped after {polls} polls", store.name());
        let id = Identity::new(&tenant, "sweep.store", &key).expect("identity");
        let body = Body::default();
        let ended = poll_then_drop(charge(&store, &tenant, &key, &body), polls).await;
        let finished = body.finished.load(Ordering::SeqCst);
        let record = settled_record(&store, &id, &what, |r| match r {
            None => !finished,
            Some(r) => r.state == RecordState::Complete,
        })
        .await;
        match &record {
            None => assert!(
                !finished,
                "{what}: the body finished, its answer was not recorded"
            ),
            Some(r) if r.state == RecordState::Complete => {
                assert!(finished, "{what}: recorded without the body finishing")
            }
            Some(r) => panic!("{what}: the record was left in progress: {r:?}"),
        }
        eprintln!("{what}: settled at {:?}", std::time::Instant::now());
        let outcome = retried(charge(&store, &tenant, &key, &body), &what).await;
        eprintln!("{what}: retried at {:?}", std::time::Instant::now());
        let runs = body.runs.load(Ordering::SeqCst);
        if finished {
            assert_eq!(outcome, Some(Outcome::Replayed), "{what}");
            assert_eq!(runs, 1, "{what}: the body ran again after it finished");
        } else {
            assert_eq!(outcome, Some(Outcome::Executed), "{what}");
        }
        if ended {
            eprintln!("{what}: ended by itself");
            return;
        }
    }
    panic!("the call never ended by itself");
}

/// Store mode with a `recover` hook, each call a takeover of a record whose
/// owner died (its lease ended), dropped after each number of polls.
async fn sweep_takeover_with_hook(inner: Arc<dyn Store>) {
    let store = Yielding(inner);
    let tenant = fresh_tenant();
    for polls in 0..MOST_POLLS {
        let key = format!("k{polls}");
        let what = format!(
            "{} takeover with a hook, dropped after {polls} polls",
            store.name()
        );
        let id = Identity::new(&tenant, "sweep.hooked", &key).expect("identity");
        let hour = Duration::from_secs(3600);
        let dead = common::records::acquire(store.0.as_ref(), &id, None, hour, hour).await;
        assert_eq!(
            store
                .0
                .heartbeat(&id, &dead, Duration::ZERO)
                .await
                .expect("end the lease"),
            Fenced::Written
        );
        let body = Body::default();
        let ended = poll_then_drop(charge_hooked(&store, &tenant, &key, &body), polls).await;
        let finished = body.finished.load(Ordering::SeqCst);
        // The dead owner's record (attempt 1) has its lease ended already:
        // seen so, the dropped call's takeover may still be on its way, and
        // only the store's work for the dropped call (which waits for it)
        // says how it ended.
        let record = settled_record(&store, &id, &what, |r| match r {
            None => false,
            Some(r) if r.state == RecordState::Complete => true,
            Some(r) => {
                r.attempt > 1
                    && !finished
                    && r.lease_expires_at_ms.is_some_and(|end| end <= r.now_ms)
            }
        })
        .await;
        match &record {
            None => panic!("{what}: the record was released, for a blind re-run"),
            Some(r) if r.state == RecordState::Complete => {
                assert!(finished, "{what}: recorded without the body finishing")
            }
            Some(r) => {
                assert!(
                    !finished,
                    "{what}: the body finished, its answer was not recorded"
                );
                assert!(
                    r.lease_expires_at_ms.is_some_and(|end| end <= r.now_ms),
                    "{what}: left in progress with a live lease: {r:?}"
                );
            }
        }
        let outcome = retried(charge_hooked(&store, &tenant, &key, &body), &what).await;
        let runs = body.runs.load(Ordering::SeqCst);
        if finished {
            assert_eq!(outcome, Some(Outcome::Replayed), "{what}");
            assert_eq!(runs, 1, "{what}: the body ran again after it finished");
        }
        if ended {
            eprintln!("{what}: ended by itself");
            return;
        }
    }
    panic!("the call never ended by itself");
}

/// Store mode with a `recover` hook that finds the side effect, each call a
/// takeover of a record whose owner died, dropped after each number of
/// polls: the body never runs, and the record is never released for a
/// blind re-run (in progress with its lease ended, or the hook's answer).
async fn sweep_takeover_whose_hook_finds_it(inner: Arc<dyn Store>) {
    let store = Yielding(inner);
    let tenant = fresh_tenant();
    let body = Body::default();
    for polls in 0..MOST_POLLS {
        let key = format!("k{polls}");
        let what = format!(
            "{} hook that finds it, dropped after {polls} polls",
            store.name()
        );
        let id = Identity::new(&tenant, "sweep.found", &key).expect("identity");
        let hour = Duration::from_secs(3600);
        let dead = common::records::acquire(store.0.as_ref(), &id, None, hour, hour).await;
        assert_eq!(
            store
                .0
                .heartbeat(&id, &dead, Duration::ZERO)
                .await
                .expect("end the lease"),
            Fenced::Written
        );
        let ended = poll_then_drop(charge_found(&store, &tenant, &key, &body), polls).await;
        // As in `sweep_takeover_with_hook`: the dead owner's record is not
        // yet how the dropped call left it.
        let record = settled_record(&store, &id, &what, |r| match r {
            None => false,
            Some(r) if r.state == RecordState::Complete => true,
            Some(r) => r.attempt > 1 && r.lease_expires_at_ms.is_some_and(|end| end <= r.now_ms),
        })
        .await;
        match &record {
            None => panic!("{what}: the record was released, for a blind re-run"),
            Some(r) if r.state == RecordState::Complete => {
                assert!(r.recovered, "{what}: complete, not by the hook: {r:?}")
            }
            Some(r) => assert!(
                r.lease_expires_at_ms.is_some_and(|end| end <= r.now_ms),
                "{what}: left in progress with a live lease: {r:?}"
            ),
        }
        let outcome = retried(charge_found(&store, &tenant, &key, &body), &what).await;
        assert!(
            matches!(outcome, Some(Outcome::Recovered | Outcome::Replayed)),
            "{what}: {outcome:?}"
        );
        assert_eq!(body.runs.load(Ordering::SeqCst), 0, "{what}: the body ran");
        if ended {
            eprintln!("{what}: ended by itself");
            return;
        }
    }
    panic!("the call never ended by itself");
}

/// The three sweeps at once, each on a store of its own (its own pool and
/// background worker) that `open` makes: a drop point whose store work takes
/// a while (a release that keeps looking for a reservation that may land
/// late, about 9 s) holds up its own sweep only, as a sweep waits for all of
/// its store's background work before it looks at the record.
async fn all_three<F, Fut>(open: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn Store>>,
{
    let (a, b, c) = tokio::join!(open(), open(), open());
    tokio::join!(
        sweep_store_mode(a),
        sweep_takeover_with_hook(b),
        sweep_takeover_whose_hook_finds_it(c),
    );
}

#[tokio::test]
async fn memory_a_call_dropped_at_any_await_point() {
    all_three(|| async { Arc::new(MemoryStore::new()) as Arc<dyn Store> }).await;
}

#[tokio::test]
async fn sqlite_a_call_dropped_at_any_await_point() {
    let url = common::scratch::sqlite_url("sweep");
    all_three(|| async {
        Arc::new(SqliteStore::connect(&url).await.expect("open")) as Arc<dyn Store>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_call_dropped_at_any_await_point() {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    all_three(|| async {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&common::servers::pg_url())
            .await
            .expect("pool");
        Arc::new(
            idempotent_runtime::PgStore::from_pool(pool)
                .await
                .expect("store"),
        ) as Arc<dyn Store>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_call_dropped_at_any_await_point() {
    if mysql_store_or_skip().await.is_none() {
        return;
    }
    all_three(|| async {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&common::servers::mysql_url())
            .await
            .expect("pool");
        Arc::new(
            idempotent_runtime::MySqlStore::from_pool(pool)
                .await
                .expect("store"),
        ) as Arc<dyn Store>
    })
    .await;
}

// ------------------------------------------------------------ transactional mode

const PG_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_sweep_charges (
    tenant TEXT NOT NULL, idem_key TEXT NOT NULL)";
const MY_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_sweep_charges (
    tenant VARCHAR(100) NOT NULL, idem_key VARCHAR(255) NOT NULL) ENGINE = InnoDB";
const LITE_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_sweep_charges (
    tenant TEXT NOT NULL, idem_key TEXT NOT NULL)";

/// A transactional charge on database `$db`: its business row written in
/// the caller's transaction (`$insert`), then the body.
macro_rules! charge_in {
    ($db:ty, $scope:literal, $insert:literal, $name:ident) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(body), ttl = "1h", in_progress = wait("20s"))]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            body: &Body,
        ) -> Result<u32, Error> {
            sqlx::query($insert)
                .bind(tenant)
                .bind(key)
                .execute(&mut **tx)
                .await
                .map_err(|e| Error::Store(StoreError::new("test", "business write", e)))?;
            Ok(body.run().await)
        }
    };
}

charge_in!(
    sqlx::Postgres,
    "sweep.tx_pg",
    "INSERT INTO idempotent_sweep_charges (tenant, idem_key) VALUES ($1, $2)",
    pg_charge_in
);
charge_in!(
    sqlx::MySql,
    "sweep.tx_my",
    "INSERT INTO idempotent_sweep_charges (tenant, idem_key) VALUES (?, ?)",
    my_charge_in
);
charge_in!(
    sqlx::Sqlite,
    "sweep.tx_lite",
    "INSERT INTO idempotent_sweep_charges (tenant, idem_key) VALUES (?, ?)",
    lite_charge_in
);

/// One transactional call and its commit, on `pool`.
macro_rules! tx_call {
    ($pool:expr, $charge:ident, $tenant:expr, $key:expr, $body:expr) => {
        async {
            let mut tx = $pool
                .begin()
                .await
                .map_err(|e| Error::Store(StoreError::new("test", "begin", e)))?;
            let answer = $charge(&mut tx, $tenant, $key, $body).await?;
            tx.commit()
                .await
                .map_err(|e| Error::Store(StoreError::new("test", "commit", e)))?;
            Ok::<u32, Error>(answer)
        }
    };
}

/// Transactional mode on a pool of one connection, dropped after each
/// number of polls (the transaction with it); `count` reads the business
/// rows of a key through the pool.
macro_rules! sweep_tx {
    ($pool:expr, $charge:ident, $count:expr) => {{
        let pool = $pool;
        let tenant = fresh_tenant();
        let mut ended = false;
        for polls in 0..MOST_POLLS {
            let key = format!("k{polls}");
            let what = format!("{} dropped after {polls} polls", stringify!($charge));
            let body = Body::default();
            ended = poll_then_drop(tx_call!(pool, $charge, &tenant, &key, &body), polls).await;
            let rows: i64 = tokio::time::timeout(BOUND, $count(&pool, &tenant, &key))
                .await
                .unwrap_or_else(|_| panic!("{what}: the pool's one connection is stuck"));
            assert!(rows <= 1, "{what}: {rows} business rows");
            let outcome = retried(tx_call!(pool, $charge, &tenant, &key, &body), &what).await;
            let after: i64 = $count(&pool, &tenant, &key).await;
            assert_eq!(after, 1, "{what}: business rows after the retry");
            if rows == 1 {
                assert_eq!(
                    outcome,
                    Some(Outcome::Replayed),
                    "{what}: committed, not replayed"
                );
                assert_eq!(body.runs.load(Ordering::SeqCst), 1, "{what}");
            } else {
                assert_eq!(
                    outcome,
                    Some(Outcome::Executed),
                    "{what}: rolled back, yet replayed"
                );
            }
            if ended {
                eprintln!("{what}: ended by itself");
                break;
            }
        }
        assert!(ended, "the call never ended by itself");
    }};
}

async fn pg_rows(pool: &sqlx::PgPool, tenant: &str, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM idempotent_sweep_charges WHERE tenant = $1 AND idem_key = $2",
    )
    .bind(tenant)
    .bind(key)
    .fetch_one(pool)
    .await
    .expect("count")
}

async fn my_rows(pool: &sqlx::MySqlPool, tenant: &str, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM idempotent_sweep_charges WHERE tenant = ? AND idem_key = ?",
    )
    .bind(tenant)
    .bind(key)
    .fetch_one(pool)
    .await
    .expect("count")
}

async fn lite_rows(pool: &sqlx::SqlitePool, tenant: &str, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM idempotent_sweep_charges WHERE tenant = ? AND idem_key = ?",
    )
    .bind(tenant)
    .bind(key)
    .fetch_one(pool)
    .await
    .expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_transactional_call_dropped_at_any_await_point() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    common::servers::pg_create_tables(store.pool(), PG_DDL)
        .await
        .expect("ddl");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&common::servers::pg_url())
        .await
        .expect("pool");
    sweep_tx!(pool, pg_charge_in, pg_rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_transactional_call_dropped_at_any_await_point() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    sqlx::query(MY_DDL)
        .execute(store.pool())
        .await
        .expect("ddl");
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&common::servers::mysql_url())
        .await
        .expect("pool");
    sweep_tx!(pool, my_charge_in, my_rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_transactional_call_dropped_at_any_await_point() {
    let url = common::scratch::sqlite_url("sweep_tx");
    let store = SqliteStore::connect(&url).await.expect("open");
    sqlx::query(LITE_DDL)
        .execute(store.pool())
        .await
        .expect("ddl");
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("pool");
    sweep_tx!(pool, lite_charge_in, lite_rows);
}

// ------------------------------------------- transactional mode, mid-statement

/// A transactional call (and its transaction) dropped while the answer to
/// its reservation is held on its way back (the statement ran on the server,
/// the row locked in the caller's transaction), on a pool of one connection
/// through the fault proxy. Once the answer goes on, the next call on that
/// pool gets the connection back outside any transaction, finds the key
/// free (the reservation rolled back with the transaction) and runs once.
macro_rules! dropped_mid_reservation {
    ($name:expr, $proxy:expr, $pool:expr, $charge:ident, $count:expr) => {{
        let (proxy, pool) = ($proxy, $pool);
        let tenant = fresh_tenant();
        let key = format!("mid-{}", uuid::Uuid::new_v4().simple());
        let body = Body::default();
        let _held = proxy.stall_on_next_request_containing(
            key.as_bytes(),
            common::proxy::Stall::ToClientOnly,
        );
        tokio::select! {
            answer = tx_call!(pool, $charge, &tenant, &key, &body) => {
                panic!("{}: the call answered while its reservation's answer was held: {answer:?}", $name)
            }
            _ = proxy.wait_held(common::proxy::Direction::ToClient) => {}
        }
        // The call and its transaction are dropped; the answer goes on.
        proxy.release_stall();
        let outcome = retried(tx_call!(pool, $charge, &tenant, &key, &body), $name).await;
        assert_eq!(outcome, Some(Outcome::Executed), "{}", $name);
        assert_eq!(body.runs.load(Ordering::SeqCst), 1, "{}", $name);
        let rows: i64 = $count(&pool, &tenant, &key).await;
        assert_eq!(rows, 1, "{}: business rows", $name);
        let again = retried(tx_call!(pool, $charge, &tenant, &key, &body), $name).await;
        assert_eq!(again, Some(Outcome::Replayed), "{}", $name);
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_transactional_call_dropped_mid_reservation_leaves_its_connection_clean() {
    let Some((proxy, store)) = crate::connection_faults::through_a_proxy::postgres(1).await else {
        return;
    };
    common::servers::pg_create_tables(store.pool(), PG_DDL)
        .await
        .expect("ddl");
    let pool = store.pool().clone();
    dropped_mid_reservation!("postgres", &proxy, pool, pg_charge_in, pg_rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_transactional_call_dropped_mid_reservation_leaves_its_connection_clean() {
    let Some((proxy, store)) = crate::connection_faults::through_a_proxy::mariadb(1).await else {
        return;
    };
    sqlx::query(MY_DDL)
        .execute(store.pool())
        .await
        .expect("ddl");
    let pool = store.pool().clone();
    dropped_mid_reservation!("mariadb", &proxy, pool, my_charge_in, my_rows);
}

// ------------------------------------------- transactional mode, runtime shut down

/// Told when a transactional body below has written its business row (one
/// per database: `cargo test` runs the two tests in one process).
static PG_GATE: std::sync::LazyLock<tokio::sync::Notify> =
    std::sync::LazyLock::new(tokio::sync::Notify::new);
static MY_GATE: std::sync::LazyLock<tokio::sync::Notify> =
    std::sync::LazyLock::new(tokio::sync::Notify::new);

#[idempotent(scope = "sweep.tx_pg_held", key = key, tenant = tenant, tx = tx, skip(body),
             ttl = "1h", in_progress = wait("20s"))]
async fn pg_charge_held(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
    body: &Body,
) -> Result<u32, Error> {
    sqlx::query("INSERT INTO idempotent_sweep_charges (tenant, idem_key) VALUES ($1, $2)")
        .bind(tenant)
        .bind(key)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Store(StoreError::new("test", "business write", e)))?;
    if body.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        PG_GATE.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(7)
}

#[idempotent(scope = "sweep.tx_my_held", key = key, tenant = tenant, tx = tx, skip(body),
             ttl = "1h", in_progress = wait("20s"))]
async fn my_charge_held(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
    body: &Body,
) -> Result<u32, Error> {
    sqlx::query("INSERT INTO idempotent_sweep_charges (tenant, idem_key) VALUES (?, ?)")
        .bind(tenant)
        .bind(key)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Store(StoreError::new("test", "business write", e)))?;
    if body.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        MY_GATE.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(7)
}

/// A transactional call whose runtime is shut down while its body runs (its
/// reservation and business row uncommitted), on a pool of one connection
/// opened on another runtime (kept running): the transaction ends with the
/// call, and a call on a third runtime, through the same pool, finds the key
/// free, runs once and commits.
macro_rules! shut_down_mid_body {
    ($name:expr, $pool:expr, $charge:ident, $count:expr, $gate:expr) => {{
        let pool = $pool;
        let tenant = fresh_tenant();
        let key = format!("shut-{}", uuid::Uuid::new_v4().simple());
        let body = Arc::new(Body::default());
        let doomed = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        {
            let (pool, tenant, key, body) =
                (pool.clone(), tenant.clone(), key.clone(), body.clone());
            doomed.spawn(async move {
                let _ = tx_call!(pool, $charge, &tenant, &key, &body).await;
            });
        }
        tokio::time::timeout(BOUND, $gate.notified())
            .await
            .expect("the body ran");
        // Shut down on a thread of its own (not from inside this runtime).
        std::thread::spawn(move || drop(doomed))
            .join()
            .expect("shut down");
        let third = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let (p, t, k, b) = (pool.clone(), tenant.clone(), key.clone(), body.clone());
        let outcome = std::thread::spawn(move || {
            third.block_on(async move {
                let outcome = retried(tx_call!(p, $charge, &t, &k, &b), $name).await;
                let rows: i64 = $count(&p, &t, &k).await;
                (outcome, rows)
            })
        })
        .join()
        .expect("the third runtime's call");
        assert_eq!(outcome, (Some(Outcome::Executed), 1), "{}", $name);
        assert_eq!(body.runs.load(Ordering::SeqCst), 2, "{}", $name);
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_transactional_call_shut_down_mid_body_frees_its_connection() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    common::servers::pg_create_tables(store.pool(), PG_DDL)
        .await
        .expect("ddl");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&common::servers::pg_url())
        .await
        .expect("pool");
    shut_down_mid_body!("postgres", pool, pg_charge_held, pg_rows, PG_GATE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_transactional_call_shut_down_mid_body_frees_its_connection() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    sqlx::query(MY_DDL)
        .execute(store.pool())
        .await
        .expect("ddl");
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&common::servers::mysql_url())
        .await
        .expect("pool");
    shut_down_mid_body!("mariadb", pool, my_charge_held, my_rows, MY_GATE);
}
