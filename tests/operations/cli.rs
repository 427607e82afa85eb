//! The `idempotent` command line: `scopes`, `audit` and `purge`, through the
//! library functions the binary is a thin `main` over, on a real SQLite file;
//! plus one end-to-end run of the built binary.

use idempotent_runtime::cli::{run_from, CliError};
use idempotent_runtime::{
    Completion, Fenced, Identity, OwnerToken, Reservation, ReserveRequest, SqliteStore, Store,
    StoredOutcome,
};
use std::path::PathBuf;
use std::time::Duration;

/// A scratch directory removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("idempotent-cli-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
    fn file(&self, name: &str, contents: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write scratch file");
        path.to_string_lossy().into_owned()
    }
    fn db_url(&self) -> String {
        format!("sqlite://{}", self.0.join("idem.db").display())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every command that opens the store `url` names: audit (with `manifest`),
/// purge and inspect.
fn commands_opening<'a>(url: &'a str, manifest: &'a str) -> [Vec<&'a str>; 3] {
    [
        vec![
            "idempotent",
            "audit",
            "--database-url",
            url,
            "--manifest",
            manifest,
        ],
        vec!["idempotent", "purge", "--database-url", url],
        vec![
            "idempotent",
            "inspect",
            "--database-url",
            url,
            "--scope",
            "orders.place",
            "--tenant",
            "t",
            "--key",
            "k",
        ],
    ]
}

const MANIFEST: &str = r#"
[scopes."orders.place"]
description = "placing an order"
ttl = "24h"

[scopes."orders.cancel"]
lease = "45s"

[retired."orders.place_v1"]
reason = "renamed to orders.place"
"#;

/// A complete record of a fresh key of `scope`, kept for `ttl`.
async fn plant(store: &dyn Store, scope: &str, ttl: Duration) -> Identity {
    let (lease, reserved) = (Duration::from_secs(60), Duration::from_secs(3600));
    common::records::plant(store, "cli-tenant", scope, lease, reserved, Some(ttl)).await
}

async fn wait_expired(store: &dyn Store, id: &Identity) {
    assert!(
        wait_expired_or_purged(store, id).await,
        "the planted expired record is gone, and no one else purges this database"
    );
}

/// Waits (bounded) until the planted record expired by the store's clock:
/// `true` when it did and is still there, `false` when it is gone, purged
/// by another test sharing the server (the caller plants again).
async fn wait_expired_or_purged(store: &dyn Store, id: &Identity) -> bool {
    for _ in 0..500 {
        let Some(snap) = store.fetch(id).await.expect("fetch") else {
            return false;
        };
        if snap.is_expired() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the planted record did not expire within 2.5 s");
}

#[tokio::test]
async fn scopes_lists_declared_and_retired_names() {
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);

    let table = run_from(["idempotent", "scopes", "--manifest", &manifest])
        .await
        .expect("scopes");
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("scope"), "{table}");
    let place = lines
        .iter()
        .find(|l| l.starts_with("orders.place "))
        .expect("orders.place row");
    assert!(
        place.contains("declared") && place.contains("1day") && place.contains("placing an order")
    );
    let retired = lines
        .iter()
        .find(|l| l.starts_with("orders.place_v1"))
        .expect("retired row");
    assert!(retired.contains("retired") && retired.contains("renamed to orders.place"));
    // Aligned: the status column starts at the same place on every row.
    let col = lines[0].find("status").expect("status header");
    for l in &lines[2..] {
        assert!(
            l[col..].starts_with("declared") || l[col..].starts_with("retired"),
            "{l}"
        );
    }

    let json: serde_json::Value = serde_json::from_str(
        &run_from(["idempotent", "scopes", "--manifest", &manifest, "--json"])
            .await
            .expect("scopes --json"),
    )
    .expect("JSON");
    assert_eq!(json["scopes"]["orders.cancel"]["lease"], "45s");
    assert_eq!(
        json["retired"]["orders.place_v1"]["reason"],
        "renamed to orders.place"
    );
}

#[tokio::test]
async fn audit_reports_orphans_retired_and_expired_records() {
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    plant(&store, "orders.place", Duration::from_secs(3600)).await;
    plant(&store, "orders.place_v1", Duration::from_secs(3600)).await;
    plant(&store, "billing.refund", Duration::from_secs(3600)).await;
    let expired = plant(&store, "orders.place", Duration::from_millis(1)).await;
    wait_expired(&store, &expired).await;

    let out = audit_json(&url, &manifest).await.expect("audit");
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let scope = |name: &str| {
        json["scopes"]
            .as_array()
            .expect("scopes")
            .iter()
            .find(|s| s["scope"] == name)
            .unwrap_or_else(|| panic!("{name} missing from {out}"))
            .clone()
    };
    assert_eq!(json["store"], "sqlite");
    assert_eq!(scope("orders.place")["status"], "claimed");
    assert_eq!(scope("orders.place")["complete"], 1);
    assert_eq!(scope("orders.place")["expired"], 1);
    assert_eq!(scope("orders.place_v1")["status"], "retired");
    assert_eq!(scope("billing.refund")["status"], "orphan");
    assert_eq!(scope("orders.cancel")["status"], "unused");
    assert_eq!(json["summary"]["orphan_scopes"], 1);
    assert_eq!(json["summary"]["retired_scopes"], 1);

    let table = run_from([
        "idempotent",
        "audit",
        "--database-url",
        &url,
        "--manifest",
        &manifest,
    ])
    .await
    .expect("audit table");
    let orphan = table
        .lines()
        .find(|l| l.starts_with("billing.refund"))
        .expect("orphan row");
    assert!(orphan.contains("ORPHAN"), "{table}");
    assert!(
        table.contains("1 orphan scope(s), 1 retired scope(s) with records left"),
        "{table}"
    );

    // `--check`: findings are an error (exit status 3 in the binary) that
    // carries the report.
    let checked = run_from([
        "idempotent",
        "audit",
        "--check",
        "--database-url",
        &url,
        "--manifest",
        &manifest,
    ])
    .await;
    match checked {
        Err(CliError::AuditFindings { report }) => assert!(report.contains("ORPHAN"), "{report}"),
        other => panic!("findings with --check: {other:?}"),
    }
}

/// `audit --check` on a store with nothing to report succeeds.
#[tokio::test]
async fn audit_check_passes_on_a_store_without_findings() {
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    plant(&store, "orders.place", Duration::from_secs(3600)).await;
    let out = run_from([
        "idempotent",
        "audit",
        "--check",
        "--database-url",
        &url,
        "--manifest",
        &manifest,
    ])
    .await
    .expect("no findings");
    assert!(out.contains("orders.place"), "{out}");
}

/// `audit --check --grace D`, a scheduled check of a busy system: an expired
/// record that has waited for a purge less than `D` is not a finding (the
/// purge comes every few minutes), one that has waited longer is, as any
/// with a grace of zero or without one; how long shows in the report.
#[tokio::test]
async fn audit_check_with_a_grace_counts_only_what_is_older_than_it() {
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    plant(&store, "orders.place", Duration::from_secs(3600)).await;
    let expired = plant(&store, "orders.place", Duration::from_millis(1)).await;
    wait_expired(&store, &expired).await;
    let check = |grace: Option<&'static str>| {
        let url = url.clone();
        let manifest = manifest.clone();
        async move {
            let mut args = vec!["idempotent", "audit", "--check", "--json"];
            args.extend(grace.map(|g| ["--grace", g]).into_iter().flatten());
            args.extend(["--database-url", &url, "--manifest", &manifest]);
            run_from(args).await
        }
    };

    let report = check(Some("1h")).await.expect("younger than the grace");
    let json: serde_json::Value = serde_json::from_str(&report).expect("JSON");
    let waited = json["summary"]["longest_unpurged_ms"]
        .as_i64()
        .unwrap_or_else(|| panic!("how long the expired record waited: {report}"));
    assert!((0..3_600_000).contains(&waited), "{report}");
    assert_eq!(json["summary"]["longest_stuck_ms"], serde_json::Value::Null);
    for grace in [None, Some("0s")] {
        match check(grace).await {
            Err(CliError::AuditFindings { report }) => {
                assert!(report.contains("\"expired\": 1"), "{report}")
            }
            other => panic!("an unpurged record with --grace {grace:?}: {other:?}"),
        }
    }
    let refused = run_from([
        "idempotent",
        "audit",
        "--grace",
        "1h",
        "--database-url",
        &url,
        "--manifest",
        &manifest,
    ])
    .await;
    assert!(
        matches!(&refused, Err(e @ CliError::Usage(_)) if e.to_string().contains("--check")),
        "--grace without --check: {refused:?}"
    );
    let table = run_from([
        "idempotent",
        "audit",
        "--database-url",
        &url,
        "--manifest",
        &manifest,
    ])
    .await
    .expect("audit table");
    assert!(
        table.contains("1 expired record(s) not purged (the longest for "),
        "{table}"
    );
}

/// A SQLite file another process holds locked (exclusive locking mode) for
/// longer than the first look's bound (5 s) is waited for, as the store's
/// own open waits for it, not reported as a server that never answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_waits_for_a_sqlite_file_another_connection_holds_locked() {
    use sqlx::{Connection, Executor};
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    plant(&store, "orders.place", Duration::from_secs(3600)).await;
    drop(store);
    let mut locker = sqlx::SqliteConnection::connect(&url)
        .await
        .expect("connect");
    locker
        .execute("PRAGMA locking_mode = EXCLUSIVE")
        .await
        .expect("exclusive locking mode");
    locker
        .execute("BEGIN EXCLUSIVE")
        .await
        .expect("lock the file");
    locker
        .execute("COMMIT")
        .await
        .expect("commit, keeping the lock");
    let audit = {
        let (url, manifest) = (url.clone(), manifest.clone());
        tokio::spawn(async move { audit_json(&url, &manifest).await })
    };
    // Past the first look's bound, then the lock goes with the connection.
    tokio::time::sleep(Duration::from_secs(6)).await;
    locker.close().await.expect("close the locking connection");
    let out = audit
        .await
        .expect("the audit task")
        .expect("the audit waited for the lock");
    assert!(out.contains("orders.place"), "{out}");
}

/// `release` of a complete record that has expired says the key is free
/// already (the record counts as absent, rule 16), not that the recorded
/// result is the key's answer; the record is left for the purge.
#[tokio::test]
async fn release_of_an_expired_complete_record_says_it_counts_as_absent() {
    let dir = Scratch::new();
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    let expired = plant(&store, "orders.place", Duration::from_millis(1)).await;
    wait_expired(&store, &expired).await;
    let refused = run_from([
        "idempotent",
        "release",
        "--database-url",
        &url,
        "--scope",
        expired.scope(),
        "--tenant",
        expired.tenant(),
        "--key",
        expired.key(),
        "--reason",
        "INC-2",
    ])
    .await
    .expect_err("nothing to release");
    let said = refused.to_string();
    assert!(
        said.contains("expired") && said.contains("nothing to release"),
        "{said}"
    );
    assert!(!said.contains("is the answer for this key"), "{said}");
    assert!(
        store.fetch(&expired).await.expect("fetch").is_some(),
        "left for the purge"
    );
}

#[tokio::test]
async fn purge_deletes_expired_records_only() {
    let dir = Scratch::new();
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    let live = plant(&store, "orders.place", Duration::from_secs(3600)).await;
    let mut expired = Vec::new();
    for _ in 0..5 {
        expired.push(plant(&store, "orders.place", Duration::from_millis(1)).await);
    }
    for id in &expired {
        wait_expired(&store, id).await;
    }

    let out = run_from([
        "idempotent",
        "purge",
        "--database-url",
        &url,
        "--batch",
        "2",
        "--json",
    ])
    .await
    .expect("purge");
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(json["deleted"], 5, "{out}");
    assert_eq!(json["batch"], 2);
    assert!(store.fetch(&live).await.expect("fetch").is_some());
    for id in &expired {
        assert!(store.fetch(id).await.expect("fetch").is_none());
    }

    let again = run_from(["idempotent", "purge", "--database-url", &url])
        .await
        .expect("purge table");
    let row = again.lines().nth(2).expect("one row");
    assert!(row.starts_with("sqlite") && row.contains(" 0 "), "{again}");
}

#[tokio::test]
async fn mistakes_are_reported_with_what_to_fix() {
    let missing = run_from([
        "idempotent",
        "scopes",
        "--manifest",
        "/nonexistent/idempotent.toml",
    ])
    .await
    .expect_err("no such file");
    assert!(matches!(missing, CliError::Manifest(_)));
    assert!(
        missing.to_string().contains("/nonexistent/idempotent.toml"),
        "{missing}"
    );

    let dir = Scratch::new();
    let bad = dir.file("bad.toml", "[scopes.\"Orders.Place\"]\n");
    let e = run_from(["idempotent", "scopes", "--manifest", &bad])
        .await
        .expect_err("bad scope name");
    assert!(e.to_string().contains("Orders.Place"), "{e}");

    let manifest = dir.file("idempotent.toml", MANIFEST);
    let e = run_from([
        "idempotent",
        "audit",
        "--database-url",
        "redis://localhost",
        "--manifest",
        &manifest,
    ])
    .await
    .expect_err("unsupported scheme");
    assert!(matches!(e, CliError::Connect(_)));
    assert!(e.to_string().contains("sqlite:"), "{e}");

    let e = run_from([
        "idempotent",
        "purge",
        "--database-url",
        "sqlite::memory:",
        "--batch",
        "0",
    ])
    .await
    .expect_err("batch 0");
    assert!(matches!(e, CliError::Usage(_)), "{e}");

    // A mistyped SQLite path is an error, and no database is created there:
    // an empty new file would look like a healthy store with nothing in it.
    let typo = dir.0.join("typo.db");
    let url = format!("sqlite:{}", typo.display());
    for command in commands_opening(&url, &manifest) {
        let e = run_from(command.clone())
            .await
            .expect_err("no database at that path");
        assert!(
            matches!(e, CliError::NoSqliteDatabase { .. }),
            "{command:?}: {e}"
        );
        assert!(e.to_string().contains("typo.db"), "{e}");
        assert!(!typo.exists(), "{command:?} created {}", typo.display());
    }

    // A scope the attribute refuses names no record: said, with the rule.
    let e = run_from([
        "idempotent",
        "inspect",
        "--database-url",
        "sqlite::memory:",
        "--scope",
        "Orders.Place",
        "--tenant",
        "t",
        "--key",
        "k",
    ])
    .await
    .expect_err("not a scope");
    assert!(matches!(e, CliError::BadScope(_)), "{e}");
    assert!(e.to_string().contains("--scope"), "{e}");
}

/// The real binary, built by cargo and run once.
///
/// It is built with the features of the README's test command
/// (`--workspace --all-features`, and `--tests` so dev-dependencies count as
/// they do there): cargo then finds every dependency fresh and only builds the
/// binary itself. (`cargo run -p idempotent-runtime --features cli` resolves
/// other features and recompiled the runtime and half its dependencies: minutes
/// on a cold machine.)
#[test]
fn the_binary_runs_end_to_end() {
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    // What cargo sets for this test process (CARGO_MANIFEST_DIR, CARGO_PKG_*,
    // ...) must not reach the inner cargo: build scripts watch some of them
    // (`rerun-if-env-changed`; ring's watches CARGO_MANIFEST_DIR and
    // CARGO_PKG_NAME), and a changed value reruns them and rebuilds every crate
    // above them, here and again in the next outer build.
    for (name, _) in std::env::vars() {
        let set_by_cargo = name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&name.as_str());
        if set_by_cargo {
            build.env_remove(name);
        }
    }
    let build = build
        .args([
            "build",
            "--quiet",
            "--workspace",
            "--all-features",
            "--tests",
            "--bin",
            "idempotent",
            "--message-format=json",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        build.status.success(),
        "cargo build: exit {:?}\nstderr: {}",
        build.status,
        String::from_utf8_lossy(&build.stderr)
    );
    let binary = String::from_utf8_lossy(&build.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        // Not the binary's unit-test harness, which `--tests` builds too.
        .filter(|m| m["target"]["name"] == "idempotent" && m["profile"]["test"] == false)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .expect("cargo reports the built binary");
    let out = std::process::Command::new(&binary)
        .args(["scopes", "--json", "--manifest", &manifest])
        .output()
        .expect("the binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(
        json["retired"]["orders.place_v1"]["reason"],
        "renamed to orders.place"
    );

    // `--help` never shows the password of a URL given through
    // `DATABASE_URL` (the way to keep it off the process list).
    for command in ["audit", "purge", "inspect", "release"] {
        let out = std::process::Command::new(&binary)
            .args([command, "--help"])
            .env(
                "DATABASE_URL",
                "postgres://app:s3cr3t-pw@db.internal:5432/app",
            )
            .output()
            .expect("the binary runs");
        let shown = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(shown.contains("DATABASE_URL"), "{command} --help: {shown}");
        assert!(
            !shown.contains("s3cr3t-pw") && !shown.contains("db.internal"),
            "{command} --help shows DATABASE_URL's value: {shown}"
        );
    }
}

use crate::common;

/// `audit --json` of the store `url` names, against `manifest`.
async fn audit_json(url: &str, manifest: &str) -> Result<String, CliError> {
    run_from([
        "idempotent",
        "audit",
        "--database-url",
        url,
        "--manifest",
        manifest,
        "--json",
    ])
    .await
}

/// `audit --json` of the store `url` names: the row of `scope`.
async fn audit_row(url: &str, manifest: &str, scope: &str) -> serde_json::Value {
    let out = audit_json(url, manifest)
        .await
        .unwrap_or_else(|e| panic!("audit on {url}: {e}"));
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    json["scopes"]
        .as_array()
        .expect("scopes")
        .iter()
        .find(|s| s["scope"] == scope)
        .unwrap_or_else(|| panic!("{scope} missing from the audit of {url}"))
        .clone()
}

/// `audit` and `purge` take PostgreSQL and MySQL/MariaDB URLs too. The servers
/// are shared with other tests, so this plants a scope no one else uses and
/// asserts only on it.
#[tokio::test]
async fn audit_and_purge_work_on_server_urls() {
    let pg = common::servers::pg_store_or_skip()
        .await
        .map(|s| (common::servers::pg_url(), Box::new(s) as Box<dyn Store>));
    let my = common::servers::mysql_store_or_skip()
        .await
        .map(|s| (common::servers::mysql_url(), Box::new(s) as Box<dyn Store>));
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    for (url, store) in pg.into_iter().chain(my) {
        let scope = format!("cli.{}", uuid::Uuid::new_v4().simple());
        plant(&*store, &scope, Duration::from_secs(3600)).await;
        // Another test's purge may delete the expired record before the
        // audit counts it: then it is planted again (bounded).
        let mut tries = 0;
        let expired = loop {
            tries += 1;
            assert!(
                tries <= 10,
                "the planted expired record was purged by others 10 times in a row ({url})"
            );
            let expired = plant(&*store, &scope, Duration::from_millis(1)).await;
            if !wait_expired_or_purged(&*store, &expired).await {
                continue;
            }
            let row = audit_row(&url, &manifest, &scope).await;
            assert_eq!(
                row["status"], "orphan",
                "the manifest does not declare it ({url})"
            );
            assert_eq!(row["complete"], 1, "{url}");
            if row["expired"].as_u64().unwrap_or(0) >= 1 {
                break expired;
            }
            assert!(
                store.fetch(&expired).await.expect("fetch").is_none(),
                "the audit counted no expired record, yet one is there ({url}): {row}"
            );
        };

        run_from([
            "idempotent",
            "purge",
            "--database-url",
            &url,
            "--batch",
            "500",
        ])
        .await
        .unwrap_or_else(|e| panic!("purge on {url}: {e}"));
        assert!(
            store.fetch(&expired).await.expect("fetch").is_none(),
            "purge removed the expired record ({url})"
        );
    }
}

/// A record left in progress by attempt 2, whose lease has run out (two
/// reservations with a zero lease: the second takes the first over).
async fn plant_stuck(store: &dyn Store, scope: &str, tenant: &str, key: &str) -> Identity {
    let identity = Identity::new(tenant, scope, key).expect("identity");
    for attempt in [1, 2] {
        let token = OwnerToken::new();
        let r = store
            .reserve(ReserveRequest {
                identity: &identity,
                fingerprint: Some(&idempotent_runtime::Fingerprint::of(&1).expect("fp")),
                token: &token,
                lease: Duration::ZERO,
                ttl: Duration::from_secs(3600),
            })
            .await
            .expect("reserve");
        assert!(
            matches!(r, Reservation::Acquired { attempt: a, .. } if a == attempt),
            "{r:?}"
        );
    }
    identity
}

/// A record whose owner's lease is live for an hour.
async fn plant_running(store: &dyn Store, scope: &str, tenant: &str, key: &str) -> Identity {
    let identity = Identity::new(tenant, scope, key).expect("identity");
    let token = OwnerToken::new();
    let r = store
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &token,
            lease: Duration::from_secs(3600),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert_eq!(r, Reservation::FRESH);
    identity
}

/// `inspect` and `release` on one store, by URL: every case, with its output.
async fn inspect_and_release_on(url: &str, store: &dyn Store) {
    let scope = format!("cli.ops.{}", uuid::Uuid::new_v4().simple());
    let tenant = format!("cli-{}", uuid::Uuid::new_v4().simple());
    let stuck = plant_stuck(store, &scope, &tenant, "stuck-key").await;
    let running = plant_running(store, &scope, &tenant, "running-key").await;
    // A complete record under a key of its own.
    let done = {
        let identity =
            Identity::new(tenant.as_str(), scope.as_str(), "done-key").expect("identity");
        let token = OwnerToken::new();
        store
            .reserve(ReserveRequest {
                identity: &identity,
                fingerprint: None,
                token: &token,
                lease: Duration::from_secs(60),
                ttl: Duration::from_secs(3600),
            })
            .await
            .expect("reserve");
        let outcome = StoredOutcome {
            is_error: false,
            payload: br#"{"card":"4242 secret"}"#.to_vec(),
        };
        assert_eq!(
            store
                .complete(Completion::by_body(
                    &identity,
                    &token,
                    &outcome,
                    Duration::from_secs(3600)
                ))
                .await
                .expect("complete"),
            Fenced::Written
        );
        identity
    };
    let args = |cmd: &str, key: &str, more: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "idempotent",
            cmd,
            "--database-url",
            url,
            "--scope",
            &scope,
            "--tenant",
            &tenant,
            "--key",
            key,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(more.iter().map(|s| s.to_string()));
        v
    };

    // inspect: state, attempt, lease, expiry, fingerprint version; no result.
    let table = run_from(args("inspect", "stuck-key", &[]))
        .await
        .unwrap_or_else(|e| panic!("inspect on {url}: {e}"));
    let line = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line in\n{table}"))
            .to_owned()
    };
    assert!(line("state").contains("STUCK"), "{table}");
    let stuck_json: serde_json::Value = serde_json::from_str(
        &run_from(args("inspect", "stuck-key", &["--json"]))
            .await
            .expect("inspect --json"),
    )
    .expect("JSON");
    assert_eq!(
        (&stuck_json["state"], &stuck_json["stuck"]),
        (&"in_progress".into(), &true.into()),
        "{stuck_json}"
    );
    assert!(
        line("attempt ").contains("2 (taken over 1 time(s)"),
        "{table}"
    );
    assert!(line("lease").contains(" ago)"), "{table}");
    assert!(line("expires").contains("(in "), "{table}");
    assert!(line("fingerprint").contains("version v1"), "{table}");
    assert!(line("key digest").contains(&stuck.key_digest()), "{table}");
    assert!(
        !table.contains("stuck-key"),
        "the raw key is not printed: {table}"
    );

    let json: serde_json::Value = serde_json::from_str(
        &run_from(args("inspect", "done-key", &["--json"]))
            .await
            .expect("inspect --json"),
    )
    .expect("JSON");
    assert_eq!(json["state"], "complete", "{json}");
    assert_eq!(json["stuck"], false, "{json}");
    assert_eq!(json["attempt"], 1);
    assert_eq!(json["fingerprint_version"], serde_json::Value::Null);
    assert_eq!(json["result_bytes"], 22);
    assert!(
        json.get("result").is_none(),
        "no result without --show-result: {json}"
    );
    let hidden = run_from(args("inspect", "done-key", &[]))
        .await
        .expect("inspect");
    // The secret's own text, not a fragment a random tenant or scope name could hold.
    assert!(!hidden.contains("4242 secret"), "{hidden}");
    assert!(!hidden.contains("card"), "{hidden}");
    assert!(
        hidden.contains("not shown (pass --show-result)"),
        "{hidden}"
    );
    let shown = run_from(args("inspect", "done-key", &["--show-result"]))
        .await
        .expect("inspect --show-result");
    assert!(shown.contains(r#"{"card":"4242 secret"}"#), "{shown}");

    // release: a complete record is refused, and left as it was.
    let before = store.fetch(&done).await.expect("fetch").expect("done");
    let refused = run_from(args("release", "done-key", &["--reason", "INC-1"]))
        .await
        .expect_err("a complete record is never released");
    assert!(
        matches!(refused, CliError::ReleaseRefused { .. }),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("the record is complete"),
        "{refused}"
    );
    let refused = run_from(args(
        "release",
        "done-key",
        &["--reason", "INC-1", "--even-if-running"],
    ))
    .await
    .expect_err("not even with --even-if-running");
    assert!(
        refused.to_string().contains("the record is complete"),
        "{refused}"
    );
    let after = store
        .fetch(&done)
        .await
        .expect("fetch")
        .expect("done is kept");
    assert_eq!(
        (after.state, &after.outcome),
        (before.state, &before.outcome)
    );

    // A live lease is refused unless --even-if-running.
    let refused = run_from(args("release", "running-key", &["--reason", "INC-2"]))
        .await
        .expect_err("the owner may be running");
    assert!(
        refused.to_string().contains("--even-if-running"),
        "{refused}"
    );
    assert!(store.fetch(&running).await.expect("fetch").is_some());

    // An empty reason is refused before anything happens.
    for blank in ["  ", "\0", " \u{7}\t"] {
        let e = run_from(args("release", "stuck-key", &["--reason", blank]))
            .await
            .expect_err("a reason is required");
        assert!(matches!(e, CliError::NoReason), "{blank:?}: {e}");
    }
    let e = run_from(args("release", "stuck-key", &[]))
        .await
        .expect_err("--reason is required");
    assert!(matches!(e, CliError::Usage(_)), "{e}");

    // --end-lease keeps the record and ends its lease: the next call takes
    // it over as the next attempt (asking a recover hook, rule 20) instead
    // of running as a fresh attempt 1. A live lease, a complete record and
    // no record are refused as for a release.
    let hooked = plant_running(store, &scope, &tenant, "hooked-key").await;
    let refused = run_from(args(
        "release",
        "hooked-key",
        &["--reason", "INC-5", "--end-lease"],
    ))
    .await
    .expect_err("the owner may be running");
    assert!(
        refused.to_string().contains("--even-if-running"),
        "{refused}"
    );
    let refused = run_from(args(
        "release",
        "done-key",
        &["--reason", "INC-5", "--end-lease"],
    ))
    .await
    .expect_err("a complete record has no lease");
    assert!(
        refused.to_string().contains("the record is complete"),
        "{refused}"
    );
    let missing = run_from(args(
        "release",
        "no-such-key",
        &["--reason", "INC-5", "--end-lease"],
    ))
    .await
    .expect_err("no record");
    assert!(matches!(missing, CliError::NoRecord { .. }), "{missing}");
    let out = run_from(args(
        "release",
        "hooked-key",
        &[
            "--reason",
            "INC-5: host gone",
            "--even-if-running",
            "--end-lease",
        ],
    ))
    .await
    .unwrap_or_else(|e| panic!("release --end-lease on {url}: {e}"));
    assert!(
        out.contains("ended the lease") && out.contains("as attempt 2") && out.contains("INC-5"),
        "{out}"
    );
    let kept = store
        .fetch(&hooked)
        .await
        .expect("fetch")
        .expect("the record is kept");
    assert_eq!(kept.state, idempotent_runtime::RecordState::InProgress);
    let next = store
        .reserve(ReserveRequest {
            identity: &hooked,
            fingerprint: None,
            token: &OwnerToken::new(),
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(
        matches!(
            next,
            Reservation::Acquired {
                took_over: true,
                attempt: 2,
                ..
            }
        ),
        "the next call takes the record over at once: {next:?}"
    );

    // A lease that has run out needs nothing written: the next call takes
    // the record over as it is (ending it again would race with an owner
    // that renews it just then).
    let before = store.fetch(&stuck).await.expect("fetch").expect("stuck");
    let out = run_from(args(
        "release",
        "stuck-key",
        &["--reason", "INC-6", "--end-lease"],
    ))
    .await
    .unwrap_or_else(|e| panic!("release --end-lease of a stuck record on {url}: {e}"));
    assert!(
        out.contains("already over") && out.contains("as attempt 3"),
        "{out}"
    );
    let after = store.fetch(&stuck).await.expect("fetch").expect("stuck");
    assert_eq!(
        (
            after.lease_expires_at_ms,
            after.expires_at_ms,
            after.owner_token
        ),
        (
            before.lease_expires_at_ms,
            before.expires_at_ms,
            before.owner_token
        ),
        "nothing written"
    );

    // The stuck record is released; the reason is printed.
    let out = run_from(args(
        "release",
        "stuck-key",
        &["--reason", "INC-3: owner host is gone"],
    ))
    .await
    .unwrap_or_else(|e| panic!("release on {url}: {e}"));
    assert!(
        out.contains("attempt 2") && out.contains("reason: INC-3: owner host is gone"),
        "{out}"
    );
    assert!(store.fetch(&stuck).await.expect("fetch").is_none());
    let gone = run_from(args("inspect", "stuck-key", &[]))
        .await
        .expect_err("released");
    assert!(matches!(gone, CliError::NoRecord { .. }), "{gone}");
    assert!(gone.to_string().contains("has not committed yet"), "{gone}");

    let json: serde_json::Value = serde_json::from_str(
        &run_from(args(
            "release",
            "running-key",
            &["--reason", "INC-4", "--even-if-running", "--json"],
        ))
        .await
        .expect("release --even-if-running"),
    )
    .expect("JSON");
    assert_eq!(
        (json["released"].clone(), json["attempt"].clone()),
        (true.into(), 1.into())
    );
    assert_eq!(json["reason"], "INC-4");
    assert!(store.fetch(&running).await.expect("fetch").is_none());
}

/// Reserves `identity` with a lease of a minute: a record in progress, lease live.
async fn hold_for_a_minute(store: &SqliteStore, identity: &Identity) {
    let minute = Duration::from_secs(60);
    let request = ReserveRequest {
        identity,
        fingerprint: None,
        token: &OwnerToken::new(),
        lease: minute,
        ttl: minute,
    };
    let got = store.reserve(request).await.expect("reserve");
    assert!(matches!(got, Reservation::Acquired { .. }), "{got:?}");
}

#[tokio::test]
async fn inspect_and_release_on_sqlite() {
    let dir = Scratch::new();
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    inspect_and_release_on(&url, &store).await;

    // `tenant = shared` records are named with --shared.
    hold_for_a_minute(
        &store,
        &Identity::shared("cli.shared", "k").expect("identity"),
    )
    .await;
    let out = run_from([
        "idempotent",
        "inspect",
        "--database-url",
        &url,
        "--scope",
        "cli.shared",
        "--shared",
        "--key",
        "k",
    ])
    .await
    .expect("inspect --shared");
    assert!(
        out.contains("none: the shared namespace (tenant = shared)") && out.contains("lease live"),
        "{out}"
    );
    let e = run_from([
        "idempotent",
        "inspect",
        "--database-url",
        &url,
        "--scope",
        "cli.shared",
        "--key",
        "k",
    ])
    .await
    .expect_err("--tenant or --shared is required");
    assert!(matches!(e, CliError::Usage(_)), "{e}");

    // Keys and tenants are the client's: one starting with `-` is a value,
    // written after its option as any other.
    hold_for_a_minute(
        &store,
        &Identity::new("-tenant", "cli.hyphen", "-abc").expect("identity"),
    )
    .await;
    let out = run_from([
        "idempotent",
        "inspect",
        "--database-url",
        &url,
        "--scope",
        "cli.hyphen",
        "--tenant",
        "-tenant",
        "--key",
        "-abc",
    ])
    .await
    .expect("a key and a tenant starting with '-'");
    assert!(out.contains("lease live"), "{out}");
}

#[tokio::test]
async fn inspect_and_release_on_postgres() {
    if let Some(store) = common::servers::pg_store_or_skip().await {
        inspect_and_release_on(&common::servers::pg_url(), &store).await;
    }
}

#[tokio::test]
async fn inspect_and_release_on_mariadb() {
    if let Some(store) = common::servers::mysql_store_or_skip().await {
        inspect_and_release_on(&common::servers::mysql_url(), &store).await;
    }
}

/// A database without the idempotency tables (an existing empty SQLite file,
/// a PostgreSQL search path or a MariaDB database where no store was ever
/// opened) is refused, and nothing is created in it: opening a store applies
/// the migrations, and an audit of a mistyped database name would report an
/// empty, healthy store.
#[tokio::test]
async fn a_database_without_idempotency_tables_is_refused_and_left_as_it_was() {
    async fn refused_everywhere(url: &str) {
        let dir = Scratch::new();
        let manifest = dir.file("idempotent.toml", MANIFEST);
        for command in commands_opening(url, &manifest) {
            let e = run_from(command.clone())
                .await
                .expect_err("no tables there");
            assert!(
                matches!(e, CliError::NoIdempotencyTables),
                "{command:?}: {e}"
            );
            assert!(e.to_string().contains("check the URL"), "{e}");
        }
    }

    let dir = Scratch::new();
    let empty = dir.0.join("empty.db");
    std::fs::File::create(&empty).expect("an empty file");
    let url = format!("sqlite:{}", empty.display());
    refused_everywhere(&url).await;
    assert_eq!(
        std::fs::metadata(&empty).expect("still there").len(),
        0,
        "nothing was written to the file"
    );

    if crate::common::servers::pg_store_or_skip().await.is_some() {
        let schema = format!("cli_empty_{}", uuid::Uuid::new_v4().simple());
        let base = crate::common::servers::pg_url();
        let url = crate::common::servers::pg_url_in_schema(&schema);
        refused_everywhere(&url).await;
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&base)
            .await
            .expect("connect");
        let created: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM information_schema.schemata WHERE schema_name = $1)",
        )
        .bind(&schema)
        .fetch_one(&mut conn)
        .await
        .expect("schemata");
        assert!(!created, "nothing was created for {schema}");
    }

    if crate::common::servers::mysql_store_or_skip()
        .await
        .is_some()
    {
        let database = format!("cli_empty_{}", uuid::Uuid::new_v4().simple());
        let base = crate::common::servers::mysql_url();
        let mut conn = <sqlx::MySqlConnection as sqlx::Connection>::connect(&base)
            .await
            .expect("connect");
        sqlx::query(&format!("CREATE DATABASE {database}"))
            .execute(&mut conn)
            .await
            .expect("create database");
        let (server, _) = base.rsplit_once('/').expect("a database in the URL");
        let url = format!("{server}/{database}");
        refused_everywhere(&url).await;
        let tables: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = ?",
        )
        .bind(&database)
        .fetch_one(&mut conn)
        .await
        .expect("tables");
        sqlx::query(&format!("DROP DATABASE {database}"))
            .execute(&mut conn)
            .await
            .expect("drop database");
        assert_eq!(tables, 0, "nothing was created in {database}");
    }
}

/// A server that accepts connections and never answers (paused, a proxy
/// without a backend) is an error after the stores' own connect bound, for
/// the look at whether the database holds records as for the store itself:
/// never a command that hangs.
#[tokio::test]
async fn a_server_that_never_answers_is_an_error_not_a_hang() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let port = listener.local_addr().expect("addr").port();
    // Accepts every connection and keeps it open without a word.
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    for url in [
        format!("postgres://idem@127.0.0.1:{port}/idem"),
        format!("mysql://idem@127.0.0.1:{port}/idem"),
    ] {
        let command = ["idempotent", "purge", "--database-url", url.as_str()];
        let answered = tokio::time::timeout(Duration::from_secs(60), run_from(command)).await;
        let e = answered
            .unwrap_or_else(|_| panic!("{url}: no answer in 60 s"))
            .expect_err("nothing answers there");
        assert!(
            e.to_string().contains("no answer from the database server"),
            "{url}: {e}"
        );
    }
    silent.abort();
}

/// A port nothing listens on is reported as refused, naming the address, from the first look
/// (not as a pool that timed out after a second one).
#[tokio::test]
async fn a_server_that_refuses_connections_is_reported_as_refused() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        listener.local_addr().expect("addr").port()
    };
    for url in [
        format!("postgres://idem@127.0.0.1:{port}/idem"),
        format!("mysql://idem@127.0.0.1:{port}/idem"),
    ] {
        let command = ["idempotent", "purge", "--database-url", url.as_str()];
        let e = tokio::time::timeout(Duration::from_secs(60), run_from(command))
            .await
            .unwrap_or_else(|_| panic!("{url}: no answer in 60 s"))
            .expect_err("nothing listens there");
        let said = e.to_string().to_lowercase();
        assert!(said.contains("refused"), "{url}: {e}");
        assert!(!said.contains("timed out"), "{url}: {e}");
        assert!(
            said.contains(&format!("127.0.0.1:{port}")),
            "{url}: the error names no address: {e}"
        );
    }
}

/// `audit` and `inspect` only read, so they open a database they may only
/// read: a PostgreSQL session in read-only mode (as on a hot standby) and a
/// MariaDB user granted nothing but `SELECT`. Opening a store whose
/// migrations are all applied takes no lock and runs no DDL; before, every
/// open ran `CREATE TABLE IF NOT EXISTS` for the migration history and both
/// commands failed.
#[tokio::test]
async fn audit_and_inspect_work_on_a_database_they_may_only_read() {
    let pg = common::servers::pg_store_or_skip().await.map(|s| {
        let url = common::servers::pg_url();
        let separator = if url.contains('?') { '&' } else { '?' };
        let read_only = format!("{url}{separator}options=-c%20default_transaction_read_only%3Don");
        (read_only, Box::new(s) as Box<dyn Store>)
    });
    let my = match common::servers::mysql_store_or_skip().await {
        Some(s) => Some((
            common::servers::mysql_reader_url(s.pool()).await,
            Box::new(s) as Box<dyn Store>,
        )),
        None => None,
    };
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    for (url, store) in pg.into_iter().chain(my) {
        let scope = format!("cli.ro.{}", uuid::Uuid::new_v4().simple());
        let tenant = format!("cli-{}", uuid::Uuid::new_v4().simple());
        plant_running(&*store, &scope, &tenant, "running-key").await;

        let row = audit_row(&url, &manifest, &scope).await;
        assert_eq!(row["in_progress"], 1, "{url}: {row}");

        let shown = run_from([
            "idempotent",
            "inspect",
            "--database-url",
            &url,
            "--scope",
            &scope,
            "--tenant",
            &tenant,
            "--key",
            "running-key",
        ])
        .await
        .unwrap_or_else(|e| panic!("inspect on {url}: {e}"));
        assert!(
            shown.contains("in_progress") || shown.contains("in progress"),
            "{url}: {shown}"
        );

        // The premise: this access really may only read (a purge is refused).
        let purge = run_from(["idempotent", "purge", "--database-url", &url]).await;
        assert!(purge.is_err(), "a purge through {url} was not refused");
    }
}

/// A database whose idempotency schema is older than the command's (a
/// command line newer than the deployed application) is refused, naming the
/// migration it lacks, and its schema is left as it was: the command line
/// never changes a schema (an `audit` from a scheduled job, or an `inspect`
/// by an operator, would otherwise apply the migrations with whatever rights
/// its account has, under the running application's feet).
#[tokio::test]
async fn a_database_with_an_older_schema_is_refused_and_left_as_it_was() {
    /// Every command that opens the store is refused, naming the migration
    /// (`None`: the history could not be read).
    async fn refused_everywhere(url: &str, version: Option<i64>) {
        let dir = Scratch::new();
        let manifest = dir.file("idempotent.toml", MANIFEST);
        for command in commands_opening(url, &manifest) {
            match run_from(command.clone()).await {
                Err(CliError::SchemaBehind {
                    version: lacking, ..
                }) => {
                    assert_eq!(lacking, version, "{command:?}")
                }
                other => panic!("{command:?}: {other:?}"),
            }
        }
    }

    /// Forgets the newest migration in the history of the store on `$pool`
    /// (`$history`: the table, `$param`: the driver's placeholder), has every
    /// command refuse `$url`, and asserts the history still lacks it. Then
    /// the history goes (`$forget`: a statement; a database set up before
    /// it, or restored without it): refused again, and no history is made.
    macro_rules! refused_and_left_as_it_was {
        ($pool:expr, $history:expr, $param:literal, $url:expr, $forget:expr) => {{
            let newest: i64 = sqlx::query_scalar(&format!("SELECT MAX(version) FROM {}", $history))
                .fetch_one($pool)
                .await
                .expect("history");
            sqlx::query(&format!(
                "DELETE FROM {} WHERE version = {}",
                $history, $param
            ))
            .bind(newest)
            .execute($pool)
            .await
            .expect("forget the newest migration");
            refused_everywhere($url, Some(newest)).await;
            let lacking: i64 = sqlx::query_scalar(&format!(
                "SELECT COUNT(*) FROM {} WHERE version = {}",
                $history, $param
            ))
            .bind(newest)
            .fetch_one($pool)
            .await
            .expect("history");
            assert_eq!(
                lacking, 0,
                "{}: the command applied migration {newest}",
                $url
            );
            sqlx::query(&$forget)
                .execute($pool)
                .await
                .expect("forget the history");
            refused_everywhere($url, None).await;
            let history: Result<i64, _> =
                sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {}", $history))
                    .fetch_one($pool)
                    .await;
            assert!(history.is_err(), "{}: the command made a history", $url);
        }};
    }
    const HISTORY: &str = "idempotency_schema_migrations";

    // SQLite: a file of its own.
    let dir = Scratch::new();
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("a store");
    refused_and_left_as_it_was!(
        store.pool(),
        HISTORY,
        "?",
        &url,
        format!("ALTER TABLE {HISTORY} RENAME TO _idempotent_migrations")
    );

    // PostgreSQL: a schema of its own, on the search path.
    if common::servers::pg_store_or_skip().await.is_some() {
        let (mut admin, schema, url) = common::servers::pg_schema_of_its_own("cli_older").await;
        let store = idempotent_runtime::PgStore::connect(&url)
            .await
            .expect("a store in the schema");
        refused_and_left_as_it_was!(
            store.pool(),
            format!("{schema}.{HISTORY}"),
            "$1",
            &url,
            format!("DROP TABLE {schema}.{HISTORY}")
        );
        drop(store);
        sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
            .execute(&mut admin)
            .await
            .expect("drop schema");
    }

    // MariaDB: a database of its own.
    if let Some(admin) = common::servers::mysql_store_or_skip().await {
        let database = common::servers::mysql_create_database(&admin, "cli_older").await;
        let url = match common::servers::mysql_url().rsplit_once('/') {
            Some((server, _)) => format!("{server}/{database}"),
            None => panic!("a database in the URL"),
        };
        let store = idempotent_runtime::MySqlStore::connect(&url)
            .await
            .expect("a store in the database");
        refused_and_left_as_it_was!(
            store.pool(),
            HISTORY,
            "?",
            &url,
            format!("DROP TABLE {HISTORY}")
        );
        drop(store);
        sqlx::query(&format!("DROP DATABASE `{database}`"))
            .execute(admin.pool())
            .await
            .expect("drop database");
    }
}

/// The command line leaves a SQLite file's journal mode as it found it:
/// the stores switch a file to WAL when they open it, a change of the file
/// an `audit` must not make.
#[tokio::test]
async fn a_sqlite_file_keeps_its_journal_mode() {
    let dir = Scratch::new();
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("a store");
    store.pool().close().await;
    drop(store);
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url)
        .await
        .expect("connect");
    // The store's connections close on their own threads: the switch is
    // refused as locked until the last has (bounded).
    let mut tries = 0;
    let mode: String = loop {
        match sqlx::query_scalar("PRAGMA journal_mode = DELETE")
            .fetch_one(&mut conn)
            .await
        {
            Err(e) if e.to_string().contains("locked") && tries < 200 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other.expect("journal mode"),
        }
    };
    assert_eq!(mode, "delete");
    let manifest = dir.file("idempotent.toml", MANIFEST);
    for command in commands_opening(&url, &manifest) {
        match run_from(command.clone()).await {
            Ok(_) | Err(CliError::NoRecord { .. }) => {}
            Err(e) => panic!("{command:?}: {e}"),
        }
    }
    drop(conn);
    // A new connection reads the mode from the file.
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url)
        .await
        .expect("connect");
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut conn)
        .await
        .expect("journal mode");
    assert_eq!(
        mode, "delete",
        "the command switched the file's journal mode"
    );
}

/// An account that may read the records but not the migration history is
/// told what the database said (no right to read that table), not that the
/// schema is older than the command: the schema is complete, and deploying
/// the application would change nothing.
#[tokio::test]
async fn an_account_that_may_not_read_the_history_is_told_so() {
    const READER: &str = "idempotent_records_only";
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    let mut urls = Vec::new();
    if let Some(store) = common::servers::pg_store_or_skip().await {
        // Roles are the cluster's: made once, granted again each run.
        let _ = sqlx::query(&format!("CREATE ROLE {READER} LOGIN"))
            .execute(store.pool())
            .await;
        sqlx::query(&format!("GRANT SELECT ON idempotency_records TO {READER}"))
            .execute(store.pool())
            .await
            .expect("grant");
        let url = common::servers::pg_url();
        let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        urls.push(format!("{scheme}://{READER}@{host}"));
    }
    if let Some(store) = common::servers::mysql_store_or_skip().await {
        let database: String = sqlx::query_scalar("SELECT DATABASE()")
            .fetch_one(store.pool())
            .await
            .expect("the test database's name");
        sqlx::query(&format!("CREATE USER IF NOT EXISTS '{READER}'@'%'"))
            .execute(store.pool())
            .await
            .expect("create user");
        sqlx::query(&format!(
            "GRANT SELECT ON `{database}`.idempotency_records TO '{READER}'@'%'"
        ))
        .execute(store.pool())
        .await
        .expect("grant");
        let url = common::servers::mysql_url();
        let (scheme, rest) = url.split_once("://").expect("a mysql:// URL");
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        urls.push(format!("{scheme}://{READER}@{host}"));
    }
    for url in urls {
        let e = audit_json(&url, &manifest)
            .await
            .expect_err("the history may not be read");
        assert!(
            !matches!(e, CliError::SchemaBehind { .. }),
            "{url}: a complete schema reported as older: {e}"
        );
        let said = e.to_string().to_lowercase();
        assert!(
            said.contains("denied") && said.contains("check migrations"),
            "{url}: {e}"
        );
    }
}

/// An in-progress record whose lease and ttl have both run out counts as
/// absent (rule 16): `inspect` shows it expired (not stuck), and
/// `release --end-lease`, with or without `--even-if-running`, finds no
/// record and writes nothing (the record is not made live again).
#[tokio::test]
async fn an_expired_in_progress_record_is_not_stuck_and_has_no_lease_to_end() {
    let dir = Scratch::new();
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    // Kept far longer than its lease (a retention the lease's end would carry
    // on), then both run out.
    let blink = Duration::from_millis(1);
    let abandoned = common::records::plant(
        &store,
        "cli-tenant",
        "orders.place",
        blink,
        Duration::from_millis(100),
        None,
    )
    .await;
    wait_expired(&store, &abandoned).await;
    let before = store
        .fetch(&abandoned)
        .await
        .expect("fetch")
        .expect("record");

    let inspected = run_from([
        "idempotent",
        "inspect",
        "--database-url",
        &url,
        "--scope",
        abandoned.scope(),
        "--tenant",
        abandoned.tenant(),
        "--key",
        abandoned.key(),
        "--json",
    ])
    .await
    .expect("inspect");
    let json: serde_json::Value = serde_json::from_str(&inspected).expect("json");
    assert_eq!(
        (&json["expired"], &json["stuck"]),
        (&serde_json::json!(true), &serde_json::json!(false)),
        "{json}"
    );

    for even_if_running in [false, true] {
        let mut args = vec![
            "idempotent",
            "release",
            "--database-url",
            &url,
            "--scope",
            abandoned.scope(),
            "--tenant",
            abandoned.tenant(),
            "--key",
            abandoned.key(),
            "--reason",
            "INC-7",
            "--end-lease",
        ];
        if even_if_running {
            args.push("--even-if-running");
        }
        let refused = run_from(args)
            .await
            .expect_err("no record to end a lease of");
        assert!(matches!(refused, CliError::NoRecord { .. }), "{refused:?}");
        let after = store
            .fetch(&abandoned)
            .await
            .expect("fetch")
            .expect("record");
        assert!(after.is_expired(), "still counts as absent");
        assert_eq!(
            (after.lease_expires_at_ms, after.expires_at_ms),
            (before.lease_expires_at_ms, before.expires_at_ms),
            "nothing written"
        );
    }
}

/// A `sqlite:file:` URL (an SQLite URI filename: `file:PATH`,
/// `file:///PATH`, `file://localhost/PATH`, which the store opens) names the
/// file in it: the command line opens that file as the store does. It said
/// "there is no SQLite database at file:/…" of a file that was there. A URI
/// naming no file is still refused, and nothing is created there.
#[tokio::test]
async fn a_sqlite_uri_filename_opens_the_file_it_names() {
    let dir = Scratch::new();
    let manifest = dir.file("idempotent.toml", MANIFEST);
    let store = SqliteStore::connect(&dir.db_url())
        .await
        .expect("sqlite file");
    let id = plant(&store, "orders.place", Duration::from_secs(3600)).await;
    let path = dir.0.join("idem.db");
    let path = path.display();
    let urls = [
        format!("sqlite:file:{path}"),
        format!("sqlite:file:{path}?mode=ro"),
        format!("sqlite:file://{path}"),
        format!("sqlite:file://localhost{path}"),
    ];
    // The store itself opens it (SQLite reads every filename as a URI).
    let opened = idempotent_runtime::connect_url(&urls[0])
        .await
        .expect("the store opens a URI filename");
    assert!(opened.fetch(&id).await.expect("fetch").is_some());
    for url in &urls {
        let out = run_from([
            "idempotent",
            "inspect",
            "--database-url",
            url,
            "--scope",
            "orders.place",
            "--tenant",
            "cli-tenant",
            "--key",
            id.key(),
        ])
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(out.contains("complete"), "{url}: {out}");
        let audit = audit_json(url, &manifest)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(audit.contains("orders.place"), "{url}: {audit}");
    }

    let typo = dir.0.join("typo.db");
    for url in [
        format!("sqlite:file:{}", typo.display()),
        format!("sqlite:file://{}?mode=rwc", typo.display()),
    ] {
        for command in commands_opening(&url, &manifest) {
            let e = run_from(command.clone())
                .await
                .expect_err("no database at that path");
            assert!(
                matches!(e, CliError::NoSqliteDatabase { .. }),
                "{command:?}: {e}"
            );
            assert!(!typo.exists(), "{command:?} created {}", typo.display());
        }
    }
}

/// A writer the operator log goes to, kept for the test to read.
#[derive(Clone, Default)]
struct CapturedLog(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLog {
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

/// The operator log is the record of who released what and why: a
/// `--reason` holding a line break (a ticket title pasted in, or on purpose)
/// stays inside its own event, escaped. It was written as it was, and what
/// followed the line break read as another event of the log.
#[tokio::test]
async fn a_release_reason_cannot_forge_a_line_of_the_operator_log() {
    use tracing::instrument::WithSubscriber;
    let dir = Scratch::new();
    let url = dir.db_url();
    let store = SqliteStore::connect(&url).await.expect("sqlite file");
    let forged = "2026-12-06T14:40:12.631014Z  INFO idempotent::operator: nothing was released";
    // Released, refused, and both with --end-lease: each one event.
    for (key, live, end_lease) in [
        ("stuck", false, false),
        ("stuck-end-lease", false, true),
        ("running", true, false),
        ("running-end-lease", true, true),
    ] {
        {
            if live {
                plant_running(&store, "cli.reason", "t", key).await;
            } else {
                plant_stuck(&store, "cli.reason", "t", key).await;
            }
            let captured = CapturedLog::default();
            let writer = captured.clone();
            let log = idempotent_runtime::cli::log_subscriber(move || writer.clone(), false);
            let reason = format!("INC-9\n{forged}\r\x1b[2K");
            let mut args = vec![
                "idempotent",
                "release",
                "--database-url",
                &url,
                "--scope",
                "cli.reason",
                "--tenant",
                "t",
                "--key",
                key,
                "--reason",
                &reason,
            ];
            if end_lease {
                args.push("--end-lease");
            }
            let _ = run_from(args).with_subscriber(log).await;
            let text = String::from_utf8_lossy(&captured.0.lock().expect("log")).into_owned();
            assert_eq!(
                text.lines().count(),
                1,
                "one event, one line ({key}, end_lease {end_lease}):\n{text}"
            );
            assert!(text.contains("INC-9") && !text.contains('\x1b'), "{text}");
        }
    }
}

/// A relative `sqlite:` path that names no file is reported with the
/// directory it was looked for from: "no SQLite database at data/app.db"
/// does not say that the command ran in the wrong directory.
#[tokio::test]
async fn a_missing_relative_sqlite_path_is_reported_from_the_current_directory() {
    let relative = format!("no-such-dir-{}/idem.db", uuid::Uuid::new_v4().simple());
    let url = format!("sqlite:{relative}");
    let e = run_from(["idempotent", "purge", "--database-url", &url])
        .await
        .expect_err("no database there");
    let CliError::NoSqliteDatabase { path } = &e else {
        panic!("{e}");
    };
    let here = std::env::current_dir().expect("current directory");
    assert_eq!(path, &here.join(&relative), "{e}");
    assert!(e.to_string().contains(&here.display().to_string()), "{e}");
    assert!(!here.join(&relative).exists());
}
