//! Transactional mode on SQLite: `TransactionalConnection` for
//! `sqlx::SqliteConnection` and `sqlx::Transaction<'_, Sqlite>`, writing to the
//! `idempotency_records` table that [`SqliteStore`](crate::SqliteStore) creates
//! (open the database with `SqliteStore` once so its migrations have run).
//!
//! SQLite locks the whole database, not a row: once the caller's transaction
//! has written the reservation, another connection's writes wait for it. A
//! duplicate in another transaction does not wait inside its statement (that
//! would leave its transaction holding the write lock even when the wait ends
//! in a replay): its write is tried with the connection's `busy_timeout` at 0
//! (set for the statement and put back after), and tried again within
//! `lock_wait`, reading beside the transaction between tries, so an owner
//! that commits meanwhile is replayed without a lock. Past `lock_wait` it
//! answers `InProgress`. A call dropped during a try cannot put the timeout
//! back itself; the connection gets it back from the next reservation on it,
//! or, in a pool made by `SqliteStore::connect`, when it is released.
//!
//! The reservation is the transaction's first write. A deferred transaction
//! (`BEGIN`, sqlx's `begin()`) that has already *read* holds a snapshot, and
//! SQLite lets it upgrade to a writer only if the snapshot is still the
//! newest; it never waits for that upgrade (waiting while holding a read lock
//! could deadlock), so the busy timeout does not apply. The answers:
//!
//! * `SQLITE_BUSY_SNAPSHOT` (517): another connection committed since the
//!   snapshot was taken. This transaction can never write: refused with
//!   [`Error::StaleSnapshot`], whatever the wait policy.
//! * `SQLITE_BUSY` with a snapshot held, in WAL mode: another connection holds
//!   the write lock now. If it rolls back, a retry can still write; if it
//!   commits, the retry gets `SQLITE_BUSY_SNAPSHOT`. Tried again within the
//!   caller's wait policy, then answered `InProgress`.
//! * `SQLITE_BUSY` with a snapshot held, in rollback-journal mode: the other
//!   writer cannot commit while this transaction holds its shared lock, so
//!   waiting only blocks it: a deadlock, refused with [`Error::StaleSnapshot`].
//!
//! A replay, a refusal (in progress) or a mismatch takes no lock (rule 15):
//! before anything is written in the caller's transaction, the record is read
//! on a connection beside it (one per database file, kept for the next call),
//! which sees what others committed and leaves the caller's transaction as it
//! was: no snapshot, no write lock that would make the record look in
//! progress to every other caller until the transaction ends, or keep a
//! store-mode owner from recording its result. Only an absent or expired
//! record, or an ended lease, goes the write path below. An in-memory
//! database has no such reader: there a transaction that has read answers a
//! complete record from its own snapshot, and otherwise writes.
//!
//! Transactions begun with `BEGIN IMMEDIATE` (`pool.begin_with("BEGIN
//! IMMEDIATE")`) take the write lock up front and never meet any of this.
//!
//! A transaction that holds the write lock before the call (`BEGIN
//! IMMEDIATE`, or a write of its own), or in the rollback journal any lock
//! (a read of its own: no writer can commit past its shared lock), or in a
//! database in memory the store's one connection (any transaction), keeps
//! every owner from renewing its lease: it never takes over (or replaces)
//! an in-progress record whose owner, a store-mode call of this process,
//! is still at work; the call is refused with [`Error::StaleSnapshot`] and
//! writes nothing. Where the owner's write waits while its lease runs out,
//! the check before every transactional reservation refuses it, on every
//! SQL store (`live_owners::may_be_kept_from_writing`); a transaction that
//! holds the write lock also gets `InProgress` while the lease is live
//! (`live_owner_answer`). An owner in another process
//! cannot be asked: there its lease decides, as for a paused owner.
//!
//! A completion or release written here does not wake the duplicates waiting
//! in a [`SqliteStore`](crate::SqliteStore) of this process
//! ([`Store::wait_for_change`]): it is part of the caller's transaction,
//! which may still roll back, and the store does not see the caller's commit.
//! Such waiters see the committed change by their fallback look at the
//! record ([`fallback_poll`](super::sqlite::fallback_poll), at most
//! [`FALLBACK_POLL_MAX`](super::sqlite::FALLBACK_POLL_MAX) late). Waiting
//! duplicates in transactional mode itself retry their reservation under
//! the engine's polling backoff.

use super::*;
use crate::error::Error;
use sqlx::SqliteConnection;
use std::sync::Arc;

use super::sqlite::{
    complete_on, database_id, heartbeat_on, is_busy, live_owner_answer, primary_code, release_on,
    reserve_in, result_code, LiveOwnerAnswer,
};

/// Extended result code: a WAL snapshot is older than the newest commit.
const SQLITE_BUSY_SNAPSHOT: i64 = 517;

fn err(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| super::sqlite::store_error(operation, e)
}

/// What a lock conflict on the reservation's write means for this transaction.
enum Conflict {
    /// Another transaction holds the lock; waiting (and retrying) can help.
    Wait,
    /// This transaction can never take the write lock: it must roll back.
    Never,
}

/// Classifies a busy/locked error from the reservation's first write on `conn`.
async fn classify(conn: &mut SqliteConnection, e: &sqlx::Error) -> Result<Conflict, StoreError> {
    const OP: &str = "reserve";
    if result_code(e) == Some(SQLITE_BUSY_SNAPSHOT) {
        return Ok(Conflict::Never);
    }
    // SQLITE_LOCKED (shared cache) never uses the busy handler either, but a
    // retry after the other connection's transaction ends succeeds.
    if primary_code(e) != Some(5) {
        return Ok(Conflict::Wait);
    }
    // A failed first write leaves the transaction in the state it was in
    // before: READ when it already held a snapshot, NONE when it did not
    // (another connection holds the lock: trying again can help).
    if txn_state(conn).await.map_err(err(OP))? != libsqlite3_sys::SQLITE_TXN_READ {
        return Ok(Conflict::Wait);
    }
    let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut *conn)
        .await
        .map_err(err(OP))?;
    Ok(if journal.eq_ignore_ascii_case("wal") {
        Conflict::Wait
    } else {
        Conflict::Never
    })
}

/// Connections whose busy timeout a reservation changed and did not restore,
/// because the call was dropped while it waited for the lock: the raw handle's
/// address, and the timeout (ms) the connection had before. Restored by the
/// next reservation on the connection, and by pools made by
/// [`SqliteStore::connect`](crate::SqliteStore::connect) when the connection
/// is released (see [`restore_busy_timeout`]).
///
/// A connection closed while still listed may have its address reused by a
/// new one, so each entry also keeps the timeout the reservation set: an entry
/// whose set timeout is not the connection's current one is stale and ignored.
static CHANGED_TIMEOUTS: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<usize, ChangedTimeout>>,
> = std::sync::LazyLock::new(Default::default);

/// A busy timeout a reservation changed: what it was, and what it was set to.
#[derive(Clone, Copy)]
struct ChangedTimeout {
    original: i32,
    set_to: i32,
}

/// Whether `CHANGED_TIMEOUTS` may be non-empty: the pools' release hook reads
/// only this on the common path.
static ANY_CHANGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn changed_timeouts(
) -> std::sync::MutexGuard<'static, std::collections::HashMap<usize, ChangedTimeout>> {
    CHANGED_TIMEOUTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Sets `conn`'s busy timeout to `ms`, remembering what to restore. `current`
/// is the timeout read from the connection; if an earlier, dropped call left
/// it changed, the timeout from before that call is the one kept.
pub(super) async fn set_busy_timeout(
    conn: &mut SqliteConnection,
    current: i32,
    ms: i32,
) -> Result<(usize, i32), sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    let raw = handle.as_raw_handle().as_ptr();
    let key = raw as usize;
    let original = {
        let mut changed = changed_timeouts();
        let entry = changed.entry(key).or_insert(ChangedTimeout {
            original: current,
            set_to: current,
        });
        if entry.set_to != current {
            // Left by a connection that was closed at this address: not ours.
            entry.original = current;
        }
        entry.set_to = ms;
        ANY_CHANGED.store(true, std::sync::atomic::Ordering::SeqCst);
        entry.original
    };
    // SAFETY: the handle is a live connection, locked for our exclusive use
    // while `handle` is held.
    unsafe { libsqlite3_sys::sqlite3_busy_timeout(raw, ms) };
    Ok((key, original))
}

/// Forgets a change `set_busy_timeout` made to a connection that is being
/// closed instead of put back (nothing is left to restore), so the pools'
/// release hook goes back to its one atomic load.
pub(super) fn forget_busy_timeout(key: usize) {
    let mut changed = changed_timeouts();
    changed.remove(&key);
    if changed.is_empty() {
        ANY_CHANGED.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Puts back the busy timeout `set_busy_timeout` changed.
pub(super) async fn put_back_busy_timeout(
    conn: &mut SqliteConnection,
    key: usize,
    original: i32,
) -> Result<(), sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    let raw = handle.as_raw_handle().as_ptr();
    // SAFETY: as in `set_busy_timeout`.
    unsafe { libsqlite3_sys::sqlite3_busy_timeout(raw, original) };
    forget_busy_timeout(key);
    Ok(())
}

/// For a pool's release hook: if a dropped transactional call left this
/// connection's busy timeout changed, restores it. Costs one atomic load when
/// no call was dropped. On error the connection should be closed.
pub(super) async fn restore_busy_timeout(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    if !ANY_CHANGED.load(std::sync::atomic::Ordering::SeqCst) {
        return Ok(());
    }
    let current: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(&mut *conn)
        .await?;
    let mut handle = conn.lock_handle().await?;
    let raw = handle.as_raw_handle().as_ptr();
    let original = {
        let mut changed = changed_timeouts();
        let entry = changed.remove(&(raw as usize));
        if changed.is_empty() {
            ANY_CHANGED.store(false, std::sync::atomic::Ordering::SeqCst);
        }
        // A stale entry (another connection at this address) is dropped unused.
        entry
            .filter(|e| i64::from(e.set_to) == current)
            .map(|e| e.original)
    };
    if let Some(ms) = original {
        tracing::debug!(target: "idempotent", busy_timeout_ms = ms,
            "sqlite: restored the busy timeout a dropped transactional call had changed");
        // SAFETY: as in `set_busy_timeout`.
        unsafe { libsqlite3_sys::sqlite3_busy_timeout(raw, ms) };
    }
    Ok(())
}

/// The transaction's state on the main database: `SQLITE_TXN_NONE`, `_READ`
/// (it holds a snapshot) or `_WRITE`.
async fn txn_state(conn: &mut SqliteConnection) -> Result<i32, sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    // SAFETY: the handle is a live connection, locked for our exclusive use
    // while `handle` is held; sqlite3_txn_state only reads its state.
    Ok(unsafe {
        libsqlite3_sys::sqlite3_txn_state(handle.as_raw_handle().as_ptr(), c"main".as_ptr())
    })
}

/// Readers beside callers' transactions: one connection per database file,
/// opened on first use, reading only. The map's lock is held only to find a
/// file's slot; each slot's lock is held across its one read.
static READERS_BESIDE: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<String, ReaderEntry>>,
> = std::sync::LazyLock::new(Default::default);

/// A file's reader, and when a call last asked for it.
struct ReaderEntry {
    slot: Arc<tokio::sync::Mutex<ReaderState>>,
    last_used: std::time::Instant,
}

/// How many database files keep a reader; past that, the least recently used
/// idle one is closed.
const MAX_READER_FILES: usize = 16;

/// A reader no call has asked for this long is closed (one left on a deleted
/// file would keep its descriptors).
const READER_IDLE: Duration = Duration::from_secs(60);

/// How long a reader waits for a lock (rollback-journal mode only: a writer
/// committing). Past it, the call decides in the caller's transaction.
const READER_BUSY_TIMEOUT: Duration = Duration::from_millis(200);

/// How long a call waits for its turn at a file's reader. A read holds the
/// turn for at most its opening and [`READER_BUSY_TIMEOUT`]; past this, the
/// holder is a call no longer polled, and the call decides without the
/// reader (in the caller's transaction, as with no reader at all).
const READER_TURN_WAIT: Duration = Duration::from_secs(1);

/// Where a file's reader stands.
#[derive(Default)]
enum ReaderState {
    /// Not opened yet (or dropped after an error).
    #[default]
    Closed,
    Open(SqliteConnection),
    /// The caller's connection holds the file in `locking_mode = EXCLUSIVE`,
    /// which keeps every other connection out: no reader until this time.
    LockedOut(std::time::Instant),
}

/// How long a file held in `locking_mode = EXCLUSIVE` goes without a reader
/// before it is tried again.
const LOCKED_OUT_FOR: Duration = Duration::from_secs(60);

/// What the read beside the caller's transaction found.
enum Beside {
    /// A replay, a mismatch, or a live lease (`InProgress`).
    Answer(Reservation),
    /// Nothing a read settles (absent, expired, an ended lease): a write is due.
    WriteDue,
    /// No reader for this database: in memory, moved or deleted under the
    /// caller's connection, locked out, or the read failed (logged).
    NoReader,
}

/// Whether SQLite says the database file `handle` opened has been renamed,
/// moved or deleted since (`SQLITE_FCNTL_HAS_MOVED`); `true` when it cannot
/// tell. The path then names another file, or none.
fn has_moved(handle: *mut libsqlite3_sys::sqlite3) -> bool {
    let mut moved: std::os::raw::c_int = 0;
    // SAFETY: `handle` is a live connection, locked for the caller's exclusive
    // use; the file control only writes the file's state into `moved`.
    let rc = unsafe {
        libsqlite3_sys::sqlite3_file_control(
            handle,
            c"main".as_ptr(),
            libsqlite3_sys::SQLITE_FCNTL_HAS_MOVED,
            (&raw mut moved).cast(),
        )
    };
    rc != libsqlite3_sys::SQLITE_OK || moved != 0
}

/// The file of the connection's main database, when another connection
/// opening that path reads the same database: `None` for an in-memory or
/// temporary one, and for a file moved or deleted since the connection opened
/// it. No round trip.
async fn shared_file(conn: &mut SqliteConnection) -> Result<Option<String>, sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    let raw = handle.as_raw_handle().as_ptr();
    // SAFETY: the handle is a live connection, locked for our exclusive use
    // while `handle` is held; the returned string is owned by SQLite and
    // valid until the database is detached or closed, and copied at once.
    let name = unsafe {
        let ptr = libsqlite3_sys::sqlite3_db_filename(raw, c"main".as_ptr());
        if ptr.is_null() {
            return Ok(None);
        }
        std::ffi::CStr::from_ptr(ptr)
            .to_str()
            .ok()
            .map(str::to_owned)
    };
    Ok(name.filter(|n| !n.is_empty() && !has_moved(raw)))
}

/// The slot of `file`'s reader. Closes the readers idle for [`READER_IDLE`],
/// and when the map is full, the least recently used idle one.
fn reader_slot(file: &str) -> Arc<tokio::sync::Mutex<ReaderState>> {
    let now = std::time::Instant::now();
    let mut readers = READERS_BESIDE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let idle = |e: &ReaderEntry| Arc::strong_count(&e.slot) == 1;
    readers.retain(|_, e| !idle(e) || now.duration_since(e.last_used) < READER_IDLE);
    if !readers.contains_key(file) && readers.len() >= MAX_READER_FILES {
        let oldest = readers
            .iter()
            .filter(|(_, e)| idle(e))
            .min_by_key(|(_, e)| e.last_used)
            .map(|(f, _)| f.clone());
        if let Some(oldest) = oldest {
            readers.remove(&oldest);
        }
    }
    let entry = readers
        .entry(file.to_owned())
        .or_insert_with(|| ReaderEntry {
            slot: Arc::default(),
            last_used: now,
        });
    entry.last_used = now;
    entry.slot.clone()
}

/// Reads the record on a connection beside the caller's (see
/// [`READERS_BESIDE`]): it sees what others committed, and leaves the
/// caller's transaction as it was.
async fn read_beside(conn: &mut SqliteConnection, request: ReserveRequest<'_>) -> Beside {
    let file = match shared_file(conn).await {
        Ok(Some(file)) => file,
        Ok(None) => return Beside::NoReader,
        Err(e) => {
            tracing::debug!(target: "idempotent", error = %e, "sqlite: the database's file is unknown");
            return Beside::NoReader;
        }
    };
    let slot = reader_slot(&file);
    // One read at a time per file; a call that has kept the reader past
    // any read's length is not being polled (parked, leaked): decided
    // without the reader, instead of waiting for as long as that call lives.
    let Ok(mut state) = tokio::time::timeout(READER_TURN_WAIT, slot.lock()).await else {
        tracing::debug!(target: "idempotent", file,
            "sqlite: the reader beside the transaction is kept by a call no longer polled; \
             deciding in the transaction");
        return Beside::NoReader;
    };
    if let ReaderState::LockedOut(until) = *state {
        if std::time::Instant::now() < until {
            return Beside::NoReader;
        }
        *state = ReaderState::Closed;
    }
    // A reader whose file was replaced at the path (deleted and created
    // again) reads another database than the caller's: opened again.
    if let ReaderState::Open(reader) = &mut *state {
        let moved = match reader.lock_handle().await {
            Ok(mut handle) => has_moved(handle.as_raw_handle().as_ptr()),
            Err(_) => true,
        };
        if moved {
            *state = ReaderState::Closed;
        }
    }
    if matches!(*state, ReaderState::Closed) {
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&file)
            .create_if_missing(false)
            .busy_timeout(READER_BUSY_TIMEOUT)
            .pragma("query_only", "ON");
        match sqlx::Connection::connect_with(&options).await {
            Ok(reader) => *state = ReaderState::Open(reader),
            Err(e) => return reader_failed(conn, &mut state, &file, &e).await,
        }
    }
    let ReaderState::Open(reader) = &mut *state else {
        return Beside::NoReader;
    };
    match super::sqlite::answer_from_a_read(reader, request).await {
        Ok(Some(answer)) => Beside::Answer(answer),
        Ok(None) => Beside::WriteDue,
        Err(e) => reader_failed(conn, &mut state, &file, &e).await,
    }
}

/// After the reader of `file` failed to open or read: when the caller's
/// connection holds the file in `locking_mode = EXCLUSIVE`, every reader
/// would wait out its busy timeout and fail, so there is none for
/// [`LOCKED_OUT_FOR`]; otherwise (a writer committing in rollback-journal
/// mode, a broken connection) the next call tries a fresh one.
async fn reader_failed(
    conn: &mut SqliteConnection,
    state: &mut ReaderState,
    file: &str,
    e: &sqlx::Error,
) -> Beside {
    let mode: Result<String, _> = sqlx::query_scalar("PRAGMA locking_mode")
        .fetch_one(&mut *conn)
        .await;
    let exclusive = mode.is_ok_and(|m| m.eq_ignore_ascii_case("exclusive"));
    tracing::debug!(target: "idempotent", file, error = %e, exclusive,
        "sqlite: the read beside the transaction failed; deciding in the transaction");
    *state = if exclusive {
        ReaderState::LockedOut(std::time::Instant::now() + LOCKED_OUT_FOR)
    } else {
        ReaderState::Closed
    };
    Beside::NoReader
}

async fn reserve_on(
    conn: &mut SqliteConnection,
    request: ReserveRequest<'_>,
    lock_wait: Duration,
) -> Result<Reservation, Error> {
    const OP: &str = "reserve";
    // Rule 15: a replay, a refusal or a mismatch takes no lock. The caller's
    // transaction would keep the database's write lock until it ends: every
    // other transactional caller would wait for it and be told the record is
    // in progress, and a store-mode owner could not record its result. A
    // transaction that already holds it (it has written) takes nothing new.
    let state = txn_state(conn).await.map_err(err(OP))?;
    // Rules 10 and 15: a transaction that held the write lock before this
    // call keeps every owner from writing; one of this process still at
    // work is never taken over from it. Asked only while this process
    // lists an owner at all: otherwise the look would cost a statement per
    // call for nothing.
    if state == libsqlite3_sys::SQLITE_TXN_WRITE && super::live_owners::any_listed() {
        match live_owner_answer(conn, request).await.map_err(err(OP))? {
            None => {}
            Some(LiveOwnerAnswer::InProgress(lease_remaining)) => {
                return Ok(Reservation::InProgress { lease_remaining });
            }
            Some(LiveOwnerAnswer::KeptFromWriting) => {
                let id = request.identity;
                tracing::warn!(target: "idempotent", scope = %id.scope, key = %id.key_digest(),
                    "refused: an in-progress record's owner, at work in this process, could not write while the caller's SQLite transaction held the write lock, and its lease ran out; not taken over");
                return Err(Error::StaleSnapshot {
                    scope: id.scope.clone(),
                    store: "sqlite",
                });
            }
        }
    }
    if state != libsqlite3_sys::SQLITE_TXN_WRITE {
        // First, what others committed, read beside the transaction: it
        // leaves the transaction as it was (no snapshot, no lock), and it is
        // current, so a live in-progress record answers too.
        match read_beside(conn, request).await {
            Beside::Answer(answer) => return Ok(answer),
            Beside::WriteDue => {}
            // No reader (an in-memory database): a transaction that holds a
            // snapshot answers a complete record from its own read. A
            // complete record does not change until it expires, so even an
            // older snapshot answers it rightly; an in-progress one may have
            // been released or completed since, so it goes the write path.
            // One without a snapshot writes first: a read would give it a
            // snapshot that another writer could make stale before its write.
            Beside::NoReader => {
                if state == libsqlite3_sys::SQLITE_TXN_READ
                    && let Some(answer) =
                        super::sqlite::settled_answer_from_a_read(&mut *conn, request)
                            .await
                            .map_err(err(OP))?
                {
                    return Ok(answer);
                }
            }
        }
    }
    // The write is tried without waiting in SQLite's busy handler (busy
    // timeout 0), and tried again within `lock_wait`. Waiting inside the
    // statement would end with the caller's transaction holding the
    // database's write lock even when the wait ends in a replay, a mismatch
    // or a live lease (the owner committed meanwhile): that lock would make
    // the record look in progress to every other caller until the
    // transaction ends (rule 15). Between tries, what others committed is
    // read beside the transaction, so such answers take no lock. And a
    // transaction holding a snapshot is answered at once by SQLite (it never
    // waits to upgrade): tried again, it writes once the other writer rolls
    // back, within the caller's wait policy.
    let deadline = tokio::time::Instant::now() + lock_wait;
    let mut round = 0;
    loop {
        let e = match write_without_waiting(conn, request).await? {
            Err(e) if is_busy(&e) => e,
            other => return Ok(other.map_err(err(OP))?),
        };
        if let Conflict::Never = classify(conn, &e).await? {
            let id = request.identity;
            tracing::warn!(target: "idempotent", scope = %id.scope, key = %id.key_digest(), error = %e,
                "refused: the caller's SQLite transaction cannot write (begin it with BEGIN IMMEDIATE)");
            return Err(Error::StaleSnapshot {
                scope: id.scope.clone(),
                store: "sqlite",
            });
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            // The lock's holder may be any writer, for any key (even with
            // `in_progress = reject` the wait is short: `LEAST_LOCK_WAIT`):
            // the time to try again is short, not a lease, as in store mode.
            return Ok(Reservation::InProgress {
                lease_remaining: super::sqlite::BUSY_RETRY_AFTER.min(request.lease),
            });
        }
        tokio::time::sleep(polling_backoff(round).min(deadline - now)).await;
        round = round.saturating_add(1);
        if state != libsqlite3_sys::SQLITE_TXN_WRITE
            && let Beside::Answer(answer) = read_beside(conn, request).await
        {
            return Ok(answer);
        }
    }
}

/// One try of the reservation's write in the caller's transaction, with the
/// connection's busy timeout at 0 for it (a lock held by another connection
/// answers `SQLITE_BUSY` at once) and put back after.
async fn write_without_waiting(
    conn: &mut SqliteConnection,
    request: ReserveRequest<'_>,
) -> Result<Result<Reservation, sqlx::Error>, Error> {
    const OP: &str = "reserve";
    let current: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(&mut *conn)
        .await
        .map_err(err(OP))?;
    let current = i32::try_from(current.clamp(0, i64::from(i32::MAX))).unwrap_or(i32::MAX);
    // Changed through the C API, not a PRAGMA, to learn the connection's
    // identity too: a call dropped before it is put back cannot put it back
    // itself, so the change is remembered until someone does.
    let (key, original) = set_busy_timeout(conn, current, 0).await.map_err(err(OP))?;
    tracing::trace!(target: "idempotent", scope = %request.identity.scope,
        "sqlite: reserving in the caller's transaction");
    let answer = reserve_in(conn, request).await;
    put_back_busy_timeout(conn, key, original)
        .await
        .map_err(err(OP))?;
    Ok(answer)
}

/// [`database_id`] on the caller's connection.
async fn database_id_in_transaction(
    conn: &mut SqliteConnection,
) -> Result<Option<String>, StoreError> {
    database_id(conn)
        .await
        .map_err(err(super::READ_DATABASE_ID))
}

crate::transaction::transactional_connection! {
    /// Transactional mode on a SQLite connection: the reservation and the
    /// recorded result are statements in the connection's current transaction.
    ///
    /// ```no_run
    /// use idempotent_runtime::TransactionalConnection;
    /// fn assert_tx<C: TransactionalConnection + ?Sized>() {}
    /// assert_tx::<sqlx::SqliteConnection>();
    /// assert_tx::<sqlx::Transaction<'static, sqlx::Sqlite>>();
    /// ```
    impl for SqliteConnection {
        store: "sqlite",
        in_transaction: in_transaction,
        reserve: reserve_on,
        complete: complete_on,
        release: release_on,
        heartbeat: heartbeat_on,
        database_id: database_id_in_transaction,
    }
}

/// Whether the connection is in a transaction. SQLite itself knows:
/// `sqlite3_get_autocommit` is zero inside a transaction, whether sqlx began
/// it or a plain `BEGIN` did. No round trip. Never taken from sqlx's count of
/// the transactions it began: a `COMMIT` sent as a query ends the
/// transaction while sqlx still counts it.
pub(super) async fn in_transaction(conn: &mut SqliteConnection) -> Result<bool, StoreError> {
    let mut handle = conn
        .lock_handle()
        .await
        .map_err(err("check for an open transaction"))?;
    // SAFETY: the handle is a live connection, locked for our exclusive use
    // while `handle` is held; sqlite3_get_autocommit only reads its state.
    let autocommit =
        unsafe { libsqlite3_sys::sqlite3_get_autocommit(handle.as_raw_handle().as_ptr()) };
    Ok(autocommit == 0)
}
