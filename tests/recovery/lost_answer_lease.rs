//! A takeover whose answer was lost, in a scope with a recover hook: the
//! engine ends the record's lease so the next call takes it over at once and
//! asks the hook (`end_lease_logged` in `execute_inner`). That is one
//! synchronous try: when it fails (the connection that lost the answer is
//! not back yet), the guard is disarmed and nothing tries again, so the key
//! stays in progress for the whole lease (here 30 s; 30 s by default) and
//! every retry meanwhile is refused `InProgress`. In a scope without a hook
//! the same failure is handed to the store's background worker, which
//! retries (`release_detached`); `end_lease_detached` exists for exactly
//! this, but is only used when the call is dropped.

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::store::{OwnerToken, Reservation, ReserveRequest};
use idempotent_runtime::{
    idempotent, Error, Fenced, Identity, MemoryStore, Recovery, Store, StoreError, Takeover,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// A takeover lands but its answer is lost, and the next heartbeat (the
/// engine's "end the lease") fails too: the store is briefly unreachable.
struct CutThenDown {
    cut: AtomicBool,
    failing_heartbeats: AtomicUsize,
}

#[async_trait::async_trait]
impl Intercept for CutThenDown {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let answer = inner.reserve(r).await?;
        if let Reservation::Acquired {
            took_over: true, ..
        } = answer
        {
            if self.cut.swap(false, Ordering::SeqCst) {
                self.failing_heartbeats.store(1, Ordering::SeqCst);
                return Err(StoreError::new(
                    "cut-then-down",
                    "reserve",
                    "connection reset",
                ));
            }
        }
        Ok(answer)
    }
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &OwnerToken,
        l: Duration,
    ) -> Result<Fenced, StoreError> {
        let failing = self
            .failing_heartbeats
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Err(StoreError::new(
                "cut-then-down",
                "heartbeat",
                "connection refused",
            ));
        }
        inner.heartbeat(i, t, l).await
    }
}

static ASKED: AtomicUsize = AtomicUsize::new(0);

async fn nothing_happened(_: &Takeover) -> Result<Recovery<u32>, Error> {
    ASKED.fetch_add(1, Ordering::SeqCst);
    Ok(Recovery::Run)
}

#[idempotent(scope = "recovery.lost_answer_lease", key = key, tenant = shared, store = store,
             lease = "30s", in_progress = reject, recover = nothing_happened)]
async fn ship(store: &Hooked<CutThenDown>, key: &str) -> Result<u32, Error> {
    Ok(7)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_takeover_answer_whose_lease_could_not_be_ended_at_once_is_ended_later() {
    let store = Hooked::new(CutThenDown {
        cut: AtomicBool::new(false),
        failing_heartbeats: AtomicUsize::new(0),
    });
    let id = Identity::shared("recovery.lost_answer_lease", "parcel-1").unwrap();
    // A crashed owner's record whose lease has run out.
    let r = store
        .inner
        .reserve(ReserveRequest {
            identity: &id,
            fingerprint: None,
            token: &OwnerToken::new(),
            lease: Duration::ZERO,
            ttl: Duration::from_secs(3600),
        })
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Acquired { .. }));

    // The retry takes it over; the answer is lost, and so is the first try
    // to end the lease.
    store.cut.store(true, Ordering::SeqCst);
    let lost = ship(&store, "parcel-1").await;
    assert!(matches!(lost, Err(Error::Store(_))), "{lost:?}");

    // The store is reachable again. The next retries must get the record
    // within a few seconds (taken over, the hook asked), not after 30 s.
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match ship(&store, "parcel-1").await {
                Err(Error::InProgress { .. }) => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                other => return other,
            }
        }
    })
    .await;
    let record = store.inner.fetch(&id).await.unwrap();
    assert!(
        matches!(answer, Ok(Ok(7))),
        "the key stayed in progress under the lost call's token (answer {answer:?}; record {record:?})"
    );
    assert_eq!(ASKED.load(Ordering::SeqCst), 1, "the hook was asked");
}
