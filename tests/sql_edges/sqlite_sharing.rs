//! SQLite files and in-memory databases opened the ways users open them:
//! a file URL asking for SQLite's shared cache, a file URL naming a VFS that
//! takes no locks, and one in-memory database named by two stores.

use idempotent_runtime::{
    idempotent, Completion, Error, Fenced, Fingerprint, Identity, OwnerToken, Reservation,
    ReserveRequest, SqliteStore, Store, StoredOutcome,
};
use sqlx::Sqlite;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(300);

/// How long a call that should answer at once is given before the test
/// says it is blocked (a bound on liveness, not a timing assertion).
const BLOCKED_AFTER: Duration = Duration::from_secs(30);

fn identity(tenant: &str, key: &str) -> Identity {
    Identity::new(tenant, "sqlite.sharing", key).expect("valid identity")
}

async fn reserve(store: &SqliteStore, id: &Identity, token: &OwnerToken) -> Reservation {
    let fp = Fingerprint::of("request").expect("fingerprint");
    store
        .reserve(ReserveRequest {
            identity: id,
            fingerprint: Some(&fp),
            token,
            lease: LONG,
            ttl: LONG,
        })
        .await
        .expect("reserve")
}

fn outcome() -> StoredOutcome {
    StoredOutcome {
        is_error: false,
        payload: br#"{"receipt":7}"#.to_vec(),
    }
}

async fn completed(store: &SqliteStore, id: &Identity) {
    let token = OwnerToken::new();
    assert_eq!(reserve(store, id, &token).await, Reservation::FRESH);
    assert_eq!(
        store
            .complete(Completion::by_body(id, &token, &outcome(), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
}

/// A file URL with `cache=shared` (copied from an in-memory example, or
/// meant to "share" the file): with SQLite's shared cache the pool's
/// connections lock whole tables, and a read of the records table waits
/// (sqlx waits for the lock without a bound, past the busy timeout) while
/// another connection's transaction has written it, as transactional mode's
/// does for as long as its body runs. A replay, which on a file answers from
/// a read that never waits for writers, waited for that transaction to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_on_a_file_opened_with_shared_cache_does_not_wait_for_a_writer() {
    // The last: a `file:` URI given as the file name, its `?` percent-encoded
    // (sqlx decodes the name, and SQLite reads its `cache` over the flags):
    // that replay waited.
    for spelling in [
        "sqlite://{}",
        "sqlite://{}?cache=shared",
        "sqlite://{}?mode=rwc&cache=shared",
        "sqlite:file:{}%3Fcache%3Dshared",
    ] {
        let path = crate::common::scratch::sqlite_path("sharing");
        let url = spelling.replace("{}", &path.display().to_string());
        let store = match SqliteStore::connect(&url).await {
            // SQLite's own URI reads its `cache` over the store's private
            // cache: such a file name is refused, and says why.
            Err(e) if url.starts_with("sqlite:file:") => {
                let message = e.to_string();
                assert!(message.contains("cache=shared"), "{url}: {message}");
                continue;
            }
            store => store.expect("open"),
        };
        let done = identity("t1", "done");
        completed(&store, &done).await;
        // Another connection of the pool writes the records table in a
        // transaction left open (a transactional call whose body still runs).
        let mut writer = store.pool().acquire().await.expect("a connection");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *writer)
            .await
            .expect("begin");
        sqlx::query(
            "INSERT INTO idempotency_records (tenant, scope, key, state, expires_at, created_at) \
             VALUES ('t2', 'sqlite.sharing', 'running', 'in_progress', 0, 0)",
        )
        .execute(&mut *writer)
        .await
        .expect("write in the transaction");
        let replay =
            tokio::time::timeout(BLOCKED_AFTER, reserve(&store, &done, &OwnerToken::new())).await;
        sqlx::query("ROLLBACK")
            .execute(&mut *writer)
            .await
            .expect("rollback");
        drop(writer);
        let replay = replay.unwrap_or_else(|_| {
            panic!("{url:?}: the replay waited for another connection's transaction to end")
        });
        assert_eq!(replay, Reservation::Completed(outcome()), "{url:?}");
    }
}

/// One in-memory database named by two stores (a service and its test
/// harness, each opening `file:name?mode=memory&cache=shared`): one record,
/// refused as in progress by the other store while its owner runs, replayed
/// by it once complete; another tenant's key is its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_on_one_named_in_memory_database_share_its_records() {
    let url = format!(
        "sqlite:file:sharing_{}?mode=memory&cache=shared",
        uuid::Uuid::new_v4().simple()
    );
    shared_by_two_stores(&url).await;
}

/// The same, the name a `file:` URI of SQLite's own (its `?` percent-encoded,
/// so sqlx hands it to SQLite whole): its `cache=shared` keeps the database
/// shared, and is not refused as on a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_in_memory_database_in_a_file_uri_is_shared_by_two_stores() {
    let url = format!(
        "sqlite:file:sharing_{}%3Fmode%3Dmemory%26cache%3Dshared",
        uuid::Uuid::new_v4().simple()
    );
    shared_by_two_stores(&url).await;
}

async fn shared_by_two_stores(url: &str) {
    let url = url.to_owned();
    let a = SqliteStore::connect(&url).await.expect("store a");
    let b = SqliteStore::connect(&url).await.expect("store b");
    let id = identity("t1", "shared");
    let owner = OwnerToken::new();
    assert_eq!(reserve(&a, &id, &owner).await, Reservation::FRESH);
    let seen = tokio::time::timeout(BLOCKED_AFTER, reserve(&b, &id, &OwnerToken::new()))
        .await
        .expect("b answered");
    assert!(matches!(seen, Reservation::InProgress { .. }), "{seen:?}");
    assert_eq!(
        a.complete(Completion::by_body(&id, &owner, &outcome(), LONG))
            .await
            .expect("complete"),
        Fenced::Written
    );
    assert_eq!(
        reserve(&b, &id, &OwnerToken::new()).await,
        Reservation::Completed(outcome())
    );
    assert_eq!(
        reserve(&b, &identity("t2", "shared"), &OwnerToken::new()).await,
        Reservation::FRESH,
        "another tenant's key is its own"
    );
}

#[idempotent(scope = "sqlite_sharing.charge", key = key, tenant = tenant, tx = tx, skip(runs),
             in_progress = reject)]
async fn charge(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    sqlx::query("INSERT INTO charges (tenant, idem_key) VALUES (?1, ?2)")
        .bind(tenant)
        .bind(key)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Store(idempotent_runtime::StoreError::new("sqlite", "charge", e)))?;
    Ok(500)
}

/// A file URL naming one of SQLite's VFSes that take no file locks
/// (`vfs=unix-none`, chosen on network file systems to get rid of "database
/// is locked"): nothing keeps two connections (two processes) from writing
/// at once, so two transactions began at once each reserved the one key and
/// ran its body. The store is only correct with locks: such a URL is refused
/// when the store is opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_url_naming_a_vfs_without_locks_is_refused() {
    let path = crate::common::scratch::sqlite_path("sharing-nolock");
    refused_or_runs_one_body(&format!(
        "sqlite://{}?mode=rwc&vfs=unix-none",
        path.display()
    ))
    .await;
}

/// The same VFS named in the other ways sqlx and SQLite read a URL: the
/// value percent-encoded (sqlx decodes the query), `vfs` given twice (sqlx
/// keeps the last), or in a `file:` URI given as the file name, its `?`
/// percent-encoded (sqlx decodes the name and SQLite reads it as a URI).
/// Each opened the file without locks: read from the URL's text, the
/// refusal saw `unix%2Dnone`, the first `vfs`, or no query at all. SQLite's
/// URI in the file name may also ask for no locks on the default VFS
/// (`nolock=1`), which sqlx's query does not take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vfs_without_locks_is_refused_however_the_url_spells_it() {
    for (n, spelling) in [
        "sqlite://{}?mode=rwc&vfs=unix%2Dnone",
        "sqlite://{}?mode=rwc&%76fs=unix-none",
        "sqlite://{}?mode=rwc&vfs=unix&vfs=unix-none",
        "sqlite:file:{}%3Fvfs%3Dunix-none",
        "sqlite:file:{}%3Fnolock%3D1",
    ]
    .into_iter()
    .enumerate()
    {
        let path = crate::common::scratch::sqlite_path(&format!("sharing-nolock-{n}"));
        refused_or_runs_one_body(&spelling.replace("{}", &path.display().to_string())).await;
    }
}

/// Opens a store on `url` (a VFS without locks): refused with an error that
/// says why, or else two transactions begun at once must not both run the
/// body of one key.
async fn refused_or_runs_one_body(url: &str) {
    let store = match SqliteStore::connect(url).await {
        Err(e) => {
            let message = e.to_string();
            let named = ["unix-none", "nolock"].iter().any(|n| message.contains(n));
            assert!(
                named && message.contains("lock"),
                "{url}: the error names the VFS (or `nolock`) and says why: {message}"
            );
            return;
        }
        Ok(store) => store,
    };
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE charges (tenant TEXT NOT NULL, idem_key TEXT NOT NULL)")
        .execute(&pool)
        .await
        .expect("ddl");
    let runs = AtomicUsize::new(0);
    // Two callers begin their transactions as the store's documentation
    // says (`BEGIN IMMEDIATE`: the write lock first). With locks, the second
    // waits for the first to end.
    let mut first = pool.begin_with("BEGIN IMMEDIATE").await.expect("first");
    let second = tokio::time::timeout(BLOCKED_AFTER, pool.begin_with("BEGIN IMMEDIATE")).await;
    let mut second = second
        .unwrap_or_else(|_| panic!("{url}: the second transaction began beside the first: no lock"))
        .expect("second");
    let a = charge(&mut first, "t1", "k", &runs).await;
    let b = charge(&mut second, "t1", "k", &runs).await;
    drop((first, second));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "{url}: one key, two bodies: {a:?} and {b:?}"
    );
}

/// A file opened read-only (`mode=ro`: a replica, a reporting process),
/// after a service migrated it and recorded an answer: the store opens, the
/// recorded answer is replayed, and a fresh key is refused with a store
/// error (nothing may run whose record cannot be written), never answered
/// as reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_url_replays_and_refuses_to_reserve() {
    let path = crate::common::scratch::sqlite_path("sharing-ro");
    let writer = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("open read-write");
    let done = identity("t1", "done");
    completed(&writer, &done).await;
    let reader = SqliteStore::connect(&format!("sqlite://{}?mode=ro", path.display()))
        .await
        .expect("open read-only");
    assert_eq!(
        reserve(&reader, &done, &OwnerToken::new()).await,
        Reservation::Completed(outcome())
    );
    let fp = Fingerprint::of("request").expect("fingerprint");
    let fresh = identity("t1", "fresh");
    let answer = reader
        .reserve(ReserveRequest {
            identity: &fresh,
            fingerprint: Some(&fp),
            token: &OwnerToken::new(),
            lease: LONG,
            ttl: LONG,
        })
        .await;
    assert!(
        answer.is_err(),
        "a fresh key on a read-only file: {answer:?}"
    );
}

/// `synchronous = NORMAL` is only safe from corruption in WAL mode: on a
/// file that cannot be switched to WAL (here through `unix-dotfile`, a VFS
/// that locks with a dot-file and has no shared memory), every connection
/// runs FULL instead, also those the pool opens later, and the store works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_on_a_file_that_cannot_be_wal_runs_full_on_every_connection() {
    let path = crate::common::scratch::sqlite_path("sharing-dotfile");
    let store = SqliteStore::builder(&format!(
        "sqlite://{}?mode=rwc&vfs=unix-dotfile",
        path.display()
    ))
    .synchronous(idempotent_runtime::store::sqlite::Synchronous::Normal)
    .connect()
    .await
    .expect("open");
    let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(store.pool())
        .await
        .expect("journal mode");
    assert_ne!(journal, "wal");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(store.pool().acquire().await.expect("a connection"));
    }
    for conn in &mut held {
        let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut **conn)
            .await
            .expect("level");
        assert_eq!(level, 2, "FULL on every connection");
    }
    drop(held);
    completed(&store, &identity("t1", "dotfile")).await;
}
