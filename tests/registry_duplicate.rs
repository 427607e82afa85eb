//! Two crates claiming one scope: the macro cannot see across crates, so
//! `registry::validate()` must report it, naming both sites. The second
//! "crate" is a registration submitted by hand, exactly as generated code does.
//! (Its own test binary: the duplicate would fail every other registry test.)

use idempotent_runtime::__private::{
    inventory, ErrorPolicy, InProgressPolicy, Registration, ScopeInfo, ScopeSpec,
};
use idempotent_runtime::registry::{self, RegistryError};
use idempotent_runtime::{idempotent, Error};
use std::time::Duration;

#[idempotent(scope = "dup_test.orders.place", key = key, tenant = shared)]
async fn place(key: &str, sku: &str) -> Result<String, Error> {
    Ok(sku.to_owned())
}
const PLACE_LINE: u32 = line!() - 3;

static OTHER_CRATE: ScopeInfo = ScopeInfo::new(ScopeSpec {
    scope: "dup_test.orders.place",
    function: "legacy_orders::api::place_order",
    file: "legacy-orders/src/api.rs",
    line: 120,
    ttl: Duration::from_secs(24 * 3600),
    lease: Duration::from_secs(30),
    in_progress: InProgressPolicy::Reject,
    errors: ErrorPolicy::Release,
    transactional: false,
    fingerprinted: true,
    fingerprinted_parameters: &["sku"],
    shared_tenant: true,
    recover: None,
    shared_scope: false,
});
inventory::submit! { Registration(&OTHER_CRATE) }

// A scope claimed once is not reported.
static LONE: ScopeInfo = ScopeInfo::new(ScopeSpec {
    scope: "dup_test.orders.cancel",
    function: "legacy_orders::api::cancel",
    file: "legacy-orders/src/api.rs",
    line: 200,
    ttl: Duration::from_secs(24 * 3600),
    lease: Duration::from_secs(30),
    in_progress: InProgressPolicy::Reject,
    errors: ErrorPolicy::Release,
    transactional: false,
    fingerprinted: true,
    fingerprinted_parameters: &[],
    shared_tenant: true,
    recover: None,
    shared_scope: false,
});
inventory::submit! { Registration(&LONE) }

#[test]
fn validate_names_both_sites_of_a_cross_crate_duplicate() {
    drop(place("k", "sku")); // exists to be registered
    let err = registry::validate().expect_err("one scope, two functions");
    let RegistryError::DuplicateScopes(dups) = &err else {
        panic!("unexpected error {err:?}");
    };
    assert_eq!(dups.len(), 1, "{dups:#?}");
    assert_eq!(dups[0].scope, "dup_test.orders.place");
    assert_eq!(dups[0].sites.len(), 2);

    let message = err.to_string();
    let here = format!("`{}::place` at {}:{}", module_path!(), file!(), PLACE_LINE);
    assert!(message.contains(&here), "{message}");
    assert!(
        message.contains("`legacy_orders::api::place_order` at legacy-orders/src/api.rs:120"),
        "{message}"
    );
    assert!(message.contains("dup_test.orders.place"), "{message}");
    assert!(!message.contains("dup_test.orders.cancel"), "{message}");
    assert!(
        message.contains("give each function its own scope"),
        "{message}"
    );
}
