//! Rules 15 and 16 at the longest durations the attribute accepts (over
//! 2^63 milliseconds), in transactional mode: the reservation and the
//! completion written in the caller's transaction neither overflow the
//! database's integers (a store error) nor wrap round to a time long past (a
//! record expired at once, whose retry would run the body again). The record
//! is replayed in a later transaction, and a duplicate in another
//! transaction is refused as in progress while the owner's is open. (Store
//! mode: `public_api_edges::the_longest_ttl_lease_and_wait_replay`.)

use crate::common::servers::fresh_tenant;
use crate::tx_fixtures::{hold_here, lite, my, pg, ran, runs, Hold};
use idempotent_runtime::{idempotent, with_outcome, Error, Identity, Outcome, RecordState, Store};

macro_rules! forever_tx {
    ($name:ident, $db:ty, $scope:literal) => {
        #[idempotent(scope = $scope, key = key, tenant = tenant, tx = tx, skip(hold),
                     ttl = "300000000years", lease = "300000000years", in_progress = reject)]
        async fn $name(
            tx: &mut sqlx::Transaction<'_, $db>,
            tenant: &str,
            key: &str,
            hold: Option<&Hold>,
        ) -> Result<u32, Error> {
            let run = ran(tenant);
            hold_here(hold).await;
            Ok(run)
        }
    };
}

forever_tx!(pg_forever, sqlx::Postgres, "tx_forever.pg");
forever_tx!(my_forever, sqlx::MySql, "tx_forever.my");
forever_tx!(lite_forever, sqlx::Sqlite, "tx_forever.lite");

macro_rules! longest_durations_in_a_transaction {
    ($store:expr, $pool:expr, $f:ident, $scope:literal, $duplicate_beside:expr) => {{
        let (store, pool) = ($store, $pool);
        let tenant = fresh_tenant();
        let id = Identity::new(&tenant, $scope, "k").expect("identity");

        let mut tx = pool.begin().await.expect("begin");
        let (first, how) = with_outcome($f(&mut tx, &tenant, "k", None)).await;
        assert_eq!((first.expect("runs"), how), (1, Some(Outcome::Executed)));
        tx.commit().await.expect("commit");
        let snapshot = store.fetch(&id).await.expect("fetch").expect("recorded");
        assert_eq!(snapshot.state, RecordState::Complete);
        assert!(!snapshot.is_expired(), "kept, not expired: {snapshot:?}");

        let mut tx = pool.begin().await.expect("begin");
        let (again, how) = with_outcome($f(&mut tx, &tenant, "k", None)).await;
        assert_eq!((again.expect("replays"), how), (1, Some(Outcome::Replayed)));
        tx.commit().await.expect("commit");

        if $duplicate_beside {
            // An owner's transaction open on another key; a duplicate in a
            // transaction of its own is refused as in progress.
            let hold = Hold::default();
            let owner = async {
                let mut tx = pool.begin().await.expect("begin");
                let answer = $f(&mut tx, &tenant, "open", Some(&hold)).await;
                tx.commit().await.expect("commit");
                answer
            };
            let duplicate = async {
                hold.reached.notified().await;
                let mut tx = pool.begin().await.expect("begin");
                let answer = $f(&mut tx, &tenant, "open", None).await;
                tx.rollback().await.expect("rollback");
                hold.go.notify_one();
                answer
            };
            let (owned, refused) = tokio::join!(owner, duplicate);
            assert_eq!(owned.expect("the owner's answer"), 2);
            assert!(
                matches!(refused, Err(Error::InProgress { .. })),
                "{refused:?}"
            );
            let mut tx = pool.begin().await.expect("begin");
            let (again, how) = with_outcome($f(&mut tx, &tenant, "open", None)).await;
            assert_eq!((again.expect("replays"), how), (2, Some(Outcome::Replayed)));
            tx.commit().await.expect("commit");
        }
        runs(&tenant)
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_the_longest_ttl_and_lease_in_a_transaction() {
    let Some(db) = pg("SELECT 1").await else {
        return;
    };
    let ran =
        longest_durations_in_a_transaction!(&db.0, db.0.pool(), pg_forever, "tx_forever.pg", true);
    assert_eq!(ran, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_the_longest_ttl_and_lease_in_a_transaction() {
    let Some(db) = my("SELECT 1").await else {
        return;
    };
    let ran =
        longest_durations_in_a_transaction!(&db.0, db.0.pool(), my_forever, "tx_forever.my", true);
    assert_eq!(ran, 2);
}

/// SQLite: one writer at a time, so no duplicate beside an open owner here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_longest_ttl_and_lease_in_a_transaction() {
    let db = lite("tx-forever", "SELECT 1").await;
    let ran = longest_durations_in_a_transaction!(
        &db.0,
        db.0.pool(),
        lite_forever,
        "tx_forever.lite",
        false
    );
    assert_eq!(ran, 1);
}
