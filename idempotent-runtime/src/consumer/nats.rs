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
pub async fn process<'m, F, Fut, T, E>(
    message: &'m jetstream::Message,
    handler: F,
) -> Result<Handled<T, E>, async_nats::Error>
where
    F: FnOnce(&'m str) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: AsIdempotencyError,
{
    let mut handled = handle(message_key(message), handler).await;
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
