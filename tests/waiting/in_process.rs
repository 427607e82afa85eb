//! Waiting duplicates (rule 4) are woken by the change they wait for, not by
//! polling: `Store::wait_for_change` of the memory, SQLite and MySQL/MariaDB
//! stores. Changes made through another store (another process) are found by
//! the SQLite and MySQL stores' fallback look at the record, a read, not a
//! reservation.
//!
//! Each test holds a record with a call whose body waits on a channel the
//! test releases. A duplicate with `in_progress = wait("10s")` arrives while
//! it is held; the test releases the holder only once the duplicate has
//! entered its wait (a handshake through the store wrapper below), and holds
//! on a little longer so that a polling wait would have to look many times.
//! The duplicate then replays the result (or, when the holder's error
//! releases the record, acquires and runs), having reserved only a few
//! times: once to find the record in progress, once after the change.
//!
//! `Counting` wraps a real store, counts `reserve` calls and reports when a
//! duplicate enters `wait_for_change` (which it forwards).

use crate::common::counting::Counting;
use crate::common::servers::mysql_store_or_skip;
use idempotent_runtime::{
    idempotent, Error, Fenced, Identity, MemoryStore, MySqlStore, OwnerToken, Reservation,
    ReserveRequest, SqliteStore, Store,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// How long the holder keeps the record after the duplicate started waiting.
/// Not a synchronization (the handshake is): the time a polling wait would
/// spend looking again and again (the default backoff looks about 8 times
/// in 400 ms, the SQLite fallback poll is not a reservation at all).
const HOLD: Duration = Duration::from_millis(400);

/// At most this many reservations by the duplicate: one that finds the record
/// in progress, one after the change, and one spare.
const FEW: usize = 3;

/// What a call's body does: counts its runs, says it started, waits for
/// `go`, then succeeds or fails (its error releases the record).
#[derive(Default)]
struct Gate {
    runs: AtomicUsize,
    started: watch::Sender<bool>,
    go: Notify,
    fail: bool,
}

impl Gate {
    /// Until the body has started.
    async fn started(&self) {
        let _ = self.started.subscribe().wait_for(|s| *s).await;
    }
    fn failing() -> Self {
        Gate {
            fail: true,
            ..Gate::default()
        }
    }
    /// A gate whose body does not wait.
    fn open() -> Self {
        let gate = Gate::default();
        gate.go.notify_one();
        gate
    }
}

#[idempotent(scope = "waiting.held", key = key, tenant = tenant, store = store,
             in_progress = wait("10s"), skip(gate))]
async fn held(store: &dyn Store, tenant: &str, key: &str, gate: &Gate) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.started.send_replace(true);
    gate.go.notified().await;
    if gate.fail {
        return Err(Error::NoDefaultStore {
            scope: "the holder's own error".into(),
        });
    }
    Ok(7)
}

fn tenant() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The holder runs through `holder_store`, the duplicate through `dup`; the
/// holder completes (or, with `fail`, releases) after the duplicate waits.
/// Returns the duplicate's answer, its reservations, and both gates.
async fn duplicate_while_held<H: Store, D: Store>(
    holder_store: &H,
    dup: &Counting<D>,
    fail: bool,
) -> (Result<u64, Error>, usize, Gate, Gate) {
    let tenant = tenant();
    let holder_gate = if fail {
        Gate::failing()
    } else {
        Gate::default()
    };
    let dup_gate = Gate::open();
    let holder = held(holder_store, &tenant, "k", &holder_gate);
    let waits_before = *dup.waits.borrow();
    let duplicate = async {
        holder_gate.started().await;
        let before = dup.reserves();
        let answer = held(dup, &tenant, "k", &dup_gate).await;
        (answer, dup.reserves() - before)
    };
    let release = async {
        holder_gate.started().await;
        dup.waited(waits_before + 1).await;
        tokio::time::sleep(HOLD).await;
        holder_gate.go.notify_one();
    };
    let (held_answer, (answer, reserves), ()) = tokio::join!(holder, duplicate, release);
    if fail {
        assert!(held_answer.is_err(), "the holder's body failed");
    } else {
        assert_eq!(held_answer.expect("the holder completes"), 7);
    }
    (answer, reserves, holder_gate, dup_gate)
}

fn assert_replayed(answer: Result<u64, Error>, reserves: usize, gates: (&Gate, &Gate)) {
    assert_eq!(answer.expect("the duplicate replays"), 7);
    assert_eq!(
        gates.0.runs.load(Ordering::SeqCst),
        1,
        "the holder ran once"
    );
    assert_eq!(
        gates.1.runs.load(Ordering::SeqCst),
        0,
        "the duplicate's body did not run"
    );
    assert!(
        reserves <= FEW,
        "the duplicate was woken by the completion, not by polling: {reserves} reservations"
    );
}

fn assert_acquired_after_release(
    answer: Result<u64, Error>,
    reserves: usize,
    gates: (&Gate, &Gate),
) {
    assert_eq!(answer.expect("the duplicate runs once the key is free"), 7);
    assert_eq!(gates.0.runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        gates.1.runs.load(Ordering::SeqCst),
        1,
        "the duplicate acquired the released record and ran"
    );
    assert!(
        reserves <= FEW,
        "the duplicate was woken by the release, not by polling: {reserves} reservations"
    );
}

fn sqlite_url() -> String {
    crate::common::scratch::sqlite_url("waiting")
}

#[idempotent(scope = "waiting.bounded", key = key, tenant = tenant, store = store,
             in_progress = wait("1s"), skip(gate))]
async fn held_past_the_bound(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.started.send_replace(true);
    gate.go.notified().await;
    Ok(7)
}

/// Rule 4: the wait is bounded by `in_progress = wait(..)`, not by the
/// owner's lease. The holder's record is still in progress when the
/// duplicate's bound (1 s) is reached, and completes only later (2 s, well
/// inside its 30 s lease): the duplicate is refused with `InProgress` at its
/// bound. A wait bounded by the lease alone is still waiting when the holder
/// completes, and replays. On a paused clock (the memory store reads the
/// runtime's), so the order of the two moments is fixed, not raced.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn memory_a_waiting_duplicate_gives_up_at_its_bound_not_the_lease() {
    let store = MemoryStore::new();
    let tenant = tenant();
    let (holder_gate, dup_gate) = (Gate::default(), Gate::open());
    let holder = held_past_the_bound(&store, &tenant, "k", &holder_gate);
    let duplicate = async {
        holder_gate.started().await;
        held_past_the_bound(&store, &tenant, "k", &dup_gate).await
    };
    let release = async {
        holder_gate.started().await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        holder_gate.go.notify_one();
    };
    let (held_answer, answer, ()) = tokio::join!(holder, duplicate, release);
    assert_eq!(held_answer.expect("the holder completes"), 7);
    assert!(
        matches!(answer, Err(Error::InProgress { .. })),
        "the duplicate must give up at its 1 s bound while the record is in progress: {answer:?}"
    );
    assert_eq!(dup_gate.runs.load(Ordering::SeqCst), 0, "the duplicate ran");
}

#[tokio::test]
async fn memory_a_waiting_duplicate_is_woken_by_the_completion() {
    let store = Counting::new(MemoryStore::new());
    let (answer, reserves, h, d) = duplicate_while_held(&store, &store, false).await;
    assert_replayed(answer, reserves, (&h, &d));
}

#[tokio::test]
async fn memory_a_waiting_duplicate_is_woken_by_the_release_and_acquires() {
    let store = Counting::new(MemoryStore::new());
    let (answer, reserves, h, d) = duplicate_while_held(&store, &store, true).await;
    assert_acquired_after_release(answer, reserves, (&h, &d));
}

#[tokio::test]
async fn sqlite_a_waiting_duplicate_is_woken_by_the_completion() {
    let store = Counting::new(SqliteStore::connect(&sqlite_url()).await.expect("open"));
    let (answer, reserves, h, d) = duplicate_while_held(&store, &store, false).await;
    assert_replayed(answer, reserves, (&h, &d));
}

#[tokio::test]
async fn sqlite_a_waiting_duplicate_is_woken_by_the_release_and_acquires() {
    let store = Counting::new(SqliteStore::connect(&sqlite_url()).await.expect("open"));
    let (answer, reserves, h, d) = duplicate_while_held(&store, &store, true).await;
    assert_acquired_after_release(answer, reserves, (&h, &d));
}

/// Two stores on one file stand for two processes: the holder's store cannot
/// tell the duplicate's. The duplicate's fallback look at the record sees
/// the change, and it still reserves only a few times.
#[tokio::test]
async fn sqlite_two_stores_on_one_file_fall_back_to_looking() {
    let url = sqlite_url();
    let holder = SqliteStore::connect(&url).await.expect("open");
    let dup = Counting::new(SqliteStore::connect(&url).await.expect("open again"));
    let (answer, reserves, h, d) = duplicate_while_held(&holder, &dup, false).await;
    assert_replayed(answer, reserves, (&h, &d));

    let (answer, reserves, h, d) = duplicate_while_held(&holder, &dup, true).await;
    assert_acquired_after_release(answer, reserves, (&h, &d));
}

/// Many duplicates wait on one record; one completion wakes them all, and
/// every one replays.
async fn many_waiters_are_all_woken<S: Store>(store: &Counting<S>) {
    let tenant = tenant();
    let holder_gate = Gate::default();
    let dup_gate = Gate::open();
    const DUPLICATES: usize = 8;
    let holder = held(store, &tenant, "k", &holder_gate);
    let duplicates = async {
        holder_gate.started().await;
        let calls = (0..DUPLICATES).map(|_| held(store, &tenant, "k", &dup_gate));
        futures_util::future::join_all(calls).await
    };
    let release = async {
        holder_gate.started().await;
        store.waited(DUPLICATES).await;
        holder_gate.go.notify_one();
    };
    let (first, answers, ()) = tokio::join!(holder, duplicates, release);
    assert_eq!(first.expect("holder"), 7);
    for answer in answers {
        assert_eq!(answer.expect("every duplicate replays"), 7);
    }
    assert_eq!(dup_gate.runs.load(Ordering::SeqCst), 0);
    assert!(
        store.reserves() <= 1 + DUPLICATES * FEW,
        "{} reservations",
        store.reserves()
    );
}

#[tokio::test]
async fn sqlite_many_waiters_are_all_woken() {
    let store = Counting::new(SqliteStore::connect(&sqlite_url()).await.expect("open"));
    many_waiters_are_all_woken(&store).await;
}

/// A duplicate dropped while it waits (its caller gave up) leaves nothing
/// behind; the holder completes and a later duplicate replays.
async fn a_dropped_waiter_is_harmless<S: Store>(store: &Counting<S>) {
    let tenant = tenant();
    let holder_gate = Gate::default();
    let dup_gate = Gate::open();
    let holder = held(store, &tenant, "k", &holder_gate);
    let drop_a_waiter = async {
        holder_gate.started().await;
        let before = *store.waits.borrow();
        tokio::select! {
            _ = held(store, &tenant, "k", &dup_gate) => {
                panic!("the duplicate cannot finish while the record is held")
            }
            () = store.waited(before + 1) => {}
        }
        holder_gate.go.notify_one();
    };
    let (first, ()) = tokio::join!(holder, drop_a_waiter);
    assert_eq!(first.expect("holder"), 7);
    assert_eq!(
        held(store, &tenant, "k", &dup_gate).await.expect("replay"),
        7
    );
    assert_eq!(dup_gate.runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn memory_a_dropped_waiter_is_harmless() {
    a_dropped_waiter_is_harmless(&Counting::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn sqlite_a_dropped_waiter_is_harmless() {
    let store = Counting::new(SqliteStore::connect(&sqlite_url()).await.expect("open"));
    a_dropped_waiter_is_harmless(&store).await;
}

#[idempotent(scope = "waiting.ended", key = key, tenant = tenant, store = store,
             in_progress = wait("60s"), skip(gate))]
async fn after_an_ended_lease(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

/// The owner ends its lease early (a heartbeat with no lease left, what the
/// engine does when a `recover` hook's answer is not recorded, so that the
/// next call takes over at once): a duplicate already waiting looks again
/// and takes the record over, instead of sleeping until the end of the
/// lease it saw (30 s) or of its wait bound (60 s). The 20 s limit only
/// turns a missed wake-up into a failure instead of a long wait.
async fn woken_by_an_ended_lease<S: Store>(store: &Counting<S>) {
    let tenant = tenant();
    let identity = Identity::new(&tenant, "waiting.ended", "k").expect("identity");
    let token = OwnerToken::new();
    let held = store
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &token,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("the owner reserves");
    assert!(matches!(held, Reservation::Acquired { .. }), "{held:?}");
    let gate = Gate::open();
    let waits_before = *store.waits.borrow();
    let duplicate = after_an_ended_lease(store, &tenant, "k", &gate);
    let end = async {
        store.waited(waits_before + 1).await;
        let ended = store
            .heartbeat(&identity, &token, Duration::ZERO)
            .await
            .expect("heartbeat");
        assert_eq!(ended, Fenced::Written, "the owner still held its record");
    };
    let (answer, ()) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::join!(duplicate, end)
    })
    .await
    .expect("the waiting duplicate was woken by the end of the lease");
    assert_eq!(answer.expect("the duplicate takes the record over"), 7);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "its body ran once");
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("the record");
    assert_eq!(record.attempt, 2, "a takeover (rule 20)");
}

#[tokio::test]
async fn memory_a_waiting_duplicate_is_woken_by_an_ended_lease() {
    woken_by_an_ended_lease(&Counting::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn sqlite_a_waiting_duplicate_is_woken_by_an_ended_lease() {
    let store = SqliteStore::connect(&sqlite_url()).await.expect("open");
    woken_by_an_ended_lease(&Counting::new(store)).await;
}

/// A transactional-mode owner and a store-mode duplicate on one scope (rule 21).
#[idempotent(scope = "waiting.tx_owner", key = key, tenant = tenant, tx = conn, shared_scope,
             skip(gate))]
async fn owner_in_transaction(
    conn: &mut sqlx::SqliteConnection,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    let _ = &conn;
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.started.send_replace(true);
    gate.go.notified().await;
    Ok(7)
}

#[idempotent(scope = "waiting.tx_owner", key = key, tenant = tenant, store = store, shared_scope,
             skip(gate))]
async fn duplicate_in_store_mode(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    Ok(8)
}

/// Rule 4 on SQLite: an owner in transactional mode holds the database's
/// write lock until its transaction ends, and its record is invisible to
/// others until then. A store-mode duplicate whose reservation meets that
/// lock past the busy timeout (100 ms here, 10 s by default) is a duplicate
/// of a call in progress: it waits within its `in_progress` bound and
/// replays once the owner commits. (It used to fail with `Error::Store`,
/// "database is locked", though the owner committed moments later.)
/// Handshake: the owner finishes only once the duplicate has met the lock and
/// entered its wait.
#[tokio::test]
async fn sqlite_a_store_mode_duplicate_waits_for_a_transactional_owner_past_the_busy_timeout() {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;
    let url = sqlite_url();
    let options = |busy: Duration| {
        SqliteConnectOptions::from_str(&url)
            .expect("url")
            .create_if_missing(true)
            .busy_timeout(busy)
    };
    let dup_pool = SqlitePoolOptions::new()
        .connect_with(options(Duration::from_millis(100)))
        .await
        .expect("open");
    let store = Counting::new(SqliteStore::from_pool(dup_pool).await.expect("store"));
    let owner_pool = SqlitePoolOptions::new()
        .connect_with(options(Duration::from_secs(10)))
        .await
        .expect("open again");
    let tenant = tenant();
    let (owner_gate, dup_gate) = (Gate::default(), Gate::open());
    let dup_done = watch::Sender::new(false);
    let owner = async {
        let mut tx = owner_pool.begin().await.expect("begin");
        let answer = owner_in_transaction(&mut tx, &tenant, "k", &owner_gate).await;
        tx.commit().await.expect("commit");
        answer
    };
    let duplicate = async {
        owner_gate.started().await;
        let answer = duplicate_in_store_mode(&store, &tenant, "k", &dup_gate).await;
        dup_done.send_replace(true);
        answer
    };
    let release = async {
        owner_gate.started().await;
        let mut done = dup_done.subscribe();
        tokio::select! {
            () = store.waited(1) => {}
            _ = done.wait_for(|d| *d) => {}
        }
        owner_gate.go.notify_one();
    };
    let (owned, answer, ()) = tokio::join!(owner, duplicate, release);
    assert_eq!(owned.expect("the owner completes"), 7);
    assert_eq!(
        answer.expect("the duplicate waits and replays the owner's result"),
        7
    );
    assert_eq!(owner_gate.runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        dup_gate.runs.load(Ordering::SeqCst),
        0,
        "the duplicate's body did not run"
    );
}

/// Rule 4 with the clock paused: the duplicate is woken by the completion
/// (or the release) itself, not by its wait bound running out. Every step
/// here is in process (memory store), so the paused clock moves only when
/// every task waits: a duplicate that is not woken sleeps to its 10 s bound,
/// which moves the clock 10 s on; one that is woken answers at the moment of
/// the change. (The reservation count of the tests above cannot tell the two
/// apart: a waiter that sleeps to its bound reserves twice, as a woken one
/// does.)
async fn answered_at_the_change(fail: bool) {
    let store = Counting::new(MemoryStore::new());
    let tenant = tenant();
    let holder_gate = if fail {
        Gate::failing()
    } else {
        Gate::default()
    };
    let dup_gate = Gate::open();
    let holder = held(&store, &tenant, "k", &holder_gate);
    let duplicate = async {
        holder_gate.started().await;
        let answer = held(&store, &tenant, "k", &dup_gate).await;
        (answer, tokio::time::Instant::now())
    };
    let release = async {
        holder_gate.started().await;
        store.waited(1).await;
        tokio::time::sleep(HOLD).await;
        holder_gate.go.notify_one();
        tokio::time::Instant::now()
    };
    let (held_answer, (answer, answered_at), changed_at) = tokio::join!(holder, duplicate, release);
    assert_eq!(held_answer.is_err(), fail, "the holder's own answer");
    assert_eq!(answer.expect("the duplicate's answer"), 7);
    assert_eq!(
        dup_gate.runs.load(Ordering::SeqCst),
        usize::from(fail),
        "the duplicate runs only when the holder released"
    );
    // Paused clock: 0 when woken by the change, about 9.6 s when the
    // duplicate slept to its 10 s bound.
    let after = answered_at.saturating_duration_since(changed_at);
    assert!(
        after < Duration::from_secs(1),
        "the duplicate answered {after:?} after the holder's {} (paused clock): it was not woken by it",
        if fail { "release" } else { "completion" }
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn memory_a_waiting_duplicate_answers_at_the_completion_not_at_its_bound() {
    answered_at_the_change(false).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn memory_a_waiting_duplicate_answers_at_the_release_not_at_its_bound() {
    answered_at_the_change(true).await;
}

/// A store whose `wait_for_change` first lets the holder finish (and waits
/// until its change is written), then waits as the memory store does: the
/// change lands between the reservation that found the record in progress
/// and the waiter's subscription, the window a lost wake-up lives in.
struct ChangeBeforeTheWait {
    inner: Counting<MemoryStore>,
    /// Told when a duplicate enters its wait; the test lets the holder go.
    entered: Notify,
    /// Set once the holder's call has returned (its change is written).
    changed: watch::Sender<bool>,
}

#[async_trait::async_trait]
impl Store for ChangeBeforeTheWait {
    fn name(&self) -> &'static str {
        "change-before-the-wait"
    }
    async fn reserve(
        &self,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, idempotent_runtime::StoreError> {
        self.inner.reserve(r).await
    }
    async fn complete(
        &self,
        c: idempotent_runtime::Completion<'_>,
    ) -> Result<Fenced, idempotent_runtime::StoreError> {
        self.inner.complete(c).await
    }
    async fn release(
        &self,
        i: &Identity,
        t: &OwnerToken,
    ) -> Result<Fenced, idempotent_runtime::StoreError> {
        self.inner.release(i, t).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, idempotent_runtime::StoreError> {
        self.inner.heartbeat(i, t, lease).await
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.release_detached(i, t)
    }
    fn complete_detached(&self, c: idempotent_runtime::Completion<'_>) {
        self.inner.complete_detached(c)
    }
    fn end_lease_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.end_lease_detached(i, t)
    }
    async fn force_release(
        &self,
        i: &Identity,
        r: bool,
    ) -> Result<idempotent_runtime::ForcedRelease, idempotent_runtime::StoreError> {
        self.inner.force_release(i, r).await
    }
    async fn wait_for_change(&self, i: &Identity, max_wait: Duration, round: u32) {
        self.entered.notify_one();
        let _ = self.changed.subscribe().wait_for(|c| *c).await;
        self.inner.wait_for_change(i, max_wait, round).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, idempotent_runtime::StoreError> {
        self.inner.purge_expired(batch).await
    }
    async fn fetch(
        &self,
        i: &Identity,
    ) -> Result<Option<idempotent_runtime::RecordSnapshot>, idempotent_runtime::StoreError> {
        self.inner.fetch(i).await
    }
    async fn scope_stats(
        &self,
    ) -> Result<Vec<idempotent_runtime::ScopeStats>, idempotent_runtime::StoreError> {
        self.inner.scope_stats().await
    }
}

/// Rule 4, the lost wake-up: the holder completes (or releases) after the
/// duplicate's reservation found it in progress and before the duplicate
/// subscribes to its change. The wait must see that the record changed and
/// end at once, not sleep to its bound (10 s) or the lease (30 s) for a
/// notification already sent. On a paused clock: answered at the moment of
/// the change.
async fn a_change_before_the_subscription_is_not_missed(fail: bool) {
    let store = ChangeBeforeTheWait {
        inner: Counting::new(MemoryStore::new()),
        entered: Notify::new(),
        changed: watch::Sender::new(false),
    };
    let tenant = tenant();
    let holder_gate = if fail {
        Gate::failing()
    } else {
        Gate::default()
    };
    let dup_gate = Gate::open();
    let holder = async {
        let answer = held(&store, &tenant, "k", &holder_gate).await;
        let at = tokio::time::Instant::now();
        store.changed.send_replace(true);
        (answer, at)
    };
    let duplicate = async {
        holder_gate.started().await;
        let answer = held(&store, &tenant, "k", &dup_gate).await;
        (answer, tokio::time::Instant::now())
    };
    let release = async {
        store.entered.notified().await;
        holder_gate.go.notify_one();
    };
    let ((held_answer, changed_at), (answer, answered_at), ()) =
        tokio::join!(holder, duplicate, release);
    assert_eq!(held_answer.is_err(), fail);
    assert_eq!(answer.expect("the duplicate's answer"), 7);
    assert_eq!(dup_gate.runs.load(Ordering::SeqCst), usize::from(fail));
    assert_eq!(
        answered_at.saturating_duration_since(changed_at),
        Duration::ZERO,
        "(paused clock) the duplicate slept past a change made before it subscribed"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn memory_a_completion_before_the_waiter_subscribes_is_not_missed() {
    a_change_before_the_subscription_is_not_missed(false).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn memory_a_release_before_the_waiter_subscribes_is_not_missed() {
    a_change_before_the_subscription_is_not_missed(true).await;
}

/// The MySQL/MariaDB store (one database shared by the suite; a fresh tenant
/// per test).
async fn mysql() -> Option<Counting<MySqlStore>> {
    mysql_store_or_skip().await.map(Counting::new)
}

#[tokio::test]
async fn mysql_a_waiting_duplicate_is_woken_by_the_completion() {
    let Some(store) = mysql().await else { return };
    let (answer, reserves, h, d) = duplicate_while_held(&store, &store, false).await;
    assert_replayed(answer, reserves, (&h, &d));
}

#[tokio::test]
async fn mysql_a_waiting_duplicate_is_woken_by_the_release_and_acquires() {
    let Some(store) = mysql().await else { return };
    let (answer, reserves, h, d) = duplicate_while_held(&store, &store, true).await;
    assert_acquired_after_release(answer, reserves, (&h, &d));
}

/// Two stores opened on one database stand for two processes: the holder's
/// store cannot tell the duplicate's. The duplicate's look at the record (a
/// primary-key read) sees the change, and it reserves only a few times,
/// where it used to reserve again at every poll (about ten times a second).
#[tokio::test]
async fn mysql_two_stores_on_one_database_fall_back_to_looking() {
    let Some(holder) = mysql_store_or_skip().await else {
        return;
    };
    let Some(dup) = mysql().await else { return };
    let (answer, reserves, h, d) = duplicate_while_held(&holder, &dup, false).await;
    assert_replayed(answer, reserves, (&h, &d));

    let (answer, reserves, h, d) = duplicate_while_held(&holder, &dup, true).await;
    assert_acquired_after_release(answer, reserves, (&h, &d));
}

/// A transactional-mode owner on MySQL/MariaDB, on the scope of
/// [`owner_in_transaction`] (rule 21).
#[idempotent(scope = "waiting.tx_owner", key = key, tenant = tenant, tx = conn, shared_scope,
             skip(gate))]
async fn owner_in_mysql_transaction(
    conn: &mut sqlx::MySqlConnection,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    let _ = &conn;
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.started.send_replace(true);
    gate.go.notified().await;
    Ok(7)
}

/// Rule 4 on MySQL/MariaDB behind an owner in transactional mode: its record
/// is written in its caller's transaction, invisible to others and its row
/// locked until that transaction ends. The store-mode duplicate's look at the
/// record finds nothing in progress and returns at once; its reservation
/// waits for the row (a second at most through the store, then
/// `InProgress`), so the wait does not go round without a pause: the
/// duplicate waits within its bound, reserving a few times, and replays the
/// owner's result once the owner commits. Handshake: the owner finishes only
/// once the duplicate has entered its wait, and holds on a little longer.
#[tokio::test]
async fn mysql_a_store_mode_duplicate_waits_for_a_transactional_owner() {
    let Some(store) = mysql().await else { return };
    let owner_pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&crate::common::servers::mysql_url())
        .await
        .expect("pool");
    let tenant = tenant();
    let (owner_gate, dup_gate) = (Gate::default(), Gate::open());
    let dup_done = watch::Sender::new(false);
    let owner = async {
        let mut tx = owner_pool.begin().await.expect("begin");
        let answer = owner_in_mysql_transaction(&mut tx, &tenant, "k", &owner_gate).await;
        tx.commit().await.expect("commit");
        answer
    };
    let duplicate = async {
        owner_gate.started().await;
        let before = store.reserves();
        let answer = duplicate_in_store_mode(&store, &tenant, "k", &dup_gate).await;
        dup_done.send_replace(true);
        (answer, store.reserves() - before)
    };
    let release = async {
        owner_gate.started().await;
        let mut done = dup_done.subscribe();
        tokio::select! {
            () = store.waited(1) => tokio::time::sleep(HOLD).await,
            _ = done.wait_for(|d| *d) => {}
        }
        owner_gate.go.notify_one();
    };
    let (owned, (answer, reserves), ()) = tokio::join!(owner, duplicate, release);
    owner_pool.close().await;
    assert_eq!(owned.expect("the owner completes"), 7);
    assert_eq!(
        answer.expect("the duplicate waits and replays the owner's result"),
        7
    );
    assert_eq!(owner_gate.runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        dup_gate.runs.load(Ordering::SeqCst),
        0,
        "the duplicate's body did not run"
    );
    assert!(
        reserves <= FEW,
        "the duplicate waited, not reserving again and again: {reserves} reservations"
    );
}

#[tokio::test]
async fn mysql_many_waiters_are_all_woken() {
    let Some(store) = mysql().await else { return };
    many_waiters_are_all_woken(&store).await;
}

#[tokio::test]
async fn mysql_a_dropped_waiter_is_harmless() {
    let Some(store) = mysql().await else { return };
    a_dropped_waiter_is_harmless(&store).await;
}

#[tokio::test]
async fn mysql_a_waiting_duplicate_is_woken_by_an_ended_lease() {
    let Some(store) = mysql().await else { return };
    woken_by_an_ended_lease(&store).await;
}
