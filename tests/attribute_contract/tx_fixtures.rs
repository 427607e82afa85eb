//! What the transactional-mode test files share: a body held open by a
//! handshake, and the three databases of transactional mode, each a store
//! with the test's business table made.

use crate::common;
use common::servers::{mysql_store_or_skip, pg_store_or_skip};
use tokio::sync::Notify;

/// The expiry a test gives a record: a time in 1970, long past on any clock.
pub(crate) const LONG_AGO_MS: i64 = 1_000;

/// Bodies run per tenant (committed or not): each test gives its calls a
/// fresh tenant, so the tests sharing the count never see each other's.
static RUNS: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<String, u32>>> =
    std::sync::LazyLock::new(Default::default);

/// Counts one run of a body for `tenant`; answers the count so far.
pub(crate) fn ran(tenant: &str) -> u32 {
    let mut runs = RUNS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let n = runs.entry(tenant.to_owned()).or_default();
    *n += 1;
    *n
}

/// How many times a body ran for `tenant`.
pub(crate) fn runs(tenant: &str) -> u32 {
    RUNS.lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .get(tenant)
        .copied()
        .unwrap_or(0)
}

/// Holds a body open: it notifies `reached` once the reservation is held,
/// then waits for `go`.
#[derive(Default)]
pub(crate) struct Hold {
    pub(crate) reached: Notify,
    pub(crate) go: Notify,
}

pub(crate) async fn hold_here(hold: Option<&Hold>) {
    if let Some(hold) = hold {
        hold.reached.notify_one();
        hold.go.notified().await;
    }
}

/// Once the owner's body holds (`hold.reached`), four duplicates `one()` at
/// once; half a second after they set out the owner's body goes on (they
/// are on their way; any order is correct). Their answers.
pub(crate) async fn four_duplicates_then_go<F: std::future::Future>(
    hold: &Hold,
    one: impl Fn() -> F,
) -> [F::Output; 4] {
    hold.reached.notified().await;
    let let_go = async {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        hold.go.notify_one();
    };
    let (a, b, c, d, ()) = tokio::join!(one(), one(), one(), one(), let_go);
    [a, b, c, d]
}

pub(crate) struct Pg(pub(crate) idempotent_runtime::PgStore);
pub(crate) struct My(pub(crate) idempotent_runtime::MySqlStore);
/// A SQLite store on a file of its own, in a scratch folder removed on drop.
pub(crate) struct Lite(
    pub(crate) idempotent_runtime::SqliteStore,
    pub(crate) std::path::PathBuf,
);

impl Drop for Lite {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

/// The test PostgreSQL database's store, with `ddl`'s table (`None`: no server).
pub(crate) async fn pg(ddl: &str) -> Option<Pg> {
    let store = pg_store_or_skip().await?;
    common::servers::pg_create_tables(store.pool(), ddl)
        .await
        .expect("ddl");
    Some(Pg(store))
}

/// The test MariaDB database's store, with `ddl`'s table (`None`: no server).
pub(crate) async fn my(ddl: &str) -> Option<My> {
    let store = mysql_store_or_skip().await?;
    sqlx::query(ddl).execute(store.pool()).await.expect("ddl");
    Some(My(store))
}

/// A SQLite file of its own (in a scratch folder named after `name`), with
/// `ddl`'s table.
pub(crate) async fn lite(name: &str, ddl: &str) -> Lite {
    let dir = common::scratch::dir(name);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let url = format!("sqlite:{}?mode=rwc", dir.join("tx.db").display());
    let store = idempotent_runtime::SqliteStore::connect(&url)
        .await
        .expect("open");
    sqlx::query(ddl).execute(store.pool()).await.expect("ddl");
    Lite(store, dir)
}
