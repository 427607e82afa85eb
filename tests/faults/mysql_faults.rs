//! Database faults on MariaDB/MySQL: a killed connection surfaces as
//! `Error::Store`; a closed port fails fast and says where; a dropped call is
//! released in the database a pool's `after_connect` hook picks.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip};
use idempotent_runtime::{Error, Fenced, Identity, MySqlStore, OwnerToken, ReserveRequest, Store};
use sqlx::mysql::MySqlPoolOptions;
use std::time::Duration;

#[tokio::test]
async fn connect_to_a_closed_port_fails_fast_and_says_where() {
    let attempt = tokio::time::timeout(
        Duration::from_secs(60),
        MySqlStore::connect("mysql://root@127.0.0.1:1/test"),
    )
    .await
    .expect("connect gives up on its own (acquire timeout), it does not hang");
    let message = attempt.expect_err("nothing listens on port 1").to_string();
    assert!(message.contains("127.0.0.1:1"), "{message}");
    assert!(message.contains("mysql"), "{message}");
}

#[tokio::test]
async fn a_killed_connection_surfaces_as_a_store_error_and_the_next_call_succeeds() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&common::servers::mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool).await.expect("store");
    let mut connection_id = next_connection_id(&store).await;

    // Make the kill land *during* a statement: another transaction holds the
    // record's row lock, so the store's reservation waits on it (up to its
    // 1 s lock wait, in the procedure), and the connection is killed while it
    // waits. (Killing an idle pooled connection is not enough: the pool may
    // replace it unnoticed.) The kill is sent once the server shows the
    // statement waiting for a lock; on a loaded machine it can still arrive
    // after the wait ran out, when the store has rightly answered InProgress
    // (the holder has the record): then the scenario runs again on a new key.
    let tenant = fresh_tenant();
    let token = OwnerToken::new();
    let mut failed = None;
    for round in 0..5 {
        let id = Identity::new(&tenant, "faults.kill", format!("k{round}")).expect("identity");
        let request = ReserveRequest {
            identity: &id,
            fingerprint: None,
            token: &token,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        let holder_token = OwnerToken::new();
        let mut holder = admin.pool().begin().await.expect("holder transaction");
        let held = idempotent_runtime::TransactionalConnection::reserve_in_transaction(
            &mut holder,
            ReserveRequest {
                token: &holder_token,
                ..request
            },
            Duration::from_secs(1),
        )
        .await
        .expect("the holder reserves in its transaction");
        assert!(matches!(
            held,
            idempotent_runtime::Reservation::Acquired { .. }
        ));
        let waiting = {
            let (store, id, token) = (store.clone(), id.clone(), token.clone());
            tokio::spawn(async move {
                store
                    .reserve(ReserveRequest {
                        identity: &id,
                        fingerprint: None,
                        token: &token,
                        lease: Duration::from_secs(30),
                        ttl: Duration::from_secs(3600),
                    })
                    .await
            })
        };
        // Kill it once the server shows it waiting for the row lock
        // (`Update`) or for the procedure's named lock (`User lock`); bounded.
        for _ in 0..200 {
            let state: Option<String> =
                sqlx::query_scalar("SELECT STATE FROM information_schema.PROCESSLIST WHERE ID = ?")
                    .bind(connection_id)
                    .fetch_optional(admin.pool())
                    .await
                    .expect("processlist")
                    .flatten();
            if state.is_some_and(|s| s == "Update" || s == "User lock") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sqlx::query(&format!("KILL CONNECTION {connection_id}"))
            .execute(admin.pool())
            .await
            .expect("kill");
        let answer = waiting.await.expect("task");
        holder.rollback().await.expect("holder rolls back");
        match answer {
            Err(e) => {
                failed = Some((e, id));
                break;
            }
            Ok(idempotent_runtime::Reservation::InProgress { .. }) => {
                // The kill came after the answer; the connection is gone
                // now, so find the pool's next one for the next round.
                connection_id = next_connection_id(&store).await;
            }
            Ok(other) => panic!("a held record answered {other:?}"),
        }
    }
    let (failed, id) = failed.expect("in one of five rounds the kill lands during the statement");
    let message = Error::from(failed).to_string();
    assert!(message.contains("mysql store failed"), "{message}");

    let request = ReserveRequest {
        identity: &id,
        fingerprint: None,
        token: &token,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    };
    let mut next = store.reserve(request).await;
    for _ in 0..3 {
        if next.is_ok() {
            break;
        }
        next = store.reserve(request).await;
    }
    assert!(matches!(
        next.expect("the next call succeeds"),
        idempotent_runtime::Reservation::Acquired { .. }
    ));
    assert_eq!(
        store.release(&id, &token).await.expect("release"),
        Fenced::Written
    );
}

/// The id of the (only) connection of `store`'s pool, replacing a killed one
/// first: the first statement on a dead connection fails, the next opens anew.
async fn next_connection_id(store: &MySqlStore) -> u64 {
    for _ in 0..3 {
        if let Ok(id) = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(store.pool())
            .await
        {
            return id;
        }
    }
    panic!("the pool opens a new connection after a killed one")
}

#[idempotent_runtime::idempotent(scope = "mysql_faults.after_connect", key = key, tenant = tenant,
                                 store = store, skip(started), lease = "1h")]
async fn held_forever(
    store: &MySqlStore,
    tenant: &str,
    key: &str,
    started: &tokio::sync::Notify,
) -> Result<u32, Error> {
    started.notify_one();
    std::future::pending::<()>().await;
    Ok(0)
}

/// Rule 14 on a pool whose `after_connect` hook picks the database (`USE`),
/// not the URL: a call dropped while it holds its record is released by the
/// store's background worker, whose connections run the pool's hooks too;
/// otherwise its release would look in the URL's database and the key would
/// stay taken for the whole lease (here an hour).
#[tokio::test]
async fn a_dropped_call_is_released_in_the_database_the_after_connect_hook_uses() {
    use sqlx::Executor;
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = crate::common::servers::mysql_create_database(&admin, "after_connect").await;
    let use_db = format!("USE `{db}`");
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .after_connect(move |conn, _| {
            let use_db = use_db.clone();
            Box::pin(async move {
                conn.execute(use_db.as_str()).await?;
                Ok(())
            })
        })
        .connect(&common::servers::mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");

    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, "mysql_faults.after_connect", "k").expect("identity");
    let started = tokio::sync::Notify::new();
    tokio::select! {
        answer = held_forever(&store, &tenant, "k", &started) => panic!("the held call answered: {answer:?}"),
        () = started.notified() => {} // the call holds its record; drop it now
    }
    let bound = Duration::from_secs(40);
    let deadline = tokio::time::Instant::now() + bound;
    let released = loop {
        let fetched = tokio::time::timeout(bound, store.fetch(&id))
            .await
            .expect("fetch hung")
            .expect("fetch");
        match fetched {
            None => break true,
            Some(_) if tokio::time::Instant::now() >= deadline => break false,
            Some(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    drop(store);
    pool.close().await;
    let _ = admin
        .pool()
        .execute(format!("DROP DATABASE {db}").as_str())
        .await;
    assert!(
        released,
        "the dropped call's record in database {db} was not released within {bound:?}"
    );
}
