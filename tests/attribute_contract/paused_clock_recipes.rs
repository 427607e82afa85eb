//! The README's "Testing a service of your own" recipes on `MemoryStore`
//! under a paused tokio clock, as a user's test would write them with the
//! public API only: `tokio::time::advance` runs a `ttl` or a lease out at
//! once; a call polled to a crash point and `std::mem::forget`-ten is taken
//! over after its lease and the `recover` hook answers (`Outcome::Recovered`);
//! renewals come every `lease / 3`; a duplicate waits exactly its
//! `wait(...)` bound, or is woken by the owner's answer; and a call's future
//! does not grow with what its body holds.

use idempotent_runtime::{
    idempotent, metrics, with_outcome, Error, KeyProblem, MemoryStore, Outcome, Recovery, Takeover,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::{advance, sleep, Instant};

#[idempotent(scope = "recipes.ttl", key = key, tenant = shared, store = store, ttl = "1h")]
async fn kept_an_hour(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

/// `advance` past the `ttl` makes the record absent: the next call runs.
#[tokio::test(start_paused = true)]
async fn advancing_a_paused_clock_past_the_ttl_lets_the_key_run_again() {
    let store = MemoryStore::new();
    let (_, first) = with_outcome(kept_an_hour(&store, "k")).await;
    assert_eq!(first, Some(Outcome::Executed));
    advance(Duration::from_secs(3599)).await;
    let (_, within) = with_outcome(kept_an_hour(&store, "k")).await;
    assert_eq!(within, Some(Outcome::Replayed), "within the ttl");
    advance(Duration::from_secs(2)).await;
    let (_, after) = with_outcome(kept_an_hour(&store, "k")).await;
    assert_eq!(after, Some(Outcome::Executed), "past the ttl");
}

static HOOK_ASKED: AtomicUsize = AtomicUsize::new(0);

async fn found_at_the_gateway(t: &Takeover) -> Result<Recovery<u32>, Error> {
    HOOK_ASKED.fetch_add(1, Ordering::SeqCst);
    assert_eq!(t.attempt(), 2, "the first takeover");
    Ok(Recovery::Completed(99))
}

#[idempotent(scope = "recipes.crash", key = key, tenant = shared, store = store,
             skip(crash_point), recover = found_at_the_gateway)]
async fn charge(
    store: &MemoryStore,
    key: &str,
    crash_point: Option<&Notify>,
) -> Result<u32, Error> {
    if let Some(reached) = crash_point {
        reached.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(1)
}

/// "A crashed owner": poll the call to its crash point, forget it, advance
/// past the lease (30 s by default): the next call takes the record over and
/// the hook's answer is recorded and returned, the body not run.
#[tokio::test(start_paused = true)]
async fn a_forgotten_call_is_taken_over_after_its_lease_and_the_hook_answers() {
    let store = MemoryStore::new();
    let reached = Notify::new();
    let mut call = Box::pin(charge(&store, "k", Some(&reached)));
    tokio::select! {
        _ = &mut call => panic!("the call finished instead of crashing"),
        _ = reached.notified() => {}
    }
    std::mem::forget(call);
    advance(Duration::from_secs(31)).await;
    let (result, outcome) = with_outcome(charge(&store, "k", None)).await;
    assert_eq!(
        (result.expect("recovered"), outcome),
        (99, Some(Outcome::Recovered))
    );
    let (again, replayed) = with_outcome(charge(&store, "k", None)).await;
    assert_eq!(
        (again.expect("replayed"), replayed),
        (99, Some(Outcome::Replayed))
    );
    assert_eq!(HOOK_ASKED.load(Ordering::SeqCst), 1, "asked once");
}

#[idempotent(scope = "recipes.released", key = key, tenant = shared, store = store)]
async fn fails(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Err(Error::InvalidKey(KeyProblem::Empty))
}

/// `Outcome::Executed` means the body ran, also when its `Err` was released.
#[tokio::test]
async fn a_released_error_reports_the_body_as_executed() {
    let store = MemoryStore::new();
    let (result, outcome) = with_outcome(fails(&store, "k")).await;
    assert!(result.is_err());
    assert_eq!(outcome, Some(Outcome::Executed));
}

#[idempotent(scope = "recipes.held", key = key, tenant = shared, store = store,
             in_progress = reject, skip(gate))]
async fn held(store: &MemoryStore, key: &str, gate: &Notify) -> Result<u32, Error> {
    gate.notified().await;
    Ok(1)
}

/// The default lease (30 s) is renewed every 10 s: a body that runs 25 s
/// renews it twice, and a duplicate refused meanwhile is told to come back
/// when the lease it saw runs out (at most the lease, at least the 5 s left
/// after the last renewal).
#[tokio::test(start_paused = true)]
async fn the_lease_is_renewed_every_third_and_a_refusal_says_when_it_ends() {
    let store = MemoryStore::new();
    let gate = Notify::new();
    let before = metrics::snapshot().heartbeats;
    let mut call = Box::pin(held(&store, "k", &gate));
    for _ in 0..25 {
        tokio::select! {
            _ = &mut call => panic!("the body waits for the gate"),
            _ = sleep(Duration::from_secs(1)) => {}
        }
    }
    assert_eq!(
        metrics::snapshot().heartbeats - before,
        2,
        "at 10 s and 20 s"
    );
    match held(&store, "k", &gate).await {
        Err(Error::InProgress { retry_after, .. }) => assert!(
            (Duration::from_secs(5)..=Duration::from_secs(30)).contains(&retry_after),
            "{retry_after:?}"
        ),
        other => panic!("expected InProgress, got {other:?}"),
    }
    gate.notify_one();
    assert_eq!(call.await.expect("the owner's answer"), 1);
}

#[idempotent(scope = "recipes.waiting", key = key, tenant = shared, store = store,
             in_progress = wait("10s"), skip(gate))]
async fn waited(store: &MemoryStore, key: &str, gate: Option<&Notify>) -> Result<u32, Error> {
    if let Some(gate) = gate {
        gate.notified().await;
    }
    Ok(7)
}

/// `in_progress = wait("10s")`: a duplicate waits its bound and no more, and
/// one the owner's answer wakes replays it at once.
#[tokio::test(start_paused = true)]
async fn a_duplicate_waits_its_bound_or_is_woken_by_the_owners_answer() {
    let store = MemoryStore::new();
    let gate = Notify::new();
    let mut owner = Box::pin(waited(&store, "k", Some(&gate)));
    tokio::select! {
        _ = &mut owner => panic!("the owner waits for the gate"),
        _ = sleep(Duration::from_millis(1)) => {}
    }
    let start = Instant::now();
    let refused = tokio::select! {
        r = waited(&store, "k", None) => r,
        _ = &mut owner => panic!("the owner waits for the gate"),
    };
    assert!(
        matches!(refused, Err(Error::InProgress { .. })),
        "{refused:?}"
    );
    let waited_for = start.elapsed();
    assert!(
        (Duration::from_secs(10)..Duration::from_secs(11)).contains(&waited_for),
        "{waited_for:?}"
    );
    let start = Instant::now();
    let answer = async {
        sleep(Duration::from_secs(3)).await;
        gate.notify_one();
        owner.await
    };
    let ((replayed, outcome), owned) =
        tokio::join!(with_outcome(waited(&store, "k", None)), answer);
    assert_eq!(
        (replayed.expect("replayed"), outcome, owned.expect("owner")),
        (7, Some(Outcome::Replayed), 7)
    );
    let woken_after = start.elapsed();
    assert!(
        (Duration::from_secs(3)..Duration::from_millis(3100)).contains(&woken_after),
        "{woken_after:?}"
    );
}

#[idempotent(scope = "recipes.big_body", key = key, tenant = shared, store = store)]
async fn big_body(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    let buffer = [7u8; 64 * 1024];
    tokio::task::yield_now().await;
    Ok(u32::from(buffer[100]))
}

/// A call's future is the same few kilobytes whatever its body holds across
/// an await (the body lives in an allocation of its own).
#[test]
fn a_calls_future_does_not_grow_with_what_its_body_holds() {
    let store = MemoryStore::new();
    let big = std::mem::size_of_val(&big_body(&store, "k"));
    let small = std::mem::size_of_val(&kept_an_hour(&store, "k"));
    assert_eq!(big, small, "a 64 KiB body state changes the call's future");
    assert!(big < 4096, "about 3 KB: {big}");
}
