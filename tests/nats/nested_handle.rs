//! A `handle` nested in a delivery's handler (a message that carries several
//! items, each settled by its own key): the inner delivery settles its own
//! calls. A recorded error it replayed is its answer, acked there; when the
//! outer handler then fails a step of its own, the outer delivery is failed
//! and redelivered, not taken for that replayed answer and acked (which
//! would lose the step that failed).

use crate::nats_consumer::{json, order, pulled_in_turn, settled, BillError, Order, TestStream};

use crate::common::servers::nats_or_skip;
use futures_util::StreamExt;
use idempotent_runtime::consumer::nats::process;
use idempotent_runtime::consumer::{handle, Disposition, Verdict};
use idempotent_runtime::{idempotent, MemoryStore};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// Items of a batch message: a declined item's error is its final answer
/// (`errors = record`); the batch's own step (`ship`) fails while `down`.
struct Batch {
    store: MemoryStore,
    declines: AtomicUsize,
    shipped: AtomicUsize,
    down: AtomicBool,
}

impl Batch {
    #[idempotent(scope = "nats.nested.items", key = item_id, tenant = shared, store = self.store,
                 in_progress = reject, errors = record)]
    async fn decline(&self, item_id: &str, order: &Order) -> Result<u64, BillError> {
        self.declines.fetch_add(1, Ordering::SeqCst);
        let _ = order;
        Err(BillError::LedgerDown)
    }

    /// The outer handler: settles its item through a `handle` of its own,
    /// then ships the batch (its own step, which may fail).
    async fn batch(&self, msg_id: &str, item: &Order) -> Result<(), BillError> {
        let item_key = format!("{msg_id}/item-1");
        let inner = handle(Some(item_key.as_str()), |k| self.decline(k, item)).await;
        if inner.disposition() != Disposition::Ack {
            return Err(BillError::LedgerDown);
        }
        if self.down.load(Ordering::SeqCst) {
            return Err(BillError::LedgerDown);
        }
        self.shipped.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Without a broker: the outer handler's own `Err` after the inner
/// delivery replayed a recorded error is `Failed`.
#[tokio::test]
async fn mapping_a_nested_handles_replayed_error_is_not_the_outer_answer() {
    let batch = Batch {
        store: MemoryStore::new(),
        declines: AtomicUsize::new(0),
        shipped: AtomicUsize::new(0),
        down: AtomicBool::new(true),
    };
    let item = order("o-n1", 1);
    // The item's decline is recorded (its first run is nak'd once).
    let first = handle(Some("m-n1"), |k| batch.batch(k, &item)).await;
    assert_eq!(first.verdict, Verdict::Failed);
    // Its replay is acked by the inner delivery; the ship step fails.
    let second = handle(Some("m-n1"), |k| batch.batch(k, &item)).await;
    assert_eq!(
        (second.verdict, second.disposition()),
        (Verdict::Failed, Disposition::Nak(None)),
        "the outer handler failed its own step"
    );
    batch.down.store(false, Ordering::SeqCst);
    let third = handle(Some("m-n1"), |k| batch.batch(k, &item)).await;
    assert_eq!(third.disposition(), Disposition::Ack);
    assert_eq!(
        (
            batch.declines.load(Ordering::SeqCst),
            batch.shipped.load(Ordering::SeqCst)
        ),
        (1, 1)
    );
}

/// On JetStream: the batch message is redelivered until its own step
/// succeeds; acked at the delivery whose ship failed, it never came back and
/// was never shipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_nested_handles_replayed_error_does_not_ack_a_failed_outer_step() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(60), async {
        let batch = Batch {
            store: MemoryStore::new(),
            declines: AtomicUsize::new(0),
            shipped: AtomicUsize::new(0),
            down: AtomicBool::new(true),
        };
        let stream = TestStream::create(&js, "NESTED").await;
        let consumer = stream.durable("nested", Duration::from_secs(30)).await;
        stream.publish("m-batch", json(&order("o-b", 5))).await;
        let mut messages = pulled_in_turn(&consumer, 1);
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(40);
        while !(settled(&consumer).await && batch.shipped.load(Ordering::SeqCst) > 0) {
            assert!(
                Instant::now() < deadline,
                "the batch was never shipped: {seen:?}"
            );
            let Ok(next) = tokio::time::timeout(Duration::from_millis(500), messages.next()).await
            else {
                continue;
            };
            let message = next.expect("the stream goes on").expect("a message");
            let delivered = message.info().unwrap().delivered;
            // The ship step fails at the first two deliveries (the first
            // records the item's decline, the second replays it).
            batch.down.store(delivered < 3, Ordering::SeqCst);
            let o: Order = serde_json::from_slice(&message.payload).unwrap();
            let handled = process(&message, |k| batch.batch(k, &o))
                .await
                .expect("settle the delivery");
            seen.push((delivered, handled.verdict, handled.disposition()));
        }
        assert_eq!(
            seen.iter().map(|d| (d.0, d.1)).take(2).collect::<Vec<_>>(),
            [(1, Verdict::Failed), (2, Verdict::Failed)],
            "{seen:?}"
        );
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert_eq!(seen[2].2, Disposition::Ack, "{seen:?}");
        assert_eq!(
            (
                batch.declines.load(Ordering::SeqCst),
                batch.shipped.load(Ordering::SeqCst)
            ),
            (1, 1)
        );
        stream.delete().await;
    })
    .await
    .expect("finished within 60 s");
}

/// The rest of what a nested `handle` saw still counts for the delivery
/// around it: the inner call refused by a newer version's record that is
/// still running, returned by the outer handler, is nak'd until that
/// record's lease ends (terminated, the message was lost if the newer
/// version's body then failed).
#[tokio::test]
async fn mapping_a_nested_handles_running_record_still_counts_for_the_outer_delivery() {
    let batch = Batch {
        store: MemoryStore::new(),
        declines: AtomicUsize::new(0),
        shipped: AtomicUsize::new(0),
        down: AtomicBool::new(false),
    };
    let identity =
        idempotent_runtime::Identity::shared("nats.nested.items", "m-n2/item-1").unwrap();
    let newer = idempotent_runtime::Fingerprint::from_stored(format!(
        "v99:{}",
        "0123456789abcdef".repeat(4)
    ));
    crate::common::records::acquire(
        &batch.store,
        &identity,
        Some(&newer),
        Duration::from_secs(3600),
        Duration::from_secs(3600),
    )
    .await;
    let item = order("o-n2", 2);
    let (batch, item) = (&batch, &item);
    let outer = handle(Some("m-n2"), |k| async move {
        let item_key = format!("{k}/item-1");
        let inner = handle(Some(item_key.as_str()), |ik| batch.decline(ik, item)).await;
        assert!(
            matches!(inner.verdict, Verdict::InProgress { .. }),
            "{:?}",
            inner.verdict
        );
        inner.result.expect("the item has a key")
    })
    .await;
    assert!(
        matches!(
            (outer.verdict, outer.disposition()),
            (Verdict::InProgress { .. }, Disposition::Nak(Some(_)))
        ),
        "{:?}",
        outer.verdict
    );
    assert_eq!(batch.declines.load(Ordering::SeqCst), 0);
}
