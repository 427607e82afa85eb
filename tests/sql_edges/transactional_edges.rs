//! Transactional mode at its edges (DESIGN.md rule 15): `tx = conn` given a
//! connection that is *not* inside a transaction. The reservation would commit
//! at once and nothing would renew its lease, so a body outliving its lease
//! could run twice. Every SQL store refuses such a call with
//! `Error::NotInTransaction` before anything is written; a connection inside a
//! transaction begun with a plain `BEGIN` (not through sqlx) is accepted.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{idempotent, with_outcome, Error, Identity, Outcome, Store};
use sqlx::Executor;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The body outlives its 300 ms lease (the case that ran twice before).
const BODY: Duration = Duration::from_millis(1200);

#[idempotent(scope = "tx_edges.pg", key = key, tenant = tenant, tx = conn, skip(runs),
             lease = "300ms", in_progress = wait("5s"))]
async fn pg_on_connection(
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(BODY).await;
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("postgres", "body", e)))?;
    Ok(one as u64)
}

#[idempotent(scope = "tx_edges.mysql", key = key, tenant = tenant, tx = conn, skip(runs),
             lease = "300ms", in_progress = wait("5s"))]
async fn my_on_connection(
    conn: &mut sqlx::MySqlConnection,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(BODY).await;
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("mysql", "body", e)))?;
    Ok(one as u64)
}

#[idempotent(scope = "tx_edges.sqlite", key = key, tenant = tenant, tx = conn, skip(runs),
             lease = "300ms", in_progress = wait("5s"))]
async fn sqlite_on_connection(
    conn: &mut sqlx::SqliteConnection,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(BODY).await;
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("sqlite", "body", e)))?;
    Ok(one as u64)
}

fn assert_refused(answer: &Result<u64, Error>, store: &str) {
    match answer {
        Err(e @ Error::NotInTransaction { store: s, .. }) => {
            assert_eq!(*s, store);
            let message = e.to_string();
            assert!(
                message.contains("not inside a transaction") && message.contains("begin"),
                "the error says what to do: {message}"
            );
        }
        other => panic!("expected NotInTransaction, got {other:?}"),
    }
}

/// Two callers on two autocommit connections, at once, on one identity: both
/// are refused, no body runs, nothing is written.
macro_rules! two_autocommit_callers {
    ($pool:expr, $call:ident, $scope:literal, $store:literal, $store_value:expr) => {{
        let pool = $pool;
        let tenant = fresh_tenant();
        let runs = AtomicUsize::new(0);
        let mut first = pool.acquire().await.expect("acquire");
        let mut second = pool.acquire().await.expect("acquire");
        let (a, b) = tokio::join!(
            $call(&mut first, &tenant, "k", &runs),
            $call(&mut second, &tenant, "k", &runs)
        );
        assert_refused(&a, $store);
        assert_refused(&b, $store);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "no body ran");
        let id = Identity::new(&tenant, $scope, "k").expect("identity");
        assert_eq!(
            $store_value.fetch(&id).await.expect("fetch"),
            None,
            "nothing was written"
        );
    }};
}

/// A plain `BEGIN` (not sqlx's `begin()`) is a transaction too: the call runs,
/// and after `COMMIT` a retry on the same connection replays.
macro_rules! plain_begin_is_accepted {
    ($pool:expr, $call:ident, $store_value:expr) => {{
        let pool = $pool;
        let tenant = fresh_tenant();
        let runs = AtomicUsize::new(0);
        let mut conn = pool.acquire().await.expect("acquire");
        conn.execute("BEGIN").await.expect("BEGIN");
        let (answer, outcome) = with_outcome($call(&mut conn, &tenant, "k", &runs)).await;
        assert_eq!(answer.expect("runs"), 1);
        assert_eq!(outcome, Some(Outcome::Executed));
        conn.execute("COMMIT").await.expect("COMMIT");
        conn.execute("BEGIN").await.expect("BEGIN");
        let (answer, outcome) = with_outcome($call(&mut conn, &tenant, "k", &runs)).await;
        assert_eq!(answer.expect("replays"), 1);
        assert_eq!(outcome, Some(Outcome::Replayed));
        conn.execute("COMMIT").await.expect("COMMIT");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
        let _ = &$store_value;
    }};
}

/// A transaction sqlx began, ended by a statement sent as a query (`end`:
/// a `COMMIT`, or on MySQL a statement that commits implicitly, such as
/// `TRUNCATE`): sqlx still counts it as open, the server does not. The call
/// is refused as on an autocommit connection (it used to be accepted: the
/// reservation committed at once with no lease renewal, and a duplicate
/// could take it over while the body ran).
macro_rules! ended_behind_sqlx_is_refused {
    ($pool:expr, $end:expr, $call:ident, $scope:literal, $store:literal, $store_value:expr) => {{
        let pool = $pool;
        let tenant = fresh_tenant();
        let runs = AtomicUsize::new(0);
        let mut tx = pool.begin().await.expect("begin");
        tx.execute($end).await.expect("the statement that ends it");
        assert!(
            sqlx::Connection::is_in_transaction(&*tx),
            "sqlx still counts the transaction"
        );
        let answer = $call(&mut tx, &tenant, "k", &runs).await;
        let _ = tx.rollback().await;
        assert_refused(&answer, $store);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "no body ran");
        let id = Identity::new(&tenant, $scope, "k").expect("identity");
        assert_eq!(
            $store_value.fetch(&id).await.expect("fetch"),
            None,
            "nothing was written"
        );
    }};
}

#[tokio::test]
async fn pg_a_transaction_ended_by_a_commit_query_is_refused() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    ended_behind_sqlx_is_refused!(
        store.pool(),
        "COMMIT",
        pg_on_connection,
        "tx_edges.pg",
        "postgres",
        store
    );
}

#[tokio::test]
async fn mysql_a_transaction_ended_by_an_implicit_commit_is_refused() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    store
        .pool()
        .execute("CREATE TABLE IF NOT EXISTS tx_edges_scratch (id INT)")
        .await
        .expect("scratch table");
    ended_behind_sqlx_is_refused!(
        store.pool(),
        "TRUNCATE TABLE tx_edges_scratch",
        my_on_connection,
        "tx_edges.mysql",
        "mysql",
        store
    );
}

#[tokio::test]
async fn sqlite_a_transaction_ended_by_a_commit_query_is_refused() {
    let (store, dir) = sqlite_store().await;
    ended_behind_sqlx_is_refused!(
        store.pool(),
        "COMMIT",
        sqlite_on_connection,
        "tx_edges.sqlite",
        "sqlite",
        store
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn pg_autocommit_connection_is_refused() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    two_autocommit_callers!(
        store.pool(),
        pg_on_connection,
        "tx_edges.pg",
        "postgres",
        store
    );
}

#[tokio::test]
async fn pg_plain_begin_is_a_transaction() {
    let Some(store) = pg_store_or_skip().await else {
        return;
    };
    plain_begin_is_accepted!(store.pool(), pg_on_connection, store);
}

#[tokio::test]
async fn mysql_autocommit_connection_is_refused() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    two_autocommit_callers!(
        store.pool(),
        my_on_connection,
        "tx_edges.mysql",
        "mysql",
        store
    );
}

#[tokio::test]
async fn mysql_plain_begin_is_a_transaction() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    plain_begin_is_accepted!(store.pool(), my_on_connection, store);
}

/// `SET autocommit = 0`: every statement opens a transaction that lasts until
/// COMMIT, so the reservation commits with the caller's writes: accepted.
#[tokio::test]
async fn mysql_autocommit_off_is_a_transaction() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);
    let mut conn = store.pool().acquire().await.expect("acquire");
    conn.execute("SET autocommit = 0")
        .await
        .expect("autocommit off");
    let answer = my_on_connection(&mut conn, &tenant, "k", &runs).await;
    conn.execute("ROLLBACK").await.expect("ROLLBACK");
    conn.execute("SET autocommit = 1")
        .await
        .expect("autocommit on");
    assert_eq!(answer.expect("runs"), 1);
    let id = Identity::new(&tenant, "tx_edges.mysql", "k").expect("identity");
    assert_eq!(
        store.fetch(&id).await.expect("fetch"),
        None,
        "rolled back with the caller"
    );
}

async fn sqlite_store() -> (idempotent_runtime::SqliteStore, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("idempotent-tx-edges-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let url = format!("sqlite:{}?mode=rwc", dir.join("edges.db").display());
    let store = idempotent_runtime::SqliteStore::connect(&url)
        .await
        .expect("open");
    (store, dir)
}

#[tokio::test]
async fn sqlite_autocommit_connection_is_refused() {
    let (store, dir) = sqlite_store().await;
    two_autocommit_callers!(
        store.pool(),
        sqlite_on_connection,
        "tx_edges.sqlite",
        "sqlite",
        store
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn sqlite_plain_begin_is_a_transaction() {
    let (store, dir) = sqlite_store().await;
    plain_begin_is_accepted!(store.pool(), sqlite_on_connection, store);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TCP proxy to MariaDB that makes it look like MySQL 8.0 for one thing:
/// the system variable `@@in_transaction` does not exist (MySQL has none; it
/// is MariaDB's). Every client byte string `@@in_transaction` is rewritten to
/// `@@in_transactioX` (same length, so packets stay valid), which the server
/// refuses with error 1193, as MySQL 8 does for `@@in_transaction`.
async fn mysql8_lookalike(upstream: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let upstream = upstream.to_owned();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let chunk = &mut buf[..n];
                        let needle = b"@@in_transaction";
                        let mut i = 0;
                        while i + needle.len() <= chunk.len() {
                            if &chunk[i..i + needle.len()] == needle {
                                chunk[i + needle.len() - 1] = b'X';
                                i += needle.len();
                            } else {
                                i += 1;
                            }
                        }
                        if sw.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                };
                let down = async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                };
                tokio::join!(up, down);
            });
        }
    });
    format!("127.0.0.1:{port}")
}

/// Rule 15 on MySQL 8.0 (no `@@in_transaction`): a transaction begun through
/// sqlx (`pool.begin()`, the way the README shows) must be accepted. The
/// check now always asks the server, and on MySQL 8 the fallback only counts
/// `autocommit = 0`, so every sqlx transaction (autocommit stays 1 under
/// `BEGIN`) is refused with `NotInTransaction`: transactional mode cannot be
/// used at all on MySQL 8. (Before, sqlx's own count answered for these.)
#[tokio::test]
async fn mysql8_a_transaction_begun_through_sqlx_is_accepted() {
    let Some(_reachable) = mysql_store_or_skip().await else {
        return;
    };
    // mysql://user[:pass]@host:port/db[?query]
    let url = common::servers::mysql_url();
    let (scheme_user, rest) = url.rsplit_once('@').expect("user@host");
    let (upstream, path) = rest.split_once('/').expect("host/db");
    let upstream = if upstream.contains(':') {
        upstream.to_owned()
    } else {
        format!("{upstream}:3306")
    };
    let proxy = mysql8_lookalike(&upstream).await;
    let sep = if path.contains('?') { '&' } else { '?' };
    let via = format!("{scheme_user}@{proxy}/{path}{sep}ssl-mode=disabled");
    let store = idempotent_runtime::MySqlStore::connect(&via)
        .await
        .expect("open through the proxy");
    // The proxy does what MySQL 8 does: the variable is unknown (1193).
    let asked: Result<i64, sqlx::Error> =
        sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
            .fetch_one(store.pool())
            .await;
    match asked {
        Err(sqlx::Error::Database(e)) => assert!(
            e.message().contains("Unknown system variable"),
            "{}",
            e.message()
        ),
        other => panic!("the proxy should hide @@in_transaction: {other:?}"),
    }
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);
    let mut tx = store.pool().begin().await.expect("begin");
    let answer = my_on_connection(&mut tx, &tenant, "k", &runs).await;
    let _ = tx.rollback().await;
    assert_eq!(
        answer.expect("a sqlx transaction on MySQL 8 runs the call"),
        1
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// What a transactional call says on a database no store has opened (so no
/// migration was applied: transactional mode applies none). The error must
/// name the fix, opening a store on the database once, on every SQL store;
/// before, PostgreSQL spoke of a search_path or a renamed schema, MySQL of a
/// migration cut off or a dump without its procedures (and a migration
/// history to edit that does not exist), SQLite only of a missing table.
fn assert_says_open_a_store(answer: Result<u64, Error>, store: &str, runs: &AtomicUsize) {
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "{store}: the body never ran"
    );
    let message = match answer {
        Err(e @ Error::Store(_)) => e.to_string(),
        other => panic!("{store}: expected Error::Store, got {other:?}"),
    };
    let constructor = format!("{store}::from_pool");
    assert!(
        message.contains("no store has opened this database") && message.contains(&constructor),
        "{store}: the error says to open a store once, so the migrations apply: {message}"
    );
}

#[tokio::test]
async fn pg_database_no_store_opened_says_to_open_one() {
    if pg_store_or_skip().await.is_none() {
        return;
    }
    let (mut admin, schema, _) = common::servers::pg_schema_of_its_own("tx_unopened").await;
    let pool = common::servers::pg_one_connection_pool_in(&schema).await;
    let runs = AtomicUsize::new(0);
    let mut tx = pool.begin().await.expect("begin");
    let answer = pg_on_connection(&mut tx, &fresh_tenant(), "k", &runs).await;
    let _ = tx.rollback().await;
    pool.close().await;
    admin
        .execute(format!("DROP SCHEMA {schema} CASCADE").as_str())
        .await
        .expect("drop the schema");
    assert_says_open_a_store(answer, "PgStore", &runs);
}

#[tokio::test]
async fn mysql_database_no_store_opened_says_to_open_one() {
    let Some(admin) = mysql_store_or_skip().await else {
        return;
    };
    let db = common::servers::mysql_create_database(&admin, "tx_unopened").await;
    let mut conn =
        <sqlx::MySqlConnection as sqlx::Connection>::connect(&common::servers::mysql_url())
            .await
            .expect("connect");
    conn.execute(format!("USE `{db}`").as_str())
        .await
        .expect("use the new database");
    let runs = AtomicUsize::new(0);
    let mut tx = sqlx::Connection::begin(&mut conn).await.expect("begin");
    let answer = my_on_connection(&mut tx, &fresh_tenant(), "k", &runs).await;
    let _ = tx.rollback().await;
    drop(conn);
    admin
        .pool()
        .execute(format!("DROP DATABASE `{db}`").as_str())
        .await
        .expect("drop the database");
    assert_says_open_a_store(answer, "MySqlStore", &runs);
}

#[tokio::test]
async fn sqlite_database_no_store_opened_says_to_open_one() {
    let pool = sqlx::SqlitePool::connect(&common::scratch::sqlite_url("tx-unopened"))
        .await
        .expect("a new SQLite file");
    let runs = AtomicUsize::new(0);
    let mut tx = pool.begin().await.expect("begin");
    let answer = sqlite_on_connection(&mut tx, &fresh_tenant(), "k", &runs).await;
    let _ = tx.rollback().await;
    assert_says_open_a_store(answer, "SqliteStore", &runs);
}
