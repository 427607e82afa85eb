//! Waiting duplicates on [`PgStore`] when the store's `LISTEN` connection
//! cannot help: it went silent (a half-open connection: nothing closed, no
//! error, nothing delivered), or it cannot connect at all. A waiter must not
//! trust a listener that hears nothing, and must poll at the documented
//! backoff (5 ms doubling to 100 ms) while there is no listener, instead of
//! waiting for one round after round.
//!
//! The faults are injected by a small proxy (below) that tells the listener's
//! connection from the pool's by the `LISTEN` it sends: it can freeze the
//! server's bytes to the listener connections open at that moment (the
//! requests still reach the server), or cut every connection that tries to
//! `LISTEN`. The store's other connections pass untouched.
//!
//! Every step is a handshake (the duplicate's mark is on the record, the
//! duplicate made N reservations, the listener sent a new `LISTEN`). The
//! tokio timeouts only turn a hang into a failure; each is far below the
//! wait bound it guards (60 s) and far above what the path takes when it
//! works (milliseconds to about three seconds).

use crate::common::counting::Counting;
use crate::common::servers::{fresh_tenant, pg_store_or_skip, pg_url};
use idempotent_runtime::{idempotent, with_outcome, Error, Identity, Outcome, PgStore, Store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What `PgListener` sends to listen on the store's channel (also when it
/// listens again after a reconnection).
const LISTEN: &[u8] = br#"LISTEN "idempotency_records""#;

/// The longest any one step may take before the test fails. The wait bound
/// of the calls below is 60 s; each step takes milliseconds to a few
/// seconds when the store behaves.
const STEP_LIMIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------- the proxy

/// One proxied connection.
struct Conn {
    /// It sent `LISTEN`: the store's listener connection.
    listening: AtomicBool,
    /// Still open.
    open: AtomicBool,
    /// The server's bytes to the client are held while `true`.
    frozen: watch::Sender<bool>,
    /// Set: the proxy closes both sides of the connection at once.
    close: watch::Sender<bool>,
    /// The port the server sees this connection come from
    /// (`pg_stat_activity.client_port`).
    server_side_port: u16,
}

struct ProxyShared {
    upstream: SocketAddr,
    conns: Mutex<Vec<Arc<Conn>>>,
    /// Cut every connection that sends `LISTEN` (the listener cannot connect).
    cut_listens: AtomicBool,
    /// `LISTEN` requests forwarded to the server.
    listens: watch::Sender<usize>,
    /// Connections cut because they sent `LISTEN`.
    cuts: watch::Sender<usize>,
    shutdown: watch::Sender<bool>,
}

/// A TCP proxy on loopback in front of the test's PostgreSQL server that
/// can fault the `LISTEN` connections only. Dropping it closes every
/// connection.
struct ListenerProxy {
    port: u16,
    shared: Arc<ProxyShared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for ListenerProxy {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
        self.accept.abort();
    }
}

impl ListenerProxy {
    async fn start() -> Self {
        let options = PgConnectOptions::from_str(&pg_url()).expect("the test URL");
        let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
            .await
            .expect("resolve the server")
            .next()
            .expect("the server's address");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("the proxy's address").port();
        let shared = Arc::new(ProxyShared {
            upstream,
            conns: Mutex::new(Vec::new()),
            cut_listens: AtomicBool::new(false),
            listens: watch::channel(0).0,
            cuts: watch::channel(0).0,
            shutdown: watch::channel(false).0,
        });
        let accept = tokio::spawn({
            let shared = shared.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(serve(client, shared.clone()));
                }
            }
        });
        ListenerProxy {
            port,
            shared,
            accept,
        }
    }

    /// A store whose every connection (its pool's and its listener's) goes
    /// through the proxy.
    async fn store(&self) -> PgStore {
        self.store_named("idempotent-test").await
    }

    /// [`store`](Self::store), its connections (the listener's too) named
    /// `application_name` on the server.
    async fn store_named(&self, application_name: &str) -> PgStore {
        let options = PgConnectOptions::from_str(&pg_url())
            .expect("the test URL")
            .host("127.0.0.1")
            .port(self.port)
            .application_name(application_name);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await
            .expect("a pool through the proxy");
        PgStore::from_pool(pool)
            .await
            .expect("a store through the proxy")
    }

    /// Holds, from now on, every byte the server sends to the listener
    /// connections open now (they were not closed, they report no error,
    /// they just go silent). Returns how many were frozen.
    fn freeze_listeners(&self) -> usize {
        let conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        let mut frozen = 0;
        for conn in conns.iter() {
            if conn.open.load(Ordering::SeqCst) && conn.listening.load(Ordering::SeqCst) {
                conn.frozen.send_replace(true);
                frozen += 1;
            }
        }
        frozen
    }

    /// Closes, now, the listener connections open now (both ways: as a
    /// server that went away, or a middlebox that reset them, ends them).
    /// Returns how many were closed.
    fn close_listeners(&self) -> usize {
        let conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        let mut closed = 0;
        for conn in conns.iter() {
            if conn.open.load(Ordering::SeqCst) && conn.listening.load(Ordering::SeqCst) {
                conn.close.send_replace(true);
                closed += 1;
            }
        }
        closed
    }

    /// The ports the server sees the listener connections open now come
    /// from (`pg_stat_activity.client_port`).
    fn listener_ports(&self) -> Vec<i32> {
        let conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns
            .iter()
            .filter(|c| c.open.load(Ordering::SeqCst) && c.listening.load(Ordering::SeqCst))
            .map(|c| i32::from(c.server_side_port))
            .collect()
    }

    /// From now on, a connection that sends `LISTEN` is closed instead.
    fn cut_listens(&self) {
        self.shared.cut_listens.store(true, Ordering::SeqCst);
    }

    fn listens(&self) -> usize {
        *self.shared.listens.borrow()
    }

    /// Waits until `n` connections in all were cut for sending `LISTEN`.
    async fn until_cuts(&self, n: usize) {
        let mut cuts = self.shared.cuts.subscribe();
        let _ = cuts.wait_for(|cut| *cut >= n).await;
    }

    /// Waits until `n` `LISTEN` requests in all were forwarded.
    async fn until_listens(&self, n: usize) {
        let mut listens = self.shared.listens.subscribe();
        let _ = listens.wait_for(|seen| *seen >= n).await;
    }
}

async fn serve(client: TcpStream, shared: Arc<ProxyShared>) {
    let mut shutdown = shared.shutdown.subscribe();
    let Ok(server) = TcpStream::connect(shared.upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let server_side_port = server.local_addr().map_or(0, |a| a.port());
    let conn = Arc::new(Conn {
        listening: AtomicBool::new(false),
        open: AtomicBool::new(true),
        frozen: watch::channel(false).0,
        close: watch::channel(false).0,
        server_side_port,
    });
    let mut close = conn.close.subscribe();
    shared
        .conns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(conn.clone());
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        () = to_server(client_read, server_write, &shared, &conn) => {}
        () = to_client(server_read, client_write, &conn) => {}
        _ = shutdown.wait_for(|stop| *stop) => {}
        _ = close.wait_for(|close| *close) => {}
    }
    conn.open.store(false, Ordering::SeqCst);
}

async fn to_server(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &ProxyShared,
    conn: &Conn,
) {
    let mut buf = vec![0u8; 64 * 1024];
    // The previous chunk's tail, so a `LISTEN` split across reads is seen.
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut window = std::mem::take(&mut tail);
        window.extend_from_slice(&buf[..n]);
        let listen = window.windows(LISTEN.len()).any(|w| w == LISTEN);
        if listen && shared.cut_listens.load(Ordering::SeqCst) {
            shared.cuts.send_modify(|cuts| *cuts += 1);
            return;
        }
        if listen {
            conn.listening.store(true, Ordering::SeqCst);
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        if listen {
            shared.listens.send_modify(|seen| *seen += 1);
        }
        tail = window[window.len().saturating_sub(LISTEN.len() - 1)..].to_vec();
    }
}

async fn to_client(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, conn: &Conn) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut frozen = conn.frozen.subscribe();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|frozen| !*frozen).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------- the log

/// The runtime's warnings (target `idempotent`), captured process-wide: the
/// listener runs on a thread of its own, which a scoped subscriber would
/// not see. Each test looks only for messages no other test produces.
mod log {
    use std::sync::Mutex;
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::Layer;

    static WARNINGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

    struct Capture;

    /// Every field of an event, the message among them.
    struct Message(String);

    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.0.push_str(&format!("{}={value:?} ", field.name()));
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Capture {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            let meta = event.metadata();
            if meta.target() == "idempotent" && *meta.level() == tracing::Level::WARN {
                let mut message = Message(String::new());
                event.record(&mut message);
                WARNINGS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(message.0);
            }
        }
    }

    /// Starts capturing (once per process).
    pub fn capture() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let filter = tracing_subscriber::filter::Targets::new()
                .with_target("idempotent", tracing::Level::WARN);
            let subscriber = tracing_subscriber::registry().with(Capture.with_filter(filter));
            tracing::subscriber::set_global_default(subscriber)
                .expect("no other global subscriber in this test binary");
        });
    }

    /// How many warnings so far contain `text` (in any field).
    pub fn warnings_containing(text: &str) -> usize {
        WARNINGS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|w| w.contains(text))
            .count()
    }
}

// ---------------------------------------------------------------- the calls

use super::postgres::Hold;

const SCOPE: &str = "waiting.pg_listener.charge";

#[idempotent(scope = "waiting.pg_listener.charge", key = key, tenant = tenant, store = store,
             skip(hold, runs), in_progress = wait("60s"), lease = "60s")]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    amount: u64,
    hold: Option<&Hold>,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    if let Some(hold) = hold {
        hold.here().await;
    }
    Ok(amount * 10)
}

/// Waits until a duplicate's mark is on the record: it registered with a
/// listener that was listening, and waits for a notification.
async fn until_marked(store: &PgStore, identity: &Identity) {
    loop {
        let marked: Option<bool> = sqlx::query_scalar(
            "SELECT waiting FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3",
        )
        .bind(identity.tenant())
        .bind(identity.scope())
        .bind(identity.key())
        .fetch_optional(store.pool())
        .await
        .expect("read the mark");
        if marked == Some(true) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn step<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(STEP_LIMIT, future)
        .await
        .unwrap_or_else(|_| panic!("waited {STEP_LIMIT:?} (the wait bound is 60 s) for {what}"))
}

// ---------------------------------------------------------------- the tests

/// The duplicate waits on a listening listener; then the listener's
/// connection goes silent (the server's bytes to it are held: half-open,
/// no error, no close) and the owner completes, so its notification never
/// arrives. The listener must notice the silence on its own (it checks a
/// connection that has been quiet), say it is not listening, wake the
/// waiter (which looks at the record again and replays) and reconnect.
/// Before, the listener trusted the connection for as long as it lived: it
/// never reconnected, and the waiter slept out its 5 s slice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_listener_connection_is_noticed_its_waiters_answered_and_it_reconnects() {
    let Some(owner_store) = pg_store_or_skip().await else {
        return;
    };
    log::capture();
    let proxy = ListenerProxy::start().await;
    let dup_store = proxy.store().await;
    let (tenant, key) = (fresh_tenant(), "silent-1".to_owned());
    let identity = Identity::new(&tenant, SCOPE, &key).expect("identity");
    let (hold, runs) = (Hold::default(), AtomicUsize::new(0));
    let owner_call = charge(&owner_store, &tenant, &key, 4, Some(&hold), &runs);
    let duplicate = async {
        hold.reached.notified().await;
        let dup_call = with_outcome(charge(&dup_store, &tenant, &key, 4, None, &runs));
        let fault = async {
            step(
                "the duplicate's mark",
                until_marked(&owner_store, &identity),
            )
            .await;
            assert_eq!(proxy.listens(), 1, "one listener, listening once");
            assert_eq!(
                proxy.freeze_listeners(),
                1,
                "the duplicate's store has one listener connection"
            );
            // The owner completes now: its notification is held in the
            // frozen connection.
            hold.go.notify_one();
        };
        let (answer, ()) = tokio::join!(step("the duplicate's answer", dup_call), fault);
        answer
    };
    let (owned, (replayed, outcome)) = tokio::join!(owner_call, duplicate);
    assert_eq!(owned.expect("owner"), 40);
    assert_eq!(replayed.expect("duplicate"), 40, "the duplicate replays");
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    step(
        "the listener to notice its silent connection and LISTEN on a new one",
        proxy.until_listens(2),
    )
    .await;
    assert_eq!(
        log::warnings_containing("went silent"),
        1,
        "the silent connection is logged, once"
    );
}

/// The listener cannot connect (every connection that tries to `LISTEN` is
/// cut, as a role's connection limit or a broken route would refuse it).
/// The duplicate must poll at the documented backoff (5 ms doubling to
/// 100 ms): the owner completes once the duplicate has looked at the record
/// 30 times, which polling does in under 3 s. Before, every round first
/// waited up to a second for a listener that was not coming, without
/// looking at the record (30 rounds took about 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_polls_at_the_documented_backoff_while_the_listener_cannot_connect() {
    let Some(owner_store) = pg_store_or_skip().await else {
        return;
    };
    log::capture();
    let proxy = ListenerProxy::start().await;
    proxy.cut_listens();
    let dup = Counting::new(proxy.store().await);
    let (tenant, key) = (fresh_tenant(), "no-listener-1".to_owned());
    let (hold, runs) = (Hold::default(), AtomicUsize::new(0));
    let owner_call = charge(&owner_store, &tenant, &key, 6, Some(&hold), &runs);
    let duplicate = async {
        hold.reached.notified().await;
        let dup_call = with_outcome(charge(&dup, &tenant, &key, 6, None, &runs));
        let release = async {
            while dup.reserves() < 30 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            hold.go.notify_one();
        };
        let (answer, ()) = tokio::join!(dup_call, release);
        answer
    };
    let (owned, (replayed, outcome)) = step(
        "the duplicate to look at the record 30 times and replay",
        async { tokio::join!(owner_call, duplicate) },
    )
    .await;
    assert_eq!(owned.expect("owner"), 60);
    assert_eq!(replayed.expect("duplicate"), 60, "the duplicate replays");
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    step(
        "the listener to try to connect three times",
        proxy.until_cuts(3),
    )
    .await;
    assert_eq!(proxy.listens(), 0, "the listener never listened");
    assert_eq!(
        log::warnings_containing("could not connect"),
        1,
        "the outage is logged once, not at every attempt"
    );
}

/// How the listener's connection ends in [`ended_mid_wait`].
#[derive(Debug, Clone, Copy)]
enum End {
    /// Closed under it, with no word from the server (a server gone, a reset).
    Closed,
    /// The server ends it (`pg_terminate_backend`, as at a restart or a
    /// failover): an error message, then the close.
    Terminated,
}

/// The duplicate waits on a listening listener; its connection ends (`end`)
/// and the owner completes at once, so its notification is sent while no
/// listener listens. The waiter must be woken by the loss itself, look at the
/// record again and replay; the listener listens again on a new connection,
/// and the next waiter is woken by a notification again (it reserves a few
/// times, not at every poll, while the owner holds the record 2 s after its
/// mark).
async fn ended_mid_wait(end: End) {
    let Some(owner_store) = pg_store_or_skip().await else {
        return;
    };
    log::capture();
    let proxy = ListenerProxy::start().await;
    let name = format!("idempotent-ended-{}", uuid::Uuid::new_v4().simple());
    let dup = Counting::new(proxy.store_named(&name).await);
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);

    // Round 1: the listener's connection ends while the duplicate waits.
    let identity = Identity::new(&tenant, SCOPE, "ended-1").expect("identity");
    let hold = Hold::default();
    let owner_call = charge(&owner_store, &tenant, identity.key(), 3, Some(&hold), &runs);
    let duplicate = async {
        hold.reached.notified().await;
        let dup_call = with_outcome(charge(&dup, &tenant, identity.key(), 3, None, &runs));
        let fault = async {
            step(
                "the duplicate's mark",
                until_marked(&owner_store, &identity),
            )
            .await;
            assert_eq!(proxy.listens(), 1, "one listener, listening once");
            match end {
                End::Closed => assert_eq!(proxy.close_listeners(), 1, "one listener connection"),
                End::Terminated => {
                    let ports = proxy.listener_ports();
                    assert_eq!(ports.len(), 1, "one listener connection");
                    let ended: Vec<bool> = sqlx::query_scalar(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE application_name = $1 AND client_port = $2",
                    )
                    .bind(&name)
                    .bind(ports[0])
                    .fetch_all(owner_store.pool())
                    .await
                    .expect("terminate the listener's backend");
                    assert_eq!(ended, vec![true], "the listener's one backend");
                }
            }
            hold.go.notify_one();
        };
        let (answer, ()) = tokio::join!(step("the duplicate's answer", dup_call), fault);
        answer
    };
    let (owned, (replayed, outcome)) = tokio::join!(owner_call, duplicate);
    assert_eq!(owned.expect("owner"), 30);
    assert_eq!(
        replayed.expect("duplicate"),
        30,
        "{end:?}: the duplicate replays"
    );
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    step(
        "the listener to LISTEN again on a new connection",
        proxy.until_listens(2),
    )
    .await;

    // Round 2: notifications wake waiters again.
    let identity = Identity::new(&tenant, SCOPE, "ended-2").expect("identity");
    let hold = Hold::default();
    let owner_call = charge(&owner_store, &tenant, identity.key(), 5, Some(&hold), &runs);
    let duplicate = async {
        hold.reached.notified().await;
        let dup_call = charge(&dup, &tenant, identity.key(), 5, None, &runs);
        let release = async {
            step(
                "the duplicate's mark",
                until_marked(&owner_store, &identity),
            )
            .await;
            let marked_at = dup.reserves();
            tokio::time::sleep(Duration::from_secs(2)).await;
            hold.go.notify_one();
            marked_at
        };
        tokio::join!(step("the second duplicate's answer", dup_call), release)
    };
    let (owned, (replayed, marked_at)) = tokio::join!(owner_call, duplicate);
    assert_eq!(owned.expect("owner"), 50);
    assert_eq!(replayed.expect("duplicate"), 50);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let after_mark = dup.reserves() - marked_at;
    assert!(
        after_mark <= 2,
        "{end:?}: after the listener reconnected, a waiter is woken by the notification, \
         not by polling: {after_mark} reservations after its mark"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_connection_closed_mid_wait_wakes_its_waiters_and_listens_again() {
    ended_mid_wait(End::Closed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_backend_terminated_mid_wait_wakes_its_waiters_and_listens_again() {
    ended_mid_wait(End::Terminated).await;
}

/// The server ends sessions idle longer than `idle_session_timeout` (a
/// setting of the role, the database or, here, the connection's options,
/// which the listener's connection shares with the pool's). The listener's
/// connection is idle while nobody waits (it only listens), so the server
/// ended it at every timeout: a warning each time ("lost its connection"),
/// and a reconnection, forever, and a duplicate arriving meanwhile polled.
/// The listener must keep its connection within the server's idle limit:
/// here, no loss while the store sits idle for four times the limit, and the
/// next duplicate is still woken by a notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_keeps_its_connection_within_the_servers_idle_session_timeout() {
    let Some(owner_store) = pg_store_or_skip().await else {
        return;
    };
    log::capture();
    let name = format!("idempotent-idle-{}", uuid::Uuid::new_v4().simple());
    let options = PgConnectOptions::from_str(&pg_url())
        .expect("the test URL")
        .application_name(&name)
        .options([("idle_session_timeout", "1s")]);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        // The pool's own idle connections are ended by the server too; a
        // connection is tested before it is handed out (sqlx's default).
        .test_before_acquire(true)
        .connect_with(options)
        .await
        .expect("a pool with idle_session_timeout = 1s");
    let dup = Counting::new(PgStore::from_pool(pool).await.expect("store"));
    let tenant = fresh_tenant();
    let runs = AtomicUsize::new(0);
    // A duplicate waits, `wait_for` of them: the listener listens.
    let woken = |key: &'static str, amount: u64| {
        let (tenant, runs, dup, owner_store) = (&tenant, &runs, &dup, &owner_store);
        async move {
            let identity = Identity::new(tenant, SCOPE, key).expect("identity");
            let hold = Hold::default();
            let owner_call = charge(owner_store, tenant, key, amount, Some(&hold), runs);
            let duplicate = async {
                hold.reached.notified().await;
                let dup_call = charge(dup, tenant, key, amount, None, runs);
                let release = async {
                    step("the duplicate's mark", until_marked(owner_store, &identity)).await;
                    hold.go.notify_one();
                };
                tokio::join!(step("the duplicate's answer", dup_call), release).0
            };
            let (owned, replayed) = tokio::join!(owner_call, duplicate);
            assert_eq!(owned.expect("owner"), amount * 10);
            assert_eq!(replayed.expect("duplicate"), amount * 10);
        }
    };
    woken("idle-1", 1).await;
    let losses = log::warnings_containing("lost its connection");
    // Idle: nobody waits for four of the server's idle limits.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        log::warnings_containing("lost its connection") - losses,
        0,
        "the server ended the idle listener's connection"
    );
    woken("idle-2", 2).await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "each body ran once");
}
