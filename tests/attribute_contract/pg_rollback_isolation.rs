//! Rule 15's last sentence on PostgreSQL at the stricter isolation levels:
//! "a caller's rollback never turns waiting duplicates into deadlock
//! errors". A transactional owner (REPEATABLE READ or SERIALIZABLE) holds a
//! key while four duplicates, each in a transaction of its own at the same
//! level, wait for it (`wait`); the owner rolls back. Nobody waits forever
//! and nobody is told `Error::Store` (a deadlock, or any other store error):
//! each duplicate runs the body, replays, or is refused with an answer the
//! README names for these levels (`StaleSnapshot`, `InProgress`), which a
//! retry in a new transaction turns into the replay. The body's effects are
//! committed once. (READ COMMITTED: `transactional_connections`; MariaDB at
//! every level: `transactional_races`.)

use crate::common::servers::fresh_tenant;
use crate::tx_fixtures::{four_duplicates_then_go, hold_here, pg, ran, runs, Hold};
use idempotent_runtime::{idempotent, with_outcome, Error, Outcome};
use std::time::Duration;

const DDL: &str = "CREATE TABLE IF NOT EXISTS pg_rollback_isolation_rows (tenant TEXT NOT NULL)";

#[idempotent(scope = "pg_rollback_isolation.charge", key = key, tenant = tenant, tx = tx,
             skip(hold), ttl = "1h", in_progress = wait("30s"))]
async fn charge(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
    hold: Option<&Hold>,
) -> Result<u32, Error> {
    sqlx::query("INSERT INTO pg_rollback_isolation_rows (tenant) VALUES ($1)")
        .bind(tenant)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("postgres", "body", e)))?;
    let run = ran(tenant);
    hold_here(hold).await;
    Ok(run)
}

/// What one duplicate ended with, after its retries.
#[derive(Debug, Default)]
struct Ended {
    executed: bool,
    refusals: Vec<String>,
    value: Option<u32>,
}

async fn owner_rollback_with_waiters(begin: &'static str) {
    let Some(db) = pg(DDL).await else { return };
    let pool = db.0.pool();
    let tenant = fresh_tenant();
    let hold = Hold::default();

    let owner = async {
        let mut tx = pool.begin_with(begin).await.expect("begin");
        let answer = charge(&mut tx, &tenant, "k", Some(&hold)).await;
        tx.rollback().await.expect("the owner rolls back");
        answer
    };
    let one = || async {
        let mut ended = Ended::default();
        for _ in 0..20 {
            let mut tx = pool.begin_with(begin).await.expect("begin");
            let (answer, how) = with_outcome(charge(&mut tx, &tenant, "k", None)).await;
            match answer {
                Ok(v) => {
                    tx.commit()
                        .await
                        .expect("the duplicate's transaction commits");
                    ended.executed = how == Some(Outcome::Executed);
                    ended.value = Some(v);
                    return ended;
                }
                Err(e @ (Error::StaleSnapshot { .. } | Error::InProgress { .. })) => {
                    ended.refusals.push(e.to_string());
                    tx.rollback().await.expect("rollback after a refusal");
                }
                Err(e) => panic!("{begin}: a waiting duplicate got {e:?}"),
            }
        }
        panic!("{begin}: 20 tries without an answer: {ended:?}");
    };
    let duplicates = four_duplicates_then_go(&hold, one);
    let (owned, ended) = tokio::time::timeout(Duration::from_secs(120), async {
        tokio::join!(owner, duplicates)
    })
    .await
    .unwrap_or_else(|_| panic!("{begin}: nobody waits forever"));
    assert_eq!(owned.expect("the owner's body ran"), 1);
    eprintln!("{begin}: {ended:?}");
    let executed: Vec<_> = ended.iter().filter(|e| e.executed).collect();
    assert_eq!(executed.len(), 1, "{begin}: {ended:?}");
    for e in &ended {
        assert_eq!(e.value, Some(2), "{begin}: {ended:?}");
    }
    assert_eq!(runs(&tenant), 2, "{begin}: the owner's run and one more");
    let rows: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM pg_rollback_isolation_rows WHERE tenant = $1")
            .bind(&tenant)
            .fetch_one(pool)
            .await
            .expect("count");
    assert_eq!(rows, 1, "{begin}: one body's effects committed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_repeatable_read_owner_rollback_hands_the_key_on_without_deadlocks() {
    owner_rollback_with_waiters("BEGIN ISOLATION LEVEL REPEATABLE READ").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_serializable_owner_rollback_hands_the_key_on_without_deadlocks() {
    owner_rollback_with_waiters("BEGIN ISOLATION LEVEL SERIALIZABLE").await;
}
