//! What the two server stores, PostgreSQL and MySQL/MariaDB, share: opening
//! their pool on a URL, a pool per runtime ([`RuntimePools`]), and the
//! background worker that finishes dropped calls' records on a small pool of
//! its own.
//!
//! # Connections belong to a runtime
//!
//! A pooled connection's socket is registered with the I/O driver of the
//! runtime that opened it, and only that driver reports it ready. Used from
//! another runtime it works while its own runtime drives I/O, answers nothing
//! (a statement hangs, an acquire times out) while that runtime is alive but
//! idle (a current-thread runtime no one is blocking on), and fails ("A Tokio
//! 1.x context was found, but it is being shutdown") once that runtime is
//! gone, even in the middle of a statement. The common way to get there is a
//! `static` store shared by many `#[tokio::test]`s, each on a runtime of its
//! own that ends with the test. So a store never hands one runtime's
//! connections to another: calls on the runtime the store was opened on use
//! the pool it was opened with, and calls on any other runtime use a pool of
//! that runtime's own, made with the same options on first use and dropped
//! (its connections closed) when that runtime shuts down.

use super::detached::{Detached, Work};
use crate::error::StoreError;
use crate::identity::Identity;
use crate::store::{Fenced, OwnerToken};
use futures_util::future::BoxFuture;
use sqlx::pool::PoolOptions;
use sqlx::{Database, Pool};
use std::borrow::Cow;
use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use tokio::runtime::{Handle, Id};

pub use super::ACQUIRE_TIMEOUT;

/// The connect options of a database's connections (`PgConnectOptions`, ...).
type ConnectOptions<DB> = <<DB as Database>::Connection as sqlx::Connection>::Options;

/// Connects a pool of 16 connections to the server `url` names, waiting at
/// most [`ACQUIRE_TIMEOUT`]. A bad URL, or a server that does not answer in
/// time, is a `StoreError` of `store` naming the `server` and its
/// `address(options)` (host and port), never a hang.
pub(crate) async fn connect<DB: Database>(
    store: &'static str,
    server: &str,
    url: &str,
    address: impl FnOnce(&ConnectOptions<DB>) -> String,
) -> Result<Pool<DB>, StoreError> {
    let options = ConnectOptions::<DB>::from_str(url)
        .map_err(|e| StoreError::new(store, "connect", format!("bad database URL: {e}")))?;
    let address = address(&options);
    PoolOptions::<DB>::new()
        .max_connections(16)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| StoreError::new(store, "connect", connect_failure(server, &address, &e)))
}

/// What a failed connection to the `server` at `address` says: sqlx's
/// error, and what to check.
pub(crate) fn connect_failure(server: &str, address: &str, e: &sqlx::Error) -> String {
    // The server answered and refused (a database or user it does
    // not know, a password), or nothing answered in time.
    let why = match e {
        sqlx::Error::Database(_) => "the server refused: check the database name, user \
                     and password in the URL, and the server's state (too many connections, \
                     starting up)"
            .to_owned(),
        sqlx::Error::PoolTimedOut => format!(
            "no connection within {ACQUIRE_TIMEOUT:?} (refused, unreachable, too slow, \
                     or the server kept refusing new connections: too many connections, \
                     starting up): check the host and port in the URL and that the server is up"
        ),
        sqlx::Error::Io(_) => "could not reach or talk to the server: check the host \
                     and port in the URL, that the server is up, and its TLS settings"
            .to_owned(),
        _ => "check the URL: its scheme, host and port (a server of the kind it names), \
                     and its TLS options"
            .to_owned(),
    };
    format!("could not connect to the {server} server at {address}: {e}; {why}")
}

/// A store's pools, one per runtime (module docs): the pool the store was
/// opened with, for the runtime it was opened on, and one made with the same
/// options for each other runtime the store is used from.
pub(crate) struct RuntimePools<DB: Database> {
    /// The pool the store was opened with.
    home: Pool<DB>,
    /// The runtime the store was opened on, while it runs (`None`: opened
    /// outside a runtime).
    home_runtime: Option<(Id, Arc<AtomicBool>)>,
    /// The pools of the other runtimes, each removed when its runtime shuts down.
    others: Arc<Mutex<HashMap<Id, Pool<DB>>>>,
    /// Dropped with the store: ends the tasks [`on_shutdown`] left on the
    /// runtimes it was used from (nothing is ever sent).
    gone: tokio::sync::watch::Sender<()>,
}

impl<DB: Database> std::fmt::Debug for RuntimePools<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimePools")
            .field("home", &self.home)
            .field(
                "other_runtimes",
                &self.others.try_lock().map(|o| o.len()).ok(),
            )
            .finish()
    }
}

impl<DB: Database> RuntimePools<DB> {
    /// Pools for a store opened with `pool` on the current runtime.
    pub(crate) fn new(pool: Pool<DB>) -> Self {
        let (gone, _) = tokio::sync::watch::channel(());
        let home_runtime = Handle::try_current().ok().map(|runtime| {
            let alive = Arc::new(AtomicBool::new(true));
            let flag = alive.clone();
            // Dropped when the runtime shuts down: from then on its id never
            // selects the pool it opened (ids of finished runtimes may be reused).
            on_shutdown(&runtime, gone.subscribe(), move || {
                flag.store(false, Ordering::Release)
            });
            (runtime.id(), alive)
        });
        RuntimePools {
            home: pool,
            home_runtime,
            others: Arc::new(Mutex::new(HashMap::new())),
            gone,
        }
    }

    /// The pool the store was opened with.
    pub(crate) fn home(&self) -> &Pool<DB> {
        &self.home
    }

    /// The pool for the runtime the caller runs on. Outside a runtime (a
    /// statement polled by another executor), the pool the store was opened with.
    pub(crate) fn current(&self) -> Cow<'_, Pool<DB>> {
        let Ok(runtime) = Handle::try_current() else {
            return Cow::Borrowed(&self.home);
        };
        let id = runtime.id();
        if let Some((home, alive)) = &self.home_runtime
            && *home == id
            && alive.load(Ordering::Acquire)
        {
            return Cow::Borrowed(&self.home);
        }
        let mut others = self.others.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pool) = others.get(&id) {
            return Cow::Owned(pool.clone());
        }
        // Lazy, and nothing opened ahead: connections are opened by this
        // runtime's own statements, as many as it uses at once (at most the
        // pool's `max_connections` per runtime).
        let pool = self
            .home
            .options()
            .clone()
            .min_connections(0)
            .connect_lazy_with((*self.home.connect_options()).clone());
        others.insert(id, pool.clone());
        drop(others);
        let others = Arc::downgrade(&self.others);
        on_shutdown(&runtime, self.gone.subscribe(), move || forget(&others, id));
        Cow::Owned(pool)
    }
}

/// Drops the pool of runtime `id` (closing its idle connections), if the
/// store is still there.
fn forget<DB: Database>(others: &Weak<Mutex<HashMap<Id, Pool<DB>>>>, id: Id) {
    if let Some(others) = others.upgrade() {
        let removed = others.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        drop(removed); // outside the lock
    }
}

/// Runs `then` when `runtime` shuts down: a task that lasts as long as the
/// store holds it, and a runtime drops its tasks when it shuts down. When the
/// store is dropped first (`gone` closes), the task ends and `then` runs
/// then, so a runtime that outlives many stores keeps no task per store.
fn on_shutdown(
    runtime: &Handle,
    mut gone: tokio::sync::watch::Receiver<()>,
    then: impl FnOnce() + Send + 'static,
) {
    struct OnDrop<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for OnDrop<F> {
        fn drop(&mut self) {
            if let Some(then) = self.0.take() {
                then();
            }
        }
    }
    let guard = OnDrop(Some(then));
    runtime.spawn(async move {
        let _guard = guard;
        // Nothing is ever sent: this ends when the store's sender is dropped.
        while gone.changed().await.is_ok() {}
    });
}

/// One of a store's fenced writes, run on the worker's pool for a dropped
/// call: `Ok(Fenced::Written)` when done, `Ok(Fenced::NotOwner)` when the token owns nothing.
type Written = BoxFuture<'static, Result<Fenced, StoreError>>;

/// The worker that finishes dropped calls' records: its own small pool (two
/// connections) on its own runtime, with the store pool's connect options
/// and pool options (its `after_connect`, `before_acquire` and
/// `after_release` hooks too). `write` carries out one [`Work`] on a
/// connection of that pool: [`Work::Release`] frees a dropped call's record;
/// [`Work::EndLease`] ends its lease and keeps it (a call in a scope with a
/// recover hook, dropped while its reservation was in flight);
/// [`Work::Complete`] records the outcome of one dropped while its result
/// was being recorded (marked recovered when a recover hook gave it).
/// `write` may carry what the store knows of itself (MySQL: the database
/// it named its table in, which the worker's fresh connections need not be on).
pub(crate) fn background_worker<DB: Database>(
    store: &'static str,
    pool: &Pool<DB>,
    write: impl Fn(Pool<DB>, Identity, OwnerToken, Work) -> Written + Send + Sync + 'static,
) -> Detached {
    // The pool's own options, hooks included (an `after_connect` that sets a
    // `search_path` or a role applies to these connections too), sized down.
    let pool_options = pool
        .options()
        .clone()
        .max_connections(2)
        .min_connections(0)
        .acquire_timeout(ACQUIRE_TIMEOUT);
    let options = pool.connect_options();
    let worker = Detached::new(
        store,
        Box::new(move || {
            let pool = pool_options.connect_lazy_with((*options).clone());
            Arc::new(move |identity, token, work| write(pool.clone(), identity, token, work))
        }),
    );
    worker.set_attempt_limit(super::detached::ATTEMPT_ANSWERS_WITHIN);
    worker
}

/// Runs `statement`, a statement (or a few, one round trip after another)
/// a store sends on a caller's behalf on a [`ClosedIfDropped`] connection it
/// holds, and gives it up when the server leaves it unanswered for
/// `silent_after` (the store's silent-connection timeout,
/// [`ATTEMPT_ANSWERS_WITHIN`](super::detached::ATTEMPT_ANSWERS_WITHIN)
/// unless set) plus `waits`: the longest the statement may
/// rightly wait on the server (the row-lock waits the store allows it, the
/// time its bytes take to cross the link), so that a legitimate wait is
/// never cut. Given up, it is `Err` with [`unanswered`]'s error: the caller
/// then returns that error at once, dropping the connection unanswered, so
/// [`ClosedIfDropped`] closes it (never hand it back). The acquire is not
/// counted: the pool's `acquire_timeout` bounds it.
///
/// Without it, a connection gone silent (a frozen server that still
/// acknowledges packets, a network black hole; new connections would work)
/// held an annotated call for as long as TCP kept the connection: minutes
/// to for ever, unless the caller bounded the call itself. The store's
/// worker bounds its own attempts the same way
/// ([`Detached::set_attempt_limit`]). A statement given up may still land
/// later; every write is fenced by its owner token, and the engine treats
/// the error as one after which the statement may have landed (a
/// reservation's record is released, a completion's answer is recorded by
/// the worker).
pub(crate) async fn answered_within<F: std::future::Future>(
    silent_after: std::time::Duration,
    waits: std::time::Duration,
    statement: F,
) -> Result<F::Output, sqlx::Error> {
    let within = silent_after.saturating_add(waits);
    tokio::time::timeout(within, statement)
        .await
        .map_err(|_| unanswered(within))
}

/// What a statement given up by [`answered_within`] fails with: an I/O
/// error (`TimedOut`) saying what happened and what to check.
fn unanswered(within: std::time::Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "the database server did not answer within {within:?} (a connection gone silent: \
             a stalled or frozen server, or a network dropping its packets; or a wait for a \
             lock that long, behind DDL or a long transaction); the statement was given up and \
             its connection closed, and it may still land. Check the database server, its \
             locks and the network to it; the call can be retried"
        ),
    ))
}

/// A pooled connection for a store statement, handed back to the pool only
/// once the statement has answered ([`hand_back`](Self::hand_back)); dropped
/// before that (the call was dropped mid-statement: a caller's timeout, a
/// cancelled request), it is closed instead. sqlx hands a connection back by
/// pinging it, without a bound: on a server that never answers the
/// interrupted statement (stalled, or the connection black-holed by the
/// network) the ping holds the pool's slot for as long as the TCP connection
/// lives, and once callers that gave up had held every slot, every later call
/// failed with `PoolTimedOut`, though new connections would have worked.
/// sqlx bounds a close (5 s).
pub(crate) struct ClosedIfDropped<DB: Database>(Option<sqlx::pool::PoolConnection<DB>>);

impl<DB: Database> ClosedIfDropped<DB> {
    /// A connection of `pool`.
    pub(crate) async fn acquire(pool: &Pool<DB>) -> Result<Self, sqlx::Error> {
        Ok(Self(Some(pool.acquire().await?)))
    }

    /// The statement answered (or failed): back to the pool as usual.
    pub(crate) fn hand_back(mut self) {
        drop(self.0.take());
    }

    /// Closes the connection when it is dropped, also after a `hand_back`.
    #[cfg(any(feature = "mysql", feature = "postgres"))]
    pub(crate) fn close_on_drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

#[cfg(any(feature = "mysql", feature = "postgres"))]
impl<DB: Database> super::Pooled<DB> for ClosedIfDropped<DB> {
    fn acquire(pool: &Pool<DB>) -> BoxFuture<'_, Result<Self, sqlx::Error>> {
        Box::pin(ClosedIfDropped::acquire(pool))
    }

    fn close_on_drop(&mut self) {
        ClosedIfDropped::close_on_drop(self);
    }
}

impl<DB: Database> std::ops::Deref for ClosedIfDropped<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.0
            .as_ref()
            .expect("present until handed back or dropped")
    }
}

impl<DB: Database> std::ops::DerefMut for ClosedIfDropped<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.0
            .as_mut()
            .expect("present until handed back or dropped")
    }
}

impl<DB: Database> Drop for ClosedIfDropped<DB> {
    fn drop(&mut self) {
        if let Some(mut conn) = self.0.take() {
            conn.close_on_drop();
        }
    }
}
