//! The fingerprint of an HTTP request: method, request target and body, with
//! JSON bodies in a canonical form.
//!
//! # The canonical form (`http1`, and `http2` below)
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
//! A JSON body may start with a UTF-8 byte order mark, which is left out. A
//! body sent with a `Content-Encoding` other than `identity` is not read as
//! JSON (its bytes are compressed): it is hashed raw, after `e`, the length
//! and the encodings (every `Content-Encoding` value, lowercase, in order,
//! joined by commas), so the same bytes under another encoding are another
//! request. Earlier versions ignored both (lossy: an encoded request had
//! the fingerprint of the same bytes sent plain), so there is no legacy form
//! for them: a retry of such a request recorded by an earlier version is a
//! mismatch until that record expires.
//!
//! # The media type (`http2`)
//!
//! The current form, `http2`, is the above preceded by `t`, the length and
//! the essence of the request's `Content-Type` (`type/subtype`, spaces and
//! tabs trimmed, ASCII lowercase, bytes as sent; parameters such as `charset`
//! left out; every `Content-Type` header, joined by commas; empty without one),
//! right after the target. The same bytes as `text/plain` and as
//! `application/octet-stream`, or one JSON body as `application/json` and as
//! `application/merge-patch+json`, are two requests; `http1` left the media
//! type out and took them for one. An `http2` fingerprint carries its `http1`
//! form as its legacy one, so a retry of a request an earlier version
//! recorded is still answered from that record (compared as `http1` did)
//! until it expires; every record this version creates carries `http2` (one
//! it takes over from an earlier version's owner that died keeps `http1`).
//!
//! The stored fingerprint is `http2:` followed by the lowercase hex digest.
//! The body is read where it lies: the canonical form is streamed into the
//! hash, never built as a second copy of the body.

pub use crate::fingerprint::json::canonical_json;
use crate::fingerprint::json::parse_json;
use crate::fingerprint::Fingerprint;
use axum::http::{header, HeaderMap, Method};
use sha2::{Digest, Sha256};

/// The version prefix of HTTP request fingerprints.
pub const HTTP_FINGERPRINT_VERSION: &str = crate::fingerprint::HTTP_V2;

/// The version before the media type counted (see the module doc).
const LEGACY_HTTP_FINGERPRINT_VERSION: &str = crate::fingerprint::HTTP_V1;

/// The essence of every `Content-Type` value (`type/subtype`, spaces and
/// tabs trimmed, ASCII lowercased; the bytes as sent otherwise), joined by
/// commas; empty without one. Every header counts, as for `Content-Encoding`.
fn media_type(headers: &HeaderMap) -> Vec<u8> {
    let mut essences: Vec<Vec<u8>> = Vec::new();
    for value in headers.get_all(header::CONTENT_TYPE) {
        let bytes = value.as_bytes();
        let essence = bytes.split(|b| *b == b';').next().unwrap_or_default();
        let start = essence.iter().position(|b| !matches!(b, b' ' | b'\t'));
        let end = essence.iter().rposition(|b| !matches!(b, b' ' | b'\t'));
        let trimmed = match (start, end) {
            (Some(start), Some(end)) => &essence[start..=end],
            _ => &[][..],
        };
        essences.push(trimmed.to_ascii_lowercase());
    }
    essences.join(&b',')
}

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
/// (members sorted, numbers as exact decimals) and its media type,
/// labelled `http2:`.
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
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json_content_type);
    let encodings: Vec<String> = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .flat_map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .split(',')
                .map(|e| e.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter(|e| !e.is_empty() && e != "identity")
        .collect();
    let encoding = (!encodings.is_empty()).then(|| encodings.join(","));
    let unmarked = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let canonical = match &encoding {
        None if json => parse_json(unmarked),
        _ => None,
    };
    let write_body = |hash: &mut Sha256| {
        if let Some(node) = &canonical {
            hash.update(b"j");
            node.write(hash);
            return;
        }
        if let Some(encoding) = &encoding {
            hash.update(b"e");
            hash.update((encoding.len() as u64).to_be_bytes());
            hash.update(encoding.as_bytes());
        }
        hash.update(b"r");
        hash.update(body);
    };
    let media_type = media_type(headers);
    let current = hashed(HTTP_FINGERPRINT_VERSION, method, target, |hash| {
        hash.update(b"t");
        hash.update((media_type.len() as u64).to_be_bytes());
        hash.update(&media_type);
        write_body(hash);
    });
    let without_media_type = hashed(LEGACY_HTTP_FINGERPRINT_VERSION, method, target, write_body);
    Fingerprint::with_legacy(current, without_media_type)
}

/// `<version>:` and the hex SHA-256 of the method, the target and what
/// `body` writes.
fn hashed(version: &str, method: &Method, target: &str, body: impl FnOnce(&mut Sha256)) -> String {
    let mut hash = Sha256::new();
    for part in [method.as_str().as_bytes(), target.as_bytes()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    body(&mut hash);
    format!("{version}:{}", hex::encode(hash.finalize()))
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
        assert!(base.as_str().starts_with("http2:"));
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

    /// Rule 7: the same bytes under another `Content-Encoding` are another
    /// request (they were one, and the second was replayed the first's
    /// answer), every `Content-Encoding` header counting; `identity` is no
    /// encoding.
    #[test]
    fn the_content_encoding_is_part_of_the_request() {
        let with = |encoding: Option<&str>| {
            let mut headers = HeaderMap::new();
            if let Some(e) = encoding {
                headers.insert(header::CONTENT_ENCODING, e.parse().unwrap());
            }
            request_fingerprint(&Method::POST, "/a", &headers, b"abc")
        };
        let plain = with(None);
        assert_ne!(
            plain.legacy(),
            None,
            "its http1 form, without the media type"
        );
        assert_eq!(plain, with(Some("identity")));
        let br = with(Some("br"));
        assert_ne!(plain, br);
        assert_ne!(br, with(Some("gzip")));
        assert_eq!(br, with(Some(" BR ")), "the name, trimmed, in any case");
        assert_ne!(
            br.legacy(),
            plain.legacy(),
            "http1 counted the encoding too"
        );
        let mut two = HeaderMap::new();
        two.append(header::CONTENT_ENCODING, "gzip".parse().unwrap());
        two.append(header::CONTENT_ENCODING, "br".parse().unwrap());
        let gzip_br = request_fingerprint(&Method::POST, "/a", &two, b"abc");
        assert_ne!(gzip_br, with(Some("gzip")), "every header counts");
        assert_eq!(gzip_br, with(Some("gzip, br")));
    }

    /// Rule 22: the same bytes under another media type are another request
    /// (they were one, and the second was replayed the first's answer). The
    /// `http1` form, which left the media type out, is the legacy one, so a
    /// record an earlier version made still answers its retries.
    #[test]
    fn the_media_type_is_part_of_the_request() {
        let with = |content_type: Option<&str>, body: &[u8]| {
            let mut headers = HeaderMap::new();
            if let Some(t) = content_type {
                headers.insert(header::CONTENT_TYPE, t.parse().unwrap());
            }
            request_fingerprint(&Method::POST, "/a", &headers, body)
        };
        let text = with(Some("text/plain"), b"hello");
        assert_ne!(text, with(Some("application/octet-stream"), b"hello"));
        assert_ne!(text, with(None, b"hello"));
        assert_eq!(text.version(), HTTP_FINGERPRINT_VERSION);
        assert_eq!(text, with(Some(" Text/Plain; charset=utf-8"), b"hello"));
        // Bytes as sent: two different invalid bytes are two media types;
        // and every header counts.
        let raw = |value: &[u8]| {
            let mut headers = HeaderMap::new();
            headers.insert(
                header::CONTENT_TYPE,
                axum::http::HeaderValue::from_bytes(value).unwrap(),
            );
            request_fingerprint(&Method::POST, "/a", &headers, b"hello")
        };
        assert_ne!(raw(b"text/pla\xFF"), raw(b"text/pla\xFE"));
        let mut two = HeaderMap::new();
        two.append(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        two.append(header::CONTENT_TYPE, "text/csv".parse().unwrap());
        assert_ne!(
            text,
            request_fingerprint(&Method::POST, "/a", &two, b"hello")
        );
        let json = with(Some("application/json"), br#"{"a":1}"#);
        assert_eq!(
            json,
            with(Some("application/json; charset=utf-8"), br#"{"a": 1}"#)
        );
        let patch = with(Some("application/merge-patch+json"), br#"{"a":1}"#);
        assert_ne!(json, patch);
        // The legacy form: one for all media types, and never a current one.
        let legacy = patch.legacy().expect("an http1 form");
        assert_eq!(legacy.version(), "http1");
        assert_eq!(json.legacy(), Some(legacy));
        assert_ne!(
            text.legacy(),
            with(Some("text/plain"), b"hello!").legacy(),
            "the body still counts"
        );
    }

    /// A JSON body that starts with a byte order mark is the same JSON.
    #[test]
    fn a_byte_order_mark_before_json_is_left_out() {
        let mut json = HeaderMap::new();
        json.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        let body = br#"{"a":1}"#;
        let marked = [&b"\xEF\xBB\xBF"[..], &body[..]].concat();
        let plain = request_fingerprint(&Method::POST, "/a", &json, body);
        let with_mark = request_fingerprint(&Method::POST, "/a", &json, &marked);
        assert_eq!(plain, with_mark);
        assert_eq!(with_mark.legacy(), plain.legacy());
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
