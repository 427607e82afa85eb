//! Transactional mode (DESIGN.md rule 15) with the connections and
//! transaction shapes a user passes: one key called twice in one
//! transaction (also after its record expired), a nested transaction
//! (savepoint) rolled back while the outer one stays open, two tenants' calls
//! of one key in concurrent open transactions, and a takeover asked of the
//! `recover` hook (rule 20) inside a transaction, on PostgreSQL, MariaDB and
//! SQLite.

use crate::common;

use super::tx_fixtures::{
    four_duplicates_then_go, hold_here, lite, my, pg, ran, runs, Hold, Lite, My, Pg, LONG_AGO_MS,
};
use common::servers::fresh_tenant;
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, Outcome, OwnerToken, Recovery, Reservation,
    ReserveRequest, Store, Takeover,
};
use sqlx::{Connection, MySql, Postgres, Sqlite};
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

type Answer = Result<u64, Error>;

const PG_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_conn_charges (
    tenant TEXT NOT NULL, idem_key TEXT NOT NULL, amount BIGINT NOT NULL)";
const MY_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_conn_charges (
    tenant VARCHAR(100) NOT NULL, idem_key VARCHAR(255) NOT NULL, amount BIGINT NOT NULL)
    ENGINE = InnoDB";
const SQLITE_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_conn_charges (
    tenant TEXT NOT NULL, idem_key TEXT NOT NULL, amount INTEGER NOT NULL)";

// ---------------------------------------------------------------- the functions

#[idempotent(scope = "tx_conn.pg", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = reject, recover = look_up)]
async fn pg_charge(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    sqlx::query(
        "INSERT INTO idempotent_test_conn_charges (tenant, idem_key, amount) VALUES ($1, $2, $3)",
    )
    .bind(tenant)
    .bind(key)
    .bind(amount)
    .execute(&mut **tx)
    .await
    .expect("business write");
    hold_here(hold).await;
    Ok(amount as u64)
}

#[idempotent(scope = "tx_conn.mysql", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = reject, recover = look_up)]
async fn my_charge(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    sqlx::query(
        "INSERT INTO idempotent_test_conn_charges (tenant, idem_key, amount) VALUES (?, ?, ?)",
    )
    .bind(tenant)
    .bind(key)
    .bind(amount)
    .execute(&mut **tx)
    .await
    .expect("business write");
    hold_here(hold).await;
    Ok(amount as u64)
}

#[idempotent(scope = "tx_conn.sqlite", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = reject, recover = look_up)]
async fn sqlite_charge(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    sqlx::query(
        "INSERT INTO idempotent_test_conn_charges (tenant, idem_key, amount) VALUES (?1, ?2, ?3)",
    )
    .bind(tenant)
    .bind(key)
    .bind(amount)
    .execute(&mut **tx)
    .await
    .expect("business write");
    hold_here(hold).await;
    Ok(amount as u64)
}

/// What the hook was told, per tenant: (attempt, previous attempt's start).
type Asked = HashMap<String, Vec<(u32, i64)>>;
static ASKED: LazyLock<Mutex<Asked>> = LazyLock::new(Default::default);

/// The `recover` hook: notes what it was told; keys starting with `found-`
/// were charged by the previous attempt (recorded as 7), others run again.
async fn look_up(takeover: &Takeover) -> Result<Recovery<u64>, Error> {
    ASKED
        .lock()
        .unwrap()
        .entry(takeover.tenant().to_owned())
        .or_default()
        .push((
            takeover.attempt(),
            takeover.previous_attempt_started_at_ms(),
        ));
    Ok(if takeover.key().starts_with("found-") {
        Recovery::Completed(7)
    } else {
        Recovery::Run
    })
}

fn asked(tenant: &str) -> Vec<(u32, i64)> {
    ASKED
        .lock()
        .unwrap()
        .get(tenant)
        .cloned()
        .unwrap_or_default()
}

// ---------------------------------------------------------------- per database

/// One database's pool and store, the business rows and the raw statements a
/// test needs, so each scenario is written once.
trait Db: Sized + 'static {
    type D: sqlx::Database;
    const SCOPE: &'static str;
    fn store(&self) -> &dyn Store;
    fn pool(&self) -> &sqlx::Pool<Self::D>;
    async fn charge(
        tx: &mut sqlx::Transaction<'_, Self::D>,
        tenant: &str,
        key: &str,
        amount: i64,
        hold: Option<&Hold>,
    ) -> Answer;
    async fn rows(&self, tenant: &str) -> i64;
    /// Moves the expiry of the record (`tenant`, `scope`, `key`) to long ago.
    async fn expire_in(&self, tenant: &str, scope: &str, key: &str);
    async fn expire(&self, tenant: &str, key: &str) {
        self.expire_in(tenant, Self::SCOPE, key).await;
    }
}

impl Db for Pg {
    type D = Postgres;
    const SCOPE: &'static str = "tx_conn.pg";
    fn store(&self) -> &dyn Store {
        &self.0
    }
    fn pool(&self) -> &sqlx::PgPool {
        self.0.pool()
    }
    async fn charge(
        tx: &mut sqlx::Transaction<'_, Postgres>,
        tenant: &str,
        key: &str,
        amount: i64,
        hold: Option<&Hold>,
    ) -> Answer {
        pg_charge(tx, tenant, key, amount, hold).await
    }
    async fn rows(&self, tenant: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotent_test_conn_charges WHERE tenant = $1")
            .bind(tenant)
            .fetch_one(self.pool())
            .await
            .expect("count")
    }
    async fn expire_in(&self, tenant: &str, scope: &str, key: &str) {
        sqlx::query(
            "UPDATE idempotency_records SET expires_at = $4
              WHERE tenant = $1 AND scope = $2 AND key = $3",
        )
        .bind(tenant)
        .bind(scope)
        .bind(key)
        .bind(LONG_AGO_MS)
        .execute(self.pool())
        .await
        .expect("expire the record");
    }
}

impl Db for My {
    type D = MySql;
    const SCOPE: &'static str = "tx_conn.mysql";
    fn store(&self) -> &dyn Store {
        &self.0
    }
    fn pool(&self) -> &sqlx::MySqlPool {
        self.0.pool()
    }
    async fn charge(
        tx: &mut sqlx::Transaction<'_, MySql>,
        tenant: &str,
        key: &str,
        amount: i64,
        hold: Option<&Hold>,
    ) -> Answer {
        my_charge(tx, tenant, key, amount, hold).await
    }
    async fn rows(&self, tenant: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotent_test_conn_charges WHERE tenant = ?")
            .bind(tenant)
            .fetch_one(self.pool())
            .await
            .expect("count")
    }
    async fn expire_in(&self, tenant: &str, scope: &str, key: &str) {
        sqlx::query(
            "UPDATE idempotency_records SET expires_at = ?
              WHERE tenant = ? AND scope = ? AND `key` = ?",
        )
        .bind(LONG_AGO_MS)
        .bind(tenant)
        .bind(scope)
        .bind(key)
        .execute(self.pool())
        .await
        .expect("expire the record");
    }
}

impl Db for Lite {
    type D = Sqlite;
    const SCOPE: &'static str = "tx_conn.sqlite";
    fn store(&self) -> &dyn Store {
        &self.0
    }
    fn pool(&self) -> &sqlx::SqlitePool {
        self.0.pool()
    }
    async fn charge(
        tx: &mut sqlx::Transaction<'_, Sqlite>,
        tenant: &str,
        key: &str,
        amount: i64,
        hold: Option<&Hold>,
    ) -> Answer {
        sqlite_charge(tx, tenant, key, amount, hold).await
    }
    async fn rows(&self, tenant: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotent_test_conn_charges WHERE tenant = ?1")
            .bind(tenant)
            .fetch_one(self.pool())
            .await
            .expect("count")
    }
    async fn expire_in(&self, tenant: &str, scope: &str, key: &str) {
        sqlx::query(
            "UPDATE idempotency_records SET expires_at = ?4
              WHERE tenant = ?1 AND scope = ?2 AND key = ?3",
        )
        .bind(tenant)
        .bind(scope)
        .bind(key)
        .bind(LONG_AGO_MS)
        .execute(self.pool())
        .await
        .expect("expire the record");
    }
}

fn id<B: Db>(tenant: &str, key: &str) -> Identity {
    Identity::new(tenant, B::SCOPE, key).expect("identity")
}

// ---------------------------------------------------------------- one key twice in one transaction

/// Rules 5, 7 and 15: the same key called again inside the transaction that
/// recorded it (not committed yet) replays what it recorded, and with other
/// arguments is a mismatch; the body runs once. `expired_first`: the key's
/// committed record has expired, so the first call takes it over in the
/// transaction and the second must see that, not the expired record.
async fn twice_in_one_transaction<B: Db>(db: &B, expired_first: bool) {
    let tenant = fresh_tenant();
    if expired_first {
        let mut tx = db.pool().begin().await.expect("begin");
        assert_eq!(
            B::charge(&mut tx, &tenant, "k", 500, None)
                .await
                .expect("runs"),
            500
        );
        tx.commit().await.expect("commit");
        db.expire(&tenant, "k").await;
    }
    let mut tx = db.pool().begin().await.expect("begin");
    let (first, outcome) = with_outcome(B::charge(&mut tx, &tenant, "k", 500, None)).await;
    assert_eq!(
        (first.expect("runs"), outcome),
        (500, Some(Outcome::Executed))
    );
    let (second, outcome) = with_outcome(B::charge(&mut tx, &tenant, "k", 500, None)).await;
    assert_eq!(
        (second.expect("replays"), outcome),
        (500, Some(Outcome::Replayed)),
        "the second call in the transaction replays its first"
    );
    let other = B::charge(&mut tx, &tenant, "k", 700, None).await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch { .. })),
        "other arguments in the same transaction: {other:?}"
    );
    tx.commit().await.expect("commit");
    let before = i64::from(expired_first);
    assert_eq!(
        db.rows(&tenant).await,
        before + 1,
        "the body ran once in the transaction"
    );
    let mut tx = db.pool().begin().await.expect("begin");
    let (again, outcome) = with_outcome(B::charge(&mut tx, &tenant, "k", 500, None)).await;
    assert_eq!(
        (again.expect("replays"), outcome),
        (500, Some(Outcome::Replayed))
    );
    tx.commit().await.expect("commit");
    assert_eq!(db.rows(&tenant).await, before + 1);
}

#[tokio::test]
async fn pg_a_key_called_twice_in_one_transaction_runs_its_body_once() {
    let Some(db) = pg(PG_DDL).await else { return };
    twice_in_one_transaction(&db, false).await;
    twice_in_one_transaction(&db, true).await;
}

#[tokio::test]
async fn mysql_a_key_called_twice_in_one_transaction_runs_its_body_once() {
    let Some(db) = my(MY_DDL).await else { return };
    twice_in_one_transaction(&db, false).await;
    twice_in_one_transaction(&db, true).await;
}

#[tokio::test]
async fn sqlite_a_key_called_twice_in_one_transaction_runs_its_body_once() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    twice_in_one_transaction(&db, false).await;
    twice_in_one_transaction(&db, true).await;
}

// ---------------------------------------------------------------- a rolled-back savepoint

/// A call in a nested transaction (sqlx's `begin()` on a transaction: a
/// savepoint) that is rolled back takes its reservation with it: while the
/// outer transaction stays open, another caller's transaction finds the key
/// free and runs it (`in_progress = reject`: not refused as in progress);
/// the outer transaction then finds it recorded and replays. One business
/// row in the end.
async fn a_rolled_back_savepoint_frees_the_key_for_others<B: Db>(db: &B) {
    let tenant = fresh_tenant();
    let mut outer = db.pool().begin().await.expect("begin");
    {
        let mut inner = outer.begin().await.expect("savepoint");
        assert_eq!(
            B::charge(&mut inner, &tenant, "sp", 500, None)
                .await
                .expect("runs"),
            500
        );
        inner.rollback().await.expect("rollback to savepoint");
    }
    let mut other = db.pool().begin().await.expect("begin");
    let (answer, outcome) = with_outcome(B::charge(&mut other, &tenant, "sp", 500, None)).await;
    assert_eq!(
        (answer.expect("the key is free"), outcome),
        (500, Some(Outcome::Executed)),
        "the rolled-back savepoint's reservation is gone for others too"
    );
    other.commit().await.expect("commit");
    let (answer, outcome) = with_outcome(B::charge(&mut outer, &tenant, "sp", 500, None)).await;
    // PostgreSQL READ COMMITTED sees the other's commit; MariaDB's snapshot
    // (REPEATABLE READ, taken before it) does not, and is refused rather
    // than running the body again.
    match answer {
        Ok(v) => assert_eq!((v, outcome), (500, Some(Outcome::Replayed))),
        Err(Error::StaleSnapshot { .. }) => {}
        Err(e) => panic!("the outer transaction's call: {e:?}"),
    }
    outer.commit().await.expect("commit");
    assert_eq!(db.rows(&tenant).await, 1, "one business row");
    assert!(db
        .store()
        .fetch(&id::<B>(&tenant, "sp"))
        .await
        .expect("fetch")
        .is_some_and(|s| s.state == idempotent_runtime::RecordState::Complete));
}

#[tokio::test]
async fn pg_a_rolled_back_savepoint_frees_the_key_for_other_transactions() {
    let Some(db) = pg(PG_DDL).await else { return };
    a_rolled_back_savepoint_frees_the_key_for_others(&db).await;
}

#[tokio::test]
async fn mysql_a_rolled_back_savepoint_frees_the_key_for_other_transactions() {
    let Some(db) = my(MY_DDL).await else { return };
    a_rolled_back_savepoint_frees_the_key_for_others(&db).await;
}

/// SQLite: the outer transaction keeps the database's write lock after the
/// savepoint rolls back, so the key is tried again in the outer transaction
/// (free: it runs) and after it commits (it replays).
#[tokio::test]
async fn sqlite_a_rolled_back_savepoint_takes_the_record_with_it() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    let tenant = fresh_tenant();
    let mut outer = db.pool().begin().await.expect("begin");
    {
        let mut inner = outer.begin().await.expect("savepoint");
        assert_eq!(
            Lite::charge(&mut inner, &tenant, "sp", 500, None)
                .await
                .expect("runs"),
            500
        );
        inner.rollback().await.expect("rollback to savepoint");
    }
    let (answer, outcome) = with_outcome(Lite::charge(&mut outer, &tenant, "sp", 500, None)).await;
    assert_eq!(
        (answer.expect("runs"), outcome),
        (500, Some(Outcome::Executed))
    );
    outer.commit().await.expect("commit");
    let mut tx = db.pool().begin().await.expect("begin");
    let (answer, outcome) = with_outcome(Lite::charge(&mut tx, &tenant, "sp", 500, None)).await;
    assert_eq!(
        (answer.expect("replays"), outcome),
        (500, Some(Outcome::Replayed))
    );
    tx.commit().await.expect("commit");
    assert_eq!(db.rows(&tenant).await, 1);
}

// ---------------------------------------------------------------- tenants

/// Rule 1 in transactional mode: tenant A's call of key `k` holds its body
/// open in its transaction; tenant B's call of the same key in another
/// transaction is not refused as in progress (`reject`) and runs; each
/// tenant then replays its own answer, never the other's.
async fn one_key_two_tenants<B: Db>(db: &B) {
    let a = fresh_tenant();
    let b = fresh_tenant();
    let hold = Hold::default();
    let owner = async {
        let mut tx = db.pool().begin().await.expect("begin");
        let answer = B::charge(&mut tx, &a, "k", 100, Some(&hold)).await;
        tx.commit().await.expect("commit");
        answer
    };
    let other = async {
        hold.reached.notified().await;
        let mut tx = db.pool().begin().await.expect("begin");
        let answer = with_outcome(B::charge(&mut tx, &b, "k", 200, None)).await;
        tx.commit().await.expect("commit");
        hold.go.notify_one();
        answer
    };
    let (owner, (other, outcome)) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(owner, other)
    })
    .await
    .expect("neither tenant waits for the other");
    assert_eq!(owner.expect("tenant a runs"), 100);
    assert_eq!(
        (other.expect("tenant b runs, not in progress"), outcome),
        (200, Some(Outcome::Executed))
    );
    for (tenant, amount) in [(&a, 100), (&b, 200)] {
        let mut tx = db.pool().begin().await.expect("begin");
        let (answer, outcome) = with_outcome(B::charge(&mut tx, tenant, "k", amount, None)).await;
        assert_eq!(
            (answer.expect("replays"), outcome),
            (amount as u64, Some(Outcome::Replayed))
        );
        tx.commit().await.expect("commit");
        assert_eq!(db.rows(tenant).await, 1);
    }
}

#[tokio::test]
async fn pg_one_key_of_two_tenants_in_open_transactions_is_two_records() {
    let Some(db) = pg(PG_DDL).await else { return };
    one_key_two_tenants(&db).await;
}

#[tokio::test]
async fn mysql_one_key_of_two_tenants_in_open_transactions_is_two_records() {
    let Some(db) = my(MY_DDL).await else { return };
    one_key_two_tenants(&db).await;
}

// ---------------------------------------------------------------- rule 20 in a transaction

/// Plants an in-progress record whose lease has already run out, as a
/// crashed store-mode owner leaves it; answers when its attempt started.
async fn plant_stuck(store: &dyn Store, identity: &Identity) -> i64 {
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
    let s = store.fetch(identity).await.expect("fetch").expect("record");
    s.attempt_started_at_ms
}

/// Calls `key` in a new transaction, again in another one while refused
/// with `StaleSnapshot` (MariaDB refuses a takeover of a lease that ran out
/// in the second its transaction began; the README's remedy is a new
/// transaction). Bounded: 50 transactions.
async fn in_a_new_transaction<'p, B: Db>(
    db: &'p B,
    tenant: &str,
    key: &str,
) -> (u64, Option<Outcome>, sqlx::Transaction<'p, B::D>) {
    for _ in 0..50 {
        let mut tx = db.pool().begin().await.expect("begin");
        match with_outcome(B::charge(&mut tx, tenant, key, 500, None)).await {
            (Ok(v), outcome) => return (v, outcome, tx),
            (Err(Error::StaleSnapshot { .. }), _) => {
                tx.rollback().await.expect("rollback");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (Err(e), _) => panic!("{key}: {e:?}"),
        }
    }
    panic!("{key}: refused as stale in 50 transactions");
}

/// Rule 20 in transactional mode: a transaction that takes a stuck record
/// over asks the hook with attempt 2 and the start of the attempt it takes
/// over (not its own start, nor zero); a transaction rolled back takes the
/// takeover with it, so the next one is told the same; `Completed` is
/// recorded without running the body, `Run` runs it once.
async fn a_takeover_in_a_transaction_tells_the_hook_the_previous_start<B: Db>(db: &B) {
    let tenant = fresh_tenant();
    let found = id::<B>(&tenant, "found-1");
    let missing = id::<B>(&tenant, "missing-1");
    let found_started = plant_stuck(db.store(), &found).await;
    let missing_started = plant_stuck(db.store(), &missing).await;

    let (answer, _, tx) = in_a_new_transaction(db, &tenant, "found-1").await;
    assert_eq!(answer, 7, "recovered");
    tx.rollback().await.expect("rollback");
    let (answer, outcome, tx) = in_a_new_transaction(db, &tenant, "found-1").await;
    assert_eq!((answer, outcome), (7, Some(Outcome::Recovered)));
    tx.commit().await.expect("commit");
    let (answer, outcome, tx) = in_a_new_transaction(db, &tenant, "missing-1").await;
    assert_eq!((answer, outcome), (500, Some(Outcome::Executed)));
    tx.commit().await.expect("commit");

    assert_eq!(
        asked(&tenant),
        [(2, found_started), (2, found_started), (2, missing_started)],
        "each takeover told attempt 2 and when the planted attempt started"
    );
    assert_eq!(db.rows(&tenant).await, 1, "only `Run` ran the body");
    let s = db
        .store()
        .fetch(&found)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!((s.attempt, s.recovered), (2, true));
}

#[tokio::test]
async fn pg_a_takeover_in_a_transaction_tells_the_hook_when_the_previous_attempt_started() {
    let Some(db) = pg(PG_DDL).await else { return };
    a_takeover_in_a_transaction_tells_the_hook_the_previous_start(&db).await;
}

#[tokio::test]
async fn mysql_a_takeover_in_a_transaction_tells_the_hook_when_the_previous_attempt_started() {
    let Some(db) = my(MY_DDL).await else { return };
    a_takeover_in_a_transaction_tells_the_hook_the_previous_start(&db).await;
}

#[tokio::test]
async fn sqlite_a_takeover_in_a_transaction_tells_the_hook_when_the_previous_attempt_started() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    a_takeover_in_a_transaction_tells_the_hook_the_previous_start(&db).await;
}

// ---------------------------------------------------------------- rule 16: a live lease past its ttl

/// Rules 4 and 16 in transactional mode: a store-mode owner whose body has
/// outlived the record's ttl while its lease is live (planted: a 1 ms ttl,
/// an hour's lease) is in progress to a transactional call of its key, which
/// is refused (`reject`) and does not run the body beside it; the owner's
/// record is untouched.
async fn a_live_lease_past_its_ttl_is_in_progress<B: Db>(db: &B) {
    let tenant = fresh_tenant();
    let identity = id::<B>(&tenant, "k");
    let owner = OwnerToken::new();
    let got = db
        .store()
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &owner,
            lease: Duration::from_secs(3600),
            ttl: Duration::from_millis(1),
        })
        .await
        .expect("plant");
    assert_eq!(got, Reservation::FRESH);
    for i in 0.. {
        let s = db
            .store()
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        if s.expires_at_ms < s.now_ms {
            break;
        }
        assert!(i < 500, "the ttl did not run out within 5 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut tx = db.pool().begin().await.expect("begin");
    let answer = B::charge(&mut tx, &tenant, "k", 500, None).await;
    tx.commit().await.expect("commit");
    assert!(
        matches!(answer, Err(Error::InProgress { .. })),
        "a live owner past its ttl is in progress: {answer:?}"
    );
    assert_eq!(
        db.rows(&tenant).await,
        0,
        "the body did not run beside the owner"
    );
    let s = db
        .store()
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(s.owner_token.as_deref(), Some(owner.as_str()));
}

#[tokio::test]
async fn pg_a_live_lease_past_its_ttl_is_in_progress_to_a_transactional_call() {
    let Some(db) = pg(PG_DDL).await else { return };
    a_live_lease_past_its_ttl_is_in_progress(&db).await;
}

#[tokio::test]
async fn mysql_a_live_lease_past_its_ttl_is_in_progress_to_a_transactional_call() {
    let Some(db) = my(MY_DDL).await else { return };
    a_live_lease_past_its_ttl_is_in_progress(&db).await;
}

#[tokio::test]
async fn sqlite_a_live_lease_past_its_ttl_is_in_progress_to_a_transactional_call() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    a_live_lease_past_its_ttl_is_in_progress(&db).await;
}

// ---------------------------------------------------------------- nested calls in one transaction

#[idempotent(scope = "tx_conn.pg_checkout", key = order, tenant = tenant, tx = tx, ttl = "1h",
             in_progress = reject)]
async fn pg_checkout(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    order: &str,
) -> Result<u64, Error> {
    let a = pg_charge(tx, tenant, &format!("{order}-a"), 100, None).await?;
    let b = pg_charge(tx, tenant, &format!("{order}-b"), 200, None).await?;
    Ok(a + b)
}

#[idempotent(scope = "tx_conn.my_checkout", key = order, tenant = tenant, tx = tx, ttl = "1h",
             in_progress = reject)]
async fn my_checkout(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    order: &str,
) -> Result<u64, Error> {
    let a = my_charge(tx, tenant, &format!("{order}-a"), 100, None).await?;
    let b = my_charge(tx, tenant, &format!("{order}-b"), 200, None).await?;
    Ok(a + b)
}

#[idempotent(scope = "tx_conn.sqlite_checkout", key = order, tenant = tenant, tx = tx, ttl = "1h",
             in_progress = reject)]
async fn sqlite_checkout(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    order: &str,
) -> Result<u64, Error> {
    let a = sqlite_charge(tx, tenant, &format!("{order}-a"), 100, None).await?;
    let b = sqlite_charge(tx, tenant, &format!("{order}-b"), 200, None).await?;
    Ok(a + b)
}

/// A transactional function whose body calls two others on the same
/// transaction: rolled back, none of the three records stays and the next
/// transaction runs all three bodies; committed, a retry replays the outer
/// answer and a direct call of an inner key replays too. Two business rows.
macro_rules! nested_in_one_transaction {
    ($db:expr, $checkout:ident, $charge:ident) => {{
        let db = $db;
        let tenant = fresh_tenant();
        for commit in [false, true] {
            let mut tx = db.pool().begin().await.expect("begin");
            let (answer, outcome) = with_outcome($checkout(&mut tx, &tenant, "o1")).await;
            assert_eq!(
                (answer.expect("runs"), outcome),
                (300, Some(Outcome::Executed))
            );
            if commit {
                tx.commit().await.expect("commit");
            } else {
                tx.rollback().await.expect("rollback");
                assert_eq!(db.rows(&tenant).await, 0);
            }
        }
        let mut tx = db.pool().begin().await.expect("begin");
        let (answer, outcome) = with_outcome($checkout(&mut tx, &tenant, "o1")).await;
        assert_eq!(
            (answer.expect("replays"), outcome),
            (300, Some(Outcome::Replayed))
        );
        let (answer, outcome) = with_outcome($charge(&mut tx, &tenant, "o1-b", 200, None)).await;
        assert_eq!(
            (answer.expect("replays"), outcome),
            (200, Some(Outcome::Replayed))
        );
        tx.commit().await.expect("commit");
        assert_eq!(db.rows(&tenant).await, 2, "each inner body ran once");
    }};
}

#[tokio::test]
async fn pg_calls_nested_in_one_transaction_commit_and_roll_back_together() {
    let Some(db) = pg(PG_DDL).await else { return };
    nested_in_one_transaction!(&db, pg_checkout, pg_charge);
}

#[tokio::test]
async fn mysql_calls_nested_in_one_transaction_commit_and_roll_back_together() {
    let Some(db) = my(MY_DDL).await else { return };
    nested_in_one_transaction!(&db, my_checkout, my_charge);
}

#[tokio::test]
async fn sqlite_calls_nested_in_one_transaction_commit_and_roll_back_together() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    nested_in_one_transaction!(&db, sqlite_checkout, sqlite_charge);
}

// ---------------------------------------------------------------- read-only transactions

/// MariaDB, a read-only transaction (`START TRANSACTION READ ONLY`), as
/// PostgreSQL's is documented: a recorded key replays, a live owner's key is
/// refused as in progress, a mismatch is a mismatch; a fresh key, which
/// would have to be written, fails before the body runs, and the
/// transaction stays usable; in a writable transaction it then runs once.
#[tokio::test]
async fn mysql_a_read_only_transaction_replays_and_refuses_what_it_cannot_write() {
    let Some(db) = my(MY_DDL).await else { return };
    let tenant = fresh_tenant();
    let mut tx = db.pool().begin().await.expect("begin");
    assert_eq!(
        My::charge(&mut tx, &tenant, "done", 500, None)
            .await
            .expect("runs"),
        500
    );
    tx.commit().await.expect("commit");
    let live = id::<My>(&tenant, "live");
    let got = db
        .store()
        .reserve(ReserveRequest {
            identity: &live,
            fingerprint: None,
            token: &OwnerToken::new(),
            lease: Duration::from_secs(3600),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("plant a live owner");
    assert_eq!(got, Reservation::FRESH);

    let mut tx = db
        .pool()
        .begin_with("START TRANSACTION READ ONLY")
        .await
        .expect("begin read only");
    let (answer, outcome) = with_outcome(My::charge(&mut tx, &tenant, "done", 500, None)).await;
    assert_eq!(
        (answer.expect("replays"), outcome),
        (500, Some(Outcome::Replayed))
    );
    let mismatch = My::charge(&mut tx, &tenant, "done", 900, None).await;
    assert!(
        matches!(mismatch, Err(Error::FingerprintMismatch { .. })),
        "{mismatch:?}"
    );
    let busy = My::charge(&mut tx, &tenant, "live", 500, None).await;
    assert!(matches!(busy, Err(Error::InProgress { .. })), "{busy:?}");
    let fresh = My::charge(&mut tx, &tenant, "fresh", 500, None).await;
    assert!(fresh.is_err(), "a fresh key cannot be written: {fresh:?}");
    let one: i64 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *tx)
        .await
        .expect("the transaction stays usable");
    assert_eq!(one, 1);
    tx.commit().await.expect("commit");
    assert_eq!(db.rows(&tenant).await, 1);
    assert!(db
        .store()
        .fetch(&id::<My>(&tenant, "fresh"))
        .await
        .expect("fetch")
        .is_none());

    let mut tx = db.pool().begin().await.expect("begin");
    let (answer, outcome) = with_outcome(My::charge(&mut tx, &tenant, "fresh", 500, None)).await;
    assert_eq!(
        (answer.expect("runs"), outcome),
        (500, Some(Outcome::Executed))
    );
    tx.commit().await.expect("commit");
    assert_eq!(db.rows(&tenant).await, 2);
}

// ---------------------------------------------------------------- answers that keep no lock, per isolation level

#[idempotent(scope = "tx_conn.shared_pg", key = key, tenant = tenant, store = store, skip(hold),
             shared_scope, ttl = "1h", in_progress = reject)]
async fn pg_shared_store(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(amount as u64)
}

#[idempotent(scope = "tx_conn.shared_pg", key = key, tenant = tenant, tx = tx, skip(hold),
             shared_scope, ttl = "1h", in_progress = reject)]
async fn pg_shared_tx(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(amount as u64)
}

#[idempotent(scope = "tx_conn.shared_my", key = key, tenant = tenant, store = store, skip(hold),
             shared_scope, ttl = "1h", in_progress = reject)]
async fn my_shared_store(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(amount as u64)
}

#[idempotent(scope = "tx_conn.shared_my", key = key, tenant = tenant, tx = tx, skip(hold),
             shared_scope, ttl = "1h", in_progress = reject)]
async fn my_shared_tx(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(amount as u64)
}

/// Rule 15 at a chosen isolation level: a transaction that was refused as in
/// progress (key `busy`, a store-mode owner at work), was given a replay and
/// a mismatch (key `done`), and stays open, holds nothing: the owner records
/// its result meanwhile, a store-mode call of `busy` then replays it, and
/// another transaction at the same level replays `done` (not refused as in
/// progress).
macro_rules! answers_keep_no_lock {
    ($db:expr, $begin:expr, $store_fn:ident, $tx_fn:ident) => {{
        let db = $db;
        let begin: &str = $begin;
        let tenant = fresh_tenant();
        let mut tx = db.pool().begin().await.expect("begin");
        assert_eq!(
            $tx_fn(&mut tx, &tenant, "done", 5, None)
                .await
                .expect("runs"),
            5
        );
        tx.commit().await.expect("commit");
        let hold = Hold::default();
        let owner = $store_fn(db.store(), &tenant, "busy", 7, Some(&hold));
        let others = async {
            hold.reached.notified().await;
            let mut open = db.pool().begin_with(begin.to_owned()).await.expect("begin");
            let busy = $tx_fn(&mut open, &tenant, "busy", 7, None).await;
            assert!(
                matches!(busy, Err(Error::InProgress { .. })),
                "{begin}: {busy:?}"
            );
            let (done, outcome) = with_outcome($tx_fn(&mut open, &tenant, "done", 5, None)).await;
            assert_eq!(
                (done.expect("replays"), outcome),
                (5, Some(Outcome::Replayed)),
                "{begin}"
            );
            let other = $tx_fn(&mut open, &tenant, "done", 6, None).await;
            assert!(
                matches!(other, Err(Error::FingerprintMismatch { .. })),
                "{begin}: {other:?}"
            );
            hold.go.notify_one();
            let mut next = db.pool().begin_with(begin.to_owned()).await.expect("begin");
            let (done, outcome) = with_outcome($tx_fn(&mut next, &tenant, "done", 5, None)).await;
            next.commit().await.expect("commit");
            (open, done, outcome)
        };
        let (owned, (open, done, outcome)) = tokio::time::timeout(Duration::from_secs(60), async {
            tokio::join!(owner, others)
        })
        .await
        .unwrap_or_else(|_| {
            panic!("{begin}: the owner or a replay waited for the open transaction")
        });
        assert_eq!(owned.expect("the owner records its result"), 7, "{begin}");
        assert_eq!(
            (done.expect("replays"), outcome),
            (5, Some(Outcome::Replayed)),
            "{begin}"
        );
        let (busy, outcome) = with_outcome($store_fn(db.store(), &tenant, "busy", 7, None)).await;
        assert_eq!(
            (busy.expect("replays"), outcome),
            (7, Some(Outcome::Replayed)),
            "{begin}"
        );
        open.rollback().await.expect("rollback");
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_answers_in_an_open_transaction_keep_no_lock_at_every_isolation_level() {
    let Some(db) = pg(PG_DDL).await else { return };
    for begin in [
        "BEGIN ISOLATION LEVEL READ COMMITTED",
        "BEGIN ISOLATION LEVEL REPEATABLE READ",
        "BEGIN ISOLATION LEVEL SERIALIZABLE",
    ] {
        answers_keep_no_lock!(&db, begin, pg_shared_store, pg_shared_tx);
    }
}

/// MariaDB at READ COMMITTED and REPEATABLE READ (under SERIALIZABLE every
/// read locks, and the README tells such transactions to roll back at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_answers_in_an_open_transaction_keep_no_lock_below_serializable() {
    let Some(db) = my(MY_DDL).await else { return };
    for begin in [
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION",
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; START TRANSACTION",
    ] {
        answers_keep_no_lock!(&db, begin, my_shared_store, my_shared_tx);
    }
}

// ---------------------------------------------------------------- a held answer recorded in a transaction that rolls back

static HELD_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[idempotent(scope = "tx_conn.held_answer", key = key, tenant = tenant, store = store,
             shared_scope, fingerprint = false, ttl = "1h", lease = "300ms")]
async fn held_in_store_mode(
    store: &idempotent_runtime::SqliteStore,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    HELD_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Ok(7)
}

#[idempotent(scope = "tx_conn.held_answer", key = key, tenant = tenant, tx = tx,
             shared_scope, fingerprint = false, ttl = "1h", lease = "300ms")]
async fn held_in_tx(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    HELD_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Ok(7)
}

/// An answer this process produced in store mode and could not record is
/// recorded by a transactional takeover; that transaction rolls back, taking
/// the recorded answer with it. The answer is still held: the next
/// transaction's takeover records it again, and the body never runs a
/// second time.
#[tokio::test]
async fn sqlite_a_held_answer_recorded_in_a_rolled_back_transaction_is_still_held() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    let pool = db.pool().clone();
    // The first attempt's completion fails; a takeover's goes through.
    sqlx::query(
        "CREATE TRIGGER fail_first_completion BEFORE UPDATE ON idempotency_records
         WHEN NEW.state = 'complete' AND OLD.previous_attempt_started_at IS NULL
         BEGIN SELECT RAISE(ABORT, 'the store is down'); END",
    )
    .execute(&pool)
    .await
    .expect("trigger");
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "tx_conn.held_answer", "k").expect("identity");
    let _ = held_in_store_mode(&db.0, &tenant, "k").await;
    assert_eq!(HELD_RUNS.load(std::sync::atomic::Ordering::SeqCst), 1);
    for i in 0.. {
        let s = db
            .store()
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        assert_eq!(
            s.state,
            idempotent_runtime::RecordState::InProgress,
            "not recorded"
        );
        if s.lease_expires_at_ms.expect("a lease") <= s.now_ms {
            break;
        }
        assert!(i < 200, "the lease never ran out");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for commit in [false, true] {
        let mut tx = pool.begin().await.expect("begin");
        let answer = held_in_tx(&mut tx, &tenant, "k").await;
        assert_eq!(answer.expect("the held answer"), 7, "commit = {commit}");
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
        assert_eq!(
            HELD_RUNS.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "commit = {commit}: the body ran again although this process held its answer"
        );
    }
    let s = db
        .store()
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!(s.state, idempotent_runtime::RecordState::Complete);
}

// ---------------------------------------------------------------- SQLite: every way to begin, every journal

/// SQLite, a transaction begun with `begin` on a file in the journal mode
/// given (a pool of the application's, `from_pool`): a fresh key runs, a
/// recorded key replays and other arguments are a mismatch, each answered
/// (bounded: nothing waits for a lock the transaction itself holds), and a
/// retry after the commit replays.
async fn sqlite_begun_with(begin: &'static str, wal: bool) {
    let dir = common::scratch::dir("tx-conn-begin");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.join("db.sqlite"))
        .create_if_missing(true)
        .journal_mode(if wal {
            sqlx::sqlite::SqliteJournalMode::Wal
        } else {
            sqlx::sqlite::SqliteJournalMode::Delete
        })
        .busy_timeout(Duration::from_secs(5));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool");
    let store = idempotent_runtime::SqliteStore::from_pool(pool.clone())
        .await
        .expect("from_pool");
    sqlx::query(SQLITE_DDL).execute(&pool).await.expect("ddl");
    let tenant = fresh_tenant();
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        sqlite_charge(&mut tx, &tenant, "done", 5, None)
            .await
            .expect("runs"),
        5
    );
    tx.commit().await.expect("commit");

    let what = format!("{begin}, wal = {wal}");
    let answers = tokio::time::timeout(Duration::from_secs(60), async {
        let mut tx = pool.begin_with(begin).await.expect("begin");
        let done = with_outcome(sqlite_charge(&mut tx, &tenant, "done", 5, None)).await;
        let other = sqlite_charge(&mut tx, &tenant, "done", 6, None).await;
        let fresh = with_outcome(sqlite_charge(&mut tx, &tenant, "fresh", 9, None)).await;
        tx.commit().await.expect("commit");
        (done, other, fresh)
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: a call waited for its own transaction's lock"));
    let (done, other, fresh) = answers;
    assert_eq!(
        (done.0.expect("replays"), done.1),
        (5, Some(Outcome::Replayed)),
        "{what}"
    );
    assert!(
        matches!(other, Err(Error::FingerprintMismatch { .. })),
        "{what}: {other:?}"
    );
    assert_eq!(
        (fresh.0.expect("runs"), fresh.1),
        (9, Some(Outcome::Executed)),
        "{what}"
    );
    let mut tx = pool.begin().await.expect("begin");
    let again = with_outcome(sqlite_charge(&mut tx, &tenant, "fresh", 9, None)).await;
    tx.commit().await.expect("commit");
    assert_eq!(
        (again.0.expect("replays"), again.1),
        (9, Some(Outcome::Replayed)),
        "{what}"
    );
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotent_test_conn_charges WHERE tenant = ?1")
            .bind(&tenant)
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(rows, 2, "{what}");
    drop(store);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_exclusive_transaction_on_a_rollback_journal_is_answered() {
    sqlite_begun_with("BEGIN EXCLUSIVE", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_immediate_transaction_on_a_rollback_journal_is_answered() {
    sqlite_begun_with("BEGIN IMMEDIATE", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_exclusive_transaction_in_wal_mode_is_answered() {
    sqlite_begun_with("BEGIN EXCLUSIVE", true).await;
}

// ---------------------------------------------------------------- an owner's transaction dropped with waiters

macro_rules! waited_pair {
    ($db:ty, $scope:literal, $store_fn:ident, $tx_fn:ident) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, store = store, shared_scope,
                                             ttl = "1h", in_progress = wait("20s"))]
        async fn $store_fn(store: &dyn Store, tenant: &str, key: &str) -> Result<u64, Error> {
            Ok(u64::from(ran(tenant)))
        }

        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(hold),
                                             shared_scope, ttl = "1h", in_progress = wait("20s"))]
        async fn $tx_fn(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            hold: Option<&Hold>,
        ) -> Result<u64, Error> {
            let n = ran(tenant);
            hold_here(hold).await;
            Ok(u64::from(n))
        }
    };
}

waited_pair!(
    Postgres,
    "tx_conn.dropped_pg",
    pg_waited_store,
    pg_waited_tx
);
waited_pair!(MySql, "tx_conn.dropped_my", my_waited_store, my_waited_tx);
waited_pair!(
    Sqlite,
    "tx_conn.dropped_sqlite",
    sqlite_waited_store,
    sqlite_waited_tx
);

/// Rule 15: a transactional owner's call has answered (its record complete
/// in its transaction, not committed) when four store-mode duplicates begin
/// to wait for it; then its transaction is dropped, neither committed nor
/// rolled back (sqlx rolls it back as the connection goes back to the
/// pool). The key goes to one duplicate, which runs the body; the other
/// three replay its answer; nobody is told of a deadlock or waits forever.
macro_rules! owner_dropped_with_waiters {
    ($db:expr, $store_fn:ident, $tx_fn:ident) => {{
        let db = $db;
        let tenant = fresh_tenant();
        let hold = Hold::default();
        let waiting = Notify::new();
        let owner = async {
            let mut tx = db.pool().begin().await.expect("begin");
            let answer = $tx_fn(&mut tx, &tenant, "k", Some(&hold)).await;
            // The duplicates are on their way; give them time to queue
            // behind the uncommitted record (not asserted: any order is
            // correct), then drop the transaction.
            waiting.notified().await;
            drop(tx);
            answer
        };
        let duplicates = async {
            hold.reached.notified().await;
            hold.go.notify_one();
            let one = || $store_fn(db.store(), &tenant, "k");
            let let_go = async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                waiting.notify_one();
            };
            let (a, b, c, d, ()) = tokio::join!(
                with_outcome(one()),
                with_outcome(one()),
                with_outcome(one()),
                with_outcome(one()),
                let_go
            );
            [a, b, c, d]
        };
        let (owned, answers) = tokio::time::timeout(Duration::from_secs(90), async {
            tokio::join!(owner, duplicates)
        })
        .await
        .expect("nobody waits forever");
        assert_eq!(owned.expect("the owner's call answered"), 1);
        let executed: Vec<_> = answers
            .iter()
            .filter(|(_, o)| *o == Some(Outcome::Executed))
            .collect();
        assert_eq!(executed.len(), 1, "{answers:?}");
        for (answer, _) in &answers {
            assert_eq!(answer.as_ref().ok(), Some(&2), "{answers:?}");
        }
        assert_eq!(
            runs(&tenant),
            2,
            "the owner's run (rolled back) and one duplicate's"
        );
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_an_owners_transaction_dropped_uncommitted_hands_the_key_to_one_waiter() {
    let Some(db) = pg(PG_DDL).await else { return };
    owner_dropped_with_waiters!(&db, pg_waited_store, pg_waited_tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_an_owners_transaction_dropped_uncommitted_hands_the_key_to_one_waiter() {
    let Some(db) = my(MY_DDL).await else { return };
    owner_dropped_with_waiters!(&db, my_waited_store, my_waited_tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_an_owners_transaction_dropped_uncommitted_hands_the_key_to_one_waiter() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    owner_dropped_with_waiters!(&db, sqlite_waited_store, sqlite_waited_tx);
}

// ---------------------------------------------------------------- a waited-out duplicate keeps its transaction's writes

#[idempotent(scope = "tx_conn.short_pg", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = wait("1s"))]
async fn pg_short_wait(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    tenant: &str,
    key: &str,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(3)
}

#[idempotent(scope = "tx_conn.short_my", key = key, tenant = tenant, tx = tx, skip(hold),
             ttl = "1h", in_progress = wait("1s"))]
async fn my_short_wait(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tenant: &str,
    key: &str,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(3)
}

/// Rule 15 ("its own transaction stays usable"): a duplicate whose
/// transaction wrote a business row, then waited for an open owner until its
/// bound and was answered `InProgress`, commits that row: the wait cost it
/// the call, not its earlier writes. The owner then commits and the key
/// replays.
macro_rules! waited_out_keeps_writes {
    ($db:expr, $call:ident, $insert:literal) => {{
        let db = $db;
        let tenant = fresh_tenant();
        let hold = Hold::default();
        let owner = async {
            let mut tx = db.pool().begin().await.expect("begin");
            let answer = $call(&mut tx, &tenant, "k", Some(&hold)).await;
            tx.commit().await.expect("commit");
            answer
        };
        let duplicate = async {
            hold.reached.notified().await;
            let mut tx = db.pool().begin().await.expect("begin");
            sqlx::query($insert)
                .bind(&tenant)
                .bind("before")
                .execute(&mut *tx)
                .await
                .expect("an earlier write");
            let answer = $call(&mut tx, &tenant, "k", None).await;
            let usable = sqlx::query($insert)
                .bind(&tenant)
                .bind("after")
                .execute(&mut *tx)
                .await;
            tx.commit().await.expect("commit");
            hold.go.notify_one();
            (answer, usable.map(|_| ()))
        };
        let (owned, (answer, usable)) = tokio::time::timeout(Duration::from_secs(60), async {
            tokio::join!(owner, duplicate)
        })
        .await
        .expect("bounded");
        assert_eq!(owned.expect("owner"), 3);
        assert!(
            matches!(answer, Err(Error::InProgress { .. })),
            "{answer:?}"
        );
        usable.expect("the duplicate's transaction stays usable");
        assert_eq!(
            db.rows(&tenant).await,
            2,
            "the duplicate's writes before and after the call"
        );
        let mut tx = db.pool().begin().await.expect("begin");
        let (again, outcome) = with_outcome($call(&mut tx, &tenant, "k", None)).await;
        tx.commit().await.expect("commit");
        assert_eq!(
            (again.expect("replays"), outcome),
            (3, Some(Outcome::Replayed))
        );
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_duplicate_that_waited_out_its_bound_keeps_its_transactions_writes() {
    let Some(db) = pg(PG_DDL).await else { return };
    waited_out_keeps_writes!(
        &db,
        pg_short_wait,
        "INSERT INTO idempotent_test_conn_charges (tenant, idem_key, amount) VALUES ($1, $2, 0)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_duplicate_that_waited_out_its_bound_keeps_its_transactions_writes() {
    let Some(db) = my(MY_DDL).await else { return };
    waited_out_keeps_writes!(
        &db,
        my_short_wait,
        "INSERT INTO idempotent_test_conn_charges (tenant, idem_key, amount) VALUES (?, ?, 0)"
    );
}

// ---------------------------------------------------------------- PostgreSQL: a waiter at a strict level whose owner ends mid-wait

/// Until the backend `pid` waits for a lock (bounded).
async fn pg_until_waiting(pool: &sqlx::PgPool, pid: i32) {
    for _ in 0..2000 {
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted")
                .bind(pid)
                .fetch_one(pool)
                .await
                .expect("pg_locks");
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("backend {pid} never waited for a lock");
}

/// Rule 15 under REPEATABLE READ and SERIALIZABLE: a transactional duplicate
/// (which wrote a business row first) waits for an open owner's uncommitted
/// reservation; the owner commits or rolls back while it waits. After a
/// commit the duplicate replays or is refused `StaleSnapshot` (its snapshot
/// is older than the record: README); after a rollback it runs the body.
/// Either way it is not told of a deadlock or a store failure, and its
/// transaction stays usable with its earlier write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_strict_waiter_whose_owner_ends_mid_wait_gets_a_clean_answer() {
    let Some(db) = pg(PG_DDL).await else { return };
    for begin in [
        "BEGIN ISOLATION LEVEL REPEATABLE READ",
        "BEGIN ISOLATION LEVEL SERIALIZABLE",
    ] {
        for owner_commits in [true, false] {
            let what = format!("{begin}, owner commits: {owner_commits}");
            let tenant = fresh_tenant();
            let hold = Hold::default();
            let ended = Notify::new();
            let owner = async {
                let mut tx = db.pool().begin().await.expect("begin");
                let answer = pg_waited_tx(&mut tx, &tenant, "k", Some(&hold)).await;
                ended.notified().await;
                if owner_commits {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
                answer
            };
            let duplicate = async {
                hold.reached.notified().await;
                hold.go.notify_one();
                let mut tx = db.pool().begin_with(begin).await.expect("begin");
                let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&mut *tx)
                    .await
                    .expect("pid");
                sqlx::query(
                    "INSERT INTO idempotent_test_conn_charges (tenant, idem_key, amount) \
                     VALUES ($1, 'before', 0)",
                )
                .bind(&tenant)
                .execute(&mut *tx)
                .await
                .expect("an earlier write");
                let watch = async {
                    pg_until_waiting(db.pool(), pid).await;
                    ended.notify_one();
                };
                let ((answer, outcome), ()) = tokio::join!(
                    with_outcome(pg_waited_tx(&mut tx, &tenant, "k", None)),
                    watch
                );
                let usable = sqlx::query("SELECT 1").execute(&mut *tx).await;
                let committed = tx.commit().await;
                (answer, outcome, usable.map(|_| ()), committed)
            };
            let (owned, (answer, outcome, usable, committed)) =
                tokio::time::timeout(Duration::from_secs(60), async {
                    tokio::join!(owner, duplicate)
                })
                .await
                .unwrap_or_else(|_| panic!("{what}: blocked"));
            assert_eq!(owned.expect("owner"), 1, "{what}");
            match (owner_commits, answer) {
                (true, Ok(v)) => assert_eq!((v, outcome), (1, Some(Outcome::Replayed)), "{what}"),
                (true, Err(Error::StaleSnapshot { .. })) => {}
                (false, Ok(v)) => assert_eq!((v, outcome), (2, Some(Outcome::Executed)), "{what}"),
                (_, other) => panic!("{what}: {other:?}"),
            }
            usable.unwrap_or_else(|e| panic!("{what}: the transaction is unusable: {e}"));
            committed.unwrap_or_else(|e| panic!("{what}: commit: {e}"));
            assert_eq!(db.rows(&tenant).await, 1, "{what}: the earlier write stays");
        }
    }
}

// ---------------------------------------------------------------- SQLite: answers that keep no lock, either journal

#[idempotent(scope = "tx_conn.shared_sqlite", key = key, tenant = tenant, store = store,
             skip(hold), shared_scope, ttl = "1h", in_progress = reject)]
async fn sqlite_shared_store(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(amount as u64)
}

#[idempotent(scope = "tx_conn.shared_sqlite", key = key, tenant = tenant, tx = tx, skip(hold),
             shared_scope, ttl = "1h", in_progress = reject)]
async fn sqlite_shared_tx(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    key: &str,
    amount: i64,
    hold: Option<&Hold>,
) -> Result<u64, Error> {
    hold_here(hold).await;
    Ok(amount as u64)
}

/// A store over an application's pool (`from_pool`) on a file in the
/// rollback journal (`journal_mode = DELETE`), where a reader's lock keeps
/// every writer from committing.
async fn lite_rollback_journal() -> Lite {
    let dir = common::scratch::dir("tx-conn-journal");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.join("db.sqlite"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Delete)
        .busy_timeout(Duration::from_secs(5));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool");
    let store = idempotent_runtime::SqliteStore::from_pool(pool)
        .await
        .expect("from_pool");
    sqlx::query(SQLITE_DDL)
        .execute(store.pool())
        .await
        .expect("ddl");
    Lite(store, dir)
}

/// As on the server stores: on SQLite, in WAL mode and in the rollback
/// journal, a deferred transaction that was refused as in progress, given a
/// replay and a mismatch, and stays open, keeps neither the owner from
/// recording its result nor another transaction from replaying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_answers_in_an_open_transaction_keep_no_lock_in_either_journal() {
    let wal = lite("tx-conn", SQLITE_DDL).await;
    answers_keep_no_lock!(&wal, "BEGIN", sqlite_shared_store, sqlite_shared_tx);
    let journal = lite_rollback_journal().await;
    answers_keep_no_lock!(&journal, "BEGIN", sqlite_shared_store, sqlite_shared_tx);
}

// ---------------------------------------------------------------- rules 17 and 21: the registry

/// Rule 17 for transactional functions: each is listed as transactional,
/// with its `recover` hook and policies, and the connection parameter (and
/// skipped ones) are not among the fingerprinted parameters. Rule 21: a scope
/// shared by a store-mode and a transactional claimant lists both, and the
/// registry validates.
#[test]
fn transactional_functions_are_listed_with_their_mode_and_parameters() {
    use idempotent_runtime::__private::InProgressPolicy;
    use idempotent_runtime::registry;
    let all = registry::scopes();
    let of = |scope: &str| -> Vec<_> { all.iter().filter(|i| i.scope == scope).collect() };
    for scope in ["tx_conn.pg", "tx_conn.mysql", "tx_conn.sqlite"] {
        let [info] = of(scope)[..] else {
            panic!("{scope}: {:?}", of(scope))
        };
        assert!(info.transactional, "{scope}");
        assert_eq!(info.fingerprinted_parameters, ["amount"], "{scope}");
        assert_eq!(info.in_progress, InProgressPolicy::Reject, "{scope}");
        assert!(
            info.recover.is_some_and(|r| r.contains("look_up")),
            "{scope}: {:?}",
            info.recover
        );
        assert!(!info.shared_scope, "{scope}");
        assert_eq!(info.file, file!());
    }
    for scope in [
        "tx_conn.shared_pg",
        "tx_conn.shared_my",
        "tx_conn.shared_sqlite",
    ] {
        let claimants = of(scope);
        assert_eq!(claimants.len(), 2, "{scope}: {claimants:?}");
        assert!(claimants.iter().all(|i| i.shared_scope), "{scope}");
        let mut modes: Vec<bool> = claimants.iter().map(|i| i.transactional).collect();
        modes.sort();
        assert_eq!(modes, [false, true], "{scope}: one of each mode");
        for c in &claimants {
            assert_eq!(
                c.fingerprinted_parameters,
                ["amount"],
                "{scope}: {}",
                c.function
            );
        }
    }
    registry::validate().expect("the registry validates");
}

// ---------------------------------------------------------------- rules 15, 16 and 19: a reservation committed in progress, audited and purged

macro_rules! short_lease {
    ($db:ty, $scope:literal, $name:ident) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(hold),
                                             ttl = "1h", lease = "100ms", in_progress = reject)]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            hold: Option<&Hold>,
        ) -> Result<u64, Error> {
            hold_here(hold).await;
            Ok(4)
        }
    };
}

short_lease!(Postgres, "tx_conn.audit_pg", pg_short_lease);
short_lease!(MySql, "tx_conn.audit_my", my_short_lease);
short_lease!(Sqlite, "tx_conn.audit_sqlite", sqlite_short_lease);

/// This scope's row of an audit against the registry (zeros when absent).
async fn audited(store: &dyn Store, scope: &str) -> idempotent_runtime::audit::ScopeAudit {
    use idempotent_runtime::audit::{audit, KnownScope};
    let report = audit(store, &KnownScope::from_registry())
        .await
        .expect("audit");
    report
        .scope(scope)
        .expect("a claimed scope is listed")
        .clone()
}

/// README, transactional mode: a call dropped while its body runs, whose
/// caller commits anyway, commits the reservation in progress. The audit
/// shows it in progress, then (its lease over) stuck, claimed by the
/// function; the next call in a transaction takes it over and runs (attempt
/// 2, counted as taken over); once expired the audit counts it as expired
/// and a purge deletes it. Counts are compared before and after, as the
/// scope's records of earlier runs stay in a shared database.
macro_rules! committed_in_progress_audited_and_purged {
    ($db:expr, $scope:literal, $call:ident) => {{
        let db = $db;
        let scope: &str = $scope;
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, scope, "k").expect("identity");
        let before = audited(db.store(), scope).await;
        assert!(
            before
                .claimed_by
                .iter()
                .any(|f| f.ends_with(stringify!($call))),
            "{scope}: {:?}",
            before.claimed_by
        );

        let hold = Hold::default();
        let mut tx = db.pool().begin().await.expect("begin");
        tokio::select! {
            answer = $call(&mut tx, &tenant, "k", Some(&hold)) => panic!("held: {answer:?}"),
            () = hold.reached.notified() => {}
        }
        tx.commit().await.expect("the caller commits anyway");
        let mut stuck = false;
        for _ in 0..500 {
            let s = db
                .store()
                .fetch(&identity)
                .await
                .expect("fetch")
                .expect("committed in progress");
            assert_eq!(s.state, idempotent_runtime::RecordState::InProgress);
            if s.lease_expires_at_ms.is_some_and(|l| l <= s.now_ms) {
                stuck = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(stuck, "the lease never ran out");
        let now = audited(db.store(), scope).await;
        assert_eq!(now.stuck, before.stuck + 1, "stuck: {now:?}");

        // MariaDB refuses a takeover of a lease that ran out in the second
        // its transaction began (README): a new transaction takes it.
        let mut taken = None;
        for _ in 0..50 {
            let mut tx = db.pool().begin().await.expect("begin");
            match with_outcome($call(&mut tx, &tenant, "k", None)).await {
                (Err(Error::StaleSnapshot { .. }), _) => {
                    tx.rollback().await.expect("rollback");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                answered => {
                    tx.commit().await.expect("commit");
                    taken = Some(answered);
                    break;
                }
            }
        }
        let (answer, outcome) = taken.expect("taken over within 50 transactions");
        assert_eq!(
            (answer.expect("taken over"), outcome),
            (4, Some(Outcome::Executed))
        );
        let s = db
            .store()
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        assert_eq!(
            (s.state, s.attempt),
            (idempotent_runtime::RecordState::Complete, 2)
        );
        let now = audited(db.store(), scope).await;
        assert_eq!(now.stuck, before.stuck, "{now:?}");
        assert_eq!(now.complete, before.complete + 1, "{now:?}");
        assert_eq!(now.taken_over, before.taken_over + 1, "{now:?}");

        db.expire(&tenant, "k").await;
        let now = audited(db.store(), scope).await;
        assert_eq!(now.complete, before.complete, "{now:?}");
        assert!(
            now.expired > before.expired || now.expired >= 1,
            "expired: {now:?}"
        );
        let deleted = idempotent_runtime::purge::purge_all(db.store(), 100)
            .await
            .expect("purge");
        assert!(deleted >= 1, "the purge deleted {deleted}");
        assert_eq!(db.store().fetch(&identity).await.expect("fetch"), None);
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_reservation_committed_in_progress_is_audited_taken_over_and_purged() {
    let Some(db) = pg(PG_DDL).await else { return };
    committed_in_progress_audited_and_purged!(
        &ScopeDb(&db, "tx_conn.audit_pg"),
        "tx_conn.audit_pg",
        pg_short_lease
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_reservation_committed_in_progress_is_audited_taken_over_and_purged() {
    let Some(db) = my(MY_DDL).await else { return };
    committed_in_progress_audited_and_purged!(
        &ScopeDb(&db, "tx_conn.audit_my"),
        "tx_conn.audit_my",
        my_short_lease
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_reservation_committed_in_progress_is_audited_taken_over_and_purged() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    committed_in_progress_audited_and_purged!(
        &ScopeDb(&db, "tx_conn.audit_sqlite"),
        "tx_conn.audit_sqlite",
        sqlite_short_lease
    );
}

/// A database seen through one scope: `expire` moves that scope's record.
struct ScopeDb<'a, B: Db>(&'a B, &'static str);

impl<B: Db> ScopeDb<'_, B> {
    fn store(&self) -> &dyn Store {
        self.0.store()
    }
    fn pool(&self) -> &sqlx::Pool<B::D> {
        self.0.pool()
    }
    async fn expire(&self, tenant: &str, key: &str) {
        self.0.expire_in(tenant, self.1, key).await;
    }
}

// ---------------------------------------------------------------- a takeover released in a transaction, a store-mode waiter behind it

macro_rules! released_pair {
    ($db:ty, $scope:literal, $store_fn:ident, $tx_fn:ident) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, store = store, shared_scope,
                                             ttl = "1h", in_progress = wait("20s"))]
        async fn $store_fn(store: &dyn Store, tenant: &str, key: &str) -> Result<u64, Error> {
            Ok(u64::from(ran(tenant)))
        }

        /// Fails (released) after `hold`.
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(hold),
                                             shared_scope, ttl = "1h", in_progress = wait("20s"))]
        async fn $tx_fn(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            hold: Option<&Hold>,
        ) -> Result<u64, Error> {
            ran(tenant);
            hold_here(hold).await;
            Err(Error::Store(idempotent_runtime::StoreError::new(
                "gateway", "charge", "declined",
            )))
        }
    };
}

released_pair!(
    Postgres,
    "tx_conn.released_pg",
    pg_released_store,
    pg_released_tx
);
released_pair!(
    MySql,
    "tx_conn.released_my",
    my_released_store,
    my_released_tx
);
released_pair!(
    Sqlite,
    "tx_conn.released_sqlite",
    sqlite_released_store,
    sqlite_released_tx
);

/// Rules 10, 13 and 15: a transaction takes a stuck record over (a crashed
/// owner's, lease run out) and its body fails, releasing the record in the
/// transaction, while a store-mode duplicate waits behind it (`wait`); the
/// transaction commits. The duplicate then runs the body (the key is free):
/// it is not told `InProgress`, `LeaseLost` or of a store failure.
macro_rules! released_takeover_with_a_waiter {
    ($db:expr, $scope:literal, $store_fn:ident, $tx_fn:ident) => {{
        let db = $db;
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, $scope, "k").expect("identity");
        plant_stuck(db.store(), &identity).await;
        let hold = Hold::default();
        let owner = async {
            let mut answer = None;
            for _ in 0..50 {
                let mut tx = db.pool().begin().await.expect("begin");
                match $tx_fn(&mut tx, &tenant, "k", Some(&hold)).await {
                    // MariaDB: a lease that ran out in the second the
                    // transaction began (README); a new transaction takes it.
                    Err(Error::StaleSnapshot { .. }) => {
                        tx.rollback().await.expect("rollback");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => {
                        tx.commit().await.expect("commit");
                        answer = Some(other);
                        break;
                    }
                }
            }
            answer.expect("taken over within 50 transactions")
        };
        let waiter = async {
            hold.reached.notified().await;
            let let_go = async {
                // The waiter is on its way; any order is correct.
                tokio::time::sleep(Duration::from_millis(500)).await;
                hold.go.notify_one();
            };
            let (answer, ()) =
                tokio::join!(with_outcome($store_fn(db.store(), &tenant, "k")), let_go);
            answer
        };
        let (owned, (answer, outcome)) = tokio::time::timeout(Duration::from_secs(60), async {
            tokio::join!(owner, waiter)
        })
        .await
        .expect("nobody waits forever");
        assert!(
            matches!(owned, Err(Error::Store(_))),
            "the owner's own error: {owned:?}"
        );
        assert_eq!(
            (answer.expect("the waiter runs"), outcome),
            (2, Some(Outcome::Executed))
        );
        let s = db
            .store()
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        assert_eq!(s.state, idempotent_runtime::RecordState::Complete);
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_a_takeover_released_in_a_transaction_frees_the_key_for_a_waiter() {
    let Some(db) = pg(PG_DDL).await else { return };
    released_takeover_with_a_waiter!(
        &db,
        "tx_conn.released_pg",
        pg_released_store,
        pg_released_tx
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_a_takeover_released_in_a_transaction_frees_the_key_for_a_waiter() {
    let Some(db) = my(MY_DDL).await else { return };
    released_takeover_with_a_waiter!(
        &db,
        "tx_conn.released_my",
        my_released_store,
        my_released_tx
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_a_takeover_released_in_a_transaction_frees_the_key_for_a_waiter() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    released_takeover_with_a_waiter!(
        &db,
        "tx_conn.released_sqlite",
        sqlite_released_store,
        sqlite_released_tx
    );
}

// ---------------------------------------------------------------- an owner's rollback with transactional waiters

/// Rule 15: a transactional owner holds the key open while four
/// transactional duplicates (each in a transaction of its own, `wait`) wait
/// for it; the owner rolls back. The key goes to one duplicate, which runs
/// the body and commits; the other three replay it. Nobody is told of a
/// deadlock or waits forever. (MariaDB: `my_owner_rollback_with_waiters_*`.)
macro_rules! owner_rollback_with_tx_waiters {
    ($db:expr, $tx_fn:ident) => {{
        let db = $db;
        let tenant = fresh_tenant();
        let hold = Hold::default();
        let owner = async {
            let mut tx = db.pool().begin().await.expect("begin");
            let answer = $tx_fn(&mut tx, &tenant, "k", Some(&hold)).await;
            tx.rollback().await.expect("rollback");
            answer
        };
        let one = || async {
            let mut tx = db.pool().begin().await.expect("begin");
            let answer = with_outcome($tx_fn(&mut tx, &tenant, "k", None)).await;
            tx.commit().await.expect("commit");
            answer
        };
        let duplicates = four_duplicates_then_go(&hold, one);
        let (owned, answers) = tokio::time::timeout(Duration::from_secs(90), async {
            tokio::join!(owner, duplicates)
        })
        .await
        .expect("nobody waits forever");
        assert_eq!(owned.expect("the owner's call answered"), 1);
        let executed = answers
            .iter()
            .filter(|(_, o)| *o == Some(Outcome::Executed))
            .count();
        assert_eq!(executed, 1, "{answers:?}");
        for (answer, _) in &answers {
            assert_eq!(answer.as_ref().ok(), Some(&2), "{answers:?}");
        }
        assert_eq!(runs(&tenant), 2);
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_an_owners_rollback_hands_the_key_to_one_transactional_waiter() {
    let Some(db) = pg(PG_DDL).await else { return };
    for _ in 0..3 {
        owner_rollback_with_tx_waiters!(&db, pg_waited_tx);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_an_owners_rollback_hands_the_key_to_one_transactional_waiter() {
    let db = lite("tx-conn", SQLITE_DDL).await;
    for _ in 0..3 {
        owner_rollback_with_tx_waiters!(&db, sqlite_waited_tx);
    }
}

// ---------------------------------------------------------------- MariaDB: a transaction at READ UNCOMMITTED for itself only

/// Rules 5 and 15 on MariaDB: a transaction made READ UNCOMMITTED for
/// itself alone (`SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED` before
/// `START TRANSACTION`, the session's own level left as it was) must not
/// replay a result another transactional owner has recorded but not
/// committed: the owner then rolls back and the key runs again, and the
/// duplicate would have answered with a result that never existed. It
/// should be refused, as a transaction of a READ UNCOMMITTED session is
/// (`sql_edges::mysql_edges::a_transaction_that_reads_uncommitted_data_is_refused`);
/// today it replays (the README tells users not to set such a level).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a documented limitation (README: a level set for the next transaction only is not \
            seen): the check reads @@tx_isolation, the session's level; run it if the reservation \
            learns the transaction's own level (information_schema.innodb_trx)"]
async fn mysql_a_transaction_read_uncommitted_for_itself_never_replays_an_uncommitted_result() {
    let Some(db) = my(MY_DDL).await else { return };
    let tenant = fresh_tenant();
    let mut owner = db.pool().begin().await.expect("begin");
    assert_eq!(
        My::charge(&mut owner, &tenant, "k", 500, None)
            .await
            .expect("runs"),
        500
    );
    // The owner's result is recorded in its transaction, not committed.
    let mut duplicate = db
        .pool()
        .begin_with("SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED; START TRANSACTION")
        .await
        .expect("begin");
    let answer = with_outcome(My::charge(&mut duplicate, &tenant, "k", 500, None)).await;
    // The call's reads have started the transaction in InnoDB: its level.
    let level: Option<String> = sqlx::query_scalar(
        "SELECT trx_isolation_level FROM information_schema.innodb_trx \
         WHERE trx_mysql_thread_id = CONNECTION_ID()",
    )
    .fetch_optional(&mut *duplicate)
    .await
    .expect("level");
    duplicate.rollback().await.expect("rollback");
    if let Some(level) = level {
        assert_eq!(level, "READ UNCOMMITTED", "the duplicate's transaction");
    }
    owner.rollback().await.expect("the owner rolls back");
    assert!(db
        .store()
        .fetch(&id::<My>(&tenant, "k"))
        .await
        .expect("fetch")
        .is_none());
    assert!(
        !matches!(answer, (Ok(_), Some(Outcome::Replayed))),
        "the duplicate replayed a result its owner then rolled back: {answer:?}"
    );
    assert!(
        matches!(&answer.0, Err(e) if e.to_string().contains("READ UNCOMMITTED")),
        "refused, saying why: {answer:?}"
    );
}

/// The same through the store, on a pool it shares with application code
/// that set `SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED` for a dirty
/// report read in autocommit and gave the connection back (MariaDB keeps
/// that level for the session's autocommit statements until a transaction
/// ends): the store's reservation does not replay a result its
/// transactional owner has not committed. (A session set with
/// `SET SESSION ...`: `sql_edges::transactional_hostile`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_shared_session_left_read_uncommitted_for_its_next_transaction_never_replays_an_uncommitted_result(
) {
    let Some(db) = my(MY_DDL).await else { return };
    let shared = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&common::servers::mysql_url())
        .await
        .expect("pool");
    let store = idempotent_runtime::MySqlStore::from_pool(shared.clone())
        .await
        .expect("store");
    {
        let mut conn = shared.acquire().await.expect("connection");
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
            .execute(&mut *conn)
            .await
            .expect("a dirty report's level");
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotent_test_conn_charges")
            .fetch_one(&mut *conn)
            .await
            .expect("the report");
    }
    let tenant = fresh_tenant();
    let mut owner = db.pool().begin().await.expect("begin");
    assert_eq!(
        my_shared_tx(&mut owner, &tenant, "k", 5, None)
            .await
            .expect("runs"),
        5
    );
    let answer = with_outcome(my_shared_store(&store, &tenant, "k", 5, None)).await;
    owner.rollback().await.expect("the owner rolls back");
    assert!(
        !matches!(answer, (Ok(_), Some(Outcome::Replayed))),
        "the duplicate replayed a result its owner then rolled back: {answer:?}"
    );
}
