//! Rule 20 in transactional mode (`tx = ...` with `recover = ...`): a call
//! whose transaction takes over a stuck record asks the hook first; the
//! hook's answer is recorded in the caller's transaction (marked recovered)
//! and commits or rolls back with it. On SQLite and PostgreSQL.
//!
//! The stuck record is planted through the store: an in-progress record whose
//! lease has run out (a zero lease), as a crashed store-mode owner of the same
//! scope would leave it.

use crate::common;
use crate::common::ledger::Ledger;

use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, Outcome, OwnerToken, RecordState, Recovery,
    Reservation, ReserveRequest, SqliteStore, Store, StoreError, Takeover,
};
use std::time::Duration;

/// The attempts the hook was asked about, per tenant.
static ASKED: Ledger<u32> = Ledger::new();

pub(crate) fn asked(tenant: &str) -> Vec<u32> {
    ASKED.of(tenant)
}

/// Keys starting with `found-` were charged by the crashed attempt; for keys
/// starting with `unsure-` the hook cannot tell (it fails).
pub(crate) async fn found_by_key(takeover: &Takeover) -> Result<Recovery<String>, Error> {
    ASKED.record(takeover.tenant(), takeover.attempt());
    if takeover.key().starts_with("unsure-") {
        let unreachable = StoreError::new("gateway", "look the charge up", "timed out");
        return Err(Error::Store(unreachable));
    }
    Ok(if takeover.key().starts_with("found-") {
        Recovery::Completed(format!("recovered {}", takeover.key()))
    } else {
        Recovery::Run
    })
}

#[idempotent(scope = "rtx.sqlite", key = key, tenant = tenant, tx = tx, recover = found_by_key)]
async fn sqlite_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
) -> Result<String, Error> {
    Ok(format!("ran {key}"))
}

#[idempotent(scope = "rtx.mysql", key = key, tenant = tenant, tx = tx, recover = found_by_key)]
async fn mysql_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
) -> Result<String, Error> {
    Ok(format!("ran {key}"))
}

#[idempotent(scope = "rtx.pg", key = key, tenant = tenant, tx = tx, recover = found_by_key)]
async fn pg_charge(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
) -> Result<String, Error> {
    Ok(format!("ran {key}"))
}

/// An in-progress record whose lease has run out, as a crashed owner leaves
/// it (lease zero, kept an hour).
pub(crate) async fn plant_stuck(store: &dyn Store, identity: &Identity) {
    let token = OwnerToken::new();
    let got = store
        .reserve(ReserveRequest {
            identity,
            fingerprint: None,
            token: &token,
            lease: Duration::ZERO,
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert_eq!(got, Reservation::FRESH);
}

pub(crate) fn tenant() -> String {
    format!("rtx-{}", uuid::Uuid::new_v4().simple())
}

pub(crate) async fn state(store: &dyn Store, identity: &Identity) -> (RecordState, u32, bool) {
    let s = store.fetch(identity).await.expect("fetch").expect("record");
    (s.state, s.attempt, s.recovered)
}

/// Rule 20 in a transaction: `found`'s and `missing`'s records (keys
/// `found-1`, `missing-1` of tenant `t`) are stuck. A takeover of `found` in
/// a transaction rolled back leaves the record as it was; committed, the
/// hook's answer is recorded (attempt 2, recovered), then replayed without
/// asking; the hook's `Run` for `missing` runs the body as attempt 2.
/// `begin` opens a transaction that takes over, `begin_replay` one that
/// replays.
macro_rules! the_hooks_answer_is_recorded_in_the_transaction {
    ($store:expr, $begin:expr, $begin_replay:expr, $charge:ident, $t:expr, $found:expr, $missing:expr) => {{
        let (store, t, found, missing) = (&$store, &$t, &$found, &$missing);

        // Rolled back: the takeover and the recorded answer vanish together.
        let mut tx = $begin(store).await;
        let (got, o) = with_outcome($charge(&mut tx, t, "found-1")).await;
        assert_eq!(
            (got.unwrap(), o),
            ("recovered found-1".to_owned(), Some(Outcome::Recovered))
        );
        tx.rollback().await.unwrap();
        assert_eq!(
            state(store, found).await,
            (RecordState::InProgress, 1, false)
        );

        // Committed: complete, attempt 2, recovered; then replayed.
        let mut tx = $begin(store).await;
        let (got, o) = with_outcome($charge(&mut tx, t, "found-1")).await;
        assert_eq!(
            (got.unwrap(), o),
            ("recovered found-1".to_owned(), Some(Outcome::Recovered))
        );
        tx.commit().await.unwrap();
        assert_eq!(state(store, found).await, (RecordState::Complete, 2, true));
        assert_eq!(asked(t), [2, 2], "asked as attempt 2, in both transactions");
        let mut tx = $begin_replay(store).await;
        let (got, o) = with_outcome($charge(&mut tx, t, "found-1")).await;
        assert_eq!(
            (got.unwrap(), o),
            ("recovered found-1".to_owned(), Some(Outcome::Replayed))
        );
        tx.commit().await.unwrap();
        assert_eq!(asked(t), [2, 2], "a replay does not ask");

        // Run: the body runs in the transaction, as attempt 2.
        let mut tx = $begin(store).await;
        let (got, o) = with_outcome($charge(&mut tx, t, "missing-1")).await;
        assert_eq!(
            (got.unwrap(), o),
            ("ran missing-1".to_owned(), Some(Outcome::Executed))
        );
        tx.commit().await.unwrap();
        assert_eq!(
            state(store, missing).await,
            (RecordState::Complete, 2, false)
        );
        assert_eq!(asked(t), [2, 2, 2]);
    }};
}
pub(crate) use the_hooks_answer_is_recorded_in_the_transaction;

#[tokio::test]
async fn sqlite_transaction_records_the_hooks_answer() {
    let store = SqliteStore::connect(&crate::common::scratch::sqlite_url("rtx"))
        .await
        .expect("sqlite");
    let t = tenant();
    let found = Identity::new(t.as_str(), "rtx.sqlite", "found-1").unwrap();
    let missing = Identity::new(t.as_str(), "rtx.sqlite", "missing-1").unwrap();
    plant_stuck(&store, &found).await;
    plant_stuck(&store, &missing).await;

    the_hooks_answer_is_recorded_in_the_transaction!(
        store,
        |s: &SqliteStore| {
            let pool = s.pool().clone();
            async move { pool.begin_with("BEGIN IMMEDIATE").await.unwrap() }
        },
        |s: &SqliteStore| {
            let pool = s.pool().clone();
            async move { pool.begin_with("BEGIN IMMEDIATE").await.unwrap() }
        },
        sqlite_charge,
        t,
        found,
        missing
    );
}

#[tokio::test]
async fn postgres_transaction_records_the_hooks_answer() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    let t = tenant();
    let found = Identity::new(t.as_str(), "rtx.pg", "found-1").unwrap();
    let missing = Identity::new(t.as_str(), "rtx.pg", "missing-1").unwrap();
    plant_stuck(&store, &found).await;
    plant_stuck(&store, &missing).await;

    let mut tx = store.pool().begin().await.unwrap();
    let (got, o) = with_outcome(pg_charge(&mut tx, &t, "found-1")).await;
    assert_eq!(
        (got.unwrap(), o),
        ("recovered found-1".to_owned(), Some(Outcome::Recovered))
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        state(&store, &found).await,
        (RecordState::InProgress, 1, false)
    );

    let mut tx = store.pool().begin().await.unwrap();
    let (got, o) = with_outcome(pg_charge(&mut tx, &t, "found-1")).await;
    assert_eq!(
        (got.unwrap(), o),
        ("recovered found-1".to_owned(), Some(Outcome::Recovered))
    );
    tx.commit().await.unwrap();
    assert_eq!(
        state(&store, &found).await,
        (RecordState::Complete, 2, true)
    );

    let mut tx = store.pool().begin().await.unwrap();
    let (got, o) = with_outcome(pg_charge(&mut tx, &t, "missing-1")).await;
    assert_eq!(
        (got.unwrap(), o),
        ("ran missing-1".to_owned(), Some(Outcome::Executed))
    );
    tx.commit().await.unwrap();
    assert_eq!(
        state(&store, &missing).await,
        (RecordState::Complete, 2, false)
    );
}

/// A hook that fails (its error released, the default) in a caller's
/// transaction that then commits: the record the takeover wrote stays in
/// progress with its lease *ended*, so the next call takes it over at once
/// and asks again (rule 20), as in store mode, instead of being refused as
/// in progress for a whole lease. The transactional calls are made by
/// `call`, on the store's pool; `begin` opens the transaction.
macro_rules! a_failing_hook_is_asked_again_at_once {
    ($store:expr, $begin:expr, $charge:ident, $scope:literal) => {{
        let store = $store;
        let t = tenant();
        let unsure = Identity::new(t.as_str(), $scope, "unsure-1").unwrap();
        plant_stuck(&store, &unsure).await;
        for attempt in [2, 3] {
            let mut tx = $begin(&store).await;
            let got = $charge(&mut tx, &t, "unsure-1").await;
            assert!(
                matches!(got, Err(Error::Store(_))),
                "attempt {attempt}: {got:?}"
            );
            tx.commit().await.unwrap();
            let snapshot = store.fetch(&unsure).await.unwrap().expect("record");
            assert_eq!(
                (snapshot.state, snapshot.attempt),
                (RecordState::InProgress, attempt),
                "kept for the next takeover"
            );
            assert!(
                snapshot.lease_expires_at_ms.expect("a lease") <= snapshot.now_ms,
                "attempt {attempt}: the lease was ended"
            );
        }
        assert_eq!(asked(&t), [2, 3], "asked again at once, as attempt 3");
    }};
}

#[tokio::test]
async fn sqlite_a_failing_hook_is_asked_again_at_once() {
    let store = SqliteStore::connect(&crate::common::scratch::sqlite_url("rtx"))
        .await
        .expect("sqlite");
    a_failing_hook_is_asked_again_at_once!(
        store,
        |s: &SqliteStore| {
            let pool = s.pool().clone();
            async move { pool.begin_with("BEGIN IMMEDIATE").await.unwrap() }
        },
        sqlite_charge,
        "rtx.sqlite"
    );
}

#[tokio::test]
async fn postgres_a_failing_hook_is_asked_again_at_once() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    a_failing_hook_is_asked_again_at_once!(
        store,
        |s: &idempotent_runtime::PgStore| {
            let pool = s.pool().clone();
            async move { pool.begin().await.unwrap() }
        },
        pg_charge,
        "rtx.pg"
    );
}

/// A MySQL transaction that takes over a lease planted to have run out: a
/// transaction takes over only a lease that ran out before the second it
/// began in (MySQL tells a transaction's start in whole seconds), so it
/// begins in the server's next second, on a connection of its own (below).
pub(crate) async fn mysql_begin_in_the_next_second(
    pool: sqlx::MySqlPool,
) -> sqlx::Transaction<'static, sqlx::MySql> {
    let now = || async {
        sqlx::query_scalar::<_, i64>("SELECT CAST(UNIX_TIMESTAMP() AS SIGNED)")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let second = now().await;
    tokio::time::timeout(Duration::from_secs(10), async {
        while now().await == second {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the server's clock moves on");
    // MySQL shows transactions (information_schema.INNODB_TRX) through a
    // cache that it refreshes only once nobody has read it for 0.1 s: while
    // other tests' calls read it (a cold CI run kept it stale for more than
    // 7 s), it may still show a pooled connection's previous transaction,
    // which gives the new one an older start, and the takeover is refused
    // as stale (README). A connection of its own has no earlier transaction
    // the cache could show: the cache shows this one, or none, and then the
    // other checks decide (README).
    let own = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let mut tx = own.begin().await.unwrap();
    // The transaction begins with its first statement.
    sqlx::query("SELECT 1 FROM idempotency_records LIMIT 1")
        .fetch_optional(&mut *tx)
        .await
        .unwrap();
    tx
}

#[tokio::test]
async fn mysql_a_failing_hook_is_asked_again_at_once() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    a_failing_hook_is_asked_again_at_once!(
        store,
        |s: &idempotent_runtime::MySqlStore| mysql_begin_in_the_next_second(s.pool().clone()),
        mysql_charge,
        "rtx.mysql"
    );
}

// ---- the shared namespace, a hook's error recorded, duplicates refused ----

/// A final answer a hook may give (recorded under `errors = record`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
enum Charged {
    Declined(String),
    Framework(String),
}

impl From<Error> for Charged {
    fn from(e: Error) -> Self {
        Charged::Framework(e.to_string())
    }
}

/// The card was declined, as the crashed attempt found: a final answer.
async fn declined(takeover: &Takeover) -> Result<Recovery<String>, Charged> {
    ASKED.record(&format!("shared {}", takeover.key()), takeover.attempt());
    Err(Charged::Declined(format!(
        "declined {} for {:?}",
        takeover.key(),
        takeover.tenant()
    )))
}

#[idempotent(scope = "rtx.shared_sqlite", key = key, tenant = shared, tx = tx, recover = declined,
             errors = record, in_progress = reject)]
async fn sqlite_shared(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    key: &str,
) -> Result<String, Charged> {
    Ok(format!("ran {key}"))
}

#[idempotent(scope = "rtx.shared_mysql", key = key, tenant = shared, tx = tx, recover = declined,
             errors = record, in_progress = reject)]
async fn mysql_shared(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    key: &str,
) -> Result<String, Charged> {
    Ok(format!("ran {key}"))
}

#[idempotent(scope = "rtx.shared_pg", key = key, tenant = shared, tx = tx, recover = declined,
             errors = record, in_progress = reject)]
async fn pg_shared(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    key: &str,
) -> Result<String, Charged> {
    Ok(format!("ran {key}"))
}

/// Rules 15 and 20 with `tenant = shared`, `errors = record` and
/// `in_progress = reject` in transactional mode: a takeover of a record of
/// the shared namespace asks the hook (its tenant the empty string), the
/// hook's error is recorded in the caller's transaction, undone with a
/// rollback (the next call is asked again, as the same attempt) and, once
/// committed, marked recovered and replayed without asking again.
macro_rules! a_hooks_recorded_error_in_the_shared_namespace {
    ($store:expr, $begin:expr, $charge:ident, $scope:literal) => {{
        let store = $store;
        let key = format!("declined-{}", uuid::Uuid::new_v4().simple());
        let asked = || asked(&format!("shared {key}"));
        let identity = Identity::shared($scope, key.as_str()).unwrap();
        plant_stuck(&store, &identity).await;
        let answer = Charged::Declined(format!("declined {key} for \"\""));

        let mut tx = $begin(&store).await;
        let (got, o) = with_outcome($charge(&mut tx, &key)).await;
        assert_eq!((got, o), (Err(answer.clone()), Some(Outcome::Recovered)));
        tx.rollback().await.unwrap();
        assert_eq!(
            state(&store, &identity).await,
            (RecordState::InProgress, 1, false),
            "rolled back with the transaction"
        );

        let mut tx = $begin(&store).await;
        let (got, o) = with_outcome($charge(&mut tx, &key)).await;
        assert_eq!((got, o), (Err(answer.clone()), Some(Outcome::Recovered)));
        tx.commit().await.unwrap();
        assert_eq!(
            state(&store, &identity).await,
            (RecordState::Complete, 2, true)
        );
        let recorded = store.fetch(&identity).await.unwrap().expect("record");
        assert!(
            recorded.outcome.is_some_and(|o| o.is_error),
            "the error is the answer"
        );
        assert_eq!(asked(), [2, 2], "asked as attempt 2 in both transactions");

        let mut tx = $begin(&store).await;
        let (got, o) = with_outcome($charge(&mut tx, &key)).await;
        assert_eq!((got, o), (Err(answer), Some(Outcome::Replayed)));
        tx.commit().await.unwrap();
        assert_eq!(asked(), [2, 2], "a replay does not ask");
    }};
}

#[tokio::test]
async fn sqlite_a_hooks_recorded_error_in_the_shared_namespace() {
    let store = SqliteStore::connect(&crate::common::scratch::sqlite_url("rtx"))
        .await
        .expect("sqlite");
    a_hooks_recorded_error_in_the_shared_namespace!(
        store,
        |s: &SqliteStore| {
            let pool = s.pool().clone();
            async move { pool.begin_with("BEGIN IMMEDIATE").await.unwrap() }
        },
        sqlite_shared,
        "rtx.shared_sqlite"
    );
}

#[tokio::test]
async fn postgres_a_hooks_recorded_error_in_the_shared_namespace() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    a_hooks_recorded_error_in_the_shared_namespace!(
        store,
        |s: &idempotent_runtime::PgStore| {
            let pool = s.pool().clone();
            async move { pool.begin().await.unwrap() }
        },
        pg_shared,
        "rtx.shared_pg"
    );
}

#[tokio::test]
async fn mysql_a_hooks_recorded_error_in_the_shared_namespace() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    a_hooks_recorded_error_in_the_shared_namespace!(
        store,
        |s: &idempotent_runtime::MySqlStore| mysql_begin_in_the_next_second(s.pool().clone()),
        mysql_shared,
        "rtx.shared_mysql"
    );
}
