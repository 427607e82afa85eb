//! Transactional mode (`tx = ...`, DESIGN.md rule 15) on PostgreSQL, MariaDB
//! and SQLite: the reservation and the recorded result are statements in the
//! caller's transaction and commit or roll back with the business writes.
//!
//! These call the engine's transactional entry points
//! (`__private::{begin_in_transaction, finish_in_transaction}`) directly, as
//! the code `#[idempotent(tx = ...)]` expands to does.

mod common;

use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::__private::{
    begin_in_transaction, finish_in_transaction, ReleaseErrors, TransactionStep, TransactionalCall,
    TransactionalConnection,
};
use idempotent_runtime::registry::{ErrorPolicy, InProgressPolicy, ScopeInfo};
use idempotent_runtime::{
    Error, Identity, OwnerToken, RecordState, Reservation, ReserveRequest, Store,
};
use std::time::Duration;

const fn spec(scope: &'static str, in_progress: InProgressPolicy) -> ScopeInfo {
    ScopeInfo::__new(
        scope,
        "transactional::charge",
        file!(),
        line!(),
        Duration::from_secs(3600),
        Duration::from_secs(30),
        in_progress,
        ErrorPolicy::Release,
        true,
        false,
        &[],
        false,
    )
}

static WAIT: ScopeInfo = spec("tx.charge", InProgressPolicy::Wait(Duration::from_secs(2)));
static REJECT: ScopeInfo = spec("tx.charge", InProgressPolicy::Reject);

type Answer = Result<u64, Error>;

async fn begin<C: TransactionalConnection + ?Sized>(
    spec: &'static ScopeInfo,
    conn: &mut C,
    tenant: &str,
    key: &str,
) -> TransactionStep<Answer> {
    let call = TransactionalCall {
        spec,
        identity: Identity::new(tenant, spec.scope, key),
        fingerprint: Ok(None),
    };
    begin_in_transaction(call, &ReleaseErrors, conn).await
}

fn identity(tenant: &str, key: &str) -> Identity {
    Identity::new(tenant, "tx.charge", key).expect("identity")
}

/// The business table the bodies write to, in each database.
const PG_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_charges (
    tenant TEXT NOT NULL, idem_key TEXT NOT NULL, amount BIGINT NOT NULL)";
const MY_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_charges (
    tenant VARCHAR(100) NOT NULL, idem_key VARCHAR(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB";

// ---------------------------------------------------------------- PostgreSQL

async fn pg_charge(pool: &sqlx::PgPool, tenant: &str, key: &str, commit: bool) -> Answer {
    let mut tx = pool.begin().await.expect("begin");
    let held = match begin(&WAIT, &mut tx, tenant, key).await {
        TransactionStep::Return(r) => return r,
        TransactionStep::Run(held) => held,
    };
    sqlx::query(
        "INSERT INTO idempotent_test_charges (tenant, idem_key, amount) VALUES ($1, $2, 500)",
    )
    .bind(tenant)
    .bind(key)
    .execute(&mut *tx)
    .await
    .expect("business write");
    let result = finish_in_transaction(held, &ReleaseErrors, &mut tx, Ok(500)).await;
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    result
}

async fn pg_charges(pool: &sqlx::PgPool, tenant: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotent_test_charges WHERE tenant = $1")
        .bind(tenant)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test]
async fn pg_rollback_leaves_no_record_commit_leaves_one_of_each() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    sqlx::query(PG_DDL).execute(&pool).await.expect("ddl");
    let tenant = fresh_tenant();

    assert_eq!(
        pg_charge(&pool, &tenant, "k", false).await.expect("runs"),
        500
    );
    assert_eq!(
        store.fetch(&identity(&tenant, "k")).await.expect("fetch"),
        None
    );
    assert_eq!(
        pg_charges(&pool, &tenant).await,
        0,
        "rolled back with the record"
    );

    assert_eq!(
        pg_charge(&pool, &tenant, "k", true)
            .await
            .expect("retry executes"),
        500
    );
    assert_eq!(
        pg_charge(&pool, &tenant, "k", true).await.expect("replays"),
        500
    );
    assert_eq!(pg_charges(&pool, &tenant).await, 1, "one business row");
    let record = store
        .fetch(&identity(&tenant, "k"))
        .await
        .expect("fetch")
        .expect("one record");
    assert_eq!(record.state, RecordState::Complete);
}

#[tokio::test]
async fn pg_duplicate_of_an_open_transaction_is_in_progress_and_never_blocks() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    let tenant = fresh_tenant();
    let mut owner = pool.begin().await.expect("begin");
    let TransactionStep::Run(held) = begin(&WAIT, &mut owner, &tenant, "k").await else {
        panic!("the first call acquires");
    };

    // Through the store (no transaction): answers InProgress instead of waiting on the row lock.
    let token = OwnerToken::new();
    let id = identity(&tenant, "k");
    let request = ReserveRequest {
        identity: &id,
        fingerprint: None,
        token: &token,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    };
    assert!(matches!(
        store.reserve(request).await.expect("reserve"),
        Reservation::InProgress { .. }
    ));

    // In another transaction, reject: refused at once, and that transaction stays usable.
    let mut other = pool.begin().await.expect("begin");
    let refused = begin(&REJECT, &mut other, &tenant, "k").await;
    assert!(matches!(
        refused,
        TransactionStep::Return(Err(Error::InProgress { .. }))
    ));
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *other)
        .await
        .expect("the duplicate's transaction is still usable");
    assert_eq!(one, 1);
    other.rollback().await.expect("rollback");

    // In another transaction, wait (2 s): bounded, then InProgress.
    let mut waiting = pool.begin().await.expect("begin");
    assert!(matches!(
        begin(&WAIT, &mut waiting, &tenant, "k").await,
        TransactionStep::Return(Err(Error::InProgress { .. }))
    ));
    waiting.rollback().await.expect("rollback");

    assert!(
        finish_in_transaction(held, &ReleaseErrors, &mut owner, Answer::Ok(7))
            .await
            .is_ok()
    );
    owner.commit().await.expect("commit");
    let mut after = pool.begin().await.expect("begin");
    assert!(matches!(
        begin(&WAIT, &mut after, &tenant, "k").await,
        TransactionStep::Return(Ok(7))
    ));
    after.commit().await.expect("commit");
}

#[tokio::test]
async fn pg_plain_connection_works_too() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let mut conn = store.pool().acquire().await.expect("acquire");
    let conn: &mut sqlx::PgConnection = &mut conn;
    let TransactionStep::Run(held) = begin(&WAIT, conn, &tenant, "k").await else {
        panic!("acquires");
    };
    assert_eq!(
        finish_in_transaction(held, &ReleaseErrors, conn, Answer::Ok(3))
            .await
            .expect("ok"),
        3
    );
    assert!(matches!(
        begin(&WAIT, conn, &tenant, "k").await,
        TransactionStep::Return(Ok(3))
    ));
}

// ---------------------------------------------------------------- MariaDB / MySQL

async fn my_charge(pool: &sqlx::MySqlPool, tenant: &str, key: &str, commit: bool) -> Answer {
    let mut tx = pool.begin().await.expect("begin");
    let held = match begin(&WAIT, &mut tx, tenant, key).await {
        TransactionStep::Return(r) => return r,
        TransactionStep::Run(held) => held,
    };
    sqlx::query(
        "INSERT INTO idempotent_test_charges (tenant, idem_key, amount) VALUES (?, ?, 500)",
    )
    .bind(tenant)
    .bind(key)
    .execute(&mut *tx)
    .await
    .expect("business write");
    let result = finish_in_transaction(held, &ReleaseErrors, &mut tx, Ok(500)).await;
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    result
}

async fn my_charges(pool: &sqlx::MySqlPool, tenant: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotent_test_charges WHERE tenant = ?")
        .bind(tenant)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test]
async fn mysql_rollback_leaves_no_record_commit_leaves_one_of_each() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    sqlx::query(MY_DDL).execute(&pool).await.expect("ddl");
    let tenant = fresh_tenant();

    assert_eq!(
        my_charge(&pool, &tenant, "k", false).await.expect("runs"),
        500
    );
    assert_eq!(
        store.fetch(&identity(&tenant, "k")).await.expect("fetch"),
        None
    );
    assert_eq!(
        my_charges(&pool, &tenant).await,
        0,
        "rolled back with the record"
    );

    assert_eq!(
        my_charge(&pool, &tenant, "k", true)
            .await
            .expect("retry executes"),
        500
    );
    assert_eq!(
        my_charge(&pool, &tenant, "k", true).await.expect("replays"),
        500
    );
    assert_eq!(my_charges(&pool, &tenant).await, 1, "one business row");
    let record = store
        .fetch(&identity(&tenant, "k"))
        .await
        .expect("fetch")
        .expect("one record");
    assert_eq!(record.state, RecordState::Complete);
}

#[tokio::test]
async fn mysql_duplicate_of_an_open_transaction_is_in_progress_and_never_blocks() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    let tenant = fresh_tenant();
    let mut owner = pool.begin().await.expect("begin");
    let TransactionStep::Run(held) = begin(&WAIT, &mut owner, &tenant, "k").await else {
        panic!("the first call acquires");
    };

    let token = OwnerToken::new();
    let id = identity(&tenant, "k");
    let request = ReserveRequest {
        identity: &id,
        fingerprint: None,
        token: &token,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    };
    assert!(matches!(
        store.reserve(request).await.expect("reserve"),
        Reservation::InProgress { .. }
    ));

    let mut other = pool.begin().await.expect("begin");
    assert!(matches!(
        begin(&REJECT, &mut other, &tenant, "k").await,
        TransactionStep::Return(Err(Error::InProgress { .. }))
    ));
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *other)
        .await
        .expect("the duplicate's transaction is still usable");
    assert_eq!(one, 1);
    other.rollback().await.expect("rollback");

    let mut waiting = pool.begin().await.expect("begin");
    assert!(matches!(
        begin(&WAIT, &mut waiting, &tenant, "k").await,
        TransactionStep::Return(Err(Error::InProgress { .. }))
    ));
    waiting.rollback().await.expect("rollback");

    assert!(
        finish_in_transaction(held, &ReleaseErrors, &mut owner, Answer::Ok(7))
            .await
            .is_ok()
    );
    owner.commit().await.expect("commit");
    let mut after = pool.begin().await.expect("begin");
    assert!(matches!(
        begin(&WAIT, &mut after, &tenant, "k").await,
        TransactionStep::Return(Ok(7))
    ));
    after.commit().await.expect("commit");
}

// ---------------------------------------------------------------- SQLite

#[tokio::test]
async fn sqlite_rollback_leaves_no_record_commit_replays() {
    let dir = std::env::temp_dir().join(format!("idempotent-tx-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let url = format!("sqlite:{}?mode=rwc", dir.join("tx.db").display());
    let store = idempotent_runtime::SqliteStore::connect(&url)
        .await
        .expect("open");
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE IF NOT EXISTS idempotent_test_charges (tenant TEXT, idem_key TEXT, amount INTEGER)")
        .execute(&pool)
        .await
        .expect("ddl");
    let tenant = fresh_tenant();
    for commit in [false, true, true] {
        let mut tx = pool.begin().await.expect("begin");
        match begin(&WAIT, &mut tx, &tenant, "k").await {
            TransactionStep::Return(r) => assert_eq!(r.expect("replay"), 500),
            TransactionStep::Run(held) => {
                sqlx::query("INSERT INTO idempotent_test_charges VALUES (?1, 'k', 500)")
                    .bind(&tenant)
                    .execute(&mut *tx)
                    .await
                    .expect("write");
                assert_eq!(
                    finish_in_transaction(held, &ReleaseErrors, &mut tx, Answer::Ok(500))
                        .await
                        .expect("ok"),
                    500
                );
            }
        }
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
            assert_eq!(
                store.fetch(&identity(&tenant, "k")).await.expect("fetch"),
                None
            );
        }
    }
    let charges: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotent_test_charges WHERE tenant = ?1")
            .bind(&tenant)
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(charges, 1);
    let _ = std::fs::remove_dir_all(&dir);
}
