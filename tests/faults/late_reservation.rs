//! Rules 3 and 10 on the memory store, in one process: a reservation whose
//! answer comes (nearly) a lease after it was sent (the process starved or
//! stopped while the statement was decided; here the store answers late) is
//! confirmed by one fenced renewal before the body runs. The multi-process
//! pause tests show it on PostgreSQL and MariaDB with SIGSTOP; these show
//! the three answers of that renewal without servers or signals.
//! On tokio's paused clock (the memory store's clock too): the late answer
//! and the lease's end fall where the test puts them, however loaded the
//! machine (an on-time reservation must send no renewal).

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{
    idempotent, Error, Fenced, Identity, MemoryStore, OwnerToken, Reservation, ReserveRequest,
    Store, StoreError,
};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

/// A memory store whose next reservation answers `delay_ms` after it was
/// decided (`landed` told then), and whose renewals may fail.
#[derive(Default)]
struct LateAnswer {
    delay_ms: AtomicU64,
    landed: Notify,
    fail_renewals: AtomicBool,
    renewals: AtomicUsize,
}

#[async_trait::async_trait]
impl Intercept for LateAnswer {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let answer = inner.reserve(r).await;
        let delay = self.delay_ms.swap(0, Ordering::SeqCst);
        if delay > 0 {
            self.landed.notify_one();
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
            if self.fail_renewals.swap(false, Ordering::SeqCst) {
                return Err(StoreError::new(
                    "hooked",
                    "heartbeat",
                    "briefly unreachable",
                ));
            }
        }
        inner.heartbeat(i, t, lease).await
    }
}

#[idempotent(scope = "faults.late_reservation", key = key, tenant = shared, store = store,
             skip(runs), lease = "300ms", in_progress = reject)]
async fn work(store: &Hooked<LateAnswer>, key: &str, runs: &AtomicUsize) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// The reservation lands, its lease runs out before its answer comes, and
/// another caller takes the record over and records its answer meanwhile:
/// the late call gets `LeaseLost` and its body does not run (before the
/// fenced renewal it ran a second time, its completion then refused).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_reservation_answered_after_a_takeover_runs_no_body() {
    let store = Hooked::new(LateAnswer::default());
    store.delay_ms.store(600, Ordering::SeqCst);
    let runs = AtomicUsize::new(0);
    let late = work(&store, "taken", &runs);
    let other = async {
        store.landed.notified().await;
        tokio::time::sleep(Duration::from_millis(400)).await; // past the lease
        work(&store, "taken", &runs).await
    };
    let (late, other) =
        tokio::time::timeout(Duration::from_secs(20), async { tokio::join!(late, other) })
            .await
            .expect("both answered");
    assert_eq!(other.expect("the takeover ran and recorded"), 1);
    assert!(matches!(late, Err(Error::LeaseLost(_))), "{late:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "one body run: the takeover's"
    );
    assert_eq!(work(&store, "taken", &runs).await.expect("replayed"), 1);
}

/// Answered late but still its own (nobody took it over): the renewal is
/// written and the body runs, as before.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_late_reservation_still_owned_runs_its_body_after_one_renewal() {
    let store = Hooked::new(LateAnswer::default());
    store.delay_ms.store(250, Ordering::SeqCst); // >= 2/3 of 300 ms
    let runs = AtomicUsize::new(0);
    assert_eq!(work(&store, "owned", &runs).await.expect("ran"), 1);
    assert_eq!(
        store.renewals.load(Ordering::SeqCst),
        1,
        "the confirming renewal"
    );
    // On time: no renewal more.
    assert_eq!(work(&store, "on-time", &runs).await.expect("ran"), 2);
    assert_eq!(store.renewals.load(Ordering::SeqCst), 1);
}

/// Answered late and the confirming renewal fails (ownership unknown): the
/// call fails with the store's error without running its body, and the
/// record is released (no hook), so a retry runs the body once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_late_reservation_whose_renewal_fails_runs_no_body_and_frees_the_key() {
    let store = Hooked::new(LateAnswer::default());
    store.delay_ms.store(250, Ordering::SeqCst);
    store.fail_renewals.store(true, Ordering::SeqCst);
    let runs = AtomicUsize::new(0);
    let first = work(&store, "unknown", &runs).await;
    assert!(matches!(first, Err(Error::Store(_))), "{first:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the body did not run blind");
    assert_eq!(work(&store, "unknown", &runs).await.expect("retry ran"), 1);
}
