//! Rule 20 on the consumer path: a delivery whose worker died mid-body (its
//! future forgotten: no release, no renewal, as a killed process leaves it)
//! is redelivered by JetStream; the redelivery takes the record over once
//! its lease ran out, and the `recover` hook, not a blind re-run, decides.
//! On the real JetStream server (streams named `IDEM_*`), PostgreSQL and
//! MariaDB (the test databases, fresh tenants).

use crate::common;
use crate::nats_consumer::{
    json, next_delivery, order, pulled_in_turn, Order, PulledInTurn, TestStream,
};

use async_nats::jetstream;
use common::servers::{fresh_tenant, nats_or_skip};
use idempotent_runtime::consumer::nats::process;
use idempotent_runtime::consumer::{Disposition, Verdict};
use idempotent_runtime::{
    idempotent, Completion, Error, Fenced, ForcedRelease, Identity, OwnerToken, PgStore,
    RecordSnapshot, RecordState, Recovery, Reservation, ReserveRequest, ScopeStats, Store,
    StoreError, Takeover,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;

const SCOPE: &str = "nats.recovered.billing";

/// What the payment gateway (the side effect) knows, per tenant: charges
/// made, keyed by message id. The hook asks it; the body charges it.
#[derive(Default)]
struct Gateway {
    charges: HashMap<String, u32>,
    /// The attempts the hook was asked about.
    asked: Vec<u32>,
    /// How the next hook calls behave, first to last (then: look it up).
    hook_script: Vec<HookMode>,
    /// Bodies begun.
    bodies: u32,
    /// The first body hangs after charging (its worker "dies" there).
    first_body_hangs: bool,
    /// The first body panics after charging.
    first_body_panics: bool,
}

#[derive(Clone, Copy, Debug)]
enum HookMode {
    /// The gateway cannot be reached: the hook fails.
    Unreachable,
    /// The hook panics.
    Panics,
}

static GATEWAYS: LazyLock<Mutex<HashMap<String, Gateway>>> = LazyLock::new(Default::default);
/// Released once per body that charged and is about to hang.
static HUNG: Semaphore = Semaphore::const_new(0);

fn with_gateway<T>(tenant: &str, f: impl FnOnce(&mut Gateway) -> T) -> T {
    let mut all = GATEWAYS.lock().unwrap_or_else(|p| p.into_inner());
    f(all.entry(tenant.to_owned()).or_default())
}

/// Asks the gateway, by message id, whether the crashed attempt charged.
async fn found_in_gateway(t: &Takeover) -> Result<Recovery<u64>, Error> {
    let (mode, charged) = with_gateway(t.tenant(), |g| {
        g.asked.push(t.attempt());
        let mode = (!g.hook_script.is_empty()).then(|| g.hook_script.remove(0));
        (mode, g.charges.get(t.key()).copied().unwrap_or(0))
    });
    match mode {
        Some(HookMode::Unreachable) => Err(Error::Store(StoreError::new(
            "gateway",
            "look the charge up",
            "timed out",
        ))),
        Some(HookMode::Panics) => panic!("the recover hook panics (by design)"),
        None if charged > 0 => Ok(Recovery::Completed(4242)),
        None => Ok(Recovery::Run),
    }
}

#[idempotent(scope = "nats.recovered.billing", key = msg_id, tenant = tenant, store = store,
             in_progress = reject, lease = "1s", recover = found_in_gateway)]
async fn bill(store: &dyn Store, tenant: &str, msg_id: &str, order: &Order) -> Result<u64, Error> {
    let (hang, panics) = with_gateway(tenant, |g| {
        g.bodies += 1;
        *g.charges.entry(msg_id.to_owned()).or_default() += 1;
        (
            std::mem::take(&mut g.first_body_hangs),
            std::mem::take(&mut g.first_body_panics),
        )
    });
    if panics {
        panic!("the body panics after charging (by design)");
    }
    if hang {
        HUNG.add_permits(1);
        std::future::pending::<()>().await;
    }
    let _ = order;
    Ok(7)
}

async fn pg() -> Option<PgStore> {
    common::servers::pg_store_or_skip().await
}

/// The durable `billing` of `stream` (ack wait 1 s), pulled one message at a time.
async fn billing(stream: &TestStream) -> PulledInTurn {
    pulled_in_turn(&stream.durable("billing", Duration::from_secs(1)).await, 1)
}

/// Delivers the message until a delivery is acked or terminated (at most
/// 40 deliveries); every disposition on the way, in order.
async fn deliver_until_settled(
    store: &'static dyn Store,
    tenant: &str,
    messages: &mut PulledInTurn,
) -> Vec<(Verdict, Disposition)> {
    let mut seen = Vec::new();
    for _ in 0..40 {
        let message = next_delivery(messages).await;
        let o: Order = serde_json::from_slice(&message.payload).unwrap();
        let task = {
            let (tenant, message) = (tenant.to_owned(), message);
            // The hook may panic: its delivery's task ends, unsettled.
            tokio::spawn(async move {
                process(&message, |k| bill(store, &tenant, k, &o))
                    .await
                    .map(|h| (h.verdict, h.disposition()))
            })
        };
        match task.await {
            Ok(settled) => {
                let (verdict, disposition) = settled.expect("settled");
                seen.push((verdict, disposition));
                if matches!(disposition, Disposition::Ack | Disposition::Term) {
                    return seen;
                }
            }
            Err(e) if e.is_panic() => {}
            Err(e) => panic!("{e}"),
        }
    }
    panic!("never settled: {seen:?}");
}

/// The stores live for the whole test binary: a spawned delivery borrows one.
static PG: tokio::sync::OnceCell<Option<&'static PgStore>> = tokio::sync::OnceCell::const_new();
static MARIADB: tokio::sync::OnceCell<Option<&'static idempotent_runtime::MySqlStore>> =
    tokio::sync::OnceCell::const_new();

async fn leaked_pg_store() -> Option<&'static PgStore> {
    *PG.get_or_init(|| async {
        let store: &'static PgStore = Box::leak(Box::new(pg().await?));
        Some(store)
    })
    .await
}

async fn leaked_pg() -> Option<&'static dyn Store> {
    Some(leaked_pg_store().await?)
}

async fn leaked_mariadb_store() -> Option<&'static idempotent_runtime::MySqlStore> {
    *MARIADB
        .get_or_init(|| async {
            let store = common::servers::mysql_store_or_skip().await?;
            let store: &'static idempotent_runtime::MySqlStore = Box::leak(Box::new(store));
            Some(store)
        })
        .await
}

async fn leaked_mariadb() -> Option<&'static dyn Store> {
    Some(leaked_mariadb_store().await?)
}

/// Handles the first delivery until its body has charged and hangs, then
/// forgets it: the worker died there (no release, no renewal).
async fn first_delivery_dies_after_charging(
    store: &'static dyn Store,
    tenant: &str,
    messages: &mut PulledInTurn,
) {
    let first = Box::leak(Box::new(next_delivery(messages).await));
    let o: &'static Order = Box::leak(Box::new(serde_json::from_slice(&first.payload).unwrap()));
    let tenant: &'static str = Box::leak(tenant.to_owned().into_boxed_str());
    let mut dying = Box::pin(process(first, move |k| bill(store, tenant, k, o)));
    tokio::select! {
        _ = &mut dying => panic!("the hanging body returned"),
        permit = HUNG.acquire() => permit.expect("open").forget(),
    }
    std::mem::forget(dying);
}

async fn record(store: &dyn Store, tenant: &str, key: &str) -> RecordSnapshot {
    let identity = Identity::new(tenant, SCOPE, key).unwrap();
    store.fetch(&identity).await.unwrap().expect("a record")
}

/// The worker charged and died: the redeliveries are nak'd while the dead
/// worker's lease lasts, then one takes the record over, the hook finds the
/// charge, and its answer is recorded and acked. One charge, one body.
async fn died_after_charging(js: jetstream::Context, store: &'static dyn Store, label: &str) {
    let tenant = fresh_tenant();
    with_gateway(&tenant, |g| g.first_body_hangs = true);
    let stream = TestStream::create(&js, label).await;
    let mut messages = billing(&stream).await;
    stream.publish("d-1", json(&order("o-1", 100))).await;

    first_delivery_dies_after_charging(store, &tenant, &mut messages).await;
    let seen = deliver_until_settled(store, &tenant, &mut messages).await;
    let (last, before) = seen.split_last().unwrap();
    assert_eq!(*last, (Verdict::Executed, Disposition::Ack), "{seen:?}");
    assert!(
        before
            .iter()
            .all(|(v, _)| matches!(v, Verdict::InProgress { .. })),
        "{seen:?}"
    );
    let (charges, bodies, asked) = with_gateway(&tenant, |g| {
        (g.charges.get("d-1").copied(), g.bodies, g.asked.clone())
    });
    assert_eq!((charges, bodies), (Some(1), 1), "charged once, one body");
    assert_eq!(asked, [2]);
    let r = record(store, &tenant, "d-1").await;
    assert_eq!(
        (r.state, r.attempt, r.recovered),
        (RecordState::Complete, 2, true)
    );
    drop(messages);
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_delivery_whose_worker_died_after_charging_is_recovered_not_charged_again() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = leaked_pg().await else {
        return;
    };
    tokio::time::timeout(
        Duration::from_secs(120),
        died_after_charging(js, store, "diedpg"),
    )
    .await
    .expect("finished within 120 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_delivery_whose_worker_died_after_charging_is_recovered_not_charged_again() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = leaked_mariadb().await else {
        return;
    };
    tokio::time::timeout(
        Duration::from_secs(120),
        died_after_charging(js, store, "diedmy"),
    )
    .await
    .expect("finished within 120 s");
}

/// The hook cannot reach the gateway at the first takeover, and panics at
/// the second: neither frees the record for a blind re-run; the delivery
/// after them asks again (attempt 4), finds the charge and is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_then_panicking_hook_keeps_the_message_until_it_can_answer() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = leaked_pg().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let tenant = fresh_tenant();
        with_gateway(&tenant, |g| {
            g.first_body_hangs = true;
            g.hook_script = vec![HookMode::Unreachable, HookMode::Panics];
        });
        let stream = TestStream::create(&js, "HOOKFAILS").await;
        let mut messages = billing(&stream).await;
        stream.publish("f-1", json(&order("o-1", 100))).await;

        first_delivery_dies_after_charging(store, &tenant, &mut messages).await;
        let seen = deliver_until_settled(store, &tenant, &mut messages).await;
        assert_eq!(
            seen.last(),
            Some(&(Verdict::Executed, Disposition::Ack)),
            "{seen:?}"
        );
        assert!(
            seen.iter()
                .any(|(v, d)| *v == Verdict::Failed && matches!(d, Disposition::Nak(_))),
            "the failing hook's delivery was nak'd: {seen:?}"
        );
        let (charges, bodies, asked) = with_gateway(&tenant, |g| {
            (g.charges.get("f-1").copied(), g.bodies, g.asked.clone())
        });
        assert_eq!((charges, bodies), (Some(1), 1), "charged once, one body");
        assert_eq!(asked, [2, 3, 4]);
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 120 s");
}

// ---------------------------------------------------------------- a store fault at completion

/// A PostgreSQL store whose next `complete` calls fail (the connection
/// dropped as the answer was written); everything else, and the store's
/// background work, goes to the database.
struct FailingCompletion {
    inner: PgStore,
    fail: AtomicUsize,
    /// The background writes of failed completions are lost too (the
    /// store's worker cannot reach the database either, and gives up).
    lose_background_writes: bool,
}

#[async_trait::async_trait]
impl Store for FailingCompletion {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn max_result_bytes(&self) -> usize {
        self.inner.max_result_bytes()
    }
    fn database_id(&self) -> Option<&str> {
        self.inner.database_id()
    }
    fn records_in_process_memory(&self) -> bool {
        self.inner.records_in_process_memory()
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.inner.reserve(r).await
    }
    async fn complete(&self, c: Completion<'_>) -> Result<Fenced, StoreError> {
        let failing = self
            .fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Err(StoreError::new("postgres", "complete", "connection reset"));
        }
        self.inner.complete(c).await
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        self.inner.release(i, t).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.heartbeat(i, t, lease).await
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.release_detached(i, t)
    }
    fn complete_detached(&self, c: Completion<'_>) {
        if !self.lose_background_writes {
            self.inner.complete_detached(c)
        }
    }
    fn end_lease_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.end_lease_detached(i, t)
    }
    async fn force_release(&self, i: &Identity, r: bool) -> Result<ForcedRelease, StoreError> {
        self.inner.force_release(i, r).await
    }
    async fn wait_for_change(&self, i: &Identity, max_wait: Duration, round: u32) {
        self.inner.wait_for_change(i, max_wait, round).await
    }
    async fn finish_background_work(&self, within: Duration) -> usize {
        self.inner.finish_background_work(within).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }
    async fn fetch(&self, i: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        self.inner.fetch(i).await
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.inner.scope_stats().await
    }
}

/// The body charged, and writing its answer failed: the delivery is nak'd
/// (the caller cannot know it was recorded), and its redelivery replays the
/// answer the store's background work recorded, or, when that was lost too,
/// takes the record over once its lease ran out and records the answer this
/// process holds: acked, never charged again.
async fn answer_not_written(lose_background_writes: bool, label: &str) {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(pg) = pg().await else {
        return;
    };
    let store: &'static FailingCompletion = Box::leak(Box::new(FailingCompletion {
        inner: pg,
        fail: AtomicUsize::new(1),
        lose_background_writes,
    }));
    let tenant = fresh_tenant();
    let stream = TestStream::create(&js, label).await;
    let mut messages = billing(&stream).await;
    stream.publish("c-1", json(&order("o-1", 100))).await;

    let mut seen = Vec::new();
    for _ in 0..40 {
        let message = next_delivery(&mut messages).await;
        let o: Order = serde_json::from_slice(&message.payload).unwrap();
        let handled = process(&message, |k| bill(store, &tenant, k, &o))
            .await
            .expect("settled");
        seen.push((handled.verdict, handled.disposition()));
        if matches!(handled.disposition(), Disposition::Ack | Disposition::Term) {
            break;
        }
    }
    assert_eq!(seen.first().map(|s| s.0), Some(Verdict::Failed), "{seen:?}");
    assert_eq!(seen.last().map(|s| s.1), Some(Disposition::Ack), "{seen:?}");
    let (charges, bodies, asked) = with_gateway(&tenant, |g| {
        (g.charges.get("c-1").copied(), g.bodies, g.asked.clone())
    });
    assert_eq!((charges, bodies), (Some(1), 1), "charged once: {seen:?}");
    assert!(asked.is_empty(), "the answer was known: {asked:?}");
    let r = record(store, &tenant, "c-1").await;
    assert_eq!(r.state, RecordState::Complete);
    drop(messages);
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_answer_could_not_be_written_is_not_charged_again() {
    tokio::time::timeout(
        Duration::from_secs(120),
        answer_not_written(false, "complfault"),
    )
    .await
    .expect("finished within 120 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_answer_and_its_background_write_were_lost_is_not_charged_again() {
    tokio::time::timeout(
        Duration::from_secs(120),
        answer_not_written(true, "compllost"),
    )
    .await
    .expect("finished within 120 s");
}

/// The body charged and panicked: the panic leaves the delivery unsettled,
/// the record's lease is ended (a scope with a hook), and the redelivery
/// takes it over and asks the hook, which finds the charge. One charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_body_panicked_after_charging_is_recovered_on_redelivery() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = leaked_pg().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let tenant = fresh_tenant();
        with_gateway(&tenant, |g| g.first_body_panics = true);
        let stream = TestStream::create(&js, "BODYPANICS").await;
        let mut messages = billing(&stream).await;
        stream.publish("p-1", json(&order("o-1", 100))).await;
        let seen = deliver_until_settled(store, &tenant, &mut messages).await;
        assert_eq!(
            seen,
            [(Verdict::Executed, Disposition::Ack)],
            "the panicking delivery settled nothing; the next was recovered"
        );
        let (charges, bodies, asked) = with_gateway(&tenant, |g| {
            (g.charges.get("p-1").copied(), g.bodies, g.asked.clone())
        });
        assert_eq!((charges, bodies, asked), (Some(1), 1, vec![2]));
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 120 s");
}

// ---------------------------------------------------------------- a deploy that moved to transactional mode

/// The same boundary, in store mode (the version whose worker died) and in
/// transactional mode (the version the redelivery reaches).
#[idempotent(scope = "nats.recovered.mixed", key = msg_id, tenant = tenant, store = store,
             in_progress = reject, lease = "1s", recover = found_in_gateway, shared_scope)]
async fn bill_mixed(
    store: &dyn Store,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, Error> {
    bill_body(tenant, msg_id, order).await
}

#[idempotent(scope = "nats.recovered.mixed", key = msg_id, tenant = tenant, tx = tx,
             in_progress = reject, recover = found_in_gateway, shared_scope)]
async fn bill_mixed_pg_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, Error> {
    bill_body(tenant, msg_id, order).await
}

#[idempotent(scope = "nats.recovered.mixed", key = msg_id, tenant = tenant, tx = tx,
             in_progress = reject, recover = found_in_gateway, shared_scope)]
async fn bill_mixed_mysql_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, Error> {
    bill_body(tenant, msg_id, order).await
}

async fn bill_body(tenant: &str, msg_id: &str, order: &Order) -> Result<u64, Error> {
    let hang = with_gateway(tenant, |g| {
        g.bodies += 1;
        *g.charges.entry(msg_id.to_owned()).or_default() += 1;
        std::mem::take(&mut g.first_body_hangs)
    });
    if hang {
        HUNG.add_permits(1);
        std::future::pending::<()>().await;
    }
    let _ = order;
    Ok(7)
}

enum TxDb {
    Pg(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
}

/// One delivery in transactional mode: commit on `Ok`, roll back otherwise.
async fn bill_in_tx(db: &TxDb, tenant: &str, msg_id: &str, order: &Order) -> Result<u64, Error> {
    let db_err = |e: sqlx::Error| Error::Store(StoreError::new("test", "transaction", e));
    match db {
        TxDb::Pg(pool) => {
            let mut tx = pool.begin().await.map_err(db_err)?;
            let r = bill_mixed_pg_tx(&mut tx, tenant, msg_id, order).await?;
            tx.commit().await.map_err(db_err)?;
            Ok(r)
        }
        TxDb::MySql(pool) => {
            let mut tx = pool.begin().await.map_err(db_err)?;
            let r = bill_mixed_mysql_tx(&mut tx, tenant, msg_id, order).await?;
            tx.commit().await.map_err(db_err)?;
            Ok(r)
        }
    }
}

/// The store-mode worker charged and died; the redelivery reaches the
/// transactional version, which takes the record over in its transaction,
/// asks the hook, records its answer and commits: acked, one charge.
async fn died_then_transactional(js: jetstream::Context, store: &'static dyn Store, db: TxDb) {
    let tenant = fresh_tenant();
    with_gateway(&tenant, |g| g.first_body_hangs = true);
    let stream = TestStream::create(&js, "MIXED").await;
    let mut messages = billing(&stream).await;
    stream.publish("x-1", json(&order("o-1", 100))).await;

    let first = Box::leak(Box::new(next_delivery(&mut messages).await));
    let o: &'static Order = Box::leak(Box::new(serde_json::from_slice(&first.payload).unwrap()));
    let t: &'static str = Box::leak(tenant.clone().into_boxed_str());
    let mut dying = Box::pin(process(first, move |k| bill_mixed(store, t, k, o)));
    tokio::select! {
        _ = &mut dying => panic!("the hanging body returned"),
        permit = HUNG.acquire() => permit.expect("open").forget(),
    }
    std::mem::forget(dying);

    let mut seen = Vec::new();
    for _ in 0..40 {
        let message = next_delivery(&mut messages).await;
        let o: Order = serde_json::from_slice(&message.payload).unwrap();
        let handled = process(&message, |k| bill_in_tx(&db, &tenant, k, &o))
            .await
            .expect("settled");
        seen.push((handled.verdict, handled.disposition()));
        if matches!(handled.disposition(), Disposition::Ack | Disposition::Term) {
            break;
        }
    }
    assert_eq!(
        seen.last(),
        Some(&(Verdict::Executed, Disposition::Ack)),
        "{seen:?}"
    );
    let (charges, bodies, asked) = with_gateway(&tenant, |g| {
        (g.charges.get("x-1").copied(), g.bodies, g.asked.clone())
    });
    assert_eq!((charges, bodies), (Some(1), 1), "charged once: {seen:?}");
    assert_eq!(asked.last(), Some(&2), "{asked:?}");
    let identity = Identity::new(tenant.as_str(), "nats.recovered.mixed", "x-1").unwrap();
    let r = store.fetch(&identity).await.unwrap().expect("a record");
    assert_eq!((r.state, r.recovered), (RecordState::Complete, true));
    drop(messages);
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_store_mode_death_is_recovered_by_the_transactional_version() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = leaked_pg_store().await else {
        return;
    };
    let pool = store.pool().clone();
    tokio::time::timeout(
        Duration::from_secs(120),
        died_then_transactional(js, store, TxDb::Pg(pool)),
    )
    .await
    .expect("finished within 120 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_store_mode_death_is_recovered_by_the_transactional_version() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = leaked_mariadb_store().await else {
        return;
    };
    let pool = store.pool().clone();
    tokio::time::timeout(
        Duration::from_secs(120),
        died_then_transactional(js, store, TxDb::MySql(pool)),
    )
    .await
    .expect("finished within 120 s");
}

// ---------------------------------------------------------------- the tenant from a header

/// The header a producer names the message's tenant in.
const TENANT_HEADER: &str = "H-Cons-Tenant";

/// The tenant of a delivery: its header as sent; a missing header is the
/// empty string, which the call refuses (never the shared tenant).
fn tenant_of(message: &jetstream::Message) -> &str {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(TENANT_HEADER))
        .map_or("", |v| v.as_str())
}

/// A message whose tenant header is missing, or too long to be a tenant, is
/// terminated without a record or a charge; the same message id from a
/// tenant that names itself runs, once, in that tenant's record only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_without_a_valid_tenant_are_terminated_and_touch_no_record() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = leaked_pg().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(60), async {
        let tenant = fresh_tenant();
        let too_long = "t".repeat(300);
        let stream = TestStream::create(&js, "TENANTS").await;
        let mut messages = billing(&stream).await;
        let publish = |tenant: Option<String>, id: &'static str| {
            let stream = &stream;
            async move {
                let header = tenant.as_deref().map(|t| (TENANT_HEADER, t));
                stream
                    .publish_with_header(id, header, json(&order("o-1", 100)))
                    .await;
            }
        };
        publish(None, "t-1").await;
        publish(Some(too_long.clone()), "t-2").await;
        publish(Some(tenant.clone()), "t-3").await;
        let mut verdicts = Vec::new();
        for _ in 0..3 {
            let message = next_delivery(&mut messages).await;
            let o: Order = serde_json::from_slice(&message.payload).unwrap();
            let t = tenant_of(&message).to_owned();
            let handled = process(&message, |k| bill(store, &t, k, &o))
                .await
                .expect("settled");
            verdicts.push((handled.verdict, handled.disposition()));
        }
        assert_eq!(
            verdicts,
            [
                (Verdict::InvalidKey, Disposition::Term),
                (Verdict::InvalidKey, Disposition::Term),
                (Verdict::Executed, Disposition::Ack),
            ]
        );
        for (t, key) in [("", "t-1"), (too_long.as_str(), "t-2")] {
            assert_eq!(with_gateway(t, |g| g.bodies), 0, "nothing ran for {key}");
        }
        let shared = Identity::shared(SCOPE, "t-1").unwrap();
        assert!(
            store.fetch(&shared).await.unwrap().is_none(),
            "a missing tenant is not the shared tenant"
        );
        assert_eq!(with_gateway(&tenant, |g| g.bodies), 1);
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 60 s");
}
