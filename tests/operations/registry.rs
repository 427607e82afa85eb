//! The registry lists every `#[idempotent]` function of this test binary with
//! its file and line, validates, and renders as a table and as JSON.
//! (The cross-crate duplicate lives in `registry_duplicate.rs`, so it cannot
//! poison these tests.)

use idempotent_runtime::__private::{
    inventory, ErrorPolicy, InProgressPolicy, Registration, ScopeInfo, ScopeSpec,
};
use idempotent_runtime::registry::{self, Format};
use idempotent_runtime::{idempotent, Error};
use std::time::Duration;

#[idempotent(scope = "registry_test.charge", key = key, tenant = shared)]
async fn charge(key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount)
}
const CHARGE_LINE: u32 = line!() - 3;

mod nested {
    use idempotent_runtime::{idempotent, Error};

    #[idempotent(scope = "registry_test.refund", key = key, tenant = account, ttl = "1h", in_progress = reject)]
    pub async fn refund(account: &str, key: &str, note: &str) -> Result<String, Error> {
        Ok(note.to_owned())
    }
    pub const REFUND_LINE: u32 = line!() - 3;
}

// A registration as another crate's generated code would submit it.
static HAND_MADE: ScopeInfo = ScopeInfo::new(ScopeSpec {
    scope: "registry_test.hand_made",
    function: "other_crate::shipping::dispatch",
    file: "other-crate/src/shipping.rs",
    line: 42,
    ttl: Duration::from_secs(7 * 24 * 3600),
    lease: Duration::from_secs(90),
    in_progress: InProgressPolicy::Wait(Duration::from_secs(10)),
    errors: ErrorPolicy::RecordIf("other_crate::is_final"),
    transactional: true,
    fingerprinted: true,
    fingerprinted_parameters: &["order", "address"],
    shared_tenant: false,
    recover: None,
    shared_scope: false,
});
inventory::submit! { Registration(&HAND_MADE) }

fn find(scope: &str) -> &'static ScopeInfo {
    registry::scopes()
        .into_iter()
        .find(|i| i.scope == scope)
        .unwrap_or_else(|| {
            panic!(
                "scope {scope} is not in the registry: {:#?}",
                registry::scopes()
            )
        })
}

#[test]
fn annotated_functions_are_listed_with_file_and_line() {
    let charge_info = find("registry_test.charge");
    assert_eq!(charge_info.function, concat!(module_path!(), "::charge"));
    assert_eq!(charge_info.file, file!());
    assert_eq!(charge_info.line, CHARGE_LINE);
    assert_eq!(charge_info.ttl, Duration::from_secs(24 * 3600));
    assert_eq!(charge_info.fingerprinted_parameters, ["amount"]);
    assert!(charge_info.shared_tenant);

    let refund = find("registry_test.refund");
    assert_eq!(refund.function, concat!(module_path!(), "::nested::refund"));
    assert_eq!(refund.file, file!());
    assert_eq!(refund.line, nested::REFUND_LINE);
    assert_eq!(refund.ttl, Duration::from_secs(3600));
    assert_eq!(refund.in_progress, InProgressPolicy::Reject);
    assert_eq!(refund.errors, ErrorPolicy::Release);
    assert_eq!(refund.fingerprinted_parameters, ["note"]);
    assert!(!refund.shared_tenant);

    // Keep the functions used: they exist to be registered.
    drop((charge("k", 1), nested::refund("a", "k", "n")));
}

#[test]
fn scopes_are_sorted_and_the_registry_validates() {
    let all = registry::scopes();
    let names: Vec<&str> = all.iter().map(|i| i.scope).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted);
    for scope in [
        "registry_test.charge",
        "registry_test.refund",
        "registry_test.hand_made",
    ] {
        assert_eq!(
            names.iter().filter(|n| **n == scope).count(),
            1,
            "{scope} in {names:?}"
        );
    }
    registry::validate().expect("no scope of this test binary is claimed twice");
}

#[test]
fn the_table_is_aligned_and_complete() {
    let table = registry::render(Format::Table);
    let lines: Vec<&str> = table.lines().collect();
    let header = lines[0];
    for column in [
        "scope",
        "function",
        "file:line",
        "ttl",
        "lease",
        "in_progress",
        "errors",
        "tx",
        "fingerprinted params",
    ] {
        assert!(header.contains(column), "{column} missing from {header:?}");
    }
    let row = lines
        .iter()
        .find(|l| l.starts_with("registry_test.hand_made"))
        .expect("hand-made row");
    // Every column starts where its header does.
    let at = |s: &str, needle: &str| {
        s.find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not in {s:?}"))
    };
    assert_eq!(
        at(row, "other_crate::shipping::dispatch"),
        at(header, "function")
    );
    assert_eq!(
        at(row, "other-crate/src/shipping.rs:42"),
        at(header, "file:line")
    );
    assert_eq!(at(row, "7days"), at(header, "ttl"));
    assert_eq!(at(row, "1m 30s"), at(header, "lease"));
    assert_eq!(at(row, "wait(10s)"), at(header, "in_progress"));
    assert_eq!(
        at(row, "record_if(other_crate::is_final)"),
        at(header, "errors")
    );
    assert_eq!(at(row, "yes"), at(header, " tx ") + 1);
    assert_eq!(
        at(row, "order, address"),
        at(header, "fingerprinted params")
    );
    let charge_row = lines
        .iter()
        .find(|l| l.starts_with("registry_test.charge"))
        .expect("charge row");
    assert!(
        charge_row.contains(&format!("{}:{}", file!(), CHARGE_LINE)),
        "{charge_row}"
    );
}

#[test]
fn the_json_carries_every_field() {
    let json: serde_json::Value =
        serde_json::from_str(&registry::render(Format::Json)).expect("valid JSON");
    let rows = json.as_array().expect("an array");
    let hand = rows
        .iter()
        .find(|r| r["scope"] == "registry_test.hand_made")
        .expect("hand-made row");
    assert_eq!(hand["function"], "other_crate::shipping::dispatch");
    assert_eq!(hand["file"], "other-crate/src/shipping.rs");
    assert_eq!(hand["line"], 42);
    assert_eq!(hand["ttl"], "7days");
    assert_eq!(hand["ttl_ms"], 7 * 24 * 3600 * 1000u64);
    assert_eq!(hand["lease"], "1m 30s");
    assert_eq!(hand["in_progress"], "wait(10s)");
    assert_eq!(hand["errors"], "record_if(other_crate::is_final)");
    assert_eq!(hand["transactional"], true);
    assert_eq!(
        hand["fingerprinted_parameters"],
        serde_json::json!(["order", "address"])
    );
    let charge = rows
        .iter()
        .find(|r| r["scope"] == "registry_test.charge")
        .expect("charge row");
    assert_eq!(charge["line"], CHARGE_LINE);
}
