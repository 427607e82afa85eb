//! Rules 3, 9 and 10 at the start of a body: the lease the reservation set
//! must still hold when the body's first renewal *lands*, not only when it
//! is sent. A renewal that answers within its period (lease / 3) is a
//! healthy one everywhere else in the engine (a slower one counts as a
//! heartbeat failure), so the first renewal is due a period after the lease
//! was written (the reservation's statement sent), at once when the body
//! starts later than that; it was due a period after the body's start, and a
//! reservation answered late (the process stalled while the statement was
//! decided, but under the two thirds of a lease that `late_reservation`
//! confirms with a fenced renewal) left it less. The lease's lapse (rule 9)
//! counts from there too.
//!
//! On tokio's paused clock, the memory store's clock too: the late answer,
//! the renewal's round trip and the lease's end fall where the test puts
//! them, however loaded the machine. The same holds after a takeover whose
//! recover hook answers `Run`: its confirming renewal sets the lease the body
//! starts under.

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{
    idempotent, Error, Fenced, Identity, MemoryStore, OwnerToken, Recovery, Reservation,
    ReserveRequest, Store, StoreError, Takeover,
};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

/// The scope's lease (300 ms): a renewal every 100 ms.
const LEASE_MS: u64 = 300;

/// A memory store whose next reservation answers `delay_ms` after it was
/// decided, and whose renewals take `renewal_ms` to reach it (a round trip
/// well within a renewal period).
#[derive(Default)]
struct SlowAnswers {
    delay_ms: AtomicU64,
    renewal_ms: AtomicU64,
    renewals: AtomicUsize,
    fail_renewals: AtomicBool,
    /// The next renewal answers this long after it was written.
    renewal_answer_ms: AtomicU64,
}

#[async_trait::async_trait]
impl Intercept for SlowAnswers {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let answer = inner.reserve(r).await;
        let delay = self.delay_ms.swap(0, Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        answer
    }

    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        if !lease.is_zero() {
            self.renewals.fetch_add(1, Ordering::SeqCst);
            let travel = self.renewal_ms.load(Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(travel)).await;
            if self.fail_renewals.load(Ordering::SeqCst) {
                return Err(StoreError::new("hooked", "heartbeat", "unreachable"));
            }
        }
        let written = inner.heartbeat(i, t, lease).await;
        let late = self.renewal_answer_ms.swap(0, Ordering::SeqCst);
        if late > 0 && !lease.is_zero() {
            tokio::time::sleep(Duration::from_millis(late)).await;
        }
        written
    }
}

/// The first run signals `started` and works for 150 ms (half a lease);
/// later runs return at once.
#[idempotent(scope = "faults.first_renewal", key = key, tenant = shared, store = store,
             skip(runs, started), lease = "300ms", in_progress = wait("5s"))]
async fn work(
    store: &Hooked<SlowAnswers>,
    key: &str,
    runs: &AtomicUsize,
    started: &Notify,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        started.notify_one();
        tokio::time::sleep(Duration::from_millis(LEASE_MS / 2)).await;
    }
    Ok(n)
}

/// The reservation is answered 190 ms after it set its 300 ms lease: just
/// under the two thirds of a lease the engine confirms, so no confirming
/// renewal is sent, and the body's first renewal was due a period after the
/// body's start (290 ms), 10 ms before the lease's end. Renewals take 20 ms
/// (a fifth of their period: healthy by the engine's own measure). A
/// duplicate that arrives meanwhile waits exactly until the lease's end
/// (300 ms) and looks again: the renewal had not landed, so it took the
/// record over and ran the body a second time beside the live owner, whose
/// renewal and completion were then refused (`LeaseLost`). The owner never
/// stalled after its body started; only its first renewal had no room.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_reservation_answered_late_leaves_its_first_renewal_room_to_land() {
    let store = Hooked::new(SlowAnswers::default());
    store.delay_ms.store(190, Ordering::SeqCst);
    store.renewal_ms.store(20, Ordering::SeqCst);
    let runs = AtomicUsize::new(0);
    let started = Notify::new();
    let owner = work(&store, "k", &runs, &started);
    let duplicate = async {
        started.notified().await;
        work(&store, "k", &runs, &started).await
    };
    let (owner, duplicate) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::join!(owner, duplicate)
    })
    .await
    .expect("both answered");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the body ran once (owner: {owner:?}, duplicate: {duplicate:?})"
    );
    assert_eq!(owner.expect("the owner recorded its answer"), 1);
    assert_eq!(duplicate.expect("the duplicate replays it"), 1);
}

/// A reservation answered under two thirds of a lease late sends no
/// renewal before the body, and a body that ends in its first poll sends
/// none at all: the confirming renewal is a round trip on the call's path,
/// paid only by an answer so late that the lease may be gone.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_reservation_answered_under_two_thirds_of_a_lease_late_costs_no_renewal() {
    let store = Hooked::new(SlowAnswers::default());
    store
        .delay_ms
        .store(LEASE_MS * 2 / 3 - 10, Ordering::SeqCst);
    let runs = AtomicUsize::new(0);
    #[idempotent(scope = "faults.first_renewal.fast", key = key, tenant = shared, store = store,
                 skip(runs), lease = "300ms", in_progress = reject)]
    async fn fast(
        store: &Hooked<SlowAnswers>,
        key: &str,
        runs: &AtomicUsize,
    ) -> Result<usize, Error> {
        Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
    }
    assert_eq!(fast(&store, "on-time", &runs).await.expect("ran"), 1);
    assert_eq!(
        store.renewals.load(Ordering::SeqCst),
        0,
        "a body that ends in its first poll, answered within a third of its lease: no renewal"
    );
}

/// Rule 9 (README: a body that ends a lease or more after the lease was
/// last written finds it lapsed, counted even when nobody took the record
/// over): the reservation wrote the lease when it was decided, not when its
/// answer came. Answered 90 ms late (on time: under a third of the 300 ms
/// lease), every renewal then failing, a body ending 350 ms after the lease
/// was written ran 50 ms past its lease's end, and nothing counted it: the
/// lapse was measured from the late answer (260 ms).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lapse_counts_from_when_the_reservation_wrote_the_lease() {
    #[idempotent(scope = "faults.first_renewal.lapse", key = key, tenant = shared,
                 store = store, lease = "300ms", in_progress = reject)]
    async fn long(store: &Hooked<SlowAnswers>, key: &str) -> Result<u32, Error> {
        tokio::time::sleep(Duration::from_millis(260)).await;
        Ok(7)
    }
    let store = Hooked::new(SlowAnswers::default());
    store.delay_ms.store(90, Ordering::SeqCst);
    store.fail_renewals.store(true, Ordering::SeqCst);
    let before = idempotent_runtime::metrics::snapshot();
    assert_eq!(long(&store, "k").await.expect("nobody took it over"), 7);
    let after = idempotent_runtime::metrics::snapshot();
    assert!(
        after.heartbeat_failures > before.heartbeat_failures,
        "the renewals failed"
    );
    assert_eq!(
        after.lease_lapses - before.lease_lapses,
        1,
        "the body ended 50 ms after its lease did: a lapse"
    );
}

async fn run_again(_: &Takeover) -> Result<Recovery<usize>, Error> {
    Ok(Recovery::Run)
}

/// As `work`, with a recover hook that answers `Run`.
#[idempotent(scope = "faults.first_renewal.hook", key = key, tenant = shared, store = store,
             skip(runs, started), lease = "300ms", in_progress = wait("5s"),
             recover = run_again)]
async fn work_with_hook(
    store: &Hooked<SlowAnswers>,
    key: &str,
    runs: &AtomicUsize,
    started: &Notify,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        started.notify_one();
        tokio::time::sleep(Duration::from_millis(LEASE_MS / 2)).await;
    }
    Ok(n)
}

/// Rules 10 and 20: a takeover whose recover hook answers `Run` confirms
/// the record with one fenced renewal before the body runs; that renewal's
/// lease counts from when it was written. Answered 190 ms after it was
/// written (the process stalled right then), the body's first renewal came
/// a period after the body's start, 10 ms before the lease's end: with a
/// 20 ms round trip, a duplicate waiting for the lease's end took the
/// record over, its hook answered `Run` too, and the body ran twice.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_confirming_renewal_answered_late_leaves_the_first_renewal_room_to_land() {
    let store = Hooked::new(SlowAnswers::default());
    let id = Identity::shared("faults.first_renewal.hook", "k").expect("identity");
    // A crashed owner's record, its lease over.
    let crashed = OwnerToken::new();
    let got = store
        .reserve(ReserveRequest {
            identity: &id,
            fingerprint: None,
            token: &crashed,
            lease: Duration::from_millis(10),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(matches!(got, Reservation::Acquired { .. }), "{got:?}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    store.renewal_answer_ms.store(190, Ordering::SeqCst);
    store.renewal_ms.store(20, Ordering::SeqCst);
    let runs = AtomicUsize::new(0);
    let started = Notify::new();
    let owner = work_with_hook(&store, "k", &runs, &started);
    let duplicate = async {
        started.notified().await;
        work_with_hook(&store, "k", &runs, &started).await
    };
    let (owner, duplicate) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::join!(owner, duplicate)
    })
    .await
    .expect("both answered");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the body ran once (owner: {owner:?}, duplicate: {duplicate:?})"
    );
    assert_eq!(owner.expect("the owner recorded its answer"), 1);
    assert_eq!(duplicate.expect("the duplicate replays it"), 1);
}
