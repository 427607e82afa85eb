//! Every shape `#[idempotent]` accepts, run against `MemoryStore`: the first
//! call executes, a retry replays, fingerprints include exactly the right
//! parameters, and every function is registered with its file and line.
//!
//! Each function here has its own scope: one crate may not reuse a scope.

use idempotent_runtime::registry::{self, ScopeInfo};
use idempotent_runtime::{
    idempotent, with_outcome, Error, ErrorPolicy, InProgressPolicy, MemoryStore, Outcome, Recovery,
    Store, Takeover,
};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: u64,
    amount: u64,
}

#[derive(Serialize)]
struct Account {
    id: u32,
}

// ---- a free function: tenant from a field, key by name, a skipped argument
const FREE_LINE: u32 = line!() + 2;
#[idempotent(scope = "shapes.free", key = key, tenant = account.id, store = store, skip(runs))]
async fn free(
    store: &MemoryStore,
    account: &Account,
    key: &str,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<Receipt, Error> {
    let id = runs.fetch_add(1, Ordering::SeqCst) as u64 + 1;
    Ok(Receipt { id, amount })
}

#[tokio::test]
async fn free_function_executes_then_replays() {
    let store = MemoryStore::new();
    let account = Account { id: 7 };
    let runs = AtomicUsize::new(0);
    let (first, o1) = with_outcome(free(&store, &account, "k1", 100, &runs)).await;
    // `runs` is skipped: another counter does not change the fingerprint.
    let other_runs = AtomicUsize::new(50);
    let (again, o2) = with_outcome(free(&store, &account, "k1", 100, &other_runs)).await;
    assert_eq!(first.unwrap(), Receipt { id: 1, amount: 100 });
    assert_eq!(again.unwrap(), Receipt { id: 1, amount: 100 });
    assert_eq!((o1, o2), (Some(Outcome::Executed), Some(Outcome::Replayed)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(other_runs.load(Ordering::SeqCst), 50);

    // `amount` is fingerprinted: the same key with another amount is refused.
    let mismatch = free(&store, &account, "k1", 999, &runs).await;
    assert!(
        matches!(mismatch, Err(Error::FingerprintMismatch(_))),
        "{mismatch:?}"
    );
    // Another tenant is another record.
    let other_tenant = free(&store, &Account { id: 8 }, "k1", 999, &runs).await;
    assert_eq!(other_tenant.unwrap(), Receipt { id: 2, amount: 999 });
}

// ---- a method on &self, store and tenant from fields
struct Service {
    store: MemoryStore,
    tenant: String,
    runs: AtomicUsize,
}

impl Service {
    #[idempotent(scope = "shapes.method", key = key, tenant = self.tenant, store = self.store,
                 in_progress = reject, lease = "2s")]
    async fn charge(&self, key: String, amount: u64) -> Result<Receipt, Error> {
        let id = self.runs.fetch_add(1, Ordering::SeqCst) as u64 + 1;
        Ok(Receipt { id, amount })
    }
}

#[tokio::test]
async fn method_on_self_executes_then_replays() {
    let service = Service {
        store: MemoryStore::new(),
        tenant: "t".into(),
        runs: AtomicUsize::new(0),
    };
    let (a, o1) = with_outcome(service.charge("k".into(), 5)).await;
    let (b, o2) = with_outcome(service.charge("k".into(), 5)).await;
    assert_eq!(a.unwrap(), b.unwrap());
    assert_eq!((o1, o2), (Some(Outcome::Executed), Some(Outcome::Replayed)));
    assert!(matches!(
        service.charge("k".into(), 6).await,
        Err(Error::FingerprintMismatch(_))
    ));
    assert_eq!(service.runs.load(Ordering::SeqCst), 1);
}

// ---- a generic function with `store = store`, and `?` converting errors
#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum AppError {
    Idempotent(String),
    Parse(String),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idempotent(e.to_string())
    }
}

impl From<std::num::ParseIntError> for AppError {
    fn from(e: std::num::ParseIntError) -> Self {
        AppError::Parse(e.to_string())
    }
}

#[idempotent(scope = "shapes.generic", key = key, tenant = shared, store = store)]
async fn generic<S>(store: &S, key: &str, input: String) -> Result<u32, AppError>
where
    S: Store,
{
    let n: u32 = input.parse()?; // `?` converts through From, as in the original function
    if n == 0 {
        return Ok(1000); // `return` returns from the body
    }
    Ok(n * 2)
}

#[tokio::test]
async fn generic_function_with_store_parameter() {
    let store = MemoryStore::new();
    assert_eq!(generic(&store, "g1", "21".into()).await, Ok(42));
    assert_eq!(generic(&store, "g0", "0".into()).await, Ok(1000));
    let (replay, outcome) = with_outcome(generic(&store, "g1", "21".into())).await;
    assert_eq!((replay, outcome), (Ok(42), Some(Outcome::Replayed)));
    assert!(matches!(
        generic(&store, "g2", "x".into()).await,
        Err(AppError::Parse(_))
    ));
    // The error was released (the default): the key is free for a retry.
    assert_eq!(generic(&store, "g2", "3".into()).await, Ok(6));
}

// ---- &dyn Store and Arc<dyn Store>
#[idempotent(scope = "shapes.dyn_store", key = key, tenant = tenant, store = store)]
async fn dyn_store(store: &dyn Store, tenant: u64, key: &str, value: u8) -> Result<u8, Error> {
    Ok(value)
}

// An owned store the body also uses: name a clone, so the body can take the
// original (and skip it: only a plain `store = store` leaves it out of the fingerprint).
#[idempotent(scope = "shapes.arc_store", key = key, tenant = shared, store = store.clone(), skip(store))]
async fn arc_store(store: Arc<dyn Store>, key: &str) -> Result<String, Error> {
    Ok(store.name().to_owned())
}

#[tokio::test]
async fn dyn_and_arc_stores() {
    let store = MemoryStore::new();
    assert_eq!(dyn_store(&store, 1, "d", 3).await.unwrap(), 3);
    let (v, o) = with_outcome(dyn_store(&store, 1, "d", 3)).await;
    assert_eq!((v.unwrap(), o), (3, Some(Outcome::Replayed)));
    let arc: Arc<dyn Store> = Arc::new(MemoryStore::new());
    assert_eq!(arc_store(arc.clone(), "a").await.unwrap(), "memory");
    let (_, o) = with_outcome(arc_store(arc, "a")).await;
    assert_eq!(o, Some(Outcome::Replayed));
}

// ---- fingerprint = false: a reused key is never refused for its arguments
#[idempotent(scope = "shapes.no_fingerprint", key = key, tenant = shared, store = store,
             fingerprint = false)]
async fn unfingerprinted(store: &MemoryStore, key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount)
}

#[tokio::test]
async fn fingerprint_false_replays_whatever_the_arguments() {
    let store = MemoryStore::new();
    assert_eq!(unfingerprinted(&store, "n", 1).await.unwrap(), 1);
    let (v, o) = with_outcome(unfingerprinted(&store, "n", 2)).await;
    assert_eq!((v.unwrap(), o), (1, Some(Outcome::Replayed)));
}

// ---- shared tenant, errors = record_if, crate = path
mod renamed {
    pub use idempotent_runtime::*;
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum PayError {
    Declined,
    Busy,
    Idempotent(String),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Idempotent(e.to_string())
    }
}

impl PayError {
    fn is_final(&self) -> bool {
        matches!(self, PayError::Declined)
    }
}

#[idempotent(scope = "shapes.record_if", key = key, tenant = shared, store = store, skip(runs),
             errors = record_if(PayError::is_final), crate = crate::macro_shapes::renamed, ttl = "1h")]
async fn pay(
    store: &MemoryStore,
    key: &str,
    fail: Option<bool>,
    runs: &AtomicUsize,
) -> Result<u8, PayError> {
    runs.fetch_add(1, Ordering::SeqCst);
    match fail {
        Some(true) => Err(PayError::Declined),
        Some(false) => Err(PayError::Busy),
        None => Ok(1),
    }
}

#[tokio::test]
async fn record_if_records_final_errors_only() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    assert_eq!(
        pay(&store, "busy", Some(false), &runs).await,
        Err(PayError::Busy)
    );
    assert_eq!(
        pay(&store, "busy", Some(false), &runs).await,
        Err(PayError::Busy)
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "Busy is released: the retry ran"
    );
    assert_eq!(
        pay(&store, "final", Some(true), &runs).await,
        Err(PayError::Declined)
    );
    let (again, o) = with_outcome(pay(&store, "final", Some(true), &runs)).await;
    assert_eq!(
        (again, o),
        (Err(PayError::Declined), Some(Outcome::Replayed))
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "Declined is recorded: replayed"
    );
}

// ---- an async fn in a trait impl
trait Charger {
    async fn charge(&self, key: &str, amount: u64) -> Result<u64, PayError>;
}

struct Gateway(MemoryStore);

impl Charger for Gateway {
    #[idempotent(scope = "shapes.trait_impl", key = key, tenant = shared, store = self.0,
                 errors = record)]
    async fn charge(&self, key: &str, amount: u64) -> Result<u64, PayError> {
        Ok(amount + 1)
    }
}

#[tokio::test]
async fn trait_impl_method() {
    let gateway = Gateway(MemoryStore::new());
    assert_eq!(gateway.charge("t", 1).await.unwrap(), 2);
    let (v, o) = with_outcome(gateway.charge("t", 1)).await;
    assert_eq!((v.unwrap(), o), (2, Some(Outcome::Replayed)));
}

// ---- the default store
#[idempotent(scope = "shapes.default_store", key = key, tenant = tenant)]
async fn with_default(tenant: &str, key: &str) -> Result<u8, Error> {
    Ok(9)
}

#[tokio::test]
async fn default_store_is_used_without_store_argument() {
    idempotent_runtime::set_default_store(MemoryStore::new());
    assert_eq!(with_default("t", "k").await.unwrap(), 9);
    let (v, o) = with_outcome(with_default("t", "k")).await;
    assert_eq!((v.unwrap(), o), (9, Some(Outcome::Replayed)));
}

// ---- a parameter called `shared` as the tenant: `tenant = (shared)`
// Only the bare identifier `shared` is the opt-out; in parentheses it is an
// expression over the parameters, so every tenant has its own namespace.
#[idempotent(scope = "shapes.tenant_named_shared", key = key, tenant = (shared), store = store,
             fingerprint = false)]
async fn tenant_named_shared(
    store: &MemoryStore,
    shared: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<String, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(format!("for {shared}"))
}

// The same function with the bare opt-out. (A parameter may not be called
// `shared` then: the word would mean two things; see tests/ui/shared_is_also_a_parameter.rs.)
#[idempotent(scope = "shapes.tenant_shared_opt_out", key = key, tenant = shared, store = store,
             fingerprint = false)]
async fn tenant_shared_opt_out(
    store: &MemoryStore,
    who: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<String, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(format!("for {who}"))
}

#[tokio::test]
async fn parenthesized_shared_is_the_parameter_not_the_opt_out() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let (a, oa) = with_outcome(tenant_named_shared(&store, "acme", "k", &runs)).await;
    let (b, ob) = with_outcome(tenant_named_shared(&store, "globex", "k", &runs)).await;
    assert_eq!(a.unwrap(), "for acme");
    assert_eq!(b.unwrap(), "for globex", "another tenant is another record");
    assert_eq!((oa, ob), (Some(Outcome::Executed), Some(Outcome::Executed)));
    assert_eq!(runs.load(Ordering::SeqCst), 2, "each tenant's body ran");
    // Each tenant replays its own result.
    let (a2, oa2) = with_outcome(tenant_named_shared(&store, "acme", "k", &runs)).await;
    let (b2, ob2) = with_outcome(tenant_named_shared(&store, "globex", "k", &runs)).await;
    assert_eq!(
        (a2.unwrap(), oa2),
        ("for acme".to_owned(), Some(Outcome::Replayed))
    );
    assert_eq!(
        (b2.unwrap(), ob2),
        ("for globex".to_owned(), Some(Outcome::Replayed))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn bare_shared_is_one_namespace() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let a = tenant_shared_opt_out(&store, "acme", "k", &runs).await;
    let (b, ob) = with_outcome(tenant_shared_opt_out(&store, "globex", "k", &runs)).await;
    assert_eq!(a.unwrap(), "for acme");
    // The key is global to the scope: the second caller gets the first's result.
    assert_eq!(
        (b.unwrap(), ob),
        ("for acme".to_owned(), Some(Outcome::Replayed))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

// ---- a `Result` alias (`pay::Result<T>`: the last path segment is
// `Result`) with `errors = record`, `errors = record_if(..)` and a runtime
// re-exported under another path (`crate = path`)
mod pay {
    pub type Result<T> = std::result::Result<T, super::PayError>;
}

// The attribute itself is named through the re-exporting module too.
#[renamed::idempotent(scope = "shapes.result_alias", key = key, tenant = shared, store = store,
             skip(runs), errors = record, crate = crate::macro_shapes::renamed)]
async fn declined(store: &MemoryStore, key: &str, runs: &AtomicUsize) -> pay::Result<u8> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(PayError::Declined)
}

#[idempotent(scope = "shapes.result_alias_record_if", key = key, tenant = shared,
             store = store, skip(runs), errors = record_if(PayError::is_final))]
async fn busy(store: &MemoryStore, key: &str, runs: &AtomicUsize) -> pay::Result<u8> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(PayError::Busy)
}

#[tokio::test]
async fn result_alias_with_recorded_errors() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    assert_eq!(declined(&store, "k", &runs).await, Err(PayError::Declined));
    let (again, o) = with_outcome(declined(&store, "k", &runs)).await;
    assert_eq!(
        (again, o),
        (Err(PayError::Declined), Some(Outcome::Replayed))
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the recorded error replayed"
    );
    // `record_if` through the alias: Busy is not final, so it is released
    // and the retry runs.
    let busy_runs = AtomicUsize::new(0);
    assert_eq!(busy(&store, "b", &busy_runs).await, Err(PayError::Busy));
    assert_eq!(busy(&store, "b", &busy_runs).await, Err(PayError::Busy));
    assert_eq!(
        busy_runs.load(Ordering::SeqCst),
        2,
        "released, not recorded"
    );
}

// ---- lifetime parameters, every optional argument, and the function's own
// doc comments and attributes after the attribute
struct Trace<'a>(&'a str);

#[idempotent(
    scope = "shapes.lifetimes",
    key = key,
    tenant = account.id,
    store = store,
    skip(account, trace),
    ttl = "7d",
    lease = "45s",
    in_progress = wait("2s"),
    errors = release
)]
/// Doc comments and other attributes are kept.
#[allow(clippy::needless_lifetimes)]
async fn with_lifetimes<'a, 'b>(
    store: &'a MemoryStore,
    account: &'a Account,
    key: &'b str,
    amount: u64,
    trace: Option<Trace<'b>>,
) -> Result<Receipt, Error> {
    Ok(Receipt {
        id: u64::from(account.id),
        amount: amount + trace.map_or(0, |t| t.0.len() as u64),
    })
}

#[tokio::test]
async fn lifetimes_and_every_optional_argument() {
    let store = MemoryStore::new();
    let account = Account { id: 3 };
    let first = with_lifetimes(&store, &account, "k", 5, None).await;
    assert_eq!(first.unwrap(), Receipt { id: 3, amount: 5 });
    // `trace` is skipped: another trace replays the first answer.
    let (again, o) = with_outcome(with_lifetimes(&store, &account, "k", 5, Some(Trace("x")))).await;
    assert_eq!(
        (again.unwrap(), o),
        (Receipt { id: 3, amount: 5 }, Some(Outcome::Replayed))
    );
}

// ---- `recover = path`: a free function in a shared scope (rule 21: both
// claimants ask the same hook), and an associated function on a method
async fn refund_happened(_: &Takeover) -> Result<Recovery<u64>, Error> {
    Ok(Recovery::Run)
}

#[idempotent(scope = "shapes.shared_refund", key = order, tenant = shared, store = store,
             shared_scope, ttl = "7d", recover = refund_happened)]
async fn refund_http(store: &MemoryStore, order: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount)
}

#[idempotent(scope = "shapes.shared_refund", key = order, tenant = shared, store = store,
             shared_scope, ttl = "7d", skip(delivery), recover = refund_happened)]
async fn refund_from_queue(
    store: &MemoryStore,
    order: &str,
    amount: u64,
    delivery: u32,
) -> Result<u64, Error> {
    Ok(amount + u64::from(delivery))
}

#[tokio::test]
async fn shared_scope_claimants_answer_each_other() {
    let store = MemoryStore::new();
    assert_eq!(refund_http(&store, "o", 10).await.unwrap(), 10);
    // The queue's redelivery of the same refund gets the HTTP call's answer.
    let (v, o) = with_outcome(refund_from_queue(&store, "o", 10, 7)).await;
    assert_eq!((v.unwrap(), o), (10, Some(Outcome::Replayed)));
}

struct Charges {
    store: MemoryStore,
}

impl Charges {
    async fn charge_happened(t: &Takeover) -> Result<Recovery<String>, Error> {
        Ok(Recovery::Completed(format!("attempt {}", t.attempt())))
    }

    #[idempotent(scope = "shapes.recover_method", key = key, tenant = shared, store = self.store,
                 recover = Self::charge_happened)]
    async fn charge(&self, key: &str) -> Result<String, Error> {
        Ok(key.to_owned())
    }
}

#[tokio::test]
async fn recover_hook_as_an_associated_function() {
    let charges = Charges {
        store: MemoryStore::new(),
    };
    // No earlier attempt: the hook is not asked and the body runs.
    assert_eq!(charges.charge("k").await.unwrap(), "k");
    let (v, o) = with_outcome(charges.charge("k")).await;
    assert_eq!((v.unwrap(), o), ("k".to_owned(), Some(Outcome::Replayed)));
}

/// `recover = self.hook`: the hook is a method of the same service, so it
/// reaches the state the body uses (here the gateway's ledger of charges).
struct PaymentService {
    store: MemoryStore,
    /// Charges made, by key: the provider the hook asks.
    charged: std::sync::Mutex<Vec<(String, u64)>>,
}

impl PaymentService {
    async fn charge_happened(&self, t: &Takeover) -> Result<Recovery<u64>, Error> {
        let charged = self.charged.lock().unwrap();
        Ok(match charged.iter().find(|(key, _)| key == t.key()) {
            Some((_, amount)) => Recovery::Completed(*amount),
            None => Recovery::Run,
        })
    }

    #[idempotent(scope = "shapes.recover_self", key = key, tenant = shared, store = self.store,
                 recover = self.charge_happened)]
    async fn charge(&self, key: &str, amount: u64) -> Result<u64, Error> {
        self.charged.lock().unwrap().push((key.to_owned(), amount));
        Ok(amount)
    }
}

impl PaymentService {
    // A typed shared receiver takes a method hook as `&self` does.
    #[allow(clippy::needless_arbitrary_self_type)]
    #[idempotent(scope = "shapes.recover_self_typed", key = key, tenant = shared,
                 store = self.store, recover = self.charge_happened)]
    async fn charge_typed(self: &Self, key: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount)
    }
}

/// A method a `macro_rules!` writes, whose hook name comes from the macro's
/// caller: the call uses the method's own `self`, so it resolves.
macro_rules! charging_method {
    ($name:ident, $scope:literal, $hook:ident) => {
        impl PaymentService {
            #[idempotent(scope = $scope, key = key, tenant = shared, store = self.store, recover = self.$hook)]
            async fn $name(&self, key: &str, amount: u64) -> Result<u64, Error> {
                Ok(amount)
            }
        }
    };
}

charging_method!(
    charge_by_macro,
    "shapes.recover_self_macro",
    charge_happened
);

#[tokio::test]
async fn recover_hook_as_a_method_of_the_same_service() {
    let service = PaymentService {
        store: MemoryStore::new(),
        charged: Default::default(),
    };
    // An earlier attempt charged "k1" and died before recording; its lease
    // runs out (the retry waits for it, no sleep here).
    service.charged.lock().unwrap().push(("k1".to_owned(), 40));
    for key in ["k1", "k2"] {
        let identity = idempotent_runtime::Identity::shared("shapes.recover_self", key).unwrap();
        crate::common::records::acquire(
            &service.store,
            &identity,
            None,
            Duration::from_millis(20),
            Duration::from_secs(3600),
        )
        .await;
    }
    let (found, o) = with_outcome(service.charge("k1", 40)).await;
    assert_eq!((found.unwrap(), o), (40, Some(Outcome::Recovered)));
    let (ran, o) = with_outcome(service.charge("k2", 50)).await;
    assert_eq!((ran.unwrap(), o), (50, Some(Outcome::Executed)));
    assert_eq!(
        *service.charged.lock().unwrap(),
        [("k1".to_owned(), 40), ("k2".to_owned(), 50)],
        "the hook's answer stood for the charge: none was made twice"
    );
    assert_eq!(
        registered("shapes.recover_self").recover,
        Some("self.charge_happened")
    );
    assert_eq!(service.charge_typed("k3", 60).await.unwrap(), 60);
    assert_eq!(service.charge_by_macro("k4", 70).await.unwrap(), 70);
}

// ---- the registry
fn registered(scope: &str) -> &'static ScopeInfo {
    registry::scopes()
        .into_iter()
        .find(|s| s.scope == scope)
        .unwrap_or_else(|| panic!("{scope} is not registered"))
}

#[test]
fn registry_lists_every_function_with_file_line_and_policies() {
    let free = registered("shapes.free");
    assert_eq!(free.function, concat!(module_path!(), "::free"));
    assert_eq!(free.file, file!());
    assert_eq!(free.line, FREE_LINE);
    // `tenant = account.id` does not exclude `account` (only `tenant = account` would).
    assert_eq!(free.fingerprinted_parameters, ["account", "amount"]);
    assert!(free.fingerprinted && !free.shared_tenant && !free.transactional);
    assert_eq!(free.ttl, Duration::from_secs(24 * 3600));
    assert_eq!(free.lease, Duration::from_secs(30));
    assert_eq!(
        free.in_progress,
        InProgressPolicy::Wait(Duration::from_secs(10))
    );
    assert_eq!(free.errors, ErrorPolicy::Release);

    let method = registered("shapes.method");
    assert_eq!(method.function, concat!(module_path!(), "::charge"));
    assert_eq!(method.fingerprinted_parameters, ["amount"]);
    assert_eq!(method.in_progress, InProgressPolicy::Reject);
    assert_eq!(method.lease, Duration::from_secs(2));

    let pay = registered("shapes.record_if");
    assert_eq!(pay.errors, ErrorPolicy::RecordIf("PayError::is_final"));
    assert_eq!(pay.fingerprinted_parameters, ["fail"]);
    assert!(pay.shared_tenant);
    assert_eq!(pay.ttl, Duration::from_secs(3600));

    let off = registered("shapes.no_fingerprint");
    assert!(!off.fingerprinted && off.fingerprinted_parameters.is_empty());
    assert_eq!(registered("shapes.trait_impl").errors, ErrorPolicy::Record);
    assert_eq!(
        registered("shapes.generic").fingerprinted_parameters,
        ["input"]
    );

    assert!(!registered("shapes.tenant_named_shared").shared_tenant);
    assert!(registered("shapes.tenant_shared_opt_out").shared_tenant);

    let lifetimes = registered("shapes.lifetimes");
    assert_eq!(lifetimes.fingerprinted_parameters, ["amount"]);
    assert_eq!(lifetimes.ttl, Duration::from_secs(7 * 24 * 3600));
    assert_eq!(lifetimes.lease, Duration::from_secs(45));
    assert_eq!(
        lifetimes.in_progress,
        InProgressPolicy::Wait(Duration::from_secs(2))
    );
    assert_eq!(lifetimes.errors, ErrorPolicy::Release);
    assert_eq!(
        registered("shapes.result_alias").errors,
        ErrorPolicy::Record
    );
    assert_eq!(
        registered("shapes.recover_method").recover,
        Some("Self::charge_happened")
    );
    let refunds: Vec<_> = registry::scopes()
        .into_iter()
        .filter(|s| s.scope == "shapes.shared_refund")
        .collect();
    assert_eq!(refunds.len(), 2, "both claimants are listed");
    assert!(refunds
        .iter()
        .all(|s| s.shared_scope && s.recover == Some("refund_happened")));

    let ours: Vec<_> = registry::scopes()
        .into_iter()
        .filter(|s| s.scope.starts_with("shapes."))
        .collect();
    // Every function here (the shared scopes are listed once per claimant).
    assert_eq!(ours.len(), 35, "{ours:#?}");
    assert!(
        ours.windows(2).all(|w| w[0].scope <= w[1].scope),
        "sorted by scope"
    );
}

// ---- a body on one line: no lint at its braces (nested as the tail of the
// async block that runs it, it drew rustc's `unused_braces`, an error under
// `deny(warnings)`, and the suggested fix did not compile).
#[rustfmt::skip]
#[deny(unused_braces)]
#[idempotent(scope = "shapes.one_line", key = key, tenant = shared, store = store)]
async fn one_line(store: &MemoryStore, key: &str, amount: u64) -> Result<u64, Error> { Ok(amount + 1) }

#[tokio::test]
async fn a_body_on_one_line_compiles_under_deny_unused_braces() {
    let store = MemoryStore::new();
    assert_eq!(one_line(&store, "k", 1).await.expect("runs"), 2);
}

// ---- a body with items of its own named like the return type's names: the
// return type still means what the signature says (the body's `struct
// Error` or `use std::io::*` shadowed them once the body's statements went
// into the async block itself).
#[idempotent(scope = "shapes.body_items", key = key, tenant = shared, store = store)]
async fn body_items(store: &MemoryStore, key: &str) -> Result<u64, Error> {
    #[allow(dead_code)]
    struct Error;
    let _ = Error;
    Ok(1)
}

#[idempotent(scope = "shapes.body_glob", key = key, tenant = shared, store = store)]
async fn body_glob(store: &MemoryStore, key: &str) -> Result<u64, Error> {
    #[allow(unused_imports)]
    use std::io::*;
    Ok(2)
}

#[tokio::test]
async fn items_of_the_body_do_not_shadow_the_return_type() {
    let store = MemoryStore::new();
    assert_eq!(body_items(&store, "k").await.expect("runs"), 1);
    assert_eq!(body_glob(&store, "k").await.expect("runs"), 2);
}

// ---- raw identifiers: `r#amount` is `amount` (as `cargo fix` writes a name
// that became a keyword). The fingerprint and the registry named it
// `r#amount`, so the raw spelling changed the fingerprint (a record made
// before it answered every retry with a mismatch), `key = r#key` left `key`
// in the fingerprint and `skip(r#note)` was refused.
#[idempotent(scope = "shapes.raw_names", key = r#key, tenant = shared, store = store,
             skip(r#note), shared_scope)]
async fn raw_names(
    store: &MemoryStore,
    key: &str,
    r#amount: u64,
    note: &str,
) -> Result<u64, Error> {
    let _ = note;
    Ok(r#amount * 2)
}

#[idempotent(scope = "shapes.raw_names", key = key, tenant = shared, store = store,
             skip(note), shared_scope)]
async fn plain_names(
    store: &MemoryStore,
    key: &str,
    amount: u64,
    note: &str,
) -> Result<u64, Error> {
    let _ = note;
    Ok(amount * 3)
}

#[tokio::test]
async fn raw_identifiers_are_named_as_rust_reads_them() {
    let store = MemoryStore::new();
    assert_eq!(raw_names(&store, "k", 5, "a").await.expect("runs"), 10);
    let (again, outcome) = with_outcome(plain_names(&store, "k", 5, "b")).await;
    assert_eq!(
        (again.expect("replays"), outcome),
        (10, Some(Outcome::Replayed)),
        "one fingerprint for `r#amount` and `amount`"
    );
    let info = registry::scopes()
        .into_iter()
        .find(|s| s.function.ends_with("raw_names"))
        .expect("registered");
    assert_eq!(info.fingerprinted_parameters, ["amount"]);
}

// ---- two claimants of a shared scope, one with a parameter compiled out:
// both fingerprint `amount` where they are compiled, so they agree (the
// attribute compared the names as written and refused them; it leaves such
// a comparison to `registry::validate`, which sees what is compiled in).
#[idempotent(scope = "shapes.cfg_shared", key = key, tenant = shared, store = store, shared_scope)]
async fn cfg_shared_http(
    store: &MemoryStore,
    key: &str,
    amount: u64,
    #[cfg(any())] note: &str,
) -> Result<u64, Error> {
    Ok(amount + 1)
}

#[idempotent(scope = "shapes.cfg_shared", key = key, tenant = shared, store = store, shared_scope)]
async fn cfg_shared_queue(store: &MemoryStore, key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount + 2)
}

#[tokio::test]
async fn shared_scope_claimants_agree_on_what_is_compiled_in() {
    let store = MemoryStore::new();
    assert_eq!(cfg_shared_http(&store, "k", 1).await.expect("runs"), 2);
    let (again, outcome) = with_outcome(cfg_shared_queue(&store, "k", 1)).await;
    assert_eq!(
        (again.expect("replays"), outcome),
        (2, Some(Outcome::Replayed))
    );
    let ours: Vec<_> = registry::scopes()
        .into_iter()
        .filter(|s| s.scope == "shapes.cfg_shared")
        .collect();
    assert_eq!(ours.len(), 2);
    assert!(ours
        .iter()
        .all(|s| s.fingerprinted_parameters == ["amount"]));
}

// ---- a parameter under `#[cfg]` (or a `#[cfg_attr]` that gives one):
// fingerprinted where it is compiled in (it failed to compile when compiled
// out: the fingerprint named it).
#[idempotent(scope = "shapes.cfg_param", key = key, tenant = shared, store = store)]
async fn cfg_param(
    store: &MemoryStore,
    key: &str,
    #[cfg(any())] compiled_out: u64,
    #[cfg(not(any()))] amount: u64,
    #[cfg_attr(all(), cfg(any()))] compiled_out_by_cfg_attr: u64,
    #[cfg_attr(any(), cfg(any()))] currency: &str,
    #[cfg_attr(all(), allow(unused), cfg_attr(all(), cfg(any())))] nested_out: u64,
    #[cfg_attr(true, cfg(false))] out_by_a_literal: u64,
) -> Result<u64, Error> {
    Ok(amount + currency.len() as u64)
}

#[tokio::test]
async fn a_parameter_under_cfg_is_fingerprinted_only_where_compiled_in() {
    let store = MemoryStore::new();
    assert_eq!(cfg_param(&store, "k", 5, "EUR").await.expect("runs"), 8);
    for (amount, currency) in [(6, "EUR"), (5, "USD")] {
        assert!(
            matches!(
                cfg_param(&store, "k", amount, currency).await,
                Err(Error::FingerprintMismatch(_))
            ),
            "the parameters compiled in are fingerprinted"
        );
    }
    let info = registry::scopes()
        .into_iter()
        .find(|s| s.scope == "shapes.cfg_param")
        .expect("registered");
    assert_eq!(info.fingerprinted_parameters, ["amount", "currency"]);
}

// ---- a `Result` alias of any name: the compiler checks what it stands for
// (it was refused for not ending in `Result`).
type ChargeOutcome<T> = std::result::Result<T, Error>;

#[idempotent(scope = "shapes.named_alias", key = key, tenant = shared, store = store)]
async fn named_alias(store: &MemoryStore, key: &str, amount: u64) -> ChargeOutcome<u64> {
    Ok(amount)
}

#[tokio::test]
async fn a_result_alias_of_any_name_is_taken() {
    let store = MemoryStore::new();
    assert_eq!(named_alias(&store, "k", 5).await.expect("runs"), 5);
    let (again, outcome) = with_outcome(named_alias(&store, "k", 5)).await;
    assert_eq!(
        (again.expect("replays"), outcome),
        (5, Some(Outcome::Replayed))
    );
}

// ---- two parameters of one name under opposite `#[cfg]`s (one type per
// feature): the one compiled in is fingerprinted. Each was given the first
// one's `#[cfg]`s, so with the compiled-out one first nothing was
// fingerprinted and another amount replayed the first call's answer.
#[idempotent(scope = "shapes.cfg_same_name", key = key, tenant = shared, store = store)]
async fn cfg_same_name(
    store: &MemoryStore,
    key: &str,
    #[cfg(any())] amount: u128,
    #[cfg(not(any()))] amount: u32,
) -> Result<u32, Error> {
    Ok(amount)
}

#[tokio::test]
async fn a_parameter_named_like_a_compiled_out_one_is_fingerprinted() {
    let store = MemoryStore::new();
    assert_eq!(cfg_same_name(&store, "k", 100).await.expect("runs"), 100);
    let other = cfg_same_name(&store, "k", 999).await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch(_))),
        "{other:?}"
    );
    let info = registry::scopes()
        .into_iter()
        .find(|s| s.scope == "shapes.cfg_same_name")
        .expect("registered");
    assert_eq!(info.fingerprinted_parameters, ["amount"]);
}

// ---- a body whose every path returns (its block has type `!`), under a
// `line!` and a `file!` of the crate's own: compiles with no warning (the
// suite denies warnings under clippy) and runs.
mod shadowed_std_macros {
    use super::*;

    #[allow(unused_macros)]
    macro_rules! line {
        () => {
            "not a line"
        };
    }
    #[allow(unused_macros)]
    macro_rules! file {
        () => {
            0
        };
    }

    #[idempotent(scope = "shapes.every_path_returns", key = key, tenant = shared, store = store)]
    pub(super) async fn every_path_returns(
        store: &MemoryStore,
        key: &str,
        big: bool,
    ) -> Result<u8, Error> {
        if big {
            return Ok(2);
        } else {
            return Ok(1);
        }
    }
}

#[tokio::test]
async fn a_body_whose_every_path_returns_runs_and_replays() {
    let store = MemoryStore::new();
    let first = with_outcome(shadowed_std_macros::every_path_returns(&store, "k", true)).await;
    assert_eq!(
        (first.0.expect("runs"), first.1),
        (2, Some(Outcome::Executed))
    );
    let again = with_outcome(shadowed_std_macros::every_path_returns(&store, "k", true)).await;
    assert_eq!(
        (again.0.expect("replays"), again.1),
        (2, Some(Outcome::Replayed))
    );
}

// ---- in a module that forbids lints the generated code could trip: the
// code allows none (an `allow` under `forbid` is an error, E0453).
mod forbidding {
    #![forbid(
        unreachable_code,
        clippy::needless_return,
        clippy::diverging_sub_expression
    )]
    use super::*;

    #[idempotent(scope = "shapes.forbidding", key = key, tenant = shared, store = store)]
    pub(super) async fn early_return(store: &MemoryStore, key: &str, n: u8) -> Result<u8, Error> {
        if n == 0 {
            return Ok(0);
        }
        Ok(n)
    }
}

#[tokio::test]
async fn a_module_that_forbids_lints_compiles_and_runs() {
    let store = MemoryStore::new();
    assert_eq!(
        forbidding::early_return(&store, "k", 3)
            .await
            .expect("runs"),
        3
    );
    assert_eq!(
        forbidding::early_return(&store, "k", 3)
            .await
            .expect("replays"),
        3
    );
}

// ---- a method taking `self` by value consumes it: the value is the request
// (a command object), so it is fingerprinted like a parameter, unless
// `skip(self)`. A borrowed `self` is the service, never fingerprinted.
#[derive(Serialize)]
struct ChargeCommand {
    account: String,
    amount: u64,
}

impl ChargeCommand {
    #[idempotent(scope = "shapes.command", key = key, tenant = self.account, store = store)]
    async fn execute(self, store: &MemoryStore, key: &str, currency: &str) -> Result<u64, Error> {
        let _ = currency;
        Ok(self.amount)
    }
}

/// A service taken by value (a cheap handle), left out with `skip(self)`.
#[derive(Clone, Copy)]
struct Mailer {
    sent_by: u8,
}

impl Mailer {
    #[idempotent(scope = "shapes.consumed_service", key = key, tenant = shared, store = store,
                 skip(self))]
    async fn send(self, store: &MemoryStore, key: &str, to: String) -> Result<String, Error> {
        Ok(format!("{to} by {}", self.sent_by))
    }
}

#[tokio::test]
async fn a_by_value_self_is_fingerprinted_unless_skipped() {
    let store = MemoryStore::new();
    let command = |amount| ChargeCommand {
        account: "acct-1".into(),
        amount,
    };
    assert_eq!(command(10).execute(&store, "k", "EUR").await.unwrap(), 10);
    assert!(
        matches!(
            command(999_999).execute(&store, "k", "EUR").await,
            Err(Error::FingerprintMismatch(_))
        ),
        "another command under the same key was served the first one's answer"
    );
    let again = with_outcome(command(10).execute(&store, "k", "EUR")).await;
    assert!(
        matches!(again, (Ok(10), Some(Outcome::Replayed))),
        "{again:?}"
    );
    assert_eq!(
        registered("shapes.command").fingerprinted_parameters,
        ["self", "currency"]
    );

    let sent = Mailer { sent_by: 1 }.send(&store, "m", "ann".into()).await;
    assert_eq!(sent.unwrap(), "ann by 1");
    let again = with_outcome(Mailer { sent_by: 2 }.send(&store, "m", "ann".into())).await;
    assert!(
        matches!(again, (Ok(ref s), Some(Outcome::Replayed)) if s == "ann by 1"),
        "{again:?}"
    );
    assert_eq!(
        registered("shapes.consumed_service").fingerprinted_parameters,
        ["to"]
    );
}

/// A record a build stored before a by-value `self` counted (its other
/// parameters' fingerprint) is still replayed, and not to other ones.
#[tokio::test]
async fn a_record_stored_before_a_by_value_self_counted_is_still_replayed() {
    let store = MemoryStore::new();
    let id = idempotent_runtime::Identity::new("acct-1", "shapes.command", "old").unwrap();
    let mut builder = idempotent_runtime::FingerprintBuilder::new();
    builder.argument("currency", "EUR");
    let old = builder.finish().unwrap().unwrap();
    crate::common::records::recorded(&store, &id, Some(&old), b"7").await;
    let command = || ChargeCommand {
        account: "acct-1".into(),
        amount: 10,
    };
    let replayed = with_outcome(command().execute(&store, "old", "EUR")).await;
    assert!(
        matches!(replayed, (Ok(7), Some(Outcome::Replayed))),
        "{replayed:?}"
    );
    assert!(matches!(
        command().execute(&store, "old", "USD").await,
        Err(Error::FingerprintMismatch(_))
    ));
}

// ---- a parameter bound to a name and destructured at once
// (`req @ Refund { amount, .. }`) is fingerprinted by its name.
#[derive(Serialize)]
struct Refund {
    order: String,
    amount: u64,
}

#[idempotent(scope = "shapes.bound_pattern", key = key, tenant = shared, store = store)]
async fn refund_bound(
    store: &MemoryStore,
    key: &str,
    req @ Refund { amount, .. }: Refund,
) -> Result<u64, Error> {
    Ok(amount + req.order.len() as u64)
}

#[tokio::test]
async fn a_parameter_bound_with_a_subpattern_is_fingerprinted_by_its_name() {
    let store = MemoryStore::new();
    let refund = |amount| Refund {
        order: "o-1".into(),
        amount,
    };
    assert_eq!(refund_bound(&store, "k", refund(5)).await.unwrap(), 8);
    assert!(matches!(
        refund_bound(&store, "k", refund(6)).await,
        Err(Error::FingerprintMismatch(_))
    ));
    assert_eq!(
        registered("shapes.bound_pattern").fingerprinted_parameters,
        ["req"]
    );
}
