//! Rule 21: several functions may claim one scope on purpose, when every one
//! says `shared_scope`; the registry lists every claimant and the audit shows
//! them. A claimant from another crate (a registration submitted by hand,
//! exactly as generated code does) joins them; `registry::validate()` accepts
//! the agreeing claimants and refuses disagreeing ones, naming both sites.
//! (Its own test binary: the registry of a binary is global.)

use idempotent_runtime::__private::{
    inventory, ErrorPolicy, InProgressPolicy, Registration, ScopeInfo, ScopeSpec,
};
use idempotent_runtime::registry::{self, Disagreement, Format, RegistryError};
use idempotent_runtime::{audit, idempotent, with_outcome, Error, MemoryStore, Outcome};
use std::time::Duration;

/// The foreground path: an HTTP handler refunding an order.
#[idempotent(scope = "shared_test.refund_order", key = order, tenant = shop, store = store,
             shared_scope, skip(request_id))]
async fn refund_http(
    store: &MemoryStore,
    shop: &str,
    order: &str,
    amount: u64,
    request_id: &str,
) -> Result<String, Error> {
    let _ = request_id;
    Ok(format!("refunded {amount} (http)"))
}
const HTTP_LINE: u32 = line!() - 10;

/// The background path: a queue consumer delivering "refund order 8891".
#[idempotent(scope = "shared_test.refund_order", key = order, tenant = shop, store = store,
             shared_scope, skip(delivery))]
async fn refund_from_queue(
    store: &MemoryStore,
    shop: &str,
    order: &str,
    amount: u64,
    delivery: u64,
) -> Result<String, Error> {
    let _ = delivery;
    Ok(format!("refunded {amount} (queue)"))
}
const QUEUE_LINE: u32 = line!() - 10;

// The same boundary claimed by a function of another crate, in agreement.
static BATCH: ScopeInfo = ScopeInfo::new(ScopeSpec {
    scope: "shared_test.refund_order",
    function: "billing_batch::refunds::run",
    file: "billing-batch/src/refunds.rs",
    line: 77,
    ttl: Duration::from_secs(24 * 3600),
    lease: Duration::from_secs(30),
    in_progress: InProgressPolicy::Reject,
    errors: ErrorPolicy::Release,
    transactional: false,
    fingerprinted: true,
    fingerprinted_parameters: &["amount"],
    shared_tenant: false,
    recover: None,
    shared_scope: true,
});
inventory::submit! { Registration(&BATCH) }

fn claimants() -> Vec<&'static ScopeInfo> {
    registry::scopes()
        .into_iter()
        .filter(|i| i.scope == "shared_test.refund_order")
        .collect()
}

#[tokio::test]
async fn foreground_and_background_share_one_boundary() {
    let store = MemoryStore::new();
    let (first, o1) = with_outcome(refund_http(&store, "shop-1", "order-8891", 500, "req-1")).await;
    let (second, o2) =
        with_outcome(refund_from_queue(&store, "shop-1", "order-8891", 500, 3)).await;
    assert_eq!(o1, Some(Outcome::Executed));
    assert_eq!(
        o2,
        Some(Outcome::Replayed),
        "the queue's delivery is the same refund"
    );
    assert_eq!(first.unwrap(), second.unwrap());
    // A different amount under the same order is a mismatch on either path.
    assert!(matches!(
        refund_from_queue(&store, "shop-1", "order-8891", 900, 4).await,
        Err(Error::FingerprintMismatch(_))
    ));
}

#[test]
fn the_registry_lists_every_claimant_and_validates() {
    registry::validate().expect("the shared claimants agree");
    let all = claimants();
    let functions: Vec<&str> = all.iter().map(|i| i.function).collect();
    assert_eq!(
        functions,
        [
            "billing_batch::refunds::run",
            concat!(module_path!(), "::refund_from_queue"),
            concat!(module_path!(), "::refund_http"),
        ]
    );
    assert!(all.iter().all(|i| i.shared_scope));
    let http = all
        .iter()
        .find(|i| i.function.ends_with("refund_http"))
        .unwrap();
    assert_eq!((http.file, http.line), (file!(), HTTP_LINE));
    let queue = all
        .iter()
        .find(|i| i.function.ends_with("refund_from_queue"))
        .unwrap();
    assert_eq!(queue.line, QUEUE_LINE);

    let table = registry::render(Format::Table);
    let header = table.lines().next().unwrap();
    let col = header.find("shared").expect("a shared column");
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("shared_test.refund_order"))
        .collect();
    assert_eq!(rows.len(), 3, "{table}");
    assert!(rows.iter().all(|r| r[col..].starts_with("yes")), "{table}");
    let json: serde_json::Value = serde_json::from_str(&registry::render(Format::Json)).unwrap();
    let shared = json
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["scope"] == "shared_test.refund_order" && r["shared_scope"] == true)
        .count();
    assert_eq!(shared, 3);
}

#[tokio::test]
async fn the_audit_shows_every_claimant() {
    let store = MemoryStore::new();
    refund_http(&store, "shop-2", "order-1", 1, "r")
        .await
        .unwrap();
    let report = audit::audit_registry(&store).await.unwrap();
    let entry = report
        .scope("shared_test.refund_order")
        .expect("the shared scope");
    assert_eq!(entry.complete, 1);
    assert_eq!(entry.claimed_by.len(), 3, "{entry:?}");
    let table = report.render(Format::Table);
    let row = table
        .lines()
        .find(|l| l.starts_with("shared_test.refund_order"))
        .unwrap();
    for claimant in [
        "billing_batch::refunds::run",
        "refund_http",
        "refund_from_queue",
    ] {
        assert!(row.contains(claimant), "{row}");
    }
}

fn variant(
    line: u32,
    ttl: Duration,
    fingerprinted: &'static [&'static str],
    shared: bool,
) -> ScopeInfo {
    ScopeInfo::new(ScopeSpec {
        scope: "shared_test.other",
        function: "other_crate::consumer::refund",
        file: "other-crate/src/consumer.rs",
        line,
        ttl,
        lease: Duration::from_secs(30),
        in_progress: InProgressPolicy::Reject,
        errors: ErrorPolicy::Release,
        transactional: false,
        fingerprinted: true,
        fingerprinted_parameters: fingerprinted,
        shared_tenant: false,
        recover: None,
        shared_scope: shared,
    })
}

#[test]
fn disagreeing_claimants_are_refused_naming_both_sites() {
    let here = ScopeInfo::new(ScopeSpec {
        scope: "shared_test.other",
        function: "app::http::refund",
        file: "app/src/http.rs",
        line: 40,
        ttl: Duration::from_secs(3600),
        lease: Duration::from_secs(30),
        in_progress: InProgressPolicy::Wait(Duration::from_secs(10)),
        errors: ErrorPolicy::Release,
        transactional: false,
        fingerprinted: true,
        fingerprinted_parameters: &["amount", "order"],
        shared_tenant: false,
        recover: None,
        shared_scope: true,
    });

    // Same names in another order, same ttl: they agree.
    let agreeing = variant(12, Duration::from_secs(3600), &["order", "amount"], true);
    registry::validate_infos(&[&here, &agreeing]).expect("order of parameters does not matter");

    let longer = variant(
        12,
        Duration::from_secs(7 * 24 * 3600),
        &["order", "amount"],
        true,
    );
    let err = registry::validate_infos(&[&here, &longer]).unwrap_err();
    let RegistryError::SharedScopeConflicts(conflicts) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(conflicts.len(), 1);
    assert!(matches!(
        conflicts[0].disagreement,
        Disagreement::Ttl { .. }
    ));
    let message = err.to_string();
    assert!(
        message.contains("`app::http::refund` at app/src/http.rs:40"),
        "{message}"
    );
    assert!(
        message.contains("`other_crate::consumer::refund` at other-crate/src/consumer.rs:12"),
        "{message}"
    );
    assert!(message.contains("1h vs 7days"), "{message}");

    // One asks a recover hook, the other does not.
    let mut hooked = variant(12, Duration::from_secs(3600), &["order", "amount"], true);
    hooked.recover = Some("app::refunds::look_up");
    let err = registry::validate_infos(&[&here, &hooked]).unwrap_err();
    let RegistryError::SharedScopeConflicts(conflicts) = &err else {
        panic!("{err:?}")
    };
    assert!(matches!(
        conflicts[0].disagreement,
        Disagreement::Recover {
            first: None,
            second: Some("app::refunds::look_up")
        }
    ));
    assert!(
        err.to_string().contains("run the body again blind"),
        "{err}"
    );

    // One keeps one namespace for every tenant (`tenant = shared`), the other
    // one per tenant: one event through both never meets its record.
    let mut one_namespace = variant(12, Duration::from_secs(3600), &["order", "amount"], true);
    one_namespace.shared_tenant = true;
    let err = registry::validate_infos(&[&here, &one_namespace]).unwrap_err();
    let RegistryError::SharedScopeConflicts(conflicts) = &err else {
        panic!("{err:?}")
    };
    assert!(matches!(
        conflicts[0].disagreement,
        Disagreement::SharedTenant {
            first: false,
            second: true
        }
    ));
    assert!(err.to_string().contains("run twice"), "{err}");

    // One records errors, the other releases them: a retry through the
    // releasing one of a recorded error could neither replay it nor run.
    let mut recording = variant(12, Duration::from_secs(3600), &["order", "amount"], true);
    recording.errors = ErrorPolicy::RecordIf("app::refunds::is_final");
    let err = registry::validate_infos(&[&here, &recording]).unwrap_err();
    let RegistryError::SharedScopeConflicts(conflicts) = &err else {
        panic!("{err:?}")
    };
    assert!(matches!(
        conflicts[0].disagreement,
        Disagreement::ErrorPolicy {
            first: ErrorPolicy::Release,
            second: ErrorPolicy::RecordIf("app::refunds::is_final")
        }
    ));
    assert!(
        err.to_string()
            .contains("`errors = release` vs `errors = record_if(app::refunds::is_final)`"),
        "{err}"
    );
    // Two policies that both record agree.
    let mut here_recording = here.clone();
    here_recording.errors = ErrorPolicy::Record;
    assert!(registry::validate_infos(&[&here_recording, &recording]).is_ok());

    let fewer = variant(12, Duration::from_secs(3600), &["order"], true);
    let err = registry::validate_infos(&[&here, &fewer]).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("(amount, order) vs (order)"), "{message}");

    // A claimant without the flag is the duplicate-scope error, naming all sites.
    let unflagged = variant(90, Duration::from_secs(3600), &["order", "amount"], false);
    let err = registry::validate_infos(&[&here, &agreeing, &agreeing, &unflagged]).unwrap_err();
    let RegistryError::DuplicateScopes(dups) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(
        dups[0].sites.len(),
        3,
        "the same site registered twice counts once"
    );
    assert_eq!(dups[0].shared.len(), 2);
    let message = err.to_string();
    for site in [
        "app/src/http.rs:40",
        "other-crate/src/consumer.rs:12",
        "other-crate/src/consumer.rs:90",
    ] {
        assert!(message.contains(site), "{site} in {message}");
    }
    assert!(message.contains("every claimant must say so"), "{message}");
}

/// A scope claimed twice without the flag and, elsewhere, a shared scope
/// whose claimants disagree: the duplicate (rule 18's error, which no flag
/// excuses) is the one reported.
#[test]
fn a_duplicate_is_reported_before_a_disagreement() {
    let hour = Duration::from_secs(3600);
    let shared = variant(12, hour, &["order", "amount"], true);
    let disagreeing = variant(13, 7 * 24 * hour, &["order", "amount"], true);
    let mut first = variant(20, hour, &["order"], false);
    first.scope = "shared_test.duplicate";
    let mut second = variant(21, hour, &["order"], false);
    second.scope = "shared_test.duplicate";
    let err = registry::validate_infos(&[&shared, &disagreeing, &first, &second]).unwrap_err();
    let RegistryError::DuplicateScopes(dups) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(dups.len(), 1);
    assert_eq!(dups[0].scope, "shared_test.duplicate");
}

/// One site can claim a scope more than once with other settings: a helper
/// that builds an `IdempotencyLayer` (its site is the `build()` line) called
/// for two routers, one with a `recover` hook and a day's ttl, the other with
/// neither. Those are two claimants of one boundary that disagree (one would
/// re-run blind what the other recovers), and are reported as such; only a
/// site registered again with the same settings counts once.
#[test]
fn one_site_claiming_a_scope_with_other_settings_is_reported() {
    let hour = Duration::from_secs(3600);
    let day = variant(40, 24 * hour, &["order"], false);
    let mut hooked = day.clone();
    hooked.recover = Some("app::refunds::recover");
    let minute = variant(40, Duration::from_secs(60), &["order"], false);

    // Without `shared_scope`: the duplicate-scope error, the site named for each claim.
    let err = registry::validate_infos(&[&hooked, &minute]).unwrap_err();
    let RegistryError::DuplicateScopes(dups) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(dups[0].sites.len(), 2, "{err}");
    assert!(
        err.to_string().contains("other-crate/src/consumer.rs:40"),
        "{err}"
    );

    // Both saying `shared_scope`: their disagreement is named.
    let (mut hooked_shared, mut minute_shared) = (hooked.clone(), minute.clone());
    hooked_shared.shared_scope = true;
    minute_shared.shared_scope = true;
    let err = registry::validate_infos(&[&hooked_shared, &minute_shared]).unwrap_err();
    let RegistryError::SharedScopeConflicts(conflicts) = &err else {
        panic!("{err:?}")
    };
    assert!(
        matches!(conflicts[0].disagreement, Disagreement::Ttl { .. }),
        "{err}"
    );
    let mut minute_hooked = minute_shared.clone();
    minute_hooked.ttl = day.ttl;
    let err = registry::validate_infos(&[&hooked_shared, &minute_hooked]).unwrap_err();
    let RegistryError::SharedScopeConflicts(conflicts) = &err else {
        panic!("{err:?}")
    };
    assert!(
        matches!(conflicts[0].disagreement, Disagreement::Recover { .. }),
        "{err}"
    );

    // The same site with the same settings, registered again, is one claimant.
    assert!(registry::validate_infos(&[&hooked, &hooked.clone()]).is_ok());
    assert!(registry::validate_infos(&[&day, &day.clone(), &day]).is_ok());
}
