//! Rules 14 and 20 together: a call of a scope with a `recover` hook that
//! ends without an answer while its body runs (dropped by a timeout around
//! it, or a body that panics) may have left its side effect behind, as an
//! owner that died would have. The record is not released (the next call
//! would be a fresh attempt that runs the body blind, charging again): its
//! lease is ended, so the next call takes it over at once and asks the hook.

use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, MemoryStore, Outcome, Recovery, SqliteStore, Store,
    Takeover,
};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

#[derive(Default)]
struct Gateway {
    /// Charges made per key.
    charges: HashMap<String, u32>,
    /// The attempts the hook was asked about, per key.
    asked: HashMap<String, Vec<u32>>,
    /// Told when a key is charged (per key: the tests of this file share
    /// the gateway when they run in one process, as under `cargo test`).
    charged: HashMap<String, Arc<Notify>>,
}

static GATEWAY: LazyLock<Mutex<Gateway>> = LazyLock::new(Default::default);

fn gateway() -> std::sync::MutexGuard<'static, Gateway> {
    GATEWAY.lock().unwrap_or_else(|p| p.into_inner())
}

/// What tells that `key` was charged.
fn charged(key: &str) -> Arc<Notify> {
    gateway().charged.entry(key.to_owned()).or_default().clone()
}

async fn find_charge(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    let mut g = gateway();
    let key = takeover.key().to_owned();
    g.asked
        .entry(key.clone())
        .or_default()
        .push(takeover.attempt());
    Ok(match g.charges.get(&key) {
        Some(&n) if n > 0 => Recovery::Completed(n),
        _ => Recovery::Run,
    })
}

/// How the first attempt ends after charging.
#[derive(Clone, Copy, PartialEq)]
enum Then {
    /// Waits for the gateway's answer for ever (the caller's timeout drops it).
    Hang,
    Panic,
    Return,
}

#[idempotent(scope = "recovery.dropped_body", key = key, tenant = shared, store = store,
             skip(then), lease = "30s", recover = find_charge)]
async fn charge(store: &dyn Store, key: &str, then: Then) -> Result<u32, Error> {
    let n = {
        let mut g = gateway();
        let n = g.charges.entry(key.to_owned()).or_default();
        *n += 1;
        *n
    };
    charged(key).notify_one();
    match then {
        Then::Hang => std::future::pending().await,
        Then::Panic => panic!("the gateway client panicked after charging"),
        Then::Return => Ok(n),
    }
}

/// The first attempt charges and ends without an answer (`first`); the
/// retry asks the hook, which finds the charge: recovered, charged once.
/// Waits (at most `bound`) until `identity`'s record has no live lease:
/// released, or its lease ended.
async fn no_live_lease(
    store: &dyn Store,
    identity: &Identity,
    bound: Duration,
) -> Result<(), tokio::time::error::Elapsed> {
    tokio::time::timeout(bound, async {
        loop {
            match store.fetch(identity).await.expect("fetch") {
                Some(r) if r.lease_expires_at_ms.is_some_and(|l| l > r.now_ms) => {}
                _ => return,
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

async fn ended_without_an_answer_then_retried(store: &dyn Store, first: Then) {
    let key = format!("k-{}", uuid::Uuid::new_v4());
    match first {
        Then::Hang => {
            let charged = charged(&key);
            let mut call = Box::pin(charge(store, &key, Then::Hang));
            tokio::select! {
                () = charged.notified() => {}
                answer = &mut call => panic!("the first attempt hangs: {answer:?}"),
            }
            drop(call); // the caller's timeout
        }
        Then::Panic => {
            let panicked = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(charge(
                store,
                &key,
                Then::Panic,
            )))
            .await;
            assert!(panicked.is_err(), "the body's panic propagates");
        }
        Then::Return => unreachable!(),
    }
    // The dropped call's record is finished by the store's worker: until it
    // has been (released, or its lease ended), a retry would be refused.
    let identity = Identity::shared("recovery.dropped_body", key.as_str()).expect("identity");
    no_live_lease(store, &identity, Duration::from_secs(30))
        .await
        .expect("the first attempt's record is finished");

    let retried = with_outcome(charge(store, &key, Then::Return)).await;
    charged_once_and_the_hook_asked(&key);
    assert!(
        matches!(retried, (Ok(1), Some(Outcome::Recovered))),
        "{retried:?}"
    );
}

/// The gateway charged `key` once, and the hook was asked about attempt 2.
fn charged_once_and_the_hook_asked(key: &str) {
    let g = gateway();
    assert_eq!(g.charges.get(key), Some(&1), "charged once");
    assert_eq!(
        g.asked.get(key).map(Vec::as_slice),
        Some(&[2][..]),
        "the hook was asked"
    );
}

/// The attempts `slow_hook` was asked about, per key.
static HOOK_ASKED: LazyLock<Mutex<HashMap<String, Vec<u32>>>> = LazyLock::new(Default::default);
static HOOK_WAITING: Notify = Notify::const_new();

/// Asked about attempt 2, it never answers (the caller's timeout drops the
/// call); asked again, it finds the charge.
async fn slow_hook(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    HOOK_ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(takeover.key().to_owned())
        .or_default()
        .push(takeover.attempt());
    if takeover.attempt() == 2 {
        HOOK_WAITING.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(Recovery::Completed(99))
}

#[idempotent(scope = "recovery.dropped_hook", key = key, tenant = shared, store = store,
             lease = "60s", recover = slow_hook)]
async fn charge_then_panic(store: &dyn Store, key: &str) -> Result<u32, Error> {
    panic!("the gateway client panicked after charging {key}")
}

/// Rules 14 and 20: a call dropped while its recover hook runs ends the
/// record's lease, as one dropped while its body runs does, so the next call
/// takes it over at once and asks the hook again. It left the record in
/// progress with the lease the takeover had just renewed (60 s here): every
/// retry was refused `InProgress` until it ran out (model hunt).
async fn dropped_while_the_hook_runs(store: &dyn Store) {
    let key = format!("k-{}", uuid::Uuid::new_v4());
    let identity = Identity::shared("recovery.dropped_hook", key.as_str()).expect("identity");
    let lease_ended = || no_live_lease(store, &identity, Duration::from_secs(10));
    let panicked = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
        charge_then_panic(store, &key),
    ))
    .await;
    assert!(panicked.is_err(), "the body's panic propagates");
    lease_ended()
        .await
        .expect("the first attempt's lease is ended");
    {
        let mut call = Box::pin(charge_then_panic(store, &key));
        tokio::select! {
            () = HOOK_WAITING.notified() => {}
            answer = &mut call => panic!("the hook never answers attempt 2: {answer:?}"),
        }
        drop(call); // the caller's timeout, while the hook runs
    }
    lease_ended()
        .await
        .expect("a call dropped while its hook ran ends the record's lease");
    let retried = with_outcome(charge_then_panic(store, &key)).await;
    assert!(
        matches!(retried, (Ok(99), Some(Outcome::Recovered))),
        "{retried:?}"
    );
    let asked = HOOK_ASKED.lock().unwrap_or_else(|p| p.into_inner());
    assert_eq!(asked.get(&key).map(Vec::as_slice), Some(&[2, 3][..]));
}

async fn both(store: &dyn Store) {
    ended_without_an_answer_then_retried(store, Then::Hang).await;
    ended_without_an_answer_then_retried(store, Then::Panic).await;
    dropped_while_the_hook_runs(store).await;
    answer_panicked_while_it_was_recorded(store).await;
}

/// A receipt whose `Serialize` panics the first time it is asked (the
/// engine serializes an answer to record it, after the body ran).
#[derive(Debug, PartialEq, serde::Deserialize)]
struct Receipt(u32);

static RECEIPT_PANICS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl serde::Serialize for Receipt {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if RECEIPT_PANICS.swap(false, std::sync::atomic::Ordering::SeqCst) {
            panic!("the receipt's serializer panicked");
        }
        s.serialize_u32(self.0)
    }
}

async fn find_receipt(takeover: &Takeover) -> Result<Recovery<Receipt>, Error> {
    let n = find_charge(takeover).await?;
    Ok(match n {
        Recovery::Completed(n) => Recovery::Completed(Receipt(n)),
        Recovery::Run => Recovery::Run,
    })
}

#[idempotent(scope = "recovery.answer_panicked", key = key, tenant = shared, store = store,
             lease = "30s", recover = find_receipt)]
async fn charge_for_a_receipt(store: &dyn Store, key: &str) -> Result<Receipt, Error> {
    let mut g = gateway();
    let n = g.charges.entry(key.to_owned()).or_default();
    *n += 1;
    Ok(Receipt(*n))
}

/// The body charged and answered, then recording its answer panicked (the
/// answer's own `Serialize`): as for a body that panics, the record's lease
/// is ended, and the retry asks the hook (which finds the charge) instead
/// of being a fresh attempt that charges again.
async fn answer_panicked_while_it_was_recorded(store: &dyn Store) {
    let key = format!("k-{}", uuid::Uuid::new_v4());
    RECEIPT_PANICS.store(true, std::sync::atomic::Ordering::SeqCst);
    let panicked = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
        charge_for_a_receipt(store, &key),
    ))
    .await;
    assert!(panicked.is_err(), "the serializer's panic propagates");
    let identity = Identity::shared("recovery.answer_panicked", key.as_str()).expect("identity");
    no_live_lease(store, &identity, Duration::from_secs(30))
        .await
        .expect("the first attempt's record is finished");
    assert!(
        store.fetch(&identity).await.expect("fetch").is_some(),
        "the record is kept for the hook, not released"
    );

    let retried = with_outcome(charge_for_a_receipt(store, &key)).await;
    charged_once_and_the_hook_asked(&key);
    assert!(
        matches!(retried, (Ok(Receipt(1)), Some(Outcome::Recovered))),
        "{retried:?}"
    );
}

#[tokio::test]
async fn memory() {
    both(&MemoryStore::new()).await;
}

#[tokio::test]
async fn sqlite() {
    let store = SqliteStore::connect(&crate::common::scratch::sqlite_url("dropped"))
        .await
        .expect("sqlite");
    both(&store).await;
}

#[tokio::test]
async fn postgres() {
    let Some(store) = crate::common::servers::pg_store_or_skip().await else {
        return;
    };
    both(&store).await;
}

#[tokio::test]
async fn mysql() {
    let Some(store) = crate::common::servers::mysql_store_or_skip().await else {
        return;
    };
    both(&store).await;
}

/// A store whose first release fails (a connection reset).
#[derive(Default)]
struct FirstReleaseFails(std::sync::atomic::AtomicBool);

#[async_trait::async_trait]
impl crate::common::hooked::Intercept for FirstReleaseFails {
    async fn release(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &idempotent_runtime::OwnerToken,
    ) -> Result<idempotent_runtime::Fenced, idempotent_runtime::StoreError> {
        if !self.0.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Err(idempotent_runtime::StoreError::new(
                "hooked",
                "release",
                "connection reset",
            ));
        }
        inner.release(i, t).await
    }
}

async fn find_no_charge(_: &Takeover) -> Result<Recovery<u32>, Declined> {
    Ok(Recovery::Run)
}

#[idempotent(scope = "recovery.declined", key = key, tenant = shared, store = store,
             lease = "30s", recover = find_no_charge)]
async fn declined(store: &dyn Store, key: &str) -> Result<u32, Declined> {
    let _ = (store, key);
    Err(Declined)
}

/// The gateway's refusal.
#[derive(Debug)]
struct Declined;

impl From<Error> for Declined {
    fn from(_: Error) -> Self {
        Declined
    }
}

/// A body's `Err` is an answer, not an uncertain outcome (rule 13): its
/// record is released even when the release statement fails (the store's
/// worker makes it), never kept for the hook as a dropped call's is.
#[tokio::test]
async fn a_body_error_whose_release_fails_is_still_released() {
    let store = crate::common::hooked::Hooked::new(FirstReleaseFails::default());
    let key = format!("k-{}", uuid::Uuid::new_v4());
    let identity = Identity::shared("recovery.declined", key.as_str()).expect("identity");
    assert!(declined(&store, &key).await.is_err());
    tokio::time::timeout(Duration::from_secs(30), async {
        while store.fetch(&identity).await.expect("fetch").is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the record is released, not kept in progress for a takeover");
}

/// Hangs every renewal that ends a lease while `hang` is set, once it has
/// said so on `ending`.
#[derive(Default)]
struct EndingTheLeaseHangs {
    hang: std::sync::atomic::AtomicBool,
    ending: Notify,
}

#[async_trait::async_trait]
impl crate::common::hooked::Intercept for EndingTheLeaseHangs {
    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &idempotent_runtime::OwnerToken,
        lease: Duration,
    ) -> Result<idempotent_runtime::Fenced, idempotent_runtime::StoreError> {
        if lease.is_zero() && self.hang.load(std::sync::atomic::Ordering::SeqCst) {
            self.ending.notify_one();
            std::future::pending::<()>().await;
        }
        inner.heartbeat(i, t, lease).await
    }
}

static DECLINING_RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Asked about attempt 2, it fails (the error is not recorded: the record is
/// kept for the next takeover); asked again, it finds the charge.
async fn failing_hook(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    match takeover.attempt() {
        2 => Err(Error::Store(idempotent_runtime::StoreError::new(
            "gateway",
            "look up the charge",
            "the gateway did not answer",
        ))),
        _ => Ok(Recovery::Completed(5)),
    }
}

#[idempotent(scope = "recovery.failing_hook", key = key, tenant = shared, store = store,
             lease = "60s", recover = failing_hook)]
async fn charge_once_then_panic(store: &dyn Store, key: &str) -> Result<u32, Error> {
    DECLINING_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    panic!("the gateway client panicked after charging {key}")
}

/// Rule 20: a hook's error that is not recorded keeps the record for the next
/// takeover (its lease ended). A call dropped while that lease is being ended
/// must leave the record so, never release it: released, the next call was a
/// fresh attempt that ran the body blind (a review of the guard kept armed
/// through the hook).
#[tokio::test]
async fn a_call_dropped_while_a_hook_error_keeps_the_record_does_not_release_it() {
    let store = crate::common::hooked::Hooked::new(EndingTheLeaseHangs::default());
    let key = format!("k-{}", uuid::Uuid::new_v4());
    let identity = Identity::shared("recovery.failing_hook", key.as_str()).expect("identity");
    let panicked = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
        charge_once_then_panic(&store, &key),
    ))
    .await;
    assert!(panicked.is_err(), "the body's panic propagates");
    store
        .intercept
        .hang
        .store(true, std::sync::atomic::Ordering::SeqCst);
    {
        let mut call = Box::pin(charge_once_then_panic(&store, &key));
        tokio::select! {
            () = store.intercept.ending.notified() => {}
            answer = &mut call => panic!("ending the lease hangs: {answer:?}"),
        }
        drop(call); // the caller's timeout, while the lease is being ended
    }
    store
        .intercept
        .hang
        .store(false, std::sync::atomic::Ordering::SeqCst);
    no_live_lease(&store, &identity, Duration::from_secs(10))
        .await
        .expect("the store's worker ends the lease");
    assert!(
        store.fetch(&identity).await.expect("fetch").is_some(),
        "the record is kept for the next takeover, not released"
    );
    let retried = with_outcome(charge_once_then_panic(&store, &key)).await;
    assert!(
        matches!(retried, (Ok(5), Some(Outcome::Recovered))),
        "{retried:?}"
    );
    assert_eq!(
        DECLINING_RUNS.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the body ran once"
    );
}
