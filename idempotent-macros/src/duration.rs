//! Durations written in the attribute (`ttl = "24h"`, `lease = "30s"`,
//! `in_progress = wait("10s")`), parsed with `humantime` when the code compiles.

use std::time::Duration;

/// Which duration is being parsed: decides the minimum and the wording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `ttl`: retention of a completed record. At least 1ms.
    Ttl,
    /// `lease`: renewed every lease/3 while the body runs. At least 10ms, so
    /// the heartbeat does not hammer the store.
    Lease,
    /// `wait(...)`: how long a duplicate waits. At least 1ms (zero is `reject`).
    Wait,
}

impl Kind {
    fn minimum(self) -> Duration {
        match self {
            Kind::Ttl | Kind::Wait => Duration::from_millis(1),
            Kind::Lease => Duration::from_millis(10),
        }
    }

    fn what(self) -> &'static str {
        match self {
            Kind::Ttl => "`ttl`",
            Kind::Lease => "`lease`",
            Kind::Wait => "`wait(...)`",
        }
    }

    fn example(self) -> &'static str {
        match self {
            Kind::Ttl => "ttl = \"24h\"",
            Kind::Lease => "lease = \"30s\"",
            Kind::Wait => "in_progress = wait(\"10s\")",
        }
    }
}

/// Parses a duration like `"24h"`, `"30s"`, `"1h 30m"`, `"250ms"`.
pub(crate) fn parse(text: &str, kind: Kind) -> Result<Duration, String> {
    let value = humantime::parse_duration(text.trim()).map_err(|e| {
        format!(
            "{} is not a duration: `{text}` ({e}); write a number with a unit, e.g. {}",
            kind.what(),
            kind.example()
        )
    })?;
    if value.is_zero() {
        return Err(match kind {
            Kind::Wait => "`wait(...)` must be longer than zero; to refuse a duplicate at once, \
                           write `in_progress = reject`"
                .to_owned(),
            _ => format!(
                "{} must be longer than zero, e.g. {}",
                kind.what(),
                kind.example()
            ),
        });
    }
    let minimum = kind.minimum();
    if value < minimum {
        let why = match kind {
            Kind::Lease => {
                " (the lease is renewed every lease/3; shorter leases would hammer the store)"
            }
            _ => "",
        };
        return Err(format!(
            "{} is {}, below the minimum of {}{why}",
            kind.what(),
            humantime::format_duration(value),
            humantime::format_duration(minimum)
        ));
    }
    if u64::try_from(value.as_millis()).is_err() {
        return Err(format!("{} is too long to be stored", kind.what()));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!(parse("24h", Kind::Ttl), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse("30s", Kind::Lease), Ok(Duration::from_secs(30)));
        assert_eq!(parse("1h 30m", Kind::Ttl), Ok(Duration::from_secs(5_400)));
        assert_eq!(parse("250ms", Kind::Wait), Ok(Duration::from_millis(250)));
        assert_eq!(
            parse("7days", Kind::Ttl),
            Ok(Duration::from_secs(7 * 86_400))
        );
    }

    #[test]
    fn refuses_bad_zero_and_too_short() {
        assert!(parse("soon", Kind::Ttl)
            .unwrap_err()
            .contains("not a duration"));
        assert!(parse("10", Kind::Ttl)
            .unwrap_err()
            .contains("not a duration"));
        assert!(parse("0s", Kind::Ttl)
            .unwrap_err()
            .contains("longer than zero"));
        assert!(parse("0s", Kind::Wait)
            .unwrap_err()
            .contains("in_progress = reject"));
        assert!(parse("5ms", Kind::Lease)
            .unwrap_err()
            .contains("minimum of 10ms"));
        assert!(parse("500us", Kind::Ttl)
            .unwrap_err()
            .contains("minimum of 1ms"));
        assert_eq!(parse("10ms", Kind::Lease), Ok(Duration::from_millis(10)));
    }
}
