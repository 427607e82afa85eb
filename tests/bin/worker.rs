//! A test worker: one OS process making one idempotent call against a shared
//! PostgreSQL or MariaDB database, or a SQLite file. The multi-process and crash tests start
//! many of these at once and count the side effects their bodies wrote.
//!
//! ```text
//! idempotent-worker <pg|mysql|sqlite> <url> <mode> <tenant> <key> <start_at_ms>
//! ```
//!
//! Every worker connects first, then waits until the wall clock reaches
//! `start_at_ms` (the start barrier), then calls. It prints one line:
//! `executed <pid>`, `replayed <pid-of-the-executor>`, `in_progress`, or
//! `error <message>`.
//!
//! Modes:
//! * `once`: a body that writes a side-effect row and sleeps 300 ms (lease 30 s, wait up to 60 s).
//! * `hold`: lease 2 s; the body writes a side-effect row, prints `holding`, and
//!   sleeps for 10 minutes: the test kills it with SIGKILL.
//! * `takeover`: the same scope as `hold`; a short body, waiting up to 60 s.
//! * `tx-crash`: transactional mode (`tx = tx`, scope `worker.tx_pg` or
//!   `worker.tx_mysql`); the body writes a business row in the caller's
//!   transaction, the result is recorded in it, then the worker prints
//!   `before-commit` and sleeps until killed (the commit never happens).
//! * `recover-hold-after` / `recover-hold-before` (rule 20, scope
//!   `worker.recover`, lease 2 s, `recover = side_effect_happened`): the body
//!   writes its side-effect row and then prints `holding` (after), or prints
//!   `holding` before writing it (before), and sleeps until killed.
//! * `dropped-then-finish`: a `hold` call (scope `worker.crash`) is dropped
//!   while its body runs (the task is aborted); the worker then waits for the
//!   store's background work (`Store::finish_background_work`), prints
//!   `unfinished <n>` and returns from `main`. The record must be released
//!   before the process is gone.
//! * `recover-retry`: the same function, waiting up to 60 s: it takes the
//!   killed holder's record over and its hook looks the side effect up in
//!   the database by (tenant, key). The hook prints `asked <attempt>`; the
//!   call prints `recovered <pid>` (the pid that wrote the side effect) when
//!   the hook found it, `executed <pid>` when the body ran again.

use idempotent_runtime::{
    idempotent, with_outcome, Error, MySqlStore, Outcome, PgStore, Recovery, SqliteStore, Store,
    Takeover,
};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Done {
    pid: u32,
}

#[derive(Clone)]
enum Db {
    Pg(sqlx::PgPool),
    My(sqlx::MySqlPool),
    /// The store's own file (the side effects in a table beside its records).
    Lite(sqlx::SqlitePool),
}

/// The database, for the recover hook (a plain `async fn(&Takeover)`).
static DB: std::sync::OnceLock<Db> = std::sync::OnceLock::new();

/// Rule 20: did the crashed attempt write its side effect? Asked by the key.
async fn side_effect_happened(takeover: &Takeover) -> Result<Recovery<Done>, Error> {
    println!("asked {}", takeover.attempt());
    let _ = std::io::stdout().flush();
    let db = DB.get().expect("the database is set before any call");
    let wrote =
        |e: sqlx::Error| idempotent_runtime::StoreError::new("test", "look up the side effect", e);
    let pid: Option<i64> = match db {
        Db::Pg(p) => sqlx::query_scalar(
            "SELECT pid FROM idempotent_test_side_effects WHERE tenant = $1 AND idem_key = $2 LIMIT 1",
        )
        .bind(takeover.tenant())
        .bind(takeover.key())
        .fetch_optional(p)
        .await
        .map_err(wrote)?,
        Db::My(p) => sqlx::query_scalar(
            "SELECT pid FROM idempotent_test_side_effects WHERE tenant = ? AND idem_key = ? LIMIT 1",
        )
        .bind(takeover.tenant())
        .bind(takeover.key())
        .fetch_optional(p)
        .await
        .map_err(wrote)?,
        Db::Lite(p) => sqlx::query_scalar(
            "SELECT pid FROM idempotent_test_side_effects WHERE tenant = ? AND idem_key = ? LIMIT 1",
        )
        .bind(takeover.tenant())
        .bind(takeover.key())
        .fetch_optional(p)
        .await
        .map_err(wrote)?,
    };
    Ok(match pid {
        Some(pid) => Recovery::Completed(Done {
            pid: u32::try_from(pid).unwrap_or(0),
        }),
        None => Recovery::Run,
    })
}

/// When a holder stops for good.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hold {
    No,
    AfterSideEffect,
    BeforeSideEffect,
}

async fn hold_here() {
    println!("holding");
    let _ = std::io::stdout().flush();
    tokio::time::sleep(Duration::from_secs(600)).await;
}

#[idempotent(scope = "worker.recover", key = key, tenant = tenant, store = store, skip(db, hold),
             lease = "2s", in_progress = wait("60s"), recover = side_effect_happened)]
async fn recoverable(
    store: &dyn Store,
    db: &Db,
    tenant: &str,
    key: &str,
    hold: Hold,
) -> Result<Done, Error> {
    if hold == Hold::BeforeSideEffect {
        hold_here().await;
    }
    db.side_effect(tenant, key, "recover").await?;
    if hold == Hold::AfterSideEffect {
        hold_here().await;
    }
    Ok(Done {
        pid: std::process::id(),
    })
}

impl Db {
    /// How many side effects the bodies wrote for `(tenant, key)`.
    async fn side_effects(&self, tenant: &str, key: &str) -> i64 {
        let counted = match self {
            Db::Pg(p) => sqlx::query_scalar(
                "SELECT COUNT(*) FROM idempotent_test_side_effects WHERE tenant = $1 AND idem_key = $2",
            )
            .bind(tenant)
            .bind(key)
            .fetch_one(p)
            .await,
            Db::My(p) => sqlx::query_scalar(
                "SELECT COUNT(*) FROM idempotent_test_side_effects WHERE tenant = ? AND idem_key = ?",
            )
            .bind(tenant)
            .bind(key)
            .fetch_one(p)
            .await,
            Db::Lite(p) => sqlx::query_scalar(
                "SELECT COUNT(*) FROM idempotent_test_side_effects WHERE tenant = ? AND idem_key = ?",
            )
            .bind(tenant)
            .bind(key)
            .fetch_one(p)
            .await,
        };
        counted.unwrap_or(0)
    }

    async fn side_effect(&self, tenant: &str, key: &str, note: &str) -> Result<(), Error> {
        let pid = i64::from(std::process::id());
        let result = match self {
            Db::Pg(p) => sqlx::query(
                "INSERT INTO idempotent_test_side_effects (tenant, idem_key, pid, note) VALUES ($1, $2, $3, $4)",
            )
            .bind(tenant)
            .bind(key)
            .bind(pid)
            .bind(note)
            .execute(p)
            .await
            .map(drop),
            Db::My(p) => sqlx::query(
                "INSERT INTO idempotent_test_side_effects (tenant, idem_key, pid, note) VALUES (?, ?, ?, ?)",
            )
            .bind(tenant)
            .bind(key)
            .bind(pid)
            .bind(note)
            .execute(p)
            .await
            .map(drop),
            Db::Lite(p) => sqlx::query(
                "INSERT INTO idempotent_test_side_effects (tenant, idem_key, pid, note) VALUES (?, ?, ?, ?)",
            )
            .bind(tenant)
            .bind(key)
            .bind(pid)
            .bind(note)
            .execute(p)
            .await
            .map(drop),
        };
        result.map_err(|e| idempotent_runtime::StoreError::new("test", "side effect", e).into())
    }
}

#[idempotent(scope = "worker.once", key = key, tenant = tenant, store = store, skip(db),
             lease = "30s", in_progress = wait("60s"))]
async fn once(store: &dyn Store, db: &Db, tenant: &str, key: &str) -> Result<Done, Error> {
    db.side_effect(tenant, key, "once").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(Done {
        pid: std::process::id(),
    })
}

#[idempotent(scope = "worker.crash", key = key, tenant = tenant, store = store, skip(db, hold),
             lease = "2s", in_progress = wait("60s"))]
async fn crashable(
    store: &dyn Store,
    db: &Db,
    tenant: &str,
    key: &str,
    hold: bool,
) -> Result<Done, Error> {
    db.side_effect(tenant, key, if hold { "hold" } else { "takeover" })
        .await?;
    if hold {
        println!("holding");
        let _ = std::io::stdout().flush();
        tokio::time::sleep(Duration::from_secs(600)).await;
    }
    Ok(Done {
        pid: std::process::id(),
    })
}

#[idempotent(scope = "worker.tx_pg", key = key, tenant = tenant, tx = tx, ttl = "1h",
             in_progress = wait("5s"))]
async fn tx_charge_pg(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
) -> Result<Done, Error> {
    sqlx::query(
        "INSERT INTO idempotent_test_charges (tenant, idem_key, amount) VALUES ($1, $2, 1)",
    )
    .bind(tenant)
    .bind(key)
    .execute(&mut **tx)
    .await
    .map_err(|e| idempotent_runtime::StoreError::new("test", "business write", e))?;
    Ok(Done {
        pid: std::process::id(),
    })
}

#[idempotent(scope = "worker.tx_mysql", key = key, tenant = tenant, tx = tx, ttl = "1h",
             in_progress = wait("5s"))]
async fn tx_charge_mysql(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
) -> Result<Done, Error> {
    sqlx::query("INSERT INTO idempotent_test_charges (tenant, idem_key, amount) VALUES (?, ?, 1)")
        .bind(tenant)
        .bind(key)
        .execute(&mut **tx)
        .await
        .map_err(|e| idempotent_runtime::StoreError::new("test", "business write", e))?;
    Ok(Done {
        pid: std::process::id(),
    })
}

/// The body ran in this call (not a replay or a refusal).
fn executed(answer: (Result<Done, Error>, Option<Outcome>)) -> Result<(), String> {
    match answer {
        (Ok(_), Some(Outcome::Executed)) => Ok(()),
        (Ok(_), _) => Err("the reservation was not acquired (replayed)".into()),
        (Err(e), _) => Err(e.to_string()),
    }
}

/// Transactional mode, crashing between the body and the commit: the business
/// row and the recorded result are written in the transaction, which never commits.
async fn tx_crash(db: &Db, tenant: &str, key: &str) -> Result<(), String> {
    match db {
        Db::Pg(pool) => {
            let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
            executed(with_outcome(tx_charge_pg(&mut tx, tenant, key)).await)?;
            println!("before-commit");
            let _ = std::io::stdout().flush();
            tokio::time::sleep(Duration::from_secs(600)).await;
            tx.commit().await.map_err(|e| e.to_string())
        }
        Db::My(pool) => {
            let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
            executed(with_outcome(tx_charge_mysql(&mut tx, tenant, key)).await)?;
            println!("before-commit");
            let _ = std::io::stdout().flush();
            tokio::time::sleep(Duration::from_secs(600)).await;
            tx.commit().await.map_err(|e| e.to_string())
        }
        Db::Lite(_) => Err("tx-crash is not a SQLite mode".into()),
    }
}

fn report(result: Result<Done, Error>, outcome: Option<Outcome>) {
    match (result, outcome) {
        (Ok(d), Some(Outcome::Replayed)) => println!("replayed {}", d.pid),
        (Ok(d), Some(Outcome::Recovered)) => println!("recovered {}", d.pid),
        (Ok(d), _) => println!("executed {}", d.pid),
        (Err(Error::InProgress { .. }), _) => println!("in_progress"),
        (Err(e), _) => println!("error {e}"),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, backend, url, mode, tenant, key, start_at] = &args[..] else {
        eprintln!(
            "usage: idempotent-worker <pg|mysql|sqlite> <url> <mode> <tenant> <key> <start_at_ms>"
        );
        std::process::exit(2);
    };
    let start_at: u64 = start_at.parse().unwrap_or(0);
    let (store, db): (Box<dyn Store>, Db) = match backend.as_str() {
        "pg" => match PgStore::connect(url).await {
            Ok(s) => {
                let pool = s.pool().clone();
                (Box::new(s), Db::Pg(pool))
            }
            Err(e) => {
                println!("error {e}");
                std::process::exit(1);
            }
        },
        "sqlite" => match SqliteStore::connect(url).await {
            Ok(s) => {
                let pool = s.pool().clone();
                (Box::new(s), Db::Lite(pool))
            }
            Err(e) => {
                println!("error {e}");
                std::process::exit(1);
            }
        },
        _ => match MySqlStore::connect(url).await {
            Ok(s) => {
                let pool = s.pool().clone();
                (Box::new(s), Db::My(pool))
            }
            Err(e) => {
                println!("error {e}");
                std::process::exit(1);
            }
        },
    };
    // The start barrier: every worker calls at the same wall-clock instant.
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    if start_at > now_ms {
        tokio::time::sleep(Duration::from_millis((start_at - now_ms).min(60_000))).await;
    }
    match mode.as_str() {
        "once" => {
            let (r, o) = with_outcome(once(&*store, &db, tenant, key)).await;
            report(r, o);
        }
        "hold" | "takeover" => {
            let (r, o) = with_outcome(crashable(&*store, &db, tenant, key, mode == "hold")).await;
            report(r, o);
        }
        "recover-hold-after" | "recover-hold-before" | "recover-retry" => {
            let _ = DB.set(db.clone());
            let hold = match mode.as_str() {
                "recover-hold-after" => Hold::AfterSideEffect,
                "recover-hold-before" => Hold::BeforeSideEffect,
                _ => Hold::No,
            };
            let (r, o) = with_outcome(recoverable(&*store, &db, tenant, key, hold)).await;
            report(r, o);
        }
        "dropped-then-finish" => {
            let store: std::sync::Arc<dyn Store> = store.into();
            let call = tokio::spawn({
                let (store, db) = (store.clone(), db.clone());
                let (tenant, key) = (tenant.clone(), key.clone());
                async move {
                    let _ = crashable(&*store, &db, &tenant, &key, true).await;
                }
            });
            // The body is running once its side effect is there.
            let identity = idempotent_runtime::Identity::new(tenant, "worker.crash", key)
                .expect("a valid identity");
            for _ in 0..1000 {
                if db.side_effects(tenant, key).await > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let held = store.fetch(&identity).await.ok().flatten().is_some();
            call.abort();
            let _ = call.await;
            let unfinished = store.finish_background_work(Duration::from_secs(30)).await;
            println!("held {held} unfinished {unfinished}");
        }
        "tx-crash" => {
            if let Err(e) = tx_crash(&db, tenant, key).await {
                println!("error {e}");
            }
        }
        other => {
            println!("error unknown mode {other}");
            std::process::exit(2);
        }
    }
}
