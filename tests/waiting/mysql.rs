//! Waiting duplicates on [`MySqlStore`]: MySQL and MariaDB have nothing like
//! PostgreSQL's `LISTEN/NOTIFY`, and the store keeps no in-process list of
//! waiters, so a duplicate that finds the record in progress polls it (the
//! default `Store::wait_for_change`: a reservation after 5 ms, doubling to
//! 100 ms), as the README says. Correct answers are the point here (the
//! scenarios every store shares are in `every_store`); the test below pins
//! the cost the README states, by letting the owner finish only once the
//! duplicate has looked at the record many times.

use crate::common::counting::Counting;
use crate::common::servers::{fresh_tenant, mysql_store_or_skip};
use idempotent_runtime::{idempotent, with_outcome, Error, Outcome, Store};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

#[idempotent(scope = "waiting.mysql.charge", key = key, tenant = tenant, store = store,
             skip(go, runs), in_progress = wait("60s"))]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    go: Option<&Notify>,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    if let Some(go) = go {
        go.notified().await;
    }
    Ok(amount * 10)
}

/// The duplicate polls: it reserves again and again while the owner runs
/// (30 times here, which the documented backoff does in about 3 s), and
/// replays the owner's result once it is recorded. The body runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_polls_the_record_and_replays() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let dup = Counting::new(store.clone());
    let (tenant, key) = (fresh_tenant(), "polled-1".to_owned());
    let (go, runs) = (Notify::new(), AtomicUsize::new(0));
    let owner_call = charge(&store, &tenant, &key, 8, Some(&go), &runs);
    let duplicate = async {
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let dup_call = with_outcome(charge(&dup, &tenant, &key, 8, None, &runs));
        let release = async {
            while dup.reserves() < 30 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            go.notify_one();
        };
        let (answer, ()) = tokio::join!(dup_call, release);
        answer
    };
    let (owned, (replayed, outcome)) = tokio::time::timeout(Duration::from_secs(45), async {
        tokio::join!(owner_call, duplicate)
    })
    .await
    .expect("the duplicate polled 30 times and replayed");
    assert_eq!(owned.expect("owner"), 80);
    assert_eq!(replayed.expect("duplicate"), 80, "the duplicate replays");
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
}
