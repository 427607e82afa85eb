//! The shape of a value as its `Serialize` describes it: which kinds of
//! scalars (`u8` or `u32`, `char` or `str`) and which named types and
//! variants it is made of, and where each stands: in which field, in which
//! place of a tuple, in which entry of a map. Rule 12 compares a result's
//! shape with the shape of what its JSON reads back as: two values that
//! JSON writes alike but whose shapes differ are two values (an
//! `#[serde(untagged)]` enum's `Wide(7u32)` read back as `Small(7u8)`,
//! `Letter('x')` as `Text("x")`, `B { x: 7u32, y: 7u8 }` as
//! `A { x: 7u8, y: 7u32 }`). Values, and the order of a sequence's elements
//! or a map's entries (a set or a map written again in another order), are
//! not part of a shape. Nor is which of an untagged enum's struct variants a
//! value is: serde writes each under the enum's name, so two with fields of
//! the same names and types have one shape.

use serde::ser::{self, Serialize, Serializer};
use std::fmt;
use std::hash::{Hash, Hasher};

/// Whether `a` and `b` have one shape. `true` when either cannot be
/// described (its `Serialize` fails): there is nothing to compare.
pub(crate) fn same_shape<T: Serialize + ?Sized>(a: &T, b: &T) -> bool {
    match (Shape::of(a), Shape::of(b)) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// A value's shape as one hash, built bottom up: a scalar, or a compound
/// (a struct, a tuple, a sequence, a map, an `Option`'s `Some`, a newtype)
/// with the shapes of its members. A tuple's members count in their place
/// (`(u8, u32)` is not `(u32, u8)`), a struct's fields under their names, a
/// sequence's elements and a map's entries (each key with its value) in any
/// order: a set or a map written again in another order has the same shape.
#[derive(Debug, Default)]
struct Shape {
    /// The compounds being walked, innermost last.
    open: Vec<Frame>,
    /// The whole value's shape, once walked.
    done: Option<u64>,
}

/// How a compound's members make its shape.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Members {
    /// Each in its place (a tuple's, a newtype's, a field's value).
    InPlace,
    /// In any order (a sequence's elements, a struct's named fields).
    AnyOrder,
    /// Key and value pairs, in any order (a map's entries).
    Entries,
}

/// A compound whose members are being walked.
#[derive(Debug)]
struct Frame {
    /// What it is (its kind and names).
    head: u64,
    members: Members,
    /// The members' shapes so far: in order, or summed (in any order).
    sum: u64,
    count: u64,
    /// A map's key, whose value comes next (an entry is the two together).
    key: Option<u64>,
}

/// SipHash with fixed keys: the same in both walks of one comparison.
fn hash_of(value: impl Hash) -> u64 {
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    value.hash(&mut h);
    h.finish()
}

impl Shape {
    fn of<T: Serialize + ?Sized>(value: &T) -> Option<u64> {
        let mut shape = Shape::default();
        value.serialize(&mut shape).ok()?;
        shape.done
    }

    /// A scalar, or a compound without members (a unit, a `None`).
    fn event(&mut self, kind: u8, names: &[&str]) {
        self.member(hash_of((kind, names)));
    }

    /// A compound starts: its members come next, up to [`Shape::close`].
    fn open(&mut self, kind: u8, names: &[&str], members: Members) {
        self.open.push(Frame {
            head: hash_of((kind, names)),
            members,
            sum: 0,
            count: 0,
            key: None,
        });
    }

    /// The innermost compound has all its members.
    fn close(&mut self) {
        if let Some(frame) = self.open.pop() {
            self.member(hash_of((frame.head, frame.sum, frame.count, frame.key)));
        }
    }

    /// A member walked whole: of the innermost compound, or the value.
    fn member(&mut self, shape: u64) {
        let Some(frame) = self.open.last_mut() else {
            self.done = Some(shape);
            return;
        };
        match frame.members {
            Members::InPlace => frame.sum = hash_of((frame.sum, shape)),
            Members::AnyOrder => frame.sum = frame.sum.wrapping_add(hash_of(shape)),
            Members::Entries => match frame.key.take() {
                None => {
                    frame.key = Some(shape);
                    return;
                }
                Some(key) => frame.sum = frame.sum.wrapping_add(hash_of((key, shape))),
            },
        }
        frame.count = frame.count.wrapping_add(1);
    }

    /// A compound of one member (`Some`, a newtype, a struct's field).
    fn one<T: ?Sized + Serialize>(&mut self, kind: u8, names: &[&str], value: &T) -> Result {
        self.open(kind, names, Members::InPlace);
        value.serialize(&mut *self)?;
        self.close();
        Ok(())
    }
}

#[derive(Debug)]
struct ShapeError;

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the value's Serialize failed")
    }
}

impl std::error::Error for ShapeError {}

impl ser::Error for ShapeError {
    fn custom<T: fmt::Display>(_: T) -> Self {
        ShapeError
    }
}

type Result = std::result::Result<(), ShapeError>;

/// `Serializer` methods for values without members (a scalar, a unit, a
/// `None`): each is the event of its kind, with the names given.
macro_rules! leaf {
    ($($method:ident($($arg:tt: $ty:ty),*) = $kind:expr, [$($name:expr),*];)*) => {$(
        fn $method(self $(, $arg: $ty)*) -> Result {
            self.event($kind, &[$($name),*]);
            Ok(())
        }
    )*};
}

/// `Serializer` methods that open a compound of its kind, with the names
/// given, whose members make its shape as `$members` says.
macro_rules! compound {
    ($($method:ident($($arg:tt: $ty:ty),*) = $kind:expr, [$($name:expr),*], $members:ident;)*) => {$(
        fn $method(self $(, $arg: $ty)*) -> std::result::Result<Self, ShapeError> {
            self.open($kind, &[$($name),*], Members::$members);
            Ok(self)
        }
    )*};
}

impl<'a> Serializer for &'a mut Shape {
    type Ok = ();
    type Error = ShapeError;
    type SerializeSeq = &'a mut Shape;
    type SerializeTuple = &'a mut Shape;
    type SerializeTupleStruct = &'a mut Shape;
    type SerializeTupleVariant = &'a mut Shape;
    type SerializeMap = &'a mut Shape;
    type SerializeStruct = &'a mut Shape;
    type SerializeStructVariant = &'a mut Shape;

    leaf! {
        serialize_bool(_: bool) = 1, [];
        serialize_i8(_: i8) = 2, [];
        serialize_i16(_: i16) = 3, [];
        serialize_i32(_: i32) = 4, [];
        serialize_i64(_: i64) = 5, [];
        serialize_i128(_: i128) = 6, [];
        serialize_u8(_: u8) = 7, [];
        serialize_u16(_: u16) = 8, [];
        serialize_u32(_: u32) = 9, [];
        serialize_u64(_: u64) = 10, [];
        serialize_u128(_: u128) = 11, [];
        serialize_f32(_: f32) = 12, [];
        serialize_f64(_: f64) = 13, [];
        serialize_char(_: char) = 14, [];
        serialize_str(_: &str) = 15, [];
        serialize_bytes(_: &[u8]) = 16, [];
        serialize_none() = 17, [];
        serialize_unit() = 19, [];
        serialize_unit_struct(name: &'static str) = 20, [name];
        serialize_unit_variant(name: &'static str, _: u32, variant: &'static str) = 21, [name, variant];
    }

    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result {
        self.one(18, &[], value)
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result {
        self.one(22, &[name], value)
    }

    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        name: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result {
        self.one(23, &[name, variant], value)
    }

    compound! {
        serialize_seq(_: Option<usize>) = 24, [], AnyOrder;
        serialize_tuple(_: usize) = 25, [], InPlace;
        serialize_tuple_struct(name: &'static str, _: usize) = 26, [name], InPlace;
        serialize_tuple_variant(name: &'static str, _: u32, variant: &'static str, _: usize)
            = 27, [name, variant], InPlace;
        serialize_map(_: Option<usize>) = 28, [], Entries;
        serialize_struct(name: &'static str, _: usize) = 29, [name], AnyOrder;
        serialize_struct_variant(name: &'static str, _: u32, variant: &'static str, _: usize)
            = 30, [name, variant], AnyOrder;
    }
}

macro_rules! elements {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for &mut Shape {
            type Ok = ();
            type Error = ShapeError;
            fn $method<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
                value.serialize(&mut **self)
            }
            fn end(self) -> Result {
                self.close();
                Ok(())
            }
        }
    )*};
}

elements!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

impl ser::SerializeMap for &mut Shape {
    type Ok = ();
    type Error = ShapeError;
    fn serialize_key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result {
        key.serialize(&mut **self)
    }
    fn serialize_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
        value.serialize(&mut **self)
    }
    fn end(self) -> Result {
        self.close();
        Ok(())
    }
}

macro_rules! fields {
    ($($trait:ident),*) => {$(
        impl ser::$trait for &mut Shape {
            type Ok = ();
            type Error = ShapeError;
            fn serialize_field<T: ?Sized + Serialize>(
                &mut self,
                name: &'static str,
                value: &T,
            ) -> Result {
                self.one(31, &[name], value)
            }
            fn end(self) -> Result {
                self.close();
                Ok(())
            }
        }
    )*};
}

fields!(SerializeStruct, SerializeStructVariant);

#[cfg(test)]
mod tests {
    use super::{same_shape, Shape};
    use crate::fingerprint::tests::M;
    use serde::Serialize;

    fn of<T: Serialize + ?Sized>(value: &T) -> u64 {
        Shape::of(value).expect("a value that serializes has a shape")
    }

    /// A value through each `Serializer` method (`M` reaches all but the
    /// narrower integers), each with members of one shape where it has any.
    fn one_of_each() -> Vec<(&'static str, u64)> {
        let one = || Box::new(M::I64(1));
        vec![
            ("bool", of(&true)),
            ("i8", of(&1i8)),
            ("i16", of(&1i16)),
            ("i32", of(&1i32)),
            ("i64", of(&M::I64(1))),
            ("i128", of(&M::I128(1))),
            ("u8", of(&1u8)),
            ("u16", of(&1u16)),
            ("u32", of(&1u32)),
            ("u64", of(&M::U64(1))),
            ("u128", of(&M::U128(1))),
            ("f32", of(&M::F32(1.0))),
            ("f64", of(&M::F64(1.0))),
            ("char", of(&M::Char('a'))),
            ("str", of(&M::Str("a".into()))),
            ("bytes", of(&M::Bytes(vec![1]))),
            ("none", of(&M::None)),
            ("some", of(&M::Some(one()))),
            ("unit", of(&M::Unit)),
            ("unit struct", of(&M::UnitStruct)),
            ("unit variant", of(&M::UnitVariant("A"))),
            ("newtype struct", of(&M::Newtype(one()))),
            ("newtype variant", of(&M::NewtypeVariant("A", one()))),
            ("seq", of(&M::Seq(vec![M::I64(1)]))),
            ("tuple", of(&M::Tuple(vec![M::I64(1)]))),
            ("tuple struct", of(&M::TupleStruct(vec![M::I64(1)]))),
            ("tuple variant", of(&M::TupleVariant("A", vec![M::I64(1)]))),
            ("map", of(&M::StrMap(vec![("a".into(), M::I64(1))]))),
            ("struct", of(&M::Struct(vec![("a", M::I64(1))]))),
            (
                "struct variant",
                of(&M::StructVariant("A", vec![("a", M::I64(1))])),
            ),
        ]
    }

    /// Each `Serializer` method makes a shape of its own (rule 12): no two
    /// kinds of value are taken for one.
    #[test]
    fn each_kind_of_value_has_a_shape_of_its_own() {
        let shapes = one_of_each();
        for (i, (a, shape_a)) in shapes.iter().enumerate() {
            for (b, shape_b) in &shapes[i + 1..] {
                assert_ne!(shape_a, shape_b, "{a} and {b}");
            }
        }
    }

    /// Names count (a variant's, a struct's, a field's); so does a tuple's
    /// members' order, and not a sequence's, a struct's or a map's, nor
    /// the text of a map's keys.
    #[test]
    fn names_count_and_only_a_tuples_order_does() {
        let shape = |m: M| of(&m);
        let (small, wide) = (|| M::I64(1), || M::U64(1));
        assert_ne!(shape(M::UnitVariant("A")), shape(M::UnitVariant("B")));
        assert_ne!(
            shape(M::TupleVariant("A", vec![small()])),
            shape(M::TupleVariant("B", vec![small()]))
        );
        assert_ne!(
            shape(M::Struct(vec![("a", small())])),
            shape(M::Struct(vec![("b", small())]))
        );
        assert_ne!(
            shape(M::Tuple(vec![small(), wide()])),
            shape(M::Tuple(vec![wide(), small()]))
        );
        assert_eq!(
            shape(M::Seq(vec![small(), wide()])),
            shape(M::Seq(vec![wide(), small()]))
        );
        assert_eq!(
            shape(M::Struct(vec![("a", small()), ("b", wide())])),
            shape(M::Struct(vec![("b", wide()), ("a", small())]))
        );
        assert_eq!(
            shape(M::StrMap(vec![("a".into(), small()), ("b".into(), wide())])),
            shape(M::StrMap(vec![("b".into(), wide()), ("a".into(), small())]))
        );
        // An entry is its key's shape with its value's (keys are values:
        // their text is not part of the shape).
        let (text, letter) = (|| M::Str("a".into()), || M::Char('a'));
        assert_ne!(
            shape(M::AnyMap(vec![(text(), small()), (letter(), wide())])),
            shape(M::AnyMap(vec![(text(), wide()), (letter(), small())]))
        );
        assert_eq!(
            shape(M::StrMap(vec![("a".into(), small()), ("b".into(), wide())])),
            shape(M::StrMap(vec![("a".into(), wide()), ("b".into(), small())]))
        );
        assert!(same_shape(&M::Str("a".into()), &M::Str("b".into())));
        assert!(!same_shape(&M::Str("a".into()), &M::Char('a')));
    }
}
