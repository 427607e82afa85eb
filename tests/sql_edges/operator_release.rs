//! An operator's release (`Store::force_release`, the CLI's `release`) of a
//! record another open transaction holds: a transactional-mode takeover in
//! progress (its row locked), or on MySQL/MariaDB a transactional caller's
//! uncommitted record. The release waits a bounded moment and says the record
//! is held, instead of waiting for the other transaction to end (PostgreSQL:
//! without bound; MySQL/MariaDB: `innodb_lock_wait_timeout`, 50 s, then a raw
//! 1205 error). Once the holder ends, the release works.

use crate::common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{idempotent, Error, ForcedRelease, Identity, Store};
use sqlx::{Connection, Executor, MySql};
use std::time::Duration;

/// Only to report a hang as a failure: the release answers within about a second.
const HANG: Duration = Duration::from_secs(20);

const SCOPE: &str = "operator_release.held";

/// An in-progress record with a live lease, reserved through the store.
async fn in_progress(store: &dyn Store, tenant: &str) -> Identity {
    let id = Identity::new(tenant, SCOPE, "k").expect("identity");
    crate::common::records::acquire(
        store,
        &id,
        None,
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
    .await;
    id
}

/// The answer is an error that says the record is held by another transaction.
fn assert_held(
    answer: Result<Result<ForcedRelease, impl std::fmt::Display>, impl std::fmt::Debug>,
) {
    let answer = answer.expect("the release waited for the other transaction to end");
    match answer {
        Err(e) => assert!(
            e.to_string().contains("held by another open transaction"),
            "{e}"
        ),
        Ok(released) => panic!("released a record another transaction holds: {released:?}"),
    }
}

#[tokio::test]
async fn postgres_a_record_a_transaction_holds_is_reported_not_waited_for() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let id = in_progress(&store, &tenant).await;
    // A transactional-mode takeover holds the row (locked, uncommitted).
    let mut holder = store.pool().begin().await.expect("holder");
    sqlx::query(
        "SELECT 1 FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE",
    )
    .bind(id.tenant())
    .bind(id.scope())
    .bind(id.key())
    .execute(&mut *holder)
    .await
    .expect("lock the row");

    assert_held(tokio::time::timeout(HANG, store.force_release(&id, false)).await);

    holder.rollback().await.expect("the holder ends");
    let released = store.force_release(&id, false).await.expect("release");
    assert!(
        matches!(released, ForcedRelease::Released { attempt: 1 }),
        "{released:?}"
    );
}

#[idempotent(scope = "operator_release.uncommitted", key = key, tenant = tenant, tx = tx)]
async fn charge_in_tx(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    let _ = (&tx, tenant, key);
    Ok(7)
}

#[tokio::test]
async fn mysql_a_record_a_transaction_holds_is_reported_not_waited_for() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let id = in_progress(&store, &tenant).await;
    let mut holder = store.pool().acquire().await.expect("holder").detach();
    holder.execute("BEGIN").await.expect("begin");
    sqlx::query(
        "SELECT 1 FROM idempotency_records WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE",
    )
    .bind(id.tenant())
    .bind(id.scope())
    .bind(id.key())
    .execute(&mut holder)
    .await
    .expect("lock the row");

    assert_held(tokio::time::timeout(HANG, store.force_release(&id, false)).await);

    holder.execute("ROLLBACK").await.expect("the holder ends");
    holder.close().await.expect("close");
    let released = store.force_release(&id, false).await.expect("release");
    assert!(
        matches!(released, ForcedRelease::Released { attempt: 1 }),
        "{released:?}"
    );

    // A transactional caller's record, not committed yet: the same answer,
    // and no pooled connection keeps the operator's shortened lock wait.
    let mut tx = store.pool().begin().await.expect("caller's transaction");
    charge_in_tx(&mut tx, &tenant, "uncommitted")
        .await
        .expect("runs");
    let uncommitted =
        Identity::new(&tenant, "operator_release.uncommitted", "uncommitted").expect("identity");
    assert_held(tokio::time::timeout(HANG, store.force_release(&uncommitted, false)).await);
    tx.rollback().await.expect("rollback");
    let waits: Vec<i64> = {
        let mut waits = Vec::new();
        for _ in 0..4 {
            let mut conn = store.pool().acquire().await.expect("a pooled connection");
            waits.push(
                sqlx::query_scalar("SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)")
                    .fetch_one(&mut *conn)
                    .await
                    .expect("read the lock wait"),
            );
        }
        waits
    };
    assert!(
        waits.iter().all(|w| *w > 1),
        "a session kept the operator's 1 s wait: {waits:?}"
    );
}

/// SQLite: another connection's transaction holds the database's one write
/// lock past the busy timeout (here a short one, set on the application's
/// pool). The release and the purge say so and what to do, not SQLite's
/// bare "database is locked"; once the holder ends, the release works.
#[tokio::test]
async fn sqlite_a_write_lock_held_past_the_busy_timeout_is_reported() {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;
    let path = std::env::temp_dir().join(format!(
        "idempotent-operator-release-{}.db",
        uuid::Uuid::new_v4().simple()
    ));
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
        .expect("url")
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(200));
    let pool = SqlitePoolOptions::new()
        .connect_with(options)
        .await
        .expect("pool");
    let store = idempotent_runtime::SqliteStore::from_pool(pool.clone())
        .await
        .expect("store");
    let id = in_progress(&store, "acme").await;
    let mut holder = pool.begin_with("BEGIN IMMEDIATE").await.expect("begin");
    holder
        .execute("CREATE TABLE held (x)")
        .await
        .expect("a write");
    let released = tokio::time::timeout(HANG, store.force_release(&id, false)).await;
    let purged = tokio::time::timeout(HANG, store.purge_expired(10)).await;
    for answer in [
        released.map(|r| r.map(|_| ())),
        purged.map(|r| r.map(|_| ())),
    ] {
        let e = answer.expect("bounded").expect_err("the lock is held");
        assert!(
            e.to_string()
                .contains("retry once that transaction has ended"),
            "{e}"
        );
    }
    holder.rollback().await.expect("rollback");
    let released = store.force_release(&id, false).await.expect("released");
    assert!(
        matches!(released, ForcedRelease::Released { .. }),
        "{released:?}"
    );
    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}
