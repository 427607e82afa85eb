//! MariaDB/MySQL at the edges of the locking rules (DESIGN.md rules 3, 10, 15, 16).
//!
//! * An expired record whose row lock is released to eight waiting callers at
//!   once is acquired by exactly one of them, whether they reserve through the
//!   store, inside transactions, or through `reserve_in_transaction` on an
//!   autocommit connection (every write of the procedure is fenced).
//! * A replay, a mismatch or an in-progress answer inside an open transaction
//!   holds no lock that makes the record look in progress to anyone else, even
//!   when the transaction's snapshot is older than the record.
//! * When a transactional owner rolls back, exactly one of its waiting
//!   duplicates takes the key; none dies of a deadlock (1213), and every
//!   waiter's own earlier writes survive.
//! * A row held by an open transaction never stalls the purge of the others.
//!
//! Where a test waits on a lock it waits for the server to *show* the waiters
//! (`information_schema.PROCESSLIST`), never for a sleep. Stores
//! whose sessions wait at most a few seconds for a row lock turn a lock that
//! should not be there into a quick failure instead of a 50 s hang; nothing
//! asserts how long anything took.

use crate::common;

use common::servers::{
    fresh_tenant, mysql_create_database, mysql_drop_then_check, mysql_store_or_skip, mysql_url,
    mysql_url_of,
};
use idempotent_runtime::TransactionalConnection;
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Fenced, Fingerprint, Identity, MySqlStore,
    Outcome, OwnerToken, Reservation, ReserveRequest, Store, StoredOutcome,
};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::{Executor, MySql};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

const LONG: Duration = Duration::from_secs(3600);
/// How long a guarded session waits for a row lock before failing (a guard
/// against hangs, not a timing assertion).
const GUARD_S: u64 = 3;
/// The lock wait given to transactional reservations that must wait.
const WAIT: Duration = Duration::from_secs(30);

fn fp(value: &str) -> Fingerprint {
    Fingerprint::of(value).expect("fingerprint")
}

fn ok(payload: &[u8]) -> StoredOutcome {
    StoredOutcome {
        is_error: false,
        payload: payload.to_vec(),
    }
}

fn request<'a>(
    identity: &'a Identity,
    fingerprint: Option<&'a Fingerprint>,
    token: &'a OwnerToken,
    lease: Duration,
    ttl: Duration,
) -> ReserveRequest<'a> {
    ReserveRequest {
        identity,
        fingerprint,
        token,
        lease,
        ttl,
    }
}

/// A pool whose sessions wait at most `GUARD_S` seconds for a row lock.
async fn guarded_pool(max_connections: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(format!("SET SESSION innodb_lock_wait_timeout = {GUARD_S}").as_str())
                    .await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("guarded pool")
}

/// A store on a [`guarded_pool`].
async fn guarded_store(max_connections: u32) -> MySqlStore {
    MySqlStore::from_pool(guarded_pool(max_connections).await)
        .await
        .expect("guarded store")
}

async fn connection_id<'e, E: Executor<'e, Database = MySql>>(executor: E) -> u64 {
    sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(executor)
        .await
        .expect("connection id")
}

/// How many of the sessions `ids` are waiting on a lock: a user-level lock
/// (`GET_LOCK`), or a statement on the records table that has been running
/// for 100 ms or more (a primary-key statement that takes that long is
/// waiting on a row lock). (`INNODB_TRX` is no help: MariaDB leaves out some
/// transactions waiting on a lock before their first write.)
async fn waiting(admin: &MySqlPool, ids: &[u64]) -> usize {
    let list = ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let query = |elapsed: &str| {
        format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.PROCESSLIST
              WHERE ID IN ({list})
                AND (STATE = 'User lock'
                     OR (INFO LIKE '%idempotency_records%' AND {elapsed}))"
        )
    };
    // MariaDB has TIME_MS; MySQL only whole seconds.
    let n: Result<i64, sqlx::Error> = sqlx::query_scalar(&query("TIME_MS >= 100"))
        .fetch_one(admin)
        .await;
    let n = match n {
        Ok(n) => n,
        Err(_) => sqlx::query_scalar(&query("TIME >= 1"))
            .fetch_one(admin)
            .await
            .expect("processlist"),
    };
    n as usize
}

/// Waits (bounded) until every session in `ids` is waiting on a lock or its
/// task has finished (`finished` counts those).
async fn until_all_wait_or_finish(admin: &MySqlPool, ids: &[u64], finished: &AtomicUsize) {
    for _ in 0..3000 {
        // Read `finished` first: a task counted here has left its lock wait,
        // so it cannot be counted twice.
        let done = finished.load(Ordering::SeqCst);
        if done + waiting(admin, ids).await >= ids.len() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the callers did not all reach their lock waits");
}

/// Polls the store's clock until `check` holds for the record (bounded).
async fn until_clock(
    store: &MySqlStore,
    identity: &Identity,
    check: impl Fn(&idempotent_runtime::RecordSnapshot) -> bool,
) {
    for _ in 0..1000 {
        let snap = store
            .fetch(identity)
            .await
            .expect("fetch")
            .expect("present");
        if check(&snap) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the database clock did not pass the planted expiry");
}

// ---------------------------------------------------------------- rule 3 / 10: fenced writes

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// `Store::reserve` (the procedure in its own transaction).
    Store,
    /// `reserve_in_transaction` on a connection in autocommit mode: the
    /// procedure's statements each commit on their own.
    Autocommit,
    /// `reserve_in_transaction` inside a transaction, committed right after.
    Transaction,
}

/// Eight callers on autocommit connections: each statement of the procedure
/// commits on its own, so only fenced writes keep them from all acquiring.
const AUTOCOMMIT: [Via; 8] = [Via::Autocommit; 8];
/// Every way in, interleaved.
const MIXED: [Via; 8] = [
    Via::Autocommit,
    Via::Store,
    Via::Transaction,
    Via::Autocommit,
    Via::Store,
    Via::Transaction,
    Via::Autocommit,
    Via::Transaction,
];

/// An expired record (or an in-progress one whose lease ran out) is held by
/// another transaction's row lock while eight callers line up behind it, one
/// at a time in the order given; the lock is released with all of them
/// waiting (a store caller may have answered `InProgress` by then: it waits
/// at most 1 s). Exactly one acquires.
async fn released_to_eight_callers(lease_expired: bool, callers: [Via; 8]) {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let admin = store.pool().clone();
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "mysql_edges.fence", "k").expect("identity");
    let f = fp("same");
    let planted = OwnerToken::new();
    if lease_expired {
        let short = Duration::from_millis(1);
        let got = store
            .reserve(request(&identity, Some(&f), &planted, short, LONG))
            .await
            .expect("plant");
        assert_eq!(got, Reservation::FRESH);
        until_clock(&store, &identity, |s| {
            s.lease_expires_at_ms.is_some_and(|l| l <= s.now_ms)
        })
        .await;
    } else {
        let got = store
            .reserve(request(&identity, Some(&f), &planted, LONG, LONG))
            .await
            .expect("plant");
        assert_eq!(got, Reservation::FRESH);
        // Kept for a second, so the holder can lock it before it expires:
        // once expired, another test's purge of the shared table may delete
        // it first (a purge skips rows that are locked).
        assert_eq!(
            store
                .complete(Completion::by_body(
                    &identity,
                    &planted,
                    &ok(b"1"),
                    Duration::from_secs(1)
                ))
                .await
                .expect("complete"),
            Fenced::Written
        );
    }

    let mut holder = admin.begin().await.expect("holder");
    sqlx::query(
        "SELECT state FROM idempotency_records WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .fetch_one(&mut *holder)
    .await
    .expect("the holder locks the row");
    if !lease_expired {
        until_clock(&store, &identity, |s| s.is_expired()).await;
    }

    let finished = Arc::new(AtomicUsize::new(0));
    let mut ids = Vec::new();
    let mut tasks = Vec::new();
    for via in callers {
        let (identity, f, done) = (identity.clone(), f.clone(), finished.clone());
        let token = OwnerToken::new();
        match via {
            Via::Store => {
                let pool = MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&mysql_url())
                    .await
                    .expect("pool of one");
                let own = MySqlStore::from_pool(pool).await.expect("store");
                ids.push(connection_id(own.pool()).await);
                tasks.push(tokio::spawn(async move {
                    let got = own
                        .reserve(request(&identity, Some(&f), &token, LONG, LONG))
                        .await
                        .expect("reserve through the store");
                    done.fetch_add(1, Ordering::SeqCst);
                    (via, token, got)
                }));
            }
            Via::Autocommit => {
                let mut conn = admin.acquire().await.expect("connection");
                ids.push(connection_id(&mut *conn).await);
                tasks.push(tokio::spawn(async move {
                    let got = conn
                        .reserve_in_transaction(
                            request(&identity, Some(&f), &token, LONG, LONG),
                            WAIT,
                        )
                        .await
                        .expect("reserve on an autocommit connection");
                    done.fetch_add(1, Ordering::SeqCst);
                    (via, token, got)
                }));
            }
            Via::Transaction => {
                let mut tx = admin.begin().await.expect("begin");
                ids.push(connection_id(&mut *tx).await);
                tasks.push(tokio::spawn(async move {
                    let got = match tx
                        .reserve_in_transaction(
                            request(&identity, Some(&f), &token, LONG, LONG),
                            WAIT,
                        )
                        .await
                    {
                        Ok(got) => got,
                        // Behind the winner, its fenced write locked the
                        // winner's in-progress record: refused, as a
                        // transaction that must end (not acquiring).
                        Err(Error::StaleSnapshot { .. }) => Reservation::InProgress {
                            lease_remaining: Duration::ZERO,
                        },
                        Err(e) => panic!("reserve in a transaction: {e:?}"),
                    };
                    tx.commit().await.expect("commit");
                    done.fetch_add(1, Ordering::SeqCst);
                    (via, token, got)
                }));
            }
        }
        // One at a time, so they queue on the lock in this order.
        until_all_wait_or_finish(&admin, &ids, &finished).await;
    }
    holder.commit().await.expect("the holder lets go");

    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("caller"));
    }
    let winners: Vec<_> = answers
        .iter()
        .filter(|(_, _, got)| matches!(got, Reservation::Acquired { .. }))
        .collect();
    assert_eq!(
        winners.len(),
        1,
        "exactly one caller acquires the released record: {answers:?}"
    );
    assert!(
        matches!(
            winners[0].2,
            Reservation::Acquired { took_over, attempt, .. }
                if took_over == lease_expired && attempt == if lease_expired { 2 } else { 1 }
        ),
        "{:?}",
        winners[0].2
    );
    for (via, _, got) in &answers {
        assert!(
            matches!(
                got,
                Reservation::Acquired { .. } | Reservation::InProgress { .. }
            ),
            "{via:?}: {got:?}"
        );
    }
    let snap = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(snap.owner_token.as_deref(), Some(winners[0].1.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_record_released_to_eight_callers_is_acquired_once() {
    released_to_eight_callers(false, AUTOCOMMIT).await;
    released_to_eight_callers(false, MIXED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_lease_released_to_eight_callers_is_taken_over_once() {
    released_to_eight_callers(true, AUTOCOMMIT).await;
    released_to_eight_callers(true, MIXED).await;
}

// ---------------------------------------------------------------- rule 15: answers take no lock

/// Reserves in `tx` with a fresh token and a long lease and ttl.
async fn in_tx(
    tx: &mut sqlx::Transaction<'_, MySql>,
    identity: &Identity,
    fingerprint: Option<&Fingerprint>,
    lock_wait: Duration,
) -> Reservation {
    let token = OwnerToken::new();
    tx.reserve_in_transaction(
        request(identity, fingerprint, &token, LONG, LONG),
        lock_wait,
    )
    .await
    .expect("reserve in a transaction")
}

/// With the transactions in `open` still open, a caller through a store and
/// one in a fresh transaction replay `payload` at once (their sessions would
/// fail after `GUARD_S` seconds on a row lock).
async fn others_replay(
    guarded: &MySqlStore,
    identity: &Identity,
    fingerprint: &Fingerprint,
    payload: &[u8],
) {
    let token = OwnerToken::new();
    let through_store = guarded
        .reserve(request(identity, Some(fingerprint), &token, LONG, LONG))
        .await
        .expect("reserve through the store");
    assert_eq!(
        through_store,
        Reservation::Completed(ok(payload)),
        "through the store"
    );
    let mut other = guarded.pool().begin().await.expect("begin");
    let in_other = in_tx(&mut other, identity, Some(fingerprint), WAIT).await;
    other.rollback().await.expect("rollback");
    assert_eq!(
        in_other,
        Reservation::Completed(ok(payload)),
        "in another transaction"
    );
}

#[tokio::test]
async fn a_replay_or_mismatch_inside_an_open_transaction_takes_no_lock() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let guarded = guarded_store(4).await;
    let identity = Identity::new(fresh_tenant(), "mysql_edges.answers", "k").expect("identity");
    let (a, b) = (fp("a"), fp("b"));
    let token = OwnerToken::new();
    let got = store
        .reserve(request(&identity, Some(&a), &token, LONG, LONG))
        .await
        .expect("reserve");
    assert_eq!(got, Reservation::FRESH);
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );

    let mut replaying = store.pool().begin().await.expect("begin");
    assert_eq!(
        in_tx(&mut replaying, &identity, Some(&a), WAIT).await,
        Reservation::Completed(ok(b"7"))
    );
    let mut mismatching = store.pool().begin().await.expect("begin");
    assert_eq!(
        in_tx(&mut mismatching, &identity, Some(&b), WAIT).await,
        Reservation::FingerprintMismatch
    );
    // Both transactions are still open.
    others_replay(&guarded, &identity, &a, b"7").await;
    let token = OwnerToken::new();
    assert_eq!(
        guarded
            .reserve(request(&identity, Some(&b), &token, LONG, LONG))
            .await
            .expect("reserve"),
        Reservation::FingerprintMismatch
    );
    replaying.commit().await.expect("commit");
    mismatching.commit().await.expect("commit");
}

#[tokio::test]
async fn an_in_progress_answer_inside_an_open_transaction_takes_no_lock() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let guarded = guarded_store(4).await;
    let identity = Identity::new(fresh_tenant(), "mysql_edges.answers", "k").expect("identity");
    let (a, b) = (fp("a"), fp("b"));
    let owner = OwnerToken::new();
    let got = store
        .reserve(request(&identity, Some(&a), &owner, LONG, LONG))
        .await
        .expect("reserve");
    assert_eq!(got, Reservation::FRESH);

    let mut refused = store.pool().begin().await.expect("begin");
    assert!(matches!(
        in_tx(&mut refused, &identity, Some(&a), Duration::ZERO).await,
        Reservation::InProgress { .. }
    ));
    let mut mismatching = store.pool().begin().await.expect("begin");
    assert_eq!(
        in_tx(&mut mismatching, &identity, Some(&b), Duration::ZERO).await,
        Reservation::FingerprintMismatch
    );
    // With both transactions open, the owner renews and completes (its
    // session would fail on a row lock after GUARD_S seconds) and the
    // others replay.
    assert_eq!(
        guarded
            .heartbeat(&identity, &owner, LONG)
            .await
            .expect("heartbeat"),
        Fenced::Written
    );
    assert_eq!(
        guarded
            .complete(Completion::by_body(&identity, &owner, &ok(b"8"), LONG))
            .await
            .expect("the owner completes while the duplicates' transactions are open"),
        Fenced::Written
    );
    others_replay(&guarded, &identity, &a, b"8").await;
    refused.commit().await.expect("commit");
    mismatching.commit().await.expect("commit");
}

/// A consistent read that fixes the transaction's REPEATABLE READ snapshot.
async fn snapshot_now(tx: &mut sqlx::Transaction<'_, MySql>, tenant: &str) {
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records WHERE tenant = ?")
        .bind(tenant)
        .fetch_one(&mut **tx)
        .await
        .expect("a consistent read");
    assert_eq!(n, 0);
}

/// The caller's REPEATABLE READ snapshot is older than the record: its plain
/// read sees nothing, the insert meets the committed record. The answer is
/// still right, and what it holds does not make the record look in progress.
#[tokio::test]
async fn a_snapshot_older_than_the_record_still_replays_and_blocks_no_one() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let guarded = guarded_store(4).await;
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "mysql_edges.snapshot", "k").expect("identity");
    let (a, b) = (fp("a"), fp("b"));
    let mut stale_same = store.pool().begin().await.expect("begin");
    snapshot_now(&mut stale_same, &tenant).await;
    let mut stale_other = store.pool().begin().await.expect("begin");
    snapshot_now(&mut stale_other, &tenant).await;
    let mut stale_third = store.pool().begin().await.expect("begin");
    snapshot_now(&mut stale_third, &tenant).await;

    let token = OwnerToken::new();
    let got = store
        .reserve(request(&identity, Some(&a), &token, LONG, LONG))
        .await
        .expect("reserve");
    assert_eq!(got, Reservation::FRESH);
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &token, &ok(b"9"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );

    assert_eq!(
        in_tx(&mut stale_same, &identity, Some(&a), WAIT).await,
        Reservation::Completed(ok(b"9")),
        "a stale snapshot still replays the committed record"
    );
    assert_eq!(
        in_tx(&mut stale_other, &identity, Some(&b), WAIT).await,
        Reservation::FingerprintMismatch,
        "and still sees the mismatch"
    );
    others_replay(&guarded, &identity, &a, b"9").await;
    assert_eq!(
        in_tx(&mut stale_third, &identity, Some(&a), WAIT).await,
        Reservation::Completed(ok(b"9")),
        "a third stale transaction replays too"
    );
    for tx in [stale_same, stale_other, stale_third] {
        tx.commit().await.expect("commit");
    }
}

/// What the two claimants of `mysql_edges.mixed` share.
#[derive(Default)]
struct Mixed {
    runs: AtomicUsize,
    owner_started: Notify,
    waiter_ran: std::sync::atomic::AtomicBool,
}

/// The store-mode claimant (e.g. a background delivery): a body that runs
/// while its lease is renewed by the heartbeat, until it has seen its lease
/// renewed `RENEWALS` times or the other claimant's body has run.
#[idempotent(scope = "mysql_edges.mixed", key = key, tenant = tenant, store = store,
             skip(mixed), shared_scope, ttl = "1h", lease = "1s", in_progress = reject)]
async fn mixed_in_store(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    mixed: &Mixed,
) -> Result<u64, Error> {
    let identity = Identity::new(tenant, "mysql_edges.mixed", key).expect("identity");
    run_while_renewed(store, &identity, mixed).await;
    Ok(1)
}

/// A store-mode owner's body: counts its run, then runs (its lease renewed
/// by the heartbeat) until it has seen the lease renewed `RENEWALS` times or
/// the other claimant's body has run.
async fn run_while_renewed(store: &dyn Store, identity: &Identity, mixed: &Mixed) {
    const RENEWALS: usize = 8;
    mixed.runs.fetch_add(1, Ordering::SeqCst);
    mixed.owner_started.notify_one();
    let mut seen = Vec::new();
    while seen.len() < RENEWALS && !mixed.waiter_ran.load(Ordering::SeqCst) {
        let lease = store
            .fetch(identity)
            .await
            .expect("fetch")
            .and_then(|s| s.lease_expires_at_ms);
        if let Some(lease) = lease {
            if seen.last() != Some(&lease) {
                seen.push(lease);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The transactional claimant (e.g. the foreground request), waiting for
/// an owner longer than the lease.
#[idempotent(scope = "mysql_edges.mixed", key = key, tenant = tenant, tx = tx,
             skip(mixed), shared_scope, ttl = "1h", lease = "1s", in_progress = wait("60s"))]
async fn mixed_in_tx(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    mixed: &Mixed,
) -> Result<u64, Error> {
    let _ = (&tx, tenant, key);
    mixed.runs.fetch_add(1, Ordering::SeqCst);
    mixed.waiter_ran.store(true, Ordering::SeqCst);
    Ok(2)
}

/// A store-mode owner (heartbeat every lease / 3) is running; a
/// transactional duplicate of the same shared scope would wait for it
/// (bound longer than the lease). Waiting inside the transaction used to
/// run the body twice: once the lease in the duplicate's REPEATABLE READ
/// snapshot had run out, its fenced take-over `UPDATE` failed but kept the
/// row's exclusive lock (InnoDB keeps it until commit); the owner's next
/// heartbeat waited on that lock, so its real lease ran out, and the
/// duplicate's next poll took the record over beside the live owner. A
/// transactional duplicate of a committed in-progress record is now
/// refused at once (`may_wait_in_transaction` is false on MySQL).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transactional_waiter_never_runs_the_body_beside_a_live_store_owner() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let key = "k";
    let mixed = Arc::new(Mixed::default());
    let owner = {
        let (store, tenant, mixed) = (store.clone(), tenant.clone(), mixed.clone());
        tokio::spawn(async move {
            with_outcome(mixed_in_store(&store as &dyn Store, &tenant, key, &mixed)).await
        })
    };
    mixed.owner_started.notified().await;
    let waited = tokio::time::timeout(Duration::from_secs(60), async {
        let mut tx = store.pool().begin().await.expect("begin");
        let answer = with_outcome(mixed_in_tx(&mut tx, &tenant, key, &mixed)).await;
        tx.commit().await.expect("commit");
        answer
    })
    .await
    .expect("the waiter answers within its bound");
    let owned = tokio::time::timeout(Duration::from_secs(60), owner)
        .await
        .expect("the owner finishes")
        .expect("owner task");
    assert_eq!(
        mixed.runs.load(Ordering::SeqCst),
        1,
        "the body ran twice: owner {owned:?}, waiter {waited:?}"
    );
    assert!(
        matches!(owned, (Ok(1), Some(Outcome::Executed))),
        "{owned:?}"
    );
    // Its snapshot cannot see the owner finish, and a look that locked the
    // row would starve the owner: the waiter is refused at once (a later
    // call, in a new transaction, replays).
    assert!(
        matches!(waited, (Err(Error::InProgress { .. }), None)),
        "{waited:?}"
    );
    let mut tx = store.pool().begin().await.expect("begin");
    let retried = with_outcome(mixed_in_tx(&mut tx, &tenant, key, &mixed)).await;
    tx.commit().await.expect("commit");
    assert!(
        matches!(retried, (Ok(1), Some(Outcome::Replayed))),
        "{retried:?}"
    );
}

/// The store-mode claimant of `mysql_edges.same_tx`: runs, its lease renewed
/// by the heartbeat, until the lease has been renewed `RENEWALS` times or
/// the transactional claimant's body has run.
#[idempotent(scope = "mysql_edges.same_tx", key = key, tenant = tenant, store = store,
             skip(mixed), shared_scope, ttl = "1h", lease = "1s", in_progress = reject)]
async fn same_tx_in_store(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    mixed: &Mixed,
) -> Result<u64, Error> {
    let identity = Identity::new(tenant, "mysql_edges.same_tx", key).expect("identity");
    run_while_renewed(store, &identity, mixed).await;
    Ok(1)
}

/// The transactional claimant of `mysql_edges.same_tx`, refused at once
/// while the record is in progress.
#[idempotent(scope = "mysql_edges.same_tx", key = key, tenant = tenant, tx = tx,
             skip(mixed), shared_scope, ttl = "1h", lease = "1s", in_progress = reject)]
async fn same_tx_in_tx(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    mixed: &Mixed,
) -> Result<u64, Error> {
    let _ = (&tx, tenant, key);
    mixed.runs.fetch_add(1, Ordering::SeqCst);
    mixed.waiter_ran.store(true, Ordering::SeqCst);
    Ok(2)
}

/// Until the record's committed lease (as others see it) is in the past, or
/// has been renewed twice since `since`: either way, a REPEATABLE READ
/// snapshot taken before now shows a lease that has run out.
async fn until_the_snapshot_lease_is_stale(store: &MySqlStore, identity: &Identity) {
    let first = store.fetch(identity).await.expect("fetch");
    let mut renewals = 0;
    let mut last = first.as_ref().and_then(|s| s.lease_expires_at_ms);
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let Some(now) = store.fetch(identity).await.expect("fetch") else {
                return;
            };
            let lease = now.lease_expires_at_ms;
            match lease {
                Some(lease) if lease <= now.now_ms => return,
                None => return,
                _ => {}
            }
            if lease != last {
                renewals += 1;
                last = lease;
                if renewals >= 2 {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the lease is renewed or runs out");
}

/// A store-mode owner is running (heartbeat every lease / 3); a transactional
/// caller of the same shared scope is refused (`InProgress`) and calls again
/// in the same REPEATABLE READ transaction, as `retry_after` invites. Its
/// snapshot then shows the owner's lease run out: the fenced take-over
/// `UPDATE` used to fail but keep the row's exclusive lock, so the owner's
/// heartbeat waited on it, its real lease ran out, and the next call in the
/// transaction took the record over beside the live owner (body twice). A
/// transaction cannot take over a lease that ran out after it began: such a
/// call is refused with `StaleSnapshot` (roll back, retry in a new
/// transaction), and takes no lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_again_in_one_transaction_never_take_over_a_live_store_owner() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    calls_again_in_one_transaction(store).await;
}

/// The same while something else reads `information_schema.innodb_trx`
/// every 20 ms (a monitoring agent; other transactions' calls, whose
/// takeover checks read it): InnoDB refreshes the table's cache only once
/// nobody has read it for 0.1 s, so a transaction begun after the last
/// refresh is not in it, and the check of when the transaction began found
/// nothing and let the takeover through. Seen in a full run: the fourth
/// call in the transaction took the record over beside the live owner, whose
/// renewals the transaction's failed write kept waiting, and the body ran
/// twice. A takeover in a transaction now writes only the version of the
/// record its snapshot read (same token, same lease), whatever that table
/// says.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_again_in_one_transaction_never_take_over_a_live_store_owner_while_innodb_trx_is_read_often(
) {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let reader = InnodbTrxReader::start(store.pool());
    calls_again_in_one_transaction(store).await;
    reader.stop().await;
}

/// A pool of one connection whose session runs at `level` (`SET SESSION
/// TRANSACTION ISOLATION LEVEL ...`, e.g. `"SERIALIZABLE"`).
async fn one_connection_at(level: &'static str) -> sqlx::MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(format!("SET SESSION TRANSACTION ISOLATION LEVEL {level}").as_str())
                    .await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("pool")
}

/// Reads `information_schema.innodb_trx` every 20 ms on a connection of its
/// own (as a monitoring agent would) until stopped: InnoDB then never
/// refreshes the cache it shows that table through, and a transaction begun
/// after the last refresh is not in it.
struct InnodbTrxReader {
    reading: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl InnodbTrxReader {
    fn start(pool: &sqlx::MySqlPool) -> Self {
        let reading = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (pool, still) = (pool.clone(), reading.clone());
        let task = tokio::spawn(async move {
            let mut conn = pool.acquire().await.expect("a connection");
            while still.load(Ordering::SeqCst) {
                sqlx::query("SELECT COUNT(*) FROM information_schema.innodb_trx")
                    .execute(&mut *conn)
                    .await
                    .expect("read innodb_trx");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        InnodbTrxReader { reading, task }
    }

    async fn stop(self) {
        self.reading.store(false, Ordering::SeqCst);
        self.task.await.expect("reader");
    }
}

/// A store-mode owner runs; a transactional caller of the same shared scope
/// calls again and again in one REPEATABLE READ transaction: the body runs
/// once, and every call is refused.
async fn calls_again_in_one_transaction(store: MySqlStore) {
    let tenant = fresh_tenant();
    let key = "k";
    let identity = Identity::new(&tenant, "mysql_edges.same_tx", key).expect("identity");
    let mixed = Arc::new(Mixed::default());
    let owner = {
        let (store, tenant, mixed) = (store.clone(), tenant.clone(), mixed.clone());
        tokio::spawn(async move {
            with_outcome(same_tx_in_store(&store as &dyn Store, &tenant, key, &mixed)).await
        })
    };
    mixed.owner_started.notified().await;
    let mut tx = store.pool().begin().await.expect("begin");
    let mut answers = Vec::new();
    for _ in 0..5 {
        let answer = same_tx_in_tx(&mut tx, &tenant, key, &mixed).await;
        let refused = matches!(
            answer,
            Err(Error::InProgress { .. } | Error::StaleSnapshot { .. })
        );
        answers.push(answer);
        if !refused {
            break;
        }
        until_the_snapshot_lease_is_stale(&store, &identity).await;
    }
    tx.rollback().await.expect("rollback");
    let owned = tokio::time::timeout(Duration::from_secs(60), owner)
        .await
        .expect("the owner finishes")
        .expect("owner task");
    assert_eq!(
        mixed.runs.load(Ordering::SeqCst),
        1,
        "the body ran twice: owner {owned:?}, answers in the transaction {answers:?}"
    );
    assert!(
        matches!(owned, (Ok(1), Some(Outcome::Executed))),
        "{owned:?}"
    );
    // Every call is refused; once its snapshot shows the lease run out
    // (by the third call: two renewals apart, more than a lease since the
    // first), as stale.
    assert!(
        answers.iter().all(|a| matches!(
            a,
            Err(Error::InProgress { .. } | Error::StaleSnapshot { store: "mysql", .. })
        )) && answers
            .iter()
            .skip(2)
            .all(|a| matches!(a, Err(Error::StaleSnapshot { .. }))),
        "{answers:?}"
    );
}

// ---------------------------------------------------------------- rule 15: rollback without deadlocks

const EDGES_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_edges_writes (
    tenant VARCHAR(100) NOT NULL, what VARCHAR(100) NOT NULL) ENGINE = InnoDB";

/// The test server's store, with the table the bodies write their effects to.
async fn edges_store() -> Option<MySqlStore> {
    let store = mysql_store_or_skip().await?;
    sqlx::query(EDGES_DDL)
        .execute(store.pool())
        .await
        .expect("ddl");
    Some(store)
}

#[derive(Default)]
struct Hold {
    reached: Notify,
    go: Notify,
}

#[idempotent(scope = "mysql_edges.rollback", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = wait("60s"))]
async fn charge(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    sqlx::query("INSERT INTO idempotent_edges_writes (tenant, what) VALUES (?, 'body')")
        .bind(tenant)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("mysql", "body", e)))?;
    if let Some(hold) = hold {
        hold.reached.notify_one();
        hold.go.notified().await;
    }
    Ok(42)
}

async fn writes(pool: &MySqlPool, tenant: &str, what: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_edges_writes WHERE tenant = ? AND what = ?")
        .bind(tenant)
        .bind(what)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owner_rollback_hands_the_key_to_one_waiter_without_deadlocks() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(12)
        .connect(&mysql_url())
        .await
        .expect("pool");
    sqlx::query(EDGES_DDL).execute(&pool).await.expect("ddl");
    let tenant = fresh_tenant();

    let hold = Arc::new(Hold::default());
    let owner = {
        let (pool, tenant, hold) = (pool.clone(), tenant.clone(), hold.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin");
            let answer = charge(&mut tx, &tenant, "k", Some(&hold)).await;
            tx.rollback().await.expect("the owner rolls back");
            answer
        })
    };
    hold.reached.notified().await;

    const WAITERS: usize = 8;
    let finished = Arc::new(AtomicUsize::new(0));
    let (id_tx, mut id_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut waiters = Vec::new();
    for i in 0..WAITERS {
        let (pool, tenant, finished, id_tx) = (
            pool.clone(),
            tenant.clone(),
            finished.clone(),
            id_tx.clone(),
        );
        waiters.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query("INSERT INTO idempotent_edges_writes (tenant, what) VALUES (?, ?)")
                .bind(&tenant)
                .bind(format!("before-{i}"))
                .execute(&mut *tx)
                .await
                .expect("the waiter's own write");
            id_tx.send(connection_id(&mut *tx).await).expect("send");
            let (answer, outcome) = with_outcome(charge(&mut tx, &tenant, "k", None)).await;
            let committed = tx.commit().await;
            finished.fetch_add(1, Ordering::SeqCst);
            (answer, outcome, committed)
        }));
    }
    let mut ids = Vec::new();
    for _ in 0..WAITERS {
        ids.push(id_rx.recv().await.expect("id"));
    }
    until_all_wait_or_finish(&pool, &ids, &finished).await;
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "no waiter answers while the owner holds the key"
    );
    hold.go.notify_one();
    assert_eq!(
        owner.await.expect("owner").expect("the owner's body ran"),
        42
    );

    let mut executed = 0;
    for waiter in waiters {
        let (answer, outcome, committed) = waiter.await.expect("waiter");
        committed.expect("every waiter's transaction is still alive and commits");
        match answer {
            Ok(42) if outcome == Some(Outcome::Executed) => executed += 1,
            Ok(42) if outcome == Some(Outcome::Replayed) => {}
            Err(Error::InProgress { .. }) => {}
            other => panic!("a waiter got {other:?} ({outcome:?})"),
        }
    }
    assert_eq!(executed, 1, "exactly one waiter took the key over");
    for i in 0..WAITERS {
        assert_eq!(
            writes(&pool, &tenant, &format!("before-{i}")).await,
            1,
            "waiter {i}'s own earlier write survived"
        );
    }
    assert_eq!(writes(&pool, &tenant, "body").await, 1, "one body's write");
    let identity = Identity::new(&tenant, "mysql_edges.rollback", "k").expect("identity");
    assert_eq!(
        store
            .fetch(&identity)
            .await
            .expect("fetch")
            .map(|s| s.state),
        Some(idempotent_runtime::RecordState::Complete)
    );
}

// ------------------------------------------ rule 15: a deadlock through the write path's GET_LOCK

#[idempotent(scope = "mysql_edges.cycle", key = key, tenant = tenant, tx = tx,
             in_progress = wait("60s"))]
async fn cycled(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    Ok(1)
}

/// Waits (bounded) until the session `id` is waiting on a lock.
async fn until_waiting(admin: &MySqlPool, id: u64) {
    for _ in 0..3000 {
        if waiting(admin, &[id]).await == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("session {id} did not reach its lock wait");
}

/// Three transactions in transactional mode, a deadlock that passes through
/// the write path's user-level lock, which InnoDB's deadlock detector cannot
/// see: T1 holds key `a`, T2 key `b` (uncommitted); T3 asks for `a` (it
/// holds `a`'s GET_LOCK and waits for T1's row), T2 asks for `a` (it waits
/// for the GET_LOCK T3 holds), then T1 asks for `b` (T2's row). The cycle
/// T1 → T2 → T3 → T1 used to last until every wait ran out (60 s here, the
/// scope's whole `wait`), and answered `InProgress`. Now InnoDB finds it
/// (error 1213): exactly one of T1 and T2 gets `Error::Store` naming the
/// deadlock, and the others finish (T3 once its turn comes), none with
/// `InProgress`. Handshakes on the server's process list, no sleeps;
/// nothing asserts how long it took.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadlock_through_the_get_lock_of_a_third_transaction_is_found() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(6)
        .connect(&mysql_url())
        .await
        .expect("pool");
    let tenant = fresh_tenant();
    let mut t1 = pool.begin().await.expect("begin T1");
    let mut t2 = pool.begin().await.expect("begin T2");
    let mut t3 = pool.begin().await.expect("begin T3");
    let (id2, id3) = (connection_id(&mut *t2).await, connection_id(&mut *t3).await);
    assert_eq!(cycled(&mut t1, &tenant, "a").await.expect("T1 holds a"), 1);
    assert_eq!(cycled(&mut t2, &tenant, "b").await.expect("T2 holds b"), 1);

    // Each transaction ends as soon as its call answers: committed after Ok
    // (the other waiters then replay it), rolled back otherwise.
    async fn call_then_end(
        mut tx: sqlx::Transaction<'static, MySql>,
        tenant: String,
        key: &'static str,
    ) -> (Result<u64, Error>, Option<Outcome>) {
        let (answer, outcome) = with_outcome(cycled(&mut tx, &tenant, key)).await;
        if answer.is_ok() {
            tx.commit().await.expect("commit");
        } else {
            let _ = tx.rollback().await;
        }
        (answer, outcome)
    }
    let third = tokio::spawn(call_then_end(t3, tenant.clone(), "a"));
    until_waiting(&pool, id3).await;
    let second = tokio::spawn(call_then_end(t2, tenant.clone(), "a"));
    until_waiting(&pool, id2).await;
    let first = tokio::spawn(call_then_end(t1, tenant.clone(), "b"));

    let first = first.await.expect("T1");
    let second = second.await.expect("T2");
    let third = third.await.expect("T3");
    let answers = [("T1 b", &first), ("T2 a", &second), ("T3 a", &third)];
    let victims = answers
        .iter()
        .filter(|(_, (answer, _))| {
            matches!(answer, Err(Error::Store(e)) if e.to_string().to_lowercase().contains("deadlock"))
        })
        .count();
    assert_eq!(
        victims, 1,
        "exactly one transaction is the deadlock's victim: {answers:?}"
    );
    for (who, (answer, outcome)) in answers {
        match answer {
            Ok(1) => assert!(
                matches!(outcome, Some(Outcome::Executed | Outcome::Replayed)),
                "{who}: {outcome:?}"
            ),
            Err(Error::Store(_)) => {}
            other => panic!("{who} got {other:?}, not Ok or the deadlock: {answers:?}"),
        }
    }
    assert!(third.0.is_ok(), "T3 is not in the cycle: {answers:?}");
    for key in ["a", "b"] {
        let identity = Identity::new(&tenant, "mysql_edges.cycle", key).expect("identity");
        assert_eq!(
            store
                .fetch(&identity)
                .await
                .expect("fetch")
                .map(|s| s.state),
            Some(idempotent_runtime::RecordState::Complete),
            "{key} is recorded by the transaction that committed it"
        );
    }
}

// ---------------------------------------------------------------- rule 16: purge skips held rows

/// Purges in batches of two until `gone` are all gone (bounded); every batch
/// must succeed (a guarded session fails after `GUARD_S` seconds on a lock).
async fn purge_until_gone(guarded: &MySqlStore, gone: &[&Identity]) {
    for _ in 0..50 {
        guarded
            .purge_expired(2)
            .await
            .expect("the purge does not wait for a held row");
        let mut left = 0;
        for identity in gone {
            left += usize::from(guarded.fetch(identity).await.expect("fetch").is_some());
        }
        if left == 0 {
            return;
        }
    }
    panic!("the purge did not get to the expired records");
}

/// Expired records are planted with expiry times in 1970, so they are the
/// first a purge in expiry order meets. The oldest is held by an open
/// transaction. In a database of its own: on the shared one, a purge another
/// test ran between the planting and the lock deleted the expired record
/// this test was about to hold (`RowNotFound`, one run in a few).
#[tokio::test]
async fn the_purge_skips_a_row_held_by_an_open_transaction() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = common::servers::mysql_create_database(&admin, "purge_held").await;
    let options: sqlx::mysql::MySqlConnectOptions = mysql_url().parse().expect("URL");
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(format!("SET SESSION innodb_lock_wait_timeout = {GUARD_S}").as_str())
                    .await?;
                Ok(())
            })
        })
        .connect_with(options.database(&db))
        .await
        .expect("pool");
    let guarded = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let outcome = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
        a_held_row_is_skipped_by_the_purge(&guarded),
    ))
    .await;
    pool.close().await;
    admin
        .pool()
        .execute(format!("DROP DATABASE `{db}`").as_str())
        .await
        .expect("drop database");
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// [`the_purge_skips_a_row_held_by_an_open_transaction`]'s body, on a store
/// whose sessions wait at most `GUARD_S` seconds for a row lock.
async fn a_held_row_is_skipped_by_the_purge(store: &MySqlStore) {
    let tenant = fresh_tenant();
    let identity = |k: &str| Identity::new(&tenant, "mysql_edges.purge", k).expect("identity");
    let now_ms: i64 = sqlx::query_scalar(
        "SELECT CAST(UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) AS SIGNED)",
    )
    .fetch_one(store.pool())
    .await
    .expect("clock");
    // (key, state, lease_expires_at, expires_at)
    let rows = [
        ("held", "complete", None, 1_000),
        ("complete-1", "complete", None, 1_001),
        ("complete-2", "complete", None, 1_002),
        ("complete-3", "complete", None, 1_003),
        ("abandoned", "in_progress", Some(1_004), 1_004),
        ("leased", "in_progress", Some(now_ms + 600_000), 1_005),
    ];
    for (key, state, lease, expires) in rows {
        sqlx::query(
            "INSERT INTO idempotency_records
                 (tenant, scope, `key`, state, fingerprint, owner_token, is_error, result,
                  lease_expires_at, expires_at, created_at, updated_at)
             VALUES (?, 'mysql_edges.purge', ?, ?, NULL, ?, 0, ?, ?, ?, ?, ?)",
        )
        .bind(&tenant)
        .bind(key)
        .bind(state)
        .bind((state == "in_progress").then(|| OwnerToken::new().as_str().to_owned()))
        .bind((state == "complete").then_some(&b"1"[..]))
        .bind(lease)
        .bind(expires)
        .bind(expires)
        .bind(expires)
        .execute(store.pool())
        .await
        .expect("plant");
    }
    let (held, leased) = (identity("held"), identity("leased"));
    let others = ["complete-1", "complete-2", "complete-3", "abandoned"].map(identity);

    let mut holder = store.pool().begin().await.expect("begin");
    sqlx::query(
        "SELECT state FROM idempotency_records WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE",
    )
    .bind(held.tenant())
    .bind(held.scope())
    .bind(held.key())
    .fetch_one(&mut *holder)
    .await
    .expect("lock the oldest expired row");

    purge_until_gone(store, &others.iter().collect::<Vec<_>>()).await;
    assert!(
        store.fetch(&held).await.expect("fetch").is_some(),
        "the held row is left alone"
    );
    holder.rollback().await.expect("rollback");
    purge_until_gone(store, &[&held]).await;
    assert!(
        store.fetch(&leased).await.expect("fetch").is_some(),
        "a live lease is never purged, even past its ttl"
    );
}

/// On a small table MariaDB reads the purge's batch with a full scan, so
/// `SKIP LOCKED` tested only the rows themselves: one expired record whose
/// `expires_at` index entry another transaction held in share mode (an
/// index-only `LOCK IN SHARE MODE`) made the purge's `DELETE` wait on that
/// entry for `innodb_lock_wait_timeout` (50 s by default), and then fail
/// with nothing purged (hunt finding). Here the table is a database of its
/// own (a shared one holds enough rows for the index plan) and the purge's
/// session waits at most `GUARD_S` seconds, so a wait fails the test.
#[tokio::test]
async fn the_purge_skips_a_row_whose_expiry_index_entry_is_held() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = common::servers::mysql_create_database(&admin, "purge_plan").await;
    let use_db = format!("USE `{db}`");
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            let use_db = use_db.clone();
            Box::pin(async move {
                conn.execute(use_db.as_str()).await?;
                conn.execute(format!("SET SESSION innodb_lock_wait_timeout = {GUARD_S}").as_str())
                    .await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    for i in 0..30_i64 {
        sqlx::query(
            "INSERT INTO idempotency_records
                 (tenant, scope, `key`, state, is_error, result, expires_at, created_at, updated_at)
             VALUES ('t', 'mysql_edges.purge_plan', ?, 'complete', 0, '1', ?, 0, 0)",
        )
        .bind(format!("k{i}"))
        .bind(1_000 + i)
        .execute(&pool)
        .await
        .expect("plant an expired record");
    }
    let mut holder = pool.begin().await.expect("begin");
    let held: i64 = sqlx::query_scalar(
        "SELECT expires_at FROM idempotency_records FORCE INDEX (idempotency_records_expires_at)
          WHERE expires_at = 1005 LOCK IN SHARE MODE",
    )
    .fetch_one(&mut *holder)
    .await
    .expect("hold one index entry");
    assert_eq!(held, 1005);

    let purged = store.purge_expired(1000).await;
    holder.rollback().await.expect("rollback");
    let then = store.purge_expired(1000).await;
    drop(store);
    pool.close().await;
    admin
        .pool()
        .execute(format!("DROP DATABASE `{db}`").as_str())
        .await
        .expect("drop database");
    assert_eq!(
        purged.expect("the purge does not wait for a held index entry"),
        29,
        "every expired record but the held one"
    );
    assert_eq!(then.expect("purge"), 1, "the held one, once let go");
}

/// The purge's `DELETE` of an expired record touches that record alone. On
/// a table of some size (a thousand records here) with few records expired,
/// as a purger that runs keeps it, MariaDB reads that `DELETE` through the
/// expiry index: it read the first entry past the expired ones too, and
/// waited for that record's row lock, although the record was live (its
/// owner's transactional-mode call still open, or its completion under way),
/// for `innodb_lock_wait_timeout` (50 s by default), and then failed the
/// batch with nothing purged; a store-mode completion under way there ended
/// in a deadlock with it, and the call that had run its body got a `Store`
/// error (hcrash hunt, purge storm). Here the live record is held by an open
/// transaction and the purge's session waits at most `GUARD_S` seconds, so a
/// wait fails the test.
#[tokio::test]
async fn the_purge_waits_for_no_live_record_past_the_expired_ones() {
    in_a_database_waiting_guard_s("purge_past", |store, pool| async move {
        purge_past_a_live_record(&store, &pool).await
    })
    .await;
}

/// A thousand live records, one expired record, and a live in-progress
/// record (`running`) whose expiry index entry comes first after it.
async fn plant_past_a_live_record(pool: &MySqlPool) {
    let now_ms: i64 = sqlx::query_scalar(
        "SELECT CAST(UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) AS SIGNED)",
    )
    .fetch_one(pool)
    .await
    .expect("clock");
    // A thousand live records, kept for a day or more.
    sqlx::query(
        "INSERT INTO idempotency_records
             (tenant, scope, `key`, state, is_error, result, expires_at, created_at, updated_at)
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)
         SELECT 't', 'mysql_edges.purge_past', CONCAT('live-', i), 'complete', 0, '1',
                ? + 86400000 + i, ?, ?
           FROM n",
    )
    .bind(now_ms)
    .bind(now_ms)
    .bind(now_ms)
    .execute(pool)
    .await
    .expect("plant the live records");
    // One expired record, and the live in-progress record whose expiry
    // index entry comes first after it.
    sqlx::query(
        "INSERT INTO idempotency_records
             (tenant, scope, `key`, state, owner_token, is_error, result, lease_expires_at,
              expires_at, created_at, updated_at)
         VALUES ('t', 'mysql_edges.purge_past', 'expired', 'complete', NULL, 0, '1', NULL,
                 1000, 1000, 1000),
                ('t', 'mysql_edges.purge_past', 'running', 'in_progress', 'owner', 0, NULL, ? + 600000,
                 ? + 3600000, ?, ?)",
    )
    .bind(now_ms)
    .bind(now_ms)
    .bind(now_ms)
    .bind(now_ms)
    .execute(pool)
    .await
    .expect("plant the expired and the running record");
    sqlx::query("ANALYZE TABLE idempotency_records")
        .execute(pool)
        .await
        .expect("analyze");
}

async fn purge_past_a_live_record(store: &MySqlStore, pool: &MySqlPool) {
    plant_past_a_live_record(pool).await;
    let identity = |k: &str| Identity::new("t", "mysql_edges.purge_past", k).expect("identity");

    // The running record's row, held as its owner's open transaction holds it.
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query(
        "SELECT state FROM idempotency_records WHERE tenant = 't' AND scope = ? AND `key` = 'running' FOR UPDATE",
    )
    .bind("mysql_edges.purge_past")
    .fetch_one(&mut *holder)
    .await
    .expect("hold the running record");
    let purged = store.purge_expired(10).await;
    holder.rollback().await.expect("rollback");
    assert_eq!(
        purged.expect("the purge waits for no live record"),
        1,
        "the expired record"
    );
    assert!(store
        .fetch(&identity("expired"))
        .await
        .expect("fetch")
        .is_none());
    assert!(store
        .fetch(&identity("running"))
        .await
        .expect("fetch")
        .is_some());
}

/// The same for a reservation that replaces an expired record (rule 3): it
/// writes that record alone, and waits for no live record of another
/// identity past the expired ones (held here by an open transaction, as a
/// transactional-mode call holds its own).
#[tokio::test]
async fn replacing_an_expired_record_waits_for_no_live_record_of_another_key() {
    in_a_database_waiting_guard_s("replace_past", |store, pool| async move {
        replace_past_a_live_record(&store, &pool).await
    })
    .await;
}

/// Runs `check` on a store in a database of its own (named after `name`),
/// its sessions waiting at most `GUARD_S` seconds for a row lock, so a wait
/// fails the check instead of stalling it; the database is dropped after,
/// whether the check passed or not.
async fn in_a_database_waiting_guard_s<F, Fut>(name: &str, check: F)
where
    F: FnOnce(MySqlStore, MySqlPool) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = common::servers::mysql_create_database(&admin, name).await;
    let use_db = format!("USE `{db}`");
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            let use_db = use_db.clone();
            Box::pin(async move {
                conn.execute(use_db.as_str()).await?;
                conn.execute(format!("SET SESSION innodb_lock_wait_timeout = {GUARD_S}").as_str())
                    .await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let outcome = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(check(
        store,
        pool.clone(),
    )))
    .await;
    pool.close().await;
    admin
        .pool()
        .execute(format!("DROP DATABASE `{db}`").as_str())
        .await
        .expect("drop database");
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn replace_past_a_live_record(store: &MySqlStore, pool: &MySqlPool) {
    plant_past_a_live_record(pool).await;
    let identity = |k: &str| Identity::new("t", "mysql_edges.purge_past", k).expect("identity");
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query(
        "SELECT state FROM idempotency_records WHERE tenant = 't' AND scope = ? AND `key` = 'running' FOR UPDATE",
    )
    .bind("mysql_edges.purge_past")
    .fetch_one(&mut *holder)
    .await
    .expect("hold the running record");
    let expired = identity("expired");
    let token = OwnerToken::new();
    let answer = tokio::time::timeout(
        Duration::from_secs(30),
        store.reserve(ReserveRequest {
            identity: &expired,
            fingerprint: None,
            token: &token,
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
        }),
    )
    .await
    .expect("the reservation answers");
    holder.rollback().await.expect("rollback");
    assert_eq!(
        answer.expect("reserve"),
        Reservation::FRESH,
        "the expired record is replaced, whoever holds another"
    );
}

/// A stored procedure that is missing (a newer build's migration, which
/// drops it and creates it again, was cut off in between) is reported as
/// such, with what to do, not as a bare "does not exist".
#[tokio::test]
async fn a_missing_procedure_says_what_happened_and_what_to_do() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = common::servers::mysql_create_database(&admin, "missing_proc").await;
    let options: sqlx::mysql::MySqlConnectOptions = mysql_url().parse().expect("URL");
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect_with(options.database(&db))
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool).await.expect("store");
    store
        .pool()
        .execute("DROP PROCEDURE idempotency_purge")
        .await
        .expect("drop the procedure");
    let purged = store.purge_expired(10).await;
    // The remedy the message gives for a restore without procedures: the
    // history rows of the procedures' migrations deleted, the store opened
    // again applies them again.
    store
        .pool()
        .execute("DELETE FROM idempotency_schema_migrations WHERE version >= 2")
        .await
        .expect("forget the procedures' migrations");
    let reopened = MySqlStore::from_pool(store.pool().clone()).await;
    let purged_again = match &reopened {
        Ok(reopened) => reopened.purge_expired(10).await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    store.pool().close().await;
    admin
        .pool()
        .execute(format!("DROP DATABASE `{db}`").as_str())
        .await
        .expect("drop database");
    purged_again.expect("the procedures are back");
    let said = purged.expect_err("no procedure, no purge").to_string();
    assert!(
        said.contains("stored procedure of the idempotency schema is missing")
            && said.contains("open the store once with the build that ran it")
            && said.contains("--routines")
            && said.contains("version 2 and later"),
        "{said}"
    );
}

// ------------------------------------------- a fresh key through the store (MariaDB's plain insert)

/// A store-mode reservation of a key whose record a transactional-mode owner
/// has inserted but not committed: the plain read does not see it, MariaDB's
/// plain insert does not wait for its row lock (it leaves the key to the
/// procedure, which waits one reserver at a time under GET_LOCK), and the
/// answer is "in progress" after the store's 1 s lock wait — not a wait of
/// `innodb_lock_wait_timeout` (50 s by default; the bound below is only a
/// guard against a hang), and never a second owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_key_behind_an_uncommitted_transactional_owner_is_in_progress() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let identity = Identity::new(fresh_tenant(), "edges.fresh_behind_tx", "k").expect("identity");
    let f = fp("a");
    let mut tx = store.pool().begin().await.expect("begin");
    assert!(matches!(
        in_tx(&mut tx, &identity, Some(&f), WAIT).await,
        Reservation::Acquired { .. }
    ));
    let token = OwnerToken::new();
    let answer = tokio::time::timeout(
        Duration::from_secs(20),
        store.reserve(request(&identity, Some(&f), &token, LONG, LONG)),
    )
    .await
    .expect("the store's reservation waits at most its lock wait")
    .expect("reserve");
    assert!(
        matches!(answer, Reservation::InProgress { .. }),
        "{answer:?}"
    );
    tx.rollback().await.expect("rollback");
    // The owner rolled back: the key is free, and the store reserves it.
    assert!(matches!(
        store
            .reserve(request(&identity, Some(&f), &token, LONG, LONG))
            .await
            .expect("reserve"),
        Reservation::Acquired { attempt: 1, .. }
    ));
}

/// `in_progress = wait(d)` with `d` under a second, in transactional mode:
/// InnoDB waits for row locks in whole seconds, and rounding `d` down made
/// it no wait at all (`InProgress` at once, though the owner was about to
/// commit). Rounded up, the duplicate waits (its session is seen waiting on
/// the owner's row), and replays the owner's answer once it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_under_a_second_in_a_transaction_still_waits() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let admin = store.pool().clone();
    let identity = Identity::new(fresh_tenant(), "edges.subsecond_wait", "k").expect("identity");
    let f = fp("a");
    let mut owner = store.pool().begin().await.expect("begin");
    let owner_token = OwnerToken::new();
    let got = owner
        .reserve_in_transaction(request(&identity, Some(&f), &owner_token, LONG, LONG), WAIT)
        .await
        .expect("the owner reserves");
    assert!(matches!(got, Reservation::Acquired { .. }), "{got:?}");

    let finished = Arc::new(AtomicUsize::new(0));
    let mut duplicate = store.pool().begin().await.expect("begin");
    let id = connection_id(&mut *duplicate).await;
    let task = {
        let (identity, f, finished) = (identity.clone(), f.clone(), finished.clone());
        tokio::spawn(async move {
            let token = OwnerToken::new();
            let got = duplicate
                .reserve_in_transaction(
                    request(&identity, Some(&f), &token, LONG, LONG),
                    Duration::from_millis(900),
                )
                .await;
            finished.fetch_add(1, Ordering::SeqCst);
            duplicate.commit().await.expect("commit");
            got
        })
    };
    until_all_wait_or_finish(&admin, &[id], &finished).await;
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the duplicate waits for the owner: {:?}",
        if finished.load(Ordering::SeqCst) > 0 {
            Some(task.await)
        } else {
            None
        }
    );
    assert_eq!(
        owner
            .complete_in_transaction(Completion::by_body(
                &identity,
                &owner_token,
                &ok(b"7"),
                LONG
            ))
            .await
            .expect("complete"),
        Fenced::Written
    );
    owner.commit().await.expect("commit");
    let got = task.await.expect("duplicate").expect("reserve");
    assert_eq!(got, Reservation::Completed(ok(b"7")));
}

/// MariaDB's `sql_mode` `EMPTY_STRING_IS_NULL` turns the shared tenant (an
/// empty string) into `NULL`: every call failed with "GET_LOCK failed". The
/// error now says what is wrong; nothing is written either way.
#[tokio::test]
async fn the_shared_tenant_under_empty_string_is_null_is_refused_with_a_clear_error() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    if !store_is_mariadb(&store).await {
        return; // a MariaDB mode
    }
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION sql_mode = CONCAT(@@sql_mode, ',EMPTY_STRING_IS_NULL')")
                    .await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("pool");
    let odd = MySqlStore::from_pool(pool).await.expect("store");
    let identity =
        Identity::shared("edges.empty_is_null", format!("k-{}", fresh_tenant())).expect("identity");
    let token = OwnerToken::new();
    let refused = odd
        .reserve(request(&identity, Some(&fp("a")), &token, LONG, LONG))
        .await
        .expect_err("refused");
    assert!(
        refused.to_string().contains("EMPTY_STRING_IS_NULL"),
        "the error names the cause: {refused}"
    );
    assert!(store.fetch(&identity).await.expect("fetch").is_none());
}

async fn store_is_mariadb(store: &MySqlStore) -> bool {
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(store.pool())
        .await
        .expect("version");
    version.contains("MariaDB")
}

/// Under SERIALIZABLE every read of a transaction locks what it reads: a
/// transactional call that finds a record in progress holds a shared lock on
/// it, which keeps the owner from renewing its lease until the transaction
/// ends. It is refused as a transaction that must end (`StaleSnapshot`), not
/// as `InProgress` (which invites calling again in it).
#[tokio::test]
async fn an_in_progress_record_met_under_serializable_refuses_the_transaction() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let identity = Identity::new(fresh_tenant(), "edges.serializable", "k").expect("identity");
    let f = fp("a");
    let owner = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(&identity, Some(&f), &owner, LONG, LONG))
            .await
            .expect("the owner reserves"),
        Reservation::FRESH
    );
    let pool = one_connection_at("SERIALIZABLE").await;
    let mut tx = pool.begin().await.expect("begin");
    let token = OwnerToken::new();
    let got = tx
        .reserve_in_transaction(
            request(&identity, Some(&f), &token, LONG, LONG),
            Duration::ZERO,
        )
        .await;
    tx.rollback().await.expect("rollback");
    assert!(
        matches!(got, Err(Error::StaleSnapshot { store: "mysql", .. })),
        "{got:?}"
    );
    // The owner was never held up for good: it records its result.
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &owner, &ok(b"1"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
}

/// Gives the pool's connection back inside a transaction that is never ended,
/// as code sharing the pool does with a plain `BEGIN` and an early return.
async fn leave_a_transaction_open(pool: &MySqlPool) {
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("BEGIN").await.expect("begin");
    sqlx::query("SELECT COUNT(*) FROM idempotency_records")
        .fetch_one(&mut *conn)
        .await
        .expect("a read in it");
}

/// A store on a pool it shares with application code, which gave the one
/// connection back inside a transaction it began and never ended: the
/// store's reservation and completion were written inside that
/// transaction, unseen by anyone else and rolled back with it, so a retry
/// ran the body again. The store writes on a connection outside any
/// transaction (the left-open one is closed, rolling its transaction back).
#[tokio::test]
async fn a_transaction_left_open_on_a_shared_pool_does_not_swallow_the_record() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    if !store_is_mariadb(&admin).await {
        return; // MySQL 8 cannot tell (no @@in_transaction)
    }
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let identity = Identity::new(fresh_tenant(), "edges.left_open", "k").expect("identity");
    let f = fp("a");
    let token = OwnerToken::new();

    leave_a_transaction_open(&pool).await;
    let got = store
        .reserve(request(&identity, Some(&f), &token, LONG, LONG))
        .await
        .expect("reserve");
    assert_eq!(got, Reservation::FRESH);
    let seen = admin.fetch(&identity).await.expect("fetch");
    assert!(
        seen.is_some_and(|r| r.state == idempotent_runtime::RecordState::InProgress),
        "the reservation is committed, seen by others"
    );

    leave_a_transaction_open(&pool).await;
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &token, &ok(b"5"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
    let seen = admin
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(
        seen.state,
        idempotent_runtime::RecordState::Complete,
        "the completion is committed"
    );

    leave_a_transaction_open(&pool).await;
    let retry = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(&identity, Some(&f), &retry, LONG, LONG))
            .await
            .expect("reserve"),
        Reservation::Completed(ok(b"5")),
        "a retry replays"
    );
}

/// A transaction takes over a crashed owner's record whose lease ran out
/// before the transaction began, whatever the session's time zone: the
/// transaction's start (`information_schema.innodb_trx`, the server's local
/// time) was read in the session's zone, and a session ahead of the server
/// (`+05:00`) was refused as stale for hours.
#[tokio::test]
async fn a_takeover_in_a_session_of_another_time_zone_is_not_refused() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let identity = Identity::new(fresh_tenant(), "edges.time_zone", "k").expect("identity");
    let f = fp("a");
    let crashed = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(
                &identity,
                Some(&f),
                &crashed,
                Duration::from_millis(1),
                LONG
            ))
            .await
            .expect("the owner reserves"),
        Reservation::FRESH
    );
    until_clock(&store, &identity, |s| {
        s.lease_expires_at_ms.is_some_and(|l| l <= s.now_ms)
    })
    .await;
    // A transaction begun in a later second than the lease's end.
    let second = |pool: MySqlPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT CAST(UNIX_TIMESTAMP() AS SIGNED)")
            .fetch_one(&pool)
            .await
            .expect("clock")
    };
    let now = second(store.pool().clone()).await;
    for zone in ["+05:00", "-05:00"] {
        while second(store.pool().clone()).await == now {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // MySQL shows transactions (information_schema.INNODB_TRX) through a
        // cache refreshed at most every 0.1 s: one still showing this
        // connection's previous transaction gives this one an older start.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut tx = store.pool().begin().await.expect("begin");
        sqlx::query(&format!("SET time_zone = '{zone}'"))
            .execute(&mut *tx)
            .await
            .expect("zone");
        let token = OwnerToken::new();
        let got = tx
            .reserve_in_transaction(request(&identity, Some(&f), &token, LONG, LONG), WAIT)
            .await;
        tx.rollback().await.expect("rollback");
        assert!(
            matches!(
                got,
                Ok(Reservation::Acquired {
                    took_over: true,
                    ..
                })
            ),
            "{zone}: {got:?}"
        );
    }
}

/// A transaction whose snapshot is older than a store-mode owner's
/// in-progress record, calling with other arguments: its insert meets the
/// record and its re-read locks it, so the answer (a mismatch) would leave
/// the transaction holding a lock that keeps the owner from renewing its
/// lease for as long as it stays open. Refused as a transaction that must
/// end (`StaleSnapshot`), as an in-progress answer there is.
#[tokio::test]
async fn a_mismatch_that_locked_a_live_record_refuses_the_transaction() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "edges.locked_mismatch", "k").expect("identity");
    let mut stale = store.pool().begin().await.expect("begin");
    snapshot_now(&mut stale, &tenant).await;
    let owner = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(&identity, Some(&fp("a")), &owner, LONG, LONG))
            .await
            .expect("the owner reserves"),
        Reservation::FRESH
    );
    let token = OwnerToken::new();
    let got = stale
        .reserve_in_transaction(request(&identity, Some(&fp("b")), &token, LONG, LONG), WAIT)
        .await;
    stale.rollback().await.expect("rollback");
    assert!(
        matches!(got, Err(Error::StaleSnapshot { store: "mysql", .. })),
        "{got:?}"
    );
}

/// A store on a pool whose sessions have autocommit off (`SET SESSION
/// autocommit = 0` in `after_connect`, as a server's `autocommit = 0` does),
/// with `connections` connections.
async fn autocommit_off_store(connections: u32) -> MySqlStore {
    let pool = MySqlPoolOptions::new()
        .max_connections(connections)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION autocommit = 0").await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("pool");
    MySqlStore::from_pool(pool).await.expect("store")
}

/// A store opened on a pool whose sessions have autocommit off: a fresh key's
/// record is committed (other sessions see it, and a second caller is refused),
/// not left in the session's open transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_key_on_an_autocommit_off_session_is_committed() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let store = autocommit_off_store(1).await;
    let identity = Identity::new(fresh_tenant(), "edges.autocommit_off", "k").expect("identity");
    let f = fp("a");
    let token = OwnerToken::new();
    assert!(matches!(
        store
            .reserve(request(&identity, Some(&f), &token, LONG, LONG))
            .await
            .expect("reserve"),
        Reservation::Acquired { attempt: 1, .. }
    ));
    let seen = admin.fetch(&identity).await.expect("fetch");
    assert!(
        seen.is_some(),
        "the record is committed, visible to other sessions"
    );
    let other = OwnerToken::new();
    assert!(matches!(
        admin
            .reserve(request(&identity, Some(&f), &other, LONG, LONG))
            .await
            .expect("reserve"),
        Reservation::InProgress { .. }
    ));
}

/// The same pool: a completion and a release are committed too. Before, they
/// stayed in the session's open transaction: other sessions saw the record in
/// progress, and when the connection closed the completion was rolled back,
/// so once the lease ran out a retry ran the body again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_releases_on_an_autocommit_off_session_are_committed() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    writes_are_committed(autocommit_off_store(2).await, &admin).await;
}

/// The same when a session of the store's pool is turned to autocommit off
/// after the store opened (by the application sharing the pool): each write
/// finds out for itself, not from what the store saw when it opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_turned_to_autocommit_off_after_the_store_opened_still_commits() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let mut session = pool.acquire().await.expect("the pool's one session");
    session
        .execute("SET SESSION autocommit = 0")
        .await
        .expect("autocommit off");
    drop(session);
    writes_are_committed(store, &admin).await;
}

/// A store on a pool whose sessions run with autocommit off under
/// SERIALIZABLE (a server's `autocommit = 0` and
/// `transaction_isolation = SERIALIZABLE`), with one connection.
async fn autocommit_off_serializable_store() -> MySqlStore {
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION autocommit = 0").await?;
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                    .await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("pool");
    MySqlStore::from_pool(pool).await.expect("store")
}

/// The store's reads of records (`fetch`, the audit's counts) on a session
/// with autocommit off under SERIALIZABLE, where InnoDB makes every plain
/// read of a transaction a locking one, leave no lock behind on the
/// connection they hand back to the pool: other identities' records are
/// still completed and fresh keys still reserved (rule 1) while that
/// connection sits idle. Before, the read's transaction stayed open with its
/// shared locks: the record a mismatch's read looked at could not be
/// completed by its owner (a store error after its body ran), and after an
/// audit every fresh key of every scope was answered in progress and the
/// purge deleted nothing, for as long as the connection stayed in the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_an_autocommit_off_serializable_session_keep_no_lock() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let reader = autocommit_off_serializable_store().await;
    let tenant = fresh_tenant();
    let scope = "edges.serializable_reads";
    let f = fp("a");
    let running = Identity::new(&tenant, scope, "running").expect("identity");
    let token = OwnerToken::new();
    assert!(matches!(
        admin
            .reserve(request(&running, Some(&f), &token, LONG, LONG))
            .await
            .expect("reserve"),
        Reservation::Acquired { .. }
    ));
    // A read of the running record (as a mismatch's), then the audit's
    // counts; the reader's one connection then sits idle in its pool.
    let seen = reader.fetch(&running).await.expect("fetch");
    assert!(seen.is_some());
    let stats = reader.scope_stats().await.expect("scope stats");
    assert!(stats.iter().any(|s| s.scope == scope));
    // The owner records its result.
    assert_eq!(
        admin
            .complete(Completion::by_body(&running, &token, &ok(b"7"), LONG))
            .await
            .expect("the owner's completion is not kept waiting by the reader's locks"),
        Fenced::Written
    );
    // Fresh keys of this scope and of another are still free.
    for (scope, key) in [(scope, "fresh"), ("edges.serializable_reads_other", "a")] {
        let fresh = Identity::new(&tenant, scope, key).expect("identity");
        let got = admin
            .reserve(request(&fresh, Some(&f), &OwnerToken::new(), LONG, LONG))
            .await
            .expect("reserve");
        assert!(
            matches!(got, Reservation::Acquired { .. }),
            "{scope}/{key}: {got:?}"
        );
    }
    reader.pool().close().await;
}

/// Through `store`: a reservation, a heartbeat and a completion of one key,
/// a reservation, a heartbeat and a release of another; then the store's
/// pool closes (whatever its sessions left uncommitted is rolled back), and
/// `admin` must see the completion and the release.
async fn writes_are_committed(store: MySqlStore, admin: &MySqlStore) {
    let tenant = fresh_tenant();
    let (completed, released) = (
        Identity::new(&tenant, "edges.autocommit_off", "completed").expect("identity"),
        Identity::new(&tenant, "edges.autocommit_off", "released").expect("identity"),
    );
    let f = fp("a");
    for (identity, complete) in [(&completed, true), (&released, false)] {
        let token = OwnerToken::new();
        assert!(matches!(
            store
                .reserve(request(identity, Some(&f), &token, LONG, LONG))
                .await
                .expect("reserve"),
            Reservation::Acquired { .. }
        ));
        assert_eq!(
            store
                .heartbeat(identity, &token, LONG)
                .await
                .expect("heartbeat"),
            Fenced::Written
        );
        let done = if complete {
            store
                .complete(Completion::by_body(identity, &token, &ok(b"7"), LONG))
                .await
        } else {
            store.release(identity, &token).await
        };
        assert_eq!(done.expect("fenced write"), Fenced::Written);
        // A stale token is still refused (and changes nothing).
        assert_eq!(
            store
                .heartbeat(identity, &OwnerToken::new(), LONG)
                .await
                .expect("heartbeat"),
            Fenced::NotOwner
        );
    }
    store.pool().close().await;
    assert_eq!(
        admin
            .reserve(request(
                &completed,
                Some(&f),
                &OwnerToken::new(),
                LONG,
                LONG
            ))
            .await
            .expect("reserve"),
        Reservation::Completed(ok(b"7")),
        "other sessions replay the committed completion"
    );
    assert!(
        admin.fetch(&released).await.expect("fetch").is_none(),
        "the release is committed: the key is free"
    );
}

/// A pool whose sessions read uncommitted data (`READ UNCOMMITTED`) is
/// refused when the store opens, saying why: its plain reads would replay a
/// result that a transactional-mode caller has recorded but not committed,
/// and that may still roll back. Before, the store opened, replayed such a
/// result, and after the rollback the key ran again with another answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_reads_uncommitted_data_is_refused() {
    if mysql_store_or_skip().await.is_none() {
        return;
    }
    let pool = one_connection_at("READ UNCOMMITTED").await;
    let refused = MySqlStore::from_pool(pool).await.expect_err("refused");
    assert!(
        matches!(&refused, Error::Store(e) if e.to_string().contains("READ UNCOMMITTED")),
        "{refused}"
    );
}

/// The same in transactional mode: a call in a READ UNCOMMITTED transaction
/// is refused before anything is read or written, and its body does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_that_reads_uncommitted_data_is_refused() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let identity = Identity::new(fresh_tenant(), "mysql_edges.rollback", "k").expect("identity");
    let mut conn = store.pool().acquire().await.expect("connection");
    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
        .await
        .expect("isolation");
    let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
    let refused = charge(&mut tx, identity.tenant(), identity.key(), None)
        .await
        .expect_err("refused");
    assert!(
        matches!(&refused, Error::Store(e) if e.to_string().contains("READ UNCOMMITTED")),
        "{refused}"
    );
    tx.rollback().await.expect("rollback");
    conn.close_on_drop();
    assert!(store.fetch(&identity).await.expect("fetch").is_none());
}

/// Rule 11 in store mode: a pool the store shares with code that sets the
/// session's clock (a time-freezing test: `SET timestamp` in `after_connect`)
/// decides nothing with it. Two days ahead, the store's statements read a
/// record completed a moment ago with a ttl of a day as expired and ran the
/// body again, took over a live lease, and purged live records; two days
/// behind, a live duplicate was told to come back in two days. Every
/// statement of the store on such a session is now refused and writes
/// nothing: the reservation (fresh, replay, live lease), the renewal, the
/// completion, the operator's release, the purge, the audit's reads.
#[tokio::test]
async fn a_store_on_sessions_whose_clock_is_set_decides_nothing_by_it() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let complete = Identity::new(tenant.clone(), "mysql_edges.clock", "complete").expect("id");
    let token = OwnerToken::new();
    let acquired = store
        .reserve(request(&complete, None, &token, LONG, LONG))
        .await
        .expect("reserve");
    assert!(
        matches!(acquired, Reservation::Acquired { .. }),
        "{acquired:?}"
    );
    assert_eq!(
        store
            .complete(Completion::by_body(&complete, &token, &ok(b"1"), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
    let live = Identity::new(tenant.clone(), "mysql_edges.clock", "live").expect("id");
    let owner = OwnerToken::new();
    store
        .reserve(request(&live, None, &owner, LONG, LONG))
        .await
        .expect("reserve the live one");

    for skew in ["+ 172800", "- 172800"] {
        let set = format!("SET timestamp = UNIX_TIMESTAMP(SYSDATE()) {skew}");
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .after_connect(move |conn, _| {
                let set = set.clone();
                Box::pin(async move {
                    conn.execute(set.as_str()).await?;
                    Ok(())
                })
            })
            .connect(&mysql_url())
            .await
            .expect("pool");
        let skewed = MySqlStore::from_pool(pool).await.expect("store");
        let refused = |what: &str, e: &dyn std::fmt::Display| {
            assert!(
                e.to_string().contains("SET timestamp"),
                "{skew}: {what} not refused for the set clock: {e}"
            );
        };
        let fresh =
            Identity::new(tenant.clone(), "mysql_edges.clock", format!("fresh{skew}")).expect("id");
        for identity in [&complete, &live, &fresh] {
            let answer = skewed
                .reserve(request(identity, None, &OwnerToken::new(), LONG, LONG))
                .await;
            match answer {
                Err(e) => refused("a reservation", &e),
                Ok(answer) => panic!("{skew}: {identity:?} answered {answer:?}"),
            }
        }
        match skewed.heartbeat(&live, &owner, LONG).await {
            Err(e) => refused("a renewal", &e),
            Ok(answer) => panic!("{skew}: renewal answered {answer:?}"),
        }
        match skewed
            .complete(Completion::by_body(&live, &owner, &ok(b"2"), LONG))
            .await
        {
            Err(e) => refused("a completion", &e),
            Ok(answer) => panic!("{skew}: completion answered {answer:?}"),
        }
        match skewed.force_release(&live, true).await {
            Err(e) => refused("an operator's release", &e),
            Ok(answer) => panic!("{skew}: operator's release answered {answer:?}"),
        }
        match skewed.purge_expired(1_000).await {
            Err(e) => refused("a purge", &e),
            Ok(n) => panic!("{skew}: the purge ran ({n} deleted)"),
        }
        match skewed.scope_stats().await {
            Err(e) => refused("an audit", &e),
            Ok(_) => panic!("{skew}: the audit read on the set clock"),
        }
        skewed.pool().close().await;
    }
    // Nothing was written: the complete record replays, the live one is
    // still its owner's, and the fresh key was never reserved.
    let replay = store
        .reserve(request(&complete, None, &OwnerToken::new(), LONG, LONG))
        .await
        .expect("replay");
    assert!(matches!(replay, Reservation::Completed(_)), "{replay:?}");
    let in_progress = store
        .reserve(request(&live, None, &OwnerToken::new(), LONG, LONG))
        .await
        .expect("in progress");
    assert!(
        matches!(in_progress, Reservation::InProgress { lease_remaining } if lease_remaining > Duration::from_secs(60)),
        "{in_progress:?}"
    );
    assert_eq!(
        store.heartbeat(&live, &owner, LONG).await.expect("renewal"),
        Fenced::Written
    );
    for skew in ["+ 172800", "- 172800"] {
        let fresh =
            Identity::new(tenant.clone(), "mysql_edges.clock", format!("fresh{skew}")).expect("id");
        assert!(store.fetch(&fresh).await.expect("fetch").is_none());
    }
}

/// Rule 11 in transactional mode: the caller's session decides nothing with
/// a clock of its own. `SET timestamp` moves `NOW()` and `UNIX_TIMESTAMP()`,
/// which the store's statements read: two hours ahead, a complete record
/// with a ttl of one hour looked expired and the body ran a second time. A
/// session whose clock is set is now refused, the body not run, and once it
/// is reset the record replays.
#[tokio::test]
async fn a_transaction_on_a_session_whose_clock_is_set_is_refused() {
    let Some(store) = edges_store().await else {
        return;
    };
    let tenant = fresh_tenant();
    let mut tx = store.pool().begin().await.expect("begin");
    assert_eq!(
        charge(&mut tx, &tenant, "k", None)
            .await
            .expect("first call"),
        42
    );
    tx.commit().await.expect("commit");

    let mut conn = store.pool().acquire().await.expect("connection");
    for set in [
        // (`UNIX_TIMESTAMP()` reads the set clock too: the server's is `SYSDATE()`.)
        "SET timestamp = UNIX_TIMESTAMP(SYSDATE()) + 7200",
        "SET timestamp = UNIX_TIMESTAMP(SYSDATE()) - 7200",
    ] {
        conn.execute(set).await.expect("set the session's clock");
        let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
        let refused = charge(&mut tx, &tenant, "k", None)
            .await
            .err()
            .unwrap_or_else(|| panic!("{set}: not refused"));
        assert!(
            matches!(&refused, Error::Store(e) if e.to_string().contains("SET timestamp")),
            "{set}: {refused}"
        );
        tx.rollback().await.expect("rollback");
    }
    conn.execute("SET timestamp = DEFAULT")
        .await
        .expect("reset the clock");
    let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
    let (answer, outcome) =
        idempotent_runtime::with_outcome(charge(&mut tx, &tenant, "k", None)).await;
    assert_eq!(answer.expect("replay"), 42);
    assert_eq!(outcome, Some(idempotent_runtime::Outcome::Replayed));
    tx.commit().await.expect("commit");
    assert_eq!(
        writes(store.pool(), &tenant, "body").await,
        1,
        "the body ran once"
    );
}

/// A transactional body that backdates its own writes (`SET timestamp`, so
/// that `DEFAULT CURRENT_TIMESTAMP` columns take a historical time, as data
/// replays do), and sets it back before it returns only when told to.
#[idempotent(scope = "mysql_edges.backdated", key = key, tenant = tenant, tx = tx, ttl = "1h",
             skip(set_back))]
async fn backdated_charge(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    set_back: bool,
) -> Result<u64, Error> {
    (&mut **tx)
        .execute("SET timestamp = UNIX_TIMESTAMP(SYSDATE()) - 86400")
        .await
        .expect("backdate the session's clock");
    sqlx::query("INSERT INTO idempotent_edges_writes (tenant, what) VALUES (?, 'backdated')")
        .bind(tenant)
        .execute(&mut **tx)
        .await
        .expect("the body's write");
    if set_back {
        (&mut **tx)
            .execute("SET timestamp = DEFAULT")
            .await
            .expect("set the clock back");
    }
    Ok(42)
}

/// Rule 11 in transactional mode, the clock set by the body itself: the
/// check before the reservation saw the server's clock, and the completion
/// computed the record's expiry on the body's (a day back, so a ttl of an
/// hour had run out at once): the caller committed, and its retry ran the
/// body a second time. The completion is now refused like a reservation on
/// a set clock; the caller rolls back, and its retry (whose body sets the
/// clock back) runs once, then replays.
#[tokio::test]
async fn a_body_that_sets_the_sessions_clock_records_nothing_by_it() {
    let Some(store) = edges_store().await else {
        return;
    };
    let tenant = fresh_tenant();
    let mut conn = store.pool().acquire().await.expect("connection");
    for attempt in 1..=3 {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
        let answer = backdated_charge(&mut tx, &tenant, "k", attempt > 1).await;
        match answer {
            Ok(value) => {
                assert_eq!(value, 42);
                tx.commit().await.expect("commit");
            }
            Err(Error::Store(e)) if attempt == 1 && e.to_string().contains("SET timestamp") => {
                tx.rollback().await.expect("rollback");
            }
            Err(e) => panic!("attempt {attempt}: {e}"),
        }
        conn.execute("SET timestamp = DEFAULT")
            .await
            .expect("reset the clock");
    }
    conn.close_on_drop();
    assert_eq!(
        writes(store.pool(), &tenant, "backdated").await,
        1,
        "the body's effect is committed once"
    );
    let identity = Identity::new(tenant.as_str(), "mysql_edges.backdated", "k").expect("identity");
    assert!(
        store.fetch(&identity).await.expect("fetch").is_some(),
        "the record is there, not expired"
    );
}

/// Four store-mode callers of a key a transactional-mode owner holds
/// uncommitted, the owner rolling back while they wait: none gets an error (no
/// InnoDB deadlock between waiters: they wait one at a time under GET_LOCK,
/// and the plain insert never queues on the row), and at most one acquires.
/// The others answer in progress (the store's lock wait ran out) or acquire
/// nothing; whatever the timing, an error fails the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn store_callers_behind_an_owner_that_rolls_back_get_no_errors() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let identity = Identity::new(fresh_tenant(), "edges.fresh_rollback", "k").expect("identity");
    let f = fp("a");
    let mut tx = admin.pool().begin().await.expect("begin");
    assert!(matches!(
        in_tx(&mut tx, &identity, Some(&f), WAIT).await,
        Reservation::Acquired { .. }
    ));
    let finished = Arc::new(AtomicUsize::new(0));
    let (mut ids, mut tasks) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        let own = guarded_store(1).await;
        ids.push(connection_id(own.pool()).await);
        let (identity, f, finished) = (identity.clone(), f.clone(), finished.clone());
        tasks.push(tokio::spawn(async move {
            let token = OwnerToken::new();
            let got = own
                .reserve(request(&identity, Some(&f), &token, LONG, LONG))
                .await;
            finished.fetch_add(1, Ordering::SeqCst);
            got
        }));
    }
    until_all_wait_or_finish(admin.pool(), &ids, &finished).await;
    tx.rollback().await.expect("the owner rolls back");
    let mut acquired = 0;
    for task in tasks {
        match task
            .await
            .expect("task")
            .expect("no store error for a caller behind a rollback")
        {
            Reservation::Acquired { .. } => acquired += 1,
            Reservation::InProgress { .. } => {}
            other => panic!("a waiter got {other:?}"),
        }
    }
    assert!(acquired <= 1, "{acquired} callers acquired one key");
}

// ---------------------------------------------------------------- one server, two databases

/// A store on a second database of the test server, `<database>_second`.
async fn store_on_a_second_database(first: &MySqlStore) -> MySqlStore {
    let url = mysql_url();
    let (server, db) = url.rsplit_once('/').expect("a database in the URL");
    let second = format!("{}_second", db.split('?').next().unwrap_or(db));
    first
        .pool()
        .execute(format!("CREATE DATABASE IF NOT EXISTS `{second}`").as_str())
        .await
        .expect("create the second database");
    MySqlStore::connect(&format!("{server}/{second}"))
        .await
        .expect("a store on the second database")
}

/// In `store`'s database: a transactional owner holds a new row of
/// `identity`, and a duplicate in another transaction waits for it inside the
/// reservation procedure, holding the identity's user-level lock (seen with
/// `IS_USED_LOCK`: a handshake, not a sleep). Returns the owner's transaction
/// and the waiter, to end once the other database has answered.
async fn hold_the_reservation_lock(
    store: &MySqlStore,
    identity: &Identity,
    f: &Fingerprint,
) -> (
    sqlx::Transaction<'static, MySql>,
    tokio::task::JoinHandle<Reservation>,
) {
    let mut owner = store.pool().begin().await.expect("begin");
    assert_eq!(
        in_tx(&mut owner, identity, Some(f), Duration::ZERO).await,
        Reservation::FRESH
    );
    let (pool, waiter_identity, waiter_f) = (store.pool().clone(), identity.clone(), f.clone());
    let (session_tx, session_rx) = tokio::sync::oneshot::channel();
    let waiter = tokio::spawn(async move {
        let mut dup = pool.begin().await.expect("begin");
        let _ = session_tx.send(connection_id(&mut *dup).await);
        let answer = in_tx(&mut dup, &waiter_identity, Some(&waiter_f), WAIT).await;
        dup.rollback().await.expect("rollback");
        answer
    });
    let session = session_rx.await.expect("the duplicate's session");
    // The lock's name as migration 0006 writes it (with the database) or as
    // 0005 did (without): the handshake holds on either.
    for _ in 0..3000 {
        let probe = sqlx::query_scalar::<_, Option<u64>>(
            "SELECT CAST(COALESCE(
                 IS_USED_LOCK(CONCAT('idempotency:', LEFT(SHA2(CONCAT(
                     LENGTH(DATABASE()), ':', DATABASE(),
                     LENGTH(?), ':', ?, LENGTH(?), ':', ?, ?), 256), 52))),
                 IS_USED_LOCK(CONCAT('idempotency:', LEFT(SHA2(CONCAT(
                     LENGTH(?), ':', ?, LENGTH(?), ':', ?, ?), 256), 52)))) AS UNSIGNED)",
        );
        let id = (
            identity.tenant().as_bytes(),
            identity.scope().as_bytes(),
            identity.key().as_bytes(),
        );
        let holder = (0..2)
            .fold(probe, |q, _| {
                q.bind(id.0).bind(id.0).bind(id.1).bind(id.1).bind(id.2)
            })
            .fetch_one(store.pool())
            .await
            .expect("IS_USED_LOCK");
        if holder == Some(session) {
            return (owner, waiter);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the duplicate never reached its lock wait");
}

/// Rules 1 and 3: two databases of one MariaDB server are two stores. A
/// reservation of (tenant, scope, key) waiting in database A does not hold up
/// the same identity in database B, where it is free: `GET_LOCK` names belong
/// to the whole server, and the procedure's lock name left the database out,
/// so B's transactional reservation (no wait) was refused `InProgress`.
#[tokio::test]
async fn a_fresh_key_is_free_beside_a_waiter_of_the_same_identity_in_another_database() {
    let Some(store_a) = mysql_store_or_skip().await else {
        return;
    };
    let store_b = store_on_a_second_database(&store_a).await;
    let identity = Identity::new(fresh_tenant(), "mysql_edges.two_databases", "k").expect("id");
    let f = fp("a");
    let (owner, waiter) = hold_the_reservation_lock(&store_a, &identity, &f).await;
    let mut in_b = store_b.pool().begin().await.expect("begin");
    let answer = in_tx(&mut in_b, &identity, Some(&f), Duration::ZERO).await;
    in_b.rollback().await.expect("rollback");
    owner.rollback().await.expect("rollback the owner in A");
    let _ = waiter.await.expect("the waiter in A");
    assert_eq!(
        answer,
        Reservation::FRESH,
        "B has no record of this identity"
    );
}

/// The same for a store-mode takeover of an expired lease in database B
/// (the procedure's write path): it waited a second for A's lock and was
/// refused `InProgress`.
#[tokio::test]
async fn a_takeover_is_not_held_up_by_a_waiter_of_the_same_identity_in_another_database() {
    let Some(store_a) = mysql_store_or_skip().await else {
        return;
    };
    let store_b = store_on_a_second_database(&store_a).await;
    let identity = Identity::new(fresh_tenant(), "mysql_edges.two_databases", "k").expect("id");
    let f = fp("a");
    // Database B: a record whose lease ran out (its owner crashed).
    let crashed = OwnerToken::new();
    let short = Duration::from_millis(1);
    assert_eq!(
        store_b
            .reserve(request(&identity, Some(&f), &crashed, short, LONG))
            .await
            .expect("reserve in B"),
        Reservation::FRESH
    );
    until_clock(&store_b, &identity, |s| {
        s.lease_expires_at_ms.is_some_and(|l| l <= s.now_ms)
    })
    .await;
    let (owner, waiter) = hold_the_reservation_lock(&store_a, &identity, &f).await;
    let takeover = store_b
        .reserve(request(&identity, Some(&f), &OwnerToken::new(), LONG, LONG))
        .await;
    owner.rollback().await.expect("rollback the owner in A");
    let _ = waiter.await.expect("the waiter in A");
    assert!(
        matches!(
            takeover,
            Ok(Reservation::Acquired {
                took_over: true,
                ..
            })
        ),
        "B's expired lease is taken over, whatever A's sessions do: got {takeover:?}"
    );
}

/// Rows two transactions lock in opposite orders, and the handshakes of
/// [`a_transaction_the_server_rolled_back_is_not_reported_as_a_takeover`].
#[derive(Default)]
struct Deadlock {
    first: i64,
    second: i64,
    /// The body holds `first`; the other transaction holds `second`.
    first_locked: Notify,
    second_locked: Notify,
    /// Whether the body's second lock was refused as a deadlock (1213).
    victim: std::sync::atomic::AtomicBool,
}

/// Locks `first`, then (once the other transaction holds it) `second`, while
/// the other transaction asks for `first`: whichever of the two waits comes
/// second closes the cycle, and InnoDB rolls back the lighter transaction,
/// this one. The body carries on and answers `Ok`.
#[idempotent(scope = "mysql_edges.deadlock", key = key, tenant = tenant, tx = tx, skip(rows))]
async fn deadlocked(
    tx: &mut sqlx::MySqlConnection,
    tenant: &str,
    key: &str,
    rows: &Deadlock,
) -> Result<u64, Error> {
    sqlx::query("UPDATE idempotent_test_deadlock SET n = n + 1 WHERE id = ?")
        .bind(rows.first)
        .execute(&mut *tx)
        .await
        .expect("lock the first row");
    // It waits for the other's lock until the deadlock is found, however
    // slow the server is (a pooled session may carry a shorter wait).
    (&mut *tx)
        .execute("SET SESSION innodb_lock_wait_timeout = 60")
        .await
        .expect("lock wait");
    rows.first_locked.notify_one();
    rows.second_locked.notified().await;
    let second = sqlx::query("UPDATE idempotent_test_deadlock SET n = n + 1 WHERE id = ?")
        .bind(rows.second)
        .execute(&mut *tx)
        .await;
    let deadlock =
        matches!(&second, Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40001"));
    rows.victim.store(deadlock, Ordering::SeqCst);
    Ok(1)
}

/// Transactional mode on MariaDB: InnoDB rolls a deadlock's victim back
/// whole, the reservation with it. The completion then finds no record, and
/// the call said `LeaseLost` ("taken over by another caller"), which nobody
/// did. It is now a store error saying the server rolled the transaction
/// back. Handshakes: each transaction asks for the other's row only once the
/// other holds it; the order of the two waits does not matter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_the_server_rolled_back_is_not_reported_as_a_takeover() {
    a_deadlock_victims_call_names_the_rollback(Session::Begin).await;
}

/// [`a_transaction_the_server_rolled_back_is_not_reported_as_a_takeover`]
/// on a session with `autocommit = 0`: there the body's next statement (and
/// the completion) opens a new transaction at once, so the session is still
/// "in a transaction" when the completion finds no record. It said
/// `LeaseLost` all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_autocommit_off_session_the_server_rolled_back_is_not_reported_as_a_takeover() {
    a_deadlock_victims_call_names_the_rollback(Session::AutocommitOff).await;
}

/// How the body's transaction is opened.
#[derive(Clone, Copy, Debug)]
enum Session {
    /// `BEGIN`, through sqlx.
    Begin,
    /// `SET autocommit = 0`: every statement opens a transaction.
    AutocommitOff,
}

/// The body's transaction is a deadlock's victim; the body carries on and
/// answers `Ok`; the call must say the server rolled it back.
async fn a_deadlock_victims_call_names_the_rollback(session: Session) {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    pool.execute(
        "CREATE TABLE IF NOT EXISTS idempotent_test_deadlock (id BIGINT PRIMARY KEY, n INT NOT NULL)",
    )
    .await
    .expect("table");
    let base = i64::from(rand_u16()) * 100 + i64::from(std::process::id() % 1000) * 10_000_000;
    let rows = Deadlock {
        first: base + 1,
        second: base + 2,
        ..Deadlock::default()
    };
    // The other transaction's filler rows make it the heavier one.
    for id in base + 1..=base + 12 {
        sqlx::query("REPLACE INTO idempotent_test_deadlock (id, n) VALUES (?, 0)")
            .bind(id)
            .execute(&pool)
            .await
            .expect("row");
    }
    let tenant = fresh_tenant();
    let mut tx = pool.acquire().await.expect("acquire");
    match session {
        Session::Begin => tx.execute("BEGIN").await.expect("begin"),
        Session::AutocommitOff => tx.execute("SET autocommit = 0").await.expect("autocommit"),
    };
    let call = deadlocked(&mut tx, &tenant, "k", &rows);
    let other = async {
        let mut conn = pool.acquire().await.expect("acquire");
        conn.execute("SET SESSION innodb_lock_wait_timeout = 60")
            .await
            .expect("lock wait");
        conn.execute("BEGIN").await.expect("begin");
        sqlx::query("UPDATE idempotent_test_deadlock SET n = n + 1 WHERE id BETWEEN ? AND ?")
            .bind(base + 2)
            .bind(base + 12)
            .execute(&mut *conn)
            .await
            .expect("update (locks the second row)");
        rows.second_locked.notify_one();
        rows.first_locked.notified().await;
        sqlx::query("UPDATE idempotent_test_deadlock SET n = n + 1 WHERE id = ?")
            .bind(base + 1)
            .execute(&mut *conn)
            .await
            .expect("the other transaction gets the first row once the victim is rolled back");
        conn.execute("ROLLBACK").await.expect("rollback");
        conn.close_on_drop();
    };
    let (answer, ()) = tokio::join!(call, other);
    assert!(
        rows.victim.load(Ordering::SeqCst),
        "the body's transaction was the deadlock's victim"
    );
    match answer {
        Err(Error::Store(e)) => assert!(e.to_string().contains("rolled back by the server"), "{e}"),
        other => panic!("{session:?}: expected a store error naming the rollback, got {other:?}"),
    }
    let _ = tx.execute("ROLLBACK").await;
    tx.close_on_drop();
    drop(tx);
    let identity = Identity::new(tenant.as_str(), "mysql_edges.deadlock", "k").expect("identity");
    assert!(
        store.fetch(&identity).await.expect("fetch").is_none(),
        "nothing recorded"
    );
}

/// A number for this test's rows, different from run to run.
fn rand_u16() -> u16 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos % 60_000) as u16
}

/// A transactional call (`in_progress = reject`) for a key nobody holds.
#[idempotent(scope = "mysql_edges.expired_locked_tx", key = key, tenant = tenant, tx = tx,
             skip(runs), ttl = "1h", in_progress = reject)]
async fn charge_in_tx(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    let _ = (&tx, tenant, key);
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

/// Transactional mode with `in_progress = reject`: an expired record that
/// another transaction holds for a moment (a purge deleting it) is not a
/// call in progress. The reservation waited no time at all for the row and
/// answered `InProgress` for a key nobody held (operations hunt: 4 of 10
/// transactional calls on expired keys while a purge ran). Handshake on the
/// server's process list: the holder lets go once the call is seen waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_call_waits_out_a_short_lock_on_an_expired_record() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "mysql_edges.expired_locked_tx", "k").expect("identity");
    let now_ms: i64 = sqlx::query_scalar(
        "SELECT CAST(UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) AS SIGNED)",
    )
    .fetch_one(store.pool())
    .await
    .expect("clock");
    // A completed record that expires in a moment, held by another
    // transaction before it does (a purge skips held rows, so another test's
    // purge cannot take it away first).
    let expires = now_ms + 300;
    sqlx::query(
        "INSERT INTO idempotency_records
             (tenant, scope, `key`, state, fingerprint, owner_token, is_error, result,
              lease_expires_at, expires_at, created_at, updated_at)
         VALUES (?, 'mysql_edges.expired_locked_tx', 'k', 'complete', NULL, NULL, 0, '1',
                 NULL, ?, ?, ?)",
    )
    .bind(&tenant)
    .bind(expires)
    .bind(now_ms)
    .bind(now_ms)
    .execute(store.pool())
    .await
    .expect("plant");
    let mut holder = store.pool().begin().await.expect("begin");
    let holder_id = connection_id(&mut *holder).await;
    sqlx::query(
        "SELECT state FROM idempotency_records WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .fetch_one(&mut *holder)
    .await
    .expect("hold the row");
    until_clock(&store, &identity, |r| r.is_expired()).await;

    let runs = Arc::new(AtomicUsize::new(0));
    let (started, caller_id) = (Arc::new(Notify::new()), Arc::new(AtomicUsize::new(0)));
    let calling = {
        let (pool, tenant, runs) = (store.pool().clone(), tenant.clone(), runs.clone());
        let (started, caller_id) = (started.clone(), caller_id.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin");
            let id = connection_id(&mut *tx).await;
            caller_id.store(id as usize, Ordering::SeqCst);
            started.notify_one();
            let answer = charge_in_tx(&mut tx, &tenant, "k", &runs).await;
            tx.commit().await.expect("commit");
            answer
        })
    };
    started.notified().await;
    let caller = caller_id.load(Ordering::SeqCst) as u64;
    assert_ne!(caller, holder_id);
    let mut seen_waiting = false;
    for _ in 0..3000 {
        if calling.is_finished() {
            break;
        }
        if waiting(store.pool(), &[caller]).await == 1 {
            seen_waiting = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    holder.rollback().await.expect("rollback");
    let answer = calling.await.expect("task");
    assert!(
        matches!(answer, Ok(7)),
        "a transactional call for an expired key held a moment by another transaction: {answer:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(seen_waiting, "the call waited for the row");
}

// ---------------------------------------------------------------- rule 3 / 10: a renewal beats a takeover

/// A takeover that read an expired lease must not overwrite a renewal its
/// owner committed before the takeover's write got the row: the owner's
/// heartbeat renewed the lease while the reservation was on its way, so the
/// record is in progress again and the reservation answers so (rules 3 and
/// 10). The renewal is committed by a transaction that holds the row while
/// the reservation's write waits for it (seen in the processlist, not
/// slept for), as the owner's heartbeat would have been just before it.
async fn a_renewal_committed_before_the_takeover_writes(via: Via) {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let admin = store.pool().clone();
    let identity = Identity::new(fresh_tenant(), "mysql_edges.renewed", "k").expect("identity");
    let f = fp("same");
    let owner = OwnerToken::new();
    let got = store
        .reserve(request(
            &identity,
            Some(&f),
            &owner,
            Duration::from_millis(1),
            LONG,
        ))
        .await
        .expect("plant");
    assert_eq!(got, Reservation::FRESH);
    until_clock(&store, &identity, |s| {
        s.lease_expires_at_ms.is_some_and(|l| l <= s.now_ms)
    })
    .await;

    // The owner's heartbeat, in a transaction that holds the row.
    let mut holder = admin.begin().await.expect("holder");
    let renewed = sqlx::query(
        "UPDATE idempotency_records
            SET lease_expires_at = UNIX_TIMESTAMP() * 1000 + 3600000
          WHERE tenant = ? AND scope = ? AND `key` = ?
            AND state = 'in_progress' AND owner_token = ?",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .bind(owner.as_str())
    .execute(&mut *holder)
    .await
    .expect("the owner renews");
    assert_eq!(renewed.rows_affected(), 1);

    let finished = Arc::new(AtomicUsize::new(0));
    let taker = OwnerToken::new();
    let (id2, f2, done, token) = (identity.clone(), f.clone(), finished.clone(), taker.clone());
    let (cid, task) = match via {
        Via::Store => {
            let pool = MySqlPoolOptions::new()
                .max_connections(1)
                .connect(&mysql_url())
                .await
                .expect("pool of one");
            let own = MySqlStore::from_pool(pool).await.expect("store");
            let cid = connection_id(own.pool()).await;
            (
                cid,
                tokio::spawn(async move {
                    let got = own
                        .reserve(request(&id2, Some(&f2), &token, LONG, LONG))
                        .await
                        .expect("reserve through the store");
                    done.fetch_add(1, Ordering::SeqCst);
                    got
                }),
            )
        }
        _ => {
            let mut conn = admin.acquire().await.expect("connection");
            let cid = connection_id(&mut *conn).await;
            (
                cid,
                tokio::spawn(async move {
                    let got = conn
                        .reserve_in_transaction(request(&id2, Some(&f2), &token, LONG, LONG), WAIT)
                        .await
                        .expect("reserve on an autocommit connection");
                    done.fetch_add(1, Ordering::SeqCst);
                    got
                }),
            )
        }
    };
    until_all_wait_or_finish(&admin, &[cid], &finished).await;
    holder.commit().await.expect("the renewal commits");
    let got = task.await.expect("the reservation");
    assert!(
        matches!(got, Reservation::InProgress { .. }),
        "{via:?}: a lease renewed before the takeover wrote is live: {got:?}"
    );
    let snap = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(
        snap.owner_token.as_deref(),
        Some(owner.as_str()),
        "{via:?}: the renewed owner keeps the record"
    );
    assert_eq!(snap.attempt, 1, "{via:?}: no takeover was counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_renewed_while_a_takeover_waits_for_the_row_is_not_taken_over() {
    a_renewal_committed_before_the_takeover_writes(Via::Autocommit).await;
    a_renewal_committed_before_the_takeover_writes(Via::Store).await;
}

/// Rule 16: an in-progress record whose retention ran out while its lease is
/// still live is in progress, not absent. The store's own read answers that
/// before the reservation procedure is called; a reservation inside a
/// transaction (or on an autocommit connection) asks the procedure itself,
/// which must answer the same: in progress, never an error and never a
/// replacement of the live owner's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_lease_past_its_ttl_is_in_progress_inside_a_transaction() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let admin = store.pool().clone();
    let identity =
        Identity::new(fresh_tenant(), "mysql_edges.ttl_over_lease_live", "k").expect("identity");
    let f = fp("same");
    let owner = OwnerToken::new();
    let got = store
        .reserve(request(
            &identity,
            Some(&f),
            &owner,
            LONG,
            Duration::from_millis(1),
        ))
        .await
        .expect("plant");
    assert_eq!(got, Reservation::FRESH);
    until_clock(&store, &identity, |s| s.expires_at_ms <= s.now_ms).await;

    let mut tx = admin.begin().await.expect("begin");
    let in_tx = tx
        .reserve_in_transaction(
            request(&identity, Some(&f), &OwnerToken::new(), LONG, LONG),
            WAIT,
        )
        .await;
    tx.rollback().await.expect("rollback");
    let mut conn = admin.acquire().await.expect("connection");
    let autocommit = conn
        .reserve_in_transaction(
            request(&identity, Some(&f), &OwnerToken::new(), LONG, LONG),
            WAIT,
        )
        .await;
    for (how, got) in [
        ("in a transaction", in_tx),
        ("on an autocommit connection", autocommit),
    ] {
        assert!(
            matches!(got, Ok(Reservation::InProgress { .. })),
            "{how}: a live lease past its ttl is in progress: {got:?}"
        );
    }
    let snap = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(snap.owner_token.as_deref(), Some(owner.as_str()));
}

/// A write of the store's worker behind a row another transaction holds (a
/// transactional-mode owner's) ends on the server within the worker's own
/// lock wait, not the sessions' `innodb_lock_wait_timeout` (50 s by
/// default): the worker cuts each attempt at its bound and tries again, and
/// every cut statement went on waiting on the server for the full 50 s,
/// holding one of the worker's two connections, so a few such writes kept a
/// completion handed over meanwhile (a body that had run) from its record
/// past the lease. The store is on a database of its own, so the server's
/// process list shows the worker's statements alone; the test watches the
/// first one end (its connection gone from the list, or a new statement
/// there) while the row is still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_statement_behind_a_held_row_ends_on_the_server() {
    const WAIT: Duration = Duration::from_secs(45);
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let database = common::servers::mysql_create_database(&admin, "edges_worker_wait").await;
    let url = match mysql_url().rsplit_once('/') {
        Some((server, _)) => format!("{server}/{database}"),
        None => panic!("a database in the URL"),
    };
    let store = MySqlStore::connect(&url).await.expect("a store");
    let identity =
        Identity::new(fresh_tenant(), "mysql_edges.worker_lock_wait", "k").expect("identity");
    let token = OwnerToken::new();
    let reserved = store
        .reserve(request(&identity, None, &token, LONG, LONG))
        .await
        .expect("reserve");
    assert!(
        matches!(reserved, Reservation::Acquired { .. }),
        "{reserved:?}"
    );
    let mut locker = <sqlx::MySqlConnection as sqlx::Connection>::connect(&url)
        .await
        .expect("connect");
    let locker_id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
        .fetch_one(&mut locker)
        .await
        .expect("id");
    locker.execute("BEGIN").await.expect("begin");
    let locked = sqlx::query(
        "SELECT state FROM idempotency_records \
         WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .fetch_all(&mut locker)
    .await
    .expect("lock the row");
    assert_eq!(locked.len(), 1, "the row is held");
    let outcome = idempotent_runtime::StoredOutcome {
        is_error: false,
        payload: b"7".to_vec(),
    };
    store.complete_detached(idempotent_runtime::Completion {
        identity: &identity,
        token: &token,
        outcome: &outcome,
        ttl: LONG,
        by: idempotent_runtime::AnsweredBy::Body,
    });
    // The statements running on the store's database, but the locker's and
    // this watcher's: (connection, milliseconds in its state).
    let watcher = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("watcher");
    let running = || {
        let watcher = watcher.clone();
        async move {
            sqlx::query_as::<_, (i64, f64)>(
                "SELECT CAST(ID AS SIGNED), CAST(TIME_MS AS DOUBLE) \
                   FROM information_schema.PROCESSLIST \
                  WHERE DB = DATABASE() AND COMMAND <> 'Sleep' \
                    AND ID NOT IN (?, CONNECTION_ID())",
            )
            .bind(locker_id)
            .fetch_all(&watcher)
            .await
            .expect("process list")
        }
    };
    let deadline = std::time::Instant::now() + WAIT;
    // The worker's write, waiting for the row for a second already.
    let (first, mut waited) = loop {
        if let Some(&(id, ms)) = running().await.iter().find(|(_, ms)| *ms > 1000.0) {
            break (id, ms);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the worker's statement never waited for the row"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    loop {
        match running().await.iter().find(|(id, _)| *id == first) {
            Some(&(_, ms)) if ms >= waited => waited = ms,
            _ => break,
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the worker's statement (connection {first}) still waits for the row on the server \
             after {waited} ms"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    locker.execute("COMMIT").await.expect("commit");
    assert_eq!(
        store.finish_background_work(Duration::from_secs(60)).await,
        0,
        "the completion landed"
    );
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("the record");
    drop((store, locker, watcher));
    sqlx::query(&format!("DROP DATABASE `{database}`"))
        .execute(admin.pool())
        .await
        .expect("drop database");
    assert_eq!(record.state, idempotent_runtime::RecordState::Complete);
}

/// The reservation procedure's answers are read in full. A store whose
/// sessions have autocommit off has every reservation answered by the
/// procedure: a live lease is told with the time it has left (the
/// `retry_after` a refused duplicate is given), a recorded error replays as
/// an error, and a takeover after a lease ran out is counted as the second
/// attempt with when the first one started (what a `recover` hook is told,
/// rule 20).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_procedures_answers_are_read_in_full() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let store = autocommit_off_store(1).await;
    let tenant = fresh_tenant();
    let f = fp("a");

    let running = Identity::new(&tenant, "edges.procedure_answers", "running").expect("id");
    let owner = OwnerToken::new();
    let lease = Duration::from_secs(600);
    admin
        .reserve(request(&running, Some(&f), &owner, lease, LONG))
        .await
        .expect("reserve");
    let other = OwnerToken::new();
    match store
        .reserve(request(&running, Some(&f), &other, lease, LONG))
        .await
        .expect("reserve")
    {
        Reservation::InProgress { lease_remaining } => assert!(
            lease_remaining > Duration::from_secs(60) && lease_remaining <= lease,
            "a lease of {lease:?} was told as {lease_remaining:?} left"
        ),
        other => panic!("expected InProgress, got {other:?}"),
    }

    let failed = Identity::new(&tenant, "edges.procedure_answers", "failed").expect("id");
    let owner = OwnerToken::new();
    admin
        .reserve(request(&failed, Some(&f), &owner, LONG, LONG))
        .await
        .expect("reserve");
    let error = StoredOutcome {
        is_error: true,
        payload: b"\"declined\"".to_vec(),
    };
    assert!(admin
        .complete(Completion::by_body(&failed, &owner, &error, LONG))
        .await
        .expect("complete")
        .is_written());
    let other = OwnerToken::new();
    match store
        .reserve(request(&failed, Some(&f), &other, LONG, LONG))
        .await
        .expect("reserve")
    {
        Reservation::Completed(outcome) => assert_eq!(outcome, error),
        other => panic!("expected the recorded error, got {other:?}"),
    }

    let lost = Identity::new(&tenant, "edges.procedure_answers", "lost").expect("id");
    let owner = OwnerToken::new();
    admin
        .reserve(request(&lost, Some(&f), &owner, lease, LONG))
        .await
        .expect("reserve");
    let started = admin
        .fetch(&lost)
        .await
        .expect("fetch")
        .expect("the record")
        .attempt_started_at_ms;
    // The owner ends its lease (a zero lease), as a crashed owner's runs out.
    assert!(admin
        .heartbeat(&lost, &owner, Duration::ZERO)
        .await
        .expect("heartbeat")
        .is_written());
    let taker = OwnerToken::new();
    match store
        .reserve(request(&lost, Some(&f), &taker, lease, LONG))
        .await
        .expect("reserve")
    {
        Reservation::Acquired {
            attempt,
            previous_attempt_started_at_ms,
            ..
        } => {
            assert_eq!(attempt, 2, "a takeover is the second attempt");
            assert_eq!(previous_attempt_started_at_ms, Some(started));
        }
        other => panic!("expected a takeover, got {other:?}"),
    }
}

/// A transactional body that waits for the test's go before it returns
/// (when given a hold).
#[idempotent(scope = "mysql_edges.stalled", key = key, tenant = tenant, tx = tx, ttl = "1h",
             skip(hold))]
async fn stalled_charge(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    if let Some(hold) = hold {
        hold.reached.notify_one();
        hold.go.notified().await;
    }
    Ok(42)
}

/// A transactional completion whose statement waits longer than a second
/// before the server evaluates it (here a metadata lock on a table a trigger
/// of the records' table names; in production a backup's global read lock
/// or a saturated server): the statement's `NOW(6)` and `SYSDATE(6)` then
/// lie more than a second apart, which the clock guard reads as a clock the
/// body set. The caller's transaction is open, the record is its own, the
/// clock is the server's: the answer is recorded, not refused as "the
/// caller's transaction ended".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_completion_that_waits_over_a_second_is_recorded() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let database = common::servers::mysql_create_database(&admin, "edges_stall").await;
    let url = match mysql_url().rsplit_once('/') {
        Some((server, _)) => format!("{server}/{database}"),
        None => panic!("a database in the URL"),
    };
    let store = MySqlStore::connect(&url).await.expect("a store");
    for ddl in [
        "CREATE TABLE stall_side (id INT) ENGINE = InnoDB",
        "CREATE TRIGGER stall_prelock BEFORE UPDATE ON idempotency_records FOR EACH ROW \
         BEGIN IF NEW.scope = '' THEN INSERT INTO stall_side VALUES (1); END IF; END",
    ] {
        store.pool().execute(ddl).await.expect("ddl");
    }
    let tenant = fresh_tenant();
    let mut conn = store.pool().acquire().await.expect("connection");
    // A first call prepares the completion on this connection, so the
    // second one's waits where it runs, after its clock started.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
    assert_eq!(
        stalled_charge(&mut tx, &tenant, "warm", None)
            .await
            .expect("first call"),
        42
    );
    tx.commit().await.expect("commit");
    let hold = Arc::new(Hold::default());
    let call = tokio::spawn({
        let (hold, tenant) = (hold.clone(), tenant.clone());
        async move {
            let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
            let answer = stalled_charge(&mut tx, &tenant, "k", Some(&hold)).await;
            match answer {
                Ok(_) => tx.commit().await.expect("commit"),
                Err(_) => tx.rollback().await.expect("rollback"),
            }
            answer
        }
    });
    hold.reached.notified().await;
    let mut locker = store.pool().acquire().await.expect("connection");
    locker
        .execute("LOCK TABLES stall_side WRITE")
        .await
        .expect("lock the trigger's table");
    hold.go.notify_one();
    // Until the server shows the completion waiting for over a second.
    let mut waited = false;
    for _ in 0..3000 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST
              WHERE DB = DATABASE() AND STATE LIKE 'Waiting for table metadata lock%'
                AND INFO LIKE '%state = ''complete''%' AND TIME >= 2",
        )
        .fetch_one(&mut *locker)
        .await
        .expect("process list");
        if waiting > 0 {
            waited = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    locker.execute("UNLOCK TABLES").await.expect("unlock");
    drop(locker);
    let answer = call.await.expect("the call's task");
    store.pool().close().await;
    admin
        .pool()
        .execute(format!("DROP DATABASE `{database}`").as_str())
        .await
        .expect("drop database");
    assert!(waited, "the completion never showed waiting");
    assert!(matches!(answer, Ok(42)), "{answer:?}");
}

// ---------------------------------------------------------------- §5: migrations on a brand-new database

/// DESIGN.md §5: the schema migrations apply themselves "also when several
/// processes open a brand-new database at the same moment". Several stores
/// open one brand-new MariaDB/MySQL database at once, three rounds: every
/// open succeeds, and the database ends up with the whole history, each
/// migration once (as many as the test server's migrated database has).
/// PostgreSQL's counterpart is
/// `postgres_edges::concurrent_first_opens_migrate_once_under_a_repeatable_read_default`,
/// SQLite's `sqlite_edges` (many tasks and processes on one new file).
#[tokio::test]
async fn concurrent_first_opens_of_a_brand_new_database_migrate_once() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let expected: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_schema_migrations")
        .fetch_one(admin.pool())
        .await
        .expect("the migrated test database's history");
    let url = mysql_url();
    let (server, rest) = url.rsplit_once('/').expect("a database in the URL");
    let query = rest.split_once('?').map(|(_, query)| query);
    let mut failures = Vec::new();
    for round in 0..3 {
        let db = common::servers::mysql_create_database(&admin, "first_opens").await;
        let db_url = match query {
            Some(query) => format!("{server}/{db}?{query}"),
            None => format!("{server}/{db}"),
        };
        let opened = futures::future::join_all((0..6).map(|_| {
            let db_url = db_url.clone();
            tokio::spawn(async move {
                let store = MySqlStore::connect(&db_url).await?;
                store.pool().close().await;
                Ok::<_, Error>(())
            })
        }))
        .await;
        for open in opened {
            if let Err(e) = open.expect("an open's task") {
                failures.push(format!("round {round}: {e}"));
            }
        }
        let history: Result<i64, _> = sqlx::query_scalar(&format!(
            "SELECT COUNT(DISTINCT version) FROM `{db}`.idempotency_schema_migrations"
        ))
        .fetch_one(admin.pool())
        .await;
        admin
            .pool()
            .execute(format!("DROP DATABASE `{db}`").as_str())
            .await
            .expect("drop database");
        match history {
            Ok(n) if n == expected => {}
            other => failures.push(format!(
                "round {round}: history {other:?}, expected {expected} migrations"
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "concurrent first opens of a new database failed: {failures:#?}"
    );
}

// ---------------------------------------------------------------- §5: statements per call

#[idempotent(scope = "mysql_edges.counted", key = key, tenant = tenant, store = store, ttl = "1h")]
async fn counted_call(
    store: &MySqlStore,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    Ok(amount)
}

/// The statements the one session of `pool` has had executed
/// (`Questions`, which counts no ping and no prepare), this read included.
async fn statements_so_far(pool: &MySqlPool) -> i64 {
    let row = pool
        .fetch_one("SHOW SESSION STATUS LIKE 'Questions'")
        .await
        .expect("the session's Questions");
    let value: String = sqlx::Row::try_get(&row, 1).expect("its value");
    value.parse().expect("a count")
}

/// DESIGN.md §5: per call, one round trip to reserve (acquire, replay,
/// in-progress and mismatch all answered by the same statement) and one to
/// complete; a replay is the one reservation. Counted by the server on the
/// only session of the store's pool: a fresh call is two statements, a
/// replay one. (A mismatch is answered by the reservation too, and then
/// read once more to say what refused it: not counted here.) (The engine's side of the floor, one
/// reservation and one completion per call, is `engine_accounting`'s; this
/// is the store's.)
#[tokio::test]
async fn a_call_costs_one_statement_to_reserve_and_one_to_complete() {
    if mysql_store_or_skip().await.is_none() {
        return;
    }
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .test_before_acquire(false)
        .connect(&mysql_url())
        .await
        .expect("a pool of one session");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let tenant = fresh_tenant();
    // What one read of the count costs; and every statement the calls use
    // prepared once, before anything is counted.
    assert_eq!(counted_call(&store, &tenant, "warm", 1).await.unwrap(), 1);
    assert_eq!(counted_call(&store, &tenant, "warm", 1).await.unwrap(), 1);
    let before = statements_so_far(&pool).await;
    let read = statements_so_far(&pool).await - before;
    let cost = |from: i64, to: i64| to - from - read;

    let before = statements_so_far(&pool).await;
    assert_eq!(counted_call(&store, &tenant, "k", 7).await.unwrap(), 7);
    let fresh = cost(before, statements_so_far(&pool).await);
    let before = statements_so_far(&pool).await;
    assert_eq!(counted_call(&store, &tenant, "k", 7).await.unwrap(), 7);
    let replay = cost(before, statements_so_far(&pool).await);
    pool.close().await;
    assert_eq!(
        (fresh, replay),
        (2, 1),
        "statements for (a fresh call, its replay)"
    );
}

// ---------------------------------------------------------------- 0013: legitimate takeovers in a new transaction

/// A consistent read that opens the transaction's REPEATABLE READ snapshot
/// (whatever the tenant's records are).
async fn open_snapshot(tx: &mut sqlx::Transaction<'_, MySql>, tenant: &str) {
    let _: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records WHERE tenant = ?")
        .bind(tenant)
        .fetch_one(&mut **tx)
        .await
        .expect("a consistent read");
}

/// Reserves `identity` in new transactions until one is not refused as
/// stale (0008 refuses a lease that ran out in the second its transaction
/// began; the README's remedy is a new transaction), and commits it.
/// Bounded: 50 transactions.
async fn reserve_in_new_transactions(
    store: &MySqlStore,
    identity: &Identity,
    lease: Duration,
) -> Reservation {
    for _ in 0..50 {
        let mut tx = store.pool().begin().await.expect("begin");
        let token = OwnerToken::new();
        match tx
            .reserve_in_transaction(request(identity, None, &token, lease, LONG), WAIT)
            .await
        {
            Ok(got) => {
                tx.commit().await.expect("commit");
                return got;
            }
            Err(Error::StaleSnapshot { .. }) => {
                tx.rollback().await.expect("rollback");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    panic!("refused as stale in 50 new transactions");
}

/// Waits until the record's lease has run out on the database clock.
async fn until_lease_ran_out(store: &MySqlStore, identity: &Identity) {
    until_clock(store, identity, |s| {
        s.lease_expires_at_ms.is_some_and(|l| l <= s.now_ms)
    })
    .await;
}

/// 0013 makes a transaction take over only the version of the record its
/// snapshot read, and refuses a takeover (or a replacement of an
/// in-progress record) on a later version as stale. A legitimate takeover
/// must still go through in a new transaction: an owner taken over and
/// crashed twice (the old snapshot saw the first crash), a completed record
/// replaced and crashed (the old snapshot saw it completed), an in-progress
/// record replaced and crashed (the old snapshot saw the first one). The old
/// transaction may be refused (it must not take over on a version it did not
/// read); a new one takes over, with the attempt counted.
///
/// In a database of its own: other tests' purges would delete its expired
/// records part-way.
#[tokio::test]
async fn a_takeover_refused_to_an_old_snapshot_goes_through_in_a_new_transaction() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = mysql_create_database(&admin, "edges_v0013").await;
    let url = mysql_url_of(&mysql_url(), &db);
    let checked = tokio::spawn(async move {
        let store = MySqlStore::connect(&url).await.expect("a store of its own");
        takeovers_refused_to_an_old_snapshot_go_through_in_new_transactions(store).await;
    })
    .await;
    mysql_drop_then_check(&admin, &[&db], checked).await;
}

async fn takeovers_refused_to_an_old_snapshot_go_through_in_new_transactions(store: MySqlStore) {
    let tenant = fresh_tenant();
    let short = Duration::from_millis(1);

    // Taken over and crashed twice.
    let identity = Identity::new(&tenant, "edges.v0013", "twice").expect("identity");
    let first = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(&identity, None, &first, short, LONG))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    until_lease_ran_out(&store, &identity).await;
    let mut old = store.pool().begin().await.expect("begin");
    open_snapshot(&mut old, &tenant).await;
    let second = reserve_in_new_transactions(&store, &identity, short).await;
    assert!(
        matches!(
            second,
            Reservation::Acquired {
                took_over: true,
                attempt: 2,
                ..
            }
        ),
        "{second:?}"
    );
    until_lease_ran_out(&store, &identity).await;
    let token = OwnerToken::new();
    let got = old
        .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
        .await;
    old.rollback().await.expect("rollback");
    eprintln!("twice, old snapshot: {got:?}");
    assert!(
        matches!(got, Err(Error::StaleSnapshot { .. })),
        "the old snapshot read the first crash only: {got:?}"
    );
    let third = reserve_in_new_transactions(&store, &identity, LONG).await;
    assert!(
        matches!(
            third,
            Reservation::Acquired {
                took_over: true,
                attempt: 3,
                ..
            }
        ),
        "a new transaction takes over the second crash: {third:?}"
    );

    // Completed, expired, replaced and crashed.
    let identity = Identity::new(&tenant, "edges.v0013", "replaced").expect("identity");
    let owner = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(&identity, None, &owner, LONG, LONG))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    assert_eq!(
        store
            .complete(Completion::by_body(
                &identity,
                &owner,
                &ok(b"1"),
                Duration::from_millis(200)
            ))
            .await
            .expect("complete"),
        Fenced::Written
    );
    until_clock(&store, &identity, |s| s.expires_at_ms <= s.now_ms).await;
    let mut old = store.pool().begin().await.expect("begin");
    open_snapshot(&mut old, &tenant).await;
    let replacer = OwnerToken::new();
    let got = store
        .reserve(request(&identity, None, &replacer, short, LONG))
        .await
        .expect("replace");
    assert!(
        matches!(
            got,
            Reservation::Acquired {
                took_over: false,
                attempt: 1,
                ..
            }
        ),
        "{got:?}"
    );
    until_lease_ran_out(&store, &identity).await;
    let token = OwnerToken::new();
    let got = old
        .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
        .await;
    old.rollback().await.expect("rollback");
    eprintln!("replaced, old snapshot: {got:?}");
    assert!(
        matches!(got, Err(Error::StaleSnapshot { .. })),
        "the old snapshot read the completed record only: {got:?}"
    );
    let got = reserve_in_new_transactions(&store, &identity, LONG).await;
    assert!(
        matches!(
            got,
            Reservation::Acquired {
                took_over: true,
                attempt: 2,
                ..
            }
        ),
        "a new transaction takes over the crashed replacement: {got:?}"
    );

    // In progress, expired (lease and ttl), replaced and crashed the same way.
    let identity = Identity::new(&tenant, "edges.v0013", "replaced_in_progress").expect("identity");
    let ttl = Duration::from_millis(200);
    let crashed = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(&identity, None, &crashed, short, ttl))
            .await
            .expect("reserve"),
        Reservation::FRESH
    );
    until_clock(&store, &identity, |s| s.expires_at_ms <= s.now_ms).await;
    let mut old = store.pool().begin().await.expect("begin");
    open_snapshot(&mut old, &tenant).await;
    let replacer = OwnerToken::new();
    let got = store
        .reserve(request(&identity, None, &replacer, short, ttl))
        .await
        .expect("replace");
    assert!(
        matches!(
            got,
            Reservation::Acquired {
                took_over: false,
                attempt: 1,
                ..
            }
        ),
        "{got:?}"
    );
    until_clock(&store, &identity, |s| s.expires_at_ms <= s.now_ms).await;
    let token = OwnerToken::new();
    let got = old
        .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
        .await;
    old.rollback().await.expect("rollback");
    eprintln!("replaced in progress, old snapshot: {got:?}");
    assert!(
        matches!(got, Err(Error::StaleSnapshot { .. })),
        "the old snapshot read the first record only: {got:?}"
    );
    let got = reserve_in_new_transactions(&store, &identity, LONG).await;
    assert!(
        matches!(
            got,
            Reservation::Acquired {
                took_over: false,
                attempt: 1,
                ..
            }
        ),
        "a new transaction replaces the crashed replacement: {got:?}"
    );
}

/// A store-mode owner of a fresh record of `scope` (in a tenant of its
/// own), with a lease of `lease` and no heartbeat.
async fn a_live_owner(store: &MySqlStore, scope: &str, lease: Duration) -> (Identity, OwnerToken) {
    let identity = Identity::new(fresh_tenant(), scope, "k").expect("identity");
    let owner = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(&identity, None, &owner, lease, LONG))
            .await
            .expect("the owner reserves"),
        Reservation::FRESH
    );
    (identity, owner)
}

/// A call on `conn`, in a SERIALIZABLE transaction, finds the owner's lease
/// live: its read locked the record, and it is refused as stale.
async fn refused_a_look_at(
    conn: &mut sqlx::MySqlConnection,
    identity: &Identity,
    token: &OwnerToken,
) {
    let first = conn
        .reserve_in_transaction(request(identity, None, token, LONG, LONG), WAIT)
        .await;
    assert!(
        matches!(first, Err(Error::StaleSnapshot { .. })),
        "{first:?}"
    );
}

/// The owner renews its lease once, in a task of its own (the renewal may
/// wait for a transaction's lock).
fn renew_once(
    store: &MySqlStore,
    identity: &Identity,
    owner: &OwnerToken,
    lease: Duration,
) -> tokio::task::JoinHandle<Result<Fenced, idempotent_runtime::StoreError>> {
    let (store, identity, owner) = (store.clone(), identity.clone(), owner.clone());
    tokio::spawn(async move { store.heartbeat(&identity, &owner, lease).await })
}

/// Under SERIALIZABLE the read of a transactional call is a locking one: a
/// call that finds a live owner's record holds a shared lock on it (refused
/// as `StaleSnapshot`), and the owner's renewal waits for that lock. A
/// caller that calls again in the same transaction once the lease has run
/// out waiting reads the latest version (its read locks, so it is never a
/// stale snapshot) and its version check of 0013 matches: only the
/// `innodb_trx` check of 0008 stands between it and a takeover of the live
/// owner, and that table leaves the transaction out while something reads it
/// more often than every 0.1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_serializable_transaction_calling_again_never_takes_over_the_owner_it_starved() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let reader = InnodbTrxReader::start(store.pool());
    let lease = Duration::from_millis(1500);
    let (identity, owner) = a_live_owner(&store, "edges.serializable_again", lease).await;
    let pool = one_connection_at("SERIALIZABLE").await;
    let mut tx = pool.begin().await.expect("begin");
    let token = OwnerToken::new();
    refused_a_look_at(&mut tx, &identity, &token).await;
    // The owner renews; its renewal waits for the transaction's lock.
    let renewal = renew_once(&store, &identity, &owner, lease);
    until_lease_ran_out(&store, &identity).await;
    let again = tx
        .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
        .await;
    let _ = tx.rollback().await;
    let renewed = renewal.await.expect("renewal task");
    reader.stop().await;
    eprintln!("again: {again:?}; the owner's renewal: {renewed:?}");
    assert!(
        !matches!(again, Ok(Reservation::Acquired { .. })),
        "a transaction took over the owner whose renewal waited for its lock: {again:?}; the owner's renewal: {renewed:?}"
    );
}

/// A savepoint rolled back: MariaDB (10.11) lets go of the row locks taken
/// after it, MySQL keeps them. A SERIALIZABLE call in a nested transaction
/// (sqlx's `begin` on a transaction: a savepoint) finds a live owner and is
/// refused (its read locked the record); the nested transaction is rolled
/// back and the owner renews. Where the renewal waits for the outer
/// transaction's lock (MySQL), the call again once the lease has run out is
/// refused: the marks (0014) outlive `ROLLBACK TO SAVEPOINT`. Where the
/// renewal goes through (the lock went with the savepoint, MariaDB), the
/// owner then crashes, and the call again may take the renewed version over
/// (the transaction never locked it) or be refused all the same (0008, when
/// `innodb_trx` shows the transaction, whose start came before that lease
/// ran out; or this process still counting the owner at work for a moment
/// after its lease on the database's clock): never any other answer.
/// `innodb_trx` is read often throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_again_after_rolling_back_to_a_savepoint_takes_over_only_what_it_did_not_starve() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let reader = InnodbTrxReader::start(store.pool());
    let lease = Duration::from_millis(1500);
    let (identity, owner) = a_live_owner(&store, "edges.savepoint_again", lease).await;
    let pool = one_connection_at("SERIALIZABLE").await;
    let mut tx = pool.begin().await.expect("begin");
    let token = OwnerToken::new();
    let mut nested = sqlx::Connection::begin(&mut *tx).await.expect("savepoint");
    refused_a_look_at(&mut nested, &identity, &token).await;
    nested.rollback().await.expect("rollback to the savepoint");
    let renewal = renew_once(&store, &identity, &owner, lease);
    // The lease runs out: renewed once and then crashed, or starved.
    until_lease_ran_out(&store, &identity).await;
    let starved = !renewal.is_finished();
    let again = tx
        .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
        .await;
    let _ = tx.rollback().await;
    let renewed = renewal.await.expect("renewal task");
    reader.stop().await;
    if starved {
        assert!(
            matches!(again, Err(Error::StaleSnapshot { .. })),
            "a transaction rolled back to a savepoint took over the owner its lock starved: {again:?}; the owner's renewal: {renewed:?}"
        );
    } else {
        assert!(matches!(renewed, Ok(Fenced::Written)), "{renewed:?}");
        assert!(
            matches!(
                again,
                Ok(Reservation::Acquired {
                    took_over: true,
                    ..
                }) | Err(Error::StaleSnapshot { .. })
            ),
            "the owner renewed and crashed: {again:?}"
        );
    }
}

/// A transaction's marks (0014) end with it: after a SERIALIZABLE
/// transaction was refused a live owner's record (its lock marked that
/// version) and rolled back, or committed, the owner crashes; a new
/// transaction on the same connection takes the record over once the lease
/// has run out, the same version notwithstanding. Also with autocommit off,
/// where a transaction ends with COMMIT and the next begins by itself.
#[tokio::test]
async fn a_version_marked_by_an_ended_transaction_is_taken_over_by_the_next() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let lease = Duration::from_millis(300);
    for (end, autocommit_off) in [("rollback", false), ("commit", false), ("commit", true)] {
        let key = format!("{end}-{autocommit_off}");
        let (identity, _crashed) = a_live_owner(&store, "edges.marks_end", lease).await;
        let pool = one_connection_at("SERIALIZABLE").await;
        let mut conn = pool.acquire().await.expect("a connection");
        let begin = if autocommit_off {
            "SET autocommit = 0"
        } else {
            "BEGIN"
        };
        conn.execute(begin).await.expect("begin");
        refused_a_look_at(&mut conn, &identity, &OwnerToken::new()).await;
        conn.execute(if end == "rollback" {
            "ROLLBACK"
        } else {
            "COMMIT"
        })
        .await
        .expect("end the transaction");
        // The owner crashed: its lease runs out unrenewed.
        until_lease_ran_out(&store, &identity).await;
        // New transactions on the connection, until one is not refused as
        // stale (0008 refuses one while `innodb_trx` still shows the
        // connection's previous transaction, whose start came before the
        // lease ran out; the README's remedy is a new transaction). Bounded:
        // 50 transactions; marks that outlived their transaction would
        // refuse them all.
        let mut again = None;
        for _ in 0..50 {
            if !autocommit_off {
                conn.execute("BEGIN").await.expect("begin again");
            }
            let taker = OwnerToken::new();
            let got = conn
                .reserve_in_transaction(request(&identity, None, &taker, LONG, LONG), WAIT)
                .await;
            conn.execute("ROLLBACK").await.expect("roll back");
            match got {
                Err(Error::StaleSnapshot { .. }) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                got => {
                    again = Some(got);
                    break;
                }
            }
        }
        assert!(
            matches!(
                again,
                Some(Ok(Reservation::Acquired {
                    took_over: true,
                    ..
                }))
            ),
            "{key}: new transactions are refused a crashed owner's record: {again:?}"
        );
    }
}

/// InnoDB shows `information_schema.innodb_trx` through a cache that it
/// refreshes only once nobody has read the table for 0.1 s. While something
/// reads it more often (a monitoring agent; other transactions' takeover
/// checks; the caller's own retries, each of which reads it), the cache may
/// go on showing a transaction of the caller's connection that has ended.
/// A transaction begun on that connection after a crashed owner's lease ran
/// out was then judged by the old transaction's start, which came before the
/// lease ran out, and refused as stale (0008): every new transaction, for as
/// long as the reads went on (rule 10: once the lease is over, the next
/// caller takes the record over). A takeover in a new transaction now goes
/// through, after at most one refusal on the connection (the one that lets
/// the session tell the old transaction's row from its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_transaction_takes_over_a_crashed_owner_while_innodb_trx_shows_an_ended_one() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    // Long enough that the transaction begun first (at once) began a whole
    // second before the lease ran out: `innodb_trx` tells whole seconds.
    let lease = Duration::from_secs(3);
    let pool = one_connection_at("REPEATABLE READ").await;
    let mut conn = pool.acquire().await.expect("a connection");
    let thread: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut *conn)
        .await
        .expect("connection id");
    // Set up (bounded: other tests' readers may keep the cache from ever
    // showing the transaction, or a pause of the reader may let it refresh).
    let mut set_up = None;
    for _ in 0..5 {
        let (identity, crashed) = a_live_owner(&store, "edges.innodb_trx_ended", lease).await;
        // A transaction of the connection begins while the lease is live.
        conn.execute("BEGIN").await.expect("begin");
        conn.execute("SELECT COUNT(*) FROM idempotency_records")
            .await
            .expect("a read in the transaction");
        // Until `innodb_trx` shows it (its cache refreshes once it has not
        // been read for 0.1 s), then read often from there on.
        let mut shown = false;
        for _ in 0..10 {
            if innodb_trx_shows(store.pool(), thread).await {
                shown = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let reader = shown.then(|| InnodbTrxReader::start(store.pool()));
        conn.execute("ROLLBACK").await.expect("roll back");
        // The cache still shows the ended transaction.
        match reader {
            Some(reader) if innodb_trx_shows(store.pool(), thread).await => {
                set_up = Some((identity, crashed, reader));
                break;
            }
            Some(reader) => reader.stop().await,
            None => {}
        }
    }
    let Some((identity, _crashed, reader)) = set_up else {
        eprintln!(
            "SKIPPED: innodb_trx never showed an ended transaction of the connection \
             (its cache kept frozen or refreshed by other readers)"
        );
        return;
    };
    // The owner crashed: its lease runs out unrenewed.
    until_lease_ran_out(&store, &identity).await;
    // New transactions on the connection, each begun after the lease ran
    // out; bounded (50: refused for as long as the reads went on before).
    let (refused, again) = new_transactions_until_not_refused(&mut conn, &identity).await;
    reader.stop().await;
    assert!(
        matches!(
            again,
            Some(Ok(Reservation::Acquired {
                took_over: true,
                ..
            }))
        ),
        "new transactions begun after the lease ran out were refused a crashed owner's record \
         ({refused} refused): {again:?}"
    );
    assert!(refused <= 1, "refused {refused} times before the takeover");
}

/// `innodb_trx` tells a transaction's start in whole seconds, rounded down:
/// a transaction begun after a crashed owner's lease ran out, in the second
/// it ran out, looked as if it had begun before, and was refused as stale
/// (0008), as was every new transaction on the connection until that second
/// was over. A new transaction on the connection now takes the record over
/// after one refusal at most (the refused one's check says the next began
/// after the lease ran out). The lease is made to run out early in a second
/// of the database's clock.
#[tokio::test]
async fn a_new_transaction_begun_in_the_second_a_lease_ran_out_takes_it_over() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let lease = Duration::from_millis(300);
    // Until the database's clock is early in a second (bounded: 20 looks).
    for _ in 0..20 {
        let now_ms: i64 =
            sqlx::query_scalar("SELECT CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)")
                .fetch_one(store.pool())
                .await
                .expect("the database's clock");
        let into_the_second = now_ms.rem_euclid(1000);
        if (50..150).contains(&into_the_second) {
            break;
        }
        let until = (1050 - into_the_second).rem_euclid(1000);
        tokio::time::sleep(Duration::from_millis(u64::try_from(until).unwrap_or(0))).await;
    }
    let (identity, _crashed) = a_live_owner(&store, "edges.second_of_the_lease", lease).await;
    let pool = one_connection_at("REPEATABLE READ").await;
    let mut conn = pool.acquire().await.expect("a connection");
    // The owner crashed: its lease runs out unrenewed.
    until_lease_ran_out(&store, &identity).await;
    let (refused, again) = new_transactions_until_not_refused(&mut conn, &identity).await;
    assert!(
        matches!(
            again,
            Some(Ok(Reservation::Acquired {
                took_over: true,
                ..
            }))
        ),
        "new transactions begun after the lease ran out were refused a crashed owner's record \
         ({refused} refused): {again:?}"
    );
    assert!(
        refused <= 1,
        "refused {refused} times before the takeover, all begun after the lease ran out"
    );
}

/// Reserves `identity` in new transactions on `conn` (each rolled back),
/// until one is not refused `StaleSnapshot` (bounded: 50); answers how many
/// were refused, and the first other answer.
async fn new_transactions_until_not_refused(
    conn: &mut sqlx::MySqlConnection,
    identity: &Identity,
) -> (usize, Option<Result<Reservation, Error>>) {
    let mut refused = 0;
    for _ in 0..50 {
        conn.execute("BEGIN").await.expect("begin");
        let taker = OwnerToken::new();
        let got = conn
            .reserve_in_transaction(request(identity, None, &taker, LONG, LONG), WAIT)
            .await;
        conn.execute("ROLLBACK").await.expect("roll back");
        match got {
            Err(Error::StaleSnapshot { .. }) => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            got => return (refused, Some(got)),
        }
    }
    (refused, None)
}

/// Whether `information_schema.innodb_trx` (InnoDB's cache of it) shows a
/// transaction of the connection whose id is `thread`.
async fn innodb_trx_shows(pool: &MySqlPool, thread: u64) -> bool {
    let rows: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_mysql_thread_id = ?",
    )
    .bind(thread)
    .fetch_one(pool)
    .await
    .expect("read innodb_trx");
    rows > 0
}

/// READ COMMITTED: a takeover whose fenced write meets a renewal committed
/// after its read fails, and the locking re-read of 0006 keeps a shared lock
/// on the record (`StaleSnapshot`). Each later read of the transaction sees
/// the latest committed version, which that lock freezes: a call again once
/// the starved lease has run out matches the version it read, and only the
/// `innodb_trx` check of 0008 refuses it (not while that table is read more
/// often than every 0.1 s). The call marks the version it locked (0014),
/// and the call again is refused as stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_committed_transaction_calling_again_never_takes_over_the_owner_it_starved() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let reader = InnodbTrxReader::start(store.pool());
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "edges.read_committed_again", "k").expect("identity");
    let lease = Duration::from_millis(1500);
    let owner = OwnerToken::new();
    assert_eq!(
        store
            .reserve(request(
                &identity,
                None,
                &owner,
                Duration::from_millis(1),
                LONG
            ))
            .await
            .expect("the owner reserves"),
        Reservation::FRESH
    );
    until_lease_ran_out(&store, &identity).await;
    // The owner's late renewal, not committed yet: it holds the row.
    let mut renewing = store.pool().begin().await.expect("begin");
    sqlx::query(
        "UPDATE idempotency_records SET lease_expires_at =
             UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) + 1500
          WHERE tenant = ? AND scope = ? AND `key` = ?",
    )
    .bind(&tenant)
    .bind("edges.read_committed_again")
    .bind("k")
    .execute(&mut *renewing)
    .await
    .expect("renew");
    let pool = one_connection_at("READ COMMITTED").await;
    let mut tx = pool.begin().await.expect("begin");
    let (caller_id,): (u64,) = sqlx::query_as("SELECT CONNECTION_ID()")
        .fetch_one(&mut *tx)
        .await
        .expect("the caller's connection id");
    let caller = {
        let identity = identity.clone();
        tokio::spawn(async move {
            let token = OwnerToken::new();
            let first = tx
                .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
                .await;
            (tx, token, first)
        })
    };
    // The caller's takeover write waits for the renewal's row lock (its
    // read came before the renewal commits).
    until_all_wait_or_finish(store.pool(), &[caller_id], &AtomicUsize::new(0)).await;
    renewing.commit().await.expect("the renewal commits");
    let (mut tx, token, first) = caller.await.expect("caller");
    assert!(
        matches!(first, Err(Error::StaleSnapshot { .. })),
        "the call read before the renewal committed: {first:?}"
    );
    // The owner renews again; its renewal waits for the transaction's lock.
    let renewal = renew_once(&store, &identity, &owner, lease);
    until_lease_ran_out(&store, &identity).await;
    let again = tx
        .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
        .await;
    let _ = tx.rollback().await;
    let renewed = renewal.await.expect("renewal task");
    reader.stop().await;
    eprintln!("again: {again:?}; the owner's renewal: {renewed:?}");
    assert!(
        !matches!(again, Ok(Reservation::Acquired { .. })),
        "a transaction took over the owner whose renewal waited for its lock: {again:?}; the owner's renewal: {renewed:?}"
    );
}

/// One transaction on `conn`, begun with `begin` (statements in order), whose
/// first call finds the live owner's record and locks it (SERIALIZABLE):
/// `between` runs next (statements expected to fail are marked with a
/// leading `!`), the owner's renewal waits for the transaction's lock, and
/// once the lease has run out the transaction calls again and ends with
/// `end`. Answers the first call, the call again, whether the renewal was
/// still waiting then, and the renewal's answer.
async fn call_again_after(
    store: &MySqlStore,
    conn: &mut sqlx::MySqlConnection,
    scope: &str,
    begin: &[&str],
    between: &[&str],
    end: &[&str],
) -> (
    Result<Reservation, Error>,
    Result<Reservation, Error>,
    bool,
    Result<Fenced, idempotent_runtime::StoreError>,
) {
    let lease = Duration::from_millis(1500);
    let (identity, owner) = a_live_owner(store, scope, lease).await;
    for statement in begin {
        conn.execute(*statement).await.expect(statement);
    }
    let token = OwnerToken::new();
    let first = conn
        .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
        .await;
    for statement in between {
        match statement.strip_prefix('!') {
            Some(refused) => {
                let got = conn.execute(refused).await;
                assert!(got.is_err(), "{refused}: {got:?}");
            }
            None => {
                conn.execute(*statement).await.expect(statement);
            }
        }
    }
    let open: i64 = sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
        .fetch_one(&mut *conn)
        .await
        .expect("in transaction");
    assert_eq!(open, 1, "the transaction goes on");
    let renewal = renew_once(store, &identity, &owner, lease);
    until_lease_ran_out(store, &identity).await;
    let starved = !renewal.is_finished();
    let again = conn
        .reserve_in_transaction(request(&identity, None, &token, LONG, LONG), WAIT)
        .await;
    for statement in end {
        conn.execute(*statement).await.expect(statement);
    }
    (first, again, starved, renewal.await.expect("renewal task"))
}

/// 0014's transaction signature is the session's counts of BEGIN, COMMIT,
/// ROLLBACK and XA statements, which MariaDB counts when a statement starts,
/// whether or not the server carries it out. A statement of that kind that
/// the server refuses leaves the transaction open, with its locks (XA START
/// in an open transaction: XAER_OUTSIDE; COMMIT, ROLLBACK or BEGIN in an XA
/// transaction: XAER_RMFAIL), yet changes the signature: the marks are taken
/// for an ended transaction's and dropped, and a call again takes over the
/// owner whose renewal waits for the transaction's lock (`innodb_trx` read
/// often, so 0008 does not see the transaction).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "reproduces a known limit of 0014 (README): a BEGIN/COMMIT/ROLLBACK/XA statement the server refuses moves the transaction signature while the transaction holds its lock; the call again takes over the owner it starved"]
async fn a_transaction_statement_the_server_refuses_does_not_drop_the_marks() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let reader = InnodbTrxReader::start(store.pool());
    let xid = format!("h_edges_{}", uuid::Uuid::new_v4().simple());
    let (xa_start, xa_end, xa_rollback, refused_xa_start) = (
        format!("XA START '{xid}'"),
        format!("XA END '{xid}'"),
        format!("XA ROLLBACK '{xid}'"),
        format!("!XA START '{xid}'"),
    );
    let mut taken = Vec::new();
    for (begin, between, end) in [
        (
            vec!["BEGIN"],
            vec![refused_xa_start.as_str()],
            vec!["ROLLBACK"],
        ),
        (
            vec![xa_start.as_str()],
            vec!["!COMMIT"],
            vec![xa_end.as_str(), xa_rollback.as_str()],
        ),
    ] {
        let pool = one_connection_at("SERIALIZABLE").await;
        let mut conn = pool.acquire().await.expect("a connection");
        let (first, again, starved, renewed) = call_again_after(
            &store,
            &mut conn,
            "edges.refused_statement",
            &begin,
            &between,
            &end,
        )
        .await;
        eprintln!(
            "{between:?}: first {first:?}; again {again:?}; starved {starved}; renewal {renewed:?}"
        );
        assert!(
            matches!(first, Err(Error::StaleSnapshot { .. })),
            "{first:?}"
        );
        if matches!(again, Ok(Reservation::Acquired { .. })) {
            taken.push(format!(
                "{between:?}: again {again:?} (renewal waiting then: {starved}; {renewed:?})"
            ));
        }
    }
    reader.stop().await;
    assert!(
        taken.is_empty(),
        "a transaction took over the owner whose renewal waited for its lock: {taken:?}"
    );
}

/// The session's isolation level, `@@tx_isolation`, is not the
/// transaction's when the level was set for the next transaction only (`SET
/// TRANSACTION ISOLATION LEVEL SERIALIZABLE`) or when the session's level
/// was changed inside a SERIALIZABLE transaction (`SET SESSION TRANSACTION
/// ...`: the transaction keeps its level). The transaction's first call
/// locks the live owner's record and answers `InProgress` (the runtime does
/// not see SERIALIZABLE); the owner's renewal waits for the lock. 0014 marks
/// every answer on a live in-progress lease in a transaction, whatever the
/// level says, so a call again once the lease has run out is refused. (Its
/// first draft marked by the session's level: the call again took the owner
/// over.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_serializable_other_than_by_its_sessions_level_never_takes_over_the_owner_it_starved(
) {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let reader = InnodbTrxReader::start(store.pool());
    let mut taken = Vec::new();
    for (session, begin) in [
        (
            "REPEATABLE READ",
            vec!["SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", "BEGIN"],
        ),
        (
            "SERIALIZABLE",
            vec![
                "BEGIN",
                "SELECT 1 FROM idempotency_records LIMIT 0",
                "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            ],
        ),
    ] {
        let pool = one_connection_at(session).await;
        let mut conn = pool.acquire().await.expect("a connection");
        let (first, again, starved, renewed) = call_again_after(
            &store,
            &mut conn,
            "edges.serializable_unseen",
            &begin,
            &[],
            &["ROLLBACK"],
        )
        .await;
        eprintln!(
            "{begin:?}: first {first:?}; again {again:?}; starved {starved}; renewal {renewed:?}"
        );
        assert!(
            matches!(
                first,
                Ok(Reservation::InProgress { .. }) | Err(Error::StaleSnapshot { .. })
            ),
            "{first:?}"
        );
        if matches!(again, Ok(Reservation::Acquired { .. })) {
            taken.push(format!(
                "{begin:?}: first {first:?}; again {again:?} (renewal waiting then: {starved}; {renewed:?})"
            ));
        }
    }
    reader.stop().await;
    assert!(
        taken.is_empty(),
        "a transaction took over the owner whose renewal waited for its lock: {taken:?}"
    );
}

/// The transactional claimant of `edges.many_marks`: its body counts its runs.
#[idempotent(scope = "edges.many_marks", key = key, tenant = tenant, tx = tx,
             skip(runs), shared_scope, ttl = "1h", lease = "1h", in_progress = wait("5s"))]
async fn many_marks_in_tx(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    let _ = (&tx, tenant, key);
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

/// More records locked in one transaction than 0014 marks one by one (200;
/// SERIALIZABLE: each look at a live owner's record locks it, refused as
/// stale): the marks become one for every record, and a call again on any of
/// them once its lease has run out (the first marked, one marked after the
/// overflow) is refused as stale, while `innodb_trx` is read often. The
/// transaction ends by being dropped (sqlx rolls it back); a new transaction
/// on the same connection runs the body of a record whose owner crashed
/// (through the attribute, `in_progress = wait(...)`), once: the marks ended
/// with the transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn more_than_two_hundred_records_locked_in_one_transaction_are_all_refused_until_it_ends() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    const RECORDS: usize = 203;
    let lease = Duration::from_secs(8);
    let tenant = fresh_tenant();
    let mut identities = Vec::new();
    for i in 0..RECORDS {
        let identity =
            Identity::new(&tenant, "edges.many_marks", format!("k{i}")).expect("identity");
        assert_eq!(
            store
                .reserve(request(&identity, None, &OwnerToken::new(), lease, LONG))
                .await
                .expect("an owner reserves"),
            Reservation::FRESH
        );
        identities.push(identity);
    }
    let reader = InnodbTrxReader::start(store.pool());
    let pool = one_connection_at("SERIALIZABLE").await;
    let mut tx = pool.begin().await.expect("begin");
    let token = OwnerToken::new();
    for identity in &identities {
        refused_a_look_at(&mut tx, identity, &token).await;
    }
    let overflowed: i64 =
        sqlx::query_scalar("SELECT CAST(@idempotency_tx_locked LIKE '%/*' AS SIGNED)")
            .fetch_one(&mut *tx)
            .await
            .expect("the marks");
    assert_eq!(overflowed, 1, "one mark for every record");
    // The owners crashed (no owner renews: the transaction's locks would
    // keep them from it). The last lease to run out is the last reserved.
    let last = identities.last().expect("records");
    for _ in 0..600 {
        let snap = store.fetch(last).await.expect("fetch").expect("present");
        if snap.lease_expires_at_ms.is_some_and(|l| l <= snap.now_ms) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in [0, 1, RECORDS - 2, RECORDS - 1] {
        let again = tx
            .reserve_in_transaction(request(&identities[i], None, &token, LONG, LONG), WAIT)
            .await;
        assert!(
            matches!(again, Err(Error::StaleSnapshot { .. })),
            "record {i} of {RECORDS}: {again:?}"
        );
    }
    drop(tx);
    reader.stop().await;
    // New transactions on the connection until one is not refused as stale
    // (0008 refuses one while `innodb_trx` still shows the connection's
    // previous transaction; bounded).
    let runs = AtomicUsize::new(0);
    let mut got = None;
    for _ in 0..50 {
        let mut tx = pool.begin().await.expect("begin again");
        let answer = with_outcome(many_marks_in_tx(&mut tx, &tenant, "k0", &runs)).await;
        match answer {
            (Err(Error::StaleSnapshot { .. }), _) => {
                drop(tx);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            answer => {
                tx.commit().await.expect("commit");
                got = Some(answer);
                break;
            }
        }
    }
    assert!(
        matches!(got, Some((Ok(7), Some(Outcome::Executed)))),
        "a new transaction is refused a crashed owner's record: {got:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Under SERIALIZABLE the look of a transactional call is a locking read
/// (see `a_serializable_transaction_calling_again_never_takes_over_the_owner_it_starved`):
/// a call with other arguments that finds a live owner's record holds a
/// shared lock on it, and the owner's renewal waits for the transaction. The
/// README says such a call is refused with `StaleSnapshot` (roll back at
/// once), as an in-progress answer there is and as a mismatch whose re-read
/// locked the record is (`a_mismatch_that_locked_a_live_record_refuses_the_transaction`).
/// Before 0014 it was answered `FingerprintMismatch`, which did not tell the
/// caller that its transaction kept the owner from renewing; now the
/// procedure answers such a mismatch with the lease left and the runtime
/// refuses it under SERIALIZABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mismatch_under_serializable_refuses_the_transaction() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let identity =
        Identity::new(fresh_tenant(), "edges.serializable_mismatch", "k").expect("identity");
    let owner = OwnerToken::new();
    let lease = Duration::from_secs(30);
    assert_eq!(
        store
            .reserve(request(&identity, Some(&fp("a")), &owner, lease, LONG))
            .await
            .expect("the owner reserves"),
        Reservation::FRESH
    );
    let pool = one_connection_at("SERIALIZABLE").await;
    let mut tx = pool.begin().await.expect("begin");
    let got = tx
        .reserve_in_transaction(
            request(&identity, Some(&fp("b")), &OwnerToken::new(), LONG, LONG),
            WAIT,
        )
        .await;
    // The owner's renewal waits for the transaction's lock (the store's
    // session gives up after its lock wait).
    let renewal = renew_once(&store, &identity, &owner, lease);
    let mut held = false;
    for _ in 0..40 {
        if renewal.is_finished() {
            break;
        }
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST
              WHERE INFO LIKE 'UPDATE %idempotency_records%' AND TIME_MS >= 200",
        )
        .fetch_one(store.pool())
        .await
        .expect("processlist");
        if waiting > 0 {
            held = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tx.rollback().await.expect("rollback");
    let renewed = renewal.await.expect("renewal task");
    eprintln!("answer {got:?}; the owner's renewal waited: {held}; {renewed:?}");
    assert!(
        matches!(got, Err(Error::StaleSnapshot { store: "mysql", .. })),
        "a mismatch that locked the live owner's record (its renewal waited: {held}): {got:?}"
    );
}
