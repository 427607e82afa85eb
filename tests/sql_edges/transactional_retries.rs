//! Transactional mode (DESIGN.md rules 10 and 15) under a caller that goes on
//! calling in the same transaction after a refusal, on PostgreSQL, beside a
//! store-mode owner that is alive and renewing.
//!
//! On MariaDB a transaction that met an owner's late renewal keeps the row
//! lock its look took (InnoDB keeps the locks of a failed write until the
//! transaction ends), the owner cannot renew, its lease runs out, and the
//! next call in the same transaction takes it over beside the live owner
//! (`mysql_edges`). On PostgreSQL every answer other than "acquired" undoes
//! the reservation's subtransaction and its locks (migrations 0006 and
//! 0007), also when the caller's own savepoint is open around the call or
//! rolled back between calls. These tests pin that down at every isolation
//! level: the owner's renewal meets the caller's look mid-takeover (a
//! deterministic handshake: the renewal holds the row until the caller's
//! takeover is seen waiting for it), then the caller calls again and again,
//! and the owner renews each time without waiting; the caller never takes
//! the record over while the owner is alive.

use crate::common::servers::{fresh_tenant, pg_store_or_skip, pg_url};
use idempotent_runtime::{
    Error, Fenced, Identity, OwnerToken, PgStore, Reservation, ReserveRequest, Store,
    TransactionalConnection,
};
use sqlx::Connection;
use std::str::FromStr;
use std::time::Duration;

const HOUR: Duration = Duration::from_secs(3600);

/// The owner's lease while it is "paused" (its renewal is late), and after.
const SHORT: Duration = Duration::from_millis(300);

/// A store whose statements wait at most 3 s for a row lock: a renewal the
/// caller's transaction blocks fails instead of hanging (a guard against a
/// hang, not a timing assertion: nothing the test waits for takes that long
/// unless it is blocked).
async fn guarded_store() -> PgStore {
    let options = sqlx::postgres::PgConnectOptions::from_str(&pg_url())
        .expect("url")
        .options([("lock_timeout", "3s")]);
    PgStore::from_pool(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .expect("guarded pool"),
    )
    .await
    .expect("guarded store")
}

async fn connection_and_pid() -> (sqlx::PgConnection, i32) {
    let mut conn = sqlx::PgConnection::connect(&pg_url())
        .await
        .expect("connect");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .expect("pid");
    (conn, pid)
}

/// Until the record's lease is over on the database clock.
async fn until_the_lease_is_over(store: &PgStore, identity: &Identity) {
    for _ in 0..3000 {
        let s = store.fetch(identity).await.expect("fetch").expect("record");
        if s.lease_expires_at_ms.is_some_and(|l| l <= s.now_ms) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the lease never ran out");
}

/// Until `waiter` waits for a lock `holder` holds.
async fn until_blocked(monitor: &mut sqlx::PgConnection, waiter: i32, holder: i32) {
    for _ in 0..6000 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND $2 = ANY(pg_blocking_pids(pid))",
        )
        .bind(waiter)
        .bind(holder)
        .fetch_one(&mut *monitor)
        .await
        .expect("pg_stat_activity");
        if n > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{waiter} never waited for {holder}");
}

fn request<'a>(identity: &'a Identity, token: &'a OwnerToken) -> ReserveRequest<'a> {
    ReserveRequest {
        identity,
        fingerprint: None,
        token,
        lease: HOUR,
        ttl: HOUR,
    }
}

/// Whether nobody holds the record's row: a lock taken with NOWAIT in a
/// transaction of its own, then given back.
async fn row_is_free(monitor: &mut sqlx::PgConnection, identity: &Identity) -> bool {
    let mut tx = monitor.begin().await.expect("begin");
    let locked = sqlx::query(
        "SELECT 1 FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3
            FOR UPDATE NOWAIT",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .fetch_optional(&mut *tx)
    .await;
    tx.rollback().await.expect("rollback");
    match locked {
        Ok(row) => row.is_some(),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => false,
        Err(e) => panic!("NOWAIT look: {e}"),
    }
}

/// What a refusal in the caller's transaction may be at `begin`'s level:
/// `InProgress` under READ COMMITTED (every statement sees the renewal),
/// `StaleSnapshot` under REPEATABLE READ and SERIALIZABLE (the renewal is
/// newer than the snapshot).
fn refused(begin: &str, answer: &Result<Reservation, Error>) -> bool {
    if begin.contains("READ COMMITTED") {
        matches!(answer, Ok(Reservation::InProgress { .. }))
    } else {
        matches!(
            answer,
            Err(Error::StaleSnapshot {
                store: "postgres",
                ..
            })
        )
    }
}

/// The owner (`owner`, a store-mode reservation) is paused past its lease;
/// its late renewal holds the row (uncommitted) while the caller's
/// transaction, begun with `begin` and having read before, tries to take the
/// record over and waits for the row; the renewal commits. The caller is
/// refused; then it goes on calling in the same transaction (in the outer
/// transaction after rolling back its savepoint, when `savepoint`), the
/// owner renewing between the calls. Each renewal is written at once, and no
/// call takes the record over. Only once the owner has stopped renewing
/// (crashed) is it taken over, and only where the caller's snapshot can see
/// that (READ COMMITTED); elsewhere a new transaction does.
async fn calls_again_beside_a_live_owner(begin: &'static str, savepoint: bool) {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let guarded = guarded_store().await;
    let identity =
        Identity::new(fresh_tenant(), "tx_retries.pg_live_owner", "k").expect("identity");
    let owner = crate::common::records::acquire(&store, &identity, None, SHORT, HOUR).await;
    until_the_lease_is_over(&store, &identity).await;

    let (mut caller, caller_pid) = connection_and_pid().await;
    sqlx::query(begin)
        .execute(&mut caller)
        .await
        .expect("begin");
    sqlx::query("SELECT count(*) FROM idempotency_records")
        .execute(&mut caller)
        .await
        .expect("the caller's transaction reads (its snapshot, where it keeps one)");
    if savepoint {
        sqlx::query("SAVEPOINT retry")
            .execute(&mut caller)
            .await
            .expect("savepoint");
    }

    // The owner's late renewal, in flight: it holds the row.
    let (mut renewal, renewal_pid) = connection_and_pid().await;
    sqlx::query("BEGIN")
        .execute(&mut renewal)
        .await
        .expect("begin");
    let renewed: u64 = sqlx::query(
        "UPDATE idempotency_records SET lease_expires_at = idempotency_now_ms() + 3600000,
                updated_at = idempotency_now_ms()
          WHERE tenant = $1 AND scope = $2 AND key = $3 AND owner_token = $4",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .bind(owner.as_str())
    .execute(&mut renewal)
    .await
    .expect("renew")
    .rows_affected();
    assert_eq!(renewed, 1, "the owner still owns its record");

    let calling = {
        let identity = identity.clone();
        tokio::spawn(async move {
            let token = OwnerToken::new();
            let answer = caller
                .reserve_in_transaction(request(&identity, &token), Duration::from_secs(30))
                .await;
            (caller, answer)
        })
    };
    let (mut monitor, _) = connection_and_pid().await;
    until_blocked(&mut monitor, caller_pid, renewal_pid).await;
    sqlx::query("COMMIT")
        .execute(&mut renewal)
        .await
        .expect("the renewal commits");
    let (mut caller, answer) = tokio::time::timeout(Duration::from_secs(30), calling)
        .await
        .expect("the caller answers")
        .expect("task");
    assert!(refused(begin, &answer), "{begin}: {answer:?}");

    for round in 0..3 {
        assert!(
            row_is_free(&mut monitor, &identity).await,
            "{begin}, round {round}: the refused caller keeps the owner's row locked"
        );
        let renewed = guarded.heartbeat(&identity, &owner, SHORT * 2).await;
        assert!(
            matches!(renewed, Ok(Fenced::Written)),
            "{begin}, round {round}: the live owner's renewal: {renewed:?}"
        );
        if savepoint {
            sqlx::query("ROLLBACK TO SAVEPOINT retry")
                .execute(&mut caller)
                .await
                .expect("rollback to the savepoint");
        }
        let token = OwnerToken::new();
        let answer = caller
            .reserve_in_transaction(request(&identity, &token), Duration::from_millis(200))
            .await;
        assert!(
            !matches!(answer, Ok(Reservation::Acquired { .. })),
            "{begin}, round {round}: the caller took over a live owner: {answer:?}"
        );
        if begin.contains("READ COMMITTED") {
            assert!(
                matches!(answer, Ok(Reservation::InProgress { .. })),
                "{begin}, round {round}: {answer:?}"
            );
        } else {
            assert!(
                refused(begin, &answer),
                "{begin}, round {round}: {answer:?}"
            );
        }
    }
    assert!(
        row_is_free(&mut monitor, &identity).await,
        "{begin}: the refused caller keeps the owner's row locked"
    );

    // The owner crashes: its lease runs out with nobody renewing it.
    until_the_lease_is_over(&store, &identity).await;
    let token = OwnerToken::new();
    let answer = caller
        .reserve_in_transaction(request(&identity, &token), Duration::from_millis(200))
        .await;
    if begin.contains("READ COMMITTED") {
        assert!(
            matches!(
                answer,
                Ok(Reservation::Acquired {
                    took_over: true,
                    ..
                })
            ),
            "{begin}: a crashed owner is taken over (rule 10): {answer:?}"
        );
    } else {
        assert!(
            refused(begin, &answer),
            "{begin}: the snapshot cannot take over a record renewed since: {answer:?}"
        );
        sqlx::query("ROLLBACK")
            .execute(&mut caller)
            .await
            .expect("rollback");
        sqlx::query(begin)
            .execute(&mut caller)
            .await
            .expect("begin anew");
        let answer = caller
            .reserve_in_transaction(request(&identity, &token), Duration::from_millis(200))
            .await;
        assert!(
            matches!(
                answer,
                Ok(Reservation::Acquired {
                    took_over: true,
                    ..
                })
            ),
            "{begin}: a new transaction takes the crashed owner over (rule 10): {answer:?}"
        );
    }
    sqlx::query("ROLLBACK")
        .execute(&mut caller)
        .await
        .expect("rollback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_read_committed_calling_again_never_starves_a_live_owner() {
    calls_again_beside_a_live_owner("BEGIN ISOLATION LEVEL READ COMMITTED", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_repeatable_read_calling_again_after_stale_snapshot_never_starves_a_live_owner() {
    calls_again_beside_a_live_owner("BEGIN ISOLATION LEVEL REPEATABLE READ", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_serializable_calling_again_after_stale_snapshot_never_starves_a_live_owner() {
    calls_again_beside_a_live_owner("BEGIN ISOLATION LEVEL SERIALIZABLE", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_retry_loop_at_a_savepoint_never_starves_a_live_owner_at_any_level() {
    for begin in [
        "BEGIN ISOLATION LEVEL READ COMMITTED",
        "BEGIN ISOLATION LEVEL REPEATABLE READ",
        "BEGIN ISOLATION LEVEL SERIALIZABLE",
    ] {
        calls_again_beside_a_live_owner(begin, true).await;
    }
}
