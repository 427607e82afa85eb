//! The consumer's verdict (`consumer::handle` / `consumer::nats::process`)
//! for a handler that makes more than one idempotent call per message (one
//! step per scope, all keyed by the message id: reserve the stock, then
//! charge). `with_outcome` reports the *last* idempotent call that finished
//! with a result, and `classify` turns any `Err` into `Replayed` (ack) when
//! that outcome is `Replayed` — even when the error is the framework's own
//! store error from a later step that never ran. The message is acked and
//! never redelivered: the charge is lost.

use idempotent_runtime::consumer::{handle, Disposition, Verdict};
use idempotent_runtime::{idempotent, Error, MemoryStore, SqliteStore};
use std::sync::atomic::{AtomicUsize, Ordering};

static CHARGED: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "contract_edges.consumer.reserve_stock", key = key, tenant = shared,
             store = store, in_progress = reject)]
async fn reserve_stock(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

#[idempotent(scope = "contract_edges.consumer.charge", key = key, tenant = shared,
             store = store, in_progress = reject)]
async fn charge(store: &SqliteStore, key: &str) -> Result<u32, Error> {
    CHARGED.fetch_add(1, Ordering::SeqCst);
    Ok(2)
}

#[tokio::test]
async fn a_later_steps_store_failure_after_a_replayed_step_is_not_acked() {
    let stock = MemoryStore::new();
    let payments = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    // An earlier delivery reserved the stock; its charge step failed (or the
    // consumer died before it): the message was not acked and comes again.
    reserve_stock(&stock, "msg-1")
        .await
        .expect("stock reserved");
    // The payments store is unreachable during the redelivery.
    payments.pool().close().await;

    let handled = handle(Some("msg-1"), |key| async {
        reserve_stock(&stock, key).await?; // replayed
        charge(&payments, key).await // refused: the store is down
    })
    .await;
    assert!(
        matches!(handled.result, Some(Err(Error::Store(_)))),
        "{:?}",
        handled.result
    );
    assert_eq!(CHARGED.load(Ordering::SeqCst), 0, "the charge never ran");
    assert_eq!(
        (handled.verdict, handled.disposition()),
        (Verdict::Failed, Disposition::Nak(None)),
        "the charge never ran, yet the message is acked and will not be redelivered"
    );
}
