//! Waiting duplicates on [`PgStore`]: a duplicate that finds the record in
//! progress (`in_progress = wait(...)`) is woken by `LISTEN/NOTIFY` when the
//! record completes or is released, in this process or another (another
//! pool), instead of polling; and where the listener cannot help (a
//! transactional-mode owner's uncommitted reservation, an owner that died) it
//! still gets the right answer.
//!
//! Every holder is held by a handshake (its body waits for the test to let it
//! go). The test lets it go only once the duplicate is known to wait: its
//! mark is on the record (`waiting = TRUE`), and then some more time passes,
//! so a polling duplicate would have reserved dozens of times. A store
//! wrapper counts each call's reservations.

use crate::common::counting::Counting;
use crate::common::servers::{fresh_tenant, pg_store_or_skip, pg_url};
use idempotent_runtime::store::postgres::wait_key;
use idempotent_runtime::{
    idempotent, with_outcome, Error, Fenced, Identity, Outcome, OwnerToken, PgStore, Reservation,
    ReserveRequest, Store, StoreError,
};
use sqlx::Postgres;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

/// How long a holder keeps the record after the duplicate is known to wait:
/// with the old polling (at most 100 ms apart) that would be ~20 reservations.
const HOLD_AFTER_WAITING: Duration = Duration::from_secs(2);

/// Holds a body open: it notifies `reached` once it runs, then waits for `go`.
#[derive(Default)]
pub(super) struct Hold {
    pub(super) reached: Notify,
    pub(super) go: Notify,
}

impl Hold {
    pub(super) async fn here(&self) {
        self.reached.notify_one();
        self.go.notified().await;
    }
}

#[idempotent(scope = "waiting.pg.charge", key = key, tenant = tenant, store = store,
             skip(hold, runs), in_progress = wait("10s"))]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    hold: Option<&Hold>,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    if let Some(hold) = hold {
        hold.here().await;
    }
    Ok(amount * 10)
}

/// `Err` (released, the default error policy) when `fail` is set.
#[idempotent(scope = "waiting.pg.fallible", key = key, tenant = tenant, store = store,
             skip(hold, runs, fail), in_progress = wait("10s"), shared_scope)]
async fn fallible(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    hold: Option<&Hold>,
    runs: &AtomicUsize,
    fail: bool,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    if let Some(hold) = hold {
        hold.here().await;
    }
    if fail {
        return Err(StoreError::new("test", "the body", "failed on purpose").into());
    }
    Ok(amount * 10)
}

#[idempotent(scope = "waiting.pg.in_tx", key = key, tenant = tenant, tx = tx, skip(runs),
             in_progress = wait("10s"), shared_scope)]
async fn charge_in_tx(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    let _ = &tx;
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(amount * 10)
}

/// Waits until a duplicate's mark is on the record: it registered with the
/// listener and waits for a notification.
async fn until_marked(pool: &sqlx::PgPool, identity: &Identity) {
    loop {
        let marked: Option<bool> = sqlx::query_scalar(
            "SELECT waiting FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3",
        )
        .bind(identity.tenant())
        .bind(identity.scope())
        .bind(identity.key())
        .fetch_optional(pool)
        .await
        .expect("read the mark");
        if marked == Some(true) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The owner (on `owner_store`) holds the record; the duplicate (on
/// `dup_store`) waits and replays once the owner completes.
async fn woken_by_completion(owner_store: PgStore, dup_store: PgStore) {
    woken_by_completion_of(owner_store, dup_store, fresh_tenant(), "order-1".to_owned()).await;
}

/// [`woken_by_completion`] for a given tenant and key.
async fn woken_by_completion_of(
    owner_store: PgStore,
    dup_store: PgStore,
    tenant: String,
    key: String,
) {
    let identity = Identity::new(&tenant, "waiting.pg.charge", &key).expect("identity");
    let owner = Counting::new(owner_store.clone());
    let dup = Counting::new(dup_store);
    let (hold, runs) = (Hold::default(), AtomicUsize::new(0));
    let owner_call = charge(&owner, &tenant, &key, 7, Some(&hold), &runs);
    let duplicate = async {
        hold.reached.notified().await;
        let dup_call = with_outcome(charge(&dup, &tenant, &key, 7, None, &runs));
        let release = async {
            until_marked(owner_store.pool(), &identity).await;
            tokio::time::sleep(HOLD_AFTER_WAITING).await;
            hold.go.notify_one();
        };
        let (answer, ()) = tokio::join!(dup_call, release);
        answer
    };
    let (owned, (replayed, outcome)) = tokio::join!(owner_call, duplicate);
    assert_eq!(owned.expect("owner"), 70);
    assert_eq!(replayed.expect("duplicate"), 70, "the duplicate replays");
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    assert_eq!(owner.reserves(), 1);
    assert!(
        dup.reserves() <= 3,
        "a woken duplicate reserves a few times, not on every poll: {} reservations",
        dup.reserves()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_is_woken_by_the_completion() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    woken_by_completion(store.clone(), store).await;
}

/// Two stores, two pools, two listeners: as two processes sharing the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_another_process_is_woken_by_the_completion() {
    let Some(owner) = pg_store_or_skip().await else {
        return;
    };
    let other = PgStore::connect(&pg_url()).await.expect("second store");
    woken_by_completion(owner, other).await;
}

/// Rule 4 for identities whose text is awkward for `NOTIFY`: quotes and
/// backslashes, characters outside ASCII (counted in characters by
/// `length()` and in bytes by the payload limit), a key of 255 bytes of
/// 4-byte characters, a tenant that looks like a length prefix. The payload
/// is a digest, so each waiter is still woken by its own record's
/// notification (a wait key that disagreed with the database's would leave
/// it polling, dozens of reservations over the hold).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_identities_with_awkward_text_are_woken_not_polling() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let base = fresh_tenant();
    let cases = [
        (
            format!("{base}'\\"),
            "it's a \"quoted\" \\ key; $$ -- /*".to_owned(),
        ),
        (format!("1:{base}"), "\u{1F4B3}".repeat(63) + "abc"),
        (
            format!("t\u{e9}n\u{e4}nt-{base}"),
            "\u{65e5}\u{672c}\u{8a9e}\u{feff}e\u{301}".to_owned(),
        ),
        (base.clone(), "k".repeat(255)),
    ];
    for (tenant, key) in cases {
        assert!(key.len() <= 255, "a valid key: {} bytes", key.len());
        woken_by_completion_of(store.clone(), store.clone(), tenant, key).await;
    }
}

/// Rules 3 and 4 with many waiters split over two stores (two pools, two
/// listeners: as two processes): the owner's body fails, the release
/// notifies both listeners, and of the fifty woken waiters exactly one runs
/// the body; every other one replays its result. Each store has a pool of
/// four connections: a waiter holds none while it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_waiters_over_two_stores_behind_a_failing_owner_run_the_body_once() {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    // Pools of four connections: waiters hold none while they wait.
    let small = || async {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&pg_url())
            .await
            .expect("pool");
        PgStore::from_pool(pool).await.expect("store")
    };
    let (first, second) = (small().await, small().await);
    let (tenant, key) = (fresh_tenant(), "order-50".to_owned());
    let (a, b) = (Counting::new(first), Counting::new(second));
    let (hold, runs) = (Hold::default(), AtomicUsize::new(0));
    let owner_call = fallible(&a, &tenant, &key, 5, Some(&hold), &runs, true);
    let duplicates = async {
        hold.reached.notified().await;
        let calls = (0..50).map(|i| {
            let store: &dyn Store = if i % 2 == 0 { &a } else { &b };
            with_outcome(fallible(store, &tenant, &key, 5, None, &runs, false))
        });
        let release = async {
            a.waited(25).await;
            b.waited(25).await;
            hold.go.notify_one();
        };
        let (answers, ()) = tokio::join!(futures_util::future::join_all(calls), release);
        answers
    };
    let (owned, answers) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(owner_call, duplicates)
    })
    .await
    .expect("fifty waiters answered within a minute");
    assert!(owned.is_err(), "the owner's body failed");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the owner, then exactly one waiter"
    );
    let mut executed = 0;
    for (answer, outcome) in answers {
        assert_eq!(answer.expect("a waiter's answer"), 50);
        executed += usize::from(outcome == Some(Outcome::Executed));
    }
    assert_eq!(executed, 1, "one waiter ran the body, the others replayed");
}

/// Many waiters on one key lock the row in turn to mark it, so one waiter's
/// mark can find the row locked (here by a transaction the test holds, as
/// another waiter's mark or the owner's heartbeat would). A mark another
/// waiter has already committed covers it: the record's next change notifies,
/// so this waiter waits for the notification instead of polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_mark_finds_the_row_locked_and_marked_waits_for_the_notification() {
    let Some(owner_store) = pg_store_or_skip().await else {
        return;
    };
    let (tenant, key) = (fresh_tenant(), "order-locked".to_owned());
    let identity = Identity::new(&tenant, "waiting.pg.charge", &key).expect("identity");
    let first = Counting::new(owner_store.clone());
    let second = Counting::new(PgStore::connect(&pg_url()).await.expect("second store"));
    let (hold, runs) = (Hold::default(), AtomicUsize::new(0));
    let owner_call = charge(&owner_store, &tenant, &key, 5, Some(&hold), &runs);
    let waiters = async {
        hold.reached.notified().await;
        let first_call = charge(&first, &tenant, &key, 5, None, &runs);
        let second_call = async {
            until_marked(owner_store.pool(), &identity).await;
            // The first waiter's mark is committed; now the row is locked.
            let mut lock = owner_store.pool().begin().await.expect("begin");
            sqlx::query(
                "SELECT 1 FROM idempotency_records \
                 WHERE tenant = $1 AND scope = $2 AND key = $3 FOR NO KEY UPDATE",
            )
            .bind(&tenant)
            .bind("waiting.pg.charge")
            .bind(&key)
            .execute(&mut *lock)
            .await
            .expect("lock the row");
            let second_call = charge(&second, &tenant, &key, 5, None, &runs);
            let release = async {
                second.waited(1).await;
                tokio::time::sleep(HOLD_AFTER_WAITING).await;
                lock.rollback().await.expect("unlock the row");
                hold.go.notify_one();
            };
            let (answer, ()) = tokio::join!(second_call, release);
            answer
        };
        tokio::join!(first_call, second_call)
    };
    let (owned, (a, b)) = tokio::join!(owner_call, waiters);
    assert_eq!(owned.expect("owner"), 50);
    assert_eq!(
        (a.expect("first waiter"), b.expect("second waiter")),
        (50, 50)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    assert!(
        second.reserves() <= 3,
        "the waiter behind the locked row waited for the notification instead of \
         polling: {} reservations",
        second.reserves()
    );
}

/// The owner fails (`errors = release`): the waiting duplicate, in another
/// store, is woken by the release and runs the body itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_is_woken_by_a_release_and_acquires() {
    let Some(owner_store) = pg_store_or_skip().await else {
        return;
    };
    let dup_store = PgStore::connect(&pg_url()).await.expect("second store");
    let (tenant, key) = (fresh_tenant(), "order-2".to_owned());
    let identity = Identity::new(&tenant, "waiting.pg.fallible", &key).expect("identity");
    let owner = Counting::new(owner_store.clone());
    let dup = Counting::new(dup_store);
    let (hold, runs) = (Hold::default(), AtomicUsize::new(0));
    let owner_call = fallible(&owner, &tenant, &key, 3, Some(&hold), &runs, true);
    let duplicate = async {
        hold.reached.notified().await;
        let dup_call = with_outcome(fallible(&dup, &tenant, &key, 3, None, &runs, false));
        let release = async {
            until_marked(owner_store.pool(), &identity).await;
            tokio::time::sleep(HOLD_AFTER_WAITING).await;
            hold.go.notify_one();
        };
        let (answer, ()) = tokio::join!(dup_call, release);
        answer
    };
    let (owned, (acquired, outcome)) = tokio::join!(owner_call, duplicate);
    assert!(owned.is_err(), "the owner's body failed");
    assert_eq!(acquired.expect("duplicate"), 30);
    assert_eq!(
        outcome,
        Some(Outcome::Executed),
        "the duplicate ran the body"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(
        dup.reserves() <= 3,
        "a woken duplicate reserves a few times: {} reservations",
        dup.reserves()
    );
    let record = owner_store.fetch(&identity).await.expect("fetch");
    assert_eq!(
        record.and_then(|r| r.outcome).map(|o| o.payload),
        Some(b"30".to_vec())
    );
}

/// The listener cannot help while the owner is a transactional-mode call:
/// its reservation is uncommitted, invisible to the duplicate's mark. The
/// duplicate polls, and replays once the owner's transaction commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_owner_falls_back_to_polling_and_still_replays() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let (tenant, key) = (fresh_tenant(), "order-3".to_owned());
    let runs = AtomicUsize::new(0);
    let dup = Counting::new(store.clone());
    let mut tx = store.pool().begin().await.expect("begin");
    let owned = charge_in_tx(&mut tx, &tenant, &key, 5, &runs)
        .await
        .expect("owner in its transaction");
    assert_eq!(owned, 50);
    // The duplicate goes through the store in scope waiting.pg.in_tx.
    #[idempotent(scope = "waiting.pg.in_tx", key = key, tenant = tenant, store = store,
                 skip(runs), in_progress = wait("10s"), shared_scope)]
    async fn charge_through_store(
        store: &dyn Store,
        tenant: &str,
        key: &str,
        amount: u64,
        runs: &AtomicUsize,
    ) -> Result<u64, Error> {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok(amount * 10)
    }
    let duplicate = with_outcome(charge_through_store(&dup, &tenant, &key, 5, &runs));
    let commit = async {
        // The duplicate has found the record in progress at least twice
        // (a reservation, a poll, another reservation) before the commit.
        while dup.reserves() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tx.commit().await.expect("commit");
    };
    let ((replayed, outcome), ()) = tokio::join!(duplicate, commit);
    assert_eq!(replayed.expect("duplicate"), 50);
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
}

/// The store-mode twin of [`charge_in_tx`] (same scope, same fingerprint).
#[idempotent(scope = "waiting.pg.in_tx", key = key, tenant = tenant, store = store,
             skip(runs), in_progress = wait("30s"), shared_scope)]
async fn charge_in_tx_through_store(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(amount * 10)
}

/// A transactional-mode owner took an expired record over and holds it
/// (uncommitted) while a store-mode duplicate waits. The duplicate's mark
/// finds the row locked, and the version it can read has a lease that ran
/// out: that is not a change worth reserving again at once (the owner's
/// transaction holds the row for as long as it runs, and the reservation that
/// follows only waits for its lock, `lock_wait` at a time, to answer
/// `InProgress` again), so the duplicate polls at the documented backoff
/// (5 ms doubling to 100 ms) like one behind an uncommitted reservation,
/// instead of reserving again and again with no pause between: with a short
/// `lock_wait`, hundreds of statements a second for as long as it waits.
///
/// Measured from below only, as the time the duplicate spent in its waits
/// (its reservations, which wait for the row lock, are not counted): twelve
/// waits take at least the pauses of the backoff (5 + 10 + 20 + 40 + 80 +
/// 6 x 100 ms), which the sleeps guarantee; returned at once, they take the
/// few milliseconds of a mark each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_behind_a_transactional_takeover_polls_at_the_backoff() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let (tenant, key) = (fresh_tenant(), "order-tx-takeover".to_owned());
    // A dead owner's record whose lease has run out.
    sqlx::query(
        "INSERT INTO idempotency_records (tenant, scope, key, state, owner_token, \
         lease_expires_at, expires_at, created_at, updated_at) \
         VALUES ($1, 'waiting.pg.in_tx', $2, 'in_progress', 'gone', \
                 idempotency_now_ms() - 1000, idempotency_now_ms() + 86400000, \
                 idempotency_now_ms() - 2000, idempotency_now_ms() - 2000)",
    )
    .bind(&tenant)
    .bind(&key)
    .execute(store.pool())
    .await
    .expect("a dead owner's expired record");
    let runs = AtomicUsize::new(0);
    let mut tx = store.pool().begin().await.expect("begin");
    let owned = charge_in_tx(&mut tx, &tenant, &key, 6, &runs)
        .await
        .expect("the transactional owner takes the record over");
    assert_eq!(owned, 60);
    let dup = Counting::new(store.clone().with_lock_wait(Duration::from_millis(1)));
    let duplicate = with_outcome(charge_in_tx_through_store(&dup, &tenant, &key, 6, &runs));
    let commit = async {
        // Twelve waits have returned once the thirteenth reservation is made.
        while dup.reserves() < 13 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let waiting = dup.time_waiting();
        tx.commit().await.expect("commit");
        waiting
    };
    let ((replayed, outcome), waiting) = tokio::time::timeout(Duration::from_secs(25), async {
        tokio::join!(duplicate, commit)
    })
    .await
    .expect("the duplicate answered once the owner committed");
    assert_eq!(replayed.expect("duplicate"), 60);
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    let pauses = Duration::from_millis(5 + 10 + 20 + 40 + 80 + 6 * 100);
    assert!(
        waiting >= pauses,
        "twelve waits took {waiting:?} in all: the duplicate reserved again with no pause \
         (at least {pauses:?} of backoff expected)"
    );
    let identity = Identity::new(&tenant, "waiting.pg.in_tx", &key).expect("identity");
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(
        record.attempt, 2,
        "the transactional owner took the record over"
    );
}

/// The listener cannot help when the owner died: nothing completes the
/// record. The duplicate waits until the lease runs out and takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_owners_record_is_taken_over_at_the_end_of_its_lease() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let (tenant, key) = (fresh_tenant(), "order-4".to_owned());
    // A record held by an owner that will never come back, for 1.5 s more.
    sqlx::query(
        "INSERT INTO idempotency_records (tenant, scope, key, state, owner_token, \
         lease_expires_at, expires_at, created_at, updated_at) \
         VALUES ($1, 'waiting.pg.charge', $2, 'in_progress', 'gone', \
                 idempotency_now_ms() + 1500, idempotency_now_ms() + 86400000, \
                 idempotency_now_ms(), idempotency_now_ms())",
    )
    .bind(&tenant)
    .bind(&key)
    .execute(store.pool())
    .await
    .expect("a dead owner's record");
    let dup = Counting::new(store.clone());
    let runs = AtomicUsize::new(0);
    let (answer, outcome) = with_outcome(charge(&dup, &tenant, &key, 9, None, &runs)).await;
    assert_eq!(answer.expect("taken over"), 90);
    assert_eq!(outcome, Some(Outcome::Executed));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(
        dup.reserves() <= 3,
        "the duplicate waited for the lease, not polling: {} reservations",
        dup.reserves()
    );
    let identity = Identity::new(&tenant, "waiting.pg.charge", &key).expect("identity");
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(record.attempt, 2, "a takeover (rule 20)");
}

/// Only a record somebody waits for notifies (the fresh path pays no NOTIFY),
/// and the notification's payload is the record's wait key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_records_with_waiters_notify_and_the_payload_is_the_wait_key() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let unmarked = Identity::new(&tenant, "waiting.pg.charge", "quiet").expect("identity");
    let marked = Identity::new(&tenant, "waiting.pg.charge", "watched").expect("identity");
    let mut listener = sqlx::postgres::PgListener::connect(&pg_url())
        .await
        .expect("listener");
    listener
        .listen("idempotency_records")
        .await
        .expect("listen");

    // A record without waiters completes, then one with a waiter.
    let runs = AtomicUsize::new(0);
    charge(&store, &tenant, unmarked.key(), 1, None, &runs)
        .await
        .expect("unwatched call");
    let hold = Hold::default();
    let owner_call = charge(&store, &tenant, marked.key(), 2, Some(&hold), &runs);
    let duplicate = async {
        hold.reached.notified().await;
        let dup_call = charge(&store, &tenant, marked.key(), 2, None, &runs);
        let release = async {
            until_marked(store.pool(), &marked).await;
            hold.go.notify_one();
        };
        let (answer, ()) = tokio::join!(dup_call, release);
        answer
    };
    let (owned, replayed) = tokio::join!(owner_call, duplicate);
    assert_eq!(owned.expect("owner"), 20);
    assert_eq!(replayed.expect("duplicate"), 20);

    // Notifications arrive in commit order: the first of ours must be the
    // watched record's (other tests may notify on the same channel).
    let (quiet, watched) = (wait_key(&unmarked), wait_key(&marked));
    let sql_key: String = sqlx::query_scalar("SELECT idempotency_wait_key($1, $2, $3)")
        .bind(marked.tenant())
        .bind(marked.scope())
        .bind(marked.key())
        .fetch_one(store.pool())
        .await
        .expect("wait key in SQL");
    assert_eq!(sql_key, watched, "Rust and SQL compute the same wait key");
    loop {
        let notification = listener.recv().await.expect("a notification");
        assert_ne!(
            notification.payload(),
            quiet,
            "a record nobody waited for must not notify"
        );
        if notification.payload() == watched {
            break;
        }
    }
}

/// The owner ends its lease early (a heartbeat with no lease left, what the
/// engine does when a `recover` hook's answer is not recorded): a record a
/// duplicate waits for notifies, so the duplicate looks again at once
/// instead of at the end of the lease it saw. Renewals (longer leases) do
/// not notify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_lease_notifies_the_waiters_and_a_renewal_does_not() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "waiting.pg.charge", "ended").expect("identity");
    let token = OwnerToken::new();
    held_and_waited_for(&store, &identity, &token).await;
    let mut listener = sqlx::postgres::PgListener::connect(&pg_url())
        .await
        .expect("listener");
    listener
        .listen("idempotency_records")
        .await
        .expect("listen");
    let watched = wait_key(&identity);

    // A renewal, a marker, then the end of the lease. Notifications arrive in
    // commit order, so the record's first one must come after the marker: the
    // renewal sent none, the ended lease one.
    assert_eq!(
        store
            .heartbeat(&identity, &token, Duration::from_secs(60))
            .await
            .expect("renew"),
        Fenced::Written
    );
    let marker = format!("marker-{tenant}");
    sqlx::query("SELECT pg_notify('idempotency_records', $1)")
        .bind(&marker)
        .execute(store.pool())
        .await
        .expect("the marker");
    assert_eq!(
        store
            .heartbeat(&identity, &token, Duration::ZERO)
            .await
            .expect("end the lease"),
        Fenced::Written
    );
    let mut seen_marker = false;
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let n = listener.recv().await.expect("a notification");
            if n.payload() == marker {
                seen_marker = true;
            } else if n.payload() == watched {
                assert!(seen_marker, "the renewal notified the waiters");
                return;
            }
        }
    })
    .await
    .expect("the ended lease notified the waiters");
    let lease_left: i64 = sqlx::query_scalar(
        "SELECT lease_expires_at - idempotency_now_ms() FROM idempotency_records \
         WHERE tenant = $1 AND scope = $2 AND key = $3",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .fetch_one(store.pool())
    .await
    .expect("the lease");
    assert!(lease_left <= 0, "the lease ended: {lease_left} ms left");
}

/// A release (the owner's error, `errors = release`) and an operator's
/// release delete a record a duplicate waits for: each notifies the waiters
/// (the delete trigger), so they reserve again at once instead of at the end
/// of their wait slice. (`a_waiting_duplicate_is_woken_by_a_release_and_acquires`
/// counts reservations, which a duplicate that sleeps to its slice does not
/// exceed: this looks at the notification itself.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_and_an_operator_release_notify_the_waiters() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let mut listener = sqlx::postgres::PgListener::connect(&pg_url())
        .await
        .expect("listener");
    listener
        .listen("idempotency_records")
        .await
        .expect("listen");
    for operator in [false, true] {
        let key = if operator {
            "operator-released"
        } else {
            "released"
        };
        let identity = Identity::new(&tenant, "waiting.pg.charge", key).expect("identity");
        let token = OwnerToken::new();
        held_and_waited_for(&store, &identity, &token).await;
        if operator {
            let released = store
                .force_release(&identity, false)
                .await
                .expect("the operator releases");
            assert!(
                matches!(released, idempotent_runtime::ForcedRelease::Released { .. }),
                "{released:?}"
            );
        } else {
            assert_eq!(
                store.release(&identity, &token).await.expect("release"),
                Fenced::Written
            );
        }
        let watched = wait_key(&identity);
        // A guard against a hang, not a timing assertion: without the
        // notification nothing else would arrive for this key.
        tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let n = listener.recv().await.expect("a notification");
                if n.payload() == watched {
                    return;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the {key} record's delete notified nobody"));
    }
}

/// `identity` reserved under `token` (lease 30 s) and marked as waited for,
/// as a waiting duplicate marks it.
async fn held_and_waited_for(
    store: &idempotent_runtime::PgStore,
    identity: &Identity,
    token: &OwnerToken,
) {
    let held = store
        .reserve(ReserveRequest {
            identity,
            fingerprint: None,
            token,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("the owner reserves");
    assert!(matches!(held, Reservation::Acquired { .. }), "{held:?}");
    sqlx::query(
        "UPDATE idempotency_records SET waiting = TRUE \
         WHERE tenant = $1 AND scope = $2 AND key = $3",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .execute(store.pool())
    .await
    .expect("a waiter's mark");
}

/// A transactional-mode duplicate (READ COMMITTED, where it may wait in its
/// transaction), in the scope of `fallible`.
#[idempotent(scope = "waiting.pg.fallible", key = key, tenant = tenant, tx = tx,
             skip(runs), in_progress = wait("60s"), shared_scope)]
async fn fallible_in_tx(
    tx: &mut sqlx::PgConnection,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    let _ = &tx;
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(amount * 10)
}

/// Rules 3, 4 and 15: two transactional-mode duplicates wait, each in its own
/// open transaction, behind a store-mode owner whose body fails (`errors =
/// release`). The release frees the key: one of them reserves it in its
/// transaction and runs the body; the other then waits for that transaction
/// (its reservation is uncommitted) and replays its result once it commits.
/// The body runs once more in all, nobody is told `InProgress` or a
/// deadlock, and the recorded result is the one committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_waiters_behind_a_failing_owner_run_the_body_once_and_replay() {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use std::str::FromStr;
    let Some(owner_store) = pg_store_or_skip().await else {
        return;
    };
    let name = format!("idempotent-txw-{}", uuid::Uuid::new_v4().simple());
    let options = PgConnectOptions::from_str(&pg_url())
        .expect("url")
        .application_name(&name);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("the waiters' pool");
    let (tenant, key) = (fresh_tenant(), "order-tx-waiters".to_owned());
    let identity = Identity::new(&tenant, "waiting.pg.fallible", &key).expect("identity");
    let (hold, owner_runs, runs) = (Hold::default(), AtomicUsize::new(0), AtomicUsize::new(0));
    let owner_call = fallible(
        &owner_store,
        &tenant,
        &key,
        4,
        Some(&hold),
        &owner_runs,
        true,
    );
    let waiter = || async {
        let mut tx = pool.begin().await.expect("begin");
        let answer = with_outcome(fallible_in_tx(&mut tx, &tenant, &key, 4, &runs)).await;
        tx.commit().await.expect("commit");
        answer
    };
    let waiters = async {
        hold.reached.notified().await;
        tokio::join!(waiter(), waiter())
    };
    let release = async {
        // (The waiters start once the owner's body runs.) Both waiters have looked at the record and wait, their
        // transactions open (a bounded look at the server's activity).
        let mut both = false;
        for _ in 0..2000 {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                   AND state = 'idle in transaction' AND query LIKE '%idempotency_re%'",
            )
            .bind(&name)
            .fetch_one(owner_store.pool())
            .await
            .expect("activity");
            if n >= 2 {
                both = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(both, "both transactional waiters looked at the record");
        hold.go.notify_one();
    };
    let (owned, ((a, a_outcome), (b, b_outcome)), ()) =
        tokio::time::timeout(Duration::from_secs(45), async {
            tokio::join!(owner_call, waiters, release)
        })
        .await
        .expect("the waiters were answered");
    assert!(owned.is_err(), "the owner's body failed");
    assert_eq!(owner_runs.load(Ordering::SeqCst), 1);
    assert_eq!((a.expect("waiter a"), b.expect("waiter b")), (40, 40));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one waiter ran the body");
    let mut outcomes = [a_outcome, b_outcome];
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(
        outcomes,
        [Some(Outcome::Executed), Some(Outcome::Replayed)],
        "one executed, one replayed"
    );
    let record = owner_store.fetch(&identity).await.expect("fetch");
    assert_eq!(
        record.and_then(|r| r.outcome).map(|o| o.payload),
        Some(b"40".to_vec())
    );
}

/// The store's backends whose last statement was one of the listener's (its
/// `LISTEN`, its check of `idle_session_timeout`, a `SELECT 1`), among the
/// connections named `app` (`application_name`).
async fn listener_backends(admin: &sqlx::PgPool, app: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
           AND (query LIKE 'LISTEN%' OR query LIKE '%idle_session_timeout%' OR query = 'SELECT 1')",
    )
    .bind(app)
    .fetch_one(admin)
    .await
    .expect("count the listener backends")
}

/// Until `app` has `n` listener backends (a hang guard fails the test).
async fn until_listener_backends(admin: &sqlx::PgPool, app: &str, n: i64) {
    let seen = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let seen = listener_backends(admin, app).await;
            if seen == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        seen.is_ok(),
        "{app}: {} listener backends, expected {n}",
        listener_backends(admin, app).await
    );
}

/// Rule 4's listener is one connection per store, whatever the number of
/// waiters and however many of them are dropped mid-wait, and it goes away
/// with the store: twenty waiters (ten of them dropped while they wait) on
/// one store leave one listener; once the store is dropped, none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_listener_per_store_and_none_once_the_store_is_dropped() {
    let Some(admin) = pg_store_or_skip().await else {
        return;
    };
    let app = format!("h-listener-{}", uuid::Uuid::new_v4().simple());
    let options: sqlx::postgres::PgConnectOptions = pg_url().parse().expect("url");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&app))
        .await
        .expect("pool");
    let store = PgStore::from_pool(pool).await.expect("store");
    let (tenant, key) = (fresh_tenant(), "order-listeners".to_owned());
    let counted = Counting::new(store.clone());
    let (hold, runs) = (Hold::default(), AtomicUsize::new(0));
    let owner_call = charge(&counted, &tenant, &key, 4, Some(&hold), &runs);
    let waiters = async {
        hold.reached.notified().await;
        let dropped = async {
            let calls = (0..10).map(|_| charge(&counted, &tenant, &key, 4, None, &runs));
            let all = futures_util::future::join_all(calls);
            tokio::select! {
                _ = all => panic!("a dropped waiter was answered while the owner held the record"),
                () = counted.waited(10) => {}
            }
        };
        dropped.await;
        let calls = (0..10).map(|_| charge(&counted, &tenant, &key, 4, None, &runs));
        let release = async {
            counted.waited(20).await;
            until_listener_backends(admin.pool(), &app, 1).await;
            hold.go.notify_one();
        };
        let (answers, ()) = tokio::join!(futures_util::future::join_all(calls), release);
        answers
    };
    let (owned, answers) = tokio::join!(owner_call, waiters);
    assert_eq!(owned.expect("owner"), 40);
    for answer in answers {
        assert_eq!(answer.expect("a waiter"), 40);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    until_listener_backends(admin.pool(), &app, 1).await;
    drop(counted);
    drop(store);
    until_listener_backends(admin.pool(), &app, 0).await;
}
