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
use sqlx::{Executor, Row, Sqlite, SqliteConnection};

const STORE: &str = "sqlite";
const MAX_DURATION_MS: i64 = 1 << 60;

macro_rules! now_ms {
    () => {
        "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
    };
}

macro_rules! row_expired {
    () => {
        concat!(
            "(expires_at <= ",
            now_ms!(),
            " AND (state = 'complete' OR COALESCE(lease_expires_at, 0) <= ",
            now_ms!(),
            "))"
        )
    };
}

/// Inserts, replaces an expired record, or takes over an expired lease whose
/// fingerprint agrees; returns a row only when this call acquired the record.
const RESERVE_SQL: &str = concat!(
    "INSERT INTO idempotency_records ",
    "(tenant, scope, key, state, fingerprint, owner_token, lease_expires_at, expires_at, ",
    "created_at, completed_at, takeover_count, is_error, result) ",
    "VALUES (?1, ?2, ?3, 'in_progress', ?4, ?5, ",
    now_ms!(),
    " + ?6, ",
    now_ms!(),
    " + ?7, ",
    now_ms!(),
    ", NULL, 0, 0, NULL) ",
    "ON CONFLICT (tenant, scope, key) DO UPDATE SET ",
    "state = 'in_progress', fingerprint = excluded.fingerprint, ",
    "owner_token = excluded.owner_token, lease_expires_at = excluded.lease_expires_at, ",
    "expires_at = excluded.expires_at, ",
    "created_at = CASE WHEN ",
    row_expired!(),
    " THEN excluded.created_at ELSE created_at END, ",
    "completed_at = NULL, ",
    "takeover_count = CASE WHEN ",
    row_expired!(),
    " THEN 0 ELSE takeover_count + 1 END, ",
    "is_error = 0, result = NULL ",
    "WHERE ",
    row_expired!(),
    " OR (state = 'in_progress' AND lease_expires_at <= ",
    now_ms!(),
    " AND (fingerprint IS NULL OR excluded.fingerprint IS NULL ",
    "OR fingerprint = excluded.fingerprint)) ",
    "RETURNING takeover_count"
);

const EXISTING_SQL: &str = concat!(
    "SELECT state, fingerprint, lease_expires_at - ",
    now_ms!(),
    " AS lease_remaining, is_error, result FROM idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3"
);

const COMPLETE_SQL: &str = concat!(
    "UPDATE idempotency_records SET state = 'complete', owner_token = NULL, ",
    "lease_expires_at = NULL, completed_at = ",
    now_ms!(),
    ", expires_at = ",
    now_ms!(),
    " + ?5, is_error = ?6, result = ?7 ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 ",
    "AND state = 'in_progress' AND owner_token = ?4"
);

const RELEASE_SQL: &str = concat!(
    "DELETE FROM idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 ",
    "AND state = 'in_progress' AND owner_token = ?4"
);

fn err(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| StoreError::new(STORE, operation, e)
}

fn ms(d: Duration) -> i64 {
    duration_to_millis(d).min(MAX_DURATION_MS)
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
            ms(lock_wait).min(i64::from(i32::MAX))
        )
        .as_str(),
    )
    .await
    .map_err(err(OP))?;
    let answer = reserve_inner(conn, request).await;
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

async fn reserve_inner(
    conn: &mut SqliteConnection,
    request: ReserveRequest<'_>,
) -> Result<Reservation, sqlx::Error> {
    let id = request.identity;
    let fingerprint = request.fingerprint.map(Fingerprint::as_str);
    for _ in 0..2 {
        let acquired: Option<i64> = sqlx::query_scalar(RESERVE_SQL)
            .bind(&id.tenant)
            .bind(&id.scope)
            .bind(&id.key)
            .bind(fingerprint)
            .bind(request.token.as_str())
            .bind(ms(request.lease))
            .bind(ms(request.ttl))
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(takeovers) = acquired {
            return Ok(Reservation::Acquired {
                took_over: takeovers > 0,
            });
        }
        let Some(row) = sqlx::query(EXISTING_SQL)
            .bind(&id.tenant)
            .bind(&id.scope)
            .bind(&id.key)
            .fetch_optional(&mut *conn)
            .await?
        else {
            continue;
        };
        let stored_fp: Option<String> = row.try_get("fingerprint")?;
        let state: String = row.try_get("state")?;
        if fingerprints_conflict(stored_fp.as_deref(), fingerprint) {
            return Ok(Reservation::FingerprintMismatch);
        }
        if RecordState::parse(&state) == Some(RecordState::Complete) {
            let is_error: bool = row.try_get("is_error")?;
            let result: Option<Vec<u8>> = row.try_get("result")?;
            return Ok(Reservation::Completed(StoredOutcome {
                is_error,
                payload: result.unwrap_or_else(|| b"null".to_vec()),
            }));
        }
        if let Some(ms) = row.try_get::<Option<i64>, _>("lease_remaining")? {
            if ms > 0 {
                return Ok(Reservation::InProgress {
                    lease_remaining: millis_to_duration(ms),
                });
            }
        }
    }
    Ok(Reservation::InProgress {
        lease_remaining: Duration::ZERO,
    })
}

async fn complete_on<'e, E: Executor<'e, Database = Sqlite>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
    outcome: &StoredOutcome,
    ttl: Duration,
) -> Result<bool, StoreError> {
    let done = sqlx::query(COMPLETE_SQL)
        .bind(&identity.tenant)
        .bind(&identity.scope)
        .bind(&identity.key)
        .bind(token.as_str())
        .bind(ms(ttl))
        .bind(outcome.is_error)
        .bind(&outcome.payload[..])
        .execute(executor)
        .await
        .map_err(err("complete"))?;
    Ok(done.rows_affected() > 0)
}

async fn release_on<'e, E: Executor<'e, Database = Sqlite>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
) -> Result<bool, StoreError> {
    let done = sqlx::query(RELEASE_SQL)
        .bind(&identity.tenant)
        .bind(&identity.scope)
        .bind(&identity.key)
        .bind(token.as_str())
        .execute(executor)
        .await
        .map_err(err("release"))?;
    Ok(done.rows_affected() > 0)
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
    async fn reserve_in_transaction(
        &mut self,
        request: ReserveRequest<'_>,
        lock_wait: Duration,
    ) -> Result<Reservation, StoreError> {
        reserve_on(self, request, lock_wait).await
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

#[async_trait::async_trait]
impl crate::transaction::TransactionalConnection for sqlx::Transaction<'_, Sqlite> {
    async fn reserve_in_transaction(
        &mut self,
        request: ReserveRequest<'_>,
        lock_wait: Duration,
    ) -> Result<Reservation, StoreError> {
        reserve_on(&mut **self, request, lock_wait).await
    }

    async fn complete_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        complete_on(&mut **self, identity, token, outcome, ttl).await
    }

    async fn release_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<bool, StoreError> {
        release_on(&mut **self, identity, token).await
    }
}
