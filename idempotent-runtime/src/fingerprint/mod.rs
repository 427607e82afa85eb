//! The canonical fingerprint of a call's arguments.
//!
//! Canonical form, version 1 (`v1`): the fingerprinted arguments are serialized
//! with serde into a JSON value, as one object `{ "<parameter name>": <value>, ... }`;
//! every object's members are written sorted by key (byte order), with no
//! whitespace, numbers as serde_json writes them, strings JSON-escaped. The
//! fingerprint is `v1:` followed by the lowercase hex SHA-256 of those bytes.
//!
//! Because members are sorted, the result does not depend on struct field order
//! or on a map's iteration order, and it is the same on every process and
//! platform. Changing the canonical form means a new version prefix, so a record
//! made with an older form is still recognisable.

use crate::error::Error;
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The version of the canonical form this build writes.
pub const CANONICAL_VERSION: &str = "v1";

/// A versioned fingerprint, e.g. `v1:9f86d0...`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(String);

impl Fingerprint {
    /// The fingerprint as stored: `<version>:<hex sha-256>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The canonical-form version this fingerprint was made with.
    pub fn version(&self) -> &str {
        self.0.split(':').next().unwrap_or_default()
    }

    /// Wraps a stored fingerprint string.
    pub fn from_stored(s: impl Into<String>) -> Self {
        Fingerprint(s.into())
    }

    /// Fingerprints the canonical bytes of `value`.
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<Self, Error> {
        let mut b = FingerprintBuilder::new();
        b.argument("value", value);
        b.finish().map(|f| f.expect("one argument was added"))
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Collects named arguments and produces their [`Fingerprint`].
///
/// ```
/// use idempotent_runtime::FingerprintBuilder;
/// let mut a = FingerprintBuilder::new();
/// a.argument("amount", &10u32);
/// a.argument("currency", "EUR");
/// let mut b = FingerprintBuilder::new();
/// b.argument("currency", "EUR");
/// b.argument("amount", &10u32);
/// assert_eq!(a.finish().unwrap(), b.finish().unwrap());
/// ```
#[derive(Debug, Default)]
pub struct FingerprintBuilder {
    arguments: BTreeMap<&'static str, Value>,
    error: Option<Error>,
}

impl FingerprintBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one named argument. A serialization failure is kept and reported by [`finish`](Self::finish).
    pub fn argument<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) {
        if self.error.is_some() {
            return;
        }
        match serde_json::to_value(value) {
            Ok(v) => {
                self.arguments.insert(name, v);
            }
            Err(e) => {
                self.error = Some(Error::Fingerprint {
                    argument: name.to_owned(),
                    message: e.to_string(),
                })
            }
        }
    }

    /// The fingerprint, or `None` when no argument was added (a call with
    /// nothing to fingerprint has no fingerprint and cannot be contradicted).
    pub fn finish(self) -> Result<Option<Fingerprint>, Error> {
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
        Ok(Some(Fingerprint(format!(
            "{CANONICAL_VERSION}:{}",
            hex::encode(Sha256::digest(&bytes))
        ))))
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    // serde_json's string escaping is deterministic; writing into a Vec cannot fail.
    serde_json::to_writer(&mut *out, s).expect("writing a string into memory");
}

/// Writes `value` with every object's members sorted by key. Sorting here
/// (rather than relying on serde_json's map type) keeps the form stable even
/// if a dependency turns on serde_json's `preserve_order` feature.
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
        scalar => serde_json::to_writer(&mut *out, scalar).expect("writing a scalar into memory"),
    }
}

#[cfg(test)]
mod tests;
