//! The `idempotent` command line, as library functions (the binary is a thin
//! `main` over [`run`]). Enabled by the `cli` feature.
//!
//! ```text
//! idempotent scopes [--manifest idempotent.toml] [--json]
//! idempotent audit  --database-url URL [--manifest idempotent.toml] [--json]
//! idempotent purge  --database-url URL [--batch 1000] [--json]
//! ```
//!
//! `--database-url` may also come from `DATABASE_URL`, which keeps passwords
//! out of the process list.
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
use crate::manifest::{Manifest, ManifestError};
use crate::purge::{purge_all, DEFAULT_BATCH};
use crate::registry::Format;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Inspect and maintain idempotency records: list the scopes of a manifest,
/// audit a store against it, purge expired records.
#[derive(Debug, Parser)]
#[command(name = "idempotent", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the scopes a manifest declares and the names it retired.
    Scopes {
        /// The scope manifest.
        #[arg(long, default_value = Manifest::FILE_NAME)]
        manifest: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Compare a store with the manifest: records per scope and state, stuck
    /// leases, expired records not yet purged, orphan scopes.
    Audit {
        /// The store: sqlite:PATH, postgres://..., mysql://... or mariadb://...
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        /// The scope manifest whose declared scopes count as claimed.
        #[arg(long, default_value = Manifest::FILE_NAME)]
        manifest: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete expired records now, in batches, until none is left.
    Purge {
        /// The store: sqlite:PATH, postgres://..., mysql://... or mariadb://...
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        /// Records deleted per statement.
        #[arg(long, default_value_t = DEFAULT_BATCH, value_parser = clap::value_parser!(u32).range(1..))]
        batch: u32,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
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
    /// The store could not be opened.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The store failed during the command.
    #[error(transparent)]
    Store(#[from] crate::Error),
}

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
    run(Cli::try_parse_from(args)?).await
}

/// Runs a parsed command; returns what it prints on stdout.
pub async fn run(cli: Cli) -> Result<String, CliError> {
    match cli.command {
        Command::Scopes { manifest, json } => Ok(Manifest::load(&manifest)?.render(format(json))),
        Command::Audit {
            database_url,
            manifest,
            json,
        } => {
            let manifest = Manifest::load(&manifest)?;
            let store = connect_url(&database_url).await?;
            let report = audit(&*store, &KnownScope::from_manifest(&manifest)).await?;
            Ok(report.render(format(json)))
        }
        Command::Purge {
            database_url,
            batch,
            json,
        } => {
            let store = connect_url(&database_url).await?;
            let deleted = purge_all(&*store, batch)
                .await
                .map_err(crate::Error::from)?;
            Ok(render_purge(store.name(), deleted, batch, format(json)))
        }
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
