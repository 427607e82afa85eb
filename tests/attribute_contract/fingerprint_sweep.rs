//! Rules 6, 7 and 12 over many value shapes, through the public API: two
//! different values of one type never share a fingerprint and equal ones
//! built otherwise always do; results of every shape replay equal or are
//! refused naming the scope, on every store; and a mismatch changes nothing
//! in the record it meets, whatever that record is (complete, running,
//! abandoned, or made by a newer version), on every store.

use crate::common;
use idempotent_runtime::{idempotent, with_outcome, Error, Fingerprint, MemoryStore, Outcome};
use idempotent_runtime::{SqliteStore, Store};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

async fn stores() -> Vec<(&'static str, Arc<dyn Store>)> {
    let mut all: Vec<(&'static str, Arc<dyn Store>)> = vec![
        ("memory", Arc::new(MemoryStore::new())),
        (
            "sqlite",
            Arc::new(
                SqliteStore::connect(&common::scratch::sqlite_url("fingerprint_sweep"))
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

fn fp<T: Serialize + ?Sized>(v: &T) -> Result<String, String> {
    Fingerprint::of(v)
        .map(|f| f.as_str().to_owned())
        .map_err(|e| e.to_string())
}

/// Every two values of `values` (all different) must fingerprint apart, or be refused.
fn distinct<T: Serialize + Debug>(what: &str, values: &[T], problems: &mut Vec<String>) {
    let fps: Vec<Result<String, String>> = values.iter().map(|v| fp(v)).collect();
    for i in 0..values.len() {
        for j in i + 1..values.len() {
            if let (Ok(a), Ok(b)) = (&fps[i], &fps[j]) {
                if a == b {
                    problems.push(format!(
                        "{what}: COLLISION {:?} and {:?} -> {a}",
                        values[i], values[j]
                    ));
                }
            }
        }
    }
    for (v, f) in values.iter().zip(&fps) {
        if let Err(e) = f {
            problems.push(format!("{what}: {v:?} refused: {e}"));
        }
    }
}

/// All values built by `make` (equal values, built otherwise) must share a fingerprint.
fn same<T: Serialize + Debug>(
    what: &str,
    mut make: impl FnMut(usize) -> T,
    problems: &mut Vec<String>,
) {
    let first = make(0);
    let want = fp(&first);
    for i in 1..64 {
        let v = make(i);
        let got = fp(&v);
        if got != want {
            problems.push(format!(
                "{what}: equal values fingerprint apart: {first:?} {want:?} vs {v:?} {got:?}"
            ));
            return;
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
enum Unitish {
    A,
    B(()),
    C {},
    D(Option<u8>),
    E(Vec<u8>),
    F(()),
    G((), ()),
    H(Option<()>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t")]
enum Internal {
    A { x: u8 },
    B { x: u8 },
    C,
    D(BTreeMap<String, u8>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", content = "c")]
enum Adjacent {
    A(u8),
    B(u8),
    C,
    D(Option<u8>),
    E(()),
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
struct Pair(u8, u8);

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
struct Line {
    sku: String,
    qty: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct WithSkip {
    #[serde(skip_serializing_if = "Option::is_none")]
    a: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    b: Option<u8>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Newtype(String);

#[test]
fn values_of_one_type_fingerprint_apart_and_equal_ones_alike() {
    let mut p = Vec::new();
    distinct(
        "Option<Option<()>>",
        &[None, Some(None), Some(Some(()))],
        &mut p,
    );
    distinct(
        "Option<Option<Option<u8>>>",
        &[None, Some(None), Some(Some(None)), Some(Some(Some(0)))],
        &mut p,
    );
    distinct(
        "f64",
        &[
            0.0,
            -0.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MIN_POSITIVE,
            5e-324,
            -5e-324,
            1.0,
            1.0 + f64::EPSILON,
            9007199254740992.0,
            9007199254740993.0f64.next_up(),
        ],
        &mut p,
    );
    distinct(
        "Option<f64>",
        &[None, Some(f64::NAN), Some(f64::INFINITY), Some(0.0)],
        &mut p,
    );
    distinct(
        "f32",
        &[
            0.1f32,
            0.1f32.next_up(),
            0.1f32.next_down(),
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            -0.0,
            0.0,
        ],
        &mut p,
    );
    distinct(
        "u128",
        &[
            1u128 << 64,
            (1u128 << 64) + 1,
            u128::MAX,
            u128::MAX - 1,
            u64::MAX as u128,
            (1u128 << 53) + 1,
            1u128 << 53,
        ],
        &mut p,
    );
    distinct(
        "i128",
        &[
            i128::MIN,
            i128::MIN + 1,
            i128::MAX,
            -(1i128 << 64),
            -(1i128 << 64) - 1,
            i64::MIN as i128,
        ],
        &mut p,
    );
    distinct(
        "u64",
        &[(1u64 << 53), (1u64 << 53) + 1, u64::MAX, u64::MAX - 1],
        &mut p,
    );
    distinct(
        "Unitish",
        &[
            Unitish::A,
            Unitish::B(()),
            Unitish::C {},
            Unitish::D(None),
            Unitish::D(Some(0)),
            Unitish::E(vec![]),
            Unitish::F(()),
            Unitish::G((), ()),
            Unitish::H(None),
            Unitish::H(Some(())),
        ],
        &mut p,
    );
    distinct(
        "Internal",
        &[
            Internal::A { x: 1 },
            Internal::B { x: 1 },
            Internal::C,
            Internal::D(BTreeMap::new()),
            Internal::D([("t".to_owned(), 1)].into()),
            Internal::D([("x".to_owned(), 1)].into()),
        ],
        &mut p,
    );
    distinct(
        "Adjacent",
        &[
            Adjacent::A(1),
            Adjacent::B(1),
            Adjacent::C,
            Adjacent::D(None),
            Adjacent::D(Some(1)),
            Adjacent::E(()),
        ],
        &mut p,
    );
    distinct(
        "HashMap<Pair,u8>",
        &[
            HashMap::from([(Pair(1, 2), 3)]),
            HashMap::from([(Pair(2, 1), 3)]),
            HashMap::from([(Pair(1, 2), 3), (Pair(2, 1), 3)]),
        ],
        &mut p,
    );
    distinct(
        "HashMap<Option<String>,u8>",
        &[
            HashMap::from([(None, 1)]),
            HashMap::from([(Some("null".to_owned()), 1)]),
            HashMap::from([(Some(String::new()), 1)]),
            HashMap::from([(Some("?null".to_owned()), 1)]),
        ],
        &mut p,
    );
    distinct(
        "HashMap<Option<Option<u8>>,u8>",
        &[
            HashMap::from([(None, 1)]),
            HashMap::from([(Some(None), 1)]),
            HashMap::from([(Some(Some(1)), 1)]),
            HashMap::from([(None, 1), (Some(None), 1)]),
        ],
        &mut p,
    );
    distinct(
        "BTreeMap<Unitish,u8>",
        &[
            BTreeMap::from([(Unitish::A, 1)]),
            BTreeMap::from([(Unitish::B(()), 1)]),
            BTreeMap::from([(Unitish::F(()), 1)]),
            BTreeMap::from([(Unitish::H(None), 1)]),
            BTreeMap::from([(Unitish::H(Some(())), 1)]),
            BTreeMap::from([(Unitish::D(None), 1)]),
        ],
        &mut p,
    );
    distinct(
        "BTreeMap<String,Option<()>>",
        &[
            BTreeMap::from([("a".to_owned(), None)]),
            BTreeMap::from([("a".to_owned(), Some(()))]),
            BTreeMap::new(),
        ],
        &mut p,
    );
    distinct(
        "Vec<(String,u8)> vs map",
        &[
            vec![("a".to_owned(), 1u8)],
            vec![("a".to_owned(), 1), ("a".to_owned(), 1)],
        ],
        &mut p,
    );
    distinct(
        "WithSkip",
        &[
            WithSkip { a: None, b: None },
            WithSkip {
                a: Some(1),
                b: None,
            },
            WithSkip {
                a: None,
                b: Some(1),
            },
        ],
        &mut p,
    );
    distinct(
        "(char,String)",
        &[
            ('a', "b".to_owned()),
            ('b', "a".to_owned()),
            ('\0', String::new()),
        ],
        &mut p,
    );
    distinct(
        "Vec<String>",
        &[
            vec!["a,b".to_owned()],
            vec!["a".to_owned(), "b".to_owned()],
            vec!["\"a\"".to_owned()],
            vec!["\0".to_owned()],
            vec![String::new()],
            vec![],
        ],
        &mut p,
    );
    distinct(
        "HashSet<Vec<u8>>",
        &[
            HashSet::from([vec![1u8, 2], vec![3]]),
            HashSet::from([vec![1u8], vec![2, 3]]),
            HashSet::from([vec![1u8, 2, 3]]),
            HashSet::from([vec![], vec![1u8, 2, 3]]),
        ],
        &mut p,
    );
    distinct(
        "HashSet<String>",
        &[
            HashSet::from(["a\",\"b".to_owned()]),
            HashSet::from(["a".to_owned(), "b".to_owned()]),
        ],
        &mut p,
    );
    distinct(
        "HashMap<String, HashSet<u8>>",
        &[
            HashMap::from([("a".to_owned(), HashSet::from([1u8, 2]))]),
            HashMap::from([
                ("a".to_owned(), HashSet::from([1u8])),
                ("b".to_owned(), HashSet::from([2])),
            ]),
        ],
        &mut p,
    );
    distinct(
        "Duration",
        &[
            Duration::from_secs(1),
            Duration::from_nanos(1_000_000_000 - 1),
            Duration::new(0, 1),
        ],
        &mut p,
    );
    distinct(
        "Newtype",
        &[
            Newtype("a".into()),
            Newtype("\u{e9}".into()),
            Newtype("e\u{301}".into()),
        ],
        &mut p,
    );
    distinct(
        "serde_json::Value",
        &[
            serde_json::json!(1),
            serde_json::json!(1.0),
            serde_json::json!(-0.0),
            serde_json::json!(0),
            serde_json::json!("1"),
            serde_json::json!(null),
            serde_json::json!([]),
            serde_json::json!({}),
            serde_json::json!([null]),
            serde_json::json!(u64::MAX),
            serde_json::json!(u64::MAX as f64),
            serde_json::json!(i64::MIN),
            serde_json::json!(i64::MIN as f64),
        ],
        &mut p,
    );
    distinct(
        "Vec<BinaryHeap<u8>>",
        &[
            vec![BinaryHeap::from([1u8, 1, 2])],
            vec![BinaryHeap::from([1u8, 2, 2])],
        ],
        &mut p,
    );

    // Equal values built otherwise.
    same(
        "HashMap<Pair,HashSet<Line>>",
        |i| {
            let mut m = HashMap::with_capacity(i);
            let mut keys: Vec<u8> = (0..20).collect();
            keys.rotate_left(i % 20);
            for k in keys {
                let mut s = HashSet::with_capacity(i % 7);
                for q in (0..5).rev() {
                    s.insert(Line {
                        sku: format!("s{k}"),
                        qty: (q + i as u32) % 5,
                    });
                }
                m.insert(Pair(k, k.wrapping_mul(3)), s);
            }
            m
        },
        &mut p,
    );
    same(
        "HashMap<String,f64>",
        |i| {
            let mut m = HashMap::new();
            let mut keys: Vec<u32> = (0..30).collect();
            keys.rotate_left(i % 30);
            for k in keys {
                m.insert(format!("k{k}"), k as f64 / 3.0);
            }
            m
        },
        &mut p,
    );
    same(
        "BinaryHeap<Line>",
        |i| {
            let mut items: Vec<(u32, u32)> = (0..10).map(|q| (q, q % 3)).collect();
            items.rotate_left(i % 10);
            items.into_iter().collect::<BinaryHeap<_>>()
        },
        &mut p,
    );
    same(
        "HashMap<Option<String>, HashSet<Option<u8>>>",
        |i| {
            let mut m = HashMap::new();
            let mut keys: Vec<Option<String>> = (0..10)
                .map(|k| (k % 4 != 0).then(|| format!("{k}")))
                .collect();
            keys.rotate_left(i % 10);
            for k in keys {
                let s: HashSet<Option<u8>> = (0..6).map(|x| (x != 0).then_some(x)).collect();
                m.insert(k, s);
            }
            m
        },
        &mut p,
    );
    same(
        "VecDeque rotated",
        |i| {
            let mut d: VecDeque<u8> = VecDeque::with_capacity(8);
            for _ in 0..(i % 8) {
                d.push_back(0);
                d.pop_front();
            }
            d.extend([1, 2, 3]);
            d
        },
        &mut p,
    );
    same(
        "BTreeSet",
        |i| {
            (0..(10 + i % 3))
                .rev()
                .take(10)
                .collect::<BTreeSet<usize>>()
                .len()
        },
        &mut p,
    );
    for line in &p {
        eprintln!("PROBLEM {line}");
    }
    assert!(p.is_empty(), "{} problems", p.len());
}

// ---- replays -------------------------------------------------------------

macro_rules! echo {
    ($name:ident, $scope:literal, $ty:ty) => {
        // Tuples of many collections: the point is their shapes.
        #[allow(clippy::type_complexity)]
        #[idempotent(scope = $scope, key = key, tenant = tenant, store = store, skip(value))]
        async fn $name(
            store: &dyn Store,
            tenant: &str,
            key: &str,
            value: $ty,
        ) -> Result<$ty, Error> {
            Ok(value)
        }
    };
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum Loose {
    I(i64),
    U(u64),
    F(f64),
    S(String),
    B(bool),
    L(Vec<Loose>),
    N,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Flat {
    id: u64,
    #[serde(flatten)]
    rest: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct FlatF32 {
    id: u64,
    #[serde(flatten)]
    inner: InnerF32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct InnerF32 {
    f: f32,
    g: f64,
    c: char,
    big: u64,
    neg: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
enum Tagged {
    Charge { amount: u64, f: f32 },
    Refund(InnerF32),
    Nothing,
}

echo!(
    e_u128,
    "sweep.u128",
    (u128, i128, Option<u128>, Vec<Option<i128>>)
);
echo!(
    e_keys,
    "sweep.keys",
    (
        BTreeMap<u128, u8>,
        BTreeMap<i128, u8>,
        HashMap<bool, u8>,
        HashMap<char, u8>
    )
);
echo!(
    e_ekeys,
    "sweep.ekeys",
    (BTreeMap<Unitish, u8>, BTreeMap<Newtype2, u8>)
);
echo!(
    e_floats,
    "sweep.floats",
    (f32, f32, f32, f64, f64, Option<f32>, Vec<f32>)
);
echo!(
    e_text,
    "sweep.text",
    (String, char, char, Vec<char>, String)
);
echo!(
    e_time,
    "sweep.time",
    (
        Duration,
        std::time::SystemTime,
        std::ops::Range<i32>,
        std::ops::RangeInclusive<u8>
    )
);
echo!(e_value, "sweep.value", serde_json::Value);
echo!(e_loose, "sweep.loose", Vec<Loose>);
echo!(e_flat, "sweep.flat", Flat);
echo!(e_flatf32, "sweep.flatf32", FlatF32);
echo!(e_tagged, "sweep.tagged", Vec<Tagged>);
echo!(e_adjacent, "sweep.adjacent", Vec<Adjacent>);
echo!(e_unitish, "sweep.unitish", Vec<Unitish>);
echo!(e_bytes, "sweep.bytes", (Vec<u8>, [u8; 32], Box<[u8]>));
echo!(
    e_sets,
    "sweep.sets",
    (HashSet<Line>, HashMap<String, HashSet<u64>>, BinaryHeapEq)
);
echo!(
    e_misc,
    "sweep.misc",
    (
        std::net::IpAddr,
        std::num::Wrapping<u64>,
        std::num::NonZeroU64,
        std::cmp::Reverse<i8>,
        std::path::PathBuf
    )
);
echo!(
    e_units,
    "sweep.units",
    (Vec<()>, HashMap<String, ()>, Option<Vec<()>>, ((), ((),)))
);
echo!(e_someunit_map, "sweep.someunit_map", HashMap<String, Option<()>>);
echo!(e_pair_key, "sweep.pair_key", BTreeMap<Pair, u8>);
echo!(e_nan_vec, "sweep.nan_vec", Vec<Option<f64>>);
echo!(e_unit_key, "sweep.unit_key", BTreeMap<Unitish, u8>);
echo!(e_opt_key, "sweep.opt_key", BTreeMap<Option<u8>, u8>);

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
struct Newtype2(String);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct BinaryHeapEq(BinaryHeap<u32>);

impl PartialEq for BinaryHeapEq {
    fn eq(&self, other: &Self) -> bool {
        self.0.clone().into_sorted_vec() == other.0.clone().into_sorted_vec()
    }
}

/// The cases refused when recorded (rule 12), naming their scope: JSON
/// writes `Some(())` and `NaN` as `null`, and has no keys but strings.
const REFUSED: [&str; 4] = [
    "sweep.someunit_map",
    "sweep.pair_key",
    "sweep.nan_vec",
    "sweep.unit_key",
];

macro_rules! check {
    ($problems:expr, $store:expr, $sname:expr, $f:ident, $scope:literal, $value:expr) => {{
        let t = common::servers::fresh_tenant();
        let value = $value;
        let first = $f($store, &t, "k", value.clone()).await;
        match first {
            Ok(v) => {
                if v != value {
                    $problems.push(format!(
                        "{} {}: first call returned another value",
                        $sname, $scope
                    ));
                }
                let (again, outcome) = with_outcome($f($store, &t, "k", value.clone())).await;
                match again {
                    Ok(again) if outcome == Some(Outcome::Replayed) => {
                        if REFUSED.contains(&$scope) {
                            $problems.push(format!("{} {}: recorded, not refused", $sname, $scope));
                        }
                        if again != value {
                            $problems.push(format!(
                                "{} {}: REPLAYED ANOTHER VALUE: {:?} -> {:?}",
                                $sname, $scope, value, again
                            ));
                        }
                    }
                    other => $problems.push(format!(
                        "{} {}: second call {:?} ({:?})",
                        $sname, $scope, other, outcome
                    )),
                }
            }
            Err(Error::ResultNotFaithful { scope, message })
            | Err(Error::ResultEncoding { scope, message }) => {
                if !REFUSED.contains(&$scope) {
                    $problems.push(format!("{} {}: refused: {message}", $sname, $scope));
                }
                if scope != $scope {
                    $problems.push(format!("{} {}: refusal names {scope}", $sname, $scope));
                }
            }
            Err(e) => $problems.push(format!("{} {}: unexpected {e:?}", $sname, $scope)),
        }
    }};
}

#[tokio::test]
async fn results_of_more_shapes_replay_equal_or_are_refused_naming_the_scope() {
    let mut p: Vec<String> = Vec::new();
    for (name, store) in stores().await {
        let s = &*store;
        check!(
            p,
            s,
            name,
            e_u128,
            "sweep.u128",
            (
                u128::MAX,
                i128::MIN,
                Some(u128::MAX - 1),
                vec![Some(i128::MAX), None, Some(-(1i128 << 70))]
            )
        );
        check!(
            p,
            s,
            name,
            e_keys,
            "sweep.keys",
            (
                BTreeMap::from([(u128::MAX, 1u8), (0, 2)]),
                BTreeMap::from([(i128::MIN, 1u8)]),
                HashMap::from([(true, 1u8), (false, 2)]),
                HashMap::from([('\0', 1u8), ('"', 2), ('\u{10ffff}', 3)]),
            )
        );
        check!(
            p,
            s,
            name,
            e_ekeys,
            "sweep.ekeys",
            (
                BTreeMap::from([(Unitish::A, 1u8)]),
                BTreeMap::from([(Newtype2("x".into()), 1u8)]),
            )
        );
        check!(
            p,
            s,
            name,
            e_floats,
            "sweep.floats",
            (
                0.1f32,
                f32::MIN_POSITIVE,
                1e-45f32,
                -0.0f64,
                5e-324f64,
                Some(f32::MAX),
                vec![f32::MIN, 3.4028235e38, 1.1754942e-38]
            )
        );
        check!(
            p,
            s,
            name,
            e_text,
            "sweep.text",
            (
                "a\0b\u{2028}\u{feff}\u{7f}".to_owned(),
                '\0',
                '\u{10ffff}',
                vec!['\u{d7ff}', '\u{e000}'],
                "\\u0000".to_owned()
            )
        );
        check!(
            p,
            s,
            name,
            e_time,
            "sweep.time",
            (
                Duration::new(u64::MAX, 999_999_999),
                std::time::UNIX_EPOCH + Duration::new(4_000_000_000, 1),
                -5..i32::MAX,
                0..=255u8
            )
        );
        check!(
            p,
            s,
            name,
            e_value,
            "sweep.value",
            serde_json::json!({
                "a": [1, 1.0, -0.0, 1e300, u64::MAX, i64::MIN, 5e-324, null, "x\0"],
                "b": {"": {"nested": [[[]]]}},
            })
        );
        check!(
            p,
            s,
            name,
            e_loose,
            "sweep.loose",
            vec![
                Loose::I(-1),
                Loose::U(u64::MAX),
                Loose::F(1.0),
                Loose::F(-0.0),
                Loose::F(1e20),
                Loose::S("1".into()),
                Loose::B(true),
                Loose::L(vec![Loose::N]),
                Loose::N,
            ]
        );
        check!(
            p,
            s,
            name,
            e_flat,
            "sweep.flat",
            Flat {
                id: u64::MAX,
                rest: [
                    ("x".to_owned(), serde_json::json!(1.5)),
                    ("y".to_owned(), serde_json::json!(u64::MAX))
                ]
                .into(),
            }
        );
        check!(
            p,
            s,
            name,
            e_flatf32,
            "sweep.flatf32",
            FlatF32 {
                id: 1,
                inner: InnerF32 {
                    f: 0.1,
                    g: 0.1,
                    c: '\u{10ffff}',
                    big: u64::MAX,
                    neg: i64::MIN
                },
            }
        );
        check!(
            p,
            s,
            name,
            e_tagged,
            "sweep.tagged",
            vec![
                Tagged::Charge {
                    amount: u64::MAX,
                    f: 16777217.0
                },
                Tagged::Refund(InnerF32 {
                    f: f32::MIN_POSITIVE,
                    g: 5e-324,
                    c: 'x',
                    big: 1 << 60,
                    neg: -1
                }),
                Tagged::Nothing,
            ]
        );
        check!(
            p,
            s,
            name,
            e_adjacent,
            "sweep.adjacent",
            vec![
                Adjacent::A(1),
                Adjacent::C,
                Adjacent::D(None),
                Adjacent::D(Some(2)),
                Adjacent::E(())
            ]
        );
        check!(
            p,
            s,
            name,
            e_unitish,
            "sweep.unitish",
            vec![
                Unitish::A,
                Unitish::B(()),
                Unitish::C {},
                Unitish::D(None),
                Unitish::E(vec![1]),
                Unitish::G((), ()),
                Unitish::H(None),
            ]
        );
        check!(
            p,
            s,
            name,
            e_bytes,
            "sweep.bytes",
            (
                vec![0u8, 255, 0],
                [7u8; 32],
                vec![1u8, 2].into_boxed_slice()
            )
        );
        check!(
            p,
            s,
            name,
            e_sets,
            "sweep.sets",
            (
                (0..50)
                    .map(|q| Line {
                        sku: format!("s{q}"),
                        qty: q
                    })
                    .collect::<HashSet<_>>(),
                HashMap::from([("a".to_owned(), (0..40).collect::<HashSet<u64>>())]),
                BinaryHeapEq((0..20).collect()),
            )
        );
        check!(
            p,
            s,
            name,
            e_misc,
            "sweep.misc",
            (
                "::ffff:1.2.3.4".parse::<std::net::IpAddr>().unwrap(),
                std::num::Wrapping(u64::MAX),
                std::num::NonZeroU64::new(u64::MAX).unwrap(),
                std::cmp::Reverse(-128i8),
                std::path::PathBuf::from("/tmp/é\u{0}x"),
            )
        );
        check!(
            p,
            s,
            name,
            e_units,
            "sweep.units",
            (
                vec![(), ()],
                HashMap::from([("a".to_owned(), ())]),
                Some(vec![()]),
                ((), ((),))
            )
        );
        check!(
            p,
            s,
            name,
            e_someunit_map,
            "sweep.someunit_map",
            HashMap::from([("a".to_owned(), Some(()))])
        );
        check!(
            p,
            s,
            name,
            e_pair_key,
            "sweep.pair_key",
            BTreeMap::from([(Pair(1, 2), 3u8)])
        );
        check!(
            p,
            s,
            name,
            e_nan_vec,
            "sweep.nan_vec",
            vec![Some(1.0), None, Some(f64::NAN)]
        );
        check!(
            p,
            s,
            name,
            e_unit_key,
            "sweep.unit_key",
            BTreeMap::from([(Unitish::B(()), 3u8)])
        );
        check!(
            p,
            s,
            name,
            e_opt_key,
            "sweep.opt_key",
            BTreeMap::from([(Some(1u8), 3u8)])
        );
    }
    for line in &p {
        eprintln!("PROBLEM {line}");
    }
    assert!(p.is_empty(), "{} problems", p.len());
}

// ---- rule 7: a mismatch changes nothing ----------------------------------

use idempotent_runtime::{Identity, OwnerToken, RecordSnapshot, Reservation, ReserveRequest};
use std::sync::atomic::{AtomicUsize, Ordering};

#[idempotent(scope = "sweep.pay", key = key, tenant = tenant, store = store, skip(runs))]
async fn pay(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    lines: HashSet<u32>,
    runs: &AtomicUsize,
) -> Result<usize, Error> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + lines.len())
}

/// Everything a record holds but the store's clock reading.
fn held(s: &RecordSnapshot) -> String {
    format!(
        "{:?} {:?} {:?} {:?} {:?} {} {} {} {} {}",
        s.state,
        s.fingerprint,
        s.owner_token,
        s.outcome,
        s.lease_expires_at_ms,
        s.expires_at_ms,
        s.created_at_ms,
        s.attempt,
        s.attempt_started_at_ms,
        s.recovered
    )
}

#[tokio::test]
async fn a_mismatch_changes_nothing_in_the_record_it_meets_on_every_store() {
    for (name, store) in stores().await {
        let t = common::servers::fresh_tenant();
        let runs = AtomicUsize::new(0);
        let s = &*store;
        let id = |key: &str| Identity::new(&t, "sweep.pay", key).expect("identity");
        // A complete record, met by a set argument (current and legacy forms).
        pay(s, &t, "done", (0..8).collect(), &runs)
            .await
            .expect("first");
        let before = s.fetch(&id("done")).await.unwrap().unwrap();
        let err = pay(s, &t, "done", (0..9).collect(), &runs)
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::FingerprintMismatch(_)),
            "{name}: {err:?}"
        );
        let after = s.fetch(&id("done")).await.unwrap().unwrap();
        assert_eq!(held(&before), held(&after), "{name}: complete");

        // An in-progress record of other arguments, its lease live.
        let other = Fingerprint::of(&"other").unwrap();
        let token = OwnerToken::new();
        let live = id("live");
        let req = ReserveRequest {
            identity: &live,
            fingerprint: Some(&other),
            token: &token,
            lease: Duration::from_secs(600),
            ttl: Duration::from_secs(600),
        };
        assert!(matches!(
            s.reserve(req).await.unwrap(),
            Reservation::Acquired { .. }
        ));
        let before = s.fetch(&live).await.unwrap().unwrap();
        let err = pay(s, &t, "live", (0..9).collect(), &runs)
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::FingerprintMismatch(_)),
            "{name}: {err:?}"
        );
        let after = s.fetch(&live).await.unwrap().unwrap();
        assert_eq!(held(&before), held(&after), "{name}: live");

        // An in-progress record of other arguments whose lease ran out.
        let token = OwnerToken::new();
        let lapsed = id("lapsed");
        let req = ReserveRequest {
            identity: &lapsed,
            fingerprint: Some(&other),
            token: &token,
            lease: Duration::from_millis(20),
            ttl: Duration::from_secs(600),
        };
        assert!(matches!(
            s.reserve(req).await.unwrap(),
            Reservation::Acquired { .. }
        ));
        let mut before = s.fetch(&lapsed).await.unwrap().unwrap();
        for _ in 0..500 {
            if before
                .lease_expires_at_ms
                .is_some_and(|l| l <= before.now_ms)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            before = s.fetch(&lapsed).await.unwrap().unwrap();
        }
        let err = pay(s, &t, "lapsed", (0..9).collect(), &runs)
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::FingerprintMismatch(_)),
            "{name}: {err:?}"
        );
        let after = s.fetch(&lapsed).await.unwrap().unwrap();
        assert_eq!(held(&before), held(&after), "{name}: lapsed");

        // A record a newer version made.
        let newer = Fingerprint::from_stored(format!("v9:{}", "ab".repeat(32)));
        let token = OwnerToken::new();
        let future = id("future");
        let req = ReserveRequest {
            identity: &future,
            fingerprint: Some(&newer),
            token: &token,
            lease: Duration::from_secs(600),
            ttl: Duration::from_secs(600),
        };
        assert!(matches!(
            s.reserve(req).await.unwrap(),
            Reservation::Acquired { .. }
        ));
        let before = s.fetch(&future).await.unwrap().unwrap();
        let err = pay(s, &t, "future", (0..9).collect(), &runs)
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::RecordedByNewerVersion { .. }),
            "{name}: {err:?}"
        );
        let after = s.fetch(&future).await.unwrap().unwrap();
        assert_eq!(held(&before), held(&after), "{name}: newer");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
    }
}

// ---- rule 12: untagged variants that JSON writes alike --------------------

/// An untagged enum whose variants write the same JSON: each reads back as
/// the first variant that reads it. (Struct variants whose fields have the
/// same types, `Refund { amount: u64 }` beside `Card { amount: u64 }`, are
/// not told apart: serde writes both under the enum's name. The README says so.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Alike {
    Card { amount: u64 },
    Refund { amount: u32 },
    Small(u8),
    Wide(u32),
    Text(String),
    Letter(char),
}

#[idempotent(scope = "sweep.alike", key = key, tenant = tenant, store = store, skip(runs))]
async fn alike(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    value: Alike,
    runs: &AtomicUsize,
) -> Result<Alike, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(value)
}

/// Rule 12 on every store: a result that JSON writes like another value of
/// its type, and that reads back as that value (`Wide(7)` as `Small(7)`,
/// `Letter('x')` as `Text("x")`, `Refund { amount: 1u32 }` as
/// `Card { amount: 1u64 }`), is refused naming the scope, never recorded;
/// the variants that read back as themselves replay equal.
#[tokio::test]
async fn an_untagged_variant_that_reads_back_as_another_is_refused_naming_the_scope() {
    for (name, store) in stores().await {
        let s = &*store;
        for value in [
            Alike::Refund { amount: 1 },
            Alike::Wide(7),
            Alike::Letter('x'),
        ] {
            let (t, runs) = (common::servers::fresh_tenant(), AtomicUsize::new(0));
            for _ in 0..2 {
                match alike(s, &t, "k", value.clone(), &runs).await {
                    Err(Error::ResultNotFaithful { scope, message }) => {
                        assert_eq!(scope, "sweep.alike", "{name}");
                        assert!(message.contains("untagged"), "{name}: {message}");
                    }
                    other => panic!("{name}: {value:?} answered {other:?}"),
                }
            }
            assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}: nothing recorded");
        }
        for value in [
            Alike::Card { amount: 1 },
            Alike::Small(7),
            Alike::Wide(70_000),
            Alike::Text("xy".into()),
        ] {
            let (t, runs) = (common::servers::fresh_tenant(), AtomicUsize::new(0));
            assert_eq!(
                alike(s, &t, "k", value.clone(), &runs)
                    .await
                    .expect("first"),
                value
            );
            let (again, outcome) = with_outcome(alike(s, &t, "k", value.clone(), &runs)).await;
            assert_eq!(
                (again.expect("replay"), outcome),
                (value, Some(Outcome::Replayed)),
                "{name}"
            );
            assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
        }
    }
}
