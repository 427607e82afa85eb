use super::encoder::{is_unordered, Encoder, Mode};
use super::*;
use proptest::prelude::*;
use serde::ser::{SerializeMap, SerializeStruct, SerializeStructVariant};
use serde::ser::{SerializeTuple, SerializeTupleStruct, SerializeTupleVariant, Serializer};
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};

/// The v1 implementation as it shipped (serde_json::to_value, then objects
/// written with sorted members): the reference v2 must agree with wherever
/// v1 was faithful, and the legacy form must agree with everywhere.
mod v1 {
    use serde::Serialize;
    use serde_json::Value;
    use sha2::{Digest, Sha256};
    use std::collections::BTreeMap;

    pub fn canonical<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
        let value = serde_json::to_value(value)?;
        let mut out = Vec::new();
        write_canonical(&mut out, &value);
        Ok(out)
    }

    /// The v1 `FingerprintBuilder`: `Ok(None)` without arguments, `Err` when v1 could not.
    #[derive(Default)]
    pub struct Builder {
        arguments: BTreeMap<&'static str, Value>,
        error: Option<String>,
    }

    impl Builder {
        pub fn argument<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) {
            if self.error.is_some() {
                return;
            }
            match serde_json::to_value(value) {
                Ok(v) => {
                    self.arguments.insert(name, v);
                }
                Err(e) => self.error = Some(e.to_string()),
            }
        }

        pub fn finish(self) -> Result<Option<String>, String> {
            if let Some(e) = self.error {
                return Err(e);
            }
            if self.arguments.is_empty() {
                return Ok(None);
            }
            let mut bytes = Vec::with_capacity(128);
            bytes.push(b'{');
            for (i, (name, value)) in self.arguments.iter().enumerate() {
                if i > 0 {
                    bytes.push(b',');
                }
                write_string(&mut bytes, name);
                bytes.push(b':');
                write_canonical(&mut bytes, value);
            }
            bytes.push(b'}');
            Ok(Some(format!("v1:{}", hex::encode(Sha256::digest(&bytes)))))
        }
    }

    /// `Fingerprint::of` as v1 computed it.
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<String, String> {
        let mut b = Builder::default();
        b.argument("value", value);
        b.finish().map(|f| f.expect("one argument"))
    }

    fn write_string(out: &mut Vec<u8>, s: &str) {
        serde_json::to_writer(&mut *out, s).expect("writing a string into memory");
    }

    fn write_canonical(out: &mut Vec<u8>, value: &Value) {
        match value {
            Value::Object(map) => {
                let mut members: Vec<(&String, &Value)> = map.iter().collect();
                members.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                out.push(b'{');
                for (i, (k, v)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(out, k);
                    out.push(b':');
                    write_canonical(out, v);
                }
                out.push(b'}');
            }
            Value::Array(items) => {
                out.push(b'[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_canonical(out, v);
                }
                out.push(b']');
            }
            scalar => {
                let start = out.len();
                serde_json::to_writer(&mut *out, scalar).expect("writing a scalar into memory");
                // v1 shipped with serde_json 1.0.147 or later, which writes
                // `1e+17`; one before wrote `1e17` (see
                // `float_text_is_the_same_whatever_serde_json_writes`).
                if let Some(e) = out[start..].iter().position(|&b| b == b'e') {
                    let exponent = start + e + 1;
                    if scalar.is_number() && out.get(exponent).is_some_and(u8::is_ascii_digit) {
                        out.insert(exponent, b'+');
                    }
                }
            }
        }
    }
}

/// The canonical (v2) bytes of a value and whether they needed the extension.
fn canonical<T: Serialize + ?Sized>(value: &T) -> (String, bool) {
    let mut enc = Encoder::new(Mode::Canonical);
    value
        .serialize(&mut enc)
        .expect("every value has a canonical form");
    (text(enc.bytes()), enc.extended())
}

fn v2<T: Serialize + ?Sized>(value: &T) -> String {
    canonical(value).0
}

/// The bytes the legacy (v1) mode writes, or why it cannot.
fn legacy<T: Serialize + ?Sized>(value: &T) -> Result<String, String> {
    let mut enc = Encoder::new(Mode::Legacy);
    value.serialize(&mut enc).map_err(|e| e.to_string())?;
    Ok(text(enc.bytes()))
}

fn reference<T: Serialize + ?Sized>(value: &T) -> Result<String, String> {
    v1::canonical(value)
        .map(|b| text(&b))
        .map_err(|e| e.to_string())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("the canonical form is UTF-8")
}

fn fp<T: Serialize + ?Sized>(value: &T) -> Fingerprint {
    Fingerprint::of(value).expect("fingerprintable")
}

fn sha(bytes: &str) -> String {
    hex::encode(Sha256::digest(bytes.as_bytes()))
}

// ---------------------------------------------------------------------------
// A value of the whole serde data model, serialized by hand so that every
// Serializer method is exercised (including serialize_key/serialize_value
// apart, and a collection whose type is named like an unordered set).

#[derive(Debug, Clone)]
pub(super) enum M {
    Unit,
    UnitStruct,
    None,
    Bool(bool),
    I64(i64),
    U64(u64),
    I128(i128),
    U128(u128),
    F64(f64),
    F32(f32),
    Str(String),
    Char(char),
    Bytes(Vec<u8>),
    Newtype(Box<M>),
    Some(Box<M>),
    Seq(Vec<M>),
    Tuple(Vec<M>),
    TupleStruct(Vec<M>),
    /// Serialized through `collect_seq` of a type named `HashSet`.
    Set(Vec<M>),
    /// Through `serialize_entry`.
    StrMap(Vec<(String, M)>),
    /// Through `serialize_key` + `serialize_value`.
    IntMap(Vec<(i64, M)>),
    AnyMap(Vec<(M, M)>),
    Struct(Vec<(&'static str, M)>),
    UnitVariant(&'static str),
    NewtypeVariant(&'static str, Box<M>),
    TupleVariant(&'static str, Vec<M>),
    StructVariant(&'static str, Vec<(&'static str, M)>),
}

/// `entries` as a map of known length, each entry through `serialize_entry`
/// (`M::StrMap`, `M::AnyMap`).
fn serialize_entries<S: Serializer, K: Serialize>(
    s: S,
    entries: &[(K, M)],
) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(entries.len()))?;
    for (k, x) in entries {
        m.serialize_entry(k, x)?;
    }
    m.end()
}

/// A collection named like std's, to reach the unordered path from `M`.
mod named {
    /// Its type name ends in `HashSet`, so it is treated as unordered.
    pub(super) struct HashSet<'a>(pub(super) &'a [super::M]);
    impl<'a> IntoIterator for HashSet<'a> {
        type Item = &'a super::M;
        type IntoIter = std::slice::Iter<'a, super::M>;
        fn into_iter(self) -> Self::IntoIter {
            self.0.iter()
        }
    }
}

impl Serialize for M {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            M::Unit => s.serialize_unit(),
            M::UnitStruct => s.serialize_unit_struct("Unit"),
            M::None => s.serialize_none(),
            M::Bool(v) => s.serialize_bool(*v),
            M::I64(v) => s.serialize_i64(*v),
            M::U64(v) => s.serialize_u64(*v),
            M::I128(v) => s.serialize_i128(*v),
            M::U128(v) => s.serialize_u128(*v),
            M::F64(v) => s.serialize_f64(*v),
            M::F32(v) => s.serialize_f32(*v),
            M::Str(v) => s.serialize_str(v),
            M::Char(v) => s.serialize_char(*v),
            M::Bytes(v) => s.serialize_bytes(v),
            M::Newtype(v) => s.serialize_newtype_struct("Newtype", v),
            M::Some(v) => s.serialize_some(v),
            M::Seq(v) => s.collect_seq(v),
            M::Tuple(v) => {
                let mut t = s.serialize_tuple(v.len())?;
                for x in v {
                    t.serialize_element(x)?;
                }
                t.end()
            }
            M::TupleStruct(v) => {
                let mut t = s.serialize_tuple_struct("TupleStruct", v.len())?;
                for x in v {
                    t.serialize_field(x)?;
                }
                t.end()
            }
            M::Set(v) => s.collect_seq(named::HashSet(v)),
            M::StrMap(v) => serialize_entries(s, v),
            M::IntMap(v) => {
                let mut m = s.serialize_map(None)?;
                for (k, x) in v {
                    m.serialize_key(k)?;
                    m.serialize_value(x)?;
                }
                m.end()
            }
            M::AnyMap(v) => serialize_entries(s, v),
            M::Struct(v) => {
                let mut m = s.serialize_struct("Struct", v.len())?;
                for (k, x) in v {
                    m.serialize_field(k, x)?;
                }
                m.end()
            }
            M::UnitVariant(name) => s.serialize_unit_variant("E", 0, name),
            M::NewtypeVariant(name, v) => s.serialize_newtype_variant("E", 1, name, v),
            M::TupleVariant(name, v) => {
                let mut t = s.serialize_tuple_variant("E", 2, name, v.len())?;
                for x in v {
                    t.serialize_field(x)?;
                }
                t.end()
            }
            M::StructVariant(name, v) => {
                let mut m = s.serialize_struct_variant("E", 3, name, v.len())?;
                for (k, x) in v {
                    m.serialize_field(k, x)?;
                }
                m.end()
            }
        }
    }
}

impl M {
    /// Written `null` by v1 (and by v2 outside `Some`).
    fn null_like(&self) -> bool {
        match self {
            M::Unit | M::UnitStruct | M::None => true,
            M::Newtype(x) => x.null_like(),
            _ => false,
        }
    }

    /// A non-finite float anywhere except in map keys.
    fn has_non_finite_value(&self) -> bool {
        match self {
            M::F64(v) => !v.is_finite(),
            M::F32(v) => !v.is_finite(),
            // `Some` of a value written as `null` would replay as `None`.
            M::Some(x) if x.writes_null() => true,
            M::Newtype(x) | M::Some(x) | M::NewtypeVariant(_, x) => x.has_non_finite_value(),
            M::Seq(v) | M::Tuple(v) | M::TupleStruct(v) | M::Set(v) | M::TupleVariant(_, v) => {
                v.iter().any(M::has_non_finite_value)
            }
            M::StrMap(v) => v.iter().any(|(_, x)| x.has_non_finite_value()),
            M::IntMap(v) => v.iter().any(|(_, x)| x.has_non_finite_value()),
            M::AnyMap(v) => v.iter().any(|(_, x)| x.has_non_finite_value()),
            M::Struct(v) | M::StructVariant(_, v) => {
                v.iter().any(|(_, x)| x.has_non_finite_value())
            }
            _ => false,
        }
    }

    /// Whether serde_json writes this value as a bare `null`.
    fn writes_null(&self) -> bool {
        match self {
            M::None | M::Unit | M::UnitStruct => true,
            M::Newtype(x) => x.writes_null(),
            M::Some(x) => x.writes_null(),
            _ => false,
        }
    }

    /// The same value with every set's and map's entries in another order
    /// (sequences keep theirs): `pick` chooses a rotation.
    fn reordered(&self, pick: &mut impl FnMut() -> usize) -> M {
        fn rotate<T: Clone>(v: &[T], by: usize) -> Vec<T> {
            let mut v = v.to_vec();
            if !v.is_empty() {
                let n = v.len();
                v.rotate_left(by % n);
                if by % 2 == 1 {
                    v.reverse();
                }
            }
            v
        }
        match self {
            M::Newtype(x) => M::Newtype(Box::new(x.reordered(pick))),
            M::Some(x) => M::Some(Box::new(x.reordered(pick))),
            M::NewtypeVariant(n, x) => M::NewtypeVariant(n, Box::new(x.reordered(pick))),
            M::Seq(v) => M::Seq(v.iter().map(|x| x.reordered(pick)).collect()),
            M::Tuple(v) => M::Tuple(v.iter().map(|x| x.reordered(pick)).collect()),
            M::TupleStruct(v) => M::TupleStruct(v.iter().map(|x| x.reordered(pick)).collect()),
            M::TupleVariant(n, v) => {
                M::TupleVariant(n, v.iter().map(|x| x.reordered(pick)).collect())
            }
            M::Set(v) => {
                let inner: Vec<M> = v.iter().map(|x| x.reordered(pick)).collect();
                M::Set(rotate(&inner, pick()))
            }
            M::StrMap(v) => {
                let inner: Vec<_> = v
                    .iter()
                    .map(|(k, x)| (k.clone(), x.reordered(pick)))
                    .collect();
                M::StrMap(rotate(&inner, pick()))
            }
            M::IntMap(v) => {
                // A map of unknown length (what `#[serde(flatten)]` writes): a
                // repeated key comes from two sources, and which value came
                // first is part of the value, so only distinct keys move.
                let mut inner: Vec<_> = v.iter().map(|(k, x)| (*k, x.reordered(pick))).collect();
                let by = pick() as i64;
                inner.sort_by_key(|(k, _)| k.wrapping_add(by) % 3);
                M::IntMap(inner)
            }
            M::AnyMap(v) => {
                let inner: Vec<_> = v
                    .iter()
                    .map(|(k, x)| (k.reordered(pick), x.reordered(pick)))
                    .collect();
                M::AnyMap(rotate(&inner, pick()))
            }
            M::Struct(v) => {
                let inner: Vec<_> = v.iter().map(|(k, x)| (*k, x.reordered(pick))).collect();
                M::Struct(rotate(&inner, pick()))
            }
            M::StructVariant(n, v) => {
                let inner: Vec<_> = v.iter().map(|(k, x)| (*k, x.reordered(pick))).collect();
                M::StructVariant(n, rotate(&inner, pick()))
            }
            other => other.clone(),
        }
    }
}

/// Field and variant names, with characters JSON escapes and non-ASCII ones.
const NAMES: &[&str] = &[
    "a", "b", "amount", "z", "a b", "a!", "é", "\"q", "\\", "\n", "\u{1}", "", "😀", "\u{7f}",
];

fn name() -> impl Strategy<Value = &'static str> {
    prop::sample::select(NAMES)
}

fn string() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-c \"\\\\/]{0,4}",
        "[\\x00-\\x1f\\x7f]{0,3}",
        "[é€😀\u{2028}\u{fffd}a]{0,3}",
        any::<String>(),
    ]
}

fn finite_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(-0.0),
        Just(0.1),
        Just(1e300),
        Just(f64::MIN_POSITIVE / 4.0),
        Just(f64::MAX),
        any::<f64>().prop_filter("finite", |v| v.is_finite()),
    ]
}

fn finite_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(0.1f32),
        Just(-0.0f32),
        Just(f32::MAX),
        any::<f32>().prop_filter("finite", |v| v.is_finite()),
    ]
}

fn any_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(f64::NAN),
        Just(-f64::NAN),
        finite_f64(),
    ]
}

/// Scalars v1 writes faithfully.
fn faithful_leaf() -> impl Strategy<Value = M> {
    prop_oneof![
        Just(M::Unit),
        Just(M::UnitStruct),
        Just(M::None),
        any::<bool>().prop_map(M::Bool),
        any::<i64>().prop_map(M::I64),
        any::<u64>().prop_map(M::U64),
        any::<i64>().prop_map(|v| M::I128(v.into())),
        any::<u64>().prop_map(|v| M::U128(v.into())),
        finite_f64().prop_map(M::F64),
        finite_f32().prop_map(M::F32),
        string().prop_map(M::Str),
        any::<char>().prop_map(M::Char),
        prop::collection::vec(any::<u8>(), 0..4).prop_map(M::Bytes),
        name().prop_map(M::UnitVariant),
    ]
}

/// Map keys v1 accepts, all of one kind per map so their texts are distinct.
fn faithful_keys() -> impl Strategy<Value = Vec<M>> {
    prop_oneof![
        prop::collection::btree_set(any::<bool>(), 0..3)
            .prop_map(|s| s.into_iter().map(M::Bool).collect()),
        prop::collection::btree_set(any::<char>(), 0..3)
            .prop_map(|s| s.into_iter().map(M::Char).collect()),
        prop::collection::btree_set(any::<u128>(), 0..3)
            .prop_map(|s| s.into_iter().map(M::U128).collect()),
        prop::collection::btree_set(any::<i128>(), 0..3).prop_map(|s| s
            .into_iter()
            .map(|v| M::Newtype(Box::new(M::I128(v))))
            .collect()),
        prop::collection::vec(finite_f64(), 0..3).prop_map(|v| {
            let bits: BTreeSet<u64> = v.into_iter().map(f64::to_bits).collect();
            bits.into_iter()
                .map(|b| M::F64(f64::from_bits(b)))
                .collect()
        }),
        prop::collection::vec(finite_f32(), 0..3).prop_map(|v| {
            let bits: BTreeSet<u32> = v.into_iter().map(f32::to_bits).collect();
            bits.into_iter()
                .map(|b| M::F32(f32::from_bits(b)))
                .collect()
        }),
        prop::sample::subsequence(NAMES, 0..4)
            .prop_map(|v| v.into_iter().map(M::UnitVariant).collect()),
    ]
}

fn shuffled<T: Clone + std::fmt::Debug>(
    v: impl Strategy<Value = Vec<T>>,
) -> impl Strategy<Value = Vec<T>> {
    v.prop_shuffle()
}

/// Struct fields: distinct names, in any order.
fn fields_of(inner: BoxedStrategy<M>) -> impl Strategy<Value = Vec<(&'static str, M)>> {
    shuffled(
        prop::sample::subsequence(NAMES, 0..5)
            .prop_flat_map(move |names| {
                let n = names.len();
                (Just(names), prop::collection::vec(inner.clone(), n))
            })
            .prop_map(|(names, values)| names.into_iter().zip(values).collect::<Vec<_>>()),
    )
}

/// Values v1 represented faithfully: v2 must write exactly v1's bytes for them.
fn faithful() -> impl Strategy<Value = M> {
    faithful_leaf().prop_recursive(4, 48, 5, |inner| {
        let fields = fields_of(inner.clone());
        let fields_for_variant = fields_of(inner.clone());
        let inner = inner.clone();
        prop_oneof![
            inner.clone().prop_map(|x| M::Newtype(Box::new(x))),
            inner
                .clone()
                .prop_filter("not null-like", |x| !x.null_like())
                .prop_map(|x| M::Some(Box::new(x))),
            prop::collection::vec(inner.clone(), 0..4).prop_map(M::Seq),
            prop::collection::vec(inner.clone(), 0..4).prop_map(M::Tuple),
            prop::collection::vec(inner.clone(), 0..4).prop_map(M::TupleStruct),
            prop::collection::vec(inner.clone(), 0..2).prop_map(M::Set),
            shuffled(
                prop::collection::btree_map(string(), inner.clone(), 0..4)
                    .prop_map(|m| m.into_iter().collect())
            )
            .prop_map(M::StrMap),
            shuffled(
                prop::collection::btree_map(any::<i64>(), inner.clone(), 0..4)
                    .prop_map(|m| m.into_iter().collect())
            )
            .prop_map(M::IntMap),
            shuffled(faithful_keys().prop_flat_map(move |keys| {
                let n = keys.len();
                (Just(keys), prop::collection::vec(inner.clone(), n))
                    .prop_map(|(k, v)| k.into_iter().zip(v).collect::<Vec<_>>())
            }))
            .prop_map(M::AnyMap),
            fields.prop_map(M::Struct),
            (name(), prop::collection::vec(faithful_leaf(), 0..3))
                .prop_map(|(n, v)| M::TupleVariant(n, v)),
            (name(), faithful_leaf()).prop_map(|(n, v)| M::NewtypeVariant(n, Box::new(v))),
            (name(), fields_for_variant).prop_map(|(n, v)| M::StructVariant(n, v)),
        ]
    })
}

/// Anything: non-finite floats, `Some` of null-likes, sets of any size, maps
/// with repeated keys and keys of any shape, integers beyond 64 bits.
fn wide() -> impl Strategy<Value = M> {
    let leaf = prop_oneof![
        4 => faithful_leaf(),
        1 => any_f64().prop_map(M::F64),
        1 => prop_oneof![Just(f32::INFINITY), Just(f32::NEG_INFINITY), Just(f32::NAN)].prop_map(M::F32),
        1 => any::<u128>().prop_map(M::U128),
        1 => any::<i128>().prop_map(M::I128),
    ];
    leaf.prop_recursive(4, 48, 5, |inner| {
        prop_oneof![
            inner.clone().prop_map(|x| M::Newtype(Box::new(x))),
            inner.clone().prop_map(|x| M::Some(Box::new(x))),
            prop::collection::vec(inner.clone(), 0..4).prop_map(M::Seq),
            prop::collection::vec(inner.clone(), 0..4).prop_map(M::Tuple),
            prop::collection::vec(inner.clone(), 0..5).prop_map(M::Set),
            // Repeated keys are likely with this alphabet.
            prop::collection::vec(("[ab1]{0,1}", inner.clone()), 0..4).prop_map(M::StrMap),
            prop::collection::vec((0i64..3, inner.clone()), 0..4).prop_map(M::IntMap),
            prop::collection::vec((inner.clone(), inner.clone()), 0..4).prop_map(M::AnyMap),
            // A struct's field names are distinct, as in Rust (repeated names
            // are flatten's, written in declaration order: see the tests below).
            fields_of(inner.clone().boxed()).prop_map(M::Struct),
            (name(), prop::collection::vec(inner.clone(), 0..3))
                .prop_map(|(n, v)| M::TupleVariant(n, v)),
            (name(), inner.clone()).prop_map(|(n, v)| M::NewtypeVariant(n, Box::new(v))),
            (name(), fields_of(inner.clone().boxed())).prop_map(|(n, v)| M::StructVariant(n, v)),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Compatibility: where v1 was faithful, v2 writes v1's bytes and label.
    #[test]
    fn v2_writes_v1_bytes_where_v1_was_faithful(m in faithful()) {
        let (bytes, extended) = canonical(&m);
        prop_assert_eq!(&bytes, &reference(&m).unwrap());
        prop_assert!(!extended, "needed no extension: {}", bytes);
        let f = fp(&m);
        prop_assert_eq!(f.as_str(), v1::of(&m).unwrap());
        prop_assert_eq!(f.version(), "v1");
        prop_assert!(f.legacy().is_none());
    }

    /// The legacy form is exactly v1, lossy parts and refusals included, and
    /// `legacy()` is the fingerprint v1 made.
    #[test]
    fn legacy_form_is_exactly_v1(m in wide()) {
        match (legacy(&m), reference(&m)) {
            (Ok(ours), Ok(theirs)) => prop_assert_eq!(ours, theirs),
            (Err(_), Err(_)) => {}
            (ours, theirs) => prop_assert!(false, "legacy {:?} but v1 {:?}", ours, theirs),
        }
        let f = fp(&m);
        let old = v1::of(&m);
        if f.version() == "v1" {
            prop_assert_eq!(f.as_str(), old.unwrap());
            prop_assert!(f.legacy().is_none());
        } else {
            prop_assert_eq!(f.version(), "v2");
            // A legacy exists only where v1 was not lossy; when it does, it is v1's.
            if let Some(l) = f.legacy() {
                prop_assert_eq!(Some(l.as_str().to_owned()), old.ok());
            }
        }
    }

    /// Sets and maps in any order give the same bytes.
    #[test]
    fn v2_ignores_set_and_map_order(m in wide(), seed in any::<u64>()) {
        let mut state = seed;
        let mut pick = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize
        };
        let other = m.reordered(&mut pick);
        prop_assert_eq!(canonical(&m), canonical(&other));
        prop_assert_eq!(fp(&m), fp(&other));
    }

    /// Rule 12's check refuses exactly the values with a non-finite float or
    /// a `Some` of a value written as `null`.
    #[test]
    fn faithful_check_refuses_exactly_non_finite_floats(m in wide()) {
        let verdict = check_faithful_json(&m);
        prop_assert_eq!(verdict.is_err(), m.has_non_finite_value(), "{:?}", verdict);
        if let Err(message) = verdict {
            prop_assert!(
                message.contains("non-finite float") || message.contains("replay as `None`"),
                "{}", message
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Bug 1: order-dependent serializations

proptest! {
    #[test]
    fn equal_hash_sets_fingerprint_equal(items in prop::collection::vec("[a-z]{0,4}", 0..12)) {
        let forward: HashSet<String> = items.iter().cloned().collect();
        let backward: HashSet<String> = items.iter().rev().cloned().collect();
        prop_assert_eq!(fp(&forward), fp(&backward));
        let mut bigger = forward.clone();
        if bigger.insert("new!".to_owned()) {
            prop_assert_ne!(fp(&forward), fp(&bigger));
        }
    }

    #[test]
    fn equal_hash_maps_with_any_key_type_fingerprint_equal(
        entries in prop::collection::vec(((any::<u8>(), any::<u8>()), any::<i32>()), 0..12)
    ) {
        let forward: HashMap<(u8, u8), i32> = entries.iter().cloned().collect();
        let backward: HashMap<(u8, u8), i32> = forward.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>().into_iter().rev().collect();
        prop_assert_eq!(fp(&forward), fp(&backward));
        let tree: BTreeMap<(u8, u8), i32> = forward.iter().map(|(k, v)| (*k, *v)).collect();
        prop_assert_eq!(fp(&forward), fp(&tree));
    }

    #[test]
    fn nested_unordered_collections_fingerprint_equal(
        entries in prop::collection::vec(("[a-c]{1,2}", prop::collection::vec(any::<i8>(), 0..4)), 0..6)
    ) {
        let build = |rev: bool| -> HashMap<String, HashSet<Vec<i8>>> {
            let mut m: HashMap<String, HashSet<Vec<i8>>> = HashMap::new();
            let mut items = entries.clone();
            if rev {
                items.reverse();
            }
            for (k, v) in items {
                m.entry(k).or_default().insert(v);
            }
            m
        };
        prop_assert_eq!(fp(&build(false)), fp(&build(true)));
    }

    #[test]
    fn binary_heaps_with_equal_elements_fingerprint_equal(items in prop::collection::vec(any::<u16>(), 0..16)) {
        let a: BinaryHeap<u16> = items.iter().copied().collect();
        let mut sorted = items.clone();
        sorted.sort_unstable();
        let b: BinaryHeap<u16> = sorted.into_iter().collect();
        prop_assert_eq!(fp(&a), fp(&b));
    }

    #[test]
    fn map_iteration_order_does_not_matter(entries in proptest::collection::vec(("[a-z]{0,6}", any::<i64>()), 0..20)) {
        let hash: HashMap<String, i64> = entries.iter().cloned().collect();
        let tree: BTreeMap<String, i64> = entries.iter().cloned().collect();
        let mut rev: Vec<(String, i64)> = tree.clone().into_iter().collect();
        rev.reverse();
        // A HashMap built in reverse order iterates differently but is the same value.
        let hash_rev: HashMap<String, i64> = rev.into_iter().collect();
        let f1 = fp(&hash);
        prop_assert_eq!(&f1, &fp(&tree));
        prop_assert_eq!(&f1, &fp(&hash_rev));
        prop_assert_eq!(f1.version(), "v1");
    }
}

#[test]
fn unordered_collections_are_recognised_by_type_name() {
    fn name_of<T: ?Sized>(_: &T) -> &'static str {
        std::any::type_name::<T>()
    }
    let set: HashSet<u8> = HashSet::new();
    let heap: BinaryHeap<u8> = BinaryHeap::new();
    assert!(is_unordered(name_of(&&set)));
    assert!(is_unordered(name_of(&&heap)));
    assert!(is_unordered(
        "&indexmap::set::IndexSet<alloc::string::String>"
    ));
    assert!(is_unordered(
        "&hashbrown::set::HashSet<u8, foldhash::fast::RandomState>"
    ));
    assert!(is_unordered("&mut dashmap::set::DashSet<u8>"));
    assert!(is_unordered(
        "std::collections::hash::set::HashSet<alloc::vec::Vec<u8>>"
    ));
    for ordered in [
        name_of(&&Vec::<HashSet<u8>>::new()),
        name_of(&&BTreeSet::<u8>::new()),
        name_of(&&std::collections::VecDeque::<u8>::new()),
        name_of(&&[0u8; 3]),
        name_of(&&[0u8][..]),
        "&std::iter::Map<std::collections::hash::set::Iter<u8>, F>",
        "&my::HashSetLike<u8>",
        // Slices, arrays and tuples of sets keep their order (a slice of
        // sets was taken for a set: two orders shared a fingerprint).
        name_of(&&[HashSet::<u8>::new()][..]),
        name_of(&[HashSet::<u8>::new()]),
        "&[(std::collections::hash::set::HashSet<u8>, alloc::string::String)]",
        "&mut [std::collections::hash::set::HashSet<u8>]",
        "(std::collections::hash::set::HashSet<u8>,)",
    ] {
        assert!(!is_unordered(ordered), "{ordered}");
    }
}

#[test]
fn a_slice_of_sets_keeps_its_order() {
    let (one, two): (HashSet<u8>, HashSet<u8>) = ([1].into(), [2].into());
    let forward = [one.clone(), two.clone()];
    let backward = [two, one];
    assert_ne!(fp(&forward[..]), fp(&backward[..]));
    assert_ne!(
        fp(&Box::<[HashSet<u8>]>::from(forward.clone())),
        fp(&Box::<[HashSet<u8>]>::from(backward.clone()))
    );
    assert_ne!(fp(&forward), fp(&backward));
}

#[test]
fn a_single_element_set_and_a_btree_set_stay_v1() {
    let one: HashSet<&str> = ["x"].into();
    assert_eq!(canonical(&one), (r#"["x"]"#.to_owned(), false));
    let tree: BTreeSet<i32> = [3, -1, 20].into();
    assert_eq!(canonical(&tree), ("[-1,3,20]".to_owned(), false));
    let empty: HashSet<u8> = HashSet::new();
    assert_eq!(canonical(&empty), ("[]".to_owned(), false));
}

#[test]
fn tuple_keyed_map_is_fingerprinted_now() {
    let mut m = HashMap::new();
    m.insert((1u8, 2u8), 3u8);
    m.insert((0u8, 9u8), 4u8);
    let f = fp(&m);
    assert_eq!(f.version(), "v2");
    assert!(
        f.legacy().is_none(),
        "v1 could not write it, so no v1 record exists"
    );
    assert_eq!(v2(&m), "{[0,9]:4,[1,2]:3}");
    let mut other = m.clone();
    other.insert((0, 9), 5);
    assert_ne!(f, fp(&other));
}

#[derive(Serialize, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
#[serde(untagged)]
enum LooseKey {
    Number(u8),
    Text(String),
    Pair(u8, u8),
}

#[test]
fn a_structured_key_never_meets_a_string_key_of_the_same_text() {
    let text = HashMap::from([(LooseKey::Text("[1,2]".into()), 0u8)]);
    let pair = HashMap::from([(LooseKey::Pair(1, 2), 0u8)]);
    assert_eq!(v2(&text), r#"{"[1,2]":0}"#);
    assert_eq!(v2(&pair), "{[1,2]:0}");
    assert_ne!(fp(&text), fp(&pair));
    // v1 keys sort before the others, each kind by its own text.
    let both: HashMap<LooseKey, u8> = [
        (LooseKey::Pair(1, 2), 1),
        (LooseKey::Text("b".into()), 2),
        (LooseKey::Number(7), 3),
    ]
    .into();
    assert_eq!(v2(&both), r#"{"7":3,"b":2,[1,2]:1}"#);
}

fn loose(k: &LooseKey) -> M {
    match k {
        LooseKey::Number(n) => M::U64((*n).into()),
        LooseKey::Text(t) => M::Str(t.clone()),
        LooseKey::Pair(a, b) => M::Tuple(vec![M::U64((*a).into()), M::U64((*b).into())]),
    }
}

#[test]
fn a_number_key_and_a_string_key_with_the_same_text_are_both_kept() {
    let a: HashMap<LooseKey, &str> = [
        (LooseKey::Number(1), "n"),
        (LooseKey::Text("1".into()), "t"),
    ]
    .into();
    let b: HashMap<LooseKey, &str> = [
        (LooseKey::Number(1), "t"),
        (LooseKey::Text("1".into()), "n"),
    ]
    .into();
    // Same key text: members in the order of their v1 bytes (`"1":"n"` < `"1":"t"`).
    assert_eq!(v2(&a), r#"{1:"n","1":"t"}"#);
    assert_eq!(v2(&b), r#"{"1":"n",1:"t"}"#);
    assert_ne!(fp(&a), fp(&b));
    assert_eq!(fp(&a).version(), "v2");
    // v1 kept one of the two (whichever came last): lossy, so no legacy.
    assert!(fp(&a).legacy().is_none());
    // Same key text and same value: still one order, whatever the arrival order.
    let same = |first: LooseKey, second: LooseKey| {
        let mut m = BTreeMap::new();
        m.insert(first, 0u8);
        m.insert(second, 0u8);
        // BTreeMap iterates in key order; serialize its entries both ways round.
        let entries: Vec<(LooseKey, u8)> = m.into_iter().collect();
        let forward = M::AnyMap(
            entries
                .iter()
                .map(|(k, v)| (loose(k), M::U64((*v).into())))
                .collect(),
        );
        let backward = M::AnyMap(
            entries
                .iter()
                .rev()
                .map(|(k, v)| (loose(k), M::U64((*v).into())))
                .collect(),
        );
        (v2(&forward), v2(&backward))
    };
    let (forward, backward) = same(LooseKey::Number(1), LooseKey::Text("1".into()));
    assert_eq!(forward, r#"{"1":0,1:0}"#);
    assert_eq!(forward, backward);
    // Alone in a map, the number key is written as v1 wrote it.
    let alone: HashMap<LooseKey, &str> = [(LooseKey::Number(1), "n")].into();
    assert_eq!(canonical(&alone), (r#"{"1":"n"}"#.to_owned(), false));
}

/// A struct with a flattened map: serde writes it as a map of unknown length,
/// the struct's own fields and the map's entries together.
#[derive(Serialize, Clone, Debug)]
struct WithExtras {
    amount: u32,
    #[serde(flatten)]
    extras: HashMap<String, u32>,
    #[serde(flatten)]
    labels: HashMap<u32, u32>,
}

#[test]
fn a_field_and_a_flattened_entry_with_the_same_name_are_not_interchangeable() {
    let request = |amount, extra| WithExtras {
        amount,
        extras: HashMap::from([("amount".to_owned(), extra), ("note".to_owned(), 9)]),
        labels: HashMap::new(),
    };
    // The same two numbers, but which is the field and which the extra differs.
    let (a, b) = (request(1, 2), request(2, 1));
    assert_ne!(fp(&a), fp(&b), "{} vs {}", v2(&a), v2(&b));
    assert_eq!(v2(&a), r#"{"amount":1,"amount":2,"note":9}"#);
    assert_eq!(fp(&a), fp(&request(1, 2)));
    // Two flattened maps holding one key text (a string key and a number key).
    let labelled = |text, number| WithExtras {
        amount: 0,
        extras: HashMap::from([("7".to_owned(), text)]),
        labels: HashMap::from([(7, number)]),
    };
    assert_ne!(fp(&labelled(1, 2)), fp(&labelled(2, 1)));
}

/// A key type with two values of one text (both written as the string "x").
#[derive(Serialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(untagged)]
enum SameTextKey {
    Name(String),
    Code(String),
}

#[derive(Serialize, Clone, Debug)]
struct FieldAndSameTextKeys {
    x: u32,
    #[serde(flatten)]
    extras: HashMap<SameTextKey, u32>,
}

/// Equal values, maps iterated in another order: a field "x" beside a
/// flattened map holding two keys written "x". The field and the map are two
/// sources, in their written order; the map's two entries are one source,
/// ordered by their bytes, not by the map's iteration order.
#[test]
fn iteration_order_does_not_count_beside_a_field_of_the_same_name() {
    let entries = [
        (SameTextKey::Name("x".into()), 1u32),
        (SameTextKey::Code("x".into()), 2u32),
    ];
    let order = |m: &HashMap<SameTextKey, u32>| m.values().copied().collect::<Vec<_>>();
    let first: HashMap<_, _> = entries.iter().cloned().collect();
    // Another map (other hasher keys) with the same entries, iterated the other way.
    let other = (0..1000)
        .map(|_| entries.iter().cloned().rev().collect::<HashMap<_, _>>())
        .find(|m| order(m) != order(&first))
        .expect("some hasher iterates the two keys the other way");
    assert_eq!(first, other, "equal maps");
    let a = FieldAndSameTextKeys {
        x: 0,
        extras: first,
    };
    let b = FieldAndSameTextKeys {
        x: 0,
        extras: other,
    };
    assert_eq!(fp(&a), fp(&b), "equal values: {} vs {}", v2(&a), v2(&b));
    assert_eq!(v2(&a), r#"{"x":0,"x":1,"x":2}"#);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// The flattened maps' own iteration order still does not count, with or
    /// without a key that repeats a field's name.
    #[test]
    fn flattened_maps_fingerprint_equal_in_any_iteration_order(
        amount in any::<u32>(),
        extras in prop::collection::vec(("(amount|a|b|c|[0-9])", any::<u32>()), 0..8),
        labels in prop::collection::vec((0u32..10, any::<u32>()), 0..8),
    ) {
        let mut e1 = HashMap::new();
        let mut l1 = HashMap::new();
        for (k, v) in &extras {
            e1.entry(k.clone()).or_insert(*v);
        }
        for (k, v) in &labels {
            l1.entry(*k).or_insert(*v);
        }
        // The same entries, inserted the other way round into maps of another
        // capacity (and hasher keys): another iteration order.
        let mut e2 = HashMap::with_capacity(64);
        let mut l2 = HashMap::with_capacity(64);
        for (k, v) in e1.iter().collect::<Vec<_>>().into_iter().rev() {
            e2.insert(k.clone(), *v);
        }
        for (k, v) in l1.iter().collect::<Vec<_>>().into_iter().rev() {
            l2.insert(*k, *v);
        }
        let one = WithExtras { amount, extras: e1, labels: l1 };
        let other = WithExtras { amount, extras: e2, labels: l2 };
        prop_assert_eq!(fp(&one), fp(&other));
    }
}

// ---------------------------------------------------------------------------
// Bug 2: values that collided

#[test]
fn infinities_nan_and_none_are_four_values() {
    let values = [
        None,
        Some(f64::INFINITY),
        Some(f64::NEG_INFINITY),
        Some(f64::NAN),
        Some(0.0),
        Some(-0.0),
    ];
    let prints: Vec<Fingerprint> = values.iter().map(fp).collect();
    for (i, a) in prints.iter().enumerate() {
        for (j, b) in prints.iter().enumerate() {
            assert_eq!(i == j, a == b, "{:?} vs {:?}", values[i], values[j]);
        }
    }
    // Every NaN is one value.
    assert_eq!(fp(&f64::NAN), fp(&-f64::NAN));
    assert_eq!(fp(&f32::NAN), fp(&f64::NAN));
    assert_eq!(fp(&f32::INFINITY), fp(&f64::INFINITY));
}

#[test]
fn nested_options_and_units_are_distinct() {
    let units = [fp(&None::<()>), fp(&Some(()))];
    assert_ne!(units[0], units[1]);
    let nested = [
        fp(&None::<Option<Option<u8>>>),
        fp(&Some(None::<Option<u8>>)),
        fp(&Some(Some(None::<u8>))),
        fp(&Some(Some(Some(0u8)))),
    ];
    for i in 0..nested.len() {
        for j in i + 1..nested.len() {
            assert_ne!(nested[i], nested[j], "{i} vs {j}");
        }
    }
    #[derive(Serialize)]
    struct Empty;
    #[derive(Serialize)]
    struct Wrapper(Option<u8>);
    assert_ne!(fp(&None::<Empty>), fp(&Some(Empty)));
    assert_ne!(fp(&None::<Wrapper>), fp(&Some(Wrapper(None))));
    // `Some(x)` with a non-null `x` is still written as v1 wrote it.
    assert_eq!(canonical(&Some(Some(5u8))), ("5".to_owned(), false));
}

#[derive(Serialize, Debug, Clone)]
enum Kind {
    A,
    B(u8),
    C(u8, f64),
    D { x: Option<f32> },
}

#[derive(Serialize, Debug, Clone)]
struct Order {
    tags: HashSet<String>,
    limits: HashMap<(u8, u8), Option<f64>>,
    price: Option<Option<f64>>,
    unit: Option<()>,
    kind: Kind,
}

/// `Order` with every unordered part ordered and NaN made comparable.
fn normal(o: &Order) -> impl PartialEq + std::fmt::Debug {
    fn bits(v: f64) -> u64 {
        if v.is_nan() {
            f64::NAN.to_bits()
        } else {
            v.to_bits()
        }
    }
    let kind = match &o.kind {
        Kind::A => (0, 0, 0, None),
        Kind::B(b) => (1, *b, 0, None),
        Kind::C(b, v) => (2, *b, bits(*v), None),
        Kind::D { x } => (3, 0, 0, Some(x.map(|v| bits(v.into())))),
    };
    (
        o.tags.iter().cloned().collect::<BTreeSet<_>>(),
        o.limits
            .iter()
            .map(|(k, v)| (*k, v.map(bits)))
            .collect::<BTreeMap<_, _>>(),
        o.price.map(|p| p.map(bits)),
        o.unit,
        kind,
    )
}

fn small_f64() -> impl Strategy<Value = f64> {
    prop::sample::select(vec![
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        0.0,
        -0.0,
        1.5,
    ])
}

fn order() -> impl Strategy<Value = Order> {
    let kind = prop_oneof![
        Just(Kind::A),
        (0u8..2).prop_map(Kind::B),
        (0u8..2, small_f64()).prop_map(|(b, v)| Kind::C(b, v)),
        prop::option::of(small_f64().prop_map(|v| v as f32)).prop_map(|x| Kind::D { x }),
    ];
    (
        prop::collection::hash_set(prop::sample::select(vec!["a", "b", "c"]), 0..3),
        prop::collection::hash_map((0u8..2, 0u8..2), prop::option::of(small_f64()), 0..3),
        prop::option::of(prop::option::of(small_f64())),
        prop::option::of(Just(())),
        kind,
    )
        .prop_map(|(tags, limits, price, unit, kind)| Order {
            tags: tags.into_iter().map(str::to_owned).collect(),
            limits,
            price,
            unit,
            kind,
        })
}

/// The same value, every collection rebuilt (new hasher state, other order).
fn rebuilt(o: &Order) -> Order {
    let mut tags: Vec<String> = o.tags.iter().cloned().collect();
    tags.reverse();
    let mut limits: Vec<_> = o.limits.iter().map(|(k, v)| (*k, *v)).collect();
    limits.reverse();
    Order {
        tags: tags.into_iter().collect(),
        limits: limits.into_iter().collect(),
        ..o.clone()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// Fingerprints are equal exactly when the values are.
    #[test]
    fn any_change_of_a_value_changes_the_fingerprint(a in order(), other in order(), same in any::<bool>()) {
        let b = if same { rebuilt(&a) } else { other };
        prop_assert_eq!(fp(&a) == fp(&b), normal(&a) == normal(&b), "{:?} vs {:?}", a, b);
    }

    #[test]
    fn any_struct_field_change_changes_the_fingerprint(
        x in any::<u32>(), y in ".{0,12}", dx in 1u32.., other in ".{0,12}"
    ) {
        let base = fp(&A { x, y: y.clone() });
        prop_assert_ne!(&base, &fp(&A { x: x.wrapping_add(dx), y: y.clone() }));
        if other != y {
            prop_assert_ne!(&base, &fp(&A { x, y: other }));
        }
    }

    #[test]
    fn argument_names_and_split_matter(a in any::<i32>(), b in any::<i32>()) {
        let mut one = FingerprintBuilder::new();
        one.argument("a", &a);
        one.argument("b", &b);
        let mut swapped = FingerprintBuilder::new();
        swapped.argument("a", &b);
        swapped.argument("b", &a);
        let one = one.finish().unwrap();
        if a != b {
            prop_assert_ne!(one, swapped.finish().unwrap());
        }
    }
}

// ---------------------------------------------------------------------------
// Known values

#[derive(Serialize)]
struct A {
    x: u32,
    y: String,
}
#[derive(Serialize)]
struct B {
    y: String,
    x: u32,
}

#[test]
fn field_order_does_not_matter() {
    let a = fp(&A {
        x: 1,
        y: "z".into(),
    });
    let b = fp(&B {
        y: "z".into(),
        x: 1,
    });
    assert_eq!(a, b);
    assert_eq!(a.version(), "v1");
}

#[test]
fn known_value_is_stable_across_builds() {
    // Pinned: if this changes, the canonical form changed and needs a new version.
    let f = fp(&A {
        x: 1,
        y: "z".into(),
    });
    let mut h = Sha256::new();
    h.update(br#"{"value":{"x":1,"y":"z"}}"#);
    assert_eq!(f.as_str(), format!("v1:{}", hex::encode(h.finalize())));
}

#[test]
fn v1_known_values() {
    #[derive(Serialize)]
    enum E {
        Unit,
        New(i8),
        Tuple(u8, bool),
        Struct { b: (), a: char },
    }
    #[derive(Serialize)]
    struct Everything {
        float: f64,
        single: f32,
        neg_zero: f64,
        big: f64,
        text: &'static str,
        bytes: serde_bytes_like::Bytes,
        map: BTreeMap<u32, &'static str>,
        f32_keys: BTreeMap<u8, ()>,
        e: Vec<E>,
        wide: i128,
    }
    mod serde_bytes_like {
        pub struct Bytes(pub &'static [u8]);
        impl serde::Serialize for Bytes {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(self.0)
            }
        }
    }
    let value = Everything {
        float: 0.1,
        single: 0.1,
        neg_zero: -0.0,
        big: 1e300,
        text: "a\"\\\n\u{1}é😀\u{7f}",
        bytes: serde_bytes_like::Bytes(&[0, 255]),
        map: [(10, "x"), (9, "y")].into(),
        f32_keys: [(1, ())].into(),
        e: vec![
            E::Unit,
            E::New(-1),
            E::Tuple(2, true),
            E::Struct { b: (), a: 'c' },
        ],
        wide: -5,
    };
    let expected = concat!(
        r#"{"big":1e+300,"bytes":[0,255],"e":["Unit",{"New":-1},{"Tuple":[2,true]},{"Struct":{"a":"c","b":null}}],"#,
        r#""f32_keys":{"1":null},"float":0.1,"map":{"10":"x","9":"y"},"neg_zero":-0.0,"#,
        r#""single":0.10000000149011612,"text":"a\"\\\n\u0001é😀"#,
        "\u{7f}",
        r#"","wide":-5}"#
    );
    assert_eq!(reference(&value).unwrap(), expected);
    assert_eq!(canonical(&value), (expected.to_owned(), false));
    // serde_json widens f32 values (not f32 keys).
    let keys: BTreeMap<String, f32> = [("k".into(), 0.1)].into();
    assert_eq!(v2(&keys), r#"{"k":0.10000000149011612}"#);
    assert_eq!(v2(&HashMap::from([(OrderedF32(0.1), 1u8)])), r#"{"0.1":1}"#);
    assert_eq!(
        reference(&HashMap::from([(OrderedF32(0.1), 1u8)])).unwrap(),
        r#"{"0.1":1}"#
    );
}

/// An f32 map key (f32 is not `Hash`).
#[derive(PartialEq)]
struct OrderedF32(f32);
impl Eq for OrderedF32 {}
impl std::hash::Hash for OrderedF32 {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state)
    }
}
impl Serialize for OrderedF32 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f32(self.0)
    }
}

/// Rule 6: a float's text in the canonical form is fixed, whatever
/// serde_json the build resolves (`serde_json = "1"` admits any 1.x).
/// serde_json wrote positive exponents without a sign up to 1.0.146 (ryu:
/// `1e17`) and with one from 1.0.147 on (zmij: `1e+17`); the canonical form
/// keeps the second (what records stored so far carry), so a dependency
/// update is not a new canonical form that turns every retry of such a call
/// into a mismatch. Values, map keys, `f32` (widened and as keys), legacy
/// (v1) form alike.
#[test]
fn float_text_is_the_same_whatever_serde_json_writes() {
    assert_eq!(v2(&1e17), "1e+17");
    assert_eq!(v2(&-1.2345678901234568e17), "-1.2345678901234568e+17");
    assert_eq!(v2(&f64::MAX), "1.7976931348623157e+308");
    assert_eq!(v2(&1e16f32), "1.0000000272564224e+16");
    assert_eq!(v2(&1e15), "1000000000000000.0");
    assert_eq!(v2(&1e-7), "1e-7");
    assert_eq!(v2(&5e-324), "5e-324");
    assert_eq!(v2(&1.5), "1.5");
    assert_eq!(
        v2(&HashMap::from([(OrderedF32(3e30), 1u8)])),
        r#"{"3e+30":1}"#
    );
    assert_eq!(
        v2(&HashMap::from([(OrderedF64(-1e21), 1u8)])),
        r#"{"-1e+21":1}"#
    );
    assert_eq!(legacy(&vec![1e300, 2.5e-300]).unwrap(), "[1e+300,2.5e-300]");
    assert_eq!(
        fp(&1e17).as_str(),
        format!("v1:{}", sha(r#"{"value":1e+17}"#))
    );
}

/// An f64 map key (f64 is not `Hash`).
#[derive(PartialEq)]
struct OrderedF64(f64);
impl Eq for OrderedF64 {}
impl std::hash::Hash for OrderedF64 {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state);
    }
}
impl Serialize for OrderedF64 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.0)
    }
}

#[test]
fn v2_known_values() {
    // Pinned: if one of these changes, v2 changed and needs a new version.
    let set: HashSet<&str> = ["b", "a", "c"].into();
    assert_eq!(canonical(&set), (r#"["a","b","c"]"#.to_owned(), true));
    assert_eq!(v2(&f64::INFINITY), "inf");
    assert_eq!(v2(&f64::NEG_INFINITY), "-inf");
    assert_eq!(v2(&f64::NAN), "nan");
    assert_eq!(v2(&f32::NEG_INFINITY), "-inf");
    assert_eq!(v2(&Some(None::<u8>)), "?null");
    assert_eq!(v2(&Some(Some(None::<u8>))), "??null");
    assert_eq!(v2(&Some(())), "?null");
    assert_eq!(v2(&u128::MAX), "340282366920938463463374607431768211455");
    assert_eq!(v2(&i128::MIN), "-170141183460469231731687303715884105728");
    let keys: HashMap<Option<u8>, u8> = [(None, 1), (Some(2), 3)].into();
    assert_eq!(v2(&keys), "{2:3,null:1}");
    let set_of_sets: HashSet<Vec<i32>> = [vec![10], vec![9, 1], vec![]].into();
    assert_eq!(v2(&set_of_sets), "[[10],[9,1],[]]");

    // One full fingerprint, pinned as a hash.
    #[derive(Serialize)]
    struct Request {
        tags: HashSet<&'static str>,
        ratio: f64,
        limit: Option<Option<u32>>,
    }
    let request = Request {
        tags: ["y", "x"].into(),
        ratio: f64::NEG_INFINITY,
        limit: Some(None),
    };
    let bytes = r#"{"value":{"limit":?null,"ratio":-inf,"tags":["x","y"]}}"#;
    let f = fp(&request);
    assert_eq!(f.as_str(), format!("v2:{}", sha(bytes)));
    assert_eq!(
        f.as_str(),
        "v2:6733dbf2bcd58c6281a1f093f9ace5f0880f85b09ebec34e591c7774ef76f9b8"
    );
}

/// What serde_json's `RawValue` does when serialized.
struct Raw(&'static str);
impl Serialize for Raw {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("$serde_json::private::RawValue", 1)?;
        st.serialize_field("$serde_json::private::RawValue", self.0)?;
        st.end()
    }
}

#[test]
fn raw_json_values_are_canonicalised_as_v1_did() {
    let raw = Raw(r#" { "b" : [1, 2.5, null], "a" : "x" } "#);
    assert_eq!(
        canonical(&raw),
        (r#"{"a":"x","b":[1,2.5,null]}"#.to_owned(), false)
    );
    // serde_json (with `raw_value`, which sqlx turns on) parsed it the same way.
    assert_eq!(reference(&raw).unwrap(), r#"{"a":"x","b":[1,2.5,null]}"#);
}

/// Rule 6: raw JSON text that a `serde_json::Value` cannot hold (a number
/// beyond `f64`'s precision, a repeated member) is an error, never a
/// collision: read as a `Value` (as v1 did), texts that differ in a digit,
/// or in a member the reading drops, were one fingerprint.
#[test]
fn raw_json_a_value_cannot_hold_is_an_error_not_a_collision() {
    for lossy in [
        r#"{"amount":12345678901234567890123}"#,
        "0.10000000000000000001",
        r#"{"to":"alice","to":"mallory"}"#,
        r#"[{"a":{"b":1,"b":2}}]"#,
    ] {
        let refused = Fingerprint::of(&Raw(lossy)).expect_err(lossy).to_string();
        assert!(refused.contains("raw JSON"), "{lossy}: {refused}");
    }
    // What a `Value` holds exactly is fingerprinted as before, spelling aside.
    for (a, b) in [
        ("0.1", " 0.1 "),
        ("1.0", "1.0"),
        (r#"{"b":1.50,"a":[-0.0]}"#, r#"{"a":[-0.0],"b":1.5}"#),
        (r#""é""#, r#""é""#),
        ("12345678901234567890", "12345678901234567890"),
    ] {
        assert_eq!(fp(&Raw(a)), fp(&Raw(b)), "{a} vs {b}");
    }
    assert_ne!(fp(&Raw("0.1")), fp(&Raw("0.2")));
}

// ---------------------------------------------------------------------------
// Legacy

#[test]
fn legacy_is_the_v1_fingerprint_of_the_same_arguments() {
    // Set order: v1 wrote this very set in its iteration order.
    let set: HashSet<u8> = [3, 1, 2].into();
    let sorted = fp(&set);
    assert_eq!(sorted.version(), "v2");
    let legacy = sorted
        .legacy()
        .expect("v1 wrote the set in iteration order");
    assert_eq!(legacy.as_str(), v1::of(&set).unwrap());
    assert_eq!(legacy.version(), "v1");
    assert!(legacy.legacy().is_none());

    // Several arguments: only the extended one is rewritten in v1.
    let mut new = FingerprintBuilder::new();
    let mut old = v1::Builder::default();
    for b in [&mut new as &mut dyn Arguments, &mut old] {
        b.add("amount", &10u32);
        b.add("tags", &set);
    }
    let new = new.finish().unwrap().unwrap();
    assert_eq!(new.version(), "v2");
    assert_eq!(
        new.legacy().unwrap().as_str(),
        old.finish().unwrap().unwrap()
    );

    // Where v1 was lossy its form is shared with another value (`+inf` and
    // `None` both wrote `null`): no legacy, or a new `None` record would
    // replay to `+inf` (rule 7).
    assert_eq!(
        v1::of(&f64::INFINITY).unwrap(),
        fp(&None::<f64>).as_str(),
        "v1's collision"
    );
    assert!(fp(&f64::INFINITY).legacy().is_none());
    assert!(fp(&Some(None::<u8>)).legacy().is_none());
    let mut mixed = FingerprintBuilder::new();
    mixed.argument("tags", &set);
    mixed.argument("ratio", &f64::NAN);
    assert!(mixed.finish().unwrap().unwrap().legacy().is_none());

    // Nothing v1 could write: no legacy.
    assert!(fp(&u128::MAX).legacy().is_none());
    assert!(fp(&HashMap::from([((1u8, 2u8), 3u8)])).legacy().is_none());
    // Nothing extended: no legacy.
    assert!(fp(&1.5f64).legacy().is_none());
}

/// Both builders behind one interface, so a test feeds them the same arguments.
trait Arguments {
    fn add(&mut self, name: &'static str, value: &dyn ErasedValue);
}
trait ErasedValue {
    fn add_to_builder(&self, name: &'static str, b: &mut FingerprintBuilder);
    fn add_to_v1(&self, name: &'static str, b: &mut v1::Builder);
}
impl<T: Serialize> ErasedValue for T {
    fn add_to_builder(&self, name: &'static str, b: &mut FingerprintBuilder) {
        b.argument(name, self);
    }
    fn add_to_v1(&self, name: &'static str, b: &mut v1::Builder) {
        b.argument(name, self);
    }
}
impl Arguments for FingerprintBuilder {
    fn add(&mut self, name: &'static str, value: &dyn ErasedValue) {
        value.add_to_builder(name, self);
    }
}
impl Arguments for v1::Builder {
    fn add(&mut self, name: &'static str, value: &dyn ErasedValue) {
        value.add_to_v1(name, self);
    }
}

#[test]
fn equality_and_hash_ignore_the_legacy() {
    let f = fp(&HashSet::from([1u8, 2, 3]));
    let stored = Fingerprint::from_stored(f.as_str());
    assert!(f.legacy().is_some() && stored.legacy().is_none());
    assert_eq!(f, stored);
    let set: HashSet<Fingerprint> = [f.clone()].into();
    assert!(set.contains(&stored));
    assert_eq!(f.to_string(), f.as_str());
}

// ---------------------------------------------------------------------------
// Builder behaviour and errors

#[test]
fn no_arguments_means_no_fingerprint() {
    assert!(FingerprintBuilder::new().finish().unwrap().is_none());
}

/// A value whose `Serialize` fails, somewhere inside.
struct Broken;
impl Serialize for Broken {
    fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("the lock was poisoned"))
    }
}

#[test]
fn unserializable_argument_is_reported_by_name_and_path() {
    #[derive(Serialize)]
    struct Outer {
        items: Vec<BTreeMap<&'static str, Broken>>,
    }
    let mut b = FingerprintBuilder::new();
    b.argument("fine", &1u8);
    b.argument(
        "weird",
        &Outer {
            items: vec![BTreeMap::new(), [("k", Broken)].into()],
        },
    );
    b.argument("later", &2u8);
    match b.finish() {
        Err(Error::Fingerprint { argument, message }) => {
            assert_eq!(argument, "weird");
            assert_eq!(
                message,
                r#"the lock was poisoned (at `items[1][entry #0]`)"#
            );
        }
        other => panic!("expected a fingerprint error, got {other:?}"),
    }
    assert!(matches!(
        Fingerprint::of(&Broken),
        Err(Error::Fingerprint { .. })
    ));
}

#[test]
fn a_failed_panicked_or_nested_fingerprint_leaves_no_trace_in_the_next() {
    let value: HashMap<(u8, u8), HashSet<&str>> = [((1, 2), ["b", "a"].into())].into();
    let expected = fp(&value);
    assert_eq!(expected.version(), "v2");

    // A Serialize that fails half-way through, after a good argument.
    let mut b = FingerprintBuilder::new();
    b.argument("ok", &value);
    b.argument("broken", &(HashSet::from([1u8, 2]), Broken));
    assert!(b.finish().is_err());
    assert_eq!(fp(&value), expected);

    // A Serialize that panics the second time: in the legacy (v1) pass.
    struct PanicsSecondTime(std::cell::Cell<u8>);
    impl Serialize for PanicsSecondTime {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            self.0.set(self.0.get() + 1);
            assert!(self.0.get() < 2, "serialize panicked on purpose");
            HashSet::from([1u8, 2]).serialize(s)
        }
    }
    let caught = std::panic::catch_unwind(|| {
        let mut b = FingerprintBuilder::new();
        b.argument("x", &value);
        b.argument("y", &PanicsSecondTime(0.into()));
    });
    assert!(caught.is_err());
    assert_eq!(fp(&value), expected);

    // A fingerprint made while another is being made (a Serialize that fingerprints).
    struct Nested;
    impl Serialize for Nested {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let inner = fp(&HashSet::from(["q", "p"]));
            s.serialize_str(inner.as_str())
        }
    }
    let mut outer = FingerprintBuilder::new();
    outer.argument("value", &value);
    outer.argument("nested", &Nested);
    let mut same = FingerprintBuilder::new();
    same.argument("nested", fp(&HashSet::from(["p", "q"])).as_str());
    same.argument("value", &value);
    assert_eq!(outer.finish().unwrap(), same.finish().unwrap());
    assert_eq!(fp(&value), expected);
}

#[test]
fn a_repeated_argument_name_keeps_the_last_value() {
    let mut b = FingerprintBuilder::new();
    b.argument("a", &f64::NAN);
    b.argument("a", &1u8);
    let mut only = FingerprintBuilder::new();
    only.argument("a", &1u8);
    let f = b.finish().unwrap().unwrap();
    assert_eq!(f, only.finish().unwrap().unwrap());
    assert_eq!(f.version(), "v1");
    assert!(f.legacy().is_none());
}

// ---------------------------------------------------------------------------
// Rule 12

#[test]
fn faithful_check_names_what_and_where() {
    #[derive(Serialize)]
    struct Line {
        price: f32,
    }
    #[derive(Serialize)]
    enum Payment {
        Card { amount: f64 },
        Split(f64, f64),
        Cash(f64),
    }
    #[derive(Serialize)]
    struct Receipt {
        lines: Vec<Line>,
        totals: BTreeMap<&'static str, f64>,
        by_id: BTreeMap<u32, Option<f64>>,
        payment: Payment,
    }
    let fine = || Receipt {
        lines: vec![Line { price: 1.0 }, Line { price: -0.0 }],
        totals: [("EUR", 2.5)].into(),
        by_id: [(7, None)].into(),
        payment: Payment::Card { amount: 1e300 },
    };
    assert_eq!(check_faithful_json(&fine()), Ok(()));
    let suffix = ", which JSON cannot represent (it would replay as null)";
    let cases: Vec<(Receipt, &str)> = vec![
        (
            Receipt {
                lines: vec![Line { price: 0.0 }, Line { price: f32::NAN }],
                ..fine()
            },
            "`lines[1].price` is the non-finite float NaN",
        ),
        (
            Receipt {
                totals: [("EUR", f64::INFINITY)].into(),
                ..fine()
            },
            r#"`totals[entry #0]` is the non-finite float inf"#,
        ),
        (
            Receipt {
                by_id: [(7, Some(f64::NEG_INFINITY))].into(),
                ..fine()
            },
            r#"`by_id[entry #0]` is the non-finite float -inf"#,
        ),
        (
            Receipt {
                payment: Payment::Card { amount: f64::NAN },
                ..fine()
            },
            "`payment.Card.amount` is the non-finite float NaN",
        ),
        (
            Receipt {
                payment: Payment::Split(1.0, f64::INFINITY),
                ..fine()
            },
            "`payment.Split[1]` is the non-finite float inf",
        ),
        (
            Receipt {
                payment: Payment::Cash(f64::INFINITY),
                ..fine()
            },
            "`payment.Cash` is the non-finite float inf",
        ),
    ];
    for (receipt, expected) in cases {
        assert_eq!(
            check_faithful_json(&receipt),
            Err(format!("{expected}{suffix}"))
        );
    }
    assert_eq!(
        check_faithful_json(&f64::NAN),
        Err(format!("the value is the non-finite float NaN{suffix}"))
    );
    assert_eq!(
        check_faithful_json(&HashMap::from([(1u8, [0.0, f64::INFINITY])])),
        Err(format!(
            "`[entry #0][1]` is the non-finite float inf{suffix}"
        ))
    );
}

#[test]
fn faithful_check_accepts_what_json_carries_and_leaves_encoding_errors_alone() {
    assert_eq!(
        check_faithful_json(&(u128::MAX, Some(1u8), "x", [0.1f32])),
        Ok(())
    );
    // Not a faithfulness problem: the recording serializer reports it.
    assert_eq!(check_faithful_json(&vec![Broken]), Ok(()));
    // Keys are serde_json's business (a non-finite key is its error, not a null).
    assert_eq!(
        check_faithful_json(&HashMap::from([(OrderedF32(f32::NAN), 1u8)])),
        Ok(())
    );
}

// ---------------------------------------------------------------------------
// Speed: printed, never asserted. Run by hand, in release mode:
// cargo test --release -p idempotent-runtime --lib fingerprint::tests::timing -- --ignored --nocapture

#[test]
#[ignore = "timing, run by hand in release mode"]
fn timing_old_vs_new_for_four_field_structs() {
    #[derive(Serialize)]
    struct Flat {
        amount_cents: u64,
        currency: &'static str,
        customer_id: u64,
        capture: bool,
    }
    #[derive(Serialize)]
    struct Charge {
        amount_cents: u64,
        currency: String,
        description: String,
        metadata: BTreeMap<String, String>,
    }
    let flat = Flat {
        amount_cents: 12_345,
        currency: "EUR",
        customer_id: 987_654_321,
        capture: true,
    };
    let charge = Charge {
        amount_cents: 12_345,
        currency: "EUR".into(),
        description: "Order #1234: 2 × widget".into(),
        metadata: [
            ("order".into(), "1234".into()),
            ("channel".into(), "web".into()),
        ]
        .into(),
    };
    fn time(label: &str, f: &dyn Fn() -> usize) {
        let rounds = 100_000;
        let mut best = std::time::Duration::MAX;
        let mut keep = 0usize;
        for _ in 0..5 {
            let start = std::time::Instant::now();
            for _ in 0..rounds {
                keep = keep.wrapping_add(std::hint::black_box(f()));
            }
            best = best.min(start.elapsed() / rounds);
        }
        println!("{label:<40} {best:>10?} per call (best of 5; {keep})");
    }
    time("flat: v1 (to_value + sort)", &|| {
        v1::of(&flat).unwrap().len()
    });
    time("flat: v2 (canonical serializer)", &|| {
        fp(&flat).as_str().len()
    });
    time("charge: v1 (to_value + sort)", &|| {
        v1::of(&charge).unwrap().len()
    });
    time("charge: v2 (canonical serializer)", &|| {
        fp(&charge).as_str().len()
    });
    time("charge: check_faithful_json", &|| {
        usize::from(check_faithful_json(&charge).is_ok())
    });
}

/// Rule 12: `Some(x)` where `x` is written as `null` replays as `None`, so it
/// is refused too (`Option<Option<T>>`, `Option<()>`); `None` and `Some(v)` of
/// anything else are fine, at any depth.
#[test]
fn faithful_check_refuses_some_of_a_null() {
    #[derive(Serialize)]
    struct Patch {
        limit: Option<Option<u32>>,
        flag: Option<()>,
    }
    let ok = |limit, flag| check_faithful_json(&Patch { limit, flag });
    assert_eq!(ok(None, None), Ok(()));
    assert_eq!(ok(Some(Some(3)), None), Ok(()));
    let refused = ok(Some(None), None).expect_err("Some(None) replays as None");
    assert!(
        refused.contains("`limit`") && refused.contains("replay as `None`"),
        "{refused}"
    );
    let refused = ok(None, Some(())).expect_err("Some(()) replays as None");
    assert!(refused.contains("`flag`"), "{refused}");
    assert!(check_faithful_json(&Some(Some(None::<u8>))).is_err());
    assert!(check_faithful_json(&vec![Some(1u8), None]).is_ok());
}

/// Fixed vectors (SHA-256 of the canonical bytes, computed outside this
/// crate): fingerprints must not change from one build to the next, however
/// the bytes are fed to the hasher (short forms, and forms longer than its
/// buffer).
#[test]
fn fingerprints_are_fixed() {
    fn of<T: Serialize + ?Sized>(value: &T) -> String {
        Fingerprint::of(value).unwrap().as_str().to_owned()
    }
    assert_eq!(
        of(&1u8),
        "v1:48208f9428d64634bd8e28ff345bf0eab60d53c18fa2fbdb0b9bc1e84df2b5f6"
    );
    assert_eq!(
        of(&"a".repeat(300)),
        "v1:6ebf63e7bf6af0e60095a489d8e51941d4e9122096cf7e834a9921eb2d6d24c9"
    );
    assert_eq!(
        of(&"b".repeat(120)),
        "v1:1aef3e305f5eab495fca9151eb375e1b0e9faf2a276b1f4e1415db2f3914e8ba"
    );
    let mut b = FingerprintBuilder::new();
    b.argument("currency", "EUR");
    b.argument("amount", &10u32);
    assert_eq!(
        b.finish().unwrap().unwrap().as_str(),
        "v1:5f19111fbbc74b0d131074d03b389a0125fea1f9d6f001532dad555dc57ca8af"
    );
}

#[test]
fn hex_digits_of_every_byte() {
    let bytes: Vec<u8> = (0..=255).collect();
    let mut out = vec![0u8; 512];
    write_hex(&bytes, &mut out);
    assert_eq!(out, hex::encode(&bytes).into_bytes());
}

/// An internally tagged enum whose content is a map: serde writes the tag
/// (a `str` key) and the map's entries (`String` keys) into one map of known
/// length, so a content entry named like the tag repeats its key.
#[derive(Serialize, Debug)]
#[serde(tag = "type")]
enum Tagged {
    Card(HashMap<String, String>),
    Bank(HashMap<String, String>),
}

#[test]
fn a_tag_and_a_content_entry_with_the_tags_name_are_not_interchangeable() {
    let card = Tagged::Card(HashMap::from([("type".to_owned(), "Bank".to_owned())]));
    let bank = Tagged::Bank(HashMap::from([("type".to_owned(), "Card".to_owned())]));
    assert_ne!(fp(&card), fp(&bank), "{} vs {}", v2(&card), v2(&bank));
    assert_eq!(v2(&card), r#"{"type":"Card","type":"Bank"}"#);
    // The content map's own order still does not count.
    let many = |pairs: &[(&str, &str)]| {
        Tagged::Card(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        )
    };
    let a = many(&[("type", "x"), ("a", "1"), ("b", "2"), ("c", "3")]);
    for _ in 0..8 {
        let b = many(&[("c", "3"), ("b", "2"), ("a", "1"), ("type", "x")]);
        assert_eq!(fp(&a), fp(&b));
    }
}

#[derive(Serialize, Debug)]
struct Limits {
    amount: u32,
    currency: &'static str,
}

/// A flattened struct whose field repeats an outer field's name: both names
/// are `str` keys from the types' definitions, written in declaration order.
#[derive(Serialize, Debug)]
struct WithLimits {
    amount: u32,
    #[serde(flatten)]
    limits: Limits,
}

#[test]
fn a_field_and_a_flattened_structs_field_of_the_same_name_are_not_interchangeable() {
    let request = |amount, limit| WithLimits {
        amount,
        limits: Limits {
            amount: limit,
            currency: "EUR",
        },
    };
    let (a, b) = (request(1, 2), request(2, 1));
    assert_ne!(fp(&a), fp(&b), "{} vs {}", v2(&a), v2(&b));
    assert_eq!(v2(&a), r#"{"amount":1,"amount":2,"currency":"EUR"}"#);
    assert_eq!(fp(&a), fp(&request(1, 2)));
}

/// A value serde buffers before writing it (its private `Content`: an enum's
/// struct or tuple variant under `#[serde(flatten)]`, an internally tagged
/// newtype variant holding an enum's struct variant) reaches the encoder as a
/// map of known length whose keys all have one type, `Content`: a field and
/// a flattened entry of one name were sorted by their values, so the
/// requests below, which swap the two, shared a fingerprint (the second call
/// replayed the first's answer).
mod buffered {
    use super::*;

    #[derive(Serialize)]
    pub struct Billing {
        pub country: &'static str,
        #[serde(flatten)]
        pub extra: BTreeMap<String, &'static str>,
    }

    #[derive(Serialize)]
    pub enum Method {
        Card { billing: Billing },
        Tuple(u32, Billing),
        Limits { o: WithLimits },
    }

    /// The variant flattened: serde buffers it.
    #[derive(Serialize)]
    pub struct Charge {
        pub amount: u32,
        #[serde(flatten)]
        pub method: Method,
    }

    /// An internally tagged newtype holding a struct variant: buffered too.
    #[derive(Serialize)]
    #[serde(tag = "kind")]
    pub enum Tagged {
        Pay(Method),
    }

    #[derive(Serialize)]
    #[serde(tag = "type")]
    pub enum TagOrEntry {
        A(BTreeMap<String, &'static str>),
        B(BTreeMap<String, &'static str>),
    }

    #[derive(Serialize)]
    pub enum Wrap {
        W { inner: TagOrEntry },
    }

    #[derive(Serialize)]
    pub struct FlatWrap {
        #[serde(flatten)]
        pub w: Wrap,
    }

    pub fn billing(country: &'static str, extra: &'static str) -> Billing {
        Billing {
            country,
            extra: BTreeMap::from([("country".to_owned(), extra)]),
        }
    }
}

#[test]
fn a_field_and_a_flattened_entry_of_one_name_stay_apart_in_a_buffered_value() {
    use buffered::*;
    let card = |c, e| Charge {
        amount: 100,
        method: Method::Card {
            billing: billing(c, e),
        },
    };
    let (a, b) = (card("DE", "FR"), card("FR", "DE"));
    assert_ne!(fp(&a), fp(&b), "{} vs {}", v2(&a), v2(&b));
    assert_eq!(fp(&a), fp(&card("DE", "FR")), "an equal request");
    let tuple = |c, e| Charge {
        amount: 1,
        method: Method::Tuple(1, billing(c, e)),
    };
    assert_ne!(fp(&tuple("DE", "FR")), fp(&tuple("FR", "DE")));
    let tagged = |c, e| {
        Tagged::Pay(Method::Card {
            billing: billing(c, e),
        })
    };
    assert_ne!(fp(&tagged("DE", "FR")), fp(&tagged("FR", "DE")));
    // A field and a flattened struct's field of one name.
    let limits = |amount, limit| Method::Limits {
        o: WithLimits {
            amount,
            limits: Limits {
                amount: limit,
                currency: "EUR",
            },
        },
    };
    let flat = |amount, limit| Charge {
        amount: 0,
        method: limits(amount, limit),
    };
    assert_ne!(fp(&flat(1, 2)), fp(&flat(2, 1)));
    assert_ne!(
        fp(&Tagged::Pay(limits(1, 2))),
        fp(&Tagged::Pay(limits(2, 1)))
    );
    // An internal tag and a content map's entry of the tag's name.
    let entry = |k: &str, v| BTreeMap::from([(k.to_owned(), v)]);
    let a = FlatWrap {
        w: Wrap::W {
            inner: TagOrEntry::A(entry("type", "B")),
        },
    };
    let b = FlatWrap {
        w: Wrap::W {
            inner: TagOrEntry::B(entry("type", "A")),
        },
    };
    assert_ne!(fp(&a), fp(&b), "{} vs {}", v2(&a), v2(&b));
}

/// An internally tagged enum's newtype variant holding a struct with a field
/// of the tag's name: serde writes the tag and the field as two members of
/// one struct, both `str` names. They were sorted by their values, so
/// `Refund` holding `type: "Charge"` and `Charge` holding `type: "Refund"`
/// shared a fingerprint (the second call replayed the first's answer).
#[derive(Serialize, Debug, Clone)]
struct TaggedInner {
    r#type: &'static str,
    amount: u32,
}

#[derive(Serialize, Debug, Clone)]
#[serde(tag = "type")]
enum TaggedCommand {
    Refund(TaggedInner),
    Charge(TaggedInner),
}

#[derive(Serialize, Debug, Clone)]
#[serde(tag = "type")]
enum TaggedKind {
    Card {},
    Bank {},
}

#[derive(Serialize, Debug, Clone)]
#[serde(tag = "type")]
enum TaggedOuter {
    Card(TaggedKind),
    Bank(TaggedKind),
}

/// Two fields renamed alike: written in declaration order.
#[derive(Serialize, Debug, Clone)]
struct RenamedAlike {
    #[serde(rename = "v")]
    x: u32,
    #[serde(rename = "v")]
    y: u32,
}

#[test]
fn a_structs_members_of_one_name_keep_their_order() {
    let inner = |r#type| TaggedInner {
        r#type,
        amount: 100,
    };
    let refund = TaggedCommand::Refund(inner("Charge"));
    let charge = TaggedCommand::Charge(inner("Refund"));
    assert_ne!(
        fp(&refund),
        fp(&charge),
        "{} vs {}",
        v2(&refund),
        v2(&charge)
    );
    assert_eq!(fp(&refund), fp(&refund.clone()));
    let card_bank = TaggedOuter::Card(TaggedKind::Bank {});
    let bank_card = TaggedOuter::Bank(TaggedKind::Card {});
    assert_ne!(fp(&card_bank), fp(&bank_card));
    let (xy, yx) = (RenamedAlike { x: 1, y: 2 }, RenamedAlike { x: 2, y: 1 });
    assert_ne!(fp(&xy), fp(&yx));
    assert_eq!(fp(&xy), fp(&xy.clone()));
}

/// A multimap kept in a `HashSet` and written as repeated entries whose keys
/// are passed as `&str` (`k.as_str()`, so serde's key type is `str`, as for a
/// struct's field names): one source, whose entries arrive in the set's
/// iteration order, which must not count (rule 6). Only in a map of unknown
/// length (serde's form of `#[serde(flatten)]`) is each `str` key a source of
/// its own.
struct StrKeyedMultimap(HashSet<(String, u32)>);

impl Serialize for StrKeyedMultimap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k.as_str(), v)?;
        }
        m.end()
    }
}

#[test]
fn a_str_keyed_multimap_does_not_depend_on_its_sets_iteration_order() {
    let labels = || {
        StrKeyedMultimap(HashSet::from([
            ("env".to_owned(), 1),
            ("env".to_owned(), 2),
            ("env".to_owned(), 3),
        ]))
    };
    let order = |m: &StrKeyedMultimap| m.0.iter().map(|(_, v)| *v).collect::<Vec<_>>();
    let first = labels();
    // Each HashSet has its own RandomState: among 64 sets of the same
    // entries, one iterates in another order (all alike: p = (1/6)^63).
    let other = (0..64)
        .map(|_| labels())
        .find(|m| order(m) != order(&first))
        .expect("a set that iterates in another order");
    assert_eq!(fp(&first), fp(&other), "{} vs {}", v2(&first), v2(&other));
}

/// A `RawValue` holding a float exactly as serde_json writes it (the shortest
/// text of an `f64`) is JSON a `Value` holds; it is fingerprinted, not refused
/// as lossy (serde_json's parser reads such texts back exactly only with its
/// `float_roundtrip` feature, which the runtime turns on).
#[test]
fn raw_json_with_a_float_serde_json_writes_is_not_refused() {
    let x: f64 = "1.0715660391465826e-75".parse().expect("a float");
    let text = serde_json::to_string(&serde_json::json!({ "rate": x })).expect("json");
    assert_eq!(text, r#"{"rate":1.0715660391465826e-75}"#);
    let raw = serde_json::value::RawValue::from_string(text.clone()).expect("raw");
    let answer = Fingerprint::of(&raw);
    assert!(
        answer.is_ok(),
        "{text}: {:?}",
        answer.err().map(|e| e.to_string())
    );
}

/// What serde_json writes a `Number` as when its `arbitrary_precision`
/// feature is on (any crate of the build may turn it on): a struct named by
/// a private token, whose one field holds the number's text.
struct PreciseNumber(&'static str);

impl Serialize for PreciseNumber {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        const TOKEN: &str = "$serde_json::private::Number";
        let mut number = serializer.serialize_struct(TOKEN, 1)?;
        number.serialize_field(TOKEN, self.0)?;
        number.end()
    }
}

/// Rule 6 with serde_json's `arbitrary_precision`: a number held as text
/// fingerprints as the `u64`, `i64` or `f64` it is (as without the feature),
/// and text none of them holds exactly is an error. Before, the text was
/// hashed as a one-member map, equal to a map a caller could pass, and every
/// `Value` argument holding a number changed fingerprint with the feature.
#[test]
fn arbitrary_precision_numbers_fingerprint_as_the_number_they_are() {
    let same = |text: &'static str, expected: Fingerprint| {
        assert_eq!(
            Fingerprint::of(&PreciseNumber(text)).expect(text),
            expected,
            "{text}"
        );
    };
    same("450", Fingerprint::of(&450_u64).expect("u64"));
    same("-7", Fingerprint::of(&-7_i64).expect("i64"));
    same("1.0", Fingerprint::of(&1.0_f64).expect("f64"));
    same("0.1", Fingerprint::of(&0.1_f64).expect("f64"));
    same("1e2", Fingerprint::of(&100.0_f64).expect("f64"));
    assert_eq!(
        Fingerprint::of(&vec![PreciseNumber("1"), PreciseNumber("2.5")]).expect("a list"),
        Fingerprint::of(&serde_json::json!([1, 2.5])).expect("a Value")
    );
    let map = HashMap::from([("$serde_json::private::Number", "1.0")]);
    assert_ne!(
        Fingerprint::of(&PreciseNumber("1.0")).expect("number"),
        Fingerprint::of(&map).expect("a map with the token's name")
    );
    // What earlier builds wrote (the token's map) is kept as the legacy
    // form, so their records still match after an upgrade.
    assert_eq!(
        Fingerprint::of(&PreciseNumber("1.0"))
            .expect("number")
            .legacy(),
        Some(Fingerprint::of(&map).expect("the map"))
    );
    // `-0` is the float `-0.0` (as serde_json reads it without the feature), not `0`.
    same("-0", Fingerprint::of(&-0.0_f64).expect("f64"));
    assert_ne!(
        Fingerprint::of(&PreciseNumber("-0")).expect("-0"),
        Fingerprint::of(&PreciseNumber("0")).expect("0")
    );
    for text in [
        "0.10000000000000000001",
        "123456789012345678901234567890",
        "1e400",
    ] {
        let e = Fingerprint::of(&PreciseNumber(text)).expect_err(text);
        assert!(e.to_string().contains("arbitrary_precision"), "{text}: {e}");
    }
}

/// A recursive value: each level a struct holding a map, a list and an
/// option (the heaviest frames per level), or nothing at the end.
#[derive(Serialize)]
struct Tree {
    children: BTreeMap<&'static str, Vec<Option<Box<Tree>>>>,
}

fn tree(levels: usize) -> Tree {
    let mut t = Tree {
        children: BTreeMap::new(),
    };
    for _ in 0..levels {
        t = Tree {
            children: BTreeMap::from([("c", vec![Some(Box::new(t))])]),
        };
    }
    t
}

/// A chain of newtypes and options, with no container between its levels.
#[derive(Serialize)]
struct Chain(Option<Box<Chain>>);

fn chain(levels: usize) -> Chain {
    (0..levels).fold(Chain(None), |c, _| Chain(Some(Box::new(c))))
}

/// A syntax tree's shape: many struct variants, each holding the next
/// level. serde's derived code for such an enum takes large frames (over 30
/// KiB a level in a debug build, where a plain struct takes 2).
macro_rules! ast {
    ($ty:ident, $make:ident: $($variant:ident),*) => {
        #[derive(Serialize)]
        enum $ty {
            Leaf,
            $($variant { name: String, weight: u64, flags: Vec<bool>, note: Option<String>, next: Box<$ty> },)*
        }

        fn $make(levels: usize) -> $ty {
            let variants: &[fn($ty) -> $ty] = &[$(|next| $ty::$variant {
                name: stringify!($variant).to_owned(),
                weight: 1,
                flags: vec![true],
                note: None,
                next: Box::new(next),
            }),*];
            (0..levels).fold($ty::Leaf, |next, i| variants[i % variants.len()](next))
        }
    };
}

ast!(Ast, ast: A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14, A15, A16, A17, A18, A19);

// Two hundred variants: a level's frames take about 350 KiB in a debug build.
ast!(WideAst, wide_ast: B0, B1, B2, B3, B4, B5, B6, B7, B8, B9, B10, B11, B12, B13, B14, B15, B16, B17, B18, B19, B20, B21, B22, B23, B24, B25, B26, B27, B28, B29, B30, B31, B32, B33, B34, B35, B36, B37, B38, B39, B40, B41, B42, B43, B44, B45, B46, B47, B48, B49, B50, B51, B52, B53, B54, B55, B56, B57, B58, B59, B60, B61, B62, B63, B64, B65, B66, B67, B68, B69, B70, B71, B72, B73, B74, B75, B76, B77, B78, B79, B80, B81, B82, B83, B84, B85, B86, B87, B88, B89, B90, B91, B92, B93, B94, B95, B96, B97, B98, B99, B100, B101, B102, B103, B104, B105, B106, B107, B108, B109, B110, B111, B112, B113, B114, B115, B116, B117, B118, B119, B120, B121, B122, B123, B124, B125, B126, B127, B128, B129, B130, B131, B132, B133, B134, B135, B136, B137, B138, B139, B140, B141, B142, B143, B144, B145, B146, B147, B148, B149, B150, B151, B152, B153, B154, B155, B156, B157, B158, B159, B160, B161, B162, B163, B164, B165, B166, B167, B168, B169, B170, B171, B172, B173, B174, B175, B176, B177, B178, B179, B180, B181, B182, B183, B184, B185, B186, B187, B188, B189, B190, B191, B192, B193, B194, B195, B196, B197, B198, B199);

/// On `stack` bytes of stack, as a tokio worker thread has (2 MiB).
fn on_a_stack_of<T: Send + 'static>(stack: usize, work: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(stack)
        .spawn(work)
        .expect("a thread")
        .join()
        .expect("no panic")
}

/// A deep value is fingerprinted on a 2 MiB stack (tokio's worker threads),
/// in a debug build too, where the encoder overflowed the stack and aborted
/// the process at about a thousand levels; past the bound it is an error.
/// A result is refused past its own, lower bound (serde_json writes it after
/// the check, with no guard of its own), before serde_json could overflow.
#[test]
fn a_deep_value_is_fingerprinted_or_refused_never_a_stack_overflow() {
    const STACK: usize = 2 << 20;
    let answers = on_a_stack_of(STACK, || {
        let deep = tree(2_000); // 8,000 levels
        let answers = (
            Fingerprint::of(&deep).map_err(|e| e.to_string()),
            check_faithful_json(&deep),
            Fingerprint::of(&chain(encoder::MAX_DEPTH as usize + 1)).map_err(|e| e.to_string()),
            check_faithful_json(&tree(300)),
            check_faithful_json(&tree(100)),
        );
        drop(deep); // level by level, a small frame each
        answers
    });
    let (deep, deep_result, too_deep, deep_result_300, result_100) = answers;
    // Large frames a level: the stack is looked at by how far it moved, not
    // by a count of levels (a look every 32 levels let these overflow).
    let (ast_deep, ast_result, wide_deep) = on_a_stack_of(STACK, || {
        (
            Fingerprint::of(&ast(3_000)).map_err(|e| e.to_string()),
            check_faithful_json(&ast(200)),
            Fingerprint::of(&wide_ast(300)).map_err(|e| e.to_string()),
        )
    });
    assert!(ast_deep.is_ok(), "{ast_deep:?}");
    assert!(wide_deep.is_ok(), "{wide_deep:?}");
    assert!(ast_result.is_ok(), "{ast_result:?}");
    assert!(deep.is_ok(), "{deep:?}");
    let deep_result = deep_result.expect_err("too deep to record");
    assert!(
        deep_result.contains("nested more than 1000 levels"),
        "{deep_result}"
    );
    let too_deep = too_deep.expect_err("past the bound");
    assert!(
        too_deep.contains("nested more than 10000 levels"),
        "{too_deep}"
    );
    assert!(deep_result_300.is_err(), "1,200 levels: refused");
    assert!(
        result_100.is_ok(),
        "400 levels: checked (the read-back refuses past 128 arrays and objects)"
    );
    // And the encoder is usable again on the same thread.
    assert!(on_a_stack_of(STACK, || {
        let _ = Fingerprint::of(&chain(encoder::MAX_DEPTH as usize + 5));
        Fingerprint::of(&chain(3)).is_ok()
    }));
}

/// Rule 12: `Some` of raw JSON text `null` would replay as `None`: refused,
/// as `Some(None)` is. Other raw text, and a bare `null`, come back as they are.
#[test]
fn some_raw_null_is_not_faithful() {
    use serde_json::value::RawValue;
    let raw = |text: &str| RawValue::from_string(text.to_owned()).expect("raw JSON");
    for text in ["null", " null\n"] {
        let answer = check_faithful_json(&Some(raw(text)));
        assert!(
            answer
                .as_ref()
                .is_err_and(|e| e.contains("replay as `None`")),
            "{text:?}: {answer:?}"
        );
    }
    assert!(check_faithful_json(&Some(raw("1"))).is_ok());
    assert!(check_faithful_json(&Some(raw(r#"{"a":null}"#))).is_ok());
    assert!(check_faithful_json(&raw("null")).is_ok());
    assert!(check_faithful_json(&vec![Some(raw("[null]"))]).is_ok());
    assert!(check_faithful_json(&vec![Some(raw("2")), Some(raw("null"))]).is_err());
}

/// A generic function's instantiation is named by its types without module
/// paths: moving a type to another module keeps the fingerprints.
#[test]
fn type_names_lose_their_module_paths() {
    use super::short_type_name;
    assert_eq!(
        short_type_name("alloc::vec::Vec<shop::orders::User>"),
        "Vec<User>"
    );
    assert_eq!(short_type_name("u8"), "u8");
    assert_eq!(short_type_name("&str"), "&str");
    assert_eq!(
        short_type_name("core::option::Option<(a::B, [c::D; 3])>"),
        "Option<(B, [D; 3])>"
    );
    assert_eq!(short_type_name("dyn core::fmt::Debug"), "dyn Debug");
}

/// A map's keys are request or result data (an e-mail address, a name): an
/// error names the entry by its place, never by its key, since the message
/// reaches logs (a 5xx answer over HTTP is logged with it).
#[test]
fn an_error_inside_a_map_does_not_show_its_key() {
    let personal = "alice.personal@example.com";
    let result = HashMap::from([(personal.to_owned(), f64::NAN)]);
    let e = check_faithful_json(&result).expect_err("NaN cannot be recorded");
    assert!(!e.contains(personal) && e.contains("entry #0"), "{e}");
    // An argument whose value at that key cannot be fingerprinted.
    struct Unwritable;
    impl Serialize for Unwritable {
        fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(serde::ser::Error::custom("cannot be written"))
        }
    }
    let argument = BTreeMap::from([(personal.to_owned(), Unwritable)]);
    let e = Fingerprint::of(&argument)
        .expect_err("unwritable")
        .to_string();
    assert!(!e.contains(personal) && e.contains("entry #0"), "{e}");
}

/// What `v3` counts (the answer's type, a by-value `self`) labels the
/// fingerprint `v3`, and its legacy form is what the build before made of
/// the rest, instantiations included: a record that build stored is still
/// replayed, whatever it counted.
#[test]
fn what_v3_counts_keeps_the_fingerprint_the_build_before_made_as_legacy() {
    let before = |instantiated: bool| {
        let mut b = FingerprintBuilder::new();
        b.argument("v", &7u8);
        if instantiated {
            b.instantiation("<V>", "u8");
        }
        b.finish().unwrap().unwrap()
    };
    for instantiated in [false, true] {
        let mut b = FingerprintBuilder::new();
        b.argument("v", &7u8);
        if instantiated {
            b.instantiation("<V>", "u8");
        }
        b.counted("<Self>", "Repo<User>", Counted::SinceV3);
        let now = b.finish().unwrap().unwrap();
        assert_eq!(now.version(), "v3");
        assert_ne!(now.as_str(), before(instantiated).as_str());
        assert_eq!(
            now.legacy().map(|l| l.as_str().to_owned()),
            Some(before(instantiated).as_str().to_owned()),
            "instantiated: {instantiated}"
        );
        assert_eq!(unknown_version(now.as_str()), None, "this build knows v3");
    }
    // Nothing but what v3 counts: the build before made no fingerprint.
    let mut b = FingerprintBuilder::new();
    b.counted("self", &5u8, Counted::SinceV3);
    let only = b.finish().unwrap().unwrap();
    assert_eq!((only.version(), only.legacy()), ("v3", None));
    // Another answer type, another fingerprint.
    let answer = |t: &str| {
        let mut b = FingerprintBuilder::new();
        b.argument("v", &7u8);
        b.counted("<T>", t, Counted::SinceV3);
        b.finish().unwrap().unwrap()
    };
    assert_ne!(answer("User").as_str(), answer("Invoice").as_str());
}

/// A tuple or a slice `Self` counts since `v4`: the legacy form is what the
/// build before made of the rest, a `v3` fingerprint included (that build
/// knew `v3`, and did not count the tuple), and a build that knows `v3` but
/// not `v4` reads the new record as a newer version's, not as a mismatch.
#[test]
fn a_tuple_self_keeps_the_build_befores_v3_form() {
    let mut before = FingerprintBuilder::new();
    before.argument("v", &7u8);
    before.counted("<A>", "User", Counted::SinceV3);
    let before = before.finish().unwrap().unwrap();
    assert_eq!(before.version(), "v3");
    let mut now = FingerprintBuilder::new();
    now.argument("v", &7u8);
    now.counted("<A>", "User", Counted::SinceV3);
    now.counted("<Self>", "(User,)", Counted::SinceV4);
    let now = now.finish().unwrap().unwrap();
    assert_eq!(now.version(), "v4");
    assert_eq!(
        now.legacy().map(|l| l.as_str().to_owned()),
        Some(before.as_str().to_owned())
    );
    assert_eq!(unknown_version(now.as_str()), None, "this build knows v4");
    // Nothing else counted: the build before made no fingerprint.
    let mut only = FingerprintBuilder::new();
    only.counted("<Self>", "(User,)", Counted::SinceV4);
    let only = only.finish().unwrap().unwrap();
    assert_eq!((only.version(), only.legacy()), ("v4", None));
    // Tuples and slices since `v4`; generic arguments and arrays before.
    for tuple in ["(A, B)", "(User,)", "[u8]", "&[User]", "&mut (User,)"] {
        assert!(names_a_tuple_or_slice(tuple), "{tuple}");
        assert!(!named_an_instantiation_before_v4(tuple), "{tuple}");
    }
    for before in ["Repo<User>", "[u8; 4]", "(Repo<User>,)"] {
        assert!(named_an_instantiation_before_v4(before), "{before}");
    }
}

#[test]
fn only_generic_arguments_other_than_lifetimes_make_an_instantiation() {
    for generic in [
        "Repo<User>",
        "Buffer<5>",
        "[u8; 4]",
        "Pair<'_, u8>",
        "Outer<'_, Inner<'_>>",
        "Map<K, V>",
        "(A, B)",
        "(User,)",
        "[u8]",
        "&[User]",
        "&mut (User,)",
    ] {
        assert!(names_an_instantiation(generic), "{generic}");
    }
    for plain in [
        "Service",
        "Service<'_>",
        "Svc<'_, 'static>",
        "&Service",
        "&mut Service",
        "()",
        "dyn Fn(u8) -> u8",
    ] {
        assert!(!names_an_instantiation(plain), "{plain}");
    }
}

/// A set among the arguments of a `v3` fingerprint: equal sets are one
/// fingerprint whatever their iteration order, and the legacy form is the
/// build before's canonical (`v2`) fingerprint of them, not an order-bound one.
#[test]
fn a_v3_fingerprint_of_equal_sets_ignores_their_order() {
    let of = |set: &HashSet<u32>, since_v3: bool| {
        let mut b = FingerprintBuilder::new();
        b.argument("tags", set);
        if since_v3 {
            b.counted("self", &5u8, Counted::SinceV3);
        }
        b.finish().unwrap().unwrap()
    };
    let (mut a, mut b) = (HashSet::new(), HashSet::with_capacity(1024));
    for i in 0..200 {
        a.insert(i);
        b.insert(199 - i);
    }
    let (now_a, now_b) = (of(&a, true), of(&b, true));
    assert_eq!(now_a.as_str(), now_b.as_str());
    assert_eq!(now_a.version(), "v3");
    let before = of(&a, false);
    assert_eq!(before.version(), "v2");
    assert_eq!(
        now_a.legacy().map(|l| l.as_str().to_owned()),
        Some(before.as_str().to_owned())
    );
    assert_eq!(
        now_b.legacy().map(|l| l.as_str().to_owned()),
        Some(before.as_str().to_owned())
    );
}
// Append to idempotent-runtime/src/fingerprint/tests.rs.

/// Rule 7 across versions: every form this build makes or compares by (`v1`,
/// `v2`, `v3`, `v4`, `http1`, `http2`) is a known version. A record of other
/// arguments in any of them is a mismatch (`FingerprintMismatch`, 422), never
/// "recorded by a newer version" (`RecordedByNewerVersion`, retry later),
/// which only a label this build cannot read may say.
#[test]
fn every_form_this_build_makes_is_a_known_version() {
    let digest = "0123456789abcdef".repeat(4);
    for label in ["v1", "v2", "v3", "v4", "v5", "http1", "http2"] {
        assert_eq!(
            unknown_version(&format!("{label}:{digest}")),
            None,
            "{label} is a form this build knows"
        );
    }
    for label in ["v6", "v9", "http3", "http9"] {
        assert_eq!(
            unknown_version(&format!("{label}:{digest}")),
            Some(label),
            "{label} is a newer build's form"
        );
    }
    // And the labels the builders actually write.
    let v1 = Fingerprint::of(&7u8).unwrap();
    let set: std::collections::HashSet<u8> = [1, 2].into_iter().collect();
    let v2 = Fingerprint::of(&set).unwrap();
    let mut b = FingerprintBuilder::new();
    b.argument("v", &7u8);
    b.counted("<Self>", "Repo<User>", Counted::SinceV3);
    let v3 = b.finish().unwrap().unwrap();
    for (made, label) in [(&v1, "v1"), (&v2, "v2"), (&v3, "v3")] {
        assert_eq!(made.version(), label);
        assert_eq!(unknown_version(made.as_str()), None, "{label}");
    }
    assert_eq!(
        v2.legacy().map(|l| l.version().to_owned()).as_deref(),
        Some("v1")
    );
}

/// Every map key kind the key serializer takes: those v1 took (written as
/// JSON strings) and, in `AnyMap`s of their own, those only v2 takes.
fn pinned_keys() -> (M, M) {
    let v1_keys = M::AnyMap(vec![
        (M::Bool(false), M::I64(1)),
        (M::I64(-1), M::I64(2)),
        (M::U64(2), M::I64(3)),
        (M::I128(3), M::I64(4)),
        (M::U128(4), M::I64(5)),
        (M::F64(2.5), M::I64(6)),
        (M::F32(0.1), M::I64(7)),
        (M::Char('k'), M::I64(8)),
        (M::Str("s\"é".into()), M::I64(9)),
        (M::UnitVariant("V"), M::I64(10)),
        (M::Newtype(Box::new(M::Str("nt".into()))), M::I64(11)),
    ]);
    let v2_keys = M::AnyMap(vec![
        (M::I128(i128::MAX), M::I64(1)),
        (M::U128(u128::MAX), M::I64(2)),
        (M::F64(f64::INFINITY), M::I64(3)),
        (M::F32(f32::NAN), M::I64(4)),
        (M::Bytes(vec![1, 2]), M::I64(5)),
        (M::None, M::I64(6)),
        (M::Some(Box::new(M::I64(1))), M::I64(7)),
        (M::Unit, M::I64(8)),
        (M::UnitStruct, M::I64(9)),
        (M::Seq(vec![M::I64(1)]), M::I64(10)),
        (M::Tuple(vec![M::I64(2)]), M::I64(11)),
        (M::TupleStruct(vec![M::I64(3)]), M::I64(12)),
        (M::Set(vec![M::I64(5), M::I64(4)]), M::I64(13)),
        (M::StrMap(vec![("m".into(), M::I64(1))]), M::I64(14)),
        (M::Struct(vec![("f", M::I64(1))]), M::I64(15)),
        (M::NewtypeVariant("N", Box::new(M::I64(1))), M::I64(16)),
        (M::TupleVariant("T", vec![M::I64(1)]), M::I64(17)),
        (M::StructVariant("S", vec![("g", M::I64(1))]), M::I64(18)),
    ]);
    (v1_keys, v2_keys)
}

/// A value through every `Serializer` method `M` reaches.
fn pinned_value(v1_only: bool) -> M {
    let mut fields = vec![
        ("unit", M::Unit),
        ("unit_struct", M::UnitStruct),
        ("none", M::None),
        ("bool", M::Bool(true)),
        ("i64", M::I64(-3)),
        ("u64", M::U64(u64::MAX)),
        ("i128", M::I128(-5)),
        ("u128", M::U128(7)),
        ("f64", M::F64(1e17)),
        ("f32", M::F32(0.1)),
        ("str", M::Str("é\"\n".into())),
        ("char", M::Char('x')),
        ("bytes", M::Bytes(vec![0, 255])),
        ("newtype", M::Newtype(Box::new(M::Str("n".into())))),
        ("some", M::Some(Box::new(M::I64(1)))),
        ("seq", M::Seq(vec![M::I64(2), M::I64(1)])),
        ("tuple", M::Tuple(vec![M::Bool(false), M::Str("t".into())])),
        ("tuple_struct", M::TupleStruct(vec![M::I64(9)])),
        (
            "str_map",
            M::StrMap(vec![("b".into(), M::I64(1)), ("a".into(), M::I64(2))]),
        ),
        ("int_map", M::IntMap(vec![(10, M::I64(1)), (-1, M::I64(2))])),
        ("keys", pinned_keys().0),
        ("unit_variant", M::UnitVariant("U")),
        (
            "newtype_variant",
            M::NewtypeVariant("N", Box::new(M::I64(4))),
        ),
        (
            "tuple_variant",
            M::TupleVariant("T", vec![M::I64(5), M::I64(6)]),
        ),
        (
            "struct_variant",
            M::StructVariant("S", vec![("z", M::I64(7)), ("y", M::I64(8))]),
        ),
    ];
    if !v1_only {
        fields.extend([
            ("i128_wide", M::I128(i128::MIN)),
            ("u128_wide", M::U128(u128::MAX)),
            ("nan", M::F64(f64::NAN)),
            ("f32_inf", M::F32(f32::NEG_INFINITY)),
            ("some_none", M::Some(Box::new(M::None))),
            (
                "some_some_unit",
                M::Some(Box::new(M::Some(Box::new(M::Unit)))),
            ),
            ("set", M::Set(vec![M::Str("b".into()), M::Str("a".into())])),
            ("v2_keys", pinned_keys().1),
        ]);
    }
    M::Struct(fields)
}

/// Pinned outputs (computed by this crate, to hold it to itself) of every
/// encoder path: values and map keys of each kind in the canonical, legacy
/// and check modes, serde_json's raw and arbitrary-precision tokens, the
/// arguments each version counts, and the canonical JSON of request bodies.
/// A stored record's fingerprint is compared byte for byte: none of these
/// may change (rule 6).
#[test]
fn encoder_outputs_are_pinned() {
    let full = pinned_value(false);
    let v1_only = pinned_value(true);
    let bytes = |(text, extended): (String, bool)| format!("{text} extended={extended}");
    let outcome = |r: Result<String, String>| r.unwrap_or_else(|e| format!("error: {e}"));
    let checked = |r: Result<(), String>| outcome(r.map(|()| "ok".to_owned()));
    let fingerprint = |r: Result<Fingerprint, Error>| {
        outcome(
            r.map(|f| format!("{} legacy={:?}", f.as_str(), f.legacy().map(|l| l.value)))
                .map_err(|e| e.to_string()),
        )
    };
    let numbers = [
        PreciseNumber("-0"),
        PreciseNumber("1e2"),
        PreciseNumber("450"),
    ];
    let mut lines = vec![
        format!("v2: {}", bytes(canonical(&full))),
        format!("legacy of v2: {}", outcome(legacy(&full))),
        format!("v1: {}", bytes(canonical(&v1_only))),
        format!("legacy of v1: {}", outcome(legacy(&v1_only))),
        format!("fingerprint of v2: {}", fingerprint(Fingerprint::of(&full))),
        format!(
            "fingerprint of v1: {}",
            fingerprint(Fingerprint::of(&v1_only))
        ),
        format!("check of v2: {}", checked(check_faithful_json(&full))),
        format!("check of v1: {}", checked(check_faithful_json(&v1_only))),
        format!(
            "raw: {}",
            bytes(canonical(&Raw(r#" {"b": [1, 2.5], "a": null} "#)))
        ),
        format!(
            "check of raw: {}",
            checked(check_faithful_json(&Some(Raw(" 7 "))))
        ),
        format!(
            "check of raw null: {}",
            checked(check_faithful_json(&Some(Raw(" null "))))
        ),
        format!("numbers: {}", bytes(canonical(&numbers))),
        format!(
            "fingerprint of a number: {}",
            fingerprint(Fingerprint::of(&PreciseNumber("2.5")))
        ),
    ];
    for counted in 0..5 {
        let mut b = FingerprintBuilder::new();
        b.argument("v", &7u8);
        match counted {
            0 => b.instantiation("<V>", "u8"),
            1 => b.counted("<T>", "User", Counted::SinceV3),
            2 => b.counted("<Self>", "(User,)", Counted::SinceV4),
            3 => b.counted("<impl Trait>", "Card", Counted::SinceV5),
            _ => {
                b.instantiation("<V>", "u8");
                b.counted("<T>", "User", Counted::SinceV3);
                b.counted("<Self>", "(User,)", Counted::SinceV4);
                b.counted("<impl Trait>", "Card", Counted::SinceV5);
            }
        }
        let counted_as = format!("counted {counted}");
        lines.push(format!(
            "{counted_as}: {}",
            fingerprint(Ok(b.finish().unwrap().unwrap()))
        ));
    }
    let body = br#" { "z": [3, {"y": 1, "x": [true, false, null]}], "a": "\u00e9\n", "n": -1.50e3, "e": {}, "l": [] } "#;
    let node = json::parse_json(body).expect("JSON");
    let mut unordered = Vec::new();
    node.write_unordered(&mut unordered);
    lines.push(format!(
        "json: {}",
        text(&json::canonical_json(body).expect("JSON"))
    ));
    lines.push(format!("json unordered: {}", text(&unordered)));
    let mut hash = Sha256::new();
    json::parse_json(body).expect("JSON").write(&mut hash);
    lines.push(format!("json sha: {}", hex::encode(hash.finalize())));
    let expected = [
        r#"v2: {"bool":true,"bytes":[0,255],"char":"x","f32":0.10000000149011612,"f32_inf":-inf,"f64":1e+17,"i128":-5,"i128_wide":-170141183460469231731687303715884105728,"i64":-3,"int_map":{"-1":2,"10":1},"keys":{"-1":2,"0.1":7,"2":3,"2.5":6,"3":4,"4":5,"V":10,"false":1,"k":8,"nt":11,"s\"é":9},"nan":nan,"newtype":"n","newtype_variant":{"N":4},"none":null,"seq":[2,1],"set":["a","b"],"some":1,"some_none":?null,"some_some_unit":??null,"str":"é\"\n","str_map":{"a":2,"b":1},"struct_variant":{"S":{"y":8,"z":7}},"tuple":[false,"t"],"tuple_struct":[9],"tuple_variant":{"T":[5,6]},"u128":7,"u128_wide":340282366920938463463374607431768211455,"u64":18446744073709551615,"unit":null,"unit_struct":null,"unit_variant":"U","v2_keys":{170141183460469231731687303715884105727:1,340282366920938463463374607431768211455:2,1:7,[1,2]:5,[1]:10,[2]:11,[3]:12,[4,5]:13,inf:3,nan:4,null:6,null:8,null:9,{"N":1}:16,{"S":{"g":1}}:18,{"T":[1]}:17,{"f":1}:15,{"m":1}:14}} extended=true"#,
        r#"legacy of v2: error: an integer outside the 64-bit range (at `i128_wide`)"#,
        r#"v1: {"bool":true,"bytes":[0,255],"char":"x","f32":0.10000000149011612,"f64":1e+17,"i128":-5,"i64":-3,"int_map":{"-1":2,"10":1},"keys":{"-1":2,"0.1":7,"2":3,"2.5":6,"3":4,"4":5,"V":10,"false":1,"k":8,"nt":11,"s\"é":9},"newtype":"n","newtype_variant":{"N":4},"none":null,"seq":[2,1],"some":1,"str":"é\"\n","str_map":{"a":2,"b":1},"struct_variant":{"S":{"y":8,"z":7}},"tuple":[false,"t"],"tuple_struct":[9],"tuple_variant":{"T":[5,6]},"u128":7,"u64":18446744073709551615,"unit":null,"unit_struct":null,"unit_variant":"U"} extended=false"#,
        r#"legacy of v1: {"bool":true,"bytes":[0,255],"char":"x","f32":0.10000000149011612,"f64":1e+17,"i128":-5,"i64":-3,"int_map":{"-1":2,"10":1},"keys":{"-1":2,"0.1":7,"2":3,"2.5":6,"3":4,"4":5,"V":10,"false":1,"k":8,"nt":11,"s\"é":9},"newtype":"n","newtype_variant":{"N":4},"none":null,"seq":[2,1],"some":1,"str":"é\"\n","str_map":{"a":2,"b":1},"struct_variant":{"S":{"y":8,"z":7}},"tuple":[false,"t"],"tuple_struct":[9],"tuple_variant":{"T":[5,6]},"u128":7,"u64":18446744073709551615,"unit":null,"unit_struct":null,"unit_variant":"U"}"#,
        r#"fingerprint of v2: v2:916c8505314356cd882cefef68ef1233b91c6f478a8a1670e8dfff5fb3e55ffc legacy=None"#,
        r#"fingerprint of v1: v1:130cf16eee38029443de1a3c4e39feab34d331751bda70f55d91711c51ef3895 legacy=None"#,
        r#"check of v2: error: `nan` is the non-finite float NaN, which JSON cannot represent (it would replay as null)"#,
        r#"check of v1: ok"#,
        r#"raw: {"a":null,"b":[1,2.5]} extended=false"#,
        r#"check of raw: ok"#,
        r#"check of raw null: error: the value is `Some` of a value JSON writes as null (e.g. `Some(None)`), which would replay as `None`"#,
        r#"numbers: [-0.0,100.0,450] extended=false"#,
        r#"fingerprint of a number: v1:65e3e354e4f6da71cc9878cc4719ebe24853cd2da61128a5ce830df569327dd0 legacy=Some("v1:7a736cc4a178f644bf7d14412d00544bb7374fb34532c5e80f774d82db6e1f98")"#,
        r#"counted 0: v1:9665abf28d183c24c4736720d849a6d41ca7b9d9b9b8f0a1ae5a306adcc7566a legacy=Some("v1:2790ebfa2520c12713bbcd700feafd20683f2f874cfed5e277f600a99e79e02f")"#,
        r#"counted 1: v3:b7d74d12a7652d3f1ae156e107a83bb6492c6f025b6ad3da8e73833019d16385 legacy=Some("v1:2790ebfa2520c12713bbcd700feafd20683f2f874cfed5e277f600a99e79e02f")"#,
        r#"counted 2: v4:59557ebda9bcf52fad9553be34f959677a249d57899328e13ec5cd9ee2079779 legacy=Some("v1:2790ebfa2520c12713bbcd700feafd20683f2f874cfed5e277f600a99e79e02f")"#,
        r#"counted 3: v5:c0132e1a0415add2032607298e60bc6a595aae4d6a6e59460dc3cdba0bd698d3 legacy=Some("v1:2790ebfa2520c12713bbcd700feafd20683f2f874cfed5e277f600a99e79e02f")"#,
        r#"counted 4: v5:8ada05ebd2bf929757219df1c8fee68fc717dceeda3773dc36ab77170d9ec59b legacy=Some("v4:ade7176b9e5d093efd8c4d2c0a701453b8e25a16f1359d59c7766d7338d9e013")"#,
        r#"json: {"a":"é\n","e":{},"l":[],"n":-15e2,"z":[3e0,{"x":[true,false,null],"y":1e0}]}"#,
        r#"json unordered: {"a":"é\n","e":{},"l":[],"n":-15e2,"z":[3e0,{"x":[false,null,true],"y":1e0}]}"#,
        r#"json sha: 4e89795eb6fc8085ec16f383b0c953f602e0baf0922a1f3a7e0133688ba7c99d"#,
    ];
    assert_eq!(lines.len(), expected.len());
    for (line, expected) in lines.iter().zip(expected) {
        assert_eq!(line, expected);
    }
}

/// The integers narrower than 64 bits (which the pinned value does not
/// reach), as values and as map keys, are written as v1 wrote them, in the
/// canonical and the legacy form (rule 6).
#[test]
fn narrow_integers_are_written_as_v1_wrote_them() {
    #[derive(Serialize)]
    struct Narrow {
        i8: i8,
        i16: i16,
        i32: i32,
        u8: u8,
        u16: u16,
        u32: u32,
        by_i8: BTreeMap<i8, u8>,
        by_i16: BTreeMap<i16, u8>,
        by_i32: BTreeMap<i32, u8>,
        by_u8: BTreeMap<u8, u8>,
        by_u16: BTreeMap<u16, u8>,
        by_u32: BTreeMap<u32, u8>,
    }
    let narrow = Narrow {
        i8: i8::MIN,
        i16: i16::MIN,
        i32: i32::MIN,
        u8: u8::MAX,
        u16: u16::MAX,
        u32: u32::MAX,
        by_i8: [(i8::MIN, 1), (0, 2), (i8::MAX, 3)].into(),
        by_i16: [(i16::MIN, 1), (-1, 2)].into(),
        by_i32: [(i32::MIN, 1), (i32::MAX, 2)].into(),
        by_u8: [(0, 1), (u8::MAX, 2)].into(),
        by_u16: [(9, 1), (u16::MAX, 2)].into(),
        by_u32: [(10, 1), (u32::MAX, 2)].into(),
    };
    let v1 = text(&v1::canonical(&narrow).expect("v1 wrote it"));
    assert_eq!(canonical(&narrow), (v1.clone(), false));
    assert_eq!(legacy(&narrow), Ok(v1));
}
