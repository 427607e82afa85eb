//! The soak worker: one OS process looping over random keys of one tenant,
//! making idempotent calls against PostgreSQL or MariaDB until its call count
//! or its deadline runs out. `tests/multiprocess/soak.rs` keeps several of these running and
//! SIGKILLs them at random points.
//!
//! ```text
//! idempotent-soak-worker <pg|mysql> <url> <store|tx> <tenant> <run_start_ms> <epoch_ms>
//!                        <keys> <calls> <deadline_ms>
//! ```
//!
//! Keys: the run is cut into epochs of `epoch_ms` (wall clock from
//! `run_start_ms`, the same for every worker of the run); a call picks one of
//! `keys` keys `g<epoch>-k<i>` of the current epoch, or (one call in four) of
//! the previous one, so a small set of keys is hot at any moment and fresh
//! executions keep happening.
//!
//! Every body writes one effect row `(tenant, key, attempt)` to
//! `idempotent_soak_effects`, where `attempt` is a fresh UUID, and returns the
//! attempt id, which is what gets recorded.
//! * `store`: `store = store`, lease 1 s, `in_progress = wait("3s")`; the
//!   effect is a separate autocommit statement (outside the store).
//! * `tx`: `tx = tx` on a real transaction (`pool.begin()`); the effect is
//!   written in that transaction, which the worker commits after the call.
//!
//! The worker reports its phases on stdout, one line each, flushed at once, so
//! the test knows the last phase a killed worker reached:
//!
//! ```text
//! call <key>                  about to call (the reservation is in flight)
//! reserved <key> <attempt>    the body runs: the reservation is held
//! effect <key> <attempt>      the effect row is written (store: committed)
//! recorded <key> <attempt>    tx only: the call returned; the commit is in flight
//! executed <key> <attempt>    the body's result is recorded (tx: committed)
//! replayed <key> <attempt>    the recorded result came back, naming its attempt
//! refused <key>               Error::InProgress after the wait
//! error <key> <kind> <message>
//! done
//! ```

use idempotent_runtime::{idempotent, with_outcome, Error, MySqlStore, Outcome, PgStore, Store};
use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Pauses inside one call, in milliseconds: after `reserved`, after `effect`,
/// and (tx) after `recorded`. Random per call, so kills land mid-body.
#[derive(Clone, Copy)]
struct Pace {
    after_reserved: u64,
    after_effect: u64,
    before_commit: u64,
}

/// A small xorshift generator; the seed comes from a v4 UUID.
struct Rng(u64);

impl Rng {
    fn new() -> Self {
        let seed = uuid::Uuid::new_v4().as_u64_pair().0 | 1;
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Uniform in `lo..hi` (`hi > lo`).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One phase line, flushed before anything else happens.
fn phase(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn sleep_ms(ms: u64) -> tokio::time::Sleep {
    tokio::time::sleep(Duration::from_millis(ms))
}

/// A short name for an error: the variant, and for a store error the
/// operation and the database's error code (e.g. `Store:reserve:1213`).
fn kind(e: &Error) -> String {
    match e {
        Error::Store(s) => format!("Store:{}:{}", s.operation, db_code(&*s.source)),
        other => {
            let debug = format!("{other:?}");
            debug
                .split(|c: char| !c.is_alphanumeric())
                .next()
                .unwrap_or("?")
                .to_owned()
        }
    }
}

/// The database error code behind an error, or the sqlx error's kind.
fn db_code(e: &(dyn std::error::Error + 'static)) -> String {
    let mut current = Some(e);
    while let Some(err) = current {
        if let Some(sqlx_error) = err.downcast_ref::<sqlx::Error>() {
            return sqlx_code(sqlx_error);
        }
        current = err.source();
    }
    "other".into()
}

fn sqlx_code(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(d) => {
            let state = d.code().map(|c| c.into_owned()).unwrap_or("db".into());
            match d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                // MySQL's own error number first (1213 deadlock, 1205 lock wait timeout).
                Some(my) => format!("{}/{state}", my.number()),
                None => state,
            }
        }
        sqlx::Error::Io(_) => "io".into(),
        sqlx::Error::PoolTimedOut => "pool-timeout".into(),
        sqlx::Error::PoolClosed => "pool-closed".into(),
        sqlx::Error::Protocol(_) => "protocol".into(),
        _ => "sqlx".into(),
    }
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

fn effect_failed(e: sqlx::Error) -> Error {
    idempotent_runtime::StoreError::new("test", "effect", e).into()
}

// ------------------------------------------------------------- store mode

#[derive(Clone)]
enum Db {
    Pg(sqlx::PgPool),
    My(sqlx::MySqlPool),
}

#[idempotent(scope = "soak.store", key = key, tenant = tenant, store = store, skip(db, pace),
             lease = "1s", in_progress = wait("3s"), ttl = "1h")]
async fn store_call(
    store: &dyn Store,
    db: &Db,
    tenant: &str,
    key: &str,
    pace: Pace,
) -> Result<String, Error> {
    let attempt = uuid::Uuid::new_v4().to_string();
    phase(&format!("reserved {key} {attempt}"));
    sleep_ms(pace.after_reserved).await;
    // The side effect, outside the store: its own autocommit statement.
    let pid = i64::from(std::process::id());
    match db {
        Db::Pg(p) => {
            sqlx::query(
                "INSERT INTO idempotent_soak_effects (tenant, idem_key, attempt, pid) VALUES ($1, $2, $3, $4)",
            )
            .bind(tenant)
            .bind(key)
            .bind(&attempt)
            .bind(pid)
            .execute(p)
            .await
            .map_err(effect_failed)?;
        }
        Db::My(p) => {
            sqlx::query(
                "INSERT INTO idempotent_soak_effects (tenant, idem_key, attempt, pid) VALUES (?, ?, ?, ?)",
            )
            .bind(tenant)
            .bind(key)
            .bind(&attempt)
            .bind(pid)
            .execute(p)
            .await
            .map_err(effect_failed)?;
        }
    }
    phase(&format!("effect {key} {attempt}"));
    sleep_ms(pace.after_effect).await;
    Ok(attempt)
}

// ----------------------------------------------------- transactional mode

#[idempotent(scope = "soak.tx_pg", key = key, tenant = tenant, tx = tx, skip(pace),
             in_progress = wait("3s"), ttl = "1h")]
async fn tx_call_pg(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
    pace: Pace,
) -> Result<String, Error> {
    let attempt = uuid::Uuid::new_v4().to_string();
    phase(&format!("reserved {key} {attempt}"));
    sleep_ms(pace.after_reserved).await;
    sqlx::query(
        "INSERT INTO idempotent_soak_effects (tenant, idem_key, attempt, pid) VALUES ($1, $2, $3, $4)",
    )
    .bind(tenant)
    .bind(key)
    .bind(&attempt)
    .bind(i64::from(std::process::id()))
    .execute(&mut **tx)
    .await
    .map_err(effect_failed)?;
    phase(&format!("effect {key} {attempt}"));
    sleep_ms(pace.after_effect).await;
    Ok(attempt)
}

#[idempotent(scope = "soak.tx_mysql", key = key, tenant = tenant, tx = tx, skip(pace),
             in_progress = wait("3s"), ttl = "1h")]
async fn tx_call_mysql(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
    pace: Pace,
) -> Result<String, Error> {
    let attempt = uuid::Uuid::new_v4().to_string();
    phase(&format!("reserved {key} {attempt}"));
    sleep_ms(pace.after_reserved).await;
    sqlx::query(
        "INSERT INTO idempotent_soak_effects (tenant, idem_key, attempt, pid) VALUES (?, ?, ?, ?)",
    )
    .bind(tenant)
    .bind(key)
    .bind(&attempt)
    .bind(i64::from(std::process::id()))
    .execute(&mut **tx)
    .await
    .map_err(effect_failed)?;
    phase(&format!("effect {key} {attempt}"));
    sleep_ms(pace.after_effect).await;
    Ok(attempt)
}

/// What a call's answer prints (store mode, or tx mode after the commit).
fn answer_line(key: &str, result: Result<String, Error>, outcome: Option<Outcome>) -> String {
    match (result, outcome) {
        (Ok(a), Some(Outcome::Replayed)) => format!("replayed {key} {a}"),
        (Ok(a), Some(Outcome::Executed)) => format!("executed {key} {a}"),
        (Ok(a), None) => format!("error {key} NoOutcome the call reported no outcome ({a})"),
        (Ok(a), Some(Outcome::Recovered)) => {
            format!("error {key} Recovered no recover hook is set, yet one answered ({a})")
        }
        (Err(Error::InProgress { .. }), _) => format!("refused {key}"),
        (Err(e), _) => format!("error {key} {} {}", kind(&e), one_line(&e.to_string())),
    }
}

/// Transactional mode: begin, call, (report `recorded`), commit or roll back.
macro_rules! tx_round {
    ($pool:expr, $call:ident, $tenant:expr, $key:expr, $pace:expr) => {{
        match $pool.begin().await {
            Err(e) => format!(
                "error {} begin:{} {}",
                $key,
                sqlx_code(&e),
                one_line(&e.to_string())
            ),
            Ok(mut tx) => {
                let (result, outcome) = with_outcome($call(&mut tx, $tenant, $key, $pace)).await;
                match result {
                    Ok(a) => {
                        if outcome == Some(Outcome::Executed) {
                            phase(&format!("recorded {} {a}", $key));
                            sleep_ms($pace.before_commit).await;
                        }
                        match tx.commit().await {
                            Ok(()) => answer_line($key, Ok(a), outcome),
                            Err(e) => format!(
                                "error {} commit:{} {}",
                                $key,
                                sqlx_code(&e),
                                one_line(&e.to_string())
                            ),
                        }
                    }
                    Err(e) => {
                        let _ = tx.rollback().await;
                        answer_line($key, Err(e), outcome)
                    }
                }
            }
        }
    }};
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, backend, url, mode, tenant, run_start, epoch_ms, keys, calls, deadline] = &args[..]
    else {
        eprintln!(
            "usage: idempotent-soak-worker <pg|mysql> <url> <store|tx> <tenant> <run_start_ms> \
             <epoch_ms> <keys> <calls> <deadline_ms>"
        );
        std::process::exit(2);
    };
    let number = |s: &str| -> u64 {
        s.parse().unwrap_or_else(|_| {
            eprintln!("soak worker: not a number: {s}");
            std::process::exit(2)
        })
    };
    let (run_start, epoch_ms, keys, calls, deadline) = (
        number(run_start),
        number(epoch_ms).max(1),
        number(keys).max(1),
        number(calls),
        number(deadline),
    );
    let tx_mode = match mode.as_str() {
        "store" => false,
        "tx" => true,
        other => {
            eprintln!("soak worker: unknown mode {other}");
            std::process::exit(2);
        }
    };
    let (store, db): (Box<dyn Store>, Db) = match backend.as_str() {
        "pg" => match PgStore::connect(url).await {
            Ok(s) => {
                let pool = s.pool().clone();
                (Box::new(s), Db::Pg(pool))
            }
            Err(e) => {
                phase(&format!("error - connect {}", one_line(&e.to_string())));
                std::process::exit(1);
            }
        },
        "mysql" => match MySqlStore::connect(url).await {
            Ok(s) => {
                let pool = s.pool().clone();
                (Box::new(s), Db::My(pool))
            }
            Err(e) => {
                phase(&format!("error - connect {}", one_line(&e.to_string())));
                std::process::exit(1);
            }
        },
        other => {
            eprintln!("soak worker: unknown backend {other}");
            std::process::exit(2);
        }
    };

    let mut rng = Rng::new();
    for _ in 0..calls {
        if now_ms() >= deadline {
            break;
        }
        let mut epoch = now_ms().saturating_sub(run_start) / epoch_ms;
        if epoch > 0 && rng.range(0, 4) == 0 {
            epoch -= 1;
        }
        let key = format!("g{epoch}-k{}", rng.range(0, keys));
        let pace = Pace {
            after_reserved: rng.range(0, 25),
            after_effect: rng.range(0, 60),
            before_commit: rng.range(0, 30),
        };
        phase(&format!("call {key}"));
        let line = match (&db, tx_mode) {
            (db, false) => {
                let (result, outcome) =
                    with_outcome(store_call(&*store, db, tenant, &key, pace)).await;
                answer_line(&key, result, outcome)
            }
            (Db::Pg(pool), true) => tx_round!(pool, tx_call_pg, tenant, &key, pace),
            (Db::My(pool), true) => tx_round!(pool, tx_call_mysql, tenant, &key, pace),
        };
        phase(&line);
        sleep_ms(rng.range(20, 80)).await;
    }
    phase("done");
}
