//! Functions claiming one scope in one crate (DESIGN.md rules 18 and 21).
//!
//! The compiler expands every `#[idempotent]` of a crate in one process, so a
//! process-wide table keyed by (crate, scope) sees every claim. The compiler
//! expands each function once, so there every claim is a function of its
//! own, even two with one name in one file (methods of two types, or a
//! `macro_rules!` stamping one function into two modules). An IDE's
//! long-lived proc-macro server (rust-analyzer) expands a function again
//! after every edit: there a claim from the same file and function name
//! replaces the earlier one ([`Expansions`]).
//!
//! A scope has one claimant, or several that all say `shared_scope` (rule 21)
//! and agree on the terms `idempotent_rules::shared_scope` lists.
//!
//! Limitation: claims in *different* crates are not visible here; the runtime's
//! `registry::validate()` reports them when the program starts.

use idempotent_rules::shared_scope::{first_difference, Difference, Terms};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Where a scope was claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Site {
    pub function: String,
    pub file: String,
    pub line: usize,
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` ({}:{})", self.function, self.file, self.line)
    }
}

/// One function's claim on a scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    pub site: Site,
    /// The function says `shared_scope`.
    pub shared: bool,
    /// The fingerprinted parameter names, sorted; `None` with `fingerprint = false`.
    pub fingerprint: Option<Vec<String>>,
    /// The fingerprinted parameters that carry a `#[cfg]` (or a
    /// `#[cfg_attr]` that may give one): whether they are compiled in is not
    /// known here, so only what holds either way is compared now (the rest
    /// by `registry::validate` at run time, which sees what is compiled in).
    pub under_cfg: Vec<String>,
    /// The ttl, after the manifest's default.
    pub ttl: Duration,
    /// The function has a `recover = ...` hook (rule 20).
    pub recovers: bool,
    /// The function says `tenant = shared` (one namespace for every tenant).
    pub shared_tenant: bool,
    /// The function may record an `Err` (`errors = record` or `record_if`).
    pub records_errors: bool,
}

/// Why a claim is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Not every claimant says `shared_scope`. `others` are the earlier claimants.
    Duplicate { others: Vec<Claim> },
    /// Every claimant says `shared_scope`, but this one disagrees with `other`.
    Disagree { other: Box<Claim>, what: String },
}

type Table = HashMap<(String, String), Vec<Claim>>;

fn table() -> &'static Mutex<Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// The crate being compiled, as cargo names it.
pub(crate) fn current_crate() -> String {
    let get = |v: &str| std::env::var(v).unwrap_or_default();
    format!("{}/{}", get("CARGO_PKG_NAME"), get("CARGO_CRATE_NAME"))
}

fn shape(fingerprint: &Option<Vec<String>>) -> String {
    match fingerprint {
        None => "nothing (`fingerprint = false`)".to_owned(),
        Some(names) if names.is_empty() => "no parameter".to_owned(),
        Some(names) => format!("({})", names.join(", ")),
    }
}

fn human(d: Duration) -> String {
    idempotent_rules::duration::format_duration(d)
}

impl Claim {
    /// What rule 21 compares.
    fn terms(&self) -> Terms<'_> {
        Terms {
            fingerprint: self
                .fingerprint
                .as_ref()
                .map(|names| names.iter().map(String::as_str).collect()),
            ttl: self.ttl,
            recovers: self.recovers,
            shared_tenant: self.shared_tenant,
            records_errors: self.records_errors,
        }
    }
}

/// Whether `a` and `b` fingerprint the same names in some build although
/// their names as written differ, because of parameters under `#[cfg]`:
/// both fingerprint (or neither), and every name one of them has whatever
/// the cfg is among the other's names.
fn fingerprints_may_agree(a: &Claim, b: &Claim) -> bool {
    let (Some(names_a), Some(names_b)) = (&a.fingerprint, &b.fingerprint) else {
        return false;
    };
    if a.under_cfg.is_empty() && b.under_cfg.is_empty() {
        return false;
    }
    let always_in = |names: &[String], under_cfg: &[String], other: &[String]| {
        names
            .iter()
            .filter(|n| !under_cfg.contains(n))
            .all(|n| other.contains(n))
    };
    always_in(names_a, &a.under_cfg, names_b) && always_in(names_b, &b.under_cfg, names_a)
}

/// What `a` and `b`, both sharing a scope, disagree on (the rule:
/// `idempotent_rules::shared_scope`), said for the compile error.
fn disagreement(a: &Claim, b: &Claim) -> Option<String> {
    let pick = |of: fn(&Claim) -> bool| if of(a) { a } else { b };
    let (terms_a, mut terms_b) = (a.terms(), b.terms());
    if fingerprints_may_agree(a, b) {
        terms_b.fingerprint = terms_a.fingerprint.clone();
    }
    Some(match first_difference(&terms_a, &terms_b)? {
        Difference::Fingerprint => format!(
            "they fingerprint different parameters: {} vs {}. The fingerprint is computed over the \
             parameters' names and values, so the same request through both would be refused as a \
             mismatch; give the parameters the same names (or `skip(...)` the extra ones)",
            shape(&a.fingerprint),
            shape(&b.fingerprint)
        ),
        Difference::Ttl => format!(
            "their ttl differs: {} vs {}. Whether a duplicate is recognised would depend on which \
             of them recorded it; give both the same `ttl`",
            human(a.ttl),
            human(b.ttl)
        ),
        Difference::Recover => format!(
            "only `{}` asks a `recover` hook before taking over a crashed attempt: after its \
             crash, the other would run the body again blind (rule 20); give every claimant a \
             `recover` hook, or none",
            pick(|c| c.recovers).site.function
        ),
        Difference::SharedTenant => format!(
            "only `{}` says `tenant = shared`: its records are one namespace for every tenant, \
             the other's one per tenant, so one event through both would be two records and \
             run twice; give every claimant the same `tenant` (`shared` on all, or a tenant \
             expression on all)",
            pick(|c| c.shared_tenant).site.function
        ),
        Difference::ErrorPolicy => {
            let recording = pick(|c| c.records_errors);
            let releasing = if std::ptr::eq(recording, a) { b } else { a };
            format!(
                "only `{}` records errors (`errors = record` or `record_if`): a retry through `{}` \
                 (`errors = release`) of an event whose error was recorded could neither replay it \
                 nor run, and would be refused until the record expires; give every claimant an \
                 error policy that records, or `release` on all",
                recording.site.function, releasing.site.function
            )
        }
    })
}

/// How often this process expands one function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expansions {
    /// Once: the compiler (a new process every build).
    Once,
    /// Again after every edit: an IDE's long-lived proc-macro server, where
    /// an edit may also move the function to another line.
    AfterEveryEdit,
}

impl Expansions {
    /// This process's: an IDE's proc-macro server expands again
    /// (rust-analyzer's, whose executable's name says `rust-analyzer`, and
    /// the JetBrains IDEs', `intellij-rust-native-helper`); anything else is
    /// taken for the compiler.
    pub(crate) fn of_this_process() -> Expansions {
        static IDE: OnceLock<bool> = OnceLock::new();
        let ide = *IDE.get_or_init(|| {
            std::env::current_exe().is_ok_and(|exe| {
                exe.file_name().is_some_and(|name| {
                    let name = name.to_string_lossy();
                    ["rust-analyzer", "intellij"]
                        .iter()
                        .any(|ide| name.contains(ide))
                })
            })
        });
        if ide {
            Expansions::AfterEveryEdit
        } else {
            Expansions::Once
        }
    }
}

/// Records `claim` on `scope` in `krate`; refuses it when another function
/// already claims the scope and not every claimant says `shared_scope`, or
/// when they all do but this one disagrees with another. A refused claim is
/// still recorded, so a further claimant's error names every site.
pub(crate) fn claim(krate: &str, scope: &str, claim: Claim) -> Result<(), Refusal> {
    claim_in(Expansions::of_this_process(), krate, scope, claim)
}

fn claim_in(expansions: Expansions, krate: &str, scope: &str, claim: Claim) -> Result<(), Refusal> {
    let mut table = table().lock().unwrap_or_else(|p| p.into_inner());
    let claims = table
        .entry((krate.to_owned(), scope.to_owned()))
        .or_default();
    if expansions == Expansions::AfterEveryEdit {
        // The same function, expanded again (maybe after an edit).
        claims.retain(|c| {
            !(c.site.file == claim.site.file && c.site.function == claim.site.function)
        });
    }
    let others = claims.clone();
    claims.push(claim.clone());
    if others.is_empty() {
        return Ok(());
    }
    if !claim.shared || others.iter().any(|c| !c.shared) {
        return Err(Refusal::Duplicate { others });
    }
    match others
        .iter()
        .find_map(|o| disagreement(o, &claim).map(|what| (o.clone(), what)))
    {
        Some((other, what)) => Err(Refusal::Disagree {
            other: Box::new(other),
            what,
        }),
        None => Ok(()),
    }
}

/// The duplicate-scope error (rule 18), naming every site; with a hint about
/// `shared_scope` (rule 21) when some claimants already say it.
pub(crate) fn duplicate_message(scope: &str, others: &[Claim], site: &Site) -> String {
    let mut sites: Vec<String> = others.iter().map(|c| c.site.to_string()).collect();
    sites.push(site.to_string());
    let last = sites.pop().unwrap_or_default();
    let count = if sites.len() == 1 {
        "two functions".to_owned()
    } else {
        format!("{} functions", sites.len() + 1)
    };
    let listed = format!("{} and {last}", sites.join(", "));
    let shared: Vec<String> = others
        .iter()
        .filter(|c| c.shared)
        .map(|c| c.site.to_string())
        .collect();
    let hint = if shared.is_empty() {
        "give each function its own scope, or, if they are meant to share one deduplication \
         boundary (e.g. an HTTP handler and a queue consumer of one business event), write \
         `shared_scope` on every one of them"
            .to_owned()
    } else {
        let verb = if shared.len() == 1 { "says" } else { "say" };
        format!(
            "{} {verb} `shared_scope`, so sharing is meant: write `shared_scope` on every \
             claimant, or give this function its own scope",
            shared.join(" and ")
        )
    };
    let expanded_twice = if others.iter().any(|c| c.site == *site) {
        " (one function expanded more than once, e.g. by a `macro_rules!` that stamps it into \
         several modules: pass each expansion its own scope)"
    } else {
        ""
    };
    format!(
        "scope `{scope}` is claimed by {count} in this crate: {listed}{expanded_twice}. Records \
         are identified by scope, so they would replay each other's results; {hint}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(function: &str, line: usize) -> Site {
        Site {
            function: function.into(),
            file: "src/lib.rs".into(),
            line,
        }
    }

    fn plain(function: &str, line: usize) -> Claim {
        Claim {
            site: site(function, line),
            shared: false,
            fingerprint: Some(vec!["order".into()]),
            under_cfg: Vec::new(),
            ttl: Duration::from_secs(3600),
            recovers: false,
            shared_tenant: false,
            records_errors: false,
        }
    }

    fn shared(function: &str, line: usize) -> Claim {
        Claim {
            shared: true,
            ..plain(function, line)
        }
    }

    #[test]
    fn second_function_is_refused_same_function_expanded_again_is_not() {
        let ide = |krate, claim| claim_in(Expansions::AfterEveryEdit, krate, "x.y", claim);
        assert_eq!(ide("t/a", plain("first", 3)), Ok(()));
        assert_eq!(ide("t/a", plain("first", 5)), Ok(()));
        assert_eq!(
            ide("t/a", plain("second", 9)),
            Err(Refusal::Duplicate {
                others: vec![plain("first", 5)]
            })
        );
        assert_eq!(ide("t/b", plain("second", 9)), Ok(()));
    }

    /// The compiler expands each function once: two functions of one name in
    /// one file (methods of two types, a `macro_rules!` stamping one function
    /// into two modules, even at the same line) are two claimants.
    #[test]
    fn the_compiler_refuses_two_functions_of_one_name_in_one_file() {
        let compiler = |claim| claim_in(Expansions::Once, "t/c", "x.z", claim);
        assert_eq!(compiler(plain("charge", 3)), Ok(()));
        assert_eq!(
            compiler(plain("charge", 8)),
            Err(Refusal::Duplicate {
                others: vec![plain("charge", 3)]
            })
        );
        assert!(matches!(
            compiler(plain("charge", 8)),
            Err(Refusal::Duplicate { others }) if others.len() == 2
        ));
    }

    /// A fingerprinted parameter under `#[cfg]`: which names are compiled in
    /// is not known when the attribute expands, so the fingerprints are not
    /// compared then (`registry::validate` compares the compiled-in ones);
    /// the other terms still are.
    #[test]
    fn fingerprints_with_a_parameter_under_cfg_are_compared_at_run_time() {
        let mut with_cfg = shared("http", 1);
        with_cfg.fingerprint = Some(vec!["amount".into(), "note".into()]);
        with_cfg.under_cfg = vec!["note".into()];
        let mut without = shared("queue", 2);
        without.fingerprint = Some(vec!["amount".into()]);
        assert_eq!(claim("t/cfg", "r.cfg", with_cfg.clone()), Ok(()));
        assert_eq!(claim("t/cfg", "r.cfg", without.clone()), Ok(()));
        without.ttl = Duration::from_secs(60);
        without.site = site("cron", 3);
        assert!(matches!(
            claim("t/cfg", "r.cfg", without),
            Err(Refusal::Disagree { what, .. }) if what.contains("ttl")
        ));
        // What differs whatever the cfg is still refused now: a name the
        // other never has, and no fingerprint at all.
        let mut order = shared("jobs", 4);
        order.fingerprint = Some(vec!["order".into()]);
        assert!(matches!(
            claim("t/cfg2", "r.cfg2", with_cfg.clone()).and(claim("t/cfg2", "r.cfg2", order)),
            Err(Refusal::Disagree { what, .. }) if what.contains("different parameters")
        ));
        let mut off = shared("jobs", 4);
        off.fingerprint = None;
        assert!(matches!(
            claim("t/cfg3", "r.cfg3", with_cfg).and(claim("t/cfg3", "r.cfg3", off)),
            Err(Refusal::Disagree { what, .. }) if what.contains("fingerprint = false")
        ));
    }

    /// Tests run in the test harness, not in rust-analyzer.
    #[test]
    fn this_process_is_taken_for_the_compiler() {
        assert_eq!(Expansions::of_this_process(), Expansions::Once);
    }

    #[test]
    fn shared_scopes_need_every_claimant_to_agree() {
        assert_eq!(claim("t/s", "r.s", shared("http", 1)), Ok(()));
        assert_eq!(claim("t/s", "r.s", shared("queue", 2)), Ok(()));
        // A third claimant without the flag names both others.
        assert_eq!(
            claim("t/s", "r.s", plain("cron", 3)),
            Err(Refusal::Duplicate {
                others: vec![shared("http", 1), shared("queue", 2)]
            })
        );
        // A second claimant that differs from the first in one term is
        // refused, naming the first and the term (each case its own scope).
        /// Makes the second claimant differ from the first.
        type Differ = fn(&mut Claim);
        #[rustfmt::skip]
        let differs: [(&str, &str, Differ, &str); 5] = [
            ("t/t", "r.t", |c| c.ttl = Duration::from_secs(60), "ttl"),
            ("t/u", "r.u", |c| c.fingerprint = None, "fingerprint = false"),
            ("t/v", "r.v", |c| c.recovers = true, "only `late` asks a `recover` hook"),
            ("t/w", "r.w", |c| c.shared_tenant = true, "only `late` says `tenant = shared`"),
            ("t/x", "r.x", |c| c.records_errors = true, "only `late` records errors"),
        ];
        for (krate, scope, differ, says) in differs {
            let mut late = shared("late", 4);
            differ(&mut late);
            assert!(
                matches!(
                    claim(krate, scope, shared("http", 1)).and(claim(krate, scope, late)),
                    Err(Refusal::Disagree { other, what }) if other.site.function == "http" && what.contains(says)
                ),
                "{says}"
            );
        }
        // No fingerprinted parameter records no fingerprint, as
        // `fingerprint = false` does: they agree (rule 8).
        let mut no_parameter = shared("http", 1);
        no_parameter.fingerprint = Some(vec![]);
        let mut off = shared("late", 4);
        off.fingerprint = None;
        assert_eq!(
            claim("t/nf", "r.nf", no_parameter).and(claim("t/nf", "r.nf", off)),
            Ok(())
        );
    }
}
