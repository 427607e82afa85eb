//! `application/problem+json` (RFC 9457) answers, and the HTTP status of every
//! [`crate::Error`] (DESIGN.md rule 22).
//!
//! Every refusal the layer and the extractor make is a [`Problem`]: a JSON
//! object with a `type` (one of the URNs in [`types`]), a `title`, the
//! `status` and a `detail` that tells the client what to do. Clients can
//! branch on `type`; people read `detail`.

use crate::error::Error;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The media type of every error body: `application/problem+json`.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The `type` URIs of the problems this crate answers with. Stable: clients
/// may match on them.
pub mod types {
    /// No `Idempotency-Key` header on a route that requires one (400).
    pub const MISSING_KEY: &str = "urn:idempotent:problem:missing-key";
    /// The `Idempotency-Key` header is not a bare token or a quoted string,
    /// or the key is empty, too long or holds a control character (400).
    pub const INVALID_KEY: &str = "urn:idempotent:problem:invalid-key";
    /// The route could not tell who the caller is (401).
    pub const MISSING_TENANT: &str = "urn:idempotent:problem:missing-tenant";
    /// The tenant value is empty, too long or holds a control character (400).
    pub const INVALID_TENANT: &str = "urn:idempotent:problem:invalid-tenant";
    /// The key was used before with a different request (422).
    pub const KEY_REUSED: &str = "urn:idempotent:problem:key-reused";
    /// A request with the same key is still running (409 + `Retry-After`).
    pub const IN_PROGRESS: &str = "urn:idempotent:problem:in-progress";
    /// The key's record was made by a newer version of the server, which
    /// this instance cannot compare the request with; nothing ran (503 +
    /// `Retry-After`).
    pub const RECORDED_BY_NEWER_VERSION: &str = "urn:idempotent:problem:recorded-by-newer-version";
    /// The request body is larger than the route buffers (413).
    pub const BODY_TOO_LARGE: &str = "urn:idempotent:problem:body-too-large";
    /// The request body could not be read (400).
    pub const BODY_UNREADABLE: &str = "urn:idempotent:problem:body-unreadable";
    /// The idempotency store is unavailable (503).
    pub const STORE_UNAVAILABLE: &str = "urn:idempotent:problem:store-unavailable";
    /// The request ran, but the store failed as its answer was being
    /// recorded; the server goes on trying to record it, and a retry with the
    /// same key gets it once it is (503 + `Retry-After`).
    pub const ANSWER_NOT_RECORDED_YET: &str = "urn:idempotent:problem:answer-not-recorded-yet";
    /// The request ran, but its lease was lost to another attempt, so its
    /// answer was not recorded (500).
    pub const LEASE_LOST: &str = "urn:idempotent:problem:lease-lost";
    /// The response could not be recorded (too large, not serializable) (500).
    pub const RESPONSE_NOT_RECORDED: &str = "urn:idempotent:problem:response-not-recorded";
    /// A server-side misconfiguration or bug (500).
    pub const SERVER_ERROR: &str = "urn:idempotent:problem:server-error";
}

/// One `application/problem+json` body (RFC 9457). Read from another
/// server, the members RFC 9457 makes optional may be missing: `type` is then
/// `about:blank`, `title` and `detail` are empty, and `status` is 0 (the
/// retrying client puts the response's status there).
///
/// ```
/// use idempotent_runtime::http::problem::{types, Problem};
/// use axum::http::StatusCode;
/// let p = Problem::new(StatusCode::BAD_REQUEST, types::MISSING_KEY, "Idempotency-Key required",
///                      "send an Idempotency-Key header");
/// assert_eq!(p.status, 400);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// A URI naming the kind of problem (one of [`types`]).
    #[serde(rename = "type", default = "about_blank")]
    pub problem_type: String,
    /// A short summary of the kind of problem, the same for every occurrence.
    #[serde(default)]
    pub title: String,
    /// The HTTP status code.
    #[serde(default)]
    pub status: u16,
    /// What went wrong this time and what the client should do about it.
    #[serde(default)]
    pub detail: String,
    /// Seconds to wait before sending the same request again (the same
    /// number as the `Retry-After` header): for answers that are not final,
    /// such as 409 in-progress. A problem with one carries [`NotFinal`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// A response extension saying the answer is not the request's final one:
/// send the same request again, with the same key (later). A handler that
/// made side effects before answering with it makes them again when the
/// retry it asks for runs it (unless they are idempotent calls of their own,
/// which replay). [`IdempotencyLayer`](super::IdempotencyLayer)
/// passes such an answer through without recording it, whatever its status
/// and the layer's recording rule, and releases the key, so the retry the
/// answer asks for is processed rather than answered the same way until the
/// record expires.
///
/// Every [`Problem`] with a `retry_after` carries it, so the answers `Error`'s
/// `IntoResponse` makes for `InProgress` (a handler's `#[idempotent]` call
/// that found its own record in progress, perhaps under another request's
/// key), `StaleSnapshot` and `RecordedByNewerVersion` do; so does every
/// refusal the layer makes before it reserves the key (400 `missing-key`,
/// `invalid-key`, `invalid-tenant` and `body-unreadable`, 401
/// `missing-tenant`, 413 `body-too-large`: nothing ran; send the corrected
/// request with the same key), which an idempotency layer around it (outside
/// the route's authentication, or a request decoder) would otherwise record.
/// Insert it into a
/// response of your own that says the same:
///
/// ```
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use idempotent_runtime::http::problem::NotFinal;
///
/// fn busy() -> Response {
///     let mut response = (StatusCode::CONFLICT, "the order is being shipped; retry").into_response();
///     response.extensions_mut().insert(NotFinal);
///     response
/// }
/// # assert!(busy().extensions().get::<NotFinal>().is_some());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NotFinal;

/// RFC 9457's `type` when a problem names none.
fn about_blank() -> String {
    "about:blank".to_owned()
}

impl Problem {
    /// A problem with the given status, type, title and detail.
    pub fn new(
        status: StatusCode,
        problem_type: &str,
        title: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Problem {
            problem_type: problem_type.to_owned(),
            title: title.into(),
            status: status.as_u16(),
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// This problem with a `Retry-After` of `secs` seconds: not final, a
    /// retry is answered.
    fn retried_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// The status as a [`StatusCode`] (500 if the number is not a status).
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.status_code();
        let retry_after = self.retry_after;
        // Serializing a struct of strings and integers cannot fail; keep a
        // valid body even if it somehow did.
        let body = serde_json::to_vec(&self).unwrap_or_else(|_| {
            br#"{"type":"urn:idempotent:problem:server-error","title":"Internal error","status":500,"detail":"the error could not be described"}"#.to_vec()
        });
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
            response.extensions_mut().insert(NotFinal);
        }
        response
    }
}

/// A `Retry-After` value in whole seconds: rounded up, at least 1.
///
/// ```
/// use idempotent_runtime::http::problem::retry_after_secs;
/// use std::time::Duration;
/// assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
/// assert_eq!(retry_after_secs(Duration::from_millis(2500)), 3);
/// assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
/// assert_eq!(retry_after_secs(Duration::MAX), u64::MAX);
/// ```
pub fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    secs.max(1)
}

/// The problem an [`Error`] becomes in an HTTP answer (rule 22):
///
/// | error | status |
/// |---|---|
/// | `InvalidKey`, `InvalidTenant` | 400 |
/// | `FingerprintMismatch` | 422 |
/// | `InProgress` | 409 + `Retry-After` (whole seconds, ≥ 1) |
/// | `Store`, `StaleSnapshot`, `RecordedByNewerVersion` | 503 + `Retry-After: 1` |
/// | `LeaseLost` | 500 + `Retry-After: 1` |
/// | everything else (`ResultTooLarge`, `NoDefaultStore`, ...) | 500 |
///
/// The detail of a 5xx does not repeat server internals (database messages):
/// those are logged, not sent to the client.
pub fn problem_for(error: &Error) -> Problem {
    use types::*;
    match error {
        Error::InvalidKey(problem) => Problem::new(
            StatusCode::BAD_REQUEST,
            INVALID_KEY,
            "Invalid Idempotency-Key",
            format!(
                "The Idempotency-Key was refused: {problem}. Send 1 to 255 bytes without control \
                 characters, e.g. a UUID made once per operation."
            ),
        ),
        Error::InvalidTenant(problem) => Problem::new(
            StatusCode::BAD_REQUEST,
            INVALID_TENANT,
            "Invalid caller identity",
            format!(
                "The caller's identity (tenant) was refused: {problem}. Check the credentials \
                 or account id sent with the request."
            ),
        ),
        Error::FingerprintMismatch(_) => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            KEY_REUSED,
            "Idempotency-Key reused for a different request",
            "This Idempotency-Key was already used with a different request (method, path or \
             body). A retry must repeat the original request exactly; a new operation needs a \
             new key.",
        ),
        Error::InProgress { retry_after, .. } => {
            let secs = retry_after_secs(*retry_after);
            Problem::new(
                StatusCode::CONFLICT,
                IN_PROGRESS,
                "A request for the same operation is still in progress",
                format!(
                    "An earlier request with this Idempotency-Key, or one for the same operation, \
                     has not finished yet. Retry the same request with the same key after {secs} \
                     second(s) to get the answer."
                ),
            )
            .retried_after(secs)
        }
        // A newer instance recorded this key (a rolling deploy, a
        // rollback): nothing ran here, and another instance, or this one once
        // the record expires, can answer.
        Error::RecordedByNewerVersion { .. } => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            RECORDED_BY_NEWER_VERSION,
            "Request not processed; retry",
            "This Idempotency-Key's request was recorded by a newer version of the server, \
             which this instance cannot compare the request with, so it was not processed \
             here. Retry the same request with the same key shortly, never with a new key.",
        )
        .retried_after(1),
        // Not final (a retry is answered): never recorded, also by a layer
        // that records 5xx answers, when a handler answers it with `?`.
        Error::Store(_) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            STORE_UNAVAILABLE,
            "Idempotency store unavailable",
            "The server's idempotency store failed while handling this request, which may \
             have been processed in part or in whole (the store can fail as an answer is \
             being recorded). Retry later with the same Idempotency-Key, never a new one: \
             what the server recorded is answered from its record, not done again.",
        )
        .retried_after(1),
        // The server's transaction could not take the record (another
        // request with this key may hold it, or held it just now): nothing
        // ran, and a new transaction can.
        Error::StaleSnapshot { .. } => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            STORE_UNAVAILABLE,
            "Request not processed; retry",
            "The server's transaction could not take this request's record (another request \
             with this Idempotency-Key may be running), so it was not processed here. Retry \
             the same request with the same key shortly, never with a new key.",
        )
        .retried_after(1),
        Error::LeaseLost(_) => Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            LEASE_LOST,
            "Answer not recorded",
            "This attempt's lease ran out (the request ran long, or the server was paused) \
             and another attempt took the request over, so no answer of this attempt was \
             recorded. Retry with the same Idempotency-Key to get the recorded answer.",
        )
        .retried_after(1),
        Error::ResultEncoding { .. }
        | Error::ResultTooLarge { .. }
        | Error::ResultNotFaithful { .. } => Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            RESPONSE_NOT_RECORDED,
            "Answer could not be recorded",
            "The server could not record its answer for this Idempotency-Key. This is a server \
             problem, and a retry may run the request again: contact the service's operators \
             before retrying.",
        ),
        Error::Fingerprint { .. }
        | Error::ReplayDecoding { .. }
        | Error::NoDefaultStore { .. }
        | Error::NoRuntime { .. }
        | Error::NotInTransaction { .. }
        | Error::ScopeTooLong { .. } => Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            SERVER_ERROR,
            "Internal server error",
            "The server's idempotency handling is misconfigured; the request did not run. \
             Contact the service's operators; retrying will not help until it is fixed.",
        ),
    }
}

/// Under the `http` feature, `?` on an [`Error`] in an axum handler answers
/// with the status of rule 22 and a problem+json body (see [`problem_for`]).
/// Server-side failures are logged here with their full message.
///
/// ```
/// use axum::response::IntoResponse;
/// use idempotent_runtime::Error;
/// use std::time::Duration;
/// let e = Error::InProgress { scope: "payments.charge".into(), retry_after: Duration::from_millis(1500) };
/// let response = e.into_response();
/// assert_eq!(response.status(), 409);
/// assert_eq!(response.headers()["retry-after"], "2");
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let problem = problem_for(&self);
        if problem.status >= 500 {
            tracing::error!(target: "idempotent", error = %self, status = problem.status,
                "idempotency failure answered as a server error");
        }
        problem.into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RecordContext;

    /// The answers that say "send it again" are marked not final, so the
    /// layer never records them; final refusals are not.
    #[test]
    fn answers_with_a_retry_after_are_marked_not_final() {
        let context = || RecordContext {
            scope: "a.b".into(),
            key_digest: "0".into(),
        };
        let not_final = |e: Error| e.into_response().extensions().get::<NotFinal>().is_some();
        assert!(not_final(Error::InProgress {
            scope: "a.b".into(),
            retry_after: Duration::from_secs(3),
        }));
        assert!(not_final(Error::StaleSnapshot {
            scope: "a.b".into(),
            store: "postgres",
        }));
        assert!(not_final(Error::RecordedByNewerVersion {
            context: context(),
            version: "v9".into(),
        }));
        assert!(not_final(Error::Store(crate::StoreError::new(
            "postgres", "reserve", "down"
        ))));
        assert!(not_final(Error::LeaseLost(context())));
        assert!(!not_final(Error::FingerprintMismatch(context())));
        assert!(!not_final(Error::InvalidKey(crate::KeyProblem::Empty)));
    }

    /// `Retry-After` is whole seconds, rounded up and never 0 (a client
    /// told 0 sends the request again at once, in a loop).
    #[test]
    fn retry_after_is_never_zero() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_nanos(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        let problem = problem_for(&Error::InProgress {
            scope: "a.b".into(),
            retry_after: Duration::ZERO,
        });
        assert_eq!(problem.retry_after, Some(1));
        assert_eq!(problem.into_response().headers()[header::RETRY_AFTER], "1");
    }

    /// A store that failed may have failed as the answer was being recorded,
    /// after the body ran (or after an earlier step of the handler ran): the
    /// problem never tells the client the request was not processed, which
    /// invites a new key and a second run (README hunt: it did).
    #[test]
    fn a_store_failure_never_says_the_request_was_not_processed() {
        for operation in ["reserve", "complete", "heartbeat"] {
            let problem = problem_for(&Error::Store(crate::StoreError::new(
                "postgres", operation, "down",
            )));
            assert_eq!(problem.status, 503);
            assert!(
                !problem.detail.contains("not processed")
                    && !problem.detail.contains("nothing was processed"),
                "{operation}: {}",
                problem.detail
            );
            assert!(
                problem.detail.contains("may have been processed")
                    && problem
                        .detail
                        .contains("same Idempotency-Key, never a new one"),
                "{operation}: {}",
                problem.detail
            );
        }
        // Nor do the other answers that say "send it again": one may come
        // from a later step of a handler whose earlier steps ran.
        let again = [
            Error::StaleSnapshot {
                scope: "a.b".into(),
                store: "postgres",
            },
            Error::RecordedByNewerVersion {
                context: RecordContext {
                    scope: "a.b".into(),
                    key_digest: "0".into(),
                },
                version: "v9".into(),
            },
        ];
        for e in again {
            let detail = problem_for(&e).detail;
            assert!(
                !detail.contains("nothing was processed")
                    && detail.contains("never with a new key"),
                "{detail}"
            );
        }
        let unrecorded = problem_for(&Error::ResultTooLarge {
            scope: "a.b".into(),
            size: 2,
            limit: 1,
        });
        assert!(
            !unrecorded.detail.contains("released"),
            "a recover hook's answer that cannot be recorded keeps its record: {}",
            unrecorded.detail
        );
    }
}
