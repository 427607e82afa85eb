//! [`IdempotencyLayer`]: the tower layer that makes a route idempotent.

use super::fingerprint::request_fingerprint;
use super::key::{key_from_headers, KeyRejection};
use super::problem::{types, NotFinal, Problem};
use super::REPLAYED;
use crate::engine::{execute, with_outcome, Call, Outcome, Recover, ReleaseErrors, StoreRef};
use crate::error::Error;
use crate::identity::Identity;
use crate::recovery::{Recovery, Takeover};
use crate::registry::{ErrorPolicy, InProgressPolicy, ScopeInfo, ScopeSpec};
use crate::store::Store;
use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{
    header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode,
};
use axum::response::IntoResponse;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http_body::Frame;
use http_body_util::{BodyExt, LengthLimitError, Limited, StreamBody};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// The default cap on a buffered request body: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;

/// The largest response body the layer records, by default and at most:
/// half of [`MAX_RESULT_BYTES`](crate::MAX_RESULT_BYTES). The record keeps a
/// binary body base64-encoded (4/3 of its size) and a text body JSON-escaped,
/// so a body up to this size fits the record (text full of characters that
/// need escaping excepted: its answer is then not recorded, as a larger one),
/// on a store that records [`MAX_RESULT_BYTES`](crate::MAX_RESULT_BYTES); a
/// MySQL server with a smaller `max_allowed_packet` records less
/// ([`Store::max_result_bytes`](crate::Store::max_result_bytes)). The
/// response's headers and trailers are recorded too, and count.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = crate::engine::MAX_RESULT_BYTES / 2;

/// The response headers recorded and replayed by default (besides the
/// status and the body): `Content-Type`, `Content-Encoding` and
/// `Content-Range` (the recorded body is the encoded bytes, and a partial
/// answer's range), `Location`, `Content-Location`, `Content-Language`,
/// `ETag` and `Last-Modified`. The same allow-list picks the trailers
/// recorded (none of these is one).
pub const DEFAULT_RECORDED_HEADERS: [HeaderName; 8] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_RANGE,
    header::LOCATION,
    header::CONTENT_LOCATION,
    header::CONTENT_LANGUAGE,
    header::ETAG,
    header::LAST_MODIFIED,
];

type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;
type RecoverFn = dyn Fn(Takeover) -> BoxFuture<'static, Result<Recovery<Response<Body>>, Response<Body>>>
    + Send
    + Sync;

/// What was wrong with an [`IdempotencyLayerBuilder`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayerConfigError {
    /// The scope is not lowercase segments `[a-z0-9_-]+` joined by `.`, ≤ 128 bytes.
    #[error("scope {scope:?} is not a valid scope: {problem}")]
    InvalidScope {
        /// The scope given.
        scope: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Neither `tenant_from_extension` nor `tenant_from` was called.
    #[error(
        "scope `{scope}`: the layer needs to know whose key a request carries; call \
             `tenant_from_extension::<YourPrincipal>()` (set by your authentication) or \
             `tenant_from(|parts| ...)` on the builder"
    )]
    NoTenant {
        /// The scope of the layer.
        scope: String,
    },
    /// The lease is zero.
    #[error("scope `{scope}`: the lease must be longer than zero")]
    ZeroLease {
        /// The scope of the layer.
        scope: String,
    },
    /// `max_response_bytes` is over what a record can hold: no answer over
    /// [`DEFAULT_MAX_RESPONSE_BYTES`] can be recorded, so a larger limit
    /// would have its answers released and their handlers run again.
    #[error(
        "scope `{scope}`: `max_response_bytes` is {limit} bytes, over the {max} bytes (4 MiB) a \
         record can hold: an answer larger than that is never recorded (its key is released \
         and every retry runs the handler again); give at most {max}, and answer with an id \
         the client fetches the large payload by"
    )]
    ResponseLimitTooLarge {
        /// The scope of the layer.
        scope: String,
        /// The limit given.
        limit: usize,
        /// The most a record holds ([`DEFAULT_MAX_RESPONSE_BYTES`]).
        max: usize,
    },
    /// The ttl, or a lease that is not zero, breaks the rule the attribute
    /// applies to it (a zero ttl would record nothing any retry could
    /// replay; a lease under 10 ms is taken over while the handler runs).
    #[error("scope `{scope}`: {problem}")]
    InvalidDuration {
        /// The scope of the layer.
        scope: String,
        /// What is wrong, as the attribute says it.
        problem: idempotent_rules::duration::DurationError,
    },
}

/// Configures an [`IdempotencyLayer`]; made by [`IdempotencyLayer::builder`].
#[must_use = "call .build() to get the layer"]
pub struct IdempotencyLayerBuilder {
    store: Arc<dyn Store>,
    scope: String,
    tenant: Option<Arc<TenantFn>>,
    /// Where the tenant comes from, for the log of a request without one.
    tenant_source: String,
    key_required: bool,
    lease: Duration,
    ttl: Duration,
    in_progress: InProgressPolicy,
    max_body_bytes: usize,
    max_response_bytes: usize,
    recorded_headers: Vec<HeaderName>,
    recording: RecordRule,
    recover: Option<(Arc<RecoverFn>, &'static str)>,
    shared_scope: bool,
}

impl IdempotencyLayerBuilder {
    /// Asks `hook` before a takeover runs the handler again (rule 20 of the
    /// contract). A takeover happens when a request's record is still in
    /// progress after its lease ran out: the instance that ran the handler
    /// crashed (or paused, or lost the store) and may have done the work
    /// before it could record the answer. Without a hook the retry runs the
    /// handler again; with one, the hook is told the tenant, scope, key,
    /// attempt number and when the previous attempt started, and answers:
    ///
    /// * `Ok(Recovery::Run)`: the handler runs, as attempt *n*;
    /// * `Ok(Recovery::Completed(response))`: `response` is the request's
    ///   answer: recorded (by the layer's rules, with its allow-listed
    ///   headers) and replayed to every retry; the handler does not run;
    /// * `Err(response)`: `response` is sent, nothing is recorded and the
    ///   record is kept with its lease ended, so the next retry takes it
    ///   over and asks again (a response the layer would not record, such as
    ///   a 5xx, counts as this too). It is sent with `Retry-After: 1` unless
    ///   it has a `Retry-After` of its own, and marked
    ///   [`NotFinal`](super::problem::NotFinal). Give it a 5xx or a 4xx
    ///   status: one of another status (a 202, a redirect, a 408), which
    ///   clients take for the request's final answer, is sent as a 503
    ///   problem instead (with the hook's `Retry-After`), so the client
    ///   comes back; so is a `Completed` answer that is not recorded.
    ///
    /// ```
    /// use axum::http::StatusCode;
    /// use axum::response::IntoResponse;
    /// use idempotent_runtime::http::IdempotencyLayer;
    /// use idempotent_runtime::{MemoryStore, Recovery};
    /// # #[derive(Clone, Debug)] struct AccountId(String);
    /// # impl std::fmt::Display for AccountId {
    /// #     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(&self.0) }
    /// # }
    /// # async fn charge_by_key(_key: &str) -> Result<Option<String>, ()> { Ok(None) }
    /// let layer = IdempotencyLayer::builder("payments.charge", MemoryStore::new())
    ///     .tenant_from_extension::<AccountId>()
    ///     .recover(|takeover| async move {
    ///         // Ask the payment provider, by our key, whether the charge happened.
    ///         match charge_by_key(takeover.key()).await {
    ///             Ok(Some(charge_id)) => Ok(Recovery::Completed(
    ///                 (StatusCode::CREATED, charge_id).into_response(),
    ///             )),
    ///             Ok(None) => Ok(Recovery::Run),
    ///             Err(()) => Err(StatusCode::SERVICE_UNAVAILABLE.into_response()),
    ///         }
    ///     })
    ///     .build()
    ///     .expect("a valid layer");
    /// ```
    pub fn recover<F, Fut>(mut self, hook: F) -> Self
    where
        F: Fn(Takeover) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Recovery<Response<Body>>, Response<Body>>>
            + Send
            + 'static,
    {
        let hook: Arc<RecoverFn> = Arc::new(move |takeover| Box::pin(hook(takeover)));
        // The registry's name for it: a function's path; a closure's type
        // name says nothing (`main::{{closure}}`).
        let name = std::any::type_name::<F>();
        let name = if name.contains("{{closure}}") {
            "a closure given to IdempotencyLayerBuilder::recover"
        } else {
            name
        };
        self.recover = Some((hook, name));
        self
    }

    /// Takes the tenant from a request extension of type `T`, put there by
    /// your authentication middleware (which must run before this layer).
    /// The tenant is `T`'s `Display` form. A request without the extension is
    /// refused with 401: it is never served from a shared namespace.
    pub fn tenant_from_extension<T>(mut self) -> Self
    where
        T: std::fmt::Display + Clone + Send + Sync + 'static,
    {
        self.tenant = Some(Arc::new(|parts: &Parts| {
            parts.extensions.get::<T>().map(|t| t.to_string())
        }));
        self.tenant_source = format!("the request extension `{}`", std::any::type_name::<T>());
        self
    }

    /// Takes the tenant from the request's parts (method, URI, headers,
    /// extensions). `None` refuses the request with 401.
    ///
    /// Only use values your authentication has verified: a tenant taken from
    /// an unauthenticated header lets one caller read another's answers.
    pub fn tenant_from<F>(mut self, tenant: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.tenant = Some(Arc::new(tenant));
        self.tenant_source = "the `tenant_from` closure".to_owned();
        self
    }

    setters! {
        /// Says this layer shares its scope on purpose with the other layers that
        /// claim it and say so too (rule 21 of the contract: e.g. two routers of
        /// one service, built apart, that accept the same request). Without it, a
        /// second claimant of the scope is reported by
        /// [`registry::validate`](crate::registry::validate) as a duplicate,
        /// naming both sites. The claimants must have the same ttl and either all
        /// have a [`recover`](Self::recover) hook or none, or `validate` reports
        /// the disagreement; which answers each records
        /// ([`record_client_errors`](Self::record_client_errors) and the like)
        /// may differ, as may the hooks themselves.
        ///
        /// A layer fingerprints the request (its method, target and body), so it
        /// cannot share a scope with an annotated function (a route and a message
        /// consumer that process the same business event): `validate` reports
        /// that they fingerprint different parameters. Share such a scope
        /// between annotated functions, the route's handler calling one.
        ///
        /// ```
        /// use idempotent_runtime::http::IdempotencyLayer;
        /// use idempotent_runtime::MemoryStore;
        /// # #[derive(Clone, Debug)] struct AccountId(String);
        /// # impl std::fmt::Display for AccountId {
        /// #     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(&self.0) }
        /// # }
        /// let store = MemoryStore::new();
        /// let public = IdempotencyLayer::builder("orders.create", store.clone())
        ///     .tenant_from_extension::<AccountId>()
        ///     .shared_scope()
        ///     .build()
        ///     .expect("a valid layer");
        /// let partner = IdempotencyLayer::builder("orders.create", store)
        ///     .tenant_from_extension::<AccountId>()
        ///     .shared_scope()
        ///     .build()
        ///     .expect("a valid layer");
        /// let claimants = [public.scope_info(), partner.scope_info()];
        /// assert!(idempotent_runtime::registry::validate_infos(&claimants).is_ok());
        /// ```
        fn shared_scope() => shared_scope = true;

        /// Requests without an `Idempotency-Key` pass through to the handler
        /// unprotected, instead of being refused with 400 (the default). A
        /// malformed key is still refused.
        fn key_optional() => key_required = false;

        /// The lease of a running request (default 30 s), renewed every
        /// `lease / 3` while the handler runs. After a crash, a retry can take
        /// the key over once the lease has run out.
        fn lease(lease: Duration) => lease = lease;

        /// How long a recorded answer is replayed (default 24 h).
        fn ttl(ttl: Duration) => ttl = ttl;

        /// A duplicate that arrives while the first request runs waits up to
        /// `bound` for its answer and replays it (default 10 s); still running
        /// after that, it gets 409 with `Retry-After`. At least 1 ms, as
        /// `in_progress = wait("...")` ([`build`](Self::build) refuses less; for
        /// no wait, [`reject_in_progress`](Self::reject_in_progress)).
        fn wait(bound: Duration) => in_progress = InProgressPolicy::Wait(bound);

        /// A duplicate that arrives while the first request runs gets 409 with
        /// `Retry-After` at once, without waiting.
        fn reject_in_progress() => in_progress = InProgressPolicy::Reject;

        /// The largest request body buffered for the fingerprint (default
        /// [`DEFAULT_MAX_BODY_BYTES`]); a larger one is refused with 413. With
        /// axum, a cap above its 2 MB default body limit needs
        /// `axum::extract::DefaultBodyLimit` raised as well: otherwise the
        /// handler's extractor answers 413 itself (not recorded, as no 413 is
        /// by the default rule).
        fn max_body_bytes(limit: usize) => max_body_bytes = limit;

        /// The largest response body recorded (default and at most
        /// [`DEFAULT_MAX_RESPONSE_BYTES`], 4 MiB: [`build`](Self::build) refuses
        /// a larger limit with [`LayerConfigError::ResponseLimitTooLarge`]). A
        /// larger answer cannot be recorded: the key is released and the client
        /// gets 500.
        fn max_response_bytes(limit: usize) => max_response_bytes = limit;
    }

    /// Also records and replays this response header (besides
    /// [`DEFAULT_RECORDED_HEADERS`]), and a trailer of that name (e.g.
    /// `grpc-status`, `grpc-message`). Recorded headers and trailers are
    /// stored with the answer: do not add ones that hold secrets (e.g.
    /// `Set-Cookie`).
    pub fn record_header(mut self, name: HeaderName) -> Self {
        if !self.recorded_headers.contains(&name) {
            self.recorded_headers.push(name);
        }
        self
    }

    setters! {
        /// Whether 4xx answers of the handler are recorded as the final answer
        /// for their key (default `true`). `401`, `405`, `408`, `411`, `412`, `413`,
        /// `414`, `415`, `417`, `421`, `423`, `425`, `428`, `429` and `431` are
        /// never recorded by the default rule: they say "not processed, try
        /// again" (a `401` once the client has authenticated again, a `405`
        /// with the route's method, a `411` with a `Content-Length`, a `412`
        /// with a precondition that holds now, a `413` with a smaller
        /// body, a `414` with a shorter target, a `415` with the right
        /// `Content-Type`, a `417` without the expectation, a `421` over another
        /// connection, a `428` with a precondition such as `If-Match`, a `431`
        /// with smaller header fields), so replaying them would refuse every
        /// retry: with the refusal itself when only headers or framing changed
        /// (they are not fingerprinted), or 422.
        fn record_client_errors(record: bool) => recording.client_errors = record;

        /// Whether 5xx answers of the handler are recorded (default `false`: a
        /// 5xx releases the key, so a retry runs the handler again).
        fn record_server_errors(record: bool) => recording.server_errors = record;
    }

    /// Replaces the rule for which statuses are recorded: `true` records the
    /// answer, `false` passes it through and releases the key.
    pub fn record_when<F>(mut self, rule: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.recording.when = Some(Arc::new(rule));
        self
    }

    /// Checks the configuration and makes the layer.
    ///
    /// A layer's scope is described by a [`ScopeInfo`] like an annotated
    /// function's; it is allocated once here and lives for the rest of the
    /// program (leaked: a few hundred bytes per layer built — build layers
    /// at startup, not per request). It is registered, so
    /// [`registry::scopes`](crate::registry::scopes) and audits list it,
    /// with the place `build()` was called from.
    #[track_caller]
    pub fn build(self) -> Result<IdempotencyLayer, LayerConfigError> {
        // The same rule the attribute checks when it compiles.
        if let Err(problem) = idempotent_rules::scope::check_scope(&self.scope) {
            let problem = problem.to_string();
            return Err(LayerConfigError::InvalidScope {
                scope: self.scope,
                problem,
            });
        }
        let Some(tenant) = self.tenant else {
            return Err(LayerConfigError::NoTenant { scope: self.scope });
        };
        if self.lease.is_zero() {
            return Err(LayerConfigError::ZeroLease { scope: self.scope });
        }
        if self.max_response_bytes > DEFAULT_MAX_RESPONSE_BYTES {
            return Err(LayerConfigError::ResponseLimitTooLarge {
                scope: self.scope,
                limit: self.max_response_bytes,
                max: DEFAULT_MAX_RESPONSE_BYTES,
            });
        }
        // The rules the attribute applies to `ttl = "..."`, `lease = "..."` and
        // `in_progress = wait("...")`.
        use idempotent_rules::duration::{check_duration, DurationKind};
        let checked = check_duration(self.ttl, DurationKind::Ttl)
            .and_then(|_| check_duration(self.lease, DurationKind::Lease))
            .and_then(|_| match self.in_progress {
                InProgressPolicy::Wait(bound) => match check_duration(bound, DurationKind::Wait) {
                    // Longer than the attribute can write (`Duration::MAX`):
                    // as long as a wait may be (the engine caps it).
                    Err(idempotent_rules::duration::DurationError::TooLong { .. }) => Ok(bound),
                    checked => checked,
                },
                InProgressPolicy::Reject => Ok(Duration::ZERO),
            });
        if let Err(problem) = checked {
            return Err(LayerConfigError::InvalidDuration {
                scope: self.scope,
                problem,
            });
        }
        let caller = std::panic::Location::caller();
        let spec: &'static ScopeInfo = Box::leak(Box::new(ScopeInfo::new(ScopeSpec {
            scope: Box::leak(self.scope.into_boxed_str()),
            function: "idempotent_runtime::http::IdempotencyLayer",
            file: caller.file(),
            line: caller.line(),
            ttl: self.ttl,
            lease: self.lease,
            in_progress: self.in_progress,
            errors: ErrorPolicy::RecordIf(self.recording.policy()),
            transactional: false,
            fingerprinted: true,
            // Not parameter names: the layer's fingerprint is its own
            // canonical form of the request, which no annotated function
            // makes, so rule 21 must never find a function agreeing with it
            // (one whose parameters are called `method`, `target` and `body`
            // did). A name no Rust parameter can have says so to
            // `registry::validate()`, and reads as what is fingerprinted.
            fingerprinted_parameters: &["HTTP request (method, target, body)"],
            shared_tenant: false,
            recover: self.recover.as_ref().map(|(_, name)| *name),
            shared_scope: self.shared_scope,
        })));
        crate::registry::register_runtime(spec);
        Ok(IdempotencyLayer {
            config: Arc::new(Config {
                store: self.store,
                spec,
                tenant,
                tenant_source: self.tenant_source,
                key_required: self.key_required,
                max_body_bytes: self.max_body_bytes,
                max_response_bytes: self.max_response_bytes,
                recorded_headers: self.recorded_headers,
                recording: self.recording,
                recover: self.recover.map(|(hook, _)| hook),
            }),
        })
    }
}

struct Config {
    store: Arc<dyn Store>,
    spec: &'static ScopeInfo,
    tenant: Arc<TenantFn>,
    tenant_source: String,
    key_required: bool,
    max_body_bytes: usize,
    max_response_bytes: usize,
    recorded_headers: Vec<HeaderName>,
    recording: RecordRule,
    recover: Option<Arc<RecoverFn>>,
}

/// Which of the handler's answers a layer records as final for their key:
/// what [`IdempotencyLayerBuilder::record_client_errors`],
/// [`record_server_errors`](IdempotencyLayerBuilder::record_server_errors)
/// and [`record_when`](IdempotencyLayerBuilder::record_when) set.
struct RecordRule {
    client_errors: bool,
    server_errors: bool,
    /// A rule of the user's, in place of the two above.
    when: Option<Arc<StatusFn>>,
}

/// The 4xx answers that say "not processed, send it again": 408 Request
/// Timeout, 423 Locked, 425 Too Early and 429 Too Many Requests. Recording
/// one would answer every retry with it for the record's ttl.
pub(crate) fn says_try_again(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::REQUEST_TIMEOUT
            | StatusCode::LOCKED
            | StatusCode::TOO_EARLY
            | StatusCode::TOO_MANY_REQUESTS
    )
}

/// The 4xx answers that say "not processed: send it again, changed" (or,
/// for 421, unchanged over another connection), made before any work: the
/// client sends the request again with the same key, so a recorded one
/// would answer that request with itself (what changed is a header or the
/// framing, which the fingerprint leaves out) or 422 (a changed method,
/// target, media type or body) for the record's ttl.
///
/// * 401: authenticated again;
/// * 405: with the route's method (the router's answer; no handler ran);
/// * 411: with a `Content-Length` (RFC 9110: "The client MAY repeat the
///   request if it adds a valid Content-Length");
/// * 413: with a smaller body (a body limit or a request decoder inside the layer);
/// * 414: with a shorter target;
/// * 415: with the right `Content-Type` (an extractor, before the handler's code ran);
/// * 417: without the expectation (RFC 9110: a client "SHOULD repeat that
///   request without a 100-continue expectation");
/// * 412: with a precondition that holds now (a fresh `If-Match` after
///   reading the resource again; RFC 9110: the server did not perform the
///   method);
/// * 421: over another connection (RFC 9110: clients "MAY retry the
///   request, whether or not the request method is idempotent, over a
///   different connection");
/// * 428: made conditional (`If-Match`, RFC 6585);
/// * 431: with smaller header fields (RFC 6585: "MAY be resubmitted after
///   reducing the size of the request header fields").
///
/// Not 406 Not Acceptable: a handler may negotiate the representation
/// after its work (rendering the answer), and a retry with another
/// `Accept` would run that work again.
fn asks_for_a_resend(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::UNAUTHORIZED
            | StatusCode::METHOD_NOT_ALLOWED
            | StatusCode::LENGTH_REQUIRED
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::URI_TOO_LONG
            | StatusCode::UNSUPPORTED_MEDIA_TYPE
            | StatusCode::EXPECTATION_FAILED
            | StatusCode::PRECONDITION_FAILED
            | StatusCode::MISDIRECTED_REQUEST
            | StatusCode::PRECONDITION_REQUIRED
            | StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    )
}

impl RecordRule {
    /// Whether an answer of `status` is recorded.
    fn records(&self, status: StatusCode) -> bool {
        // A 1xx answer (101 Switching Protocols) hands the connection over:
        // nothing a replay could give again.
        if status.is_informational() {
            return false;
        }
        if let Some(rule) = &self.when {
            return rule(status);
        }
        if status.is_server_error() {
            self.server_errors
        } else if status.is_client_error() {
            // "Try again" answers, and answers asking for the request
            // again, changed (or over another connection), with the same key.
            self.client_errors && !says_try_again(status) && !asks_for_a_resend(status)
        } else {
            true
        }
    }

    /// The rule as the layer's [`ScopeInfo`] lists it (its errors policy).
    fn policy(&self) -> &'static str {
        match (&self.when, self.client_errors, self.server_errors) {
            (Some(_), ..) => "record_when(custom rule)",
            (None, true, false) => "release 5xx, record 4xx",
            (None, true, true) => "record 4xx and 5xx",
            (None, false, false) => "release 4xx and 5xx",
            (None, false, true) => "release 4xx, record 5xx",
        }
    }
}

/// A tower layer that makes the routes it wraps idempotent on the
/// `Idempotency-Key` convention (DESIGN.md rule 22).
///
/// For every request that is not `GET`, `HEAD`, `OPTIONS`, `TRACE` or `QUERY`:
///
/// 1. reads the `Idempotency-Key` (bare token or RFC 8941 quoted string;
///    missing → 400, or pass through with [`key_optional`](IdempotencyLayerBuilder::key_optional));
/// 2. finds the tenant (missing → 401), so the record is
///    (tenant, scope, key) and a replay is never served to another tenant;
/// 3. buffers the body up to a cap (over it → 413) and fingerprints method,
///    target and body, JSON canonicalised ([`request_fingerprint`](super::request_fingerprint));
/// 4. runs the handler as the body of an idempotent call — the same
///    reservation, lease, heartbeat, fencing and retention as `#[idempotent]`
///    functions, in the same store;
/// 5. records the status, the body and the allow-listed headers and
///    trailers ([`DEFAULT_RECORDED_HEADERS`],
///    [`record_header`](IdempotencyLayerBuilder::record_header)), and replays
///    them to every retry with `Idempotent-Replayed: true`.
///
/// The first answer is the handler's own: its status, every header, its
/// trailers (e.g. gRPC's `grpc-status`) and its response extensions reach
/// the caller and the middleware outside this layer unchanged, only the body
/// buffered. A replay has the recorded status, body, headers and trailers
/// only: extensions are never recorded (they are not serializable), so
/// middleware outside the layer that reads a response extension finds none
/// on a replay.
///
/// Same key with a different request → 422; still running after the wait
/// bound → 409 with `Retry-After`; the store down → 503. A 5xx from the
/// handler releases the key (configurable). Every refusal is
/// `application/problem+json`.
///
/// ```
/// use axum::{routing::post, Extension, Router};
/// use idempotent_runtime::http::IdempotencyLayer;
/// use idempotent_runtime::MemoryStore;
///
/// #[derive(Clone)]
/// struct AccountId(String);
/// impl std::fmt::Display for AccountId {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(&self.0) }
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = IdempotencyLayer::builder("payments.charge", MemoryStore::new())
///     .tenant_from_extension::<AccountId>()       // set by your authentication
///     .build()?;
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { (axum::http::StatusCode::CREATED, "charged") }).route_layer(layer));
///     // .layer(your_auth_layer) — it must run before (outside) the idempotency layer
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("scope", &self.config.spec.scope)
            .field("store", &self.config.store.name())
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// Starts configuring a layer for `scope` (lowercase segments joined by
    /// dots, e.g. `payments.charge`) on `store` (any [`Store`]; an
    /// `Arc<dyn Store>` works too).
    pub fn builder(
        scope: impl Into<String>,
        store: impl Store + 'static,
    ) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            store: Arc::new(store),
            scope: scope.into(),
            tenant: None,
            tenant_source: String::new(),
            key_required: true,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 60 * 60),
            in_progress: InProgressPolicy::Wait(Duration::from_secs(10)),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            recorded_headers: DEFAULT_RECORDED_HEADERS.to_vec(),
            recording: RecordRule {
                client_errors: true,
                server_errors: false,
                when: None,
            },
            recover: None,
            shared_scope: false,
        }
    }

    /// What this layer registered: its scope, lease, ttl and policies.
    pub fn scope_info(&self) -> &'static ScopeInfo {
        self.config.spec
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service made by [`IdempotencyLayer`] around an inner service.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("scope", &self.config.spec.scope)
            .finish_non_exhaustive()
    }
}

/// Whether a method passes through untouched: `GET`, `HEAD`, `OPTIONS`,
/// `TRACE`, and `QUERY` (the safe method with a body, which the IETF's HTTP
/// working group defines: a search whose criteria are too long for a URL).
///
/// ```
/// use axum::http::Method;
/// use idempotent_runtime::http::is_safe_method;
/// assert!(is_safe_method(&Method::GET));
/// assert!(is_safe_method(&Method::from_bytes(b"QUERY").unwrap()));
/// assert!(!is_safe_method(&Method::POST));
/// ```
pub fn is_safe_method(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    ) || method.as_str() == "QUERY"
}

/// Why the handler's answer is not the call's recorded value.
enum Failure<E> {
    /// The engine refused or failed (problem+json of rule 22).
    Engine(Error),
    /// The inner service failed; its error goes back to the caller.
    Inner(E),
    /// An answer the policy does not record (e.g. a 5xx): passed through, key released.
    Passthrough(Response<Body>),
    /// The answer could not be recorded (body too large or unreadable): key released.
    Unrecordable(Problem),
}

impl<E> From<Error> for Failure<E> {
    fn from(e: Error) -> Self {
        Failure::Engine(e)
    }
}

impl<S, ResBody> tower_service::Service<Request<Body>> for IdempotencyService<S>
where
    S: tower_service::Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone is not ready; the ready one goes into the future.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        if is_safe_method(request.method()) {
            return Box::pin(handle(config, inner, request));
        }
        Box::pin(to_the_end(handle(config, inner, request)))
    }
}

/// Runs a request that may change state in a task of its own, so it runs to
/// its end even when the caller stops waiting for it: a client that hangs up
/// (its own timeout, a proxy's) drops the connection, and with it the future
/// the server awaits. Dropped halfway, the handler would leave its side
/// effects done and the key released (rule 14), and the client's retry with
/// the same key would run it again; run to its end, its answer is recorded
/// and the retry replays it. A panic propagates to the caller as before.
/// The caller's tracing span goes with it; its task-locals do not. Outside a
/// Tokio runtime it runs in the caller's future. A limit outside the layer
/// (a concurrency limit, load shedding) no longer counts the request once
/// the caller is gone; a limit inside it runs in this task and still does.
async fn to_the_end<F, T>(work: F) -> T
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    if tokio::runtime::Handle::try_current().is_err() {
        return work.await;
    }
    // The request's span goes with it (its logs stay under the request's
    // trace); task-locals do not.
    match tokio::spawn(tracing::Instrument::in_current_span(work)).await {
        Ok(answer) => answer,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Cancelled: only when the runtime shuts down, which also ends the
        // caller; should it still be polled, it ends rather than waits for ever.
        Err(_) => panic!("the request's task was cancelled: the runtime is shutting down"),
    }
}

async fn handle<S, ResBody>(
    config: Arc<Config>,
    mut inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: tower_service::Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    if is_safe_method(request.method()) {
        return inner.call(request).await.map(|r| r.map(Body::new));
    }
    let spec = config.spec;
    let key = match key_from_headers(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if !config.key_required => {
            return inner.call(request).await.map(|r| r.map(Body::new));
        }
        Ok(None) => return Ok(not_processed(KeyRejection::Missing.into_response())),
        Err(rejection) => return Ok(not_processed(rejection.into_response())),
    };
    let (mut parts, body) = request.into_parts();
    let Some(tenant) = (config.tenant)(&parts) else {
        tracing::info!(target: "idempotent", scope = spec.scope, tenant_source = %config.tenant_source,
            "refused with 401: no tenant for the request (if the request was authenticated, the \
             middleware that sets the tenant must run before this layer: add it as an outer layer)");
        return Ok(not_processed(missing_tenant().into_response()));
    };
    let identity = match Identity::new(tenant, spec.scope, key) {
        Ok(identity) => identity,
        Err(e) => return Ok(not_processed(e.into_response())),
    };
    // The one copy of the body: buffered for the fingerprint, then handed
    // to the handler as the same (reference-counted) bytes.
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > config.max_body_bytes as u64) {
        return Ok(not_processed(
            body_too_large(config.max_body_bytes).into_response(),
        ));
    }
    let bytes = match Limited::new(body, config.max_body_bytes).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return Ok(not_processed(
                body_too_large(config.max_body_bytes).into_response(),
            ));
        }
        // A limit outside this layer (tower-http's `RequestBodyLimitLayer`):
        // its `LengthLimitError` reaches the layer wrapped (in `axum::Error`
        // by axum's `Body`). The same body can only fail again: 413, not
        // "send it again".
        Err(e) if wraps_a_length_limit(&*e) => {
            tracing::info!(target: "idempotent", scope = spec.scope, error = %e,
                "request body over a limit set outside the layer");
            return Ok(not_processed(outer_body_too_large().into_response()));
        }
        Err(e) => {
            tracing::info!(target: "idempotent", scope = spec.scope, error = %e, "request body could not be read");
            return Ok(not_processed(
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    types::BODY_UNREADABLE,
                    "Request body could not be read",
                    "The request body ended early or was malformed. Send the request again \
                     with the same Idempotency-Key.",
                )
                .into_response(),
            ));
        }
    };
    // A layer around this one already runs this request as the call of this
    // very identity (one layer applied router-wide and on the route, or two
    // with one scope) on a store of the same kind and database, likely the
    // same store: reserving it again would wait for that call, which waits
    // for this one, and answer 409 until the wait bound, every time. The
    // enclosing call records the answer; this layer's body cap still holds.
    // One on another database (a store per region or per customer) is
    // another record: this layer reserves and records its own, or its
    // database would never learn of the request. A database a store cannot
    // name (`None`) may be any.
    if parts
        .extensions
        .get::<EnclosingCalls>()
        .is_some_and(|calls| {
            calls
                .0
                .iter()
                .any(|(held, store)| *held == identity && same_records(store, &config.store))
        })
    {
        return inner
            .call(Request::from_parts(parts, Body::from(bytes)))
            .await
            .map(|r| r.map(Body::new));
    }
    // The URI the client sent: under `Router::nest` the request's own URI has
    // the prefix stripped (`/accounts/{a}/transfers` seen as `/transfers`),
    // and two accounts' requests with one key would look the same.
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    let target = uri
        .path_and_query()
        .map_or_else(|| uri.path(), |pq| pq.as_str());
    let fingerprint = request_fingerprint(&parts.method, target, &parts.headers, &bytes);
    parts
        .extensions
        .get_or_insert_default::<EnclosingCalls>()
        .0
        .push((identity.clone(), config.store.clone()));
    let request = Request::from_parts(parts, Body::from(bytes));

    let call = Call {
        spec,
        store: Ok(StoreRef::Borrowed(config.store.as_ref())),
        identity: Ok(identity),
        fingerprint: Ok(Some(fingerprint)),
    };
    let run = run_handler(&config, inner, request);
    let (result, outcome) = with_outcome(execute::<Result<Recorded, Failure<S::Error>>, _, _, _>(
        call,
        ReleaseErrors,
        RecoverHook {
            config: &config,
            inner_error: std::marker::PhantomData,
        },
        run,
    ))
    .await;
    match result {
        Ok(recorded) => Ok(recorded.into_response(outcome == Some(Outcome::Replayed))),
        Err(Failure::Passthrough(response)) => Ok(response),
        Err(Failure::Inner(e)) => Err(e),
        // The handler ran; only the recording of its answer failed. Saying
        // "not processed" would invite a retry with a new key.
        // (Or a recover hook answered for it: its answer is recorded alike.)
        Err(Failure::Engine(Error::Store(_)))
            if matches!(outcome, Some(Outcome::Executed | Outcome::Recovered)) =>
        {
            Ok(answer_not_recorded_yet().into_response())
        }
        Err(Failure::Engine(e)) => Ok(e.into_response()),
        Err(Failure::Unrecordable(problem)) => Ok(problem.into_response()),
    }
}

/// The identities a request is already the call of, with the store each is
/// reserved in, one per enclosing layer that reserved it: a layer inside
/// them with one of these on a store of the same records
/// ([`same_records`]) passes the request through.
#[derive(Clone, Default)]
struct EnclosingCalls(Vec<(Identity, Arc<dyn Store>)>);

/// Whether `a` and `b` may keep their records in one place: stores of one
/// kind whose databases ([`Store::database_id`], read when they opened: no
/// round trip) may be one (`store::may_be_one_database`).
fn same_records(a: &Arc<dyn Store>, b: &Arc<dyn Store>) -> bool {
    a.name() == b.name() && crate::store::may_be_one_database(a.database_id(), b.database_id())
}

/// A refusal the layer makes before it reserves anything (no key, a bad
/// key, no tenant or a bad one, a body over the cap or unreadable): nothing
/// ran and nothing is recorded, and the corrected request may be sent again
/// with the same key. An idempotency layer around this one (a router-wide
/// one, outside the authentication or the request decoder this one is
/// behind) must not record it either, or that request would get this
/// refusal back, or a 422 once its body changed: marked [`NotFinal`].
fn not_processed(mut response: Response<Body>) -> Response<Body> {
    response.extensions_mut().insert(NotFinal);
    response
}

/// The body of the idempotent call: the handler, then its answer collected for recording.
async fn run_handler<S, ResBody>(
    config: &Config,
    mut inner: S,
    request: Request<Body>,
) -> Result<Recorded, Failure<S::Error>>
where
    S: tower_service::Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    let response = inner.call(request).await.map_err(Failure::Inner)?;
    record(config, response, AnswerOf::Handler).await
}

/// The layer's `recover` hook (or none) as the engine asks it.
struct RecoverHook<'a, E> {
    config: &'a Config,
    inner_error: std::marker::PhantomData<fn() -> E>,
}

impl<'a, E: Send + 'a> Recover<Recorded, Failure<E>> for RecoverHook<'a, E> {
    type Future = BoxFuture<'a, Result<Recovery<Recorded>, Failure<E>>>;

    fn ask(self, takeover: Takeover) -> Option<Self::Future> {
        let hook = self.config.recover.clone()?;
        let config = self.config;
        Some(Box::pin(async move {
            let not_recorded = match hook(takeover).await {
                Ok(Recovery::Run) => return Ok(Recovery::Run),
                Ok(Recovery::Completed(response)) => {
                    match record(config, response, AnswerOf::RecoverHook).await {
                        Err(Failure::Passthrough(response)) => response,
                        recorded => return recorded.map(Recovery::Completed),
                    }
                }
                Err(response) => response,
            };
            if !says_come_back(not_recorded.status()) {
                tracing::warn!(target: "idempotent", scope = config.spec.scope,
                    status = not_recorded.status().as_u16(),
                    "a recover hook's answer is not recorded (its Err, or a Completed answer the \
                     layer does not record) and has a status clients take as final; sent as 503 \
                     so that the client comes back and the hook is asked again");
                return Err(Failure::Passthrough(ask_again_later(
                    outcome_not_known_yet(&not_recorded),
                )));
            }
            Err(Failure::Passthrough(ask_again_later(not_recorded)))
        }))
    }
}

/// Whether a fresh answer of this status, sent with `Retry-After`, tells a
/// client to send the request again: a 5xx, or a 4xx other than 408 (which
/// timeout middleware sends after dropping a handler halfway, so clients
/// take it for final). A 1xx, 2xx or 3xx is an answer: the request's
/// outcome, or a redirect a client follows.
fn says_come_back(status: StatusCode) -> bool {
    status.is_server_error() || (status.is_client_error() && status != StatusCode::REQUEST_TIMEOUT)
}

/// What a recover hook's answer that is not recorded (its `Err`, or a
/// `Completed` answer the layer does not record) is sent as when its status
/// does not say "send it again" ([`says_come_back`]): the record is kept
/// for the next retry to ask again, and a 202, a 200 or a followed redirect
/// would report the unknown outcome to the client as a success (which then
/// never comes back for the answer the hook finds later), a 408 as a final
/// refusal. A 503 problem instead, with the hook's own `Retry-After` if it
/// gave one. The problem's `retry_after` is the header's number of seconds,
/// and left out when the header is a date (it says the same as the header,
/// or nothing).
fn outcome_not_known_yet(hook_answer: &Response<Body>) -> Response<Body> {
    let theirs = hook_answer.headers().get(header::RETRY_AFTER).cloned();
    let seconds = theirs
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let mut problem = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        types::SERVER_ERROR,
        "Outcome not known yet",
        "An earlier attempt of this request may have been processed, and the server cannot \
         tell yet whether it was. Nothing ran again: retry later with the same \
         Idempotency-Key, never a new one.",
    );
    problem.retry_after = match (&theirs, seconds) {
        (_, Some(seconds)) => Some(seconds),
        (Some(_date), None) => None,
        (None, None) => Some(1),
    };
    let mut response = problem.into_response();
    if let Some(theirs) = theirs {
        // Kept as given (an HTTP date too); `ask_again_later` marks the
        // answer `NotFinal` when the problem carries no number.
        response.headers_mut().insert(header::RETRY_AFTER, theirs);
    }
    response
}

/// A recover hook's answer that is sent but not recorded (its `Err`, or a
/// `Completed` answer the layer's rules do not record): the record is kept
/// and the next retry asks the hook again, so the answer says to send the
/// request again: `Retry-After: 1` unless it has one, and [`NotFinal`] (an
/// idempotency layer around this one does not record it either).
fn ask_again_later(mut response: Response<Body>) -> Response<Body> {
    response
        .headers_mut()
        .entry(header::RETRY_AFTER)
        .or_insert(HeaderValue::from_static("1"));
    response.extensions_mut().insert(NotFinal);
    response
}

/// Whose answer [`record`] collects: what becomes of the record when it
/// is not recorded differs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AnswerOf {
    /// The handler's: the key is released, and a retry runs the handler.
    Handler,
    /// A recover hook's `Completed` answer: the record is kept, its lease
    /// ended, and the next retry takes it over and asks again (rule 20).
    RecoverHook,
}

impl AnswerOf {
    fn not_recorded(self) -> &'static str {
        match self {
            AnswerOf::Handler => "the key is released",
            AnswerOf::RecoverHook => "the record is kept and the next retry asks the hook again",
        }
    }
}

/// An answer (the handler's, or a recover hook's), collected for recording
/// by the layer's rules.
async fn record<ResBody, E>(
    config: &Config,
    response: Response<ResBody>,
    of: AnswerOf,
) -> Result<Recorded, Failure<E>>
where
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    let status = response.status();
    if response.extensions().get::<NotFinal>().is_some() {
        tracing::info!(target: "idempotent", scope = config.spec.scope, status = status.as_u16(),
            "the answer says to send the request again (not final): not recorded; {}", of.not_recorded());
        return Err(Failure::Passthrough(response.map(Body::new)));
    }
    if !config.recording.records(status) {
        tracing::info!(target: "idempotent", scope = config.spec.scope, status = status.as_u16(),
            "answer not recorded by the layer's rule; {}", of.not_recorded());
        return Err(Failure::Passthrough(response.map(Body::new)));
    }
    let (parts, body) = response.into_parts();
    let (body, trailers) = match Limited::new(body, config.max_response_bytes)
        .collect()
        .await
    {
        Ok(collected) => {
            let trailers = collected.trailers().filter(|t| !t.is_empty()).cloned();
            (collected.to_bytes(), trailers)
        }
        Err(e) => {
            let too_large = e.downcast_ref::<LengthLimitError>().is_some();
            tracing::error!(target: "idempotent", scope = config.spec.scope, error = %e,
                "the answer could not be recorded; {}", of.not_recorded());
            if of == AnswerOf::RecoverHook {
                // Nothing ran again, and the record waits for the next ask:
                // a retry is safe (not `response-not-recorded`, which the
                // client takes for final).
                let mut problem = Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    types::SERVER_ERROR,
                    "Answer could not be recorded",
                    "The answer found for this request's earlier attempt could not be recorded \
                     (too large, or its body failed). Nothing ran again; the record is kept, and \
                     a retry with the same Idempotency-Key asks again.",
                );
                problem.retry_after = Some(1);
                return Err(Failure::Unrecordable(problem));
            }
            return Err(Failure::Unrecordable(Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::RESPONSE_NOT_RECORDED,
                "Answer could not be recorded",
                if too_large {
                    format!(
                        "The answer is larger than the {} bytes this route records, so it could \
                         not be kept for retries and the key was released. Contact the service's \
                         operators; a retry runs the request again.",
                        config.max_response_bytes
                    )
                } else {
                    "The answer's body failed while it was being read, so it could not be \
                     recorded and the key was released. A retry runs the request again."
                        .to_owned()
                },
            )));
        }
    };
    Ok(Recorded {
        status: parts.status,
        headers: allow_listed(&config.recorded_headers, &parts.headers),
        body,
        trailers: trailers
            .as_ref()
            .map(|t| allow_listed(&config.recorded_headers, t))
            .unwrap_or_default(),
        live: Some(Live { parts, trailers }),
    })
}

/// The fields of `map` named in `names`, in the order of `names`.
fn allow_listed(names: &[HeaderName], map: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    names
        .iter()
        .flat_map(|name| {
            map.get_all(name)
                .iter()
                .map(move |v| (name.clone(), v.clone()))
        })
        .collect()
}

/// The handler ran, but the store failed while its answer was being
/// recorded. The engine goes on recording it in the background (the record
/// stays in progress meanwhile), so a retry with the same key gets it.
fn answer_not_recorded_yet() -> Problem {
    let mut problem = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        types::ANSWER_NOT_RECORDED_YET,
        "Processed; answer not recorded yet",
        "The request was processed, but the server could not record its answer in its \
         idempotency store yet and goes on trying. Do not send it again with a new key: retry \
         later with the same Idempotency-Key to get the answer.",
    );
    problem.retry_after = Some(1);
    problem
}

fn missing_tenant() -> Problem {
    Problem::new(
        StatusCode::UNAUTHORIZED,
        types::MISSING_TENANT,
        "Caller not identified",
        "This request changes state and its Idempotency-Key belongs to a caller, but the request \
         does not say who the caller is. Authenticate (send your credentials or account id) and \
         send the request again with the same key.",
    )
}

/// Whether `error`, or one of the errors it wraps, is a body length
/// limit's `LengthLimitError`.
fn wraps_a_length_limit(error: &(dyn std::error::Error + 'static)) -> bool {
    // Bounded: a source chain is short, but nothing makes it end.
    std::iter::successors(Some(error), |e| e.source())
        .take(64)
        .any(|e| e.is::<LengthLimitError>())
}

/// A body over a limit set outside the layer, whose size this layer does
/// not know.
fn outer_body_too_large() -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        types::BODY_TOO_LARGE,
        "Request body too large",
        "The request body is larger than this route accepts. Send a smaller body; this \
         request was not processed.",
    )
}

fn body_too_large(limit: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        types::BODY_TOO_LARGE,
        "Request body too large",
        format!(
            "The request body is larger than the {limit} bytes this route accepts. Send a smaller \
             body; this request was not processed."
        ),
    )
}

// ---------------------------------------------------------------- the recorded answer

/// The handler's answer as recorded: status, allow-listed headers, body and
/// allow-listed trailers. The first answer also keeps what is not recorded
/// (`live`): every header, the trailers and the extensions the handler set.
struct Recorded {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
    trailers: Vec<(HeaderName, HeaderValue)>,
    live: Option<Live>,
}

/// The handler's own answer, less its body (buffered into the record): what
/// the first answer passes on unchanged and a replay does not have.
struct Live {
    /// Status, version, every header and the extensions.
    parts: axum::http::response::Parts,
    /// Every trailer, if the body had any.
    trailers: Option<HeaderMap>,
}

impl Recorded {
    fn into_response(self, replayed: bool) -> Response<Body> {
        let mut response = match self.live {
            Some(Live {
                mut parts,
                trailers,
            }) => {
                // The body is buffered now: its length is known again.
                parts.headers.remove(header::CONTENT_LENGTH);
                parts.headers.remove(header::TRANSFER_ENCODING);
                Response::from_parts(parts, body_with_trailers(self.body, trailers))
            }
            None => {
                let trailers = (!self.trailers.is_empty()).then(|| {
                    let mut map = HeaderMap::with_capacity(self.trailers.len());
                    for (name, value) in self.trailers {
                        map.append(name, value);
                    }
                    map
                });
                let mut headers = HeaderMap::with_capacity(self.headers.len());
                for (name, value) in self.headers {
                    headers.append(name, value);
                }
                if let Some(trailers) = &trailers {
                    // HTTP/1.1 sends only the trailers the head announces.
                    headers.remove(header::TRAILER);
                    for name in trailers.keys() {
                        headers.append(header::TRAILER, HeaderValue::from(name.clone()));
                    }
                }
                let mut response = Response::new(body_with_trailers(self.body, trailers));
                *response.status_mut() = self.status;
                *response.headers_mut() = headers;
                response
            }
        };
        if replayed {
            response
                .headers_mut()
                .insert(REPLAYED.clone(), HeaderValue::from_static("true"));
        }
        response
    }
}

/// `data`, then `trailers` if there are any. Without trailers the body's
/// length is exact (sent as `Content-Length`); with them it is not, so
/// HTTP/1.1 sends it chunked, the only framing that carries trailers.
fn body_with_trailers(data: Bytes, trailers: Option<HeaderMap>) -> Body {
    match trailers {
        None => Body::from(data),
        Some(trailers) => {
            let frames = [Frame::data(data), Frame::trailers(trailers)];
            Body::new(StreamBody::new(futures_util::stream::iter(
                frames.map(Ok::<_, std::convert::Infallible>),
            )))
        }
    }
}

/// Bytes in the record: text as is (JSON-escaped in the record), anything
/// else, and text that escaping would make larger than base64, as base64. A
/// body is stored in at most 4/3 of its size, so one up to
/// [`DEFAULT_MAX_RESPONSE_BYTES`] always fits the record.
#[derive(Serialize, Deserialize)]
enum StoredBytes<'a> {
    #[serde(rename = "t")]
    Text(std::borrow::Cow<'a, str>),
    #[serde(rename = "b64")]
    Base64(String),
}

impl<'a> StoredBytes<'a> {
    fn of(bytes: &'a [u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) if json_escaped_len(text) <= bytes.len().div_ceil(3) * 4 => {
                StoredBytes::Text(text.into())
            }
            _ => {
                use base64::Engine as _;
                StoredBytes::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
            }
        }
    }

    fn into_bytes(self) -> Result<Bytes, String> {
        match self {
            StoredBytes::Text(text) => Ok(Bytes::from(text.into_owned())),
            StoredBytes::Base64(b64) => {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map(Bytes::from)
                    .map_err(|e| e.to_string())
            }
        }
    }
}

/// The length of `text` as a JSON string's contents (serde_json's escapes).
fn json_escaped_len(text: &str) -> usize {
    text.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum()
}

#[derive(Serialize, Deserialize)]
struct StoredResponse<'a> {
    #[serde(rename = "status")]
    status: u16,
    #[serde(rename = "headers")]
    headers: Vec<(std::borrow::Cow<'a, str>, StoredBytes<'a>)>,
    #[serde(rename = "body")]
    body: StoredBytes<'a>,
    /// Absent in records without trailers, as in those written before
    /// trailers were recorded.
    #[serde(rename = "trailers", default, skip_serializing_if = "Vec::is_empty")]
    trailers: Vec<(std::borrow::Cow<'a, str>, StoredBytes<'a>)>,
}

fn stored_fields(
    fields: &[(HeaderName, HeaderValue)],
) -> Vec<(std::borrow::Cow<'_, str>, StoredBytes<'_>)> {
    fields
        .iter()
        .map(|(n, v)| (n.as_str().into(), StoredBytes::of(v.as_bytes())))
        .collect()
}

fn decoded_fields<E: serde::de::Error>(
    stored: Vec<(std::borrow::Cow<'_, str>, StoredBytes<'_>)>,
) -> Result<Vec<(HeaderName, HeaderValue)>, E> {
    let mut fields = Vec::with_capacity(stored.len());
    for (name, value) in stored {
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(E::custom)?;
        let value = value.into_bytes().map_err(E::custom)?;
        let value = HeaderValue::from_maybe_shared(value).map_err(E::custom)?;
        fields.push((name, value));
    }
    Ok(fields)
}

impl Serialize for Recorded {
    fn serialize<Ser: serde::Serializer>(&self, serializer: Ser) -> Result<Ser::Ok, Ser::Error> {
        StoredResponse {
            status: self.status.as_u16(),
            headers: stored_fields(&self.headers),
            body: StoredBytes::of(&self.body),
            trailers: stored_fields(&self.trailers),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Recorded {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        let stored = StoredResponse::deserialize(deserializer)?;
        Ok(Recorded {
            status: StatusCode::from_u16(stored.status).map_err(D::Error::custom)?,
            headers: decoded_fields(stored.headers)?,
            body: stored.body.into_bytes().map_err(D::Error::custom)?,
            trailers: decoded_fields(stored.trailers)?,
            live: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recover hook's answer that is not recorded says to send the request
    /// again, keeping a `Retry-After` of the hook's own.
    #[test]
    fn a_hooks_unrecorded_answer_says_to_ask_again() {
        let plain = ask_again_later(StatusCode::SERVICE_UNAVAILABLE.into_response());
        assert_eq!(plain.headers()[header::RETRY_AFTER], "1");
        assert!(plain.extensions().get::<NotFinal>().is_some());
        let own = ask_again_later(
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "30")],
            )
                .into_response(),
        );
        assert_eq!(own.headers()[header::RETRY_AFTER], "30");
        assert_eq!(own.headers().get_all(header::RETRY_AFTER).iter().count(), 1);
    }

    /// A hook's unrecorded answer of a status clients take for final is
    /// sent as a 503 problem that says to come back, with the hook's own
    /// `Retry-After` as it was given (an HTTP date too).
    #[tokio::test]
    async fn a_hooks_unrecorded_answer_of_a_final_status_becomes_a_503_problem() {
        for status in [
            StatusCode::OK,
            StatusCode::ACCEPTED,
            StatusCode::SEE_OTHER,
            StatusCode::REQUEST_TIMEOUT,
        ] {
            assert!(!says_come_back(status), "{status}");
        }
        for status in [
            StatusCode::FAILED_DEPENDENCY,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::BAD_GATEWAY,
        ] {
            assert!(says_come_back(status), "{status}");
        }
        let plain = ask_again_later(outcome_not_known_yet(&StatusCode::ACCEPTED.into_response()));
        assert_eq!(plain.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(plain.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            plain.headers()[header::CONTENT_TYPE],
            super::super::PROBLEM_JSON
        );
        assert!(plain.extensions().get::<NotFinal>().is_some());
        let date = "Wed, 21 Oct 2037 07:28:00 GMT";
        let dated = outcome_not_known_yet(
            &(StatusCode::ACCEPTED, [(header::RETRY_AFTER, date)]).into_response(),
        );
        assert_eq!(dated.headers()[header::RETRY_AFTER], date);
        assert_eq!(
            dated.headers().get_all(header::RETRY_AFTER).iter().count(),
            1
        );
        assert_eq!(
            problem_retry_after(dated).await,
            None,
            "no number of seconds in the body beside a date in the header"
        );
        let in_seconds = outcome_not_known_yet(
            &(StatusCode::ACCEPTED, [(header::RETRY_AFTER, "7")]).into_response(),
        );
        assert_eq!(in_seconds.headers()[header::RETRY_AFTER], "7");
        assert_eq!(problem_retry_after(in_seconds).await, Some(7));
        let dated = ask_again_later(outcome_not_known_yet(
            &(StatusCode::ACCEPTED, [(header::RETRY_AFTER, date)]).into_response(),
        ));
        assert!(dated.extensions().get::<NotFinal>().is_some());
    }

    /// The `retry_after` of the problem `response` carries.
    async fn problem_retry_after(response: Response<Body>) -> Option<u64> {
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body");
        serde_json::from_slice::<Problem>(&body)
            .expect("a problem")
            .retry_after
    }

    #[test]
    fn the_escaped_length_is_serde_jsons() {
        let mut every_byte = String::new();
        for c in 0u8..=0x7f {
            every_byte.push(c as char);
        }
        for text in [
            "",
            "plain",
            "quote \" and \\ back",
            "é ü 漢字 \u{1F600}",
            &every_byte,
        ] {
            let json = serde_json::to_string(text).expect("json");
            assert_eq!(super::json_escaped_len(text), json.len() - 2, "{text:?}");
        }
    }

    #[test]
    fn text_that_escaping_would_grow_past_base64_is_stored_as_base64() {
        assert!(matches!(
            super::StoredBytes::of(b"{\"a\":1}"),
            super::StoredBytes::Text(_)
        ));
        let controls = "\u{1}".repeat(300);
        assert!(matches!(
            super::StoredBytes::of(controls.as_bytes()),
            super::StoredBytes::Base64(_)
        ));
    }

    #[test]
    fn recorded_answers_round_trip_text_and_binary() {
        for body in [&b"{\"a\":1}"[..], &[0xff, 0x00, 0x80][..], b""] {
            let r = Recorded {
                status: StatusCode::CREATED,
                headers: vec![
                    (header::LOCATION, HeaderValue::from_static("/payments/1")),
                    (
                        header::CONTENT_TYPE,
                        HeaderValue::from_bytes(b"text/x; q=\xe9").unwrap(),
                    ),
                ],
                body: Bytes::copy_from_slice(body),
                trailers: vec![(
                    HeaderName::from_static("grpc-status"),
                    HeaderValue::from_static("0"),
                )],
                live: None,
            };
            let json = serde_json::to_vec(&r).unwrap();
            let back: Recorded = serde_json::from_slice(&json).unwrap();
            assert_eq!(back.status, r.status);
            assert_eq!(back.headers, r.headers);
            assert_eq!(back.body, r.body);
            assert_eq!(back.trailers, r.trailers);
        }
    }

    /// A record written before trailers were recorded (no `trailers` field)
    /// still decodes, and one without trailers is written as before.
    #[test]
    fn records_without_trailers_keep_the_earlier_format() {
        let earlier = r#"{"status":201,"headers":[["location",{"t":"/payments/1"}]],"body":{"t":"{\"a\":1}"}}"#;
        let r: Recorded = serde_json::from_str(earlier).expect("an earlier record decodes");
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(
            r.headers,
            vec![(header::LOCATION, HeaderValue::from_static("/payments/1"))]
        );
        assert_eq!(&r.body[..], b"{\"a\":1}");
        assert!(r.trailers.is_empty());
        assert_eq!(serde_json::to_string(&r).expect("json"), earlier);
    }

    #[tokio::test]
    async fn a_replay_announces_and_sends_its_recorded_trailers() {
        let r = Recorded {
            status: StatusCode::OK,
            headers: vec![(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            )],
            body: Bytes::from_static(b"\0\0\0\0\0"),
            trailers: vec![(
                HeaderName::from_static("grpc-status"),
                HeaderValue::from_static("0"),
            )],
            live: None,
        };
        let response = r.into_response(true);
        assert_eq!(response.headers()[header::TRAILER], "grpc-status");
        assert_eq!(response.headers()[&REPLAYED], "true");
        let collected = response.into_body().collect().await.expect("body");
        assert_eq!(
            collected.trailers().and_then(|t| t.get("grpc-status")),
            Some(&HeaderValue::from_static("0"))
        );
        assert_eq!(&collected.to_bytes()[..], b"\0\0\0\0\0");
    }

    #[test]
    fn layers_with_a_bad_scope_are_refused() {
        for bad in ["Payments", "a..b", "", &"a".repeat(129)] {
            let built = IdempotencyLayer::builder(bad, crate::MemoryStore::new()).build();
            assert!(
                matches!(built, Err(LayerConfigError::InvalidScope { .. })),
                "{bad:?}"
            );
        }
    }
}
