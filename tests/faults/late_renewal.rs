//! Rules 14 and 20 with rule 9 on the network stores: a renewal of the lease
//! still on its way to the server when the call ends its lease (its body
//! panicked in a scope with a `recover` hook) must not give the record a
//! whole lease again. The call dropped the renewal it no longer waited for,
//! but a statement that was sent runs on the server when it arrives; landing
//! after the write that ended the lease, it renewed it, and every retry was
//! refused (`in_progress = reject`), or waited, until that lease ran out,
//! instead of taking the record over at once and asking the hook. The call
//! now lets its renewals land before it ends the lease.
//!
//! The renewal is held on its way by the fault proxy (its connection only).

use crate::common::proxy::FaultProxy;
use crate::common::servers::fresh_tenant;
use crate::connection_faults::through_a_proxy;
use idempotent_runtime::{idempotent, with_outcome, Error, Outcome, Recovery, Store, Takeover};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Where a tenant's first body stops: `reached` when it gets there; at
/// `go` it panics, after its side effect.
#[derive(Default)]
struct Gate {
    reached: Notify,
    go: Notify,
}

static GATES: LazyLock<Mutex<HashMap<String, Arc<Gate>>>> = LazyLock::new(Default::default);

fn gate(tenant: &str) -> Option<Arc<Gate>> {
    GATES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(tenant)
        .cloned()
}

/// Sets up `tenant`'s gate: its first body (or hook) stops there.
fn gate_for(tenant: &str) -> Arc<Gate> {
    let gate = Arc::new(Gate::default());
    GATES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(tenant.to_owned(), gate.clone());
    gate
}

/// Takes `tenant`'s gate away: its next calls do not stop.
fn no_gate_for(tenant: &str) {
    GATES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(tenant);
}

/// The record of an owner that crashed, its lease over, of `key` in `scope`.
async fn crashed_owners_record(
    store: &dyn Store,
    scope: &str,
    tenant: &str,
    key: &str,
) -> idempotent_runtime::Identity {
    let identity = idempotent_runtime::Identity::new(tenant, scope, key).expect("identity");
    store
        .reserve(idempotent_runtime::ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &idempotent_runtime::OwnerToken::new(),
            lease: Duration::ZERO,
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("a crashed owner's record");
    identity
}

/// The side effect is found at the provider.
async fn found(_: &Takeover) -> Result<Recovery<u32>, Error> {
    Ok(Recovery::Completed(7))
}

/// The lease is long beside the moment the test gives the call to end it
/// while its renewal is held ([`ENDS_WITHIN`]): the call waits for its
/// renewal at most a lease.
#[idempotent(scope = "faults.late_renewal", key = key, tenant = tenant, store = store,
             lease = "6s", in_progress = reject, recover = found)]
async fn charge(store: &dyn Store, tenant: &str, key: &str) -> Result<u32, Error> {
    if let Some(gate) = gate(tenant) {
        gate.reached.notify_one();
        gate.go.notified().await;
        panic!("the body panics after its side effect");
    }
    Ok(1)
}

/// How long the panicked call is given to end its lease while its renewal
/// is held. Before, it ended the lease at once (and returned); now it waits
/// for the renewal, so this only bounds the test's wait.
const ENDS_WITHIN: Duration = Duration::from_secs(1);

/// Spawns `call` and lets it run until its body (or hook) stops at
/// `tenant`'s gate; holds the next statement naming `key` (the call's
/// renewal) on its way; lets the gate go. Answers how the call ended (its
/// renewal let land when it had not ended within [`ENDS_WITHIN`]: it waits
/// for it), once the held renewal has reached the server.
async fn ended_while_its_renewal_was_held<T: Send + 'static>(
    proxy: &FaultProxy,
    (tenant, key): (&str, &str),
    call: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    let held = gate_for(tenant);
    let mut call = tokio::spawn(call);
    held.reached.notified().await;
    // The next statement naming the key is the call's first renewal.
    let renewal = proxy.hold_next_request_containing(key.as_bytes());
    renewal.request_seen().await;
    held.go.notify_one();
    let ended = match tokio::time::timeout(ENDS_WITHIN, &mut call).await {
        Ok(ended) => ended,
        Err(_) => {
            // Still waiting for its renewal: let it land.
            proxy.release_held();
            call.await
        }
    };
    no_gate_for(tenant);
    // Whatever the call is still doing, the renewal reaches the server now.
    proxy.release_held();
    renewal.settled().await;
    ended
}

async fn a_renewal_landing_after_the_lease_was_ended(
    name: &str,
    proxy: &FaultProxy,
    store: Arc<dyn Store>,
) {
    let tenant = fresh_tenant();
    let key = format!("late-renewal-{tenant}");
    // The body panics; its renewal is still on its way.
    let ended = ended_while_its_renewal_was_held(proxy, (&tenant, &key), {
        let (store, tenant, key) = (store.clone(), tenant.clone(), key.clone());
        async move { charge(&*store, &tenant, &key).await }
    })
    .await;
    let ended = ended.expect_err("the body panicked");
    assert!(ended.is_panic(), "{name}: {ended:?}");
    let (answer, outcome) = with_outcome(charge(&*store, &tenant, &key)).await;
    assert_eq!(
        (answer.as_ref().ok().copied(), outcome),
        (Some(7), Some(Outcome::Recovered)),
        "{name}: the retry takes the record over at once and asks the hook; the renewal the \
         panicked call sent before ending its lease must not have renewed it: {answer:?}"
    );
}

/// Asks the provider: the first time for a tenant with a gate it waits at
/// the gate and cannot say (an error: the record is kept, its lease ended);
/// then the side effect is found.
async fn asks_at_the_gate(t: &Takeover) -> Result<Recovery<u32>, Error> {
    if let Some(gate) = gate(t.tenant()) {
        gate.reached.notify_one();
        gate.go.notified().await;
        return Err(Error::Store(idempotent_runtime::StoreError::new(
            "gateway",
            "find_charge",
            "the provider cannot say now",
        )));
    }
    Ok(Recovery::Completed(t.attempt()))
}

#[idempotent(scope = "faults.late_renewal_hook", key = key, tenant = tenant, store = store,
             lease = "6s", in_progress = reject, recover = asks_at_the_gate)]
async fn charge_again(store: &dyn Store, tenant: &str, key: &str) -> Result<u32, Error> {
    Ok(1)
}

/// The same for a recover hook that answers an error: the call ends the
/// lease of the record it took over, so the next call takes it over at once
/// and asks again; its hook's renewal, still on its way, must not renew it.
async fn a_hooks_renewal_landing_after_the_lease_was_ended(
    name: &str,
    proxy: &FaultProxy,
    store: Arc<dyn Store>,
) {
    let tenant = fresh_tenant();
    let key = format!("late-hook-renewal-{tenant}");
    crashed_owners_record(&*store, "faults.late_renewal_hook", &tenant, &key).await;
    let answered = ended_while_its_renewal_was_held(proxy, (&tenant, &key), {
        let (store, tenant, key) = (store.clone(), tenant.clone(), key.clone());
        async move { charge_again(&*store, &tenant, &key).await }
    })
    .await;
    assert!(
        matches!(answered, Ok(Err(Error::Store(_)))),
        "{name}: the hook's error: {answered:?}"
    );
    let (answer, outcome) = with_outcome(charge_again(&*store, &tenant, &key)).await;
    assert_eq!(
        (answer.as_ref().ok().copied(), outcome),
        (Some(3), Some(Outcome::Recovered)),
        "{name}: the retry takes the record over at once (attempt 3) and asks the hook again; \
         the renewal sent while the first hook ran must not have renewed it: {answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_renewal_that_lands_after_a_panicked_body_ended_the_lease_renews_nothing() {
    let Some((proxy, store)) = through_a_proxy::postgres(4).await else {
        return;
    };
    a_renewal_landing_after_the_lease_was_ended("postgres", &proxy, Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_renewal_that_lands_after_a_panicked_body_ended_the_lease_renews_nothing() {
    let Some((proxy, store)) = through_a_proxy::mariadb(4).await else {
        return;
    };
    a_renewal_landing_after_the_lease_was_ended("mariadb", &proxy, Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_renewal_that_lands_after_a_hook_error_ended_the_lease_renews_nothing() {
    let Some((proxy, store)) = through_a_proxy::postgres(4).await else {
        return;
    };
    a_hooks_renewal_landing_after_the_lease_was_ended("postgres", &proxy, Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_renewal_that_lands_after_a_hook_error_ended_the_lease_renews_nothing() {
    let Some((proxy, store)) = through_a_proxy::mariadb(4).await else {
        return;
    };
    a_hooks_renewal_landing_after_the_lease_was_ended("mariadb", &proxy, Arc::new(store)).await;
}

/// A receipt whose `Serialize` panics for the value `0`: the answer of a
/// body that ran (its side effect done) and whose recording panicked.
#[derive(Debug, PartialEq, serde::Deserialize)]
struct Receipt(u32);

impl serde::Serialize for Receipt {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == 0 {
            panic!("the receipt's serializer panicked");
        }
        s.serialize_u32(self.0)
    }
}

async fn found_the_receipt(_: &Takeover) -> Result<Recovery<Receipt>, Error> {
    Ok(Recovery::Completed(Receipt(7)))
}

#[idempotent(scope = "faults.late_renewal_answer", key = key, tenant = tenant, store = store,
             lease = "6s", in_progress = reject, recover = found_the_receipt)]
async fn charge_for_a_receipt(
    store: &dyn Store,
    tenant: &str,
    key: &str,
) -> Result<Receipt, Error> {
    if let Some(gate) = gate(tenant) {
        gate.reached.notify_one();
        gate.go.notified().await;
        // Its serializer panics as the call records it.
        return Ok(Receipt(0));
    }
    Ok(Receipt(1))
}

/// The same for a body that answered, whose answer panicked while it was
/// recorded (its own `Serialize`): as for a body that panics, the call ends
/// the lease so the next call asks the hook; the renewal the body sent
/// before it answered, still on its way, must not renew it.
async fn a_renewal_landing_after_an_answer_that_panicked_ended_the_lease(
    name: &str,
    proxy: &FaultProxy,
    store: Arc<dyn Store>,
) {
    let tenant = fresh_tenant();
    let key = format!("late-answer-renewal-{tenant}");
    let identity = idempotent_runtime::Identity::new(
        tenant.as_str(),
        "faults.late_renewal_answer",
        key.as_str(),
    )
    .expect("identity");
    let held = gate_for(&tenant);
    let mut owner = tokio::spawn({
        let (store, tenant, key) = (store.clone(), tenant.clone(), key.clone());
        async move { charge_for_a_receipt(&*store, &tenant, &key).await }
    });
    held.reached.notified().await;
    let renewal = proxy.hold_next_request_containing(key.as_bytes());
    renewal.request_seen().await;
    held.go.notify_one();
    let ended = match tokio::time::timeout(ENDS_WITHIN, &mut owner).await {
        Ok(ended) => ended,
        Err(_) => {
            proxy.release_held();
            owner.await
        }
    };
    let ended = ended.expect_err("recording the answer panicked");
    assert!(ended.is_panic(), "{name}: {ended:?}");
    no_gate_for(&tenant);
    // The lease is ended, by the call or by the store's worker it handed
    // the end to (bounded).
    let mut ended_lease = false;
    for _ in 0..500 {
        let snap = store
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("a record");
        if snap
            .lease_expires_at_ms
            .is_some_and(|end| snap.now_ms >= end)
        {
            ended_lease = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        ended_lease,
        "{name}: the record's lease is ended within 5 s"
    );
    proxy.release_held();
    renewal.settled().await;
    let (answer, outcome) = with_outcome(charge_for_a_receipt(&*store, &tenant, &key)).await;
    assert_eq!(
        (answer.as_ref().ok(), outcome),
        (Some(&Receipt(7)), Some(Outcome::Recovered)),
        "{name}: the retry takes the record over at once and asks the hook; the renewal the \
         body sent before its answer panicked must not have renewed the ended lease: {answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_renewal_that_lands_after_an_answer_that_panicked_ended_the_lease_renews_nothing(
) {
    let Some((proxy, store)) = through_a_proxy::postgres(4).await else {
        return;
    };
    a_renewal_landing_after_an_answer_that_panicked_ended_the_lease(
        "postgres",
        &proxy,
        Arc::new(store),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_renewal_that_lands_after_an_answer_that_panicked_ended_the_lease_renews_nothing()
{
    let Some((proxy, store)) = through_a_proxy::mariadb(4).await else {
        return;
    };
    a_renewal_landing_after_an_answer_that_panicked_ended_the_lease(
        "mariadb",
        &proxy,
        Arc::new(store),
    )
    .await;
}

/// How many times `finds_after_the_gate` was asked, per tenant.
static ASKED: LazyLock<Mutex<HashMap<String, u32>>> = LazyLock::new(Default::default);

/// Asks the provider, which finds the side effect: the first time for a
/// tenant with a gate it waits at the gate (its renewal is held meanwhile).
async fn finds_after_the_gate(t: &Takeover) -> Result<Recovery<u32>, Error> {
    *ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(t.tenant().to_owned())
        .or_default() += 1;
    if let Some(gate) = gate(t.tenant()) {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    Ok(Recovery::Completed(t.attempt()))
}

#[idempotent(scope = "faults.late_renewal_found", key = key, tenant = tenant, store = store,
             lease = "6s", in_progress = reject, recover = finds_after_the_gate)]
async fn charge_found(store: &dyn Store, tenant: &str, key: &str) -> Result<u32, Error> {
    Ok(1)
}

/// A hook that answers `Completed` has its answer recorded at once: nothing
/// ends the lease, so its renewal still on its way is not waited for (it
/// changes nothing once the answer is recorded). Waited for, a renewal held
/// on its way kept the answer back while no renewal went out: the lease ran
/// out, another call took the record over and asked the hook again, and the
/// first call's answer was refused (`LeaseLost`).
async fn a_hooks_answer_is_not_held_back_by_its_renewal(
    name: &str,
    proxy: &FaultProxy,
    store: Arc<dyn Store>,
) {
    let tenant = fresh_tenant();
    let key = format!("found-{tenant}");
    let identity = crashed_owners_record(&*store, "faults.late_renewal_found", &tenant, &key).await;
    let held = gate_for(&tenant);
    let mut taker = tokio::spawn({
        let (store, tenant, key) = (store.clone(), tenant.clone(), key.clone());
        async move { with_outcome(charge_found(&*store, &tenant, &key)).await }
    });
    held.reached.notified().await;
    let renewal = proxy.hold_next_request_containing(key.as_bytes());
    renewal.request_seen().await;
    no_gate_for(&tenant);
    held.go.notify_one();
    // The lease the hook's call holds runs out on the store's clock (no
    // renewal was written since the takeover) unless the call has answered.
    let lease_over = async {
        loop {
            let snap = store
                .fetch(&identity)
                .await
                .expect("fetch")
                .expect("a record");
            if snap.state == idempotent_runtime::RecordState::InProgress
                && snap
                    .lease_expires_at_ms
                    .is_some_and(|end| snap.now_ms >= end)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let answered = tokio::select! {
        biased;
        answered = &mut taker => answered,
        () = lease_over => {
            // Another caller meanwhile: it takes the record over.
            let other = with_outcome(charge_found(&*store, &tenant, &key)).await;
            proxy.release_held();
            let answered = taker.await;
            panic!(
                "{name}: the hook's answer was held back until the lease ran out; another \
                 call took the record over ({other:?}), and the first one answered {answered:?}"
            );
        }
    };
    proxy.release_held();
    renewal.settled().await;
    let (answer, outcome) = answered.expect("the call answers");
    assert_eq!(
        (answer.as_ref().ok().copied(), outcome),
        (Some(2), Some(Outcome::Recovered)),
        "{name}: {answer:?}"
    );
    assert_eq!(
        ASKED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&tenant)
            .copied(),
        Some(1),
        "{name}: the hook is asked once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_hooks_answer_is_not_held_back_by_its_renewal() {
    let Some((proxy, store)) = through_a_proxy::postgres(4).await else {
        return;
    };
    a_hooks_answer_is_not_held_back_by_its_renewal("postgres", &proxy, Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_hooks_answer_is_not_held_back_by_its_renewal() {
    let Some((proxy, store)) = through_a_proxy::mariadb(4).await else {
        return;
    };
    a_hooks_answer_is_not_held_back_by_its_renewal("mariadb", &proxy, Arc::new(store)).await;
}

/// Waits at `tenant`'s gate, then never answers (the caller's timeout, a
/// client gone, drops the call): the side effect may have happened. A
/// lease long beside the worker's schedule of ends (about 9 s).
#[idempotent(scope = "faults.late_renewal_dropped", key = key, tenant = tenant, store = store,
             lease = "15s", in_progress = reject, recover = found)]
async fn charge_then_hang(store: &dyn Store, tenant: &str, key: &str) -> Result<u32, Error> {
    if let Some(gate) = gate(tenant) {
        gate.reached.notify_one();
        gate.go.notified().await;
        std::future::pending::<()>().await;
    }
    Ok(1)
}

/// Rules 14 and 20 for a call *dropped* while its renewal is on its way (the
/// panicked and failed calls above wait for it; a dropped call cannot): the
/// store's worker ends the record's lease, and a renewal that lands after
/// that renewed it for a whole lease (15 s here), every retry refused
/// (`in_progress = reject`) until it ran out. The worker ends the lease
/// again: the record's lease is seen ended while the renewed one would
/// still run, and the retry takes the record over and asks the hook.
async fn a_renewal_landing_after_a_dropped_call(
    name: &str,
    proxy: &FaultProxy,
    store: Arc<dyn Store>,
) {
    let tenant = fresh_tenant();
    let key = format!("late-renewal-dropped-{tenant}");
    let identity = idempotent_runtime::Identity::new(&tenant, "faults.late_renewal_dropped", &key)
        .expect("identity");
    let held = gate_for(&tenant);
    let call = tokio::spawn({
        let (store, tenant, key) = (store.clone(), tenant.clone(), key.clone());
        async move { charge_then_hang(&*store, &tenant, &key).await }
    });
    held.reached.notified().await;
    // The next statement naming the key is the call's first renewal.
    let renewal = proxy.hold_next_request_containing(key.as_bytes());
    renewal.request_seen().await;
    // The renewal is on its way: the caller gives up on the call.
    call.abort();
    let ended = call.await.expect_err("aborted");
    assert!(ended.is_cancelled(), "{name}: {ended:?}");
    no_gate_for(&tenant);
    // The store's worker ends the lease (its own connections, not held).
    let left = store.finish_background_work(Duration::from_secs(30)).await;
    assert_eq!(left, 0, "{name}: the worker did not end the lease");
    // Now the renewal reaches the server and renews the lease.
    proxy.release_held();
    renewal.settled().await;
    let renewed = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("the record");
    let renewed_until = renewed.lease_expires_at_ms.expect("in progress");
    // Read every 50 ms until the lease is seen ended, for as long as the
    // renewed lease would run (less a margin for the read).
    loop {
        let now = store
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("the record");
        let until = now.lease_expires_at_ms.expect("in progress");
        if until <= now.now_ms {
            break;
        }
        assert!(
            now.now_ms < renewed_until - 2_000,
            "{name}: the renewal the dropped call had sent renewed the lease its store ended, \
             and it runs for the whole lease: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (answer, outcome) = with_outcome(charge_then_hang(&*store, &tenant, &key)).await;
    assert_eq!(
        (answer.as_ref().ok().copied(), outcome),
        (Some(7), Some(Outcome::Recovered)),
        "{name}: the retry takes the record over at once and asks the hook: {answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_renewal_that_lands_after_a_dropped_call_ended_the_lease_is_ended_again() {
    let Some((proxy, store)) = through_a_proxy::postgres(4).await else {
        return;
    };
    a_renewal_landing_after_a_dropped_call("postgres", &proxy, Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_renewal_that_lands_after_a_dropped_call_ended_the_lease_is_ended_again() {
    let Some((proxy, store)) = through_a_proxy::mariadb(4).await else {
        return;
    };
    a_renewal_landing_after_a_dropped_call("mariadb", &proxy, Arc::new(store)).await;
}

/// Rule 14 beside the ends made again: a dropped call's record that someone
/// else's transaction holds (a transactional-mode call that took it over,
/// its body running) makes each end made again wait for the row lock, up to
/// the worker's 10 s, on one of the worker's two connections. Two such
/// records held both connections, and the release of a third dropped call
/// (a record in progress, refusing retries) waited for them. The ends made
/// again use one of the worker's connections at most: the other is there
/// for the work that finishes a dropped call's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_ends_made_again_that_wait_for_row_locks_leave_the_worker_a_connection() {
    use crate::common::records::{acquire, pg_lock_row_in_transaction};
    use idempotent_runtime::{Identity, OwnerToken};
    use sqlx::Connection;

    let Some(store) = crate::common::servers::pg_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let scope = "faults.late_renewal_held_rows";
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let dropped: Vec<(Identity, OwnerToken)> = {
        let mut dropped = Vec::new();
        for n in 0..2 {
            let identity = Identity::new(&tenant, scope, format!("held-{n}")).expect("identity");
            let token = acquire(&store, &identity, None, lease, ttl).await;
            dropped.push((identity, token));
        }
        dropped
    };
    // Connections that take each record in a transaction left open (a
    // takeover's body running), opened first so the rows are taken at once.
    let mut holders = Vec::new();
    let mut holder_pids: Vec<i32> = Vec::new();
    for _ in &dropped {
        let mut conn = sqlx::PgConnection::connect(&crate::common::servers::pg_url())
            .await
            .expect("connect");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .expect("pid");
        holders.push(conn);
        holder_pids.push(pid);
    }
    let mut watcher = sqlx::PgConnection::connect(&crate::common::servers::pg_url())
        .await
        .expect("connect");
    for (identity, token) in &dropped {
        store.end_lease_detached(identity.clone(), token.clone());
    }
    assert_eq!(
        store.finish_background_work(Duration::from_secs(30)).await,
        0
    );
    for ((identity, _), conn) in dropped.iter().zip(&mut holders) {
        pg_lock_row_in_transaction(conn, identity).await;
    }
    // Until the ends made again wait: both of them (before the fix), or one
    // waiting and the other queued behind it (so two schedule steps, 2.5 s,
    // pass without a second waiter).
    let mut first_seen = None;
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE pg_blocking_pids(pid) && $1::int[]",
        )
        .bind(&holder_pids)
        .fetch_one(&mut watcher)
        .await
        .expect("waiters");
        if waiting >= 1 && first_seen.is_none() {
            first_seen = Some(std::time::Instant::now());
        }
        if waiting >= 2 || first_seen.is_some_and(|at| at.elapsed() > Duration::from_millis(2_500))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A third call is dropped holding its record: its release is due now.
    let identity = Identity::new(&tenant, scope, "released").expect("identity");
    let token = acquire(&store, &identity, None, lease, ttl).await;
    store.release_detached(identity.clone(), token);
    let left = store.finish_background_work(Duration::from_secs(3)).await;
    let record = store.fetch(&identity).await.expect("fetch");
    for mut holder in holders {
        sqlx::query("ROLLBACK")
            .execute(&mut holder)
            .await
            .expect("rollback");
    }
    assert_eq!(
        (left, record.map(|r| r.state)),
        (0, None),
        "the dropped call's release waited for the worker's connections, both held by ends \
         of lease made again waiting for row locks"
    );
}
