//! Rule 20 for a body that runs longer than its scope's `ttl` (its lease kept
//! alive by the heartbeat the whole time) and whose owner then dies. The
//! record is an in-progress record whose lease ran out: a takeover. When the
//! heartbeat renewed only the lease, never the record's retention
//! (`expires_at`, set once at reservation to `created + ttl`), the record
//! was "expired" on both counts once the lease ran out and the store treated
//! it as absent: the retry became a fresh attempt 1 and ran the body blind,
//! without asking the recover hook. The heartbeat now moves the retention
//! with the lease.

use idempotent_runtime::{
    idempotent, Error, Identity, MemoryStore, Recovery, SqliteStore, Store, Takeover,
};
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

#[derive(Default)]
struct Gateway {
    /// Side effects per key.
    charges: HashMap<String, u32>,
    /// Questions the hook was asked, per key (attempt numbers).
    asked: HashMap<String, Vec<u32>>,
}

static GATEWAY: LazyLock<Mutex<Gateway>> = LazyLock::new(Default::default);

fn gateway() -> std::sync::MutexGuard<'static, Gateway> {
    GATEWAY.lock().unwrap_or_else(|p| p.into_inner())
}

async fn look_up(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    let mut g = gateway();
    let key = takeover.key().to_owned();
    g.asked
        .entry(key.clone())
        .or_default()
        .push(takeover.attempt());
    Ok(match g.charges.get(&key) {
        Some(&n) if n > 0 => Recovery::Completed(n),
        _ => Recovery::Run,
    })
}

/// Where the first attempt dies: after its side effect.
#[derive(Default)]
struct Died {
    reached: Notify,
}

/// ttl (1 s) longer than the lease (300 ms), as usual; the first attempt's
/// body outlives the ttl under a live, renewed lease.
#[idempotent(scope = "recovery.long_body", key = key, tenant = shared, store = store,
             skip(die), lease = "300ms", ttl = "1s", in_progress = wait("30s"),
             recover = look_up)]
async fn long_job(store: &dyn Store, key: &str, die: Option<&Died>) -> Result<u32, Error> {
    if let Some(died) = die {
        // Long work: keep going (the heartbeat renews the lease) until the
        // ttl, counted from the reservation, is over (by the store's clock).
        let identity = Identity::shared("recovery.long_body", key).expect("identity");
        loop {
            let record = store.fetch(&identity).await?.expect("the record");
            if record.now_ms > record.created_at_ms + 1500 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        *gateway().charges.entry(key.to_owned()).or_default() += 1;
        died.reached.notify_one();
        std::future::pending::<()>().await;
    }
    let mut g = gateway();
    let n = g.charges.entry(key.to_owned()).or_default();
    *n += 1;
    Ok(*n)
}

/// The first attempt charges after 1 s of work under a live lease and dies
/// (its future is leaked: no completion, no release, no heartbeat). The
/// retry waits the lease out and must take the record over as attempt 2 and
/// ask the hook, which finds the charge (it was charged twice when the store
/// counted the record as absent, lease and ttl both over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_outlived_its_ttl_and_died_is_taken_over_not_rerun_blind() {
    let store = MemoryStore::new();
    died_then_retried(&store, &store, Job::OutlivesItsTtl).await;
}

/// The same on SQLite (the SQL stores decide "expired" the same way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_body_that_outlived_its_ttl_and_died_is_taken_over_not_rerun_blind() {
    on_sqlite(Job::OutlivesItsTtl).await;
}

/// `died_then_retried` on one SQLite file, as two processes would see it:
/// the attempt that dies uses one store, the retry another. A dead process
/// takes its store with it; a leaked future does not, and may have been
/// leaked in the middle of a heartbeat, holding the store's write gate and
/// one of its connections for ever (with one in-memory store for both, that
/// hung the retry: a test artefact, not a takeover failure).
async fn on_sqlite(job: Job) {
    let path = std::env::temp_dir().join(format!(
        "idempotent-long-bodies-{}.db",
        uuid::Uuid::new_v4().simple()
    ));
    let url = format!("sqlite://{}", path.display());
    let dying = SqliteStore::connect(&url).await.expect("sqlite");
    let retrying = SqliteStore::connect(&url).await.expect("sqlite");
    died_then_retried(&dying, &retrying, job).await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// Which of the two jobs a test runs.
#[derive(Clone, Copy)]
enum Job {
    OutlivesItsTtl,
    TtlShorterThanLease,
}

async fn run(job: Job, store: &dyn Store, key: &str, die: Option<&Died>) -> Result<u32, Error> {
    match job {
        Job::OutlivesItsTtl => long_job(store, key, die).await,
        Job::TtlShorterThanLease => short_ttl_job(store, key, die).await,
    }
}

/// The first attempt of `job` charges and dies (its future is leaked: no
/// completion, no release, no heartbeat); the retry must take the record over
/// as attempt 2 and ask the hook, which finds the charge.
async fn died_then_retried(dying: &dyn Store, retrying: &dyn Store, job: Job) {
    let key = format!("job-{}", uuid::Uuid::new_v4().simple());
    let died = Died::default();
    {
        let mut call = Box::pin(run(job, dying, &key, Some(&died)));
        tokio::time::timeout(Duration::from_secs(20), async {
            tokio::select! {
                _ = &mut call => panic!("the call finished instead of dying"),
                _ = died.reached.notified() => {}
            }
        })
        .await
        .expect("the first attempt reached its side effect");
        std::mem::forget(call);
    }
    assert_eq!(gateway().charges.get(&key).copied(), Some(1));

    let retry = tokio::time::timeout(Duration::from_secs(20), run(job, retrying, &key, None))
        .await
        .expect("the retry answered");
    let (charges, asked) = {
        let g = gateway();
        (
            g.charges.get(&key).copied(),
            g.asked.get(&key).cloned().unwrap_or_default(),
        )
    };
    assert_eq!(
        charges,
        Some(1),
        "charged twice: the retry ran the body blind (answer {retry:?}, hook asked for attempts {asked:?})"
    );
    assert_eq!(asked, vec![2], "the hook is asked once, as attempt 2");
    assert_eq!(retry.expect("recovered"), 1);
}

/// A ttl shorter than the lease (each is checked only against its own
/// minimum). The first attempt charges at once and dies.
///
/// The retry must take the record over in the ttl after the lease ran out:
/// later, the record counts as absent (rule 16) and the retry is a fresh
/// call. With a 50 ms ttl, a retry that the loaded machine woke 60 ms after
/// the lease ended ran the body again (a correct answer for a record that
/// expired, and a failed test). The memory test runs on a paused clock, where
/// the retry wakes at the very end of the lease; SQLite decides by its own
/// clock, so the ttl leaves the retry half a second.
#[idempotent(scope = "recovery.short_ttl", key = key, tenant = shared, store = store,
             skip(die), lease = "1s", ttl = "500ms", in_progress = wait("30s"),
             recover = look_up)]
async fn short_ttl_job(store: &dyn Store, key: &str, die: Option<&Died>) -> Result<u32, Error> {
    let _ = store;
    let n = {
        let mut g = gateway();
        let n = g.charges.entry(key.to_owned()).or_default();
        *n += 1;
        *n
    };
    if let Some(died) = die {
        died.reached.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(n)
}

/// The record of an owner that died is kept for its ttl *after its lease ran
/// out*, so the retry that waited the lease out takes it over (attempt 2) and
/// asks the hook. When the retention was counted from the reservation, a ttl
/// shorter than the lease had run out before the lease did: the record counted
/// as absent, the retry was a fresh attempt 1 and charged a second time.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_crashed_owner_with_a_ttl_shorter_than_its_lease_is_taken_over_not_rerun_blind() {
    let store = MemoryStore::new();
    died_then_retried(&store, &store, Job::TtlShorterThanLease).await;
}

/// The same on SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_crashed_owner_with_a_ttl_shorter_than_its_lease_is_taken_over() {
    on_sqlite(Job::TtlShorterThanLease).await;
}
