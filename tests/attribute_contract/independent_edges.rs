//! The attribute as a backend engineer writes it, on every store: the
//! spellings of `key = ...` and `tenant = ...` a service uses (fields of a
//! `&mut self`, a reference to a reference, a method call, an `Option` with
//! a fallback, a number), maps and sets keyed by every kind of value, results
//! that serde writes with one name twice, and a body that outlives its `ttl`
//! or panics while a duplicate waits for it.

use crate::common;
use idempotent_runtime::{idempotent, with_outcome, Error, Identity, MemoryStore, Outcome};
use idempotent_runtime::{SqliteStore, Store};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Every store the tests can reach: memory, SQLite (a file of its own), and
/// PostgreSQL and MySQL/MariaDB when their servers answer.
async fn stores() -> Vec<(&'static str, Arc<dyn Store>)> {
    let mut all: Vec<(&'static str, Arc<dyn Store>)> = vec![
        ("memory", Arc::new(MemoryStore::new())),
        (
            "sqlite",
            Arc::new(
                SqliteStore::connect(&common::scratch::sqlite_url("independent_edges"))
                    .await
                    .expect("open a SQLite file"),
            ),
        ),
    ];
    if let Some(pg) = common::servers::pg_store_or_skip().await {
        all.push(("postgres", Arc::new(pg)));
    }
    if let Some(my) = common::servers::mysql_store_or_skip().await {
        all.push(("mysql", Arc::new(my)));
    }
    all
}

fn tenant() -> String {
    common::servers::fresh_tenant()
}

// ---- results serde writes with one member name twice ---------------------------

/// Two flattened maps: serde writes both maps' entries into one object, so a
/// name both hold is written twice, and each map reads back every entry of
/// that name (the last one wins in both).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Labels {
    #[serde(flatten)]
    pub system: BTreeMap<String, u64>,
    #[serde(flatten)]
    pub user: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notes {
    #[serde(flatten)]
    pub system: BTreeMap<String, String>,
    #[serde(flatten)]
    pub user: BTreeMap<String, String>,
}

#[idempotent(scope = "independent.labels", key = key, tenant = tenant, store = store, skip(runs))]
async fn labels(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<Labels, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Labels {
        system: [("x".to_owned(), 1)].into(),
        user: [("x".to_owned(), 2)].into(),
    })
}

#[idempotent(scope = "independent.notes", key = key, tenant = tenant, store = store, skip(runs))]
async fn notes(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<Notes, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Notes {
        system: [("x".to_owned(), "p".to_owned())].into(),
        user: [("x".to_owned(), "q".to_owned())].into(),
    })
}

/// A recorded error of the same shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rejected {
    #[serde(flatten)]
    pub system: BTreeMap<String, String>,
    #[serde(flatten)]
    pub user: BTreeMap<String, String>,
}

impl From<Error> for Rejected {
    fn from(e: Error) -> Self {
        Rejected {
            system: [("framework".to_owned(), format!("{e:?}"))].into(),
            user: BTreeMap::new(),
        }
    }
}

#[idempotent(scope = "independent.rejected", key = key, tenant = tenant, store = store,
             skip(runs), errors = record)]
async fn rejected(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u64, Rejected> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(Rejected {
        system: [("reason".to_owned(), "declined".to_owned())].into(),
        user: [("reason".to_owned(), "over limit".to_owned())].into(),
    })
}

/// Rule 12: a result whose JSON holds one member name twice (two flattened
/// maps holding one key) reads back as another value (both maps get the
/// last entry). It must be refused when it is recorded, naming the scope,
/// never replayed as that other value; numbers and strings alike.
#[tokio::test]
async fn a_result_written_with_one_name_twice_is_never_replayed_as_another_value() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let first = labels(&*store, &t, "k", &runs).await;
        match first {
            Err(Error::ResultNotFaithful { scope, .. }) => {
                assert_eq!(scope, "independent.labels", "{name}")
            }
            other => panic!("{name}: numbers: expected ResultNotFaithful, got {other:?}"),
        }
        // Refused: nothing recorded, the retry runs the body again.
        let again = labels(&*store, &t, "k", &runs).await;
        assert!(
            matches!(again, Err(Error::ResultNotFaithful { .. })),
            "{name}: {again:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");

        let (t, runs) = (tenant(), AtomicUsize::new(0));
        match notes(&*store, &t, "k", &runs).await {
            Err(Error::ResultNotFaithful { scope, .. }) => {
                assert_eq!(scope, "independent.notes", "{name}")
            }
            other => panic!("{name}: strings: expected ResultNotFaithful, got {other:?}"),
        }
    }
}

/// Rule 12 for `errors = record`: a recorded error is checked the same way.
#[tokio::test]
async fn a_recorded_error_written_with_one_name_twice_is_never_replayed_as_another() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let first = rejected(&*store, &t, "k", &runs).await;
        let Err(first) = first else {
            panic!("{name}: the body fails")
        };
        assert!(
            first
                .system
                .get("framework")
                .is_some_and(|e| e.contains("ResultNotFaithful")),
            "{name}: expected the refusal, got {first:?}"
        );
        // Not recorded: the retry runs again rather than replaying `user`'s
        // reason as `system`'s.
        let (again, outcome) = with_outcome(rejected(&*store, &t, "k", &runs)).await;
        assert_ne!(outcome, Some(Outcome::Replayed), "{name}: {again:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");
    }
}

/// A multimap written as one map with a name repeated, that reads back
/// equal, is still recorded and replayed (the refusal above must not catch
/// it).
#[derive(Debug, Clone, PartialEq)]
pub struct Headers(pub Vec<(String, String)>);

impl Serialize for Headers {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Headers {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Headers;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Headers, A::Error> {
                let mut all = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    all.push(entry);
                }
                Ok(Headers(all))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

#[idempotent(scope = "independent.headers", key = key, tenant = tenant, store = store, skip(runs))]
async fn headers(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<Headers, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Headers(vec![
        ("set-cookie".to_owned(), "a=1".to_owned()),
        ("vary".to_owned(), "accept".to_owned()),
        ("set-cookie".to_owned(), "b=2".to_owned()),
    ]))
}

#[tokio::test]
async fn a_multimap_that_reads_back_equal_is_recorded_and_replayed() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let first = headers(&*store, &t, "k", &runs).await.expect("recorded");
        let (again, outcome) = with_outcome(headers(&*store, &t, "k", &runs)).await;
        assert_eq!(outcome, Some(Outcome::Replayed), "{name}");
        assert_eq!(again.expect("replayed"), first, "{name}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
    }
}

// ---- results of every shape a service returns -----------------------------------

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Done;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Shape {
    Empty,
    Circle(u32),
    Rect { w: u32, h: u32 },
    Pair(i8, char),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Everything {
    pub top_u128: u128,
    pub top_i128: i128,
    pub big: u64,
    pub f: f32,
    pub c: char,
    pub bytes: Vec<u8>,
    pub by_i8: BTreeMap<i8, Shape>,
    pub by_shape: BTreeMap<String, Vec<Shape>>,
    pub done: Done,
    pub unit: (),
    pub maybe_done: Option<Done>,
    pub set: HashSet<u64>,
}

fn everything() -> Everything {
    Everything {
        top_u128: u128::MAX - 7,
        top_i128: i128::MIN + 3,
        big: u64::MAX - 1,
        f: 3.4028235e38,
        c: '\u{10ffff}',
        bytes: vec![0, 255, 34, 92],
        by_i8: [
            (-128, Shape::Empty),
            (-1, Shape::Circle(u32::MAX)),
            (127, Shape::Rect { w: 1, h: 2 }),
        ]
        .into(),
        by_shape: [("all".to_owned(), vec![Shape::Pair(-5, '"'), Shape::Empty])].into(),
        done: Done,
        unit: (),
        maybe_done: None,
        set: (0..32).map(|i| i * 1_000_003).collect(),
    }
}

#[idempotent(scope = "independent.shapes", key = key, tenant = tenant, store = store, skip(runs))]
async fn shapes(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<(Everything, u128, i128, Done, ()), Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok((everything(), u128::MAX, i128::MIN, Done, ()))
}

#[idempotent(scope = "independent.some_unit", key = key, tenant = tenant, store = store, skip(runs))]
async fn some_unit(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<(Option<()>, Option<Done>), Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok((Some(()), None))
}

#[idempotent(scope = "independent.tuple_keys", key = key, tenant = tenant, store = store, skip(runs))]
async fn tuple_keys(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
) -> Result<BTreeMap<(u8, u8), u8>, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok([((1, 2), 3)].into())
}

/// Rule 12 on every store: results of every shape replay equal; `Some(())`
/// (which JSON writes as `null`, read back `None`) is refused naming the
/// scope; a map JSON cannot key (tuple keys) is an error, never recorded.
#[tokio::test]
async fn results_of_every_shape_replay_equal_or_are_refused_naming_the_scope() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let first = shapes(&*store, &t, "k", &runs).await.expect("recorded");
        let (again, outcome) = with_outcome(shapes(&*store, &t, "k", &runs)).await;
        assert_eq!(outcome, Some(Outcome::Replayed), "{name}");
        let again = again.expect("replayed");
        assert_eq!(again, first, "{name}");
        assert_eq!(again.0.f.to_bits(), everything().f.to_bits(), "{name}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");

        let (t, runs) = (tenant(), AtomicUsize::new(0));
        for _ in 0..2 {
            match some_unit(&*store, &t, "k", &runs).await {
                Err(Error::ResultNotFaithful { scope, .. }) => {
                    assert_eq!(scope, "independent.some_unit", "{name}")
                }
                other => panic!("{name}: expected ResultNotFaithful, got {other:?}"),
            }
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}: nothing recorded");

        let (t, runs) = (tenant(), AtomicUsize::new(0));
        for _ in 0..2 {
            match tuple_keys(&*store, &t, "k", &runs).await {
                Err(
                    Error::ResultEncoding { scope, .. } | Error::ResultNotFaithful { scope, .. },
                ) => {
                    assert_eq!(scope, "independent.tuple_keys", "{name}")
                }
                other => panic!("{name}: expected a refusal, got {other:?}"),
            }
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}: nothing recorded");
    }
}

// ---- key and tenant spellings in a service --------------------------------------

#[derive(Debug, Clone, Serialize)]
pub struct Account {
    pub id: u64,
    pub plan: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Order {
    pub batch: String,
    pub number: u32,
    pub line: u32,
    pub amount: u64,
}

impl Order {
    pub fn idempotency_key(&self) -> String {
        format!("{}-{}/{}", self.batch, self.number, self.line)
    }
}

/// A service a handler owns mutably: its tenant is a field, its store a
/// handle cloned per call (as the README says for `&mut self`), and the body
/// updates the service's own state.
pub struct Cart {
    store: Arc<dyn Store>,
    shop: String,
    placed: Vec<u64>,
}

impl Cart {
    #[idempotent(scope = "independent.cart_place", key = key, tenant = self.shop,
                 store = self.store.clone())]
    async fn place(&mut self, key: &str, amount: u64) -> Result<usize, Error> {
        self.placed.push(amount);
        Ok(self.placed.len())
    }

    /// The key from a method of a reference to a reference, the tenant from
    /// a number field of another.
    #[idempotent(scope = "independent.cart_line", key = order.idempotency_key(),
                 tenant = account.id, store = self.store.clone(), skip(account))]
    async fn line(&mut self, account: &&Account, order: &&Order) -> Result<u64, Error> {
        self.placed.push(order.amount);
        Ok(order.amount * 10 + self.placed.len() as u64)
    }
}

#[idempotent(scope = "independent.optional_tenant", key = key,
             tenant = user.as_deref().unwrap_or("anonymous"), store = store, skip(runs))]
async fn optional_tenant(
    store: &dyn Store,
    user: Option<String>,
    key: impl std::fmt::Display + Send,
    amount: u64,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

#[tokio::test]
async fn a_mut_self_service_replays_and_keeps_its_tenants_apart() {
    for (name, store) in stores().await {
        let shop = tenant();
        let mut cart = Cart {
            store: store.clone(),
            shop: shop.clone(),
            placed: Vec::new(),
        };
        assert_eq!(cart.place("k", 5).await.expect("placed"), 1, "{name}");
        let (again, outcome) = with_outcome(cart.place("k", 5)).await;
        assert_eq!(
            (again.expect("replayed"), outcome),
            (1, Some(Outcome::Replayed))
        );
        assert_eq!(cart.placed, vec![5], "{name}: the body ran once");
        assert!(
            matches!(cart.place("k", 6).await, Err(Error::FingerprintMismatch(_))),
            "{name}"
        );
        // Another shop, same key: its own record.
        let mut other = Cart {
            store: store.clone(),
            shop: format!("{shop}-2"),
            placed: Vec::new(),
        };
        assert_eq!(other.place("k", 6).await.expect("its own"), 1, "{name}");

        // Account ids 1 and 11 with orders "1/11" and "11/1": the parts are
        // rendered apart.
        let (a1, a11) = (
            Account {
                id: 1,
                plan: "free".into(),
            },
            Account {
                id: 11,
                plan: "pro".into(),
            },
        );
        let batch = uuid::Uuid::new_v4().to_string();
        let o = Order {
            batch: batch.clone(),
            number: 1,
            line: 11,
            amount: 3,
        };
        let first = cart.line(&&a1, &&o).await.expect("line");
        assert_eq!(cart.line(&&a1, &&o).await.expect("replay"), first, "{name}");
        // The account is skipped: its plan changing is the same request.
        let a1_pro = Account {
            id: 1,
            plan: "pro".into(),
        };
        assert_eq!(
            cart.line(&&a1_pro, &&o).await.expect("replay"),
            first,
            "{name}"
        );
        let placed = cart.placed.len();
        let (got, outcome) = with_outcome(cart.line(&&a11, &&o)).await;
        assert_eq!(
            outcome,
            Some(Outcome::Executed),
            "{name}: account 11 is its own tenant"
        );
        assert!(got.is_ok(), "{name}");
        assert_eq!(cart.placed.len(), placed + 1, "{name}");
        let o2 = Order {
            batch: batch.clone(),
            number: 11,
            line: 1,
            amount: 3,
        };
        let (_, outcome) = with_outcome(cart.line(&&a1, &&o2)).await;
        assert_eq!(
            outcome,
            Some(Outcome::Executed),
            "{name}: another line, another key"
        );

        let base = uuid::Uuid::new_v4().as_u128();

        // An `Option` tenant with a fallback, and a key of any `Display`.
        let runs = AtomicUsize::new(0);
        let user = Some(tenant());
        let got = optional_tenant(&*store, user.clone(), base, 1, &runs).await;
        assert_eq!(got.expect("runs"), 1, "{name}");
        let got = optional_tenant(&*store, user.clone(), base.to_string(), 1, &runs).await;
        assert_eq!(got.expect("replays"), 1, "{name}");
        assert!(matches!(
            optional_tenant(&*store, user.clone(), base, 2, &runs).await,
            Err(Error::FingerprintMismatch(_))
        ));
        let other_user = Some(tenant());
        let got = optional_tenant(&*store, other_user, base, 2, &runs).await;
        assert_eq!(got.expect("its own"), 2, "{name}");
    }
}

// ---- fingerprints of maps and sets keyed by every kind of value ----------------

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Sku {
    pub vendor: String,
    pub code: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Uid(pub [u8; 16]);

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Slot {
    Any,
    At(u16),
    Range { from: u16, to: u16 },
    Named(String, Option<String>),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Basket {
    pub by_pair: HashMap<(u8, String), u32>,
    pub by_sku: HashMap<Sku, u32>,
    pub by_uid: HashMap<Uid, HashSet<String>>,
    pub by_slot: HashMap<Slot, Vec<u8>>,
    pub by_option: HashMap<Option<String>, u8>,
    pub by_bytes: HashMap<Vec<u8>, i64>,
    pub by_u128: HashMap<u128, bool>,
    pub by_i8: HashMap<i8, char>,
    pub sets: HashSet<BTreeSet<u32>>,
    pub options: HashSet<Option<(u8, bool)>>,
    pub nested: HashMap<String, HashMap<Slot, HashSet<Uid>>>,
    pub prices: HashMap<String, Option<f64>>,
}

/// The same basket, built in another order with other capacities (so its
/// maps and sets iterate otherwise); `variant` changes one value.
fn basket(reverse: bool, variant: u32) -> Basket {
    let mut ids: Vec<u32> = (0..24).collect();
    if reverse {
        ids.reverse();
    }
    let cap = if reverse { 512 } else { 0 };
    let mut b = Basket {
        by_pair: HashMap::with_capacity(cap),
        by_sku: HashMap::with_capacity(cap),
        by_uid: HashMap::with_capacity(cap),
        by_slot: HashMap::with_capacity(cap),
        by_option: HashMap::with_capacity(cap),
        by_bytes: HashMap::with_capacity(cap),
        by_u128: HashMap::with_capacity(cap),
        by_i8: HashMap::with_capacity(cap),
        sets: HashSet::with_capacity(cap),
        options: HashSet::with_capacity(cap),
        nested: HashMap::with_capacity(cap),
        prices: HashMap::with_capacity(cap),
    };
    for &i in &ids {
        let v = if i == 7 { variant } else { i };
        b.by_pair.insert(((i % 3) as u8, format!("p{i}")), v);
        b.by_sku.insert(
            Sku {
                vendor: format!("v{}", i % 5),
                code: i,
            },
            v,
        );
        let mut names = HashSet::with_capacity(cap);
        for j in 0..(i % 6) {
            names.insert(format!("n{j}"));
        }
        let mut uid = [0u8; 16];
        uid[(i % 16) as usize] = i as u8 + 1;
        uid[0] = (i / 16) as u8;
        b.by_uid.insert(Uid(uid), names);
        let slot = match i % 4 {
            0 => Slot::At(i as u16),
            1 => Slot::Range {
                from: i as u16,
                to: v as u16,
            },
            2 => Slot::Named(format!("s{i}"), (i % 3 == 0).then(|| "x".to_owned())),
            _ => Slot::At(1000 + i as u16),
        };
        b.by_slot
            .insert(slot.clone(), vec![i as u8; (i % 3) as usize]);
        b.by_option.insert(Some(format!("o{i}")), v as u8);
        b.by_bytes.insert(vec![i as u8, 0, 255], -(v as i64));
        b.by_u128.insert(u128::MAX - i as u128, i % 2 == 0);
        b.by_i8
            .insert(-(i as i8), char::from_u32(0x1f600 + i).unwrap());
        b.sets.insert((0..i % 5).map(|k| k * i).collect());
        b.options.insert(Some((i as u8, i % 2 == 0)));
        let inner = b
            .nested
            .entry(format!("g{}", i % 4))
            .or_insert_with(|| HashMap::with_capacity(cap));
        let uids = inner
            .entry(slot)
            .or_insert_with(|| HashSet::with_capacity(cap));
        uids.insert(Uid([i as u8; 16]));
        uids.insert(Uid([(v as u8).wrapping_add(100); 16]));
        inner
            .entry(Slot::Any)
            .or_insert_with(|| HashSet::with_capacity(cap));
        b.prices
            .insert(format!("price{i}"), Some(f64::from(v) / 3.0));
    }
    b.by_option.insert(None, 0);
    b.options.insert(None);
    b.sets.insert(BTreeSet::new());
    b
}

#[idempotent(scope = "independent.basket", key = key, tenant = tenant, store = store, skip(runs))]
async fn checkout(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    basket: &Basket,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// Rule 6 on every store: maps keyed by tuples, structs, id newtypes, enums
/// with data, `Option`, bytes, `u128` and negative numbers, sets of sets and
/// of options, nested maps of sets: equal values built otherwise are one
/// request; one value changed anywhere is another.
#[tokio::test]
async fn maps_and_sets_keyed_by_every_kind_of_value_are_one_request_however_built() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let got = checkout(&*store, &t, "k", &basket(false, 7), &runs).await;
        assert_eq!(got.expect("runs"), 1, "{name}");
        for round in 0..3 {
            let (got, outcome) = with_outcome(checkout(
                &*store,
                &t,
                "k",
                &basket(round % 2 == 0, 7),
                &runs,
            ))
            .await;
            assert_eq!(
                (got.expect("replays"), outcome),
                (1, Some(Outcome::Replayed)),
                "{name} {round}"
            );
        }
        for variant in [8, 1000] {
            let got = checkout(&*store, &t, "k", &basket(true, variant), &runs).await;
            assert!(
                matches!(got, Err(Error::FingerprintMismatch(_))),
                "{name}: variant {variant}: {got:?}"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Quote {
    pub base: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discount: Option<f64>,
    #[serde(rename = "per_unit")]
    pub unit_prices: HashMap<String, Option<f64>>,
    #[serde(flatten)]
    pub extra: HashMap<String, Option<f32>>,
}

#[idempotent(scope = "independent.quote", key = key, tenant = tenant, store = store, skip(runs))]
async fn quote(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    quote: Quote,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// Rule 6: `+inf`, `-inf`, `NaN` and `None` are four values also inside maps,
/// under `skip_serializing_if`, `rename` and `#[serde(flatten)]`, as `f64`
/// and as `f32`; no two of them share a record's answer.
#[tokio::test]
async fn non_finite_floats_and_none_inside_maps_and_flattened_fields_are_different_requests() {
    let specials: [Option<f64>; 4] = [
        Some(f64::INFINITY),
        Some(f64::NEG_INFINITY),
        Some(f64::NAN),
        None,
    ];
    let quotes = |i: usize| -> Vec<Quote> {
        let s = specials[i];
        vec![
            Quote {
                base: s.unwrap_or(1.0),
                discount: None,
                unit_prices: HashMap::new(),
                extra: HashMap::new(),
            },
            Quote {
                base: 1.0,
                discount: s,
                unit_prices: HashMap::new(),
                extra: HashMap::new(),
            },
            Quote {
                base: 1.0,
                discount: None,
                unit_prices: [("a".to_owned(), s)].into(),
                extra: HashMap::new(),
            },
            Quote {
                base: 1.0,
                discount: None,
                unit_prices: HashMap::new(),
                extra: [("a".to_owned(), s.map(|f| f as f32))].into(),
            },
        ]
    };
    for (name, store) in stores().await {
        // Each place, each special value: the first call of each runs; a
        // repeat replays.
        for place in 0..4 {
            let t = tenant();
            let runs = AtomicUsize::new(0);
            for (i, _) in specials.iter().enumerate() {
                if place == 0 && i == 3 {
                    continue; // `base` is not an Option
                }
                let key = format!("k{place}");
                let got = quote(&*store, &t, &key, quotes(i)[place].clone(), &runs).await;
                if i == 0 {
                    assert!(got.is_ok(), "{name}: place {place} value {i}: {got:?}");
                } else {
                    assert!(
                        matches!(got, Err(Error::FingerprintMismatch(_))),
                        "{name}: place {place}: value {i} is not value 0: {got:?}"
                    );
                }
            }
            // Each special against each other special, each with its own key.
            for a in 0..4 {
                for b in 0..4 {
                    if a == b || (place == 0 && (a == 3 || b == 3)) {
                        continue;
                    }
                    let key = format!("p{place}-{a}-{b}");
                    let runs = AtomicUsize::new(0);
                    quote(&*store, &t, &key, quotes(a)[place].clone(), &runs)
                        .await
                        .expect("first");
                    let (again, outcome) =
                        with_outcome(quote(&*store, &t, &key, quotes(a)[place].clone(), &runs))
                            .await;
                    assert_eq!(
                        (again.expect("replays"), outcome),
                        (1, Some(Outcome::Replayed)),
                        "{name}"
                    );
                    let other = quote(&*store, &t, &key, quotes(b)[place].clone(), &runs).await;
                    assert!(
                        matches!(other, Err(Error::FingerprintMismatch(_))),
                        "{name}: place {place}: {a} vs {b}: {other:?}"
                    );
                }
            }
        }
    }
}

// ---- a body that outlives its ttl; a panic while a duplicate waits --------------

#[idempotent(scope = "independent.outlives_ttl", key = key, tenant = tenant, store = store,
             skip(runs, gate), ttl = "1ms", lease = "30s", in_progress = reject)]
async fn outlives_ttl(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    gate: Option<tokio::sync::oneshot::Receiver<()>>,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(gate) = gate {
        let _ = gate.await;
    }
    Ok(n)
}

/// Rule 16 with rule 3: a record in progress counts as absent only once
/// both its ttl and its lease ran out. A body that runs past its `ttl` (1 ms)
/// under a 30 s lease is still running: a duplicate is refused as in
/// progress, never run beside it, on every store.
#[tokio::test]
async fn a_body_running_past_its_ttl_is_never_run_twice() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), Arc::new(AtomicUsize::new(0)));
        let (open, gate) = tokio::sync::oneshot::channel();
        let owner = {
            let (store, t, runs) = (store.clone(), t.clone(), runs.clone());
            tokio::spawn(async move { outlives_ttl(&*store, &t, "k", &runs, Some(gate)).await })
        };
        // Until the body runs and the store's clock is past the record's ttl
        // (a snapshot of a record in progress shows the later of its ttl and
        // its lease as its expiry: its creation tells when the ttl ends).
        let identity = Identity::new(t.as_str(), "independent.outlives_ttl", "k").unwrap();
        let mut past_ttl = false;
        for _ in 0..10_000 {
            if runs.load(Ordering::SeqCst) == 1 {
                if let Some(s) = store.fetch(&identity).await.expect("fetch") {
                    if s.created_at_ms + 1 < s.now_ms {
                        past_ttl = true;
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(past_ttl, "{name}: the body never ran past its ttl");
        let dup = outlives_ttl(&*store, &t, "k", &runs, None).await;
        assert!(
            matches!(dup, Err(Error::InProgress { .. })),
            "{name}: expected InProgress, got {dup:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}: the body ran twice");
        let _ = open.send(());
        assert_eq!(owner.await.expect("owner").expect("recorded"), 1, "{name}");
    }
}

#[idempotent(scope = "independent.panics", key = key, tenant = tenant, store = store,
             skip(runs, started, gate), in_progress = wait("60s"))]
async fn panics_while_waited_for(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    started: Option<tokio::sync::oneshot::Sender<()>>,
    gate: Option<tokio::sync::oneshot::Receiver<()>>,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(started) = started {
        let _ = started.send(());
    }
    if let Some(gate) = gate {
        let _ = gate.await;
        panic!("the owner's body panics");
    }
    Ok(n)
}

/// Rules 4 and 14 on every store: a duplicate waiting for an owner whose
/// body panics is not left waiting for its bound (60 s) nor refused: the
/// release frees the key, and the duplicate runs the body itself; the
/// panic reaches the owner's caller.
#[tokio::test]
async fn a_duplicate_waiting_for_a_panicking_owner_runs_the_body_itself() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), Arc::new(AtomicUsize::new(0)));
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let (open, gate) = tokio::sync::oneshot::channel();
        let owner = {
            let (store, t, runs) = (store.clone(), t.clone(), runs.clone());
            tokio::spawn(async move {
                panics_while_waited_for(&*store, &t, "k", &runs, Some(started_tx), Some(gate)).await
            })
        };
        started.await.expect("the owner's body started");
        let waiter = {
            let (store, t, runs) = (store.clone(), t.clone(), runs.clone());
            tokio::spawn(async move {
                panics_while_waited_for(&*store, &t, "k", &runs, None, None).await
            })
        };
        // Give the waiter a chance to start waiting (whether it has or not,
        // the outcome below is the same).
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = open.send(());
        let owner = owner.await;
        assert!(
            owner.is_err_and(|e| e.is_panic()),
            "{name}: the panic propagates"
        );
        let got = waiter.await.expect("waiter");
        assert_eq!(got.expect("the waiter runs the body"), 2, "{name}");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");
    }
}

// ---- a panic in the result's serde or in the error policy ----------------------

/// A value whose `Serialize` panics when it holds "explode-on-write" and whose
/// `Deserialize` panics when it reads "explode-on-read": user code the engine
/// runs after the body answered, while the record is still in progress.
#[derive(Debug, Clone, PartialEq)]
pub struct Touchy(pub String);

impl Serialize for Touchy {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.0 == "explode-on-write" {
            panic!("the result's Serialize panicked");
        }
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Touchy {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        if text == "explode-on-read" {
            panic!("the result's Deserialize panicked");
        }
        Ok(Touchy(text))
    }
}

impl From<Error> for Touchy {
    fn from(e: Error) -> Self {
        Touchy(format!("framework: {e:?}"))
    }
}

fn policy_panics(e: &Touchy) -> bool {
    if e.0 == "explode-in-policy" {
        panic!("the error policy panicked");
    }
    true
}

#[idempotent(scope = "independent.touchy", key = key, tenant = tenant, store = store,
             skip(runs), errors = record_if(policy_panics))]
async fn touchy(
    store: Arc<dyn Store>,
    tenant: String,
    key: String,
    answer: Result<String, String>,
    runs: Arc<AtomicUsize>,
) -> Result<Touchy, Touchy> {
    runs.fetch_add(1, Ordering::SeqCst);
    answer.map(Touchy).map_err(Touchy)
}

/// Rule 14 on every store: a panic in user code the engine runs after the
/// body answered (the result's `Serialize`, its `Deserialize` when it is
/// read back, a `record_if` predicate) propagates and releases the record:
/// the retry runs at once, it is neither refused as in progress until the
/// lease (30 s) runs out nor replayed.
#[tokio::test]
async fn a_panic_in_the_results_serde_or_the_error_policy_releases_the_record() {
    let cases: [(&str, Result<String, String>); 3] = [
        ("write", Ok("explode-on-write".to_owned())),
        ("read", Ok("explode-on-read".to_owned())),
        ("policy", Err("explode-in-policy".to_owned())),
    ];
    for (name, store) in stores().await {
        for (case, answer) in cases.clone() {
            let (t, runs) = (tenant(), Arc::new(AtomicUsize::new(0)));
            let joined = tokio::spawn(touchy(
                store.clone(),
                t.clone(),
                "k".to_owned(),
                answer,
                runs.clone(),
            ))
            .await;
            assert!(
                joined.is_err_and(|e| e.is_panic()),
                "{name} {case}: the panic propagates"
            );
            assert_eq!(
                store.finish_background_work(Duration::from_secs(60)).await,
                0
            );
            let identity = Identity::new(t.as_str(), "independent.touchy", "k").unwrap();
            let left = store.fetch(&identity).await.expect("fetch");
            assert!(
                left.as_ref().is_none_or(|s| s.is_expired()),
                "{name} {case}: the record was left: {left:?}"
            );
            let (again, outcome) = with_outcome(touchy(
                store.clone(),
                t.clone(),
                "k".to_owned(),
                Ok("fine".to_owned()),
                runs.clone(),
            ))
            .await;
            assert_eq!(outcome, Some(Outcome::Executed), "{name} {case}: {again:?}");
            assert_eq!(again, Ok(Touchy("fine".to_owned())), "{name} {case}");
        }
    }
}

#[idempotent(scope = "independent.waited", key = key, tenant = tenant, store = store,
             skip(runs, gate), in_progress = wait("60s"))]
async fn waited_for(
    store: Arc<dyn Store>,
    tenant: String,
    key: String,
    runs: Arc<AtomicUsize>,
    gate: Option<tokio::sync::oneshot::Receiver<()>>,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(gate) = gate {
        let _ = gate.await;
    }
    Ok(n)
}

/// Rules 4 and 14 on every store: duplicates dropped while they wait (a
/// client that hung up) change nothing: the owner records its answer, and
/// the next call replays it.
#[tokio::test]
async fn duplicates_dropped_while_they_wait_leave_the_owners_answer() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), Arc::new(AtomicUsize::new(0)));
        let (open, gate) = tokio::sync::oneshot::channel();
        let owner = tokio::spawn(waited_for(
            store.clone(),
            t.clone(),
            "k".to_owned(),
            runs.clone(),
            Some(gate),
        ));
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                tokio::spawn(waited_for(
                    store.clone(),
                    t.clone(),
                    "k".to_owned(),
                    runs.clone(),
                    None,
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        for w in &waiters {
            w.abort();
        }
        for w in waiters {
            let _ = w.await;
        }
        let _ = open.send(());
        assert_eq!(owner.await.expect("owner").expect("recorded"), 1, "{name}");
        let (again, outcome) = with_outcome(waited_for(
            store.clone(),
            t.clone(),
            "k".to_owned(),
            runs.clone(),
            None,
        ))
        .await;
        assert_eq!(
            (again.expect("replayed"), outcome),
            (1, Some(Outcome::Replayed)),
            "{name}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
    }
}

#[idempotent(scope = "independent.bounded", key = key, tenant = tenant, store = store,
             skip(runs, gate), in_progress = wait("1s"), lease = "30s")]
async fn bounded(
    store: Arc<dyn Store>,
    tenant: String,
    key: String,
    runs: Arc<AtomicUsize>,
    gate: Option<tokio::sync::oneshot::Receiver<()>>,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(gate) = gate {
        let _ = gate.await;
    }
    Ok(n)
}

/// Rule 4 on every store: a duplicate waits at most its bound (1 s) for an
/// owner that goes on running (its 30 s lease renewed), then is refused
/// with `InProgress`, the owner's lease left as `retry_after`; it neither
/// waits for the lease nor runs the body. The owner's answer is then
/// replayed.
#[tokio::test]
async fn a_waiting_duplicate_gives_up_at_its_bound_on_every_store() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), Arc::new(AtomicUsize::new(0)));
        let (open, gate) = tokio::sync::oneshot::channel();
        let owner = tokio::spawn(bounded(
            store.clone(),
            t.clone(),
            "k".to_owned(),
            runs.clone(),
            Some(gate),
        ));
        for _ in 0..10_000 {
            if runs.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let dup = bounded(store.clone(), t.clone(), "k".to_owned(), runs.clone(), None).await;
        match dup {
            Err(Error::InProgress { scope, retry_after }) => {
                assert_eq!(scope, "independent.bounded", "{name}");
                assert!(
                    retry_after <= Duration::from_secs(30),
                    "{name}: {retry_after:?}"
                );
            }
            other => panic!("{name}: expected InProgress, got {other:?}"),
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
        let _ = open.send(());
        assert_eq!(owner.await.expect("owner").expect("recorded"), 1, "{name}");
        let (again, outcome) = with_outcome(bounded(
            store.clone(),
            t.clone(),
            "k".to_owned(),
            runs.clone(),
            None,
        ))
        .await;
        assert_eq!(
            (again.expect("replayed"), outcome),
            (1, Some(Outcome::Replayed)),
            "{name}"
        );
    }
}

#[idempotent(scope = "independent.stalled", key = key, tenant = tenant, store = store,
             skip(runs, gate), lease = "500ms", in_progress = wait("20s"))]
async fn stalled(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    runs: &AtomicUsize,
    gate: &tokio::sync::Notify,
) -> Result<usize, Error> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    gate.notified().await;
    Ok(n)
}

/// Rules 4 and 10 on every store: a duplicate waiting (bound 20 s) for an
/// owner that stopped being polled (a paused process: its heartbeat stops
/// with it) takes the record over when the 500 ms lease ends and runs the
/// body itself, rather than waiting out its bound; the stale owner's answer
/// is then refused and the taker's is what replays.
#[tokio::test]
async fn a_waiting_duplicate_takes_over_when_a_stalled_owners_lease_ends() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let gate = tokio::sync::Notify::new();
        let mut stale = Box::pin(stalled(&*store, &t, "k", &runs, &gate));
        for _ in 0..2000 {
            assert!(futures::poll!(stale.as_mut()).is_pending(), "{name}");
            if runs.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{name}: the owner's body runs"
        );
        // The owner is no longer polled. A duplicate waits, then takes over.
        let open = tokio::sync::Notify::new();
        open.notify_one();
        let (taker, outcome) = with_outcome(stalled(&*store, &t, "k", &runs, &open)).await;
        assert_eq!(
            (taker.expect("takes over"), outcome),
            (2, Some(Outcome::Executed)),
            "{name}"
        );
        gate.notify_one();
        let late = stale.await;
        assert!(matches!(late, Err(Error::LeaseLost(_))), "{name}: {late:?}");
        let again = tokio::sync::Notify::new();
        let (replayed, outcome) = with_outcome(stalled(&*store, &t, "k", &runs, &again)).await;
        assert_eq!(
            (replayed.expect("replayed"), outcome),
            (2, Some(Outcome::Replayed)),
            "{name}"
        );
    }
}

/// An argument whose `Serialize` fails for some values.
#[derive(Debug, Clone)]
pub struct Picky(pub Option<u32>);

impl Serialize for Picky {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Some(amount) => serializer.serialize_u32(amount),
            None => Err(serde::ser::Error::custom("no amount")),
        }
    }
}

#[idempotent(scope = "independent.picky", key = key, tenant = tenant, store = store, skip(runs))]
async fn picky(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    r#req: Picky,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// The errors table on every store: an argument whose `Serialize` fails is
/// `Error::Fingerprint` naming the parameter (as Rust reads it), before
/// anything runs or is stored; an empty tenant (a lookup that found
/// nobody) is `InvalidTenant`, never the shared namespace. The key stays
/// free for a good request.
#[tokio::test]
async fn a_failing_argument_and_an_empty_tenant_are_refused_before_anything_runs() {
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        match picky(&*store, &t, "k", Picky(None), &runs).await {
            Err(Error::Fingerprint { argument, message }) => {
                assert_eq!(argument, "req", "{name}");
                assert!(message.contains("no amount"), "{name}: {message}");
            }
            other => panic!("{name}: expected Error::Fingerprint, got {other:?}"),
        }
        assert_eq!(runs.load(Ordering::SeqCst), 0, "{name}");
        let identity = Identity::new(t.as_str(), "independent.picky", "k").unwrap();
        assert!(
            store.fetch(&identity).await.expect("fetch").is_none(),
            "{name}"
        );
        let got = picky(&*store, &t, "k", Picky(Some(5)), &runs).await;
        assert_eq!(got.expect("runs"), 1, "{name}");

        let runs = AtomicUsize::new(0);
        let got = optional_tenant(&*store, Some(String::new()), "k", 1, &runs).await;
        assert!(
            matches!(got, Err(Error::InvalidTenant(_))),
            "{name}: {got:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 0, "{name}");
    }
}

/// A quantity in one of two forms, told apart by serde only by what reads:
/// the float form, tried first, reads every number.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Quantity {
    Approx(f64),
    Exact(u128),
}

#[idempotent(scope = "independent.quantity", key = key, tenant = tenant, store = store, skip(runs))]
async fn quantity(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    exact: u128,
    runs: &AtomicUsize,
) -> Result<Quantity, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Quantity::Exact(exact))
}

/// Rule 12 on every store: an untagged enum's `Exact(n)` that reads back as
/// `Approx(n as f64)` is refused, for numbers beyond 64 bits as for small
/// ones (a `u128` written as its digits reads back as the float nearest).
#[tokio::test]
async fn an_integer_beyond_64_bits_that_reads_back_as_a_float_is_refused() {
    for (name, store) in stores().await {
        for exact in [7, u128::from(u64::MAX) + 1, u128::MAX] {
            let (t, runs) = (tenant(), AtomicUsize::new(0));
            match quantity(&*store, &t, "k", exact, &runs).await {
                Err(Error::ResultNotFaithful { scope, .. }) => {
                    assert_eq!(scope, "independent.quantity", "{name}")
                }
                other => panic!("{name}: {exact}: expected ResultNotFaithful, got {other:?}"),
            }
        }
    }
}

#[idempotent(scope = "independent.heap", key = key, tenant = tenant, store = store, skip(runs))]
async fn prioritize(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    queue: std::collections::BinaryHeap<(u8, String)>,
    order: std::collections::VecDeque<u8>,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// Rule 6 on every store: a `BinaryHeap` is compared by its elements, not
/// its layout (which depends on the order they were pushed); a `VecDeque`
/// keeps its order.
#[tokio::test]
async fn a_heap_built_in_another_order_is_one_request_a_deque_in_another_order_is_not() {
    let items: Vec<(u8, String)> = (0..40u8).map(|i| (i % 7, format!("job-{i}"))).collect();
    let heap = |reverse: bool| {
        let mut items = items.clone();
        if reverse {
            items.reverse();
        }
        let mut heap = std::collections::BinaryHeap::new();
        for item in items {
            heap.push(item);
        }
        heap
    };
    let deque = |reverse: bool| {
        let mut d: std::collections::VecDeque<u8> = (0..5).collect();
        if reverse {
            d.make_contiguous().reverse();
        }
        d
    };
    assert_ne!(
        heap(false).iter().collect::<Vec<_>>(),
        heap(true).iter().collect::<Vec<_>>(),
        "the two heaps are laid out otherwise"
    );
    for (name, store) in stores().await {
        let (t, runs) = (tenant(), AtomicUsize::new(0));
        let first = prioritize(&*store, &t, "k", heap(false), deque(false), &runs).await;
        assert_eq!(first.expect("runs"), 1, "{name}");
        let (again, outcome) = with_outcome(prioritize(
            &*store,
            &t,
            "k",
            heap(true),
            deque(false),
            &runs,
        ))
        .await;
        assert_eq!(
            (again.expect("replays"), outcome),
            (1, Some(Outcome::Replayed)),
            "{name}"
        );
        let other = prioritize(&*store, &t, "k", heap(true), deque(true), &runs).await;
        assert!(
            matches!(other, Err(Error::FingerprintMismatch(_))),
            "{name}: {other:?}"
        );
    }
}
