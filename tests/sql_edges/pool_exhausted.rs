//! PostgreSQL and MariaDB: a caller's transactions that hold every
//! connection of the application's pool (given to `from_pool`) keep a
//! store-mode owner's lease renewals (rule 9) waiting for the pool while its
//! lease runs out. A transactional-mode call (rule 15) in one of those
//! transactions must not take the record over beside the live owner: its
//! body would run twice (rules 3, 10). The same defect was fixed on SQLite
//! (`sqlite_edges::a_transaction_holding_the_only_pooled_connection_never_takes_over_an_owner_it_starved`).
//!
//! Deterministic: the transactions are open before the renewal is sent (it
//! can only wait for the pool); the lease is seen over by a store on a pool
//! of its own; every wait is bounded.

use crate::common::servers::{fresh_tenant, mysql_url, pg_url};
use idempotent_runtime::{
    idempotent, with_outcome, Error, Fenced, Identity, MySqlStore, OwnerToken, PgStore,
    Reservation, ReserveRequest, Store,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The transactional claimant on PostgreSQL; counts its runs.
#[idempotent(scope = "pool_exhausted.pg", key = key, tenant = tenant, tx = tx, skip(runs), shared_scope, ttl = "1h", lease = "2s", in_progress = reject)]
async fn claim_pg(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    let _ = (&tx, tenant, key);
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(2)
}

/// The transactional claimant on MariaDB; counts its runs.
#[idempotent(scope = "pool_exhausted.my", key = key, tenant = tenant, tx = tx, skip(runs), shared_scope, ttl = "1h", lease = "2s", in_progress = reject)]
async fn claim_my(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    let _ = (&tx, tenant, key);
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(2)
}

/// The store-mode owner on PostgreSQL: runs until told to end.
#[idempotent(scope = "pool_exhausted.pg", key = key, tenant = tenant, store = store, skip(owner), shared_scope, ttl = "1h", lease = "1s", in_progress = reject)]
async fn owner_pg(
    store: &PgStore,
    tenant: &str,
    key: &str,
    owner: &BlockedOwner,
) -> Result<u64, Error> {
    let _ = (store, tenant, key);
    owner.runs.fetch_add(1, Ordering::SeqCst);
    owner.started.notify_one();
    owner.end.notified().await;
    Ok(1)
}

/// A store-mode owner's handshakes, and its runs.
#[derive(Default)]
struct BlockedOwner {
    runs: AtomicUsize,
    started: tokio::sync::Notify,
    end: tokio::sync::Notify,
}

/// The owner reserves `id` with a short lease through `store`.
async fn reserve_short<S: Store>(store: &S, id: &Identity, token: &OwnerToken) -> Duration {
    let lease = Duration::from_millis(300);
    let reserved = store
        .reserve(ReserveRequest {
            identity: id,
            fingerprint: None,
            token,
            lease,
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(
        matches!(reserved, Reservation::Acquired { .. }),
        "{reserved:?}"
    );
    lease
}

/// Until `id`'s lease has been over for more than a second, as `beside` (a
/// pool of its own) reads it: MariaDB's transactional reservation refuses a
/// transaction that began before the lease ran out, its start known in
/// whole seconds, so a call made within the second after could be refused
/// by that alone (the owner is starved all the same).
async fn until_the_lease_is_over<S: Store>(beside: &S, id: &Identity) {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let record = beside.fetch(id).await.expect("fetch").expect("a record");
            if record
                .lease_expires_at_ms
                .is_some_and(|lease| record.now_ms - lease > 1_100)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the lease runs out");
}

async fn pg_pool(size: u32) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .connect(&pg_url())
        .await
        .expect("pool")
}

async fn my_pool(size: u32) -> sqlx::MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(size)
        .connect(&mysql_url())
        .await
        .expect("pool")
}

/// PostgreSQL: `size` transactions hold every connection of the store's
/// pool; a transactional call in the first must not take the record over
/// from the owner whose renewal waits for the pool.
async fn pg_owner_starved_by(size: u32) {
    pg_owner_starved_beside(size, None).await
}

/// [`pg_owner_starved_by`], with an owner of the same identity in the
/// database of `elsewhere` listed after the starved one, when given.
async fn pg_owner_starved_beside(size: u32, elsewhere: Option<&PgStore>) {
    let pool = pg_pool(size).await;
    let store = PgStore::from_pool(pool.clone()).await.expect("store");
    let beside = PgStore::from_pool(pg_pool(1).await).await.expect("beside");
    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, "pool_exhausted.pg", "k").expect("identity");
    let token = OwnerToken::new();
    let lease = reserve_short(&store, &id, &token).await;
    if let Some(elsewhere) = elsewhere {
        let reserved = elsewhere
            .reserve(ReserveRequest {
                identity: &id,
                fingerprint: None,
                token: &OwnerToken::new(),
                lease: Duration::from_secs(3600),
                ttl: Duration::from_secs(3600),
            })
            .await
            .expect("reserve elsewhere");
        assert!(
            matches!(reserved, Reservation::Acquired { .. }),
            "{reserved:?}"
        );
    }
    let mut txs = Vec::new();
    for _ in 0..size {
        txs.push(pool.begin().await.expect("begin"));
    }
    let renewing = {
        let (store, id, token) = (store.clone(), id.clone(), token.clone());
        tokio::spawn(async move { store.heartbeat(&id, &token, lease).await })
    };
    until_the_lease_is_over(&beside, &id).await;
    assert!(
        !renewing.is_finished(),
        "the renewal waits for the pool: {renewing:?}"
    );
    let runs = AtomicUsize::new(0);
    let answer = with_outcome(claim_pg(&mut txs[0], &tenant, "k", &runs)).await;
    for tx in txs {
        tx.rollback().await.expect("rollback");
    }
    let renewed = tokio::time::timeout(Duration::from_secs(60), renewing)
        .await
        .expect("the renewal ends")
        .expect("task");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the body ran beside the live owner: {answer:?}; the owner's renewal after: {renewed:?}"
    );
    assert!(
        matches!(answer, (Err(Error::StaleSnapshot { .. }), None)),
        "refused: {answer:?}"
    );
    assert!(
        matches!(renewed, Ok(Fenced::Written)),
        "the owner renews once the transactions have ended: {renewed:?}"
    );
    pool.close().await;
}

/// The same on MariaDB.
async fn my_owner_starved_by(size: u32) {
    let pool = my_pool(size).await;
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let beside = MySqlStore::from_pool(my_pool(1).await)
        .await
        .expect("beside");
    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, "pool_exhausted.my", "k").expect("identity");
    let token = OwnerToken::new();
    let lease = reserve_short(&store, &id, &token).await;
    let mut txs = Vec::new();
    for _ in 0..size {
        txs.push(pool.begin().await.expect("begin"));
    }
    let renewing = {
        let (store, id, token) = (store.clone(), id.clone(), token.clone());
        tokio::spawn(async move { store.heartbeat(&id, &token, lease).await })
    };
    until_the_lease_is_over(&beside, &id).await;
    assert!(
        !renewing.is_finished(),
        "the renewal waits for the pool: {renewing:?}"
    );
    let runs = AtomicUsize::new(0);
    let answer = with_outcome(claim_my(&mut txs[0], &tenant, "k", &runs)).await;
    for tx in txs {
        tx.rollback().await.expect("rollback");
    }
    let renewed = tokio::time::timeout(Duration::from_secs(60), renewing)
        .await
        .expect("the renewal ends")
        .expect("task");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the body ran beside the live owner: {answer:?}; the owner's renewal after: {renewed:?}"
    );
    assert!(
        matches!(answer, (Err(Error::StaleSnapshot { .. }), None)),
        "refused: {answer:?}"
    );
    assert!(
        matches!(renewed, Ok(Fenced::Written)),
        "the owner renews once the transactions have ended: {renewed:?}"
    );
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_transaction_holding_the_only_pooled_connection_never_takes_over_an_owner_it_starved()
{
    pg_owner_starved_by(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_transactions_holding_every_pooled_connection_never_take_over_an_owner_they_starved() {
    pg_owner_starved_by(2).await;
}

/// The same, while an owner of the same identity in another database of
/// the server (one identity's records in two databases: two regions, a
/// database per customer) was listed after the starved owner, its lease
/// running: it is not the starved owner's record, and must not hide it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_an_owner_of_the_same_identity_in_another_database_does_not_hide_one_a_transaction_starved(
) {
    crate::common::servers::pg_with_fresh_database("pool_exhausted", |url| async move {
        let elsewhere = PgStore::connect(&url).await.expect("the other database");
        pg_owner_starved_beside(1, Some(&elsewhere)).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_transaction_holding_the_only_pooled_connection_never_takes_over_an_owner_it_starved(
) {
    my_owner_starved_by(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_transactions_holding_every_pooled_connection_never_take_over_an_owner_they_starved()
{
    my_owner_starved_by(2).await;
}

/// The same with an `#[idempotent]` owner whose heartbeat renews its lease:
/// while its body waits, the caller's transaction takes the pool's only
/// connection, and the engine's renewals wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_transaction_holding_the_only_pooled_connection_never_takes_over_a_called_owner() {
    let pool = pg_pool(1).await;
    let store = PgStore::from_pool(pool.clone()).await.expect("store");
    let beside = PgStore::from_pool(pg_pool(1).await).await.expect("beside");
    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, "pool_exhausted.pg", "k").expect("identity");
    let owner = std::sync::Arc::new(BlockedOwner::default());
    let owned = {
        let (store, tenant, owner) = (store.clone(), tenant.clone(), owner.clone());
        tokio::spawn(async move { with_outcome(owner_pg(&store, &tenant, "k", &owner)).await })
    };
    owner.started.notified().await;
    let mut tx = pool.begin().await.expect("begin");
    until_the_lease_is_over(&beside, &id).await;
    let runs = AtomicUsize::new(0);
    let answer = with_outcome(claim_pg(&mut tx, &tenant, "k", &runs)).await;
    tx.rollback().await.expect("rollback");
    owner.end.notify_one();
    let owned = tokio::time::timeout(Duration::from_secs(60), owned)
        .await
        .expect("the owner ends")
        .expect("owner task");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the body ran beside the live owner: {answer:?}; the owner's answer: {owned:?}"
    );
    assert!(
        matches!(answer, (Err(Error::StaleSnapshot { .. }), None)),
        "refused: {answer:?}"
    );
    assert!(
        matches!(owned, (Ok(1), Some(idempotent_runtime::Outcome::Executed))),
        "{owned:?}"
    );
    assert_eq!(owner.runs.load(Ordering::SeqCst), 1, "the body ran once");
    pool.close().await;
}

/// Rule 10 with rule 15: an owner whose call stopped being polled while its
/// renewal waited for the pool (a starved task, a future set aside: a
/// paused owner) is taken over by a transactional call once a lease has
/// passed since that renewal began, as by any other caller. (Its renewal
/// counted as at work for as long as it stayed unpolled: every call in the
/// transaction was refused `StaleSnapshot`.) Before that, the refusal is
/// right: the renewal had just begun. The transaction begins after the
/// lease ran out (MariaDB refuses one begun before), then takes the pool's
/// only connection; the renewal is polled once, waits for it, and is never
/// polled again.
macro_rules! paused_mid_renewal {
    ($test:ident, $pool:ident, $store:ident, $scope:literal, $claim:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let pool = $pool(1).await;
            let store = $store::from_pool(pool.clone()).await.expect("store");
            let beside = $store::from_pool($pool(1).await).await.expect("beside");
            let tenant = fresh_tenant();
            let id = Identity::new(&tenant, $scope, "k").expect("identity");
            let token = OwnerToken::new();
            let lease = reserve_short(&store, &id, &token).await;
            until_the_lease_is_over(&beside, &id).await;
            let mut tx = pool.begin().await.expect("begin");
            let mut renewal = std::pin::pin!(store.heartbeat(&id, &token, lease));
            tokio::select! {
                biased;
                renewed = &mut renewal => panic!("the renewal waits for the pool: {renewed:?}"),
                () = std::future::ready(()) => {}
            }
            let runs = AtomicUsize::new(0);
            let mut refused = 0;
            let answer = loop {
                let answer = with_outcome($claim(&mut tx, &tenant, "k", &runs)).await;
                if matches!(answer.0, Err(Error::StaleSnapshot { .. })) && refused < 50 {
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                break answer;
            };
            tx.commit().await.expect("commit");
            assert!(
                matches!(answer, (Ok(2), Some(idempotent_runtime::Outcome::Executed))),
                "the paused owner is taken over: {answer:?} after {refused} refusals"
            );
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            let renewed = tokio::time::timeout(Duration::from_secs(60), renewal)
                .await
                .expect("the renewal ends");
            assert!(
                matches!(renewed, Ok(Fenced::NotOwner)),
                "the resumed owner's renewal finds the record taken over: {renewed:?}"
            );
            pool.close().await;
        }
    };
}

paused_mid_renewal!(
    pg_an_owner_paused_while_its_renewal_waits_for_the_pool_is_taken_over_after_a_lease,
    pg_pool,
    PgStore,
    "pool_exhausted.pg",
    claim_pg
);
paused_mid_renewal!(
    mysql_an_owner_paused_while_its_renewal_waits_for_the_pool_is_taken_over_after_a_lease,
    my_pool,
    MySqlStore,
    "pool_exhausted.my",
    claim_my
);
