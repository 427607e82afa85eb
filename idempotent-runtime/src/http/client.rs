//! A client for APIs on the `Idempotency-Key` convention that retries safely.
//!
//! The rule it is built around: **a key belongs to an operation, not to an
//! attempt**. Make one [`Intent`] when the operation is decided (the user
//! opens the checkout, a job picks up an order), and call [`Intent::send`]
//! as often as needed: every attempt, inside `send` and across calls to it,
//! carries the same key. A second operation is a second `Intent`, with a new
//! key. There is no way to change an intent's key, and the retry loop lives
//! inside `send`, so "a new key on every retry" cannot be written by
//! accident. The key is pinned to the request, too: once an intent has been
//! sent or cloned (a clone is the same operation, e.g. to send it from
//! another task), a changed header or body is refused by `send` before
//! anything goes out ([`ClientError::RequestChanged`]), so a request set up
//! once and cloned per order cannot send every order under one key.
//!
//! ```no_run
//! use idempotent_runtime::http::{IdempotentClient, RetryPolicy};
//! use reqwest::Method;
//!
//! # async fn demo() -> Result<(), idempotent_runtime::http::ClientError> {
//! let client = IdempotentClient::new(reqwest::Client::new());
//! // Once per operation: the key is minted here.
//! let charge = client
//!     .intent(Method::POST, "http://127.0.0.1:3000/payments")?
//!     .header("x-account-id", "acct_alice")?
//!     .json(&serde_json::json!({"amount_cents": 450, "currency": "EUR"}))?;
//! let answer = charge.send().await?;          // retried with the same key
//! println!("{} (replayed: {}, attempts: {})", answer.status(), answer.is_replayed(), answer.attempts());
//! # Ok(()) }
//! ```
//!
//! Retries: connection errors, timeouts, 5xx, a 409 that is not a replay
//! (a request with the key still running; its `Retry-After` is honoured),
//! and 423, 425 and 429 ("not processed, try again"; `Retry-After` honoured),
//! and any other 4xx but 408 that carries `Retry-After` (the server asks
//! for the request again: a `recover` hook that could not tell yet),
//! but not a 500 `response-not-recorded` problem: the handler ran and its
//! answer could not be recorded, so a retry may run it again. A
//! replayed answer (`Idempotent-Replayed: true`), a 409 included, and every
//! other 4xx (408 whatever its headers) are final and returned as they are. A handler's own 409 is
//! retried like the framework's: behind a layer that records it, the retry
//! comes back replayed and final; from a server that does not, every attempt
//! is spent. Backoff is
//! exponential with jitter, bounded by [`RetryPolicy`].
//!
//! The client sends no TLS of its own: `idempotent-runtime` depends on
//! reqwest without default features. For `https://` URLs, enable a TLS
//! feature of reqwest in your own `Cargo.toml` (e.g. `reqwest = { version =
//! "0.13", features = ["rustls"] }`); cargo unifies the features.

use super::key::IDEMPOTENCY_KEY;
use super::problem::{Problem, PROBLEM_JSON};
use super::REPLAYED;
use bytes::Bytes;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{Method, StatusCode, Url};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// How [`Intent::send`] retries.
///
/// ```
/// use idempotent_runtime::http::RetryPolicy;
/// use std::time::Duration;
/// let patient = RetryPolicy { max_attempts: 10, max_backoff: Duration::from_secs(30), ..RetryPolicy::default() };
/// assert_eq!(patient.initial_backoff, Duration::from_millis(100));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 6). At least 1.
    pub max_attempts: u32,
    /// The backoff before the first retry (default 100 ms); doubles per retry.
    pub initial_backoff: Duration,
    /// The largest backoff (default 5 s).
    pub max_backoff: Duration,
    /// The longest `Retry-After` honoured (default 60 s); a longer one is cut to this.
    pub max_retry_after: Duration,
    /// A timeout for each attempt, answer body included (default 30 s).
    /// It replaces the `reqwest::Client`'s own `timeout` for every attempt
    /// (reqwest lets a request's timeout win over its client's); `None`
    /// leaves the client's in force, and with none there, nothing bounds an
    /// attempt, not even the size of the answer's body.
    pub attempt_timeout: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 6,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(60),
            attempt_timeout: Some(Duration::from_secs(30)),
        }
    }
}

impl RetryPolicy {
    /// The pause before retry number `retry` (1 for the first retry): the
    /// exponential backoff with "equal jitter" (between half and all of it),
    /// or the server's `Retry-After` when that is longer (capped at
    /// [`max_retry_after`](Self::max_retry_after)).
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let exp = 2u32.saturating_pow(retry.saturating_sub(1));
        let base = self
            .initial_backoff
            .saturating_mul(exp)
            .min(self.max_backoff);
        let half = base / 2;
        let jitter = Duration::from_nanos(fastrand::u64(
            0..=u64::try_from(half.as_nanos()).unwrap_or(u64::MAX),
        ));
        let backoff = half + jitter;
        match retry_after {
            Some(server) => server.min(self.max_retry_after).max(backoff),
            None => backoff,
        }
    }
}

/// What an [`Intent`] could not do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The URL could not be parsed, or its scheme is not `http` or `https`.
    #[error("invalid URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL given, without what may be secret in it (a user, a
        /// password, a query or a fragment), as logs show URLs.
        url: String,
        /// Why it was refused.
        reason: String,
    },
    /// A header name or value is not valid HTTP.
    #[error("invalid header {name:?}: {reason}")]
    InvalidHeader {
        /// The header's name as given.
        name: String,
        /// Why it was refused.
        reason: String,
    },
    /// A key given to [`IdempotentClient::intent_with_key`] cannot be sent
    /// as a bare `Idempotency-Key` header.
    #[error("the idempotency key cannot be sent: {0}")]
    InvalidKey(String),
    /// The request body could not be serialized as JSON.
    #[error("the request body could not be serialized as JSON: {0}")]
    Serialize(#[source] serde_json::Error),
    /// reqwest refused to build or send the request for a reason retrying
    /// cannot fix: nothing was sent.
    #[error("the request failed and retrying cannot help: {0}")]
    Request(#[source] reqwest::Error),
    /// The server answered with a redirect the `reqwest::Client` could not
    /// follow (a loop, too many hops, a location of another scheme than
    /// http(s), an `https://` location without TLS in this build). **The
    /// request itself was sent and answered, so the operation may have
    /// run**: sending the same intent again gets the same redirect. Send it
    /// again with the same key ([`Intent::key`], then
    /// [`IdempotentClient::intent_with_key`]) through a client built with
    /// `reqwest::redirect::Policy::none()`, which gets the 3xx itself as the
    /// answer (with `Idempotent-Replayed` when it is a replay); never a new
    /// key for this operation. (An `http://` intent
    /// through an `https://` proxy, without TLS in this build, fails the
    /// same way before anything is sent: reqwest's error cannot tell the
    /// two apart.)
    #[error(
        "the server answered with a redirect that could not be followed, so the request was \
         sent and the operation may have run: send it again with the same key (Intent::key, \
         intent_with_key) through a client built with `redirect::Policy::none()` to get the \
         redirect itself, never with a new key ({0})"
    )]
    RedirectNotFollowed(#[source] reqwest::Error),
    /// The URL is `https://`, and this build's reqwest has no TLS: nothing
    /// was sent. Enable a TLS feature of your reqwest dependency.
    #[error(
        "the URL needs TLS and this build's reqwest has none, so nothing was sent: enable a TLS \
         feature of your reqwest dependency (e.g. `rustls`) ({0})"
    )]
    NoTls(#[source] reqwest::Error),
    /// The server answered with a body larger than the client reads
    /// ([`IdempotentClient::with_max_answer_bytes`]; 64 MiB by default), in
    /// an answer that is not retried (a replay, a 4xx other than 409, 423,
    /// 425 and 429 without `Retry-After`, a 5xx problem+json), so it was not read (a server answering without end would otherwise use
    /// up the process's memory). **The request was sent and answered, so the
    /// operation may have run**: raise the limit and send the same intent
    /// again to read its answer (a replay, from a server that recorded it),
    /// never a new key.
    #[error(
        "the server answered {status} with a body larger than the {limit} bytes this client reads, \
         so it was not read; the request was sent and answered, so the operation may have run: \
         raise the limit (IdempotentClient::with_max_answer_bytes) and send the same intent \
         again, never with a new key"
    )]
    AnswerTooLarge {
        /// The answer's status.
        status: StatusCode,
        /// The limit it went past.
        limit: usize,
    },
    /// Every attempt ended in a retryable failure. **The outcome is unknown**:
    /// the operation may or may not have happened. Retry the same intent
    /// later ([`Intent::send`] again, or [`IdempotentClient::intent_with_key`]
    /// with the saved key): never make a new intent for this operation.
    #[error(
        "gave up after {attempts} attempt(s), the last one {last}; the outcome is unknown: \
             send the same intent again later (same key), never a new one for this operation"
    )]
    RetriesExhausted {
        /// How many attempts were made.
        attempts: u32,
        /// How the last attempt ended.
        last: LastAttempt,
    },
    /// The answer's body is not the JSON the caller asked for.
    #[error("the answer's body is not the expected JSON: {0}")]
    Decode(#[source] serde_json::Error),
    /// The intent's request was changed (a header, the body) after the
    /// intent was sent or cloned. Its key belongs to the request as it was
    /// then: sent changed, another request would go out under that key, which
    /// a server refuses (422) or, when the two look alike (two orders of one
    /// amount made from one cloned template), answers with the first one's
    /// recorded answer: the second operation would never run. Nothing was
    /// sent. A new operation is a new intent ([`IdempotentClient::intent`]),
    /// never a changed clone of another's; to send this operation again with
    /// a changed header (a refreshed token), make it anew with
    /// [`IdempotentClient::intent_with_key`] and this intent's
    /// [`key`](Intent::key).
    #[error(
        "this intent's request was changed after the intent was sent or cloned, and its key \
         belongs to the request as it was, so nothing was sent: make a new intent \
         (IdempotentClient::intent) for another operation, never a changed clone of another's; \
         to send this operation again with a changed header, make it anew with \
         IdempotentClient::intent_with_key and its key"
    )]
    RequestChanged,
}

/// How the last attempt of an exhausted [`Intent::send`] ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum LastAttempt {
    /// The server answered with a retryable status (a 5xx other than a 500
    /// `response-not-recorded`; or a 409, 423, 425 or 429; or another 4xx
    /// but 408 with `Retry-After`), not a replay.
    Status {
        /// The status.
        status: StatusCode,
        /// The problem+json body, when the answer had one.
        problem: Option<Problem>,
    },
    /// The connection failed or timed out.
    Transport(reqwest::Error),
}

impl std::fmt::Display for LastAttempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LastAttempt::Status {
                status,
                problem: Some(p),
            } => write!(f, "answered {status}: {}", p.detail),
            LastAttempt::Status { status, .. } => write!(f, "answered {status}"),
            LastAttempt::Transport(e) => write!(f, "failed: {e}"),
        }
    }
}

/// The final answer to an [`Intent`].
#[derive(Debug, Clone)]
pub struct IdempotentResponse {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    attempts: u32,
}

impl IdempotentResponse {
    /// The status of the answer.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers of the answer.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body of the answer.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Whether the server answered from its record (`Idempotent-Replayed:
    /// true`): the operation had already been carried out, by an earlier
    /// attempt whose answer was lost or by a concurrent one. The headers are
    /// those of the last answer: after a redirect the `reqwest::Client`
    /// followed (reqwest's default), the redirected-to answer's, so a
    /// replayed redirect reads as not replayed. A client built with
    /// `reqwest::redirect::Policy::none()` gets the server's own answer.
    pub fn is_replayed(&self) -> bool {
        replayed(&self.headers)
    }

    /// How many attempts it took (1: no retry).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The body as JSON of type `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, ClientError> {
        serde_json::from_slice(&self.body).map_err(ClientError::Decode)
    }

    /// The problem+json body, when the answer is one.
    pub fn problem(&self) -> Option<Problem> {
        problem_of(self.status, &self.headers, &self.body)
    }
}

/// Whether an answer is worth another attempt with the same key. A replay
/// (`Idempotent-Replayed: true`) never is: it is the key's recorded, final
/// answer, whatever its status (a recorded 5xx or 409 included). Of fresh
/// answers: a 5xx, but not a 500 `response-not-recorded` (the handler ran;
/// a retry would run it again); and a 409, which may say the request with
/// this key is still running. A fresh 409 cannot be told apart: the layer's
/// in-progress problem, another server's (the IETF draft's problem type is
/// the server's own, without `Retry-After`) and a handler's own 409 look
/// alike; the retry settles it (a handler's recorded 409 comes back replayed).
/// And the 4xx answers that say "not processed, try again" (423 Locked,
/// 425 Too Early, 429 Too Many Requests), which the layer never records,
/// and any other fresh 4xx but 408 that carries `Retry-After`
/// ([`asks_for_a_follow_up`]); their `Retry-After` is honoured. Not 408: timeout middleware (tower-http's
/// `TimeoutLayer`) answers 408 after dropping a handler halfway, so it may
/// have done its work.
fn worth_retrying(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> bool {
    if replayed(headers) {
        return false;
    }
    (status.is_server_error() && !handler_ran_unrecorded(status, headers, body))
        || status == StatusCode::CONFLICT
        || (super::layer::says_try_again(status) && status != StatusCode::REQUEST_TIMEOUT)
        || asks_for_a_follow_up(status, headers)
}

/// A fresh 4xx (not 408) that carries `Retry-After`: the server asks for
/// the request again after a while (RFC 9110 §10.2.3). The layer sends its
/// "not decided yet, ask again" answers so: a `recover` hook's `Err` (it
/// could not tell whether the earlier attempt's side effect happened; the
/// record is kept and the next retry asks again), or its `Completed`
/// answer the layer does not record, whatever their status (returned as
/// final, a hook's 424 would report an operation whose outcome is unknown
/// as refused, where the retry gets the charge the hook found).
/// Not 408, whose timeout middleware may have dropped a handler halfway.
fn asks_for_a_follow_up(status: StatusCode, headers: &HeaderMap) -> bool {
    status.is_client_error()
        && status != StatusCode::REQUEST_TIMEOUT
        && headers.contains_key(RETRY_AFTER)
}

/// The answer says `Idempotent-Replayed: true`.
fn replayed(headers: &HeaderMap) -> bool {
    headers
        .get(REPLAYED)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// A 500 saying the handler ran but its answer could not be recorded
/// (`response-not-recorded`): a retry may run the handler again. Final, like
/// a 4xx.
fn handler_ran_unrecorded(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> bool {
    problem_of(status, headers, body)
        .is_some_and(|p| p.problem_type == super::problem::types::RESPONSE_NOT_RECORDED)
}

/// The problem+json body of an answer, read as RFC 9457 §3.1 asks: a member
/// missing or of the wrong type is ignored (`type` is then `about:blank`,
/// `title` and `detail` empty, `status` the answer's, `retry_after` none),
/// so a problem from any server is read.
fn problem_of(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Option<Problem> {
    if !is_problem_json(headers) {
        return None;
    }
    let serde_json::Value::Object(members) = serde_json::from_slice(body).ok()? else {
        return None;
    };
    let text = |name: &str| {
        members
            .get(name)
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    let number = |name: &str| members.get(name).and_then(serde_json::Value::as_u64);
    Some(Problem {
        problem_type: text("type").unwrap_or_else(|| "about:blank".to_owned()),
        title: text("title").unwrap_or_default(),
        status: number("status")
            .and_then(|n| u16::try_from(n).ok())
            .unwrap_or(status.as_u16()),
        detail: text("detail").unwrap_or_default(),
        retry_after: number("retry_after"),
    })
}

/// A reqwest client that sends [`Intent`]s with retries.
#[derive(Debug, Clone)]
pub struct IdempotentClient {
    http: reqwest::Client,
    policy: RetryPolicy,
    max_answer_bytes: usize,
}

/// The largest answer body an [`IdempotentClient`] reads by default.
pub const DEFAULT_MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

impl Default for IdempotentClient {
    fn default() -> Self {
        IdempotentClient::new(reqwest::Client::default())
    }
}

impl IdempotentClient {
    /// Wraps a reqwest client with the default [`RetryPolicy`].
    pub fn new(http: reqwest::Client) -> Self {
        IdempotentClient {
            http,
            policy: RetryPolicy::default(),
            max_answer_bytes: DEFAULT_MAX_ANSWER_BYTES,
        }
    }

    setters! {
        /// Uses `policy` for every intent made from now on.
        fn with_policy(policy: RetryPolicy) => policy = policy;

        /// Reads answer bodies of at most `limit` bytes
        /// ([`DEFAULT_MAX_ANSWER_BYTES`] by default): a larger one is
        /// [`ClientError::AnswerTooLarge`], not read, for every intent made from
        /// now on. The body is read as it arrives and given up past the limit,
        /// so a server answering without end (or a compressed body that grows
        /// without end) uses no more memory than that.
        ///
        /// ```
        /// let client = idempotent_runtime::http::IdempotentClient::new(reqwest::Client::new())
        ///     .with_max_answer_bytes(1024 * 1024);
        /// ```
        fn with_max_answer_bytes(limit: usize) => max_answer_bytes = limit;
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// A new operation: mints a fresh key (a UUID v4) that every attempt of
    /// this intent will carry. Make it once per operation, outside any loop.
    pub fn intent(&self, method: Method, url: &str) -> Result<Intent, ClientError> {
        self.intent_with_key(method, url, uuid::Uuid::new_v4().to_string())
    }

    /// Resumes an operation whose key was saved (e.g. with the order, before
    /// the first attempt), after a restart of the calling program. The key
    /// is 1–255 bytes of printable ASCII (spaces included): a bare token
    /// (visible ASCII without `"`, `\`, `,` or `;`) is sent as it is, any
    /// other key as an RFC 8941 quoted string, which the server reads back
    /// to the same key.
    pub fn intent_with_key(
        &self,
        method: Method,
        url: &str,
        key: impl Into<String>,
    ) -> Result<Intent, ClientError> {
        let key = key.into();
        let bare = key
            .bytes()
            .all(|b| (0x21..=0x7e).contains(&b) && !matches!(b, b'"' | b'\\' | b',' | b';'));
        let sent = if bare {
            key.clone()
        } else {
            format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
        };
        let header = super::key::parse_key(sent.as_bytes())
            .ok()
            .filter(|parsed| *parsed == key)
            .and_then(|_| HeaderValue::from_str(&sent).ok())
            .ok_or_else(|| {
                ClientError::InvalidKey(
                    "use 1 to 255 bytes of printable ASCII (e.g. a UUID)".to_owned(),
                )
            })?;
        let invalid = |reason: String| ClientError::InvalidUrl {
            url: shown_unparsed_url(url),
            reason,
        };
        let url = Url::parse(url).map_err(|e| invalid(e.to_string()))?;
        // Refused here, not by reqwest at the first attempt, whose error
        // would show the whole URL (`user:password@host` parses as a URL
        // of scheme `user`).
        if !matches!(url.scheme(), "http" | "https") {
            return Err(invalid("the scheme must be http or https".to_owned()));
        }
        Ok(Intent {
            client: self.clone(),
            method,
            url,
            key,
            key_header: header,
            headers: HeaderMap::new(),
            body: None,
            pinned: Arc::new(AtomicBool::new(false)),
            changed: false,
        })
    }
}

/// One logical operation against an idempotent API: its key is fixed when
/// the intent is made, and every attempt of [`send`](Self::send) carries it.
///
/// The key is pinned to the request: once the intent has been sent or
/// cloned, a header or body set on it (or on any clone) makes
/// [`send`](Self::send) refuse it, before anything is sent
/// ([`ClientError::RequestChanged`]). A clone is the same operation, with
/// the same key and request (to send it from another task); a second
/// operation is a second intent.
///
/// Its `Debug` shows the method, the URL, a digest of the key and the names
/// of the extra headers: not the raw key (rule 2), nor header values (an
/// `Authorization` header's secret), nor the body.
pub struct Intent {
    client: IdempotentClient,
    method: Method,
    url: Url,
    key: String,
    key_header: HeaderValue,
    headers: HeaderMap,
    body: Option<Bytes>,
    /// Set once this intent or one of its clones was sent or cloned: from
    /// then on its request is the key's (shared by every clone).
    pinned: Arc<AtomicBool>,
    /// The request was changed once it was pinned: `send` refuses it.
    changed: bool,
}

impl Clone for Intent {
    /// The same operation: the same key and request. Pins the request, for
    /// this intent and the clone alike.
    fn clone(&self) -> Self {
        self.pinned.store(true, Ordering::Relaxed);
        Intent {
            client: self.client.clone(),
            method: self.method.clone(),
            url: self.url.clone(),
            key: self.key.clone(),
            key_header: self.key_header.clone(),
            headers: self.headers.clone(),
            body: self.body.clone(),
            pinned: self.pinned.clone(),
            changed: self.changed,
        }
    }
}

/// A `Retry-After` value (RFC 9110 §10.2.3): whole seconds, or an HTTP date
/// (then the time until it, as of `now`; zero once it has passed). `None`
/// when it is neither.
fn retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    // Seconds past `u64`: the longest wait there is (the caller caps it),
    // not "no advice" (which retried at once).
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::MAX);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The request failed because its URL needs TLS and this build's reqwest has
/// none (an `https://` URL without a TLS feature): every attempt would fail
/// alike, before anything is sent. hyper's connector says so only in its
/// message.
fn needs_tls(e: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = source {
        if error.to_string().contains("scheme is not http") {
            return true;
        }
        source = error.source();
    }
    false
}

/// reqwest's error names the request's URL in its message; it is kept as
/// [`shown_url`] shows it, so logs and error texts carry no user, password
/// or query (rule 2).
fn without_secrets(mut e: reqwest::Error) -> reqwest::Error {
    if let Some(url) = e.url_mut() {
        hide_secrets(url);
    }
    e
}

/// A URL as `Debug` shows it: scheme, host, port and path; no user, password
/// or query (they can carry secrets, like a header's value).
fn shown_url(url: &Url) -> String {
    let mut shown = url.clone();
    hide_secrets(&mut shown);
    shown.to_string()
}

/// [`shown_url`] for a URL that does not parse (or is refused): without a
/// query, a fragment, a user or a password. Without an `@`, there is no
/// user or password: the text up to its query or fragment. With one, the
/// scheme (`http` or `https`) and what follows the last `@` (a password may
/// hold `/`, and URL parsers also take `http:/u:p@host`, `http:u:p@host`
/// and backslashes); with a `?` or `#` as well, the scheme alone, for a
/// password may hold those and a query an `@` (review: a query's `@`
/// showed the rest of the query).
fn shown_unparsed_url(url: &str) -> String {
    if !url.contains('@') {
        return url.split(['?', '#']).next().unwrap_or_default().to_owned();
    }
    let scheme = match url.split_once(':') {
        Some((scheme, rest))
            if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") =>
        {
            Some((scheme, rest))
        }
        _ => None,
    };
    let Some((scheme, rest)) = scheme else {
        return "(not shown: it may hold a password)".to_owned();
    };
    if url.contains(['?', '#']) {
        return format!("{scheme}:(the rest not shown: it may hold a password)");
    }
    let after_slashes = rest.trim_start_matches(['/', '\\']);
    let slashes = &rest[..rest.len() - after_slashes.len()];
    let host_on = after_slashes
        .rsplit_once('@')
        .map_or(after_slashes, |(_, host_on)| host_on);
    format!("{scheme}:{slashes}{host_on}")
}

/// Takes a URL's user, password, query and fragment out.
fn hide_secrets(url: &mut Url) {
    // Only URLs that cannot have them refuse these; those have none to hide.
    let _ = url.set_username("");
    let _ = url.set_password(None);
    url.set_query(None);
    url.set_fragment(None);
}

impl std::fmt::Debug for Intent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Intent")
            .field("method", &self.method)
            .field("url", &shown_url(&self.url))
            .field("key_digest", &crate::identity::short_digest(&[&self.key]))
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("body_bytes", &self.body.as_ref().map(Bytes::len))
            .finish()
    }
}

impl Intent {
    /// The idempotency key of this operation. Save it with the operation if
    /// the program may restart before it is answered
    /// ([`IdempotentClient::intent_with_key`] resumes it).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Adds a header to every attempt. An `Idempotency-Key` given here is
    /// ignored: the intent's own key is always the one sent. A
    /// `Content-Type` replaces the one set before (by [`json`](Self::json)
    /// or an earlier call): a request has one.
    pub fn header(mut self, name: &str, value: &str) -> Result<Self, ClientError> {
        self.change();
        let invalid = |reason: String| ClientError::InvalidHeader {
            name: name.to_owned(),
            reason,
        };
        let n = HeaderName::from_bytes(name.as_bytes()).map_err(|e| invalid(e.to_string()))?;
        let v = HeaderValue::from_str(value).map_err(|e| invalid(e.to_string()))?;
        if n == CONTENT_TYPE {
            self.headers.insert(n, v);
        } else if n != IDEMPOTENCY_KEY {
            self.headers.append(n, v);
        }
        Ok(self)
    }

    /// Sets a JSON body (serialized once, so every attempt sends the same bytes).
    pub fn json<T: serde::Serialize + ?Sized>(mut self, body: &T) -> Result<Self, ClientError> {
        let bytes = serde_json::to_vec(body).map_err(ClientError::Serialize)?;
        self.change();
        self.headers
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        self.body = Some(Bytes::from(bytes));
        Ok(self)
    }

    /// Sets a raw body; set its `Content-Type` with [`header`](Self::header).
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.change();
        self.body = Some(body.into());
        self
    }

    /// Notes a change of the request: one made once it is pinned (sent or
    /// cloned) makes `send` refuse it.
    fn change(&mut self) {
        self.changed |= self.pinned.load(Ordering::Relaxed);
    }

    /// Sends the request, retrying with the same key per the client's
    /// [`RetryPolicy`]. Returns the first final answer (a replay, whatever
    /// its status; 2xx, 3xx, 4xx other than a fresh 409, 423, 425 or 429
    /// or one with `Retry-After`; a 500
    /// `response-not-recorded`), or [`ClientError::RetriesExhausted`] when every attempt
    /// failed retryably. Calling it again later is a further retry of the
    /// same operation, with the same key. An intent whose request was
    /// changed after it was sent or cloned is refused, and nothing is sent
    /// ([`ClientError::RequestChanged`]).
    pub async fn send(&self) -> Result<IdempotentResponse, ClientError> {
        if self.changed {
            return Err(ClientError::RequestChanged);
        }
        self.pinned.store(true, Ordering::Relaxed);
        let policy = &self.client.policy;
        let max_attempts = policy.max_attempts.max(1);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let last = match self.attempt().await {
                Ok(Attempted::TooLarge(status)) => {
                    return Err(ClientError::AnswerTooLarge {
                        status,
                        limit: self.client.max_answer_bytes,
                    });
                }
                Ok(Attempted::Answered(status, headers, body)) => {
                    if !worth_retrying(status, &headers, &body) {
                        return Ok(IdempotentResponse {
                            status,
                            headers,
                            body,
                            attempts: attempt,
                        });
                    }
                    let retry_after = headers
                        .get(RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| retry_after(v, SystemTime::now()));
                    let problem = problem_of(status, &headers, &body);
                    (LastAttempt::Status { status, problem }, retry_after)
                }
                // A redirect that could not be followed: a loop, too many
                // hops, a location reqwest refuses (another scheme: its
                // error names that location), or TLS needed for an `http://`
                // intent, so by a redirect's location (or an `https://`
                // proxy). The request itself was answered (client hunt: a
                // processed POST was reported as "nothing was sent"). A hop's
                // transport failure is retried: the replayed redirect is
                // followed again.
                Err(e)
                    if e.is_redirect()
                        || (e.is_builder() && e.url().is_some_and(|at| at != &self.url))
                        || (needs_tls(&e) && self.url.scheme() == "http") =>
                {
                    return Err(ClientError::RedirectNotFollowed(without_secrets(e)));
                }
                Err(e) if needs_tls(&e) => return Err(ClientError::NoTls(without_secrets(e))),
                Err(e) if e.is_builder() => {
                    return Err(ClientError::Request(without_secrets(e)));
                }
                Err(e) => (LastAttempt::Transport(without_secrets(e)), None),
            };
            let (last, retry_after) = last;
            if attempt >= max_attempts {
                tracing::warn!(target: "idempotent", method = %self.method, url = %shown_url(&self.url), attempts = attempt,
                    last = %last, "giving up; the outcome is unknown");
                return Err(ClientError::RetriesExhausted {
                    attempts: attempt,
                    last,
                });
            }
            let delay = policy.delay(attempt, retry_after);
            tracing::info!(target: "idempotent", method = %self.method, url = %shown_url(&self.url), attempt,
                last = %last, delay_ms = delay.as_millis() as u64, "retrying with the same idempotency key");
            tokio::time::sleep(delay).await;
        }
    }

    async fn attempt(&self) -> Result<Attempted, reqwest::Error> {
        let mut request = self
            .client
            .http
            .request(self.method.clone(), self.url.clone())
            .headers(self.headers.clone())
            .header(IDEMPOTENCY_KEY, self.key_header.clone());
        if let Some(body) = &self.body {
            request = request.body(body.clone());
        }
        if let Some(timeout) = self.client.policy.attempt_timeout {
            request = request.timeout(timeout);
        }
        let mut response = request.send().await?;
        let status = response.status();
        let headers = response.headers().clone();
        let limit = self.client.max_answer_bytes;
        // Past the limit, an answer its status and headers say to retry (a
        // balancer's 503 page) is retried as if it had no body; any other
        // is not read.
        let too_large = |headers: HeaderMap| {
            if retried_whatever_its_body(status, &headers) {
                Attempted::Answered(status, headers, Bytes::new())
            } else {
                Attempted::TooLarge(status)
            }
        };
        if response
            .content_length()
            .is_some_and(|length| length > u64::try_from(limit).unwrap_or(u64::MAX))
        {
            return Ok(too_large(headers));
        }
        let mut body = bytes::BytesMut::new();
        while let Some(chunk) = response.chunk().await? {
            if body.len().saturating_add(chunk.len()) > limit {
                return Ok(too_large(headers));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Attempted::Answered(status, headers, body.freeze()))
    }
}

/// Whether an answer is retried without looking at its body: one
/// [`worth_retrying`] on its status and headers alone, except a 5xx
/// problem+json, which may be `response-not-recorded` (final).
fn retried_whatever_its_body(status: StatusCode, headers: &HeaderMap) -> bool {
    !(status.is_server_error() && is_problem_json(headers)) && worth_retrying(status, headers, &[])
}

/// The answer's media type is problem+json.
fn is_problem_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|ct| ct.split(';').next())
        .is_some_and(|e| e.trim().eq_ignore_ascii_case(PROBLEM_JSON))
}

/// How one attempt was answered.
enum Attempted {
    /// Its status, headers and body.
    Answered(StatusCode, HeaderMap, Bytes),
    /// Its status; the body was larger than the client reads.
    TooLarge(StatusCode),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule 2: `Debug` of an intent shows neither the raw key nor header
    /// values, nor the URL's user, password or query.
    #[test]
    fn debug_shows_neither_the_key_nor_header_values() {
        let client = IdempotentClient::new(reqwest::Client::new());
        let intent = client
            .intent_with_key(
                Method::POST,
                "http://user:SECRET-PASSWORD@127.0.0.1:1/charges?token=SECRET-TOKEN",
                "SECRET-KEY-4711",
            )
            .expect("intent")
            .header("authorization", "Bearer SECRET-TOKEN")
            .expect("header");
        let shown = format!("{intent:?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(
            shown.contains("authorization") && shown.contains("/charges"),
            "{shown}"
        );
    }

    /// A key that is not a bare token is sent quoted (RFC 8941), and the
    /// server's parser reads the same key back; keys it cannot carry are
    /// refused when the intent is made.
    #[test]
    fn keys_that_are_not_bare_tokens_are_sent_quoted() {
        let client = IdempotentClient::new(reqwest::Client::new());
        for key in [
            "order 42",
            " padded ",
            "a\"b",
            "back\\slash",
            "a,b;c",
            "plain-uuid",
        ] {
            let intent = client
                .intent_with_key(Method::POST, "http://127.0.0.1:1/x", key)
                .unwrap_or_else(|e| panic!("{key:?}: {e}"));
            assert_eq!(intent.key(), key);
            let parsed = super::super::key::parse_key(intent.key_header.as_bytes());
            assert_eq!(
                parsed.as_deref(),
                Ok(key),
                "{key:?} as {:?}",
                intent.key_header
            );
        }
        assert_eq!(
            client
                .intent_with_key(Method::POST, "http://127.0.0.1:1/x", "plain-uuid")
                .unwrap()
                .key_header,
            "plain-uuid",
            "a bare token is sent as it is"
        );
        for bad in ["", "caf\u{e9}", "tab\there", &"k".repeat(256)] {
            assert!(
                matches!(
                    client.intent_with_key(Method::POST, "http://127.0.0.1:1/x", bad),
                    Err(ClientError::InvalidKey(_))
                ),
                "{bad:?}"
            );
        }
    }

    /// A request carries one `Content-Type`: the last one set, by `json` or
    /// `header`; other headers may repeat.
    #[test]
    fn the_last_content_type_set_is_the_one_sent() {
        let client = IdempotentClient::new(reqwest::Client::new());
        let intent = client
            .intent(Method::POST, "http://127.0.0.1:1/charges")
            .expect("intent")
            .json(&1)
            .expect("json")
            .header("Content-Type", "application/merge-patch+json")
            .expect("header")
            .header("accept", "a/b")
            .expect("header")
            .header("accept", "c/d")
            .expect("header");
        let content_types: Vec<_> = intent.headers.get_all(CONTENT_TYPE).iter().collect();
        assert_eq!(content_types, ["application/merge-patch+json"]);
        assert_eq!(intent.headers.get_all("accept").iter().count(), 2);
    }

    /// RFC 9110 §10.2.3: `Retry-After` is whole seconds or an HTTP date.
    #[test]
    fn retry_after_takes_seconds_or_an_http_date() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").expect("date");
        assert_eq!(retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        let later = now + Duration::from_secs(4);
        assert_eq!(
            retry_after(&httpdate::fmt_http_date(later), now),
            Some(Duration::from_secs(4))
        );
        let earlier = now - Duration::from_secs(4);
        assert_eq!(
            retry_after(&httpdate::fmt_http_date(earlier), now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after("soon", now), None);
        assert_eq!(
            retry_after("99999999999999999999999", now),
            Some(Duration::MAX),
            "too many seconds to count is the longest wait, which the policy caps"
        );
        assert_eq!(retry_after("-3", now), None);
    }

    /// RFC 9457 makes every member optional: a problem from another server
    /// is read, with the response's status where it names none.
    #[test]
    fn a_problem_with_optional_members_left_out_is_read() {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        let p = problem_of(
            StatusCode::CONFLICT,
            &headers,
            br#"{"title":"Conflict","detail":"try later"}"#,
        )
        .expect("a problem");
        assert_eq!(
            (p.problem_type.as_str(), p.status, p.title.as_str()),
            ("about:blank", 409, "Conflict")
        );
        let p = problem_of(
            StatusCode::FORBIDDEN,
            &headers,
            br#"{"type":"https://example.com/probs/out-of-credit","status":403}"#,
        )
        .expect("a problem");
        assert_eq!((p.status, p.detail.as_str()), (403, ""));
        // Members of the wrong type are ignored, not the whole problem.
        let p = problem_of(
            StatusCode::SERVICE_UNAVAILABLE,
            &headers,
            br#"{"type":7,"status":"503","detail":null,"title":"Down","retry_after":"5s"}"#,
        )
        .expect("a problem");
        assert_eq!(
            (
                p.problem_type.as_str(),
                p.status,
                p.title.as_str(),
                p.detail.as_str(),
                p.retry_after
            ),
            ("about:blank", 503, "Down", "", None)
        );
        assert!(problem_of(StatusCode::CONFLICT, &headers, b"[1, 2]").is_none());
    }

    #[test]
    fn delays_grow_are_jittered_and_honour_retry_after() {
        let p = RetryPolicy::default();
        for retry in 1..=10 {
            let d = p.delay(retry, None);
            let base = (p.initial_backoff * 2u32.pow(retry - 1)).min(p.max_backoff);
            assert!(
                d >= base / 2 && d <= base,
                "retry {retry}: {d:?} vs {base:?}"
            );
        }
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(3600))),
            p.max_retry_after
        );
        assert!(p.delay(u32::MAX, None) <= p.max_backoff);
    }

    #[test]
    fn each_intent_has_its_own_key_and_keeps_it() {
        let c = IdempotentClient::default();
        let a = c.intent(Method::POST, "http://127.0.0.1:1/x").unwrap();
        let b = c.intent(Method::POST, "http://127.0.0.1:1/x").unwrap();
        assert_ne!(a.key(), b.key());
        let a2 = a.clone().header("Idempotency-Key", "other").unwrap();
        assert_eq!(a2.key(), a.key());
        assert!(a2.headers.get(IDEMPOTENCY_KEY).is_none());
        assert!(matches!(
            c.intent_with_key(Method::POST, "http://h/x", "has\ttab"),
            Err(ClientError::InvalidKey(_))
        ));
        assert!(matches!(
            c.intent(Method::POST, "not a url"),
            Err(ClientError::InvalidUrl { .. })
        ));
        // Rule 2: what may be secret in a URL is not in its error (logs hunt).
        let refused = c
            .intent(
                Method::POST,
                "http://USER-SECRET:PASSWORD-SECRET@127.0.0.1:99999/p?token=QUERY-SECRET#F-SECRET",
            )
            .map(drop)
            .expect_err("an invalid port");
        let shown = format!("{refused} {refused:?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.contains("invalid URL \"http:"), "{shown}");
    }

    /// Rule 2 (client hunt): the forms URL parsers accept besides `://`,
    /// and a password holding `/`, `?` or `#`, showed the user and password
    /// (or part of it) in an invalid URL's error.
    #[test]
    fn an_unparsed_urls_user_and_password_are_never_shown() {
        let c = IdempotentClient::default();
        for url in [
            "http://USER-SECRET:PW-SECRET@127.0.0.1:99999/p",
            "http:/USER-SECRET:PW-SECRET@127.0.0.1:99999/p",
            "http:USER-SECRET:PW-SECRET@127.0.0.1:99999/p",
            "http:\\\\USER-SECRET:PW-SECRET@127.0.0.1:99999/p",
            "HTTPS://USER-SECRET:PW-SECRET@127.0.0.1:99999/p",
            "http://USER-SECRET:PW/SECRET@127.0.0.1:99999/p",
            // A raw `@` in the password: what follows the *last* one.
            "http://USER-SECRET:PW@SECRET@127.0.0.1:99999/p",
            "USER-SECRET:PW-SECRET@127.0.0.1:99999/p",
            // A `?` or `#` in the password, or an `@` in the query (review:
            // the rest of the query was shown): the scheme alone.
            "http://USER-SECRET:PW?SECRET@127.0.0.1:99999/p",
            "http://USER-SECRET:PW#SECRET@127.0.0.1:99999/p",
            "http://127.0.0.1:99999/hook?email=ops@example.com&token=QUERY-SECRET",
            "http://127.0.0.1:99999/hook#a@FRAGMENT-SECRET",
            "ftp://h/?e=a@b&token=QUERY-SECRET",
        ] {
            let refused = c.intent(Method::POST, url).map(drop).expect_err(url);
            let shown = format!("{refused} {refused:?}");
            assert!(!shown.contains("SECRET"), "{url}: {shown}");
        }
        let refused = c
            .intent(
                Method::POST,
                "http://USER-SECRET:PW-SECRET@127.0.0.1:99999/p",
            )
            .map(drop)
            .expect_err("an invalid port");
        assert!(
            refused.to_string().contains("http://127.0.0.1:99999/p"),
            "{refused}"
        );
    }
}
