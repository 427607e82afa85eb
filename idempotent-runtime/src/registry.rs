//! The registry of every `#[idempotent]` function in the binary.
//!
//! Each annotated function registers a [`ScopeInfo`] when the program starts
//! (through `inventory`), so the scopes a binary claims can be listed and
//! compared with what a store holds.

use std::time::Duration;

/// What a duplicate gets while the first call is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProgressPolicy {
    /// Wait up to this long for the first call's result, then replay it
    /// (or return [`Error::InProgress`](crate::Error::InProgress) if it is not done).
    Wait(Duration),
    /// Return [`Error::InProgress`](crate::Error::InProgress) at once.
    Reject,
}

/// What an `Err(e)` returned by the body does to the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorPolicy {
    /// Release the record: the key is free and a retry runs the body again (the default).
    Release,
    /// Record the error as the final answer for the key; retries replay it.
    Record,
    /// Record the errors a predicate (named here) accepts; release the others.
    RecordIf(&'static str),
}

/// Everything the attribute declared about one function.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScopeInfo {
    /// The scope string, e.g. `payments.charge`.
    pub scope: &'static str,
    /// The function's path, `module::path::function`.
    pub function: &'static str,
    /// Source file of the function.
    pub file: &'static str,
    /// Line of the function's name.
    pub line: u32,
    /// Retention of a completed record.
    pub ttl: Duration,
    /// Lease of an in-progress record (renewed every `lease / 3`).
    pub lease: Duration,
    /// What a concurrent duplicate gets.
    pub in_progress: InProgressPolicy,
    /// What an `Err` does.
    pub errors: ErrorPolicy,
    /// Whether reservation and completion run in the caller's transaction (`tx = ...`).
    pub transactional: bool,
    /// Whether the arguments are fingerprinted at all (`fingerprint = false` turns it off).
    pub fingerprinted: bool,
    /// The parameters that go into the fingerprint, in declaration order.
    pub fingerprinted_parameters: &'static [&'static str],
    /// Whether the tenant is `shared` (no per-caller namespace).
    pub shared_tenant: bool,
}

impl ScopeInfo {
    /// Used by the generated code. `const` so it can live in a `static`.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub const fn __new(
        scope: &'static str,
        function: &'static str,
        file: &'static str,
        line: u32,
        ttl: Duration,
        lease: Duration,
        in_progress: InProgressPolicy,
        errors: ErrorPolicy,
        transactional: bool,
        fingerprinted: bool,
        fingerprinted_parameters: &'static [&'static str],
        shared_tenant: bool,
    ) -> Self {
        ScopeInfo {
            scope,
            function,
            file,
            line,
            ttl,
            lease,
            in_progress,
            errors,
            transactional,
            fingerprinted,
            fingerprinted_parameters,
            shared_tenant,
        }
    }
}

/// One registration, submitted by the generated code.
#[doc(hidden)]
pub struct Registration(pub &'static ScopeInfo);

inventory::collect!(Registration);

/// Every annotated function linked into this binary, sorted by scope, then function.
///
/// ```
/// for info in idempotent_runtime::registry::scopes() {
///     println!("{} -> {} ({}:{})", info.scope, info.function, info.file, info.line);
/// }
/// ```
pub fn scopes() -> Vec<&'static ScopeInfo> {
    let mut all: Vec<&'static ScopeInfo> = inventory::iter::<Registration>
        .into_iter()
        .map(|r| r.0)
        .collect();
    all.sort_by(|a, b| {
        (a.scope, a.function, a.file, a.line).cmp(&(b.scope, b.function, b.file, b.line))
    });
    all.dedup_by(|a, b| std::ptr::eq(*a, *b));
    all
}
