//! [`SqliteStore`]: records in an embedded SQLite database (via sqlx).
//!
//! One table, `idempotency_records`, keyed by `(tenant, scope, key)`, named
//! `main.idempotency_records` by every statement: SQLite looks an unqualified
//! name up in `temp` first, and a TEMP table of that name left on a pooled
//! connection by code sharing the pool took the store's writes there. Every
//! time decision (lease expiry, retention) is computed by the SQL statements
//! themselves on SQLite's clock; the application's clock is never passed in.
//!
//! Per call, the store sends what DESIGN.md §5 calls the floor: a reservation
//! is one read when the record answers by itself (replay, mismatch, live
//! lease; no write lock), and for a new key the read and one conditional
//! upsert (`INSERT … ON CONFLICT … DO UPDATE … WHERE … RETURNING`, a single
//! autocommit statement: SQLite takes the write lock for it with the busy
//! handler, as for `BEGIN IMMEDIATE`; a lock still held when the busy
//! timeout runs out answers `InProgress`, see `reserve`); completion is one
//! fenced `UPDATE`.
//! Within one process, writes also queue on an async gate so they do not spin
//! in SQLite's busy handler (nor hold pool connections while they queue).
//! On a multi-threaded runtime each write takes its turn in a task of its
//! own (`beside_the_caller`), so a call future kept alive but no longer
//! polled never keeps the turn from the process's other writes. A
//! reservation goes on there when its call is dropped, and the dropped
//! call's release waits for it to end before it looks for the record; a
//! statement its call left at SQLite (a current-thread runtime, or one shut
//! down) is looked for as long as its busy timeout lets it land
//! (`Reserving`).
//!
//! Durability is chosen with [`Synchronous`] (FULL by default); see
//! [`SqliteStore::builder`].
//!
//! Waiting duplicates ([`Store::wait_for_change`]) are woken at once by a
//! completion or release made through any handle of the same store in this
//! process; changes by other processes (or by other `SqliteStore`s opened on
//! the same file) are seen by a fallback poll, [`fallback_poll`].

use super::*;
use crate::error::Error;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::Row;
use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;

const STORE: &str = "sqlite";

/// How long a statement waits for another connection's (or process's) write lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The least time a store-mode reservation that met a held write lock takes
/// before it answers `InProgress` (see [`SqliteStore`]'s `reserve`).
const BUSY_TRY_AT_LEAST: Duration = Duration::from_millis(20);

/// The least time queued for the write turn that is taken off a
/// reservation's busy timeout (see `BusyTimeoutCut`).
const CUT_FROM: Duration = Duration::from_millis(250);

/// When such a reservation's caller may try again (its `retry_after`, at
/// most its lease): the lock's holder is unknown, so not a whole lease.
pub(super) const BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Connections in the pool of a file database opened with [`SqliteStore::connect`].
const MAX_FILE_CONNECTIONS: u32 = 8;

/// Where versions before 0.x's one migration runner recorded their
/// migrations; copied once into `idempotency_schema_migrations` and left in
/// place for older runtimes that share the file.
const LEGACY_MIGRATIONS_TABLE: &str = "_idempotent_migrations";

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
    "INSERT INTO main.idempotency_records ",
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
    " AS expired, is_error, result, ",
    "(SELECT read_uncommitted FROM pragma_read_uncommitted) AS reads_uncommitted ",
    "FROM main.idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3"
);

/// Why a read made on a connection left with `PRAGMA read_uncommitted = 1`
/// answers nothing ([`judge`]).
const READS_UNCOMMITTED: &str =
    "the connection reads uncommitted data (PRAGMA read_uncommitted = 1, \
     left on a connection of the pool by other code, or set on the caller's connection): with a \
     shared cache it sees other connections' writes before they commit, and a result replayed \
     from there may be rolled back; nothing was answered. Set PRAGMA read_uncommitted = 0 on the \
     pool's connections, or give the store a pool of its own";

/// How long ago an in-progress record's lease ran out (negative: not yet),
/// whether the whole row counts as absent, its fingerprint and its owner:
/// what a transaction that holds the write lock asks before taking a record
/// over (see [`live_owner_answer`]).
const LEASE_ENDED_SQL: &str = concat!(
    "SELECT ",
    now_ms!(),
    " - lease_expires_at AS lease_ended_ms, ",
    row_expired!(),
    " AS expired, fingerprint, owner_token FROM main.idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 AND state = 'in_progress'"
);

const COMPLETE_SQL: &str = concat!(
    "UPDATE main.idempotency_records SET state = 'complete', owner_token = NULL, ",
    "lease_expires_at = NULL, completed_at = ",
    now_ms!(),
    ", expires_at = ",
    now_ms!(),
    " + ?5, is_error = ?6, result = ?7, recovered = ?8 ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 ",
    "AND state = 'in_progress' AND owner_token = ?4"
);

const RELEASE_SQL: &str = concat!(
    "DELETE FROM main.idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 ",
    "AND state = 'in_progress' AND owner_token = ?4"
);

/// A renewal; the record's retention moves with its lease ([`Store::heartbeat`]).
const HEARTBEAT_SQL: &str = concat!(
    "UPDATE main.idempotency_records SET lease_expires_at = ",
    now_ms!(),
    " + ?5, expires_at = max(expires_at, COALESCE(",
    now_ms!(),
    " + ?5 + (expires_at - lease_expires_at), expires_at)) ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 ",
    "AND state = 'in_progress' AND owner_token = ?4"
);

const PURGE_SQL: &str = concat!(
    "DELETE FROM main.idempotency_records WHERE rowid IN (",
    "SELECT rowid FROM main.idempotency_records WHERE ",
    row_expired!(),
    " LIMIT ?1)"
);

const FETCH_SQL: &str = concat!(
    "SELECT state, fingerprint, owner_token, is_error, result, lease_expires_at, expires_at, ",
    now_ms!(),
    " AS now_ms, created_at, takeover_count + 1 AS attempt, ",
    "COALESCE(attempt_started_at, created_at) AS attempt_started_at, recovered ",
    "FROM main.idempotency_records WHERE tenant = ?1 AND scope = ?2 AND key = ?3"
);

/// The operator's release (rule 20's escape hatch): an in-progress record,
/// with `?4 = 1` only once its lease ran out. Returns its attempt number.
const FORCE_RELEASE_SQL: &str = concat!(
    "DELETE FROM main.idempotency_records ",
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
    "AS recovered, ",
    "MAX(CASE WHEN expired = 0 AND state = 'in_progress' AND lease_expires_at <= now_ms ",
    "THEN now_ms - lease_expires_at END) AS longest_stuck, ",
    "MAX(CASE WHEN expired THEN now_ms - CASE WHEN state = 'complete' THEN expires_at ",
    "ELSE MAX(expires_at, COALESCE(lease_expires_at, 0)) END END) AS longest_unpurged ",
    "FROM (SELECT scope, state, lease_expires_at, expires_at, created_at, now_ms, takeover_count, ",
    "recovered, ",
    "(expires_at <= now_ms AND (state = 'complete' OR COALESCE(lease_expires_at, 0) <= now_ms)) ",
    "AS expired ",
    "FROM main.idempotency_records, (SELECT ",
    now_ms!(),
    " AS now_ms)) ",
    "GROUP BY scope ORDER BY scope"
);

fn err(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| store_error(operation, e)
}

/// The store's error for a statement that failed: the database's own, or,
/// for one that found no records table, [`NoRecordsTable`], which says what
/// to do (store mode and transactional mode alike).
pub(super) fn store_error(operation: &'static str, e: sqlx::Error) -> StoreError {
    let missing = matches!(&e, sqlx::Error::Database(d)
        if d.message().starts_with("no such table:") && d.message().contains("idempotency_records"));
    if missing {
        StoreError::new(STORE, operation, NoRecordsTable(e))
    } else {
        StoreError::new(STORE, operation, e)
    }
}

/// A statement of the store's that found no records table in the database:
/// the database's error, with what to do about it. A database no store has
/// opened has none: transactional mode applies no migrations.
#[derive(Debug)]
struct NoRecordsTable(sqlx::Error);

impl std::fmt::Display for NoRecordsTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: the database has no idempotency records table. If no store has opened this \
             database yet, it has none: transactional mode (`tx = ...`) applies no migrations, \
             so open a store on it once at startup (`SqliteStore::from_pool(pool)` or \
             `SqliteStore::connect(url)`), which applies them; otherwise the table was dropped \
             after the store opened: restart the service, so the store opens again and makes it",
            self.0
        )
    }
}

impl std::error::Error for NoRecordsTable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// A lease or ttl for SQL; capped so `now + d` stays inside 64-bit integers.
fn ms(d: Duration) -> i64 {
    duration_to_millis(d)
}

/// The owner of an in-progress record and what is left of its lease (ms;
/// no row when the record is not in progress): what a waiting duplicate
/// looks at (one primary-key read, no write lock).
const LEASE_REMAINING_SQL: &str = concat!(
    "SELECT owner_token, lease_expires_at - ",
    now_ms!(),
    " FROM main.idempotency_records ",
    "WHERE tenant = ?1 AND scope = ?2 AND key = ?3 AND state = 'in_progress'"
);

/// SQLite's `synchronous` level on the store's connections: how durable a
/// recorded result (and a reservation) is once the call that wrote it returns.
///
/// The level is a trade between the cost of a commit and what a crash can
/// take back. "Lost" below means: after the crash the database is as it was
/// before the lost commits (consistent, never corrupt); a lost completion makes
/// the key look in progress or absent again, so a retry may run the body again.
///
/// | level | process crash (kill, panic, OOM) | OS crash or power loss |
/// |---|---|---|
/// | [`Full`](Self::Full) (default) | nothing lost | nothing lost |
/// | [`Normal`](Self::Normal), WAL mode | nothing lost | the last commits may be lost |
///
/// [`SqliteStore::connect`] uses `Full`. Choose with [`SqliteStore::builder`]:
///
/// ```
/// use idempotent_runtime::store::sqlite::Synchronous;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::Error> {
/// # let dir = std::env::temp_dir().join(format!("idempotent-doc-sync-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// # let url = format!("sqlite://{}", dir.join("orders.db").display());
/// let store = idempotent_runtime::SqliteStore::builder(&url)
///     .synchronous(Synchronous::Normal)
///     .connect()
///     .await?;
/// # drop(store);
/// # let _ = std::fs::remove_dir_all(&dir);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// `PRAGMA synchronous = FULL`: every commit is synced to stable storage
    /// (the WAL file is fsynced) before the statement returns. A recorded
    /// result survives a process crash, an OS crash and a power loss, as far
    /// as the storage honours fsync. The default.
    #[default]
    Full,
    /// `PRAGMA synchronous = NORMAL`, in WAL mode: commits are written to the
    /// WAL file but synced only at checkpoints. A recorded result survives a
    /// process crash (the data is in the OS's page cache); an OS crash or power
    /// loss may roll back the most recent commits (the database stays
    /// consistent). Commits are cheaper, since they do not wait for the disk.
    ///
    /// Only in WAL mode is NORMAL safe from corruption. If the file cannot be
    /// switched to WAL (e.g. a file system without shared memory),
    /// [`SqliteStoreBuilder::connect`] uses `Full` instead and logs a warning.
    Normal,
}

impl Synchronous {
    /// The value as `PRAGMA synchronous` takes it: `FULL` or `NORMAL`.
    pub fn as_str(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }

    /// The level from `PRAGMA synchronous`'s answer (0 OFF, 1 NORMAL, 2 FULL,
    /// 3 EXTRA); `None` for OFF, which this store never sets, and unknown
    /// values. EXTRA is at least as durable as FULL and reported as `Full`.
    pub fn from_pragma(value: i64) -> Option<Synchronous> {
        match value {
            1 => Some(Synchronous::Normal),
            2 | 3 => Some(Synchronous::Full),
            _ => None,
        }
    }

    fn sqlx(self) -> sqlx::sqlite::SqliteSynchronous {
        match self {
            Synchronous::Full => sqlx::sqlite::SqliteSynchronous::Full,
            Synchronous::Normal => sqlx::sqlite::SqliteSynchronous::Normal,
        }
    }
}

/// Opens a [`SqliteStore`] with options beyond the URL; made by
/// [`SqliteStore::builder`]. `SqliteStore::connect(url)` is
/// `SqliteStore::builder(url).connect()`.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct SqliteStoreBuilder {
    url: String,
    synchronous: Synchronous,
}

impl SqliteStoreBuilder {
    /// The `synchronous` level set on every connection the store opens
    /// (default [`Synchronous::Full`]). See [`Synchronous`] for what each
    /// level guarantees. Has no effect on what survives for in-memory
    /// databases, which nothing survives.
    pub fn synchronous(mut self, level: Synchronous) -> Self {
        self.synchronous = level;
        self
    }

    /// Opens (creating it if missing) the database and applies the store's
    /// migrations; see [`SqliteStore::connect`].
    ///
    /// # Errors
    /// [`Error::Store`] when the URL is malformed, the file cannot be opened
    /// or created, or the migrations fail.
    pub async fn connect(self) -> Result<SqliteStore, Error> {
        SqliteStore::open(&self.url, self.synchronous).await
    }
}

/// The longest pause between two looks at a record that a waiting duplicate
/// found in progress, when no change in this process wakes it: changes made
/// by other processes (or by another `SqliteStore` opened on the same file,
/// or committed in a caller's transaction) are seen this late at most.
pub const FALLBACK_POLL_MAX: Duration = Duration::from_millis(250);

/// The pause before the `round`-th fallback look at a record found in
/// progress ([`Store::wait_for_change`] of [`SqliteStore`]): 20 ms, doubling
/// every round, at most [`FALLBACK_POLL_MAX`]. A change made through the same
/// store in this process wakes the waiter at once instead.
///
/// ```
/// use idempotent_runtime::store::sqlite::{fallback_poll, FALLBACK_POLL_MAX};
/// use std::time::Duration;
/// assert_eq!(fallback_poll(0), Duration::from_millis(20));
/// assert_eq!(fallback_poll(1), Duration::from_millis(40));
/// assert_eq!(fallback_poll(30), FALLBACK_POLL_MAX);
/// ```
pub fn fallback_poll(round: u32) -> Duration {
    Duration::from_millis(20u64.saturating_mul(1u64 << round.min(16))).min(FALLBACK_POLL_MAX)
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
/// # let _ = std::fs::remove_dir_all(&dir);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// Serializes this process's writes so they queue here, not in SQLite's
    /// busy handler. Other processes are handled by the busy timeout.
    write_gate: WriteGate,
    /// Finishes the records of dropped calls (rule 14), on a small pool of
    /// its own with the store pool's options (so it works on after the
    /// application closed the store's pool at shutdown).
    detached: Arc<super::detached::Detached>,
    /// This process's waiting duplicates, woken by this store's completions
    /// and releases.
    waiters: Arc<super::waiters::Waiters>,
    /// The reservations under way in a task of their own, which the release
    /// of a call dropped meanwhile waits for.
    reserving: Arc<Reserving>,
    /// An in-memory database opened by [`connect`](Self::connect): one
    /// connection of the store's own, outside the pool, that keeps the
    /// database alive exactly as long as the store (a shared-cache in-memory
    /// database is gone when its last connection closes). The pool's one
    /// connection is not enough: sqlx returns a connection to its pool from a
    /// task on the runtime of the call, and closes it when that runtime has
    /// ended (a store shared by several `#[tokio::test]`s, each on a runtime
    /// of its own), taking every record with it. Held, never read.
    _keeps_in_memory_database: Option<Arc<std::sync::Mutex<sqlx::SqliteConnection>>>,
    /// The database is in memory: a connection of its pool is never closed
    /// by the store (the last one to close takes the database with it).
    in_memory: bool,
    /// [`Store::database_id`], read when the store opened.
    database_id: Option<Arc<str>>,
}

impl SqliteStore {
    /// Opens (creating it if missing) the database at `url` and applies the
    /// store's migrations.
    ///
    /// `url` is an sqlx SQLite URL: `sqlite://payments.db`, `sqlite:///var/lib/app/idem.db`,
    /// or `sqlite::memory:` for a private in-memory database (every clone of
    /// the store sees the same one; it is gone when the store is dropped).
    /// File databases use WAL journaling and a busy timeout, so several
    /// processes can share one file (and each connection its own cache: a
    /// `cache=shared` in the URL is not used for a file, since with SQLite's
    /// shared cache a replay would wait, without a bound, for any
    /// transaction that wrote the records table); several processes may also open (create
    /// and migrate) one brand-new file at the same moment. Connections use
    /// `synchronous = FULL` ([`Synchronous::Full`]: a recorded result survives
    /// power loss); to choose another level, use [`builder`](Self::builder).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::Error> {
    /// let store = idempotent_runtime::SqliteStore::connect("sqlite::memory:").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Store`] when the URL is malformed or names a VFS that takes
    /// no file locks (`vfs=unix-none`), its file name is a `file:` URI of
    /// SQLite's own asking for `nolock` or `cache=shared`, the file cannot
    /// be opened or created, or the migrations fail.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::open(url, Synchronous::Full).await
    }

    /// Options beyond the URL, e.g. the durability level:
    /// `SqliteStore::builder(url).synchronous(Synchronous::Normal).connect().await`.
    /// See [`Synchronous`].
    pub fn builder(url: &str) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            url: url.to_owned(),
            synchronous: Synchronous::Full,
        }
    }

    async fn open(url: &str, synchronous: Synchronous) -> Result<Self, Error> {
        let mut options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::new(STORE, "parse the connection URL", e))?
            // Opened only to look (the command line): never a new file.
            .create_if_missing(!super::migrate::only_check())
            .busy_timeout(BUSY_TIMEOUT)
            .synchronous(synchronous.sqlx());
        let mut first: sqlx::SqliteConnection = sqlx::Connection::connect_with(&options)
            .await
            .map_err(|e| {
                let file = options.get_filename().display().to_string();
                StoreError::new(
                    STORE,
                    "open the database",
                    format!(
                        "{file}: {e}; check the path: its directory must exist and this process \
                         may write there, and the file, if there is one, must be a SQLite database"
                    ),
                )
            })?;
        refuse_a_vfs_without_locks(&mut first).await?;
        let mut keeper = None;
        let pool = if shared_in_memory(&mut first, &options).await? {
            keeper = Some(first);
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
            refuse_uri_parameters_of_a_file_name(&options)?;
            // WAL is a property of the file: switch it once, waiting out other
            // processes doing the same, before the pool opens its connections
            // (which then find the file in WAL mode and need no switch).
            let file = options.get_filename().display().to_string();
            let wal = if super::migrate::only_check() {
                // Opened to look (the command line): the file stays as it is.
                sqlx::query_scalar::<_, String>("PRAGMA journal_mode")
                    .fetch_one(&mut first)
                    .await
                    .map_err(err("read the journal mode"))?
                    .eq_ignore_ascii_case("wal")
            } else {
                switch_to_wal(&mut first, &file)
                    .await
                    .map_err(err("switch the database to WAL journaling"))?
            };
            if !wal && synchronous == Synchronous::Normal {
                // NORMAL is only safe from corruption in WAL mode.
                tracing::warn!(target: "idempotent", file,
                    "sqlite: synchronous = NORMAL was asked for, but the database is not in WAL mode; \
                     using FULL");
                options = options.synchronous(Synchronous::Full.sqlx());
            }
            // A file's connections keep caches of their own, whatever the
            // URL says (`cache=shared`): with SQLite's shared cache they lock
            // whole tables, and a read of the records table (a replay, a
            // waiting duplicate) waited, past the busy timeout and without a
            // bound, for any transaction that had written it (a
            // transactional call's, for as long as its body runs), where
            // WAL lets it read beside the writer.
            options = options.shared_cache(false);
            let pool = pool_options()
                .max_connections(MAX_FILE_CONNECTIONS)
                .connect_with(options)
                .await;
            // Closed only now, so the WAL files are not removed and recreated in between.
            let _ = sqlx::Connection::close(first).await;
            pool
        }
        .map_err(|e| StoreError::new(STORE, "open the database", e))?;
        Self::on_pool(pool, keeper).await
    }

    /// Uses an existing pool (e.g. the application's own) and applies the
    /// store's migrations to its database.
    ///
    /// Durability is the pool's: the store leaves the `synchronous` level
    /// the pool's connect options set (sqlx's default is FULL, as
    /// [`Synchronous::Full`]) untouched, since the pool's connections also
    /// carry the application's own writes. Set it with
    /// `SqliteConnectOptions::synchronous`. A pool whose connections run
    /// with `synchronous = OFF` (a commit may be lost, and the file corrupted,
    /// on an OS crash or power loss) gets a warning in the log.
    ///
    /// The migrations are recorded in their own table, `idempotency_schema_migrations`,
    /// so they do not interfere with the application's sqlx migrations. For
    /// concurrent use, configure the pool with WAL journaling and a busy timeout
    /// (as [`connect`](Self::connect) does). What to know about such a pool:
    ///
    /// - Busy timeout: without one (`busy_timeout(Duration::ZERO)`) every write
    ///   that meets another connection's lock fails at once with "database is
    ///   locked" (a reservation answers `InProgress` at once, and a waiting
    ///   duplicate polls); the store logs a warning when it finds the pool so
    ///   configured.
    /// - WAL: `journal_mode(Wal)` in the pool's options runs the switch on
    ///   every new connection, and SQLite does not wait for a switch that
    ///   meets another connection's lock: pools of several processes creating
    ///   one brand-new file at once can fail with "database is locked". Open it once with `connect` (which waits
    ///   the switch out), or switch the file before the pools are made.
    ///   Without WAL (the rollback journal) the store works, more slowly.
    /// - Transactional mode (`tx = ...`): begin the transactions with
    ///   `BEGIN IMMEDIATE`. A deferred transaction that has read before
    ///   another connection wrote can never write, and is refused with
    ///   [`Error::StaleSnapshot`]. A call dropped while its reservation's
    ///   statement runs leaves its connection's busy timeout changed (at none
    ///   at all, or at the call's wait bound) until the next transactional
    ///   call on that connection: the connection's own writes then meet
    ///   another's lock with "database is locked" at once. Pools made by
    ///   `connect` restore it when the connection is released; on a pool of
    ///   your own, close a connection whose call you dropped
    ///   (`PoolConnection::close`), or call the store once more on it.
    /// - `PRAGMA read_uncommitted = 1` on a connection (left there by other
    ///   code, or on the caller's connection in transactional mode): with a
    ///   shared cache it reads other connections' uncommitted writes, so a
    ///   reservation that finds the record on such a connection is refused
    ///   with [`Error::Store`] rather than replay a result that may roll back.
    /// - In-memory databases with shared cache (`sqlite::memory:`) and more than
    ///   one connection: sqlx waits for another connection's table lock
    ///   without a bound, so `in_progress = wait(...)` and `reject` are not
    ///   honoured there. Use `connect("sqlite::memory:")` (one connection) or
    ///   `max_connections(1)`. The same holds for a file whose pool was opened
    ///   with a shared cache (`cache=shared` in its URL, or
    ///   `SqliteConnectOptions::shared_cache(true)`): a replay waits for every
    ///   transaction that wrote the records table; give a file's pool private
    ///   caches (the default), as `connect` does.
    /// - A VFS that takes no file locks (`unix-none`, `win32-none`): nothing
    ///   keeps two connections from reserving one key at once, and a body
    ///   may run twice. `connect` refuses such a URL; a pool of your own must
    ///   use a VFS that locks (the default).
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
        Self::on_pool(pool, None).await
    }

    /// [`from_pool`](Self::from_pool), with the connection that keeps an
    /// in-memory database alive if the caller opened one already.
    async fn on_pool(
        pool: SqlitePool,
        keeper: Option<sqlx::SqliteConnection>,
    ) -> Result<Self, Error> {
        migrate(&pool).await?;
        // SQLite has no privileges: a read that fails fails the open.
        let database_id =
            super::database_id_read_at_open(STORE, database_id(&pool).await, |_| false)?;
        let busy_timeout: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&pool)
            .await
            .map_err(err("read the busy timeout"))?;
        let file = pool.connect_options().get_filename().display().to_string();
        if busy_timeout <= 0 {
            tracing::warn!(target: "idempotent", file,
                "sqlite: the pool's connections have no busy timeout, so a write that meets another \
                 connection's lock fails at once with \"database is locked\"; set one with \
                 SqliteConnectOptions::busy_timeout");
        }
        let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&pool)
            .await
            .map_err(err("read the synchronous level"))?;
        if synchronous == 0 {
            tracing::warn!(target: "idempotent", file,
                "sqlite: the pool's connections run with synchronous = OFF: a recorded result may be \
                 lost, and the database corrupted, on an OS crash or power loss; set \
                 SqliteConnectOptions::synchronous to FULL (or NORMAL in WAL mode)");
        }
        // An in-memory database has no file: `main` is listed with none.
        let in_memory: bool = sqlx::query_scalar(
            "SELECT COALESCE((SELECT file FROM pragma_database_list WHERE name = 'main'), '') = ''",
        )
        .fetch_one(&pool)
        .await
        .map_err(err("read the database's file"))?;
        // A shared-cache in-memory database lives while one connection to it
        // is open: a pool that closes its idle connections (sqlx's defaults
        // do after 10 minutes) took every record with it. One connection of
        // the store's own keeps it. A private one (each connection a new,
        // empty database) cannot be kept by another connection: it is taken
        // only as a pool of one connection that is never closed (min 1, no
        // idle timeout, no lifetime), and refused otherwise.
        let keeper = match keeper {
            Some(keeper) => Some(keeper),
            None if in_memory => {
                let options = pool.connect_options();
                let mut keeper: sqlx::SqliteConnection = sqlx::Connection::connect_with(&*options)
                    .await
                    .map_err(err("open the database"))?;
                match shared_in_memory(&mut keeper, &options).await {
                    Ok(_) => Some(keeper),
                    Err(private) => {
                        let _ = sqlx::Connection::close(keeper).await;
                        let o = pool.options();
                        let kept_open = o.get_max_connections() == 1
                            && o.get_min_connections() >= 1
                            && o.get_idle_timeout().is_none()
                            && o.get_max_lifetime().is_none();
                        if !kept_open {
                            return Err(private.into());
                        }
                        None
                    }
                }
            }
            None => None,
        };
        let write_gate = WriteGate::new(millis_to_duration(busy_timeout));
        let waiters = Arc::new(super::waiters::Waiters::default());
        let reserving = Arc::new(Reserving::new(write_gate.patience));
        let detached = {
            use super::detached::{Detached, Work};
            // A file database: the worker's own small pool, with the store
            // pool's options (its hooks and pragmas too). The application may
            // close the store's pool while dropped calls' records are still to
            // be released (a shutdown), and then every release failed and the
            // records stayed in progress for their lease. An in-memory
            // database is reachable only through the store's own connections
            // (a private one is a new, empty database on each connection; a
            // shared-cache one is kept to one pooled connection): there the
            // worker uses the store's pool.
            let own_options = pool.options().clone().max_connections(2).min_connections(0);
            let (connect_options, stores_pool) = (pool.connect_options(), pool.clone());
            let (write_gate, waiters, reserving) =
                (write_gate.clone(), waiters.clone(), reserving.clone());
            Detached::new(
                STORE,
                Box::new(move || {
                    let pool = if in_memory {
                        stores_pool
                    } else {
                        own_options.connect_lazy_with((*connect_options).clone())
                    };
                    Arc::new(move |identity, token, work| {
                        let (pool, write_gate, waiters, reserving) = (
                            pool.clone(),
                            write_gate.clone(),
                            waiters.clone(),
                            reserving.clone(),
                        );
                        Box::pin(async move {
                            // The dropped call's reservation may still
                            // be under way, and land after any search; or
                            // have left its statement at SQLite.
                            let statement_left = match work {
                                Work::Release | Work::EndLease => reserving.ended(&token).await,
                                Work::Complete(..) => None,
                            };
                            // Its owner was ended as it was handed over: a
                            // renewal that saw it listed before, and went
                            // on without the write turn, lands first (see
                            // `SqliteStore::heartbeat`).
                            if matches!(work, Work::EndLease)
                                && !super::live_owners::renewals_landed(&token, write_gate.patience)
                                    .await
                            {
                                tracing::warn!(target: "idempotent",
                                    "sqlite: a renewal still unanswered past the busy timeout; \
                                     ending the lease anyway (should it land later, it renews \
                                     the lease once more)");
                            }
                            let mut pause = super::detached::RETRY_AFTER[0];
                            let done = loop {
                                let done = {
                                    let _turn = write_gate.take().await;
                                    match &work {
                                        Work::Release => release_on(&pool, &identity, &token).await,
                                        Work::EndLease => {
                                            heartbeat_on(&pool, &identity, &token, Duration::ZERO)
                                                .await
                                        }
                                        Work::Complete(answer) => {
                                            let completion = answer.completing(&identity, &token);
                                            complete_on(&pool, completion).await
                                        }
                                    }
                                };
                                // A statement left at SQLite lands within
                                // its busy timeout: looked for until then
                                // (the worker's schedule goes on after).
                                match statement_left {
                                    Some(until)
                                        if matches!(done, Ok(Fenced::NotOwner))
                                            && std::time::Instant::now() < until =>
                                    {
                                        tokio::time::sleep(pause).await;
                                        pause = (pause * 2).min(super::detached::SEARCH_PAUSE);
                                    }
                                    _ => break done,
                                }
                            };
                            if matches!(done, Ok(Fenced::Written)) {
                                waiters.notify(&identity);
                            }
                            if done.is_ok() {
                                // Written or fenced out: the owner is done.
                                super::live_owners::ended(&token);
                            }
                            done
                        })
                    })
                }),
            )
        };
        Ok(SqliteStore {
            pool,
            write_gate,
            detached: Arc::new(detached),
            waiters,
            reserving,
            _keeps_in_memory_database: keeper.map(|k| Arc::new(std::sync::Mutex::new(k))),
            in_memory,
            database_id,
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

    /// Runs `write` on the store's pool in this process's turn to write
    /// (see [`beside_the_caller`]), waiting for the turn at most `most`
    /// (see [`WriteGate::take_within`]; `Duration::MAX`: as long as it takes).
    async fn write_in_turn<T, W, F>(
        &self,
        operation: &'static str,
        most: Duration,
        write: W,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        W: FnOnce(PoolConnection<sqlx::Sqlite>) -> F + Send + 'static,
        F: std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let (gate, pool, in_memory) = (self.write_gate.clone(), self.pool.clone(), self.in_memory);
        beside_the_caller(operation, async move {
            let _turn = gate.take_within(most).await;
            let conn = outside_any_transaction(&pool, None, in_memory, operation).await?;
            write(conn).await
        })
        .await
    }

    async fn release_now(
        &self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<Fenced, StoreError> {
        super::live_owners::ended(token);
        let (id, token) = (identity.clone(), token.clone());
        let released = self
            .write_in_turn("release", Duration::MAX, move |mut conn| async move {
                release_on(&mut *conn, &id, &token).await
            })
            .await?;
        if released.is_written() {
            self.waiters.notify(identity);
        }
        Ok(released)
    }

    async fn complete_now(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        // The owner is at work while this call polls its completion, and
        // for a lease after one that failed (it is tried again): its body
        // has run (see `live_owners::completion`).
        let (id, token) = (completion.identity.clone(), completion.token.clone());
        let answer = completion.answer();
        // The turn is waited for a third of the owner's lease at most (see
        // `WriteGate::take_within`): nothing renews the lease meanwhile.
        let most = super::live_owners::lease(completion.token).map_or(Duration::MAX, |lease| {
            (lease / 3).max(Duration::from_millis(1))
        });
        let write = self.write_in_turn("complete", most, move |mut conn| async move {
            complete_on(&mut *conn, answer.completing(&id, &token)).await
        });
        let completed = super::live_owners::completion(completion.token, write).await?;
        super::live_owners::ended(completion.token);
        if completed.is_written() {
            self.waiters.notify(completion.identity);
        }
        Ok(completed)
    }
}

/// Refuses a database opened on one of SQLite's VFSes that take no file
/// locks (`unix-none`, `win32-none`: `vfs=unix-none`, chosen on network file
/// systems to be rid of "database is locked"). Nothing then keeps two
/// connections, or two processes, from writing at once: two transactions
/// begun at once each reserved one key and ran its body, and concurrent
/// commits can corrupt the file. Asked of SQLite itself
/// (`SQLITE_FCNTL_VFSNAME` on the connection `first`), not read from the
/// URL's text: sqlx decodes the query (`vfs=unix%2Dnone`), keeps the last
/// `vfs` of several, and hands SQLite a file name that is itself a `file:`
/// URI (`sqlite:file:app.db%3Fvfs%3Dunix-none`), and each of those opened
/// the file without locks past a look at the text.
async fn refuse_a_vfs_without_locks(first: &mut sqlx::SqliteConnection) -> Result<(), StoreError> {
    const OP: &str = "open the database";
    let vfs = {
        let mut handle = first.lock_handle().await.map_err(err(OP))?;
        let mut name: *mut std::ffi::c_char = std::ptr::null_mut();
        // SAFETY: the handle is a live connection, locked for our exclusive
        // use while `handle` is held; SQLITE_FCNTL_VFSNAME writes a string
        // allocated with sqlite3_malloc (or nothing) to `name`, which is
        // read and freed below.
        let rc = unsafe {
            libsqlite3_sys::sqlite3_file_control(
                handle.as_raw_handle().as_ptr(),
                c"main".as_ptr(),
                libsqlite3_sys::SQLITE_FCNTL_VFSNAME,
                (&raw mut name).cast(),
            )
        };
        if rc != libsqlite3_sys::SQLITE_OK || name.is_null() {
            // No file (an in-memory database), or a VFS that does not say.
            return Ok(());
        }
        // SAFETY: a NUL-terminated string from sqlite3_mprintf, freed once.
        let vfs = unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        unsafe { libsqlite3_sys::sqlite3_free(name.cast()) };
        vfs
    };
    // A shim VFS names those under it after a `/` ("shim/unix-none").
    if !vfs.split('/').any(|layer| layer.ends_with("-none")) {
        return Ok(());
    }
    Err(StoreError::new(
        STORE,
        OP,
        format!(
            "the VFS {vfs:?} takes no file locks, so nothing keeps two connections (or two \
             processes) from reserving one key at once and running its body twice: leave \
             `vfs` out of the URL (the default VFS locks the file), and keep the database on a \
             local file system whose locks work"
        ),
    ))
}

/// Refuses a file name that is itself a `file:` URI (the URL's path
/// percent-encoded: `sqlite:file:app.db%3Fnolock%3D1`; sqlx decodes it and
/// hands it to SQLite, which reads its parameters) asking for what the
/// store cannot work with: `nolock` (no file locks: two connections reserve
/// one key at once and run its body twice), or `cache=shared` (SQLite reads
/// it over the private cache the store gives a file's connections, and a
/// replay waited for any transaction that wrote the records table). Read as
/// SQLite reads them: a raw `?` starts the parameters and `#` ends them, each
/// name and value percent-decoded.
fn refuse_uri_parameters_of_a_file_name(options: &SqliteConnectOptions) -> Result<(), StoreError> {
    let filename = options.get_filename().to_string_lossy();
    let Some((_, query)) = filename
        .strip_prefix("file:")
        .and_then(|rest| rest.split_once('?'))
    else {
        return Ok(());
    };
    let query = query.split_once('#').map_or(query, |(query, _)| query);
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let (name, value) = (percent_decoded(name), percent_decoded(value));
        let why = match name.as_str() {
            "nolock" if sqlite_true(&value) => {
                "`nolock` takes no file locks, so nothing keeps two connections (or two \
                 processes) from reserving one key at once and running its body twice"
            }
            "cache" if value == "shared" => {
                "`cache=shared` gives the file's connections SQLite's shared cache, with which \
                 a replay waits, without a bound, for any transaction that wrote the records table"
            }
            _ => continue,
        };
        return Err(StoreError::new(
            STORE,
            "open the database",
            format!(
                "the file name {filename:?} is a `file:` URI asking for {name}={value}: {why}; \
                 name the file as a path (`sqlite://path/to/app.db`), with sqlx's own \
                 parameters (`mode`, `immutable`) in the URL's query"
            ),
        ));
    }
    Ok(())
}

/// `text` with its `%HH` escapes decoded (as SQLite decodes a URI's
/// parameters); a `%` not followed by two hex digits stays as it is.
pub(crate) fn percent_decoded(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

/// Whether SQLite reads a URI parameter's `value` as true
/// (`sqlite3_uri_boolean`: a number other than 0, or yes, on, true).
fn sqlite_true(value: &str) -> bool {
    let digits: String = value.chars().take_while(char::is_ascii_digit).collect();
    if !digits.is_empty() {
        return digits.chars().any(|d| d != '0');
    }
    ["yes", "on", "true"]
        .iter()
        .any(|word| value.eq_ignore_ascii_case(word))
}

/// Whether the database `first` (a connection opened with `options`) has no
/// file but lives in memory, shared by every connection opened with the same
/// options (`sqlite::memory:`, `file::memory:?cache=shared`): asked of SQLite
/// itself, not read from the URL's text (percent-encoding, parameter order).
/// A database without a file is opened a second time, and that connection
/// must see a table the first made. Refuses one that each connection would
/// open anew, empty: an empty path (SQLite's private temporary database), or
/// an in-memory database without a shared cache (`mode=memory&cache=private`,
/// `file::memory:`). The store's pools and its background worker open
/// several connections, and each would see a database of its own: records
/// lost, completions failing on a missing table, and a retry running the
/// body again.
async fn shared_in_memory(
    first: &mut sqlx::SqliteConnection,
    options: &SqliteConnectOptions,
) -> Result<bool, StoreError> {
    const OP: &str = "open the database";
    const PROBE: &str = "idempotency_connection_probe";
    let file: String =
        sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
            .fetch_one(&mut *first)
            .await
            .map_err(err(OP))?;
    if !file.is_empty() {
        return Ok(false);
    }
    let mut second: sqlx::SqliteConnection = sqlx::Connection::connect_with(options)
        .await
        .map_err(err(OP))?;
    sqlx::query(&format!("CREATE TABLE IF NOT EXISTS {PROBE} (x INTEGER)"))
        .execute(&mut *first)
        .await
        .map_err(err(OP))?;
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE name = ?")
        .bind(PROBE)
        .fetch_one(&mut second)
        .await
        .map_err(err(OP))?;
    let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {PROBE}"))
        .execute(&mut *first)
        .await;
    let _ = sqlx::Connection::close(second).await;
    if seen == 1 {
        return Ok(true);
    }
    Err(StoreError::new(
        STORE,
        "parse the connection URL",
        "the URL names no file, or an in-memory database without a shared cache: every \
         connection would open a database of its own, empty; name a file \
         (`sqlite://path/to/app.db`) or use a shared in-memory database (`sqlite::memory:`)",
    ))
}

/// A store's reservations under way in a task of their own
/// ([`beside_the_caller`]), by owner token. Such a reservation goes on when
/// its call is dropped, and may land long after: it waits for the write
/// turn (up to the busy timeout), for a pool connection (up to the pool's
/// `acquire_timeout`, sqlx's default 30 s, once per connection found inside
/// a transaction), then for SQLite's lock. The dropped call's release (or
/// end of lease), made by the background worker, waits here for it to end
/// before it looks for the record: on its schedule alone the release gave up
/// after about 9 s, and a reservation landing later stayed in progress under
/// the dropped call's token, every retry refused until its lease ran out.
///
/// A reservation that ends while its statement is at SQLite (on a
/// current-thread runtime it runs in the caller's future and ends with it;
/// on any runtime, one shut down) leaves that statement behind: SQLite runs
/// it without its caller, and it lands as late as the busy timeout after,
/// when it gets the lock (`statement_lands_within`). The release
/// then looks for the record until then.
#[derive(Debug)]
struct Reserving {
    by_token: std::sync::Mutex<HashMap<OwnerToken, KnownReservation>>,
    /// How long after its call a statement left at SQLite may still land:
    /// the busy timeout it waits for the lock.
    statement_lands_within: Duration,
}

/// A reservation [`Reserving`] knows of.
#[derive(Debug)]
enum KnownReservation {
    /// Under way: answers when the reservation's `UnderWay` is dropped.
    UnderWay(tokio::sync::watch::Receiver<()>),
    /// Ended with its statement left at SQLite, which may land until then.
    StatementLeft(std::time::Instant),
}

impl Reserving {
    fn new(statement_lands_within: Duration) -> Self {
        Reserving {
            by_token: std::sync::Mutex::default(),
            statement_lands_within,
        }
    }

    fn by_token(&self) -> std::sync::MutexGuard<'_, HashMap<OwnerToken, KnownReservation>> {
        // Only single inserts and removals: a poisoned map is still usable.
        self.by_token
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `token`'s reservation is under way until the answer is dropped.
    fn begins(self: &Arc<Self>, token: &OwnerToken) -> UnderWay {
        let (ended, running) = tokio::sync::watch::channel(());
        self.by_token()
            .insert(token.clone(), KnownReservation::UnderWay(running));
        UnderWay {
            reserving: self.clone(),
            token: token.clone(),
            ended,
            statement_sent: false,
        }
    }

    /// Returns once `token`'s reservation, if one is under way, has ended:
    /// until when the statement it left at SQLite may still land, if it
    /// left one (forgotten once told).
    async fn ended(&self, token: &OwnerToken) -> Option<std::time::Instant> {
        loop {
            let mut running = {
                let mut by_token = self.by_token();
                match by_token.get(token) {
                    Some(KnownReservation::UnderWay(running)) => running.clone(),
                    Some(&KnownReservation::StatementLeft(until)) => {
                        by_token.remove(token);
                        return Some(until);
                    }
                    None => return None,
                }
            };
            // Nothing is ever sent: this answers (an error) when the
            // reservation's `UnderWay` is dropped.
            let _ = running.changed().await;
        }
    }
}

/// A reservation under way ([`Reserving::begins`]); its end when dropped.
struct UnderWay {
    reserving: Arc<Reserving>,
    token: OwnerToken,
    ended: tokio::sync::watch::Sender<()>,
    /// Its statement is at SQLite, unanswered.
    statement_sent: bool,
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        let mut by_token = self.reserving.by_token();
        if by_token.get(&self.token).is_some_and(|known| {
            matches!(known, KnownReservation::UnderWay(running)
                if running.same_channel(&self.ended.subscribe()))
        }) {
            if self.statement_sent {
                // Statements left whose time is up and that no release came
                // for (a `Store` used directly) are forgotten here, on this
                // rare path (a call dropped mid-statement).
                let now = std::time::Instant::now();
                by_token.retain(|_, known| {
                    !matches!(known, KnownReservation::StatementLeft(until) if *until < now)
                });
                let until = now + self.reserving.statement_lands_within;
                by_token.insert(self.token.clone(), KnownReservation::StatementLeft(until));
            } else {
                by_token.remove(&self.token);
            }
        }
        // `ended` is dropped next, waking the release waiting for it.
    }
}

/// This process's turn to write: writes queue here rather than spin in
/// SQLite's busy handler, and without holding pool connections. A turn is
/// waited for at most `patience` (the pool's busy timeout, or the default
/// one when it has none), as SQLite waits for a lock: a turn held longer may
/// be held by a call future kept alive but no longer polled on a
/// current-thread runtime (where writes run in the caller's future, see
/// [`beside_the_caller`]). The write then goes ahead without the turn, and
/// SQLite's own lock keeps it correct, as for a write of another process; a
/// parked call never holds up the other calls of the process for longer
/// than that.
#[derive(Debug, Clone)]
struct WriteGate {
    turn: Arc<tokio::sync::Mutex<()>>,
    patience: Duration,
}

impl WriteGate {
    fn new(busy_timeout: Duration) -> Self {
        let patience = if busy_timeout.is_zero() {
            BUSY_TIMEOUT
        } else {
            busy_timeout
        };
        WriteGate {
            turn: Arc::new(tokio::sync::Mutex::new(())),
            patience,
        }
    }

    /// The turn if it is free now.
    fn try_take(&self) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        self.turn.clone().try_lock_owned().ok()
    }

    /// The turn, waited for at most `patience`; `None` past it. On every
    /// runtime: a store may be shared by several, and a turn taken on a
    /// current-thread one by a call that is then parked would otherwise hold
    /// up the writes of a multi-threaded one for ever. (Past the bound a
    /// write holds a pool connection in SQLite's busy handler, one a replay
    /// might have used: only when the turn was held that long.)
    async fn take(&self) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        self.take_within(self.patience).await
    }

    /// The turn, waited for at most `most` (and never past `patience`);
    /// `None` past it. A lease renewal, and a completion, wait at most a
    /// third of the owner's lease: a turn parked with a call kept alive but
    /// no longer polled held up every renewal and completion of the process
    /// for the whole busy timeout, and a live owner's shorter lease ran out
    /// while its body ran (another process took the record over, and ran
    /// the body beside it) or while its answer waited to be recorded.
    async fn take_within(&self, most: Duration) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        let most = most.min(self.patience);
        match tokio::time::timeout(most, self.turn.clone().lock_owned()).await {
            Ok(turn) => Some(turn),
            Err(_) => {
                tracing::warn!(target: "idempotent", waited_ms = most.as_millis() as u64,
                    "sqlite: this process's write turn stayed taken past the busy timeout or, \
                     for a renewal or a completion, a third of the lease (a call future kept \
                     alive but no longer polled on a current-thread runtime?); writing without it");
                None
            }
        }
    }
}

/// Runs `write`, a store write that takes the process's write turn, where no
/// caller's future can keep that turn: in a task of its own on a
/// multi-threaded runtime, polled to its end whatever its caller does. A
/// caller kept alive but no longer polled (parked in a `select!` loop,
/// leaked) would otherwise keep the turn, and every other write in the
/// process would wait for it for as long as it lives. A write under way when
/// its caller is dropped finishes (as a statement sent to SQLite does
/// anyway). On a current-thread runtime (or outside one) it runs in the
/// caller's future: there a task of its own runs only while someone drives
/// the runtime (`Handle::block_on` from another thread does not), so a
/// spawned write could wait for ever.
async fn beside_the_caller<T: Send + 'static>(
    operation: &'static str,
    write: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    let multi_threaded = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if !multi_threaded {
        return write.await;
    }
    tokio::spawn(write)
        .await
        .map_err(|e| StoreError::new(STORE, operation, e))?
}

/// A connection of `pool` outside any transaction, for the store's writes
/// (see [`super::outside_any_transaction`]). SQLite tells
/// (`sqlite3_get_autocommit`, no statement). A connection to a database
/// `in_memory` is never closed (the last one to close takes the database
/// with it): the write is refused instead.
async fn outside_any_transaction(
    pool: &SqlitePool,
    first: Option<PoolConnection<sqlx::Sqlite>>,
    in_memory: bool,
    operation: &'static str,
) -> Result<PoolConnection<sqlx::Sqlite>, StoreError> {
    let if_left_open = if in_memory {
        super::IfLeftOpen::Refuse
    } else {
        super::IfLeftOpen::Close
    };
    super::outside_any_transaction(STORE, operation, pool, first, if_left_open, |conn| {
        Box::pin(super::sqlite_tx::in_transaction(conn))
    })
    .await
}

/// A pool connection whose busy timeout may have been cut short for one
/// statement (by the time its call already queued for the write turn). The
/// timeout is put back by [`put_back`](Self::put_back); a call dropped
/// before that (mid-statement, on a current-thread runtime where the write
/// runs in the caller's future) closes the connection instead of giving it
/// back with the short timeout, since a pool given to
/// [`SqliteStore::from_pool`] has no release hook that would restore it.
struct BusyTimeoutCut {
    conn: PoolConnection<sqlx::Sqlite>,
    /// The connection's key and its busy timeout (ms) before the cut, until
    /// put back.
    cut: Option<(usize, i32)>,
}

impl BusyTimeoutCut {
    /// The connection as it is.
    fn none(conn: PoolConnection<sqlx::Sqlite>) -> Self {
        BusyTimeoutCut { conn, cut: None }
    }

    /// The connection with `waited` taken off its busy timeout (down to none
    /// at all: SQLite then answers at once if another connection holds the
    /// lock). A wait under [`CUT_FROM`] is left alone: writes of one process
    /// queue for milliseconds all the time, and cutting costs three round
    /// trips to SQLite's worker thread (a call then waits at most the busy
    /// timeout and `CUT_FROM`).
    async fn by(conn: PoolConnection<sqlx::Sqlite>, waited: Duration) -> Result<Self, sqlx::Error> {
        let mut this = Self::none(conn);
        if waited < CUT_FROM {
            return Ok(this);
        }
        let waited = i64::try_from(waited.as_millis()).unwrap_or(i64::MAX);
        let current: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&mut *this.conn)
            .await?;
        if current <= 0 {
            return Ok(this);
        }
        let left = i32::try_from(current.saturating_sub(waited)).unwrap_or(0);
        let current = i32::try_from(current).unwrap_or(i32::MAX);
        // Counted as cut from before the change is made: a call dropped
        // meanwhile closes the connection too.
        this.cut = Some((0, current));
        this.cut = Some(super::sqlite_tx::set_busy_timeout(&mut this.conn, current, left).await?);
        Ok(this)
    }

    /// Whether the busy timeout is cut now (not yet put back).
    fn is_cut(&self) -> bool {
        self.cut.is_some()
    }

    /// Puts the busy timeout back as it was (on failure the connection is
    /// closed when dropped).
    async fn put_back(&mut self) -> Result<(), sqlx::Error> {
        if let Some((key, original)) = self.cut {
            super::sqlite_tx::put_back_busy_timeout(&mut self.conn, key, original).await?;
            self.cut = None;
        }
        Ok(())
    }
}

impl std::ops::Deref for BusyTimeoutCut {
    type Target = sqlx::SqliteConnection;
    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}

impl std::ops::DerefMut for BusyTimeoutCut {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.conn
    }
}

impl Drop for BusyTimeoutCut {
    fn drop(&mut self) {
        if let Some((key, _)) = self.cut {
            self.conn.close_on_drop();
            // Closed, not given back: nothing to restore (0: the cut was
            // still being made, and nothing was listed).
            if key != 0 {
                super::sqlite_tx::forget_busy_timeout(key);
            }
        }
    }
}

/// `sql`, a write on the record `token` owns, with that record bound: its
/// first four parameters are the tenant, scope, key and owner token. The
/// caller binds the rest, in order, after them.
fn on_owned_record<'q>(
    sql: &'q str,
    identity: &'q Identity,
    token: &'q OwnerToken,
) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>> {
    sqlx::query(sql)
        .bind(&identity.tenant)
        .bind(&identity.scope)
        .bind(&identity.key)
        .bind(token.as_str())
}

/// Runs a write fenced by the owner token ([`on_owned_record`]): `Written`
/// when it changed the record, `NotOwner` when the token no longer owns it.
async fn fenced<'e, 'q, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
    operation: &'static str,
    statement: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
    executor: E,
) -> Result<Fenced, StoreError> {
    let done = statement.execute(executor).await.map_err(err(operation))?;
    Ok(Fenced::from_owned(done.rows_affected() > 0))
}

/// Completes the record, fenced by its token, on a pool or on the caller's
/// connection (transactional mode). An outcome a `recover` hook gave is
/// marked recovered (rule 20).
pub(super) async fn complete_on<'e, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
    executor: E,
    completion: Completion<'_>,
) -> Result<Fenced, StoreError> {
    let statement = on_owned_record(COMPLETE_SQL, completion.identity, completion.token)
        .bind(ms(completion.ttl))
        .bind(completion.outcome.is_error)
        .bind(&completion.outcome.payload[..])
        .bind(completion.marks_recovered());
    fenced("complete", statement, executor).await
}

/// Renews (or, with a shorter lease, ends early) the lease `token` owns.
pub(super) async fn heartbeat_on<'e, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
    lease: Duration,
) -> Result<Fenced, StoreError> {
    let statement = on_owned_record(HEARTBEAT_SQL, identity, token).bind(ms(lease));
    fenced("heartbeat", statement, executor).await
}

/// Deletes the in-progress record, fenced by `token`.
pub(super) async fn release_on<'e, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
) -> Result<Fenced, StoreError> {
    fenced(
        "release",
        on_owned_record(RELEASE_SQL, identity, token),
        executor,
    )
    .await
}

/// The write path of a reservation, on a connection in autocommit (the
/// store's: each statement is its own transaction) or inside the caller's
/// transaction (transactional mode): one conditional upsert decides
/// atomically; when it does not acquire, the row it met is read and judged.
/// In autocommit the row may change between the two statements; that is
/// harmless, since only the upsert ever acquires: a row that is gone or
/// expired by the time it is read gets a second upsert.
pub(super) async fn reserve_in(
    conn: &mut sqlx::SqliteConnection,
    request: ReserveRequest<'_>,
) -> Result<Reservation, sqlx::Error> {
    let id = request.identity;
    let fingerprint = request.fingerprint.map(Fingerprint::as_str);
    // Two passes at most: a lease that runs out between the upsert and the
    // read is taken over on the second pass.
    for _ in 0..2 {
        // Read to the end (`fetch_all`, one row at most), never stopped at
        // the returned row: an autocommit statement commits when it runs to
        // its end, and a commit that fails (in the rollback journal, a reader
        // held past the busy timeout) rolls the insert back. Stopped early,
        // the statement committed when it was reset, where sqlx does not see
        // its failure, and the call was told `Acquired` for nothing.
        let acquired: Vec<(i64, Option<i64>)> = sqlx::query_as(RESERVE_SQL)
            .bind(&id.tenant)
            .bind(&id.scope)
            .bind(&id.key)
            .bind(fingerprint)
            .bind(request.token.as_str())
            .bind(ms(request.lease))
            .bind(ms(request.ttl))
            .fetch_all(&mut *conn)
            .await?;
        if let Some(&(takeovers, previous_started)) = acquired.first() {
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

/// What a caller's transaction that already holds the database's write lock
/// (or, in the rollback journal, a shared lock) answers about a record
/// whose owner is a call of this process still at work
/// ([`live_owners`](super::live_owners)), if the reservation would
/// otherwise take it over: its lease ran out while the transaction kept the
/// owner from renewing it (or from recording its result), or runs out at
/// any moment while the transaction keeps doing so. Read in the
/// transaction, which is current (no one else can commit while it holds
/// the lock). `None`: no such owner; the reservation decides as ever.
pub(super) async fn live_owner_answer(
    conn: &mut sqlx::SqliteConnection,
    request: ReserveRequest<'_>,
) -> Result<Option<LiveOwnerAnswer>, sqlx::Error> {
    let id = request.identity;
    let Some(row) = sqlx::query(LEASE_ENDED_SQL)
        .bind(&id.tenant)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(None);
    };
    let ended: Option<i64> = row.try_get("lease_ended_ms")?;
    let expired: bool = row.try_get("expired")?;
    let stored: Option<String> = row.try_get("fingerprint")?;
    let owner: Option<String> = row.try_get("owner_token")?;
    // A record of another request is answered as a mismatch, never taken over.
    let would_take_it = expired
        || !fingerprints_conflict(
            stored.as_deref(),
            request.fingerprint.map(Fingerprint::as_str),
        );
    if !would_take_it || !owner.is_some_and(|owner| super::live_owners::alive(&owner)) {
        return Ok(None);
    }
    // Answered here, never by the upsert, whose own look at the clock may
    // find the lease over a moment later.
    Ok(Some(match ended {
        Some(ended) if ended < 0 => LiveOwnerAnswer::InProgress(millis_to_duration(-ended)),
        _ => LiveOwnerAnswer::KeptFromWriting,
    }))
}

/// See [`live_owner_answer`].
pub(super) enum LiveOwnerAnswer {
    /// The lease is live for this long: a call in progress.
    InProgress(Duration),
    /// The lease ran out while the owner is at work: the caller's
    /// transaction must end so that it can write.
    KeptFromWriting,
}

/// The options of the pools [`SqliteStore::connect`] makes: a connection
/// whose busy timeout a dropped transactional call left changed gets it back
/// when it returns to the pool (or is closed if that fails).
fn pool_options() -> SqlitePoolOptions {
    SqlitePoolOptions::new().after_release(|conn, _| {
        Box::pin(async move { Ok(super::sqlite_tx::restore_busy_timeout(conn).await.is_ok()) })
    })
}

/// The error of an operator's write (a release, the purge): one that met
/// another connection's lock for the whole busy timeout says so, and what
/// to do, rather than SQLite's "database is locked".
fn locked_out_or(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| {
        if is_busy(&e) {
            StoreError::new(
                STORE,
                operation,
                format!(
                    "another connection held the database's write lock for the whole busy \
                     timeout (an open transaction: perhaps a transactional-mode call in progress, \
                     or its caller has not committed yet); retry once that transaction has ended \
                     ({e})"
                ),
            )
        } else {
            err(operation)(e)
        }
    }
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
///
/// Answers whether the file is in WAL mode now.
async fn switch_to_wal(conn: &mut sqlx::SqliteConnection, file: &str) -> Result<bool, sqlx::Error> {
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
        return Ok(false);
    }
    Ok(true)
}

/// What tells this database's records apart from any other's
/// ([`Store::database_id`]): the id migration 0003 made once for them, and
/// the file of the database the records are in as SQLite names it (empty
/// in memory). The store reads it when it opens; transactional mode reads
/// it on the caller's connection, and so gets the same text there. The file
/// is the one an unqualified `idempotency_records` is found in (`temp`,
/// then `main`, then the attached databases in the order they were
/// attached), not always `main`'s: a caller's connection may open a file of
/// its own and reach the records in one it attached, as the store's
/// statements in its transactions do.
const DATABASE_ID_SQL: &str = "SELECT d.id || '/' || COALESCE(
        (SELECT l.file FROM pragma_database_list l
          WHERE EXISTS (SELECT 1 FROM pragma_table_info('idempotency_records', l.name))
          ORDER BY l.name <> 'temp', l.seq
          LIMIT 1), '')
      FROM idempotency_database d";

/// Reads [`DATABASE_ID_SQL`] on `conn` (`None` when its row is gone).
pub(super) async fn database_id<'c>(
    conn: impl sqlx::Executor<'c, Database = sqlx::Sqlite>,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(DATABASE_ID_SQL)
        .fetch_optional(conn)
        .await
}

/// Applies the embedded migrations that this database has not seen, in one
/// `BEGIN IMMEDIATE` transaction so two processes opening a new file at once
/// do not both apply them.
async fn migrate(pool: &SqlitePool) -> Result<(), StoreError> {
    let mut backend = MigrationTransaction {
        pool: pool.clone(),
        tx: super::migrate::OneTransaction::new(None),
    };
    super::migrate::run(&mut backend, super::migrate::SQLITE)
        .await
        .map_err(|e| StoreError::new(STORE, super::migrate::operation(), e))
}

/// The migration runner's view of SQLite: one `BEGIN IMMEDIATE` transaction
/// (the database's write lock) for the whole run.
struct MigrationTransaction {
    pool: SqlitePool,
    tx: super::migrate::OneTransaction<sqlx::Sqlite>,
}

impl MigrationTransaction {
    fn tx(&mut self) -> Result<&mut sqlx::SqliteConnection, sqlx::Error> {
        self.tx.connection()
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
                    self.tx = super::migrate::OneTransaction::new(Some(tx));
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
        self.tx.applied().await
    }

    /// A plain read on the pool (in WAL mode it never waits for a writer; a
    /// rollback-journal pool of the user's may wait its busy timeout);
    /// `Ok(None)` when there is no history table yet (an error: the locked
    /// run reports what is wrong).
    async fn applied_without_lock(&mut self) -> Result<Option<Vec<(i64, Vec<u8>)>>, sqlx::Error> {
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
        )
        .bind(super::migrate::HISTORY_TABLE)
        .fetch_one(&self.pool)
        .await?;
        if !exists {
            return Ok(None);
        }
        super::migrate::applied_on(&self.pool).await.map(Some)
    }

    async fn execute(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        self.tx.execute(sql).await
    }

    async fn record(&mut self, migration: &super::migrate::Migration) -> Result<(), sqlx::Error> {
        const INSERT: &str = concat!(
            "INSERT INTO idempotency_schema_migrations (version, description, checksum, applied_at) ",
            "VALUES (?1, ?2, ?3, ",
            now_ms!(),
            ")"
        );
        super::migrate::record_on(self.tx()?, INSERT, migration).await
    }

    async fn unlock(&mut self, done: bool) -> Result<(), sqlx::Error> {
        self.tx.finish(done).await
    }
}

/// Reads the record and answers from that read alone, when it can: a live
/// record gives a replay, a mismatch or a live lease; `None` when it is absent,
/// expired or its lease ran out (a write is due).
pub(super) async fn answer_from_a_read<'e, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
    executor: E,
    request: ReserveRequest<'_>,
) -> Result<Option<Reservation>, sqlx::Error> {
    Ok(read_and_judge(executor, request)
        .await?
        .map(|(answer, _)| answer))
}

/// The answer of a read that no later commit can change, however old the
/// reading transaction's snapshot: a complete record that has not expired
/// answers a replay or a mismatch (it does not change until it expires).
/// `None` for anything else (absent, expired, in progress), which goes the
/// write path.
pub(super) async fn settled_answer_from_a_read<
    'e,
    E: sqlx::Executor<'e, Database = sqlx::Sqlite>,
>(
    executor: E,
    request: ReserveRequest<'_>,
) -> Result<Option<Reservation>, sqlx::Error> {
    Ok(read_and_judge(executor, request)
        .await?
        .and_then(|(answer, complete)| complete.then_some(answer)))
}

/// Reads the record and judges it ([`judge`]); with the answer, whether the
/// record is complete.
async fn read_and_judge<'e, E: sqlx::Executor<'e, Database = sqlx::Sqlite>>(
    executor: E,
    request: ReserveRequest<'_>,
) -> Result<Option<(Reservation, bool)>, sqlx::Error> {
    let id = request.identity;
    let Some(row) = sqlx::query(EXISTING_SQL)
        .bind(&id.tenant)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(executor)
        .await?
    else {
        return Ok(None);
    };
    let Some(answer) = judge(&row, request.fingerprint.map(Fingerprint::as_str))? else {
        return Ok(None);
    };
    let state: String = row.try_get("state")?;
    Ok(Some((
        answer,
        RecordState::parse(&state) == Some(RecordState::Complete),
    )))
}

/// What an existing row (read with `EXISTING_SQL`) answers to a request with
/// `fingerprint`; `None` when the row is expired or its lease ran out, so the
/// caller must go through the conditional upsert. A row read on a connection
/// that reads uncommitted data (`PRAGMA read_uncommitted = 1`, which with a
/// shared cache skips the table locks) answers nothing: it may be another
/// connection's uncommitted reservation or result, and a duplicate replayed
/// a result its owner's transaction then rolled back. It fails with
/// [`READS_UNCOMMITTED`].
fn judge(
    row: &sqlx::sqlite::SqliteRow,
    fingerprint: Option<&str>,
) -> Result<Option<Reservation>, sqlx::Error> {
    if row.try_get::<i64, _>("reads_uncommitted")? != 0 {
        return Err(sqlx::Error::Configuration(READS_UNCOMMITTED.into()));
    }
    super::rows::Columns(row).answer(fingerprint)
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    fn name(&self) -> &'static str {
        STORE
    }

    fn database_id(&self) -> Option<&str> {
        self.database_id.as_deref()
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        const OP: &str = "reserve";
        // Fast path, one read and no write lock: a live record that answers
        // the request by itself (replay, mismatch, or a live lease). Replays
        // and waiting duplicates never queue behind writers.
        // Time queued for the read's connection counts against the write's
        // busy timeout as time queued for the write turn does (below): on a
        // small pool, a write waiting in SQLite's busy handler for a lock
        // held outside this process's turn (a transactional-mode caller,
        // another process) holds the connection the other calls queue for,
        // and each of them, given the whole busy timeout again, held it as
        // long: duplicates queued past the pool's acquire timeout.
        let queued = tokio::time::Instant::now();
        let mut conn = self.pool.acquire().await.map_err(err(OP))?;
        match answer_from_a_read(&mut *conn, request).await {
            Ok(Some(answer)) => return Ok(answer),
            Ok(None) => {}
            // In the rollback journal a writer committing (or holding the
            // database exclusively) keeps readers out too: the write path
            // below waits for the lock as well, and past it answers
            // `InProgress`, as a reservation that met the lock does.
            Err(e) if is_busy(&e) => {}
            Err(e) => return Err(err(OP)(e)),
        }

        // Write path: absent, expired, or a lease that ran out. The
        // conditional upsert is one autocommit statement: SQLite takes the
        // write lock for it as for `BEGIN IMMEDIATE` (waiting in the busy
        // handler, never failing on a stale snapshot, since an autocommit
        // statement holds none), and decides atomically. The read's
        // connection is kept when the gate is free; a call that must queue
        // for the gate gives it back meanwhile, so queued writers never hold
        // the connections that replays need.
        // Beside the caller (see `beside_the_caller`), with the request's
        // parts owned.
        let (gate, pool, in_memory) = (self.write_gate.clone(), self.pool.clone(), self.in_memory);
        let (identity, token) = (request.identity.clone(), request.token.clone());
        let fingerprint = request.fingerprint.cloned();
        let (lease, ttl) = (request.lease, request.ttl);
        let sent = std::time::Instant::now();
        let under_way = self.reserving.begins(request.token);
        let answer = beside_the_caller(OP, async move {
            // Declared first, dropped last: the reservation has ended (its
            // statement landed or failed, or was left at SQLite) once this
            // is gone.
            let mut under_way = under_way;
            let (turn, mut conn) = match gate.try_take() {
                Some(turn) => {
                    let conn = outside_any_transaction(&pool, Some(conn), in_memory, OP).await?;
                    // Cut only after a long wait for the connection (at
                    // least `CUT_FROM`): nothing is sent otherwise.
                    let conn = BusyTimeoutCut::by(conn, queued.elapsed())
                        .await
                        .map_err(err(OP))?;
                    (Some(turn), conn)
                }
                None => {
                    drop(conn);
                    tracing::trace!(target: "idempotent", scope = %identity.scope,
                        key = %identity.key_digest(), "sqlite: waiting for the write turn");
                    let turn = gate.take().await;
                    let conn = outside_any_transaction(&pool, None, in_memory, OP).await?;
                    // Time queued for the turn (and for the read's
                    // connection) counts against the busy timeout: the
                    // statement waits only for what is left of it, so a
                    // call never waits twice the busy timeout.
                    let waited = queued.elapsed();
                    let conn = BusyTimeoutCut::by(conn, waited).await.map_err(err(OP))?;
                    if conn.is_cut() {
                        tracing::trace!(target: "idempotent", scope = %identity.scope,
                            key = %identity.key_digest(), queued_ms = waited.as_millis() as u64,
                            "sqlite: busy timeout cut by the time queued for the write turn");
                    }
                    (turn, conn)
                }
            };
            tracing::trace!(target: "idempotent", scope = %identity.scope,
                key = %identity.key_digest(), "sqlite: writing the reservation");
            let request = ReserveRequest {
                identity: &identity,
                fingerprint: fingerprint.as_ref(),
                token: &token,
                lease,
                ttl,
            };
            let tried = tokio::time::Instant::now();
            under_way.statement_sent = true;
            let answer = reserve_in(&mut conn, request).await;
            under_way.statement_sent = false;
            if let Err(e) = conn.put_back().await {
                // The answer stands; the connection is closed, not reused.
                tracing::warn!(target: "idempotent", error = %e,
                    "sqlite: could not put a connection's busy timeout back; closing it");
            }
            match answer {
                // Rule 4: the write lock stayed held past the busy timeout,
                // by another connection's transaction (a transactional-mode
                // owner of this very key among them, whose record this call
                // cannot see yet), and nothing was written: answered as a
                // call in progress, as on PostgreSQL and in SQLite's
                // transactional mode, so the caller waits within its
                // `in_progress` policy and tries again, or is refused with
                // `InProgress`. The holder may be anyone, for any key, so
                // the time to try again is short, not a lease. Never less
                // than a short pause per try (the turn and the connection
                // given back first): a connection left without a busy
                // timeout answers at once, and must not make a waiting
                // duplicate spin.
                Err(e) if is_busy(&e) => {
                    drop((turn, conn));
                    tokio::time::sleep_until(tried + BUSY_TRY_AT_LEAST).await;
                    Ok(Reservation::InProgress {
                        lease_remaining: BUSY_RETRY_AFTER.min(lease),
                    })
                }
                answer => answer.map_err(err(OP)),
            }
        })
        .await;
        if let Ok(Reservation::Acquired { .. }) = answer {
            super::live_owners::reserved(
                (request.identity, self.database_id()),
                request.token,
                request.lease,
                sent,
            );
        }
        answer
    }

    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        self.complete_now(completion).await
    }

    async fn force_release(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        let id = identity.clone();
        // Read to the end, as the reservation's upsert is (see `reserve_in`):
        // its commit's failure is then seen.
        let deleted: Vec<i64> = self
            .write_in_turn(
                OPERATOR_RELEASE,
                Duration::MAX,
                move |mut conn| async move {
                    sqlx::query_scalar(FORCE_RELEASE_SQL)
                        .bind(&id.tenant)
                        .bind(&id.scope)
                        .bind(&id.key)
                        .bind(require_expired_lease)
                        .fetch_all(&mut *conn)
                        .await
                        .map_err(locked_out_or(OPERATOR_RELEASE))
                },
            )
            .await?;
        if let Some(&attempt) = deleted.first() {
            self.waiters.notify(identity);
            return Ok(ForcedRelease::Released {
                attempt: u32::try_from(attempt).unwrap_or(1),
            });
        }
        Ok(refused_release(self.fetch(identity).await?))
    }

    async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError> {
        self.release_now(identity, token).await
    }

    async fn heartbeat(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        let (id, token_owned) = (identity.clone(), token.clone());
        // Counted at work while this call polls the renewal (see
        // `live_owners::renewal`): on a current-thread runtime the write
        // runs in this very future, and an owner set aside mid-renewal (a
        // paused owner) made every transactional call of the process on its
        // record `StaleSnapshot` for as long as it stayed unpolled.
        // A renewal waits for the turn a renewal period at most (see
        // `WriteGate::take_within`); the end of a lease (zero) as any write.
        let most = if lease.is_zero() {
            Duration::MAX
        } else {
            (lease / 3).max(Duration::from_millis(1))
        };
        let patience = self.write_gate.patience;
        let in_turn = self.write_in_turn("heartbeat", most, move |mut conn| async move {
            // A renewal whose owner this process ended after it was asked
            // for (its call dropped or its body panicked, the lease ended
            // on purpose so the next call takes over at once) is not
            // written: it runs in a task of its own, which may take the
            // write turn after the write that ended the lease, and would
            // give the record a whole lease again, every retry refused
            // until it ran out. (The renewal lists its owner as it begins.)
            let _statement = if lease.is_zero() {
                None
            } else {
                match super::live_owners::renewal_statement(&token_owned) {
                    Some(statement) => Some(statement),
                    None => return Ok(Fenced::NotOwner),
                }
            };
            heartbeat_on(&mut *conn, &id, &token_owned, lease).await
        });
        let ending = lease.is_zero().then(|| token.clone());
        let write = async move {
            // The end of a lease (its owner ended already, see
            // `live_owners::renewal`) waits for the renewals that saw the
            // owner listed: one that went on without the write turn (see
            // `WriteGate::take_within`), waiting for another connection's
            // lock, landed after the end and gave the record a whole lease
            // again.
            if let Some(token) = ending
                && !super::live_owners::renewals_landed(&token, patience).await
            {
                tracing::warn!(target: "idempotent",
                    "sqlite: a renewal still unanswered past the busy timeout; ending the lease \
                     anyway (should it land later, it renews the lease once more)");
            }
            in_turn.await
        };
        let renewed =
            super::live_owners::renewal((identity, self.database_id()), token, lease, write)
                .await?;
        if renewed.is_written() {
            // The lease may have been shortened (ended early so the next call
            // takes over at once); waiters in this process sleep until the
            // end they last saw, so they look again (a read each).
            self.waiters.notify(identity);
        }
        Ok(renewed)
    }

    crate::store::detached::hand_over_to_the_worker!(told = super::live_owners::handed_over);

    /// Woken at once when this store (any clone of it, in this process)
    /// completes or releases the record, its detached worker finishes it, or
    /// an operator's [`force_release`](Store::force_release) through it
    /// frees it. Other processes, other `SqliteStore`s on the same file and
    /// completions committed in a caller's transaction (transactional mode:
    /// the store cannot see the caller's commit, so it is not told) are seen
    /// by a fallback look at the record (one primary-key read, no write lock)
    /// after [`fallback_poll`] pauses (20 ms doubling, at most
    /// [`FALLBACK_POLL_MAX`]). Returns when the record is no longer held by
    /// the owner first seen (completed, released, taken over), when its lease
    /// runs out, or after `max_wait`; the caller reserves only then.
    ///
    /// A waiter joins before it looks at the record, so a change made between
    /// the reservation that found it in progress and the wait is not missed:
    /// the look sees it, or the change's notification wakes the waiter.
    async fn wait_for_change(&self, identity: &Identity, max_wait: Duration, round: u32) {
        let look = || async {
            sqlx::query_as(LEASE_REMAINING_SQL)
                .bind(&identity.tenant)
                .bind(&identity.scope)
                .bind(&identity.key)
                .fetch_optional(&self.pool)
                .await
                .map_err(err("look at a record while waiting"))
        };
        let bounds = (max_wait, round);
        super::waiters::wait_looking(STORE, &self.waiters, identity, bounds, fallback_poll, look)
            .await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        // The write gate is taken for each chunk, so other writers get in
        // between.
        const OP: &str = "purge expired records";
        super::purge_in_chunks(STORE, batch, |chunk| {
            self.write_in_turn(OP, Duration::MAX, move |mut conn| async move {
                let done = sqlx::query(PURGE_SQL)
                    .bind(i64::from(chunk))
                    .execute(&mut *conn)
                    .await
                    .map_err(locked_out_or(OP))?;
                Ok(done.rows_affected())
            })
        })
        .await
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
        let rows = sqlx::query(SCOPE_STATS_SQL)
            .fetch_all(&self.pool)
            .await
            .map_err(err(COUNT_PER_SCOPE))?;
        rows.iter()
            .map(|row| {
                rows::Columns(row)
                    .scope_stats()
                    .map_err(err(COUNT_PER_SCOPE))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database file of a test's own, deleted (with its WAL and shared
    /// memory files) when the test ends.
    struct ScratchFile(std::path::PathBuf);

    impl ScratchFile {
        fn new() -> Self {
            let dir = std::env::temp_dir().join("idempotent-sqlite-unit");
            std::fs::create_dir_all(&dir).expect("create the temp dir");
            ScratchFile(dir.join(format!("{}.db", uuid::Uuid::new_v4().simple())))
        }

        fn url(&self) -> String {
            format!("sqlite://{}", self.0.display())
        }
    }

    impl Drop for ScratchFile {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let mut path = self.0.clone().into_os_string();
                path.push(suffix);
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// `PRAGMA synchronous` on several of the pool's connections at once.
    async fn levels(pool: &SqlitePool) -> Vec<i64> {
        let mut conns = Vec::new();
        for _ in 0..3 {
            conns.push(pool.acquire().await.expect("a connection"));
        }
        let mut levels = Vec::new();
        for conn in &mut conns {
            levels.push(
                sqlx::query_scalar("PRAGMA synchronous")
                    .fetch_one(&mut **conn)
                    .await
                    .expect("read the level"),
            );
        }
        levels
    }

    #[tokio::test]
    async fn connect_runs_full_and_the_builder_sets_normal() {
        let (full_file, normal_file) = (ScratchFile::new(), ScratchFile::new());
        let full = SqliteStore::connect(&full_file.url()).await.expect("open");
        assert_eq!(
            levels(full.pool()).await,
            [2, 2, 2],
            "FULL on every connection"
        );
        let normal = SqliteStore::builder(&normal_file.url())
            .synchronous(Synchronous::Normal)
            .connect()
            .await
            .expect("open");
        assert_eq!(
            levels(normal.pool()).await,
            [1, 1, 1],
            "NORMAL on every connection"
        );
        let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(normal.pool())
            .await
            .expect("journal mode");
        assert_eq!(journal, "wal", "NORMAL is only used in WAL mode");
        assert_eq!(Synchronous::from_pragma(1), Some(Synchronous::Normal));
        assert_eq!(Synchronous::from_pragma(3), Some(Synchronous::Full));
        assert_eq!(Synchronous::from_pragma(0), None);
    }

    #[tokio::test]
    async fn from_pool_keeps_the_pools_level() {
        let file = ScratchFile::new();
        let options = SqliteConnectOptions::from_str(&file.url())
            .expect("url")
            .create_if_missing(true)
            .synchronous(sqlx::sqlite::SqliteSynchronous::Normal);
        let pool = SqlitePoolOptions::new()
            .max_connections(3)
            .connect_with(options)
            .await
            .expect("pool");
        let store = SqliteStore::from_pool(pool).await.expect("store");
        assert_eq!(levels(store.pool()).await, [1, 1, 1]);
    }

    fn request<'a>(id: &'a Identity, token: &'a OwnerToken) -> ReserveRequest<'a> {
        ReserveRequest {
            identity: id,
            fingerprint: None,
            token,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        }
    }

    /// A URL whose database each connection would open anew (an empty path,
    /// a private-cache in-memory database) is refused when the store opens:
    /// it was accepted, and records, even the table, were lost between the
    /// store's connections. Shared in-memory databases are accepted.
    #[tokio::test]
    async fn a_database_of_one_connection_is_refused() {
        for url in [
            "sqlite://",
            "sqlite:",
            "sqlite://?mode=memory&cache=private",
            "sqlite://?mode=memory",
            "sqlite:?mode=memory",
            "sqlite://file::memory:",
            "sqlite://?mode=memory&cache=%70rivate",
            "sqlite://x?cache=private&mode=memory",
        ] {
            match SqliteStore::connect(url).await {
                Err(Error::Store(e)) => assert!(
                    e.to_string().contains("a database of its own"),
                    "{url}: {e}"
                ),
                other => panic!("{url}: expected a refusal, got {:?}", other.map(|_| ())),
            }
        }
        for url in ["sqlite::memory:", "sqlite://file::memory:?cache=shared"] {
            let store = SqliteStore::connect(url).await.expect(url);
            let id = Identity::new("t", "unit.url", "k").expect("identity");
            let token = OwnerToken::new();
            assert!(matches!(
                store.reserve(request(&id, &token)).await,
                Ok(Reservation::Acquired { .. })
            ));
        }
    }

    /// A waiter leaves no entry behind, whether it was woken or dropped.
    #[tokio::test]
    async fn waiters_leave_no_entry_behind() {
        let store = SqliteStore::connect("sqlite::memory:").await.expect("open");
        let id = Identity::new("t", "unit.wait", "k").expect("identity");
        let token = OwnerToken::new();
        assert!(matches!(
            store.reserve(request(&id, &token)).await,
            Ok(Reservation::Acquired { .. })
        ));
        // Dropped mid-wait.
        let dropped = tokio::time::timeout(
            Duration::from_millis(1),
            store.wait_for_change(&id, Duration::from_secs(10), 0),
        )
        .await;
        assert!(dropped.is_err(), "the record is still held");
        assert_eq!(store.waiters.len(), 0, "a dropped waiter left");
        // Woken by the completion.
        let waiter = store.wait_for_change(&id, Duration::from_secs(10), 0);
        let complete = async {
            while store.waiters.len() == 0 {
                tokio::task::yield_now().await;
            }
            let outcome = StoredOutcome {
                is_error: false,
                payload: b"1".to_vec(),
            };
            assert!(store
                .complete(Completion::by_body(
                    &id,
                    &token,
                    &outcome,
                    Duration::from_secs(60)
                ))
                .await
                .expect("complete")
                .is_written());
        };
        tokio::join!(waiter, complete);
        assert_eq!(store.waiters.len(), 0, "a woken waiter left");
    }
}
