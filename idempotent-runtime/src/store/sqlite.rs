//! [`SqliteStore`]: records in an embedded SQLite database (via sqlx).
//!
//! One table, `idempotency_records`, keyed by `(tenant, scope, key)`. Every
//! time decision (lease expiry, retention) is computed by the SQL statements
//! themselves on SQLite's clock; the application's clock is never passed in.
//!
//! Writes start with `BEGIN IMMEDIATE` (or are single autocommit statements),
//! so concurrent reservations queue on SQLite's write lock instead of failing
//! with a lock upgrade; within one process they also queue on an async gate so
//! they do not spin in SQLite's busy handler.

use super::*;
use crate::error::Error;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::Row;
use std::str::FromStr;
use std::sync::Arc;

const STORE: &str = "sqlite";

/// How long a statement waits for another connection's (or process's) write lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections in the pool of a file database opened with [`SqliteStore::connect`].
const MAX_FILE_CONNECTIONS: u32 = 8;

/// Where versions before 0.x's one migration runner recorded their
/// migrations; copied once into `idempotency_schema_migrations` and left in
/// place for older runtimes that share the file.
const LEGACY_MIGRATIONS_TABLE: &str = "_idempotent_migrations";

/// The migrations, embedded at compile time from `migrations/sqlite`.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// The database's clock, in ms since the Unix epoch. SQLite evaluates `'now'`
/// once per statement, so every use within one statement agrees.
macro_rules! now_ms {
    () => {
        "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
    };
}

/// Rule 16: the existing row counts as absent (retention over, and for an
/// in-progress record its lease too).
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

const RESERVE_SQL: &str = concat!(
    "INSERT INTO idempotency_records ",
    "(tenant, scope, key, state, fingerprint, owner_token, lease_expires_at, expires_at, ",
    "created_at, completed_at, takeover_count, is_error, result, ",
    "attempt_started_at, previous_attempt_started_at, recovered) ",
    "VALUES (?1, ?2, ?3, 'in_progress', ?4, ?5, ",
    now_ms!(),
    " + ?6, ",
    now_ms!(),
    " + ?7, ",
    now_ms!(),
    ", NULL, 0, 0, NULL, ",
    now_ms!(),
    ", NULL, 0) ",
    "ON CONFLICT (tenant, scope, key) DO UPDATE SET ",
    "state = 'in_progress', ",
    "fingerprint = excluded.fingerprint, ",
    "owner_token = excluded.owner_token, ",
    "lease_expires_at = excluded.lease_expires_at, ",
    "expires_at = excluded.expires_at, ",
    "created_at = CASE WHEN ",
    row_expired!(),
    " THEN excluded.created_at ELSE created_at END, ",
    "completed_at = NULL, ",
    "takeover_count = CASE WHEN ",
    row_expired!(),
    " THEN 0 ELSE takeover_count + 1 END, ",
    // Rule 20: when the attempt taken over had started (the SET expressions
    // all read the row as it was before this update).
    "previous_attempt_started_at = CASE WHEN ",
    row_expired!(),
    " THEN NULL ELSE COALESCE(attempt_started_at, created_at) END, ",
    "attempt_started_at = excluded.attempt_started_at, ",
    "recovered = 0, ",
    "is_error = 0, ",
    "result = NULL ",
    "WHERE ",
    row_expired!(),
    " OR (state = 'in_progress' AND lease_expires_at <= ",
    now_ms!(),
    " AND (fingerprint IS NULL OR excluded.fingerprint IS NULL ",
    "OR fingerprint = excluded.fingerprint)) ",
    "RETURNING takeover_count, previous_attempt_started_at"
);

const EXISTING_SQL: &str = concat!(
    "SELECT state, fingerprint, lease_expires_at - ",
    now_ms!(),
    " AS lease_remaining, ",
    row_expired!(),
    " AS expired, is_error, result FROM idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3"
);

const COMPLETE_SQL: &str = concat!(
    "UPDATE idempotency_records SET state = 'complete', owner_token = NULL, ",
    "lease_expires_at = NULL, completed_at = ",
    now_ms!(),
    ", expires_at = ",
    now_ms!(),
    " + ?5, is_error = ?6, result = ?7, recovered = ?8 ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 ",
    "AND state = 'in_progress' AND owner_token = ?4"
);

const RELEASE_SQL: &str = concat!(
    "DELETE FROM idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 ",
    "AND state = 'in_progress' AND owner_token = ?4"
);

const HEARTBEAT_SQL: &str = concat!(
    "UPDATE idempotency_records SET lease_expires_at = ",
    now_ms!(),
    " + ?5 ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 ",
    "AND state = 'in_progress' AND owner_token = ?4"
);

const PURGE_SQL: &str = concat!(
    "DELETE FROM idempotency_records WHERE rowid IN (",
    "SELECT rowid FROM idempotency_records WHERE ",
    row_expired!(),
    " LIMIT ?1)"
);

const FETCH_SQL: &str = concat!(
    "SELECT state, fingerprint, owner_token, is_error, result, lease_expires_at, expires_at, ",
    now_ms!(),
    " AS now_ms, created_at, takeover_count + 1 AS attempt, ",
    "COALESCE(attempt_started_at, created_at) AS attempt_started_at, recovered ",
    "FROM idempotency_records WHERE tenant = ?1 AND scope = ?2 AND key = ?3"
);

/// The operator's release (rule 20's escape hatch): an in-progress record,
/// with `?4 = 1` only once its lease ran out. Returns its attempt number.
const FORCE_RELEASE_SQL: &str = concat!(
    "DELETE FROM idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 AND state = 'in_progress' ",
    "AND (?4 = 0 OR lease_expires_at <= ",
    now_ms!(),
    ") RETURNING takeover_count + 1"
);

const SCOPE_STATS_SQL: &str = concat!(
    "SELECT scope, ",
    "SUM(CASE WHEN expired = 0 AND state = 'complete' THEN 1 ELSE 0 END) AS complete, ",
    "SUM(CASE WHEN expired = 0 AND state = 'in_progress' AND lease_expires_at > now_ms ",
    "THEN 1 ELSE 0 END) AS in_progress, ",
    "SUM(CASE WHEN expired = 0 AND state = 'in_progress' AND lease_expires_at <= now_ms ",
    "THEN 1 ELSE 0 END) AS stuck, ",
    "SUM(expired) AS expired, ",
    "MIN(created_at) AS oldest, ",
    "SUM(CASE WHEN expired = 0 AND takeover_count > 0 THEN 1 ELSE 0 END) AS taken_over, ",
    "SUM(CASE WHEN expired = 0 AND state = 'complete' AND recovered = 1 THEN 1 ELSE 0 END) ",
    "AS recovered ",
    "FROM (SELECT scope, state, lease_expires_at, created_at, now_ms, takeover_count, recovered, ",
    "(expires_at <= now_ms AND (state = 'complete' OR COALESCE(lease_expires_at, 0) <= now_ms)) ",
    "AS expired ",
    "FROM idempotency_records, (SELECT ",
    now_ms!(),
    " AS now_ms)) ",
    "GROUP BY scope ORDER BY scope"
);

fn err(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| StoreError::new(STORE, operation, e)
}

/// A lease or ttl for SQL; capped so `now + d` stays inside 64-bit integers.
fn ms(d: Duration) -> i64 {
    duration_to_millis(d)
}

/// The embedded SQLite store: the default for single-machine services and the
/// store the README's example runs on. Records survive restarts; several
/// processes may share one database file. Cloning gives another handle to the
/// same pool.
///
/// ```
/// use idempotent_runtime::{set_default_store, SqliteStore};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::Error> {
/// # let dir = std::env::temp_dir().join(format!("idempotent-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// # let path = dir.join("payments.db");
/// # let url = format!("sqlite://{}", path.display());
/// // e.g. "sqlite://payments.db" (created when missing) or "sqlite::memory:"
/// let store = SqliteStore::connect(&url).await?;
/// set_default_store(store);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// Serializes this process's writes so they queue here, not in SQLite's
    /// busy handler. Other processes are handled by the busy timeout.
    write_gate: Arc<tokio::sync::Mutex<()>>,
    /// Finishes the records of dropped calls (rule 14). SQLite connections
    /// run on threads of their own, so it shares the store's pool.
    detached: Arc<super::detached::Detached>,
}

impl SqliteStore {
    /// Opens (creating it if missing) the database at `url` and applies the
    /// store's migrations.
    ///
    /// `url` is an sqlx SQLite URL: `sqlite://payments.db`, `sqlite:///var/lib/app/idem.db`,
    /// or `sqlite::memory:` for a private in-memory database (every clone of
    /// the store sees the same one; it is gone when the store is dropped).
    /// File databases use WAL journaling and a busy timeout, so several
    /// processes can share one file; several processes may also open (create
    /// and migrate) one brand-new file at the same moment.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::Error> {
    /// let store = idempotent_runtime::SqliteStore::connect("sqlite::memory:").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Store`] when the URL is malformed, the file cannot be opened
    /// or created, or the migrations fail.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::new(STORE, "parse the connection URL", e))?
            .create_if_missing(true)
            .busy_timeout(BUSY_TIMEOUT);
        let in_memory = url.contains(":memory:") || url.contains("mode=memory");
        let pool = if in_memory {
            // A shared-cache in-memory database lives as long as one connection
            // to it is open: keep exactly one, forever, so every caller sees
            // the same records and none are lost to an idle timeout.
            pool_options()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(options)
                .await
        } else {
            // WAL is a property of the file: switch it once, waiting out other
            // processes doing the same, before the pool opens its connections
            // (which then find the file in WAL mode and need no switch).
            let mut first: sqlx::SqliteConnection = sqlx::Connection::connect_with(&options)
                .await
                .map_err(err("open the database"))?;
            switch_to_wal(&mut first, &options.get_filename().display().to_string())
                .await
                .map_err(err("switch the database to WAL journaling"))?;
            let pool = pool_options()
                .max_connections(MAX_FILE_CONNECTIONS)
                .connect_with(options)
                .await;
            // Closed only now, so the WAL files are not removed and recreated in between.
            let _ = sqlx::Connection::close(first).await;
            pool
        }
        .map_err(|e| StoreError::new(STORE, "open the database", e))?;
        Self::from_pool(pool).await
    }

    /// Uses an existing pool (e.g. the application's own) and applies the
    /// store's migrations to its database.
    ///
    /// The migrations are recorded in their own table, `idempotency_schema_migrations`,
    /// so they do not interfere with the application's sqlx migrations. For
    /// concurrent use, configure the pool with WAL journaling and a busy timeout
    /// (as [`connect`](Self::connect) does). What to know about such a pool:
    ///
    /// - Busy timeout: without one (`busy_timeout(Duration::ZERO)`) every write
    ///   that meets another connection's lock fails at once with "database is
    ///   locked"; the store logs a warning when it finds the pool so configured.
    /// - WAL: `journal_mode(Wal)` in the pool's options runs the switch on
    ///   every new connection, and SQLite does not wait for a switch that
    ///   meets another connection's lock: pools of several processes creating
    ///   one brand-new file at once can fail with "database is locked". Open it once with `connect` (which waits
    ///   the switch out), or switch the file before the pools are made.
    ///   Without WAL (the rollback journal) the store works, more slowly.
    /// - Transactional mode (`tx = ...`): begin the transactions with
    ///   `BEGIN IMMEDIATE`. A deferred transaction that has read before
    ///   another connection wrote can never write, and is refused with
    ///   [`Error::StaleSnapshot`]. A call dropped while it waits for the lock
    ///   leaves its connection's busy timeout at the call's wait bound until
    ///   the next transactional call on that connection; pools made by
    ///   `connect` restore it when the connection is released.
    /// - In-memory databases with shared cache (`sqlite::memory:`) and more than
    ///   one connection: sqlx waits for another connection's table lock
    ///   without a bound, so `in_progress = wait(...)` and `reject` are not
    ///   honoured there. Use `connect("sqlite::memory:")` (one connection) or
    ///   `max_connections(1)`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use sqlx::sqlite::SqlitePoolOptions;
    /// let pool = SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
    /// let store = idempotent_runtime::SqliteStore::from_pool(pool).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Store`] when the migrations fail, or when a migration already
    /// applied to this database differs from the one this version ships.
    pub async fn from_pool(pool: SqlitePool) -> Result<Self, Error> {
        migrate(&pool).await?;
        let busy_timeout: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&pool)
            .await
            .map_err(err("read the busy timeout"))?;
        if busy_timeout <= 0 {
            let file = pool.connect_options().get_filename().display().to_string();
            tracing::warn!(target: "idempotent", file,
                "sqlite: the pool's connections have no busy timeout, so a write that meets another \
                 connection's lock fails at once with \"database is locked\"; set one with \
                 SqliteConnectOptions::busy_timeout");
        }
        let write_gate = Arc::new(tokio::sync::Mutex::new(()));
        let detached = {
            use super::detached::{Detached, Work};
            let (pool, write_gate) = (pool.clone(), write_gate.clone());
            Detached::new(
                STORE,
                Box::new(move || {
                    Arc::new(move |identity, token, work| {
                        let (pool, write_gate) = (pool.clone(), write_gate.clone());
                        Box::pin(async move {
                            let _gate = write_gate.lock().await;
                            match work {
                                Work::Release => release_on(&pool, &identity, &token).await,
                                Work::Complete(outcome, ttl) => {
                                    complete_on(&pool, &identity, &token, &outcome, ttl, false)
                                        .await
                                }
                            }
                        })
                    })
                }),
            )
        };
        Ok(SqliteStore {
            pool,
            write_gate,
            detached: Arc::new(detached),
        })
    }

    /// The underlying pool.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = idempotent_runtime::SqliteStore::connect("sqlite::memory:").await?;
    /// let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records")
    ///     .fetch_one(store.pool()).await?;
    /// assert_eq!(n, 0);
    /// # Ok(()) }
    /// ```
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn release_now(
        &self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<bool, StoreError> {
        let _gate = self.write_gate.lock().await;
        release_on(&self.pool, identity, token).await
    }
}

/// Completes the record, fenced by `token`, on a pool or on the caller's
/// connection (transactional mode).
/// `recovered` marks an outcome a `recover` hook gave (rule 20).
pub(super) async fn complete_on<'e, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
    outcome: &StoredOutcome,
    ttl: Duration,
    recovered: bool,
) -> Result<bool, StoreError> {
    let done = sqlx::query(COMPLETE_SQL)
        .bind(&identity.tenant)
        .bind(&identity.scope)
        .bind(&identity.key)
        .bind(token.as_str())
        .bind(ms(ttl))
        .bind(outcome.is_error)
        .bind(&outcome.payload[..])
        .bind(recovered)
        .execute(executor)
        .await
        .map_err(err("complete"))?;
    Ok(done.rows_affected() > 0)
}

/// Deletes the in-progress record, fenced by `token`.
pub(super) async fn release_on<'e, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
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

/// The write path of a reservation, on a connection already inside a write
/// transaction (the store's `BEGIN IMMEDIATE`, or the caller's own in
/// transactional mode): one conditional upsert decides atomically; when it
/// does not acquire, the row it met is read and judged.
pub(super) async fn reserve_in(
    conn: &mut sqlx::SqliteConnection,
    request: ReserveRequest<'_>,
) -> Result<Reservation, sqlx::Error> {
    let id = request.identity;
    let fingerprint = request.fingerprint.map(Fingerprint::as_str);
    // Two passes at most: a lease that runs out between the upsert and the
    // read is taken over on the second pass.
    for _ in 0..2 {
        let acquired: Option<(i64, Option<i64>)> = sqlx::query_as(RESERVE_SQL)
            .bind(&id.tenant)
            .bind(&id.scope)
            .bind(&id.key)
            .bind(fingerprint)
            .bind(request.token.as_str())
            .bind(ms(request.lease))
            .bind(ms(request.ttl))
            .fetch_optional(&mut *conn)
            .await?;
        if let Some((takeovers, previous_started)) = acquired {
            let attempt = u32::try_from(takeovers.saturating_add(1)).unwrap_or(u32::MAX);
            return Ok(Reservation::acquired(attempt, previous_started));
        }
        let row = sqlx::query(EXISTING_SQL)
            .bind(&id.tenant)
            .bind(&id.scope)
            .bind(&id.key)
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(answer) = row
            .map(|row| judge(&row, fingerprint))
            .transpose()?
            .flatten()
        {
            return Ok(answer);
        }
    }
    // The record's lease ended just as we looked: tell the caller to come back at once.
    Ok(Reservation::InProgress {
        lease_remaining: Duration::ZERO,
    })
}

/// The options of the pools [`SqliteStore::connect`] makes: a connection
/// whose busy timeout a dropped transactional call left changed gets it back
/// when it returns to the pool (or is closed if that fails).
fn pool_options() -> SqlitePoolOptions {
    SqlitePoolOptions::new().after_release(|conn, _| {
        Box::pin(async move { Ok(super::sqlite_tx::restore_busy_timeout(conn).await.is_ok()) })
    })
}

/// SQLITE_BUSY or SQLITE_LOCKED, with any extended code: another connection
/// holds a lock this statement needs.
pub(super) fn is_busy(e: &sqlx::Error) -> bool {
    matches!(primary_code(e), Some(5 | 6))
}

/// The SQLite result code of a database error (extended, as sqlx enables
/// extended result codes), e.g. 5 SQLITE_BUSY, 517 SQLITE_BUSY_SNAPSHOT.
pub(super) fn result_code(e: &sqlx::Error) -> Option<i64> {
    match e {
        sqlx::Error::Database(db) => db.code().and_then(|c| c.parse::<i64>().ok()),
        _ => None,
    }
}

/// The primary result code (the low byte of the extended one).
pub(super) fn primary_code(e: &sqlx::Error) -> Option<i64> {
    result_code(e).map(|c| c & 0xff)
}

/// Switches `file`, which `conn` is open on, to WAL journaling (a property of
/// the file, kept across connections and restarts).
///
/// SQLite does not consult the busy handler for this switch when another
/// connection holds the write lock: the switch first reads the file header
/// (a read transaction) and then upgrades to a write, and an upgrade from a
/// read transaction answers `SQLITE_BUSY` at once, since waiting while holding
/// the read lock could deadlock. Two processes opening a brand-new file at the
/// same moment both switch, and the loser got "database is locked" (with
/// `journal_mode` in the pool's options, every new pooled connection ran the
/// switch). Here a busy switch is retried, with a bounded backoff: once the
/// other side has switched, the retry only reads the header and finds WAL.
async fn switch_to_wal(conn: &mut sqlx::SqliteConnection, file: &str) -> Result<(), sqlx::Error> {
    let deadline = tokio::time::Instant::now() + BUSY_TIMEOUT;
    let mut pause = Duration::from_millis(1);
    let mode = loop {
        match sqlx::query_scalar::<_, String>("PRAGMA journal_mode = WAL")
            .fetch_one(&mut *conn)
            .await
        {
            Err(e) if is_busy(&e) && tokio::time::Instant::now() + pause < deadline => {
                tracing::debug!(target: "idempotent", file, error = %e,
                    "sqlite: another connection holds the lock while switching to WAL; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            other => break other?,
        }
    };
    if !mode.eq_ignore_ascii_case("wal") {
        // E.g. a file system without shared-memory support: SQLite keeps the
        // rollback journal, which is slower but still correct with a busy timeout.
        tracing::warn!(target: "idempotent", file, journal_mode = %mode,
            "sqlite: the database could not be switched to WAL journaling; concurrent use will be slower");
    }
    Ok(())
}

/// Applies the embedded migrations that this database has not seen, in one
/// `BEGIN IMMEDIATE` transaction so two processes opening a new file at once
/// do not both apply them.
async fn migrate(pool: &SqlitePool) -> Result<(), StoreError> {
    let mut backend = MigrationTransaction {
        pool: pool.clone(),
        tx: None,
    };
    super::migrate::run(&mut backend, &MIGRATOR)
        .await
        .map_err(|e| StoreError::new(STORE, "apply migrations", e))
}

/// The migration runner's view of SQLite: one `BEGIN IMMEDIATE` transaction
/// (the database's write lock) for the whole run.
struct MigrationTransaction {
    pool: SqlitePool,
    tx: Option<sqlx::Transaction<'static, sqlx::Sqlite>>,
}

impl MigrationTransaction {
    fn tx(&mut self) -> Result<&mut sqlx::SqliteConnection, sqlx::Error> {
        self.tx.as_deref_mut().ok_or(sqlx::Error::PoolClosed)
    }
}

#[async_trait::async_trait]
impl super::migrate::MigrationBackend for MigrationTransaction {
    /// The write lock, waited for (beyond the busy timeout) up to `LOCK_TIMEOUT`.
    async fn lock(&mut self) -> Result<(), super::migrate::MigrationError> {
        let deadline = tokio::time::Instant::now() + super::migrate::LOCK_TIMEOUT;
        loop {
            match self.pool.begin_with("BEGIN IMMEDIATE").await {
                Ok(tx) => {
                    self.tx = Some(tx);
                    return Ok(());
                }
                Err(e) if is_busy(&e) && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) if is_busy(&e) => return Err(super::migrate::MigrationError::LockTimeout),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Creates the history table; a file whose history is in the legacy
    /// table gets it copied, once (the write lock is held, so of several
    /// processes opening the file at once the first copies, the rest find
    /// the table).
    async fn create_history(&mut self) -> Result<(), sqlx::Error> {
        let tx = self.tx()?;
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN (?1, ?2)",
        )
        .bind(super::migrate::HISTORY_TABLE)
        .bind(LEGACY_MIGRATIONS_TABLE)
        .fetch_all(&mut *tx)
        .await?;
        if tables.iter().any(|t| t == super::migrate::HISTORY_TABLE) {
            return Ok(());
        }
        sqlx::query(
            "CREATE TABLE idempotency_schema_migrations (\
             version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
             checksum BLOB NOT NULL, applied_at INTEGER NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        if tables.iter().any(|t| t == LEGACY_MIGRATIONS_TABLE) {
            sqlx::query(&format!(
                "INSERT INTO idempotency_schema_migrations \
                 (version, description, checksum, applied_at) \
                 SELECT version, description, checksum, applied_at FROM {LEGACY_MIGRATIONS_TABLE}"
            ))
            .execute(&mut *tx)
            .await?;
        }
        Ok(())
    }

    async fn applied(&mut self) -> Result<Vec<(i64, Vec<u8>)>, sqlx::Error> {
        sqlx::query_as("SELECT version, checksum FROM idempotency_schema_migrations")
            .fetch_all(self.tx()?)
            .await
    }

    async fn execute(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        // Through the `Executor` trait, not `RawSql::execute`, whose future is
        // not `Send` for every lifetime (and would make `connect` unspawnable).
        sqlx::Executor::execute(self.tx()?, sqlx::raw_sql(sql))
            .await
            .map(drop)
    }

    async fn record(
        &mut self,
        version: i64,
        description: &str,
        checksum: &[u8],
    ) -> Result<(), sqlx::Error> {
        sqlx::query(concat!(
            "INSERT INTO idempotency_schema_migrations (version, description, checksum, applied_at) ",
            "VALUES (?1, ?2, ?3, ",
            now_ms!(),
            ")"
        ))
        .bind(version)
        .bind(description)
        .bind(checksum)
        .execute(self.tx()?)
        .await
        .map(drop)
    }

    async fn unlock(&mut self, done: bool) -> Result<(), sqlx::Error> {
        match self.tx.take() {
            Some(tx) if done => tx.commit().await,
            Some(tx) => tx.rollback().await,
            None => Ok(()),
        }
    }
}

/// Reads the record and answers from that read alone, when it can: a live
/// record gives a replay, a mismatch or a live lease; `None` when it is absent,
/// expired or its lease ran out (a write is due).
pub(super) async fn answer_from_a_read<'e, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
    executor: E,
    request: ReserveRequest<'_>,
) -> Result<Option<Reservation>, sqlx::Error> {
    let id = request.identity;
    let row = sqlx::query(EXISTING_SQL)
        .bind(&id.tenant)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(executor)
        .await?;
    Ok(row
        .map(|row| judge(&row, request.fingerprint.map(Fingerprint::as_str)))
        .transpose()?
        .flatten())
}

/// What an existing row (read with `EXISTING_SQL`) answers to a request with
/// `fingerprint`; `None` when the row is expired or its lease ran out, so the
/// caller must go through the conditional upsert.
fn judge(
    row: &sqlx::sqlite::SqliteRow,
    fingerprint: Option<&str>,
) -> Result<Option<Reservation>, sqlx::Error> {
    let expired: bool = row.try_get("expired")?;
    if expired {
        return Ok(None);
    }
    let stored_fp: Option<String> = row.try_get("fingerprint")?;
    if fingerprints_conflict(stored_fp.as_deref(), fingerprint) {
        return Ok(Some(Reservation::FingerprintMismatch));
    }
    let state: String = row.try_get("state")?;
    if RecordState::parse(&state) == Some(RecordState::Complete) {
        let is_error: bool = row.try_get("is_error")?;
        let result: Option<Vec<u8>> = row.try_get("result")?;
        return Ok(Some(Reservation::Completed(outcome_from(is_error, result))));
    }
    let remaining: Option<i64> = row.try_get("lease_remaining")?;
    Ok(match remaining {
        Some(ms) if ms > 0 => Some(Reservation::InProgress {
            lease_remaining: millis_to_duration(ms),
        }),
        _ => None,
    })
}

fn outcome_from(is_error: bool, result: Option<Vec<u8>>) -> StoredOutcome {
    StoredOutcome {
        is_error,
        payload: result.unwrap_or_else(|| b"null".to_vec()),
    }
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    fn name(&self) -> &'static str {
        STORE
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        const OP: &str = "reserve";
        // Fast path, one read and no write lock: a live record that answers
        // the request by itself (replay, mismatch, or a live lease). Replays
        // and waiting duplicates never queue behind writers.
        if let Some(answer) = answer_from_a_read(&self.pool, request)
            .await
            .map_err(err(OP))?
        {
            return Ok(answer);
        }

        // Write path: absent, expired, or a lease that ran out, under the write lock.
        let _gate = self.write_gate.lock().await;
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(err(OP))?;
        let answer = reserve_in(&mut tx, request).await.map_err(err(OP))?;
        if matches!(answer, Reservation::Acquired { .. }) {
            tx.commit().await.map_err(err(OP))?;
        } else {
            // Nothing was written: end the transaction without a commit.
            tx.rollback().await.map_err(err(OP))?;
        }
        Ok(answer)
    }

    async fn complete(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let _gate = self.write_gate.lock().await;
        complete_on(&self.pool, identity, token, outcome, ttl, false).await
    }

    async fn complete_recovered(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let _gate = self.write_gate.lock().await;
        complete_on(&self.pool, identity, token, outcome, ttl, true).await
    }

    async fn force_release(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        const OP: &str = "release a record for an operator";
        let deleted: Option<i64> = {
            let _gate = self.write_gate.lock().await;
            sqlx::query_scalar(FORCE_RELEASE_SQL)
                .bind(&identity.tenant)
                .bind(&identity.scope)
                .bind(&identity.key)
                .bind(require_expired_lease)
                .fetch_optional(&self.pool)
                .await
                .map_err(err(OP))?
        };
        if let Some(attempt) = deleted {
            return Ok(ForcedRelease::Released {
                attempt: u32::try_from(attempt).unwrap_or(1),
            });
        }
        Ok(refused_release(self.fetch(identity).await?))
    }

    async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<bool, StoreError> {
        self.release_now(identity, token).await
    }

    async fn heartbeat(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let _gate = self.write_gate.lock().await;
        let done = sqlx::query(HEARTBEAT_SQL)
            .bind(&identity.tenant)
            .bind(&identity.scope)
            .bind(&identity.key)
            .bind(token.as_str())
            .bind(ms(lease))
            .execute(&self.pool)
            .await
            .map_err(err("heartbeat"))?;
        Ok(done.rows_affected() > 0)
    }

    fn release_detached(&self, identity: Identity, token: OwnerToken) {
        self.detached
            .hand_over(identity, token, super::detached::Work::Release);
    }

    fn complete_detached(
        &self,
        identity: Identity,
        token: OwnerToken,
        outcome: StoredOutcome,
        ttl: Duration,
    ) {
        self.detached.hand_over(
            identity,
            token,
            super::detached::Work::Complete(outcome, ttl),
        );
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let _gate = self.write_gate.lock().await;
        let done = sqlx::query(PURGE_SQL)
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await
            .map_err(err("purge expired records"))?;
        Ok(done.rows_affected())
    }

    async fn fetch(&self, identity: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        const OP: &str = "fetch a record";
        let Some(row) = sqlx::query(FETCH_SQL)
            .bind(&identity.tenant)
            .bind(&identity.scope)
            .bind(&identity.key)
            .fetch_optional(&self.pool)
            .await
            .map_err(err(OP))?
        else {
            return Ok(None);
        };
        rows::Columns(&row).snapshot().map(Some).map_err(err(OP))
    }

    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        const OP: &str = "count records per scope";
        let rows = sqlx::query(SCOPE_STATS_SQL)
            .fetch_all(&self.pool)
            .await
            .map_err(err(OP))?;
        rows.iter()
            .map(|row| rows::Columns(row).scope_stats().map_err(err(OP)))
            .collect()
    }
}
