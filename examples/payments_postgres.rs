//! The payment service on PostgreSQL in transactional mode: the charge row
//! and the idempotency record are written in one transaction, so they commit
//! or roll back together. Run it with:
//!
//! ```text
//! cargo run --example payments_postgres
//! ```
//!
//! The server is `IDEMPOTENT_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`). Each run uses its own accounts
//! (tenants), so it can be run again without cleaning up; the row counts
//! printed below are the proof.

use idempotent_runtime::{idempotent, with_outcome, Error, Identity, Outcome, PgStore, Store};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Transaction};
use std::time::Duration;

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
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Idempotency(#[from] Error),
}

/// Charges `account` once per idempotency key, in the caller's transaction:
/// the reservation, the charge row and the recorded receipt are all written in
/// `tx` and become visible together when the caller commits.
#[idempotent(scope = "payments.charge", key = key, tenant = account, tx = tx)]
async fn charge(
    tx: &mut Transaction<'_, Postgres>,
    account: &str,
    key: &str,
    request: &ChargeRequest,
) -> Result<Receipt, ChargeError> {
    // Stand-in for the card gateway: a little latency, then the charge row.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let charge_id: i64 = sqlx::query_scalar(
        "INSERT INTO idempotent_example_charges (account, amount_cents, currency)
         VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(account)
    .bind(request.amount_cents as i64)
    .bind(&request.currency)
    .fetch_one(&mut **tx)
    .await?;
    Ok(Receipt {
        charge_id,
        amount_cents: request.amount_cents,
    })
}

/// A request handler: begin, charge, commit.
async fn handle(
    pool: &PgPool,
    account: &str,
    key: &str,
    request: &ChargeRequest,
) -> (Result<Receipt, ChargeError>, Option<Outcome>) {
    let mut tx = match pool.begin().await {
        Ok(tx) => tx,
        Err(e) => return (Err(e.into()), None),
    };
    let (result, outcome) = with_outcome(charge(&mut tx, account, key, request)).await;
    if result.is_ok() {
        if let Err(e) = tx.commit().await {
            return (Err(e.into()), outcome);
        }
    }
    (result, outcome)
}

async fn charges_for(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_example_charges WHERE account = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap_or(-1)
}

/// What the store holds for (account, payments.charge, key).
async fn record_for(store: &PgStore, account: &str, key: &str) -> String {
    let identity = match Identity::new(account, "payments.charge", key) {
        Ok(identity) => identity,
        Err(e) => return e.to_string(),
    };
    match store.fetch(&identity).await {
        Ok(Some(record)) => format!("{:?}", record.state).to_lowercase(),
        Ok(None) => "none".into(),
        Err(e) => e.to_string(),
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
    let url = std::env::var("IDEMPOTENT_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    // Enough connections for 20 concurrent requests, each holding a transaction.
    let pool = PgPoolOptions::new()
        .max_connections(24)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS idempotent_example_charges (
             id BIGSERIAL PRIMARY KEY, account TEXT NOT NULL,
             amount_cents BIGINT NOT NULL, currency TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    // Applies the idempotency migrations; in transactional mode the records
    // are written through the caller's transaction, not through the store.
    let store = PgStore::from_pool(pool.clone()).await?;
    let run = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let [alice, bob, carol] = ["alice", "bob", "carol"].map(|name| format!("acct_{name}_{run}"));
    println!("idempotent demo — payment service on PostgreSQL, transactional mode (run {run})\n");

    let coffee = ChargeRequest {
        amount_cents: 450,
        currency: "EUR".into(),
    };

    // 1. A first call executes: the charge row and the record commit together.
    let (r, o) = handle(&pool, &alice, "key-A1", &coffee).await;
    let first = r?;
    println!(
        "1. first call             -> {:<8} charge #{} for {} cents; record: {}",
        describe(o),
        first.charge_id,
        first.amount_cents,
        record_for(&store, &alice, "key-A1").await
    );

    // 2. A retry with the same key replays the recorded receipt; the body does not run.
    let (r, o) = handle(&pool, &alice, "key-A1", &coffee).await;
    let again = r?;
    assert_eq!(again, first);
    println!(
        "2. retry, same key        -> {:<8} charge #{} (same receipt); alice has {} charge row(s)",
        describe(o),
        again.charge_id,
        charges_for(&pool, &alice).await
    );

    // 3. The body runs, but the caller's transaction rolls back afterwards
    //    (say, saving the order failed): the charge row and the reservation go
    //    with it, so the key is free and the retry executes.
    let mut tx = pool.begin().await?;
    let (r, o) = with_outcome(charge(&mut tx, &carol, "key-C1", &coffee)).await;
    let doomed = r?;
    tx.rollback().await?;
    println!(
        "3. caller rolls back      -> {:<8} charge #{} undone; carol has {} charge row(s); record: {}",
        describe(o),
        doomed.charge_id,
        charges_for(&pool, &carol).await,
        record_for(&store, &carol, "key-C1").await
    );
    let (r, o) = handle(&pool, &carol, "key-C1", &coffee).await;
    println!(
        "   retry                  -> {:<8} charge #{}; carol has {} charge row(s); record: {}",
        describe(o),
        r?.charge_id,
        charges_for(&pool, &carol).await,
        record_for(&store, &carol, "key-C1").await
    );

    // 4. Twenty concurrent duplicates, each in its own transaction: the first
    //    holds the row lock until it commits, the others wait for it and replay.
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (pool, bob) = (pool.clone(), bob.clone());
        let req = ChargeRequest {
            amount_cents: 1999,
            currency: "EUR".into(),
        };
        tasks.push(tokio::spawn(async move {
            handle(&pool, &bob, "key-B1", &req).await
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
    println!(
        "4. 20 concurrent dups     -> {executed} executed, {replayed} replayed; bob has {} charge row(s)",
        charges_for(&pool, &bob).await
    );

    // 5. The same key with a different request is refused: a client bug, not a retry.
    let pricier = ChargeRequest {
        amount_cents: 50_000,
        currency: "EUR".into(),
    };
    match handle(&pool, &alice, "key-A1", &pricier).await {
        (Err(ChargeError::Idempotency(e @ Error::FingerprintMismatch(_))), _) => {
            println!("5. same key, new amount   -> refused  ({e})")
        }
        other => println!("5. unexpected: {other:?}"),
    }
    Ok(())
}
