//! A store's pool per tokio runtime (`server::RuntimePools`) leaves nothing
//! behind: a store opened and dropped many times on a long-lived runtime, or
//! used from another runtime and dropped, leaves no task per store on it.

use crate::common;

use common::servers::{fresh_tenant, pg_url};
use idempotent_runtime::{Identity, PgStore, Store};
use sqlx::postgres::PgPoolOptions;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);
const CALL_BOUND: Duration = Duration::from_secs(20);

fn within_deadline(scenario: impl FnOnce() + Send + 'static) {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(scenario));
        let _ = done.send(outcome);
    });
    match finished.recv_timeout(DEADLINE) {
        Ok(Ok(())) => {}
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("the scenario hung: no answer within {DEADLINE:?}"),
    }
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// The runtime's live task count once it is at most `limit`, or after 10 s,
/// whichever comes first. Tasks that end on their own (a pool returning a
/// connection, a dropped store's shutdown) may take a moment on a loaded
/// machine; a leaked task never ends, so a leak still shows.
async fn alive_tasks_settled_to(limit: usize) -> usize {
    let metrics = tokio::runtime::Handle::current().metrics();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        settle().await;
        let alive = metrics.num_alive_tasks();
        if alive <= limit || tokio::time::Instant::now() >= deadline {
            return alive;
        }
    }
}

/// Opening a store and dropping it, many times, on one long-lived runtime
/// (a store per request, per tenant schema, per test on a shared runtime)
/// must not leave a task per store on that runtime for the rest of its life.
#[test]
fn dropped_pg_stores_leave_no_task_on_the_opening_runtime() {
    within_deadline(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .connect(&pg_url())
                .await
                .expect("PostgreSQL reachable");
            // Migrations applied once.
            drop(PgStore::from_pool(pool.clone()).await.expect("open"));
            settle().await;
            let metrics = tokio::runtime::Handle::current().metrics();
            let before = metrics.num_alive_tasks();
            for _ in 0..40 {
                let store = tokio::time::timeout(CALL_BOUND, PgStore::from_pool(pool.clone()))
                    .await
                    .expect("open in time")
                    .expect("open");
                drop(store);
            }
            let after = alive_tasks_settled_to(before + 2).await;
            assert!(
                after <= before + 2,
                "40 stores opened and dropped left {} tasks alive on the runtime (before: {before}, after: {after})",
                after - before
            );
        });
    });
}

/// The same for a store used from a runtime other than its own: each
/// (store, runtime) leaves a task on that runtime after the store is gone.
#[test]
fn dropped_pg_stores_leave_no_task_on_other_runtimes() {
    within_deadline(|| {
        let home = current_thread();
        let pool = home.block_on(async {
            PgPoolOptions::new()
                .max_connections(2)
                .connect(&pg_url())
                .await
                .expect("PostgreSQL reachable")
        });
        home.block_on(async { drop(PgStore::from_pool(pool.clone()).await.expect("open")) });
        let other = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let metrics = other.metrics();
        other.block_on(settle());
        let before = metrics.num_alive_tasks();
        for round in 0..20 {
            let store = home
                .block_on(PgStore::from_pool(pool.clone()))
                .expect("open");
            other.block_on(async {
                let id = Identity::new(fresh_tenant(), "runtime_pools.leak", format!("k{round}"))
                    .expect("id");
                tokio::time::timeout(CALL_BOUND, store.fetch(&id))
                    .await
                    .expect("fetch in time")
                    .expect("fetch");
            });
            drop(store);
        }
        let after = other.block_on(alive_tasks_settled_to(before + 2));
        assert!(
            after <= before + 2,
            "20 stores used once from this runtime and dropped left {} tasks alive on it (before: {before}, after: {after})",
            after - before
        );
    });
}
