//! What the engine asks of its store, and what it writes to the logs.
//!
//! - DESIGN §5: per call, one reservation and one completion; a replay is one
//!   reservation and nothing else; fast bodies never heartbeat.
//! - Rule 9: a long body heartbeats; a failing heartbeat is visible (log + metric).
//! - Rule 2: raw keys never appear in logs — the scope and a short digest do.
//!
//! `Counting` wraps a real `MemoryStore` and counts the calls that reach it.

use idempotent_runtime::{
    idempotent, Completion, Error, Fenced, Identity, MemoryStore, OwnerToken, RecordSnapshot,
    Reservation, ReserveRequest, ScopeStats, Store, StoreError,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Calls {
    reserve: AtomicUsize,
    complete: AtomicUsize,
    release: AtomicUsize,
    heartbeat: AtomicUsize,
    /// Reads of a record (`fetch`), which no common path makes.
    fetch: AtomicUsize,
}

struct Counting {
    inner: MemoryStore,
    calls: Calls,
    fail_heartbeats: AtomicBool,
    /// Renewals answer that another caller owns the record.
    heartbeats_lose: AtomicBool,
    fail_releases: AtomicBool,
    detached_releases: AtomicUsize,
}

impl Counting {
    fn new() -> Self {
        Counting {
            inner: MemoryStore::new(),
            calls: Calls::default(),
            fail_heartbeats: AtomicBool::new(false),
            heartbeats_lose: AtomicBool::new(false),
            fail_releases: AtomicBool::new(false),
            detached_releases: AtomicUsize::new(0),
        }
    }
    fn counts(&self) -> [usize; 4] {
        let c = &self.calls;
        [&c.reserve, &c.complete, &c.release, &c.heartbeat].map(|a| a.load(Ordering::SeqCst))
    }
}

#[async_trait::async_trait]
impl Store for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.calls.reserve.fetch_add(1, Ordering::SeqCst);
        self.inner.reserve(r).await
    }
    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        self.calls.complete.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(completion).await
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        self.calls.release.fetch_add(1, Ordering::SeqCst);
        if self.fail_releases.load(Ordering::SeqCst) {
            return Err(StoreError::new("counting", "release", "injected failure"));
        }
        self.inner.release(i, t).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        self.calls.heartbeat.fetch_add(1, Ordering::SeqCst);
        if self.fail_heartbeats.load(Ordering::SeqCst) {
            return Err(StoreError::new("counting", "heartbeat", "injected failure"));
        }
        if self.heartbeats_lose.load(Ordering::SeqCst) {
            return Ok(Fenced::NotOwner);
        }
        self.inner.heartbeat(i, t, lease).await
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.calls.release.fetch_add(1, Ordering::SeqCst);
        self.detached_releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release_detached(i, t)
    }
    fn complete_detached(&self, completion: Completion<'_>) {
        self.calls.complete.fetch_add(1, Ordering::SeqCst);
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
        self.calls.fetch.fetch_add(1, Ordering::SeqCst);
        self.inner.fetch(i).await
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.inner.scope_stats().await
    }
}

#[idempotent(scope = "accounting.quick", key = key, tenant = tenant, store = store)]
async fn quick(store: &Counting, tenant: &str, key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount)
}

#[idempotent(scope = "accounting.slow", key = key, tenant = tenant, store = store,
             lease = "150ms", skip(pause_ms))]
async fn slow(store: &Counting, tenant: &str, key: &str, pause_ms: u64) -> Result<u64, Error> {
    tokio::time::sleep(Duration::from_millis(pause_ms)).await;
    Ok(pause_ms)
}

#[idempotent(scope = "accounting.failing", key = key, tenant = tenant, store = store)]
async fn failing(store: &Counting, tenant: &str, key: &str) -> Result<u64, Error> {
    Err(Error::NoDefaultStore {
        scope: "the body's own error".into(),
    })
}

/// Rule 14: a release that fails (the body's error is released by default) is
/// not left to the lease: the store is handed it to retry in the background.
#[tokio::test]
async fn a_failed_release_is_handed_to_the_store() {
    let store = Counting::new();
    store.fail_releases.store(true, Ordering::SeqCst);
    assert!(failing(&store, "t", "k").await.is_err());
    assert_eq!(store.detached_releases.load(Ordering::SeqCst), 1);
    let id = Identity::new("t", "accounting.failing", "k").unwrap();
    assert_eq!(
        store.inner.fetch(&id).await.unwrap(),
        None,
        "the key is free"
    );

    // A release that works is not handed over a second time.
    store.fail_releases.store(false, Ordering::SeqCst);
    assert!(failing(&store, "t", "k2").await.is_err());
    assert_eq!(store.detached_releases.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_fresh_call_reserves_once_and_completes_once_and_a_replay_only_reserves() {
    let store = Counting::new();
    assert_eq!(quick(&store, "t", "k", 5).await.unwrap(), 5);
    assert_eq!(
        store.counts(),
        [1, 1, 0, 0],
        "[reserve, complete, release, heartbeat] for a fresh call"
    );
    assert_eq!(quick(&store, "t", "k", 5).await.unwrap(), 5);
    assert_eq!(
        store.counts(),
        [2, 1, 0, 0],
        "a replay costs one reservation and nothing else"
    );
    assert_eq!(
        store.calls.fetch.load(Ordering::SeqCst),
        0,
        "neither a fresh call nor a replay reads the record"
    );
    assert!(matches!(
        quick(&store, "t", "k", 6).await,
        Err(Error::FingerprintMismatch(_))
    ));
    // The reservation answers the mismatch; one read of the record then
    // tells whether a newer version made it (`RecordedByNewerVersion`, the
    // README's Upgrades) and what refused the call (a message consumer's
    // verdict). No write.
    assert_eq!(
        store.counts(),
        [3, 1, 0, 0],
        "a mismatch is answered by the reservation and writes nothing"
    );
    assert_eq!(
        store.calls.fetch.load(Ordering::SeqCst),
        1,
        "a mismatch reads the record once"
    );
}

// Paused clock: a starved process neither renews early nor finds its
// reservation answered late (which a renewal would confirm).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_long_body_heartbeats_and_a_fast_one_never_does() {
    let store = Counting::new();
    slow(&store, "t", "fast", 0).await.unwrap();
    assert_eq!(store.counts()[3], 0, "a fast body never heartbeats");
    slow(&store, "t", "long", 400).await.unwrap();
    assert!(
        store.counts()[3] >= 3,
        "a 400 ms body under a 150 ms lease renews every 50 ms: {:?}",
        store.counts()
    );
}

// Paused clock: a starved process neither renews early nor finds its
// reservation answered late (which a renewal would confirm).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_failing_heartbeat_is_counted_and_logged() {
    let logs = capture_logs();
    let store = Counting::new();
    store.fail_heartbeats.store(true, Ordering::SeqCst);
    let before = idempotent_runtime::metrics::snapshot().heartbeat_failures;
    slow(&store, "t", "hb-fails", 300).await.unwrap();
    let after = idempotent_runtime::metrics::snapshot().heartbeat_failures;
    assert!(
        after > before,
        "heartbeat failures are counted ({before} -> {after})"
    );
    let text = logs.lock().unwrap().clone();
    assert!(text.contains("heartbeat failed"), "and logged:\n{text}");
}

#[idempotent(scope = "accounting.blocking", key = key, tenant = tenant, store = store,
             lease = "30ms")]
async fn blocks_its_thread(store: &Counting, tenant: &str, key: &str) -> Result<u64, Error> {
    tokio::task::yield_now().await;
    // A blocking call in an async body: on this current-thread runtime
    // nothing else runs, the heartbeat included, for five leases.
    std::thread::sleep(Duration::from_millis(150));
    // Long enough for the renewal that was due to be sent.
    tokio::time::sleep(Duration::from_millis(40)).await;
    Ok(1)
}

#[idempotent(scope = "accounting.blocking_returns", key = key, tenant = tenant, store = store,
             lease = "30ms")]
async fn blocks_its_thread_then_returns(
    store: &Counting,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    // No await at all: no renewal is ever sent.
    std::thread::sleep(Duration::from_millis(150));
    Ok(1)
}

#[idempotent(scope = "accounting.lost_then_runs", key = key, tenant = tenant, store = store,
             lease = "30ms")]
async fn runs_on_after_losing(store: &Counting, tenant: &str, key: &str) -> Result<u64, Error> {
    tokio::time::sleep(Duration::from_millis(150)).await;
    Ok(1)
}

/// A lease lost to another caller is reported as lost, once: the renewals
/// stop, and the body that goes on running (without blocking) is not then
/// reported as having blocked its thread.
// On tokio's paused clock (the memory store's clock too): a starved test
// process cannot let the 30 ms lease lapse before its first renewal.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lost_lease_is_not_also_reported_as_a_lapse() {
    let logs = capture_logs();
    let store = Counting::new();
    store.heartbeats_lose.store(true, Ordering::SeqCst);
    let tenant = format!("t-{}", uuid::Uuid::new_v4().simple());
    // (The wrapped store still holds the record as ours, so the completion
    // is written: only the renewals said it was lost.)
    runs_on_after_losing(&store, &tenant, "lost").await.unwrap();
    let ours = lines_about(&logs, &tenant, "accounting.lost_then_runs", "lost");
    assert!(
        ours.iter().any(|l| l.contains("lease was lost")),
        "{ours:#?}"
    );
    assert!(
        !ours.iter().any(|l| l.contains("lease lapsed")),
        "{ours:#?}"
    );
}

/// The same lapse when the body returns straight after blocking: no renewal
/// is sent to notice it, so the end of the body does.
#[tokio::test]
async fn a_lease_that_lapsed_before_the_body_returned_is_logged() {
    let logs = capture_logs();
    let store = Counting::new();
    let tenant = format!("t-{}", uuid::Uuid::new_v4().simple());
    let call = blocks_its_thread_then_returns(&store, &tenant, "blocked");
    let lapsed = a_lapse_is_counted_and_logged(
        &logs,
        (&tenant, "accounting.blocking_returns", "blocked"),
        call,
    );
    lapsed.await.unwrap();
}

/// Runs `call` (of `key` of `scope`, under `tenant`) and checks that a
/// lease lapse was counted and logged for its record.
async fn a_lapse_is_counted_and_logged<F: std::future::Future>(
    logs: &Mutex<String>,
    (tenant, scope, key): (&str, &str, &str),
    call: F,
) -> F::Output {
    let lapses = idempotent_runtime::metrics::snapshot().lease_lapses;
    let out = call.await;
    assert!(
        idempotent_runtime::metrics::snapshot().lease_lapses > lapses,
        "and counted"
    );
    let ours = lines_about(logs, tenant, scope, key);
    assert!(
        ours.iter().any(|line| line.contains("lease lapsed")),
        "the lapse is logged: {ours:#?}"
    );
    out
}

/// Rule 9: a heartbeat that could not renew in time is visible. A body that
/// blocks its thread stops its own heartbeat (it is driven by the call's
/// future); when the overdue renewal is finally sent, the lease had already
/// lapsed and any caller could have taken the record over. That lapse was
/// silent when nobody did (the late renewal simply succeeded): now it is
/// logged and counted as a lease lapse.
#[tokio::test]
async fn a_lease_that_lapsed_while_the_body_blocked_its_thread_is_logged() {
    let logs = capture_logs();
    let store = Counting::new();
    let tenant = format!("t-{}", uuid::Uuid::new_v4().simple());
    let call = blocks_its_thread(&store, &tenant, "blocked");
    let lapsed =
        a_lapse_is_counted_and_logged(&logs, (&tenant, "accounting.blocking", "blocked"), call);
    lapsed.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_carry_the_scope_and_a_digest_never_the_raw_key() {
    let logs = capture_logs();
    let store = Arc::new(Counting::new());
    let secret = "sk_live_SECRET-KEY-4242";
    quick(&store, "tenant-x", secret, 1).await.unwrap(); // executed
    quick(&store, "tenant-x", secret, 1).await.unwrap(); // replayed
    let _ = quick(&store, "tenant-x", secret, 2).await; // mismatch
    let running = {
        let store = store.clone();
        tokio::spawn(async move { slow(&store, "tenant-x", secret, 300).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = slow(&store, "tenant-x", secret, 300).await; // waits, then replays
    running.await.unwrap().unwrap();
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        slow(&store, "tenant-x", "sk_live_SECRET-dropped", 5_000),
    )
    .await;
    assert!(dropped.is_err());

    let text = logs.lock().unwrap().clone();
    let digest = Identity::new("tenant-x", "accounting.quick", secret)
        .unwrap()
        .key_digest();
    for expected in [
        "executed",
        "replayed",
        "refused",
        "accounting.quick",
        digest.as_str(),
    ] {
        assert!(
            text.contains(expected),
            "logs mention {expected:?}:\n{text}"
        );
    }
    assert!(
        !text.contains("SECRET"),
        "a raw key reached the logs:\n{text}"
    );
}

/// Captures every event (any level, any thread) into one process-wide buffer.
/// Tests only look for what they themselves caused, so sharing it is fine.
/// The captured log lines about one record (they name its key's digest).
fn lines_about(logs: &Mutex<String>, tenant: &str, scope: &str, key: &str) -> Vec<String> {
    let digest = Identity::new(tenant, scope, key).unwrap().key_digest();
    logs.lock()
        .unwrap()
        .lines()
        .filter(|line| line.contains(digest.as_str()))
        .map(str::to_owned)
        .collect()
}

pub(crate) fn capture_logs() -> Arc<Mutex<String>> {
    static LOGS: std::sync::OnceLock<Arc<Mutex<String>>> = std::sync::OnceLock::new();
    #[derive(Clone)]
    struct Buf(Arc<Mutex<String>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().push_str(&String::from_utf8_lossy(b));
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(String::new()));
        let writer = Buf(buf.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other subscriber in this test binary");
        buf
    })
    .clone()
}

/// A recover hook that blocks its thread for five leases before it answers.
async fn blocking_hook(
    _: &idempotent_runtime::Takeover,
) -> Result<idempotent_runtime::Recovery<u64>, Error> {
    tokio::task::yield_now().await;
    std::thread::sleep(Duration::from_millis(150));
    Ok(idempotent_runtime::Recovery::Completed(7))
}

#[idempotent(scope = "accounting.blocking_hook", key = key, tenant = tenant, store = store,
             lease = "30ms", recover = blocking_hook)]
async fn recovered_by_a_blocking_hook(
    store: &Counting,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    Ok(1)
}

/// Rule 9 for the hook as for a body: a lease that lapsed while the recover
/// hook blocked its thread is logged and counted.
#[tokio::test]
async fn a_lease_that_lapsed_while_the_recover_hook_blocked_is_logged() {
    let logs = capture_logs();
    let store = Counting::new();
    let tenant = format!("t-{}", uuid::Uuid::new_v4().simple());
    let identity =
        idempotent_runtime::Identity::new(tenant.as_str(), "accounting.blocking_hook", "k")
            .unwrap();
    // What a crashed owner leaves: a record whose lease runs out at once.
    crate::common::records::acquire(
        &store,
        &identity,
        None,
        Duration::from_millis(1),
        Duration::from_secs(3600),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let call = recovered_by_a_blocking_hook(&store, &tenant, "k");
    let lapsed =
        a_lapse_is_counted_and_logged(&logs, (&tenant, "accounting.blocking_hook", "k"), call);
    assert_eq!(lapsed.await.unwrap(), 7);
}
