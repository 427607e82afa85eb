//! A small payment service on an embedded SQLite file, showing what
//! `#[idempotent]` does. Run it with:
//!
//! ```text
//! cargo run --example payments
//! ```
//!
//! Every charge writes a row to a `charges` table in the same database as the
//! idempotency records (the stand-in for a card gateway, which knows each
//! charge by its idempotency key); the row counts printed below are the proof.
//!
//! Step 7 crashes for real: the example starts itself again as a child
//! process that charges a card and aborts before the result is recorded. The
//! retry takes the dead owner's record over and, before charging again, its
//! `recover` hook asks the gateway by the key whether the charge happened.
//! At the end it prints the metrics the runtime reported (through the
//! `metrics` facade; here read back with a debugging recorder, in a service
//! an exporter such as Prometheus).

use idempotent_runtime::{
    idempotent, with_outcome, Error, Outcome, Recovery, SqliteStore, Store, Takeover,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use serde::{Deserialize, Serialize};
use sqlx::SqlitePool;
use std::sync::{Arc, OnceLock};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct ChargeRequest {
    amount_cents: u64,
    currency: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Receipt {
    charge_id: i64,
    amount_cents: u64,
}

#[derive(Debug, thiserror::Error)]
enum ChargeError {
    #[error("the card gateway is unavailable; try again")]
    GatewayUnavailable,
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Idempotency(#[from] Error),
}

/// The payment service: a database pool and a store sharing it.
struct Payments {
    db: SqlitePool,
    store: SqliteStore,
    gateway_up: std::sync::atomic::AtomicBool,
    /// The child process of step 7: abort right after the card is charged.
    crash_after_charge: bool,
}

/// The gateway's records, for the recover hook (a plain `async fn(&Takeover)`).
static GATEWAY: OnceLock<SqlitePool> = OnceLock::new();

/// Rule 20: before a takeover charges again, ask the gateway by the
/// idempotency key whether the crashed attempt's charge went through.
async fn charge_happened(takeover: &Takeover) -> Result<Recovery<Receipt>, ChargeError> {
    let gateway = GATEWAY.get().ok_or(ChargeError::GatewayUnavailable)?;
    let found: Option<(i64, i64)> =
        sqlx::query_as("SELECT id, amount_cents FROM charges WHERE account = ? AND idem_key = ?")
            .bind(takeover.tenant())
            .bind(takeover.key())
            .fetch_optional(gateway)
            .await?;
    Ok(match found {
        Some((charge_id, amount)) => Recovery::Completed(Receipt {
            charge_id,
            amount_cents: amount as u64,
        }),
        None => Recovery::Run,
    })
}

impl Payments {
    /// Charges `account` once per idempotency key, however often the request arrives.
    #[idempotent(scope = "payments.charge", key = key, tenant = account, store = self.store,
                 lease = "2s", recover = charge_happened)]
    async fn charge(
        &self,
        account: &str,
        key: &str,
        request: &ChargeRequest,
    ) -> Result<Receipt, ChargeError> {
        if !self.gateway_up.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ChargeError::GatewayUnavailable);
        }
        // Stand-in for the card gateway: a little latency, then the charge row.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let id =
            sqlx::query("INSERT INTO charges (account, amount_cents, idem_key) VALUES (?, ?, ?)")
                .bind(account)
                .bind(request.amount_cents as i64)
                .bind(key)
                .execute(&self.db)
                .await?
                .last_insert_rowid();
        if self.crash_after_charge {
            // The card is charged; the process dies before the receipt is recorded.
            std::process::abort();
        }
        Ok(Receipt {
            charge_id: id,
            amount_cents: request.amount_cents,
        })
    }

    async fn charges_for(&self, account: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM charges WHERE account = ?")
            .bind(account)
            .fetch_one(&self.db)
            .await
            .unwrap_or(-1)
    }
}

fn describe(outcome: Option<Outcome>) -> &'static str {
    match outcome {
        Some(Outcome::Executed) => "executed",
        Some(Outcome::Replayed) => "replayed",
        Some(Outcome::Recovered) => "recovered",
        None => "refused",
    }
}

/// Opens the service on the database file at `path`.
async fn open(
    path: &std::path::Path,
    crash_after_charge: bool,
) -> Result<Payments, Box<dyn std::error::Error>> {
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let db = SqlitePool::connect(&url).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, account TEXT NOT NULL, \
         amount_cents INTEGER NOT NULL, idem_key TEXT NOT NULL)",
    )
    .execute(&db)
    .await?;
    let _ = GATEWAY.set(db.clone());
    let store = SqliteStore::from_pool(db.clone()).await?;
    Ok(Payments {
        db,
        store,
        gateway_up: true.into(),
        crash_after_charge,
    })
}

const CRASH_FLAG: &str = "--crash-after-charge";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, path] = &args[..] {
        if flag == CRASH_FLAG {
            // Step 7's child: charge erin's card, then die (see `charge`).
            let svc = open(std::path::Path::new(path), true).await?;
            let req = ChargeRequest {
                amount_cents: 1250,
                currency: "EUR".into(),
            };
            svc.charge("acct_erin", "key-E1", &req).await?;
            return Err("the child should have crashed after the charge".into());
        }
    }

    // Counters and histograms the runtime reports through the `metrics`
    // facade; a service would install an exporter here instead.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install()?;

    let path = std::env::temp_dir().join(format!("idempotent-payments-{}.db", std::process::id()));
    let svc = Arc::new(open(&path, false).await?);
    println!(
        "idempotent demo — payment service on SQLite ({})\n",
        path.display()
    );

    let coffee = ChargeRequest {
        amount_cents: 450,
        currency: "EUR".into(),
    };

    // 1. A first call executes.
    let (r, o) = with_outcome(svc.charge("acct_alice", "key-A1", &coffee)).await;
    let first = r?;
    println!(
        "1. first call           -> {:<8} charge #{} for {} cents",
        describe(o),
        first.charge_id,
        first.amount_cents
    );

    // 2. A retry with the same key replays the recorded receipt; the body does not run.
    let (r, o) = with_outcome(svc.charge("acct_alice", "key-A1", &coffee)).await;
    let again = r?;
    assert_eq!(again, first);
    println!(
        "2. retry, same key      -> {:<8} charge #{} (same receipt); alice has {} charge row(s)",
        describe(o),
        again.charge_id,
        svc.charges_for("acct_alice").await
    );

    // 3. Twenty concurrent duplicates: one execution, nineteen replays.
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let svc = svc.clone();
        let req = ChargeRequest {
            amount_cents: 1999,
            currency: "EUR".into(),
        };
        tasks.push(tokio::spawn(async move {
            with_outcome(svc.charge("acct_bob", "key-B1", &req)).await
        }));
    }
    let (mut executed, mut replayed) = (0, 0);
    for t in tasks {
        match t.await? {
            (Ok(_), Some(Outcome::Executed)) => executed += 1,
            (Ok(_), Some(Outcome::Replayed)) => replayed += 1,
            (other, _) => println!("   unexpected: {other:?}"),
        }
    }
    println!("3. 20 concurrent dups   -> {executed} executed, {replayed} replayed; bob has {} charge row(s)",
        svc.charges_for("acct_bob").await);

    // 4. The same key with a different request is refused: a client bug, not a retry.
    let pricier = ChargeRequest {
        amount_cents: 50_000,
        currency: "EUR".into(),
    };
    match svc.charge("acct_alice", "key-A1", &pricier).await {
        Err(ChargeError::Idempotency(e @ Error::FingerprintMismatch(_))) => {
            println!("4. same key, new amount -> refused  ({e})")
        }
        other => println!("4. unexpected: {other:?}"),
    }

    // 5. A failing call releases the key; the retry executes.
    svc.gateway_up
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let reason = match svc.charge("acct_carol", "key-C1", &coffee).await {
        Err(e) => e.to_string(),
        Ok(r) => format!("unexpected success: {r:?}"),
    };
    println!("5. gateway down         -> failed   ({reason}); the key is released");
    svc.gateway_up
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (r, o) = with_outcome(svc.charge("acct_carol", "key-C1", &coffee)).await;
    println!(
        "   retry after recovery -> {:<8} charge #{}; carol has {} charge row(s)",
        describe(o),
        r?.charge_id,
        svc.charges_for("acct_carol").await
    );

    // 6. Another tenant's identical key is another record.
    let (r, o) = with_outcome(svc.charge("acct_dave", "key-A1", &coffee)).await;
    println!(
        "6. dave uses key-A1 too -> {:<8} charge #{} (alice's receipt was #{})",
        describe(o),
        r?.charge_id,
        first.charge_id
    );

    // 7. A crash after the side effect: the child charges erin's card and
    //    dies before recording the receipt. The retry takes the record over
    //    when the dead owner's lease (2 s) runs out, and asks the gateway first.
    let status = std::process::Command::new(std::env::current_exe()?)
        .args([CRASH_FLAG, &path.display().to_string()])
        .stderr(std::process::Stdio::null())
        .status()?;
    println!(
        "7. crash after charging -> the process died ({}); erin has {} charge row(s), no receipt recorded",
        if status.success() { "it did not?" } else { "aborted" },
        svc.charges_for("acct_erin").await
    );
    let erin = ChargeRequest {
        amount_cents: 1250,
        currency: "EUR".into(),
    };
    let (r, o) = with_outcome(svc.charge("acct_erin", "key-E1", &erin)).await;
    println!(
        "   retry, same key      -> {:<8} charge #{} (the recover hook found it at the gateway); erin has {} charge row(s)",
        describe(o),
        r?.charge_id,
        svc.charges_for("acct_erin").await
    );

    // What this binary claims (one line in any service; see "Choosing a scope" in the README).
    println!("\nregistered scopes:");
    idempotent_runtime::registry::print_table();

    // What operators see: the counters by scope and outcome (never by key or tenant).
    println!("\nmetrics:");
    let mut lines: Vec<String> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let (_, key) = key.into_parts();
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}=\"{}\"", l.key(), l.value()))
                .collect();
            let shown = match value {
                DebugValue::Counter(n) => n.to_string(),
                DebugValue::Histogram(v) if !v.is_empty() => format!("{} sample(s)", v.len()),
                _ => return None,
            };
            Some(format!("  {}{{{}}} {shown}", key.name(), labels.join(",")))
        })
        .collect();
    lines.sort();
    for line in lines {
        println!("{line}");
    }
    // Before exiting: calls dropped at shutdown are released by the store's
    // background thread; wait for it, so none stays in progress for its lease.
    svc.store
        .finish_background_work(std::time::Duration::from_secs(5))
        .await;
    let _ = std::fs::remove_file(&path);
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}
