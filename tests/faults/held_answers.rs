//! The windows in which an answer this process holds unrecorded must stay
//! pinned (`unrecorded::Pins`): the first call's write finds its record taken
//! over *while* the takeover's reservation statement is in flight, or as it
//! lands and fails or is dropped. The database tests of `connection_faults`
//! reach only the cases where that write ends after the takeover looked;
//! these use a hooked store (the memory store behind interceptors that
//! order the statements, no database) so the order is certain. The waits for
//! a lease to run out are the only waits on time. Found by a mutation audit:
//! pinning only at drop time, letting go before looking, no refresh at drop
//! time and no keep on a failed takeover in a hook scope each ran the body
//! twice with every other test passing.
use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Fenced, Identity, MemoryStore, Outcome,
    OwnerToken, Reservation, ReserveRequest, Store, StoreError,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

const LIMIT: Duration = Duration::from_secs(10);

/// Holds the first completion (the first call's write) until `go`;
/// `writing` says it has begun, `written` that it has ended.
#[derive(Default)]
struct FirstWriteHeld {
    completes: AtomicUsize,
    writing: Notify,
    go: Notify,
    written: Notify,
}

impl FirstWriteHeld {
    async fn complete(&self, inner: &MemoryStore, c: Completion<'_>) -> Result<Fenced, StoreError> {
        if self.completes.fetch_add(1, Ordering::SeqCst) == 0 {
            self.writing.notify_one();
            self.go.notified().await;
            let written = inner.complete(c).await;
            self.written.notify_one();
            return written;
        }
        inner.complete(c).await
    }

    /// The second reservation: lands (a takeover), then lets the first
    /// write end and waits for it. Whether this was that one, and its answer.
    async fn takeover_lets_the_first_write_end(
        &self,
        reserves: &AtomicUsize,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> (bool, Result<Reservation, StoreError>) {
        let takeover = reserves.fetch_add(1, Ordering::SeqCst) == 1;
        let answer = inner.reserve(r).await;
        if takeover {
            assert!(
                matches!(
                    answer,
                    Ok(Reservation::Acquired {
                        took_over: true,
                        ..
                    })
                ),
                "{answer:?}"
            );
            self.go.notify_one();
            self.written.notified().await;
        }
        (takeover, answer)
    }
}

// ---- 1: a write that finds the record taken over before the takeover looks

static RUNS_1: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "audit.held.look", key = key, tenant = shared, store = store,
             in_progress = reject, lease = "300ms")]
async fn look(store: &dyn Store, key: &str) -> Result<u32, Error> {
    RUNS_1.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

#[derive(Default)]
struct WriteLandsBeforeTheLook {
    first: FirstWriteHeld,
    reserves: AtomicUsize,
}

#[async_trait::async_trait]
impl Intercept for WriteLandsBeforeTheLook {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        // The first call's hanging write finds the record taken over before
        // this takeover's answer reaches its call.
        self.first
            .takeover_lets_the_first_write_end(&self.reserves, inner, r)
            .await
            .1
    }
    async fn complete(&self, inner: &MemoryStore, c: Completion<'_>) -> Result<Fenced, StoreError> {
        self.first.complete(inner, c).await
    }
}

/// DESIGN rule 3 (unrecorded.rs: the pin is held from before the
/// reservation statement until the takeover has looked): kills a call that
/// pins only at drop time, and one that lets go before it looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_finds_the_record_taken_over_before_the_takeover_looks_leaves_the_answer_to_it(
) {
    let store = Hooked::new(WriteLandsBeforeTheLook::default());
    let first = look(&store, "k");
    let retry = async {
        store.first.writing.notified().await;
        tokio::time::sleep(Duration::from_millis(500)).await; // lease lapsed
        with_outcome(look(&store, "k")).await
    };
    let (first, (retry, outcome)) =
        tokio::time::timeout(LIMIT, async { tokio::join!(first, retry) })
            .await
            .expect("bounded");
    assert_eq!(
        RUNS_1.load(Ordering::SeqCst),
        1,
        "rule 3: the takeover ran the body again ({first:?}, {retry:?})"
    );
    assert_eq!(retry.expect("the takeover"), 7);
    assert_eq!(outcome, Some(Outcome::Replayed));
}

// ---- 2: a takeover dropped after an answer was noted during its statement

static RUNS_2: AtomicUsize = AtomicUsize::new(0);
static BODY_GO: Notify = Notify::const_new();

#[idempotent(scope = "audit.held.drop", key = key, tenant = shared, store = store,
             in_progress = reject, lease = "300ms")]
async fn dropped(store: &dyn Store, key: &str) -> Result<u32, Error> {
    if RUNS_2.fetch_add(1, Ordering::SeqCst) == 0 {
        BODY_GO.notified().await;
    }
    Ok(7)
}

#[derive(Default)]
struct NotedWhileTheStatementIsInFlight {
    completes: AtomicUsize,
    reserves: AtomicUsize,
    sent: Notify,
    noted: Notify,
    landed: Notify,
    go: Notify,
}

#[async_trait::async_trait]
impl Intercept for NotedWhileTheStatementIsInFlight {
    async fn heartbeat(
        &self,
        _: &MemoryStore,
        _: &Identity,
        _: &OwnerToken,
        _: Duration,
    ) -> Result<Fenced, StoreError> {
        Ok(Fenced::Written) // renews nothing: the lease runs out while the body waits
    }
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        if self.reserves.fetch_add(1, Ordering::SeqCst) == 1 {
            self.sent.notify_one();
            self.noted.notified().await;
            let answer = inner.reserve(r).await;
            assert!(
                matches!(
                    answer,
                    Ok(Reservation::Acquired {
                        took_over: true,
                        ..
                    })
                ),
                "{answer:?}"
            );
            self.landed.notify_one();
            std::future::pending::<()>().await;
        }
        inner.reserve(r).await
    }
    async fn complete(&self, inner: &MemoryStore, c: Completion<'_>) -> Result<Fenced, StoreError> {
        if self.completes.fetch_add(1, Ordering::SeqCst) == 0 {
            self.noted.notify_one();
            self.go.notified().await;
        }
        inner.complete(c).await
    }
}

/// DESIGN rule 3 with FinishOnDrop's drop-time refresh: a takeover whose
/// statement was sent before the answer was noted, and that is dropped as
/// it lands, keeps the record for the next call, which replays the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_dropped_after_an_answer_was_noted_during_its_statement_keeps_the_record() {
    let store = Hooked::new(NotedWhileTheStatementIsInFlight::default());
    let run = async {
        let first = dropped(&store, "k");
        let rest = async {
            tokio::time::sleep(Duration::from_millis(500)).await; // lease lapsed in the body
            tokio::select! {
                answer = dropped(&store, "k") => panic!("the takeover answered: {answer:?}"),
                () = async {
                    store.sent.notified().await;
                    BODY_GO.notify_one();
                    store.landed.notified().await;
                } => {}
            }
            // Dropped as it landed; now the first call's write finds the record taken over.
            store.go.notify_one();
        };
        let (first, ()) = tokio::join!(first, rest);
        let (next, outcome) = with_outcome(dropped(&store, "k")).await;
        (first, next, outcome)
    };
    let (first, next, outcome) = tokio::time::timeout(LIMIT, run).await.expect("bounded");
    assert_eq!(
        RUNS_2.load(Ordering::SeqCst),
        1,
        "rule 3: the body ran again ({first:?}, {next:?})"
    );
    assert_eq!(next.expect("the next call"), 7);
    assert_eq!(outcome, Some(Outcome::Replayed));
}

// ---- 3: a failed takeover (recover hook) whose write ended while it was pinned

static RUNS_3: AtomicUsize = AtomicUsize::new(0);
static ASKED_3: AtomicUsize = AtomicUsize::new(0);

async fn run_again(
    _: &idempotent_runtime::Takeover,
) -> Result<idempotent_runtime::Recovery<u32>, Error> {
    ASKED_3.fetch_add(1, Ordering::SeqCst);
    Ok(idempotent_runtime::Recovery::Run)
}

#[idempotent(scope = "audit.held.failed", key = key, tenant = shared, store = store,
             in_progress = reject, lease = "300ms", recover = run_again)]
async fn failed(store: &dyn Store, key: &str) -> Result<u32, Error> {
    RUNS_3.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

#[derive(Default)]
struct TakeoverFailsAfterTheWriteEnded {
    first: FirstWriteHeld,
    reserves: AtomicUsize,
}

#[async_trait::async_trait]
impl Intercept for TakeoverFailsAfterTheWriteEnded {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let (takeover, answer) = self
            .first
            .takeover_lets_the_first_write_end(&self.reserves, inner, r)
            .await;
        if takeover {
            return Err(StoreError::new(
                "hooked",
                "reserve",
                "the connection was cut",
            ));
        }
        answer
    }
    async fn complete(&self, inner: &MemoryStore, c: Completion<'_>) -> Result<Fenced, StoreError> {
        self.first.complete(inner, c).await
    }
}

/// A takeover in a scope with a recover hook lands as its call fails, after
/// the first call's write found the record taken over: the record is kept
/// (lease ended) and so is the answer (Pins::keep), so the next call replays
/// it without asking the hook or running the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_takeover_with_a_hook_keeps_the_answer_held_for_the_next_call() {
    let store = Hooked::new(TakeoverFailsAfterTheWriteEnded::default());
    let first = failed(&store, "k");
    let retry = async {
        store.first.writing.notified().await;
        tokio::time::sleep(Duration::from_millis(500)).await; // lease lapsed
        let failed_takeover = failed(&store, "k").await;
        assert!(
            matches!(failed_takeover, Err(Error::Store(_))),
            "{failed_takeover:?}"
        );
        with_outcome(failed(&store, "k")).await
    };
    let (first, (next, outcome)) =
        tokio::time::timeout(LIMIT, async { tokio::join!(first, retry) })
            .await
            .expect("bounded");
    assert_eq!(
        RUNS_3.load(Ordering::SeqCst),
        1,
        "the body ran again ({first:?}, {next:?})"
    );
    assert_eq!(
        ASKED_3.load(Ordering::SeqCst),
        0,
        "the hook was asked though the answer is known"
    );
    assert_eq!(next.expect("the next call"), 7);
    assert_eq!(outcome, Some(Outcome::Replayed));
}

// ---- 4: a takeover whose store cannot take the answer held

static RUNS_4: AtomicUsize = AtomicUsize::new(0);

/// An answer larger than the smaller limit below.
fn large_answer() -> String {
    "x".repeat(100)
}

#[idempotent(scope = "audit.held.too_large", key = key, tenant = shared, store = store,
             in_progress = reject, lease = "300ms")]
async fn too_large(store: &dyn Store, key: &str) -> Result<String, Error> {
    RUNS_4.fetch_add(1, Ordering::SeqCst);
    Ok(large_answer())
}

/// The store's limit drops for the second call (as for a second store object
/// of the same kind opened after the server's limit changed).
struct LimitDropsForTheTakeover {
    limit: AtomicUsize,
    first: FirstWriteHeld,
}

#[async_trait::async_trait]
impl Intercept for LimitDropsForTheTakeover {
    fn max_result_bytes(&self, _: &MemoryStore) -> usize {
        self.limit.load(Ordering::SeqCst)
    }
    async fn complete(&self, inner: &MemoryStore, c: Completion<'_>) -> Result<Fenced, StoreError> {
        self.first.complete(inner, c).await
    }
}

/// A takeover that finds the answer this process holds but whose store
/// cannot take it (`ResultTooLarge`) keeps the record and the answer for the
/// next takeover, which records and replays it (unrecorded-answers hunt: the
/// record was released, and the next call ran the body again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_whose_store_cannot_take_the_answer_held_keeps_it_for_the_next() {
    let store = Hooked::new(LimitDropsForTheTakeover {
        limit: AtomicUsize::new(1 << 20),
        first: FirstWriteHeld::default(),
    });
    let first = too_large(&store, "k");
    let rest = async {
        store.first.writing.notified().await;
        tokio::time::sleep(Duration::from_millis(500)).await; // lease lapsed
        store.limit.store(10, Ordering::SeqCst);
        let refused = too_large(&store, "k").await;
        assert!(
            matches!(refused, Err(Error::ResultTooLarge { .. })),
            "{refused:?}"
        );
        store.limit.store(1 << 20, Ordering::SeqCst);
        // The first call's write now finds the record taken over.
        store.first.go.notify_one();
    };
    let (first, ()) = tokio::time::timeout(LIMIT, async { tokio::join!(first, rest) })
        .await
        .expect("bounded");
    let (next, outcome) = tokio::time::timeout(LIMIT, with_outcome(too_large(&store, "k")))
        .await
        .expect("bounded");
    assert_eq!(
        RUNS_4.load(Ordering::SeqCst),
        1,
        "rule 3: the body ran again ({first:?}, {next:?})"
    );
    assert_eq!(next.expect("the next call"), large_answer());
    assert_eq!(outcome, Some(Outcome::Replayed));
}

// ---- 5: the windows of that keep

#[derive(Default)]
struct KeepWindows {
    limit: AtomicUsize,
    first: FirstWriteHeld,
    // end-lease interception
    hang_end_lease: AtomicBool,
    pause_after_end_lease: AtomicBool,
    ending: Notify,
    landed: Notify,
    resume: Notify,
}

#[async_trait::async_trait]
impl Intercept for KeepWindows {
    fn max_result_bytes(&self, _: &MemoryStore) -> usize {
        self.limit.load(Ordering::SeqCst)
    }
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        if lease.is_zero() && self.hang_end_lease.load(Ordering::SeqCst) {
            self.ending.notify_one();
            std::future::pending::<()>().await;
        }
        if lease.is_zero() && self.pause_after_end_lease.swap(false, Ordering::SeqCst) {
            let r = inner.heartbeat(i, t, lease).await;
            self.landed.notify_one();
            self.resume.notified().await;
            return r;
        }
        inner.heartbeat(i, t, lease).await
    }
    async fn complete(&self, inner: &MemoryStore, c: Completion<'_>) -> Result<Fenced, StoreError> {
        self.first.complete(inner, c).await
    }
}

fn keep_windows() -> Hooked<KeepWindows> {
    let p = KeepWindows::default();
    p.limit.store(1 << 20, Ordering::SeqCst);
    Hooked::new(p)
}

static RUNS_A: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "audit.held.drop_in_keep", key = key, tenant = shared, store = store,
             in_progress = reject, lease = "300ms")]
async fn drop_in_keep(store: &dyn Store, key: &str) -> Result<String, Error> {
    RUNS_A.fetch_add(1, Ordering::SeqCst);
    Ok("x".repeat(100))
}

/// A takeover that cannot take the held answer, dropped while it ends the
/// record's lease, has the store's worker end it: the record was released
/// (the drop guard, still armed, knew of no reason to keep it), and the next
/// call ran the body again (review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_cannot_take_the_answer_dropped_as_it_keeps_the_record_keeps_it() {
    let store = keep_windows();
    let first = drop_in_keep(&store, "k");
    let rest = async {
        store.intercept.first.writing.notified().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        store.intercept.limit.store(10, Ordering::SeqCst);
        store.intercept.hang_end_lease.store(true, Ordering::SeqCst);
        tokio::select! {
            r = drop_in_keep(&store, "k") => panic!("answered {r:?}"),
            () = store.intercept.ending.notified() => {}
        }
        store
            .intercept
            .hang_end_lease
            .store(false, Ordering::SeqCst);
        store.intercept.limit.store(1 << 20, Ordering::SeqCst);
        store.intercept.first.go.notify_one();
    };
    let (first, ()) = tokio::time::timeout(LIMIT, async { tokio::join!(first, rest) })
        .await
        .expect("bounded");
    let (next, outcome) = tokio::time::timeout(LIMIT, with_outcome(drop_in_keep(&store, "k")))
        .await
        .expect("bounded");
    assert_eq!(
        RUNS_A.load(Ordering::SeqCst),
        1,
        "rule 3: the body ran again ({first:?}, {next:?}, {outcome:?})"
    );
}

static RUNS_B: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "audit.held.keep_order", key = key, tenant = shared, store = store,
             in_progress = reject, lease = "300ms")]
async fn keep_order(store: &dyn Store, key: &str) -> Result<String, Error> {
    RUNS_B.fetch_add(1, Ordering::SeqCst);
    Ok("x".repeat(100))
}

/// The answer is kept before the record's lease is ended: a call of this
/// process that takes the record over as soon as the lease has ended finds
/// it (review: kept only after, it found nothing and ran the body again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answer_is_kept_before_the_lease_is_ended() {
    let store = keep_windows();
    let first_done = Notify::new();
    let first = async {
        let r = keep_order(&store, "k").await;
        first_done.notify_one();
        r
    };
    let rest = async {
        let p = &store.intercept;
        p.first.writing.notified().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        p.limit.store(10, Ordering::SeqCst);
        p.pause_after_end_lease.store(true, Ordering::SeqCst);
        let second = keep_order(&store, "k");
        let driver = async {
            p.landed.notified().await;
            p.limit.store(1 << 20, Ordering::SeqCst);
            p.first.go.notify_one();
            first_done.notified().await;
            let third = with_outcome(keep_order(&store, "k")).await;
            p.resume.notify_one();
            third
        };
        tokio::join!(second, driver)
    };
    let (first, (second, third)) = tokio::time::timeout(LIMIT, async { tokio::join!(first, rest) })
        .await
        .expect("bounded");
    assert_eq!(
        RUNS_B.load(Ordering::SeqCst),
        1,
        "rule 3: the body ran again ({first:?}, {second:?}, {third:?})"
    );
}

// ---- 6: an answer kept for as long as its record may be taken over

static RUNS_6: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "audit.held.retention", key = key, tenant = shared, store = store,
             in_progress = reject, lease = "3s", ttl = "2s")]
async fn retained(store: &dyn Store, key: &str) -> Result<u32, Error> {
    RUNS_6.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

#[derive(Default)]
struct WriteHangsPastTheTtl {
    first: FirstWriteHeld,
}

#[async_trait::async_trait]
impl Intercept for WriteHangsPastTheTtl {
    async fn complete(&self, inner: &MemoryStore, c: Completion<'_>) -> Result<Fenced, StoreError> {
        self.first.complete(inner, c).await
    }
}

/// The record's retention counts its ttl from the end of the lease (the
/// reservation keeps it lease + ttl): an answer held unrecorded is kept as
/// long, and a takeover after the ttl counted from the answer, but within
/// that retention, records it (outage hunt: kept for the ttl alone, the
/// takeover found nothing and ran the body again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_held_is_kept_for_as_long_as_its_record_may_be_taken_over() {
    let store = Hooked::new(WriteHangsPastTheTtl::default());
    let first = retained(&store, "k");
    let rest = async {
        store.first.writing.notified().await;
        // Past the lease (3 s) and the ttl counted from the answer (2 s),
        // within the record's retention (5 s from its reservation).
        tokio::time::sleep(Duration::from_millis(3300)).await;
        let retry = with_outcome(retained(&store, "k")).await;
        store.first.go.notify_one();
        retry
    };
    let (first, (retry, outcome)) =
        tokio::time::timeout(LIMIT, async { tokio::join!(first, rest) })
            .await
            .expect("bounded");
    assert_eq!(
        RUNS_6.load(Ordering::SeqCst),
        1,
        "rule 3: the body ran again ({first:?}, {retry:?})"
    );
    assert_eq!(retry.expect("the takeover"), 7);
    assert_eq!(outcome, Some(Outcome::Replayed));
}

// ---- 7: a record a dropped takeover kept outlives its answer no more

static RUNS_7: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "audit.held.kept_tail", key = key, tenant = shared, store = store,
             in_progress = reject, lease = "1s", ttl = "3s")]
async fn kept_tail(store: &dyn Store, key: &str) -> Result<u32, Error> {
    RUNS_7.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

#[derive(Default)]
struct TakeoverDroppedAsItLands {
    first: FirstWriteHeld,
    reserves: AtomicUsize,
    landed: Notify,
}

#[async_trait::async_trait]
impl Intercept for TakeoverDroppedAsItLands {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        if self.reserves.fetch_add(1, Ordering::SeqCst) == 1 {
            let _ = inner.reserve(r).await;
            self.landed.notify_one();
            std::future::pending::<()>().await;
        }
        inner.reserve(r).await
    }
    async fn complete(&self, inner: &MemoryStore, c: Completion<'_>) -> Result<Fenced, StoreError> {
        self.first.complete(inner, c).await
    }
}

/// A takeover dropped as it lands keeps the record, whose retention the
/// takeover renewed (lease + ttl from then): the answer held stays as long,
/// and a call in the record's tail, past the answer's first time, records
/// and replays it (review: the answer kept its first time, and that call ran
/// the body again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_held_stays_as_long_as_the_record_a_takeover_kept() {
    let store = Hooked::new(TakeoverDroppedAsItLands::default());
    let first = kept_tail(&store, "k");
    let rest = async {
        store.first.writing.notified().await;
        let noted = tokio::time::Instant::now();
        // Past the lease (1 s), within the reservation's retention (4 s).
        tokio::time::sleep(Duration::from_millis(3000)).await;
        tokio::select! {
            answer = kept_tail(&store, "k") => panic!("the takeover answered: {answer:?}"),
            () = store.landed.notified() => {}
        }
        // Dropped as it landed: the record is kept, retained until about
        // 7 s; the first call's write now finds it taken over.
        store.first.go.notify_one();
        // Past the answer's first time (4 s from its note), within the kept
        // record's retention.
        tokio::time::sleep_until(noted + Duration::from_millis(5500)).await;
        with_outcome(kept_tail(&store, "k")).await
    };
    let (first, (retry, outcome)) =
        tokio::time::timeout(LIMIT, async { tokio::join!(first, rest) })
            .await
            .expect("bounded");
    assert_eq!(
        RUNS_7.load(Ordering::SeqCst),
        1,
        "rule 3: the body ran again ({first:?}, {retry:?})"
    );
    assert_eq!(retry.expect("the call in the kept record's tail"), 7);
    assert_eq!(outcome, Some(Outcome::Replayed));
}
