//! A NATS JetStream consumer made safe against redelivery by `#[idempotent]`.
//! Needs a NATS server with JetStream (`nats-server -js -a 127.0.0.1 -p 4222`,
//! or `IDEMPOTENT_NATS_URL`); the records and the effects live in a temporary
//! SQLite file. Run it with:
//!
//! ```text
//! cargo run --example consumer_nats
//! ```
//!
//! It creates a stream and a durable pull consumer, publishes a few orders
//! (with a producer retry, a poison message, a message without an id, ...),
//! bills them with an idempotent handler that writes one invoice row per
//! order, and prints what became of every delivery and how many invoices each
//! message produced. Then it deletes its stream and exits.
//!
//! The key is the producer's message id (`Nats-Msg-Id`); the scope names the
//! consumer (`orders.consumer.billing`), so a second consumer of the same
//! stream (shipping, say) has its own records and processes every message too;
//! the tenant is the stream, the namespace those ids were made in.

use async_nats::jetstream::{self, consumer::pull, stream};
use futures_util::{StreamExt, TryStreamExt};
use idempotent_runtime::consumer::nats::{message_key, process};
use idempotent_runtime::consumer::{handle, AsIdempotencyError, Verdict};
use idempotent_runtime::{idempotent, Error, SqliteStore};
use serde::{Deserialize, Serialize};
use sqlx::SqlitePool;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::{timeout, Instant};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Order {
    order_id: String,
    amount_cents: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Invoice {
    invoice_id: i64,
}

#[derive(Debug, thiserror::Error)]
enum BillingError {
    #[error("the ledger is unavailable; try again")]
    LedgerDown,
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Idempotency(#[from] Error),
}

/// Lets the consumer core tell the framework's refusals from our own failures.
impl AsIdempotencyError for BillingError {
    fn as_idempotency_error(&self) -> Option<&Error> {
        match self {
            BillingError::Idempotency(e) => Some(e),
            _ => None,
        }
    }
}

struct Billing {
    db: SqlitePool,
    store: SqliteStore,
    /// Orders whose first attempt finds the ledger down.
    ledger_down_once: Mutex<HashSet<String>>,
    /// Orders that take a while to bill.
    slow: HashSet<String>,
}

impl Billing {
    /// Bills an order once per message id, however often it is delivered.
    /// `in_progress = reject`: a duplicate delivery that finds the message still
    /// being billed is declined at once (and nak'd with a delay) instead of
    /// holding the consumer. A short lease for the demo, so that delay is short.
    #[idempotent(scope = "orders.consumer.billing", key = msg_id, tenant = stream,
                 store = self.store, in_progress = reject, lease = "2s")]
    async fn bill(
        &self,
        stream: &str,
        msg_id: &str,
        order: &Order,
    ) -> Result<Invoice, BillingError> {
        let down = self
            .ledger_down_once
            .lock()
            .unwrap()
            .remove(&order.order_id);
        if down {
            return Err(BillingError::LedgerDown);
        }
        if self.slow.contains(&order.order_id) {
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        let invoice_id =
            sqlx::query("INSERT INTO invoices (msg_id, order_id, amount_cents) VALUES (?, ?, ?)")
                .bind(msg_id)
                .bind(&order.order_id)
                .bind(order.amount_cents as i64)
                .execute(&self.db)
                .await?
                .last_insert_rowid();
        Ok(Invoice { invoice_id })
    }
}

/// Publishes with `Nats-Msg-Id`. JetStream drops a message whose id it saw
/// within the stream's duplicate window (a short one here); a producer retry
/// that comes later is stored and delivered: the case the consumer must handle.
async fn publish(
    js: &jetstream::Context,
    subject: &str,
    msg_id: &str,
    order: &Order,
) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ack = js
            .send_publish(
                subject.to_owned(),
                jetstream::message::PublishMessage::build()
                    .payload(serde_json::to_vec(order)?.into())
                    .message_id(msg_id),
            )
            .await?
            .await?;
        if !ack.duplicate {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("JetStream kept dropping the retry as a duplicate".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "idempotent=warn".into()),
        )
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();

    let url =
        std::env::var("IDEMPOTENT_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = match async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url.as_str())
        .await
    {
        Ok(client) => client,
        Err(e) => {
            eprintln!("cannot reach NATS at {url} ({e}); start it with `nats-server -js -a 127.0.0.1 -p 4222` or set IDEMPOTENT_NATS_URL");
            std::process::exit(1);
        }
    };
    let js = jetstream::new(client);

    let pid = std::process::id();
    let path = std::env::temp_dir().join(format!("idempotent-consumer-{pid}.db"));
    let db = SqlitePool::connect(&format!("sqlite://{}?mode=rwc", path.display())).await?;
    sqlx::query("CREATE TABLE invoices (id INTEGER PRIMARY KEY, msg_id TEXT NOT NULL, order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL)")
        .execute(&db)
        .await?;
    let billing = Arc::new(Billing {
        store: SqliteStore::from_pool(db.clone()).await?,
        db,
        ledger_down_once: Mutex::new(HashSet::from(["order-3".to_owned()])),
        slow: HashSet::from(["order-4".to_owned()]),
    });

    let stream_name = format!("ORDERS_DEMO_{pid}");
    let subject = format!("demo.{pid}.orders");
    let stream = js
        .create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            duplicate_window: Duration::from_millis(500),
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await?;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("billing".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await?;
    println!("idempotent demo — NATS JetStream consumer (stream {stream_name}, durable `billing`, scope `orders.consumer.billing`)");
    println!("records and invoices on SQLite ({})\n", path.display());

    let order = |id: &str, amount_cents| Order {
        order_id: id.into(),
        amount_cents,
    };
    println!("published:");
    publish(&js, &subject, "ord-1", &order("order-1", 1200)).await?;
    println!("  ord-1   order-1, 1200 cents");
    let retry = js
        .send_publish(
            subject.clone(),
            jetstream::message::PublishMessage::build()
                .payload(serde_json::to_vec(&order("order-1", 1200))?.into())
                .message_id("ord-1"),
        )
        .await?
        .await?;
    println!(
        "  ord-1   again at once: JetStream's duplicate window dropped it (duplicate = {})",
        retry.duplicate
    );
    publish(&js, &subject, "ord-2", &order("order-2", 800)).await?;
    println!("  ord-2   order-2, 800 cents");
    publish(&js, &subject, "ord-1", &order("order-1", 1200)).await?;
    println!("  ord-1   again after the window: a producer retry the stream keeps");
    publish(&js, &subject, "ord-3", &order("order-3", 500)).await?;
    println!("  ord-3   order-3 (the ledger is down on its first attempt)");
    publish(&js, &subject, "ord-2", &order("order-2", 99_900)).await?;
    println!("  ord-2   same id, different amount: poison");
    js.publish(
        subject.clone(),
        serde_json::to_vec(&order("order-x", 1))?.into(),
    )
    .await?
    .await?;
    println!("  (none)  a message without Nats-Msg-Id");
    publish(&js, &subject, "ord-4", &order("order-4", 2500)).await?;
    publish(&js, &subject, "ord-4", &order("order-4", 2500)).await?;
    println!("  ord-4   twice; billing it takes 600 ms");
    publish(&js, &subject, "ord-5", &order("order-5", 300)).await?;
    println!("  ord-5   order-5 (the ack of its first delivery gets lost)");

    println!("\ndeliveries:");
    // One message at a time, but a handler still running after 200 ms is left
    // to finish in the background while the next message is taken, as a
    // consumer with a few workers would.
    //
    // One pull request per message, each sent when the last one is done
    // (`sequence(1)`). Not `consumer.stream().max_messages_per_batch(1)`:
    // on a loaded machine that stream can count a request as still owing a
    // message it already delivered, and then sends no new request until the
    // old one expires, 30 s later.
    let mut messages = consumer
        .sequence(1)?
        .try_flatten()
        .map_err(|e| e as Box<dyn std::error::Error>);
    let mut running = tokio::task::JoinSet::new();
    let verdicts: Arc<Mutex<BTreeMap<&'static str, usize>>> = Default::default();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        if Instant::now() > deadline {
            return Err("the consumer did not settle every message within 30 s".into());
        }
        tokio::select! {
            next = messages.next() => {
                let message = next.ok_or("the message stream ended")??;
                let (billing, verdicts, stream_name) = (billing.clone(), verdicts.clone(), stream_name.clone());
                running.spawn(async move {
                    let info = message.info().map(|i| (i.stream_sequence, i.delivered)).unwrap_or((0, 0));
                    let order: Order = match serde_json::from_slice(&message.payload) {
                        Ok(order) => order,
                        Err(_) => {
                            let _ = message.ack_with(jetstream::AckKind::Term).await;
                            return;
                        }
                    };
                    let key = message_key(&message).unwrap_or("(none)").to_owned();
                    let bill = |msg_id| billing.bill(&stream_name, msg_id, &order);
                    let (verdict, settled) = if key == "ord-5" && info.1 == 1 {
                        // Handled, but the ack never reaches the server: it
                        // redelivers after ack_wait, and the retry replays.
                        (handle(message_key(&message), bill).await.verdict, "ack lost (simulated)".to_owned())
                    } else {
                        match process(&message, bill).await {
                            Ok(handled) => (handled.verdict, handled.disposition().to_string()),
                            Err(e) => (Verdict::Failed, format!("could not settle: {e}")),
                        }
                    };
                    *verdicts.lock().unwrap().entry(verdict.as_str()).or_default() += 1;
                    println!("  seq {:>2}  delivery {}  {key:<7} -> {:<11} -> {settled}", info.0, info.1, verdict.as_str());
                });
                let _ = timeout(Duration::from_millis(200), running.join_next()).await;
            }
            _ = tick.tick() => {
                while running.try_join_next().is_some() {}
                let info = consumer.get_info().await?;
                if running.is_empty() && info.num_pending == 0 && info.num_ack_pending == 0 {
                    break;
                }
            }
        }
    }

    println!("\ninvoices per message id (the effect):");
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT msg_id, COUNT(*) FROM invoices GROUP BY msg_id ORDER BY msg_id")
            .fetch_all(&billing.db)
            .await?;
    for (msg_id, count) in &rows {
        println!("  {msg_id}: {count}");
    }
    let verdicts = verdicts.lock().unwrap().clone();
    let deliveries: usize = verdicts.values().sum();
    let line: Vec<String> = verdicts.iter().map(|(v, n)| format!("{v} {n}")).collect();
    println!(
        "\n{deliveries} deliveries of 9 stored messages: {}",
        line.join(", ")
    );
    println!(
        "{} invoices for {} message ids",
        rows.iter().map(|r| r.1).sum::<i64>(),
        rows.len()
    );

    js.delete_stream(&stream_name).await?;
    let _ = std::fs::remove_file(&path);
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}
