//! Retention that really runs: delete expired records in bounded batches,
//! once ([`purge_all`]) or in the background ([`Purger`]).
//!
//! A record is purgeable when its retention (`ttl`) has run out; an
//! in-progress record only when both its lease and its retention have run
//! out (DESIGN rule 16). Stores decide that on their own clock, so a purge
//! never deletes a live record. On PostgreSQL and MySQL a record held by an
//! open transaction is skipped (`SKIP LOCKED`), never waited for. SQLite has
//! one write lock for the whole database: while a caller's transaction that
//! has written holds it, the purge waits for it like every other write (the
//! store's busy timeout), and fails then; the [`Purger`] tries again at its
//! next run.
//!
//! ```
//! use idempotent_runtime::{purge::{Purger, PurgerConfig}, MemoryStore};
//! use std::time::Duration;
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = MemoryStore::new();
//! let purger = Purger::spawn(store.clone(), PurgerConfig {
//!     interval: Duration::from_secs(60),
//!     batch: 1000,
//! });
//! // ... serve requests ...
//! let stats = purger.shutdown().await; // finishes the batch in flight, then stops
//! assert!(stats.last_error.is_none());
//! # }
//! ```

use crate::error::StoreError;
use crate::store::Store;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The most batches one [`purge_all`] (or one purger run) deletes before it
/// returns; the rest waits for the next run. Keeps a run bounded even when
/// records expire faster than they are deleted.
pub const MAX_BATCHES_PER_RUN: u32 = 10_000;

/// The batch size used when none is given.
pub const DEFAULT_BATCH: u32 = 1_000;

/// Told of records deleted for good.
type Tell = Arc<dyn Fn(u64) + Send + Sync>;

tokio::task_local! {
    /// The purge batch in flight in this task: told what each of its
    /// statements deleted as it commits ([`deleted_for_good`]). A SQL store
    /// deletes a batch in statements of at most 500 records, each committed
    /// on its own, so a batch that fails part way, or a run cut off by a
    /// shutdown, has deleted records its answer never reports.
    static BATCH_IN_FLIGHT: Tell;
}

/// Tells the purge batch in flight in this task, if any, that `n` records
/// were deleted for good (a committed statement).
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn deleted_for_good(n: u64) {
    let _ = BATCH_IN_FLIGHT.try_with(|tell| tell(n));
}

/// Deletes expired records in batches of `batch` until a batch comes back
/// short (nothing more to delete), or [`MAX_BATCHES_PER_RUN`] batches have
/// run. Returns how many records were deleted. A `batch` of 0 counts as 1.
///
/// ```
/// use idempotent_runtime::{purge::purge_all, MemoryStore};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::StoreError> {
/// let deleted = purge_all(&MemoryStore::new(), 500).await?;
/// assert_eq!(deleted, 0);
/// # Ok(()) }
/// ```
pub async fn purge_all(store: &dyn Store, batch: u32) -> Result<u64, StoreError> {
    run_of(store, batch, None, MAX_BATCHES_PER_RUN, Arc::new(|_| {}))
        .await
        .map(|(deleted, _)| deleted)
}

/// Deletes every expired record now (the operator's `idempotent purge`):
/// runs of [`purge_all`] until one ends before its [`MAX_BATCHES_PER_RUN`]
/// batches, at most `max_runs` of them. Answers how many were deleted, and
/// whether it got to the end (`false`: records kept expiring as fast as
/// batches of `batch` were deleted, and some may be left); a failure comes
/// with how many were deleted before it.
#[cfg(feature = "cli")]
pub(crate) async fn purge_runs(
    store: &dyn Store,
    batch: u32,
    max_runs: u32,
) -> Result<(u64, bool), (u64, StoreError)> {
    runs_of(store, batch, max_runs, MAX_BATCHES_PER_RUN).await
}

#[cfg(any(feature = "cli", test))]
async fn runs_of(
    store: &dyn Store,
    batch: u32,
    max_runs: u32,
    batches_per_run: u32,
) -> Result<(u64, bool), (u64, StoreError)> {
    let total = Arc::new(AtomicU64::new(0));
    let count: Tell = {
        let total = Arc::clone(&total);
        Arc::new(move |n| {
            total.fetch_add(n, Ordering::Relaxed);
        })
    };
    // A run whose every batch came back full deleted exactly this many; one
    // that deleted fewer got to the end (also when its last batch was short).
    let full_run = u64::from(batches_per_run) * u64::from(batch.max(1));
    for _ in 0..max_runs.max(1) {
        match run_of(store, batch, None, batches_per_run, Arc::clone(&count)).await {
            Ok((deleted, _)) if deleted < full_run => {
                return Ok((total.load(Ordering::Relaxed), true))
            }
            Ok(_) => {}
            Err(e) => return Err((total.load(Ordering::Relaxed), e)),
        }
    }
    Ok((total.load(Ordering::Relaxed), false))
}

/// The batch loop shared by [`purge_all`], the purger and [`purge_runs`]: at
/// most `max_batches` batches. Between batches (never during one) it checks
/// `stop`. What is deleted is counted (`deleted_now` and the `purged`
/// metric) as it is deleted for good: statement by statement where the store
/// tells ([`deleted_for_good`]), so a batch that fails part way, or a run
/// cut off, counts what it deleted; otherwise when the batch answers.
/// Returns (deleted, batches run).
async fn run_of(
    store: &dyn Store,
    batch: u32,
    stop: Option<&watch::Receiver<bool>>,
    max_batches: u32,
    deleted_now: Tell,
) -> Result<(u64, u32), StoreError> {
    let batch = batch.max(1);
    let name = store.name();
    let count = move |n: u64| {
        deleted_now(n);
        crate::metrics::purged(name, n);
    };
    let mut total = 0u64;
    for batches in 1..=max_batches {
        let told = Arc::new(AtomicU64::new(0));
        let tell: Tell = {
            let (told, count) = (Arc::clone(&told), count.clone());
            Arc::new(move |n| {
                told.fetch_add(n, Ordering::Relaxed);
                count(n);
            })
        };
        let deleted = BATCH_IN_FLIGHT
            .scope(tell, store.purge_expired(batch))
            .await?;
        // A store that does not tell as it goes (the memory store, a store
        // of your own) is counted by its answer.
        count(deleted.saturating_sub(told.load(Ordering::Relaxed)));
        total += deleted;
        if deleted < u64::from(batch) || stop.is_some_and(|s| *s.borrow()) {
            return Ok((total, batches));
        }
    }
    tracing::warn!(
        store = store.name(),
        deleted = total,
        "purge stopped after {max_batches} batches of {batch}; the rest waits for the next run (raise the batch size if this repeats)"
    );
    Ok((total, max_batches))
}

/// How long [`PurgerHandle::shutdown`] lets the batch in flight run on.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How often the background purger runs and how much it deletes per batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgerConfig {
    /// Time between runs (the first run starts at once). At least 1 ms.
    pub interval: Duration,
    /// Records deleted per batch (a SQL store deletes a batch in statements
    /// of at most 500 records, each its own transaction). At least 1.
    pub batch: u32,
}

impl Default for PurgerConfig {
    /// Every minute, batches of [`DEFAULT_BATCH`].
    fn default() -> Self {
        PurgerConfig {
            interval: Duration::from_secs(60),
            batch: DEFAULT_BATCH,
        }
    }
}

/// What a purger has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgerStats {
    /// Runs finished (successfully or not), and a run cut off by
    /// [`PurgerHandle::shutdown_within`].
    pub runs: u64,
    /// Records deleted over all runs (a run that failed or was cut off
    /// counts what it deleted for good: on the SQL stores, each committed
    /// statement of at most 500 records; on others, each finished batch).
    pub deleted: u64,
    /// Runs that failed with a store error, or were cut off by a shutdown
    /// (then [`last_error`](Self::last_error) says so).
    pub failed_runs: u64,
    /// The last store error, if the latest failing run is more recent than the latest successful one.
    pub last_error: Option<String>,
}

/// The background purger. See [`Purger::spawn`].
#[derive(Debug)]
pub struct Purger;

impl Purger {
    /// Starts a task on the current Tokio runtime that runs [`purge_all`]
    /// every `config.interval` (first run at once) and logs what it deleted.
    /// Store errors are logged, counted in [`PurgerStats`], and retried at the
    /// next interval; they never stop the purger.
    ///
    /// `store` is anything that is a [`Store`]: a store value, an `Arc<S>`,
    /// an `Arc<dyn Store>`.
    ///
    /// The task lives exactly as long as the returned handle:
    /// [`PurgerHandle::shutdown`] stops it cleanly (the batch in flight
    /// finishes), and dropping the handle stops it too (the batch in flight
    /// is abandoned, which is harmless: a purge is a single idempotent delete).
    ///
    /// # Panics
    /// Like `tokio::spawn`, when called outside a Tokio runtime.
    ///
    /// ```
    /// use idempotent_runtime::{purge::{Purger, PurgerConfig}, MemoryStore, Store};
    /// use std::sync::Arc;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    /// let purger = Purger::spawn(store, PurgerConfig::default());
    /// println!("{:?}", purger.stats());
    /// purger.shutdown().await;
    /// # }
    /// ```
    pub fn spawn<S: Store + 'static>(store: S, config: PurgerConfig) -> PurgerHandle {
        let (stop_tx, stop_rx) = watch::channel(false);
        let stats = Arc::new(Mutex::new(PurgerStats::default()));
        let in_run = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task = tokio::spawn(purge_loop(
            store,
            config,
            stop_rx,
            Arc::clone(&stats),
            Arc::clone(&in_run),
        ));
        PurgerHandle {
            stop: stop_tx,
            task: Some(task),
            stats,
            in_run,
        }
    }
}

async fn purge_loop<S: Store>(
    store: S,
    config: PurgerConfig,
    mut stop: watch::Receiver<bool>,
    stats: Arc<Mutex<PurgerStats>>,
    in_run: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut ticker = tokio::time::interval(config.interval.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let name = store.name();
    tracing::debug!(
        store = name,
        interval = ?config.interval,
        batch = config.batch,
        "idempotency purger started"
    );
    loop {
        tokio::select! {
            biased;
            // A closed channel (handle gone) also means stop.
            _ = stop.changed() => break,
            _ = ticker.tick() => {}
        }
        if *stop.borrow() {
            break;
        }
        let count_deleted: Tell = {
            let stats = Arc::clone(&stats);
            Arc::new(move |deleted| {
                let mut s = stats.lock().unwrap_or_else(|p| p.into_inner());
                s.deleted = s.deleted.saturating_add(deleted);
            })
        };
        in_run.store(true, Ordering::SeqCst);
        let result = run_of(
            &store,
            config.batch,
            Some(&stop),
            MAX_BATCHES_PER_RUN,
            count_deleted,
        )
        .await;
        let mut s = stats.lock().unwrap_or_else(|p| p.into_inner());
        in_run.store(false, Ordering::SeqCst);
        s.runs += 1;
        match result {
            Ok((deleted, batches)) => {
                s.last_error = None;
                if deleted > 0 {
                    tracing::info!(
                        store = name,
                        deleted,
                        batches,
                        "purged expired idempotency records"
                    );
                } else {
                    tracing::trace!(store = name, "no expired idempotency records to purge");
                }
            }
            Err(e) => {
                s.failed_runs += 1;
                tracing::warn!(store = name, error = %e, "idempotency purge failed; retrying at the next interval");
                s.last_error = Some(e.to_string());
            }
        }
    }
    tracing::debug!(store = name, "idempotency purger stopped");
}

/// Controls a running purger. Dropping it stops the purger.
#[derive(Debug)]
#[must_use = "dropping the handle stops the purger at once"]
pub struct PurgerHandle {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
    stats: Arc<Mutex<PurgerStats>>,
    /// A run is under way (not waiting for its next interval).
    in_run: Arc<std::sync::atomic::AtomicBool>,
}

impl PurgerHandle {
    /// What the purger has done so far.
    pub fn stats(&self) -> PurgerStats {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Stops the purger: the batch in flight finishes, no further batch
    /// starts. A batch still running after [`SHUTDOWN_GRACE`] (a very large
    /// batch over a large backlog, a stalled database) is stopped where it
    /// is: what its committed statements deleted stays deleted (and is
    /// counted); the statement cut off may still complete on the server, and
    /// what it deletes is not counted (it only ever deletes expired records).
    /// Returns the final statistics once the task has ended.
    pub async fn shutdown(self) -> PurgerStats {
        self.shutdown_within(SHUTDOWN_GRACE).await
    }

    /// [`shutdown`](Self::shutdown), letting the batch in flight run at most
    /// `grace` (of real time) more.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use idempotent_runtime::purge::{Purger, PurgerConfig};
    /// use std::time::Duration;
    /// let purger = Purger::spawn(idempotent_runtime::MemoryStore::new(), PurgerConfig {
    ///     interval: Duration::from_secs(60),
    ///     batch: 1000,
    /// });
    /// let stats = purger.shutdown_within(Duration::from_secs(2)).await;
    /// assert_eq!(stats.failed_runs, 0);
    /// # }
    /// ```
    pub async fn shutdown_within(mut self, grace: Duration) -> PurgerStats {
        let _ = self.stop.send(true);
        if let Some(mut task) = self.task.take() {
            let ended = match crate::store::within_real_time(grace, &mut task).await {
                Ok(ended) => ended,
                Err(_) => {
                    tracing::warn!(
                        "idempotency purger: the batch in flight was still running {grace:?} after \
                         shutdown was asked; stopped where it was"
                    );
                    task.abort();
                    let ended = task.await;
                    if ended
                        .as_ref()
                        .is_err_and(tokio::task::JoinError::is_cancelled)
                        && self.in_run.load(Ordering::SeqCst)
                    {
                        // The run cut off counts as a failed one (what its
                        // finished batches deleted is already in `deleted`).
                        let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner());
                        s.runs += 1;
                        s.failed_runs += 1;
                        s.last_error = Some(format!(
                            "stopped by shutdown: the batch in flight was still running {grace:?} \
                             after shutdown was asked"
                        ));
                    }
                    ended
                }
            };
            if let Err(e) = ended
                && e.is_panic()
            {
                tracing::error!("idempotency purger task panicked: {e}");
            }
        }
        self.stats()
    }

    /// Whether the purger task has ended (it only ends when told to, or if it panicked).
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for PurgerHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Identity;
    use crate::store::{
        Answer, AnsweredBy, OwnerToken, Reservation, ReserveRequest, StoredOutcome,
    };
    use crate::MemoryStore;

    /// `n` complete records with a 1 ms ttl, expired once this returns.
    async fn expired_records(store: &MemoryStore, n: usize) {
        for i in 0..n {
            let identity = Identity::new("t", "purge.test", format!("k{i}")).expect("identity");
            let token = OwnerToken::new();
            let reserved = store
                .reserve(ReserveRequest {
                    identity: &identity,
                    fingerprint: None,
                    token: &token,
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_millis(1),
                })
                .await
                .expect("reserve");
            assert!(matches!(reserved, Reservation::Acquired { .. }));
            let answer = Answer {
                outcome: StoredOutcome {
                    is_error: false,
                    payload: b"1".to_vec(),
                },
                ttl: Duration::from_millis(1),
                by: AnsweredBy::Body,
            };
            let completed = store
                .complete(answer.completing(&identity, &token))
                .await
                .expect("complete");
            assert!(completed.is_written());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    /// The operator's purge deletes every expired record, however many runs
    /// that takes (one run stops at its bound, here 3 batches of 2), and
    /// says so when it stops at its own bound of runs with records left.
    #[tokio::test]
    async fn purge_runs_go_on_past_one_runs_bound_and_say_when_they_stop() {
        let store = MemoryStore::new();
        expired_records(&store, 25).await;
        let (one_run, batches) = run_of(&store, 2, None, 3, Arc::new(|_| {}))
            .await
            .expect("one run");
        assert_eq!((one_run, batches), (6, 3), "a run stops at its bound");
        assert_eq!(
            runs_of(&store, 2, 2, 3).await.expect("purge"),
            (12, false),
            "two runs, both full: stopped with records left"
        );
        assert_eq!(runs_of(&store, 2, 10, 3).await.expect("purge"), (7, true));
        assert!(store.is_empty(), "nothing expired is left");
        // The last run allowed ends with a short batch: it got to the end.
        expired_records(&store, 5).await;
        assert_eq!(runs_of(&store, 2, 1, 3).await.expect("purge"), (5, true));
        assert_eq!(runs_of(&store, 2, 10, 3).await.expect("purge"), (0, true));
    }

    /// A store that purges as the SQL stores do (statements of at most
    /// `PURGE_CHUNK` records, each committed on its own), whose first
    /// statement deletes a whole chunk and whose second fails or stalls.
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    struct SecondStatementFails {
        statements: std::sync::atomic::AtomicU32,
        stalls: bool,
    }

    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[async_trait::async_trait]
    impl Store for SecondStatementFails {
        fn name(&self) -> &'static str {
            "chunked"
        }
        async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
            crate::store::purge_in_chunks("chunked", batch, |n| async move {
                if self.statements.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Ok(u64::from(n));
                }
                if self.stalls {
                    std::future::pending::<()>().await;
                }
                Err(StoreError::new("chunked", "purge", "connection reset"))
            })
            .await
        }
        async fn reserve(&self, _: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
            unreachable!("the purge only")
        }
        async fn complete(
            &self,
            _: crate::store::Completion<'_>,
        ) -> Result<crate::store::Fenced, StoreError> {
            unreachable!("the purge only")
        }
        async fn release(
            &self,
            _: &Identity,
            _: &OwnerToken,
        ) -> Result<crate::store::Fenced, StoreError> {
            unreachable!("the purge only")
        }
        async fn heartbeat(
            &self,
            _: &Identity,
            _: &OwnerToken,
            _: Duration,
        ) -> Result<crate::store::Fenced, StoreError> {
            unreachable!("the purge only")
        }
        fn release_detached(&self, _: Identity, _: OwnerToken) {
            unreachable!("the purge only")
        }
        fn complete_detached(&self, _: crate::store::Completion<'_>) {
            unreachable!("the purge only")
        }
        async fn force_release(
            &self,
            _: &Identity,
            _: bool,
        ) -> Result<crate::store::ForcedRelease, StoreError> {
            unreachable!("the purge only")
        }
        async fn fetch(
            &self,
            _: &Identity,
        ) -> Result<Option<crate::store::RecordSnapshot>, StoreError> {
            unreachable!("the purge only")
        }
        async fn scope_stats(&self) -> Result<Vec<crate::store::ScopeStats>, StoreError> {
            unreachable!("the purge only")
        }
    }

    /// What a batch's committed statements deleted is counted although the
    /// batch then fails (the purger's statistics, the `purged` metric, the
    /// operator's purge) or is cut off by a shutdown.
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[tokio::test]
    async fn a_batch_that_fails_part_way_counts_what_its_statements_deleted() {
        let chunk = u64::from(crate::store::PURGE_CHUNK);
        let store = || SecondStatementFails {
            statements: Default::default(),
            stalls: false,
        };
        let before = crate::metrics::snapshot().purged;
        let (deleted, e) = runs_of(&store(), u32::MAX, 3, 3)
            .await
            .expect_err("the second statement fails");
        assert_eq!(deleted, chunk, "{e}");
        assert!(crate::metrics::snapshot().purged >= before + chunk);

        let spawn = |stalls: bool| {
            Purger::spawn(
                SecondStatementFails {
                    statements: Default::default(),
                    stalls,
                },
                PurgerConfig {
                    interval: Duration::from_secs(3600),
                    batch: u32::MAX,
                },
            )
        };
        // Bounded: the first run starts at once.
        async fn until(purger: &PurgerHandle, done: impl Fn(&PurgerStats) -> bool) {
            for _ in 0..10_000 {
                if done(&purger.stats()) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let purger = spawn(false);
        until(&purger, |s| s.runs != 0).await;
        let stats = purger.shutdown().await;
        assert_eq!(
            (stats.runs, stats.failed_runs, stats.deleted),
            (1, 1, chunk)
        );

        let purger = spawn(true);
        until(&purger, |s| s.deleted != 0).await;
        let stats = purger.shutdown_within(Duration::from_millis(50)).await;
        assert_eq!(
            (stats.runs, stats.failed_runs, stats.deleted),
            (1, 1, chunk)
        );
    }

    /// A batch of 0 counts as 1: every expired record is still deleted.
    #[tokio::test]
    async fn a_batch_of_zero_counts_as_one() {
        let store = MemoryStore::new();
        expired_records(&store, 3).await;
        assert_eq!(purge_all(&store, 0).await.expect("purge"), 3);
        assert!(store.is_empty());
    }
}
