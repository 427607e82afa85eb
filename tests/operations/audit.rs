//! The audit finds what an operator must see, on every store: an orphan scope
//! (records no code claims, as a rename leaves behind), a stuck lease, and
//! expired records nobody purged — and reports live records as such.
//!
//! Scopes carry a uuid suffix so a shared database works; assertions look at
//! this test's scopes only.

use crate::common;

use idempotent_runtime::audit::{audit, KnownScope, ScopeStatus};
use idempotent_runtime::registry::Format;
use idempotent_runtime::{Identity, MemoryStore, SqliteStore, Store};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(3600);
const BLINK: Duration = Duration::from_millis(1);

fn unique(prefix: &str) -> String {
    format!("{prefix}.{}", uuid::Uuid::new_v4().simple())
}

/// Creates an in-progress record and returns its identity.
async fn reserve(store: &dyn Store, scope: &str, lease: Duration, ttl: Duration) -> Identity {
    common::records::plant(store, "audit-tenant", scope, lease, ttl, None).await
}

/// A complete record kept for `ttl`.
async fn complete(store: &dyn Store, scope: &str, ttl: Duration) -> Identity {
    common::records::plant(store, "audit-tenant", scope, LONG, LONG, Some(ttl)).await
}

/// Waits (bounded) until, by the store's clock, the lease of `identity` ran out
/// (`lease_only`) or the record expired. An expired record may be gone already,
/// purged by another test sharing the database: it has passed too (the caller
/// plants again when the audit misses it). A record whose ttl is long is never
/// purged, so it must be there.
async fn wait_until_passed(store: &dyn Store, identity: &Identity, lease_only: bool) {
    for _ in 0..500 {
        let found = store.fetch(identity).await.expect("fetch");
        let Some(snap) = found else {
            assert!(!lease_only, "a record whose ttl is long was deleted");
            return;
        };
        let passed = if lease_only {
            snap.lease_expires_at_ms.is_some_and(|l| l <= snap.now_ms)
        } else {
            snap.is_expired()
        };
        if passed {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the store's clock did not pass the planted expiry within 2.5 s");
}

async fn finds_orphans_stuck_leases_and_unpurged_records(store: &dyn Store) {
    let claimed = unique("audit.claimed");
    let unused = unique("audit.unused");
    let orphan = unique("audit.orphan");
    let retired = unique("audit.retired");

    // Other tests sharing the database may purge at any moment; an expired
    // record they delete is re-planted (bounded), nothing else is excused.
    for attempt in 1..=5 {
        complete(store, &claimed, LONG).await; // live
        complete(store, &claimed, LONG).await; // live
        let stuck = reserve(store, &claimed, BLINK, LONG).await; // lease runs out, ttl does not
        let live_in_progress = reserve(store, &claimed, LONG, LONG).await;
        let expired = complete(store, &claimed, BLINK).await;
        complete(store, &orphan, LONG).await;
        complete(store, &retired, LONG).await;
        wait_until_passed(store, &stuck, true).await;
        wait_until_passed(store, &expired, false).await;

        let known = [
            KnownScope::claimed(&claimed, "audit_test::claimed"),
            KnownScope::claimed(&unused, "audit_test::unused"),
            KnownScope::retired(&retired, Some("renamed to audit.claimed".into())),
        ];
        let report = audit(store, &known).await.expect("audit");

        let c = report.scope(&claimed).expect("claimed scope listed");
        if c.expired == 0 && store.fetch(&expired).await.expect("fetch").is_none() {
            eprintln!(
                "attempt {attempt}: another test purged the planted expired record; re-planting"
            );
            continue;
        }
        assert_eq!(c.status, ScopeStatus::Claimed);
        assert_eq!(c.claimed_by, ["audit_test::claimed"]);
        assert_eq!(c.stuck, attempt, "stuck lease: {c:?}");
        assert_eq!(c.in_progress, attempt, "live lease: {c:?}");
        assert!(c.expired >= 1, "expired, unpurged: {c:?}");
        assert_eq!(c.complete, 2 * attempt, "{c:?}");
        assert!(c.oldest_created_at_ms.is_some() && c.oldest_created_at.is_some());

        let o = report.scope(&orphan).expect("orphan listed");
        assert_eq!(o.status, ScopeStatus::Orphan);
        assert_eq!(o.complete, attempt);
        assert!(report.orphans().any(|s| s.scope == orphan));

        let r = report.scope(&retired).expect("retired listed");
        assert_eq!(r.status, ScopeStatus::Retired);
        assert_eq!(
            r.retired_reason.as_deref(),
            Some("renamed to audit.claimed")
        );

        let u = report.scope(&unused).expect("unused listed");
        assert_eq!((u.status, u.total()), (ScopeStatus::Unused, 0));
        assert!(report.has_findings());

        let table = report.render(Format::Table);
        let orphan_line = table
            .lines()
            .find(|l| l.starts_with(&orphan))
            .expect("orphan row");
        assert!(orphan_line.contains("ORPHAN"), "{orphan_line}");
        let json: serde_json::Value =
            serde_json::from_str(&report.render(Format::Json)).expect("JSON");
        let row = json["scopes"]
            .as_array()
            .expect("scopes")
            .iter()
            .find(|s| s["scope"] == claimed.as_str())
            .expect("claimed row")
            .clone();
        assert_eq!(row["stuck"], attempt);
        assert_eq!(json["store"], store.name());

        let _ = live_in_progress;
        return;
    }
    panic!("the planted expired record was purged by others five times in a row");
}

#[tokio::test]
async fn memory_store() {
    finds_orphans_stuck_leases_and_unpurged_records(&MemoryStore::new()).await;
}

#[tokio::test]
async fn sqlite_store() {
    let store = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    finds_orphans_stuck_leases_and_unpurged_records(&store).await;
}

#[tokio::test]
async fn postgres_store() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    finds_orphans_stuck_leases_and_unpurged_records(&store).await;
}

#[tokio::test]
async fn mysql_store() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    finds_orphans_stuck_leases_and_unpurged_records(&store).await;
}

#[tokio::test]
async fn the_registry_is_the_default_claimant() {
    // Nothing in this binary is annotated: every planted scope is an orphan.
    let store = MemoryStore::new();
    let scope = unique("audit.lonely");
    complete(&store, &scope, LONG).await;
    let report = idempotent_runtime::audit::audit_registry(&store)
        .await
        .expect("audit");
    assert_eq!(
        report.scope(&scope).map(|s| s.status),
        Some(ScopeStatus::Orphan)
    );
}
