//! Rules 4, 14 and 20 on SQLite: a call in a scope with a `recover` hook,
//! its reservation a takeover of a record whose owner died (lease ended), is
//! dropped while its reservation statement is at SQLite, waiting for the
//! write lock. The statement goes on without the call and lands: the call's
//! token then owns the record, with a whole lease (an hour here). The
//! store's work for the dropped call must end that lease, however late the
//! statement lands within SQLite's busy timeout, so that a retry takes the
//! record over at once and asks the hook, instead of being refused as in
//! progress for the hour.
//!
//! The statement is parked by a busy handler of the test's own
//! (`sqlite3_busy_handler` on every connection of the store's pool, the
//! worker's too): the first connection to meet the lock once the test arms
//! it waits in the handler until the test lets it go, as a statement waits
//! in SQLite's busy handler for a lock held by another connection (the
//! test's, here). Any other wait acts as a busy timeout of 10 s. A commit hook
//! on the parked connection tells the test when its statement commits.
//!
//! On a current-thread runtime the reservation runs in the caller's future
//! and its statement outlives it; on a multi-threaded one it runs in a task
//! of its own, which the call's drop does not end (and which holds the
//! process's write turn while parked, so the worker's writes queue behind
//! it there, whether or not the worker waits for the reservation).
//!
//! On PostgreSQL and MariaDB the statement is held on its way to the server
//! by the fault proxy instead, and let through just after the drop.

use crate::common;

use common::proxy::FaultProxy;
use common::servers::fresh_tenant;
use idempotent_runtime::{
    idempotent, with_outcome, Error, Fenced, Identity, Outcome, RecordState, Recovery, SqliteStore,
    Store, Takeover,
};
use libsqlite3_sys as ffi;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// How long anything the test waits for may take: only reached when it hangs.
const BOUND: Duration = Duration::from_secs(60);

/// How long after it was parked a late statement lands: past the worker's
/// retry schedule (about 9 s), within SQLite's busy timeout (10 s), as a
/// statement that waited for a lock that long could.
const LATE: Duration = Duration::from_millis(9_500);

/// The test's hold on one statement (see the module's comment).
#[derive(Default)]
struct Park {
    state: Mutex<ParkState>,
    changed: Condvar,
    /// Told when the armed statement waits in the handler.
    parked: Notify,
    /// Told when the parked connection commits (its statement landed).
    landed: Notify,
}

#[derive(Default)]
struct ParkState {
    armed: bool,
    released: bool,
}

/// What each connection's busy handler is given: the park, and the
/// connection (for its commit hook).
struct ConnPark {
    park: Arc<Park>,
    db: *mut ffi::sqlite3,
}

impl Park {
    fn lock(&self) -> std::sync::MutexGuard<'_, ParkState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn arm(&self) {
        self.lock().armed = true;
    }

    fn release(&self) {
        self.lock().released = true;
        self.changed.notify_all();
    }

    /// The busy handler's answer on `db`, the `count`th time it is asked:
    /// 1 to try the lock again, 0 to give up.
    fn busy(&self, db: *mut ffi::sqlite3, count: c_int) -> c_int {
        let mut state = self.lock();
        if state.armed {
            state.armed = false;
            // SAFETY: `db` is the connection whose handler this is, asked on
            // its own thread; the hook's argument (this park) outlives it.
            unsafe {
                ffi::sqlite3_commit_hook(
                    db,
                    Some(committing),
                    std::ptr::from_ref(self).cast_mut().cast(),
                );
            }
            self.parked.notify_one();
            while !state.released {
                state = self
                    .changed
                    .wait(state)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            return 1;
        }
        drop(state);
        if count < 10_000 {
            std::thread::sleep(Duration::from_millis(1));
            1
        } else {
            0
        }
    }
}

unsafe extern "C" fn busy(arg: *mut c_void, count: c_int) -> c_int {
    // SAFETY: `arg` is the `ConnPark` installed with this handler, never freed.
    let conn = unsafe { &*arg.cast::<ConnPark>() };
    conn.park.busy(conn.db, count)
}

/// Told as the parked connection commits (its statement holds the write
/// lock until the commit is done), also when its statement is reset before
/// its end (its call gone), where no WAL hook is called.
unsafe extern "C" fn committing(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the park given with this hook, kept alive by the test.
    let park = unsafe { &*arg.cast::<Park>() };
    park.landed.notify_one();
    0
}

/// Installs `park`'s busy handler on a connection.
fn install(handle: &mut sqlx::sqlite::LockedSqliteHandle<'_>, park: Arc<Park>) {
    let db = handle.as_raw_handle().as_ptr();
    // Leaked: a handful of connections per test, each needing it as long as
    // it is open.
    let arg = Box::into_raw(Box::new(ConnPark { park, db }));
    // SAFETY: the handle is locked (the connection's thread waits), and
    // `arg` is never freed.
    unsafe {
        ffi::sqlite3_busy_handler(db, Some(busy), arg.cast());
    }
}

/// A store on a new WAL database whose pool's connections (and so its
/// worker's) wait for locks in `park`'s busy handler; with the options, for
/// the test's own connection.
async fn parked_store(park: &Arc<Park>) -> (SqliteStore, sqlx::sqlite::SqliteConnectOptions) {
    use std::str::FromStr;
    let options =
        sqlx::sqlite::SqliteConnectOptions::from_str(&common::scratch::sqlite_url("late_takeover"))
            .expect("url")
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let park = park.clone();
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .after_connect(move |conn, _| {
            let park = park.clone();
            Box::pin(async move {
                let mut handle = conn.lock_handle().await?;
                install(&mut handle, park);
                Ok(())
            })
        })
        .connect_with(options.clone())
        .await
        .expect("pool");
    let store = SqliteStore::from_pool(pool).await.expect("store");
    (store, options)
}

async fn run_again(_: &Takeover) -> Result<Recovery<u32>, Error> {
    Ok(Recovery::Run)
}

#[idempotent(scope = "faults.late_takeover", key = key, tenant = tenant, store = store,
             skip(runs), lease = "1h", in_progress = reject, recover = run_again)]
async fn charge(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

/// The takeover of a dead owner's record, dropped while its statement waits
/// for the lock; the statement lands at once after the drop, or `late`.
async fn a_takeover_dropped_at_sqlite(late: bool) {
    let park = Arc::new(Park::default());
    let (store, options) = parked_store(&park).await;
    let tenant = fresh_tenant();
    let key = "late-takeover";
    let id = Identity::new(&tenant, "faults.late_takeover", key).expect("identity");
    let hour = Duration::from_secs(3600);
    let dead = common::records::acquire(&store, &id, None, hour, hour).await;
    assert_eq!(
        store
            .heartbeat(&id, &dead, Duration::ZERO)
            .await
            .expect("end the lease"),
        Fenced::Written,
        "the dead owner's lease ended"
    );

    // Another connection holds the write lock: the call's statement waits.
    let mut holder: sqlx::SqliteConnection = sqlx::Connection::connect_with(&options)
        .await
        .expect("holder");
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .expect("take the write lock");
    park.arm();
    let runs = AtomicUsize::new(0);
    tokio::select! {
        answer = charge(&store, &tenant, key, &runs) => {
            panic!("the call answered while its takeover waited for the lock: {answer:?}")
        }
        () = park.parked.notified() => {}
    }
    // The call is dropped; the lock is free for everyone but the parked
    // statement (the worker's writes find the dead owner's record).
    sqlx::query("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("free the write lock");
    if late {
        // The worker's work for the dropped call ends, having found nothing
        // (its schedule done), or goes on past `LATE`: the statement lands
        // then either way, within its busy timeout.
        let _ = store.finish_background_work(LATE).await;
    }
    park.release();
    tokio::time::timeout(BOUND, park.landed.notified())
        .await
        .expect("the dropped call's takeover commits");
    // Its connection holds the write lock until the commit is done.
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .expect("the write lock, once the takeover committed");
    sqlx::query("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("free the write lock");

    let left = tokio::time::timeout(BOUND, store.finish_background_work(BOUND))
        .await
        .expect("finish_background_work overran its own bound");
    assert_eq!(
        left, 0,
        "the store's work for the dropped call did not finish"
    );
    let record = store.fetch(&id).await.expect("fetch").expect("a record");
    assert_eq!(record.state, RecordState::InProgress, "{record:?}");
    assert_eq!(record.attempt, 2, "the dropped call's takeover: {record:?}");
    assert!(
        record
            .lease_expires_at_ms
            .is_some_and(|end| end <= record.now_ms),
        "the dropped call's takeover kept its lease of an hour: {record:?}"
    );
    let (answer, outcome) = with_outcome(charge(&store, &tenant, key, &runs)).await;
    assert_eq!(answer.expect("the retry took the record over"), 7);
    assert_eq!(outcome, Some(Outcome::Executed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the retry's body ran once");
    drop(holder);
}

#[tokio::test]
async fn sqlite_a_takeover_landing_just_after_its_call_was_dropped_has_its_lease_ended() {
    a_takeover_dropped_at_sqlite(false).await;
}

#[tokio::test]
async fn sqlite_a_takeover_landing_late_after_its_call_was_dropped_has_its_lease_ended() {
    a_takeover_dropped_at_sqlite(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_multi_thread_a_takeover_landing_just_after_its_call_was_dropped_has_its_lease_ended(
) {
    a_takeover_dropped_at_sqlite(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_multi_thread_a_takeover_landing_late_after_its_call_was_dropped_has_its_lease_ended(
) {
    a_takeover_dropped_at_sqlite(true).await;
}

/// The same on a database server: the takeover's statement is held on its
/// way by the fault proxy (its connection only) while the call is dropped,
/// and reaches the server once let through, after its call is gone. The
/// store's worker looks for the record on its retry schedule (and for as
/// long as the store's statements wait for locks): a statement let through
/// within it has its lease ended.
async fn a_takeover_held_on_its_way(
    name: &str,
    proxy: &FaultProxy,
    store: &dyn Store,
    reads_first: usize,
) {
    let tenant = fresh_tenant();
    let key = format!("late-takeover-{}", uuid::Uuid::new_v4().simple());
    let id = Identity::new(&tenant, "faults.late_takeover", &key).expect("identity");
    let hour = Duration::from_secs(3600);
    let dead = common::records::acquire(store, &id, None, hour, hour).await;
    assert_eq!(
        store
            .heartbeat(&id, &dead, Duration::ZERO)
            .await
            .expect("end the lease"),
        Fenced::Written,
        "{name}: the dead owner's lease ended"
    );
    // The store's statements before the takeover (a look that finds the
    // lease over) pass.
    let held = proxy.hold_request_containing_after(key.as_bytes(), reads_first);
    let runs = AtomicUsize::new(0);
    tokio::select! {
        answer = charge(store, &tenant, &key, &runs) => {
            panic!("{name}: the call answered while its takeover was held: {answer:?}")
        }
        () = held.request_seen() => {}
    }
    // The call is dropped; its statement goes on to the server.
    proxy.release_held();
    held.settled().await;
    let left = tokio::time::timeout(BOUND, store.finish_background_work(BOUND))
        .await
        .expect("finish_background_work overran its own bound");
    assert_eq!(
        left, 0,
        "{name}: the store's work for the dropped call did not finish"
    );
    let record = store.fetch(&id).await.expect("fetch").expect("a record");
    assert_eq!(record.state, RecordState::InProgress, "{name}: {record:?}");
    assert_eq!(
        record.attempt, 2,
        "{name}: the dropped call's takeover: {record:?}"
    );
    assert!(
        record
            .lease_expires_at_ms
            .is_some_and(|end| end <= record.now_ms),
        "{name}: the dropped call's takeover kept its lease of an hour: {record:?}"
    );
    let (answer, outcome) = with_outcome(charge(store, &tenant, &key, &runs)).await;
    assert_eq!(answer.expect("the retry took the record over"), 7, "{name}");
    assert_eq!(outcome, Some(Outcome::Executed), "{name}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "{name}: the retry's body ran once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_takeover_reaching_the_server_after_its_call_was_dropped_has_its_lease_ended() {
    let Some((proxy, store)) = crate::connection_faults::through_a_proxy::postgres(4).await else {
        return;
    };
    // `idempotency_reserve` answers that the record needs the autocommit
    // takeover, which comes next.
    a_takeover_held_on_its_way("postgres", &proxy, &store, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_takeover_reaching_the_server_after_its_call_was_dropped_has_its_lease_ended() {
    let Some((proxy, store)) = crate::connection_faults::through_a_proxy::mariadb(4).await else {
        return;
    };
    // The insert that finds the record, then the procedure that takes it over.
    a_takeover_held_on_its_way("mariadb", &proxy, &store, 1).await;
}
