//! Calls polled by something other than a tokio runtime, and a tokio
//! runtime whose clock is paused.
//!
//! * Outside any runtime (a call handed to an executor of another kind on a
//!   thread of its own) the lease's heartbeat, a duplicate's wait and the SQL
//!   stores' connections cannot work: the call is refused with
//!   `Error::NoRuntime` before anything is reserved or run. It panicked
//!   inside sqlx, or, on the memory store, inside the heartbeat once the
//!   body had started.
//! * On a paused clock (tests with `start_paused`), a body blocked in
//!   `spawn_blocking` holds the clock still, and with it the heartbeat: the
//!   memory store judged leases by the real clock, so a duplicate took the
//!   record over and ran the body beside the first. Its clock is tokio's now.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{idempotent, Error, MemoryStore, SqliteStore, Store};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake};
use std::time::Duration;

/// Polls `future` to its end on this thread, with no runtime of any kind:
/// what an executor of another kind does.
fn block_on_without_a_runtime<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

/// Pending once (waking itself), then ready: a body that is not done at its
/// first poll, without needing any runtime.
struct PendingOnce(bool);

impl Future for PendingOnce {
    type Output = ();
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[idempotent(scope = "executors.plain", key = key, tenant = tenant, store = store, skip(runs))]
async fn plain(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    PendingOnce(false).await;
    Ok(7)
}

#[idempotent(scope = "executors.in_tx", key = key, tenant = tenant, tx = tx, skip(runs))]
async fn in_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

fn refused_outside_a_runtime(store: &dyn Store, tenant: &str) {
    let runs = AtomicUsize::new(0);
    let got = block_on_without_a_runtime(plain(store, tenant, "k", &runs));
    assert!(
        matches!(&got, Err(Error::NoRuntime { scope }) if scope == "executors.plain"),
        "{}: {got:?}",
        store.name()
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "{}: the body did not start",
        store.name()
    );
}

#[test]
fn a_call_outside_any_runtime_is_refused_before_anything_runs() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let tenant = fresh_tenant();
    let mut stores: Vec<Arc<dyn Store>> = vec![Arc::new(MemoryStore::new())];
    let file =
        std::env::temp_dir().join(format!("idempotent-executors-{}.db", uuid::Uuid::new_v4()));
    runtime.block_on(async {
        let url = format!("sqlite://{}?mode=rwc", file.display());
        stores.push(Arc::new(SqliteStore::connect(&url).await.expect("sqlite")));
        if let Some(pg) = pg_store_or_skip().await {
            stores.push(Arc::new(pg));
        }
        if let Some(mysql) = mysql_store_or_skip().await {
            stores.push(Arc::new(mysql));
        }
    });
    for store in &stores {
        refused_outside_a_runtime(&**store, &tenant);
        // The key is untouched: on the runtime, the call runs once and replays.
        let runs = AtomicUsize::new(0);
        for _ in 0..2 {
            let got = runtime.block_on(plain(&**store, &tenant, "k", &runs));
            assert_eq!(got.expect("runs on the runtime"), 7);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{}", store.name());
    }

    // Transactional mode: a transaction begun on the runtime, the call polled
    // outside it.
    let pool = runtime.block_on(async {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:")
            .await
            .expect("pool");
        SqliteStore::from_pool(pool.clone())
            .await
            .expect("migrated");
        pool
    });
    let mut tx = runtime.block_on(pool.begin()).expect("begin");
    let runs = AtomicUsize::new(0);
    let got = block_on_without_a_runtime(in_tx(&mut tx, &tenant, "k", &runs));
    assert!(matches!(got, Err(Error::NoRuntime { .. })), "{got:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    runtime.block_on(tx.rollback()).expect("rollback");
    drop(stores);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
    }
}

/// A runtime built without its timer (`enable_time`, or `enable_all`) is
/// refused the same way: the memory store reserved, the body started, and
/// the heartbeat's timer panicked; the unwinding released the key and the
/// retry ran the body again (review).
#[test]
fn a_call_on_a_runtime_without_a_timer_is_refused_before_anything_runs() {
    let untimed = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime without its timer");
    let store = MemoryStore::new();
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);
    let got = untimed.block_on(plain(&store, &tenant, "k", &runs));
    assert!(matches!(got, Err(Error::NoRuntime { .. })), "{got:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the body did not start");
    assert!(store.is_empty(), "nothing was reserved");
    // On a runtime with its timer the same thread's calls run.
    let timed = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    assert_eq!(
        timed
            .block_on(plain(&store, &tenant, "k", &runs))
            .expect("runs"),
        7
    );
    let again = untimed.block_on(plain(&store, &tenant, "k", &runs));
    assert!(matches!(again, Err(Error::NoRuntime { .. })), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[idempotent(scope = "executors.paused", key = key, tenant = shared, store = store,
             lease = "1s", in_progress = reject, skip(runs, release))]
async fn blocking_body(
    store: &MemoryStore,
    key: &str,
    runs: &AtomicUsize,
    release: Arc<std::sync::Mutex<std::sync::mpsc::Receiver<()>>>,
) -> Result<u32, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    // Blocked until the duplicate has had its answer: a paused clock stands
    // still meanwhile (tokio does not move it while a blocking task runs).
    tokio::task::spawn_blocking(move || {
        let waiting = release.lock().unwrap_or_else(|p| p.into_inner());
        let _ = waiting.recv_timeout(Duration::from_secs(60));
    })
    .await
    .expect("blocking task");
    Ok(n as u32)
}

/// The owner's body blocks in `spawn_blocking` while the duplicate arrives
/// more than a lease later by the real clock (a real sleep, also in
/// `spawn_blocking`). By the paused clock, the one the heartbeat follows, no
/// time has passed: the lease is live, the duplicate is refused, and the
/// body runs once. With the real clock the duplicate took the record over.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_paused_clock_drives_the_memory_stores_leases_as_it_drives_the_heartbeat() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = Arc::new(std::sync::Mutex::new(release_rx));
    let owner = {
        let (store, runs, release_rx) = (store.clone(), runs.clone(), release_rx.clone());
        tokio::spawn(async move { blocking_body(&store, "k", &runs, release_rx).await })
    };
    // Until the owner's body is under way.
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    tokio::task::spawn_blocking(|| std::thread::sleep(Duration::from_millis(1_200)))
        .await
        .expect("a real lease's time passes");
    let duplicate = blocking_body(&store, "k", &runs, release_rx.clone()).await;
    let _ = release_tx.send(());
    assert!(
        matches!(duplicate, Err(Error::InProgress { .. })),
        "the lease is live by the paused clock: {duplicate:?}"
    );
    assert_eq!(
        owner
            .await
            .expect("owner")
            .expect("the owner's result is recorded"),
        1
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
}
