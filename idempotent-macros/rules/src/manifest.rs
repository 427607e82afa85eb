//! The scope manifest, `idempotent.toml`: the scopes a project declares, with
//! optional per-scope defaults, and the names it has retired.
//!
//! ```toml
//! [scopes."orders.place"]
//! description = "placing an order"   # for people
//! ttl = "24h"                        # optional default; the attribute's `ttl` wins
//! lease = "30s"                      # optional default; the attribute's `lease` wins
//!
//! [retired."orders.place_v1"]
//! reason = "renamed to orders.place"
//! ```
//!
//! A manifest is valid as a whole or not at all: unknown keys, a name that is
//! not a scope ([`check_scope`]), a duration that
//! [`parse_duration`] refuses, or a name that
//! is both declared and retired make it invalid, with every problem listed.
//! The macro and the command line give the same verdict on the same file.
//!
//! # Where the manifest is
//!
//! One lookup order, used by the macro (from the crate being compiled) and by
//! the `idempotent` command line (from the current directory, unless
//! `--manifest` names a file); first match wins ([`locate`]):
//!
//! 1. the file named by the `IDEMPOTENT_MANIFEST` environment variable
//!    (a relative path is relative to the base directory); it must exist;
//! 2. `idempotent.toml` in the base directory (the crate's directory,
//!    `CARGO_MANIFEST_DIR`, for the macro), or in the package directory the
//!    base directory is inside (the command line in `crate/src`);
//! 3. `idempotent.toml` at the root of the package's workspace, as cargo
//!    finds it ([`workspace_root`]).
//!
//! No manifest found: only the scope format is checked.

use crate::duration::{format_duration, parse_duration, DurationError, DurationKind};
use crate::scope::{check_scope, nearest, ScopeError};
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The manifest's file name.
pub const FILE_NAME: &str = "idempotent.toml";
/// The environment variable that names a manifest explicitly.
pub const ENV_VAR: &str = "IDEMPOTENT_MANIFEST";

/// A parsed and checked `idempotent.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Manifest {
    /// Where it was read from (`<string>` when parsed from text); named in errors.
    #[serde(skip)]
    pub path: PathBuf,
    /// Declared scopes by name, sorted.
    pub scopes: BTreeMap<String, DeclaredScope>,
    /// Retired scope names, sorted.
    pub retired: BTreeMap<String, RetiredScope>,
}

/// One `[scopes."name"]` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeclaredScope {
    /// What the scope protects, for people.
    pub description: Option<String>,
    /// Default retention for this scope (the attribute's `ttl` wins).
    #[serde(serialize_with = "ser_opt_duration")]
    pub ttl: Option<Duration>,
    /// Default lease for this scope (the attribute's `lease` wins).
    #[serde(serialize_with = "ser_opt_duration")]
    pub lease: Option<Duration>,
}

/// One `[retired."name"]` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct RetiredScope {
    /// Why the name was retired, e.g. `renamed to orders.place`.
    pub reason: Option<String>,
}

/// What the manifest says about one declared scope.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScopeDefaults {
    /// The scope's `ttl`, if the manifest gives one.
    pub ttl: Option<Duration>,
    /// The scope's `lease`, if the manifest gives one.
    pub lease: Option<Duration>,
}

fn ser_opt_duration<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(&format_duration(*d)),
        None => s.serialize_none(),
    }
}

/// Why a manifest could not be found or read. Each message names the file and
/// says what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// `IDEMPOTENT_MANIFEST` names a file that does not exist.
    #[error("{ENV_VAR} is set to `{}`, but there is no file there; point it at a scope manifest or unset it", .path.display())]
    EnvVarNoFile {
        /// The path it names (made absolute against the base directory).
        path: PathBuf,
    },
    /// The file could not be read.
    #[error("cannot read the scope manifest `{}`: {source}; check the path ({ENV_VAR}, or the command line's --manifest)", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not TOML of the expected shape (with line and column).
    #[error("the scope manifest `{}` is not valid: {message}", .path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The TOML parser's message.
        message: String,
    },
    /// The file parses but breaks the rules; every problem is listed.
    #[error("the scope manifest `{}` is not valid: {}", .path.display(), join(.problems))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found, in file order of tables (scopes, then retired).
        problems: Vec<ManifestProblem>,
    },
}

fn join(problems: &[ManifestProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// One rule a manifest entry breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ManifestProblem {
    /// An entry's name is not a scope.
    ScopeName {
        /// `scopes` or `retired`.
        table: &'static str,
        /// The name.
        scope: String,
        /// What is wrong with it.
        error: ScopeError,
    },
    /// A `ttl` or `lease` is refused.
    Duration {
        /// The declared scope.
        scope: String,
        /// `ttl` or `lease`.
        field: &'static str,
        /// Why.
        error: DurationError,
    },
    /// A name is both declared and retired.
    DeclaredAndRetired {
        /// The name.
        scope: String,
    },
}

impl fmt::Display for ManifestProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ManifestProblem::ScopeName {
                table,
                scope,
                error,
            } => write!(f, "[{table}.{scope:?}] is not a valid scope name: {error}"),
            ManifestProblem::Duration {
                scope,
                field,
                error,
            } => write!(f, "[scopes.{scope:?}] {field}: {error}"),
            ManifestProblem::DeclaredAndRetired { scope } => write!(
                f,
                "{scope:?} is both declared and retired; remove it from one of [scopes] and [retired]"
            ),
        }
    }
}

/// Why a scope may not be claimed under a manifest (DESIGN.md rule 18).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MembershipError {
    /// The name is retired.
    #[error("scope `{scope}` is retired in `{}`{}. A retired name must not be claimed again (new records \
             would mix with old ones); use the scope that replaced it",
        .manifest.display(), .reason.as_deref().map(|r| format!(": \"{r}\"")).unwrap_or_default())]
    Retired {
        /// The scope.
        scope: String,
        /// The reason given in the manifest.
        reason: Option<String>,
        /// The manifest.
        manifest: PathBuf,
    },
    /// The name is not declared.
    #[error("scope `{scope}` is not declared in the scope manifest `{}`; {}, declare it there: \
             [scopes.\"{scope}\"]",
        .manifest.display(),
        .nearest.as_deref().map_or_else(
            || "if this is a new operation".to_owned(),
            |n| format!("did you mean `{n}`? If this is a new operation"),
        ))]
    Undeclared {
        /// The scope.
        scope: String,
        /// The nearest declared name, if any.
        nearest: Option<String>,
        /// The manifest.
        manifest: PathBuf,
    },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    #[serde(default)]
    scopes: BTreeMap<String, RawScope>,
    #[serde(default)]
    retired: BTreeMap<String, RawRetired>,
}

// Unknown keys are refused: a typo such as `tll` must not be silently ignored.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScope {
    description: Option<String>,
    ttl: Option<String>,
    lease: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetired {
    reason: Option<String>,
}

impl ManifestProblem {
    /// What is wrong with `scope`, a name in the manifest's `table`
    /// (`scopes` or `retired`), when it is not a valid scope name.
    fn of_scope_name(table: &'static str, scope: &str) -> Option<Self> {
        check_scope(scope)
            .err()
            .map(|error| ManifestProblem::ScopeName {
                table,
                scope: scope.to_owned(),
                error,
            })
    }
}

impl Manifest {
    /// The conventional file name ([`FILE_NAME`]).
    pub const FILE_NAME: &'static str = FILE_NAME;

    /// Reads and checks a manifest file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ManifestError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ManifestError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse_named(&text, path)
    }

    /// Parses and checks manifest text; errors name the file as `<string>`.
    ///
    /// ```
    /// use idempotent_rules::manifest::Manifest;
    /// let m = Manifest::parse(r#"
    ///     [scopes."orders.place"]
    ///     ttl = "24h"
    ///     [retired."orders.place_v1"]
    ///     reason = "renamed to orders.place"
    /// "#)?;
    /// assert_eq!(m.scopes["orders.place"].ttl, Some(std::time::Duration::from_secs(86_400)));
    /// assert!(m.is_retired("orders.place_v1"));
    /// # Ok::<(), idempotent_rules::manifest::ManifestError>(())
    /// ```
    pub fn parse(text: &str) -> Result<Self, ManifestError> {
        Self::parse_named(text, Path::new("<string>"))
    }

    /// Parses and checks manifest text read from `path` (named in errors).
    pub fn parse_named(text: &str, path: &Path) -> Result<Self, ManifestError> {
        let raw: RawManifest = toml::from_str(text).map_err(|e| ManifestError::Parse {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let mut problems = Vec::new();
        let mut manifest = Manifest {
            path: path.to_owned(),
            ..Manifest::default()
        };
        for (name, s) in raw.scopes {
            problems.extend(ManifestProblem::of_scope_name("scopes", &name));
            let mut duration = |field: &'static str, kind, text: Option<String>| {
                text.and_then(|t| match parse_duration(&t, kind) {
                    Ok(d) => Some(d),
                    Err(error) => {
                        problems.push(ManifestProblem::Duration {
                            scope: name.clone(),
                            field,
                            error,
                        });
                        None
                    }
                })
            };
            let entry = DeclaredScope {
                ttl: duration("ttl", DurationKind::Ttl, s.ttl),
                lease: duration("lease", DurationKind::Lease, s.lease),
                description: s.description,
            };
            manifest.scopes.insert(name, entry);
        }
        for (name, r) in raw.retired {
            problems.extend(ManifestProblem::of_scope_name("retired", &name));
            if manifest.scopes.contains_key(&name) {
                problems.push(ManifestProblem::DeclaredAndRetired {
                    scope: name.clone(),
                });
            }
            manifest
                .retired
                .insert(name, RetiredScope { reason: r.reason });
        }
        if problems.is_empty() {
            Ok(manifest)
        } else {
            Err(ManifestError::Invalid {
                path: path.to_owned(),
                problems,
            })
        }
    }

    /// Whether `scope` is declared.
    pub fn is_declared(&self, scope: &str) -> bool {
        self.scopes.contains_key(scope)
    }

    /// Whether `scope` is retired.
    pub fn is_retired(&self, scope: &str) -> bool {
        self.retired.contains_key(scope)
    }

    /// Whether `scope` may be claimed: declared and not retired. Returns the
    /// scope's defaults; an undeclared scope's error offers the nearest
    /// declared name.
    ///
    /// ```
    /// use idempotent_rules::manifest::{Manifest, MembershipError};
    /// let m = Manifest::parse("[scopes.\"orders.place\"]\n[retired.\"orders.v1\"]\n")?;
    /// assert!(m.check_scope("orders.place").is_ok());
    /// assert!(matches!(m.check_scope("orders.v1"), Err(MembershipError::Retired { .. })));
    /// let e = m.check_scope("orders.plase").unwrap_err();
    /// assert!(e.to_string().contains("did you mean `orders.place`?"));
    /// # Ok::<(), idempotent_rules::manifest::ManifestError>(())
    /// ```
    pub fn check_scope(&self, scope: &str) -> Result<ScopeDefaults, MembershipError> {
        if let Some(retired) = self.retired.get(scope) {
            return Err(MembershipError::Retired {
                scope: scope.to_owned(),
                reason: retired.reason.clone(),
                manifest: self.path.clone(),
            });
        }
        match self.scopes.get(scope) {
            Some(declared) => Ok(ScopeDefaults {
                ttl: declared.ttl,
                lease: declared.lease,
            }),
            None => Err(MembershipError::Undeclared {
                scope: scope.to_owned(),
                // Only a name near enough to be a slip: `standalone.job` is
                // not offered `ct.generic`.
                nearest: nearest(
                    scope,
                    self.scopes.keys().map(String::as_str),
                    Some((scope.chars().count() / 3).max(3)),
                )
                .map(str::to_owned),
                manifest: self.path.clone(),
            }),
        }
    }
}

/// Finds the manifest in the [documented order](self#where-the-manifest-is),
/// reading `IDEMPOTENT_MANIFEST` from the environment. `base_dir` is the
/// crate's directory for the macro, the current directory for the command
/// line; without one, only the environment variable is looked at.
/// `Err` when `IDEMPOTENT_MANIFEST` names a file that does not exist.
pub fn locate(base_dir: Option<&Path>) -> Result<Option<PathBuf>, ManifestError> {
    let explicit = std::env::var_os(ENV_VAR);
    locate_with(explicit.as_deref(), base_dir)
}

/// [`locate`] with the environment variable's value passed in (empty counts as unset).
pub fn locate_with(
    explicit: Option<&OsStr>,
    base_dir: Option<&Path>,
) -> Result<Option<PathBuf>, ManifestError> {
    if let Some(explicit) = explicit.filter(|v| !v.is_empty()) {
        let mut path = PathBuf::from(explicit);
        if path.is_relative() {
            if let Some(dir) = base_dir {
                path = dir.join(path);
            }
        }
        if !path.is_file() {
            return Err(ManifestError::EnvVarNoFile { path });
        }
        return Ok(Some(path));
    }
    Ok(base_dir.and_then(search_from))
}

/// Steps 2 and 3 of the lookup: `idempotent.toml` in `dir`, else at the root
/// of the workspace `dir` belongs to ([`workspace_root`]).
pub fn search_from(dir: &Path) -> Option<PathBuf> {
    let package = dir.ancestors().find(|d| d.join("Cargo.toml").is_file());
    [Some(dir), package]
        .into_iter()
        .flatten()
        .map(|d| d.join(FILE_NAME))
        .find(|beside| beside.is_file())
        .or_else(|| {
            let candidate = workspace_root(dir)?.join(FILE_NAME);
            candidate.is_file().then_some(candidate)
        })
}

/// The root of the cargo workspace `dir` belongs to, found as cargo finds
/// it. The package is the nearest directory at or above `dir` with a
/// `Cargo.toml` (the command line may run in `crate/src`). Its root is the
/// package itself when its `Cargo.toml` has a `[workspace]`; the root its
/// `package.workspace` names; otherwise the nearest directory above with a
/// `[workspace]` that does not exclude it (a `members` entry that names it
/// or a directory above it, literally, wins over an `exclude` one, as in
/// cargo, where a glob does not; an excluded package is looked for further
/// up, and with no root above is a workspace of its own). A package outside the
/// root's directory that names it, or one inside it that is excluded, was
/// checked against the wrong manifest, or none.
pub fn workspace_root(dir: &Path) -> Option<PathBuf> {
    let (package, own) = dir
        .ancestors()
        .find_map(|d| read_toml(&d.join("Cargo.toml")).map(|t| (d, t)))?;
    if own.contains_key("workspace") {
        return Some(package.to_path_buf());
    }
    let named = own
        .get("package")
        .and_then(|p| p.get("workspace"))
        .and_then(toml::Value::as_str);
    if let Some(named) = named {
        return Some(package.join(named));
    }
    package.ancestors().skip(1).find_map(|ancestor| {
        let workspace = read_toml(&ancestor.join("Cargo.toml"))?
            .get("workspace")?
            .clone();
        let below = plain(package.strip_prefix(ancestor).ok()?);
        let listed = |key: &str| {
            workspace
                .get(key)
                .and_then(toml::Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(toml::Value::as_str)
                .map(|entry| plain(Path::new(entry)))
                .collect::<Vec<_>>()
        };
        let member = listed("members").iter().any(|m| below.starts_with(m));
        // An entry may name the package's `Cargo.toml` itself.
        let excluded = listed("exclude").iter().any(|e| {
            below.starts_with(e) || (e.ends_with("Cargo.toml") && e.parent() == Some(&*below))
        });
        (member || !excluded).then(|| ancestor.to_path_buf())
    })
}

/// A `Cargo.toml`, if it is there and parses.
fn read_toml(path: &Path) -> Option<toml::Table> {
    std::fs::read_to_string(path).ok()?.parse().ok()
}

/// `p` without `.` components.
fn plain(p: &Path) -> PathBuf {
    p.components()
        .filter(|c| !matches!(c, std::path::Component::CurDir))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"
        [scopes."orders.place"]
        description = "placing an order"
        ttl = "48h"
        [scopes."orders.cancel"]
        lease = "5s"
        [retired."orders.place_v1"]
        reason = "renamed to orders.place"
    "#;

    #[test]
    fn reads_the_documented_format() {
        let m = Manifest::parse(TEXT).unwrap();
        let s = &m.scopes["orders.place"];
        assert_eq!(s.description.as_deref(), Some("placing an order"));
        assert_eq!(s.ttl, Some(Duration::from_secs(48 * 3600)));
        assert_eq!(s.lease, None);
        assert_eq!(
            m.scopes["orders.cancel"].lease,
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            m.retired["orders.place_v1"].reason.as_deref(),
            Some("renamed to orders.place")
        );
        assert_eq!(m.path, Path::new("<string>"));
        assert_eq!(
            Manifest::parse("").unwrap(),
            Manifest {
                path: "<string>".into(),
                ..Manifest::default()
            }
        );
    }

    #[test]
    fn declared_retired_and_unknown() {
        let m = Manifest::parse(TEXT).unwrap();
        assert_eq!(
            m.check_scope("orders.place"),
            Ok(ScopeDefaults {
                ttl: Some(Duration::from_secs(48 * 3600)),
                lease: None
            })
        );
        let retired = m.check_scope("orders.place_v1").unwrap_err().to_string();
        assert!(retired.contains("\"renamed to orders.place\""), "{retired}");
        assert!(
            retired.contains("use the scope that replaced it"),
            "{retired}"
        );
        let unknown = m.check_scope("orders.plase").unwrap_err().to_string();
        assert!(
            unknown.contains("did you mean `orders.place`?"),
            "{unknown}"
        );
        assert!(
            unknown.contains("declare it there: [scopes.\"orders.plase\"]"),
            "{unknown}"
        );
        // A name too far from every declared one gets no suggestion.
        let far = m.check_scope("standalone.job").unwrap_err().to_string();
        assert!(!far.contains("did you mean"), "{far}");
        let empty = Manifest::parse("").unwrap();
        assert_eq!(
            empty.check_scope("a"),
            Err(MembershipError::Undeclared {
                scope: "a".into(),
                nearest: None,
                manifest: "<string>".into()
            })
        );
    }

    #[test]
    fn every_problem_is_listed() {
        let e = Manifest::parse(
            "[scopes.\"A.b\"]\nttl = \"soon\"\nlease = \"5ms\"\n[scopes.\"c\"]\n[retired.\"c\"]\n[retired.\"x..y\"]\n",
        )
        .unwrap_err();
        let ManifestError::Invalid { problems, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(problems.len(), 5, "{e}");
        assert!(
            matches!(&problems[0], ManifestProblem::ScopeName { table: "scopes", scope, .. } if scope == "A.b")
        );
        assert!(matches!(
            &problems[1],
            ManifestProblem::Duration {
                field: "ttl",
                error: DurationError::NotADuration { .. },
                ..
            }
        ));
        assert!(matches!(
            &problems[2],
            ManifestProblem::Duration {
                field: "lease",
                error: DurationError::BelowMinimum { .. },
                ..
            }
        ));
        assert!(
            matches!(&problems[3], ManifestProblem::DeclaredAndRetired { scope } if scope == "c")
        );
        assert!(matches!(
            &problems[4],
            ManifestProblem::ScopeName {
                table: "retired",
                ..
            }
        ));
        let text = e.to_string();
        assert!(
            text.contains("[scopes.\"A.b\"] ttl: `ttl` is not a duration"),
            "{text}"
        );
        assert!(text.contains("below the minimum of 10ms"), "{text}");
    }

    #[test]
    fn bad_shapes_are_parse_errors() {
        for (text, expected) in [
            ("[scopes.\"a\"]\nttl = 5", "ttl"),
            ("[scope.\"a\"]", "scope"),
            ("[scopes.\"a.b\"]\ntll = \"1h\"\n", "tll"),
            ("[scopes\n", "line 1"),
            ("[retired.\"a\"]\ndescription = \"x\"\n", "description"),
        ] {
            let e = Manifest::parse(text).unwrap_err();
            assert!(matches!(e, ManifestError::Parse { .. }), "{text}: {e}");
            assert!(e.to_string().contains(expected), "{text}: {e}");
        }
    }

    #[test]
    fn load_names_the_file() {
        let e = Manifest::load("/nonexistent/idempotent.toml").unwrap_err();
        assert!(matches!(e, ManifestError::Io { .. }));
        assert!(
            e.to_string().contains("`/nonexistent/idempotent.toml`"),
            "{e}"
        );
    }

    #[test]
    fn serializes_durations_as_text() {
        let m = Manifest::parse("[scopes.\"a\"]\nttl = \"90s\"\n").unwrap();
        let json = toml::to_string(&m).unwrap();
        assert!(json.contains("ttl = \"1m 30s\""), "{json}");
    }

    struct Scratch(PathBuf);
    impl Scratch {
        fn new(name: &str) -> Self {
            let root =
                std::env::temp_dir().join(format!("idem-rules-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("member")).unwrap();
            Scratch(root)
        }

        /// A workspace root (its `Cargo.toml` says `workspace`) with one
        /// package in `member`.
        fn workspace(name: &str, workspace: &str) -> Self {
            let scratch = Scratch::new(name);
            std::fs::write(scratch.0.join("Cargo.toml"), workspace).unwrap();
            let member = scratch.0.join("member").join("Cargo.toml");
            std::fs::write(member, "[package]\nname = \"m\"\n").unwrap();
            scratch
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn lookup_order() {
        let scratch = Scratch::workspace("lookup", "[workspace]\nmembers = [\"member\"]\n");
        let root = &scratch.0;
        let member = root.join("member");
        // 3 before 2: nothing, then the workspace root.
        assert_eq!(locate_with(None, Some(&member)).unwrap(), None);
        std::fs::write(root.join(FILE_NAME), "").unwrap();
        assert_eq!(
            locate_with(None, Some(&member)).unwrap(),
            Some(root.join(FILE_NAME))
        );
        // 2: beside the crate wins over the workspace root.
        std::fs::write(member.join(FILE_NAME), "").unwrap();
        assert_eq!(
            locate_with(None, Some(&member)).unwrap(),
            Some(member.join(FILE_NAME))
        );
        // 1: the variable wins over both; relative to the base directory; empty is unset.
        std::fs::write(root.join("other.toml"), "").unwrap();
        assert_eq!(
            locate_with(Some(OsStr::new("../other.toml")), Some(&member)).unwrap(),
            Some(member.join("../other.toml"))
        );
        assert_eq!(
            locate_with(Some(OsStr::new("")), Some(&member)).unwrap(),
            Some(member.join(FILE_NAME))
        );
        let e = locate_with(Some(OsStr::new("nope.toml")), Some(&member)).unwrap_err();
        assert!(
            matches!(&e, ManifestError::EnvVarNoFile { path } if *path == member.join("nope.toml"))
        );
        assert!(
            e.to_string().contains("IDEMPOTENT_MANIFEST is set to"),
            "{e}"
        );
        // No base directory: only the variable.
        assert_eq!(locate_with(None, None).unwrap(), None);
    }

    #[test]
    fn the_workspace_root_is_the_nearest_workspace() {
        let scratch = Scratch::new("nearest");
        let root = &scratch.0;
        let member = root.join("member");
        std::fs::write(root.join("Cargo.toml"), "[workspace]\n").unwrap();
        std::fs::write(root.join(FILE_NAME), "").unwrap();
        // A member that is itself a workspace root stops the walk there.
        std::fs::write(
            member.join("Cargo.toml"),
            "[workspace]\n[package]\nname = \"m\"\n",
        )
        .unwrap();
        assert_eq!(search_from(&member), None);
    }

    /// As cargo finds the root: a package the root's `exclude` lists is a
    /// workspace of its own (it was checked against the root's manifest), and
    /// a member outside the root's directory that names the root with
    /// `package.workspace` gets the root's manifest (it got none).
    #[test]
    fn the_workspace_root_is_the_one_cargo_finds() {
        let scratch = Scratch::workspace(
            "cargo-root",
            "[workspace]\nmembers = [\"member\", \"../outside\"]\nexclude = [\"./excl\"]\n",
        );
        let root = &scratch.0;
        std::fs::write(root.join(FILE_NAME), "").unwrap();
        let member = root.join("member");
        assert_eq!(search_from(&member), Some(root.join(FILE_NAME)));
        let excluded = root.join("excl").join("inner");
        std::fs::create_dir_all(&excluded).unwrap();
        std::fs::write(excluded.join("Cargo.toml"), "[package]\nname = \"x\"\n").unwrap();
        assert_eq!(workspace_root(&excluded), None);
        assert_eq!(search_from(&excluded), None);
        // A directory that is not a package (the command line's current
        // directory) still finds the root above it.
        assert_eq!(search_from(&root.join("excl")), Some(root.join(FILE_NAME)));
        let outside = root.with_extension("outside");
        std::fs::create_dir_all(&outside).unwrap();
        let name = root.file_name().unwrap().to_str().unwrap();
        std::fs::write(
            outside.join("Cargo.toml"),
            format!("[package]\nname = \"o\"\nworkspace = \"../{name}\"\n"),
        )
        .unwrap();
        assert_eq!(
            search_from(&outside),
            Some(outside.join("..").join(name).join(FILE_NAME))
        );
        // From a directory inside a package (the command line in `crate/src`):
        // the package's answer, as cargo gives it.
        std::fs::create_dir_all(outside.join("src")).unwrap();
        assert_eq!(
            search_from(&outside.join("src")),
            Some(outside.join("..").join(name).join(FILE_NAME))
        );
        std::fs::create_dir_all(excluded.join("src")).unwrap();
        assert_eq!(search_from(&excluded.join("src")), None);
        let _ = std::fs::remove_dir_all(&outside);
    }

    /// From inside a package (the command line in `crate/src`), the
    /// package's own manifest comes before the workspace root's, as it does
    /// for the compiler check.
    #[test]
    fn inside_a_package_its_own_manifest_comes_first() {
        let scratch = Scratch::workspace("inside", "[workspace]\nmembers = [\"member\"]\n");
        let root = &scratch.0;
        let member = root.join("member");
        std::fs::write(root.join(FILE_NAME), "").unwrap();
        std::fs::write(member.join(FILE_NAME), "").unwrap();
        std::fs::create_dir_all(member.join("src")).unwrap();
        assert_eq!(
            search_from(&member.join("src")),
            Some(member.join(FILE_NAME))
        );
        assert_eq!(search_from(&member), Some(member.join(FILE_NAME)));
    }

    /// A `members` entry that names a package (literally, as cargo reads it
    /// here; a glob does not) wins over an `exclude` entry above it, and a
    /// package an inner root excludes belongs to an outer root that lists it.
    #[test]
    fn members_win_over_exclude_and_an_excluded_package_looks_further_up() {
        let scratch = Scratch::new("members");
        let root = &scratch.0;
        std::fs::write(
            root.join("Cargo.toml"),
            "[workspace]\nmembers = [\"tools/*\", \"tools/x\", \"inner/pkg\"]\nexclude = [\"tools\"]\n",
        )
        .unwrap();
        let tool = root.join("tools").join("x");
        std::fs::create_dir_all(&tool).unwrap();
        std::fs::write(tool.join("Cargo.toml"), "[package]\nname = \"x\"\n").unwrap();
        assert_eq!(workspace_root(&tool), Some(root.clone()));
        let globbed = root.join("tools").join("y");
        std::fs::create_dir_all(&globbed).unwrap();
        std::fs::write(globbed.join("Cargo.toml"), "[project]\nname = \"y\"\n").unwrap();
        assert_eq!(
            workspace_root(&globbed),
            None,
            "only the glob names it: excluded"
        );
        std::fs::write(
            root.join("Cargo.toml"),
            "[workspace]\nexclude = [\"tools/y/Cargo.toml\"]\n",
        )
        .unwrap();
        assert_eq!(workspace_root(&globbed), None, "excluded by its Cargo.toml");
        std::fs::write(
            root.join("Cargo.toml"),
            "[workspace]\nmembers = [\"inner/pkg\"]\n",
        )
        .unwrap();
        let inner = root.join("inner");
        let pkg = inner.join("pkg");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::write(
            inner.join("Cargo.toml"),
            "[workspace]\nexclude = [\"pkg\"]\n",
        )
        .unwrap();
        std::fs::write(pkg.join("Cargo.toml"), "[package]\nname = \"p\"\n").unwrap();
        assert_eq!(workspace_root(&pkg), Some(root.clone()));
    }
}
