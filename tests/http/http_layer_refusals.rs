//! The layer's own refusals made before anything runs (no tenant, a tenant
//! that is not valid, a body over the cap) say "nothing ran, send the
//! request again with the same key". An idempotency layer around this one
//! (a router-wide one, with a tenant of its own, outside the middleware
//! that authenticates for the route) must not record them either: the
//! corrected request with the same key would get the refusal back, or a 422
//! once its body changed.

use crate::http_app::{expect_problem, serve, AccountId};
use axum::body::Bytes;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use idempotent_runtime::http::problem::types;
use idempotent_runtime::http::{IdempotencyLayer, IdempotencyLayerBuilder};
use idempotent_runtime::MemoryStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Stands in for a route's own authentication, inside a router-wide layer:
/// with good credentials (`X-Credentials: good`), `X-Account-Id` names the
/// caller (an empty one too, which no layer takes for a tenant); with bad
/// ones, nobody.
async fn route_authentication(mut request: Request, next: Next) -> Response {
    let good = request
        .headers()
        .get("x-credentials")
        .is_some_and(|v| v == "good");
    let account = request
        .headers()
        .get("x-account-id")
        .and_then(|v| v.to_str().ok())
        .map(|account| AccountId(account.to_owned()));
    if let (true, Some(account)) = (good, account) {
        request.extensions_mut().insert(account);
    }
    next.run(request).await
}

/// A router-wide layer (tenant: the API client's `X-Client-Id`) around the
/// route's authentication around the route's own layer (tenant: the
/// account the authentication names). Returns the base URL, the server
/// task and the handler's run counter.
async fn nested(
    outer: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
    inner_scope: &str,
) -> (String, tokio::task::JoinHandle<()>, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move |body: Bytes| {
        let counted = counted.clone();
        async move {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            let body = String::from_utf8_lossy(&body).into_owned();
            (StatusCode::CREATED, format!("{body} (run {n})"))
        }
    };
    let outer_scope = format!("{inner_scope}.gateway");
    let app = Router::new()
        .route("/orders", post(handler))
        .route_layer(
            IdempotencyLayer::builder(inner_scope, MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(route_authentication))
        .layer(
            outer(
                IdempotencyLayer::builder(outer_scope, MemoryStore::new()).tenant_from(|parts| {
                    parts
                        .headers
                        .get("x-client-id")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                }),
            )
            .build()
            .expect("layer"),
        );
    let (base, task) = serve(app).await;
    (base, task, runs)
}

async fn send(base: &str, credentials: &str, account: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/orders"))
        .header("x-client-id", "client-1")
        .header("x-credentials", credentials)
        .header("x-account-id", account)
        .header("idempotency-key", "order-1")
        .body("one order")
        .send()
        .await
        .expect("request")
}

/// The route's layer answers 401 `missing-tenant` ("authenticate and send
/// the request again with the same key"). An outer layer whose rule
/// records 4xx answers (`record_when`) recorded it, and the authenticated
/// request with the same key got the recorded 401 back.
#[tokio::test]
async fn an_inner_layers_missing_tenant_is_not_recorded_by_an_outer_layer() {
    let (base, _task, runs) = nested(
        |outer| outer.record_when(|status| status.is_success() || status.is_client_error()),
        "refusals.unauthenticated",
    )
    .await;

    let refused = send(&base, "bad", "acct-1").await;
    expect_problem(refused, 401, types::MISSING_TENANT).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    let authenticated = send(&base, "good", "acct-1").await;
    assert!(
        authenticated.headers().get("idempotent-replayed").is_none(),
        "the 401 was recorded and replayed"
    );
    assert_eq!(authenticated.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let retry = send(&base, "good", "acct-1").await;
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.text().await.expect("body"), "one order (run 1)");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The route's layer answers 400 `invalid-tenant` when the authentication
/// names an empty account ("check the credentials sent with the request").
/// An outer layer with the default rule recorded that 400, and the request
/// with good credentials and the same key got the recorded 400 back.
#[tokio::test]
async fn an_inner_layers_invalid_tenant_is_not_recorded_by_an_outer_layer() {
    let (base, _task, runs) = nested(|outer| outer, "refusals.invalid-tenant").await;

    let refused = send(&base, "good", "").await;
    expect_problem(refused, 400, types::INVALID_TENANT).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    let authenticated = send(&base, "good", "acct-1").await;
    assert!(
        authenticated.headers().get("idempotent-replayed").is_none(),
        "the 400 was recorded and replayed"
    );
    assert_eq!(authenticated.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
