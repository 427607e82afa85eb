//! The `idempotent` command line, as library functions (the binary is a thin
//! `main` over [`run`]). Enabled by the `cli` feature.
//!
//! ```text
//! idempotent scopes [--manifest idempotent.toml] [--json]
//! idempotent audit  --database-url URL [--manifest idempotent.toml] [--json] [--check [--grace 15m]]
//! idempotent purge  --database-url URL [--batch 1000] [--json]
//! idempotent inspect --database-url URL --scope S (--tenant T | --shared) --key K [--show-result] [--json]
//! idempotent release --database-url URL --scope S (--tenant T | --shared) --key K --reason "..." [--even-if-running] [--end-lease] [--json]
//! ```
//!
//! `inspect` shows one record: state, attempt (rule 20), lease, retention,
//! fingerprint version; never the recorded result unless `--show-result` is
//! given (results can hold personal data). `release` frees a stuck
//! in-progress record (its owner is gone and nobody will finish it): it
//! refuses a complete record, and one whose lease is still live unless
//! `--even-if-running`, and logs the reason (a `warn` event, target
//! `idempotent::operator`) and prints it. It deletes the record, so the next
//! call runs as a fresh attempt 1 without asking a `recover` hook; with
//! `--end-lease` it keeps the record and ends its lease instead, so the next
//! call takes it over at once as the next attempt and asks the hook (rule 20).
//!
//! Without `--manifest`, `scopes` and `audit` find the manifest the way the
//! `#[idempotent]` macro does, starting from the current directory:
//! `IDEMPOTENT_MANIFEST`, else `./idempotent.toml`, else `idempotent.toml` at
//! the workspace root ([`crate::manifest::locate`]). The manifest is checked by
//! the same rules as the macro's, so both accept and refuse the same files.
//!
//! `--database-url` may also come from `DATABASE_URL`, which keeps passwords
//! out of the process list (`--help` names the variable, never its value).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let err = idempotent_runtime::cli::run_from(["idempotent", "scopes", "--manifest", "/nonexistent.toml"])
//!     .await
//!     .unwrap_err();
//! assert!(err.to_string().contains("/nonexistent.toml"));
//! # }
//! ```

use crate::audit::{audit, KnownScope};
use crate::connect::{connect_url, ConnectError};
use crate::identity::Identity;
use crate::manifest::{Manifest, ManifestError, ENV_VAR, FILE_NAME};
use crate::purge::{purge_runs, DEFAULT_BATCH, MAX_BATCHES_PER_RUN};
use crate::registry::Format;
use crate::store::{ForcedRelease, RecordSnapshot, RecordState};
use crate::Store;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Inspect and maintain idempotency records: list the scopes of a manifest,
/// audit a store against it, purge expired records, inspect or release one record.
#[derive(Debug, Parser)]
#[command(name = "idempotent", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands. Their `Debug` shows `--database-url` without its
/// password or query (a `password=` parameter): see [`shown_database_url`].
#[derive(Subcommand)]
pub enum Command {
    /// List the scopes a manifest declares and the names it retired.
    Scopes {
        /// The scope manifest. Default: the one the macro finds, looked for
        /// from the current directory (IDEMPOTENT_MANIFEST, else
        /// ./idempotent.toml, else idempotent.toml at the workspace root).
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Compare a store with the manifest: records per scope and state, stuck
    /// leases, expired records not yet purged, orphan scopes.
    Audit {
        /// The store: sqlite:PATH, postgres://..., mysql://... or mariadb://...
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        /// The scope manifest whose declared scopes count as claimed.
        /// Default: found as for `scopes`.
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Exit with status 3 (the report still printed) when the report
        /// has findings: orphan scopes, stuck leases or expired records not
        /// purged. For a scheduled check.
        #[arg(long)]
        check: bool,
        /// With --check: a stuck lease or an expired record counts only once
        /// it has been so this long (e.g. `15m`: a little longer than the
        /// purge's interval). On a busy system some lease has always just
        /// run out and some record has always just expired.
        #[arg(long, requires = "check", value_parser = grace_period)]
        grace: Option<Duration>,
    },
    /// Delete expired records now, in batches, until none is left.
    Purge {
        /// The store: sqlite:PATH, postgres://..., mysql://... or mariadb://...
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        /// Records deleted per statement.
        #[arg(long, default_value_t = DEFAULT_BATCH, value_parser = clap::value_parser!(u32).range(1..))]
        batch: u32,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one record: state, attempt, lease, retention, fingerprint
    /// version. The recorded result is left out unless --show-result.
    Inspect {
        /// Which record.
        #[command(flatten)]
        record: RecordArgs,
        /// Also print the recorded result (it may hold personal data).
        #[arg(long)]
        show_result: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Free a stuck in-progress record so the key can run again. Refuses a
    /// complete record (its result is the key's answer), and a record whose
    /// lease is live unless --even-if-running. The reason is logged.
    Release {
        /// Which record.
        #[command(flatten)]
        record: RecordArgs,
        /// Why (logged with the release): a ticket, what was checked.
        #[arg(long, allow_hyphen_values = true, value_parser = not_an_option)]
        reason: String,
        /// Release even while the owner's lease is live (the owner may be
        /// running the body: only when you know it is gone).
        #[arg(long)]
        even_if_running: bool,
        /// Keep the record and end its lease instead of deleting it: the
        /// next call takes it over at once, as the next attempt, and asks
        /// the scope's recover hook whether the work was done.
        #[arg(long)]
        end_lease: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Which record `inspect` and `release` act on. Its `Debug` shows the
/// record's key digest, never the raw `--key` (rule 2), and the database URL
/// without its password ([`shown_database_url`]).
#[derive(Args)]
// One of `--tenant` and `--shared`: a missing one is reported as
// `<--tenant <TENANT>|--shared>`, naming both.
#[command(group(clap::ArgGroup::new("namespace").args(["tenant", "shared"]).required(true)))]
pub struct RecordArgs {
    /// The store: sqlite:PATH, postgres://..., mysql://... or mariadb://...
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// The scope, e.g. payments.charge.
    #[arg(long, allow_hyphen_values = true, value_parser = not_an_option)]
    pub scope: String,
    /// The tenant (the `tenant = ...` value of the call).
    #[arg(
        long,
        allow_hyphen_values = true,
        value_parser = not_an_option
    )]
    pub tenant: Option<String>,
    /// The record is in the shared namespace (`tenant = shared`).
    #[arg(long)]
    pub shared: bool,
    /// The client's idempotency key (a value starting with `-` is taken as
    /// the key, as any other: keys are the client's).
    #[arg(long, allow_hyphen_values = true, value_parser = not_an_option)]
    pub key: String,
}

/// The long options of the command line's subcommands.
const OPTIONS: &[&str] = &[
    "--database-url",
    "--manifest",
    "--json",
    "--check",
    "--grace",
    "--batch",
    "--show-result",
    "--scope",
    "--tenant",
    "--shared",
    "--key",
    "--reason",
    "--even-if-running",
    "--end-lease",
    "--help",
];

/// `--grace`: a duration as the manifest writes them (`15m`, `1h 30m`, `0s`).
fn grace_period(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value.trim())
        .map_err(|e| format!("`{value}` is not a duration ({e}); write e.g. `15m` or `1h`"))
}

/// A value that may start with `-` (keys and tenants are the client's), but
/// is not one of the command's own options: `--tenant --shared --key k`
/// means an option is missing its value, not a tenant called `--shared`.
fn not_an_option(value: &str) -> Result<String, String> {
    if let Some(attached) = value.strip_prefix(ATTACHED) {
        return Ok(attached.to_owned());
    }
    let name = value.split_once('=').map_or(value, |(name, _)| name);
    if OPTIONS.contains(&name) {
        return Err(format!(
            "`{value}` is one of this command's options, not a value: the option before it \
             is missing its value"
        ));
    }
    Ok(value.to_owned())
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Scopes { manifest, json } => f
                .debug_struct("Scopes")
                .field("manifest", manifest)
                .field("json", json)
                .finish(),
            Command::Audit {
                database_url,
                manifest,
                json,
                check,
                grace,
            } => f
                .debug_struct("Audit")
                .field("database_url", &shown_database_url(database_url))
                .field("manifest", manifest)
                .field("json", json)
                .field("check", check)
                .field("grace", grace)
                .finish(),
            Command::Purge {
                database_url,
                batch,
                json,
            } => f
                .debug_struct("Purge")
                .field("database_url", &shown_database_url(database_url))
                .field("batch", batch)
                .field("json", json)
                .finish(),
            Command::Inspect {
                record,
                show_result,
                json,
            } => f
                .debug_struct("Inspect")
                .field("record", record)
                .field("show_result", show_result)
                .field("json", json)
                .finish(),
            Command::Release {
                record,
                reason,
                even_if_running,
                end_lease,
                json,
            } => f
                .debug_struct("Release")
                .field("record", record)
                .field("reason", reason)
                .field("even_if_running", even_if_running)
                .field("end_lease", end_lease)
                .field("json", json)
                .finish(),
        }
    }
}

/// A database URL as the command line's `Debug` shows it: without what may
/// be secret in it. Everything before the last `@` (the user and password,
/// a password holding `@` or `/` included) is replaced by `***`, and the
/// query and fragment (a `password=` parameter) are left out:
/// `postgres://ops:secret@db:5432/records?sslmode=require` shows as
/// `postgres://***@db:5432/records`.
///
/// ```
/// use idempotent_runtime::cli::shown_database_url;
/// assert_eq!(shown_database_url("postgres://ops:s3cr@t@db/records?password=x"), "postgres://***@db/records");
/// assert_eq!(shown_database_url("sqlite:records.db?mode=rwc"), "sqlite:records.db");
/// ```
pub fn shown_database_url(url: &str) -> String {
    let without_query = |text: &str| text.split(['?', '#']).next().unwrap_or_default().to_owned();
    match url.rsplit_once('@') {
        Some((before, host_on)) => {
            let scheme = before
                .split_once("://")
                .map_or_else(|| before.split(':').next().unwrap_or_default(), |(s, _)| s);
            format!("{scheme}://***@{}", without_query(host_on))
        }
        None => without_query(url),
    }
}

impl std::fmt::Debug for RecordArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The digest the logs carry for this record; a key or tenant the
        // store would refuse has none, and says only that.
        let key_digest = self.identity().map_or_else(
            |_| "(not a valid identity)".to_owned(),
            |id| id.key_digest(),
        );
        f.debug_struct("RecordArgs")
            .field("database_url", &shown_database_url(&self.database_url))
            .field("scope", &self.scope)
            .field("tenant", &self.tenant)
            .field("shared", &self.shared)
            .field("key_digest", &key_digest)
            .finish()
    }
}

impl RecordArgs {
    fn identity(&self) -> Result<Identity, CliError> {
        // A scope the attribute would refuse names no record.
        idempotent_rules::scope::check_scope(&self.scope).map_err(CliError::BadScope)?;
        let identity = match &self.tenant {
            Some(tenant) if tenant.is_empty() => return Err(CliError::EmptyTenant),
            Some(tenant) => Identity::new(tenant.as_str(), self.scope.as_str(), self.key.as_str()),
            None => Identity::shared(self.scope.as_str(), self.key.as_str()),
        };
        Ok(identity?)
    }
}

/// Why a command failed. Each message says what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// The arguments were not understood (includes `--help` and `--version`,
    /// whose text is the error's message).
    #[error("{0}")]
    Usage(#[from] clap::Error),
    /// The manifest could not be read.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// No `--manifest` was given and none was found where the macro looks.
    #[error("no scope manifest found: {ENV_VAR} is not set and there is no {FILE_NAME} in {} \
             or at the root of its workspace; pass --manifest PATH or run from the project's directory",
             .searched_from.display())]
    NoManifest {
        /// The directory the lookup started from (the current directory).
        searched_from: PathBuf,
    },
    /// The store could not be opened.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A `sqlite:` URL names a file that does not exist: the command line
    /// opens stores, it never creates one (a mistyped path would otherwise
    /// look like an empty, healthy store).
    #[error("there is no SQLite database at {}; check the path in --database-url \
             (the command line never creates a database)", .path.display())]
    NoSqliteDatabase {
        /// The file the URL names (a relative path made absolute from the
        /// current directory).
        path: PathBuf,
    },
    /// The database the URL names has no idempotency records table: the
    /// command line never sets a database up (opening a store there would
    /// create the tables, and an audit of a mistyped database name would
    /// look like an empty, healthy store).
    #[error(
        "the database --database-url names holds no idempotency records (it has no \
             `idempotency_records` table); check the URL: the command line never creates the \
             tables, the application does when it first opens its store"
    )]
    NoIdempotencyTables,
    /// The database's schema is older than this command's: a migration this
    /// build knows was never applied there (or its migration history could
    /// not be read). The command line never changes a schema (a read-only
    /// `audit` or `inspect` would otherwise apply it, with whatever rights
    /// its account has, under the application's feet).
    #[error(
        "the database --database-url names has an older idempotency schema than this command \
         ({}); this command never changes a schema: use the command of the version the \
         application runs, or deploy the application first (its store applies the migrations \
         when it opens)",
        match .version {
            Some(version) => format!("migration {version}, {:?}, is not applied", .description),
            None => .description.clone(),
        }
    )]
    SchemaBehind {
        /// The first migration the database lacks; `None` when its history
        /// could not be read (`description` then says why).
        version: Option<i64>,
        /// What that migration does.
        description: String,
    },
    /// `--tenant ""`: no record has an empty tenant; a record of the shared
    /// namespace (`tenant = shared`) is named with `--shared`.
    #[error("--tenant is empty: name the record's tenant, or pass --shared (instead of --tenant) for a record of the shared namespace (`tenant = shared`)")]
    EmptyTenant,
    /// `--scope` is not a scope the attribute accepts, so no record has it.
    #[error("--scope: {0}")]
    BadScope(idempotent_rules::scope::ScopeError),
    /// The store failed during the command.
    #[error(transparent)]
    Store(#[from] crate::Error),
    /// `inspect` or `release` found no record with that identity.
    #[error("no record in scope `{scope}` for that tenant and key (key digest {key_digest}): it never existed, \
             was released, expired and was purged, or was reserved in a transaction that has not \
             committed yet (transactional mode: nothing outside it sees the record until then); \
             check --scope, --tenant (or --shared) and --key")]
    NoRecord {
        /// The scope asked for.
        scope: String,
        /// The digest of the identity asked for (the logs carry the same one).
        key_digest: String,
    },
    /// `release` refused: the record is complete, or its lease is live.
    #[error("release refused (scope `{scope}`, key digest {key_digest}): {why}")]
    ReleaseRefused {
        /// The scope.
        scope: String,
        /// The digest of the identity.
        key_digest: String,
        /// Why, and what to do instead.
        why: String,
    },
    /// `audit --check` found something that needs attention; the report is
    /// the command's output all the same (the binary prints it on stdout and
    /// exits with status 3).
    #[error("the audit has findings (orphan scopes, stuck leases or expired records not purged)")]
    AuditFindings {
        /// The report, as `audit` prints it.
        report: String,
    },
    /// `release` was given an empty `--reason`.
    #[error("--reason must say why the record is released (a ticket, what was checked); it is logged with the release")]
    NoReason,
    /// `purge` deleted as many batches as one command runs, and every one
    /// came back full: records expire as fast as they are deleted.
    #[error(
        "purge deleted {deleted} expired records in {runs} runs of {per_run} batches of {batch} \
             and stopped with records left: they expire as fast as such batches delete them; \
             run purge again with a larger --batch"
    )]
    PurgeIncomplete {
        /// How many records it deleted.
        deleted: u64,
        /// The runs it made.
        runs: u32,
        /// Batches per run.
        per_run: u32,
        /// The batch size.
        batch: u32,
    },
    /// `purge` failed part way; what it deleted before stays deleted.
    #[error("purge failed after deleting {deleted} expired records (they stay deleted): {source}")]
    PurgeFailed {
        /// How many records it deleted before it failed.
        deleted: u64,
        /// Why it failed.
        source: crate::Error,
    },
    /// The command ran, but its output could not be written (stdout closed,
    /// a full disk): what it did stands (a `release` released).
    #[error("the command ran, but its output could not be written: {source} (what it did stands: a `release` released the record; `idempotent inspect` shows it as it is now)")]
    Output {
        /// Why the write failed.
        source: std::io::Error,
    },
}

/// The most runs of [`crate::purge::MAX_BATCHES_PER_RUN`] batches one `purge`
/// command makes (a billion records in batches of 1,000).
const PURGE_RUNS: u32 = 100;

fn format(json: bool) -> Format {
    if json {
        Format::Json
    } else {
        Format::Table
    }
}

/// Parses `args` (the first is the program name) and runs the command;
/// returns what it prints on stdout.
pub async fn run_from<I, T>(args: I) -> Result<String, CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    run(Cli::try_parse_from(
        args.into_iter().flat_map(split_attached_values),
    )?)
    .await
}

/// The command line of this process, as the `idempotent` binary reads it
/// (with [`run_from`]'s reading of `--key=VALUE`); prints the usage,
/// `--help` or `--version` and exits on its own.
pub fn parse_command_line() -> Cli {
    Cli::parse_from(std::env::args_os().flat_map(split_attached_values))
}

/// Marks a value given as `--option=VALUE`: [`not_an_option`] takes it as it
/// is, since it cannot be an option missing its value (`--key=--json` is the
/// key `--json`). A NUL never comes in an argument from the OS.
const ATTACHED: char = '\0';

/// `--key=VALUE` (and `--tenant=`, `--scope=`, `--reason=`) as two arguments,
/// the value marked [`ATTACHED`]; every other argument as it is, except one
/// that already starts with the mark (only [`run_from`] can be given one):
/// it is marked once more, so that taking the mark off leaves it as it was
/// (a tenant `"\0acme"` stays invalid, never becomes `acme`).
fn split_attached_values<T: Into<std::ffi::OsString>>(arg: T) -> Vec<std::ffi::OsString> {
    let arg = arg.into();
    if let Some((option, value)) = arg.to_str().and_then(|a| a.split_once('='))
        && ["--key", "--tenant", "--scope", "--reason"].contains(&option)
    {
        return vec![option.into(), format!("{ATTACHED}{value}").into()];
    }
    match arg.to_str() {
        Some(a) if a.starts_with(ATTACHED) => vec![format!("{ATTACHED}{a}").into()],
        _ => vec![arg],
    }
}

/// Opens the store a URL names, as [`connect_url`] does, but never sets a
/// database up: a SQLite file that does not exist, or a database without the
/// idempotency records table, is an operator's mistyped URL, not a new store.
/// Nor does it change a schema: a database whose history lacks a migration
/// this build knows is refused ([`CliError::SchemaBehind`]).
/// A server that cannot be reached is reported from the first look, within
/// [`ACQUIRE_TIMEOUT`](crate::store::ACQUIRE_TIMEOUT), with the reason
/// (refused, no answer), not looked for a second time by the store.
async fn open_store(url: &str) -> Result<Arc<dyn Store>, CliError> {
    let url = &*crate::connect::with_lowercase_scheme(url);
    check_existing_sqlite_file(url)?;
    match holds_records(url).await {
        Probe::Holds(false) => return Err(CliError::NoIdempotencyTables),
        Probe::Unreachable(e) => return Err(crate::Error::Store(e).into()),
        Probe::Holds(true) | Probe::CannotTell => {}
    }
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    let opened = crate::store::migrate::only_checking(connect_url(url)).await;
    #[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
    let opened = connect_url(url).await;
    opened.map_err(schema_behind_or_connect)
}

/// [`CliError::SchemaBehind`] when the store's open found migrations this
/// build ships missing from the database (or could not read its history),
/// otherwise the connect error as it is.
fn schema_behind_or_connect(e: ConnectError) -> CliError {
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    {
        use crate::store::migrate::MigrationError;
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(error) = cause {
            match error.downcast_ref::<MigrationError>() {
                Some(MigrationError::NotApplied {
                    version,
                    description,
                }) => {
                    return CliError::SchemaBehind {
                        version: Some(*version),
                        description: description.clone(),
                    };
                }
                Some(MigrationError::NoHistory) => {
                    return CliError::SchemaBehind {
                        version: None,
                        description: "it has no migration history table, \
                                      idempotency_schema_migrations"
                            .to_owned(),
                    };
                }
                _ => cause = error.source(),
            }
        }
    }
    CliError::Connect(e)
}

/// A `sqlite:` URL must name a file that exists (or `:memory:`).
fn check_existing_sqlite_file(url: &str) -> Result<(), CliError> {
    #[cfg(feature = "sqlite")]
    if url
        .get(..7)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("sqlite:"))
    {
        use std::str::FromStr;
        if let Ok(options) = sqlx::sqlite::SqliteConnectOptions::from_str(url) {
            let path = options.get_filename();
            // sqlx names `sqlite::memory:` `file:sqlx-in-memory-<n>`.
            let in_memory = path.as_os_str() == ":memory:"
                || path.to_string_lossy().starts_with("file:sqlx-in-memory-");
            if in_memory {
                return Ok(());
            }
            match sqlite_file(path) {
                Some(file) if !file.exists() => {
                    // Named from the current directory: a relative path
                    // alone does not say the command ran in the wrong one.
                    let path = std::path::absolute(&file).unwrap_or(file);
                    return Err(CliError::NoSqliteDatabase { path });
                }
                _ => {}
            }
        }
    }
    let _ = url;
    Ok(())
}

/// The file SQLite opens for `filename`. sqlx opens every filename with
/// `SQLITE_OPEN_URI`, so one starting with `file:` is an SQLite URI
/// (`file:PATH`, `file:///PATH`, `file://localhost/PATH`, then `?query` and
/// `#fragment`): the file is its path, percent-decoded. `None` for a URI of
/// an in-memory database (`file::memory:`, `mode=memory`) or an empty path
/// (a temporary database): no file to look for.
#[cfg(feature = "sqlite")]
fn sqlite_file(filename: &std::path::Path) -> Option<PathBuf> {
    let Some(uri) = filename.to_str().and_then(|f| f.strip_prefix("file:")) else {
        return Some(filename.to_path_buf());
    };
    let (uri, _fragment) = uri.split_once('#').unwrap_or((uri, ""));
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    // An authority, if any, is empty or `localhost` (SQLite refuses others).
    let path = match path.strip_prefix("//") {
        Some(rest) => &rest[rest.find('/').unwrap_or(rest.len())..],
        None => path,
    };
    let path = crate::store::sqlite::percent_decoded(path);
    let memory = query
        .split('&')
        .any(|pair| crate::store::sqlite::percent_decoded(pair) == "mode=memory");
    if memory || path.is_empty() || path == ":memory:" {
        return None;
    }
    Some(PathBuf::from(path))
}

/// What the first look at a database found.
enum Probe {
    /// It answered: whether it holds the idempotency records table.
    Holds(bool),
    /// No connection: refused, failed, or no answer within the bound.
    Unreachable(crate::StoreError),
    /// It cannot tell (an in-memory SQLite database, a store this build
    /// lacks, a query it could not run): opening the store says what is
    /// wrong, or finds it empty.
    CannotTell,
}

/// Whether the database `url` names holds the idempotency records table,
/// read on a connection of its own before any store opens (a store applies
/// the migrations, creating the tables), within the stores' own bound,
/// [`ACQUIRE_TIMEOUT`].
///
/// [`ACQUIRE_TIMEOUT`]: crate::store::ACQUIRE_TIMEOUT
async fn holds_records(url: &str) -> Probe {
    let bound = crate::store::ACQUIRE_TIMEOUT;
    let store = match crate::connect::scheme_of(url).as_str() {
        "postgres" | "postgresql" => "postgres",
        "mysql" | "mariadb" => "mysql",
        _ => "sqlite",
    };
    let unreachable = |why: Box<dyn std::error::Error + Send + Sync>| {
        Probe::Unreachable(crate::StoreError::new(store, "connect", why))
    };
    match tokio::time::timeout(bound, read_holds_records(url)).await {
        Ok(Ok(Some(holds))) => Probe::Holds(holds),
        Ok(Ok(None)) => Probe::CannotTell,
        Ok(Err(e)) => unreachable(e),
        // A SQLite file is there: its lock is busy (another process writes);
        // the store's own open waits for it.
        Err(_) if store == "sqlite" => Probe::CannotTell,
        Err(_) => unreachable(
            format!(
                "no answer from the database server within {} s: check the host and port, \
                 and that the server is up",
                bound.as_secs()
            )
            .into(),
        ),
    }
}

/// `Err` when no connection could be made; `Ok(None)` when it cannot tell.
async fn read_holds_records(
    url: &str,
) -> Result<Option<bool>, Box<dyn std::error::Error + Send + Sync>> {
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    use sqlx::Connection as _;
    match crate::connect::scheme_of(url).as_str() {
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            use std::str::FromStr;
            let Ok(options) = sqlx::sqlite::SqliteConnectOptions::from_str(url) else {
                return Ok(None);
            };
            if options.get_filename().as_os_str() == ":memory:" {
                return Ok(None);
            }
            let mut conn = sqlx::SqliteConnection::connect_with(&options.read_only(true)).await?;
            Ok(sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM sqlite_master \
                  WHERE type = 'table' AND name = 'idempotency_records')",
            )
            .fetch_one(&mut conn)
            .await
            .ok())
        }
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            use std::str::FromStr;
            let options = sqlx::postgres::PgConnectOptions::from_str(url)?;
            let address = format!("{}:{}", options.get_host(), options.get_port());
            let mut conn = sqlx::PgConnection::connect_with(&options)
                .await
                .map_err(|e| crate::store::server::connect_failure("PostgreSQL", &address, &e))?;
            Ok(
                sqlx::query_scalar("SELECT to_regclass('idempotency_records') IS NOT NULL")
                    .fetch_one(&mut conn)
                    .await
                    .ok(),
            )
        }
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            use std::str::FromStr;
            let options =
                sqlx::mysql::MySqlConnectOptions::from_str(&crate::connect::mysql_url(url))?;
            let address = format!("{}:{}", options.get_host(), options.get_port());
            let mut conn = sqlx::MySqlConnection::connect_with(&options)
                .await
                .map_err(|e| {
                    crate::store::server::connect_failure("MySQL/MariaDB", &address, &e)
                })?;
            Ok(sqlx::query_scalar::<_, i64>(
                "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
                  WHERE table_schema = DATABASE() AND table_name = 'idempotency_records')",
            )
            .fetch_one(&mut conn)
            .await
            .ok()
            .map(|found| found == 1))
        }
        _ => Ok(None),
    }
}

/// Runs a parsed command; returns what it prints on stdout.
pub async fn run(cli: Cli) -> Result<String, CliError> {
    match cli.command {
        Command::Scopes { manifest, json } => Ok(crate::manifest::render(
            &load_manifest(manifest)?,
            format(json),
        )),
        Command::Audit {
            database_url,
            manifest,
            json,
            check,
            grace,
        } => {
            let manifest = load_manifest(manifest)?;
            let store = open_store(&database_url).await?;
            let report = audit(&*store, &KnownScope::from_manifest(&manifest)).await?;
            let rendered = report.render(format(json));
            if check && report.has_findings_older_than(grace.unwrap_or_default()) {
                return Err(CliError::AuditFindings { report: rendered });
            }
            Ok(rendered)
        }
        Command::Purge {
            database_url,
            batch,
            json,
        } => {
            let store = open_store(&database_url).await?;
            let (deleted, done) = purge_runs(&*store, batch, PURGE_RUNS)
                .await
                .map_err(|(deleted, e)| purge_failed(deleted, e))?;
            if !done {
                return Err(CliError::PurgeIncomplete {
                    deleted,
                    runs: PURGE_RUNS,
                    per_run: MAX_BATCHES_PER_RUN,
                    batch: batch.max(1),
                });
            }
            Ok(render_purge(store.name(), deleted, batch, format(json)))
        }
        Command::Inspect {
            record,
            show_result,
            json,
        } => {
            let identity = record.identity()?;
            let store = open_store(&record.database_url).await?;
            let snapshot = store
                .fetch(&identity)
                .await
                .map_err(crate::Error::from)?
                .ok_or_else(|| no_record(&identity))?;
            Ok(render_inspect(
                store.name(),
                &identity,
                &snapshot,
                show_result,
                format(json),
            ))
        }
        Command::Release {
            record,
            reason,
            even_if_running,
            end_lease,
            json,
        } => {
            let reason = reason.trim().to_owned();
            // A reason is for the person reading the log: nothing but
            // spaces and control characters (a NUL) is none.
            if reason.chars().all(|c| c.is_whitespace() || c.is_control()) {
                return Err(CliError::NoReason);
            }
            let identity = record.identity()?;
            let store = open_store(&record.database_url).await?;
            if end_lease {
                return end_the_lease(
                    store.as_ref(),
                    &identity,
                    &reason,
                    even_if_running,
                    format(json),
                )
                .await;
            }
            let answer = store
                .force_release(&identity, !even_if_running)
                .await
                .map_err(crate::Error::from)?;
            let refused = |why: String| release_refused(store.as_ref(), &identity, &reason, why);
            match answer {
                ForcedRelease::Released { attempt } => {
                    tracing::warn!(target: "idempotent::operator", store = store.name(),
                        scope = %identity.scope, key = %identity.key_digest(), attempt, reason = ?reason,
                        "an operator released an in-progress record; the next call with this key runs as attempt 1");
                    Ok(render_release(
                        store.name(),
                        &identity,
                        attempt,
                        &reason,
                        format(json),
                    ))
                }
                ForcedRelease::Complete => {
                    // An expired one already counts as absent (rule 16).
                    let expired = store
                        .fetch(&identity)
                        .await
                        .map_err(crate::Error::from)?
                        .is_none_or(|snapshot| snapshot.is_expired());
                    Err(refused(if expired {
                        "the record is complete and has expired: it already counts as absent \
                         (the next call with this key runs the body), and the purge deletes it; \
                         there is nothing to release"
                            .to_owned()
                    } else {
                        "the record is complete: its recorded result is the answer for this key, and \
                         deleting it would let a retry run the body again. It expires with its ttl \
                         (`idempotent inspect` shows when); use a new key for new work"
                            .to_owned()
                    }))
                }
                ForcedRelease::LeaseLive { lease_remaining } => {
                    Err(refused(lease_is_live(lease_remaining)))
                }
                ForcedRelease::Absent => Err(no_record(&identity)),
            }
        }
    }
}

/// A refused release (`--end-lease` too), logged with the operator's reason.
/// (The reason is logged quoted and escaped, `?reason`, here and in every
/// operator event: a line break in it would otherwise start what reads as
/// another event of the log.)
fn release_refused(store: &dyn Store, identity: &Identity, reason: &str, why: String) -> CliError {
    tracing::warn!(target: "idempotent::operator", store = store.name(),
        scope = %identity.scope, key = %identity.key_digest(), reason = ?reason, why = %why,
        "an operator's release was refused");
    CliError::ReleaseRefused {
        scope: identity.scope.clone(),
        key_digest: identity.key_digest(),
        why,
    }
}

/// Why a record whose owner's lease runs `remaining` longer is not released.
fn lease_is_live(remaining: Duration) -> String {
    format!(
        "its owner's lease is live for another {}: the owner may be running the body right now. \
         Wait until the lease runs out (the next call then takes the record over, asking the \
         scope's recover hook), or pass --even-if-running if you know the owner is gone",
        crate::registry::human(remaining.max(Duration::from_millis(1)))
    )
}

/// `release --end-lease`: the in-progress record is kept and its lease
/// ended, so the next call takes it over at once and asks the scope's
/// recover hook. A lease that has run out needs nothing written (the next
/// call takes the record over as it is); a live one is ended only with
/// `--even-if-running`, fenced by the owner's token as read. Refused, as a
/// release, for a complete record; every refusal is logged.
async fn end_the_lease(
    store: &dyn Store,
    identity: &Identity,
    reason: &str,
    even_if_running: bool,
    format: Format,
) -> Result<String, CliError> {
    let refused = |why: String| release_refused(store, identity, reason, why);
    let snapshot = store
        .fetch(identity)
        .await
        .map_err(crate::Error::from)?
        .filter(|snapshot| !snapshot.is_expired())
        .ok_or_else(|| no_record(identity))?;
    let lease_remaining = snapshot
        .lease_expires_at_ms
        .map_or(0, |ends| ends.saturating_sub(snapshot.now_ms).max(0));
    let ended_now =
        match (&snapshot.state, &snapshot.owner_token) {
            (RecordState::Complete, _) => return Err(refused(
                "the record is complete: its recorded result is the answer for this key; there \
                 is no lease to end"
                    .to_owned(),
            )),
            // Nothing to write: the next call takes the record over as it is
            // (with --even-if-running it is ended all the same, as the
            // operator asked; an owner that was only slow may still renew it
            // with its token before the next call comes, as the README says).
            (RecordState::InProgress, _) if lease_remaining == 0 && !even_if_running => false,
            (RecordState::InProgress, _) if !even_if_running => {
                return Err(refused(lease_is_live(crate::store::millis_to_duration(
                    lease_remaining,
                ))))
            }
            (RecordState::InProgress, Some(token)) => {
                let token = crate::OwnerToken::from_stored(token.clone());
                // Bounded: a transaction holding the record (a
                // transactional-mode call) would hold the statement for as
                // long as it lasts. The store bounds that wait itself where a
                // statement given up on here would go on waiting on the server.
                let within = Duration::from_secs(10);
                let ended =
                    tokio::time::timeout(within, store.end_lease_for_operator(identity, &token));
                match ended.await {
                    Err(_) => {
                        return Err(refused(format!(
                            "the lease could not be ended within {}: a transaction may hold the \
                             record (a transactional-mode call in progress); `idempotent \
                             inspect` shows it, retry once that transaction has ended",
                            crate::registry::human(within)
                        )))
                    }
                    Ok(Ok(crate::store::Fenced::Written)) => true,
                    Ok(Ok(crate::store::Fenced::NotOwner)) => return Err(refused(
                        "the record changed meanwhile: its owner finished, or another call took \
                         it over; `idempotent inspect` shows it now"
                            .to_owned(),
                    )),
                    Ok(Err(e)) => return Err(crate::Error::from(e).into()),
                }
            }
            (RecordState::InProgress, None) => {
                return Err(refused(
                    "the record has no owner token to end its lease with".to_owned(),
                ))
            }
        };
    let what = if ended_now {
        "ended the lease of"
    } else {
        "found the lease already over on"
    };
    tracing::warn!(target: "idempotent::operator", store = store.name(),
        scope = %identity.scope, key = %identity.key_digest(), attempt = snapshot.attempt,
        reason = ?reason, ended_now,
        "an operator's release --end-lease: the next call takes the record over and asks its recover hook");
    Ok(match format {
        Format::Json => crate::registry::to_json(&serde_json::json!({
            "store": store.name(),
            "scope": identity.scope,
            "key_digest": identity.key_digest(),
            "released": false,
            "lease_ended": true,
            "ended_now": ended_now,
            "attempt": snapshot.attempt,
            "reason": reason,
        })),
        Format::Table => format!(
            "{what} the in-progress record (store {}, scope `{}`, key digest {}, attempt {}); \
             the next call with this key takes it over as attempt {} and asks the scope's \
             recover hook\nreason: {reason}\n",
            store.name(),
            identity.scope,
            identity.key_digest(),
            snapshot.attempt,
            snapshot.attempt.saturating_add(1),
        ),
    })
}

/// The manifest named by `--manifest`, else the one [`crate::manifest::locate`]
/// finds from the current directory: the lookup order the macro uses.
pub fn load_manifest(explicit: Option<PathBuf>) -> Result<Manifest, CliError> {
    let path = match explicit {
        Some(path) => path,
        None => {
            let here = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
            crate::manifest::locate(Some(&here))?.ok_or(CliError::NoManifest {
                searched_from: here,
            })?
        }
    };
    Ok(Manifest::load(path)?)
}

fn no_record(identity: &Identity) -> CliError {
    CliError::NoRecord {
        scope: identity.scope.clone(),
        key_digest: identity.key_digest(),
    }
}

/// `ms` since the epoch in RFC 3339; past the year 9999, which RFC 3339
/// cannot write (a ttl or lease of thousands of years), as milliseconds.
fn time(ms: i64) -> String {
    crate::audit::timestamp(ms, true)
}

/// How far `ms` is from `now_ms`: "in 29s" or "12s ago" (whole seconds from
/// 10 s on: milliseconds there are noise).
fn relative(ms: i64, now_ms: i64) -> String {
    // Any two readings, however far apart (a record written by hand), in
    // 128 bits: their difference cannot overflow.
    let between = i128::from(ms) - i128::from(now_ms);
    let x = u64::try_from(between.unsigned_abs()).unwrap_or(u64::MAX);
    let x = if x >= 10_000 {
        x.saturating_add(500) / 1000 * 1000
    } else {
        x
    };
    let d = crate::registry::human(Duration::from_millis(x));
    if between > 0 {
        format!("in {d}")
    } else {
        format!("{d} ago")
    }
}

/// A purge that failed: with how many it deleted first, when it deleted any.
fn purge_failed(deleted: u64, e: crate::error::StoreError) -> CliError {
    match deleted {
        0 => CliError::Store(e.into()),
        deleted => CliError::PurgeFailed {
            deleted,
            source: e.into(),
        },
    }
}

/// What `inspect` prints: one record, without the result unless asked.
fn render_inspect(
    store: &str,
    identity: &Identity,
    s: &RecordSnapshot,
    show_result: bool,
    format: Format,
) -> String {
    // In progress with its lease run out: its owner is gone or cut off.
    let stuck = s.state == RecordState::InProgress
        && !s.is_expired()
        && s.lease_expires_at_ms.is_none_or(|l| l <= s.now_ms);
    let state = match (s.state, s.is_expired()) {
        (_, true) => "expired (counts as absent; not purged yet)",
        (RecordState::Complete, false) => "complete",
        (RecordState::InProgress, false) if stuck => {
            "in progress, STUCK (lease expired: the next call takes it over)"
        }
        (RecordState::InProgress, false) => "in progress (lease live)",
    };
    let fingerprint_version = s
        .fingerprint
        .as_deref()
        .map(|f| f.split_once(':').map_or(f, |(v, _)| v).to_owned());
    let result = s.outcome.as_ref().map(|o| {
        (
            o.is_error,
            o.payload.len(),
            String::from_utf8_lossy(&o.payload).into_owned(),
        )
    });
    match format {
        Format::Json => {
            let mut out = serde_json::json!({
                "store": store,
                "scope": identity.scope,
                "tenant": identity.tenant,
                "key_digest": identity.key_digest(),
                "state": s.state.as_str(),
                "expired": s.is_expired(),
                "stuck": stuck,
                "attempt": s.attempt,
                "attempt_started_at_ms": s.attempt_started_at_ms,
                "created_at_ms": s.created_at_ms,
                "lease_expires_at_ms": s.lease_expires_at_ms,
                "expires_at_ms": s.expires_at_ms,
                "now_ms": s.now_ms,
                "fingerprint_version": fingerprint_version,
                "recovered": s.recovered,
                "result_bytes": result.as_ref().map(|r| r.1),
                "recorded_error": result.as_ref().map(|r| r.0),
            });
            if show_result {
                out["result"] = serde_json::json!(result.as_ref().map(|r| r.2.clone()));
            }
            crate::registry::to_json(&out)
        }
        Format::Table => {
            let mut rows = vec![
                ("store", store.to_owned()),
                ("scope", identity.scope.clone()),
                (
                    "tenant",
                    // A tenant's own name is shown quoted, so none reads
                    // like the shared namespace's mark (purge hunt: a tenant
                    // named like it showed the same line).
                    if identity.tenant.is_empty() {
                        "none: the shared namespace (tenant = shared)".to_owned()
                    } else {
                        format!("{:?}", identity.tenant)
                    },
                ),
                ("key digest", identity.key_digest()),
                ("state", state.to_owned()),
                (
                    "attempt",
                    if s.attempt > 1 {
                        format!(
                            "{} (taken over {} time(s) after an owner's lease expired)",
                            s.attempt,
                            s.attempt - 1
                        )
                    } else {
                        s.attempt.to_string()
                    },
                ),
                (
                    "attempt started",
                    format!(
                        "{} ({})",
                        time(s.attempt_started_at_ms),
                        relative(s.attempt_started_at_ms, s.now_ms)
                    ),
                ),
                (
                    "created",
                    format!(
                        "{} ({})",
                        time(s.created_at_ms),
                        relative(s.created_at_ms, s.now_ms)
                    ),
                ),
                (
                    "lease",
                    match s.lease_expires_at_ms {
                        Some(l) => format!("{} ({})", time(l), relative(l, s.now_ms)),
                        None => "-".to_owned(),
                    },
                ),
                (
                    "expires",
                    format!(
                        "{} ({})",
                        time(s.expires_at_ms),
                        relative(s.expires_at_ms, s.now_ms)
                    ),
                ),
                (
                    "fingerprint",
                    fingerprint_version
                        .map(|v| format!("version {v}"))
                        .unwrap_or_else(|| "none".to_owned()),
                ),
                (
                    "recovered",
                    if s.recovered {
                        "yes (a recover hook answered; the body did not run)"
                    } else {
                        "no"
                    }
                    .to_owned(),
                ),
            ];
            match (&result, show_result) {
                (None, _) => rows.push(("result", "-".to_owned())),
                (Some((is_error, len, _)), false) => rows.push((
                    "result",
                    format!(
                        "{} of {len} bytes, not shown (pass --show-result)",
                        if *is_error {
                            "a recorded error"
                        } else {
                            "a value"
                        }
                    ),
                )),
                (Some((is_error, _, text)), true) => {
                    rows.push((
                        "recorded error",
                        if *is_error { "yes" } else { "no" }.to_owned(),
                    ));
                    rows.push(("result", text.clone()));
                }
            }
            let rows: Vec<Vec<String>> = rows
                .into_iter()
                .map(|(k, v)| vec![k.to_owned(), v])
                .collect();
            crate::table::render(&["field", "value"], &rows)
        }
    }
}

/// What `release` prints.
fn render_release(
    store: &str,
    identity: &Identity,
    attempt: u32,
    reason: &str,
    format: Format,
) -> String {
    match format {
        Format::Json => crate::registry::to_json(&serde_json::json!({
            "store": store,
            "scope": identity.scope,
            "key_digest": identity.key_digest(),
            "released": true,
            "attempt": attempt,
            "reason": reason,
        })),
        Format::Table => format!(
            "released the in-progress record (store {store}, scope `{}`, key digest {}, attempt {attempt}); \
             the next call with this key runs as a fresh attempt 1 (a recover hook of the scope \
             is not asked; --end-lease keeps the record for it)\nreason: {reason}\n",
            identity.scope,
            identity.key_digest()
        ),
    }
}

fn render_purge(store: &str, deleted: u64, batch: u32, format: Format) -> String {
    match format {
        Format::Json => crate::registry::to_json(&serde_json::json!({
            "store": store,
            "deleted": deleted,
            "batch": batch,
        })),
        Format::Table => crate::table::render(
            &["store", "deleted", "batch"],
            &[vec![
                store.to_owned(),
                deleted.to_string(),
                batch.to_string(),
            ]],
        ),
    }
}

/// The binary's log: `warn` and above (an operator's release and every
/// refusal, with the reason given: target `idempotent::operator`) written to
/// `writer` (stderr in the binary), or what `RUST_LOG` asks for.
pub fn log_subscriber<W>(writer: W, ansi: bool) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing::level_filters::LevelFilter::WARN.into())
        .from_env_lossy();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi)
        .finish()
}

/// Writes a command's output. A failure to write it (a closed pipe, a full
/// disk) is an error that says the command itself has run: a `release`
/// that printed nothing still released the record.
///
/// # Errors
/// [`CliError::Output`] when `out` refuses the text.
pub fn print_output(out: &mut impl std::io::Write, text: &str) -> Result<(), CliError> {
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| CliError::Output { source })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Times however far apart (written into the table by hand) are shown,
    /// never an overflow (purge hunt: `created_at = i64::MIN` panicked).
    #[test]
    fn relative_times_of_extreme_readings_do_not_overflow() {
        assert_eq!(relative(1_500, 1_000), "in 500ms");
        assert_eq!(relative(1_000, 13_400), "12s ago");
        for (ms, now) in [(i64::MIN, 1_000), (i64::MAX, -1), (i64::MIN, i64::MAX)] {
            let shown = relative(ms, now);
            assert!(
                shown.starts_with("in ") || shown.ends_with(" ago"),
                "{shown}"
            );
            assert!(std::panic::catch_unwind(|| time(ms)).is_ok());
        }
    }

    /// A purge that failed says how many it deleted first, when it deleted
    /// any; one that deleted nothing is the store's error as it is.
    #[test]
    fn a_failed_purge_says_what_it_deleted_first() {
        let e =
            || crate::error::StoreError::new("test", "purge expired records", "connection reset");
        let partial = purge_failed(1500, e());
        assert!(matches!(
            partial,
            CliError::PurgeFailed { deleted: 1500, .. }
        ));
        let said = partial.to_string();
        assert!(
            said.contains("after deleting 1500 expired records (they stay deleted)")
                && said.contains("connection reset"),
            "{said}"
        );
        let none = purge_failed(0, e());
        assert!(matches!(none, CliError::Store(_)), "{none}");
    }

    /// A writer the log or the output goes to, kept for the test to read.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The binary's log carries an operator's release (and refusals) with
    /// the reason given; it logged nothing at all before it had a subscriber.
    #[test]
    fn the_binarys_log_carries_operator_events() {
        let captured = Captured::default();
        let writer = captured.clone();
        let log = log_subscriber(move || writer.clone(), false);
        tracing::subscriber::with_default(log, || {
            tracing::warn!(target: "idempotent::operator", reason = "INC-77", "an operator released an in-progress record");
            tracing::debug!(target: "idempotent", "not shown by default");
        });
        let text = String::from_utf8_lossy(&captured.0.lock().expect("log")).into_owned();
        assert!(
            text.contains("idempotent::operator") && text.contains("INC-77"),
            "{text}"
        );
        assert!(!text.contains("not shown"), "{text}");
    }

    /// `--tenant ""` names no record; the message points at `--shared`.
    #[test]
    fn an_empty_tenant_points_at_shared() {
        let cli = Cli::try_parse_from([
            "idempotent",
            "inspect",
            "--database-url",
            "sqlite::memory:",
            "--scope",
            "a.b",
            "--tenant=",
            "--key",
            "k",
        ])
        .expect("parsed");
        let Command::Inspect { record, .. } = cli.command else {
            panic!("inspect");
        };
        let e = record.identity().expect_err("an empty tenant");
        assert!(matches!(e, CliError::EmptyTenant), "{e:?}");
        assert!(e.to_string().contains("--shared"), "{e}");
    }

    /// Output that cannot be written (a closed pipe) is an error saying the
    /// command ran, not a panic.
    #[test]
    fn output_that_cannot_be_written_is_an_error_not_a_panic() {
        struct ClosedPipe;
        impl std::io::Write for ClosedPipe {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let e = print_output(&mut ClosedPipe, "released").expect_err("a closed pipe");
        assert!(matches!(e, CliError::Output { .. }), "{e:?}");
        assert!(e.to_string().contains("the command ran"), "{e}");
        let mut out = Captured::default();
        print_output(&mut out, "ok\n").expect("written");
        assert_eq!(&*out.0.lock().expect("out"), b"ok\n");
    }
    use clap::CommandFactory;

    /// `sqlite::memory:` is an in-memory database, not a missing file (sqlx
    /// renames it, and it was refused as "no SQLite database at
    /// file:sqlx-in-memory-0"); a missing file is still refused.
    #[cfg(feature = "sqlite")]
    #[test]
    fn an_in_memory_sqlite_url_is_not_a_missing_file() {
        assert!(check_existing_sqlite_file("sqlite::memory:").is_ok());
        let missing = check_existing_sqlite_file("sqlite:///nonexistent/idempotent-cli-test.db");
        assert!(matches!(missing, Err(CliError::NoSqliteDatabase { .. })));
        // SQLite URI filenames: in memory, or the file in them.
        for url in ["sqlite:file::memory:", "sqlite:file:x.db%3Fmode%3Dmemory"] {
            assert!(check_existing_sqlite_file(url).is_ok(), "{url}");
        }
        for (url, file) in [
            ("sqlite:file:/nonexistent/a%20b.db", "/nonexistent/a b.db"),
            (
                "sqlite:file:///nonexistent/c.db?mode=ro",
                "/nonexistent/c.db",
            ),
            (
                "sqlite:file://localhost/nonexistent/d.db%23x",
                "/nonexistent/d.db",
            ),
        ] {
            match check_existing_sqlite_file(url) {
                Err(CliError::NoSqliteDatabase { path }) => {
                    assert_eq!(path, std::path::Path::new(file), "{url}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    /// A time past the year 9999 (a ttl of `9999y` is accepted) panicked
    /// `inspect` ("a Display implementation returned an error").
    #[test]
    fn times_past_the_year_9999_are_written_not_a_panic() {
        assert_eq!(time(0), "1970-01-01T00:00:00.000Z");
        let far = 400_000_000_000_000_i64; // about the year 14645
        assert_eq!(
            time(far),
            "400000000000000 ms after the Unix epoch (past the year 9999)"
        );
        assert_eq!(
            time(i64::MAX).split(' ').next(),
            Some("9223372036854775807")
        );
    }

    /// [`OPTIONS`] is every long option of every subcommand.
    #[test]
    fn the_option_list_is_the_commands_own() {
        let mut defined: Vec<String> = Cli::command()
            .get_subcommands()
            .flat_map(|sub| sub.get_arguments().filter_map(|a| a.get_long()))
            .map(|long| format!("--{long}"))
            .chain(["--help".to_owned()])
            .collect();
        defined.sort();
        defined.dedup();
        let mut listed: Vec<String> = OPTIONS.iter().map(|o| (*o).to_owned()).collect();
        listed.sort();
        assert_eq!(listed, defined);
    }

    /// `idempotent inspect --database-url sqlite::memory:` and then `args`, parsed.
    fn parse_inspect(args: &[&str]) -> Result<Cli, clap::Error> {
        let mut all = vec!["idempotent", "inspect", "--database-url", "sqlite::memory:"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all)
    }

    /// A value may start with `-`, but an option of the command in a value's
    /// place means the option before it is missing its value.
    #[test]
    fn an_option_is_never_taken_for_a_value() {
        let ok =
            parse_inspect(&["--scope", "a.b", "--tenant", "-t", "--key", "-abc"]).expect("values");
        let Command::Inspect { record, .. } = ok.command else {
            panic!("inspect");
        };
        assert_eq!(
            (record.tenant.as_deref(), record.key.as_str()),
            (Some("-t"), "-abc")
        );
        for args in [
            &["--scope", "a.b", "--tenant", "--shared", "--key", "k"][..],
            &["--scope", "a.b", "--tenant", "t", "--key", "--json"][..],
        ] {
            let e = parse_inspect(args).expect_err("an option in a value's place");
            assert!(e.to_string().contains("missing its value"), "{args:?}: {e}");
        }
        // Refused one way or another (here the `k` left over is).
        parse_inspect(&["--scope", "--key", "k", "--tenant", "t"])
            .expect_err("--scope has no value");
        let e = Cli::try_parse_from([
            "idempotent",
            "release",
            "--database-url",
            "sqlite::memory:",
            "--scope",
            "a.b",
            "--tenant",
            "t",
            "--key",
            "k",
            "--reason",
            "--even-if-running",
        ])
        .expect_err("--reason is missing its value");
        assert!(e.to_string().contains("missing its value"), "{e}");
    }

    /// Any key is the client's, one spelled like an option too: given as
    /// `--key=VALUE` it cannot be an option missing its value, so it is taken
    /// (it was refused, and such a record could be neither inspected nor
    /// released).
    #[test]
    fn a_record_names_its_tenant_or_the_shared_namespace_never_both() {
        let missing = parse_inspect(&["--scope", "a.b", "--key", "k"])
            .map(drop)
            .expect_err("neither");
        let message = missing.to_string();
        assert!(
            message.contains("--tenant") && message.contains("--shared"),
            "a missing tenant names both ways: {message}"
        );
        parse_inspect(&["--scope", "a.b", "--key", "k", "--tenant", "t", "--shared"])
            .map(drop)
            .expect_err("both");
        parse_inspect(&["--scope", "a.b", "--key", "k", "--tenant", "t"]).expect("a tenant");
        parse_inspect(&["--scope", "a.b", "--key", "k", "--shared"]).expect("the shared namespace");
    }

    #[test]
    fn a_value_attached_with_equals_is_taken_even_when_it_looks_like_an_option() {
        let parse = |args: &[&str]| {
            let mut all = vec!["idempotent", "release", "--database-url", "sqlite::memory:"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all.into_iter().flat_map(split_attached_values))
        };
        let ok = parse(&[
            "--scope=a.b",
            "--tenant=--shared",
            "--key=--json",
            "--reason=--even-if-running",
        ])
        .expect("attached values");
        let Command::Release { record, reason, .. } = ok.command else {
            panic!("release");
        };
        assert_eq!(
            (
                record.scope.as_str(),
                record.tenant.as_deref(),
                record.key.as_str(),
                reason.as_str()
            ),
            ("a.b", Some("--shared"), "--json", "--even-if-running")
        );
        let ok = parse(&[
            "--scope",
            "a.b",
            "--tenant",
            "t",
            "--key=--key=x",
            "--reason",
            "r",
        ])
        .expect("a value with = in it");
        let Command::Release { record, .. } = ok.command else {
            panic!("release");
        };
        assert_eq!(record.key, "--key=x");
        // A value that starts with the mark itself (only `run_from` can be
        // given one) keeps it: it is not taken for another, valid, tenant.
        let given_apart = parse(&[
            "--scope", "a.b", "--tenant", "\0acme", "--key", "k", "--reason", "r",
        ]);
        let attached = parse(&[
            "--scope",
            "a.b",
            "--tenant=\0acme",
            "--key",
            "k",
            "--reason",
            "r",
        ]);
        for parsed in [given_apart, attached] {
            let Command::Release { record, .. } = parsed.expect("parses").command else {
                panic!("release");
            };
            assert_eq!(record.tenant.as_deref(), Some("\0acme"));
        }
        // Given apart, it is still an option missing its value.
        let e = parse(&[
            "--scope", "a.b", "--tenant", "t", "--key", "--json", "--reason", "r",
        ])
        .expect_err("missing value");
        assert!(e.to_string().contains("missing its value"), "{e}");
    }
}
