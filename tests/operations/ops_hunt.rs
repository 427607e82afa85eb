//! An independent tester's attacks on the operations side (purge, audit, the
//! command line), on every store: what broke is kept as a regression test of
//! its fix, what held as a regression test of its own.
//!
//! Scopes carry a uuid suffix, tenants are fresh: the shared server databases
//! work (a purge there also deletes other tests' expired records, which they
//! allow for).

use crate::common;

use idempotent_runtime::audit::{audit, KnownScope};
use idempotent_runtime::registry::Format;
use idempotent_runtime::{
    Completion, Fenced, Identity, MemoryStore, OwnerToken, RecordState, Reservation,
    ReserveRequest, SqliteStore, Store, StoredOutcome,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(3600);
const BLINK: Duration = Duration::from_millis(1);

fn unique(prefix: &str) -> String {
    format!("{prefix}.{}", uuid::Uuid::new_v4().simple())
}

async fn reserve(
    store: &dyn Store,
    identity: &Identity,
    token: &OwnerToken,
    lease: Duration,
    ttl: Duration,
) -> Reservation {
    store
        .reserve(ReserveRequest {
            identity,
            fingerprint: None,
            token,
            lease,
            ttl,
        })
        .await
        .expect("reserve")
}

/// Waits (bounded) until, on the store's clock, every one of `ids` counts as
/// expired (`lease_only`: its lease ran out). A record already gone counts
/// (another test's purge on a shared server deletes only what expired).
async fn wait_for_clock(store: &dyn Store, ids: &[Identity], lease_only: bool) {
    for _ in 0..1000 {
        let mut all = true;
        for id in ids {
            let Some(snap) = store.fetch(id).await.expect("fetch") else {
                continue;
            };
            all &= if lease_only {
                snap.lease_expires_at_ms.is_some_and(|l| l <= snap.now_ms)
            } else {
                snap.is_expired()
            };
            if !all {
                break;
            }
        }
        if all {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the store's clock did not pass the planted expiries within 5 s");
}

/// Purges run without pause while callers race for records that have just
/// become purgeable (abandoned: lease and ttl both run out) and records that
/// are stuck (lease run out, ttl live), under many tenants of one scope. Of
/// the callers of one identity exactly one acquires (a purge never deletes
/// the record a caller has just replaced or taken over, which would let a
/// second caller acquire it too), its completion is written (never refused as
/// a lost lease because the purge deleted the new owner's record), the stuck
/// records are never purged, and afterwards every record replays.
async fn purge_races_replacements_and_takeovers(store: Arc<dyn Store>, rounds: usize) {
    const IDENTITIES: usize = 24;
    const CALLERS: usize = 3;
    const PURGERS: usize = 2;
    let scope = unique("ops.purge_race");
    for round in 0..rounds {
        // Half abandoned (purgeable), half stuck (a takeover's, not the purge's).
        let mut abandoned = Vec::new();
        let mut stuck = Vec::new();
        for i in 0..IDENTITIES {
            let tenant = format!("{}-{round}-{i}", common::servers::fresh_tenant());
            let id = Identity::new(tenant, scope.as_str(), format!("k{i}")).expect("identity");
            let ttl = if i % 2 == 0 { BLINK } else { LONG };
            let reserved = reserve(&*store, &id, &OwnerToken::new(), BLINK, ttl).await;
            assert!(
                matches!(reserved, Reservation::Acquired { .. }),
                "{reserved:?}"
            );
            if i % 2 == 0 {
                abandoned.push(id);
            } else {
                stuck.push(id);
            }
        }
        wait_for_clock(&*store, &abandoned, false).await;
        wait_for_clock(&*store, &stuck, true).await;

        let stop = Arc::new(AtomicBool::new(false));
        let purged = Arc::new(AtomicU64::new(0));
        let start = Arc::new(tokio::sync::Barrier::new(PURGERS + IDENTITIES * CALLERS));
        let mut purgers = Vec::new();
        for p in 0..PURGERS {
            let (store, stop, purged, start) = (
                Arc::clone(&store),
                Arc::clone(&stop),
                Arc::clone(&purged),
                Arc::clone(&start),
            );
            purgers.push(tokio::spawn(async move {
                start.wait().await;
                // Small batches: many statements interleave with the callers.
                let batch = 1 + p as u32 * 2;
                while !stop.load(Ordering::SeqCst) {
                    let n = store.purge_expired(batch).await.expect("purge");
                    purged.fetch_add(n, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                }
            }));
        }
        let all: Vec<Identity> = abandoned.iter().chain(&stuck).cloned().collect();
        let mut callers = Vec::new();
        for id in &all {
            for _ in 0..CALLERS {
                let (store, id, start) = (Arc::clone(&store), id.clone(), Arc::clone(&start));
                callers.push(tokio::spawn(async move {
                    start.wait().await;
                    let token = OwnerToken::new();
                    let answer = reserve(&*store, &id, &token, LONG, LONG).await;
                    (id, token, answer)
                }));
            }
        }
        let mut owners: std::collections::HashMap<Identity, Vec<(OwnerToken, bool)>> =
            Default::default();
        for caller in callers {
            let (id, token, answer) = caller.await.expect("caller");
            match answer {
                Reservation::Acquired { took_over, .. } => {
                    owners.entry(id).or_default().push((token, took_over))
                }
                Reservation::InProgress { .. } => {}
                other => panic!("{}: unexpected answer {other:?}", store.name()),
            }
        }
        // Completions while the purges still run.
        for id in &all {
            let acquired = owners.get(id).map_or(0, Vec::len);
            assert_eq!(
                acquired,
                1,
                "{} round {round}: {acquired} callers of one identity acquired it (purged {})",
                store.name(),
                purged.load(Ordering::SeqCst)
            );
            let (token, took_over) = &owners[id][0];
            let outcome = StoredOutcome {
                is_error: false,
                payload: b"\"done\"".to_vec(),
            };
            let written = store
                .complete(Completion::by_body(id, token, &outcome, LONG))
                .await
                .expect("complete");
            assert_eq!(
                written,
                Fenced::Written,
                "{} round {round}: the new owner's completion was refused (took over: {took_over})",
                store.name()
            );
        }
        stop.store(true, Ordering::SeqCst);
        for p in purgers {
            p.await.expect("purger");
        }
        for id in &all {
            let snap = store.fetch(id).await.expect("fetch");
            assert_eq!(
                snap.map(|s| s.state),
                Some(RecordState::Complete),
                "{}",
                store.name()
            );
            let replay = reserve(&*store, id, &OwnerToken::new(), LONG, LONG).await;
            assert!(
                matches!(replay, Reservation::Completed(_)),
                "{}: {replay:?}",
                store.name()
            );
        }
        // The stuck ones were taken over (attempt 2), never replaced.
        for id in &stuck {
            assert!(
                owners[id][0].1,
                "{}: a stuck record was purged",
                store.name()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_races_replacements_and_takeovers_on_memory() {
    purge_races_replacements_and_takeovers(Arc::new(MemoryStore::new()), 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_races_replacements_and_takeovers_on_sqlite() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("ops-purge-race"))
        .await
        .expect("sqlite");
    purge_races_replacements_and_takeovers(Arc::new(store), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_races_replacements_and_takeovers_on_postgres() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    purge_races_replacements_and_takeovers(Arc::new(store), 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_races_replacements_and_takeovers_on_mariadb() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    purge_races_replacements_and_takeovers(Arc::new(store), 6).await;
}

/// A scope name in the store is whatever was written there (the `Store` API
/// checks its length alone; an older build, another program): the audit's
/// table shows one holding a line break or a terminal escape as text, on one
/// line of its own, so it can neither forge rows nor a summary, nor drive the
/// operator's terminal.
#[tokio::test]
async fn an_audit_table_shows_control_characters_in_a_scope_as_text() {
    let store = MemoryStore::new();
    let forged = "evil.scope\norders.place  claimed  1  0  0  0  0  0  -  app\n\
                  memory store: 1 scope(s), 1 record(s); 0 orphan scope(s)\x1b[2K";
    let id = Identity::new("t", forged, "k").expect("the Store API takes it");
    let token = OwnerToken::new();
    let reserved = reserve(&store, &id, &token, LONG, LONG).await;
    assert!(matches!(reserved, Reservation::Acquired { .. }));
    let report = audit(&store, &[KnownScope::claimed("orders.place", "app")])
        .await
        .expect("audit");
    let table = report.render(Format::Table);
    assert!(
        !table.contains('\x1b'),
        "the terminal escape is printed raw:\n{table}"
    );
    // Header, rule, two rows (the orphan and the unused claimed scope), an
    // empty line, the summary and the orphans' advice.
    let rows: Vec<&str> = table
        .lines()
        .skip(2)
        .take_while(|l| !l.is_empty())
        .collect();
    assert_eq!(rows.len(), 2, "the scope forged rows:\n{table}");
    assert!(
        rows.iter().any(|r| r.starts_with("evil.scope\\n")),
        "{table}"
    );
    // The JSON keeps the scope as it is (escaped by JSON itself).
    let json: serde_json::Value = serde_json::from_str(&report.render(Format::Json)).expect("json");
    assert!(json["scopes"]
        .as_array()
        .expect("scopes")
        .iter()
        .any(|s| s["scope"] == forged));
}

/// As above, for the characters that reorder or break a line without being
/// control characters: a bidirectional override (U+202E) in a scope written
/// raw turns the rest of its row around wherever the table is shown by a
/// renderer that applies the Unicode bidirectional algorithm (a browser's
/// CI log, a dashboard, a bidi terminal), so the row's counts read reversed,
/// and a line separator (U+2028) breaks the row there. Both are shown as
/// text, as a control character is.
#[tokio::test]
async fn an_audit_table_shows_bidi_overrides_and_line_separators_in_a_scope_as_text() {
    let store = MemoryStore::new();
    for (key, forged) in [
        ("rlo", "evil.scope\u{202e}9 9 9"),
        ("isolate", "evil.isolate\u{2067}x\u{2069}"),
        ("ls", "evil.ls\u{2028}orders.place  claimed"),
    ] {
        let id = Identity::new("t", forged, key).expect("the Store API takes it");
        let reserved = reserve(&store, &id, &OwnerToken::new(), LONG, LONG).await;
        assert!(matches!(reserved, Reservation::Acquired { .. }));
    }
    let report = audit(&store, &[]).await.expect("audit");
    let table = report.render(Format::Table);
    for raw in ['\u{202e}', '\u{2067}', '\u{2069}', '\u{2028}'] {
        assert!(
            !table.contains(raw),
            "{raw:?} is printed raw:\n{}",
            table.escape_debug()
        );
    }
    assert!(table.contains("evil.scope\\u{202e}9 9 9"), "{table}");
    assert!(table.contains("evil.ls\\u{2028}orders.place"), "{table}");
}

/// A database a newer build has migrated (its history holds a version this
/// build does not know: a rolling deploy, or a rollback) is left alone, as the
/// README's upgrade section says, by the command line too: `audit` and
/// `purge` work there, the purge deletes the expired records of many tenants
/// and none of the live ones, the audit then agrees with the store, and the
/// unknown version is still in the history.
#[tokio::test]
async fn the_command_line_works_on_a_database_a_newer_build_migrated() {
    use idempotent_runtime::cli::run_from;
    let path = common::scratch::sqlite_path("ops-cli-newer");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let store = SqliteStore::connect(&url).await.expect("a store");
    sqlx::query(
        "INSERT INTO idempotency_schema_migrations (version, description, checksum, applied_at) \
         VALUES (9999, 'a newer build', x'00', 0)",
    )
    .execute(store.pool())
    .await
    .expect("a newer build's migration");
    let scope = "orders.place";
    let mut expired = Vec::new();
    let mut live = Vec::new();
    for i in 0..40 {
        // Tenants of every shape the identity takes.
        let tenant = format!("tenant {i} ü/é'\"%_*");
        let ttl = if i % 2 == 0 { BLINK } else { LONG };
        let id = common::records::plant(&store, &tenant, scope, LONG, LONG, Some(ttl)).await;
        if i % 2 == 0 {
            expired.push(id);
        } else {
            live.push(id);
        }
    }
    wait_for_clock(&store, &expired, false).await;
    let dir = common::scratch::dir("ops-cli-newer");
    let manifest = dir.join("idempotent.toml");
    std::fs::write(&manifest, "[scopes.\"orders.place\"]\n").expect("manifest");
    let manifest = manifest.display().to_string();
    let file_url = format!("sqlite://{}", path.display());

    let audit_json = || {
        run_from([
            "idempotent",
            "audit",
            "--database-url",
            &file_url,
            "--manifest",
            &manifest,
            "--json",
        ])
    };
    let before: serde_json::Value =
        serde_json::from_str(&audit_json().await.expect("audit")).expect("json");
    assert_eq!(before["scopes"][0]["expired"], 20, "{before}");
    assert_eq!(before["scopes"][0]["complete"], 20, "{before}");
    let purged: serde_json::Value = serde_json::from_str(
        &run_from([
            "idempotent",
            "purge",
            "--database-url",
            &file_url,
            "--batch",
            "3",
            "--json",
        ])
        .await
        .expect("purge"),
    )
    .expect("json");
    assert_eq!(purged["deleted"], 20, "{purged}");
    let after: serde_json::Value =
        serde_json::from_str(&audit_json().await.expect("audit")).expect("json");
    assert_eq!(after["scopes"][0]["expired"], 0, "{after}");
    assert_eq!(after["scopes"][0]["complete"], 20, "{after}");
    for id in &live {
        assert_eq!(
            store.fetch(id).await.expect("fetch").map(|s| s.state),
            Some(RecordState::Complete)
        );
    }
    for id in &expired {
        assert!(store.fetch(id).await.expect("fetch").is_none());
    }
    let kept: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idempotency_schema_migrations WHERE version = 9999",
    )
    .fetch_one(store.pool())
    .await
    .expect("history");
    assert_eq!(kept, 1);
}

/// An in-memory SQLite URL names a database that is new and empty whenever
/// the command opens it: every command says it holds no idempotency records
/// (check the URL), never that its schema is older than the command's (which
/// sends the operator to deploy the application first).
#[tokio::test]
async fn an_in_memory_sqlite_url_is_said_to_hold_no_records() {
    use idempotent_runtime::cli::{run_from, CliError};
    let dir = common::scratch::dir("ops-cli-memory");
    let manifest = dir.join("idempotent.toml");
    std::fs::write(&manifest, "[scopes.\"orders.place\"]\n").expect("manifest");
    let manifest = manifest.display().to_string();
    for url in [
        "sqlite::memory:",
        "sqlite://:memory:",
        "sqlite:file::memory:",
    ] {
        for command in [
            vec![
                "idempotent",
                "audit",
                "--database-url",
                url,
                "--manifest",
                &manifest,
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
        ] {
            let e = run_from(command.clone()).await.expect_err("nothing there");
            assert!(
                matches!(e, CliError::NoIdempotencyTables),
                "{command:?}: {e}"
            );
        }
    }
}

/// A purger asked to run once and then (as good as) never again, with an
/// interval of `Duration::MAX`, runs its first run at once and stays up: its
/// timer's next deadline, now plus the interval, does not fit in an
/// `Instant`, and a timer that added them unchecked would panic the task
/// before its first run.
#[tokio::test]
async fn a_purger_with_the_longest_interval_runs_at_once_and_stays_up() {
    use idempotent_runtime::purge::{Purger, PurgerConfig};
    let store = MemoryStore::new();
    let expired =
        common::records::plant(&store, "t", "ops.purger_max", LONG, LONG, Some(BLINK)).await;
    wait_for_clock(&store, std::slice::from_ref(&expired), false).await;
    for interval in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
        let purger = Purger::spawn(
            store.clone(),
            PurgerConfig {
                interval,
                batch: 10,
            },
        );
        // Bounded: a run ends, or the task does.
        for _ in 0..2000 {
            if purger.stats().runs > 0 || purger.is_finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            !purger.is_finished(),
            "{interval:?}: the purger's task ended"
        );
        let stats = purger.shutdown().await;
        assert_eq!(stats.runs, 1, "{interval:?}: {stats:?}");
    }
    assert!(store.fetch(&expired).await.expect("fetch").is_none());
}

/// What the audit calls each record is what the next call of its key finds,
/// on every store: a complete record replays, an expired one (complete, or in
/// progress with lease and ttl both run out) is replaced as attempt 1, an
/// in-progress one whose ttl ran out but whose lease is live is in progress
/// (never expired), a stuck one is taken over as attempt 2; taken-over and
/// recovered records are counted, and so are the waits of the stuck and the
/// unpurged. Run in a database (schema) of its own: nobody else's purge
/// deletes the planted expired records.
async fn the_audit_agrees_with_the_next_call(store: &dyn Store) {
    let scope = unique("ops.audit_agrees");
    let tenant = common::servers::fresh_tenant();
    let id = |name: &str| Identity::new(tenant.as_str(), scope.as_str(), name).expect("identity");
    let outcome = StoredOutcome {
        is_error: false,
        payload: b"\"ok\"".to_vec(),
    };
    let plant = |name: &'static str, lease: Duration, ttl: Duration| {
        let identity = id(name);
        async move {
            let token = OwnerToken::new();
            let r = reserve(store, &identity, &token, lease, ttl).await;
            assert!(matches!(r, Reservation::Acquired { .. }), "{name}: {r:?}");
            (identity, token)
        }
    };
    let complete = |identity: &Identity, token: &OwnerToken, ttl: Duration, by| {
        let (identity, token, outcome) = (identity.clone(), token.clone(), outcome.clone());
        async move {
            let written = store
                .complete(Completion {
                    identity: &identity,
                    token: &token,
                    outcome: &outcome,
                    ttl,
                    by,
                })
                .await
                .expect("complete");
            assert_eq!(written, Fenced::Written);
        }
    };
    use idempotent_runtime::AnsweredBy::{Body, RecoverHook};
    let (live, t) = plant("complete-live", LONG, LONG).await;
    complete(&live, &t, LONG, Body).await;
    let (expired_complete, t) = plant("complete-expired", LONG, LONG).await;
    complete(&expired_complete, &t, BLINK, Body).await;
    let (running_past_ttl, _) = plant("running-past-ttl", LONG, BLINK).await;
    let (stuck, _) = plant("stuck", BLINK, LONG).await;
    let (abandoned, _) = plant("abandoned", BLINK, BLINK).await;
    let (taken, _) = plant("taken-over", BLINK, LONG).await;
    let (recovered, _) = plant("recovered", BLINK, LONG).await;
    wait_for_clock(store, &[expired_complete.clone(), abandoned.clone()], false).await;
    wait_for_clock(
        store,
        &[stuck.clone(), taken.clone(), recovered.clone()],
        true,
    )
    .await;
    for (identity, by) in [(&taken, Body), (&recovered, RecoverHook)] {
        let token = OwnerToken::new();
        let r = reserve(store, identity, &token, LONG, LONG).await;
        assert!(
            matches!(
                r,
                Reservation::Acquired {
                    took_over: true,
                    attempt: 2,
                    ..
                }
            ),
            "{r:?}"
        );
        complete(identity, &token, LONG, by).await;
    }
    // The running record's ttl has run out by now (it was planted before
    // the expired ones, with the same ttl).
    let snap = store
        .fetch(&running_past_ttl)
        .await
        .expect("fetch")
        .expect("a live lease keeps it");
    assert!(snap.expires_at_ms <= snap.now_ms, "{snap:?}");

    let report = audit(store, &[KnownScope::claimed(scope.as_str(), "ops")])
        .await
        .expect("audit");
    let s = report.scope(&scope).expect("the scope");
    let name = store.name();
    assert_eq!(
        (s.complete, s.in_progress, s.stuck, s.expired),
        (3, 1, 1, 2),
        "{name}: {s:?}"
    );
    assert_eq!((s.taken_over, s.recovered), (2, 1), "{name}: {s:?}");
    assert!(
        s.longest_stuck_ms.is_some_and(|ms| ms >= 0),
        "{name}: {s:?}"
    );
    assert!(
        s.longest_unpurged_ms.is_some_and(|ms| ms >= 0),
        "{name}: {s:?}"
    );

    // The next call of each key.
    let next = |identity: &Identity| {
        let identity = identity.clone();
        async move { reserve(store, &identity, &OwnerToken::new(), LONG, LONG).await }
    };
    for identity in [&live, &taken, &recovered] {
        let r = next(identity).await;
        assert!(matches!(r, Reservation::Completed(_)), "{name}: {r:?}");
    }
    for identity in [&expired_complete, &abandoned] {
        let r = next(identity).await;
        assert!(
            matches!(
                r,
                Reservation::Acquired {
                    took_over: false,
                    attempt: 1,
                    ..
                }
            ),
            "{name}: {r:?}"
        );
    }
    let r = next(&running_past_ttl).await;
    assert!(matches!(r, Reservation::InProgress { .. }), "{name}: {r:?}");
    let r = next(&stuck).await;
    assert!(
        matches!(
            r,
            Reservation::Acquired {
                took_over: true,
                attempt: 2,
                ..
            }
        ),
        "{name}: {r:?}"
    );
    // And the audit follows: the replaced and taken-over records are live.
    let report = audit(store, &[KnownScope::claimed(scope.as_str(), "ops")])
        .await
        .expect("audit");
    let s = report.scope(&scope).expect("the scope");
    assert_eq!(
        (s.complete, s.in_progress, s.stuck, s.expired, s.taken_over),
        (3, 4, 0, 0, 3),
        "{name}: {s:?}"
    );
}

#[tokio::test]
async fn the_audit_agrees_with_the_next_call_on_memory() {
    the_audit_agrees_with_the_next_call(&MemoryStore::new()).await;
}

#[tokio::test]
async fn the_audit_agrees_with_the_next_call_on_sqlite() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("ops-audit-agrees"))
        .await
        .expect("sqlite");
    the_audit_agrees_with_the_next_call(&store).await;
}

#[tokio::test]
async fn the_audit_agrees_with_the_next_call_on_postgres() {
    if common::servers::pg_store_or_skip().await.is_none() {
        return;
    }
    let (mut admin, schema, url) = common::servers::pg_schema_of_its_own("h_ops_audit").await;
    let store = idempotent_runtime::PgStore::connect(&url)
        .await
        .expect("a store in the schema");
    the_audit_agrees_with_the_next_call(&store).await;
    drop(store);
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&mut admin)
        .await
        .expect("drop schema");
}

#[tokio::test]
async fn the_audit_agrees_with_the_next_call_on_mariadb() {
    let Some(admin) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let database = common::servers::mysql_create_database(&admin, "h_ops_audit").await;
    let url = match common::servers::mysql_url().rsplit_once('/') {
        Some((server, _)) => format!("{server}/{database}"),
        None => panic!("a database in the URL"),
    };
    let store = idempotent_runtime::MySqlStore::connect(&url)
        .await
        .expect("a store in the database");
    the_audit_agrees_with_the_next_call(&store).await;
    drop(store);
    sqlx::query(&format!("DROP DATABASE `{database}`"))
        .execute(admin.pool())
        .await
        .expect("drop database");
}

/// A SQLite file opened read-only (`?mode=ro`, as the README shows for
/// `audit`) is audited, and a purge through it fails saying the database is
/// read-only, deleting nothing, rather than pretending it purged.
#[tokio::test]
async fn a_purge_through_a_read_only_sqlite_url_fails_saying_so() {
    use idempotent_runtime::cli::run_from;
    let path = common::scratch::sqlite_path("ops-cli-ro");
    let store = SqliteStore::connect(&format!("sqlite://{}?mode=rwc", path.display()))
        .await
        .expect("a store");
    let expired =
        common::records::plant(&store, "t", "orders.place", LONG, LONG, Some(BLINK)).await;
    wait_for_clock(&store, std::slice::from_ref(&expired), false).await;
    let ro = format!("sqlite:file:{}?mode=ro", path.display());
    let e = run_from(["idempotent", "purge", "--database-url", &ro])
        .await
        .expect_err("a read-only database cannot be purged");
    let text = e.to_string();
    assert!(text.contains("read"), "{text}");
    assert!(store.fetch(&expired).await.expect("fetch").is_some());
}

/// A PostgreSQL pool whose sessions default to SERIALIZABLE (or REPEATABLE
/// READ: `default_transaction_isolation`, on the database or in the connect
/// options) has a purge statement whose snapshot predates another purge's
/// delete of one of its expired records (two purgers, or the command line
/// beside the application's): locking that row fails with a serialization
/// failure. The purge sends the statement again with a fresh snapshot, as the
/// store's fenced writes do, instead of failing the run.
///
/// The purge is held after its snapshot by a test-only wrapper of the
/// store's clock function in a schema of its own, gated by an advisory lock
/// for the sessions of one application name.
#[tokio::test]
async fn a_purge_under_serializable_outlives_a_concurrent_purge_of_its_rows_on_postgres() {
    let Some((mut admin, schema, plain, gated)) = pg_gated_schema().await else {
        return;
    };
    let expired = common::records::plant(&plain, "t", "ops.ser", LONG, LONG, Some(BLINK)).await;
    wait_for_clock(&plain, std::slice::from_ref(&expired), false).await;
    close_gate(&mut admin).await;
    let held = tokio::spawn(async move { gated.purge_expired(10).await });
    // The gated purge waits at the gate, its snapshot taken.
    until_held_at_the_gate(&mut admin).await;
    // Another purge deletes the record meanwhile.
    assert_eq!(plain.purge_expired(10).await.expect("purge"), 1);
    open_gate(&mut admin).await;
    let answer = held.await.expect("the gated purge");
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&mut admin)
        .await
        .expect("drop schema");
    assert_eq!(
        answer.expect("the purge goes on past the serialization failure"),
        0
    );
}

/// A record taken over and then abandoned for good (lease and ttl run out)
/// is replaced by the next call as a fresh attempt 1, never taken over as
/// attempt 3, and the audit no longer counts it as taken over: on every
/// store.
async fn a_taken_over_record_that_expired_starts_again_at_attempt_1(store: &dyn Store) {
    let scope = unique("ops.retaken");
    let id = Identity::new(common::servers::fresh_tenant(), scope.as_str(), "k").expect("id");
    let r = reserve(store, &id, &OwnerToken::new(), BLINK, LONG).await;
    assert!(
        matches!(r, Reservation::Acquired { attempt: 1, .. }),
        "{r:?}"
    );
    wait_for_clock(store, std::slice::from_ref(&id), true).await;
    let r = reserve(store, &id, &OwnerToken::new(), BLINK, BLINK).await;
    assert!(
        matches!(
            r,
            Reservation::Acquired {
                took_over: true,
                attempt: 2,
                ..
            }
        ),
        "{}: {r:?}",
        store.name()
    );
    wait_for_clock(store, std::slice::from_ref(&id), false).await;
    // (Another test's purge on a shared server may have deleted it already.)
    let report = audit(store, &[]).await.expect("audit");
    if let Some(s) = report.scope(&scope) {
        assert_eq!((s.expired, s.taken_over), (1, 0), "{}: {s:?}", store.name());
    }
    let r = reserve(store, &id, &OwnerToken::new(), LONG, LONG).await;
    assert!(
        matches!(
            r,
            Reservation::Acquired {
                took_over: false,
                attempt: 1,
                ..
            }
        ),
        "{}: {r:?}",
        store.name()
    );
    let report = audit(store, &[]).await.expect("audit");
    let s = report.scope(&scope).expect("listed");
    assert_eq!(
        (s.in_progress, s.taken_over, s.expired),
        (1, 0, 0),
        "{}: {s:?}",
        store.name()
    );
}

#[tokio::test]
async fn a_taken_over_record_that_expired_starts_again_on_every_store() {
    a_taken_over_record_that_expired_starts_again_at_attempt_1(&MemoryStore::new()).await;
    let sqlite = SqliteStore::connect(&common::scratch::sqlite_url("ops-retaken"))
        .await
        .expect("sqlite");
    a_taken_over_record_that_expired_starts_again_at_attempt_1(&sqlite).await;
    if let Some(pg) = common::servers::pg_store_or_skip().await {
        a_taken_over_record_that_expired_starts_again_at_attempt_1(&pg).await;
    }
    if let Some(my) = common::servers::mysql_store_or_skip().await {
        a_taken_over_record_that_expired_starts_again_at_attempt_1(&my).await;
    }
}

/// A PostgreSQL schema of its own whose clock function holds the sessions
/// of the application `ops_gated` at an advisory lock (`GATE`) while the
/// test holds it; answers the admin connection, the schema, a plain store
/// there and a store whose sessions are gated and default to SERIALIZABLE.
async fn pg_gated_schema() -> Option<(
    sqlx::PgConnection,
    String,
    idempotent_runtime::PgStore,
    idempotent_runtime::PgStore,
)> {
    common::servers::pg_store_or_skip().await?;
    let (mut admin, schema, url) = common::servers::pg_schema_of_its_own("h_ops_gate").await;
    let plain = idempotent_runtime::PgStore::connect(&url)
        .await
        .expect("a store in the schema");
    sqlx::query(&format!(
        "CREATE OR REPLACE FUNCTION {schema}.idempotency_now_ms() RETURNS BIGINT
         LANGUAGE plpgsql VOLATILE AS $f$
         BEGIN
             IF current_setting('application_name') = 'ops_gated' THEN
                 PERFORM pg_advisory_xact_lock_shared({GATE});
             END IF;
             RETURN (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT;
         END $f$"
    ))
    .execute(&mut admin)
    .await
    .expect("wrap the clock");
    let gated = idempotent_runtime::PgStore::connect(&format!(
        "{url}%20-c%20default_transaction_isolation%3Dserializable&application_name=ops_gated"
    ))
    .await
    .expect("a serializable store");
    Some((admin, schema, plain, gated))
}

const GATE: i64 = 0x0b5_9a7f;

/// Closes the gate.
async fn close_gate(admin: &mut sqlx::PgConnection) {
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(GATE)
        .execute(admin)
        .await
        .expect("close the gate");
}

/// Waits (bounded) until a gated session waits at the gate.
async fn until_held_at_the_gate(admin: &mut sqlx::PgConnection) {
    for _ in 0..2000 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE a.application_name = 'ops_gated' AND l.locktype = 'advisory'
                AND NOT l.granted",
        )
        .fetch_one(&mut *admin)
        .await
        .expect("pg_locks");
        if n > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("no gated session reached the gate");
}

async fn open_gate(admin: &mut sqlx::PgConnection) {
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(GATE)
        .execute(admin)
        .await
        .expect("open the gate");
}

/// An operator's release (`idempotent release`) of a stuck record under a
/// SERIALIZABLE (or REPEATABLE READ) default, while a call takes the record
/// over: the release's snapshot predates the takeover, and its delete failed
/// with a bare serialization failure ("could not serialize access"), which
/// tells the operator nothing. Made again with a fresh snapshot, it finds the
/// lease live and refuses as it should.
#[tokio::test]
async fn a_release_under_serializable_meeting_a_takeover_is_refused_as_live_on_postgres() {
    let Some((mut admin, schema, plain, gated)) = pg_gated_schema().await else {
        return;
    };
    let stuck = common::records::plant(&plain, "t", "ops.rel", BLINK, LONG, None).await;
    wait_for_clock(&plain, std::slice::from_ref(&stuck), true).await;
    close_gate(&mut admin).await;
    let release = {
        let stuck = stuck.clone();
        tokio::spawn(async move { gated.force_release(&stuck, true).await })
    };
    until_held_at_the_gate(&mut admin).await;
    let r = reserve(&plain, &stuck, &OwnerToken::new(), LONG, LONG).await;
    assert!(
        matches!(
            r,
            Reservation::Acquired {
                took_over: true,
                ..
            }
        ),
        "{r:?}"
    );
    open_gate(&mut admin).await;
    let answer = release.await.expect("the release");
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&mut admin)
        .await
        .expect("drop schema");
    let answer = answer.expect("an answer, not a serialization failure");
    assert!(
        matches!(answer, idempotent_runtime::ForcedRelease::LeaseLive { .. }),
        "{answer:?}"
    );
}

/// An operator's release (`idempotent release`) through a store on a pool it
/// shares with application code, which gave the pool's one connection back
/// inside a transaction it began, wrote in and never ended (`BEGIN` sent as a
/// query, then an early return): the release's own `BEGIN` starts nothing
/// there (PostgreSQL warns and stays in the transaction that is open, at that
/// transaction's isolation level), and the release's `COMMIT` committed the
/// application's abandoned write with it. The purge closes such a connection
/// and takes another; the release must not commit what other code left open
/// either. (In a schema of its own, for the application's table.)
#[tokio::test]
async fn a_release_on_a_connection_left_in_a_transaction_commits_none_of_its_work_on_postgres() {
    release_beside_a_transaction_left_open("BEGIN; INSERT INTO app_work VALUES (1)", false).await;
}

/// As above, with the application's transaction left failed (a statement of
/// its own failed there, then the early return): every statement is refused
/// there until it ends, the check for an open transaction included, and the
/// release failed with "current transaction is aborted", telling the
/// operator nothing of theirs was wrong. Such a connection is closed and
/// another taken, as a reservation does: the release is made.
#[tokio::test]
async fn a_release_on_a_connection_left_in_a_failed_transaction_is_made_on_postgres() {
    release_beside_a_transaction_left_open(
        "BEGIN; INSERT INTO app_work VALUES (1); SELECT 1 / 0",
        true,
    )
    .await;
}

/// An operator's release of a stuck record through a store whose pool's one
/// connection application code gave back inside the transaction `left`
/// began; `must_release`: the release must be made (not refused).
async fn release_beside_a_transaction_left_open(left: &str, must_release: bool) {
    use sqlx::Executor;
    if common::servers::pg_store_or_skip().await.is_none() {
        return;
    }
    let (mut admin, schema, _) = common::servers::pg_schema_of_its_own("ops_release").await;
    admin
        .execute(format!("CREATE TABLE {schema}.app_work (x INT)").as_str())
        .await
        .expect("app table");
    let pool = common::servers::pg_one_connection_pool_in(&schema).await;
    let store = idempotent_runtime::PgStore::from_pool(pool.clone())
        .await
        .expect("store");
    let stuck =
        common::records::plant(&store, "t", "ops.release_left_open", BLINK, LONG, None).await;
    wait_for_clock(&store, std::slice::from_ref(&stuck), true).await;

    // The application's code leaves the pool's one connection in a
    // transaction it wrote in.
    let mut conn = pool.acquire().await.expect("connection");
    // (A failing statement fails the whole string; its transaction stays.)
    let _ = conn.execute(left).await;
    drop(conn);
    let released = store.force_release(&stuck, true).await;

    let committed: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.app_work"))
        .fetch_one(&mut admin)
        .await
        .expect("count the application's work");
    let records: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.idempotency_records"
    ))
    .fetch_one(&mut admin)
    .await
    .expect("count the records");
    drop(store);
    pool.close().await; // rolls back what was left open
    admin
        .execute(format!("DROP SCHEMA {schema} CASCADE").as_str())
        .await
        .expect("drop schema");
    assert_eq!(
        committed, 0,
        "the release ({released:?}) committed the application's abandoned write"
    );
    match released {
        Ok(answer) => assert!(
            matches!(answer, idempotent_runtime::ForcedRelease::Released { .. }) && records == 0,
            "{answer:?}, {records} records left as others see them"
        ),
        Err(e) => assert!(
            !must_release && records == 1 && e.to_string().contains("transaction"),
            "{e}"
        ),
    }
}

/// Records expire as fast as they are written while purges run without
/// pause: every reservation, completion and purge statement answers (no
/// deadlock, no lock wait that runs out between a purge and the calls
/// writing the expiry index next to the records it deletes), and every
/// completion is written.
async fn purges_beside_a_stream_of_short_lived_records(store: Arc<dyn Store>) {
    const WRITERS: usize = 6;
    const EACH: usize = 40;
    let scope = unique("ops.stream");
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(tokio::sync::Barrier::new(WRITERS + 2));
    let mut purgers = Vec::new();
    for p in 0..2u32 {
        let (store, stop, start) = (Arc::clone(&store), Arc::clone(&stop), Arc::clone(&start));
        purgers.push(tokio::spawn(async move {
            start.wait().await;
            let mut deleted = 0;
            while !stop.load(Ordering::SeqCst) {
                deleted += store.purge_expired(1 + 4 * p).await.expect("purge");
                tokio::task::yield_now().await;
            }
            deleted
        }));
    }
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (store, start, scope) = (Arc::clone(&store), Arc::clone(&start), scope.clone());
        writers.push(tokio::spawn(async move {
            start.wait().await;
            let tenant = common::servers::fresh_tenant();
            for i in 0..EACH {
                let id = Identity::new(tenant.as_str(), scope.as_str(), format!("{w}-{i}"))
                    .expect("identity");
                let token = OwnerToken::new();
                // The in-progress record's expiry lands in the purged range soon.
                let r = reserve(&*store, &id, &token, LONG, BLINK).await;
                assert!(matches!(r, Reservation::Acquired { .. }), "{r:?}");
                let outcome = StoredOutcome {
                    is_error: false,
                    payload: b"1".to_vec(),
                };
                let ttl = if i % 3 == 0 { LONG } else { BLINK };
                let written = store
                    .complete(Completion::by_body(&id, &token, &outcome, ttl))
                    .await
                    .expect("complete");
                assert_eq!(written, Fenced::Written, "{}", store.name());
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    stop.store(true, Ordering::SeqCst);
    for p in purgers {
        p.await.expect("purger");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_beside_a_stream_of_short_lived_records_on_sqlite() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("ops-stream"))
        .await
        .expect("sqlite");
    purges_beside_a_stream_of_short_lived_records(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_beside_a_stream_of_short_lived_records_on_postgres() {
    if let Some(store) = common::servers::pg_store_or_skip().await {
        purges_beside_a_stream_of_short_lived_records(Arc::new(store)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_beside_a_stream_of_short_lived_records_on_mariadb() {
    if let Some(store) = common::servers::mysql_store_or_skip().await {
        purges_beside_a_stream_of_short_lived_records(Arc::new(store)).await;
    }
}

/// A PostgreSQL store whose sessions default to SERIALIZABLE.
async fn pg_serializable() -> Option<idempotent_runtime::PgStore> {
    common::servers::pg_store_or_skip().await?;
    let base = common::servers::pg_url();
    let separator = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{separator}options=-c%20default_transaction_isolation%3Dserializable");
    Some(
        idempotent_runtime::PgStore::connect(&url)
            .await
            .expect("a serializable store"),
    )
}

/// A MariaDB store whose pool's sessions run SERIALIZABLE.
async fn mysql_serializable() -> Option<idempotent_runtime::MySqlStore> {
    common::servers::mysql_store_or_skip().await?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(
                    conn,
                    "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                )
                .await
                .map(|_| ())
            })
        })
        .connect(&common::servers::mysql_url())
        .await
        .expect("a pool");
    Some(
        idempotent_runtime::MySqlStore::from_pool(pool)
            .await
            .expect("a serializable store"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_beside_short_lived_records_under_serializable_on_postgres() {
    if let Some(store) = pg_serializable().await {
        purges_beside_a_stream_of_short_lived_records(Arc::new(store)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_beside_short_lived_records_under_serializable_on_mariadb() {
    if let Some(store) = mysql_serializable().await {
        purges_beside_a_stream_of_short_lived_records(Arc::new(store)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_races_replacements_and_takeovers_under_serializable_on_postgres() {
    if let Some(store) = pg_serializable().await {
        purge_races_replacements_and_takeovers(Arc::new(store), 4).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_races_replacements_and_takeovers_under_serializable_on_mariadb() {
    if let Some(store) = mysql_serializable().await {
        purge_races_replacements_and_takeovers(Arc::new(store), 4).await;
    }
}

/// Audits and an operator's reads (`inspect`) beside a stream of
/// short-lived records and purges, on a PostgreSQL pool that defaults to
/// SERIALIZABLE: every audit answers (a read can be the one PostgreSQL
/// cancels for a read/write conflict among serializable transactions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audits_beside_short_lived_records_under_serializable_on_postgres() {
    let Some(store) = pg_serializable().await else {
        return;
    };
    let store: Arc<dyn Store> = Arc::new(store);
    let stream = tokio::spawn(purges_beside_a_stream_of_short_lived_records(Arc::clone(
        &store,
    )));
    let probe = Identity::new("t", "ops.probe", "k").expect("identity");
    let mut audits = 0;
    while !stream.is_finished() {
        audit(&*store, &[]).await.expect("an audit answers");
        store.fetch(&probe).await.expect("a read answers");
        audits += 1;
    }
    stream.await.expect("the stream");
    assert!(audits > 0);
}
