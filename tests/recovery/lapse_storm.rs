//! Rule 10 in a storm, on every store: bodies that block their thread past
//! a short lease (a synchronous call, a starved runtime), so leases lapse
//! and records are taken over while their owners still run; some calls are
//! dropped at random moments, some bodies panic. Two bodies of one key may
//! then run side by side (README: a lease far longer than a renewal takes),
//! but a stale owner never overwrites what a newer one recorded, and is
//! never told it succeeded when it did not: every `Ok` any caller got for a
//! key is one and the same recorded answer, and a last call replays it. With
//! a `recover` hook the same holds for the hooks' answers.
//!
//! Nothing here is timed: how many leases lapse depends on the machine, and
//! whatever lapses, the answers must agree. A failure prints the seed
//! (`IDEMPOTENT_STORM_SEED` replays the drops and blocks it chose).

use crate::common::servers::fresh_tenant;
use crate::storm::{memory, mysql, postgres, quiet_storm_panics, seed, sqlite, Rng, STORM_PANIC};
use futures::FutureExt;
use idempotent_runtime::{idempotent, with_outcome, Error, Outcome, Recovery, Store, Takeover};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

static NEXT: AtomicU32 = AtomicU32::new(1);

/// The first side effect made per (tenant, key), for the hook.
static EFFECTS: LazyLock<Mutex<HashMap<(String, String), u32>>> = LazyLock::new(Default::default);

async fn look(t: &Takeover) -> Result<Recovery<u32>, Error> {
    // Hooks that block too, some past the lease.
    std::thread::sleep(Duration::from_millis(u64::from(t.attempt() % 3) * 10));
    let found = EFFECTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(t.tenant().to_owned(), t.key().to_owned()))
        .copied();
    Ok(found.map_or(Recovery::Run, Recovery::Completed))
}

/// Blocks its thread for `block_ms`, makes its side effect, waits half as
/// long again, and panics after it if told to.
async fn work(tenant: &str, key: &str, block_ms: u64, panics: bool) -> Result<u32, Error> {
    let value = NEXT.fetch_add(1, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(block_ms));
    EFFECTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry((tenant.to_owned(), key.to_owned()))
        .or_insert(value);
    tokio::time::sleep(Duration::from_millis(block_ms / 2)).await;
    if panics {
        panic!("{STORM_PANIC}");
    }
    Ok(value)
}

#[idempotent(scope = "recovery.lapse_storm", key = key, tenant = tenant, store = store,
             skip(block_ms, panics), lease = "20ms", in_progress = wait("5s"))]
async fn lapsing(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    block_ms: u64,
    panics: bool,
) -> Result<u32, Error> {
    work(tenant, key, block_ms, panics).await
}

#[idempotent(scope = "recovery.lapse_storm_hook", key = key, tenant = tenant, store = store,
             skip(block_ms, panics), lease = "20ms", in_progress = wait("5s"), recover = look)]
async fn lapsing_with_hook(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    block_ms: u64,
    panics: bool,
) -> Result<u32, Error> {
    work(tenant, key, block_ms, panics).await
}

async fn call(
    hook: bool,
    store: &dyn Store,
    tenant: &str,
    key: &str,
    block_ms: u64,
    panics: bool,
) -> Result<u32, Error> {
    if hook {
        lapsing_with_hook(store, tenant, key, block_ms, panics).await
    } else {
        lapsing(store, tenant, key, block_ms, panics).await
    }
}

type Answers = Vec<(String, Result<u32, String>, Option<Outcome>)>;

async fn lapse_storm(name: &str, hook: bool, a: Arc<dyn Store>, b: Arc<dyn Store>, seed: u64) {
    quiet_storm_panics();
    let tenant = fresh_tenant();
    let tasks: Vec<_> = (0..6u64)
        .map(|t| {
            let store = if t % 2 == 0 { a.clone() } else { b.clone() };
            let tenant = tenant.clone();
            let mut rng = Rng(seed ^ (t + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            tokio::spawn(async move {
                let mut answers: Answers = Vec::new();
                for round in 0..10 {
                    let key = format!("r{round}");
                    let block_ms = rng.below(45);
                    let panics = rng.below(6) == 0;
                    let drop_after =
                        (rng.below(4) == 0).then(|| Duration::from_millis(rng.below(40)));
                    let pending =
                        with_outcome(call(hook, &*store, &tenant, &key, block_ms, panics));
                    let ended = std::panic::AssertUnwindSafe(async {
                        match drop_after {
                            Some(after) => tokio::time::timeout(after, pending).await.ok(),
                            None => Some(pending.await),
                        }
                    })
                    .catch_unwind()
                    .await;
                    if let Ok(Some((answer, outcome))) = ended {
                        answers.push((key, answer.map_err(|e| e.to_string()), outcome));
                    }
                }
                answers
            })
        })
        .collect();
    let mut by_key: BTreeMap<String, Vec<(u32, Option<Outcome>)>> = BTreeMap::new();
    for task in tasks {
        for (key, answer, outcome) in task.await.expect("a storm task") {
            if let Ok(v) = answer {
                by_key.entry(key).or_default().push((v, outcome));
            }
        }
    }
    for (key, answers) in &by_key {
        let first = answers[0].0;
        assert!(
            answers.iter().all(|(v, _)| *v == first),
            "{name} (hook {hook}, seed {seed}): {key} answered differently: {answers:?}"
        );
        let (last, outcome) = with_outcome(call(hook, &*a, &tenant, key, 0, false)).await;
        assert_eq!(
            (last.map_err(|e| e.to_string()), outcome),
            (Ok(first), Some(Outcome::Replayed)),
            "{name} (hook {hook}, seed {seed}): the last call of {key}; earlier: {answers:?}"
        );
    }
}

macro_rules! lapse_storms {
    ($($test:ident: $name:literal, $stores:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let Some((a, b)) = $stores else { return };
            let seed = seed();
            lapse_storm($name, false, a.clone(), b.clone(), seed).await;
            lapse_storm($name, true, a, b, seed).await;
        }
    )*};
}

lapse_storms! {
    memory_owners_whose_leases_lapse_never_answer_two_values_for_a_key: "memory", Some(memory().await);
    sqlite_owners_whose_leases_lapse_never_answer_two_values_for_a_key: "sqlite", Some(sqlite("lapse-storm").await);
    postgres_owners_whose_leases_lapse_never_answer_two_values_for_a_key: "postgres", postgres().await;
    mysql_owners_whose_leases_lapse_never_answer_two_values_for_a_key: "mysql", mysql().await;
}
