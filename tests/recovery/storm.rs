//! Rules 3, 10, 14 and 20 in a storm, on every store: tasks on two store
//! objects (two instances of a service) call a few keys of a scope with a
//! `recover` hook over and over, and a call is dropped at a random moment (a
//! caller's timeout: while its reservation is in flight, while its hook or
//! its body runs, while its answer is recorded) or its body panics after its
//! side effect. The hook looks for the side effect, as a real one asks the
//! payment provider.
//!
//! What must hold whatever the interleaving: never two bodies of a key at
//! once; with the hook, at most one side effect per key and every `Ok` any
//! caller got is that side effect's answer; without it (a dropped or
//! panicked call releases its record, rules 13 and 14), every `Ok` of a key
//! is one and the same recorded answer. Once the storm is over, a last call
//! of each key gets that answer without running the body.
//!
//! The leases are long (none runs out here: a dropped or panicked call ends
//! or releases its record at once, through the store), so nothing waits on
//! a clock. The drops come from a seeded generator; a failure prints the
//! seed, and `IDEMPOTENT_STORM_SEED` replays it.

use crate::common::scratch::sqlite_url;
use crate::common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use futures::FutureExt;
use idempotent_runtime::{
    idempotent, with_outcome, Error, MemoryStore, Outcome, Recovery, SqliteStore, Store, Takeover,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

const KEYS: usize = 2;
const TASKS: usize = 8;
const CALLS_PER_TASK: usize = 25;
/// What the bodies' panics say; the quiet panic hook leaves them unprinted.
pub(crate) const STORM_PANIC: &str = "storm: the body panicked after its side effect";

#[derive(Default)]
struct Key {
    /// The side effects the bodies made (the payment provider's view).
    effects: Vec<u32>,
    /// Bodies running now.
    running: u32,
}

#[derive(Default)]
struct World {
    keys: HashMap<(String, String), Key>,
    /// What broke an invariant, as it happened.
    violations: Vec<String>,
}

static WORLD: LazyLock<Mutex<World>> = LazyLock::new(Default::default);

fn world() -> std::sync::MutexGuard<'static, World> {
    WORLD.lock().unwrap_or_else(|p| p.into_inner())
}

static NEXT_VALUE: AtomicU32 = AtomicU32::new(1);

/// Counts a body out when it ends, however it ends (answer, panic, drop).
struct Running((String, String));

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(k) = world().keys.get_mut(&self.0) {
            k.running -= 1;
        }
    }
}

async fn side_effect_happened(t: &Takeover) -> Result<Recovery<u32>, Error> {
    tokio::task::yield_now().await;
    let found = world()
        .keys
        .get(&(t.tenant().to_owned(), t.key().to_owned()))
        .and_then(|k| k.effects.first().copied());
    Ok(found.map_or(Recovery::Run, Recovery::Completed))
}

#[idempotent(scope = "recovery.storm", key = key, tenant = tenant, store = store,
             skip(panics, pauses), lease = "30s", in_progress = wait("10s"),
             recover = side_effect_happened)]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    panics: bool,
    pauses: u8,
) -> Result<u32, Error> {
    work(tenant, key, panics, pauses, true).await
}

/// The same without a hook: a dropped or panicked call releases its record,
/// and the next call runs the body again (rules 13 and 14).
#[idempotent(scope = "recovery.storm_blind", key = key, tenant = tenant, store = store,
             skip(panics, pauses), lease = "30s", in_progress = wait("10s"))]
async fn charge_blind(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    panics: bool,
    pauses: u8,
) -> Result<u32, Error> {
    work(tenant, key, panics, pauses, false).await
}

/// Either function, by `hook`.
async fn call(
    hook: bool,
    store: &dyn Store,
    tenant: &str,
    key: &str,
    panics: bool,
    pauses: u8,
) -> Result<u32, Error> {
    if hook {
        charge(store, tenant, key, panics, pauses).await
    } else {
        charge_blind(store, tenant, key, panics, pauses).await
    }
}

/// A body: makes its side effect (a new value) between two pauses, and
/// panics after it if told to. With a hook, a body that finds a side effect
/// already made is the blind re-run the hook exists to prevent.
async fn work(tenant: &str, key: &str, panics: bool, pauses: u8, hook: bool) -> Result<u32, Error> {
    let id = (tenant.to_owned(), key.to_owned());
    let value = NEXT_VALUE.fetch_add(1, Ordering::Relaxed);
    {
        let mut w = world();
        let k = w.keys.entry(id.clone()).or_default();
        k.running += 1;
        let (running, effects) = (k.running, k.effects.len());
        if running > 1 {
            w.violations
                .push(format!("{tenant} {key}: {running} bodies at once"));
        }
        if hook && effects > 0 {
            w.violations.push(format!(
                "{tenant} {key}: a body ran after the side effect was made"
            ));
        }
    }
    let _running = Running(id.clone());
    tokio::time::sleep(Duration::from_micros(u64::from(pauses) * 300)).await;
    world().keys.entry(id).or_default().effects.push(value);
    tokio::time::sleep(Duration::from_micros(u64::from(pauses) * 300)).await;
    if panics {
        panic!("{STORM_PANIC}");
    }
    Ok(value)
}

/// A panic hook that leaves the storm's own panics unprinted (dozens of
/// backtraces would be written otherwise) and prints every other as before.
pub(crate) fn quiet_storm_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ours = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s == STORM_PANIC);
            if !ours {
                before(info);
            }
        }));
    });
}

/// A small seeded generator (xorshift), so a failing storm can be told by its seed.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

async fn storm(name: &str, hook: bool, a: Arc<dyn Store>, b: Arc<dyn Store>, seed: u64) {
    quiet_storm_panics();
    let tenant = fresh_tenant();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let store = if t % 2 == 0 { a.clone() } else { b.clone() };
            let tenant = tenant.clone();
            let mut rng = Rng(seed ^ (0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(t as u64 + 1)));
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for round in 0..CALLS_PER_TASK {
                    let key = format!("r{round}-k{}", rng.below(KEYS as u64));
                    let panics = rng.below(4) == 0;
                    let pauses = u8::try_from(rng.below(4)).unwrap_or(0);
                    // Dropped after up to a few ms (a third of the calls), or let run.
                    let drop_after =
                        (rng.below(2) == 0).then(|| Duration::from_micros(rng.below(4_000)));
                    let pending = with_outcome(call(hook, &*store, &tenant, &key, panics, pauses));
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
    let mut answers = Vec::new();
    for task in tasks {
        answers.extend(task.await.expect("a storm task"));
    }
    // What the dropped calls left the stores to finish (a lease to end)
    // is waited for by the last calls below (`in_progress = wait`), as a
    // retry would.
    let effects = |key: &str| {
        world()
            .keys
            .get(&(tenant.clone(), key.to_owned()))
            .map(|k| k.effects.clone())
            .unwrap_or_default()
    };
    // With the hook, every answer is the one side effect's; without it, a
    // dropped or panicked call released its record and its side effect
    // stays behind, but every answer of a key is still one and the same:
    // the one recorded.
    let answer_of = |key: &str| {
        let effects = effects(key);
        if hook {
            return effects.first().copied();
        }
        answers
            .iter()
            .find_map(|(k, a, _)| (k == key).then(|| a.as_ref().ok().copied()).flatten())
    };
    for (key, answer, outcome) in &answers {
        if let Ok(v) = answer {
            assert_eq!(
                answer_of(key),
                Some(*v),
                "{name} (seed {seed}): {key} answered {v} ({outcome:?}); effects {:?}",
                effects(key)
            );
            assert!(
                effects(key).contains(v),
                "{name} (seed {seed}): {key}: {v} was never made"
            );
        }
    }
    let keys: std::collections::BTreeSet<String> =
        answers.iter().map(|(k, _, _)| k.clone()).collect();
    for key in &keys {
        let expected = answer_of(key);
        let (answer, outcome) = with_outcome(call(hook, &*a, &tenant, key, false, 0)).await;
        let answer = answer
            .unwrap_or_else(|e| panic!("{name} (seed {seed}): the last call of {key} failed: {e}"));
        if let Some(expected) = expected {
            assert_eq!(
                (answer, outcome == Some(Outcome::Executed)),
                (expected, false),
                "{name} (seed {seed}): the last call of {key} ({outcome:?}); effects {:?}",
                effects(key)
            );
        }
        assert!(
            effects(key).contains(&answer),
            "{name} (seed {seed}): {key}"
        );
    }
    let w = world();
    for k in &keys {
        let made = w
            .keys
            .get(&(tenant.clone(), k.clone()))
            .map_or(0, |k| k.effects.len());
        assert!(
            !hook || made <= 1,
            "{name} (seed {seed}): {made} side effects for {k}"
        );
    }
    let mine: Vec<_> = w
        .violations
        .iter()
        .filter(|v| v.starts_with(&tenant))
        .collect();
    assert!(mine.is_empty(), "{name} (seed {seed}): {mine:#?}");
}

pub(crate) fn seed() -> u64 {
    std::env::var("IDEMPOTENT_STORM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                | 1
        })
}

// Two stores on the same records (two instances of a service), per store.

pub(crate) async fn memory() -> (Arc<dyn Store>, Arc<dyn Store>) {
    let store = MemoryStore::new();
    (Arc::new(store.clone()), Arc::new(store))
}

/// In a file named after `file`.
pub(crate) async fn sqlite(file: &str) -> (Arc<dyn Store>, Arc<dyn Store>) {
    let url = sqlite_url(file);
    let a = SqliteStore::connect(&url).await.expect("sqlite");
    let b = SqliteStore::connect(&url).await.expect("sqlite again");
    (Arc::new(a), Arc::new(b))
}

pub(crate) async fn postgres() -> Option<(Arc<dyn Store>, Arc<dyn Store>)> {
    let (a, b) = (pg_store_or_skip().await?, pg_store_or_skip().await?);
    Some((Arc::new(a), Arc::new(b)))
}

pub(crate) async fn mysql() -> Option<(Arc<dyn Store>, Arc<dyn Store>)> {
    let (a, b) = (mysql_store_or_skip().await?, mysql_store_or_skip().await?);
    Some((Arc::new(a), Arc::new(b)))
}

macro_rules! storms {
    ($($test:ident: $name:literal, $hook:literal, $stores:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let Some((a, b)) = $stores else { return };
            storm($name, $hook, a, b, seed()).await;
        }
    )*};
}

storms! {
    memory_a_storm_with_a_hook_makes_one_side_effect_per_key: "memory", true, Some(memory().await);
    sqlite_a_storm_with_a_hook_makes_one_side_effect_per_key: "sqlite", true, Some(sqlite("storm").await);
    postgres_a_storm_with_a_hook_makes_one_side_effect_per_key: "postgres", true, postgres().await;
    mysql_a_storm_with_a_hook_makes_one_side_effect_per_key: "mysql", true, mysql().await;
    memory_a_storm_without_a_hook_answers_one_value_per_key: "memory", false, Some(memory().await);
    sqlite_a_storm_without_a_hook_answers_one_value_per_key: "sqlite", false, Some(sqlite("storm").await);
    postgres_a_storm_without_a_hook_answers_one_value_per_key: "postgres", false, postgres().await;
    mysql_a_storm_without_a_hook_answers_one_value_per_key: "mysql", false, mysql().await;
}
