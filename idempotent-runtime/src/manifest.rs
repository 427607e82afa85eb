//! The scope manifest, `idempotent.toml`: the scopes a project declares and
//! the names it has retired.
//!
//! ```toml
//! [scopes."orders.place"]
//! description = "placing an order"
//! ttl = "24h"            # optional default for this scope; the attribute wins
//!
//! [retired."orders.place_v1"]
//! reason = "renamed to orders.place"
//! ```
//!
//! The `#[idempotent]` macro reads the same file when the code compiles (it
//! refuses undeclared and retired scopes); this reader serves the run-time
//! side: the `idempotent` command line and [`audit`](crate::audit) against a
//! manifest instead of a binary's registry. Enabled by the `manifest` feature.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The longest scope name accepted, in bytes.
pub const MAX_SCOPE_LEN: usize = 128;

/// A parsed `idempotent.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Manifest {
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

fn ser_opt_duration<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(&crate::registry::human(*d)),
        None => s.serialize_none(),
    }
}

/// Why a manifest could not be read. Each message names the file and says
/// what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// The file could not be read.
    #[error(
        "cannot read scope manifest {path}: {source}; pass the right file with --manifest PATH"
    )]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("scope manifest {path} is not valid: {message}")]
    Parse {
        /// The file (`<string>` when parsed from a string).
        path: PathBuf,
        /// The TOML parser's message, with line and column.
        message: String,
    },
    /// A duration field could not be parsed.
    #[error("scope manifest {path}: `{field}` of scope `{scope}` is {value:?}, which is not a duration ({message}); write it like \"24h\", \"30s\" or \"1h 30m\"")]
    Duration {
        /// The file.
        path: PathBuf,
        /// The scope whose entry holds the field.
        scope: String,
        /// `ttl` or `lease`.
        field: &'static str,
        /// The text found.
        value: String,
        /// The parser's message.
        message: String,
    },
    /// A scope name does not have the required format.
    #[error("scope manifest {path}: scope name {scope:?} is invalid: {problem}")]
    BadScopeName {
        /// The file.
        path: PathBuf,
        /// The offending name.
        scope: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A name is both declared and retired.
    #[error("scope manifest {path}: `{scope}` is both declared and retired; remove it from one of [scopes] and [retired]")]
    DeclaredAndRetired {
        /// The file.
        path: PathBuf,
        /// The name.
        scope: String,
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

// Unknown keys are refused, as the macro refuses them when the code compiles:
// a typo such as `tll` must not be silently ignored by one reader only.
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

/// Checks a scope name: lowercase segments of `[a-z0-9_-]+` joined by `.`,
/// at most [`MAX_SCOPE_LEN`] bytes. Returns what is wrong, if anything.
///
/// ```
/// use idempotent_runtime::manifest::scope_name_problem;
/// assert_eq!(scope_name_problem("orders.place"), None);
/// assert!(scope_name_problem("Orders..place").is_some());
/// ```
pub fn scope_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("it is empty".into());
    }
    if name.len() > MAX_SCOPE_LEN {
        return Some(format!(
            "it is {} bytes long; the limit is {MAX_SCOPE_LEN}",
            name.len()
        ));
    }
    for (i, segment) in name.split('.').enumerate() {
        if segment.is_empty() {
            return Some(format!(
                "segment {} is empty; join non-empty segments with single dots",
                i + 1
            ));
        }
        if let Some(c) = segment
            .chars()
            .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '_' | '-'))
        {
            return Some(format!(
                "it contains {c:?}; use lowercase letters, digits, `_` and `-` in segments joined by `.`"
            ));
        }
    }
    None
}

impl Manifest {
    /// The conventional file name, looked for in the current directory by the CLI.
    pub const FILE_NAME: &'static str = "idempotent.toml";

    /// Reads and checks a manifest file.
    ///
    /// ```no_run
    /// let m = idempotent_runtime::manifest::Manifest::load("idempotent.toml")?;
    /// for name in m.scopes.keys() { println!("{name}"); }
    /// # Ok::<(), idempotent_runtime::manifest::ManifestError>(())
    /// ```
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ManifestError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ManifestError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse_named(&text, path)
    }

    /// Parses manifest text (errors name the file as `<string>`).
    ///
    /// ```
    /// use idempotent_runtime::manifest::Manifest;
    /// let m = Manifest::parse(r#"
    ///     [scopes."orders.place"]
    ///     ttl = "24h"
    ///     [retired."orders.place_v1"]
    ///     reason = "renamed to orders.place"
    /// "#)?;
    /// assert_eq!(m.scopes["orders.place"].ttl, Some(std::time::Duration::from_secs(86_400)));
    /// assert!(m.is_retired("orders.place_v1"));
    /// # Ok::<(), idempotent_runtime::manifest::ManifestError>(())
    /// ```
    pub fn parse(text: &str) -> Result<Self, ManifestError> {
        Self::parse_named(text, Path::new("<string>"))
    }

    fn parse_named(text: &str, path: &Path) -> Result<Self, ManifestError> {
        let raw: RawManifest = toml::from_str(text).map_err(|e| ManifestError::Parse {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let duration = |scope: &str, field: &'static str, value: Option<String>| {
            value
                .map(|v| {
                    humantime::parse_duration(&v).map_err(|e| ManifestError::Duration {
                        path: path.to_owned(),
                        scope: scope.to_owned(),
                        field,
                        value: v.clone(),
                        message: e.to_string(),
                    })
                })
                .transpose()
        };
        let check = |name: &str| match scope_name_problem(name) {
            Some(problem) => Err(ManifestError::BadScopeName {
                path: path.to_owned(),
                scope: name.to_owned(),
                problem,
            }),
            None => Ok(()),
        };
        let mut manifest = Manifest::default();
        for (name, s) in raw.scopes {
            check(&name)?;
            let entry = DeclaredScope {
                ttl: duration(&name, "ttl", s.ttl)?,
                lease: duration(&name, "lease", s.lease)?,
                description: s.description,
            };
            manifest.scopes.insert(name, entry);
        }
        for (name, r) in raw.retired {
            check(&name)?;
            if manifest.scopes.contains_key(&name) {
                return Err(ManifestError::DeclaredAndRetired {
                    path: path.to_owned(),
                    scope: name,
                });
            }
            manifest
                .retired
                .insert(name, RetiredScope { reason: r.reason });
        }
        Ok(manifest)
    }

    /// Whether `scope` is declared.
    pub fn is_declared(&self, scope: &str) -> bool {
        self.scopes.contains_key(scope)
    }

    /// Whether `scope` is retired.
    pub fn is_retired(&self, scope: &str) -> bool {
        self.retired.contains_key(scope)
    }

    /// The manifest as a table (one row per declared and retired scope) or JSON.
    ///
    /// ```
    /// use idempotent_runtime::{manifest::Manifest, registry::Format};
    /// let m = Manifest::parse("[scopes.\"a.b\"]\nttl = \"1h\"\n")?;
    /// assert!(m.render(Format::Table).contains("a.b"));
    /// # Ok::<(), idempotent_runtime::manifest::ManifestError>(())
    /// ```
    pub fn render(&self, format: crate::registry::Format) -> String {
        match format {
            crate::registry::Format::Json => crate::registry::to_json(self),
            crate::registry::Format::Table => {
                let opt = |d: &Option<Duration>| d.map_or("-".to_owned(), crate::registry::human);
                let mut rows: Vec<Vec<String>> = self
                    .scopes
                    .iter()
                    .map(|(name, s)| {
                        vec![
                            name.clone(),
                            "declared".into(),
                            opt(&s.ttl),
                            opt(&s.lease),
                            s.description.clone().unwrap_or_default(),
                        ]
                    })
                    .collect();
                rows.extend(self.retired.iter().map(|(name, r)| {
                    vec![
                        name.clone(),
                        "retired".into(),
                        "-".into(),
                        "-".into(),
                        r.reason.clone().unwrap_or_default(),
                    ]
                }));
                crate::table::render(
                    &["scope", "status", "ttl", "lease", "description / reason"],
                    &rows,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_documented_format() {
        let m = Manifest::parse(
            r#"
            [scopes."orders.place"]
            description = "placing an order"
            ttl = "24h"
            [retired."orders.place_v1"]
            reason = "renamed to orders.place"
            "#,
        )
        .unwrap();
        let s = &m.scopes["orders.place"];
        assert_eq!(s.description.as_deref(), Some("placing an order"));
        assert_eq!(s.ttl, Some(Duration::from_secs(24 * 3600)));
        assert_eq!(s.lease, None);
        assert_eq!(
            m.retired["orders.place_v1"].reason.as_deref(),
            Some("renamed to orders.place")
        );
    }

    #[test]
    fn refuses_bad_durations_names_and_overlaps() {
        let e = Manifest::parse("[scopes.\"a.b\"]\nttl = \"soon\"\n").unwrap_err();
        assert!(
            matches!(e, ManifestError::Duration { field: "ttl", .. }),
            "{e}"
        );
        let e = Manifest::parse("[scopes.\"A.b\"]\n").unwrap_err();
        assert!(matches!(e, ManifestError::BadScopeName { .. }), "{e}");
        let e = Manifest::parse("[scopes.\"a.b\"]\n[retired.\"a.b\"]\n").unwrap_err();
        assert!(matches!(e, ManifestError::DeclaredAndRetired { .. }), "{e}");
        let e = Manifest::parse("[scopes.\"a.b\"]\ntll = \"1h\"\n").unwrap_err();
        assert!(e.to_string().contains("tll"), "{e}");
        let e = Manifest::parse("[scopes\n").unwrap_err();
        assert!(matches!(e, ManifestError::Parse { .. }), "{e}");
    }

    #[test]
    fn scope_names() {
        assert_eq!(scope_name_problem("a"), None);
        assert_eq!(scope_name_problem("pay-ments.charge_2"), None);
        assert!(scope_name_problem("").is_some());
        assert!(scope_name_problem(".a").is_some());
        assert!(scope_name_problem("a b").is_some());
        assert!(scope_name_problem(&"a".repeat(129)).is_some());
    }
}
