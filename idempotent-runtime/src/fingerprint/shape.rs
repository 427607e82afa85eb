//! The shape of a value as its `Serialize` describes it: which kinds of
//! scalars (`u8` or `u32`, `char` or `str`) and which named types and
//! variants it is made of, counted wherever they stand. Rule 12 compares a
//! result's shape with the shape of what its JSON reads back as: two values
//! that JSON writes alike but whose shapes differ are two values (an
//! `#[serde(untagged)]` enum's `Wide(7u32)` read back as `Small(7u8)`,
//! `Letter('x')` as `Text("x")`). Values, and where things stand (a set's or
//! a map's order), are not part of a shape. Nor is which of an untagged
//! enum's struct variants a value is: serde writes each under the enum's
//! name, so two with fields of the same types have one shape.

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

/// A multiset of events, as a count and a sum of their hashes (the order
/// events come in does not change it).
#[derive(Debug, Default, PartialEq, Eq, Clone, Copy)]
struct Shape {
    events: u64,
    sum: u64,
}

impl Shape {
    fn of<T: Serialize + ?Sized>(value: &T) -> Option<Shape> {
        let mut shape = Shape::default();
        value.serialize(&mut shape).ok()?;
        Some(shape)
    }

    fn event(&mut self, kind: u8, names: &[&str]) {
        // SipHash with fixed keys: the same in both walks of one comparison.
        #[allow(deprecated)]
        let mut h = std::hash::SipHasher::new();
        kind.hash(&mut h);
        names.hash(&mut h);
        self.events = self.events.wrapping_add(1);
        self.sum = self.sum.wrapping_add(h.finish());
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

macro_rules! scalar {
    ($($method:ident($ty:ty) = $kind:expr;)*) => {$(
        fn $method(self, _: $ty) -> Result {
            self.event($kind, &[]);
            Ok(())
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

    scalar! {
        serialize_bool(bool) = 1;
        serialize_i8(i8) = 2;
        serialize_i16(i16) = 3;
        serialize_i32(i32) = 4;
        serialize_i64(i64) = 5;
        serialize_i128(i128) = 6;
        serialize_u8(u8) = 7;
        serialize_u16(u16) = 8;
        serialize_u32(u32) = 9;
        serialize_u64(u64) = 10;
        serialize_u128(u128) = 11;
        serialize_f32(f32) = 12;
        serialize_f64(f64) = 13;
        serialize_char(char) = 14;
        serialize_str(&str) = 15;
        serialize_bytes(&[u8]) = 16;
    }

    fn serialize_none(self) -> Result {
        self.event(17, &[]);
        Ok(())
    }

    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result {
        self.event(18, &[]);
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result {
        self.event(19, &[]);
        Ok(())
    }

    fn serialize_unit_struct(self, name: &'static str) -> Result {
        self.event(20, &[name]);
        Ok(())
    }

    fn serialize_unit_variant(self, name: &'static str, _: u32, variant: &'static str) -> Result {
        self.event(21, &[name, variant]);
        Ok(())
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result {
        self.event(22, &[name]);
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        name: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result {
        self.event(23, &[name, variant]);
        value.serialize(self)
    }

    fn serialize_seq(self, _: Option<usize>) -> std::result::Result<Self, ShapeError> {
        self.event(24, &[]);
        Ok(self)
    }

    fn serialize_tuple(self, _: usize) -> std::result::Result<Self, ShapeError> {
        self.event(25, &[]);
        Ok(self)
    }

    fn serialize_tuple_struct(
        self,
        name: &'static str,
        _: usize,
    ) -> std::result::Result<Self, ShapeError> {
        self.event(26, &[name]);
        Ok(self)
    }

    fn serialize_tuple_variant(
        self,
        name: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> std::result::Result<Self, ShapeError> {
        self.event(27, &[name, variant]);
        Ok(self)
    }

    fn serialize_map(self, _: Option<usize>) -> std::result::Result<Self, ShapeError> {
        self.event(28, &[]);
        Ok(self)
    }

    fn serialize_struct(
        self,
        name: &'static str,
        _: usize,
    ) -> std::result::Result<Self, ShapeError> {
        self.event(29, &[name]);
        Ok(self)
    }

    fn serialize_struct_variant(
        self,
        name: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> std::result::Result<Self, ShapeError> {
        self.event(30, &[name, variant]);
        Ok(self)
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
                self.event(31, &[name]);
                value.serialize(&mut **self)
            }
            fn end(self) -> Result {
                Ok(())
            }
        }
    )*};
}

fields!(SerializeStruct, SerializeStructVariant);
