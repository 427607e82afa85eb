//! Message consumers on NATS JetStream (`idempotent_runtime::consumer`).
//!
//! * `mapping_*`: how each answer of a real `#[idempotent]` handler maps to a
//!   disposition (no broker needed; MemoryStore).
//! * `jetstream_full_loop_*`: one consumer on the real JetStream server and a
//!   SQLite file: every mapping end to end, including what the server does next
//!   (a nak'd message comes back, a term'd one never does).
//! * `redelivery_storm_*`: two worker processes (`tests/bin/nats_consumer_worker.rs`)
//!   share one durable consumer with a 1 s `ack_wait`, messages are published
//!   twice, some fail, some lose their ack, some outlive `ack_wait`, and one
//!   worker is SIGKILLed in its third body: exactly one effect per message id
//!   (transactional mode on PostgreSQL, and on MariaDB in a database of the
//!   test's own; store mode on a shared SQLite file, where the killed
//!   bodies' effects are found by the scope's recover hook on takeover).
//! * other `jetstream_*`: a newer version's running record, a silent server,
//!   tenants from subjects, ack policies.
//! * `two_consumers_*`: two durables of one stream with two scopes each process
//!   every message once (two records per message id, never one); a third
//!   durable that shares billing's scope shows the silent skip.
//!
//! Every test has its own stream, durables and tenant, and deletes its stream
//! (and its rows) at the end. NATS is found at `IDEMPOTENT_NATS_URL`
//! (default `nats://127.0.0.1:4222`), PostgreSQL at `IDEMPOTENT_PG_URL`.

use crate::common;

use async_nats::jetstream::{self, consumer::pull, consumer::PullConsumer, stream};
use common::servers::{fresh_tenant, mysql_url, nats_or_skip, nats_url, pg_store_or_skip, pg_url};
use futures_util::StreamExt;
use idempotent_runtime::consumer::nats::{message_key, process};
use idempotent_runtime::consumer::{handle, Disposition, Verdict};
use idempotent_runtime::{idempotent, Error, MemoryStore, PgStore, SqliteStore, Store};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::Semaphore;
use tokio::time::Instant;

const WORKER: &str = env!("CARGO_BIN_EXE_idempotent-nats-worker");

// ---------------------------------------------------------------- the mapping, through real handlers

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Order {
    order_id: String,
    amount_cents: u64,
}

pub(crate) fn order(id: &str, amount_cents: u64) -> Order {
    Order {
        order_id: id.into(),
        amount_cents,
    }
}

#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
pub(crate) enum BillError {
    #[error("the ledger is down")]
    LedgerDown,
    #[error("{0}")]
    #[serde(skip)]
    Idempotency(#[from] Error),
}

impl idempotent_runtime::consumer::AsIdempotencyError for BillError {
    fn as_idempotency_error(&self) -> Option<&Error> {
        match self {
            BillError::Idempotency(e) => Some(e),
            BillError::LedgerDown => None,
        }
    }
}

/// A handler for the mapping tests: counts its effects, fails while `down`,
/// and (when gated) says it has entered the body, then waits for the gate.
struct Ledger {
    store: MemoryStore,
    effects: AtomicUsize,
    down: std::sync::atomic::AtomicBool,
    entered: Semaphore,
    gate: Option<Semaphore>,
}

impl Ledger {
    fn new(gated: bool) -> Self {
        Ledger {
            store: MemoryStore::new(),
            effects: AtomicUsize::new(0),
            down: false.into(),
            entered: Semaphore::new(0),
            gate: gated.then(|| Semaphore::new(0)),
        }
    }

    #[idempotent(scope = "nats.mapping.billing", key = msg_id, tenant = shared, store = self.store,
                 in_progress = reject, lease = "5s")]
    async fn bill(&self, msg_id: &str, order: &Order) -> Result<u64, BillError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(BillError::LedgerDown);
        }
        self.entered.add_permits(1);
        if let Some(gate) = &self.gate {
            let _ = tokio::time::timeout(Duration::from_secs(20), gate.acquire()).await;
        }
        self.effects.fetch_add(1, Ordering::SeqCst);
        Ok(order.amount_cents)
    }

    /// An annotated function whose body calls `bill`.
    #[idempotent(scope = "nats.mapping.billing_outer", key = msg_id, tenant = shared,
                 store = self.store, in_progress = reject)]
    async fn bill_through_outer(&self, msg_id: &str, order: &Order) -> Result<u64, BillError> {
        self.bill(msg_id, order).await
    }

    /// A result JSON cannot hold (`NaN`): never recordable.
    #[idempotent(scope = "nats.mapping.ratios", key = msg_id, tenant = shared, store = self.store,
                 in_progress = reject)]
    async fn ratio(&self, msg_id: &str, order: &Order) -> Result<f64, BillError> {
        self.effects.fetch_add(1, Ordering::SeqCst);
        let _ = order;
        Ok(f64::NAN)
    }

    /// `errors = record`: a declined order's error is its final answer.
    #[idempotent(scope = "nats.mapping.declines", key = msg_id, tenant = shared, store = self.store,
                 in_progress = reject, errors = record)]
    async fn decline(&self, msg_id: &str, order: &Order) -> Result<u64, BillError> {
        self.effects.fetch_add(1, Ordering::SeqCst);
        let _ = order;
        Err(BillError::LedgerDown)
    }
}

#[tokio::test]
async fn mapping_executed_and_replayed_are_acked_with_one_effect() {
    let ledger = Ledger::new(false);
    let o = order("o-1", 100);
    let first = handle(Some("m-1"), |k| ledger.bill(k, &o)).await;
    let again = handle(Some("m-1"), |k| ledger.bill(k, &o)).await;
    assert_eq!(
        (first.verdict, first.disposition()),
        (Verdict::Executed, Disposition::Ack)
    );
    assert_eq!(
        (again.verdict, again.disposition()),
        (Verdict::Replayed, Disposition::Ack)
    );
    assert_eq!(again.result.unwrap().unwrap(), 100);
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

/// Handles a delivery of `msg_id` with `o` on a task of its own and returns
/// once its body runs (holding the record, at the gate of the gated
/// `ledger`): the task answers the delivery's verdict.
async fn delivery_running(
    ledger: &Arc<Ledger>,
    msg_id: &'static str,
    o: Order,
) -> tokio::task::JoinHandle<Verdict> {
    let running = {
        let ledger = ledger.clone();
        tokio::spawn(async move { handle(Some(msg_id), |k| ledger.bill(k, &o)).await.verdict })
    };
    tokio::time::timeout(Duration::from_secs(20), ledger.entered.acquire())
        .await
        .expect("the first delivery's body started")
        .expect("the semaphore is open")
        .forget();
    running
}

#[tokio::test]
async fn mapping_in_progress_is_nakd_with_the_retry_after() {
    let ledger = Arc::new(Ledger::new(true));
    let o = order("o-2", 200);
    // Once the first delivery's body runs (it holds the record), the duplicate arrives.
    let running = delivery_running(&ledger, "m-2", o.clone()).await;
    let duplicate = handle(Some("m-2"), |k| ledger.bill(k, &o)).await;
    let Disposition::Nak(Some(delay)) = duplicate.disposition() else {
        panic!("expected nak with a delay, got {:?}", duplicate.verdict);
    };
    assert!(
        delay > Duration::ZERO && delay <= Duration::from_secs(5),
        "{delay:?}"
    );
    ledger.gate.as_ref().unwrap().add_permits(1);
    assert_eq!(running.await.unwrap(), Verdict::Executed);
    let later = handle(Some("m-2"), |k| ledger.bill(k, &o)).await;
    assert_eq!(later.disposition(), Disposition::Ack);
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

/// A delivery whose arguments fingerprint otherwise than those of a delivery
/// of the same message still running (a rolling deploy that changed the
/// handler's argument type; here another amount stands for it) is nak'd
/// until that one's lease would end, not terminated: the running delivery
/// may yet fail and release the key, and then nobody would process the
/// message. Once the record is complete, the mismatch is poison (term).
#[tokio::test]
async fn mapping_mismatch_with_a_delivery_still_running_is_nakd_not_termed() {
    let ledger = Arc::new(Ledger::new(true));
    let running = delivery_running(&ledger, "m-9", order("o-9", 900)).await;
    let other_arguments = order("o-9", 901);
    let other_version = handle(Some("m-9"), |k| ledger.bill(k, &other_arguments)).await;
    match (other_version.verdict, other_version.disposition()) {
        (Verdict::InProgress { retry_after }, Disposition::Nak(Some(delay))) => {
            assert_eq!(retry_after, delay);
            assert!(
                delay > Duration::ZERO && delay <= Duration::from_secs(5),
                "{delay:?}"
            );
        }
        other => panic!("expected a nak until the running delivery's lease ends, got {other:?}"),
    }
    assert!(matches!(
        other_version.idempotency_error(),
        Some(Error::FingerprintMismatch(_))
    ));
    ledger.gate.as_ref().unwrap().add_permits(1);
    assert_eq!(running.await.unwrap(), Verdict::Executed);
    let after = handle(Some("m-9"), |k| ledger.bill(k, &other_arguments)).await;
    assert_eq!(
        (after.verdict, after.disposition()),
        (Verdict::Mismatch, Disposition::Term)
    );
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

/// Plants a record of `fingerprint` whose 1 ms lease has run out (an owner
/// that died mid-body), as the store's clock tells.
async fn plant_abandoned(
    ledger: &Ledger,
    identity: &idempotent_runtime::Identity,
    fingerprint: &idempotent_runtime::Fingerprint,
) {
    common::records::acquire(
        &ledger.store,
        identity,
        Some(fingerprint),
        Duration::from_millis(1),
        Duration::from_secs(3600),
    )
    .await;
    let lapsed = async {
        loop {
            match ledger.store.fetch(identity).await.unwrap() {
                Some(r) if r.lease_expires_at_ms.is_some_and(|ends| ends < r.now_ms) => break,
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), lapsed)
        .await
        .expect("the planted lease runs out");
}

/// A mismatch with a record left in progress by a delivery whose process
/// died (its lease ran out before it answered) is not terminated at once:
/// that message's own redelivery, perhaps to the older version in a rolling
/// deploy, may yet take the record over and finish it. It is nak'd for a
/// grace counted from when the record was abandoned, whatever the delivery
/// count (deliveries spent while the owner lived do not use it up); nothing
/// runs.
#[tokio::test]
async fn mapping_mismatch_with_an_abandoned_record_is_nakd_before_it_is_termed() {
    let ledger = Ledger::new(false);
    let identity = idempotent_runtime::Identity::shared("nats.mapping.billing", "m-13").unwrap();
    let other_arguments = idempotent_runtime::Fingerprint::from_stored(format!(
        "v2:{}",
        "0123456789abcdef".repeat(4)
    ));
    plant_abandoned(&ledger, &identity, &other_arguments).await;
    let before = ledger
        .store
        .fetch(&identity)
        .await
        .unwrap()
        .map(|r| (r.state, r.fingerprint));

    let payload = order("o-13", 1300);
    let redelivered = handle(Some("m-13"), |k| ledger.bill(k, &payload)).await;
    assert!(
        matches!(
            redelivered.verdict,
            Verdict::MismatchWithAbandonedRecord { abandoned_for }
                if abandoned_for < idempotent_runtime::consumer::ABANDONED_RECORD_GRACE
        ),
        "{:?}",
        redelivered.verdict
    );
    assert!(matches!(
        redelivered.idempotency_error(),
        Some(Error::FingerprintMismatch(_))
    ));
    assert!(matches!(
        redelivered.disposition(),
        Disposition::Nak(Some(_))
    ));
    // Delivered many times before (while its owner was alive): still nak'd.
    let late = handle(Some("m-13"), |k| ledger.bill(k, &payload))
        .await
        .with_deliveries(idempotent_runtime::consumer::DELIVERIES_BEFORE_TERM + 2);
    assert!(
        matches!(late.disposition(), Disposition::Nak(Some(_))),
        "{:?}",
        late.disposition()
    );
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 0, "nothing ran");
    assert_eq!(
        ledger
            .store
            .fetch(&identity)
            .await
            .unwrap()
            .map(|r| (r.state, r.fingerprint)),
        before,
        "the abandoned record is untouched, for its own delivery to take over"
    );
}

/// The same through an annotated function whose body calls the refused
/// one: the outer call, finishing after the inner one, does not hide that
/// the inner record is still running.
#[tokio::test]
async fn mapping_mismatch_with_a_running_record_inside_another_call_is_nakd() {
    let ledger = Arc::new(Ledger::new(true));
    let running = delivery_running(&ledger, "m-12", order("o-12", 1200)).await;
    let other_arguments = order("o-12", 1201);
    let nested = handle(Some("m-12"), |k| {
        ledger.bill_through_outer(k, &other_arguments)
    })
    .await;
    assert!(
        matches!(nested.verdict, Verdict::InProgress { .. }),
        "{:?}",
        nested.verdict
    );
    // The same when the handler looks at the outcome itself: its own
    // `with_outcome` scope reports to the delivery's whole.
    let looked_at = handle(Some("m-12"), |k| async {
        let (result, _outcome) =
            idempotent_runtime::with_outcome(ledger.bill_through_outer(k, &other_arguments)).await;
        result
    })
    .await;
    assert!(
        matches!(looked_at.verdict, Verdict::InProgress { .. }),
        "{:?}",
        looked_at.verdict
    );
    ledger.gate.as_ref().unwrap().add_permits(1);
    assert_eq!(running.await.unwrap(), Verdict::Executed);
}

/// A record a newer version of the crate is still running (a rolling deploy:
/// the newer instance holds this very message, its lease renewed) refuses an
/// older instance's delivery as `RecordedByNewerVersion`. While it runs, the
/// delivery is nak'd until its lease ends, as for a mismatch with a running
/// record, however often the message was delivered meanwhile (a body longer
/// than `ack_wait` spends deliveries): terminating it would end the message
/// itself, and if the newer instance's body then fails and releases the key,
/// nobody processes the message.
#[tokio::test]
async fn mapping_a_newer_versions_running_record_is_nakd_not_termed() {
    let ledger = Ledger::new(false);
    let identity = idempotent_runtime::Identity::shared("nats.mapping.billing", "m-21").unwrap();
    let newer = idempotent_runtime::Fingerprint::from_stored(format!(
        "v99:{}",
        "0123456789abcdef".repeat(4)
    ));
    let token = common::records::acquire(
        &ledger.store,
        &identity,
        Some(&newer),
        Duration::from_secs(3600),
        Duration::from_secs(3600),
    )
    .await;
    let payload = order("o-21", 2100);
    for deliveries in [1, idempotent_runtime::consumer::DELIVERIES_BEFORE_TERM + 3] {
        let redelivered = handle(Some("m-21"), |k| ledger.bill(k, &payload))
            .await
            .with_deliveries(deliveries);
        assert!(
            matches!(
                redelivered.idempotency_error(),
                Some(Error::RecordedByNewerVersion { .. })
            ),
            "{:?}",
            redelivered.result
        );
        match (redelivered.verdict, redelivered.disposition()) {
            (Verdict::InProgress { retry_after }, Disposition::Nak(Some(delay))) => {
                assert_eq!(retry_after, delay);
                // At most the call's own lease (5 s), however long the planted one.
                assert!(delay <= Duration::from_secs(5), "{delay:?}");
            }
            other => panic!(
                "delivery {deliveries}: expected a nak while the newer version runs, got {other:?}"
            ),
        }
    }
    // The newer instance's body fails: the key is released, and the next
    // delivery (here, to this older instance) processes the message.
    assert_eq!(
        ledger.store.release(&identity, &token).await.unwrap(),
        idempotent_runtime::Fenced::Written
    );
    let after = handle(Some("m-21"), |k| ledger.bill(k, &payload))
        .await
        .with_deliveries(idempotent_runtime::consumer::DELIVERIES_BEFORE_TERM + 4);
    assert_eq!(
        (after.verdict, after.disposition()),
        (Verdict::Executed, Disposition::Ack)
    );
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

/// A newer version's record left in progress (its instance died mid-body,
/// after the message had been delivered many times while it ran: a body
/// longer than `ack_wait`) is not terminated at the next delivery of an
/// older instance: as for an abandoned record of other arguments, its grace
/// runs from when its lease ran out, for the message's redelivery to reach a
/// newer instance that takes it over.
#[tokio::test]
async fn mapping_a_newer_versions_abandoned_record_is_nakd_before_it_is_termed() {
    let ledger = Ledger::new(false);
    let identity = idempotent_runtime::Identity::shared("nats.mapping.billing", "m-22").unwrap();
    let newer = idempotent_runtime::Fingerprint::from_stored(format!(
        "v99:{}",
        "0123456789abcdef".repeat(4)
    ));
    plant_abandoned(&ledger, &identity, &newer).await;
    let payload = order("o-22", 2200);
    let late = handle(Some("m-22"), |k| ledger.bill(k, &payload))
        .await
        .with_deliveries(idempotent_runtime::consumer::DELIVERIES_BEFORE_TERM + 10);
    assert!(
        matches!(
            late.idempotency_error(),
            Some(Error::RecordedByNewerVersion { .. })
        ),
        "{:?}",
        late.result
    );
    assert!(
        matches!(late.disposition(), Disposition::Nak(Some(_))),
        "just abandoned, delivered many times while it ran: {:?} -> {:?}",
        late.verdict,
        late.disposition()
    );
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 0, "nothing ran");
}

#[idempotent(scope = "nats.mapping.tx_declines", key = msg_id, tenant = shared, tx = tx,
             skip(runs), in_progress = reject, errors = record)]
async fn decline_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    runs: &AtomicUsize,
    msg_id: &str,
    order: &Order,
) -> Result<u64, BillError> {
    runs.fetch_add(1, Ordering::SeqCst);
    let _ = order;
    Err(BillError::LedgerDown)
}

/// Transactional mode with `errors = record`: the recorded error is written in
/// the caller's transaction, so a handler that commits only on `Ok` (`?` on
/// the call, then `commit`) rolls it back: the error is never final, every
/// delivery runs the body again and is nak'd. Committing for a
/// recorded error too (not for the framework's refusals) makes the
/// redelivery replay it and ack.
#[tokio::test]
async fn mapping_a_recorded_error_in_a_transaction_needs_its_commit() {
    let dir = crate::common::scratch::dir("nats-txrec");
    let url = format!("sqlite://{}?mode=rwc", dir.join("txrec.db").display());
    let pool = SqliteStore::connect(&url).await.unwrap().pool().clone();
    let o = order("o-t", 1);

    // `?` on the call: the recorded error goes with the rollback.
    let runs = AtomicUsize::new(0);
    let mut verdicts = Vec::new();
    for _delivery in 0..3 {
        let handled = handle(Some("m-t1"), |k| async {
            let mut tx = pool.begin().await.unwrap();
            let r = decline_in(&mut tx, &runs, k, &o).await?;
            tx.commit().await.unwrap();
            Ok::<_, BillError>(r)
        })
        .await;
        verdicts.push(handled.verdict);
    }
    assert_eq!(verdicts, [Verdict::Failed; 3]);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "the body ran at every delivery"
    );

    // Committed for a recorded error: nak'd once, then replayed and acked.
    let runs = AtomicUsize::new(0);
    let mut verdicts = Vec::new();
    for _delivery in 0..3 {
        let handled = handle(Some("m-t2"), |k| async {
            let mut tx = pool.begin().await.unwrap();
            let r = decline_in(&mut tx, &runs, k, &o).await;
            if !matches!(r, Err(BillError::Idempotency(_))) {
                tx.commit().await.unwrap();
            }
            r
        })
        .await;
        verdicts.push((handled.verdict, handled.disposition()));
    }
    assert_eq!(
        verdicts,
        [
            (Verdict::Failed, Disposition::Nak(None)),
            (Verdict::Replayed, Disposition::Ack),
            (Verdict::Replayed, Disposition::Ack)
        ]
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    pool.close().await;
}

/// Bodies that entered, and the gate a held body waits at (never opened:
/// the held call is forgotten, as a process killed mid-body would leave it).
static DELIVERED_ENTERED: Semaphore = Semaphore::const_new(0);

#[idempotent(scope = "nats.mapping.delivered_fingerprinted", key = msg_id, tenant = shared,
             store = store, in_progress = reject, lease = "1s")]
async fn bill_counting_deliveries(
    store: &MemoryStore,
    msg_id: &str,
    order: &Order,
    delivered: i64,
) -> Result<u64, Error> {
    DELIVERED_ENTERED.add_permits(1);
    if delivered == 1 {
        std::future::pending::<()>().await;
    }
    Ok(order.amount_cents)
}

#[idempotent(scope = "nats.mapping.delivered_skipped", key = msg_id, tenant = shared,
             store = store, in_progress = reject, lease = "1s", skip(delivered))]
async fn bill_skipping_deliveries(
    store: &MemoryStore,
    msg_id: &str,
    order: &Order,
    delivered: i64,
) -> Result<u64, Error> {
    DELIVERED_ENTERED.add_permits(1);
    if delivered == 1 {
        std::future::pending::<()>().await;
    }
    Ok(order.amount_cents)
}

/// A handler that fingerprints the delivery's own metadata (its count, a
/// timestamp) makes every redelivery of one message a mismatch: after a
/// delivery that died mid-body, the message's own redelivery cannot take
/// its record over, is nak'd for the abandoned record's grace and then
/// terminated; the message is never processed. Skipped, the
/// redelivery takes the record over and runs.
#[tokio::test]
async fn mapping_fingerprinted_delivery_metadata_keeps_a_crashed_message_from_its_redelivery() {
    let o = order("o-d", 7);
    let mut verdicts = Vec::new();
    for skipped in [false, true] {
        let store = MemoryStore::new();
        let first = async {
            if skipped {
                bill_skipping_deliveries(&store, "m-d", &o, 1).await
            } else {
                bill_counting_deliveries(&store, "m-d", &o, 1).await
            }
        };
        let mut first = Box::pin(first);
        tokio::select! {
            _ = &mut first => panic!("the held body returned"),
            entered = DELIVERED_ENTERED.acquire() => entered.unwrap().forget(),
        }
        // The process dies mid-body: no release, no more heartbeats.
        std::mem::forget(first);
        let identity = idempotent_runtime::Identity::shared(
            if skipped {
                "nats.mapping.delivered_skipped"
            } else {
                "nats.mapping.delivered_fingerprinted"
            },
            "m-d",
        )
        .unwrap();
        let lapsed = async {
            loop {
                match store.fetch(&identity).await.unwrap() {
                    Some(r) if r.lease_expires_at_ms.is_some_and(|ends| ends < r.now_ms) => break,
                    _ => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), lapsed)
            .await
            .expect("the lease runs out");
        let redelivered = handle(Some("m-d"), |k| async {
            if skipped {
                bill_skipping_deliveries(&store, k, &o, 2).await
            } else {
                bill_counting_deliveries(&store, k, &o, 2).await
            }
        })
        .await
        .with_deliveries(2);
        verdicts.push(redelivered.verdict);
    }
    assert!(
        matches!(verdicts[0], Verdict::MismatchWithAbandonedRecord { .. }),
        "fingerprinted delivery count: {:?}",
        verdicts[0]
    );
    assert_eq!(
        verdicts[1],
        Verdict::Executed,
        "skipped: the redelivery takes over"
    );
}

/// Deliveries handled side by side in one task (a batch under `join!` /
/// `join_all`): each delivery's verdict sees only its own calls. Message A
/// replays a recorded error (acked); message B replays a result and then a
/// later step fails (nak'd), interleaved with A's replay. Were the report
/// scopes shared, B's failure would pass for a recorded answer and be acked,
/// and lost. (Held up.)
#[tokio::test]
async fn mapping_deliveries_joined_in_one_task_keep_their_verdicts_apart() {
    let ledger = Ledger::new(false);
    let (a, b) = (order("o-a", 1), order("o-b", 2));
    // Recorded before: A's declined answer, B's billed result.
    let _ = handle(Some("m-ja"), |k| ledger.decline(k, &a)).await;
    let _ = handle(Some("m-jb"), |k| ledger.bill(k, &b)).await;
    let a_replayed = Semaphore::new(0);
    let (a_handled, b_handled) = tokio::join!(
        handle(Some("m-ja"), |k| async {
            let r = ledger.decline(k, &a).await;
            a_replayed.add_permits(1);
            r
        }),
        handle(Some("m-jb"), |k| async {
            ledger.bill(k, &b).await?;
            // A later step fails, after A's replay has been reported.
            let _ = tokio::time::timeout(Duration::from_secs(10), a_replayed.acquire()).await;
            Err::<u64, _>(BillError::LedgerDown)
        }),
    );
    assert_eq!(
        (a_handled.verdict, a_handled.disposition()),
        (Verdict::Replayed, Disposition::Ack)
    );
    assert_eq!(
        (b_handled.verdict, b_handled.disposition()),
        (Verdict::Failed, Disposition::Nak(None))
    );
}

#[idempotent(scope = "nats.mapping.any_store", key = msg_id, tenant = tenant, store = store,
             in_progress = reject, lease = "5s")]
async fn bill_on(
    store: &dyn Store,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, Error> {
    Ok(order.amount_cents)
}

/// A newer version's record, running and abandoned, is told apart on every
/// real store (the lease end and the store's clock its read gives): nak'd
/// while it runs, nak'd for the grace once abandoned, however many
/// deliveries came before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mapping_a_newer_versions_record_is_judged_alike_on_every_store() {
    let dir = crate::common::scratch::dir("nats-stores");
    let sqlite = SqliteStore::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.join("stores.db").display()
    ))
    .await
    .unwrap();
    let mut stores: Vec<(&str, Box<dyn Store>)> = vec![("sqlite", Box::new(sqlite.clone()))];
    if let Some(pg) = pg_store_or_skip().await {
        stores.push(("postgres", Box::new(pg)));
    }
    if let Some(mysql) = common::servers::mysql_store_or_skip().await {
        stores.push(("mariadb", Box::new(mysql)));
    }
    let newer = idempotent_runtime::Fingerprint::from_stored(format!(
        "v99:{}",
        "0123456789abcdef".repeat(4)
    ));
    let o = order("o-s", 5);
    let late = idempotent_runtime::consumer::DELIVERIES_BEFORE_TERM + 3;
    for (name, store) in &stores {
        let store: &dyn Store = store.as_ref();
        let tenant = fresh_tenant();
        let running =
            idempotent_runtime::Identity::new(&tenant, "nats.mapping.any_store", "m-run").unwrap();
        let abandoned =
            idempotent_runtime::Identity::new(&tenant, "nats.mapping.any_store", "m-ab").unwrap();
        let hour = Duration::from_secs(3600);
        common::records::acquire(store, &running, Some(&newer), hour, hour).await;
        common::records::acquire(
            store,
            &abandoned,
            Some(&newer),
            Duration::from_millis(1),
            hour,
        )
        .await;
        let lapsed = async {
            loop {
                match store.fetch(&abandoned).await.unwrap() {
                    Some(r) if r.lease_expires_at_ms.is_some_and(|ends| ends < r.now_ms) => break,
                    _ => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), lapsed)
            .await
            .expect("the planted lease runs out");
        let on_running = handle(Some("m-run"), |k| bill_on(store, &tenant, k, &o))
            .await
            .with_deliveries(late);
        let on_abandoned = handle(Some("m-ab"), |k| bill_on(store, &tenant, k, &o))
            .await
            .with_deliveries(late);
        println!(
            "{name}: running -> {:?} {}, abandoned -> {:?} {}",
            on_running.verdict,
            on_running.disposition(),
            on_abandoned.verdict,
            on_abandoned.disposition()
        );
        assert!(
            matches!(on_running.verdict, Verdict::InProgress { retry_after } if retry_after <= Duration::from_secs(5)),
            "{name}: {:?}",
            on_running.verdict
        );
        assert!(
            matches!(
                on_abandoned.verdict,
                Verdict::MismatchWithAbandonedRecord { .. }
            ),
            "{name}: {:?}",
            on_abandoned.verdict
        );
        for handled in [&on_running, &on_abandoned] {
            assert!(
                matches!(handled.disposition(), Disposition::Nak(Some(_))),
                "{name}: {:?}",
                handled.disposition()
            );
        }
        for identity in [&running, &abandoned] {
            let _ = store.force_release(identity, false).await;
        }
    }
    sqlite.pool().close().await;
}

/// What a handler returns decides: a mismatch with a running record met by
/// an earlier step whose error the handler let go does not turn the later
/// step's mismatch with a complete record (poison) into a nak.
#[tokio::test]
async fn mapping_only_the_returned_mismatch_counts_for_the_verdict() {
    let (gated, plain) = (Arc::new(Ledger::new(true)), Ledger::new(false));
    let done = order("o-11", 1100);
    handle(Some("m-11"), |k| plain.bill(k, &done)).await;
    let running = delivery_running(&gated, "m-10", order("o-10", 1000)).await;
    let (optional, poison) = (order("o-10", 1001), order("o-11", 1101));
    let handled = handle(Some("m-10"), |k| {
        let (gated, plain, optional, poison) = (&gated, &plain, &optional, &poison);
        async move {
            let _ = gated.bill(k, optional).await; // running: let go
            plain.bill("m-11", poison).await // complete: returned
        }
    })
    .await;
    assert_eq!(
        (handled.verdict, handled.disposition()),
        (Verdict::Mismatch, Disposition::Term)
    );
    gated.gate.as_ref().unwrap().add_permits(1);
    assert_eq!(running.await.unwrap(), Verdict::Executed);
}

#[tokio::test]
async fn mapping_released_error_is_nakd_and_the_redelivery_runs() {
    let ledger = Ledger::new(false);
    let o = order("o-3", 300);
    ledger.down.store(true, Ordering::SeqCst);
    let failed = handle(Some("m-3"), |k| ledger.bill(k, &o)).await;
    assert_eq!(
        (failed.verdict, failed.disposition()),
        (Verdict::Failed, Disposition::Nak(None))
    );
    ledger.down.store(false, Ordering::SeqCst);
    let retry = handle(Some("m-3"), |k| ledger.bill(k, &o)).await;
    assert_eq!(
        (retry.verdict, retry.disposition()),
        (Verdict::Executed, Disposition::Ack)
    );
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn mapping_mismatch_missing_and_invalid_keys_are_termed() {
    let ledger = Ledger::new(false);
    let (sent, resent) = (order("o-4", 400), order("o-4", 99_999));
    let first = handle(Some("m-4"), |k| ledger.bill(k, &sent)).await;
    assert_eq!(first.disposition(), Disposition::Ack);
    let poison = handle(Some("m-4"), |k| ledger.bill(k, &resent)).await;
    assert_eq!(
        (poison.verdict, poison.disposition()),
        (Verdict::Mismatch, Disposition::Term)
    );
    assert!(matches!(
        poison.idempotency_error(),
        Some(Error::FingerprintMismatch(_))
    ));

    let called = AtomicUsize::new(0);
    let other = order("o-5", 1);
    let no_key = handle(None, |k| {
        called.fetch_add(1, Ordering::SeqCst);
        ledger.bill(k, &other)
    })
    .await;
    assert_eq!(
        (no_key.verdict, no_key.disposition()),
        (Verdict::MissingKey, Disposition::Term)
    );
    assert_eq!(
        called.load(Ordering::SeqCst),
        0,
        "a message without a key is never processed"
    );

    for bad in ["", "line\nbreak"] {
        let h = handle(Some(bad), |k| ledger.bill(k, &other)).await;
        assert_eq!(
            (h.verdict, h.disposition()),
            (Verdict::InvalidKey, Disposition::Term)
        );
    }
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

/// The body ran but its result can never be recorded: the key was released,
/// so a redelivery would run the body again (in a tight loop, as long as
/// redeliveries come). The message is terminated as poison after one run.
#[tokio::test]
async fn mapping_an_unrecordable_result_is_termed_after_one_run() {
    let ledger = Ledger::new(false);
    let o = order("o-8", 800);
    let h = handle(Some("m-8"), |k| ledger.ratio(k, &o)).await;
    assert_eq!(
        (h.verdict, h.disposition()),
        (Verdict::Unrecordable, Disposition::Term)
    );
    assert!(matches!(
        h.idempotency_error(),
        Some(Error::ResultNotFaithful { .. })
    ));
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn mapping_recorded_error_is_nakd_once_then_acked() {
    let ledger = Ledger::new(false);
    let o = order("o-7", 700);
    let first = handle(Some("m-7"), |k| ledger.decline(k, &o)).await;
    // The first execution of a recorded error looks like a released one...
    assert_eq!(first.disposition(), Disposition::Nak(None));
    // ...and its redelivery replays the final answer: acked, no second effect.
    let again = handle(Some("m-7"), |k| ledger.decline(k, &o)).await;
    assert_eq!(
        (again.verdict, again.disposition()),
        (Verdict::Replayed, Disposition::Ack)
    );
    assert!(matches!(again.result, Some(Err(BillError::LedgerDown))));
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

/// An argument whose `Serialize` always fails, as a raw JSON payload with a
/// repeated member does: it can never be fingerprinted.
struct Unfingerprintable;

impl Serialize for Unfingerprintable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("a repeated member"))
    }
}

#[idempotent(scope = "nats.mapping.raw", key = msg_id, tenant = shared, store = store, skip(effects),
             in_progress = reject)]
async fn raw_payload(
    store: &MemoryStore,
    effects: &AtomicUsize,
    msg_id: &str,
    payload: &Unfingerprintable,
) -> Result<u64, Error> {
    let _ = payload;
    Ok(effects.fetch_add(1, Ordering::SeqCst) as u64)
}

/// Every delivery of a payload that cannot be fingerprinted fails alike:
/// terminated, not nak'd for ever, and the body never runs.
#[tokio::test]
async fn mapping_a_payload_that_cannot_be_fingerprinted_is_termed() {
    let (store, effects) = (MemoryStore::new(), AtomicUsize::new(0));
    let h = handle(Some("m-raw"), |k| {
        raw_payload(&store, &effects, k, &Unfingerprintable)
    })
    .await;
    assert_eq!(
        (h.verdict, h.disposition()),
        (Verdict::Unfingerprintable, Disposition::Term)
    );
    assert!(matches!(
        h.idempotency_error(),
        Some(Error::Fingerprint { .. })
    ));
    assert_eq!(effects.load(Ordering::SeqCst), 0);
}

/// The receipt a later version of the handler returns, under the same scope.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    amount_cents: u64,
    ledger_entry: String,
}

#[idempotent(scope = "nats.mapping.receipts", key = msg_id, tenant = shared, store = store,
             in_progress = reject, shared_scope, skip(effects))]
async fn receipt_v1(
    store: &MemoryStore,
    effects: &AtomicUsize,
    msg_id: &str,
) -> Result<u64, Error> {
    effects.fetch_add(1, Ordering::SeqCst);
    Ok(500)
}

#[idempotent(scope = "nats.mapping.receipts", key = msg_id, tenant = shared, store = store,
             in_progress = reject, shared_scope, skip(effects))]
async fn receipt_v2(
    store: &MemoryStore,
    effects: &AtomicUsize,
    msg_id: &str,
) -> Result<Receipt, Error> {
    effects.fetch_add(1, Ordering::SeqCst);
    Ok(Receipt {
        amount_cents: 500,
        ledger_entry: "e-1".into(),
    })
}

/// A message processed by the old version of a handler, delivered again to a
/// new version whose result type changed: its recorded answer no longer
/// decodes, so no delivery can ever succeed while the record lasts (and once
/// it expired, a redelivery would run the body a second time). Terminated,
/// with the one effect.
#[tokio::test]
async fn mapping_a_recorded_answer_that_no_longer_decodes_is_termed() {
    let (store, effects) = (MemoryStore::new(), AtomicUsize::new(0));
    let first = handle(Some("m-v"), |k| receipt_v1(&store, &effects, k)).await;
    assert_eq!(first.disposition(), Disposition::Ack);
    let after_deploy = handle(Some("m-v"), |k| receipt_v2(&store, &effects, k)).await;
    assert_eq!(
        (after_deploy.verdict, after_deploy.disposition()),
        (Verdict::ReplayUndecodable, Disposition::Term)
    );
    assert!(matches!(
        after_deploy.idempotency_error(),
        Some(Error::ReplayDecoding { .. })
    ));
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

/// A handler that spawns its idempotent call (to keep a panic off the
/// consumer's loop): wrapped in `carry_outcome`, the call still reports to
/// the delivery, so the replay of its recorded error is acked; unwrapped it
/// reports to nobody, and that replay looks like a failure.
#[tokio::test]
async fn mapping_a_spawned_call_reports_its_replay_through_carry_outcome() {
    let ledger = Arc::new(Ledger::new(false));
    let spawned = |key: &str, carried: bool| {
        let (ledger, key) = (ledger.clone(), key.to_owned());
        let call = async move { ledger.decline(&key, &order("o-9", 900)).await };
        async move {
            let task = if carried {
                tokio::spawn(idempotent_runtime::carry_outcome(call))
            } else {
                tokio::spawn(call)
            };
            task.await.expect("the spawned call")
        }
    };
    let first = handle(Some("m-9"), |k| spawned(k, true)).await;
    assert_eq!(first.verdict, Verdict::Failed);
    let again = handle(Some("m-9"), |k| spawned(k, true)).await;
    assert_eq!(
        (again.verdict, again.disposition()),
        (Verdict::Replayed, Disposition::Ack)
    );
    let unwrapped = handle(Some("m-9"), |k| spawned(k, false)).await;
    assert_eq!(unwrapped.verdict, Verdict::Failed);
    // Spawned by the closure itself, before it returns its future: `handle`
    // calls the handler inside its scope, so the call still reports.
    let eager = handle(Some("m-9"), |k| {
        let (ledger, key) = (ledger.clone(), k.to_owned());
        let task = tokio::spawn(idempotent_runtime::carry_outcome(async move {
            ledger.decline(&key, &order("o-9", 900)).await
        }));
        async move { task.await.expect("the spawned call") }
    })
    .await;
    assert_eq!(eager.verdict, Verdict::Replayed);
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

/// A handler that uses `with_outcome` itself (as an HTTP handler would, for
/// `MarkReplayed`): its scope passes what it saw on to the delivery's, so the
/// replay of a recorded error is still acked.
#[tokio::test]
async fn mapping_a_handler_with_its_own_with_outcome_still_reports_its_replay() {
    let ledger = Ledger::new(false);
    let o = order("o-10", 1000);
    let own_scope = |k: &str| {
        let (ledger, o, k) = (&ledger, &o, k.to_owned());
        async move {
            let (result, outcome) = idempotent_runtime::with_outcome(ledger.decline(&k, o)).await;
            assert!(outcome.is_some());
            result
        }
    };
    let first = handle(Some("m-10"), own_scope).await;
    assert_eq!(first.verdict, Verdict::Failed);
    let again = handle(Some("m-10"), own_scope).await;
    assert_eq!(
        (again.verdict, again.disposition()),
        (Verdict::Replayed, Disposition::Ack)
    );
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------- JetStream helpers

/// A fresh stream (its own name and subject) with a short duplicate window,
/// deleted when the test ends (also when it fails).
pub(crate) struct TestStream {
    js: jetstream::Context,
    pub(crate) name: String,
    pub(crate) subject: String,
    deleted: bool,
}

impl Drop for TestStream {
    /// A test that failed (or timed out) before `delete` still removes its
    /// stream: from a thread of its own, bounded, on a connection of its own.
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        let name = std::mem::take(&mut self.name);
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    let client = async_nats::connect(nats_url().as_str()).await.ok()?;
                    jetstream::new(client).delete_stream(&name).await.ok()
                })
                .await;
            });
        })
        .join();
    }
}

impl TestStream {
    pub(crate) async fn create(js: &jetstream::Context, label: &str) -> TestStream {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("IDEM_{label}_{id}");
        let subject = format!("idem.{}.{id}", label.to_lowercase());
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            // Short, so a producer retry published after it is stored and
            // delivered: the duplicates the consumer itself must recognise.
            duplicate_window: Duration::from_millis(100),
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("create the stream");
        TestStream {
            js: js.clone(),
            name,
            subject,
            deleted: false,
        }
    }

    pub(crate) async fn durable(&self, name: &str, ack_wait: Duration) -> PullConsumer {
        self.js
            .get_stream(&self.name)
            .await
            .expect("get the stream")
            .create_consumer(pull::Config {
                durable_name: Some(name.into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait,
                max_ack_pending: 256,
                ..Default::default()
            })
            .await
            .expect("create the durable consumer")
    }

    /// Publishes with `Nats-Msg-Id`; a publish dropped by the duplicate window
    /// is repeated until the stream stores it (bounded).
    pub(crate) async fn publish(&self, msg_id: &str, payload: Vec<u8>) -> u64 {
        self.publish_with_header(msg_id, None, payload).await
    }

    /// [`publish`](Self::publish), with a header (`(name, value)`) when given.
    pub(crate) async fn publish_with_header(
        &self,
        msg_id: &str,
        header: Option<(&str, &str)>,
        payload: Vec<u8>,
    ) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut message = jetstream::message::PublishMessage::build()
                .payload(payload.clone().into())
                .message_id(msg_id);
            if let Some((name, value)) = header {
                message = message.header(name, value);
            }
            let ack = self
                .js
                .send_publish(self.subject.clone(), message)
                .await
                .expect("publish")
                .await
                .expect("publish acknowledged");
            if !ack.duplicate {
                return ack.sequence;
            }
            assert!(
                Instant::now() < deadline,
                "JetStream kept dropping {msg_id} as a duplicate"
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    /// Publishes without `Nats-Msg-Id`.
    async fn publish_without_id(&self, payload: Vec<u8>) -> u64 {
        self.js
            .publish(self.subject.clone(), payload.into())
            .await
            .expect("publish")
            .await
            .expect("publish acknowledged")
            .sequence
    }

    pub(crate) async fn delete(mut self) {
        self.js
            .delete_stream(&self.name)
            .await
            .expect("delete the stream");
        self.deleted = true;
    }
}

/// The next delivery of `messages`, waited for at most 30 s.
pub(crate) async fn next_delivery(messages: &mut PulledInTurn) -> jetstream::Message {
    tokio::time::timeout(Duration::from_secs(30), messages.next())
        .await
        .expect("a delivery within 30 s")
        .expect("the message stream goes on")
        .expect("a message")
}

/// A consumer's messages as [`pulled_in_turn`] takes them.
pub(crate) type PulledInTurn = futures_util::stream::TryFlatten<pull::Sequence>;

/// The consumer's messages, pulled with one request of up to `batch` at a
/// time: the next request goes out once the last one is done (all its
/// messages taken, or expired after 60 s).
///
/// Not `consumer.stream().max_messages_per_batch(batch).messages()`:
/// async-nats's pull `Stream` (0.51, and 0.52 alike) counts the messages its
/// requests still owe, and when a message arrives before its own background
/// task has reported the request as sent (a loaded machine), the count ends
/// too high. With a batch of one it then sends no further request until the
/// last one's 30 s expiry runs out (plus 5 s), and a redelivery or the next
/// message waits that long: `stale_deliveries` failed so in CI, and the
/// server's trace showed no second `CONSUMER.MSG.NEXT`. A larger batch
/// stalls the same way when most of it arrives first.
pub(crate) fn pulled_in_turn(consumer: &PullConsumer, batch: usize) -> PulledInTurn {
    use futures_util::TryStreamExt;
    consumer
        .sequence(batch)
        .expect("a consumer without a pinned client")
        .try_flatten()
}

/// Whether every message of the durable has been delivered and settled.
pub(crate) async fn settled(consumer: &PullConsumer) -> bool {
    match consumer.get_info().await {
        Ok(info) => info.num_pending == 0 && info.num_ack_pending == 0,
        Err(_) => false,
    }
}

pub(crate) fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("serialize")
}

// ---------------------------------------------------------------- one consumer, every mapping, on JetStream

struct Billing {
    db: sqlx::SqlitePool,
    store: SqliteStore,
    /// Orders that fail their first attempt (released: nak).
    fail_once: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The gated order waits here until a duplicate delivery found it in progress.
    gate: Arc<Semaphore>,
}

impl Billing {
    #[idempotent(scope = "nats.loop.billing", key = msg_id, tenant = tenant, store = self.store,
                 in_progress = reject, lease = "2s")]
    async fn bill(&self, tenant: &str, msg_id: &str, order: &Order) -> Result<u64, BillError> {
        if self.fail_once.lock().unwrap().remove(&order.order_id) {
            return Err(BillError::LedgerDown);
        }
        if order.order_id == "gated" {
            // Bounded: a missing duplicate fails the counts, it does not hang.
            let _ = tokio::time::timeout(Duration::from_secs(20), self.gate.acquire()).await;
        }
        sqlx::query("INSERT INTO effects (msg_id) VALUES (?)")
            .bind(msg_id)
            .execute(&self.db)
            .await
            .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("test", "effect", e)))?;
        Ok(order.amount_cents)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_full_loop_acks_naks_and_terms_as_mapped() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), full_loop(js))
        .await
        .expect("the full loop finished within 120 s");
}

async fn full_loop(js: jetstream::Context) {
    let tenant = fresh_tenant();
    let dir = crate::common::scratch::dir("nats-loop");
    let url = format!("sqlite://{}?mode=rwc", dir.join("loop.db").display());
    let db = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE effects (msg_id TEXT NOT NULL)")
        .execute(&db)
        .await
        .unwrap();
    let billing = Arc::new(Billing {
        store: SqliteStore::from_pool(db.clone()).await.unwrap(),
        db,
        fail_once: std::sync::Mutex::new(["o-3".to_owned()].into()),
        gate: Arc::new(Semaphore::new(0)),
    });

    let stream = TestStream::create(&js, "LOOP").await;
    // A long ack_wait: every redelivery here comes from a nak, none from a timeout.
    let consumer = stream.durable("loop", Duration::from_secs(60)).await;
    stream.publish("m-1", json(&order("o-1", 100))).await;
    stream.publish("m-1", json(&order("o-1", 100))).await; // a producer retry, after the window
    stream.publish("m-2", json(&order("o-2", 200))).await;
    let poison_seq = stream.publish("m-2", json(&order("o-2", 99_999))).await; // same id, other payload
    let no_id_seq = stream.publish_without_id(json(&order("o-x", 1))).await;
    stream.publish("m-3", json(&order("o-3", 300))).await; // fails once
    stream.publish("m-4", json(&order("gated", 400))).await;
    stream.publish("m-4", json(&order("gated", 400))).await; // arrives while the first runs
    let stored = 8;

    // Deliveries are handled one at a time, except the gated order's, which
    // run in the background (a consumer with a few workers).
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, i64, Verdict, Disposition)>();
    let handle_one = {
        let (billing, tenant) = (billing.clone(), tenant.clone());
        move |message: jetstream::Message| {
            let (billing, tenant, tx) = (billing.clone(), tenant.clone(), tx.clone());
            async move {
                let info = message
                    .info()
                    .map(|i| (i.stream_sequence, i.delivered))
                    .unwrap();
                let order: Order = serde_json::from_slice(&message.payload).unwrap();
                let handled = process(&message, |k| billing.bill(&tenant, k, &order))
                    .await
                    .expect("settle the delivery");
                if matches!(handled.verdict, Verdict::InProgress { .. }) {
                    billing.gate.add_permits(1);
                }
                let _ = tx.send((info.0, info.1, handled.verdict, handled.disposition()));
            }
        }
    };
    let mut messages = pulled_in_turn(&consumer, 1);
    let mut background = tokio::task::JoinSet::new();
    let mut seen: Vec<(u64, i64, Verdict, Disposition)> = Vec::new();
    loop {
        while let Ok(d) = rx.try_recv() {
            seen.push(d);
        }
        if background.is_empty() && settled(&consumer).await {
            break;
        }
        let Ok(next) = tokio::time::timeout(Duration::from_millis(200), messages.next()).await
        else {
            while background.try_join_next().is_some() {}
            continue;
        };
        let message = next
            .expect("the message stream goes on")
            .expect("a message");
        if message_key(&message) == Some("m-4") {
            background.spawn(handle_one(message));
        } else {
            handle_one(message).await;
        }
    }
    while let Ok(d) = rx.try_recv() {
        seen.push(d);
    }

    let mut verdicts: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, _, v, _) in &seen {
        *verdicts.entry(v.as_str()).or_default() += 1;
    }
    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT msg_id, COUNT(*) FROM effects GROUP BY msg_id ORDER BY msg_id")
            .fetch_all(&billing.db)
            .await
            .unwrap();
    println!(
        "full loop: {stored} stored messages, {} deliveries, verdicts {verdicts:?}, effects {effects:?}",
        seen.len()
    );
    // m-4's duplicate is nak'd with a delay at least once while the first
    // runs (more often only on a machine so slow that the first outlives the delay).
    let in_progress = verdicts.get("in-progress").copied().unwrap_or(0);
    assert!(in_progress >= 1, "deliveries: {seen:?}");
    let expected: BTreeMap<&str, usize> = [
        ("executed", 4),              // m-1, m-2, m-3 (second delivery), m-4 (the gated one)
        ("replayed", 2), // the producer retry of m-1; m-4's duplicate, redelivered after its nak
        ("failed", 1),   // m-3's first delivery: released, nak'd, redelivered
        ("in-progress", in_progress), // m-4's duplicate while the first ran: nak'd with a delay
        ("mismatch", 1), // m-2 with another payload: term
        ("missing-key", 1), // no Nats-Msg-Id: term, never processed
    ]
    .into();
    assert_eq!(verdicts, expected, "deliveries: {seen:?}");
    for (seq, _, verdict, disposition) in &seen {
        let want = match verdict {
            Verdict::Executed | Verdict::Replayed => Disposition::Ack,
            Verdict::InProgress { retry_after } => {
                assert!(*retry_after > Duration::ZERO && *retry_after <= Duration::from_secs(2));
                Disposition::Nak(Some(*retry_after))
            }
            // The first delivery of a failing message waits a second.
            Verdict::Failed => Disposition::Nak(Some(Duration::from_secs(1))),
            _ => Disposition::Term,
        };
        assert_eq!(*disposition, want, "stream sequence {seq}");
    }
    // A term'd message is never delivered again.
    for seq in [poison_seq, no_id_seq] {
        let deliveries = seen.iter().filter(|d| d.0 == seq).count();
        assert_eq!(
            deliveries, 1,
            "stream sequence {seq} was delivered {deliveries} times"
        );
    }
    let want_effects: Vec<(String, i64)> = ["m-1", "m-2", "m-3", "m-4"]
        .iter()
        .map(|k| (k.to_string(), 1))
        .collect();
    assert_eq!(effects, want_effects);

    stream.delete().await;
    billing.db.close().await;
}

// ---------------------------------------------------------------- a newer version's running record, on JetStream

/// A rolling deploy on JetStream: a newer instance is running a message (its
/// record in progress, planted here with a newer fingerprint version), the
/// message outlives `ack_wait` and is redelivered; its tenth delivery reaches
/// an older instance, whose `process` must not terminate it. The newer
/// instance's body then fails (releases the key): the message comes back and
/// is processed once. Terminated, it never came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_newer_versions_running_record_does_not_lose_the_message() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(90), newer_running(js))
        .await
        .expect("finished within 90 s");
}

async fn newer_running(js: jetstream::Context) {
    let tenant = fresh_tenant();
    let dir = crate::common::scratch::dir("nats-newer");
    let url = format!("sqlite://{}?mode=rwc", dir.join("newer.db").display());
    let db = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE effects (msg_id TEXT NOT NULL)")
        .execute(&db)
        .await
        .unwrap();
    let billing = Billing {
        store: SqliteStore::from_pool(db.clone()).await.unwrap(),
        db,
        fail_once: std::sync::Mutex::new(Default::default()),
        gate: Arc::new(Semaphore::new(0)),
    };
    let identity =
        idempotent_runtime::Identity::new(&tenant, "nats.loop.billing", "m-newer").unwrap();
    let newer = idempotent_runtime::Fingerprint::from_stored(format!(
        "v99:{}",
        "0123456789abcdef".repeat(4)
    ));
    let token = common::records::acquire(
        &billing.store,
        &identity,
        Some(&newer),
        Duration::from_secs(600),
        Duration::from_secs(3600),
    )
    .await;

    let stream = TestStream::create(&js, "NATSHUNT_NEWER").await;
    let consumer = stream
        .durable("natshunt-newer", Duration::from_secs(1))
        .await;
    let seq = stream
        .publish("m-newer", json(&order("o-newer", 4200)))
        .await;
    let mut messages = pulled_in_turn(&consumer, 1);
    let mut seen: Vec<(i64, Verdict, Disposition)> = Vec::new();
    let mut released = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if released && settled(&consumer).await {
            break;
        }
        let Ok(next) = tokio::time::timeout(Duration::from_millis(300), messages.next()).await
        else {
            continue;
        };
        let message = next
            .expect("the message stream goes on")
            .expect("a message");
        let info = message.info().unwrap();
        assert_eq!(info.stream_sequence, seq);
        let delivered = info.delivered;
        if delivered < idempotent_runtime::consumer::DELIVERIES_BEFORE_TERM as i64 {
            // The newer instance's own deliveries while its body runs:
            // never settled, so `ack_wait` brings the message back.
            continue;
        }
        let o: Order = serde_json::from_slice(&message.payload).unwrap();
        let handled = process(&message, |k| billing.bill(&tenant, k, &o))
            .await
            .expect("settle the delivery");
        seen.push((delivered, handled.verdict, handled.disposition()));
        if !released {
            // The newer instance's body fails: its key is released.
            assert_eq!(
                billing.store.release(&identity, &token).await.unwrap(),
                idempotent_runtime::Fenced::Written
            );
            released = true;
        }
    }
    let effects: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&billing.db)
        .await
        .unwrap();
    println!("a newer version's running record: deliveries {seen:?}, effects {effects}");
    assert!(
        seen.iter().all(|d| d.2 != Disposition::Term),
        "an older instance terminated the message the newer one was running: {seen:?}"
    );
    assert_eq!(effects, 1, "the message was processed once: {seen:?}");

    stream.delete().await;
    billing.db.close().await;
}

// ---------------------------------------------------------------- a NATS server that stops answering

/// The consumer's connection to NATS goes silent (a TCP proxy holds every
/// byte both ways) after a message was delivered: `process` still runs the
/// handler and returns (the ack is queued by the client, not awaited), so a
/// silent server never holds a delivery's handling. When the connection
/// answers again the queued ack lands: the message is settled, its effect
/// happened once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_silent_server_does_not_hold_process() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(90), silent_server(js))
        .await
        .expect("finished within 90 s");
}

async fn silent_server(js: jetstream::Context) {
    use common::proxy::{Direction, FaultProxy, Stall};
    let upstream = nats_url()
        .trim_start_matches("nats://")
        .trim_end_matches('/')
        .to_owned();
    let proxy = FaultProxy::start(&upstream).await.unwrap();
    let tenant = fresh_tenant();
    let dir = crate::common::scratch::dir("nats-silent");
    let url = format!("sqlite://{}?mode=rwc", dir.join("silent.db").display());
    let db = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE effects (msg_id TEXT NOT NULL)")
        .execute(&db)
        .await
        .unwrap();
    let billing = Billing {
        store: SqliteStore::from_pool(db.clone()).await.unwrap(),
        db,
        fail_once: std::sync::Mutex::new(Default::default()),
        gate: Arc::new(Semaphore::new(0)),
    };
    let stream = TestStream::create(&js, "NATSHUNT_SILENT").await;
    let admin = stream
        .durable("natshunt-silent", Duration::from_secs(5))
        .await;
    stream.publish("m-s1", json(&order("o-s1", 1))).await;

    let client = async_nats::connect(format!("nats://127.0.0.1:{}", proxy.port()))
        .await
        .unwrap();
    let consumer: PullConsumer = jetstream::new(client)
        .get_stream(&stream.name)
        .await
        .unwrap()
        .get_consumer("natshunt-silent")
        .await
        .unwrap();
    let mut messages = pulled_in_turn(&consumer, 1);
    let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
        .await
        .expect("a delivery")
        .expect("the stream goes on")
        .expect("a message");
    proxy.stall(Stall::Both);
    let o: Order = serde_json::from_slice(&message.payload).unwrap();
    let handled = tokio::time::timeout(
        Duration::from_secs(10),
        process(&message, |k| billing.bill(&tenant, k, &o)),
    )
    .await
    .expect("process returns while the server is silent")
    .expect("the ack is queued");
    assert_eq!(
        (handled.verdict, handled.disposition()),
        (Verdict::Executed, Disposition::Ack)
    );
    proxy.wait_held(Direction::ToServer).await;
    assert!(!settled(&admin).await, "the ack has not reached the server");
    proxy.release_stall();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !settled(&admin).await {
        assert!(Instant::now() < deadline, "the queued ack never landed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let effects: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&billing.db)
        .await
        .unwrap();
    assert_eq!(effects, 1);
    drop(messages);
    stream.delete().await;
    billing.db.close().await;
}

// ---------------------------------------------------------------- progress while a long handler runs

/// A handler that runs until the test lets it go, on a memory store.
struct Report {
    store: MemoryStore,
    effects: AtomicUsize,
    entered: Semaphore,
    release: Semaphore,
}

impl Report {
    fn new() -> Self {
        Report {
            store: MemoryStore::new(),
            effects: AtomicUsize::new(0),
            entered: Semaphore::new(0),
            release: Semaphore::new(0),
        }
    }

    #[idempotent(scope = "nats.progress.reports", key = msg_id, tenant = shared,
                 store = self.store, in_progress = reject, lease = "5s")]
    async fn build(&self, msg_id: &str, order: &Order) -> Result<u64, BillError> {
        self.entered.add_permits(1);
        // Bounded: a handshake that never comes fails the test, it does not hang.
        let _ = tokio::time::timeout(Duration::from_secs(30), self.release.acquire()).await;
        self.effects.fetch_add(1, Ordering::SeqCst);
        Ok(order.amount_cents)
    }
}

/// One message on a durable with a 2 s `ack_wait`, and two pulls pending on
/// it: the first delivery goes to `first`, any redelivery to the second
/// pull, whose deliveries are sent on the returned channel.
struct LongDelivery {
    stream: TestStream,
    admin: PullConsumer,
    first: jetstream::Message,
    redeliveries: tokio::sync::mpsc::UnboundedReceiver<jetstream::Message>,
    second_pull: tokio::task::JoinHandle<()>,
    /// `+WPI` messages seen on the stream's ack subjects.
    progress_seen: Arc<Semaphore>,
    watcher: tokio::task::JoinHandle<()>,
}

impl LongDelivery {
    async fn start(js: &jetstream::Context, label: &str) -> LongDelivery {
        let stream = TestStream::create(js, label).await;
        let durable = format!("{}-durable", label.to_lowercase());
        let admin = stream.durable(&durable, Duration::from_secs(2)).await;
        // Every ack, nak and progress message is a publish to the delivery's
        // reply subject, `$JS.ACK.<stream>.…`: a second client sees them.
        let watching = async_nats::connect(nats_url().as_str()).await.unwrap();
        let mut acks = watching
            .subscribe(format!("$JS.ACK.{}.>", stream.name))
            .await
            .unwrap();
        watching.flush().await.unwrap();
        let progress_seen = Arc::new(Semaphore::new(0));
        let seen = progress_seen.clone();
        let watcher = tokio::spawn(async move {
            let _client = watching;
            while let Some(ack) = acks.next().await {
                if ack.payload.as_ref() == b"+WPI" {
                    seen.add_permits(1);
                }
            }
        });
        stream.publish("report-1", json(&order("r-1", 5))).await;
        let mut first_pull = pulled_in_turn(&admin, 1);
        let first = tokio::time::timeout(Duration::from_secs(10), first_pull.next())
            .await
            .expect("a delivery")
            .expect("the stream goes on")
            .expect("a message");
        drop(first_pull);
        let (sender, redeliveries) = tokio::sync::mpsc::unbounded_channel();
        let second = admin.clone();
        let second_pull = tokio::spawn(async move {
            let mut pull = pulled_in_turn(&second, 1);
            while let Some(Ok(message)) = pull.next().await {
                if sender.send(message).is_err() {
                    return;
                }
            }
        });
        LongDelivery {
            stream,
            admin,
            first,
            redeliveries,
            second_pull,
            progress_seen,
            watcher,
        }
    }

    async fn finish(self) {
        self.second_pull.abort();
        self.watcher.abort();
        self.stream.delete().await;
    }
}

/// With progress every 200 ms, a handler that runs past its 2 s `ack_wait`
/// (it goes on until 25 progress messages, five seconds of them, have reached
/// the server) keeps its delivery: nothing is redelivered to the pull that
/// waits beside it, the message is delivered once and acked once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_progress_keeps_a_long_handler_from_being_redelivered() {
    use idempotent_runtime::consumer::nats::process_with_progress;
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(90), async {
        let mut run = LongDelivery::start(&js, "PROGRESS").await;
        let report = Report::new();
        let o: Order = serde_json::from_slice(&run.first.payload).unwrap();
        let seen = run.progress_seen.clone();
        let handling = process_with_progress(&run.first, Duration::from_millis(200), |k| {
            report.build(k, &o)
        });
        let letting_go = async {
            let _ = seen.acquire_many(25).await.expect("the watcher goes on");
            report.release.add_permits(1);
        };
        let (handled, ()) = tokio::join!(handling, letting_go);
        let handled = handled.expect("the ack is sent");
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Executed, Disposition::Ack)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while !settled(&run.admin).await {
            assert!(Instant::now() < deadline, "the ack never landed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let info = run.admin.get_info().await.unwrap();
        assert_eq!(
            (info.delivered.consumer_sequence, info.num_redelivered),
            (1, 0),
            "one delivery, none redelivered"
        );
        assert!(
            run.redeliveries.try_recv().is_err(),
            "no redelivery reached the second pull"
        );
        assert_eq!(report.effects.load(Ordering::SeqCst), 1);
        run.finish().await;
    })
    .await
    .expect("finished within 90 s");
}

/// The same long handler under plain `process`: JetStream redelivers the
/// message once its 2 s `ack_wait` has run out (the handler waits for that
/// redelivery), the redelivery is nak'd as in progress, and the body still
/// runs once. This is what the test above shows progress prevents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_without_progress_a_long_handler_is_redelivered() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(90), async {
        let mut run = LongDelivery::start(&js, "NOPROGRESS").await;
        let report = Report::new();
        let o: Order = serde_json::from_slice(&run.first.payload).unwrap();
        let handling = process(&run.first, |k| report.build(k, &o));
        let redelivered = async {
            let _ = report.entered.acquire().await.expect("entered");
            let again = run.redeliveries.recv().await.expect("a redelivery");
            let duplicate = process(&again, |k| report.build(k, &o))
                .await
                .expect("the nak is sent");
            report.release.add_permits(1);
            duplicate
        };
        let (handled, duplicate) = tokio::join!(handling, redelivered);
        assert!(
            matches!(duplicate.verdict, Verdict::InProgress { .. }),
            "the redelivery found the message running: {:?}",
            duplicate.verdict
        );
        let handled = handled.expect("the ack is sent");
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Executed, Disposition::Ack)
        );
        assert!(
            run.progress_seen.available_permits() == 0,
            "no progress was sent"
        );
        assert_eq!(report.effects.load(Ordering::SeqCst), 1);
        run.finish().await;
    })
    .await
    .expect("finished within 90 s");
}

// ---------------------------------------------------------------- tenants from subjects

#[idempotent(scope = "nats.tenants.billing", key = msg_id, tenant = tenant, store = store,
             in_progress = reject)]
async fn tenant_bill(
    store: &MemoryStore,
    effects: &std::sync::Mutex<Vec<(String, u64)>>,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, Error> {
    effects
        .lock()
        .unwrap()
        .push((tenant.to_owned(), order.amount_cents));
    Ok(order.amount_cents)
}

/// Tenants taken from the subject (`<base>.<customer>`), each customer
/// numbering its own ids: the records keep customers apart, but JetStream's
/// duplicate window does not, it compares `Nats-Msg-Id` across the whole
/// stream. A second customer's message with an id the first one used inside
/// the window is dropped at publish (`duplicate: true`) and never reaches the
/// consumer; ids that carry the customer (`globex:order-1`) are stored and
/// processed once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_ids_numbered_per_customer_collide_in_the_streams_duplicate_window() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(60), tenants_from_subjects(js))
        .await
        .expect("finished within 60 s");
}

async fn tenants_from_subjects(js: jetstream::Context) {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let name = format!("IDEM_NATSHUNT_TENANTS_{id}");
    let base = format!("idem.natshunt_tenants.{id}");
    let stream = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{base}.*")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .expect("create the stream");
    // Deleted at the end, or on a failure by its drop.
    let cleanup = TestStream {
        js: js.clone(),
        name: name.clone(),
        subject: base.clone(),
        deleted: false,
    };
    let publish = |customer: &'static str, msg_id: String, amount: u64| {
        let (js, subject) = (js.clone(), format!("{base}.{customer}"));
        async move {
            js.send_publish(
                subject,
                jetstream::message::PublishMessage::build()
                    .payload(json(&order("o", amount)).into())
                    .message_id(msg_id),
            )
            .await
            .expect("publish")
            .await
            .expect("publish acknowledged")
            .duplicate
        }
    };
    // Ids numbered per customer: the second customer's "order-1" is dropped.
    assert!(!publish("acme", "order-1".into(), 100).await);
    let dropped = publish("globex", "order-1".into(), 200).await;
    // Ids that carry the customer: both stored.
    assert!(!publish("acme", "acme:order-2".into(), 300).await);
    assert!(!publish("globex", "globex:order-2".into(), 400).await);

    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("natshunt-tenants".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let store = MemoryStore::new();
    let effects = std::sync::Mutex::new(Vec::new());
    let mut messages = pulled_in_turn(&consumer, 4);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !settled(&consumer).await {
        let Ok(next) = tokio::time::timeout(Duration::from_millis(300), messages.next()).await
        else {
            continue;
        };
        let message = next.expect("the stream goes on").expect("a message");
        let customer = message
            .subject
            .as_str()
            .rsplit('.')
            .next()
            .unwrap()
            .to_owned();
        let o: Order = serde_json::from_slice(&message.payload).unwrap();
        process(&message, |k| {
            tenant_bill(&store, &effects, &customer, k, &o)
        })
        .await
        .expect("settle");
    }
    let mut effects = effects.into_inner().unwrap();
    effects.sort();
    println!(
        "ids per customer: globex's order-1 dropped as a duplicate: {dropped}; effects {effects:?}"
    );
    assert!(
        dropped,
        "JetStream dropped globex's order-1 as acme's duplicate"
    );
    assert_eq!(
        effects,
        [
            ("acme".to_owned(), 100),
            ("acme".to_owned(), 300),
            ("globex".to_owned(), 400)
        ]
    );
    cleanup.delete().await;
}

#[idempotent(scope = "nats.tenants.streams", key = msg_id, tenant = stream, store = store,
             in_progress = reject, skip(effects))]
async fn stream_bill(
    store: &dyn Store,
    effects: &std::sync::Mutex<Vec<(String, u64)>>,
    stream: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, Error> {
    effects
        .lock()
        .unwrap()
        .push((stream.to_owned(), order.amount_cents));
    Ok(order.amount_cents)
}

/// `tenant = stream`: two streams whose producers both number their ids
/// from 1 publish `order-1` with different payloads, and each stream's
/// producer retries it after the duplicate window. One consumer per stream,
/// one scope: each stream's `order-1` runs once with its own payload (not a
/// mismatch with the other's, never the other's answer), and each retry
/// replays its own stream's answer. On every store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_one_id_in_two_streams_is_two_messages_each_with_its_own_answer() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let dir = crate::common::scratch::dir("nats-two-streams");
    let sqlite = SqliteStore::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.join("streams.db").display()
    ))
    .await
    .unwrap();
    let mut stores: Vec<(&str, Box<dyn Store>)> = vec![
        ("memory", Box::new(MemoryStore::new())),
        ("sqlite", Box::new(sqlite.clone())),
    ];
    if let Some(pg) = pg_store_or_skip().await {
        stores.push(("postgres", Box::new(pg)));
    }
    if let Some(mysql) = common::servers::mysql_store_or_skip().await {
        stores.push(("mariadb", Box::new(mysql)));
    }
    tokio::time::timeout(Duration::from_secs(60), async {
        for (name, store) in &stores {
            let store: &dyn Store = store.as_ref();
            let effects = std::sync::Mutex::new(Vec::new());
            let mut answers: Vec<(String, Verdict, u64)> = Vec::new();
            let mut streams = Vec::new();
            for (label, amount) in [("HCONS_TWO_A", 100u64), ("HCONS_TWO_B", 200)] {
                let stream = TestStream::create(&js, label).await;
                let consumer = stream.durable("hcons-two", Duration::from_secs(30)).await;
                stream.publish("order-1", json(&order("o-1", amount))).await;
                // The producer's retry, after the duplicate window: stored again.
                stream.publish("order-1", json(&order("o-1", amount))).await;
                let mut messages = consumer.fetch().max_messages(2).messages().await.unwrap();
                for _ in 0..2 {
                    let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                        .await
                        .expect("a delivery within 10 s")
                        .expect("the batch goes on")
                        .expect("a message");
                    let o: Order = serde_json::from_slice(&message.payload).unwrap();
                    let handled = process(&message, |k| {
                        stream_bill(store, &effects, &stream.name, k, &o)
                    })
                    .await
                    .expect("settle");
                    let answer = handled.result.expect("called").expect("answered");
                    answers.push((stream.name.clone(), handled.verdict, answer));
                }
                streams.push(stream);
            }
            let names: Vec<String> = streams.iter().map(|s| s.name.clone()).collect();
            let want = vec![
                (names[0].clone(), Verdict::Executed, 100),
                (names[0].clone(), Verdict::Replayed, 100),
                (names[1].clone(), Verdict::Executed, 200),
                (names[1].clone(), Verdict::Replayed, 200),
            ];
            assert_eq!(answers, want, "{name}");
            assert_eq!(
                effects.into_inner().unwrap(),
                [(names[0].clone(), 100), (names[1].clone(), 200)],
                "{name}: one effect per stream's message"
            );
            for (stream, tenant) in streams.into_iter().zip(&names) {
                let identity =
                    idempotent_runtime::Identity::new(tenant, "nats.tenants.streams", "order-1")
                        .unwrap();
                let _ = store.force_release(&identity, false).await;
                stream.delete().await;
            }
        }
    })
    .await
    .expect("finished within 60 s");
    sqlite.pool().close().await;
}

// ---------------------------------------------------------------- ack policies

/// `process` settles each delivery on its own: it needs `AckPolicy::Explicit`.
/// With `AckPolicy::All` the ack of a later message acknowledges every earlier
/// one, also one `process` nak'd (its body failed, the key was released): that
/// message is never redelivered and its effect never happens. The
/// test shows both policies side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_an_ack_all_consumer_loses_a_nakd_message_to_a_later_ack() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(60), ack_policies(js))
        .await
        .expect("finished within 60 s");
}

async fn ack_policies(js: jetstream::Context) {
    let mut effects_by_policy = Vec::new();
    for policy in [
        jetstream::consumer::AckPolicy::Explicit,
        jetstream::consumer::AckPolicy::All,
    ] {
        let tenant = fresh_tenant();
        let dir = crate::common::scratch::dir("nats-ackall");
        let url = format!("sqlite://{}?mode=rwc", dir.join("ackall.db").display());
        let db = sqlx::SqlitePool::connect(&url).await.unwrap();
        sqlx::query("CREATE TABLE effects (msg_id TEXT NOT NULL)")
            .execute(&db)
            .await
            .unwrap();
        let billing = Billing {
            store: SqliteStore::from_pool(db.clone()).await.unwrap(),
            db,
            fail_once: std::sync::Mutex::new(["o-a1".to_owned()].into()),
            gate: Arc::new(Semaphore::new(0)),
        };
        let stream = TestStream::create(&js, "NATSHUNT_ACKALL").await;
        let consumer = stream
            .js
            .get_stream(&stream.name)
            .await
            .unwrap()
            .create_consumer(pull::Config {
                durable_name: Some("natshunt-ackall".into()),
                ack_policy: policy,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .unwrap();
        stream.publish("m-a1", json(&order("o-a1", 1))).await; // fails once: nak
        stream.publish("m-a2", json(&order("o-a2", 2))).await; // ack
        let mut messages = pulled_in_turn(&consumer, 1);
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline && !(seen.len() >= 2 && settled(&consumer).await) {
            let Ok(next) = tokio::time::timeout(Duration::from_millis(300), messages.next()).await
            else {
                continue;
            };
            let message = next.expect("the stream goes on").expect("a message");
            let o: Order = serde_json::from_slice(&message.payload).unwrap();
            let handled = process(&message, |k| billing.bill(&tenant, k, &o))
                .await
                .expect("settle");
            seen.push((o.order_id.clone(), handled.disposition()));
        }
        let effects: Vec<String> = sqlx::query_scalar("SELECT msg_id FROM effects ORDER BY msg_id")
            .fetch_all(&billing.db)
            .await
            .unwrap();
        println!("{policy:?}: deliveries {seen:?}, effects {effects:?}");
        effects_by_policy.push(effects);
        stream.delete().await;
        billing.db.close().await;
    }
    assert_eq!(
        effects_by_policy[0],
        ["m-a1", "m-a2"],
        "explicit: every message once"
    );
    assert_eq!(
        effects_by_policy[1],
        ["m-a2"],
        "AckPolicy::All: the later ack acknowledged the nak'd message, which never came back"
    );
}

// ---------------------------------------------------------------- two consumers of one stream

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Event {
    n: u32,
}

async fn effect(
    pool: &sqlx::PgPool,
    tenant: &str,
    consumer: &str,
    msg_id: &str,
) -> Result<(), Error> {
    sqlx::query(
        "INSERT INTO idempotent_test_nats_effects (tenant, consumer, msg_id, pid) VALUES ($1, $2, $3, $4)",
    )
    .bind(tenant)
    .bind(consumer)
    .bind(msg_id)
    .bind(i64::from(std::process::id()))
    .execute(pool)
    .await
    .map(drop)
    .map_err(|e| idempotent_runtime::StoreError::new("test", "effect", e).into())
}

#[idempotent(scope = "nats.two.billing", key = msg_id, tenant = tenant, store = store, skip(pool),
             in_progress = reject)]
async fn two_billing(
    store: &PgStore,
    pool: &sqlx::PgPool,
    tenant: &str,
    msg_id: &str,
    event: &Event,
) -> Result<u32, Error> {
    effect(pool, tenant, "billing", msg_id).await?;
    Ok(event.n)
}

#[idempotent(scope = "nats.two.shipping", key = msg_id, tenant = tenant, store = store, skip(pool),
             in_progress = reject)]
async fn two_shipping(
    store: &PgStore,
    pool: &sqlx::PgPool,
    tenant: &str,
    msg_id: &str,
    event: &Event,
) -> Result<u32, Error> {
    effect(pool, tenant, "shipping", msg_id).await?;
    Ok(event.n)
}

#[derive(Clone, Copy)]
enum Which {
    Billing,
    Shipping,
}

/// Runs one durable until every message is delivered and settled; returns its verdict counts.
async fn consume(
    consumer: PullConsumer,
    which: Which,
    store: PgStore,
    tenant: String,
) -> BTreeMap<&'static str, usize> {
    let mut counts = BTreeMap::new();
    let mut messages = pulled_in_turn(&consumer, 4);
    loop {
        if settled(&consumer).await {
            return counts;
        }
        let Ok(next) = tokio::time::timeout(Duration::from_millis(200), messages.next()).await
        else {
            continue;
        };
        let message = next
            .expect("the message stream goes on")
            .expect("a message");
        let event: Event = serde_json::from_slice(&message.payload).unwrap();
        let (store, pool) = (&store, store.pool());
        let handled = process(&message, |k| async {
            match which {
                Which::Billing => two_billing(store, pool, &tenant, k, &event).await,
                Which::Shipping => two_shipping(store, pool, &tenant, k, &event).await,
            }
        })
        .await
        .expect("settle the delivery");
        *counts.entry(handled.verdict.as_str()).or_default() += 1;
    }
}

async fn create_effects_table(store: &PgStore) {
    common::servers::pg_create_tables(
        store.pool(),
        "CREATE TABLE IF NOT EXISTS idempotent_test_nats_effects (
             tenant TEXT NOT NULL, consumer TEXT NOT NULL, msg_id TEXT NOT NULL, pid BIGINT NOT NULL)",
    )
    .await
    .expect("create the effects table");
}

async fn delete_rows(store: &PgStore, tenant: &str) {
    for sql in [
        "DELETE FROM idempotent_test_nats_effects WHERE tenant = $1",
        "DELETE FROM idempotency_records WHERE tenant = $1",
    ] {
        sqlx::query(sql)
            .bind(tenant)
            .execute(store.pool())
            .await
            .expect("clean up");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_of_one_stream_each_process_every_message_once() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), two_consumers(js, store))
        .await
        .expect("the two consumers finished within 120 s");
}

async fn two_consumers(js: jetstream::Context, store: PgStore) {
    create_effects_table(&store).await;
    let tenant = fresh_tenant();
    let stream = TestStream::create(&js, "TWO").await;
    let billing = stream.durable("billing", Duration::from_secs(30)).await;
    let shipping = stream.durable("shipping", Duration::from_secs(30)).await;
    const IDS: u32 = 10;
    // The second round republishes every id (producer retries the stream keeps).
    for _round in 0..2 {
        for n in 0..IDS {
            stream.publish(&format!("ev-{n}"), json(&Event { n })).await;
        }
    }
    let published = 2 * IDS as usize;

    let (b, s) = tokio::join!(
        tokio::spawn(consume(
            billing,
            Which::Billing,
            store.clone(),
            tenant.clone()
        )),
        tokio::spawn(consume(
            shipping,
            Which::Shipping,
            store.clone(),
            tenant.clone()
        )),
    );
    let (b, s) = (b.unwrap(), s.unwrap());

    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT consumer, msg_id, COUNT(*) FROM idempotent_test_nats_effects WHERE tenant = $1
         GROUP BY consumer, msg_id ORDER BY consumer, msg_id",
    )
    .bind(&tenant)
    .fetch_all(store.pool())
    .await
    .unwrap();
    let records: Vec<(String, i64)> = sqlx::query_as(
        "SELECT scope, COUNT(*) FROM idempotency_records WHERE tenant = $1 AND state = 'complete'
         GROUP BY scope ORDER BY scope",
    )
    .bind(&tenant)
    .fetch_all(store.pool())
    .await
    .unwrap();

    // The bug this guards against: a third durable that shares billing's scope
    // (one dedup boundary for two consumers) skips everything, silently.
    let replica = stream
        .durable("billing-replica", Duration::from_secs(30))
        .await;
    let r = consume(replica, Which::Billing, store.clone(), tenant.clone()).await;
    let effects_after: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_test_nats_effects WHERE tenant = $1")
            .bind(&tenant)
            .fetch_one(store.pool())
            .await
            .unwrap();

    println!(
        "two consumers: {IDS} message ids, {published} stored messages; billing {b:?}; shipping {s:?}; \
         effects {} (billing {}, shipping {}); complete records {records:?}; \
         a third durable sharing billing's scope: {r:?}, effects after it {effects_after}",
        rows.len(),
        rows.iter().filter(|r| r.0 == "billing").count(),
        rows.iter().filter(|r| r.0 == "shipping").count(),
    );
    for n in 0..IDS {
        let id = format!("ev-{n}");
        for consumer in ["billing", "shipping"] {
            let count = rows
                .iter()
                .find(|r| r.0 == consumer && r.1 == id)
                .map_or(0, |r| r.2);
            assert_eq!(count, 1, "{consumer} has {count} effects for {id}");
        }
    }
    assert_eq!(rows.len(), 2 * IDS as usize);
    assert_eq!(
        records,
        vec![
            ("nats.two.billing".to_owned(), i64::from(IDS)),
            ("nats.two.shipping".to_owned(), i64::from(IDS))
        ],
        "two records per message id, one per consumer"
    );
    for counts in [&b, &s] {
        assert_eq!(counts.get("executed"), Some(&(IDS as usize)), "{counts:?}");
        assert!(counts.values().sum::<usize>() >= published, "{counts:?}");
    }
    assert_eq!(
        r.get("executed"),
        None,
        "the shared-scope durable ran nothing: {r:?}"
    );
    assert_eq!(r.get("replayed"), Some(&published), "{r:?}");
    assert_eq!(effects_after, 2 * i64::from(IDS));

    stream.delete().await;
    delete_rows(&store, &tenant).await;
}

// ---------------------------------------------------------------- the redelivery storm, many processes

/// The worker processes of a test; killed and reaped when the test ends, however it ends.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Starts a worker whose stdout lines arrive on `lines` tagged with `index`;
/// with `hold_after` > 0 its next body after that many holds (see the worker).
fn spawn_worker(
    db_url: &str,
    index: usize,
    hold_after: usize,
    stream: &str,
    tenant: &str,
    lines: &tokio::sync::mpsc::UnboundedSender<(usize, String)>,
) -> Child {
    let deadline = now_ms() + 180_000;
    let mut child = Command::new(WORKER)
        .args([
            db_url.to_owned(),
            nats_url(),
            stream.to_owned(),
            "storm".to_owned(),
            tenant.to_owned(),
            deadline.to_string(),
            hold_after.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the NATS worker process");
    let out = child.stdout.take().expect("piped stdout");
    let lines = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if lines.send((index, line)).is_err() {
                break;
            }
        }
    });
    child
}

#[derive(Debug, Default)]
struct StormCounts {
    deliveries: usize,
    acks: usize,
    naks: usize,
    terms: usize,
    lost_acks: usize,
    verdicts: BTreeMap<String, usize>,
    max_delivered: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_storm_two_processes_one_killed_one_effect_per_message() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(150), storm(js, StormDb::Pg(store)))
        .await
        .expect("the storm settled within 150 s");
}

/// The same storm on MariaDB (transactional mode there: the worker's
/// `bill_mysql`), in a database of the test's own, dropped at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_storm_two_processes_one_killed_one_effect_per_message_mariadb() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let Some(admin) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let database = common::servers::mysql_create_database(&admin, "natshunt_storm").await;
    let dropped = DropDatabase(Some((admin.pool().clone(), database.clone())));
    let base = mysql_url();
    let url = format!(
        "{}/{database}",
        base.rsplit_once('/')
            .map_or(base.as_str(), |(server, _)| server)
    );
    let store = idempotent_runtime::MySqlStore::connect(&url)
        .await
        .expect("open the storm's database");
    sqlx::query(
        "CREATE TABLE idempotent_test_nats_effects (
             tenant VARCHAR(64) NOT NULL, consumer VARCHAR(32) NOT NULL,
             msg_id VARCHAR(64) NOT NULL, pid BIGINT NOT NULL)",
    )
    .execute(store.pool())
    .await
    .expect("create the effects table");
    tokio::time::timeout(
        Duration::from_secs(150),
        storm(js, StormDb::MySql { store, url }),
    )
    .await
    .expect("the storm settled within 150 s");
    dropped.drop_now().await;
}

/// The storm in store mode on a SQLite file the two processes share (the
/// worker's `bill_sqlite`): the killed worker's effect is written and its
/// record left in progress; the redelivery takes the record over once its
/// 2 s lease has run out, and the scope's recover hook finds the effect and
/// records it instead of running the body again. One effect per message id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_storm_in_store_mode_a_killed_bodys_effect_is_recovered_not_repeated() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let dir = common::scratch::dir("nats-storm-sqlite");
    let url = format!("sqlite://{}", dir.join("storm.db").display());
    let store = SqliteStore::connect(&url)
        .await
        .expect("open the storm's SQLite file");
    sqlx::query(
        "CREATE TABLE idempotent_test_nats_effects (
             tenant TEXT NOT NULL, consumer TEXT NOT NULL, msg_id TEXT NOT NULL, pid INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await
    .expect("create the effects table");
    tokio::time::timeout(
        Duration::from_secs(150),
        storm(js, StormDb::Sqlite { store, url }),
    )
    .await
    .expect("the storm settled within 150 s");
}

/// Drops a test's own MariaDB database: at the end, or (a failed test) on drop.
struct DropDatabase(Option<(sqlx::MySqlPool, String)>);

impl DropDatabase {
    async fn drop_now(mut self) {
        if let Some((pool, database)) = self.0.take() {
            sqlx::query(&format!("DROP DATABASE `{database}`"))
                .execute(&pool)
                .await
                .expect("drop the storm's database");
        }
    }
}

impl Drop for DropDatabase {
    fn drop(&mut self) {
        let Some((_, database)) = self.0.take() else {
            return;
        };
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(10), async {
                    let pool = sqlx::MySqlPool::connect(&mysql_url()).await.ok()?;
                    sqlx::query(&format!("DROP DATABASE IF EXISTS `{database}`"))
                        .execute(&pool)
                        .await
                        .ok()
                })
                .await;
            });
        })
        .join();
    }
}

/// Where a storm's workers bill (transactional mode): the shared PostgreSQL
/// test database, or a MariaDB database of the test's own; or (store mode,
/// with a recover hook) a SQLite file of the test's own.
enum StormDb {
    Pg(PgStore),
    MySql {
        store: idempotent_runtime::MySqlStore,
        url: String,
    },
    Sqlite {
        store: SqliteStore,
        url: String,
    },
}

impl StormDb {
    fn url(&self) -> String {
        match self {
            StormDb::Pg(_) => pg_url(),
            StormDb::MySql { url, .. } | StormDb::Sqlite { url, .. } => url.clone(),
        }
    }

    /// How many message ids have an effect.
    async fn effect_ids(&self, tenant: &str) -> i64 {
        const SQL: &str =
            "SELECT COUNT(DISTINCT msg_id) FROM idempotent_test_nats_effects WHERE tenant = ";
        match self {
            StormDb::Pg(store) => sqlx::query_scalar(&format!("{SQL}$1"))
                .bind(tenant)
                .fetch_one(store.pool())
                .await
                .unwrap(),
            StormDb::MySql { store, .. } => sqlx::query_scalar(&format!("{SQL}?"))
                .bind(tenant)
                .fetch_one(store.pool())
                .await
                .unwrap(),
            StormDb::Sqlite { store, .. } => sqlx::query_scalar(&format!("{SQL}?"))
                .bind(tenant)
                .fetch_one(store.pool())
                .await
                .unwrap(),
        }
    }

    /// The effects per message id.
    async fn per_id(&self, tenant: &str) -> Vec<(String, i64)> {
        const SQL: &str =
            "SELECT msg_id, COUNT(*) FROM idempotent_test_nats_effects WHERE tenant = ";
        const END: &str = " GROUP BY msg_id ORDER BY msg_id";
        match self {
            StormDb::Pg(store) => sqlx::query_as(&format!("{SQL}$1{END}"))
                .bind(tenant)
                .fetch_all(store.pool())
                .await
                .unwrap(),
            StormDb::MySql { store, .. } => sqlx::query_as(&format!("{SQL}?{END}"))
                .bind(tenant)
                .fetch_all(store.pool())
                .await
                .unwrap(),
            StormDb::Sqlite { store, .. } => sqlx::query_as(&format!("{SQL}?{END}"))
                .bind(tenant)
                .fetch_all(store.pool())
                .await
                .unwrap(),
        }
    }

    /// The complete records of the worker's scope.
    async fn complete(&self, tenant: &str) -> i64 {
        match self {
            StormDb::Pg(store) => sqlx::query_scalar(
                "SELECT COUNT(*) FROM idempotency_records WHERE tenant = $1 \
                 AND scope = 'nats.storm.billing' AND state = 'complete'",
            )
            .bind(tenant)
            .fetch_one(store.pool())
            .await
            .unwrap(),
            StormDb::MySql { store, .. } => sqlx::query_scalar(
                "SELECT COUNT(*) FROM idempotency_records WHERE tenant = ? \
                 AND scope = 'nats.storm.billing_mysql' AND state = 'complete'",
            )
            .bind(tenant)
            .fetch_one(store.pool())
            .await
            .unwrap(),
            StormDb::Sqlite { store, .. } => sqlx::query_scalar(
                "SELECT COUNT(*) FROM idempotency_records WHERE tenant = ? \
                 AND scope = 'nats.storm.billing_sqlite' AND state = 'complete'",
            )
            .bind(tenant)
            .fetch_one(store.pool())
            .await
            .unwrap(),
        }
    }
}

async fn storm(js: jetstream::Context, db: StormDb) {
    #[derive(Serialize)]
    struct StormOrder {
        n: u32,
        slow: bool,
        fail_first: bool,
        lose_first_ack: bool,
    }
    if let StormDb::Pg(store) = &db {
        create_effects_table(store).await;
    }
    let db_url = db.url();
    let tenant = fresh_tenant();
    let stream = TestStream::create(&js, "STORM").await;
    let consumer = stream.durable("storm", Duration::from_secs(1)).await;
    const IDS: u32 = 16;
    let payload = |n: u32| {
        json(&StormOrder {
            n,
            slow: n % 4 == 1,
            fail_first: n % 5 == 2,
            lose_first_ack: n % 6 == 3,
        })
    };
    // Every id twice: the second round is a producer retry the stream keeps.
    for _round in 0..2 {
        for n in 0..IDS {
            stream.publish(&format!("st-{n}"), payload(n)).await;
        }
    }
    let published = 2 * IDS as usize;

    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers(vec![
        spawn_worker(&db_url, 0, 2, &stream.name, &tenant, &lines_tx),
        spawn_worker(&db_url, 1, 0, &stream.name, &tenant, &lines_tx),
    ]);
    let mut counts = StormCounts::default();
    let mut kills = 0;
    // The message whose body worker 0 was running when it was killed, and
    // whether worker 0 still reported finishing it (then it was not mid-body).
    let mut killed_key: Option<String> = None;
    let mut killed_mid_body = false;
    // Store mode: the keys whose takeover asked the recover hook.
    let mut recovered: Vec<String> = Vec::new();
    let mut next_check = Instant::now();
    loop {
        match tokio::time::timeout(Duration::from_millis(100), lines.recv()).await {
            Ok(Some((worker, line))) => {
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.as_slice() {
                    ["begin", _, _] => {}
                    ["begin", key, _, "hold"] => {
                        // SIGKILL worker 0 in the middle of its third body (it
                        // holds, so the kill lands mid-body): its transaction
                        // (effect and reservation) is rolled back, and the
                        // message is redelivered to the others.
                        if worker == 0 && kills == 0 {
                            workers.0[0].kill().expect("SIGKILL worker 0");
                            let _ = workers.0[0].wait();
                            kills += 1;
                            killed_key = Some(key.to_string());
                            killed_mid_body = true;
                            workers.0.push(spawn_worker(
                                &db_url,
                                2,
                                0,
                                &stream.name,
                                &tenant,
                                &lines_tx,
                            ));
                        }
                    }
                    ["delivery", key, delivered, verdict, disposition] => {
                        if worker == 0 && killed_key.as_deref() == Some(*key) {
                            killed_mid_body = false;
                        }
                        counts.deliveries += 1;
                        counts.max_delivered =
                            counts.max_delivered.max(delivered.parse().unwrap_or(0));
                        *counts.verdicts.entry(verdict.to_string()).or_default() += 1;
                        match *disposition {
                            "ack" => counts.acks += 1,
                            "term" => counts.terms += 1,
                            "lost" => counts.lost_acks += 1,
                            d if d.starts_with("nak") => counts.naks += 1,
                            other => panic!("worker {worker}: unexpected disposition {other}"),
                        }
                    }
                    ["ready", _] => {}
                    ["recover", key, _attempt] => recovered.push(key.to_string()),
                    _ => eprintln!("worker {worker}: {line}"),
                }
            }
            Ok(None) => panic!("every worker's output ended"),
            Err(_) => {}
        }
        if Instant::now() >= next_check {
            next_check = Instant::now() + Duration::from_millis(500);
            let effect_ids = db.effect_ids(&tenant).await;
            if effect_ids == i64::from(IDS) && settled(&consumer).await {
                break;
            }
        }
    }
    drop(workers);

    let per_id = db.per_id(&tenant).await;
    let effects: i64 = per_id.iter().map(|r| r.1).sum();
    let complete = db.complete(&tenant).await;
    println!(
        "redelivery storm: messages {IDS} ids ({published} stored), deliveries {}, acks {}, naks {}, terms {}, \
         lost acks {}, verdicts {:?}, most deliveries of one message {}, effects {effects}, \
         complete records {complete}, kills {kills} (mid-body of {killed_key:?}: {killed_mid_body})",
        counts.deliveries,
        counts.acks,
        counts.naks,
        counts.terms,
        counts.lost_acks,
        counts.verdicts,
        counts.max_delivered,
    );
    for (id, count) in &per_id {
        assert_eq!(*count, 1, "{id} has {count} effects");
    }
    assert_eq!(
        per_id.len(),
        IDS as usize,
        "every message id has its effect: {per_id:?}"
    );
    assert_eq!(
        complete,
        i64::from(IDS),
        "every message id has a complete record"
    );
    assert_eq!(kills, 1, "worker 0 was killed once");
    assert!(killed_mid_body, "the kill landed while a body ran");
    assert!(counts.max_delivered >= 2, "messages were redelivered");
    assert_eq!(counts.terms, 0, "nothing here is poison");
    if let StormDb::Sqlite { .. } = &db {
        assert!(
            killed_key.as_ref().is_some_and(|k| recovered.contains(k)),
            "the killed body's record was taken over and its hook asked: {recovered:?}"
        );
    }

    stream.delete().await;
    if let StormDb::Pg(store) = &db {
        delete_rows(store, &tenant).await;
    }
}
