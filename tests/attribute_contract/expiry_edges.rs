//! Rule 16 at its edges, as a user's tests would write them with the public
//! API only: "an expired record counts as absent" also when the retry
//! brings *other* arguments (not a mismatch: there is no record to
//! contradict) and when the record holds a recorded error (`errors =
//! record`), on every store in store mode and on every SQL store in
//! transactional mode; and on `MemoryStore` under a paused clock, the exact
//! millisecond a `ttl` and a lease run out (one before: the record stands;
//! at it: absent, also for a purge).

use crate::common;
use crate::tx_fixtures::{lite, my, pg};
use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::purge::purge_all;
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, MemoryStore, Outcome, RecordState, SqliteStore,
    Store,
};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::advance;

/// Waits (bounded, about 15 s) until `identity`'s record counts as expired
/// on the store's own clock, or is gone.
async fn until_expired(store: &dyn Store, identity: &Identity) {
    for _ in 0..3_000 {
        match store.fetch(identity).await.expect("fetch") {
            None => return,
            Some(s) if s.is_expired() => return,
            Some(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    panic!("the record did not expire on the store's clock within 15 s");
}

// ---------------------------------------------------------------- store mode, every store

#[idempotent(scope = "expiry_edges.charge", key = key, tenant = tenant, store = store,
             skip(runs), ttl = "2s", in_progress = reject)]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicU32,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(amount * 10)
}

/// A body's own error, recorded as the key's answer (`errors = record`).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Declined {
    Card(u64),
    Library(String),
}

impl From<Error> for Declined {
    fn from(e: Error) -> Self {
        Declined::Library(e.to_string())
    }
}

#[idempotent(scope = "expiry_edges.declined", key = key, tenant = tenant, store = store,
             skip(runs, decline), ttl = "2s", errors = record, in_progress = reject)]
async fn pay(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    decline: bool,
    runs: &AtomicU32,
) -> Result<u64, Declined> {
    runs.fetch_add(1, Ordering::SeqCst);
    if decline {
        return Err(Declined::Card(amount));
    }
    Ok(amount)
}

/// Rules 7 and 16: within its ttl a record refuses other arguments; once
/// expired it counts as absent, so other arguments run (not
/// `FingerprintMismatch`), and the new record then stands for them: it
/// replays them and refuses the first call's arguments. A recorded error
/// expires the same way: replayed within its ttl, the body runs again after.
async fn expired_records_count_as_absent(store: &dyn Store) {
    let name = store.name();
    let tenant = fresh_tenant();
    let runs = AtomicU32::new(0);
    let first = Identity::new(&tenant, "expiry_edges.charge", "k").expect("identity");

    let (got, how) = with_outcome(charge(store, &tenant, "k", 1, &runs)).await;
    assert_eq!((got.expect(name), how), (10, Some(Outcome::Executed)));
    let other = charge(store, &tenant, "k", 2, &runs).await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch(_))),
        "{name}: other arguments within the ttl: {other:?}"
    );
    until_expired(store, &first).await;
    let (got, how) = with_outcome(charge(store, &tenant, "k", 2, &runs)).await;
    assert_eq!(
        (got.expect(name), how),
        (20, Some(Outcome::Executed)),
        "{name}: an expired record is absent, other arguments run"
    );
    let (got, how) = with_outcome(charge(store, &tenant, "k", 2, &runs)).await;
    assert_eq!(
        (got.expect(name), how),
        (20, Some(Outcome::Replayed)),
        "{name}"
    );
    let old = charge(store, &tenant, "k", 1, &runs).await;
    assert!(
        matches!(old, Err(Error::FingerprintMismatch(_))),
        "{name}: the new record stands for its own arguments: {old:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");

    // A recorded error.
    let runs = AtomicU32::new(0);
    let declined = Identity::new(&tenant, "expiry_edges.declined", "d").expect("identity");
    let (got, how) = with_outcome(pay(store, &tenant, "d", 5, true, &runs)).await;
    assert_eq!(
        (got, how),
        (Err(Declined::Card(5)), Some(Outcome::Executed))
    );
    let (got, how) = with_outcome(pay(store, &tenant, "d", 5, false, &runs)).await;
    assert_eq!(
        (got, how),
        (Err(Declined::Card(5)), Some(Outcome::Replayed)),
        "{name}: the recorded error is the key's answer"
    );
    until_expired(store, &declined).await;
    let (got, how) = with_outcome(pay(store, &tenant, "d", 6, false, &runs)).await;
    assert_eq!(
        (got, how),
        (Ok(6), Some(Outcome::Executed)),
        "{name}: an expired recorded error is absent too"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");
}

#[tokio::test]
async fn expired_records_count_as_absent_on_memory() {
    expired_records_count_as_absent(&MemoryStore::new()).await;
}

#[tokio::test]
async fn expired_records_count_as_absent_on_sqlite() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("expiry-edges"))
        .await
        .expect("sqlite");
    expired_records_count_as_absent(&store).await;
}

#[tokio::test]
async fn expired_records_count_as_absent_on_postgres() {
    if let Some(store) = pg_store_or_skip().await {
        expired_records_count_as_absent(&store).await;
    }
}

#[tokio::test]
async fn expired_records_count_as_absent_on_mysql() {
    if let Some(store) = mysql_store_or_skip().await {
        expired_records_count_as_absent(&store).await;
    }
}

// ---------------------------------------------------------------- transactional mode, every SQL store

static TX_RUNS: AtomicU32 = AtomicU32::new(0);

macro_rules! tx_charge {
    ($name:ident, $db:ty, $scope:literal) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, ttl = "2s", in_progress = reject)]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            amount: u64,
        ) -> Result<u64, Error> {
            TX_RUNS.fetch_add(1, Ordering::SeqCst);
            Ok(amount * 10)
        }
    };
}

tx_charge!(pg_charge, sqlx::Postgres, "expiry_edges.pg_tx");
tx_charge!(my_charge, sqlx::MySql, "expiry_edges.my_tx");
tx_charge!(lite_charge, sqlx::Sqlite, "expiry_edges.lite_tx");

/// Rules 15 and 16 in a transaction: a committed record that expired counts
/// as absent for a call with other arguments, which runs in the caller's
/// transaction; a rollback takes that run away again (the key is then still
/// free: the first arguments run too); a commit makes the new record the
/// key's answer, replayed to its arguments, the first ones refused.
macro_rules! expired_in_a_transaction {
    ($store:expr, $pool:expr, $f:ident, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let id = Identity::new(&tenant, $scope, "k").expect("identity");

        let mut tx = pool.begin().await.expect("begin");
        let (got, how) = with_outcome($f(&mut tx, &tenant, "k", 1)).await;
        assert_eq!((got.expect("runs"), how), (10, Some(Outcome::Executed)));
        tx.commit().await.expect("commit");
        let mut tx = pool.begin().await.expect("begin");
        let other = $f(&mut tx, &tenant, "k", 2).await;
        assert!(
            matches!(other, Err(Error::FingerprintMismatch(_))),
            "other arguments within the ttl: {other:?}"
        );
        tx.rollback().await.expect("rollback");
        until_expired(store, &id).await;

        // Other arguments on the expired record, rolled back.
        let mut tx = pool.begin().await.expect("begin");
        let (got, how) = with_outcome($f(&mut tx, &tenant, "k", 2)).await;
        assert_eq!(
            (got.expect("an expired record is absent"), how),
            (20, Some(Outcome::Executed))
        );
        tx.rollback().await.expect("rollback");

        // Other arguments again, committed.
        let mut tx = pool.begin().await.expect("begin");
        let (got, how) = with_outcome($f(&mut tx, &tenant, "k", 3)).await;
        assert_eq!(
            (got.expect("still absent after the rollback"), how),
            (30, Some(Outcome::Executed))
        );
        tx.commit().await.expect("commit");
        let mut tx = pool.begin().await.expect("begin");
        let (got, how) = with_outcome($f(&mut tx, &tenant, "k", 3)).await;
        assert_eq!((got.expect("replays"), how), (30, Some(Outcome::Replayed)));
        let old = $f(&mut tx, &tenant, "k", 1).await;
        assert!(
            matches!(old, Err(Error::FingerprintMismatch(_))),
            "the new record stands for its own arguments: {old:?}"
        );
        tx.commit().await.expect("commit");
        let snapshot = store.fetch(&id).await.expect("fetch").expect("a record");
        assert_eq!(snapshot.state, RecordState::Complete);
    }};
}

#[tokio::test]
async fn pg_an_expired_record_counts_as_absent_in_a_transaction() {
    let Some(db) = pg("SELECT 1").await else {
        return;
    };
    expired_in_a_transaction!(&db.0, db.0.pool(), pg_charge, "expiry_edges.pg_tx");
}

#[tokio::test]
async fn mysql_an_expired_record_counts_as_absent_in_a_transaction() {
    let Some(db) = my("SELECT 1").await else {
        return;
    };
    expired_in_a_transaction!(&db.0, db.0.pool(), my_charge, "expiry_edges.my_tx");
}

#[tokio::test]
async fn sqlite_an_expired_record_counts_as_absent_in_a_transaction() {
    let db = lite("expiry-edges-tx", "SELECT 1").await;
    expired_in_a_transaction!(&db.0, db.0.pool(), lite_charge, "expiry_edges.lite_tx");
}

// ---------------------------------------------------------------- the exact millisecond, paused clock

#[idempotent(scope = "expiry_edges.paused", key = key, tenant = shared, store = store,
             ttl = "1h", lease = "30s", in_progress = reject)]
async fn kept(store: &MemoryStore, key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount)
}

/// Rule 16 at the millisecond: a millisecond before its ttl a record replays
/// (and refuses other arguments); at its ttl it counts as absent, and other
/// arguments run.
#[tokio::test(start_paused = true)]
async fn a_record_stands_until_the_millisecond_its_ttl_ends() {
    let store = MemoryStore::new();
    let (_, how) = with_outcome(kept(&store, "k", 1)).await;
    assert_eq!(how, Some(Outcome::Executed));
    advance(Duration::from_secs(3600) - Duration::from_millis(1)).await;
    let (got, how) = with_outcome(kept(&store, "k", 1)).await;
    assert_eq!((got.expect("replay"), how), (1, Some(Outcome::Replayed)));
    let other = kept(&store, "k", 2).await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch(_))),
        "{other:?}"
    );
    advance(Duration::from_millis(1)).await;
    let (got, how) = with_outcome(kept(&store, "k", 2)).await;
    assert_eq!(
        (got.expect("absent at its ttl"), how),
        (2, Some(Outcome::Executed))
    );
}

#[idempotent(scope = "expiry_edges.crash", key = key, tenant = shared, store = store,
             ttl = "1s", lease = "30s", in_progress = reject, skip(crash_point))]
async fn crashes(
    store: &MemoryStore,
    key: &str,
    crash_point: Option<&Notify>,
) -> Result<u32, Error> {
    if let Some(reached) = crash_point {
        reached.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(2)
}

/// Rules 10 and 16 at the millisecond: a crashed owner's record (its ttl
/// of 1 s long run out, its lease of 30 s not) is refused as in progress,
/// with a `retry_after` of the millisecond left, and kept by a purge a
/// millisecond before its lease ends; at that millisecond the next call
/// takes it over and runs, also after a purge made at that very moment.
#[tokio::test(start_paused = true)]
async fn a_crashed_owners_record_stands_until_the_millisecond_its_lease_ends() {
    for purge_first in [false, true] {
        let store = MemoryStore::new();
        let id = Identity::shared("expiry_edges.crash", "k").expect("identity");
        let reached = Notify::new();
        let mut call = Box::pin(crashes(&store, "k", Some(&reached)));
        tokio::select! {
            _ = &mut call => panic!("the call finished instead of crashing"),
            _ = reached.notified() => {}
        }
        std::mem::forget(call);
        advance(Duration::from_secs(30) - Duration::from_millis(1)).await;
        match crashes(&store, "k", None).await {
            Err(Error::InProgress { retry_after, .. }) => {
                assert_eq!(retry_after, Duration::from_millis(1))
            }
            other => panic!("a millisecond before the lease ends: {other:?}"),
        }
        assert_eq!(purge_all(&store, 100).await.expect("purge"), 0);
        assert_eq!(
            store.fetch(&id).await.expect("fetch").map(|s| s.state),
            Some(RecordState::InProgress),
            "a purge keeps a record whose lease is live, its ttl run out"
        );
        advance(Duration::from_millis(1)).await;
        if purge_first {
            // The record may go or stay (its retention may outlast its
            // lease); the call below runs either way.
            assert!(purge_all(&store, 100).await.expect("purge") <= 1);
        }
        let (got, how) = with_outcome(crashes(&store, "k", None)).await;
        assert_eq!(got.expect("taken over, or absent"), 2);
        assert_eq!(how, Some(Outcome::Executed));
        let (got, how) = with_outcome(crashes(&store, "k", None)).await;
        assert_eq!((got.expect("replayed"), how), (2, Some(Outcome::Replayed)));
    }
}
