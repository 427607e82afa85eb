//! [`MySqlStore`]: records in a MySQL or MariaDB table shared by every instance of a service.
//!
//! # Schema
//!
//! One InnoDB table, `idempotency_records`, with the primary key
//! (tenant, scope, `key`) and an index on `expires_at` for purging. Tenant,
//! scope and key are `VARBINARY(255)`: matched byte for byte, with no
//! collation, case folding or trailing-space padding. The result is a
//! `LONGBLOB`. Times are `BIGINT` milliseconds since the epoch on the
//! database's clock (`UNIX_TIMESTAMP()` and `NOW(6)`, both independent of the
//! session time zone). Migrations (`migrations/mysql`) are embedded and applied
//! on open under `GET_LOCK` (by the runner in `store/migrate.rs`), so many
//! processes may open at once; they are recorded in `idempotency_schema_migrations`.
//!
//! # Round trips
//!
//! * `reserve` through the store on MariaDB: one prepared statement,
//!   `INSERT … VALUES … ON DUPLICATE KEY UPDATE` (a no-op) `RETURNING` the
//!   row, that never waits for a row lock: a fresh key is inserted, and an
//!   existing record comes back as it is, so a live complete record is
//!   replayed, a live record with another fingerprint is a mismatch, a live
//!   lease is in progress, all answered by that one statement (a fresh key
//!   costs what a hand-written `INSERT IGNORE` costs, a replay what a
//!   primary-key `SELECT` costs). On MySQL (no `RETURNING`) a plain
//!   primary-key `SELECT` comes first, without a lock, and answers the same.
//!   Only an expired record, a lease that ran out, a row another session
//!   holds locked, or (MySQL) an absent key goes on to the write path, one
//!   `CALL idempotency_reserve_v4(…)`
//!   (migration 0005: the one reservation body; v2 and v3 are wrappers kept
//!   for older processes), a stored procedure that reads the record again and
//!   writes under a user-level lock (`GET_LOCK`) per identity, held only for
//!   the CALL, fenced (`INSERT`, or `UPDATE … WHERE` the state decided on
//!   still holds; when it no longer does, the record is read again and
//!   decided again). In transactional mode the procedure is the only
//!   statement: it makes the same plain read first.
//! * `complete`, `release`, `heartbeat`: one statement each, fenced by the owner token.
//! * a waiting duplicate (`in_progress = wait(..)`): woken at once when the
//!   record is completed, released or its lease renewed or ended through
//!   this store (any clone of it, its background worker included) in this
//!   process. Other processes' changes reach it by no notification (nothing
//!   like PostgreSQL's `LISTEN/NOTIFY`): it looks at the record with one
//!   primary-key read (no lock), 5 ms doubling to
//!   100 ms apart ([`polling_backoff`]), and reserves again only once the
//!   record changed, its lease ran out, or its wait ended.
//! * `purge_expired`: one `CALL idempotency_purge(batch)`: the batch's primary
//!   keys are selected `FOR UPDATE SKIP LOCKED` and deleted in one short
//!   transaction, so a row held by an open transaction is skipped, never
//!   waited for (DESIGN.md rule 16).
//!
//! # Lock waits
//!
//! InnoDB waits for row locks in whole seconds (`innodb_lock_wait_timeout`).
//! A reservation made through the store waits at most 1 s in all, for the
//! identity's `GET_LOCK` and then for a row held by another transaction (a
//! concurrent reservation's, which takes well under a millisecond, or a
//! transactional-mode owner's, which answers `InProgress` when the second
//! runs out). In transactional mode the wait is the whole seconds left of
//! `in_progress = wait(...)`, rounded down; the engine polls for the rest.
//! There the procedure waits for a row a second at a time and lets the
//! identity's `GET_LOCK` go between those seconds (migration 0009, unless
//! `innodb_rollback_on_timeout` is on), so a reserver waiting for that lock
//! gets its turn in the row wait, where InnoDB sees it: a deadlock that passes
//! through the `GET_LOCK` (three transactions, each holding a key the next
//! asks for) ends in error 1213 for one of them, not in every wait running out.
//! Under SERIALIZABLE, where InnoDB makes the procedure's plain reads locking
//! ones, a read waits for a row held by an open owner at most that bound too
//! (migration 0010), never the session's own `innodb_lock_wait_timeout`, and
//! the whole seconds it waited are taken from the waits after it.
//! Replays, mismatches and live leases never wait: on MySQL they take no
//! lock; on MariaDB the one statement holds the row only while it runs, and
//! when another session holds it the procedure answers from a plain read.
//!
//! # Transactional mode
//!
//! The procedure runs in the caller's transaction. A replay, mismatch or
//! in-progress answer holds no lock, so others still see a complete record
//! as complete (DESIGN.md rule 15). The caller's REPEATABLE READ snapshot may
//! be older than the record: then the plain read sees nothing, the insert
//! meets the committed record and holds a shared lock on it, which nobody
//! reading it plainly waits for. (A record *in progress* in that old snapshot
//! is answered from it, `InProgress`, until the snapshot's lease has run out
//! by the database clock; then the latest version is read under a lock.)
//! Only one reserver of an identity at a time
//! waits on its row lock, so a transactional owner's rollback hands the key
//! to one waiter instead of deadlocking several (error 1213 would roll back
//! a waiter's whole transaction).

use super::*;
use crate::error::Error;
use sqlx::mysql::{MySqlPool, MySqlRow};
use sqlx::{Executor, MySql, Row};

const STORE: &str = "mysql";
use super::detached::Work;
use super::server::ClosedIfDropped;
pub use super::server::ACQUIRE_TIMEOUT;
/// Whole seconds a reservation through the store waits for a row lock: the
/// smallest non-zero InnoDB wait. Concurrent reservations hold a new row's lock
/// for well under a millisecond, so a duplicate sees the committed record (and
/// its fingerprint) instead of a bare `InProgress`; a row held by a
/// transactional-mode owner answers `InProgress` after at most this.
const STORE_LOCK_WAIT_S: u64 = 1;
/// The longest lock wait InnoDB takes (`innodb_lock_wait_timeout` tops out at 2^30 s).
const MAX_LOCK_WAIT_S: u64 = 1 << 30;
const MIGRATION_LOCK: &str = "idempotent_runtime.migrate";
/// The database clock in milliseconds since the epoch, independent of the session time zone.
const NOW_MS: &str = "(UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000))";

/// Whether the session's clock was set (`SET timestamp = …`): `NOW()` and
/// `UNIX_TIMESTAMP()`, which the store's statements read, then give the set
/// time, while `SYSDATE()` goes on giving the server's. More than a second
/// apart counts as set (a server started with `--sysdate-is-now` makes the
/// two one, and then a set clock is not seen).
macro_rules! clock_set {
    () => {
        concat!("CAST(NOT ", clock_unset!(), " AS SIGNED)")
    };
}

/// The condition that the session's clock is the server's (see
/// [`clock_set!`]): the store-mode statements' guards end with it, so a
/// session whose clock was set (a time-freezing test sharing the pool, a
/// `SET timestamp` left on a pooled connection) never decides a lease or a
/// retention by it; such a statement goes on to [`clean_connection`], which
/// refuses the session ([`SESSION_CLOCK_REFUSED`]).
macro_rules! clock_unset {
    () => {
        "(ABS(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6))) <= 1000000)"
    };
}

/// A store in MySQL 8 or MariaDB: many instances of a service share one
/// database. Cloning gives another handle to the same pool.
///
/// ```no_run
/// use idempotent_runtime::{set_default_store, MySqlStore};
/// # #[tokio::main] async fn main() -> Result<(), idempotent_runtime::Error> {
/// let store = MySqlStore::connect("mysql://root@127.0.0.1:3306/app").await?;
/// set_default_store(store);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pools: std::sync::Arc<server::RuntimePools<MySql>>,
    detached: std::sync::Arc<detached::Detached>,
    /// The server is MariaDB, which bounds a statement's lock wait with
    /// `SET STATEMENT` and has `INSERT … RETURNING`: a reservation is then one
    /// plain statement ([`INSERT_OR_READ_SQL`]) for a fresh key and a replay alike.
    mariadb: bool,
    /// The largest answer a completion can carry: the server refuses a
    /// statement larger than its `max_allowed_packet` (and drops the
    /// connection), so such an answer could never be recorded.
    max_result_bytes: usize,
    /// The sessions' `innodb_lock_wait_timeout`, read when the store was
    /// opened: how long a caller's fenced write may wait for a row lock,
    /// so its bound ([`committed!`]) never cuts such a wait.
    lock_wait: Duration,
    /// The store's table and procedures, named in the database the store
    /// was opened on.
    names: std::sync::Arc<Names>,
    /// This process's waiting duplicates, woken by this store's (and its
    /// clones' and background worker's) completions, releases and renewals.
    waiters: std::sync::Arc<super::waiters::Waiters>,
    /// [`Store::database_id`], read when the store opened.
    database_id: Option<std::sync::Arc<str>>,
}

/// The table the store's records are in, unqualified: transactional mode
/// runs in the caller's database.
const TABLE: &str = "idempotency_records";

/// The store's statements on its table and procedures, naming the database
/// the store was opened on (`DATABASE()` then). Unqualified, a connection of
/// a pool the store shares that other code left on another database (`USE
/// other`, a database per tenant or per report) sent the store's
/// reservations and results to that database's table, when it had one (a
/// store of its own), where the store's other connections never look: a
/// retry ran the body again. Built once, when the store opens: a call
/// sends the same statements as before, with the database in front of the
/// names.
#[derive(Debug, Clone)]
struct Names {
    /// The records table (`` `db`.idempotency_records ``).
    table: String,
    /// [`READ_SQL`].
    read: String,
    /// [`INSERT_OR_READ_SQL`].
    insert_or_read: String,
    /// [`LEASE_REMAINING_SQL`].
    lease_remaining: String,
    /// [`RESERVE_SQL`].
    reserve: String,
    /// The purge procedure's call.
    purge: String,
    /// The check of a session the store's reads and writes are about to
    /// use ([`clean_connection`]).
    check: std::sync::Arc<SessionCheck>,
}

/// [`checked_session`]'s statements (MariaDB's, and MySQL 8's, which has no
/// `@@in_transaction`), each reading the records table (no row): a
/// statement that reads an InnoDB table is a transaction, so it takes the
/// isolation a `SET TRANSACTION ISOLATION LEVEL …` (no `SESSION`: the next
/// transaction's only) left pending on the session by other code, and the
/// store's statements after it run at the session's own. `@@tx_isolation`
/// does not show such a pending level: a pending READ UNCOMMITTED made the
/// store's next plain read (the reservation procedure's, a record read)
/// see a transactional-mode owner's uncommitted result, and replay it.
///
/// No row (`WHERE FALSE`: the table is opened and locked, the transaction
/// begun, and no row read): on a session with autocommit off under
/// SERIALIZABLE every read is a locking one, and a row of the table (the
/// first in the index scanned, which the check read) may be held by an
/// owner's open transaction (a transactional-mode call whose body runs, the
/// purge's batch): the check waited for it, and a call of an unrelated key
/// was refused with a lock wait timeout. The records table, not another of
/// the store's: a session left with `LOCK TABLES idempotency_records` may
/// read no table the lock does not name.
#[derive(Debug, Clone)]
struct SessionCheck {
    mariadb: String,
    mysql8: String,
    /// How long the store's statements on a checked session may go
    /// unanswered before its connection is given up as silent
    /// ([`MySqlStore::with_silent_connection_timeout`]).
    silent_after: Duration,
}

impl SessionCheck {
    /// Reading `table` (the records table, qualified or not).
    fn reading(table: &str) -> Self {
        SessionCheck {
            mariadb: SESSION_CHECK_SQL.replace(TABLE, table),
            mysql8: SESSION_CHECK_MYSQL8_SQL.replace(TABLE, table),
            silent_after: detached::ATTEMPT_ANSWERS_WITHIN,
        }
    }
}

/// [`SessionCheck`] on MariaDB: left inside a transaction, clock set, READ
/// UNCOMMITTED, inside a transaction with autocommit off; and the table opened.
const SESSION_CHECK_SQL: &str = concat!(
    "SELECT CAST(@@autocommit = 1 AND @@in_transaction = 1 AS SIGNED), ",
    clock_set!(),
    ", CAST(@@tx_isolation = 'READ-UNCOMMITTED' AS SIGNED), ",
    "CAST(@@autocommit = 0 AND @@in_transaction = 1 AS SIGNED), ",
    "(SELECT 1 FROM idempotency_records WHERE FALSE) LIMIT 1"
);

/// [`SessionCheck`] on MySQL 8: clock set, autocommit off; and the table opened.
const SESSION_CHECK_MYSQL8_SQL: &str = concat!(
    "SELECT ",
    clock_set!(),
    ", CAST(@@autocommit = 0 AS SIGNED), ",
    "(SELECT 1 FROM idempotency_records WHERE FALSE) LIMIT 1"
);

impl Names {
    /// In `database`, or unqualified when the session had none.
    fn in_database(database: Option<&str>) -> Self {
        let Some(database) = database else {
            return Names {
                table: TABLE.to_owned(),
                read: READ_SQL.to_owned(),
                insert_or_read: INSERT_OR_READ_SQL.to_owned(),
                lease_remaining: LEASE_REMAINING_SQL.to_owned(),
                reserve: RESERVE_SQL.to_owned(),
                purge: PURGE_SQL.to_owned(),
                check: std::sync::Arc::new(SessionCheck::reading(TABLE)),
            };
        };
        let database = format!("`{}`", database.replace('`', "``"));
        let table = format!("{database}.{TABLE}");
        let procedure = |name: &str| format!("{database}.{name}(");
        Names {
            read: READ_SQL.replace(TABLE, &table),
            insert_or_read: INSERT_OR_READ_SQL.replace(TABLE, &table),
            lease_remaining: LEASE_REMAINING_SQL.replace(TABLE, &table),
            reserve: RESERVE_SQL.replace(
                "idempotency_reserve_v4(",
                &procedure("idempotency_reserve_v4"),
            ),
            purge: PURGE_SQL.replace("idempotency_purge(", &procedure("idempotency_purge")),
            check: std::sync::Arc::new(SessionCheck::reading(&table)),
            table,
        }
    }
}

/// The purge procedure's call.
const PURGE_SQL: &str = "CALL idempotency_purge(?)";

/// What a waiting duplicate looks at (one primary-key read, no lock): the
/// owner of an in-progress record and what is left of its lease (ms; both
/// `NULL` when the record is not in progress), after whether the session can
/// be trusted with the read, as [`READ_SQL`]'s `autocommit` column says (in
/// autocommit, and on MariaDB outside any transaction and not reading
/// uncommitted rows; its clock not set). A session that cannot is read again
/// on a checked connection ([`connection_for_a_read`]): in a transaction
/// left open, the read would answer from that transaction's old snapshot,
/// and with a set clock the lease would never seem to end.
///
/// On a session in a transaction (autocommit off, or, on MariaDB, one left
/// open) the tenant is `NULL`, so the read reads no row: under SERIALIZABLE
/// InnoDB makes every plain read of a transaction a locking one, and the
/// read waited for a row an owner held (a transactional-mode owner's, up to
/// `innodb_lock_wait_timeout`, past the duplicate's wait bound), then left
/// its shared lock in the session's transaction, on a connection back in the
/// pool, where it kept the owner from completing the record. (`SYSDATE()`,
/// the clock's guard, stays out of the key: it is not a constant, and the
/// read would no longer be a primary-key read.) The tenant arrives with one
/// byte before it, cut off by `SUBSTRING`, as in [`owned_record!`]: under
/// MariaDB's `EMPTY_STRING_IS_NULL` the shared tenant (an empty string)
/// bound as it is became `NULL`, the look found no record in progress, and
/// the duplicate reserved again at once, found it in progress, and looked
/// again, without a pause, for as long as its wait lasted.
const LEASE_REMAINING_SQL: &str = concat!(
    "SELECT CAST(@@SESSION.autocommit = 1 /*M! AND @@SESSION.in_transaction = 0 ",
    "AND @@SESSION.tx_isolation <> 'READ-UNCOMMITTED' */ AND ",
    clock_unset!(),
    " AS SIGNED), CONVERT(r.owner_token USING utf8mb4), ",
    "CAST(r.lease_expires_at - (UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)) ",
    "AS SIGNED) FROM (SELECT 1 AS one) d LEFT JOIN idempotency_records r ",
    "ON r.tenant = IF(@@SESSION.autocommit = 1 /*M! AND @@SESSION.in_transaction = 0 */, ",
    "SUBSTRING(?, 2), NULL) AND r.scope = ? AND r.`key` = ? AND r.state = 'in_progress'"
);

/// A waiting duplicate's look at the record of `identity`
/// ([`LEASE_REMAINING_SQL`]): on any pooled connection, and again on a
/// checked one when that session cannot be trusted with the read.
async fn lease_remaining(
    pool: &MySqlPool,
    names: &Names,
    identity: &Identity,
) -> Result<super::waiters::Held, StoreError> {
    const OP: &str = "look at a record while waiting";
    type Looked = (i64, Option<String>, Option<i64>);
    async fn read(
        conn: &mut sqlx::MySqlConnection,
        names: &Names,
        identity: &Identity,
    ) -> Result<Looked, StoreError> {
        // The tenant after one byte (see `LEASE_REMAINING_SQL`).
        let mut tenant = Vec::with_capacity(identity.tenant.len() + 1);
        tenant.push(b'_');
        tenant.extend_from_slice(identity.tenant.as_bytes());
        server::answered_within(
            names.check.silent_after,
            // A plain read, and none on a session in a transaction: no lock
            // wait.
            Duration::ZERO,
            sqlx::query_as::<_, Looked>(&names.lease_remaining)
                .bind(tenant)
                .bind(identity.scope.as_bytes())
                .bind(identity.key.as_bytes())
                .fetch_one(conn),
        )
        .await
        .and_then(|looked| looked)
        .map_err(err(OP))
    }
    let mut conn = ClosedIfDropped::acquire(pool).await.map_err(err(OP))?;
    let looked = read(&mut conn, names, identity).await?;
    conn.hand_back();
    let (_, owner, remaining) = if looked.0 == 1 {
        looked
    } else {
        let mut conn = connection_for_a_read(pool, &names.check).await?;
        let looked = read(&mut conn.conn, names, identity).await?;
        conn.hand_back().await;
        looked
    };
    Ok(remaining.map(|remaining| (owner, Some(remaining))))
}

impl MySqlStore {
    /// Connects (waiting at most [`ACQUIRE_TIMEOUT`], 5 s, for the server) and
    /// applies the migrations. A server that is down gives an `Error::Store`
    /// naming the host and port, never a hang. `mariadb://` URLs are accepted.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), idempotent_runtime::Error> {
    /// let store = idempotent_runtime::MySqlStore::connect("mysql://root@127.0.0.1/app").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let url = match url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => url.to_owned(),
        };
        let pool = server::connect::<MySql>(STORE, "MySQL/MariaDB", &url, |options| {
            format!("{}:{}", options.get_host(), options.get_port())
        })
        .await?;
        Self::from_pool(pool).await
    }

    /// Uses an existing pool and applies the migrations. Give the pool an
    /// `acquire_timeout` so a stopped server fails fast.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), idempotent_runtime::Error> {
    /// let pool = sqlx::MySqlPool::connect("mysql://root@127.0.0.1/app").await.unwrap();
    /// let store = idempotent_runtime::MySqlStore::from_pool(pool).await?;
    /// # Ok(()) }
    /// ```
    pub async fn from_pool(pool: MySqlPool) -> Result<Self, Error> {
        let opened = migrate(&pool)
            .await
            .map_err(|e| StoreError::new(STORE, migrate::operation(), e))?;
        if reads_uncommitted(&opened.isolation) {
            return Err(StoreError::new(STORE, "open", READ_UNCOMMITTED_REFUSED).into());
        }
        // ER_TABLEACCESS_DENIED_ERROR, ER_COLUMNACCESS_DENIED_ERROR
        let database_id = super::database_id_read_at_open(STORE, opened.database_id, |e| {
            matches!(error_number(e), Some(1142 | 1143))
        })?;
        let names = std::sync::Arc::new(Names::in_database(opened.database.as_deref()));
        let waiters = std::sync::Arc::new(super::waiters::Waiters::default());
        Ok(MySqlStore {
            detached: std::sync::Arc::new(background_worker(&pool, &names, &waiters)),
            waiters,
            mariadb: opened.version.contains("MariaDB"),
            max_result_bytes: result_limit(opened.max_allowed_packet),
            lock_wait: Duration::from_secs(opened.lock_wait_s.min(MAX_LOCK_WAIT_S)),
            names,
            database_id,
            pools: std::sync::Arc::new(server::RuntimePools::new(pool)),
        })
    }

    /// Sets how long a statement may go unanswered by the server before the
    /// store gives its connection up as silent (default 20 s): a frozen or
    /// stalled server, or a network that drops its packets without closing
    /// the connection, would otherwise hold the call for as long as TCP keeps
    /// the connection. The statement is given up and its connection closed,
    /// and the call fails with [`Error::Store`] (a
    /// result being recorded is handed to the store's background worker,
    /// which tries again on new connections, each attempt bounded the same
    /// way). Waits the statement may rightly have on the server come on top:
    /// its row-lock wait (the sessions' `innodb_lock_wait_timeout` for a
    /// completion, a release or a renewal) and, for a large result, a second
    /// for every 256 KiB. A statement given up may still land; every write
    /// is fenced by its owner token.
    ///
    /// `Duration::ZERO` does not turn the bound off: a statement with no
    /// wait of its own on top (a reservation's first statement, a read) is
    /// given up unless answered within the timer's resolution (about a
    /// millisecond), and its call fails with [`Error::Store`]. For no bound,
    /// give `Duration::MAX`.
    ///
    /// Set it below your request deadline so a call fails in time to be
    /// retried; keep it above the slowest answer your server gives under
    /// load. The store's background worker, which records the answers of
    /// calls whose own statements failed, keeps at least the default: its
    /// attempts are bounded by the longest of 20 s and the timeouts any of
    /// the store's clones set (they share the worker, and a clone's short
    /// timeout must not cut the attempts of one set long for a slow server;
    /// an attempt waits up to 5 s for a connection of the worker's pool,
    /// then its writes up to 10 s for a row lock, a wait the server ends).
    ///
    /// ```no_run
    /// # async fn f(store: idempotent_runtime::MySqlStore) {
    /// let store = store.with_silent_connection_timeout(std::time::Duration::from_secs(5));
    /// # }
    /// ```
    pub fn with_silent_connection_timeout(mut self, timeout: Duration) -> Self {
        let mut names = (*self.names).clone();
        names.check = std::sync::Arc::new(SessionCheck {
            silent_after: timeout,
            ..(*names.check).clone()
        });
        self.names = std::sync::Arc::new(names);
        self.detached.set_attempt_limit(timeout);
        self
    }

    /// How long a statement may go unanswered before its connection is given
    /// up as silent ([`with_silent_connection_timeout`](Self::with_silent_connection_timeout)).
    pub fn silent_connection_timeout(&self) -> Duration {
        self.names.check.silent_after
    }

    /// The pool the store was opened with. Calls on the runtime it was opened
    /// on use it; calls on other runtimes use a pool of their runtime's own,
    /// made with the same options (a connection belongs to the runtime that
    /// opened it).
    pub fn pool(&self) -> &MySqlPool {
        self.pools.home()
    }
}

/// Runs a fenced write of the store (`$write`, on the executor `$on`, with
/// `$commit` its [`Commit`]) on the pool (`&MySqlPool`), committed whatever
/// the session's autocommit: first as one autocommit statement; when that
/// matched nothing (not the owner, or a session with autocommit off, where
/// the statement is a no-op that reads and locks nothing), again in a
/// transaction of its own, whose answer is final. Without that, on a session
/// with autocommit off a completion would stay in the session's open
/// transaction, unseen by others and rolled back when the connection closes,
/// and after the lease a retry would run the body again. The same for a
/// session left inside a transaction another user of the pool began and
/// never ended (MariaDB: the first statement matches nothing there too; the
/// second runs on a connection outside any, see [`clean_connection`]).
///
/// Each of the two is given up when the server leaves it unanswered for
/// `$waits` (its row-lock wait, and a completion's transfer allowance) past
/// the check's `silent_after` (the store's silent-connection timeout), its
/// connection closed ([`server::answered_within`]).
macro_rules! committed {
    ($pool:expr, $check:expr, $op:expr, $waits:expr, |$on:ident, $commit:ident| $write:expr) => {{
        let pool: &MySqlPool = $pool;
        let check: &std::sync::Arc<SessionCheck> = $check;
        let (silent_after, waits): (Duration, Duration) = (check.silent_after, $waits);
        let mut first = ClosedIfDropped::acquire(pool).await.map_err(err($op))?;
        let done = {
            let ($on, $commit) = (&mut *first, Commit::Autocommit);
            server::answered_within(silent_after, waits, $write)
                .await
                .map_err(err($op))?
        };
        first.hand_back();
        let done = done?;
        if done.is_written() {
            Ok(done)
        } else {
            let mut conn = clean_connection(pool, Some(check)).await?;
            // Every answer hands the connection back (a deadlock or a lock
            // wait that ran out rolls the transaction back; it answered).
            let done = server::answered_within(silent_after, waits, async {
                let mut tx = sqlx::Connection::begin(&mut *conn)
                    .await
                    .map_err(err($op))?;
                let done = {
                    let ($on, $commit) = (&mut *tx, Commit::WithTheTransaction);
                    $write.await?
                };
                tx.commit().await.map_err(err($op))?;
                Ok(done)
            })
            .await
            .map_err(err($op))?;
            conn.hand_back();
            done
        }
    }};
}

/// How a fenced write is committed.
#[derive(Debug, Clone, Copy)]
enum Commit {
    /// With the transaction it runs in, one of the store's own (the session
    /// checked before it began), or the caller's right after
    /// [`in_transaction`] checked its clock ([`complete_in_transaction`]).
    WithTheTransaction,
    /// With the caller's transaction (transactional mode). The caller's body
    /// ran on the session since its checks, and may have set its clock: a
    /// write that decides a lease or a retention by it matches nothing.
    WithTheCallersTransaction,
    /// As one autocommit statement; a no-op on a session with autocommit off.
    Autocommit,
}

impl Commit {
    /// The condition the write's `WHERE` ends with. MySQL folds the session
    /// variables into a constant: with autocommit off, or (MariaDB, which
    /// alone runs what a `/*M! */` comment holds) inside a transaction left
    /// open by another user of the pool, the statement is an "impossible
    /// WHERE" that reads and locks no row.
    fn condition(self) -> &'static str {
        match self {
            Commit::WithTheTransaction => "",
            Commit::WithTheCallersTransaction => concat!(" AND ", clock_unset!()),
            Commit::Autocommit => {
                concat!(
                    " AND @@SESSION.autocommit = 1 /*M! AND @@SESSION.in_transaction = 0 */ AND ",
                    clock_unset!()
                )
            }
        }
    }
}

/// A connection of `pool` outside any transaction, for the store's own
/// writes (see [`super::outside_any_transaction`]). `check`: ask whether
/// another user of the pool left it inside a transaction (MariaDB's
/// `@@in_transaction`; MySQL 8 has none) and whether its clock was set
/// (refused: [`SESSION_CLOCK_REFUSED`]) or it reads uncommitted data
/// (refused: [`READ_UNCOMMITTED_REFUSED`]); unchecked, the reservation
/// procedure guards the clock itself ([`RESERVE_SQL`]). A session with
/// autocommit off is left as it is: the store's statements handle it.
async fn clean_connection(
    pool: &MySqlPool,
    check: Option<&std::sync::Arc<SessionCheck>>,
) -> Result<ClosedIfDropped<MySql>, StoreError> {
    match check {
        Some(check) => checked_connection(pool, check, None).await,
        None => ClosedIfDropped::acquire(pool)
            .await
            .map_err(err(CLEAN_CONNECTION)),
    }
}

/// [`clean_connection`] (checked) for the store's reads of records
/// (`fetch`, the audit's counts). On a session with autocommit off, where
/// every statement opens a transaction that lasts until a `COMMIT`, the read
/// is made in autocommit: `SET SESSION autocommit = 1` first (which commits
/// the transaction the session is in; one more round trip, on such sessions
/// only), and autocommit off again when the connection is handed back
/// ([`ReadConnection::hand_back`]; a connection dropped before that is
/// closed). In the session's own transaction the read answered from the
/// snapshot the session's first read took under REPEATABLE READ (an earlier
/// read of the store's own included), so a record completed since was still
/// absent, or still in progress; and under SERIALIZABLE, where InnoDB makes
/// every plain read of a transaction a locking one, it waited for rows other
/// transactions held and left its shared locks in that transaction, on a
/// connection back in the pool: the record a read looked at could not be
/// completed by its owner, and after the audit's counts no fresh key of any
/// scope could be reserved and the purge deleted nothing, for as long as the
/// connection sat idle (rule 1). (The store's writes on such a session commit
/// what it holds already: `BEGIN`, or the procedure's `SET autocommit = 1`.)
async fn connection_for_a_read(
    pool: &MySqlPool,
    check: &std::sync::Arc<SessionCheck>,
) -> Result<ReadConnection, StoreError> {
    let autocommit_off = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let conn = checked_connection(pool, check, Some(&autocommit_off)).await?;
    Ok(ReadConnection {
        conn,
        autocommit_off: autocommit_off.load(std::sync::atomic::Ordering::SeqCst),
    })
}

/// A connection of [`connection_for_a_read`]: its session's autocommit is
/// put back off when it is handed back, if it was off.
struct ReadConnection {
    conn: ClosedIfDropped<MySql>,
    autocommit_off: bool,
}

impl ReadConnection {
    /// Back to the pool as the read found it; when autocommit cannot be put
    /// back off, closed instead.
    async fn hand_back(mut self) {
        if self.autocommit_off
            && self
                .conn
                .execute("SET SESSION autocommit = 0")
                .await
                .is_err()
        {
            return;
        }
        self.conn.hand_back();
    }
}

/// A connection of `pool` that passed [`checked_session`] (`for_a_read` as
/// it says). The check's connection is already closed if the call is
/// dropped while the check waits (a silent server).
async fn checked_connection(
    pool: &MySqlPool,
    check: &std::sync::Arc<SessionCheck>,
    for_a_read: Option<&std::sync::Arc<std::sync::atomic::AtomicBool>>,
) -> Result<ClosedIfDropped<MySql>, StoreError> {
    super::outside_any_transaction::<_, ClosedIfDropped<MySql>, _>(
        STORE,
        CLEAN_CONNECTION,
        pool,
        None,
        super::IfLeftOpen::Close,
        |conn| Box::pin(checked_session(conn, check.clone(), for_a_read.cloned())),
    )
    .await
}

const CLEAN_CONNECTION: &str = "take a connection outside any transaction";

/// [`clean_connection`]'s check of a session: whether it was left inside a
/// transaction another user of the pool began. `for_a_read` (from
/// [`connection_for_a_read`]): on a session with autocommit off, turn
/// autocommit on (committing the transaction it is in) and say so there.
async fn checked_session(
    conn: &mut sqlx::MySqlConnection,
    check: std::sync::Arc<SessionCheck>,
    for_a_read: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
) -> Result<bool, StoreError> {
    const OP: &str = CLEAN_CONNECTION;
    // Bounded like the statement it comes before; given up, the
    // error drops the connection, closed.
    type Asked = (i64, i64, i64, i64, Option<i64>);
    let asked: Result<Asked, sqlx::Error> = server::answered_within(
        check.silent_after,
        Duration::ZERO,
        sqlx::query_as(&check.mariadb).fetch_one(&mut *conn),
    )
    .await
    .map_err(err(OP))?;
    let (left_open, clock_set, in_autocommit_off_transaction) = match asked {
        // A session turned to READ UNCOMMITTED after the store
        // opened (by code sharing the pool): its reads would
        // replay results that may still roll back.
        Ok((_, _, 1, _, _)) => return Err(StoreError::new(STORE, OP, READ_UNCOMMITTED_REFUSED)),
        Ok((left_open, clock_set, _, off, _)) => (left_open, clock_set, off),
        // MySQL 8: no `@@in_transaction`.
        Err(sqlx::Error::Database(e)) if error_number(&*e) == Some(ER_UNKNOWN_SYSTEM_VARIABLE) => {
            let (clock_set, off, _): (i64, i64, Option<i64>) = sqlx::query_as(&check.mysql8)
                .fetch_one(&mut *conn)
                .await
                .map_err(err(OP))?;
            (0, clock_set, off)
        }
        Err(e) => return Err(err(OP)(e)),
    };
    if clock_set != 0 {
        return Err(StoreError::new(STORE, OP, SESSION_CLOCK_REFUSED));
    }
    if let Some(autocommit_off) = for_a_read {
        let off = in_autocommit_off_transaction != 0;
        if off {
            conn.execute("SET SESSION autocommit = 1")
                .await
                .map_err(err(OP))?;
        }
        autocommit_off.store(off, std::sync::atomic::Ordering::SeqCst);
    }
    Ok(left_open != 0)
}

/// What the worker's writes pass [`committed!`] as their waits: no bound of
/// their own, the worker bounds each attempt (`Detached::set_attempt_limit`).
const WORKER_WAITS: Duration = Duration::MAX;

/// The longest a write of the store's worker waits for a row lock, in
/// seconds, unless its sessions' own `innodb_lock_wait_timeout` is shorter.
const WORKER_LOCK_WAIT_S: u64 = 10;

/// Sets the lock wait of the worker's connection (the worker's own pool:
/// no caller's session changes) to [`WORKER_LOCK_WAIT_S`] or the session's
/// shorter one. A release behind a row another transaction holds (a
/// transactional-mode owner's) waited `innodb_lock_wait_timeout`, 50 s by
/// default, and each attempt cut at the worker's bound went on waiting on
/// the server; a few such releases held both of the worker's connections,
/// and a completion handed over meanwhile (a body that had run) waited past
/// its record's lease, open to a takeover that ran the body again (hunt).
async fn worker_lock_wait(conn: &mut sqlx::MySqlConnection) -> Result<(), StoreError> {
    sqlx::query(
        "SET SESSION innodb_lock_wait_timeout = LEAST(@@SESSION.innodb_lock_wait_timeout, ?)",
    )
    .bind(WORKER_LOCK_WAIT_S)
    .execute(conn)
    .await
    .map(drop)
    .map_err(err("set the worker's lock wait"))
}

/// The worker that finishes dropped calls' records with the store's fenced
/// writes (module `server`), on the store's table (`names`): the worker's
/// connections are fresh ones, on the pool's database, which need not be
/// the one the store was opened on (a connection another user of the pool
/// left on another database with `USE`): unqualified, a completion handed
/// over went to that database's table (or to none), and the record stayed
/// in progress. Each write sets the connection's lock wait to the worker's
/// ([`worker_lock_wait`]), and wakes this process's waiters on the record
/// when it is written.
fn background_worker(
    pool: &MySqlPool,
    names: &std::sync::Arc<Names>,
    waiters: &std::sync::Arc<super::waiters::Waiters>,
) -> detached::Detached {
    let (names, waiters) = (names.clone(), waiters.clone());
    server::background_worker(STORE, pool, move |pool, identity, token, work| {
        let (names, waiters) = (names.clone(), waiters.clone());
        Box::pin(async move {
            let table = names.table.as_str();
            let (id, token) = (&identity, &token);
            let done = committed!(
                &pool,
                &names.check,
                work.operation(),
                WORKER_WAITS,
                |on, commit| async {
                    worker_lock_wait(&mut *on).await?;
                    match &work {
                        Work::Release => release_as(commit, table, &mut *on, id, token).await,
                        Work::EndLease => {
                            heartbeat_as(commit, table, &mut *on, id, token, Duration::ZERO).await
                        }
                        Work::Complete(answer) => {
                            complete_as(commit, table, &mut *on, answer.completing(id, token)).await
                        }
                    }
                }
            );
            waiters.notify_written(&identity, &done);
            done
        })
    })
}

/// Applies the embedded migrations once, under `GET_LOCK`, recording them in
/// `idempotency_schema_migrations`. MySQL DDL is not transactional, so every
/// statement is written to be safe to run again.
///
/// Returns what the store needs to know of the server and the pool's
/// sessions (read on the same connection, so opening a store takes one
/// connection from the pool, once).
async fn migrate(pool: &MySqlPool) -> Result<Opened, migrate::MigrationError> {
    let mut backend = MigrationConnection(pool.acquire().await?);
    migrate::run(&mut backend, super::migrate::MYSQL).await?;
    let (version, max_allowed_packet, lock_wait_s): (String, u64, u64) = sqlx::query_as(
        "SELECT VERSION(), CAST(@@max_allowed_packet AS UNSIGNED), \
         CAST(@@SESSION.innodb_lock_wait_timeout AS UNSIGNED) LIMIT 1",
    )
    .fetch_one(&mut *backend.0)
    .await?;
    // As text, not prepared: MariaDB answers a prepared `DATABASE()` with
    // the database of when the statement was prepared on the connection
    // (sqlx keeps prepared statements), not the one it is on now.
    // Through the `Executor` trait, as in `MigrationConnection::execute`.
    let database: Option<String> =
        Executor::fetch_one(&mut *backend.0, sqlx::raw_sql("SELECT DATABASE() LIMIT 1"))
            .await?
            .try_get(0)?;
    let isolation = session_isolation(&mut backend.0).await?;
    let database_id = database_id(&mut backend.0).await;
    Ok(Opened {
        version,
        isolation,
        max_allowed_packet,
        lock_wait_s,
        database,
        database_id,
    })
}

/// What tells this database's records apart from any other's
/// ([`Store::database_id`]): the id migration 0016 made once for them, and
/// the database's name. The store reads it when it opens; transactional
/// mode reads it on the caller's connection, and so gets the same text
/// there. As text, not prepared, for `DATABASE()` (see [`migrate`]).
const DATABASE_ID_SQL: &str =
    "SELECT CONCAT(id, '/', DATABASE()) FROM idempotency_database LIMIT 1";

/// Reads [`DATABASE_ID_SQL`] on `conn` (`None` when its row is gone).
async fn database_id(conn: &mut sqlx::MySqlConnection) -> Result<Option<String>, sqlx::Error> {
    match Executor::fetch_optional(conn, sqlx::raw_sql(DATABASE_ID_SQL)).await? {
        Some(row) => row.try_get(0),
        None => Ok(None),
    }
}

/// [`database_id`] on the caller's connection (transactional mode).
async fn database_id_in_transaction(
    conn: &mut sqlx::MySqlConnection,
) -> Result<Option<String>, StoreError> {
    database_id(conn)
        .await
        .map_err(err(super::READ_DATABASE_ID))
}

/// Room in a completion's statement for everything but the answer (the
/// identity, the owner token, the other values and the packet's framing).
const COMPLETION_OVERHEAD: u64 = 64 * 1024;

/// The largest answer a completion can carry on a server whose
/// `max_allowed_packet` is `packet`, at most [`MAX_RESULT_BYTES`](crate::MAX_RESULT_BYTES).
fn result_limit(packet: u64) -> usize {
    let room = packet.saturating_sub(COMPLETION_OVERHEAD);
    usize::try_from(room)
        .unwrap_or(usize::MAX)
        .min(crate::engine::MAX_RESULT_BYTES)
}

/// The session's transaction isolation: `@@transaction_isolation` (MySQL 8,
/// MariaDB 11.1), or `@@tx_isolation` (MariaDB before 11.1).
async fn session_isolation(conn: &mut sqlx::MySqlConnection) -> Result<String, sqlx::Error> {
    match sqlx::query_scalar("SELECT @@SESSION.transaction_isolation LIMIT 1")
        .fetch_one(&mut *conn)
        .await
    {
        Err(sqlx::Error::Database(e)) if error_number(&*e) == Some(ER_UNKNOWN_SYSTEM_VARIABLE) => {
            sqlx::query_scalar("SELECT @@SESSION.tx_isolation LIMIT 1")
                .fetch_one(conn)
                .await
        }
        other => other,
    }
}

/// Whether sessions at `isolation` (`@@tx_isolation`) read what other
/// transactions have not committed. The session's level: one set with `SET
/// TRANSACTION` for the next transaction only does not show in it (the
/// server tells it only once the transaction has touched a table, and only
/// with the PROCESS privilege), so such a transaction is not seen. The store cannot work on them: it would
/// replay a result whose transaction may still roll back, and tell a client
/// the work was done when it never was.
fn reads_uncommitted(isolation: &str) -> bool {
    isolation.eq_ignore_ascii_case("READ-UNCOMMITTED")
}

/// What a store opened on a pool (or a call in a transaction) that reads
/// uncommitted data is told.
const READ_UNCOMMITTED_REFUSED: &str =
    "the session's transaction isolation is READ UNCOMMITTED: it would replay results of \
     transactions that may still roll back. Use READ COMMITTED or stronger for the store's \
     pool (and for transactions that call in transactional mode)";

/// What [`migrate`] read of the server and the pool's sessions.
struct Opened {
    /// `VERSION()`: MariaDB's says so.
    version: String,
    /// `@@max_allowed_packet`: the largest statement the server takes.
    max_allowed_packet: u64,
    /// The sessions' transaction isolation, as `@@tx_isolation` spells it.
    isolation: String,
    /// The sessions' `@@innodb_lock_wait_timeout`, in seconds.
    lock_wait_s: u64,
    /// `DATABASE()`: the database the migrations were applied in.
    database: Option<String>,
    /// [`Store::database_id`] ([`DATABASE_ID_SQL`]), as read: a session
    /// refused the read opens all the same (see `database_id_read_at_open`).
    database_id: Result<Option<String>, sqlx::Error>,
}

/// The migration runner's view of MySQL/MariaDB: one pooled connection.
struct MigrationConnection(sqlx::pool::PoolConnection<MySql>);

#[async_trait::async_trait]
impl migrate::MigrationBackend for MigrationConnection {
    async fn lock(&mut self) -> Result<(), migrate::MigrationError> {
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?) LIMIT 1")
            .bind(MIGRATION_LOCK)
            .bind(migrate::LOCK_TIMEOUT.as_secs() as i64)
            .fetch_one(&mut *self.0)
            .await?;
        match locked {
            Some(1) => Ok(()),
            _ => Err(migrate::MigrationError::LockTimeout),
        }
    }

    async fn create_history(&mut self) -> Result<(), sqlx::Error> {
        self.0
            .execute(
                "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
                     version BIGINT PRIMARY KEY,
                     description VARCHAR(255) NOT NULL,
                     checksum VARBINARY(64) NOT NULL,
                     applied_at TIMESTAMP(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3)
                 ) ENGINE = InnoDB",
            )
            .await
            .map(drop)
    }

    async fn applied(&mut self) -> Result<Vec<(i64, Vec<u8>)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT version, checksum FROM idempotency_schema_migrations \
             LIMIT 18446744073709551615",
        )
        .fetch_all(&mut *self.0)
        .await
    }

    /// A plain read before `GET_LOCK`: a database whose history is complete
    /// is opened without a lock and without DDL (a read-only user or server
    /// opens it). A history row is written after its migration's last
    /// statement, so it never names a migration that is not all there.
    /// `Ok(None)` when there is no history table yet (an error: the locked
    /// run reports what is wrong). The read is followed by a
    /// `ROLLBACK`: on a session with autocommit off it would otherwise keep
    /// its snapshot, and the history read again under the lock would miss
    /// what another process migrated meanwhile.
    async fn applied_without_lock(&mut self) -> Result<Option<Vec<(i64, Vec<u8>)>>, sqlx::Error> {
        let applied = self.applied().await;
        self.0.execute("ROLLBACK").await?;
        match applied {
            // ER_NO_SUCH_TABLE
            Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42S02") => {
                Ok(None)
            }
            applied => applied.map(Some),
        }
    }

    async fn execute(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        for statement in split_statements(sql) {
            // Through the `Executor` trait: `RawSql::execute`'s future is not
            // `Send` for every lifetime (and `connect` must be spawnable).
            Executor::execute(&mut *self.0, sqlx::raw_sql(statement)).await?;
        }
        Ok(())
    }

    async fn record(&mut self, migration: &migrate::Migration) -> Result<(), sqlx::Error> {
        const INSERT: &str = "INSERT INTO idempotency_schema_migrations \
            (version, description, checksum) VALUES (?, ?, ?)";
        migrate::record_on(&mut *self.0, INSERT, migration).await?;
        // Committed now also on a session with autocommit off (nothing to
        // commit otherwise), so another process does not wait on its lock.
        self.0.execute("COMMIT").await.map(drop)
    }

    /// Every statement committed on its own (DDL is not transactional).
    async fn unlock(&mut self, _done: bool) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(MIGRATION_LOCK)
            .execute(&mut *self.0)
            .await
            .map(drop)
    }
}

/// Splits a migration on lines reading `-- @@statement`.
fn split_statements(sql: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut offset = 0;
    for line in sql.split_inclusive('\n') {
        if line.trim() == "-- @@statement" {
            out.push(&sql[start..offset]);
            start = offset + line.len();
        }
        offset += line.len();
    }
    out.push(&sql[start..]);
    out.into_iter().filter(|s| !s.trim().is_empty()).collect()
}

fn err(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| match &e {
        sqlx::Error::Database(d) if error_number(&**d) == Some(ER_SP_DOES_NOT_EXIST) => {
            StoreError::new(STORE, operation, format!("{PROCEDURE_MISSING} ({d})"))
        }
        _ => StoreError::new(STORE, operation, e),
    }
}

/// What a call of a stored procedure that is not there says, and what to do.
/// A database no store has opened has none (transactional mode applies no
/// migrations). MySQL has no atomic replacement of a procedure (MariaDB's `CREATE OR
/// REPLACE` is not MySQL's), so a migration replacing one drops it and
/// creates it again; a migrating process cut off in between leaves it
/// missing, and only a build that has that migration applies it again.
/// `mysqldump` leaves procedures out unless told `--routines`.
const PROCEDURE_MISSING: &str =
    "a stored procedure of the idempotency schema is missing (nothing was written). If no store \
     has opened this database yet, it has none of the schema: transactional mode (`tx = ...`) \
     applies no migrations, so open a store on it once at startup \
     (`MySqlStore::from_pool(pool)` or `MySqlStore::connect(url)`), which applies them. \
     Otherwise, either a migration replacing it (it drops the procedure, then creates it again) was cut off in \
     between: open the store once with the build that ran it, which applies it again; or the \
     database was restored from a dump without its procedures (mysqldump leaves them out \
     unless given --routines): restore them, or, with the service stopped, delete the rows of \
     version 2 and later from idempotency_schema_migrations and open the store again, which \
     applies those migrations again (each can run again safely) and so creates the procedures \
     the store calls";

fn text(bytes: Option<Vec<u8>>) -> Result<Option<String>, sqlx::Error> {
    bytes
        .map(|b| String::from_utf8(b).map_err(|e| sqlx::Error::Decode(Box::new(e))))
        .transpose()
}

/// The store's first read of a reservation: answers replays, mismatches and
/// live leases (decoded by [`rows::Columns::answer`]) without a procedure call
/// or a lock. `autocommit` guards the answer: on a connection left with
/// autocommit off the read would run in an old snapshot, so the procedure
/// (which turns autocommit on for its statements) answers instead. On
/// MariaDB it also guards against a session that code sharing the pool
/// turned to READ UNCOMMITTED after the store opened: that read would replay
/// a result a transactional-mode caller recorded and may still roll back;
/// the procedure's connection is checked instead ([`clean_connection`]).
const READ_SQL: &str = concat!(
    "SELECT state, CONVERT(fingerprint USING utf8mb4) AS fingerprint, is_error, result, ",
    "CAST(lease_expires_at - (UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)) ",
    "AS SIGNED) AS lease_remaining, ",
    "CAST(COALESCE(expires_at <= (UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)) ",
    "AND (state = 'complete' OR lease_expires_at <= ",
    "(UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000))), 0) AS SIGNED) AS expired, ",
    "CAST(@@SESSION.autocommit = 1 /*M! AND @@SESSION.in_transaction = 0 ",
    "AND @@SESSION.tx_isolation <> 'READ-UNCOMMITTED' */ AND ",
    clock_unset!(),
    " AS SIGNED) AS autocommit ",
    "FROM idempotency_records WHERE tenant = ? AND scope = ? AND `key` = ? LIMIT 1"
);

/// MariaDB's reservation through the store, in one statement: the insert of
/// the in-progress record, or, when the key exists, the existing record
/// (`ON DUPLICATE KEY UPDATE` that changes nothing, `RETURNING` the row). A
/// fresh key then costs one statement, as a hand-written `INSERT IGNORE`
/// does, and a replay one, as a primary-key `SELECT` does; the returned
/// columns are [`READ_SQL`]'s, decoded by [`rows::Columns::answer`], plus
/// whether the record existed: the session variable `@idempotency_existed`,
/// set to 0 by a value of the row to insert (evaluated before the insert)
/// and to 1 by the duplicate-key branch (evaluated only when the key exists),
/// so a record with this request's token that existed already (a token used
/// twice) is judged like any other, as the procedure judges it. It never waits for a row lock
/// (`SET STATEMENT innodb_lock_wait_timeout = 0`): a key another session holds
/// (a transactional-mode owner, uncommitted, or a concurrent reservation's
/// statement) goes to the procedure, which waits for it one reserver at a
/// time under `GET_LOCK` (so a rollback hands the key to one waiter, no
/// deadlock between waiters). The row's values are plain `VALUES`: an
/// `INSERT … SELECT` from a derived table, which carried the guard below in
/// its `WHERE`, cost a fifth of a replay's speed. On a session with
/// autocommit off, or left inside a transaction by another user of the pool,
/// the row's `state` is `NULL`, which the `NOT NULL` column refuses (error
/// 1048, in any SQL mode for a one-row insert) before anything is written or
/// locked: the row would stay in the session's open transaction (rolled back
/// with it, or its commit cut off by a caller dropped in between). The
/// procedure answers then, in one `CALL` on a connection outside any
/// transaction, as it does for an expired record or a lease that ran out.
const INSERT_OR_READ_SQL: &str = concat!(
    "SET STATEMENT innodb_lock_wait_timeout = 0 FOR ",
    "INSERT INTO idempotency_records ",
    "(tenant, scope, `key`, state, fingerprint, owner_token, is_error, result, ",
    "lease_expires_at, expires_at, created_at, updated_at, attempt, attempt_started_at, recovered) ",
    "VALUES (?, ?, ?, IF(@@SESSION.autocommit = 1 AND @@SESSION.in_transaction = 0 AND ",
    clock_unset!(),
    ", 'in_progress', NULL), ?, ?, ",
    "IF((@idempotency_existed := 0) = 0, 0, 0), NULL, ",
    "UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) + ?, ",
    "UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) + ?, ",
    "UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000), ",
    "UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000), 1, ",
    "UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000), 0) ",
    "ON DUPLICATE KEY UPDATE tenant = ",
    "IF((@idempotency_existed := 1) = 1, idempotency_records.tenant, idempotency_records.tenant) ",
    "RETURNING state, CONVERT(fingerprint USING utf8mb4) AS fingerprint, is_error, result, ",
    "CAST(lease_expires_at - (UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)) ",
    "AS SIGNED) AS lease_remaining, ",
    "CAST(COALESCE(expires_at <= (UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)) ",
    "AND (state = 'complete' OR lease_expires_at <= ",
    "(UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000))), 0) AS SIGNED) AS expired, ",
    "CAST(@idempotency_existed AS SIGNED) AS existed"
);

/// MySQL's error numbers for a duplicate key, a lock wait that ran out and
/// a system variable the server does not have (`@@in_transaction` on MySQL 8).
const ER_DUP_ENTRY: u16 = 1062;
/// `Column … cannot be null`: the insert-or-read statement on a session
/// with autocommit off.
const ER_BAD_NULL_ERROR: u16 = 1048;
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
const ER_UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;
/// `PROCEDURE … does not exist`.
const ER_SP_DOES_NOT_EXIST: u16 = 1305;

/// A MySQL error's number (`DatabaseError::code` is its SQLSTATE).
fn error_number(e: &dyn sqlx::error::DatabaseError) -> Option<u16> {
    e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .map(|e| e.number())
}

/// Binds a reservation's first seven arguments, in the order the procedure
/// and [`INSERT_OR_READ_SQL`] take them: tenant, scope, key, fingerprint,
/// owner token, lease and ttl (ms).
fn bind_request<'q>(
    query: sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    request: ReserveRequest<'q>,
) -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments> {
    let id = request.identity;
    query
        .bind(id.tenant.as_bytes())
        .bind(id.scope.as_bytes())
        .bind(id.key.as_bytes())
        .bind(request.fingerprint.map(|f| f.as_str().as_bytes()))
        .bind(request.token.as_str().as_bytes())
        .bind(duration_to_millis(request.lease))
        .bind(duration_to_millis(request.ttl))
}

/// [`INSERT_OR_READ_SQL`]: `Acquired` when it inserted the record, the
/// existing record's answer when a plain read answers it, or what to do next.
async fn insert_or_read(
    pool: &MySqlPool,
    names: &Names,
    request: ReserveRequest<'_>,
) -> Result<InsertOrRead, StoreError> {
    // Read to the end (`fetch_all`, one row at most): stopped at the row,
    // an error the server sends after it would go unseen.
    let mut conn = ClosedIfDropped::acquire(pool)
        .await
        .map_err(err("reserve"))?;
    // No row-lock wait (`innodb_lock_wait_timeout = 0` for the statement).
    let found = server::answered_within(
        names.check.silent_after,
        Duration::ZERO,
        bind_request(sqlx::query(&names.insert_or_read), request).fetch_all(&mut *conn),
    )
    .await
    .map_err(err("reserve"))?
    .map(|rows| rows.into_iter().next());
    let row = match found {
        Ok(Some(row)) => row,
        Ok(None) => {
            conn.hand_back();
            return Ok(InsertOrRead::Decide);
        }
        // Autocommit is off (the `NULL` state): the procedure decides.
        Err(sqlx::Error::Database(e)) if error_number(&*e) == Some(ER_BAD_NULL_ERROR) => {
            conn.hand_back();
            return Ok(InsertOrRead::Decide);
        }
        Err(sqlx::Error::Database(e))
            if matches!(error_number(&*e), Some(ER_LOCK_WAIT_TIMEOUT | ER_DUP_ENTRY)) =>
        {
            // Another session holds the row (most often a concurrent
            // duplicate's statement, for well under a millisecond): a plain
            // read answers a replay, on this connection. The statement
            // that failed was a transaction (it read the table), so an
            // isolation other code left pending here for the next
            // transaction was taken by it, and the read runs at the
            // session's own, which its guard checks (`SessionCheck`).
            // One plain read, where the procedure path costs the session
            // check and a `CALL` that queues on the identity's `GET_LOCK`.
            let answer = plain_read(&mut conn, names, request).await?;
            conn.hand_back();
            return Ok(answer?.map_or(InsertOrRead::Decide, InsertOrRead::Answered));
        }
        Err(e) => {
            conn.hand_back();
            return Err(err("reserve")(e));
        }
    };
    conn.hand_back();
    // By position: sqlx takes a prepared statement's column names from its
    // prepare-time metadata, which MariaDB does not send for `RETURNING`.
    if row.try_get::<i64, _>(6).map_err(err("reserve"))? == 0 {
        return Ok(InsertOrRead::Answered(Reservation::acquired(1, None)));
    }
    let columns = rows::AnswerColumns {
        state: 0,
        fingerprint: 1,
        is_error: 2,
        result: 3,
        lease_remaining: 4,
        expired: 5,
    };
    Ok(rows::Columns(&row)
        .answer_from(request.fingerprint.map(Fingerprint::as_str), columns)
        .map_err(err("reserve"))?
        .map_or(InsertOrRead::Decide, InsertOrRead::Answered))
}

/// What [`insert_or_read`] found.
enum InsertOrRead {
    /// Inserted, or the existing record answers.
    Answered(Reservation),
    /// Expired, a lease that ran out, autocommit off, or a row another
    /// session holds that a plain read did not answer: the procedure decides.
    Decide,
}

/// [`READ_SQL`] on `conn`: the record's answer when a plain read answers it
/// (a replay, a mismatch, a live lease) on a session its guard accepts. The
/// outer `Err`: the server left it unanswered, and the connection must be
/// closed; the inner one is the statement's answer (hand it back).
async fn plain_read(
    conn: &mut sqlx::MySqlConnection,
    names: &Names,
    request: ReserveRequest<'_>,
) -> Result<Result<Option<Reservation>, StoreError>, StoreError> {
    let silent_after = names.check.silent_after;
    let answered = server::answered_within(
        silent_after,
        Duration::ZERO,
        read_answer(conn, names, request),
    )
    .await
    .map_err(err("reserve"))?;
    Ok(answered)
}

/// [`plain_read`]'s statement and its decoding.
async fn read_answer(
    conn: &mut sqlx::MySqlConnection,
    names: &Names,
    request: ReserveRequest<'_>,
) -> Result<Option<Reservation>, StoreError> {
    let id = request.identity;
    // A plain read: no lock wait.
    let row = sqlx::query(&names.read)
        .bind(id.tenant.as_bytes())
        .bind(id.scope.as_bytes())
        .bind(id.key.as_bytes())
        .fetch_optional(&mut *conn)
        .await
        .map_err(err("reserve"))?;
    let Some(row) = row else {
        return Ok(None);
    };
    if row
        .try_get::<i64, _>("autocommit")
        .map_err(err("reserve"))?
        != 1
    {
        return Ok(None);
    }
    rows::Columns(&row)
        .answer(request.fingerprint.map(Fingerprint::as_str))
        .map_err(err("reserve"))
}

/// A reservation through the store: on MariaDB the insert-or-read statement,
/// on MySQL the plain read; the procedure only for what is left (expired,
/// lease run out, a row another session holds, MySQL's absent keys).
async fn reserve_through_store(
    pool: &MySqlPool,
    names: &Names,
    request: ReserveRequest<'_>,
    mariadb: bool,
) -> Result<Reservation, StoreError> {
    if mariadb {
        match insert_or_read(pool, names, request).await? {
            InsertOrRead::Answered(answer) => return Ok(answer),
            InsertOrRead::Decide => {
                return reserve_through_the_procedure(pool, names, request, Some(&names.check))
                    .await;
            }
        }
    }
    let mut conn = ClosedIfDropped::acquire(pool)
        .await
        .map_err(err("reserve"))?;
    let answer = plain_read(&mut conn, names, request).await?;
    conn.hand_back();
    match answer? {
        Some(answer) => Ok(answer),
        None => reserve_through_the_procedure(pool, names, request, None).await,
    }
}

/// The reservation procedure (`idempotency_reserve_v4`): its answer as one
/// row (the `1` before the OUT arguments), which the session variables also get.
/// The key arrives as `NULL` on a session whose clock was set ([`clock_unset!`]),
/// which the procedure refuses before it reads or writes anything: it decides
/// by `NOW()`, and a fresh key on MySQL 8 comes here without another check.
///
/// On MariaDB the CALL runs with `max_error_count` at its default (64) and
/// no `max_statement_time` (for the statement only; MySQL skips the `/*M!
/// */` comment). On a session left with `max_error_count = 0` the server
/// records no condition for a `SELECT … INTO` that finds no row, so the
/// procedure's `NOT FOUND` handler never ran, a key it did not find looked
/// found with every column `NULL`, and after fifty attempts to take that
/// over the call was refused ("the record kept changing"): every
/// transactional call of a fresh key. A `max_statement_time` left on the
/// session cut the procedure's wait for a row (bounded by the call's own
/// `in_progress = wait`, or a second through the store) into a store error
/// where the answer is `InProgress`.
const RESERVE_SQL: &str = concat!(
    "/*M! SET STATEMENT max_error_count = 64, max_statement_time = 0 FOR */ ",
    "CALL idempotency_reserve_v4(?, ?, IF(",
    clock_unset!(),
    ", ?, NULL), ?, ?, ?, ?, ?, ?, 1, ",
    "@idempotency_outcome, @idempotency_took_over, @idempotency_is_error, @idempotency_result, ",
    "@idempotency_lease_remaining_ms, @idempotency_attempt_number, @idempotency_previous_started)"
);

/// The procedure's refusal of a `NULL` tenant, scope or key (migration 0008).
const NULL_IDENTITY_REFUSED: &str = "45000";

async fn reserve_with(
    conn: &mut sqlx::MySqlConnection,
    reserve_sql: &str,
    request: ReserveRequest<'_>,
    lock_wait_s: u64,
    own_transaction: bool,
) -> Result<Answer, StoreError> {
    let row: Result<MySqlRow, sqlx::Error> = bind_request(sqlx::query(reserve_sql), request)
        .bind(i64::try_from(lock_wait_s.min(MAX_LOCK_WAIT_S)).unwrap_or(0))
        .bind(i8::from(own_transaction))
        .fetch_one(&mut *conn)
        .await;
    let row = match row {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(NULL_IDENTITY_REFUSED) => {
            // The key is never NULL: a `NULL` one is the clock's guard.
            let clock_set: i64 = sqlx::query_scalar(concat!("SELECT ", clock_set!(), " LIMIT 1"))
                .fetch_one(&mut *conn)
                .await
                .map_err(err("reserve"))?;
            if clock_set != 0 {
                return Err(StoreError::new(STORE, "reserve", SESSION_CLOCK_REFUSED));
            }
            return Err(StoreError::new(STORE, "reserve", sqlx::Error::Database(e)));
        }
        other => other.map_err(err("reserve"))?,
    };
    decode_reservation(&row).map_err(err("reserve"))
}

/// The procedure's answer.
enum Answer {
    Reservation(Reservation),
    /// Transactional mode only (migration 0008): the caller's transaction
    /// may be what keeps the record's owner from renewing its lease (a lease
    /// that ran out after the transaction began, or a lock this call took on
    /// an in-progress record); it must end.
    StaleSnapshot,
    /// Transactional mode only (migration 0014): a mismatch with an
    /// in-progress record whose lease is live, which a read under
    /// SERIALIZABLE locked (see [`reserve_in_transaction`]).
    MismatchWithALiveOwner,
}

/// A reservation through the store, on a connection outside any transaction
/// ([`clean_connection`], which asks the session `check` when given: on
/// MariaDB): the procedure never answers `stale_snapshot` there.
async fn reserve_through_the_procedure(
    pool: &MySqlPool,
    names: &Names,
    request: ReserveRequest<'_>,
    check: Option<&std::sync::Arc<SessionCheck>>,
) -> Result<Reservation, StoreError> {
    let mut conn = clean_connection(pool, check).await?;
    // It waits `STORE_LOCK_WAIT_S` in all, for the identity's `GET_LOCK`
    // and then for the row.
    let answer = server::answered_within(
        names.check.silent_after,
        Duration::from_secs(STORE_LOCK_WAIT_S),
        reserve_with(&mut conn, &names.reserve, request, STORE_LOCK_WAIT_S, true),
    )
    .await
    .map_err(err("reserve"))?;
    conn.hand_back();
    match answer? {
        Answer::Reservation(reservation) => Ok(reservation),
        Answer::MismatchWithALiveOwner => Ok(Reservation::FingerprintMismatch),
        Answer::StaleSnapshot => Err(StoreError::new(
            STORE,
            "reserve",
            "idempotency_reserve answered stale_snapshot outside a transaction",
        )),
    }
}

/// Reads the procedure's answer by position: sqlx takes the column names of a
/// prepared `CALL` from its (empty) prepare-time metadata, so names do not resolve.
fn decode_reservation(row: &MySqlRow) -> Result<Answer, sqlx::Error> {
    let outcome = text(row.try_get_unchecked::<Option<Vec<u8>>, _>(0)?)?.unwrap_or_default();
    let flag = |index: usize| -> Result<bool, sqlx::Error> {
        Ok(row.try_get::<Option<i64>, _>(index)?.unwrap_or(0) != 0)
    };
    Ok(Answer::Reservation(match outcome.as_str() {
        "acquired" => Reservation::acquired(
            rows::attempt_number(row.try_get::<Option<i64>, _>(5)?.unwrap_or(1)),
            row.try_get::<Option<i64>, _>(6)?,
        ),
        "completed" => Reservation::Completed(rows::stored_outcome(
            flag(2)?,
            row.try_get_unchecked::<Option<Vec<u8>>, _>(3)?,
        )),
        "in_progress" => Reservation::InProgress {
            lease_remaining: millis_to_duration(row.try_get::<Option<i64>, _>(4)?.unwrap_or(0)),
        },
        "mismatch" if row.try_get::<Option<i64>, _>(4)?.is_some() => {
            return Ok(Answer::MismatchWithALiveOwner)
        }
        "mismatch" => Reservation::FingerprintMismatch,
        "stale_snapshot" => return Ok(Answer::StaleSnapshot),
        other => {
            return Err(sqlx::Error::Protocol(format!(
                "idempotency_reserve answered an unknown outcome `{other}`"
            )))
        }
    }))
}

/// The condition of a fenced write on the record a token owns, bound by
/// [`on_owned_record`]. The tenant arrives with one byte before it, cut off
/// by `SUBSTRING`: MariaDB's `sql_mode` `EMPTY_STRING_IS_NULL` turns an empty
/// string bound as a parameter into `NULL`, so the shared tenant (an empty
/// string) matched nothing on a session that code sharing the pool (a
/// transactional body, say) switched to that mode after the record was
/// reserved; the write answered `NotOwner`, and the owner was told another
/// caller had taken its record over while the record stayed in progress
/// under its token. A function's result is never turned into `NULL`, and a
/// function of parameters still finds the row by its primary key.
macro_rules! owned_record {
    () => {
        "tenant = SUBSTRING(?, 2) AND scope = ? AND `key` = ? \
         AND state = 'in_progress' AND owner_token = ?"
    };
}

/// Binds, after what `statement` bound so far, the record `token` owns: its
/// [`owned_record!`] condition.
fn on_owned_record<'q>(
    statement: sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    identity: &'q Identity,
    token: &'q OwnerToken,
) -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments> {
    let mut tenant = Vec::with_capacity(identity.tenant.len() + 1);
    tenant.push(b'_');
    tenant.extend_from_slice(identity.tenant.as_bytes());
    statement
        .bind(tenant)
        .bind(identity.scope.as_bytes())
        .bind(identity.key.as_bytes())
        .bind(token.as_str().as_bytes())
}

/// The text of a write (`change`: an `UPDATE … SET …` or a `DELETE FROM …`)
/// made to the record the token owns only: its `WHERE` is the
/// [`owned_record!`] condition ([`fenced`] binds it) and `commit`'s
/// [`condition`](Commit::condition).
fn owned_record_write(change: &str, commit: Commit) -> String {
    format!(
        "{change}\n          WHERE {}{}",
        owned_record!(),
        commit.condition()
    )
}

/// Runs a write fenced by the owner token (made with [`owned_record_write`]:
/// the record of `identity` that `token` owns is bound after what
/// `statement` bound so far): `Written` when it matched the record,
/// `NotOwner` when the token no longer owns it. The connection reports rows
/// *matched* (CLIENT_FOUND_ROWS), so an identical rewrite still counts as
/// owning the record.
async fn fenced<'e, 'q, E: Executor<'e, Database = MySql>>(
    operation: &'static str,
    statement: sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    identity: &'q Identity,
    token: &'q OwnerToken,
    executor: E,
) -> Result<Fenced, StoreError> {
    let done = on_owned_record(statement, identity, token)
        .execute(executor)
        .await
        .map_err(err(operation))?;
    Ok(Fenced::from_owned(done.rows_affected() == 1))
}

/// Records the outcome in the caller's transaction (transactional mode).
async fn complete_with<'e, E: Executor<'e, Database = MySql>>(
    executor: E,
    completion: Completion<'_>,
) -> Result<Fenced, StoreError> {
    let commit = Commit::WithTheCallersTransaction;
    complete_as(commit, TABLE, executor, completion).await
}

/// Records the outcome, fenced by the token; an outcome a `recover` hook
/// gave is marked recovered (rule 20).
async fn complete_as<'e, E: Executor<'e, Database = MySql>>(
    commit: Commit,
    table: &str,
    executor: E,
    completion: Completion<'_>,
) -> Result<Fenced, StoreError> {
    let change = format!(
        "UPDATE {table} SET state = 'complete', owner_token = NULL,
                is_error = ?, result = ?, lease_expires_at = NULL,
                expires_at = {NOW_MS} + ?, updated_at = {NOW_MS}, recovered = ?"
    );
    let sql = owned_record_write(&change, commit);
    let statement = sqlx::query(&sql)
        .bind(completion.outcome.is_error)
        .bind(&completion.outcome.payload)
        .bind(duration_to_millis(completion.ttl))
        .bind(completion.marks_recovered());
    let (identity, token) = (completion.identity, completion.token);
    fenced("complete", statement, identity, token, executor).await
}

/// Renews (or, with a shorter lease, ends early) the lease `token` owns.
async fn heartbeat_as<'e, E: Executor<'e, Database = MySql>>(
    commit: Commit,
    table: &str,
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
    lease: Duration,
) -> Result<Fenced, StoreError> {
    // The record's retention moves with its lease (`Store::heartbeat`). MySQL assigns left to right, each assignment
    // seeing the ones before it: `expires_at` first, from the old lease.
    let change = format!(
        "UPDATE {table}
            SET expires_at = GREATEST(expires_at,
                    COALESCE({NOW_MS} + ? + (expires_at - lease_expires_at), expires_at)),
                lease_expires_at = {NOW_MS} + ?, updated_at = {NOW_MS}"
    );
    let sql = owned_record_write(&change, commit);
    let statement = sqlx::query(&sql)
        .bind(duration_to_millis(lease))
        .bind(duration_to_millis(lease));
    fenced("heartbeat", statement, identity, token, executor).await
}

/// Renews (or, with a zero lease, ends) the lease in the caller's
/// transaction (transactional mode).
async fn heartbeat_with<'e, E: Executor<'e, Database = MySql>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
    lease: Duration,
) -> Result<Fenced, StoreError> {
    let commit = Commit::WithTheCallersTransaction;
    heartbeat_as(commit, TABLE, executor, identity, token, lease).await
}

/// Deletes the in-progress record in the caller's transaction (transactional mode).
async fn release_with<'e, E: Executor<'e, Database = MySql>>(
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
) -> Result<Fenced, StoreError> {
    release_as(Commit::WithTheTransaction, TABLE, executor, identity, token).await
}

/// Deletes the in-progress record `token` owns, freeing the key.
async fn release_as<'e, E: Executor<'e, Database = MySql>>(
    commit: Commit,
    table: &str,
    executor: E,
    identity: &Identity,
    token: &OwnerToken,
) -> Result<Fenced, StoreError> {
    let sql = owned_record_write(&format!("DELETE FROM {table}"), commit);
    fenced("release", sqlx::query(&sql), identity, token, executor).await
}

#[async_trait::async_trait]
impl Store for MySqlStore {
    fn name(&self) -> &'static str {
        STORE
    }

    fn database_id(&self) -> Option<&str> {
        self.database_id.as_deref()
    }

    fn max_result_bytes(&self) -> usize {
        self.max_result_bytes
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let reserve = async {
            reserve_through_store(&self.pools.current(), &self.names, request, self.mariadb).await
        };
        live_owners::reservation((&request, self.database_id()), reserve).await
    }

    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        let pool = self.pools.current();
        let waits = self
            .lock_wait
            .saturating_add(detached::allowance_for(completion.outcome.payload.len()));
        let table = self.names.table.as_str();
        let write = async {
            committed!(&pool, &self.names.check, "complete", waits, |on, commit| {
                complete_as(commit, table, on, completion)
            })
        };
        let done = live_owners::completed(completion.token, write).await;
        self.waiters.notify_written(completion.identity, &done);
        done
    }

    async fn force_release(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        // Read the attempt and delete in one short transaction, the row
        // locked. A row another transaction holds (a transactional-mode call
        // in progress, its insert uncommitted) is waited for at most
        // OPERATOR_LOCK_WAIT, not `innodb_lock_wait_timeout` (50 s by default).
        // The session's wait is shortened for that, on a connection closed
        // afterwards instead of returned to the pool with it, whatever
        // happens (this call dropped halfway included).
        let mut conn = clean_connection(&self.pools.current(), Some(&self.names.check)).await?;
        conn.close_on_drop();
        sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
            .bind(OPERATOR_LOCK_WAIT.as_secs().max(1))
            .execute(&mut *conn)
            .await
            .map_err(err(OPERATOR_RELEASE))?;
        let mut tx = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(err(OPERATOR_RELEASE))?;
        let sql = format!(
            "SELECT CAST(attempt AS SIGNED), CAST(COALESCE(state = 'in_progress'
                    AND (? = 0 OR lease_expires_at <= {NOW_MS}), 0) AS SIGNED)
               FROM {table} WHERE tenant = ? AND scope = ? AND `key` = ?
              LIMIT 1 FOR UPDATE",
            table = self.names.table
        );
        let row: Result<Option<(i64, i64)>, sqlx::Error> = sqlx::query_as(&sql)
            .bind(require_expired_lease)
            .bind(identity.tenant.as_bytes())
            .bind(identity.scope.as_bytes())
            .bind(identity.key.as_bytes())
            .fetch_optional(&mut *tx)
            .await;
        let row = match row {
            Err(sqlx::Error::Database(e)) if error_number(&*e) == Some(ER_LOCK_WAIT_TIMEOUT) => {
                tx.rollback().await.map_err(err(OPERATOR_RELEASE))?;
                return Err(held_by_a_transaction(STORE, OPERATOR_RELEASE));
            }
            other => other.map_err(err(OPERATOR_RELEASE))?,
        };
        if let Some((attempt, 1)) = row {
            sqlx::query(&format!(
                "DELETE FROM {} WHERE tenant = ? AND scope = ? AND `key` = ?",
                self.names.table
            ))
            .bind(identity.tenant.as_bytes())
            .bind(identity.scope.as_bytes())
            .bind(identity.key.as_bytes())
            .execute(&mut *tx)
            .await
            .map_err(err(OPERATOR_RELEASE))?;
            tx.commit().await.map_err(err(OPERATOR_RELEASE))?;
            self.waiters.notify(identity);
            return Ok(ForcedRelease::Released {
                attempt: rows::attempt_number(attempt),
            });
        }
        tx.rollback().await.map_err(err(OPERATOR_RELEASE))?;
        drop(conn);
        Ok(refused_release(self.fetch(identity).await?))
    }

    async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError> {
        live_owners::ended(token);
        let pool = self.pools.current();
        let done = committed!(
            &pool,
            &self.names.check,
            "release",
            self.lock_wait,
            |on, commit| release_as(commit, &self.names.table, on, identity, token)
        );
        self.waiters.notify_written(identity, &done);
        done
    }

    async fn heartbeat(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        let pool = self.pools.current();
        let write = async {
            committed!(
                &pool,
                &self.names.check,
                "heartbeat",
                self.lock_wait,
                |on, commit| heartbeat_as(commit, &self.names.table, on, identity, token, lease)
            )
        };
        let done = live_owners::renewal((identity, self.database_id()), token, lease, write).await;
        // The lease may have been shortened (ended early so the next call
        // takes over at once); waiters in this process sleep until the end
        // they last saw, so they look again (a read each).
        self.waiters.notify_written(identity, &done);
        done
    }

    crate::store::detached::hand_over_to_the_worker!(told = live_owners::handed_over);

    /// Woken at once when this store (any clone of it, in this process)
    /// completes, releases or renews the record, its background worker
    /// finishes it, or an operator's [`force_release`](Store::force_release)
    /// through it frees it. Other processes, other `MySqlStore`s and
    /// completions committed in a caller's transaction (transactional mode:
    /// the store cannot see the caller's commit) are seen by a look at the
    /// record (one primary-key read, no lock) after
    /// [`polling_backoff`] pauses (5 ms doubling to 100 ms). Returns when the
    /// record is no longer held by the owner first seen (completed, released,
    /// taken over), when its lease runs out, or after `max_wait`; the caller
    /// reserves only then.
    async fn wait_for_change(&self, identity: &Identity, max_wait: Duration, round: u32) {
        let pool = self.pools.current();
        let look = || lease_remaining(&pool, &self.names, identity);
        let bounds = (max_wait, round);
        super::waiters::wait_looking(
            STORE,
            &self.waiters,
            identity,
            bounds,
            polling_backoff,
            look,
        )
        .await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        super::purge_in_chunks(STORE, batch, |chunk| async move {
            // The procedure decides by the session's clock and begins a
            // transaction of its own (which would commit one left open).
            let mut conn = clean_connection(&self.pools.current(), Some(&self.names.check)).await?;
            let row: MySqlRow = sqlx::query(&self.names.purge)
                .bind(i64::from(chunk))
                .fetch_one(&mut *conn)
                .await
                .map_err(err("purge expired records"))?;
            conn.hand_back();
            // By position, like the reservation's answer.
            let deleted: Option<i64> = row.try_get(0).map_err(err("purge expired records"))?;
            Ok(deleted.unwrap_or(0).max(0) as u64)
        })
        .await
    }

    async fn fetch(&self, identity: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        let sql = format!(
            "SELECT state, CONVERT(fingerprint USING utf8mb4) AS fingerprint,
                    CONVERT(owner_token USING utf8mb4) AS owner_token, is_error, result,
                    lease_expires_at, expires_at, CAST({NOW_MS} AS SIGNED) AS now_ms, created_at,
                    CAST(attempt AS SIGNED) AS attempt,
                    COALESCE(attempt_started_at, created_at) AS attempt_started_at, recovered
               FROM {table} WHERE tenant = ? AND scope = ? AND `key` = ? LIMIT 1",
            table = self.names.table
        );
        let mut conn = connection_for_a_read(&self.pools.current(), &self.names.check).await?;
        // A plain read: no lock wait.
        let row = server::answered_within(
            self.names.check.silent_after,
            Duration::ZERO,
            sqlx::query(&sql)
                .bind(identity.tenant.as_bytes())
                .bind(identity.scope.as_bytes())
                .bind(identity.key.as_bytes())
                .fetch_optional(&mut *conn.conn),
        )
        .await
        .and_then(|row| row)
        .map_err(err("fetch"))?;
        conn.hand_back().await;
        rows::Columns::snapshot_if_found(row.as_ref()).map_err(err("fetch"))
    }

    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        // Every scope: a `LIMIT` of its own, so a `sql_select_limit` code
        // sharing the pool left on the session does not cut the answer.
        let sql = format!(
            "SELECT CONVERT(s.scope USING utf8mb4) AS scope,
                    CAST(SUM(NOT expired AND state = 'complete') AS SIGNED) AS complete,
                    CAST(SUM(NOT expired AND state = 'in_progress' AND lease_expires_at > now_ms)
                         AS SIGNED) AS in_progress,
                    CAST(SUM(NOT expired AND state = 'in_progress' AND lease_expires_at <= now_ms)
                         AS SIGNED) AS stuck,
                    CAST(SUM(expired) AS SIGNED) AS expired,
                    MIN(created_at) AS oldest,
                    CAST(SUM(NOT expired AND attempt > 1) AS SIGNED) AS taken_over,
                    CAST(SUM(NOT expired AND state = 'complete' AND recovered = 1) AS SIGNED)
                         AS recovered,
                    CAST(MAX(CASE WHEN NOT expired AND state = 'in_progress'
                                       AND lease_expires_at <= now_ms
                                  THEN now_ms - lease_expires_at END) AS SIGNED) AS longest_stuck,
                    CAST(MAX(CASE WHEN expired THEN now_ms - CASE WHEN state = 'complete'
                                  THEN expires_at ELSE GREATEST(expires_at, lease_expires_at) END
                             END) AS SIGNED) AS longest_unpurged
               FROM (SELECT r.scope, r.state, r.lease_expires_at, r.expires_at, r.created_at, n.now_ms,
                            r.attempt, r.recovered,
                            (r.expires_at <= n.now_ms
                             AND (r.state = 'complete' OR r.lease_expires_at <= n.now_ms)) AS expired
                       FROM {table} r
                       CROSS JOIN (SELECT CAST({NOW_MS} AS SIGNED) AS now_ms) n) s
              GROUP BY s.scope ORDER BY s.scope
              LIMIT 18446744073709551615",
            table = self.names.table
        );
        let mut conn = connection_for_a_read(&self.pools.current(), &self.names.check).await?;
        let found = sqlx::query(&sql)
            .fetch_all(&mut *conn.conn)
            .await
            .map_err(err(COUNT_PER_SCOPE))?;
        conn.hand_back().await;
        found
            .iter()
            .map(|row| rows::Columns(row).scope_stats())
            .collect::<Result<_, sqlx::Error>>()
            .map_err(err(COUNT_PER_SCOPE))
    }
}

// ---------------------------------------------------------------- transactional mode

/// `in_progress = wait(d)` as whole seconds of InnoDB lock wait (InnoDB
/// waits in whole seconds), rounded up: a bound under a second still waits
/// (one second), where rounding down would not wait at all; the wait passes
/// its bound by less than a second.
fn lock_wait_seconds(lock_wait: Duration) -> u64 {
    lock_wait.as_secs() + u64::from(lock_wait.subsec_nanos() > 0)
}

crate::transaction::transactional_connection! {
    /// Transactional mode on a MySQL/MariaDB connection: the reservation and the
    /// recorded result are statements in the connection's current transaction.
    ///
    /// ```no_run
    /// use idempotent_runtime::TransactionalConnection;
    /// fn assert_tx<C: TransactionalConnection + ?Sized>() {}
    /// assert_tx::<sqlx::MySqlConnection>();
    /// assert_tx::<sqlx::Transaction<'static, sqlx::MySql>>();
    /// ```
    impl for sqlx::MySqlConnection {
        store: STORE,
        in_transaction: in_transaction,
        reserve: reserve_in_transaction,
        complete: complete_in_transaction,
        release: release_with,
        heartbeat: heartbeat_with,
        database_id: database_id_in_transaction,
        max_result_bytes: max_result_bytes_on,
    }
}

/// The largest answer a completion on `conn` can carry: its session's
/// `max_allowed_packet` (the server refuses a larger statement and drops the
/// connection, the caller's transaction with it).
async fn max_result_bytes_on(conn: &mut sqlx::MySqlConnection) -> Result<usize, StoreError> {
    let packet: u64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS UNSIGNED) LIMIT 1")
        .fetch_one(conn)
        .await
        .map_err(err("read max_allowed_packet"))?;
    Ok(result_limit(packet))
}

/// Transactional mode's completion: [`complete_with`] in the caller's
/// transaction. The reservation's row is locked by that transaction until
/// it ends, so nobody else can have taken the record over while it is
/// open. When the completion matches nothing, either the body set the
/// session's clock (refused by [`in_transaction`]'s check, as a
/// reservation on a set clock is), or the caller's transaction ended while
/// the body ran: InnoDB rolls back a deadlock's victim whole (and a lock
/// wait timeout's with `innodb_rollback_on_timeout`), reservation and
/// body's writes alike, and with autocommit off the body's next statement
/// opens a new transaction at once, so the session still says it is in
/// one. That is not `LeaseLost`: it is a store error that says so; a retry
/// in a new transaction runs again.
///
/// The clock guard also fails a statement that waited more than a second
/// before the server evaluated it (a metadata lock, a backup's global read
/// lock, a saturated server): `NOW(6)` is when the statement began,
/// `SYSDATE(6)` when its `WHERE` ran. So once the check has found the clock
/// unset and the transaction open (nothing else runs on the session in
/// between), the same write runs again unguarded: it records the answer
/// where only the wait failed the guard, and matches nothing where the
/// transaction ended.
async fn complete_in_transaction(
    conn: &mut sqlx::MySqlConnection,
    completion: Completion<'_>,
) -> Result<Fenced, StoreError> {
    let written = complete_with(&mut *conn, completion).await?;
    if written == Fenced::NotOwner {
        if in_transaction(conn).await?
            && complete_as(Commit::WithTheTransaction, TABLE, &mut *conn, completion).await?
                == Fenced::Written
        {
            return Ok(Fenced::Written);
        }
        return Err(StoreError::new(
            STORE,
            "complete",
            TRANSACTION_ENDED_BY_THE_SERVER,
        ));
    }
    Ok(written)
}

/// What a transactional call whose transaction ended under it is told.
const TRANSACTION_ENDED_BY_THE_SERVER: &str = concat!(
    "the caller's transaction ended while the body ran, and the record is not this call's: ",
    "most likely rolled back by the server (a deadlock, or a lock wait timeout with ",
    "innodb_rollback_on_timeout), which undid the reservation and the body's writes; or ",
    "committed by a statement that commits implicitly (DDL, COMMIT), after which another ",
    "caller may have taken the record over. Nothing was recorded: roll back (with autocommit ",
    "off, what the body wrote after its transaction ended is in the session's current one) and ",
    "run the call again in a new transaction"
);

/// Whether the connection is in a transaction, as the server sees it:
/// `@@in_transaction` (MariaDB), or `autocommit = 0`, where every statement
/// opens a transaction that lasts until `COMMIT`. Asked every time, not taken
/// from sqlx's count of the transactions it began: a statement that commits
/// implicitly (DDL, `TRUNCATE`, `LOCK TABLES`, ...) or a deadlock ends the
/// server's transaction while sqlx still counts it, and a reservation made
/// then would commit at once, with no lease renewal, so a duplicate could
/// take it over while the body runs. MySQL 8.0 has no `@@in_transaction`:
/// there a transaction begun through sqlx (autocommit stays on under
/// `BEGIN`) can only be known from sqlx's count, so on MySQL 8 an implicit
/// commit inside such a transaction is not detected.
///
/// A transaction that reads uncommitted data is refused
/// ([`READ_UNCOMMITTED_REFUSED`]), and so is a session whose clock was set
/// (`SET timestamp = …`, [`SESSION_CLOCK_REFUSED`]): both read in the same
/// round trip.
async fn in_transaction(conn: &mut sqlx::MySqlConnection) -> Result<bool, StoreError> {
    const OP: &str = "check for an open transaction";
    let asked: Result<(i64, String, i64), sqlx::Error> = sqlx::query_as(concat!(
        "SELECT CAST(@@autocommit = 0 OR @@in_transaction = 1 AS SIGNED), @@tx_isolation, ",
        clock_set!(),
        " LIMIT 1"
    ))
    .fetch_one(&mut *conn)
    .await;
    let (open, isolation, clock_set) = match asked {
        // MySQL 8: no `@@in_transaction`; sqlx's count, or autocommit off.
        Err(sqlx::Error::Database(e)) if error_number(&*e) == Some(ER_UNKNOWN_SYSTEM_VARIABLE) => {
            let (autocommit_off, clock_set): (i64, i64) = sqlx::query_as(concat!(
                "SELECT CAST(@@autocommit = 0 AS SIGNED), ",
                clock_set!(),
                " LIMIT 1"
            ))
            .fetch_one(&mut *conn)
            .await
            .map_err(err(OP))?;
            let isolation = session_isolation(conn).await.map_err(err(OP))?;
            let open = autocommit_off != 0 || sqlx::Connection::is_in_transaction(conn);
            (i64::from(open), isolation, clock_set)
        }
        other => other.map_err(err(OP))?,
    };
    if reads_uncommitted(&isolation) {
        return Err(StoreError::new(STORE, OP, READ_UNCOMMITTED_REFUSED));
    }
    if clock_set != 0 {
        return Err(StoreError::new(STORE, OP, SESSION_CLOCK_REFUSED));
    }
    Ok(open != 0)
}

/// What a call on a session whose clock was set is told (transactional mode,
/// and the store's own statements on a pool it shares: [`clean_connection`]).
const SESSION_CLOCK_REFUSED: &str = concat!(
    "the session's clock is set (SET timestamp = ...): leases and retention are decided on the ",
    "server's clock, and a set clock would make a complete record look expired (or a lost ",
    "lease look live), so nothing was written. Run `SET timestamp = DEFAULT` on the connection ",
    "before the call (and before it goes back to a pool the store shares; a body that sets the ",
    "clock sets it back before it returns), or give the store a pool of its own"
);

/// The reservation in the connection's transaction, waiting for a row lock
/// for `lock_wait` in whole seconds ([`lock_wait_seconds`]). A transaction
/// that may be keeping the record's owner from renewing its lease (migration
/// 0008) is refused with [`Error::StaleSnapshot`].
async fn reserve_in_transaction(
    conn: &mut sqlx::MySqlConnection,
    request: ReserveRequest<'_>,
    lock_wait: Duration,
) -> Result<Reservation, Error> {
    let stale = || Error::StaleSnapshot {
        scope: request.identity.scope.clone(),
        store: STORE,
    };
    match reserve_with(
        &mut *conn,
        RESERVE_SQL,
        request,
        lock_wait_seconds(lock_wait),
        false,
    )
    .await?
    {
        // Under SERIALIZABLE InnoDB makes every read of a transaction a
        // locking one: the look that found the record in progress (also
        // with another fingerprint) holds a shared lock on it, which keeps
        // the owner from renewing its lease until the transaction ends (the
        // session's level; one set for the next transaction only is not
        // seen, as for READ UNCOMMITTED; migration 0014 still keeps such a
        // transaction from taking the record over).
        answer @ (Answer::Reservation(Reservation::InProgress { .. })
        | Answer::MismatchWithALiveOwner) => {
            let isolation = session_isolation(conn)
                .await
                .map_err(err("read the transaction isolation"))?;
            match answer {
                _ if isolation.eq_ignore_ascii_case("SERIALIZABLE") => Err(stale()),
                Answer::Reservation(reservation) => Ok(reservation),
                _ => Ok(Reservation::FingerprintMismatch),
            }
        }
        Answer::Reservation(reservation) => Ok(reservation),
        Answer::StaleSnapshot => Err(stale()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Completion, OwnerToken, StoredOutcome};

    /// A completion carries the answer and about 64 KiB more at most: the
    /// answers a server takes are its `max_allowed_packet` less that, and
    /// never more than `MAX_RESULT_BYTES`.
    #[test]
    fn the_answers_a_server_takes_follow_its_packet_size() {
        let max = crate::engine::MAX_RESULT_BYTES;
        assert_eq!(result_limit(4 << 20), (4 << 20) - 64 * 1024);
        assert_eq!(result_limit(16 << 20), max);
        assert_eq!(result_limit(1 << 30), max);
        assert_eq!(result_limit(1024), 0);
        assert_eq!(result_limit(u64::MAX), max);
    }

    /// The store on the test server (`IDEMPOTENT_MYSQL_URL`, by default the
    /// local one) and its URL; `None`, said loudly, when it is unreachable,
    /// unless `IDEMPOTENT_REQUIRE_SERVERS=1`.
    async fn server_store() -> Option<(MySqlStore, String)> {
        let url = std::env::var("IDEMPOTENT_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        match MySqlStore::connect(&url).await {
            Ok(store) => Some((store, url)),
            Err(e) if std::env::var("IDEMPOTENT_REQUIRE_SERVERS").is_ok_and(|v| v == "1") => {
                panic!("MySQL/MariaDB unreachable at {url}: {e}")
            }
            Err(e) => {
                eprintln!("SKIPPED: MySQL/MariaDB unreachable at {url}: {e}");
                None
            }
        }
    }

    /// A reservation of `identity` by `token`: a minute's lease, a day's ttl.
    fn request<'a>(identity: &'a Identity, token: &'a OwnerToken) -> ReserveRequest<'a> {
        ReserveRequest {
            identity,
            fingerprint: None,
            token,
            lease: Duration::from_secs(60),
            ttl: TTL,
        }
    }

    const TTL: Duration = Duration::from_secs(86_400);

    /// Completes `identity` for its owner `token`; the completion is written.
    async fn complete(store: &MySqlStore, identity: &Identity, token: &OwnerToken) {
        let outcome = StoredOutcome {
            is_error: false,
            payload: b"\"recorded\"".to_vec(),
        };
        let completion = Completion::by_body(identity, token, &outcome, TTL);
        assert!(store
            .complete(completion)
            .await
            .expect("complete")
            .is_written());
    }

    /// Reserves `identity`, a key nobody holds, for a fresh token, which
    /// acquires it (a minute's lease) and is answered.
    async fn acquired(store: &MySqlStore, identity: &Identity) -> OwnerToken {
        let token = OwnerToken::new();
        let reserved = store
            .reserve(request(identity, &token))
            .await
            .expect("reserve");
        assert!(
            matches!(reserved, Reservation::Acquired { .. }),
            "{reserved:?}"
        );
        token
    }

    /// Reserves and completes `identity`, a key nobody holds.
    async fn completed(store: &MySqlStore, identity: &Identity) {
        let token = acquired(store, identity).await;
        complete(store, identity, &token).await;
    }

    /// A record of a fresh tenant in `scope` (key `k`), reserved by the
    /// token answered: in progress for a minute.
    async fn held_record(store: &MySqlStore, scope: &str) -> (Identity, OwnerToken) {
        let tenant = format!("t-{}", OwnerToken::new().as_str());
        let identity = Identity::new(tenant, scope, "k").expect("id");
        let token = acquired(store, &identity).await;
        (identity, token)
    }

    /// A pool of at most `connections` connections to `url`, each of whose
    /// sessions runs `statements`, in order, when it connects.
    async fn session_pool(
        url: &str,
        connections: u32,
        statements: &'static [&'static str],
    ) -> MySqlPool {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(connections)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    for statement in statements {
                        conn.execute(*statement).await?;
                    }
                    Ok(())
                })
            })
            .connect(url)
            .await
            .expect("pool")
    }

    /// A pool of one connection whose session has autocommit off: each
    /// statement opens a transaction that stays open.
    async fn autocommit_off(url: &str) -> MySqlPool {
        session_pool(url, 1, &["SET SESSION autocommit = 0"]).await
    }

    /// A reservation of `identity` for a fresh token on a connection of
    /// `pool`, through the store's reservation as it runs for MySQL 8 (the
    /// plain read first), on the table of the pool's database.
    async fn reserve_as_mysql_8_on(
        pool: &MySqlPool,
        identity: &Identity,
    ) -> Result<Reservation, StoreError> {
        let token = OwnerToken::new();
        let names = Names::in_database(None);
        reserve_through_store(pool, &names, request(identity, &token), false).await
    }

    /// Rule 11 on MySQL 8's path (no `@@in_transaction`: a fresh key goes from
    /// the plain read to the procedure on a connection nobody asked): run on
    /// MariaDB by calling the store's reservation as it runs for MySQL 8. A
    /// session whose clock was set two days ahead acquired a record completed
    /// a moment ago (ttl a day) again, and decided a fresh key's lease by the
    /// set clock; both are refused now, and nothing is written.
    #[tokio::test]
    async fn mysql_8s_reservation_refuses_a_session_whose_clock_is_set() {
        let Some((store, url)) = server_store().await else {
            return;
        };
        let tenant = format!("t-{}", OwnerToken::new().as_str());
        let done = Identity::new(tenant.clone(), "mysql_unit.clock", "done").expect("id");
        completed(&store, &done).await;

        let skewed = session_pool(
            &url,
            1,
            &["SET timestamp = UNIX_TIMESTAMP(SYSDATE()) + 172800"],
        )
        .await;
        let fresh = Identity::new(tenant.clone(), "mysql_unit.clock", "fresh").expect("id");
        for identity in [&done, &fresh] {
            match reserve_as_mysql_8_on(&skewed, identity).await {
                Err(e) => assert!(e.to_string().contains("SET timestamp"), "{e}"),
                Ok(answer) => panic!("{identity:?} answered {answer:?} on a set clock"),
            }
        }
        skewed.close().await;
        assert!(store.fetch(&fresh).await.expect("fetch").is_none());
        let token = OwnerToken::new();
        let replay = store.reserve(request(&done, &token)).await;
        assert!(
            matches!(replay, Ok(Reservation::Completed(_))),
            "{replay:?}"
        );
    }

    /// The store's plain read on MySQL 8's path (no `INSERT … RETURNING`:
    /// the read comes first), run on MariaDB by calling the store's
    /// reservation as it runs for MySQL 8. Rule 1: another tenant's complete
    /// record with the same scope and key is not this tenant's answer. And a
    /// session with autocommit off never answers from the snapshot its
    /// earlier read opened: a record completed since is replayed, not told
    /// in progress (a legitimate retry refused until the connection ends).
    #[tokio::test]
    async fn mysql_8s_plain_read_keeps_tenants_apart_and_reads_no_old_snapshot() {
        let Some((store, url)) = server_store().await else {
            return;
        };
        let (first, second) = (
            format!("t-{}", OwnerToken::new().as_str()),
            format!("t-{}", OwnerToken::new().as_str()),
        );
        let theirs = Identity::new(first.clone(), "mysql_unit.read", "k").expect("id");
        completed(&store, &theirs).await;
        let ours = Identity::new(second, "mysql_unit.read", "k").expect("id");
        let token = OwnerToken::new();
        let answer =
            reserve_through_store(store.pool(), &store.names, request(&ours, &token), false).await;
        assert!(
            matches!(answer, Ok(Reservation::Acquired { attempt: 1, .. })),
            "another tenant's record answered: {answer:?}"
        );

        let off = autocommit_off(&url).await;
        let running = Identity::new(first, "mysql_unit.read", "running").expect("id");
        let owner = acquired(&store, &running).await;
        let answer = reserve_as_mysql_8_on(&off, &running).await;
        assert!(
            matches!(answer, Ok(Reservation::InProgress { .. })),
            "{answer:?}"
        );
        complete(&store, &running, &owner).await;
        let answer = reserve_as_mysql_8_on(&off, &running).await;
        assert!(
            matches!(answer, Ok(Reservation::Completed(_))),
            "a retry after the completion was answered {answer:?}"
        );
        off.close().await;
    }

    /// Rule 4: every change this store makes to a record, its background
    /// worker's included, wakes the duplicates of this process waiting on
    /// it (`wait_for_change` then looks at once, instead of at its next
    /// fallback look): a completion, a release, a renewal (which may shorten
    /// the lease) and an ended lease, an operator's release, and the
    /// completion, release and end of lease of a dropped call.
    #[tokio::test]
    async fn every_change_through_the_store_wakes_this_processs_waiters() {
        let Some((store, _)) = server_store().await else {
            return;
        };
        let outcome = StoredOutcome {
            is_error: false,
            payload: b"1".to_vec(),
        };
        let changes: [&str; 9] = [
            "complete",
            "release",
            "renew",
            "end the lease",
            "force release",
            "complete a dropped call",
            "release a dropped call",
            "end a dropped call's lease",
            "nothing",
        ];
        for change in changes {
            let (identity, token) = held_record(&store, "mysql_unit.wake").await;
            let notify = store.waiters.join(&identity);
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let completion = Completion::by_body(&identity, &token, &outcome, TTL);
            match change {
                "complete" => assert!(store.complete(completion).await.expect(change).is_written()),
                "release" => assert!(store
                    .release(&identity, &token)
                    .await
                    .expect(change)
                    .is_written()),
                "renew" => assert!(store
                    .heartbeat(&identity, &token, Duration::from_secs(30))
                    .await
                    .expect(change)
                    .is_written()),
                "end the lease" => assert!(store
                    .heartbeat(&identity, &token, Duration::ZERO)
                    .await
                    .expect(change)
                    .is_written()),
                "force release" => {
                    let released = store.force_release(&identity, false).await.expect(change);
                    assert!(
                        matches!(released, ForcedRelease::Released { .. }),
                        "{released:?}"
                    );
                }
                "complete a dropped call" => store.complete_detached(completion),
                "release a dropped call" => store.release_detached(identity.clone(), token.clone()),
                "end a dropped call's lease" => {
                    store.end_lease_detached(identity.clone(), token.clone())
                }
                _ => {}
            }
            assert_eq!(
                store.finish_background_work(Duration::from_secs(30)).await,
                0
            );
            let woken = tokio::time::timeout(Duration::ZERO, notified.as_mut())
                .await
                .is_ok();
            assert_eq!(woken, change != "nothing", "{change}: waiters woken");
            store.waiters.leave(&identity);
        }
    }

    /// A waiting duplicate's look ([`lease_remaining`]) on a session with
    /// autocommit off (a pool whose connections turn it off): its first read
    /// opens a transaction that stays open, and a look answered from that
    /// snapshot would see the record in progress until its lease ran out,
    /// long after it was completed. The look reads again on a checked
    /// connection, and sees the completion.
    #[tokio::test]
    async fn a_waiters_look_reads_no_old_snapshot() {
        let Some((store, url)) = server_store().await else {
            return;
        };
        let (identity, token) = held_record(&store, "mysql_unit.look").await;
        let off = autocommit_off(&url).await;
        let names = Names::in_database(None);
        let held = lease_remaining(&off, &names, &identity)
            .await
            .expect("look");
        let (owner, remaining) = held.expect("the record is in progress");
        assert_eq!(owner.as_deref(), Some(token.as_str()));
        assert!(remaining.is_some_and(|r| r > 0), "{remaining:?}");
        complete(&store, &identity, &token).await;
        let held = lease_remaining(&off, &names, &identity)
            .await
            .expect("look");
        assert_eq!(held, None, "the look saw the completed record in progress");
        off.close().await;
    }

    /// A waiting duplicate's look ([`lease_remaining`]) on a session with
    /// autocommit off under SERIALIZABLE, where InnoDB makes every plain read
    /// of a transaction a locking one. Its read on that session (before the
    /// guard sent it on to a checked connection) read the record's row: it
    /// waited for an owner holding the row (a transactional-mode owner whose
    /// body runs), up to `innodb_lock_wait_timeout`, past the duplicate's
    /// wait bound; and it left a shared lock on the row in the session's
    /// transaction, on a connection back in the pool, so the owner could not
    /// complete its record until that connection was used again. On a
    /// session the guard refuses, the read reads no row now.
    #[tokio::test]
    async fn a_waiters_look_takes_no_lock_on_the_record() {
        let Some((store, url)) = server_store().await else {
            return;
        };
        let (identity, token) = held_record(&store, "mysql_unit.look_locks").await;
        let serializable = session_pool(
            &url,
            2,
            &[
                "SET SESSION autocommit = 0",
                "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                "SET SESSION innodb_lock_wait_timeout = 1",
            ],
        )
        .await;
        let names = Names::in_database(None);
        fn row_of<'q>(
            identity: &'q Identity,
            sql: &'q str,
        ) -> sqlx::query::QueryScalar<'q, MySql, i64, sqlx::mysql::MySqlArguments> {
            sqlx::query_scalar(sql)
                .bind(identity.tenant.as_bytes())
                .bind(identity.scope.as_bytes())
                .bind(identity.key.as_bytes())
        }
        const ROW: &str = "SELECT 1 FROM idempotency_records \
            WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE";
        const FREE_ROW: &str = "SELECT 1 FROM idempotency_records \
            WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE SKIP LOCKED";
        // An owner holds the row: the look does not wait for it (it timed
        // out after the session's one-second lock wait).
        let mut holder = store.pools.current().begin().await.expect("begin");
        let held_row = row_of(&identity, ROW)
            .fetch_optional(&mut *holder)
            .await
            .expect("lock the row");
        assert_eq!(held_row, Some(1));
        let held = lease_remaining(&serializable, &names, &identity)
            .await
            .expect("the look waited for the row an owner holds");
        let (owner, _) = held.expect("the record is in progress");
        assert_eq!(owner.as_deref(), Some(token.as_str()));
        holder.rollback().await.expect("rollback");
        // Two idle connections: the look's read takes one and its checked
        // read the other, so a lock left by the first stays on the row.
        let (a, b) = (
            serializable.acquire().await.expect("a"),
            serializable.acquire().await.expect("b"),
        );
        drop((a, b));
        // Handed back in tasks of their own (after a ping each).
        tokio::time::timeout(Duration::from_secs(30), async {
            while serializable.num_idle() < 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("both connections back in the pool");
        let held = lease_remaining(&serializable, &names, &identity)
            .await
            .expect("look");
        let (owner, _) = held.expect("the record is in progress");
        assert_eq!(owner.as_deref(), Some(token.as_str()));
        let free = row_of(&identity, FREE_ROW)
            .fetch_optional(&*store.pools.current())
            .await
            .expect("read the row");
        assert_eq!(free, Some(1), "the look left a lock on the record's row");
        serializable.close().await;
        complete(&store, &identity, &token).await;
    }

    /// A waiting duplicate's look ([`lease_remaining`]) of a record of the
    /// shared tenant (an empty string) on a session that code sharing the pool
    /// turned to MariaDB's `sql_mode` `EMPTY_STRING_IS_NULL`: the tenant bound
    /// as a parameter became `NULL`, the read found no record, and the look
    /// answered that the record was no longer in progress. The duplicate
    /// reserved again at once, found it in progress (on another session), and
    /// looked again on that one: no pause between the two, for as long as its
    /// wait lasted. The look finds the record now, as the fenced writes do.
    #[tokio::test]
    async fn a_waiters_look_finds_the_shared_tenants_record_under_empty_string_is_null() {
        let Some((store, url)) = server_store().await else {
            return;
        };
        if !store.mariadb {
            return; // a MariaDB mode
        }
        let identity = Identity::shared(
            "mysql_unit.look_empty_is_null",
            format!("k-{}", OwnerToken::new().as_str()),
        )
        .expect("id");
        let token = acquired(&store, &identity).await;
        let odd = session_pool(
            &url,
            1,
            &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',EMPTY_STRING_IS_NULL')"],
        )
        .await;
        let held = lease_remaining(&odd, &Names::in_database(None), &identity)
            .await
            .expect("look");
        odd.close().await;
        let (owner, _) = held.expect("the look found the record in progress");
        assert_eq!(owner.as_deref(), Some(token.as_str()));
        assert!(store
            .release(&identity, &token)
            .await
            .expect("release")
            .is_written());
    }

    #[test]
    fn splits_on_marker_lines_only() {
        let sql = "-- says `-- @@statement` inline\nA;\n-- @@statement\nB\n-- @@statement\n";
        assert_eq!(
            super::split_statements(sql),
            vec!["-- says `-- @@statement` inline\nA;\n", "B\n"]
        );
    }
}
