//! Rule 14's last sentence on the database servers: a dropped call's
//! release that cannot be made (the database unreachable for as long as the
//! store's background worker tries) is logged and counted
//! (`metrics::snapshot().release_failures`), and the lease bounds the
//! damage: the record stays in progress under the dropped call, never freed
//! nor recorded as something else, and once its lease has run out the next
//! call takes it over and runs. On PostgreSQL and MariaDB, each through a
//! fault proxy that takes the server away (`go_down`) as the call is dropped.

use crate::common::proxy::FaultProxy;
use crate::common::servers::fresh_tenant;
use crate::connection_faults::through_a_proxy;
use idempotent_runtime::{
    idempotent, metrics, with_outcome, Error, Identity, Outcome, RecordState, Store,
};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

const SCOPE: &str = "faults.release_outage";

/// The first run of the body stops at its crash point for good (the call is
/// dropped there); later runs answer their run number.
#[derive(Default)]
struct Gate {
    runs: AtomicU32,
    reached: Notify,
}

#[idempotent(scope = "faults.release_outage", key = key, tenant = tenant, store = store,
             skip(gate), lease = "2s", in_progress = reject)]
async fn held(store: &dyn Store, tenant: &str, key: &str, gate: &Gate) -> Result<u32, Error> {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if run == 1 {
        gate.reached.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(run)
}

async fn release_in_an_outage(proxy: FaultProxy, store: Arc<dyn Store>, direct: Arc<dyn Store>) {
    let name = store.name();
    let tenant = fresh_tenant();
    let id = Identity::new(&tenant, SCOPE, "k").expect("identity");
    let gate = Gate::default();
    let mut call = Box::pin(held(&*store, &tenant, "k", &gate));
    tokio::select! {
        _ = &mut call => panic!("{name}: the first run stops at its crash point"),
        _ = gate.reached.notified() => {}
    }
    let before = metrics::snapshot().release_failures;
    proxy.go_down();
    drop(call);
    assert_eq!(
        store.finish_background_work(Duration::from_secs(120)).await,
        0,
        "{name}: the worker gives the release up"
    );
    assert!(
        metrics::snapshot().release_failures > before,
        "{name}: a release that could not be made is counted"
    );
    let kept = direct
        .fetch(&id)
        .await
        .expect("fetch")
        .expect("the record is kept");
    assert_eq!(
        (kept.state, kept.attempt),
        (RecordState::InProgress, 1),
        "{name}: still the dropped call's"
    );

    proxy.pass_through();
    // Bounded wait for the lease to run out on the database's clock.
    let mut lapsed = false;
    for _ in 0..3_000 {
        let s = direct.fetch(&id).await.expect("fetch").expect("record");
        if s.lease_expires_at_ms.is_some_and(|l| l <= s.now_ms) {
            lapsed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(lapsed, "{name}: the lease ran out within 15 s");
    let (got, how) = with_outcome(held(&*store, &tenant, "k", &gate)).await;
    assert_eq!(
        (got.expect("taken over"), how),
        (2, Some(Outcome::Executed)),
        "{name}: the lease bounded the damage"
    );
    let (got, how) = with_outcome(held(&*direct, &tenant, "k", &gate)).await;
    assert_eq!((got.expect("replayed"), how), (2, Some(Outcome::Replayed)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_release_that_cannot_be_made_is_counted_and_the_lease_bounds_it() {
    let Some((proxy, store)) = through_a_proxy::postgres(2).await else {
        return;
    };
    let Some(direct) = crate::common::servers::pg_store_or_skip().await else {
        return;
    };
    release_in_an_outage(proxy, Arc::new(store), Arc::new(direct)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_release_that_cannot_be_made_is_counted_and_the_lease_bounds_it() {
    let Some((proxy, store)) = through_a_proxy::mariadb(2).await else {
        return;
    };
    let Some(direct) = crate::common::servers::mysql_store_or_skip().await else {
        return;
    };
    release_in_an_outage(proxy, Arc::new(store), Arc::new(direct)).await;
}
