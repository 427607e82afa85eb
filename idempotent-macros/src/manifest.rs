//! The scope manifest, `idempotent.toml`, read when the code compiles.
//!
//! Where it is looked for, first match wins:
//! 1. the file named by the `IDEMPOTENT_MANIFEST` environment variable (relative
//!    paths are relative to the crate's directory); it must exist;
//! 2. `idempotent.toml` beside the crate's `Cargo.toml` (`CARGO_MANIFEST_DIR`);
//! 3. `idempotent.toml` at the workspace root: the nearest ancestor directory
//!    whose `Cargo.toml` has a `[workspace]` table.
//!
//! No manifest: only the scope format is checked.

use crate::duration::{self, Kind};
use crate::scope;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The file's name.
pub(crate) const FILE_NAME: &str = "idempotent.toml";
/// The environment variable that names a manifest explicitly.
pub(crate) const ENV_VAR: &str = "IDEMPOTENT_MANIFEST";

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct Manifest {
    #[serde(default)]
    pub scopes: BTreeMap<String, Declared>,
    #[serde(default)]
    pub retired: BTreeMap<String, Retired>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct Declared {
    #[serde(default)]
    #[allow(dead_code)] // documentation for humans and the CLI
    pub description: Option<String>,
    pub ttl: Option<String>,
    pub lease: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct Retired {
    pub reason: Option<String>,
}

/// What the manifest says about one scope.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Defaults {
    pub ttl: Option<Duration>,
    pub lease: Option<Duration>,
}

/// Finds the manifest. `Err` when `IDEMPOTENT_MANIFEST` names a file that does not exist.
pub(crate) fn locate() -> Result<Option<PathBuf>, String> {
    let crate_dir = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from);
    if let Some(explicit) = std::env::var_os(ENV_VAR).filter(|v| !v.is_empty()) {
        let mut path = PathBuf::from(explicit);
        if path.is_relative() {
            if let Some(dir) = &crate_dir {
                path = dir.join(path);
            }
        }
        if !path.is_file() {
            return Err(format!(
                "{ENV_VAR} is set to `{}`, but there is no file there; point it at a scope \
                 manifest or unset it",
                path.display()
            ));
        }
        return Ok(Some(path));
    }
    let Some(crate_dir) = crate_dir else {
        return Ok(None);
    };
    Ok(search_from(&crate_dir))
}

/// `idempotent.toml` beside the crate, else at the workspace root.
pub(crate) fn search_from(crate_dir: &Path) -> Option<PathBuf> {
    let beside = crate_dir.join(FILE_NAME);
    if beside.is_file() {
        return Some(beside);
    }
    for dir in crate_dir.ancestors() {
        let cargo_toml = dir.join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&cargo_toml) else {
            continue;
        };
        let is_workspace = text
            .parse::<toml::Table>()
            .map(|t| t.contains_key("workspace"))
            .unwrap_or(false);
        if is_workspace {
            let candidate = dir.join(FILE_NAME);
            return candidate.is_file().then_some(candidate);
        }
    }
    None
}

/// Reads and parses the manifest.
pub(crate) fn load(path: &Path) -> Result<Manifest, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the scope manifest `{}`: {e}", path.display()))?;
    parse(&text).map_err(|e| {
        format!(
            "the scope manifest `{}` is not valid: {}",
            path.display(),
            e.trim_end()
        )
    })
}

pub(crate) fn parse(text: &str) -> Result<Manifest, String> {
    toml::from_str(text).map_err(|e| e.to_string())
}

/// Checks one scope against the manifest; returns its defaults.
pub(crate) fn check(
    manifest: &Manifest,
    scope_name: &str,
    path: &Path,
) -> Result<Defaults, String> {
    if let Some(retired) = manifest.retired.get(scope_name) {
        let reason = retired
            .reason
            .as_deref()
            .map(|r| format!(": \"{r}\""))
            .unwrap_or_default();
        return Err(format!(
            "scope `{scope_name}` is retired in `{}`{reason}. A retired name must not be \
             claimed again (new records would mix with old ones); use the scope that replaced it",
            path.display()
        ));
    }
    let Some(declared) = manifest.scopes.get(scope_name) else {
        let hint =
            match scope::nearest(scope_name, manifest.scopes.keys().map(String::as_str), None) {
                Some(near) => format!("did you mean `{near}`? "),
                None => String::new(),
            };
        return Err(format!(
            "scope `{scope_name}` is not declared in the scope manifest `{}`; {hint}\
             If this is a new operation, declare it there: [scopes.\"{scope_name}\"]",
            path.display()
        ));
    };
    let mut problems = Vec::new();
    let mut duration_of = |text: &Option<String>, kind: Kind, name: &str| {
        text.as_deref()
            .and_then(|t| match duration::parse(t, kind) {
                Ok(d) => Some(d),
                Err(e) => {
                    problems.push(format!(
                        "in `{}`, [scopes.\"{scope_name}\"] {name}: {e}",
                        path.display()
                    ));
                    None
                }
            })
    };
    let defaults = Defaults {
        ttl: duration_of(&declared.ttl, Kind::Ttl, "ttl"),
        lease: duration_of(&declared.lease, Kind::Lease, "lease"),
    };
    if problems.is_empty() {
        Ok(defaults)
    } else {
        Err(problems.join("; "))
    }
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
    fn declared_retired_and_unknown() {
        let m = parse(TEXT).unwrap();
        let path = Path::new("idempotent.toml");
        assert_eq!(
            check(&m, "orders.place", path),
            Ok(Defaults {
                ttl: Some(Duration::from_secs(48 * 3600)),
                lease: None
            })
        );
        let retired = check(&m, "orders.place_v1", path).unwrap_err();
        assert!(retired.contains("\"renamed to orders.place\""), "{retired}");
        let unknown = check(&m, "orders.plase", path).unwrap_err();
        assert!(
            unknown.contains("did you mean `orders.place`?"),
            "{unknown}"
        );
    }

    #[test]
    fn bad_manifests_are_explained() {
        assert!(parse("[scopes.\"a\"]\nttl = 5")
            .unwrap_err()
            .contains("ttl"));
        assert!(parse("[scope.\"a\"]").unwrap_err().contains("scope"));
        let m = parse("[scopes.\"a\"]\nttl = \"forever\"").unwrap();
        assert!(check(&m, "a", Path::new("m.toml"))
            .unwrap_err()
            .contains("not a duration"));
    }

    #[test]
    fn finds_the_workspace_manifest() {
        let root = std::env::temp_dir().join(format!("idem-manifest-{}", std::process::id()));
        let member = root.join("member");
        std::fs::create_dir_all(&member).unwrap();
        std::fs::write(
            root.join("Cargo.toml"),
            "[workspace]\nmembers = [\"member\"]\n",
        )
        .unwrap();
        std::fs::write(member.join("Cargo.toml"), "[package]\nname = \"m\"\n").unwrap();
        assert_eq!(search_from(&member), None);
        std::fs::write(root.join(FILE_NAME), "").unwrap();
        assert_eq!(search_from(&member), Some(root.join(FILE_NAME)));
        std::fs::write(member.join(FILE_NAME), "").unwrap();
        assert_eq!(search_from(&member), Some(member.join(FILE_NAME)));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
