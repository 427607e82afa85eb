//! Uncertain outcomes (DESIGN.md rule 20): what a `recover` hook is told when
//! a call takes over a record whose previous owner's lease ran out, and what
//! it answers.
//!
//! A takeover means the previous attempt started and never finished: its
//! process crashed, paused or lost the store. It may have charged the card
//! and died before recording it. Running the body again is a blind retry;
//! `#[idempotent(..., recover = path)]` asks `path` first:
//!
//! ```
//! use idempotent_runtime::{idempotent, Error, MemoryStore, Recovery, Takeover};
//! # use serde::{Deserialize, Serialize};
//! # #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)] struct Receipt { charge_id: String }
//! # struct Gateway;
//! # impl Gateway { async fn find_charge(&self, _key: &str) -> Result<Option<Receipt>, Error> { Ok(None) } }
//! # static GATEWAY: Gateway = Gateway;
//!
//! /// Asks the payment provider, by our idempotency key, whether the charge happened.
//! async fn charge_happened(takeover: &Takeover) -> Result<Recovery<Receipt>, Error> {
//!     match GATEWAY.find_charge(takeover.key()).await? {
//!         Some(receipt) => Ok(Recovery::Completed(receipt)), // record it; the body does not run
//!         None => Ok(Recovery::Run),                         // it did not: charge now
//!     }
//! }
//!
//! #[idempotent(scope = "docs.recover", key = key, tenant = account, store = store,
//!              recover = charge_happened)]
//! async fn charge(store: &MemoryStore, account: &str, key: &str, cents: u64) -> Result<Receipt, Error> {
//!     Ok(Receipt { charge_id: format!("ch_{cents}") })
//! }
//! ```
//!
//! The hook is called when, and only when, a call takes over a record whose
//! previous owner's lease expired, before the body runs: never on a fresh
//! reservation, a replay, a refusal, or after a release. It runs under the
//! call's lease (renewed by the heartbeat, like the body). Its answer decides
//! the call:
//!
//! | the hook returns | the body | the record | the caller gets | `with_outcome` |
//! |---|---|---|---|---|
//! | `Ok(Recovery::Run)` | runs, as attempt `n` | as for any call | the body's result | `Executed` |
//! | `Ok(Recovery::Completed(v))` | does not run | `v` is recorded (marked recovered) | `Ok(v)` | `Recovered` |
//! | `Err(e)`, recorded by `errors = ...` | does not run | `e` is recorded | `Err(e)` | `Recovered` |
//! | `Err(e)`, not recorded (`errors = release`) | does not run | **kept** in progress, its lease ended at once | `Err(e)` | `Recovered` |
//!
//! The last row differs from a body's released error on purpose: releasing
//! would delete the record, and the next call would run the body as a fresh
//! attempt 1, without asking: the blind retry the hook exists to prevent. The
//! record is kept, so the next call takes it over (attempt `n + 1`) and asks
//! the hook again. A hook that panics, or a call dropped while its hook runs,
//! leaves the record the same way (for a dropped call the store's
//! background worker ends the lease, at once: the next call does not wait
//! for it to run out).
//!
//! Without `recover`, a takeover runs the body again, as before; every
//! takeover is logged (warn, with its attempt number) and counted
//! (`idempotent_takeovers_total`, labelled by scope and attempt).

use crate::identity::Identity;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What a `recover` hook is told about a takeover: whose record it is, which
/// attempt this is, and when the previous attempt started.
///
/// Its `Debug` form leaves the raw key out (keys can be guessable secrets);
/// [`key`](Takeover::key) gives it to the hook, which may need it to ask a
/// provider what happened.
#[derive(Clone, PartialEq, Eq)]
pub struct Takeover {
    identity: Identity,
    attempt: u32,
    previous_attempt_started_at_ms: i64,
}

impl Takeover {
    /// A takeover of `identity` as attempt `attempt` (at least 2), whose
    /// previous attempt started at `previous_attempt_started_at`. The engine
    /// makes these; the constructor is public so hooks can be unit-tested.
    ///
    /// ```
    /// use idempotent_runtime::{Identity, Takeover};
    /// use std::time::{Duration, UNIX_EPOCH};
    /// let id = Identity::new("acct_1", "payments.charge", "key-1").unwrap();
    /// let t = Takeover::new(id, 2, UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    /// assert_eq!((t.tenant(), t.scope(), t.key(), t.attempt()), ("acct_1", "payments.charge", "key-1", 2));
    /// assert!(!format!("{t:?}").contains("key-1"));
    /// ```
    pub fn new(identity: Identity, attempt: u32, previous_attempt_started_at: SystemTime) -> Self {
        let ms = previous_attempt_started_at
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Takeover {
            identity,
            attempt: attempt.max(2),
            previous_attempt_started_at_ms: ms,
        }
    }

    pub(crate) fn from_store(
        identity: Identity,
        attempt: u32,
        previous_attempt_started_at_ms: i64,
    ) -> Self {
        Takeover {
            identity,
            attempt: attempt.max(2),
            previous_attempt_started_at_ms,
        }
    }

    /// Whose key this is: the `tenant = ...` value (the empty string for
    /// `tenant = shared`).
    pub fn tenant(&self) -> &str {
        &self.identity.tenant
    }

    /// The scope, e.g. `payments.charge`.
    pub fn scope(&self) -> &str {
        &self.identity.scope
    }

    /// The client's idempotency key, as given to the call. Pass it to a
    /// provider that deduplicates by it; do not log it (use
    /// [`key_digest`](Takeover::key_digest)).
    pub fn key(&self) -> &str {
        &self.identity.key
    }

    /// The whole identity.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The short digest of the identity the framework's logs carry.
    pub fn key_digest(&self) -> String {
        self.identity.key_digest()
    }

    /// Which attempt this call is: 2 for the first takeover, counting up with
    /// every further one. Kept in the record, so it survives restarts and
    /// process boundaries.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// When the previous attempt (the one taken over) started, on the store's
    /// clock (the database's, for SQL stores).
    pub fn previous_attempt_started_at(&self) -> SystemTime {
        UNIX_EPOCH
            + Duration::from_millis(u64::try_from(self.previous_attempt_started_at_ms).unwrap_or(0))
    }

    /// The same, in milliseconds since the Unix epoch.
    pub fn previous_attempt_started_at_ms(&self) -> i64 {
        self.previous_attempt_started_at_ms
    }
}

impl std::fmt::Debug for Takeover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Takeover")
            .field("tenant", &self.identity.tenant)
            .field("scope", &self.identity.scope)
            .field("key_digest", &self.identity.key_digest())
            .field("attempt", &self.attempt)
            .field(
                "previous_attempt_started_at_ms",
                &self.previous_attempt_started_at_ms,
            )
            .finish()
    }
}

/// A `recover` hook's answer: run the body, or the work was already done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery<T> {
    /// The previous attempt did not produce the side effect (or producing it
    /// again is safe): run the body as usual.
    Run,
    /// The previous attempt did the work and this is its result: record it
    /// and return it; the body does not run.
    Completed(T),
}
