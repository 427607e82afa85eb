//! A small payment service on an embedded SQLite file, showing what
//! `#[idempotent]` does. Run it with:
//!
//! ```text
//! cargo run --example payments
//! ```
//!
//! Every charge writes a row to a `charges` table in the same database as the
//! idempotency records; the row counts printed below are the proof.

use idempotent_runtime::{idempotent, with_outcome, Error, Outcome, SqliteStore};
use serde::{Deserialize, Serialize};
use sqlx::SqlitePool;
use std::sync::Arc;

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
}

impl Payments {
    /// Charges `account` once per idempotency key, however often the request arrives.
    #[idempotent(scope = "payments.charge", key = key, tenant = account, store = self.store)]
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
        let id = sqlx::query("INSERT INTO charges (account, amount_cents) VALUES (?, ?)")
            .bind(account)
            .bind(request.amount_cents as i64)
            .execute(&self.db)
            .await?
            .last_insert_rowid();
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join(format!("idempotent-payments-{}.db", std::process::id()));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let db = SqlitePool::connect(&url).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, account TEXT NOT NULL, amount_cents INTEGER NOT NULL)",
    )
    .execute(&db)
    .await?;
    let store = SqliteStore::from_pool(db.clone()).await?;
    let svc = Arc::new(Payments {
        db,
        store,
        gateway_up: true.into(),
    });
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

    // What this binary claims (one line in any service; see "Choosing a scope" in the README).
    println!("\nregistered scopes:");
    idempotent_runtime::registry::print_table();
    let _ = std::fs::remove_file(&path);
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}
