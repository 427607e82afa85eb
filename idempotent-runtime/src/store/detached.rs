//! The records of dropped calls, finished by something the store owns
//! (DESIGN.md rule 14).
//!
//! A call dropped mid-way (its future cancelled: a client gone, a timeout, a
//! runtime shutting down) cannot await its own release, or the recording of a
//! result its body already produced. Spawning that work on the caller's
//! runtime loses it when the runtime is shutting down, which is exactly when
//! many calls are dropped. So each SQL store owns a [`Detached`] worker: one
//! background thread with a runtime of its own, started on first use and
//! stopped (after finishing what it was handed) when the last handle to the
//! store is dropped. It opens its own connections (a connection belongs to the
//! runtime that opened it) and carries the work out:
//!
//! * **release** — the call was dropped while it held the record, or while its
//!   reservation statement was in flight (or failed: a connection cut after the
//!   server committed). The statement may land after the first attempt has
//!   found nothing, so a release that finds nothing (fenced by the owner token,
//!   it can never free someone else's record) is tried again over
//!   [`RETRY_AFTER`], and for as long as a statement of the store may wait
//!   for locks before it lands ([`Detached::statements_land_within`]).
//!   SQLite's reservation, which runs to its end in a task of its own, is
//!   waited for instead: the store's write for the worker waits until it
//!   has ended, however long it waited for the write turn, a connection and
//!   the lock, before the first attempt. Where that task ends with the call
//!   (a current-thread runtime, or one shut down) while its statement is at
//!   SQLite, the statement still lands within the busy timeout, and the
//!   write is tried again until then.
//! * **end lease** — a call in a scope with a `recover` hook was dropped: its
//!   record is kept for the next call to take over, its lease ended. A
//!   database server's worker ends it again a few times over [`RETRY_AFTER`],
//!   for a renewal the dropped call had sent that lands late.
//! * **complete** — the call was dropped while recording its result, or the
//!   recording failed (a connection cut): the body has run, so freeing the key
//!   would let a retry run it again. The result is recorded instead (fenced by
//!   the token), and retries replay it.
//!
//! A completion that keeps failing (a failover, an outage) is tried on after
//! that, every few seconds, for as long as the record's ttl (at most
//! [`COMPLETE_TRIED_FOR`]), until it lands or finds the record taken over.
//!
//! An attempt a database server leaves unanswered for
//! [`ATTEMPT_ANSWERS_WITHIN`] (a connection gone silent) is given up, its
//! connection closed, and tried again on a new one.
//!
//! Work that cannot be done is logged and counted (`release_failures`); the
//! lease bounds the damage.

use crate::error::StoreError;
use crate::identity::Identity;
use crate::store::{Fenced, OwnerToken};
use futures_util::future::BoxFuture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

/// The time from the start of one attempt to the start of the next, when a
/// release found nothing to release (the reservation may still be in flight)
/// or when an attempt failed: about 9 s in all. An attempt that took longer
/// (it waited for a lock) is followed by the next at once.
pub(crate) const RETRY_AFTER: [Duration; 4] = [
    Duration::from_millis(100),
    Duration::from_millis(400),
    Duration::from_millis(1_600),
    Duration::from_millis(6_400),
];

/// The pause between a dropped call's release attempts once [`RETRY_AFTER`]
/// is used up, while its statement may still land: the record it finds is
/// in progress, refusing retries, until the next attempt.
pub(crate) const SEARCH_PAUSE: Duration = Duration::from_secs(1);

/// The longest a dropped call's release looks for its record (a store with
/// a lock wait of minutes): a statement that lands later stays in progress
/// until its lease runs out.
pub(crate) const LONGEST_SEARCH: Duration = Duration::from_secs(600);

/// How long a completion that keeps failing is tried for (after
/// [`RETRY_AFTER`], every last pause), at most: the record stays in progress
/// under the call's token until someone takes it over (then the fenced write
/// finds nothing and the worker stops), so recording the result late is still
/// right, and giving up would let a retry run the body again after the lease.
/// Bounded by the record's ttl too.
pub(crate) const COMPLETE_TRIED_FOR: Duration = Duration::from_secs(3600);

/// How long one attempt of a database server's worker may go unanswered
/// before it is given up as failed, its connection closed, and tried again on
/// a new one ([`transfer_allowance`] more for a large answer; PostgreSQL
/// and MySQL/MariaDB end the worker's lock waits at 10 s, under this). A
/// connection that went silent (a frozen server that still
/// acknowledges packets, a network black hole) otherwise held the attempt,
/// and with it the worker's retries, for as long as TCP kept the connection:
/// minutes to for ever, unlogged, with the record's lease running out and
/// two such attempts filling the worker's pool (unrecorded-answers hunt). A
/// statement given up may still land later; every write is fenced by its
/// owner token, so a late one changes nothing the next attempt did not.
/// The default; a store may be given another (`with_silent_connection_timeout`),
/// and its worker keeps at least this one.
#[cfg(any(feature = "postgres", feature = "mysql", test))]
pub(crate) const ATTEMPT_ANSWERS_WITHIN: Duration = Duration::from_secs(20);

/// The shortest bound on a worker's attempt ([`Detached::set_attempt_limit`]):
/// the wait for a connection of the worker's pool, inside the attempt (up to
/// its `acquire_timeout`, [`ACQUIRE_TIMEOUT`](crate::store::ACQUIRE_TIMEOUT):
/// both connections held by other jobs' lock waits), then the worker's 10 s
/// row-lock wait, which the server ends itself, and 2 s for its answer to
/// arrive: 17 s.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const SHORTEST_ATTEMPT_LIMIT: Duration =
    crate::store::ACQUIRE_TIMEOUT.saturating_add(Duration::from_secs(12));

/// [`Detached::attempt_limit_ms`] when attempts have no bound (no store set
/// one).
const NO_ATTEMPT_LIMIT: u64 = 0;

/// What the worker does for one dropped call.
#[derive(Debug, Clone)]
pub(crate) enum Work {
    /// Delete the in-progress record `token` owns.
    Release,
    /// End the lease of the in-progress record `token` owns (kept, for the
    /// next call to take over).
    EndLease,
    /// Record this answer.
    Complete(crate::store::Answer),
}

/// Carries out one piece of [`Work`] on the worker's own connections:
/// `Ok(Fenced::Written)` when it was done, `Ok(Fenced::NotOwner)` when `token` owns nothing (never
/// reserved, already released or completed, or taken over).
pub(crate) type WriteFn = Arc<
    dyn Fn(Identity, OwnerToken, Work) -> BoxFuture<'static, Result<Fenced, StoreError>>
        + Send
        + Sync,
>;

/// Opens what the worker needs on its own runtime (e.g. a small pool) and
/// returns the write to run. Called once, on the worker's thread.
pub(crate) type OpenFn = Box<dyn FnOnce() -> WriteFn + Send>;

/// A store's background worker for dropped calls. Cheap to create: the thread
/// starts with the first job handed to it.
pub(crate) struct Detached {
    store: &'static str,
    state: Mutex<State>,
    unfinished: Arc<Unfinished>,
    /// How long, in ms, a statement of the store may still land after its
    /// call was dropped (its lock waits): a release or an end of lease
    /// that finds nothing is tried again for at least this long.
    lands_within_ms: std::sync::atomic::AtomicU64,
    /// How long, in ms, an attempt may go unanswered before it is given up
    /// and tried again ([`ATTEMPT_ANSWERS_WITHIN`] unless the store was
    /// given a longer one, for a database server's worker); [`NO_ATTEMPT_LIMIT`]:
    /// no bound (SQLite, whose busy timeout bounds every write and whose
    /// connections cannot go silent).
    attempt_limit_ms: std::sync::atomic::AtomicU64,
}

/// How many handed-over jobs are not finished yet, and a wake-up for
/// [`Detached::finish_within`] whenever one finishes. Neither needs a
/// runtime, so the worker's thread and any caller's runtime share it.
#[derive(Default)]
struct Unfinished {
    count: AtomicUsize,
    changed: Notify,
}

/// Counts one job as finished when dropped: when it is done, given up, or
/// never started (the worker could not take it).
struct Finished(Arc<Unfinished>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// Something a store keeps alive for as long as a job is under way (SQLite's
/// account of its owners still at work).
pub(crate) type KeepWhileRunning = Option<Box<dyn Send>>;

struct Job {
    identity: Identity,
    token: OwnerToken,
    work: Work,
    keep: KeepWhileRunning,
    /// A release or an end of lease that finds nothing is tried again until
    /// then (the real clock: the caller's runtime may have paused its own).
    search_until: std::time::Instant,
    /// How long one attempt may go unanswered (`None`: no bound).
    answers_within: Option<Duration>,
    finished: Finished,
}

enum State {
    Idle(Option<OpenFn>),
    Running(mpsc::UnboundedSender<Job>),
}

impl std::fmt::Debug for Detached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detached")
            .field("store", &self.store)
            .finish()
    }
}

impl Detached {
    /// A worker for `store` whose connections `open` makes on its thread.
    pub(crate) fn new(store: &'static str, open: OpenFn) -> Self {
        Detached {
            store,
            state: Mutex::new(State::Idle(Some(open))),
            unfinished: Arc::default(),
            lands_within_ms: std::sync::atomic::AtomicU64::new(0),
            attempt_limit_ms: std::sync::atomic::AtomicU64::new(NO_ATTEMPT_LIMIT),
        }
    }

    /// An attempt unanswered for `limit` is given up as failed and tried
    /// again: for a worker whose connections can go silent (a database
    /// server's). The store's clones share the worker, and the longest limit
    /// any of them set holds: a clone given a short timeout must not cut the
    /// attempts of one given a long timeout for a slow server.
    ///
    /// Never under [`SHORTEST_ATTEMPT_LIMIT`]: the worker's writes wait up
    /// to 10 s for a row lock (the server ends that wait), and an attempt
    /// cut sooner would leave its statement waiting on the server, one more
    /// per attempt.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn set_attempt_limit(&self, limit: Duration) {
        let limit = limit.max(SHORTEST_ATTEMPT_LIMIT);
        let ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        self.attempt_limit_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// Says that a reservation statement of the store may land as late as
    /// `bound` after its call was dropped (it waits that long for locks at
    /// most): a dropped call's release searches for its record at least that
    /// long, so a statement landing after [`RETRY_AFTER`]'s attempts is still
    /// released. The longest bound given so far holds (a store's clones share
    /// the worker). Only PostgreSQL's statements wait past the default
    /// (SQLite's worker waits for the dropped call's reservation itself).
    #[cfg(feature = "postgres")]
    pub(crate) fn statements_land_within(&self, bound: Duration) {
        let ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        self.lands_within_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// Waits until every job handed over so far is finished, or `within` has
    /// passed; returns how many are still unfinished (0: all done). Runs on
    /// the caller's runtime; the jobs go on on the worker's.
    pub(crate) async fn finish_within(&self, within: Duration) -> usize {
        // A bound too long for the clock (`Duration::MAX`) is no bound.
        let deadline = tokio::time::Instant::now().checked_add(within);
        loop {
            // Registered before the count is read, so a job finishing in
            // between still wakes this wait.
            let changed = self.unfinished.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let left = self.unfinished.count.load(Ordering::SeqCst);
            if left == 0 {
                return 0;
            }
            match deadline {
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline, changed).await.is_err() {
                        return self.unfinished.count.load(Ordering::SeqCst);
                    }
                }
                None => changed.await,
            }
        }
    }

    /// [`hand_over`](Self::hand_over), keeping what `told(&token,
    /// completing)` answers (`completing`: the work is a completion): a
    /// store that keeps its own account of its owners is told first.
    pub(crate) fn hand_over_told(
        &self,
        identity: Identity,
        token: OwnerToken,
        work: Work,
        told: fn(&OwnerToken, bool) -> KeepWhileRunning,
    ) {
        let keep = told(&token, matches!(work, Work::Complete(_)));
        self.hand_over(identity, token, work, keep);
    }

    /// Hands `work` on `identity` (owned by `token`) to the background thread,
    /// keeping `keep` until the job is done or given up. Never blocks and
    /// never needs the caller's runtime.
    pub(crate) fn hand_over(
        &self,
        identity: Identity,
        token: OwnerToken,
        work: Work,
        keep: KeepWhileRunning,
    ) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let State::Idle(open) = &mut *state {
            match open.take().map(|open| start(self.store, open)) {
                Some(Ok(sender)) => *state = State::Running(sender),
                Some(Err(e)) => {
                    // Stays idle without an opener: every later job is logged as lost.
                    tracing::error!(target: "idempotent", store = self.store, error = %e,
                        "could not start the background thread for dropped calls");
                }
                None => {}
            }
        }
        self.unfinished.count.fetch_add(1, Ordering::SeqCst);
        let lands_within =
            Duration::from_millis(self.lands_within_ms.load(Ordering::Relaxed)).min(LONGEST_SEARCH);
        let answers_within = match self.attempt_limit_ms.load(Ordering::Relaxed) {
            NO_ATTEMPT_LIMIT => None,
            ms => Some(Duration::from_millis(ms).saturating_add(transfer_allowance(&work))),
        };
        let job = Job {
            identity,
            token,
            work,
            keep,
            search_until: std::time::Instant::now() + lands_within,
            answers_within,
            finished: Finished(self.unfinished.clone()),
        };
        let sent = match &*state {
            State::Running(sender) => sender.send(job).map_err(|e| e.0),
            State::Idle(_) => Err(job),
        };
        if let Err(job) = sent {
            lost(
                self.store,
                &job.identity,
                &job.work,
                "the background thread is not running",
            );
        }
    }
}

/// How much longer than [`ATTEMPT_ANSWERS_WITHIN`] an attempt that sends an
/// answer may take: a second for every 256 KiB (an 8 MiB answer: 32 s), so
/// a slow link still carries one (review).
fn transfer_allowance(work: &Work) -> Duration {
    match work {
        Work::Complete(answer) => allowance_for(answer.outcome.payload.len()),
        Work::Release | Work::EndLease => Duration::ZERO,
    }
}

/// The time a statement that sends `bytes` of answer gets beyond
/// [`ATTEMPT_ANSWERS_WITHIN`]: a second for every 256 KiB. The worker's
/// attempts ([`transfer_allowance`]) and a caller's completion
/// (`server::answered_within`) alike.
pub(crate) fn allowance_for(bytes: usize) -> Duration {
    const BYTES_PER_SECOND: usize = 256 * 1024;
    Duration::from_secs(u64::try_from(bytes / BYTES_PER_SECOND).unwrap_or(u64::MAX))
}

fn start(store: &'static str, open: OpenFn) -> std::io::Result<mpsc::UnboundedSender<Job>> {
    let (sender, mut jobs) = mpsc::unbounded_channel::<Job>();
    spawn_with_runtime(format!("idempotent-{store}-detached"), async move {
        let write = open();
        let mut running = tokio::task::JoinSet::new();
        // One end made again at a time: see `end_again_after_late_renewals`.
        let ends_made_again = Arc::new(tokio::sync::Semaphore::new(1));
        while let Some(job) = jobs.recv().await {
            let Job {
                identity,
                token,
                work,
                keep,
                search_until,
                answers_within,
                finished,
            } = job;
            // A completion's answer is kept for this process's takeovers
            // (`unrecorded`) until it is recorded; when its record was taken
            // over, as `found_taken_over` says (while a call of its request
            // pins it or kept a record for it); when the store gave up, until
            // its time is up.
            let noted =
                matches!(work, Work::Complete(..)).then(|| (identity.clone(), token.clone()));
            // A database server's worker (one whose attempts are bounded:
            // its connections can go silent) ends a lease again after it
            // ended it; see `end_again_after_late_renewals`.
            let ends_again = (matches!(work, Work::EndLease) && answers_within.is_some())
                .then(|| (write.clone(), identity.clone(), token.clone()));
            let one_at_a_time = ends_made_again.clone();
            let job = with_retries(
                store,
                write.clone(),
                identity,
                token,
                work,
                (search_until, answers_within),
            );
            running.spawn(async move {
                let ended = job.await;
                if let (Some((identity, token)), Some(ended)) = (noted, ended) {
                    // Written or fenced out: the owner is done.
                    super::live_owners::ended(&token);
                    crate::unrecorded::write_answered(&identity, &token, ended);
                }
                drop(keep);
                // The dropped call's record is finished: `finish_background_work`
                // need not wait for the ends made again below.
                drop(finished);
                if let (Some((write, identity, token)), Some(Fenced::Written)) = (ends_again, ended)
                {
                    let ends = (write, identity, token);
                    end_again_after_late_renewals(store, ends, answers_within, &one_at_a_time)
                        .await;
                }
            });
            while running.try_join_next().is_some() {}
        }
        // Every handle to the store is gone: finish what was handed over.
        while running.join_next().await.is_some() {}
    })?;
    Ok(sender)
}

/// Runs `work` on a new thread called `name`, on a current-thread runtime of
/// its own, so it outlives whatever runtime started it. Either failing to
/// start is the error.
pub(crate) fn spawn_with_runtime(
    name: String,
    work: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(name)
        .spawn(move || runtime.block_on(work))?;
    Ok(())
}

/// Does `work`, trying again on failure (an attempt unanswered within
/// `answers_within` too); what its last write found (`None`: it gave up, or
/// a release or an end of lease found nothing).
async fn with_retries(
    store: &'static str,
    write: WriteFn,
    identity: Identity,
    token: OwnerToken,
    work: Work,
    (search_until, answers_within): (std::time::Instant, Option<Duration>),
) -> Option<Fenced> {
    let mut last_error = None;
    // A completion goes on being tried after the schedule while it fails.
    let keep_trying = match &work {
        Work::Complete(answer) => {
            Some(tokio::time::Instant::now() + COMPLETE_TRIED_FOR.min(answer.ttl))
        }
        Work::Release | Work::EndLease => None,
    };
    let last_pause = RETRY_AFTER[RETRY_AFTER.len() - 1];
    let pauses = std::iter::once(Duration::ZERO)
        .chain(RETRY_AFTER)
        .chain(std::iter::repeat(last_pause));
    let mut attempt_started = tokio::time::Instant::now();
    for (attempt, pause) in pauses.enumerate() {
        let scheduled = attempt <= RETRY_AFTER.len();
        let tried_on = last_error.is_some()
            && keep_trying.is_some_and(|until| tokio::time::Instant::now() + pause < until);
        // A release or an end of lease goes on looking while the dropped
        // call's statement may still land (one more attempt after that).
        let searching = keep_trying.is_none() && std::time::Instant::now() < search_until;
        if !scheduled && !tried_on && !searching {
            break;
        }
        let pause = if scheduled || tried_on {
            pause
        } else {
            pause.min(SEARCH_PAUSE)
        };
        // The pause counts from the start of the attempt before: an attempt
        // that failed after waiting for a lock (SQLite's busy timeout, a lock
        // wait) has waited already, and a pause after it would leave the
        // record's lock free for others for that long, so a completion under
        // steady contention could miss every moment the lock is free until
        // the lease runs out and a retry runs the body again.
        tokio::time::sleep_until(attempt_started + pause).await;
        attempt_started = tokio::time::Instant::now();
        let attempt = write(identity.clone(), token.clone(), work.clone());
        let answered = match answers_within {
            // Given up: dropping the attempt closes its connection.
            Some(limit) => tokio::time::timeout(limit, attempt)
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::new(
                        store,
                        work.name(),
                        format!(
                            "no answer within {} s; its connection was closed",
                            limit.as_secs()
                        ),
                    ))
                }),
            None => attempt.await,
        };
        match answered {
            Ok(Fenced::Written) => {
                tracing::info!(target: "idempotent", store, scope = %identity.scope,
                    key = %identity.key_digest(), work = work.name(), "finished a dropped call's record");
                return Some(Fenced::Written);
            }
            // A completion that finds nothing will never find anything: the
            // record was taken over, or the dropped statement itself landed.
            Ok(Fenced::NotOwner) if matches!(work, Work::Complete(..)) => {
                tracing::warn!(target: "idempotent", store, scope = %identity.scope,
                    key = %identity.key_digest(),
                    "a dropped call's record is no longer in progress under its token (already recorded, or taken over)");
                return Some(Fenced::NotOwner);
            }
            Ok(Fenced::NotOwner) => last_error = None,
            Err(e) => {
                tracing::warn!(target: "idempotent", store, scope = %identity.scope,
                    key = %identity.key_digest(), work = work.name(), error = %e,
                    "finishing a dropped call's record failed; trying again");
                last_error = Some(e);
            }
        }
    }
    match last_error {
        // Nothing to release: the dropped call's reservation never landed, or
        // its record was already released or taken over.
        None => tracing::debug!(target: "idempotent", store, scope = %identity.scope,
            key = %identity.key_digest(), "a dropped call held no record; nothing to release"),
        Some(e) => lost(store, &identity, &work, &e.to_string()),
    }
    None
}

/// Ends the lease of a dropped call's record again, at each pause of
/// [`RETRY_AFTER`], after the worker ended it, until the record is no longer
/// the call's (a call took it over: `NotOwner`).
///
/// A call dropped while a renewal of its lease was on its way to a database
/// server cannot wait for that renewal (a call that ends its own lease lets
/// its renewals land first): the statement runs on the server when it
/// arrives, also after its connection was closed, and landing after the
/// worker's end it gave the record a whole lease again. Every retry was then
/// refused, or waited, until that lease ran out, instead of taking the record
/// over at once and asking the `recover` hook (rules 14 and 20). Ended again,
/// a renewal that lands within the schedule (about 9 s) renews it at most
/// until the next end; one later still renews it for one lease, as before.
/// Fenced by the call's token: only the dropped call's own statements write
/// with it, so nothing anyone else holds is touched. The worker's path
/// alone: a call never waits for it, nor does `finish_background_work`.
///
/// One end made again is under way at a time in the worker (`one_at_a_time`):
/// a record someone else's transaction holds (a transactional-mode call that
/// took it over, its body running) keeps an end made again waiting for the
/// row lock, up to the worker's 10 s, on one of the worker's two connections.
/// Unbounded, two such records held both, and the release or completion of
/// another dropped call waited for them (past its `acquire_timeout`: then a
/// pause more), the record refusing retries meanwhile; many calls dropped at
/// once filled the worker's pool with four ends each.
async fn end_again_after_late_renewals(
    store: &'static str,
    (write, identity, token): (WriteFn, Identity, OwnerToken),
    answers_within: Option<Duration>,
    one_at_a_time: &tokio::sync::Semaphore,
) {
    for pause in RETRY_AFTER {
        tokio::time::sleep(pause).await;
        // Never closed: the worker keeps it for as long as it runs.
        let Ok(_turn) = one_at_a_time.acquire().await else {
            return;
        };
        let attempt = write(identity.clone(), token.clone(), Work::EndLease);
        let answered = match answers_within {
            Some(limit) => tokio::time::timeout(limit, attempt).await.ok(),
            None => Some(attempt.await),
        };
        match answered {
            Some(Ok(Fenced::NotOwner)) => return,
            Some(Ok(Fenced::Written)) => {}
            Some(Err(e)) => tracing::debug!(target: "idempotent", store, scope = %identity.scope,
                key = %identity.key_digest(), error = %e,
                "ending a dropped call's lease again failed; trying at the next pause"),
            None => tracing::debug!(target: "idempotent", store, scope = %identity.scope,
                key = %identity.key_digest(),
                "ending a dropped call's lease again went unanswered; trying at the next pause"),
        }
    }
}

impl Work {
    fn name(&self) -> &'static str {
        match self {
            Work::Release => "release",
            Work::EndLease => "end lease",
            Work::Complete(..) => "complete",
        }
    }

    /// The store write that does it, as the store's errors name it (a
    /// lease is ended by a heartbeat of zero).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn operation(&self) -> &'static str {
        match self {
            Work::Release => "release",
            Work::EndLease => "heartbeat",
            Work::Complete(..) => "complete",
        }
    }
}

fn lost(store: &'static str, identity: &Identity, work: &Work, why: &str) {
    crate::metrics::release_failed(store);
    tracing::error!(target: "idempotent", store, scope = %identity.scope, key = %identity.key_digest(),
        work = work.name(), reason = why,
        "could not finish a dropped call's record; it stays in progress until its lease runs out");
}

/// The detached methods of [`Store`](crate::Store) for a store with a
/// `detached: Arc<Detached>` field: each hands its work to the store's worker
/// ([`Detached::hand_over`]). Written once for the SQL stores.
macro_rules! hand_over_to_the_worker {
    () => {
        $crate::store::detached::hand_over_to_the_worker!(told = |_, _| None);
    };
    // `told(&token, completing)` is called first: the store keeps its own
    // account of its owners (SQLite's live owners), and what it answers is
    // kept until the job is done or given up.
    (told = $told:expr) => {
        // Written as `#[async_trait]` expands an `async fn`: this macro is
        // expanded after the attribute has rewritten the impl.
        fn finish_background_work<'life0, 'async_trait>(
            &'life0 self,
            within: Duration,
        ) -> ::core::pin::Pin<Box<dyn ::core::future::Future<Output = usize> + Send + 'async_trait>>
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(self.detached.finish_within(within))
        }

        fn release_detached(&self, identity: Identity, token: OwnerToken) {
            let work = $crate::store::detached::Work::Release;
            self.detached.hand_over_told(identity, token, work, $told);
        }

        fn end_lease_detached(&self, identity: Identity, token: OwnerToken) {
            let work = $crate::store::detached::Work::EndLease;
            self.detached.hand_over_told(identity, token, work, $told);
        }

        fn complete_detached(&self, completion: $crate::store::Completion<'_>) {
            let (identity, token) = (completion.identity.clone(), completion.token.clone());
            let work = $crate::store::detached::Work::Complete(completion.answer());
            self.detached.hand_over_told(identity, token, work, $told);
        }
    };
}
pub(crate) use hand_over_to_the_worker;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A store's silent-connection timeout bounds its worker's attempts, but
    /// never below the worker's own row-lock wait (which the server ends):
    /// cut sooner, an attempt would leave its statement waiting on the server.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn a_workers_attempts_are_never_cut_before_its_own_lock_wait_ends() {
        let worker = Detached::new("test", Box::new(|| -> WriteFn { unreachable!() }));
        let limit = |worker: &Detached| worker.attempt_limit_ms.load(Ordering::Relaxed);
        assert_eq!(
            limit(&worker),
            NO_ATTEMPT_LIMIT,
            "no bound until a store sets one"
        );
        worker.set_attempt_limit(Duration::from_secs(2));
        assert_eq!(limit(&worker), 17_000);
        worker.set_attempt_limit(Duration::from_secs(30));
        assert_eq!(limit(&worker), 30_000);
        // A clone's shorter timeout does not cut the attempts of one set long.
        worker.set_attempt_limit(Duration::from_secs(2));
        assert_eq!(limit(&worker), 30_000);
    }

    /// An attempt of the worker takes its connection from the worker's pool
    /// inside the attempt's bound: with both of its connections held by
    /// other jobs' lock waits (or a new connection slow to open) that takes
    /// up to the pool's `acquire_timeout` (`ACQUIRE_TIMEOUT`). Then its write
    /// waits up to 10 s for a row lock, a wait the server ends. Even with
    /// the store's silent-connection timeout set short, such an attempt must
    /// end by the server's answer, not be cut while its statement still
    /// waits on the server (one more waiting statement per attempt) and sent
    /// again.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[tokio::test(start_paused = true)]
    async fn a_worker_attempt_that_waited_for_a_connection_and_then_a_lock_is_not_cut() {
        let worker = Detached::new("test", Box::new(|| -> WriteFn { unreachable!() }));
        worker.set_attempt_limit(Duration::from_secs(2));
        let limit = Duration::from_millis(worker.attempt_limit_ms.load(Ordering::Relaxed));
        let attempts = Arc::new(AtomicUsize::new(0));
        let counted = attempts.clone();
        let write: WriteFn = Arc::new(move |_, _, _| {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            Box::pin(async move {
                if first {
                    // The pool's connection, just inside its acquire timeout.
                    let acquired = crate::store::ACQUIRE_TIMEOUT - Duration::from_millis(1);
                    tokio::time::sleep(acquired).await;
                    // The row lock, waited for until just inside the server's
                    // end of the wait; then the lock is free and the write lands.
                    tokio::time::sleep(Duration::from_secs(10) - Duration::from_millis(1)).await;
                }
                Ok(Fenced::Written)
            })
        });
        let id = Identity::new("t", "releaser.test", "slow-slot").expect("identity");
        // Nothing to search for past the schedule: the reservation landed.
        let ended = with_retries(
            "test",
            write,
            id,
            OwnerToken::new(),
            Work::Release,
            (std::time::Instant::now(), Some(limit)),
        )
        .await;
        assert_eq!(ended, Some(Fenced::Written));
        assert_eq!(
            attempts.load(Ordering::SeqCst),
            1,
            "the first attempt was cut at {limit:?} while its statement still waited on the server"
        );
    }

    /// An answer of a call's body, kept for an hour.
    fn an_answer() -> crate::store::Answer {
        crate::store::Answer {
            outcome: crate::store::StoredOutcome {
                is_error: false,
                payload: b"1".to_vec(),
            },
            ttl: Duration::from_secs(3600),
            by: crate::store::AnsweredBy::Body,
        }
    }

    /// The release happens on the releaser's own runtime even when the runtime
    /// that handed it over is gone, and is tried again while it finds nothing.
    #[test]
    fn releases_after_the_callers_runtime_is_gone_and_retries_while_nothing_is_found() {
        let attempts = Arc::new(AtomicUsize::new(0));
        let (done_tx, done_rx) = std::sync::mpsc::channel::<usize>();
        let counted = attempts.clone();
        let detached = Detached::new(
            "test",
            Box::new(move || {
                let done_tx = Mutex::new(done_tx);
                Arc::new(move |_, _, _| {
                    let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    let done = done_tx.lock().ok().map(|tx| tx.clone());
                    Box::pin(async move {
                        // The reservation "lands" before the second attempt.
                        let released = n >= 2;
                        if let (true, Some(tx)) = (released, done) {
                            let _ = tx.send(n);
                        }
                        Ok(Fenced::from_owned(released))
                    })
                })
            }),
        );
        let caller = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        caller.block_on(async {
            let id = Identity::new("t", "releaser.test", "k").expect("identity");
            detached.hand_over(id, OwnerToken::new(), Work::Release, None);
        });
        drop(caller);
        let n = done_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("released in the background");
        assert_eq!(n, 2, "one empty attempt, then the release");
    }

    /// A completion whose attempts fail after waiting for a lock (SQLite's
    /// busy timeout) is tried again at once: with a pause after each, the
    /// lock was free for others meanwhile, and under steady contention the
    /// completion could miss it until the lease ran out (a retry then runs
    /// the body again). An attempt that fails at once still waits out the
    /// schedule (no spinning).
    #[tokio::test(start_paused = true)]
    async fn a_completion_that_waited_for_a_lock_is_tried_again_at_once() {
        const LOCK_WAIT: Duration = Duration::from_secs(10);
        let started = Arc::new(Mutex::new(Vec::new()));
        let seen = started.clone();
        let write: WriteFn = Arc::new(move |_, _, _| {
            let seen = seen.clone();
            Box::pin(async move {
                let attempt = {
                    let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                    seen.push(tokio::time::Instant::now());
                    seen.len()
                };
                match attempt {
                    // Two that fail at once, then lock waits that time out.
                    1 | 2 => Err(StoreError::new("test", "complete", "connection refused")),
                    3..=7 => {
                        tokio::time::sleep(LOCK_WAIT).await;
                        Err(StoreError::new("test", "complete", "database is locked"))
                    }
                    _ => Ok(Fenced::Written),
                }
            })
        });
        let id = Identity::new("t", "releaser.test", "k").expect("identity");
        let answer = an_answer();
        let far = std::time::Instant::now() + Duration::from_secs(3600);
        with_retries(
            "test",
            write,
            id,
            OwnerToken::new(),
            Work::Complete(answer),
            (far, None),
        )
        .await;
        let started = started.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert_eq!(started.len(), 8, "recorded at the eighth attempt");
        let gaps: Vec<Duration> = started.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(
            gaps[..2],
            RETRY_AFTER[..2],
            "quick failures wait out the schedule"
        );
        assert!(
            gaps[2..].iter().all(|gap| *gap == LOCK_WAIT),
            "each attempt after a lock wait starts when the one before ends: {gaps:?}"
        );
    }

    /// A dropped call's completion (its body has run) goes on being tried
    /// after the retry schedule for as long as it fails, until it lands:
    /// given up, the record would stay in progress until its lease ran out,
    /// and a retry would run the body again. A release stops after the
    /// schedule (its lease bounds the damage).
    #[tokio::test(start_paused = true)]
    async fn a_completion_is_tried_past_the_schedule_until_it_lands() {
        const FAILURES: usize = 3 * RETRY_AFTER.len();
        for (work, landed) in [
            (Work::Complete(an_answer()), Some(Fenced::Written)),
            (Work::Release, None),
        ] {
            let tries = Arc::new(AtomicUsize::new(0));
            let counted = tries.clone();
            let write: WriteFn = Arc::new(move |_, _, _| {
                let counted = counted.clone();
                Box::pin(async move {
                    if counted.fetch_add(1, Ordering::SeqCst) < FAILURES {
                        Err(StoreError::new("test", "complete", "connection refused"))
                    } else {
                        Ok(Fenced::Written)
                    }
                })
            });
            let id = Identity::new("t", "releaser.test", "k").expect("identity");
            let name = work.name();
            let done = with_retries(
                "test",
                write,
                id,
                OwnerToken::new(),
                work,
                // Nothing left to search for: only a completion goes on.
                (std::time::Instant::now(), None),
            )
            .await;
            assert_eq!(done, landed, "{name}");
            if landed.is_some() {
                assert_eq!(tries.load(Ordering::SeqCst), FAILURES + 1, "{name}");
            }
        }
    }

    /// An attempt on a connection that went silent is given up after its
    /// bound (dropped, which closes the connection), logged as failed and
    /// tried again: it held the worker for as long as TCP kept the
    /// connection (unrecorded-answers hunt).
    #[tokio::test(start_paused = true)]
    async fn an_attempt_that_never_answers_is_given_up_and_tried_again() {
        struct DroppedFlag(Arc<AtomicUsize>);
        impl Drop for DroppedFlag {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let (attempts, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (counted, seen_dropped) = (attempts.clone(), dropped.clone());
        let write: WriteFn = Arc::new(move |_, _, _| {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            let flag = DroppedFlag(seen_dropped.clone());
            Box::pin(async move {
                let _flag = flag;
                if first {
                    std::future::pending::<()>().await;
                }
                Ok(Fenced::Written)
            })
        });
        let id = Identity::new("t", "releaser.test", "silent").expect("identity");
        let answer = an_answer();
        let far = std::time::Instant::now() + Duration::from_secs(3600);
        let ended = with_retries(
            "test",
            write,
            id,
            OwnerToken::new(),
            Work::Complete(answer),
            (far, Some(ATTEMPT_ANSWERS_WITHIN)),
        )
        .await;
        assert_eq!(ended, Some(Fenced::Written), "recorded by the next attempt");
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            2,
            "the silent attempt was dropped (closing its connection)"
        );
    }

    /// Rule 14: a dropped call's release that cannot be made is never
    /// silent: once its attempts are used up it is logged and counted
    /// (`release_failures`); the lease bounds the damage.
    #[tokio::test(start_paused = true)]
    async fn a_release_that_keeps_failing_is_counted() {
        let attempts = Arc::new(AtomicUsize::new(0));
        let counted = attempts.clone();
        let write: WriteFn = Arc::new(move |_, _, _| {
            counted.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Err(StoreError::new("test", "release", "connection refused")) })
        });
        let before = crate::metrics::snapshot().release_failures;
        let id = Identity::new("t", "releaser.test", "lost").expect("identity");
        // Nothing to search for past the schedule: the reservation landed.
        with_retries(
            "test",
            write,
            id,
            OwnerToken::new(),
            Work::Release,
            (std::time::Instant::now(), None),
        )
        .await;
        assert_eq!(
            attempts.load(Ordering::SeqCst),
            RETRY_AFTER.len() + 1,
            "tried on the schedule, then given up"
        );
        assert!(
            crate::metrics::snapshot().release_failures > before,
            "a release given up is counted"
        );
    }

    /// An attempt that sends an answer gets a second more per 256 KiB of it
    /// (an 8 MiB answer over a slow link never fit in the bound alone).
    #[test]
    fn a_large_answer_gets_time_to_cross_the_link() {
        let mut answer = an_answer();
        answer.outcome.payload = vec![0; 8 << 20];
        assert_eq!(
            transfer_allowance(&Work::Complete(answer)),
            Duration::from_secs(32)
        );
        assert_eq!(
            transfer_allowance(&Work::Complete(an_answer())),
            Duration::ZERO
        );
        assert_eq!(transfer_allowance(&Work::Release), Duration::ZERO);
    }

    /// A completion the worker recorded is forgotten by `unrecorded`: the
    /// worker says how its write ended (`write_answered`).
    #[test]
    fn a_completion_the_worker_recorded_is_no_longer_held_unrecorded() {
        let detached = Detached::new(
            "test",
            Box::new(|| Arc::new(|_, _, _| Box::pin(async { Ok(Fenced::Written) }))),
        );
        let id = Identity::new("t", "releaser.test", "recorded-by-the-worker").expect("identity");
        let (token, request) = (
            OwnerToken::new(),
            crate::unrecorded::Request {
                store: "test",
                database: None,
                fingerprint: Some("v3:recorded-by-the-worker".into()),
            },
        );
        let answer = an_answer();
        crate::unrecorded::note(&id, &token, &request, &answer);
        assert!(crate::unrecorded::for_takeover(&id, &request).is_some());
        detached.hand_over(id.clone(), token, Work::Complete(answer), None);
        let caller = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let left = caller.block_on(detached.finish_within(Duration::from_secs(30)));
        assert_eq!(left, 0);
        // Kept, it would answer a later record of the request (after an
        // operator's release, say) with a stale copy, and keep every call's
        // pin off its fast path for up to an hour (mutation audit).
        assert!(
            crate::unrecorded::for_takeover(&id, &request).is_none(),
            "the worker's recorded answer is forgotten"
        );
    }

    /// `finish_within` counts the work not yet done: a job held up counts as
    /// unfinished when the wait ends, and once it is done the wait returns 0.
    #[test]
    fn finish_within_waits_for_the_handed_over_work() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let held = gate.clone();
        let detached = Detached::new(
            "test",
            Box::new(move || {
                Arc::new(move |_, _, _| {
                    let held = held.clone();
                    Box::pin(async move {
                        let _pass = held.acquire().await;
                        Ok(Fenced::Written)
                    })
                })
            }),
        );
        let caller = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        caller.block_on(async {
            assert_eq!(
                detached.finish_within(Duration::ZERO).await,
                0,
                "nothing handed over yet"
            );
            for key in ["a", "b"] {
                let id = Identity::new("t", "releaser.test", key).expect("identity");
                detached.hand_over(id, OwnerToken::new(), Work::Release, None);
            }
            assert_eq!(
                detached.finish_within(Duration::from_millis(50)).await,
                2,
                "both jobs wait at the gate"
            );
            gate.add_permits(2);
            assert_eq!(detached.finish_within(Duration::from_secs(30)).await, 0);
        });
    }
}
