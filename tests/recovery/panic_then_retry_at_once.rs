//! Rules 14 and 20: in a scope with a `recover` hook, a body that panics
//! ends its record's lease before the panic reaches the caller (the call
//! itself is still running, not dropped), so a retry made as soon as the
//! caller has caught the panic takes the record over at once and asks the
//! hook, even under `in_progress = reject`, where nothing waits a live lease
//! out. Without a hook the panic releases the record, and that retry runs
//! the body. On every store.

use crate::common;

use idempotent_runtime::{
    idempotent, with_outcome, Error, MemoryStore, Outcome, Recovery, SqliteStore, Store, Takeover,
};
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

/// The attempts the hook was asked about, per tenant.
static ASKED: LazyLock<Mutex<HashMap<String, Vec<u32>>>> = LazyLock::new(Default::default);

async fn found(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(takeover.tenant().to_owned())
        .or_default()
        .push(takeover.attempt());
    Ok(Recovery::Completed(42))
}

#[idempotent(scope = "recovery.panic_then_retry", key = key, tenant = tenant, store = store,
             skip(panics), in_progress = reject, recover = found)]
async fn charge(store: &dyn Store, tenant: &str, key: &str, panics: bool) -> Result<u32, Error> {
    if panics {
        panic!("the gateway client panicked after charging");
    }
    Ok(1)
}

/// The same scope without a hook: the panic releases the record.
#[idempotent(scope = "recovery.panic_then_retry_released", key = key, tenant = tenant,
             store = store, skip(panics), in_progress = reject)]
async fn charge_released(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    panics: bool,
) -> Result<u32, Error> {
    if panics {
        panic!("the gateway client panicked before charging");
    }
    Ok(1)
}

async fn retried_at_once(store: &dyn Store) {
    let name = store.name();
    // Without a hook: released before the panic reaches the caller, so the
    // retry right after runs the body (rule 14), not `InProgress`.
    let tenant = format!("panic-release-{}", uuid::Uuid::new_v4().simple());
    let panicked = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(charge_released(
        store, &tenant, "k", true,
    )))
    .await;
    assert!(panicked.is_err(), "{name}: the body's panic propagates");
    let (got, outcome) = with_outcome(charge_released(store, &tenant, "k", false)).await;
    assert!(
        matches!((&got, outcome), (Ok(1), Some(Outcome::Executed))),
        "{name}: the retry right after the panic runs the body: {got:?} {outcome:?}"
    );

    let name = store.name();
    let tenant = format!("panic-retry-{}", uuid::Uuid::new_v4().simple());
    let panicked = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(charge(
        store, &tenant, "k", true,
    )))
    .await;
    assert!(panicked.is_err(), "{name}: the body's panic propagates");
    let (got, outcome) = with_outcome(charge(store, &tenant, "k", false)).await;
    assert!(
        matches!((&got, outcome), (Ok(42), Some(Outcome::Recovered))),
        "{name}: the retry right after the panic took the record over and asked the hook: \
         {got:?} {outcome:?}"
    );
    let asked = ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&tenant)
        .cloned();
    assert_eq!(asked.as_deref(), Some(&[2][..]), "{name}");
}

#[tokio::test]
async fn memory_a_retry_right_after_a_panic_asks_the_hook() {
    retried_at_once(&MemoryStore::new()).await;
}

#[tokio::test]
async fn sqlite_a_retry_right_after_a_panic_asks_the_hook() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("panic_then_retry"))
        .await
        .expect("sqlite");
    retried_at_once(&store).await;
}

#[tokio::test]
async fn postgres_a_retry_right_after_a_panic_asks_the_hook() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    retried_at_once(&store).await;
}

#[tokio::test]
async fn mysql_a_retry_right_after_a_panic_asks_the_hook() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    retried_at_once(&store).await;
}
