//! The scope format (DESIGN.md §3): lowercase segments of `a-z`, `0-9`, `_`
//! and `-`, joined by single dots, at most [`MAX_SCOPE_BYTES`] bytes; and the
//! "did you mean" suggestion used for scopes and argument names.

use std::fmt;

/// The longest scope, in bytes.
pub const MAX_SCOPE_BYTES: usize = 128;

const EXAMPLE: &str = "e.g. `payments.charge`";

/// Where a scope has an empty segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmptySegment {
    /// `.a`
    Leading,
    /// `a.`
    Trailing,
    /// `a..b`
    Doubled,
}

impl fmt::Display for EmptySegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EmptySegment::Leading => "starts with a dot",
            EmptySegment::Trailing => "ends with a dot",
            EmptySegment::Doubled => "has two dots in a row",
        })
    }
}

/// Why a string is not a scope. Each message says which rule broke and how to
/// write it instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScopeError {
    /// The scope is the empty string.
    #[error(
        "the scope is empty; name the operation with lowercase segments joined by dots, {EXAMPLE}"
    )]
    Empty,
    /// Longer than [`MAX_SCOPE_BYTES`].
    #[error("the scope is {len} bytes long; the limit is {MAX_SCOPE_BYTES} bytes; shorten it")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// A leading, trailing or doubled dot.
    #[error("the scope {place}, leaving an empty segment; segments are joined by single dots, {EXAMPLE}")]
    EmptySegment {
        /// Where.
        place: EmptySegment,
    },
    /// An uppercase ASCII letter.
    #[error("the scope contains the uppercase letter `{letter}`; scopes are lowercase{}",
        .lowercase.as_deref().map(|l| format!(": write `{l}`")).unwrap_or_default())]
    Uppercase {
        /// The first uppercase letter.
        letter: char,
        /// The whole scope in lowercase, when that is a valid scope.
        lowercase: Option<String>,
    },
    /// Any other character outside `a-z0-9_-` and `.`.
    #[error("the scope contains {}, which is not allowed; a segment uses only `a-z`, `0-9`, `_` and `-`, \
             and segments are joined by `.`, {EXAMPLE}", describe_char(*.character))]
    Character {
        /// The first character not allowed.
        character: char,
    },
}

fn describe_char(c: char) -> String {
    if c == ' ' {
        "a space".to_owned()
    } else if c.is_control() {
        format!("the control character {c:?}")
    } else {
        format!("`{c}`")
    }
}

/// Checks the scope format. The error says which rule broke (the first one,
/// in the order of [`scope_problems`]).
///
/// ```
/// use idempotent_rules::scope::{check_scope, ScopeError};
/// assert_eq!(check_scope("payments.charge"), Ok(()));
/// assert!(matches!(check_scope("Payments.charge"), Err(ScopeError::Uppercase { letter: 'P', .. })));
/// ```
pub fn check_scope(scope: &str) -> Result<(), ScopeError> {
    match scope_problems(scope).into_iter().next() {
        Some(problem) => Err(problem),
        None => Ok(()),
    }
}

/// Every rule of the scope format that `scope` breaks, each once, so all
/// can be reported in one round (`Payments..charge` is uppercase *and* has
/// an empty segment): the length, then the segments in order, each giving
/// its empty place, its first uppercase letter or its first character not
/// allowed, where not reported already. Empty when the scope is valid.
///
/// ```
/// use idempotent_rules::scope::{scope_problems, EmptySegment, ScopeError};
/// assert_eq!(scope_problems("payments.charge"), vec![]);
/// assert_eq!(
///     scope_problems("Pay..charge/v1"),
///     vec![
///         ScopeError::Uppercase { letter: 'P', lowercase: None },
///         ScopeError::EmptySegment { place: EmptySegment::Doubled },
///         ScopeError::Character { character: '/' },
///     ]
/// );
/// ```
pub fn scope_problems(scope: &str) -> Vec<ScopeError> {
    if scope.is_empty() {
        return vec![ScopeError::Empty];
    }
    let mut problems = Vec::new();
    if scope.len() > MAX_SCOPE_BYTES {
        problems.push(ScopeError::TooLong { len: scope.len() });
    }
    let count = scope.split('.').count();
    let (mut uppercase, mut character) = (false, false);
    for (index, segment) in scope.split('.').enumerate() {
        if segment.is_empty() {
            let place = if index == 0 {
                EmptySegment::Leading
            } else if index == count - 1 {
                EmptySegment::Trailing
            } else {
                EmptySegment::Doubled
            };
            let problem = ScopeError::EmptySegment { place };
            if !problems.contains(&problem) {
                problems.push(problem);
            }
            continue;
        }
        if let Some(letter) = segment.chars().find(|c| c.is_ascii_uppercase()) {
            if !uppercase {
                uppercase = true;
                let lower = scope.to_ascii_lowercase();
                let lowercase = scope_problems(&lower).is_empty().then_some(lower);
                problems.push(ScopeError::Uppercase { letter, lowercase });
            }
        }
        if let Some(found) = segment
            .chars()
            .find(|c| !matches!(c, 'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | '-'))
        {
            if !character {
                character = true;
                problems.push(ScopeError::Character { character: found });
            }
        }
    }
    problems
}

/// The candidate closest to `name` by edit distance, ties broken by order.
/// With `max_distance`, candidates further away than that are not offered.
///
/// ```
/// use idempotent_rules::scope::nearest;
/// assert_eq!(nearest("orders.plase", ["orders.place", "orders.cancel"], None), Some("orders.place"));
/// ```
pub fn nearest<'a, I>(name: &str, candidates: I, max_distance: Option<usize>) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    candidates
        .into_iter()
        .map(|c| (strsim::levenshtein(name, c), c))
        .filter(|(d, _)| max_distance.is_none_or(|m| *d <= m))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_well_formed_scopes() {
        for ok in [
            "payments.charge",
            "a",
            "orders.place_v2",
            "x-y.z_1.0",
            "pay-ments.charge_2",
            &"a".repeat(MAX_SCOPE_BYTES),
        ] {
            assert_eq!(check_scope(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn names_the_rule_that_broke() {
        let cases = [
            ("", "empty"),
            (".a", "starts with a dot"),
            (".", "starts with a dot"),
            ("a.", "ends with a dot"),
            ("a..b", "two dots in a row"),
            (
                "Payments.charge",
                "uppercase letter `P`; scopes are lowercase: write `payments.charge`",
            ),
            ("payments charge", "a space"),
            ("payments/charge", "`/`"),
            ("pay\u{7}", "control character"),
            ("é", "`é`"),
        ];
        for (scope, expected) in cases {
            let message = check_scope(scope).unwrap_err().to_string();
            assert!(message.contains(expected), "{scope:?}: {message}");
        }
        // No "write ..." when the lowercase form is not a scope either.
        let e = check_scope("A b").unwrap_err();
        assert_eq!(
            e,
            ScopeError::Uppercase {
                letter: 'A',
                lowercase: None
            }
        );
        let long = "a".repeat(MAX_SCOPE_BYTES + 1);
        assert_eq!(check_scope(&long), Err(ScopeError::TooLong { len: 129 }));
        assert!(check_scope(&long)
            .unwrap_err()
            .to_string()
            .contains("129 bytes"));
    }

    /// Every rule broken is listed, each once, in the order of the scope;
    /// the first is what `check_scope` reports.
    #[test]
    fn lists_every_rule_that_broke() {
        let problems = scope_problems("Payments..charge/v1.Refund..x.");
        assert_eq!(
            problems,
            [
                ScopeError::Uppercase {
                    letter: 'P',
                    lowercase: None
                },
                ScopeError::EmptySegment {
                    place: EmptySegment::Doubled
                },
                ScopeError::Character { character: '/' },
                ScopeError::EmptySegment {
                    place: EmptySegment::Trailing
                },
            ]
        );
        assert_eq!(
            check_scope("Payments..charge/v1.Refund..x."),
            Err(problems[0].clone())
        );
        let long = format!("{}.A", "a".repeat(MAX_SCOPE_BYTES));
        assert!(matches!(
            &scope_problems(&long)[..],
            [ScopeError::TooLong { .. }, ScopeError::Uppercase { .. }]
        ));
        assert_eq!(scope_problems(""), [ScopeError::Empty]);
        assert_eq!(scope_problems("payments.charge"), []);
    }

    #[test]
    fn the_length_limit_counts_bytes() {
        // 64 two-byte characters are 128 bytes but are refused for the characters.
        assert!(matches!(
            check_scope(&"é".repeat(64)),
            Err(ScopeError::Character { character: 'é' })
        ));
        assert!(matches!(
            check_scope(&"é".repeat(65)),
            Err(ScopeError::TooLong { len: 130 })
        ));
    }

    /// A candidate exactly `max_distance` edits away is still offered (a
    /// slip of three letters in a scope or argument name gets its hint, rule
    /// 18); one edit further is not.
    #[test]
    fn nearest_offers_a_candidate_at_exactly_the_bound() {
        assert_eq!(
            nearest("orders.pl", ["orders.place"], Some(3)),
            Some("orders.place")
        );
        assert_eq!(nearest("orders.p", ["orders.place"], Some(3)), None);
    }

    #[test]
    fn nearest_picks_the_closest() {
        let names = ["orders.place", "orders.cancel", "payments.charge"];
        assert_eq!(nearest("orders.plac", names, None), Some("orders.place"));
        assert_eq!(
            nearest("payment.charge", names, None),
            Some("payments.charge")
        );
        assert_eq!(nearest("zzz", names, Some(2)), None);
        assert_eq!(nearest("x", [], None), None);
    }
}
