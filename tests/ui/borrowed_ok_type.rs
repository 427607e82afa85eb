// A borrowed `&str` or `&[T]` in the `Ok` type cannot come back from a replay
// (the recorded answer is decoded into a new value): refused with a message
// saying what to return instead, in place of rustc's "`Deserialize` is not
// general enough".
use idempotent_runtime::{idempotent, Error};
use serde::{Deserialize, Serialize};

#[idempotent(scope = "payments.label", key = key, tenant = shared)]
async fn label(key: &str) -> Result<&'static str, Error> {
    Ok("charged")
}

#[idempotent(scope = "payments.labels", key = key, tenant = shared)]
async fn labels(key: &str) -> std::io::Result<Vec<(u8, &'static [u8])>> {
    Ok(Vec::new())
}

// What the compiler may accept passes this check: an owned `Cow`, a
// reference to a type of the crate's own that deserializes into an interned
// value, a reference in an associated type's path or a const expression, a
// type of the crate's own holding a reference, `PhantomData`, a crate's own
// type named like a standard container, an empty array.
#[idempotent(scope = "payments.cow", key = key, tenant = shared)]
async fn cow(key: &str) -> Result<std::borrow::Cow<'static, str>, Error> {
    Ok("x".into())
}

#[derive(Debug, Serialize)]
pub struct Currency {
    code: &'static str,
}
static EUR: Currency = Currency { code: "EUR" };
impl<'de> Deserialize<'de> for &'static Currency {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(|_| &EUR)
    }
}
#[idempotent(scope = "payments.currency", key = key, tenant = shared)]
async fn currency(key: &str) -> Result<&'static Currency, Error> {
    Ok(&EUR)
}

pub trait Owned {
    type O;
}
impl Owned for &'static str {
    type O = String;
}
#[idempotent(scope = "payments.owned", key = key, tenant = shared)]
async fn owned(key: &str) -> Result<<&'static str as Owned>::O, Error> {
    Ok(String::new())
}

#[idempotent(scope = "payments.sized", key = key, tenant = shared)]
async fn sized(key: &str) -> Result<[u8; std::mem::size_of::<&u8>()], Error> {
    Ok([0; std::mem::size_of::<&u8>()])
}

#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct Id<T: ?Sized>(u64, #[serde(skip)] std::marker::PhantomData<fn() -> Box<T>>);
#[idempotent(scope = "payments.id", key = key, tenant = shared)]
async fn id(key: &str) -> Result<Id<&'static str>, Error> {
    Ok(Id(1, std::marker::PhantomData))
}

mod interned {
    // A crate's own container named like a standard one.
    #[derive(serde::Serialize)]
    pub struct Vec<T>(pub std::vec::Vec<T>);
    impl<'de> serde::Deserialize<'de> for Vec<&'static str> {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            std::vec::Vec::<String>::deserialize(d)
                .map(|v| Vec(v.into_iter().map(|s| &*String::leak(s)).collect()))
        }
    }
}
#[idempotent(scope = "payments.interned", key = key, tenant = shared)]
async fn interned_labels(key: &str) -> Result<interned::Vec<&'static str>, Error> {
    Ok(interned::Vec(vec!["a"]))
}

#[idempotent(scope = "payments.none", key = key, tenant = shared)]
async fn none(key: &str) -> Result<([&'static str; 0], u8), Error> {
    Ok(([], 1))
}

#[idempotent(scope = "payments.marker", key = key, tenant = shared)]
async fn marker(key: &str) -> Result<std::marker::PhantomData<&'static str>, Error> {
    Ok(std::marker::PhantomData)
}

fn main() {}
