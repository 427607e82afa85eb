//! A reservation whose answer reaches the call late (the statement was
//! decided at once; the process was paused, or the link was slow, before the
//! call saw the answer) leaves the body less of its lease than a heartbeat
//! period plus a renewal's round trip. The engine renews at once only when
//! the answer came a lease minus a period or more after it was sent
//! (`Acquired::answered_late`); just below that, the body's first renewal is
//! sent a period after the body starts, right at the end of the lease, and
//! lands after it. A duplicate that arrives in between takes the record
//! over while the first body still runs.
//!
//! On a paused clock with a hooked memory store, so the order is certain:
//! lease 3 s (period 1 s, "late" from 2 s on); the first reservation is
//! decided at t = 0 and answered at t = 1.99 s; every renewal takes 20 ms
//! to land (a round trip).
use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{
    idempotent, Error, Fenced, Identity, MemoryStore, OwnerToken, Reservation, ReserveRequest,
    Store, StoreError,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Just short of "late" (lease - lease / 3 = 2 s).
const ANSWER_DELAY: Duration = Duration::from_millis(1990);
/// What a renewal takes to land.
const RENEWAL_ROUND_TRIP: Duration = Duration::from_millis(20);

#[derive(Default)]
struct SlowAnswers {
    reserves: AtomicUsize,
}

#[async_trait::async_trait]
impl Intercept for SlowAnswers {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let answer = inner.reserve(r).await;
        if self.reserves.fetch_add(1, Ordering::SeqCst) == 0 {
            // Decided now (the lease runs from now); the call sees it later.
            tokio::time::sleep(ANSWER_DELAY).await;
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
        tokio::time::sleep(RENEWAL_ROUND_TRIP).await;
        inner.heartbeat(i, t, lease).await
    }
}

static RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "audit.read.late_answer", key = key, tenant = shared, store = store,
             lease = "3s", in_progress = reject)]
async fn ship(store: &Hooked<SlowAnswers>, key: &str) -> Result<u32, Error> {
    let run = RUNS.fetch_add(1, Ordering::SeqCst) + 1;
    // A body that runs for a while (its lease renewed meanwhile).
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(u32::try_from(run).unwrap_or(u32::MAX))
}

/// DESIGN rules 3, 9 and 10: a reservation answered late but not "late
/// enough" for the engine's check still gets a lease the heartbeat keeps:
/// a duplicate that comes while the first body runs is refused in progress,
/// and the body runs once.
#[tokio::test(start_paused = true)]
async fn a_reservation_answered_just_short_of_late_keeps_its_lease_while_the_body_runs() {
    let store = Hooked::new(SlowAnswers::default());
    let start = tokio::time::Instant::now();
    let first = ship(&store, "k");
    let duplicate = async {
        // The lease set at t = 0 ended at 3 s; the first renewal, sent at
        // 2.99 s (a period after the body started), lands at 3.01 s.
        tokio::time::sleep_until(start + Duration::from_millis(3005)).await;
        ship(&store, "k").await
    };
    let (first, duplicate) = tokio::join!(first, duplicate);
    assert_eq!(
        RUNS.load(Ordering::SeqCst),
        1,
        "rule 3: the body ran twice: the duplicate took the record over while the first body ran \
         (first: {first:?}, duplicate: {duplicate:?})"
    );
    assert_eq!(first.expect("the first call"), 1);
    assert!(
        matches!(duplicate, Err(Error::InProgress { .. })),
        "{duplicate:?}"
    );
}
