//! What every claimant of a shared scope must agree on (DESIGN.md rule 21),
//! and in which order a difference is reported. The macro checks it for the
//! claimants of one crate when the code compiles; `registry::validate()` for
//! every claimant in the program when it starts.
//!
//! ```
//! use idempotent_rules::shared_scope::{first_difference, Difference, Terms};
//! use std::time::Duration;
//!
//! let http = Terms {
//!     fingerprint: Some(vec!["order", "amount"]),
//!     ttl: Duration::from_secs(3600),
//!     recovers: false,
//!     shared_tenant: false,
//!     records_errors: false,
//! };
//! // The parameters' order does not count.
//! let queue = Terms { fingerprint: Some(vec!["amount", "order"]), ..http.clone() };
//! assert_eq!(first_difference(&http, &queue), None);
//! let longer = Terms { ttl: Duration::from_secs(7 * 86_400), ..http.clone() };
//! assert_eq!(first_difference(&http, &longer), Some(Difference::Ttl));
//! ```

use std::time::Duration;

/// What one claimant of a shared scope declares, as far as rule 21 compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terms<'a> {
    /// The names of the fingerprinted parameters, in any order; `None` with
    /// `fingerprint = false`. The canonical form is computed over names and
    /// values, so the same request through two claimants matches only when
    /// they fingerprint the same names.
    pub fingerprint: Option<Vec<&'a str>>,
    /// The ttl, after the manifest's default: whether a duplicate is
    /// recognised must not depend on which claimant recorded it.
    pub ttl: Duration,
    /// The claimant asks a `recover` hook before it takes over a crashed
    /// attempt (rule 20): one without would run the body again blind after a
    /// crash of one with it.
    pub recovers: bool,
    /// The claimant says `tenant = shared`: one namespace for every tenant
    /// beside one per tenant would make one event two records.
    pub shared_tenant: bool,
    /// The claimant may record an `Err` (`errors = record` or `record_if`): a
    /// claimant that releases every error can neither replay a recorded one
    /// nor run.
    pub records_errors: bool,
}

/// The first thing two claimants of a shared scope disagree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Difference {
    /// They fingerprint different parameter names (or one not at all).
    Fingerprint,
    /// Their ttl differs.
    Ttl,
    /// One asks a `recover` hook and the other does not.
    Recover,
    /// One says `tenant = shared` and the other names the tenant.
    SharedTenant,
    /// One may record errors and the other releases them.
    ErrorPolicy,
}

/// The first difference between `a` and `b`, in the order of [`Difference`];
/// `None` when they agree and may share the scope.
pub fn first_difference(a: &Terms<'_>, b: &Terms<'_>) -> Option<Difference> {
    if sorted(&a.fingerprint) != sorted(&b.fingerprint) {
        Some(Difference::Fingerprint)
    } else if a.ttl != b.ttl {
        Some(Difference::Ttl)
    } else if a.recovers != b.recovers {
        Some(Difference::Recover)
    } else if a.shared_tenant != b.shared_tenant {
        Some(Difference::SharedTenant)
    } else if a.records_errors != b.records_errors {
        Some(Difference::ErrorPolicy)
    } else {
        None
    }
}

/// The names in one order, so their order does not count. No name at all is
/// no fingerprint, as with `fingerprint = false`: the call records none, so
/// (rule 8) neither can contradict the other.
fn sorted<'a>(names: &Option<Vec<&'a str>>) -> Option<Vec<&'a str>> {
    names
        .clone()
        .filter(|names| !names.is_empty())
        .map(|mut names| {
            names.sort_unstable();
            names
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms() -> Terms<'static> {
        Terms {
            fingerprint: Some(vec!["order", "amount"]),
            ttl: Duration::from_secs(3600),
            recovers: false,
            shared_tenant: false,
            records_errors: false,
        }
    }

    /// A claimant with no fingerprinted parameter records no fingerprint,
    /// as one with `fingerprint = false` does: the two agree (they were
    /// refused as "no parameter vs nothing").
    #[test]
    fn no_fingerprinted_parameter_is_no_fingerprint() {
        let none = Terms {
            fingerprint: Some(vec![]),
            ..terms()
        };
        let off = Terms {
            fingerprint: None,
            ..terms()
        };
        assert_eq!(first_difference(&none, &off), None);
        assert_eq!(first_difference(&off, &none), None);
        assert_eq!(
            first_difference(&none, &terms()),
            Some(Difference::Fingerprint)
        );
    }

    #[test]
    fn each_term_is_compared_and_the_first_difference_is_named() {
        let base = terms();
        assert_eq!(first_difference(&base, &base.clone()), None);
        let cases = [
            (
                Terms {
                    fingerprint: None,
                    ..terms()
                },
                Difference::Fingerprint,
            ),
            (
                Terms {
                    fingerprint: Some(vec!["order"]),
                    ..terms()
                },
                Difference::Fingerprint,
            ),
            (
                Terms {
                    ttl: Duration::from_secs(60),
                    ..terms()
                },
                Difference::Ttl,
            ),
            (
                Terms {
                    recovers: true,
                    ..terms()
                },
                Difference::Recover,
            ),
            (
                Terms {
                    shared_tenant: true,
                    ..terms()
                },
                Difference::SharedTenant,
            ),
            (
                Terms {
                    records_errors: true,
                    ..terms()
                },
                Difference::ErrorPolicy,
            ),
        ];
        for (other, expected) in cases {
            assert_eq!(first_difference(&base, &other), Some(expected), "{other:?}");
            assert_eq!(first_difference(&other, &base), Some(expected), "{other:?}");
        }
        // Several differences: the first in the order of `Difference`.
        let many = Terms {
            ttl: Duration::from_secs(60),
            records_errors: true,
            ..terms()
        };
        assert_eq!(first_difference(&base, &many), Some(Difference::Ttl));
    }
}
