//! Database faults on PostgreSQL: the store's connections killed during a call
//! (`pg_terminate_backend`) surface as `Error::Store` and corrupt nothing; the
//! next call succeeds. A store pointed at a closed port fails fast and says where.

use crate::common;

use common::servers::{fresh_tenant, pg_store_or_skip, pg_url};
use idempotent_runtime::{idempotent, Error, Identity, PgStore, RecordState, Store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::str::FromStr;
use std::time::Duration;

/// The body kills every backend of the store's pool (found by its
/// application_name) before returning, so the completion meets a dead connection.
#[idempotent(scope = "faults.terminate", key = key, tenant = tenant, store = store, skip(admin, app, kill),
             lease = "1s", in_progress = wait("20s"))]
async fn killed_mid_call(
    store: &PgStore,
    admin: &sqlx::PgPool,
    app: &str,
    tenant: &str,
    key: &str,
    kill: bool,
) -> Result<u32, Error> {
    if kill {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(app)
        .execute(admin)
        .await
        .map_err(|e| idempotent_runtime::StoreError::new("test", "terminate", e))?;
        // pg_terminate_backend only signals the backend: wait (bounded) until it
        // is really gone, so the store's next statement meets a dead connection.
        for _ in 0..250 {
            let alive: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(app)
            .fetch_one(admin)
            .await
            .map_err(|e| idempotent_runtime::StoreError::new("test", "watch", e))?;
            if alive == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(42)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connections_surface_as_store_errors_and_the_next_call_succeeds() {
    let Some(admin) = pg_store_or_skip().await else {
        return;
    };
    let app = format!("idem-fault-{}", uuid::Uuid::new_v4().simple());
    let options = PgConnectOptions::from_str(&pg_url())
        .expect("url")
        .application_name(&app);
    // One connection, not tested before use: the killed one is what the next statement gets.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .expect("pool");
    let store = PgStore::from_pool(pool).await.expect("store");
    let tenant = fresh_tenant();

    // The kill is a signal: now and then the pool has already replaced the dead
    // connection before the completion runs, and the call simply succeeds. Either
    // way nothing may be corrupted; retry with fresh keys until a kill surfaces.
    let mut surfaced = None;
    for attempt in 0..8 {
        let key = format!("k{attempt}");
        let id =
            Identity::new(tenant.as_str(), "faults.terminate", key.as_str()).expect("identity");
        match killed_mid_call(&store, admin.pool(), &app, &tenant, &key, true).await {
            Err(Error::Store(_)) => {
                // Nothing half-written. The answer is final, so the store keeps
                // trying to record it in the background: the record is either
                // still in progress under the call's token, or already complete
                // with exactly the body's answer (the background completion got
                // there before this read). Both are right.
                let record = admin.fetch(&id).await.expect("fetch").expect("record kept");
                match record.state {
                    RecordState::InProgress => {
                        assert!(record.owner_token.is_some() && record.outcome.is_none());
                    }
                    RecordState::Complete => {
                        let outcome = record.outcome.expect("a complete record has its answer");
                        assert!(!outcome.is_error);
                        assert_eq!(outcome.payload, b"42");
                    }
                }
                surfaced = Some((key, id));
                break;
            }
            Ok(42) => {
                let record = admin.fetch(&id).await.expect("fetch").expect("record");
                assert_eq!(
                    record.state,
                    RecordState::Complete,
                    "a recovered call recorded its result"
                );
            }
            other => panic!("a killed connection gave {other:?}"),
        }
    }
    let (key, id) = surfaced.expect("no kill surfaced as Error::Store in 8 attempts");

    // The next call gets a fresh connection and either replays the answer the
    // background completion recorded, or waits out the 1 s lease, takes over
    // and completes.
    let mut next = killed_mid_call(&store, admin.pool(), &app, &tenant, &key, false).await;
    for _ in 0..3 {
        if !matches!(next, Err(Error::Store(_))) {
            break;
        }
        next = killed_mid_call(&store, admin.pool(), &app, &tenant, &key, false).await;
    }
    assert_eq!(next.expect("the next call succeeds"), 42);
    let record = admin.fetch(&id).await.expect("fetch").expect("record");
    assert_eq!(record.state, RecordState::Complete);
}

#[tokio::test]
async fn connect_to_a_closed_port_fails_fast_and_says_where() {
    let attempt = tokio::time::timeout(
        Duration::from_secs(60),
        PgStore::connect("postgres://postgres@127.0.0.1:1/test"),
    )
    .await
    .expect("connect gives up on its own (acquire timeout), it does not hang");
    let message = attempt.expect_err("nothing listens on port 1").to_string();
    assert!(message.contains("127.0.0.1:1"), "{message}");
    assert!(message.contains("postgres"), "{message}");
}

#[tokio::test]
async fn a_lazy_pool_against_a_closed_port_fails_fast() {
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .expect("lazy pool");
    let attempt = tokio::time::timeout(Duration::from_secs(60), PgStore::from_pool(pool))
        .await
        .expect("bounded by the pool's acquire timeout");
    assert!(matches!(attempt, Err(Error::Store(_))));
}
