//! Rules 20 and 21 on every store (memory, SQLite, PostgreSQL, MariaDB): two
//! functions claiming one scope on purpose (`shared_scope`), both with a
//! `recover` hook. Run at once on one key they make one body run in total,
//! and the other call gets its answer; a call of one claimant dropped
//! mid-body is taken over by the other, whose hook is asked (attempt 2) and
//! answers for both; when the hook finds nothing, the other claimant's body
//! runs as attempt 2.

use crate::common::ledger::Ledger;
use crate::common::servers::{every_store, fresh_tenant};
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, Outcome, RecordState, Recovery, Store, Takeover,
};
use std::time::Duration;
use tokio::sync::watch;

const SCOPE: &str = "huntb.shared_refund";

/// Refunds made by bodies, by tenant: what the hook asks (the provider).
static REFUNDED: Ledger<String> = Ledger::new();
/// What the hook was asked, by tenant: (key, attempt).
static ASKED: Ledger<(String, u32)> = Ledger::new();

fn refunded(tenant: &str) -> Vec<String> {
    REFUNDED.of(tenant)
}

fn asked(tenant: &str) -> Vec<(String, u32)> {
    ASKED.of(tenant)
}

async fn refund_happened(t: &Takeover) -> Result<Recovery<String>, Error> {
    ASKED.record(t.tenant(), (t.key().to_owned(), t.attempt()));
    Ok(if refunded(t.tenant()).iter().any(|k| k == t.key()) {
        Recovery::Completed(format!("found {} at the provider", t.key()))
    } else {
        Recovery::Run
    })
}

/// Says when a body has started (a count), and holds it until `go`.
struct Gate {
    entered: watch::Sender<usize>,
    go: watch::Sender<bool>,
}

impl Gate {
    fn new(open: bool) -> Self {
        Gate {
            entered: watch::channel(0).0,
            go: watch::channel(open).0,
        }
    }

    async fn wait_entered(&self, n: usize) {
        let mut rx = self.entered.subscribe();
        tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|&v| v >= n))
            .await
            .expect("a body started within a minute")
            .expect("gate alive");
    }

    async fn body(&self, tenant: &str, key: &str, by: &str) -> String {
        REFUNDED.record(tenant, key.to_owned());
        self.entered.send_modify(|n| *n += 1);
        let _ = self.go.subscribe().wait_for(|&g| g).await;
        format!("refunded {key} ({by})")
    }
}

/// The foreground path.
#[idempotent(scope = "huntb.shared_refund", key = order, tenant = shop, store = store,
             shared_scope, recover = refund_happened, skip(gate),
             lease = "30s", in_progress = wait("60s"))]
async fn refund_http(
    store: &dyn Store,
    shop: &str,
    order: &str,
    amount: u64,
    gate: &Gate,
) -> Result<String, Error> {
    let _ = amount;
    Ok(gate.body(shop, order, "http").await)
}

/// The background path: the same refund delivered from a queue.
#[idempotent(scope = "huntb.shared_refund", key = order, tenant = shop, store = store,
             shared_scope, recover = refund_happened, skip(gate, delivery),
             lease = "30s", in_progress = wait("60s"))]
async fn refund_from_queue(
    store: &dyn Store,
    shop: &str,
    order: &str,
    amount: u64,
    delivery: u32,
    gate: &Gate,
) -> Result<String, Error> {
    let _ = (amount, delivery);
    Ok(gate.body(shop, order, "queue").await)
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within a minute"))
}

/// Both claimants called at once on each of a few keys: one body per key
/// in total, and both calls answer the same value (one ran it, the other
/// replayed it); the hook is never asked (nothing was taken over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_claimants_at_once_on_one_key_run_one_body_on_every_store() {
    for (name, store) in every_store("shared_claimants").await {
        let tenant = fresh_tenant();
        for round in 0..4 {
            let key = format!("order-{round}");
            let gate = Gate::new(false);
            let store: &dyn Store = &*store;
            let http = with_outcome(refund_http(store, &tenant, &key, 500, &gate));
            let queue = with_outcome(refund_from_queue(store, &tenant, &key, 500, round, &gate));
            let opener = async {
                gate.wait_entered(1).await;
                gate.go.send_replace(true);
            };
            let ((h, ho), (q, qo), ()) =
                within("two claimants", async { tokio::join!(http, queue, opener) }).await;
            let (h, q) = (h.expect("http"), q.expect("queue"));
            assert_eq!(h, q, "{name} {key}: one answer for both claimants");
            let mut outcomes = [ho, qo];
            outcomes.sort_by_key(|o| format!("{o:?}"));
            assert_eq!(
                outcomes,
                [Some(Outcome::Executed), Some(Outcome::Replayed)],
                "{name} {key}"
            );
            assert_eq!(*gate.entered.borrow(), 1, "{name} {key}: one body in total");
        }
        assert_eq!(refunded(&tenant).len(), 4, "{name}");
        assert!(asked(&tenant).is_empty(), "{name}: nothing was taken over");
        // A different amount through either claimant is another request.
        let gate = Gate::new(true);
        assert!(
            matches!(
                refund_from_queue(&*store, &tenant, "order-0", 900, 9, &gate).await,
                Err(Error::FingerprintMismatch(_))
            ),
            "{name}"
        );
    }
}

/// A call of one claimant dropped mid-body (after its side effect) leaves
/// the record for a takeover; the other claimant takes it over, its hook is
/// asked as attempt 2 and finds the refund, and its answer is recorded for
/// both claimants. When the dropped body had not made its side effect, the
/// other claimant's hook answers `Run` and its body runs as attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_call_of_one_claimant_is_recovered_by_the_other_on_every_store() {
    for (name, store) in every_store("shared_claimants").await {
        let store: &dyn Store = &*store;
        let tenant = fresh_tenant();

        // The side effect made, then the call dropped.
        let held = Gate::new(false);
        let mut call = Box::pin(refund_http(store, &tenant, "done", 500, &held));
        tokio::select! {
            out = &mut call => panic!("{name}: the call ended before it was held: {out:?}"),
            () = held.wait_entered(1) => {}
        }
        drop(call);
        let open = Gate::new(true);
        let (got, outcome) = within(
            "the queue's takeover",
            with_outcome(refund_from_queue(store, &tenant, "done", 500, 1, &open)),
        )
        .await;
        assert_eq!(
            (got.expect("recovered"), outcome),
            (
                "found done at the provider".to_owned(),
                Some(Outcome::Recovered)
            ),
            "{name}"
        );
        assert_eq!(
            *open.entered.borrow(),
            0,
            "{name}: the body did not run again"
        );
        let (got, outcome) = within(
            "the http replay",
            with_outcome(refund_http(store, &tenant, "done", 500, &open)),
        )
        .await;
        assert_eq!(
            (got.expect("replayed"), outcome),
            (
                "found done at the provider".to_owned(),
                Some(Outcome::Replayed)
            ),
            "{name}"
        );
        let identity = Identity::new(tenant.as_str(), SCOPE, "done").unwrap();
        let s = store.fetch(&identity).await.unwrap().expect("record");
        assert_eq!(
            (s.state, s.attempt, s.recovered),
            (RecordState::Complete, 2, true),
            "{name}"
        );

        // No side effect yet when dropped (the queue's call this time): the
        // http claimant's hook answers Run and its body runs as attempt 2.
        let held = Gate::new(false);
        let mut call = Box::pin(refund_from_queue(store, &tenant, "not-done", 500, 2, &held));
        tokio::select! {
            out = &mut call => panic!("{name}: the call ended before it was held: {out:?}"),
            () = held.wait_entered(1) => {}
        }
        drop(call);
        assert!(!refunded(&tenant).is_empty(), "refunds");
        REFUNDED.forget(&tenant, &"not-done".to_owned());
        let (got, outcome) = within(
            "the http takeover",
            with_outcome(refund_http(store, &tenant, "not-done", 500, &open)),
        )
        .await;
        assert_eq!(
            (got.expect("ran"), outcome),
            (
                "refunded not-done (http)".to_owned(),
                Some(Outcome::Executed)
            ),
            "{name}"
        );
        let (got, outcome) = within(
            "the queue's replay",
            with_outcome(refund_from_queue(store, &tenant, "not-done", 500, 3, &open)),
        )
        .await;
        assert_eq!(
            (got.expect("replayed"), outcome),
            (
                "refunded not-done (http)".to_owned(),
                Some(Outcome::Replayed)
            ),
            "{name}"
        );
        let identity = Identity::new(tenant.as_str(), SCOPE, "not-done").unwrap();
        let s = store.fetch(&identity).await.unwrap().expect("record");
        assert_eq!(
            (s.state, s.attempt, s.recovered),
            (RecordState::Complete, 2, false),
            "{name}"
        );
        assert_eq!(
            asked(&tenant),
            [("done".to_owned(), 2), ("not-done".to_owned(), 2)],
            "{name}: asked once per takeover, as attempt 2"
        );
    }
}
