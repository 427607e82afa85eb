//! Rules 10 and 20 as a user meets them on every store: an owner whose call
//! stops being polled (a starved task, a paused process) past its lease, a
//! takeover that asks the `recover` hook, and the owner resuming afterwards;
//! the attempt numbers and previous start times a chain of takeovers shows
//! the hook; and an owner whose renewals starve for a connection of the pool
//! its own body holds.
//!
//! Handshakes only: the owner's body says when it runs and waits for the
//! test's word; the takers wait (`in_progress = wait`) until the store's
//! clock shows the lease over.

use crate::common::scratch::sqlite_url;
use crate::common::servers::{
    fresh_tenant, mysql_store_or_skip, mysql_url, pg_store_or_skip, pg_url,
};
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, MemoryStore, MySqlStore, Outcome, PgStore,
    RecordState, Recovery, SqliteStore, Store, Takeover,
};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use tokio::sync::Notify;

const SCOPE: &str = "recovery.edges.paused";

/// What the hook does for a tenant, and what it was asked.
#[derive(Default)]
struct Script {
    /// Answers, one per ask; `None` = `Run`, `Some(Ok(v))` = `Completed(v)`,
    /// `Some(Err(()))` = an error. Past the end: `Run`.
    answers: Vec<Option<Result<u32, ()>>>,
    /// (attempt, previous attempt's start in ms) of each ask.
    asked: Vec<(u32, i64)>,
    /// Bodies run.
    runs: u32,
}

static SCRIPTS: LazyLock<Mutex<HashMap<String, Script>>> = LazyLock::new(Default::default);

fn script<T>(tenant: &str, f: impl FnOnce(&mut Script) -> T) -> T {
    let mut all = SCRIPTS.lock().unwrap_or_else(|p| p.into_inner());
    f(all.entry(tenant.to_owned()).or_default())
}

/// The hook's gate, for the test that holds a hook while the owner resumes.
static HOOK_GATES: LazyLock<Mutex<HashMap<String, std::sync::Arc<Gate>>>> =
    LazyLock::new(Default::default);

async fn look(t: &Takeover) -> Result<Recovery<u32>, Error> {
    let answer = script(t.tenant(), |s| {
        let n = s.asked.len();
        s.asked
            .push((t.attempt(), t.previous_attempt_started_at_ms()));
        s.answers.get(n).cloned().flatten()
    });
    let gate = HOOK_GATES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(t.tenant())
        .cloned();
    if let Some(gate) = gate {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    match answer {
        None => Ok(Recovery::Run),
        Some(Ok(v)) => Ok(Recovery::Completed(v)),
        Some(Err(())) => Err(Error::Store(idempotent_runtime::StoreError::new(
            "gateway",
            "hook",
            "the gateway cannot say",
        ))),
    }
}

/// Holds a body where it is: `reached` when it gets there, and it goes on at `go`.
#[derive(Default)]
pub(crate) struct Gate {
    pub(crate) reached: Notify,
    pub(crate) go: Notify,
}

#[idempotent(scope = "recovery.edges.paused", key = key, tenant = tenant, store = store,
             skip(gate, value), lease = "300ms", in_progress = wait("10s"), recover = look)]
async fn pay(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: Option<&Gate>,
    value: u32,
) -> Result<u32, Error> {
    script(tenant, |s| s.runs += 1);
    if let Some(gate) = gate {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    Ok(value)
}

/// Polls `call` until its body has started, then hands it back unpolled:
/// from here it renews nothing, as a stopped process or a starved task.
pub(crate) async fn until_running<F: std::future::Future + Unpin>(call: &mut F, gate: &Gate)
where
    F::Output: std::fmt::Debug,
{
    tokio::select! {
        out = call => panic!("the call finished before its body was held: {out:?}"),
        _ = gate.reached.notified() => {}
    }
}

/// A store's name, and two stores on its records (two instances of a service).
pub(crate) type TwoInstances = (&'static str, Arc<dyn Store>, Arc<dyn Store>);

async fn stores() -> Vec<TwoInstances> {
    two_instances_of_each_store("takeover-edges").await
}

/// Two stores on the same records for every store (two instances of a
/// service), SQLite's in a file named after `sqlite_file`.
pub(crate) async fn two_instances_of_each_store(sqlite_file: &str) -> Vec<TwoInstances> {
    let mut all: Vec<TwoInstances> = Vec::new();
    let memory = MemoryStore::new();
    all.push(("memory", Arc::new(memory.clone()), Arc::new(memory)));
    let url = sqlite_url(sqlite_file);
    all.push((
        "sqlite",
        Arc::new(SqliteStore::connect(&url).await.expect("sqlite")),
        Arc::new(SqliteStore::connect(&url).await.expect("sqlite again")),
    ));
    if let (Some(a), Some(b)) = (pg_store_or_skip().await, pg_store_or_skip().await) {
        all.push(("postgres", Arc::new(a), Arc::new(b)));
    }
    if let (Some(a), Some(b)) = (mysql_store_or_skip().await, mysql_store_or_skip().await) {
        all.push(("mysql", Arc::new(a), Arc::new(b)));
    }
    all
}

fn id(tenant: &str, key: &str) -> Identity {
    Identity::new(tenant, SCOPE, key).expect("identity")
}

/// Rule 10 with rule 20: the owner stops being polled mid-body past its
/// lease; a retry takes over, its hook finds the work done and records its
/// answer. The resumed owner's completion is refused (`LeaseLost`) and the
/// record keeps the one recovered answer, which every later retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_resumed_after_a_recovered_takeover_is_refused_on_every_store() {
    for (name, owner_store, taker_store) in stores().await {
        let tenant = fresh_tenant();
        script(&tenant, |s| s.answers = vec![Some(Ok(100))]);
        let gate = Gate::default();
        let mut owner = Box::pin(pay(&*owner_store, &tenant, "k", Some(&gate), 1));
        until_running(&mut owner, &gate).await;
        let (taken, outcome) = with_outcome(pay(&*taker_store, &tenant, "k", None, 2)).await;
        assert_eq!(taken.expect("the takeover answers"), 100, "{name}");
        assert_eq!(outcome, Some(Outcome::Recovered), "{name}");
        gate.go.notify_one();
        let late = owner.await;
        assert!(
            matches!(late, Err(Error::LeaseLost(_))),
            "{name}: the resumed owner's completion is refused: {late:?}"
        );
        let snap = taker_store
            .fetch(&id(&tenant, "k"))
            .await
            .expect("fetch")
            .expect("a record");
        assert_eq!(snap.state, RecordState::Complete, "{name}");
        assert!(snap.recovered, "{name}: the hook's answer stays recorded");
        for store in [&*owner_store, &*taker_store] {
            let (again, outcome) = with_outcome(pay(store, &tenant, "k", None, 3)).await;
            assert_eq!(again.expect("replay"), 100, "{name}");
            assert_eq!(outcome, Some(Outcome::Replayed), "{name}");
        }
        assert_eq!(
            script(&tenant, |s| s.runs),
            1,
            "{name}: only the paused owner's body ran"
        );
    }
}

/// The owner resumes while the taker's hook is still asking: the owner's
/// completion is refused (the record is the taker's since the takeover),
/// and the taker's `Run` then runs the body under its own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_resumed_while_the_takers_hook_asks_is_refused_on_every_store() {
    for (name, owner_store, taker_store) in stores().await {
        let tenant = fresh_tenant();
        let hook_gate = std::sync::Arc::new(Gate::default());
        HOOK_GATES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(tenant.clone(), hook_gate.clone());
        let gate = Gate::default();
        let mut owner = Box::pin(pay(&*owner_store, &tenant, "k", Some(&gate), 1));
        until_running(&mut owner, &gate).await;
        let mut taker = Box::pin(with_outcome(pay(&*taker_store, &tenant, "k", None, 2)));
        tokio::select! {
            out = &mut taker => panic!("{name}: the taker finished before its hook was held: {out:?}"),
            _ = hook_gate.reached.notified() => {}
        }
        // The taker stays polled (its heartbeat renews) while the owner resumes.
        gate.go.notify_one();
        let late = tokio::select! {
            late = &mut owner => late,
            out = &mut taker => panic!("{name}: the taker finished while its hook was held: {out:?}"),
        };
        assert!(
            matches!(late, Err(Error::LeaseLost(_))),
            "{name}: the resumed owner's completion is refused: {late:?}"
        );
        hook_gate.go.notify_one();
        let (taken, outcome) = taker.await;
        assert_eq!(taken.expect("the taker runs the body"), 2, "{name}");
        assert_eq!(outcome, Some(Outcome::Executed), "{name}");
        let (again, _) = with_outcome(pay(&*owner_store, &tenant, "k", None, 3)).await;
        assert_eq!(again.expect("replay"), 2, "{name}");
    }
}

/// Rule 20's `Takeover`: attempt numbers count up through a chain of
/// takeovers, and each hook is told when the attempt it takes over started
/// (the previous takeover's start, not the first attempt's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_takeover_is_told_its_attempt_and_when_the_previous_one_started() {
    for (name, first, second) in stores().await {
        let tenant = fresh_tenant();
        // Takeover 2: the hook fails (kept for the next); takeover 3: Run,
        // and that body is paused past its lease; takeover 4: Completed.
        script(&tenant, |s| {
            s.answers = vec![Some(Err(())), None, Some(Ok(7))]
        });
        let identity = id(&tenant, "k");
        let gate = Gate::default();
        let mut owner = Box::pin(pay(&*first, &tenant, "k", Some(&gate), 1));
        until_running(&mut owner, &gate).await;
        let (a1, s1) = started(&*second, &identity).await;
        assert_eq!(a1, 1, "{name}");
        let failed = pay(&*second, &tenant, "k", None, 2).await;
        assert!(failed.is_err(), "{name}: the hook's error: {failed:?}");
        let (a2, s2) = started(&*second, &identity).await;
        assert_eq!(a2, 2, "{name}");
        let gate3 = Gate::default();
        let mut third = Box::pin(pay(&*first, &tenant, "k", Some(&gate3), 3));
        until_running(&mut third, &gate3).await;
        let (a3, s3) = started(&*second, &identity).await;
        assert_eq!(a3, 3, "{name}");
        let fourth = pay(&*second, &tenant, "k", None, 4).await;
        assert_eq!(fourth.expect("recovered"), 7, "{name}");
        gate.go.notify_one();
        gate3.go.notify_one();
        assert!(matches!(owner.await, Err(Error::LeaseLost(_))), "{name}");
        assert!(matches!(third.await, Err(Error::LeaseLost(_))), "{name}");
        let asked = script(&tenant, |s| s.asked.clone());
        assert_eq!(
            asked,
            vec![(2, s1), (3, s2), (4, s3)],
            "{name}: each hook is told its attempt and the previous attempt's start"
        );
        assert!(s1 <= s2 && s2 <= s3, "{name}: {s1} {s2} {s3}");
    }
}

#[idempotent(scope = "recovery.edges.pool", key = key, tenant = tenant, store = store,
             skip(hold, value), lease = "300ms", in_progress = wait("10s"))]
async fn on_the_pool(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    hold: Option<(&Gate, &Take)>,
    value: u32,
) -> Result<u32, Error> {
    script(tenant, |s| s.runs += 1);
    if let Some((gate, take)) = hold {
        let connection = take().await;
        gate.reached.notify_one();
        gate.go.notified().await;
        drop(connection);
    }
    Ok(value)
}

async fn started(store: &dyn Store, identity: &Identity) -> (u32, i64) {
    let s = store.fetch(identity).await.expect("fetch").expect("record");
    (s.attempt, s.attempt_started_at_ms)
}

/// Until the store's clock shows the record's lease over (bounded).
async fn lease_over(store: &dyn Store, identity: &Identity) {
    for _ in 0..1000 {
        let s = store.fetch(identity).await.expect("fetch").expect("record");
        if s.lease_expires_at_ms.is_some_and(|end| s.now_ms >= end) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the lease did not run out within 10 s");
}

type Take = dyn Fn() -> futures::future::BoxFuture<'static, Box<dyn std::any::Any + Send>> + Sync;

/// The owner's body holds the one connection of the pool its store renews
/// the lease through; another instance (its own pool) waits for the record.
async fn renewals_starved_by_the_body(
    name: &str,
    owner_store: &dyn Store,
    taker_store: &dyn Store,
    take: &Take,
) {
    let tenant = fresh_tenant();
    let gate = Gate::default();
    let before = idempotent_runtime::metrics::snapshot();
    let mut owner = Box::pin(on_the_pool(
        owner_store,
        &tenant,
        "k",
        Some((&gate, take)),
        1,
    ));
    until_running(&mut owner, &gate).await;
    let running_since = tokio::time::Instant::now();
    let taker = on_the_pool(taker_store, &tenant, "k", None, 2);
    let taken = tokio::select! {
        out = &mut owner => panic!("{name}: the owner finished while its body held the pool: {out:?}"),
        taken = taker => taken,
    };
    // The owner's body goes on until it has run a whole lease (the 300 ms
    // of the scope) by this process's clock, as a body holding the pool
    // would; the takeover proved the lease ran out on the store's clock,
    // which may be a hair ahead of the body's start here.
    tokio::select! {
        out = &mut owner => panic!("{name}: the owner finished while its body held the pool: {out:?}"),
        _ = tokio::time::sleep_until(running_since + std::time::Duration::from_millis(300)) => {}
    }
    gate.go.notify_one();
    let late = owner.await;
    let after = idempotent_runtime::metrics::snapshot();
    // The documented limit: the lease lapsed, another instance took the
    // record over and ran the body beside the owner.
    assert_eq!(
        taken.expect("{name}: the other instance takes over"),
        2,
        "{name}"
    );
    assert!(matches!(late, Err(Error::LeaseLost(_))), "{name}: {late:?}");
    let replayed = on_the_pool(owner_store, &tenant, "k", None, 3).await;
    assert_eq!(replayed.expect("replay"), 2, "{name}: one answer recorded");
    // And the documented guard: visible as failed renewals and a lapse.
    assert!(
        after.heartbeat_failures > before.heartbeat_failures,
        "{name}: the starved renewals count as heartbeat failures ({} -> {}, lapses {} -> {})",
        before.heartbeat_failures,
        after.heartbeat_failures,
        before.lease_lapses,
        after.lease_lapses
    );
    assert!(
        after.lease_lapses > before.lease_lapses,
        "{name}: the lease ran out while the body ran and another caller took the record \
         over: rule 9 and the README say that is logged and counted as a lapse"
    );
}

fn held<T: Send + 'static>(
    f: impl Fn() -> futures::future::BoxFuture<'static, T> + Sync,
) -> impl Fn() -> futures::future::BoxFuture<'static, Box<dyn std::any::Any + Send>> + Sync {
    move || {
        let fut = f();
        Box::pin(async move { Box::new(fut.await) as Box<dyn std::any::Any + Send> })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_renewals_starved_by_a_body_holding_the_pool() {
    let url = sqlite_url("takeover-pool");
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("pool");
    let owner = SqliteStore::from_pool(pool.clone()).await.expect("store");
    let taker = SqliteStore::connect(&url).await.expect("taker");
    let take = held(move || {
        let pool = pool.clone();
        Box::pin(async move { pool.acquire().await.expect("acquire") })
    });
    renewals_starved_by_the_body("sqlite", &owner, &taker, &take).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_renewals_starved_by_a_body_holding_the_pool() {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&pg_url())
        .await
        .expect("pool");
    let owner = PgStore::from_pool(pool.clone()).await.expect("store");
    let taker = PgStore::connect(&pg_url()).await.expect("taker");
    let take = held(move || {
        let pool = pool.clone();
        Box::pin(async move { pool.acquire().await.expect("acquire") })
    });
    renewals_starved_by_the_body("postgres", &owner, &taker, &take).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_renewals_starved_by_a_body_holding_the_pool() {
    if mysql_store_or_skip().await.is_none() {
        return;
    }
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&mysql_url())
        .await
        .expect("pool");
    let owner = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let taker = MySqlStore::connect(&mysql_url()).await.expect("taker");
    let take = held(move || {
        let pool = pool.clone();
        Box::pin(async move { pool.acquire().await.expect("acquire") })
    });
    renewals_starved_by_the_body("mysql", &owner, &taker, &take).await;
}

const SHARED: &str = "recovery.edges.shared";

/// Rule 21: a store-mode claimant of a shared boundary (e.g. a background
/// delivery) ...
#[idempotent(scope = "recovery.edges.shared", key = key, tenant = tenant, store = store,
             shared_scope, skip(gate, value), lease = "300ms", in_progress = wait("10s"),
             recover = look)]
async fn deliver(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: Option<&Gate>,
    value: u32,
) -> Result<u32, Error> {
    script(tenant, |s| s.runs += 1);
    if let Some(gate) = gate {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    Ok(value)
}

/// ... and the foreground request in the caller's transaction, one per database.
macro_rules! request_in_tx {
    ($name:ident, $db:ty) => {
        #[idempotent(scope = "recovery.edges.shared", key = key, tenant = tenant, tx = tx,
                             shared_scope, skip(value), lease = "300ms", in_progress = wait("10s"),
                             recover = look)]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            value: u32,
        ) -> Result<u32, Error> {
            script(tenant, |s| s.runs += 1);
            Ok(value)
        }
    };
}
request_in_tx!(request_pg, sqlx::Postgres);
request_in_tx!(request_my, sqlx::MySql);
request_in_tx!(request_sqlite, sqlx::Sqlite);

/// The PostgreSQL store and its pool, or `None` when the server is not there.
async fn pg_with_pool() -> Option<(PgStore, sqlx::PgPool)> {
    let store = pg_store_or_skip().await?;
    let pool = store.pool().clone();
    Some((store, pool))
}

/// The MariaDB store and its pool, or `None` when the server is not there.
async fn mysql_with_pool() -> Option<(MySqlStore, sqlx::MySqlPool)> {
    let store = mysql_store_or_skip().await?;
    let pool = store.pool().clone();
    Some((store, pool))
}

/// A SQLite store on a file of its own (`name`) and its pool.
async fn sqlite_with_pool(name: &str) -> Option<(SqliteStore, sqlx::SqlitePool)> {
    let store = SqliteStore::connect(&sqlite_url(name)).await.ok()?;
    let pool = store.pool().clone();
    Some((store, pool))
}

/// Rules 20 and 21: a store-mode claimant stops being polled past its
/// lease; the transactional claimant takes the record over in its
/// transaction, its hook answers `Completed`, and the transaction rolls
/// back. The next caller (the store-mode claimant again) takes over as the
/// same attempt, told the same previous start, and its hook's `Run` runs
/// the body; the resumed first owner is refused; one answer is recorded.
macro_rules! rolled_back_recovery {
    ($test:ident, $request:ident, $open:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let Some((store, pool)) = $open.await else {
                return;
            };
            let store: &dyn Store = &store;
            let tenant = fresh_tenant();
            script(&tenant, |s| s.answers = vec![Some(Ok(100)), None]);
            let identity = Identity::new(tenant.as_str(), SHARED, "k").expect("identity");
            let gate = Gate::default();
            let mut owner = Box::pin(deliver(store, &tenant, "k", Some(&gate), 1));
            until_running(&mut owner, &gate).await;
            let (_, first_start) = started(store, &identity).await;
            // MySQL and SQLite refuse a transaction's duplicate of a live
            // store-mode lease at once (README): call once it ran out.
            lease_over(store, &identity).await;
            // MySQL tells a transaction's start in whole seconds: one begun
            // in the second the lease ran out is refused as stale (README);
            // a new transaction is the remedy.
            let mut stale = 0;
            let (tx, (recovered, outcome)) = loop {
                let mut tx = pool.begin().await.expect("begin");
                let answer = with_outcome($request(&mut tx, &tenant, "k", 2)).await;
                if matches!(answer.0, Err(Error::StaleSnapshot { .. })) && stale < 30 {
                    stale += 1;
                    tx.rollback().await.expect("rollback");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
                break (tx, answer);
            };
            assert_eq!(recovered.expect("the hook's answer"), 100);
            assert_eq!(outcome, Some(Outcome::Recovered));
            tx.rollback().await.expect("rollback");
            let (again, outcome) = with_outcome(deliver(store, &tenant, "k", None, 3)).await;
            assert_eq!(again.expect("the body runs after Run"), 3);
            assert_eq!(outcome, Some(Outcome::Executed));
            gate.go.notify_one();
            let late = owner.await;
            assert!(matches!(late, Err(Error::LeaseLost(_))), "{late:?}");
            let asked = script(&tenant, |s| s.asked.clone());
            assert_eq!(
                asked,
                vec![(2, first_start), (2, first_start)],
                "the rolled-back takeover is undone: asked again as attempt 2"
            );
            let mut tx = pool.begin().await.expect("begin");
            let (replayed, outcome) = with_outcome($request(&mut tx, &tenant, "k", 4)).await;
            tx.commit().await.expect("commit");
            assert_eq!(replayed.expect("replay"), 3);
            assert_eq!(outcome, Some(Outcome::Replayed));
            assert_eq!(
                script(&tenant, |s| s.runs),
                2,
                "the first owner's body and the last taker's"
            );
        }
    };
}

rolled_back_recovery!(
    postgres_a_rolled_back_recovery_in_a_transaction_is_asked_again_by_the_shared_claimant,
    request_pg,
    pg_with_pool()
);
rolled_back_recovery!(
    mysql_a_rolled_back_recovery_in_a_transaction_is_asked_again_by_the_shared_claimant,
    request_my,
    mysql_with_pool()
);
rolled_back_recovery!(
    sqlite_a_rolled_back_recovery_in_a_transaction_is_asked_again_by_the_shared_claimant,
    request_sqlite,
    sqlite_with_pool("takeover-shared")
);

/// Rules 10 and 21: the paused store-mode claimant resumes while the
/// transactional claimant's takeover (its hook's answer recorded) is still
/// uncommitted; whichever of the owner's completion and the commit comes
/// first, the owner is refused and the one recorded answer is the hook's.
macro_rules! resumed_beside_an_open_takeover {
    ($test:ident, $request:ident, $open:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let Some((store, pool)) = $open.await else {
                return;
            };
            let store: &dyn Store = &store;
            let tenant = fresh_tenant();
            script(&tenant, |s| s.answers = vec![Some(Ok(100))]);
            let identity = Identity::new(tenant.as_str(), SHARED, "k").expect("identity");
            let gate = Gate::default();
            let mut owner = Box::pin(deliver(store, &tenant, "k", Some(&gate), 1));
            until_running(&mut owner, &gate).await;
            lease_over(store, &identity).await;
            let mut stale = 0;
            let (tx, recovered) = loop {
                let mut tx = pool.begin().await.expect("begin");
                let answer = $request(&mut tx, &tenant, "k", 2).await;
                if matches!(answer, Err(Error::StaleSnapshot { .. })) && stale < 30 {
                    stale += 1;
                    tx.rollback().await.expect("rollback");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
                break (tx, answer);
            };
            assert_eq!(recovered.expect("the hook's answer"), 100);
            gate.go.notify_one();
            let (late, committed) = tokio::join!(owner, async {
                tokio::task::yield_now().await;
                tx.commit().await
            });
            committed.expect("commit");
            assert!(matches!(late, Err(Error::LeaseLost(_))), "{late:?}");
            let (replayed, outcome) = with_outcome(deliver(store, &tenant, "k", None, 3)).await;
            assert_eq!(replayed.expect("replay"), 100);
            assert_eq!(outcome, Some(Outcome::Replayed));
        }
    };
}

resumed_beside_an_open_takeover!(
    postgres_an_owner_resumed_beside_an_uncommitted_takeover_is_refused,
    request_pg,
    pg_with_pool()
);
resumed_beside_an_open_takeover!(
    mysql_an_owner_resumed_beside_an_uncommitted_takeover_is_refused,
    request_my,
    mysql_with_pool()
);
resumed_beside_an_open_takeover!(
    sqlite_an_owner_resumed_beside_an_uncommitted_takeover_is_refused,
    request_sqlite,
    sqlite_with_pool("takeover-open")
);

#[idempotent(scope = "recovery.edges.expiring", key = key, tenant = tenant, store = store,
             skip(gate, value), ttl = "500ms", lease = "300ms", in_progress = wait("10s"),
             recover = look)]
async fn short_lived(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: Option<&Gate>,
    value: u32,
) -> Result<u32, Error> {
    script(tenant, |s| s.runs += 1);
    if let Some(gate) = gate {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    Ok(value)
}

/// Until the store's clock shows the record's retention over (bounded).
async fn retention_over(store: &dyn Store, identity: &Identity) {
    for _ in 0..1000 {
        let s = store.fetch(identity).await.expect("fetch").expect("record");
        if s.now_ms >= s.expires_at_ms {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the retention did not run out within 10 s");
}

/// Rules 16 and 20: a record made anew after the old one expired counts its
/// attempts from 1 again, and its first takeover's hook is told attempt 2
/// and the new attempt's start, not the expired record's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_made_anew_after_expiry_counts_its_attempts_afresh_on_every_store() {
    for (name, first, second) in stores().await {
        let tenant = fresh_tenant();
        let identity = Identity::new(tenant.as_str(), "recovery.edges.expiring", "k").expect("id");
        // An owner dies, a takeover's hook fails twice: attempt 3, kept.
        script(&tenant, |s| {
            s.answers = vec![Some(Err(())), Some(Err(())), None]
        });
        let dead = Gate::default();
        let mut owner = Box::pin(short_lived(&*first, &tenant, "k", Some(&dead), 1));
        until_running(&mut owner, &dead).await;
        assert!(
            short_lived(&*second, &tenant, "k", None, 2).await.is_err(),
            "{name}"
        );
        assert!(
            short_lived(&*second, &tenant, "k", None, 2).await.is_err(),
            "{name}"
        );
        let (attempt, _) = started(&*second, &identity).await;
        assert_eq!(attempt, 3, "{name}");
        std::mem::forget(owner);
        // Kept for a ttl after its lease ended; then it counts as absent.
        retention_over(&*second, &identity).await;
        let gate = Gate::default();
        let mut anew = Box::pin(short_lived(&*first, &tenant, "k", Some(&gate), 4));
        until_running(&mut anew, &gate).await;
        let (attempt, start) = started(&*second, &identity).await;
        assert_eq!(attempt, 1, "{name}: a fresh record after expiry");
        assert_eq!(
            script(&tenant, |s| s.asked.len()),
            2,
            "{name}: no hook for a fresh record"
        );
        let taken = short_lived(&*second, &tenant, "k", None, 5).await;
        assert_eq!(taken.expect("Run"), 5, "{name}");
        let asked = script(&tenant, |s| s.asked.clone());
        assert_eq!(asked[2], (2, start), "{name}: {asked:?}");
        gate.go.notify_one();
        assert!(matches!(anew.await, Err(Error::LeaseLost(_))), "{name}");
    }
}

#[idempotent(scope = "recovery.edges.pool_then_on", key = key, tenant = tenant, store = store,
             skip(hold, then), lease = "300ms", in_progress = reject)]
async fn holds_then_goes_on(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    hold: (&Gate, &Take),
    then: &Gate,
) -> Result<u32, Error> {
    let (gate, take) = hold;
    let connection = take().await;
    gate.reached.notify_one();
    gate.go.notified().await;
    drop(connection);
    then.reached.notify_one();
    then.go.notified().await;
    Ok(1)
}

/// Rule 9: the body holds the pool's one connection for more than a lease,
/// then lets it go and runs on; the renewals that waited for it are written
/// only then, after the lease had run out (nobody took it over). That lapse
/// is logged and counted, as the README says of a body holding the store's
/// pool: a renewal written after the lease ran out found it lapsed.
async fn renewals_written_after_the_lease_ran_out(store: &dyn Store, take: &Take) {
    let tenant = fresh_tenant();
    let (gate, then) = (Gate::default(), Gate::default());
    let before = idempotent_runtime::metrics::snapshot();
    let mut call = Box::pin(holds_then_goes_on(
        store,
        &tenant,
        "k",
        (&gate, take),
        &then,
    ));
    until_running(&mut call, &gate).await;
    let running_since = tokio::time::Instant::now();
    tokio::select! {
        out = &mut call => panic!("finished while its body held the pool: {out:?}"),
        _ = tokio::time::sleep_until(running_since + std::time::Duration::from_millis(400)) => {}
    }
    gate.go.notify_one();
    tokio::select! {
        out = &mut call => panic!("finished early: {out:?}"),
        _ = then.reached.notified() => {}
    }
    // The renewals that waited get the connection and are written, and a
    // fresh one after them (the lapse is then long past the lease the body
    // ends with: only the renewals' own answers can tell it).
    let written = async {
        for _ in 0..1000 {
            if idempotent_runtime::metrics::snapshot().heartbeats >= before.heartbeats + 3 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("no renewal was written within 5 s of the pool coming free");
    };
    tokio::select! {
        out = &mut call => panic!("finished early: {out:?}"),
        _ = written => {}
    }
    then.go.notify_one();
    assert_eq!(call.await.expect("nobody took it over"), 1);
    let after = idempotent_runtime::metrics::snapshot();
    assert!(
        after.lease_lapses > before.lease_lapses,
        "the lease ran out while the renewals waited for the pool ({} -> {} lapses)",
        before.lease_lapses,
        after.lease_lapses
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_renewal_written_after_the_lease_ran_out_is_a_lapse() {
    let url = sqlite_url("takeover-pool-late");
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("pool");
    let store = SqliteStore::from_pool(pool.clone()).await.expect("store");
    let take = held(move || {
        let pool = pool.clone();
        Box::pin(async move { pool.acquire().await.expect("acquire") })
    });
    renewals_written_after_the_lease_ran_out(&store, &take).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_renewal_written_after_the_lease_ran_out_is_a_lapse() {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&pg_url())
        .await
        .expect("pool");
    let store = PgStore::from_pool(pool.clone()).await.expect("store");
    let take = held(move || {
        let pool = pool.clone();
        Box::pin(async move { pool.acquire().await.expect("acquire") })
    });
    renewals_written_after_the_lease_ran_out(&store, &take).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_renewal_written_after_the_lease_ran_out_is_a_lapse() {
    if mysql_store_or_skip().await.is_none() {
        return;
    }
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    let take = held(move || {
        let pool = pool.clone();
        Box::pin(async move { pool.acquire().await.expect("acquire") })
    });
    renewals_written_after_the_lease_ran_out(&store, &take).await;
}

#[idempotent(scope = "recovery.edges.shared_types", key = key, tenant = tenant, store = store,
             shared_scope)]
async fn refund_unsigned(
    store: &MemoryStore,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    Ok(amount)
}

#[idempotent(scope = "recovery.edges.shared_types", key = key, tenant = tenant, store = store,
             shared_scope)]
async fn refund_signed(
    store: &MemoryStore,
    tenant: &str,
    key: &str,
    amount: i32,
) -> Result<u64, Error> {
    Ok(amount as u64 + 1000)
}

/// Rule 21: claimants of one boundary whose parameter of one name has
/// another integer type answer for each other when the value is the same
/// number (a u64 and an i32 holding 7 are one request), and refuse another.
#[tokio::test]
async fn shared_claimants_with_integer_types_of_their_own_answer_for_each_other() {
    let store = MemoryStore::new();
    let tenant = fresh_tenant();
    assert_eq!(
        refund_unsigned(&store, &tenant, "k", 7)
            .await
            .expect("first"),
        7
    );
    let (other, outcome) = with_outcome(refund_signed(&store, &tenant, "k", 7)).await;
    assert_eq!(
        (other.expect("replay"), outcome),
        (7, Some(Outcome::Replayed))
    );
    let differs = refund_signed(&store, &tenant, "k", 8).await;
    assert!(
        matches!(differs, Err(Error::FingerprintMismatch(_))),
        "{differs:?}"
    );
}

static PANICKED: LazyLock<Mutex<std::collections::HashSet<String>>> =
    LazyLock::new(Default::default);

/// Panics the first time it is asked for a tenant, then answers `Run`.
async fn panics_once(t: &Takeover) -> Result<Recovery<u32>, Error> {
    script(t.tenant(), |s| {
        s.asked
            .push((t.attempt(), t.previous_attempt_started_at_ms()))
    });
    if PANICKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(t.tenant().to_owned())
    {
        panic!("the hook's client library panicked");
    }
    Ok(Recovery::Run)
}

#[idempotent(scope = "recovery.edges.tx_panic", key = key, tenant = tenant, tx = tx,
             lease = "300ms", in_progress = reject, recover = panics_once)]
async fn pg_in_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
) -> Result<u32, Error> {
    script(tenant, |s| s.runs += 1);
    Ok(9)
}

/// Rule 20 in transactional mode: a hook that panics takes the caller's
/// transaction down with it (dropped: rolled back); the takeover is undone,
/// and the next call in a new transaction is asked again, as the same
/// attempt, before any body runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_hook_panicking_in_a_transaction_is_asked_again_before_any_body_runs() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let identity = Identity::new(tenant.as_str(), "recovery.edges.tx_panic", "k").expect("id");
    let crashed = idempotent_runtime::OwnerToken::new();
    store
        .reserve(idempotent_runtime::ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &crashed,
            lease: std::time::Duration::ZERO,
            ttl: std::time::Duration::from_secs(3600),
        })
        .await
        .expect("a crashed owner's record");
    let (_, first_start) = started(&store, &identity).await;
    let pool = store.pool().clone();
    let panicked = {
        use futures::FutureExt;
        std::panic::AssertUnwindSafe(async {
            let mut tx = pool.begin().await.expect("begin");
            let _ = pg_in_tx(&mut tx, &tenant, "k").await;
            tx.commit().await.expect("commit");
        })
        .catch_unwind()
        .await
    };
    assert!(panicked.is_err(), "the hook's panic propagates");
    let mut tx = pool.begin().await.expect("begin");
    let (ran, outcome) = with_outcome(pg_in_tx(&mut tx, &tenant, "k")).await;
    tx.commit().await.expect("commit");
    assert_eq!((ran.expect("Run"), outcome), (9, Some(Outcome::Executed)));
    assert_eq!(
        script(&tenant, |s| (s.asked.clone(), s.runs)),
        (vec![(2, first_start), (2, first_start)], 1)
    );
}
