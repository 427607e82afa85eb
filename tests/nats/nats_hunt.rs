//! An independent tester's probes of the consumer contract (README, "Message
//! consumers"), on the real JetStream server and PostgreSQL, each delivery
//! handled on a store object of its own, as another worker process would:
//!
//! * a handler that fails is nak'd with a pause that grows at every
//!   redelivery, as the server counts them (1 s, 2 s, 4 s), and runs once it
//!   succeeds; a producer retry after that is a replay;
//! * the tenant comes from a header: one message id from two tenants (and
//!   from a tenant that differs only in case) is two records, each with its
//!   own answer, never a replay of the other's nor a mismatch with it;
//! * a body that outlives `ack_wait` under the default `in_progress = wait`:
//!   the redelivery, on another store object, finds the body running (and
//!   waits) or done, and replays its answer; one effect, the message settled;
//! * PostgreSQL cut off while a body runs: the delivery is nak'd as failed,
//!   and its redeliveries get the body's answer (also when the outage
//!   outlasts the lease: the answer this process holds is recorded on
//!   takeover), never a second run; PostgreSQL gone silent under
//!   `process_with_progress`: the delivery is answered once the store gives
//!   the silent connection up, not kept by its progress for as long as the
//!   silence lasts.
//!
//! Streams are named `IDEM_HUNT_*` and deleted at the end.

use crate::common;
use crate::nats_consumer::{
    json, next_delivery, order, pulled_in_turn, settled, Order, TestStream,
};

use async_nats::jetstream;
use common::servers::{fresh_tenant, nats_or_skip, pg_store_or_skip};
use futures_util::StreamExt;
use idempotent_runtime::consumer::nats::{process, process_with_progress};
use idempotent_runtime::consumer::{Disposition, Verdict};
use idempotent_runtime::{idempotent, Error, Identity, PgStore, RecordState, Store};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

const SCOPE: &str = "nats.hunt.billing";

/// Per tenant: bodies begun, effects (amounts billed), failures still to come.
struct Ledger {
    begun: u32,
    effects: Vec<u64>,
    fails_left: u32,
    /// The first body waits for this gate (and says it has begun).
    gated: bool,
    /// One permit per gated body that has begun.
    entered: Arc<Semaphore>,
    /// Opens the gated body.
    gate: Arc<Semaphore>,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            begun: 0,
            effects: Vec::new(),
            fails_left: 0,
            gated: false,
            entered: Arc::new(Semaphore::new(0)),
            gate: Arc::new(Semaphore::new(0)),
        }
    }
}

static LEDGERS: LazyLock<Mutex<HashMap<String, Ledger>>> = LazyLock::new(Default::default);

fn ledger<T>(tenant: &str, f: impl FnOnce(&mut Ledger) -> T) -> T {
    let mut all = LEDGERS.lock().unwrap_or_else(|p| p.into_inner());
    f(all.entry(tenant.to_owned()).or_default())
}

#[derive(Debug, thiserror::Error)]
enum HuntError {
    #[error("the ledger is down")]
    LedgerDown,
    #[error(transparent)]
    Idempotency(#[from] Error),
}

impl idempotent_runtime::consumer::AsIdempotencyError for HuntError {
    fn as_idempotency_error(&self) -> Option<&Error> {
        match self {
            HuntError::Idempotency(e) => Some(e),
            HuntError::LedgerDown => None,
        }
    }
}

/// The body: fails while the tenant's ledger says so (the key is released),
/// otherwise bills the order's amount once.
async fn body(tenant: &str, order: &Order) -> Result<u64, HuntError> {
    let (fail, gated) = ledger(tenant, |l| {
        l.begun += 1;
        let fail = l.fails_left > 0;
        l.fails_left = l.fails_left.saturating_sub(1);
        let gated = (l.gated && l.begun == 1).then(|| (l.entered.clone(), l.gate.clone()));
        (fail, gated)
    });
    if fail {
        return Err(HuntError::LedgerDown);
    }
    if let Some((entered, gate)) = gated {
        entered.add_permits(1);
        // Bounded: a handshake that never comes fails the counts, not the run.
        let _ = tokio::time::timeout(Duration::from_secs(30), gate.acquire()).await;
    }
    let amount = amount_of(order);
    ledger(tenant, |l| l.effects.push(amount));
    Ok(amount)
}

fn amount_of(order: &Order) -> u64 {
    // `Order`'s fields are the suite's; its JSON has the amount.
    serde_json::to_value(order).unwrap()["amount_cents"]
        .as_u64()
        .unwrap()
}

/// As the README recommends for consumers.
#[idempotent(scope = "nats.hunt.billing", key = msg_id, tenant = tenant, store = store,
             in_progress = reject, lease = "20s")]
async fn bill(
    store: &dyn Store,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, HuntError> {
    body(tenant, order).await
}

/// The attribute's default for duplicates: `in_progress = wait("10s")`.
#[idempotent(scope = "nats.hunt.waiting", key = msg_id, tenant = tenant, store = store,
             lease = "20s")]
async fn bill_waiting(
    store: &dyn Store,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, HuntError> {
    body(tenant, order).await
}

/// A store object of its own, as another worker process would have: its own pool.
async fn another_worker() -> Option<&'static PgStore> {
    Some(Box::leak(Box::new(pg_store_or_skip().await?)))
}

fn delivered(message: &jetstream::Message) -> i64 {
    message.info().expect("a JetStream delivery").delivered
}

// ---------------------------------------------------------------- a failing handler, redelivered

/// README: a failed delivery is nak'd, "`process` delays it by the delivery
/// count, 1 s after the first delivery, doubling up to 60 s". On the server:
/// three failures (each on a store object of its own) are nak'd after 1 s,
/// 2 s and 4 s as the server counts the deliveries, the fourth runs and is
/// acked, and a producer retry published afterwards replays that answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handler_is_nakd_later_at_every_redelivery_then_runs_once() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    if pg_store_or_skip().await.is_none() {
        return;
    }
    tokio::time::timeout(Duration::from_secs(90), async {
        let tenant = fresh_tenant();
        ledger(&tenant, |l| l.fails_left = 3);
        let stream = TestStream::create(&js, "HUNT_FAILING").await;
        let consumer = stream.durable("billing", Duration::from_secs(30)).await;
        let mut messages = pulled_in_turn(&consumer, 1);
        stream.publish("f-1", json(&order("o-1", 250))).await;
        let mut seen = Vec::new();
        loop {
            let message = next_delivery(&mut messages).await;
            let store = another_worker().await.unwrap();
            let o: Order = serde_json::from_slice(&message.payload).unwrap();
            let handled = process(&message, |k| bill(store, &tenant, k, &o))
                .await
                .expect("settled");
            seen.push((delivered(&message), handled.verdict, handled.disposition()));
            if handled.disposition() == Disposition::Ack || seen.len() > 6 {
                break;
            }
        }
        let secs = |s| Disposition::Nak(Some(Duration::from_secs(s)));
        assert_eq!(
            seen,
            [
                (1, Verdict::Failed, secs(1)),
                (2, Verdict::Failed, secs(2)),
                (3, Verdict::Failed, secs(4)),
                (4, Verdict::Executed, Disposition::Ack),
            ]
        );
        // The producer publishes the message again, after the window.
        stream.publish("f-1", json(&order("o-1", 250))).await;
        let message = next_delivery(&mut messages).await;
        let store = another_worker().await.unwrap();
        let o: Order = serde_json::from_slice(&message.payload).unwrap();
        let handled = process(&message, |k| bill(store, &tenant, k, &o))
            .await
            .expect("settled");
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Replayed, Disposition::Ack)
        );
        assert_eq!(handled.result.unwrap().unwrap(), 250);
        assert_eq!(
            ledger(&tenant, |l| (l.begun, l.effects.clone())),
            (4, vec![250])
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while !settled(&consumer).await {
            assert!(Instant::now() < deadline, "the message was settled");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 90 s");
}

// ---------------------------------------------------------------- the tenant from a header

const TENANT_HEADER: &str = "X-Tenant";

fn tenant_of(message: &jetstream::Message) -> String {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(TENANT_HEADER))
        .map_or(String::new(), |v| v.as_str().to_owned())
}

/// One message id from three tenants named in a header (the third differs
/// from the first only in case), each published after the duplicate window:
/// three records, each tenant billed its own amount and answered with it
/// (never the first tenant's answer replayed, never a mismatch with it).
/// Then the first tenant's retry replays its own answer, and its reuse of
/// the id with another amount is its own poison message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_message_id_from_tenants_in_a_header_is_answered_per_tenant() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    if pg_store_or_skip().await.is_none() {
        return;
    }
    tokio::time::timeout(Duration::from_secs(90), async {
        let acme = format!("acme-{}", uuid::Uuid::new_v4().simple());
        let globex = format!("globex-{}", uuid::Uuid::new_v4().simple());
        let acme_upper = acme.to_uppercase();
        let stream = TestStream::create(&js, "HUNT_TENANTS").await;
        let consumer = stream.durable("billing", Duration::from_secs(30)).await;
        let mut messages = pulled_in_turn(&consumer, 1);
        let sent: [(&str, u64); 5] = [
            (&acme, 100),
            (&globex, 200),
            (&acme_upper, 300),
            (&acme, 100),
            (&acme, 999),
        ];
        let mut seen = Vec::new();
        for (tenant, amount) in sent {
            stream
                .publish_with_header(
                    "order-1",
                    Some((TENANT_HEADER, tenant)),
                    json(&order("o-1", amount)),
                )
                .await;
            let message = next_delivery(&mut messages).await;
            let store = another_worker().await.unwrap();
            let o: Order = serde_json::from_slice(&message.payload).unwrap();
            let t = tenant_of(&message);
            assert_eq!(t, tenant, "the header as sent");
            let handled = process(&message, |k| bill(store, &t, k, &o))
                .await
                .expect("settled");
            let answer = match handled.result {
                Some(Ok(v)) => Some(v),
                _ => None,
            };
            seen.push((handled.verdict, handled.disposition(), answer));
        }
        assert_eq!(
            seen,
            [
                (Verdict::Executed, Disposition::Ack, Some(100)),
                (Verdict::Executed, Disposition::Ack, Some(200)),
                (Verdict::Executed, Disposition::Ack, Some(300)),
                (Verdict::Replayed, Disposition::Ack, Some(100)),
                (Verdict::Mismatch, Disposition::Term, None),
            ]
        );
        for (tenant, effects) in [(&acme, [100]), (&globex, [200]), (&acme_upper, [300])] {
            assert_eq!(ledger(tenant, |l| l.effects.clone()), effects, "{tenant}");
            let store = another_worker().await.unwrap();
            let record = store
                .fetch(&Identity::new(tenant.as_str(), SCOPE, "order-1").unwrap())
                .await
                .unwrap()
                .expect("a record per tenant");
            assert_eq!(record.state, RecordState::Complete);
        }
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 90 s");
}

// ---------------------------------------------------------------- a body longer than ack_wait, default wait

/// A body that outlives the consumer's 1 s `ack_wait`, under the attribute's
/// default `in_progress = wait("10s")`: the redelivery (on another store
/// object; the body is let go once it has arrived, so its call finds the
/// body running and waits, or finds it just done) replays the body's answer
/// instead of running it again; both deliveries are acked, one effect, and
/// the message is settled (any later redelivery only replays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_longer_than_ack_wait_is_waited_for_and_replayed_by_its_redelivery() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    if pg_store_or_skip().await.is_none() {
        return;
    }
    tokio::time::timeout(Duration::from_secs(90), async {
        let tenant = fresh_tenant();
        let (entered, gate) = ledger(&tenant, |l| {
            l.gated = true;
            (l.entered.clone(), l.gate.clone())
        });
        let stream = TestStream::create(&js, "HUNT_LONGBODY").await;
        let consumer = stream.durable("billing", Duration::from_secs(1)).await;
        let mut messages = pulled_in_turn(&consumer, 1);
        stream.publish("l-1", json(&order("o-1", 40))).await;
        let deliver = |message: jetstream::Message| {
            let tenant = tenant.clone();
            tokio::spawn(async move {
                let store = another_worker().await.unwrap();
                let o: Order = serde_json::from_slice(&message.payload).unwrap();
                let handled = process(&message, |k| bill_waiting(store, &tenant, k, &o))
                    .await
                    .expect("settled");
                (delivered(&message), handled.verdict, handled.disposition())
            })
        };
        let first = deliver(next_delivery(&mut messages).await);
        let _entered = entered.acquire().await.unwrap();
        // The redelivery, after the first delivery's ack_wait ran out.
        let second = next_delivery(&mut messages).await;
        assert_eq!(delivered(&second), 2);
        let second = deliver(second);
        gate.add_permits(1);
        let first = first.await.unwrap();
        let second = second.await.unwrap();
        assert_eq!(first, (1, Verdict::Executed, Disposition::Ack));
        assert_eq!(second, (2, Verdict::Replayed, Disposition::Ack));
        // Later redeliveries (if the acks came after another ack_wait) replay.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !settled(&consumer).await {
            assert!(Instant::now() < deadline, "the message was settled");
            if let Ok(Some(Ok(m))) =
                tokio::time::timeout(Duration::from_millis(200), messages.next()).await
            {
                let (_, verdict, _) = deliver(m).await.unwrap();
                assert_eq!(verdict, Verdict::Replayed);
            }
        }
        assert_eq!(
            ledger(&tenant, |l| (l.begun, l.effects.clone())),
            (1, vec![40])
        );
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 90 s");
}

// ---------------------------------------------------------------- a store outage while a message is in flight

/// A short lease, so that an outage can outlast it.
#[idempotent(scope = "nats.hunt.outage", key = msg_id, tenant = tenant, store = store,
             in_progress = reject, lease = "3s")]
async fn bill_short_lease(
    store: &dyn Store,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, HuntError> {
    body(tenant, order).await
}

/// `host:port` of a server URL.
fn host_port(url: &str) -> String {
    let after = url.split_once('@').map_or(url, |(_, a)| a);
    let after = after.split_once("://").map_or(after, |(_, a)| a);
    after.split('/').next().expect("host").to_owned()
}

/// PostgreSQL goes away (a fault proxy cuts every connection of the first
/// worker's store) while a delivery's body runs: the body's answer cannot be
/// recorded, so the delivery is nak'd as failed (neither acked as done nor
/// terminated). Its redeliveries, handled on other store objects of this
/// process, are nak'd while the record is still in progress and then
/// answered with that body's answer: the body ran once, and the message is
/// acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_mid_body_naks_the_delivery_and_its_redelivery_replays_the_answer() {
    store_outage_mid_body(Outage::Cut).await;
}

/// The same, with the first worker's store still cut off when the record's
/// lease runs out: the redelivery takes the record over, and the answer this
/// process holds is recorded and replayed (README, "When a lease runs out or
/// the store fails mid-call"), not the body run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_longer_than_the_lease_still_runs_the_body_once() {
    store_outage_mid_body(Outage::CutPastTheLease).await;
}

/// The server goes silent instead (every byte held, nothing closed) under
/// `process_with_progress` on a 1 s `ack_wait`: the call gives the silent
/// connection up (a 2 s bound here), so the delivery is answered, nak'd as
/// failed, rather than kept by its progress for as long as the silence
/// lasts; the message is then answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_store_mid_body_does_not_hold_a_delivery_kept_by_progress() {
    store_outage_mid_body(Outage::Silent).await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outage {
    /// Every connection cut, back once the first delivery answered.
    Cut,
    /// Every connection cut until the redeliveries are done.
    CutPastTheLease,
    /// Every byte held until the first delivery answered.
    Silent,
}

async fn store_outage_mid_body(outage: Outage) {
    let outlasts_lease = outage == Outage::CutPastTheLease;
    let Some(js) = nats_or_skip().await else {
        return;
    };
    if pg_store_or_skip().await.is_none() {
        return;
    }
    tokio::time::timeout(Duration::from_secs(90), async {
        let url = common::servers::pg_url();
        let proxy = common::proxy::FaultProxy::start(&host_port(&url))
            .await
            .expect("proxy");
        let through = url.replacen(&host_port(&url), &format!("127.0.0.1:{}", proxy.port()), 1);
        let proxied: &'static PgStore = Box::leak(Box::new(
            PgStore::connect(&through)
                .await
                .expect("proxied")
                .with_silent_connection_timeout(Duration::from_secs(2)),
        ));
        let tenant = fresh_tenant();
        let (entered, gate) = ledger(&tenant, |l| {
            l.gated = true;
            (l.entered.clone(), l.gate.clone())
        });
        let stream = TestStream::create(&js, "HUNT_OUTAGE").await;
        let ack_wait = if outage == Outage::Silent { 1 } else { 30 };
        let consumer = stream
            .durable("billing", Duration::from_secs(ack_wait))
            .await;
        let mut messages = pulled_in_turn(&consumer, 1);
        stream.publish("s-1", json(&order("o-1", 75))).await;

        let message = next_delivery(&mut messages).await;
        let first = {
            let tenant = tenant.clone();
            tokio::spawn(async move {
                let o: Order = serde_json::from_slice(&message.payload).unwrap();
                let handler = |k| bill_short_lease(proxied, &tenant, k, &o);
                let every = Duration::from_millis(300);
                let handled = if outage == Outage::Silent {
                    process_with_progress(&message, every, handler).await
                } else {
                    process(&message, handler).await
                }
                .expect("settled");
                (handled.verdict, handled.disposition())
            })
        };
        let _entered = entered.acquire().await.unwrap();
        if outage == Outage::Silent {
            proxy.stall(common::proxy::Stall::Both);
        } else {
            proxy.go_down();
        }
        gate.add_permits(1);
        let first = first.await.unwrap();
        if !outlasts_lease {
            proxy.pass_through();
            proxy.release_stall();
        }
        assert_eq!(
            first,
            (
                Verdict::Failed,
                Disposition::Nak(Some(Duration::from_secs(1)))
            ),
            "an answer that could not be recorded is neither acked nor terminated"
        );

        let mut later = Vec::new();
        loop {
            let message = next_delivery(&mut messages).await;
            let store = another_worker().await.unwrap();
            let o: Order = serde_json::from_slice(&message.payload).unwrap();
            let handled = process(&message, |k| bill_short_lease(store, &tenant, k, &o))
                .await
                .expect("settled");
            let answer = match handled.result {
                Some(Ok(v)) => Some(v),
                _ => None,
            };
            later.push((handled.verdict, handled.disposition(), answer));
            if matches!(handled.disposition(), Disposition::Ack | Disposition::Term)
                || later.len() > 20
            {
                break;
            }
        }
        proxy.pass_through();
        println!("after the outage ({outage:?}): {later:?}");
        let (verdict, disposition, answer) = *later.last().unwrap();
        assert!(
            matches!(verdict, Verdict::Replayed | Verdict::Executed),
            "{later:?}"
        );
        assert_eq!(
            (disposition, answer),
            (Disposition::Ack, Some(75)),
            "{later:?}"
        );
        assert!(
            later[..later.len() - 1].iter().all(|(v, d, _)| matches!(
                v,
                Verdict::InProgress { .. } | Verdict::Failed
            ) && matches!(
                d,
                Disposition::Nak(Some(_))
            )),
            "{later:?}"
        );
        assert_eq!(
            ledger(&tenant, |l| (l.begun, l.effects.clone())),
            (1, vec![75]),
            "the body ran once: {later:?}"
        );
        drop(messages);
        stream.delete().await;
    })
    .await
    .expect("finished within 90 s");
}
