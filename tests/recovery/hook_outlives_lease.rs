//! Rule 20 with rule 3: a takeover's `recover` hook runs under the call's
//! lease, renewed by the heartbeat. When the renewals do not land (a store
//! that stopped answering, a thread blocked, a process stopped) and the hook
//! outlives the lease, another caller takes the record over, asks its own
//! hook and runs the body. The first hook's later `Run` used to start the
//! body a second time; the call now confirms it still owns the record (a
//! fenced renewal) and answers `LeaseLost` without running it.
//!
//! Handshakes: the first owner's renewals never land (the store wrapper
//! holds them); the test waits until the store's clock shows its lease
//! over, lets a second caller take over and finish, and only then lets the
//! first hook answer.

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{
    idempotent, Error, Fenced, Identity, MemoryStore, OwnerToken, Recovery, Reservation,
    ReserveRequest, Store, StoreError, Takeover,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

const SCOPE: &str = "recovery.hook_outlives_lease";

#[derive(Default)]
struct Seen {
    /// The attempts the hook was asked about.
    asked: Vec<u32>,
    /// How many times the body ran.
    runs: u32,
}

static SEEN: LazyLock<Mutex<Seen>> = LazyLock::new(Default::default);
/// The first takeover's hook is asking.
static IN_HOOK: Notify = Notify::const_new();
/// The first takeover's hook may answer.
static ANSWER: Notify = Notify::const_new();

fn seen() -> std::sync::MutexGuard<'static, Seen> {
    SEEN.lock().unwrap_or_else(|p| p.into_inner())
}

async fn slow_hook(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    seen().asked.push(takeover.attempt());
    if takeover.attempt() == 2 {
        IN_HOOK.notify_one();
        ANSWER.notified().await;
    }
    Ok(Recovery::Run)
}

#[idempotent(scope = "recovery.hook_outlives_lease", key = key, tenant = shared, store = store,
             lease = "300ms", in_progress = reject, recover = slow_hook)]
async fn charge(store: &dyn Store, key: &str) -> Result<u32, Error> {
    let mut seen = seen();
    seen.runs += 1;
    Ok(seen.runs)
}

/// The owner whose renewal a store wrapper saw first: the call under test.
#[derive(Default)]
struct FirstRenewer(Mutex<Option<OwnerToken>>);

impl FirstRenewer {
    /// Whether `token` is that owner's (the first token asked about is).
    fn is(&self, token: &OwnerToken) -> bool {
        let mut first = self.0.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert_with(|| token.clone()) == token
    }
}

/// Holds every renewal of the first owner that renews (until `unstall`).
#[derive(Default)]
struct StallFirstRenewer {
    first: FirstRenewer,
    unstall: AtomicBool,
}

#[async_trait::async_trait]
impl Intercept for StallFirstRenewer {
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        let stall = !self.unstall.load(Ordering::SeqCst) && self.first.is(token);
        if stall {
            std::future::pending::<()>().await;
        }
        inner.heartbeat(identity, token, lease).await
    }
}

/// Takes the record for an owner of its own, with `lease`, that never
/// finishes (as one that crashed, or another caller).
async fn take(store: &dyn Store, identity: &Identity, lease: Duration) {
    let taken = store
        .reserve(ReserveRequest {
            identity,
            fingerprint: None,
            token: &OwnerToken::new(),
            lease,
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(matches!(taken, Reservation::Acquired { .. }), "{taken:?}");
}

/// Until the store's clock shows the record's lease over.
async fn lease_over(store: &dyn Store, identity: &Identity) {
    for _ in 0..2_000 {
        let record = store.fetch(identity).await.expect("fetch").expect("record");
        if record
            .lease_expires_at_ms
            .is_some_and(|end| end <= record.now_ms)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the lease never ran out");
}

#[tokio::test]
async fn a_hook_that_outlives_its_lease_does_not_run_the_body_after_another_takeover() {
    let store = Hooked::new(StallFirstRenewer::default());
    let identity = Identity::shared(SCOPE, "k").expect("identity");
    // An owner that crashed: reserved, never finished, its lease short.
    take(&store, &identity, Duration::from_millis(10)).await;
    lease_over(&store, &identity).await;

    // The first takeover asks its hook, which takes longer than its lease
    // (its renewals never land).
    let first = charge(&store, "k");
    let rest = async {
        IN_HOOK.notified().await;
        lease_over(&store, &identity).await;
        // A second takeover asks, runs the body and records its result.
        store.unstall.store(true, Ordering::SeqCst);
        let second = charge(&store, "k").await;
        ANSWER.notify_one();
        second
    };
    let (first, second) = tokio::join!(first, rest);
    assert_eq!(second.expect("the second takeover runs"), 1);
    assert!(
        matches!(first, Err(Error::LeaseLost(_))),
        "the first hook's Run came after its record was lost: {first:?}"
    );
    let (asked, runs) = {
        let seen = seen();
        (seen.asked.clone(), seen.runs)
    };
    assert_eq!(asked, [2, 3], "each takeover asked its hook");
    assert_eq!(runs, 1, "the body ran once");
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(
        serde_json::from_slice::<u32>(&record.outcome.expect("complete").payload).expect("u32"),
        1,
        "the second takeover's result stays recorded"
    );
}

/// Counts one owner's renewals and what they were answered.
#[derive(Default)]
struct CountRenewals {
    owner: FirstRenewer,
    /// Renewals of `owner` answered `NotOwner`, and those sent after the first such answer.
    not_owner: std::sync::atomic::AtomicUsize,
    after_lost: std::sync::atomic::AtomicUsize,
    first_written: Notify,
    lost: Notify,
}

#[async_trait::async_trait]
impl Intercept for CountRenewals {
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        let ours = self.owner.is(token);
        if ours && self.not_owner.load(Ordering::SeqCst) > 0 {
            self.after_lost.fetch_add(1, Ordering::SeqCst);
        }
        let answer = inner.heartbeat(identity, token, lease).await;
        if ours {
            match answer {
                Ok(Fenced::Written) => self.first_written.notify_one(),
                Ok(Fenced::NotOwner) => {
                    self.not_owner.fetch_add(1, Ordering::SeqCst);
                    self.lost.notify_one();
                }
                Err(_) => {}
            }
        }
        answer
    }
}

static BODY_GO: Notify = Notify::const_new();

#[idempotent(scope = "recovery.lost_lease_renewals", key = key, tenant = shared, store = store,
             lease = "30ms", in_progress = reject)]
async fn long_body(store: &dyn Store, key: &str) -> Result<u32, Error> {
    BODY_GO.notified().await;
    Ok(1)
}

/// A lease lost to another owner is not won back by renewing: the call stops
/// renewing at the first `NotOwner` (it went on every lease/3 for the rest
/// of the body, each one an ERROR log line and a counted failure). The
/// absence of renewals is watched for 30 renewal periods.
#[tokio::test]
async fn a_lost_lease_is_not_renewed_again() {
    let store = Hooked::new(CountRenewals::default());
    let identity = Identity::shared("recovery.lost_lease_renewals", "k").expect("identity");
    let call = long_body(&store, "k");
    let rest = async {
        store.first_written.notified().await;
        // An operator frees the record and another caller takes it.
        store
            .force_release(&identity, false)
            .await
            .expect("force release");
        take(&store, &identity, Duration::from_secs(3600)).await;
        store.lost.notified().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        BODY_GO.notify_one();
    };
    let (answer, ()) = tokio::join!(call, rest);
    assert!(matches!(answer, Err(Error::LeaseLost(_))), "{answer:?}");
    assert_eq!(
        store.not_owner.load(Ordering::SeqCst),
        1,
        "one renewal found the lease lost"
    );
    assert_eq!(
        store.after_lost.load(Ordering::SeqCst),
        0,
        "no renewal after the lease was lost"
    );
}

#[derive(Default)]
struct ConfirmSeen {
    asked: Vec<u32>,
    runs: u32,
}

static CONFIRM_SEEN: LazyLock<Mutex<ConfirmSeen>> = LazyLock::new(Default::default);
/// Set by the hook as it answers `Run`: the next renewal (the fenced check
/// that the call still owns the record) fails.
static FAIL_THE_CHECK: AtomicBool = AtomicBool::new(false);

fn confirm_seen() -> std::sync::MutexGuard<'static, ConfirmSeen> {
    CONFIRM_SEEN.lock().unwrap_or_else(|p| p.into_inner())
}

async fn run_hook(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    confirm_seen().asked.push(takeover.attempt());
    if takeover.attempt() == 2 {
        FAIL_THE_CHECK.store(true, Ordering::SeqCst);
    }
    Ok(Recovery::Run)
}

#[idempotent(scope = "recovery.unconfirmed_run", key = key, tenant = shared, store = store,
             lease = "300ms", in_progress = reject, recover = run_hook)]
async fn unconfirmed(store: &dyn Store, key: &str) -> Result<u32, Error> {
    let mut seen = confirm_seen();
    seen.runs += 1;
    Ok(seen.runs)
}

/// Fails the renewal that follows the hook's `Run` (a renewal with the
/// scope's lease; the lease's end, a renewal of zero, goes through).
struct FailTheCheck;

#[async_trait::async_trait]
impl Intercept for FailTheCheck {
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        if !lease.is_zero() && FAIL_THE_CHECK.swap(false, Ordering::SeqCst) {
            return Err(StoreError::new(
                "hooked",
                "heartbeat",
                "the store stopped answering",
            ));
        }
        inner.heartbeat(identity, token, lease).await
    }
}

/// Rules 3 and 20: after the hook answers `Run`, the body starts only once
/// a fenced renewal confirms the call still owns the record. When that
/// renewal fails (the store is unreachable: the record may have been taken
/// over while the hook ran), ownership is unknown and the body does not run
/// blind: the call fails with the store's error, the record stays in
/// progress with its lease ended, and the next call takes it over and asks
/// the hook again. Found by a mutation audit: running the body when the
/// check failed passed every other test.
#[tokio::test]
async fn a_run_whose_ownership_check_fails_does_not_run_the_body() {
    let store = Hooked::new(FailTheCheck);
    let identity = Identity::shared("recovery.unconfirmed_run", "k").expect("identity");
    // An owner that crashed: reserved, never finished, its lease short.
    take(&store, &identity, Duration::from_millis(10)).await;
    lease_over(&store, &identity).await;

    let first = tokio::time::timeout(Duration::from_secs(10), unconfirmed(&store, "k"))
        .await
        .expect("bounded");
    assert!(
        matches!(first, Err(Error::Store(_))),
        "the ownership check failed: {first:?}"
    );
    assert_eq!(confirm_seen().runs, 0, "the body did not run blind");
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("the record is kept, not released");
    assert!(record.outcome.is_none(), "still in progress");

    // The next call takes the record over at once and asks the hook again.
    let second = tokio::time::timeout(Duration::from_secs(10), unconfirmed(&store, "k"))
        .await
        .expect("bounded");
    assert_eq!(second.expect("the next takeover runs the body"), 1);
    let (asked, runs) = {
        let seen = confirm_seen();
        (seen.asked.clone(), seen.runs)
    };
    assert_eq!(asked, [2, 3], "each takeover asked its hook");
    assert_eq!(runs, 1, "the body ran once");
}

/// The first takeover's patient hook is asking its provider.
static PATIENT_ASKING: Notify = Notify::const_new();
/// The first takeover's patient hook may answer.
static PATIENT_ANSWER: Notify = Notify::const_new();
/// How many times [`ship`]'s body ran.
static SHIPPED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Waits for the provider on the first takeover (attempt 2); finds the
/// work done (7) on any other.
async fn patient_hook(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    if takeover.attempt() == 2 {
        PATIENT_ASKING.notify_one();
        PATIENT_ANSWER.notified().await;
    }
    Ok(Recovery::Completed(7))
}

#[idempotent(scope = "recovery.patient_hook", key = key, tenant = shared, store = store,
             lease = "300ms", in_progress = reject, recover = patient_hook)]
async fn ship(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(SHIPPED.fetch_add(1, Ordering::SeqCst) + 1)
}

/// A hook runs under the call's lease, renewed by the heartbeat like a
/// body's: while a hook that takes three leases (tokio's paused clock; the
/// memory store keeps time by it) waits for its provider, the record stays
/// the call's, and a duplicate is refused as in progress instead of taking
/// it over and asking a second hook beside the first.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hook_that_takes_longer_than_its_lease_keeps_the_record_by_renewing_it() {
    let store: &'static MemoryStore = Box::leak(Box::new(MemoryStore::new()));
    let identity = Identity::shared("recovery.patient_hook", "k").expect("identity");
    // An owner that crashed: reserved, never finished.
    take(store, &identity, Duration::from_millis(10)).await;
    lease_over(store, &identity).await;

    let first = tokio::spawn(ship(store, "k"));
    PATIENT_ASKING.notified().await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    let duplicate = ship(store, "k").await;
    assert!(
        matches!(duplicate, Err(Error::InProgress { .. })),
        "the record of a hook still asking was taken over: {duplicate:?}"
    );
    PATIENT_ANSWER.notify_one();
    assert_eq!(first.await.expect("the first call").expect("recovered"), 7);
    assert_eq!(ship(store, "k").await.expect("replayed"), 7);
    assert_eq!(SHIPPED.load(Ordering::SeqCst), 0, "the body never ran");
}

/// The first takeover's late hook is asking.
static LATE_ASKING: Notify = Notify::const_new();
/// The first takeover's late hook may answer.
static LATE_ANSWER: Notify = Notify::const_new();
/// How many times [`refund`]'s body ran.
static REFUNDED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Finds the work done (99) on the first takeover, once let answer; on
/// any other, finds nothing done.
async fn late_hook(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    if takeover.attempt() == 2 {
        LATE_ASKING.notify_one();
        LATE_ANSWER.notified().await;
        return Ok(Recovery::Completed(99));
    }
    Ok(Recovery::Run)
}

#[idempotent(scope = "recovery.hook_answer_lost", key = key, tenant = shared, store = store,
             lease = "300ms", in_progress = reject, recover = late_hook)]
async fn refund(store: &dyn Store, key: &str) -> Result<u32, Error> {
    Ok(REFUNDED.fetch_add(1, Ordering::SeqCst) + 1)
}

/// A hook's `Completed` answer is recorded only while the call still owns
/// the record: when the hook outlived its lease and another takeover ran the
/// body and recorded its answer meanwhile, the late answer is not recorded,
/// and the call answers `LeaseLost`, never its own value beside the one
/// every retry is replayed.
#[tokio::test]
async fn a_hook_answer_that_comes_after_the_record_was_lost_is_not_returned() {
    let store = Hooked::new(StallFirstRenewer::default());
    let identity = Identity::shared("recovery.hook_answer_lost", "k").expect("identity");
    take(&store, &identity, Duration::from_millis(10)).await;
    lease_over(&store, &identity).await;

    let first = refund(&store, "k");
    let rest = async {
        LATE_ASKING.notified().await;
        lease_over(&store, &identity).await;
        store.unstall.store(true, Ordering::SeqCst);
        let second = refund(&store, "k").await;
        LATE_ANSWER.notify_one();
        second
    };
    let (first, second) = tokio::join!(first, rest);
    assert_eq!(second.expect("the second takeover runs"), 1);
    assert!(
        matches!(first, Err(Error::LeaseLost(_))),
        "the hook's answer came after its record was lost: {first:?}"
    );
    assert_eq!(refund(&store, "k").await.expect("replayed"), 1);
    assert_eq!(REFUNDED.load(Ordering::SeqCst), 1, "the body ran once");
}
