//! Rule 2, second half: "Raw keys never appear in logs: log the scope and a
//! short digest." Every event at every level (TRACE included, dependencies'
//! too) and every span field is captured while one recognisable key goes
//! through each store's paths: executed, replayed, refused (fingerprint
//! mismatch), a body error released, a waiting duplicate, a call dropped
//! mid-body (the detached worker releases it), a call that crashed (the next
//! one takes over and asks the recover hook); then the `Display` and `Debug`
//! of every error those calls returned are searched too.

use crate::common::scratch::sqlite_url;
use crate::common::servers::{mysql_store_or_skip, pg_store_or_skip};
use crate::engine_accounting::capture_logs;
use idempotent_runtime::{idempotent, Error, MemoryStore, Recovery, SqliteStore, Store, Takeover};
use tokio::sync::Notify;

/// Where a body stops until it is let go (or for good, when `go` never comes).
#[derive(Default)]
struct Gate {
    entered: Notify,
    go: Notify,
}

async fn found(_: &Takeover) -> Result<Recovery<u64>, Error> {
    Ok(Recovery::Completed(77))
}

#[idempotent(scope = "leaks.charge", key = key, tenant = tenant, store = store, skip(gate),
             lease = "300ms", in_progress = wait("30s"), recover = found)]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    gate: Option<&Gate>,
) -> Result<u64, Error> {
    if let Some(gate) = gate {
        gate.entered.notify_one();
        gate.go.notified().await;
    }
    Ok(amount)
}

#[idempotent(scope = "leaks.failing", key = key, tenant = tenant, store = store)]
async fn failing(store: &dyn Store, tenant: &str, key: &str) -> Result<u64, Error> {
    Err(Error::NoDefaultStore {
        scope: "the body's own error".into(),
    })
}

/// Runs every path on `store` with keys and a tenant marked `KEYLEAK` and
/// `TENANTLEAK`; answers what the returned errors print.
async fn every_path(store: &dyn Store, label: &str) -> Vec<String> {
    let run = uuid::Uuid::new_v4();
    let tenant = format!("TENANTLEAK-{label}-{run}");
    let keys: Vec<String> = (0..6)
        .map(|n| format!("sk_live_KEYLEAK-{label}-{n}-{run}"))
        .collect();
    let key = |n: usize| keys[n].as_str();
    let mut printed = Vec::new();
    let mut keep = |e: &Error| {
        printed.push(e.to_string());
        printed.push(format!("{e:?}"));
        printed.push(format!("{e:#?}"));
    };

    assert_eq!(charge(store, &tenant, key(1), 1, None).await.unwrap(), 1);
    assert_eq!(charge(store, &tenant, key(1), 1, None).await.unwrap(), 1);
    let mismatch = charge(store, &tenant, key(1), 2, None).await.unwrap_err();
    assert!(
        matches!(mismatch, Error::FingerprintMismatch(_)),
        "{mismatch}"
    );
    keep(&mismatch);
    let own = failing(store, &tenant, key(2)).await.unwrap_err();
    keep(&own);

    // A waiting duplicate, answered when the first call records.
    let gate = Gate::default();
    let first = charge(store, &tenant, key(3), 3, Some(&gate));
    let second = async {
        gate.entered.notified().await;
        let waiting = charge(store, &tenant, key(3), 3, None);
        tokio::pin!(waiting);
        // The duplicate has reached its wait once a poll leaves it pending.
        assert!(futures::poll!(&mut waiting).is_pending());
        gate.go.notify_one();
        waiting.await
    };
    let (a, b) = tokio::join!(first, second);
    assert_eq!((a.unwrap(), b.unwrap()), (3, 3));

    // A call dropped mid-body (with a recover hook): the store's worker ends
    // its lease, and the next call (waiting for it) takes over and asks the hook.
    let gate = Gate::default();
    {
        let dropped = charge(store, &tenant, key(4), 4, Some(&gate));
        tokio::pin!(dropped);
        tokio::select! {
            _ = &mut dropped => panic!("the gated call finished"),
            _ = gate.entered.notified() => {}
        }
    }
    assert_eq!(charge(store, &tenant, key(4), 4, None).await.unwrap(), 77);

    // A call that crashed mid-body: its lease runs out and the next call
    // takes over, asking the recover hook.
    let gate = Gate::default();
    let mut crashed = Box::pin(charge(store, &tenant, key(5), 5, Some(&gate)));
    tokio::select! {
        _ = &mut crashed => panic!("the gated call finished"),
        _ = gate.entered.notified() => {}
    }
    std::mem::forget(crashed);
    assert_eq!(charge(store, &tenant, key(5), 5, None).await.unwrap(), 77);
    printed
}

fn assert_no_raw_identity(logs: &std::sync::Mutex<String>, printed: &[String]) {
    let text = logs.lock().unwrap().clone();
    assert!(
        text.contains("leaks.charge") && text.contains("took over"),
        "the run was logged:\n{text}"
    );
    assert_neither_key_nor_tenant(&text, printed);
}

/// No log line names the raw key or tenant (the span and events carry a
/// digest of the identity), and no printed error the raw key.
fn assert_neither_key_nor_tenant(text: &str, printed: &[String]) {
    let leaked: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("KEYLEAK") || l.contains("TENANTLEAK"))
        .collect();
    assert!(
        leaked.is_empty(),
        "a raw key reached the logs:\n{}",
        leaked.join("\n")
    );
    for p in printed {
        assert!(!p.contains("KEYLEAK"), "an error shows the raw key: {p}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_at_any_level_names_the_raw_key_on_memory() {
    let logs = capture_logs();
    let store = MemoryStore::new();
    let printed = every_path(&store, "memory").await;
    assert_no_raw_identity(&logs, &printed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_at_any_level_names_the_raw_key_on_sqlite() {
    let logs = capture_logs();
    let store = SqliteStore::connect(&sqlite_url("key_in_logs"))
        .await
        .expect("sqlite file");
    let printed = every_path(&store, "sqlite").await;
    assert_no_raw_identity(&logs, &printed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_at_any_level_names_the_raw_key_on_postgres() {
    let logs = capture_logs();
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let printed = every_path(&store, "postgres").await;
    assert_no_raw_identity(&logs, &printed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_at_any_level_names_the_raw_key_on_mysql() {
    let logs = capture_logs();
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let printed = every_path(&store, "mysql").await;
    assert_no_raw_identity(&logs, &printed);
}

// ------------------------------------------------------- transactional mode

#[idempotent(scope = "leaks.tx_sqlite", key = key, tenant = tenant, tx = tx, in_progress = reject)]
async fn in_sqlite_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    Ok(amount)
}

#[idempotent(scope = "leaks.tx_pg", key = key, tenant = tenant, tx = tx, in_progress = reject)]
async fn in_pg_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    Ok(amount)
}

#[idempotent(scope = "leaks.tx_mysql", key = key, tenant = tenant, tx = tx, in_progress = reject)]
async fn in_mysql_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    Ok(amount)
}

/// Executed, replayed and refused (fingerprint mismatch) in transactions of
/// their own; then, where `$held` is true, a call in a second transaction
/// while the first one still holds the uncommitted record (a row lock wait
/// that ends as in progress). Answers what the errors print.
macro_rules! every_tx_path {
    ($pool:expr, $call:ident, $label:literal, $held:expr) => {{
        let run = uuid::Uuid::new_v4();
        let tenant = format!("TENANTLEAK-{}-{run}", $label);
        let key = format!("sk_live_KEYLEAK-{}-tx-{run}", $label);
        let mut printed = Vec::new();
        for _ in 0..2 {
            let mut tx = $pool.begin().await.expect("begin");
            assert_eq!($call(&mut tx, &tenant, &key, 1).await.unwrap(), 1);
            tx.commit().await.expect("commit");
        }
        let mut tx = $pool.begin().await.expect("begin");
        let e = $call(&mut tx, &tenant, &key, 2).await.unwrap_err();
        assert!(matches!(e, Error::FingerprintMismatch(_)), "{e}");
        printed.push(format!("{e} {e:?}"));
        tx.rollback().await.expect("rollback");
        if $held {
            let held_key = format!("{key}-held");
            let mut first = $pool.begin().await.expect("begin");
            assert_eq!($call(&mut first, &tenant, &held_key, 3).await.unwrap(), 3);
            let mut second = $pool.begin().await.expect("begin");
            let e = $call(&mut second, &tenant, &held_key, 3).await.unwrap_err();
            printed.push(format!("{e} {e:?}"));
            second.rollback().await.expect("rollback");
            first.commit().await.expect("commit");
        }
        printed
    }};
}

fn assert_no_raw_key_in_tx_logs(logs: &std::sync::Mutex<String>, printed: &[String], scope: &str) {
    let text = logs.lock().unwrap().clone();
    assert!(text.contains(scope), "the run was logged:\n{text}");
    assert_neither_key_nor_tenant(&text, printed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_names_the_raw_key_in_transactional_mode_on_sqlite() {
    let logs = capture_logs();
    let store = SqliteStore::connect(&sqlite_url("key_in_logs_tx"))
        .await
        .expect("sqlite file");
    let printed = every_tx_path!(store.pool(), in_sqlite_tx, "sqlite", false);
    assert_no_raw_key_in_tx_logs(&logs, &printed, "leaks.tx_sqlite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_names_the_raw_key_in_transactional_mode_on_postgres() {
    let logs = capture_logs();
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let printed = every_tx_path!(store.pool(), in_pg_tx, "postgres", true);
    assert_no_raw_key_in_tx_logs(&logs, &printed, "leaks.tx_pg");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_names_the_raw_key_in_transactional_mode_on_mysql() {
    let logs = capture_logs();
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let printed = every_tx_path!(store.pool(), in_mysql_tx, "mysql", true);
    assert_no_raw_key_in_tx_logs(&logs, &printed, "leaks.tx_mysql");
}

// ------------------------------------------------------- the command line

/// The parsed command line of `inspect` and `release` (public: `cli::run`
/// takes it) prints, with `{:?}`, the key's digest, never the raw key an
/// operator passed with `--key`.
#[test]
fn a_parsed_command_line_debug_prints_the_key_digest_not_the_key() {
    use idempotent_runtime::cli::Cli;
    use idempotent_runtime::Identity;
    for command in ["inspect", "release"] {
        let mut args = vec![
            "idempotent",
            command,
            "--database-url",
            "sqlite:records.db",
            "--scope",
            "leaks.charge",
            "--tenant",
            "acme",
            "--key",
            "sk_live_KEYLEAK-cli",
        ];
        if command == "release" {
            args.extend(["--reason", "INC-1"]);
        }
        let cli = <Cli as clap::Parser>::try_parse_from(args).expect("parses");
        let shown = format!("{cli:?}");
        assert!(!shown.contains("KEYLEAK"), "{shown}");
        let digest = Identity::new("acme", "leaks.charge", "sk_live_KEYLEAK-cli")
            .unwrap()
            .key_digest();
        assert!(shown.contains(&digest), "{shown}");
    }
}

/// The parsed command line of every subcommand that takes a
/// `--database-url` prints, with `{:?}`, no password of that URL (the
/// secrets hunt's lead: `Cli`'s derived `Debug` and `RecordArgs`' own showed
/// `postgres://user:secret@host/db` whole). Nor do a connection's failure
/// (a port nothing listens on, a port that is not a number, a password the
/// real MariaDB server refuses), its log lines at any level, or the error's
/// `Display` and `Debug`.
#[tokio::test]
async fn a_database_urls_password_is_in_no_parsed_command_line_error_or_log_line() {
    use idempotent_runtime::cli::Cli;
    let logs = crate::engine_accounting::capture_logs();
    let url = "postgres://ops:PWLEAK-1@127.0.0.1:1/records?password=PWLEAK-2&sslmode=disable";
    let record = ["--scope", "leaks.charge", "--tenant", "acme", "--key", "k"];
    let mut commands: Vec<Vec<&str>> = vec![
        vec!["idempotent", "audit", "--database-url", url],
        vec!["idempotent", "purge", "--database-url", url],
        [
            &["idempotent", "inspect", "--database-url", url][..],
            &record[..],
        ]
        .concat(),
        [
            &["idempotent", "release", "--database-url", url][..],
            &record[..],
            &["--reason", "INC-1"][..],
        ]
        .concat(),
    ];
    for args in &commands {
        let cli = <Cli as clap::Parser>::try_parse_from(args.clone()).expect("parses");
        let shown = format!("{cli:?}");
        assert!(!shown.contains("PWLEAK"), "{shown}");
        assert!(
            shown.contains("127.0.0.1"),
            "the host is still shown: {shown}"
        );
    }
    let my = crate::common::servers::mysql_url();
    let refused_password = my.replacen("://root@", "://root:PWLEAK-3@", 1);
    commands.push(vec![
        "idempotent",
        "purge",
        "--database-url",
        &refused_password,
    ]);
    commands.push(vec![
        "idempotent",
        "purge",
        "--database-url",
        "postgres://ops:PWLEAK-4@127.0.0.1:notaport/records",
    ]);
    for args in commands {
        let e = idempotent_runtime::cli::run_from(args.clone())
            .await
            .expect_err("no store there");
        let shown = format!("{e} {e:?}");
        assert!(!shown.contains("PWLEAK"), "{args:?}: {shown}");
    }
    let logged = logs.lock().unwrap().clone();
    assert!(!logged.contains("PWLEAK"), "{logged}");
}

// ------------------------------------------------------- deadlocks in transactional mode

#[idempotent(scope = "leaks.tx_pg_wait", key = key, tenant = tenant, tx = tx,
             in_progress = wait("5s"))]
async fn in_pg_tx_waiting(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    Ok(1)
}

#[idempotent(scope = "leaks.tx_mysql_wait", key = key, tenant = tenant, tx = tx,
             in_progress = wait("5s"))]
async fn in_mysql_tx_waiting(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    Ok(1)
}

/// Two transactions each hold one uncommitted record and then call with the
/// other's key: a lock cycle, which the database ends (a deadlock error, or
/// a lock wait that runs out) for at least one of them. Answers what the
/// errors print.
macro_rules! crossed_tx {
    ($pool:expr, $call:ident, $label:literal) => {{
        let run = uuid::Uuid::new_v4();
        let tenant = format!("TENANTLEAK-{}-{run}", $label);
        let (k1, k2) = (
            format!("sk_live_KEYLEAK-{}-dl1-{run}", $label),
            format!("sk_live_KEYLEAK-{}-dl2-{run}", $label),
        );
        let mut a = $pool.begin().await.expect("begin");
        let mut b = $pool.begin().await.expect("begin");
        $call(&mut a, &tenant, &k1).await.unwrap();
        $call(&mut b, &tenant, &k2).await.unwrap();
        let (ra, rb) = tokio::join!($call(&mut a, &tenant, &k2), $call(&mut b, &tenant, &k1));
        let mut printed = Vec::new();
        for e in [ra.err(), rb.err()].into_iter().flatten() {
            printed.push(format!("{e} | {e:?} | {e:#?}"));
        }
        let _ = a.rollback().await;
        let _ = b.rollback().await;
        assert!(
            !printed.is_empty(),
            "the lock cycle was ended for one of them"
        );
        printed
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_transactions_names_no_raw_key_on_postgres() {
    let logs = capture_logs();
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let printed = crossed_tx!(store.pool(), in_pg_tx_waiting, "postgres");
    assert_no_raw_key_in_tx_logs(&logs, &printed, "leaks.tx_pg_wait");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_transactions_names_no_raw_key_on_mysql() {
    let logs = capture_logs();
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let printed = crossed_tx!(store.pool(), in_mysql_tx_waiting, "mysql");
    assert_no_raw_key_in_tx_logs(&logs, &printed, "leaks.tx_mysql_wait");
}

// ------------------------------------------------------- the store down mid-call

#[idempotent(scope = "leaks.store_down", key = key, tenant = tenant, store = store, skip(pool),
             lease = "2s")]
async fn closes_the_pool<DB: sqlx::Database>(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    pool: &sqlx::Pool<DB>,
) -> Result<u64, Error> {
    // The database goes away for this store while the body runs: the
    // record cannot be written, and the store's worker keeps trying.
    pool.close().await;
    Ok(1)
}

/// The store's pool is closed while the body runs: the call's recording
/// fails (logged with the driver's error) and is handed to the store's
/// worker, which logs what it did. Neither those lines nor the call's error
/// name the raw key.
async fn store_down_mid_call<DB: sqlx::Database>(
    store: &dyn Store,
    pool: &sqlx::Pool<DB>,
    label: &str,
) {
    let logs = capture_logs();
    let run = uuid::Uuid::new_v4();
    let tenant = format!("TENANTLEAK-{label}-{run}");
    let key = format!("sk_live_KEYLEAK-{label}-down-{run}");
    let answer = closes_the_pool(store, &tenant, &key, pool).await;
    let mut printed = Vec::new();
    if let Err(e) = &answer {
        printed.push(format!("{e} | {e:?}"));
    }
    // The worker logs what it did with the record (finished it on a
    // connection of its own, or failed and tries again): a handshake on the
    // log, bounded; then every line so far is searched.
    let digest =
        idempotent_runtime::Identity::new(tenant.as_str(), "leaks.store_down", key.as_str())
            .unwrap()
            .key_digest();
    let mut tries = 0;
    while !logs
        .lock()
        .unwrap()
        .lines()
        .any(|l| l.contains(&digest) && l.contains("a dropped call's record"))
    {
        tries += 1;
        assert!(tries < 600, "the store's worker logged what it did");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_no_raw_key_in_tx_logs(&logs, &printed, "leaks.store_down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_down_mid_call_logs_no_raw_key_on_sqlite() {
    let pool = sqlx::SqlitePool::connect(&sqlite_url("key_in_logs_down"))
        .await
        .expect("sqlite");
    let store = SqliteStore::from_pool(pool.clone()).await.expect("store");
    store_down_mid_call(&store, &pool, "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_down_mid_call_logs_no_raw_key_on_postgres() {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    let pool = sqlx::PgPool::connect(&crate::common::servers::pg_url())
        .await
        .expect("postgres");
    let store = idempotent_runtime::PgStore::from_pool(pool.clone())
        .await
        .expect("store");
    store_down_mid_call(&store, &pool, "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_down_mid_call_logs_no_raw_key_on_mysql() {
    if mysql_store_or_skip().await.is_none() {
        return;
    }
    let pool = sqlx::MySqlPool::connect(&crate::common::servers::mysql_url())
        .await
        .expect("mysql");
    let store = idempotent_runtime::MySqlStore::from_pool(pool.clone())
        .await
        .expect("store");
    store_down_mid_call(&store, &pool, "mysql").await;
}
