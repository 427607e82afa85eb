//! The engine: reserve → run the body under a lease → complete, release or record.

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::identity::Identity;
use crate::metrics::{CallOutcome, METRICS};
use crate::recovery::{Recovery, Takeover};
use crate::registry::{InProgressPolicy, ScopeInfo};
use crate::store::{
    Answer, AnsweredBy, Fenced, OwnerToken, Reservation, ReserveRequest, Store, StoredOutcome,
};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use serde::{de::DeserializeOwned, Serialize};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::task::Poll;
use std::time::Duration;
use tokio::time::{sleep_until, Instant};
use tracing::Instrument;

/// The largest serialized result (or recorded error) a call may record, in bytes.
pub const MAX_RESULT_BYTES: usize = 8 * 1024 * 1024;

// ---------------------------------------------------------------- default store

static DEFAULT_STORE: RwLock<Option<Arc<dyn Store>>> = RwLock::new(None);

/// Sets the store used by every `#[idempotent]` function that has no `store = ...`.
/// Call it once at startup; calling it again replaces the store for later calls.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use idempotent_runtime::{set_default_store, MemoryStore};
/// set_default_store(MemoryStore::new());
/// # }
/// ```
pub fn set_default_store(store: impl Store + 'static) {
    let store: Arc<dyn Store> = Arc::new(store);
    *DEFAULT_STORE
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(store);
}

/// The store set by [`set_default_store`], if any.
pub fn default_store() -> Option<Arc<dyn Store>> {
    DEFAULT_STORE
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()
}

// ---------------------------------------------------------------- outcome

/// How an idempotent call was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The body ran (first call, retry after a release, or takeover of an expired lease).
    Executed,
    /// The body did not run: the recorded result (or recorded error) was returned.
    Replayed,
    /// The call took over a record whose previous owner's lease had expired,
    /// and its `recover` hook answered instead of the body (rule 20):
    /// `Recovery::Completed(v)` (recorded and returned) or an error.
    Recovered,
}

/// What the idempotent calls that finished in a [`with_outcome`] scope
/// reported: the last one's [`Outcome`], and whether any of them replayed a
/// recorded error (the consumer's verdict needs to know: an `Err` of the
/// handler's own after replays of results only came from a later step, which
/// failed; with a recorded error among the replays it is that answer, in
/// whatever order the calls finished).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reported {
    /// `None` when no call finished with a result (refused, failed).
    pub(crate) outcome: Option<Outcome>,
    pub(crate) replayed_error: bool,
    /// Whether a body's `Ok` result could not be recorded (rule 12): its
    /// effect happened, and every retry would run it again. A body's `Err`
    /// that its error policy could not record is released like any error
    /// not recorded, and does not count.
    pub(crate) unrecordable_result: bool,
    /// The last call refused as a mismatch, if any, and what the record
    /// that refused it was when read (store mode): a record still in
    /// progress, or abandoned in progress, may yet be released or taken over
    /// by the delivery that made it, so a message consumer redelivers rather
    /// than terms.
    pub(crate) last_mismatch: Option<LastMismatch>,
}

/// What refused the last call refused as a fingerprint mismatch (see
/// [`Reported::last_mismatch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LastMismatch {
    /// A record still in progress under a live lease, with the lease it had
    /// left: its owner may yet release the key.
    Running { lease_remaining: Duration },
    /// A record left in progress by an owner whose lease ran out without an
    /// answer `abandoned_for` ago (the store's clock): the call that made it
    /// (other arguments, or another version's fingerprint of the same ones)
    /// may yet take it over and finish it.
    Abandoned { abandoned_for: Duration },
    /// A complete record, or not known in transactional mode (which reads
    /// nothing more): a plain mismatch.
    Final,
    /// The record's state could not be read (the store failed): it may
    /// still be running and be released, so the mismatch is not final.
    Unread,
}

/// Where a [`with_outcome`] scope collects what its calls reported: shared,
/// so that [`carry_outcome`] can hand it to a future on another task.
type ReportSlot = std::sync::Arc<std::sync::Mutex<Option<Reported>>>;

tokio::task_local! {
    static OUTCOME: ReportSlot;
}

/// Runs `future` and reports how the idempotent call in it was answered,
/// without changing the function's signature: with several calls, the one
/// that finished last (an annotated function calling another finishes after
/// it, so that is the outermost). `None` when no idempotent call finished
/// with a result (e.g. it was refused).
///
/// ```
/// # use idempotent_runtime::{idempotent, with_outcome, Outcome, MemoryStore, Error};
/// #[idempotent(scope = "docs.outcome", key = key, tenant = shared, store = store)]
/// async fn work(store: &MemoryStore, key: &str) -> Result<u32, Error> { Ok(7) }
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// let (_, first) = with_outcome(work(&store, "k")).await;
/// let (_, again) = with_outcome(work(&store, "k")).await;
/// assert_eq!((first, again), (Some(Outcome::Executed), Some(Outcome::Replayed)));
/// # }
/// ```
pub async fn with_outcome<F: Future>(future: F) -> (F::Output, Option<Outcome>) {
    let (out, reported) = with_report(future).await;
    (out, reported.and_then(|r| r.outcome))
}

/// [`with_outcome`], with what the call reported whole. What a scope saw is
/// also reported to the scope around it, if any: a handler that uses
/// `with_outcome` itself inside [`consumer::handle`](crate::consumer::handle)
/// still reports its replay to the delivery.
pub(crate) async fn with_report<F: Future>(future: F) -> (F::Output, Option<Reported>) {
    reported_in(future, |reported| reported).await
}

/// [`with_report`] for a scope that settles a replayed recorded error
/// itself ([`consumer::handle`](crate::consumer::handle): it is that
/// delivery's answer, acked there). The scope around it hears the rest of
/// what it saw, but not that replay: an `Err` the enclosing handler returns
/// after a nested `handle` replayed a recorded error is the enclosing
/// handler's own failure, not a recorded answer.
pub(crate) async fn with_settled_report<F: Future>(future: F) -> (F::Output, Option<Reported>) {
    reported_in(future, |reported| Reported {
        replayed_error: false,
        ..reported
    })
    .await
}

/// Runs `future` in a scope of its own, and reports `passed_on` of what it
/// saw to the scope around it, if any.
async fn reported_in<F: Future>(
    future: F,
    passed_on: impl FnOnce(Reported) -> Reported,
) -> (F::Output, Option<Reported>) {
    let slot = ReportSlot::default();
    let out = OUTCOME.scope(slot.clone(), future).await;
    let reported = *slot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(reported) = reported {
        report_whole(passed_on(reported));
    }
    (out, reported)
}

/// Lets an idempotent call that runs on another task report to the
/// [`with_outcome`] scope this is called in (and so to
/// [`consumer::handle`](crate::consumer::handle) and
/// [`consumer::nats::process`](crate::consumer::nats::process)). The scope is
/// tied to its task: a call spawned with `tokio::spawn` reports to nobody, so
/// a consumer could not tell the replay of a recorded error (acked) from a
/// failure (nak'd), and would nak it at every delivery. Wrap the future when
/// you spawn it, *inside* the scope: the scope is taken when `carry_outcome`
/// is called, not when the future is polled (outside a scope the future only
/// runs, reporting to nobody). With several calls carried into one scope,
/// the scope reports the one that finished last.
///
/// ```
/// # use idempotent_runtime::{carry_outcome, idempotent, with_outcome, Outcome, MemoryStore, Error};
/// #[idempotent(scope = "docs.carry", key = key, tenant = shared, store = store)]
/// async fn work(store: MemoryStore, key: String) -> Result<u32, Error> { Ok(7) }
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// let (_, first) = with_outcome(async {
///     tokio::spawn(carry_outcome(work(store.clone(), "k".into()))).await
/// })
/// .await;
/// assert_eq!(first, Some(Outcome::Executed));
/// # }
/// ```
pub fn carry_outcome<F: Future>(future: F) -> impl Future<Output = F::Output> {
    let slot = OUTCOME.try_with(ReportSlot::clone).ok();
    async move {
        match slot {
            Some(slot) => OUTCOME.scope(slot, future).await,
            None => future.await,
        }
    }
}

pub(crate) fn report(outcome: Outcome) {
    report_whole(Reported {
        outcome: Some(outcome),
        replayed_error: false,
        unrecordable_result: false,
        last_mismatch: None,
    });
}

/// Reports a call refused as a mismatch, with what refused it (see
/// [`Reported::last_mismatch`]).
fn report_mismatch(refused_by: LastMismatch) {
    report_whole(Reported {
        outcome: None,
        replayed_error: false,
        unrecordable_result: false,
        last_mismatch: Some(refused_by),
    });
}

/// Reports a body's `Ok` result that could not be recorded (see
/// [`Reported::unrecordable_result`]).
fn report_unrecordable_result() {
    report_whole(Reported {
        outcome: None,
        replayed_error: false,
        unrecordable_result: true,
        last_mismatch: None,
    });
}

fn report_whole(reported: Reported) {
    // Outside `with_outcome` there is nobody to tell; that is fine.
    let _ = OUTCOME.try_with(|slot| {
        let mut slot = slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let earlier = *slot;
        *slot = Some(Reported {
            // The call that finished last, of those that finished with a result.
            outcome: reported.outcome.or(earlier.and_then(|r| r.outcome)),
            replayed_error: reported.replayed_error || earlier.is_some_and(|r| r.replayed_error),
            unrecordable_result: reported.unrecordable_result
                || earlier.is_some_and(|r| r.unrecordable_result),
            // The mismatch reported last, also from a scope nested in this
            // one (its report arrives whole): an outcome reported after it (an
            // annotated function whose body returned that mismatch) keeps it.
            last_mismatch: reported
                .last_mismatch
                .or(earlier.and_then(|r| r.last_mismatch)),
        });
    });
}

// ---------------------------------------------------------------- return types and error policies

/// The return type of an annotated function: `Result<T, E>` with a serializable `T`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a `Result<T, E>`: #[idempotent] functions must return one (or an alias of one), so a refusal or a store failure can be returned as an error",
    label = "the function's return type",
    note = "return `Result<T, E>` with `T: Serialize + Deserialize` and `E: From<idempotent_runtime::Error>`"
)]
pub trait IdempotentReturn: Sized {
    /// The success value, recorded and replayed.
    type Value: Serialize + DeserializeOwned;
    /// The function's error type.
    type Failure: From<Error>;
    /// Splits into a standard `Result`.
    fn into_result(self) -> Result<Self::Value, Self::Failure>;
    /// Rebuilds from a standard `Result`.
    fn from_result(r: Result<Self::Value, Self::Failure>) -> Self;
}

impl<T: Serialize + DeserializeOwned, E: From<Error>> IdempotentReturn for Result<T, E> {
    type Value = T;
    type Failure = E;
    fn into_result(self) -> Result<T, E> {
        self
    }
    fn from_result(r: Result<T, E>) -> Self {
        r
    }
}

/// How `Err(e)` values are treated (`errors = ...` in the attribute).
pub trait ErrorHandling<E> {
    /// Whether `error` is recorded as the final answer (`false`: the record
    /// is released). Asked once per error.
    fn records(&self, error: &E) -> bool;
    /// `error` as it is recorded (JSON), asked only after [`records`] said
    /// yes and [`check_faithful`] passed (serde_json has no guard against a
    /// value nested deep enough to overflow the stack; the check has).
    ///
    /// [`records`]: ErrorHandling::records
    /// [`check_faithful`]: ErrorHandling::check_faithful
    fn encode(&self, error: &E) -> Result<Vec<u8>, String>;
    /// Rebuild a recorded error for a replay.
    fn replay(&self, payload: &[u8]) -> Result<E, String>;
    /// Rule 12 for a recorded error: `Err` when it would not replay equal.
    fn check_faithful(&self, _error: &E) -> Result<(), String> {
        Ok(())
    }
    /// Rule 12 for a recorded error: `payload` (what `error` was recorded
    /// as) reads back as an equal error (see [`reads_back_equal`]).
    fn reads_back(&self, _error: &E, payload: &[u8]) -> Result<(), String> {
        self.replay(payload).map(drop)
    }
}

/// `errors = release` (the default): every `Err` releases the key.
#[derive(Debug, Clone, Copy)]
pub struct ReleaseErrors;

impl<E> ErrorHandling<E> for ReleaseErrors {
    fn records(&self, _: &E) -> bool {
        false
    }
    fn encode(&self, _: &E) -> Result<Vec<u8>, String> {
        Err("errors = release records no error".to_owned())
    }
    fn replay(&self, _: &[u8]) -> Result<E, String> {
        Err(
            "the record holds a recorded error, but this function now releases errors \
             (errors = release); the record will expire after its ttl"
                .to_owned(),
        )
    }
}

/// The methods of an [`ErrorHandling`] that records errors (`errors = record`
/// and `errors = record_if(...)`), for an error type `E`: a recorded error is
/// its JSON, checked before it is written and read back equal after (rule
/// 12), and decoded from it for a replay.
macro_rules! errors_recorded_as_json {
    () => {
        fn encode(&self, error: &E) -> Result<Vec<u8>, String> {
            serde_json::to_vec(error).map_err(|e| e.to_string())
        }
        fn check_faithful(&self, error: &E) -> Result<(), String> {
            crate::fingerprint::check_faithful_json(error)
        }
        fn reads_back(&self, error: &E, payload: &[u8]) -> Result<(), String> {
            reads_back_equal(error, payload)
        }
        fn replay(&self, payload: &[u8]) -> Result<E, String> {
            serde_json::from_slice(payload).map_err(|e| replay_failure(&e))
        }
    };
}

/// `errors = record`: every `Err` is recorded and replayed.
#[derive(Debug, Clone, Copy)]
pub struct RecordErrors;

impl<E: Serialize + DeserializeOwned> ErrorHandling<E> for RecordErrors {
    fn records(&self, _: &E) -> bool {
        true
    }
    errors_recorded_as_json!();
}

/// `errors = record_if(pred)`: errors for which `pred(&e)` is true are recorded; others release.
#[derive(Debug, Clone, Copy)]
pub struct RecordErrorsIf<F>(pub F);

impl<E: Serialize + DeserializeOwned, F: Fn(&E) -> bool> ErrorHandling<E> for RecordErrorsIf<F> {
    fn records(&self, error: &E) -> bool {
        (self.0)(error)
    }
    errors_recorded_as_json!();
}

// ---------------------------------------------------------------- the call

/// A store that is either borrowed from the call's arguments or the default one.
pub enum StoreRef<'a> {
    /// `store = <expr>`.
    Borrowed(&'a dyn Store),
    /// The process-wide default store.
    Shared(Arc<dyn Store>),
}

impl StoreRef<'_> {
    fn get(&self) -> &dyn Store {
        match self {
            StoreRef::Borrowed(s) => *s,
            StoreRef::Shared(s) => s.as_ref(),
        }
    }
}

/// Everything the engine needs for one call, prepared before the body runs.
pub struct Call<'a> {
    /// What the attribute declared.
    pub spec: &'static ScopeInfo,
    /// Where the record lives.
    pub store: Result<StoreRef<'a>, Error>,
    /// The validated identity.
    pub identity: Result<Identity, Error>,
    /// The arguments' fingerprint (`None` when there is nothing to fingerprint).
    pub fingerprint: Result<Option<Fingerprint>, Error>,
}

/// Finishes the record of a call that is dropped (cancelled) mid-way (rule 14);
/// the store carries the work out, not the caller's runtime:
/// * dropped while a reservation that may acquire the record is in flight, or
///   while the body runs: the record is released, so a retry runs again; in a
///   scope with a `recover` hook its lease is ended instead (see
///   `keep_for_takeover`), and so it is while the reservation is in flight
///   when this process holds the request's answer unrecorded (see `pins`);
/// * dropped while the result is being recorded: the body has run, so the
///   result is recorded (freeing the key would let a retry run it twice).
struct FinishOnDrop<'a> {
    store: &'a dyn Store,
    identity: &'a Identity,
    token: &'a OwnerToken,
    /// The call's fingerprint (with the store's kind and database and the
    /// identity, what its answer is noted under while it is recorded:
    /// `unrecorded`).
    fingerprint: Option<&'a Fingerprint>,
    /// While the reservation is in flight: the answers of this call's
    /// request this process has not recorded yet, if any (`unrecorded::Pins`).
    /// The reservation may be a takeover that lands as the call fails or is
    /// dropped, before it could look for them: the record is then kept for
    /// the next call's takeover (its lease ended), which records the answer,
    /// never released for a new record whose call would run the body again
    /// (NATS hunt: the body ran twice).
    pins: crate::unrecorded::Pins<'a>,
    /// Set while a reservation is in flight and while the call owns the record.
    armed: AtomicBool,
    /// The outcome being recorded, while its completion is under way, and
    /// whether a recover hook gave it (the record is then marked recovered).
    completing: Option<Answer>,
    /// The scope has a `recover` hook: a call that ends without an answer
    /// (dropped while its reservation is in flight or while the body runs, or
    /// a body that panics) may have left the side effect behind, as an owner
    /// that died would have. Releasing the record would make the next call a
    /// fresh attempt that runs the body without asking the hook (rule 20), so
    /// its lease is ended instead: the next call takes it over at once and
    /// asks.
    keep_for_takeover: bool,
    /// The call's scope: an answer noted unrecorded is kept for the record's
    /// retention, which counts its ttl from the end of the scope's lease.
    spec: &'static ScopeInfo,
}

impl FinishOnDrop<'_> {
    fn arm(&self, armed: bool) {
        self.armed.store(armed, Ordering::Relaxed);
    }

    /// Ends the lease of the call's record, kept in progress, so the next
    /// call takes it over at once and asks the recover hook (rule 20), and
    /// disarms the guard: nothing is left for a drop to finish. The renewals
    /// still on their way (`in_flight`) land first: one landing after the
    /// end would renew the ended lease.
    async fn end_lease_for_takeover(&mut self, in_flight: Option<RenewalsInFlight<'_>>) {
        if let Some(in_flight) = in_flight {
            in_flight.landed(self.spec, self.identity).await;
        }
        end_lease_logged(self.store, self.identity, self.token).await;
        self.arm(false);
    }
}

impl Drop for FinishOnDrop<'_> {
    fn drop(&mut self) {
        // Cloned only when there is something to hand over: most calls end
        // disarmed, with nothing left to finish.
        // Answers noted since the last statement count too, while the
        // reservation is in flight (afterwards `refresh` does nothing).
        if *self.armed.get_mut() {
            self.pins.refresh();
        }
        if *self.armed.get_mut() && (self.keep_for_takeover || self.pins.holds()) {
            self.pins.keep(self.spec.lease);
            let (identity, token) = (self.identity.clone(), self.token.clone());
            tracing::info!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                "call ended without an answer; the store ends the lease of its record (if it has one), \
                 for the next call to take over and ask the recover hook, or record the answer this \
                 process holds");
            self.store.end_lease_detached(identity, token);
        } else if *self.armed.get_mut() {
            let (identity, token) = (self.identity.clone(), self.token.clone());
            tracing::info!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                "call ended while it held (or may have held) its record; the store releases it");
            self.store.release_detached(identity, token);
        } else if let Some(answer) = self.completing.take() {
            let (identity, token) = (&self.identity, &self.token);
            tracing::info!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                "call dropped while recording its result; the store records it");
            self.store
                .complete_detached(answer.completing(identity, token));
        }
    }
}

// ---------------------------------------------------------------- recover hooks (rule 20)

/// A function's `recover = ...` hook, or [`NoRecover`]. The generated code
/// passes one of these to [`execute`] and [`begin_in_transaction`](crate::__private::begin_in_transaction).
pub trait Recover<T, E> {
    /// The hook's future.
    type Future: Future<Output = Result<Recovery<T>, E>>;
    /// Calls the hook for a takeover; `None` when there is no hook.
    fn ask(self, takeover: Takeover) -> Option<Self::Future>;
}

/// No `recover = ...`: a takeover runs the body again (logged and counted).
#[derive(Debug, Clone, Copy)]
pub struct NoRecover;

impl<T, E> Recover<T, E> for NoRecover {
    type Future = std::future::Ready<Result<Recovery<T>, E>>;
    fn ask(self, _: Takeover) -> Option<Self::Future> {
        None
    }
}

/// `recover = path`: the generated code wraps a closure that owns the
/// [`Takeover`] and calls `path(&takeover)`.
#[derive(Debug, Clone, Copy)]
pub struct RecoverWith<F>(pub F);

impl<T, E, F, Fut> Recover<T, E> for RecoverWith<F>
where
    F: FnOnce(Takeover) -> Fut,
    Fut: Future<Output = Result<Recovery<T>, E>>,
{
    type Future = Fut;
    fn ask(self, takeover: Takeover) -> Option<Fut> {
        Some((self.0)(takeover))
    }
}

/// Pins a hook's answer to the function's own `T` and `E`, so a hook of the
/// wrong type is reported at the `recover = path` the user wrote.
pub fn recovery<R: IdempotentReturn>(
    answer: Result<Recovery<R::Value>, R::Failure>,
) -> Result<Recovery<R::Value>, R::Failure> {
    answer
}

/// Logs and counts a takeover (rule 20: every takeover, with its attempt).
pub(crate) fn note_takeover(
    spec: &'static ScopeInfo,
    identity: &Identity,
    attempt: u32,
    previous_started_ms: Option<i64>,
    answer_known: bool,
) {
    crate::metrics::takeover(spec.scope, attempt);
    let previous_started = previous_started_ms.map(|ms| {
        humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
        )
        .to_string()
    });
    match spec.recover {
        _ if answer_known => {
            tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.log_digest(),
            attempt, previous_attempt_started_at = previous_started.as_deref().unwrap_or("?"),
            "took over a record whose lease had expired; this process holds the answer the previous \
             attempt produced and could not record (the store was unreachable, or its write hung, \
             past the lease): recording that answer instead of running the body again")
        }
        Some(hook) => {
            tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.log_digest(),
            attempt, previous_attempt_started_at = previous_started.as_deref().unwrap_or("?"), recover = hook,
            "took over a record whose lease had expired; the previous attempt may have done the work: asking the recover hook")
        }
        None => {
            tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.log_digest(),
            attempt, previous_attempt_started_at = previous_started.as_deref().unwrap_or("?"),
            "took over a record whose lease had expired; running the body again although the previous attempt \
             may have done the work (give the function `recover = ...` to check first)")
        }
    }
}

// ---------------------------------------------------------------- the call

/// Runs one idempotent call. The generated code calls this through `__private`.
pub async fn execute<R, H, C, Fut>(call: Call<'_>, errors: H, recover: C, body: Fut) -> R
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
    C: Recover<R::Value, R::Failure>,
    Fut: Future<Output = R>,
{
    let spec = call.spec;
    let span = call_span(&call);
    let steps = async {
        // Only what touches the body is generic over it (one copy of these
        // steps per annotated function): the call's steps before and after
        // the body are functions of their own, compiled once per answer type.
        let (identity, store_ref, fingerprint) = match checked_call(call, &span) {
            Ok(checked) => checked,
            Err(e) => return failed::<R>(e),
        };
        let store = store_ref.get();
        let token = OwnerToken::new();
        let mut guard = FinishOnDrop {
            store,
            identity: &identity,
            token: &token,
            fingerprint: fingerprint.as_ref(),
            armed: AtomicBool::new(false),
            completing: None,
            keep_for_takeover: spec.recover.is_some(),
            pins: crate::unrecorded::Pins::for_call(&identity, store, fingerprint.as_ref()),
            spec,
        };
        let (running, lease_set) = match before_body::<R, H, C>(
            (spec, store, &identity, &token),
            fingerprint.as_ref(),
            &mut guard,
            &errors,
            recover,
            &span,
        )
        .await
        {
            Ok(running) => running,
            Err(answered) => return answered,
        };
        let (ran, lease_watch, in_flight) = run_with_heartbeat(
            store,
            spec,
            (&identity, &token),
            (spec.lease, lease_set),
            body,
        )
        .await;
        after_body::<R, H>(
            (spec, store, &identity, &token),
            &mut guard,
            &errors,
            (ran, lease_watch, running, in_flight),
        )
        .await
    };
    let (result, outcome): Answered<R> = steps.instrument(span.clone()).await;
    call_ended(spec, &span, outcome);
    R::from_result(result)
}

/// The span of one call (`idempotent_call`), its key's digest recorded.
/// Apart from [`execute`] so that it is compiled once, not once per
/// annotated function.
fn call_span(call: &Call<'_>) -> tracing::Span {
    crate::registry::report_conflicts_once();
    let span = tracing::info_span!(target: "idempotent", "idempotent_call",
        scope = call.spec.scope, key = tracing::field::Empty, store = tracing::field::Empty,
        attempt = tracing::field::Empty, outcome = tracing::field::Empty);
    if let (Ok(identity), false) = (&call.identity, span.is_disabled()) {
        span.record("key", identity.key_digest().as_str());
    }
    span
}

/// Counts the call's outcome and records it into its span.
fn call_ended(spec: &'static ScopeInfo, span: &tracing::Span, outcome: CallOutcome) {
    crate::metrics::call(spec.scope, outcome);
    if recordable(span) {
        span.record("outcome", outcome.as_str());
    }
}

/// Whether a value recorded into the call's span can reach anyone: a
/// subscriber that enabled the span, or a `log` logger listening at INFO
/// (tracing's `log` compatibility writes records of disabled spans to it,
/// and only at or below `log::max_level()`). Otherwise the record is skipped:
/// it would be built and dropped unseen on every call.
fn recordable(span: &tracing::Span) -> bool {
    !span.is_disabled() || log::max_level() >= log::LevelFilter::Info
}

/// `Error::NoRuntime` when the call is polled outside a tokio runtime, or in
/// one built without its timer (`Builder::new_current_thread().build()`
/// without `enable_time` or `enable_all`): the heartbeat, the waits and the
/// SQL stores would panic there, on the memory store part-way through the
/// body (whose retry then ran it again). So nothing is reserved.
pub(crate) fn within_a_runtime(spec: &ScopeInfo) -> Result<(), Error> {
    thread_local! {
        /// The runtime this thread last looked for a timer in, and whether
        /// it has one (runtime ids are never reused).
        static TIMED: std::cell::Cell<Option<(tokio::runtime::Id, bool)>> =
            const { std::cell::Cell::new(None) };
    }
    let refused = || Error::NoRuntime {
        scope: spec.scope.to_owned(),
    };
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| refused())?;
    let id = runtime.id();
    let timed = match TIMED.with(|timed| timed.get()) {
        Some((known, timed)) if known == id => timed,
        _ => {
            // tokio has no question for it: making a timer (not polled, so
            // never registered) panics without one. The panic is reported
            // once per runtime and thread; under `panic = "abort"` it ends
            // the process (nothing was reserved).
            let timed =
                std::panic::catch_unwind(|| drop(tokio::time::sleep(Duration::ZERO))).is_ok();
            TIMED.with(|cell| cell.set(Some((id, timed))));
            timed
        }
    };
    if timed {
        Ok(())
    } else {
        Err(refused())
    }
}

/// The outcome label of a call that failed with `error`.
pub(crate) fn failure_outcome(error: &Error) -> CallOutcome {
    match error {
        Error::FingerprintMismatch(_) => CallOutcome::Mismatch,
        Error::InProgress { .. } => CallOutcome::InProgress,
        Error::LeaseLost(_) => CallOutcome::LeaseLost,
        _ => CallOutcome::Failed,
    }
}

pub(crate) type Answered<R> = (
    Result<<R as IdempotentReturn>::Value, <R as IdempotentReturn>::Failure>,
    CallOutcome,
);

/// The answer of a call that failed with `e` before or instead of its body.
fn failed<R: IdempotentReturn>(e: Error) -> Answered<R> {
    let outcome = failure_outcome(&e);
    (Err(e.into()), outcome)
}

/// The call's identity, store and fingerprint, once each was made without
/// error and the call runs where it can (a tokio runtime with its timer).
fn checked_call<'a>(
    call: Call<'a>,
    span: &tracing::Span,
) -> Result<(Identity, StoreRef<'a>, Option<Fingerprint>), Error> {
    let identity = call.identity?;
    within_a_runtime(call.spec)?;
    let store_ref = call.store?;
    if recordable(span) {
        span.record("store", store_ref.get().name());
    }
    let fingerprint = call.fingerprint?;
    Ok((identity, store_ref, fingerprint))
}

/// What every step of one call in store mode works on: its scope, store,
/// identity and owner token.
type CallParts<'c> = (
    &'static ScopeInfo,
    &'c dyn Store,
    &'c Identity,
    &'c OwnerToken,
);

/// The call's steps up to its body: the reservation, and on a takeover the
/// unrecorded answer or the recover hook. `Ok` with when the body starts and
/// when its lease was last written at the earliest (the sending of the
/// statement that wrote it: the body's first renewal is due a period after
/// that, see [`Heartbeat`]), or `Err` with the call's answer (a replay, a
/// refusal, a recovered answer): the body does not run.
async fn before_body<'c, R, H, C>(
    (spec, store, identity, token): CallParts<'c>,
    fingerprint: Option<&Fingerprint>,
    guard: &mut FinishOnDrop<'c>,
    errors: &H,
    recover: C,
    span: &tracing::Span,
) -> Result<(Instant, Instant), Answered<R>>
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
    C: Recover<R::Value, R::Failure>,
{
    let fail = |e: Error| Err(failed::<R>(e));
    let digest = identity.log_digest();
    let request = reserve_request(spec, identity, fingerprint, token);
    let reserving = Instant::now();
    let reserved = reserve_from(
        store,
        request,
        spec,
        Some((&guard.armed, &guard.pins)),
        reserving,
    )
    .await;
    if guard.keep_for_takeover && guard.armed.load(Ordering::Relaxed) && reserved.is_err() {
        // The reservation failed but may have landed, possibly as a takeover:
        // end its lease (fenced by this call's token; nothing if it never
        // landed) so the next call takes it over at once and asks the hook.
        guard.pins.keep(spec.lease);
        if end_lease_logged(store, identity, token).await == EndedLease::NotOurs {
            // Nothing of this token yet: a statement still in flight may land
            // later, so the store's worker tries again.
            store.end_lease_detached(identity.clone(), token.clone());
        }
        guard.arm(false);
    }
    // Without a hook, a failed reservation that may have landed is finished
    // by the guard as the call returns, as a dropped one is: released, or,
    // while this process holds the request's answer unrecorded, kept for the
    // next takeover by the store's worker (the error is not held up by a
    // store that is likely down). One path for both, which the test of a
    // dropped takeover covers.
    let reserved_at = Instant::now();
    crate::metrics::reserve_time(
        spec.scope,
        reserve_label(&reserved),
        reserved_at - reserving,
    );
    let acquired = match reserved {
        Ok(Reserved::Acquired(acquired)) => acquired,
        Ok(Reserved::Replay(outcome)) => {
            return Err(replay::<R, H>(
                spec,
                errors,
                identity,
                store.name(),
                outcome,
            ))
        }
        Err(e) => return fail(e),
    };
    // The reservation acquired: a record this call holds is released or
    // recorded as rules 13 and 14 say. The pins are let go once a takeover
    // has looked for the answer (until then an answer whose write finds the
    // record taken over, by this very call, stays: review).
    let pinned = guard.pins.let_go();
    if recordable(span) {
        span.record("attempt", acquired.attempt);
    }

    let known = acquired
        .took_over
        .then(|| {
            let request =
                crate::unrecorded::Request::new((store.name(), store.database_id()), fingerprint);
            crate::unrecorded::for_takeover(identity, &request).map(|known| (known, request))
        })
        .flatten();
    drop(pinned);
    let takeover = acquired.takeover(spec, identity, known.is_some());
    if let Some((known, request)) = known {
        let mut sink = StoreSink {
            store,
            guard: &mut *guard,
            in_flight: None,
        };
        return Err(record_unrecorded_answer::<R, H>(
            spec,
            (errors, identity, &request),
            &mut sink,
            known,
            true,
        )
        .await);
    }
    // Rules 3 and 10: a reservation answered a lease (or nearly) after it
    // was sent (the process stopped or starved while the statement was
    // decided) may have lost the record before this call learnt it owned
    // it: another caller may have taken it over, run the body and recorded
    // its answer. One fenced renewal says whether it is still this call's
    // (and gives the body a full lease) before the hook or the body runs.
    // The lease the body starts with was set no earlier than this.
    let mut lease_set = acquired.sent;
    if acquired.answered_late(spec.lease, reserved_at) {
        let renewing = Instant::now();
        match store.heartbeat(identity, token, spec.lease).await {
            Ok(Fenced::Written) => lease_set = renewing,
            Ok(Fenced::NotOwner) => {
                tracing::error!(target: "idempotent", scope = spec.scope, key = %digest,
                    attempt = acquired.attempt,
                    "the reservation was answered after its lease had run out, and another caller \
                     has taken the record over: the body does not run");
                guard.arm(false);
                // The body did not run: not the `lease_lost` outcome.
                return Err((
                    Err(Error::LeaseLost(identity.context()).into()),
                    CallOutcome::Failed,
                ));
            }
            // Ownership unknown: the body does not run blind. The guard,
            // still armed, finishes the record as for a failed reservation
            // (released, or its lease ended for a scope with a hook).
            Err(e) => return fail(Error::Store(e)),
        }
    }
    if let Some(takeover) = takeover
        && let Some(hook) = recover.ask(takeover)
    {
        // While the hook runs (and until the body starts), the guard stays
        // armed for a takeover: a dropped call ends the record's lease, so the
        // next call takes it over at once and asks the hook again. Releasing
        // it would let a retry run the body blind; leaving it (as this did)
        // refused every retry for the rest of a renewed lease.
        let (answer, mut hook_watch, in_flight) = run_with_heartbeat(
            store,
            spec,
            (identity, token),
            (spec.lease, lease_set),
            hook,
        )
        .await;
        // The hook's renewals still on their way land before this call
        // ends its lease (the hook panicked, a renewal failed after `Run`,
        // its answer is not recorded), so none renews a lease this call has
        // ended; otherwise they are let go (a renewal landing after the
        // answer is recorded, or beside the body's, changes nothing), and
        // the hook's answer is not held back by one stuck on its way.
        // Rule 9 as for a body: a lease that lapsed while the hook ran (its
        // thread blocked) is noted, the clock read only for a hook.
        hook_watch.note_if_lapsed(spec, identity, Instant::now(), None);
        let answered = match answer {
            Err(panic) => {
                guard.end_lease_for_takeover(Some(in_flight)).await;
                std::panic::resume_unwind(panic);
            }
            Ok(answer) => hook_answer(answer),
        };
        match answered {
            None => {
                // Rules 3 and 20: the body runs only while this call still
                // owns the record. A hook that outlived its lease (its thread
                // blocked, its process stopped) may have lost the record to
                // another caller's takeover, which ran the body already: a
                // fenced renewal says so before the body starts.
                let renewing = Instant::now();
                // The hook's renewals are let land meanwhile (polled beside
                // it: one waiting for a pool connection must not keep it
                // from this renewal), for the end of the lease below.
                let mut landing = pin!(in_flight.landed(spec, identity));
                let mut landed = false;
                let mut beat = pin!(store.heartbeat(identity, token, spec.lease));
                let renewed = std::future::poll_fn(|cx| {
                    if !landed && landing.as_mut().poll(cx).is_ready() {
                        landed = true;
                    }
                    beat.as_mut().poll(cx)
                })
                .await;
                match renewed {
                    Ok(Fenced::Written) => lease_set = renewing,
                    Ok(Fenced::NotOwner) => {
                        tracing::error!(target: "idempotent", scope = spec.scope, key = %digest,
                            attempt = acquired.attempt,
                            "the recover hook answered Run after this call had lost the record \
                             to another caller: the body does not run");
                        guard.arm(false);
                        // The body did not run: not the `lease_lost` outcome
                        // (a body that ran, its answer not recorded).
                        return Err((
                            Err(Error::LeaseLost(identity.context()).into()),
                            CallOutcome::Failed,
                        ));
                    }
                    // Ownership unknown: the body does not run blind. The
                    // record stays in progress, its lease ended if the store
                    // lets us, and the next call asks the hook again.
                    Err(e) => {
                        if !landed {
                            landing.as_mut().await;
                        }
                        end_lease_logged(store, identity, token).await;
                        guard.arm(false);
                        return fail(Error::Store(e));
                    }
                }
                tracing::info!(target: "idempotent", scope = spec.scope, key = %digest,
                    attempt = acquired.attempt, "the recover hook answered Run: running the body");
            }
            Some(result) => {
                // The hook answered. Recording it disarms the guard first;
                // an answer that is not recorded (a hook `Err` released, a
                // value that cannot be recorded) keeps the record for the
                // next takeover, so the guard stays kept for one: a call
                // dropped while settle ends the lease still ends it, never
                // releases the record for a retry to run the body blind.
                count_answer(AnsweredBy::RecoverHook);
                // Encoded first (no await since the hook ended): a panic of
                // the answer's own `Serialize` ends the lease once the
                // hook's renewals have landed, as a hook's panic does.
                let encoded = match std::panic::catch_unwind(AssertUnwindSafe(|| {
                    outcome_to_record::<R, H>(spec, &result, errors)
                })) {
                    Ok(encoded) => encoded,
                    Err(panic) => {
                        guard.end_lease_for_takeover(Some(in_flight)).await;
                        std::panic::resume_unwind(panic);
                    }
                };
                // The renewals land before the sink ends the lease (an
                // answer not recorded), and are let go before it records
                // the answer.
                let mut sink = StoreSink {
                    store,
                    guard: &mut *guard,
                    in_flight: Some(in_flight),
                };
                return Err(settle_encoded::<R>(
                    spec,
                    identity,
                    &mut sink,
                    result,
                    encoded,
                    AnsweredBy::RecoverHook,
                )
                .await);
            }
        }
    }

    // The body starts as the reservation ends, unless a takeover was handled
    // in between (one clock read less per call).
    let running = if acquired.took_over {
        Instant::now()
    } else {
        reserved_at
    };
    Ok((running, lease_set))
}

/// The call's steps after its body: the answer released or recorded (rules
/// 12 and 13), a panic propagated once the record is finished (rule 14).
async fn after_body<'c, R, H>(
    (spec, store, identity, _): CallParts<'c>,
    guard: &mut FinishOnDrop<'c>,
    errors: &H,
    (ran, mut lease_watch, running, in_flight): (
        Result<R, PanicPayload>,
        LeaseWatch,
        Instant,
        RenewalsInFlight<'c>,
    ),
) -> Answered<R>
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
{
    let result = match ran {
        Ok(r) => r.into_result(),
        Err(panic) => {
            crate::metrics::body_time(spec.scope, "panic", running.elapsed());
            if guard.keep_for_takeover {
                // As for a dropped call (`FinishOnDrop`): the hook is asked
                // next. A renewal still on its way would renew the ended
                // lease: it lands first.
                guard.end_lease_for_takeover(Some(in_flight)).await;
            } else {
                drop(in_flight);
                release(store, guard).await;
            }
            std::panic::resume_unwind(panic);
        }
    };
    // The body answered: from here on the record is released or recorded
    // as the answer says (rule 13), also if this call is dropped meanwhile.
    // Until then (the result's own `Serialize`/`Deserialize` and the error
    // policy run first, and may panic), a scope with a recover hook still
    // ends the lease of a call that ends without an answer: the side effect
    // happened, and the next call asks the hook (`StoreSink::release` and
    // `record` take the guard from there).
    let ended = Instant::now();
    crate::metrics::body_time(
        spec.scope,
        if result.is_ok() { "ok" } else { "err" },
        ended.saturating_duration_since(running),
    );
    lease_watch.note_if_lapsed(spec, identity, ended, None);
    count_answer(AnsweredBy::Body);
    // The answer is encoded before anything is written (no await since the
    // body ended): its own `Serialize`, or the error policy, may panic, and
    // in a scope with a recover hook that ends the lease as for a body that
    // panics, once the body's renewals still on their way have landed (one
    // landing after the end would renew the ended lease).
    let encoded = match std::panic::catch_unwind(AssertUnwindSafe(|| {
        outcome_to_record::<R, H>(spec, &result, errors)
    })) {
        Ok(encoded) => encoded,
        Err(panic) => {
            if guard.keep_for_takeover {
                guard.end_lease_for_takeover(Some(in_flight)).await;
            }
            // Otherwise the guard, still armed, releases the record.
            std::panic::resume_unwind(panic);
        }
    };
    // Not waited for: a renewal landing after the answer is recorded or the
    // key released changes nothing. Dropped now, so one still waiting for a
    // pool connection does not keep it from the completion.
    drop(in_flight);
    let mut sink = StoreSink {
        store,
        guard: &mut *guard,
        in_flight: None,
    };
    settle_encoded::<R>(spec, identity, &mut sink, result, encoded, AnsweredBy::Body).await
}

/// Counts an answer of a call that holds its record (the body's, or a
/// recover hook's) and reports it to [`with_outcome`].
pub(crate) fn count_answer(by: AnsweredBy) {
    let (counter, outcome) = match by {
        AnsweredBy::Body => (&METRICS.executed, Outcome::Executed),
        AnsweredBy::RecoverHook => (&METRICS.recovered, Outcome::Recovered),
    };
    counter.fetch_add(1, Ordering::Relaxed);
    report(outcome);
}

/// What the outcome label says for an answer [`settle`] records.
fn call_outcome(by: AnsweredBy) -> CallOutcome {
    match by {
        AnsweredBy::Body => CallOutcome::Executed,
        AnsweredBy::RecoverHook => CallOutcome::Recovered,
    }
}

/// Where a held reservation's record is written: the store, under the
/// call's drop guard (store mode), or the caller's transaction
/// (transactional mode). Every write is fenced by the call's owner token.
pub(crate) trait RecordSink: Send {
    /// Frees the key: the answer is not recorded and a retry runs again.
    /// An error is what the caller gets instead of the answer.
    fn release(&mut self) -> BoxFuture<'_, Result<(), Error>>;

    /// Leaves the record in progress for the next call to take over (a
    /// recover hook's answer that is not recorded: rule 20).
    fn keep_for_takeover(&mut self) -> BoxFuture<'_, ()>;

    /// Records the answer. `Ok(Fenced::NotOwner)`: another owner holds the record now.
    fn record(&mut self, answer: Answer)
        -> BoxFuture<'_, Result<Fenced, crate::error::StoreError>>;

    /// The largest answer [`record`](Self::record) can write (serialized
    /// bytes), when the sink knows it without asking anyone (a store's).
    fn known_limit(&self) -> Option<usize>;

    /// The store's name, for logs.
    fn store_name(&self) -> &'static str;

    /// The largest answer [`record`](Self::record) can write, asked of the
    /// database (a MySQL transaction's session); only when there is no
    /// [`known_limit`](Self::known_limit), and only for answers larger than
    /// [`ASK_FOR_LIMIT_ABOVE`].
    fn ask_limit(&mut self) -> BoxFuture<'_, Result<usize, crate::error::StoreError>> {
        let limit = self.known_limit().unwrap_or(MAX_RESULT_BYTES);
        Box::pin(async move { Ok(limit) })
    }
}

/// Answers up to this size are recorded in transactional mode without asking
/// the connection for its limit (a statement of its own): a MySQL server
/// takes at least this much unless its `max_allowed_packet` is set below
/// 128 KiB.
const ASK_FOR_LIMIT_ABOVE: usize = 64 * 1024;

/// `None` when the store can record `stored`; otherwise why not: the store's
/// limit could not be read, or the answer is larger than it.
async fn store_cannot_take(
    spec: &'static ScopeInfo,
    sink: &mut dyn RecordSink,
    stored: &StoredOutcome,
) -> Option<Error> {
    let size = stored.payload.len();
    let limit = match sink.known_limit() {
        Some(limit) => Ok(limit),
        None if size <= ASK_FOR_LIMIT_ABOVE => return None,
        None => sink.ask_limit().await,
    };
    match limit {
        Err(e) => Some(Error::Store(e)),
        Ok(limit) if size > limit => Some(Error::ResultTooLarge {
            scope: spec.scope.to_owned(),
            size,
            limit,
        }),
        Ok(_) => None,
    }
}

/// Store mode's [`RecordSink`]: writes through the store, and keeps the
/// call's [`FinishOnDrop`] guard in step, so a call dropped mid-write is
/// finished by the store (rule 14).
struct StoreSink<'g, 'a> {
    store: &'a dyn Store,
    guard: &'g mut FinishOnDrop<'a>,
    /// A recover hook's renewals still on their way: let land before the
    /// sink ends the lease ([`keep_for_takeover`](RecordSink::keep_for_takeover)),
    /// let go before it records or releases (a renewal landing after that
    /// changes nothing; kept unpolled, one waiting for a pool connection
    /// would keep it from the write).
    in_flight: Option<RenewalsInFlight<'a>>,
}

impl RecordSink for StoreSink<'_, '_> {
    fn known_limit(&self) -> Option<usize> {
        Some(self.store.max_result_bytes())
    }

    fn store_name(&self) -> &'static str {
        self.store.name()
    }

    fn release(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            // The answer says to free the key: a call dropped meanwhile
            // releases it too, hook or not (rule 13).
            self.guard.keep_for_takeover = false;
            drop(self.in_flight.take());
            release(self.store, self.guard).await;
            Ok(())
        })
    }

    fn keep_for_takeover(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // Dropped while the lease is being ended, the call ends it
            // through the store's worker: never released (review).
            self.guard.keep_for_takeover = true;
            self.guard
                .end_lease_for_takeover(self.in_flight.take())
                .await;
        })
    }

    fn record(
        &mut self,
        answer: Answer,
    ) -> BoxFuture<'_, Result<Fenced, crate::error::StoreError>> {
        Box::pin(async move {
            let (store, identity, token) = (self.store, self.guard.identity, self.guard.token);
            drop(self.in_flight.take());
            // The answer is recordable: from here on a dropped call records
            // it rather than freeing the key for a re-run.
            self.guard.arm(false);
            // Until it is recorded, a takeover in this process answers with
            // it (see `unrecorded`).
            let noted = !store.records_in_process_memory();
            if noted {
                let request = crate::unrecorded::Request::new(
                    (store.name(), store.database_id()),
                    self.guard.fingerprint,
                );
                crate::unrecorded::note_for(
                    identity,
                    token,
                    &request,
                    &answer,
                    self.guard.spec.lease,
                );
            }
            let answer = self.guard.completing.insert(answer);
            let mut written = store.complete(answer.completing(identity, token)).await;
            // Failed: the store's worker goes on trying it, and answers for
            // the note when it is done.
            if let (true, Ok(fenced)) = (noted, &written)
                && crate::unrecorded::write_answered(identity, token, *fenced)
                && *fenced == Fenced::NotOwner
            {
                // Its record was taken over by a call of this process,
                // which recorded this very answer (`unrecorded`).
                tracing::info!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                    "this answer was recorded by the call that took its record over");
                written = Ok(Fenced::Written);
            }
            let unrecorded = self.guard.completing.take();
            if let (Err(e), Some(answer)) = (&written, unrecorded) {
                // The answer is final: keep trying to record it in the
                // background (fenced by the token), so a retry replays it
                // instead of running the body again once the lease runs out.
                tracing::error!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(), error = %e,
                    "the answer could not be recorded yet; the store keeps trying");
                store.complete_detached(answer.completing(identity, token));
            }
            written
        })
    }
}

/// Records (or releases) the answer of a call that holds its record — the
/// body's result, or a recover hook's — through `sink`. Shared by store mode
/// and transactional mode.
///
/// A hook's answer that is not recorded (an error the policy releases, or a
/// value that cannot be recorded) does not free the key: the record stays in
/// progress, so the next call takes it over and asks the hook again instead
/// of running the body blind (rule 20).
pub(crate) async fn settle<R, H>(
    spec: &'static ScopeInfo,
    identity: &Identity,
    sink: &mut dyn RecordSink,
    errors: &H,
    result: Result<R::Value, R::Failure>,
    by: AnsweredBy,
) -> Answered<R>
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
{
    let encoded = outcome_to_record::<R, H>(spec, &result, errors);
    settle_encoded::<R>(spec, identity, sink, result, encoded, by).await
}

/// [`settle`] once the answer was encoded for the record
/// ([`outcome_to_record`]).
async fn settle_encoded<R>(
    spec: &'static ScopeInfo,
    identity: &Identity,
    sink: &mut dyn RecordSink,
    result: Result<R::Value, R::Failure>,
    encoded: Result<Option<StoredOutcome>, Error>,
    by: AnsweredBy,
) -> Answered<R>
where
    R: IdempotentReturn,
{
    let digest = identity.log_digest();
    let unrecorded = match encoded {
        Ok(Some(stored)) => match store_cannot_take(spec, sink, &stored).await {
            Some(e) => Some(e),
            None => {
                let recorded_error = stored.is_error;
                let ttl = spec.ttl;
                let written = sink
                    .record(Answer {
                        outcome: stored,
                        ttl,
                        by,
                    })
                    .await;
                if matches!(written, Ok(Fenced::Written)) {
                    match by {
                        AnsweredBy::Body => {
                            tracing::info!(target: "idempotent", scope = spec.scope, key = %digest, recorded_error, "executed")
                        }
                        AnsweredBy::RecoverHook => {
                            tracing::info!(target: "idempotent", scope = spec.scope, key = %digest, recorded_error,
                                "recovered: the recover hook's answer was recorded; the body did not run")
                        }
                    }
                }
                return after_completion::<R>(written, identity, result, call_outcome(by));
            }
        },
        Ok(None) => None,
        Err(e) => Some(e),
    };
    match by {
        AnsweredBy::Body => {
            // Not a limit the store failed to tell (a store error).
            let never = unrecorded
                .as_ref()
                .is_some_and(Error::answer_can_never_be_recorded);
            if never && result.is_ok() {
                report_unrecordable_result();
            }
            if let Err(e) = sink.release().await {
                return (Err(e.into()), CallOutcome::Failed);
            }
            if unrecorded.is_none() {
                tracing::info!(target: "idempotent", scope = spec.scope, key = %digest, "executed; error released");
            }
        }
        AnsweredBy::RecoverHook => {
            sink.keep_for_takeover().await;
            tracing::warn!(target: "idempotent", scope = spec.scope, key = %digest,
                "the recover hook's answer is not recorded; the record stays in progress \
                 so the next call asks the hook again");
        }
    }
    match unrecorded {
        None => (result, call_outcome(by)),
        Some(e) => (Err(e.into()), CallOutcome::Failed),
    }
}

/// What the reservation histogram's `outcome` label says.
pub(crate) fn reserve_label(reserved: &Result<Reserved, Error>) -> &'static str {
    match reserved {
        Ok(Reserved::Acquired(a)) if a.took_over => "took_over",
        Ok(Reserved::Acquired(_)) => "acquired",
        Ok(Reserved::Replay(_)) => "replayed",
        Err(Error::InProgress { .. }) => "in_progress",
        Err(Error::FingerprintMismatch(_)) => "mismatch",
        Err(_) => "error",
    }
}

/// A reservation the call now owns.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Acquired {
    pub took_over: bool,
    pub attempt: u32,
    pub previous_started_ms: Option<i64>,
    /// No later than when the statement that acquired was sent: the lease
    /// it set runs out no earlier than a lease after this.
    pub sent: Instant,
}

impl Acquired {
    /// Whether the reservation's answer came so late that the lease it set
    /// may run out before the body's first renewal lands (due a heartbeat
    /// period, `lease / 3`, after the reservation was sent), or has run out
    /// already: the
    /// process was stopped (a GC pause, a frozen VM) or starved while the
    /// statement was decided, and another caller may have taken the record
    /// over meanwhile, and even recorded its answer.
    fn answered_late(&self, lease: Duration, answered: Instant) -> bool {
        let period = lease / 3;
        answered.saturating_duration_since(self.sent) >= lease.saturating_sub(period)
    }

    /// On a takeover (rule 20): logs and counts it, and returns what the
    /// `recover` hook is asked with. `None` for a fresh record.
    /// `answer_known`: this process holds the answer of the attempt taken
    /// over (`unrecorded`), so neither the hook nor the body is asked.
    pub(crate) fn takeover(
        &self,
        spec: &'static ScopeInfo,
        identity: &Identity,
        answer_known: bool,
    ) -> Option<Takeover> {
        if !self.took_over {
            return None;
        }
        note_takeover(
            spec,
            identity,
            self.attempt,
            self.previous_started_ms,
            answer_known,
        );
        Some(Takeover::from_store(
            identity.clone(),
            self.attempt,
            self.previous_started_ms.unwrap_or(0),
        ))
    }
}

/// A recover hook's answer: `None` to run the body, `Some(result)` to record
/// and return instead of running it.
pub(crate) fn hook_answer<T, E>(answer: Result<Recovery<T>, E>) -> Option<Result<T, E>> {
    match answer {
        Ok(Recovery::Run) => None,
        Ok(Recovery::Completed(v)) => Some(Ok(v)),
        Err(e) => Some(Err(e)),
    }
}

/// Answers a reservation that found the record complete: counts and logs the
/// replay and decodes the recorded result (a recorded error replayed is a
/// replay too). Shared by store mode and transactional mode.
pub(crate) fn replay<R: IdempotentReturn, H: ErrorHandling<R::Failure>>(
    spec: &'static ScopeInfo,
    errors: &H,
    identity: &Identity,
    store: &'static str,
    outcome: StoredOutcome,
) -> Answered<R> {
    tracing::info!(target: "idempotent", scope = spec.scope, key = %identity.log_digest(), store, "replayed");
    report_whole(Reported {
        outcome: Some(Outcome::Replayed),
        replayed_error: outcome.is_error,
        unrecordable_result: false,
        last_mismatch: None,
    });
    // A recorded answer that no longer decodes is not "a recorded result"
    // for the metric (`with_outcome` still says Replayed: the consumer's
    // verdict needs to know it was processed before).
    match decoded_replay::<R, H>(spec, errors, outcome) {
        Ok(recorded) => {
            METRICS.replayed.fetch_add(1, Ordering::Relaxed);
            (recorded, CallOutcome::Replayed)
        }
        Err(e) => (Err(e.into()), CallOutcome::Failed),
    }
}

/// A call that took a record over, for which this process still holds an
/// answer the same request produced and could not record (see
/// [`crate::unrecorded`]): records that answer under this call's token,
/// through `sink`, and replays it. The body does not run again, and the
/// `recover` hook is not asked: the answer is known. Shared by store mode and
/// transactional mode.
pub(crate) async fn record_unrecorded_answer<R, H>(
    spec: &'static ScopeInfo,
    (errors, identity, request): (&H, &Identity, &crate::unrecorded::Request),
    sink: &mut dyn RecordSink,
    (noted_by, answer): (OwnerToken, Answer),
    committed_when_written: bool,
) -> Answered<R>
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
{
    // As for any answer (the sink may take less than the store that first
    // tried to write it: a MySQL transaction's session, a store opened
    // before the server's limit changed). The record is kept for the next
    // takeover, and so is the answer, as for a recover hook's answer that
    // cannot be recorded: released, the next call would make a new record
    // and run the body again (unrecorded-answers hunt). The answer is kept
    // before the lease is ended: once it has ended, any call of this process
    // may take the record over and look (review).
    if let Some(e) = store_cannot_take(spec, sink, &answer.outcome).await {
        crate::unrecorded::kept_for_the_next_takeover(
            identity,
            &noted_by,
            (request, &answer),
            spec.lease,
        );
        sink.keep_for_takeover().await;
        return (Err(e.into()), CallOutcome::Failed);
    }
    let outcome = answer.outcome.clone();
    match sink.record(answer).await {
        Ok(Fenced::Written) => {
            // The call still writing it under its own token is told, when
            // its write finds the record taken over, that its answer was
            // recorded; only once that is so for good (not in a caller's
            // transaction, which may yet roll back). A store-mode write is
            // its own committed statement, unless application code left a
            // pooled connection inside a transaction the store cannot see
            // (PostgreSQL, MySQL 8: README, sharing a pool), which loses
            // the write itself too.
            if committed_when_written {
                crate::unrecorded::recorded_by_takeover(identity, &noted_by);
            }
            replay::<R, H>(spec, errors, identity, sink.store_name(), outcome)
        }
        Ok(Fenced::NotOwner) => {
            tracing::error!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                "lease lost: another caller took the record over meanwhile");
            (
                Err(Error::LeaseLost(identity.context()).into()),
                CallOutcome::Failed,
            )
        }
        Err(e) => (Err(Error::Store(e).into()), CallOutcome::Failed),
    }
}

/// The caller's answer once a fenced write of `result` (completion) was
/// tried: `result` itself when it was written, `LeaseLost` when another
/// owner holds the record now, the store's error otherwise.
pub(crate) fn after_completion<R: IdempotentReturn>(
    written: Result<Fenced, crate::error::StoreError>,
    identity: &Identity,
    result: Result<R::Value, R::Failure>,
    done: CallOutcome,
) -> Answered<R> {
    match written {
        Ok(Fenced::Written) => (result, done),
        Ok(Fenced::NotOwner) => {
            tracing::error!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                "lease lost: another caller took the record over meanwhile; this answer was not recorded");
            // `lease_lost` is a body that ran; a recover hook's answer that
            // lost the record is a failed call (the body did not run).
            let outcome = if done == CallOutcome::Recovered {
                CallOutcome::Failed
            } else {
                METRICS.lease_lost.fetch_add(1, Ordering::Relaxed);
                CallOutcome::LeaseLost
            };
            (Err(Error::LeaseLost(identity.context()).into()), outcome)
        }
        Err(e) => (Err(Error::Store(e).into()), CallOutcome::Failed),
    }
}

pub(crate) enum Reserved {
    Acquired(Acquired),
    Replay(StoredOutcome),
}

/// The least a reservation in a caller's transaction waits for a row (on
/// SQLite, the database's write lock) that another transaction holds, also
/// with `in_progress = reject` and at the end of a `wait(...)` bound. Such a
/// lock is as often a short write as a call in progress: a purge deleting the
/// expired record, another reservation replacing it, on SQLite any writer.
/// Waiting none answered those with a made-up `InProgress`, refusing a call
/// for a key nobody held. A transactional-mode owner holds its row for its
/// whole call, so a duplicate of one is refused this much later.
/// MySQL/MariaDB wait in whole seconds: 1 s there.
pub(crate) const LEAST_LOCK_WAIT: Duration = Duration::from_millis(500);

/// Something that can answer a reservation: a store, or the caller's transaction.
/// (Boxed `Send` futures: an `async fn` here defeats the `Send` proof of the call's future.)
pub(crate) trait Reserver: Send {
    fn reserve_once<'a>(
        &'a mut self,
        request: ReserveRequest<'a>,
        lock_wait: Duration,
    ) -> futures_util::future::BoxFuture<'a, Result<Reservation, Error>>;

    /// The store itself, when this is one: [`reserve`] then awaits its
    /// reservation directly rather than through a second boxed future.
    fn as_store(&self) -> Option<&dyn Store> {
        None
    }

    /// Frees a record this reservation just acquired (fenced by `token`).
    fn release_acquired<'a>(
        &'a mut self,
        identity: &'a Identity,
        token: &'a OwnerToken,
    ) -> futures_util::future::BoxFuture<'a, Result<Fenced, Error>>;

    /// Whether a record found in progress may be waited for and asked about
    /// again (see [`TransactionalConnection::may_wait_in_transaction`]); when
    /// not, a duplicate that would wait is refused at once. A store: always.
    ///
    /// [`TransactionalConnection::may_wait_in_transaction`]: crate::TransactionalConnection::may_wait_in_transaction
    fn may_wait<'a>(&'a mut self) -> futures_util::future::BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async { Ok(true) })
    }
}

impl Reserver for &dyn Store {
    fn reserve_once<'a>(
        &'a mut self,
        request: ReserveRequest<'a>,
        _lock_wait: Duration,
    ) -> futures_util::future::BoxFuture<'a, Result<Reservation, Error>> {
        Box::pin(async move { Ok(self.reserve(request).await?) })
    }

    fn as_store(&self) -> Option<&dyn Store> {
        Some(*self)
    }

    fn release_acquired<'a>(
        &'a mut self,
        identity: &'a Identity,
        token: &'a OwnerToken,
    ) -> futures_util::future::BoxFuture<'a, Result<Fenced, Error>> {
        Box::pin(async move { Ok(self.release(identity, token).await?) })
    }
}

/// Waits until the record found in progress may have changed, at most
/// `max_wait`: a store may be told ([`Store::wait_for_change`]); nothing
/// tells a caller's transaction (no `store`), which asks again after a
/// backoff.
async fn wait_for_change(
    store: Option<&dyn Store>,
    identity: &Identity,
    max_wait: Duration,
    round: u32,
) {
    match store {
        Some(store) => store.wait_for_change(identity, max_wait, round).await,
        None => tokio::time::sleep(crate::store::polling_backoff(round).min(max_wait)).await,
    }
}

/// Reserves, waiting (bounded) while another owner runs, per the in-progress policy.
/// `in_flight`, when given, is set while a reservation statement is under way
/// and stays set when it acquired (the call's release-on-drop guard).
/// The reservation a call of `spec` asks for, in store mode and in
/// transactional mode. The in-progress record is kept for the scope's ttl
/// *after its lease* (and, with the heartbeat keeping that distance, after
/// every renewed lease): the record of an owner that died stays to be taken
/// over (rule 20) for ttl after its lease ran out, however the two compare.
/// Counted from the reservation, a ttl shorter than the lease would run out
/// first, and the dead owner's record would count as absent (rule 16) when its
/// lease did: a blind re-run instead of a takeover.
pub(crate) fn reserve_request<'a>(
    spec: &ScopeInfo,
    identity: &'a Identity,
    fingerprint: Option<&'a Fingerprint>,
    token: &'a OwnerToken,
) -> ReserveRequest<'a> {
    ReserveRequest {
        identity,
        fingerprint,
        token,
        lease: spec.lease,
        ttl: spec.lease.saturating_add(spec.ttl),
    }
}

pub(crate) async fn reserve(
    store: impl Reserver,
    request: ReserveRequest<'_>,
    spec: &'static ScopeInfo,
    in_flight: Option<InFlight<'_>>,
) -> Result<Reserved, Error> {
    reserve_from(store, request, spec, in_flight, Instant::now()).await
}

/// A store-mode call's account of its reservation statements: set while one
/// is under way and kept set when it acquired (the call's release-on-drop
/// guard), and the answers of its request this process holds unrecorded,
/// pinned again before each statement.
pub(crate) type InFlight<'a> = (&'a AtomicBool, &'a crate::unrecorded::Pins<'a>);

/// [`reserve`], started at `started` (the caller's clock reading: the wait
/// bound runs from there).
async fn reserve_from(
    mut store: impl Reserver,
    request: ReserveRequest<'_>,
    spec: &'static ScopeInfo,
    in_flight: Option<InFlight<'_>>,
    started: Instant,
) -> Result<Reserved, Error> {
    let flight = |on: bool| {
        if let Some((flag, pins)) = in_flight {
            if on {
                // Answers noted while this call waited count too (review).
                pins.refresh();
            }
            flag.store(on, Ordering::Relaxed);
        }
    };
    // Rule 6: a record made with an older canonical form is compared by that
    // form's rules. The legacy fingerprint exists only for arguments whose
    // current form differs from the old one; it is tried once, on a mismatch.
    // A record this call creates always carries the current form
    // (`current`). The legacy form is what the build before made for the
    // same call, so it meets records that build stored, and also records of
    // calls that build could not tell apart from this one (a trait's default
    // method of a plain implementor, which counts no `<Self>`, and one of a
    // generic implementor, whose legacy form leaves `<Self>` out): sharing
    // records as that build did.
    let current = request.fingerprint;
    let legacy = current.and_then(Fingerprint::legacy);
    // Mismatches answered since the last wait (see the mismatch arm).
    let mut mismatches: u32 = 0;
    // Mismatches whose record was gone (or changed) when it was read: the
    // reservation is made again, a bounded number of times.
    let mut rereads: u32 = 0;
    let mut request = request;
    let deadline = match spec.in_progress {
        // A bound too long for the clock (`Duration::MAX`) is a century.
        InProgressPolicy::Wait(d) => started
            .checked_add(d)
            .or_else(|| started.checked_add(Duration::from_secs(100 * 365 * 24 * 3600))),
        InProgressPolicy::Reject => None,
    };
    let mut waits: u32 = 0;
    // Whether an in-progress record may be waited for: asked once, when it is.
    let mut may_wait: Option<bool> = None;
    // The clock when this round's reservation starts: read again only after
    // something took time (a wait, a statement that was answered).
    let mut now = started;
    loop {
        let lock_wait = deadline
            .map_or(Duration::ZERO, |d| d.saturating_duration_since(now))
            .max(LEAST_LOCK_WAIT);
        flight(true);
        let answer = match store.as_store() {
            Some(direct) => direct.reserve(request).await.map_err(Error::from),
            None => store.reserve_once(request, lock_wait).await,
        };
        // Acquired: the call owns the record. Failed: the statement may still
        // have landed (a connection cut after the server committed), so the
        // guard releases whatever this token may own when the call returns.
        flight(match &answer {
            Ok(reservation) => matches!(reservation, Reservation::Acquired { .. }),
            Err(e) => statement_may_have_landed(e),
        });
        match answer? {
            Reservation::Acquired {
                took_over: false, ..
            } if legacy.is_some() && request.fingerprint == legacy.as_ref() => {
                // The old record went away between the two statements: this
                // call created a new one with the legacy fingerprint, which a
                // retry with the same arguments in another order (a set)
                // would not match. Free it and reserve again with the current
                // form. (A takeover of the old record keeps it: that record
                // is the old version's, and rule 20 needs its history.)
                // Whoever owns it now (if not this call) is left alone: fenced.
                let _ = store
                    .release_acquired(request.identity, request.token)
                    .await?;
                flight(false);
                request.fingerprint = current;
                now = Instant::now();
            }
            Reservation::Acquired {
                took_over,
                attempt,
                previous_attempt_started_at_ms,
            } => {
                return Ok(Reserved::Acquired(Acquired {
                    took_over,
                    attempt,
                    previous_started_ms: previous_attempt_started_at_ms,
                    sent: now,
                }))
            }
            Reservation::Completed(outcome) => return Ok(Reserved::Replay(outcome)),
            // A mismatch with one form, when the other exists, tries the other:
            // the record may be an old one (legacy form), or, after the legacy
            // form was refused, one made meanwhile by a current-version call
            // with these same arguments (current form). Three refusals in a
            // row between two waits are final.
            Reservation::FingerprintMismatch if legacy.is_some() && mismatches < 2 => {
                mismatches += 1;
                request.fingerprint = if request.fingerprint == current {
                    legacy.as_ref()
                } else {
                    current
                };
                now = Instant::now();
            }
            Reservation::FingerprintMismatch => {
                let fingerprints = [current, legacy.as_ref()];
                match mismatched_record(&store, request.identity, &fingerprints, spec.lease).await {
                    MismatchedRecord::Changed if rereads < 2 => {
                        // Try every form again: the record may now carry
                        // the legacy one (an older version's call).
                        rereads += 1;
                        mismatches = 0;
                        now = Instant::now();
                        continue;
                    }
                    MismatchedRecord::ByNewerVersion(version, by) => {
                        // What the record is, for a message consumer: one
                        // still running may yet be released by the newer
                        // version, so the delivery is nak'd, not terminated.
                        report_mismatch(by);
                        tracing::warn!(target: "idempotent", scope = spec.scope, key = %request.identity.log_digest(),
                            version = %version, "refused for now: a newer version of idempotent made this key's record, and this version cannot compare its fingerprint");
                        return Err(Error::RecordedByNewerVersion {
                            context: request.identity.context(),
                            version,
                        });
                    }
                    MismatchedRecord::Refused(by) => report_mismatch(by),
                    // Refused by records of other arguments that keep coming
                    // and going: not poison, look again shortly.
                    MismatchedRecord::Changed => report_mismatch(LastMismatch::Running {
                        lease_remaining: Duration::from_secs(1),
                    }),
                }
                METRICS.mismatched.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(target: "idempotent", scope = spec.scope, key = %request.identity.log_digest(),
                    "refused: key reused with different arguments");
                return Err(Error::FingerprintMismatch(request.identity.context()));
            }
            Reservation::InProgress { lease_remaining } => {
                now = Instant::now();
                if deadline.is_some_and(|d| now < d) && may_wait.is_none() {
                    may_wait = Some(store.may_wait().await?);
                }
                match deadline {
                    Some(deadline) if now < deadline && may_wait == Some(true) => {
                        // Until the record changes (the store may be told),
                        // the lease runs out (its owner may be gone), or the
                        // wait bound is reached, whichever comes first.
                        let max_wait = (deadline - now)
                            .min(lease_remaining)
                            .max(Duration::from_millis(1));
                        wait_for_change(store.as_store(), request.identity, max_wait, waits).await;
                        waits = waits.saturating_add(1);
                        mismatches = 0;
                        now = Instant::now();
                    }
                    _ => {
                        METRICS.refused_in_progress.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(target: "idempotent", scope = spec.scope, key = %request.identity.log_digest(),
                            "refused: a call with the same key is in progress");
                        return Err(Error::InProgress {
                            scope: spec.scope.to_owned(),
                            retry_after: lease_remaining.max(Duration::from_millis(1)),
                        });
                    }
                }
            }
        }
    }
}

/// What a record that refused a reservation as a mismatch is, as far as
/// that changes the answer.
enum MismatchedRecord {
    /// Gone, expired, or now holding this call's own fingerprint when read:
    /// its owner released it (or it ran out) after the refusal, so the
    /// reservation is made again rather than refused.
    Changed,
    /// A newer build made its fingerprint with a form this one does not know
    /// (see [`unknown_version`](crate::fingerprint::unknown_version)): the
    /// version label, and what the record is (running, abandoned, complete):
    /// a consumer does not terminate a message whose record the newer
    /// version may yet release or take over.
    ByNewerVersion(String, LastMismatch),
    /// A record of other arguments: the mismatch stands, and this is what
    /// refused it, as reported (running, with at most the call's own lease
    /// left, since a store's clock reading is trusted only that far;
    /// abandoned; or complete or not known).
    Refused(LastMismatch),
}

/// Reads the record that refused a reservation as a mismatch (made with one
/// of `fingerprints`): one read, made only then, of what a replay would read.
/// Through a store only: in transactional mode the mismatch stands as it is;
/// when the read fails it stands, as [`LastMismatch::Unread`].
async fn mismatched_record(
    store: &impl Reserver,
    identity: &Identity,
    fingerprints: &[Option<&Fingerprint>],
    lease: Duration,
) -> MismatchedRecord {
    let Some(direct) = store.as_store() else {
        return MismatchedRecord::Refused(LastMismatch::Final);
    };
    let snapshot = match direct.fetch(identity).await {
        Ok(Some(snapshot)) => snapshot,
        Ok(None) => return MismatchedRecord::Changed,
        // The mismatch stands, but what refused it is unknown: a record
        // still running may yet be released (a store failure is never final).
        Err(e) => {
            tracing::warn!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                error = %e, "the record of a fingerprint mismatch could not be read (running or \
                 finished?); a consumer naks the delivery");
            return MismatchedRecord::Refused(LastMismatch::Unread);
        }
    };
    let stored = snapshot.fingerprint.as_deref();
    let ours = fingerprints
        .iter()
        .flatten()
        .any(|f| stored == Some(f.as_str()));
    if snapshot.is_expired() || ours || stored.is_none() {
        return MismatchedRecord::Changed;
    }
    let refused_by = match (snapshot.state, snapshot.lease_expires_at_ms) {
        (crate::store::RecordState::InProgress, Some(lease_ends))
            if lease_ends > snapshot.now_ms =>
        {
            LastMismatch::Running {
                lease_remaining: crate::store::millis_to_duration(lease_ends - snapshot.now_ms)
                    .min(lease),
            }
        }
        (crate::store::RecordState::InProgress, lease_ends) => LastMismatch::Abandoned {
            // No lease end at all (a store that keeps none): as abandoned
            // long ago.
            abandoned_for: lease_ends.map_or(crate::consumer::ABANDONED_RECORD_GRACE, |ends| {
                crate::store::millis_to_duration(snapshot.now_ms.saturating_sub(ends))
            }),
        },
        _ => LastMismatch::Final,
    };
    if let Some(version) = stored.and_then(crate::fingerprint::unknown_version) {
        return MismatchedRecord::ByNewerVersion(version.to_owned(), refused_by);
    }
    MismatchedRecord::Refused(refused_by)
}

/// Whether a failed reservation may still have written the record: not when
/// it never reached the database (no connection could be had from the pool),
/// so an outage does not turn every refused call into background releases.
fn statement_may_have_landed(e: &Error) -> bool {
    let Error::Store(store) = e else {
        return false;
    };
    !never_reached_the_database(store)
}

/// A SQL store's error from before any statement was sent: no connection
/// could be had from the pool, or the pool was misconfigured or closed.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn never_reached_the_database(store: &crate::error::StoreError) -> bool {
    matches!(
        store.source.downcast_ref::<sqlx::Error>(),
        Some(sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Configuration(_))
    )
}

/// Without a SQL store, every store error may have landed.
#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
fn never_reached_the_database(_: &crate::error::StoreError) -> bool {
    false
}

/// What a finished body's result becomes: `Ok(Some(outcome))` to record,
/// `Ok(None)` to release the key (an error the policy does not record), or an
/// error when it cannot be recorded faithfully (the key is then released and
/// the caller gets the error). Shared by store mode and transactional mode;
/// a store that records less than [`MAX_RESULT_BYTES`] is asked in
/// [`settle`].
pub(crate) fn outcome_to_record<R: IdempotentReturn, H: ErrorHandling<R::Failure>>(
    spec: &'static ScopeInfo,
    result: &Result<R::Value, R::Failure>,
    errors: &H,
) -> Result<Option<StoredOutcome>, Error> {
    let encoding = |message: String| Error::ResultEncoding {
        scope: spec.scope.to_owned(),
        message,
    };
    // Rule 12: a value that would not replay equal is refused, never recorded
    // as something else (JSON has no non-finite floats: serde_json writes null).
    let faithful = |check: Result<(), String>| {
        check.map_err(|message| Error::ResultNotFaithful {
            scope: spec.scope.to_owned(),
            message,
        })
    };
    // Checked before the result is read back (which would hold it twice).
    let too_large = |size: usize| {
        if size > MAX_RESULT_BYTES {
            return Err(Error::ResultTooLarge {
                scope: spec.scope.to_owned(),
                size,
                limit: MAX_RESULT_BYTES,
            });
        }
        Ok(())
    };
    // What is recorded must also read back as its own type: serde writes some
    // values it cannot read (see `reads_back`), and such a record would
    // answer every retry with `ReplayDecoding` until its ttl ran out.
    let stored =
        match result {
            Ok(value) => {
                faithful(crate::fingerprint::check_faithful_json(value))?;
                let payload = serde_json::to_vec(value).map_err(|e| encoding(e.to_string()))?;
                too_large(payload.len())?;
                faithful(reads_back_equal(value, &payload))?;
                StoredOutcome {
                    is_error: false,
                    payload,
                }
            }
            Err(e) => {
                if !errors.records(e) {
                    return Ok(None);
                }
                faithful(errors.check_faithful(e))?;
                let payload = errors.encode(e).map_err(encoding)?;
                too_large(payload.len())?;
                faithful(errors.reads_back(e, &payload).map_err(|message| {
                    format!("the recorded error would not read back: {message}")
                }))?;
                StoredOutcome {
                    is_error: true,
                    payload,
                }
            }
        };
    Ok(Some(stored))
}

/// Rule 12: `payload`, what a value was written as, must read back as its
/// own type, and not as another value. serde writes some values it cannot
/// read: `u128`/`i128` inside `#[serde(flatten)]` or an internally tagged
/// enum (serde buffers those and its buffer has no 128-bit integers), number
/// map keys under `#[serde(flatten)]`, a field skipped when serialized
/// (`skip_serializing_if`) without `#[serde(default)]`. And some it reads as
/// another value: a flattened `Option` whose `None` comes back `Some` (of a
/// struct whose fields all have defaults, or an empty map), a field skipped
/// when serialized whose `default` is another value. The value read back is
/// written again and its object members compared ([`Members`]): a refusal
/// releases the key and the retry runs the body again, so only a member that
/// appears or goes counts, never what an equal value may write otherwise.
pub(crate) fn reads_back_equal<T: Serialize + DeserializeOwned>(
    value: &T,
    payload: &[u8],
) -> Result<(), String> {
    let decoded: T = decoded_record(payload)?;
    // JSON writes some values of one type alike that are not equal: the
    // variants of an `#[serde(untagged)]` enum that write the same JSON
    // (`Wide(7u32)` and `Small(7u8)`, `Letter('x')` and `Text("x")`), which
    // read back as the first that reads it. Their shapes differ
    // (`crate::fingerprint::shape`), also where two such values trade kinds
    // (`B { x: 7u32, y: 7u8 }` read back as `A { x: 7u8, y: 7u32 }`). Not
    // seen: struct variants whose fields have the same names and types
    // (serde writes both under the enum's name) and unit variants (both
    // `null`).
    if !crate::fingerprint::shape::same_shape(value, &decoded) {
        return Err(
            "written as JSON it reads back as another value of its type: check the type's \
             serde attributes (an `#[serde(untagged)]` enum whose variants write the same \
             JSON, such as `Wide(7u32)` read back as `Small(7u8)`, or `Letter('x')` as \
             `Text(\"x\")`: tag the enum)"
                .to_owned(),
        );
    }
    writes_again_as_equal(&decoded, payload)
}

/// `payload` read as a `T`, or why it does not read.
fn decoded_record<T: DeserializeOwned>(payload: &[u8]) -> Result<T, String> {
    serde_json::from_slice(payload).map_err(|e| {
        format!(
            "written as JSON it does not read back as its own type ({}): check the type's serde \
             attributes (a 128-bit integer inside `#[serde(flatten)]` or an internally tagged \
             enum, number map keys under `#[serde(flatten)]`, a field skipped when serialized \
             without `#[serde(default)]`)",
            replay_failure(&e)
        )
    })
}

/// Whether `decoded` (what `payload` read back as) writes again as the same
/// value: the same members, numbers, booleans and nulls, wherever they stand.
fn writes_again_as_equal<T: Serialize>(decoded: &T, payload: &[u8]) -> Result<(), String> {
    let Ok(again) = serde_json::to_vec(decoded) else {
        return Ok(()); // its own type could not write it again: nothing to compare
    };
    if again == payload {
        return Ok(());
    }
    // Written again otherwise: a set or a map in another order (through
    // whatever `Serialize`, into an array or into a string), which is equal;
    // or with members its first writing did not have, or without some it
    // had, or with other numbers, booleans or nulls, which is another value.
    // The members and those scalars are compared, not where they stand nor
    // the text of strings.
    if let (Ok(before), Ok(after)) = (
        serde_json::from_slice::<serde_json::Value>(payload),
        serde_json::from_slice::<serde_json::Value>(&again),
    ) && Members::of(&before) != Members::of(&after)
    {
        return Err(
            "written as JSON it reads back as another value: check the type's serde attributes \
             (`#[serde(flatten)]` on an `Option`, whose `None` reads back as `Some` when every \
             field of the inner type has a default; a `skip_serializing_if` field whose \
             `default` is another value)"
                .to_owned(),
        );
    }
    // The scalars and the repeated names from the text itself: a
    // `serde_json::Value` holds an integer beyond 64 bits as the float
    // nearest (`Exact(u128::MAX)` read back as `Approx(3.4e38)` would look
    // unchanged) and keeps one member per name.
    let (Some(before), Some(after)) = (
        crate::fingerprint::json::parse_json(payload),
        crate::fingerprint::json::parse_json(&again),
    ) else {
        return Ok(());
    };
    if Scalars::of(&before) != Scalars::of(&after) {
        return Err(
            "written as JSON it reads back as another value: check the type's serde attributes \
             (an `#[serde(untagged)]` enum whose variants read each other's values, such as \
             `Whole(7)` read back as `Float(7.0)` when the float variant comes first; a \
             `deserialize_with` that does not read what its `serialize_with` writes)"
                .to_owned(),
        );
    }
    if Repeats::of(&before) != Repeats::of(&after) {
        return Err(
            "written as JSON it has one member name twice in an object, and reads back as \
             another value: check the type's serde attributes (two `#[serde(flatten)]` maps \
             holding one key each read back every entry of that name)"
                .to_owned(),
        );
    }
    Ok(())
}

/// The members of a JSON text written under a name that occurs more than
/// once in its object, at every depth: each with its name and its value
/// (canonical, arrays in no order), counted. Two `#[serde(flatten)]` maps
/// holding one key write that name twice, and each reads back every entry
/// of it (the last one wins in both): the values under the name change,
/// which a `serde_json::Value` (one member per name) cannot show. A
/// multimap that reads back as written keeps them.
#[derive(Debug, PartialEq)]
struct Repeats(std::collections::BTreeMap<(String, Vec<u8>), usize>);

impl Repeats {
    fn of(node: &crate::fingerprint::json::Node<'_>) -> Self {
        let mut repeats = Repeats(std::collections::BTreeMap::new());
        repeats.add(node);
        repeats
    }

    fn add(&mut self, node: &crate::fingerprint::json::Node<'_>) {
        use crate::fingerprint::json::Node;
        match node {
            Node::Array(items) => items.iter().for_each(|item| self.add(item)),
            Node::Object(members) => {
                // The names written more than once (sorted once: no
                // allocation per member for the usual object without any).
                let mut names: Vec<&str> = members.iter().map(|(name, _)| name.as_ref()).collect();
                names.sort_unstable();
                let repeated: Vec<&str> = names
                    .windows(2)
                    .filter(|pair| pair[0] == pair[1])
                    .map(|pair| pair[0])
                    .collect();
                for (name, value) in members {
                    if !repeated.is_empty() && repeated.binary_search(&name.as_ref()).is_ok() {
                        let mut bytes = Vec::new();
                        value.write_unordered(&mut bytes);
                        *self.0.entry((name.to_string(), bytes)).or_default() += 1;
                    }
                    self.add(value);
                }
            }
            _ => {}
        }
    }
}

/// The numbers, booleans and nulls of a JSON text, at every depth, counted
/// wherever they stand: a set or a map written again in another order has
/// the same ones; a value that reads back as another (an untagged enum's
/// `7` read as `7.0`) does not. A number is compared as the text writes it
/// (`7` and `7.0` differ; integers of any size by every digit). Strings are
/// not compared: an equal value may write one otherwise (a set joined into
/// a string in its own order).
#[derive(Debug, Default, PartialEq)]
struct Scalars(std::collections::BTreeMap<String, usize>);

impl Scalars {
    fn of(node: &crate::fingerprint::json::Node<'_>) -> Self {
        let mut scalars = Scalars::default();
        scalars.add(node);
        scalars
    }

    fn add(&mut self, node: &crate::fingerprint::json::Node<'_>) {
        use crate::fingerprint::json::Node;
        match node {
            Node::Object(members) => members.iter().for_each(|(_, m)| self.add(m)),
            Node::Array(items) => items.iter().for_each(|item| self.add(item)),
            Node::String(_) => {}
            Node::Number(n) => self.count(n.as_written()),
            Node::Literal(l) => self.count(String::from_utf8_lossy(l).into_owned()),
        }
    }

    fn count(&mut self, scalar: String) {
        *self.0.entry(scalar).or_default() += 1;
    }
}

/// The object members of a JSON value, at every depth: each object's keys,
/// with the members of their values; the members of an array's elements
/// merged. What serde reads back as another value shows here (a member that
/// appears or goes); what writing an equal value again may change (the
/// order of a set's or a map's members, the text of a string) does not.
#[derive(Debug, Default, PartialEq)]
struct Members(std::collections::BTreeMap<String, Members>);

impl Members {
    fn of(value: &serde_json::Value) -> Self {
        let mut members = Members::default();
        members.add(value);
        members
    }

    fn add(&mut self, value: &serde_json::Value) {
        match value {
            serde_json::Value::Object(object) => {
                for (key, member) in object {
                    self.0.entry(key.clone()).or_default().add(member);
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|item| self.add(item)),
            _ => {}
        }
    }
}

/// A recorded answer, decoded: `Ok` with the result or the recorded error,
/// `Err(ReplayDecoding)` when it no longer decodes as the function's types.
fn decoded_replay<R: IdempotentReturn, H: ErrorHandling<R::Failure>>(
    spec: &'static ScopeInfo,
    errors: &H,
    outcome: StoredOutcome,
) -> Result<Result<R::Value, R::Failure>, Error> {
    let failed = |message: String| Error::ReplayDecoding {
        scope: spec.scope.to_owned(),
        message,
    };
    if outcome.is_error {
        match errors.replay(&outcome.payload) {
            Ok(e) => Ok(Err(e)),
            Err(message) => Err(failed(message)),
        }
    } else {
        serde_json::from_slice(&outcome.payload)
            .map(Ok)
            .map_err(|e| failed(replay_failure(&e)))
    }
}

/// Why a recorded value could not be read back, without the value: serde
/// quotes what it found (`invalid type: string "receipt for KEY-1",
/// expected u64`), and that is recorded data, which may hold a raw key or
/// personal data and ends up in logs (rule 2). What the type expected, and
/// where, is kept: `invalid type, expected u64 at line 1 column 20`.
fn replay_failure(e: &serde_json::Error) -> String {
    let message = e.to_string();
    if !e.is_data() {
        return message;
    }
    // serde's own forms, exactly (`invalid type: …`, `invalid value: …`,
    // `invalid length 3`, ``unknown variant `…` ``, ``unknown field `…` ``):
    // what it found is quoted after the kind (cut off here), what the type
    // expected is the type's own description. A type's own message may read
    // alike and quote the value anywhere: not trusted.
    let serde_form = |found: &str| {
        [
            "invalid type: ",
            "invalid value: ",
            "unknown variant `",
            "unknown field `",
        ]
        .iter()
        .any(|form| found.starts_with(form))
            || found
                .strip_prefix("invalid length ")
                .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
    };
    if let Some((found, expected)) = message.rsplit_once(", expected ")
        && serde_form(found)
    {
        let kind = found
            .split([':', '`'])
            .next()
            .unwrap_or_default()
            .trim_end();
        return format!("{kind}, expected {expected}");
    }
    // The type's own names, or serde's own words, no data.
    let fixed = [
        "missing field",
        "duplicate field",
        "u128 is not supported",
        "i128 is not supported",
    ];
    if fixed.iter().any(|start| message.starts_with(start)) {
        return message;
    }
    // Anything else (a type's own `Deserialize` or `try_from` message) may
    // quote the value: only where it failed.
    match e.line() {
        0 => "the recorded value does not fit the type".to_owned(),
        line => format!(
            "the recorded value does not fit the type at line {line} column {}",
            e.column()
        ),
    }
}

/// Ends the lease of a record this call owns, without deleting it: the next
/// call takes it over (and asks the recover hook again) at once.
pub(crate) async fn end_lease_logged(
    store: &dyn Store,
    identity: &Identity,
    token: &OwnerToken,
) -> EndedLease {
    match store.heartbeat(identity, token, Duration::ZERO).await {
        Ok(Fenced::Written) => EndedLease::Ended,
        Ok(Fenced::NotOwner) => {
            tracing::warn!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                "ending the lease found the record owned by someone else (lease lost); left it alone");
            EndedLease::NotOurs
        }
        Err(e) => {
            tracing::error!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(), error = %e,
                "ending the lease failed; the store retries it in the background");
            store.end_lease_detached(identity.clone(), token.clone());
            EndedLease::HandedToTheStore
        }
    }
}

/// What [`end_lease_logged`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndedLease {
    /// The lease is over.
    Ended,
    /// No record held with this token (another owner's, or none).
    NotOurs,
    /// It failed; the store's worker tries again.
    HandedToTheStore,
}

/// Releases the call's record now. The guard stays armed until the release
/// has been made, so a call dropped while it waits, or a release that fails,
/// is handed to the store's background worker when the guard drops (rule 14).
async fn release(store: &dyn Store, guard: &FinishOnDrop<'_>) {
    let (identity, token) = (guard.identity, guard.token);
    match store.release(identity, token).await {
        Ok(Fenced::Written) => guard.arm(false),
        Ok(Fenced::NotOwner) => {
            guard.arm(false);
            tracing::warn!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                "release found the record owned by someone else (lease lost); left it alone")
        }
        Err(e) => {
            tracing::warn!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(), error = %e,
                "release failed; the store retries it in the background")
        }
    }
}

type PanicPayload = Box<dyn std::any::Any + Send + 'static>;

/// What the heartbeat knows of the lease: when it was last written, and
/// whether its lapse was noted since (rule 9: a lease that ran out while the
/// body ran is never silent, see [`note_lapse`]). Kept by the heartbeat, and
/// handed back at the body's end for a lapse no renewal saw.
#[derive(Debug, Clone, Copy)]
struct LeaseWatch {
    /// When the lease was last written, at the earliest: the sending of the
    /// statement that wrote it before the body started, then the sending of
    /// each renewal that was written.
    renewed_at: Instant,
    /// A lapse was noted since then (or the lease was lost: nothing more to say).
    noted: bool,
}

impl LeaseWatch {
    /// A renewal sent at `sent` was written.
    fn written(&mut self, sent: Instant) {
        if sent > self.renewed_at {
            self.renewed_at = sent;
            self.noted = false;
        }
    }

    /// A renewal sent at `sent` answered that it was written, now. It landed
    /// somewhere between its sending and now: when now is a lease or more
    /// after the lease was last written, it may have landed after the lease
    /// ran out (it waited for a pool connection the body held, or for a
    /// row lock), and that is noted as a lapse before it counts. (Counted
    /// at its sending alone, such a lapse went unnoticed.) One clock read
    /// per renewal written: bodies longer than a period only.
    fn written_by(&mut self, spec: &'static ScopeInfo, identity: &Identity, sent: Instant) {
        self.note_if_lapsed(spec, identity, Instant::now(), None);
        self.written(sent);
    }

    /// Notes a lapse once: `now` is a lease or more after the lease was last
    /// written, or, when a renewal sent at `in_flight` may already have been
    /// written, after that one.
    fn note_if_lapsed(
        &mut self,
        spec: &'static ScopeInfo,
        identity: &Identity,
        now: Instant,
        in_flight: Option<Instant>,
    ) {
        let newest = in_flight.map_or(self.renewed_at, |sent| sent.max(self.renewed_at));
        let since = now.saturating_duration_since(newest);
        if !self.noted && since >= spec.lease {
            self.noted = true;
            note_lapse(spec, identity, since, spec.lease);
        }
    }
}

/// Polls the body and, on the same task, renews the lease every `lease / 3`,
/// counted from `lease_set` (no later than when the lease was last written).
/// Nothing is spawned: when this future stops being polled, renewal stops too.
///
/// Generic over the body (one copy per annotated function) only as far as
/// polling it: the renewals are [`Heartbeat`]'s, compiled once.
async fn run_with_heartbeat<'a, R, Fut: Future<Output = R>>(
    store: &'a dyn Store,
    spec: &'static ScopeInfo,
    (identity, token): (&'a Identity, &'a OwnerToken),
    (lease, lease_set): (Duration, Instant),
    body: Fut,
) -> (Result<R, PanicPayload>, LeaseWatch, RenewalsInFlight<'a>) {
    let mut beats = Heartbeat::new(store, spec, (identity, token), lease, lease_set);
    let mut body = pin!(AssertUnwindSafe(body).catch_unwind());
    let out = std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = body.as_mut().poll(cx) {
            return Poll::Ready(out);
        }
        beats.poll_renewals(cx);
        Poll::Pending
    })
    .await;
    let (watch, in_flight) = beats.finish();
    (out, watch, in_flight)
}

/// The renewals of a body or a hook still unanswered when it ended. A
/// renewal that was sent runs on the server when it arrives, also once its
/// future is dropped: one that lands after the call ended the lease (to have
/// the next call take the record over at once and ask the `recover` hook)
/// gives the record a whole lease again, and every retry is refused, or
/// waits, until it runs out. [`landed`](Self::landed) waits for them before
/// such a write; dropped, they are not waited for (a completion or a
/// release is not undone by a renewal that lands after it).
pub(crate) struct RenewalsInFlight<'a>(Vec<Renewal<'a>>);

impl RenewalsInFlight<'_> {
    /// Waits until every renewal in flight has answered (or failed), so a
    /// write of this call that ends its lease comes after them; for the
    /// scope's lease at most (a renewal unanswered that long is one whose
    /// connection was lost or a lock holds: the lease is ended then, as
    /// before, rather than the call held for as long as the store's own
    /// bound on a renewal).
    async fn landed(self, spec: &'static ScopeInfo, identity: &Identity) {
        if self.0.is_empty() {
            return;
        }
        let all = futures_util::future::join_all(self.0);
        if tokio::time::timeout(spec.lease, all).await.is_err() {
            tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.log_digest(),
                "a lease renewal still unanswered a lease after the call ended; ending the lease \
                 anyway (should it land later, it renews the lease once more)");
        }
    }
}

/// A renewal of the lease, sent and not yet answered.
type Renewal<'a> = futures_util::future::BoxFuture<'a, Result<Fenced, crate::error::StoreError>>;

/// The lease renewals of one running body ([`run_with_heartbeat`]).
struct Heartbeat<'a> {
    store: &'a dyn Store,
    spec: &'static ScopeInfo,
    identity: &'a Identity,
    token: &'a OwnerToken,
    lease: Duration,
    period: Duration,
    /// When the first renewal is due: a period after the lease was written.
    first_due: Instant,
    /// Made the first time the body is pending: a body that finishes in its
    /// first poll costs no timer (fast bodies never heartbeat).
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// The renewal in flight, and when it has had its period.
    beat: Option<Renewal<'a>>,
    beat_due: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// A renewal that outlived its period (a connection whose peer went
    /// silent, a row another transaction holds). It is polled until it
    /// answers, never dropped: its statement would go on holding a pooled
    /// connection on the server. One more renewal may start beside it; never
    /// a third.
    late: Option<Renewal<'a>>,
    /// Another caller owns the record now (fenced renewal): renewing again
    /// cannot win it back, so no more renewals are sent.
    lost: bool,
    /// When the lease was last set, as far as this call knows: the sending
    /// of the statement that set it before the body started (the
    /// reservation, or the renewal that checked it), then the sending of
    /// each renewal that was written. A renewal sent a lease or more after it finds the
    /// lease already lapsed (see `note_lapse`).
    watch: LeaseWatch,
    beat_sent: Instant,
    late_sent: Instant,
}

impl<'a> Heartbeat<'a> {
    fn new(
        store: &'a dyn Store,
        spec: &'static ScopeInfo,
        (identity, token): (&'a Identity, &'a OwnerToken),
        lease: Duration,
        lease_set: Instant,
    ) -> Self {
        let period = (lease / 3).max(Duration::from_millis(1));
        // The first renewal is due a period after the lease was written (at
        // the earliest: when the statement that wrote it was sent), not after
        // the body starts: a reservation answered late (the process paused,
        // a slow link) leaves the body less than a lease, and a renewal a
        // period after the body's start landed after the lease had run out,
        // a duplicate's takeover in between (the body ran twice). Whatever
        // the first poll costs, a renewal overdue when it returns Pending is
        // sent at once.
        let first_due = lease_set + period;
        let started = lease_set; // no clock read per call
        Heartbeat {
            store,
            spec,
            identity,
            token,
            lease,
            period,
            first_due,
            timer: None,
            beat: None,
            beat_due: None,
            late: None,
            lost: false,
            watch: LeaseWatch {
                renewed_at: started,
                noted: false,
            },
            beat_sent: started,
            late_sent: started,
        }
    }

    /// Called while the body is pending: takes the answers of renewals in
    /// flight and sends the next one when it is due. Registers `cx` for
    /// whatever it waits on.
    fn poll_renewals(&mut self, cx: &mut std::task::Context<'_>) {
        let (spec, identity, period) = (self.spec, self.identity, self.period);
        let first_due = self.first_due;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(sleep_until(first_due)));
        loop {
            if let Some(f) = self.late.as_mut()
                && let Poll::Ready(result) = f.as_mut().poll(cx)
            {
                self.late = None;
                // Its failure was counted when it ran late; a success or a
                // lost lease still counts.
                if matches!(result, Ok(Fenced::Written)) {
                    self.watch.written_by(spec, identity, self.late_sent);
                }
                if result.is_ok() {
                    self.lost |= note_heartbeat(spec, identity, result);
                }
            }
            if let Some(f) = self.beat.as_mut() {
                if let Poll::Ready(result) = f.as_mut().poll(cx) {
                    self.beat = None;
                    if matches!(result, Ok(Fenced::Written)) {
                        self.watch.written_by(spec, identity, self.beat_sent);
                    }
                    let failed = result.is_err();
                    self.lost |= note_heartbeat(spec, identity, result);
                    // A renewal that failed is tried again soon: the lease is
                    // still running out. Counted from when it was sent, not
                    // from when its answer is seen (a body that blocked the
                    // thread meanwhile would push the next one past the lease).
                    let next = if failed { period / 4 } else { period };
                    timer.as_mut().reset(self.beat_sent + next);
                } else {
                    let due = self
                        .beat_due
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(period)));
                    if due.as_mut().poll(cx).is_pending() {
                        return;
                    }
                    note_heartbeat(
                        spec,
                        identity,
                        Err(crate::error::StoreError::new(
                            self.store.name(),
                            "heartbeat",
                            "no answer within a renewal period (lease / 3): the server is slow, \
                             a row lock holds the statement, or the store's pool had no free \
                             connection for it",
                        )),
                    );
                    if self.late.is_none() {
                        // Keep it, and try another renewal soon.
                        self.late = self.beat.take();
                        self.late_sent = self.beat_sent;
                        timer.as_mut().reset(Instant::now() + period / 4);
                    } else {
                        // Two in flight already: wait for one of them.
                        due.as_mut().reset(Instant::now() + period);
                        continue;
                    }
                }
            }
            if self.lost || timer.as_mut().poll(cx).is_pending() {
                return;
            }
            self.beat_sent = Instant::now();
            // A late renewal still in flight may have been written already.
            self.watch.note_if_lapsed(
                spec,
                identity,
                self.beat_sent,
                self.late.is_some().then_some(self.late_sent),
            );
            self.beat = Some(self.store.heartbeat(identity, self.token, self.lease));
            match self.beat_due.as_mut() {
                Some(due) => due.as_mut().reset(Instant::now() + period),
                None => self.beat_due = Some(Box::pin(tokio::time::sleep(period))),
            }
        }
    }

    /// The body has ended: what is known of its lease.
    fn finish(self) -> (LeaseWatch, RenewalsInFlight<'a>) {
        // A renewal still in flight when the body ends is not counted as
        // written: the body-end check below sees the lease as last confirmed.
        // (Counted as written at its sending, a renewal waiting for a pool
        // connection the body held hid a lease that ran out while the body
        // ran, and another caller took the record over: rule 9 says that is
        // never silent. The check notes a lapse only once no renewal has been
        // confirmed for a whole lease, so one still in flight then has been
        // unanswered for two periods or more, a heartbeat failure already.)
        // After a lost lease there is nothing more to say.
        let mut watch = self.watch;
        watch.noted |= self.lost;
        let in_flight = RenewalsInFlight(self.late.into_iter().chain(self.beat).collect());
        (watch, in_flight)
    }
}

/// Counts and logs a lease that ran out while the body ran, because no
/// renewal was sent in time (the body blocked its thread, or its runtime was
/// starved, or the call was not polled) or none was written (the store
/// failed): for `lapsed`, any caller could have taken the record over and
/// run the body beside this one. Rule 9: never silent, even when nobody did
/// and the next renewal wins the lease back.
fn note_lapse(spec: &'static ScopeInfo, identity: &Identity, lapsed: Duration, lease: Duration) {
    crate::metrics::lease_lapsed(spec.scope);
    tracing::warn!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
        since_renewed_ms = lapsed.as_millis() as u64, lease_ms = lease.as_millis() as u64,
        "heartbeat: the lease lapsed before it could be renewed (the body blocked its thread, \
         its runtime was starved, the call was not polled, or renewals failed): another caller \
         could have taken the record over and run the body meanwhile");
}

/// Counts and logs a renewal's answer; `true` when the lease was lost.
fn note_heartbeat(
    spec: &'static ScopeInfo,
    identity: &Identity,
    result: Result<Fenced, crate::error::StoreError>,
) -> bool {
    match result {
        Ok(Fenced::Written) => {
            METRICS.heartbeats.fetch_add(1, Ordering::Relaxed);
            false
        }
        Ok(Fenced::NotOwner) => {
            crate::metrics::heartbeat_failed(spec.scope);
            tracing::error!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                "heartbeat: the lease was lost to another caller; this call's result will not be \
                 recorded, and its lease is no longer renewed");
            true
        }
        Err(e) => {
            crate::metrics::heartbeat_failed(spec.scope);
            tracing::warn!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(), error = %e,
                "heartbeat failed; will try again");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`reads_back_equal`] for a payload written by hand, without the value
    /// it was written from (no shape to compare).
    fn reads_back_as<T: Serialize + DeserializeOwned>(payload: &[u8]) -> Result<(), String> {
        writes_again_as_equal(&decoded_record::<T>(payload)?, payload)
    }

    /// Rule 12: a value that JSON writes like another of its type, and
    /// reads back as that one, is refused: the two differ in the kinds of
    /// scalars or the named types they are made of. One that reads back as
    /// itself, however its sets and maps come back ordered, is not.
    #[test]
    fn a_value_that_reads_back_as_another_of_another_shape_is_refused() {
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(untagged)]
        enum Alike {
            Small(u8),
            Wide(u32),
            Text(String),
            Letter(char),
            Pair(u8, u8),
            Wider(u16, u64),
        }
        let written = |v: &Vec<Alike>| serde_json::to_vec(v).expect("written");
        for value in [
            vec![Alike::Wide(7)],
            vec![Alike::Letter('x')],
            vec![Alike::Small(1), Alike::Wider(1, 2)],
        ] {
            let refused = reads_back_equal(&value, &written(&value))
                .expect_err("reads back as other variants");
            assert!(refused.contains("untagged"), "{refused}");
        }
        for value in [
            vec![
                Alike::Wide(700),
                Alike::Text("xy".into()),
                Alike::Pair(1, 2),
            ],
            vec![Alike::Wider(1, 1 << 40), Alike::Small(0)],
        ] {
            assert_eq!(reads_back_equal(&value, &written(&value)), Ok(()));
        }
        let set: std::collections::HashMap<String, std::collections::HashSet<u64>> =
            [("a".to_owned(), (0..64).collect())].into();
        assert_eq!(
            reads_back_equal(&set, &serde_json::to_vec(&set).unwrap()),
            Ok(())
        );
    }

    /// Rule 12's read-back check compares the numbers, booleans and nulls a
    /// value writes wherever they stand: an untagged enum's `7` read back as
    /// `7.0` is another value; sets and maps of numbers written again in
    /// another order are the same one.
    #[test]
    fn a_value_whose_numbers_read_back_otherwise_is_another_value() {
        #[derive(Serialize, serde::Deserialize)]
        #[serde(untagged)]
        enum Amount {
            Float(f64),
            Whole(u64),
        }
        let written = |v: &Amount| serde_json::to_vec(v).expect("json");
        let refused = reads_back_as::<Amount>(&written(&Amount::Whole(7)))
            .expect_err("Whole(7) reads back as Float(7.0)");
        assert!(refused.contains("untagged"), "{refused}");
        assert_eq!(
            reads_back_as::<Amount>(&written(&Amount::Float(7.5))),
            Ok(())
        );
        // Beyond 64 bits too: a `serde_json::Value` holds such an integer
        // as the float nearest, so the text itself is compared.
        #[derive(Serialize, serde::Deserialize)]
        #[serde(untagged)]
        enum Quantity {
            Approx(f64),
            Exact(u128),
        }
        for exact in [u128::from(u64::MAX) + 1, u128::MAX] {
            let payload = serde_json::to_vec(&Quantity::Exact(exact)).expect("json");
            let refused = reads_back_as::<Quantity>(&payload)
                .expect_err("Exact reads back as Approx, the float nearest");
            assert!(refused.contains("untagged"), "{refused}");
        }
        let payload = serde_json::to_vec(&Quantity::Approx(3.5e38)).expect("json");
        assert_eq!(reads_back_as::<Quantity>(&payload), Ok(()));

        let set: std::collections::HashSet<u64> = (0..64).collect();
        let map: std::collections::HashMap<String, (bool, Option<u8>)> = (0..64u8)
            .map(|i| (format!("k{i}"), (i % 2 == 0, (i % 3 == 0).then_some(i))))
            .collect();
        let payload = serde_json::to_vec(&(set, map)).expect("json");
        assert_eq!(
            reads_back_as::<(
                std::collections::HashSet<u64>,
                std::collections::HashMap<String, (bool, Option<u8>)>
            )>(&payload),
            Ok(())
        );
    }

    /// Rule 12: two flattened maps holding one key write its name twice,
    /// and both read back the last entry: another value, whether the values
    /// are numbers or strings (a `serde_json::Value` keeps one member per
    /// name, so only the text written twice shows it); with keys of their
    /// own each reads back both, and the names come back twice. Maps that
    /// hold one key with one value read back as written, in any order of
    /// their sets.
    #[test]
    fn a_value_written_with_one_name_twice_that_reads_back_otherwise_is_another_value() {
        #[derive(Serialize, serde::Deserialize)]
        struct Two<V> {
            #[serde(flatten)]
            a: std::collections::BTreeMap<String, V>,
            #[serde(flatten)]
            b: std::collections::BTreeMap<String, V>,
        }
        let two = |a: (&str, u64), b: (&str, u64)| Two {
            a: [(a.0.to_owned(), a.1)].into(),
            b: [(b.0.to_owned(), b.1)].into(),
        };
        let payload = serde_json::to_vec(&two(("x", 1), ("x", 2))).expect("json");
        assert!(
            reads_back_as::<Two<u64>>(&payload).is_err(),
            "both read back 2"
        );
        let strings = Two {
            a: [("x".to_owned(), "p".to_owned())].into(),
            b: [("x".to_owned(), "q".to_owned())].into(),
        };
        let payload = serde_json::to_vec(&strings).expect("json");
        let refused = reads_back_as::<Two<String>>(&payload).expect_err("both read back q");
        assert!(refused.contains("twice"), "{refused}");
        // Keys of their own: each map reads back both entries.
        let payload = serde_json::to_vec(&two(("x", 1), ("y", 2))).expect("json");
        assert!(reads_back_as::<Two<u64>>(&payload).is_err());
        // One key holding one value in both: equal.
        let payload = serde_json::to_vec(&two(("x", 1), ("x", 1))).expect("json");
        assert_eq!(reads_back_as::<Two<u64>>(&payload), Ok(()));
        // A name repeated whose values hold a set: written again in another
        // order, still equal.
        let sets: Two<std::collections::HashSet<u64>> = Two {
            a: [("x".to_owned(), (0..64).collect())].into(),
            b: [("x".to_owned(), (0..64).collect())].into(),
        };
        let payload = serde_json::to_vec(&sets).expect("json");
        assert_eq!(
            reads_back_as::<Two<std::collections::HashSet<u64>>>(&payload),
            Ok(())
        );
    }
    use crate::registry::ErrorPolicy;
    use crate::MemoryStore;

    /// Rule 2: a recorded value that does not fit the return type is
    /// reported without the value (it may hold a raw key or personal data,
    /// and the error is logged), with what the type expected.
    #[test]
    fn a_replay_that_does_not_fit_does_not_quote_the_recorded_value() {
        let cases: [(&[u8], &str); 4] = [
            (
                br#""receipt for SECRET-KEY-4711""#,
                "invalid type, expected u64",
            ),
            (br#"-7"#, "invalid value, expected u64"),
            (
                br#""SECRET-KEY-4711, expected u64""#,
                "invalid type, expected u64",
            ),
            (
                br#"{"amount": "SECRET-KEY-4711"}"#,
                "invalid type, expected u64",
            ),
        ];
        for (payload, shape) in cases {
            let outcome = StoredOutcome {
                is_error: false,
                payload: payload.to_vec(),
            };
            let message =
                match decoded_replay::<Result<u64, Error>, _>(&SPEC, &ReleaseErrors, outcome) {
                    Err(e @ Error::ReplayDecoding { .. }) => e.to_string(),
                    other => panic!("{other:?}"),
                };
            assert!(!message.contains("SECRET"), "{message}");
            assert!(!message.contains("-7"), "{message}");
            assert!(message.contains(shape), "{message}");
            assert!(message.contains("engine.test"), "{message}");
        }
        // A type's own message, which may quote the value, is not passed on.
        let message = replay_failure(&refused_by_the_type(|s| format!("no such account: {s}")));
        assert!(!message.contains("SECRET"), "{message}");
        assert!(message.contains("does not fit the type"), "{message}");
        // Nor one that reads like serde's own (logs hunt: "unknown currency
        // <value>, expected an ISO 4217 code" kept the value).
        let message = replay_failure(&refused_by_the_type(|s| {
            format!("unknown currency {s}, expected an ISO 4217 code")
        }));
        assert!(!message.contains("SECRET"), "{message}");
        assert!(message.contains("does not fit the type"), "{message}");
        // Even one that starts like serde's own (review: "invalid value
        // <value>, expected ..." passed as serde's form).
        let message = replay_failure(&refused_by_the_type(|s| {
            format!("invalid value {s}, expected an ISO 4217 code")
        }));
        assert!(!message.contains("SECRET"), "{message}");
        // serde's own length form keeps its shape.
        let e = serde_json::from_slice::<[u8; 2]>(b"[1]").expect_err("refused");
        assert!(replay_failure(&e).starts_with("invalid length"), "{e}");
        // A recorded error replayed through `errors = record`, the same.
        let recorded = RecordErrors.replay(br#""SECRET-KEY-4711""#);
        let message: String = match recorded {
            Err(message) => message,
            Ok(value) => {
                let value: u64 = value;
                panic!("decoded {value}")
            }
        };
        assert!(!message.contains("SECRET"), "{message}");
        // Messages that quote no recorded value stay whole.
        let outcome = StoredOutcome {
            is_error: false,
            payload: b"12x".to_vec(),
        };
        let message = match decoded_replay::<Result<u64, Error>, _>(&SPEC, &ReleaseErrors, outcome)
        {
            Err(e) => e.to_string(),
            Ok(v) => panic!("decoded {v:?}"),
        };
        assert!(message.contains("trailing characters"), "{message}");
    }

    /// The error of reading `"SECRET-KEY-4711"` as a type whose own
    /// `Deserialize` refuses it with `message(value)`: a message of the
    /// type's own, which quotes the value it was given.
    fn refused_by_the_type(message: fn(&str) -> String) -> serde_json::Error {
        struct Refusing(fn(&str) -> String);
        impl<'de> serde::de::DeserializeSeed<'de> for Refusing {
            type Value = ();
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                let s = <String as serde::Deserialize>::deserialize(d)?;
                Err(serde::de::Error::custom((self.0)(&s)))
            }
        }
        let mut input = serde_json::Deserializer::from_slice(br#""SECRET-KEY-4711""#);
        serde::de::DeserializeSeed::deserialize(Refusing(message), &mut input).expect_err("refused")
    }

    static SPEC: ScopeInfo = ScopeInfo::new(crate::registry::ScopeSpec {
        scope: "engine.test",
        function: "engine::tests::f",
        file: file!(),
        line: line!(),
        ttl: Duration::from_secs(60),
        lease: Duration::from_millis(300),
        in_progress: InProgressPolicy::Reject,
        errors: ErrorPolicy::Release,
        transactional: false,
        fingerprinted: true,
        fingerprinted_parameters: &["amount"],
        shared_tenant: false,
        recover: None,
        shared_scope: false,
    });

    async fn call(store: &MemoryStore, key: &str, amount: u32) -> Result<u32, Error> {
        let c = Call {
            spec: &SPEC,
            store: Ok(StoreRef::Borrowed(store)),
            identity: Identity::new("tenant", SPEC.scope, key),
            fingerprint: {
                let mut f = crate::FingerprintBuilder::new();
                f.argument("amount", &amount);
                f.finish()
            },
        };
        execute::<Result<u32, Error>, _, _, _>(c, ReleaseErrors, NoRecover, async move {
            Ok(amount * 2)
        })
        .await
    }

    fn assert_send<T: Send>(t: T) -> T {
        t
    }

    static SLOW_FIRST_POLL: ScopeInfo = ScopeInfo::new(crate::registry::ScopeSpec {
        scope: "engine.slow_first_poll",
        function: "engine::tests::slow",
        file: file!(),
        line: line!(),
        ttl: Duration::from_secs(60),
        lease: Duration::from_secs(3),
        in_progress: InProgressPolicy::Reject,
        errors: ErrorPolicy::Release,
        transactional: false,
        fingerprinted: false,
        fingerprinted_parameters: &[],
        shared_tenant: false,
        recover: None,
        shared_scope: false,
    });

    /// The first renewal is due a period (lease / 3) after the body starts,
    /// not after its first poll: a body whose first poll blocks for longer
    /// (synchronous work before its first await) is renewed as soon as it
    /// is pending. Otherwise a first poll longer than 2/3 of the lease lets
    /// the lease run out before the first renewal, and a duplicate takes
    /// the record over while the body still runs (it would run twice).
    /// Deterministic: the memory store answers at once, so one poll of the
    /// call reserves, runs the body's first poll, and renews if it is due.
    #[test]
    fn a_first_poll_longer_than_a_period_is_renewed_when_it_returns_pending() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let store = MemoryStore::new();
            let (go, wait) = tokio::sync::oneshot::channel::<()>();
            let c = Call {
                spec: &SLOW_FIRST_POLL,
                store: Ok(StoreRef::Borrowed(&store)),
                identity: Identity::new("tenant", SLOW_FIRST_POLL.scope, "k"),
                fingerprint: Ok(None),
            };
            let identity = Identity::new("tenant", SLOW_FIRST_POLL.scope, "k").expect("identity");
            let mut call = std::pin::pin!(execute::<Result<u32, Error>, _, _, _>(
                c,
                ReleaseErrors,
                NoRecover,
                async move {
                    // Synchronous work past a period (1 s of the 3 s lease).
                    std::thread::sleep(Duration::from_millis(1_200));
                    let _ = wait.await;
                    Ok(1)
                },
            ));
            // Poll the call, letting the runtime turn its timer between polls
            // (its clock stood still during the blocking first poll), until
            // the record shows the renewal. Without it, the first renewal
            // would come a whole period after the first poll (at 2.2 s):
            // these few turns take far less than that.
            let mut lease_left = 0;
            for _ in 0..100 {
                let polled = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
                assert!(polled.is_pending(), "the body waits for `go`");
                let record = store
                    .fetch(&identity)
                    .await
                    .expect("fetch")
                    .expect("record");
                lease_left = record.lease_expires_at_ms.expect("in progress") - record.now_ms;
                if lease_left > 2_500 {
                    break;
                }
                tokio::task::yield_now().await;
            }
            assert!(
                lease_left > 2_500,
                "renewed as soon as the body was pending: {lease_left} ms of the lease left"
            );
            let _ = go.send(());
            assert_eq!(call.await.expect("the call"), 1);
        });
    }

    #[test]
    fn owner_tokens_are_unique_hex_with_one_prefix_per_process() {
        let (a, b) = (OwnerToken::new(), OwnerToken::new());
        for t in [&a, &b] {
            assert_eq!(t.as_str().len(), 32);
            assert!(t
                .as_str()
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        }
        assert_ne!(a, b);
        assert_eq!(a.as_str()[..16], b.as_str()[..16]);
        let n = |t: &OwnerToken| u64::from_str_radix(&t.as_str()[16..], 16).expect("hex");
        assert!(n(&b) > n(&a));
    }

    /// A recorded error nested too deep for serde_json to write on the
    /// stack (a chain of options): refused as not faithful by the check,
    /// which runs before serde_json writes it. serde_json ran first, and its
    /// stack overflow aborted the process.
    #[test]
    fn a_recorded_error_too_deep_to_write_is_refused_before_it_is_written() {
        #[derive(Serialize, serde::Deserialize, Debug)]
        struct Deep(Option<Box<Deep>>);
        impl From<Error> for Deep {
            fn from(_: Error) -> Self {
                Deep(None)
            }
        }
        let answer = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                let deep = (0..100_000).fold(Deep(None), |d, _| Deep(Some(Box::new(d))));
                let result: Result<u32, Deep> = Err(deep);
                let answer =
                    outcome_to_record::<Result<u32, Deep>, _>(&SPEC, &result, &RecordErrors)
                        .map(|_| ());
                // Taken apart level by level: a recursive drop would overflow too.
                let Err(Deep(mut next)) = result else {
                    unreachable!()
                };
                while let Some(mut level) = next {
                    next = level.0.take();
                }
                answer
            })
            .expect("a thread")
            .join()
            .expect("no panic");
        assert!(
            matches!(&answer, Err(Error::ResultNotFaithful { message, .. }) if message.contains("nested more than")),
            "{answer:?}"
        );
    }

    #[tokio::test]
    async fn the_call_future_is_send_and_replays() {
        let store = MemoryStore::new();
        let first = assert_send(with_outcome(call(&store, "k", 21))).await;
        assert_eq!((first.0.unwrap(), first.1), (42, Some(Outcome::Executed)));
        let again = with_outcome(call(&store, "k", 21)).await;
        assert_eq!((again.0.unwrap(), again.1), (42, Some(Outcome::Replayed)));
        assert!(matches!(
            call(&store, "k", 22).await,
            Err(Error::FingerprintMismatch(_))
        ));
    }

    #[tokio::test]
    async fn missing_default_store_says_what_to_do() {
        let c = Call {
            spec: &SPEC,
            store: crate::__private::default_store(&SPEC),
            identity: Identity::new("t", SPEC.scope, "k"),
            fingerprint: Ok(None),
        };
        if default_store().is_none() {
            let r = execute::<Result<u32, Error>, _, _, _>(c, ReleaseErrors, NoRecover, async {
                Ok(1)
            })
            .await;
            let e = r.unwrap_err();
            assert!(matches!(e, Error::NoDefaultStore { .. }));
            assert!(e.to_string().contains("set_default_store"));
        }
    }
}
