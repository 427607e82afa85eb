//! The NATS consumer worker: one OS process pulling from a durable JetStream
//! consumer and billing every message once, in transactional mode on
//! PostgreSQL or MariaDB. `tests/nats/nats_consumer.rs` runs two of these on one durable
//! consumer (the redelivery storm) and SIGKILLs one mid-way.
//!
//! ```text
//! idempotent-nats-worker <db_url> <nats_url> <stream> <durable> <tenant> <deadline_ms> <hold_after>
//! ```
//!
//! `db_url` is a PostgreSQL URL (scope `nats.storm.billing`) or a
//! `mysql://` URL for MariaDB/MySQL (scope `nats.storm.billing_mysql`), both
//! in transactional mode; or a `sqlite://` URL (scope
//! `nats.storm.billing_sqlite`) in *store* mode: the effect row is written
//! first (autocommit, in the same file), then the body goes on, and the
//! record is completed after the body. A worker killed mid-body leaves the
//! effects of the bodies it was running and their records in progress; a
//! redelivery takes each record over when its lease runs out, and the
//! scope's `recover` hook finds the effect and records it
//! (`Recovery::Completed`) instead of running the body again.
//!
//! With `hold_after` > 0, the body after that many bodies of this process
//! prints its `begin` line with `hold` and then sleeps for a minute: the test
//! SIGKILLs the worker on that line, so the kill lands mid-body for certain.
//!
//! The key is the message's `Nats-Msg-Id`; the scope is `nats.storm.billing`.
//! The body writes one effect row `(tenant, 'storm', msg_id, pid)` to
//! `idempotent_test_nats_effects` in the caller's transaction, in which the
//! result is recorded too; the worker commits after the call, then settles the
//! delivery. A process killed before its commit leaves neither an effect nor a
//! record behind: the database rolls both back, and the redelivery runs again.
//!
//! The payload says how a message misbehaves (JSON, see `StormOrder`):
//! `slow` bodies take 1.5 s (longer than the test's 1 s `ack_wait`, so the
//! server redelivers them while they run), `fail_first` fails its first
//! delivery (released: nak), `lose_first_ack` is handled but not settled on its
//! first delivery (the server redelivers after `ack_wait`; the retry replays).
//!
//! Output, one line each, flushed at once:
//!
//! ```text
//! ready <pid>
//! begin <msg_id> <delivered> [hold]                 the body runs (effect written, not committed)
//! delivery <msg_id> <delivered> <verdict> <disposition>   after settling (`lost` when not settled)
//! error <message>
//! ```
//!
//! The worker exits by itself at `deadline_ms` (wall clock) if nobody kills it.

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures_util::{StreamExt, TryStreamExt};
use idempotent_runtime::consumer::nats::{message_key, settle};
use idempotent_runtime::consumer::{handle, AsIdempotencyError, Disposition};
use idempotent_runtime::{idempotent, Error};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One message of the storm.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StormOrder {
    n: u32,
    slow: bool,
    fail_first: bool,
    lose_first_ack: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Billed {
    pid: u32,
}

#[derive(Debug, thiserror::Error)]
enum WorkerError {
    #[error("the first delivery of this message fails (by design)")]
    FirstDeliveryFails,
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Idempotency(#[from] Error),
}

impl AsIdempotencyError for WorkerError {
    fn as_idempotency_error(&self) -> Option<&Error> {
        match self {
            WorkerError::Idempotency(e) => Some(e),
            _ => None,
        }
    }
}

/// Bodies begun in this process, and the one (1-based) that holds; 0: none.
static BEGUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static HOLD_AT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[idempotent(scope = "nats.storm.billing", key = msg_id, tenant = tenant, tx = tx,
             lease = "2s", in_progress = reject, skip(delivered))]
async fn bill(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    msg_id: &str,
    order: &StormOrder,
    delivered: i64,
) -> Result<Billed, WorkerError> {
    if order.fail_first && delivered == 1 {
        return Err(WorkerError::FirstDeliveryFails);
    }
    let pid = std::process::id();
    sqlx::query(
        "INSERT INTO idempotent_test_nats_effects (tenant, consumer, msg_id, pid) VALUES ($1, 'storm', $2, $3)",
    )
    .bind(tenant)
    .bind(msg_id)
    .bind(i64::from(pid))
    .execute(&mut **tx)
    .await?;
    let nth = BEGUN.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    if nth == HOLD_AT.load(std::sync::atomic::Ordering::SeqCst) {
        say(&format!("begin {msg_id} {delivered} hold"));
        tokio::time::sleep(Duration::from_secs(60)).await;
    } else {
        say(&format!("begin {msg_id} {delivered}"));
    }
    let pause = if order.slow { 1500 } else { 200 };
    tokio::time::sleep(Duration::from_millis(pause)).await;
    Ok(Billed { pid })
}

/// The same on MariaDB/MySQL.
#[idempotent(scope = "nats.storm.billing_mysql", key = msg_id, tenant = tenant, tx = tx,
             lease = "2s", in_progress = reject, skip(delivered))]
async fn bill_mysql(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    msg_id: &str,
    order: &StormOrder,
    delivered: i64,
) -> Result<Billed, WorkerError> {
    if order.fail_first && delivered == 1 {
        return Err(WorkerError::FirstDeliveryFails);
    }
    let pid = std::process::id();
    sqlx::query(
        "INSERT INTO idempotent_test_nats_effects (tenant, consumer, msg_id, pid) VALUES (?, 'storm', ?, ?)",
    )
    .bind(tenant)
    .bind(msg_id)
    .bind(i64::from(pid))
    .execute(&mut **tx)
    .await?;
    let nth = BEGUN.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    if nth == HOLD_AT.load(std::sync::atomic::Ordering::SeqCst) {
        say(&format!("begin {msg_id} {delivered} hold"));
        tokio::time::sleep(Duration::from_secs(60)).await;
    } else {
        say(&format!("begin {msg_id} {delivered}"));
    }
    let pause = if order.slow { 1500 } else { 200 };
    tokio::time::sleep(Duration::from_millis(pause)).await;
    Ok(Billed { pid })
}

/// The SQLite store of a `sqlite://` worker, for its recover hook.
static SQLITE: std::sync::OnceLock<idempotent_runtime::SqliteStore> = std::sync::OnceLock::new();

/// Rule 20 for the store-mode worker: a takeover asks whether the killed
/// delivery's effect is there; if so it is the answer, and the body does not
/// run again.
async fn effect_written(
    takeover: &idempotent_runtime::Takeover,
) -> Result<idempotent_runtime::Recovery<Billed>, WorkerError> {
    let Some(store) = SQLITE.get() else {
        return Ok(idempotent_runtime::Recovery::Run);
    };
    let pid: Option<i64> = sqlx::query_scalar(
        "SELECT pid FROM idempotent_test_nats_effects WHERE tenant = ? AND consumer = 'storm' AND msg_id = ?",
    )
    .bind(takeover.tenant())
    .bind(takeover.key())
    .fetch_optional(store.pool())
    .await?;
    say(&format!(
        "recover {} {}",
        takeover.key(),
        takeover.attempt()
    ));
    Ok(match pid {
        Some(pid) => idempotent_runtime::Recovery::Completed(Billed {
            pid: u32::try_from(pid).unwrap_or(0),
        }),
        None => idempotent_runtime::Recovery::Run,
    })
}

/// The same in store mode on SQLite, with the hook.
#[idempotent(scope = "nats.storm.billing_sqlite", key = msg_id, tenant = tenant, store = store,
             lease = "2s", in_progress = reject, skip(delivered), recover = effect_written)]
async fn bill_sqlite(
    store: &idempotent_runtime::SqliteStore,
    tenant: &str,
    msg_id: &str,
    order: &StormOrder,
    delivered: i64,
) -> Result<Billed, WorkerError> {
    if order.fail_first && delivered == 1 {
        return Err(WorkerError::FirstDeliveryFails);
    }
    let pid = std::process::id();
    sqlx::query(
        "INSERT INTO idempotent_test_nats_effects (tenant, consumer, msg_id, pid) VALUES (?, 'storm', ?, ?)",
    )
    .bind(tenant)
    .bind(msg_id)
    .bind(i64::from(pid))
    .execute(store.pool())
    .await?;
    let nth = BEGUN.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    if nth == HOLD_AT.load(std::sync::atomic::Ordering::SeqCst) {
        say(&format!("begin {msg_id} {delivered} hold"));
        tokio::time::sleep(Duration::from_secs(60)).await;
    } else {
        say(&format!("begin {msg_id} {delivered}"));
    }
    let pause = if order.slow { 1500 } else { 200 };
    tokio::time::sleep(Duration::from_millis(pause)).await;
    Ok(Billed { pid })
}

/// The database the worker bills in.
#[derive(Clone)]
enum Db {
    Pg(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
    Sqlite(idempotent_runtime::SqliteStore),
}

/// One delivery: bill in a transaction, commit, settle.
async fn deliver(db: &Db, tenant: &str, message: jetstream::Message) {
    let delivered = message.info().map(|i| i.delivered).unwrap_or(0);
    let Ok(order) = serde_json::from_slice::<StormOrder>(&message.payload) else {
        let _ = settle(&message, Disposition::Term).await;
        say("error undecodable payload");
        return;
    };
    let order = &order;
    let handled = handle(message_key(&message), |msg_id| async move {
        match db {
            Db::Pg(pool) => {
                let mut tx = pool.begin().await?;
                let billed = bill(&mut tx, tenant, msg_id, order, delivered).await?;
                tx.commit().await?;
                Ok::<_, WorkerError>(billed)
            }
            Db::MySql(pool) => {
                let mut tx = pool.begin().await?;
                let billed = bill_mysql(&mut tx, tenant, msg_id, order, delivered).await?;
                tx.commit().await?;
                Ok(billed)
            }
            Db::Sqlite(store) => Ok(bill_sqlite(store, tenant, msg_id, order, delivered).await?),
        }
    })
    .await;
    let disposition = handled.disposition();
    let shown = if order.lose_first_ack && delivered == 1 && disposition == Disposition::Ack {
        "lost".to_owned()
    } else {
        match settle(&message, disposition).await {
            Ok(()) => disposition.to_string(),
            Err(e) => format!("unsettled({e})").replace(' ', "_"),
        }
    };
    let key = message_key(&message).unwrap_or("-");
    say(&format!(
        "delivery {key} {delivered} {} {shown}",
        handled.verdict
    ));
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, db_url, nats_url, stream, durable, tenant, deadline_ms, hold_after] = &args[..] else {
        eprintln!("usage: idempotent-nats-worker <db_url> <nats_url> <stream> <durable> <tenant> <deadline_ms> <hold_after>");
        std::process::exit(2);
    };
    let hold_after: usize = hold_after.parse().expect("hold_after is a number");
    if hold_after > 0 {
        HOLD_AT.store(hold_after + 1, std::sync::atomic::Ordering::SeqCst);
    }
    let deadline_ms: u64 = deadline_ms.parse().expect("deadline_ms is a number");
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let run_for = Duration::from_millis(deadline_ms.saturating_sub(now_ms));

    let db = if db_url.starts_with("sqlite:") {
        let store = idempotent_runtime::SqliteStore::connect(db_url)
            .await
            .expect("open the SQLite store");
        let _ = SQLITE.set(store.clone());
        Db::Sqlite(store)
    } else if db_url.starts_with("mysql://") || db_url.starts_with("mariadb://") {
        Db::MySql(
            sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(6)
                .connect(db_url)
                .await
                .expect("connect to MariaDB/MySQL"),
        )
    } else {
        Db::Pg(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(6)
                .connect(db_url)
                .await
                .expect("connect to PostgreSQL"),
        )
    };
    let client = async_nats::connect(nats_url.as_str())
        .await
        .expect("connect to NATS");
    let js = jetstream::new(client);
    let consumer: PullConsumer = js
        .get_stream(stream)
        .await
        .expect("the stream exists")
        .get_consumer(durable)
        .await
        .expect("the durable consumer exists");
    say(&format!("ready {}", std::process::id()));

    let tenant: Arc<str> = tenant.as_str().into();
    // At most three deliveries in flight; a few more wait in the client's
    // buffer, where their ack_wait runs too (so the server redelivers some).
    let permits = Arc::new(tokio::sync::Semaphore::new(3));
    let run = async {
        loop {
            // One pull request of four at a time (async-nats's `stream()`
            // can miss its next request under load and wait out the last
            // one's 30 s expiry: tests/nats/nats_consumer.rs, pulled_in_turn).
            let mut messages = match consumer.sequence(4) {
                Ok(batches) => batches.try_flatten(),
                Err(e) => {
                    say(&format!("error pull: {e}"));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            while let Some(next) = messages.next().await {
                let message = match next {
                    Ok(m) => m,
                    Err(e) => {
                        say(&format!("error message: {e}"));
                        continue;
                    }
                };
                let permit = permits
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("semaphore open");
                let (db, tenant) = (db.clone(), tenant.clone());
                tokio::spawn(async move {
                    deliver(&db, &tenant, message).await;
                    drop(permit);
                });
            }
        }
    };
    let _ = tokio::time::timeout(run_for, run).await;
}
