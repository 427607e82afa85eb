//! Transactional mode (`tx = ...`, DESIGN.md rule 15) on PostgreSQL, MariaDB
//! and SQLite: the reservation and the recorded result are statements in the
//! caller's transaction and commit or roll back with the business writes.
//!
//! Every call goes through the real attribute, `#[idempotent(..., tx = tx)]`,
//! on functions taking `tx: &mut sqlx::Transaction<'_, DB>` (or a plain
//! connection). A test that needs a reservation held open mid-body passes a
//! [`Hold`]: the body says it has started, then waits until it is let go.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, Outcome, OwnerToken, RecordState, Reservation,
    ReserveRequest, Store,
};
use sqlx::{MySql, Postgres, Sqlite};
use std::future::Future;
use std::time::Duration;
use tokio::sync::Notify;

type Answer = Result<u64, Error>;

/// Holds a body open: it notifies `reached` once the reservation is held,
/// then waits for `go`.
#[derive(Default)]
struct Hold {
    reached: Notify,
    go: Notify,
}

async fn hold_here(hold: Option<&Hold>) {
    if let Some(hold) = hold {
        hold.reached.notify_one();
        hold.go.notified().await;
    }
}

/// Runs `owner` (a call whose body holds on `hold`) and, once the body is
/// running, `check`; then lets the body finish. Returns the owner's answer.
async fn while_held(
    hold: &Hold,
    owner: impl Future<Output = Answer>,
    check: impl Future<Output = ()>,
) -> Answer {
    let checker = async {
        hold.reached.notified().await;
        check.await;
        hold.go.notify_one();
    };
    let (answer, ()) = tokio::join!(owner, checker);
    answer
}

fn identity(tenant: &str, key: &str) -> Identity {
    Identity::new(tenant, "tx.charge", key).expect("identity")
}

fn my_identity(tenant: &str, key: &str) -> Identity {
    Identity::new(tenant, "tx.charge_mysql", key).expect("identity")
}

/// The business table the bodies write to, in each database.
const PG_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_charges (
    tenant TEXT NOT NULL, idem_key TEXT NOT NULL, amount BIGINT NOT NULL)";
const MY_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_charges (
    tenant VARCHAR(100) NOT NULL, idem_key VARCHAR(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB";

// ---------------------------------------------------------------- PostgreSQL

#[idempotent(scope = "tx.charge", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = wait("2s"))]
async fn pg_charge_in(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    sqlx::query(
        "INSERT INTO idempotent_test_charges (tenant, idem_key, amount) VALUES ($1, $2, $3)",
    )
    .bind(tenant)
    .bind(key)
    .bind(amount)
    .execute(&mut **tx)
    .await
    .expect("business write");
    hold_here(hold).await;
    Ok(amount as u64)
}

#[idempotent(scope = "tx.charge_reject", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = reject)]
async fn pg_charge_or_reject(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    key: &str,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(1)
}

#[idempotent(scope = "tx.charge_conn", key = key, tenant = tenant, tx = conn, ttl = "1h")]
async fn pg_charge_on_connection(
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *conn)
        .await
        .expect("the body uses the connection");
    Ok(one as u64 + 2)
}

async fn pg_charge(pool: &sqlx::PgPool, tenant: &str, key: &str, commit: bool) -> Answer {
    let mut tx = pool.begin().await.expect("begin");
    let result = pg_charge_in(&mut tx, tenant, key, 500, None).await;
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
    common::servers::pg_create_tables(&pool, PG_DDL)
        .await
        .expect("ddl");
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
    let (replay, outcome) = with_outcome(pg_charge(&pool, &tenant, "k", true)).await;
    assert_eq!(replay.expect("replays"), 500);
    assert_eq!(outcome, Some(Outcome::Replayed));
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
    common::servers::pg_create_tables(&pool, PG_DDL)
        .await
        .expect("ddl");
    let tenant = fresh_tenant();

    // `in_progress = reject`: a duplicate in another transaction is refused at
    // once, and that transaction stays usable.
    let hold = Hold::default();
    let owner = async {
        let mut owner = pool.begin().await.expect("begin");
        let answer = pg_charge_or_reject(&mut owner, &tenant, "k", Some(&hold)).await;
        owner.commit().await.expect("commit");
        answer
    };
    let check = async {
        let mut other = pool.begin().await.expect("begin");
        let refused = pg_charge_or_reject(&mut other, &tenant, "k", None).await;
        assert!(
            matches!(refused, Err(Error::InProgress { .. })),
            "{refused:?}"
        );
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *other)
            .await
            .expect("the duplicate's transaction is still usable");
        assert_eq!(one, 1);
        other.rollback().await.expect("rollback");
    };
    assert_eq!(while_held(&hold, owner, check).await.expect("owner"), 1);

    // `in_progress = wait("2s")`: the store (no transaction) answers InProgress
    // instead of waiting on the row lock; a duplicate in another transaction
    // waits, bounded, then gets InProgress.
    let hold = Hold::default();
    let owner = async {
        let mut owner = pool.begin().await.expect("begin");
        let answer = pg_charge_in(&mut owner, &tenant, "k", 7, Some(&hold)).await;
        owner.commit().await.expect("commit");
        answer
    };
    let check = async {
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
        let mut waiting = pool.begin().await.expect("begin");
        let waited = pg_charge_in(&mut waiting, &tenant, "k", 7, None).await;
        assert!(
            matches!(waited, Err(Error::InProgress { .. })),
            "{waited:?}"
        );
        waiting.rollback().await.expect("rollback");
    };
    assert_eq!(while_held(&hold, owner, check).await.expect("owner"), 7);

    let mut after = pool.begin().await.expect("begin");
    let (replay, outcome) = with_outcome(pg_charge_in(&mut after, &tenant, "k", 7, None)).await;
    assert_eq!(replay.expect("replays"), 7);
    assert_eq!(outcome, Some(Outcome::Replayed));
    after.commit().await.expect("commit");
    assert_eq!(pg_charges(&pool, &tenant).await, 1, "one business row");
}

/// Rules 7 and 15 on PostgreSQL: inside a caller's transaction, the same key
/// with other arguments is refused as a mismatch (not replayed): the body does
/// not run, the record is untouched, and the transaction stays usable.
#[tokio::test]
async fn pg_a_different_request_in_a_transaction_is_a_mismatch() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    common::servers::pg_create_tables(&pool, PG_DDL)
        .await
        .expect("ddl");
    let tenant = fresh_tenant();
    assert_eq!(
        pg_charge(&pool, &tenant, "k", true).await.expect("runs"),
        500
    );
    let before = store
        .fetch(&identity(&tenant, "k"))
        .await
        .expect("fetch")
        .expect("recorded");

    let mut other = pool.begin().await.expect("begin");
    let (refused, outcome) = with_outcome(pg_charge_in(&mut other, &tenant, "k", 600, None)).await;
    assert!(
        matches!(refused, Err(Error::FingerprintMismatch(_))),
        "same key, other amount, in a transaction: {refused:?}"
    );
    assert_ne!(outcome, Some(Outcome::Replayed));
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *other)
        .await
        .expect("the refused caller's transaction is still usable");
    assert_eq!(one, 1);
    other.commit().await.expect("commit");

    assert_eq!(pg_charges(&pool, &tenant).await, 1, "the body did not run");
    let after = store
        .fetch(&identity(&tenant, "k"))
        .await
        .expect("fetch")
        .expect("still recorded");
    assert_eq!(
        (
            after.state,
            &after.fingerprint,
            &after.outcome,
            after.expires_at_ms
        ),
        (
            before.state,
            &before.fingerprint,
            &before.outcome,
            before.expires_at_ms
        ),
        "the record is untouched"
    );
}

/// `tx = conn` on a `&mut PgConnection` that is inside a transaction (begun
/// by sqlx); an autocommit connection is refused (tests/transactional_edges.rs).
#[tokio::test]
async fn pg_connection_inside_a_transaction_works_too() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let mut tx = store.pool().begin().await.expect("begin");
    let conn: &mut sqlx::PgConnection = &mut tx;
    assert_eq!(
        pg_charge_on_connection(conn, &tenant, "k")
            .await
            .expect("ok"),
        3
    );
    let (replay, outcome) = with_outcome(pg_charge_on_connection(conn, &tenant, "k")).await;
    assert_eq!(replay.expect("replays"), 3);
    assert_eq!(outcome, Some(Outcome::Replayed));
    tx.commit().await.expect("commit");
}

// ---------------------------------------------------------------- MariaDB / MySQL

#[idempotent(scope = "tx.charge_mysql", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = wait("2s"))]
async fn my_charge_in(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    sqlx::query("INSERT INTO idempotent_test_charges (tenant, idem_key, amount) VALUES (?, ?, ?)")
        .bind(tenant)
        .bind(key)
        .bind(amount)
        .execute(&mut **tx)
        .await
        .expect("business write");
    hold_here(hold).await;
    Ok(amount as u64)
}

#[idempotent(scope = "tx.charge_mysql_reject", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = reject)]
async fn my_charge_or_reject(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(1)
}

async fn my_charge(pool: &sqlx::MySqlPool, tenant: &str, key: &str, commit: bool) -> Answer {
    let mut tx = pool.begin().await.expect("begin");
    let result = my_charge_in(&mut tx, tenant, key, 500, None).await;
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
        store
            .fetch(&my_identity(&tenant, "k"))
            .await
            .expect("fetch"),
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
    let (replay, outcome) = with_outcome(my_charge(&pool, &tenant, "k", true)).await;
    assert_eq!(replay.expect("replays"), 500);
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(my_charges(&pool, &tenant).await, 1, "one business row");
    let record = store
        .fetch(&my_identity(&tenant, "k"))
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
    sqlx::query(MY_DDL).execute(&pool).await.expect("ddl");
    let tenant = fresh_tenant();

    let hold = Hold::default();
    let owner = async {
        let mut owner = pool.begin().await.expect("begin");
        let answer = my_charge_or_reject(&mut owner, &tenant, "k", Some(&hold)).await;
        owner.commit().await.expect("commit");
        answer
    };
    let check = async {
        let mut other = pool.begin().await.expect("begin");
        let refused = my_charge_or_reject(&mut other, &tenant, "k", None).await;
        assert!(
            matches!(refused, Err(Error::InProgress { .. })),
            "{refused:?}"
        );
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *other)
            .await
            .expect("the duplicate's transaction is still usable");
        assert_eq!(one, 1);
        other.rollback().await.expect("rollback");
    };
    assert_eq!(while_held(&hold, owner, check).await.expect("owner"), 1);

    let hold = Hold::default();
    let owner = async {
        let mut owner = pool.begin().await.expect("begin");
        let answer = my_charge_in(&mut owner, &tenant, "k", 7, Some(&hold)).await;
        owner.commit().await.expect("commit");
        answer
    };
    let check = async {
        let token = OwnerToken::new();
        let id = my_identity(&tenant, "k");
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
        let mut waiting = pool.begin().await.expect("begin");
        let waited = my_charge_in(&mut waiting, &tenant, "k", 7, None).await;
        assert!(
            matches!(waited, Err(Error::InProgress { .. })),
            "{waited:?}"
        );
        waiting.rollback().await.expect("rollback");
    };
    assert_eq!(while_held(&hold, owner, check).await.expect("owner"), 7);

    let mut after = pool.begin().await.expect("begin");
    let (replay, outcome) = with_outcome(my_charge_in(&mut after, &tenant, "k", 7, None)).await;
    assert_eq!(replay.expect("replays"), 7);
    assert_eq!(outcome, Some(Outcome::Replayed));
    after.commit().await.expect("commit");
    assert_eq!(my_charges(&pool, &tenant).await, 1, "one business row");
}

// ---------------------------------------------------------------- SQLite

#[idempotent(scope = "tx.charge_sqlite", key = key, tenant = tenant, tx = tx, ttl = "1h")]
async fn sqlite_charge_in(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    sqlx::query("INSERT INTO idempotent_test_charges VALUES (?1, ?2, 500)")
        .bind(tenant)
        .bind(key)
        .execute(&mut **tx)
        .await
        .expect("write");
    Ok(500)
}

/// A SQLite store on a scratch file of its own (removed when the test
/// process ends) and its pool, with the business table the bodies write.
async fn sqlite_with_charges(name: &str) -> (idempotent_runtime::SqliteStore, sqlx::SqlitePool) {
    let store = idempotent_runtime::SqliteStore::connect(&common::scratch::sqlite_url(name))
        .await
        .expect("open");
    let pool = store.pool().clone();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS idempotent_test_charges \
         (tenant TEXT, idem_key TEXT, amount INTEGER)",
    )
    .execute(&pool)
    .await
    .expect("ddl");
    (store, pool)
}

#[tokio::test]
async fn sqlite_rollback_leaves_no_record_commit_replays() {
    let (store, pool) = sqlite_with_charges("tx").await;
    let tenant = fresh_tenant();
    let sqlite_identity = Identity::new(&tenant, "tx.charge_sqlite", "k").expect("identity");
    let mut outcomes = Vec::new();
    for commit in [false, true, true] {
        let mut tx = pool.begin().await.expect("begin");
        let (answer, outcome) = with_outcome(sqlite_charge_in(&mut tx, &tenant, "k")).await;
        assert_eq!(answer.expect("runs or replays"), 500);
        outcomes.push(outcome);
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
            assert_eq!(store.fetch(&sqlite_identity).await.expect("fetch"), None);
        }
    }
    assert_eq!(
        outcomes,
        [
            Some(Outcome::Executed),
            Some(Outcome::Executed),
            Some(Outcome::Replayed)
        ]
    );
    let charges: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotent_test_charges WHERE tenant = ?1")
            .bind(&tenant)
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(charges, 1);
}

// ---------------------------------------------------------------- rule 16 in a transaction

/// The expiry a test gives a record: a time in 1970, long past on any clock.
const LONG_AGO_MS: i64 = 1_000;

/// Rule 16 in transactional mode, on PostgreSQL: a completed record whose ttl
/// has run out counts as absent inside a caller's transaction too, so the key
/// executes again (not replayed). The record's expiry is moved into the past
/// by hand, so no test sleeps through a ttl.
#[tokio::test]
async fn pg_an_expired_record_counts_as_absent_in_a_transaction() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    common::servers::pg_create_tables(&pool, PG_DDL)
        .await
        .expect("ddl");
    let tenant = fresh_tenant();
    let (first, outcome) = with_outcome(pg_charge(&pool, &tenant, "k", true)).await;
    assert_eq!(
        (first.expect("runs"), outcome),
        (500, Some(Outcome::Executed))
    );
    sqlx::query(
        "UPDATE idempotency_records SET expires_at = $4
          WHERE tenant = $1 AND scope = $2 AND key = $3",
    )
    .bind(&tenant)
    .bind("tx.charge")
    .bind("k")
    .bind(LONG_AGO_MS)
    .execute(&pool)
    .await
    .expect("expire the record");
    let (again, outcome) = with_outcome(pg_charge(&pool, &tenant, "k", true)).await;
    assert_eq!(again.expect("runs again"), 500);
    assert_eq!(
        outcome,
        Some(Outcome::Executed),
        "an expired record is not replayed"
    );
    assert_eq!(pg_charges(&pool, &tenant).await, 2, "the body ran twice");
}

/// As [`pg_an_expired_record_counts_as_absent_in_a_transaction`], on MariaDB.
#[tokio::test]
async fn mysql_an_expired_record_counts_as_absent_in_a_transaction() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    sqlx::query(MY_DDL).execute(&pool).await.expect("ddl");
    let tenant = fresh_tenant();
    let (first, outcome) = with_outcome(my_charge(&pool, &tenant, "k", true)).await;
    first.expect("runs");
    assert_eq!(outcome, Some(Outcome::Executed));
    sqlx::query(
        "UPDATE idempotency_records SET expires_at = ?
          WHERE tenant = ? AND scope = ? AND `key` = ?",
    )
    .bind(LONG_AGO_MS)
    .bind(&tenant)
    .bind("tx.charge_mysql")
    .bind("k")
    .execute(&pool)
    .await
    .expect("expire the record");
    let (again, outcome) = with_outcome(my_charge(&pool, &tenant, "k", true)).await;
    again.expect("runs again");
    assert_eq!(
        outcome,
        Some(Outcome::Executed),
        "an expired record is not replayed"
    );
    assert_eq!(my_charges(&pool, &tenant).await, 2, "the body ran twice");
}

/// As [`pg_an_expired_record_counts_as_absent_in_a_transaction`], on SQLite.
#[tokio::test]
async fn sqlite_an_expired_record_counts_as_absent_in_a_transaction() {
    let (store, pool) = sqlite_with_charges("tx").await;
    let tenant = fresh_tenant();
    let mut outcomes = Vec::new();
    for expire_first in [false, true] {
        if expire_first {
            sqlx::query(
                "UPDATE idempotency_records SET expires_at = ?4
                  WHERE tenant = ?1 AND scope = ?2 AND key = ?3",
            )
            .bind(&tenant)
            .bind("tx.charge_sqlite")
            .bind("k")
            .bind(LONG_AGO_MS)
            .execute(&pool)
            .await
            .expect("expire the record");
        }
        let mut tx = pool.begin().await.expect("begin");
        let (answer, outcome) = with_outcome(sqlite_charge_in(&mut tx, &tenant, "k")).await;
        assert_eq!(answer.expect("runs"), 500);
        outcomes.push(outcome);
        tx.commit().await.expect("commit");
    }
    assert_eq!(
        outcomes,
        [Some(Outcome::Executed), Some(Outcome::Executed)],
        "an expired record is not replayed"
    );
    drop(store);
}

#[idempotent(scope = "tx.charge_sqlite_amount", key = key, tenant = tenant, tx = tx, ttl = "1h")]
async fn sqlite_charge_amount_in(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    key: &str,
    amount: i64,
) -> Result<u64, Error> {
    sqlx::query("INSERT INTO idempotent_test_charges VALUES (?1, ?2, ?3)")
        .bind(tenant)
        .bind(key)
        .bind(amount)
        .execute(&mut **tx)
        .await
        .expect("write");
    Ok(amount.unsigned_abs())
}

/// Rules 7 and 20 on SQLite, in a caller's transaction: a record of *other
/// arguments* whose lease ran out (its owner crashed, in another process)
/// is refused as a mismatch, never taken over. In store mode, and in a
/// deferred transaction, a read answers the mismatch before any write; in a
/// transaction that holds the write lock (`BEGIN IMMEDIATE`, or a business
/// write first) the reservation's upsert answers, so its own condition must
/// refuse the takeover of another request's record.
#[tokio::test]
async fn sqlite_a_stuck_record_of_other_arguments_is_a_mismatch_in_a_transaction() {
    let (store, pool) = sqlite_with_charges("txstuck").await;
    let tenant = fresh_tenant();
    let stuck = Identity::new(&tenant, "tx.charge_sqlite_amount", "k").expect("identity");
    // Another request's reservation, by an owner that is not this process's.
    let other = idempotent_runtime::Fingerprint::from_stored(format!("v1:{}", "0".repeat(64)));
    let acquired = store
        .reserve(ReserveRequest {
            identity: &stuck,
            fingerprint: Some(&other),
            token: &OwnerToken::new(),
            lease: Duration::from_secs(3600),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(
        matches!(acquired, Reservation::Acquired { .. }),
        "{acquired:?}"
    );
    // Its lease ran out long ago (the database's clock; no sleeping).
    sqlx::query(
        "UPDATE idempotency_records SET lease_expires_at = ?4
          WHERE tenant = ?1 AND scope = ?2 AND key = ?3",
    )
    .bind(&tenant)
    .bind("tx.charge_sqlite_amount")
    .bind("k")
    .bind(LONG_AGO_MS)
    .execute(&pool)
    .await
    .expect("end the lease");
    let before = store.fetch(&stuck).await.expect("fetch").expect("stuck");

    // A deferred transaction (a read beside it answers), and one that holds
    // the write lock from the start (the upsert answers).
    for begin in ["BEGIN", "BEGIN IMMEDIATE"] {
        let mut tx = pool.begin_with(begin).await.expect("begin");
        let (refused, outcome) =
            with_outcome(sqlite_charge_amount_in(&mut tx, &tenant, "k", 500)).await;
        assert!(
            matches!(refused, Err(Error::FingerprintMismatch(_))),
            "a stuck record of other arguments, in a transaction begun with {begin}: {refused:?}"
        );
        assert_ne!(outcome, Some(Outcome::Executed), "the body ran ({begin})");
        tx.commit().await.expect("commit");
    }

    let after = store
        .fetch(&stuck)
        .await
        .expect("fetch")
        .expect("still there");
    assert_eq!(
        (
            after.state,
            &after.fingerprint,
            &after.owner_token,
            after.attempt
        ),
        (
            RecordState::InProgress,
            &before.fingerprint,
            &before.owner_token,
            before.attempt
        ),
        "the record is untouched"
    );
    let charges: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_test_charges WHERE tenant = ?1")
            .bind(&tenant)
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(charges, 0, "the body did not run");
}

// ---------------------------------------------------------------- a wait bound longer than lock_timeout allows

/// A long but valid wait bound (`wait("30days")`, accepted by the attribute)
/// in transactional mode on PostgreSQL: the engine passes the whole wait left
/// as the reservation's lock wait, which becomes `lock_timeout` in
/// milliseconds; PostgreSQL refuses more than 2^31 - 1 ms, so a fresh key's
/// reservation failed (and aborted the caller's transaction) until the store
/// capped the statement's lock wait there.
#[idempotent(scope = "tx.long_wait_bound", key = key, tenant = tenant, tx = tx,
             ttl = "1h", in_progress = wait("30days"))]
async fn pg_charge_long_wait(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    Ok(7)
}

#[tokio::test]
async fn pg_a_long_wait_bound_does_not_break_a_fresh_reservation_in_a_transaction() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let mut tx = store.pool().begin().await.expect("begin");
    let first = tokio::time::timeout(
        Duration::from_secs(30),
        pg_charge_long_wait(&mut tx, &tenant, "k-long-wait"),
    )
    .await
    .expect("answers");
    assert_eq!(first.expect("a fresh key is acquired and runs"), 7);
    tx.commit().await.expect("commit");
}

#[idempotent(scope = "tx.charge_sqlite_fails", key = key, tenant = tenant, tx = tx, ttl = "1h",
             skip(fail))]
async fn sqlite_charge_or_fail_in(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    key: &str,
    fail: bool,
) -> Result<u64, Error> {
    if fail {
        let down = idempotent_runtime::StoreError::new("ledger", "charge", "down");
        return Err(Error::Store(down));
    }
    Ok(500)
}

/// A body's released error in a transaction the caller then commits: the
/// reservation is deleted in that transaction, so the key is free at once
/// (a retry runs the body) and no record is left in progress for a lease.
#[tokio::test]
async fn sqlite_a_released_error_in_a_committed_transaction_frees_the_key() {
    let store = idempotent_runtime::SqliteStore::connect(&common::scratch::sqlite_url("txrel"))
        .await
        .expect("open");
    let pool = store.pool().clone();
    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, "tx.charge_sqlite_fails", "k").expect("identity");
    let mut tx = pool.begin().await.expect("begin");
    let (failed, outcome) =
        with_outcome(sqlite_charge_or_fail_in(&mut tx, &tenant, "k", true)).await;
    assert!(matches!(failed, Err(Error::Store(_))), "{failed:?}");
    assert_eq!(outcome, Some(Outcome::Executed));
    tx.commit().await.expect("commit");
    assert_eq!(store.fetch(&id).await.expect("fetch"), None, "released");

    let mut tx = pool.begin().await.expect("begin");
    let (again, outcome) =
        with_outcome(sqlite_charge_or_fail_in(&mut tx, &tenant, "k", false)).await;
    assert_eq!(again.expect("runs again"), 500);
    assert_eq!(outcome, Some(Outcome::Executed));
    tx.commit().await.expect("commit");
}

static HELD_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[idempotent(scope = "tx.held_answer", key = key, tenant = tenant, store = store, shared_scope,
             fingerprint = false, ttl = "1h", lease = "300ms")]
async fn held_in_store_mode(
    store: &idempotent_runtime::SqliteStore,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    HELD_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Ok(7)
}

#[idempotent(scope = "tx.held_answer", key = key, tenant = tenant, tx = tx, shared_scope,
             fingerprint = false, ttl = "1h", lease = "300ms")]
async fn held_in_tx(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    HELD_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Ok(7)
}

/// An answer this process produced in store mode and could not record (its
/// completion failed) is recorded by a transactional call that takes the
/// record over once the lease ran out: the body does not run a second time
/// (unrecorded.rs: whichever mode takes the record over).
#[tokio::test]
async fn sqlite_a_transactional_takeover_records_the_answer_this_process_holds() {
    let store = idempotent_runtime::SqliteStore::connect(&common::scratch::sqlite_url("txheld"))
        .await
        .expect("open");
    let pool = store.pool().clone();
    // The first attempt's completion fails; a takeover's (which has a
    // previous attempt) goes through.
    sqlx::query(
        "CREATE TRIGGER fail_first_completion BEFORE UPDATE ON idempotency_records
         WHEN NEW.state = 'complete' AND OLD.previous_attempt_started_at IS NULL
         BEGIN SELECT RAISE(ABORT, 'the store is down'); END",
    )
    .execute(&pool)
    .await
    .expect("trigger");
    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, "tx.held_answer", "k").expect("identity");
    let _ = held_in_store_mode(&store, &tenant, "k").await;
    assert_eq!(HELD_RUNS.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Bounded wait until the unrenewed lease has run out.
    let mut expired = false;
    for _ in 0..200 {
        let snapshot = store.fetch(&id).await.expect("fetch").expect("record");
        assert_eq!(snapshot.state, RecordState::InProgress, "not recorded");
        if snapshot.lease_expires_at_ms.expect("a lease") <= snapshot.now_ms {
            expired = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(expired, "the lease never ran out");
    let mut tx = pool.begin().await.expect("begin");
    let answer = held_in_tx(&mut tx, &tenant, "k").await;
    tx.commit().await.expect("commit");
    assert_eq!(answer.expect("the held answer"), 7);
    assert_eq!(
        HELD_RUNS.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the body ran again although this process held its answer"
    );
    let snapshot = store.fetch(&id).await.expect("fetch").expect("record");
    assert_eq!(snapshot.state, RecordState::Complete);
}
