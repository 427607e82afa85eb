//! Rule 2 on the consumer: the message id is the key, and no log line of this
//! crate names it, at any level (TRACE included) and in any span field, for
//! a delivery executed, a copy replayed, and a copy with other arguments
//! (a mismatch: poison, termed with a warning), and a message whose id is
//! too long to be a key (refused, termed with a warning). `async_nats` itself logs
//! whole messages at `trace` level (the README says so and tells users to
//! keep it at `debug` or above): its own `TRACE` lines are left out of the
//! search, and none of its lines at `DEBUG` or above may name the key.

use crate::common::servers::nats_or_skip;
use crate::nats_consumer::{json, order, pulled_in_turn, BillError, Order, TestStream};
use futures_util::StreamExt;
use idempotent_runtime::consumer::nats::process;
use idempotent_runtime::consumer::{Disposition, Verdict};
use idempotent_runtime::{idempotent, MemoryStore};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

#[idempotent(scope = "nats.leaks.bill", key = msg_id, tenant = shared, store = store,
             in_progress = reject)]
async fn bill(store: &MemoryStore, msg_id: &str, order: &Order) -> Result<u64, BillError> {
    let _ = order;
    Ok(1)
}

fn capture_logs() -> Arc<Mutex<String>> {
    static LOGS: OnceLock<Arc<Mutex<String>>> = OnceLock::new();
    #[derive(Clone)]
    struct Buf(Arc<Mutex<String>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().push_str(&String::from_utf8_lossy(b));
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(String::new()));
        let writer = Buf(buf.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other subscriber in this test binary");
        buf
    })
    .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_logs_no_message_id_at_any_level() {
    let logs = capture_logs();
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let store = MemoryStore::new();
    let key = format!("sk_live_KEYLEAK-nats-{}", uuid::Uuid::new_v4());
    let stream = TestStream::create(&js, "LEAKS").await;
    let consumer = stream.durable("leaks", Duration::from_secs(60)).await;
    stream.publish(&key, json(&order("o-1", 100))).await;
    stream.publish(&key, json(&order("o-1", 100))).await;
    stream.publish(&key, json(&order("o-1", 999))).await;
    // An id too long to be a key (300 bytes, the marker in it): refused, termed.
    let too_long = format!("{key}-{}", "x".repeat(300 - key.len() - 1));
    stream.publish(&too_long, json(&order("o-2", 1))).await;
    let mut messages = pulled_in_turn(&consumer, 1);
    let mut seen = Vec::new();
    for _ in 0..4 {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .expect("a delivery within 30 s")
            .expect("a delivery")
            .expect("a message");
        let order: Order = serde_json::from_slice(&message.payload).expect("an order");
        let handled = process(&message, |k| bill(&store, k, &order))
            .await
            .expect("settle the delivery");
        seen.push((handled.verdict, handled.disposition()));
    }
    stream.delete().await;
    assert_eq!(
        seen,
        [
            (Verdict::Executed, Disposition::Ack),
            (Verdict::Replayed, Disposition::Ack),
            (Verdict::Mismatch, Disposition::Term),
            (Verdict::InvalidKey, Disposition::Term),
        ]
    );
    let text = logs.lock().unwrap().clone();
    assert!(text.contains("poison message terminated"), "{text}");
    let ours: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("KEYLEAK") && !l.contains(" TRACE async_nats"))
        .collect();
    assert!(
        ours.is_empty(),
        "a raw key reached the logs:\n{}",
        ours.join("\n")
    );
}
