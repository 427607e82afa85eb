//! The serializer behind the canonical form (see the module doc of
//! [`crate::fingerprint`] for the rules) and behind [`check_faithful_json`].
//!
//! One [`serde::Serializer`], three modes:
//!
//! - [`Mode::Canonical`] writes the current form (v2), noting in
//!   [`Encoder::extended`] whether anything needed v2's extensions;
//! - [`Mode::Legacy`] writes exactly what v1 wrote (`serde_json::to_value`
//!   followed by sorted objects), lossy parts included, and fails where v1
//!   failed: this is the "legacy" fingerprint old records are compared with;
//! - [`Mode::Check`] writes nothing and fails on the first value JSON cannot
//!   carry faithfully (rule 12).
//!
//! Bytes go straight into one buffer. Maps, structs and unordered sets are
//! written in arrival order first; their entries' positions are kept on a
//! stack, and only when they are not already in canonical order is the
//! region rewritten, sorted.
//!
//! [`check_faithful_json`]: super::check_faithful_json

use serde::ser::{
    self, Error as _, Serialize, SerializeMap, SerializeSeq, SerializeStruct,
    SerializeStructVariant, SerializeTuple, SerializeTupleStruct, SerializeTupleVariant,
    Serializer,
};
use serde_json::ser::{CompactFormatter, Formatter};
use std::fmt;
use std::io;

/// The struct name serde_json's `RawValue` serializes under; v1 parsed it
/// back into a JSON value, so its text is canonicalised, not hashed verbatim.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";
/// The struct name serde_json writes a `Number` as when its
/// `arbitrary_precision` feature is on (any crate in the build may turn it
/// on): one field, this name again, holding the number's text.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// Base names (last path segment, generics stripped) of collections whose
/// iteration order is not part of their value. Their `Serialize` must go
/// through [`Serializer::collect_seq`] for the name to be seen.
pub(crate) const UNORDERED_COLLECTIONS: &[&str] = &[
    "HashSet", // std, hashbrown, ahash's AHashSet (delegates to std's); not im (see the module doc)
    "IndexSet", // indexmap: insertion-ordered, but its equality ignores order
    "DashSet", // dashmap (current versions do not use collect_seq; see the module doc)
    "BinaryHeap", // std: iterates in heap layout, which depends on insertion history
];

/// Whether `type_name` (from [`std::any::type_name`]) names an unordered collection.
pub(crate) fn is_unordered(type_name: &str) -> bool {
    let mut t = type_name.trim_start();
    while let Some(rest) = t.strip_prefix('&') {
        t = rest.trim_start();
        t = t.strip_prefix("mut ").unwrap_or(t);
    }
    // A slice, an array or a tuple (`[HashSet<u8>]`) keeps its order, whatever
    // it holds: only a path names a collection.
    if !t.starts_with(|c: char| c.is_alphabetic() || c == '_') {
        return false;
    }
    let path = t.split('<').next().unwrap_or(t);
    let base = path.rsplit("::").next().unwrap_or(path).trim();
    UNORDERED_COLLECTIONS.contains(&base)
}

/// How many values deep a value may be nested (each container, `Some` and
/// newtype counts one) to be fingerprinted. The encoder's stack grows on
/// the heap as it goes deeper (see [`Encoder::nested`]): this only bounds
/// the memory an absurdly deep value takes.
pub(crate) const MAX_DEPTH: u32 = 10_000;

/// How deep a result (or a recorded error) may be nested, counted the same
/// way ([`Mode::Check`]). What passes is then written by serde_json, which
/// has no guard against a stack overflow: for ordinary types that fits in a
/// small part of a 2 MiB stack (tokio's worker threads) in a debug build,
/// though a type whose every level takes tens of KiB there (a many-variant
/// enum) can overflow serde_json's own recursion at a few hundred levels.
/// Deeper than 128 arrays and objects would not be read back anyway
/// (serde_json's limit, which the read-back check meets).
pub(crate) const MAX_CHECKED_DEPTH: u32 = 1_000;

/// [`Encoder::nested`] looks at the stack left each time the encoder has
/// gone this much deeper into it since the last look: never at the shallow
/// levels of ordinary values (a look costs a little, and a caller already
/// short of stack would get a new segment for each field), and never less
/// often than the stack moves, however large a level's frames (a level of a
/// many-variant enum takes over 30 KiB in a debug build, a plain struct 2).
const STACK_LOOK_DISTANCE: usize = 64 * 1024;
/// When less stack than this is left at a look, the encoder goes on in a
/// new segment of [`STACK_SEGMENT`] bytes. Covers the distance until the
/// next look and one more level.
const STACK_RED_ZONE: usize = 256 * 1024;
const STACK_SEGMENT: usize = 1024 * 1024;

/// What the encoder is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Mode {
    /// The canonical form this build writes (v2, which is v1 wherever v1 was faithful).
    #[default]
    Canonical,
    /// Exactly v1's bytes, lossy parts included; an error where v1 failed.
    Legacy,
    /// No output; an error on the first value JSON would not round-trip.
    Check,
}

/// How a value was written when it was a map key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum KeyKind {
    /// A string, char or unit variant: written as a JSON string (v1).
    Text,
    /// A number or bool: written as a JSON string of its text (v1), or bare
    /// when the map also holds a text key with the same text (v2).
    Scalar,
    /// Anything v1 refused as a key: written as its canonical bytes (v2).
    /// Also what the main serializer answers, since it writes everything else.
    Other,
}

/// One element of an unordered collection or one member of a map/struct, as
/// written: `out[start..end]`, its key being `out[start..start + key_len]`
/// and its sort key `keys[key_start..key_end]`.
#[derive(Debug, Clone, Copy)]
struct Entry {
    start: usize,
    end: usize,
    key_start: usize,
    key_end: usize,
    key_len: usize,
    kind: KeyKind,
    /// The Rust type of the key as written (`std::any::type_name`): in a map
    /// of unknown length, entries with one key from *different* sources (a
    /// struct's field, `str`, and a flattened map's key, e.g. `String`) have
    /// different key types.
    key_type: &'static str,
}

/// The serializer. See the module doc.
#[derive(Debug, Default)]
pub(crate) struct Encoder {
    mode: Mode,
    out: Vec<u8>,
    /// Sort keys of the open maps' entries (a stack, like `entries`).
    keys: Vec<u8>,
    /// Entries of the open maps, structs and unordered collections.
    entries: Vec<Entry>,
    /// Where a region being sorted is copied while it is rewritten.
    scratch: Vec<u8>,
    extended: bool,
    /// A value was written as v1 (no extension) but otherwise than earlier
    /// builds wrote it (serde_json's `arbitrary_precision` number, once a
    /// map): its legacy form (what they wrote) is kept to compare with their
    /// records, while the label stays v1.
    rewritten: bool,
    /// An extension was used for a value v1 wrote *lossily* (a non-finite
    /// float, `Some(null)`, two keys with the same text): v1's bytes for it
    /// are shared with another value, so they cannot stand for it.
    lossy: bool,
    /// Check mode writes nothing: the number of values written so far, and
    /// that number right after the latest `null`, tell `serialize_some`
    /// whether its value was a bare `null`.
    written: u64,
    null_written_at: u64,
    /// How deep the value being written is nested (see [`Encoder::nested`]).
    depth: u32,
    /// Where on the stack the encoder last looked at the stack left (an
    /// address; 0 before the first level of a value).
    stack_looked_at: usize,
    /// Where the level being written started (an address; 0 before the
    /// first level of a value), and the most stack one level has taken in
    /// this value: a look asks for room for a few of those.
    stack_level_at: usize,
    stack_level_max: usize,
}

impl Encoder {
    pub(crate) fn new(mode: Mode) -> Self {
        Encoder {
            mode,
            ..Encoder::default()
        }
    }

    /// Empties the encoder for reuse, keeping its buffers' capacity.
    pub(crate) fn reset(&mut self) {
        self.mode = Mode::Canonical;
        self.out.clear();
        self.keys.clear();
        self.entries.clear();
        self.scratch.clear();
        self.extended = false;
        self.rewritten = false;
        self.lossy = false;
        self.depth = 0;
        self.stack_looked_at = 0;
        self.stack_level_at = 0;
        self.stack_level_max = 0;
    }

    /// The memory its buffers hold.
    pub(crate) fn capacity(&self) -> usize {
        self.out.capacity() + self.keys.capacity() + self.scratch.capacity()
    }

    pub(crate) fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Everything written so far.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.out
    }

    /// Drops everything written after `len` bytes and any half-written
    /// container (after an error).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.out.truncate(len);
        self.keys.clear();
        self.entries.clear();
        self.depth = 0;
        self.stack_looked_at = 0;
        self.stack_level_at = 0;
        self.stack_level_max = 0;
    }

    /// Writes `value`, one level deeper than the value that holds it (a
    /// recursive value: a tree, a linked list), on more stack when little is
    /// left, so a deep value never overflows the stack (which aborts the
    /// process). Past [`MAX_DEPTH`] levels ([`MAX_CHECKED_DEPTH`] for a
    /// result) it is an error ([`Problem::TooDeep`]).
    fn nested<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<KeyKind> {
        let limit = self.depth_limit();
        if self.depth >= limit {
            return Err(EncodeError::new(Problem::TooDeep(limit)));
        }
        self.depth += 1;
        let mark = 0u8;
        let here = std::hint::black_box(&mark) as *const u8 as usize;
        let (looked_at, level_at) = (self.stack_looked_at, self.stack_level_at);
        // (A step of megabytes is stacker's switch to a new segment.)
        let step = here.abs_diff(level_at);
        if level_at != 0 && step < STACK_SEGMENT {
            self.stack_level_max = self.stack_level_max.max(step);
        }
        self.stack_level_at = here;
        // Room for the distance to the next look and a few of the largest
        // levels seen (a level of a many-variant enum takes tens of KiB in a
        // debug build); a level larger than the distance looks every time.
        let room = STACK_RED_ZONE.max(STACK_LOOK_DISTANCE + 3 * self.stack_level_max);
        let written = if looked_at == 0 {
            // The value's first level: the caller's stack is the caller's.
            self.stack_looked_at = here;
            value.serialize(&mut *self)
        } else if here.abs_diff(looked_at) >= STACK_LOOK_DISTANCE
            || self.stack_level_max >= STACK_LOOK_DISTANCE
        {
            self.stack_looked_at = here;
            stacker::maybe_grow(room, STACK_SEGMENT.max(4 * room), || {
                value.serialize(&mut *self)
            })
        } else {
            value.serialize(&mut *self)
        };
        self.stack_looked_at = looked_at;
        self.stack_level_at = level_at;
        if level_at == 0 {
            self.stack_level_max = 0; // the value is written
        }
        self.depth -= 1;
        written
    }

    fn depth_limit(&self) -> u32 {
        match self.mode {
            Mode::Check => MAX_CHECKED_DEPTH,
            Mode::Canonical | Mode::Legacy => MAX_DEPTH,
        }
    }

    /// Whether a v2 extension was needed since the flag was last cleared.
    pub(crate) fn extended(&self) -> bool {
        self.extended
    }

    /// Whether a value was written otherwise than earlier builds wrote it,
    /// with no extension (see the field).
    pub(crate) fn rewritten(&self) -> bool {
        self.rewritten
    }

    /// Whether an extension stood for a value v1 wrote lossily.
    pub(crate) fn lossy(&self) -> bool {
        self.lossy
    }

    pub(crate) fn clear_extended(&mut self) {
        self.extended = false;
        self.rewritten = false;
        self.lossy = false;
    }

    fn writes(&self) -> bool {
        self.mode != Mode::Check
    }

    fn put(&mut self, bytes: &[u8]) {
        self.written += 1;
        if self.writes() {
            self.out.extend_from_slice(bytes);
        }
    }

    fn put_byte(&mut self, byte: u8) {
        self.written += 1;
        if self.writes() {
            self.out.push(byte);
        }
    }

    /// A JSON string, escaped exactly as serde_json escapes it (v1 used serde_json).
    fn put_str(&mut self, s: &str) -> Result<(), EncodeError> {
        self.written += 1;
        if self.writes() {
            serde_json::to_writer(&mut self.out, s).map_err(EncodeError::custom)?;
        }
        Ok(())
    }

    /// A text value (a `char`, a `str`, a unit variant's name): a JSON string.
    fn text(&mut self, s: &str) -> Result<KeyKind, EncodeError> {
        self.put_str(s)?;
        Ok(KeyKind::Other)
    }

    /// A newtype struct's value: the value it wraps, as if unwrapped.
    fn wrapped<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<KeyKind> {
        self.nested(value)
    }

    /// Opens the object that wraps a variant's content, `{"variant":`, for
    /// a value of an enum variant (`None`: not one).
    fn open_variant(&mut self, variant: Option<&str>) -> Result<(), EncodeError> {
        if let Some(v) = variant {
            self.put_byte(b'{');
            self.put_str(v)?;
            self.put_byte(b':');
        }
        Ok(())
    }

    /// Closes what [`Encoder::open_variant`] opened.
    fn close_variant(&mut self, variant: Option<&str>) {
        if variant.is_some() {
            self.put_byte(b'}');
        }
    }

    /// A number (or other scalar) through serde_json's formatter, so the text is v1's.
    fn put_with(
        &mut self,
        write: impl FnOnce(&mut Vec<u8>) -> io::Result<()>,
    ) -> Result<KeyKind, EncodeError> {
        self.written += 1;
        if self.writes() {
            write(&mut self.out).map_err(EncodeError::custom)?;
        }
        Ok(KeyKind::Other)
    }

    fn float(&mut self, value: f64) -> Result<KeyKind, EncodeError> {
        if value.is_finite() {
            return self.put_with(|w| write_float(w, |w| CompactFormatter.write_f64(w, value)));
        }
        match self.mode {
            Mode::Canonical => {
                self.extended = true;
                self.lossy = true;
                self.put(non_finite_token(value));
            }
            Mode::Legacy => self.put(b"null"),
            Mode::Check => return Err(EncodeError::new(Problem::NonFinite(value))),
        }
        Ok(KeyKind::Other)
    }

    /// An integer beyond 64 bits: exact digits (v2); v1 could not write it.
    fn wide_integer(
        &mut self,
        write: impl FnOnce(&mut Vec<u8>) -> io::Result<()>,
    ) -> Result<KeyKind, EncodeError> {
        match self.mode {
            Mode::Legacy => Err(EncodeError::new(Problem::NotInV1(
                "an integer outside the 64-bit range",
            ))),
            Mode::Canonical => {
                self.extended = true;
                self.put_with(write)
            }
            Mode::Check => Ok(KeyKind::Other),
        }
    }

    /// Puts the unordered collection's elements `entries[first..]`, written
    /// from `region` on, in byte order.
    fn sort_elements(&mut self, first: usize, region: usize) {
        let Encoder {
            out,
            entries,
            scratch,
            ..
        } = self;
        let elements = &mut entries[first..];
        let in_order = elements
            .windows(2)
            .all(|w| out[w[0].start..w[0].end] <= out[w[1].start..w[1].end]);
        if in_order {
            return;
        }
        scratch.clear();
        scratch.extend_from_slice(&out[region..]);
        let bytes = |e: &Entry| &scratch[e.start - region..e.end - region];
        elements.sort_by(|a, b| bytes(a).cmp(bytes(b)));
        out.truncate(region);
        for (i, e) in elements.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(bytes(e));
        }
    }

    /// Puts the map's entries `entries[first..]`, written from `region` on,
    /// in canonical order: by key text (v1 keys) then by key bytes (other
    /// keys). Entries with the same key are kept (v2, typed keys) or reduced
    /// to the last one (v1, which stored them in a map).
    ///
    /// Entries with the same key *and* key kind from different sources
    /// (different key types: a field and a flattened map's entry, an internal
    /// tag and its content map's entry) keep their sources' written order:
    /// which value came from which is part of the value. Repeats from one
    /// source (one key type) are sorted by their bytes, so a set's iteration
    /// order does not count.
    ///
    /// `names_are_sources`: a struct, or a map whose length was not given
    /// (`serialize_map(None)`, serde's form of a struct with
    /// `#[serde(flatten)]` fields), where every `str` key is a name from a
    /// type's definition and a source of its own (see
    /// [`restore_arrival_order_of_repeats`]).
    fn sort_entries(&mut self, first: usize, region: usize, names_are_sources: bool) {
        let mode = self.mode;
        let Encoder {
            out,
            keys,
            entries,
            scratch,
            extended,
            lossy,
            ..
        } = self;
        let members = &mut entries[first..];
        let sort_key = |e: &Entry| (e.kind == KeyKind::Other, &keys[e.key_start..e.key_end]);
        if members
            .windows(2)
            .all(|w| sort_key(&w[0]) < sort_key(&w[1]))
        {
            return; // already in order, no repeated key: the bytes are final
        }
        scratch.clear();
        scratch.extend_from_slice(&out[region..]);
        let bytes = |e: &Entry| &scratch[e.start - region..e.end - region];
        if mode == Mode::Legacy {
            // Stable: entries with one key stay in arrival order, the last one wins.
            members.sort_by(|a, b| sort_key(a).cmp(&sort_key(b)));
        } else {
            members.sort_by(|a, b| {
                sort_key(a)
                    .cmp(&sort_key(b))
                    .then_with(|| bytes(a).cmp(bytes(b)))
                    // `"1":x` from a string and from a number are written apart below.
                    .then_with(|| a.kind.cmp(&b.kind))
            });
        }
        let repeated = members
            .windows(2)
            .any(|w| sort_key(&w[0]) == sort_key(&w[1]));
        let typed = repeated && mode == Mode::Canonical;
        if typed {
            restore_arrival_order_of_repeats(members, sort_key, names_are_sources);
            *extended = true;
            *lossy = true;
        }
        out.truncate(region);
        let mut written = 0;
        for (i, e) in members.iter().enumerate() {
            if mode == Mode::Legacy
                && members
                    .get(i + 1)
                    .is_some_and(|next| sort_key(next) == sort_key(e))
            {
                continue; // v1 kept only the last value of a repeated key
            }
            if written > 0 {
                out.push(b',');
            }
            let b = bytes(e);
            if typed && e.kind == KeyKind::Scalar {
                // `"1":v` → `1:v`: a number key, told apart from the string "1".
                out.extend_from_slice(&b[1..e.key_len - 1]);
                out.extend_from_slice(&b[e.key_len..]);
            } else {
                out.extend_from_slice(b);
            }
            written += 1;
        }
    }
}

/// Within each run of `members` (sorted) that shares one sort key, orders the
/// entries of each key kind that occurs more than once by their source, when
/// they come from different sources: sources in the order they were written
/// (entries are written in arrival order, so `start` is it), each source's
/// entries by their bytes, in the places that kind holds in the run. A
/// source is a key type (a flattened map's `String` keys beside a struct's
/// field; an internal tag beside its content map's keys), except that with
/// `names_are_sources` (a struct, or a map of unknown length: serde's form of
/// a struct with `#[serde(flatten)]` fields) every entry with a `str` key is a
/// source of its own: there such a key is a name from a type's definition (a
/// struct's field, also within a flattened struct; an internal tag), written
/// in declaration order.
/// A key of a value serde buffered before writing it (see [`is_buffered`]) is
/// a source of its own too: there every key has one type, serde's `Content`,
/// field names and a flattened map's keys alike, and the written order is all
/// that tells them apart.
/// Repeats of one key type otherwise come from one source (a multimap written
/// as repeated entries, perhaps in a set's iteration order) and stay sorted
/// by their bytes. With no repeated key and kind, nothing moves.
fn restore_arrival_order_of_repeats<K: Eq>(
    members: &mut [Entry],
    sort_key: impl Fn(&Entry) -> K,
    names_are_sources: bool,
) {
    let mut run_start = 0;
    while run_start < members.len() {
        let key = sort_key(&members[run_start]);
        let run_len = members[run_start..]
            .iter()
            .take_while(|e| sort_key(e) == key)
            .count();
        let run = &mut members[run_start..run_start + run_len];
        for kind in [KeyKind::Text, KeyKind::Scalar, KeyKind::Other] {
            let places: Vec<usize> = (0..run.len()).filter(|&i| run[i].kind == kind).collect();
            let own_source = |e: &Entry| {
                (names_are_sources && e.key_type == NAME_KEY_TYPE) || is_buffered(e.key_type)
            };
            let one_source = places
                .windows(2)
                .all(|w| run[w[0]].key_type == run[w[1]].key_type && !own_source(&run[w[0]]));
            if places.len() < 2 || one_source {
                continue;
            }
            // Sources in the order they were written (a source's first entry
            // says where it stands); one source's entries keep their order by
            // bytes (the run is sorted so), since their own order is a
            // collection's iteration order.
            let arrived: Vec<Entry> = places.iter().map(|&i| run[i]).collect();
            // Where each key type's first entry stands (one pass: a run can
            // hold as many entries as a map has).
            let mut first_of_type: std::collections::HashMap<&'static str, usize> =
                std::collections::HashMap::new();
            for e in &arrived {
                let first = first_of_type.entry(e.key_type).or_insert(e.start);
                *first = (*first).min(e.start);
            }
            let source_at = |entry: &Entry| {
                if own_source(entry) {
                    return entry.start;
                }
                first_of_type
                    .get(entry.key_type)
                    .copied()
                    .unwrap_or(usize::MAX)
            };
            let order: Vec<usize> = arrived.iter().map(source_at).collect();
            let mut indexed: Vec<(usize, Entry)> =
                order.into_iter().zip(arrived.iter().copied()).collect();
            indexed.sort_by_key(|(source, _)| *source); // stable
            for (&place, (_, entry)) in places.iter().zip(indexed) {
                run[place] = entry;
            }
        }
        run_start += run_len;
    }
}

/// The key type of a name from a type's definition: serde passes a struct's
/// field names (also in a flattened struct) and an internal tag to
/// `serialize_entry` as `str` (see [`restore_arrival_order_of_repeats`]); a
/// collection's keys arrive as its key type or a reference to it (`String`,
/// `&str`), or as `str` from a custom `Serialize`.
const NAME_KEY_TYPE: &str = "str";

/// Whether `key_type` is serde's private `Content`, the form of a value serde
/// buffers before writing it (an enum's struct or tuple variant under
/// `#[serde(flatten)]`, an internally tagged newtype variant holding one).
/// Its map keys arrive in the order the value wrote them: a struct's fields
/// in declaration order, a flattened map's entries in its iteration order.
fn is_buffered(key_type: &str) -> bool {
    let t = key_type.trim_start_matches('&');
    t.starts_with("serde") && t.contains("private") && t.ends_with("::Content")
}

/// Whether `parsed`, read from the JSON `text`, holds all of it: the two have
/// one canonical form (exact decimals, repeated members kept), so no number
/// was rounded and no member dropped.
fn holds_exactly(text: &str, parsed: &serde_json::Value) -> bool {
    let written = serde_json::to_vec(parsed).unwrap_or_default();
    match super::json::canonical_json(text.as_bytes()) {
        Some(exact) => super::json::canonical_json(&written).is_some_and(|read| read == exact),
        None => false,
    }
}

/// Writes a finite float's text (by `write`, serde_json's formatter) with
/// the sign of a positive exponent: `1e+17`. serde_json writes floats so from
/// 1.0.147 on (zmij), and wrote `1e17` up to 1.0.146 (ryu); the manifest
/// admits both, and the canonical form must not change with the dependency's
/// version (rule 6), so it is this text whichever the build has.
fn write_float(
    out: &mut Vec<u8>,
    write: impl FnOnce(&mut Vec<u8>) -> io::Result<()>,
) -> io::Result<()> {
    let start = out.len();
    write(out)?;
    if let Some(e) = out[start..].iter().position(|&b| b == b'e') {
        let exponent = start + e + 1;
        if out.get(exponent).is_some_and(u8::is_ascii_digit) {
            out.insert(exponent, b'+');
        }
    }
    Ok(())
}

/// `inf`, `-inf` and `nan`: not JSON, so no finite number, string or other
/// value is ever written this way. Every NaN is the one value `nan`.
fn non_finite_token(value: f64) -> &'static [u8] {
    if value.is_nan() {
        b"nan"
    } else if value > 0.0 {
        b"inf"
    } else {
        b"-inf"
    }
}

// ---------------------------------------------------------------------------
// Errors

/// Why a value could not be encoded, and where (built while the error
/// unwinds, so a successful encoding pays nothing for paths).
#[derive(Debug)]
pub(crate) struct EncodeError {
    problem: Problem,
    /// Innermost first.
    path: Vec<Segment>,
}

#[derive(Debug)]
enum Problem {
    /// The value's own `Serialize` failed (or, never in practice, a write).
    Custom(String),
    /// A non-finite float (only in [`Mode::Check`]).
    NonFinite(f64),
    /// `Some(x)` where `x` writes `null`, e.g. `Some(None)` (only in
    /// [`Mode::Check`]): JSON writes it as `null`, which replays as `None`.
    NullInSome,
    /// Something v1 could not write (only in [`Mode::Legacy`]).
    NotInV1(&'static str),
    /// Raw JSON text (`RawValue`) that a `serde_json::Value` cannot hold.
    LossyRawJson,
    /// Nested deeper than this ([`MAX_DEPTH`] or [`MAX_CHECKED_DEPTH`]).
    TooDeep(u32),
}

#[derive(Debug)]
enum Segment {
    Field(&'static str),
    Index(usize),
    Key(String),
}

impl EncodeError {
    fn new(problem: Problem) -> Self {
        EncodeError {
            problem,
            path: Vec::new(),
        }
    }

    fn at(mut self, segment: Segment) -> Self {
        self.path.push(segment);
        self
    }

    fn in_variant(self, variant: Option<&'static str>) -> Self {
        match variant {
            Some(v) => self.at(Segment::Field(v)),
            None => self,
        }
    }

    /// Whether this is a rule-12 refusal (rather than the value's own
    /// `Serialize` failing, which the recording serializer reports itself).
    pub(crate) fn is_not_faithful(&self) -> bool {
        matches!(
            self.problem,
            Problem::NonFinite(_) | Problem::NullInSome | Problem::TooDeep(_)
        )
    }

    fn path(&self) -> String {
        let mut s = String::new();
        for segment in self.path.iter().rev() {
            match segment {
                Segment::Field(name) => {
                    if !s.is_empty() {
                        s.push('.');
                    }
                    s.push_str(name);
                }
                Segment::Index(i) => s.push_str(&format!("[{i}]")),
                Segment::Key(k) => {
                    s.push('[');
                    s.push_str(k);
                    s.push(']');
                }
            }
        }
        s
    }
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path();
        match &self.problem {
            Problem::NonFinite(v) => {
                if path.is_empty() {
                    f.write_str("the value")?;
                } else {
                    write!(f, "`{path}`")?;
                }
                write!(
                    f,
                    " is the non-finite float {v}, which JSON cannot represent (it would replay as null)"
                )
            }
            Problem::NullInSome => {
                if path.is_empty() {
                    f.write_str("the value")?;
                } else {
                    write!(f, "`{path}`")?;
                }
                f.write_str(
                    " is `Some` of a value JSON writes as null (e.g. `Some(None)`), which would replay as `None`",
                )
            }
            Problem::Custom(m) => write_at(f, m, &path),
            Problem::NotInV1(m) => write_at(f, m, &path),
            Problem::LossyRawJson => write_at(
                f,
                "raw JSON text (`RawValue`) holds a number beyond `f64`'s precision or a repeated \
                 member, which its canonical form cannot tell apart from other text; pass the \
                 value parsed into a type of your own, or `skip` it",
                &path,
            ),
            Problem::TooDeep(limit) => write_at(
                f,
                &format!(
                    "the value is nested more than {limit} levels deep (a recursive value?); \
                     flatten it (an argument can also be left out with `skip`)"
                ),
                "", // as deep as the value: too long to be of use
            ),
        }
    }
}

fn write_at(f: &mut fmt::Formatter<'_>, message: &str, path: &str) -> fmt::Result {
    f.write_str(message)?;
    if !path.is_empty() {
        write!(f, " (at `{path}`)")?;
    }
    Ok(())
}

impl std::error::Error for EncodeError {}

impl ser::Error for EncodeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        EncodeError::new(Problem::Custom(msg.to_string()))
    }
}

// ---------------------------------------------------------------------------
// The serializer

type Result<T, E = EncodeError> = std::result::Result<T, E>;

/// `Serializer` methods for integers: each has serde_json's formatter write
/// its value, widened to `$wide`, through the serializer's `$put` (which
/// takes that writing as a closure). Given `$put` alone: the integers of 64
/// bits or fewer, written as an `i64` or a `u64` as v1 wrote them.
macro_rules! via {
    ($put:ident) => {
        via! {
            $put:
            serialize_i8(i8) => write_i64 as i64;
            serialize_i16(i16) => write_i64 as i64;
            serialize_i32(i32) => write_i64 as i64;
            serialize_i64(i64) => write_i64 as i64;
            serialize_u8(u8) => write_u64 as u64;
            serialize_u16(u16) => write_u64 as u64;
            serialize_u32(u32) => write_u64 as u64;
            serialize_u64(u64) => write_u64 as u64;
        }
    };
    ($put:ident: $($method:ident($ty:ty) => $write:ident as $wide:ty;)*) => {$(
        fn $method(self, v: $ty) -> Result<KeyKind> {
            self.$put(|w| CompactFormatter.$write(w, <$wide>::from(v)))
        }
    )*};
}

/// The `Serializer` methods the main serializer and the key serializer
/// write alike, each through a method of its own: a `char`, a `str` and a
/// unit variant (its name) as text, through `text`; a newtype struct as the
/// value it wraps, through `wrapped`.
macro_rules! alike_methods {
    () => {
        fn serialize_char(self, v: char) -> Result<KeyKind> {
            self.text(v.encode_utf8(&mut [0; 4]))
        }

        fn serialize_str(self, v: &str) -> Result<KeyKind> {
            self.text(v)
        }

        fn serialize_unit_variant(
            self,
            _name: &'static str,
            _index: u32,
            variant: &'static str,
        ) -> Result<KeyKind> {
            self.text(variant)
        }

        fn serialize_newtype_struct<T: ?Sized + Serialize>(
            self,
            _name: &'static str,
            value: &T,
        ) -> Result<KeyKind> {
            self.wrapped(value)
        }
    };
}

impl<'a> Serializer for &'a mut Encoder {
    type Ok = KeyKind;
    type Error = EncodeError;
    type SerializeSeq = Seq<'a>;
    type SerializeTuple = Seq<'a>;
    type SerializeTupleStruct = Seq<'a>;
    type SerializeTupleVariant = Seq<'a>;
    type SerializeMap = Map<'a>;
    type SerializeStruct = Map<'a>;
    type SerializeStructVariant = Map<'a>;

    fn serialize_bool(self, v: bool) -> Result<KeyKind> {
        self.put(if v { b"true" } else { b"false" });
        Ok(KeyKind::Other)
    }

    via!(put_with);

    fn serialize_i128(self, v: i128) -> Result<KeyKind> {
        if let Ok(v) = i64::try_from(v) {
            self.serialize_i64(v)
        } else if let Ok(v) = u64::try_from(v) {
            self.serialize_u64(v)
        } else {
            self.wide_integer(|w| CompactFormatter.write_i128(w, v))
        }
    }

    fn serialize_u128(self, v: u128) -> Result<KeyKind> {
        match u64::try_from(v) {
            Ok(v) => self.serialize_u64(v),
            Err(_) => self.wide_integer(|w| CompactFormatter.write_u128(w, v)),
        }
    }

    fn serialize_f32(self, v: f32) -> Result<KeyKind> {
        // serde_json::to_value widens f32 to f64 (0.1f32 → 0.10000000149011612).
        self.float(f64::from(v))
    }

    fn serialize_f64(self, v: f64) -> Result<KeyKind> {
        self.float(v)
    }

    alike_methods!();

    fn serialize_bytes(self, v: &[u8]) -> Result<KeyKind> {
        // v1: an array of numbers.
        self.put_byte(b'[');
        for (i, b) in v.iter().enumerate() {
            if i > 0 {
                self.put_byte(b',');
            }
            self.serialize_u8(*b)?;
        }
        self.put_byte(b']');
        Ok(KeyKind::Other)
    }

    fn serialize_none(self) -> Result<KeyKind> {
        self.put(b"null");
        self.null_written_at = self.written;
        Ok(KeyKind::Other)
    }

    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result<KeyKind> {
        let start = self.out.len();
        let before = self.written;
        self.nested(value)?;
        if self.mode == Mode::Check
            && self.written == before + 1
            && self.null_written_at == self.written
        {
            return Err(EncodeError::new(Problem::NullInSome));
        }
        if self.mode == Mode::Canonical {
            // v1 wrote `Some(x)` as `x`: fine unless `x` itself reads as
            // `None` (`null`) or as another such wrapper.
            let inner = &self.out[start..];
            if inner == b"null" || inner.first() == Some(&b'?') {
                self.out.insert(start, b'?');
                self.extended = true;
                self.lossy = true;
            }
        }
        Ok(KeyKind::Other)
    }

    fn serialize_unit(self) -> Result<KeyKind> {
        self.serialize_none()
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<KeyKind> {
        self.serialize_none()
    }

    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<KeyKind> {
        self.open_variant(Some(variant))?;
        self.nested(value)
            .map_err(|e| e.at(Segment::Field(variant)))?;
        self.close_variant(Some(variant));
        Ok(KeyKind::Other)
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<Seq<'a>> {
        Seq::begin(self, None, false)
    }

    fn serialize_tuple(self, _len: usize) -> Result<Seq<'a>> {
        Seq::begin(self, None, false)
    }

    fn serialize_tuple_struct(self, _name: &'static str, _len: usize) -> Result<Seq<'a>> {
        Seq::begin(self, None, false)
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Seq<'a>> {
        Seq::begin(self, Some(variant), false)
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Map<'a>> {
        let mut map = Map::begin(self, None, false)?;
        // serde writes a struct with `#[serde(flatten)]` as a map of unknown length.
        map.names_are_sources = len.is_none();
        Ok(map)
    }

    fn serialize_struct(self, name: &'static str, _len: usize) -> Result<Map<'a>> {
        let raw = name == RAW_VALUE_TOKEN;
        // v1 wrote serde_json's number token as a map (Legacy keeps that).
        let number = name == NUMBER_TOKEN && self.mode == Mode::Canonical;
        let mut map = Map::begin(self, None, raw || number)?;
        map.number = number;
        map.names_are_sources = true;
        Ok(map)
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Map<'a>> {
        let mut map = Map::begin(self, Some(variant), false)?;
        map.names_are_sources = true;
        Ok(map)
    }

    /// `HashSet` and friends serialize through here, exactly like `Vec`:
    /// the collection's type name is the only way to tell them apart.
    fn collect_seq<I>(self, iter: I) -> Result<KeyKind>
    where
        I: IntoIterator,
        I::Item: Serialize,
    {
        let unordered = self.mode == Mode::Canonical && is_unordered(std::any::type_name::<I>());
        let mut seq = Seq::begin(self, None, unordered)?;
        for item in iter {
            seq.element(&item)?;
        }
        seq.finish()
    }
}

// ---------------------------------------------------------------------------
// Sequences

/// A sequence, tuple or (with `variant`) tuple variant being written.
pub(crate) struct Seq<'a> {
    enc: &'a mut Encoder,
    count: usize,
    variant: Option<&'static str>,
    /// For an unordered collection: its first entry and where its elements start.
    unordered: Option<(usize, usize)>,
}

impl<'a> Seq<'a> {
    fn begin(enc: &'a mut Encoder, variant: Option<&'static str>, unordered: bool) -> Result<Self> {
        enc.open_variant(variant)?;
        enc.put_byte(b'[');
        let unordered = unordered.then_some((enc.entries.len(), enc.out.len()));
        Ok(Seq {
            enc,
            count: 0,
            variant,
            unordered,
        })
    }

    fn element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
        if self.count > 0 {
            self.enc.put_byte(b',');
        }
        let start = self.enc.out.len();
        if let Err(e) = self.enc.nested(value) {
            return Err(e.at(Segment::Index(self.count)).in_variant(self.variant));
        }
        if self.unordered.is_some() {
            let end = self.enc.out.len();
            self.enc.entries.push(Entry {
                start,
                end,
                key_start: 0,
                key_end: 0,
                key_len: 0,
                kind: KeyKind::Other,
                key_type: "",
            });
        }
        self.count += 1;
        Ok(())
    }

    fn finish(self) -> Result<KeyKind> {
        if let Some((first, region)) = self.unordered {
            if self.enc.entries.len() - first >= 2 {
                // With two elements or more, v1's bytes depended on iteration order.
                self.enc.extended = true;
                self.enc.sort_elements(first, region);
            }
            self.enc.entries.truncate(first);
        }
        self.enc.put_byte(b']');
        self.enc.close_variant(self.variant);
        Ok(KeyKind::Other)
    }
}

macro_rules! seq_impl {
    ($($trait:ident :: $method:ident),*) => {$(
        impl $trait for Seq<'_> {
            type Ok = KeyKind;
            type Error = EncodeError;
            fn $method<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
                self.element(value)
            }
            fn end(self) -> Result<KeyKind> {
                self.finish()
            }
        }
    )*};
}

seq_impl!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

// ---------------------------------------------------------------------------
// Maps and structs

/// A key written, its value not yet.
#[derive(Debug, Clone, Copy)]
struct Pending {
    start: usize,
    key_start: usize,
    key_end: usize,
    key_len: usize,
    kind: KeyKind,
    key_type: &'static str,
}

/// A map, struct or (with `variant`) struct variant being written.
pub(crate) struct Map<'a> {
    enc: &'a mut Encoder,
    count: usize,
    variant: Option<&'static str>,
    first: usize,
    keys_base: usize,
    region: usize,
    pending: Option<Pending>,
    /// serde_json's `RawValue` (or, with `number`, its `Number` under
    /// `arbitrary_precision`): its one field is JSON text to canonicalise.
    raw: bool,
    /// The text is one number (see [`Map::number_value`]).
    number: bool,
    /// A struct's members, or a map of unknown length: see [`Encoder::sort_entries`].
    /// A struct's fields (an internal tag among them) are `&'static str`
    /// names written in declaration order, never a collection's iteration
    /// order, so two with one name (an internally tagged enum's tag beside a
    /// field of that name, two fields renamed alike) keep their order.
    names_are_sources: bool,
}

impl<'a> Map<'a> {
    fn begin(enc: &'a mut Encoder, variant: Option<&'static str>, raw: bool) -> Result<Self> {
        enc.open_variant(variant)?;
        if !raw {
            enc.put_byte(b'{');
        }
        Ok(Map {
            first: enc.entries.len(),
            keys_base: enc.keys.len(),
            region: enc.out.len(),
            enc,
            count: 0,
            variant,
            pending: None,
            raw,
            number: false,
            names_are_sources: false,
        })
    }

    fn separator(&mut self) {
        if self.count > 0 {
            self.enc.put_byte(b',');
        }
    }

    /// Writes an entry's key, by `write` (which leaves its text, if it has
    /// one, in `keys`, and says which it was), and the `:` after it: the
    /// entry with its value still to come. A key without text sorts by its
    /// bytes.
    fn pending(
        &mut self,
        key_type: &'static str,
        write: impl FnOnce(&mut Encoder) -> Result<KeyKind>,
    ) -> Result<Pending> {
        self.separator();
        let enc = &mut *self.enc;
        let start = enc.out.len();
        let key_start = enc.keys.len();
        let kind = write(enc)?;
        let key_len = enc.out.len() - start;
        if kind == KeyKind::Other {
            enc.keys.extend_from_slice(&enc.out[start..]);
        }
        enc.put_byte(b':');
        Ok(Pending {
            start,
            key_start,
            key_end: enc.keys.len(),
            key_len,
            kind,
            key_type,
        })
    }

    fn key<K: ?Sized + Serialize>(&mut self, key: &K) -> Result<Pending> {
        let (count, variant) = (self.count, self.variant);
        self.pending(std::any::type_name::<K>(), |enc| {
            key.serialize(KeySerializer { enc }).map_err(|e| {
                e.at(Segment::Key(format!("key #{count}")))
                    .in_variant(variant)
            })
        })
    }

    fn field_key(&mut self, name: &'static str) -> Result<Pending> {
        self.pending(NAME_KEY_TYPE, |enc| {
            enc.put_str(name)?;
            enc.keys.extend_from_slice(name.as_bytes());
            Ok(KeyKind::Text)
        })
    }

    fn value<T: ?Sized + Serialize>(
        &mut self,
        key: Pending,
        value: &T,
        segment: impl FnOnce(&Encoder) -> Segment,
    ) -> Result<()> {
        if let Err(e) = self.enc.nested(value) {
            return Err(e.at(segment(&*self.enc)).in_variant(self.variant));
        }
        self.enc.entries.push(Entry {
            start: key.start,
            end: self.enc.out.len(),
            key_start: key.key_start,
            key_end: key.key_end,
            key_len: key.key_len,
            kind: key.kind,
            key_type: key.key_type,
        });
        self.count += 1;
        Ok(())
    }

    /// Where in a map an error is: by the entry's place, never its key,
    /// which is request or result data (an e-mail address, a name) and
    /// would reach logs with the message (rule 2: messages carry no
    /// personal data).
    fn entry_segment(entry: usize) -> Segment {
        Segment::Key(format!("entry #{entry}"))
    }

    fn entry<K: ?Sized + Serialize, V: ?Sized + Serialize>(
        &mut self,
        key: &K,
        value: &V,
    ) -> Result<()> {
        if self.enc.mode == Mode::Check {
            // Keys are not walked: JSON keys are strings and numbers, and
            // serde_json itself refuses the rest when recording.
            return self.enc.nested(value).map(|_| ()).map_err(|e| {
                e.at(Map::entry_segment(self.count))
                    .in_variant(self.variant)
            });
        }
        let pending = self.key(key)?;
        let entry = self.count;
        self.value(pending, value, |_| Map::entry_segment(entry))
    }

    fn field<T: ?Sized + Serialize>(&mut self, name: &'static str, value: &T) -> Result<()> {
        if self.raw {
            return if self.number {
                self.number_value(value)
            } else if self.enc.mode == Mode::Check {
                self.check_raw_value(value)
            } else {
                self.raw_value(value)
            };
        }
        if self.enc.mode == Mode::Check {
            return self
                .enc
                .nested(value)
                .map(|_| ())
                .map_err(|e| e.at(Segment::Field(name)).in_variant(self.variant));
        }
        let pending = self.field_key(name)?;
        self.value(pending, value, |_| Segment::Field(name))
    }

    /// The text of a raw value's one field (JSON text, or a number's
    /// digits), as `read` takes it; nothing of it is left written.
    fn raw_text<T: ?Sized + Serialize, R>(
        &mut self,
        value: &T,
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        let enc = &mut *self.enc;
        let start = enc.out.len();
        let key_start = enc.keys.len();
        // The key serializer hands strings back raw.
        value.serialize(KeySerializer { enc: &mut *enc })?;
        let read = read(&enc.keys[key_start..]);
        enc.out.truncate(start);
        enc.keys.truncate(key_start);
        Ok(read)
    }

    /// serde_json's `RawValue` in [`Mode::Check`]: one value, which counts as
    /// a `null` when its text is `null` (so `Some` of it is refused: it would
    /// replay as `None`). Any other text comes back as it is.
    fn check_raw_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
        let null = self.raw_text(value, |text| {
            std::str::from_utf8(text).is_ok_and(|t| t.trim() == "null")
        })?;
        if null {
            self.enc.null_written_at = self.enc.written;
        }
        Ok(())
    }

    /// serde_json's `RawValue`: v1 parsed the text into a JSON value, so it
    /// is written canonically (sorted members, no whitespace) here too. Text
    /// that a `serde_json::Value` cannot hold (a number beyond `f64`'s
    /// precision, a repeated member) is an error: read as a `Value`, texts that
    /// differ there would be one value (rule 6).
    fn raw_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
        let parsed = self.raw_text(value, |text| {
            let text = std::str::from_utf8(text).map_err(EncodeError::custom)?;
            let parsed =
                serde_json::from_str::<serde_json::Value>(text).map_err(EncodeError::custom)?;
            if holds_exactly(text, &parsed) {
                Ok(parsed)
            } else {
                Err(EncodeError::new(Problem::LossyRawJson))
            }
        })?;
        parsed?.serialize(&mut *self.enc)?;
        Ok(())
    }

    /// serde_json's `Number` under its `arbitrary_precision` feature, whose
    /// field is the number's text: written as the `u64`, `i64` or `f64` it
    /// is, as the same `Value` is written without the feature (so turning
    /// the feature on, in any crate of the build, changes no fingerprint).
    /// Text none of them holds exactly (`0.10000000000000000001`, a 30-digit
    /// integer) is an error: without the text it would be one value with
    /// the number it rounds to (rule 6).
    fn number_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
        let text = self.raw_text(value, |text| String::from_utf8_lossy(text).into_owned())?;
        let enc = &mut *self.enc;
        // Earlier builds wrote the token's map; their records are compared
        // with that form (rule 6).
        enc.rewritten = true;
        if let Ok(n) = text.parse::<u64>() {
            n.serialize(&mut *enc)?;
        } else if let Ok(n) = text.parse::<i64>() {
            // `-0` is serde_json's float `-0.0` (without the feature too), not
            // the integer `0`.
            if n == 0 {
                (-0.0_f64).serialize(&mut *enc)?;
            } else {
                n.serialize(&mut *enc)?;
            }
        } else {
            let exact = text.parse::<f64>().ok().filter(|f| {
                let written = serde_json::to_vec(f).unwrap_or_default();
                f.is_finite()
                    && super::json::canonical_json(&written)
                        == super::json::canonical_json(text.as_bytes())
            });
            let Some(f) = exact else {
                return Err(EncodeError::custom(
                    "a serde_json number held as text (its `arbitrary_precision` feature) that no \
                     u64, i64 or f64 holds exactly: its canonical form cannot tell it from the \
                     number it rounds to; pass it as a string, or a type of your own",
                ));
            };
            f.serialize(&mut *enc)?;
        }
        Ok(())
    }

    fn finish(self) -> Result<KeyKind> {
        if self.enc.mode != Mode::Check && !self.raw {
            if self.enc.entries.len() - self.first >= 2 {
                self.enc
                    .sort_entries(self.first, self.region, self.names_are_sources);
            }
            self.enc.entries.truncate(self.first);
            self.enc.keys.truncate(self.keys_base);
        }
        if !self.raw {
            self.enc.put_byte(b'}');
        }
        self.enc.close_variant(self.variant);
        Ok(KeyKind::Other)
    }
}

impl SerializeMap for Map<'_> {
    type Ok = KeyKind;
    type Error = EncodeError;

    fn serialize_key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result<()> {
        if self.enc.mode != Mode::Check {
            self.pending = Some(self.key(key)?);
        }
        Ok(())
    }

    fn serialize_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
        if self.enc.mode == Mode::Check {
            let entry = self.count;
            self.count += 1;
            return self.enc.nested(value).map(|_| ()).map_err(|e| {
                e.at(Segment::Key(format!("key #{entry}")))
                    .in_variant(self.variant)
            });
        }
        match self.pending.take() {
            Some(pending) => {
                let entry = self.count;
                self.value(pending, value, |_| Map::entry_segment(entry))
            }
            None => Err(ser::Error::custom(
                "serialize_value was called before serialize_key",
            )),
        }
    }

    fn serialize_entry<K: ?Sized + Serialize, V: ?Sized + Serialize>(
        &mut self,
        key: &K,
        value: &V,
    ) -> Result<()> {
        self.entry(key, value)
    }

    fn end(self) -> Result<KeyKind> {
        self.finish()
    }
}

macro_rules! struct_impl {
    ($($trait:ident),*) => {$(
        impl $trait for Map<'_> {
            type Ok = KeyKind;
            type Error = EncodeError;
            fn serialize_field<T: ?Sized + Serialize>(
                &mut self,
                name: &'static str,
                value: &T,
            ) -> Result<()> {
                self.field(name, value)
            }
            fn end(self) -> Result<KeyKind> {
                self.finish()
            }
        }
    )*};
}

struct_impl!(SerializeStruct, SerializeStructVariant);

// ---------------------------------------------------------------------------
// Map keys

/// Writes a map key: strings, chars and unit variants as JSON strings,
/// numbers and bools as JSON strings of their text (both as v1, which used
/// serde_json's key rules), anything else as its canonical bytes (v2; v1
/// refused them). Keeps the text (or the bytes) as the entry's sort key.
struct KeySerializer<'a> {
    enc: &'a mut Encoder,
}

impl<'a> KeySerializer<'a> {
    fn text(self, s: &str) -> Result<KeyKind> {
        self.enc.put_str(s)?;
        self.enc.keys.extend_from_slice(s.as_bytes());
        Ok(KeyKind::Text)
    }

    /// A newtype struct as a key: the key it wraps.
    fn wrapped<T: ?Sized + Serialize>(self, value: &T) -> Result<KeyKind> {
        value.serialize(self)
    }

    fn scalar(self, write: impl FnOnce(&mut Vec<u8>) -> io::Result<()>) -> Result<KeyKind> {
        let enc = self.enc;
        let start = enc.keys.len();
        write(&mut enc.keys).map_err(EncodeError::custom)?;
        enc.out.push(b'"');
        enc.out.extend_from_slice(&enc.keys[start..]);
        enc.out.push(b'"');
        Ok(KeyKind::Scalar)
    }

    /// A key v1 refused: written by the main serializer (v2) or an error (v1).
    fn other(self) -> Result<&'a mut Encoder> {
        match self.enc.mode {
            Mode::Legacy => Err(EncodeError::new(Problem::NotInV1(
                "a map key that is not a string, number, bool or unit variant",
            ))),
            _ => {
                self.enc.extended = true;
                Ok(self.enc)
            }
        }
    }
}

/// Methods of [`KeySerializer`] for keys v1 refused (see
/// [`KeySerializer::other`]): each hands its value, as it came, to the main
/// serializer. `<T>` marks a method generic over the value's type.
macro_rules! key_other {
    ($($method:ident $(<$t:ident>)? ($($arg:ident: $ty:ty),* $(,)?) -> $ok:ty;)*) => {$(
        fn $method $(<$t: ?Sized + Serialize>)? (self, $($arg: $ty),*) -> Result<$ok> {
            self.other()?.$method($($arg),*)
        }
    )*};
}

impl<'a> Serializer for KeySerializer<'a> {
    type Ok = KeyKind;
    type Error = EncodeError;
    // A compound key is written by the main serializer (`other`).
    type SerializeSeq = <&'a mut Encoder as Serializer>::SerializeSeq;
    type SerializeTuple = <&'a mut Encoder as Serializer>::SerializeTuple;
    type SerializeTupleStruct = <&'a mut Encoder as Serializer>::SerializeTupleStruct;
    type SerializeTupleVariant = <&'a mut Encoder as Serializer>::SerializeTupleVariant;
    type SerializeMap = <&'a mut Encoder as Serializer>::SerializeMap;
    type SerializeStruct = <&'a mut Encoder as Serializer>::SerializeStruct;
    type SerializeStructVariant = <&'a mut Encoder as Serializer>::SerializeStructVariant;

    fn serialize_bool(self, v: bool) -> Result<KeyKind> {
        self.scalar(|w| {
            w.extend_from_slice(if v { b"true" } else { b"false" });
            Ok(())
        })
    }

    via!(scalar);

    via! {
        scalar:
        serialize_i128(i128) => write_i128 as i128;
        serialize_u128(u128) => write_u128 as u128;
    }

    fn serialize_f32(self, v: f32) -> Result<KeyKind> {
        if v.is_finite() {
            // serde_json writes f32 keys at f32 precision (values are widened).
            self.scalar(|w| write_float(w, |w| CompactFormatter.write_f32(w, v)))
        } else {
            self.other()?.serialize_f32(v)
        }
    }

    fn serialize_f64(self, v: f64) -> Result<KeyKind> {
        if v.is_finite() {
            self.scalar(|w| write_float(w, |w| CompactFormatter.write_f64(w, v)))
        } else {
            self.other()?.serialize_f64(v)
        }
    }

    alike_methods!();

    key_other! {
        serialize_bytes(v: &[u8]) -> KeyKind;
        serialize_none() -> KeyKind;
        serialize_some<T>(value: &T) -> KeyKind;
        serialize_unit() -> KeyKind;
        serialize_unit_struct(name: &'static str) -> KeyKind;
        serialize_newtype_variant<T>(
            name: &'static str,
            index: u32,
            variant: &'static str,
            value: &T,
        ) -> KeyKind;
        serialize_seq(len: Option<usize>) -> Seq<'a>;
        serialize_tuple(len: usize) -> Seq<'a>;
        serialize_tuple_struct(name: &'static str, len: usize) -> Seq<'a>;
        serialize_tuple_variant(
            name: &'static str,
            index: u32,
            variant: &'static str,
            len: usize,
        ) -> Seq<'a>;
        serialize_map(len: Option<usize>) -> Map<'a>;
        serialize_struct(name: &'static str, len: usize) -> Map<'a>;
        serialize_struct_variant(
            name: &'static str,
            index: u32,
            variant: &'static str,
            len: usize,
        ) -> Map<'a>;
    }

    fn collect_seq<I>(self, iter: I) -> Result<KeyKind>
    where
        I: IntoIterator,
        I::Item: Serialize,
    {
        self.other()?.collect_seq(iter)
    }
}

#[cfg(test)]
mod tests {
    use super::write_float;
    use std::io::Write;

    /// The text `write_float` makes of what a formatter wrote.
    fn written(formatter_text: &str) -> String {
        let mut out = b"[".to_vec();
        write_float(&mut out, |w| w.write_all(formatter_text.as_bytes())).expect("a Vec takes it");
        String::from_utf8(out).expect("ASCII")
    }

    /// Rule 6: the canonical text of a float does not change with the
    /// serde_json the build resolved. The lockfile's serde_json (1.0.147 or
    /// later) already writes `1e+17`, so the fingerprint tests of floats pass
    /// whether or not the sign is added; this feeds `write_float` the text
    /// serde_json up to 1.0.146 wrote (`1e17`), which the manifest admits.
    #[test]
    fn a_positive_exponent_gets_its_sign_whatever_the_formatter_wrote() {
        assert_eq!(written("1e17"), "[1e+17");
        assert_eq!(
            written("-1.2345678901234568e17"),
            "[-1.2345678901234568e+17"
        );
        assert_eq!(
            written("1.7976931348623157e308"),
            "[1.7976931348623157e+308"
        );
        // Already signed, negative, or no exponent at all: as written.
        assert_eq!(written("1e+17"), "[1e+17");
        assert_eq!(written("1e-7"), "[1e-7");
        assert_eq!(written("1000000000000000.0"), "[1000000000000000.0");
    }
}
