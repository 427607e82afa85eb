//! Rules 12 and 13 in transactional mode (rule 15), on PostgreSQL, MariaDB
//! and SQLite alike: what a body's answer does to the record written in the
//! caller's transaction when that answer is an error the policy releases, an
//! error the policy records (`errors = record`), or a value that cannot be
//! recorded faithfully (a non-finite float). Store mode checks the same on
//! every store (`contract`); these are the transactional cells of the
//! matrix: each scenario is written once (`answers_in_a_transaction!`) and
//! run on each database.

use crate::common;

use super::contract::ChargeError;
use super::tx_fixtures::{lite, my, pg, ran, runs};
use common::records::{acquire, recorded};
use common::servers::fresh_tenant;
use idempotent_runtime::{
    idempotent, with_outcome, Error, FingerprintBuilder, Identity, Outcome, RecordState, Recovery,
    Store, Takeover,
};
use sqlx::{MySql, Postgres, Sqlite};
use std::collections::HashSet;
use std::time::Duration;

const PG_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_tx_answers (
    tenant TEXT NOT NULL, idem_key TEXT NOT NULL)";
const MY_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_tx_answers (
    tenant VARCHAR(100) NOT NULL, idem_key VARCHAR(255) NOT NULL) ENGINE = InnoDB";
const SQLITE_DDL: &str = "CREATE TABLE IF NOT EXISTS idempotent_test_tx_answers (
    tenant TEXT NOT NULL, idem_key TEXT NOT NULL)";

/// The three functions of one database, each writing a business row
/// (`$insert`) in the caller's transaction before it answers: one whose
/// error is released (the default), one whose error is recorded, and one
/// answering the float it is given.
macro_rules! functions {
    ($db:ty, $release_scope:literal, $record_scope:literal, $float_scope:literal,
     $set_scope:literal, $insert:literal, $released:ident, $recorded:ident, $floats:ident,
     $sets:ident) => {
        #[idempotent(scope = $release_scope, key = key, tenant = tenant, tx = tx, skip(fail),
                                                                             ttl = "1h")]
        async fn $released(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            fail: bool,
        ) -> Result<u64, ChargeError> {
            sqlx::query($insert)
                .bind(tenant)
                .bind(key)
                .execute(&mut **tx)
                .await
                .expect("business write");
            let n = ran(tenant);
            if fail {
                return Err(ChargeError::Unavailable);
            }
            Ok(u64::from(n))
        }

        #[idempotent(scope = $record_scope, key = key, tenant = tenant, tx = tx, ttl = "1h",
                                                                             errors = record)]
        async fn $recorded(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
        ) -> Result<u64, ChargeError> {
            sqlx::query($insert)
                .bind(tenant)
                .bind(key)
                .execute(&mut **tx)
                .await
                .expect("business write");
            let n = ran(tenant);
            Err(ChargeError::Declined(format!("declined on run {n}")))
        }

        #[idempotent(scope = $float_scope, key = key, tenant = tenant, tx = tx, skip(value),
                                                                             ttl = "1h")]
        async fn $floats(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            value: f64,
        ) -> Result<f64, Error> {
            sqlx::query($insert)
                .bind(tenant)
                .bind(key)
                .execute(&mut **tx)
                .await
                .expect("business write");
            ran(tenant);
            Ok(value)
        }

        #[idempotent(scope = $set_scope, key = key, tenant = tenant, tx = tx, ttl = "1h")]
        async fn $sets(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            items: HashSet<String>,
        ) -> Result<u64, Error> {
            sqlx::query($insert)
                .bind(tenant)
                .bind(key)
                .execute(&mut **tx)
                .await
                .expect("business write");
            Ok(u64::from(ran(tenant)))
        }
    };
}

functions!(
    Postgres,
    "tx_answers.pg_released",
    "tx_answers.pg_recorded",
    "tx_answers.pg_floats",
    "tx_answers.pg_sets",
    "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES ($1, $2)",
    pg_released,
    pg_recorded,
    pg_floats,
    pg_sets
);
functions!(
    MySql,
    "tx_answers.my_released",
    "tx_answers.my_recorded",
    "tx_answers.my_floats",
    "tx_answers.my_sets",
    "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?, ?)",
    my_released,
    my_recorded,
    my_floats,
    my_sets
);
functions!(
    Sqlite,
    "tx_answers.lite_released",
    "tx_answers.lite_recorded",
    "tx_answers.lite_floats",
    "tx_answers.lite_sets",
    "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?1, ?2)",
    lite_released,
    lite_recorded,
    lite_floats,
    lite_sets
);

/// Rule 13 in a transaction the caller commits: a released error deletes
/// the reservation in that transaction, so the key is free at once (a retry
/// runs the body, no record is left in progress for a lease), while the
/// business row written before the error commits with it.
macro_rules! released_error_then_commit {
    ($store:expr, $pool:expr, $released:ident, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, $scope, "k").expect("identity");
        let mut tx = pool.begin().await.expect("begin");
        let (failed, outcome) = with_outcome($released(&mut tx, &tenant, "k", true)).await;
        assert_eq!(failed, Err(ChargeError::Unavailable));
        assert_eq!(outcome, Some(Outcome::Executed));
        tx.commit().await.expect("commit");
        assert_eq!(
            store.fetch(&identity).await.expect("fetch"),
            None,
            "a released error leaves no record once the caller commits"
        );

        let mut tx = pool.begin().await.expect("begin");
        let (again, outcome) = with_outcome($released(&mut tx, &tenant, "k", false)).await;
        tx.commit().await.expect("commit");
        assert_eq!(
            (again, outcome),
            (Ok(2), Some(Outcome::Executed)),
            "the retry runs the body"
        );
        let mut tx = pool.begin().await.expect("begin");
        let (replay, outcome) = with_outcome($released(&mut tx, &tenant, "k", true)).await;
        tx.commit().await.expect("commit");
        assert_eq!((replay, outcome), (Ok(2), Some(Outcome::Replayed)));
        assert_eq!(runs(&tenant), 2);
    }};
}

/// Rule 13 with `errors = record` in a transaction: rolled back, the recorded
/// error goes with the business write and the key runs again; committed, the
/// error is the key's final answer and every retry replays it without
/// running the body.
macro_rules! recorded_error_in_a_transaction {
    ($store:expr, $pool:expr, $recorded:ident, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, $scope, "k").expect("identity");
        let mut tx = pool.begin().await.expect("begin");
        let (first, outcome) = with_outcome($recorded(&mut tx, &tenant, "k")).await;
        assert_eq!(
            (first, outcome),
            (
                Err(ChargeError::Declined("declined on run 1".into())),
                Some(Outcome::Executed)
            )
        );
        tx.rollback().await.expect("rollback");
        assert_eq!(store.fetch(&identity).await.expect("fetch"), None);

        let mut tx = pool.begin().await.expect("begin");
        let (second, outcome) = with_outcome($recorded(&mut tx, &tenant, "k")).await;
        tx.commit().await.expect("commit");
        let recorded = Err(ChargeError::Declined("declined on run 2".into()));
        assert_eq!(
            (second.clone(), outcome),
            (recorded.clone(), Some(Outcome::Executed))
        );
        for _ in 0..2 {
            let mut tx = pool.begin().await.expect("begin");
            let (replay, outcome) = with_outcome($recorded(&mut tx, &tenant, "k")).await;
            tx.commit().await.expect("commit");
            assert_eq!(
                (replay, outcome),
                (recorded.clone(), Some(Outcome::Replayed)),
                "the recorded error is the key's final answer"
            );
        }
        assert_eq!(runs(&tenant), 2);
    }};
}

/// Rule 12 in a transaction: a result that would not replay equal (`+inf`
/// in JSON) is refused when it is recorded, naming the scope; the caller's
/// transaction stays usable, and once it commits nothing is recorded and
/// the key is free (a retry runs the body and its finite answer replays).
macro_rules! unfaithful_result_in_a_transaction {
    ($store:expr, $pool:expr, $floats:ident, $insert:literal, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, $scope, "k").expect("identity");
        let mut tx = pool.begin().await.expect("begin");
        let refused = $floats(&mut tx, &tenant, "k", f64::INFINITY).await;
        match &refused {
            Err(e @ Error::ResultNotFaithful { scope, .. }) => {
                assert_eq!(scope, $scope);
                assert!(e.to_string().contains($scope), "{e}");
            }
            other => panic!("a non-finite result must be refused, got {other:?}"),
        }
        sqlx::query($insert)
            .bind(&tenant)
            .bind("after")
            .execute(&mut *tx)
            .await
            .expect("the caller's transaction stays usable");
        tx.commit().await.expect("commit");
        assert_eq!(
            store.fetch(&identity).await.expect("fetch"),
            None,
            "nothing is recorded and the key is not left in progress"
        );

        let mut tx = pool.begin().await.expect("begin");
        let (again, outcome) = with_outcome($floats(&mut tx, &tenant, "k", 1.5)).await;
        tx.commit().await.expect("commit");
        assert_eq!(
            (again.expect("runs again"), outcome),
            (1.5, Some(Outcome::Executed))
        );
        let mut tx = pool.begin().await.expect("begin");
        let (replay, outcome) = with_outcome($floats(&mut tx, &tenant, "k", 1.5)).await;
        tx.commit().await.expect("commit");
        assert_eq!(
            (replay.expect("replays"), outcome),
            (1.5, Some(Outcome::Replayed))
        );
        assert_eq!(runs(&tenant), 2);
    }};
}

#[tokio::test]
async fn pg_a_released_error_in_a_committed_transaction_frees_the_key() {
    let Some(db) = pg(PG_DDL).await else { return };
    released_error_then_commit!(&db.0, db.0.pool(), pg_released, "tx_answers.pg_released");
}

#[tokio::test]
async fn mysql_a_released_error_in_a_committed_transaction_frees_the_key() {
    let Some(db) = my(MY_DDL).await else { return };
    released_error_then_commit!(&db.0, db.0.pool(), my_released, "tx_answers.my_released");
}

#[tokio::test]
async fn sqlite_a_released_error_in_a_committed_transaction_frees_the_key_and_replays_the_retry() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    released_error_then_commit!(
        &db.0,
        db.0.pool(),
        lite_released,
        "tx_answers.lite_released"
    );
}

#[tokio::test]
async fn pg_a_recorded_error_in_a_transaction_commits_or_rolls_back_with_it() {
    let Some(db) = pg(PG_DDL).await else { return };
    recorded_error_in_a_transaction!(&db.0, db.0.pool(), pg_recorded, "tx_answers.pg_recorded");
}

#[tokio::test]
async fn mysql_a_recorded_error_in_a_transaction_commits_or_rolls_back_with_it() {
    let Some(db) = my(MY_DDL).await else { return };
    recorded_error_in_a_transaction!(&db.0, db.0.pool(), my_recorded, "tx_answers.my_recorded");
}

#[tokio::test]
async fn sqlite_a_recorded_error_in_a_transaction_commits_or_rolls_back_with_it() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    recorded_error_in_a_transaction!(
        &db.0,
        db.0.pool(),
        lite_recorded,
        "tx_answers.lite_recorded"
    );
}

#[tokio::test]
async fn pg_a_result_that_would_not_replay_equal_is_refused_in_a_transaction() {
    let Some(db) = pg(PG_DDL).await else { return };
    unfaithful_result_in_a_transaction!(
        &db.0,
        db.0.pool(),
        pg_floats,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES ($1, $2)",
        "tx_answers.pg_floats"
    );
}

#[tokio::test]
async fn mysql_a_result_that_would_not_replay_equal_is_refused_in_a_transaction() {
    let Some(db) = my(MY_DDL).await else { return };
    unfaithful_result_in_a_transaction!(
        &db.0,
        db.0.pool(),
        my_floats,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?, ?)",
        "tx_answers.my_floats"
    );
}

#[tokio::test]
async fn sqlite_a_result_that_would_not_replay_equal_is_refused_in_a_transaction() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    unfaithful_result_in_a_transaction!(
        &db.0,
        db.0.pool(),
        lite_floats,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?1, ?2)",
        "tx_answers.lite_floats"
    );
}

/// Rule 6 in a transaction: a record an older version made with the v1
/// form of the fingerprint (committed in store mode) is compared by v1's
/// rules inside a caller's transaction too: the same request replays it,
/// another request is refused as a mismatch; the body runs neither time,
/// the record is untouched and the caller's transaction stays usable.
macro_rules! v1_record_in_a_transaction {
    ($store:expr, $pool:expr, $sets:ident, $insert:literal, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, $scope, "old").expect("identity");
        let items: HashSet<String> = (0..16).map(|i| format!("item-{i}")).collect();
        let mut current = FingerprintBuilder::new();
        current.argument("items", &items);
        let v1 = current
            .finish()
            .expect("fingerprinted")
            .expect("a fingerprint")
            .legacy()
            .expect("a v1 form");
        assert_eq!(v1.version(), "v1");
        recorded(store, &identity, Some(&v1), b"41").await;
        // The record as stored, without the moment it was read.
        let stored = || async {
            let mut snapshot = store
                .fetch(&identity)
                .await
                .expect("fetch")
                .expect("recorded");
            snapshot.now_ms = 0;
            snapshot
        };
        let before = stored().await;

        let mut tx = pool.begin().await.expect("begin");
        let (replay, how) = with_outcome($sets(&mut tx, &tenant, "old", items.clone())).await;
        assert_eq!(
            (replay.expect("the same request replays the v1 record"), how),
            (41, Some(Outcome::Replayed))
        );
        let mut other = items.clone();
        other.insert("one more".into());
        let refused = $sets(&mut tx, &tenant, "old", other).await;
        assert!(
            matches!(refused, Err(Error::FingerprintMismatch(_))),
            "another request is a mismatch: {refused:?}"
        );
        sqlx::query($insert)
            .bind(&tenant)
            .bind("after")
            .execute(&mut *tx)
            .await
            .expect("the caller's transaction stays usable");
        tx.commit().await.expect("commit");
        assert_eq!(runs(&tenant), 0, "the body never ran");
        assert_eq!(stored().await, before, "the record is untouched");
    }};
}

#[tokio::test]
async fn pg_a_v1_record_is_compared_by_v1_rules_in_a_transaction() {
    let Some(db) = pg(PG_DDL).await else { return };
    v1_record_in_a_transaction!(
        &db.0,
        db.0.pool(),
        pg_sets,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES ($1, $2)",
        "tx_answers.pg_sets"
    );
}

#[tokio::test]
async fn mysql_a_v1_record_is_compared_by_v1_rules_in_a_transaction() {
    let Some(db) = my(MY_DDL).await else { return };
    v1_record_in_a_transaction!(
        &db.0,
        db.0.pool(),
        my_sets,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?, ?)",
        "tx_answers.my_sets"
    );
}

#[tokio::test]
async fn sqlite_a_v1_record_is_compared_by_v1_rules_in_a_transaction() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    v1_record_in_a_transaction!(
        &db.0,
        db.0.pool(),
        lite_sets,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?1, ?2)",
        "tx_answers.lite_sets"
    );
}

/// Rule 8 in a transaction: a record made without a fingerprint (committed
/// in store mode, as a function with `fingerprint = false` or an older
/// build leaves it) cannot be contradicted: a transactional call with
/// arguments replays it, whatever they are, and the body does not run.
macro_rules! unfingerprinted_record_in_a_transaction {
    ($store:expr, $pool:expr, $sets:ident, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, $scope, "bare").expect("identity");
        recorded(store, &identity, None, b"41").await;
        for n in [1, 5] {
            let items: HashSet<String> = (0..n).map(|i| format!("item-{i}")).collect();
            let mut tx = pool.begin().await.expect("begin");
            let (replay, how) = with_outcome($sets(&mut tx, &tenant, "bare", items)).await;
            tx.commit().await.expect("commit");
            assert_eq!(
                (replay.expect("a record without a fingerprint replays"), how),
                (41, Some(Outcome::Replayed))
            );
        }
        assert_eq!(runs(&tenant), 0, "the body never ran");
    }};
}

#[tokio::test]
async fn pg_a_record_without_a_fingerprint_is_not_contradicted_in_a_transaction() {
    let Some(db) = pg(PG_DDL).await else { return };
    unfingerprinted_record_in_a_transaction!(&db.0, db.0.pool(), pg_sets, "tx_answers.pg_sets");
}

#[tokio::test]
async fn mysql_a_record_without_a_fingerprint_is_not_contradicted_in_a_transaction() {
    let Some(db) = my(MY_DDL).await else { return };
    unfingerprinted_record_in_a_transaction!(&db.0, db.0.pool(), my_sets, "tx_answers.my_sets");
}

#[tokio::test]
async fn sqlite_a_record_without_a_fingerprint_is_not_contradicted_in_a_transaction() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    unfingerprinted_record_in_a_transaction!(&db.0, db.0.pool(), lite_sets, "tx_answers.lite_sets");
}

/// Rule 2 in a transaction: a bad key or tenant is refused before anything
/// runs or is written, and the caller's transaction stays usable; a key at
/// the 255-byte limit (multi-byte characters) is an ordinary key.
macro_rules! bad_keys_in_a_transaction {
    ($store:expr, $pool:expr, $released:ident, $insert:literal, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let too_long = "k".repeat(256);
        let mut tx = pool.begin().await.expect("begin");
        for key in ["", "line\nbreak", "nul\0", too_long.as_str()] {
            let got = $released(&mut tx, &tenant, key, false).await;
            assert!(
                matches!(&got, Err(ChargeError::Idempotency(e)) if e.starts_with("InvalidKey")),
                "key {key:?}: {got:?}"
            );
        }
        let got = $released(&mut tx, "", "k", false).await;
        assert!(
            matches!(&got, Err(ChargeError::Idempotency(e)) if e.starts_with("InvalidTenant")),
            "an empty tenant: {got:?}"
        );
        sqlx::query($insert)
            .bind(&tenant)
            .bind("after")
            .execute(&mut *tx)
            .await
            .expect("the caller's transaction stays usable");
        let longest: String = "ü".repeat(127) + "k";
        assert_eq!(longest.len(), 255);
        let (ran_once, outcome) = with_outcome($released(&mut tx, &tenant, &longest, false)).await;
        assert_eq!((ran_once, outcome), (Ok(1), Some(Outcome::Executed)));
        tx.commit().await.expect("commit");
        assert_eq!(runs(&tenant), 1, "no bad key ran the body");
        let identity = Identity::new(&tenant, $scope, &longest).expect("identity");
        assert!(store.fetch(&identity).await.expect("fetch").is_some());
        let mut tx = pool.begin().await.expect("begin");
        let (replay, outcome) = with_outcome($released(&mut tx, &tenant, &longest, false)).await;
        tx.commit().await.expect("commit");
        assert_eq!((replay, outcome), (Ok(1), Some(Outcome::Replayed)));
    }};
}

#[tokio::test]
async fn pg_bad_keys_are_refused_in_a_transaction_before_anything_runs() {
    let Some(db) = pg(PG_DDL).await else { return };
    bad_keys_in_a_transaction!(
        &db.0,
        db.0.pool(),
        pg_released,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES ($1, $2)",
        "tx_answers.pg_released"
    );
}

#[tokio::test]
async fn mysql_bad_keys_are_refused_in_a_transaction_before_anything_runs() {
    let Some(db) = my(MY_DDL).await else { return };
    bad_keys_in_a_transaction!(
        &db.0,
        db.0.pool(),
        my_released,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?, ?)",
        "tx_answers.my_released"
    );
}

#[tokio::test]
async fn sqlite_bad_keys_are_refused_in_a_transaction_before_anything_runs() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    bad_keys_in_a_transaction!(
        &db.0,
        db.0.pool(),
        lite_released,
        "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?1, ?2)",
        "tx_answers.lite_released"
    );
}

/// Rules 16 and 7 in a transaction: a record whose ttl ran out counts as
/// absent, also when it was made with *other* arguments: a completed one
/// and an abandoned one (its lease and ttl both over) are replaced by the
/// transactional call, which runs the body (no mismatch, nothing of the
/// old record replayed); its answer then replays. `$expire` moves a
/// record's retention (and an in-progress one's lease) to 1970.
macro_rules! expired_other_request_in_a_transaction {
    ($store:expr, $pool:expr, $sets:ident, $expire:literal, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let mut other_request = FingerprintBuilder::new();
        other_request.argument("items", &HashSet::from(["another".to_owned()]));
        let other = other_request
            .finish()
            .expect("fingerprinted")
            .expect("a fingerprint");
        for (key, complete) in [("completed", true), ("abandoned", false)] {
            let identity = Identity::new(&tenant, $scope, key).expect("identity");
            let hour = Duration::from_secs(3600);
            if complete {
                recorded(store, &identity, Some(&other), b"41").await;
            } else {
                acquire(store, &identity, Some(&other), hour, hour).await;
            }
            sqlx::query($expire)
                .bind(&tenant)
                .bind($scope)
                .bind(key)
                .execute(pool)
                .await
                .expect("expire the record");
            assert!(
                store
                    .fetch(&identity)
                    .await
                    .expect("fetch")
                    .expect("planted")
                    .is_expired(),
                "{key}: planted as expired"
            );
        }
        let items: HashSet<String> = (0..3).map(|i| format!("item-{i}")).collect();
        for (n, key) in [(1, "completed"), (2, "abandoned")] {
            let mut tx = pool.begin().await.expect("begin");
            let (fresh, how) = with_outcome($sets(&mut tx, &tenant, key, items.clone())).await;
            tx.commit().await.expect("commit");
            let fresh = fresh.unwrap_or_else(|e| {
                panic!("{key}: an expired record of another request counts as absent: {e:?}")
            });
            assert_eq!((fresh, how), (n, Some(Outcome::Executed)), "{key}");
            let mut tx = pool.begin().await.expect("begin");
            let (replay, how) = with_outcome($sets(&mut tx, &tenant, key, items.clone())).await;
            tx.commit().await.expect("commit");
            assert_eq!(
                (replay.expect("replays"), how),
                (n, Some(Outcome::Replayed))
            );
        }
    }};
}

#[tokio::test]
async fn pg_an_expired_record_of_another_request_counts_as_absent_in_a_transaction() {
    let Some(db) = pg(PG_DDL).await else { return };
    expired_other_request_in_a_transaction!(
        &db.0,
        db.0.pool(),
        pg_sets,
        "UPDATE idempotency_records SET expires_at = 1000,
                lease_expires_at = CASE WHEN state = 'in_progress' THEN 1000
                                        ELSE lease_expires_at END
          WHERE tenant = $1 AND scope = $2 AND key = $3",
        "tx_answers.pg_sets"
    );
}

#[tokio::test]
async fn mysql_an_expired_record_of_another_request_counts_as_absent_in_a_transaction() {
    let Some(db) = my(MY_DDL).await else { return };
    expired_other_request_in_a_transaction!(
        &db.0,
        db.0.pool(),
        my_sets,
        "UPDATE idempotency_records SET expires_at = 1000,
                lease_expires_at = IF(state = 'in_progress', 1000, lease_expires_at)
          WHERE tenant = ? AND scope = ? AND `key` = ?",
        "tx_answers.my_sets"
    );
}

#[tokio::test]
async fn sqlite_an_expired_record_of_another_request_counts_as_absent_in_a_transaction() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    expired_other_request_in_a_transaction!(
        &db.0,
        db.0.pool(),
        lite_sets,
        "UPDATE idempotency_records SET expires_at = 1000,
                lease_expires_at = CASE WHEN state = 'in_progress' THEN 1000
                                        ELSE lease_expires_at END
          WHERE tenant = ?1 AND scope = ?2 AND key = ?3",
        "tx_answers.lite_sets"
    );
}

/// Rules 7, 13 and 12 within one transaction: the call's own uncommitted
/// record answers a second call of the key in the same transaction as any
/// record would: other arguments are a mismatch (the body does not run, the
/// first answer stands), a released error or a refused result leaves the
/// key free for the next call in that same transaction, which runs the body.
macro_rules! one_transaction_many_calls {
    ($store:expr, $pool:expr, $sets:ident, $released:ident, $floats:ident) => {{
        let (_store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let one: HashSet<String> = HashSet::from(["one".to_owned()]);
        let two: HashSet<String> = HashSet::from(["two".to_owned()]);
        let mut tx = pool.begin().await.expect("begin");
        let (first, how) = with_outcome($sets(&mut tx, &tenant, "sets", one.clone())).await;
        assert_eq!((first.expect("runs"), how), (1, Some(Outcome::Executed)));
        let other = $sets(&mut tx, &tenant, "sets", two).await;
        assert!(
            matches!(other, Err(Error::FingerprintMismatch(_))),
            "other arguments in the same transaction: {other:?}"
        );
        let (again, how) = with_outcome($sets(&mut tx, &tenant, "sets", one)).await;
        assert_eq!((again.expect("replays"), how), (1, Some(Outcome::Replayed)));

        let failed = $released(&mut tx, &tenant, "released", true).await;
        assert_eq!(failed, Err(ChargeError::Unavailable));
        let (ran, how) = with_outcome($released(&mut tx, &tenant, "released", false)).await;
        assert_eq!(
            (ran, how),
            (Ok(3), Some(Outcome::Executed)),
            "the key was freed"
        );

        let refused = $floats(&mut tx, &tenant, "floats", f64::NAN).await;
        assert!(
            matches!(refused, Err(Error::ResultNotFaithful { .. })),
            "{refused:?}"
        );
        let (ran, how) = with_outcome($floats(&mut tx, &tenant, "floats", 2.5)).await;
        assert_eq!((ran.expect("runs"), how), (2.5, Some(Outcome::Executed)));
        tx.commit().await.expect("commit");
        assert_eq!(runs(&tenant), 5, "sets once, released twice, floats twice");
    }};
}

#[tokio::test]
async fn pg_calls_of_one_key_in_one_transaction_answer_as_its_record_says() {
    let Some(db) = pg(PG_DDL).await else { return };
    one_transaction_many_calls!(&db.0, db.0.pool(), pg_sets, pg_released, pg_floats);
}

#[tokio::test]
async fn mysql_calls_of_one_key_in_one_transaction_answer_as_its_record_says() {
    let Some(db) = my(MY_DDL).await else { return };
    one_transaction_many_calls!(&db.0, db.0.pool(), my_sets, my_released, my_floats);
}

#[tokio::test]
async fn sqlite_calls_of_one_key_in_one_transaction_answer_as_its_record_says() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    one_transaction_many_calls!(&db.0, db.0.pool(), lite_sets, lite_released, lite_floats);
}

/// The recover hook of the `*_declines` functions: the crashed attempt's
/// charge was declined at the gateway, a final answer.
async fn declined_at_the_gateway(takeover: &Takeover) -> Result<Recovery<u64>, ChargeError> {
    Err(ChargeError::Declined(format!(
        "declined on attempt {}",
        takeover.attempt() - 1
    )))
}

macro_rules! declining {
    ($db:ty, $scope:literal, $insert:literal, $name:ident) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, ttl = "1h",
                                             errors = record, recover = declined_at_the_gateway)]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
        ) -> Result<u64, ChargeError> {
            sqlx::query($insert)
                .bind(tenant)
                .bind(key)
                .execute(&mut **tx)
                .await
                .expect("business write");
            Ok(u64::from(ran(tenant)))
        }
    };
}

declining!(
    Postgres,
    "tx_answers.pg_declines",
    "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES ($1, $2)",
    pg_declines
);
declining!(
    MySql,
    "tx_answers.my_declines",
    "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?, ?)",
    my_declines
);
declining!(
    Sqlite,
    "tx_answers.lite_declines",
    "INSERT INTO idempotent_test_tx_answers (tenant, idem_key) VALUES (?1, ?2)",
    lite_declines
);

/// Rules 20 and 13 in a transaction: a takeover whose hook answers an error,
/// with `errors = record`, records that error as the key's final answer in
/// the caller's transaction (marked recovered), without running the body:
/// rolled back, the stuck record is back as it was; committed, every retry
/// replays the error. `$end_lease` moves the planted owner's lease to 1970.
macro_rules! hook_error_recorded_in_a_transaction {
    ($store:expr, $pool:expr, $declines:ident, $end_lease:literal, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let identity = Identity::new(&tenant, $scope, "stuck").expect("identity");
        acquire(
            store,
            &identity,
            None,
            Duration::from_secs(3600),
            Duration::from_secs(3600),
        )
        .await;
        sqlx::query($end_lease)
            .bind(&tenant)
            .bind($scope)
            .bind("stuck")
            .execute(pool)
            .await
            .expect("end the crashed owner's lease");
        let declined = Err(ChargeError::Declined("declined on attempt 1".into()));

        let mut tx = pool.begin().await.expect("begin");
        let (got, how) = with_outcome($declines(&mut tx, &tenant, "stuck")).await;
        assert_eq!((got, how), (declined.clone(), Some(Outcome::Recovered)));
        tx.rollback().await.expect("rollback");
        let back = store
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        assert_eq!((back.state, back.attempt), (RecordState::InProgress, 1));

        let mut tx = pool.begin().await.expect("begin");
        let (got, how) = with_outcome($declines(&mut tx, &tenant, "stuck")).await;
        assert_eq!((got, how), (declined.clone(), Some(Outcome::Recovered)));
        tx.commit().await.expect("commit");
        let done = store
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        assert_eq!(
            (done.state, done.attempt, done.recovered),
            (RecordState::Complete, 2, true)
        );
        assert!(
            done.outcome.is_some_and(|o| o.is_error),
            "an error recorded"
        );
        let mut tx = pool.begin().await.expect("begin");
        let (got, how) = with_outcome($declines(&mut tx, &tenant, "stuck")).await;
        tx.commit().await.expect("commit");
        assert_eq!((got, how), (declined, Some(Outcome::Replayed)));
        assert_eq!(runs(&tenant), 0, "the body never ran");
    }};
}

#[tokio::test]
async fn pg_a_hook_error_is_recorded_in_the_transaction_with_errors_record() {
    let Some(db) = pg(PG_DDL).await else { return };
    hook_error_recorded_in_a_transaction!(
        &db.0,
        db.0.pool(),
        pg_declines,
        "UPDATE idempotency_records SET lease_expires_at = 1000
          WHERE tenant = $1 AND scope = $2 AND key = $3",
        "tx_answers.pg_declines"
    );
}

#[tokio::test]
async fn mysql_a_hook_error_is_recorded_in_the_transaction_with_errors_record() {
    let Some(db) = my(MY_DDL).await else { return };
    hook_error_recorded_in_a_transaction!(
        &db.0,
        db.0.pool(),
        my_declines,
        "UPDATE idempotency_records SET lease_expires_at = 1000
          WHERE tenant = ? AND scope = ? AND `key` = ?",
        "tx_answers.my_declines"
    );
}

#[tokio::test]
async fn sqlite_a_hook_error_is_recorded_in_the_transaction_with_errors_record() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    hook_error_recorded_in_a_transaction!(
        &db.0,
        db.0.pool(),
        lite_declines,
        "UPDATE idempotency_records SET lease_expires_at = 1000
          WHERE tenant = ?1 AND scope = ?2 AND key = ?3",
        "tx_answers.lite_declines"
    );
}

/// Rule 1 in a transaction: look-alike keys and tenants (case, trailing
/// spaces, SQL wildcards, composed and decomposed accents) are distinct
/// identities: each runs its body once in the caller's transaction and
/// then replays its own answer, never another's.
macro_rules! look_alikes_in_a_transaction {
    ($pool:expr, $released:ident) => {{
        let pool = $pool;
        let base = fresh_tenant();
        let tenants = [base.clone(), format!("{base} "), base.to_uppercase()];
        let keys = [
            "k",
            "K",
            "k ",
            "k  ",
            "k_",
            "k%",
            "caf\u{e9}",
            "cafe\u{301}",
        ];
        let mut answers = Vec::new();
        let mut tx = pool.begin().await.expect("begin");
        for tenant in &tenants {
            for key in keys {
                let (got, how) = with_outcome($released(&mut tx, tenant, key, false)).await;
                let got = got.unwrap_or_else(|e| panic!("{tenant:?} {key:?}: {e:?}"));
                assert_eq!(how, Some(Outcome::Executed), "{tenant:?} {key:?} is fresh");
                answers.push((tenant.clone(), key, got));
            }
        }
        tx.commit().await.expect("commit");
        let mut tx = pool.begin().await.expect("begin");
        for (tenant, key, first) in &answers {
            let (got, how) = with_outcome($released(&mut tx, tenant, key, false)).await;
            assert_eq!(
                (got, how),
                (Ok(*first), Some(Outcome::Replayed)),
                "{tenant:?} {key:?} replays its own answer"
            );
        }
        tx.commit().await.expect("commit");
    }};
}

#[tokio::test]
async fn pg_look_alike_keys_and_tenants_are_distinct_in_a_transaction() {
    let Some(db) = pg(PG_DDL).await else { return };
    look_alikes_in_a_transaction!(db.0.pool(), pg_released);
}

#[tokio::test]
async fn mysql_look_alike_keys_and_tenants_are_distinct_in_a_transaction() {
    let Some(db) = my(MY_DDL).await else { return };
    look_alikes_in_a_transaction!(db.0.pool(), my_released);
}

#[tokio::test]
async fn sqlite_look_alike_keys_and_tenants_are_distinct_in_a_transaction() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    look_alikes_in_a_transaction!(db.0.pool(), lite_released);
}

/// Rule 11 on PostgreSQL in transactional mode: lease decisions use the
/// database's clock as it reads when the statement runs, not `now()`, which
/// PostgreSQL freezes at the start of the transaction. A crashed owner's
/// lease that ran out after the caller's transaction began (but before the
/// call) is over: the call takes the record over and runs the body, instead
/// of finding it in progress for as long as the transaction has been open.
#[tokio::test]
async fn pg_a_lease_that_ran_out_after_the_transaction_began_is_over_in_it() {
    let Some(db) = pg(PG_DDL).await else { return };
    let (store, pool) = (&db.0, db.0.pool());
    let tenant = fresh_tenant();
    let scope = "tx_answers.pg_released";
    let identity = Identity::new(&tenant, scope, "clock").expect("identity");
    let hour = Duration::from_secs(3600);
    acquire(store, &identity, None, hour, hour).await;

    let mut tx = pool.begin().await.expect("begin");
    let began: i64 =
        sqlx::query_scalar("SELECT (extract(epoch FROM transaction_timestamp()) * 1000)::BIGINT")
            .fetch_one(&mut *tx)
            .await
            .expect("the transaction's start");
    // The crashed owner's lease ends just after the transaction began ...
    let lease_end = began + 50;
    sqlx::query(
        "UPDATE idempotency_records SET lease_expires_at = $4
          WHERE tenant = $1 AND scope = $2 AND key = $3",
    )
    .bind(&tenant)
    .bind(scope)
    .bind("clock")
    .bind(lease_end)
    .execute(pool)
    .await
    .expect("move the lease's end");
    // ... and, on the database's clock, is over before the call.
    for _ in 0..1_000 {
        let snapshot = store
            .fetch(&identity)
            .await
            .expect("fetch")
            .expect("record");
        if snapshot.now_ms > lease_end {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (got, how) = with_outcome(pg_released(&mut tx, &tenant, "clock", false)).await;
    tx.commit().await.expect("commit");
    assert_eq!(
        (got, how),
        (Ok(1), Some(Outcome::Executed)),
        "the lease is over on the database's clock: the record is taken over"
    );
    let done = store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("record");
    assert_eq!((done.state, done.attempt), (RecordState::Complete, 2));
}

macro_rules! big_answers {
    ($db:ty, $scope:literal, $name:ident) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(size), ttl = "1h")]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            size: usize,
        ) -> Result<String, Error> {
            ran(tenant);
            Ok("x".repeat(size))
        }
    };
}

big_answers!(Postgres, "tx_answers.pg_big", pg_big);
big_answers!(MySql, "tx_answers.my_big", my_big);
big_answers!(Sqlite, "tx_answers.lite_big", lite_big);

/// Rule 12 at the result's size limit in a transaction: an answer of
/// exactly the limit (the smaller of `MAX_RESULT_BYTES` and what the store
/// can record, as JSON) is recorded in the caller's transaction and
/// replayed; one byte more is `ResultTooLarge` naming the scope, nothing is
/// recorded, the transaction stays usable and the key is free once it
/// commits.
macro_rules! largest_answer_in_a_transaction {
    ($store:expr, $pool:expr, $big:ident, $scope:literal) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let limit = store
            .max_result_bytes()
            .min(idempotent_runtime::MAX_RESULT_BYTES);
        // The JSON of a string of n ASCII letters is n + 2 bytes.
        let mut tx = pool.begin().await.expect("begin");
        let (first, how) = with_outcome($big(&mut tx, &tenant, "max", limit - 2)).await;
        assert_eq!(
            (first.expect("recorded").len(), how),
            (limit - 2, Some(Outcome::Executed))
        );
        match $big(&mut tx, &tenant, "over", limit - 1).await {
            Err(Error::ResultTooLarge { scope, .. }) => assert_eq!(scope, $scope),
            other => panic!("one byte over: {:?}", other.map(|a| a.len())),
        }
        sqlx::query("SELECT 1")
            .execute(&mut *tx)
            .await
            .expect("the caller's transaction stays usable");
        tx.commit().await.expect("commit");
        let over = Identity::new(&tenant, $scope, "over").expect("identity");
        assert_eq!(
            store.fetch(&over).await.expect("fetch"),
            None,
            "nothing recorded"
        );

        let mut tx = pool.begin().await.expect("begin");
        let (again, how) = with_outcome($big(&mut tx, &tenant, "max", limit - 2)).await;
        assert_eq!(
            (again.expect("replayed").len(), how),
            (limit - 2, Some(Outcome::Replayed))
        );
        let (fits, how) = with_outcome($big(&mut tx, &tenant, "over", 10)).await;
        assert_eq!(
            (fits.expect("runs").len(), how),
            (10, Some(Outcome::Executed))
        );
        tx.commit().await.expect("commit");
        assert_eq!(runs(&tenant), 3);
    }};
}

#[tokio::test]
async fn pg_the_largest_answer_is_recorded_in_a_transaction_and_one_byte_more_refused() {
    let Some(db) = pg(PG_DDL).await else { return };
    largest_answer_in_a_transaction!(&db.0, db.0.pool(), pg_big, "tx_answers.pg_big");
}

#[tokio::test]
async fn mysql_the_largest_answer_is_recorded_in_a_transaction_and_one_byte_more_refused() {
    let Some(db) = my(MY_DDL).await else { return };
    largest_answer_in_a_transaction!(&db.0, db.0.pool(), my_big, "tx_answers.my_big");
}

#[tokio::test]
async fn sqlite_the_largest_answer_is_recorded_in_a_transaction_and_one_byte_more_refused() {
    let db = lite("tx-answers", SQLITE_DDL).await;
    largest_answer_in_a_transaction!(&db.0, db.0.pool(), lite_big, "tx_answers.lite_big");
}
