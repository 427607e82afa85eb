//! The fingerprint of an HTTP request: method, request target and body, with
//! JSON bodies in a canonical form.
//!
//! # The canonical form (`http1`)
//!
//! SHA-256 over, in order: the method and the request target (path and
//! query, as sent), each preceded by its length as a big-endian `u64`; then
//! one byte saying how the body was read, and the body:
//!
//! * `j` + canonical JSON, when the `Content-Type` is JSON
//!   (`application/json` or any `…/…+json`) and the body is valid JSON:
//!   object members sorted by key (byte order of the decoded key; members
//!   with equal keys keep their order), no whitespace, strings re-escaped
//!   the way `serde_json` writes them, and numbers as exact decimals:
//!   `[-]DIGITSeEXP` with no leading or trailing zeros in `DIGITS`, so
//!   `1`, `1.0`, `1.00` and `10e-1` are one value, while two numbers that
//!   differ in any digit never are (no rounding through `f64`);
//! * `r` + the raw bytes otherwise (not JSON, invalid JSON, nesting deeper
//!   than 128, an exponent beyond `i64`).
//!
//! The stored fingerprint is `http1:` followed by the lowercase hex digest.
//! The body is read where it lies: the canonical form is streamed into the
//! hash, never built as a second copy of the body.

use crate::fingerprint::Fingerprint;
use axum::http::{header, HeaderMap, Method};
use sha2::{Digest, Sha256};
use std::borrow::Cow;

/// The version prefix of HTTP request fingerprints.
pub const HTTP_FINGERPRINT_VERSION: &str = "http1";

const MAX_DEPTH: usize = 128;

/// Whether a `Content-Type` names JSON: `application/json` or `…+json`.
///
/// ```
/// use idempotent_runtime::http::is_json_content_type;
/// assert!(is_json_content_type("application/json; charset=utf-8"));
/// assert!(is_json_content_type("application/merge-patch+json"));
/// assert!(!is_json_content_type("text/plain"));
/// ```
pub fn is_json_content_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence
            .rsplit_once('+')
            .is_some_and(|(_, suffix)| suffix.eq_ignore_ascii_case("json"))
}

/// The fingerprint of a request: SHA-256 over its method, request target
/// (path and query, as sent) and body, a JSON body in a canonical form
/// (members sorted, numbers as exact decimals), labelled `http1:`.
///
/// ```
/// use axum::http::{HeaderMap, Method};
/// use idempotent_runtime::http::request_fingerprint;
/// let mut json = HeaderMap::new();
/// json.insert("content-type", "application/json".parse().unwrap());
/// let a = request_fingerprint(&Method::POST, "/payments", &json, br#"{"amount":10,"currency":"EUR"}"#);
/// let b = request_fingerprint(&Method::POST, "/payments", &json, b"{ \"currency\": \"EUR\",\n \"amount\": 10.0 }");
/// assert_eq!(a, b);
/// let c = request_fingerprint(&Method::POST, "/payments", &json, br#"{"amount":11,"currency":"EUR"}"#);
/// assert_ne!(a, c);
/// ```
pub fn request_fingerprint(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Fingerprint {
    let mut hash = Sha256::new();
    for part in [method.as_str().as_bytes(), target.as_bytes()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json_content_type);
    let canonical = if json { parse_json(body) } else { None };
    match canonical {
        Some(node) => {
            hash.update(b"j");
            node.write(&mut hash);
        }
        None => {
            hash.update(b"r");
            hash.update(body);
        }
    }
    Fingerprint::from_stored(format!(
        "{HTTP_FINGERPRINT_VERSION}:{}",
        hex::encode(hash.finalize())
    ))
}

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
enum Node<'a> {
    Literal(&'static [u8]),
    Number(Number<'a>),
    String(Cow<'a, str>),
    Array(Vec<Node<'a>>),
    Object(Vec<(Cow<'a, str>, Node<'a>)>),
}

/// An exact decimal: `(-1)^negative × digits × 10^exponent`, normalized.
struct Number<'a> {
    negative: bool,
    /// The integer part's digits and the fraction's digits (ASCII).
    int: &'a [u8],
    frac: &'a [u8],
    /// The written exponent minus the fraction's length.
    exponent: i64,
}

trait Sink {
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
    fn write<S: Sink + ?Sized>(&self, out: &mut S) {
        match self {
            Node::Literal(l) => out.put(l),
            Node::Number(n) => n.write(out),
            Node::String(s) => put_string(out, s),
            Node::Array(items) => {
                out.put(b"[");
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.put(b",");
                    }
                    item.write(out);
                }
                out.put(b"]");
            }
            Node::Object(members) => {
                let mut sorted: Vec<&(Cow<'_, str>, Node<'_>)> = members.iter().collect();
                // Stable: members with equal keys keep their order.
                sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                out.put(b"{");
                for (i, (k, v)) in sorted.into_iter().enumerate() {
                    if i > 0 {
                        out.put(b",");
                    }
                    put_string(out, k);
                    out.put(b":");
                    v.write(out);
                }
                out.put(b"}");
            }
        }
    }
}

impl Number<'_> {
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

fn parse_json(body: &[u8]) -> Option<Node<'_>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonical_json(s.as_bytes()).expect("valid JSON")).unwrap()
    }

    #[test]
    fn numbers_are_exact_decimals() {
        assert_eq!(canon("1"), "1e0");
        assert_eq!(canon("1.0"), "1e0");
        assert_eq!(canon("10e-1"), "1e0");
        assert_eq!(canon("100"), "1e2");
        assert_eq!(canon("-0.0"), "0");
        assert_eq!(canon("0"), "0");
        assert_eq!(canon("0.000120"), "12e-5");
        // Beyond f64's precision, still distinct.
        assert_ne!(canon("18446744073709551617"), canon("18446744073709551616"));
        assert_ne!(canon("0.1000000000000000000001"), canon("0.1"));
        // Exponent overflow: not canonical, fingerprinted raw.
        assert!(canonical_json(b"1e9223372036854775807").is_none());
        assert_eq!(canon("1e9223372036854775806"), "1e9223372036854775806");
    }

    #[test]
    fn invalid_json_is_refused() {
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\"}",
            "01",
            "1.",
            "-",
            "1e",
            "tru",
            "\"\\x\"",
            "\"a\nb\"",
            "\"\\ud800\"",
            "\"\\udc00\"",
            "[1] 2",
            "{\"a\":1,}",
            "+1",
            ".5",
        ] {
            assert!(
                canonical_json(bad.as_bytes()).is_none(),
                "{bad:?} should be refused"
            );
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(canonical_json(deep.as_bytes()).is_none());
        let ok = "[".repeat(100) + &"]".repeat(100);
        assert!(canonical_json(ok.as_bytes()).is_some());
    }

    #[test]
    fn strings_are_re_escaped() {
        assert_eq!(canon(r#""\u0041\/\n""#), r#""A/\n""#);
        assert_eq!(canon(r#""\ud83d\ude00""#), "\"😀\"");
        assert_eq!(canon("\"😀é\""), "\"😀é\"");
    }

    #[test]
    fn duplicate_keys_keep_their_order() {
        assert_ne!(canon(r#"{"a":1,"a":2}"#), canon(r#"{"a":2,"a":1}"#));
    }

    #[test]
    fn method_target_and_kind_are_separated() {
        let mut json = HeaderMap::new();
        json.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        let plain = HeaderMap::new();
        let body = br#"{"a":1}"#;
        let base = request_fingerprint(&Method::POST, "/a", &json, body);
        assert!(base.as_str().starts_with("http1:"));
        assert_ne!(base, request_fingerprint(&Method::PUT, "/a", &json, body));
        assert_ne!(base, request_fingerprint(&Method::POST, "/b", &json, body));
        assert_ne!(
            base,
            request_fingerprint(&Method::POST, "/a?x=1", &json, body)
        );
        assert_ne!(base, request_fingerprint(&Method::POST, "/a", &plain, body));
        // Raw bodies: whitespace matters.
        assert_ne!(
            request_fingerprint(&Method::POST, "/a", &plain, b"x y"),
            request_fingerprint(&Method::POST, "/a", &plain, b"x  y")
        );
    }

    fn arb_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i64>().prop_map(|n| n.into()),
            // Floats with a fraction, so that no float equals an integer
            // (1 and 1.0 are one value in the canonical form, not in serde_json's).
            any::<f64>()
                .prop_filter("finite, with a fraction", |f| f.is_finite()
                    && f.fract() != 0.0)
                .prop_map(|f| f.into()),
            ".{0,8}".prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                proptest::collection::btree_map(".{0,6}", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Writes objects with their members in reverse order, pretty or compact.
    fn reversed(v: &serde_json::Value) -> String {
        match v {
            serde_json::Value::Object(m) => {
                let members: Vec<String> = m
                    .iter()
                    .rev()
                    .map(|(k, v)| {
                        format!("{} :\n {}", serde_json::to_string(k).unwrap(), reversed(v))
                    })
                    .collect();
                format!("{{ {} }}", members.join(" ,\t"))
            }
            serde_json::Value::Array(items) => {
                let items: Vec<String> = items.iter().map(reversed).collect();
                format!("[ {} ]", items.join(" , "))
            }
            other => other.to_string(),
        }
    }

    proptest! {
        #[test]
        fn key_order_and_whitespace_do_not_matter(v in arb_json()) {
            let compact = serde_json::to_string(&v).unwrap();
            let pretty = serde_json::to_string_pretty(&v).unwrap();
            let rev = reversed(&v);
            let c = canonical_json(compact.as_bytes()).expect("serde_json output is valid JSON");
            prop_assert_eq!(&c, &canonical_json(pretty.as_bytes()).unwrap());
            prop_assert_eq!(&c, &canonical_json(rev.as_bytes()).unwrap());
            // The canonical form is itself valid JSON, and canonical.
            prop_assert!(serde_json::from_slice::<serde_json::Value>(&c).is_ok());
            prop_assert_eq!(&c, &canonical_json(&c).unwrap());
        }

        #[test]
        fn different_values_differ(a in arb_json(), b in arb_json()) {
            if a != b {
                let ca = canonical_json(a.to_string().as_bytes()).unwrap();
                let cb = canonical_json(b.to_string().as_bytes()).unwrap();
                prop_assert_ne!(ca, cb);
            }
        }
    }
}
