//! [`PgStore`]: records in a PostgreSQL table shared by every instance of a service.
//!
//! # Schema
//!
//! One table, `idempotency_records`, with the primary key (tenant, scope, key)
//! and an index on `expires_at` that makes purging cheap. Tenant, scope and
//! key are `TEXT COLLATE "C"` (compared byte for byte); the recorded result is
//! `BYTEA`. Times are `BIGINT` milliseconds since the epoch computed by the
//! database with `clock_timestamp()` (not `now()`, which is frozen at the start
//! of a transaction). The migrations in `migrations/postgres` are embedded in
//! the binary and applied when a store opens, under a transaction-level
//! advisory lock, so many processes may open at once. They are recorded in
//! their own table, `idempotency_schema_migrations`, so they never mix with an
//! application's own `_sqlx_migrations`.
//!
//! # Round trips
//!
//! * `reserve`: one statement, `SELECT … FROM idempotency_reserve_autocommit(…)`
//!   (through the store) or `idempotency_reserve(…)` (in a caller's
//!   transaction), a plpgsql function that answers every case (acquire,
//!   replace an expired record, take over an expired lease, replay, in
//!   progress, mismatch). The transactional variant catches a lock timeout in
//!   a subtransaction so the caller's transaction stays usable; the store's
//!   statement is its own transaction, needs no subtransaction, and answers a
//!   lock timeout (SQLSTATE 55P03) as `InProgress`.
//! * `complete`, `release`, `heartbeat`: one `UPDATE`/`DELETE` each, fenced by
//!   the owner token.
//!
//! # Rows held by other transactions
//!
//! In transactional mode a reservation is an uncommitted row locked by its
//! owner's transaction. A reservation made through the store waits at most
//! [`PgStore::lock_wait`] (100 ms unless set with [`PgStore::with_lock_wait`])
//! for such a row and then answers `InProgress`; the engine's in-progress
//! policy decides whether to poll again.

use super::*;
use crate::error::Error;
use crate::transaction::TransactionalConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{Executor, Postgres, Row};
use std::str::FromStr;

const STORE: &str = "postgres";
/// How long `connect` and every statement wait for a pooled connection.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);
/// `pg_advisory_xact_lock` key held while migrations run ("idempotnt").
const MIGRATION_LOCK: i64 = 0x6964_656d_706f_746e;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

/// A store in PostgreSQL: many instances of a service share one database.
/// Cloning gives another handle to the same pool.
///
/// ```no_run
/// use idempotent_runtime::{set_default_store, PgStore};
/// # #[tokio::main] async fn main() -> Result<(), idempotent_runtime::Error> {
/// let store = PgStore::connect("postgres://postgres@127.0.0.1:5432/app").await?;
/// set_default_store(store);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    lock_wait: Duration,
    detached: std::sync::Arc<detached::Detached>,
}

impl PgStore {
    /// Connects (waiting at most [`ACQUIRE_TIMEOUT`], 5 s, for the server) and
    /// applies the migrations. A server that is down or unreachable gives an
    /// `Error::Store` naming the host and port, never a hang.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), idempotent_runtime::Error> {
    /// let store = idempotent_runtime::PgStore::connect("postgres://postgres@127.0.0.1/app").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::new(STORE, "connect", format!("bad database URL: {e}")))?;
        let (host, port) = (options.get_host().to_owned(), options.get_port());
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await
            .map_err(|e| {
                StoreError::new(
                    STORE,
                    "connect",
                    format!(
                        "could not connect to the PostgreSQL server at {host}:{port} \
                         within {ACQUIRE_TIMEOUT:?}: {e}"
                    ),
                )
            })?;
        Self::from_pool(pool).await
    }

    /// Uses an existing pool (the application's own) and applies the migrations.
    /// Give the pool an `acquire_timeout` so a stopped server fails fast.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), idempotent_runtime::Error> {
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await.unwrap();
    /// let store = idempotent_runtime::PgStore::from_pool(pool).await?;
    /// # Ok(()) }
    /// ```
    pub async fn from_pool(pool: PgPool) -> Result<Self, Error> {
        migrate(&pool)
            .await
            .map_err(|e| StoreError::new(STORE, "apply migrations", e))?;
        Ok(PgStore {
            detached: std::sync::Arc::new(background_worker(&pool)),
            pool,
            lock_wait: DEFAULT_LOCK_WAIT,
        })
    }

    /// Sets how long a reservation made through the store waits for a row
    /// locked by another transaction before answering `InProgress` (default 100 ms).
    ///
    /// ```no_run
    /// # async fn f(store: idempotent_runtime::PgStore) {
    /// let store = store.with_lock_wait(std::time::Duration::from_millis(20));
    /// # }
    /// ```
    pub fn with_lock_wait(mut self, lock_wait: Duration) -> Self {
        self.lock_wait = lock_wait;
        self
    }

    /// How long a reservation waits for a row locked by another transaction.
    pub fn lock_wait(&self) -> Duration {
        self.lock_wait
    }

    /// The pool the store uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// The worker that finishes dropped calls' records: its own small pool on its
/// own runtime, with the store pool's connection options.
fn background_worker(pool: &PgPool) -> detached::Detached {
    let options = pool.connect_options();
    detached::Detached::new(
        STORE,
        Box::new(move || {
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .connect_lazy_with((*options).clone());
            std::sync::Arc::new(move |identity, token, work| {
                let pool = pool.clone();
                Box::pin(async move {
                    match work {
                        detached::Work::Release => release_with(&pool, &identity, &token).await,
                        detached::Work::Complete(outcome, ttl) => {
                            complete_with(&pool, &identity, &token, &outcome, ttl, false).await
                        }
                    }
                })
            })
        }),
    )
}

/// Applies the embedded migrations once, in one transaction under an
/// advisory lock (waited for at most 60 s), recording them in
/// `idempotency_schema_migrations`.
async fn migrate(pool: &PgPool) -> Result<(), migrate::MigrationError> {
    migrate::run(
        &mut MigrationTransaction(Some(pool.begin().await?)),
        &MIGRATOR,
    )
    .await
}

/// The migration runner's view of PostgreSQL: one transaction for the whole run.
struct MigrationTransaction(Option<sqlx::Transaction<'static, Postgres>>);

impl MigrationTransaction {
    fn tx(&mut self) -> Result<&mut sqlx::PgConnection, sqlx::Error> {
        self.0.as_deref_mut().ok_or(sqlx::Error::PoolClosed)
    }
}

#[async_trait::async_trait]
impl migrate::MigrationBackend for MigrationTransaction {
    /// The advisory lock, waited for at most `LOCK_TIMEOUT` (`lock_timeout`
    /// for that statement only; the migrations run with the session's own).
    async fn lock(&mut self) -> Result<(), migrate::MigrationError> {
        const LOCK_TIMED_OUT: &str = "55P03";
        let tx = self.tx()?;
        let own: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(&mut *tx)
            .await?;
        let wait = format!("{}s", migrate::LOCK_TIMEOUT.as_secs());
        let set = "SELECT set_config('lock_timeout', $1, true)";
        sqlx::query(set).bind(&wait).execute(&mut *tx).await?;
        match sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATION_LOCK)
            .execute(&mut *tx)
            .await
        {
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_TIMED_OUT) => {
                return Err(migrate::MigrationError::LockTimeout)
            }
            other => other?,
        };
        sqlx::query(set).bind(&own).execute(&mut *tx).await?;
        Ok(())
    }

    async fn create_history(&mut self) -> Result<(), sqlx::Error> {
        let tx = self.tx()?;
        tx.execute(
            "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
                 version BIGINT PRIMARY KEY,
                 description TEXT NOT NULL,
                 checksum BYTEA NOT NULL,
                 applied_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
        )
        .await
        .map(drop)
    }

    async fn applied(&mut self) -> Result<Vec<(i64, Vec<u8>)>, sqlx::Error> {
        sqlx::query_as("SELECT version, checksum FROM idempotency_schema_migrations")
            .fetch_all(self.tx()?)
            .await
    }

    async fn execute(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        // Through the `Executor` trait: `RawSql::execute`'s future is not
        // `Send` for every lifetime (and `connect` must be spawnable).
        Executor::execute(self.tx()?, sqlx::raw_sql(sql))
            .await
            .map(drop)
    }

    async fn record(
        &mut self,
        version: i64,
        description: &str,
        checksum: &[u8],
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO idempotency_schema_migrations (version, description, checksum) VALUES ($1, $2, $3)",
        )
        .bind(version)
        .bind(description)
        .bind(checksum)
        .execute(self.tx()?)
        .await
        .map(drop)
    }

    /// Commits, or rolls back everything the run did.
    async fn unlock(&mut self, done: bool) -> Result<(), sqlx::Error> {
        match self.0.take() {
            Some(tx) if done => tx.commit().await,
            Some(tx) => tx.rollback().await,
            None => Ok(()),
        }
    }
}

fn err(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| StoreError::new(STORE, operation, e)
}

fn millis_i64(d: Duration) -> i64 {
    duration_to_millis(d)
}

/// In a caller's transaction: a lock timeout is caught in a subtransaction
/// inside the function, so the caller's transaction stays usable.
const RESERVE_SQL: &str = "SELECT outcome, took_over, is_error, result, lease_remaining_ms, \
     attempt_number, previous_attempt_started_at \
     FROM idempotency_reserve($1, $2, $3, $4, $5, $6, $7, $8)";
/// Through the store (the statement is its own transaction): no subtransaction;
/// a lock timeout fails the statement with SQLSTATE 55P03, answered as `InProgress`.
const RESERVE_AUTOCOMMIT_SQL: &str =
    "SELECT outcome, took_over, is_error, result, lease_remaining_ms, \
     attempt_number, previous_attempt_started_at \
     FROM idempotency_reserve_autocommit($1, $2, $3, $4, $5, $6, $7, $8)";
/// `lock_not_available`: `lock_timeout` ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";

async fn reserve_with<'e, E: Executor<'e, Database = Postgres>>(
    executor: E,
    request: ReserveRequest<'_>,
    lock_wait: Duration,
) -> Result<Reservation, StoreError> {
    reserve_statement(RESERVE_SQL, executor, request, lock_wait)
        .await
        .map_err(err("reserve"))
}

/// The store's reservation: one statement in its own transaction. A row held
/// by another transaction past `lock_wait` is a call in progress; its remaining
/// time is unknown, so the requested lease is the estimate (as in `idempotency_reserve`).
async fn reserve_autocommit(
    pool: &PgPool,
    request: ReserveRequest<'_>,
    lock_wait: Duration,
) -> Result<Reservation, StoreError> {
    match reserve_statement(RESERVE_AUTOCOMMIT_SQL, pool, request, lock_wait).await {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            Ok(Reservation::InProgress {
                lease_remaining: request.lease,
            })
        }
        other => other.map_err(err("reserve")),
    }
}

async fn reserve_statement<'e, E: Executor<'e, Database = Postgres>>(
    sql: &'static str,
    executor: E,
    request: ReserveRequest<'_>,
    lock_wait: Duration,
) -> Result<Reservation, sqlx::Error> {
    let id = request.identity;
    let row: PgRow = sqlx::query(sql)
        .bind(&id.tenant)
        .bind(&id.scope)
        .bind(&id.key)
        .bind(request.fingerprint.map(Fingerprint::as_str))
        .bind(request.token.as_str())
        .bind(millis_i64(request.lease))
        .bind(millis_i64(request.ttl))
        .bind(millis_i64(lock_wait))
        .fetch_one(executor)
        .await?;
    decode_reservation(&row)
}

fn decode_reservation(row: &PgRow) -> Result<Reservation, sqlx::Error> {
    let outcome: String = row.try_get("outcome")?;
    Ok(match outcome.as_str() {
        "acquired" => {
            let attempt = row
                .try_get::<Option<i32>, _>("attempt_number")?
                .unwrap_or(1);
            Reservation::acquired(
                u32::try_from(attempt).unwrap_or(1),
                row.try_get::<Option<i64>, _>("previous_attempt_started_at")?,
            )
        }
        "completed" => Reservation::Completed(StoredOutcome {
            is_error: row.try_get::<Option<bool>, _>("is_error")?.unwrap_or(false),
            payload: row
                .try_get::<Option<Vec<u8>>, _>("result")?
                .unwrap_or_else(|| b"null".to_vec()),
        }),
        "in_progress" => Reservation::InProgress {
            lease_remaining: millis_to_duration(
                row.try_get::<Option<i64>, _>("lease_remaining_ms")?
                    .unwrap_or(0),
            ),
        },
        "mismatch" => Reservation::FingerprintMismatch,
        other => {
            return Err(sqlx::Error::Protocol(format!(
                "idempotency_reserve answered an unknown outcome `{other}`"
            )))
        }
    })
}

/// Records the outcome, fenced by the token; `recovered` marks an outcome a
/// `recover` hook gave (rule 20).
async fn complete_with<'e, E: Executor<'e, Database = Postgres>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
    outcome: &StoredOutcome,
    ttl: Duration,
    recovered: bool,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE idempotency_records SET state = 'complete', owner_token = NULL,
                is_error = $5, result = $6, lease_expires_at = NULL,
                expires_at = idempotency_now_ms() + $7, updated_at = idempotency_now_ms(),
                recovered = $8
          WHERE tenant = $1 AND scope = $2 AND key = $3
            AND state = 'in_progress' AND owner_token = $4",
    )
    .bind(&identity.tenant)
    .bind(&identity.scope)
    .bind(&identity.key)
    .bind(token.as_str())
    .bind(outcome.is_error)
    .bind(&outcome.payload)
    .bind(millis_i64(ttl))
    .bind(recovered)
    .execute(executor)
    .await
    .map_err(err("complete"))?;
    Ok(done.rows_affected() == 1)
}

async fn release_with<'e, E: Executor<'e, Database = Postgres>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "DELETE FROM idempotency_records
          WHERE tenant = $1 AND scope = $2 AND key = $3
            AND state = 'in_progress' AND owner_token = $4",
    )
    .bind(&identity.tenant)
    .bind(&identity.scope)
    .bind(&identity.key)
    .bind(token.as_str())
    .execute(executor)
    .await
    .map_err(err("release"))?;
    Ok(done.rows_affected() == 1)
}

#[async_trait::async_trait]
impl Store for PgStore {
    fn name(&self) -> &'static str {
        STORE
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        reserve_autocommit(&self.pool, request, self.lock_wait).await
    }

    async fn complete(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        complete_with(&self.pool, identity, token, outcome, ttl, false).await
    }

    async fn complete_recovered(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        complete_with(&self.pool, identity, token, outcome, ttl, true).await
    }

    async fn force_release(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        const OP: &str = "release a record for an operator";
        let deleted: Option<i32> = sqlx::query_scalar(
            "DELETE FROM idempotency_records
              WHERE tenant = $1 AND scope = $2 AND key = $3 AND state = 'in_progress'
                AND (NOT $4 OR lease_expires_at <= idempotency_now_ms())
             RETURNING attempt",
        )
        .bind(&identity.tenant)
        .bind(&identity.scope)
        .bind(&identity.key)
        .bind(require_expired_lease)
        .fetch_optional(&self.pool)
        .await
        .map_err(err(OP))?;
        if let Some(attempt) = deleted {
            return Ok(ForcedRelease::Released {
                attempt: u32::try_from(attempt).unwrap_or(1),
            });
        }
        Ok(refused_release(self.fetch(identity).await?))
    }

    async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<bool, StoreError> {
        release_with(&self.pool, identity, token).await
    }

    async fn heartbeat(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE idempotency_records
                SET lease_expires_at = idempotency_now_ms() + $5, updated_at = idempotency_now_ms()
              WHERE tenant = $1 AND scope = $2 AND key = $3
                AND state = 'in_progress' AND owner_token = $4",
        )
        .bind(&identity.tenant)
        .bind(&identity.scope)
        .bind(&identity.key)
        .bind(token.as_str())
        .bind(millis_i64(lease))
        .execute(&self.pool)
        .await
        .map_err(err("heartbeat"))?;
        Ok(done.rows_affected() == 1)
    }

    fn release_detached(&self, identity: Identity, token: OwnerToken) {
        self.detached
            .hand_over(identity, token, detached::Work::Release);
    }

    fn complete_detached(
        &self,
        identity: Identity,
        token: OwnerToken,
        outcome: StoredOutcome,
        ttl: Duration,
    ) {
        self.detached
            .hand_over(identity, token, detached::Work::Complete(outcome, ttl));
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM idempotency_records WHERE ctid IN (
                 SELECT ctid FROM idempotency_records
                  WHERE expires_at <= idempotency_now_ms()
                    AND (state = 'complete' OR lease_expires_at <= idempotency_now_ms())
                  ORDER BY expires_at
                  LIMIT $1
                  FOR UPDATE SKIP LOCKED)",
        )
        .bind(i64::from(batch))
        .execute(&self.pool)
        .await
        .map_err(err("purge expired records"))?;
        Ok(done.rows_affected())
    }

    async fn fetch(&self, identity: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        let row = sqlx::query(
            "SELECT state, fingerprint, owner_token, is_error, result, lease_expires_at,
                    expires_at, idempotency_now_ms() AS now_ms, created_at,
                    attempt::bigint AS attempt,
                    COALESCE(attempt_started_at, created_at) AS attempt_started_at, recovered
               FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3",
        )
        .bind(&identity.tenant)
        .bind(&identity.scope)
        .bind(&identity.key)
        .fetch_optional(&self.pool)
        .await
        .map_err(err("fetch"))?;
        row.map(|row| rows::Columns(&row).snapshot())
            .transpose()
            .map_err(err("fetch"))
    }

    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        const OP: &str = "count records per scope";
        let found = sqlx::query(
            "WITH n AS (SELECT idempotency_now_ms() AS now_ms)
             SELECT scope,
                    count(*) FILTER (WHERE NOT expired AND state = 'complete') AS complete,
                    count(*) FILTER (WHERE NOT expired AND state = 'in_progress' AND lease_expires_at > now_ms) AS in_progress,
                    count(*) FILTER (WHERE NOT expired AND state = 'in_progress' AND lease_expires_at <= now_ms) AS stuck,
                    count(*) FILTER (WHERE expired) AS expired,
                    min(created_at) AS oldest,
                    count(*) FILTER (WHERE NOT expired AND attempt > 1) AS taken_over,
                    count(*) FILTER (WHERE NOT expired AND state = 'complete' AND recovered) AS recovered
               FROM (SELECT r.*, n.now_ms,
                            (r.expires_at <= n.now_ms
                             AND (r.state = 'complete' OR r.lease_expires_at <= n.now_ms)) AS expired
                       FROM idempotency_records r CROSS JOIN n) s
              GROUP BY scope ORDER BY scope",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(err(OP))?;
        found
            .iter()
            .map(|row| rows::Columns(row).scope_stats())
            .collect::<Result<_, sqlx::Error>>()
            .map_err(err(OP))
    }
}

// ---------------------------------------------------------------- transactional mode

/// Whether the connection's transaction began before the statement asking (a
/// simple-protocol query: in autocommit it is its own transaction).
async fn started_before_this_statement(conn: &mut sqlx::PgConnection) -> Result<bool, sqlx::Error> {
    let row: PgRow = conn
        .fetch_one("SELECT transaction_timestamp() <> statement_timestamp()")
        .await?;
    row.try_get::<bool, _>(0)
}

/// Transactional mode on a PostgreSQL connection: the reservation and the
/// recorded result are statements in whatever transaction the connection is in.
///
/// ```no_run
/// use idempotent_runtime::transaction::TransactionalConnection;
/// fn assert_tx<C: TransactionalConnection + ?Sized>() {}
/// assert_tx::<sqlx::PgConnection>();
/// assert_tx::<sqlx::Transaction<'static, sqlx::Postgres>>();
/// ```
#[async_trait::async_trait]
impl TransactionalConnection for sqlx::PgConnection {
    fn store_name(&self) -> &'static str {
        STORE
    }

    /// A transaction begun through sqlx is known without a round trip. Otherwise
    /// the server is asked, with a simple-protocol query: in autocommit that
    /// query is its own transaction, which started with it (the two timestamps
    /// are equal); after a plain `BEGIN` the transaction started earlier.
    async fn in_transaction(&mut self) -> Result<bool, StoreError> {
        const OP: &str = "check for an open transaction";
        if sqlx::Connection::is_in_transaction(self) {
            return Ok(true);
        }
        started_before_this_statement(self).await.map_err(err(OP))
    }

    async fn reserve_in_transaction(
        &mut self,
        request: ReserveRequest<'_>,
        lock_wait: Duration,
    ) -> Result<Reservation, Error> {
        Ok(reserve_with(&mut *self, request, lock_wait).await?)
    }

    async fn complete_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        complete_with(&mut *self, identity, token, outcome, ttl, false).await
    }

    async fn complete_recovered_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        complete_with(&mut *self, identity, token, outcome, ttl, true).await
    }

    async fn release_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<bool, StoreError> {
        release_with(&mut *self, identity, token).await
    }
}
