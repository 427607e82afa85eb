//! An in-process TCP fault proxy for connection-level fault tests (DESIGN §6:
//! "faults at the connection level (a connection cut mid-statement, a stalled
//! server) are injected, not only provoked by luck").
//!
//! [`FaultProxy::start`] listens on `127.0.0.1:0` and forwards every accepted
//! connection to the real server. The test points a pool at [`FaultProxy::port`]
//! and switches faults at any moment; every fault applies to the connections
//! already open and to new ones:
//!
//! * pass through ([`FaultProxy::pass_through`], the initial mode);
//! * [`cut_on_next_request`](FaultProxy::cut_on_next_request): the next bytes a
//!   client sends are dropped and that connection is closed on both sides, so
//!   the statement never reaches the server;
//! * [`cut_on_next_response`](FaultProxy::cut_on_next_response): the next
//!   request is forwarded, and when the server's answer arrives the connection
//!   is closed on both sides instead: the statement ran (and, in autocommit,
//!   committed) but the client never learns it;
//! * [`stall`](FaultProxy::stall): bytes are held in both directions, or only
//!   server → client, until [`release_stall`](FaultProxy::release_stall);
//! * [`hold_next_request_containing`](FaultProxy::hold_next_request_containing):
//!   one connection's requests are held until
//!   [`release_held`](FaultProxy::release_held), then reach the server even
//!   if the client has closed that connection meanwhile (a statement delayed
//!   on its way, which the server still runs);
//! * [`slow`](FaultProxy::slow): every chunk is delayed;
//! * [`go_down`](FaultProxy::go_down): an outage, every client chunk (a new
//!   connection's handshake too) is dropped and its connection cut, until
//!   [`pass_through`](FaultProxy::pass_through).
//!
//! The one-shot faults (cuts, and [`stall_on_next_request_containing`](FaultProxy::stall_on_next_request_containing))
//! come in a `_containing(needle)` form that fires only on a client chunk
//! containing those bytes. Database drivers send bound parameters verbatim
//! (PostgreSQL's `Bind`, MySQL's `COM_STMT_EXECUTE`), so a needle such as an
//! idempotency key, an owner token or a result picks out exactly one statement,
//! and the pool's own traffic (a ping before acquire, a `Parse`/`PREPARE` round
//! trip, the startup handshake) passes untouched.
//!
//! Nothing here depends on timing: arming a one-shot fault returns a [`Trip`]
//! the test awaits ("the matching request arrived", "the connection was cut",
//! "the server's answer to it arrived"),
//! and [`FaultProxy::wait_until`] awaits the proxy's counters (connections,
//! cuts, chunks held by a stall). Every wait is bounded by [`WAIT_LIMIT`] and
//! fails the test with what it was waiting for, rather than hanging.
//!
//! # Why hand-rolled
//!
//! The Rust options were checked first. `toxiproxy_rust` is only an HTTP
//! client for Shopify's Toxiproxy server, a separate Go program the test
//! machines would have to install and run as a service. `noxious`, a Rust port
//! of that server usable as a library, has not been released since 2021
//! (tokio-util 0.6), and like Toxiproxy its faults ("toxics": latency,
//! bandwidth, slicer, timeout, reset_peer) are time- or probability-driven:
//! none cuts the connection exactly when one statement's request or response
//! passes, and none tells the test that the fault has fired. Tests built on
//! them would depend on timing windows. What is needed is about 300 lines of
//! tokio, so it lives here.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Every wait in this module gives up after this long and fails the test.
pub const WAIT_LIMIT: Duration = Duration::from_secs(30);

/// Which way bytes flow through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client → server (requests).
    ToServer,
    /// Server → client (responses).
    ToClient,
}

/// What a stall holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    /// Bytes in both directions.
    Both,
    /// Only the server's answers: requests still reach the server and run.
    ToClientOnly,
}

impl Stall {
    fn holds(self, direction: Direction) -> bool {
        match self {
            Stall::Both => true,
            Stall::ToClientOnly => direction == Direction::ToClient,
        }
    }
}

/// The proxy's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Client connections accepted and connected to the server.
    pub connections: u64,
    /// Of those, still open.
    pub open: u64,
    /// Bytes forwarded client → server.
    pub bytes_to_server: u64,
    /// Bytes forwarded server → client.
    pub bytes_to_client: u64,
    /// Connections closed by a cut.
    pub cuts: u64,
    /// Chunks a stall holds right now, client → server.
    pub held_to_server: u64,
    /// Chunks a stall holds right now, server → client.
    pub held_to_client: u64,
    /// Chunks ever held by a stall.
    pub stalled_chunks: u64,
}

#[derive(Debug, Clone, Copy)]
enum TrapKind {
    CutRequest,
    CutResponse,
    Stall(Stall),
    /// That connection goes silent for good.
    Silence,
    /// That connection's requests (from that chunk on) are held until
    /// [`FaultProxy::release_held`], then forwarded, also when the client
    /// has closed the connection meanwhile: a request delayed on the way.
    Hold,
}

struct Trap {
    kind: TrapKind,
    needle: Option<Vec<u8>>,
    /// How many matching chunks pass before one trips it.
    passes: usize,
    signal: Arc<TripSignal>,
}

impl Trap {
    /// Whether the client chunk at `window[fresh..]` (with the previous
    /// chunk's tail before it, so a needle split across reads still matches)
    /// trips this trap. A match must end inside the fresh bytes.
    fn matches(&self, window: &[u8], fresh: usize) -> bool {
        match &self.needle {
            None => window.len() > fresh,
            Some(needle) => {
                let from = fresh.saturating_sub(needle.len().saturating_sub(1));
                window[from..].windows(needle.len()).any(|w| w == needle)
            }
        }
    }
}

struct TripSignal {
    what: String,
    seen: watch::Sender<bool>,
    cut: watch::Sender<bool>,
    settled: watch::Sender<bool>,
}

/// A one-shot fault that was armed: await its handshakes.
#[derive(Clone)]
pub struct Trip {
    signal: Arc<TripSignal>,
}

impl Trip {
    /// Waits (bounded) until the matching request arrived at the proxy.
    pub async fn request_seen(&self) {
        wait_flag(
            &self.signal.seen,
            &format!("{}: the request", self.signal.what),
        )
        .await
    }

    /// Waits (bounded) until the connection was cut.
    pub async fn cut(&self) {
        wait_flag(&self.signal.cut, &format!("{}: the cut", self.signal.what)).await
    }

    /// Waits (bounded) until the server's answer to the matching request
    /// reached the proxy (whether or not it is then held, cut or forwarded),
    /// or that connection ended. After this, the request has run on the
    /// server, or never will.
    pub async fn settled(&self) {
        wait_flag(
            &self.signal.settled,
            &format!("{}: the server's answer", self.signal.what),
        )
        .await
    }

    /// Whether the matching request has arrived.
    pub fn has_fired(&self) -> bool {
        *self.signal.seen.borrow()
    }

    /// Whether the connection has been cut.
    pub fn has_cut(&self) -> bool {
        *self.signal.cut.borrow()
    }
}

async fn wait_flag(flag: &watch::Sender<bool>, what: &str) {
    let mut rx = flag.subscribe();
    if tokio::time::timeout(WAIT_LIMIT, rx.wait_for(|v| *v))
        .await
        .is_err()
    {
        panic!("fault proxy: waited {WAIT_LIMIT:?} for {what}, and it did not happen");
    }
}

#[derive(Default)]
struct Control {
    stall: Option<Stall>,
    delay: Option<Duration>,
    trap: Option<Trap>,
    /// An outage: what every client chunk trips while it lasts.
    down: Option<Arc<TripSignal>>,
    /// The requests a [`TrapKind::Hold`] holds may go on.
    held_released: bool,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    open: AtomicU64,
    bytes_to_server: AtomicU64,
    bytes_to_client: AtomicU64,
    cuts: AtomicU64,
    held_to_server: AtomicU64,
    held_to_client: AtomicU64,
    stalled_chunks: AtomicU64,
}

struct Shared {
    upstream: SocketAddr,
    control: Mutex<Control>,
    counters: Counters,
    /// Bumped after every control change and every event (connection, cut,
    /// stall hold or release), never while `control` is locked.
    events: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
}

impl Shared {
    fn control(&self) -> std::sync::MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.events.send_modify(|n| *n += 1);
    }

    fn stats(&self) -> ProxyStats {
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::SeqCst);
        ProxyStats {
            connections: r(&c.connections),
            open: r(&c.open),
            bytes_to_server: r(&c.bytes_to_server),
            bytes_to_client: r(&c.bytes_to_client),
            cuts: r(&c.cuts),
            held_to_server: r(&c.held_to_server),
            held_to_client: r(&c.held_to_client),
            stalled_chunks: r(&c.stalled_chunks),
        }
    }

    fn stalled(&self, direction: Direction) -> bool {
        self.control().stall.is_some_and(|s| s.holds(direction))
    }

    /// Holds the caller while a stall covers `direction`.
    async fn hold_while_stalled(&self, direction: Direction) {
        let mut events = self.events.subscribe();
        if !self.stalled(direction) {
            return;
        }
        let held = match direction {
            Direction::ToServer => &self.counters.held_to_server,
            Direction::ToClient => &self.counters.held_to_client,
        };
        let _held = Held::new(self, held);
        while self.stalled(direction) {
            if events.changed().await.is_err() {
                return;
            }
        }
    }

    /// Holds a held connection's request until [`FaultProxy::release_held`].
    async fn hold_until_released(&self) {
        let mut events = self.events.subscribe();
        let _held = Held::new(self, &self.counters.held_to_server);
        while !self.control().held_released {
            if events.changed().await.is_err() {
                return;
            }
        }
    }

    /// What to do with a chunk: `Some(signal)` cuts the connection.
    fn decide(
        &self,
        direction: Direction,
        window: &[u8],
        fresh: usize,
        conn: &Conn,
    ) -> Option<Arc<TripSignal>> {
        match direction {
            Direction::ToClient => conn
                .cut_response
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
            Direction::ToServer => {
                let trap = {
                    let mut control = self.control();
                    if let Some(down) = &control.down {
                        return Some(down.clone());
                    }
                    if !control
                        .trap
                        .as_ref()
                        .is_some_and(|t| t.matches(window, fresh))
                    {
                        return None;
                    }
                    if let Some(trap) = control.trap.as_mut().filter(|t| t.passes > 0) {
                        trap.passes -= 1;
                        return None;
                    }
                    let trap = control.trap.take().expect("checked above");
                    if let TrapKind::Stall(mode) = trap.kind {
                        control.stall = Some(mode);
                    }
                    trap
                };
                trap.signal.seen.send_replace(true);
                *conn.awaiting.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(trap.signal.clone());
                self.bump();
                match trap.kind {
                    TrapKind::CutRequest => Some(trap.signal),
                    TrapKind::CutResponse => {
                        *conn.cut_response.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(trap.signal);
                        None
                    }
                    TrapKind::Stall(_) => None,
                    TrapKind::Silence => {
                        conn.silenced.store(true, Ordering::SeqCst);
                        None
                    }
                    TrapKind::Hold => {
                        conn.held.store(true, Ordering::SeqCst);
                        None
                    }
                }
            }
        }
    }
}

/// Counts a chunk as held for as long as it lives (also when the connection
/// is torn down while holding).
struct Held<'a> {
    shared: &'a Shared,
    counter: &'a AtomicU64,
}

impl<'a> Held<'a> {
    fn new(shared: &'a Shared, counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        shared
            .counters
            .stalled_chunks
            .fetch_add(1, Ordering::SeqCst);
        shared.bump();
        Held { shared, counter }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::SeqCst);
        self.shared.bump();
    }
}

#[derive(Default)]
struct Conn {
    /// Set when a silence trap matched on this connection: it forwards
    /// nothing more, either way, and never closes (a black-holed TCP
    /// connection).
    silenced: std::sync::atomic::AtomicBool,
    /// Set when a hold trap matched on this connection: its requests wait
    /// for [`FaultProxy::release_held`].
    held: std::sync::atomic::AtomicBool,
    /// Set when this connection forwarded the request of a response-cut trap.
    cut_response: Mutex<Option<Arc<TripSignal>>>,
    /// A tripped trap waiting for the server's answer on this connection.
    awaiting: Mutex<Option<Arc<TripSignal>>>,
}

impl Conn {
    /// The server answered (or the connection ended): settle a waiting trip.
    fn settle(&self, shared: &Shared) {
        let waiting = self
            .awaiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(signal) = waiting {
            signal.settled.send_replace(true);
            shared.bump();
        }
    }
}

/// A TCP proxy on loopback in front of one server. Dropping it closes the
/// listener and every connection.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
        self.accept.abort();
    }
}

impl FaultProxy {
    /// Starts a proxy on `127.0.0.1:0` forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> std::io::Result<Self> {
        let upstream = tokio::net::lookup_host(upstream)
            .await?
            .next()
            .ok_or_else(|| std::io::Error::other(format!("{upstream} resolves to nothing")))?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            control: Mutex::new(Control::default()),
            counters: Counters::default(),
            events: watch::channel(0).0,
            shutdown: watch::channel(false).0,
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(FaultProxy {
            addr,
            shared,
            accept,
        })
    }

    /// Where the proxy listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port the proxy listens on (host `127.0.0.1`).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The counters now.
    pub fn stats(&self) -> ProxyStats {
        self.shared.stats()
    }

    /// Back to plain forwarding: no stall, no delay, no armed one-shot fault.
    pub fn pass_through(&self) {
        {
            let mut control = self.shared.control();
            control.stall = None;
            control.delay = None;
            control.trap = None;
            control.down = None;
        }
        self.shared.bump();
    }

    fn arm(&self, kind: TrapKind, needle: Option<&[u8]>, what: String) -> Trip {
        let signal = Arc::new(TripSignal {
            what,
            seen: watch::channel(false).0,
            cut: watch::channel(false).0,
            settled: watch::channel(false).0,
        });
        {
            let mut control = self.shared.control();
            assert!(
                control.trap.is_none(),
                "fault proxy: a one-shot fault is already armed"
            );
            if let Some(n) = needle {
                assert!(!n.is_empty(), "fault proxy: an empty needle");
            }
            control.trap = Some(Trap {
                kind,
                needle: needle.map(<[u8]>::to_vec),
                passes: 0,
                signal: signal.clone(),
            });
        }
        self.shared.bump();
        Trip { signal }
    }

    /// The next bytes any client sends are dropped and that connection is
    /// closed on both sides.
    pub fn cut_on_next_request(&self) -> Trip {
        self.arm(TrapKind::CutRequest, None, "cut on the next request".into())
    }

    /// Like [`cut_on_next_request`](Self::cut_on_next_request), for the next
    /// client chunk containing `needle`.
    pub fn cut_on_next_request_containing(&self, needle: impl AsRef<[u8]>) -> Trip {
        let needle = needle.as_ref();
        self.arm(
            TrapKind::CutRequest,
            Some(needle),
            format!(
                "cut on the request containing {:?}",
                String::from_utf8_lossy(needle)
            ),
        )
    }

    /// The next request is forwarded; when the server's answer to it arrives,
    /// that connection is closed on both sides instead of forwarding it.
    pub fn cut_on_next_response(&self) -> Trip {
        self.arm(
            TrapKind::CutResponse,
            None,
            "cut on the next response".into(),
        )
    }

    /// Like [`cut_on_next_response`](Self::cut_on_next_response), answering
    /// the next client chunk containing `needle`.
    pub fn cut_on_next_response_containing(&self, needle: impl AsRef<[u8]>) -> Trip {
        let needle = needle.as_ref();
        self.arm(
            TrapKind::CutResponse,
            Some(needle),
            format!(
                "cut on the response to the request containing {:?}",
                String::from_utf8_lossy(needle)
            ),
        )
    }

    /// Holds bytes (per `mode`) on every connection until [`release_stall`](Self::release_stall).
    pub fn stall(&self, mode: Stall) {
        self.shared.control().stall = Some(mode);
        self.shared.bump();
    }

    /// Starts a stall (per `mode`) when the next client chunk containing
    /// `needle` arrives. With [`Stall::Both`] that chunk is held too; with
    /// [`Stall::ToClientOnly`] it reaches the server and its answer is held.
    pub fn stall_on_next_request_containing(&self, needle: impl AsRef<[u8]>, mode: Stall) -> Trip {
        let needle = needle.as_ref();
        self.arm(
            TrapKind::Stall(mode),
            Some(needle),
            format!(
                "stall ({mode:?}) at the request containing {:?}",
                String::from_utf8_lossy(needle)
            ),
        )
    }

    /// Holds the requests of the connection whose next client chunk contains
    /// `needle` (that chunk included) until [`release_held`](Self::release_held),
    /// then forwards them, also when the client has closed that connection
    /// meanwhile (a request that reached the server late); every other
    /// connection passes.
    pub fn hold_next_request_containing(&self, needle: impl AsRef<[u8]>) -> Trip {
        let needle = needle.as_ref();
        self.shared.control().held_released = false;
        self.arm(
            TrapKind::Hold,
            Some(needle),
            format!(
                "hold of the request containing {:?}",
                String::from_utf8_lossy(needle)
            ),
        )
    }

    /// [`hold_next_request_containing`](Self::hold_next_request_containing),
    /// letting the first `passes` client chunks containing `needle` through
    /// (a call's statements before the one to hold).
    pub fn hold_request_containing_after(&self, needle: impl AsRef<[u8]>, passes: usize) -> Trip {
        let trip = self.hold_next_request_containing(needle);
        if let Some(trap) = self.shared.control().trap.as_mut() {
            trap.passes = passes;
        }
        trip
    }

    /// Lets the requests [`hold_next_request_containing`](Self::hold_next_request_containing)
    /// holds go on, in order.
    pub fn release_held(&self) {
        self.shared.control().held_released = true;
        self.shared.bump();
    }

    /// Ends an outage ([`go_down`](Self::go_down)) and, at once, arms a
    /// trap: the connection whose next client chunk contains `needle` goes
    /// silent for good, that chunk included (nothing more is forwarded
    /// either way, and the proxy never closes it: a frozen server, a
    /// network black hole); every other connection passes. Its trip is
    /// seen ([`Trip::request_seen`]) but never settled (the server never
    /// answers it), and its held chunks count as stalled ones
    /// (`held_to_server`, `held_to_client`, `stalled_chunks`).
    pub fn come_back_silencing_next_request_containing(&self, needle: impl AsRef<[u8]>) -> Trip {
        let needle = needle.as_ref();
        let trip = {
            let signal = Arc::new(TripSignal {
                what: format!(
                    "silence at the request containing {:?}",
                    String::from_utf8_lossy(needle)
                ),
                seen: watch::channel(false).0,
                cut: watch::channel(false).0,
                settled: watch::channel(false).0,
            });
            let mut control = self.shared.control();
            assert!(
                control.trap.is_none(),
                "fault proxy: a one-shot fault is already armed"
            );
            assert!(!needle.is_empty(), "fault proxy: an empty needle");
            control.down = None;
            control.trap = Some(Trap {
                kind: TrapKind::Silence,
                needle: Some(needle.to_vec()),
                passes: 0,
                signal: signal.clone(),
            });
            Trip { signal }
        };
        self.shared.bump();
        trip
    }

    /// Arms the trap of
    /// [`come_back_silencing_next_request_containing`](Self::come_back_silencing_next_request_containing)
    /// without an outage before it: the connection whose next client chunk
    /// contains `needle` goes silent for good, that chunk included; every
    /// other connection, and every new one, passes.
    pub fn silence_next_request_containing(&self, needle: impl AsRef<[u8]>) -> Trip {
        self.come_back_silencing_next_request_containing(needle)
    }

    /// An outage until [`pass_through`](Self::pass_through): every client
    /// chunk, on the connections already open and on new ones (their
    /// handshake), is dropped and its connection cut. Each cut is counted.
    pub fn go_down(&self) {
        let signal = Arc::new(TripSignal {
            what: "the outage".into(),
            seen: watch::channel(true).0,
            cut: watch::channel(false).0,
            settled: watch::channel(false).0,
        });
        self.shared.control().down = Some(signal);
        self.shared.bump();
    }

    /// Lets held bytes go, in order.
    pub fn release_stall(&self) {
        self.shared.control().stall = None;
        self.shared.bump();
    }

    /// Delays every chunk, both directions, by `delay`.
    pub fn slow(&self, delay: Duration) {
        self.shared.control().delay = Some(delay);
        self.shared.bump();
    }

    /// Waits (bounded) until the counters satisfy `ready`; wakes on every
    /// connection, cut, stall hold/release and control change.
    pub async fn wait_until(&self, what: &str, ready: impl Fn(&ProxyStats) -> bool) -> ProxyStats {
        let mut events = self.shared.events.subscribe();
        let wait = async {
            loop {
                let stats = self.stats();
                if ready(&stats) {
                    return stats;
                }
                if events.changed().await.is_err() {
                    panic!("fault proxy: gone while waiting for {what}");
                }
            }
        };
        match tokio::time::timeout(WAIT_LIMIT, wait).await {
            Ok(stats) => stats,
            Err(_) => panic!(
                "fault proxy: waited {WAIT_LIMIT:?} for {what}; counters now {:?}",
                self.stats()
            ),
        }
    }

    /// Waits (bounded) until a stall holds at least one chunk going `direction`.
    pub async fn wait_held(&self, direction: Direction) -> ProxyStats {
        self.wait_until(
            &format!("a chunk held going {direction:?}"),
            |s| match direction {
                Direction::ToServer => s.held_to_server > 0,
                Direction::ToClient => s.held_to_client > 0,
            },
        )
        .await
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((client, _)) => {
                tokio::spawn(serve(client, shared.clone()));
            }
            Err(e) => {
                eprintln!("fault proxy: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn serve(client: TcpStream, shared: Arc<Shared>) {
    let mut shutdown = shared.shutdown.subscribe();
    if *shutdown.borrow() {
        return;
    }
    let server = match TcpStream::connect(shared.upstream).await {
        Ok(server) => server,
        Err(e) => {
            eprintln!(
                "fault proxy: cannot reach {}: {e}; closing the client",
                shared.upstream
            );
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    shared.counters.connections.fetch_add(1, Ordering::SeqCst);
    shared.counters.open.fetch_add(1, Ordering::SeqCst);
    shared.bump();
    let conn = Conn::default();
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // A cut, an error or the server's end ends the connection: dropping both
    // pumps drops all four halves, which closes both sockets. The client's
    // end (EOF: it closed the connection) is passed on as TCP does, the
    // server's write side shut down after what the proxy forwarded, and the
    // server's answers are still read (settling a trip, `Trip::settled`:
    // the server answered) until the server closes its side.
    let to_client = pump(
        Direction::ToClient,
        server_read,
        client_write,
        &shared,
        &conn,
    );
    let mut to_client = std::pin::pin!(to_client);
    let client_closed = tokio::select! {
        end = pump(Direction::ToServer, client_read, server_write, &shared, &conn) => {
            end == PumpEnd::Eof
        }
        _ = to_client.as_mut() => false,
        _ = shutdown.wait_for(|stop| *stop) => false,
    };
    if client_closed {
        tokio::select! {
            _ = to_client.as_mut() => {}
            _ = shutdown.wait_for(|stop| *stop) => {}
        }
    }
    conn.settle(&shared);
    shared.counters.open.fetch_sub(1, Ordering::SeqCst);
    shared.bump();
}

/// The most bytes of the previous chunk kept for matching a split needle.
const TAIL: usize = 256;

/// Why a pump stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PumpEnd {
    /// The sending side closed its connection; its write side is shut down
    /// on the other socket.
    Eof,
    /// A read or write failed, or the proxy cut the connection.
    Broken,
}

async fn pump(
    direction: Direction,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    conn: &Conn,
) -> PumpEnd {
    let mut buf = vec![0u8; 64 * 1024];
    let mut window: Vec<u8> = Vec::with_capacity(TAIL + buf.len());
    let forwarded = match direction {
        Direction::ToServer => &shared.counters.bytes_to_server,
        Direction::ToClient => &shared.counters.bytes_to_client,
    };
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) => {
                let _ = to.shutdown().await;
                return PumpEnd::Eof;
            }
            Err(_) => return PumpEnd::Broken,
            Ok(n) => n,
        };
        if direction == Direction::ToClient {
            conn.settle(shared);
        }
        let fresh = window.len();
        window.extend_from_slice(&buf[..n]);
        if let Some(signal) = shared.decide(direction, &window, fresh, conn) {
            shared.counters.cuts.fetch_add(1, Ordering::SeqCst);
            signal.cut.send_replace(true);
            shared.bump();
            return PumpEnd::Broken;
        }
        if conn.silenced.load(Ordering::SeqCst) {
            let _held = Held::new(
                shared,
                match direction {
                    Direction::ToServer => &shared.counters.held_to_server,
                    Direction::ToClient => &shared.counters.held_to_client,
                },
            );
            std::future::pending::<()>().await;
        }
        if direction == Direction::ToServer && conn.held.load(Ordering::SeqCst) {
            shared.hold_until_released().await;
        }
        shared.hold_while_stalled(direction).await;
        let delay = shared.control().delay;
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return PumpEnd::Broken;
        }
        forwarded.fetch_add(n as u64, Ordering::SeqCst);
        let drop_front = window.len().saturating_sub(TAIL);
        window.drain(..drop_front);
    }
}
