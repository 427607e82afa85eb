//! The behaviour contract (DESIGN.md §4, rules 1–14 and 16's expiry-as-absent),
//! exercised through `#[idempotent]` functions against any store.
//!
//! A test file picks one store and writes
//! `contract_tests!(async { Some(store) });` — `None` means the store's server is
//! unreachable and the tests say so loudly and pass (unless
//! `IDEMPOTENT_REQUIRE_SERVERS=1`, where the factory itself must panic).
//! Every test uses its own tenant (a fresh UUID), so a database shared with other
//! tests, or left over from earlier runs, changes nothing.

#![allow(dead_code)]

use idempotent_runtime::{idempotent, Error, Store};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    pub charge_id: String,
    pub amount: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
pub enum ChargeError {
    #[error("card declined: {0}")]
    Declined(String),
    #[error("gateway unavailable")]
    Unavailable,
    #[error("idempotency: {0}")]
    Idempotency(String),
}

impl From<Error> for ChargeError {
    fn from(e: Error) -> Self {
        ChargeError::Idempotency(format!("{e:?}"))
    }
}

/// A tenant no other test uses.
pub fn fresh_tenant() -> String {
    format!("t-{}", uuid::Uuid::new_v4())
}

pub fn receipt(runs: &AtomicUsize, amount: u64) -> Receipt {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    Receipt {
        charge_id: format!("ch_{n}_{}", uuid::Uuid::new_v4().simple()),
        amount,
    }
}

// ---- the annotated functions the tests call ------------------------------------

#[idempotent(scope = "contract.charge", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<Receipt, Error> {
    Ok(receipt(runs, amount))
}

/// Same signature, another scope: the same key here is another record.
#[idempotent(scope = "contract.refund", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn refund(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<Receipt, Error> {
    Ok(receipt(runs, amount))
}

#[idempotent(scope = "contract.slow", key = key, tenant = tenant, store = store,
             skip(runs, pause_ms), in_progress = wait("20s"))]
pub async fn slow_charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
    pause_ms: u64,
) -> Result<Receipt, Error> {
    let r = receipt(runs, amount);
    tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
    Ok(r)
}

#[idempotent(scope = "contract.slow_reject", key = key, tenant = tenant, store = store,
             skip(runs, pause_ms), in_progress = reject)]
pub async fn slow_charge_reject(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    pause_ms: u64,
) -> Result<Receipt, Error> {
    let r = receipt(runs, 1);
    tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
    Ok(r)
}

/// Runs until the test opens `gate` by closing it (a closed semaphore lets
/// every waiter through at once, and every later one).
#[idempotent(scope = "contract.short_lease", key = key, tenant = tenant, store = store,
             skip(runs, gate), lease = "1500ms", in_progress = reject)]
pub async fn short_lease(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    gate: &tokio::sync::Semaphore,
) -> Result<Receipt, Error> {
    let r = receipt(runs, 1);
    // Err once closed: that is the signal.
    let _ = gate.acquire().await;
    Ok(r)
}

/// Waits on a gate the test controls, so the test can stop polling mid-body.
#[idempotent(scope = "contract.gated", key = key, tenant = tenant, store = store,
             skip(runs, gate), lease = "300ms", in_progress = reject)]
pub async fn gated(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    gate: &tokio::sync::Notify,
) -> Result<Receipt, Error> {
    let r = receipt(runs, 1);
    gate.notified().await;
    Ok(r)
}

#[idempotent(scope = "contract.fallible", key = key, tenant = tenant, store = store, skip(runs, outcome))]
pub async fn fallible(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    outcome: Result<u64, ChargeError>,
) -> Result<Receipt, ChargeError> {
    let r = receipt(runs, 0);
    outcome.map(|amount| Receipt { amount, ..r })
}

#[idempotent(scope = "contract.recorded_errors", key = key, tenant = tenant, store = store,
             skip(runs, outcome), errors = record)]
pub async fn recording(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    outcome: Result<u64, ChargeError>,
) -> Result<Receipt, ChargeError> {
    let r = receipt(runs, 0);
    outcome.map(|amount| Receipt { amount, ..r })
}

pub fn is_final(e: &ChargeError) -> bool {
    matches!(e, ChargeError::Declined(_))
}

#[idempotent(scope = "contract.record_if", key = key, tenant = tenant, store = store,
             skip(runs, outcome), errors = record_if(is_final))]
pub async fn record_if_final(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    outcome: Result<u64, ChargeError>,
) -> Result<Receipt, ChargeError> {
    let r = receipt(runs, 0);
    outcome.map(|amount| Receipt { amount, ..r })
}

#[idempotent(scope = "contract.panics", key = key, tenant = tenant, store = store, skip(runs, explode))]
pub async fn may_panic(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    explode: bool,
) -> Result<Receipt, Error> {
    let r = receipt(runs, 0);
    if explode {
        panic!("the body panicked on purpose");
    }
    Ok(r)
}

// Long enough that the retry right after the first call replays even on a
// loaded machine (a stall past the ttl between the two calls would execute
// it again), short enough to wait out.
#[idempotent(scope = "contract.ttl", key = key, tenant = tenant, store = store, skip(runs), ttl = "2s")]
pub async fn short_ttl(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<Receipt, Error> {
    Ok(receipt(runs, 0))
}

/// A value whose serialization fails (like a map with non-string keys would).
#[derive(Debug, Deserialize)]
pub struct Unrecordable;

impl Serialize for Unrecordable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "this value refuses to be serialized",
        ))
    }
}

#[idempotent(scope = "contract.unrecordable", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn unrecordable(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<Unrecordable, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Unrecordable)
}

#[idempotent(scope = "contract.big", key = key, tenant = tenant, store = store, skip(runs, size))]
pub async fn big_result(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    size: usize,
) -> Result<String, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok("x".repeat(size))
}

#[idempotent(scope = "contract.shared", key = key, tenant = shared, store = store, skip(runs))]
pub async fn shared_charge(
    store: &dyn Store,
    key: &str,
    runs: &AtomicUsize,
) -> Result<Receipt, Error> {
    Ok(receipt(runs, 0))
}

#[idempotent(scope = "contract.unfingerprinted", key = key, tenant = tenant, store = store,
             fingerprint = false)]
pub async fn unfingerprinted(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<Receipt, Error> {
    Ok(receipt(runs, amount))
}

/// A float argument: `+inf`, `-inf`, `NaN` and a finite value are four requests.
#[idempotent(scope = "contract.float", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn float_charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: f64,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) as u64 + 1)
}

/// An optional float: `None` is a fifth value, distinct from `NaN`.
#[idempotent(scope = "contract.maybe_float", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn maybe_float_charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: Option<f64>,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) as u64 + 1)
}

/// A set argument: equal sets are one request, whatever their iteration order.
#[idempotent(scope = "contract.set", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn set_charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    items: std::collections::HashSet<String>,
    by_item: std::collections::HashMap<(u8, String), u32>,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) as u64 + 1)
}

/// Only a set: the one argument kind whose v1 form was lossless but
/// order-dependent, so old records of it are compared by v1's rules.
#[idempotent(scope = "contract.set_only", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn set_only_charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    items: std::collections::HashSet<String>,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) as u64 + 1)
}

/// Returns a value JSON cannot carry (rule 12).
#[idempotent(scope = "contract.non_finite", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn non_finite_result(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<f64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(f64::INFINITY)
}

/// A receipt serde writes and cannot read back: a `u128` inside
/// `#[serde(flatten)]` (serde buffers flattened content, without 128-bit
/// integers), whatever its value.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct FlatReceipt {
    pub id: u64,
    #[serde(flatten)]
    pub money: FlatMoney,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct FlatMoney {
    pub cents: u128,
}

/// Returns a [`FlatReceipt`] (rule 12).
#[idempotent(scope = "contract.unreadable", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn unreadable_result(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<FlatReceipt, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(FlatReceipt {
        id: 1,
        money: FlatMoney { cents: 500 },
    })
}

/// An error serde writes and cannot read back: a field skipped when empty
/// without `#[serde(default)]`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Declined {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// Unrecordable error type for [`unreadable_error`]: the library's errors
/// convert into it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub enum DeclinedOr {
    Declined(Declined),
    Library(String),
}

impl From<Error> for DeclinedOr {
    fn from(e: Error) -> Self {
        DeclinedOr::Library(e.to_string())
    }
}

/// Records its error (`errors = record`): a [`Declined`] with an empty reason.
#[idempotent(scope = "contract.unreadable_error", key = key, tenant = tenant, store = store,
             skip(runs), errors = record)]
pub async fn unreadable_error(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, DeclinedOr> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(DeclinedOr::Declined(Declined {
        reason: String::new(),
    }))
}

/// A receipt serde reads back as *another* value: a flattened `Option` of a
/// struct whose fields all have defaults comes back `Some` when it was
/// `None`; a field skipped when zero comes back as its `default` (1).
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChangingReceipt {
    pub id: u64,
    #[serde(flatten)]
    pub note: Option<Note>,
    #[serde(default = "one", skip_serializing_if = "is_zero")]
    pub copies: u32,
    /// Order-free parts: written again in another order, still equal;
    /// also through a `Serialize` that does not say it is a set.
    pub tags: std::collections::HashSet<String>,
    pub by_tag: std::collections::HashMap<String, u32>,
    #[serde(serialize_with = "as_list")]
    pub listed: std::collections::HashSet<String>,
    /// A set written into one string (as `serde_with::StringWithSeparator`
    /// does), in its own order each time.
    #[serde(serialize_with = "as_joined", deserialize_with = "from_joined")]
    pub joined: std::collections::HashSet<String>,
    /// `Whole(7)` is written `7`, which the `Float` variant, tried first,
    /// reads back as `Float(7.0)`.
    pub amount: Amount,
}

/// An amount in one of two forms, told apart by serde only by what reads.
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Amount {
    Float(f64),
    Whole(u64),
}

fn as_joined<S: serde::Serializer>(
    set: &std::collections::HashSet<String>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let parts: Vec<&str> = set.iter().map(String::as_str).collect();
    serializer.serialize_str(&parts.join(","))
}

fn from_joined<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<std::collections::HashSet<String>, D::Error> {
    let text = <String as serde::Deserialize>::deserialize(deserializer)?;
    Ok(text
        .split(',')
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect())
}

fn as_list<S: serde::Serializer>(
    set: &std::collections::HashSet<String>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(set.iter())
}

#[derive(Debug, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Note {
    #[serde(default)]
    pub text: Option<String>,
}

fn one() -> u32 {
    1
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Returns a [`ChangingReceipt`] (rule 12): `None` note, zero copies, or a
/// whole amount, or (with none of them) one that reads back equal.
#[idempotent(scope = "contract.changing", key = key, tenant = tenant, store = store, skip(runs))]
pub async fn changing_result(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    note: bool,
    copies: u32,
    whole: bool,
    runs: &AtomicUsize,
) -> Result<ChangingReceipt, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    let tags: std::collections::HashSet<String> = (0..16).map(|i| format!("tag-{i}")).collect();
    Ok(ChangingReceipt {
        id: 1,
        note: note.then(Note::default),
        copies,
        by_tag: tags.iter().map(|t| (t.clone(), 1)).collect(),
        listed: tags.clone(),
        joined: tags.clone(),
        tags,
        amount: if whole {
            Amount::Whole(7)
        } else {
            Amount::Float(7.5)
        },
    })
}

/// An error that reads back as another one: its flattened `Option` is `None`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub enum ChangingError {
    Declined {
        code: u32,
        #[serde(flatten)]
        note: Option<Note>,
    },
    Library(String),
}

impl From<Error> for ChangingError {
    fn from(e: Error) -> Self {
        ChangingError::Library(e.to_string())
    }
}

#[idempotent(scope = "contract.changing_error", key = key, tenant = tenant, store = store,
             skip(runs), errors = record)]
pub async fn changing_error(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, ChangingError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(ChangingError::Declined {
        code: 3,
        note: None,
    })
}

/// Equal sets and maps built in different orders, each with its own hasher state.
pub fn set_args(
    n: usize,
    reversed: bool,
) -> (
    std::collections::HashSet<String>,
    std::collections::HashMap<(u8, String), u32>,
) {
    let mut order: Vec<usize> = (0..n).collect();
    if reversed {
        order.reverse();
    }
    let items = order.iter().map(|i| format!("item-{i}")).collect();
    let by_item = order
        .iter()
        .map(|i| ((*i as u8 % 3, format!("sku-{i}")), *i as u32))
        .collect();
    (items, by_item)
}

// ---- the tests ------------------------------------------------------------------

#[macro_export]
macro_rules! contract_tests {
    ($make:expr) => {
        use idempotent_runtime::{with_outcome, Error, Identity, Outcome, Store};
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::time::Duration;
        use $crate::contract::*;

        async fn store() -> Option<Arc<dyn Store>> {
            let made = $make.await;
            match made {
                Some(s) => Some(Arc::new(s) as Arc<dyn Store>),
                None => {
                    eprintln!("SKIPPED: the store's server is unreachable; this contract test did not run");
                    None
                }
            }
        }

        fn id(tenant: &str, scope: &str, key: &str) -> Identity {
            Identity::new(tenant, scope, key).expect("valid identity")
        }

        /// Rules 3–5: of 50 concurrent calls with one identity, exactly one runs
        /// the body; with `wait`, every other call gets the recorded result.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn fifty_concurrent_duplicates_wait_and_replay() {
            let Some(store) = store().await else { return };
            for round in 0..10 {
                let tenant = fresh_tenant();
                let runs = Arc::new(AtomicUsize::new(0));
                let mut tasks = Vec::new();
                for _ in 0..50 {
                    let (store, tenant, runs) = (store.clone(), tenant.clone(), runs.clone());
                    tasks.push(tokio::spawn(async move {
                        with_outcome(slow_charge(&*store, &tenant, "dup-key", 500, &runs, 30)).await
                    }));
                }
                let mut results = Vec::new();
                for t in tasks {
                    results.push(t.await.expect("task"));
                }
                assert_eq!(runs.load(Ordering::SeqCst), 1, "round {round}: the body must run exactly once");
                let executed = results.iter().filter(|(_, o)| *o == Some(Outcome::Executed)).count();
                let replayed = results.iter().filter(|(_, o)| *o == Some(Outcome::Replayed)).count();
                assert_eq!((executed, replayed), (1, 49), "round {round}");
                let first = results[0].0.as_ref().expect("waiting duplicates get the result").clone();
                for (r, _) in &results {
                    assert_eq!(r.as_ref().expect("every call gets the recorded result"), &first);
                }
            }
        }

        /// Rules 3–4 with `in_progress = reject`: one execution; every other call
        /// is refused with InProgress (or, arriving after completion, replays).
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn fifty_concurrent_duplicates_reject() {
            let Some(store) = store().await else { return };
            for round in 0..10 {
                let tenant = fresh_tenant();
                let runs = Arc::new(AtomicUsize::new(0));
                let barrier = Arc::new(tokio::sync::Barrier::new(50));
                let mut tasks = Vec::new();
                for _ in 0..50 {
                    let (store, tenant, runs, barrier) = (store.clone(), tenant.clone(), runs.clone(), barrier.clone());
                    tasks.push(tokio::spawn(async move {
                        barrier.wait().await;
                        with_outcome(slow_charge_reject(&*store, &tenant, "dup-key", &runs, 200)).await
                    }));
                }
                let mut refused = 0;
                let mut executed = 0;
                for t in tasks {
                    match t.await.expect("task") {
                        (Ok(_), Some(Outcome::Executed)) => executed += 1,
                        (Ok(_), Some(Outcome::Replayed)) => {}
                        (Err(Error::InProgress { retry_after, .. }), _) => {
                            // What is left of the running call's lease (the
                            // default 30 s, its body 200 ms): when a retry
                            // may find the record finished or free, not a
                            // made-up moment that would have the caller
                            // hammer the store (a mutation audit found any
                            // positive value accepted). MySQL's clock
                            // readings may add a millisecond or so.
                            assert!(
                                retry_after > Duration::from_secs(20)
                                    && retry_after <= Duration::from_secs(31),
                                "round {round}: retry_after {retry_after:?} is not the lease left"
                            );
                            refused += 1
                        }
                        other => panic!("round {round}: unexpected {other:?}"),
                    }
                }
                assert_eq!(runs.load(Ordering::SeqCst), 1, "round {round}");
                assert_eq!(executed, 1, "round {round}");
                assert!(refused >= 1, "round {round}: duplicates during the body are refused");
            }
        }

        /// Rule 1: the same key from two tenants, or in two scopes, is two records.
        #[tokio::test]
        async fn same_key_other_tenant_or_scope_is_independent() {
            let Some(store) = store().await else { return };
            let (a, b) = (fresh_tenant(), fresh_tenant());
            let runs = AtomicUsize::new(0);
            let ra = charge(&*store, &a, "order-1", 100, &runs).await.unwrap();
            let rb = charge(&*store, &b, "order-1", 100, &runs).await.unwrap();
            let rs = refund(&*store, &a, "order-1", 100, &runs).await.unwrap();
            assert_eq!(runs.load(Ordering::SeqCst), 3, "three identities, three executions");
            assert_ne!(ra, rb);
            assert_ne!(ra, rs);
            // Each replays its own result, never the other's.
            assert_eq!(charge(&*store, &a, "order-1", 100, &runs).await.unwrap(), ra);
            assert_eq!(charge(&*store, &b, "order-1", 100, &runs).await.unwrap(), rb);
            assert_eq!(refund(&*store, &a, "order-1", 100, &runs).await.unwrap(), rs);
            assert_eq!(runs.load(Ordering::SeqCst), 3);
        }

        /// `tenant = shared` is its own namespace, distinct from every tenant.
        #[tokio::test]
        async fn shared_tenant_is_one_namespace() {
            let Some(store) = store().await else { return };
            let runs = AtomicUsize::new(0);
            let key = format!("shared-{}", uuid::Uuid::new_v4());
            let first = shared_charge(&*store, &key, &runs).await.unwrap();
            assert_eq!(shared_charge(&*store, &key, &runs).await.unwrap(), first);
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            assert!(store.fetch(&Identity::shared("contract.shared", key.clone()).unwrap()).await.unwrap().is_some());
        }

        /// Rules 5 and 12: a retry replays an equal value and the body does not run.
        #[tokio::test]
        async fn retry_replays_the_recorded_result() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let (first, o1) = with_outcome(charge(&*store, &t, "k", 250, &runs)).await;
            let (again, o2) = with_outcome(charge(&*store, &t, "k", 250, &runs)).await;
            assert_eq!(first.unwrap(), again.unwrap());
            assert_eq!((o1, o2), (Some(Outcome::Executed), Some(Outcome::Replayed)));
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        }

        /// Rule 7: same identity, different arguments → FingerprintMismatch, the
        /// body does not run and the record is untouched.
        #[tokio::test]
        async fn different_arguments_are_refused_and_the_record_is_untouched() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let first = charge(&*store, &t, "k", 10, &runs).await.unwrap();
            let before = store.fetch(&id(&t, "contract.charge", "k")).await.unwrap();
            let err = charge(&*store, &t, "k", 500, &runs).await.unwrap_err();
            assert!(matches!(err, Error::FingerprintMismatch(_)), "{err:?}");
            assert!(err.to_string().contains("contract.charge"));
            assert!(!err.to_string().contains("\"k\""), "the raw key must not leak into messages");
            let after = store.fetch(&id(&t, "contract.charge", "k")).await.unwrap();
            assert_eq!(before.map(|r| (r.state, r.fingerprint, r.outcome)), after.map(|r| (r.state, r.fingerprint, r.outcome)));
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            assert_eq!(charge(&*store, &t, "k", 10, &runs).await.unwrap(), first, "the original still replays");
        }

        /// Rule 7 while the first call is still running: refused at once, not after waiting.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn mismatch_while_in_progress_is_refused() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = Arc::new(AtomicUsize::new(0));
            let first = {
                let (store, t, runs) = (store.clone(), t.clone(), runs.clone());
                tokio::spawn(async move { slow_charge(&*store, &t, "k", 1, &runs, 600).await })
            };
            while store.fetch(&id(&t, "contract.slow", "k")).await.unwrap().is_none() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let err = slow_charge(&*store, &t, "k", 2, &runs, 0).await.unwrap_err();
            assert!(matches!(err, Error::FingerprintMismatch(_)), "{err:?}");
            first.await.unwrap().unwrap();
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        }

        /// Rule 8: a record without a fingerprint cannot be contradicted.
        #[tokio::test]
        async fn a_record_without_fingerprint_is_not_contradicted() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let first = unfingerprinted(&*store, &t, "k", 10, &runs).await.unwrap();
            let rec = store.fetch(&id(&t, "contract.unfingerprinted", "k")).await.unwrap().unwrap();
            assert_eq!(rec.fingerprint, None);
            // Other arguments, same key: not a conflict, a replay.
            assert_eq!(unfingerprinted(&*store, &t, "k", 999, &runs).await.unwrap(), first);
            assert_eq!(runs.load(Ordering::SeqCst), 1);

            // A fingerprinted call meeting a record stored without a fingerprint
            // (e.g. written before fingerprinting was turned on) replays too.
            let token = idempotent_runtime::OwnerToken::new();
            let legacy = id(&t, "contract.charge", "legacy");
            let req = idempotent_runtime::ReserveRequest {
                identity: &legacy, fingerprint: None, token: &token,
                lease: Duration::from_secs(30), ttl: Duration::from_secs(3600),
            };
            assert!(matches!(store.reserve(req).await.unwrap(), idempotent_runtime::Reservation::Acquired { .. }));
            let old = Receipt { charge_id: "ch_legacy".into(), amount: 7 };
            let outcome = idempotent_runtime::StoredOutcome { is_error: false, payload: serde_json::to_vec(&old).unwrap() };
            assert_eq!(store.complete(idempotent_runtime::Completion::by_body(&legacy, &token, &outcome, Duration::from_secs(3600))).await.unwrap(), idempotent_runtime::Fenced::Written);
            assert_eq!(charge(&*store, &t, "legacy", 12345, &runs).await.unwrap(), old);
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        }

        /// Rules 6 and 7 across versions: a record whose fingerprint carries a
        /// version label this build does not know (a newer build made it, in a
        /// rolling deploy or before a rollback) cannot be compared. The call is
        /// refused for now (retry later), not as a reused key (a client's final
        /// answer); the body does not run and the record is untouched. A record
        /// with a label this build knows and another digest is still a mismatch.
        #[tokio::test]
        async fn a_record_a_newer_version_made_is_refused_for_now_not_as_a_reused_key() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let digest = "0123456789abcdef".repeat(4);
            for (key, label, newer) in [("newer", "v9", true), ("newer-http", "http7", true), ("known", "v2", false)] {
                let identity = id(&t, "contract.charge", key);
                let fingerprint = idempotent_runtime::Fingerprint::from_stored(format!("{label}:{digest}"));
                let token = $crate::common::records::acquire(&*store, &identity, Some(&fingerprint), Duration::from_secs(30), Duration::from_secs(3600)).await;
                let recorded = Receipt { charge_id: format!("ch_{key}"), amount: 7 };
                let outcome = idempotent_runtime::StoredOutcome { is_error: false, payload: serde_json::to_vec(&recorded).unwrap() };
                assert_eq!(store.complete(idempotent_runtime::Completion::by_body(&identity, &token, &outcome, Duration::from_secs(3600))).await.unwrap(), idempotent_runtime::Fenced::Written);
                let before = store.fetch(&identity).await.unwrap().map(|r| (r.state, r.fingerprint, r.outcome));

                let (answer, reported) = with_outcome(charge(&*store, &t, key, 7, &runs)).await;
                let err = answer.unwrap_err();
                if newer {
                    match &err {
                        Error::RecordedByNewerVersion { context, version } => {
                            assert_eq!((context.scope.as_str(), version.as_str()), ("contract.charge", label));
                        }
                        other => panic!("{key}: expected RecordedByNewerVersion, got {other:?}"),
                    }
                    assert!(err.to_string().contains("Retry later"), "{err}");
                    assert!(!err.to_string().contains(&format!("\"{key}\"")), "the raw key must not leak: {err}");
                    assert_eq!(reported, None, "nothing ran or replayed");
                } else {
                    assert!(matches!(err, Error::FingerprintMismatch(_)), "{key}: {err:?}");
                }
                assert_eq!(store.fetch(&identity).await.unwrap().map(|r| (r.state, r.fingerprint, r.outcome)), before, "{key}: untouched");
            }
            assert_eq!(runs.load(Ordering::SeqCst), 0, "no body ran");
        }

        /// Rule 13: `Err` releases by default — the key is free and a retry runs again.
        #[tokio::test]
        async fn an_error_releases_the_key() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let err = fallible(&*store, &t, "k", &runs, Err(ChargeError::Unavailable)).await.unwrap_err();
            assert_eq!(err, ChargeError::Unavailable);
            assert!(store.fetch(&id(&t, "contract.fallible", "k")).await.unwrap().is_none(), "released");
            let ok = fallible(&*store, &t, "k", &runs, Ok(5)).await.unwrap();
            assert_eq!(ok.amount, 5);
            assert_eq!(runs.load(Ordering::SeqCst), 2, "the retry executed");
        }

        /// Rule 13: `errors = record` makes the error the final answer.
        #[tokio::test]
        async fn recorded_errors_replay() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let declined = ChargeError::Declined("insufficient funds".into());
            assert_eq!(recording(&*store, &t, "k", &runs, Err(declined.clone())).await.unwrap_err(), declined);
            let (again, outcome) = with_outcome(recording(&*store, &t, "k", &runs, Ok(1))).await;
            assert_eq!(again.unwrap_err(), declined, "the recorded error is replayed");
            assert_eq!(outcome, Some(Outcome::Replayed));
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        }

        /// `errors = record_if(pred)`: final errors are recorded, transient ones release.
        #[tokio::test]
        async fn record_if_records_only_what_the_predicate_accepts() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            assert_eq!(record_if_final(&*store, &t, "transient", &runs, Err(ChargeError::Unavailable)).await.unwrap_err(), ChargeError::Unavailable);
            assert_eq!(record_if_final(&*store, &t, "transient", &runs, Ok(3)).await.unwrap().amount, 3);
            let declined = ChargeError::Declined("stolen card".into());
            assert_eq!(record_if_final(&*store, &t, "final", &runs, Err(declined.clone())).await.unwrap_err(), declined);
            assert_eq!(record_if_final(&*store, &t, "final", &runs, Ok(3)).await.unwrap_err(), declined);
            assert_eq!(runs.load(Ordering::SeqCst), 3);
        }

        /// Rule 14: a panic releases the record and propagates.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_panic_releases_and_propagates() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = Arc::new(AtomicUsize::new(0));
            let joined = {
                let (store, t, runs) = (store.clone(), t.clone(), runs.clone());
                tokio::spawn(async move { may_panic(&*store, &t, "k", &runs, true).await }).await
            };
            let panic = joined.expect_err("the panic propagates out of the call");
            assert!(panic.is_panic());
            assert!(store.fetch(&id(&t, "contract.panics", "k")).await.unwrap().is_none(), "released");
            may_panic(&*store, &t, "k", &runs, false).await.expect("a retry runs");
            assert_eq!(runs.load(Ordering::SeqCst), 2);
        }

        /// Rule 14: a call dropped mid-body releases promptly — long before its
        /// 30 s lease would have run out.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_dropped_call_releases_promptly() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let mut call = Box::pin(slow_charge(&*store, &t, "k", 1, &runs, 60_000));
            // Drive the call until its body has started (a handshake on the run
            // counter, not a guess at how long the reservation takes), then drop
            // it, as a timeout or a disconnected client would.
            let started_by = tokio::time::Instant::now() + Duration::from_secs(30);
            while runs.load(Ordering::SeqCst) == 0 {
                assert!(tokio::time::Instant::now() < started_by, "the body did not start in 30 s");
                if let Ok(r) = tokio::time::timeout(Duration::from_millis(5), call.as_mut()).await {
                    panic!("a 60 s body finished: {r:?}");
                }
            }
            drop(call);
            assert_eq!(runs.load(Ordering::SeqCst), 1, "the body had started");
            let rid = id(&t, "contract.slow", "k");
            let mut released = false;
            // Bounded well below the 30 s lease: only a release frees the key
            // this early (an expired lease leaves the record in place).
            for _ in 0..750 {
                if store.fetch(&rid).await.unwrap().is_none() {
                    released = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(released, "the dropped call's record was not released (lease is 30 s, we waited 15 s)");
            slow_charge(&*store, &t, "k", 1, &runs, 0).await.expect("a retry runs at once");
            assert_eq!(runs.load(Ordering::SeqCst), 2);
        }

        /// Rule 9: a body running 3× its lease keeps it (the heartbeat renews it).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_long_body_keeps_its_lease() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = Arc::new(AtomicUsize::new(0));
            // The owner's body runs until the gate opens: the test, not a
            // timer, decides that it is still running when each duplicate comes.
            let gate = Arc::new(tokio::sync::Semaphore::new(0));
            let first = {
                let (store, t, runs, gate) = (store.clone(), t.clone(), runs.clone(), gate.clone());
                tokio::spawn(async move { short_lease(&*store, &t, "k", &runs, &gate).await })
            };
            for _ in 0..1000 {
                if runs.load(Ordering::SeqCst) == 1 { break; }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(runs.load(Ordering::SeqCst), 1, "the owner's body is running");
            // Duplicates through three leases' time are refused, never take over.
            // (The lease is long enough that a machine busy with other tests
            // still renews it in time: a renewal more than a second late
            // would let a duplicate take over, rightly.)
            let started = std::time::Instant::now();
            while started.elapsed() < Duration::from_millis(4500) {
                tokio::time::sleep(Duration::from_millis(500)).await;
                // A duplicate that took the record over would run the body
                // and wait on the gate: bounded, so that shows as a failure.
                let duplicate = tokio::time::timeout(
                    Duration::from_secs(10),
                    short_lease(&*store, &t, "k", &runs, &gate),
                )
                .await
                .expect("a duplicate answered (one that took over would wait on the gate)");
                assert!(
                    matches!(duplicate, Err(Error::InProgress { .. })),
                    "a duplicate during the owner's body got {duplicate:?}"
                );
            }
            gate.close();
            first.await.unwrap().expect("the owner completes: it never lost the lease");
            assert_eq!(runs.load(Ordering::SeqCst), 1, "nobody took over a live lease");
        }

        /// Rules 9–10: a call that stops being polled stops renewing; the next caller
        /// takes over; the stale owner's completion is refused with LeaseLost and
        /// overwrites nothing.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_unpolled_call_loses_its_lease_and_cannot_complete() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let gate = tokio::sync::Notify::new();
            let mut stale = Box::pin(gated(&*store, &t, "k", &runs, &gate));
            // Poll until the body is waiting on the gate, then stop polling.
            assert!(futures::poll!(stale.as_mut()).is_pending());
            // The store answers on its own I/O; keep polling (bounded) until the body runs.
            for _ in 0..1000 {
                if runs.load(Ordering::SeqCst) == 1 { break; }
                tokio::time::sleep(Duration::from_millis(5)).await;
                assert!(futures::poll!(stale.as_mut()).is_pending());
            }
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            tokio::time::sleep(Duration::from_millis(700)).await; // > 300 ms lease
            // The next caller takes over.
            let gate2 = tokio::sync::Notify::new();
            gate2.notify_one();
            let winner = gated(&*store, &t, "k", &runs, &gate2).await.expect("takes over the expired lease");
            assert_eq!(runs.load(Ordering::SeqCst), 2);
            // The stale owner resumes and finishes: refused, nothing overwritten.
            gate.notify_one();
            let err = stale.await.unwrap_err();
            assert!(matches!(err, Error::LeaseLost(_)), "{err:?}");
            let gate3 = tokio::sync::Notify::new();
            assert_eq!(gated(&*store, &t, "k", &runs, &gate3).await.unwrap(), winner, "the taker's result stands");
        }

        /// Rule 16: after `ttl` the record counts as absent and the key executes again.
        #[tokio::test]
        async fn after_ttl_the_key_executes_again() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let first = short_ttl(&*store, &t, "k", &runs).await.unwrap();
            assert_eq!(short_ttl(&*store, &t, "k", &runs).await.unwrap(), first);
            tokio::time::sleep(Duration::from_millis(2500)).await;
            let later = short_ttl(&*store, &t, "k", &runs).await.unwrap();
            assert_ne!(later, first);
            assert_eq!(runs.load(Ordering::SeqCst), 2);
        }

        /// Rule 2: bad keys are refused before anything runs or is stored.
        #[tokio::test]
        async fn bad_keys_are_refused_before_anything_runs() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let long = "k".repeat(256);
            for bad in ["", long.as_str(), "new\nline", "nul\0byte", "tab\there", "\u{7f}del"] {
                let err = charge(&*store, &t, bad, 1, &runs).await.unwrap_err();
                assert!(matches!(err, Error::InvalidKey(_)), "{bad:?}: {err:?}");
                assert!(err.to_string().contains("invalid idempotency key"));
            }
            let max = "k".repeat(255);
            charge(&*store, &t, &max, 1, &runs).await.expect("255 bytes is allowed");
            assert_eq!(runs.load(Ordering::SeqCst), 1, "no bad key ran the body");
            let err = charge(&*store, "", "fine", 1, &runs).await.unwrap_err();
            assert!(matches!(err, Error::InvalidTenant(_)), "{err:?}");
        }

        /// A result that cannot be serialized is an error and leaves no record.
        #[tokio::test]
        async fn an_unserializable_result_leaves_no_record() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let err = unrecordable(&*store, &t, "k", &runs).await.unwrap_err();
            assert!(matches!(err, Error::ResultEncoding { .. }), "{err:?}");
            assert!(store.fetch(&id(&t, "contract.unrecordable", "k")).await.unwrap().is_none());
        }

        /// A result over the size limit is refused with a clear error and leaves no
        /// record; a several-megabyte one round-trips exactly.
        #[tokio::test]
        async fn big_results_round_trip_or_are_refused() {
            let Some(store) = store().await else { return };
            let t = fresh_tenant();
            let runs = AtomicUsize::new(0);
            let size = 3 * 1024 * 1024;
            let first = big_result(&*store, &t, "big", &runs, size).await.unwrap();
            let (again, o) = with_outcome(big_result(&*store, &t, "big", &runs, size)).await;
            assert_eq!(o, Some(Outcome::Replayed));
            assert_eq!(again.unwrap(), first);
            let err = big_result(&*store, &t, "huge", &runs, idempotent_runtime::MAX_RESULT_BYTES + 1).await.unwrap_err();
            assert!(matches!(err, Error::ResultTooLarge { .. }), "{err:?}");
            assert!(store.fetch(&id(&t, "contract.big", "huge")).await.unwrap().is_none());
        }

        /// Rule 2: keys that look like SQL patterns or escapes match exactly.
        #[tokio::test]
        async fn keys_and_tenants_match_exactly() {
            let Some(store) = store().await else { return };
            let runs = AtomicUsize::new(0);
            let base = fresh_tenant();
            let tenants = [format!("{base}"), format!("{base}%"), format!("{base}_"), format!("{base}'"), format!("{base}\\")];
            let keys = ["k", "k%", "k_", "K", "k'", "k\"", "k\\", "k\\%", "ключ", "🔑", "k "];
            let mut seen = std::collections::HashSet::new();
            for t in &tenants {
                for k in keys {
                    let r = charge(&*store, t, k, 1, &runs).await.unwrap();
                    assert!(seen.insert(r.charge_id.clone()), "{t:?}/{k:?} collided with another identity");
                }
            }
            assert_eq!(runs.load(Ordering::SeqCst), tenants.len() * keys.len());
            for t in &tenants {
                for k in keys {
                    charge(&*store, t, k, 1, &runs).await.unwrap();
                }
            }
            assert_eq!(runs.load(Ordering::SeqCst), tenants.len() * keys.len(), "all replayed");
        }
        /// Rule 6: `+inf`, `-inf`, `NaN` and `None` are four different values, so
        /// reusing a key for another of them is a mismatch, never a replay.
        #[tokio::test]
        async fn non_finite_floats_and_none_are_different_requests() {
            let Some(store) = store().await else { return };
            let (t, runs) = (fresh_tenant(), AtomicUsize::new(0));
            assert_eq!(float_charge(&*store, &t, "k", f64::INFINITY, &runs).await.unwrap(), 1);
            assert_eq!(float_charge(&*store, &t, "k", f64::INFINITY, &runs).await.unwrap(), 1, "replayed");
            for other in [f64::NEG_INFINITY, f64::NAN, 0.0] {
                let got = float_charge(&*store, &t, "k", other, &runs).await;
                assert!(matches!(got, Err(Error::FingerprintMismatch(_))), "{other}: {got:?}");
            }
            assert_eq!(maybe_float_charge(&*store, &t, "m", Some(f64::NAN), &runs).await.unwrap(), 2);
            let got = maybe_float_charge(&*store, &t, "m", None, &runs).await;
            assert!(matches!(got, Err(Error::FingerprintMismatch(_))), "None after NaN: {got:?}");
            assert_eq!(maybe_float_charge(&*store, &t, "m", Some(f64::NAN), &runs).await.unwrap(), 2, "NaN replays NaN");
            assert_eq!(runs.load(Ordering::SeqCst), 2);
        }

        /// Rule 6: equal sets (and maps with non-string keys) are one request
        /// whatever their iteration order: every retry replays.
        #[tokio::test]
        async fn equal_sets_are_one_request() {
            let Some(store) = store().await else { return };
            let (t, runs) = (fresh_tenant(), AtomicUsize::new(0));
            let (items, by_item) = set_args(24, false);
            assert_eq!(set_charge(&*store, &t, "k", items, by_item, &runs).await.unwrap(), 1);
            for attempt in 0..8 {
                let (items, by_item) = set_args(24, attempt % 2 == 0);
                let got = set_charge(&*store, &t, "k", items, by_item, &runs).await;
                assert_eq!(got.unwrap(), 1, "retry {attempt} replays");
            }
            let (mut items, by_item) = set_args(24, false);
            items.insert("one more".to_owned());
            let got = set_charge(&*store, &t, "k", items, by_item, &runs).await;
            assert!(matches!(got, Err(Error::FingerprintMismatch(_))), "{got:?}");
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        }

        /// Rule 12: a result that would not replay equal is refused when it is
        /// recorded, naming the scope; nothing is recorded and the key is free.
        #[tokio::test]
        async fn a_non_finite_result_is_refused_not_recorded_as_null() {
            let Some(store) = store().await else { return };
            let (t, runs) = (fresh_tenant(), AtomicUsize::new(0));
            let err = non_finite_result(&*store, &t, "k", &runs).await.unwrap_err();
            assert!(matches!(err, Error::ResultNotFaithful { ref scope, .. } if scope == "contract.non_finite"), "{err:?}");
            assert!(err.to_string().contains("non-finite"), "{err}");
            assert!(store.fetch(&id(&t, "contract.non_finite", "k")).await.unwrap().is_none(), "released");
            let again = non_finite_result(&*store, &t, "k", &runs).await;
            assert!(matches!(again, Err(Error::ResultNotFaithful { .. })), "{again:?}");
            assert_eq!(runs.load(Ordering::SeqCst), 2, "the key was free: the retry ran");
        }

        /// Rule 12: a result (or a recorded error) serde writes but cannot
        /// read back as its own type is refused when it is recorded, naming
        /// the scope; nothing is recorded and the key is free. Before, it was
        /// recorded, and every retry got `ReplayDecoding` for the whole ttl.
        #[tokio::test]
        async fn a_result_that_would_not_read_back_is_refused_when_recorded() {
            let Some(store) = store().await else { return };
            let (t, runs) = (fresh_tenant(), AtomicUsize::new(0));
            for round in 1..=2 {
                let err = unreadable_result(&*store, &t, "k", &runs).await.unwrap_err();
                assert!(matches!(err, Error::ResultNotFaithful { ref scope, .. } if scope == "contract.unreadable"), "{err:?}");
                assert!(err.to_string().contains("u128"), "{err}");
                assert!(store.fetch(&id(&t, "contract.unreadable", "k")).await.unwrap().is_none(), "released");
                assert_eq!(runs.load(Ordering::SeqCst), round, "the key was free: the retry ran");
            }
            let runs = AtomicUsize::new(0);
            let err = unreadable_error(&*store, &t, "k", &runs).await.unwrap_err();
            assert!(
                matches!(&err, DeclinedOr::Library(message) if message.contains("contract.unreadable_error") && message.contains("missing field")),
                "{err:?}"
            );
            assert!(store.fetch(&id(&t, "contract.unreadable_error", "k")).await.unwrap().is_none(), "released");
        }

        /// Rule 12: a result (or a recorded error) that reads back as its own
        /// type but as *another value* is refused when it is recorded. It was
        /// recorded, and every retry got the other value (a `None` note as
        /// `Some`, zero copies as one, an untagged enum's `Whole(7)` as
        /// `Float(7.0)`). Maps and sets that come back in another order are
        /// equal, and recorded.
        #[tokio::test]
        async fn a_result_that_would_read_back_as_another_value_is_refused() {
            let Some(store) = store().await else { return };
            let (t, runs) = (fresh_tenant(), AtomicUsize::new(0));
            for (key, note, copies, whole) in [("none-note", false, 2, false), ("zero-copies", true, 0, false), ("whole-amount", true, 2, true)] {
                let err = changing_result(&*store, &t, key, note, copies, whole, &runs).await.unwrap_err();
                assert!(matches!(err, Error::ResultNotFaithful { ref scope, .. } if scope == "contract.changing"), "{key}: {err:?}");
                assert!(err.to_string().contains("another value"), "{err}");
                assert!(store.fetch(&id(&t, "contract.changing", key)).await.unwrap().is_none(), "released");
            }
            let first = changing_result(&*store, &t, "equal", true, 2, false, &runs).await.expect("recorded");
            let (again, how) = with_outcome(changing_result(&*store, &t, "equal", true, 2, false, &runs)).await;
            assert_eq!((again.expect("replayed"), how), (first, Some(Outcome::Replayed)));
            assert_eq!(runs.load(Ordering::SeqCst), 4);

            let err = changing_error(&*store, &t, "k", &runs).await.unwrap_err();
            assert!(
                matches!(&err, ChangingError::Library(message) if message.contains("contract.changing_error") && message.contains("another value")),
                "{err:?}"
            );
            assert!(store.fetch(&id(&t, "contract.changing_error", "k")).await.unwrap().is_none(), "released");
        }

        /// Rule 6: a record made by an older version (canonical form v1, which
        /// wrote a set in its iteration order) is compared by v1's rules: the
        /// retry with that same set replays instead of being a mismatch. Where
        /// v1 was lossy (`+inf` written as `null`, like `None`) there is no such
        /// comparison: a new `None` record is never replayed to `+inf` (rule 7).
        #[tokio::test]
        async fn a_record_made_with_the_v1_form_is_compared_by_v1_rules() {
            let Some(store) = store().await else { return };
            let (t, runs) = (fresh_tenant(), AtomicUsize::new(0));
            let identity = id(&t, "contract.set_only", "old");
            let items: std::collections::HashSet<String> = (0..16).map(|i| format!("item-{i}")).collect();
            // What v1 stored for this set: its fingerprint in iteration order.
            let mut current = idempotent_runtime::FingerprintBuilder::new();
            current.argument("items", &items);
            let v1 = current.finish().unwrap().expect("a fingerprint").legacy().expect("a v1 form");
            assert_eq!(v1.version(), "v1");
            let token = idempotent_runtime::OwnerToken::new();
            let request = idempotent_runtime::ReserveRequest {
                identity: &identity,
                fingerprint: Some(&v1),
                token: &token,
                lease: Duration::from_secs(60),
                ttl: Duration::from_secs(3600),
            };
            assert!(matches!(store.reserve(request).await.unwrap(), idempotent_runtime::Reservation::Acquired { .. }));
            let outcome = idempotent_runtime::StoredOutcome { is_error: false, payload: b"41".to_vec() };
            assert_eq!(store.complete(idempotent_runtime::Completion::by_body(&identity, &token, &outcome, Duration::from_secs(3600))).await.unwrap(), idempotent_runtime::Fenced::Written);
            let (got, how) = with_outcome(set_only_charge(&*store, &t, "old", items.clone(), &runs)).await;
            assert_eq!(got.unwrap(), 41);
            assert_eq!(how, Some(Outcome::Replayed));
            let mut other = items.clone();
            other.insert("one more".into());
            let got = set_only_charge(&*store, &t, "old", other, &runs).await;
            assert!(matches!(got, Err(Error::FingerprintMismatch(_))), "{got:?}");
            assert_eq!(runs.load(Ordering::SeqCst), 0);

            // Lossy in v1: `None` recorded now, then `+inf` with the same key.
            assert_eq!(maybe_float_charge(&*store, &t, "lossy", None, &runs).await.unwrap(), 1);
            let got = maybe_float_charge(&*store, &t, "lossy", Some(f64::INFINITY), &runs).await;
            assert!(matches!(got, Err(Error::FingerprintMismatch(_))), "+inf is not None: {got:?}");
        }
    };
}
