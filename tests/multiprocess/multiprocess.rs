//! Many OS processes on one identity, and a process killed while it holds a
//! lease, on PostgreSQL, on MariaDB and on one SQLite file. Exactly-once is proven by counting the
//! side-effect rows the bodies wrote in the same database. Rule 20 across
//! processes: a holder SIGKILLed after (or before) its side effect, and a
//! retry in another process whose `recover` hook asks the database.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, mysql_url, pg_store_or_skip, pg_url};
use idempotent_runtime::{Fenced, OwnerToken, Reservation, ReserveRequest, Store};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const WORKER: &str = env!("CARGO_BIN_EXE_idempotent-worker");
const PROCESSES: usize = 8;

#[derive(Clone, Copy)]
enum Backend {
    Pg,
    MySql,
    /// One SQLite file ([`sqlite_file_url`]) shared by the test and its workers.
    Sqlite,
}

/// The SQLite file of this test process (nextest runs each test in a
/// process of its own; every test has its own tenant anyway).
fn sqlite_file_url() -> String {
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(|| common::scratch::sqlite_url("multiprocess"))
        .clone()
}

impl Backend {
    fn arg(self) -> &'static str {
        match self {
            Backend::Pg => "pg",
            Backend::MySql => "mysql",
            Backend::Sqlite => "sqlite",
        }
    }
    fn url(self) -> String {
        match self {
            Backend::Pg => pg_url(),
            Backend::MySql => mysql_url(),
            Backend::Sqlite => sqlite_file_url(),
        }
    }
}

/// The side-effect table the workers' bodies write to.
async fn prepare(backend: Backend) -> Option<Box<dyn Store>> {
    match backend {
        Backend::Pg => {
            let store = pg_store_or_skip().await?;
            common::servers::pg_create_tables(
                store.pool(),
                "CREATE TABLE IF NOT EXISTS idempotent_test_side_effects (
                     tenant TEXT NOT NULL, idem_key TEXT NOT NULL, pid BIGINT NOT NULL, note TEXT NOT NULL);
                 CREATE TABLE IF NOT EXISTS idempotent_test_charges (
                     tenant TEXT NOT NULL, idem_key TEXT NOT NULL, amount BIGINT NOT NULL)",
            )
            .await
            .expect("create the side-effect tables");
            Some(Box::new(store))
        }
        Backend::MySql => {
            let store = mysql_store_or_skip().await?;
            for ddl in [
                "CREATE TABLE IF NOT EXISTS idempotent_test_side_effects (
                     tenant VARCHAR(100) NOT NULL, idem_key VARCHAR(255) NOT NULL,
                     pid BIGINT NOT NULL, note VARCHAR(20) NOT NULL) ENGINE = InnoDB",
                "CREATE TABLE IF NOT EXISTS idempotent_test_charges (
                     tenant VARCHAR(100) NOT NULL, idem_key VARCHAR(255) NOT NULL,
                     amount BIGINT NOT NULL) ENGINE = InnoDB",
            ] {
                sqlx::raw_sql(ddl)
                    .execute(store.pool())
                    .await
                    .expect("create the side-effect tables");
            }
            Some(Box::new(store))
        }
        Backend::Sqlite => {
            let store = idempotent_runtime::SqliteStore::connect(&sqlite_file_url())
                .await
                .expect("open the SQLite file");
            sqlx::raw_sql(
                "CREATE TABLE IF NOT EXISTS idempotent_test_side_effects (
                     tenant TEXT NOT NULL, idem_key TEXT NOT NULL, pid INTEGER NOT NULL,
                     note TEXT NOT NULL)",
            )
            .execute(store.pool())
            .await
            .expect("create the side-effect table");
            Some(Box::new(store))
        }
    }
}

async fn side_effects(backend: Backend, tenant: &str) -> i64 {
    match backend {
        Backend::Pg => {
            let pool = sqlx::PgPool::connect(&pg_url()).await.expect("connect");
            sqlx::query_scalar(
                "SELECT count(*) FROM idempotent_test_side_effects WHERE tenant = $1",
            )
            .bind(tenant)
            .fetch_one(&pool)
            .await
            .expect("count side effects")
        }
        Backend::MySql => {
            let pool = sqlx::MySqlPool::connect(&mysql_url())
                .await
                .expect("connect");
            sqlx::query_scalar("SELECT count(*) FROM idempotent_test_side_effects WHERE tenant = ?")
                .bind(tenant)
                .fetch_one(&pool)
                .await
                .expect("count side effects")
        }
        Backend::Sqlite => {
            let pool = sqlx::SqlitePool::connect(&sqlite_file_url())
                .await
                .expect("connect");
            sqlx::query_scalar("SELECT count(*) FROM idempotent_test_side_effects WHERE tenant = ?")
                .bind(tenant)
                .fetch_one(&pool)
                .await
                .expect("count side effects")
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn spawn(backend: Backend, mode: &str, tenant: &str, key: &str, start_at: u64) -> Child {
    Command::new(WORKER)
        .args([
            backend.arg(),
            &backend.url(),
            mode,
            tenant,
            key,
            &start_at.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the worker process")
}

/// Waits for every worker (each bounded by its own 60 s waits) and returns their output lines.
fn collect(children: Vec<Child>) -> Vec<String> {
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().expect("wait for the worker");
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        })
        .collect()
}

async fn exactly_one_execution(backend: Backend) {
    let Some(_store) = prepare(backend).await else {
        return;
    };
    let tenant = fresh_tenant();
    // Three seconds is enough for every process to start and connect; they
    // then call at the same wall-clock instant.
    let start_at = now_ms() + 3000;
    let children = (0..PROCESSES)
        .map(|_| spawn(backend, "once", &tenant, "same-key", start_at))
        .collect();
    let lines = tokio::task::spawn_blocking(move || collect(children))
        .await
        .expect("join");
    let executed: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("executed "))
        .collect();
    assert_eq!(executed.len(), 1, "exactly one process executes: {lines:?}");
    let executor = executed[0].trim_start_matches("executed ");
    for line in &lines {
        assert!(
            line == executed[0] || *line == format!("replayed {executor}"),
            "every other process replays the executor's result: {lines:?}"
        );
    }
    assert_eq!(
        side_effects(backend, &tenant).await,
        1,
        "one side effect in the database"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_one_execution_postgres() {
    exactly_one_execution(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_one_execution_mariadb() {
    exactly_one_execution(Backend::MySql).await;
}

/// Eight processes on one SQLite file: one runs the body, the others wait
/// (polling the file: another process's completion is not told in process)
/// and replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_one_execution_sqlite() {
    exactly_one_execution(Backend::Sqlite).await;
}

async fn crash_then_takeover(backend: Backend) {
    let Some(store) = prepare(backend).await else {
        return;
    };
    let tenant = fresh_tenant();
    let key = "crash-key";
    let mut holder = spawn(backend, "hold", &tenant, key, 0);
    let stdout = holder.stdout.take().expect("piped stdout");
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        line
    })
    .await
    .expect("join");
    assert_eq!(first.trim(), "holding", "the holder reached its body");

    // While the holder lives (and heartbeats), nobody else may execute.
    let identity =
        idempotent_runtime::Identity::new(&tenant, "worker.crash", key).expect("identity");
    let probe = OwnerToken::new();
    let answer = store
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &probe,
            lease: Duration::from_secs(2),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("probe");
    assert!(
        matches!(answer, Reservation::InProgress { .. }),
        "live lease: {answer:?}"
    );

    holder.kill().expect("SIGKILL the holder");
    let _ = holder.wait();

    // Eight processes at once: the lease runs out (2 s after the last
    // heartbeat), exactly one takes over and completes, the rest replay.
    let start_at = now_ms() + 2000;
    let children = (0..PROCESSES)
        .map(|_| spawn(backend, "takeover", &tenant, key, start_at))
        .collect();
    let lines = tokio::task::spawn_blocking(move || collect(children))
        .await
        .expect("join");
    let executed = lines.iter().filter(|l| l.starts_with("executed ")).count();
    let replayed = lines.iter().filter(|l| l.starts_with("replayed ")).count();
    assert_eq!((executed, replayed), (1, PROCESSES - 1), "{lines:?}");
    assert_eq!(
        side_effects(backend, &tenant).await,
        2,
        "the killed holder's side effect and the one takeover's"
    );
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(record.state, idempotent_runtime::RecordState::Complete);
}

/// Rule 14 at process exit: a call dropped while its body runs is released by
/// the store's background thread. A process that waits for that work
/// (`Store::finish_background_work`) before returning from `main` leaves the
/// key free; without the wait the thread dies with the process and the record
/// stays in progress for its lease.
async fn dropped_call_released_before_exit(backend: Backend) {
    let Some(store) = prepare(backend).await else {
        return;
    };
    let tenant = fresh_tenant();
    let key = "dropped-at-exit";
    let child = spawn(backend, "dropped-then-finish", &tenant, key, 0);
    let lines = tokio::task::spawn_blocking(move || collect(vec![child]))
        .await
        .expect("join");
    assert!(
        lines[0].ends_with("held true unfinished 0"),
        "the call held its record when it was dropped, and its release was finished: {lines:?}"
    );
    let identity =
        idempotent_runtime::Identity::new(&tenant, "worker.crash", key).expect("identity");
    let record = store.fetch(&identity).await.expect("fetch");
    assert!(
        record.is_none(),
        "the dropped call's record was released before its process exited: {record:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_call_is_released_before_the_process_exits_postgres() {
    dropped_call_released_before_exit(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_call_is_released_before_the_process_exits_mariadb() {
    dropped_call_released_before_exit(Backend::MySql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_is_taken_over_once_postgres() {
    crash_then_takeover(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_is_taken_over_once_mariadb() {
    crash_then_takeover(Backend::MySql).await;
}

/// A SQLite writer SIGKILLed holding its lease: eight processes on the file
/// come for the record, exactly one takes it over and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_is_taken_over_once_sqlite() {
    crash_then_takeover(Backend::Sqlite).await;
}

/// Rule 14 at process exit on SQLite: the store's releaser thread frees the
/// dropped call's record before `main` returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_call_is_released_before_the_process_exits_sqlite() {
    dropped_call_released_before_exit(Backend::Sqlite).await;
}

async fn crash_before_commit(backend: Backend) {
    let Some(store) = prepare(backend).await else {
        return;
    };
    let tenant = fresh_tenant();
    let key = "tx-crash-key";
    let mut worker = spawn(backend, "tx-crash", &tenant, key, 0);
    let stdout = worker.stdout.take().expect("piped stdout");
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        line
    })
    .await
    .expect("join");
    assert_eq!(first.trim(), "before-commit");
    worker
        .kill()
        .expect("SIGKILL between the body and the commit");
    let _ = worker.wait();

    let scope = match backend {
        Backend::Pg => "worker.tx_pg",
        Backend::MySql => "worker.tx_mysql",
        Backend::Sqlite => unreachable!("no transactional crash on SQLite here"),
    };
    let identity = idempotent_runtime::Identity::new(&tenant, scope, key).expect("identity");
    // The server notices the dead connection and rolls its transaction back,
    // which frees the row lock. Until then a reservation answers InProgress;
    // poll (bounded) until one is acquired: fresh, not a takeover, so no
    // record survived the crash.
    let token = OwnerToken::new();
    let request = ReserveRequest {
        identity: &identity,
        fingerprint: None,
        token: &token,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    };
    let mut answer = store.reserve(request).await.expect("reserve");
    for _ in 0..300 {
        if !matches!(answer, Reservation::InProgress { .. }) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        answer = store.reserve(request).await.expect("reserve");
    }
    assert_eq!(
        answer,
        Reservation::FRESH,
        "no record survives the crash; the retry executes"
    );
    assert_eq!(
        store.release(&identity, &token).await.expect("release"),
        Fenced::Written
    );
    let charges: i64 = match backend {
        Backend::Pg => {
            let pool = sqlx::PgPool::connect(&pg_url()).await.expect("connect");
            sqlx::query_scalar("SELECT count(*) FROM idempotent_test_charges WHERE tenant = $1")
                .bind(&tenant)
                .fetch_one(&pool)
                .await
                .expect("count")
        }
        Backend::MySql => {
            let pool = sqlx::MySqlPool::connect(&mysql_url())
                .await
                .expect("connect");
            sqlx::query_scalar("SELECT count(*) FROM idempotent_test_charges WHERE tenant = ?")
                .bind(&tenant)
                .fetch_one(&pool)
                .await
                .expect("count")
        }
        Backend::Sqlite => unreachable!("no transactional crash on SQLite here"),
    };
    assert_eq!(charges, 0, "no business row survives the crash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_body_and_commit_leaves_nothing_postgres() {
    crash_before_commit(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_body_and_commit_leaves_nothing_mariadb() {
    crash_before_commit(Backend::MySql).await;
}

/// Starts a holder in `mode`, waits until it reports `holding` (its body
/// reached the crash point), and SIGKILLs it. Returns its pid.
async fn kill_holder(backend: Backend, mode: &str, tenant: &str, key: &str) -> u32 {
    let mut holder = spawn(backend, mode, tenant, key, 0);
    let pid = holder.id();
    let stdout = holder.stdout.take().expect("piped stdout");
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        line
    })
    .await
    .expect("join");
    assert_eq!(
        first.trim(),
        "holding",
        "the holder reached its crash point"
    );
    holder.kill().expect("SIGKILL the holder");
    let _ = holder.wait();
    pid
}

/// Runs one `recover-retry` worker to the end; returns its output lines.
async fn retry(backend: Backend, tenant: &str, key: &str) -> Vec<String> {
    let child = spawn(backend, "recover-retry", tenant, key, 0);
    let out = tokio::task::spawn_blocking(move || collect(vec![child]))
        .await
        .expect("join");
    out[0].lines().map(str::to_owned).collect()
}

async fn record_of(
    store: &dyn Store,
    tenant: &str,
    key: &str,
) -> idempotent_runtime::RecordSnapshot {
    let identity =
        idempotent_runtime::Identity::new(tenant, "worker.recover", key).expect("identity");
    store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("the record")
}

/// Rule 20 across processes: the holder wrote its side effect and was killed
/// before recording it. A retry in another process takes the record over as
/// attempt 2; its hook finds the side effect and answers `Completed`: the
/// retry returns the killed holder's result, and there is exactly one side effect.
async fn crash_after_side_effect_recovered(backend: Backend) {
    let Some(store) = prepare(backend).await else {
        return;
    };
    let tenant = fresh_tenant();
    let key = "recover-after";
    let holder = kill_holder(backend, "recover-hold-after", &tenant, key).await;
    assert_eq!(
        side_effects(backend, &tenant).await,
        1,
        "the holder's side effect"
    );

    let lines = retry(backend, &tenant, key).await;
    assert_eq!(
        lines,
        vec!["asked 2".to_owned(), format!("recovered {holder}")],
        "the hook is asked once, as attempt 2, and the holder's result is returned"
    );
    assert_eq!(
        side_effects(backend, &tenant).await,
        1,
        "exactly one side effect"
    );
    let record = record_of(&*store, &tenant, key).await;
    assert_eq!(
        (record.state, record.attempt, record.recovered),
        (idempotent_runtime::RecordState::Complete, 2, true)
    );
    // A later retry replays; the hook is not asked again.
    let again = retry(backend, &tenant, key).await;
    assert_eq!(again, vec![format!("replayed {holder}")]);
}

/// Rule 20 across processes: the holder was killed before its side effect.
/// The retry's hook finds nothing and answers `Run`: the body runs again, as
/// attempt 2, and there is exactly one side effect (the retry's).
async fn crash_before_side_effect_runs_again(backend: Backend) {
    let Some(store) = prepare(backend).await else {
        return;
    };
    let tenant = fresh_tenant();
    let key = "recover-before";
    let holder = kill_holder(backend, "recover-hold-before", &tenant, key).await;
    assert_eq!(side_effects(backend, &tenant).await, 0);

    let lines = retry(backend, &tenant, key).await;
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0], "asked 2");
    let executor: u32 = lines[1]
        .strip_prefix("executed ")
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("the retry runs the body: {lines:?}"));
    assert_ne!(executor, holder);
    assert_eq!(
        side_effects(backend, &tenant).await,
        1,
        "the retry's side effect only"
    );
    let record = record_of(&*store, &tenant, key).await;
    assert_eq!(
        (record.state, record.attempt, record.recovered),
        (idempotent_runtime::RecordState::Complete, 2, false)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_side_effect_is_recovered_postgres() {
    crash_after_side_effect_recovered(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_side_effect_is_recovered_mariadb() {
    crash_after_side_effect_recovered(Backend::MySql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_side_effect_runs_again_as_attempt_2_postgres() {
    crash_before_side_effect_runs_again(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_side_effect_runs_again_as_attempt_2_mariadb() {
    crash_before_side_effect_runs_again(Backend::MySql).await;
}

/// Rule 20 across processes on one SQLite file: the killed holder's side
/// effect is found by the retry's hook, in another process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_side_effect_is_recovered_sqlite() {
    crash_after_side_effect_recovered(Backend::Sqlite).await;
}
