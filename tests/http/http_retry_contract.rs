//! Rule 22 as a backend engineer meets it, on the memory store, a SQLite
//! file, PostgreSQL and MariaDB (when reachable): an axum app whose bearer
//! authentication sets the principal, handlers with extractors, the layer on
//! a route and router-wide. Requests are written byte for byte on a socket,
//! so a retry can differ from its first attempt only in how it is sent
//! (header order, JSON spacing and number forms, charset parameters,
//! framing, the key's spelling): each such retry replays the first answer,
//! and any request that differs in a value is refused with 422. Keys with
//! RFC 8941 escapes are their unescaped keys; malformed ones are 400; one
//! tenant's running request neither blocks nor answers another's; a waiting
//! duplicate whose owner answers 5xx runs the handler itself.

use crate::common;
use crate::common::logs::Logs;
use crate::http_app::{bounded, serve, sqlite_file_store};

use axum::body::Bytes;
use axum::extract::{OriginalUri, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::http::problem::types;
use idempotent_runtime::http::{IdempotencyKey, IdempotencyLayer, IdempotentClient, RetryPolicy};
use idempotent_runtime::store::{
    OwnerToken, RecordSnapshot, Reservation, ReserveRequest, ScopeStats,
};
use idempotent_runtime::{
    Completion, Fenced, ForcedRelease, Identity, MemoryStore, Store, StoreError,
};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{watch, Semaphore};

// ---------------------------------------------------------------- stores

/// Forwards every call to the store it wraps, and counts the waits of
/// duplicates that found a record in progress: the handshake that says a
/// duplicate is waiting inside the layer.
pub(crate) struct Observed {
    inner: Arc<dyn Store>,
    waits: watch::Sender<usize>,
}

impl Observed {
    pub(crate) fn new(inner: Arc<dyn Store>) -> Arc<Self> {
        Arc::new(Observed {
            inner,
            waits: watch::channel(0).0,
        })
    }

    pub(crate) async fn wait_for_a_waiter(&self) {
        let mut rx = self.waits.subscribe();
        bounded("a duplicate waiting in the layer", rx.wait_for(|&n| n > 0))
            .await
            .expect("store alive");
    }
}

#[async_trait::async_trait]
impl Store for Observed {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn max_result_bytes(&self) -> usize {
        self.inner.max_result_bytes()
    }
    fn database_id(&self) -> Option<&str> {
        self.inner.database_id()
    }
    fn records_in_process_memory(&self) -> bool {
        self.inner.records_in_process_memory()
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.inner.reserve(r).await
    }
    async fn complete(&self, c: Completion<'_>) -> Result<Fenced, StoreError> {
        self.inner.complete(c).await
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        self.inner.release(i, t).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.heartbeat(i, t, lease).await
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.release_detached(i, t)
    }
    fn complete_detached(&self, c: Completion<'_>) {
        self.inner.complete_detached(c)
    }
    fn end_lease_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.end_lease_detached(i, t)
    }
    async fn force_release(
        &self,
        i: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        self.inner.force_release(i, require_expired_lease).await
    }
    async fn wait_for_change(&self, i: &Identity, max_wait: Duration, round: u32) {
        self.waits.send_modify(|n| *n += 1);
        self.inner.wait_for_change(i, max_wait, round).await
    }
    async fn finish_background_work(&self, within: Duration) -> usize {
        self.inner.finish_background_work(within).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }
    async fn fetch(&self, i: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        self.inner.fetch(i).await
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.inner.scope_stats().await
    }
}

pub(crate) async fn every_store() -> Vec<(&'static str, Arc<dyn Store>)> {
    let mut stores: Vec<(&'static str, Arc<dyn Store>)> = vec![
        ("memory", Arc::new(MemoryStore::new())),
        ("sqlite", sqlite_file_store().await),
    ];
    if let Some(pg) = pg_store_or_skip().await {
        stores.push(("postgres", Arc::new(pg)));
    }
    if let Some(my) = mysql_store_or_skip().await {
        stores.push(("mariadb", Arc::new(my)));
    }
    stores
}

// ---------------------------------------------------------------- the app

/// The authenticated caller, from `Authorization: Bearer <principal>`.
#[derive(Debug, Clone)]
struct Principal(String);

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Bearer authentication: sets the principal (UTF-8) when there are credentials.
async fn bearer(mut request: Request, next: Next) -> Response {
    let principal = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|p| Principal(p.to_owned()));
    if let Some(principal) = principal {
        request.extensions_mut().insert(principal);
    }
    next.run(request).await
}

/// The service's state: runs of the handlers, a gate principals named
/// `held-…` wait at, and statuses the next runs answer with instead of 201.
struct Shop {
    runs: AtomicUsize,
    entered: watch::Sender<usize>,
    gate: Semaphore,
    next_statuses: std::sync::Mutex<Vec<StatusCode>>,
}

impl Shop {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
    async fn wait_entered(&self, n: usize) {
        let mut rx = self.entered.subscribe();
        bounded("a held run in the handler", rx.wait_for(|&v| v >= n))
            .await
            .expect("shop alive");
    }
}

/// `POST /orders`: a JSON order (the `Json` extractor), answered 201 with
/// the run number, the principal, the key and target it saw and the order.
async fn create_order(
    State(shop): State<Arc<Shop>>,
    Extension(principal): Extension<Principal>,
    OriginalUri(uri): OriginalUri,
    method: Method,
    key: IdempotencyKey,
    Json(order): Json<Value>,
) -> Response {
    let run = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    shop.entered.send_modify(|n| *n += 1);
    if principal.0.starts_with("held-") {
        shop.gate.acquire().await.expect("gate").forget();
    }
    let status = shop.next_statuses.lock().expect("statuses").pop();
    if let Some(status) = status {
        return (status, format!("run {run} failed")).into_response();
    }
    (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/orders/{run}")),
            (header::HeaderName::from_static("x-run"), run.to_string()),
        ],
        Json(json!({
            "run": run,
            "principal": principal.0,
            "key": key.as_str(),
            "method": method.as_str(),
            "target": uri.to_string(),
            "order": order,
        })),
    )
        .into_response()
}

/// `POST /notes`: any body (the `Bytes` extractor), answered 201 with its length.
async fn create_note(
    State(shop): State<Arc<Shop>>,
    Extension(principal): Extension<Principal>,
    body: Bytes,
) -> Response {
    let run = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        format!("note run {run} for {principal}: {} bytes", body.len()),
    )
        .into_response()
}

fn shop() -> Arc<Shop> {
    Arc::new(Shop {
        runs: AtomicUsize::new(0),
        entered: watch::channel(0).0,
        gate: Semaphore::new(0),
        next_statuses: std::sync::Mutex::new(Vec::new()),
    })
}

/// The app with the layer on its routes (`route_layer`), behind the bearer
/// authentication. Its address (host:port) and state.
async fn app_on(
    store: Arc<dyn Store>,
    scope: &str,
    configure: impl FnOnce(
        idempotent_runtime::http::IdempotencyLayerBuilder,
    ) -> idempotent_runtime::http::IdempotencyLayerBuilder,
) -> (String, Arc<Shop>) {
    let shop = shop();
    let layer =
        configure(IdempotencyLayer::builder(scope, store).tenant_from_extension::<Principal>())
            .build()
            .expect("layer");
    let app = Router::new()
        .route("/orders", post(create_order).put(create_order))
        .route("/notes", post(create_note))
        .route_layer(layer)
        .layer(middleware::from_fn(bearer))
        .with_state(shop.clone());
    let (base, _task) = serve(app).await;
    (base.trim_start_matches("http://").to_owned(), shop)
}

// ---------------------------------------------------------------- raw HTTP/1.1

enum Framing<'a> {
    /// No body and no framing header at all.
    None,
    /// `Content-Length`.
    Length(&'a [u8]),
    /// `Transfer-Encoding: chunked`, in these chunks.
    Chunked(&'a [&'a [u8]]),
}

struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
    fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "a problem: {}",
            String::from_utf8_lossy(&self.body)
        );
        self.json()["type"].as_str().unwrap_or_default().to_owned()
    }
}

/// Sends one request, written byte for byte (`head` is the request line and
/// the header lines, each ending in CRLF, without the framing headers), on a
/// connection of its own; reads the answer to the end.
async fn send_raw(addr: &str, head: &[u8], framing: Framing<'_>) -> Answer {
    let mut request = head.to_vec();
    request.extend_from_slice(b"host: test\r\nconnection: close\r\n");
    match framing {
        Framing::None => request.extend_from_slice(b"\r\n"),
        Framing::Length(body) => {
            request.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
            request.extend_from_slice(body);
        }
        Framing::Chunked(chunks) => {
            request.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
            for chunk in chunks {
                request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                request.extend_from_slice(chunk);
                request.extend_from_slice(b"\r\n");
            }
            request.extend_from_slice(b"0\r\n\r\n");
        }
    }
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(&request).await.expect("write");
    let mut raw = Vec::new();
    bounded("the answer", stream.read_to_end(&mut raw))
        .await
        .expect("read");
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines.next().expect("status line")[9..12]
        .parse()
        .expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[end + 4..].to_vec();
    if headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"))
    {
        let mut decoded = Vec::new();
        let mut rest = &body[..];
        loop {
            let line = rest.windows(2).position(|w| w == b"\r\n").expect("chunk");
            let size = usize::from_str_radix(
                std::str::from_utf8(&rest[..line])
                    .expect("size")
                    .split(';')
                    .next()
                    .expect("size"),
                16,
            )
            .expect("hex size");
            rest = &rest[line + 2..];
            if size == 0 {
                break;
            }
            decoded.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
        body = decoded;
    }
    Answer {
        status,
        headers,
        body,
    }
}

/// `POST <target>` with these header lines (each `name: value`).
fn head(method: &str, target: &str, lines: &[&str]) -> Vec<u8> {
    let mut head = format!("{method} {target} HTTP/1.1\r\n").into_bytes();
    for line in lines {
        head.extend_from_slice(line.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head
}

// ---------------------------------------------------------------- tests

const ORDER: &str =
    r#"{"amount":450,"currency":"EUR","items":[{"sku":"a/b","qty":1}],"note":"caf\u00e9 €"}"#;

/// A retry may be sent by another client, proxy or library than its first
/// attempt: members in another order and other whitespace, numbers in
/// other forms (`450`, `450.0`, `4.5e2`, `4.50E+2`, `45e1`, `0.45e3`),
/// strings with other escapes, the `Content-Type` with a `charset` or in
/// another case, a byte order mark, the body chunked, the headers in
/// another order, the key quoted or padded, the target in absolute form.
/// Each is the same request: it replays the first answer (status, body,
/// `Location`, `Idempotent-Replayed: true`) and the handler runs once.
#[tokio::test]
async fn a_retry_sent_in_another_wire_form_replays_the_first_answer() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.wire", |b| b).await;
        let tenant = fresh_tenant();
        let auth = format!("authorization: Bearer {tenant}");
        let first = send_raw(
            &addr,
            &head(
                "POST",
                "/orders?channel=web",
                &[
                    "content-type: application/json",
                    "idempotency-key: wire-1",
                    &auth,
                ],
            ),
            Framing::Length(ORDER.as_bytes()),
        )
        .await;
        assert_eq!(
            first.status,
            201,
            "{name}: {}",
            String::from_utf8_lossy(&first.body)
        );
        assert!(!first.replayed(), "{name}");
        let bom_order = [&b"\xEF\xBB\xBF"[..], ORDER.as_bytes()].concat();
        let pretty = "{\r\n\t\"note\" : \"caf\u{e9} \\u20AC\",\n  \"items\" : [ { \"qty\" : 1.0 , \"sku\" : \"a\\/b\" } ],\n  \"currency\":\"\\u0045UR\", \"amount\" : 4.50E+2\n}\n";
        let numbers = [
            r#"{"amount":450.0,"currency":"EUR","items":[{"sku":"a/b","qty":1}],"note":"café €"}"#,
            r#"{"amount":4.5e2,"currency":"EUR","items":[{"sku":"a/b","qty":10e-1}],"note":"café €"}"#,
            r#"{"amount":45e1,"currency":"EUR","items":[{"sku":"a/b","qty":1}],"note":"café €"}"#,
            r#"{"amount":0.45e3,"currency":"EUR","items":[{"sku":"a/b","qty":1}],"note":"café €"}"#,
            r#"{"amount":450.000,"currency":"EUR","items":[{"sku":"a/b","qty":100E-2}],"note":"café €"}"#,
        ];
        let mut variants: Vec<(String, Vec<u8>, Vec<String>, bool)> = vec![
            (
                "headers in another order, key quoted".into(),
                ORDER.into(),
                vec![
                    auth.clone(),
                    "idempotency-key: \"wire-1\"".into(),
                    "content-type: application/json".into(),
                ],
                false,
            ),
            (
                "key padded with spaces".into(),
                ORDER.into(),
                vec![
                    "idempotency-key:    wire-1   ".into(),
                    "content-type: application/json".into(),
                    auth.clone(),
                ],
                false,
            ),
            (
                "charset parameter".into(),
                ORDER.into(),
                vec![
                    "content-type: application/json;charset=UTF-8".into(),
                    "idempotency-key: wire-1".into(),
                    auth.clone(),
                ],
                false,
            ),
            (
                "media type in capitals, quoted charset, spaces".into(),
                ORDER.into(),
                vec![
                    "content-type: Application/JSON ; charset=\"utf-8\"".into(),
                    "idempotency-key: wire-1".into(),
                    auth.clone(),
                ],
                false,
            ),
            (
                "pretty, reordered, escaped, another number form".into(),
                pretty.into(),
                vec![
                    "content-type: application/json".into(),
                    "idempotency-key: wire-1".into(),
                    auth.clone(),
                ],
                false,
            ),
            (
                "byte order mark".into(),
                bom_order,
                vec![
                    "content-type: application/json".into(),
                    "idempotency-key: wire-1".into(),
                    auth.clone(),
                ],
                false,
            ),
            (
                "chunked".into(),
                ORDER.into(),
                vec![
                    "content-type: application/json".into(),
                    "idempotency-key: wire-1".into(),
                    auth.clone(),
                ],
                true,
            ),
        ];
        for (i, n) in numbers.iter().enumerate() {
            variants.push((
                format!("number form {i}"),
                n.as_bytes().to_vec(),
                vec![
                    "content-type: application/json".into(),
                    "idempotency-key: wire-1".into(),
                    auth.clone(),
                ],
                false,
            ));
        }
        for (what, body, lines, chunked) in &variants {
            let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
            let framing = if *chunked {
                let (a, b) = body.split_at(7);
                let (b, c) = b.split_at(1);
                Framing::Chunked(&[a, b, c][..])
            } else {
                Framing::Length(body)
            };
            let retry =
                send_raw(&addr, &head("POST", "/orders?channel=web", &lines), framing).await;
            assert_eq!(
                retry.status,
                201,
                "{name}, {what}: {}",
                String::from_utf8_lossy(&retry.body)
            );
            assert!(retry.replayed(), "{name}, {what}: not a replay");
            assert_eq!(retry.body, first.body, "{name}, {what}");
            assert_eq!(
                retry.header("location"),
                first.header("location"),
                "{name}, {what}"
            );
            assert_eq!(
                retry.header("x-run"),
                None,
                "{name}, {what}: not allow-listed"
            );
        }
        // The target in absolute form (as a proxy forwards it).
        let absolute = send_raw(
            &addr,
            &head(
                "POST",
                &format!("http://{addr}/orders?channel=web"),
                &[
                    "content-type: application/json",
                    "idempotency-key: wire-1",
                    &auth,
                ],
            ),
            Framing::Length(ORDER.as_bytes()),
        )
        .await;
        assert!(
            absolute.replayed(),
            "{name}: absolute form: {}",
            absolute.status
        );
        assert_eq!(absolute.body, first.body, "{name}");
        assert_eq!(shop.runs(), 1, "{name}: the handler ran once");
    }
}

/// A request that differs from the recorded one in any value (a digit past
/// `f64`'s precision, a string's case, an array's order, a member more, a
/// number sent as a string, the query, the method, the media type, a
/// `Content-Encoding`) is refused 422 with a problem, runs nothing and
/// leaves the record as it was: the original retry still replays.
#[tokio::test]
async fn a_request_that_differs_in_any_value_is_422_and_the_record_is_untouched() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.values", |b| b).await;
        let tenant = fresh_tenant();
        let auth = format!("authorization: Bearer {tenant}");
        let json_lines = [
            "content-type: application/json",
            "idempotency-key: v-1",
            &auth,
        ];
        let body = r#"{"amount":450,"currency":"EUR","items":[1,2]}"#;
        let first = send_raw(
            &addr,
            &head("POST", "/orders", &json_lines),
            Framing::Length(body.as_bytes()),
        )
        .await;
        assert_eq!(first.status, 201, "{name}");
        let others: [(&str, &str, &str, &[&str]); 11] = [
            (
                "POST",
                "/orders",
                r#"{"amount":450.00000000000000000001,"currency":"EUR","items":[1,2]}"#,
                &json_lines,
            ),
            (
                "POST",
                "/orders",
                r#"{"amount":450,"currency":"eur","items":[1,2]}"#,
                &json_lines,
            ),
            (
                "POST",
                "/orders",
                r#"{"amount":450,"currency":"EUR","items":[2,1]}"#,
                &json_lines,
            ),
            (
                "POST",
                "/orders",
                r#"{"amount":450,"currency":"EUR","items":[1,2],"x":null}"#,
                &json_lines,
            ),
            (
                "POST",
                "/orders",
                r#"{"amount":"450","currency":"EUR","items":[1,2]}"#,
                &json_lines,
            ),
            (
                "POST",
                "/orders",
                r#"{"amount":-450,"currency":"EUR","items":[1,2]}"#,
                &json_lines,
            ),
            ("POST", "/orders?", body, &json_lines),
            ("POST", "/orders?dry_run=1", body, &json_lines),
            ("PUT", "/orders", body, &json_lines),
            (
                "POST",
                "/orders",
                body,
                &[
                    "content-type: application/merge-patch+json",
                    "idempotency-key: v-1",
                    &auth,
                ],
            ),
            (
                "POST",
                "/orders",
                body,
                &[
                    "content-type: application/json",
                    "content-encoding: gzip",
                    "idempotency-key: v-1",
                    &auth,
                ],
            ),
        ];
        for (method, target, other, lines) in others {
            let r = send_raw(
                &addr,
                &head(method, target, lines),
                Framing::Length(other.as_bytes()),
            )
            .await;
            assert_eq!(r.status, 422, "{name}: {method} {target} {other} {lines:?}");
            assert_eq!(r.problem_type(), types::KEY_REUSED, "{name}");
            assert!(!r.replayed(), "{name}");
        }
        assert_eq!(shop.runs(), 1, "{name}: nothing else ran");
        let retry = send_raw(
            &addr,
            &head("POST", "/orders", &json_lines),
            Framing::Length(body.as_bytes()),
        )
        .await;
        assert!(retry.replayed(), "{name}");
        assert_eq!(retry.body, first.body, "{name}");
    }
}

/// A `POST` without a body may be sent with `Content-Length: 0`, with no
/// framing header at all, or chunked with only the last chunk: the same
/// (empty) request, one run and replays; with or without a JSON media type.
#[tokio::test]
async fn an_empty_body_sent_with_a_zero_length_chunked_or_unframed_is_one_request() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.empty", |b| b).await;
        let tenant = fresh_tenant();
        let auth = format!("authorization: Bearer {tenant}");
        for (key, media) in [
            ("empty-plain", None),
            ("empty-json", Some("content-type: application/json")),
        ] {
            let key_line = format!("idempotency-key: {key}");
            let mut lines = vec![key_line.as_str(), auth.as_str()];
            lines.extend(media);
            let before = shop.runs();
            let first =
                send_raw(&addr, &head("POST", "/notes", &lines), Framing::Length(b"")).await;
            assert_eq!(first.status, 201, "{name} {key}");
            for (what, framing) in [
                ("unframed", Framing::None),
                ("chunked", Framing::Chunked(&[])),
                ("zero length", Framing::Length(b"")),
            ] {
                let retry = send_raw(&addr, &head("POST", "/notes", &lines), framing).await;
                assert_eq!(
                    retry.status,
                    201,
                    "{name} {key} {what}: {}",
                    String::from_utf8_lossy(&retry.body)
                );
                assert!(retry.replayed(), "{name} {key} {what}");
                assert_eq!(retry.body, first.body, "{name} {key} {what}");
            }
            assert_eq!(shop.runs(), before + 1, "{name} {key}");
        }
    }
}

/// RFC 8941 strings: `"a\"b"` is the key `a"b` and `"a\\b"` the key `a\b`,
/// two keys apart from each other and from `ab`; keys holding SQL's
/// wildcards and quotes are keys like any other; 255 bytes after unquoting
/// is a key (its header is longer), 256 is refused. The key the handler's
/// `IdempotencyKey` extractor sees is the unescaped one, and an `Intent`
/// made with that key reaches the same record.
#[tokio::test]
async fn quoted_keys_are_their_unescaped_keys_on_every_store() {
    let at_limit = format!("\"{}\"", r#"\""#.repeat(255));
    let past_limit = format!("\"{}\"", r#"\""#.repeat(256));
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.quoted", |b| b).await;
        let tenant = fresh_tenant();
        let auth = format!("authorization: Bearer {tenant}");
        let keys: [(&str, String); 8] = [
            (r#""a\"b""#, r#"a"b"#.into()),
            (r#""a\\b""#, r"a\b".into()),
            ("ab", "ab".into()),
            (r#""a\\\"b""#, r#"a\"b"#.into()),
            ("a%", "a%".into()),
            ("a_", "a_".into()),
            (
                r#""it's a key; really, yes""#,
                "it's a key; really, yes".into(),
            ),
            (at_limit.as_str(), "\"".repeat(255)),
        ];
        let mut answers = Vec::new();
        for (header_value, key) in &keys {
            let key_line = format!("idempotency-key: {header_value}");
            let r = send_raw(
                &addr,
                &head(
                    "POST",
                    "/orders",
                    &["content-type: application/json", &key_line, &auth],
                ),
                Framing::Length(b"{}"),
            )
            .await;
            assert_eq!(
                r.status,
                201,
                "{name} {header_value}: {}",
                String::from_utf8_lossy(&r.body)
            );
            assert!(!r.replayed(), "{name} {header_value}: another key's answer");
            assert_eq!(r.json()["key"], key.as_str(), "{name} {header_value}");
            answers.push(r.body);
        }
        assert_eq!(shop.runs(), keys.len(), "{name}");
        for ((header_value, _), answer) in keys.iter().zip(&answers) {
            let key_line = format!("idempotency-key: {header_value}");
            let r = send_raw(
                &addr,
                &head(
                    "POST",
                    "/orders",
                    &["content-type: application/json", &key_line, &auth],
                ),
                Framing::Length(b"{}"),
            )
            .await;
            assert!(r.replayed(), "{name} {header_value}");
            assert_eq!(&r.body, answer, "{name} {header_value}");
        }
        // The client quotes what needs quoting: its retries reach those records.
        let client = IdempotentClient::new(reqwest::Client::new());
        for (i, (_, key)) in keys.iter().enumerate() {
            let answer = client
                .intent_with_key(Method::POST, &format!("http://{addr}/orders"), key.clone())
                .expect("intent")
                .header("authorization", &format!("Bearer {tenant}"))
                .expect("header")
                .json(&json!({}))
                .expect("json")
                .send()
                .await
                .expect("answer");
            assert!(answer.is_replayed(), "{name} {key:?}");
            assert_eq!(&answer.body()[..], &answers[i][..], "{name} {key:?}");
        }
        let key_line = format!("idempotency-key: {past_limit}");
        let r = send_raw(
            &addr,
            &head(
                "POST",
                "/orders",
                &["content-type: application/json", &key_line, &auth],
            ),
            Framing::Length(b"{}"),
        )
        .await;
        assert_eq!(r.status, 400, "{name}");
        assert_eq!(r.problem_type(), types::INVALID_KEY, "{name}");
        assert_eq!(shop.runs(), keys.len(), "{name}");
    }
}

/// Every malformed `Idempotency-Key` is a 400 `invalid-key` problem, and
/// nothing runs: an escape other than `\"` and `\\`, a backslash that ends
/// the string, a tab or a non-ASCII byte (bare or quoted), a list, a
/// parameter, an empty or blank value, a quote inside a quoted key, the
/// header twice (even with one value). No key at all is 400
/// `missing-key`. None of them holds the key:
/// the well-formed request then runs.
#[tokio::test]
async fn malformed_keys_are_400_problems_and_run_nothing() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (addr, shop) = app_on(store, "contract.malformed", |b| b).await;
    let tenant = fresh_tenant();
    let auth = format!("authorization: Bearer {tenant}");
    let bad: [&[u8]; 13] = [
        br#""a\qb""#,
        br#""a\""#,
        b"\"a\\\"",
        b"\"a\tb\"",
        b"caf\xc3\xa9",
        b"\"caf\xc3\xa9\"",
        br#""a", "b""#,
        b"a, b",
        br#""a";x=1"#,
        b"a;x=1",
        b"",
        b"   ",
        br#""a"b""#,
    ];
    for value in bad {
        let mut lines = head(
            "POST",
            "/orders",
            &["content-type: application/json", &auth],
        );
        lines.extend_from_slice(b"idempotency-key: ");
        lines.extend_from_slice(value);
        lines.extend_from_slice(b"\r\n");
        let r = send_raw(&addr, &lines, Framing::Length(b"{}")).await;
        assert_eq!(r.status, 400, "{:?}", String::from_utf8_lossy(value));
        assert_eq!(
            r.problem_type(),
            types::INVALID_KEY,
            "{:?}",
            String::from_utf8_lossy(value)
        );
    }
    for twice in [
        &["idempotency-key: k", "idempotency-key: k"][..],
        &["idempotency-key: k", "idempotency-key: \"k\""][..],
    ] {
        let mut lines = vec!["content-type: application/json", auth.as_str()];
        lines.extend_from_slice(twice);
        let r = send_raw(
            &addr,
            &head("POST", "/orders", &lines),
            Framing::Length(b"{}"),
        )
        .await;
        assert_eq!(r.status, 400, "{twice:?}");
        assert_eq!(r.problem_type(), types::INVALID_KEY, "{twice:?}");
    }
    let r = send_raw(
        &addr,
        &head(
            "POST",
            "/orders",
            &["content-type: application/json", &auth],
        ),
        Framing::Length(b"{}"),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.problem_type(), types::MISSING_KEY);
    assert_eq!(shop.runs(), 0, "a refused request ran");
    let r = send_raw(
        &addr,
        &head(
            "POST",
            "/orders",
            &[
                "content-type: application/json",
                "idempotency-key: k",
                &auth,
            ],
        ),
        Framing::Length(b"{}"),
    )
    .await;
    assert_eq!(r.status, 201);
    assert!(!r.replayed());
}

/// One tenant's request still running holds only its own record: another
/// tenant's request with the same key runs at once (it neither waits for
/// it nor gets 409) and gets its own answer; when the first ends, each
/// tenant's retry replays its own answer, never the other's.
#[tokio::test]
async fn a_running_request_neither_blocks_nor_answers_another_tenant_with_the_same_key() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.tenants", |b| b.reject_in_progress()).await;
        let held = format!("held-{}", fresh_tenant());
        let other = fresh_tenant();
        let send = |tenant: String| {
            let addr = addr.clone();
            async move {
                let auth = format!("authorization: Bearer {tenant}");
                send_raw(
                    &addr,
                    &head(
                        "POST",
                        "/orders",
                        &[
                            "content-type: application/json",
                            "idempotency-key: shared-key",
                            &auth,
                        ],
                    ),
                    Framing::Length(br#"{"amount":1}"#),
                )
                .await
            }
        };
        let first = tokio::spawn(send(held.clone()));
        shop.wait_entered(1).await;
        // The held tenant's own duplicate is refused at once (reject_in_progress)...
        let duplicate = send(held.clone()).await;
        assert_eq!(duplicate.status, 409, "{name}");
        assert_eq!(duplicate.problem_type(), types::IN_PROGRESS, "{name}");
        assert!(duplicate.header("retry-after").is_some(), "{name}");
        // ...another tenant's request with that key is not.
        let theirs = send(other.clone()).await;
        assert_eq!(
            theirs.status,
            201,
            "{name}: {}",
            String::from_utf8_lossy(&theirs.body)
        );
        assert!(!theirs.replayed(), "{name}");
        assert_eq!(theirs.json()["principal"], other.as_str(), "{name}");
        shop.gate.add_permits(1);
        let first = bounded("the held request", first).await.expect("task");
        assert_eq!(first.status, 201, "{name}");
        assert_eq!(first.json()["principal"], held.as_str(), "{name}");
        assert_eq!(shop.runs(), 2, "{name}");
        for (tenant, answer) in [(&held, &first), (&other, &theirs)] {
            shop.gate.add_permits(1); // were it to run again, it would not hang
            let r = send(tenant.clone()).await;
            assert!(r.replayed(), "{name} {tenant}");
            assert_eq!(r.body, answer.body, "{name} {tenant}");
        }
        assert_eq!(shop.runs(), 2, "{name}");
    }
}

/// A duplicate that waits for a running request whose handler then answers
/// 5xx is not left waiting, nor answered with the 5xx: the 5xx released the
/// key, so the duplicate runs the handler itself and its answer is recorded
/// and replayed.
#[tokio::test]
async fn a_waiting_duplicate_runs_the_handler_when_the_first_answers_5xx() {
    for (name, store) in every_store().await {
        let observed = Observed::new(store);
        let (addr, shop) = app_on(observed.clone(), "contract.waiters", |b| {
            b.wait(Duration::from_secs(60))
        })
        .await;
        let tenant = format!("held-{}", fresh_tenant());
        shop.next_statuses
            .lock()
            .expect("statuses")
            .push(StatusCode::SERVICE_UNAVAILABLE);
        let send = || {
            let (addr, tenant) = (addr.clone(), tenant.clone());
            async move {
                let auth = format!("authorization: Bearer {tenant}");
                send_raw(
                    &addr,
                    &head(
                        "POST",
                        "/orders",
                        &[
                            "content-type: application/json",
                            "idempotency-key: w-1",
                            &auth,
                        ],
                    ),
                    Framing::Length(br#"{"amount":1}"#),
                )
                .await
            }
        };
        let first = tokio::spawn(send());
        shop.wait_entered(1).await;
        let duplicate = tokio::spawn(send());
        observed.wait_for_a_waiter().await;
        shop.gate.add_permits(2);
        let first = bounded("the first request", first).await.expect("task");
        assert_eq!(first.status, 503, "{name}");
        let duplicate = bounded("the waiting duplicate", duplicate)
            .await
            .expect("task");
        assert_eq!(
            duplicate.status,
            201,
            "{name}: {}",
            String::from_utf8_lossy(&duplicate.body)
        );
        assert!(!duplicate.replayed(), "{name}");
        assert_eq!(shop.runs(), 2, "{name}");
        shop.gate.add_permits(1);
        let retry = send().await;
        assert!(retry.replayed(), "{name}");
        assert_eq!(retry.body, duplicate.body, "{name}");
        assert_eq!(shop.runs(), 2, "{name}");
    }
}

/// The retrying client against the layer: a first attempt answered 503 by
/// the handler (which releases the key) is retried with the same key and
/// runs again; the answer is fresh on the second attempt, and sending the
/// intent again replays it.
#[tokio::test]
async fn the_client_retries_a_released_5xx_with_the_same_key_then_gets_replays() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.client", |b| b).await;
        shop.next_statuses
            .lock()
            .expect("statuses")
            .push(StatusCode::SERVICE_UNAVAILABLE);
        let client = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(2),
            max_attempts: 3,
            ..RetryPolicy::default()
        });
        let tenant = fresh_tenant();
        let intent = client
            .intent(Method::POST, &format!("http://{addr}/orders"))
            .expect("intent")
            .header("authorization", &format!("Bearer {tenant}"))
            .expect("header")
            .json(&json!({"amount": 5}))
            .expect("json");
        let answer = intent.send().await.expect("answer");
        assert_eq!(answer.status(), 201, "{name}");
        assert_eq!(answer.attempts(), 2, "{name}");
        assert!(!answer.is_replayed(), "{name}");
        let body: Value = answer.json().expect("json");
        assert_eq!(
            body["key"],
            intent.key(),
            "{name}: the same key on the retry"
        );
        let again = intent.send().await.expect("answer");
        assert!(again.is_replayed(), "{name}");
        assert_eq!(again.body(), answer.body(), "{name}");
        assert_eq!(shop.runs(), 2, "{name}");
    }
}

/// A burst on one key, on every store: the first request held in its
/// handler, then identical duplicates, a duplicate with another body and
/// another tenant's requests with the same key, all at once. The handler
/// runs once per tenant; every identical duplicate gets the first answer
/// (replayed), the other body 422, the other tenant its own answer.
#[tokio::test]
async fn a_burst_on_one_key_runs_once_per_tenant_on_every_store() {
    for (name, store) in every_store().await {
        let observed = Observed::new(store);
        let (addr, shop) = app_on(observed.clone(), "contract.burst", |b| {
            b.wait(Duration::from_secs(30))
        })
        .await;
        let held = format!("held-{}", fresh_tenant());
        let other = fresh_tenant();
        let send = |tenant: String, body: &'static str| {
            let addr = addr.clone();
            async move {
                let auth = format!("authorization: Bearer {tenant}");
                send_raw(
                    &addr,
                    &head(
                        "POST",
                        "/orders",
                        &[
                            "content-type: application/json",
                            "idempotency-key: burst",
                            &auth,
                        ],
                    ),
                    Framing::Length(body.as_bytes()),
                )
                .await
            }
        };
        let first = tokio::spawn(send(held.clone(), r#"{"amount":1}"#));
        shop.wait_entered(1).await;
        let same: Vec<_> = (0..12)
            .map(|_| tokio::spawn(send(held.clone(), r#"{ "amount" : 1.0 }"#)))
            .collect();
        let changed = tokio::spawn(send(held.clone(), r#"{"amount":2}"#));
        let theirs: Vec<_> = (0..4)
            .map(|_| tokio::spawn(send(other.clone(), r#"{"amount":1}"#)))
            .collect();
        observed.wait_for_a_waiter().await;
        shop.gate.add_permits(1);
        let first = bounded("the first request", first).await.expect("task");
        assert_eq!(first.status, 201, "{name}");
        for r in same {
            let r = bounded("a duplicate", r).await.expect("task");
            assert_eq!(
                r.status,
                201,
                "{name}: {}",
                String::from_utf8_lossy(&r.body)
            );
            assert!(r.replayed(), "{name}");
            assert_eq!(r.body, first.body, "{name}");
        }
        let changed = bounded("the other body", changed).await.expect("task");
        assert_eq!(
            changed.status,
            422,
            "{name}: {}",
            String::from_utf8_lossy(&changed.body)
        );
        assert_eq!(changed.problem_type(), types::KEY_REUSED, "{name}");
        let mut their_bodies = Vec::new();
        for r in theirs {
            let r = bounded("the other tenant", r).await.expect("task");
            assert_eq!(
                r.status,
                201,
                "{name}: {}",
                String::from_utf8_lossy(&r.body)
            );
            assert_eq!(r.json()["principal"], other.as_str(), "{name}");
            their_bodies.push(r.body);
        }
        their_bodies.dedup();
        assert_eq!(
            their_bodies.len(),
            1,
            "{name}: one answer for the other tenant"
        );
        assert_eq!(shop.runs(), 2, "{name}: once per tenant");
    }
}

/// "Not processed, try again" answers of the handler: a 429 is not
/// recorded, and the client retries it with the same key (its retry runs
/// and is recorded); a 408 is not
/// recorded either, but the client returns it (a timeout may have dropped a
/// handler halfway), and sending the intent again runs the handler.
#[tokio::test]
async fn try_again_answers_are_not_recorded_and_the_client_retries_only_the_safe_ones() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.try-again", |b| b).await;
        let client = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(2),
            max_attempts: 3,
            ..RetryPolicy::default()
        });
        let tenant = fresh_tenant();
        let intent = |amount: u64| {
            client
                .intent(Method::POST, &format!("http://{addr}/orders"))
                .expect("intent")
                .header("authorization", &format!("Bearer {tenant}"))
                .expect("header")
                .json(&json!({ "amount": amount }))
                .expect("json")
        };
        shop.next_statuses
            .lock()
            .expect("statuses")
            .push(StatusCode::TOO_MANY_REQUESTS);
        let limited = intent(1);
        let answer = limited.send().await.expect("answer");
        assert_eq!(answer.status(), 201, "{name}");
        assert_eq!(answer.attempts(), 2, "{name}");
        assert_eq!(shop.runs(), 2, "{name}");
        shop.next_statuses
            .lock()
            .expect("statuses")
            .push(StatusCode::REQUEST_TIMEOUT);
        let timed_out = intent(2);
        let answer = timed_out.send().await.expect("answer");
        assert_eq!(answer.status(), 408, "{name}");
        assert_eq!(answer.attempts(), 1, "{name}");
        let again = timed_out.send().await.expect("answer");
        assert_eq!(again.status(), 201, "{name}");
        assert!(!again.is_replayed(), "{name}: the 408 was not recorded");
        assert_eq!(shop.runs(), 4, "{name}");
        assert!(
            timed_out.send().await.expect("answer").is_replayed(),
            "{name}"
        );
        assert!(
            limited.send().await.expect("answer").is_replayed(),
            "{name}"
        );
        assert_eq!(shop.runs(), 4, "{name}");
    }
}

/// The layer router-wide (`Router::layer`) over a route and a nested
/// router, behind the authentication: one key is one request, so the same
/// key on the nested route is 422, not the other route's replay; safe
/// methods pass through with any key and without credentials, every time.
#[tokio::test]
async fn a_router_wide_layer_keeps_routes_apart_and_passes_safe_methods_through() {
    for (name, store) in every_store().await {
        let shop = shop();
        let layer = IdempotencyLayer::builder("contract.router-wide", store)
            .tenant_from_extension::<Principal>()
            .build()
            .expect("layer");
        let reads = Arc::new(AtomicUsize::new(0));
        let list = {
            let reads = reads.clone();
            move || {
                let reads = reads.clone();
                async move {
                    let n = reads.fetch_add(1, Ordering::SeqCst) + 1;
                    format!("read {n}")
                }
            }
        };
        let app = Router::new()
            .route(
                "/orders",
                post(create_order).get(list.clone()).options(list.clone()),
            )
            .nest(
                "/v2",
                Router::new().route("/orders", post(create_order).get(list)),
            )
            .layer(layer)
            .layer(middleware::from_fn(bearer))
            .with_state(shop.clone());
        let (base, _task) = serve(app).await;
        let addr = base.trim_start_matches("http://").to_owned();
        let tenant = fresh_tenant();
        let auth = format!("authorization: Bearer {tenant}");
        let lines = [
            "content-type: application/json",
            "idempotency-key: rw-1",
            &auth,
        ];
        let first = send_raw(
            &addr,
            &head("POST", "/orders", &lines),
            Framing::Length(b"{}"),
        )
        .await;
        assert_eq!(first.status, 201, "{name}");
        assert_eq!(first.json()["target"], "/orders", "{name}");
        let nested = send_raw(
            &addr,
            &head("POST", "/v2/orders", &lines),
            Framing::Length(b"{}"),
        )
        .await;
        assert_eq!(
            nested.status,
            422,
            "{name}: {}",
            String::from_utf8_lossy(&nested.body)
        );
        let retry = send_raw(
            &addr,
            &head("POST", "/orders", &lines),
            Framing::Length(b"{}"),
        )
        .await;
        assert!(retry.replayed(), "{name}");
        assert_eq!(retry.body, first.body, "{name}");
        let fresh = [
            "content-type: application/json",
            "idempotency-key: rw-2",
            &auth,
        ];
        let v2 = send_raw(
            &addr,
            &head("POST", "/v2/orders", &fresh),
            Framing::Length(b"{}"),
        )
        .await;
        assert_eq!(v2.status, 201, "{name}");
        assert_eq!(v2.json()["target"], "/v2/orders", "{name}");
        assert_eq!(shop.runs(), 2, "{name}");
        for (method, target) in [
            ("GET", "/orders"),
            ("HEAD", "/orders"),
            ("OPTIONS", "/orders"),
            ("GET", "/v2/orders"),
        ] {
            for key in [
                "idempotency-key: rw-1",
                "idempotency-key: \"bad",
                "x-no-key: 1",
            ] {
                let before = reads.load(Ordering::SeqCst);
                let r = send_raw(&addr, &head(method, target, &[key]), Framing::None).await;
                assert_eq!(r.status, 200, "{name} {method} {target} {key}");
                assert!(!r.replayed(), "{name} {method} {target} {key}");
                assert_eq!(
                    reads.load(Ordering::SeqCst),
                    before + 1,
                    "{name} {method} {target} {key}"
                );
            }
        }
        assert_eq!(shop.runs(), 2, "{name}");
    }
}

/// The principal is compared byte for byte, on every store: tenants that
/// differ only in Unicode normalization (`é` composed or not), in case, or
/// where one tenant and key run into another's (`ab` + `c`, `a` + `bc`)
/// are separate callers, each with its own run and its own replays, and a
/// tenant of 255 bytes is a tenant; one of 256 is refused (400
/// `invalid-tenant`) and runs nothing.
#[tokio::test]
async fn principals_are_compared_byte_for_byte_on_every_store() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.principals", |b| b).await;
        let base = fresh_tenant();
        let composed = format!("{base}-caf\u{e9}");
        let decomposed = format!("{base}-cafe\u{301}");
        let upper = composed.to_uppercase();
        let prefix_a = format!("{base}-ab");
        let prefix_b = format!("{base}-a");
        let long = format!("{base}-{}", "\u{e9}".repeat(200))[..255].to_owned();
        let callers: [(&str, &str); 6] = [
            (&composed, "k"),
            (&decomposed, "k"),
            (&upper, "k"),
            (&prefix_a, "c"),
            (&prefix_b, "bc"),
            (&long, "k"),
        ];
        let send = |tenant: &str, key: &str| {
            let (addr, tenant, key) = (addr.clone(), tenant.to_owned(), key.to_owned());
            async move {
                let auth = format!("authorization: Bearer {tenant}");
                let key_line = format!("idempotency-key: {key}");
                send_raw(
                    &addr,
                    &head(
                        "POST",
                        "/orders",
                        &["content-type: application/json", &key_line, &auth],
                    ),
                    Framing::Length(b"{}"),
                )
                .await
            }
        };
        let mut answers = Vec::new();
        for (tenant, key) in callers {
            let r = send(tenant, key).await;
            assert_eq!(
                r.status,
                201,
                "{name} {tenant:?}: {}",
                String::from_utf8_lossy(&r.body)
            );
            assert!(!r.replayed(), "{name} {tenant:?}: another caller's answer");
            assert_eq!(r.json()["principal"], tenant, "{name}");
            answers.push(r.body);
        }
        assert_eq!(shop.runs(), callers.len(), "{name}");
        for ((tenant, key), answer) in callers.iter().zip(&answers) {
            let r = send(tenant, key).await;
            assert!(r.replayed(), "{name} {tenant:?}");
            assert_eq!(&r.body, answer, "{name} {tenant:?}");
        }
        let too_long = format!("{long}x");
        let r = send(&too_long, "k").await;
        assert_eq!(r.status, 400, "{name}");
        assert_eq!(r.problem_type(), types::INVALID_TENANT, "{name}");
        assert_eq!(shop.runs(), callers.len(), "{name}");
    }
}

/// A duplicate still running after the wait bound is answered 409
/// `in-progress`, with `Retry-After` in whole seconds (at least 1, at most
/// the lease) equal to the problem's `retry_after`; it is not recorded:
/// once the first ends, the same request replays its answer.
#[tokio::test]
async fn a_duplicate_still_running_after_the_wait_bound_is_409_on_every_store() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.wait-bound", |b| {
            b.wait(Duration::from_millis(20))
                .lease(Duration::from_secs(30))
        })
        .await;
        let tenant = format!("held-{}", fresh_tenant());
        let send = || {
            let (addr, tenant) = (addr.clone(), tenant.clone());
            async move {
                let auth = format!("authorization: Bearer {tenant}");
                send_raw(
                    &addr,
                    &head(
                        "POST",
                        "/orders",
                        &[
                            "content-type: application/json",
                            "idempotency-key: wb-1",
                            &auth,
                        ],
                    ),
                    Framing::Length(br#"{"amount":1}"#),
                )
                .await
            }
        };
        let first = tokio::spawn(send());
        shop.wait_entered(1).await;
        let duplicate = send().await;
        assert_eq!(duplicate.status, 409, "{name}");
        let problem = duplicate.json();
        assert_eq!(duplicate.problem_type(), types::IN_PROGRESS, "{name}");
        let retry_after: u64 = duplicate
            .header("retry-after")
            .expect("Retry-After")
            .parse()
            .expect("whole seconds");
        assert!((1..=30).contains(&retry_after), "{name}: {retry_after}");
        assert_eq!(problem["retry_after"], retry_after, "{name}");
        assert_eq!(problem["status"], 409, "{name}");
        shop.gate.add_permits(1);
        let first = bounded("the first request", first).await.expect("task");
        assert_eq!(first.status, 201, "{name}");
        shop.gate.add_permits(1); // were it to run again, it would not hang
        let retry = send().await;
        assert!(retry.replayed(), "{name}");
        assert_eq!(retry.body, first.body, "{name}");
        assert_eq!(shop.runs(), 1, "{name}");
    }
}

/// One layer applied twice on a route (router-wide, and again on the route
/// with `route_layer(layer.clone())`), or two layers built with one scope:
/// the request is one idempotent call, not two of which the inner waits for
/// the outer. It runs once and is replayed; it is never answered 409 for
/// waiting on itself.
#[tokio::test]
async fn one_layer_applied_router_wide_and_on_the_route_runs_the_request_once() {
    for ((name, store), built_twice) in every_store()
        .await
        .into_iter()
        .flat_map(|s| [(s.clone(), false), (s, true)])
    {
        let shop = shop();
        let build = || {
            IdempotencyLayer::builder("contract.twice", store.clone())
                .tenant_from_extension::<Principal>()
                .wait(Duration::from_millis(50))
                .build()
                .expect("layer")
        };
        let outer = build();
        let inner = if built_twice { build() } else { outer.clone() };
        let app = Router::new()
            .route("/orders", post(create_order))
            .route_layer(inner)
            .layer(outer)
            .layer(middleware::from_fn(bearer))
            .with_state(shop.clone());
        let (base, _task) = serve(app).await;
        let addr = base.trim_start_matches("http://").to_owned();
        let tenant = fresh_tenant();
        let auth = format!("authorization: Bearer {tenant}");
        let lines = [
            "content-type: application/json",
            "idempotency-key: twice",
            &auth,
        ];
        let first = send_raw(
            &addr,
            &head("POST", "/orders", &lines),
            Framing::Length(b"{}"),
        )
        .await;
        assert_eq!(
            first.status,
            201,
            "{name}: {}",
            String::from_utf8_lossy(&first.body)
        );
        let retry = send_raw(
            &addr,
            &head("POST", "/orders", &lines),
            Framing::Length(b"{}"),
        )
        .await;
        assert!(retry.replayed(), "{name}");
        assert_eq!(retry.body, first.body, "{name}");
        assert_eq!(shop.runs(), 1, "{name}");
    }
}

/// Layers with one scope on two kinds of store (the memory store around a
/// SQLite file) are two records, as before: the inner one still reserves
/// and records its own, and the request runs once.
#[tokio::test]
async fn a_layer_with_the_same_scope_on_another_kind_of_store_still_records() {
    let outer_store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let inner_store = sqlite_file_store().await;
    the_inner_layer_records_too("two kinds", outer_store, inner_store).await;
}

/// Layers with one scope on two databases of one kind (two memory stores, two
/// SQLite files, two PostgreSQL databases or schemas, two MariaDB databases:
/// a store per region or per customer) are two records too: the inner
/// layer's database gets its own, not a pass-through that leaves it without
/// one (a later request through that layer alone would run the handler
/// again).
#[tokio::test]
async fn a_layer_with_the_same_scope_on_another_database_of_the_same_kind_still_records() {
    the_inner_layer_records_too(
        "two memory stores",
        Arc::new(MemoryStore::new()),
        Arc::new(MemoryStore::new()),
    )
    .await;
    the_inner_layer_records_too(
        "two sqlite files",
        sqlite_file_store().await,
        sqlite_file_store().await,
    )
    .await;
    if let Some(pg) = pg_store_or_skip().await {
        common::servers::pg_with_fresh_database("http_nested", |url| async move {
            let other = idempotent_runtime::PgStore::connect(&url)
                .await
                .expect("the new database");
            the_inner_layer_records_too("two postgres databases", Arc::new(pg), Arc::new(other))
                .await;
        })
        .await;
        // One database, a schema of its own on the search path.
        let (mut admin, schema, url) = common::servers::pg_schema_of_its_own("http_nested").await;
        let checked = tokio::spawn(async move {
            let outer = idempotent_runtime::PgStore::connect(&common::servers::pg_url())
                .await
                .expect("the test database");
            let other = idempotent_runtime::PgStore::connect(&url)
                .await
                .expect("the new schema");
            the_inner_layer_records_too("two postgres schemas", Arc::new(outer), Arc::new(other))
                .await;
        })
        .await;
        sqlx::Executor::execute(&mut admin, format!("DROP SCHEMA {schema} CASCADE").as_str())
            .await
            .expect("drop the schema");
        if let Err(e) = checked {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    if let Some(my) = mysql_store_or_skip().await {
        let my = Arc::new(my);
        let db = common::servers::mysql_create_database(&my, "http_nested").await;
        let url = common::servers::mysql_url_of(&common::servers::mysql_url(), &db);
        let outer: Arc<dyn Store> = my.clone();
        let checked = tokio::spawn(async move {
            let other = idempotent_runtime::MySqlStore::connect(&url)
                .await
                .expect("the new database");
            the_inner_layer_records_too("two mariadb databases", outer, Arc::new(other)).await;
        })
        .await;
        common::servers::mysql_drop_then_check(&my, &[&db], checked).await;
    }
}

/// Two stores opened on one database (one SQLite file opened twice) are one
/// place for the records: a layer on one inside a layer of the same scope on
/// the other passes the request through, as one layer applied twice does:
/// it runs once and is replayed, never answered 409 for waiting on itself.
#[tokio::test]
async fn a_layer_on_another_store_of_the_same_database_passes_the_request_through() {
    let url = common::scratch::sqlite_url("http-one-file");
    let open = || async {
        let store: Arc<dyn Store> = Arc::new(
            idempotent_runtime::SqliteStore::connect(&url)
                .await
                .expect("the file"),
        );
        store
    };
    let (outer_store, inner_store) = (open().await, open().await);
    assert_eq!(outer_store.database_id(), inner_store.database_id());
    let shop = shop();
    let layer = |store: Arc<dyn Store>| {
        IdempotencyLayer::builder("contract.one-file", store)
            .tenant_from_extension::<Principal>()
            .wait(Duration::from_millis(50))
            .build()
            .expect("layer")
    };
    let app = Router::new()
        .route("/orders", post(create_order))
        .route_layer(layer(inner_store))
        .layer(layer(outer_store))
        .layer(middleware::from_fn(bearer))
        .with_state(shop.clone());
    let (base, _task) = serve(app).await;
    let addr = base.trim_start_matches("http://").to_owned();
    let tenant = fresh_tenant();
    let auth = format!("authorization: Bearer {tenant}");
    let lines = [
        "content-type: application/json",
        "idempotency-key: one-file",
        &auth,
    ];
    let first = send_raw(
        &addr,
        &head("POST", "/orders", &lines),
        Framing::Length(b"{}"),
    )
    .await;
    assert_eq!(
        first.status,
        201,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let retry = send_raw(
        &addr,
        &head("POST", "/orders", &lines),
        Framing::Length(b"{}"),
    )
    .await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(shop.runs(), 1);
}

/// An app whose route has a layer on `inner_store` inside one on
/// `outer_store`, both with one scope: a request runs the handler once, each
/// store gets a complete record of it, and a retry is replayed.
async fn the_inner_layer_records_too(
    name: &str,
    outer_store: Arc<dyn Store>,
    inner_store: Arc<dyn Store>,
) {
    let shop = shop();
    let layer = |store: Arc<dyn Store>| {
        IdempotencyLayer::builder("contract.two-stores", store)
            .tenant_from_extension::<Principal>()
            .build()
            .expect("layer")
    };
    let app = Router::new()
        .route("/orders", post(create_order))
        .route_layer(layer(inner_store.clone()))
        .layer(layer(outer_store.clone()))
        .layer(middleware::from_fn(bearer))
        .with_state(shop.clone());
    let (base, _task) = serve(app).await;
    let addr = base.trim_start_matches("http://").to_owned();
    let tenant = fresh_tenant();
    let auth = format!("authorization: Bearer {tenant}");
    let lines = [
        "content-type: application/json",
        "idempotency-key: two",
        &auth,
    ];
    let first = send_raw(
        &addr,
        &head("POST", "/orders", &lines),
        Framing::Length(b"{}"),
    )
    .await;
    assert_eq!(first.status, 201, "{name}");
    let identity = Identity::new(tenant.as_str(), "contract.two-stores", "two").expect("identity");
    for (which, store) in [("outer", &outer_store), ("inner", &inner_store)] {
        let record = store.fetch(&identity).await.expect("fetch");
        assert_eq!(
            record.map(|r| r.state),
            Some(idempotent_runtime::store::RecordState::Complete),
            "{name}: the {which} layer's store ({})",
            store.name()
        );
    }
    let retry = send_raw(
        &addr,
        &head("POST", "/orders", &lines),
        Framing::Length(b"{}"),
    )
    .await;
    assert!(retry.replayed(), "{name}");
    assert_eq!(shop.runs(), 1, "{name}");
}

/// Rule 2 through the layer: the raw `Idempotency-Key` appears in no log
/// line at any level, whatever the request's fate (fresh, replayed, 422,
/// 409 in progress, a 5xx that releases the key, a malformed or too long
/// key), on every store; the problems sent back do not echo it either.
#[tokio::test]
async fn the_raw_key_is_in_no_log_line_and_no_problem() {
    let (logs, _guard) = Logs::capture(tracing::Level::TRACE);
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.logs", |b| b.reject_in_progress()).await;
        let tenant = format!("held-{}", fresh_tenant());
        let auth = format!("authorization: Bearer {tenant}");
        let send = |key: String, body: &'static [u8]| {
            let (addr, auth) = (addr.clone(), auth.clone());
            async move {
                let key_line = format!("idempotency-key: {key}");
                send_raw(
                    &addr,
                    &head(
                        "POST",
                        "/orders",
                        &["content-type: application/json", &key_line, &auth],
                    ),
                    Framing::Length(body),
                )
                .await
            }
        };
        let key = "SECRETKEY-4711".to_owned();
        let first = tokio::spawn(send(key.clone(), b"{}"));
        shop.wait_entered(1).await;
        let busy = send(key.clone(), b"{}").await;
        assert_eq!(busy.status, 409, "{name}");
        shop.gate.add_permits(1);
        assert_eq!(
            bounded("first", first).await.expect("task").status,
            201,
            "{name}"
        );
        let mut answers = vec![busy];
        answers.push(send(key.clone(), b"{}").await);
        answers.push(send(key.clone(), br#"{"other":1}"#).await);
        assert_eq!(answers[1].status, 201, "{name}");
        assert_eq!(answers[2].status, 422, "{name}");
        shop.next_statuses
            .lock()
            .expect("statuses")
            .push(StatusCode::INTERNAL_SERVER_ERROR);
        shop.gate.add_permits(1);
        answers.push(send("SECRETKEY-500".to_owned(), b"{}").await);
        assert_eq!(answers[3].status, 500, "{name}");
        for bad in [
            r#""SECRETKEY\q""#.to_owned(),
            "SECRETKEY;x".to_owned(),
            "SECRETKEY SPACE".to_owned(),
            format!("SECRETKEY{}", "k".repeat(250)),
        ] {
            let r = send(bad.clone(), b"{}").await;
            assert_eq!(r.status, 400, "{name} {bad}");
            answers.push(r);
        }
        // The handler's own answer shows the key (the test app's choice).
        for r in answers.iter().filter(|r| r.status != 201) {
            assert!(
                !String::from_utf8_lossy(&r.body).contains("SECRETKEY"),
                "{name}: {}",
                String::from_utf8_lossy(&r.body)
            );
        }
    }
    let written = logs.text();
    assert!(
        written.contains("contract.logs"),
        "the layer logged: {written}"
    );
    let leaks: Vec<&str> = written
        .lines()
        .filter(|l| l.contains("SECRETKEY"))
        .collect();
    assert!(
        leaks.is_empty(),
        "raw keys in the logs:\n{}",
        leaks.join("\n")
    );
}

/// A client that sends `Expect: 100-continue` waits for the server's
/// `100 Continue` before it sends the body: the layer asks for the body
/// (the fingerprint needs it), so the request is not left waiting; and its
/// retry without the expectation is the same request, replayed.
#[tokio::test]
async fn a_request_that_expects_100_continue_gets_it_and_its_retry_replays() {
    for (name, store) in every_store().await {
        let (addr, shop) = app_on(store, "contract.expect", |b| b).await;
        let tenant = fresh_tenant();
        let body = br#"{"amount":7}"#;
        let head_bytes = format!(
            "POST /orders HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
             content-type: application/json\r\nidempotency-key: expect-1\r\n\
             authorization: Bearer {tenant}\r\nexpect: 100-continue\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        );
        let mut stream = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        stream
            .write_all(head_bytes.as_bytes())
            .await
            .expect("write");
        let mut interim = Vec::new();
        bounded("100 Continue", async {
            while !interim.windows(4).any(|w| w == b"\r\n\r\n") {
                let mut byte = [0u8; 1];
                stream.read_exact(&mut byte).await.expect("read");
                interim.push(byte[0]);
            }
        })
        .await;
        assert!(
            interim.starts_with(b"HTTP/1.1 100"),
            "{name}: {}",
            String::from_utf8_lossy(&interim)
        );
        stream.write_all(body).await.expect("write body");
        let mut rest = Vec::new();
        bounded("the answer", stream.read_to_end(&mut rest))
            .await
            .expect("read");
        let rest = String::from_utf8_lossy(&rest).into_owned();
        assert!(rest.starts_with("HTTP/1.1 201"), "{name}: {rest}");
        let auth = format!("authorization: Bearer {tenant}");
        let retry = send_raw(
            &addr,
            &head(
                "POST",
                "/orders",
                &[
                    "content-type: application/json",
                    "idempotency-key: expect-1",
                    &auth,
                ],
            ),
            Framing::Length(body),
        )
        .await;
        assert!(retry.replayed(), "{name}");
        assert!(
            rest.ends_with(&*String::from_utf8_lossy(&retry.body)),
            "{name}: {rest}"
        );
        assert_eq!(shop.runs(), 1, "{name}");
    }
}

/// A route's layer with a smaller body cap inside a router-wide layer with
/// the same scope still refuses a larger body (413, not recorded by either:
/// the smaller body sent next with the same key runs), though the
/// router-wide layer records the answers.
#[tokio::test]
async fn an_inner_layer_on_the_enclosing_calls_identity_keeps_its_body_cap() {
    for (name, store) in every_store().await {
        let shop = shop();
        let build = |cap: usize| {
            IdempotencyLayer::builder("contract.inner-cap", store.clone())
                .tenant_from_extension::<Principal>()
                .max_body_bytes(cap)
                .build()
                .expect("layer")
        };
        let app = Router::new()
            .route("/orders", post(create_order))
            .route_layer(build(16))
            .layer(build(1024))
            .layer(middleware::from_fn(bearer))
            .with_state(shop.clone());
        let (base, _task) = serve(app).await;
        let addr = base.trim_start_matches("http://").to_owned();
        let tenant = fresh_tenant();
        let auth = format!("authorization: Bearer {tenant}");
        let lines = [
            "content-type: application/json",
            "idempotency-key: cap",
            &auth,
        ];
        let large = send_raw(
            &addr,
            &head("POST", "/orders", &lines),
            Framing::Length(br#"{"amount":1234567890}"#),
        )
        .await;
        assert_eq!(large.status, 413, "{name}");
        assert_eq!(large.problem_type(), types::BODY_TOO_LARGE, "{name}");
        let small = send_raw(
            &addr,
            &head("POST", "/orders", &lines),
            Framing::Length(br#"{"amount":1}"#),
        )
        .await;
        assert_eq!(small.status, 201, "{name}");
        assert!(!small.replayed(), "{name}");
        let retry = send_raw(
            &addr,
            &head("POST", "/orders", &lines),
            Framing::Length(br#"{"amount":1}"#),
        )
        .await;
        assert!(retry.replayed(), "{name}");
        assert_eq!(shop.runs(), 1, "{name}");
    }
}
