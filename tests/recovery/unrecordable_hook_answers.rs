//! Rules 12 and 20 together: a `recover` hook's answer that cannot be
//! recorded (`Recovery::Completed` of a non-finite float or of a value over
//! `MAX_RESULT_BYTES`, or under `errors = record` an `Err` holding a
//! non-finite float) is refused with the error that names the scope, and is
//! never recorded as something else. The record is not released either
//! (the next call would be a fresh attempt 1 that runs the body blind): it
//! stays in progress with its lease ended, so the next call takes it over at
//! once, as the next attempt, and asks the hook again. The body never runs.
//! On every store, and in transactional mode on each SQL store.

use crate::common;
use crate::transactional::plant_stuck;

use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, MemoryStore, Outcome, RecordState, Recovery,
    SqliteStore, Store, Takeover, MAX_RESULT_BYTES,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

/// The attempts each hook was asked about, per tenant.
static ASKED: LazyLock<Mutex<HashMap<String, Vec<u32>>>> = LazyLock::new(Default::default);
/// How many times any body here ran.
static RUNS: AtomicUsize = AtomicUsize::new(0);

fn asked(tenant: &str) -> Vec<u32> {
    ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(tenant)
        .cloned()
        .unwrap_or_default()
}

fn note(takeover: &Takeover) {
    ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(takeover.tenant().to_owned())
        .or_default()
        .push(takeover.attempt());
}

fn tenant() -> String {
    format!("unrec-{}", uuid::Uuid::new_v4().simple())
}

/// Attempt 2: NaN; attempt 3: +inf; then the amount the gateway found.
async fn found_rate(takeover: &Takeover) -> Result<Recovery<f64>, Error> {
    note(takeover);
    Ok(Recovery::Completed(match takeover.attempt() {
        2 => f64::NAN,
        3 => f64::INFINITY,
        _ => 2.5,
    }))
}

/// Attempt 2: a receipt larger than any record holds; then a small one.
async fn found_receipt(takeover: &Takeover) -> Result<Recovery<String>, Error> {
    note(takeover);
    Ok(Recovery::Completed(match takeover.attempt() {
        2 => "x".repeat(MAX_RESULT_BYTES + 1),
        _ => "receipt".to_owned(),
    }))
}

/// A final answer a hook may give, recorded under `errors = record`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
enum Refused {
    /// Declined, at this fee rate.
    Declined(f64),
    Framework(String),
}

impl From<Error> for Refused {
    fn from(e: Error) -> Self {
        Refused::Framework(e.to_string())
    }
}

/// Attempt 2: a decline holding NaN (not recordable); then a finite one.
async fn found_decline(takeover: &Takeover) -> Result<Recovery<u32>, Refused> {
    note(takeover);
    Err(Refused::Declined(match takeover.attempt() {
        2 => f64::NAN,
        _ => 1.5,
    }))
}

#[idempotent(scope = "unrecordable.rate", key = key, tenant = tenant, store = store,
             recover = found_rate)]
async fn rate(store: &dyn Store, tenant: &str, key: &str) -> Result<f64, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(1.0)
}

#[idempotent(scope = "unrecordable.receipt", key = key, tenant = tenant, store = store,
             recover = found_receipt)]
async fn receipt(store: &dyn Store, tenant: &str, key: &str) -> Result<String, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok("ran".to_owned())
}

#[idempotent(scope = "unrecordable.decline", key = key, tenant = tenant, store = store,
             errors = record, recover = found_decline)]
async fn decline(store: &dyn Store, tenant: &str, key: &str) -> Result<u32, Refused> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

/// The record is kept for the next takeover: in progress, taken over as
/// `attempt`, its lease ended.
async fn kept_for_the_next_takeover(store: &dyn Store, identity: &Identity, attempt: u32) {
    let s = store
        .fetch(identity)
        .await
        .expect("fetch")
        .expect("the record is kept, not released");
    assert_eq!(
        (s.state, s.attempt),
        (RecordState::InProgress, attempt),
        "{}: kept in progress for the next takeover",
        store.name()
    );
    assert!(
        s.lease_expires_at_ms.expect("a lease") <= s.now_ms,
        "{}: attempt {attempt}: the lease was ended, so the next call takes over at once",
        store.name()
    );
}

fn names_scope(e: &Error, scope: &str) -> bool {
    match e {
        Error::ResultNotFaithful { scope: s, .. } | Error::ResultTooLarge { scope: s, .. } => {
            s == scope
        }
        _ => false,
    }
}

async fn every_unrecordable_hook_answer(store: &dyn Store) {
    let name = store.name();
    let runs_before = RUNS.load(Ordering::SeqCst);

    // Completed(NaN), then Completed(+inf): refused, kept; then recorded.
    let t = tenant();
    let id = Identity::new(t.as_str(), "unrecordable.rate", "k").unwrap();
    plant_stuck(store, &id).await;
    for attempt in [2, 3] {
        match rate(store, &t, "k").await {
            Err(e) if names_scope(&e, "unrecordable.rate") => {}
            other => panic!("{name}: attempt {attempt}: expected ResultNotFaithful, got {other:?}"),
        }
        kept_for_the_next_takeover(store, &id, attempt).await;
    }
    let (got, outcome) = with_outcome(rate(store, &t, "k")).await;
    assert_eq!(
        (got.ok(), outcome),
        (Some(2.5), Some(Outcome::Recovered)),
        "{name}"
    );
    let (got, outcome) = with_outcome(rate(store, &t, "k")).await;
    assert_eq!(
        (got.ok(), outcome),
        (Some(2.5), Some(Outcome::Replayed)),
        "{name}"
    );
    assert_eq!(asked(&t), [2, 3, 4], "{name}: asked again at each takeover");

    // Completed(a receipt over MAX_RESULT_BYTES): refused, kept; then recorded.
    let t = tenant();
    let id = Identity::new(t.as_str(), "unrecordable.receipt", "k").unwrap();
    plant_stuck(store, &id).await;
    let got = receipt(store, &t, "k").await;
    match &got {
        Err(e) if names_scope(e, "unrecordable.receipt") => {}
        other => panic!(
            "{name}: expected ResultTooLarge, got {:?}",
            other.as_ref().map(String::len)
        ),
    }
    kept_for_the_next_takeover(store, &id, 2).await;
    let (got, outcome) = with_outcome(receipt(store, &t, "k")).await;
    assert_eq!(
        (got.ok().as_deref(), outcome),
        (Some("receipt"), Some(Outcome::Recovered)),
        "{name}"
    );
    assert_eq!(asked(&t), [2, 3], "{name}");

    // errors = record, the hook's Err holding NaN: refused, kept; then recorded.
    let t = tenant();
    let id = Identity::new(t.as_str(), "unrecordable.decline", "k").unwrap();
    plant_stuck(store, &id).await;
    let got = decline(store, &t, "k").await;
    match &got {
        Err(Refused::Framework(message)) if message.contains("unrecordable.decline") => {}
        other => panic!("{name}: expected the refusal naming the scope, got {other:?}"),
    }
    kept_for_the_next_takeover(store, &id, 2).await;
    let (got, outcome) = with_outcome(decline(store, &t, "k")).await;
    assert_eq!(
        (got, outcome),
        (Err(Refused::Declined(1.5)), Some(Outcome::Recovered)),
        "{name}"
    );
    let (got, outcome) = with_outcome(decline(store, &t, "k")).await;
    assert_eq!(
        (got, outcome),
        (Err(Refused::Declined(1.5)), Some(Outcome::Replayed)),
        "{name}"
    );
    assert_eq!(asked(&t), [2, 3], "{name}");

    assert_eq!(
        RUNS.load(Ordering::SeqCst),
        runs_before,
        "{name}: no body ran"
    );
}

#[tokio::test]
async fn memory_an_unrecordable_hook_answer_keeps_the_record_for_the_next_takeover() {
    every_unrecordable_hook_answer(&MemoryStore::new()).await;
}

#[tokio::test]
async fn sqlite_an_unrecordable_hook_answer_keeps_the_record_for_the_next_takeover() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("unrecordable_hook"))
        .await
        .expect("sqlite");
    every_unrecordable_hook_answer(&store).await;
}

#[tokio::test]
async fn postgres_an_unrecordable_hook_answer_keeps_the_record_for_the_next_takeover() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    every_unrecordable_hook_answer(&store).await;
}

#[tokio::test]
async fn mysql_an_unrecordable_hook_answer_keeps_the_record_for_the_next_takeover() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    every_unrecordable_hook_answer(&store).await;
}

// ---- transactional mode ----------------------------------------------------

#[idempotent(scope = "unrecordable.tx_sqlite", key = key, tenant = tenant, tx = tx,
             recover = found_rate)]
async fn sqlite_rate(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
) -> Result<f64, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(1.0)
}

#[idempotent(scope = "unrecordable.tx_pg", key = key, tenant = tenant, tx = tx,
             recover = found_rate)]
async fn pg_rate(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
) -> Result<f64, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(1.0)
}

#[idempotent(scope = "unrecordable.tx_mysql", key = key, tenant = tenant, tx = tx,
             recover = found_rate)]
async fn mysql_rate(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
) -> Result<f64, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(1.0)
}

/// In the caller's transaction, committed after each answer: the
/// unrecordable answers keep the record (lease ended) for the next
/// transaction's takeover, which asks again; the finite one is recorded.
macro_rules! in_transactions {
    ($store:expr, $begin:expr, $rate:ident, $scope:literal) => {{
        let store = $store;
        let runs_before = RUNS.load(Ordering::SeqCst);
        let t = tenant();
        let id = Identity::new(t.as_str(), $scope, "k").unwrap();
        plant_stuck(&store, &id).await;
        for attempt in [2, 3] {
            let mut tx = $begin(&store).await;
            let got = $rate(&mut tx, &t, "k").await;
            assert!(
                matches!(&got, Err(e) if names_scope(e, $scope)),
                "attempt {attempt}: {got:?}"
            );
            tx.commit().await.unwrap();
            kept_for_the_next_takeover(&store, &id, attempt).await;
        }
        let mut tx = $begin(&store).await;
        let (got, outcome) = with_outcome($rate(&mut tx, &t, "k")).await;
        tx.commit().await.unwrap();
        assert_eq!((got.ok(), outcome), (Some(2.5), Some(Outcome::Recovered)));
        let s = store.fetch(&id).await.unwrap().expect("record");
        assert_eq!(
            (s.state, s.attempt, s.recovered),
            (RecordState::Complete, 4, true)
        );
        assert_eq!(asked(&t), [2, 3, 4]);
        assert_eq!(RUNS.load(Ordering::SeqCst), runs_before, "no body ran");
    }};
}

#[tokio::test]
async fn sqlite_transaction_an_unrecordable_hook_answer_keeps_the_record() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("unrecordable_hook_tx"))
        .await
        .expect("sqlite");
    in_transactions!(
        store,
        |s: &SqliteStore| {
            let pool = s.pool().clone();
            async move { pool.begin_with("BEGIN IMMEDIATE").await.unwrap() }
        },
        sqlite_rate,
        "unrecordable.tx_sqlite"
    );
}

#[tokio::test]
async fn postgres_transaction_an_unrecordable_hook_answer_keeps_the_record() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    in_transactions!(
        store,
        |s: &idempotent_runtime::PgStore| {
            let pool = s.pool().clone();
            async move { pool.begin().await.unwrap() }
        },
        pg_rate,
        "unrecordable.tx_pg"
    );
}

#[tokio::test]
async fn mysql_transaction_an_unrecordable_hook_answer_keeps_the_record() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    in_transactions!(
        store,
        |s: &idempotent_runtime::MySqlStore| {
            crate::transactional::mysql_begin_in_the_next_second(s.pool().clone())
        },
        mysql_rate,
        "unrecordable.tx_mysql"
    );
}

// ---- a crowd on one kept record ----------------------------------------------

/// Lets the hook's first answer (attempt 2) go once the crowd is calling.
static CROWD_GO: tokio::sync::Notify = tokio::sync::Notify::const_new();
static CROWD_ASKED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Attempt 2 waits for [`CROWD_GO`], then answers NaN; later attempts 5.0.
async fn crowd_hook(takeover: &Takeover) -> Result<Recovery<f64>, Error> {
    note(takeover);
    if takeover.attempt() == 2 {
        CROWD_ASKED.notify_one();
        CROWD_GO.notified().await;
        return Ok(Recovery::Completed(f64::NAN));
    }
    Ok(Recovery::Completed(5.0))
}

#[idempotent(scope = "unrecordable.crowd", key = key, tenant = tenant, store = store,
             in_progress = wait("60s"), recover = crowd_hook)]
async fn crowd(store: &dyn Store, tenant: &str, key: &str) -> Result<f64, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(1.0)
}

/// How many callers call the stuck record's key at once.
const CROWD: usize = 20;

/// Rules 3, 12 and 20 under concurrency: many callers of one stuck record
/// whose first takeover's hook answers a value that cannot be recorded. That
/// caller alone gets the refusal; the record is kept, so exactly one other
/// caller takes it over next (attempt 3) and asks again, and every other
/// caller replays that answer. The hook is asked twice, the body never.
async fn a_crowd_behind_an_unrecordable_hook_answer(store: std::sync::Arc<dyn Store>) {
    let name = store.name();
    let runs_before = RUNS.load(Ordering::SeqCst);
    let t = tenant();
    let id = Identity::new(t.as_str(), "unrecordable.crowd", "k").unwrap();
    plant_stuck(store.as_ref(), &id).await;
    let first = {
        let (store, t) = (store.clone(), t.clone());
        tokio::spawn(async move { crowd(store.as_ref(), &t, "k").await })
    };
    tokio::time::timeout(Duration::from_secs(30), CROWD_ASKED.notified())
        .await
        .expect("the first caller's takeover asks the hook");
    let others: Vec<_> = (0..CROWD)
        .map(|_| {
            let (store, t) = (store.clone(), t.clone());
            tokio::spawn(async move { crowd(store.as_ref(), &t, "k").await })
        })
        .collect();
    tokio::task::yield_now().await;
    CROWD_GO.notify_one();
    let bound = Duration::from_secs(90);
    let first = tokio::time::timeout(bound, first)
        .await
        .expect("the first caller ends")
        .expect("no panic");
    assert!(
        matches!(&first, Err(e) if names_scope(e, "unrecordable.crowd")),
        "{name}: the first takeover's caller is refused: {first:?}"
    );
    for other in others {
        let got = tokio::time::timeout(bound, other)
            .await
            .expect("a caller ends")
            .expect("no panic");
        assert_eq!(
            got.ok(),
            Some(5.0),
            "{name}: every other caller gets attempt 3's answer"
        );
    }
    assert_eq!(
        asked(&t),
        [2, 3],
        "{name}: the hook is asked once per takeover"
    );
    assert_eq!(
        RUNS.load(Ordering::SeqCst),
        runs_before,
        "{name}: no body ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_behind_an_unrecordable_hook_answer_on_every_store() {
    let mut stores: Vec<std::sync::Arc<dyn Store>> = vec![
        std::sync::Arc::new(MemoryStore::new()),
        std::sync::Arc::new(
            SqliteStore::connect(&common::scratch::sqlite_url("unrecordable_crowd"))
                .await
                .expect("sqlite"),
        ),
    ];
    if let Some(pg) = common::servers::pg_store_or_skip().await {
        stores.push(std::sync::Arc::new(pg));
    }
    if let Some(my) = common::servers::mysql_store_or_skip().await {
        stores.push(std::sync::Arc::new(my));
    }
    for store in stores {
        a_crowd_behind_an_unrecordable_hook_answer(store).await;
    }
}
