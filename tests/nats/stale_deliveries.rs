//! Deliveries that outlive their `ack_wait`: JetStream redelivers the message
//! while the first delivery's handler still runs, so two deliveries of one
//! message settle it, in whatever order their answers come. The later answer
//! of the older delivery must still count.

use crate::common;
use crate::nats_consumer::{json, order, pulled_in_turn, settled, BillError, Order, TestStream};

use async_nats::jetstream;
use common::servers::{fresh_tenant, mysql_store_or_skip, nats_or_skip, pg_store_or_skip};
use futures_util::StreamExt;
use idempotent_runtime::consumer::nats::{message_key, process};
use idempotent_runtime::consumer::{Disposition, Verdict};
use idempotent_runtime::{idempotent, Identity, MemoryStore, SqliteStore, Store};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

const SCOPE: &str = "nats.stale.billing";

/// The handler's side: its first body waits at `gate`, then fails (the key
/// is released) when `first_fails`, or counts the effect; later bodies count
/// the effect.
struct Ledger {
    first_fails: bool,
    begun: AtomicUsize,
    effects: AtomicUsize,
    entered: Semaphore,
    gate: Semaphore,
}

/// A lease far longer than the consumer's 1 s `ack_wait`: a redelivery that
/// finds the first delivery running is nak'd for the rest of it.
#[idempotent(scope = "nats.stale.billing", key = msg_id, tenant = tenant, store = store,
             in_progress = reject, lease = "30s", skip(ledger))]
async fn bill(
    store: &dyn Store,
    ledger: &Ledger,
    tenant: &str,
    msg_id: &str,
    order: &Order,
) -> Result<u64, BillError> {
    let nth = ledger.begun.fetch_add(1, Ordering::SeqCst);
    ledger.entered.add_permits(1);
    if nth == 0 {
        // Bounded: a handshake that never comes fails the counts, it does not hang.
        let _ = tokio::time::timeout(Duration::from_secs(20), ledger.gate.acquire()).await;
        if ledger.first_fails {
            return Err(BillError::LedgerDown);
        }
    }
    ledger.effects.fetch_add(1, Ordering::SeqCst);
    let _ = order;
    Ok(7)
}

async fn next_message(
    messages: &mut (impl futures_util::Stream<Item = Result<jetstream::Message, impl std::fmt::Debug>>
              + Unpin),
    within: Duration,
    what: &str,
) -> jetstream::Message {
    tokio::time::timeout(within, messages.next())
        .await
        .unwrap_or_else(|_| panic!("{what} within {within:?}"))
        .expect("the message stream goes on")
        .expect("a message")
}

/// One store's run: the first delivery's body outlives the 1 s `ack_wait`,
/// its redelivery is nak'd as in progress for the rest of the 30 s lease,
/// and then the first body answers, on the first delivery's reply subject:
/// * `first_fails`: its nak (a second) brings the message back, which runs
///   and is acked, long before the redelivery's nak would have let it come
///   back;
/// * otherwise: its ack settles the message, and nothing comes back.
///
/// Had the later answer of the older delivery not counted, the message would
/// have waited out the lease.
async fn answering_late(js: &jetstream::Context, name: &str, store: &dyn Store, first_fails: bool) {
    let tenant = fresh_tenant();
    let ledger = Ledger {
        first_fails,
        begun: AtomicUsize::new(0),
        effects: AtomicUsize::new(0),
        entered: Semaphore::new(0),
        gate: Semaphore::new(0),
    };
    let label = format!(
        "HCONS_LATE_{}_{}",
        name.to_uppercase(),
        if first_fails { "FAILS" } else { "ACKS" }
    );
    let stream = TestStream::create(js, &label).await;
    let consumer = stream.durable("hcons-late", Duration::from_secs(1)).await;
    stream.publish("s-1", json(&order("o-1", 100))).await;
    let mut messages = pulled_in_turn(&consumer, 1);
    let first = next_message(&mut messages, Duration::from_secs(10), "a delivery").await;
    let o: Order = serde_json::from_slice(&first.payload).unwrap();
    let handling_first = process(&first, |k| bill(store, &ledger, &tenant, k, &o));
    let meanwhile = async {
        let _ = ledger.entered.acquire().await.expect("entered");
        let again = next_message(
            &mut messages,
            Duration::from_secs(10),
            &format!("{label}: a redelivery once ack_wait ran out"),
        )
        .await;
        assert_eq!(message_key(&again), Some("s-1"));
        let duplicate = process(&again, |k| bill(store, &ledger, &tenant, k, &o))
            .await
            .expect("the nak is sent");
        // Let the first body go on only once the nak is out.
        ledger.gate.add_permits(1);
        duplicate
    };
    let (handled, duplicate) = tokio::join!(handling_first, meanwhile);
    let held_back = match duplicate.disposition() {
        Disposition::Nak(Some(delay)) => delay,
        other => panic!("{label}: the redelivery was {other}, not nak'd with a delay"),
    };
    assert!(
        matches!(duplicate.verdict, Verdict::InProgress { .. })
            && held_back > Duration::from_secs(20),
        "{label}: the redelivery found the message running, with most of the lease left: {:?}",
        duplicate.verdict
    );
    let handled = handled.expect("the answer is sent");
    let identity = Identity::new(&tenant, SCOPE, "s-1").unwrap();
    if first_fails {
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (
                Verdict::Failed,
                Disposition::Nak(Some(Duration::from_secs(1)))
            ),
            "{label}"
        );
        assert!(
            store.fetch(&identity).await.unwrap().is_none(),
            "{label}: the failed body released the key"
        );
        // Far less than the redelivery's nak: only the first delivery's nak
        // brings the message back this soon.
        let third = next_message(
            &mut messages,
            Duration::from_secs(12),
            "the message back after the first delivery's nak",
        )
        .await;
        let handled = process(&third, |k| bill(store, &ledger, &tenant, k, &o))
            .await
            .expect("the ack is sent");
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Executed, Disposition::Ack),
            "{label}"
        );
    } else {
        assert_eq!(
            (handled.verdict, handled.disposition()),
            (Verdict::Executed, Disposition::Ack),
            "{label}"
        );
    }
    // Settled: nothing pending, nothing waiting for an ack, so nothing comes
    // back. Within far less than the redelivery's nak.
    let deadline = Instant::now() + Duration::from_secs(12);
    while !settled(&consumer).await {
        assert!(
            Instant::now() < deadline,
            "{label}: the message was not settled by the older delivery's answer"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ledger.effects.load(Ordering::SeqCst), 1, "{label}");
    let bodies = if first_fails { 2 } else { 1 };
    assert_eq!(ledger.begun.load(Ordering::SeqCst), bodies, "{label}");
    let _ = store.force_release(&identity, false).await;
    drop(messages);
    stream.delete().await;
}

/// A delivery that outlives `ack_wait` answers after its redelivery was
/// nak'd for the rest of the running call's lease: its failure brings the
/// message back after its own short nak (and it runs once), its success
/// settles the message at once. On every store, side by side (each run
/// its own stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_answering_after_its_redelivery_was_nakd_in_progress_settles_the_message() {
    let Some(js) = nats_or_skip().await else {
        return;
    };
    let dir = common::scratch::dir("nats-late");
    let sqlite = SqliteStore::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.join("late.db").display()
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
    if let Some(mysql) = mysql_store_or_skip().await {
        stores.push(("mariadb", Box::new(mysql)));
    }
    let runs = stores.iter().flat_map(|(name, store)| {
        [true, false].map(|fails| answering_late(&js, name, store.as_ref(), fails))
    });
    tokio::time::timeout(
        Duration::from_secs(60),
        futures_util::future::join_all(runs),
    )
    .await
    .expect("finished within 60 s");
    sqlite.pool().close().await;
}
