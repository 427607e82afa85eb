//! Arguments passed through `macro_rules!` metavariables behave exactly as if
//! written directly (DESIGN.md §3). `macro_rules!` hands an `$x:literal`,
//! `$x:expr`, `$x:path` or `$x:ty` to the attribute wrapped in an invisible
//! (`Delimiter::None`) group, which the attribute must look through; `$x:ident`
//! and `$x:tt` arrive as plain tokens.
//!
//! Each wrapper annotates a function written at its call site, and every
//! argument naming a parameter comes from the call site too (macro_rules
//! hygiene: a `key` written inside the macro could not see the caller's
//! parameter `key`). Every function has its own scope (`rules.*`); the registry
//! test at the end checks what the attribute made of each argument.

use futures::future::BoxFuture;
use idempotent_runtime::__private::TransactionalConnection;
use idempotent_runtime::error::StoreError;
use idempotent_runtime::registry::{self, ScopeInfo};
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, ErrorPolicy, Fenced, Identity, InProgressPolicy,
    MemoryStore, Outcome, OwnerToken, Reservation, ReserveRequest, Store,
};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[derive(Serialize)]
struct Request {
    key: String,
    amount: u64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum PayError {
    Declined,
    Busy,
    Mismatch,
    Idempotent(String),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        match e {
            Error::FingerprintMismatch(_) => PayError::Mismatch,
            e => PayError::Idempotent(e.to_string()),
        }
    }
}

impl PayError {
    fn is_final(&self) -> bool {
        matches!(self, PayError::Declined)
    }
}

mod renamed {
    pub use idempotent_runtime::*;
}

fn registered(scope: &str) -> &'static ScopeInfo {
    registry::scopes()
        .into_iter()
        .find(|s| s.scope == scope)
        .unwrap_or_else(|| panic!("{scope} is not registered"))
}

// ---- `$x:literal`: scope, ttl, lease, wait(...) and fingerprint
macro_rules! with_literals {
    ($scope:literal, $ttl:literal, $lease:literal, $wait:literal, $fp:literal;
     [$($rest:tt)*] $($f:tt)*) => {
        #[idempotent(scope = $scope, ttl = $ttl, lease = $lease, in_progress = wait($wait),
                     fingerprint = $fp, $($rest)*)]
        $($f)*
    };
}

with_literals!("rules.literal", "2h", "3s", "4s", true; [key = key, tenant = tenant, store = store]
    async fn literal(store: &MemoryStore, tenant: u32, key: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount)
    }
);

with_literals!("rules.literal_no_fingerprint", "1h", "1s", "1s", false;
               [key = key, tenant = tenant, store = store]
    async fn literal_unfingerprinted(
        store: &MemoryStore,
        tenant: u32,
        key: &str,
        amount: u64,
    ) -> Result<u64, Error> {
        Ok(amount)
    }
);

#[tokio::test]
async fn literals_replay_and_fingerprint() {
    let store = MemoryStore::new();
    let (a, oa) = with_outcome(literal(&store, 1, "k", 10)).await;
    let (b, ob) = with_outcome(literal(&store, 1, "k", 10)).await;
    assert_eq!((a.unwrap(), b.unwrap()), (10, 10));
    assert_eq!((oa, ob), (Some(Outcome::Executed), Some(Outcome::Replayed)));
    let mismatch = literal(&store, 1, "k", 11).await;
    assert!(
        matches!(mismatch, Err(Error::FingerprintMismatch(_))),
        "{mismatch:?}"
    );
    // `fingerprint = $fp` with `false`: a reused key is never refused.
    assert_eq!(literal_unfingerprinted(&store, 1, "k", 1).await.unwrap(), 1);
    let (v, o) = with_outcome(literal_unfingerprinted(&store, 1, "k", 2)).await;
    assert_eq!((v.unwrap(), o), (1, Some(Outcome::Replayed)));
}

// ---- `$x:expr`: every argument that takes a value
macro_rules! with_exprs {
    ($scope:expr, $key:expr, $tenant:expr, $store:expr, $ttl:expr, $lease:expr,
     $in_progress:expr, $errors:expr, $fp:expr, $krate:expr; $($f:tt)*) => {
        #[idempotent(scope = $scope, key = $key, tenant = $tenant, store = $store, ttl = $ttl,
                     lease = $lease, in_progress = $in_progress, errors = $errors,
                     fingerprint = $fp, crate = $krate)]
        $($f)*
    };
}

// Parameters named directly by `key`, `tenant` and `store` are left out of the
// fingerprint (a `&MemoryStore` is not `Serialize`: fingerprinting it would not compile).
with_exprs!("rules.expr", key, tenant, store, "5h", "6s", reject, record, true,
            ::idempotent_runtime;
    async fn expr(
        store: &MemoryStore,
        tenant: &str,
        key: &str,
        amount: u64,
        fail: bool,
    ) -> Result<u64, PayError> {
        if fail {
            return Err(PayError::Declined);
        }
        Ok(amount)
    }
);

#[tokio::test]
async fn exprs_replay_mismatch_and_record_errors() {
    let store = MemoryStore::new();
    let (a, oa) = with_outcome(expr(&store, "t", "k", 5, false)).await;
    let (b, ob) = with_outcome(expr(&store, "t", "k", 5, false)).await;
    assert_eq!((a, b), (Ok(5), Ok(5)));
    assert_eq!((oa, ob), (Some(Outcome::Executed), Some(Outcome::Replayed)));
    // `amount` is fingerprinted; `key = $key` did not drag it out.
    assert_eq!(
        expr(&store, "t", "k", 6, false).await,
        Err(PayError::Mismatch)
    );
    // `tenant = $tenant`: another tenant is another record.
    assert_eq!(expr(&store, "u", "k", 6, false).await, Ok(6));
    // `errors = $errors` with `record`: the error is replayed.
    assert_eq!(
        expr(&store, "t", "e", 1, true).await,
        Err(PayError::Declined)
    );
    let (again, o) = with_outcome(expr(&store, "t", "e", 1, true)).await;
    assert_eq!(
        (again, o),
        (Err(PayError::Declined), Some(Outcome::Replayed))
    );
}

// Not plain identifiers: a field as the key, `shared` (through `$x:expr`, still
// the opt-out), `wait(...)` and `record_if(...)` as whole expressions, a
// re-exported runtime as `crate`.
with_exprs!("rules.expr_calls", req.key, shared, store, "1h", "1s", wait("7s"),
            record_if(PayError::is_final), false, crate::macro_rules_args::renamed;
    async fn expr_calls(
        store: &MemoryStore,
        req: &Request,
        fail: Option<bool>,
        runs: &AtomicUsize,
    ) -> Result<u64, PayError> {
        runs.fetch_add(1, Ordering::SeqCst);
        match fail {
            Some(true) => Err(PayError::Declined),
            Some(false) => Err(PayError::Busy),
            None => Ok(req.amount),
        }
    }
);

#[tokio::test]
async fn expr_calls_record_only_final_errors() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let req = |key: &str, amount| Request {
        key: key.into(),
        amount,
    };
    assert_eq!(expr_calls(&store, &req("k", 3), None, &runs).await, Ok(3));
    let (v, o) = with_outcome(expr_calls(&store, &req("k", 4), None, &runs)).await;
    assert_eq!(
        (v, o),
        (Ok(3), Some(Outcome::Replayed)),
        "fingerprint = false"
    );
    // Busy is released (the retry runs), Declined is recorded (replayed).
    for _ in 0..2 {
        assert_eq!(
            expr_calls(&store, &req("busy", 1), Some(false), &runs).await,
            Err(PayError::Busy)
        );
    }
    for _ in 0..2 {
        assert_eq!(
            expr_calls(&store, &req("final", 1), Some(true), &runs).await,
            Err(PayError::Declined)
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1 + 2 + 1);
}

// A metavariable handed on to a second macro: two invisible groups, one in the other.
macro_rules! outer {
    ($scope:literal, $key:expr, $store:expr; $($f:tt)*) => {
        with_exprs!($scope, $key, shared, $store, "1h", "1s", reject, release, true,
                    ::idempotent_runtime; $($f)*);
    };
}

outer!("rules.nested", key, store;
    async fn nested(store: &MemoryStore, key: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount)
    }
);

#[tokio::test]
async fn nested_metavariables() {
    let store = MemoryStore::new();
    assert_eq!(nested(&store, "k", 1).await.unwrap(), 1);
    let (v, o) = with_outcome(nested(&store, "k", 1)).await;
    assert_eq!((v.unwrap(), o), (1, Some(Outcome::Replayed)));
    assert!(matches!(
        nested(&store, "k", 2).await,
        Err(Error::FingerprintMismatch(_))
    ));
}

// ---- `tenant = $t`: `(shared)` through `$x:expr` is the parameter, `shared`
// through `$x:ident` is the opt-out, exactly as written directly.
macro_rules! with_tenant_expr {
    ($scope:literal, $tenant:expr; [$($rest:tt)*] $($f:tt)*) => {
        #[idempotent(scope = $scope, tenant = $tenant, $($rest)*)]
        $($f)*
    };
}

macro_rules! with_tenant_ident {
    ($scope:literal, $tenant:ident; [$($rest:tt)*] $($f:tt)*) => {
        #[idempotent(scope = $scope, tenant = $tenant, $($rest)*)]
        $($f)*
    };
}

with_tenant_expr!("rules.tenant_paren", (shared); [key = key, store = store]
    async fn tenant_paren(store: &MemoryStore, shared: &str, key: &str) -> Result<String, Error> {
        Ok(format!("for {shared}"))
    }
);

with_tenant_ident!("rules.tenant_ident_shared", shared; [key = key, store = store]
    async fn tenant_ident_shared(store: &MemoryStore, key: &str, who: &str) -> Result<String, Error> {
        Ok(format!("for {who}"))
    }
);

#[tokio::test]
async fn tenant_through_metavariables() {
    let store = MemoryStore::new();
    assert_eq!(tenant_paren(&store, "acme", "k").await.unwrap(), "for acme");
    let (v, o) = with_outcome(tenant_paren(&store, "globex", "k")).await;
    assert_eq!(
        (v.unwrap(), o),
        ("for globex".to_owned(), Some(Outcome::Executed))
    );
    assert_eq!(
        tenant_ident_shared(&store, "k", "acme").await.unwrap(),
        "for acme"
    );
    // One namespace: the same key from "someone else" with the same arguments replays.
    let (v, o) = with_outcome(tenant_ident_shared(&store, "k", "acme")).await;
    assert_eq!(
        (v.unwrap(), o),
        ("for acme".to_owned(), Some(Outcome::Replayed))
    );
}

// ---- `$x:ident` and `$x:expr` in `skip(...)`, `$x:ident` for key and store,
// `$x:path` for `record_if` and `crate`; the function's name, return type and
// body as `$x:ident`, `$x:ty` and `$x:block`
macro_rules! with_skip {
    ($scope:literal, $key:ident, $store:ident, $skip:ident, $also:expr, $pred:path,
     $krate:path; async fn $name:ident($($params:tt)*) -> $ret:ty $body:block) => {
        #[idempotent(scope = $scope, key = $key, tenant = shared, store = $store,
                     skip($skip, $also), errors = record_if($pred), crate = $krate)]
        async fn $name($($params)*) -> $ret $body
    };
}

with_skip!("rules.skip", id, db, runs, note, PayError::is_final, crate::macro_rules_args::renamed;
    async fn skipped(
        db: &MemoryStore,
        id: &str,
        amount: u64,
        fail: bool,
        note: &str,
        runs: &AtomicUsize,
    ) -> Result<u64, PayError> {
        let _ = note; // not part of the request
        runs.fetch_add(1, Ordering::SeqCst);
        match fail {
            true => Err(PayError::Declined),
            false => Ok(amount),
        }
    }
);

#[tokio::test]
async fn skip_through_metavariables() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    assert_eq!(skipped(&store, "k", 1, false, "a", &runs).await, Ok(1));
    // Another note and another counter: both skipped, so the same fingerprint.
    let other = AtomicUsize::new(100);
    let (v, o) = with_outcome(skipped(&store, "k", 1, false, "b", &other)).await;
    assert_eq!((v, o), (Ok(1), Some(Outcome::Replayed)));
    assert_eq!(
        (runs.load(Ordering::SeqCst), other.load(Ordering::SeqCst)),
        (1, 100)
    );
    // `amount` and `fail` are still fingerprinted.
    assert_eq!(
        skipped(&store, "k", 2, false, "a", &runs).await,
        Err(PayError::Mismatch)
    );
    // `record_if($pred)`: Declined is recorded.
    assert_eq!(
        skipped(&store, "d", 1, true, "a", &runs).await,
        Err(PayError::Declined)
    );
    let (v, o) = with_outcome(skipped(&store, "d", 1, true, "a", &runs)).await;
    assert_eq!((v, o), (Err(PayError::Declined), Some(Outcome::Replayed)));
}

// ---- `$x:path` for the policy keywords themselves (`errors = record`,
// `in_progress = reject`), not only inside `record_if(...)`
macro_rules! with_policy_paths {
    ($scope:literal, $key:ident, $store:ident, $errors:path, $in_progress:path; $($f:tt)*) => {
        #[idempotent(scope = $scope, key = $key, tenant = shared, store = $store,
                     errors = $errors, in_progress = $in_progress)]
        $($f)*
    };
}

with_policy_paths!("rules.policy_paths", key, store, record, reject;
    async fn policy_paths(store: &MemoryStore, key: &str, fail: bool) -> Result<u8, PayError> {
        if fail {
            return Err(PayError::Declined);
        }
        Ok(1)
    }
);

#[tokio::test]
async fn policy_keywords_through_path_metavariables() {
    let store = MemoryStore::new();
    assert_eq!(
        policy_paths(&store, "e", true).await,
        Err(PayError::Declined)
    );
    // `errors = $errors` with `record` as a path: the error is replayed.
    let (again, o) = with_outcome(policy_paths(&store, "e", true)).await;
    assert_eq!(
        (again, o),
        (Err(PayError::Declined), Some(Outcome::Replayed))
    );
    let info = registered("rules.policy_paths");
    assert_eq!(info.errors, ErrorPolicy::Record);
    assert_eq!(info.in_progress, InProgressPolicy::Reject);
}

// ---- the whole attribute from `$($args:tt)*`
macro_rules! attribute {
    ([$($args:tt)*] $($f:tt)*) => {
        #[idempotent($($args)*)]
        $($f)*
    };
}

attribute!([scope = "rules.whole", key = key, tenant = tenant, store = store, skip(runs),
            in_progress = reject, ttl = "9h"]
    async fn whole(store: &MemoryStore, tenant: u8, key: &str, amount: u64, runs: &AtomicUsize)
        -> Result<u64, Error> {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok(amount)
    }
);

#[tokio::test]
async fn whole_attribute_from_a_macro() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    assert_eq!(whole(&store, 1, "k", 1, &runs).await.unwrap(), 1);
    let (v, o) = with_outcome(whole(&store, 1, "k", 1, &runs)).await;
    assert_eq!((v.unwrap(), o), (1, Some(Outcome::Replayed)));
    assert!(matches!(
        whole(&store, 1, "k", 2, &runs).await,
        Err(Error::FingerprintMismatch(_))
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

// ---- `tx = $t` with `$t:expr`, through a test-only connection over MemoryStore
struct FakeTx {
    store: MemoryStore,
    statements: u32,
}

impl TransactionalConnection for FakeTx {
    fn store_name(&self) -> &'static str {
        "fake"
    }

    fn in_transaction<'a, 't>(&'a mut self) -> BoxFuture<'t, Result<bool, StoreError>>
    where
        'a: 't,
        Self: 't,
    {
        Box::pin(async { Ok(true) })
    }

    fn reserve_in_transaction<'a, 'b, 't>(
        &'a mut self,
        request: ReserveRequest<'b>,
        _lock_wait: Duration,
    ) -> BoxFuture<'t, Result<Reservation, Error>>
    where
        'a: 't,
        'b: 't,
        Self: 't,
    {
        Box::pin(async move {
            self.statements += 1;
            Ok(self.store.reserve(request).await?)
        })
    }

    fn complete_in_transaction<'a, 'b, 't>(
        &'a mut self,
        completion: Completion<'b>,
    ) -> BoxFuture<'t, Result<Fenced, StoreError>>
    where
        'a: 't,
        'b: 't,
        Self: 't,
    {
        Box::pin(async move {
            self.statements += 1;
            self.store.complete(completion).await
        })
    }

    fn release_in_transaction<'a, 'b, 'c, 't>(
        &'a mut self,
        identity: &'b Identity,
        token: &'c OwnerToken,
    ) -> BoxFuture<'t, Result<Fenced, StoreError>>
    where
        'a: 't,
        'b: 't,
        'c: 't,
        Self: 't,
    {
        Box::pin(async move {
            self.statements += 1;
            self.store.release(identity, token).await
        })
    }

    fn end_lease_in_transaction<'a, 'b, 'c, 't>(
        &'a mut self,
        identity: &'b Identity,
        token: &'c OwnerToken,
    ) -> BoxFuture<'t, Result<Fenced, StoreError>>
    where
        'a: 't,
        'b: 't,
        'c: 't,
        Self: 't,
    {
        Box::pin(async move {
            self.statements += 1;
            self.store.heartbeat(identity, token, Duration::ZERO).await
        })
    }
}

macro_rules! with_tx {
    ($scope:literal, $tx:expr; [$($rest:tt)*] $($f:tt)*) => {
        #[idempotent(scope = $scope, tx = $tx, $($rest)*)]
        $($f)*
    };
}

// `tx` names a parameter, so it is left out of the fingerprint (a `FakeTx` is not
// `Serialize`: fingerprinting it would not compile).
with_tx!("rules.tx", conn; [key = key, tenant = tenant]
    async fn transactional(conn: &mut FakeTx, tenant: &str, key: &str, amount: u64) -> Result<u64, Error> {
        conn.statements += 100;
        Ok(amount)
    }
);

#[tokio::test]
async fn tx_through_a_metavariable() {
    let mut conn = FakeTx {
        store: MemoryStore::new(),
        statements: 0,
    };
    assert_eq!(transactional(&mut conn, "t", "k", 3).await.unwrap(), 3);
    assert_eq!(conn.statements, 102, "reserve + body + complete");
    let (v, o) = with_outcome(transactional(&mut conn, "t", "k", 3)).await;
    assert_eq!((v.unwrap(), o), (3, Some(Outcome::Replayed)));
    assert_eq!(conn.statements, 103, "the body did not run again");
    assert!(matches!(
        transactional(&mut conn, "t", "k", 4).await,
        Err(Error::FingerprintMismatch(_))
    ));
}

// ---- what the attribute made of each argument
#[test]
fn registry_shows_every_argument_as_if_written_directly() {
    let literal = registered("rules.literal");
    assert_eq!(literal.function, concat!(module_path!(), "::literal"));
    assert_eq!(literal.ttl, Duration::from_secs(2 * 3600));
    assert_eq!(literal.lease, Duration::from_secs(3));
    assert_eq!(
        literal.in_progress,
        InProgressPolicy::Wait(Duration::from_secs(4))
    );
    assert!(literal.fingerprinted && !literal.shared_tenant);
    assert_eq!(literal.fingerprinted_parameters, ["amount"]);
    assert!(!registered("rules.literal_no_fingerprint").fingerprinted);

    let expr = registered("rules.expr");
    assert_eq!(expr.ttl, Duration::from_secs(5 * 3600));
    assert_eq!(expr.lease, Duration::from_secs(6));
    assert_eq!(expr.in_progress, InProgressPolicy::Reject);
    assert_eq!(expr.errors, ErrorPolicy::Record);
    assert!(!expr.shared_tenant);
    assert_eq!(expr.fingerprinted_parameters, ["amount", "fail"]);

    let calls = registered("rules.expr_calls");
    assert!(
        calls.shared_tenant,
        "`shared` through `$x:expr` is the opt-out"
    );
    assert_eq!(
        calls.in_progress,
        InProgressPolicy::Wait(Duration::from_secs(7))
    );
    assert_eq!(calls.errors, ErrorPolicy::RecordIf("PayError::is_final"));
    assert!(!calls.fingerprinted && calls.fingerprinted_parameters.is_empty());

    assert_eq!(
        registered("rules.nested").fingerprinted_parameters,
        ["amount"]
    );

    let paren = registered("rules.tenant_paren");
    assert!(!paren.shared_tenant, "`(shared)` is the parameter");
    assert!(paren.fingerprinted_parameters.is_empty());
    let ident = registered("rules.tenant_ident_shared");
    assert!(
        ident.shared_tenant,
        "`shared` through `$x:ident` is the opt-out"
    );
    assert_eq!(ident.fingerprinted_parameters, ["who"]);

    let skip = registered("rules.skip");
    assert_eq!(skip.fingerprinted_parameters, ["amount", "fail"]);
    assert_eq!(skip.errors, ErrorPolicy::RecordIf("PayError::is_final"));

    let whole = registered("rules.whole");
    assert_eq!(whole.fingerprinted_parameters, ["amount"]);
    assert_eq!(whole.in_progress, InProgressPolicy::Reject);
    assert_eq!(whole.ttl, Duration::from_secs(9 * 3600));

    let tx = registered("rules.tx");
    assert!(tx.transactional);
    assert_eq!(tx.fingerprinted_parameters, ["amount"]);
}
