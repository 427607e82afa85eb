//! Instantiations of one generic function share its scope. Each type or
//! const parameter goes into the fingerprint (unless only parameters left
//! out of it mention it), so `create::<User>` and `create::<Order>` with one
//! key are two requests: the second is refused as a reused key, never
//! replayed the first one's answer (rule 7). A record an older build stored
//! without them is still replayed (rule 6).

use idempotent_runtime::{
    idempotent, with_outcome, Error, FingerprintBuilder, Identity, MemoryStore, Outcome,
};
use serde::Serialize;

/// A type's name without its module path: what each function answers, so a
/// test sees which instantiation ran.
fn short_name<T: ?Sized>() -> String {
    std::any::type_name::<T>()
        .rsplit("::")
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[derive(Default)]
struct User;
#[derive(Default)]
struct Order;

#[idempotent(scope = "generics.create", key = key, tenant = tenant, store = store)]
async fn create<T: Default>(store: &MemoryStore, tenant: &str, key: &str) -> Result<String, Error> {
    let _ = T::default();
    Ok(short_name::<T>())
}

#[idempotent(scope = "generics.value", key = key, tenant = shared, store = store)]
async fn value<T: Serialize + Send + Sync>(
    store: &MemoryStore,
    key: &str,
    v: T,
) -> Result<String, Error> {
    Ok(std::any::type_name::<T>().to_owned())
}

#[idempotent(scope = "generics.batch", key = key, tenant = shared, store = store)]
async fn batch<const N: usize>(store: &MemoryStore, key: &str) -> Result<usize, Error> {
    Ok(N)
}

trait Account: Sync {
    fn name(&self) -> &'static str;

    /// A default method: it runs for every implementor, under one scope.
    #[idempotent(scope = "generics.close", key = key, tenant = shared, store = store)]
    async fn close(&self, store: &MemoryStore, key: &str) -> Result<String, Error> {
        Ok(format!("closed {}", self.name()))
    }
}

struct Savings;
struct Checking;

impl Account for Savings {
    fn name(&self) -> &'static str {
        "savings"
    }
}

impl Account for Checking {
    fn name(&self) -> &'static str {
        "checking"
    }
}

fn reused<T: std::fmt::Debug>(answer: Result<T, Error>) {
    assert!(
        matches!(answer, Err(Error::FingerprintMismatch(_))),
        "another instantiation was served this key's answer: {answer:?}"
    );
}

#[tokio::test]
async fn instantiations_of_one_generic_function_are_not_one_request() {
    let store = MemoryStore::new();
    assert_eq!(
        create::<User>(&store, "alice", "req-7")
            .await
            .expect("runs"),
        "User"
    );
    reused(create::<Order>(&store, "alice", "req-7").await);
    let again = with_outcome(create::<User>(&store, "alice", "req-7")).await;
    assert!(
        matches!(again, (Ok(ref u), Some(Outcome::Replayed)) if u == "User"),
        "{again:?}"
    );

    // A parameter of the type parameter's type: its type counts too (a value
    // cannot be relied on to show it).
    assert_eq!(value(&store, "k", 7u8).await.expect("runs"), "u8");
    reused(value(&store, "k", 8u8).await);
    reused(value(&store, "k", 7i64).await);

    assert_eq!(batch::<3>(&store, "k").await.expect("runs"), 3);
    reused(batch::<2>(&store, "k").await);

    assert_eq!(under_cfg::<u8>(&store, "k").await.expect("runs"), 1);
    reused(under_cfg::<u16>(&store, "k").await);
}

mod other {
    /// A type named like the type parameter below.
    pub type T = u8;
}

pub trait Model {
    type Id: Serialize + Send + Sync;
}

impl Model for User {
    type Id = u64;
}

impl Model for Order {
    type Id = u64;
}

/// `T` names another type here (`other::T`): the parameter does not tell
/// which `T` the call is for.
#[idempotent(scope = "generics.same_name", key = key, tenant = shared, store = store)]
async fn same_name<T: Default>(store: &MemoryStore, key: &str, x: other::T) -> Result<u8, Error> {
    let _ = T::default();
    Ok(x)
}

/// `T::Id` is `u64` for both models: its value does not tell which `T`.
#[idempotent(scope = "generics.associated", key = key, tenant = shared, store = store)]
async fn fetch<T: Model>(store: &MemoryStore, key: &str, id: T::Id) -> Result<String, Error> {
    let _ = id;
    Ok(short_name::<T>())
}

/// `<T>::Id`: a qualified path through `T`.
#[idempotent(scope = "generics.qualified", key = key, tenant = shared, store = store)]
async fn fetch_qualified<T: Model>(
    store: &MemoryStore,
    key: &str,
    id: <T>::Id,
) -> Result<String, Error> {
    let _ = id;
    Ok(short_name::<T>())
}

/// One value for every `T`.
#[idempotent(scope = "generics.phantom", key = key, tenant = shared, store = store)]
async fn phantom<T: Send + Sync>(
    store: &MemoryStore,
    key: &str,
    marker: std::marker::PhantomData<T>,
    none: [T; 0],
) -> Result<u8, Error> {
    let _ = (marker, none);
    Ok(1)
}

/// `T` only in a bound: the value's type is not `T`.
#[idempotent(scope = "generics.bound", key = key, tenant = shared, store = store)]
async fn widen<T: Send>(
    store: &MemoryStore,
    key: &str,
    v: impl Into<T> + Serialize + Send + Sync,
) -> Result<String, Error> {
    let _ = v;
    Ok(std::any::type_name::<T>().to_owned())
}

/// A typed id: its value (the number) does not show its model.
#[derive(Serialize)]
#[serde(transparent, bound = "")]
struct TypedId<T> {
    raw: u64,
    #[serde(skip)]
    model: std::marker::PhantomData<T>,
}

fn typed<T>(raw: u64) -> TypedId<T> {
    TypedId {
        raw,
        model: std::marker::PhantomData,
    }
}

#[idempotent(scope = "generics.typed_id", key = key, tenant = shared, store = store)]
async fn delete<T: Send + Sync>(
    store: &MemoryStore,
    key: &str,
    id: TypedId<T>,
) -> Result<String, Error> {
    let _ = id;
    Ok(short_name::<T>())
}

/// A capacity only in the type.
#[derive(Serialize)]
struct Buf<const N: usize>(Vec<u8>);

#[idempotent(scope = "generics.capacity", key = key, tenant = shared, store = store)]
async fn capacity<const N: usize>(
    store: &MemoryStore,
    key: &str,
    b: Buf<N>,
) -> Result<usize, Error> {
    let _ = b;
    Ok(N)
}

/// The only parameter naming `T` is compiled out.
#[idempotent(scope = "generics.cfg_out", key = key, tenant = shared, store = store)]
async fn compiled_out<T: Default + Send + Sync>(
    store: &MemoryStore,
    key: &str,
    #[cfg(any())] v: T,
) -> Result<String, Error> {
    Ok(short_name::<T>())
}

#[tokio::test]
async fn a_type_parameter_a_value_may_not_show_counts() {
    let store = MemoryStore::new();
    assert_eq!(
        delete::<User>(&store, "d", typed(7)).await.expect("runs"),
        "User"
    );
    reused(delete::<Order>(&store, "d", typed(7)).await);
    assert_eq!(
        capacity::<4>(&store, "c", Buf(vec![1]))
            .await
            .expect("runs"),
        4
    );
    reused(capacity::<8>(&store, "c", Buf(vec![1])).await);
    assert_eq!(
        compiled_out::<User>(&store, "o").await.expect("runs"),
        "User"
    );
    reused(compiled_out::<Order>(&store, "o").await);
}

#[tokio::test]
async fn a_type_parameter_no_value_can_show_counts() {
    let store = MemoryStore::new();
    assert_eq!(
        fetch_qualified::<User>(&store, "q", 7).await.expect("runs"),
        "User"
    );
    reused(fetch_qualified::<Order>(&store, "q", 7).await);
    assert_eq!(
        phantom::<User>(&store, "p", std::marker::PhantomData, [])
            .await
            .expect("runs"),
        1
    );
    reused(phantom::<Order>(&store, "p", std::marker::PhantomData, []).await);
    assert_eq!(widen::<u16>(&store, "w", 7u8).await.expect("runs"), "u16");
    reused(widen::<u64>(&store, "w", 7u8).await);
}

#[tokio::test]
async fn a_type_parameter_only_named_in_a_path_still_counts() {
    let store = MemoryStore::new();
    assert_eq!(same_name::<User>(&store, "k", 1).await.expect("runs"), 1);
    reused(same_name::<Order>(&store, "k", 1).await);
    assert_eq!(fetch::<User>(&store, "k", 7).await.expect("runs"), "User");
    reused(fetch::<Order>(&store, "k", 7).await);
}

/// A trait's default method runs for every implementor under one scope, and
/// `self` is not fingerprinted: the implementors are one request (README).
#[tokio::test]
async fn a_default_methods_implementors_share_its_records() {
    let store = MemoryStore::new();
    assert_eq!(
        Savings.close(&store, "k").await.expect("runs"),
        "closed savings"
    );
    let replayed = with_outcome(Checking.close(&store, "k")).await;
    assert!(
        matches!(replayed, (Ok(ref s), Some(Outcome::Replayed)) if s == "closed savings"),
        "{replayed:?}"
    );
}

/// A type parameter that only a skipped parameter's type mentions is not
/// part of the request: one caller passing a pool and another a transaction
/// (`E: Executor`) send one request.
#[idempotent(scope = "generics.skipped", key = key, tenant = shared, store = store, skip(ctx))]
async fn with_context<C: Sync + ?Sized>(
    store: &MemoryStore,
    key: &str,
    ctx: &C,
    amount: u32,
) -> Result<u32, Error> {
    let _ = ctx;
    Ok(amount)
}

mod limits {
    /// Named like the type parameter below.
    pub type T = u32;
}

/// A skipped parameter whose type only looks like the type parameter (a
/// path ending in its name, an associated type's binding): the type
/// parameter still counts.
#[idempotent(scope = "generics.lookalike", key = key, tenant = shared, store = store,
             skip(limit, items))]
async fn lookalike<T: Default, Item: Default>(
    store: &MemoryStore,
    key: &str,
    limit: limits::T,
    items: Box<dyn Iterator<Item = u8> + Send + Sync>,
) -> Result<String, Error> {
    let _ = (limit, items, T::default(), Item::default());
    Ok(format!("{}/{}", short_name::<T>(), short_name::<Item>()))
}

#[tokio::test]
async fn a_skipped_parameter_that_only_looks_like_a_type_parameter_does_not_hide_it() {
    let store = MemoryStore::new();
    let items = || Box::new(std::iter::empty::<u8>()) as Box<dyn Iterator<Item = u8> + Send + Sync>;
    assert_eq!(
        lookalike::<User, User>(&store, "k", 5, items())
            .await
            .expect("runs"),
        "User/User"
    );
    reused(lookalike::<Order, User>(&store, "k", 5, items()).await);
    reused(lookalike::<User, Order>(&store, "k", 5, items()).await);
}

#[tokio::test]
async fn a_type_parameter_of_a_skipped_parameter_does_not_count() {
    let store = MemoryStore::new();
    assert_eq!(with_context(&store, "k", &1u8, 5).await.expect("runs"), 5);
    let replayed = with_outcome(with_context(&store, "k", "a transaction", 5)).await;
    assert!(
        matches!(replayed, (Ok(5), Some(Outcome::Replayed))),
        "{replayed:?}"
    );
}

/// A type parameter under `#[cfg]`: counted where it is compiled in.
#[idempotent(scope = "generics.under_cfg", key = key, tenant = shared, store = store)]
async fn under_cfg<#[cfg(any())] T, #[cfg(not(any()))] U: Default>(
    store: &MemoryStore,
    key: &str,
) -> Result<u8, Error> {
    let _ = U::default();
    Ok(1)
}

#[idempotent(scope = "generics.priced", key = key, tenant = shared, store = store)]
async fn priced<T: Default>(store: &MemoryStore, key: &str, v: u8) -> Result<String, Error> {
    let _ = T::default();
    Ok("ran".to_owned())
}

/// A record stored by a build that did not count instantiations (the
/// parameters' fingerprint alone) is still replayed to the same call.
#[tokio::test]
async fn a_record_stored_without_the_instantiation_is_still_replayed() {
    let store = MemoryStore::new();
    let mut builder = FingerprintBuilder::new();
    builder.argument("v", &7u8);
    let old = builder
        .finish()
        .expect("fingerprint")
        .expect("one argument");
    recorded_by_an_older_build(
        &store,
        "generics.priced",
        "old",
        &old,
        br#""recorded by an older build""#,
    )
    .await;
    let replayed = with_outcome(priced::<User>(&store, "old", 7)).await;
    assert!(
        matches!(replayed, (Ok(ref s), Some(Outcome::Replayed)) if s == "recorded by an older build"),
        "{replayed:?}"
    );
    reused(priced::<User>(&store, "old", 8).await);
}

/// The claimants of a shared scope answer for each other (rule 21): a method
/// and a free function claiming one are one request with the same
/// arguments, whatever their instantiation.
struct Refunds;

impl Refunds {
    #[idempotent(scope = "generics.shared_refund", key = key, tenant = shared, store = store,
                 shared_scope)]
    async fn refund(&self, store: &MemoryStore, key: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount)
    }
}

#[idempotent(scope = "generics.shared_refund", key = key, tenant = shared, store = store,
             shared_scope)]
async fn refund_from_queue<T: Send>(
    store: &MemoryStore,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    Ok(amount + 1)
}

#[tokio::test]
async fn the_claimants_of_a_shared_scope_replay_each_other() {
    let store = MemoryStore::new();
    assert_eq!(Refunds.refund(&store, "k", 5).await.expect("runs"), 5);
    let replayed = with_outcome(refund_from_queue::<u8>(&store, "k", 5)).await;
    assert!(
        matches!(replayed, (Ok(5), Some(Outcome::Replayed))),
        "{replayed:?}"
    );
    reused(refund_from_queue::<u8>(&store, "k", 6).await);
}

// ---- The answer's type decides too: a record of one type is never replayed
// as another. Two types of one shape, so such a replay would decode silently.

#[derive(Debug, Default, PartialEq, Serialize, serde::Deserialize)]
struct Customer {
    id: u32,
}

#[derive(Debug, Default, PartialEq, Serialize, serde::Deserialize)]
struct Invoice {
    id: u32,
}

/// Where records of `T` live: left out of the fingerprint, and its type
/// mentions `T`.
struct Repo<T>(std::marker::PhantomData<T>);

impl<T> Repo<T> {
    fn new() -> Self {
        Repo(std::marker::PhantomData)
    }
}

/// `T` is mentioned by a skipped parameter only, and by the return type.
#[idempotent(scope = "generics.load", key = key, tenant = shared, store = store, skip(repo))]
async fn load<T: Default + Serialize + serde::de::DeserializeOwned + Send + Sync>(
    store: &MemoryStore,
    key: &str,
    repo: &Repo<T>,
) -> Result<T, Error> {
    let _ = repo;
    Ok(T::default())
}

/// A key typed by what it finds: the key is left out, `T` is in the answer.
struct TypedKey<T>(&'static str, std::marker::PhantomData<T>);

impl<T> std::fmt::Display for TypedKey<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

#[idempotent(scope = "generics.find", key = key, tenant = shared, store = store)]
async fn find<T: Default + Serialize + serde::de::DeserializeOwned + Send + Sync>(
    store: &MemoryStore,
    key: &TypedKey<T>,
) -> Result<T, Error> {
    Ok(T::default())
}

/// A trait's default method answering `Self`: one per implementor.
trait Created: Default + Serialize + serde::de::DeserializeOwned + Send + Sync {
    #[idempotent(scope = "generics.created", key = key, tenant = shared, store = store)]
    async fn create(store: &MemoryStore, key: &str) -> Result<Self, Error> {
        Ok(Self::default())
    }
}

impl Created for Customer {}
impl Created for Invoice {}

/// A method of a generic type: the impl's parameter shapes the answer.
impl<T: Default + Serialize + serde::de::DeserializeOwned + Send + Sync> Repo<T> {
    #[idempotent(scope = "generics.repo_get", key = key, tenant = shared, store = store)]
    async fn get(&self, store: &MemoryStore, key: &str) -> Result<T, Error> {
        Ok(T::default())
    }
}

/// A method of a type with a const parameter: its value shapes the answer.
struct Buffer<const N: usize>;

impl<const N: usize> Buffer<N> {
    #[idempotent(scope = "generics.buffer_fill", key = key, tenant = shared, store = store)]
    async fn fill(&self, store: &MemoryStore, key: &str, byte: u8) -> Result<Vec<u8>, Error> {
        Ok(vec![byte; N])
    }
}

#[tokio::test]
async fn a_record_of_one_answer_type_is_never_replayed_as_another() {
    let store = MemoryStore::new();
    assert_eq!(
        load::<Customer>(&store, "k", &Repo::new())
            .await
            .expect("runs"),
        Customer::default()
    );
    reused(load::<Invoice>(&store, "k", &Repo::new()).await);
    let again = with_outcome(load::<Customer>(&store, "k", &Repo::new())).await;
    assert!(
        matches!(again, (Ok(_), Some(Outcome::Replayed))),
        "{again:?}"
    );

    assert_eq!(
        find::<Customer>(&store, &TypedKey("k", std::marker::PhantomData))
            .await
            .expect("runs"),
        Customer::default()
    );
    reused(find::<Invoice>(&store, &TypedKey("k", std::marker::PhantomData)).await);

    assert_eq!(
        Customer::create(&store, "k").await.expect("runs"),
        Customer::default()
    );
    reused(Invoice::create(&store, "k").await);

    assert_eq!(
        Repo::<Customer>::new()
            .get(&store, "k")
            .await
            .expect("runs"),
        Customer::default()
    );
    reused(Repo::<Invoice>::new().get(&store, "k").await);

    assert_eq!(
        Buffer::<2>.fill(&store, "k", 1).await.expect("runs"),
        [1, 1]
    );
    reused(Buffer::<5>.fill(&store, "k", 1).await);
    let again = with_outcome(Buffer::<2>.fill(&store, "k", 1)).await;
    assert!(
        matches!(again, (Ok(ref v), Some(Outcome::Replayed)) if v == &[1, 1]),
        "{again:?}"
    );
}

/// A record a build stored before the answer's type counted (the
/// parameters' fingerprint alone) is still replayed to the same call.
#[tokio::test]
async fn a_record_stored_before_the_answers_type_counted_is_still_replayed() {
    let store = MemoryStore::new();
    let mut builder = FingerprintBuilder::new();
    builder.argument("byte", &1u8);
    let old = builder
        .finish()
        .expect("fingerprint")
        .expect("one argument");
    recorded_by_an_older_build(&store, "generics.buffer_fill", "old", &old, b"[7,7]").await;
    let replayed = with_outcome(Buffer::<2>.fill(&store, "old", 1)).await;
    assert!(
        matches!(replayed, (Ok(ref v), Some(Outcome::Replayed)) if v == &[7, 7]),
        "{replayed:?}"
    );
    reused(Buffer::<2>.fill(&store, "old", 2).await);
}

/// Records `payload` for `key` of `scope` (shared tenant) under `fingerprint`,
/// as an older build would have.
async fn recorded_by_an_older_build(
    store: &MemoryStore,
    scope: &str,
    key: &str,
    fingerprint: &idempotent_runtime::Fingerprint,
    payload: &[u8],
) {
    let id = Identity::shared(scope, key).expect("identity");
    crate::common::records::recorded(store, &id, Some(fingerprint), payload).await;
}

/// The fingerprint the build before the answer's type counted made: the
/// parameter `v` (7u8) and the instantiation `<V>` (u8) it counted too.
fn before_the_answer_counted() -> idempotent_runtime::Fingerprint {
    let mut builder = FingerprintBuilder::new();
    builder.argument("v", &7u8);
    builder.argument("<V>", "u8");
    builder
        .finish()
        .expect("fingerprint")
        .expect("two arguments")
}

impl<T: Send + Sync> Repo<T> {
    /// A generic method of a generic type: `<V>` counted before, `<Self>` now.
    #[idempotent(scope = "generics.repo_put", key = key, tenant = shared, store = store)]
    async fn put<V: Serialize + Send + Sync>(
        &self,
        store: &MemoryStore,
        key: &str,
        v: V,
    ) -> Result<u8, Error> {
        let _ = v;
        Ok(1)
    }
}

/// `<V>` counted before; `<T>` (only the key and the answer mention it) now.
#[idempotent(scope = "generics.find_with", key = key, tenant = shared, store = store)]
async fn find_with<T: Default + Serialize + serde::de::DeserializeOwned + Send + Sync, V>(
    store: &MemoryStore,
    key: &TypedKey<T>,
    v: V,
) -> Result<T, Error>
where
    V: Serialize + Send + Sync,
{
    let _ = v;
    Ok(T::default())
}

trait CreatedWith: Default + Serialize + serde::de::DeserializeOwned + Send + Sync {
    /// `<V>` counted before; `<Self>` (in the answer) now.
    #[idempotent(scope = "generics.created_with", key = key, tenant = shared, store = store)]
    async fn create_with<V: Serialize + Send + Sync>(
        store: &MemoryStore,
        key: &str,
        v: V,
    ) -> Result<Self, Error> {
        let _ = v;
        Ok(Self::default())
    }
}

impl CreatedWith for Customer {}

/// A function that counts more since the answer's type counted replays
/// what the build before stored for it, whatever that build counted (its
/// own instantiations included), and still refuses other arguments.
#[tokio::test]
async fn records_of_the_build_before_the_answer_counted_are_still_replayed() {
    let store = MemoryStore::new();
    let old = before_the_answer_counted();
    recorded_by_an_older_build(&store, "generics.repo_put", "old", &old, b"9").await;
    let replayed = with_outcome(Repo::<Customer>::new().put(&store, "old", 7u8)).await;
    assert!(
        matches!(replayed, (Ok(9), Some(Outcome::Replayed))),
        "{replayed:?}"
    );
    reused(Repo::<Customer>::new().put(&store, "old", 8u8).await);

    recorded_by_an_older_build(&store, "generics.find_with", "old", &old, br#"{"id":4}"#).await;
    let key = TypedKey("old", std::marker::PhantomData);
    let replayed = with_outcome(find_with::<Customer, u8>(&store, &key, 7)).await;
    assert!(
        matches!(replayed, (Ok(Customer { id: 4 }), Some(Outcome::Replayed))),
        "{replayed:?}"
    );

    recorded_by_an_older_build(&store, "generics.created_with", "old", &old, br#"{"id":5}"#).await;
    let replayed = with_outcome(Customer::create_with(&store, "old", 7u8)).await;
    assert!(
        matches!(replayed, (Ok(Customer { id: 5 }), Some(Outcome::Replayed))),
        "{replayed:?}"
    );
}

/// A default method whose answer's type is a type parameter only the key
/// and the answer mention (counted since `v3`), for implementors that are
/// tuples: their `Self` counts too now, and did not in the build before.
trait Picked: Send + Sync {
    #[idempotent(scope = "generics.tuple_pick", key = key, tenant = shared, store = store)]
    async fn pick<A: Default + Serialize + serde::de::DeserializeOwned + Send + Sync>(
        &self,
        store: &MemoryStore,
        key: &TypedKey<A>,
        v: u8,
    ) -> Result<A, Error> {
        let _ = v;
        Ok(A::default())
    }
}

impl Picked for (Customer,) {}

/// What the build before tuples counted as generic made of
/// `(Customer,).pick::<Customer>(.., 7)`: the parameter `v` and the answer's
/// type `<A>`, a `v3` fingerprint, without `<Self>`.
fn before_tuples_counted() -> idempotent_runtime::Fingerprint {
    let mut builder = FingerprintBuilder::new();
    builder.argument("v", &7u8);
    idempotent_runtime::__private::fingerprint_answer_type(
        &mut builder,
        "<A>",
        std::any::type_name::<Customer>(),
    );
    builder
        .finish()
        .expect("fingerprint")
        .expect("two arguments")
}

/// A record the build before stored for a tuple implementor's call whose
/// fingerprint was already `v3` (the answer's type counted) is still
/// replayed once the tuple's `Self` counts too (rule 6: a rolling deploy
/// must not refuse a processed request as a reused key).
#[tokio::test]
async fn a_v3_record_stored_before_tuples_counted_is_still_replayed() {
    let store = MemoryStore::new();
    let old = before_tuples_counted();
    assert!(old.as_str().starts_with("v3:"), "{old:?}");
    recorded_by_an_older_build(&store, "generics.tuple_pick", "old", &old, br#"{"id":4}"#).await;
    let key = TypedKey("old", std::marker::PhantomData);
    let replayed = with_outcome((Customer::default(),).pick::<Customer>(&store, &key, 7)).await;
    assert!(
        matches!(replayed, (Ok(Customer { id: 4 }), Some(Outcome::Replayed))),
        "{replayed:?}"
    );
    reused(
        (Customer::default(),)
            .pick::<Customer>(&store, &key, 8)
            .await,
    );
}

/// The other way round: what this build records for a tuple implementor
/// carries a label the build before (which knew `v3`, and did not count the
/// tuple) does not know, so that build answers "recorded by a newer
/// version" (retry later) rather than refusing the retry as a reused key.
#[tokio::test]
async fn a_tuple_implementors_record_is_labelled_for_the_build_before() {
    use idempotent_runtime::Store;
    let store = MemoryStore::new();
    let key = TypedKey("new", std::marker::PhantomData);
    (Customer::default(),)
        .pick::<Customer>(&store, &key, 7)
        .await
        .expect("runs");
    let id = Identity::shared("generics.tuple_pick", "new").expect("identity");
    let stored = store
        .fetch(&id)
        .await
        .expect("fetch")
        .expect("recorded")
        .fingerprint
        .expect("a fingerprint");
    let label = stored.split(':').next().unwrap_or_default();
    assert!(
        !["v1", "v2", "v3"].contains(&label),
        "{stored}: a label the build before compares, and refuses"
    );
    assert_eq!(
        idempotent_runtime::fingerprint::unknown_version(&stored),
        None
    );
}

/// `impl Trait` in argument position is an anonymous type parameter: the
/// same id of two models, through one key, is two requests exactly as with
/// `delete::<User>` and `delete::<Order>` above (the value does not show
/// which model the call is for, and the body may act on a different table).
#[idempotent(scope = "generics.impl_trait_typed_id", key = key, tenant = shared, store = store)]
async fn delete_any(
    store: &MemoryStore,
    key: &str,
    id: TypedId<impl Send + Sync>,
) -> Result<String, Error> {
    Ok(std::any::type_name_of_val(&id)
        .rsplit("::")
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// The same with the whole parameter an `impl Trait`: `7u8` and `7i64`
/// are two requests with `value::<T>` above, and must be here too.
#[idempotent(scope = "generics.impl_trait_value", key = key, tenant = shared, store = store)]
async fn value_any(
    store: &MemoryStore,
    key: &str,
    v: impl Serialize + Send + Sync,
) -> Result<String, Error> {
    Ok(std::any::type_name_of_val(&v).to_owned())
}

#[tokio::test]
async fn an_impl_trait_argument_tells_instantiations_apart_like_a_type_parameter() {
    let store = MemoryStore::new();
    assert_eq!(
        delete_any(&store, "d", typed::<User>(7))
            .await
            .expect("runs"),
        "User>"
    );
    reused(delete_any(&store, "d", typed::<Order>(7)).await);

    assert_eq!(value_any(&store, "v", 7u8).await.expect("runs"), "u8");
    reused(value_any(&store, "v", 7i64).await);
}

/// A record stored by a build that did not count an `impl Trait`
/// parameter's type (the parameters' fingerprint alone) is still replayed
/// to the same call, and a different value is still a reused key.
#[tokio::test]
async fn a_record_stored_without_the_impl_trait_type_is_still_replayed() {
    let store = MemoryStore::new();
    let mut builder = FingerprintBuilder::new();
    builder.argument("v", &7u8);
    let old = builder
        .finish()
        .expect("fingerprint")
        .expect("one argument");
    recorded_by_an_older_build(
        &store,
        "generics.impl_trait_value",
        "old",
        &old,
        br#""recorded by an older build""#,
    )
    .await;
    let replayed = with_outcome(value_any(&store, "old", 7u8)).await;
    assert!(
        matches!(replayed, (Ok(ref s), Some(Outcome::Replayed)) if s == "recorded by an older build"),
        "{replayed:?}"
    );
    reused(value_any(&store, "old", 8u8).await);
}
