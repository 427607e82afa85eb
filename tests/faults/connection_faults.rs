//! Connection-level faults, injected (DESIGN §6): the store's connections run
//! through an in-process TCP proxy (`common::proxy`) that cuts one statement's
//! request or response, stalls the server, or slows every chunk, on
//! PostgreSQL and on MariaDB.
//!
//! Each scenario checks the behaviour contract (DESIGN §4):
//! (a) every failure is a typed `idempotent_runtime::Error` (a call that hangs
//!     or panics fails the test);
//! (b) the body runs at most once per key: a reservation whose answer was
//!     lost is released by the store (rule 14), and a result whose completion
//!     was cut is recorded by the store in the background, so a retry replays
//!     it; only a lost heartbeat may lead to a second run, reported as
//!     `LeaseLost`;
//! (c) nothing is lost or corrupted: the record ends complete with exactly
//!     the recorded result; a final retry converges to one answer every later
//!     retry replays; a bystander record of the same tenant is untouched.
//!
//! One-shot faults are aimed with a needle: bound parameters cross the wire
//! verbatim, so the key picks out the reservation, the owner token the
//! heartbeat and the result the completion. Every wait is a proxy handshake or
//! a bounded poll of the database; the only time-based waits let a lease run
//! out. Each test prints its counts (`cargo nextest run --test
//! connection_faults --no-capture`).

use crate::common;

use common::proxy::{Direction, FaultProxy, Stall, Trip, WAIT_LIMIT};
use common::servers::{fresh_tenant, mysql_store_or_skip, mysql_url, pg_store_or_skip, pg_url};
use idempotent_runtime::{
    idempotent, metrics, with_outcome, AnsweredBy, Completion, Error, Fenced, Identity, MySqlStore,
    Outcome, OwnerToken, PgStore, RecordSnapshot, RecordState, Reservation, ReserveRequest, Store,
    StoredOutcome,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// A single call that takes longer than this has hung.
const CALL_LIMIT: Duration = Duration::from_secs(60);
/// A call whose statement goes out on a connection gone silent, given up by
/// the store's bound on a caller's statement (its silent-connection timeout
/// past the statement's lock waits), takes longer than this only if it
/// hangs. No test asserts the bound's duration.
const SILENT_CALL_LIMIT: Duration = Duration::from_secs(120);
/// The silent-connection timeout of the proxied store in the scenarios that
/// silence a connection (`with_silent_connection_timeout`; 20 s by default).
const SILENT_AFTER: Duration = Duration::from_secs(2);
/// A whole scenario that takes longer than this has hung.
const SCENARIO_LIMIT: Duration = Duration::from_secs(240);
/// The proxied pool's acquire timeout: a pool that cannot get a connection says so.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);
/// DESIGN rule 14's release is awaited this long after a stall is lifted.
const RELEASE_LIMIT: Duration = Duration::from_secs(15);
/// The one fingerprinted argument: every record carries a fingerprint.
const AMOUNT: u32 = 1250;
/// Another request's argument, for the test that two requests of one key
/// never answer for each other.
const OTHER_AMOUNT: u32 = 990;

// ---------------------------------------------------------------- the functions under test

/// The workhorse: a short lease (1 s, heartbeat every ~333 ms) and a duplicate
/// that waits up to 5 s, so a retry outwaits an orphaned lease and takes over.
#[idempotent(scope = "faults.conn.call", key = key, tenant = tenant, store = store, skip(rig),
             lease = "1s", in_progress = wait("5s"), shared_scope)]
async fn guarded(
    store: &dyn Store,
    rig: &Rig,
    tenant: &str,
    key: &str,
    amount: u32,
) -> Result<String, Error> {
    rig.body(key, amount).await
}

/// The same scope in transactional mode, on PostgreSQL (a shared scope: a
/// request handled in a transaction, and retried by a store-mode caller or
/// the reverse).
#[idempotent(scope = "faults.conn.call", key = key, tenant = tenant, tx = tx, skip(rig),
             lease = "1s", in_progress = wait("5s"), shared_scope)]
async fn guarded_in_pg_tx(
    tx: &mut sqlx::PgConnection,
    rig: &Rig,
    tenant: &str,
    key: &str,
    amount: u32,
) -> Result<String, Error> {
    let _ = &tx;
    rig.body(key, amount).await
}

/// The same on MySQL/MariaDB.
#[idempotent(scope = "faults.conn.call", key = key, tenant = tenant, tx = tx, skip(rig),
             lease = "1s", in_progress = wait("5s"), shared_scope)]
async fn guarded_in_mysql_tx(
    tx: &mut sqlx::MySqlConnection,
    rig: &Rig,
    tenant: &str,
    key: &str,
    amount: u32,
) -> Result<String, Error> {
    let _ = &tx;
    rig.body(key, amount).await
}

/// For the dropped-call tests: a long lease (so lease expiry cannot pass for a
/// release within the 15 s bound) and no waiting.
#[idempotent(scope = "faults.conn.dropped", key = key, tenant = tenant, store = store, skip(rig),
             lease = "30s", in_progress = reject)]
async fn abandoned(
    store: &dyn Store,
    rig: &Rig,
    tenant: &str,
    key: &str,
    amount: u32,
) -> Result<String, Error> {
    rig.body(key, amount).await
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Function {
    Guarded,
    Abandoned,
}

impl Function {
    fn scope(self) -> &'static str {
        match self {
            Function::Guarded => "faults.conn.call",
            Function::Abandoned => "faults.conn.dropped",
        }
    }
}

/// What the next body run for a key does besides returning its answer.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// Arms a cut of the completion's request (the needle is the result).
    CutCompletionRequest,
    /// Arms a cut of the completion's response.
    CutCompletionResponse,
    /// Arms a cut of the next heartbeat (the needle is the owner token), lets
    /// the duplicate start, and returns after a later heartbeat renewed the lease.
    CutHeartbeat,
    /// Returns after the lease was renewed this many times.
    OutliveHeartbeats(usize),
    /// Takes the store down (every connection cut, new ones refused) as the
    /// body returns, so neither the completion nor the store's background
    /// recording of it can land.
    StoreDownAfterTheBody,
    /// Stalls every connection as the body returns: the completion is sent
    /// and hangs, unanswered, until the stall is released.
    StallAfterTheBody,
    /// The connection the completion goes out on goes silent for good (the
    /// needle is the result); every other connection passes.
    SilenceCompletion,
    /// Another transaction (on the direct pool, MariaDB) locks the record's
    /// row before the body returns, and commits this long after.
    HoldTheRowAfterTheBody(Duration),
}

// ---------------------------------------------------------------- the rig

#[derive(Debug, Default)]
struct Tally {
    calls: usize,
    executed: usize,
    replayed: usize,
    errors: BTreeMap<&'static str, usize>,
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::Store(_) => "Store",
        Error::InProgress { .. } => "InProgress",
        Error::LeaseLost(_) => "LeaseLost",
        Error::FingerprintMismatch(_) => "FingerprintMismatch",
        _ => "other",
    }
}

/// One test's world: a proxy in front of the server, a store whose pool goes
/// through it, a direct store (no proxy) for inspection, a fresh tenant.
struct Rig {
    backend: &'static str,
    test: &'static str,
    proxy: FaultProxy,
    store: Arc<dyn Store>,
    direct: Arc<dyn Store>,
    /// The pool of `direct`, for calls in a transaction.
    direct_pool: DirectPool,
    tenant: String,
    plans: Mutex<HashMap<String, Plan>>,
    /// The answer each body run returned, per key, in order.
    runs: Mutex<BTreeMap<String, Vec<String>>>,
    trips: Mutex<Vec<Trip>>,
    started: Notify,
    tally: Mutex<Tally>,
    notes: Mutex<Vec<String>>,
    metrics_at_start: metrics::Snapshot,
    bystander: Mutex<Option<(Identity, RecordSnapshot)>>,
}

enum DirectPool {
    Postgres(sqlx::PgPool),
    MariaDb(sqlx::MySqlPool),
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn comparable(mut snapshot: RecordSnapshot) -> RecordSnapshot {
    snapshot.now_ms = 0;
    snapshot
}

impl Rig {
    async fn postgres(test: &'static str) -> Option<Rig> {
        Rig::postgres_silent_after(test, None).await
    }

    /// The same, the proxied store giving a connection up as silent after
    /// `silent_after` (`None`: the store's default).
    async fn postgres_silent_after(
        test: &'static str,
        silent_after: Option<Duration>,
    ) -> Option<Rig> {
        let direct = pg_store_or_skip().await?;
        let pool = DirectPool::Postgres(direct.pool().clone());
        let (proxy, store) = through_a_proxy::postgres(2).await?;
        let store = match silent_after {
            Some(timeout) => store.with_silent_connection_timeout(timeout),
            None => store,
        };
        Some(
            Rig::new(
                "postgres",
                test,
                proxy,
                Arc::new(store),
                (Arc::new(direct), pool),
            )
            .await,
        )
    }

    /// The same on MariaDB, the proxied pool's sessions waiting `lock_wait_s` for a
    /// row lock (`innodb_lock_wait_timeout`; `None`: the server's), the
    /// proxied store giving a connection up as silent after `silent_after`
    /// (`None`: the store's default).
    async fn mariadb_waiting_for_locks(
        test: &'static str,
        lock_wait_s: Option<u32>,
        silent_after: Option<Duration>,
    ) -> Option<Rig> {
        let direct = mysql_store_or_skip().await?;
        let pool = DirectPool::MariaDb(direct.pool().clone());
        let (proxy, store) = through_a_proxy::mariadb_waiting_for_locks(2, lock_wait_s).await?;
        let store = match silent_after {
            Some(timeout) => store.with_silent_connection_timeout(timeout),
            None => store,
        };
        Some(
            Rig::new(
                "mariadb",
                test,
                proxy,
                Arc::new(store),
                (Arc::new(direct), pool),
            )
            .await,
        )
    }

    async fn new(
        backend: &'static str,
        test: &'static str,
        proxy: FaultProxy,
        store: Arc<dyn Store>,
        (direct, direct_pool): (Arc<dyn Store>, DirectPool),
    ) -> Rig {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let rig = Rig {
            backend,
            test,
            proxy,
            store,
            direct,
            direct_pool,
            tenant: fresh_tenant(),
            plans: Mutex::default(),
            runs: Mutex::default(),
            trips: Mutex::default(),
            started: Notify::new(),
            tally: Mutex::default(),
            notes: Mutex::default(),
            metrics_at_start: metrics::snapshot(),
            bystander: Mutex::default(),
        };
        // A bystander record of the same tenant, made before any fault: it
        // must come out of the test exactly as it went in.
        let key = rig.key("bystander");
        let (answer, _) = rig.call(&key).await;
        answer.expect("the bystander call, before any fault");
        let id = rig.identity(Function::Guarded, &key);
        let snapshot = rig.fetch_id(&id).await.expect("the bystander record");
        *lock(&rig.bystander) = Some((id, comparable(snapshot)));
        rig
    }

    fn key(&self, label: &str) -> String {
        format!("{label}-{}", uuid::Uuid::new_v4().simple())
    }

    fn identity(&self, function: Function, key: &str) -> Identity {
        Identity::new(self.tenant.as_str(), function.scope(), key).expect("identity")
    }

    async fn fetch_id(&self, id: &Identity) -> Option<RecordSnapshot> {
        self.direct
            .fetch(id)
            .await
            .expect("fetch, not through the proxy")
    }

    async fn fetch(&self, function: Function, key: &str) -> Option<RecordSnapshot> {
        self.fetch_id(&self.identity(function, key)).await
    }

    /// Polls until the record is gone (released in the background), bounded
    /// by [`RELEASE_LIMIT`]; fails the test otherwise.
    async fn wait_released(&self, function: Function, key: &str) {
        let since = Instant::now();
        loop {
            match self.fetch(function, key).await {
                None => return,
                Some(r) if since.elapsed() >= RELEASE_LIMIT => panic!(
                    "DESIGN rule 14: the record was not released within {RELEASE_LIMIT:?}: {r:?}"
                ),
                Some(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    fn plan(&self, key: &str, plan: Plan) {
        lock(&self.plans).insert(key.to_owned(), plan);
    }

    /// The answers the body returned for `key`, one per run.
    fn runs(&self, key: &str) -> Vec<String> {
        lock(&self.runs).get(key).cloned().unwrap_or_default()
    }

    fn note(&self, note: impl Into<String>) {
        let note = note.into();
        println!("[{} {}] {note}", self.backend, self.test);
        lock(&self.notes).push(note);
    }

    fn keep(&self, trip: Trip) -> Trip {
        lock(&self.trips).push(trip.clone());
        trip
    }

    fn trip(&self, index: usize) -> Trip {
        lock(&self.trips)
            .get(index)
            .cloned()
            .expect("the body armed a fault")
    }

    /// The body of both functions.
    async fn body(&self, key: &str, amount: u32) -> Result<String, Error> {
        assert!(amount == AMOUNT || amount == OTHER_AMOUNT, "{amount}");
        let answer = format!("answer-{}", uuid::Uuid::new_v4().simple());
        lock(&self.runs)
            .entry(key.to_owned())
            .or_default()
            .push(answer.clone());
        let plan = lock(&self.plans).remove(key);
        match plan {
            None => {}
            Some(Plan::CutCompletionRequest) => {
                self.keep(self.proxy.cut_on_next_request_containing(&answer));
            }
            Some(Plan::CutCompletionResponse) => {
                self.keep(self.proxy.cut_on_next_response_containing(&answer));
            }
            Some(Plan::CutHeartbeat) => {
                let token = self.own_token(key).await;
                let trip = self.keep(self.proxy.cut_on_next_request_containing(&token));
                self.started.notify_one();
                trip.cut().await;
                self.await_renewal(key, &token).await;
            }
            Some(Plan::OutliveHeartbeats(n)) => {
                let token = self.own_token(key).await;
                for _ in 0..n {
                    self.await_renewal(key, &token).await;
                }
            }
            Some(Plan::StoreDownAfterTheBody) => self.proxy.go_down(),
            Some(Plan::StallAfterTheBody) => self.proxy.stall(Stall::Both),
            Some(Plan::SilenceCompletion) => {
                self.keep(self.proxy.silence_next_request_containing(&answer));
            }
            Some(Plan::HoldTheRowAfterTheBody(held_for)) => {
                let DirectPool::MariaDb(pool) = &self.direct_pool else {
                    panic!("a row held on MariaDB only");
                };
                let id = self.identity(Function::Guarded, key);
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query(
                    "SELECT state FROM idempotency_records \
                     WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE",
                )
                .bind(id.tenant().as_bytes())
                .bind(id.scope().as_bytes())
                .bind(id.key().as_bytes())
                .fetch_one(&mut *tx)
                .await
                .expect("lock the record's row");
                tokio::spawn(async move {
                    tokio::time::sleep(held_for).await;
                    tx.commit().await.expect("commit");
                });
            }
        }
        Ok(answer)
    }

    /// The token of the in-progress record this body runs under.
    async fn own_token(&self, key: &str) -> String {
        let record = self
            .fetch(Function::Guarded, key)
            .await
            .expect("a body runs under an in-progress record");
        assert_eq!(record.state, RecordState::InProgress);
        record
            .owner_token
            .expect("an in-progress record has an owner")
    }

    /// Returns once a heartbeat has extended the lease past what it is now
    /// (or the record is no longer this owner's: taken over). Bounded.
    async fn await_renewal(&self, key: &str, token: &str) {
        let lease_of = |r: &Option<RecordSnapshot>| {
            r.as_ref()
                .filter(|r| r.owner_token.as_deref() == Some(token))
                .and_then(|r| r.lease_expires_at_ms)
        };
        let Some(now) = lease_of(&self.fetch(Function::Guarded, key).await) else {
            return;
        };
        let deadline = Instant::now() + WAIT_LIMIT;
        loop {
            match lease_of(&self.fetch(Function::Guarded, key).await) {
                Some(lease) if lease <= now => {}
                _ => return,
            }
            assert!(
                Instant::now() < deadline,
                "no heartbeat renewed the lease within {WAIT_LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs a call (bounded) and tallies what it got.
    async fn settle(
        &self,
        call: impl Future<Output = Result<String, Error>>,
    ) -> (Result<String, Error>, Option<Outcome>) {
        self.settle_within(CALL_LIMIT, call).await
    }

    /// The same, a hang being a call that takes longer than `limit`.
    async fn settle_within(
        &self,
        limit: Duration,
        call: impl Future<Output = Result<String, Error>>,
    ) -> (Result<String, Error>, Option<Outcome>) {
        let (answer, outcome) = tokio::time::timeout(limit, with_outcome(call))
            .await
            .unwrap_or_else(|_| panic!("a call hung for {limit:?}"));
        let mut tally = lock(&self.tally);
        tally.calls += 1;
        match (&answer, outcome) {
            (Ok(_), Some(Outcome::Replayed)) => tally.replayed += 1,
            (Ok(_), _) => tally.executed += 1,
            (Err(e), _) => *tally.errors.entry(kind(e)).or_default() += 1,
        }
        (answer, outcome)
    }

    async fn call(&self, key: &str) -> (Result<String, Error>, Option<Outcome>) {
        self.call_fn(Function::Guarded, key).await
    }

    /// A call (through the proxy) whose statement may go out on a connection
    /// gone silent: it hangs only past [`SILENT_CALL_LIMIT`].
    async fn call_on_a_silent_connection(
        &self,
        key: &str,
    ) -> (Result<String, Error>, Option<Outcome>) {
        let store = self.store.as_ref();
        self.settle_within(
            SILENT_CALL_LIMIT,
            guarded(store, self, &self.tenant, key, AMOUNT),
        )
        .await
    }

    /// A call through another store object on the same database, not
    /// through the proxy (as a second store, the HTTP layer's or a
    /// consumer's, would make it).
    async fn call_direct(&self, key: &str) -> (Result<String, Error>, Option<Outcome>) {
        self.call_direct_with(key, AMOUNT).await
    }

    async fn call_direct_with(
        &self,
        key: &str,
        amount: u32,
    ) -> (Result<String, Error>, Option<Outcome>) {
        let store = self.direct.as_ref();
        self.settle(guarded(store, self, &self.tenant, key, amount))
            .await
    }

    /// A call in a transaction on the direct pool, committed when it answers
    /// (the same scope in transactional mode).
    async fn call_in_transaction(&self, key: &str) -> (Result<String, Error>, Option<Outcome>) {
        self.call_in_transaction_then(key, true).await
    }

    /// The same, committed or rolled back.
    async fn call_in_transaction_then(
        &self,
        key: &str,
        commit: bool,
    ) -> (Result<String, Error>, Option<Outcome>) {
        let tenant = self.tenant.as_str();
        match &self.direct_pool {
            DirectPool::Postgres(pool) => {
                let mut tx = pool.begin().await.expect("begin");
                let answer = self
                    .settle(guarded_in_pg_tx(&mut tx, self, tenant, key, AMOUNT))
                    .await;
                if commit {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
                answer
            }
            DirectPool::MariaDb(pool) => {
                let mut tx = pool.begin().await.expect("begin");
                let answer = self
                    .settle(guarded_in_mysql_tx(&mut tx, self, tenant, key, AMOUNT))
                    .await;
                if commit {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
                answer
            }
        }
    }

    /// Returns once the body ran for `key` and its in-progress record has a
    /// lease that ran out on the server's clock (read directly, not through
    /// the proxy). Bounded.
    async fn until_lease_lapsed(&self, key: &str) {
        self.until_lease_lapsed_for(key, Duration::ZERO).await
    }

    /// The same, `ago` ago at least.
    async fn until_lease_lapsed_for(&self, key: &str, ago: Duration) {
        let deadline = Instant::now() + WAIT_LIMIT;
        let ago = i64::try_from(ago.as_millis()).expect("ms");
        loop {
            assert!(Instant::now() < deadline, "the body never ran");
            if !self.runs(key).is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        loop {
            let record = self
                .fetch(Function::Guarded, key)
                .await
                .expect("the record stays in progress");
            assert_eq!(record.state, RecordState::InProgress);
            if record
                .lease_expires_at_ms
                .is_some_and(|at| at + ago <= record.now_ms)
            {
                return;
            }
            assert!(Instant::now() < deadline, "the 1 s lease never ran out");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn call_fn(
        &self,
        function: Function,
        key: &str,
    ) -> (Result<String, Error>, Option<Outcome>) {
        let store = self.store.as_ref();
        match function {
            Function::Guarded => {
                self.settle(guarded(store, self, &self.tenant, key, AMOUNT))
                    .await
            }
            Function::Abandoned => {
                self.settle(abandoned(store, self, &self.tenant, key, AMOUNT))
                    .await
            }
        }
    }

    /// Retries (bounded) until a call answers, then checks that the answer is
    /// recorded and that every later retry replays it. Returns the answer.
    async fn converge(&self, function: Function, key: &str) -> String {
        let mut answer = None;
        for _ in 0..8 {
            match self.call_fn(function, key).await {
                (Ok(v), _) => {
                    answer = Some(v);
                    break;
                }
                (Err(Error::Store(_) | Error::InProgress { .. }), _) => continue,
                (Err(e), _) => panic!("a retry got {e:?}"),
            }
        }
        let answer = answer.expect("retries converge to an answer");
        for _ in 0..3 {
            let (again, outcome) = self.call_fn(function, key).await;
            assert_eq!(again.expect("a later retry"), answer);
            assert_eq!(outcome, Some(Outcome::Replayed), "a later retry replays");
        }
        let record = self
            .fetch(function, key)
            .await
            .expect("the answer is recorded");
        assert_eq!(record.state, RecordState::Complete);
        assert!(record.fingerprint.is_some(), "the fingerprint is kept");
        let outcome = record.outcome.expect("a complete record has an outcome");
        assert!(!outcome.is_error);
        assert_eq!(
            outcome.payload,
            serde_json::to_vec(&answer).expect("json"),
            "the record holds exactly the answer"
        );
        assert!(
            self.runs(key).contains(&answer),
            "the recorded answer is one a body run returned"
        );
        answer
    }

    /// The end of every test: the bystander is untouched; print the counts.
    async fn finish(&self) {
        let (id, before) = lock(&self.bystander).clone().expect("bystander");
        let after = self.fetch_id(&id).await.map(comparable);
        assert_eq!(
            after.as_ref(),
            Some(&before),
            "another identity's record was touched"
        );
        let tally = lock(&self.tally);
        let runs = lock(&self.runs);
        let bodies: usize = runs.values().map(Vec::len).sum();
        let per_key: Vec<String> = runs
            .iter()
            .filter(|(k, _)| !k.starts_with("bystander-"))
            .map(|(k, v)| format!("{}={}", k.split('-').next().unwrap_or(k), v.len()))
            .collect();
        let stats = self.proxy.stats();
        let m = metrics::snapshot();
        let s = &self.metrics_at_start;
        println!(
            "[{} {}] calls={} executed={} replayed={} errors={:?} | bodies run={} ({}) | \
             proxy: connections={} cuts={} stalled_chunks={} bytes to server={} to client={} | \
             metrics (this process, since the rig): heartbeats+{} heartbeat_failures+{} taken_over+{} lease_lost+{}",
            self.backend,
            self.test,
            tally.calls,
            tally.executed,
            tally.replayed,
            tally.errors,
            bodies,
            per_key.join(" "),
            stats.connections,
            stats.cuts,
            stats.stalled_chunks,
            stats.bytes_to_server,
            stats.bytes_to_client,
            m.heartbeats - s.heartbeats,
            m.heartbeat_failures - s.heartbeat_failures,
            m.taken_over - s.taken_over,
            m.lease_lost - s.lease_lost,
        );
    }
}

fn assert_store_error(answer: &Result<String, Error>, what: &str) {
    match answer {
        Err(Error::Store(e)) => println!("    {what}: Error::Store({e})"),
        other => panic!("{what}: expected Error::Store, got {other:?}"),
    }
}

async fn run(rig: &Rig, scenario: impl Future<Output = ()>) {
    if tokio::time::timeout(SCENARIO_LIMIT, scenario)
        .await
        .is_err()
    {
        panic!("the scenario hung for {SCENARIO_LIMIT:?}");
    }
    rig.finish().await;
}

macro_rules! on_both_servers {
    ($($name:ident),* $(,)?) => {
        on_both_servers!(silent_after = None; $($name),*);
    };
    (silent_after = $silent_after:expr; $($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let (test, silent_after) = (stringify!($name), $silent_after);
                if let Some(rig) = super::Rig::postgres_silent_after(test, silent_after).await {
                    super::run(&rig, super::$name(&rig)).await;
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mariadb() {
                let (test, silent_after) = (stringify!($name), $silent_after);
                if let Some(rig) = super::Rig::mariadb_waiting_for_locks(test, None, silent_after).await {
                    super::run(&rig, super::$name(&rig)).await;
                }
            }
        }
    )*};
}

on_both_servers!(
    reservation_request_cut,
    reservation_response_cut,
    completion_request_cut,
    completion_response_cut,
    heartbeat_cut,
    outage_outlasting_the_lease_after_the_body,
    outage_outlasting_the_lease_retried_through_another_store,
    outage_outlasting_the_lease_retried_in_a_transaction,
    an_unrecorded_answer_never_answers_another_request,
    completion_hanging_past_the_lease,
    dropped_while_reservation_answer_stalled,
    dropped_while_reservation_request_stalled,
    slow_connection,
);

// The scenarios that silence a connection wait for the store to give it up:
// a short silent-connection timeout ends them in seconds.
on_both_servers!(
    silent_after = Some(super::SILENT_AFTER);
    worker_write_on_a_connection_gone_silent,
    reservation_on_a_connection_gone_silent,
);

// ---------------------------------------------------------------- scenarios

/// The reservation never reaches the server: the caller gets `Error::Store`,
/// there is no record, and a retry runs the body once.
async fn reservation_request_cut(rig: &Rig) {
    let key = rig.key("reservation");
    let trip = rig.proxy.cut_on_next_request_containing(&key);
    let (first, _) = rig.call(&key).await;
    assert_store_error(&first, "reservation request cut");
    assert!(trip.has_cut());
    assert!(rig.runs(&key).is_empty(), "the body must not run");
    assert_eq!(
        rig.fetch(Function::Guarded, &key).await,
        None,
        "the reservation never reached the server"
    );

    let answer = rig.converge(Function::Guarded, &key).await;
    assert_eq!(rig.runs(&key), vec![answer], "the retry ran the body once");
}

/// The reservation committed but its answer was cut: the caller got an error
/// and the body must not have run. The record is in progress under a token
/// nobody holds; a retry sees it in progress until the 1 s lease runs out,
/// takes it over and runs the body exactly once.
async fn reservation_response_cut(rig: &Rig) {
    let key = rig.key("reservation");
    let trip = rig.proxy.cut_on_next_response_containing(&key);
    let (first, _) = rig.call(&key).await;
    assert_store_error(&first, "reservation response cut");
    assert!(trip.has_fired() && trip.has_cut());
    assert!(rig.runs(&key).is_empty(), "the body must not run");
    // The reservation committed under this call's token, but the call never
    // learned it: rule 14, the store releases what the token may own.
    rig.wait_released(Function::Guarded, &key).await;

    let before = metrics::snapshot();
    let answer = rig.converge(Function::Guarded, &key).await;
    assert_eq!(
        rig.runs(&key),
        vec![answer],
        "the retry ran the body exactly once"
    );
    assert_eq!(
        metrics::snapshot().taken_over,
        before.taken_over,
        "no takeover: the orphaned reservation was released, not waited out"
    );
    rig.note("reservation committed, answer cut → body not run; the store released the orphan; retry ran once");
}

/// The body ran; its completion never reached the server. The caller gets
/// `Error::Store`; the store keeps trying to record the result in the
/// background, so a retry replays it and the body never runs a second time.
async fn completion_request_cut(rig: &Rig) {
    let key = rig.key("completion");
    rig.plan(&key, Plan::CutCompletionRequest);
    let (first, _) = rig.call(&key).await;
    assert_store_error(&first, "completion request cut");
    assert!(rig.trip(0).has_cut());
    assert_eq!(rig.runs(&key).len(), 1, "the body ran once");
    rig.note(
        "completion request cut → the store records the result in the background → retries replay",
    );

    let answer = rig.converge(Function::Guarded, &key).await;
    let runs = rig.runs(&key);
    assert_eq!(
        runs,
        vec![answer],
        "no re-run: the first run's answer is the recorded one"
    );
}

/// The completion committed but its answer was cut: the caller gets
/// `Error::Store`, the record is complete with the body's answer, and every
/// retry replays it; the body ran once.
async fn completion_response_cut(rig: &Rig) {
    let key = rig.key("completion");
    rig.plan(&key, Plan::CutCompletionResponse);
    let (first, _) = rig.call(&key).await;
    assert_store_error(&first, "completion response cut");
    assert!(rig.trip(0).has_cut());
    let runs = rig.runs(&key);
    assert_eq!(runs.len(), 1, "the body ran once");
    let record = rig
        .fetch(Function::Guarded, &key)
        .await
        .expect("the record");
    assert_eq!(
        record.state,
        RecordState::Complete,
        "the completion committed before its answer was cut"
    );
    rig.note("completion committed, answer cut → record complete → retries replay");

    let answer = rig.converge(Function::Guarded, &key).await;
    assert_eq!(answer, runs[0], "the retry replays the first run's answer");
    assert_eq!(rig.runs(&key).len(), 1, "and the body did not run again");
}

/// The body ran, and the store went down before its answer was recorded, for
/// longer than the lease: the store goes on trying to record the answer in
/// the background, but nothing can renew the lease meanwhile. When the store
/// comes back, a retry in this process must not take the record over and run
/// the body again: the answer this process still holds is recorded first, and
/// the retry replays it (the caller was told so: "answer not recorded yet,
/// retry later").
async fn outage_outlasting_the_lease_after_the_body(rig: &Rig) {
    after_an_outage_outlasting_the_lease(rig, Retry::SameStoreWhenBack).await
}

/// The same, retried through another store object on the same database
/// while the first one's store is still down: the answer this process holds
/// is recorded by whichever store takes the record over.
async fn outage_outlasting_the_lease_retried_through_another_store(rig: &Rig) {
    after_an_outage_outlasting_the_lease(rig, Retry::AnotherStore).await
}

/// How a retry after the outage reaches the store.
#[derive(Debug, Clone, Copy)]
enum Retry {
    /// Through the same store, once it is back.
    SameStoreWhenBack,
    /// Through another store object, while the first one's is still down.
    AnotherStore,
    /// In a transaction (the scope shared with a transactional function),
    /// while the first store is still down.
    InATransaction,
}

/// The store goes down as the body returns, for longer than the lease; the
/// retry (per `retry`) records the answer this process holds and replays it:
/// the body ran once.
async fn after_an_outage_outlasting_the_lease(rig: &Rig, retry: Retry) {
    let key = rig.key("outage");
    rig.plan(&key, Plan::StoreDownAfterTheBody);
    let (first, _) = rig.call(&key).await;
    assert_store_error(&first, "store down as the body returned");
    let runs = rig.runs(&key);
    assert_eq!(runs.len(), 1, "the body ran once");
    let taken_over = metrics::snapshot().taken_over;
    let (answer, outcome) = match retry {
        Retry::SameStoreWhenBack => {
            rig.until_lease_lapsed(&key).await;
            rig.proxy.pass_through();
            rig.call(&key).await
        }
        Retry::AnotherStore => {
            rig.until_lease_lapsed(&key).await;
            rig.call_direct(&key).await
        }
        Retry::InATransaction => {
            // MySQL/MariaDB refuse a transaction a takeover of a lease that
            // ran out after it began, in whole seconds (StaleSnapshot): one
            // that ran out well before it is taken over.
            rig.until_lease_lapsed_for(&key, Duration::from_millis(2100))
                .await;
            rig.call_in_transaction(&key).await
        }
    };
    assert_eq!(
        rig.runs(&key),
        runs,
        "DESIGN rule 3: the retry ({retry:?}) after the outage ran the body a second time \
         instead of recording the answer the first run produced"
    );
    assert_eq!(answer.expect("the retry after the outage"), runs[0]);
    assert_eq!(outcome, Some(Outcome::Replayed));
    // Rule 20: a takeover answered with the known answer is still counted
    // (each test runs in a process of its own: nothing else counts here).
    assert!(
        metrics::snapshot().taken_over > taken_over,
        "the takeover is counted"
    );
    rig.proxy.pass_through();
    let converged = rig.converge(Function::Guarded, &key).await;
    assert_eq!(converged, runs[0]);
    rig.note(format!(
        "store down past the lease after the body → the retry ({retry:?}) recorded the answer and replayed it"
    ));
}

/// The store went down as the body returned, and its worker goes on
/// recording the answer. As the store comes back, the connection the
/// worker's write goes out on goes silent for good (a frozen server that
/// still acknowledges packets, a network black hole), while new connections
/// work. The attempt is given up after its bound, its connection closed, and
/// the next attempt, on a new connection, records the answer (unrecorded-
/// answers hunt: the worker waited on the silent connection for as long as
/// TCP kept it, unlogged, its retries with it, and the record's lease ran
/// out with the database reachable).
async fn worker_write_on_a_connection_gone_silent(rig: &Rig) {
    let key = rig.key("silent-worker");
    rig.plan(&key, Plan::StoreDownAfterTheBody);
    let (first, _) = rig.call(&key).await;
    assert_store_error(&first, "store down as the body returned");
    let runs = rig.runs(&key);
    assert_eq!(runs.len(), 1, "the body ran once");
    // The answer crosses the wire verbatim: it picks out the worker's write.
    let silenced = rig
        .proxy
        .come_back_silencing_next_request_containing(&runs[0]);
    silenced.request_seen().await;
    assert_eq!(
        rig.store
            .finish_background_work(Duration::from_secs(120))
            .await,
        0,
        "the worker's write on a silent connection was never given up and tried again"
    );
    let record = rig
        .fetch(Function::Guarded, &key)
        .await
        .expect("the record");
    assert_eq!(
        record.state,
        RecordState::Complete,
        "the worker recorded the answer on a new connection: {record:?}"
    );
    let (retry, outcome) = rig.call(&key).await;
    assert_eq!(retry.expect("the retry"), runs[0]);
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(rig.runs(&key), runs, "the body ran once");
    rig.note("the worker's write on a silent connection was given up and recorded on a new one");
}

/// A call's reservation goes out on a connection gone silent for good (a
/// frozen server that still acknowledges packets, a network black hole),
/// while new connections work. The call answers `Error::Store` once the
/// statement has gone unanswered past the store's bound on a caller's
/// statement, its connection closed, instead of waiting for as long as TCP
/// keeps the connection (minutes to for ever: the call hung). The body did
/// not run; the record the statement may have left is released (rule 14:
/// here it never reached the server); a retry runs the body exactly once.
async fn reservation_on_a_connection_gone_silent(rig: &Rig) {
    let key = rig.key("silent-reservation");
    let silenced = rig.proxy.silence_next_request_containing(&key);
    let (first, _) = rig.call_on_a_silent_connection(&key).await;
    assert_store_error(&first, "reservation on a silent connection");
    assert!(
        silenced.has_fired(),
        "the reservation went out on the silenced connection"
    );
    assert!(rig.runs(&key).is_empty(), "the body must not run");
    assert_eq!(
        rig.fetch(Function::Guarded, &key).await,
        None,
        "the silenced reservation never reached the server"
    );

    let answer = rig.converge(Function::Guarded, &key).await;
    assert_eq!(
        rig.runs(&key),
        vec![answer],
        "the retry ran the body exactly once"
    );
    rig.note(
        "reservation on a silent connection → Error::Store, connection closed; retry ran once",
    );
}

/// The body ran; the connection its completion goes out on goes silent for
/// good, while new connections work. The completion is given up past the
/// store's bound, its connection closed, and the call answers as a failed
/// completion does (`Error::Store`, `after_completion`), instead of hanging.
/// The answer is held in this process and recorded by the store's worker on
/// a new connection, so a retry replays it: the body ran once.
async fn completion_on_a_connection_gone_silent(rig: &Rig) {
    let key = rig.key("silent-completion");
    rig.plan(&key, Plan::SilenceCompletion);
    let (first, _) = rig.call_on_a_silent_connection(&key).await;
    assert_store_error(&first, "completion on a silent connection");
    assert!(
        rig.trip(0).has_fired(),
        "the completion went out on the silenced connection"
    );
    let runs = rig.runs(&key);
    assert_eq!(runs.len(), 1, "the body ran once");
    assert_eq!(
        rig.store
            .finish_background_work(Duration::from_secs(120))
            .await,
        0,
        "the worker recorded the answer"
    );
    let record = rig
        .fetch(Function::Guarded, &key)
        .await
        .expect("the record");
    assert_eq!(
        record.state,
        RecordState::Complete,
        "the worker recorded the answer on a new connection: {record:?}"
    );
    let (retry, outcome) = rig.call(&key).await;
    assert_eq!(retry.expect("the retry"), runs[0]);
    assert_eq!(outcome, Some(Outcome::Replayed));
    let answer = rig.converge(Function::Guarded, &key).await;
    assert_eq!(answer, runs[0]);
    assert_eq!(rig.runs(&key), runs, "the body ran once");
    rig.note("completion on a silent connection → Error::Store, answer recorded by the worker; retries replay");
}

/// An answer this process could not record answers only its own request:
/// when its record is gone (an operator released it) and the key's next
/// record, made by a call of other arguments whose owner died, is taken
/// over by a call of those other arguments, that call runs its body (review:
/// it was answered with the first request's answer, which was then recorded
/// as the second's).
async fn an_unrecorded_answer_never_answers_another_request(rig: &Rig) {
    let key = rig.key("other");
    rig.plan(&key, Plan::StoreDownAfterTheBody);
    let (first, _) = rig.call(&key).await;
    assert_store_error(&first, "store down as the body returned");
    rig.until_lease_lapsed(&key).await;
    let identity = rig.identity(Function::Guarded, &key);
    rig.direct
        .force_release(&identity, true)
        .await
        .expect("an operator releases the stuck record");
    // The key's next record: made without a fingerprint (rule 8: any call
    // may take it over) by an owner that died at once.
    let lease = Duration::from_millis(300);
    rig.direct
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &OwnerToken::new(),
            lease,
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    rig.until_lease_lapsed(&key).await;
    let (other, outcome) = rig.call_direct_with(&key, OTHER_AMOUNT).await;
    let runs = rig.runs(&key);
    assert_eq!(
        runs.len(),
        2,
        "the other request's body ran: {other:?} {outcome:?}"
    );
    assert_eq!(other.expect("the other request"), runs[1]);
    assert_eq!(outcome, Some(Outcome::Executed));
    rig.proxy.pass_through();
    rig.note("an unrecorded answer of one request was not given to another request of its key");
}

/// The store went down as the body returned, past the lease, so this process
/// holds the answer unrecorded. A takeover of the record, dropped (a caller's
/// timeout) while its reservation waited for the row, lands after the drop:
/// its record must be kept for the next call, not released for a new record
/// whose call would run the body again. And when the first call's write
/// reaches the store again and finds the record taken over, the answer stays
/// for that next call, which records and replays it (NATS hunt: the body ran
/// twice, on PostgreSQL, MariaDB and SQLite). On PostgreSQL only: the
/// handshake on the row lock reads `pg_blocking_pids` (the engine's decision
/// is the same on every store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_dropped_as_it_lands_keeps_the_record_of_an_answer_held() {
    if let Some(rig) =
        Rig::postgres("a_takeover_dropped_as_it_lands_keeps_the_record_of_an_answer_held").await
    {
        run(&rig, dropped_takeover_of_an_answer_held(&rig)).await;
    }
}

/// A call whose body ran as the store went down for longer than its lease:
/// its record is in progress with a lapsed lease, and this process holds its
/// answer unrecorded (the proxy stays down). Its key and the body's runs.
async fn answer_held_unrecorded(rig: &Rig, label: &str) -> (String, Vec<String>) {
    let key = rig.key(label);
    rig.plan(&key, Plan::StoreDownAfterTheBody);
    let (first, _) = rig.call(&key).await;
    assert_store_error(&first, "store down as the body returned");
    let runs = rig.runs(&key);
    assert_eq!(runs.len(), 1, "the body ran once");
    rig.until_lease_lapsed(&key).await;
    (key, runs)
}

async fn dropped_takeover_of_an_answer_held(rig: &Rig) {
    let (key, runs) = answer_held_unrecorded(rig, "dropped-takeover").await;
    let DirectPool::Postgres(pool) = &rig.direct_pool else {
        unreachable!("a PostgreSQL rig")
    };
    // Another session holds the record's row; a store that waits long for
    // a row lock takes the record over behind it.
    let identity = rig.identity(Function::Guarded, &key);
    let mut locker = pool.acquire().await.expect("a connection");
    let locker_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *locker)
        .await
        .expect("pid");
    common::records::pg_lock_row_in_transaction(&mut locker, &identity).await;
    let patient = PgStore::from_pool(pool.clone())
        .await
        .expect("store")
        .with_lock_wait(Duration::from_secs(60));
    let blocked = async {
        let deadline = Instant::now() + WAIT_LIMIT;
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(locker_pid)
            .fetch_one(pool)
            .await
            .expect("pg_stat_activity");
            if waiting > 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the takeover never waited for the row"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        answer = guarded(&patient, rig, &rig.tenant, &key, AMOUNT) => {
            panic!("the takeover answered while the row was held: {answer:?}")
        }
        () = blocked => {}
    }
    // Dropped while its statement waits; it lands once the row is free.
    sqlx::query("COMMIT")
        .execute(&mut *locker)
        .await
        .expect("commit");
    assert_eq!(
        patient.finish_background_work(WAIT_LIMIT).await,
        0,
        "the dropped takeover's record is finished"
    );
    let record = rig.fetch_id(&identity).await;
    assert!(
        record
            .as_ref()
            .is_some_and(|r| r.state == RecordState::InProgress),
        "the record of an answer this process holds is kept, not released: {record:?}"
    );
    // The first call's write reaches the store again and finds the record
    // taken over: the answer stays for the next takeover.
    rig.proxy.pass_through();
    assert_eq!(
        rig.store.finish_background_work(WAIT_LIMIT).await,
        0,
        "the first call's write is done"
    );
    let (answer, outcome) = rig.call_direct(&key).await;
    assert_eq!(
        rig.runs(&key),
        runs,
        "DESIGN rule 3: the call after a dropped takeover ran the body a second time \
         instead of recording the answer the first run produced"
    );
    assert_eq!(
        answer.expect("the call after the dropped takeover"),
        runs[0]
    );
    assert_eq!(outcome, Some(Outcome::Replayed));
    rig.note("a takeover dropped as it landed kept the record; the next call recorded the answer");
}

/// Only a reservation in flight keeps the record of an answer held: a call
/// of the same request whose reservation answered (here a fresh record,
/// after an operator released the first) and that is dropped while its body
/// runs releases its record, as rule 14 says (review: the record was kept
/// with its lease ended, so a store without `end_lease_detached` kept the
/// key blocked for a whole lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_in_its_body_releases_its_record_though_an_answer_is_held() {
    if let Some(rig) =
        Rig::postgres("a_call_dropped_in_its_body_releases_its_record_though_an_answer_is_held")
            .await
    {
        run(&rig, dropped_in_the_body_with_an_answer_held(&rig)).await;
    }
}

async fn dropped_in_the_body_with_an_answer_held(rig: &Rig) {
    let (key, _) = answer_held_unrecorded(rig, "dropped-in-body").await;
    let identity = rig.identity(Function::Guarded, &key);
    rig.direct
        .force_release(&identity, true)
        .await
        .expect("an operator releases the stuck record");
    rig.plan(&key, Plan::OutliveHeartbeats(1_000));
    let body_started = async {
        let deadline = Instant::now() + WAIT_LIMIT;
        while rig.runs(&key).len() < 2 {
            assert!(Instant::now() < deadline, "the second body never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        answer = rig.call_direct(&key) => panic!("the body was to outlive the test: {answer:?}"),
        () = body_started => {}
    }
    assert_eq!(
        rig.direct.finish_background_work(WAIT_LIMIT).await,
        0,
        "the dropped call's record is finished"
    );
    let record = rig.fetch_id(&identity).await;
    assert!(
        record.is_none(),
        "DESIGN rule 14: a call dropped in its body releases its record: {record:?}"
    );
    rig.proxy.pass_through();
    rig.note("a call dropped in its body released its record, an answer held or not");
}

/// A transactional takeover that records the hanging call's answer and then
/// rolls back vouches for nothing: the record is the hanging call's again,
/// another owner (another process: here a plain reservation) takes it over
/// and records its own answer, and when the hanging write lands at last its
/// call is told `LeaseLost`, not that its answer was recorded (review: the
/// rolled-back takeover had marked it recorded, hiding a second run).
/// On PostgreSQL only: MySQL/MariaDB refuse a transaction the takeover of a
/// lease that ran out less than a second or so before it began, and the
/// stalled call gives up waiting for a connection before then (the engine's
/// decision is the same on every store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transactional_takeover_vouches_for_nothing() {
    if let Some(rig) =
        Rig::postgres("a_rolled_back_transactional_takeover_vouches_for_nothing").await
    {
        run(&rig, rolled_back_transactional_takeover(&rig)).await;
    }
}

async fn rolled_back_transactional_takeover(rig: &Rig) {
    let key = rig.key("rolled-back");
    rig.plan(&key, Plan::StallAfterTheBody);
    let meanwhile = async {
        rig.until_lease_lapsed(&key).await;
        let (retry, outcome) = rig.call_in_transaction_then(&key, false).await;
        assert_eq!(
            retry.expect("the takeover in a transaction"),
            rig.runs(&key)[0]
        );
        assert_eq!(outcome, Some(Outcome::Replayed));
        // Rolled back: the record is the hanging call's, its lease run out.
        let identity = rig.identity(Function::Guarded, &key);
        let token = OwnerToken::new();
        let taken = rig
            .direct
            .reserve(ReserveRequest {
                identity: &identity,
                fingerprint: None,
                token: &token,
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(3600),
            })
            .await
            .expect("another owner's reservation");
        assert!(
            matches!(
                taken,
                Reservation::Acquired {
                    took_over: true,
                    ..
                }
            ),
            "{taken:?}"
        );
        let other = StoredOutcome {
            is_error: false,
            payload: br#""another owner's answer""#.to_vec(),
        };
        let written = rig
            .direct
            .complete(Completion {
                identity: &identity,
                token: &token,
                outcome: &other,
                ttl: Duration::from_secs(3600),
                by: AnsweredBy::Body,
            })
            .await
            .expect("another owner's completion");
        assert_eq!(written, Fenced::Written);
        rig.proxy.pass_through();
    };
    let ((first, _), ()) = tokio::join!(rig.call(&key), meanwhile);
    assert!(
        matches!(first, Err(Error::LeaseLost(_))),
        "the hanging call's answer was not what got recorded: {first:?}"
    );
    rig.note("a rolled-back transactional takeover did not vouch for the hanging call's answer");
}

/// The same, retried in transactional mode (the scope is shared with a
/// transactional function): the takeover inside the caller's transaction
/// records the answer this process holds, and it commits with the caller's.
async fn outage_outlasting_the_lease_retried_in_a_transaction(rig: &Rig) {
    after_an_outage_outlasting_the_lease(rig, Retry::InATransaction).await
}

/// The completion is sent and hangs past the lease (a connection that went
/// silent: no error, no answer). A retry (through another store object) takes
/// the record over: it records the answer the hanging call produced and
/// replays it, instead of running the body again. When the hanging write
/// finally arrives it finds the record taken over and changes nothing, and
/// its call is answered with its own answer, which is what was recorded.
async fn completion_hanging_past_the_lease(rig: &Rig) {
    let key = rig.key("hanging");
    rig.plan(&key, Plan::StallAfterTheBody);
    let retried = async {
        rig.until_lease_lapsed(&key).await;
        let runs = rig.runs(&key);
        assert_eq!(runs.len(), 1, "the body ran once");
        let (retry, outcome) = rig.call_direct(&key).await;
        assert_eq!(
            rig.runs(&key),
            runs,
            "DESIGN rule 3: the retry ran the body a second time while the first run's answer \
             was still being written"
        );
        assert_eq!(retry.expect("the retry"), runs[0]);
        assert_eq!(outcome, Some(Outcome::Replayed));
        rig.proxy.pass_through();
    };
    let ((first, _), ()) = tokio::join!(rig.call(&key), retried);
    // Its write found the record taken over by a call that recorded this
    // very answer: the hanging call is told its answer, not `LeaseLost`
    // ("not recorded, the work may have run twice"), which was not so.
    assert_eq!(
        first.expect("the hanging call's answer was recorded by the takeover"),
        rig.runs(&key)[0]
    );
    let answer = rig.converge(Function::Guarded, &key).await;
    assert_eq!(answer, rig.runs(&key)[0]);
    assert_eq!(rig.runs(&key).len(), 1);
    rig.note("completion hung past the lease → a retry recorded the hanging call's answer; the late write changed nothing");
}

/// A long body under a 1 s lease: one heartbeat is cut. The failure is
/// counted, a later heartbeat renews the lease, and a duplicate waiting
/// meanwhile replays. If the lease lapsed instead and the duplicate took over,
/// the owner must be told `LeaseLost`: never a silent double run.
async fn heartbeat_cut(rig: &Rig) {
    let key = rig.key("heartbeat");
    rig.plan(&key, Plan::CutHeartbeat);
    let before = metrics::snapshot();
    let owner = rig.call(&key);
    let duplicate = async {
        tokio::time::timeout(WAIT_LIMIT, rig.started.notified())
            .await
            .expect("the owner's body started");
        rig.call(&key).await
    };
    let ((owner, _), (duplicate, duplicate_outcome)) = tokio::join!(owner, duplicate);
    let after = metrics::snapshot();
    assert!(rig.trip(0).has_cut(), "a heartbeat was cut");
    assert!(
        after.heartbeat_failures > before.heartbeat_failures,
        "the failed heartbeat is counted"
    );
    let runs = rig.runs(&key);
    let recorded = match (&owner, runs.len()) {
        (Ok(answer), 1) => {
            match &duplicate {
                Ok(d) => {
                    assert_eq!(d, answer);
                    assert_eq!(duplicate_outcome, Some(Outcome::Replayed));
                }
                Err(Error::InProgress { .. }) => {}
                Err(e) => panic!("the duplicate got {e:?}"),
            }
            rig.note(format!(
                "heartbeat cut, lease renewed by the next heartbeat → owner completed, duplicate {}",
                if duplicate.is_ok() { "replayed" } else { "refused InProgress" }
            ));
            answer.clone()
        }
        (Err(Error::LeaseLost(_)), 2) => {
            assert_eq!(
                duplicate.as_ref().expect("the duplicate took over"),
                &runs[1]
            );
            rig.note("heartbeat cut, lease lapsed → duplicate took over; owner told LeaseLost (reported double run)");
            runs[1].clone()
        }
        _ => panic!(
            "owner got {owner:?} with {} body runs, duplicate got {duplicate:?}: \
             a second run must be reported to the owner as LeaseLost",
            runs.len()
        ),
    };
    assert_eq!(rig.converge(Function::Guarded, &key).await, recorded);
    assert_eq!(rig.runs(&key).len(), runs.len(), "no run after the answer");
}

/// DESIGN rule 14, answer stalled: the reservation reaches the server and
/// commits, its answer is held, and the caller gives up.
async fn dropped_while_reservation_answer_stalled(rig: &Rig) {
    dropped_during_stall(rig, Stall::ToClientOnly).await;
}

/// DESIGN rule 14, request stalled: the reservation is held in the proxy when
/// the caller gives up, and reaches the server only after the stall is lifted.
async fn dropped_while_reservation_request_stalled(rig: &Rig) {
    dropped_during_stall(rig, Stall::Both).await;
}

/// DESIGN rule 14: "a future dropped mid-way (including while its reservation
/// is still in flight) releases the record"; the store hands the release to
/// something it owns. After the stall is lifted the record must be gone
/// within 15 s (its 30 s lease cannot pass for a release), and a new call
/// runs the body once.
///
/// KNOWN TO FAIL until rule 14's fix lands in the engine (being made in
/// parallel): the engine arms its release-on-drop guard only after the
/// reservation returns, so a call dropped while its reservation is in flight
/// leaves the record in progress for its whole lease.
async fn dropped_during_stall(rig: &Rig, mode: Stall) {
    let key = rig.key("dropped");
    let trip = rig.proxy.stall_on_next_request_containing(&key, mode);
    {
        let mut call = pin!(abandoned(
            rig.store.as_ref(),
            rig,
            &rig.tenant,
            &key,
            AMOUNT
        ));
        let held = match mode {
            Stall::Both => Direction::ToServer,
            Stall::ToClientOnly => Direction::ToClient,
        };
        tokio::select! {
            answer = call.as_mut() => panic!("the call finished while the proxy held its reservation: {answer:?}"),
            _ = rig.proxy.wait_held(held) => {}
        }
        // The caller gives up, as callers do: a timeout around the call.
        // Nothing can finish while the proxy holds the bytes, so it fires.
        let gave_up = tokio::time::timeout(Duration::from_millis(200), call.as_mut()).await;
        assert!(
            gave_up.is_err(),
            "the call cannot finish during the stall: {gave_up:?}"
        );
        // `call` is dropped here, its reservation in flight.
    }
    {
        let mut tally = lock(&rig.tally);
        tally.calls += 1;
        *tally.errors.entry("dropped by the caller").or_default() += 1;
    }
    assert!(trip.has_fired());
    assert!(
        rig.runs(&key).is_empty(),
        "the dropped call's body never ran"
    );
    let during = rig.fetch(Function::Abandoned, &key).await;
    rig.proxy.release_stall();
    // The held reservation now runs on the server (with `Stall::Both` it
    // only gets there now): wait until its answer is back at the proxy, so
    // an absent record below means released, not "not arrived yet".
    trip.settled().await;

    let released_at = Instant::now();
    let mut last;
    loop {
        last = rig.fetch(Function::Abandoned, &key).await;
        if last.is_none() || released_at.elapsed() >= RELEASE_LIMIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rig.note(format!(
        "stall {mode:?}: record during the stall: {}; {:?} after the stall was lifted: {}",
        describe(&during),
        released_at.elapsed(),
        describe(&last)
    ));
    assert!(
        last.is_none(),
        "DESIGN rule 14: a call dropped while its reservation was in flight must release the record; \
         {RELEASE_LIMIT:?} after the stall was lifted it is still there: {last:?}"
    );

    let (fresh, outcome) = rig.call_fn(Function::Abandoned, &key).await;
    let fresh = fresh.expect("a new call after the release");
    assert_eq!(outcome, Some(Outcome::Executed));
    assert_eq!(rig.runs(&key), vec![fresh.clone()], "it ran the body once");
    assert_eq!(rig.converge(Function::Abandoned, &key).await, fresh);
}

fn describe(record: &Option<RecordSnapshot>) -> String {
    match record {
        None => "absent".into(),
        Some(r) => format!(
            "{:?}, lease {} ms from now",
            r.state,
            r.lease_expires_at_ms.map_or(0, |l| l - r.now_ms)
        ),
    }
}

/// Every chunk delayed 20 ms: fresh calls, replays, concurrent duplicates and
/// a body that outlives two heartbeats all behave exactly as without delay.
async fn slow_connection(rig: &Rig) {
    rig.proxy.slow(Duration::from_millis(20));

    let first = rig.key("slow");
    let (answer, outcome) = rig.call(&first).await;
    let answer = answer.expect("a call over a slow link");
    assert_eq!(outcome, Some(Outcome::Executed));
    let (again, outcome) = rig.call(&first).await;
    assert_eq!(again.expect("a replay over a slow link"), answer);
    assert_eq!(outcome, Some(Outcome::Replayed));

    let contended = rig.key("contended");
    let answers = futures::future::join_all((0..4).map(|_| rig.call(&contended))).await;
    let runs = rig.runs(&contended);
    assert_eq!(runs.len(), 1, "four concurrent duplicates, one body run");
    let mut executed = 0;
    for (a, o) in &answers {
        assert_eq!(a.as_ref().expect("every duplicate answers"), &runs[0]);
        executed += usize::from(*o == Some(Outcome::Executed));
    }
    assert_eq!(executed, 1, "one executed, the others replayed");

    let long = rig.key("long");
    rig.plan(&long, Plan::OutliveHeartbeats(2));
    let (answer, outcome) = rig.call(&long).await;
    answer.expect("a body renewed twice over a slow link");
    assert_eq!(outcome, Some(Outcome::Executed));

    rig.proxy.pass_through();
    for key in [&first, &contended, &long] {
        rig.converge(Function::Guarded, key).await;
        assert_eq!(rig.runs(key).len(), 1, "one body run per key");
    }
    assert_eq!(rig.proxy.stats().cuts, 0);
    assert!(
        lock(&rig.tally).errors.is_empty(),
        "no errors over a slow link"
    );
}

// ---------------------------------------------------------------- the proxy itself

/// A server that records what it receives and answers each chunk with "ok:" + chunk.
async fn echo_server() -> (
    std::net::SocketAddr,
    Arc<Mutex<Vec<u8>>>,
    tokio::task::JoinHandle<()>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let received = Arc::new(Mutex::new(Vec::new()));
    let seen = received.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n @ 1..) = socket.read(&mut buf).await {
                    lock(&seen).extend_from_slice(&buf[..n]);
                    let mut reply = b"ok:".to_vec();
                    reply.extend_from_slice(&buf[..n]);
                    if socket.write_all(&reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, received, task)
}

async fn read_some(stream: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(WAIT_LIMIT, stream.read(&mut buf))
        .await
        .expect("bounded read")
        .unwrap_or(0);
    buf[..n].to_vec()
}

#[tokio::test]
async fn proxy_cuts_exactly_the_request_or_response_it_is_aimed_at() {
    use tokio::io::AsyncWriteExt;
    let (addr, received, _server) = echo_server().await;
    let proxy = FaultProxy::start(&addr.to_string()).await.expect("proxy");
    let mut client = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");

    client.write_all(b"ping").await.expect("write");
    assert_eq!(read_some(&mut client).await, b"ok:ping");

    // A request cut aimed at "SECRET": other traffic passes, the matching
    // chunk is dropped (needle split across two writes) and the connection closed.
    let trip = proxy.cut_on_next_request_containing("SECRET");
    client.write_all(b"hello").await.expect("write");
    assert_eq!(read_some(&mut client).await, b"ok:hello");
    assert!(!trip.has_fired());
    let before = lock(&received).len();
    client.write_all(b"xxSEC").await.expect("write");
    assert_eq!(read_some(&mut client).await, b"ok:xxSEC");
    client.write_all(b"RETyy").await.expect("write");
    trip.cut().await;
    assert_eq!(
        read_some(&mut client).await,
        b"",
        "closed, nothing forwarded"
    );
    assert_eq!(&lock(&received)[before..], b"xxSEC");
    assert_eq!(proxy.stats().cuts, 1);

    // A response cut: the server gets the request, the client gets nothing.
    let mut client = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    let trip = proxy.cut_on_next_response();
    client.write_all(b"commit").await.expect("write");
    trip.cut().await;
    assert_eq!(read_some(&mut client).await, b"");
    assert!(lock(&received).ends_with(b"commit"), "the server got it");

    // A plain request cut: whatever the client sends next.
    let mut client = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    let before = lock(&received).len();
    let trip = proxy.cut_on_next_request();
    client.write_all(b"anything").await.expect("write");
    trip.cut().await;
    trip.settled().await;
    assert_eq!(read_some(&mut client).await, b"");
    assert_eq!(lock(&received).len(), before, "nothing reached the server");
    let stats = proxy.stats();
    assert_eq!((stats.connections, stats.cuts), (3, 3));
}

#[tokio::test]
async fn proxy_stalls_until_released_and_keeps_order() {
    use tokio::io::AsyncWriteExt;
    let (addr, received, _server) = echo_server().await;
    let proxy = FaultProxy::start(&addr.to_string()).await.expect("proxy");
    let mut client = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");

    // Server → client only: the request arrives, its answer is held.
    proxy.stall(Stall::ToClientOnly);
    client.write_all(b"one").await.expect("write");
    proxy.wait_held(Direction::ToClient).await;
    assert_eq!(lock(&received).as_slice(), b"one");
    proxy.release_stall();
    assert_eq!(read_some(&mut client).await, b"ok:one");

    // Both ways, started by a needle: the matching chunk itself is held.
    let trip = proxy.stall_on_next_request_containing("two", Stall::Both);
    client.write_all(b"two").await.expect("write");
    trip.request_seen().await;
    proxy.wait_held(Direction::ToServer).await;
    assert_eq!(lock(&received).as_slice(), b"one");
    assert!(!trip.has_cut());
    proxy.release_stall();
    trip.settled().await;
    assert_eq!(read_some(&mut client).await, b"ok:two");
    assert_eq!(lock(&received).as_slice(), b"onetwo");

    proxy.slow(Duration::from_millis(5));
    client.write_all(b"three").await.expect("write");
    assert_eq!(read_some(&mut client).await, b"ok:three");
    proxy.pass_through();
    let stats = proxy.stats();
    assert_eq!(stats.cuts, 0);
    assert_eq!(stats.stalled_chunks, 2);
    assert_eq!(stats.bytes_to_server, 11);
}

/// A call dropped while its statement waits on a server that does not answer
/// (stalled, or the connection black-holed by the network) must not take the
/// pool's slot with it. sqlx hands a connection back by pinging it, without a
/// bound, and that ping waited as long as the server stayed silent: once
/// callers that gave up (a timeout around the call, as the README advises)
/// held every slot, every later call failed with `PoolTimedOut`, though the
/// caller was long gone. The store now closes a connection whose statement
/// its call abandoned: the pool's slot is free again while the server is
/// still silent. The pool has one connection; each round's reservation is
/// the one whose answer is held.
async fn a_dropped_call_on_a_silent_connection_frees_its_slot(
    proxy: &FaultProxy,
    store: &dyn Store,
    pool_size: impl Fn() -> u32,
) {
    use idempotent_runtime::{OwnerToken, Reservation, ReserveRequest};
    let tenant = fresh_tenant();
    fn request<'a>(identity: &'a Identity, token: &'a OwnerToken) -> ReserveRequest<'a> {
        ReserveRequest {
            identity,
            fingerprint: None,
            token,
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
        }
    }
    let token = OwnerToken::new();
    for round in 0..3 {
        let key = format!("silent-{round}-{tenant}");
        let identity = Identity::new(tenant.clone(), "faults.silent", key.clone()).expect("id");
        let trip = proxy.stall_on_next_request_containing(&key, Stall::ToClientOnly);
        {
            let mut call = pin!(store.reserve(request(&identity, &token)));
            tokio::select! {
                answer = call.as_mut() => panic!("round {round}: answered during the stall: {answer:?}"),
                _ = trip.request_seen() => {}
            }
            proxy.wait_held(Direction::ToClient).await;
            // The caller gives up: `call` is dropped mid-statement.
        }
        // The handshake is the pool's own count of its connections, bounded.
        let freed = async {
            while pool_size() != 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(WAIT_LIMIT, freed)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "round {round}: the abandoned connection still holds the pool's slot \
                 {WAIT_LIMIT:?} later, the server silent"
                )
            });
        proxy.release_stall();
    }
    let identity = Identity::new(tenant, "faults.silent", "after").expect("id");
    let answer = store
        .reserve(request(&identity, &token))
        .await
        .expect("a new connection answers");
    assert!(matches!(answer, Reservation::Acquired { .. }), "{answer:?}");
}

/// Stores whose pool (of `max_connections`) goes through a [`FaultProxy`]
/// (`None` when the server is not there). The migrations run through the
/// proxy, in pass-through mode.
pub(crate) mod through_a_proxy {
    use super::*;

    pub async fn postgres(max_connections: u32) -> Option<(FaultProxy, PgStore)> {
        pg_store_or_skip().await?;
        let options = PgConnectOptions::from_str(&pg_url()).expect("PostgreSQL URL");
        let upstream = format!("{}:{}", options.get_host(), options.get_port());
        let proxy = FaultProxy::start(&upstream).await.expect("proxy");
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(
                options
                    .host("127.0.0.1")
                    .port(proxy.port())
                    .application_name("idempotent-connection-faults"),
            )
            .await
            .expect("a pool through the proxy");
        Some((proxy, PgStore::from_pool(pool).await.expect("store")))
    }

    pub async fn mariadb(max_connections: u32) -> Option<(FaultProxy, MySqlStore)> {
        mariadb_waiting_for_locks(max_connections, None).await
    }

    /// The same, the pool's sessions waiting `lock_wait_s` for a row lock
    /// (`SET SESSION innodb_lock_wait_timeout` as each connection opens).
    pub async fn mariadb_waiting_for_locks(
        max_connections: u32,
        lock_wait_s: Option<u32>,
    ) -> Option<(FaultProxy, MySqlStore)> {
        mysql_store_or_skip().await?;
        let url = mysql_url();
        let url = match url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => url,
        };
        let options = MySqlConnectOptions::from_str(&url).expect("MySQL URL");
        let upstream = format!("{}:{}", options.get_host(), options.get_port());
        let proxy = FaultProxy::start(&upstream).await.expect("proxy");
        let pool = MySqlPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if let Some(seconds) = lock_wait_s {
                        sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
                            .bind(seconds)
                            .execute(conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options.host("127.0.0.1").port(proxy.port()))
            .await
            .expect("a pool through the proxy");
        Some((proxy, MySqlStore::from_pool(pool).await.expect("store")))
    }
}

/// [`completion_on_a_connection_gone_silent`] on both servers, the store
/// giving a connection up as silent after [`SILENT_AFTER`]; on MariaDB the
/// sessions wait 2 s for a row lock instead of the server's 50 s, so the
/// completion's bound (the silent-connection timeout past the lock wait)
/// gives it up sooner.
mod completion_on_a_connection_gone_silent {
    use super::SILENT_AFTER;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let test = "completion_on_a_connection_gone_silent";
        if let Some(rig) = super::Rig::postgres_silent_after(test, Some(SILENT_AFTER)).await {
            super::run(&rig, super::completion_on_a_connection_gone_silent(&rig)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mariadb() {
        let test = "completion_on_a_connection_gone_silent";
        let rig = super::Rig::mariadb_waiting_for_locks(test, Some(2), Some(SILENT_AFTER));
        if let Some(rig) = rig.await {
            super::run(&rig, super::completion_on_a_connection_gone_silent(&rig)).await;
        }
    }
}

/// The bound on a caller's statement never cuts a row-lock wait the store
/// allows: on MariaDB a completion waits for a row lock as long as the
/// sessions' `innodb_lock_wait_timeout` (50 s by default), and the bound
/// counts from the end of that. Another transaction holds the record's row
/// as the body returns, for longer than the [`SILENT_AFTER`] a silent
/// statement gets (the store's silent-connection timeout), then commits:
/// the completion lands and the call answers with the body's result (given
/// up at the timeout, it answered `Error::Store`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_completion_waiting_for_a_row_lock_is_not_given_up() {
    let test = "a_completion_waiting_for_a_row_lock_is_not_given_up";
    let Some(rig) = Rig::mariadb_waiting_for_locks(test, None, Some(SILENT_AFTER)).await else {
        return;
    };
    let key = rig.key("locked");
    let held = SILENT_AFTER + Duration::from_secs(3);
    rig.plan(&key, Plan::HoldTheRowAfterTheBody(held));
    let (answer, outcome) = rig.call_on_a_silent_connection(&key).await;
    let runs = rig.runs(&key);
    assert_eq!(runs.len(), 1, "the body ran once");
    assert_eq!(
        answer.expect("the completion waited for the row lock and landed"),
        runs[0]
    );
    assert_eq!(outcome, Some(Outcome::Executed));
    rig.finish().await;
}

#[tokio::test]
async fn postgres_a_dropped_call_on_a_silent_connection_frees_its_slot() {
    let Some((proxy, store)) = through_a_proxy::postgres(1).await else {
        return;
    };
    let pool = store.pool().clone();
    a_dropped_call_on_a_silent_connection_frees_its_slot(&proxy, &store, || pool.size()).await;
}

#[tokio::test]
async fn mariadb_a_dropped_call_on_a_silent_connection_frees_its_slot() {
    let Some((proxy, store)) = through_a_proxy::mariadb(1).await else {
        return;
    };
    let pool = store.pool().clone();
    a_dropped_call_on_a_silent_connection_frees_its_slot(&proxy, &store, || pool.size()).await;
}

/// The same for the question MariaDB's store asks a connection before it
/// writes outside the insert-or-read statement (whether another user of the
/// pool left it inside a transaction, and whether its clock was set): a call
/// dropped while that question waits on a silent server frees its slot too.
/// It is the first round trip of a record's fetch, of the purge, the audit,
/// an operator's release and the reservation procedure.
#[tokio::test]
async fn mariadb_a_dropped_check_on_a_silent_connection_frees_its_slot() {
    let Some((proxy, store)) = through_a_proxy::mariadb(1).await else {
        return;
    };
    let identity = Identity::new(fresh_tenant(), "faults.silent", "checked").expect("id");
    let trip = proxy.stall_on_next_request_containing("@@in_transaction", Stall::ToClientOnly);
    {
        let mut call = pin!(store.fetch(&identity));
        tokio::select! {
            answer = call.as_mut() => panic!("answered during the stall: {answer:?}"),
            _ = trip.request_seen() => {}
        }
        proxy.wait_held(Direction::ToClient).await;
    }
    let freed = async {
        while store.pool().size() != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(WAIT_LIMIT, freed)
        .await
        .expect("the abandoned check's connection still holds the pool's slot, the server silent");
    proxy.release_stall();
    assert!(store.fetch(&identity).await.expect("fetch").is_none());
}

/// `with_silent_connection_timeout(Duration::MAX)` is no bound, as the
/// setting's documentation says, and overflows nothing (the statements'
/// waits on top, the worker's attempts): a reservation, a completion and a
/// replay go through. A clone keeps the setting of the handle it was made
/// from, and setting it on a clone leaves the original's alone. (A zero
/// timeout is not tested: what it gives up depends on the timer's
/// resolution and the server's speed.)
#[tokio::test]
async fn an_unbounded_silent_connection_timeout_overflows_nothing_and_clones_keep_theirs() {
    let tenant = fresh_tenant();
    let answer = StoredOutcome {
        is_error: false,
        payload: br#""the answer""#.to_vec(),
    };
    let stores: Vec<(&str, Arc<dyn Store>)> = {
        let mut stores: Vec<(&str, Arc<dyn Store>)> = Vec::new();
        if let Some(store) = pg_store_or_skip().await {
            let unbounded = store.clone().with_silent_connection_timeout(Duration::MAX);
            assert_eq!(unbounded.silent_connection_timeout(), Duration::MAX);
            assert_eq!(unbounded.clone().silent_connection_timeout(), Duration::MAX);
            assert_eq!(store.silent_connection_timeout(), Duration::from_secs(20));
            stores.push(("postgres", Arc::new(unbounded)));
        }
        if let Some(store) = mysql_store_or_skip().await {
            let unbounded = store.clone().with_silent_connection_timeout(Duration::MAX);
            assert_eq!(unbounded.silent_connection_timeout(), Duration::MAX);
            assert_eq!(unbounded.clone().silent_connection_timeout(), Duration::MAX);
            assert_eq!(store.silent_connection_timeout(), Duration::from_secs(20));
            stores.push(("mariadb", Arc::new(unbounded)));
        }
        stores
    };
    for (name, store) in stores {
        let identity =
            Identity::new(tenant.clone(), "faults.unbounded_timeout", name).expect("identity");
        let token = OwnerToken::new();
        let request = ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &token,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        let reserved = store.reserve(request).await.expect("a reservation");
        assert!(
            matches!(reserved, Reservation::Acquired { .. }),
            "{name}: {reserved:?}"
        );
        let written = store
            .complete(Completion {
                identity: &identity,
                token: &token,
                outcome: &answer,
                ttl: Duration::from_secs(3600),
                by: AnsweredBy::Body,
            })
            .await
            .expect("a completion");
        assert_eq!(written, Fenced::Written, "{name}");
        let retry = OwnerToken::new();
        let replay = store
            .reserve(ReserveRequest {
                token: &retry,
                ..request
            })
            .await
            .expect("a replay");
        assert_eq!(replay, Reservation::Completed(answer.clone()), "{name}");
    }
}
