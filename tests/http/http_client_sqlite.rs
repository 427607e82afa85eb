//! The retrying client against the layer on a SQLite file store, the way a
//! service deploys it (the other client tests run on the memory store): an
//! attempt the client gave up on while the charge ran ends in that charge's
//! replay; one key sent by two accounts is two operations; redirects the
//! client follows carry the key, and a retry of the operation follows the
//! replayed redirect without charging again.

use crate::common;
use crate::http_app;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use common::servers::fresh_tenant;
use http_app::{bounded, serve, sqlite_file_store, TestServer};
use idempotent_runtime::http::{IdempotencyLayer, IdempotentClient, Intent, RetryPolicy};
use idempotent_runtime::Store;
use reqwest::Method;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn charge(client: &IdempotentClient, base: &str, account: &str) -> Intent {
    client
        .intent(Method::POST, &format!("{base}/payments"))
        .expect("intent")
        .header("x-account-id", account)
        .expect("header")
        .json(&serde_json::json!({"amount_cents": 450, "currency": "EUR"}))
        .expect("body")
}

/// The client hangs up on its first attempt (its attempt timeout) while the
/// charge still runs on the server; its retry is refused as in progress
/// (409 + `Retry-After`), and once the charge ends the next retry gets that
/// charge's answer, replayed. One charge; every attempt carried one key.
/// (Handshakes: the gateway is held until the server has answered a retry
/// with 409, which only an attempt after the first can get.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_given_up_while_the_charge_ran_ends_in_its_replay_on_sqlite() {
    let server = TestServer::start(sqlite_file_store().await, |b| {
        b.reject_in_progress().lease(Duration::from_secs(2))
    })
    .await;
    let a = fresh_tenant();
    server.shop.gateway.hold();
    let client = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 20,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        max_retry_after: Duration::from_secs(2),
        attempt_timeout: Some(Duration::from_millis(300)),
    });
    let intent = charge(&client, &server.base, &a);
    let sent = tokio::spawn({
        let intent = intent.clone();
        async move { intent.send().await }
    });
    server.shop.gateway.wait_entered(1).await;
    server.wait_conflicts(1).await;
    server.shop.gateway.release();
    let answer = bounded("the send", sent)
        .await
        .expect("task")
        .expect("answered");
    assert_eq!(answer.status(), 201);
    assert!(
        answer.is_replayed(),
        "the answer is the first attempt's charge"
    );
    assert!(answer.attempts() >= 3, "{}", answer.attempts());
    assert_eq!(server.shop.charges_of(&a).len(), 1, "exactly one charge");
    assert_eq!(server.shop.gateway.calls(), 1);
    let keys = server.shop.seen_keys.lock().unwrap().clone();
    assert!(
        keys.iter().all(|k| k == intent.key()),
        "one key: {keys:?} vs {}",
        intent.key()
    );
}

/// The record is (tenant, scope, key): one key sent by two accounts (a
/// client library that derives keys from an order number) is two charges,
/// and each account's retry replays its own answer, never the other's.
#[tokio::test]
async fn one_key_sent_by_two_accounts_is_two_charges_each_replayed_to_its_own() {
    let server = TestServer::start(sqlite_file_store().await, |b| b).await;
    let (a, b) = (fresh_tenant(), fresh_tenant());
    let client = IdempotentClient::new(reqwest::Client::new());
    let key = format!("order-{}", uuid::Uuid::new_v4());
    let intent_of = |account: &str| {
        client
            .intent_with_key(Method::POST, &server.url("/payments"), key.clone())
            .expect("intent")
            .header("x-account-id", account)
            .expect("header")
            .json(&serde_json::json!({"amount_cents": 450, "currency": "EUR"}))
            .expect("body")
    };
    let (for_a, for_b) = (intent_of(&a), intent_of(&b));
    let first_a = for_a.send().await.expect("a");
    let first_b = for_b.send().await.expect("b");
    assert_eq!(
        (first_a.status().as_u16(), first_b.status().as_u16()),
        (201, 201)
    );
    assert!(!first_b.is_replayed(), "b's charge is b's own operation");
    assert_ne!(first_a.body(), first_b.body());
    let again_a = for_a.send().await.expect("a again");
    let again_b = for_b.send().await.expect("b again");
    assert!(again_a.is_replayed() && again_b.is_replayed());
    assert_eq!(again_a.body(), first_a.body());
    assert_eq!(again_b.body(), first_b.body());
    assert_eq!(server.shop.charges_of(&a).len(), 1);
    assert_eq!(server.shop.charges_of(&b).len(), 1);
}

/// What a redirecting app counts: the POSTs the handlers ran, the GETs
/// of the redirect's location, and the `Idempotency-Key` of every request.
#[derive(Default)]
struct Hops {
    orders: AtomicUsize,
    reads: AtomicUsize,
    keys: Mutex<Vec<(String, Option<String>)>>,
}

async fn keep_keys(State(hops): State<Arc<Hops>>, request: Request, next: Next) -> Response {
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    hops.keys.lock().unwrap().push((
        format!("{} {}", request.method(), request.uri().path()),
        key,
    ));
    next.run(request).await
}

fn account_of(parts: &axum::http::request::Parts) -> Option<String> {
    parts
        .headers
        .get("x-account-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Post/Redirect/Get: the order is placed and answered 303 to its page,
/// which the client follows with a GET. Sending the intent again replays
/// the 303 (nothing placed again) and follows it again.
#[tokio::test]
async fn a_303_the_client_follows_is_replayed_on_a_retry_and_places_nothing_again() {
    let store: Arc<dyn Store> = sqlite_file_store().await;
    let hops = Arc::new(Hops::default());
    let layer = IdempotencyLayer::builder("test.client.orders", store)
        .tenant_from(account_of)
        .build()
        .expect("layer");
    async fn place(State(hops): State<Arc<Hops>>) -> Response {
        let n = hops.orders.fetch_add(1, Ordering::SeqCst) + 1;
        let mut headers = HeaderMap::new();
        headers.insert("location", format!("/orders/{n}").parse().unwrap());
        (StatusCode::SEE_OTHER, headers).into_response()
    }
    async fn read(State(hops): State<Arc<Hops>>, Path(n): Path<u64>) -> Response {
        hops.reads.fetch_add(1, Ordering::SeqCst);
        axum::Json(serde_json::json!({ "order": n })).into_response()
    }
    let app = Router::new()
        .route("/orders", post(place))
        .route_layer(layer)
        .route("/orders/{n}", get(read))
        .layer(middleware::from_fn_with_state(hops.clone(), keep_keys))
        .with_state(hops.clone());
    let (base, _task) = serve(app).await;
    let a = fresh_tenant();
    let intent = IdempotentClient::new(reqwest::Client::new())
        .intent(Method::POST, &format!("{base}/orders"))
        .unwrap()
        .header("x-account-id", &a)
        .unwrap()
        .json(&serde_json::json!({"sku": "book"}))
        .unwrap();
    let first = intent.send().await.expect("first");
    let again = intent.send().await.expect("again");
    assert_eq!(
        (first.status().as_u16(), again.status().as_u16()),
        (200, 200)
    );
    assert_eq!(first.body(), again.body(), "the same order's page");
    assert_eq!(hops.orders.load(Ordering::SeqCst), 1, "one order placed");
    assert_eq!(hops.reads.load(Ordering::SeqCst), 2);
    let keys = hops.keys.lock().unwrap().clone();
    let posts: Vec<_> = keys.iter().filter(|(r, _)| r == "POST /orders").collect();
    assert_eq!(posts.len(), 2);
    assert!(posts
        .iter()
        .all(|(_, k)| k.as_deref() == Some(intent.key())));
}

/// A 307 to a route under another layer (another scope) is followed with
/// the method, the body and the key: the charge runs there once, and a
/// retry of the operation follows the replayed 307 to that charge's replay.
#[tokio::test]
async fn a_307_to_another_scope_carries_the_key_and_a_retry_charges_nothing_again() {
    let store: Arc<dyn Store> = sqlite_file_store().await;
    let hops = Arc::new(Hops::default());
    let old = IdempotencyLayer::builder("test.client.v1", store.clone())
        .tenant_from(account_of)
        .build()
        .expect("v1 layer");
    let new = IdempotencyLayer::builder("test.client.v2", store)
        .tenant_from(account_of)
        .build()
        .expect("v2 layer");
    async fn moved() -> Response {
        let mut headers = HeaderMap::new();
        headers.insert("location", "/v2/orders".parse().unwrap());
        (StatusCode::TEMPORARY_REDIRECT, headers).into_response()
    }
    async fn place(State(hops): State<Arc<Hops>>, body: String) -> Response {
        let n = hops.orders.fetch_add(1, Ordering::SeqCst) + 1;
        (
            StatusCode::CREATED,
            axum::Json(serde_json::json!({ "order": n, "body": body })),
        )
            .into_response()
    }
    let app = Router::new()
        .route("/v1/orders", post(moved))
        .route_layer(old)
        .merge(
            Router::new()
                .route("/v2/orders", post(place))
                .route_layer(new),
        )
        .layer(middleware::from_fn_with_state(hops.clone(), keep_keys))
        .with_state(hops.clone());
    let (base, _task) = serve(app).await;
    let a = fresh_tenant();
    let intent = IdempotentClient::new(reqwest::Client::new())
        .intent(Method::POST, &format!("{base}/v1/orders"))
        .unwrap()
        .header("x-account-id", &a)
        .unwrap()
        .json(&serde_json::json!({"sku": "book"}))
        .unwrap();
    let first = intent.send().await.expect("first");
    let again = intent.send().await.expect("again");
    assert_eq!(
        (first.status().as_u16(), again.status().as_u16()),
        (201, 201)
    );
    assert!(!first.is_replayed());
    assert!(again.is_replayed(), "the charge's own replay");
    assert_eq!(first.body(), again.body());
    assert_eq!(hops.orders.load(Ordering::SeqCst), 1, "one charge");
    let keys = hops.keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert!(
        keys.iter().all(|(_, k)| k.as_deref() == Some(intent.key())),
        "every hop carried the key: {keys:?}"
    );
}

/// Two servers on one SQLite file (two processes behind a load balancer,
/// here two stores in one process, which see each other's changes only
/// through the file): the operation's retry reaches the other server while
/// the first still charges, waits there for the record (the layer's
/// default wait), and gets the first server's charge, replayed. One charge
/// in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_reaching_another_server_on_the_same_file_waits_and_replays() {
    let url = common::scratch::sqlite_url("http-two-servers");
    let store_a: Arc<dyn Store> = Arc::new(
        idempotent_runtime::SqliteStore::connect(&url)
            .await
            .expect("store a"),
    );
    let store_b: Arc<dyn Store> = Arc::new(
        idempotent_runtime::SqliteStore::connect(&url)
            .await
            .expect("store b"),
    );
    let a_server = TestServer::start(store_a, |b| b).await;
    let b_server = TestServer::start(store_b, |b| b).await;
    let account = fresh_tenant();
    a_server.shop.gateway.hold();
    let client = IdempotentClient::new(reqwest::Client::new());
    let to_a = charge(&client, &a_server.base, &account);
    let first = tokio::spawn({
        let to_a = to_a.clone();
        async move { to_a.send().await }
    });
    a_server.shop.gateway.wait_entered(1).await;
    // The balancer sends the retry to the other server (the fingerprint
    // counts the path and query, not the host).
    let to_b = client
        .intent_with_key(Method::POST, &b_server.url("/payments"), to_a.key())
        .unwrap()
        .header("x-account-id", &account)
        .unwrap()
        .json(&serde_json::json!({"amount_cents": 450, "currency": "EUR"}))
        .unwrap();
    let retry = tokio::spawn(async move { to_b.send().await });
    b_server.wait_arrivals(1).await;
    a_server.shop.gateway.release();
    let first = bounded("the first send", first)
        .await
        .unwrap()
        .expect("first answered");
    let retry = bounded("the retry", retry)
        .await
        .unwrap()
        .expect("retry answered");
    assert_eq!(
        (first.status().as_u16(), retry.status().as_u16()),
        (201, 201)
    );
    assert!(retry.is_replayed(), "the other server replayed the charge");
    assert_eq!(retry.body(), first.body());
    assert_eq!(a_server.shop.charges_of(&account).len(), 1);
    assert!(b_server.shop.charges_of(&account).is_empty());
    assert_eq!(b_server.shop.gateway.calls(), 0);
}
