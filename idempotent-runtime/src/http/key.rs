//! Reading the `Idempotency-Key` header, and the [`IdempotencyKey`] extractor.

use super::problem::{types, Problem};
use crate::error::{Error, KeyProblem};
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};

/// The header carrying the key: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Why an `Idempotency-Key` header was refused. Every variant answers 400
/// with a problem+json body ([`IntoResponse`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyRejection {
    /// The route requires a key and the request has none.
    #[error("this request needs an Idempotency-Key header: send one (e.g. a UUID made once per operation, reused by every retry of it)")]
    Missing,
    /// The header appears more than once.
    #[error("the Idempotency-Key header appears {count} times; send it exactly once")]
    Repeated {
        /// How many times it appears.
        count: usize,
    },
    /// The header is neither a bare token nor an RFC 8941 quoted string.
    #[error("the Idempotency-Key header is malformed: {reason}; send a bare token (`Idempotency-Key: 8e03978e-40d5`) or a quoted string (`Idempotency-Key: \"8e03978e-40d5\"`)")]
    Malformed {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The key itself is refused (empty, longer than 255 bytes, control character).
    #[error("invalid idempotency key: {0}")]
    Invalid(KeyProblem),
}

impl KeyRejection {
    /// The problem+json body this rejection answers with.
    pub fn problem(&self) -> Problem {
        match self {
            KeyRejection::Missing => Problem::new(
                StatusCode::BAD_REQUEST,
                types::MISSING_KEY,
                "Idempotency-Key required",
                "This request changes state, so it needs an Idempotency-Key header. Make a \
                 unique key (e.g. a UUID) once per operation and send it with every retry of \
                 that operation.",
            ),
            KeyRejection::Invalid(problem) => {
                super::problem::problem_for(&Error::InvalidKey(problem.clone()))
            }
            other => Problem::new(
                StatusCode::BAD_REQUEST,
                types::INVALID_KEY,
                "Invalid Idempotency-Key",
                other.to_string(),
            ),
        }
    }
}

impl IntoResponse for KeyRejection {
    fn into_response(self) -> Response {
        self.problem().into_response()
    }
}

/// Parses one `Idempotency-Key` header value: a bare token, or an RFC 8941
/// string (`"..."`, with `\"` and `\\` escapes). Leading and trailing spaces
/// are ignored. The key is then checked like every key (1–255 bytes, no
/// control characters).
///
/// A bare token is any run of visible ASCII characters without `"`, `\`,
/// `,` or `;` — so UUIDs, ULIDs, base64 and `order-8891-refund` all work
/// bare; the quoted form is what the IETF draft writes.
///
/// ```
/// use idempotent_runtime::http::parse_key;
/// assert_eq!(parse_key(b"8e03978e-40d5").unwrap(), "8e03978e-40d5");
/// assert_eq!(parse_key(br#""8e03978e-40d5""#).unwrap(), "8e03978e-40d5");
/// assert_eq!(parse_key(br#""a \"b\"""#).unwrap(), r#"a "b""#);
/// assert!(parse_key(br#""unterminated"#).is_err());
/// assert!(parse_key(b"").is_err());
/// ```
pub fn parse_key(value: &[u8]) -> Result<String, KeyRejection> {
    let trimmed = trim_spaces(value);
    let key = if let Some(rest) = trimmed.strip_prefix(b"\"") {
        parse_sf_string(rest)?
    } else {
        if trimmed.is_empty() {
            return Err(KeyRejection::Invalid(KeyProblem::Empty));
        }
        if let Some(&b) = trimmed
            .iter()
            .find(|&&b| !(0x21..=0x7e).contains(&b) || matches!(b, b'"' | b'\\' | b',' | b';'))
        {
            return Err(KeyRejection::Malformed {
                reason: if b == b' ' || b == b'\t' {
                    "a bare key cannot contain spaces (quote it)"
                } else if b >= 0x80 {
                    "it contains a non-ASCII byte"
                } else if b < 0x20 || b == 0x7f {
                    "it contains a control character"
                } else {
                    "a bare key cannot contain `\"`, `\\`, `,` or `;` (quote it, escaping `\"` and `\\`)"
                },
            });
        }
        // Every byte is visible ASCII, so this is valid UTF-8.
        String::from_utf8_lossy(trimmed).into_owned()
    };
    crate::identity::validate_key(&key).map_err(|e| match e {
        Error::InvalidKey(p) => KeyRejection::Invalid(p),
        _ => KeyRejection::Malformed {
            reason: "it is not a valid key",
        },
    })?;
    Ok(key)
}

fn trim_spaces(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// RFC 8941 §4.2.5: the bytes after the opening quote.
fn parse_sf_string(rest: &[u8]) -> Result<String, KeyRejection> {
    let mut out = String::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c as char),
                _ => {
                    return Err(KeyRejection::Malformed {
                        reason: "in a quoted key, `\\` may only escape `\"` or `\\`",
                    })
                }
            },
            b'"' => {
                if bytes.as_slice().is_empty() {
                    return Ok(out);
                }
                return Err(KeyRejection::Malformed {
                    reason:
                        "there is something after the closing quote (parameters are not accepted)",
                });
            }
            0x20..=0x7e => out.push(b as char),
            _ => {
                return Err(KeyRejection::Malformed {
                    reason: "a quoted key may only hold printable ASCII characters",
                })
            }
        }
    }
    Err(KeyRejection::Malformed {
        reason: "the quoted key has no closing quote",
    })
}

/// The request's key: `Ok(None)` when there is no `Idempotency-Key` header.
///
/// ```
/// use axum::http::HeaderMap;
/// use idempotent_runtime::http::key_from_headers;
/// let mut headers = HeaderMap::new();
/// assert_eq!(key_from_headers(&headers).unwrap(), None);
/// headers.insert("idempotency-key", "\"k-1\"".parse().unwrap());
/// assert_eq!(key_from_headers(&headers).unwrap().as_deref(), Some("k-1"));
/// ```
pub fn key_from_headers(headers: &HeaderMap) -> Result<Option<String>, KeyRejection> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    let others = values.count();
    if others > 0 {
        return Err(KeyRejection::Repeated { count: others + 1 });
    }
    parse_key(first.as_bytes()).map(Some)
}

/// An axum extractor for the request's `Idempotency-Key`, for handlers that
/// call `#[idempotent]` functions themselves (so the key reaches the function
/// as an argument). A missing or invalid header is refused with the same
/// problem+json 400 the layer sends. Use `Option<IdempotencyKey>` where the
/// key is optional (a malformed header is still refused).
///
/// ```
/// use axum::{routing::post, Extension, Json, Router};
/// use idempotent_runtime::http::{IdempotencyKey, MarkReplayed};
/// use idempotent_runtime::{idempotent, with_outcome, Error, MemoryStore};
///
/// // The key is the caller's: the tenant keeps one caller's answers from another (rule 22).
/// #[idempotent(scope = "docs.refunds", key = key, tenant = account, store = store)]
/// async fn refund(store: &MemoryStore, account: &str, key: &str, amount: u64) -> Result<u64, Error> {
///     Ok(amount)
/// }
///
/// #[derive(Clone)]
/// struct Account(String); // set by your authentication middleware
///
/// async fn handler(
///     Extension(account): Extension<Account>,
///     key: IdempotencyKey,
///     Json(amount): Json<u64>,
/// ) -> Result<(MarkReplayed, Json<u64>), Error> {
///     # let store = MemoryStore::new();
///     let (result, outcome) = with_outcome(refund(&store, &account.0, key.as_str(), amount)).await;
///     Ok((MarkReplayed(outcome), Json(result?)))   // `?`: an Error answers with rule 22's status
/// }
///
/// let app: Router = Router::new().route("/refunds", post(handler));
/// ```
///
/// `Display` gives the key itself (what `key = key` renders); `Debug` gives
/// a short digest of it, so a handler traced with `#[tracing::instrument]`
/// does not log the raw key (rule 2).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(pub String);

impl std::fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("digest", &crate::identity::short_digest(&[&self.0]))
            .finish()
    }
}

impl IdempotencyKey {
    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an owned string.
    pub fn into_inner(self) -> String {
        self.0
    }
}

impl std::fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for IdempotencyKey {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = KeyRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        match key_from_headers(&parts.headers)? {
            Some(key) => Ok(IdempotencyKey(key)),
            None => Err(KeyRejection::Missing),
        }
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = KeyRejection;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(key_from_headers(&parts.headers)?.map(IdempotencyKey))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule 2: `Debug` of the extractor shows a digest; `Display` (what
    /// `key = key` renders) stays the key.
    #[test]
    fn debug_shows_a_digest_and_display_the_key() {
        let key = IdempotencyKey("SECRET-KEY-4711".to_owned());
        assert!(!format!("{key:?}").contains("SECRET"), "{key:?}");
        assert_eq!(key.to_string(), "SECRET-KEY-4711");
    }

    #[test]
    fn bare_and_quoted_forms() {
        assert_eq!(parse_key(b"  abc-123  ").unwrap(), "abc-123");
        assert_eq!(parse_key(b"YWJj+/==").unwrap(), "YWJj+/==");
        assert_eq!(parse_key(br#""with space""#).unwrap(), "with space");
        assert_eq!(parse_key(br#""a\\b""#).unwrap(), r"a\b");
    }

    #[test]
    fn refusals_say_why() {
        assert!(matches!(
            parse_key(b""),
            Err(KeyRejection::Invalid(KeyProblem::Empty))
        ));
        assert!(matches!(
            parse_key(br#""""#),
            Err(KeyRejection::Invalid(KeyProblem::Empty))
        ));
        assert!(matches!(
            parse_key(b"a b"),
            Err(KeyRejection::Malformed { .. })
        ));
        assert!(matches!(
            parse_key(br#""a"; p=1"#),
            Err(KeyRejection::Malformed { .. })
        ));
        assert!(matches!(
            parse_key(br#""a\n""#),
            Err(KeyRejection::Malformed { .. })
        ));
        assert!(matches!(
            parse_key("\"é\"".as_bytes()),
            Err(KeyRejection::Malformed { .. })
        ));
        assert!(matches!(
            parse_key("k".repeat(256).as_bytes()),
            Err(KeyRejection::Invalid(KeyProblem::TooLong { len: 256, .. }))
        ));
        assert!(matches!(
            parse_key(b"a,b"),
            Err(KeyRejection::Malformed { .. })
        ));
        // Rule 22: a bare key is an RFC 8941 token. `;` starts the item's
        // parameters (`abc;v=1` is not the key `abc;v=1`), and `"` and `\`
        // belong in a quoted key only.
        for bare in [&b"abc;v=1"[..], b"a;", br#"a"b"#, br"a\b"] {
            assert!(
                matches!(parse_key(bare), Err(KeyRejection::Malformed { .. })),
                "{:?} was accepted as a bare key",
                String::from_utf8_lossy(bare)
            );
        }
    }

    #[tokio::test]
    async fn the_extractor_and_its_optional_form() {
        let parts = |key: Option<&str>| {
            let mut b = axum::http::Request::builder();
            if let Some(k) = key {
                b = b.header(IDEMPOTENCY_KEY, k);
            }
            b.body(()).unwrap().into_parts().0
        };
        let required = |key| async move {
            <IdempotencyKey as FromRequestParts<()>>::from_request_parts(&mut parts(key), &()).await
        };
        let optional = |key| async move {
            <IdempotencyKey as OptionalFromRequestParts<()>>::from_request_parts(
                &mut parts(key),
                &(),
            )
            .await
        };
        assert_eq!(required(Some("\"k\"")).await.unwrap().as_str(), "k");
        assert_eq!(required(None).await, Err(KeyRejection::Missing));
        assert_eq!(optional(None).await, Ok(None));
        assert_eq!(
            optional(Some("k")).await,
            Ok(Some(IdempotencyKey("k".into())))
        );
        assert!(matches!(
            optional(Some("a b")).await,
            Err(KeyRejection::Malformed { .. })
        ));
        let response = KeyRejection::Missing.into_response();
        assert_eq!(response.status(), 400);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
    }

    #[test]
    fn repeated_header_is_refused() {
        let mut h = HeaderMap::new();
        h.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        h.append(IDEMPOTENCY_KEY, "b".parse().unwrap());
        assert_eq!(
            key_from_headers(&h),
            Err(KeyRejection::Repeated { count: 2 })
        );
    }
}
