//! What the engine did, for operators: metrics through the [`metrics`] crate
//! facade, and process-wide counters ([`snapshot`]).
//!
//! # Metrics (the `metrics` facade)
//!
//! The runtime reports through the [`metrics`](https://docs.rs/metrics) facade,
//! so the exporter is the application's choice: install a recorder
//! (`metrics-exporter-prometheus`, an OpenTelemetry or StatsD bridge, ...)
//! once at startup and these appear; without one, every update is a no-op.
//! Labels are the scope and an outcome (or the store), **never** a key or a
//! tenant: label values stay few, and keys, which can be guessable secrets,
//! never reach a metrics backend.
//!
//! | name | kind | labels | what it counts |
//! |---|---|---|---|
//! | `idempotent_calls_total` | counter | `scope`, `outcome` | calls, by what the caller got (below) |
//! | `idempotent_takeovers_total` | counter | `scope`, `attempt` | takeovers of an expired lease (rule 20); `attempt` is `2`, `3`, `4` or `5+` |
//! | `idempotent_heartbeat_failures_total` | counter | `scope` | lease renewals that failed (store error, or the lease was lost) or did not answer within their period (`lease / 3`) |
//! | `idempotent_lease_lapses_total` | counter | `scope` | leases that ran out while the body ran, before a renewal was written (the body blocked its thread, its runtime was starved, renewals failed): another caller could have taken the record over meanwhile |
//! | `idempotent_purged_total` | counter | `store` | expired records deleted by purges |
//! | `idempotent_release_failures_total` | counter | `store` | dropped calls whose record could not be finished: released, recorded (the body had answered) or its lease ended |
//! | `idempotent_reserve_duration_seconds` | histogram | `scope`, `outcome` | how long the reservation took, waits for a running duplicate included |
//! | `idempotent_body_duration_seconds` | histogram | `scope`, `outcome` | how long the body ran; `outcome` is `ok`, `err` or `panic` |
//!
//! `outcome` of `idempotent_calls_total`, one per call:
//!
//! | outcome | the caller got |
//! |---|---|
//! | `executed` | the body's result (recorded, or a released error) |
//! | `replayed` | a recorded result (or recorded error) |
//! | `recovered` | the `recover` hook's answer (rule 20): the body did not run |
//! | `mismatch` | `Error::FingerprintMismatch` |
//! | `in_progress` | `Error::InProgress` (refused, or waited its bound) |
//! | `lease_lost` | `Error::LeaseLost`: the body ran, its result was not recorded (a `recover` hook's answer that lost the record counts as `failed`) |
//! | `failed` | another idempotency error: the store failed, the key was invalid, the result could not be recorded, a recorded answer no longer decodes (`Error::ReplayDecoding`), ... |
//!
//! `outcome` of `idempotent_reserve_duration_seconds`: `acquired`,
//! `took_over`, `replayed`, `in_progress`, `mismatch` or `error`.
//!
//! A rising `idempotent_takeovers_total` with `attempt="3"` or more is
//! repeated uncertainty: the same keys keep being taken over (a body that
//! outlives its lease, a crash loop, a `recover` hook that keeps failing).
//! `idempotent audit` shows which scopes hold such records, and
//! `idempotent inspect` one record's attempt.
//!
//! # Process-wide counters
//!
//! [`snapshot`] reads the same events as plain totals for the whole process,
//! without labels: handy in tests and for a quick log line.

use metrics::{Key, Label, Level, Metadata};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::Duration;

/// Counter: calls by scope and outcome.
pub const CALLS: &str = "idempotent_calls_total";
/// Counter: takeovers of an expired lease by scope and attempt.
pub const TAKEOVERS: &str = "idempotent_takeovers_total";
/// Counter: failed lease renewals (or ones unanswered within their period) by scope.
pub const HEARTBEAT_FAILURES: &str = "idempotent_heartbeat_failures_total";
/// Counter: leases that ran out while their body ran, by scope.
pub const LEASE_LAPSES: &str = "idempotent_lease_lapses_total";
/// Counter: records deleted by purges, by store.
pub const PURGED: &str = "idempotent_purged_total";
/// Counter: dropped calls whose record could not be released, by store.
pub const RELEASE_FAILURES: &str = "idempotent_release_failures_total";
/// Histogram (seconds): reservation time by scope and outcome.
pub const RESERVE_SECONDS: &str = "idempotent_reserve_duration_seconds";
/// Histogram (seconds): body time by scope and outcome.
pub const BODY_SECONDS: &str = "idempotent_body_duration_seconds";

/// What a call ended with, for `idempotent_calls_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub(crate) enum CallOutcome {
    Executed,
    Replayed,
    Recovered,
    Mismatch,
    InProgress,
    LeaseLost,
    Failed,
}

impl CallOutcome {
    /// Every outcome, in declaration order (`ALL[o as usize] == o`).
    const ALL: [CallOutcome; 7] = [
        CallOutcome::Executed,
        CallOutcome::Replayed,
        CallOutcome::Recovered,
        CallOutcome::Mismatch,
        CallOutcome::InProgress,
        CallOutcome::LeaseLost,
        CallOutcome::Failed,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Executed => "executed",
            CallOutcome::Replayed => "replayed",
            CallOutcome::Recovered => "recovered",
            CallOutcome::Mismatch => "mismatch",
            CallOutcome::InProgress => "in_progress",
            CallOutcome::LeaseLost => "lease_lost",
            CallOutcome::Failed => "failed",
        }
    }
}

/// Counts one call (the facade only; the process counters are counted where
/// the events happen, as before).
pub(crate) fn call(scope: &'static str, outcome: CallOutcome) {
    let key = &ScopeKeys::of(scope).calls[outcome as usize];
    metrics::with_recorder(|r| r.register_counter(key, &METADATA)).increment(1);
}

/// Counts a takeover of an expired lease as attempt `attempt`.
pub(crate) fn takeover(scope: &'static str, attempt: u32) {
    METRICS.taken_over.fetch_add(1, Ordering::Relaxed);
    let attempt = match attempt {
        0..=2 => "2",
        3 => "3",
        4 => "4",
        _ => "5+",
    };
    metrics::counter!(TAKEOVERS, "scope" => scope, "attempt" => attempt).increment(1);
}

/// Counts a failed heartbeat.
pub(crate) fn heartbeat_failed(scope: &'static str) {
    METRICS.heartbeat_failures.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(HEARTBEAT_FAILURES, "scope" => scope).increment(1);
}

/// Counts a lease that ran out while its body ran.
pub(crate) fn lease_lapsed(scope: &'static str) {
    METRICS.lease_lapses.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(LEASE_LAPSES, "scope" => scope).increment(1);
}

/// Counts purged records.
pub(crate) fn purged(store: &'static str, n: u64) {
    METRICS.purged.fetch_add(n, Ordering::Relaxed);
    metrics::counter!(PURGED, "store" => store).increment(n);
}

/// Counts a dropped call's record that a SQL store's background worker could
/// not finish (release, completion or end of lease).
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn release_failed(store: &'static str) {
    METRICS.release_failures.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(RELEASE_FAILURES, "store" => store).increment(1);
}

/// Records how long a reservation took.
pub(crate) fn reserve_time(scope: &'static str, outcome: &'static str, took: Duration) {
    match RESERVE_OUTCOMES.iter().position(|o| *o == outcome) {
        Some(i) => {
            let key = &ScopeKeys::of(scope).reserve[i];
            metrics::with_recorder(|r| r.register_histogram(key, &METADATA)).record(took);
        }
        None => metrics::histogram!(RESERVE_SECONDS, "scope" => scope, "outcome" => outcome)
            .record(took),
    }
}

/// Records how long a body ran.
pub(crate) fn body_time(scope: &'static str, outcome: &'static str, took: Duration) {
    match BODY_OUTCOMES.iter().position(|o| *o == outcome) {
        Some(i) => {
            let key = &ScopeKeys::of(scope).body[i];
            metrics::with_recorder(|r| r.register_histogram(key, &METADATA)).record(took);
        }
        None => {
            metrics::histogram!(BODY_SECONDS, "scope" => scope, "outcome" => outcome).record(took)
        }
    }
}

// ---------------------------------------------------------------- per-call keys

/// What `metrics::counter!` and `histogram!` would have passed from this
/// module (target and module path `idempotent_runtime::metrics`, level INFO).
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// The `outcome` labels of [`RESERVE_SECONDS`].
const RESERVE_OUTCOMES: [&str; 6] = [
    "acquired",
    "took_over",
    "replayed",
    "in_progress",
    "mismatch",
    "error",
];

/// The `outcome` labels of [`BODY_SECONDS`].
const BODY_OUTCOMES: [&str; 3] = ["ok", "err", "panic"];

/// The keys of one scope's per-call metrics, made the first time the scope
/// is seen and kept for the life of the process (one per scope name: a few
/// hundred bytes). The keys, with their hashes, are what the macros would
/// build on every call (same names, labels and label order), so a recorder
/// sees no difference; but nothing is allocated or hashed per call.
///
/// Only keys are kept, never handles: every update still asks the current
/// recorder (`metrics::with_recorder`), so a recorder installed after the
/// first calls (or a local one) gets every later update.
struct ScopeKeys {
    scope: &'static str,
    /// By `CallOutcome as usize`.
    calls: [Key; CallOutcome::ALL.len()],
    /// By position in [`RESERVE_OUTCOMES`].
    reserve: [Key; RESERVE_OUTCOMES.len()],
    /// By position in [`BODY_OUTCOMES`].
    body: [Key; BODY_OUTCOMES.len()],
}

impl ScopeKeys {
    fn of(scope: &'static str) -> &'static ScopeKeys {
        thread_local! {
            /// The keys this thread used last: a call's metrics, and most
            /// threads' calls, are of one scope after another.
            static LAST: Cell<Option<&'static ScopeKeys>> = const { Cell::new(None) };
        }
        let last = LAST.try_with(Cell::get).ok().flatten();
        if let Some(keys) = last.filter(|k| std::ptr::eq(k.scope, scope) || k.scope == scope) {
            return keys;
        }
        let keys = Self::shared(scope);
        let _ = LAST.try_with(|l| l.set(Some(keys)));
        keys
    }

    fn shared(scope: &'static str) -> &'static ScopeKeys {
        static ALL: RwLock<BTreeMap<&'static str, &'static ScopeKeys>> =
            RwLock::new(BTreeMap::new());
        let found = ALL
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(scope)
            .copied();
        if let Some(keys) = found {
            return keys;
        }
        let mut all = ALL.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        all.entry(scope)
            .or_insert_with(|| Box::leak(Box::new(ScopeKeys::new(scope))))
    }

    fn new(scope: &'static str) -> ScopeKeys {
        let key = |name: &'static str, outcome: &'static str| {
            let labels: &'static [Label] = Box::leak(Box::new([
                Label::from_static_parts("scope", scope),
                Label::from_static_parts("outcome", outcome),
            ]));
            Key::from_static_parts(name, labels)
        };
        ScopeKeys {
            scope,
            calls: CallOutcome::ALL.map(|o| key(CALLS, o.as_str())),
            reserve: RESERVE_OUTCOMES.map(|o| key(RESERVE_SECONDS, o)),
            body: BODY_OUTCOMES.map(|o| key(BODY_SECONDS, o)),
        }
    }
}

/// Declares the process-wide counters once, from [`Snapshot`]'s fields: the
/// `AtomicU64`s the engine bumps (`METRICS`), the plain copy [`snapshot`]
/// returns, and the reading of the one into the other. A counter added to
/// [`Snapshot`] is counted and read with no other place to remember.
macro_rules! process_counters {
    (
        $(#[$snapshot_meta:meta])*
        pub struct Snapshot {
            $($(#[$field_meta:meta])* pub $name:ident: u64,)*
        }
    ) => {
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub $name: AtomicU64,)*
        }

        pub(crate) static METRICS: Counters = Counters {
            $($name: AtomicU64::new(0),)*
        };

        $(#[$snapshot_meta])*
        pub struct Snapshot {
            $($(#[$field_meta])* pub $name: u64,)*
        }

        /// Reads the counters.
        pub fn snapshot() -> Snapshot {
            let m = &METRICS;
            let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
            Snapshot {
                $($name: r(&m.$name),)*
            }
        }
    };
}

process_counters! {
    /// A copy of the counters since the process started, without labels. For
    /// per-scope numbers, install a `metrics` recorder (see the module docs); a
    /// rising `heartbeat_failures`, `lease_lapses` or `lease_lost` means bodies
    /// outlive their leases, block their threads, or the store is struggling.
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
        /// Takeovers answered by a `recover` hook (`Recovery::Completed`, or an
        /// error): the body did not run.
        pub recovered: u64,
        /// Calls refused with `Error::InProgress`.
        pub refused_in_progress: u64,
        /// Calls refused with `Error::FingerprintMismatch`.
        pub mismatched: u64,
        /// A body's completions refused because the lease was lost (a recover
        /// hook's answer that lost its record is not counted: the body did not run).
        pub lease_lost: u64,
        /// Records taken over after their owner's lease expired.
        pub taken_over: u64,
        /// Successful lease renewals.
        pub heartbeats: u64,
        /// Failed lease renewals (store error or lease lost), and renewals that
        /// did not answer within their period (`lease / 3`).
        pub heartbeat_failures: u64,
        /// Leases that ran out while their body ran, before a renewal was
        /// written: the body blocked its thread, its runtime was starved, or
        /// renewals failed for a lease. Another caller could have taken the
        /// record over and run the body beside it; each is also logged.
        pub lease_lapses: u64,
        /// Records deleted by purges.
        pub purged: u64,
        /// Dropped calls whose record could not be finished by the store's
        /// background worker: released, recorded (the body had answered) or its
        /// lease ended (it stays in progress until its lease runs out); each is
        /// also logged.
        pub release_failures: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn outcomes_index_their_keys() {
        for (i, o) in CallOutcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
    }

    /// The cached keys are the keys the macros build on every call.
    #[test]
    fn cached_keys_are_the_macros_keys() {
        let keys = ScopeKeys::of("metrics.unit");
        let built = |name: &'static str, outcome: &'static str| {
            Key::from_parts(
                name,
                vec![
                    Label::new("scope", "metrics.unit"),
                    Label::new("outcome", outcome),
                ],
            )
        };
        for o in CallOutcome::ALL {
            let key = &keys.calls[o as usize];
            assert_eq!(*key, built(CALLS, o.as_str()));
            assert_eq!(key.get_hash(), built(CALLS, o.as_str()).get_hash());
        }
        for (i, o) in RESERVE_OUTCOMES.iter().enumerate() {
            assert_eq!(keys.reserve[i], built(RESERVE_SECONDS, o));
        }
        for (i, o) in BODY_OUTCOMES.iter().enumerate() {
            assert_eq!(keys.body[i], built(BODY_SECONDS, o));
        }
        // Another thread, and another string with the same text, find the same keys.
        let other: &'static str = Box::leak(String::from("metrics.unit").into_boxed_str());
        let again = std::thread::spawn(move || ScopeKeys::of(other) as *const ScopeKeys as usize)
            .join()
            .expect("thread");
        assert_eq!(again, keys as *const ScopeKeys as usize);
    }

    /// Remembers the keys registered with it.
    #[derive(Default)]
    struct Seen(Arc<Mutex<Vec<String>>>);

    impl metrics::Recorder for Seen {
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> metrics::Counter {
            self.note(key, metadata);
            metrics::Counter::noop()
        }
        fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> metrics::Gauge {
            self.note(key, metadata);
            metrics::Gauge::noop()
        }
        fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> metrics::Histogram {
            self.note(key, metadata);
            metrics::Histogram::noop()
        }
    }

    impl Seen {
        fn note(&self, key: &Key, metadata: &Metadata<'_>) {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            self.0.lock().expect("lock").push(format!(
                "{} {} {} {}",
                key.name(),
                labels.join(","),
                metadata.target(),
                if *metadata.level() == Level::INFO {
                    "INFO"
                } else {
                    "not INFO"
                }
            ));
        }
    }

    /// Keys made before a recorder exists still reach one installed later.
    #[test]
    fn a_recorder_installed_after_the_first_calls_sees_every_later_call() {
        call("metrics.late", CallOutcome::Executed);
        reserve_time("metrics.late", "acquired", Duration::from_millis(1));
        body_time("metrics.late", "ok", Duration::from_millis(1));
        let seen = Seen::default();
        let log = seen.0.clone();
        metrics::with_local_recorder(&seen, || {
            call("metrics.late", CallOutcome::Replayed);
            reserve_time("metrics.late", "replayed", Duration::from_millis(1));
            body_time("metrics.late", "err", Duration::from_millis(1));
        });
        let target = "idempotent_runtime::metrics";
        assert_eq!(
            *log.lock().expect("lock"),
            [
                format!("{CALLS} scope=metrics.late,outcome=replayed {target} INFO"),
                format!("{RESERVE_SECONDS} scope=metrics.late,outcome=replayed {target} INFO"),
                format!("{BODY_SECONDS} scope=metrics.late,outcome=err {target} INFO"),
            ]
        );
    }
}
