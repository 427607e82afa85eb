//! `process_with_progress` on a delivery that waited in the client's buffer
//! before its handler started (behind other messages of a batch): JetStream's
//! `ack_wait` runs from the delivery, not from the handler's start. Progress
//! that first went out `every` after the start came too late once the
//! message had waited `ack_wait - every`: the message was redelivered while
//! its handler ran (nak'd as in progress, one delivery spent). The first
//! progress goes out when the handler starts.

use crate::common::servers::{nats_or_skip, nats_url};
use crate::nats_consumer::{json, order, pulled_in_turn, settled, BillError, Order, TestStream};

use futures_util::StreamExt;
use idempotent_runtime::consumer::nats::{process, process_with_progress};
use idempotent_runtime::consumer::{Disposition, Verdict};
use idempotent_runtime::{idempotent, MemoryStore};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// The consumer's `ack_wait`.
const ACK_WAIT: Duration = Duration::from_secs(16);
/// How often progress is sent.
const EVERY: Duration = Duration::from_secs(6);
/// How long the delivery waits in the buffer before its handler starts:
/// more than `ACK_WAIT - EVERY` by 2 s (the server's redelivery check runs
/// on a timer of its own), less than `ACK_WAIT` by 4 s (a loaded machine's
/// scheduling).
const BUFFERED: Duration = Duration::from_secs(12);

struct Report {
    store: MemoryStore,
    runs: AtomicUsize,
    release: Semaphore,
}

impl Report {
    #[idempotent(scope = "nats.progress_start.reports", key = msg_id, tenant = shared,
                 store = self.store, in_progress = reject, lease = "30s")]
    async fn build(&self, msg_id: &str, order: &Order) -> Result<u64, BillError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        // Bounded: a handshake that never comes fails the test, it does not hang.
        let _ = tokio::time::timeout(Duration::from_secs(30), self.release.acquire()).await;
        let _ = order;
        Ok(1)
    }
}

/// A delivery that sat in the buffer for three quarters of its `ack_wait`,
/// then handled with progress every three eighths of `ack_wait`, until two progress
/// messages have reached the server: it is not redelivered; the body runs
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_progress_covers_the_time_a_delivery_waited_in_the_buffer() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(60), async {
        let stream = TestStream::create(&js, "PROGRESS_START").await;
        let admin = stream.durable("progress-start", ACK_WAIT).await;
        // Progress is a publish to the delivery's reply subject, which a
        // second client sees.
        let watching = async_nats::connect(nats_url().as_str()).await.unwrap();
        let mut acks = watching
            .subscribe(format!("$JS.ACK.{}.>", stream.name))
            .await
            .unwrap();
        watching.flush().await.unwrap();
        let progress_seen = Arc::new(Semaphore::new(0));
        let seen = progress_seen.clone();
        let watcher = tokio::spawn(async move {
            let _client = watching;
            while let Some(ack) = acks.next().await {
                if ack.payload.as_ref() == b"+WPI" {
                    seen.add_permits(1);
                }
            }
        });
        stream.publish("report-1", json(&order("r-1", 5))).await;
        let mut first_pull = pulled_in_turn(&admin, 1);
        let first = tokio::time::timeout(Duration::from_secs(10), first_pull.next())
            .await
            .expect("a delivery")
            .expect("the stream goes on")
            .expect("a message");
        drop(first_pull);
        // Any redelivery goes to a second pull, whose handler answers it.
        let report = Arc::new(Report {
            store: MemoryStore::new(),
            runs: AtomicUsize::new(0),
            release: Semaphore::new(0),
        });
        let (sender, mut redelivered) = tokio::sync::mpsc::unbounded_channel();
        let (second, r) = (admin.clone(), report.clone());
        let second_pull = tokio::spawn(async move {
            let mut pull = pulled_in_turn(&second, 1);
            while let Some(Ok(message)) = pull.next().await {
                let o: Order = serde_json::from_slice(&message.payload).unwrap();
                let handled = process(&message, |k| r.build(k, &o)).await.unwrap();
                let delivered = message.info().unwrap().delivered;
                if sender.send((delivered, handled.verdict)).is_err() {
                    return;
                }
            }
        });

        // The message waits in the buffer (behind other work).
        tokio::time::sleep(BUFFERED).await;
        let o: Order = serde_json::from_slice(&first.payload).unwrap();
        let handling = process_with_progress(&first, EVERY, |k| report.build(k, &o));
        let letting_go = async {
            let _ = progress_seen
                .acquire_many(2)
                .await
                .expect("the watcher goes on");
            report.release.add_permits(1);
        };
        let (handled, ()) = tokio::join!(handling, letting_go);
        let handled = handled.expect("the ack is sent");
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Executed, Disposition::Ack)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while !settled(&admin).await {
            assert!(Instant::now() < deadline, "the ack never landed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        second_pull.abort();
        watcher.abort();
        let mut redeliveries = Vec::new();
        while let Ok(r) = redelivered.try_recv() {
            redeliveries.push(r);
        }
        let info = admin.get_info().await.unwrap();
        println!(
            "deliveries {}, redelivered {:?}, body runs {}",
            info.delivered.consumer_sequence,
            redeliveries,
            report.runs.load(Ordering::SeqCst)
        );
        assert_eq!(report.runs.load(Ordering::SeqCst), 1, "one body run");
        assert!(
            redeliveries
                .iter()
                .all(|(_, v)| matches!(v, Verdict::InProgress { .. })),
            "a redelivery only ever waits for the running delivery: {redeliveries:?}"
        );
        assert_eq!(
            (info.delivered.consumer_sequence, redeliveries.len()),
            (1, 0),
            "one delivery, none redelivered while the handler ran"
        );
        stream.delete().await;
    })
    .await
    .expect("finished within 60 s");
}
