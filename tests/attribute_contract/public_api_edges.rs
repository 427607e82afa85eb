//! The public API at its edges, on every store, as a user meets it: keys,
//! tenants and scopes at their byte limits (multi-byte UTF-8) and cut at every
//! place; the longest `ttl`, `lease` and `wait` the attribute accepts (store
//! and transactional mode); results at the edges of what JSON carries and of
//! the size limit; arguments equal but built otherwise, and arguments JSON
//! would merge; racing calls with other arguments; duplicates polled by one
//! task; failures and dropped calls mixed; transactional mode in savepoints;
//! SQLite URLs whose connections would each see a database of their own.

use crate::common;
use common::counting::Counting;
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, MemoryStore, Outcome, SqliteStore, Store,
};
use serde::{Deserialize, Serialize};
use sqlx::Acquire;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Every store the tests can reach: memory, SQLite (a file of its own), and
/// PostgreSQL and MySQL/MariaDB when their servers answer.
async fn stores() -> Vec<(&'static str, Arc<dyn Store>)> {
    let mut all: Vec<(&'static str, Arc<dyn Store>)> = vec![
        ("memory", Arc::new(MemoryStore::new())),
        (
            "sqlite",
            Arc::new(
                SqliteStore::connect(&common::scratch::sqlite_url("api_edges"))
                    .await
                    .expect("open a SQLite file"),
            ),
        ),
    ];
    if let Some(pg) = common::servers::pg_store_or_skip().await {
        all.push(("postgres", Arc::new(pg)));
    }
    if let Some(my) = common::servers::mysql_store_or_skip().await {
        all.push(("mysql", Arc::new(my)));
    }
    all
}

fn tenant() -> String {
    common::servers::fresh_tenant()
}

// ---- keys and tenants at 255 bytes of multi-byte UTF-8 ------------------------

#[idempotent(scope = "api_edges.limits", key = key, tenant = tenant, store = store, skip(runs))]
async fn at_limits(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// A string of exactly `bytes` bytes made of 2-, 3- and 4-byte characters
/// (and ASCII to fill), starting with `prefix`.
fn multibyte(prefix: &str, bytes: usize) -> String {
    let mut s = prefix.to_owned();
    for c in ['é', '€', '🔑'].iter().cycle() {
        if s.len() + c.len_utf8() > bytes {
            break;
        }
        s.push(*c);
    }
    while s.len() < bytes {
        s.push('a');
    }
    assert_eq!(s.len(), bytes);
    s
}

/// Rule 2 at its limit: a key (and a tenant) of exactly 255 bytes in
/// multi-byte UTF-8 is accepted, recorded and replayed on every store, two
/// such keys that differ only in their last character are two records, and
/// one byte more is `InvalidKey`/`InvalidTenant` before anything runs (never
/// a store error, never cut to an existing record).
#[tokio::test]
async fn keys_and_tenants_of_255_multibyte_bytes() {
    for (name, store) in stores().await {
        let runs = AtomicUsize::new(0);
        let t = multibyte(&tenant(), 255);
        let k1 = multibyte("k1-", 254) + "x";
        let k2 = multibyte("k1-", 254) + "y";
        assert_eq!((k1.len(), k2.len()), (255, 255));
        let first = at_limits(&*store, &t, &k1, 1, &runs).await;
        assert_eq!(first.unwrap(), 1, "{name}: 255-byte tenant and key");
        let (again, outcome) = with_outcome(at_limits(&*store, &t, &k1, 1, &runs)).await;
        assert_eq!(
            (again.unwrap(), outcome),
            (1, Some(Outcome::Replayed)),
            "{name}"
        );
        assert_eq!(
            at_limits(&*store, &t, &k2, 1, &runs).await.unwrap(),
            2,
            "{name}: another last character is another record"
        );
        let mismatch = at_limits(&*store, &t, &k1, 2, &runs).await;
        assert!(
            matches!(mismatch, Err(Error::FingerprintMismatch(_))),
            "{name}: {mismatch:?}"
        );

        // 256 bytes: a 2-byte character over the limit by one.
        let long_key = multibyte("k1-", 254) + "é";
        assert_eq!(long_key.len(), 256);
        let got = at_limits(&*store, &t, &long_key, 1, &runs).await;
        assert!(matches!(got, Err(Error::InvalidKey(_))), "{name}: {got:?}");
        let long_tenant = multibyte(&tenant(), 254) + "é";
        let got = at_limits(&*store, &long_tenant, &k1, 1, &runs).await;
        assert!(
            matches!(got, Err(Error::InvalidTenant(_))),
            "{name}: {got:?}"
        );
        // C1 control characters (NEL) are control characters.
        let got = at_limits(&*store, &t, "a\u{85}b", 1, &runs).await;
        assert!(matches!(got, Err(Error::InvalidKey(_))), "{name}: {got:?}");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            2,
            "{name}: only the two good keys ran"
        );

        // Keys that look alike are different keys: no-break space, NFC/NFD,
        // trailing space, case.
        let t2 = tenant();
        let alike = [
            "k é",
            "k\u{a0}é",
            "k e\u{301}",
            "k é ",
            "K É",
            "🔑",
            "😀",
            "𝒜",
            "\u{fffd}",
            "?",
            "1",
            "01",
            "1.0",
            "1e0",
            "+1",
            " 1",
            "0x1",
            "NULL",
            "null",
            "TRUE",
        ];
        for (i, k) in alike.iter().enumerate() {
            let before = runs.load(Ordering::SeqCst);
            at_limits(&*store, &t2, k, 1, &runs).await.unwrap();
            assert_eq!(
                runs.load(Ordering::SeqCst),
                before + 1,
                "{name}: {i} {k:?} is a key of its own"
            );
            let before = runs.load(Ordering::SeqCst);
            at_limits(&*store, &format!("{t2}{k}"), "k", 1, &runs)
                .await
                .unwrap();
            assert_eq!(
                runs.load(Ordering::SeqCst),
                before + 1,
                "{name}: {i} {k:?} is a tenant of its own"
            );
        }
    }
}

/// The longest scope (128 bytes).
#[idempotent(scope = "api_edges.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", key = key, tenant = tenant, store = store, skip(runs))]
async fn longest_scope(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

#[idempotent(scope = "api_edges.big", key = key, tenant = tenant, store = store, skip(runs, size))]
async fn big(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    size: usize,
) -> Result<String, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok("x".repeat(size))
}

/// Rule 1 at every part's limit at once (a 255-byte tenant, a 128-byte
/// scope, a 255-byte key), and rule 12 at the result's limit: an answer of
/// exactly `MAX_RESULT_BYTES` (as recorded JSON) is recorded and replayed
/// on every store; one byte more is `ResultTooLarge`, nothing recorded.
#[tokio::test]
async fn every_part_at_its_limit_and_the_largest_result() {
    for (name, store) in stores().await {
        let runs = AtomicUsize::new(0);
        let t = multibyte(&tenant(), 255);
        let k = multibyte("k-", 255);
        assert_eq!(longest_scope(&*store, &t, &k, &runs).await.expect(name), 1);
        assert_eq!(
            longest_scope(&*store, &t, &k, &runs).await.expect(name),
            1,
            "{name}: replayed"
        );

        let t = tenant();
        let runs = AtomicUsize::new(0);
        // The JSON of a string of n ASCII letters is n + 2 bytes.
        let limit = store
            .max_result_bytes()
            .min(idempotent_runtime::MAX_RESULT_BYTES);
        let first = big(&*store, &t, "max", &runs, limit - 2).await;
        assert_eq!(first.expect(name).len(), limit - 2);
        let (again, outcome) = with_outcome(big(&*store, &t, "max", &runs, limit - 2)).await;
        assert_eq!(outcome, Some(Outcome::Replayed), "{name}");
        assert_eq!(again.expect(name).len(), limit - 2);
        let over = big(&*store, &t, "over", &runs, limit - 1).await;
        assert!(
            matches!(over, Err(Error::ResultTooLarge { .. })),
            "{name}: {over:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");
    }
}

#[idempotent(scope = "api_edges.split", key = key, tenant = tenant, store = store, skip(runs))]
async fn split_s(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

#[idempotent(scope = "api_edges.splitk", key = key, tenant = tenant, store = store, skip(runs))]
async fn split_sk(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// Rule 1: one text cut into (tenant, scope, key) at every place, with
/// separators a store or a lock name might join the parts with, is as many
/// records as cuts: none is replayed another's answer.
#[tokio::test]
async fn tenant_scope_and_key_never_run_together() {
    for (name, store) in stores().await {
        let runs = AtomicUsize::new(0);
        let base = tenant();
        let text = format!("{base}:k/1|2.3 4%5_6'7\\8");
        let mut answers = std::collections::HashSet::new();
        for cut in 1..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let (t, k) = text.split_at(cut);
            assert!(
                answers.insert(split_s(&*store, t, k, &runs).await.expect(name)),
                "{name}: {t:?}/{k:?}"
            );
            // The scope `api_edges.split` + key `k...` against `api_edges.splitk` + `...`.
            if let Some(rest) = k.strip_prefix('k') {
                if !rest.is_empty() {
                    let n = split_sk(&*store, t, rest, &runs).await.expect(name);
                    assert!(answers.insert(n), "{name}: {t:?}/k/{rest:?}");
                }
            }
        }
        let ran = runs.load(Ordering::SeqCst);
        assert_eq!(ran, answers.len(), "{name}");
        // And each is replayed its own answer.
        for cut in 1..text.len() {
            if text.is_char_boundary(cut) {
                let (t, k) = text.split_at(cut);
                split_s(&*store, t, k, &runs).await.expect(name);
            }
        }
        assert_eq!(runs.load(Ordering::SeqCst), ran, "{name}: all replayed");
    }
}

// ---- the longest durations the attribute accepts --------------------------------

/// Over 2^63 milliseconds (humantime's year is 365.25 days), under 2^64: the
/// attribute accepts it ("more than u64::MAX milliseconds" is the limit).
#[idempotent(scope = "api_edges.forever", key = key, tenant = tenant, store = store, skip(runs, gate),
             ttl = "300000000years", lease = "300000000years", in_progress = wait("300000000years"))]
async fn forever(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    gate: &tokio::sync::Semaphore,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let _ = gate.acquire().await;
    Ok(n)
}

/// Rule 16 and rule 4 at the longest durations: a record kept "forever" is
/// replayed (not expired at once by an overflow), and a duplicate that waits
/// "forever" behind a running owner gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_ttl_lease_and_wait_replay() {
    for (name, inner) in stores().await {
        let store = Arc::new(Counting::new(inner));
        let (t, runs) = (tenant(), Arc::new(AtomicUsize::new(0)));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let owner = {
            let (store, t, runs, gate) = (store.clone(), t.clone(), runs.clone(), gate.clone());
            tokio::spawn(async move { forever(&*store, &t, "k", &runs, &gate).await })
        };
        // The owner's body has started when it counted its run.
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let waiter = {
            let (store, t, runs, gate) = (store.clone(), t.clone(), runs.clone(), gate.clone());
            tokio::spawn(async move { with_outcome(forever(&*store, &t, "k", &runs, &gate)).await })
        };
        // The duplicate found the record in progress and waits.
        store.waited(1).await;
        gate.close();
        assert_eq!(owner.await.unwrap().expect("owner"), 1, "{name}");
        let (waited, outcome) = tokio::time::timeout(Duration::from_secs(60), waiter)
            .await
            .expect("the waiter answers")
            .unwrap();
        assert_eq!(waited.expect("waiter"), 1, "{name}");
        assert!(
            matches!(outcome, Some(Outcome::Replayed)),
            "{name}: {outcome:?}"
        );
        let (again, outcome) = with_outcome(forever(&*store, &t, "k", &runs, &gate)).await;
        assert_eq!(
            (again.expect("retry"), outcome),
            (1, Some(Outcome::Replayed)),
            "{name}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}: the body ran once");
    }
}

// ---- results at the edges of JSON --------------------------------------------------

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Edges {
    u64_max: u64,
    i64_min: i64,
    u128_max: u128,
    i128_min: i128,
    above_2_53: u64,
    neg_zero: f64,
    subnormal: f64,
    f32s: Vec<f32>,
    f32_neg_zero: f32,
    chars: Vec<char>,
    text: String,
    by_number: BTreeMap<u64, String>,
    by_i128: HashMap<i128, u8>,
    by_bool: BTreeMap<bool, u8>,
    by_char: BTreeMap<char, u8>,
    nested: Option<Option<u8>>,
    bytes: Vec<u8>,
    unit: (),
    tuple: (u8, String, Option<u8>),
}

fn edges() -> Edges {
    // f32 values spread over the whole range (every 2^17th bit pattern),
    // finite only.
    let f32s = (0u32..=u32::MAX)
        .step_by(1 << 17)
        .map(f32::from_bits)
        .filter(|f| f.is_finite())
        .chain([
            0.1,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::EPSILON,
            16_777_217.0,
        ])
        .collect();
    Edges {
        u64_max: u64::MAX,
        i64_min: i64::MIN,
        u128_max: u128::MAX,
        i128_min: i128::MIN,
        above_2_53: (1 << 53) + 1,
        neg_zero: -0.0,
        subnormal: f64::from_bits(1),
        f32s,
        f32_neg_zero: -0.0,
        chars: vec!['\0', '\u{1f}', '"', '\\', '\u{2028}', '\u{10ffff}', 'é'],
        text: "nul\0 \u{7f} \u{85} \u{2028}\u{2029} \"q\" \\ \u{feff} e\u{301} 🔑".to_owned(),
        by_number: [(0, "zero".to_owned()), (u64::MAX, "max".to_owned())].into(),
        by_i128: [(i128::MIN, 1), (i128::MAX, 2), (0, 3)].into(),
        by_bool: [(false, 0), (true, 1)].into(),
        by_char: [('\0', 0), ('"', 1), ('🔑', 2)].into(),
        nested: Some(Some(0)),
        bytes: (0..=255).collect(),
        unit: (),
        tuple: (255, String::new(), None),
    }
}

#[idempotent(scope = "api_edges.edges", key = key, tenant = tenant, store = store, skip(runs))]
async fn edge_result(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<Edges, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(edges())
}

fn float_bits(e: &Edges) -> (u64, u64, Vec<u32>, u32) {
    (
        e.neg_zero.to_bits(),
        e.subnormal.to_bits(),
        e.f32s.iter().map(|f| f.to_bits()).collect(),
        e.f32_neg_zero.to_bits(),
    )
}

/// Rule 12: a replay returns an equal value, to the bit for floats, for
/// numbers, strings, characters and map keys at the edges of what JSON
/// carries, on every store.
#[tokio::test]
async fn results_at_the_edges_of_json_replay_equal() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let first = edge_result(&*store, &t, "k", &runs)
            .await
            .expect("recorded");
        let (again, outcome) = with_outcome(edge_result(&*store, &t, "k", &runs)).await;
        assert_eq!(outcome, Some(Outcome::Replayed), "{name}");
        let again = again.expect("replayed");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
        assert_eq!(again, first, "{name}");
        assert_eq!(
            float_bits(&again),
            float_bits(&edges()),
            "{name}: floats to the bit"
        );
    }
}

// ---- concurrent calls of one key with different arguments ------------------------

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Echo {
    amount: u64,
    run: usize,
}

#[idempotent(scope = "api_edges.race", key = key, tenant = tenant, store = store, skip(runs),
             in_progress = wait("30s"))]
async fn race(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<Echo, Error> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::task::yield_now().await;
    Ok(Echo { amount, run })
}

/// Rules 3, 5 and 7 together: calls of one fresh key with two different
/// arguments, all at once. Exactly one body runs; every call that gets an
/// answer gets the winner's, and only when its own arguments are the
/// winner's; the others are refused as a reused key (or in progress).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_calls_with_other_arguments_never_get_anothers_answer() {
    for (name, store) in stores().await {
        for round in 0..5 {
            let (t, runs) = (tenant(), Arc::new(AtomicUsize::new(0)));
            let barrier = Arc::new(tokio::sync::Barrier::new(24));
            let calls: Vec<_> = (0..24u64)
                .map(|i| {
                    let (store, t, runs, barrier) =
                        (store.clone(), t.clone(), runs.clone(), barrier.clone());
                    let amount = 100 + i % 2;
                    tokio::spawn(async move {
                        barrier.wait().await;
                        (amount, race(&*store, &t, "k", amount, &runs).await)
                    })
                })
                .collect();
            let mut answers = Vec::new();
            for call in calls {
                answers.push(call.await.unwrap());
            }
            assert_eq!(
                runs.load(Ordering::SeqCst),
                1,
                "{name} round {round}: one body ran"
            );
            let winner = answers
                .iter()
                .find_map(|(_, r)| r.as_ref().ok().cloned())
                .expect("the winner's answer");
            for (amount, answer) in &answers {
                match answer {
                    Ok(echo) => {
                        assert_eq!(echo, &winner, "{name}: one answer");
                        assert_eq!(
                            *amount, winner.amount,
                            "{name}: an answer for other arguments"
                        );
                    }
                    Err(Error::FingerprintMismatch(_)) => {
                        assert_ne!(
                            *amount, winner.amount,
                            "{name}: the winner's own arguments refused"
                        )
                    }
                    Err(e) => panic!("{name} round {round}: {amount}: {e:?}"),
                }
            }
        }
    }
}

// ---- SQLite URLs -------------------------------------------------------------------

#[idempotent(scope = "api_edges.url", key = key, tenant = shared, store = store, skip(runs))]
async fn via_url(store: &SqliteStore, key: &str, runs: &AtomicUsize) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::task::yield_now().await;
    Ok(n)
}

/// A SQLite URL whose every connection would see a database of its own
/// (SQLite's `memdb` VFS, whose databases are private to a connection unless
/// their name starts with `/`) must be refused when the store opens, as a
/// private in-memory database is (README, Stores): otherwise the store's
/// connections do not see each other's records, and a retry on another
/// pooled connection runs the body again. Whatever such a URL opens, a key's
/// body runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_urls_never_give_connections_databases_of_their_own() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let urls = [
        format!("sqlite://api_edges-{id}-private?vfs=memdb"),
        format!("sqlite:api_edges-{id}-private2?vfs=memdb&mode=rwc"),
        format!("sqlite:///api_edges-{id}-shared?vfs=memdb"),
        format!("sqlite://file:api_edges-{id}-named?mode=memory&cache=shared"),
    ];
    for url in urls {
        let store = match SqliteStore::connect(&url).await {
            Ok(store) => Arc::new(store),
            Err(e) => {
                eprintln!("{url}: refused: {e}");
                continue;
            }
        };
        let runs = Arc::new(AtomicUsize::new(0));
        let calls: Vec<_> = (0..16)
            .map(|_| {
                let (store, runs) = (store.clone(), runs.clone());
                tokio::spawn(async move { via_url(&store, "k", &runs).await })
            })
            .collect();
        for call in calls {
            let got = call.await.unwrap();
            assert!(
                matches!(got, Ok(1) | Err(Error::InProgress { .. })),
                "{url}: {got:?}"
            );
        }
        for _ in 0..8 {
            assert_eq!(
                via_url(&store, "k", &runs).await.expect(&url),
                1,
                "{url}: replayed"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{url}: the body ran once");
    }
}

// ---- transactional mode in savepoints -------------------------------------------

macro_rules! savepoint_fns {
    ($db:ty, $name:ident, $scope:literal) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(runs),
                                                                             in_progress = reject)]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            amount: u64,
            runs: &AtomicUsize,
        ) -> Result<usize, Error> {
            let _ = amount;
            Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
        }
    };
}
savepoint_fns!(sqlx::Postgres, pg_in_savepoint, "api_edges.sp_pg");
savepoint_fns!(sqlx::MySql, my_in_savepoint, "api_edges.sp_my");
savepoint_fns!(sqlx::Sqlite, lite_in_savepoint, "api_edges.sp_lite");

/// Rule 15 with sqlx's nested transactions (savepoints), on each SQL store:
/// a call in a savepoint rolled back leaves no record (the same outer
/// transaction runs the key again, and after its commit a retry replays);
/// a call in a savepoint released into an outer transaction that rolls back
/// leaves none either; within one transaction a second call replays and
/// other arguments are refused.
macro_rules! savepoint_test {
    ($test:ident, $store:expr, $call:ident, $scope:literal) => {
        #[tokio::test]
        async fn $test() {
            let Some(store) = $store.await else { return };
            let pool = store.pool().clone();
            let (t, runs) = (tenant(), AtomicUsize::new(0));
            let fetch = |key: &'static str| {
                let (store, t) = (&store, t.clone());
                async move {
                    store
                        .fetch(&Identity::new(t, $scope, key).unwrap())
                        .await
                        .expect("fetch")
                }
            };

            // A: rolled-back savepoint, then the outer transaction runs it.
            let mut outer = pool.begin().await.expect("begin");
            {
                let mut inner = outer.begin().await.expect("savepoint");
                assert_eq!(
                    $call(&mut inner, &t, "a", 1, &runs)
                        .await
                        .expect("in savepoint"),
                    1
                );
                inner.rollback().await.expect("rollback to savepoint");
            }
            let (again, outcome) = with_outcome($call(&mut outer, &t, "a", 1, &runs)).await;
            assert_eq!(
                (again.expect("outer"), outcome),
                (2, Some(Outcome::Executed))
            );
            let (again, outcome) = with_outcome($call(&mut outer, &t, "a", 1, &runs)).await;
            assert_eq!(
                (again.expect("same tx"), outcome),
                (2, Some(Outcome::Replayed))
            );
            let other = $call(&mut outer, &t, "a", 2, &runs).await;
            assert!(
                matches!(other, Err(Error::FingerprintMismatch(_))),
                "{other:?}"
            );
            outer.commit().await.expect("commit");
            let mut tx = pool.begin().await.expect("begin");
            let (again, outcome) = with_outcome($call(&mut tx, &t, "a", 1, &runs)).await;
            assert_eq!(
                (again.expect("retry"), outcome),
                (2, Some(Outcome::Replayed))
            );
            tx.commit().await.expect("commit");

            // B: released savepoint, outer rolled back.
            let mut outer = pool.begin().await.expect("begin");
            {
                let mut inner = outer.begin().await.expect("savepoint");
                assert_eq!(
                    $call(&mut inner, &t, "b", 1, &runs)
                        .await
                        .expect("in savepoint"),
                    3
                );
                inner.commit().await.expect("release savepoint");
            }
            outer.rollback().await.expect("rollback");
            assert!(
                fetch("b").await.is_none(),
                "rolled back with the outer transaction"
            );
            let mut tx = pool.begin().await.expect("begin");
            let (again, outcome) = with_outcome($call(&mut tx, &t, "b", 1, &runs)).await;
            assert_eq!(
                (again.expect("retry"), outcome),
                (4, Some(Outcome::Executed))
            );
            tx.commit().await.expect("commit");
            assert_eq!(runs.load(Ordering::SeqCst), 4);
        }
    };
}

savepoint_test!(
    pg_calls_in_savepoints_commit_and_roll_back_with_them,
    common::servers::pg_store_or_skip(),
    pg_in_savepoint,
    "api_edges.sp_pg"
);
savepoint_test!(
    mysql_calls_in_savepoints_commit_and_roll_back_with_them,
    common::servers::mysql_store_or_skip(),
    my_in_savepoint,
    "api_edges.sp_my"
);
savepoint_test!(
    sqlite_calls_in_savepoints_commit_and_roll_back_with_them,
    async {
        Some(
            SqliteStore::connect(&common::scratch::sqlite_url("api_edges-sp"))
                .await
                .expect("open"),
        )
    },
    lite_in_savepoint,
    "api_edges.sp_lite"
);

// ---- equal arguments built in other orders ---------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
struct Line {
    sku: String,
    qty: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", content = "data")]
enum Adjacent {
    Tags(std::collections::HashSet<String>),
    Lines {
        lines: std::collections::HashSet<Line>,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
enum External {
    Tags(std::collections::HashSet<u16>),
    Pair(std::collections::HashSet<u16>, u8),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind")]
enum Internal {
    Lines {
        lines: std::collections::HashSet<Line>,
    },
}

#[derive(Debug, Serialize)]
struct Nested {
    by_sku: HashMap<String, std::collections::HashSet<u16>>,
    #[allow(clippy::box_collection)] // a set behind a box is one of the shapes
    boxed: Box<std::collections::HashSet<String>>,
    shared: Arc<std::collections::HashSet<u16>>,
    maybe: Option<std::collections::HashSet<(u8, String)>>,
    in_tuple: (std::collections::HashSet<u16>, u8),
    in_vec: Vec<std::collections::HashSet<u16>>,
    by_tuple: HashMap<(u8, String), Vec<u8>>,
    adjacent: Adjacent,
    adjacent_struct: Adjacent,
    external: External,
    external_pair: External,
    internal: Internal,
    cell: std::cell::RefCell<std::collections::HashSet<u16>>,
    mutex: std::sync::Mutex<std::collections::HashSet<u16>>,
}

/// Builds the same value from scratch; each `HashSet`/`HashMap` gets its own
/// random hasher keys, so its iteration order differs from one build to the
/// next.
fn nested() -> Nested {
    use std::collections::HashSet;
    let nums = || (0u16..12).collect::<HashSet<_>>();
    let words = || (0..12).map(|i| format!("w{i}")).collect::<HashSet<_>>();
    let lines = || {
        (0..12)
            .map(|i| Line {
                sku: format!("s{i}"),
                qty: i,
            })
            .collect::<HashSet<_>>()
    };
    Nested {
        by_sku: (0..6).map(|i| (format!("s{i}"), nums())).collect(),
        boxed: Box::new(words()),
        shared: Arc::new(nums()),
        maybe: Some((0..12).map(|i| (i, format!("x{i}"))).collect()),
        in_tuple: (nums(), 1),
        in_vec: vec![nums(), nums()],
        by_tuple: (0..12)
            .map(|i| ((i, format!("t{i}")), vec![i, 0]))
            .collect(),
        adjacent: Adjacent::Tags(words()),
        adjacent_struct: Adjacent::Lines { lines: lines() },
        external: External::Tags(nums()),
        external_pair: External::Pair(nums(), 2),
        internal: Internal::Lines { lines: lines() },
        cell: std::cell::RefCell::new(nums()),
        mutex: std::sync::Mutex::new(nums()),
    }
}

#[idempotent(scope = "api_edges.equal", key = key, tenant = shared, store = store, skip(runs))]
async fn equal_args(
    store: &MemoryStore,
    key: &str,
    order: &Nested,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// Rule 6: the same value, built again with every set and map iterating
/// otherwise, is the same request (never a false `FingerprintMismatch`),
/// wherever the sets sit: in maps, boxes, `Arc`s, options, tuples, vectors,
/// adjacently, externally and internally tagged enums, cells and mutexes.
#[tokio::test]
async fn equal_values_built_otherwise_are_one_request() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let first = nested();
    equal_args(&store, "k", &first, &runs).await.expect("first");
    for i in 0..20 {
        let again = nested();
        let got = equal_args(&store, "k", &again, &runs).await;
        assert_eq!(
            got.unwrap_or_else(|e| panic!("build {i}: {e:?}")),
            1,
            "build {i}: replayed"
        );
    }
    // And one element changed anywhere is another request.
    let mut other = nested();
    other.in_vec[1].insert(99);
    let got = equal_args(&store, "k", &other, &runs).await;
    assert!(matches!(got, Err(Error::FingerprintMismatch(_))), "{got:?}");
}

// ---- transactional mode with the longest durations --------------------------------

macro_rules! forever_tx_fns {
    ($db:ty, $name:ident, $scope:literal) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(runs),
                                             ttl = "300000000years", lease = "300000000years",
                                             in_progress = wait("300000000years"))]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            runs: &AtomicUsize,
        ) -> Result<usize, Error> {
            Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
        }
    };
}
forever_tx_fns!(sqlx::Postgres, pg_forever_tx, "api_edges.forever_pg");
forever_tx_fns!(sqlx::MySql, my_forever_tx, "api_edges.forever_my");
forever_tx_fns!(sqlx::Sqlite, lite_forever_tx, "api_edges.forever_lite");

/// Rules 15 and 16 at the longest durations the attribute accepts, in
/// transactional mode: a call executes and commits, and a retry in a new
/// transaction replays (the durations reach each database's lock waits and
/// expiry arithmetic).
macro_rules! forever_tx_test {
    ($test:ident, $store:expr, $call:ident) => {
        #[tokio::test]
        async fn $test() {
            let Some(store) = $store.await else { return };
            let pool = store.pool().clone();
            let (t, runs) = (tenant(), AtomicUsize::new(0));
            let mut tx = pool.begin().await.expect("begin");
            let (first, outcome) = with_outcome($call(&mut tx, &t, "k", &runs)).await;
            assert_eq!(
                (first.expect("first"), outcome),
                (1, Some(Outcome::Executed))
            );
            tx.commit().await.expect("commit");
            let mut tx = pool.begin().await.expect("begin");
            let (again, outcome) = with_outcome($call(&mut tx, &t, "k", &runs)).await;
            assert_eq!(
                (again.expect("retry"), outcome),
                (1, Some(Outcome::Replayed))
            );
            tx.commit().await.expect("commit");
        }
    };
}
forever_tx_test!(
    pg_the_longest_ttl_lease_and_wait_in_a_transaction,
    common::servers::pg_store_or_skip(),
    pg_forever_tx
);
forever_tx_test!(
    mysql_the_longest_ttl_lease_and_wait_in_a_transaction,
    common::servers::mysql_store_or_skip(),
    my_forever_tx
);
forever_tx_test!(
    sqlite_the_longest_ttl_lease_and_wait_in_a_transaction,
    async {
        Some(
            SqliteStore::connect(&common::scratch::sqlite_url("api_edges-forever"))
                .await
                .expect("open"),
        )
    },
    lite_forever_tx
);

// ---- duplicates polled by one task ------------------------------------------------

#[idempotent(scope = "api_edges.one_task", key = key, tenant = tenant, store = store, skip(runs, gate),
             in_progress = wait("30s"))]
async fn one_task(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
    gate: &tokio::sync::Semaphore,
) -> Result<(u64, usize), Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let _ = gate.acquire().await;
    Ok((amount, n))
}

/// Rules 3 and 4 on a current-thread runtime, the duplicates all polled by
/// one task (`join_all`): the first runs the body (held until every other
/// call has been polled once), the others wait and replay; none runs the
/// body, none is refused, none waits for ever.
#[tokio::test(flavor = "current_thread")]
async fn duplicates_polled_by_one_task_wait_and_replay() {
    for (name, inner) in stores().await {
        let store = Counting::new(inner);
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let gate = tokio::sync::Semaphore::new(0);
        let calls =
            futures::future::join_all((0..12).map(|_| one_task(&store, &t, "k", 5, &runs, &gate)));
        let opener = async {
            // Every duplicate found the record in progress and waits.
            store.waited(11).await;
            gate.close();
        };
        let (answers, ()) = tokio::time::timeout(Duration::from_secs(120), async {
            tokio::join!(calls, opener)
        })
        .await
        .unwrap_or_else(|_| panic!("{name}: the calls never ended"));
        for answer in answers {
            assert_eq!(answer.expect(name), (5, 1), "{name}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
    }
}

// ---- values JSON would merge are different requests --------------------------------

#[derive(Debug, Clone, PartialEq, Serialize)]
struct Request {
    nested: Option<Option<u8>>,
    deeper: Option<Option<Option<()>>>,
    big: u128,
    small: i128,
    wide: u64,
    float: f64,
    single: f32,
    text: String,
    bytes: Vec<u8>,
    letter: char,
    pair: (String, String),
    unit: Option<()>,
    by_key: HashMap<Option<String>, u8>,
}

fn request() -> Request {
    Request {
        nested: None,
        deeper: Some(None),
        big: u128::MAX,
        small: i128::MIN,
        wide: 1 << 53,
        float: 0.1,
        single: 0.1,
        text: "a\0b".to_owned(),
        bytes: vec![1, 2],
        letter: 'a',
        pair: ("ab".to_owned(), "c".to_owned()),
        unit: None,
        by_key: [(None, 1)].into(),
    }
}

#[idempotent(scope = "api_edges.merge", key = key, tenant = shared, store = store, skip(runs))]
async fn merge(
    store: &MemoryStore,
    key: &str,
    request: &Request,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// Rule 6: values that differ where JSON (or a careless canonical form)
/// would write them alike are different requests: `None` and `Some(None)`,
/// `Some(Some(None))` and `Some(None)`, integers one apart beyond `f64`'s
/// precision and at the 128-bit limits, floats one bit apart, a string with
/// and without what follows a NUL, two strings cut elsewhere, `None` and
/// `Some(())` ...; each is refused as a reused key, never replayed.
#[tokio::test]
async fn values_json_would_merge_are_different_requests() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    assert_eq!(
        merge(&store, "k", &request(), &runs).await.expect("first"),
        1
    );
    assert_eq!(
        merge(&store, "k", &request(), &runs).await.expect("replay"),
        1
    );
    type Change = Box<dyn Fn(&mut Request)>;
    let variants: Vec<(&str, Change)> = vec![
        ("Some(None)", Box::new(|r| r.nested = Some(None))),
        (
            "Some(Some(None))",
            Box::new(|r| r.deeper = Some(Some(None))),
        ),
        ("None", Box::new(|r| r.deeper = None)),
        ("u128::MAX - 1", Box::new(|r| r.big = u128::MAX - 1)),
        ("i128::MIN + 1", Box::new(|r| r.small = i128::MIN + 1)),
        ("2^53 + 1", Box::new(|r| r.wide = (1 << 53) + 1)),
        (
            "next f64",
            Box::new(|r| r.float = f64::from_bits(0.1f64.to_bits() + 1)),
        ),
        ("-0.0 vs 0.1", Box::new(|r| r.float = -0.0)),
        (
            "next f32",
            Box::new(|r| r.single = f32::from_bits(0.1f32.to_bits() + 1)),
        ),
        ("f32 as f64", Box::new(|r| r.single = 0.1f64 as f32)),
        ("text cut at NUL", Box::new(|r| r.text = "a".to_owned())),
        ("bytes reordered", Box::new(|r| r.bytes = vec![2, 1])),
        ("char", Box::new(|r| r.letter = 'b')),
        (
            "pair cut elsewhere",
            Box::new(|r| r.pair = ("a".to_owned(), "bc".to_owned())),
        ),
        ("Some(())", Box::new(|r| r.unit = Some(()))),
        (
            "Some(\"null\") key",
            Box::new(|r| r.by_key = [(Some("null".to_owned()), 1)].into()),
        ),
        (
            "Some(\"\") key",
            Box::new(|r| r.by_key = [(Some(String::new()), 1)].into()),
        ),
    ];
    for (what, change) in variants {
        let mut other = request();
        change(&mut other);
        if format!("{other:?}") == format!("{:?}", request()) {
            continue; // not another value (0.1f64 as f32 is 0.1f32)
        }
        let got = merge(&store, "k", &other, &runs).await;
        assert!(
            matches!(got, Err(Error::FingerprintMismatch(_))),
            "{what}: {got:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

// ---- errors, drops and duplicates together -----------------------------------------

#[idempotent(scope = "api_edges.churn", key = key, tenant = tenant, store = store, skip(runs),
             in_progress = wait("20s"))]
async fn churn(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    for _ in 0..(n % 4) {
        tokio::task::yield_now().await;
    }
    if n % 3 == 1 {
        // A failure: the key is released and the next call runs again.
        return Err(Error::InvalidKey(idempotent_runtime::KeyProblem::Empty));
    }
    Ok(n)
}

/// Rules 3, 5, 13 and 14 at once, on every store: many calls of a few keys,
/// bodies that fail (releasing the key) and calls dropped at random points
/// (mid-reservation, mid-body, mid-completion). Every call that gets an
/// answer for a key gets the same one, and once the dropped calls' work is
/// done, a retry replays that answer (or runs once, when none was given).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failures_and_drops_never_give_one_key_two_answers() {
    for (name, store) in stores().await {
        let t = tenant();
        let runs = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..120u64 {
            let (store, t, runs) = (store.clone(), t.clone(), runs.clone());
            tasks.push(tokio::spawn(async move {
                let key = format!("k{}", i % 6);
                let call = churn(&*store, &t, &key, &runs);
                // Every third call is dropped after a few polls.
                let answer = if i % 3 == 0 {
                    let mut call = std::pin::pin!(call);
                    let mut polled = None;
                    for _ in 0..(i % 7) {
                        match futures::poll!(call.as_mut()) {
                            std::task::Poll::Ready(a) => {
                                polled = Some(a);
                                break;
                            }
                            std::task::Poll::Pending => tokio::task::yield_now().await,
                        }
                    }
                    polled
                } else {
                    Some(call.await)
                };
                (key, answer)
            }));
        }
        let mut answers: HashMap<String, usize> = HashMap::new();
        for task in tasks {
            let (key, answer) = task.await.unwrap();
            match answer {
                Some(Ok(n)) => {
                    let first = *answers.entry(key.clone()).or_insert(n);
                    assert_eq!(first, n, "{name}: {key} got two answers");
                }
                Some(Err(Error::InvalidKey(_))) | None => {}
                Some(Err(e)) => panic!("{name}: {key}: {e:?}"),
            }
        }
        assert_eq!(
            store.finish_background_work(Duration::from_secs(60)).await,
            0,
            "{name}"
        );
        for k in 0..6 {
            let key = format!("k{k}");
            // A retry after the dust settled: the answer given, or a fresh run.
            let mut got = churn(&*store, &t, &key, &runs).await;
            if matches!(got, Err(Error::InvalidKey(_))) {
                got = churn(&*store, &t, &key, &runs).await;
            }
            let n = got.unwrap_or_else(|e| panic!("{name}: {key}: {e:?}"));
            if let Some(first) = answers.get(&key) {
                assert_eq!(*first, n, "{name}: {key}: the retry got another answer");
            }
            let (again, outcome) = with_outcome(churn(&*store, &t, &key, &runs)).await;
            assert_eq!(
                (again.expect(name), outcome),
                (n, Some(Outcome::Replayed)),
                "{name}: {key}"
            );
        }
    }
}

// ---- an expired record is absent, whatever it was made with -----------------------

/// A body's own error, recorded; the framework's refusals as text.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Declined(String);

impl From<Error> for Declined {
    fn from(e: Error) -> Self {
        Declined(format!("framework: {e:?}"))
    }
}

#[idempotent(scope = "api_edges.brief", key = key, tenant = tenant, store = store, skip(runs),
             ttl = "1ms", errors = record, shared_scope)]
async fn brief(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    fail: bool,
    runs: &AtomicUsize,
) -> Result<(u64, usize), Declined> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if fail {
        return Err(Declined(format!("declined {n}")));
    }
    Ok((amount, n))
}

/// Until the store's clock says the record of `key` counts as absent.
async fn until_expired(store: &dyn Store, tenant: &str, key: &str) {
    let identity = Identity::new(tenant, "api_edges.brief", key).unwrap();
    for _ in 0..10_000 {
        match store.fetch(&identity).await.expect("fetch") {
            Some(snapshot) if !snapshot.is_expired() => {
                tokio::time::sleep(Duration::from_millis(1)).await
            }
            _ => return,
        }
    }
    panic!("the record never expired");
}

/// Rule 16 with rule 7: a record whose retention ran out counts as absent,
/// so a call with *other* arguments (or another outcome) runs, is recorded
/// and replayed; it is neither refused as a reused key nor answered with the
/// old record, on every store.
#[tokio::test]
async fn an_expired_record_is_absent_for_other_arguments() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        assert_eq!(
            brief(&*store, &t, "k", 1, false, &runs).await,
            Ok((1, 1)),
            "{name}"
        );
        until_expired(&*store, &t, "k").await;
        // Other arguments, and an error recorded this time.
        let (got, outcome) = with_outcome(brief(&*store, &t, "k", 2, true, &runs)).await;
        assert_eq!(
            (got, outcome),
            (Err(Declined("declined 2".into())), Some(Outcome::Executed)),
            "{name}"
        );
        until_expired(&*store, &t, "k").await;
        let (got, outcome) = with_outcome(brief(&*store, &t, "k", 3, false, &runs)).await;
        assert_eq!(
            (got, outcome),
            (Ok((3, 3)), Some(Outcome::Executed)),
            "{name}"
        );
    }
}

macro_rules! brief_tx {
    ($db:ty, $name:ident, $test:ident, $store:expr) => {
        #[idempotent(scope = "api_edges.brief", key = key, tenant = tenant, tx = tx, skip(runs),
                                                     ttl = "1ms", errors = record, shared_scope)]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            amount: u64,
            fail: bool,
            runs: &AtomicUsize,
        ) -> Result<(u64, usize), Declined> {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            if fail {
                return Err(Declined(format!("declined {n}")));
            }
            Ok((amount, n))
        }

        /// As `an_expired_record_is_absent_for_other_arguments`, in
        /// transactional mode (each call in a transaction that commits).
        #[tokio::test]
        async fn $test() {
            let Some(store) = $store.await else { return };
            let pool = store.pool().clone();
            let (t, runs) = (tenant(), AtomicUsize::new(0));
            let steps = [
                (1, false, Ok((1, 1))),
                (2, true, Err(Declined("declined 2".into()))),
                (3, false, Ok((3, 3))),
            ];
            for (amount, fail, expected) in steps {
                let mut tx = pool.begin().await.expect("begin");
                let (got, outcome) =
                    with_outcome($name(&mut tx, &t, "k", amount, fail, &runs)).await;
                tx.commit().await.expect("commit");
                assert_eq!(
                    (got, outcome),
                    (expected, Some(Outcome::Executed)),
                    "{amount}"
                );
                until_expired(&store, &t, "k").await;
            }
        }
    };
}
brief_tx!(
    sqlx::MySql,
    brief_my,
    mysql_an_expired_record_is_absent_in_a_transaction,
    common::servers::mysql_store_or_skip()
);
brief_tx!(
    sqlx::Sqlite,
    brief_lite,
    sqlite_an_expired_record_is_absent_in_a_transaction,
    async {
        Some(
            SqliteStore::connect(&common::scratch::sqlite_url("api_edges-brief"))
                .await
                .expect("open"),
        )
    }
);

// ---- `fingerprint = false` and the answer's type -----------------------------------

#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Customer {
    name: String,
}

#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Invoice {
    name: String,
}

/// Two answer types whose JSON looks alike: one decodes as the other.
trait Named: Default + Serialize + serde::de::DeserializeOwned + Send + Sync {
    fn named() -> Self;
}

impl Named for Customer {
    fn named() -> Self {
        Customer {
            name: "customer".into(),
        }
    }
}

impl Named for Invoice {
    fn named() -> Self {
        Invoice {
            name: "invoice".into(),
        }
    }
}

/// Arguments not compared (`fingerprint = false`); the answer is a `T`.
#[idempotent(scope = "api_edges.unfingerprinted_load", key = key, tenant = shared, store = store,
             fingerprint = false)]
async fn unfingerprinted_load<T: Named>(
    store: &MemoryStore,
    key: &str,
    note: u8,
    runs: &AtomicUsize,
) -> Result<T, Error> {
    let _ = note;
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(T::named())
}

/// A const parameter shaping the answer, arguments not compared.
#[idempotent(scope = "api_edges.unfingerprinted_fill", key = key, tenant = shared, store = store,
             fingerprint = false)]
async fn unfingerprinted_fill<const N: usize>(
    store: &MemoryStore,
    key: &str,
    byte: u8,
) -> Result<Vec<u8>, Error> {
    Ok(vec![byte; N])
}

/// A type parameter no parameter shows, shaping an answer of one type.
#[idempotent(scope = "api_edges.unfingerprinted_create", key = key, tenant = shared,
             store = store, fingerprint = false)]
async fn unfingerprinted_create<T: Named>(store: &MemoryStore, key: &str) -> Result<String, Error> {
    Ok(std::any::type_name::<T>().to_owned())
}

/// A trait's default method answering `Self`, arguments not compared.
trait Loaded: Named {
    #[idempotent(scope = "api_edges.unfingerprinted_created", key = key, tenant = shared,
                 store = store, fingerprint = false)]
    async fn created(store: &MemoryStore, key: &str) -> Result<Self, Error> {
        Ok(Self::named())
    }
}

impl Loaded for Customer {}
impl Loaded for Invoice {}

/// A method of a generic type answering its parameter, arguments not compared.
struct Shelf<T>(std::marker::PhantomData<T>);

impl<T: Named> Shelf<T> {
    #[idempotent(scope = "api_edges.unfingerprinted_shelf", key = key, tenant = shared,
                 store = store, fingerprint = false)]
    async fn take(&self, store: &MemoryStore, key: &str) -> Result<T, Error> {
        Ok(T::named())
    }
}

/// The README (generics): "the answer is of that type, so `load::<Invoice>`
/// never replays what `load::<User>` recorded". `fingerprint = false` says
/// the *arguments* are not compared (a retry with another `note` replays);
/// it must not make one instantiation's answer the other's: a record of a
/// `Customer` replayed to a call answering an `Invoice` is decoded as one
/// (the JSON fits) and handed over as that call's own answer.
#[tokio::test]
async fn fingerprint_false_never_replays_one_answer_type_as_another() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let customer = unfingerprinted_load::<Customer>(&store, "k", 1, &runs).await;
    assert_eq!(customer.expect("runs"), Customer::named());
    // Arguments are not compared: another `note` is the same request.
    let (again, outcome) =
        with_outcome(unfingerprinted_load::<Customer>(&store, "k", 2, &runs)).await;
    assert_eq!(
        (again.expect("replayed"), outcome),
        (Customer::named(), Some(Outcome::Replayed))
    );
    let (invoice, outcome) =
        with_outcome(unfingerprinted_load::<Invoice>(&store, "k", 1, &runs)).await;
    assert!(
        matches!(invoice, Err(Error::FingerprintMismatch(_))),
        "an Invoice call got {invoice:?} ({outcome:?}): the Customer's answer, decoded as an Invoice"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    assert_eq!(
        Customer::created(&store, "c").await.expect("runs"),
        Customer::named()
    );
    let invoice = Invoice::created(&store, "c").await;
    assert!(
        matches!(invoice, Err(Error::FingerprintMismatch(_))),
        "Invoice::created got {invoice:?}: the Customer's answer"
    );
    assert_eq!(
        Customer::created(&store, "c").await.expect("replayed"),
        Customer::named()
    );

    let customers = Shelf::<Customer>(std::marker::PhantomData);
    let invoices = Shelf::<Invoice>(std::marker::PhantomData);
    assert_eq!(
        customers.take(&store, "s").await.expect("runs"),
        Customer::named()
    );
    let invoice = invoices.take(&store, "s").await;
    assert!(
        matches!(invoice, Err(Error::FingerprintMismatch(_))),
        "Shelf::<Invoice>::take got {invoice:?}: the Customer's answer"
    );
    assert_eq!(
        customers.take(&store, "s").await.expect("replayed"),
        Customer::named()
    );

    // `Vec<u8>` whatever `N`, and no argument shows `N`, which shapes the
    // answer: as with a fingerprint (`create::<User>(key)`).
    assert_eq!(
        unfingerprinted_fill::<2>(&store, "f", 7)
            .await
            .expect("runs"),
        vec![7; 2]
    );
    assert_eq!(
        unfingerprinted_fill::<2>(&store, "f", 9)
            .await
            .expect("replayed"),
        vec![7; 2]
    );
    let three = unfingerprinted_fill::<3>(&store, "f", 7).await;
    assert!(
        matches!(three, Err(Error::FingerprintMismatch(_))),
        "{three:?}"
    );
    unfingerprinted_create::<Customer>(&store, "n")
        .await
        .expect("runs");
    let order = unfingerprinted_create::<Invoice>(&store, "n").await;
    assert!(
        matches!(order, Err(Error::FingerprintMismatch(_))),
        "{order:?}"
    );
}

// ---- a trait's default method, implementors that are generic types ----------------

/// A default method whose answer depends on the implementor (`Self`), its
/// return type not naming it.
trait Describe: Send + Sync {
    fn what(&self) -> String;

    #[idempotent(scope = "api_edges.describe", key = key, tenant = shared, store = store)]
    async fn describe(&self, store: &MemoryStore, key: &str) -> Result<String, Error> {
        Ok(self.what())
    }
}

impl<T: Named> Describe for (T,) {
    fn what(&self) -> String {
        std::any::type_name::<T>().to_owned()
    }
}

impl<T: Named> Describe for Vec<T> {
    fn what(&self) -> String {
        std::any::type_name::<T>().to_owned()
    }
}

/// The README: "An implementor that is a generic type counts its `Self`
/// (`Generic<u8>` and `Generic<u16>` are told apart)". `Vec<T>` is; so is a
/// tuple `(T,)`.
#[tokio::test]
async fn generic_implementors_of_a_default_method_are_told_apart() {
    let store = MemoryStore::new();
    let vec_c: Vec<Customer> = Vec::new();
    let vec_i: Vec<Invoice> = Vec::new();
    let first = vec_c.describe(&store, "v").await.expect("runs");
    let other = vec_i.describe(&store, "v").await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch(_))),
        "Vec<Invoice> got {other:?} after {first}"
    );
    let tuple_c = (Customer::default(),);
    let tuple_i = (Invoice::default(),);
    let first = tuple_c.describe(&store, "t").await.expect("runs");
    let other = tuple_i.describe(&store, "t").await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch(_))),
        "(Invoice,) got {other:?} after {first}"
    );
}

// ---- a recorded error over the size limit ----------------------------------

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Refusal {
    Long(String),
    Framework(String),
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Self {
        Refusal::Framework(e.to_string())
    }
}

#[idempotent(scope = "api_edges.recorded_error", key = key, tenant = tenant, store = store,
             skip(runs, error), errors = record)]
async fn recorded_error(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    error: Refusal,
) -> Result<u32, Refusal> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(error)
}

/// Rules 12 and 13 with `errors = record`: an error over what the store can
/// record is answered `ResultTooLarge` (naming the scope) in place of the
/// body's own, nothing is recorded and the key is free: the retry runs the
/// body again, and its error, small enough, is recorded and replayed.
#[tokio::test]
async fn a_recorded_error_over_the_size_limit_is_refused_and_frees_the_key() {
    for (name, store) in stores().await {
        let t = tenant();
        let runs = AtomicUsize::new(0);
        let huge = "x".repeat(idempotent_runtime::MAX_RESULT_BYTES + 10);
        match recorded_error(&*store, &t, "huge", &runs, Refusal::Long(huge)).await {
            Err(Refusal::Framework(m)) => assert!(
                m.contains("api_edges.recorded_error") && m.contains("limit"),
                "{name}: {m}"
            ),
            other => panic!("{name}: {:?}", other.map_err(|_| "the long error")),
        }
        let id = Identity::new(t.as_str(), "api_edges.recorded_error", "huge").unwrap();
        assert!(store.fetch(&id).await.unwrap().is_none(), "{name}");
        let short = Refusal::Long("short".into());
        let (again, o) =
            with_outcome(recorded_error(&*store, &t, "huge", &runs, short.clone())).await;
        assert_eq!(
            (again, o, runs.load(Ordering::SeqCst)),
            (Err(short.clone()), Some(Outcome::Executed), 2),
            "{name}"
        );
        let (replay, o) =
            with_outcome(recorded_error(&*store, &t, "huge", &runs, short.clone())).await;
        assert_eq!(
            (replay, o, runs.load(Ordering::SeqCst)),
            (Err(short), Some(Outcome::Replayed), 2),
            "{name}"
        );
    }
}
