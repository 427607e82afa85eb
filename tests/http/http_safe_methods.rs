//! Rule 22: safe methods pass through. Every safe method the layer names
//! (`GET`, `HEAD`, `OPTIONS`, `TRACE`, `QUERY`) reaches the handler without an
//! `Idempotency-Key` (no 400), and one that carries a key is never recorded
//! nor replayed: each request runs the handler and gets its own answer. An
//! `OPTIONS` request is a CORS preflight: refusing it for want of a key, or
//! replaying one preflight's answer to another, breaks the route for every
//! browser. (`http_server::safe_methods_pass_through` covers GET and HEAD.)

use crate::http_app::serve_on_loopback;
use axum::extract::State;
use axum::http::{Method, StatusCode};
use axum::routing::on;
use axum::routing::MethodFilter;
use axum::Router;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::MemoryStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Counts its calls and answers the count: a replay would repeat an old one.
async fn counted(State(calls): State<Arc<AtomicUsize>>) -> (StatusCode, String) {
    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::OK, format!("call {n}"))
}

#[tokio::test]
async fn options_and_trace_pass_through_like_get() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::builder("test.safe_methods", MemoryStore::new())
        .tenant_from(|_| Some("tenant-a".to_owned()))
        .build()
        .expect("layer config");
    let every = MethodFilter::GET
        .or(MethodFilter::OPTIONS)
        .or(MethodFilter::TRACE)
        .or(MethodFilter::POST);
    let app = Router::new()
        .route("/things", on(every, counted))
        .route_layer(layer)
        .with_state(calls.clone());
    let (addr, task) = serve_on_loopback(app).await;
    let url = format!("http://{addr}/things");
    let client = reqwest::Client::new();

    // The layer is on: a POST without a key is refused before the handler.
    let refused = client.post(&url).send().await.expect("post");
    assert_eq!(refused.status(), 400, "the layer guards the route");
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    let mut expected_calls = 0;
    for method in [Method::GET, Method::OPTIONS, Method::TRACE] {
        // Without a key: passed through to the handler, not 400.
        let r = client
            .request(method.clone(), &url)
            .send()
            .await
            .expect("request");
        expected_calls += 1;
        assert_eq!(r.status(), 200, "{method} without a key passes through");
        assert!(r.headers().get("idempotent-replayed").is_none(), "{method}");
        assert_eq!(r.text().await.unwrap(), format!("call {expected_calls}"));
        // With a key, twice: each runs the handler; nothing is replayed.
        for _ in 0..2 {
            let r = client
                .request(method.clone(), &url)
                .header("idempotency-key", format!("k-{method}"))
                .send()
                .await
                .expect("request");
            expected_calls += 1;
            assert_eq!(r.status(), 200, "{method} with a key passes through");
            assert!(
                r.headers().get("idempotent-replayed").is_none(),
                "{method} with a key is never replayed"
            );
            assert_eq!(
                r.text().await.unwrap(),
                format!("call {expected_calls}"),
                "{method}: the handler ran, its own answer came back"
            );
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), expected_calls);
    task.abort();
}

/// `QUERY`, the safe method with a body (a search whose criteria do not fit
/// in a URL), passes through like `GET`: no key needed, never recorded nor
/// replayed, even with a key and the same body.
#[tokio::test]
async fn the_query_method_passes_through() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::builder("test.safe_methods_query", MemoryStore::new())
        .tenant_from(|_| Some("tenant-a".to_owned()))
        .build()
        .expect("layer config");
    let app = Router::new()
        .route("/search", axum::routing::any(counted))
        .route_layer(layer)
        .with_state(calls.clone());
    let (addr, task) = serve_on_loopback(app).await;
    let url = format!("http://{addr}/search");
    let client = reqwest::Client::new();
    let query = Method::from_bytes(b"QUERY").expect("method");

    let refused = client.post(&url).body("q").send().await.expect("post");
    assert_eq!(refused.status(), 400, "the layer guards the route");
    for (n, key) in [(1, None), (2, Some("k-query")), (3, Some("k-query"))] {
        let mut request = client
            .request(query.clone(), &url)
            .body("{\"q\":\"shoes\"}");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let r = request.send().await.expect("query");
        assert_eq!(r.status(), 200, "QUERY with key {key:?} passes through");
        assert!(r.headers().get("idempotent-replayed").is_none());
        assert_eq!(r.text().await.expect("body"), format!("call {n}"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    task.abort();
}
