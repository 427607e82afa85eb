//! NATS JetStream consumers (feature `nats`): the key of a message is the
//! producer's message id (`Nats-Msg-Id`), and a [`Disposition`] becomes an
//! ack, a nak (with its delay) or a term.
//!
//! ```no_run
//! use futures_util::StreamExt;
//! use idempotent_runtime::consumer::nats::process;
//! use idempotent_runtime::{idempotent, Error, SqliteStore};
//!
//! #[idempotent(scope = "orders.consumer.billing", key = msg_id, tenant = shared,
//!              store = store, in_progress = reject)]
//! async fn bill(store: &SqliteStore, msg_id: &str, order: &[u8]) -> Result<(), Error> {
//!     Ok(()) // write the effect here
//! }
//!
//! # async fn run(consumer: async_nats::jetstream::consumer::PullConsumer, store: SqliteStore)
//! #     -> Result<(), async_nats::Error> {
//! let mut messages = consumer.messages().await?;
//! while let Some(message) = messages.next().await {
//!     let message = message?;
//!     let handled = process(&message, |key| bill(&store, key, &message.payload)).await?;
//!     println!("{} -> {}", handled.verdict, handled.disposition());
//! }
//! # Ok(()) }
//! ```
//!
//! For handlers that may outlive the consumer's `ack_wait`,
//! [`process_with_progress`] also tells the server, while the handler runs,
//! that the delivery is still being worked on.
//!
//! The consumer must use `AckPolicy::Explicit` (async-nats's default): each
//! delivery is settled on its own. Under `AckPolicy::All` the ack of a later
//! message also acknowledges an earlier one this module nak'd (its body
//! failed and released the key), which is then never redelivered; under
//! `AckPolicy::None` nothing is.
//!
//! A message without `Nats-Msg-Id` is never processed: without the producer's
//! id a redelivery could not be recognised, so it is terminated and logged
//! (the producer must set the header: `PublishMessage::build().message_id(..)`).
//! A fingerprint mismatch (the same id with a different payload) and an
//! invalid id are terminated and logged too; nothing in the logs carries the
//! raw id, only the stream, the consumer, the stream sequence and the scope
//! with a digest of the key.

use super::{handle, AsIdempotencyError, Disposition, Handled};
use async_nats::jetstream::{self, AckKind};
use std::future::Future;
use std::time::Duration;

/// The header holding the producer's message id: the idempotency key.
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";

/// The message's key: its `Nats-Msg-Id` header, if it has one.
///
/// As async-nats reads it: the client trims the whitespace around a header
/// value, so ids that differ only there (`order-42 ` and `order-42`) are one
/// key, although JetStream's duplicate window, which compares ids as sent,
/// keeps both messages. The second is then replayed (same payload) or
/// terminated as a mismatch; producers should not pad ids.
pub fn message_key(message: &async_nats::Message) -> Option<&str> {
    message
        .headers
        .as_ref()?
        .get(async_nats::header::NATS_MESSAGE_ID)
        .map(|value| value.as_str())
}

/// The JetStream acknowledgement for a disposition.
pub fn ack_kind(disposition: Disposition) -> AckKind {
    match disposition {
        Disposition::Ack => AckKind::Ack,
        Disposition::Nak(delay) => AckKind::Nak(delay),
        Disposition::Term => AckKind::Term,
    }
}

/// Tells the server what became of the delivery (one publish to its reply
/// subject; not confirmed by the server, like `Message::ack`).
pub async fn settle(
    message: &jetstream::Message,
    disposition: Disposition,
) -> Result<(), async_nats::Error> {
    message.ack_with(ack_kind(disposition)).await
}

/// Handles one JetStream delivery: the key is its `Nats-Msg-Id`,
/// `handler(key)` runs (see [`handle`]), poison is logged, and the
/// disposition is sent to the server. The error is only that of sending it;
/// the handler's own answer is in the returned [`Handled`].
///
/// While the handler runs, the server hears nothing of the delivery: a
/// handler that outlives the consumer's `ack_wait` has its message
/// redelivered (and nak'd as in progress) every `ack_wait`, each time using
/// up one of the consumer's deliveries. For handlers that may run that long,
/// use [`process_with_progress`].
pub async fn process<'m, F, Fut, T, E>(
    message: &'m jetstream::Message,
    handler: F,
) -> Result<Handled<T, E>, async_nats::Error>
where
    F: FnOnce(&'m str) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: AsIdempotencyError,
{
    let handled = handle(message_key(message), handler).await;
    conclude(message, handled).await
}

/// The shortest interval [`process_with_progress`] sends progress at: a
/// shorter one (zero included) is taken as this. One too long for the clock
/// to count to (`Duration::MAX`) sends none.
pub const MIN_PROGRESS_INTERVAL: Duration = Duration::from_millis(10);

/// [`process`], telling the server every `progress_every` while the handler
/// runs that the delivery is still being worked on (`AckKind::Progress`,
/// `+WPI`), so that JetStream resets the delivery's `ack_wait` instead of
/// redelivering the message to another worker. The first is sent as soon
/// as the handler first waits, since `ack_wait` runs from the delivery and
/// the message may have waited in the client's buffer before its handler
/// started; then one every `progress_every`. A handler that answers without
/// waiting sends none. Pick `progress_every` well below the consumer's `ack_wait`
/// (a third of it, say). One shorter than [`MIN_PROGRESS_INTERVAL`] is taken
/// as that; one too long for the clock to count to (`Duration::MAX`) sends none.
///
/// The record already keeps a redelivery from running the body a second
/// time; progress keeps long handlers from spending the consumer's
/// `max_deliver` and the workers' time on redeliveries that can only be
/// nak'd as in progress. The price: a handler that hangs keeps its message
/// for as long as it hangs, where without progress a redelivery could reach
/// another worker (which, once the call holds the record, it could not
/// complete anyway: its lease is renewed while the body runs). Bound what
/// the handler waits on (`tokio::time::timeout`).
///
/// A progress message that cannot be sent is logged (warning) and tried
/// again at the next interval; one whose sending does not finish (the
/// client's outgoing buffer full) holds back the next ones until it does.
/// Either way the handler goes on. Progress is sent by the same future as
/// the handler, like its heartbeat: a body that blocks its thread
/// (synchronous work without `spawn_blocking`) sends none while it blocks.
///
/// ```no_run
/// use futures_util::StreamExt;
/// use idempotent_runtime::consumer::nats::process_with_progress;
/// use idempotent_runtime::{idempotent, Error, SqliteStore};
/// use std::time::Duration;
///
/// #[idempotent(scope = "orders.consumer.reports", key = msg_id, tenant = shared,
///              store = store, in_progress = reject, lease = "2m")]
/// async fn build_report(store: &SqliteStore, msg_id: &str, order: &[u8]) -> Result<(), Error> {
///     Ok(()) // minutes of work
/// }
///
/// # async fn run(consumer: async_nats::jetstream::consumer::PullConsumer, store: SqliteStore)
/// #     -> Result<(), async_nats::Error> {
/// // The consumer's ack_wait is 30 s (async-nats's default).
/// let mut messages = consumer.messages().await?;
/// while let Some(message) = messages.next().await {
///     let message = message?;
///     process_with_progress(&message, Duration::from_secs(10), |key| {
///         build_report(&store, key, &message.payload)
///     })
///     .await?;
/// }
/// # Ok(()) }
/// ```
pub async fn process_with_progress<'m, F, Fut, T, E>(
    message: &'m jetstream::Message,
    progress_every: Duration,
    handler: F,
) -> Result<Handled<T, E>, async_nats::Error>
where
    F: FnOnce(&'m str) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: AsIdempotencyError,
{
    let work = handle(message_key(message), handler);
    let handled = signalling_while(work, progress_every, || async {
        if let Err(error) = message.ack_with(AckKind::Progress).await {
            let info = message.info().ok();
            tracing::warn!(target: "idempotent",
                stream = info.as_ref().map(|i| i.stream),
                consumer = info.as_ref().map(|i| i.consumer),
                stream_sequence = info.as_ref().map(|i| i.stream_sequence),
                %error,
                "could not tell the server the delivery is in progress; trying again at the next interval");
        }
    })
    .await;
    conclude(message, handled).await
}

/// Runs `work` to its end, awaiting `signal()` every `every` while it runs
/// (the first as soon as `work` first waits). `work` is polled while a signal
/// is being sent, and a signal still being sent when `work` ends is dropped.
async fn signalling_while<W, S, SF>(work: W, every: Duration, mut signal: S) -> W::Output
where
    W: Future,
    S: FnMut() -> SF,
    SF: Future<Output = ()>,
{
    let every = every.max(MIN_PROGRESS_INTERVAL);
    // An interval too long for the clock to count to never comes.
    if tokio::time::Instant::now().checked_add(every).is_none() {
        return work.await;
    }
    // The first tick at once: the delivery's `ack_wait` has been running
    // since before the work started.
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            out = &mut work => return out,
            _ = ticks.tick() => {}
        }
        let sending = signal();
        tokio::pin!(sending);
        tokio::select! {
            biased;
            out = &mut work => return out,
            () = &mut sending => {}
        }
    }
}

/// Logs poison and sends the delivery's disposition.
async fn conclude<T, E: AsIdempotencyError>(
    message: &jetstream::Message,
    mut handled: Handled<T, E>,
) -> Result<Handled<T, E>, async_nats::Error> {
    // A failed delivery's nak waits longer at every delivery.
    if let Ok(info) = message.info() {
        handled = handled.with_deliveries(u64::try_from(info.delivered).unwrap_or(1));
    }
    let disposition = handled.disposition();
    if disposition == Disposition::Term {
        let info = message.info().ok();
        let error = handled.idempotency_error().map(|e| e.to_string());
        tracing::warn!(target: "idempotent",
            stream = info.as_ref().map(|i| i.stream),
            consumer = info.as_ref().map(|i| i.consumer),
            stream_sequence = info.as_ref().map(|i| i.stream_sequence),
            verdict = %handled.verdict,
            error = error.as_deref().unwrap_or("the message has no Nats-Msg-Id header"),
            "poison message terminated; it will not be redelivered");
    }
    settle(message, disposition).await?;
    Ok(handled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// How many signals `signalling_while` sends while work of `lasting`
    /// runs, every `every` (on the paused clock).
    async fn signals_during(lasting: Duration, every: Duration) -> usize {
        let sent = AtomicUsize::new(0);
        signalling_while(tokio::time::sleep(lasting), every, || {
            sent.fetch_add(1, Ordering::SeqCst);
            std::future::ready(())
        })
        .await;
        sent.into_inner()
    }

    #[tokio::test(start_paused = true)]
    async fn progress_is_signalled_every_interval_while_the_work_runs() {
        let second = Duration::from_secs(1);
        assert_eq!(
            signals_during(Duration::from_millis(3500), second).await,
            4,
            "at the start, 1 s, 2 s, 3 s"
        );
        assert_eq!(signals_during(Duration::from_millis(999), second).await, 1);
        let sent = AtomicUsize::new(0);
        let out = signalling_while(async { 7 }, second, || {
            sent.fetch_add(1, Ordering::SeqCst);
            std::future::ready(())
        })
        .await;
        assert_eq!(out, 7, "the work's own output");
        assert_eq!(sent.into_inner(), 0, "work that never waits: none");
    }

    #[tokio::test(start_paused = true)]
    async fn intervals_out_of_range_are_bounded_not_a_panic() {
        let min = MIN_PROGRESS_INTERVAL;
        assert_eq!(
            signals_during(min * 5 + min / 2, Duration::ZERO).await,
            6,
            "zero: the minimum"
        );
        let hour = Duration::from_secs(3600);
        assert_eq!(
            signals_during(hour, Duration::MAX).await,
            0,
            "past the clock's end: never"
        );
    }

    /// A delivery's handling can be spawned onto a task of its own.
    #[allow(dead_code)]
    fn process_with_progress_is_send(message: &'static jetstream::Message) {
        fn spawnable<T: Send + 'static>(_: T) {}
        spawnable(process_with_progress(
            message,
            Duration::from_secs(1),
            |_key| async { Ok::<(), crate::Error>(()) },
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn the_work_goes_on_while_a_signal_is_stuck() {
        // A send that never finishes (a connection gone silent) holds no work.
        let started = Arc::new(AtomicUsize::new(0));
        let work = tokio::time::sleep(Duration::from_secs(5));
        let s = started.clone();
        signalling_while(work, Duration::from_secs(1), move || {
            s.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>()
        })
        .await;
        assert_eq!(
            started.load(Ordering::SeqCst),
            1,
            "the stuck send is dropped when the work ends"
        );
    }
}
