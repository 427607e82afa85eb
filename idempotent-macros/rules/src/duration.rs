//! Durations as the attribute and the manifest write them (`ttl = "24h"`,
//! `lease = "30s"`, `in_progress = wait("10s")`): parsed with `humantime`,
//! with one minimum per kind, and the defaults.

use std::fmt;
use std::time::Duration;

/// Retention of a completed record when neither the attribute nor the manifest says.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Lease of an in-progress record when neither the attribute nor the manifest says.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// How long a duplicate waits for the first call (`in_progress = wait(...)`) by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(10);

/// Which duration: decides the minimum and the wording of errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DurationKind {
    /// `ttl`: retention of a completed record. At least 1ms.
    Ttl,
    /// `lease`: renewed every lease/3 while the body runs. At least 10ms, so
    /// the heartbeat does not hammer the store. That floor is not a safe
    /// value: a lease must be far longer than a renewal can take on a loaded
    /// store, or a second caller takes the record over while the body runs.
    Lease,
    /// `wait(...)`: how long a duplicate waits. At least 1ms (zero is `reject`).
    Wait,
}

impl DurationKind {
    /// The shortest duration accepted.
    pub const fn minimum(self) -> Duration {
        match self {
            DurationKind::Ttl | DurationKind::Wait => Duration::from_millis(1),
            DurationKind::Lease => Duration::from_millis(10),
        }
    }

    /// The default when nothing is written.
    pub const fn default_value(self) -> Duration {
        match self {
            DurationKind::Ttl => DEFAULT_TTL,
            DurationKind::Lease => DEFAULT_LEASE,
            DurationKind::Wait => DEFAULT_WAIT,
        }
    }

    /// The name as written in the attribute: `ttl`, `lease`, `wait(...)`.
    pub const fn name(self) -> &'static str {
        match self {
            DurationKind::Ttl => "ttl",
            DurationKind::Lease => "lease",
            DurationKind::Wait => "wait(...)",
        }
    }

    fn example(self) -> &'static str {
        match self {
            DurationKind::Ttl => "ttl = \"24h\"",
            DurationKind::Lease => "lease = \"30s\"",
            DurationKind::Wait => "in_progress = wait(\"10s\")",
        }
    }
}

impl fmt::Display for DurationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`", self.name())
    }
}

/// Why a duration is refused. Each message says how to write it instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DurationError {
    /// Not a number with a unit.
    #[error("{kind} is not a duration: `{text}` ({reason}); write a number with a unit, e.g. {}", kind.example())]
    NotADuration {
        /// Which duration.
        kind: DurationKind,
        /// The text found.
        text: String,
        /// `humantime`'s explanation.
        reason: String,
    },
    /// Zero.
    #[error("{}", zero_message(*.kind))]
    Zero {
        /// Which duration.
        kind: DurationKind,
    },
    /// Shorter than [`DurationKind::minimum`].
    #[error("{kind} is {}, below the minimum of {}{}", humantime::format_duration(*.value), humantime::format_duration(*.minimum),
        if *.kind == DurationKind::Lease { " (the lease is renewed every lease/3; shorter leases would hammer the store)" } else { "" })]
    BelowMinimum {
        /// Which duration.
        kind: DurationKind,
        /// The duration written.
        value: Duration,
        /// The minimum for this kind.
        minimum: Duration,
    },
    /// More milliseconds than a store column holds.
    #[error(
        "{kind} is too long to be stored (more than u64::MAX milliseconds); write a shorter one"
    )]
    TooLong {
        /// Which duration.
        kind: DurationKind,
    },
}

fn zero_message(kind: DurationKind) -> String {
    match kind {
        DurationKind::Wait => {
            "`wait(...)` must be longer than zero; to refuse a duplicate at once, \
                               write `in_progress = reject`"
                .to_owned()
        }
        _ => format!("{kind} must be longer than zero, e.g. {}", kind.example()),
    }
}

/// Parses a duration like `"24h"`, `"30s"`, `"1h 30m"`, `"250ms"` and checks
/// the minimum for its kind.
///
/// ```
/// use idempotent_rules::duration::{parse_duration, DurationKind, DurationError};
/// use std::time::Duration;
/// assert_eq!(parse_duration("30s", DurationKind::Lease), Ok(Duration::from_secs(30)));
/// assert!(matches!(parse_duration("5ms", DurationKind::Lease), Err(DurationError::BelowMinimum { .. })));
/// ```
pub fn parse_duration(text: &str, kind: DurationKind) -> Result<Duration, DurationError> {
    let value =
        humantime::parse_duration(text.trim()).map_err(|e| DurationError::NotADuration {
            kind,
            text: text.to_owned(),
            reason: e.to_string(),
        })?;
    check_duration(value, kind)
}

/// Checks a duration given as a value (a builder's `.ttl(d)`, `.lease(d)`)
/// by the rules [`parse_duration`] applies to text: not zero, at least the
/// kind's minimum, and storable in milliseconds.
///
/// ```
/// use idempotent_rules::duration::{check_duration, DurationKind, DurationError};
/// use std::time::Duration;
/// assert!(check_duration(Duration::from_secs(30), DurationKind::Lease).is_ok());
/// assert!(matches!(check_duration(Duration::ZERO, DurationKind::Ttl), Err(DurationError::Zero { .. })));
/// ```
pub fn check_duration(value: Duration, kind: DurationKind) -> Result<Duration, DurationError> {
    if value.is_zero() {
        return Err(DurationError::Zero { kind });
    }
    let minimum = kind.minimum();
    if value < minimum {
        return Err(DurationError::BelowMinimum {
            kind,
            value,
            minimum,
        });
    }
    if u64::try_from(value.as_millis()).is_err() {
        return Err(DurationError::TooLong { kind });
    }
    Ok(value)
}

/// A duration the way the attribute spells it: `24h` prints as `1day`, `90s`
/// as `1m 30s`. Rounded down to whole milliseconds (sub-millisecond noise would
/// make `1s 200us` out of a configured `1s`).
pub fn format_duration(d: Duration) -> String {
    let d = Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    humantime::format_duration(d).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use DurationKind::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!(parse_duration("24h", Ttl), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("30s", Lease), Ok(Duration::from_secs(30)));
        assert_eq!(
            parse_duration("1h 30m", Ttl),
            Ok(Duration::from_secs(5_400))
        );
        assert_eq!(
            parse_duration(" 250ms ", Wait),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(
            parse_duration("7days", Ttl),
            Ok(Duration::from_secs(7 * 86_400))
        );
    }

    #[test]
    fn refuses_what_is_not_a_duration() {
        for text in ["soon", "10", "", "abc", "-1s"] {
            let e = parse_duration(text, Ttl).unwrap_err();
            assert!(
                matches!(e, DurationError::NotADuration { .. }),
                "{text:?}: {e}"
            );
            assert!(e.to_string().contains("e.g. ttl = \"24h\""), "{e}");
        }
    }

    #[test]
    fn zero_is_refused_and_wait_points_at_reject() {
        for kind in [Ttl, Lease, Wait] {
            assert_eq!(
                parse_duration("0s", kind),
                Err(DurationError::Zero { kind })
            );
        }
        assert!(parse_duration("0s", Ttl)
            .unwrap_err()
            .to_string()
            .contains("longer than zero"));
        assert!(parse_duration("0ms", Wait)
            .unwrap_err()
            .to_string()
            .contains("in_progress = reject"));
    }

    #[test]
    fn each_kind_has_its_minimum() {
        assert_eq!(Ttl.minimum(), Duration::from_millis(1));
        assert_eq!(Wait.minimum(), Duration::from_millis(1));
        assert_eq!(Lease.minimum(), Duration::from_millis(10));
        let e = parse_duration("5ms", Lease).unwrap_err();
        assert!(e.to_string().contains("below the minimum of 10ms"), "{e}");
        assert!(e.to_string().contains("lease/3"), "{e}");
        assert_eq!(parse_duration("10ms", Lease), Ok(Duration::from_millis(10)));
        assert_eq!(parse_duration("5ms", Ttl), Ok(Duration::from_millis(5)));
        assert_eq!(parse_duration("1ms", Wait), Ok(Duration::from_millis(1)));
        assert!(parse_duration("500us", Ttl)
            .unwrap_err()
            .to_string()
            .contains("minimum of 1ms"));
        assert!(matches!(
            parse_duration("999us", Wait),
            Err(DurationError::BelowMinimum { .. })
        ));
    }

    #[test]
    fn too_long_to_store() {
        // humantime accepts up to u64::MAX seconds; that is more milliseconds than a u64.
        let e = parse_duration("18446744073709551615s", Ttl).unwrap_err();
        assert_eq!(e, DurationError::TooLong { kind: Ttl });
    }

    #[test]
    fn defaults_and_formatting() {
        assert_eq!(Ttl.default_value(), Duration::from_secs(86_400));
        assert_eq!(Lease.default_value(), Duration::from_secs(30));
        assert_eq!(Wait.default_value(), Duration::from_secs(10));
        assert_eq!(format_duration(Duration::from_secs(90)), "1m 30s");
        assert_eq!(format_duration(Duration::new(1, 200_000)), "1s");
    }
}
