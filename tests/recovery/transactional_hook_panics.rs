//! Rule 20 in transactional mode on SQLite and MariaDB, as
//! `takeover_edges.rs` checks it on PostgreSQL: a hook that panics takes the
//! caller's transaction down with it (dropped: rolled back); the takeover is
//! undone, and the next call in a new transaction is asked again, as the
//! same attempt and told the same previous start, before any body runs.

use crate::common::ledger::Ledger;
use crate::common::servers::{fresh_tenant, mysql_store_or_skip};
use crate::transactional::mysql_begin_in_the_next_second;
use idempotent_runtime::{
    idempotent, with_outcome, Error, Identity, Outcome, Recovery, SqliteStore, Store, Takeover,
};
use std::collections::HashSet;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

/// What the hook was told (attempt, previous start), and body runs.
type Seen = (Vec<(u32, i64)>, usize);
/// Per tenant: what the hook was told, and a mark per body run.
static TOLD: Ledger<(u32, i64)> = Ledger::new();
static RAN: Ledger<()> = Ledger::new();
static PANICKED: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);

fn seen(tenant: &str) -> Seen {
    (TOLD.of(tenant), RAN.of(tenant).len())
}

/// Panics the first time it is asked for a tenant, then answers `Run`.
async fn panics_once(t: &Takeover) -> Result<Recovery<u32>, Error> {
    TOLD.record(
        t.tenant(),
        (t.attempt(), t.previous_attempt_started_at_ms()),
    );
    if PANICKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(t.tenant().to_owned())
    {
        panic!("the hook's client library panicked");
    }
    Ok(Recovery::Run)
}

fn ran(tenant: &str) {
    RAN.record(tenant, ());
}

#[idempotent(scope = "huntb.tx_panic_sqlite", key = key, tenant = tenant, tx = tx,
             lease = "300ms", in_progress = reject, recover = panics_once)]
async fn sqlite_in_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
) -> Result<u32, Error> {
    ran(tenant);
    Ok(9)
}

#[idempotent(scope = "huntb.tx_panic_mysql", key = key, tenant = tenant, tx = tx,
             lease = "300ms", in_progress = reject, recover = panics_once)]
async fn mysql_in_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
) -> Result<u32, Error> {
    ran(tenant);
    Ok(9)
}

/// What a crashed owner leaves: in progress, its lease over. Its start.
async fn crashed(store: &dyn Store, identity: &Identity) -> i64 {
    crate::common::records::acquire(
        store,
        identity,
        None,
        Duration::ZERO,
        Duration::from_secs(3600),
    )
    .await;
    store
        .fetch(identity)
        .await
        .expect("fetch")
        .expect("record")
        .attempt_started_at_ms
}

macro_rules! a_hook_panicking_in_a_transaction {
    ($store:expr, $scope:literal, $begin:expr, $call:ident) => {{
        let store = $store;
        let tenant = fresh_tenant();
        let identity = Identity::new(tenant.as_str(), $scope, "k").expect("id");
        let first_start = crashed(&store, &identity).await;
        let panicked = {
            use futures::FutureExt;
            std::panic::AssertUnwindSafe(async {
                let mut tx = $begin(&store).await;
                let _ = $call(&mut tx, &tenant, "k").await;
                tx.commit().await.expect("commit");
            })
            .catch_unwind()
            .await
        };
        assert!(panicked.is_err(), "the hook's panic propagates");
        let s = store.fetch(&identity).await.unwrap().expect("record");
        assert_eq!(
            s.attempt, 1,
            "the takeover was rolled back with the transaction"
        );
        let mut tx = $begin(&store).await;
        let (got, outcome) = with_outcome($call(&mut tx, &tenant, "k")).await;
        tx.commit().await.expect("commit");
        assert_eq!((got.expect("Run"), outcome), (9, Some(Outcome::Executed)));
        assert_eq!(
            seen(&tenant),
            (vec![(2, first_start), (2, first_start)], 1),
            "asked again as attempt 2 before the one body run"
        );
        let s = store.fetch(&identity).await.unwrap().expect("record");
        assert_eq!(
            (s.state, s.attempt),
            (idempotent_runtime::RecordState::Complete, 2)
        );
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_hook_panicking_in_a_transaction_is_asked_again_before_any_body_runs() {
    let store = SqliteStore::connect(&crate::common::scratch::sqlite_url("tx_hook_panics"))
        .await
        .expect("sqlite");
    a_hook_panicking_in_a_transaction!(
        store,
        "huntb.tx_panic_sqlite",
        |s: &SqliteStore| {
            let pool = s.pool().clone();
            async move { pool.begin_with("BEGIN IMMEDIATE").await.expect("begin") }
        },
        sqlite_in_tx
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_hook_panicking_in_a_transaction_is_asked_again_before_any_body_runs() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    a_hook_panicking_in_a_transaction!(
        store,
        "huntb.tx_panic_mysql",
        |s: &idempotent_runtime::MySqlStore| mysql_begin_in_the_next_second(s.pool().clone()),
        mysql_in_tx
    );
}
