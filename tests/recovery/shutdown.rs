//! Rules 14 and 20 together: a call in a scope with a `recover` hook whose
//! runtime is shut down while its body runs. The store, not the dying
//! runtime, finishes the record: it is not released (the body may have done
//! its side effect) but its lease is ended, so the next call takes it over
//! at once, as attempt 2, and asks the hook, instead of waiting out a lease
//! of an hour or running the body blind as a fresh attempt 1.

use crate::common::scratch::sqlite_url;
use crate::common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, MemoryStore, Outcome, RecordState, Recovery,
    SqliteStore, Store, Takeover,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// How long the store's work for the dropped call may take (only ever waited
/// for, through `finish_background_work`).
const BOUND: Duration = Duration::from_secs(20);

async fn found(t: &Takeover) -> Result<Recovery<u32>, Error> {
    Ok(Recovery::Completed(t.attempt() * 100))
}

#[idempotent(scope = "recovery.shutdown", key = key, tenant = tenant, store = store,
             skip(started), lease = "1h", in_progress = reject, recover = found)]
async fn charge_forever(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    started: Option<&Notify>,
) -> Result<u32, Error> {
    if let Some(started) = started {
        started.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(1)
}

/// The store opened on a runtime of its own (kept alive, idle); the call on
/// another, shut down mid-body; the record looked at from a third.
fn shut_down_mid_body(open: impl std::future::Future<Output = Option<Arc<dyn Store>>>) {
    let home = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let Some(store) = home.block_on(open) else {
        return;
    };
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "recovery.shutdown", "k").expect("identity");
    let doomed = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let started = Arc::new(Notify::new());
    let (held, who, notify) = (store.clone(), tenant.clone(), started.clone());
    doomed.spawn(async move {
        let _ = charge_forever(held.as_ref(), &who, "k", Some(&notify)).await;
    });
    doomed.block_on(async {
        tokio::time::timeout(BOUND, started.notified())
            .await
            .expect("the call did not reach its body")
    });
    drop(doomed); // the call's future is dropped with its runtime

    let checker = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    checker.block_on(async {
        let left = store.finish_background_work(BOUND).await;
        assert_eq!(
            left,
            0,
            "{}: the store finished the dropped call",
            store.name()
        );
        let kept = store
            .fetch(&identity)
            .await
            .expect("fetch")
            .unwrap_or_else(|| panic!("{}: the record was released", store.name()));
        assert_eq!(
            (kept.state, kept.attempt),
            (RecordState::InProgress, 1),
            "{}",
            store.name()
        );
        assert!(
            kept.lease_expires_at_ms
                .is_some_and(|end| end <= kept.now_ms),
            "{}: its lease was ended: {kept:?}",
            store.name()
        );
        let (answer, outcome) =
            with_outcome(charge_forever(store.as_ref(), &tenant, "k", None)).await;
        assert_eq!(
            (answer.expect("the hook's answer"), outcome),
            (200, Some(Outcome::Recovered)),
            "{}: the next call took the record over as attempt 2 and asked the hook",
            store.name()
        );
    });
    drop(home);
}

#[test]
fn memory_a_call_shut_down_mid_body_leaves_its_record_to_the_hook() {
    shut_down_mid_body(async { Some(Arc::new(MemoryStore::new()) as Arc<dyn Store>) });
}

#[test]
fn sqlite_a_call_shut_down_mid_body_leaves_its_record_to_the_hook() {
    shut_down_mid_body(async {
        let store = SqliteStore::connect(&sqlite_url("recovery-shutdown"))
            .await
            .expect("open");
        Some(Arc::new(store) as Arc<dyn Store>)
    });
}

#[test]
fn postgres_a_call_shut_down_mid_body_leaves_its_record_to_the_hook() {
    shut_down_mid_body(async {
        pg_store_or_skip()
            .await
            .map(|s| Arc::new(s) as Arc<dyn Store>)
    });
}

#[test]
fn mysql_a_call_shut_down_mid_body_leaves_its_record_to_the_hook() {
    shut_down_mid_body(async {
        mysql_store_or_skip()
            .await
            .map(|s| Arc::new(s) as Arc<dyn Store>)
    });
}
