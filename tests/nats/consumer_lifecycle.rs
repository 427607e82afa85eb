//! What becomes of a delivery whose handler does not answer (dropped by a
//! consumer that shuts down, or panicking), and of many copies of one message
//! handled at once, on the real JetStream server and a SQLite store.

use crate::common;
use crate::nats_consumer::{json, order, pulled_in_turn, settled, BillError, Order, TestStream};

use async_nats::jetstream::{self, consumer::PullConsumer};
use common::servers::{fresh_tenant, nats_or_skip};
use futures_util::StreamExt;
use idempotent_runtime::consumer::nats::{message_key, process};
use idempotent_runtime::consumer::{Disposition, Verdict};
use idempotent_runtime::{idempotent, Error, Identity, SqliteStore, Store};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

const SCOPE: &str = "nats.lifecycle.billing";

/// A handler on a SQLite file whose first body either hangs (until the test
/// drops it) or panics; the effect is a row written at the end of the body.
struct Billing {
    db: sqlx::SqlitePool,
    store: SqliteStore,
    /// Bodies begun.
    entered: Semaphore,
    begun: AtomicUsize,
    /// What the first body does: `hang` or `panic`; later bodies write the effect.
    first: &'static str,
}

impl Billing {
    async fn open(label: &str, first: &'static str) -> Arc<Billing> {
        let dir = common::scratch::dir(label);
        let url = format!("sqlite://{}?mode=rwc", dir.join("billing.db").display());
        let db = sqlx::SqlitePool::connect(&url).await.unwrap();
        sqlx::query("CREATE TABLE effects (msg_id TEXT NOT NULL)")
            .execute(&db)
            .await
            .unwrap();
        Arc::new(Billing {
            store: SqliteStore::from_pool(db.clone()).await.unwrap(),
            db,
            entered: Semaphore::new(0),
            begun: AtomicUsize::new(0),
            first,
        })
    }

    /// A lease far longer than the test's `ack_wait`: a record left behind
    /// for its lease would hold every redelivery back for half a minute.
    #[idempotent(scope = "nats.lifecycle.billing", key = msg_id, tenant = tenant, store = self.store,
                 in_progress = reject, lease = "30s")]
    async fn bill(&self, tenant: &str, msg_id: &str, order: &Order) -> Result<u64, BillError> {
        let nth = self.begun.fetch_add(1, Ordering::SeqCst);
        self.entered.add_permits(1);
        if nth == 0 {
            match self.first {
                "hang" => std::future::pending::<()>().await,
                "panic" => panic!("the first body panics (by design)"),
                _ => {}
            }
        }
        sqlx::query("INSERT INTO effects (msg_id) VALUES (?)")
            .bind(msg_id)
            .execute(&self.db)
            .await
            .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("test", "effect", e)))?;
        let _ = order;
        Ok(7)
    }

    /// The same effect on a short lease, for the test of many copies: a
    /// copy refused as in progress is nak'd until the lease runs out.
    #[idempotent(scope = "nats.lifecycle.copies", key = msg_id, tenant = tenant, store = self.store,
                 in_progress = reject, lease = "2s")]
    async fn bill_copy(&self, tenant: &str, msg_id: &str, order: &Order) -> Result<u64, BillError> {
        self.begun.fetch_add(1, Ordering::SeqCst);
        sqlx::query("INSERT INTO effects (msg_id) VALUES (?)")
            .bind(msg_id)
            .execute(&self.db)
            .await
            .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("test", "effect", e)))?;
        let _ = order;
        Ok(7)
    }

    /// A duplicate waits for the running copy (`in_progress = wait`); the
    /// first body waits at `gate` until the test lets it go.
    #[idempotent(scope = "nats.lifecycle.waiting", key = msg_id, tenant = tenant, store = self.store,
                 in_progress = wait("30s"), lease = "5s", skip(gate))]
    async fn bill_waiting(
        &self,
        tenant: &str,
        msg_id: &str,
        order: &Order,
        gate: &Semaphore,
    ) -> Result<u64, BillError> {
        self.entered.add_permits(1);
        // Bounded: a handshake that never comes fails the counts, it does not hang.
        let _ = tokio::time::timeout(Duration::from_secs(40), gate.acquire()).await;
        sqlx::query("INSERT INTO effects (msg_id) VALUES (?)")
            .bind(msg_id)
            .execute(&self.db)
            .await
            .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("test", "effect", e)))?;
        let _ = order;
        Ok(7)
    }

    async fn effects(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects")
            .fetch_one(&self.db)
            .await
            .unwrap()
    }

    /// Waits (bounded) until the message's record is gone: released.
    async fn wait_released(&self, tenant: &str, key: &str) {
        let identity = Identity::new(tenant, SCOPE, key).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.store.fetch(&identity).await.unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "the record of the abandoned delivery was not released; a redelivery would wait for its 30 s lease"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn next_message(
    messages: &mut (impl futures_util::Stream<Item = Result<jetstream::Message, impl std::fmt::Debug>>
              + Unpin),
) -> jetstream::Message {
    tokio::time::timeout(Duration::from_secs(20), messages.next())
        .await
        .expect("a delivery within 20 s")
        .expect("the message stream goes on")
        .expect("a message")
}

async fn wait_settled(consumer: &PullConsumer) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !settled(consumer).await {
        assert!(Instant::now() < deadline, "the message was never settled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A consumer that stops while a handler runs (its `process` future is
/// dropped, as a shutdown or a `select!` does) leaves the message unsettled:
/// JetStream redelivers it after `ack_wait`, and the record was released
/// (rule 14), so the redelivery runs the body at once instead of being
/// nak'd as in progress until a lease of 30 s runs out. One effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_handler_is_dropped_is_redelivered_and_runs() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(90), async {
        let tenant = fresh_tenant();
        let billing = Billing::open("nats-dropped", "hang").await;
        let stream = TestStream::create(&js, "DROPPED").await;
        let consumer = stream.durable("dropped", Duration::from_secs(1)).await;
        stream.publish("d-1", json(&order("o-1", 100))).await;
        let mut messages = pulled_in_turn(&consumer, 1);

        let first = next_message(&mut messages).await;
        let o: Order = serde_json::from_slice(&first.payload).unwrap();
        tokio::select! {
            _ = process(&first, |k| billing.bill(&tenant, k, &o)) => panic!("the hanging body returned"),
            _ = billing.entered.acquire() => {}
        }
        // The `process` future is dropped here, mid-body.
        billing.wait_released(&tenant, "d-1").await;

        let again = next_message(&mut messages).await;
        assert_eq!(message_key(&again), Some("d-1"));
        assert!(again.info().unwrap().delivered >= 2, "a redelivery");
        let handled = process(&again, |k| billing.bill(&tenant, k, &o)).await.unwrap();
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Executed, Disposition::Ack)
        );
        wait_settled(&consumer).await;
        assert_eq!(billing.effects().await, 1);
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 90 s");
}

/// A handler that panics: the panic goes on out of `process` (here, out of
/// the delivery's task), the record is released before it does, and the
/// unsettled message is redelivered after `ack_wait` and runs. One effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_handler_panics_is_redelivered_and_runs() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(90), async {
        let tenant = fresh_tenant();
        let billing = Billing::open("nats-panics", "panic").await;
        let stream = TestStream::create(&js, "PANICS").await;
        let consumer = stream.durable("panics", Duration::from_secs(1)).await;
        stream.publish("p-1", json(&order("o-1", 100))).await;
        let mut messages = pulled_in_turn(&consumer, 1);

        let first = next_message(&mut messages).await;
        let task = {
            let (billing, tenant) = (billing.clone(), tenant.clone());
            tokio::spawn(async move {
                let o: Order = serde_json::from_slice(&first.payload).unwrap();
                process(&first, |k| billing.bill(&tenant, k, &o))
                    .await
                    .map(|h| h.verdict)
            })
        };
        let joined = task.await;
        assert!(joined.as_ref().is_err_and(|e| e.is_panic()), "{joined:?}");
        billing.wait_released(&tenant, "p-1").await;

        let again = next_message(&mut messages).await;
        assert_eq!(message_key(&again), Some("p-1"));
        let o: Order = serde_json::from_slice(&again.payload).unwrap();
        let handled = process(&again, |k| billing.bill(&tenant, k, &o))
            .await
            .unwrap();
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Executed, Disposition::Ack)
        );
        wait_settled(&consumer).await;
        assert_eq!(billing.effects().await, 1);
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 90 s");
}

/// Copies of one message (a producer that retried after the duplicate
/// window, several times) and other messages, handled by many concurrent
/// workers on one durable with a short `ack_wait`: one execution and one
/// effect per id, every copy settled with an ack, none terminated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_a_message_on_many_workers_have_one_effect_and_all_are_acked() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let tenant = fresh_tenant();
        let billing = Billing::open("nats-copies", "none").await;
        let stream = TestStream::create(&js, "COPIES").await;
        let consumer = stream.durable("copies", Duration::from_secs(1)).await;
        const IDS: usize = 4;
        const COPIES: usize = 6;
        for _copy in 0..COPIES {
            for id in 0..IDS {
                stream
                    .publish(&format!("c-{id}"), json(&order(&format!("o-{id}"), 100)))
                    .await;
            }
        }
        let seen: Arc<Mutex<BTreeMap<(String, &'static str), usize>>> = Default::default();
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..6 {
            let (consumer, billing, tenant, seen) = (
                consumer.clone(),
                billing.clone(),
                tenant.clone(),
                seen.clone(),
            );
            workers.spawn(async move {
                let mut messages = pulled_in_turn(&consumer, 1);
                while let Some(Ok(message)) = messages.next().await {
                    let o: Order = serde_json::from_slice(&message.payload).unwrap();
                    let handled = process(&message, |k| billing.bill_copy(&tenant, k, &o))
                        .await
                        .unwrap();
                    let key = message_key(&message).unwrap().to_owned();
                    *seen
                        .lock()
                        .unwrap()
                        .entry((key, handled.verdict.as_str()))
                        .or_default() += 1;
                }
            });
        }
        let deadline = Instant::now() + Duration::from_secs(90);
        while !settled(&consumer).await {
            assert!(
                Instant::now() < deadline,
                "not every copy was settled: {:?}",
                seen.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        workers.abort_all();
        let seen = seen.lock().unwrap().clone();
        for id in 0..IDS {
            let key = format!("c-{id}");
            assert_eq!(seen.get(&(key.clone(), "executed")), Some(&1), "{seen:?}");
        }
        // A store that was busy (failed, nak'd) is tried again; nothing is terminated.
        assert!(
            seen.keys()
                .all(|(_, v)| matches!(*v, "executed" | "replayed" | "in-progress" | "failed")),
            "{seen:?}"
        );
        assert_eq!(billing.effects().await, IDS as i64);
        stream.delete().await;
    })
    .await
    .expect("finished within 120 s");
}

/// Message ids that are not keys, as the real client hands them over: one
/// of 256 bytes, one with a tab inside, one of spaces only (the client trims
/// it to nothing) are terminated without running the body; the 255-byte id
/// beside them is billed and acked. Nothing is left unsettled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_ids_that_are_not_valid_keys_are_terminated_and_a_valid_one_runs() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(60), async {
        let tenant = fresh_tenant();
        let billing = Billing::open("nats-bad-ids", "none").await;
        let stream = TestStream::create(&js, "BADIDS").await;
        let consumer = stream.durable("bad-ids", Duration::from_secs(30)).await;
        let longest = "k".repeat(255);
        let too_long = "k".repeat(256);
        let ids = [too_long.as_str(), "with\ttab", "   ", longest.as_str()];
        for id in ids {
            stream.publish(id, json(&order("o-1", 100))).await;
        }
        let mut messages = pulled_in_turn(&consumer, 1);
        let mut verdicts = Vec::new();
        for _ in ids {
            let message = next_message(&mut messages).await;
            let o: Order = serde_json::from_slice(&message.payload).unwrap();
            let handled = process(&message, |k| billing.bill(&tenant, k, &o))
                .await
                .unwrap();
            verdicts.push((handled.verdict, handled.disposition()));
        }
        assert_eq!(
            verdicts,
            [
                (Verdict::InvalidKey, Disposition::Term),
                (Verdict::InvalidKey, Disposition::Term),
                (Verdict::InvalidKey, Disposition::Term),
                (Verdict::Executed, Disposition::Ack),
            ]
        );
        wait_settled(&consumer).await;
        assert_eq!(billing.effects().await, 1);
        assert_eq!(
            billing.begun.load(Ordering::SeqCst),
            1,
            "no body ran for a bad id"
        );
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 60 s");
}

/// A copy of a message that finds another copy running waits for it
/// (`in_progress = wait`) under `process_with_progress`: its progress keeps
/// its delivery past the 2 s `ack_wait` (nothing is redelivered), and once
/// the running copy is let go the waiting one replays its answer. One
/// effect, two acks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_waiting_for_a_running_copy_keeps_its_delivery_with_progress() {
    use idempotent_runtime::consumer::nats::process_with_progress;
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(90), async {
        let tenant = fresh_tenant();
        let billing = Billing::open("nats-waiting", "none").await;
        let stream = TestStream::create(&js, "WAITING").await;
        let consumer = stream.durable("waiting", Duration::from_secs(2)).await;
        // Progress messages, by the stream sequence of the delivery that sent them.
        let watching = async_nats::connect(common::servers::nats_url().as_str())
            .await
            .unwrap();
        let mut acks = watching
            .subscribe(format!("$JS.ACK.{}.>", stream.name))
            .await
            .unwrap();
        watching.flush().await.unwrap();
        let second_progress = Arc::new(Semaphore::new(0));
        let watcher = {
            let seen = second_progress.clone();
            tokio::spawn(async move {
                let _client = watching;
                while let Some(ack) = acks.next().await {
                    // $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.…
                    let sequence = ack.subject.split('.').nth(5);
                    if ack.payload.as_ref() == b"+WPI" && sequence == Some("2") {
                        seen.add_permits(1);
                    }
                }
            })
        };
        stream.publish("w-1", json(&order("o-1", 100))).await;
        stream.publish("w-1", json(&order("o-1", 100))).await; // a producer retry
        let mut messages = pulled_in_turn(&consumer, 2);
        let first = next_message(&mut messages).await;
        let second = next_message(&mut messages).await;
        let gate = Semaphore::new(0);
        let o: Order = serde_json::from_slice(&first.payload).unwrap();
        let every = Duration::from_millis(200);
        let running = process_with_progress(&first, every, |k| {
            billing.bill_waiting(&tenant, k, &o, &gate)
        });
        let waiting = async {
            let _ = billing
                .entered
                .acquire()
                .await
                .expect("the first body entered");
            process_with_progress(&second, every, |k| {
                billing.bill_waiting(&tenant, k, &o, &gate)
            })
            .await
        };
        let letting_go = async {
            // Fifteen progress messages of the waiting copy: three seconds,
            // past its 2 s ack_wait.
            let _ = second_progress
                .acquire_many(15)
                .await
                .expect("the watcher goes on");
            gate.add_permits(1);
        };
        let (running, waiting, ()) = tokio::join!(running, waiting, letting_go);
        let (running, waiting) = (running.unwrap(), waiting.unwrap());
        assert_eq!(
            (running.verdict, running.disposition()),
            (Verdict::Executed, Disposition::Ack)
        );
        assert_eq!(
            (waiting.verdict, waiting.disposition()),
            (Verdict::Replayed, Disposition::Ack)
        );
        wait_settled(&consumer).await;
        let info = consumer.get_info().await.unwrap();
        assert_eq!(
            info.num_redelivered, 0,
            "the waiting copy was not redelivered"
        );
        assert_eq!(billing.effects().await, 1);
        watcher.abort();
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 90 s");
}

/// A NATS server of the test's own (JetStream on a file store in a scratch
/// directory), killed when dropped.
struct OwnServer {
    child: Option<std::process::Child>,
    port: u16,
    dir: std::path::PathBuf,
}

impl OwnServer {
    /// Starts one, or `None` (the test says it is skipped) without `nats-server`.
    async fn start() -> Option<OwnServer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let mut server = OwnServer {
            child: None,
            port,
            dir: common::scratch::dir("nats-own-server"),
        };
        if !server.run().await {
            eprintln!("SKIPPED: no nats-server to start");
            return None;
        }
        Some(server)
    }

    /// (Re)starts the server on the same port and store; waits until it accepts.
    async fn run(&mut self) -> bool {
        let Ok(child) = std::process::Command::new("nats-server")
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
        else {
            return false;
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "the own NATS server did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// SIGKILLs it (its file store stays).
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The NATS server is killed (SIGKILL) while a handler runs and restarted
/// on its file store: the handler finishes, `process` queues its ack while
/// the client reconnects, and the message ends settled, either by that ack
/// or by a redelivery that replays. One effect, nothing terminated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_restarted_mid_handler_settles_the_message_once() {
    let Some(mut server) = OwnServer::start().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(server.url())
            .await
            .unwrap();
        let js = jetstream::new(client);
        let tenant = fresh_tenant();
        let billing = Billing::open("nats-restart", "none").await;
        let stream = TestStream::create(&js, "RESTART").await;
        let consumer = stream.durable("restart", Duration::from_secs(2)).await;
        stream.publish("r-1", json(&order("o-1", 100))).await;
        let gate = Semaphore::new(0);
        let mut messages = pulled_in_turn(&consumer, 1);
        let first = next_message(&mut messages).await;
        let o: Order = serde_json::from_slice(&first.payload).unwrap();
        let mut verdicts = Vec::new();
        let handling = process(&first, |k| billing.bill_waiting(&tenant, k, &o, &gate));
        let restarting = async {
            let _ = billing.entered.acquire().await.expect("the body entered");
            server.kill();
            assert!(server.run().await);
            gate.add_permits(1);
        };
        let (handled, ()) = tokio::join!(handling, restarting);
        match handled {
            Ok(handled) => verdicts.push(handled.verdict),
            Err(e) => eprintln!("the ack could not be queued: {e}"),
        }
        drop(messages);
        // Whatever the server kept: settle it (a redelivery replays).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if settled(&consumer).await {
                break;
            }
            assert!(Instant::now() < deadline, "never settled: {verdicts:?}");
            let Ok(mut batch) = consumer
                .fetch()
                .max_messages(1)
                .expires(Duration::from_secs(1))
                .messages()
                .await
            else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            while let Some(Ok(message)) = batch.next().await {
                let handled = process(&message, |k| billing.bill_waiting(&tenant, k, &o, &gate))
                    .await
                    .unwrap();
                verdicts.push(handled.verdict);
            }
        }
        eprintln!("verdicts {verdicts:?}");
        assert_eq!(billing.effects().await, 1, "{verdicts:?}");
        assert!(
            verdicts.iter().all(|v| matches!(
                v,
                Verdict::Executed | Verdict::Replayed | Verdict::InProgress { .. }
            )),
            "{verdicts:?}"
        );
        stream.delete().await;
    })
    .await
    .expect("finished within 120 s");
}
