//! Rule 18 on compiled code: with a scope manifest beside the crate
//! (`idempotent.toml`, the same file the compile-fail cases in
//! `tests/ui-manifest/` use), declared scopes compile, the manifest's `ttl`
//! and `lease` are the defaults of every function in the scope, and a value
//! written in the attribute overrides them. What the manifest may not contain,
//! and the scopes it refuses, are compile errors: those cases are trybuild's
//! (`tests/ui.rs`).

use idempotent_runtime::{idempotent, Error};

/// Declared without defaults: the built-in ttl and lease apply.
#[idempotent(scope = "orders.place", key = key, tenant = shared)]
pub async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

/// Declared with `ttl = "48h"` and `lease = "5s"`; the attribute sets its
/// own ttl, and keeps the manifest's lease.
#[idempotent(scope = "orders.cancel", key = key, tenant = shared, ttl = "1h")]
pub async fn cancel(key: &str) -> Result<u8, Error> {
    Ok(2)
}

/// Never compiled: a `cfg`'d-out twin of a scope is not a duplicate. The
/// attribute comes first, so the macro sees the function, `cfg` and all.
#[idempotent(scope = "orders.cancel", key = key, tenant = shared, lease = "9s")]
#[cfg(any())]
pub async fn cancel_v2(key: &str) -> Result<u8, Error> {
    Ok(3)
}

mod registered {
    use idempotent_runtime::registry::{self, ScopeInfo};
    use std::time::Duration;

    fn registered(scope: &str) -> &'static ScopeInfo {
        registry::scopes()
            .into_iter()
            .find(|s| s.scope == scope)
            .unwrap_or_else(|| panic!("{scope} is not registered"))
    }

    #[test]
    fn a_declared_scope_without_defaults_keeps_the_built_in_ones() {
        let place = registered("orders.place");
        assert_eq!(place.ttl, Duration::from_secs(24 * 3600));
        assert_eq!(place.lease, Duration::from_secs(30));
    }

    #[test]
    fn the_attribute_overrides_the_manifest_and_the_manifest_the_built_in_defaults() {
        let cancel = registered("orders.cancel");
        assert_eq!(cancel.ttl, Duration::from_secs(3600), "the attribute's");
        assert_eq!(cancel.lease, Duration::from_secs(5), "the manifest's");
    }

    #[test]
    fn only_compiled_functions_are_registered() {
        let cancels = registry::scopes()
            .into_iter()
            .filter(|s| s.scope == "orders.cancel")
            .count();
        assert_eq!(cancels, 1);
        assert!(registry::validate().is_ok());
    }
}
