//! The consumer's verdict (`consumer::handle` / `consumer::nats::process`)
//! for a handler that makes more than one idempotent call per message (one
//! step per scope, all keyed by the message id: reserve the stock, then
//! charge). `with_outcome` reports the *last* idempotent call that finished
//! with a result, and `classify` turns any `Err` into `Replayed` (ack) when
//! that outcome is `Replayed` — even when the error is the framework's own
//! store error from a later step that never ran. The message is acked and
//! never redelivered: the charge is lost.
//!
//! The same for a later step of the handler's own (not an idempotent call)
//! that fails after a replayed step: its error is not a recorded answer.
//! Only the replay of a recorded error (`errors = record`) is acked.

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::consumer::{handle, AsIdempotencyError, Disposition, Handled, Verdict};
use idempotent_runtime::{
    idempotent, Error, Identity, MemoryStore, RecordSnapshot, SqliteStore, Store, StoreError,
};
use std::sync::atomic::{AtomicUsize, Ordering};

static CHARGED: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "contract_edges.consumer.reserve_stock", key = key, tenant = shared,
             store = store, in_progress = reject)]
async fn reserve_stock(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

#[idempotent(scope = "contract_edges.consumer.charge", key = key, tenant = shared,
             store = store, in_progress = reject)]
async fn charge(store: &SqliteStore, key: &str) -> Result<u32, Error> {
    CHARGED.fetch_add(1, Ordering::SeqCst);
    Ok(2)
}

#[tokio::test]
async fn a_later_steps_store_failure_after_a_replayed_step_is_not_acked() {
    let stock = MemoryStore::new();
    let payments = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    // An earlier delivery reserved the stock; its charge step failed (or the
    // consumer died before it): the message was not acked and comes again.
    reserve_stock(&stock, "msg-1")
        .await
        .expect("stock reserved");
    // The payments store is unreachable during the redelivery.
    payments.pool().close().await;

    let handled = handle(Some("msg-1"), |key| async {
        reserve_stock(&stock, key).await?; // replayed
        charge(&payments, key).await // refused: the store is down
    })
    .await;
    assert!(
        matches!(handled.result, Some(Err(Error::Store(_)))),
        "{:?}",
        handled.result
    );
    assert_eq!(CHARGED.load(Ordering::SeqCst), 0, "the charge never ran");
    assert_eq!(
        (handled.verdict, handled.disposition()),
        (Verdict::Failed, Disposition::Nak(None)),
        "the charge never ran, yet the message is acked and will not be redelivered"
    );
}

/// A handler's error: its own steps' failures, or the framework's.
#[derive(Debug, thiserror::Error, serde::Serialize, serde::Deserialize)]
enum ShippingError {
    #[error("the address was refused")]
    AddressRefused,
    #[error("the carrier is unreachable")]
    CarrierDown,
    #[error(transparent)]
    #[serde(skip)]
    Idempotency(#[from] Error),
}

impl AsIdempotencyError for ShippingError {
    fn as_idempotency_error(&self) -> Option<&Error> {
        match self {
            ShippingError::Idempotency(e) => Some(e),
            _ => None,
        }
    }
}

#[idempotent(scope = "contract_edges.consumer.pack", key = key, tenant = shared,
             store = store, in_progress = reject)]
async fn pack(store: &MemoryStore, key: &str) -> Result<u32, ShippingError> {
    Ok(3)
}

/// A final refusal, recorded: its replay is the answer to every redelivery.
#[idempotent(scope = "contract_edges.consumer.label", key = key, tenant = shared,
             store = store, in_progress = reject, errors = record)]
async fn label(store: &MemoryStore, key: &str) -> Result<u32, ShippingError> {
    Err(ShippingError::AddressRefused)
}

#[tokio::test]
async fn a_later_plain_steps_failure_after_a_replayed_step_is_redelivered() {
    let store = MemoryStore::new();
    // The first delivery packed the parcel; the hand-over to the carrier (a
    // plain step) failed, so the message comes again.
    pack(&store, "msg-2").await.expect("packed");

    let handled = handle(Some("msg-2"), |key| async {
        pack(&store, key).await?; // replayed
        Err::<u32, _>(ShippingError::CarrierDown) // the carrier is still down
    })
    .await;
    assert!(
        matches!(handled.result, Some(Err(ShippingError::CarrierDown))),
        "{:?}",
        handled.result
    );
    assert_eq!(
        (handled.verdict, handled.disposition()),
        (Verdict::Failed, Disposition::Nak(None)),
        "the hand-over never succeeded: the message must come again"
    );
}

/// A redelivery answered with the recorded refusal: the handler returned it,
/// and the message is acked.
fn assert_recorded_refusal_acked(handled: &Handled<u32, ShippingError>, why: &str) {
    assert!(
        matches!(handled.result, Some(Err(ShippingError::AddressRefused))),
        "{:?}",
        handled.result
    );
    assert_eq!(
        (handled.verdict, handled.disposition()),
        (Verdict::Replayed, Disposition::Ack),
        "{why}"
    );
}

#[tokio::test]
async fn a_replayed_recorded_error_is_acked_even_after_a_replayed_step() {
    let store = MemoryStore::new();
    let first = handle(Some("msg-3"), |key| async {
        pack(&store, key).await?;
        label(&store, key).await
    })
    .await;
    // The refusal was recorded by this delivery's body: the body ran.
    assert_eq!(first.verdict, Verdict::Failed, "{:?}", first.result);

    let again = handle(Some("msg-3"), |key| async {
        pack(&store, key).await?; // replayed result
        label(&store, key).await // replayed recorded error
    })
    .await;
    assert_recorded_refusal_acked(
        &again,
        "the recorded refusal is the final answer: redelivering it changes nothing",
    );
}

#[tokio::test]
async fn a_replayed_recorded_error_is_acked_whatever_step_replays_after_it() {
    let store = MemoryStore::new();
    let handler = |key: &'static str| {
        let store = &store;
        async move {
            let refusal = label(store, key).await; // the recorded refusal
            pack(store, key).await?; // a step after it, replayed Ok on redelivery
            refusal
        }
    };
    let first = handle(Some("msg-4"), handler).await;
    assert_eq!(first.verdict, Verdict::Failed, "{:?}", first.result);

    let again = handle(Some("msg-4"), handler).await;
    assert_recorded_refusal_acked(
        &again,
        "the recorded refusal is the answer, though a result replayed after it",
    );
}

/// A store whose reads of a record fail (the reservation path works).
struct UnreadableRecords;

#[async_trait::async_trait]
impl Intercept for UnreadableRecords {
    async fn fetch(
        &self,
        _: &MemoryStore,
        _: &Identity,
    ) -> Result<Option<RecordSnapshot>, StoreError> {
        Err(StoreError::new("hooked", "fetch", "the connection was cut"))
    }
}

#[idempotent(scope = "contract_edges.consumer.bill", key = key, tenant = shared,
             store = store, in_progress = reject, skip(started, finish))]
async fn bill(
    store: &dyn Store,
    key: &str,
    amount: u32,
    started: &tokio::sync::Notify,
    finish: &tokio::sync::Notify,
) -> Result<u32, Error> {
    started.notify_one();
    finish.notified().await;
    Ok(amount)
}

/// A redelivery whose arguments fingerprint otherwise (a rolling deploy that
/// changed the handler) meets the record of a delivery still running; the
/// engine reads the record to tell a running one from a finished one. When
/// that read fails, the message is nak'd like any store failure, not
/// terminated as poison: the running delivery may yet fail and release the
/// key (hunt: it was terminated, and once the first delivery failed the
/// message was never processed).
#[tokio::test]
async fn a_mismatch_whose_record_cannot_be_read_is_nakd_not_terminated() {
    let store = Hooked::new(UnreadableRecords);
    let (started, finish) = (tokio::sync::Notify::new(), tokio::sync::Notify::new());
    let first = bill(&store, "msg-5", 1, &started, &finish);
    let redelivered = async {
        started.notified().await;
        let handled = handle(Some("msg-5"), |key| bill(&store, key, 2, &started, &finish)).await;
        finish.notify_one();
        handled
    };
    let (first, redelivered) = tokio::join!(first, redelivered);
    assert_eq!(first.expect("the first delivery"), 1);
    assert!(
        matches!(redelivered.result, Some(Err(Error::FingerprintMismatch(_)))),
        "{:?}",
        redelivered.result
    );
    assert_eq!(
        (redelivered.verdict, redelivered.disposition()),
        (Verdict::Failed, Disposition::Nak(None)),
        "a mismatch whose record could not be read is nak'd, not terminated"
    );
}

/// A transactional call refused because its transaction cannot hold the
/// record (a snapshot older than the record, or no transaction at all) ran
/// nothing and holds no record: a failure the redelivery retries in a new
/// transaction, nak'd with the growing delay of failures, never taken for
/// another delivery at work (`InProgress`, a fixed delay) nor for poison.
#[tokio::test]
async fn a_transaction_that_cannot_hold_the_record_is_a_failure() {
    let refusals = [
        Error::StaleSnapshot {
            scope: "contract_edges.consumer.tx".into(),
            store: "sqlite",
        },
        Error::NotInTransaction {
            scope: "contract_edges.consumer.tx".into(),
            store: "postgres",
        },
    ];
    for refusal in refusals {
        let why = refusal.to_string();
        let handled = handle(Some("msg-tx"), |_key| async move { Err::<u32, _>(refusal) }).await;
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Failed, Disposition::Nak(None)),
            "{why}"
        );
        assert_eq!(
            handled.with_deliveries(3).disposition(),
            Disposition::Nak(Some(idempotent_runtime::consumer::failed_retry_after(3))),
            "{why}"
        );
    }
}

/// The framework's error wrapped in an error of the handler's own that
/// names it as its `source()` (context added on the way out: `thiserror`'s
/// `#[source]`), inside a boxed error or an `io::Error`.
#[derive(Debug, thiserror::Error)]
#[error("billing order {order}")]
struct Billing {
    order: &'static str,
    #[source]
    source: Error,
}

static RATIOS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "contract_edges.consumer.ratio", key = key, tenant = shared,
             store = store, in_progress = reject)]
async fn ratio(store: &MemoryStore, key: &str, amount: u32) -> Result<f64, Error> {
    RATIOS.fetch_add(1, Ordering::SeqCst);
    let _ = amount;
    Ok(f64::NAN)
}

#[idempotent(scope = "contract_edges.consumer.priced", key = key, tenant = shared,
             store = store, in_progress = reject)]
async fn priced(store: &MemoryStore, key: &str, amount: u32) -> Result<u32, Error> {
    Ok(amount)
}

fn boxed(e: Error) -> Box<dyn std::error::Error + Send + Sync> {
    Box::new(Billing {
        order: "o-1",
        source: e,
    })
}

/// Context around an `io::Error` that holds the framework's error (an
/// annotated function returning `std::io::Result`): `io::Error`'s own
/// `source()` skips the error it holds.
#[derive(Debug, thiserror::Error)]
#[error("billing order {order}")]
struct BillingIo {
    order: &'static str,
    #[source]
    source: std::io::Error,
}

fn boxed_io(e: Error) -> Box<dyn std::error::Error + Send + Sync> {
    Box::new(BillingIo {
        order: "o-1",
        source: e.into(),
    })
}

fn io(e: Error) -> std::io::Error {
    std::io::Error::other(Billing {
        order: "o-1",
        source: e,
    })
}

/// A refusal the handler wrapped in context is still the framework's: a
/// result that can never be recorded is terminated after its one run (not
/// nak'd, which ran the body again at every delivery), a reused id is
/// poison, a bad id is refused, and only a plain failure is nak'd.
#[tokio::test]
async fn a_refusal_wrapped_in_the_handlers_own_error_keeps_its_verdict() {
    let store = MemoryStore::new();
    let unrecordable = handle(Some("msg-nan"), |key| async {
        ratio(&store, key, 1).await.map_err(boxed)
    })
    .await;
    assert_eq!(
        (unrecordable.verdict, unrecordable.disposition()),
        (Verdict::Unrecordable, Disposition::Term),
        "{:?}",
        unrecordable.result
    );
    let unrecordable = handle(Some("msg-nan"), |key| async {
        ratio(&store, key, 1).await.map_err(io)
    })
    .await;
    assert_eq!(unrecordable.verdict, Verdict::Unrecordable);
    let unrecordable = handle(Some("msg-nan"), |key| async {
        ratio(&store, key, 1).await.map_err(boxed_io)
    })
    .await;
    assert_eq!(unrecordable.verdict, Verdict::Unrecordable);
    assert_eq!(
        RATIOS.load(Ordering::SeqCst),
        3,
        "one run per delivery that came"
    );

    priced(&store, "msg-p", 1).await.expect("first");
    let reused = handle(Some("msg-p"), |key| async {
        priced(&store, key, 2).await.map_err(boxed)
    })
    .await;
    assert_eq!(
        (reused.verdict, reused.disposition()),
        (Verdict::Mismatch, Disposition::Term)
    );
    let reused = handle(Some("msg-p"), |key| async {
        priced(&store, key, 2).await.map_err(io)
    })
    .await;
    assert_eq!(reused.verdict, Verdict::Mismatch);
    let reused = handle(Some("msg-p"), |key| async {
        priced(&store, key, 2).await.map_err(boxed_io)
    })
    .await;
    assert_eq!(reused.verdict, Verdict::Mismatch);
    let bad = handle(Some(""), |key| async {
        priced(&store, key, 2).await.map_err(boxed)
    })
    .await;
    assert_eq!(bad.verdict, Verdict::InvalidKey);
    let own = handle(Some("msg-own"), |_key| async {
        Err::<u32, _>(std::io::Error::other("ledger down"))
    })
    .await;
    assert_eq!(own.verdict, Verdict::Failed);
}

/// An error whose `source()` is itself (a bad implementation) is looked
/// through a bounded number of times: the delivery is a failure, the
/// consumer does not spin.
#[tokio::test]
async fn an_error_that_is_its_own_source_is_a_failure_not_a_hang() {
    #[derive(Debug)]
    struct Looping;
    impl std::fmt::Display for Looping {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("looping")
        }
    }
    impl std::error::Error for Looping {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(self)
        }
    }
    let handled = handle(Some("msg-loop"), |_key| async {
        Err::<u32, Box<dyn std::error::Error + Send + Sync>>(Box::new(Looping))
    })
    .await;
    assert_eq!(handled.verdict, Verdict::Failed);
}

/// The order's stock, held by whichever message of the order gets it first.
#[idempotent(scope = "contract_edges.consumer.hold_stock", key = order, tenant = shared,
             store = store, in_progress = reject)]
async fn hold_stock(store: &MemoryStore, order: &str) -> Result<u32, Error> {
    Ok(1)
}

/// `errors = record`: a refused address is this message's final answer. The
/// body holds the order's stock first, through a nested annotated call.
#[idempotent(scope = "contract_edges.consumer.ship", key = key, tenant = tenant,
             store = store, in_progress = reject, errors = record, skip(stock, shipped))]
async fn ship(
    store: &dyn Store,
    stock: &MemoryStore,
    shipped: &AtomicUsize,
    tenant: &str,
    key: &str,
    order: &str,
) -> Result<u32, ShippingError> {
    hold_stock(stock, order).await?;
    shipped.fetch_add(1, Ordering::SeqCst);
    Ok(4)
}

/// The same in transactional mode.
#[idempotent(scope = "contract_edges.consumer.ship_tx", key = key, tenant = tenant,
             tx = tx, in_progress = reject, errors = record, skip(stock, shipped))]
async fn ship_tx(
    tx: &mut sqlx::SqliteConnection,
    stock: &MemoryStore,
    shipped: &AtomicUsize,
    tenant: &str,
    key: &str,
    order: &str,
) -> Result<u32, ShippingError> {
    hold_stock(stock, order).await?;
    shipped.fetch_add(1, Ordering::SeqCst);
    Ok(4)
}

/// Holds the order's stock as another message of the order would: its
/// record in progress.
async fn stock_held(stock: &MemoryStore, order: &str) -> Identity {
    let held = Identity::shared("contract_edges.consumer.hold_stock", order).unwrap();
    let hour = std::time::Duration::from_secs(3600);
    crate::common::records::acquire(stock, &held, None, hour, hour).await;
    held
}

fn assert_redelivered(handled: &Handled<u32, ShippingError>, on: &str) {
    assert!(
        matches!(handled.disposition(), Disposition::Nak(_)),
        "{on}: the stock was only held for now and the message never shipped, yet it is {} ({:?}, {:?})",
        handled.disposition(),
        handled.verdict,
        handled.result
    );
}

/// A body whose nested call is refused for now (another message of the same
/// order holds the stock: `InProgress`) returns that refusal as its own
/// error; under `errors = record` it cannot be recorded (the framework's
/// error is not serializable: `#[serde(skip)]`), so the key is released, as
/// for any error that is not recorded. The message must come again (nak):
/// it was terminated as a result that can never be recorded, and never
/// shipped. On every store, and in transactional mode.
#[tokio::test]
async fn a_nested_refusal_an_error_policy_cannot_record_is_redelivered_not_terminated() {
    let sqlite = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    let mut stores: Vec<(&str, Box<dyn Store>)> = vec![
        ("memory", Box::new(MemoryStore::new())),
        ("sqlite", Box::new(sqlite.clone())),
    ];
    if let Some(pg) = crate::common::servers::pg_store_or_skip().await {
        stores.push(("postgres", Box::new(pg)));
    }
    if let Some(mysql) = crate::common::servers::mysql_store_or_skip().await {
        stores.push(("mariadb", Box::new(mysql)));
    }
    for (on, store) in &stores {
        let store: &dyn Store = store.as_ref();
        let (stock, shipped) = (MemoryStore::new(), AtomicUsize::new(0));
        let tenant = crate::common::servers::fresh_tenant();
        let held = stock_held(&stock, "order-7").await;
        let handled = handle(Some("msg-7"), |key| {
            ship(store, &stock, &shipped, &tenant, key, "order-7")
        })
        .await;
        assert_redelivered(&handled, on);
        let shipment = Identity::new(&tenant, "contract_edges.consumer.ship", "msg-7").unwrap();
        assert!(
            store.fetch(&shipment).await.unwrap().is_none(),
            "{on}: the error was not recorded, the key is free"
        );
        // The other message lets the stock go: the redelivery ships.
        stock.force_release(&held, false).await.unwrap();
        let again = handle(Some("msg-7"), |key| {
            ship(store, &stock, &shipped, &tenant, key, "order-7")
        })
        .await;
        assert_eq!(
            (again.verdict, again.disposition()),
            (Verdict::Executed, Disposition::Ack),
            "{on}"
        );
        assert_eq!(shipped.load(Ordering::SeqCst), 1, "{on}");
        let _ = store.force_release(&shipment, false).await;
    }

    // Transactional mode: the handler commits what the call wrote.
    let (stock, shipped) = (MemoryStore::new(), AtomicUsize::new(0));
    let tenant = crate::common::servers::fresh_tenant();
    let held = stock_held(&stock, "order-8").await;
    let deliver = || {
        handle(Some("msg-8"), |key| async {
            let mut tx = sqlite.pool().begin().await.map_err(|e| {
                ShippingError::Idempotency(Error::Store(StoreError::new("test", "begin", e)))
            })?;
            let shipped = ship_tx(&mut tx, &stock, &shipped, &tenant, key, "order-8").await;
            tx.commit().await.expect("commit");
            shipped
        })
    };
    let handled = deliver().await;
    assert_redelivered(&handled, "sqlite, transactional");
    stock.force_release(&held, false).await.unwrap();
    let again = deliver().await;
    assert_eq!(
        (again.verdict, again.disposition()),
        (Verdict::Executed, Disposition::Ack)
    );
    assert_eq!(shipped.load(Ordering::SeqCst), 1);
    sqlite.pool().close().await;
}

/// A step whose body calls `ratio` (a result that can never be recorded)
/// and returns its refusal as its own error: the inner body's effect
/// happened, and every redelivery would run it again.
#[idempotent(scope = "contract_edges.consumer.ratio_step", key = key, tenant = shared,
             store = store, in_progress = reject)]
async fn ratio_step(store: &MemoryStore, key: &str) -> Result<f64, ShippingError> {
    Ok(ratio(store, key, 2).await?)
}

/// The refusal of a result that can never be recorded keeps its verdict
/// when an outer annotated call returns it as its own (released) error:
/// terminated, not redelivered to run the inner body again.
#[tokio::test]
async fn a_nested_result_that_can_never_be_recorded_is_terminated_through_the_outer_call() {
    let store = MemoryStore::new();
    let runs = RATIOS.load(Ordering::SeqCst);
    let handled = handle(Some("msg-nested-nan"), |key| ratio_step(&store, key)).await;
    assert_eq!(
        (handled.verdict, handled.disposition()),
        (Verdict::Unrecordable, Disposition::Term),
        "{:?}",
        handled.result
    );
    assert!(RATIOS.load(Ordering::SeqCst) > runs, "the inner body ran");
}
