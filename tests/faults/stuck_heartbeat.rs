//! Rule 9: the lease is renewed every lease/3 for as long as the body runs,
//! and a heartbeat that fails is visible. A heartbeat statement that never
//! answers (a pooled connection whose peer went silent: TCP retransmits for
//! minutes, sqlx sets no statement timeout) stops every later renewal: the
//! engine starts the next heartbeat only when the previous one has answered
//! (`run_with_heartbeat`). Nothing is logged or counted, the lease runs out
//! while the body is still running and being polled, and a duplicate takes
//! the record over and runs the body a second time.

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{
    idempotent, Error, Fenced, Identity, MemoryStore, OwnerToken, Store, StoreError,
};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

/// A memory store whose first heartbeat never answers.
struct StuckHeartbeat {
    stuck: AtomicBool,
    reached: Notify,
}

#[async_trait::async_trait]
impl Intercept for StuckHeartbeat {
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        if self.stuck.swap(false, Ordering::SeqCst) {
            self.reached.notify_one();
            std::future::pending::<()>().await;
        }
        inner.heartbeat(i, t, lease).await
    }
}

/// The first run waits for `go`; any later run returns at once.
#[idempotent(scope = "faults.stuck_heartbeat", key = key, tenant = shared, store = store,
             skip(runs, go), lease = "3s", in_progress = wait("60s"))]
async fn work(
    store: &Hooked<StuckHeartbeat>,
    key: &str,
    runs: &AtomicUsize,
    go: &Notify,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        go.notified().await;
    }
    Ok(n)
}

/// The owner's body runs (and is polled) while its first heartbeat hangs.
/// A duplicate arrives and waits. The owner is alive, so the duplicate must
/// not take its record over: it may only replay the owner's answer once
/// `go` is given. Without a renewal beside the hung one, the lease runs out
/// after 3 s and the duplicate runs the body again.
///
/// The lease is long enough for a loaded machine: the spare renewal goes out
/// a quarter period after the hung one is given up (2.25 periods into the
/// lease), so a shorter lease leaves the owner only a few milliseconds of
/// scheduling delay before a duplicate may take the record over (75 ms at
/// 300 ms, enough to fail now and then with eight test processes on two
/// cores).
#[tokio::test]
async fn a_heartbeat_that_never_answers_does_not_stop_the_renewals() {
    let store = Hooked::new(StuckHeartbeat {
        stuck: AtomicBool::new(true),
        reached: Notify::new(),
    });
    let (runs, go) = (AtomicUsize::new(0), Notify::new());
    let mut owner = pin!(work(&store, "k-stuck", &runs, &go));
    tokio::time::timeout(Duration::from_secs(20), async {
        tokio::select! {
            _ = &mut owner => panic!("the owner finished before its first heartbeat"),
            _ = store.reached.notified() => {}
        }
    })
    .await
    .expect("the first heartbeat was sent");

    // The owner keeps being polled (its body waits for `go`), and a
    // duplicate waits. Three leases' time is more than enough for a working
    // renewal to show; the duplicate must still be waiting then.
    let mut duplicate = pin!(work(&store, "k-stuck", &runs, &go));
    let early = tokio::time::timeout(Duration::from_secs(9), async {
        tokio::select! {
            d = &mut duplicate => d,
            _ = &mut owner => panic!("the owner finished without go"),
        }
    })
    .await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the body ran twice while its owner was alive and polled (duplicate answered {early:?})"
    );
    go.notify_one();
    let (o, d) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::join!(owner, duplicate)
    })
    .await
    .expect("both answered");
    assert_eq!((o.unwrap(), d.unwrap()), (1, 1));
}

/// A renewal that has not answered within its period (`lease / 3`: 1 s of
/// this 3 s lease) is a heartbeat failure, counted (`heartbeat_failures`,
/// `idempotent_heartbeat_failures_total`) while it is still awaited, as the
/// README and the metrics docs say; the owner still answers once let go.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_renewal_unanswered_within_its_period_counts_as_a_heartbeat_failure() {
    let store = Hooked::new(StuckHeartbeat {
        stuck: AtomicBool::new(true),
        reached: Notify::new(),
    });
    let (runs, go) = (AtomicUsize::new(0), Notify::new());
    let before = idempotent_runtime::metrics::snapshot().heartbeat_failures;
    let mut owner = pin!(work(&store, "k-late", &runs, &go));
    tokio::select! {
        _ = &mut owner => panic!("the owner finished before its first heartbeat"),
        _ = store.reached.notified() => {}
    }
    assert_eq!(
        idempotent_runtime::metrics::snapshot().heartbeat_failures,
        before,
        "a renewal just sent is no failure yet"
    );
    tokio::select! {
        _ = &mut owner => panic!("the owner finished without go"),
        _ = tokio::time::sleep(Duration::from_millis(1100)) => {}
    }
    assert!(
        idempotent_runtime::metrics::snapshot().heartbeat_failures > before,
        "a renewal unanswered for its whole period is a heartbeat failure"
    );
    go.notify_one();
    assert_eq!(owner.await.expect("the owner's answer"), 1);
}

/// A memory store whose first `failing` renewals fail (the store briefly
/// unreachable); `failed` is told at the first failure.
struct FailingRenewals {
    failing: AtomicUsize,
    failed: Notify,
}

#[async_trait::async_trait]
impl Intercept for FailingRenewals {
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        let failing = self
            .failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            self.failed.notify_one();
            return Err(StoreError::new(
                "hooked",
                "heartbeat",
                "the store is briefly unreachable",
            ));
        }
        inner.heartbeat(i, t, lease).await
    }
}

/// The first run waits for `go`; any later run returns at once.
#[idempotent(scope = "faults.failing_renewals", key = key, tenant = shared, store = store,
             skip(runs, go), lease = "3s", in_progress = wait("60s"))]
async fn renewed(
    store: &Hooked<FailingRenewals>,
    key: &str,
    runs: &AtomicUsize,
    go: &Notify,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        go.notified().await;
    }
    Ok(n)
}

/// Rule 9 with rule 3: a renewal that fails is tried again soon (a quarter
/// period after it was sent), not a whole period later, and a failure does
/// not end the renewals (only `NotOwner` does). Four renewals fail in a row
/// (at 1 s, 1.25 s, 1.5 s, 1.75 s of a 3 s lease): the fifth, at 2 s, renews
/// the lease a second before it runs out, and a duplicate waiting meanwhile
/// must not take the record over. Retried a period later, the fifth renewal
/// would come at 5 s, two seconds after the lease ran out; counted as a lost
/// lease, none would come at all: either way the duplicate took the record
/// over and ran the body a second time while its owner was alive and
/// polled. Found by a mutation audit (both passed every other test on the
/// memory and SQLite stores).
// On tokio's paused clock (the memory store's clock too): the renewals and
// the lease's end fall where the schedule puts them, however slow the machine.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn renewals_that_fail_are_tried_again_soon_and_keep_the_lease() {
    let store = Hooked::new(FailingRenewals {
        failing: AtomicUsize::new(4),
        failed: Notify::new(),
    });
    let (runs, go) = (AtomicUsize::new(0), Notify::new());
    let mut owner = pin!(renewed(&store, "k-failing", &runs, &go));
    tokio::time::timeout(Duration::from_secs(20), async {
        tokio::select! {
            _ = &mut owner => panic!("the owner finished before its first renewal"),
            _ = store.failed.notified() => {}
        }
    })
    .await
    .expect("the first renewal was sent");

    // Two leases' time: past the end of the first lease (3 s), and past
    // where renewals retried a period apart would have left it lapsed.
    let mut duplicate = pin!(renewed(&store, "k-failing", &runs, &go));
    let early = tokio::time::timeout(Duration::from_secs(6), async {
        tokio::select! {
            d = &mut duplicate => d,
            _ = &mut owner => panic!("the owner finished without go"),
        }
    })
    .await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the lease lapsed after failed renewals and the body ran twice (duplicate answered {early:?})"
    );
    assert_eq!(store.failing.load(Ordering::SeqCst), 0, "all four failed");
    go.notify_one();
    let (o, d) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::join!(owner, duplicate)
    })
    .await
    .expect("both answered");
    assert_eq!((o.unwrap(), d.unwrap()), (1, 1));
}

/// A memory store whose first renewal is held until `unstick`; it says when
/// a later renewal is sent (`spare`), when the held one answers
/// (`answered`), and whether it was dropped before it answered.
#[derive(Default)]
struct HeldRenewal {
    held: AtomicBool,
    reached: AtomicBool,
    spare: Notify,
    unstick: Notify,
    answered: Notify,
    dropped_unanswered: AtomicBool,
}

/// Sets its flag when dropped while armed (a future dropped mid-way).
struct DroppedWhile<'a>(&'a AtomicBool, bool);

impl Drop for DroppedWhile<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.store(true, Ordering::SeqCst);
        }
    }
}

#[async_trait::async_trait]
impl Intercept for HeldRenewal {
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        if self.held.swap(false, Ordering::SeqCst) {
            self.reached.store(true, Ordering::SeqCst);
            let mut pending = DroppedWhile(&self.dropped_unanswered, true);
            self.unstick.notified().await;
            let answer = inner.heartbeat(i, t, lease).await;
            pending.1 = false;
            self.answered.notify_one();
            return answer;
        }
        if self.reached.load(Ordering::SeqCst) {
            self.spare.notify_one();
        }
        inner.heartbeat(i, t, lease).await
    }
}

#[idempotent(scope = "faults.held_renewal", key = key, tenant = shared, store = store,
             skip(go), lease = "300ms", in_progress = reject)]
async fn held(store: &Hooked<HeldRenewal>, key: &str, go: &Notify) -> Result<u32, Error> {
    go.notified().await;
    Ok(1)
}

/// Rule 9 (`run_with_heartbeat`): a renewal that outlives its period is
/// kept and polled until it answers, beside the spare renewal sent after
/// it; never dropped mid-way. On a SQL store a dropped renewal's statement
/// goes on holding its pooled connection on the server (the connection is
/// lost to the pool, and a lock wait stays queued). Found by a mutation
/// audit: dropping it passed every other test.
#[tokio::test]
async fn a_renewal_that_outlives_its_period_is_polled_until_it_answers() {
    let store = Hooked::new(HeldRenewal {
        held: AtomicBool::new(true),
        ..HeldRenewal::default()
    });
    let go = Notify::new();
    let mut owner = pin!(held(&store, "k-held", &go));
    tokio::time::timeout(Duration::from_secs(20), async {
        tokio::select! {
            _ = &mut owner => panic!("the owner finished without go"),
            _ = store.spare.notified() => {}
        }
    })
    .await
    .expect("a spare renewal was sent beside the held one");
    store.unstick.notify_one();
    tokio::time::timeout(Duration::from_secs(20), async {
        tokio::select! {
            _ = &mut owner => panic!("the owner finished without go"),
            _ = store.answered.notified() => {}
        }
    })
    .await
    .expect("the held renewal was polled until it answered");
    assert!(!store.dropped_unanswered.load(Ordering::SeqCst));
    go.notify_one();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(20), owner)
            .await
            .expect("answered")
            .expect("the owner's answer"),
        1
    );
}
