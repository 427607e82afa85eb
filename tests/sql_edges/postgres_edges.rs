//! PostgreSQL edges of the store-mode reservation.
//!
//! A row lock on a record that is *not* in progress is short-lived: a purge
//! deleting the expired record, another call replacing it. A reservation that
//! meets one longer than its `lock_wait` tries again instead of answering
//! `InProgress` with a made-up `retry_after` (seen as a flaky conformance
//! test while another test's purge was deleting expired records).
//! Deterministic: the test holds the lock itself and lets it go only once it
//! has seen the reservation wait a second time (its statement restarted).

use crate::common::servers::{fresh_tenant, pg_store_or_skip, pg_url};
use idempotent_runtime::{Identity, OwnerToken, PgStore, Reservation, ReserveRequest, Store};
use sqlx::{Connection, Executor};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_on_an_expired_record_is_waited_out_not_answered_in_progress() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let identity = Identity::new(fresh_tenant(), "edges.pg_expired_locked", "k").expect("identity");
    // Another session will lock the expired row (as a purge deleting it
    // would). It locks it before it expires: once expired, another test's
    // purge of the shared table may delete it first (a purge skips rows that
    // are locked).
    let mut locker = sqlx::PgConnection::connect(&pg_url())
        .await
        .expect("connect");
    let locker_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut locker)
        .await
        .expect("pid");
    let short = Duration::from_secs(2);
    let first = OwnerToken::new();
    let abandoned = store
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &first,
            lease: short,
            ttl: short,
        })
        .await
        .expect("reserve");
    assert_eq!(abandoned, Reservation::FRESH);
    sqlx::query("BEGIN")
        .execute(&mut locker)
        .await
        .expect("begin");
    sqlx::query(
        "SELECT 1 FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .fetch_one(&mut locker)
    .await
    .expect("lock the row");
    // Lease and retention run out on the database's clock (a plain read is
    // not blocked by the lock).
    let mut expired = false;
    for _ in 0..1000 {
        let snapshot = store
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        if snapshot.is_expired() {
            expired = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(expired, "the record's lease and retention ran out");

    let reserving = {
        let (store, identity) = (store.clone(), identity.clone());
        tokio::spawn(async move {
            let token = OwnerToken::new();
            store
                .reserve(ReserveRequest {
                    identity: &identity,
                    fingerprint: None,
                    token: &token,
                    lease: Duration::from_secs(300),
                    ttl: Duration::from_secs(300),
                })
                .await
        })
    };

    // Handshake: two different statements of the reservation seen blocked by
    // the locker (the first timed out after `lock_wait`, the second waits).
    let mut monitor = sqlx::PgConnection::connect(&pg_url())
        .await
        .expect("connect");
    let mut starts = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while starts.len() < 2 && !reserving.is_finished() && Instant::now() < deadline {
        let blocked: Vec<String> = sqlx::query_scalar(
            "SELECT query_start::text FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(locker_pid)
        .fetch_all(&mut monitor)
        .await
        .expect("pg_stat_activity");
        starts.extend(blocked);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sqlx::query("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("rollback");

    let answer = reserving.await.expect("task").expect("reserve");
    assert_eq!(
        answer,
        Reservation::FRESH,
        "an expired record held only briefly by another session is replaced \
         (blocked statements seen: {})",
        starts.len()
    );
    assert_eq!(
        starts.len(),
        2,
        "the reservation tried again after its lock wait"
    );
}

/// Migrations on a database whose default isolation is REPEATABLE READ
/// (DESIGN.md §5: they apply themselves, also when several processes open a
/// brand-new database at the same moment). The runner's transaction is READ
/// COMMITTED: under the database's default it took its snapshot at its first
/// statement, before waiting for the advisory lock, so a process that waited
/// read the history without what the lock holder had just committed, applied
/// the migrations again and failed to open (3 of 4 opens, every round).
#[tokio::test]
async fn concurrent_first_opens_migrate_once_under_a_repeatable_read_default() {
    let admin_url = pg_url();
    let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url).await else {
        eprintln!("SKIPPED: PostgreSQL unreachable");
        return;
    };
    let mut failures = Vec::new();
    for round in 0..3 {
        let db = format!("review2_mig_{}", uuid::Uuid::new_v4().simple());
        admin
            .execute(format!("CREATE DATABASE {db}").as_str())
            .await
            .expect("create database");
        admin
            .execute(
                format!(
                    "ALTER DATABASE {db} SET default_transaction_isolation = 'repeatable read'"
                )
                .as_str(),
            )
            .await
            .expect("alter database");
        let url = match admin_url.rsplit_once('/') {
            Some((base, _)) => format!("{base}/{db}"),
            None => panic!("url {admin_url}"),
        };
        let opened = futures::future::join_all((0..4).map(|_| {
            let url = url.clone();
            tokio::spawn(async move { PgStore::connect(&url).await.map(drop) })
        }))
        .await;
        for r in opened {
            if let Err(e) = r.expect("join") {
                failures.push(format!("round {round}: {e}"));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        admin
            .execute(format!("DROP DATABASE {db} WITH (FORCE)").as_str())
            .await
            .expect("drop database");
    }
    assert!(
        failures.is_empty(),
        "concurrent first opens failed: {failures:#?}"
    );
}
