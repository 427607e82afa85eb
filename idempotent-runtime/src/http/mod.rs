//! HTTP on both sides (feature `http`), on the `Idempotency-Key` convention
//! (DESIGN.md rule 22).
//!
//! **Server** (axum / tower):
//!
//! * [`IdempotencyLayer`] makes a route idempotent without touching the
//!   handler: key from the header, tenant from your authentication,
//!   fingerprint of method, target and body, the answer recorded in the store
//!   and replayed with `Idempotent-Replayed: true`.
//! * [`IdempotencyKey`] is an extractor for handlers that call
//!   `#[idempotent]` functions themselves; [`MarkReplayed`] sets the replay
//!   header from [`with_outcome`](crate::with_outcome).
//! * [`Error`](crate::Error) implements `IntoResponse` (statuses in
//!   [`problem::problem_for`]), so `?` in a handler answers correctly.
//! * Every refusal is `application/problem+json` ([`problem::Problem`]).
//!
//! **Client** (reqwest): [`client::IdempotentClient`] mints one key per
//! [`client::Intent`] and retries that intent safely with the same key.
//!
//! | situation | answer |
//! |---|---|
//! | `GET`, `HEAD`, `OPTIONS`, `TRACE`, `QUERY` | passed through |
//! | no `Idempotency-Key` (route requires one) | 400 `missing-key` |
//! | malformed or invalid key | 400 `invalid-key` |
//! | no tenant for the request | 401 `missing-tenant` |
//! | body over the cap, or over a limit outside the layer | 413 `body-too-large` |
//! | body that cannot be read | 400 `body-unreadable` |
//! | (each refusal above) | marked [`problem::NotFinal`]: nothing ran or is recorded, nor by a layer around this one |
//! | first request | the handler's answer (headers, trailers, extensions); 2xx–4xx recorded (not 401, 405, 408, 411, 412, 413, 414, 415, 417, 421, 423, 425, 428, 429, 431, nor an answer marked [`problem::NotFinal`]), 5xx releases the key |
//! | retry, same request | the recorded status, body, allow-listed headers and trailers + `Idempotent-Replayed: true` |
//! | same key, different method, target or body | 422 `key-reused` |
//! | still running after the wait bound | 409 `in-progress` + `Retry-After` (s, ≥ 1) |
//! | store unavailable | 503 `store-unavailable` |
//! | the record was made by a newer version of the server | 503 `recorded-by-newer-version` + `Retry-After: 1` |

/// Builder methods that set one field and give the builder back, written
/// `fn name(argument: Type) => field = value;` (`fn name() => ...` for one
/// that takes no argument), each under its doc comment.
macro_rules! setters {
    ($($(#[$attr:meta])* fn $name:ident($($arg:ident: $ty:ty)?) => $($field:ident).+ = $value:expr;)*) => {
        $(
            $(#[$attr])*
            pub fn $name(mut self $(, $arg: $ty)?) -> Self {
                self.$($field).+ = $value;
                self
            }
        )*
    };
}

pub mod client;
mod fingerprint;
mod key;
mod layer;
pub mod problem;

pub use client::{ClientError, IdempotentClient, IdempotentResponse, Intent, RetryPolicy};
pub use fingerprint::{
    canonical_json, is_json_content_type, request_fingerprint, HTTP_FINGERPRINT_VERSION,
};
pub use key::{key_from_headers, parse_key, IdempotencyKey, KeyRejection, IDEMPOTENCY_KEY};
pub use layer::{
    is_safe_method, IdempotencyLayer, IdempotencyLayerBuilder, IdempotencyService,
    LayerConfigError, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_RECORDED_HEADERS,
};
pub use problem::{Problem, PROBLEM_JSON};

use crate::engine::Outcome;
use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponseParts, ResponseParts};

/// The header on a replayed answer: `Idempotent-Replayed: true`.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Response parts that add `Idempotent-Replayed: true` when the outcome is
/// [`Outcome::Replayed`], for handlers that call `#[idempotent]` functions
/// inside [`with_outcome`](crate::with_outcome).
///
/// ```
/// use axum::response::IntoResponse;
/// use idempotent_runtime::{http::MarkReplayed, Outcome};
/// let r = (MarkReplayed(Some(Outcome::Replayed)), "body").into_response();
/// assert_eq!(r.headers()["idempotent-replayed"], "true");
/// let r = (MarkReplayed(Some(Outcome::Executed)), "body").into_response();
/// assert!(r.headers().get("idempotent-replayed").is_none());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkReplayed(pub Option<Outcome>);

impl IntoResponseParts for MarkReplayed {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        if self.0 == Some(Outcome::Replayed) {
            res.headers_mut()
                .insert(REPLAYED, HeaderValue::from_static("true"));
        }
        Ok(res)
    }
}
