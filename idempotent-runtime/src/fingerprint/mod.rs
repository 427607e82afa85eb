//! The canonical fingerprint of a call's arguments.
//!
//! A fingerprint is `<version>:<lowercase hex SHA-256 of the canonical bytes>`.
//! The canonical bytes of the fingerprinted arguments are one object
//! `{"<parameter name>":<value>,...}` with members sorted by name, every value
//! written by the rules below. They depend on no map or set iteration order,
//! struct field order, process, platform or restart.
//!
//! # Version 1 (`v1`)
//!
//! A value is written as serde_json's `to_value` sees it (so with serde_json's
//! rules for keys and numbers): every object's members sorted by key (byte
//! order of the unescaped key), no whitespace, numbers as serde_json writes
//! them (`f32` widened to `f64` first: `0.1f32` is `0.10000000149011612`;
//! a positive exponent with its sign, `1e+17`, as serde_json 1.0.147 and
//! later write it, also in a build whose serde_json is older and writes `1e17`),
//! strings JSON-escaped. v1 is not faithful everywhere: it writes `inf`,
//! `-inf` and `NaN` all as `null`, `Some(x)` as `x` (so `Some(None)` and
//! `Some(())` read as `None`), sets in their iteration order (a `HashSet`'s
//! changes from one instance to the next), refuses map keys that are not
//! strings, numbers, bools or unit variants (a `(u8, u8)` key) and integers
//! beyond 64 bits, and keeps only the last of two keys with the same text.
//!
//! # Version 2 (`v2`, [`CANONICAL_VERSION`])
//!
//! **v2 extends v1: a value v1 represented faithfully is written with exactly
//! v1's bytes, and a fingerprint made only of such values keeps the `v1:`
//! label**, so fingerprints stored by earlier versions still match. A
//! fingerprint is labelled `v2:` when some argument needed an extension:
//!
//! | value | v1 | v2 |
//! |---|---|---|
//! | an unordered set with ≥ 2 elements (see below) | iteration order | elements sorted by their canonical bytes |
//! | `f64`/`f32` infinity, negative infinity, NaN | `null` (all three) | `inf`, `-inf`, `nan` (bare words: no number or string is written so) |
//! | `Some(x)` where `x` is written `null` or starts with `?` | `null` | `?` then `x`: `Some(None)` → `?null`, `Some(Some(None))` → `??null` |
//! | an integer outside the `i64`/`u64` range | error | its exact digits |
//! | a map key v1 refused (tuple, struct, sequence, `Option`, unit, bytes, a non-finite float, an enum variant with data) | error | the key's canonical bytes, not quoted: `{[1,2]:3}` |
//! | two keys of one map with the same text (the string `"1"` and the number `1`) | the last one only | both; number and bool keys bare: `{"1":"a",1:"b"}` |
//!
//! Map members are sorted by the text of v1 keys (as in v1), then the other
//! keys by their canonical bytes; members with the same key by their bytes,
//! except that members with the same key and key kind from *different
//! sources* stay in the order their sources were written, each source's
//! members by their bytes: which value came from which is part of the value
//! (`{amount: 1, extras: {"amount": 2}}` is not `{amount: 2, extras:
//! {"amount": 1}}`). A source is a key type (a `#[serde(flatten)]` map's
//! `String` keys beside a struct's field; an internal tag beside the content
//! map of `#[serde(tag = "type")]`), except that in a map of unknown length
//! (serde's form of a struct with `#[serde(flatten)]` fields) each `str` key
//! is a source of its own: there serde writes a type's own names as `str` (a
//! struct's fields, also those of a flattened struct), in declaration order,
//! while a collection's keys arrive as its key type or a reference to it
//! (`String`, `&str`). Repeats of one key type otherwise come from one source
//! (a multimap written as repeated entries, perhaps in a set's order) and are
//! sorted by their bytes; a multimap that writes its keys as `str` into a map
//! of unknown length is read as names (its set's order would count: give the
//! map its length). Earlier builds sorted some or all of these repeats by
//! their bytes; a record one of them made for such a value carries the lossy
//! form, so its retry is a mismatch (the safe answer), as for v1's lossy forms
//! below. Two flattened maps of one key type holding one key are one source
//! by this rule and still not told apart (two such values share a
//! fingerprint; avoid the repeated key). Neither is a name that only one
//! source holds: the order of sources tells them apart only when both are
//! there, so a field skipped when `None` and a flattened map's entry of its
//! name, each alone, are one value.
//! A string key is always written quoted; a key v1 refused is written as its
//! canonical bytes, which are quoted only when it is `Some` of a string (read
//! as that string, like every `Some(x)` whose `x` is not null-like). So a
//! tuple key `(1, 2)` (`[1,2]`) never meets the string key `"[1,2]"`.
//! As in v1, the JSON reading of a value is what counts: integer widths,
//! `Some(x)` vs `x` (for `x` not null-like), and the number key `1` vs the
//! string key `"1"` alone in a map are not told apart; a parameter has one
//! type, and these only meet inside `#[serde(untagged)]` enums and
//! structs with several `#[serde(flatten)]` maps (one keyed by `String`,
//! one by `Option<String>`: `"z"` in the one and `Some("z")` in the other
//! are one value).
//! Likewise the variants of an untagged enum that serde writes alike are one
//! value (`Refund { amount: 1 }` and `Charge { amount: 1 }`, or two unit
//! variants): when such an enum is an argument, tag it (serde's default, or
//! `#[serde(tag = "...")]`). A flattened `Option` that is `None` and one that
//! is `Some` of nothing (an empty map, a struct whose fields are all skipped)
//! are one value too. serde_json's `RawValue` is read as a `serde_json::Value`,
//! as in v1; text a `Value` cannot hold exactly (a number beyond `f64`'s
//! precision, a repeated member) is an error, never a collision.
//!
//! **Unordered sets** are recognised by type: serde's `Serialize` for
//! `HashSet` calls [`serde::Serializer::collect_seq`] exactly as `Vec`'s does,
//! so the canonical serializer looks at the iterated collection's type name.
//! A base name (last path segment, generics stripped) of `HashSet` (std,
//! hashbrown; ahash's `AHashSet` serializes as std's), `IndexSet` (indexmap,
//! whose equality ignores order), `DashSet` or `BinaryHeap` (whose iteration
//! order is its heap layout) is unordered; `Vec`, `VecDeque`, slices, arrays, `BTreeSet` (whose
//! order is already deterministic, so it stays v1) and everything else keep
//! their order. *Limitation:* a collection whose `Serialize` does not go
//! through `collect_seq`, or whose type is named otherwise, is written in its
//! own iteration order: current `dashmap` (`DashSet` calls `serialize_seq`),
//! `im::HashSet`, and custom wrappers. Fingerprint such a field as a
//! `BTreeSet`, or skip it. Maps of every kind are sorted, in v1 and v2.
//!
//! # Legacy fingerprints
//!
//! A fingerprint keeps one legacy form: what the build before made for the
//! same call. For a `v4` fingerprint (one that counts a method's `Self`
//! that is a tuple or a slice) that is the fingerprint of the rest, by the
//! rules below. For a `v3` fingerprint (one that counts the answer's type or
//! a by-value `self`) that is the `v1`/`v2` fingerprint of the rest
//! (parameters and instantiations); for one with instantiations, that of the parameters
//! alone; otherwise the `v1` form below. Records of builds two forms back
//! (a `v1` set order under a `v3` function) are refused as a mismatch until
//! they expire.
//!
//! When a fingerprint is labelled `v2` only because of set order (v1 wrote a
//! set in its iteration order), [`Fingerprint::legacy`] is the v1 fingerprint
//! v1 would have made for the same arguments in this process. A record stored
//! by an older version carries a `v1:` fingerprint; a reservation refused as a
//! mismatch is retried once with the legacy fingerprint, so the old record is
//! compared by v1's rules. Where v1 was *lossy* (a non-finite float written as
//! `null`, `Some(None)` as `null`, two map keys with one text) there is no
//! legacy fingerprint: v1's bytes there are shared with another value (`+inf`
//! and `None` both wrote `null`), and matching them could replay another
//! request's answer. A retry of such an old record is a mismatch, the safe
//! answer. The v1 form is only computed for arguments that needed an
//! extension.
//!
//! Fingerprints assume serde_json without its `arbitrary_precision` feature
//! (as v1 did: with it, serde_json writes numbers differently).
//!
//! # Versions this build does not know
//!
//! A change to how a fingerprint is made takes a new version label (`v3`,
//! `http3`). A build that meets a record whose fingerprint carries a label
//! it does not know (one a newer build wrote, during a rolling deploy or
//! after a rollback) cannot compare it: instead of refusing the retry as a
//! reused key, the call answers [`Error::RecordedByNewerVersion`], which
//! says to retry later (see [`unknown_version`]).
//!
//! # Results
//!
//! [`check_faithful_json`] (rule 12) uses the same serializer to tell
//! whether a result would come back equal from serde_json.

mod encoder;
mod faithful;
pub(crate) mod json;
pub(crate) mod shape;

pub use faithful::check_faithful_json;

use crate::error::Error;
use encoder::{Encoder, Mode};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::cell::Cell;
use std::ops::Range;

/// The newest version of the canonical form of values this build writes.
/// Values that v1 represented faithfully are still labelled `v1`, and a
/// fingerprint that counts the answer's type or a by-value `self` is
/// labelled `v3`, and one that counts a method's `Self` that is a tuple or a
/// slice `v4` (see the module doc).
pub const CANONICAL_VERSION: &str = "v2";

/// The first canonical form, still the label of every value it represents faithfully.
const V1: &str = "v1";

/// The HTTP layer's request fingerprint, before the media type counted.
pub(crate) const HTTP_V1: &str = "http1";

/// The HTTP layer's request fingerprint (`http::HTTP_FINGERPRINT_VERSION`).
pub(crate) const HTTP_V2: &str = "http2";

/// The label of a fingerprint that counts what builds labelled `v1`/`v2`
/// left out: the answer's type (a type parameter only the return type and
/// left-out parameters mention, `Self` in the return type, a method's
/// generic `Self`) or a by-value `self`. A new label, so that a build before
/// it, meeting such a record in a rolling deploy or after a rollback, says
/// "retry later" ([`Error::RecordedByNewerVersion`]) instead of refusing a
/// processed request as a reused key.
const V3: &str = "v3";

/// The label of a fingerprint that counts what builds labelled up to `v3`
/// left out: a method's `Self` that is a tuple or a slice (`(User,)`,
/// `[User]`, see [`names_a_tuple_or_slice`]). A new label for the same
/// reason as `v3`: a build that knows `v3` but not this, meeting such a
/// record, says "retry later" instead of refusing it as a reused key.
const V4: &str = "v4";

/// The label of a fingerprint that counts what builds labelled up to `v4`
/// left out: the type of a fingerprinted `impl Trait` parameter (an
/// anonymous type parameter: `id: TypedId<impl Model>` given a
/// `TypedId<User>` and a `TypedId<Order>` of one number). A new label for
/// the same reason as `v3`.
const V5: &str = "v5";

/// Every version label this build makes or compares fingerprints with.
const KNOWN_VERSIONS: [&str; 7] = [V1, CANONICAL_VERSION, V3, V4, V5, HTTP_V1, HTTP_V2];

/// The version label of a stored fingerprint when it is one this build does
/// not know: a newer build made it (see the module doc). `None` for a known
/// label, and for a string that is not a fingerprint of the stored form
/// (`<label>:<64 lowercase hex digits>`, the label ASCII letters and digits),
/// which is compared as it is.
///
/// ```
/// use idempotent_runtime::fingerprint::unknown_version;
/// let digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
/// assert_eq!(unknown_version(&format!("v9:{digest}")), Some("v9"));
/// assert_eq!(unknown_version(&format!("v2:{digest}")), None);
/// assert_eq!(unknown_version("v9:not-a-digest"), None);
/// ```
pub fn unknown_version(stored: &str) -> Option<&str> {
    let (label, digest) = stored.split_once(':')?;
    let well_formed = !label.is_empty()
        && label.bytes().all(|b| b.is_ascii_alphanumeric())
        && digest.len() == 64
        && digest
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    (well_formed && !KNOWN_VERSIONS.contains(&label)).then_some(label)
}

/// A versioned fingerprint, e.g. `v1:9f86d0...`.
///
/// Equality and hashing look at [`as_str`](Self::as_str) only.
///
/// ```
/// use idempotent_runtime::Fingerprint;
/// let plain = Fingerprint::of(&1.5f64).unwrap();
/// assert_eq!(plain.version(), "v1"); // v1 already wrote 1.5 faithfully
/// assert!(plain.legacy().is_none());
///
/// let inf = Fingerprint::of(&f64::INFINITY).unwrap();
/// assert_eq!(inf.version(), "v2"); // v1 wrote it as `null`, like `None`
/// assert!(inf.legacy().is_none()); // so v1's form cannot stand for it
///
/// let set: std::collections::HashSet<u8> = [1, 2, 3].into();
/// let sorted = Fingerprint::of(&set).unwrap();
/// assert_eq!(sorted.version(), "v2"); // v1 wrote it in iteration order
/// assert!(sorted.legacy().is_some()); // what v1 made of it, here
/// ```
#[derive(Debug, Clone)]
pub struct Fingerprint {
    value: String,
    legacy: Option<String>,
}

impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.value == other.value
    }
}

impl Eq for Fingerprint {}

impl std::hash::Hash for Fingerprint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.value.hash(state);
    }
}

impl Fingerprint {
    /// The fingerprint as stored: `<version>:<hex sha-256>`.
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// The canonical-form version this fingerprint was made with.
    pub fn version(&self) -> &str {
        self.value.split(':').next().unwrap_or_default()
    }

    /// Wraps a stored fingerprint string.
    pub fn from_stored(s: impl Into<String>) -> Self {
        Fingerprint {
            value: s.into(),
            legacy: None,
        }
    }

    /// A fingerprint with the one an older canonical form made for the same
    /// input, compared with records that form stored (as [`legacy`](Self::legacy)).
    #[cfg(feature = "http")]
    pub(crate) fn with_legacy(value: String, legacy: String) -> Self {
        Fingerprint {
            legacy: (legacy != value).then_some(legacy),
            value,
        }
    }

    /// The fingerprint the build before made for the same call, when it
    /// differs from this one: for a `v2` fingerprint whose arguments v1 wrote
    /// without loss but order-dependently (sets), the `v1` one; for a
    /// fingerprint with instantiations, the parameters' alone; for a `v3`
    /// one, the `v1`/`v2` fingerprint of what builds before counted. A record
    /// stored with it is compared by that build's rules (see the module doc).
    pub fn legacy(&self) -> Option<Fingerprint> {
        self.legacy.as_deref().map(Fingerprint::from_stored)
    }

    /// Fingerprints the canonical bytes of `value` (as one argument named `value`).
    ///
    /// ```
    /// use idempotent_runtime::Fingerprint;
    /// use std::collections::HashSet;
    /// let a: HashSet<&str> = ["eur", "usd", "gbp"].into();
    /// let b: HashSet<&str> = ["gbp", "eur", "usd"].into();
    /// assert_eq!(Fingerprint::of(&a).unwrap(), Fingerprint::of(&b).unwrap());
    /// ```
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<Self, Error> {
        let mut b = FingerprintBuilder::new();
        b.argument("value", value);
        if let Some(e) = b.error.take() {
            return Err(e);
        }
        Ok(b.digest())
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.value)
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
#[derive(Debug)]
pub struct FingerprintBuilder {
    /// Buffers, taken from (and given back to) the thread's spare.
    work: Workspace,
    error: Option<Error>,
}

/// Everything a builder writes into. One spare per thread is kept, so a
/// fingerprint allocates no buffers once a thread has made one.
#[derive(Debug, Default)]
struct Workspace {
    /// Holds every argument's name and canonical bytes (and, after them, the
    /// v1 bytes of those that needed an extension), back to back.
    encoder: Encoder,
    arguments: Vec<Argument>,
}

#[derive(Debug, Clone)]
struct Argument {
    name: &'static str,
    /// The name as a JSON string.
    quoted_name: Range<usize>,
    canonical: Range<usize>,
    /// Whether the canonical bytes needed a v2 extension.
    extended: bool,
    /// Whether its legacy bytes differ from the canonical ones: extended, or
    /// written as v1 but otherwise than earlier builds did.
    differs: bool,
    /// For an argument that `differs`: its legacy bytes, or `None` if the
    /// legacy form could not write it.
    legacy: Option<Range<usize>>,
    /// Since when builds count it, which decides the legacy forms.
    counted: Counted,
}

/// Since when builds count an argument of the fingerprint (see
/// [`FingerprintBuilder::counted`]), which decides its legacy forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    /// A parameter: always.
    Always,
    /// What tells one instantiation of a generic function from another (a
    /// type parameter's type, a const parameter's value, `Self` of a
    /// method), under a name no parameter can have (`<T>`):
    /// `create::<User>` and `create::<Order>` with one key are two requests,
    /// not one replayed to the other: a type or const parameter that a
    /// fingerprinted parameter mentions, or that nothing left out does. Also
    /// a method's by-value `self` (named `self`), which builds before
    /// counted left out.
    ///
    /// The fingerprint's legacy form (rule 6) is then the one without it,
    /// which builds before this existed made: a record they stored is still
    /// replayed, not refused.
    Instantiation,
    /// What `v3` counts and earlier labels did not: the answer's type (a
    /// type parameter that only the return type and left-out parameters
    /// mention, `Self` in the return type, a method's generic `Self`) or a
    /// by-value `self`. The fingerprint is then labelled `v3`, and its legacy
    /// form is what the build before made of the rest (its parameters and
    /// instantiations), so a record that build stored is still replayed.
    SinceV3,
    /// What `v4` counts and earlier labels did not: a method's `Self` that is
    /// a tuple or a slice. The fingerprint is then labelled `v4`, and its
    /// legacy form is what the build before made of the rest (a `v3`
    /// fingerprint included), so a record that build stored is still replayed.
    SinceV4,
    /// What `v5` counts and earlier labels did not: the type of a
    /// fingerprinted `impl Trait` parameter. The fingerprint is then labelled
    /// `v5`, and its legacy form is what the build before made of the rest,
    /// so a record that build stored is still replayed.
    SinceV5,
}

thread_local! {
    static SPARE: Cell<Option<Workspace>> = const { Cell::new(None) };
}

/// A spare holding more than this is dropped rather than kept for the next call.
const SPARE_LIMIT: usize = 64 * 1024;

impl Workspace {
    fn take() -> Self {
        SPARE
            .try_with(Cell::take)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn give_back(&mut self) {
        let mut work = std::mem::take(self);
        if work.encoder.capacity() > SPARE_LIMIT {
            return;
        }
        work.encoder.reset();
        work.arguments.clear();
        // During thread teardown there is nowhere to keep it: it is dropped.
        let _ = SPARE.try_with(|spare| spare.set(Some(work)));
    }
}

impl Default for FingerprintBuilder {
    fn default() -> Self {
        FingerprintBuilder {
            work: Workspace::take(),
            error: None,
        }
    }
}

impl Drop for FingerprintBuilder {
    fn drop(&mut self) {
        self.work.give_back();
    }
}

impl FingerprintBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one named argument. A value that cannot be fingerprinted (its
    /// `Serialize` fails) is kept as an error and reported by
    /// [`finish`](Self::finish). A second argument with the same name replaces the first.
    pub fn argument<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) {
        if self.error.is_some() {
            return;
        }
        let enc = &mut self.work.encoder;
        let name_start = enc.bytes().len();
        enc.clear_extended();
        let written = name.serialize(&mut *enc).and_then(|_| {
            let start = enc.bytes().len();
            value.serialize(&mut *enc).map(|_| start)
        });
        let start = match written {
            Ok(start) => start,
            Err(e) => {
                enc.truncate(name_start);
                self.error = Some(Error::Fingerprint {
                    argument: name.to_owned(),
                    message: e.to_string(),
                });
                return;
            }
        };
        let quoted_name = name_start..start;
        let canonical = start..enc.bytes().len();
        let extended = enc.extended();
        let differs = extended || enc.rewritten();
        // Only when the extension was used (or a value was written otherwise
        // than earlier builds did) is there a legacy form worth computing,
        // and only when v1's form stood for this value alone (set order): a
        // lossy v1 form (a non-finite float written as null, ...) is shared
        // with another value, so matching it could replay another request's
        // answer (rule 7).
        let legacy = if differs && !enc.lossy() {
            enc.set_mode(Mode::Legacy);
            let legacy_start = enc.bytes().len();
            let written = value.serialize(&mut *enc);
            enc.set_mode(Mode::Canonical);
            match written {
                Ok(_) => Some(legacy_start..enc.bytes().len()),
                Err(_) => {
                    enc.truncate(legacy_start);
                    None
                }
            }
        } else {
            None
        };
        self.work.arguments.retain(|a| a.name != name);
        self.work.arguments.push(Argument {
            name,
            quoted_name,
            canonical,
            extended,
            differs,
            legacy,
            counted: Counted::Always,
        });
    }

    /// Adds what tells one instantiation of a generic function from another
    /// (see [`Counted::Instantiation`]).
    pub(crate) fn instantiation<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) {
        self.counted(name, value, Counted::Instantiation);
    }

    /// Adds an argument that builds count only `since` some point (see
    /// [`Counted`]): as [`argument`](Self::argument) does, and marked so that
    /// the fingerprint's label and legacy form are those `since` calls for.
    pub(crate) fn counted<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
        since: Counted,
    ) {
        self.argument(name, value);
        if let Some(last) = self.work.arguments.last_mut().filter(|a| a.name == name) {
            last.counted = since;
        }
    }

    /// [`counted`](Self::counted) for a type, by its name without module
    /// paths ([`short_type_name`]).
    pub(crate) fn counted_type(&mut self, name: &'static str, type_name: &str, since: Counted) {
        self.counted(name, &short_type_name(type_name), since);
    }

    /// The fingerprint, or `None` when no argument was added (a call with
    /// nothing to fingerprint has no fingerprint and cannot be contradicted).
    pub fn finish(mut self) -> Result<Option<Fingerprint>, Error> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if self.work.arguments.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.digest()))
    }

    fn digest(&mut self) -> Fingerprint {
        let Workspace { encoder, arguments } = &mut self.work;
        arguments.sort_by(|a, b| a.name.cmp(b.name));
        let bytes = encoder.bytes();
        counting_since(V5, Counted::SinceV5, arguments, bytes, digest_before_v5)
    }
}

/// The fingerprint of `arguments` (sorted by name, none counted since `v5`)
/// as builds before `v5` made it, with its legacy form.
fn digest_before_v5(arguments: &[Argument], bytes: &[u8]) -> Fingerprint {
    counting_since(V4, Counted::SinceV4, arguments, bytes, digest_before_v4)
}

/// The fingerprint of `arguments` (sorted by name, none counted since `v4`)
/// as builds before `v4` made it, with its legacy form.
fn digest_before_v4(arguments: &[Argument], bytes: &[u8]) -> Fingerprint {
    counting_since(V3, Counted::SinceV3, arguments, bytes, digest_before_v3)
}

/// A fingerprint labelled `label` when one of `arguments` is counted since
/// that label (`since`), whose legacy form is what the build before made of
/// the rest (`before`, by its own rules; none left: no fingerprint, which
/// nothing contradicts); otherwise `before`'s fingerprint of them all.
fn counting_since(
    label: &str,
    since: Counted,
    arguments: &[Argument],
    bytes: &[u8],
    before: fn(&[Argument], &[u8]) -> Fingerprint,
) -> Fingerprint {
    if !arguments.iter().any(|a| a.counted == since) {
        return before(arguments, bytes);
    }
    let value = hash(label, arguments, bytes, |a| &a.canonical);
    let earlier: Vec<Argument> = arguments
        .iter()
        .filter(|a| a.counted != since)
        .cloned()
        .collect();
    let legacy = (!earlier.is_empty()).then(|| before(&earlier, bytes).value);
    Fingerprint { value, legacy }
}

/// The fingerprint of `arguments` (sorted by name, none counted since `v3`)
/// as builds before `v3` made it, with its legacy form.
fn digest_before_v3(arguments: &[Argument], bytes: &[u8]) -> Fingerprint {
    if arguments
        .iter()
        .any(|a| a.counted == Counted::Instantiation)
    {
        // Builds before instantiations counted made the fingerprint of the
        // parameters alone (none: no fingerprint, which nothing contradicts).
        let value = value_of(arguments, bytes);
        let parameters: Vec<Argument> = arguments
            .iter()
            .filter(|a| a.counted == Counted::Always)
            .cloned()
            .collect();
        let legacy = (!parameters.is_empty())
            .then(|| value_of(&parameters, bytes))
            .filter(|legacy| *legacy != value);
        return Fingerprint { value, legacy };
    }
    digest_of(arguments, bytes)
}

/// The fingerprint of `arguments` (sorted by name), their bytes in `bytes`.
fn digest_of(arguments: &[Argument], bytes: &[u8]) -> Fingerprint {
    let value = value_of(arguments, bytes);
    // The legacy fingerprint, if the legacy form could write every argument.
    let differs = arguments.iter().any(|a| a.differs);
    let v1_writable = arguments.iter().all(|a| !a.differs || a.legacy.is_some());
    let legacy = (differs && v1_writable).then(|| {
        hash(V1, arguments, bytes, |a| match &a.legacy {
            Some(v1) if a.differs => v1,
            _ => &a.canonical,
        })
    });
    Fingerprint {
        legacy: legacy.filter(|legacy| *legacy != value),
        value,
    }
}

/// The current form's fingerprint of `arguments` (no legacy form).
fn value_of(arguments: &[Argument], bytes: &[u8]) -> String {
    let extended = arguments.iter().any(|a| a.extended);
    let version = if extended { CANONICAL_VERSION } else { V1 };
    hash(version, arguments, bytes, |a| &a.canonical)
}

/// Whether a type's name (as [`std::any::type_name`] gives it) is an
/// instantiation of a generic type: generic arguments other than lifetimes
/// (`Repo<User>`, `Buffer<5>`, `Pair<'_, u8>`), an array's length
/// (`[u8; 4]`), or the built-in type constructors' element types: a tuple's
/// (`(User,)`, `(A, B)`) and a slice's (`[User]`), also behind a reference
/// (`impl<T> Describe for (T,)` answers per `T`, as `Vec<T>` does). A type
/// generic over lifetimes only (`Service<'_>`) is one type whatever its
/// lifetime, and a reference to a plain type (`&Service`) is that type's.
/// (Told apart by when builds began to count them:
/// [`named_an_instantiation_before_v4`], [`names_a_tuple_or_slice`].)
#[cfg(test)]
pub(crate) fn names_an_instantiation(type_name: &str) -> bool {
    named_an_instantiation_before_v4(type_name) || names_a_tuple_or_slice(type_name)
}

/// Whether a type's name is a tuple with elements or a slice, also behind
/// a reference (`(User,)`, `&[User]`): instantiations that builds before
/// `v4` did not count (see [`names_an_instantiation`]).
pub(crate) fn names_a_tuple_or_slice(type_name: &str) -> bool {
    let mut outer = type_name.trim_start();
    while let Some(rest) = outer.strip_prefix('&') {
        outer = rest.trim_start();
        outer = outer.strip_prefix("mut ").unwrap_or(outer).trim_start();
    }
    (outer.starts_with('(') && outer != "()") || outer.starts_with('[')
}

/// Whether builds before `v4` counted a type's name as an instantiation:
/// generic arguments other than lifetimes, or an array's length.
pub(crate) fn named_an_instantiation_before_v4(type_name: &str) -> bool {
    if type_name.contains(';') {
        return true;
    }
    // What follows each `<` up to the next `<` or `>`: arguments, unless
    // all of them are lifetimes.
    type_name.split('<').skip(1).any(|after| {
        let arguments = after.split('>').next().unwrap_or_default();
        arguments
            .split(',')
            .map(str::trim)
            .any(|a| !a.is_empty() && !a.starts_with('\''))
    })
}

/// A type's name as [`std::any::type_name`] gives it, without module paths
/// (`alloc::vec::Vec<shop::User>` → `Vec<User>`): moving a type to another
/// module keeps the fingerprints of the calls that name it.
pub(crate) fn short_type_name(full: &str) -> String {
    let mut out = String::with_capacity(full.len());
    let mut rest = full;
    while let Some(i) = rest.find("::") {
        let head = &rest[..i];
        out.push_str(head.trim_end_matches(|c: char| c.is_alphanumeric() || c == '_'));
        rest = &rest[i + 2..];
    }
    out.push_str(rest);
    out
}

/// `<version>:<hex sha-256>` of `{"name":<bytes>,...}` (arguments sorted by
/// name), each argument's bytes being `bytes[form(argument)]`.
fn hash<'a>(
    version: &str,
    arguments: &'a [Argument],
    bytes: &[u8],
    form: impl Fn(&'a Argument) -> &'a Range<usize>,
) -> String {
    let mut hasher = Buffered::default();
    hasher.put(b"{");
    for (i, argument) in arguments.iter().enumerate() {
        if i > 0 {
            hasher.put(b",");
        }
        hasher.put(&bytes[argument.quoted_name.clone()]);
        hasher.put(b":");
        hasher.put(&bytes[form(argument).clone()]);
    }
    hasher.put(b"}");
    let mut hex = [0u8; 64];
    write_hex(&hasher.finish(), &mut hex);
    let mut out = String::with_capacity(version.len() + 1 + 64);
    out.push_str(version);
    out.push(':');
    // Hex digits only: always UTF-8.
    out.push_str(std::str::from_utf8(&hex).unwrap_or_default());
    out
}

/// SHA-256 fed through a small buffer: the canonical form arrives in many
/// short pieces (braces, names, colons, values), and the hasher's own
/// buffering costs more per piece than a copy. The bytes hashed are the same.
struct Buffered {
    hasher: Sha256,
    buffer: [u8; 128],
    len: usize,
}

impl Default for Buffered {
    fn default() -> Self {
        Buffered {
            hasher: Sha256::new(),
            buffer: [0; 128],
            len: 0,
        }
    }
}

impl Buffered {
    fn put(&mut self, bytes: &[u8]) {
        if self.len + bytes.len() > self.buffer.len() {
            self.hasher.update(&self.buffer[..self.len]);
            self.len = 0;
            if bytes.len() > self.buffer.len() {
                self.hasher.update(bytes);
                return;
            }
        }
        self.buffer[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    fn finish(mut self) -> [u8; 32] {
        self.hasher.update(&self.buffer[..self.len]);
        self.hasher.finalize().into()
    }
}

/// Writes `bytes` as lowercase hex digits into `out` (twice as long).
pub(crate) fn write_hex(bytes: &[u8], out: &mut [u8]) {
    /// Every byte's two digits.
    const DIGITS: [[u8; 2]; 256] = {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut table = [[0u8; 2]; 256];
        let mut i = 0;
        while i < 256 {
            table[i] = [HEX[i >> 4], HEX[i & 0xf]];
            i += 1;
        }
        table
    };
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair.copy_from_slice(&DIGITS[usize::from(*byte)]);
    }
}

#[cfg(test)]
mod tests;
