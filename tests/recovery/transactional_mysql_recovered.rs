//! Rule 20 in transactional mode on MariaDB, as `transactional.rs` checks it
//! on SQLite and PostgreSQL: a transaction that takes over a stuck record
//! asks the hook; its `Completed` answer is recorded in the caller's
//! transaction (marked recovered, attempt 2) when it commits and replayed
//! afterwards without asking; rolled back, the record is as before; a
//! hook's `Run` runs the body in the transaction as attempt 2.

use crate::common;
use crate::transactional::{
    asked, found_by_key, mysql_begin_in_the_next_second, state, tenant,
    the_hooks_answer_is_recorded_in_the_transaction,
};
use idempotent_runtime::{idempotent, with_outcome, Error, Identity, Outcome, RecordState};
use std::time::Duration;

#[idempotent(scope = "huntb.rtx_mysql", key = key, tenant = tenant, tx = tx,
             recover = found_by_key)]
async fn charge(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
) -> Result<String, Error> {
    sqlx::query("SELECT 1")
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("test", "body", e)))?;
    Ok(format!("ran {key}"))
}

#[tokio::test]
async fn mysql_transaction_records_the_hooks_answer() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let t = tenant();
    let found = Identity::new(t.as_str(), "huntb.rtx_mysql", "found-1").unwrap();
    let missing = Identity::new(t.as_str(), "huntb.rtx_mysql", "missing-1").unwrap();
    // What a crashed store-mode owner leaves: in progress, its lease over.
    for identity in [&found, &missing] {
        common::records::acquire(
            &store,
            identity,
            None,
            Duration::ZERO,
            Duration::from_secs(3600),
        )
        .await;
    }

    the_hooks_answer_is_recorded_in_the_transaction!(
        store,
        |s: &idempotent_runtime::MySqlStore| mysql_begin_in_the_next_second(s.pool().clone()),
        |s: &idempotent_runtime::MySqlStore| {
            let pool = s.pool().clone();
            async move { pool.begin().await.unwrap() }
        },
        charge,
        t,
        found,
        missing
    );
}
