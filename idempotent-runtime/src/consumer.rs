//! Message consumers: what to tell the broker about one delivery.
//!
//! A broker delivers a message at least once: after a lost ack, a consumer
//! crash, an `ack_wait` that ran out, or a producer that published twice. An
//! `#[idempotent]` handler keyed by the producer's message id runs once per
//! message however often it arrives; this module turns each answer of such a
//! handler into a [`Disposition`] (ack, nak with a delay, or term), without
//! any broker in sight, so the mapping is the same for every broker and can be
//! tested on its own. [`nats`] (feature `nats`) applies it to NATS JetStream.
//!
//! | the handler's answer | [`Verdict`] | [`Disposition`] |
//! |---|---|---|
//! | `Ok(_)`, the body ran | `Executed` | `Ack` |
//! | `Ok(_)` or a recorded `Err(_)`, replayed | `Replayed` | `Ack` (no second effect) |
//! | `Error::InProgress { retry_after }` | `InProgress` | `Nak(Some(retry_after))` |
//! | `Error::FingerprintMismatch` against a record still in progress (in [`handle`] and [`nats::process`], in store mode): another delivery holds it, perhaps of a consumer version whose arguments differ, and may yet release it | `InProgress` (its lease's remaining time) | `Nak(Some(retry_after))` |
//! | any other `Err(_)`: the body failed and the key was released, the store failed, the lease was lost | `Failed` | `Nak(None)`; knowing the delivery count (as [`nats::process`] does), `Nak(Some(`[`failed_retry_after`]`(n)))`: 1 s after the first delivery, doubling per delivery up to 60 s |
//! | `Error::ResultNotFaithful` / `ResultTooLarge` / `ResultEncoding`: the body ran, its result can never be recorded | `Unrecordable` | `Term` (a redelivery would run the body again); a body's `Err` that `errors = record` cannot record (in [`handle`] and [`nats::process`]) is released like any error not recorded: `Failed` |
//! | `Error::FingerprintMismatch` against a record left in progress by a delivery whose lease ran out (in [`handle`] and [`nats::process`], in store mode): that delivery's process stopped before it answered, and its redelivery may yet take the record over and finish it | `MismatchWithAbandonedRecord` | `Nak` (after as long as the record has been abandoned, 1 s to 60 s) until it has been abandoned for [`ABANDONED_RECORD_GRACE`], then `Term` |
//! | `Error::FingerprintMismatch`: same message id, different payload, its record complete | `Mismatch` | `Term` (poison) |
//! | `Error::Fingerprint`: the payload's arguments cannot be fingerprinted | `Unfingerprintable` | `Term` (every delivery fails alike); knowing the delivery count, nak'd like `Failed` until [`DELIVERIES_BEFORE_TERM`] |
//! | `Error::ReplayDecoding`: processed before, but the recorded answer no longer decodes as the handler's type | `ReplayUndecodable` | `Term` (naks would come back until the record expired, and then run the body again); knowing the delivery count, nak'd like `Failed` until [`DELIVERIES_BEFORE_TERM`], so a rolling deploy's other version can replay it |
//! | `Error::RecordedByNewerVersion`: a newer version of this crate made the record (a rolling deploy, a rollback), and it is complete | `RecordedByNewerVersion` | `Term`; knowing the delivery count, nak'd like `Failed` until [`DELIVERIES_BEFORE_TERM`], so the newer version can answer it (waiting here until the record expired would run the body again) |
//! | `Error::RecordedByNewerVersion` against a record still in progress, or left in progress (in [`handle`] and [`nats::process`], in store mode): the newer version is running the message, or its redelivery may take the record over | `InProgress` / `MismatchWithAbandonedRecord`, as for a mismatch | as for a mismatch: `Nak` while it runs; for an abandoned one, `Nak` until [`ABANDONED_RECORD_GRACE`], then `Term` |
//! | no key on the message | `MissingKey` | `Term`; the handler is not called |
//! | `Error::InvalidKey` / `Error::InvalidTenant` | `InvalidKey` | `Term` |
//!
//! Give consumer handlers `in_progress = reject`: a duplicate delivery that
//! finds the message still running is declined at once (and redelivered after
//! the running call's lease), instead of holding a worker while it waits.
//!
//! The scope names the *consumer* (`orders.consumer.billing`), never only the
//! stream: two consumers of one stream are two units of work, and each must
//! process every message once. Sharing one scope between them makes the second
//! one silently skip every message the first has seen.
//!
//! ```
//! use idempotent_runtime::consumer::{handle, Disposition, Verdict};
//! use idempotent_runtime::{idempotent, Error, MemoryStore};
//!
//! #[idempotent(scope = "docs.consumer.billing", key = key, tenant = shared, store = store,
//!              in_progress = reject)]
//! async fn bill(store: &MemoryStore, key: &str, payload: &[u8]) -> Result<usize, Error> {
//!     Ok(payload.len()) // the effect: written once per message id
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = MemoryStore::new();
//! let first = handle(Some("msg-1"), |key| bill(&store, key, b"order 1")).await;
//! let again = handle(Some("msg-1"), |key| bill(&store, key, b"order 1")).await;
//! let poison = handle(Some("msg-1"), |key| bill(&store, key, b"order 2")).await;
//! let no_key = handle(None, |key| bill(&store, key, b"order 3")).await;
//! assert_eq!((first.verdict, first.disposition()), (Verdict::Executed, Disposition::Ack));
//! assert_eq!((again.verdict, again.disposition()), (Verdict::Replayed, Disposition::Ack));
//! assert_eq!((poison.verdict, poison.disposition()), (Verdict::Mismatch, Disposition::Term));
//! assert_eq!((no_key.verdict, no_key.disposition()), (Verdict::MissingKey, Disposition::Term));
//! # }
//! ```
//!
//! A recorded error (`errors = record`) is the final answer for its key: its
//! replay is acked. Its *first* execution cannot be told apart from a released
//! error, so it is nak'd once; the redelivery replays it and is acked.
//!
//! The handler's idempotent call reports how it was answered to the task
//! that runs [`handle`]. A call spawned onto another task (`tokio::spawn`)
//! must be wrapped in [`carry_outcome`](crate::carry_outcome), or its
//! replayed recorded error looks like a failure and is nak'd at every
//! delivery, a result that can never be recorded is nak'd (and its body run
//! again at every delivery) instead of terminated, and a mismatch with a
//! record still running elsewhere is terminated at once; await the task, so
//! the message is settled after the call:
//!
//! ```ignore
//! let handled = handle(Some(id), |key| {
//!     let (store, key) = (store.clone(), key.to_owned());
//!     let task = tokio::spawn(carry_outcome(async move { bill(&store, &key).await }));
//!     async move { task.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())) }
//! })
//! .await;
//! ```

use crate::engine::{with_settled_report, LastMismatch, Outcome, Reported};
use crate::error::Error;
use std::future::Future;
use std::time::Duration;

#[cfg(feature = "nats")]
pub mod nats;

/// What to tell the broker about one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// The message is done (its body ran now, or before): acknowledge it. A
    /// redelivery would only replay the recorded answer.
    Ack,
    /// Not done: deliver it again, after the delay when one is given (`None`:
    /// the broker's own redelivery timing).
    Nak(Option<Duration>),
    /// The message can never be processed as sent (no key, an invalid key,
    /// the same key with a different payload, a payload that cannot be
    /// fingerprinted, a result that can never be recorded, or a recorded
    /// answer that no longer decodes): stop delivering it. Log it.
    Term,
}

impl std::fmt::Display for Disposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Disposition::Ack => f.write_str("ack"),
            Disposition::Nak(None) => f.write_str("nak"),
            Disposition::Nak(Some(d)) => write!(f, "nak({}ms)", d.as_millis()),
            Disposition::Term => f.write_str("term"),
        }
    }
}

/// How one delivery was answered; decides its [`Disposition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The body ran in this delivery (or, on a takeover, its `recover` hook
    /// answered for it with `Recovery::Completed`) and the handler returned `Ok`.
    Executed,
    /// The recorded answer was replayed (a duplicate or a redelivery); the body did not run.
    Replayed,
    /// Another delivery of the same message is running it (`Error::InProgress`;
    /// in [`handle`] and [`nats::process`] also an `Error::FingerprintMismatch`
    /// with a record still in progress: another version of the handler may
    /// be running the message with arguments it fingerprints otherwise, and
    /// may yet release the key).
    InProgress {
        /// When the running call's lease runs out: when to try again.
        retry_after: Duration,
    },
    /// Not done: the body failed and the key was released, or the store
    /// failed (also while reading the record of a fingerprint mismatch, to
    /// tell a running one from a finished one), or the lease was lost. A
    /// redelivery tries again.
    Failed,
    /// Same message id, different payload (`Error::FingerprintMismatch`): a
    /// poison message. The record is untouched. (A mismatch with a record
    /// still in progress is [`InProgress`](Self::InProgress) in [`handle`],
    /// one with a record abandoned in progress
    /// [`MismatchWithAbandonedRecord`](Self::MismatchWithAbandonedRecord).)
    Mismatch,
    /// Same message id, other arguments (`Error::FingerprintMismatch`), and
    /// the record is another delivery's that was left in progress: its lease
    /// ran out before it answered (its process crashed or was killed). The
    /// message that made it may still be redelivered to a consumer that
    /// takes the record over and finishes it, e.g. the older version in a
    /// rolling deploy that changed the handler's arguments, and terminating
    /// this delivery at once could lose that message. So, in [`handle`] and
    /// [`nats::process`] (store mode): nak'd until the record has been
    /// abandoned for [`ABANDONED_RECORD_GRACE`], counted from when its lease
    /// ran out (the deliveries spent while its owner was still alive, such
    /// as in-progress naks or an `ack_wait` shorter than the body, take
    /// nothing from it), and, when the delivery count is known
    /// ([`Handled::disposition`]), the message has been delivered
    /// [`DELIVERIES_BEFORE_TERM`] times (a redelivery may come long after
    /// the lease ran out); then terminated as a [`Mismatch`](Self::Mismatch).
    MismatchWithAbandonedRecord {
        /// How long ago the record's lease ran out (the store's clock).
        abandoned_for: Duration,
    },
    /// The message carries no key, so it is never processed.
    MissingKey,
    /// The key or the tenant was refused (`Error::InvalidKey` / `InvalidTenant`).
    InvalidKey,
    /// The body ran, but its result can never be recorded
    /// (`Error::ResultNotFaithful`, `ResultTooLarge`, `ResultEncoding`): the
    /// key was released, so every redelivery would run the body again. The
    /// message is terminated; fix the handler's result type. (In [`handle`]
    /// and [`nats::process`], a body's `Err` that `errors = record` cannot
    /// record, such as a nested call's `InProgress` kept in a
    /// `#[serde(skip)]` variant, is released like any error not recorded:
    /// [`Failed`](Self::Failed), redelivered.)
    Unrecordable,
    /// The handler's arguments could not be fingerprinted
    /// (`Error::Fingerprint`, e.g. a raw JSON payload with a repeated member):
    /// every delivery of this payload fails alike, and the body never ran. The
    /// message is terminated, after a few deliveries when their count is
    /// known ([`Handled::disposition`]: nak'd like [`Verdict::Failed`] until
    /// [`DELIVERIES_BEFORE_TERM`]).
    Unfingerprintable,
    /// The message was processed before, but its recorded answer no longer
    /// decodes as the handler's result or error (`Error::ReplayDecoding`: the
    /// type or the error policy changed while records of the old one last).
    /// The body does not run again while the record lasts, so a redelivery
    /// to this version can never succeed, and once the record expired it
    /// would run the body a second time. The message is terminated (not
    /// acked: steps of the handler after the call did not run), after a few
    /// deliveries when their count is known ([`Handled::disposition`]: nak'd
    /// like [`Verdict::Failed`] until [`DELIVERIES_BEFORE_TERM`]). Make
    /// the new type read what the old one recorded (`#[serde(default)]`,
    /// `#[serde(alias)]`, an untagged enum of both); a new scope would run
    /// the body again for messages redelivered after the switch.
    ReplayUndecodable,
    /// The message's record was made by a newer version of this crate, whose
    /// fingerprint this version cannot compare (`Error::RecordedByNewerVersion`:
    /// a rolling deploy, a rollback). Nothing ran. A redelivery that reaches
    /// the newer version is answered there; one that waits here until the
    /// record expires would run the body a second time. So, like
    /// [`ReplayUndecodable`](Self::ReplayUndecodable): nak'd like
    /// [`Verdict::Failed`] until [`DELIVERIES_BEFORE_TERM`] when the delivery
    /// count is known, then terminated. (In [`handle`] and [`nats::process`],
    /// in store mode, a newer version's record still in progress is
    /// [`InProgress`](Self::InProgress) and one abandoned in progress
    /// [`MismatchWithAbandonedRecord`](Self::MismatchWithAbandonedRecord), as
    /// for a mismatch: the newer version holds the message, and terminating
    /// it here would lose it if that version's body then failed.)
    RecordedByNewerVersion,
}

/// How long a [`Verdict::Failed`] delivery waits before it is redelivered,
/// after `deliveries` deliveries of the message (1 for the first): 1 s,
/// doubling per delivery, at most 60 s. A failure that lasts (a store down,
/// a bug in the handler) is then tried again at a bounded pace instead of
/// in a tight loop.
///
/// ```
/// use idempotent_runtime::consumer::failed_retry_after;
/// use std::time::Duration;
/// assert_eq!(failed_retry_after(1), Duration::from_secs(1));
/// assert_eq!(failed_retry_after(3), Duration::from_secs(4));
/// assert_eq!(failed_retry_after(40), Duration::from_secs(60));
/// ```
pub fn failed_retry_after(deliveries: u64) -> Duration {
    const FIRST: Duration = Duration::from_secs(1);
    const MOST: Duration = Duration::from_secs(60);
    let doublings = deliveries.saturating_sub(1).min(16) as u32;
    FIRST.saturating_mul(1 << doublings).min(MOST)
}

/// How many deliveries a message whose every delivery has failed alike
/// ([`Verdict::Unfingerprintable`], [`Verdict::ReplayUndecodable`],
/// [`Verdict::RecordedByNewerVersion`]) gets before it is terminated, when
/// the delivery count is known ([`Handled::disposition`]): with the pauses
/// of [`failed_retry_after`] in between, about four minutes.
pub const DELIVERIES_BEFORE_TERM: u64 = 10;

/// How long after a record's lease ran out a mismatch against it
/// ([`Verdict::MismatchWithAbandonedRecord`]) is still nak'd rather than
/// terminated: four minutes, about as long as [`DELIVERIES_BEFORE_TERM`]
/// deliveries take, for the message's own redelivery to reach a consumer
/// that takes the record over.
pub const ABANDONED_RECORD_GRACE: Duration = Duration::from_secs(240);

/// How long a delivery refused by a record abandoned `abandoned_for` ago
/// waits before it is redelivered: as long again, 1 s to 60 s.
fn abandoned_retry_after(abandoned_for: Duration) -> Duration {
    abandoned_for.clamp(Duration::from_secs(1), Duration::from_secs(60))
}

impl Verdict {
    /// What to tell the broker.
    pub fn disposition(self) -> Disposition {
        match self {
            Verdict::Executed | Verdict::Replayed => Disposition::Ack,
            Verdict::InProgress { retry_after } => Disposition::Nak(Some(retry_after)),
            Verdict::Failed => Disposition::Nak(None),
            // Looked at again after as long as it has been abandoned (1 s to
            // a minute), until the grace is over.
            Verdict::MismatchWithAbandonedRecord { abandoned_for }
                if abandoned_for < ABANDONED_RECORD_GRACE =>
            {
                Disposition::Nak(Some(abandoned_retry_after(abandoned_for)))
            }
            Verdict::Mismatch
            | Verdict::MismatchWithAbandonedRecord { .. }
            | Verdict::MissingKey
            | Verdict::InvalidKey
            | Verdict::Unrecordable
            | Verdict::Unfingerprintable
            | Verdict::ReplayUndecodable
            | Verdict::RecordedByNewerVersion => Disposition::Term,
        }
    }

    /// A short lowercase name: `executed`, `replayed`, `in-progress`, `failed`,
    /// `mismatch`, `mismatch-with-abandoned-record`, `missing-key`,
    /// `invalid-key`, `unrecordable`,
    /// `unfingerprintable`, `replay-undecodable`, `recorded-by-newer-version`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Executed => "executed",
            Verdict::Replayed => "replayed",
            Verdict::InProgress { .. } => "in-progress",
            Verdict::Failed => "failed",
            Verdict::Mismatch => "mismatch",
            Verdict::MismatchWithAbandonedRecord { .. } => "mismatch-with-abandoned-record",
            Verdict::MissingKey => "missing-key",
            Verdict::InvalidKey => "invalid-key",
            Verdict::Unrecordable => "unrecordable",
            Verdict::Unfingerprintable => "unfingerprintable",
            Verdict::ReplayUndecodable => "replay-undecodable",
            Verdict::RecordedByNewerVersion => "recorded-by-newer-version",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Finds the framework's [`Error`] inside a handler's error type, so a
/// refusal (in progress, mismatch, bad key) can be told from the body's own
/// failures. Implemented for [`Error`], `std::io::Error` and boxed errors
/// (these two look along the error's `source()` chain, so a refusal wrapped
/// in context is found too); for your own error enum it is one match arm:
///
/// ```
/// use idempotent_runtime::{consumer::AsIdempotencyError, Error};
///
/// #[derive(Debug, thiserror::Error)]
/// enum BillingError {
///     #[error("ledger unavailable")]
///     Ledger,
///     #[error(transparent)]
///     Idempotency(#[from] Error),
/// }
///
/// impl AsIdempotencyError for BillingError {
///     fn as_idempotency_error(&self) -> Option<&Error> {
///         match self {
///             BillingError::Idempotency(e) => Some(e),
///             _ => None,
///         }
///     }
/// }
/// ```
pub trait AsIdempotencyError {
    /// The framework's error, when this is one.
    fn as_idempotency_error(&self) -> Option<&Error>;
}

impl AsIdempotencyError for Error {
    fn as_idempotency_error(&self) -> Option<&Error> {
        Some(self)
    }
}

/// How many errors deep [`in_sources`] looks: far more than any real chain,
/// and a bound for a `source()` that returns its own error.
const MOST_SOURCES: usize = 32;

/// The framework's [`Error`]: `error` itself, or the first of its
/// `source()`s that is one (context a handler wrapped around it, such as
/// an error of its own whose `thiserror` `#[source]` field holds it).
/// Without the look through the sources, a wrapped refusal was taken for the
/// handler's own failure: a result that can never be recorded was nak'd and
/// its body run again at every delivery, a reused id nak'd forever.
fn in_sources<'e>(error: &'e (dyn std::error::Error + 'static)) -> Option<&'e Error> {
    std::iter::successors(Some(error), |e| next_source(*e))
        .take(MOST_SOURCES)
        .find_map(|e| e.downcast_ref::<Error>())
}

/// The error `error` wraps: its `source()`, or, for an `io::Error` made
/// from another error (`io::Error::other(e)`), that error (`io::Error`'s
/// `source()` skips it and answers `e.source()`).
fn next_source<'e>(
    error: &'e (dyn std::error::Error + 'static),
) -> Option<&'e (dyn std::error::Error + 'static)> {
    match error.downcast_ref::<std::io::Error>() {
        Some(io) => io
            .get_ref()
            .map(|inner| inner as &(dyn std::error::Error + 'static)),
        None => error.source(),
    }
}

impl AsIdempotencyError for std::io::Error {
    fn as_idempotency_error(&self) -> Option<&Error> {
        in_sources(self.get_ref()?)
    }
}

impl AsIdempotencyError for Box<dyn std::error::Error + Send + Sync + 'static> {
    fn as_idempotency_error(&self) -> Option<&Error> {
        in_sources(self.as_ref())
    }
}

impl AsIdempotencyError for Box<dyn std::error::Error + 'static> {
    fn as_idempotency_error(&self) -> Option<&Error> {
        in_sources(self.as_ref())
    }
}

/// The verdict on a handler's answer: its result and the [`Outcome`] that
/// [`with_outcome`](crate::with_outcome) reported for it.
///
/// A refusal by the framework (in progress, mismatch, bad key, arguments that
/// cannot be fingerprinted, a recorded answer that no longer decodes) decides first,
/// and any other error of the framework's own is `Failed` (redelivered); then
/// a replay (of a result, or of a recorded error) is `Replayed`; then
/// `Ok` is `Executed` (also when the handler made no idempotent call at all)
/// and any other `Err` is `Failed`.
///
/// An [`Outcome`] alone does not say whether a replay was of a result or of
/// a recorded error, so here an `Err` of the handler's own after a replay is
/// taken for the replayed recorded error (`Replayed`). [`handle`] knows which
/// it was: there an `Err` after a replayed *result* (a later step of the
/// handler failed) is `Failed` and the message is redelivered. Prefer
/// [`handle`] for handlers of more than one step. Nor does it say whether
/// an answer that could not be recorded was a result or the body's error:
/// here it is `Unrecordable` either way, while [`handle`] redelivers an
/// error (`Failed`).
pub fn classify<T, E: AsIdempotencyError>(
    result: &Result<T, E>,
    outcome: Option<Outcome>,
) -> Verdict {
    verdict(
        result,
        outcome.map(|outcome| Reported {
            outcome: Some(outcome),
            replayed_error: result.is_err(),
            // Not known here: an unrecordable answer is taken for a result.
            unrecordable_result: true,
            last_mismatch: None,
        }),
    )
}

/// [`classify`], knowing whether the replay was of a recorded error.
fn verdict<T, E: AsIdempotencyError>(result: &Result<T, E>, reported: Option<Reported>) -> Verdict {
    let replayed = reported.is_some_and(|r| r.outcome == Some(Outcome::Replayed));
    let error = match result {
        Ok(_) if replayed => return Verdict::Replayed,
        Ok(_) => return Verdict::Executed,
        Err(e) => e,
    };
    match error.as_idempotency_error() {
        Some(Error::InProgress { retry_after, .. }) => Verdict::InProgress {
            retry_after: *retry_after,
        },
        // The record is another call's, still running: in a rolling deploy
        // that changed the handler's arguments, the other version's delivery
        // of this very message, which may yet fail and release the key.
        // An abandoned one: the delivery that made it may yet take it over.
        Some(Error::FingerprintMismatch(_)) => match reported.and_then(|r| r.last_mismatch) {
            Some(LastMismatch::Running { lease_remaining }) => Verdict::InProgress {
                retry_after: lease_remaining,
            },
            Some(LastMismatch::Abandoned { abandoned_for }) => {
                Verdict::MismatchWithAbandonedRecord { abandoned_for }
            }
            // What refused it could not be read (the store failed): a
            // record still running may yet be released, so the message is
            // not a poison one yet; a redelivery looks again.
            Some(LastMismatch::Unread) => Verdict::Failed,
            Some(LastMismatch::Final) | None => Verdict::Mismatch,
        },
        Some(Error::InvalidKey(_) | Error::InvalidTenant(_)) => Verdict::InvalidKey,
        Some(Error::Fingerprint { .. }) => Verdict::Unfingerprintable,
        Some(Error::ReplayDecoding { .. }) => Verdict::ReplayUndecodable,
        // A newer version's record still running, or abandoned: as for a
        // record of other arguments. That version holds the message and may
        // yet release the key (its body failing), or its redelivery to a
        // newer instance may take the record over; terminated at once here
        // (its deliveries spent while it ran counted), the message was lost.
        Some(Error::RecordedByNewerVersion { .. }) => {
            match reported.and_then(|r| r.last_mismatch) {
                Some(LastMismatch::Running { lease_remaining }) => Verdict::InProgress {
                    retry_after: lease_remaining,
                },
                Some(LastMismatch::Abandoned { abandoned_for }) => {
                    Verdict::MismatchWithAbandonedRecord { abandoned_for }
                }
                _ => Verdict::RecordedByNewerVersion,
            }
        }
        // Only the body's own result: a recover hook's answer that cannot be
        // recorded leaves the record for the next delivery to ask again, and
        // a body's `Err` that `errors = record` cannot record is released
        // like any error not recorded (often a refusal for now, such as a
        // nested call's `InProgress`, kept in a `#[serde(skip)]` variant):
        // terminated, its message was never processed.
        Some(e)
            if e.answer_can_never_be_recorded()
                && reported.is_some_and(|r| {
                    r.outcome == Some(Outcome::Executed) && r.unrecordable_result
                }) =>
        {
            Verdict::Unrecordable
        }
        // The framework's own error (a store down, a lease lost...) is never a
        // recorded answer, even after an earlier step replayed: that step's
        // outcome says nothing of the step that failed, which has not run.
        Some(_) => Verdict::Failed,
        // The handler's own error after a replay is a recorded answer only
        // when a recorded error was among the replays; after replays of
        // results only it is a later step's failure, which has to run again.
        None if replayed && reported.is_some_and(|r| r.replayed_error) => Verdict::Replayed,
        None => Verdict::Failed,
    }
}

/// One delivery, handled: the verdict and, when the handler was called, its result.
#[derive(Debug)]
pub struct Handled<T, E> {
    /// How the delivery was answered.
    pub verdict: Verdict,
    /// The handler's result; `None` when it was not called (no key).
    pub result: Option<Result<T, E>>,
    /// How many times the broker has delivered the message, this delivery
    /// included, when the broker says ([`nats::process`] does).
    deliveries: Option<u64>,
}

impl<T, E> Handled<T, E> {
    /// The same delivery, knowing how many times the broker has delivered
    /// the message, this delivery included, counting from 1 (add 1 to a
    /// broker's count of *re*deliveries; [`nats::process`] sets it from the
    /// message): [`disposition`](Self::disposition) then delays the naks
    /// of failures and terminates messages that fail alike only after
    /// [`DELIVERIES_BEFORE_TERM`]. For brokers other than NATS that say.
    ///
    /// ```
    /// use idempotent_runtime::consumer::{handle, Disposition, DELIVERIES_BEFORE_TERM};
    /// use idempotent_runtime::Error;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let failed = handle(Some("msg-1"), |_key| async { Err::<(), _>(std::io::Error::other("down")) }).await;
    /// let third = failed.with_deliveries(3);
    /// assert_eq!(third.disposition(), Disposition::Nak(Some(std::time::Duration::from_secs(4))));
    /// # let _ = (DELIVERIES_BEFORE_TERM, None::<Error>);
    /// # }
    /// ```
    pub fn with_deliveries(mut self, deliveries: u64) -> Self {
        self.deliveries = Some(deliveries);
        self
    }

    /// What to tell the broker: the verdict's [`Disposition`], and when the
    /// delivery count is known:
    /// * for a [`Verdict::Failed`] delivery, a nak delayed by
    ///   [`failed_retry_after`], so a failure that lasts (a store down, a bug
    ///   in the handler) is not redelivered in a tight loop;
    /// * for [`Verdict::Unfingerprintable`], [`Verdict::ReplayUndecodable`]
    ///   and [`Verdict::RecordedByNewerVersion`],
    ///   the same delayed nak until the message has been delivered
    ///   [`DELIVERIES_BEFORE_TERM`] times, and `Term` then: during a rolling
    ///   deploy that changes a result type, an instance of the old version
    ///   cannot decode what the new one recorded, and the redelivery reaches
    ///   a new one; a fingerprint that failed for a passing reason (a poisoned
    ///   lock in an argument) is tried again.
    pub fn disposition(&self) -> Disposition {
        match (self.verdict, self.deliveries) {
            (Verdict::Failed, Some(deliveries)) => {
                Disposition::Nak(Some(failed_retry_after(deliveries)))
            }
            (
                Verdict::Unfingerprintable
                | Verdict::ReplayUndecodable
                | Verdict::RecordedByNewerVersion,
                Some(deliveries),
            ) if deliveries < DELIVERIES_BEFORE_TERM => {
                Disposition::Nak(Some(failed_retry_after(deliveries)))
            }
            // Also before its first deliveries since it was abandoned: a
            // redelivery may come long after (an `ack_wait` of minutes,
            // consumers that were all down).
            (Verdict::MismatchWithAbandonedRecord { abandoned_for }, Some(deliveries))
                if deliveries < DELIVERIES_BEFORE_TERM =>
            {
                Disposition::Nak(Some(abandoned_retry_after(abandoned_for)))
            }
            _ => self.verdict.disposition(),
        }
    }

    /// The framework's error behind the verdict, if any (for logs: it names
    /// the scope and a digest of the key, never the key).
    pub fn idempotency_error(&self) -> Option<&Error>
    where
        E: AsIdempotencyError,
    {
        self.result.as_ref()?.as_ref().err()?.as_idempotency_error()
    }
}

/// Handles one delivery: without a key the handler is not called
/// ([`Verdict::MissingKey`]); otherwise `handler(key)` runs inside
/// [`with_outcome`](crate::with_outcome) and its answer is [`classify`]'d, knowing whether the
/// handler's replays were of results only or included a recorded error: an
/// `Err` of the handler's own when the last idempotent call replayed is that
/// recorded answer (`Replayed`, acked) if a recorded error was replayed, and
/// otherwise a later step's failure (`Failed`, redelivered). (A handler that
/// swallows a replayed recorded error and then fails a step of its own is
/// taken for the recorded answer: return the error you replayed, or handle
/// it without an `Err`.) A `handle` nested in the handler (one message
/// carrying items of their own keys) settles its own calls: a recorded error
/// replayed there is that item's answer, and an `Err` the handler returns
/// after it is `Failed`; the rest of what the nested calls reported (the
/// record of a mismatch, a result that could not be recorded) still counts
/// here. The handler is
/// typically a closure calling an `#[idempotent]` function with
/// `key = key`; in transactional mode it also commits. This function does not
/// log; [`nats::process`] does.
pub async fn handle<'k, F, Fut, T, E>(key: Option<&'k str>, handler: F) -> Handled<T, E>
where
    F: FnOnce(&'k str) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: AsIdempotencyError,
{
    let Some(key) = key else {
        return Handled {
            verdict: Verdict::MissingKey,
            result: None,
            deliveries: None,
        };
    };
    // The handler is called inside the scope, so a `carry_outcome` it calls
    // before it returns its future finds the scope too.
    let (result, reported) = with_settled_report(async move { handler(key).await }).await;
    Handled {
        verdict: verdict(&result, reported),
        result: Some(result),
        deliveries: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{KeyProblem, RecordContext, StoreError};

    fn ctx() -> RecordContext {
        RecordContext {
            scope: "orders.consumer.billing".into(),
            key_digest: "0123456789abcdef".into(),
        }
    }

    fn err(e: Error) -> Result<(), Error> {
        Err(e)
    }

    #[test]
    fn complete_answers_are_acked() {
        assert_eq!(
            classify(&Ok::<_, Error>(1), Some(Outcome::Executed)),
            Verdict::Executed
        );
        assert_eq!(
            classify(&Ok::<_, Error>(1), Some(Outcome::Replayed)),
            Verdict::Replayed
        );
        assert_eq!(classify(&Ok::<_, Error>(1), None), Verdict::Executed);
        for v in [Verdict::Executed, Verdict::Replayed] {
            assert_eq!(v.disposition(), Disposition::Ack);
        }
    }

    #[test]
    fn a_replayed_recorded_error_is_acked_a_fresh_error_is_nakd() {
        let e: Result<(), std::io::Error> = Err(std::io::Error::other("declined"));
        assert_eq!(
            classify(&e, Some(Outcome::Replayed)).disposition(),
            Disposition::Ack
        );
        assert_eq!(
            classify(&e, Some(Outcome::Executed)).disposition(),
            Disposition::Nak(None)
        );
    }

    #[test]
    fn in_progress_is_nakd_with_its_retry_after() {
        let r = err(Error::InProgress {
            scope: "orders.consumer.billing".into(),
            retry_after: Duration::from_millis(1500),
        });
        let v = classify(&r, None);
        assert_eq!(
            v,
            Verdict::InProgress {
                retry_after: Duration::from_millis(1500)
            }
        );
        assert_eq!(
            v.disposition(),
            Disposition::Nak(Some(Duration::from_millis(1500)))
        );
    }

    #[test]
    fn a_mismatch_is_poison() {
        let v = classify(&err(Error::FingerprintMismatch(ctx())), None);
        assert_eq!((v, v.disposition()), (Verdict::Mismatch, Disposition::Term));
    }

    /// What refused a mismatch decides: a running record naks until its
    /// lease ends, an abandoned one naks for a grace counted from when it
    /// was abandoned, a complete one is poison at once.
    #[test]
    fn a_mismatch_is_judged_by_the_record_that_refused_it() {
        let refused_by = |m| {
            verdict(
                &err(Error::FingerprintMismatch(ctx())),
                Some(Reported {
                    outcome: None,
                    replayed_error: false,
                    unrecordable_result: false,
                    last_mismatch: Some(m),
                }),
            )
        };
        let lease_remaining = Duration::from_secs(3);
        assert_eq!(
            refused_by(LastMismatch::Running { lease_remaining }),
            Verdict::InProgress {
                retry_after: lease_remaining
            }
        );
        let abandoned_for = Duration::from_secs(2);
        assert_eq!(
            refused_by(LastMismatch::Abandoned { abandoned_for }),
            Verdict::MismatchWithAbandonedRecord { abandoned_for }
        );
        assert_eq!(refused_by(LastMismatch::Final), Verdict::Mismatch);
        // Hunt: a store failure while reading the record made it a poison
        // message, terminated, though the record was still running.
        assert_eq!(refused_by(LastMismatch::Unread), Verdict::Failed);
        assert_eq!(
            Verdict::MismatchWithAbandonedRecord { abandoned_for }.as_str(),
            "mismatch-with-abandoned-record"
        );
    }

    /// A newer version's record is judged like a mismatch's: running, nak'd
    /// until its lease ends; abandoned, nak'd for the grace; complete (or
    /// not read), the newer version's verdict (nak'd a few times, then term).
    #[test]
    fn a_newer_versions_record_is_judged_by_what_it_is() {
        let refused_by = |m: Option<LastMismatch>| {
            verdict(
                &err(Error::RecordedByNewerVersion {
                    context: ctx(),
                    version: "v9".into(),
                }),
                Some(Reported {
                    outcome: None,
                    replayed_error: false,
                    unrecordable_result: false,
                    last_mismatch: m,
                }),
            )
        };
        let lease_remaining = Duration::from_secs(3);
        assert_eq!(
            refused_by(Some(LastMismatch::Running { lease_remaining })),
            Verdict::InProgress {
                retry_after: lease_remaining
            }
        );
        let abandoned_for = Duration::from_secs(2);
        assert_eq!(
            refused_by(Some(LastMismatch::Abandoned { abandoned_for })),
            Verdict::MismatchWithAbandonedRecord { abandoned_for }
        );
        for m in [Some(LastMismatch::Final), None] {
            assert_eq!(refused_by(m), Verdict::RecordedByNewerVersion);
        }
    }

    /// A mismatch with an abandoned record is nak'd until the record has
    /// been abandoned for the grace, whatever the delivery count: the
    /// deliveries spent while its owner was alive (in-progress naks, a body
    /// longer than `ack_wait`) must not use the grace up before it starts.
    #[test]
    fn an_abandoned_records_grace_runs_from_when_it_was_abandoned() {
        let handled = |secs: u64, deliveries: Option<u64>| Handled::<(), Error> {
            verdict: Verdict::MismatchWithAbandonedRecord {
                abandoned_for: Duration::from_secs(secs),
            },
            result: None,
            deliveries,
        };
        for deliveries in [None, Some(1), Some(DELIVERIES_BEFORE_TERM + 5)] {
            assert_eq!(
                handled(0, deliveries).disposition(),
                Disposition::Nak(Some(Duration::from_secs(1)))
            );
            assert_eq!(
                handled(30, deliveries).disposition(),
                Disposition::Nak(Some(Duration::from_secs(30)))
            );
            assert_eq!(
                handled(200, deliveries).disposition(),
                Disposition::Nak(Some(Duration::from_secs(60)))
            );
        }
        // Terminated once abandoned for the grace and, when the count is
        // known, delivered that many times: a first redelivery long after
        // the lease ran out is still nak'd.
        let grace = ABANDONED_RECORD_GRACE.as_secs();
        assert_eq!(handled(grace, None).disposition(), Disposition::Term);
        assert_eq!(
            handled(grace, Some(DELIVERIES_BEFORE_TERM)).disposition(),
            Disposition::Term
        );
        assert_eq!(
            handled(grace + 600, Some(1)).disposition(),
            Disposition::Nak(Some(Duration::from_secs(60)))
        );
    }

    #[test]
    fn bad_keys_are_poison() {
        for e in [
            Error::InvalidKey(KeyProblem::Empty),
            Error::InvalidTenant(KeyProblem::TooLong {
                len: 300,
                limit: 255,
            }),
        ] {
            let v = classify(&err(e), None);
            assert_eq!(
                (v, v.disposition()),
                (Verdict::InvalidKey, Disposition::Term)
            );
        }
    }

    #[test]
    fn released_and_store_errors_are_nakd() {
        for e in [
            Error::Store(StoreError::new("postgres", "reserve", "connection refused")),
            Error::LeaseLost(ctx()),
            Error::NoDefaultStore {
                scope: "a.b".into(),
            },
        ] {
            assert_eq!(
                classify(&err(e), Some(Outcome::Executed)).disposition(),
                Disposition::Nak(None)
            );
        }
        // A record a newer version made (a rolling deploy): nothing ran, and
        // a redelivery may reach the newer version; not a hot loop of naks
        // (the tests of `Handled::disposition` have the delivery counts).
        let newer = Error::RecordedByNewerVersion {
            context: ctx(),
            version: "v9".into(),
        };
        let v = classify(&err(newer), None);
        assert_eq!(
            (v, v.disposition()),
            (Verdict::RecordedByNewerVersion, Disposition::Term)
        );
        // The body's own error, released (it is not a framework error at all).
        let own: Result<(), std::io::Error> = Err(std::io::Error::other("ledger down"));
        assert_eq!(classify(&own, Some(Outcome::Executed)), Verdict::Failed);
    }

    /// A result that can never be recorded: the body ran and the key was
    /// released, so a redelivery would run it again, and again.
    #[test]
    fn an_unrecordable_result_is_poison() {
        let unrecordable = || {
            [
                Error::ResultNotFaithful {
                    scope: "a.b".into(),
                    message: "NaN".into(),
                },
                Error::ResultTooLarge {
                    scope: "a.b".into(),
                    size: 9 << 20,
                    limit: 8 << 20,
                },
                Error::ResultEncoding {
                    scope: "a.b".into(),
                    message: "a map key that is not a string".into(),
                },
            ]
        };
        for e in unrecordable() {
            let v = classify(&err(e), Some(Outcome::Executed));
            assert_eq!(
                (v, v.disposition()),
                (Verdict::Unrecordable, Disposition::Term)
            );
        }
        // A recover hook's answer: the body did not run, and the record is
        // kept for the next delivery to ask the hook again.
        for e in unrecordable() {
            assert_eq!(classify(&err(e), Some(Outcome::Recovered)), Verdict::Failed);
        }
        // The body's `Err` that `errors = record` could not record: released
        // like any error not recorded, so the message comes again.
        for e in unrecordable() {
            let by_an_error = Reported {
                outcome: Some(Outcome::Executed),
                replayed_error: false,
                unrecordable_result: false,
                last_mismatch: None,
            };
            assert_eq!(verdict(&err(e), Some(by_an_error)), Verdict::Failed);
        }
    }

    /// Failures that every delivery of the message would meet alike: the
    /// arguments cannot be fingerprinted, or the message was processed and
    /// its recorded answer no longer decodes (also after an earlier step of
    /// the handler replayed).
    #[test]
    fn unfingerprintable_arguments_and_undecodable_replays_are_poison() {
        let fingerprint = || Error::Fingerprint {
            argument: "payload".into(),
            message: "a repeated member".into(),
        };
        let decoding = || Error::ReplayDecoding {
            scope: "a.b".into(),
            message: "invalid type: integer, expected a struct".into(),
        };
        for outcome in [None, Some(Outcome::Replayed)] {
            let v = classify(&err(fingerprint()), outcome);
            assert_eq!(
                (v, v.disposition()),
                (Verdict::Unfingerprintable, Disposition::Term)
            );
            let v = classify(&err(decoding()), outcome);
            assert_eq!(
                (v, v.disposition()),
                (Verdict::ReplayUndecodable, Disposition::Term)
            );
        }
        assert_eq!(Verdict::Unfingerprintable.as_str(), "unfingerprintable");
        assert_eq!(Verdict::ReplayUndecodable.as_str(), "replay-undecodable");
    }

    /// Knowing the delivery count, a failed delivery is redelivered after a
    /// pause that grows, never in a tight loop.
    #[test]
    fn a_failed_delivery_with_its_count_is_nakd_with_a_growing_delay() {
        let failed = |deliveries| Handled::<(), std::io::Error> {
            verdict: Verdict::Failed,
            result: None,
            deliveries,
        };
        assert_eq!(failed(None).disposition(), Disposition::Nak(None));
        assert_eq!(
            failed(Some(1)).disposition(),
            Disposition::Nak(Some(Duration::from_secs(1)))
        );
        assert_eq!(
            failed(Some(4)).disposition(),
            Disposition::Nak(Some(Duration::from_secs(8)))
        );
    }

    /// A message that failed alike at every delivery is nak'd like a failure
    /// for its first deliveries (a rolling deploy's other version may
    /// replay it), and terminated at the `DELIVERIES_BEFORE_TERM`th.
    #[test]
    fn poison_that_fails_alike_is_terminated_after_a_few_deliveries() {
        for verdict in [
            Verdict::Unfingerprintable,
            Verdict::ReplayUndecodable,
            Verdict::RecordedByNewerVersion,
        ] {
            let delivered = |deliveries| Handled::<(), std::io::Error> {
                verdict,
                result: None,
                deliveries,
            };
            assert_eq!(
                delivered(Some(1)).disposition(),
                Disposition::Nak(Some(Duration::from_secs(1)))
            );
            assert_eq!(
                delivered(Some(DELIVERIES_BEFORE_TERM - 1)).disposition(),
                Disposition::Nak(Some(failed_retry_after(DELIVERIES_BEFORE_TERM - 1)))
            );
            assert_eq!(
                delivered(Some(DELIVERIES_BEFORE_TERM)).disposition(),
                Disposition::Term
            );
            assert_eq!(delivered(None).disposition(), Disposition::Term);
        }
    }

    #[test]
    fn a_failing_message_waits_longer_at_every_delivery() {
        let pauses: Vec<u64> = (1..=8).map(|n| failed_retry_after(n).as_secs()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(failed_retry_after(0), Duration::from_secs(1));
        assert_eq!(failed_retry_after(u64::MAX), Duration::from_secs(60));
    }

    #[test]
    fn framework_errors_are_found_inside_io_and_boxed_errors() {
        let io: std::io::Error = Error::FingerprintMismatch(ctx()).into();
        assert_eq!(classify(&Err::<(), _>(io), None), Verdict::Mismatch);
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(Error::InProgress {
            scope: "a.b".into(),
            retry_after: Duration::from_secs(2),
        });
        assert_eq!(
            classify(&Err::<(), _>(boxed), None).disposition(),
            Disposition::Nak(Some(Duration::from_secs(2)))
        );
    }

    #[test]
    fn dispositions_print_short() {
        assert_eq!(Disposition::Ack.to_string(), "ack");
        assert_eq!(Disposition::Nak(None).to_string(), "nak");
        assert_eq!(
            Disposition::Nak(Some(Duration::from_millis(250))).to_string(),
            "nak(250ms)"
        );
        assert_eq!(Disposition::Term.to_string(), "term");
    }
}
