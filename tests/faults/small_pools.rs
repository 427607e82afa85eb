//! Small pools shared with the application (`from_pool` with
//! `max_connections` 1 or 2), many concurrent calls on one key: nothing
//! blocks for ever, a legitimate call is not refused, no body runs twice.
//! Tasks are parked by handshakes (the owner's body waits for a `Notify`,
//! released once every duplicate has entered its wait), and every wait is
//! bounded by a timeout that fails the test with a message rather than
//! hanging the suite.

use crate::common::counting::Counting;
use crate::common::servers::{mysql_store_or_skip, mysql_url, pg_store_or_skip, pg_url};
use idempotent_runtime::{idempotent, Error, MySqlStore, PgStore, SqliteStore, Store};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// How many duplicates call the owner's key at once.
const DUPLICATES: usize = 30;

/// How many store-mode duplicates call a transactional-mode owner's key at
/// once ([`tx_owner_scenario!`]). Each one's first try can hold the pool's
/// free connection for a whole lock wait (InnoDB's second) or busy timeout
/// (SQLite's 10 s, before the time it queued was counted), one after
/// another: ten are enough to outlast the pool's 30 s acquire timeout that
/// way, and keep the scenario's run short.
const TX_OWNER_DUPLICATES: usize = 10;

/// The bound on a whole scenario: a hang fails the test with a message.
const SCENARIO_BOUND: Duration = Duration::from_secs(90);

/// The acquire timeout of the application's pools (sqlx's default).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);

/// The application's pool, shared with the store.
#[derive(Clone)]
enum AppPool {
    Sqlite(sqlx::SqlitePool),
    Pg(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
}

impl AppPool {
    /// One statement of the application's own on the shared pool.
    async fn touch(&self) {
        match self {
            AppPool::Sqlite(p) => {
                sqlx::query("SELECT 1")
                    .execute(p)
                    .await
                    .expect("the app's query");
            }
            AppPool::Pg(p) => {
                sqlx::query("SELECT 1")
                    .execute(p)
                    .await
                    .expect("the app's query");
            }
            AppPool::MySql(p) => {
                sqlx::query("SELECT 1")
                    .execute(p)
                    .await
                    .expect("the app's query");
            }
        }
    }
}

/// What the owner's body does, and how many times it ran.
#[derive(Default)]
struct Body {
    runs: AtomicUsize,
    started: watch::Sender<bool>,
    go: Notify,
}

#[idempotent(scope = "faults.small_pools", key = key, tenant = tenant, store = store,
             in_progress = wait("60s"), lease = "3s", skip(body, app))]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    body: &Body,
    app: &AppPool,
) -> Result<u64, Error> {
    body.runs.fetch_add(1, Ordering::SeqCst);
    body.started.send_replace(true);
    body.go.notified().await;
    // The body uses the pool it shares with the store.
    app.touch().await;
    Ok(7)
}

fn tenant() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// One owner and [`DUPLICATES`] duplicates of its key on `store`, whose
/// pool the owner's body also uses: the body runs once, every duplicate
/// replays its answer, nothing hangs.
async fn many_duplicates_on_one_key<S: Store>(store: &Counting<S>, app: &AppPool, what: &str) {
    let tenant = tenant();
    let body = Body::default();
    let owner = charge(store, &tenant, "k", &body, app);
    let waits_before = *store.waits.borrow();
    let duplicates = async {
        let _ = body.started.subscribe().wait_for(|s| *s).await;
        futures_util::future::join_all(
            (0..DUPLICATES).map(|_| charge(store, &tenant, "k", &body, app)),
        )
        .await
    };
    let release = async {
        let _ = body.started.subscribe().wait_for(|s| *s).await;
        store.waited(waits_before + DUPLICATES).await;
        // The purge and the audit, while the duplicates wait on the pool.
        let purged = store.purge_expired(100).await;
        let counted = store.scope_stats().await;
        body.go.notify_one();
        (purged, counted)
    };
    let (owned, answers, (purged, counted)) = tokio::time::timeout(SCENARIO_BOUND, async {
        tokio::join!(owner, duplicates, release)
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: the owner and its duplicates did not finish within {SCENARIO_BOUND:?} (a hang)"));
    purged.unwrap_or_else(|e| panic!("{what}: the purge beside waiting duplicates: {e}"));
    counted.unwrap_or_else(|e| panic!("{what}: the audit beside waiting duplicates: {e}"));
    assert_eq!(owned.expect("the owner completes"), 7, "{what}");
    for (i, answer) in answers.into_iter().enumerate() {
        match answer {
            Ok(v) => assert_eq!(v, 7, "{what}: duplicate #{i}"),
            Err(e) => panic!("{what}: duplicate #{i} was refused: {e}"),
        }
    }
    assert_eq!(
        body.runs.load(Ordering::SeqCst),
        1,
        "{what}: the body ran once"
    );
}

async fn sqlite_store(
    connections: u32,
    acquire_timeout: Duration,
) -> (Counting<SqliteStore>, AppPool) {
    let options: sqlx::sqlite::SqliteConnectOptions =
        crate::common::scratch::sqlite_url("small_pools")
            .parse::<sqlx::sqlite::SqliteConnectOptions>()
            .expect("url")
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(acquire_timeout)
        .connect_with(options)
        .await
        .expect("pool");
    let store = SqliteStore::from_pool(pool.clone()).await.expect("store");
    (Counting::new(store), AppPool::Sqlite(pool))
}

async fn pg_store(
    connections: u32,
    acquire_timeout: Duration,
) -> Option<(Counting<PgStore>, AppPool)> {
    pg_store_or_skip().await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(acquire_timeout)
        .connect(&pg_url())
        .await
        .expect("pool");
    let store = PgStore::from_pool(pool.clone()).await.expect("store");
    Some((Counting::new(store), AppPool::Pg(pool)))
}

async fn mysql_store(
    connections: u32,
    acquire_timeout: Duration,
) -> Option<(Counting<MySqlStore>, AppPool)> {
    mysql_store_or_skip().await?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(acquire_timeout)
        .connect(&mysql_url())
        .await
        .expect("pool");
    let store = MySqlStore::from_pool(pool.clone()).await.expect("store");
    Some((Counting::new(store), AppPool::MySql(pool)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_many_duplicates_on_pools_of_one_to_three() {
    for n in 1..=3 {
        let (store, app) = sqlite_store(n, ACQUIRE_TIMEOUT).await;
        many_duplicates_on_one_key(&store, &app, &format!("sqlite, pool of {n}")).await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn sqlite_many_duplicates_on_pools_of_one_to_three_current_thread() {
    for n in 1..=3 {
        let (store, app) = sqlite_store(n, ACQUIRE_TIMEOUT).await;
        many_duplicates_on_one_key(
            &store,
            &app,
            &format!("sqlite (current thread), pool of {n}"),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_many_duplicates_on_pools_of_one_to_three() {
    for n in 1..=3 {
        let Some((store, app)) = pg_store(n, ACQUIRE_TIMEOUT).await else {
            return;
        };
        many_duplicates_on_one_key(&store, &app, &format!("postgres, pool of {n}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_many_duplicates_on_pools_of_one_to_three() {
    for n in 1..=3 {
        let Some((store, app)) = mysql_store(n, ACQUIRE_TIMEOUT).await else {
            return;
        };
        many_duplicates_on_one_key(&store, &app, &format!("mysql, pool of {n}")).await;
    }
}

impl AppPool {
    /// Holds one of the shared pool's connections until `until` is notified.
    async fn hold_until(&self, until: &Notify) {
        macro_rules! hold {
            ($p:expr) => {{
                let mut conn = $p.acquire().await.expect("the app's connection");
                sqlx::query("SELECT 1")
                    .execute(&mut *conn)
                    .await
                    .expect("the app's query");
                until.notified().await;
                drop(conn);
            }};
        }
        match self {
            AppPool::Sqlite(p) => hold!(p),
            AppPool::Pg(p) => hold!(p),
            AppPool::MySql(p) => hold!(p),
        }
    }
}

#[idempotent(scope = "faults.small_pools_holding", key = key, tenant = tenant, store = store,
             in_progress = wait("60s"), lease = "1s", skip(body, app))]
async fn holding(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    body: &Body,
    app: &AppPool,
) -> Result<u64, Error> {
    body.runs.fetch_add(1, Ordering::SeqCst);
    let hold = app.hold_until(&body.go);
    let mut hold = std::pin::pin!(hold);
    // Started once the connection is held.
    tokio::select! {
        biased;
        () = &mut hold => unreachable!("held until go"),
        () = tokio::task::yield_now() => {}
    }
    body.started.send_replace(true);
    hold.await;
    Ok(7)
}

/// The owner's body holds one of the shared pool's connections for its whole
/// run, longer than two leases, while [`DUPLICATES`] duplicates wait on the
/// rest: its renewals still land (the body runs once), every duplicate
/// replays.
async fn body_holds_a_connection_for_its_run<S: Store>(
    store: &Counting<S>,
    app: &AppPool,
    what: &str,
) {
    let tenant = tenant();
    let body = Body::default();
    let owner = holding(store, &tenant, "k", &body, app);
    let waits_before = *store.waits.borrow();
    let duplicates = async {
        let _ = body.started.subscribe().wait_for(|s| *s).await;
        futures_util::future::join_all(
            (0..DUPLICATES).map(|_| holding(store, &tenant, "k", &body, app)),
        )
        .await
    };
    let release = async {
        let _ = body.started.subscribe().wait_for(|s| *s).await;
        store.waited(waits_before + DUPLICATES).await;
        // Two and a half leases with the connection held: renewals are due.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        body.go.notify_waiters();
    };
    let (owned, answers, ()) = tokio::time::timeout(SCENARIO_BOUND, async {
        tokio::join!(owner, duplicates, release)
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: the owner and its duplicates did not finish within {SCENARIO_BOUND:?} (a hang)"));
    let runs = body.runs.load(Ordering::SeqCst);
    let refused: Vec<String> = answers
        .iter()
        .filter_map(|a| a.as_ref().err().map(ToString::to_string))
        .collect();
    assert_eq!(
        runs, 1,
        "{what}: the body ran {runs} times (owner: {owned:?}; refused: {refused:?})"
    );
    assert_eq!(owned.expect("the owner completes"), 7, "{what}");
    assert!(
        refused.is_empty(),
        "{what}: duplicates refused: {refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_body_holding_a_connection_of_a_pool_of_two() {
    let (store, app) = sqlite_store(2, ACQUIRE_TIMEOUT).await;
    body_holds_a_connection_for_its_run(&store, &app, "sqlite, pool of 2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_body_holding_a_connection_of_a_pool_of_two() {
    let Some((store, app)) = pg_store(2, ACQUIRE_TIMEOUT).await else {
        return;
    };
    body_holds_a_connection_for_its_run(&store, &app, "postgres, pool of 2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_body_holding_a_connection_of_a_pool_of_two() {
    let Some((store, app)) = mysql_store(2, ACQUIRE_TIMEOUT).await else {
        return;
    };
    body_holds_a_connection_for_its_run(&store, &app, "mysql, pool of 2").await;
}

/// Duplicates dropped while they wait (a timeout around each call), on a
/// pool of one: the pool keeps its connection, the owner completes, and a
/// later call replays.
async fn dropped_duplicates<S: Store>(store: &Counting<S>, app: &AppPool, what: &str) {
    let tenant = tenant();
    let body = Body::default();
    let owner = charge(store, &tenant, "k", &body, app);
    let waits_before = *store.waits.borrow();
    let all_waiting = Notify::new();
    let duplicates = async {
        let _ = body.started.subscribe().wait_for(|s| *s).await;
        let calls = futures_util::future::join_all(
            (0..DUPLICATES).map(|_| charge(store, &tenant, "k", &body, app)),
        );
        tokio::select! {
            _ = calls => panic!("{what}: the duplicates answered while the owner ran"),
            () = all_waiting.notified() => {}
        }
    };
    let release = async {
        let _ = body.started.subscribe().wait_for(|s| *s).await;
        store.waited(waits_before + DUPLICATES).await;
        all_waiting.notify_one();
        body.go.notify_one();
    };
    let (owned, (), ()) = tokio::time::timeout(SCENARIO_BOUND, async {
        tokio::join!(owner, duplicates, release)
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: did not finish within {SCENARIO_BOUND:?} (a hang)"));
    assert_eq!(owned.expect("the owner completes"), 7, "{what}");
    let later = tokio::time::timeout(SCENARIO_BOUND, charge(store, &tenant, "k", &body, app))
        .await
        .unwrap_or_else(|_| panic!("{what}: a later call hung"));
    assert_eq!(later.expect("a later call replays"), 7, "{what}");
    assert_eq!(
        body.runs.load(Ordering::SeqCst),
        1,
        "{what}: the body ran once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_duplicates_dropped_while_waiting_on_a_pool_of_one() {
    let (store, app) = sqlite_store(1, ACQUIRE_TIMEOUT).await;
    dropped_duplicates(&store, &app, "sqlite, pool of 1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_duplicates_dropped_while_waiting_on_a_pool_of_one() {
    let Some((store, app)) = pg_store(1, ACQUIRE_TIMEOUT).await else {
        return;
    };
    dropped_duplicates(&store, &app, "postgres, pool of 1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_duplicates_dropped_while_waiting_on_a_pool_of_one() {
    let Some((store, app)) = mysql_store(1, ACQUIRE_TIMEOUT).await else {
        return;
    };
    dropped_duplicates(&store, &app, "mysql, pool of 1").await;
}

/// The owner's body holds the pool's only connection: a duplicate cannot
/// even read the record. Whatever it gets must come within the pool's
/// acquire timeout and say what to do.
async fn only_connection_held_by_the_body<S: Store>(store: &S, app: &AppPool, what: &str) {
    let tenant = tenant();
    let body = Body::default();
    let owner = holding(store, &tenant, "k", &body, app);
    let duplicate = async {
        let _ = body.started.subscribe().wait_for(|s| *s).await;
        let answer = holding(store, &tenant, "k", &body, app).await;
        body.go.notify_waiters();
        answer
    };
    let (owned, answer) =
        tokio::time::timeout(SCENARIO_BOUND, async { tokio::join!(owner, duplicate) })
            .await
            .unwrap_or_else(|_| {
                panic!("{what}: did not finish within {SCENARIO_BOUND:?} (a hang)")
            });
    assert_eq!(
        body.runs.load(Ordering::SeqCst),
        1,
        "{what}: the body ran once"
    );
    assert_eq!(owned.expect("the owner completes"), 7, "{what}");
    // The duplicate could not have a connection within the pool's acquire
    // timeout (a limit the README documents): its error says what to do.
    match answer {
        Ok(v) => assert_eq!(v, 7, "{what}"),
        Err(e) => {
            let message = e.to_string();
            assert!(
                message.contains("max_connections") && message.contains("pool of its own"),
                "{what}: the error of a call that got no connection says what to do: {message}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_body_holding_the_only_connection() {
    let (store, app) = sqlite_store(1, Duration::from_secs(2)).await;
    only_connection_held_by_the_body(&store, &app, "sqlite, pool of 1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_body_holding_the_only_connection() {
    let Some((store, app)) = pg_store(1, Duration::from_secs(2)).await else {
        return;
    };
    only_connection_held_by_the_body(&store, &app, "postgres, pool of 1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_body_holding_the_only_connection() {
    let Some((store, app)) = mysql_store(1, Duration::from_secs(2)).await else {
        return;
    };
    only_connection_held_by_the_body(&store, &app, "mysql, pool of 1").await;
}

/// A transactional-mode owner on each database, on one shared scope with
/// store-mode [`duplicate_of_tx`].
macro_rules! tx_owner {
    ($name:ident, $conn:ty) => {
        #[idempotent(scope = "faults.small_pools_tx", key = key, tenant = tenant, tx = conn, shared_scope, skip(body, app))]
        async fn $name(
            conn: &mut $conn,
            tenant: &str,
            key: &str,
            body: &Body,
            app: &AppPool,
        ) -> Result<u64, Error> {
            let _ = &conn;
            body.runs.fetch_add(1, Ordering::SeqCst);
            body.started.send_replace(true);
            body.go.notified().await;
            // The body uses the shared pool besides its transaction.
            app.touch().await;
            Ok(7)
        }
    };
}
tx_owner!(sqlite_tx_owner, sqlx::SqliteConnection);
tx_owner!(pg_tx_owner, sqlx::PgConnection);
tx_owner!(mysql_tx_owner, sqlx::MySqlConnection);

#[idempotent(scope = "faults.small_pools_tx", key = key, tenant = tenant, store = store,
             shared_scope, in_progress = wait("60s"), skip(body))]
async fn duplicate_of_tx(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    body: &Body,
) -> Result<u64, Error> {
    body.runs.fetch_add(1, Ordering::SeqCst);
    Ok(8)
}

/// A transactional-mode owner whose transaction holds one connection of the
/// store's pool of two (its body also uses the pool), and [`TX_OWNER_DUPLICATES`]
/// store-mode duplicates: the owner commits, every duplicate replays.
macro_rules! tx_owner_scenario {
    ($store:expr, $app:expr, $pool:expr, $owner:ident, $what:expr) => {{
        let (store, app, what) = ($store, $app, $what);
        let tenant = tenant();
        let body = Body::default();
        let waits_before = *store.waits.borrow();
        let finished = watch::Sender::new(0usize);
        let started = std::time::Instant::now();
        let owner = async {
            let mut tx = $pool.begin().await.expect("begin");
            let answer = $owner(&mut *tx, &tenant, "k", &body, app).await;
            tx.commit().await.expect("commit");
            answer
        };
        let duplicates = async {
            let _ = body.started.subscribe().wait_for(|s| *s).await;
            futures_util::future::join_all((0..TX_OWNER_DUPLICATES).map(|_| async {
                let answer = duplicate_of_tx(store, &tenant, "k", &body).await;
                finished.send_modify(|f| *f += 1);
                answer
            }))
            .await
        };
        let release = async {
            let _ = body.started.subscribe().wait_for(|s| *s).await;
            // Every duplicate has entered its wait, or answered.
            let mut finished = finished.subscribe();
            let mut waits = store.waits.subscribe();
            loop {
                let entered = (*waits.borrow_and_update()).saturating_sub(waits_before);
                if entered + *finished.borrow_and_update() >= TX_OWNER_DUPLICATES {
                    break;
                }
                tokio::select! {
                    _ = waits.changed() => {}
                    _ = finished.changed() => {}
                }
            }
            eprintln!("{what}: go after {:?}", started.elapsed());
            body.go.notify_one();
        };
        let (owned, answers, ()) = tokio::time::timeout(SCENARIO_BOUND, async {
            tokio::join!(owner, duplicates, release)
        })
        .await
        .unwrap_or_else(|_| panic!("{what}: did not finish within {SCENARIO_BOUND:?} (a hang)"));
        let refused: Vec<String> = answers
            .iter()
            .filter_map(|a| a.as_ref().err().map(ToString::to_string))
            .collect();
        eprintln!(
            "{what}: done after {:?}; {} refused",
            started.elapsed(),
            refused.len()
        );
        let runs = body.runs.load(Ordering::SeqCst);
        assert_eq!(
            runs, 1,
            "{what}: the bodies ran {runs} times; refused: {refused:?}"
        );
        assert_eq!(owned.expect("the owner completes"), 7, "{what}");
        assert!(
            refused.is_empty(),
            "{what}: {} duplicates refused: {refused:?}",
            refused.len()
        );
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_transactional_owner_on_a_pool_of_two() {
    let (store, app) = sqlite_store(2, ACQUIRE_TIMEOUT).await;
    let AppPool::Sqlite(pool) = &app else {
        unreachable!()
    };
    tx_owner_scenario!(&store, &app, pool, sqlite_tx_owner, "sqlite, pool of 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_transactional_owner_on_a_pool_of_two() {
    let Some((store, app)) = pg_store(2, ACQUIRE_TIMEOUT).await else {
        return;
    };
    let AppPool::Pg(pool) = &app else {
        unreachable!()
    };
    tx_owner_scenario!(&store, &app, pool, pg_tx_owner, "postgres, pool of 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_transactional_owner_on_a_pool_of_two() {
    // Each duplicate holds the pool's other connection for InnoDB's whole
    // second of lock wait, one after another (about 10 s for 10): past the
    // pool's acquire timeout a duplicate fails with `Error::Store`, as the
    // README says; the pool waits longer here.
    let Some((store, app)) = mysql_store(2, Duration::from_secs(90)).await else {
        return;
    };
    let AppPool::MySql(pool) = &app else {
        unreachable!()
    };
    tx_owner_scenario!(&store, &app, pool, mysql_tx_owner, "mysql, pool of 2");
}

/// A database in memory: its store's pool is one connection by design,
/// which the store's worker and the application share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_in_memory_many_duplicates_on_its_one_connection() {
    let store = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("store");
    let app = AppPool::Sqlite(store.pool().clone());
    let store = Counting::new(store);
    many_duplicates_on_one_key(&store, &app, "sqlite in memory").await;
    dropped_duplicates(&store, &app, "sqlite in memory, dropped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_transactional_owner_on_a_pool_of_three() {
    let (store, app) = sqlite_store(3, ACQUIRE_TIMEOUT).await;
    let AppPool::Sqlite(pool) = &app else {
        unreachable!()
    };
    tx_owner_scenario!(&store, &app, pool, sqlite_tx_owner, "sqlite, pool of 3");
}

/// The owner is dropped mid-body (a timeout around its call) while
/// [`DUPLICATES`] duplicates wait on a small pool: its release goes to the
/// store's worker, one duplicate takes the key over and runs the body, the
/// others replay its answer.
async fn owner_dropped_mid_body<S: Store>(store: &Counting<S>, app: &AppPool, what: &str) {
    let tenant = tenant();
    let (owner_body, dup_body) = (Body::default(), Body::default());
    dup_body.go.notify_one();
    let waits_before = *store.waits.borrow();
    let dropped = Notify::new();
    let owner = async {
        tokio::select! {
            _ = charge(store, &tenant, "k", &owner_body, app) => panic!("{what}: the owner was to be dropped"),
            () = dropped.notified() => {}
        }
    };
    let duplicates = async {
        let _ = owner_body.started.subscribe().wait_for(|s| *s).await;
        futures_util::future::join_all(
            (0..DUPLICATES).map(|_| charge(store, &tenant, "k", &dup_body, app)),
        )
        .await
    };
    let drop_owner = async {
        let _ = owner_body.started.subscribe().wait_for(|s| *s).await;
        store.waited(waits_before + DUPLICATES).await;
        dropped.notify_one();
    };
    let ((), answers, ()) = tokio::time::timeout(SCENARIO_BOUND, async {
        tokio::join!(owner, duplicates, drop_owner)
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: did not finish within {SCENARIO_BOUND:?} (a hang)"));
    let refused: Vec<String> = answers
        .iter()
        .filter_map(|a| a.as_ref().err().map(ToString::to_string))
        .collect();
    assert!(
        refused.is_empty(),
        "{what}: duplicates refused: {refused:?}"
    );
    assert_eq!(
        dup_body.runs.load(Ordering::SeqCst),
        1,
        "{what}: one duplicate took over and ran the body"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_owner_dropped_mid_body_on_small_pools() {
    for n in 1..=2 {
        let (store, app) = sqlite_store(n, ACQUIRE_TIMEOUT).await;
        owner_dropped_mid_body(&store, &app, &format!("sqlite, pool of {n}")).await;
    }
    let store = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("store");
    let app = AppPool::Sqlite(store.pool().clone());
    owner_dropped_mid_body(&Counting::new(store), &app, "sqlite in memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_owner_dropped_mid_body_on_small_pools() {
    for n in 1..=2 {
        let Some((store, app)) = pg_store(n, ACQUIRE_TIMEOUT).await else {
            return;
        };
        owner_dropped_mid_body(&store, &app, &format!("postgres, pool of {n}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_an_owner_dropped_mid_body_on_small_pools() {
    for n in 1..=2 {
        let Some((store, app)) = mysql_store(n, ACQUIRE_TIMEOUT).await else {
            return;
        };
        owner_dropped_mid_body(&store, &app, &format!("mysql, pool of {n}")).await;
    }
}

/// The shapes above on a current-thread runtime, where SQLite's writes run
/// in the caller's own future rather than in a task of their own.
#[tokio::test(flavor = "current_thread")]
async fn sqlite_current_thread_small_pools() {
    let (store, app) = sqlite_store(2, ACQUIRE_TIMEOUT).await;
    body_holds_a_connection_for_its_run(&store, &app, "sqlite (current thread), pool of 2").await;
    let (store, app) = sqlite_store(2, ACQUIRE_TIMEOUT).await;
    let AppPool::Sqlite(pool) = &app else {
        unreachable!()
    };
    tx_owner_scenario!(
        &store,
        &app,
        pool,
        sqlite_tx_owner,
        "sqlite (current thread), pool of 2"
    );
    let (store, app) = sqlite_store(1, ACQUIRE_TIMEOUT).await;
    owner_dropped_mid_body(&store, &app, "sqlite (current thread), pool of 1").await;
}

#[tokio::test(flavor = "current_thread")]
async fn postgres_current_thread_small_pools() {
    let Some((store, app)) = pg_store(2, ACQUIRE_TIMEOUT).await else {
        return;
    };
    body_holds_a_connection_for_its_run(&store, &app, "postgres (current thread), pool of 2").await;
    let AppPool::Pg(pool) = &app else {
        unreachable!()
    };
    tx_owner_scenario!(
        &store,
        &app,
        pool,
        pg_tx_owner,
        "postgres (current thread), pool of 2"
    );
    let Some((store, app)) = pg_store(1, ACQUIRE_TIMEOUT).await else {
        return;
    };
    owner_dropped_mid_body(&store, &app, "postgres (current thread), pool of 1").await;
}

#[tokio::test(flavor = "current_thread")]
async fn mysql_current_thread_small_pools() {
    let Some((store, app)) = mysql_store(2, ACQUIRE_TIMEOUT).await else {
        return;
    };
    body_holds_a_connection_for_its_run(&store, &app, "mysql (current thread), pool of 2").await;
    let Some((store, app)) = mysql_store(1, ACQUIRE_TIMEOUT).await else {
        return;
    };
    owner_dropped_mid_body(&store, &app, "mysql (current thread), pool of 1").await;
}
