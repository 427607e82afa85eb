//! Operator actions racing a takeover whose `recover` hook is running
//! (DESIGN rules 10, 16 and 20; the README's `idempotent release`), with a
//! duplicate waiting behind it. Every step is a handshake: the hook says
//! when it is asked and waits to be let go; the duplicate's wait is seen
//! through [`Counting`].
//!
//! - A purge and a release that asks for an expired lease leave the
//!   record of a takeover whose hook runs: its lease is live.
//! - `release --even-if-running` while the hook runs: the waiting duplicate
//!   wakes, runs as a fresh attempt 1, and its answer is the key's; the
//!   hook's answer, given afterwards, is fenced (`LeaseLost`) and recorded
//!   nowhere, never as attempt 1's.
//! - `release --end-lease --even-if-running` while the hook runs: the
//!   waiting duplicate wakes, takes the record over as attempt 3 and asks
//!   the hook itself; the first hook's answer is fenced.
//!
//! On memory, a SQLite file, PostgreSQL and MariaDB.

use crate::common;

use common::counting::Counting;
use idempotent_runtime::purge::purge_all;
use idempotent_runtime::{
    idempotent, with_outcome, Error, Fenced, ForcedRelease, Identity, MemoryStore, Outcome,
    OwnerToken, RecordState, Recovery, SqliteStore, Store, Takeover,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// How long a step may wait for its handshake: reached only when it never
/// comes.
const BOUND: Duration = Duration::from_secs(60);

const SCOPE: &str = "ops_hook_races.charge";

/// Where the first hook asked for a tenant stops.
#[derive(Default)]
struct Gate {
    reached: Notify,
    go: Notify,
}

static GATES: LazyLock<Mutex<HashMap<String, Arc<Gate>>>> = LazyLock::new(Default::default);

/// The hook: the first one asked for a tenant with a gate waits there (the
/// gate is taken away as it arrives), then every hook finds the side effect
/// and answers `100 + attempt`.
async fn asks(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    let gate = GATES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(takeover.tenant());
    if let Some(gate) = gate {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    Ok(Recovery::Completed(100 + takeover.attempt()))
}

#[idempotent(scope = "ops_hook_races.charge", key = key, tenant = tenant, store = store,
             skip(runs), lease = "30s", ttl = "1h", in_progress = wait("50s"), recover = asks)]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicU32,
) -> Result<u32, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// A fresh tenant and key whose record an owner that died left in
/// progress, its lease over (attempt 1); the tenant's first hook stops at
/// the gate answered.
async fn dead_owners_record(store: &dyn Store) -> (String, String, Identity, Arc<Gate>) {
    let tenant = common::servers::fresh_tenant();
    let key = format!("k-{}", uuid::Uuid::new_v4().simple());
    let identity = Identity::new(&tenant, SCOPE, &key).expect("identity");
    let hour = Duration::from_secs(3600);
    let dead = common::records::acquire(store, &identity, None, hour, hour).await;
    assert_eq!(
        store
            .heartbeat(&identity, &dead, Duration::ZERO)
            .await
            .expect("end the lease"),
        Fenced::Written
    );
    let gate = Arc::new(Gate::default());
    GATES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(tenant.clone(), gate.clone());
    (tenant, key, identity, gate)
}

async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {BOUND:?}"))
}

/// What a test scenario shares: the store (counted), and the bodies' runs.
struct Rig {
    store: Arc<Counting<Arc<dyn Store>>>,
}

impl Rig {
    fn call(
        &self,
        tenant: &str,
        key: &str,
        runs: &Arc<AtomicU32>,
    ) -> tokio::task::JoinHandle<(Result<u32, Error>, Option<Outcome>)> {
        let (store, tenant, key, runs) = (
            self.store.clone(),
            tenant.to_owned(),
            key.to_owned(),
            runs.clone(),
        );
        tokio::spawn(async move { with_outcome(charge(&*store, &tenant, &key, &runs)).await })
    }

    /// The taker at its hook's gate, and a duplicate waiting behind it.
    async fn taker_and_waiter(
        &self,
        tenant: &str,
        key: &str,
        gate: &Gate,
        runs: &Arc<AtomicU32>,
    ) -> (
        tokio::task::JoinHandle<(Result<u32, Error>, Option<Outcome>)>,
        tokio::task::JoinHandle<(Result<u32, Error>, Option<Outcome>)>,
    ) {
        let taker = self.call(tenant, key, runs);
        bounded("the taker's hook is asked", gate.reached.notified()).await;
        let waits = *self.store.waits.borrow();
        let waiter = self.call(tenant, key, runs);
        bounded("the duplicate waits", self.store.waited(waits + 1)).await;
        (taker, waiter)
    }
}

/// A purge and a release asking for an expired lease, while the hook runs:
/// the record stays (the takeover's lease is live), and the hook's answer
/// is the key's, the waiting duplicate's too.
async fn purge_and_safe_release_leave_a_running_takeover(rig: &Rig) {
    let store: &dyn Store = &*rig.store;
    let (tenant, key, identity, gate) = dead_owners_record(store).await;
    let runs = Arc::new(AtomicU32::new(0));
    let (taker, waiter) = rig.taker_and_waiter(&tenant, &key, &gate, &runs).await;
    let released = store.force_release(&identity, true).await.expect("release");
    assert!(
        matches!(released, ForcedRelease::LeaseLive { .. }),
        "{}: a release asking for an expired lease, while the taker's hook runs: {released:?}",
        store.name()
    );
    purge_all(store, 1000).await.expect("purge");
    let record = store.fetch(&identity).await.expect("fetch").expect("kept");
    assert_eq!((record.state, record.attempt), (RecordState::InProgress, 2));
    gate.go.notify_one();
    let (answer, outcome) = bounded("the taker", taker).await.expect("the taker's task");
    assert_eq!(
        (answer.ok(), outcome),
        (Some(102), Some(Outcome::Recovered))
    );
    let (answer, outcome) = bounded("the duplicate", waiter)
        .await
        .expect("the duplicate's task");
    assert_eq!((answer.ok(), outcome), (Some(102), Some(Outcome::Replayed)));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the body never ran");
}

/// `release --even-if-running` while the hook runs: the duplicate wakes and
/// runs as a fresh attempt 1 (the documented cost); the hook's answer,
/// given afterwards, is fenced and recorded nowhere.
async fn release_even_if_running_while_the_hook_runs(rig: &Rig) {
    let store: &dyn Store = &*rig.store;
    let (tenant, key, identity, gate) = dead_owners_record(store).await;
    let runs = Arc::new(AtomicU32::new(0));
    let (taker, waiter) = rig.taker_and_waiter(&tenant, &key, &gate, &runs).await;
    let released = store
        .force_release(&identity, false)
        .await
        .expect("release");
    assert_eq!(
        released,
        ForcedRelease::Released { attempt: 2 },
        "{}",
        store.name()
    );
    let (answer, outcome) = bounded("the duplicate", waiter)
        .await
        .expect("the duplicate's task");
    assert_eq!((answer.ok(), outcome), (Some(1), Some(Outcome::Executed)));
    gate.go.notify_one();
    let (answer, _) = bounded("the taker", taker).await.expect("the taker's task");
    assert!(
        matches!(answer, Err(Error::LeaseLost(_))),
        "{}: the hook answered after its record was released: {answer:?}",
        store.name()
    );
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("recorded");
    assert_eq!(
        (record.state, record.attempt, record.recovered),
        (RecordState::Complete, 1, false),
        "{}: the key's answer is attempt 1's body's",
        store.name()
    );
    let (answer, outcome) = with_outcome(charge(store, &tenant, &key, &runs)).await;
    assert_eq!((answer.ok(), outcome), (Some(1), Some(Outcome::Replayed)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// `release --end-lease --even-if-running` while the hook runs: the
/// duplicate wakes, takes the record over (attempt 3) and asks the hook;
/// the first hook's answer is fenced.
async fn end_lease_while_the_hook_runs(rig: &Rig) {
    let store: &dyn Store = &*rig.store;
    let (tenant, key, identity, gate) = dead_owners_record(store).await;
    let runs = Arc::new(AtomicU32::new(0));
    let (taker, waiter) = rig.taker_and_waiter(&tenant, &key, &gate, &runs).await;
    let owner = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .and_then(|r| r.owner_token)
        .map(OwnerToken::from_stored)
        .expect("the taker's token");
    let ended = store
        .heartbeat(&identity, &owner, Duration::ZERO)
        .await
        .expect("end");
    assert_eq!(ended, Fenced::Written);
    let (answer, outcome) = bounded("the duplicate", waiter)
        .await
        .expect("the duplicate's task");
    assert_eq!(
        (answer.ok(), outcome),
        (Some(103), Some(Outcome::Recovered))
    );
    gate.go.notify_one();
    let (answer, _) = bounded("the taker", taker).await.expect("the taker's task");
    assert!(
        matches!(answer, Err(Error::LeaseLost(_))),
        "{}: the first hook answered after the record was taken over: {answer:?}",
        store.name()
    );
    let record = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("recorded");
    assert_eq!(
        (record.state, record.attempt, record.recovered),
        (RecordState::Complete, 3, true),
        "{}",
        store.name()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the body never ran");
}

async fn all(store: Arc<dyn Store>) {
    let rig = Rig {
        store: Arc::new(Counting::new(store)),
    };
    purge_and_safe_release_leave_a_running_takeover(&rig).await;
    release_even_if_running_while_the_hook_runs(&rig).await;
    end_lease_while_the_hook_runs(&rig).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_race_a_running_hook_on_memory() {
    all(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_race_a_running_hook_on_sqlite() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("hook-races"))
        .await
        .expect("sqlite");
    all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_race_a_running_hook_on_postgres() {
    if let Some(store) = common::servers::pg_store_or_skip().await {
        all(Arc::new(store)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_race_a_running_hook_on_mariadb() {
    if let Some(store) = common::servers::mysql_store_or_skip().await {
        all(Arc::new(store)).await;
    }
}
