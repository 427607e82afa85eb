//! The [`Store`] trait every backend implements, and the types it speaks.
//!
//! A store keeps one record per [`Identity`]. A record is *in progress*
//! (held by an owner token under a lease) or *complete* (holding the recorded
//! outcome until its retention runs out). All time decisions — lease expiry,
//! retention — are made on the store's own clock (the database's for SQL stores).

use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::identity::Identity;
use std::time::Duration;

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) mod detached;

/// How long a server store's `connect` and every statement wait for a pooled
/// connection (and the command line for its first look at a database).
pub const ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) mod live_owners;
pub mod memory;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub mod migrate;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) mod rows;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod server;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(feature = "sqlite")]
pub mod sqlite_tx;
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) mod waiters;

/// A random token naming the current owner of an in-progress record.
/// Completion, release and heartbeat must present it (fencing).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OwnerToken(String);

impl OwnerToken {
    /// A fresh token, unique across processes and restarts: 64 random bits
    /// drawn once per process, then a per-process counter (32 hex
    /// characters, like a UUID without dashes). Cheaper than a random UUID
    /// per call (no system call on the hot path). A process that `fork`s
    /// after its first token hands the child the same sequence, so two
    /// owners could present one token: start worker processes anew
    /// (`exec`, a process manager), or fork before the first idempotent
    /// call, as a tokio runtime needs anyway.
    ///
    /// ```
    /// use idempotent_runtime::OwnerToken;
    /// let (a, b) = (OwnerToken::new(), OwnerToken::new());
    /// assert_ne!(a, b);
    /// assert_eq!(a.as_str().len(), 32);
    /// ```
    pub fn new() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::OnceLock;
        static PROCESS: OnceLock<u64> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let process = *PROCESS.get_or_init(|| uuid::Uuid::new_v4().as_u64_pair().0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&process.to_be_bytes());
        bytes[8..].copy_from_slice(&n.to_be_bytes());
        // Written by hand: `format!` with padded hex was a tenth of an
        // in-memory call.
        let mut text = [0u8; 32];
        crate::fingerprint::write_hex(&bytes, &mut text);
        // Hex digits only: always UTF-8.
        OwnerToken(String::from_utf8_lossy(&text).into_owned())
    }

    /// The token as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Wraps a stored token.
    pub fn from_stored(s: impl Into<String>) -> Self {
        OwnerToken(s.into())
    }
}

impl Default for OwnerToken {
    fn default() -> Self {
        Self::new()
    }
}

/// What a caller asks of [`Store::reserve`].
#[derive(Debug, Clone, Copy)]
pub struct ReserveRequest<'a> {
    /// The record's identity.
    pub identity: &'a Identity,
    /// The fingerprint of this call's arguments, if it has one.
    pub fingerprint: Option<&'a Fingerprint>,
    /// The token that will own the record if this call acquires it.
    pub token: &'a OwnerToken,
    /// How long the lease lasts before someone else may take the record over.
    pub lease: Duration,
    /// How long from now the in-progress record is kept: it counts as absent,
    /// and is purgeable, only after both its lease and this have run out (a
    /// renewal keeps this time's distance from the lease's end). The engine
    /// asks for the lease plus the scope's ttl, so a dead owner's record stays
    /// for ttl after its lease ran out, to be taken over (rule 20).
    pub ttl: Duration,
}

/// A recorded outcome: the serialized `Ok` value or recorded `Err` value.
///
/// Its `Debug` shows the payload's size, not its bytes: a recorded answer
/// may hold a raw key or personal data, and a record's `Debug` (a
/// [`RecordSnapshot`], a [`Reservation::Completed`]) is what ends up in a
/// log line (rule 2).
#[derive(Clone, PartialEq, Eq)]
pub struct StoredOutcome {
    /// `true` when this is a recorded error (`errors = record`).
    pub is_error: bool,
    /// The serialized value (JSON).
    pub payload: Vec<u8>,
}

impl std::fmt::Debug for StoredOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredOutcome")
            .field("is_error", &self.is_error)
            .field("payload_bytes", &self.payload.len())
            .finish()
    }
}

/// The answer of [`Store::reserve`]: one of the four things a duplicate can find.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// The caller's token now owns the record; run the body.
    ///
    /// The three fields always agree: `took_over` is `attempt > 1`, and
    /// `previous_attempt_started_at_ms` is `Some` exactly when `took_over`
    /// (DESIGN.md rule 20).
    Acquired {
        /// `true` when an in-progress record whose lease had run out was taken
        /// over (rule 10): its previous owner may have done the work. A record
        /// that had expired altogether (rule 16) is replaced, not taken over.
        took_over: bool,
        /// Which attempt at this record the caller now owns: 1 for a fresh
        /// record (and for one that replaced an expired record), 2 for the
        /// first takeover, counting up with every further takeover. Kept in
        /// the record, so it survives restarts and process boundaries.
        attempt: u32,
        /// On a takeover: when the attempt taken over had started, in ms since
        /// the Unix epoch on the store's clock.
        previous_attempt_started_at_ms: Option<i64>,
    },
    /// The record is complete and its fingerprint agrees: replay this.
    Completed(StoredOutcome),
    /// Another owner holds a live lease.
    InProgress {
        /// Time left on that lease, by the store's clock.
        lease_remaining: Duration,
    },
    /// A live record exists with a different fingerprint. Nothing was changed.
    FingerprintMismatch,
}

impl Reservation {
    /// What a reservation of a free (absent or expired) identity answers:
    /// attempt 1, not a takeover.
    ///
    /// ```
    /// use idempotent_runtime::Reservation;
    /// assert!(matches!(Reservation::FRESH, Reservation::Acquired { attempt: 1, took_over: false, .. }));
    /// ```
    pub const FRESH: Reservation = Reservation::Acquired {
        took_over: false,
        attempt: 1,
        previous_attempt_started_at_ms: None,
    };

    /// An acquisition of attempt `attempt`: fresh for 1, a takeover of an
    /// attempt that started at `previous_attempt_started_at_ms` otherwise.
    /// The constructor stores use, so the fields always agree.
    pub fn acquired(attempt: u32, previous_attempt_started_at_ms: Option<i64>) -> Reservation {
        let attempt = attempt.max(1);
        let took_over = attempt > 1;
        Reservation::Acquired {
            took_over,
            attempt,
            previous_attempt_started_at_ms: if took_over {
                // Stores fall back to the record's creation time; 0 (the
                // epoch) only if even that is missing, so a takeover is
                // never reported without a start time.
                Some(previous_attempt_started_at_ms.unwrap_or(0))
            } else {
                None
            },
        }
    }
}

/// What [`Store::complete`] records: the outcome for the record `token`
/// owns, kept for `ttl`, and who gave it.
///
/// ```
/// use idempotent_runtime::{AnsweredBy, Completion, Identity, OwnerToken, StoredOutcome};
/// use std::time::Duration;
/// let identity = Identity::new("acct_1", "payments.charge", "order-1")?;
/// let token = OwnerToken::new();
/// let outcome = StoredOutcome { is_error: false, payload: b"42".to_vec() };
/// let completion = Completion::by_body(&identity, &token, &outcome, Duration::from_secs(3600));
/// assert_eq!(completion.by, AnsweredBy::Body);
/// assert!(!completion.marks_recovered());
/// # Ok::<(), idempotent_runtime::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// The record's identity.
    pub identity: &'a Identity,
    /// The token that must still own the record (rule 10).
    pub token: &'a OwnerToken,
    /// The outcome to record.
    pub outcome: &'a StoredOutcome,
    /// How long the completed record is kept (its retention, rule 16).
    pub ttl: Duration,
    /// Who gave the answer: the body, or a `recover` hook (rule 20).
    pub by: AnsweredBy,
}

impl<'a> Completion<'a> {
    /// A completion with the body's answer.
    pub fn by_body(
        identity: &'a Identity,
        token: &'a OwnerToken,
        outcome: &'a StoredOutcome,
        ttl: Duration,
    ) -> Self {
        Completion {
            identity,
            token,
            outcome,
            ttl,
            by: AnsweredBy::Body,
        }
    }

    /// Whether the record is to be marked recovered ([`AnsweredBy::marks_recovered`]).
    pub fn marks_recovered(&self) -> bool {
        self.by.marks_recovered()
    }

    /// What is recorded, owned, without whose record it is: for work that
    /// outlives the caller's borrows (a detached completion).
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    pub(crate) fn answer(&self) -> Answer {
        Answer {
            outcome: self.outcome.clone(),
            ttl: self.ttl,
            by: self.by,
        }
    }
}

/// The part of a [`Completion`] that says what is recorded, owned: kept by a
/// call while its result is being recorded, and by a store's background
/// worker that records it for a dropped call.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) outcome: StoredOutcome,
    pub(crate) ttl: Duration,
    pub(crate) by: AnsweredBy,
}

impl Answer {
    /// This answer, recorded on `identity`'s record `token` owns.
    pub(crate) fn completing<'a>(
        &'a self,
        identity: &'a Identity,
        token: &'a OwnerToken,
    ) -> Completion<'a> {
        let Answer { outcome, ttl, by } = self;
        Completion {
            identity,
            token,
            outcome,
            ttl: *ttl,
            by: *by,
        }
    }
}

/// Who gave the answer a completion records ([`Store::complete`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnsweredBy {
    /// The function's body ran and returned it.
    Body,
    /// A `recover` hook (rule 20): it found that a crashed attempt had done
    /// the work, and the body did not run. The record is marked recovered;
    /// audits count such records.
    RecoverHook,
}

impl AnsweredBy {
    /// Whether the record is marked recovered: the answer is a `recover`
    /// hook's (what the stores keep in their `recovered` column).
    pub fn marks_recovered(self) -> bool {
        self == AnsweredBy::RecoverHook
    }
}

/// What a write fenced by the owner token did: [`Store::complete`],
/// [`Store::release`] and [`Store::heartbeat`]
/// change a record only while the token presented still owns it (rule 10).
///
/// ```
/// use idempotent_runtime::Fenced;
/// // A store implementation reports whether its conditional write matched a row:
/// let rows_affected = 1;
/// assert_eq!(Fenced::from_owned(rows_affected == 1), Fenced::Written);
/// assert!(!Fenced::NotOwner.is_written());
/// ```
#[must_use = "a fenced write that found another owner changed nothing: the caller no longer holds the record"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The token owned the record, and the write was made.
    Written,
    /// The token no longer owns the record (another caller took it over after
    /// its lease ran out, an operator released it, or it is gone): nothing
    /// was changed. For the caller this is a lost lease.
    NotOwner,
}

impl Fenced {
    /// [`Fenced::Written`] when the token owned the record, [`Fenced::NotOwner`] otherwise.
    pub fn from_owned(owned: bool) -> Fenced {
        if owned {
            Fenced::Written
        } else {
            Fenced::NotOwner
        }
    }

    /// `true` for [`Fenced::Written`].
    pub fn is_written(self) -> bool {
        self == Fenced::Written
    }
}

/// The state of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecordState {
    /// Held by an owner under a lease.
    InProgress,
    /// Holding a recorded outcome.
    Complete,
}

impl RecordState {
    /// The name stored in SQL stores: `in_progress` or `complete`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::InProgress => "in_progress",
            RecordState::Complete => "complete",
        }
    }

    /// Parses a stored state name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "in_progress" => Some(RecordState::InProgress),
            "complete" => Some(RecordState::Complete),
            _ => None,
        }
    }
}

/// A read-only view of one record, for inspection and tests.
/// Times are milliseconds since the Unix epoch on the store's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordSnapshot {
    /// In progress or complete.
    pub state: RecordState,
    /// The stored fingerprint, if any.
    pub fingerprint: Option<String>,
    /// The current owner's token (in progress only).
    pub owner_token: Option<String>,
    /// The recorded outcome (complete only).
    pub outcome: Option<StoredOutcome>,
    /// When the lease runs out (in progress only).
    pub lease_expires_at_ms: Option<i64>,
    /// When the record's retention runs out.
    pub expires_at_ms: i64,
    /// The store's clock when this snapshot was taken.
    pub now_ms: i64,
    /// When the record was created (by its first attempt), ms since the epoch.
    pub created_at_ms: i64,
    /// The record's attempt number (rule 20): 1 unless an expired lease was
    /// taken over, +1 for every takeover. For a complete record, the attempt
    /// that completed it.
    pub attempt: u32,
    /// When the current (or, complete, the completing) attempt took the record.
    pub attempt_started_at_ms: i64,
    /// Whether the recorded outcome came from a `recover` hook
    /// ([`AnsweredBy::RecoverHook`]) rather than from the body.
    pub recovered: bool,
}

impl RecordSnapshot {
    /// Whether the record counts as absent now (its retention ran out, and for
    /// an in-progress record its lease too).
    pub fn is_expired(&self) -> bool {
        self.expires_at_ms <= self.now_ms
            && self.lease_expires_at_ms.is_none_or(|l| l <= self.now_ms)
    }
}

/// Per-scope record counts, the raw material of an audit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScopeStats {
    /// The scope.
    pub scope: String,
    /// Complete records still within retention.
    pub complete: u64,
    /// In-progress records whose lease is live.
    pub in_progress: u64,
    /// In-progress records whose lease has run out (owner gone).
    pub stuck: u64,
    /// Records past retention that a purge has not removed yet.
    pub expired: u64,
    /// Creation time of the oldest record, ms since the epoch on the store's clock.
    pub oldest_created_at_ms: Option<i64>,
    /// Records within retention (complete, in progress or stuck) whose
    /// attempt number is above 1: an expired lease was taken over at least
    /// once (rule 20). Repeated uncertainty shows here.
    pub taken_over: u64,
    /// Complete records, within retention, whose outcome a `recover` hook
    /// gave instead of the body.
    pub recovered: u64,
    /// How long ago, in ms on the store's clock, the lease of the record
    /// stuck longest ran out (`None` without stuck records). A takeover
    /// clears a stuck record when the next call of its key comes; one stuck
    /// for long means no call came, or none can take it over.
    pub longest_stuck_ms: Option<i64>,
    /// How long ago, in ms on the store's clock, the expired record waiting
    /// longest for a purge became purgeable (its retention, and for an
    /// in-progress record its lease too, ran out; `None` without expired
    /// records). It stays below the purge's interval where a purger runs.
    pub longest_unpurged_ms: Option<i64>,
}

/// The answer of [`Store::force_release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForcedRelease {
    /// The in-progress record was deleted: the key is free and the next call
    /// runs as a fresh attempt 1.
    Released {
        /// The attempt number the deleted record had.
        attempt: u32,
    },
    /// Refused: the record is complete. Its result is the answer for the key;
    /// deleting it would let a retry run the body again.
    Complete,
    /// Refused (only when the lease had to have run out): a live owner holds
    /// the record and may be running the body right now.
    LeaseLive {
        /// Time left on the lease, by the store's clock.
        lease_remaining: Duration,
    },
    /// There is no record with this identity.
    Absent,
}

/// The interface every backend implements. The conformance suite in `tests/`
/// checks each implementation against the behaviour contract.
///
/// Implementations must make [`reserve`](Store::reserve) atomic: of many
/// concurrent reservations for one identity, exactly one is `Acquired`.
#[async_trait::async_trait]
pub trait Store: Send + Sync {
    /// A short name for messages and logs: `memory`, `sqlite`, `postgres`, `mysql`.
    fn name(&self) -> &'static str;

    /// The largest answer (its serialized bytes) this store can record. A
    /// larger one is refused with
    /// [`Error::ResultTooLarge`](crate::Error::ResultTooLarge) before
    /// anything is written, and the key is released. By default, and at
    /// most, [`MAX_RESULT_BYTES`](crate::MAX_RESULT_BYTES); a MySQL server's
    /// `max_allowed_packet` can make it smaller (a statement larger than that
    /// is refused by the server, so the answer could never be written).
    /// Answers up to 64 KiB are recorded without asking. A store that wraps
    /// another (to count or log its calls) must forward this method too, or
    /// the one it wraps is handed answers it cannot write.
    fn max_result_bytes(&self) -> usize {
        crate::engine::MAX_RESULT_BYTES
    }

    /// Whether [`complete`](Store::complete) writes this process's own
    /// memory, so it can neither fail for an outage nor hang (the memory
    /// store). Otherwise (the default) the engine keeps a copy of each
    /// answer while it is being recorded, and while the store's background
    /// worker goes on trying it: a call of this process that takes the
    /// record over once its lease has run out records that answer and
    /// replays it instead of running the body again. A store that wraps
    /// another may forward this method (a wrapper of the memory store that
    /// does not only costs that copy).
    fn records_in_process_memory(&self) -> bool {
        false
    }

    /// What tells the database this store's records are in apart from any
    /// other database a process may use (`None`: nothing does). The SQL
    /// stores read it when they open: a random id their migrations made once
    /// for the records, with the database's name (and PostgreSQL's schema,
    /// SQLite's file). A [`MemoryStore`](crate::MemoryStore) is a database of
    /// its own: a random id made by `MemoryStore::new`, shared by its clones.
    ///
    /// An answer this process could not record yet is recorded by a call of
    /// the same request that takes the record over (see
    /// [`records_in_process_memory`](Store::records_in_process_memory)) only
    /// when both stores name the same database here: one identity's records
    /// in two databases of one kind (two regions, a file per customer) are
    /// two requests. A store that wraps another must forward this method, or
    /// answers held for the wrapped store's records are not recorded through
    /// the wrapper (its takeovers ask their `recover` hook, or run the body,
    /// as a call of another process does).
    fn database_id(&self) -> Option<&str> {
        None
    }

    /// Atomically creates the record, takes over an expired one, or reports what is there.
    ///
    /// Rules: a record whose retention ran out counts as absent. A live record
    /// (complete, or in progress) whose fingerprint and the request's are both
    /// present and differ gives [`Reservation::FingerprintMismatch`] and is not
    /// modified. An in-progress record whose lease ran out is taken over: the
    /// request's token, fingerprint and a fresh lease replace the old ones.
    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError>;

    /// Records the outcome and keeps it for `ttl`; `by` says who gave it (an
    /// answer of a `recover` hook marks the record recovered, which audits
    /// count). Returns [`Fenced::NotOwner`] (and changes nothing) when the
    /// completion's token no longer owns the record.
    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError>;

    /// Deletes the in-progress record so the key is free. Returns
    /// [`Fenced::NotOwner`] (and changes nothing) when `token` no longer owns it.
    async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError>;

    /// Extends the lease to `lease` from now. Returns [`Fenced::NotOwner`]
    /// (and changes nothing) when `token` no longer owns the record.
    ///
    /// The record's retention (`expires_at`) moves with it, keeping its
    /// distance from the lease's end (never moving back): an in-progress
    /// record counts as absent only once both its lease and its ttl have run
    /// out (rule 16), and a body that outlives its ttl under a renewed lease
    /// and then dies must be *taken over* (rule 20: the `recover` hook is
    /// asked), not replaced as if the key were free.
    async fn heartbeat(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError>;

    /// Starts a release that must not wait for the caller: used when a call is
    /// dropped mid-way (its future cancelled), also while its reservation was
    /// still in flight. It must not depend on the caller's runtime, which may be
    /// shutting down: implementations release at once when they can, or hand
    /// the release to something they own (the SQL stores' background releaser),
    /// and try again for a few seconds while `token` owns nothing yet (the
    /// reservation may land late). A release that cannot be made is logged and
    /// counted (`metrics::snapshot().release_failures`).
    fn release_detached(&self, identity: Identity, token: OwnerToken);

    /// Records a result without waiting for the caller: used when a call is
    /// dropped while its completion was under way (its body has already run,
    /// so freeing the key would let a retry run it again). Like
    /// [`release_detached`](Store::release_detached) it must not depend on the
    /// caller's runtime; it is fenced by `token` like
    /// [`complete`](Store::complete).
    fn complete_detached(&self, completion: Completion<'_>);

    /// Ends the lease of the in-progress record `token` owns, without waiting
    /// for the caller and without deleting the record: the next call takes
    /// it over at once (and asks its `recover` hook). Used when a call in a
    /// scope with a hook is dropped while its reservation is in flight: the
    /// record may be a takeover of an owner that died after its side effect,
    /// so it must not be released. Likewise for a call of a request whose
    /// answer this process holds unrecorded (the next takeover records it).
    /// Fenced by `token` like
    /// [`heartbeat`](Store::heartbeat); must not depend on the caller's
    /// runtime. The default does nothing: the lease then runs out by itself
    /// (a store written before this method existed); the built-in stores
    /// end it.
    fn end_lease_detached(&self, identity: Identity, token: OwnerToken) {
        let _ = (identity, token);
    }

    /// An operator's release (`idempotent release`): deletes the record if it
    /// is **in progress**, without presenting the owner's token, so a key
    /// stuck behind a record nobody will finish is free again. Never deletes
    /// a complete record ([`ForcedRelease::Complete`]). With
    /// `require_expired_lease`, a record whose lease is still live is left
    /// alone too ([`ForcedRelease::LeaseLive`]): its owner may be running.
    ///
    /// This bypasses fencing on purpose: if the owner is in fact alive, its
    /// completion is then refused (`LeaseLost`) and a retry runs the body
    /// again. It is for a person who has checked, not for code paths.
    async fn force_release(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError>;

    /// An operator's end of the lease `token` holds (`idempotent release
    /// --end-lease --even-if-running`): [`heartbeat`](Store::heartbeat) with
    /// a zero lease, fenced by the token. A store whose statement may go on
    /// waiting on the server for a record another open transaction holds
    /// after its caller gave up (PostgreSQL's autocommit writes) bounds that
    /// wait on the server instead, and answers
    /// an error that says so: a lease the operator was told was not ended is
    /// never ended later, once that transaction is over.
    async fn end_lease_for_operator(
        &self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<Fenced, StoreError> {
        self.heartbeat(identity, token, Duration::ZERO).await
    }

    /// Waits, after [`reserve`](Store::reserve) found the record of `identity`
    /// in progress, until the record may have changed (completed, released,
    /// its lease ended) or `max_wait` has passed; the caller then reserves
    /// again. Returning early is always allowed: the caller re-checks.
    ///
    /// `round` counts this call's earlier waits (0 for the first). The
    /// default polls: it sleeps [`polling_backoff`]`(round)`, at most
    /// `max_wait`. Stores that learn of changes (PostgreSQL's `LISTEN/NOTIFY`,
    /// the in-process notification of the memory, SQLite and MySQL stores) return
    /// as soon as the record changes, and poll only as a fallback.
    async fn wait_for_change(&self, identity: &Identity, max_wait: Duration, round: u32) {
        let _ = identity;
        tokio::time::sleep(polling_backoff(round).min(max_wait)).await
    }

    /// Waits until the work this store was handed for dropped calls is done
    /// (rule 14: the releases, lease ends and completions it finishes in the
    /// background, [`release_detached`](Store::release_detached) and the
    /// others), for at most `within`. Returns how many pieces of that work are
    /// still unfinished: 0 when all are done.
    ///
    /// Call it before the process exits. The SQL stores finish dropped calls on
    /// a background thread of their own; returning from `main` ends that thread
    /// with whatever it still holds, and those records then stay in progress
    /// until their lease runs out (a retry waits that long, or takes the record
    /// over). Calls made after this returns are served as usual.
    ///
    /// It waits for work already handed over: let the dropped calls be
    /// dropped first (await aborted tasks, or shut the serving runtime down
    /// with `shutdown_timeout` or by dropping it; `shutdown_background` does
    /// not wait for that). A release of a call dropped while its reservation
    /// was in flight is tried for about 9 s while it finds nothing (the
    /// reservation may still land), so give `within` that much when such
    /// drops are likely (on SQLite, on a multi-threaded runtime, the release
    /// first waits for that reservation to end: up to the busy timeout and
    /// the pool's `acquire_timeout` more). The default
    /// returns 0 at once: a store that finishes such work before
    /// `release_detached` returns (the memory store) has nothing to wait for.
    /// A store that wraps another must forward this call (as `Arc<S>` and
    /// `Box<S>` do), or the wrapped store's work is reported done.
    ///
    /// ```no_run
    /// # async fn serve() {}
    /// # async fn run() -> Result<(), idempotent_runtime::Error> {
    /// use idempotent_runtime::{SqliteStore, Store};
    /// use std::time::Duration;
    ///
    /// let store = SqliteStore::connect("sqlite://payments.db").await?;
    /// serve().await; // until a shutdown signal; in-flight calls are dropped
    /// let unfinished = store.finish_background_work(Duration::from_secs(10)).await;
    /// if unfinished > 0 {
    ///     eprintln!("{unfinished} dropped calls stay in progress until their lease runs out");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    async fn finish_background_work(&self, within: Duration) -> usize {
        let _ = within;
        0
    }

    /// Deletes up to `batch` expired records; returns how many were deleted.
    /// An in-progress record is deleted only when both its lease and its
    /// retention have run out.
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError>;

    /// Reads one record as it is now, without changing it (expired records
    /// included). Besides inspection, the engine reads the record with it
    /// after a reservation was refused as a fingerprint mismatch (to tell a
    /// record a newer version made, one still in progress, and one released
    /// meanwhile; at most three times for one call): implement it for real
    /// in a store of your own.
    async fn fetch(&self, identity: &Identity) -> Result<Option<RecordSnapshot>, StoreError>;

    /// Counts records per scope and state, for the audit. Sorted by scope.
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError>;
}

macro_rules! delegate_store {
    ($($ptr:ty),*) => {$(
        #[async_trait::async_trait]
        impl<S: Store + ?Sized> Store for $ptr {
            fn name(&self) -> &'static str { (**self).name() }
            fn max_result_bytes(&self) -> usize { (**self).max_result_bytes() }
            fn records_in_process_memory(&self) -> bool { (**self).records_in_process_memory() }
            fn database_id(&self) -> Option<&str> { (**self).database_id() }
            async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
                (**self).reserve(request).await
            }
            async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
                (**self).complete(completion).await
            }
            async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError> {
                (**self).release(identity, token).await
            }
            async fn heartbeat(&self, identity: &Identity, token: &OwnerToken, lease: Duration) -> Result<Fenced, StoreError> {
                (**self).heartbeat(identity, token, lease).await
            }
            fn release_detached(&self, identity: Identity, token: OwnerToken) {
                (**self).release_detached(identity, token)
            }
            fn complete_detached(&self, completion: Completion<'_>) {
                (**self).complete_detached(completion)
            }
            fn end_lease_detached(&self, identity: Identity, token: OwnerToken) {
                (**self).end_lease_detached(identity, token)
            }
            async fn force_release(&self, identity: &Identity, require_expired_lease: bool) -> Result<ForcedRelease, StoreError> {
                (**self).force_release(identity, require_expired_lease).await
            }
            async fn end_lease_for_operator(&self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError> {
                (**self).end_lease_for_operator(identity, token).await
            }
            async fn finish_background_work(&self, within: Duration) -> usize {
                (**self).finish_background_work(within).await
            }
            async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
                (**self).purge_expired(batch).await
            }
            async fn wait_for_change(&self, identity: &Identity, max_wait: Duration, round: u32) {
                (**self).wait_for_change(identity, max_wait, round).await
            }
            async fn fetch(&self, identity: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
                (**self).fetch(identity).await
            }
            async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
                (**self).scope_stats().await
            }
        }
    )*};
}
delegate_store!(std::sync::Arc<S>, Box<S>);

/// Turns whatever `store = <expr>` names into a `&dyn Store`: a store value,
/// a reference to one, an `Arc<S>` or an `Arc<dyn Store>`.
pub trait AsDynStore {
    /// The store as a trait object.
    fn as_dyn_store(&self) -> &dyn Store;
}

impl<S: Store> AsDynStore for S {
    fn as_dyn_store(&self) -> &dyn Store {
        self
    }
}

impl<'s> AsDynStore for dyn Store + 's {
    fn as_dyn_store(&self) -> &dyn Store {
        self
    }
}

/// The pause before the `round`-th re-check of a record found in progress,
/// for stores that cannot be told when a record changes: 5 ms, doubling
/// every round, at most 100 ms.
///
/// ```
/// use idempotent_runtime::store::polling_backoff;
/// use std::time::Duration;
/// assert_eq!(polling_backoff(0), Duration::from_millis(5));
/// assert_eq!(polling_backoff(1), Duration::from_millis(10));
/// assert_eq!(polling_backoff(40), Duration::from_millis(100));
/// ```
pub fn polling_backoff(round: u32) -> Duration {
    Duration::from_millis(5u64.saturating_mul(1u64 << round.min(16)).min(100))
}

/// `fut`, given at most `bound` of real time. A test runtime with a paused
/// clock moves its time on whenever every task waits, also on a database
/// (a SQLite worker thread, a socket): its timers fire in no real time. A
/// bound that runs out before it has passed in real time (such a clock's,
/// or a timer firing a little early) gets what is left of it, timed by a
/// thread on the real clock ([`on_the_real_clock`]).
pub(crate) async fn within_real_time<F: std::future::Future>(
    bound: Duration,
    fut: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let started = std::time::Instant::now();
    let mut fut = std::pin::pin!(fut);
    match tokio::time::timeout(bound, &mut fut).await {
        Ok(done) => Ok(done),
        Err(elapsed) => match bound.checked_sub(started.elapsed()) {
            Some(left) if !left.is_zero() => on_the_real_clock(left, fut).await,
            _ => Err(elapsed),
        },
    }
}

/// `fut`, given at most `bound` timed by a thread of its own on the real
/// clock, which no paused tokio clock moves (a purge's shutdown on a test
/// runtime waited for ever on a batch that never answered). The thread ends
/// with `fut`. Without a thread, `fut` is awaited unbounded.
async fn on_the_real_clock<F: std::future::Future>(
    bound: Duration,
    fut: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let (ran_out, elapsed) = tokio::sync::oneshot::channel::<()>();
    let timer = std::thread::Builder::new()
        .name("idempotent-real-time-bound".to_owned())
        .spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(bound) {
                let _ = ran_out.send(());
            }
        });
    if timer.is_err() {
        return Ok(fut.await);
    }
    let answer = tokio::select! {
        answer = fut => Ok(answer),
        Ok(()) = elapsed => Err(()),
    };
    drop(done);
    match answer {
        Ok(answer) => Ok(answer),
        // tokio's `Elapsed` has no constructor: a zero timeout makes one.
        Err(()) => tokio::time::timeout(Duration::ZERO, std::future::pending::<()>())
            .await
            .map(|()| unreachable!("a pending future never answers")),
    }
}

/// A connection of `pool` outside any transaction, for a store's own writes
/// (`first`, if given, is tried first). A pool shared with application code
/// may hand over a connection that code left inside a transaction it began
/// and never ended (a plain `BEGIN`, then an early return): a reservation or
/// a completion written there would be rolled back with it, and a retry
/// would run the body again. `left_open` asks the connection; one that is
/// left open is closed, which rolls that transaction back, with a warning,
/// and another taken, or, with [`IfLeftOpen::Refuse`], the write is refused.
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
pub(crate) async fn outside_any_transaction<DB: sqlx::Database, C: Pooled<DB>, F>(
    store: &'static str,
    operation: &'static str,
    pool: &sqlx::Pool<DB>,
    first: Option<C>,
    if_left_open: IfLeftOpen,
    left_open: F,
) -> Result<C, StoreError>
where
    F: for<'c> Fn(
        &'c mut DB::Connection,
    ) -> futures_util::future::BoxFuture<'c, Result<bool, StoreError>>,
{
    const LEFT_OPEN: &str = "the pool handed over a connection left inside a transaction that \
                             other code began and never ended (a BEGIN without COMMIT or ROLLBACK)";
    let mut next = first;
    for _ in 0..=pool.options().get_max_connections() {
        let mut conn = match next.take() {
            Some(conn) => conn,
            None => C::acquire(pool)
                .await
                .map_err(|e| StoreError::new(store, operation, e))?,
        };
        if !left_open(&mut conn).await? {
            return Ok(conn);
        }
        if if_left_open == IfLeftOpen::Refuse {
            return Err(StoreError::new(
                store,
                operation,
                format!(
                    "{LEFT_OPEN}; nothing was written. End transactions on the pool's \
                     connections before giving them back"
                ),
            ));
        }
        tracing::warn!(target: "idempotent", store,
            "{LEFT_OPEN}; closing it, which rolls that transaction back");
        conn.close_on_drop();
    }
    Err(StoreError::new(
        store,
        operation,
        "every connection the pool handed over was inside a transaction that other code began \
         and never ended; end transactions on the pool's connections (COMMIT or ROLLBACK) before \
         giving them back, or give the store a pool of its own",
    ))
}

/// A pooled connection as [`outside_any_transaction`] takes it: sqlx's own
/// (SQLite), or one closed if the call is dropped mid-statement (the server
/// stores, `server::ClosedIfDropped`).
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
pub(crate) trait Pooled<DB: sqlx::Database>:
    std::ops::DerefMut<Target = DB::Connection> + Send + Sized
{
    /// A connection of `pool`.
    fn acquire(
        pool: &sqlx::Pool<DB>,
    ) -> futures_util::future::BoxFuture<'_, Result<Self, sqlx::Error>>;
    /// Closes the connection when it is dropped.
    fn close_on_drop(&mut self);
}

#[cfg(feature = "sqlite")]
impl<DB: sqlx::Database> Pooled<DB> for sqlx::pool::PoolConnection<DB> {
    fn acquire(
        pool: &sqlx::Pool<DB>,
    ) -> futures_util::future::BoxFuture<'_, Result<Self, sqlx::Error>> {
        Box::pin(pool.acquire())
    }

    fn close_on_drop(&mut self) {
        sqlx::pool::PoolConnection::close_on_drop(self);
    }
}

/// What [`outside_any_transaction`] does with a connection left open.
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IfLeftOpen {
    /// Close it (rolling its transaction back) and take another.
    Close,
    /// Refuse the write: closing the connection would lose more (the last
    /// connection to an in-memory SQLite database takes the database).
    Refuse,
}

/// The most records one purge statement of a SQL store deletes.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const PURGE_CHUNK: u32 = 500;

/// How long one purge statement (at most 500 records, a few ms
/// when the database answers) may go unanswered before the purge gives up.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub const PURGE_CHUNK_TIMEOUT: Duration = Duration::from_secs(60);

/// Purges up to `batch` records with `delete(n)` (one statement deleting at
/// most `n`, in its own short transaction), [`PURGE_CHUNK`] at a time, until
/// `batch` are gone or a statement finds fewer than it asked for. A purge
/// holds the rows it deletes locked until its statement commits; one
/// statement for a large batch would hold thousands of expired records at
/// once, and a reservation of one of them would wait behind it and answer
/// `InProgress` for a record nobody is running.
///
/// A statement that has not answered after [`PURGE_CHUNK_TIMEOUT`] (a
/// stalled server, a lock on the whole table) ends the purge with an error:
/// a purge job, the command line and a purger's shutdown never wait for ever.
/// The statement is abandoned with its connection; what it deletes is only
/// ever expired.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) async fn purge_in_chunks<F, Fut>(
    store: &'static str,
    batch: u32,
    delete: F,
) -> Result<u64, StoreError>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<u64, StoreError>>,
{
    purge_in_chunks_within(PURGE_CHUNK_TIMEOUT, store, batch, delete).await
}

/// [`purge_in_chunks`], a statement given at most `bound`.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
async fn purge_in_chunks_within<F, Fut>(
    bound: Duration,
    store: &'static str,
    batch: u32,
    mut delete: F,
) -> Result<u64, StoreError>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<u64, StoreError>>,
{
    let (mut deleted, mut left) = (0u64, batch);
    while left > 0 {
        let chunk = left.min(PURGE_CHUNK);
        let gone = within_real_time(bound, delete(chunk))
            .await
            .map_err(|_| {
                StoreError::new(
                    store,
                    "purge expired records",
                    format!(
                        "a statement deleting at most {chunk} records had no answer after {:?}: the \
                         database is stalled, or a lock holds the records table (a long transaction, \
                         LOCK TABLE); the purge stops here and the next run tries again",
                        bound
                    ),
                )
            })??;
        // Committed: counted now, also if a later statement fails or the
        // purge is cut off.
        crate::purge::deleted_for_good(gone);
        deleted = deleted.saturating_add(gone);
        if gone < u64::from(chunk) {
            break;
        }
        left -= chunk;
    }
    Ok(deleted)
}

/// Whether two stores or connections whose databases are named `a` and `b`
/// ([`Store::database_id`]) may keep their records in one database: the
/// same text, or a database not known on either side (`None`: a store or a
/// connection that cannot name its database may be on any). For the checks
/// whose safe side is to take two for one: a transaction refused beside an
/// owner it may keep from writing, an HTTP layer passing a request through
/// to an enclosing one. An answer held unrecorded is matched exactly
/// instead (`unrecorded`): recorded in another database, it would answer a
/// request it is not the answer of.
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "http"
))]
pub(crate) fn may_be_one_database(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// What reading [`Store::database_id`] is called in a SQL store's errors
/// (when it opens, and in transactional mode).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const READ_DATABASE_ID: &str = "read which database the records are in";

/// [`Store::database_id`] as a SQL store read it when it opened, from
/// `read`. A session the database refuses the read to for want of a
/// privilege (`refused`: an account granted `SELECT` on the records and the
/// migration history only, as the command line's `audit` and `inspect` may
/// be, or an application role granted the records table alone) opens all
/// the same, naming no database: its answers held unrecorded are then
/// matched by the store's kind alone, and it is said so once, here (not to
/// the command line, which holds no answers). Any other failure fails the
/// open, as every other statement of it does: a store that opened on a
/// passing fault naming no database would go on so for the life of the
/// process.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) fn database_id_read_at_open(
    store: &'static str,
    read: Result<Option<String>, sqlx::Error>,
    refused: impl FnOnce(&dyn sqlx::error::DatabaseError) -> bool,
) -> Result<Option<std::sync::Arc<str>>, StoreError> {
    match read {
        Ok(id) => Ok(id.map(std::sync::Arc::from)),
        Err(sqlx::Error::Database(e)) if refused(&*e) => {
            if !migrate::only_check() {
                tracing::warn!(target: "idempotent", store, error = %e,
                    "may not read which database the records are in (idempotency_database); \
                     answers this process holds unrecorded are matched by the store's kind \
                     alone: grant SELECT on idempotency_database to tell two databases apart");
            }
            Ok(None)
        }
        Err(e) => Err(StoreError::new(store, READ_DATABASE_ID, e)),
    }
}

/// Milliseconds as a `Duration`, negative values as zero.
pub(crate) fn millis_to_duration(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}

/// The longest duration [`duration_to_millis`] gives, in ms (2^60 ms, about
/// 36 million years): far enough to mean "forever", small enough that
/// `now + duration` never overflows a 64-bit integer in Rust or in SQL.
pub const MAX_DURATION_MILLIS: i64 = 1 << 60;

/// A duration as whole milliseconds for SQL, saturating at
/// [`MAX_DURATION_MILLIS`] so that `now + duration` cannot overflow.
///
/// ```
/// use idempotent_runtime::store::{duration_to_millis, MAX_DURATION_MILLIS};
/// use std::time::Duration;
/// assert_eq!(duration_to_millis(Duration::from_secs(2)), 2_000);
/// assert_eq!(duration_to_millis(Duration::MAX), MAX_DURATION_MILLIS);
/// ```
pub fn duration_to_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis())
        .unwrap_or(i64::MAX)
        .min(MAX_DURATION_MILLIS)
}

/// What a [`Store::force_release`] that deleted nothing answers, from a read
/// of the record made right after.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) fn refused_release(snapshot: Option<RecordSnapshot>) -> ForcedRelease {
    match snapshot {
        None => ForcedRelease::Absent,
        Some(s) if s.state == RecordState::Complete => ForcedRelease::Complete,
        Some(s) => ForcedRelease::LeaseLive {
            lease_remaining: millis_to_duration(
                s.lease_expires_at_ms.unwrap_or(s.now_ms) - s.now_ms,
            ),
        },
    }
}

/// What an operator's [`Store::force_release`] is called in a SQL store's errors.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const OPERATOR_RELEASE: &str = "release a record for an operator";

/// What an operator's [`Store::end_lease_for_operator`] is called in a SQL
/// store's errors.
#[cfg(feature = "postgres")]
pub(crate) const OPERATOR_END_LEASE: &str = "end a record's lease for an operator";

/// What [`Store::scope_stats`] is called in a SQL store's errors.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const COUNT_PER_SCOPE: &str = "count records per scope";

/// How long an operator's [`Store::force_release`] (and, on PostgreSQL,
/// [`Store::end_lease_for_operator`]) waits for a record another
/// transaction holds (a transactional-mode call in progress) before it says
/// so, instead of waiting for that transaction to end.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) const OPERATOR_LOCK_WAIT: Duration = Duration::from_secs(1);

/// What a [`Store::force_release`] answers when another open transaction
/// held the record past [`OPERATOR_LOCK_WAIT`].
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn held_by_a_transaction(store: &'static str, operation: &'static str) -> StoreError {
    StoreError::new(
        store,
        operation,
        "the record is held by another open transaction (a transactional-mode call in \
         progress, or its caller has not committed yet), so it cannot be released (nor its \
         lease ended) now: retry once that transaction has ended (`inspect` shows the record as it stands)",
    )
}

/// Whether two fingerprints contradict each other: only when both exist and differ.
pub fn fingerprints_conflict(stored: Option<&str>, incoming: Option<&str>) -> bool {
    matches!((stored, incoming), (Some(a), Some(b)) if a != b)
}

#[cfg(all(test, any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
mod tests {
    use super::{purge_in_chunks, Reservation, StoredOutcome, PURGE_CHUNK};
    use std::cell::RefCell;

    /// A store opens naming no database only when the database refused the
    /// read of its id for want of a privilege: any other failure (a fault
    /// that passes, a statement the database rejects for another reason)
    /// fails the open, or the store would name no database for the life of
    /// the process and match held answers by its kind alone.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_database_id_read_that_fails_but_for_a_privilege_fails_the_open() {
        use sqlx::Connection as _;
        let read = super::database_id_read_at_open(
            "postgres",
            Ok(Some("id/db/public".to_owned())),
            |_| true,
        )
        .expect("read");
        assert_eq!(read.as_deref(), Some("id/db/public"));
        assert!(
            super::database_id_read_at_open("postgres", Err(sqlx::Error::PoolTimedOut), |_| true)
                .is_err(),
            "not an answer of the database: fails the open"
        );
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .expect("connection");
        const READ: &str = "SELECT id FROM no_such_table";
        let not_refused = sqlx::query_scalar::<_, String>(READ)
            .fetch_optional(&mut conn)
            .await;
        assert!(matches!(not_refused, Err(sqlx::Error::Database(_))));
        assert!(
            super::database_id_read_at_open("sqlite", not_refused, |_| false).is_err(),
            "rejected for another reason than a privilege: fails the open"
        );
        let refused = sqlx::query_scalar::<_, String>(READ)
            .fetch_optional(&mut conn)
            .await;
        let refused = super::database_id_read_at_open("sqlite", refused, |_| true)
            .expect("refused for want of a privilege: opens");
        assert_eq!(refused, None, "naming no database");
    }

    /// A bound that a paused clock runs out early is timed on the real
    /// clock: a future that never answers is still given up (purge hunt: a
    /// purger's shutdown on a paused test runtime waited for ever).
    #[test]
    fn a_bound_holds_on_a_paused_clock() {
        let (answered, answers) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()
                .expect("runtime");
            let both = runtime.block_on(async {
                let never = super::within_real_time(
                    std::time::Duration::from_millis(100),
                    std::future::pending::<()>(),
                )
                .await;
                let quick =
                    super::within_real_time(std::time::Duration::from_secs(60), async { 7 }).await;
                (never.is_err(), quick.ok())
            });
            let _ = answered.send(both);
        });
        let (never_given_up, quick) = answers
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("a 100 ms bound still waiting after 30 s of real time");
        assert!(never_given_up, "a future that never answers is given up");
        assert_eq!(quick, Some(7));
    }

    /// Rule 2: a recorded answer's `Debug` (logged with a record or a
    /// reservation) shows its size, never its bytes (logs hunt).
    #[test]
    fn a_recorded_answer_is_debugged_by_its_size() {
        let outcome = StoredOutcome {
            is_error: false,
            payload: br#""receipt for SECRET-KEY""#.to_vec(),
        };
        let shown = format!("{:?}", Reservation::Completed(outcome));
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(!shown.contains("101, 99"), "no bytes either: {shown}");
        assert!(shown.contains("payload_bytes: 24"), "{shown}");
    }

    /// Runs `purge_in_chunks(batch)` against a table of `expired` records;
    /// answers what was deleted and the size of each statement.
    async fn purge(batch: u32, expired: u64) -> (u64, Vec<u32>) {
        let asked = RefCell::new(Vec::new());
        let left = RefCell::new(expired);
        let deleted = purge_in_chunks("test", batch, |n| {
            asked.borrow_mut().push(n);
            let gone = u64::from(n).min(*left.borrow());
            *left.borrow_mut() -= gone;
            async move { Ok(gone) }
        })
        .await
        .expect("no error");
        (deleted, asked.into_inner())
    }

    #[tokio::test]
    async fn a_large_purge_runs_as_statements_of_at_most_one_chunk() {
        let c = PURGE_CHUNK;
        assert_eq!(
            purge(2 * c + 7, 10 * u64::from(c)).await,
            (u64::from(2 * c + 7), vec![c, c, 7])
        );
        // Stops at the first statement that finds fewer than it asked for.
        assert_eq!(
            purge(u32::MAX, u64::from(c) + 3).await,
            (u64::from(c) + 3, vec![c, c])
        );
        assert_eq!(purge(3, 100).await, (3, vec![3]));
        assert_eq!(purge(0, 100).await, (0, vec![]));
        assert_eq!(purge(c, 0).await, (0, vec![c]));
    }

    /// A statement the database never answers ends the purge, after its
    /// bound of real time (here a short one), with an error that says why.
    #[tokio::test]
    async fn a_statement_that_never_answers_ends_the_purge() {
        let answer = super::purge_in_chunks_within(
            std::time::Duration::from_millis(50),
            "test",
            u32::MAX,
            |_| std::future::pending(),
        )
        .await;
        let e = answer.expect_err("gives up");
        assert!(e.to_string().contains("stalled"), "{e}");
    }

    /// A paused test clock moves on while a statement runs on a worker
    /// thread: its bound passing in no real time is not the database's
    /// silence, and the statement is waited for.
    #[tokio::test(start_paused = true)]
    async fn a_paused_clock_does_not_cut_a_statement_short() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let _ = tx.send(());
        });
        let mut rx = Some(rx);
        let deleted = purge_in_chunks("test", 10, |n| {
            let rx = rx.take();
            async move {
                if let Some(rx) = rx {
                    let _ = rx.await;
                }
                Ok(u64::from(n) - 1)
            }
        })
        .await
        .expect("waited for");
        assert_eq!(deleted, 9);
    }

    #[tokio::test]
    async fn a_failing_statement_ends_the_purge_with_its_error() {
        let calls = RefCell::new(0);
        let answer = purge_in_chunks("test", u32::MAX, |n| {
            *calls.borrow_mut() += 1;
            let first = *calls.borrow() == 1;
            async move {
                if first {
                    Ok(u64::from(n))
                } else {
                    Err(crate::error::StoreError::new("test", "purge", "down"))
                }
            }
        })
        .await;
        assert!(answer.is_err());
        assert_eq!(*calls.borrow(), 2);
    }
}
