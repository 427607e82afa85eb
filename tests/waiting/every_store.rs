//! Waiting duplicates (rules 3, 4, 9, 10, 14) on every store, memory, SQLite
//! (a file, and `sqlite::memory:`), PostgreSQL and MySQL/MariaDB, through one
//! set of scenarios: many waiters behind one holder that fails (exactly one
//! of them runs the body), behind a holder that died (exactly one takes the
//! record over at the end of the lease), on a pool of one connection
//! (waiters hold no connection while they wait, so the holder can still
//! record its result), two tenants with the same scope and key (a waiter is
//! never answered with the other tenant's result), the `retry_after` a
//! refused duplicate is told, a waiter dropped mid-wait, and a wait bound and
//! lease of ages. Then, for the stores that tell their waiters (all but
//! MySQL), 40 waiters on one key are woken, not polling.
//!
//! Every holder is held by a handshake: its body waits until the test lets
//! it go, which the test does only once every duplicate has entered its wait
//! (`Counting::waited`). Timeouts only turn a hang into a failure.

use crate::common::counting::Counting;
use crate::common::servers::{mysql_url, pg_url, servers_required};
use idempotent_runtime::{
    idempotent, with_outcome, Error, ForcedRelease, Identity, MemoryStore, MySqlStore, Outcome,
    OwnerToken, PgStore, RecordState, Recovery, Reservation, ReserveRequest, SqliteStore, Store,
    Takeover,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::watch;

/// The longest any scenario may take before it fails (the wait bounds are
/// 60 s; each scenario takes well under a few seconds when the store behaves).
const LIMIT: Duration = Duration::from_secs(45);

/// A body's gate: counts runs, says it started, waits until `go` is set
/// (every body sharing the gate), then answers `value` or fails.
struct Gate {
    runs: AtomicUsize,
    started: watch::Sender<usize>,
    go: watch::Sender<bool>,
    fail: bool,
    value: u64,
}

impl Gate {
    fn new(value: u64, fail: bool, open: bool) -> Self {
        Gate {
            runs: AtomicUsize::new(0),
            started: watch::Sender::new(0),
            go: watch::Sender::new(open),
            fail,
            value,
        }
    }
    fn holding(value: u64) -> Self {
        Self::new(value, false, false)
    }
    fn open(value: u64) -> Self {
        Self::new(value, false, true)
    }
    fn failing() -> Self {
        Self::new(0, true, false)
    }
    async fn started(&self, n: usize) {
        let _ = self.started.subscribe().wait_for(|s| *s >= n).await;
    }
    fn go(&self) {
        self.go.send_replace(true);
    }
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

const SCOPE: &str = "waiting.every_store.gated";

#[idempotent(scope = "waiting.every_store.gated", key = key, tenant = tenant, store = store,
             in_progress = wait("60s"), lease = "30s", skip(gate), shared_scope)]
async fn gated(store: &dyn Store, tenant: &str, key: &str, gate: &Gate) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.started.send_modify(|s| *s += 1);
    let _ = gate.go.subscribe().wait_for(|g| *g).await;
    if gate.fail {
        return Err(Error::NoDefaultStore {
            scope: "the holder's own error".into(),
        });
    }
    Ok(gate.value)
}

#[idempotent(scope = "waiting.every_store.gated", key = key, tenant = tenant, store = store,
             in_progress = reject, lease = "30s", skip(gate), shared_scope)]
async fn gated_reject(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    Ok(gate.value)
}

#[idempotent(scope = "waiting.every_store.gated", key = key, tenant = tenant, store = store,
             in_progress = wait("1s"), lease = "30s", skip(gate), shared_scope)]
async fn gated_short_wait(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    Ok(gate.value)
}

fn tenant() -> String {
    format!("t-{}", uuid::Uuid::new_v4().simple())
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: still not done after {LIMIT:?}"))
}

// ------------------------------------------------------------ the stores

#[derive(Clone, Copy, Debug)]
enum Kind {
    Memory,
    Sqlite,
    /// `sqlite::memory:`: a database in memory, shared by the store's connections.
    SqliteInMemory,
    Postgres,
    MySql,
}

/// A store of `kind` whose pool has at most `connections` connections (the
/// memory store has none), or `None` when its server is unreachable (after a
/// loud SKIPPED line, or a failure under `IDEMPOTENT_REQUIRE_SERVERS=1`).
async fn store(kind: Kind, connections: u32) -> Option<Box<dyn Store>> {
    fn skipped(what: &str, e: &dyn std::fmt::Display) -> Option<Box<dyn Store>> {
        assert!(!servers_required(), "{what} is unreachable: {e}");
        eprintln!("\n!!!!!!!! SKIPPED: {what} is unreachable ({e})\n");
        None
    }
    match kind {
        Kind::Memory => Some(Box::new(MemoryStore::new())),
        Kind::Sqlite => {
            use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
            use std::str::FromStr;
            let url = crate::common::scratch::sqlite_url("waiting-every-store");
            let options = SqliteConnectOptions::from_str(&url)
                .expect("url")
                .create_if_missing(true);
            let pool = SqlitePoolOptions::new()
                .max_connections(connections)
                .connect_with(options)
                .await
                .expect("open");
            Some(Box::new(SqliteStore::from_pool(pool).await.expect("store")))
        }
        Kind::SqliteInMemory => Some(Box::new(
            SqliteStore::connect("sqlite::memory:")
                .await
                .expect("an in-memory store"),
        )),
        Kind::Postgres => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(Duration::from_secs(5))
                .connect(&pg_url())
                .await;
            match pool {
                Ok(pool) => Some(Box::new(PgStore::from_pool(pool).await.expect("store"))),
                Err(e) => skipped("PostgreSQL", &e),
            }
        }
        Kind::MySql => {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(Duration::from_secs(5))
                .connect(&mysql_url())
                .await;
            match pool {
                Ok(pool) => Some(Box::new(MySqlStore::from_pool(pool).await.expect("store"))),
                Err(e) => skipped("MySQL/MariaDB", &e),
            }
        }
    }
}

// ------------------------------------------------------------ scenarios

/// `waiters` duplicates wait behind a holder whose body fails (`errors =
/// release`): the release wakes them, and exactly one of them runs the body
/// (rule 3: one runner at a time per identity); every other one replays its
/// result. None is told `InProgress` (the wait bound is 60 s), and none runs
/// the body a second time.
async fn waiters_behind_a_failing_holder(kind: Kind, connections: u32, waiters: usize) {
    let Some(inner) = store(kind, connections).await else {
        return;
    };
    let store = Counting::new(inner);
    let tenant = tenant();
    let holder_gate = Gate::failing();
    // The duplicates' bodies hold too, so that the others find the new
    // owner in progress and wait for it as well.
    let dup_gate = Gate::holding(7);
    let holder = gated(&store, &tenant, "k", &holder_gate);
    let duplicates = async {
        holder_gate.started(1).await;
        let calls = (0..waiters).map(|_| with_outcome(gated(&store, &tenant, "k", &dup_gate)));
        futures_util::future::join_all(calls).await
    };
    let script = async {
        holder_gate.started(1).await;
        store.waited(waiters).await;
        holder_gate.go();
        // One duplicate took the released record: it runs. Let it go once
        // the others have entered a wait again (each waited once before).
        dup_gate.started(1).await;
        store.waited(2 * waiters - 1).await;
        dup_gate.go();
    };
    let (held, answers, ()) = within(
        &format!("{kind:?}: waiters behind a failing holder"),
        async { tokio::join!(holder, duplicates, script) },
    )
    .await;
    assert!(held.is_err(), "{kind:?}: the holder's body failed");
    assert_eq!(holder_gate.runs(), 1);
    assert_eq!(
        dup_gate.runs(),
        1,
        "{kind:?}: exactly one waiter runs the released record's body"
    );
    let mut executed = 0;
    for (answer, outcome) in answers {
        assert_eq!(
            answer.unwrap_or_else(|e| panic!("{kind:?}: a waiter's answer: {e}")),
            7
        );
        if outcome == Some(Outcome::Executed) {
            executed += 1;
        }
    }
    assert_eq!(
        executed, 1,
        "{kind:?}: one waiter executed, the others replayed"
    );
}

/// A holder that died (its record reserved with a 1 s lease, never
/// completed): `waiters` duplicates wait; at the end of the lease exactly one
/// takes the record over (attempt 2) and runs the body, the others replay.
async fn waiters_behind_a_dead_holder(kind: Kind, waiters: usize) {
    let Some(inner) = store(kind, 8).await else {
        return;
    };
    let store = Counting::new(inner);
    let tenant = tenant();
    let identity = Identity::new(&tenant, SCOPE, "k").expect("identity");
    let dead = OwnerToken::new();
    let held = store
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &dead,
            lease: Duration::from_secs(1),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("the dead holder reserves");
    assert!(matches!(held, Reservation::Acquired { .. }), "{held:?}");
    let dup_gate = Gate::open(9);
    let calls = (0..waiters).map(|_| with_outcome(gated(&store, &tenant, "k", &dup_gate)));
    let answers = within(&format!("{kind:?}: waiters behind a dead holder"), async {
        futures_util::future::join_all(calls).await
    })
    .await;
    assert_eq!(
        dup_gate.runs(),
        1,
        "{kind:?}: exactly one waiter took the record over"
    );
    for (answer, _) in answers {
        assert_eq!(
            answer.unwrap_or_else(|e| panic!("{kind:?}: a waiter's answer: {e}")),
            9
        );
    }
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(record.attempt, 2, "{kind:?}: one takeover");
}

/// Two tenants hold the same scope and key at once, and each has waiters.
/// The first tenant's holder completes: its waiters replay its value; the
/// other tenant's waiters (a notification is per identity; were it per key,
/// they would be woken for a record not theirs) must not be answered with
/// it, and get their own holder's value once it completes.
async fn two_tenants_one_key(kind: Kind) {
    let Some(inner) = store(kind, 8).await else {
        return;
    };
    let store = Counting::new(inner);
    let (a, b) = (tenant(), tenant());
    let (gate_a, gate_b) = (Gate::holding(1), Gate::holding(2));
    let dup_gate = Gate::open(99);
    const WAITERS: usize = 3;
    let holders = async {
        tokio::join!(
            gated(&store, &a, "k", &gate_a),
            gated(&store, &b, "k", &gate_b)
        )
    };
    let b_done = AtomicUsize::new(0);
    let a_done = watch::Sender::new(0usize);
    let duplicates = async {
        gate_a.started(1).await;
        gate_b.started(1).await;
        let of_a = (0..WAITERS).map(|_| async {
            let answer = gated(&store, &a, "k", &dup_gate).await;
            a_done.send_modify(|n| *n += 1);
            answer
        });
        let of_b = (0..WAITERS).map(|_| async {
            let answer = gated(&store, &b, "k", &dup_gate).await;
            b_done.fetch_add(1, Ordering::SeqCst);
            answer
        });
        tokio::join!(
            futures_util::future::join_all(of_a),
            futures_util::future::join_all(of_b)
        )
    };
    let script = async {
        gate_a.started(1).await;
        gate_b.started(1).await;
        store.waited(2 * WAITERS).await;
        gate_a.go();
        // Once every waiter of A has its answer (A's change was seen),
        // B's waiters, whose holder still runs, must still be waiting.
        let _ = a_done.subscribe().wait_for(|n| *n == WAITERS).await;
        assert_eq!(
            b_done.load(Ordering::SeqCst),
            0,
            "{kind:?}: tenant B's waiters were answered while B's holder still runs"
        );
        gate_b.go();
    };
    let ((held_a, held_b), (answers_a, answers_b), ()) =
        within(&format!("{kind:?}: two tenants, one key"), async {
            tokio::join!(holders, duplicates, script)
        })
        .await;
    assert_eq!(held_a.expect("holder A"), 1);
    assert_eq!(held_b.expect("holder B"), 2);
    for answer in answers_a {
        assert_eq!(answer.expect("a waiter of A"), 1, "{kind:?}: A's waiter");
    }
    for answer in answers_b {
        assert_eq!(answer.expect("a waiter of B"), 2, "{kind:?}: B's waiter");
    }
    assert_eq!(dup_gate.runs(), 0, "{kind:?}: no waiter ran the body");
}

/// Rule 4's refusal: a duplicate with `in_progress = reject`, and one whose
/// 1 s wait bound ran out, behind a holder whose lease (30 s) has most of it
/// to run, are told `InProgress` with `retry_after` the lease left: more
/// than the wait, at most the lease.
async fn refused_with_the_lease_left(kind: Kind) {
    let Some(store) = store(kind, 8).await else {
        return;
    };
    let tenant = tenant();
    let holder_gate = Gate::holding(1);
    let dup_gate = Gate::open(2);
    let holder = gated(&*store, &tenant, "k", &holder_gate);
    let duplicates = async {
        holder_gate.started(1).await;
        let rejected = gated_reject(&*store, &tenant, "k", &dup_gate).await;
        let waited = gated_short_wait(&*store, &tenant, "k", &dup_gate).await;
        holder_gate.go();
        (rejected, waited)
    };
    let (held, (rejected, waited)) = within(&format!("{kind:?}: refusals"), async {
        tokio::join!(holder, duplicates)
    })
    .await;
    assert_eq!(held.expect("holder"), 1);
    for (what, answer) in [("reject", rejected), ("wait(1s)", waited)] {
        match answer {
            Err(Error::InProgress { retry_after, .. }) => assert!(
                retry_after > Duration::from_secs(20) && retry_after <= Duration::from_secs(30),
                "{kind:?} {what}: retry_after {retry_after:?} is not the lease left"
            ),
            other => panic!("{kind:?} {what}: expected InProgress, got {other:?}"),
        }
    }
    assert_eq!(dup_gate.runs(), 0);
}

/// Rule 14 for a waiter: a duplicate dropped while it waits (its caller
/// gave up) leaves nothing behind: the holder still completes, a duplicate
/// that waits after it is still woken and replays, and so does a later call.
async fn a_dropped_waiter(kind: Kind) {
    let Some(inner) = store(kind, 4).await else {
        return;
    };
    let store = Counting::new(inner);
    let tenant = tenant();
    let holder_gate = Gate::holding(6);
    let dup_gate = Gate::open(0);
    let holder = gated(&store, &tenant, "k", &holder_gate);
    let script = async {
        holder_gate.started(1).await;
        tokio::select! {
            answer = gated(&store, &tenant, "k", &dup_gate) => {
                panic!("{kind:?}: the duplicate answered while the record is held: {answer:?}")
            }
            () = store.waited(1) => {}
        }
        // Dropped. Another one waits, then the holder completes.
        let kept = gated(&store, &tenant, "k", &dup_gate);
        let go = async {
            store.waited(2).await;
            holder_gate.go();
        };
        let (answer, ()) = tokio::join!(kept, go);
        answer
    };
    let (held, kept) = within(&format!("{kind:?}: a dropped waiter"), async {
        tokio::join!(holder, script)
    })
    .await;
    assert_eq!(held.expect("holder"), 6);
    assert_eq!(kept.expect("the waiter kept"), 6, "{kind:?}");
    assert_eq!(
        gated(&store, &tenant, "k", &dup_gate)
            .await
            .expect("replay"),
        6
    );
    assert_eq!(dup_gate.runs(), 0, "{kind:?}: no duplicate ran the body");
}

#[idempotent(scope = "waiting.every_store.gated", key = key, tenant = tenant, store = store,
             in_progress = wait("500000000years"), lease = "500000000years", skip(gate),
             shared_scope)]
async fn gated_for_ages(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.started.send_modify(|s| *s += 1);
    let _ = gate.go.subscribe().wait_for(|g| *g).await;
    Ok(gate.value)
}

/// A wait bound and a lease of 500 million years (near the longest the
/// attribute takes): the holder reserves, a duplicate waits (no clock
/// overflows, no store refuses the lease's end), is woken by the completion
/// and replays.
async fn bounds_of_ages(kind: Kind) {
    let Some(inner) = store(kind, 4).await else {
        return;
    };
    let store = Counting::new(inner);
    let tenant = tenant();
    let holder_gate = Gate::holding(4);
    let dup_gate = Gate::open(0);
    let holder = gated_for_ages(&store, &tenant, "k", &holder_gate);
    let duplicate = async {
        holder_gate.started(1).await;
        gated_for_ages(&store, &tenant, "k", &dup_gate).await
    };
    let script = async {
        holder_gate.started(1).await;
        store.waited(1).await;
        holder_gate.go();
    };
    let (held, answer, ()) = within(&format!("{kind:?}: bounds of ages"), async {
        tokio::join!(holder, duplicate, script)
    })
    .await;
    assert_eq!(held.expect("holder"), 4, "{kind:?}");
    assert_eq!(answer.expect("the duplicate"), 4, "{kind:?}");
    assert_eq!(dup_gate.runs(), 0);
}

#[idempotent(scope = "waiting.every_store.gated", key = key, tenant = tenant, store = store,
             in_progress = wait("600s"), lease = "600s", skip(gate), shared_scope)]
async fn gated_long(store: &dyn Store, tenant: &str, key: &str, gate: &Gate) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.started.send_modify(|s| *s += 1);
    let _ = gate.go.subscribe().wait_for(|g| *g).await;
    assert!(!gate.fail, "the holder's body panics");
    Ok(gate.value)
}

const RECOVERED: &str = "waiting.every_store.recovered";

/// Asked before a takeover: run the body again.
async fn run_again(takeover: &Takeover) -> Result<Recovery<u64>, Error> {
    let _ = takeover;
    Ok(Recovery::Run)
}

/// [`gated_long`] in a scope with a `recover` hook: a panic or a drop ends
/// the lease (rules 14, 20) instead of releasing the record.
#[idempotent(scope = "waiting.every_store.recovered", key = key, tenant = tenant, store = store,
             in_progress = wait("600s"), lease = "600s", skip(gate), recover = run_again)]
async fn gated_long_hooked(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.started.send_modify(|s| *s += 1);
    let _ = gate.go.subscribe().wait_for(|g| *g).await;
    assert!(!gate.fail, "the holder's body panics");
    Ok(gate.value)
}

/// A call of [`gated_long_hooked`] when `hooked`, else of [`gated_long`].
fn stopping<'a>(
    hooked: bool,
    store: &'a dyn Store,
    tenant: &'a str,
    key: &'a str,
    gate: &'a Gate,
) -> futures_util::future::BoxFuture<'a, Result<u64, Error>> {
    if hooked {
        Box::pin(gated_long_hooked(store, tenant, key, gate))
    } else {
        Box::pin(gated_long(store, tenant, key, gate))
    }
}

/// How a holder stops holding its record without completing it.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// Its body panics (rule 14: the record is released).
    Panics,
    /// Its call is dropped mid-body (rule 14: the record is released).
    Dropped,
    /// An operator releases the record (`force_release`) while it runs.
    OperatorRelease,
}

/// `waiters` duplicates wait behind a holder whose lease and their wait
/// bound are 10 minutes; the holder stops holding (`ending`). The change
/// wakes them (or their fallback look sees it) long before either bound:
/// exactly one of them runs the body, as the next attempt, and the others
/// replay its result. After an operator's release the holder's own
/// completion, made once the waiters are answered, is refused.
async fn waiters_behind_a_holder_that_stops(
    kind: Kind,
    ending: Ending,
    hooked: bool,
    waiters: usize,
) {
    let Some(inner) = store(kind, 8).await else {
        return;
    };
    let store = Counting::new(inner);
    stops_behind(kind, &store, &store, (ending, hooked), waiters).await;
}

/// [`waiters_behind_a_holder_that_stops`] with the holder (and the
/// operator) on `holder_store` and the waiters on `store`: when the two are
/// separate store objects on one database (two processes), the waiters are
/// not told of the change, and their fallback looks see it.
async fn stops_behind(
    kind: Kind,
    holder_store: &dyn Store,
    store: &Counting<Box<dyn Store>>,
    (ending, hooked): (Ending, bool),
    waiters: usize,
) {
    let tenant = tenant();
    let scope = if hooked { RECOVERED } else { SCOPE };
    let identity = Identity::new(&tenant, scope, "k").expect("identity");
    let holder_gate = match ending {
        Ending::Panics => Gate::new(0, true, false),
        Ending::Dropped | Ending::OperatorRelease => Gate::holding(1),
    };
    let dup_gate = Gate::open(8);
    let dropped = watch::Sender::new(false);
    let answered = watch::Sender::new(false);
    let holder = async {
        let call = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(stopping(
            hooked,
            holder_store,
            &tenant,
            "k",
            &holder_gate,
        )));
        let mut dropped = dropped.subscribe();
        tokio::select! {
            answer = call => Some(answer),
            _ = dropped.wait_for(|d| *d) => None,
        }
    };
    let duplicates = async {
        holder_gate.started(1).await;
        let calls =
            (0..waiters).map(|_| with_outcome(stopping(hooked, store, &tenant, "k", &dup_gate)));
        let answers = futures_util::future::join_all(calls).await;
        answered.send_replace(true);
        answers
    };
    let script = async {
        holder_gate.started(1).await;
        store.waited(waiters).await;
        match ending {
            Ending::Panics => holder_gate.go(),
            Ending::Dropped => {
                dropped.send_replace(true);
            }
            Ending::OperatorRelease => {
                let released = holder_store.force_release(&identity, false).await;
                assert!(
                    matches!(released, Ok(ForcedRelease::Released { .. })),
                    "{kind:?}: the operator's release: {released:?}"
                );
                let _ = answered.subscribe().wait_for(|a| *a).await;
                holder_gate.go();
            }
        }
    };
    let (held, answers, ()) = within(
        &format!("{kind:?}: waiters behind a holder that stops ({ending:?})"),
        async { tokio::join!(holder, duplicates, script) },
    )
    .await;
    match (ending, held) {
        (Ending::Panics, Some(Err(_))) | (Ending::Dropped, None) => {}
        (Ending::OperatorRelease, Some(Ok(Err(Error::LeaseLost(_))))) => {}
        (_, held) => panic!(
            "{kind:?} {ending:?}: the holder's answer: {:?}",
            held.map(|h| h.map_err(|_| "a panic"))
        ),
    }
    assert_eq!(holder_gate.runs(), 1);
    assert_eq!(
        dup_gate.runs(),
        1,
        "{kind:?} {ending:?}: exactly one waiter runs the body"
    );
    let mut executed = 0;
    for (answer, outcome) in answers {
        assert_eq!(
            answer.unwrap_or_else(|e| panic!("{kind:?} {ending:?}: a waiter's answer: {e}")),
            8
        );
        executed += usize::from(outcome == Some(Outcome::Executed));
    }
    assert_eq!(
        executed, 1,
        "{kind:?} {ending:?}: one executed, the others replayed"
    );
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(record.state, RecordState::Complete, "{kind:?} {ending:?}");
    let attempt = match ending {
        Ending::Panics | Ending::Dropped if hooked => 2,
        _ => 1,
    };
    assert_eq!(
        record.attempt, attempt,
        "{kind:?} {ending:?}, hooked: {hooked}"
    );
}

/// A wait for the store's background work with no bound the clock can
/// hold (`Duration::MAX`, "as long as it takes") answers like any other:
/// after a call dropped mid-body, the release it handed over is finished,
/// and 0 is left.
async fn background_work_waited_for_without_bound(kind: Kind) {
    let Some(store) = store(kind, 4).await else {
        return;
    };
    let tenant = tenant();
    let gate = Gate::holding(1);
    tokio::select! {
        answer = gated(&*store, &tenant, "k", &gate) => panic!("{kind:?}: answered: {answer:?}"),
        () = gate.started(1) => {}
    }
    let left = within(
        &format!("{kind:?}: background work"),
        store.finish_background_work(Duration::MAX),
    )
    .await;
    assert_eq!(left, 0, "{kind:?}: the dropped call's release is finished");
    let identity = Identity::new(&tenant, SCOPE, "k").expect("identity");
    assert!(
        store.fetch(&identity).await.expect("fetch").is_none(),
        "{kind:?}: the dropped call's record is released"
    );
}

/// 20 keys, each held, with 3 waiters each (60 in all; lease and wait
/// bound 10 minutes); one waiter per key is dropped mid-wait. When the
/// holders complete, every waiter kept is woken (none waits out a bound) and
/// replays its own key's value; no waiter runs the body.
async fn many_keys_with_dropped_waiters(kind: Kind) {
    const KEYS: usize = 20;
    let Some(inner) = store(kind, 8).await else {
        return;
    };
    let store = Counting::new(inner);
    let tenant = tenant();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
    let gates: Vec<Gate> = (0..KEYS).map(|i| Gate::holding(100 + i as u64)).collect();
    let dup_gate = Gate::open(0);
    let cancel = watch::Sender::new(false);
    let gone = watch::Sender::new(0usize);
    let holders = futures_util::future::join_all(
        (0..KEYS).map(|i| gated_long(&store, &tenant, &keys[i], &gates[i])),
    );
    let duplicates = async {
        for gate in &gates {
            gate.started(1).await;
        }
        let calls = (0..3 * KEYS).map(|n| {
            let (store, tenant, keys, dup_gate) = (&store, &tenant, &keys, &dup_gate);
            let (cancel, gone) = (&cancel, &gone);
            async move {
                let call = gated_long(store, tenant, &keys[n % KEYS], dup_gate);
                if n % 3 != 0 {
                    return Some(call.await);
                }
                let mut cancelled = cancel.subscribe();
                let answer = tokio::select! {
                    answer = call => Some(answer),
                    _ = cancelled.wait_for(|c| *c) => None,
                };
                gone.send_modify(|g| *g += 1);
                answer
            }
        });
        futures_util::future::join_all(calls).await
    };
    let script = async {
        for gate in &gates {
            gate.started(1).await;
        }
        store.waited(3 * KEYS).await;
        cancel.send_replace(true);
        let _ = gone.subscribe().wait_for(|g| *g == KEYS).await;
        for gate in &gates {
            gate.go();
        }
    };
    let (held, answers, ()) = within(&format!("{kind:?}: many keys, dropped waiters"), async {
        tokio::join!(holders, duplicates, script)
    })
    .await;
    for (i, answer) in held.into_iter().enumerate() {
        assert_eq!(answer.expect("a holder"), 100 + i as u64);
    }
    for (n, answer) in answers.into_iter().enumerate() {
        match answer {
            None => assert_eq!(
                n % 3,
                0,
                "{kind:?}: only the dropped waiters gave no answer"
            ),
            Some(answer) => assert_eq!(
                answer.unwrap_or_else(|e| panic!("{kind:?}: waiter {n}: {e}")),
                100 + (n % KEYS) as u64,
                "{kind:?}: waiter {n} replays its own key's value"
            ),
        }
    }
    assert_eq!(dup_gate.runs(), 0, "{kind:?}: no waiter ran the body");
}

/// `Store::wait_for_change` called with no bound the clock can hold
/// (`Duration::MAX`) behind a record held for 10 minutes still waits, and
/// returns when the record is released.
async fn wait_for_change_without_a_bound(kind: Kind) {
    let Some(inner) = store(kind, 4).await else {
        return;
    };
    let store = Counting::new(inner);
    let identity = Identity::new(tenant(), SCOPE, "k").expect("identity");
    let holder = OwnerToken::new();
    let held = store
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &holder,
            lease: Duration::from_secs(600),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(matches!(held, Reservation::Acquired { .. }), "{held:?}");
    let release = async {
        store.waited(1).await;
        store.release(&identity, &holder).await.expect("release")
    };
    let ((), released) = within(&format!("{kind:?}: a wait without a bound"), async {
        tokio::join!(store.wait_for_change(&identity, Duration::MAX, 0), release)
    })
    .await;
    assert!(released.is_written(), "{kind:?}: {released:?}");
}

// ------------------------------------------------------------ the tests

macro_rules! every_store {
    ($($name:ident => |$kind:ident| $body:expr;)*) => {
        mod memory { use super::*; $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { let $kind = Kind::Memory; $body.await } )* }
        mod sqlite { use super::*; $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { let $kind = Kind::Sqlite; $body.await } )* }
        mod sqlite_in_memory { use super::*; $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { let $kind = Kind::SqliteInMemory; $body.await } )* }
        mod postgres { use super::*; $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { let $kind = Kind::Postgres; $body.await } )* }
        mod mysql { use super::*; $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { let $kind = Kind::MySql; $body.await } )* }
    };
}

every_store! {
    many_waiters_behind_a_failing_holder_run_the_body_exactly_once_more => |kind| waiters_behind_a_failing_holder(kind, 8, 8);
    many_waiters_on_a_pool_of_one_connection_are_all_answered => |kind| waiters_behind_a_failing_holder(kind, 1, 12);
    many_waiters_behind_a_dead_holder_take_it_over_exactly_once => |kind| waiters_behind_a_dead_holder(kind, 8);
    fifty_waiters_behind_a_failing_holder_run_the_body_exactly_once_more => |kind| waiters_behind_a_failing_holder(kind, 8, 50);
    fifty_waiters_behind_a_dead_holder_take_it_over_exactly_once => |kind| waiters_behind_a_dead_holder(kind, 50);
    a_waiter_is_never_answered_with_another_tenants_record_of_the_same_key => |kind| two_tenants_one_key(kind);
    a_refused_duplicate_is_told_the_lease_left => |kind| refused_with_the_lease_left(kind);
    a_waiter_dropped_mid_wait_leaves_nothing_behind => |kind| a_dropped_waiter(kind);
    a_wait_bound_and_lease_of_ages_still_wait_and_replay => |kind| bounds_of_ages(kind);
    waiters_behind_a_panicking_holder_are_woken_and_one_runs_the_body => |kind| waiters_behind_a_holder_that_stops(kind, Ending::Panics, false, 20);
    waiters_behind_a_dropped_holder_are_woken_and_one_runs_the_body => |kind| waiters_behind_a_holder_that_stops(kind, Ending::Dropped, false, 20);
    waiters_behind_an_operator_release_are_woken_and_one_runs_the_body => |kind| waiters_behind_a_holder_that_stops(kind, Ending::OperatorRelease, false, 20);
    waiters_behind_a_panicking_holder_with_a_recover_hook_take_it_over_once => |kind| waiters_behind_a_holder_that_stops(kind, Ending::Panics, true, 20);
    waiters_behind_a_dropped_holder_with_a_recover_hook_take_it_over_once => |kind| waiters_behind_a_holder_that_stops(kind, Ending::Dropped, true, 20);
    background_work_is_waited_for_without_a_bound_the_clock_can_hold => |kind| background_work_waited_for_without_bound(kind);
    sixty_waiters_on_twenty_keys_some_dropped_are_all_woken => |kind| many_keys_with_dropped_waiters(kind);
    a_wait_for_change_without_a_bound_the_clock_can_hold_still_waits => |kind| wait_for_change_without_a_bound(kind);
}

/// Many duplicates of one key wait while the holder runs 2 s more: each is
/// woken by the completion (the memory, SQLite and PostgreSQL stores tell
/// their waiters), so together they reserve a few times each, not at every
/// poll; every one replays.
async fn many_waiters_woken_not_polling(kind: Kind, waiters: usize) -> usize {
    let Some(inner) = store(kind, 4).await else {
        return 0;
    };
    let store = Counting::new(inner);
    let tenant = tenant();
    let holder_gate = Gate::holding(5);
    let dup_gate = Gate::open(0);
    let holder = gated(&store, &tenant, "k", &holder_gate);
    let duplicates = async {
        holder_gate.started(1).await;
        let calls = (0..waiters).map(|_| gated(&store, &tenant, "k", &dup_gate));
        futures_util::future::join_all(calls).await
    };
    let script = async {
        holder_gate.started(1).await;
        store.waited(waiters).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        holder_gate.go();
    };
    let (held, answers, ()) = within(&format!("{kind:?}: many waiters"), async {
        tokio::join!(holder, duplicates, script)
    })
    .await;
    assert_eq!(held.expect("holder"), 5);
    for answer in answers {
        assert_eq!(answer.expect("a waiter"), 5);
    }
    assert_eq!(dup_gate.runs(), 0);
    store.reserves() - 1
}

/// At most this many reservations per waiter: one that finds the record in
/// progress, one after the change, and one spare.
const FEW: usize = 3;

async fn many_waiters_on_one_key_are_woken(kind: Kind) {
    const WAITERS: usize = 40;
    let reserves = many_waiters_woken_not_polling(kind, WAITERS).await;
    assert!(
        reserves <= FEW * WAITERS,
        "{kind:?}: {WAITERS} waiters were woken by the completion, not by polling: \
         {reserves} reservations"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_many_waiters_on_one_key_are_woken_not_polling() {
    many_waiters_on_one_key_are_woken(Kind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_many_waiters_on_one_key_are_woken_not_polling() {
    many_waiters_on_one_key_are_woken(Kind::Sqlite).await;
}

/// On a pool of 4 connections: the marks of 40 waiters lock the row in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_many_waiters_on_one_key_are_woken_not_polling() {
    many_waiters_on_one_key_are_woken(Kind::Postgres).await;
}

/// Two stores on two schemas of one database share the notification
/// channel, and one identity has a record in each: the notifications of one
/// schema's record wake the other's waiters too (one extra look each), which
/// never answers them. Holder B completes first: B's waiters replay B's
/// value, A's are still waiting once B's are answered, and get A's value
/// when A's holder completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_schemas_one_identity_wrong_schema_notifications_only_look() {
    use crate::common::servers::pg_schema_of_its_own;
    if PgStore::connect(&pg_url()).await.is_err() {
        assert!(!servers_required(), "PostgreSQL is unreachable");
        return;
    }
    let (mut admin_a, schema_a, url_a) = pg_schema_of_its_own("h_waiters_a").await;
    let (mut admin_b, schema_b, url_b) = pg_schema_of_its_own("h_waiters_b").await;
    let store_a = Counting::new(PgStore::connect(&url_a).await.expect("store A"));
    let store_b = Counting::new(PgStore::connect(&url_b).await.expect("store B"));
    let tenant = tenant();
    let (gate_a, gate_b) = (Gate::holding(1), Gate::holding(2));
    let dup_gate = Gate::open(99);
    const WAITERS: usize = 3;
    let a_done = AtomicUsize::new(0);
    let b_done = watch::Sender::new(0usize);
    let holders = async {
        tokio::join!(
            gated(&store_a, &tenant, "k", &gate_a),
            gated(&store_b, &tenant, "k", &gate_b)
        )
    };
    let duplicates = async {
        gate_a.started(1).await;
        gate_b.started(1).await;
        let of_a = (0..WAITERS).map(|_| async {
            let answer = gated(&store_a, &tenant, "k", &dup_gate).await;
            a_done.fetch_add(1, Ordering::SeqCst);
            answer
        });
        let of_b = (0..WAITERS).map(|_| async {
            let answer = gated(&store_b, &tenant, "k", &dup_gate).await;
            b_done.send_modify(|n| *n += 1);
            answer
        });
        tokio::join!(
            futures_util::future::join_all(of_a),
            futures_util::future::join_all(of_b)
        )
    };
    let script = async {
        gate_a.started(1).await;
        gate_b.started(1).await;
        store_a.waited(WAITERS).await;
        store_b.waited(WAITERS).await;
        gate_b.go();
        let _ = b_done.subscribe().wait_for(|n| *n == WAITERS).await;
        assert_eq!(
            a_done.load(Ordering::SeqCst),
            0,
            "schema A's waiters were answered while A's holder still runs"
        );
        gate_a.go();
    };
    let ((held_a, held_b), (answers_a, answers_b), ()) =
        within("two schemas, one identity", async {
            tokio::join!(holders, duplicates, script)
        })
        .await;
    assert_eq!(held_a.expect("holder A"), 1);
    assert_eq!(held_b.expect("holder B"), 2);
    for answer in answers_a {
        assert_eq!(answer.expect("a waiter of A"), 1);
    }
    for answer in answers_b {
        assert_eq!(answer.expect("a waiter of B"), 2);
    }
    assert_eq!(dup_gate.runs(), 0, "no waiter ran the body");
    drop((store_a, store_b));
    for (admin, schema) in [(&mut admin_a, &schema_a), (&mut admin_b, &schema_b)] {
        sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
            .execute(&mut *admin)
            .await
            .expect("drop schema");
    }
}

/// Two store objects on one database stand for two processes: the holder's
/// (through which the operator releases too) and the waiters'. However the
/// holder stops, the waiters' fallback looks see it long before the 10
/// minute lease and bound, and one of them runs the body.
async fn across_store_objects(kind: Kind, ending: Ending) {
    let url = match kind {
        Kind::Sqlite => crate::common::scratch::sqlite_url("waiting-across"),
        Kind::Postgres => pg_url(),
        Kind::MySql => mysql_url(),
        Kind::Memory | Kind::SqliteInMemory => unreachable!("one store object only"),
    };
    let open = || async {
        match kind {
            Kind::Sqlite => {
                Box::new(SqliteStore::connect(&url).await.expect("open")) as Box<dyn Store>
            }
            Kind::Postgres => Box::new(PgStore::connect(&url).await.expect("open")),
            _ => Box::new(MySqlStore::connect(&url).await.expect("open")),
        }
    };
    let holder_store = open().await;
    let store = Counting::new(open().await);
    for hooked in [false, true] {
        stops_behind(kind, &*holder_store, &store, (ending, hooked), 8).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_store_objects_waiters_see_a_panic_a_drop_and_an_operator_release() {
    for kind in [Kind::Sqlite, Kind::Postgres, Kind::MySql] {
        for ending in [Ending::Panics, Ending::Dropped, Ending::OperatorRelease] {
            across_store_objects(kind, ending).await;
        }
    }
}
