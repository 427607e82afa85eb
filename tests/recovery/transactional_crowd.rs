//! Rules 3, 15 and 20 together: many callers, each in a transaction of its
//! own (transactional mode), call the key of one stuck record of a scope
//! with a `recover` hook, at once. One transaction takes the record over and
//! asks the hook, whose answer is recorded in that transaction; every other
//! caller waits for it, or is refused (`InProgress`, `StaleSnapshot`) and
//! retries in a new transaction, and replays that answer. The hook is asked
//! once, the body never runs. On SQLite, PostgreSQL and MariaDB.

use crate::common;
use crate::transactional::plant_stuck;

use idempotent_runtime::{
    idempotent, Error, Identity, RecordState, Recovery, SqliteStore, Store, Takeover,
};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// The attempts the hook was asked about, per tenant.
static ASKED: LazyLock<Mutex<HashMap<String, Vec<u32>>>> = LazyLock::new(Default::default);
static RUNS: AtomicUsize = AtomicUsize::new(0);
/// The hook's first caller is in the hook (its takeover written, uncommitted).
static IN_HOOK: Notify = Notify::const_new();
/// Lets the hook answer once the crowd is calling.
static HOOK_GO: Notify = Notify::const_new();

/// Tries begun (each before its transaction begins), and a wake-up for each.
static TRIES: AtomicUsize = AtomicUsize::new(0);
static TRIED: Notify = Notify::const_new();

/// How many transactions call the stuck key besides the first.
const CROWD: usize = 12;

fn asked(tenant: &str) -> Vec<u32> {
    ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(tenant)
        .cloned()
        .unwrap_or_default()
}

async fn found(takeover: &Takeover) -> Result<Recovery<String>, Error> {
    let first = {
        let mut asked = ASKED.lock().unwrap_or_else(|p| p.into_inner());
        let mine = asked.entry(takeover.tenant().to_owned()).or_default();
        mine.push(takeover.attempt());
        mine.len() == 1
    };
    if first {
        IN_HOOK.notify_one();
        HOOK_GO.notified().await;
    }
    Ok(Recovery::Completed(format!(
        "recovered as attempt {}",
        takeover.attempt()
    )))
}

#[idempotent(scope = "txcrowd.sqlite", key = key, tenant = tenant, tx = tx,
             in_progress = wait("30s"), recover = found)]
async fn sqlite_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
) -> Result<String, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok("ran".to_owned())
}

#[idempotent(scope = "txcrowd.pg", key = key, tenant = tenant, tx = tx,
             in_progress = wait("30s"), recover = found)]
async fn pg_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
) -> Result<String, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok("ran".to_owned())
}

#[idempotent(scope = "txcrowd.mysql", key = key, tenant = tenant, tx = tx,
             in_progress = wait("30s"), recover = found)]
async fn mysql_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
) -> Result<String, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok("ran".to_owned())
}

/// One caller: a transaction per try, committed when the call answers,
/// rolled back and tried again in a new one when it is refused as in
/// progress or as a stale snapshot (what the README tells a caller to do).
async fn caller<F, Fut>(once: F) -> String
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<String, Error>>,
{
    for _ in 0..500 {
        match once().await {
            Ok(answer) => return answer,
            Err(Error::InProgress { .. } | Error::StaleSnapshot { .. }) => {
                // A new transaction, a moment later (MySQL tells a
                // transaction's start in whole seconds).
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("a caller's transaction was answered {e:?}"),
        }
    }
    panic!("a caller was refused 500 times");
}

/// One try in a transaction of its own: committed on an answer, rolled back
/// otherwise.
macro_rules! one_try {
    ($pool:expr, $begin:expr, $charge:ident, $tenant:expr) => {{
        let (pool, tenant) = ($pool.clone(), $tenant.clone());
        move || {
            let (pool, tenant) = (pool.clone(), tenant.clone());
            async move {
                TRIES.fetch_add(1, Ordering::SeqCst);
                TRIED.notify_one();
                let mut tx = $begin(pool).await;
                let got = $charge(&mut tx, &tenant, "k").await;
                if got.is_ok() {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
                got
            }
        }
    }};
}

macro_rules! a_crowd_of_transactions {
    ($store:expr, $pool:expr, $begin:expr, $charge:ident, $scope:literal) => {{
        let store = $store;
        let tenant = format!("txcrowd-{}", uuid::Uuid::new_v4().simple());
        let identity = Identity::new(tenant.as_str(), $scope, "k").unwrap();
        plant_stuck(&store, &identity).await;
        let bound = Duration::from_secs(120);
        let base = TRIES.load(Ordering::SeqCst);
        let first = tokio::spawn(caller(one_try!($pool, $begin, $charge, tenant)));
        tokio::time::timeout(bound, IN_HOOK.notified())
            .await
            .expect("the first takeover asks the hook");
        let others: Vec<_> = (0..CROWD)
            .map(|_| tokio::spawn(caller(one_try!($pool, $begin, $charge, tenant))))
            .collect();
        // The hook answers once every caller of the crowd is beginning its
        // transaction (the first one's takeover is still uncommitted).
        tokio::time::timeout(bound, async {
            while TRIES.load(Ordering::SeqCst) < base + 1 + CROWD {
                TRIED.notified().await;
            }
        })
        .await
        .expect("the crowd calls");
        HOOK_GO.notify_one();
        let want = "recovered as attempt 2".to_owned();
        let first = tokio::time::timeout(bound, first)
            .await
            .expect("the first caller ends")
            .expect("no panic");
        assert_eq!(first, want);
        for other in others {
            let got = tokio::time::timeout(bound, other)
                .await
                .expect("a caller ends")
                .expect("no panic");
            assert_eq!(got, want, "every caller gets the hook's one answer");
        }
        assert_eq!(asked(&tenant), [2], "the hook is asked once");
        assert_eq!(RUNS.load(Ordering::SeqCst), 0, "no body ran");
        let s = store.fetch(&identity).await.unwrap().expect("record");
        assert_eq!(
            (s.state, s.attempt, s.recovered),
            (RecordState::Complete, 2, true)
        );
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_crowd_of_transactions_on_one_stuck_record_asks_the_hook_once() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("txcrowd"))
        .await
        .expect("sqlite");
    let pool = store.pool().clone();
    a_crowd_of_transactions!(
        store,
        pool,
        |pool: sqlx::SqlitePool| async move { pool.begin_with("BEGIN IMMEDIATE").await.unwrap() },
        sqlite_charge,
        "txcrowd.sqlite"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_crowd_of_transactions_on_one_stuck_record_asks_the_hook_once() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    a_crowd_of_transactions!(
        store,
        pool,
        |pool: sqlx::PgPool| async move { pool.begin().await.unwrap() },
        pg_charge,
        "txcrowd.pg"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_crowd_of_transactions_on_one_stuck_record_asks_the_hook_once() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let pool = store.pool().clone();
    a_crowd_of_transactions!(
        store,
        pool,
        |pool: sqlx::MySqlPool| async move { pool.begin().await.unwrap() },
        mysql_charge,
        "txcrowd.mysql"
    );
}
