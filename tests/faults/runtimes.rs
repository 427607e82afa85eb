//! A store used from runtimes other than the one that opened it: the way a
//! `static` store (`OnceLock`/`LazyLock`/`OnceCell`) is shared by many
//! `#[tokio::test]` functions, each on a current-thread runtime of its own
//! that ends with the test, or a store opened on one runtime and handed to
//! another.
//!
//! A pooled connection's socket belongs to the runtime that opened it: its
//! readiness is reported by that runtime's I/O driver. Once that runtime is
//! gone the socket answers with an error; while it is alive but not driven (a
//! current-thread runtime no one is blocking on) it answers nothing at all.
//! So every call here runs on a thread of its own with a deadline
//! ([`within_deadline`]) and under a `tokio::time::timeout`: a hang is a
//! failure that says so, never a stuck suite.

use crate::common;

use common::servers::{fresh_tenant, mysql_url, pg_url, servers_required};
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, MySqlStore, Outcome, PgStore, SqliteStore, Store,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Runtime;
use tokio::sync::Notify;

/// How long one scenario may take before it counts as hung. Generous: only
/// ever waited for, never asserted as a speed.
const DEADLINE: Duration = Duration::from_secs(90);

/// How long one call may take on its runtime (the pools' acquire timeout is 5 s).
const CALL_BOUND: Duration = Duration::from_secs(20);

/// How long a dropped call's record may take to be released (in the background).
const RELEASE_BOUND: Duration = Duration::from_secs(20);

type Opened = Pin<Box<dyn Future<Output = Option<Arc<dyn Store>>>>>;
type Open = fn() -> Opened;

fn postgres() -> Opened {
    Box::pin(async {
        match PgStore::connect(&pg_url()).await {
            Ok(store) => Some(Arc::new(store) as Arc<dyn Store>),
            Err(e) => skipped("PostgreSQL", &e),
        }
    })
}

fn mysql() -> Opened {
    Box::pin(async {
        match MySqlStore::connect(&mysql_url()).await {
            Ok(store) => Some(Arc::new(store) as Arc<dyn Store>),
            Err(e) => skipped("MySQL/MariaDB", &e),
        }
    })
}

fn sqlite() -> Opened {
    Box::pin(async {
        let store = SqliteStore::connect(&crate::common::scratch::sqlite_url("runtimes"))
            .await
            .expect("open");
        Some(Arc::new(store) as Arc<dyn Store>)
    })
}

fn skipped(what: &str, e: &Error) -> Option<Arc<dyn Store>> {
    assert!(
        !servers_required(),
        "{what} is unreachable ({e}); IDEMPOTENT_REQUIRE_SERVERS=1, so this fails"
    );
    eprintln!("\n!!!!!!!! SKIPPED: {what} is unreachable ({e})\n");
    None
}

#[idempotent(scope = "runtimes.charge", key = key, tenant = tenant, store = store, skip(runs))]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

#[idempotent(scope = "runtimes.forever", key = key, tenant = tenant, store = store,
             skip(started), lease = "1h")]
async fn runs_forever(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    started: &Notify,
) -> Result<u32, Error> {
    started.notify_one();
    std::future::pending::<()>().await;
    Ok(0)
}

/// Runs `scenario` on a thread of its own and waits at most [`DEADLINE`] for
/// it: a panic in it is this test's panic, no answer in time is a failure.
fn within_deadline(scenario: impl FnOnce() + Send + 'static) {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(scenario));
        let _ = done.send(outcome);
    });
    match finished.recv_timeout(DEADLINE) {
        Ok(Ok(())) => {}
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("the scenario hung: no answer within {DEADLINE:?}"),
    }
}

/// A current-thread runtime, like the one `#[tokio::test]` gives each test.
fn test_runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// What one `#[tokio::test]` does with the shared store: a call that runs
/// the body, then its replay, each bounded by [`CALL_BOUND`].
async fn one_test(store: &dyn Store, label: &str) {
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);
    for expected in [Outcome::Executed, Outcome::Replayed] {
        let (answer, outcome) =
            tokio::time::timeout(CALL_BOUND, with_outcome(charge(store, &tenant, "k", &runs)))
                .await
                .unwrap_or_else(|_| panic!("{label}: the call hung for {CALL_BOUND:?}"));
        let answer = answer.unwrap_or_else(|e| panic!("{label}: the call failed: {e}"));
        assert_eq!(answer, 7, "{label}");
        assert_eq!(outcome, Some(expected), "{label}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{label}: the body ran once");
}

/// Lets the runtime run what the call left spawned (sqlx returns a
/// connection to its pool in a task of the runtime that used it), so the
/// connections it used are idle in the pool, not lost with the runtime.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// [`one_test`], then [`settle`].
async fn one_test_settled(store: &dyn Store, label: &str) {
    one_test(store, label).await;
    settle().await;
}

/// Runtime A opens the store (`None`: its server is not reachable) and makes
/// one test's calls on it; returns both, A still alive.
fn opened_on_runtime_a(open: Open) -> Option<(tokio::runtime::Runtime, Arc<dyn Store>)> {
    let a = test_runtime();
    let store = a.block_on(open())?;
    a.block_on(one_test_settled(
        store.as_ref(),
        "runtime A (opened the store)",
    ));
    Some((a, store))
}

/// Opens the store on runtime A, uses it there, drops A; then runtimes B, C,
/// D (one after the other, each dropped at its end, like separate tests)
/// each make a call and its replay through the same store.
fn sequence_after_the_opening_runtime_is_gone(open: Open) {
    within_deadline(move || {
        let Some((a, store)) = opened_on_runtime_a(open) else {
            return;
        };
        drop(a);
        for label in ["runtime B", "runtime C", "runtime D"] {
            let runtime = test_runtime();
            runtime.block_on(one_test_settled(store.as_ref(), label));
            drop(runtime);
        }
    });
}

/// Opens the store on runtime A and leaves A alive but idle (nothing blocks
/// on it, so its I/O driver does not run): runtime B, then C, use the store.
fn while_the_opening_runtime_is_idle(open: Open) {
    within_deadline(move || {
        let Some((a, store)) = opened_on_runtime_a(open) else {
            return;
        };
        for label in ["runtime B", "runtime C"] {
            let runtime = test_runtime();
            runtime.block_on(one_test_settled(store.as_ref(), label));
            drop(runtime);
        }
        drop(a);
    });
}

/// Opens the store on runtime A and drops A; runtime B starts a call that
/// holds its record and is shut down mid-call (the store's background worker
/// must release the record); runtime C finds the key free through the same
/// store and runs the body; runtime D replays it.
fn dropped_call_after_the_opening_runtime_is_gone(open: Open) {
    within_deadline(move || {
        let Some((a, store)) = opened_on_runtime_a(open) else {
            return;
        };
        drop(a);

        let tenant = fresh_tenant();
        let b = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let started = Arc::new(Notify::new());
        let (held, who, notify) = (store.clone(), tenant.clone(), started.clone());
        b.spawn(async move {
            let _ = runs_forever(held.as_ref(), &who, "k", &notify).await;
        });
        b.block_on(async {
            tokio::time::timeout(CALL_BOUND, started.notified())
                .await
                .expect("runtime B: the call did not start its body (reservation hung or failed)")
        });
        drop(b); // the call's future is dropped with its runtime

        let id = Identity::new(&tenant, "runtimes.forever", "k").expect("identity");
        let c = test_runtime();
        c.block_on(async {
            let deadline = tokio::time::Instant::now() + RELEASE_BOUND;
            loop {
                let fetched = tokio::time::timeout(CALL_BOUND, store.fetch(&id))
                    .await
                    .expect("runtime C: fetch hung")
                    .expect("runtime C: fetch failed");
                match fetched {
                    None => break,
                    Some(r) if tokio::time::Instant::now() >= deadline => {
                        panic!("runtime C: the dropped call's record was not released: {r:?}")
                    }
                    Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
            one_test_settled(store.as_ref(), "runtime C (after the release)").await;
        });
        drop(c);
        let d = test_runtime();
        d.block_on(one_test(store.as_ref(), "runtime D"));
    });
}

/// Four threads, each running three runtimes one after the other (like
/// `cargo test` running tests in parallel on one static store): runtimes
/// start and end while others are using connections.
fn parallel_test_runtimes(open: Open) {
    within_deadline(move || {
        let Some((a, store)) = opened_on_runtime_a(open) else {
            return;
        };
        drop(a);
        let threads: Vec<_> = (0..4)
            .map(|thread| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for test in 0..3 {
                        let runtime = test_runtime();
                        runtime.block_on(async {
                            for call in 0..5 {
                                let label = format!("thread {thread}, runtime {test}, call {call}");
                                one_test(store.as_ref(), &label).await;
                            }
                        });
                        drop(runtime);
                    }
                })
            })
            .collect();
        let mut failures = Vec::new();
        for thread in threads {
            if let Err(panic) = thread.join() {
                failures.push(
                    panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_default(),
                );
            }
        }
        assert!(failures.is_empty(), "failed: {failures:#?}");
    });
}

#[test]
fn postgres_store_serves_runtimes_in_sequence_after_its_own_is_dropped() {
    sequence_after_the_opening_runtime_is_gone(postgres);
}

#[test]
fn mysql_store_serves_runtimes_in_sequence_after_its_own_is_dropped() {
    sequence_after_the_opening_runtime_is_gone(mysql);
}

#[test]
fn sqlite_store_serves_runtimes_in_sequence_after_its_own_is_dropped() {
    sequence_after_the_opening_runtime_is_gone(sqlite);
}

#[test]
fn postgres_store_serves_other_runtimes_while_its_own_is_idle() {
    while_the_opening_runtime_is_idle(postgres);
}

#[test]
fn mysql_store_serves_other_runtimes_while_its_own_is_idle() {
    while_the_opening_runtime_is_idle(mysql);
}

#[test]
fn sqlite_store_serves_other_runtimes_while_its_own_is_idle() {
    while_the_opening_runtime_is_idle(sqlite);
}

#[test]
fn postgres_call_dropped_on_a_later_runtime_is_released() {
    dropped_call_after_the_opening_runtime_is_gone(postgres);
}

#[test]
fn mysql_call_dropped_on_a_later_runtime_is_released() {
    dropped_call_after_the_opening_runtime_is_gone(mysql);
}

#[test]
fn sqlite_call_dropped_on_a_later_runtime_is_released() {
    dropped_call_after_the_opening_runtime_is_gone(sqlite);
}

#[test]
fn postgres_store_serves_parallel_test_runtimes() {
    parallel_test_runtimes(postgres);
}

#[test]
fn mysql_store_serves_parallel_test_runtimes() {
    parallel_test_runtimes(mysql);
}

#[test]
fn sqlite_store_serves_parallel_test_runtimes() {
    parallel_test_runtimes(sqlite);
}
