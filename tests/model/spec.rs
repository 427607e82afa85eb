//! The reference model: DESIGN.md §4 (rules 3–16) for one identity, as plain
//! data with no clock. Time is abstracted to the only two durations the
//! operations use: `Zero` (run out by the next statement, on the store's clock)
//! and `Long` (never runs out during a test). So "has the lease run out" and
//! "has the ttl run out" are booleans the model knows exactly.
//!
//! Rules, per record:
//! * absent | in progress {owner, fingerprint, lease run out?, ttl run out?} |
//!   complete {outcome, fingerprint, ttl run out?}.
//! * Expired = complete with its ttl run out, or in progress with both its
//!   lease and its ttl run out (rule 16). An expired record counts as absent.
//! * reserve: absent or expired → `Acquired { took_over: false, attempt: 1 }`,
//!   a fresh in-progress record with the request's token, fingerprint, lease
//!   and ttl.
//!   Otherwise (live): both fingerprints present and different →
//!   `FingerprintMismatch`, untouched (rules 7, 8; also for an in-progress
//!   record whose lease ran out). Complete → `Completed(outcome)` (rule 5).
//!   In progress with a live lease → `InProgress` (rule 4), also when its ttl
//!   ran out. In progress with its lease run out (ttl live) → taken over,
//!   `Acquired { took_over: true, attempt: n + 1 }` (rule 20: the record's
//!   attempt number counts takeovers): the request's token, fingerprint, lease
//!   and ttl replace the old ones (rule 10).
//! * complete / release / heartbeat succeed only for an in-progress record
//!   whose owner is the presented token (rule 10); otherwise they answer
//!   `false` and change nothing. The owner's token is honoured even after its
//!   lease (and ttl) ran out, as long as nobody took the record over. complete
//!   keeps the record's fingerprint and attempt number and sets the ttl from
//!   now (a recover hook's answer also marks it recovered); release deletes the
//!   record; heartbeat sets the lease from now and moves the retention with
//!   it (keeping their distance, never moving it back).
//! * purge deletes exactly the expired records (rule 16).

use std::time::Duration;

/// The duration that never runs out during a test.
pub const LONG: Duration = Duration::from_secs(3600);

/// A lease or ttl.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dur {
    /// Run out by the next statement (store clock).
    Zero,
    /// One hour: never runs out during a test.
    Long,
}

impl Dur {
    pub fn duration(self) -> Duration {
        match self {
            Dur::Zero => Duration::ZERO,
            Dur::Long => LONG,
        }
    }

    fn runs_out(self) -> bool {
        self == Dur::Zero
    }

    /// In units of [`LONG`]: 0 (run out by the next statement) or 1.
    fn units(self) -> i8 {
        match self {
            Dur::Zero => 0,
            Dur::Long => 1,
        }
    }
}

/// A request's fingerprint: none, or one of two distinct values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp {
    Nil,
    A,
    B,
}

/// Rule 8: a conflict needs two fingerprints that differ.
pub fn conflict(stored: Fp, incoming: Fp) -> bool {
    stored != Fp::Nil && incoming != Fp::Nil && stored != incoming
}

/// A recorded outcome. Its `Debug` form is the Rust that builds it (`out(..)`),
/// so a printed counterexample pastes into a regression test.
#[derive(Clone, PartialEq, Eq)]
pub struct Outcome {
    pub is_error: bool,
    pub payload: Vec<u8>,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "out({}, &{:?})", self.is_error, self.payload)
    }
}

/// Builds an [`Outcome`] (for regression tests).
pub fn out(is_error: bool, payload: &[u8]) -> Outcome {
    Outcome {
        is_error,
        payload: payload.to_vec(),
    }
}

/// What the model expects a reservation to answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// `took_over` is `attempt > 1`.
    Acquired {
        attempt: u32,
    },
    Completed(Outcome),
    /// Any positive `lease_remaining` of at most [`LONG`].
    InProgress,
    Mismatch,
}

/// One identity's record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rec {
    Absent,
    InProgress {
        owner: String,
        fp: Fp,
        lease_expired: bool,
        ttl_expired: bool,
        /// Where the lease and the retention end, in units of [`LONG`] from
        /// the statements' common "now" (≤ 0: run out). A renewal moves the
        /// retention with the lease (`Store::heartbeat`), so the model keeps
        /// the two ends, not only whether they ran out.
        lease_end: i8,
        retention_end: i8,
        /// Rule 20: 1, +1 per takeover.
        attempt: u32,
    },
    Complete {
        outcome: Outcome,
        fp: Fp,
        ttl_expired: bool,
        /// The attempt that completed it.
        attempt: u32,
        /// Completed with `AnsweredBy::RecoverHook`.
        recovered: bool,
    },
}

impl Rec {
    /// Rule 16: past retention, and for an in-progress record past its lease too.
    pub fn expired(&self) -> bool {
        match self {
            Rec::Absent => false,
            Rec::InProgress {
                lease_expired,
                ttl_expired,
                ..
            } => *lease_expired && *ttl_expired,
            Rec::Complete { ttl_expired, .. } => *ttl_expired,
        }
    }

    /// A record that is there and counts (not absent, not expired).
    pub fn live(&self) -> bool {
        *self != Rec::Absent && !self.expired()
    }

    pub fn fp(&self) -> Fp {
        match self {
            Rec::Absent => Fp::Nil,
            Rec::InProgress { fp, .. } | Rec::Complete { fp, .. } => *fp,
        }
    }

    /// The record's attempt number (0 when absent).
    pub fn attempt(&self) -> u32 {
        match self {
            Rec::Absent => 0,
            Rec::InProgress { attempt, .. } | Rec::Complete { attempt, .. } => *attempt,
        }
    }

    /// The current owner's token (in progress only).
    pub fn owner(&self) -> Option<&str> {
        match self {
            Rec::InProgress { owner, .. } => Some(owner),
            _ => None,
        }
    }

    /// Rules 3–8, 10, 16.
    pub fn reserve(&mut self, token: &str, fp: Fp, lease: Dur, ttl: Dur) -> Answer {
        let fresh = |attempt: u32| Rec::InProgress {
            owner: token.to_owned(),
            fp,
            lease_expired: lease.runs_out(),
            ttl_expired: ttl.runs_out(),
            lease_end: lease.units(),
            retention_end: ttl.units(),
            attempt,
        };
        if !self.live() {
            *self = fresh(1);
            return Answer::Acquired { attempt: 1 };
        }
        if conflict(self.fp(), fp) {
            return Answer::Mismatch;
        }
        match self {
            Rec::Complete { outcome, .. } => Answer::Completed(outcome.clone()),
            Rec::InProgress {
                lease_expired: false,
                ..
            } => Answer::InProgress,
            _ => {
                let attempt = self.attempt() + 1;
                *self = fresh(attempt);
                Answer::Acquired { attempt }
            }
        }
    }

    /// Rules 10, 12, 16 (and 20: `recovered` for a recover hook's answer).
    pub fn complete(&mut self, token: &str, outcome: &Outcome, ttl: Dur, recovered: bool) -> bool {
        if self.owner() != Some(token) {
            return false;
        }
        *self = Rec::Complete {
            outcome: outcome.clone(),
            fp: self.fp(),
            ttl_expired: ttl.runs_out(),
            attempt: self.attempt(),
            recovered,
        };
        true
    }

    /// Rules 10, 13.
    pub fn release(&mut self, token: &str) -> bool {
        if self.owner() != Some(token) {
            return false;
        }
        *self = Rec::Absent;
        true
    }

    /// Rules 9, 10.
    pub fn heartbeat(&mut self, token: &str, lease: Dur) -> bool {
        match self {
            Rec::InProgress {
                owner,
                lease_expired,
                ttl_expired,
                lease_end,
                retention_end,
                ..
            } if owner == token => {
                // The retention keeps its distance from the lease's end, and
                // never moves back.
                let distance = *retention_end - *lease_end;
                *lease_end = lease.units();
                *retention_end = (*retention_end).max(*lease_end + distance);
                *lease_expired = *lease_end <= 0;
                *ttl_expired = *retention_end <= 0;
                true
            }
            _ => false,
        }
    }

    /// Rule 16: deletes the record when it is expired; says whether it did.
    pub fn purge(&mut self) -> bool {
        let doomed = self.expired();
        if doomed {
            *self = Rec::Absent;
        }
        doomed
    }
}
