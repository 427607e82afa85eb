//! Reaching the PostgreSQL, MariaDB/MySQL and NATS servers the tests run against.
//!
//! URLs come from `IDEMPOTENT_PG_URL` / `IDEMPOTENT_MYSQL_URL` /
//! `IDEMPOTENT_NATS_URL`, defaulting to the local servers. An unreachable server fails the test when
//! `IDEMPOTENT_REQUIRE_SERVERS=1` (CI); otherwise the test prints a loud
//! SKIPPED line and passes.
#![allow(dead_code)]

use idempotent_runtime::{MySqlStore, PgStore};

/// The default PostgreSQL URL of the development machines.
pub const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The default MariaDB URL of the development machines.
pub const DEFAULT_MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// The default NATS URL of the development machines (JetStream enabled:
/// `nats-server -js -a 127.0.0.1 -p 4222`).
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// The PostgreSQL URL the tests use.
pub fn pg_url() -> String {
    std::env::var("IDEMPOTENT_PG_URL").unwrap_or_else(|_| DEFAULT_PG_URL.to_owned())
}

/// The MySQL/MariaDB URL the tests use.
pub fn mysql_url() -> String {
    std::env::var("IDEMPOTENT_MYSQL_URL").unwrap_or_else(|_| DEFAULT_MYSQL_URL.to_owned())
}

/// The NATS URL the tests use.
pub fn nats_url() -> String {
    std::env::var("IDEMPOTENT_NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned())
}

/// Whether an unreachable server must fail the run.
pub fn servers_required() -> bool {
    std::env::var("IDEMPOTENT_REQUIRE_SERVERS").is_ok_and(|v| v == "1")
}

fn unreachable(what: &str, env: &str, url: &str, error: &dyn std::fmt::Display) {
    if servers_required() {
        panic!(
            "{what} is unreachable at {url} ({error}); IDEMPOTENT_REQUIRE_SERVERS=1, so this fails. \
             Start the server or point {env} at one."
        );
    }
    eprintln!(
        "\n!!!!!!!! SKIPPED: {what} is unreachable at {url} ({error}); set {env} or start the server. \
         (Set IDEMPOTENT_REQUIRE_SERVERS=1 to make this a failure.)\n"
    );
}

/// The test server's URL with `schema` first on its connections' search
/// path: a store opened on it keeps its records table (and migration
/// history) there.
pub fn pg_url_in_schema(schema: &str) -> String {
    let base = pg_url();
    let separator = if base.contains('?') { '&' } else { '?' };
    format!("{base}{separator}options=-c%20search_path%3D{schema}")
}

/// A new schema of its own on the test server, named `<prefix>_<uuid>`:
/// an admin connection (to drop it afterwards), its name, and a URL with it
/// on the search path ([`pg_url_in_schema`]).
pub async fn pg_schema_of_its_own(prefix: &str) -> (sqlx::PgConnection, String, String) {
    let schema = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&pg_url())
        .await
        .expect("connect");
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&mut admin)
        .await
        .expect("create schema");
    let url = pg_url_in_schema(&schema);
    (admin, schema, url)
}

/// A pool of one connection on the test server with `schema` first on its
/// search path, named after it (`application_name`, so a test can find its
/// session in `pg_stat_activity`): for a store made `from_pool` whose one
/// connection the test's "application code" shares.
pub async fn pg_one_connection_pool_in(schema: &str) -> sqlx::PgPool {
    let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&pg_url())
        .expect("url")
        .application_name(schema)
        .options([("search_path", schema)]);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .expect("pool")
}

/// Runs `check` with the URL of a brand-new database on the PostgreSQL test
/// server (named `<prefix>_<uuid>`), on a task of its own, then drops the
/// database (`WITH (FORCE)`: whatever the check left connected) and
/// re-raises what the check panicked with: the database goes whatever the
/// check asserted.
#[allow(dead_code)] // not every test binary has such a test
pub async fn pg_with_fresh_database<F, C>(prefix: &str, check: C)
where
    C: FnOnce(String) -> F,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    use sqlx::Executor;
    let admin_url = pg_url();
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&admin_url)
        .await
        .expect("admin connection");
    let db = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    admin
        .execute(format!("CREATE DATABASE {db}").as_str())
        .await
        .expect("create database");
    let url = match admin_url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{db}"),
        None => panic!("url {admin_url}"),
    };
    let checked = tokio::spawn(check(url)).await;
    admin
        .execute(format!("DROP DATABASE {db} WITH (FORCE)").as_str())
        .await
        .expect("drop the database");
    if let Err(e) = checked {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// A `PgStore` on the test server, or `None` (after a loud SKIPPED line).
pub async fn pg_store_or_skip() -> Option<PgStore> {
    let url = pg_url();
    match PgStore::connect(&url).await {
        Ok(store) => Some(store),
        Err(e) => {
            unreachable("PostgreSQL", "IDEMPOTENT_PG_URL", &url, &e);
            None
        }
    }
}

/// A `MySqlStore` on the test server, or `None` (after a loud SKIPPED line).
pub async fn mysql_store_or_skip() -> Option<MySqlStore> {
    let url = mysql_url();
    match MySqlStore::connect(&url).await {
        Ok(store) => Some(store),
        Err(e) => {
            unreachable("MySQL/MariaDB", "IDEMPOTENT_MYSQL_URL", &url, &e);
            None
        }
    }
}

/// Every store, named (`memory`, `sqlite`, `postgres`, `mariadb`): memory,
/// a fresh SQLite file named after `what`, and the PostgreSQL and MariaDB
/// test servers (each skipped, loudly, when unreachable and not required).
pub async fn every_store(what: &str) -> Vec<(&'static str, Box<dyn idempotent_runtime::Store>)> {
    let mut stores: Vec<(&'static str, Box<dyn idempotent_runtime::Store>)> = vec![
        ("memory", Box::new(idempotent_runtime::MemoryStore::new())),
        (
            "sqlite",
            Box::new(
                idempotent_runtime::SqliteStore::connect(&crate::common::scratch::sqlite_url(what))
                    .await
                    .expect("SQLite file"),
            ),
        ),
    ];
    if let Some(pg) = pg_store_or_skip().await {
        stores.push(("postgres", Box::new(pg)));
    }
    if let Some(my) = mysql_store_or_skip().await {
        stores.push(("mariadb", Box::new(my)));
    }
    stores
}

/// Creates a database of its own on the MySQL test server (`admin` is a
/// store there) for a test that changes the schema; answers its name, which
/// starts with `prefix`. The test drops it.
#[allow(dead_code)] // not every test binary has such a test
pub async fn mysql_create_database(admin: &MySqlStore, prefix: &str) -> String {
    use sqlx::Executor;
    let db = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    admin
        .pool()
        .execute(format!("CREATE DATABASE `{db}`").as_str())
        .await
        .expect("create database");
    db
}

/// `url` with its database replaced by `database`.
#[allow(dead_code)] // not every test binary has such a test
pub fn mysql_url_of(url: &str, database: &str) -> String {
    match url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{database}"),
        None => panic!("url {url}"),
    }
}

/// Drops the databases `dbs` through `admin`, then re-raises what `checked`
/// panicked with (the test ran in a task, so that its database is dropped
/// whatever it asserted).
#[allow(dead_code)] // not every test binary has such a test
pub async fn mysql_drop_then_check(
    admin: &MySqlStore,
    dbs: &[&str],
    checked: Result<(), tokio::task::JoinError>,
) {
    use sqlx::Executor;
    for db in dbs {
        let _ = admin
            .pool()
            .execute(format!("DROP DATABASE `{}`", db.replace('`', "``")).as_str())
            .await;
    }
    if let Err(e) = checked {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// The URL of [`mysql_url`]'s server and database for a user granted only
/// `SELECT` on that database (`idempotent_reader`, no password, created when
/// missing through `pool`, a root connection).
pub async fn mysql_reader_url(pool: &sqlx::MySqlPool) -> String {
    const READER: &str = "idempotent_reader";
    let database: String = sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(pool)
        .await
        .expect("the test database's name");
    sqlx::query(&format!("CREATE USER IF NOT EXISTS '{READER}'@'%'"))
        .execute(pool)
        .await
        .expect("create the read-only user");
    sqlx::query(&format!("GRANT SELECT ON `{database}`.* TO '{READER}'@'%'"))
        .execute(pool)
        .await
        .expect("grant it SELECT");
    let url = mysql_url();
    let (scheme, rest) = url.split_once("://").expect("a mysql:// URL");
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{READER}@{host}")
}

/// A JetStream context on the test NATS server, or `None` (after a loud
/// SKIPPED line). A server that answers but has JetStream disabled counts as
/// unreachable.
pub async fn nats_or_skip() -> Option<async_nats::jetstream::Context> {
    let url = nats_url();
    let connected = async {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(std::time::Duration::from_secs(5))
            .connect(url.as_str())
            .await
            .map_err(|e| e.to_string())?;
        // The account info request answers only where JetStream is enabled.
        let not_available =
            |why: String| format!("JetStream is not available ({why}); start nats-server with -js");
        let info = client
            .request("$JS.API.INFO", "".into())
            .await
            .map_err(|e| not_available(e.to_string()))?;
        let info: serde_json::Value =
            serde_json::from_slice(&info.payload).map_err(|e| not_available(e.to_string()))?;
        if let Some(error) = info.get("error") {
            return Err(not_available(error.to_string()));
        }
        Ok::<_, String>(async_nats::jetstream::new(client))
    };
    match tokio::time::timeout(std::time::Duration::from_secs(10), connected).await {
        Ok(Ok(js)) => Some(js),
        Ok(Err(e)) => {
            unreachable("NATS (JetStream)", "IDEMPOTENT_NATS_URL", &url, &e);
            None
        }
        Err(_) => {
            unreachable(
                "NATS (JetStream)",
                "IDEMPOTENT_NATS_URL",
                &url,
                &"no answer within 10 s",
            );
            None
        }
    }
}

/// A fresh tenant no other test (or earlier run) uses.
pub fn fresh_tenant() -> String {
    format!("t-{}", uuid::Uuid::new_v4())
}

/// Creates the tables a test writes to, on PostgreSQL (`ddl`: one or more
/// `CREATE TABLE IF NOT EXISTS` statements). That statement is not safe
/// against itself: two test binaries creating one table at the same moment
/// (a fresh database, nextest running binaries side by side) make one of
/// them fail with a catalog unique violation (`pg_type_typname_nsp_index`).
/// Here the DDL runs after one advisory lock, in one simple-query message
/// (which PostgreSQL runs as one transaction, so the lock is held to its
/// end): creations take turns and the second finds the table.
pub async fn pg_create_tables(pool: &sqlx::PgPool, ddl: &str) -> Result<(), sqlx::Error> {
    /// The lock every test's DDL takes ("idem-ddl").
    const TEST_DDL_LOCK: i64 = 0x6964_656d_2d64_646c;
    sqlx::raw_sql(&format!(
        "SELECT pg_advisory_xact_lock({TEST_DDL_LOCK}); {ddl}"
    ))
    .execute(pool)
    .await
    .map(drop)
}
