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

/// Rule 18 without the application's help: the first call of any annotated
/// function logs the cross-crate duplicate at ERROR, naming both sites (an
/// application that never called `validate()` heard nothing, and one
/// function's calls could replay the other's results).
#[test]
fn the_first_call_reports_a_cross_crate_duplicate() {
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    #[derive(Clone, Default)]
    struct Errors(Arc<Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            struct Render(String);
            impl tracing::field::Visit for Render {
                fn record_debug(
                    &mut self,
                    field: &tracing::field::Field,
                    value: &dyn std::fmt::Debug,
                ) {
                    self.0.push_str(&format!(" {}={value:?}", field.name()));
                }
            }
            if *event.metadata().level() == tracing::Level::ERROR {
                let mut rendered = Render(String::new());
                event.record(&mut rendered);
                self.0.lock().unwrap().push(rendered.0);
            }
        }
    }

    let errors = Errors::default();
    let subscriber = tracing_subscriber::registry().with(errors.clone());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let _ = place("k", "sku").await;
            let _ = place("k2", "sku").await;
        })
    });
    let logged = errors.0.lock().unwrap().clone();
    let reports: Vec<_> = logged
        .iter()
        .filter(|e| e.contains("dup_test.orders.place"))
        .collect();
    assert_eq!(
        reports.len(),
        1,
        "reported once, at the first call: {logged:#?}"
    );
    assert!(
        reports[0].contains("legacy_orders::api::place_order")
            && reports[0].contains(&format!("{}::place", module_path!())),
        "both sites are named: {}",
        reports[0]
    );
}
