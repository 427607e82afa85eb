//! Rule 20 through `#[idempotent(..., recover = path)]`, on any store: a call
//! that "crashes" after (or before) its side effect, and the retry that takes
//! the record over and asks the hook first.
//!
//! The crash is in-process: the call's future is polled until its body
//! signals that it reached the crash point, and is then leaked
//! (`std::mem::forget`), so nothing runs after that point: no completion, no
//! release-on-drop, no heartbeat. That is what a killed process leaves behind
//! (`tests/multiprocess.rs` does the same across OS processes, with
//! SIGKILL). The retry waits (`in_progress = wait`) until the leaked owner's
//! lease runs out on the store's clock, then takes the record over: no test
//! sleeps.
//!
//! The payment gateway is a process-wide table of charges by (tenant, key),
//! so the hook, a plain `async fn(&Takeover)`, can ask it what happened.
//! Every test has its own tenant.
//!
//! A test file writes `recovery_tests!(async { Some(store) });`.

#![allow(dead_code)]

use idempotent_runtime::{idempotent, Error, Recovery, Store, Takeover};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{LazyLock, Mutex};
use tokio::sync::Notify;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    pub charge_id: String,
    pub amount: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
pub enum PayError {
    #[error("the gateway cannot say whether the charge happened")]
    GatewayUnreachable,
    #[error("card declined")]
    Declined,
    #[error("idempotency: {0}")]
    Idempotency(String),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Idempotency(e.to_string())
    }
}

/// What the hook answers for a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// Look the charge up at the gateway: `Completed` if it is there, else `Run`.
    Gateway,
    /// Fail with `GatewayUnreachable` this many times, then look it up.
    FailTimes(u32),
    /// Fail with `Declined` (a final answer `errors = record` keeps).
    Decline,
    /// Panic once, then look it up.
    PanicOnce,
}

/// One question the hook was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    pub key: String,
    pub scope: String,
    pub attempt: u32,
    pub previous_started_ms: i64,
}

#[derive(Default)]
struct World {
    /// The gateway: charges by (tenant, key).
    charges: HashMap<(String, String), Vec<Receipt>>,
    /// What the hook answers, per tenant.
    ask: HashMap<String, Ask>,
    /// Every question, per tenant.
    asked: HashMap<String, Vec<Asked>>,
    /// Bodies run, per tenant.
    bodies: HashMap<String, usize>,
}

static WORLD: LazyLock<Mutex<World>> = LazyLock::new(Default::default);

fn world() -> std::sync::MutexGuard<'static, World> {
    WORLD.lock().unwrap_or_else(|p| p.into_inner())
}

/// A tenant no other test uses, whose hook answers `ask`.
pub fn fresh_tenant(ask: Ask) -> String {
    let tenant = format!("rec-{}", uuid::Uuid::new_v4().simple());
    world().ask.insert(tenant.clone(), ask);
    tenant
}

/// The charges the gateway holds for (tenant, key).
pub fn charges(tenant: &str, key: &str) -> Vec<Receipt> {
    world()
        .charges
        .get(&(tenant.to_owned(), key.to_owned()))
        .cloned()
        .unwrap_or_default()
}

/// The questions the hook was asked for a tenant.
pub fn asked(tenant: &str) -> Vec<Asked> {
    world().asked.get(tenant).cloned().unwrap_or_default()
}

/// How many bodies ran for a tenant.
pub fn bodies(tenant: &str) -> usize {
    world().bodies.get(tenant).copied().unwrap_or(0)
}

fn gateway_charge(tenant: &str, key: &str, amount: u64) -> Receipt {
    let mut w = world();
    let list = w
        .charges
        .entry((tenant.to_owned(), key.to_owned()))
        .or_default();
    let receipt = Receipt {
        charge_id: format!("ch_{}_{}", list.len() + 1, uuid::Uuid::new_v4().simple()),
        amount,
    };
    list.push(receipt.clone());
    receipt
}

/// The recover hook: asks the gateway, by the idempotency key, whether the
/// charge happened.
pub async fn charge_happened(takeover: &Takeover) -> Result<Recovery<Receipt>, PayError> {
    let mut w = world();
    let tenant = takeover.tenant().to_owned();
    w.asked.entry(tenant.clone()).or_default().push(Asked {
        key: takeover.key().to_owned(),
        scope: takeover.scope().to_owned(),
        attempt: takeover.attempt(),
        previous_started_ms: takeover.previous_attempt_started_at_ms(),
    });
    let ask = w.ask.get(&tenant).copied().unwrap_or(Ask::Gateway);
    if ask == Ask::PanicOnce {
        w.ask.insert(tenant, Ask::Gateway);
        drop(w);
        panic!("the recover hook panicked on purpose");
    }
    match ask {
        Ask::FailTimes(n) if n > 0 => {
            w.ask.insert(tenant, Ask::FailTimes(n - 1));
            Err(PayError::GatewayUnreachable)
        }
        Ask::Decline => Err(PayError::Declined),
        Ask::Gateway | Ask::FailTimes(_) | Ask::PanicOnce => Ok(
            match w
                .charges
                .get(&(tenant, takeover.key().to_owned()))
                .and_then(|c| c.first())
            {
                Some(receipt) => Recovery::Completed(receipt.clone()),
                None => Recovery::Run,
            },
        ),
    }
}

/// Where a body "crashes": it signals `reached` and never goes on.
#[derive(Default)]
pub struct Crash {
    pub reached: Notify,
}

/// When in the body the crash happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// After the gateway charged the card.
    AfterCharge,
    /// Before the gateway was called.
    BeforeCharge,
}

async fn pay(tenant: &str, key: &str, amount: u64, crash: Option<(&Crash, When)>) -> Receipt {
    *world().bodies.entry(tenant.to_owned()).or_default() += 1;
    if let Some((c, When::BeforeCharge)) = crash {
        c.reached.notify_one();
        std::future::pending::<()>().await;
    }
    let receipt = gateway_charge(tenant, key, amount);
    if let Some((c, When::AfterCharge)) = crash {
        c.reached.notify_one();
        std::future::pending::<()>().await;
    }
    receipt
}

/// A charge with a recover hook; a short lease so a crashed owner's record
/// can be taken over quickly, and duplicates that wait it out.
#[idempotent(scope = "recovery.charge", key = key, tenant = tenant, store = store,
             skip(crash), lease = "300ms", in_progress = wait("30s"),
             recover = charge_happened)]
pub async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    crash: Option<(&Crash, When)>,
) -> Result<Receipt, PayError> {
    Ok(pay(tenant, key, amount, crash).await)
}

/// The same with `errors = record`: a hook's error is the final answer.
#[idempotent(scope = "recovery.charge_recorded", key = key, tenant = tenant, store = store,
             skip(crash), lease = "300ms", in_progress = wait("30s"),
             recover = charge_happened, errors = record)]
pub async fn charge_recording_errors(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    crash: Option<(&Crash, When)>,
) -> Result<Receipt, PayError> {
    Ok(pay(tenant, key, amount, crash).await)
}

impl PayError {
    /// `errors = record_if(...)`: a declined card is a final answer; a
    /// gateway that cannot be reached is not.
    pub fn is_final(&self) -> bool {
        matches!(self, PayError::Declined)
    }
}

/// The same with `errors = record_if(PayError::is_final)`: a hook's final
/// error is recorded, any other keeps the record for the next takeover.
#[idempotent(scope = "recovery.charge_record_if", key = key, tenant = tenant, store = store,
             skip(crash), lease = "300ms", in_progress = wait("30s"),
             recover = charge_happened, errors = record_if(PayError::is_final))]
pub async fn charge_recording_final_errors(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    crash: Option<(&Crash, When)>,
) -> Result<Receipt, PayError> {
    Ok(pay(tenant, key, amount, crash).await)
}

/// Without a hook: a takeover runs the body again (as before rule 20).
#[idempotent(scope = "recovery.blind", key = key, tenant = tenant, store = store,
             skip(crash), lease = "300ms", in_progress = wait("30s"))]
pub async fn charge_blind(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    crash: Option<(&Crash, When)>,
) -> Result<Receipt, PayError> {
    Ok(pay(tenant, key, amount, crash).await)
}

/// A charge whose body fails with `fail` (released: the default policy).
#[idempotent(scope = "recovery.fallible", key = key, tenant = tenant, store = store,
             skip(fail), recover = charge_happened)]
pub async fn charge_or_fail(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    fail: bool,
) -> Result<Receipt, PayError> {
    if fail {
        *world().bodies.entry(tenant.to_owned()).or_default() += 1;
        return Err(PayError::GatewayUnreachable);
    }
    Ok(pay(tenant, key, amount, None).await)
}

/// Polls `call` until its body reaches the crash point, then leaks it:
/// nothing after that point ever runs (no completion, no release, no
/// heartbeat), as when the process is killed.
pub async fn crash<F: Future>(call: F, at: &Crash) {
    let mut call = Box::pin(call);
    tokio::select! {
        _ = &mut call => panic!("the call finished instead of crashing"),
        _ = at.reached.notified() => {}
    }
    std::mem::forget(call);
}

#[macro_export]
macro_rules! recovery_tests {
    ($make:expr) => {
        use idempotent_runtime::{with_outcome, Identity, Outcome, RecordState, Store};
        use std::sync::Arc;
        use $crate::recovery::*;

        async fn store() -> Option<Arc<dyn Store>> {
            match $make.await {
                Some(s) => Some(Arc::new(s) as Arc<dyn Store>),
                None => {
                    eprintln!("SKIPPED: the store's server is unreachable; this recovery test did not run");
                    None
                }
            }
        }

        fn id(tenant: &str, scope: &str, key: &str) -> Identity {
            Identity::new(tenant, scope, key).expect("valid identity")
        }

        /// Rule 20: the owner charged the card and died before recording it.
        /// The retry takes the record over as attempt 2, the hook finds the
        /// charge at the gateway (`Completed`), the receipt is recorded and
        /// returned: exactly one side effect. Later retries replay it and the
        /// hook is not asked again.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn crash_after_the_side_effect_is_recovered_not_repeated() {
            let Some(store) = store().await else { return };
            let tenant = fresh_tenant(Ask::Gateway);
            let c = Crash::default();
            crash(charge(&*store, &tenant, "order-1", 500, Some((&c, When::AfterCharge))), &c).await;
            assert_eq!(charges(&tenant, "order-1").len(), 1, "the first attempt charged");
            let identity = id(&tenant, "recovery.charge", "order-1");
            let first = store.fetch(&identity).await.unwrap().expect("the crashed owner's record");
            assert_eq!((first.state, first.attempt), (RecordState::InProgress, 1));

            let (got, outcome) = with_outcome(charge(&*store, &tenant, "order-1", 500, None)).await;
            let receipt = got.expect("the recovered receipt");
            assert_eq!(outcome, Some(Outcome::Recovered));
            assert_eq!(charges(&tenant, "order-1"), vec![receipt.clone()], "exactly one side effect");
            assert_eq!(bodies(&tenant), 1, "the body did not run again");
            let questions = asked(&tenant);
            assert_eq!(questions.len(), 1, "{questions:?}");
            assert_eq!(
                questions[0],
                Asked {
                    key: "order-1".into(),
                    scope: "recovery.charge".into(),
                    attempt: 2,
                    previous_started_ms: first.attempt_started_at_ms,
                }
            );
            let done = store.fetch(&identity).await.unwrap().expect("the record");
            assert_eq!((done.state, done.attempt, done.recovered), (RecordState::Complete, 2, true));

            let (again, outcome) = with_outcome(charge(&*store, &tenant, "order-1", 500, None)).await;
            assert_eq!(again.expect("a replay"), receipt);
            assert_eq!(outcome, Some(Outcome::Replayed));
            assert_eq!(asked(&tenant).len(), 1, "a replay never asks the hook");
            assert_eq!(charges(&tenant, "order-1").len(), 1);
        }

        /// Rule 20: the owner died before the charge reached the gateway. The
        /// hook finds nothing (`Run`): the body runs again, as attempt 2, and
        /// charges once.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn crash_before_the_side_effect_runs_again_as_attempt_2() {
            let Some(store) = store().await else { return };
            let tenant = fresh_tenant(Ask::Gateway);
            let c = Crash::default();
            crash(charge(&*store, &tenant, "order-2", 700, Some((&c, When::BeforeCharge))), &c).await;
            assert!(charges(&tenant, "order-2").is_empty());

            let (got, outcome) = with_outcome(charge(&*store, &tenant, "order-2", 700, None)).await;
            let receipt = got.expect("the second attempt's receipt");
            assert_eq!(outcome, Some(Outcome::Executed));
            assert_eq!(charges(&tenant, "order-2"), vec![receipt]);
            assert_eq!(bodies(&tenant), 2, "the body ran again");
            let questions = asked(&tenant);
            assert_eq!(questions.iter().map(|a| a.attempt).collect::<Vec<_>>(), [2], "{questions:?}");
            let done = store
                .fetch(&id(&tenant, "recovery.charge", "order-2"))
                .await
                .unwrap()
                .expect("the record");
            assert_eq!((done.state, done.attempt, done.recovered), (RecordState::Complete, 2, false));
        }

        /// Rule 20: the hook is asked only on a takeover: never on a fresh
        /// reservation, a replay, a refused mismatch, or after a release (a
        /// body's error frees the key; the retry is a fresh attempt 1).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_hook_is_not_asked_without_a_takeover() {
            let Some(store) = store().await else { return };
            let tenant = fresh_tenant(Ask::Gateway);
            let (first, o1) = with_outcome(charge(&*store, &tenant, "k", 100, None)).await;
            let (again, o2) = with_outcome(charge(&*store, &tenant, "k", 100, None)).await;
            assert_eq!((o1, o2), (Some(Outcome::Executed), Some(Outcome::Replayed)));
            assert_eq!(first.unwrap(), again.unwrap());
            let mismatch = charge(&*store, &tenant, "k", 999, None).await;
            assert!(matches!(mismatch, Err(PayError::Idempotency(_))), "{mismatch:?}");

            // Released by the body's error, then retried.
            let failed = charge_or_fail(&*store, &tenant, "r", 5, true).await;
            assert_eq!(failed, Err(PayError::GatewayUnreachable));
            let (retried, o3) = with_outcome(charge_or_fail(&*store, &tenant, "r", 5, false)).await;
            assert_eq!(o3, Some(Outcome::Executed));
            retried.expect("the retry runs");
            let record = store
                .fetch(&id(&tenant, "recovery.fallible", "r"))
                .await
                .unwrap()
                .expect("the record");
            assert_eq!(record.attempt, 1, "a released key starts again at attempt 1");

            assert_eq!(asked(&tenant), vec![], "the hook was never asked");
        }

        /// Rule 20: a hook that cannot tell (an error, `errors = release`)
        /// does not run the body and does not free the key: the record stays
        /// in progress with its lease ended, so the next call takes it over as
        /// attempt 3 and asks again, and then recovers the charge.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_failing_hook_keeps_the_record_for_the_next_takeover() {
            let Some(store) = store().await else { return };
            let tenant = fresh_tenant(Ask::FailTimes(1));
            let c = Crash::default();
            crash(charge(&*store, &tenant, "order-3", 300, Some((&c, When::AfterCharge))), &c).await;

            let (got, outcome) = with_outcome(charge(&*store, &tenant, "order-3", 300, None)).await;
            assert_eq!(got, Err(PayError::GatewayUnreachable));
            assert_eq!(outcome, Some(Outcome::Recovered), "the hook answered, not the body");
            let identity = id(&tenant, "recovery.charge", "order-3");
            let kept = store.fetch(&identity).await.unwrap().expect("the record is kept");
            assert_eq!((kept.state, kept.attempt), (RecordState::InProgress, 2));
            assert!(kept.lease_expires_at_ms.is_some_and(|l| l <= kept.now_ms), "its lease ended: {kept:?}");

            let (got, outcome) = with_outcome(charge(&*store, &tenant, "order-3", 300, None)).await;
            assert_eq!(outcome, Some(Outcome::Recovered));
            assert_eq!(got.expect("recovered on the next takeover"), charges(&tenant, "order-3")[0]);
            assert_eq!(asked(&tenant).iter().map(|a| a.attempt).collect::<Vec<_>>(), [2, 3]);
            assert_eq!(bodies(&tenant), 1);
            assert_eq!(charges(&tenant, "order-3").len(), 1);
            let done = store.fetch(&identity).await.unwrap().expect("the record");
            assert_eq!((done.state, done.attempt, done.recovered), (RecordState::Complete, 3, true));
        }

        /// Rule 20: a hook that panics leaves the record in progress, its
        /// lease ended (the panic propagates); the next call asks again.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_panicking_hook_keeps_the_record_for_the_next_takeover() {
            let Some(store) = store().await else { return };
            let tenant = fresh_tenant(Ask::PanicOnce);
            let c = Crash::default();
            crash(charge(&*store, &tenant, "order-6", 3, Some((&c, When::AfterCharge))), &c).await;
            let panicked = {
                let (store, tenant) = (store.clone(), tenant.clone());
                tokio::spawn(async move { charge(&*store, &tenant, "order-6", 3, None).await }).await
            };
            assert!(panicked.is_err_and(|e| e.is_panic()), "the hook's panic propagates");
            let identity = id(&tenant, "recovery.charge", "order-6");
            let kept = store.fetch(&identity).await.unwrap().expect("the record is kept");
            assert_eq!((kept.state, kept.attempt), (RecordState::InProgress, 2));
            assert!(kept.lease_expires_at_ms.is_some_and(|l| l <= kept.now_ms), "{kept:?}");
            let (got, outcome) = with_outcome(charge(&*store, &tenant, "order-6", 3, None)).await;
            assert_eq!(outcome, Some(Outcome::Recovered));
            assert_eq!(got.unwrap(), charges(&tenant, "order-6")[0]);
            assert_eq!(asked(&tenant).iter().map(|a| a.attempt).collect::<Vec<_>>(), [2, 3]);
            assert_eq!(bodies(&tenant), 1);
        }

        /// Rule 20 with `errors = record`: the hook's error is recorded as the
        /// final answer and replayed; the body does not run again.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_hook_error_is_recorded_with_errors_record() {
            let Some(store) = store().await else { return };
            let tenant = fresh_tenant(Ask::Decline);
            let c = Crash::default();
            crash(charge_recording_errors(&*store, &tenant, "order-4", 1, Some((&c, When::BeforeCharge))), &c).await;
            let (got, outcome) = with_outcome(charge_recording_errors(&*store, &tenant, "order-4", 1, None)).await;
            assert_eq!((got, outcome), (Err(PayError::Declined), Some(Outcome::Recovered)));
            let (got, outcome) = with_outcome(charge_recording_errors(&*store, &tenant, "order-4", 1, None)).await;
            assert_eq!((got, outcome), (Err(PayError::Declined), Some(Outcome::Replayed)));
            assert_eq!(bodies(&tenant), 1);
            assert_eq!(asked(&tenant).len(), 1);
            let done = store
                .fetch(&id(&tenant, "recovery.charge_recorded", "order-4"))
                .await
                .unwrap()
                .expect("the record");
            assert_eq!((done.state, done.recovered), (RecordState::Complete, true));
            assert!(done.outcome.is_some_and(|o| o.is_error));
        }

        /// Rule 20 with `errors = record_if(pred)`: a hook's error the
        /// predicate accepts is recorded and replayed, as with `errors =
        /// record`; one it refuses is handled as under `errors = release`:
        /// the record is kept in progress, its lease ended, and the next call
        /// takes it over as attempt 3 and asks again. Neither runs the body.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_hook_error_is_recorded_only_when_record_if_accepts_it() {
            let Some(store) = store().await else { return };
            // Accepted: Declined is final.
            let declined = fresh_tenant(Ask::Decline);
            let c = Crash::default();
            crash(charge_recording_final_errors(&*store, &declined, "order-7", 1, Some((&c, When::BeforeCharge))), &c).await;
            let (got, outcome) = with_outcome(charge_recording_final_errors(&*store, &declined, "order-7", 1, None)).await;
            assert_eq!((got, outcome), (Err(PayError::Declined), Some(Outcome::Recovered)));
            let (got, outcome) = with_outcome(charge_recording_final_errors(&*store, &declined, "order-7", 1, None)).await;
            assert_eq!((got, outcome), (Err(PayError::Declined), Some(Outcome::Replayed)));
            assert_eq!((bodies(&declined), asked(&declined).len()), (1, 1));
            let done = store
                .fetch(&id(&declined, "recovery.charge_record_if", "order-7"))
                .await
                .unwrap()
                .expect("the record");
            assert_eq!((done.state, done.recovered), (RecordState::Complete, true));
            assert!(done.outcome.is_some_and(|o| o.is_error));

            // Refused: GatewayUnreachable is not final.
            let unsure = fresh_tenant(Ask::FailTimes(1));
            let c = Crash::default();
            crash(charge_recording_final_errors(&*store, &unsure, "order-8", 2, Some((&c, When::AfterCharge))), &c).await;
            let (got, outcome) = with_outcome(charge_recording_final_errors(&*store, &unsure, "order-8", 2, None)).await;
            assert_eq!((got, outcome), (Err(PayError::GatewayUnreachable), Some(Outcome::Recovered)));
            let identity = id(&unsure, "recovery.charge_record_if", "order-8");
            let kept = store.fetch(&identity).await.unwrap().expect("the record is kept");
            assert_eq!((kept.state, kept.attempt), (RecordState::InProgress, 2));
            assert!(kept.lease_expires_at_ms.is_some_and(|l| l <= kept.now_ms), "its lease ended: {kept:?}");
            let (got, outcome) = with_outcome(charge_recording_final_errors(&*store, &unsure, "order-8", 2, None)).await;
            assert_eq!(outcome, Some(Outcome::Recovered));
            assert_eq!(got.expect("recovered on the next takeover"), charges(&unsure, "order-8")[0]);
            assert_eq!(asked(&unsure).iter().map(|a| a.attempt).collect::<Vec<_>>(), [2, 3]);
            assert_eq!((bodies(&unsure), charges(&unsure, "order-8").len()), (1, 1));
        }

        /// Without `recover`, a takeover runs the body again: the blind retry
        /// the hook exists to prevent (two side effects), now visible as attempt 2.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn without_a_hook_a_takeover_runs_the_body_again() {
            let Some(store) = store().await else { return };
            let tenant = fresh_tenant(Ask::Gateway);
            let c = Crash::default();
            crash(charge_blind(&*store, &tenant, "order-5", 9, Some((&c, When::AfterCharge))), &c).await;
            let (got, outcome) = with_outcome(charge_blind(&*store, &tenant, "order-5", 9, None)).await;
            got.expect("the second run's receipt");
            assert_eq!(outcome, Some(Outcome::Executed));
            assert_eq!(charges(&tenant, "order-5").len(), 2, "charged twice");
            assert_eq!(asked(&tenant), vec![]);
            let done = store
                .fetch(&id(&tenant, "recovery.blind", "order-5"))
                .await
                .unwrap()
                .expect("the record");
            assert_eq!((done.attempt, done.recovered), (2, false));
        }
    };
}
