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
//! opening one brand-new database at once apply each migration once. What
//! differs per backend is behind [`MigrationBackend`]: PostgreSQL applies them
//! in one transaction under a transaction-level advisory lock, MySQL/MariaDB
//! (whose DDL is not transactional) under `GET_LOCK`, statement by statement
//! (split on `-- @@statement` lines), SQLite in one `BEGIN IMMEDIATE`
//! transaction. Every lock is waited for at most [`LOCK_TIMEOUT`].

use std::time::Duration;

/// The table every SQL store records its applied migrations in. Not
/// `_sqlx_migrations`, so a database shared with an application's own sqlx
/// migrations keeps the two histories apart.
pub const HISTORY_TABLE: &str = "idempotency_schema_migrations";

/// The longest a store waits for another process to finish migrating.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(60);

/// Why the migrations could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// A migration this version ships was recorded with other contents.
    #[error(
        "idempotency migration {version} ({description}) was changed after it was applied \
         (this database holds it with different contents): the database was set up by an \
         incompatible version of idempotent-runtime; open it with that version, or use a new database"
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
    /// The database refused a statement.
    #[error("{0}")]
    Database(#[from] sqlx::Error),
}

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
    /// Records one migration as applied.
    async fn record(
        &mut self,
        version: i64,
        description: &str,
        checksum: &[u8],
    ) -> Result<(), sqlx::Error>;
    /// Lets go of the lock: commits what was done when `done`, otherwise
    /// rolls back what can be rolled back.
    async fn unlock(&mut self, done: bool) -> Result<(), sqlx::Error>;
}

/// Applies the up migrations of `migrator` that the database has not seen,
/// under `backend`'s lock.
pub(crate) async fn run(
    backend: &mut impl MigrationBackend,
    migrator: &sqlx::migrate::Migrator,
) -> Result<(), MigrationError> {
    backend.lock().await?;
    let result = apply_pending(backend, migrator).await;
    let unlocked = backend.unlock(result.is_ok()).await;
    result?;
    Ok(unlocked?)
}

async fn apply_pending(
    backend: &mut impl MigrationBackend,
    migrator: &sqlx::migrate::Migrator,
) -> Result<(), MigrationError> {
    backend.create_history().await?;
    let applied = backend.applied().await?;
    for m in migrator.iter() {
        if m.migration_type.is_down_migration() {
            continue;
        }
        match applied.iter().find(|(v, _)| *v == m.version) {
            Some((_, sum)) if sum[..] == m.checksum[..] => continue,
            Some(_) => {
                return Err(MigrationError::Changed {
                    version: m.version,
                    description: m.description.to_string(),
                })
            }
            None => {}
        }
        backend.execute(&m.sql).await?;
        backend
            .record(m.version, &m.description, &m.checksum)
            .await?;
    }
    Ok(())
}
