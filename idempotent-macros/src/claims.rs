//! Two functions claiming one scope in one crate (DESIGN.md rule 18).
//!
//! The compiler expands every `#[idempotent]` of a crate in one process, so a
//! process-wide table keyed by (crate, scope) sees every claim. The same
//! function expanding twice (rust-analyzer, re-expansion) is not a duplicate:
//! a site is identified by its file and function name.
//!
//! Limitation: claims in *different* crates are not visible here; the runtime's
//! `registry::validate()` reports them when the program starts.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Where a scope was claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Site {
    pub function: String,
    pub file: String,
    pub line: usize,
}

type Table = HashMap<(String, String), Site>;

fn table() -> &'static Mutex<Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// The crate being compiled, as cargo names it.
pub(crate) fn current_crate() -> String {
    let get = |v: &str| std::env::var(v).unwrap_or_default();
    format!("{}/{}", get("CARGO_PKG_NAME"), get("CARGO_CRATE_NAME"))
}

/// Records `site` as the owner of `scope` in `krate`; returns the other site if
/// another function already owns it.
pub(crate) fn claim(krate: &str, scope: &str, site: Site) -> Result<(), Site> {
    let mut table = table().lock().unwrap_or_else(|p| p.into_inner());
    let key = (krate.to_owned(), scope.to_owned());
    match table.get_mut(&key) {
        Some(existing) if existing.file == site.file && existing.function == site.function => {
            *existing = site; // the same function, expanded again (maybe after an edit)
            Ok(())
        }
        Some(existing) => Err(existing.clone()),
        None => {
            table.insert(key, site);
            Ok(())
        }
    }
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

    #[test]
    fn second_function_is_refused_same_function_is_not() {
        assert_eq!(claim("t/a", "x.y", site("first", 3)), Ok(()));
        assert_eq!(claim("t/a", "x.y", site("first", 5)), Ok(()));
        assert_eq!(
            claim("t/a", "x.y", site("second", 9)),
            Err(site("first", 5))
        );
        assert_eq!(claim("t/b", "x.y", site("second", 9)), Ok(()));
    }
}
