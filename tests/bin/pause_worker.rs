//! The worker the pause tests (`tests/multiprocess/pause.rs`) stop with
//! SIGSTOP and resume with SIGCONT: one OS process making one idempotent call
//! against a SQLite file shared by processes, PostgreSQL or MariaDB.
//!
//! ```text
//! idempotent-pause-worker <sqlite|pg|mysql> <url> <mode> <tenant> <key> <effects_dir> <body_ms>
//! ```
//!
//! Every body creates one file in `effects_dir` (named `<pid>-<uuid>`: a
//! body run, counted by the test; no database write, so the count does not
//! depend on the store), prints `body <pid>`, sleeps until `body_ms` after
//! it printed (a process stopped meanwhile sleeps what is left), prints
//! `returning <pid>` and returns its pid. Each line is flushed at once, so
//! the test knows where to stop the process. The call's answer is the last
//! line: `executed <pid>`, `replayed <pid>`, `recovered <pid>`,
//! `in_progress`, `lease_lost`, or `error <message>`.
//!
//! Modes:
//! * `store` (scope `pause.store`): store mode, lease 1 s, `in_progress = wait("20s")`.
//! * `recover` (scope `pause.recover`): the same, with `recover = found`: the
//!   hook prints `asked <attempt>` and answers `Completed(<pid>)` with the pid
//!   of the first effect file, or `Run` when there is none. With
//!   `IDEMPOTENT_PAUSE_HOOK_MS` set, the hook looks, prints `asked`, sleeps
//!   until that long after it began, then prints
//!   `hook answers <attempt> <run|completed>`.
//! * `wait` (scope `pause.wait`): store mode, lease 30 s, `in_progress = wait("2s")`.
//! * `tx` (scope `pause.tx_<backend>`): transactional mode on a transaction of
//!   the store's pool, `in_progress = wait("2s")`, lease 1 s; prints
//!   `called` once the call returned, then commits.

use idempotent_runtime::{
    idempotent, with_outcome, Error, MySqlStore, Outcome, PgStore, Recovery, SqliteStore, Store,
    Takeover,
};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Done {
    pid: u32,
}

/// The folder the bodies write their effect files to.
static EFFECTS: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn say(line: &str) {
    println!("{line}");
    let _ = std::io::stdout().flush();
}

/// The pids of the effect files written so far, oldest name first.
fn effect_pids() -> Vec<u32> {
    let Some(dir) = EFFECTS.get() else {
        return Vec::new();
    };
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
        .iter()
        .filter_map(|n| n.split('-').next().and_then(|p| p.parse().ok()))
        .collect()
}

/// The body: one effect file, then `body_ms` of work.
async fn body(body_ms: u64) -> Result<Done, Error> {
    let pid = std::process::id();
    if let Some(dir) = EFFECTS.get() {
        let name = dir.join(format!("{pid}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::write(name, b"ran").map_err(|e| {
            Error::Store(idempotent_runtime::StoreError::new(
                "test",
                "write the effect file",
                e,
            ))
        })?;
    }
    // As in `found`: the deadline is set before the line is printed.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(body_ms);
    say(&format!("body {pid}"));
    tokio::time::sleep_until(deadline).await;
    say(&format!("returning {pid}"));
    Ok(Done { pid })
}

/// Rule 20: did a previous attempt run? Its effect file says so.
async fn found(takeover: &Takeover) -> Result<Recovery<Done>, Error> {
    // The deadline is set, and the answer decided, before the line is
    // printed: a process stopped right after it answers what it found, and
    // sleeps only what is left of the deadline once resumed.
    let hook_ms: u64 = std::env::var("IDEMPOTENT_PAUSE_HOOK_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(0);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(hook_ms);
    let answer = match effect_pids().first() {
        Some(&pid) => Recovery::Completed(Done { pid }),
        None => Recovery::Run,
    };
    say(&format!("asked {}", takeover.attempt()));
    tokio::time::sleep_until(deadline).await;
    say(&format!(
        "hook answers {} {}",
        takeover.attempt(),
        if matches!(answer, Recovery::Run) {
            "run"
        } else {
            "completed"
        }
    ));
    Ok(answer)
}

#[idempotent(scope = "pause.store", key = key, tenant = tenant, store = store, skip(body_ms),
             lease = "1s", in_progress = wait("20s"))]
async fn paused_store(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    body_ms: u64,
) -> Result<Done, Error> {
    body(body_ms).await
}

#[idempotent(scope = "pause.recover", key = key, tenant = tenant, store = store, skip(body_ms),
             lease = "1s", in_progress = wait("20s"), recover = found)]
async fn paused_recover(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    body_ms: u64,
) -> Result<Done, Error> {
    body(body_ms).await
}

#[idempotent(scope = "pause.wait", key = key, tenant = tenant, store = store, skip(body_ms),
             lease = "30s", in_progress = wait("2s"))]
async fn paused_wait(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    body_ms: u64,
) -> Result<Done, Error> {
    body(body_ms).await
}

#[idempotent(scope = "pause.tx_sqlite", key = key, tenant = tenant, tx = tx, skip(body_ms),
             lease = "1s", in_progress = wait("2s"))]
async fn paused_tx_sqlite(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
    body_ms: u64,
) -> Result<Done, Error> {
    body(body_ms).await
}

#[idempotent(scope = "pause.tx_pg", key = key, tenant = tenant, tx = tx, skip(body_ms),
             lease = "1s", in_progress = wait("2s"))]
async fn paused_tx_pg(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
    body_ms: u64,
) -> Result<Done, Error> {
    body(body_ms).await
}

#[idempotent(scope = "pause.tx_mysql", key = key, tenant = tenant, tx = tx, skip(body_ms),
             lease = "1s", in_progress = wait("2s"))]
async fn paused_tx_mysql(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
    body_ms: u64,
) -> Result<Done, Error> {
    body(body_ms).await
}

fn report(result: Result<Done, Error>, outcome: Option<Outcome>) {
    match (result, outcome) {
        (Ok(d), Some(Outcome::Replayed)) => say(&format!("replayed {}", d.pid)),
        (Ok(d), Some(Outcome::Recovered)) => say(&format!("recovered {}", d.pid)),
        (Ok(d), _) => say(&format!("executed {}", d.pid)),
        (Err(Error::InProgress { .. }), _) => say("in_progress"),
        (Err(Error::LeaseLost(_)), _) => say("lease_lost"),
        (Err(e), _) => say(&format!("error {}", e.to_string().replace('\n', " "))),
    }
}

/// A transactional call on a transaction of `pool`, committed when the call
/// returned (whatever it answered: a replay or a refusal wrote nothing).
macro_rules! in_transaction {
    ($pool:expr, $call:ident, $tenant:expr, $key:expr, $body_ms:expr) => {{
        match $pool.begin().await {
            Ok(mut tx) => {
                let (r, o) = with_outcome($call(&mut tx, $tenant, $key, $body_ms)).await;
                say("called");
                match tx.commit().await {
                    Ok(()) => report(r, o),
                    Err(e) => say(&format!("error commit: {e}")),
                }
            }
            Err(e) => say(&format!("error begin: {e}")),
        }
    }};
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, backend, url, mode, tenant, key, effects, body_ms] = &args[..] else {
        eprintln!(
            "usage: idempotent-pause-worker <sqlite|pg|mysql> <url> <mode> <tenant> <key> <effects_dir> <body_ms>"
        );
        std::process::exit(2);
    };
    let body_ms: u64 = body_ms.parse().unwrap_or(0);
    // The engine's logs on stderr, when asked for (`RUST_LOG=idempotent=info`).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let _ = EFFECTS.set(PathBuf::from(effects));
    let store: Box<dyn Store> = match backend.as_str() {
        "sqlite" => SqliteStore::connect(url)
            .await
            .map(|s| Box::new(s) as Box<dyn Store>),
        "pg" => PgStore::connect(url)
            .await
            .map(|s| Box::new(s) as Box<dyn Store>),
        _ => MySqlStore::connect(url)
            .await
            .map(|s| Box::new(s) as Box<dyn Store>),
    }
    .unwrap_or_else(|e| {
        say(&format!("error {e}"));
        std::process::exit(1);
    });
    say("connected");
    match mode.as_str() {
        "store" => {
            let (r, o) = with_outcome(paused_store(&*store, tenant, key, body_ms)).await;
            report(r, o);
        }
        "recover" => {
            let (r, o) = with_outcome(paused_recover(&*store, tenant, key, body_ms)).await;
            report(r, o);
        }
        "wait" => {
            let (r, o) = with_outcome(paused_wait(&*store, tenant, key, body_ms)).await;
            report(r, o);
        }
        "tx" => match backend.as_str() {
            "sqlite" => match SqliteStore::connect(url).await {
                Ok(s) => in_transaction!(s.pool(), paused_tx_sqlite, tenant, key, body_ms),
                Err(e) => say(&format!("error {e}")),
            },
            "pg" => match PgStore::connect(url).await {
                Ok(s) => in_transaction!(s.pool(), paused_tx_pg, tenant, key, body_ms),
                Err(e) => say(&format!("error {e}")),
            },
            _ => match MySqlStore::connect(url).await {
                Ok(s) => in_transaction!(s.pool(), paused_tx_mysql, tenant, key, body_ms),
                Err(e) => say(&format!("error {e}")),
            },
        },
        other => {
            say(&format!("error unknown mode {other}"));
            std::process::exit(2);
        }
    }
    store.finish_background_work(Duration::from_secs(15)).await;
}
