//! One migration runner for the SQL stores.
//!
//! Every SQL store ships its migrations embedded (`migrations/<backend>`) and
//! applies the ones a database has not seen when it opens, recording them in
//! one history table, [`HISTORY_TABLE`], with the same columns everywhere:
//! version, description, checksum (SHA-384 of the file, as sqlx computes it)
//! and when it was applied. A migration recorded with another checksum stops
//! the store from opening ([`MigrationError::Changed`]): the database was set
//! up by code this version does not match.
//!
//! The runner holds the backend's migration lock from before it reads the
//! history until after the last migration is recorded, so several processes
//! opening one brand-new database at once apply each migration once. (The
//! history is read first without it, and the lock is taken only when
//! something is pending: see `MigrationBackend::applied_without_lock`.) What
//! differs per backend is behind `MigrationBackend`: PostgreSQL applies them
//! in one transaction under a transaction-level advisory lock, MySQL/MariaDB
//! (whose DDL is not transactional) under `GET_LOCK`, statement by statement
//! (split on `-- @@statement` lines), SQLite in one `BEGIN IMMEDIATE`
//! transaction. Every lock is waited for at most [`LOCK_TIMEOUT`].

use sha2::{Digest, Sha384};
use std::time::Duration;

/// The table every SQL store records its applied migrations in. Not
/// `_sqlx_migrations`, so a database shared with an application's own sqlx
/// migrations keeps the two histories apart.
pub const HISTORY_TABLE: &str = "idempotency_schema_migrations";

/// The longest a store waits for another process to finish migrating.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(60);

/// Why the migrations could not be applied (or, opened to look, why the
/// database's schema is not this build's).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// A migration this version ships was recorded with other contents.
    #[error(
        "idempotency migration {version} ({description}) was changed after it was applied \
         (this database holds it with different contents): the database was set up by a build \
         of idempotent-runtime whose migration {version} differs from this one's (released \
         versions never change a migration: a development build?); open it with that build. \
         Do not point the service at a new, empty database instead: the records there are \
         what keeps retries from running their bodies again"
    )]
    Changed {
        /// The migration's version number.
        version: i64,
        /// The migration's description (from its file name).
        description: String,
    },
    /// Another process held the migration lock for longer than [`LOCK_TIMEOUT`].
    #[error(
        "timed out after 60 s waiting for another process to finish the idempotency migrations; \
         check for a process stuck while opening the store, then retry"
    )]
    LockTimeout,
    /// The database's history lacks a migration this build ships, and the
    /// store was opened to look, not to migrate (the command line).
    #[error(
        "idempotency migration {version} ({description}) is not applied to this database, and \
         this open never applies one"
    )]
    NotApplied {
        /// The first migration the history lacks.
        version: i64,
        /// What it does.
        description: String,
    },
    /// The database has no migration history table, and the store was
    /// opened to look, not to migrate (the command line).
    #[error(
        "the database has no idempotency migration history ({HISTORY_TABLE}): it was set up by an \
         older version; open it with the application first"
    )]
    NoHistory,
    /// The database refused a statement.
    #[error("{0}")]
    Database(#[from] sqlx::Error),
}

tokio::task_local! {
    /// Set around a store's open that must look and never migrate.
    static ONLY_CHECK: ();
}

/// Runs `open` (a store's `connect`) so that its migrations are checked and
/// never applied: a history lacking one is
/// [`MigrationError::NotApplied`], a missing one
/// [`MigrationError::NoHistory`] (one that cannot be read, the database's
/// error), and nothing is written (SQLite's
/// switch to WAL is skipped too). For the command line, which never changes
/// a schema.
#[cfg(feature = "cli")]
pub(crate) async fn only_checking<F: std::future::Future>(open: F) -> F::Output {
    ONLY_CHECK.scope((), open).await
}

/// The migration step's name in a store's errors: "check migrations" when
/// the open only checks them, else "apply migrations".
pub(crate) fn operation() -> &'static str {
    if only_check() {
        "check migrations"
    } else {
        "apply migrations"
    }
}

/// Whether the store being opened must only check its migrations.
pub(crate) fn only_check() -> bool {
    ONLY_CHECK.try_with(|_| ()).is_ok()
}

/// One migration a store ships: its file under `migrations/<backend>/`,
/// embedded when the crate compiles (see [`embedded_migrations!`]). The file
/// is named `<version>_<description>.sql`, as sqlx's migrator named them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Migration {
    /// The number the file name starts with ([`version_of`]).
    pub version: i64,
    /// The file's name.
    pub file: &'static str,
    /// The file's contents.
    pub sql: &'static str,
}

impl Migration {
    /// SHA-384 of the file's contents: what the history table records, the
    /// same bytes sqlx's migrator computed for the versions that used it.
    pub fn checksum(&self) -> Vec<u8> {
        Sha384::digest(self.sql.as_bytes()).to_vec()
    }

    /// What the migration does: the file name after its version's `_`,
    /// without `.sql`, `_` read as a space (as sqlx's migrator read it).
    pub fn description(&self) -> String {
        let rest = self
            .file
            .split_once('_')
            .map_or(self.file, |(_, rest)| rest);
        rest.trim_end_matches(".sql").replace('_', " ")
    }
}

/// The version a migration's file name starts with: its digits before the
/// first `_`. Evaluated when the crate compiles; a name without them does
/// not compile.
pub(crate) const fn version_of(file: &str) -> i64 {
    let name = file.as_bytes();
    let mut at = 0;
    let mut version = 0;
    while at < name.len() && name[at] != b'_' {
        assert!(
            name[at].is_ascii_digit(),
            "a migration's file name starts with its version"
        );
        version = version * 10 + (name[at] - b'0') as i64;
        at += 1;
    }
    assert!(
        at > 0 && at < name.len(),
        "a migration's file name is <version>_<description>.sql"
    );
    version
}

/// The migrations of one backend, in version order: the names of their
/// files under `migrations/<dir>/`, each file embedded with `include_str!`,
/// its version read from its name ([`version_of`]). A unit test checks every
/// list against its directory (a file not listed, or a list out of order,
/// fails it).
macro_rules! embedded_migrations {
    ($dir:literal: $($file:literal),+ $(,)?) => {
        &[$($crate::store::migrate::Migration {
            version: $crate::store::migrate::version_of($file),
            file: $file,
            sql: include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/", $dir, "/", $file)),
        }),+]
    };
}

/// PostgreSQL's migrations (`migrations/postgres`).
#[cfg(feature = "postgres")]
pub(crate) static POSTGRES: &[Migration] = embedded_migrations!("postgres":
    "0001_idempotency_records.sql",
    "0002_reserve_autocommit.sql",
    "0003_attempts.sql",
    "0004_one_reservation_body_and_waiters.sql",
    "0005_wake_on_ended_lease.sql",
    "0006_tx_answers_keep_no_lock.sql",
    "0007_tx_stale_snapshot_is_an_answer.sql",
    "0008_store_reads_before_it_writes.sql",
    "0009_functions_keep_to_their_schema.sql",
    "0010_acquire_refuses_text_the_server_would_convert.sql",
    "0011_records_know_their_database.sql",
);

/// MySQL/MariaDB's migrations (`migrations/mysql`).
#[cfg(feature = "mysql")]
pub(crate) static MYSQL: &[Migration] = embedded_migrations!("mysql":
    "0001_idempotency_records.sql",
    "0002_reserve_fenced.sql",
    "0003_purge_skip_locked.sql",
    "0004_attempts.sql",
    "0005_one_reserve_body.sql",
    "0006_lock_name_per_database.sql",
    "0007_purge_through_the_expiry_index.sql",
    "0008_tx_never_takes_over_a_lease_it_may_have_starved.sql",
    "0009_tx_waits_for_rows_in_slices_so_deadlocks_are_found.sql",
    "0010_tx_reads_keep_the_wait_bound_under_serializable.sql",
    "0011_purge_deletes_its_rows_by_primary_key.sql",
    "0012_replace_writes_its_record_by_primary_key.sql",
    "0013_tx_takes_over_only_the_version_it_read.sql",
    "0014_tx_never_takes_over_a_version_it_locked.sql",
    "0015_tx_judges_by_its_own_transaction_not_an_ended_one.sql",
    "0016_records_know_their_database.sql",
);

/// SQLite's migrations (`migrations/sqlite`).
#[cfg(feature = "sqlite")]
pub(crate) static SQLITE: &[Migration] = embedded_migrations!("sqlite":
    "0001_idempotency_records.sql",
    "0002_attempts.sql",
    "0003_records_know_their_database.sql",
);

/// What the runner needs from one backend, on one connection held for the
/// whole run.
#[async_trait::async_trait]
pub(crate) trait MigrationBackend: Send {
    /// Takes the migration lock, waiting at most [`LOCK_TIMEOUT`].
    async fn lock(&mut self) -> Result<(), MigrationError>;
    /// Creates [`HISTORY_TABLE`] when missing.
    async fn create_history(&mut self) -> Result<(), sqlx::Error>;
    /// The (version, checksum) pairs recorded in [`HISTORY_TABLE`].
    async fn applied(&mut self) -> Result<Vec<(i64, Vec<u8>)>, sqlx::Error>;
    /// Runs one migration's SQL.
    async fn execute(&mut self, sql: &str) -> Result<(), sqlx::Error>;
    /// Records `migration` as applied (see [`record_on`]).
    async fn record(&mut self, migration: &Migration) -> Result<(), sqlx::Error>;
    /// Lets go of the lock: commits what was done when `done`, otherwise
    /// rolls back what can be rolled back.
    async fn unlock(&mut self, done: bool) -> Result<(), sqlx::Error>;
    /// The history, read *without* the migration lock; `Ok(None)` when
    /// there is no history table (the default: the backend cannot read it
    /// so), an error when it could not be read. A database found up to date is
    /// neither locked nor changed: opening it takes no lock others wait for
    /// (SQLite's is the database's only write lock, which an application
    /// transaction that writes holds) and runs no DDL (a read-only session,
    /// a read-only user or a standby opens it, as the command line's
    /// `audit` and `inspect` need). One with anything pending (or no
    /// history yet) is migrated under the lock.
    async fn applied_without_lock(&mut self) -> Result<Option<Vec<(i64, Vec<u8>)>>, sqlx::Error> {
        Ok(None)
    }
}

/// A migration run inside one transaction (PostgreSQL, SQLite): the run's
/// statements go to its connection, and [`finish`](Self::finish) commits
/// it, or rolls back everything the run did.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) struct OneTransaction<DB: sqlx::Database>(Option<sqlx::Transaction<'static, DB>>);

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl<DB> OneTransaction<DB>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    /// The run's transaction, once it is begun.
    pub fn new(tx: Option<sqlx::Transaction<'static, DB>>) -> Self {
        OneTransaction(tx)
    }

    /// The transaction's connection; an error before it is begun or after
    /// it is finished.
    pub fn connection(&mut self) -> Result<&mut DB::Connection, sqlx::Error> {
        self.0.as_deref_mut().ok_or(sqlx::Error::PoolClosed)
    }

    /// The (version, checksum) pairs recorded in [`HISTORY_TABLE`].
    pub async fn applied(&mut self) -> Result<Vec<(i64, Vec<u8>)>, sqlx::Error>
    where
        for<'r> (i64, Vec<u8>): sqlx::FromRow<'r, DB::Row>,
        for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    {
        applied_on(self.connection()?).await
    }

    /// Runs one migration's SQL, all its statements at once.
    pub async fn execute(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        // Through the `Executor` trait, not `RawSql::execute`, whose future is
        // not `Send` for every lifetime (and would make `connect` unspawnable).
        sqlx::Executor::execute(self.connection()?, sqlx::raw_sql(sql))
            .await
            .map(drop)
    }

    /// Commits the run when `done`, otherwise rolls it back.
    pub async fn finish(&mut self, done: bool) -> Result<(), sqlx::Error> {
        match self.0.take() {
            Some(tx) if done => tx.commit().await,
            Some(tx) => tx.rollback().await,
            None => Ok(()),
        }
    }
}

/// The (version, checksum) pairs recorded in [`HISTORY_TABLE`], read on
/// `executor` (a transaction's connection, or a pool for a read without the
/// lock).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) async fn applied_on<'c, DB, E>(executor: E) -> Result<Vec<(i64, Vec<u8>)>, sqlx::Error>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'r> (i64, Vec<u8>): sqlx::FromRow<'r, DB::Row>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    sqlx::query_as("SELECT version, checksum FROM idempotency_schema_migrations")
        .fetch_all(executor)
        .await
}

/// Records `migration` in [`HISTORY_TABLE`] on `executor` with `insert`, the
/// backend's `INSERT` of its version, description and checksum (bound in
/// that order).
pub(crate) async fn record_on<'c, DB, E>(
    executor: E,
    insert: &str,
    migration: &Migration,
) -> Result<(), sqlx::Error>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> Vec<u8>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(insert)
        .bind(migration.version)
        .bind(migration.description())
        .bind(migration.checksum())
        .execute(executor)
        .await
        .map(drop)
}

/// Applies the `migrations` that the database has not seen, under
/// `backend`'s lock.
pub(crate) async fn run(
    backend: &mut impl MigrationBackend,
    migrations: &[Migration],
) -> Result<(), MigrationError> {
    let unlocked = backend.applied_without_lock().await;
    if only_check() {
        // A history that could not be read says why (no right to read it:
        // the database's own error).
        let applied = unlocked?.ok_or(MigrationError::NoHistory)?;
        return match pending(&applied, migrations)?.first() {
            None => Ok(()),
            Some(m) => Err(MigrationError::NotApplied {
                version: m.version,
                description: m.description(),
            }),
        };
    }
    if let Ok(Some(applied)) = unlocked
        && pending(&applied, migrations)?.is_empty()
    {
        return Ok(());
    }
    backend.lock().await?;
    let result = apply_pending(backend, migrations).await;
    let unlocked = backend.unlock(result.is_ok()).await;
    result?;
    Ok(unlocked?)
}

async fn apply_pending(
    backend: &mut impl MigrationBackend,
    migrations: &[Migration],
) -> Result<(), MigrationError> {
    backend.create_history().await?;
    let applied = backend.applied().await?;
    for m in pending(&applied, migrations)? {
        backend.execute(m.sql).await?;
        backend.record(m).await?;
    }
    Ok(())
}

/// The `migrations` not in the history `applied`, in order; an error when
/// one that is there was recorded with other contents.
pub(crate) fn pending<'m>(
    applied: &[(i64, Vec<u8>)],
    migrations: &'m [Migration],
) -> Result<Vec<&'m Migration>, MigrationError> {
    let mut pending = Vec::new();
    for m in migrations {
        match applied.iter().find(|(v, _)| *v == m.version) {
            Some((_, sum)) if sum[..] == m.checksum()[..] => {}
            Some(_) => {
                return Err(MigrationError::Changed {
                    version: m.version,
                    description: m.description(),
                })
            }
            None => pending.push(m),
        }
    }
    Ok(pending)
}

#[cfg(test)]
mod tests {
    use super::Migration;
    use std::path::Path;

    /// sqlx's migrator made the version of a file name of the number before
    /// its first `_`, and the description of the rest without `.sql`, `_`
    /// read as a space.
    #[test]
    fn version_and_description_follow_from_the_file_name() {
        let m = Migration {
            version: super::version_of("0012_replace_writes_its_record.sql"),
            file: "0012_replace_writes_its_record.sql",
            sql: "",
        };
        assert_eq!(m.version, 12);
        assert_eq!(m.description(), "replace writes its record");
    }

    fn check(dir: &str, listed: &[Migration]) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("migrations")
            .join(dir);
        let mut files: Vec<(String, String)> = std::fs::read_dir(&path)
            .expect("the migrations directory")
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "sql"))
            .map(|p| {
                let name = p
                    .file_name()
                    .expect("a file name")
                    .to_string_lossy()
                    .into_owned();
                let sql = std::fs::read_to_string(&p).expect("a readable migration");
                (name, sql)
            })
            .collect();
        files.sort_by_key(|(name, _)| super::version_of(name));
        let listed: Vec<(String, String)> = listed
            .iter()
            .map(|m| (m.file.to_owned(), m.sql.to_owned()))
            .collect();
        assert_eq!(
            listed, files,
            "migrations/{dir}: the embedded list and the files differ"
        );
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn the_postgres_list_is_the_directory() {
        check("postgres", super::POSTGRES);
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn the_mysql_list_is_the_directory() {
        check("mysql", super::MYSQL);
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn the_sqlite_list_is_the_directory() {
        check("sqlite", super::SQLITE);
    }

    /// That `listed` records `recorded` in its backend's history table, one
    /// row (version, description) per migration: the rows databases already
    /// migrated hold, by sqlx's migrator or by this runner, written out. A
    /// file renamed, or
    /// a version or description read differently from a name, fails it.
    fn assert_records(listed: &[Migration], recorded: &[(i64, &str)]) {
        let rows: Vec<(i64, String)> = listed
            .iter()
            .map(|m| (m.version, m.description()))
            .collect();
        let recorded: Vec<(i64, String)> = recorded
            .iter()
            .map(|(v, d)| (*v, (*d).to_owned()))
            .collect();
        assert_eq!(rows, recorded);
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn the_postgres_history_rows_are_the_ones_recorded() {
        let recorded: &[(i64, &str)] = &[
            (1, "idempotency records"),
            (2, "reserve autocommit"),
            (3, "attempts"),
            (4, "one reservation body and waiters"),
            (5, "wake on ended lease"),
            (6, "tx answers keep no lock"),
            (7, "tx stale snapshot is an answer"),
            (8, "store reads before it writes"),
            (9, "functions keep to their schema"),
            (10, "acquire refuses text the server would convert"),
            (11, "records know their database"),
        ];
        assert_records(super::POSTGRES, recorded);
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn the_mysql_history_rows_are_the_ones_recorded() {
        let recorded: &[(i64, &str)] = &[
            (1, "idempotency records"),
            (2, "reserve fenced"),
            (3, "purge skip locked"),
            (4, "attempts"),
            (5, "one reserve body"),
            (6, "lock name per database"),
            (7, "purge through the expiry index"),
            (8, "tx never takes over a lease it may have starved"),
            (9, "tx waits for rows in slices so deadlocks are found"),
            (10, "tx reads keep the wait bound under serializable"),
            (11, "purge deletes its rows by primary key"),
            (12, "replace writes its record by primary key"),
            (13, "tx takes over only the version it read"),
            (14, "tx never takes over a version it locked"),
            (15, "tx judges by its own transaction not an ended one"),
            (16, "records know their database"),
        ];
        assert_records(super::MYSQL, recorded);
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn the_sqlite_history_rows_are_the_ones_recorded() {
        let recorded: &[(i64, &str)] = &[
            (1, "idempotency records"),
            (2, "attempts"),
            (3, "records know their database"),
        ];
        assert_records(super::SQLITE, recorded);
    }

    /// The checksum of a migration is SHA-384 of its text: the bytes sqlx's
    /// migrator recorded, so databases migrated by older versions still open.
    #[test]
    fn the_checksum_is_sha384_of_the_text() {
        let m = Migration {
            version: 1,
            file: "0001_x.sql",
            sql: "SELECT 1;\n",
        };
        assert_eq!(
            hex::encode(m.checksum()),
            "24454095d8d7876ca8e842f34296ca645c83e0f7b50f048c99db4b2ff4da659267afc4ef3e994f3d74e18c741165d931"
        );
    }

    /// A database a newer build migrated holds versions this build does not
    /// know: it opens (those migrations only add), so an instance of this
    /// build goes on working beside newer ones in a rolling deploy, and after
    /// a rollback. Only a known version with other contents is refused.
    #[test]
    fn versions_this_build_does_not_know_are_left_alone() {
        let known = [
            Migration {
                version: 1,
                file: "0001_one.sql",
                sql: "SELECT 1;",
            },
            Migration {
                version: 2,
                file: "0002_two.sql",
                sql: "SELECT 2;",
            },
        ];
        let newer = vec![
            (1, known[0].checksum()),
            (2, known[1].checksum()),
            (3, b"a newer build's".to_vec()),
        ];
        assert!(super::pending(&newer, &known).expect("opens").is_empty());
        let half = vec![(1, known[0].checksum()), (3, b"x".to_vec())];
        let pending = super::pending(&half, &known).expect("opens");
        assert_eq!(pending.iter().map(|m| m.version).collect::<Vec<_>>(), [2]);
        let changed = vec![(1, b"other contents".to_vec())];
        assert!(super::pending(&changed, &known).is_err());
    }
}
