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
//! The table lives in the schema the opening connection's `search_path`
//! names (set it in the connect options to choose one). The store's
//! statements name that schema, and its functions keep to their own
//! (migration 0009), so a connection of a shared pool handed back with
//! another `search_path`, or with a TEMP table named `idempotency_records`,
//! writes the records where every other connection finds them.
//!
//! # Round trips
//!
//! * `reserve` (store mode): one plain SQL statement, prepared once per
//!   connection: a primary-key read of the record answers a replay, a refusal
//!   (in progress) or a mismatch, and for an absent record the same statement
//!   calls `idempotency_acquire_absent` (migration 0008), an `INSERT … ON
//!   CONFLICT DO NOTHING`. A replay costs a primary key lookup, writes
//!   nothing and takes no lock. Only what needs a decision under the row
//!   lock (replacing an expired record, taking over an expired lease, a race
//!   with a concurrent insert) takes a second statement, the plpgsql function
//!   `idempotency_reserve_autocommit`.
//! * `reserve_in_transaction`: one statement, a plain read that answers
//!   replays, refusals and mismatches without a lock (rule 15), gated so that
//!   only otherwise does it call `idempotency_reserve`, the same decisions in
//!   a subtransaction that catches a lock timeout so the caller's transaction
//!   stays usable. Both functions are wrappers over one body
//!   (`idempotency_reserve_core`, migration 0004).
//! * `complete`, `release`, `heartbeat`: one `UPDATE`/`DELETE` each, fenced by
//!   the owner token.
//!
//! # Waiting duplicates
//!
//! A duplicate that finds the record in progress and may wait
//! ([`Store::wait_for_change`]) is woken by `LISTEN/NOTIFY`: the store keeps
//! one listening connection (on a background thread with its own runtime,
//! started by the first waiter); the waiter registers, marks the record
//! (`waiting = TRUE`), and a trigger on the table notifies when a marked
//! record completes, is released or deleted, or changes owner — at the
//! writer's commit, whichever process or mode wrote it. Unmarked records never
//! notify, so the path without waiters pays nothing (NOTIFY takes a
//! database-wide lock at commit). A waiter polls instead (5 ms doubling to
//! 100 ms) when the listener is not listening (it could not connect, or its
//! connection was lost; only its first connection is waited for, at most a
//! second), when the record is not visible yet (a transactional-mode owner's
//! uncommitted reservation) or locked by another transaction; a marked
//! waiter with no news reserves again at the lease's end or after
//! [`WAIT_SLICE`], whichever is first. A connection can die without a word
//! (half-open: nothing closed, no error, nothing delivered), so the listener
//! checks one that has been quiet for a second while somebody waits (30 s
//! otherwise) with a `SELECT 1`; no answer within 2 s, and it counts as lost:
//! every waiter is woken to look again and polls until the listener has
//! reconnected. An outage is logged once, as a warning.
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
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{Executor, Postgres, Row};
use std::collections::HashMap;

const STORE: &str = "postgres";
use super::detached::Work;
use super::server::ClosedIfDropped;
pub use super::server::ACQUIRE_TIMEOUT;
const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);
/// `pg_advisory_xact_lock` key held while migrations run ("idempotnt").
const MIGRATION_LOCK: i64 = 0x6964_656d_706f_746e;

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
    pools: std::sync::Arc<server::RuntimePools<Postgres>>,
    lock_wait: Duration,
    /// How long a statement may go unanswered before its connection is
    /// given up as silent ([`PgStore::with_silent_connection_timeout`]).
    silent_after: Duration,
    detached: std::sync::Arc<detached::Detached>,
    watcher: std::sync::Arc<Watcher>,
    /// The statements made through the shared pool, naming the schema the
    /// store found its table in when it opened.
    statements: std::sync::Arc<Statements>,
    /// [`Store::database_id`], read when the store opened.
    database_id: Option<std::sync::Arc<str>>,
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
        let pool = server::connect::<Postgres>(STORE, "PostgreSQL", url, |options| {
            format!("{}:{}", options.get_host(), options.get_port())
        })
        .await?;
        Self::from_pool(pool).await
    }

    /// Uses an existing pool (the application's own) and applies the migrations.
    /// Give the pool an `acquire_timeout` so a stopped server fails fast.
    ///
    /// The store opens connections of its own with the pool's connect options
    /// and pool options, hooks included: for the records of dropped calls (on
    /// a background thread), and for calls made on a runtime other than the
    /// one `from_pool` ran on (a connection belongs to the runtime that
    /// opened it). Session settings the records table depends on
    /// (`search_path`, a role) may be in the connect options
    /// (`PgConnectOptions::options([("search_path", "app")])`) or in an
    /// `after_connect` hook. Call `from_pool` on the runtime the pool was
    /// made on.
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
            .map_err(|e| StoreError::new(STORE, migrate::operation(), e))?;
        let schema = records_schema(&pool).await?;
        remake_functions_named_for_another_schema(&pool, &schema)
            .await
            .map_err(|e| {
                StoreError::new(STORE, "re-make the functions after a schema rename", e)
            })?;
        let database_id = super::database_id_read_at_open(
            STORE,
            database_id_in_schema(&pool, &schema).await,
            // insufficient_privilege
            |e| e.code().as_deref() == Some("42501"),
        )?;
        let statements = std::sync::Arc::new(Statements::in_schema(&schema));
        let detached = background_worker(&pool, &statements);
        detached.statements_land_within(reservation_lands_within(DEFAULT_LOCK_WAIT));
        Ok(PgStore {
            statements,
            database_id,
            detached: std::sync::Arc::new(detached),
            watcher: std::sync::Arc::new(Watcher::new((*pool.connect_options()).clone())),
            pools: std::sync::Arc::new(server::RuntimePools::new(pool)),
            lock_wait: DEFAULT_LOCK_WAIT,
            silent_after: detached::ATTEMPT_ANSWERS_WITHIN,
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
        self.detached
            .statements_land_within(reservation_lands_within(lock_wait));
        self
    }

    /// How long a reservation waits for a row locked by another transaction.
    pub fn lock_wait(&self) -> Duration {
        self.lock_wait
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
    /// a reservation's row-lock waits ([`lock_wait`](Self::lock_wait)), a
    /// renewal's (up to 10 minutes) and, for a large result, a second for
    /// every 256 KiB. A completion or a release has no lock wait of its own
    /// (the session's `lock_timeout`, none by default): one that waits for a
    /// row lock (a transactional-mode call that took the record over) longer
    /// than the timeout is given up the same way. A statement given up may
    /// still land; every write is fenced by its owner token.
    ///
    /// `Duration::ZERO` does not turn the bound off: a statement with no
    /// wait of its own on top (a completion, a release) is given up unless
    /// answered within the timer's resolution (about a millisecond), so
    /// calls fail with [`Error::Store`] while the worker records their
    /// answers. For no bound, give `Duration::MAX`.
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
    /// # async fn f(store: idempotent_runtime::PgStore) {
    /// let store = store.with_silent_connection_timeout(std::time::Duration::from_secs(5));
    /// # }
    /// ```
    pub fn with_silent_connection_timeout(mut self, timeout: Duration) -> Self {
        self.silent_after = timeout;
        self.detached.set_attempt_limit(timeout);
        self
    }

    /// How long a statement may go unanswered before its connection is given
    /// up as silent ([`with_silent_connection_timeout`](Self::with_silent_connection_timeout)).
    pub fn silent_connection_timeout(&self) -> Duration {
        self.silent_after
    }

    /// The pool the store was opened with. Calls on the runtime it was opened
    /// on use it; calls on other runtimes use a pool of their runtime's own,
    /// made with the same options (a connection belongs to the runtime that
    /// opened it).
    pub fn pool(&self) -> &PgPool {
        self.pools.home()
    }
}

/// Where the store found its table when it opened: the schema of
/// `idempotency_records` as the opening connection resolves it (its
/// `search_path`, from the pool's connect options or hooks). A TEMP table of
/// that name on the opening connection is refused: it would hide the
/// records every other connection uses.
async fn records_schema(pool: &PgPool) -> Result<String, Error> {
    const OP: &str = "find the records table";
    let row: Option<(String, bool)> = sqlx::query_as(
        "SELECT n.nspname::TEXT, n.oid = pg_my_temp_schema()
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE c.oid = to_regclass('idempotency_records')",
    )
    .fetch_optional(pool)
    .await
    .map_err(err(OP))?;
    match row {
        Some((schema, false)) => Ok(schema),
        Some((_, true)) => Err(StoreError::new(
            STORE,
            OP,
            "a TEMP table named idempotency_records hides the store's table on this \
             connection; drop it (or open the store on a pool whose connections have none)",
        )
        .into()),
        None => Err(StoreError::new(
            STORE,
            OP,
            "no table idempotency_records after the migrations: check the search_path \
             of the pool's connections",
        )
        .into()),
    }
}

/// What tells this database's records apart from any other's
/// ([`Store::database_id`]): the id migration 0011 made once for them, the
/// database's name and the records' schema, as the session's `search_path`
/// finds them. Transactional mode reads it on the caller's connection; the
/// store reads the same text in the schema it found its records in when it
/// opens ([`database_id_in_schema`]).
const DATABASE_ID_SQL: &str = "SELECT d.id || '/' || current_database() || '/' || n.nspname::TEXT
       FROM idempotency_database d, pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
      WHERE c.oid = to_regclass('idempotency_records')";

/// Reads [`DATABASE_ID_SQL`] on `conn` (`None` when its row is gone).
async fn database_id<'c>(
    conn: impl sqlx::Executor<'c, Database = Postgres>,
) -> Result<Option<String>, StoreError> {
    sqlx::query_scalar(DATABASE_ID_SQL)
        .fetch_optional(conn)
        .await
        .map_err(err(super::READ_DATABASE_ID))
}

/// [`DATABASE_ID_SQL`]'s text for the records in `schema` (the store's,
/// [`records_schema`]), read there whatever `search_path` the pool's
/// connection has. The connection the store found its table on need not be
/// the one this runs on: on one that other code left with another
/// `search_path` (a schema per tenant, with a store of its own) an
/// unqualified read would name that schema's records, while the store's
/// go to its own schema, and an answer held for one would be recorded by a
/// takeover in the other. The schema's name is bound as the catalog holds
/// it (unquoted), as `n.nspname` gives it to transactional mode.
async fn database_id_in_schema(pool: &PgPool, schema: &str) -> Result<Option<String>, sqlx::Error> {
    let sql = qualified(
        "SELECT d.id || '/' || current_database() || '/' || $1::TEXT FROM idempotency_database d",
        schema,
    );
    sqlx::query_scalar(&sql)
        .bind(schema)
        .fetch_optional(pool)
        .await
}

/// [`database_id`] on the caller's connection (transactional mode). A
/// statement that fails aborts the caller's transaction, so the table is
/// read only once the session is known to be allowed to (a role granted the
/// records table alone is answered with an error, and the transaction goes
/// on).
async fn database_id_in_transaction(
    conn: &mut sqlx::PgConnection,
) -> Result<Option<String>, StoreError> {
    const OP: &str = super::READ_DATABASE_ID;
    let readable: bool = sqlx::query_scalar(
        "SELECT COALESCE(has_table_privilege(to_regclass('idempotency_database'), 'SELECT'), FALSE)",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(err(OP))?;
    if !readable {
        return Err(StoreError::new(
            STORE,
            OP,
            "the session may not read idempotency_database (or has none on its search_path): \
             grant SELECT on it to the role, so that answers held unrecorded are matched by \
             database",
        ));
    }
    database_id(conn).await
}

/// The migrations that name the records' schema in the store's functions:
/// 0009 pins their `search_path` to it, 0010 writes it into the text of
/// `idempotency_acquire_absent`. Each finds the schema by the table when it
/// runs, so running it again re-makes the functions for the schema the
/// table is in now. A later migration that re-creates one of the functions
/// must come after them here (running 0010 again would otherwise bring back
/// 0010's text) and pin or qualify as they do (a unit test checks the list).
const SCHEMA_NAMING_MIGRATIONS: [i64; 2] = [9, 10];

/// Whether a function of the store in `schema` names another schema (see
/// [`SCHEMA_NAMING_MIGRATIONS`]): the schema was renamed after they were
/// made. One read of the catalog.
const FUNCTIONS_NAME_ANOTHER_SCHEMA_SQL: &str = "\
SELECT EXISTS (
    SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE n.nspname = $1
       AND ((p.proname IN ('idempotency_reserve_core', 'idempotency_reserve_autocommit',
                           'idempotency_reserve', 'idempotency_notify_waiters')
             AND NOT COALESCE(p.proconfig, '{}')
                     @> ARRAY['search_path=' || quote_ident(n.nspname) || ', pg_temp'])
         OR (p.proname = 'idempotency_acquire_absent'
             AND position(quote_ident(n.nspname) || '.idempotency_records' IN p.prosrc) = 0)))";

/// After `ALTER SCHEMA app RENAME TO app2`, the functions (which move with
/// the schema) still name `app`: the store opened and replayed, but every
/// fresh key and takeover failed (`relation "app.idempotency_records" does
/// not exist`) for good, as no migration was left to run. When a function
/// names another schema than `schema` (the table's, found at open), the
/// migrations that name it are run again, under the migration lock, in one
/// transaction; a database whose functions are right is only read (one
/// catalog query), and an open that must not write (the command line) never
/// re-makes them.
async fn remake_functions_named_for_another_schema(
    pool: &PgPool,
    schema: &str,
) -> Result<(), migrate::MigrationError> {
    use migrate::MigrationBackend;
    async fn stale<'e, E: Executor<'e, Database = Postgres>>(
        executor: E,
        schema: &str,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(FUNCTIONS_NAME_ANOTHER_SCHEMA_SQL)
            .bind(schema)
            .fetch_one(executor)
            .await
    }
    if migrate::only_check() || !stale(pool, schema).await? {
        return Ok(());
    }
    let mut backend = MigrationTransaction {
        pool: pool.clone(),
        tx: migrate::OneTransaction::new(None),
    };
    backend.lock().await?;
    let remade = async {
        // Another process may have re-made them while this one waited.
        if stale(&mut *backend.tx()?, schema).await? {
            tracing::warn!(target: "idempotent", store = STORE, schema,
                "the store's functions name another schema than the one their table is in \
                 (the schema was renamed): re-making them for this one");
            for migration in migrate::POSTGRES
                .iter()
                .filter(|m| SCHEMA_NAMING_MIGRATIONS.contains(&m.version))
            {
                backend.execute(migration.sql).await?;
            }
        }
        Ok::<(), sqlx::Error>(())
    }
    .await;
    let finished = backend.unlock(remade.is_ok()).await;
    remade?;
    Ok(finished?)
}

/// The statements the store sends through the pool it shares with the
/// application, with the store's table and functions qualified by the schema
/// it found them in when it opened ([`records_schema`]). A connection of a
/// shared pool can be handed back with another `search_path` (code that
/// switches schemas per request) or a TEMP table named like the store's
/// (PostgreSQL looks in `pg_temp` first): unqualified, the records would go
/// where the store's other connections never look, and a retry would run
/// the body again. The functions keep to their own schema too (migration
/// 0009). The store's worker sends them too, on connections of its own:
/// opened with the pool's options, these may resolve the names elsewhere
/// than the connection the store opened on did (one other code had left
/// with another `search_path`). Transactional mode's statements stay
/// unqualified: they run on the caller's connection, whose `search_path` is
/// the caller's to choose.
#[derive(Debug)]
struct Statements {
    reserve: String,
    reserve_autocommit: String,
    complete: String,
    heartbeat: String,
    release: String,
    force_release: String,
    purge: String,
    fetch: String,
    scope_stats: String,
    mark_waiting: String,
}

impl Statements {
    fn in_schema(schema: &str) -> Self {
        let q = |sql: &str| qualified(sql, schema);
        Statements {
            reserve: q(RESERVE_STORE_SQL),
            reserve_autocommit: q(RESERVE_AUTOCOMMIT_SQL),
            complete: q(&outside_a_transaction_left_open(COMPLETE_SQL)),
            heartbeat: q(&outside_a_transaction_left_open(HEARTBEAT_SQL)),
            release: q(&outside_a_transaction_left_open(RELEASE_SQL)),
            force_release: q(FORCE_RELEASE_SQL),
            purge: q(PURGE_SQL),
            fetch: q(FETCH_SQL),
            scope_stats: q(SCOPE_STATS_SQL),
            mark_waiting: q(MARK_WAITING_SQL),
        }
    }
}

/// A store-mode fenced write (`sql` ends with its `WHERE` clause) that
/// matches nothing on a connection left inside a transaction other code
/// began and wrote in (a transaction id already assigned: the statement is
/// its own transaction and has written nothing when its condition is
/// checked, once, before the scan). Written there, the result or the
/// renewal would be seen by nobody else and roll back with that
/// transaction: the record would stay in progress, and once its lease ran
/// out a retry would run the body again. The write that matched nothing is
/// told apart from a takeover by [`not_owner_unless_the_connection_is_why`].
///
/// The check is a sub-`SELECT` (an init plan, evaluated once, before the
/// write), not the bare function: a write that waits for the row while
/// another transaction updates it (a waiting duplicate's mark) is checked
/// again on the row's new version, after its own update attempt was given
/// a transaction id; the bare function, asked again then, matched nothing,
/// and the owner was told its lease was lost. An init plan's value is kept
/// for that re-check.
fn outside_a_transaction_left_open(sql: &str) -> String {
    format!("{sql}\n            AND {NO_TRANSACTION_ID_YET}")
}

/// Whether no transaction id is assigned yet, evaluated once per statement
/// (see [`outside_a_transaction_left_open`]). A SQL condition.
const NO_TRANSACTION_ID_YET: &str = "(SELECT txid_current_if_assigned() IS NULL)";

/// `sql` with every name of the store's own (`idempotency_…`, in any case:
/// the table and the functions) qualified by `schema`, quoted as an
/// identifier. A name already qualified or part of another, or inside a
/// string literal (`'…'`, `E'…'`), a quoted identifier, a comment or a
/// dollar-quoted string, is left as it is.
fn qualified(sql: &str, schema: &str) -> String {
    const PREFIX: &str = "idempotency_";
    let quoted = format!("\"{}\".", schema.replace('"', "\"\""));
    let mut out = String::with_capacity(sql.len() + 8 * quoted.len());
    let mut at = 0;
    while at < sql.len() {
        let rest = &sql[at..];
        let skipped = unqualified_span(rest, out.chars().next_back());
        if skipped > 0 {
            out.push_str(&rest[..skipped]);
            at += skipped;
            continue;
        }
        let names_ours = rest
            .get(..PREFIX.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(PREFIX));
        let part_of_another = out
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || matches!(c, '_' | '.' | '$'));
        if names_ours && !part_of_another {
            out.push_str(&quoted);
        }
        let step = if names_ours {
            PREFIX.len()
        } else {
            rest.chars().next().map_or(1, char::len_utf8)
        };
        out.push_str(&rest[..step]);
        at += step;
    }
    out
}

/// How many bytes at the start of `rest` are a string literal, a quoted
/// identifier, a comment or a dollar-quoted string (to the end of `rest` if
/// it is not closed); 0 when `rest` starts with none. `before` is the
/// character before `rest` (an `E` makes a literal's backslashes escapes).
fn unqualified_span(rest: &str, before: Option<char>) -> usize {
    let closing = |open: usize, close: &str| {
        rest[open..]
            .find(close)
            .map_or(rest.len(), |end| open + end + close.len())
    };
    if rest.starts_with("--") {
        return rest.find('\n').map_or(rest.len(), |end| end + 1);
    }
    if rest.starts_with("/*") {
        // Comments nest in PostgreSQL.
        let mut depth = 0usize;
        let mut i = 0;
        while i < rest.len() {
            if rest[i..].starts_with("/*") {
                depth += 1;
                i += 2;
            } else if rest[i..].starts_with("*/") {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return i;
                }
            } else {
                i += rest[i..].chars().next().map_or(1, char::len_utf8);
            }
        }
        return rest.len();
    }
    if let Some(quote @ ('\'' | '"')) = rest.chars().next() {
        let escapes = quote == '\'' && before.is_some_and(|c| c.eq_ignore_ascii_case(&'e'));
        let mut chars = rest.char_indices().skip(1).peekable();
        while let Some((i, c)) = chars.next() {
            if escapes && c == '\\' {
                chars.next();
            } else if c == quote {
                if chars.peek().is_some_and(|&(_, next)| next == quote) {
                    chars.next();
                } else {
                    return i + 1;
                }
            }
        }
        return rest.len();
    }
    if rest.starts_with('$') && !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
        // `$tag$` or `$$`; `$1` is a parameter.
        let tag_len = rest[1..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len() - 1);
        let tag = &rest[..tag_len + 1];
        let starts_as_tag = tag[1..].chars().next().is_none_or(|c| !c.is_ascii_digit());
        if starts_as_tag && rest[tag.len()..].starts_with('$') {
            let open = tag.len() + 1;
            return closing(open, &rest[..open]);
        }
    }
    0
}

/// How late a reservation statement may land after its call was dropped
/// (rule 14: the dropped call's release must still find its record). The
/// statement waits for each row lock it meets at most `lock_wait`; it meets
/// one or two (the record's, a concurrent insert of the key), a few more
/// when a record changes under it, and a busy server adds to that.
fn reservation_lands_within(lock_wait: Duration) -> Duration {
    lock_wait
        .min(Duration::from_millis(MAX_LOCK_TIMEOUT_MS as u64))
        .saturating_mul(4)
        .saturating_add(Duration::from_secs(5))
}

/// Runs a store-mode fenced write (`write`: the same statement each time),
/// or a plain read, each statement its own transaction. Under REPEATABLE READ or
/// SERIALIZABLE as the database's or the pool's default, an `UPDATE` or
/// `DELETE` of a row another transaction changed after the statement's
/// snapshot fails with 40001: a duplicate marking the record as waited for
/// (`waiting = TRUE`) at that moment was enough, and the owner, whose body
/// had run, got `Error::Store` instead of its result being recorded. The
/// statement sent again has a new snapshot; fenced by the owner token, it
/// is safe to repeat. Each try takes its connection as [`ClosedIfDropped`]:
/// a call dropped mid-statement closes it rather than hand it back. A try
/// the server leaves unanswered for `$waits` past `$silent_after` (the
/// store's [`PgStore::silent_connection_timeout`]) fails, its connection
/// closed ([`server::answered_within`]).
macro_rules! in_own_transaction {
    ($pool:expr, $op:expr, $silent_after:expr, $waits:expr, |$conn:ident| $write:expr) => {{
        let pool: &PgPool = $pool;
        let (silent_after, waits): (Duration, Duration) = ($silent_after, $waits);
        let mut tries = 0;
        loop {
            tries += 1;
            let mut guarded = ClosedIfDropped::acquire(pool).await.map_err(err($op))?;
            let answer = {
                let $conn = &mut *guarded;
                server::answered_within(silent_after, waits, $write)
                    .await
                    .map_err(err($op))?
            };
            let left_open = matches!(&answer, Err(e) if is_left_in_a_transaction(e));
            if left_open {
                // Closed, which rolls that transaction back; the next try
                // takes another connection.
                tracing::warn!(target: "idempotent", store = STORE, "{LEFT_IN_A_TRANSACTION}; closing it, which rolls that transaction back");
                guarded.close_on_drop();
            }
            guarded.hand_back();
            match answer {
                Err(_) if left_open && tries < LEFT_OPEN_TRIES => continue,
                Err(e) if tries < FENCED_WRITE_TRIES && is_serialization_failure(&e) => {
                    tokio::time::sleep(serialization_failure_pause(tries)).await
                }
                answer => break answer,
            }
        }
    }};
}

/// How long a caller's completion, release or end of lease may wait on the
/// server beyond `detached::ATTEMPT_ANSWERS_WITHIN` (plus a completion's
/// transfer allowance): none. These statements set no `lock_timeout` (one
/// more round trip each), so a lock they meet is waited for as long as the
/// session's own `lock_timeout` says, none by default: a row lock of a
/// transactional-mode call that took the record over, a table lock of DDL
/// (`CREATE INDEX`, an `ALTER TABLE` queued behind a long transaction,
/// `VACUUM FULL`, `LOCK TABLE`). Cut at the bound, such a write fails as a
/// store error: a completion's answer is then recorded by the store's
/// worker (whose writes end their lock waits at 10 s on the server), and
/// the statement left waiting on the server ends when the lock does (one
/// per call, as PostgreSQL notices a closed client only when it next sends).
const CALLER_WRITE_WAITS: Duration = Duration::ZERO;

/// How long a caller's lease renewal may wait on the server beyond
/// `detached::ATTEMPT_ANSWERS_WITHIN`: 10 minutes. A renewal is sent again
/// after each failure, so cut at 20 s behind DDL each one left a backend
/// waiting on the server, two more per call every 20 s for as long as the
/// lock lasted, towards `max_connections` (review). A renewal on a
/// connection gone silent is held this long at most; the next renewals go
/// out on other connections meanwhile.
const RENEWAL_WAITS: Duration = Duration::from_secs(600);

/// A write of the store's worker waits for a row lock (a transaction that
/// took the record over holds it) at most 10 s, or the session's own shorter
/// `lock_timeout`: the server ends the wait, under the worker's bound on an
/// attempt (`detached::ATTEMPT_ANSWERS_WITHIN`). Cut by the worker instead,
/// the statement would go on waiting on the server after its connection
/// closed, one more per attempt (review). Set for the write's transaction
/// alone (`set_config(.., true)`): nothing is set on the session, which a
/// connection pooler would refuse as a startup parameter or leave on a
/// server connection others use.
const WORKER_LOCK_TIMEOUT_SQL: &str = "SELECT set_config('lock_timeout', \
     CASE WHEN current_setting('lock_timeout')::INTERVAL > INTERVAL '0' \
           AND current_setting('lock_timeout')::INTERVAL < INTERVAL '10 s' \
          THEN current_setting('lock_timeout') ELSE '10s' END, true)";

/// A fenced write of the store's worker, in a transaction of its own whose
/// row-lock waits end at 10 s ([`WORKER_LOCK_TIMEOUT_SQL`]), on
/// [`in_own_transaction!`]'s connection and tries.
macro_rules! in_worker_transaction {
    ($pool:expr, $op:expr, |$conn:ident| $write:expr) => {
        // The worker bounds each attempt itself (`Detached::set_attempt_limit`).
        in_own_transaction!($pool, $op, Duration::ZERO, Duration::MAX, |conn| async {
            let mut tx = sqlx::Connection::begin(&mut *conn)
                .await
                .map_err(err($op))?;
            sqlx::query(WORKER_LOCK_TIMEOUT_SQL)
                .execute(&mut *tx)
                .await
                .map_err(err($op))?;
            let done = {
                let $conn = &mut *tx;
                $write.await?
            };
            tx.commit().await.map_err(err($op))?;
            Ok::<_, StoreError>(done)
        })
    };
}

/// One of the store's fenced writes (`$op`, on the record of `$identity`) in
/// a transaction of its own, with [`in_own_transaction!`]'s connection,
/// tries and bounds (`$waits`: the row-lock wait it may rightly have): `$write`,
/// the write's future on connection `$conn`, whose `NotOwner` is told apart
/// from a connection left inside a transaction
/// ([`not_owner_unless_the_connection_is_why`]).
macro_rules! own_fenced_write {
    ($store:expr, $op:literal, $waits:expr, $identity:expr, |$conn:ident| $write:expr) => {{
        let store: &PgStore = $store;
        in_own_transaction!(
            &store.pools.current(),
            $op,
            store.silent_after,
            $waits,
            |conn| async move {
                let written = {
                    let $conn = &mut *conn;
                    $write.await?
                };
                not_owner_unless_the_connection_is_why(
                    conn,
                    $op,
                    $identity,
                    written,
                    WrittenIn::OwnTransaction,
                )
                .await
            }
        )
    }};
}

/// An operator's write (`release`, `release --end-lease`), `$write` on the
/// transaction `$tx`, in a transaction of its own:
/// - READ COMMITTED whatever the default: under REPEATABLE READ or
///   SERIALIZABLE the snapshot is taken by the first statement, and a record
///   its owner renewed or completed, or a call took over, before the write
///   failed it with a bare serialization failure ("could not serialize
///   access"), which tells the operator nothing. Here the write checks the
///   record as it is then.
/// - A row another transaction holds (a transactional-mode call in
///   progress) is waited for at most [`OPERATOR_LOCK_WAIT`], bounded by the
///   server (`lock_timeout` for the transaction), then rolled back and told
///   as [`held_by_a_transaction`]: nothing is left waiting on the server.
macro_rules! operator_write {
    ($store:expr, $op:expr, |$tx:ident| $write:expr) => {{
        let store: &PgStore = $store;
        let mut conn = store.outside_any_transaction($op).await?;
        let mut tx =
            sqlx::Connection::begin_with(&mut *conn, "BEGIN ISOLATION LEVEL READ COMMITTED")
                .await
                .map_err(err($op))?;
        sqlx::query("SELECT set_config('lock_timeout', $1, TRUE)")
            .bind(format!("{}ms", OPERATOR_LOCK_WAIT.as_millis()))
            .execute(&mut *tx)
            .await
            .map_err(err($op))?;
        let written = {
            let $tx = &mut *tx;
            $write.await
        };
        let written = match written {
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                tx.rollback().await.map_err(err($op))?;
                conn.hand_back();
                return Err(held_by_a_transaction(STORE, $op));
            }
            other => other.map_err(err($op))?,
        };
        tx.commit().await.map_err(err($op))?;
        conn.hand_back();
        written
    }};
}

/// The worker that finishes dropped calls' records with the store's fenced
/// writes (module `server`).
fn background_worker(pool: &PgPool, sql: &std::sync::Arc<Statements>) -> detached::Detached {
    let sql = sql.clone();
    server::background_worker(STORE, pool, move |pool, identity, token, work| {
        let sql = sql.clone();
        Box::pin(async move {
            let (id, token) = (&identity, &token);
            in_worker_transaction!(&pool, work.operation(), |conn| async {
                match &work {
                    Work::Release => release_with(conn, &sql.release, id, token).await,
                    Work::EndLease => {
                        heartbeat_with(conn, &sql.heartbeat, id, token, Duration::ZERO).await
                    }
                    Work::Complete(answer) => {
                        complete_with(conn, &sql.complete, answer.completing(id, token)).await
                    }
                }
            })
        })
    })
}

/// Applies the embedded migrations once, in one transaction under an
/// advisory lock (waited for at most 60 s), recording them in
/// `idempotency_schema_migrations`.
async fn migrate(pool: &PgPool) -> Result<(), migrate::MigrationError> {
    migrate::run(
        &mut MigrationTransaction {
            pool: pool.clone(),
            tx: migrate::OneTransaction::new(None),
        },
        super::migrate::POSTGRES,
    )
    .await
}

/// The migration runner's view of PostgreSQL: one transaction for the whole
/// run, begun when the lock is taken.
struct MigrationTransaction {
    pool: PgPool,
    tx: migrate::OneTransaction<Postgres>,
}

impl MigrationTransaction {
    fn tx(&mut self) -> Result<&mut sqlx::PgConnection, sqlx::Error> {
        self.tx.connection()
    }
}

#[async_trait::async_trait]
impl migrate::MigrationBackend for MigrationTransaction {
    /// Begins the run's transaction and takes the advisory lock, waited for at
    /// most `LOCK_TIMEOUT` (`lock_timeout` for that statement only; the
    /// migrations run with the session's own).
    async fn lock(&mut self) -> Result<(), migrate::MigrationError> {
        const LOCK_TIMED_OUT: &str = "55P03";
        // READ COMMITTED whatever the database's default: the history is read
        // after the advisory lock is granted, and must see what the process
        // that held it committed (under REPEATABLE READ the snapshot would be
        // older than the lock, and a second process opening a new database
        // would apply the migrations again).
        self.tx = migrate::OneTransaction::new(Some(
            self.pool
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await?,
        ));
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
        // Pending migrations go where the history is. It can be in a schema
        // further down the search_path than its first: a database set up
        // before that schema existed (a `"$user"` schema created later, an
        // application's schema put in front of `public`). Unqualified, the
        // history table would be created again in the first schema (`IF NOT
        // EXISTS` looks in the schema it creates in alone), read there as
        // empty on the next open, and every migration applied there: a
        // second, empty store, found first by the next processes, while the
        // records stayed where the history was, and every retry of a call
        // recorded before ran its body again. For the rest of this
        // transaction alone; a TEMP table is not taken for the history.
        sqlx::query(
            "SELECT set_config('search_path', concat_ws(', ', quote_ident(n.nspname),
                        NULLIF(current_setting('search_path'), '')), true)
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE c.oid = to_regclass('idempotency_schema_migrations')
                AND n.oid IS DISTINCT FROM pg_my_temp_schema()",
        )
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    /// A plain read on the pool, before any transaction or lock: a database
    /// whose history is complete is opened without a lock and without DDL
    /// (a read-only session or a hot standby opens it). The migrations and
    /// their history rows commit in one transaction, so the history never
    /// names a migration that is not all there. `Ok(None)` when there is
    /// no history table yet (an error: the locked run reports what is wrong).
    async fn applied_without_lock(&mut self) -> Result<Option<Vec<(i64, Vec<u8>)>>, sqlx::Error> {
        let exists: bool =
            sqlx::query_scalar("SELECT to_regclass('idempotency_schema_migrations') IS NOT NULL")
                .fetch_one(&self.pool)
                .await?;
        if !exists {
            return Ok(None);
        }
        migrate::applied_on(&self.pool).await.map(Some)
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
        self.tx.applied().await
    }

    async fn execute(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        self.tx.execute(&comments_in_ascii(sql)).await
    }

    async fn record(&mut self, migration: &migrate::Migration) -> Result<(), sqlx::Error> {
        const INSERT: &str = "INSERT INTO idempotency_schema_migrations \
            (version, description, checksum) VALUES ($1, $2, $3)";
        migrate::record_on(self.tx()?, INSERT, migration).await
    }

    /// Commits, or rolls back everything the run did.
    async fn unlock(&mut self, done: bool) -> Result<(), sqlx::Error> {
        self.tx.finish(done).await
    }
}

/// `sql` with every character outside ASCII on its comment lines (a line
/// whose first non-blank is `--`) replaced by `?`. The server converts the
/// whole text sqlx sends (UTF-8) into the database's encoding before it
/// parses it, comments included: a character the encoding cannot hold (the
/// `…` in a comment of migration 0008, in a LATIN1 database) failed the
/// migration, and no store opened there. What a comment says changes
/// nothing; the migration's checksum is taken of the file as it ships.
fn comments_in_ascii(sql: &str) -> std::borrow::Cow<'_, str> {
    let is_comment = |line: &str| line.trim_start().starts_with("--");
    if sql.is_ascii() || !sql.lines().any(|l| is_comment(l) && !l.is_ascii()) {
        return std::borrow::Cow::Borrowed(sql);
    }
    let mut out = String::with_capacity(sql.len());
    for line in sql.split_inclusive('\n') {
        if is_comment(line) {
            out.extend(line.chars().map(|c| if c.is_ascii() { c } else { '?' }));
        } else {
            out.push_str(line);
        }
    }
    std::borrow::Cow::Owned(out)
}

fn err(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| match &e {
        sqlx::Error::Database(db)
            if matches!(
                db.code().as_deref(),
                Some(UNDEFINED_SCHEMA | UNDEFINED_TABLE | UNDEFINED_FUNCTION)
            ) =>
        {
            StoreError::new(STORE, operation, NotWhereTheStoreFoundIt(e))
        }
        _ => StoreError::new(STORE, operation, e),
    }
}

/// SQLSTATEs of a name that is not there: a schema, a table, a function.
const UNDEFINED_SCHEMA: &str = "3F000";
const UNDEFINED_TABLE: &str = "42P01";
const UNDEFINED_FUNCTION: &str = "42883";

/// A statement of the store's that did not find its table or a function
/// where it looked: the database's error, with what to do about it.
#[derive(Debug)]
struct NotWhereTheStoreFoundIt(sqlx::Error);

impl std::fmt::Display for NotWhereTheStoreFoundIt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: the store's table or functions are not where it looked. If no store has opened \
             this database yet, it has none of them: transactional mode (`tx = ...`) applies no \
             migrations, so open a store on it once at startup (`PgStore::from_pool(pool)` or \
             `PgStore::connect(url)`), which applies them. In transactional mode the \
             connection's search_path must also reach the schema of the store's tables; \
             otherwise the schema was renamed or dropped (or the table moved) after the store \
             opened: restart the service, so the store opens again and finds them (a store \
             opened after a rename re-makes its functions for the new name)",
            self.0
        )
    }
}

impl std::error::Error for NotWhereTheStoreFoundIt {}

fn millis_i64(d: Duration) -> i64 {
    duration_to_millis(d)
}

/// Whether the server reads the text sqlx sends as it is: sqlx sends UTF-8
/// whatever the session's `client_encoding` says, and the server converts
/// every text parameter from that encoding (from LATIN1, `café` arrives as
/// `cafÃ©`), which would name the record by another tenant or key than a
/// clean connection looks for. A `SQL_ASCII` database converts nothing,
/// whatever the client says. A `SQL_ASCII` client has nothing converted
/// either, which is what a clean connection gets in a UTF8 database alone:
/// in another (`LATIN1`, `WIN1252`) a clean connection's UTF-8 is converted
/// (`é` stored as one byte), and the raw bytes (`Ã©`) name another key.
/// A SQL condition, in the statements that would create a record (and in
/// `idempotency_acquire_absent`, migration 0010).
macro_rules! reads_text_as_sent {
    () => {
        "(current_setting('client_encoding') = 'UTF8' \
          OR current_setting('server_encoding') = 'SQL_ASCII' \
          OR (current_setting('client_encoding') = 'SQL_ASCII' \
              AND current_setting('server_encoding') = 'UTF8'))"
    };
}

/// Whether a statement may write the record `$1`–`$3` name on this
/// connection: its text is read as sent ([`reads_text_as_sent!`]), or the
/// tenant and key are ASCII, which every client encoding sends as it is
/// (the scope always is). A SQL condition.
macro_rules! names_the_record_as_sent {
    () => {
        concat!(
            "(",
            reads_text_as_sent!(),
            " OR ($1 || $3) !~ '[^\\x01-\\x7f]')"
        )
    };
}

/// What a call is told when its connection's `client_encoding` is not UTF-8
/// ([`reads_text_as_sent!`]).
const UNFAITHFUL_CLIENT_ENCODING: &str = concat!(
    "this connection's client_encoding is not UTF8 (code sharing the pool set it: ",
    "SET client_encoding), so the server would read the tenant and key sqlx sends as ",
    "other text and name the record by another identity. Nothing was written; set it ",
    "back (RESET client_encoding) before a connection goes back to the pool, or give ",
    "the store a pool of its own"
);

/// The store's reservation, one plain statement (prepared once per
/// connection, cached by sqlx): a primary-key read of the record, as a
/// hand-written `SELECT` would make, hands its columns to the judge every
/// SQL store shares ([`super::rows::Columns::answer`]: replay, in progress,
/// mismatch, or a write due). Only when there is no record does it call
/// `idempotency_acquire_absent` (migration 0008), which inserts the
/// reservation (`ON CONFLICT DO NOTHING`) and sets `lock_timeout` for the
/// statement's own transaction: a conflicting row inserted by an
/// uncommitted transaction is waited for at most `$8` ms, then the
/// statement fails with 55P03 (in progress). A `CASE` evaluates its
/// branches lazily, and the function is volatile, so it never runs when the
/// record exists: a replay reads and writes nothing. `acquired` is `NULL`
/// when there is a record, else whether the insert won. On a connection
/// whose `client_encoding` would change the identity
/// ([`reads_text_as_sent!`]) the function inserts nothing and fails with
/// [`UNFAITHFUL_ENCODING_CODE`] (migration 0010): checked there, a replay
/// pays nothing for it.
///
/// The clock is read once (`OFFSET 0` keeps the subquery from being
/// flattened into the expressions that use it). What the judge leaves to a
/// write (an expired record to replace, an expired lease to take over), and
/// a concurrent reservation that inserted the row first, go to
/// `idempotency_reserve_autocommit`, which decides under the row lock.
///
/// Not a public API (it may change in any release): visible for the bench,
/// which sends it by hand beside the annotated call. `$1`–`$3` tenant, scope
/// and key, `$4` the fingerprint (or `NULL`), `$5` the owner token, `$6`/`$7`
/// lease and ttl in ms, `$8` the lock wait in ms.
#[doc(hidden)]
pub const RESERVE_STORE_SQL: &str = "\
SELECT CASE WHEN r.state IS NULL
            THEN idempotency_acquire_absent($1, $2, $3, $4, $5, $6, $7, $8, c.now_ms) END AS acquired,
       r.state, r.fingerprint, r.is_error, r.result,
       r.lease_expires_at - c.now_ms AS lease_remaining,
       (r.expires_at <= c.now_ms
        AND (r.state = 'complete' OR r.lease_expires_at <= c.now_ms)) IS TRUE AS expired
  FROM (SELECT idempotency_now_ms() AS now_ms OFFSET 0) c
  LEFT JOIN idempotency_records r ON r.tenant = $1 AND r.scope = $2 AND r.key = $3";

/// The SQLSTATE `idempotency_acquire_absent` fails with on a connection whose
/// `client_encoding` would change the identity (migration 0010).
const UNFAITHFUL_ENCODING_CODE: &str = "IE001";

/// The SQLSTATE `idempotency_acquire_absent` fails with on a connection
/// inside a transaction other code began, wrote in and left open (a plain
/// `BEGIN`, then an early return, on a pool the store shares; migration
/// 0010): the store's statement is its own transaction and has written
/// nothing when the function asks, so a transaction id already assigned is
/// that code's, and a record written there would roll back with it. A
/// transaction left open that wrote nothing is not seen (the protocol's
/// transaction status is sqlx's private state; README).
const LEFT_IN_A_TRANSACTION_CODE: &str = "IE002";

/// What a reservation, a fenced write or a mark on such a connection is told
/// (and logs): whatever that transaction did, it was left open.
const LEFT_IN_A_TRANSACTION: &str = "the pool handed over a connection left inside a \
     transaction that other code began and never ended (a BEGIN without COMMIT or ROLLBACK)";

/// PostgreSQL's SQLSTATE for a statement sent in a transaction a failed
/// statement aborted (`in_failed_sql_transaction`). On a connection of the
/// shared pool it is a transaction other code began and left after a
/// statement of its own failed there (a plain `BEGIN`, then the early return
/// the error took): every statement fails there until the transaction ends,
/// and the connection still answers the pool's ping, so handed back it
/// failed every call the pool gave it. Nothing was written; told and handled
/// as [`LEFT_IN_A_TRANSACTION_CODE`]. In transactional mode it is the
/// caller's transaction, aborted by a statement of the body.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// Whether the statement behind `e` was refused in an aborted transaction
/// ([`IN_FAILED_TRANSACTION`]).
fn failed_in_an_aborted_transaction(e: &StoreError) -> bool {
    matches!(e.source.downcast_ref::<sqlx::Error>(),
        Some(sqlx::Error::Database(d)) if d.code().as_deref() == Some(IN_FAILED_TRANSACTION))
}

/// How many connections a reservation tries when each was left inside such
/// a transaction (each is closed).
const LEFT_OPEN_TRIES: u32 = 3;

/// What a store-mode reservation or fenced write is told when every
/// connection it tried was left inside such a transaction.
#[derive(Debug)]
struct LeftInATransaction;

impl std::fmt::Display for LeftInATransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{LEFT_IN_A_TRANSACTION}; nothing was written. End transactions on the pool's \
             connections before giving them back (begin them with sqlx: pool.begin()), or give \
             the store a pool of its own"
        )
    }
}

impl std::error::Error for LeftInATransaction {}

/// Whether `e` is [`LeftInATransaction`], or a statement refused inside a
/// transaction that failed ([`IN_FAILED_TRANSACTION`]).
fn is_left_in_a_transaction(e: &StoreError) -> bool {
    e.source.downcast_ref::<LeftInATransaction>().is_some() || failed_in_an_aborted_transaction(e)
}

/// The store's fallback for what needs a decision under the row lock: the
/// plpgsql function, no subtransaction; a lock timeout fails the statement
/// with SQLSTATE 55P03, answered as `InProgress`. Sent on a connection of
/// its own, which may have been left with another `client_encoding` than the
/// read's: then not called ([`names_the_record_as_sent!`]).
const RESERVE_AUTOCOMMIT_SQL: &str = concat!(
    // Whether a transaction id is assigned, asked once, before the function
    // runs (a takeover it writes assigns one): a connection left inside a
    // transaction other code began and wrote in (as `idempotency_acquire_absent`
    // refuses with IE002), where a takeover written would roll back with it.
    // The conditions name no column, so they are checked before the function
    // scan, never after it.
    "WITH gate AS MATERIALIZED (SELECT txid_current_if_assigned() IS NULL AS clean) \
     SELECT outcome, took_over, is_error, result, lease_remaining_ms, \
     attempt_number, previous_attempt_started_at \
     FROM idempotency_reserve_autocommit($1, $2, $3, $4, $5, $6, $7, $8) \
     WHERE (SELECT clean FROM gate) AND ",
    names_the_record_as_sent!(),
    " UNION ALL SELECT 'unfaithful_client_encoding', FALSE, NULL::BOOLEAN, NULL::BYTEA, \
     NULL::BIGINT, NULL::INT, NULL::BIGINT WHERE (SELECT clean FROM gate) AND NOT ",
    names_the_record_as_sent!(),
    " UNION ALL SELECT 'left_in_a_transaction', FALSE, NULL::BOOLEAN, NULL::BYTEA, \
     NULL::BIGINT, NULL::INT, NULL::BIGINT WHERE NOT (SELECT clean FROM gate)"
);

/// In a caller's transaction, one statement: a plain read (`d`) answers a
/// replay, a refusal or a mismatch, taking no lock (rule 15) and no
/// subtransaction; only when it cannot (no record, or an expired one) does
/// the gated branch call `idempotency_reserve`, which catches a lock timeout
/// in a subtransaction so the caller's transaction stays usable. The gate is
/// an uncorrelated condition, so PostgreSQL evaluates it once, before the
/// function scan, and never calls the function otherwise.
const RESERVE_TX_SQL: &str = concat!(
    "\
WITH d AS MATERIALIZED (
    SELECT CASE WHEN c.expires_at <= c.now_ms
                     AND (c.state = 'complete' OR c.lease_expires_at <= c.now_ms) THEN NULL
                WHEN c.fingerprint IS NOT NULL AND $4::TEXT IS NOT NULL
                     AND c.fingerprint <> $4::TEXT THEN 'mismatch'
                WHEN c.state = 'complete' THEN 'completed'
                WHEN c.lease_expires_at > c.now_ms THEN 'in_progress'
           END AS outcome,
           c.is_error, c.result, c.lease_expires_at - c.now_ms AS lease_remaining_ms
      FROM (SELECT state, fingerprint, is_error, result, lease_expires_at, expires_at,
                   idempotency_now_ms() AS now_ms
              FROM idempotency_records
             WHERE tenant = $1 AND scope = $2 AND key = $3) c)
SELECT d.outcome, FALSE AS took_over, d.is_error,
       CASE WHEN d.outcome = 'completed' THEN d.result END AS result,
       d.lease_remaining_ms, NULL::INT AS attempt_number,
       NULL::BIGINT AS previous_attempt_started_at
  FROM d WHERE d.outcome IS NOT NULL
UNION ALL
SELECT f.outcome, f.took_over, f.is_error, f.result, f.lease_remaining_ms,
       f.attempt_number, f.previous_attempt_started_at
  FROM idempotency_reserve($1, $2, $3, $4, $5, $6, $7,
           -- The statement's lock wait stays under half the session's
           -- `statement_timeout` (0: none): a statement the server cancels
           -- would abort the caller's transaction, where a lock timeout is
           -- caught and answered `in_progress` (the engine asks again).
           LEAST($8::BIGINT, COALESCE(NULLIF((EXTRACT(EPOCH FROM
               current_setting('statement_timeout')::INTERVAL) * 500)::BIGINT, 0), $8::BIGINT))) f
 WHERE NOT EXISTS (SELECT 1 FROM d WHERE d.outcome IS NOT NULL)
   -- A read-only transaction gets the read's answers; a call that would
   -- have to write answers nothing (told as READ_ONLY_REFUSED), never a
   -- failed insert that would abort the caller's transaction.
   AND current_setting('transaction_read_only') = 'off'
   AND ",
    names_the_record_as_sent!(),
    "
UNION ALL
SELECT 'unfaithful_client_encoding', FALSE, NULL, NULL, NULL, NULL, NULL
 WHERE NOT EXISTS (SELECT 1 FROM d WHERE d.outcome IS NOT NULL)
   AND NOT ",
    names_the_record_as_sent!()
);

/// The longest `lock_timeout` PostgreSQL accepts, in ms.
const MAX_LOCK_TIMEOUT_MS: i64 = i32::MAX as i64;

/// `lock_not_available`: `lock_timeout` ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// `serialization_failure`: under REPEATABLE READ or SERIALIZABLE (a
/// database's or a pool's default), an insert met a row committed after the
/// statement's snapshot. In autocommit a new statement has a new snapshot.
const SERIALIZATION_FAILURE: &str = "40001";

/// How many times a store-mode reservation that failed with
/// [`SERIALIZATION_FAILURE`] is sent: a reservation of the key committed
/// meanwhile, which the next statement sees; or, under SERIALIZABLE as the
/// default, PostgreSQL cancelled the statement for a read/write conflict
/// among concurrent serializable transactions (reservations of other keys
/// on the same index page, a purge), which the next statement, with a new
/// snapshot, most often does not meet again. As many as a fenced write's
/// ([`FENCED_WRITE_TRIES`]).
const SERIALIZATION_FAILURE_TRIES: u32 = FENCED_WRITE_TRIES;

/// The longest one statement of a reservation in a caller's transaction
/// waits for a row lock; the call's wait is taken in such slices. A
/// reservation's row is written by `idempotency_reserve`'s subtransaction,
/// which commits into the caller's transaction (or savepoint), and
/// PostgreSQL wakes a waiter for a row a committed subtransaction wrote only
/// when its *top-level* transaction ends: a reservation rolled back with a
/// savepoint (`ROLLBACK TO SAVEPOINT`, a nested sqlx transaction rolled
/// back) while its owner's transaction stays open would keep a duplicate
/// that waits in one statement waiting for its whole bound, then refused as
/// in progress with the key free. The next statement finds the row gone.
/// Longer than `deadlock_timeout` (1 s by default), so a wait in a deadlock
/// among callers' transactions is still found (40P01).
const TX_LOCK_WAIT_SLICE: Duration = Duration::from_secs(2);

/// The least a slice's statement must have waited, and the least wait left,
/// for another slice: a statement that answered sooner did not wait out a
/// row lock (the lock wait may also be cut to half the session's
/// `statement_timeout`), and the next slice must not be a `lock_timeout` of
/// 0, which PostgreSQL takes as no timeout at all.
const TX_LOCK_WAIT_SLICE_FLOOR: Duration = Duration::from_millis(50);

/// The session's `deadlock_timeout`; zero where it cannot be read (the
/// slices keep their length).
async fn deadlock_timeout(conn: &mut sqlx::PgConnection) -> Duration {
    let ms: Result<i64, _> = sqlx::query_scalar(
        "SELECT (EXTRACT(EPOCH FROM current_setting('deadlock_timeout')::interval) * 1000)::bigint",
    )
    .fetch_one(conn)
    .await;
    ms.ok()
        .and_then(|ms| u64::try_from(ms).ok())
        .map_or(Duration::ZERO, Duration::from_millis)
}

/// In a caller's transaction (see [`RESERVE_TX_SQL`]). A transaction whose
/// snapshot is older than the record (REPEATABLE READ or SERIALIZABLE,
/// migration 0007) is refused with [`Error::StaleSnapshot`]; the
/// reservation's subtransaction was undone, so the transaction stays usable.
/// A row lock is waited for `lock_wait` in all, in statements of at most
/// [`TX_LOCK_WAIT_SLICE`].
async fn reserve_in_transaction(
    conn: &mut sqlx::PgConnection,
    request: ReserveRequest<'_>,
    lock_wait: Duration,
) -> Result<Reservation, Error> {
    let started = std::time::Instant::now();
    // What `idempotency_reserve` answers when its lock wait ran out: in
    // progress, with the requested lease as the estimate.
    let lock_timed_out = Reservation::InProgress {
        lease_remaining: millis_to_duration(millis_i64(request.lease)),
    };
    // A slice outlasts the session's `deadlock_timeout` (asked once a slice
    // has been waited out): PostgreSQL looks for a deadlock only once one
    // statement has waited that long, so shorter slices would never find one.
    let mut slice_len = TX_LOCK_WAIT_SLICE;
    let mut asked_deadlock_timeout = false;
    let answer = loop {
        let left = lock_wait.saturating_sub(started.elapsed());
        let slice = left.min(slice_len);
        let sent = std::time::Instant::now();
        let answer = reserve_statement(
            (RESERVE_TX_SQL, decode_reservation),
            &mut *conn,
            request,
            slice,
        )
        .await
        .map_err(err("reserve"))?;
        let waited_out = matches!(&answer, Answer::Reserved(r) if *r == lock_timed_out)
            && sent.elapsed() >= TX_LOCK_WAIT_SLICE_FLOOR;
        if !waited_out || lock_wait.saturating_sub(started.elapsed()) < TX_LOCK_WAIT_SLICE_FLOOR {
            break answer;
        }
        if !asked_deadlock_timeout {
            asked_deadlock_timeout = true;
            slice_len = slice_len.max(deadlock_timeout(&mut *conn).await + TX_LOCK_WAIT_SLICE / 2);
        }
    };
    match answer {
        Answer::Reserved(reservation) => Ok(reservation),
        Answer::StaleSnapshot => {
            let id = request.identity;
            tracing::warn!(target: "idempotent", scope = %id.scope, key = %id.key_digest(),
                "refused: the caller's transaction (REPEATABLE READ or SERIALIZABLE) cannot write the record (serialization failure: a snapshot older than the record, or a read/write conflict)");
            Err(Error::StaleSnapshot {
                scope: id.scope.clone(),
                store: STORE,
            })
        }
        Answer::UnfaithfulEncoding => {
            Err(StoreError::new(STORE, "reserve", UNFAITHFUL_CLIENT_ENCODING).into())
        }
        Answer::Other => {
            let read_only: String = sqlx::query_scalar("SHOW transaction_read_only")
                .fetch_one(&mut *conn)
                .await
                .map_err(err("reserve"))?;
            let why = if read_only == "on" {
                READ_ONLY_REFUSED
            } else {
                "the reservation statement answered nothing"
            };
            Err(StoreError::new(STORE, "reserve", why).into())
        }
        // The store's fallback statement's answer alone.
        Answer::LeftInATransaction => Err(StoreError::new(
            STORE,
            "reserve",
            "the reservation statement answered nothing",
        )
        .into()),
    }
}

/// How many times a store-mode reservation that met a row lock tries again
/// before it answers `InProgress`, when the lock was met inserting a fresh
/// record (another transaction's uncommitted insert of the key: a
/// transactional-mode owner, whose call is in progress).
const LOCK_TIMEOUT_TRIES: u32 = 3;

/// The same when the lock was met on an existing record the read found
/// expired (or replaced in between): such a lock is short-lived (a purge
/// deleting the record, another reservation replacing it), so trying for
/// longer finds it gone or replaced, instead of sending the caller away with
/// a made-up `retry_after`. A transactional-mode owner that took the expired
/// record over holds it for its whole call: then this many waits of
/// `lock_wait` (2 s at the default 100 ms) pass before `InProgress`.
const EXPIRED_RECORD_LOCK_TRIES: u32 = 20;

/// The store's reservation: one statement in its own transaction (see
/// [`RESERVE_STORE_SQL`]), and for takeovers, expired records and races a
/// second one, the plpgsql function. A row held by another transaction past
/// `lock_wait` (and the tries above) is a call in progress; its remaining
/// time is unknown, so the requested lease is the estimate (as in
/// `idempotency_reserve`).
async fn reserve_autocommit(
    pool: &PgPool,
    sql: &Statements,
    request: ReserveRequest<'_>,
    (lock_wait, silent_after): (Duration, Duration),
) -> Result<Reservation, StoreError> {
    // Counted apart: lock timeouts used up must not leave a serialization
    // failure (the holder committed while the statement waited) no try.
    let (mut lock_timeouts, mut serialization_failures, mut left_open) = (0, 0, 0);
    let answer = loop {
        let bounds = (lock_wait, silent_after);
        let read_first = (sql.reserve.as_str(), decode_store_reservation as Decode);
        let (answer, allowed) = match reserve_on(pool, read_first, request, bounds).await {
            Ok(Answer::Other) => (
                reserve_on(
                    pool,
                    (&sql.reserve_autocommit, decode_reservation),
                    request,
                    bounds,
                )
                .await,
                EXPIRED_RECORD_LOCK_TRIES,
            ),
            answer => (answer, LOCK_TIMEOUT_TRIES),
        };
        // Its connection is closed: the next try takes another.
        if left_in_a_transaction(&answer) {
            if left_open + 1 < LEFT_OPEN_TRIES {
                left_open += 1;
                continue;
            }
            break answer;
        }
        let code = match &answer {
            Err(sqlx::Error::Database(e)) => e.code(),
            _ => None,
        };
        match code.as_deref() {
            Some(LOCK_NOT_AVAILABLE) if lock_timeouts + 1 < allowed => lock_timeouts += 1,
            // The row another reservation committed meanwhile: the next
            // statement sees it (a replay, a refusal or a mismatch).
            Some(SERIALIZATION_FAILURE)
                if serialization_failures + 1 < SERIALIZATION_FAILURE_TRIES =>
            {
                serialization_failures += 1;
                tokio::time::sleep(serialization_failure_pause(serialization_failures)).await
            }
            _ => break answer,
        }
    };
    if left_in_a_transaction(&answer) {
        return Err(StoreError::new(STORE, "reserve", LeftInATransaction));
    }
    match answer {
        Ok(Answer::Reserved(reservation)) => Ok(reservation),
        Ok(Answer::LeftInATransaction) => unreachable!("answered above"),
        // Autocommit statements take a fresh snapshot each: never answered.
        Ok(Answer::UnfaithfulEncoding) => Err(StoreError::new(
            STORE,
            "reserve",
            UNFAITHFUL_CLIENT_ENCODING,
        )),
        Ok(Answer::StaleSnapshot | Answer::Other) => Err(StoreError::new(
            STORE,
            "reserve",
            "idempotency_reserve_autocommit answered nothing; is migration 0004 applied?",
        )),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            Ok(Reservation::InProgress {
                lease_remaining: request.lease,
            })
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(UNFAITHFUL_ENCODING_CODE) => {
            Err(StoreError::new(
                STORE,
                "reserve",
                UNFAITHFUL_CLIENT_ENCODING,
            ))
        }
        Err(e) => Err(err("reserve")(e)),
    }
}

/// [`reserve_statement`] on a connection of `pool` closed if the call is
/// dropped before it answers ([`ClosedIfDropped`]), or if the server leaves
/// it unanswered past its lock waits ([`reservation_lands_within`]) and
/// `silent_after` ([`server::answered_within`]).
async fn reserve_on(
    pool: &PgPool,
    (sql, decode): (&str, Decode),
    request: ReserveRequest<'_>,
    (lock_wait, silent_after): (Duration, Duration),
) -> Result<Answer, sqlx::Error> {
    let mut conn = ClosedIfDropped::acquire(pool).await?;
    let answer = server::answered_within(
        silent_after,
        reservation_lands_within(lock_wait),
        reserve_statement((sql, decode), &mut *conn, request, lock_wait),
    )
    .await?;
    if left_in_a_transaction(&answer) {
        // Closed, which rolls the transaction other code left open back
        // (as the MariaDB and SQLite stores do), so the next try takes
        // another connection.
        tracing::warn!(target: "idempotent", store = STORE, "{LEFT_IN_A_TRANSACTION}; closing it, which rolls that transaction back");
        conn.close_on_drop();
        return answer;
    }
    conn.hand_back();
    answer
}

/// Whether a reservation statement found its connection inside a
/// transaction other code began and wrote in (IE002, or the fallback's
/// answer).
fn left_in_a_transaction(answer: &Result<Answer, sqlx::Error>) -> bool {
    match answer {
        Ok(Answer::LeftInATransaction) => true,
        Err(sqlx::Error::Database(e)) => matches!(
            e.code().as_deref(),
            Some(LEFT_IN_A_TRANSACTION_CODE | IN_FAILED_TRANSACTION)
        ),
        _ => false,
    }
}

/// What one reservation statement answered.
enum Answer {
    /// A reservation's answer.
    Reserved(Reservation),
    /// No row, or `other`: a case the statement leaves to the plpgsql function.
    Other,
    /// `stale_snapshot` (transactional mode, migration 0007): the caller's
    /// snapshot is older than the record another transaction committed.
    StaleSnapshot,
    /// `unfaithful_client_encoding`: nothing was written, the connection's
    /// `client_encoding` would have changed the identity.
    UnfaithfulEncoding,
    /// `left_in_a_transaction`: nothing was written, the connection is
    /// inside a transaction other code began and wrote in.
    LeftInATransaction,
}

/// How a reservation statement's row is read: [`decode_store_reservation`]
/// for [`RESERVE_STORE_SQL`], [`decode_reservation`] for the statements over
/// the plpgsql functions.
type Decode = fn(&PgRow, ReserveRequest<'_>) -> Result<Answer, sqlx::Error>;

/// Runs one reservation statement and reads its row with `decode`.
async fn reserve_statement<'e, E: Executor<'e, Database = Postgres>>(
    (sql, decode): (&str, Decode),
    executor: E,
    request: ReserveRequest<'_>,
    lock_wait: Duration,
) -> Result<Answer, sqlx::Error> {
    let id = request.identity;
    let row: Option<PgRow> = sqlx::query(sql)
        .bind(&id.tenant)
        .bind(&id.scope)
        .bind(&id.key)
        .bind(request.fingerprint.map(Fingerprint::as_str))
        .bind(request.token.as_str())
        .bind(millis_i64(request.lease))
        .bind(millis_i64(request.ttl))
        // `lock_timeout` takes at most 2^31 - 1 ms (24.8 days); a longer wait
        // (`in_progress = wait("30days")`) waits that long per statement, and
        // the engine asks again for the rest.
        .bind(millis_i64(lock_wait).min(MAX_LOCK_TIMEOUT_MS))
        .fetch_optional(executor)
        .await?;
    match row {
        Some(row) => decode(&row, request),
        None => Ok(Answer::Other),
    }
}

/// Reads [`RESERVE_STORE_SQL`]'s row: the insert's verdict when there was
/// no record, else what the record answers by itself, judged as every SQL
/// store judges a read ([`super::rows::Columns::answer`]); `Other` where a
/// write is due.
fn decode_store_reservation(
    row: &PgRow,
    request: ReserveRequest<'_>,
) -> Result<Answer, sqlx::Error> {
    match row.try_get::<Option<bool>, _>("acquired")? {
        Some(true) => Ok(Answer::Reserved(Reservation::acquired(1, None))),
        Some(false) => Ok(Answer::Other),
        // No record and no verdict (the function answers one always): left
        // to the fallback, as a lost race is.
        None if row.try_get::<Option<&str>, _>("state")?.is_none() => Ok(Answer::Other),
        None => Ok(
            match super::rows::Columns(row).answer(request.fingerprint.map(Fingerprint::as_str))? {
                Some(reservation) => Answer::Reserved(reservation),
                None => Answer::Other,
            },
        ),
    }
}

/// Reads the row of a statement over the plpgsql functions: its `outcome`
/// and the columns that go with it.
fn decode_reservation(row: &PgRow, _: ReserveRequest<'_>) -> Result<Answer, sqlx::Error> {
    let outcome: String = row.try_get("outcome")?;
    Ok(Answer::Reserved(match outcome.as_str() {
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
        "other" => return Ok(Answer::Other),
        "stale_snapshot" => return Ok(Answer::StaleSnapshot),
        "unfaithful_client_encoding" => return Ok(Answer::UnfaithfulEncoding),
        "left_in_a_transaction" => return Ok(Answer::LeftInATransaction),
        other => {
            return Err(sqlx::Error::Protocol(format!(
                "idempotency_reserve answered an unknown outcome `{other}`"
            )))
        }
    }))
}

/// A statement on the record `token` owns: `$1`–`$3` name the record and
/// `$4` is the owner token; the caller binds the rest from `$5`.
fn on_owned_record<'q>(
    sql: &'q str,
    identity: &'q Identity,
    token: &'q OwnerToken,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(&identity.tenant)
        .bind(&identity.scope)
        .bind(&identity.key)
        .bind(token.as_str())
}

/// Runs a write fenced by the owner token: `Written` when it touched the
/// record, `NotOwner` when the token no longer owns it.
async fn fenced<'e, E: Executor<'e, Database = Postgres>>(
    operation: &'static str,
    statement: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
    executor: E,
) -> Result<Fenced, StoreError> {
    let done = statement.execute(executor).await.map_err(err(operation))?;
    Ok(Fenced::from_owned(done.rows_affected() == 1))
}

/// Whose transaction a fenced write ran in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WrittenIn {
    /// Its own (store mode): the connection should be outside any
    /// transaction.
    OwnTransaction,
    /// The caller's (transactional mode).
    CallersTransaction,
}

/// A fenced write that matched nothing (`NotOwner`), told apart from a
/// takeover when the connection is why, in one more round trip (a
/// simple-protocol query, paid only by a write that matched nothing):
/// * store mode, on a connection left inside a transaction other code
///   began ([`outside_a_transaction_left_open`]): [`LeftInATransaction`]
///   (its connection is closed and the write sent again on another). Also
///   when that transaction only read: under `REPEATABLE READ` its snapshot
///   may be older than the record, which the write then did not see (the
///   caller was told its lease was lost while the record was still its
///   own). The transaction's start is asked ([`started_before_this_statement`]),
///   which sees any transaction left open (a transaction id, asked with the
///   extended protocol, sees only one that wrote);
/// * on a connection whose `client_encoding` changed the identity it named
///   ([`reads_text_as_sent!`]; code sharing the pool left it there after
///   the reservation), for a tenant or key outside ASCII: that, not a
///   takeover. The record is still the caller's; a completion that fails
///   is recorded by the store's worker, on connections of its own.
///
/// A check that fails (an aborted transaction) leaves the answer as it was.
async fn not_owner_unless_the_connection_is_why(
    conn: &mut sqlx::PgConnection,
    operation: &'static str,
    identity: &Identity,
    written: Fenced,
    written_in: WrittenIn,
) -> Result<Fenced, StoreError> {
    // An ASCII tenant and key read the same in every client encoding.
    let ascii = identity.tenant.is_ascii() && identity.key.is_ascii();
    let own = written_in == WrittenIn::OwnTransaction;
    if written != Fenced::NotOwner || (ascii && !own) {
        return Ok(written);
    }
    let asked: Result<(bool, bool), sqlx::Error> = async {
        let row: PgRow = conn
            .fetch_one(concat!(
                "SELECT transaction_timestamp() <> statement_timestamp(), ",
                reads_text_as_sent!()
            ))
            .await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }
    .await;
    match asked {
        Ok((true, _)) if own => Err(StoreError::new(STORE, operation, LeftInATransaction)),
        Ok((_, false)) if !ascii => Err(StoreError::new(
            STORE,
            operation,
            UNFAITHFUL_CLIENT_ENCODING,
        )),
        _ => Ok(written),
    }
}

/// How many times a store-mode fenced write (or read) that failed with
/// [`SERIALIZATION_FAILURE`] is sent (see [`in_own_transaction!`]), with
/// [`serialization_failure_pause`] between the tries: about half a second of
/// pauses at most, in which the transactions it conflicted with end.
const FENCED_WRITE_TRIES: u32 = 10;

/// The pause before a statement PostgreSQL cancelled as a serialization
/// failure is sent again, after its `failures`th such failure in a row (from
/// 1): 2 ms doubling up to 100 ms, jittered (between half and all of it).
///
/// Under SERIALIZABLE as the default, the statement most often conflicted
/// with a transaction still running beside it (an audit reading the whole
/// table, a purge, a batch of other reservations); sent again at once, it
/// meets the same transaction again, and a handful of immediate tries were
/// used up in a millisecond on a loaded machine (the call failed with a bare
/// 40001). The jitter keeps calls that conflicted with each other from
/// trying again in step.
fn serialization_failure_pause(failures: u32) -> Duration {
    let full = Duration::from_millis(2u64 << failures.saturating_sub(1).min(6))
        .min(Duration::from_millis(100));
    let half = full / 2;
    half + half.mul_f64(fastrand::f64())
}

/// Whether the statement behind `e` failed with [`SERIALIZATION_FAILURE`].
fn is_serialization_failure(e: &StoreError) -> bool {
    matches!(e.source.downcast_ref::<sqlx::Error>(),
        Some(sqlx::Error::Database(d)) if d.code().as_deref() == Some(SERIALIZATION_FAILURE))
}

/// One chunk of the purge (rule 16): up to `$1` expired records, oldest
/// retention first, skipping rows other transactions hold. The clock is read
/// once, into a constant the plan sees (`(SELECT now_ms FROM clock)`), so the
/// `expires_at` index is searched for the expired range only: compared with
/// `idempotency_now_ms()` itself (volatile) the condition would be a filter,
/// and a purge that finds little to delete would walk the whole index.
pub const PURGE_SQL: &str = "WITH clock AS MATERIALIZED (SELECT idempotency_now_ms() AS now_ms)
    DELETE FROM idempotency_records WHERE ctid IN (
        SELECT ctid FROM idempotency_records
         WHERE expires_at <= (SELECT now_ms FROM clock)
           AND (state = 'complete' OR lease_expires_at <= (SELECT now_ms FROM clock))
         ORDER BY expires_at
         LIMIT $1
         FOR UPDATE SKIP LOCKED)";

/// Records the outcome, fenced by the owner token (`$4`); an outcome a
/// `recover` hook gave is marked recovered (rule 20).
const COMPLETE_SQL: &str = "UPDATE idempotency_records SET state = 'complete', owner_token = NULL,
                is_error = $5, result = $6, lease_expires_at = NULL,
                expires_at = idempotency_now_ms() + $7, updated_at = idempotency_now_ms(),
                recovered = $8, waiting = FALSE
          WHERE tenant = $1 AND scope = $2 AND key = $3
            AND state = 'in_progress' AND owner_token = $4";

/// Renews (or, with a shorter lease, ends early) the lease the owner token
/// (`$4`) holds. The record's retention moves with its lease
/// (`Store::heartbeat`): `expires_at` keeps its distance from the lease's
/// end. The clock is read once (`c.now_ms`): `idempotency_now_ms()` reads
/// `clock_timestamp()`, which is read again at every use, so two uses in one
/// statement can fall on either side of a millisecond.
const HEARTBEAT_SQL: &str = "UPDATE idempotency_records
            SET lease_expires_at = c.now_ms + $5, updated_at = c.now_ms,
                expires_at = GREATEST(expires_at,
                    c.now_ms + $5 + (expires_at - lease_expires_at))
           FROM (SELECT idempotency_now_ms() AS now_ms OFFSET 0) c
          WHERE tenant = $1 AND scope = $2 AND key = $3
            AND state = 'in_progress' AND owner_token = $4";

/// Deletes the in-progress record the owner token (`$4`) holds.
const RELEASE_SQL: &str = "DELETE FROM idempotency_records
          WHERE tenant = $1 AND scope = $2 AND key = $3
            AND state = 'in_progress' AND owner_token = $4";

/// An operator's release (`Store::force_release`): `$4` asks for an
/// expired lease.
const FORCE_RELEASE_SQL: &str = "DELETE FROM idempotency_records
              WHERE tenant = $1 AND scope = $2 AND key = $3 AND state = 'in_progress'
                AND (NOT $4 OR lease_expires_at <= idempotency_now_ms())
             RETURNING attempt";

/// One record as it is (`Store::fetch`).
const FETCH_SQL: &str =
    "SELECT state, fingerprint, owner_token, is_error, result, lease_expires_at,
                    expires_at, idempotency_now_ms() AS now_ms, created_at,
                    attempt::bigint AS attempt,
                    COALESCE(attempt_started_at, created_at) AS attempt_started_at, recovered
               FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3";

/// The records per scope and state (`Store::scope_stats`).
const SCOPE_STATS_SQL: &str = "WITH n AS (SELECT idempotency_now_ms() AS now_ms)
             SELECT scope,
                    count(*) FILTER (WHERE NOT expired AND state = 'complete') AS complete,
                    count(*) FILTER (WHERE NOT expired AND state = 'in_progress' AND lease_expires_at > now_ms) AS in_progress,
                    count(*) FILTER (WHERE NOT expired AND state = 'in_progress' AND lease_expires_at <= now_ms) AS stuck,
                    count(*) FILTER (WHERE expired) AS expired,
                    min(created_at) AS oldest,
                    count(*) FILTER (WHERE NOT expired AND attempt > 1) AS taken_over,
                    count(*) FILTER (WHERE NOT expired AND state = 'complete' AND recovered) AS recovered,
                    max(now_ms - lease_expires_at)
                        FILTER (WHERE NOT expired AND state = 'in_progress' AND lease_expires_at <= now_ms)
                        AS longest_stuck,
                    max(now_ms - CASE WHEN state = 'complete' THEN expires_at
                                      ELSE greatest(expires_at, lease_expires_at) END)
                        FILTER (WHERE expired) AS longest_unpurged
               FROM (SELECT r.*, n.now_ms,
                            (r.expires_at <= n.now_ms
                             AND (r.state = 'complete' OR r.lease_expires_at <= n.now_ms)) AS expired
                       FROM idempotency_records r CROSS JOIN n) s
              GROUP BY scope ORDER BY scope";

async fn complete_with<'e, E: Executor<'e, Database = Postgres>>(
    executor: E,
    sql: &str,
    completion: Completion<'_>,
) -> Result<Fenced, StoreError> {
    let statement = on_owned_record(sql, completion.identity, completion.token)
        .bind(completion.outcome.is_error)
        .bind(&completion.outcome.payload)
        .bind(millis_i64(completion.ttl))
        .bind(completion.marks_recovered());
    fenced("complete", statement, executor).await
}

/// Deletes the in-progress record `token` owns, freeing the key.
async fn release_with<'e, E: Executor<'e, Database = Postgres>>(
    executor: E,
    sql: &str,
    identity: &Identity,
    token: &OwnerToken,
) -> Result<Fenced, StoreError> {
    fenced("release", on_owned_record(sql, identity, token), executor).await
}

/// Renews (or, with a shorter lease, ends early) the lease `token` owns.
async fn heartbeat_with<'e, E: Executor<'e, Database = Postgres>>(
    executor: E,
    sql: &str,
    identity: &Identity,
    token: &OwnerToken,
    lease: Duration,
) -> Result<Fenced, StoreError> {
    let statement = on_owned_record(sql, identity, token).bind(millis_i64(lease));
    fenced("heartbeat", statement, executor).await
}

impl PgStore {
    /// A connection of the store's pool for a transaction of its own: one
    /// that code sharing the pool left inside a transaction (a plain
    /// `BEGIN`, then an early return; or one a statement of that code failed)
    /// is closed, rolling that transaction
    /// back, and another taken. There a `BEGIN` starts nothing (PostgreSQL
    /// warns and goes on in the open transaction, at its isolation level),
    /// and the `COMMIT` that follows would commit that code's abandoned
    /// writes. One round trip (operator and purge paths alone).
    async fn outside_any_transaction(
        &self,
        operation: &'static str,
    ) -> Result<ClosedIfDropped<Postgres>, StoreError> {
        super::outside_any_transaction::<_, ClosedIfDropped<Postgres>, _>(
            STORE,
            operation,
            &self.pools.current(),
            None,
            super::IfLeftOpen::Close,
            |conn| {
                Box::pin(async move {
                    match started_before_this_statement(conn).await {
                        // A transaction a statement of that code failed:
                        // every statement is refused there, the check too.
                        Err(sqlx::Error::Database(e))
                            if e.code().as_deref() == Some(IN_FAILED_TRANSACTION) =>
                        {
                            Ok(true)
                        }
                        other => other.map_err(err("check for an open transaction")),
                    }
                })
            },
        )
        .await
    }

    /// [`Store::force_release`], in an operator's transaction
    /// ([`operator_write!`]).
    async fn force_release_read_committed(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        let deleted: Option<i32> = operator_write!(self, OPERATOR_RELEASE, |tx| {
            sqlx::query_scalar(&self.statements.force_release)
                .bind(&identity.tenant)
                .bind(&identity.scope)
                .bind(&identity.key)
                .bind(require_expired_lease)
                .fetch_optional(tx)
        });
        if let Some(attempt) = deleted {
            return Ok(ForcedRelease::Released {
                attempt: u32::try_from(attempt).unwrap_or(1),
            });
        }
        Ok(refused_release(self.fetch(identity).await?))
    }

    /// [`Store::end_lease_for_operator`], in an operator's transaction
    /// ([`operator_write!`]): an autocommit statement left waiting on the
    /// server after its caller gave up would end the lease once the
    /// transaction holding the record is over, after the operator was told
    /// it was not ended. The server's bound leaves nothing behind.
    async fn end_lease_read_committed(
        &self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<Fenced, StoreError> {
        let ended = operator_write!(self, OPERATOR_END_LEASE, |tx| {
            on_owned_record(&self.statements.heartbeat, identity, token)
                .bind(millis_i64(Duration::ZERO))
                .execute(tx)
        });
        Ok(Fenced::from_owned(ended.rows_affected() == 1))
    }

    /// One statement of the purge: up to `chunk` expired records.
    async fn purge_chunk(&self, chunk: u32) -> Result<u64, StoreError> {
        // Deletes made in a transaction other code left open would be
        // counted, seen by nobody else, and rolled back with it. One more
        // round trip per chunk (the purge's path alone).
        let mut conn = self
            .outside_any_transaction("purge expired records")
            .await?;
        // READ COMMITTED whatever the database's or the pool's default: the
        // statement relies on it (a row changed after its snapshot is
        // checked again as it is now, and skipped when it is live). Under
        // REPEATABLE READ or SERIALIZABLE such a row, one another purger
        // deleted or a reservation replaced, failed the whole run with a
        // serialization failure, and under SERIALIZABLE the purge's scan of
        // the expiry index met read/write conflicts with the calls writing
        // next to it at every run. Two more round trips per chunk (the
        // purge's path alone).
        let mut tx =
            sqlx::Connection::begin_with(&mut *conn, "BEGIN ISOLATION LEVEL READ COMMITTED")
                .await
                .map_err(err("purge expired records"))?;
        let done = sqlx::query(&self.statements.purge)
            .bind(i64::from(chunk))
            .execute(&mut *tx)
            .await
            .map_err(err("purge expired records"))?;
        tx.commit().await.map_err(err("purge expired records"))?;
        conn.hand_back();
        Ok(done.rows_affected())
    }
}

#[async_trait::async_trait]
impl Store for PgStore {
    fn name(&self) -> &'static str {
        STORE
    }

    fn database_id(&self) -> Option<&str> {
        self.database_id.as_deref()
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let reserve = async {
            reserve_autocommit(
                &self.pools.current(),
                &self.statements,
                request,
                (self.lock_wait, self.silent_after),
            )
            .await
        };
        live_owners::reservation((&request, self.database_id()), reserve).await
    }

    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        // No row-lock wait of its own: the session's `lock_timeout`, none by
        // default (see `CALLER_WRITE_WAITS`).
        let waits = CALLER_WRITE_WAITS
            .saturating_add(detached::allowance_for(completion.outcome.payload.len()));
        let write = async {
            own_fenced_write!(self, "complete", waits, completion.identity, |conn| {
                complete_with(conn, &self.statements.complete, completion)
            })
        };
        live_owners::completed(completion.token, write).await
    }

    async fn force_release(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        self.force_release_read_committed(identity, require_expired_lease)
            .await
    }

    async fn end_lease_for_operator(
        &self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<Fenced, StoreError> {
        self.end_lease_read_committed(identity, token).await
    }

    async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError> {
        live_owners::ended(token);
        own_fenced_write!(self, "release", CALLER_WRITE_WAITS, identity, |conn| {
            release_with(conn, &self.statements.release, identity, token)
        })
    }

    async fn heartbeat(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        let write = async {
            own_fenced_write!(self, "heartbeat", RENEWAL_WAITS, identity, |conn| {
                heartbeat_with(conn, &self.statements.heartbeat, identity, token, lease)
            })
        };
        live_owners::renewal((identity, self.database_id()), token, lease, write).await
    }

    crate::store::detached::hand_over_to_the_worker!(told = live_owners::handed_over);

    /// Woken by `LISTEN/NOTIFY` when the record completes, is released or
    /// changes owner (in any process); polls only when the listener cannot
    /// help (module documentation, "Waiting duplicates").
    async fn wait_for_change(&self, identity: &Identity, max_wait: Duration, round: u32) {
        self.wait_with_listener(identity, max_wait, round).await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        super::purge_in_chunks(STORE, batch, |chunk| self.purge_chunk(chunk)).await
    }

    async fn fetch(&self, identity: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        // A plain read: no lock wait. Sent again when PostgreSQL cancels it
        // as a serialization failure (SERIALIZABLE as the default).
        let row = in_own_transaction!(
            &self.pools.current(),
            "fetch",
            self.silent_after,
            Duration::ZERO,
            |conn| async move {
                sqlx::query(&self.statements.fetch)
                    .bind(&identity.tenant)
                    .bind(&identity.scope)
                    .bind(&identity.key)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(err("fetch"))
            }
        )?;
        rows::Columns::snapshot_if_found(row.as_ref()).map_err(err("fetch"))
    }

    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        // Sent again when PostgreSQL cancels it as a serialization failure
        // (SERIALIZABLE as the default: a read beside writers can be the
        // transaction it cancels). No bound of its own: an audit reads the
        // whole table.
        let found = in_own_transaction!(
            &self.pools.current(),
            COUNT_PER_SCOPE,
            Duration::MAX,
            Duration::ZERO,
            |conn| async move {
                sqlx::query(&self.statements.scope_stats)
                    .fetch_all(&mut *conn)
                    .await
                    .map_err(err(COUNT_PER_SCOPE))
            }
        )?;
        found
            .iter()
            .map(|row| rows::Columns(row).scope_stats())
            .collect::<Result<_, sqlx::Error>>()
            .map_err(err(COUNT_PER_SCOPE))
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

/// What a transactional call in a read-only transaction that would have to
/// write (the key is absent or expired) is told. A replay, a refusal or a
/// mismatch is answered there as anywhere.
const READ_ONLY_REFUSED: &str = concat!(
    "the caller's transaction is read-only (SET TRANSACTION READ ONLY, ",
    "default_transaction_read_only, or a standby server) and this call would have to write its ",
    "record. Nothing was written and the transaction is still usable; make the call in a ",
    "read-write transaction"
);

crate::transaction::transactional_connection! {
    /// Transactional mode on a PostgreSQL connection: the reservation and the
    /// recorded result are statements in whatever transaction the connection is in.
    ///
    /// ```no_run
    /// use idempotent_runtime::TransactionalConnection;
    /// fn assert_tx<C: TransactionalConnection + ?Sized>() {}
    /// assert_tx::<sqlx::PgConnection>();
    /// assert_tx::<sqlx::Transaction<'static, sqlx::Postgres>>();
    /// ```
    impl for sqlx::PgConnection {
        store: STORE,
        in_transaction: in_transaction,
        reserve: reserve_in_transaction,
        complete: complete_in_transaction,
        release: release_in_transaction,
        heartbeat: heartbeat_in_transaction,
        database_id: database_id_in_transaction,
        may_wait: reads_what_others_commit,
    }
}

/// Transactional mode's release: [`release_with`] in the caller's
/// transaction. One that a failed statement in the body aborted (SQLSTATE
/// 25P02) runs no more statements, and can only end in a rollback (its
/// `COMMIT` rolls back too), which undoes the reservation: the key is as
/// free as a release leaves it, so the body's own error is what the caller
/// gets, not a store failure.
async fn release_in_transaction(
    conn: &mut sqlx::PgConnection,
    identity: &Identity,
    token: &OwnerToken,
) -> Result<Fenced, StoreError> {
    match release_with(&mut *conn, RELEASE_SQL, identity, token).await {
        Err(e) if failed_in_an_aborted_transaction(&e) => Ok(Fenced::Written),
        Ok(written) => {
            let callers = WrittenIn::CallersTransaction;
            not_owner_unless_the_connection_is_why(conn, "release", identity, written, callers)
                .await
        }
        other => other,
    }
}

/// Transactional mode's lease renewal: [`heartbeat_with`] in the caller's
/// transaction.
async fn heartbeat_in_transaction(
    conn: &mut sqlx::PgConnection,
    identity: &Identity,
    token: &OwnerToken,
    lease: Duration,
) -> Result<Fenced, StoreError> {
    let written = heartbeat_with(&mut *conn, HEARTBEAT_SQL, identity, token, lease).await?;
    let callers = WrittenIn::CallersTransaction;
    not_owner_unless_the_connection_is_why(conn, "heartbeat", identity, written, callers).await
}

/// Transactional mode's completion: [`complete_with`] in the caller's
/// transaction. Recording the body's *error* (`errors = record`) in a
/// transaction a failed statement of the body aborted (25P02) is answered as
/// [`release_in_transaction`] answers: the transaction can only roll back,
/// taking the reservation with it, so the caller gets the body's error, not a
/// store failure. A result (`Ok`) that cannot be recorded there stays a store
/// failure: the caller must not take it for done.
async fn complete_in_transaction(
    conn: &mut sqlx::PgConnection,
    completion: Completion<'_>,
) -> Result<Fenced, StoreError> {
    match complete_with(&mut *conn, COMPLETE_SQL, completion).await {
        Err(e) if completion.outcome.is_error && failed_in_an_aborted_transaction(&e) => {
            Ok(Fenced::Written)
        }
        Ok(written) => {
            let (identity, callers) = (completion.identity, WrittenIn::CallersTransaction);
            not_owner_unless_the_connection_is_why(conn, "complete", identity, written, callers)
                .await
        }
        other => other,
    }
}

/// Whether a waiting duplicate may ask again in this transaction: under READ
/// COMMITTED (PostgreSQL's default) each statement sees what others committed
/// since, and an in-progress answer leaves no row lock (migration 0006), so
/// polling sees the owner finish. Under REPEATABLE READ or SERIALIZABLE the
/// snapshot would answer from the past every time: refused at once instead.
async fn reads_what_others_commit(conn: &mut sqlx::PgConnection) -> Result<bool, StoreError> {
    let row: PgRow = conn
        .fetch_one("SELECT current_setting('transaction_isolation') = 'read committed'")
        .await
        .map_err(err("check the transaction's isolation level"))?;
    row.try_get::<bool, _>(0)
        .map_err(err("check the transaction's isolation level"))
}

/// Whether the connection is in a transaction, as the server sees it, asked
/// with a simple-protocol query: in autocommit that query is its own
/// transaction, which started with it (the two timestamps are equal); inside
/// a transaction (begun by sqlx or by a plain `BEGIN`) it started earlier.
/// Always asked, never taken from sqlx's count of the transactions it began:
/// a `COMMIT` sent as a query ends the server's transaction while sqlx still
/// counts it, and a reservation made then would commit at once.
async fn in_transaction(conn: &mut sqlx::PgConnection) -> Result<bool, StoreError> {
    started_before_this_statement(conn)
        .await
        .map_err(err("check for an open transaction"))
}

// ---------------------------------------------------------------- waiting duplicates

/// The channel the table's trigger notifies on (migration 0004).
const WAIT_CHANNEL: &str = "idempotency_records";
/// The longest a marked waiter sleeps without news before it reserves again:
/// the last resort should a notification be lost without the listener
/// noticing (the listener checks its connection when it has heard nothing
/// for a second while somebody waits, and wakes every waiter when that
/// check fails).
pub const WAIT_SLICE: Duration = Duration::from_secs(5);
/// How long after the listener started a waiter waits for it to be
/// listening (its first connection) before it falls back to polling. After
/// a failed attempt, or a lost connection, waiters poll at once.
const LISTENER_READY_WAIT: Duration = Duration::from_secs(1);
/// The pause between attempts to (re)connect the listener.
const LISTENER_RECONNECT_PAUSE: Duration = Duration::from_millis(500);
/// How long the listener may have heard nothing on its connection, while
/// somebody waits, before it checks that the connection still answers: a
/// half-open TCP connection (a peer or a middlebox gone, a one-way
/// partition) delivers nothing and reports nothing, and the notifications
/// sent meanwhile are lost.
const QUIET_WHILE_WAITED: Duration = Duration::from_secs(1);
/// The same, while nobody waits (keeps an idle connection honest).
const QUIET_WHILE_IDLE: Duration = Duration::from_secs(30);
/// The shortest pause between the checks that keep the listener's
/// connection within the server's `idle_session_timeout` (half of it).
const LEAST_KEEP_ALIVE: Duration = Duration::from_millis(100);
/// How long the check of a quiet connection (`SELECT 1` on it) may take
/// before the connection is given up as silent.
const LISTENER_CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one attempt to connect the listener and `LISTEN` may take.
const LISTENER_CONNECT_TIMEOUT: Duration = ACQUIRE_TIMEOUT.saturating_add(LISTENER_CHECK_TIMEOUT);

/// The payload of the notification sent when a record somebody waits for
/// completes, is released or deleted, or changes owner: a hex SHA-256 over
/// the length-prefixed tenant and scope and the key (the same as the SQL
/// function `idempotency_wait_key`; the identity itself could exceed
/// NOTIFY's payload limit). Lengths count characters, as PostgreSQL's
/// `length(text)` does.
///
/// ```
/// use idempotent_runtime::{store::postgres::wait_key, Identity};
/// let id = Identity::new("acme", "payments.charge", "k-1").unwrap();
/// assert_eq!(wait_key(&id).len(), 64);
/// ```
pub fn wait_key(identity: &Identity) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for part in [&identity.tenant, &identity.scope] {
        hash.update(part.chars().count().to_string());
        hash.update(":");
        hash.update(part);
    }
    hash.update(&identity.key);
    hex::encode(hash.finalize())
}

/// Marks the record as waited for (so its next change notifies) and reports
/// what the mark found. One statement in its own transaction: the `UPDATE`
/// skips a row locked by another transaction (a transactional-mode owner
/// holds it until it commits; waiting for it would hold a pooled connection),
/// and the plain read beside it tells a changed record from a locked one,
/// and a record another waiter has marked already (`waiting`): its next
/// change notifies too, so many waiters on one key, whose marks lock the row
/// in turn, wait for the notification instead of polling. Sent only on a
/// connection outside any transaction ([`mark_waiting`]): in one other code
/// left open, the mark's row lock would stay for as long as the connection
/// sat in the pool.
const MARK_WAITING_SQL: &str = "\
WITH marked AS (
    UPDATE idempotency_records SET waiting = TRUE
     WHERE ctid = (SELECT ctid FROM idempotency_records
                    WHERE tenant = $1 AND scope = $2 AND key = $3 AND state = 'in_progress'
                    FOR NO KEY UPDATE SKIP LOCKED)
    RETURNING idempotency_wait_key(tenant, scope, key) AS wait_key,
              lease_expires_at - idempotency_now_ms() AS lease_remaining_ms)
SELECT m.wait_key, m.lease_remaining_ms, r.state, r.waiting AS seen_waiting,
       CASE WHEN r.waiting THEN idempotency_wait_key(r.tenant, r.scope, r.key) END AS seen_wait_key,
       r.lease_expires_at - idempotency_now_ms() AS seen_remaining_ms
  FROM (SELECT 1) one
  LEFT JOIN marked m ON TRUE
  LEFT JOIN idempotency_records r ON r.tenant = $1 AND r.scope = $2 AND r.key = $3";

/// What marking a record as waited for found.
enum Mark {
    /// Marked: its next change notifies `wait_key`; the lease has this long to run.
    Marked {
        wait_key: String,
        lease_remaining: Duration,
    },
    /// Locked by another transaction, but already marked by another waiter,
    /// committed: its next change notifies `wait_key` (the trigger looks at
    /// the last committed `waiting`; only a completion, a release or a
    /// takeover, the changes waited for, clear it). The lease has this long
    /// to run.
    MarkedBefore {
        wait_key: String,
        lease_remaining: Duration,
    },
    /// The record is complete, gone past its lease (and marked: no other
    /// transaction holds it), or otherwise worth a new reservation right away.
    Changed,
    /// Not marked (absent in this snapshot, e.g. a transactional owner's
    /// uncommitted reservation, or locked by another transaction, also one
    /// whose lease ran out: a takeover holds it): poll.
    Unmarked,
}

/// Marks the record (see [`MARK_WAITING_SQL`]) on a connection outside any
/// transaction: on one left inside a transaction other code began and only
/// read in (no transaction id yet, so the statement's own check passes),
/// the mark was that transaction's first write, and its row lock stayed for
/// as long as the connection sat in the pool: the owner's completion, its
/// renewals and a takeover waited behind it, the key stuck. Such a
/// connection is closed (rolling that transaction back, with a warning) and
/// another taken, as the purge does. One more round trip, on a waiting
/// duplicate's path alone.
async fn mark_waiting(
    pool: &PgPool,
    sql: &str,
    identity: &Identity,
    silent_after: Duration,
) -> Result<Mark, StoreError> {
    const OP: &str = "mark a record as waited for";
    let conn = super::outside_any_transaction::<_, ClosedIfDropped<Postgres>, _>(
        STORE,
        OP,
        pool,
        None,
        super::IfLeftOpen::Close,
        |conn| {
            Box::pin(async move {
                // Bounded as the mark is: a connection gone silent is given
                // up (and closed), the waiter polls.
                let open = started_before_this_statement(conn);
                server::answered_within(silent_after, Duration::ZERO, open)
                    .await
                    .and_then(|answered| answered)
                    .map_err(err("check for an open transaction"))
            })
        },
    )
    .await?;
    mark_on(conn, sql, identity, silent_after)
        .await
        .map_err(err(OP))
}

async fn mark_on(
    mut conn: ClosedIfDropped<Postgres>,
    sql: &str,
    identity: &Identity,
    silent_after: Duration,
) -> Result<Mark, sqlx::Error> {
    // `SKIP LOCKED`: no lock wait.
    let row: Result<PgRow, sqlx::Error> = server::answered_within(
        silent_after,
        Duration::ZERO,
        sqlx::query(sql)
            .bind(&identity.tenant)
            .bind(&identity.scope)
            .bind(&identity.key)
            .fetch_one(&mut *conn),
    )
    .await?;
    // Handed back on an error too (a serialization failure under a
    // REPEATABLE READ default, a statement timeout): the statement answered.
    conn.hand_back();
    let row = row?;
    if let Some(wait_key) = row.try_get::<Option<String>, _>("wait_key")? {
        let remaining: Option<i64> = row.try_get("lease_remaining_ms")?;
        return Ok(match remaining {
            Some(ms) if ms > 0 => Mark::Marked {
                wait_key,
                lease_remaining: millis_to_duration(ms),
            },
            _ => Mark::Changed,
        });
    }
    let state: Option<String> = row.try_get("state")?;
    let seen_remaining: Option<i64> = row.try_get("seen_remaining_ms")?;
    let seen_waiting: Option<bool> = row.try_get("seen_waiting")?;
    let seen_wait_key: Option<String> = row.try_get("seen_wait_key")?;
    Ok(match (state.as_deref(), seen_remaining) {
        (Some("complete"), _) => Mark::Changed,
        (Some(_), None) => Mark::Changed,
        // In progress, its lease run out, yet not marked: the mark skipped a
        // row locked by another transaction, one taking the record over (or
        // deleting it). A transactional-mode takeover holds it until its
        // caller's transaction ends, and a reservation made now would only
        // wait for that lock to answer `InProgress` again: poll at the
        // backoff, as behind an uncommitted reservation, instead of
        // reserving again without a pause for as long as the wait lasts.
        (Some(_), Some(ms)) if ms <= 0 => Mark::Unmarked,
        (Some(_), Some(ms)) if seen_waiting == Some(true) => match seen_wait_key {
            Some(wait_key) => Mark::MarkedBefore {
                wait_key,
                lease_remaining: millis_to_duration(ms),
            },
            None => Mark::Unmarked,
        },
        _ => Mark::Unmarked,
    })
}

/// The pause of a waiter the listener cannot help: the engine's polling
/// backoff (5 ms doubling to 100 ms), within `max_wait`.
fn poll(round: u32, max_wait: Duration) -> tokio::time::Sleep {
    tokio::time::sleep(polling_backoff(round).min(max_wait))
}

/// The store's one `LISTEN` connection and the waiters it wakes.
///
/// The connection lives on a background thread with a runtime of its own
/// (like the worker for dropped calls, `detached.rs`), so it never depends on
/// a caller's runtime, started by the first waiter and stopped when the last
/// handle to the store is dropped. Waiters register by wait key before they
/// mark the record, and the thread wakes those whose key a notification
/// names. A connection that has been quiet for a while is checked (see
/// [`QUIET_WHILE_WAITED`]). When the connection is lost or stops answering,
/// every waiter is woken (a notification may have been lost with it) and
/// reserves again; while there is no listening connection, waiters poll.
struct Watcher {
    shared: std::sync::Arc<WatchShared>,
    state: std::sync::Mutex<WatchState>,
    /// Until when waiters wait for the listener's first connection.
    ready_by: std::sync::OnceLock<tokio::time::Instant>,
}

enum WatchState {
    Idle(Option<Box<PgConnectOptions>>),
    Running(#[allow(dead_code)] tokio::sync::oneshot::Sender<()>),
}

/// What the listener is doing, as waiters see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum ListenerStatus {
    /// Not started, or connecting for the first time: worth waiting for,
    /// briefly ([`LISTENER_READY_WAIT`]).
    #[default]
    Starting,
    /// `LISTEN` is in effect on a connection that answers.
    Listening,
    /// An attempt to connect failed, or the connection was lost or went
    /// silent: waiters poll until it listens again.
    Down,
}

#[derive(Default)]
struct WatchShared {
    /// Waiters per wait key: how many, and the `Notify` they wait on.
    waiters: std::sync::Mutex<HashMap<String, (usize, std::sync::Arc<tokio::sync::Notify>)>>,
    /// Woken when the connection was lost (notifications may have been lost).
    reset: tokio::sync::Notify,
    /// Whether `LISTEN` is in effect on a live connection.
    status: tokio::sync::watch::Sender<ListenerStatus>,
    /// Told when a waiter registers while nobody else waits: a connection
    /// that has been quiet for long is checked at once.
    first_waiter: tokio::sync::Notify,
}

impl WatchShared {
    fn waiters(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, (usize, std::sync::Arc<tokio::sync::Notify>)>>
    {
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("listener", &*self.shared.status.borrow())
            .finish()
    }
}

/// A waiter's registration; unregisters when dropped.
struct Registration {
    shared: std::sync::Arc<WatchShared>,
    key: String,
    notify: std::sync::Arc<tokio::sync::Notify>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut waiters = self.shared.waiters();
        if let Some(entry) = waiters.get_mut(&self.key) {
            entry.0 -= 1;
            if entry.0 == 0 {
                waiters.remove(&self.key);
            }
        }
    }
}

impl Watcher {
    fn new(options: PgConnectOptions) -> Self {
        Watcher {
            shared: std::sync::Arc::new(WatchShared::default()),
            state: std::sync::Mutex::new(WatchState::Idle(Some(Box::new(options)))),
            ready_by: std::sync::OnceLock::new(),
        }
    }

    /// Registers a waiter for `key`, starting the listener thread if needed.
    fn register(&self, key: String) -> Registration {
        self.start();
        let mut waiters = self.shared.waiters();
        if waiters.is_empty() {
            self.shared.first_waiter.notify_one();
        }
        let entry = waiters
            .entry(key.clone())
            .or_insert_with(|| (0, std::sync::Arc::new(tokio::sync::Notify::new())));
        entry.0 += 1;
        Registration {
            shared: self.shared.clone(),
            key,
            notify: entry.1.clone(),
        }
    }

    fn start(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let WatchState::Idle(options) = &mut *state else {
            return;
        };
        let Some(options) = options.take() else {
            return; // could not start before; waiters poll
        };
        let (stop, stopped) = tokio::sync::oneshot::channel();
        match spawn_listener(*options, self.shared.clone(), stopped) {
            Ok(()) => {
                let _ = self
                    .ready_by
                    .set(tokio::time::Instant::now() + LISTENER_READY_WAIT);
                *state = WatchState::Running(stop);
            }
            Err(e) => {
                self.shared.status.send_replace(ListenerStatus::Down);
                tracing::error!(target: "idempotent", store = STORE, error = %e,
                    "could not start the listener thread; waiting duplicates poll");
            }
        }
    }

    /// Whether `LISTEN` is in effect. Waits (at most `within`) only while
    /// the listener makes its first connection, and at most until
    /// [`LISTENER_READY_WAIT`] after it started: once an attempt failed or
    /// a connection was lost, there is no telling when it will listen
    /// again, and the waiter polls at once.
    async fn listening(&self, within: Duration) -> bool {
        let mut status = self.shared.status.subscribe();
        match *status.borrow_and_update() {
            ListenerStatus::Listening => return true,
            ListenerStatus::Down => return false,
            ListenerStatus::Starting => {}
        }
        let now = tokio::time::Instant::now();
        let ready_by = self
            .ready_by
            .get()
            .copied()
            .unwrap_or(now + LISTENER_READY_WAIT);
        let within = within.min(ready_by.saturating_duration_since(now));
        let settled = async move {
            status
                .wait_for(|s| *s != ListenerStatus::Starting)
                .await
                .is_ok_and(|s| *s == ListenerStatus::Listening)
        };
        matches!(tokio::time::timeout(within, settled).await, Ok(true))
    }
}

fn spawn_listener(
    options: PgConnectOptions,
    shared: std::sync::Arc<WatchShared>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    detached::spawn_with_runtime(format!("idempotent-{STORE}-listener"), async move {
        tokio::select! {
            _ = &mut stopped => {}
            _ = listen(options, &shared) => {}
        }
        shared.status.send_replace(ListenerStatus::Down);
        shared.reset.notify_waiters();
    })
}

/// Listens until the thread is stopped, reconnecting when the connection
/// fails or goes silent. An outage (attempts that fail, a connection lost
/// or silent until the next one listens) is logged once, as a warning, and
/// its end as information.
async fn listen(options: PgConnectOptions, shared: &WatchShared) {
    // Whether the current outage was logged.
    let mut in_outage = false;
    let mut failed_attempts = 0u64;
    loop {
        // A pool of its own for each connection (one connection, on this
        // thread's runtime), used by `PgListener` to reconnect. Not one pool
        // for all: a listener given up as silent is dropped, and its drop
        // sends `UNLISTEN` on the silent connection in a task that returns
        // the connection to its pool only when that ends (when the kernel
        // gives the connection up), which would keep the next connection
        // from being made.
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .max_lifetime(None)
            .idle_timeout(None)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy_with(options.clone());
        let connected = tokio::time::timeout(LISTENER_CONNECT_TIMEOUT, connect_listener(&pool));
        let (mut listener, idle_limit) = match connected.await {
            Ok(Ok(connected)) => connected,
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {LISTENER_CONNECT_TIMEOUT:?}"),
                };
                failed_attempts += 1;
                shared.status.send_replace(ListenerStatus::Down);
                if in_outage {
                    tracing::debug!(target: "idempotent", store = STORE, error = %error,
                        "the listener for waiting duplicates still cannot connect");
                } else {
                    in_outage = true;
                    tracing::warn!(target: "idempotent", store = STORE, error = %error,
                        "the listener for waiting duplicates could not connect; they poll \
                         until it does (retrying every {LISTENER_RECONNECT_PAUSE:?})");
                }
                tokio::time::sleep(LISTENER_RECONNECT_PAUSE).await;
                continue;
            }
        };
        if in_outage {
            tracing::info!(target: "idempotent", store = STORE, failed_attempts,
                "the listener for waiting duplicates listens again");
        }
        failed_attempts = 0;
        shared.status.send_replace(ListenerStatus::Listening);
        let why = deliver(&mut listener, shared, idle_limit).await;
        // Not listening from here on: waiters poll, and those asleep on the
        // listener are woken (their notification may be lost) to look again.
        shared.status.send_replace(ListenerStatus::Down);
        shared.reset.notify_waiters();
        in_outage = true;
        tracing::warn!(target: "idempotent", store = STORE, reason = %why,
            "the listener for waiting duplicates lost its connection; they poll until it \
             reconnects");
        drop(listener);
        tokio::time::sleep(LISTENER_RECONNECT_PAUSE).await;
    }
}

/// What the listener's loop waits for next.
enum Heard {
    Received(Result<Option<sqlx::postgres::PgNotification>, sqlx::Error>),
    Quiet,
    FirstWaiter,
}

/// Wakes the waiters each notification names, until the connection fails
/// or goes silent; says why it stopped. A connection quiet for
/// [`QUIET_WHILE_WAITED`] while somebody waits (else [`QUIET_WHILE_IDLE`])
/// is checked with a `SELECT 1`, which must answer within
/// [`LISTENER_CHECK_TIMEOUT`]: a half-open connection reports no error and
/// delivers nothing. A healthy listener that hears notifications sends
/// nothing, except within the server's `idle_session_timeout`
/// (`idle_limit`): a session that sent no statement for that long is ended
/// by the server (notifications it receives do not count), so the check is
/// also made at half that limit after the last statement.
async fn deliver(
    listener: &mut sqlx::postgres::PgListener,
    shared: &WatchShared,
    idle_limit: Option<Duration>,
) -> String {
    let keep_alive = idle_limit.map(|limit| (limit / 2).max(LEAST_KEEP_ALIVE));
    let mut heard = tokio::time::Instant::now();
    let mut spoke = heard;
    loop {
        let quiet = if shared.waiters().is_empty() {
            QUIET_WHILE_IDLE
        } else {
            QUIET_WHILE_WAITED
        };
        let check_at = match keep_alive {
            Some(keep_alive) => (heard + quiet).min(spoke + keep_alive),
            None => heard + quiet,
        };
        // `try_recv` is cancel-safe while it waits for a message (sqlx reads
        // a message into its buffer whole or not at all).
        let next = tokio::select! {
            received = listener.try_recv() => Heard::Received(received),
            () = tokio::time::sleep_until(check_at) => Heard::Quiet,
            () = shared.first_waiter.notified() => Heard::FirstWaiter,
        };
        match next {
            Heard::Received(Ok(Some(notification))) => {
                heard = tokio::time::Instant::now();
                if let Some((_, notify)) = shared.waiters().get(notification.payload()) {
                    notify.notify_waiters();
                }
            }
            // The connection was lost (`PgListener` does not reconnect by
            // itself here: a reconnection is made, bounded, by `listen`).
            Heard::Received(Ok(None)) => return "the connection was closed".to_owned(),
            Heard::Received(Err(e)) => return e.to_string(),
            Heard::Quiet => {
                // Notifications that arrive meanwhile are buffered by the
                // listener and delivered by the next `try_recv`.
                let check = listener.execute("SELECT 1");
                match tokio::time::timeout(LISTENER_CHECK_TIMEOUT, check).await {
                    Ok(Ok(_)) => {
                        heard = tokio::time::Instant::now();
                        spoke = heard;
                    }
                    Ok(Err(e)) => return format!("checking a quiet connection: {e}"),
                    Err(_) => {
                        return format!(
                            "the connection went silent (quiet for {quiet:?}, then no answer \
                             to a check within {LISTENER_CHECK_TIMEOUT:?})"
                        )
                    }
                }
            }
            // Look at the deadline again: now somebody waits.
            Heard::FirstWaiter => {}
        }
    }
}

/// Connects the listener and `LISTEN`s; answers it with the session's
/// `idle_session_timeout` (PostgreSQL 14 and later; `None` when it is off or
/// unknown), which [`deliver`] keeps the connection within.
async fn connect_listener(
    pool: &PgPool,
) -> Result<(sqlx::postgres::PgListener, Option<Duration>), sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.ignore_pool_close_event(true);
    // A lost connection ends `try_recv` with `Ok(None)`, and `listen` makes
    // the next one, with a bound on how long that may take (a reconnection
    // inside `try_recv` has none).
    listener.eager_reconnect(false);
    listener.listen(WAIT_CHANNEL).await?;
    // In milliseconds; no row before PostgreSQL 14. Not knowing it (a
    // server that does not answer this) is not a reason not to listen: a
    // lost connection is found by `deliver`.
    let idle_limit: Option<String> = sqlx::query_scalar(
        "SELECT setting FROM pg_catalog.pg_settings WHERE name = 'idle_session_timeout'",
    )
    .fetch_optional(&mut listener)
    .await
    .ok()
    .flatten();
    let idle_limit = idle_limit
        .and_then(|ms| ms.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis);
    Ok((listener, idle_limit))
}

impl PgStore {
    /// [`Store::wait_for_change`] with `LISTEN/NOTIFY`: register, make sure
    /// the listener listens, mark the record (the re-check that decides to
    /// wait: a record that changed before the mark is answered at once), then
    /// wait for its notification, at most `max_wait`, the lease's end or
    /// [`WAIT_SLICE`]. Registration comes before the mark, so a change right
    /// after the mark is never missed.
    async fn wait_with_listener(&self, identity: &Identity, max_wait: Duration, round: u32) {
        let started = tokio::time::Instant::now();
        let key = wait_key(identity);
        let registration = self.watcher.register(key.clone());
        let changed = registration.notify.notified();
        let reset = self.watcher.shared.reset.notified();
        tokio::pin!(changed, reset);
        changed.as_mut().enable();
        reset.as_mut().enable();
        if !self.watcher.listening(max_wait).await {
            let left = max_wait.saturating_sub(started.elapsed());
            return poll(round, left).await;
        }
        let left = max_wait.saturating_sub(started.elapsed());
        let wait = match mark_waiting(
            &self.pools.current(),
            &self.statements.mark_waiting,
            identity,
            self.silent_after,
        )
        .await
        {
            Ok(Mark::Marked {
                wait_key,
                lease_remaining,
            }) if wait_key == key => left.min(lease_remaining).min(WAIT_SLICE),
            Ok(Mark::MarkedBefore {
                wait_key,
                lease_remaining,
            }) if wait_key == key => left.min(lease_remaining).min(WAIT_SLICE),
            Ok(Mark::Marked { .. } | Mark::MarkedBefore { .. }) => {
                tracing::error!(target: "idempotent", store = STORE,
                    "idempotency_wait_key in the database disagrees with this build's wait key; \
                     waiting duplicates poll (check the migrations; or the database's encoding: \
                     in a SQL_ASCII database, tenants, scopes and keys that are not ASCII are \
                     measured in bytes, and their waiters are never notified)");
                return poll(round, left).await;
            }
            Ok(Mark::Changed) => return,
            Ok(Mark::Unmarked) => return poll(round, left).await,
            Err(e) => {
                tracing::debug!(target: "idempotent", store = STORE, error = %e,
                    "could not mark a record as waited for; polling");
                return poll(round, left).await;
            }
        };
        tokio::select! {
            _ = &mut changed => {}
            _ = &mut reset => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pauses between tries after serialization failures grow from
    /// about a millisecond, stay between half and all of their step, never
    /// pass 100 ms, and all of a write's tries together pause for about half
    /// a second at most: long enough for the conflicting transactions to
    /// end, short beside a lease.
    #[test]
    fn pauses_after_serialization_failures_grow_jittered_and_bounded() {
        for failures in 1..=40 {
            let step = Duration::from_millis((2u64 << (failures - 1).min(6)).min(100));
            for _ in 0..50 {
                let pause = serialization_failure_pause(failures);
                assert!(
                    pause >= step / 2 && pause <= step,
                    "after {failures} failures: {pause:?} not within {step:?}"
                );
            }
        }
        assert!(serialization_failure_pause(1) <= Duration::from_millis(2));
        let longest: Duration = (1..FENCED_WRITE_TRIES)
            .map(|failures| Duration::from_millis((2u64 << (failures - 1).min(6)).min(100)))
            .sum();
        assert!(longest <= Duration::from_millis(500), "{longest:?} in all");
        const { assert!(SERIALIZATION_FAILURE_TRIES >= 8) };
    }

    /// The migrations a store re-runs after a schema rename are the last
    /// ones to create the store's functions: a migration after 0009 that
    /// re-creates one is listed, or the re-run would bring back an older text.
    #[test]
    fn the_migrations_rerun_after_a_rename_are_the_last_to_make_the_functions() {
        let first = SCHEMA_NAMING_MIGRATIONS[0];
        let makes_functions: Vec<i64> = migrate::POSTGRES
            .iter()
            .filter(|m| m.version >= first && m.sql.contains("CREATE OR REPLACE FUNCTION"))
            .map(|m| m.version)
            .collect();
        for version in makes_functions {
            assert!(
                SCHEMA_NAMING_MIGRATIONS.contains(&version),
                "migration {version} re-creates store functions: add it to \
                 SCHEMA_NAMING_MIGRATIONS (and pin or qualify its functions' schema)"
            );
        }
        assert!(SCHEMA_NAMING_MIGRATIONS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn comments_in_ascii_changes_comment_lines_alone() {
        let sql = "-- an INSERT \u{2026} here\nSELECT 'caf\u{e9}'; -- caf\u{e9}\n  -- \u{e9}";
        assert_eq!(
            comments_in_ascii(sql),
            "-- an INSERT ? here\nSELECT 'caf\u{e9}'; -- caf\u{e9}\n  -- ?"
        );
        assert!(matches!(
            comments_in_ascii("SELECT 1 -- plain"),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn qualified_names_every_table_and_function_of_the_store_in_its_schema() {
        let sql = "SELECT idempotency_now_ms(), x FROM idempotency_records r \
                   JOIN idempotency_reserve_core($1) f ON TRUE";
        assert_eq!(
            qualified(sql, "app"),
            "SELECT \"app\".idempotency_now_ms(), x FROM \"app\".idempotency_records r \
             JOIN \"app\".idempotency_reserve_core($1) f ON TRUE"
        );
        assert_eq!(
            qualified(
                "SELECT 'x', IDEMPOTENCY_RECORDS.key, $1 FROM IDEMPOTENCY_RECORDS -- n\nWHERE idempotency_now_ms() > 0",
                "app"
            ),
            "SELECT 'x', \"app\".IDEMPOTENCY_RECORDS.key, $1 FROM \"app\".IDEMPOTENCY_RECORDS -- n\nWHERE \"app\".idempotency_now_ms() > 0",
            "in any case, between literals and comments"
        );
        assert_eq!(
            qualified("idempotency_records", "we\"ird"),
            "\"we\"\"ird\".idempotency_records",
            "the schema is quoted as an identifier, at the start of the text too"
        );
    }

    #[test]
    fn qualified_leaves_other_names_and_literals_alone() {
        for sql in [
            "SELECT public.idempotency_records",
            "SELECT 'idempotency_records'",
            "SELECT \"idempotency_records\"",
            "SELECT my_idempotency_records, x_idempotency_now_ms()",
            "SELECT $$idempotency_x$$",
            "SELECT 'see idempotency_records', \"a idempotency_x\"",
            "SELECT E'it\\'s idempotency_records'",
            "SELECT 'it''s idempotency_records'",
            "SELECT 1 -- idempotency_records\n",
            "SELECT /* a /* idempotency_records */ idempotency_x */ 1",
            "SELECT $f$ idempotency_x $f$, $$ idempotency_x $$",
        ] {
            assert_eq!(qualified(sql, "app"), sql);
        }
    }

    #[test]
    fn every_statement_through_the_shared_pool_names_its_schema() {
        let statements = Statements::in_schema("app");
        // Each named once; the pattern is exhaustive, so a statement added to
        // `Statements` and not named here does not compile.
        macro_rules! every {
            ($($name:ident),+) => {{
                let Statements { $($name),+ } = &statements;
                [$($name),+]
            }};
        }
        let every = every!(
            reserve,
            reserve_autocommit,
            complete,
            heartbeat,
            release,
            force_release,
            purge,
            fetch,
            scope_stats,
            mark_waiting
        );
        for sql in every {
            let named = sql.matches("idempotency_").count();
            assert!(named > 0, "{sql}");
            assert_eq!(sql.matches("\"app\".idempotency_").count(), named, "{sql}");
        }
    }
}
