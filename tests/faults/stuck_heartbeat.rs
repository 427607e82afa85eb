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
