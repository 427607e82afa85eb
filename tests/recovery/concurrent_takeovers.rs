//! Rules 3, 10 and 20 under a crowd: many callers (tasks, on two store
//! objects of one database, as two instances of a service) meet one record
//! whose owner stopped mid-body past its lease. Exactly one of them takes
//! the record over and asks the `recover` hook; the others wait and replay
//! what it recorded. And an owner that lost its record and then panics
//! leaves the new owner's lease alone (rule 14's release is fenced, rule 10).
//!
//! Handshakes only: the owner's body says when it runs and waits for the
//! test's word; the takers wait (`in_progress = wait`) until the store's
//! clock shows the lease over.

use crate::common::servers::fresh_tenant;
use crate::takeover_edges::{two_instances_of_each_store, until_running, Gate, TwoInstances};
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, Outcome, OwnerToken, RecordState, Recovery,
    Reservation, ReserveRequest, Store, Takeover,
};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

const SCOPE: &str = "recovery.crowd";

/// How many callers come for the stuck record at once.
const CALLERS: usize = 6;

/// Per tenant: what the hook answers (`None`: `Run`), the attempts it was
/// asked about, and how many bodies ran.
#[derive(Default)]
struct Seen {
    answer: Option<u32>,
    asked: Vec<u32>,
    runs: u32,
}

static SEEN: LazyLock<Mutex<HashMap<String, Seen>>> = LazyLock::new(Default::default);

fn seen<T>(tenant: &str, f: impl FnOnce(&mut Seen) -> T) -> T {
    let mut all = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    f(all.entry(tenant.to_owned()).or_default())
}

async fn look(t: &Takeover) -> Result<Recovery<u32>, Error> {
    let answer = seen(t.tenant(), |s| {
        s.asked.push(t.attempt());
        s.answer
    });
    // Give the other callers every chance to come in meanwhile.
    tokio::task::yield_now().await;
    Ok(answer.map_or(Recovery::Run, Recovery::Completed))
}

/// What the body does after its gate (if any) opens.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Then {
    Answer,
    Panic,
}

// The lease is what the crowd waits out for the stopped owner, and what the
// one that takes over must renew while the others' writes queue beside it
// (SQLite: one writer, two store objects): long enough for a loaded test
// machine, where a lease lost there lets a second takeover ask the hook
// again (attempt 3) and refuses the first taker's completion.
#[idempotent(scope = "recovery.crowd", key = key, tenant = tenant, store = store,
             skip(gate, then, value), lease = "2s", in_progress = wait("10s"), recover = look)]
async fn pay(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: Option<&Gate>,
    then: Then,
    value: u32,
) -> Result<u32, Error> {
    seen(tenant, |s| s.runs += 1);
    if let Some(gate) = gate {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    if then == Then::Panic {
        panic!("the body panicked after its record was taken over");
    }
    Ok(value)
}

async fn stores() -> Vec<TwoInstances> {
    two_instances_of_each_store("concurrent-takeovers").await
}

fn id(tenant: &str, key: &str) -> Identity {
    Identity::new(tenant, SCOPE, key).expect("identity")
}

/// Starts [`CALLERS`] calls at once, alternating between the two stores;
/// answers each call's result and outcome.
async fn crowd(
    name: &str,
    a: &Arc<dyn Store>,
    b: &Arc<dyn Store>,
    tenant: &str,
) -> Vec<(Result<u32, String>, Option<Outcome>)> {
    let start = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let calls: Vec<_> = (0..CALLERS)
        .map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let (tenant, start) = (tenant.to_owned(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                let value = 10 + u32::try_from(i).unwrap_or(0);
                let (answer, outcome) =
                    with_outcome(pay(&*store, &tenant, "k", None, Then::Answer, value)).await;
                (answer.map_err(|e| e.to_string()), outcome)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(
            call.await
                .unwrap_or_else(|e| panic!("{name}: a caller failed: {e}")),
        );
    }
    answers
}

/// Rules 3 and 20: a crowd meets a record whose owner stopped past its
/// lease. The hook is asked once (attempt 2), its answer is recorded once,
/// and every caller gets it: one `Recovered`, the rest `Replayed`. No body
/// runs but the stopped owner's, whose completion is then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_taking_over_one_stuck_record_asks_the_hook_once_on_every_store() {
    for (name, a, b) in stores().await {
        let tenant = fresh_tenant();
        seen(&tenant, |s| s.answer = Some(100));
        let gate = Gate::default();
        let mut owner = Box::pin(pay(&*a, &tenant, "k", Some(&gate), Then::Answer, 1));
        until_running(&mut owner, &gate).await;

        let answers = crowd(name, &a, &b, &tenant).await;
        let recovered = answers
            .iter()
            .filter(|(_, o)| *o == Some(Outcome::Recovered))
            .count();
        let replayed = answers
            .iter()
            .filter(|(_, o)| *o == Some(Outcome::Replayed))
            .count();
        assert_eq!(
            (recovered, replayed),
            (1, CALLERS - 1),
            "{name}: one takeover, the rest replay it: {answers:?}"
        );
        assert!(
            answers.iter().all(|(r, _)| r.as_ref() == Ok(&100)),
            "{name}: every caller gets the recovered answer: {answers:?}"
        );
        assert_eq!(seen(&tenant, |s| s.asked.clone()), [2], "{name}");
        gate.go.notify_one();
        let late = owner.await;
        assert!(matches!(late, Err(Error::LeaseLost(_))), "{name}: {late:?}");
        assert_eq!(seen(&tenant, |s| s.runs), 1, "{name}: no body ran again");
        let snap = a
            .fetch(&id(&tenant, "k"))
            .await
            .expect("fetch")
            .expect("record");
        assert_eq!(
            (snap.state, snap.attempt, snap.recovered),
            (RecordState::Complete, 2, true),
            "{name}"
        );
    }
}

/// The same crowd when the hook finds nothing (`Run`): exactly one caller
/// runs the body again (attempt 2), every other replays its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_taking_over_one_stuck_record_runs_the_body_once_on_every_store() {
    for (name, a, b) in stores().await {
        let tenant = fresh_tenant();
        let gate = Gate::default();
        let mut owner = Box::pin(pay(&*a, &tenant, "k", Some(&gate), Then::Answer, 1));
        until_running(&mut owner, &gate).await;

        let answers = crowd(name, &a, &b, &tenant).await;
        let executed: Vec<_> = answers
            .iter()
            .filter(|(_, o)| *o == Some(Outcome::Executed))
            .collect();
        assert_eq!(executed.len(), 1, "{name}: one runs the body: {answers:?}");
        let winner = executed[0].0.clone();
        assert!(
            answers.iter().all(|(r, o)| *r == winner
                && matches!(o, Some(Outcome::Executed) | Some(Outcome::Replayed))),
            "{name}: the rest replay its answer: {answers:?}"
        );
        assert_eq!(seen(&tenant, |s| s.asked.clone()), [2], "{name}");
        assert_eq!(
            seen(&tenant, |s| s.runs),
            2,
            "{name}: the owner's and one more"
        );
        gate.go.notify_one();
        let late = owner.await;
        assert!(matches!(late, Err(Error::LeaseLost(_))), "{name}: {late:?}");
    }
}

/// Rules 10 and 14: an owner stopped past its lease loses the record to a
/// taker whose body is still running; the owner then resumes and its body
/// panics. Its panic ends nothing of the taker's: the taker's lease stays
/// live (a third caller is refused, not let in), and the taker's answer is
/// the one recorded. (The taker runs in a task of its own: a panic's
/// backtrace is written on the panicking thread, which stops the tasks
/// polled there, the way a body blocking its thread does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_lost_its_record_and_then_panics_leaves_the_new_owner_alone_on_every_store() {
    for (name, a, b) in stores().await {
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, "recovery.crowd.panic", "k").expect("identity");
        let first = Gate::default();
        let mut owner = Box::pin(pay_or_panic(&*a, &tenant, Some(&first), Then::Panic, 1));
        until_running(&mut owner, &first).await;
        let second = Arc::new(Gate::default());
        let taker = tokio::spawn({
            let (b, tenant, second) = (b.clone(), tenant.clone(), second.clone());
            async move {
                let (answer, outcome) =
                    with_outcome(pay_or_panic(&*b, &tenant, Some(&second), Then::Answer, 2)).await;
                (answer.map_err(|e| e.to_string()), outcome)
            }
        });
        second.reached.notified().await;
        let taken = b.fetch(&identity).await.expect("fetch").expect("record");
        assert_eq!(taken.attempt, 2, "{name}: the taker holds attempt 2");

        first.go.notify_one();
        let panicked =
            futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(&mut owner)).await;
        assert!(panicked.is_err(), "{name}: the owner's panic propagates");

        let snap = a.fetch(&identity).await.expect("fetch").expect("record");
        let probe = OwnerToken::new();
        let third = a
            .reserve(ReserveRequest {
                identity: &identity,
                fingerprint: None,
                token: &probe,
                lease: std::time::Duration::from_secs(60),
                ttl: std::time::Duration::from_secs(60),
            })
            .await
            .expect("reserve");
        assert_eq!(
            (
                snap.state,
                snap.attempt,
                snap.owner_token == taken.owner_token
            ),
            (RecordState::InProgress, 2, true),
            "{name}: the taker still owns its record: {snap:?}"
        );
        assert!(
            snap.lease_expires_at_ms
                .is_some_and(|end| end > snap.now_ms),
            "{name}: the lost owner's panic did not end the taker's lease: {snap:?}"
        );
        assert!(
            matches!(third, Reservation::InProgress { .. }),
            "{name}: a third caller is refused, not let in: {third:?}"
        );
        second.go.notify_one();
        let (answer, outcome) = taker.await.expect("the taker's task");
        assert_eq!(answer, Ok(2), "{name}");
        assert_eq!(outcome, Some(Outcome::Executed), "{name}");
        assert_eq!(seen(&tenant, |s| s.asked.clone()), [2], "{name}");
        let done = a.fetch(&identity).await.expect("fetch").expect("record");
        assert_eq!(
            (done.state, done.attempt),
            (RecordState::Complete, 2),
            "{name}"
        );
    }
}

/// [`pay`] with a lease a loaded test machine renews in time, for the test
/// whose taker must keep its record while another call panics.
#[idempotent(scope = "recovery.crowd.panic", key = "k", tenant = tenant, store = store,
             skip(gate, then, value), lease = "600ms", in_progress = wait("10s"), recover = look)]
async fn pay_or_panic(
    store: &dyn Store,
    tenant: &str,
    gate: Option<&Gate>,
    then: Then,
    value: u32,
) -> Result<u32, Error> {
    seen(tenant, |s| s.runs += 1);
    if let Some(gate) = gate {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    if then == Then::Panic {
        panic!("the body panicked after its record was taken over");
    }
    Ok(value)
}
