//! The pools the SQL stores open themselves do not ping a connection that was
//! used a moment ago before every statement (sqlx's default), so a replay is
//! one round trip and a fresh key two (DESIGN §5's floor). A connection idle
//! for a while is still checked first.
//!
//! Counted on the wire: the stores' connections run through the in-process
//! proxy (`common::proxy`), which counts the bytes that make a ping —
//! PostgreSQL's bare `Sync` message (every statement also ends with one, so
//! pings = Syncs − statements), MySQL's `COM_PING` packet — and the
//! reservations (the key is bound to each). sqlx still pings every connection
//! once when it comes back to the pool, after the caller has its answer: with
//! the ping before each statement too, there would be two pings per
//! statement.

use crate::common;

use common::proxy::FaultProxy;
use common::servers::{fresh_tenant, mysql_url, pg_url, servers_required};
use idempotent_runtime::{idempotent, Error, MySqlStore, PgStore, Store};
use std::sync::atomic::{AtomicU32, Ordering};

/// Replays measured per store: enough that a ping before each statement
/// could not hide in the bound below, even if some connections sit idle past
/// the one-second window on a loaded machine.
const REPLAYS: u64 = 40;

static BODIES: AtomicU32 = AtomicU32::new(0);

#[idempotent(scope = "faults.pings.replay", key = key, tenant = tenant, store = store)]
async fn charge(store: &dyn Store, tenant: &str, key: &str) -> Result<u32, Error> {
    Ok(BODIES.fetch_add(1, Ordering::SeqCst) + 1)
}

/// `url` with its host and port replaced by the proxy's.
fn through(url: &str, proxy: &FaultProxy) -> String {
    let mut url = reqwest::Url::parse(url).expect("a database URL");
    url.set_host(Some("127.0.0.1")).expect("a host");
    url.set_port(Some(proxy.port())).expect("a port");
    url.to_string()
}

/// The proxy in front of the server `url` names.
async fn proxy_for(url: &str) -> FaultProxy {
    let parsed = reqwest::Url::parse(url).expect("a database URL");
    let upstream = format!(
        "{}:{}",
        parsed.host_str().expect("a host"),
        parsed.port().expect("a port")
    );
    FaultProxy::start(&upstream).await.expect("proxy")
}

/// Records one result, then replays it `REPLAYS` times, one after another;
/// returns (pings, reservations) seen on the wire during the replays.
async fn replays(store: &dyn Store, proxy: &FaultProxy, ping: &[u8]) -> (u64, u64) {
    let tenant = fresh_tenant();
    let key = format!("pings-{}", uuid::Uuid::new_v4());
    let first = charge(store, &tenant, &key).await.expect("first call");
    let pings = proxy.count_requests_containing(ping);
    let reservations = proxy.count_requests_containing(key.as_bytes());
    for _ in 0..REPLAYS {
        assert_eq!(charge(store, &tenant, &key).await.expect("replay"), first);
    }
    (
        pings.load(Ordering::SeqCst),
        reservations.load(Ordering::SeqCst),
    )
}

fn assert_no_ping_per_statement(store: &str, pings: u64, statements: u64) {
    println!("{store}: {statements} reservations, {pings} pings");
    assert_eq!(statements, REPLAYS, "{store}: one statement per replay");
    // The pings on the way back (at most one per statement) and a few for
    // connections that sat idle past the window; a ping before every
    // statement would make it twice the statements.
    assert!(
        pings <= statements + statements / 2,
        "{store}: {pings} pings for {statements} statements: the pool pings before each statement"
    );
}

fn skip_or_fail(what: &str, e: &Error) {
    assert!(!servers_required(), "{what} unreachable: {e}");
    eprintln!("\n!!!!!!!! SKIPPED: {what} unreachable: {e}\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_replays_do_not_ping_before_each_statement() {
    let url = pg_url();
    let proxy = proxy_for(&url).await;
    let store = match PgStore::connect(&through(&url, &proxy)).await {
        Ok(store) => store,
        Err(e) => return skip_or_fail("PostgreSQL", &e),
    };
    // A bare Sync: `S`, length 4.
    let sync = [b'S', 0, 0, 0, 4];
    let (syncs, statements) = replays(&store, &proxy, &sync).await;
    assert_no_ping_per_statement("postgres", syncs - statements, statements);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_replays_do_not_ping_before_each_statement() {
    let url = mysql_url();
    let proxy = proxy_for(&url).await;
    let store = match MySqlStore::connect(&through(&url, &proxy)).await {
        Ok(store) => store,
        Err(e) => return skip_or_fail("MySQL/MariaDB", &e),
    };
    // COM_PING: a one-byte payload (0x0e), sequence number 0.
    let ping = [1, 0, 0, 0, 0x0e];
    let (pings, statements) = replays(&store, &proxy, &ping).await;
    assert_no_ping_per_statement("mysql", pings, statements);
}
