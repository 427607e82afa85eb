//! Rule 9 under a row lock held by another transaction: a renewal that
//! outlives its period keeps waiting on the server (no `lock_timeout`, no
//! `statement_timeout`), and a dropped one would keep its pooled connection
//! until then (sqlx's return of the connection waits for the statement). The
//! engine keeps polling a late renewal and starts at most one more beside it,
//! so one locked record never empties the store's pool (it did when each late
//! renewal was dropped and retried a quarter period later).

use crate::common::servers::{fresh_tenant, pg_store_or_skip, pg_url};
use idempotent_runtime::{idempotent, Error, PgStore};
use std::time::Duration;
use tokio::sync::Notify;

#[idempotent(scope = "contract_edges.heartbeat_pool", key = key, tenant = tenant, store = store,
             skip(reached, go), lease = "300ms", in_progress = reject)]
async fn held(
    store: &PgStore,
    tenant: &str,
    key: &str,
    reached: &Notify,
    go: &Notify,
) -> Result<u32, Error> {
    reached.notify_one();
    go.notified().await;
    Ok(1)
}

#[idempotent(scope = "contract_edges.heartbeat_pool_other", key = key, tenant = tenant, store = store)]
async fn other(store: &PgStore, tenant: &str, key: &str) -> Result<u32, Error> {
    Ok(2)
}

#[tokio::test]
async fn a_locked_row_whose_renewals_time_out_does_not_empty_the_stores_pool() {
    // Migrations applied, and the server reachable.
    if pg_store_or_skip().await.is_none() {
        return;
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&pg_url())
        .await
        .expect("pool");
    let store = PgStore::from_pool(pool).await.expect("store");
    let locker = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&pg_url())
        .await
        .expect("locker pool");
    let tenant = fresh_tenant();
    let (reached, go) = (Notify::new(), Notify::new());
    let owner = held(&store, &tenant, "k", &reached, &go);
    let check = async {
        reached.notified().await;
        // Another transaction holds the owner's row for a while (e.g. a
        // transactional-mode caller, an operator's transaction).
        let mut tx = locker.begin().await.expect("begin");
        sqlx::query(
            "SELECT 1 FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE",
        )
        .bind(&tenant)
        .bind("contract_edges.heartbeat_pool")
        .bind("k")
        .fetch_one(&mut *tx)
        .await
        .expect("lock the row");
        // A dozen periods (100 ms) pass while the row is locked.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // Any other call on this store, on another key.
        let answer =
            tokio::time::timeout(Duration::from_secs(20), other(&store, &tenant, "o")).await;
        tx.rollback().await.expect("rollback");
        go.notify_one();
        answer
    };
    let (owner_answer, other_answer) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(owner, check)
    })
    .await
    .expect("both finish");
    let other_answer = other_answer.expect("the other call answers");
    assert_eq!(
        other_answer.expect("another key's call is not starved of connections by the renewals"),
        2
    );
    let _ = owner_answer;
}
