//! The registry of every `#[idempotent]` function in the binary.
//!
//! Each annotated function registers a [`ScopeInfo`] when the program starts
//! (through `inventory`), so the scopes a binary claims can be listed and
//! compared with what a store holds.

use idempotent_rules::shared_scope::{first_difference, Difference, Terms};
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

/// Defines [`ScopeInfo`] and [`ScopeSpec`] from one list of fields (the two
/// have the same fields, with the same meaning) and [`ScopeInfo::new`], which
/// copies each, so that a field added to one is added to both.
macro_rules! scope_info_and_spec {
    (
        $(#[$info_attr:meta])* pub struct ScopeInfo;
        $(#[$spec_attr:meta])* pub struct ScopeSpec;
        fields {
            $($(#[$field_attr:meta])* pub $field:ident: $ty:ty,)*
        }
    ) => {
        $(#[$info_attr])*
        pub struct ScopeInfo {
            $($(#[$field_attr])* pub $field: $ty,)*
        }

        $(#[$spec_attr])*
        pub struct ScopeSpec {
            $($(#[$field_attr])* pub $field: $ty,)*
        }

        impl ScopeInfo {
            /// Builds the description of one claimant. `const`, so it can live in a
            /// `static` (the generated code puts one in each annotated function).
            pub const fn new(spec: ScopeSpec) -> Self {
                ScopeInfo {
                    $($field: spec.$field,)*
                }
            }
        }
    };
}

scope_info_and_spec! {
    /// Everything the attribute declared about one function.
    #[derive(Debug, Clone, PartialEq, Eq)]
    #[non_exhaustive]
    pub struct ScopeInfo;

    /// Everything needed to describe one claimant of a scope, by name: what
    /// [`ScopeInfo::new`] (and the code `#[idempotent]` generates) builds a
    /// [`ScopeInfo`] from. The fields mean what [`ScopeInfo`]'s fields of the
    /// same names mean.
    ///
    /// ```
    /// use idempotent_runtime::registry::{ErrorPolicy, InProgressPolicy, ScopeInfo, ScopeSpec};
    /// use std::time::Duration;
    /// static CHARGE: ScopeInfo = ScopeInfo::new(ScopeSpec {
    ///     scope: "payments.charge",
    ///     function: "billing::charge",
    ///     file: file!(),
    ///     line: line!(),
    ///     ttl: Duration::from_secs(24 * 3600),
    ///     lease: Duration::from_secs(30),
    ///     in_progress: InProgressPolicy::Wait(Duration::from_secs(10)),
    ///     errors: ErrorPolicy::Release,
    ///     transactional: false,
    ///     fingerprinted: true,
    ///     fingerprinted_parameters: &["req"],
    ///     shared_tenant: false,
    ///     recover: None,
    ///     shared_scope: false,
    /// });
    /// assert_eq!(CHARGE.scope, "payments.charge");
    /// ```
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct ScopeSpec;

    fields {
        /// The scope string, e.g. `payments.charge`.
        pub scope: &'static str,
        /// The function's path, `module::path::function`. For a method,
        /// `module::path::method`: the attribute sees the method, not the `impl`
        /// it is in (`file` and `line` tell which).
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
        /// The `recover = path` hook asked before a takeover re-runs the body
        /// (rule 20), as written; `None` without one.
        pub recover: Option<&'static str>,
        /// `shared_scope`: this function claims its scope together with others on
        /// purpose (rule 21), e.g. an HTTP handler and a queue consumer that both
        /// process "refund order 8891". Every claimant must say so, and they must
        /// agree on what they fingerprint, on their ttl, on whether they ask a
        /// `recover` hook, on whether the tenant is `shared` and on whether they
        /// may record errors ([`validate`]).
        pub shared_scope: bool,
    }
}

impl ScopeInfo {
    /// What rule 21 compares between claimants of a shared scope.
    fn terms(&self) -> Terms<'static> {
        Terms {
            fingerprint: self.fingerprint_shape(),
            ttl: self.ttl,
            recovers: self.recover.is_some(),
            shared_tenant: self.shared_tenant,
            records_errors: !matches!(self.errors, ErrorPolicy::Release),
        }
    }

    /// The fingerprinted parameters, sorted: what decides whether two
    /// functions make the same fingerprint for the same arguments (the
    /// canonical form sorts arguments by name). `None` with `fingerprint = false`.
    pub fn fingerprint_shape(&self) -> Option<Vec<&'static str>> {
        self.fingerprinted.then(|| {
            let mut names = self.fingerprinted_parameters.to_vec();
            names.sort_unstable();
            names
        })
    }
}

impl From<ScopeSpec> for ScopeInfo {
    fn from(spec: ScopeSpec) -> Self {
        ScopeInfo::new(spec)
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
    /// The sites that said `shared_scope` (the others did not).
    pub shared: Vec<Site>,
}

/// What two claimants of a shared scope (rule 21) disagree on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Disagreement {
    /// They fingerprint different parameters (or one not at all), so the same
    /// request through the two would be refused as a mismatch.
    Fingerprint {
        /// The first site's fingerprinted parameters, sorted (`None`: off).
        first: Option<Vec<&'static str>>,
        /// The second site's.
        second: Option<Vec<&'static str>>,
    },
    /// They keep completed records for different ttls, so whether a duplicate
    /// is recognised would depend on which path recorded it.
    Ttl {
        /// The first site's ttl.
        first: Duration,
        /// The second site's ttl.
        second: Duration,
    },
    /// One asks a `recover` hook before it takes over a crashed attempt and
    /// the other does not: the other would run the body again blind after the
    /// first one's crash (rule 20).
    Recover {
        /// The first site's hook, as written (`None`: none).
        first: Option<&'static str>,
        /// The second site's.
        second: Option<&'static str>,
    },
    /// One keeps one namespace for every tenant (`tenant = shared`) and the
    /// other one per tenant: their records of one event are two identities,
    /// so the event through both runs twice (rule 3).
    SharedTenant {
        /// Whether the first site says `tenant = shared`.
        first: bool,
        /// Whether the second site does.
        second: bool,
    },
    /// One may record an `Err` (`errors = record` or `record_if`) and the
    /// other releases every error: a retry through the releasing one of an
    /// event whose error the other recorded can neither replay it nor run,
    /// and is refused until the record expires.
    ErrorPolicy {
        /// The first site's policy.
        #[serde(serialize_with = "as_text")]
        first: ErrorPolicy,
        /// The second site's.
        #[serde(serialize_with = "as_text")]
        second: ErrorPolicy,
    },
}

impl std::fmt::Display for Disagreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shape = |s: &Option<Vec<&str>>| match s {
            None => "nothing (fingerprint = false)".to_owned(),
            Some(v) if v.is_empty() => "no parameter".to_owned(),
            Some(v) => format!("({})", v.join(", ")),
        };
        match self {
            Disagreement::Fingerprint { first, second } => write!(
                f,
                "they fingerprint different parameters: {} vs {}",
                shape(first),
                shape(second)
            ),
            Disagreement::Ttl { first, second } => {
                write!(
                    f,
                    "their ttl differs: {} vs {}",
                    human(*first),
                    human(*second)
                )
            }
            Disagreement::Recover { first, second } => {
                let hook = |h: &Option<&str>| match h {
                    Some(path) => format!("`recover = {path}`"),
                    None => "no recover hook".to_owned(),
                };
                write!(
                    f,
                    "one asks a recover hook before taking over a crashed attempt and the other \
                     does not ({} vs {}): the one without would run the body again blind after \
                     the other's crash; give every claimant a `recover` hook, or none",
                    hook(first),
                    hook(second)
                )
            }
            Disagreement::SharedTenant { first, second } => {
                let namespace = |shared: &bool| {
                    if *shared {
                        "`tenant = shared`"
                    } else {
                        "a tenant per caller"
                    }
                };
                write!(
                    f,
                    "one keeps one namespace for every tenant and the other one per tenant ({} \
                     vs {}): their records of one event are two identities, so the event \
                     through both would run twice; give every claimant the same `tenant`",
                    namespace(first),
                    namespace(second)
                )
            }
            Disagreement::ErrorPolicy { first, second } => {
                let policy = |p: &ErrorPolicy| format!("`errors = {p}`");
                write!(
                    f,
                    "one records errors and the other releases them ({} vs {}): a retry through \
                     the releasing one of an event whose error was recorded could neither replay \
                     it nor run, and would be refused until the record expires; give every \
                     claimant an error policy that records, or `release` on all",
                    policy(first),
                    policy(second)
                )
            }
        }
    }
}

/// Two claimants of one shared scope that disagree.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SharedScopeConflict {
    /// The shared scope.
    pub scope: &'static str,
    /// The first claimant (registry order).
    pub first: Site,
    /// The claimant that disagrees with it.
    pub second: Site,
    /// What they disagree on.
    pub disagreement: Disagreement,
}

/// What [`validate`] found wrong with the registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Two or more functions claim the same scope, so their records would
    /// replay each other's results. Each entry names every claiming site.
    #[error("{}", describe_duplicates(.0))]
    DuplicateScopes(Vec<DuplicateScope>),
    /// Functions that share a scope on purpose (`shared_scope`, rule 21)
    /// disagree on what they fingerprint, on their ttl, on asking a
    /// `recover` hook, or on `tenant = shared`.
    #[error("{}", describe_conflicts(.0))]
    SharedScopeConflicts(Vec<SharedScopeConflict>),
}

fn describe_conflicts(conflicts: &[SharedScopeConflict]) -> String {
    let mut out = format!(
        "{} disagreement(s) between functions sharing a scope; functions that claim one scope \
         together must fingerprint the same parameter names and keep records for the same ttl:",
        conflicts.len()
    );
    for c in conflicts {
        out.push_str(&format!(
            "\n  scope `{}`: {} and {}: {}",
            c.scope, c.first, c.second, c.disagreement
        ));
    }
    out
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
        if !d.shared.is_empty() {
            out.push_str(&format!(
                " ({} of them say `shared_scope`; if sharing is meant, every claimant must say so)",
                d.shared.len()
            ));
        }
    }
    out
}

/// Checks the registry of this binary: every scope must be claimed by exactly
/// one function, or (rule 21) by several that all say `shared_scope` and
/// agree on what they fingerprint, on their ttl, on asking a `recover`
/// hook, on `tenant = shared` and on whether they may record errors. The
/// macro already refuses
/// what it can see in one crate; this catches claims from different crates
/// linked into one binary. Duplicates are reported first
/// ([`RegistryError::DuplicateScopes`]); once there are none, disagreements
/// between the claimants of shared scopes
/// ([`RegistryError::SharedScopeConflicts`]).
///
/// Call it at startup (or in a test) and refuse to start on an error:
///
/// ```
/// if let Err(e) = idempotent_runtime::registry::validate() {
///     panic!("{e}"); // names every contested scope and both sites
/// }
/// ```
pub fn validate() -> Result<(), RegistryError> {
    let registered = scopes();
    if registered.is_empty() {
        tracing::warn!(target: "idempotent",
            "registry::validate() found no idempotent scope at all: if this binary has annotated \
             functions, the linker left them out (a test that uses nothing of the crate that \
             declares them: name or call one of its items so they are linked); an \
             IdempotencyLayer's scope is registered only once its build() has run");
    }
    validate_infos(&registered)
}

/// Rule 18 across crates, without the application's help: the first call of
/// any annotated function in the process checks the registry ([`validate`])
/// and logs what it finds at ERROR, naming every contested scope and its
/// sites. The calls go on (two versions of one library linked into a binary
/// can claim one scope from the same function); [`validate`] at startup is
/// the way to refuse to start.
pub(crate) fn report_conflicts_once() {
    static CHECKED: std::sync::Once = std::sync::Once::new();
    CHECKED.call_once(|| {
        if let Err(e) = validate() {
            tracing::error!(target: "idempotent", error = %e,
                "the scopes of this binary conflict across crates (which the compiler cannot \
                 see): claimants of one scope share its records, so one function's call can \
                 replay another's result; call registry::validate() at startup to refuse to start");
        }
    });
}

/// [`validate`] over an explicit list (e.g. a filtered one).
///
/// ```
/// use idempotent_runtime::registry::{validate_infos, RegistryError};
/// assert!(validate_infos(&[]).is_ok());
/// ```
pub fn validate_infos(infos: &[&ScopeInfo]) -> Result<(), RegistryError> {
    let mut by_scope: std::collections::BTreeMap<&'static str, Vec<&ScopeInfo>> =
        Default::default();
    for info in infos {
        let claims = by_scope.entry(info.scope).or_default();
        // The same site registered again with the same settings is one
        // claimant (a function's registration linked twice, a layer built
        // again). With other settings it is another claimant of the
        // boundary (a helper building a layer for two routers, one with a
        // hook and one without), checked like any other.
        if !claims
            .iter()
            .any(|c| Site::of(c) == Site::of(info) && disagreement(c, info).is_none())
        {
            claims.push(info);
        }
    }
    let mut duplicates = Vec::new();
    let mut conflicts = Vec::new();
    for (scope, claims) in by_scope {
        if claims.len() < 2 {
            continue;
        }
        if !claims.iter().all(|c| c.shared_scope) {
            duplicates.push(DuplicateScope {
                scope,
                sites: claims.iter().map(|c| Site::of(c)).collect(),
                shared: claims
                    .iter()
                    .filter(|c| c.shared_scope)
                    .map(|c| Site::of(c))
                    .collect(),
            });
            continue;
        }
        let first = claims[0];
        for other in &claims[1..] {
            if let Some(disagreement) = disagreement(first, other) {
                conflicts.push(SharedScopeConflict {
                    scope,
                    first: Site::of(first),
                    second: Site::of(other),
                    disagreement,
                });
            }
        }
    }
    if !duplicates.is_empty() {
        Err(RegistryError::DuplicateScopes(duplicates))
    } else if !conflicts.is_empty() {
        Err(RegistryError::SharedScopeConflicts(conflicts))
    } else {
        Ok(())
    }
}

/// What two claimants of a shared scope disagree on, if anything (the rule:
/// `idempotent_rules::shared_scope`).
fn disagreement(a: &ScopeInfo, b: &ScopeInfo) -> Option<Disagreement> {
    // `Disagreement::$variant` with what `a` and `b` each have there.
    macro_rules! sides {
        ($variant:ident: $($what:tt)+) => {
            Disagreement::$variant {
                first: a.$($what)+,
                second: b.$($what)+,
            }
        };
    }
    Some(match first_difference(&a.terms(), &b.terms())? {
        Difference::Fingerprint => sides!(Fingerprint: fingerprint_shape()),
        Difference::Ttl => sides!(Ttl: ttl),
        Difference::Recover => sides!(Recover: recover),
        Difference::SharedTenant => sides!(SharedTenant: shared_tenant),
        Difference::ErrorPolicy => sides!(ErrorPolicy: errors),
    })
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

/// Serializes a policy as the attribute spells it (`release`, `record_if(path)`).
fn as_text<S: serde::Serializer>(policy: &ErrorPolicy, to: S) -> Result<S::Ok, S::Error> {
    to.collect_str(policy)
}

/// A duration the way the attribute spells it: `24h`, `30s`, `1m 30s`
/// (the rule is `idempotent_rules::duration::format_duration`).
pub(crate) fn human(d: Duration) -> String {
    idempotent_rules::duration::format_duration(d)
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
    recover: Option<&'a str>,
    shared_scope: bool,
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
            recover: self.recover,
            shared_scope: self.shared_scope,
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
/// `fingerprint = false`), recover (the hook, or `-`), shared (`yes` for a
/// scope claimed with `shared_scope`; every claimant has its own row).
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
                        i.recover.unwrap_or("-").to_owned(),
                        if i.shared_scope { "yes" } else { "-" }.to_owned(),
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
                    "recover",
                    "shared",
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
