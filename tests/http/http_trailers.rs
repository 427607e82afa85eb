//! What the first answer carries besides status, headers and body, and what
//! a replay carries: the handler's trailers (gRPC's `grpc-status`) and its
//! response extensions, read by middleware outside the layer. Each case runs
//! on the memory store and a SQLite file.

use crate::common;
use crate::http_app::{authenticate, bounded, serve, sqlite_file_store, AccountId};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use common::servers::fresh_tenant;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::{MemoryStore, Store};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A response extension the handler sets for middleware further out.
#[derive(Clone)]
struct Marker(u32);

/// Middleware outside the idempotency layer that reads the handler's
/// [`Marker`] extension and shows it to the client as `X-Marker`.
async fn expose_marker(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    if let Some(Marker(n)) = response.extensions().get::<Marker>().cloned() {
        response
            .headers_mut()
            .insert("x-marker", HeaderValue::from(n));
    }
    response
}

async fn stores() -> Vec<(&'static str, Arc<dyn Store>)> {
    vec![
        ("memory", Arc::new(MemoryStore::new())),
        ("sqlite", sqlite_file_store().await),
    ]
}

/// Sends one POST with `key` and returns the answer with its body collected
/// (data and trailers). `TE: trailers` says the client takes trailers, which
/// HTTP/1.1 needs before a server sends any.
async fn send(
    http: &reqwest::Client,
    url: &str,
    tenant: &str,
    key: &str,
) -> (
    axum::http::response::Parts,
    http_body_util::Collected<Bytes>,
) {
    let response = bounded(
        "the answer",
        http.post(url)
            .header("x-account-id", tenant)
            .header("idempotency-key", key)
            .header("te", "trailers")
            .body("{}")
            .send(),
    )
    .await
    .expect("request");
    let (parts, body) = axum::http::Response::from(response).into_parts();
    let collected = bounded("the body and its trailers", body.collect())
        .await
        .expect("body");
    (parts, collected)
}

fn replayed(parts: &axum::http::response::Parts) -> bool {
    parts
        .headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

fn trailer<'a>(
    collected: &'a http_body_util::Collected<Bytes>,
    name: &str,
) -> Option<&'a HeaderValue> {
    collected.trailers().and_then(|t| t.get(name))
}

/// A gRPC-style handler: a body, then `grpc-status` and a per-call
/// `x-debug-id` as trailers. The first answer brings both trailers to the
/// caller; a replay brings `grpc-status` (allow-listed on the layer) and not
/// `x-debug-id` (not allow-listed).
#[tokio::test]
async fn trailers_reach_the_first_answer_and_allow_listed_ones_are_replayed() {
    for (store_name, store) in stores().await {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let layer = IdempotencyLayer::builder("http_trailers.grpc", store)
            .tenant_from_extension::<AccountId>()
            .record_header(HeaderName::from_static("grpc-status"))
            .build()
            .expect("layer");
        let app = Router::new()
            .route(
                "/grpc",
                post(move || {
                    let call = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        let mut trailers = HeaderMap::new();
                        trailers.insert("grpc-status", HeaderValue::from_static("0"));
                        trailers.insert("x-debug-id", HeaderValue::from(call));
                        let frames = [
                            Frame::data(Bytes::from_static(b"\0\0\0\0\x02hi")),
                            Frame::trailers(trailers),
                        ];
                        let body = StreamBody::new(futures_util::stream::iter(
                            frames.map(Ok::<_, std::convert::Infallible>),
                        ));
                        (
                            StatusCode::OK,
                            [
                                ("content-type", "application/grpc"),
                                ("trailer", "grpc-status, x-debug-id"),
                            ],
                            Body::new(body),
                        )
                            .into_response()
                    }
                }),
            )
            .route_layer(layer)
            .layer(middleware::from_fn(authenticate));
        let (base, _task) = serve(app).await;
        let http = reqwest::Client::new();
        let url = format!("{base}/grpc");
        let tenant = fresh_tenant();

        let (first, first_body) = send(&http, &url, &tenant, "k-grpc").await;
        assert_eq!(first.status, 200, "{store_name}");
        assert!(!replayed(&first), "{store_name}");
        assert_eq!(
            trailer(&first_body, "grpc-status").map(|v| v.as_bytes()),
            Some(&b"0"[..]),
            "{store_name}: the first answer keeps the handler's trailers"
        );
        assert_eq!(
            trailer(&first_body, "x-debug-id").map(|v| v.as_bytes()),
            Some(&b"1"[..]),
            "{store_name}: every trailer, allow-listed or not"
        );
        assert_eq!(
            &first_body.to_bytes()[..],
            b"\0\0\0\0\x02hi",
            "{store_name}"
        );

        let (again, again_body) = send(&http, &url, &tenant, "k-grpc").await;
        assert_eq!(again.status, 200, "{store_name}");
        assert!(replayed(&again), "{store_name}");
        assert_eq!(
            again.headers.get("content-type").map(|v| v.as_bytes()),
            Some(&b"application/grpc"[..]),
            "{store_name}"
        );
        assert_eq!(
            trailer(&again_body, "grpc-status").map(|v| v.as_bytes()),
            Some(&b"0"[..]),
            "{store_name}: an allow-listed trailer is replayed"
        );
        assert!(
            trailer(&again_body, "x-debug-id").is_none(),
            "{store_name}: a trailer not on the allow-list is not replayed"
        );
        assert_eq!(
            &again_body.to_bytes()[..],
            b"\0\0\0\0\x02hi",
            "{store_name}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{store_name}");
    }
}

/// Middleware outside the layer reads a response extension the handler set.
/// The first answer is the handler's, extensions included; a replay has none
/// (extensions are not serializable, so they are never recorded).
#[tokio::test]
async fn the_first_answer_keeps_the_handlers_response_extensions() {
    for (store_name, store) in stores().await {
        let layer = IdempotencyLayer::builder("http_trailers.extensions", store)
            .tenant_from_extension::<AccountId>()
            .build()
            .expect("layer");
        let app = Router::new()
            .route(
                "/marked",
                post(|| async {
                    let mut response = (StatusCode::CREATED, "marked").into_response();
                    response.extensions_mut().insert(Marker(7));
                    response
                }),
            )
            .route_layer(layer)
            .layer(middleware::from_fn(authenticate))
            .layer(middleware::from_fn(expose_marker));
        let (base, _task) = serve(app).await;
        let http = reqwest::Client::new();
        let url = format!("{base}/marked");
        let tenant = fresh_tenant();

        let (first, first_body) = send(&http, &url, &tenant, "k-marked").await;
        assert_eq!(first.status, 201, "{store_name}");
        assert!(!replayed(&first), "{store_name}");
        assert_eq!(
            first.headers.get("x-marker").map(|v| v.as_bytes()),
            Some(&b"7"[..]),
            "{store_name}: middleware outside the layer sees the handler's extension"
        );
        assert_eq!(&first_body.to_bytes()[..], b"marked", "{store_name}");

        let (again, again_body) = send(&http, &url, &tenant, "k-marked").await;
        assert_eq!(again.status, 201, "{store_name}");
        assert!(replayed(&again), "{store_name}");
        assert!(
            again.headers.get("x-marker").is_none(),
            "{store_name}: extensions are never recorded"
        );
        assert_eq!(&again_body.to_bytes()[..], b"marked", "{store_name}");
    }
}
