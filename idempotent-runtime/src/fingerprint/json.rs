//! Canonical JSON text: members sorted by key (byte order of the decoded
//! key; members with equal keys keep their order), no whitespace, strings
//! re-escaped the way `serde_json` writes them, numbers as exact decimals
//! (`[-]DIGITSeEXP`, no leading or trailing zeros in `DIGITS`: `1`, `1.0` and
//! `10e-1` are one value; two numbers that differ in any digit never are).
//! Used for HTTP request bodies (`http1` fingerprints) and to tell whether a
//! `RawValue` argument survives being read as a `serde_json::Value`.

use sha2::{Digest, Sha256};
use std::borrow::Cow;

const MAX_DEPTH: usize = 128;

/// The canonical JSON of `body` as bytes, or `None` when it is not JSON the
/// canonical form can hold. For tests and for looking at what is hashed.
///
/// ```
/// use idempotent_runtime::http::canonical_json;
/// assert_eq!(canonical_json(br#"{ "b": [1.50, -0], "a": "\u00e9" }"#).unwrap(),
///            "{\"a\":\"é\",\"b\":[15e-1,0]}".as_bytes());
/// assert!(canonical_json(b"{not json").is_none());
/// ```
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let node = parse_json(body)?;
    let mut out = Vec::with_capacity(body.len());
    node.write(&mut out);
    Some(out)
}

// ---------------------------------------------------------------- the tree

/// A parsed JSON value that borrows from the body wherever it can.
pub(crate) enum Node<'a> {
    Literal(&'static [u8]),
    Number(Number<'a>),
    String(Cow<'a, str>),
    Array(Vec<Node<'a>>),
    Object(Vec<(Cow<'a, str>, Node<'a>)>),
}

/// An exact decimal: `(-1)^negative × digits × 10^exponent`, normalized.
pub(crate) struct Number<'a> {
    negative: bool,
    /// The integer part's digits and the fraction's digits (ASCII).
    int: &'a [u8],
    frac: &'a [u8],
    /// The written exponent minus the fraction's length.
    exponent: i64,
}

/// Where canonical bytes go: a hash or a buffer.
pub(crate) trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

struct SinkWriter<'s, S: Sink + ?Sized>(&'s mut S);

impl<S: Sink + ?Sized> std::io::Write for SinkWriter<'_, S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.put(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn put_string<S: Sink + ?Sized>(out: &mut S, s: &str) {
    // The writer never fails, and serde_json's escaping of a `str` cannot
    // fail otherwise; the result carries nothing to handle.
    let _ = serde_json::to_writer(SinkWriter(out), s);
}

impl Node<'_> {
    /// Writes the canonical form.
    pub(crate) fn write<S: Sink + ?Sized>(&self, out: &mut S) {
        match self {
            Node::Literal(l) => out.put(l),
            Node::Number(n) => n.write(out),
            Node::String(s) => put_string(out, s),
            Node::Array(items) => put_list(out, b"[", items, b"]", |out, item| item.write(out)),
            Node::Object(members) => {
                let mut sorted: Vec<&(Cow<'_, str>, Node<'_>)> = members.iter().collect();
                // Stable: members with equal keys keep their order.
                sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                put_list(out, b"{", sorted, b"}", |out, (k, v)| {
                    put_string(out, k);
                    out.put(b":");
                    v.write(out);
                });
            }
        }
    }
}

/// Writes `items` between `open` and `close`, separated by commas, each by
/// `write`: the canonical form of an array or an object.
fn put_list<S: Sink + ?Sized, I: IntoIterator>(
    out: &mut S,
    open: &[u8],
    items: I,
    close: &[u8],
    mut write: impl FnMut(&mut S, I::Item),
) {
    out.put(open);
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.put(b",");
        }
        write(out, item);
    }
    out.put(close);
}

impl Node<'_> {
    /// Writes the canonical form with every array's elements (and every
    /// object's members of one name) in the order of their bytes: the same
    /// for a value whose sets or lists a writer put in another order.
    pub(crate) fn write_unordered(&self, out: &mut Vec<u8>) {
        // Each part written on its own, then the parts in byte order.
        let sorted = |open: u8, parts: Vec<Vec<u8>>, close: u8, out: &mut Vec<u8>| {
            let mut parts = parts;
            parts.sort();
            out.push(open);
            out.extend_from_slice(&parts.join(&b','));
            out.push(close);
        };
        let part = |name: Option<&str>, value: &Node<'_>| {
            let mut part = Vec::new();
            if let Some(name) = name {
                put_string(&mut part, name);
                part.push(b':');
            }
            value.write_unordered(&mut part);
            part
        };
        match self {
            Node::Array(items) => {
                let parts = items.iter().map(|item| part(None, item)).collect();
                sorted(b'[', parts, b']', out);
            }
            Node::Object(members) => {
                let parts = members.iter().map(|(k, v)| part(Some(k), v)).collect();
                sorted(b'{', parts, b'}', out);
            }
            leaf => leaf.write(out),
        }
    }
}

impl Number<'_> {
    /// The number in the form it was written: its sign, its digits before
    /// and after the point, and its exponent, as they stand (`7` and `7.0`
    /// differ, as do two integers of any size that differ in a digit).
    pub(crate) fn as_written(&self) -> String {
        format!(
            "{}{}.{}e{}",
            if self.negative { "-" } else { "" },
            String::from_utf8_lossy(self.int),
            String::from_utf8_lossy(self.frac),
            self.exponent
        )
    }

    fn write<S: Sink + ?Sized>(&self, out: &mut S) {
        let all = || self.int.iter().chain(self.frac.iter()).copied();
        let leading = all().take_while(|&d| d == b'0').count();
        let total = self.int.len() + self.frac.len();
        if leading == total {
            out.put(b"0"); // zero, whatever its sign or exponent
            return;
        }
        let trailing = all().rev().take_while(|&d| d == b'0').count();
        let digits: Vec<u8> = all()
            .skip(leading)
            .take(total - leading - trailing)
            .collect();
        // `parse_number` checked that this addition cannot overflow.
        let exponent = self.exponent + trailing as i64;
        if self.negative {
            out.put(b"-");
        }
        out.put(&digits);
        out.put(format!("e{exponent}").as_bytes());
    }
}

// ---------------------------------------------------------------- the parser

/// Parses `body` as JSON; `None` when it is not JSON the canonical form can
/// hold (not UTF-8, invalid, nested deeper than 128, an exponent beyond `i64`).
pub(crate) fn parse_json(body: &[u8]) -> Option<Node<'_>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        pos: 0,
    };
    p.ws();
    let node = p.value(0)?;
    p.ws();
    (p.pos == p.s.len()).then_some(node)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek() == Some(b)).then(|| self.pos += 1)
    }

    fn literal(&mut self, word: &'static [u8]) -> Option<Node<'a>> {
        let end = self.pos.checked_add(word.len())?;
        (self.s.get(self.pos..end) == Some(word)).then(|| {
            self.pos = end;
            Node::Literal(word)
        })
    }

    fn value(&mut self, depth: usize) -> Option<Node<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'n' => self.literal(b"null"),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'"' => self.string().map(Node::String),
            b'[' => self.list(b']', |p| p.value(depth + 1)).map(Node::Array),
            b'{' => self
                .list(b'}', |p| {
                    if p.peek()? != b'"' {
                        return None;
                    }
                    let key = p.string()?;
                    p.ws();
                    p.eat(b':')?;
                    p.ws();
                    Some((key, p.value(depth + 1)?))
                })
                .map(Node::Object),
            b'-' | b'0'..=b'9' => self.number().map(Node::Number),
            _ => None,
        }
    }

    /// The items of an array or object, after its opening bracket (at
    /// `self.pos`) up to `close`: none, or `item`s separated by commas, with
    /// white space around each.
    fn list<T>(
        &mut self,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Option<T>,
    ) -> Option<Vec<T>> {
        self.pos += 1;
        let mut items = Vec::new();
        self.ws();
        if self.eat(close).is_some() {
            return Some(items);
        }
        loop {
            self.ws();
            items.push(item(self)?);
            self.ws();
            if self.eat(b',').is_none() {
                self.eat(close)?;
                return Some(items);
            }
        }
    }

    fn digits(&mut self) -> &'a [u8] {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        &self.s[start..self.pos]
    }

    fn number(&mut self) -> Option<Number<'a>> {
        let negative = self.eat(b'-').is_some();
        let int = self.digits();
        if int.is_empty() || (int.len() > 1 && int[0] == b'0') {
            return None;
        }
        let frac = if self.eat(b'.').is_some() {
            let f = self.digits();
            if f.is_empty() {
                return None;
            }
            f
        } else {
            &[]
        };
        let mut written: i64 = 0;
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            let sign: i64 = match self.peek() {
                Some(b'-') => {
                    self.pos += 1;
                    -1
                }
                Some(b'+') => {
                    self.pos += 1;
                    1
                }
                _ => 1,
            };
            let e = self.digits();
            if e.is_empty() {
                return None;
            }
            for &d in e {
                written = written
                    .checked_mul(10)?
                    .checked_add(sign * i64::from(d - b'0'))?;
            }
        }
        let frac_len = i64::try_from(frac.len()).ok()?;
        let total = i64::try_from(int.len() + frac.len()).ok()?;
        let exponent = written.checked_sub(frac_len)?;
        // Normalizing adds at most `total` (trailing zeros) to the exponent.
        exponent.checked_add(total)?;
        Some(Number {
            negative,
            int,
            frac,
            exponent,
        })
    }

    /// A string starting at the opening quote; borrowed when it has no escapes.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let start = self.pos;
        loop {
            match self.peek()? {
                b'"' => {
                    let s = &self.text[start..self.pos];
                    self.pos += 1;
                    return Some(Cow::Borrowed(s));
                }
                b'\\' => break,
                0x00..=0x1f => return None,
                _ => self.pos += 1,
            }
        }
        let mut out = String::from(&self.text[start..self.pos]);
        loop {
            match self.peek()? {
                b'"' => {
                    self.pos += 1;
                    return Some(Cow::Owned(out));
                }
                b'\\' => {
                    self.pos += 1;
                    let c = match self.peek()? {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            self.pos += 1;
                            let hi = self.hex4()?;
                            let c = if (0xD800..0xDC00).contains(&hi) {
                                self.eat(b'\\')?;
                                self.eat(b'u')?;
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return None;
                                }
                                char::from_u32(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00))?
                            } else {
                                char::from_u32(hi)? // a lone low surrogate is refused here
                            };
                            out.push(c);
                            continue;
                        }
                        _ => return None,
                    };
                    self.pos += 1;
                    out.push(c);
                }
                0x00..=0x1f => return None,
                _ => {
                    // Copy one whole UTF-8 character.
                    let rest = &self.text[self.pos..];
                    let c = rest.chars().next()?;
                    out.push(c);
                    self.pos += c.len_utf8();
                }
            }
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let end = self.pos.checked_add(4)?;
        let hex = self.text.get(self.pos..end)?;
        let v = u32::from_str_radix(hex, 16).ok()?;
        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        self.pos = end;
        Some(v)
    }
}
