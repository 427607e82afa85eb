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

/// Scopes registered while the program runs (e.g. one per HTTP layer built),
/// next to the ones `inventory` collects at startup.
static RUNTIME: std::sync::Mutex<Vec<&'static ScopeInfo>> = std::sync::Mutex::new(Vec::new());

/// Registers a scope described at run time rather than by an attribute
/// (the HTTP layer does this once per layer it builds). It is listed by
/// [`scopes`] and checked by [`validate`] like every other.
pub fn register_runtime(info: &'static ScopeInfo) {
    RUNTIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push(info);
}

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
    all.extend(
        RUNTIME
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .copied(),
    );
    all.sort_by(|a, b| {
        (a.scope, a.function, a.file, a.line).cmp(&(b.scope, b.function, b.file, b.line))
    });
    all.dedup_by(|a, b| std::ptr::eq(*a, *b));
    all
}

/// One place in the source that claims a scope: the function and where it is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Site {
    /// The function's path, `module::path::function`.
    pub function: &'static str,
    /// Source file of the function.
    pub file: &'static str,
    /// Line of the function's name.
    pub line: u32,
}

impl Site {
    fn of(info: &ScopeInfo) -> Self {
        Site {
            function: info.function,
            file: info.file,
            line: info.line,
        }
    }
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` at {}:{}", self.function, self.file, self.line)
    }
}

/// One scope claimed by two or more functions, with every claiming site.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DuplicateScope {
    /// The contested scope string.
    pub scope: &'static str,
    /// Every function claiming it, in registry order (at least two).
    pub sites: Vec<Site>,
}

/// What [`validate`] found wrong with the registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Two or more functions claim the same scope, so their records would
    /// replay each other's results. Each entry names every claiming site.
    #[error("{}", describe_duplicates(.0))]
    DuplicateScopes(Vec<DuplicateScope>),
}

fn describe_duplicates(duplicates: &[DuplicateScope]) -> String {
    let mut out = format!(
        "{} scope(s) claimed by more than one function; give each function its own scope \
         (keep the existing string on the function whose stored records must stay valid):",
        duplicates.len()
    );
    for d in duplicates {
        out.push_str(&format!("\n  scope `{}` is claimed by", d.scope));
        for (i, site) in d.sites.iter().enumerate() {
            out.push_str(if i == 0 { " " } else { " and " });
            out.push_str(&site.to_string());
        }
    }
    out
}

/// Checks the registry of this binary: every scope must be claimed by exactly
/// one function. The macro already refuses two claims it can see in one
/// crate; this catches claims from different crates linked into one binary.
///
/// Call it at startup (or in a test) and refuse to start on an error:
///
/// ```
/// if let Err(e) = idempotent_runtime::registry::validate() {
///     panic!("{e}"); // names every contested scope and both sites
/// }
/// ```
pub fn validate() -> Result<(), RegistryError> {
    validate_infos(&scopes())
}

/// [`validate`] over an explicit list (e.g. a filtered one).
///
/// ```
/// use idempotent_runtime::registry::{validate_infos, RegistryError};
/// assert!(validate_infos(&[]).is_ok());
/// ```
pub fn validate_infos(infos: &[&ScopeInfo]) -> Result<(), RegistryError> {
    let mut by_scope: std::collections::BTreeMap<&'static str, Vec<Site>> = Default::default();
    for info in infos {
        let sites = by_scope.entry(info.scope).or_default();
        let site = Site::of(info);
        // The same function registered twice is not a conflict.
        if !sites.contains(&site) {
            sites.push(site);
        }
    }
    let duplicates: Vec<DuplicateScope> = by_scope
        .into_iter()
        .filter(|(_, sites)| sites.len() > 1)
        .map(|(scope, sites)| DuplicateScope { scope, sites })
        .collect();
    if duplicates.is_empty() {
        Ok(())
    } else {
        Err(RegistryError::DuplicateScopes(duplicates))
    }
}

/// How a listing is printed: an aligned text table, or JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Aligned columns with a header, for people.
    #[default]
    Table,
    /// A pretty-printed JSON array/object, for programs.
    Json,
}

impl std::fmt::Display for InProgressPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InProgressPolicy::Wait(d) => write!(f, "wait({})", human(*d)),
            InProgressPolicy::Reject => f.write_str("reject"),
        }
    }
}

impl std::fmt::Display for ErrorPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ErrorPolicy::Release => f.write_str("release"),
            ErrorPolicy::Record => f.write_str("record"),
            ErrorPolicy::RecordIf(p) => write!(f, "record_if({p})"),
        }
    }
}

/// A duration the way the attribute spells it: `24h`, `30s`, `1m 30s`.
pub(crate) fn human(d: Duration) -> String {
    // Sub-millisecond noise would make `1s 200us` out of a configured `1s`.
    let d = Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    humantime::format_duration(d).to_string()
}

/// The serialized form of a [`ScopeInfo`] (durations as text and as milliseconds).
#[derive(serde::Serialize)]
struct ScopeRow<'a> {
    scope: &'a str,
    function: &'a str,
    file: &'a str,
    line: u32,
    ttl: String,
    ttl_ms: u128,
    lease: String,
    lease_ms: u128,
    in_progress: String,
    errors: String,
    transactional: bool,
    fingerprinted: bool,
    fingerprinted_parameters: &'a [&'a str],
    shared_tenant: bool,
}

impl serde::Serialize for ScopeInfo {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ScopeRow {
            scope: self.scope,
            function: self.function,
            file: self.file,
            line: self.line,
            ttl: human(self.ttl),
            ttl_ms: self.ttl.as_millis(),
            lease: human(self.lease),
            lease_ms: self.lease.as_millis(),
            in_progress: self.in_progress.to_string(),
            errors: self.errors.to_string(),
            transactional: self.transactional,
            fingerprinted: self.fingerprinted,
            fingerprinted_parameters: self.fingerprinted_parameters,
            shared_tenant: self.shared_tenant,
        }
        .serialize(serializer)
    }
}

/// The registry of this binary as a table or JSON.
///
/// ```
/// use idempotent_runtime::registry::{render, Format};
/// let table = render(Format::Table);
/// assert!(table.starts_with("scope"));
/// let json: serde_json::Value = serde_json::from_str(&render(Format::Json)).unwrap();
/// assert!(json.is_array());
/// ```
pub fn render(format: Format) -> String {
    render_infos(&scopes(), format)
}

/// Renders an explicit list of registrations (see [`render`]).
///
/// Table columns: scope, function, file:line, ttl, lease, in_progress,
/// errors, tx, fingerprinted params (`-` for none, `off` when
/// `fingerprint = false`).
pub fn render_infos(infos: &[&ScopeInfo], format: Format) -> String {
    match format {
        Format::Json => to_json(&infos),
        Format::Table => {
            let rows: Vec<Vec<String>> = infos
                .iter()
                .map(|i| {
                    vec![
                        i.scope.to_owned(),
                        i.function.to_owned(),
                        format!("{}:{}", i.file, i.line),
                        human(i.ttl),
                        human(i.lease),
                        i.in_progress.to_string(),
                        i.errors.to_string(),
                        if i.transactional { "yes" } else { "no" }.to_owned(),
                        if !i.fingerprinted {
                            "off".to_owned()
                        } else if i.fingerprinted_parameters.is_empty() {
                            "-".to_owned()
                        } else {
                            i.fingerprinted_parameters.join(", ")
                        },
                    ]
                })
                .collect();
            crate::table::render(
                &[
                    "scope",
                    "function",
                    "file:line",
                    "ttl",
                    "lease",
                    "in_progress",
                    "errors",
                    "tx",
                    "fingerprinted params",
                ],
                &rows,
            )
        }
    }
}

/// Prints the registry of this binary as a table on stdout: the one line a
/// binary needs for a `--list-scopes` flag.
///
/// ```no_run
/// idempotent_runtime::registry::print_table();
/// ```
pub fn print_table() {
    print!("{}", render(Format::Table));
}

/// Pretty JSON of anything serializable; our own types cannot fail to serialize.
pub(crate) fn to_json<T: serde::Serialize + ?Sized>(value: &T) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|e| {
        format!(
            "{{\"error\": {}}}",
            serde_json::Value::String(format!("could not serialize: {e}"))
        )
    });
    s.push('\n');
    s
}
