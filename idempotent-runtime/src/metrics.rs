//! Process-wide counters of what the engine did.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub executed: AtomicU64,
    pub replayed: AtomicU64,
    pub refused_in_progress: AtomicU64,
    pub mismatched: AtomicU64,
    pub lease_lost: AtomicU64,
    pub taken_over: AtomicU64,
    pub heartbeats: AtomicU64,
    pub heartbeat_failures: AtomicU64,
    pub purged: AtomicU64,
    pub release_failures: AtomicU64,
}

pub(crate) static METRICS: Counters = Counters {
    executed: AtomicU64::new(0),
    replayed: AtomicU64::new(0),
    refused_in_progress: AtomicU64::new(0),
    mismatched: AtomicU64::new(0),
    lease_lost: AtomicU64::new(0),
    taken_over: AtomicU64::new(0),
    heartbeats: AtomicU64::new(0),
    heartbeat_failures: AtomicU64::new(0),
    purged: AtomicU64::new(0),
    release_failures: AtomicU64::new(0),
};

/// A copy of the counters since the process started. Export them to your
/// metrics system periodically; a rising `heartbeat_failures` or `lease_lost`
/// means bodies outlive their leases or the store is struggling.
///
/// ```
/// let m = idempotent_runtime::metrics::snapshot();
/// assert!(m.executed >= m.executed.min(0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Snapshot {
    /// Bodies run to completion (successful or not).
    pub executed: u64,
    /// Calls answered from a recorded result.
    pub replayed: u64,
    /// Calls refused with `Error::InProgress`.
    pub refused_in_progress: u64,
    /// Calls refused with `Error::FingerprintMismatch`.
    pub mismatched: u64,
    /// Completions refused because the lease was lost.
    pub lease_lost: u64,
    /// Records taken over after their owner's lease expired.
    pub taken_over: u64,
    /// Successful lease renewals.
    pub heartbeats: u64,
    /// Failed lease renewals (store error or lease lost).
    pub heartbeat_failures: u64,
    /// Records deleted by purges.
    pub purged: u64,
    /// Dropped calls whose record could not be released (it stays reserved
    /// until its lease runs out); each is also logged.
    pub release_failures: u64,
}

/// Reads the counters.
pub fn snapshot() -> Snapshot {
    let m = &METRICS;
    let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
    Snapshot {
        executed: r(&m.executed),
        replayed: r(&m.replayed),
        refused_in_progress: r(&m.refused_in_progress),
        mismatched: r(&m.mismatched),
        lease_lost: r(&m.lease_lost),
        taken_over: r(&m.taken_over),
        heartbeats: r(&m.heartbeats),
        heartbeat_failures: r(&m.heartbeat_failures),
        purged: r(&m.purged),
        release_failures: r(&m.release_failures),
    }
}
