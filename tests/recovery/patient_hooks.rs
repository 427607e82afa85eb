//! Rule 20 on every store (memory, SQLite, PostgreSQL, MariaDB), as
//! `hook_outlives_lease.rs` checks it on the memory store with a paused
//! clock: a takeover's hook runs under the call's lease, renewed by the
//! heartbeat. While a hook takes longer than two leases on the store's own
//! clock, the record stays the call's (attempt 2, its lease ahead), a
//! duplicate is refused as in progress instead of taking it over, and the
//! hook's `Completed` answer is then recorded and replayed; the body never
//! runs.

use crate::common::servers::{every_store, fresh_tenant};
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, Outcome, RecordState, Recovery, Store, Takeover,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Per tenant: told when its hook is asking, and let it answer.
/// Asking, and may answer.
type Gate = Arc<(Notify, Notify)>;
static GATES: LazyLock<Mutex<HashMap<String, Gate>>> = LazyLock::new(Default::default);
static BODIES: AtomicUsize = AtomicUsize::new(0);

fn gate(tenant: &str) -> Gate {
    GATES
        .lock()
        .unwrap()
        .entry(tenant.to_owned())
        .or_default()
        .clone()
}

async fn patient(t: &Takeover) -> Result<Recovery<String>, Error> {
    let gate = gate(t.tenant());
    gate.0.notify_one();
    gate.1.notified().await;
    Ok(Recovery::Completed(format!("found {}", t.key())))
}

#[idempotent(scope = "huntb.patient_hook", key = key, tenant = tenant, store = store,
             lease = "2s", in_progress = reject, recover = patient)]
async fn ship(store: &dyn Store, tenant: &str, key: &str) -> Result<String, Error> {
    BODIES.fetch_add(1, Ordering::SeqCst);
    Ok("shipped by the body".to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_that_takes_longer_than_two_leases_keeps_the_record_on_every_store() {
    let lease_ms = 2000;
    for (name, store) in every_store("patient_hooks").await {
        let store: &dyn Store = &*store;
        let tenant = fresh_tenant();
        let identity = Identity::new(tenant.as_str(), "huntb.patient_hook", "k").unwrap();
        // A crashed owner's record: in progress, its lease soon over.
        crate::common::records::crashed(store, &identity).await;
        let mut polls = 0;
        loop {
            let s = store.fetch(&identity).await.unwrap().expect("record");
            if s.lease_expires_at_ms.is_none_or(|l| l <= s.now_ms) {
                break;
            }
            polls += 1;
            assert!(polls < 1000, "{name}: the planted lease never ran out");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let gate = gate(&tenant);
        let asking = gate.0.notified();
        let first = with_outcome(ship(store, &tenant, "k"));
        let rest = async {
            asking.await;
            let started = store
                .fetch(&identity)
                .await
                .unwrap()
                .expect("record")
                .attempt_started_at_ms;
            // Until the store's clock shows two leases since the takeover
            // (bounded); all the while the record is the hook's call's.
            let mut polls = 0;
            loop {
                let s = store.fetch(&identity).await.unwrap().expect("record");
                assert_eq!((s.state, s.attempt), (RecordState::InProgress, 2), "{name}");
                if s.now_ms - started > 2 * lease_ms {
                    break;
                }
                polls += 1;
                assert!(polls < 1200, "{name}: the store's clock did not move on");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let duplicate = ship(store, &tenant, "k").await;
            gate.1.notify_one();
            duplicate
        };
        let ((got, outcome), duplicate) =
            tokio::time::timeout(Duration::from_secs(90), async { tokio::join!(first, rest) })
                .await
                .expect("both calls end");
        assert!(
            matches!(duplicate, Err(Error::InProgress { .. })),
            "{name}: the record of a hook still asking was taken over: {duplicate:?}"
        );
        assert_eq!(
            (got.expect("recovered"), outcome),
            ("found k".to_owned(), Some(Outcome::Recovered)),
            "{name}"
        );
        let (again, outcome) = with_outcome(ship(store, &tenant, "k")).await;
        assert_eq!(
            (again.expect("replayed"), outcome),
            ("found k".to_owned(), Some(Outcome::Replayed)),
            "{name}"
        );
        let s = store.fetch(&identity).await.unwrap().expect("record");
        assert_eq!(
            (s.state, s.attempt, s.recovered),
            (RecordState::Complete, 2, true),
            "{name}"
        );
    }
    assert_eq!(BODIES.load(Ordering::SeqCst), 0, "the body never ran");
}
