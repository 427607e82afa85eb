//! The scope manifest, `idempotent.toml`: the scopes a project declares and
//! the names it has retired.
//!
//! ```toml
//! [scopes."orders.place"]
//! description = "placing an order"
//! ttl = "24h"            # optional default for this scope; the attribute wins
//! lease = "30s"          # optional
//!
//! [retired."orders.place_v1"]
//! reason = "renamed to orders.place"
//! ```
//!
//! The schema, its checks and where the file is looked for are the ones the
//! `#[idempotent]` macro applies when the code compiles: both use the
//! `idempotent-rules` crate, re-exported here, so the macro and the
//! `idempotent` command line give the same verdict on the same file (see
//! [`locate`] for the lookup order). This module adds the run-time side:
//! rendering a manifest for the command line and [`audit`](crate::audit)
//! against a manifest instead of a binary's registry. Enabled by the
//! `manifest` feature.

pub use idempotent_rules::duration::{parse_duration, DurationError, DurationKind};
pub use idempotent_rules::manifest::{
    locate, locate_with, search_from, DeclaredScope, Manifest, ManifestError, ManifestProblem,
    MembershipError, RetiredScope, ScopeDefaults, ENV_VAR, FILE_NAME,
};
pub use idempotent_rules::scope::{check_scope, ScopeError, MAX_SCOPE_BYTES};

use std::time::Duration;

/// A manifest as a table (one row per declared and retired scope) or JSON.
///
/// ```
/// use idempotent_runtime::{manifest::{render, Manifest}, registry::Format};
/// let m = Manifest::parse("[scopes.\"a.b\"]\nttl = \"1h\"\n")?;
/// assert!(render(&m, Format::Table).contains("a.b"));
/// # Ok::<(), idempotent_runtime::manifest::ManifestError>(())
/// ```
pub fn render(manifest: &Manifest, format: crate::registry::Format) -> String {
    match format {
        crate::registry::Format::Json => crate::registry::to_json(manifest),
        crate::registry::Format::Table => {
            let opt = |d: &Option<Duration>| d.map_or("-".to_owned(), crate::registry::human);
            let mut rows: Vec<Vec<String>> = manifest
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
            rows.extend(manifest.retired.iter().map(|(name, r)| {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Format;

    #[test]
    fn renders_declared_and_retired() {
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
        let table = render(&m, Format::Table);
        assert!(table.contains("orders.place_v1"), "{table}");
        assert!(table.contains("renamed to orders.place"), "{table}");
        let json: serde_json::Value = serde_json::from_str(&render(&m, Format::Json)).unwrap();
        assert_eq!(json["scopes"]["orders.place"]["ttl"], "1day");
        assert_eq!(
            json["retired"]["orders.place_v1"]["reason"],
            "renamed to orders.place"
        );
        assert!(json.get("path").is_none());
    }
}
