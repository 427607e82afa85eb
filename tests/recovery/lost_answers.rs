//! Lost answers: a takeover whose reservation may have landed but whose
//! answer never reached the call (a connection cut after the server
//! committed, or the call dropped while the statement was in flight) must not
//! free the record: the next call would run the body as a fresh attempt 1
//! without asking the recover hook (rule 20, README "Uncertain outcomes").
//! The record is kept with its lease ended, and the next call takes it over
//! and asks.

use crate::common::hooked::{Hooked, Intercept};
use crate::recovery::*;
use idempotent_runtime::store::{Reservation, ReserveRequest};
use idempotent_runtime::{
    AnsweredBy, Completion, Fenced, Identity, MemoryStore, Store, StoreError,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Delegates to a memory store; when armed, a reservation that *took over*
/// a record lands in the store, but the call is told the connection was cut.
struct CutAfterTakeover {
    armed: AtomicBool,
    /// When set, the next completion of a recover hook's answer fails (a connection cut
    /// before the statement reached the server).
    fail_recovered: AtomicBool,
    /// When set, a reservation that took over lands, and its answer never
    /// comes back (the call is dropped while it waits: a client hung up).
    hang: AtomicBool,
}

#[async_trait::async_trait]
impl Intercept for CutAfterTakeover {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        request: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let answer = inner.reserve(request).await?;
        if let Reservation::Acquired {
            took_over: true, ..
        } = answer
        {
            if self.hang.swap(false, Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            if self.armed.swap(false, Ordering::SeqCst) {
                return Err(StoreError::new(
                    "cut-after-takeover",
                    "reserve",
                    "connection reset by peer (after the server committed)",
                ));
            }
        }
        Ok(answer)
    }
    async fn complete(
        &self,
        inner: &MemoryStore,
        completion: Completion<'_>,
    ) -> Result<Fenced, StoreError> {
        let Completion { by, .. } = completion;
        if by == AnsweredBy::RecoverHook && self.fail_recovered.swap(false, Ordering::SeqCst) {
            return Err(StoreError::new(
                "cut-after-takeover",
                "complete",
                "connection reset",
            ));
        }
        inner.complete(completion).await
    }
}

/// The owner charged the card and died. The retry's takeover lands in the
/// store, but its answer is lost (a store error the engine treats as "may
/// have landed"). The record is kept with its lease ended, so the next call
/// takes it over and asks the hook (releasing it made that call a fresh
/// attempt 1 that charged the card a second time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_whose_answer_was_lost_does_not_free_the_record_for_a_blind_rerun() {
    let (store, tenant) = owner_died_after_charging("order-r3").await;
    assert_eq!(
        charges(&tenant, "order-r3").len(),
        1,
        "the first attempt charged"
    );

    // The retry takes the record over (attempt 2); its answer is lost.
    store.armed.store(true, Ordering::SeqCst);
    let cut = charge(&store, &tenant, "order-r3", 500, None).await;
    assert!(matches!(cut, Err(PayError::Idempotency(_))), "{cut:?}");
    // Let the store's background work (release_detached) run.
    tokio::time::sleep(Duration::from_millis(50)).await;

    // The next retry: the previous attempts may have charged; the hook must
    // be asked before anything runs.
    let again = charge(&store, &tenant, "order-r3", 500, None).await;
    let asked_attempts: Vec<u32> = asked(&tenant).iter().map(|a| a.attempt).collect();
    assert_eq!(
        charges(&tenant, "order-r3").len(),
        1,
        "the card was charged twice (answer {again:?}; hook asked for attempts {asked_attempts:?}, \
         bodies run {})",
        bodies(&tenant)
    );
    assert!(
        !asked_attempts.is_empty(),
        "the recover hook was never asked"
    );
}

/// The same through a drop: the retry's takeover lands, and the call is
/// dropped while it waits for the answer (its HTTP client hung up). The store
/// ends the record's lease instead of releasing it; the next call asks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_dropped_in_flight_does_not_free_the_record_for_a_blind_rerun() {
    let (store, tenant) = owner_died_after_charging("order-r3c").await;
    store.hang.store(true, Ordering::SeqCst);
    let dropped = tokio::time::timeout(
        Duration::from_secs(2),
        charge(&store, &tenant, "order-r3c", 500, None),
    )
    .await;
    assert!(dropped.is_err(), "the call was dropped in flight");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let again = charge(&store, &tenant, "order-r3c", 500, None).await;
    let asked_attempts: Vec<u32> = asked(&tenant).iter().map(|a| a.attempt).collect();
    assert_eq!(
        charges(&tenant, "order-r3c").len(),
        1,
        "the card was charged twice (answer {again:?}; hook asked for attempts {asked_attempts:?})"
    );
}

/// A recover hook's answer whose completion fails is handed to the store's
/// background completion, which keeps the *recovered* mark (it used the
/// plain completion: `inspect` and the audit's `recovered` column then said
/// the body produced the answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_answer_completed_in_the_background_keeps_its_recovered_mark() {
    let (store, tenant) = owner_died_after_charging("order-r3b").await;
    store.fail_recovered.store(true, Ordering::SeqCst);
    let _ = charge(&store, &tenant, "order-r3b", 500, None).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        bodies(&tenant),
        1,
        "the hook answered; the body did not run again"
    );
    let identity = Identity::new(tenant.as_str(), "recovery.charge", "order-r3b").unwrap();
    let record = store.fetch(&identity).await.unwrap().expect("the record");
    assert_eq!(
        (record.state, record.recovered),
        (idempotent_runtime::RecordState::Complete, true),
        "{record:?}"
    );
}

/// A store whose record of `key` was left by an owner that charged the card
/// and died before recording the receipt (its lease runs out).
async fn owner_died_after_charging(key: &str) -> (Hooked<CutAfterTakeover>, String) {
    let store = Hooked::new(CutAfterTakeover {
        armed: AtomicBool::new(false),
        fail_recovered: AtomicBool::new(false),
        hang: AtomicBool::new(false),
    });
    let tenant = fresh_tenant(Ask::Gateway);
    let c = Crash::default();
    crash(
        charge(&store, &tenant, key, 500, Some((&c, When::AfterCharge))),
        &c,
    )
    .await;
    (store, tenant)
}
