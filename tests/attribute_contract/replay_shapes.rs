//! Rule 12 over value shapes the read-back check (`reads_back_equal`, with
//! its shape comparison) must not refuse: each result here replays as an
//! equal value, so recording it must succeed and its replay must be equal.
//! And shapes whose replay is another value, which must be refused.

use idempotent_runtime::{idempotent, with_outcome, Error, MemoryStore, Outcome};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};

/// One function per type: records `make()` and checks its replay.
macro_rules! replays_equal {
    ($test:ident, $scope:literal, $ty:ty, $make:expr) => {
        #[tokio::test]
        async fn $test() {
            #[idempotent(scope = $scope, key = key, tenant = shared, store = store)]
            async fn echo(store: &MemoryStore, key: &str) -> Result<$ty, Error> {
                Ok($make)
            }
            let store = MemoryStore::new();
            let first = echo(&store, "k").await.expect("recorded");
            let (again, outcome) = with_outcome(echo(&store, "k")).await;
            assert_eq!(outcome, Some(Outcome::Replayed));
            assert_eq!(again.expect("replayed"), first);
        }
    };
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Unit;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct TupleStruct(u8, String, char);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
struct Transparent(u32);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Inner {
    a: u8,
    b: Option<i16>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Flat {
    id: u64,
    #[serde(flatten)]
    inner: Inner,
    #[serde(flatten)]
    rest: HashMap<String, serde_json::Value>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct FlatOption {
    id: u64,
    #[serde(flatten)]
    inner: Option<Inner>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Skips {
    shown: u8,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    maybe: Option<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    list: Vec<f32>,
    #[serde(skip)]
    hidden: u8,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum External {
    Unit,
    New(u16),
    Tuple(u8, u64),
    Struct { x: i8, y: char },
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
enum Internal {
    Unit,
    New(Inner),
    Struct { x: u8, y: f32 },
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", content = "c")]
enum Adjacent {
    Unit,
    New(u8),
    Tuple(u8, char),
    Struct { x: u128 },
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum Untagged {
    Num(u64),
    Text(String),
    Many(Vec<Untagged>),
    Obj { id: u8, name: String },
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum IntOrFloat {
    Int(i64),
    Float(f64),
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Generic<T> {
    items: Vec<Option<T>>,
    by_name: BTreeMap<String, T>,
}

/// A custom `Serialize`: a timestamp written as text, as chrono's is.
#[derive(Debug, PartialEq)]
struct Stamp(i64);

impl Serialize for Stamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("2026-12-06T22:{:02}:00Z", self.0))
    }
}

impl<'de> Deserialize<'de> for Stamp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.get(14..16)
            .and_then(|m| m.parse().ok())
            .map(Stamp)
            .ok_or_else(|| serde::de::Error::custom("not a stamp"))
    }
}

/// A custom `Serialize` that writes small numbers as numbers and large
/// ones as text (as JavaScript-safe id types do).
#[derive(Debug, PartialEq)]
struct JsId(u64);

impl Serialize for JsId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 < (1 << 53) {
            s.serialize_u64(self.0)
        } else {
            s.serialize_str(&self.0.to_string())
        }
    }
}

impl<'de> Deserialize<'de> for JsId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            N(u64),
            S(String),
        }
        match Either::deserialize(d)? {
            Either::N(n) => Ok(JsId(n)),
            Either::S(s) => s.parse().map(JsId).map_err(serde::de::Error::custom),
        }
    }
}

replays_equal!(
    a_json_value_replays_equal,
    "replay_shapes.value",
    serde_json::Value,
    serde_json::json!({"a": 1, "b": [1.5, -2, "x", null, true, 1e20, -0.0],
        "c": {"d": u64::MAX, "e": i64::MIN, "f": 0.1}})
);
replays_equal!(
    maps_and_sets_replay_equal,
    "replay_shapes.maps",
    (
        HashMap<String, Vec<u8>>,
        BTreeMap<u32, String>,
        HashSet<String>,
        HashMap<char, f32>
    ),
    (
        (0..40)
            .map(|i| (format!("k{i}"), vec![i as u8; 3]))
            .collect(),
        (0..40).map(|i| (i, format!("v{i}"))).collect(),
        (0..40).map(|i| format!("s{i}")).collect(),
        ('a'..='z').map(|c| (c, c as u32 as f32 / 7.0)).collect()
    )
);
replays_equal!(
    nested_options_that_are_none_or_some_some_replay_equal,
    "replay_shapes.options",
    (Option<Option<u8>>, Option<Option<u8>>, Option<Option<u8>>),
    (None, Some(Some(0)), Some(Some(7)))
);
replays_equal!(
    flattened_structs_and_maps_replay_equal,
    "replay_shapes.flatten",
    Flat,
    Flat {
        id: 9,
        inner: Inner { a: 3, b: Some(-4) },
        rest: [("extra".to_owned(), serde_json::json!([1, 2.5, "z"]))].into(),
    }
);
replays_equal!(
    a_flattened_option_replays_equal,
    "replay_shapes.flatten_option",
    FlatOption,
    FlatOption {
        id: 9,
        inner: Some(Inner { a: 3, b: None })
    }
);
replays_equal!(
    skipped_fields_replay_equal,
    "replay_shapes.skips",
    (Skips, Skips),
    (
        Skips {
            shown: 1,
            maybe: None,
            list: vec![],
            hidden: 0
        },
        Skips {
            shown: 2,
            maybe: Some(70_000),
            list: vec![0.5, 1e-3],
            hidden: 0
        }
    )
);
replays_equal!(
    pointers_and_cows_replay_equal,
    "replay_shapes.pointers",
    (
        Box<str>,
        std::borrow::Cow<'static, str>,
        Box<Option<Box<u8>>>,
        Box<[u16]>
    ),
    (
        "boxed".into(),
        std::borrow::Cow::Borrowed("cow"),
        Box::new(Some(Box::new(3))),
        vec![1u16, 2, 3].into()
    )
);
replays_equal!(
    wide_and_narrow_numbers_replay_equal,
    "replay_shapes.numbers",
    (u128, i128, f32, f32, f64, u8, i8, (u16, i32)),
    (
        u128::MAX,
        i128::MIN,
        0.1,
        -3.4e38,
        1e-300,
        255,
        -128,
        (65_535, -7)
    )
);
replays_equal!(
    unit_and_tuple_structs_replay_equal,
    "replay_shapes.structs",
    (Unit, (), TupleStruct, Transparent, [u8; 4]),
    (
        Unit,
        (),
        TupleStruct(1, "t".into(), 'c'),
        Transparent(4),
        [1, 2, 3, 4]
    )
);
replays_equal!(
    externally_tagged_enums_replay_equal,
    "replay_shapes.external",
    Vec<External>,
    vec![
        External::Unit,
        External::New(9),
        External::Tuple(1, 2),
        External::Struct { x: -1, y: 'q' }
    ]
);
replays_equal!(
    internally_tagged_enums_replay_equal,
    "replay_shapes.internal",
    Vec<Internal>,
    vec![
        Internal::Unit,
        Internal::New(Inner { a: 1, b: Some(2) }),
        Internal::Struct { x: 3, y: 0.25 }
    ]
);
replays_equal!(
    adjacently_tagged_enums_replay_equal,
    "replay_shapes.adjacent",
    Vec<Adjacent>,
    vec![
        Adjacent::Unit,
        Adjacent::New(1),
        Adjacent::Tuple(2, 'x'),
        Adjacent::Struct { x: 5 }
    ]
);
replays_equal!(
    untagged_enums_whose_variants_write_apart_replay_equal,
    "replay_shapes.untagged",
    (Vec<Untagged>, Vec<IntOrFloat>),
    (
        vec![
            Untagged::Num(7),
            Untagged::Text("7".into()),
            Untagged::Many(vec![
                Untagged::Num(1),
                Untagged::Obj {
                    id: 2,
                    name: "n".into()
                }
            ]),
            Untagged::Obj {
                id: 3,
                name: "m".into()
            }
        ],
        vec![
            IntOrFloat::Int(-5),
            IntOrFloat::Float(5.0),
            IntOrFloat::Float(1e20)
        ]
    )
);
replays_equal!(
    nested_generics_replay_equal,
    "replay_shapes.generics",
    Generic<Generic<u8>>,
    Generic {
        items: vec![
            None,
            Some(Generic {
                items: vec![Some(1), None],
                by_name: BTreeMap::new()
            })
        ],
        by_name: [(
            "x".to_owned(),
            Generic {
                items: vec![],
                by_name: [("y".to_owned(), 2)].into()
            }
        )]
        .into(),
    }
);
replays_equal!(
    custom_serialize_impls_replay_equal,
    "replay_shapes.custom",
    (Stamp, Vec<JsId>, HashMap<String, JsId>),
    (
        Stamp(15),
        vec![JsId(1), JsId(u64::MAX), JsId(1 << 53)],
        [("a".to_owned(), JsId(u64::MAX)), ("b".to_owned(), JsId(3))].into()
    )
);
replays_equal!(
    results_and_durations_replay_equal,
    "replay_shapes.misc",
    (Result<u8, String>, Result<u8, String>, std::time::Duration),
    (Ok(1), Err("e".into()), std::time::Duration::new(5, 7))
);

/// Records `make()`: either it is refused (rule 12: it would read back as
/// another value), or its replay is equal to it. Never another value.
macro_rules! refused_or_replays_equal {
    ($test:ident, $scope:literal, $ty:ty, $make:expr) => {
        #[tokio::test]
        async fn $test() {
            #[idempotent(scope = $scope, key = key, tenant = shared, store = store)]
            async fn echo(store: &MemoryStore, key: &str) -> Result<$ty, Error> {
                Ok($make)
            }
            let store = MemoryStore::new();
            match echo(&store, "k").await {
                Err(refused) => assert!(
                    refused.to_string().contains("reads back as another value"),
                    "{refused}"
                ),
                Ok(first) => {
                    let (again, outcome) = with_outcome(echo(&store, "k")).await;
                    assert_eq!(outcome, Some(Outcome::Replayed));
                    assert_eq!(again.expect("replayed"), first, "replayed as another value");
                }
            }
        }
    };
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum SwappedFields {
    A { x: u8, y: u32 },
    B { x: u32, y: u8 },
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum SwappedTuple {
    A(u8, u32),
    B(u32, u8),
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum NarrowFirst {
    Small(u8),
    Wide(u32),
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum WideFirst {
    Wide(u32),
    Small(u8),
}

refused_or_replays_equal!(
    an_untagged_struct_variant_whose_fields_swap_types_is_refused_or_replays_equal,
    "replay_shapes.swapped_fields",
    SwappedFields,
    SwappedFields::B { x: 7, y: 7 }
);
refused_or_replays_equal!(
    an_untagged_tuple_variant_whose_fields_swap_types_is_refused_or_replays_equal,
    "replay_shapes.swapped_tuple",
    SwappedTuple,
    SwappedTuple::B(7, 7)
);
refused_or_replays_equal!(
    two_untagged_values_that_read_back_as_each_others_kinds_are_refused_or_replay_equal,
    "replay_shapes.swapped_enums",
    (NarrowFirst, WideFirst),
    (NarrowFirst::Wide(7), WideFirst::Small(7))
);
refused_or_replays_equal!(
    a_map_whose_values_read_back_as_each_others_kinds_is_refused_or_replays_equal,
    "replay_shapes.swapped_map",
    (BTreeMap<String, NarrowFirst>, BTreeMap<String, WideFirst>),
    (
        [("a".to_owned(), NarrowFirst::Wide(1))].into(),
        [("a".to_owned(), WideFirst::Small(1))].into()
    )
);
