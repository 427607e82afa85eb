//! A small payment service behind `IdempotencyLayer`, served on loopback,
//! for the HTTP tests: a gateway stub that can be held until released, a
//! charges table in memory, and counters for every handler.
//!
//! Nothing here depends on timing: tests await handshakes
//! ([`Gateway::wait_entered`], [`TestServer::wait_arrivals`]); every wait is
//! bounded by [`WAIT_LIMIT`] and fails the test with what it was waiting for.
#![allow(dead_code)]

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idempotent_runtime::http::{
    IdempotencyKey, IdempotencyLayer, IdempotencyLayerBuilder, MarkReplayed,
};
use idempotent_runtime::{idempotent, with_outcome, Error, Store};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, Semaphore};

/// The longest any handshake in these tests waits before failing.
pub const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// Awaits `fut` for at most [`WAIT_LIMIT`], failing the test with `what`.
pub async fn bounded<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(WAIT_LIMIT, fut)
        .await
        .unwrap_or_else(|_| panic!("waited {WAIT_LIMIT:?} for {what}"))
}

/// The card gateway stand-in. Open by default; [`Gateway::hold`] makes every
/// charge wait until [`Gateway::release`].
pub struct Gateway {
    calls: AtomicUsize,
    entered: watch::Sender<usize>,
    held: AtomicBool,
    gate: Semaphore,
}

impl Gateway {
    fn new() -> Self {
        Gateway {
            calls: AtomicUsize::new(0),
            entered: watch::channel(0).0,
            held: AtomicBool::new(false),
            gate: Semaphore::new(0),
        }
    }

    /// From now on every charge waits for [`release`](Self::release).
    pub fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
    }

    /// Lets every waiting and future charge through.
    pub fn release(&self) {
        self.held.store(false, Ordering::SeqCst);
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }

    /// How many charges reached the gateway.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` charges have reached the gateway.
    pub async fn wait_entered(&self, n: usize) {
        let mut rx = self.entered.subscribe();
        bounded(
            &format!("{n} charge(s) at the gateway"),
            rx.wait_for(|&v| v >= n),
        )
        .await
        .expect("gateway alive");
    }

    async fn charge(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.entered.send_modify(|v| *v += 1);
        if self.held.load(Ordering::SeqCst) {
            let permit = self.gate.acquire().await.expect("gate open");
            permit.forget();
        }
    }
}

/// The authenticated caller, put into the request by [`authenticate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountId(pub String);

impl std::fmt::Display for AccountId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A charge request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChargeRequest {
    pub amount_cents: u64,
    pub currency: String,
}

/// A row of the charges table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Charge {
    pub charge_id: String,
    pub account: String,
    pub amount_cents: u64,
    pub currency: String,
}

/// A refund (the extractor-style route).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Refund {
    pub refund_id: u64,
    pub charge_id: String,
}

/// The service's state.
pub struct Shop {
    pub gateway: Gateway,
    pub charges: Mutex<Vec<Charge>>,
    pub next_id: AtomicU64,
    pub status_calls: AtomicUsize,
    pub notes_calls: AtomicUsize,
    pub refund_calls: AtomicUsize,
    pub store: Arc<dyn Store>,
    /// The next this many requests are answered 503 before they reach the layer.
    pub fail_next: AtomicUsize,
    /// The `Idempotency-Key` of every request that arrived, in order.
    pub seen_keys: Mutex<Vec<String>>,
    arrivals: watch::Sender<usize>,
    conflicts: watch::Sender<usize>,
    /// Requests whose handling by the server ended: answered, or dropped
    /// (the client hung up).
    ended: watch::Sender<usize>,
}

impl Shop {
    /// The charges of one account.
    pub fn charges_of(&self, account: &str) -> Vec<Charge> {
        self.charges
            .lock()
            .expect("charges")
            .iter()
            .filter(|c| c.account == account)
            .cloned()
            .collect()
    }
}

/// A running server.
pub struct TestServer {
    pub shop: Arc<Shop>,
    pub base: String,
    pub addr: SocketAddr,
    pub layer: IdempotencyLayer,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestServer {
    /// Serves the shop on `127.0.0.1:0` with the payments layer configured by `configure`.
    pub async fn start(
        store: Arc<dyn Store>,
        configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
    ) -> TestServer {
        let shop = Arc::new(Shop {
            gateway: Gateway::new(),
            charges: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            status_calls: AtomicUsize::new(0),
            notes_calls: AtomicUsize::new(0),
            refund_calls: AtomicUsize::new(0),
            store: store.clone(),
            fail_next: AtomicUsize::new(0),
            seen_keys: Mutex::new(Vec::new()),
            arrivals: watch::channel(0).0,
            conflicts: watch::channel(0).0,
            ended: watch::channel(0).0,
        });
        let layer = configure(
            IdempotencyLayer::builder("test.payments", store.clone())
                .tenant_from_extension::<AccountId>(),
        )
        .build()
        .expect("layer config");
        let notes = IdempotencyLayer::builder("test.notes", store.clone())
            .tenant_from_extension::<AccountId>()
            .key_optional()
            .build()
            .expect("notes layer config");
        let protected = Router::new()
            .route("/payments", post(charge))
            .route("/payments/{id}", get(get_charge))
            .route("/status/{code}", post(status))
            .route_layer(layer.clone());
        let optional = Router::new().route("/notes", post(note)).route_layer(notes);
        let app = Router::new()
            .merge(protected)
            .merge(optional)
            .route("/refunds", post(refund))
            .layer(middleware::from_fn(authenticate))
            .layer(middleware::from_fn_with_state(shop.clone(), count_arrivals))
            .with_state(shop.clone());
        let (addr, task) = serve_on_loopback(app).await;
        TestServer {
            shop,
            base: format!("http://{addr}"),
            addr,
            layer,
            task,
        }
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Waits until `n` requests in all have reached the server.
    pub async fn wait_arrivals(&self, n: usize) {
        let mut rx = self.shop.arrivals.subscribe();
        bounded(
            &format!("{n} request(s) at the server"),
            rx.wait_for(|&v| v >= n),
        )
        .await
        .expect("server alive");
    }

    /// Waits until the server's handling of `n` requests has ended: answered,
    /// or dropped because the client hung up.
    pub async fn wait_ended(&self, n: usize) {
        let mut rx = self.shop.ended.subscribe();
        bounded(&format!("{n} request(s) ended"), rx.wait_for(|&v| v >= n))
            .await
            .expect("server alive");
    }

    /// Waits until the server has answered `n` requests with 409.
    pub async fn wait_conflicts(&self, n: usize) {
        let mut rx = self.shop.conflicts.subscribe();
        bounded(&format!("{n} 409 answer(s)"), rx.wait_for(|&v| v >= n))
            .await
            .expect("server alive");
    }
}

async fn count_arrivals(State(shop): State<Arc<Shop>>, request: Request, next: Next) -> Response {
    if let Some(key) = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
    {
        shop.seen_keys.lock().expect("keys").push(key.to_owned());
    }
    shop.arrivals.send_modify(|v| *v += 1);
    /// Counts the request as ended when its handling ends, however it does.
    struct Ends(Arc<Shop>);
    impl Drop for Ends {
        fn drop(&mut self) {
            self.0.ended.send_modify(|v| *v += 1);
        }
    }
    let _ends = Ends(shop.clone());
    let failing = shop
        .fail_next
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if failing {
        return (StatusCode::SERVICE_UNAVAILABLE, "flaky: try again").into_response();
    }
    let response = next.run(request).await;
    if response.status() == StatusCode::CONFLICT {
        shop.conflicts.send_modify(|v| *v += 1);
    }
    response
}

/// Stands in for real authentication: `X-Account-Id` names the caller
/// (an [`AccountId`] request extension).
pub async fn authenticate(mut request: Request, next: Next) -> Response {
    if let Some(account) = request
        .headers()
        .get("x-account-id")
        .and_then(|v| v.to_str().ok())
    {
        let account = AccountId(account.to_owned());
        request.extensions_mut().insert(account);
    }
    next.run(request).await
}

async fn charge(
    State(shop): State<Arc<Shop>>,
    Extension(account): Extension<AccountId>,
    Json(req): Json<ChargeRequest>,
) -> Response {
    shop.gateway.charge().await;
    let id = shop.next_id.fetch_add(1, Ordering::SeqCst);
    let charge = Charge {
        charge_id: format!("ch_{id}"),
        account: account.0.clone(),
        amount_cents: req.amount_cents,
        currency: req.currency,
    };
    shop.charges.lock().expect("charges").push(charge.clone());
    let mut headers = HeaderMap::new();
    headers.insert(
        "location",
        format!("/payments/{}", charge.charge_id)
            .parse()
            .expect("location"),
    );
    headers.insert("x-live-only", "first answer".parse().expect("header"));
    (StatusCode::CREATED, headers, Json(charge)).into_response()
}

async fn get_charge(
    State(shop): State<Arc<Shop>>,
    Extension(account): Extension<AccountId>,
    Path(id): Path<String>,
) -> Response {
    match shop
        .charges_of(&account.0)
        .into_iter()
        .find(|c| c.charge_id == id)
    {
        Some(c) => Json(c).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn status(State(shop): State<Arc<Shop>>, Path(code): Path<u16>) -> Response {
    let call = shop.status_calls.fetch_add(1, Ordering::SeqCst) + 1;
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(serde_json::json!({ "call": call }))).into_response()
}

async fn note(State(shop): State<Arc<Shop>>) -> Response {
    let call = shop.notes_calls.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        Json(serde_json::json!({ "call": call })),
    )
        .into_response()
}

#[derive(Debug, Deserialize, Serialize)]
pub struct RefundRequest {
    pub charge_id: String,
}

#[idempotent(scope = "test.refunds", key = key, tenant = account, store = shop.store, skip(shop))]
async fn refund_once(
    shop: &Shop,
    account: &str,
    key: &str,
    charge_id: &str,
) -> Result<Refund, Error> {
    let n = shop.refund_calls.fetch_add(1, Ordering::SeqCst) as u64 + 1;
    Ok(Refund {
        refund_id: n,
        charge_id: charge_id.to_owned(),
    })
}

/// The extractor style: the handler calls an `#[idempotent]` function.
async fn refund(
    State(shop): State<Arc<Shop>>,
    account: Option<Extension<AccountId>>,
    key: IdempotencyKey,
    Json(req): Json<RefundRequest>,
) -> Result<(StatusCode, MarkReplayed, Json<Refund>), Error> {
    let Some(Extension(account)) = account else {
        return Err(Error::InvalidTenant(idempotent_runtime::KeyProblem::Empty));
    };
    let (result, outcome) =
        with_outcome(refund_once(&shop, &account.0, key.as_str(), &req.charge_id)).await;
    Ok((StatusCode::CREATED, MarkReplayed(outcome), Json(result?)))
}

/// Checks a problem+json answer and returns its body.
pub async fn expect_problem(
    response: reqwest::Response,
    status: u16,
    problem_type: &str,
) -> serde_json::Value {
    assert_eq!(response.status().as_u16(), status, "status");
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json",
        "content type"
    );
    let body: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.expect("body")).expect("problem JSON");
    assert_eq!(body["type"], problem_type, "problem type in {body}");
    assert_eq!(body["status"], status, "problem status in {body}");
    for field in ["title", "detail"] {
        assert!(
            body[field].as_str().is_some_and(|s| s.len() > 10),
            "problem {field} in {body}"
        );
    }
    body
}

/// A SQLite store on a new file in the temporary directory.
pub async fn sqlite_file_store() -> Arc<dyn idempotent_runtime::Store> {
    Arc::new(sqlite_file().await)
}

/// A `SqliteStore` on a new file in the temporary directory (its `pool()`
/// reaches the records table).
pub async fn sqlite_file() -> idempotent_runtime::SqliteStore {
    idempotent_runtime::SqliteStore::connect(&crate::common::scratch::sqlite_url("http"))
        .await
        .expect("SQLite file")
}

/// Serves `app` on a free loopback port: its base URL, and the server's task.
pub async fn serve(app: axum::Router) -> (String, tokio::task::JoinHandle<()>) {
    let (addr, task) = serve_on_loopback(app).await;
    (format!("http://{addr}"), task)
}

/// Serves `app` on a free loopback port: its address, and the server's task.
pub async fn serve_on_loopback(
    app: axum::Router,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    (addr, task)
}
