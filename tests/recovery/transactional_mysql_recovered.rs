//! Rule 20 in transactional mode on MariaDB, as `transactional.rs` checks it
//! on SQLite and PostgreSQL: a transaction that takes over a stuck record
//! asks the hook; its `Completed` answer is recorded in the caller's
//! transaction (marked recovered, attempt 2) when it commits and replayed
//! afterwards without asking; rolled back, the record is as before; a
//! hook's `Run` runs the body in the transaction as attempt 2.

use crate::common;
use crate::transactional::{asked, found_by_key, mysql_begin_in_the_next_second, state, tenant};
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

    // Rolled back: the takeover and the recorded answer vanish together.
    let mut tx = mysql_begin_in_the_next_second(store.pool().clone()).await;
    let (got, o) = with_outcome(charge(&mut tx, &t, "found-1")).await;
    assert_eq!(
        (got.unwrap(), o),
        ("recovered found-1".to_owned(), Some(Outcome::Recovered))
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        state(&store, &found).await,
        (RecordState::InProgress, 1, false)
    );

    // Committed: complete, attempt 2, recovered; then replayed.
    let mut tx = mysql_begin_in_the_next_second(store.pool().clone()).await;
    let (got, o) = with_outcome(charge(&mut tx, &t, "found-1")).await;
    assert_eq!(
        (got.unwrap(), o),
        ("recovered found-1".to_owned(), Some(Outcome::Recovered))
    );
    tx.commit().await.unwrap();
    assert_eq!(
        state(&store, &found).await,
        (RecordState::Complete, 2, true)
    );
    assert_eq!(
        asked(&t),
        [2, 2],
        "asked as attempt 2, in both transactions"
    );
    let mut tx = store.pool().begin().await.unwrap();
    let (got, o) = with_outcome(charge(&mut tx, &t, "found-1")).await;
    assert_eq!(
        (got.unwrap(), o),
        ("recovered found-1".to_owned(), Some(Outcome::Replayed))
    );
    tx.commit().await.unwrap();
    assert_eq!(asked(&t), [2, 2], "a replay does not ask");

    // Run: the body runs in the transaction, as attempt 2.
    let mut tx = mysql_begin_in_the_next_second(store.pool().clone()).await;
    let (got, o) = with_outcome(charge(&mut tx, &t, "missing-1")).await;
    assert_eq!(
        (got.unwrap(), o),
        ("ran missing-1".to_owned(), Some(Outcome::Executed))
    );
    tx.commit().await.unwrap();
    assert_eq!(
        state(&store, &missing).await,
        (RecordState::Complete, 2, false)
    );
    assert_eq!(asked(&t), [2, 2, 2]);
}
