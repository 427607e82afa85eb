//! Rules 12 and 13 at the size limit for a *recorded error* (`errors =
//! record`), as a user's test would write it: an error whose JSON is exactly
//! the limit (the smaller of `MAX_RESULT_BYTES` and what the store can
//! record) is recorded and replayed, the body not run again; one byte more is
//! refused (`ResultTooLarge`, naming the scope, in place of the body's own
//! error), nothing recorded, the key free. On every store in store mode, and
//! on every SQL store in transactional mode, where the refusal leaves the
//! caller's transaction usable.

use crate::common;
use crate::tx_fixtures::{lite, my, pg};
use common::servers::{every_store, fresh_tenant};
use idempotent_runtime::{idempotent, with_outcome, Error, Identity, Outcome, Store};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU32, Ordering};

/// The body's error: recorded as its text alone (a newtype struct is
/// written as what it holds), so its JSON is its length plus the two quotes.
/// The framework's own refusals come as `Declined("framework: ...")`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Declined(String);

impl From<Error> for Declined {
    fn from(e: Error) -> Self {
        let limit = matches!(e, Error::ResultTooLarge { .. });
        Declined(format!("framework (too large: {limit}): {e}"))
    }
}

fn refused_as_too_large(answer: &Result<u32, Declined>, scope: &str) -> bool {
    matches!(answer, Err(Declined(m))
        if m.starts_with("framework (too large: true)") && m.contains(scope))
}

/// The error's text for a recorded JSON of exactly `bytes` bytes.
fn text_of(bytes: usize) -> String {
    "x".repeat(bytes - 2)
}

/// The limit a store records answers up to.
fn limit_of(store: &dyn Store) -> usize {
    store
        .max_result_bytes()
        .min(idempotent_runtime::MAX_RESULT_BYTES)
}

// ---------------------------------------------------------------- store mode, every store

#[idempotent(scope = "error_limits.store", key = key, tenant = tenant, store = store,
             skip(runs, bytes), errors = record, ttl = "1h")]
async fn declines(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    bytes: usize,
    runs: &AtomicU32,
) -> Result<u32, Declined> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(Declined(text_of(bytes)))
}

#[tokio::test]
async fn a_recorded_error_of_exactly_the_limit_is_recorded_and_one_byte_more_refused() {
    for (_, store) in every_store("error-limits").await {
        let (store, name) = (&*store, store.name());
        let tenant = fresh_tenant();
        let runs = AtomicU32::new(0);
        let limit = limit_of(store);

        let (first, how) = with_outcome(declines(store, &tenant, "max", limit, &runs)).await;
        assert_eq!(how, Some(Outcome::Executed), "{name}");
        assert_eq!(
            first.map_err(|Declined(m)| m.len()),
            Err(limit - 2),
            "{name}: the body's own error, recorded"
        );
        let (again, how) = with_outcome(declines(store, &tenant, "max", 3, &runs)).await;
        assert_eq!(how, Some(Outcome::Replayed), "{name}");
        assert_eq!(
            again.map_err(|Declined(m)| m.len()),
            Err(limit - 2),
            "{name}: the recorded error replayed"
        );

        let over = declines(store, &tenant, "over", limit + 1, &runs).await;
        assert!(
            refused_as_too_large(&over, "error_limits.store"),
            "{name}: one byte over: {:?}",
            over.map_err(|Declined(m)| m.chars().take(80).collect::<String>())
        );
        let id = Identity::new(&tenant, "error_limits.store", "over").expect("identity");
        assert_eq!(store.fetch(&id).await.expect("fetch"), None, "{name}");
        let (fits, how) = with_outcome(declines(store, &tenant, "over", 10, &runs)).await;
        assert_eq!(
            (fits, how),
            (Err(Declined(text_of(10))), Some(Outcome::Executed)),
            "{name}: the key was free"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{name}");
    }
}

// ---------------------------------------------------------------- transactional mode

static TX_RUNS: AtomicU32 = AtomicU32::new(0);

macro_rules! tx_declines {
    ($name:ident, $db:ty, $scope:literal) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(bytes), errors = record, ttl = "1h")]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            bytes: usize,
        ) -> Result<u32, Declined> {
            TX_RUNS.fetch_add(1, Ordering::SeqCst);
            Err(Declined(text_of(bytes)))
        }
    };
}

tx_declines!(pg_declines, sqlx::Postgres, "error_limits.pg_tx");
tx_declines!(my_declines, sqlx::MySql, "error_limits.my_tx");
tx_declines!(lite_declines, sqlx::Sqlite, "error_limits.lite_tx");

macro_rules! recorded_error_at_the_limit_in_a_transaction {
    ($store:expr, $pool:expr, $f:ident, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let limit = limit_of(store);

        let mut tx = pool.begin().await.expect("begin");
        let (first, how) = with_outcome($f(&mut tx, &tenant, "max", limit)).await;
        assert_eq!(how, Some(Outcome::Executed));
        assert_eq!(first.map_err(|Declined(m)| m.len()), Err(limit - 2));
        let over = $f(&mut tx, &tenant, "over", limit + 1).await;
        assert!(
            refused_as_too_large(&over, $scope),
            "one byte over: {:?}",
            over.map_err(|Declined(m)| m.chars().take(80).collect::<String>())
        );
        sqlx::query("SELECT 1")
            .execute(&mut *tx)
            .await
            .expect("the caller's transaction stays usable");
        tx.commit().await.expect("commit");
        let over = Identity::new(&tenant, $scope, "over").expect("identity");
        assert_eq!(store.fetch(&over).await.expect("fetch"), None);

        let mut tx = pool.begin().await.expect("begin");
        let (again, how) = with_outcome($f(&mut tx, &tenant, "max", 3)).await;
        assert_eq!(how, Some(Outcome::Replayed));
        assert_eq!(again.map_err(|Declined(m)| m.len()), Err(limit - 2));
        let (fits, how) = with_outcome($f(&mut tx, &tenant, "over", 10)).await;
        assert_eq!(
            (fits, how),
            (Err(Declined(text_of(10))), Some(Outcome::Executed))
        );
        tx.commit().await.expect("commit");
    }};
}

#[tokio::test]
async fn pg_a_recorded_error_of_exactly_the_limit_in_a_transaction() {
    let Some(db) = pg("SELECT 1").await else {
        return;
    };
    recorded_error_at_the_limit_in_a_transaction!(
        &db.0,
        db.0.pool(),
        pg_declines,
        "error_limits.pg_tx"
    );
}

#[tokio::test]
async fn mysql_a_recorded_error_of_exactly_the_limit_in_a_transaction() {
    let Some(db) = my("SELECT 1").await else {
        return;
    };
    recorded_error_at_the_limit_in_a_transaction!(
        &db.0,
        db.0.pool(),
        my_declines,
        "error_limits.my_tx"
    );
}

#[tokio::test]
async fn sqlite_a_recorded_error_of_exactly_the_limit_in_a_transaction() {
    let db = lite("error-limits-tx", "SELECT 1").await;
    recorded_error_at_the_limit_in_a_transaction!(
        &db.0,
        db.0.pool(),
        lite_declines,
        "error_limits.lite_tx"
    );
}
