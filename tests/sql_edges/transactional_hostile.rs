//! Transactional mode against what a body may do on the connection it is
//! given (DESIGN.md rule 15): change the session's state, which outlives the
//! call on a connection that goes back to a pool the store shares.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, mysql_url, pg_store_or_skip};
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Fenced, Identity, MySqlStore, Outcome, OwnerToken,
    Reservation, ReserveRequest, Store, StoredOutcome, TransactionalConnection,
};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, Postgres};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(3600);

fn request<'a>(identity: &'a Identity, token: &'a OwnerToken) -> ReserveRequest<'a> {
    ReserveRequest {
        identity,
        fingerprint: None,
        token,
        lease: LONG,
        ttl: LONG,
    }
}

/// A body that changes its session's state with `statement` (READ
/// UNCOMMITTED for the transactions after this one, a reporting query's
/// habit; `EMPTY_STRING_IS_NULL`, an Oracle-compatibility one): the state
/// outlives the call on the connection, which goes back to its pool.
#[idempotent(scope = "tx_hostile.leaves_state", key = key, tenant = tenant, tx = tx,
             skip(statement))]
async fn leaves_session_state(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    statement: &str,
) -> Result<u64, Error> {
    sqlx::query(statement)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("mysql", "body", e)))?;
    Ok(1)
}

/// A pool of one connection, and a store opened on it: what a body leaves
/// on the connection, the store's next call meets.
async fn one_connection_shared_with_a_store() -> (sqlx::MySqlPool, MySqlStore) {
    let shared = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(shared.clone()).await.expect("store");
    (shared, store)
}

/// Rules 5 and 15 on MariaDB: a transactional body on a connection of the
/// pool the store shares turned its session to READ UNCOMMITTED, and went
/// back to the pool. A store-mode duplicate of a key whose transactional
/// owner has recorded its result but not committed must not replay that
/// result on that session: the owner then rolls back, the key runs again,
/// and the duplicate would have answered with a result that never existed.
/// (The store refuses a READ UNCOMMITTED pool when it opens; a session
/// changed later went unseen, and its plain read replayed the uncommitted
/// result.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_session_turned_to_read_uncommitted_never_replays_an_uncommitted_result() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let (shared, store) = one_connection_shared_with_a_store().await;
    let tenant = fresh_tenant();
    let mut tx = shared.begin().await.expect("begin");
    assert_eq!(
        leaves_session_state(
            &mut tx,
            &tenant,
            "report",
            "SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED"
        )
        .await
        .expect("the body ran"),
        1
    );
    tx.commit().await.expect("commit");

    let identity = Identity::new(&tenant, "tx_hostile.owner", "k").expect("identity");
    let owner_token = OwnerToken::new();
    let mut owner = admin.pool().begin().await.expect("begin");
    let acquired = owner
        .reserve_in_transaction(request(&identity, &owner_token), Duration::from_secs(1))
        .await
        .expect("reserve");
    assert!(
        matches!(acquired, Reservation::Acquired { .. }),
        "{acquired:?}"
    );
    let uncommitted = StoredOutcome {
        is_error: false,
        payload: b"7".to_vec(),
    };
    assert_eq!(
        owner
            .complete_in_transaction(Completion::by_body(
                &identity,
                &owner_token,
                &uncommitted,
                LONG
            ))
            .await
            .expect("complete"),
        Fenced::Written
    );

    let duplicate = store.reserve(request(&identity, &OwnerToken::new())).await;
    owner.rollback().await.expect("rollback");
    assert!(
        admin.fetch(&identity).await.expect("fetch").is_none(),
        "the owner's result was never committed"
    );
    assert!(
        !matches!(duplicate, Ok(Reservation::Completed(_))),
        "the duplicate replayed a result its owner then rolled back: {duplicate:?}"
    );
    assert!(
        matches!(&duplicate, Err(e) if e.to_string().contains("READ UNCOMMITTED")),
        "the session is refused, saying why: {duplicate:?}"
    );
}

/// A body that tries something in a nested transaction of its own (a
/// savepoint), where a statement fails (on PostgreSQL that aborts the
/// savepoint's work), and drops the nested transaction without rolling it
/// back by hand, as an early return does: sqlx sends the `ROLLBACK TO
/// SAVEPOINT` before the connection's next statement. The body then answers.
#[idempotent(scope = "tx_hostile.pg_savepoint", key = key, tenant = tenant, tx = tx, skip(runs))]
async fn pg_gives_up_a_savepoint(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    let store_error = |e| Error::Store(idempotent_runtime::StoreError::new("postgres", "body", e));
    runs.fetch_add(1, Ordering::SeqCst);
    let mut attempt = sqlx::Connection::begin(&mut **tx)
        .await
        .map_err(store_error)?;
    let failed = sqlx::query("SELECT 1 / 0").execute(&mut *attempt).await;
    assert!(failed.is_err(), "division by zero fails");
    drop(attempt);
    Ok(7)
}

/// Rules 12 and 15 on PostgreSQL: a failed statement inside the body's own
/// savepoint, given up by dropping it, leaves the caller's transaction and
/// the reservation in it usable: the answer is recorded with the caller's
/// commit (not a store failure because the transaction looked aborted), and
/// the retry replays it without running the body.
#[tokio::test]
async fn pg_a_savepoint_the_body_gives_up_keeps_the_reservation() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let (tenant, runs) = (fresh_tenant(), AtomicUsize::new(0));
    for (round, expected) in [(1, Some(Outcome::Executed)), (2, Some(Outcome::Replayed))] {
        let mut tx = store.pool().begin().await.expect("begin");
        let (answer, outcome) =
            with_outcome(pg_gives_up_a_savepoint(&mut tx, &tenant, "k", &runs)).await;
        assert_eq!(answer.expect("answered"), 7, "round {round}");
        assert_eq!(outcome, expected, "round {round}");
        tx.commit().await.expect("commit");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
}

/// Rules 9, 10 and 12 on MariaDB, the shared tenant (an empty string): a
/// store-mode owner whose completion lands on a session of the shared pool
/// that a transactional body turned to `EMPTY_STRING_IS_NULL` meanwhile.
/// The completion's `WHERE tenant = ''` then matches nothing, so the store
/// answered `NotOwner` (`Error::LeaseLost` to the caller: "another caller
/// took the record over") although nobody did: the record stays in progress
/// with the owner's token, nothing renews it, and once its lease runs out the
/// next caller takes it over and runs the body a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_completion_on_a_session_turned_to_empty_string_is_null_is_not_lease_lost() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let (shared, store) = one_connection_shared_with_a_store().await;
    let identity = Identity::shared("tx_hostile.shared_owner", format!("k-{}", fresh_tenant()))
        .expect("identity");
    let token = OwnerToken::new();
    let acquired = store
        .reserve(request(&identity, &token))
        .await
        .expect("reserve");
    assert!(
        matches!(acquired, Reservation::Acquired { .. }),
        "{acquired:?}"
    );

    let mut tx = shared.begin().await.expect("begin");
    assert_eq!(
        leaves_session_state(
            &mut tx,
            &fresh_tenant(),
            "mode",
            "SET SESSION sql_mode = CONCAT(@@sql_mode, ',EMPTY_STRING_IS_NULL')"
        )
        .await
        .expect("the body ran"),
        1
    );
    tx.commit().await.expect("commit");

    assert_eq!(
        store
            .heartbeat(&identity, &token, LONG)
            .await
            .expect("heartbeat"),
        Fenced::Written,
        "the renewal found the owner's record"
    );
    let answer = StoredOutcome {
        is_error: false,
        payload: b"7".to_vec(),
    };
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &token, &answer, LONG))
            .await
            .expect("complete"),
        Fenced::Written,
        "the completion found the owner's record"
    );
    assert_eq!(
        admin
            .reserve(request(&identity, &OwnerToken::new()))
            .await
            .expect("reserve"),
        Reservation::Completed(answer),
        "a retry replays the answer"
    );
}

/// A transactional body of the shared tenant that turns its own session to
/// `EMPTY_STRING_IS_NULL`, then answers.
#[idempotent(scope = "tx_hostile.empty_is_null_shared", key = key, tenant = shared, tx = conn)]
async fn shared_turns_empty_strings_to_null(
    conn: &mut sqlx::MySqlConnection,
    key: &str,
) -> Result<u64, Error> {
    sqlx::query("SET SESSION sql_mode = CONCAT(@@sql_mode, ',EMPTY_STRING_IS_NULL')")
        .execute(&mut *conn)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("mysql", "body", e)))?;
    Ok(1)
}

/// Rules 12 and 15 on MariaDB: the same in transactional mode. The body's
/// own session change made the completion in its transaction miss the
/// record the transaction holds, and the caller was told `LeaseLost`
/// ("another caller took the record over") while its reservation stayed in
/// progress in its transaction; committed, it kept the key in progress for a
/// lease, and the next caller then took it over and ran the body again. The
/// answer is recorded now, and a retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_shared_tenant_body_that_turns_empty_strings_to_null_is_recorded() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let mut conn = <sqlx::MySqlConnection as sqlx::Connection>::connect(&mysql_url())
        .await
        .expect("connect");
    let key = format!("k-{}", fresh_tenant());
    let mut tx = sqlx::Connection::begin(&mut conn).await.expect("begin");
    let answer = shared_turns_empty_strings_to_null(&mut tx, &key).await;
    tx.commit().await.expect("commit");
    assert_eq!(answer.expect("the body's answer"), 1);
    let identity =
        Identity::shared("tx_hostile.empty_is_null_shared", key.as_str()).expect("identity");
    let replayed = admin
        .reserve(request(&identity, &OwnerToken::new()))
        .await
        .expect("reserve");
    assert!(
        matches!(replayed, Reservation::Completed(_)),
        "a retry replays: {replayed:?}"
    );
}
