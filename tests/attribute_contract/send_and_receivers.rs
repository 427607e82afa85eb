//! What `#[idempotent]` expands to, as a caller meets it: the future stays
//! `Send` where the body's is (a trait's `+ Send` future, `tokio::spawn`),
//! methods taking `self: Arc<Self>`, the `key` and `tenant` expressions
//! evaluated once per call and before the body, an argument fingerprinted
//! as it was passed even when the body changes it, and a function calling
//! itself with another key.

use idempotent_runtime::{
    idempotent, with_outcome, Error, MemoryStore, Outcome, Recovery, Store, Takeover,
};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A trait whose method must return a `Send` future, implemented by an
/// annotated `async fn` that borrows `self`'s store and asks a hook.
trait Charger: Send + Sync {
    fn charge(&self, key: String, amount: u64) -> impl Future<Output = Result<u64, Error>> + Send;
}

struct Gateway {
    store: Arc<dyn Store>,
    runs: AtomicUsize,
}

impl Gateway {
    async fn already(&self, _t: &Takeover) -> Result<Recovery<u64>, Error> {
        Ok(Recovery::Run)
    }

    /// `self: Arc<Self>`: the service, not the request (not fingerprinted).
    #[idempotent(scope = "send.arc_self", key = key, tenant = shared, store = self.store.clone())]
    async fn refund(self: Arc<Self>, key: String, amount: u64) -> Result<u64, Error> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        tokio::task::yield_now().await;
        Ok(amount)
    }
}

impl Charger for Gateway {
    #[idempotent(scope = "send.trait_method", key = key, tenant = shared, store = self.store,
                 recover = self.already)]
    async fn charge(&self, key: String, amount: u64) -> Result<u64, Error> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        tokio::task::yield_now().await;
        Ok(amount * 2)
    }
}

fn gateway() -> Arc<Gateway> {
    Arc::new(Gateway {
        store: Arc::new(MemoryStore::new()),
        runs: AtomicUsize::new(0),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_annotated_trait_method_and_an_arc_self_method_are_spawnable() {
    let g = gateway();
    let first = tokio::spawn({
        let g = g.clone();
        async move { g.charge("k1".to_owned(), 5).await }
    });
    assert_eq!(first.await.expect("joins").expect("runs"), 10);
    let again = tokio::spawn({
        let g = g.clone();
        async move { with_outcome(g.charge("k1".to_owned(), 5)).await }
    });
    let (value, outcome) = again.await.expect("joins");
    assert_eq!(
        (value.expect("replays"), outcome),
        (10, Some(Outcome::Replayed))
    );

    assert_eq!(
        tokio::spawn(g.clone().refund("r1".to_owned(), 3))
            .await
            .expect("joins")
            .expect("runs"),
        3
    );
    let (value, outcome) = tokio::spawn(with_outcome(g.clone().refund("r1".to_owned(), 3)))
        .await
        .expect("joins");
    assert_eq!(
        (value.expect("replays"), outcome),
        (3, Some(Outcome::Replayed))
    );
    // A different amount under the same key is a reused key.
    assert!(matches!(
        g.clone().refund("r1".to_owned(), 4).await,
        Err(Error::FingerprintMismatch(_))
    ));
    assert_eq!(g.runs.load(Ordering::SeqCst), 2, "one run per key");
}

/// A command taking `self` by value whose store is one of its fields
/// (`store = self.store`): its body uses only the other fields, which are
/// captured apart from the borrowed store, so it compiles and runs. (A body
/// using `self` whole, or the store's field, cannot; the attribute says so:
/// tests/ui/store_borrowed_from_an_owned_self.rs.)
#[derive(Clone)]
struct Payout {
    store: MemoryStore,
    amount: u64,
}

impl Payout {
    #[idempotent(scope = "send.by_value_store_field", key = key, tenant = shared,
                 store = self.store, skip(self))]
    async fn send(self, key: &str) -> Result<u64, Error> {
        tokio::task::yield_now().await;
        Ok(self.amount)
    }
}

#[tokio::test]
async fn a_by_value_self_whose_body_uses_other_fields_borrows_its_store_field() {
    let store = MemoryStore::new();
    let payout = |amount| Payout {
        store: store.clone(),
        amount,
    };
    assert_eq!(payout(5).send("p1").await.expect("runs"), 5);
    // `self` is skipped: the record's answer is replayed.
    assert_eq!(payout(6).send("p1").await.expect("replays"), 5);
}

/// A by-value method whose receiver names its type (`self: Ledger` in
/// `impl Ledger`, as a macro writing the impl may) is `self` by value: a
/// body using only other fields compiles with `store = self.store`, as with
/// `self` or `self: Self`; and a body importing a module's own name
/// (`use std::fmt::{self, Write}`) does not use `self` at all, so it compiles
/// under an `Arc<Self>` receiver too; nor does one destructuring `self`
/// (`let Self { amount, .. } = self`, `match self`) move the store's field.
struct Ledger {
    store: MemoryStore,
    amount: u64,
}

impl Ledger {
    #[idempotent(scope = "send.named_self_type", key = key, tenant = shared,
                 store = self.store, skip(self))]
    async fn named(self: Ledger, key: &str) -> Result<u64, Error> {
        Ok(self.amount)
    }

    #[idempotent(scope = "send.by_value_use_self_import", key = key, tenant = shared,
                 store = self.store, skip(self))]
    async fn imports(self, key: &str) -> Result<String, Error> {
        use std::fmt::{self, Write};
        let mut out = String::new();
        let written: fmt::Result = write!(out, "{}", self.amount);
        written.expect("a String takes any write");
        Ok(out)
    }

    #[idempotent(scope = "send.arc_use_self_import", key = key, tenant = shared,
                 store = self.store, skip(self))]
    async fn arc_imports(self: Arc<Self>, key: &str) -> Result<String, Error> {
        use std::fmt::{self, Write};
        let mut out = String::new();
        let written: fmt::Result = write!(out, "{key}");
        written.expect("a String takes any write");
        Ok(out)
    }
}

impl Ledger {
    /// `self` destructured: only `amount` is moved into the body.
    #[idempotent(scope = "send.by_value_destructured", key = key, tenant = shared,
                 store = self.store, skip(self))]
    async fn destructured(self, key: &str) -> Result<u64, Error> {
        let Self { amount, .. } = self;
        Ok(amount)
    }

    /// `self` matched: only `amount` is moved into the body.
    #[idempotent(scope = "send.by_value_matched", key = key, tenant = shared,
                 store = self.store, skip(self))]
    async fn matched(self, key: &str) -> Result<u64, Error> {
        match self {
            Ledger { amount: 0, .. } => Ok(0),
            Ledger { amount, .. } => Ok(amount),
        }
    }
}

#[tokio::test]
async fn a_named_self_type_and_a_use_of_a_modules_self_are_not_uses_of_self() {
    let store = MemoryStore::new();
    let ledger = |amount| Ledger {
        store: store.clone(),
        amount,
    };
    assert_eq!(ledger(7).named("n1").await.expect("runs"), 7);
    assert_eq!(ledger(8).named("n1").await.expect("replays"), 7);
    assert_eq!(ledger(9).imports("i1").await.expect("runs"), "9");
    assert_eq!(
        Arc::new(ledger(1)).arc_imports("a1").await.expect("runs"),
        "a1"
    );
    assert_eq!(ledger(3).destructured("d1").await.expect("runs"), 3);
    assert_eq!(ledger(4).destructured("d1").await.expect("replays"), 3);
    assert_eq!(ledger(5).matched("m1").await.expect("runs"), 5);
}

/// An error type that is not `Send` (it holds an `Rc`), or that borrows
/// (not `'static`), is the function's own business (the hunt's lead: no
/// error deep in generated code): the runtime neither spawns the body nor
/// keeps the error past the call, so both compile and run where they are
/// awaited, as any `async fn` returning them does. (Only the future is then
/// not `Send`; `tokio::spawn` says so at the caller, naming the type.)
#[derive(Debug)]
struct LocalError(std::rc::Rc<String>);

impl From<Error> for LocalError {
    fn from(e: Error) -> Self {
        LocalError(std::rc::Rc::new(e.to_string()))
    }
}

#[idempotent(scope = "send.local_error", key = key, tenant = shared, store = store)]
async fn with_local_error(store: &MemoryStore, key: &str, fail: bool) -> Result<u8, LocalError> {
    if fail {
        return Err(LocalError(std::rc::Rc::new("declined".to_owned())));
    }
    Ok(1)
}

#[derive(Debug)]
struct BorrowedError<'a>(Option<&'a str>);

impl From<Error> for BorrowedError<'_> {
    fn from(_: Error) -> Self {
        BorrowedError(None)
    }
}

#[idempotent(scope = "send.borrowed_error", key = key, tenant = shared, store = store,
             skip(reason))]
async fn with_borrowed_error<'a>(
    store: &MemoryStore,
    key: &str,
    reason: &'a str,
    fail: bool,
) -> Result<u8, BorrowedError<'a>> {
    if fail {
        return Err(BorrowedError(Some(reason)));
    }
    Ok(2)
}

#[tokio::test]
async fn an_error_type_that_is_not_send_or_not_static_compiles_and_runs() {
    let store = MemoryStore::new();
    let e = with_local_error(&store, "l1", true).await.unwrap_err();
    assert_eq!(*e.0, "declined");
    assert_eq!(with_local_error(&store, "l2", false).await.unwrap(), 1);
    assert_eq!(with_local_error(&store, "l2", false).await.unwrap(), 1);
    // A refusal (another request under the key) converts into it too.
    let refused = with_local_error(&store, "l2", true).await.unwrap_err();
    assert!(
        refused.0.contains("reused with different arguments"),
        "{refused:?}"
    );
    let reason = String::from("no funds");
    let e = with_borrowed_error(&store, "b1", &reason, true)
        .await
        .unwrap_err();
    assert_eq!(e.0, Some("no funds"));
    assert_eq!(
        with_borrowed_error(&store, "b1", &reason, false)
            .await
            .unwrap(),
        2
    );
}

/// Where each expression of one call was evaluated, in order.
type Trace = Mutex<Vec<&'static str>>;

fn note<T>(trace: &Trace, what: &'static str, value: T) -> T {
    trace.lock().expect("trace").push(what);
    value
}

#[idempotent(scope = "send.evaluated_once", key = note(trace, "key", key),
             tenant = note(trace, "tenant", "acme"), store = store, skip(trace))]
async fn traced(
    store: &MemoryStore,
    trace: &Trace,
    key: &str,
    mut items: Vec<u8>,
) -> Result<usize, Error> {
    note(trace, "body", ());
    // The body changes a fingerprinted argument: the fingerprint is of the
    // value the caller passed.
    items.push(99);
    items.clear();
    Ok(items.len())
}

#[tokio::test]
async fn key_and_tenant_are_evaluated_once_before_the_body_and_the_fingerprint_is_of_the_arguments_as_passed(
) {
    let store = MemoryStore::new();
    let trace = Trace::default();
    assert_eq!(
        traced(&store, &trace, "e1", vec![1, 2])
            .await
            .expect("runs"),
        0
    );
    let first = std::mem::take(&mut *trace.lock().expect("trace"));
    assert_eq!(
        first.iter().filter(|w| **w == "key").count(),
        1,
        "{first:?}"
    );
    assert_eq!(
        first.iter().filter(|w| **w == "tenant").count(),
        1,
        "{first:?}"
    );
    assert_eq!(first.last(), Some(&"body"), "{first:?}");

    let (value, outcome) = with_outcome(traced(&store, &trace, "e1", vec![1, 2])).await;
    assert_eq!(
        (value.expect("replays"), outcome),
        (0, Some(Outcome::Replayed))
    );
    let replay = std::mem::take(&mut *trace.lock().expect("trace"));
    assert_eq!(
        replay.len(),
        2,
        "key and tenant once each, no body: {replay:?}"
    );
    assert!(matches!(
        traced(&store, &trace, "e1", vec![]).await,
        Err(Error::FingerprintMismatch(_))
    ));
}

/// A function that calls itself with another key (an order that places its
/// parent first): each key is its own record; a retry of the outer call
/// replays without running either body again.
#[idempotent(scope = "send.recursive", key = key, tenant = shared, store = store, skip(runs))]
async fn place(
    store: &MemoryStore,
    runs: &AtomicUsize,
    key: String,
    depth: u8,
) -> Result<u8, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    if depth == 0 {
        return Ok(0);
    }
    let inner = Box::pin(place(store, runs, format!("{key}/parent"), depth - 1)).await?;
    Ok(inner + 1)
}

#[tokio::test]
async fn a_function_calling_itself_with_another_key_records_each_key() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    assert_eq!(
        place(&store, &runs, "o".to_owned(), 2).await.expect("runs"),
        2
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    let (value, outcome) = with_outcome(place(&store, &runs, "o".to_owned(), 2)).await;
    assert_eq!(
        (value.expect("replays"), outcome),
        (2, Some(Outcome::Replayed))
    );
    let (value, outcome) = with_outcome(place(&store, &runs, "o/parent".to_owned(), 1)).await;
    assert_eq!(
        (value.expect("replays"), outcome),
        (1, Some(Outcome::Replayed))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3, "no body ran again");
}
