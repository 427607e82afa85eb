//! Request bodies that cannot be read: the layer's 400 `body-unreadable`
//! says nothing ran and nothing was recorded, so the same key may be sent
//! again; that stays true when an idempotency layer around this one (a
//! router-wide one, say, outside a request decoder) sees the answer.

use crate::http_app::{authenticate, expect_problem, serve, AccountId};
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Request};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use idempotent_runtime::http::problem::types;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::MemoryStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Stands in for request decompression: a body sent with
/// `Content-Encoding: x-hex` reaches the service behind it decoded (the
/// header removed), and one that is not hex fails as it is read, as a
/// corrupt gzip stream does behind a decompression layer.
async fn decode_hex(mut request: Request, next: Next) -> Response {
    if request
        .headers()
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v == "x-hex")
    {
        request.headers_mut().remove(header::CONTENT_ENCODING);
        request.headers_mut().remove(header::CONTENT_LENGTH);
        let (parts, body) = request.into_parts();
        let encoded = axum::body::to_bytes(body, usize::MAX)
            .await
            .expect("the outer layer buffered the body");
        let decoded: Option<Vec<u8>> = encoded
            .chunks(2)
            .map(|pair| {
                std::str::from_utf8(pair)
                    .ok()
                    .and_then(|s| u8::from_str_radix(s, 16).ok())
            })
            .collect();
        let body = match decoded {
            Some(bytes) => Body::from(bytes),
            None => Body::from_stream(futures_util::stream::once(async {
                Err::<Bytes, _>(std::io::Error::other("not hex"))
            })),
        };
        request = Request::from_parts(parts, body);
    }
    next.run(request).await
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An idempotency layer around a request decoder around a route's own
/// idempotency layer. A body that does not decode is refused by the inner
/// layer with 400 `body-unreadable` ("send the request again with the same
/// Idempotency-Key"): nothing ran, nothing was recorded. The outer layer
/// recorded that 400 as the key's final answer, so the corrected request
/// sent with the same key, as the answer said, was refused as a reused key
/// (422), and the same request again was answered with the replayed 400
/// for the record's ttl. Now the answer is marked `NotFinal`, which no
/// layer records.
#[tokio::test]
async fn an_inner_layers_body_unreadable_is_not_recorded_by_an_outer_layer() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move |Extension(AccountId(account)): Extension<AccountId>, body: Bytes| {
        let counted = counted.clone();
        async move {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            let body = String::from_utf8_lossy(&body).into_owned();
            (StatusCode::CREATED, format!("{account}: {body} (run {n})"))
        }
    };
    let layer = |scope: &str| {
        IdempotencyLayer::builder(scope, MemoryStore::new())
            .tenant_from_extension::<AccountId>()
            .build()
            .expect("layer")
    };
    let app = Router::new()
        .route("/orders", post(handler))
        .route_layer(layer("nested.orders"))
        .layer(middleware::from_fn(decode_hex))
        .layer(layer("nested.gateway"))
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let send = |body: String| {
        reqwest::Client::new()
            .post(format!("{base}/orders"))
            .header("x-account-id", "acct-nested")
            .header("idempotency-key", "order-1")
            .header("content-encoding", "x-hex")
            .body(body)
            .send()
    };

    let corrupt = send("zz".to_owned()).await.expect("request");
    expect_problem(corrupt, 400, types::BODY_UNREADABLE).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    let again = send("zz".to_owned()).await.expect("request");
    assert!(
        again.headers().get("idempotent-replayed").is_none(),
        "the unreadable body's 400 was recorded and replayed"
    );
    expect_problem(again, 400, types::BODY_UNREADABLE).await;

    let corrected = send(hex(b"one order")).await.expect("request");
    assert_eq!(
        corrected.status(),
        StatusCode::CREATED,
        "the corrected request with the same key: {}",
        corrected.text().await.expect("body")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let retry = send(hex(b"one order")).await.expect("request");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(
        retry.text().await.expect("body"),
        "acct-nested: one order (run 1)"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body that breaks off halfway (a malformed chunk after the first one)
/// is refused with 400 `body-unreadable` before anything is reserved: the
/// handler does not run, and the key stays free, so the request sent again
/// whole with the same key runs once (had the layer reserved the key before
/// it read the body, the retry would wait on, or be refused by, a record
/// nobody completes).
#[tokio::test]
async fn a_body_that_breaks_off_runs_nothing_and_holds_no_key() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(move |body: Bytes| {
                let counted = counted.clone();
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, body)
                }
            }),
        )
        .route_layer(
            IdempotencyLayer::builder("broken.bodies", MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .reject_in_progress()
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let address = base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    stream
        .write_all(
            b"POST /orders HTTP/1.1\r\nhost: test\r\nx-account-id: acct-broken\r\n\
              idempotency-key: order-1\r\ncontent-type: text/plain\r\n\
              transfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
        )
        .await
        .expect("write");
    let mut answer = Vec::new();
    crate::http_app::bounded(
        "the answer to the broken body",
        stream.read_to_end(&mut answer),
    )
    .await
    .expect("read");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains(types::BODY_UNREADABLE), "{answer}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    let whole = reqwest::Client::new()
        .post(format!("{base}/orders"))
        .header("x-account-id", "acct-broken")
        .header("idempotency-key", "order-1")
        .header("content-type", "text/plain")
        .body("hello, world")
        .send()
        .await
        .expect("request");
    assert_eq!(whole.status(), StatusCode::CREATED);
    assert!(whole.headers().get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An idempotency layer around a request decoder around a route's own
/// idempotency layer with a smaller body cap. A body that decodes to more
/// than the inner cap is refused by the inner layer with 413
/// `body-too-large` ("send a smaller body; this request was not
/// processed"): nothing ran, nothing was recorded. The outer layer recorded
/// that 413 as the key's final answer, so the smaller body sent with the
/// same key was refused as a reused key (422).
#[tokio::test]
async fn an_inner_layers_body_too_large_is_not_recorded_by_an_outer_layer() {
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
    let app = Router::new()
        .route("/orders", post(handler))
        .route_layer(
            IdempotencyLayer::builder("nested.small.orders", MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .max_body_bytes(16)
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(decode_hex))
        .layer(
            IdempotencyLayer::builder("nested.small.gateway", MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let send = |body: String| {
        reqwest::Client::new()
            .post(format!("{base}/orders"))
            .header("x-account-id", "acct-small")
            .header("idempotency-key", "order-1")
            .header("content-encoding", "x-hex")
            .body(body)
            .send()
    };

    let large = send(hex(b"an order far over sixteen bytes"))
        .await
        .expect("request");
    expect_problem(large, 413, types::BODY_TOO_LARGE).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    let smaller = send(hex(b"one order")).await.expect("request");
    assert_eq!(
        smaller.status(),
        StatusCode::CREATED,
        "the smaller request with the same key: {}",
        smaller.text().await.expect("body")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let retry = send(hex(b"one order")).await.expect("request");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.text().await.expect("body"), "one order (run 1)");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body over the limit of something inside the layer (axum's
/// `DefaultBodyLimit` here; tower-http's `RequestBodyLimitLayer`, or a
/// request decompressor's output limit, alike) is refused with 413 before
/// the handler's code runs. The layer recorded that 413 like any 4xx, so
/// the request sent again smaller with the same key, as the 413 asks, was
/// refused as a reused key (422) for the record's ttl.
#[tokio::test]
async fn a_413_from_inside_the_layer_is_not_recorded() {
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
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(axum::extract::DefaultBodyLimit::max(16))
        .route_layer(
            IdempotencyLayer::builder("limited.orders", MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let send = |body: &'static str| {
        reqwest::Client::new()
            .post(format!("{base}/orders"))
            .header("x-account-id", "acct-limited")
            .header("idempotency-key", "order-1")
            .body(body)
            .send()
    };

    let large = send("an order far over sixteen bytes")
        .await
        .expect("request");
    assert_eq!(large.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");
    let again = send("an order far over sixteen bytes")
        .await
        .expect("request");
    assert_eq!(again.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        again.headers().get("idempotent-replayed").is_none(),
        "the 413 was recorded and replayed"
    );

    let smaller = send("one order").await.expect("request");
    assert_eq!(
        smaller.status(),
        StatusCode::CREATED,
        "the smaller request with the same key: {}",
        smaller.text().await.expect("body")
    );
    let retry = send("one order").await.expect("request");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.text().await.expect("body"), "one order (run 1)");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// axum's `Json` extractor refuses a body sent without
/// `Content-Type: application/json` with 415, before the handler's code
/// runs. The client sends it again with the header and the same key (the
/// `Content-Type` is part of the request's fingerprint): a recorded 415
/// would answer that 422 for the record's whole ttl.
#[tokio::test]
async fn a_415_from_an_extractor_is_not_recorded() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move |axum::Json(order): axum::Json<serde_json::Value>| {
        let counted = counted.clone();
        async move {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("{order} (run {n})"))
        }
    };
    let app = Router::new()
        .route("/orders", post(handler))
        .route_layer(
            IdempotencyLayer::builder("typed.orders", MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let send = |content_type: Option<&'static str>| {
        let request = reqwest::Client::new()
            .post(format!("{base}/orders"))
            .header("x-account-id", "acct-typed")
            .header("idempotency-key", "order-1")
            .body(r#"{"sku":"a"}"#);
        match content_type {
            Some(value) => request.header("content-type", value).send(),
            None => request.send(),
        }
    };

    let untyped = send(None).await.expect("request");
    assert_eq!(untyped.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    let typed = send(Some("application/json")).await.expect("request");
    assert_eq!(
        typed.status(),
        StatusCode::CREATED,
        "the request with its Content-Type and the same key: {}",
        typed.text().await.expect("body")
    );
    let retry = send(Some("application/json")).await.expect("request");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A layer over the whole router (`Router::layer`) sees axum's own 405 for
/// a method the route does not take: the router answers it, no handler ran.
/// The client sends the request again with the right method and the same
/// key (the method is part of the request's fingerprint): a recorded 405
/// would answer that 422 for the record's whole ttl.
#[tokio::test]
async fn a_405_from_the_router_is_not_recorded() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move || {
        let counted = counted.clone();
        async move {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("order (run {n})"))
        }
    };
    let app = Router::new()
        .route("/orders", axum::routing::put(handler))
        .layer(
            IdempotencyLayer::builder("routed.orders", MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let send = |method: reqwest::Method| {
        reqwest::Client::new()
            .request(method, format!("{base}/orders"))
            .header("x-account-id", "acct-routed")
            .header("idempotency-key", "order-1")
            .body("one order")
            .send()
    };

    let wrong = send(reqwest::Method::POST).await.expect("request");
    assert_eq!(wrong.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    let right = send(reqwest::Method::PUT).await.expect("request");
    assert_eq!(
        right.status(),
        StatusCode::CREATED,
        "the request with the route's method and the same key: {}",
        right.text().await.expect("body")
    );
    let retry = send(reqwest::Method::PUT).await.expect("request");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.text().await.expect("body"), "order (run 1)");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Stands in for tower-http's `RequestBodyLimitLayer` (a router-wide cap
/// smaller than the layer's own): the body behind it is an
/// `http_body_util::Limited` of 16 bytes, which fails with
/// `LengthLimitError` past the cap, as the body reaches the layer through
/// axum's `Body` (which wraps the error in `axum::Error`).
async fn limit_16(request: Request, next: Next) -> Response {
    next.run(request.map(|body| Body::new(http_body_util::Limited::new(body, 16))))
        .await
}

/// A body over a limit set outside the layer (tower-http's
/// `RequestBodyLimitLayer` on the router, with a chunked body or one whose
/// length the limit does not check) is refused with 413 `body-too-large`:
/// nothing ran, nothing is held, and a smaller body with the same key runs.
/// The layer looked for the limit's `LengthLimitError` only at the top of
/// the body's error, where axum's `Body` had wrapped it, and answered 400
/// `body-unreadable` ("the body ended early or was malformed; send the
/// request again with the same key"), which the same body can only get
/// again.
#[tokio::test]
async fn a_body_over_a_limit_outside_the_layer_is_413_not_unreadable() {
    let mut stores: Vec<(&str, Arc<dyn idempotent_runtime::Store>)> = vec![
        ("memory", Arc::new(MemoryStore::new())),
        ("sqlite", crate::http_app::sqlite_file_store().await),
    ];
    if let Some(pg) = crate::common::servers::pg_store_or_skip().await {
        stores.push(("postgres", Arc::new(pg)));
    }
    if let Some(my) = crate::common::servers::mysql_store_or_skip().await {
        stores.push(("mariadb", Arc::new(my)));
    }
    for (name, store) in stores {
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
        let app = Router::new()
            .route("/orders", post(handler))
            .route_layer(
                IdempotencyLayer::builder("outer-limit.orders", store)
                    .tenant_from_extension::<AccountId>()
                    .build()
                    .expect("layer"),
            )
            .layer(middleware::from_fn(limit_16))
            .layer(middleware::from_fn(authenticate));
        let (base, _task) = serve(app).await;
        let tenant = crate::common::servers::fresh_tenant();
        let send = |body: &'static str| {
            reqwest::Client::new()
                .post(format!("{base}/orders"))
                .header("x-account-id", &tenant)
                .header("idempotency-key", "order-1")
                .body(body)
                .send()
        };

        let large = send("an order far over sixteen bytes")
            .await
            .expect("request");
        assert_eq!(large.status(), 413, "{name}");
        expect_problem(large, 413, types::BODY_TOO_LARGE).await;
        assert_eq!(runs.load(Ordering::SeqCst), 0, "{name}: nothing ran");

        let smaller = send("one order").await.expect("request");
        assert_eq!(
            smaller.status(),
            StatusCode::CREATED,
            "{name}: the smaller request with the same key: {}",
            smaller.text().await.expect("body")
        );
        let retry = send("one order").await.expect("request");
        assert_eq!(retry.headers()["idempotent-replayed"], "true", "{name}");
        assert_eq!(
            retry.text().await.expect("body"),
            "one order (run 1)",
            "{name}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
    }
}

/// What a route's own checks (a middleware inside the layer, as
/// tower-http's `ValidateRequestHeaderLayer` is, or the handler's first
/// lines) say to a request whose headers or framing they refuse, before
/// anything is done: each status is one the HTTP RFCs define as "not
/// processed; send it again, changed as follows" (or, for 421, unchanged
/// over another connection).
fn refuse_before_work(request: &Request, misdirect_next: &AtomicUsize) -> Option<StatusCode> {
    let headers = request.headers();
    // RFC 9110 15.5.20: a request that reached a server that does not serve
    // its target. "Clients ... MAY retry the request, whether or not the
    // request method is idempotent, over a different connection."
    if misdirect_next
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return Some(StatusCode::MISDIRECTED_REQUEST);
    }
    // RFC 9110 15.5.12: "The client MAY repeat the request if it adds a valid
    // Content-Length header field."
    if !headers.contains_key(header::CONTENT_LENGTH) {
        return Some(StatusCode::LENGTH_REQUIRED);
    }
    // RFC 9110 10.1.1: "A client that receives a 417 (Expectation Failed)
    // status code in response to a request containing a 100-continue
    // expectation SHOULD repeat that request without a 100-continue
    // expectation."
    if headers.contains_key(header::EXPECT) {
        return Some(StatusCode::EXPECTATION_FAILED);
    }
    // RFC 6585 3: the route takes only conditional requests (lost updates);
    // the client sends it again with `If-Match`.
    if !headers.contains_key(header::IF_MATCH) {
        return Some(StatusCode::PRECONDITION_REQUIRED);
    }
    // RFC 9110 13.1.1: the order is at version "v1"; a request made from an
    // older read fails its precondition and the method is not performed.
    // The client reads the resource again and sends the request with the
    // current version.
    if headers
        .get(header::IF_MATCH)
        .is_some_and(|v| v.as_bytes() != b"\"v1\"")
    {
        return Some(StatusCode::PRECONDITION_FAILED);
    }
    // RFC 6585 5: "The request MAY be resubmitted after reducing the size of
    // the request header fields."
    if headers.values().any(|v| v.len() > 1024) {
        return Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    }
    // Content negotiation (tower-http's `ValidateRequestHeaderLayer::accept`).
    if headers
        .get(header::ACCEPT)
        .is_some_and(|v| !v.as_bytes().windows(4).any(|w| w == b"json"))
    {
        return Some(StatusCode::NOT_ACCEPTABLE);
    }
    // RFC 9110 15.5.15: a target longer than the route takes; sent again shorter.
    if request.uri().to_string().len() > 64 {
        return Some(StatusCode::URI_TOO_LONG);
    }
    None
}

/// A refusal that asks for the request again (411, 412, 417, 421, 428, 431 by
/// their RFCs' words; 414, which a shorter target answers, like the 413
/// and 415 the layer already leaves unrecorded), made inside the
/// layer before the handler did anything, is not recorded: the request the
/// RFC tells the client to send (the same key; the same method, target and
/// body but for 414, so the same fingerprint but for 414) runs. Recorded, it
/// answered that request with the refusal itself (a replay: headers and
/// framing are not fingerprinted) or 422 (414), for the record's whole ttl.
#[tokio::test]
async fn refusals_that_ask_for_the_request_again_are_not_recorded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runs = Arc::new(AtomicUsize::new(0));
    let misdirect_next = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move |body: Bytes| {
        let counted = counted.clone();
        async move {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            let body = String::from_utf8_lossy(&body).into_owned();
            (StatusCode::CREATED, format!("{body} (run {n})"))
        }
    };
    let checks = misdirect_next.clone();
    let app = Router::new()
        .route("/orders", post(handler))
        // Inside the idempotency layer: added to the route before it.
        .route_layer(middleware::from_fn(move |request: Request, next: Next| {
            let checks = checks.clone();
            async move {
                match refuse_before_work(&request, &checks) {
                    Some(status) => axum::response::IntoResponse::into_response(status),
                    None => next.run(request).await,
                }
            }
        }))
        .route_layer(
            IdempotencyLayer::builder("resend.orders", MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let addr = base.trim_start_matches("http://").to_owned();

    // One request written byte for byte (`Connection: close`): its status,
    // whether it was replayed, and its body.
    let send = |key: String, target: String, extra: Vec<String>, chunked: bool| {
        let addr = addr.clone();
        async move {
            let body = "one order";
            let mut head = format!(
                "POST {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
                 X-Account-Id: acct-resend\r\nIdempotency-Key: {key}\r\n\
                 Content-Type: text/plain\r\n"
            );
            for line in &extra {
                head.push_str(line);
                head.push_str("\r\n");
            }
            let framed = if chunked {
                head.push_str("Transfer-Encoding: chunked\r\n\r\n");
                format!("{head}{:x}\r\n{body}\r\n0\r\n\r\n", body.len())
            } else {
                format!("{head}Content-Length: {}\r\n\r\n{body}", body.len())
            };
            let mut stream = tokio::net::TcpStream::connect(&addr)
                .await
                .expect("connect");
            stream.write_all(framed.as_bytes()).await.expect("write");
            let mut answer = Vec::new();
            crate::http_app::bounded("the answer", stream.read_to_end(&mut answer))
                .await
                .expect("read");
            let mut answer = String::from_utf8_lossy(&answer).into_owned();
            // The interim `100 Continue` a request that expects it gets first.
            while answer.starts_with("HTTP/1.1 1") {
                let end = answer.find("\r\n\r\n").map_or(answer.len(), |i| i + 4);
                answer.drain(..end);
            }
            let status: u16 = answer
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("no status in {answer:?}"));
            let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
            let replayed = head
                .to_ascii_lowercase()
                .contains("\r\nidempotent-replayed: true");
            (status, replayed, body.to_owned())
        }
    };
    let good_lines = || {
        vec![
            "If-Match: \"v1\"".to_owned(),
            "Accept: application/json".to_owned(),
        ]
    };
    let long_query = format!("/orders?note={}", "x".repeat(80));
    // (status, the refused request: extra lines, chunked, target)
    let cases: Vec<(u16, Vec<String>, bool, &str)> = vec![
        (411, good_lines(), true, "/orders"),
        (
            417,
            [good_lines(), vec!["Expect: 100-continue".to_owned()]].concat(),
            false,
            "/orders",
        ),
        (
            428,
            vec!["Accept: application/json".to_owned()],
            false,
            "/orders",
        ),
        (
            412,
            vec![
                "If-Match: \"v0\"".to_owned(),
                "Accept: application/json".to_owned(),
            ],
            false,
            "/orders",
        ),
        (
            431,
            [
                good_lines(),
                vec![format!("Cookie: s={}", "c".repeat(2048))],
            ]
            .concat(),
            false,
            "/orders",
        ),
        (414, good_lines(), false, long_query.as_str()),
        (421, good_lines(), false, "/orders"),
    ];
    let mut recorded = Vec::new();
    for (status, refused_lines, chunked, target) in cases {
        let key = format!("order-{status}");
        if status == 421 {
            misdirect_next.store(1, Ordering::SeqCst);
        }
        let before = runs.load(Ordering::SeqCst);
        let (got, _, _) = send(key.clone(), target.to_owned(), refused_lines, chunked).await;
        assert_eq!(got, status, "the refused request");
        assert_eq!(runs.load(Ordering::SeqCst), before, "{status}: nothing ran");

        // The request as the RFC says to send it again, with the same key.
        let (again, replayed, body) =
            send(key.clone(), "/orders".to_owned(), good_lines(), false).await;
        if again != 201 || replayed {
            recorded.push(format!(
                "{status}: the corrected request got {again} (replayed: {replayed}) {body:?}"
            ));
            continue;
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            before + 1,
            "{status}: it ran once"
        );
        let (retry, replayed, _) = send(key, "/orders".to_owned(), good_lines(), false).await;
        assert_eq!(
            (retry, replayed),
            (201, true),
            "{status}: its retry is a replay"
        );
    }
    assert!(
        recorded.is_empty(),
        "refusals that ask for the request again were recorded:\n{}",
        recorded.join("\n")
    );

    // A 406 stays recorded: a handler may negotiate the representation
    // after its work, and the request sent again with another `Accept`
    // would run that work again.
    let not_acceptable = vec![
        "If-Match: \"v1\"".to_owned(),
        "Accept: text/html".to_owned(),
    ];
    let key = "order-406".to_owned();
    let (got, _, _) = send(key.clone(), "/orders".to_owned(), not_acceptable, false).await;
    assert_eq!(got, 406);
    let (again, replayed, _) = send(key, "/orders".to_owned(), good_lines(), false).await;
    assert_eq!((again, replayed), (406, true), "a 406 is recorded");
}

/// axum's `Json` extractor refuses a body whose values do not fit the
/// handler's type with 422 (`450.0` for a `u64`, as Python's `json.dumps`
/// writes a float amount), before the handler's code runs; the layer
/// records it as a 4xx. The client fixes the amount and sends the
/// operation again with its key (the key belongs to the operation; Stripe
/// saves no result for a request that failed validation, so its users
/// expect this to work): the fixed body is the same request to the
/// fingerprint (`450.0` and `450` are one JSON number), so the stale
/// extractor error is *replayed* (`Idempotent-Replayed: true`) for the
/// record's ttl, and the charge never happens under that key. (A fix the
/// fingerprint tells apart, `"450"` to `450`, gets 422 `key-reused`
/// instead.) The layer cannot tell an extractor's 422 from a handler's own,
/// so whether 400/422 are recorded is a policy question, not a local fix.
#[tokio::test]
#[ignore = "reproduces: an extractor's 422 is recorded and replayed to the corrected request (same fingerprint)"]
async fn a_json_extractor_refusal_is_not_replayed_to_the_fixed_request() {
    #[derive(serde::Deserialize)]
    struct Charge {
        amount_cents: u64,
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move |axum::Json(charge): axum::Json<Charge>| {
        let counted = counted.clone();
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            (
                StatusCode::CREATED,
                format!("charged {}", charge.amount_cents),
            )
        }
    };
    let app = Router::new()
        .route("/charges", post(handler))
        .route_layer(
            IdempotencyLayer::builder("extractor.charges", MemoryStore::new())
                .tenant_from_extension::<AccountId>()
                .build()
                .expect("layer"),
        )
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let send = |body: &'static str| {
        reqwest::Client::new()
            .post(format!("{base}/charges"))
            .header("x-account-id", "acct-extractor")
            .header("idempotency-key", "charge-1")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let float = send(r#"{"amount_cents": 450.0}"#).await.expect("request");
    assert_eq!(float.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the handler's code did not run"
    );

    let fixed = send(r#"{"amount_cents": 450}"#).await.expect("request");
    let (status, replayed) = (
        fixed.status(),
        fixed.headers().contains_key("idempotent-replayed"),
    );
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, false),
        "the fixed request with the operation's key: {}",
        fixed.text().await.expect("body")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
