//! Transactional mode on SQLite: `TransactionalConnection` for
//! `sqlx::SqliteConnection` and `sqlx::Transaction<'_, Sqlite>`, writing to the
//! `idempotency_records` table that [`SqliteStore`](crate::SqliteStore) creates
//! (open the database with `SqliteStore` once so its migrations have run).
//!
//! SQLite locks the whole database, not a row: once the caller's transaction
//! has written the reservation, another connection's writes wait for it. A
//! duplicate in another transaction waits at most `lock_wait` (the
//! connection's `busy_timeout`, set for the statement and restored after) and
//! then answers `InProgress`.

use super::*;
use crate::error::Error;
use sqlx::{Executor, SqliteConnection};

use super::sqlite::{complete_on, release_on, reserve_in};

fn err(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| StoreError::new("sqlite", operation, e)
}

/// SQLITE_BUSY / SQLITE_LOCKED (and their extended codes): another
/// transaction holds the write lock.
fn is_busy(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i64>().ok())
            .is_some_and(|c| matches!(c & 0xff, 5 | 6)),
        _ => false,
    }
}

async fn reserve_on(
    conn: &mut SqliteConnection,
    request: ReserveRequest<'_>,
    lock_wait: Duration,
) -> Result<Reservation, StoreError> {
    const OP: &str = "reserve";
    let previous: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(&mut *conn)
        .await
        .map_err(err(OP))?;
    conn.execute(
        format!(
            "PRAGMA busy_timeout = {}",
            duration_to_millis(lock_wait).min(i64::from(i32::MAX))
        )
        .as_str(),
    )
    .await
    .map_err(err(OP))?;
    let answer = reserve_in(conn, request).await;
    conn.execute(format!("PRAGMA busy_timeout = {previous}").as_str())
        .await
        .map_err(err(OP))?;
    match answer {
        Err(e) if is_busy(&e) => Ok(Reservation::InProgress {
            lease_remaining: request.lease,
        }),
        other => other.map_err(err(OP)),
    }
}

/// Transactional mode on a SQLite connection: the reservation and the
/// recorded result are statements in the connection's current transaction.
///
/// ```no_run
/// use idempotent_runtime::transaction::TransactionalConnection;
/// fn assert_tx<C: TransactionalConnection + ?Sized>() {}
/// assert_tx::<sqlx::SqliteConnection>();
/// assert_tx::<sqlx::Transaction<'static, sqlx::Sqlite>>();
/// ```
#[async_trait::async_trait]
impl crate::transaction::TransactionalConnection for SqliteConnection {
    fn store_name(&self) -> &'static str {
        "sqlite"
    }

    /// SQLite itself knows: `sqlite3_get_autocommit` is zero inside a
    /// transaction, whether sqlx began it or a plain `BEGIN` did. No round trip.
    async fn in_transaction(&mut self) -> Result<bool, StoreError> {
        if sqlx::Connection::is_in_transaction(self) {
            return Ok(true);
        }
        let mut handle = self
            .lock_handle()
            .await
            .map_err(err("check for an open transaction"))?;
        // SAFETY: the handle is a live connection, locked for our exclusive use
        // while `handle` is held; sqlite3_get_autocommit only reads its state.
        let autocommit =
            unsafe { libsqlite3_sys::sqlite3_get_autocommit(handle.as_raw_handle().as_ptr()) };
        Ok(autocommit == 0)
    }

    async fn reserve_in_transaction(
        &mut self,
        request: ReserveRequest<'_>,
        lock_wait: Duration,
    ) -> Result<Reservation, Error> {
        Ok(reserve_on(self, request, lock_wait).await?)
    }

    async fn complete_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        complete_on(&mut *self, identity, token, outcome, ttl).await
    }

    async fn release_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<bool, StoreError> {
        release_on(&mut *self, identity, token).await
    }
}
