//! HTTP edges: a handler's own 409 is final for the client, a router nested
//! under a prefix fingerprints the path the client sent, and a binary answer
//! under the layer's response cap is recorded (its record is base64); a
//! replay carries every header of the default recorded list.

use crate::common;
use crate::http_app::expect_problem;
use crate::http_app::{authenticate, serve, AccountId};
use axum::extract::Extension;
use axum::http::StatusCode;
use axum::middleware::{self};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::servers::fresh_tenant;
use idempotent_runtime::http::problem::types;
use idempotent_runtime::http::{
    ClientError, IdempotencyLayer, IdempotentClient, RetryPolicy, DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_RECORDED_HEADERS,
};
use idempotent_runtime::MemoryStore;
use reqwest::Method;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn layer(scope: &str) -> IdempotencyLayer {
    IdempotencyLayer::builder(scope, MemoryStore::new())
        .tenant_from_extension::<AccountId>()
        .build()
        .expect("layer")
}

/// Serves one `POST path` route under `layer` (behind the test
/// authentication) whose handler counts its runs and answers `answer()`:
/// the base URL, the count, and the server's task.
async fn counting_route(
    path: &str,
    layer: IdempotencyLayer,
    answer: impl Fn() -> axum::response::Response + Clone + Send + Sync + 'static,
) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = Router::new()
        .route(
            path,
            post(move || {
                let (counted, answer) = (counted.clone(), answer.clone());
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    answer()
                }
            }),
        )
        .route_layer(layer)
        .layer(middleware::from_fn(authenticate));
    let (base, task) = serve(app).await;
    (base, calls, task)
}

/// A handler's own 409 ("this resource already exists") is a 4xx the layer
/// records as the key's final answer, and replays to every retry with
/// `Idempotent-Replayed: true`. The client retried every 409 as if it were
/// the layer's in-progress refusal: it re-sent a final answer until its
/// attempts ran out and then reported `RetriesExhausted` ("the outcome is
/// unknown") for an operation whose outcome the server had stated. Now a
/// replayed 409 is final.
#[tokio::test]
async fn the_client_returns_a_replayed_409_as_final() {
    let (base, calls, _task) = counting_route("/accounts", layer("review3.client409"), || {
        (StatusCode::CONFLICT, "an account with this e-mail exists").into_response()
    })
    .await;
    let client = fast_retrying_client(4);
    let intent = client
        .intent(Method::POST, &format!("{base}/accounts"))
        .unwrap()
        .header("x-account-id", &fresh_tenant())
        .unwrap()
        .json(&serde_json::json!({"email": "a@example.com"}))
        .unwrap();
    let answer = intent.send().await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    match answer {
        Ok(a) => {
            assert_eq!(a.status(), 409);
            // A fresh 409 looks like a request still running (the IETF
            // draft's form): retried once, it comes back replayed, and that
            // answer is final.
            assert_eq!(a.attempts(), 2, "the replayed 409 is final");
            assert!(a.is_replayed());
        }
        Err(ClientError::RetriesExhausted { attempts, last }) => panic!(
            "the client retried a recorded, final 409 {attempts} times and reported the \
             outcome as unknown (last: {last})"
        ),
        Err(e) => panic!("{e}"),
    }
}

/// Rule 22: a replay returns the recorded status, body and *selected*
/// headers: every one of `DEFAULT_RECORDED_HEADERS` (a conditional request's
/// validators `ETag` and `Last-Modified` among them: a client that revalidates
/// with them after a replay needs the ones the first answer gave), each
/// with its values, and nothing off the list.
#[tokio::test]
async fn a_replay_carries_every_default_recorded_header() {
    let sent: Vec<(&str, &str)> = vec![
        ("content-type", "application/vnd.shop.receipt+json"),
        ("content-encoding", "identity"),
        ("content-range", "bytes 0-1/2"),
        ("location", "/receipts/7"),
        ("content-location", "/receipts/7?v=1"),
        ("content-language", "de-CH"),
        ("etag", "\"r7-v1\""),
        ("last-modified", "Wed, 21 Oct 2015 07:28:00 GMT"),
    ];
    // The README's list; a name added to the default list is sent too.
    for name in DEFAULT_RECORDED_HEADERS {
        assert!(
            sent.iter().any(|(sent, _)| *sent == name.as_str()),
            "`{name}` is recorded by default: send it here too"
        );
    }
    let answer_headers = sent.clone();
    let (base, calls, _task) = counting_route("/receipts", layer("review3.headers"), move || {
        let mut response = (StatusCode::CREATED, "{}").into_response();
        for (name, value) in &answer_headers {
            response
                .headers_mut()
                .insert(*name, value.parse().expect("a header value"));
        }
        response
            .headers_mut()
            .insert("x-request-trace", "first".parse().expect("a header value"));
        response
    })
    .await;
    let tenant = fresh_tenant();
    let send = || {
        reqwest::Client::new()
            .post(format!("{base}/receipts"))
            .header("x-account-id", &tenant)
            .header("idempotency-key", "receipt-7")
            .body("{}")
            .send()
    };
    let first = send().await.expect("first answer");
    assert_eq!(first.status(), 201);
    let retry = send().await.expect("replay");
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    for (name, value) in &sent {
        assert_eq!(
            retry
                .headers()
                .get(*name)
                .map(|v| v.to_str().expect("ASCII")),
            Some(*value),
            "the replay lost the recorded `{name}`"
        );
    }
    assert!(
        retry.headers().get("x-request-trace").is_none(),
        "a header off the list is not recorded"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the retry replays");
}

/// Rule 22: same key, different path → 422. A router nested under a prefix
/// with a path parameter (`/accounts/{account}/transfers`) sees the URI with
/// the prefix stripped; the layer fingerprints that stripped URI, so a
/// request for account B with the key already used for account A is served
/// A's recorded answer (and B's transfer never runs).
#[tokio::test]
async fn a_different_path_under_a_nested_prefix_is_422_not_a_replay() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let transfers = Router::new()
        .route(
            "/transfers",
            post(
                move |axum::extract::Path(account): axum::extract::Path<String>,
                      Extension(_who): Extension<AccountId>| {
                    let counted = counted.clone();
                    async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        (StatusCode::CREATED, format!("transfer from {account}")).into_response()
                    }
                },
            ),
        )
        .route_layer(layer("review3.nested"));
    let app = Router::new()
        .nest("/accounts/{account}", transfers)
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let http = reqwest::Client::new();
    let tenant = fresh_tenant();
    let send = |account: &'static str| {
        http.post(format!("{base}/accounts/{account}/transfers"))
            .header("x-account-id", &tenant)
            .header("idempotency-key", "k-1")
            .header("content-type", "application/json")
            .body(r#"{"amount_cents":100}"#)
            .send()
    };
    let a = send("acct-a").await.unwrap();
    assert_eq!(a.status(), 201);
    assert_eq!(a.text().await.unwrap(), "transfer from acct-a");
    let b = send("acct-b").await.unwrap();
    let status = b.status();
    let replayed = b.headers().get("idempotent-replayed").cloned();
    let body = b.text().await.unwrap();
    assert_eq!(
        status,
        422,
        "a different path with the same key must be refused; got {status} \
         (replayed: {replayed:?}) with body {body:?}; handler calls: {}",
        calls.load(Ordering::SeqCst)
    );
}

/// README: the recorded body may be up to `max_response_bytes` (8 MiB at
/// most); only a larger answer releases the key and answers 500. A binary
/// answer of 7 MiB is under the cap, but it is stored base64 inside the
/// JSON record (4/3 larger), which the engine refuses as over
/// MAX_RESULT_BYTES: the client gets 500 after the handler ran, the key is
/// released, and the retry runs the handler again.
#[tokio::test]
async fn a_binary_answer_under_the_cap_is_recorded() {
    let (status, text, again, calls) = answered_twice(
        "review3.binary",
        "application/octet-stream",
        vec![0xffu8; DEFAULT_MAX_RESPONSE_BYTES - 1],
    )
    .await;
    assert_eq!(status, 201, "just under the layer's cap: {text}");
    assert_eq!(again.status(), 201);
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    let body = again.bytes().await.unwrap();
    assert!(
        body.len() == DEFAULT_MAX_RESPONSE_BYTES - 1 && body.iter().all(|b| *b == 0xff),
        "the replay carries the recorded bytes"
    );
    assert_eq!(calls, 1, "the retry replays");
}

/// README / `DEFAULT_MAX_RESPONSE_BYTES`: an answer up to the layer's cap
/// (4 MiB) is recorded, "a larger answer releases the key". A *text* body is
/// stored JSON-escaped, and escaping doubles a backslash or a quote (and
/// makes a control character six bytes), so a text answer under the cap can
/// exceed MAX_RESULT_BYTES (8 MiB): the handler runs, the engine refuses the
/// record, the key is released, the client gets 500, and its retry runs the
/// handler a second time. Here: control characters, half the cap.
#[tokio::test]
async fn a_text_answer_under_the_cap_is_recorded() {
    // 2 MiB of control characters (e.g. NUL-separated text): 12 MiB escaped.
    let size = DEFAULT_MAX_RESPONSE_BYTES / 2;
    let (status, text, again, calls) = answered_twice(
        "review4.text",
        "text/plain",
        "\u{1}".repeat(size).into_bytes(),
    )
    .await;
    let again = again.status();
    assert_eq!(
        (status, again, calls),
        (StatusCode::CREATED, StatusCode::CREATED, 1),
        "an answer of {size} bytes (half the cap) was not recorded and the retry ran the \
         handler again: {text}"
    );
}

/// The client against a server that follows the IETF draft
/// (draft-ietf-httpapi-idempotency-key-header, "Error Scenarios"): a request
/// still being processed gets 409 with an `application/problem+json` body of
/// the server's own type, and no `Retry-After`. That is the "still running"
/// answer the client exists to retry; `still_running` only knows the layer's
/// own problem type, so it returns the 409 as final after one attempt and
/// the caller is told "conflict" for an operation that then completes.
#[tokio::test]
async fn the_client_retries_an_in_progress_409_in_the_ietf_draft_form() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = Router::new().route(
        "/payments",
        post(move || {
            let counted = counted.clone();
            async move {
                if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                    (
                        StatusCode::CONFLICT,
                        [("content-type", "application/problem+json")],
                        r#"{"type":"https://developer.example.com/idempotency","title":"A request is outstanding for this Idempotency-Key","detail":"A request with the same Idempotency-Key for the same operation is being processed or is outstanding."}"#,
                    )
                        .into_response()
                } else {
                    (StatusCode::CREATED, "paid").into_response()
                }
            }
        }),
    );
    let (base, _task) = serve(app).await;
    let client = fast_retrying_client(4);
    let intent = client
        .intent(Method::POST, &format!("{base}/payments"))
        .unwrap()
        .json(&serde_json::json!({"amount": 1}))
        .unwrap();
    let answer = intent.send().await.expect("an answer");
    assert_eq!(
        (answer.status().as_u16(), answer.attempts()),
        (201, 2),
        "the in-progress 409 was returned as final"
    );
}

/// Serves `body` (as `content_type`, status 201) behind the layer on `scope`
/// and sends one request twice with one key: the first answer's status and
/// (when it failed) its text, the second answer, and how often the handler ran.
async fn answered_twice(
    scope: &str,
    content_type: &'static str,
    body: Vec<u8>,
) -> (StatusCode, String, reqwest::Response, usize) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = Router::new()
        .route(
            "/exports",
            post(move || {
                let (counted, body) = (counted.clone(), body.clone());
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, [("content-type", content_type)], body).into_response()
                }
            }),
        )
        .route_layer(layer(scope))
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let http = reqwest::Client::new();
    let tenant = fresh_tenant();
    let send = || {
        http.post(format!("{base}/exports"))
            .header("x-account-id", &tenant)
            .header("idempotency-key", "export-1")
            .body("{}")
            .send()
    };
    let first = send().await.unwrap();
    let status = first.status();
    let text = if status.is_success() {
        String::new()
    } else {
        first.text().await.unwrap()
    };
    let again = send().await.unwrap();
    (status, text, again, calls.load(Ordering::SeqCst))
}

/// Bad configuration is refused when the layer is built, never by a panic
/// per request: `wait(Duration::MAX)` ("wait as long as it takes") passes
/// `build()` (only a zero lease is checked), and then every non-safe request
/// panics in the engine (`started + d` in `reserve_from`: "overflow when
/// adding duration to instant"), even a first request that finds no record.
/// The connection is dropped without an answer. The stores saturate such
/// durations; the layer (or the engine) should too, or `build()` should
/// refuse them with a `LayerConfigError`. (`lease(Duration::MAX)` is checked
/// alongside and answers.)
#[tokio::test]
async fn a_layer_built_with_unbounded_durations_answers_requests() {
    for (name, builder) in [
        (
            "lease(Duration::MAX)",
            IdempotencyLayer::builder("contract_edges.maxlease", MemoryStore::new())
                .lease(Duration::MAX),
        ),
        (
            "wait(Duration::MAX)",
            IdempotencyLayer::builder("contract_edges.maxwait", MemoryStore::new())
                .wait(Duration::MAX),
        ),
    ] {
        let Ok(layer) = builder.tenant_from_extension::<AccountId>().build() else {
            continue; // refused at build time: fine
        };
        let app = Router::new()
            .route(
                "/orders",
                post(|| async { (StatusCode::CREATED, "created") }),
            )
            .route_layer(layer)
            .layer(middleware::from_fn(authenticate));
        let (base, _task) = serve(app).await;
        let answer = tokio::time::timeout(
            Duration::from_secs(20),
            reqwest::Client::new()
                .post(format!("{base}/orders"))
                .header("x-account-id", fresh_tenant())
                .header("idempotency-key", "k-max")
                .send(),
        )
        .await
        .expect("answered in time");
        match answer {
            Ok(r) => assert_eq!(r.status(), 201, "{name}"),
            Err(e) => panic!("{name}: the request got no answer: {e}"),
        }
    }
}

/// Rule 22: a replay returns the recorded status, body and headers. A body
/// is only readable with its `Content-Encoding` (a handler serving a
/// pre-compressed document, or a compression layer inside the idempotency
/// layer): the layer records the encoded bytes, but `Content-Encoding` is
/// not among `DEFAULT_RECORDED_HEADERS`, so the replay sends gzip bytes
/// labelled as plain JSON. Every client that decodes by the header (browsers,
/// reqwest with `gzip`, curl --compressed) reads garbage on a retry.
#[tokio::test]
async fn a_replay_keeps_the_content_encoding_of_its_body() {
    // The gzip of `{"ok":true}` (any bytes would do: they are never decoded here).
    const GZIPPED: &[u8] = &[
        0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xab, 0x56, 0xca, 0xcf, 0x56,
        0xb2, 0x2a, 0x29, 0x2a, 0x4d, 0xad, 0x05, 0x00, 0x9c, 0x2b, 0x26, 0x5a, 0x0b, 0x00, 0x00,
        0x00,
    ];
    let app = Router::new()
        .route(
            "/documents",
            post(|| async {
                (
                    StatusCode::CREATED,
                    [
                        (axum::http::header::CONTENT_TYPE, "application/json"),
                        (axum::http::header::CONTENT_ENCODING, "gzip"),
                    ],
                    GZIPPED,
                )
                    .into_response()
            }),
        )
        .route_layer(layer("contract_edges.encoding"))
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let http = reqwest::Client::new();
    let tenant = fresh_tenant();
    let send = || {
        http.post(format!("{base}/documents"))
            .header("x-account-id", &tenant)
            .header("idempotency-key", "k-enc")
            .send()
    };
    let first = send().await.unwrap();
    let first_encoding = first.headers().get("content-encoding").cloned();
    assert_eq!(first.status(), 201);
    assert_eq!(&first.bytes().await.unwrap()[..], GZIPPED);
    let again = send().await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    let again_encoding = again.headers().get("content-encoding").cloned();
    assert_eq!(&again.bytes().await.unwrap()[..], GZIPPED, "the same bytes");
    assert_eq!(
        again_encoding, first_encoding,
        "the replay's body is gzip, but it is no longer labelled so"
    );
}

/// The client "retries that intent safely with the same key". An answer the
/// server ran but could not record (larger than the route's
/// `max_response_bytes`) comes back as a 500 `response-not-recorded` problem
/// whose detail says "the key was released ... a retry runs the request
/// again". The client retries every 5xx, so one intent runs the handler (and
/// its side effect) once per attempt: six charges for one `send()`.
#[tokio::test]
async fn the_client_does_not_rerun_a_handler_whose_answer_could_not_be_recorded() {
    let layer = IdempotencyLayer::builder("contract_edges.unrecordable", MemoryStore::new())
        .tenant_from_extension::<AccountId>()
        .max_response_bytes(16)
        .build()
        .expect("layer");
    // Each run is the side effect.
    let (base, calls, _task) = counting_route("/charges", layer, || {
        (StatusCode::CREATED, "a receipt longer than sixteen bytes").into_response()
    })
    .await;
    let client = fast_retrying_client(RetryPolicy::default().max_attempts);
    let answer = client
        .intent(Method::POST, &format!("{base}/charges"))
        .unwrap()
        .header("x-account-id", &fresh_tenant())
        .unwrap()
        .send()
        .await;
    let ran = calls.load(Ordering::SeqCst);
    assert_eq!(
        ran,
        1,
        "one intent charged {ran} times (client answer: {:?})",
        answer.as_ref().map(|a| a.status())
    );
}

/// A replayed answer is final whatever its status: a layer that records 5xx
/// answers replays the first 503 to the retry, and the client returns it
/// (`is_replayed`, two attempts) instead of retrying replays until it gives
/// up and reports the outcome unknown.
#[tokio::test]
async fn the_client_returns_a_replayed_5xx_as_final() {
    let layer = IdempotencyLayer::builder("contract_edges.recorded_5xx", MemoryStore::new())
        .tenant_from_extension::<AccountId>()
        .record_server_errors(true)
        .build()
        .expect("layer");
    let (base, calls, _task) = counting_route("/charges", layer, || {
        (StatusCode::SERVICE_UNAVAILABLE, "gateway down").into_response()
    })
    .await;
    let answer = fast_retrying_client(RetryPolicy::default().max_attempts)
        .intent(Method::POST, &format!("{base}/charges"))
        .unwrap()
        .header("x-account-id", &fresh_tenant())
        .unwrap()
        .send()
        .await
        .expect("a replayed 503 is a final answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(answer.is_replayed(), "the second attempt is the replay");
    assert_eq!(answer.attempts(), 2);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
}

/// A client that retries at once (a few ms of backoff), at most `max_attempts` times.
fn fast_retrying_client(max_attempts: u32) -> IdempotentClient {
    IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(10),
        ..RetryPolicy::default()
    })
}

/// Ships an order once, whatever request asks: its key is the order id, not
/// the HTTP request's key. Waits for `gate` before it ships.
#[idempotent_runtime::idempotent(scope = "edges.ship", key = order, tenant = account,
    store = store, in_progress = reject, skip(gate, entered))]
async fn ship_once(
    store: &MemoryStore,
    account: &str,
    order: &str,
    gate: &tokio::sync::Semaphore,
    entered: &tokio::sync::Notify,
) -> Result<String, idempotent_runtime::Error> {
    entered.notify_one();
    let _pass = gate.acquire().await.expect("gate");
    Ok(format!("shipped {order}"))
}

/// The layer never records the framework's own "try again" answer. Two
/// requests with their own Idempotency-Keys ship one order: the second's
/// handler meets the first's `#[idempotent]` call still running (`in_progress
/// = reject`) and answers 409 + `Retry-After` through `Error`'s
/// `IntoResponse`, whose text promises the answer on a retry. The layer took
/// that 4xx for the second key's final answer and replayed the 409 to every
/// retry for the record's ttl; now it passes it through, releases the key,
/// and the retry after the first one finished is answered.
#[tokio::test]
async fn an_inner_call_in_progress_409_is_passed_through_not_recorded() {
    let inner_store = Arc::new(MemoryStore::new());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let entered = Arc::new(tokio::sync::Notify::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (store, gate, entered, runs) = (
            inner_store.clone(),
            gate.clone(),
            entered.clone(),
            runs.clone(),
        );
        move |Extension(AccountId(account)): Extension<AccountId>,
              axum::extract::Path(order): axum::extract::Path<String>| {
            let (store, gate, entered, runs) =
                (store.clone(), gate.clone(), entered.clone(), runs.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                ship_once(&store, &account, &order, &gate, &entered).await
            }
        }
    };
    let app = Router::new()
        .route("/orders/{order}/ship", post(handler))
        .route_layer(layer("edges.orders"))
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    let account = fresh_tenant();
    let send = |key: &'static str| {
        reqwest::Client::new()
            .post(format!("{base}/orders/o1/ship"))
            .header("x-account-id", &account)
            .header("idempotency-key", key)
            .send()
    };
    let first = tokio::spawn(send("key-a"));
    entered.notified().await;
    let refused = send("key-b").await.expect("request");
    assert_eq!(refused.status(), 409);
    assert!(refused.headers().get("retry-after").is_some());
    assert!(refused.headers().get("idempotent-replayed").is_none());
    gate.add_permits(1);
    let first = first.await.expect("task").expect("request");
    assert_eq!(first.status(), 200);
    assert_eq!(first.text().await.expect("body"), "shipped o1");

    let retry = send("key-b").await.expect("request");
    assert_eq!(
        retry.status(),
        200,
        "the retry the 409 asked for is answered, not refused again"
    );
    assert!(
        retry.headers().get("idempotent-replayed").is_none(),
        "the handler ran for key-b"
    );
    assert_eq!(retry.text().await.expect("body"), "shipped o1");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "key-b's handler ran twice, key-a's once"
    );
}

/// Rule 20 for the layer: a request whose record is in progress after its
/// lease ran out (the instance that ran the handler died, maybe after the
/// side effect) is taken over by the retry, and the layer's `recover` hook
/// is asked first. Its `Completed` answer is recorded and replayed, the
/// handler does not run; `Run` runs the handler; an `Err` answer is sent,
/// the record is kept, and the next retry asks again (attempt 3).
#[tokio::test]
async fn the_layer_asks_its_recover_hook_on_a_takeover() {
    use idempotent_runtime::{Identity, Recovery};
    let store = Arc::new(MemoryStore::new());
    let asked: Arc<std::sync::Mutex<Vec<(String, u32)>>> = Arc::default();
    let gateway_down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let hook = {
        let (asked, gateway_down) = (asked.clone(), gateway_down.clone());
        move |takeover: idempotent_runtime::Takeover| {
            let (asked, gateway_down) = (asked.clone(), gateway_down.clone());
            async move {
                asked
                    .lock()
                    .unwrap()
                    .push((takeover.key().to_owned(), takeover.attempt()));
                match takeover.key() {
                    "k-charged" => Ok(Recovery::Completed(
                        (StatusCode::CREATED, "charge found at the provider").into_response(),
                    )),
                    "k-down" if gateway_down.load(Ordering::SeqCst) => {
                        Err((StatusCode::SERVICE_UNAVAILABLE, "provider unreachable")
                            .into_response())
                    }
                    "k-down" => Ok(Recovery::Completed(
                        (StatusCode::CREATED, "found on the second ask").into_response(),
                    )),
                    // Larger than the layer records: not recorded, kept.
                    "k-huge" => Ok(Recovery::Completed(
                        (StatusCode::CREATED, "x".repeat(100)).into_response(),
                    )),
                    _ => Ok(Recovery::Run),
                }
            }
        }
    };
    let layer = IdempotencyLayer::builder("edges.recover", store.clone())
        .tenant_from_extension::<AccountId>()
        .max_response_bytes(64)
        .recover(hook)
        .build()
        .expect("layer");
    assert_eq!(
        layer.scope_info().recover,
        Some("a closure given to IdempotencyLayerBuilder::recover"),
        "the registry says it has a hook"
    );
    let (base, calls, _task) = counting_route("/charges", layer, || {
        (StatusCode::CREATED, "charged by the handler").into_response()
    })
    .await;
    let account = fresh_tenant();
    // What a crashed instance leaves: a record in progress whose lease runs out.
    for key in ["k-charged", "k-not-charged", "k-down", "k-huge"] {
        let identity = Identity::new(account.clone(), "edges.recover", key).unwrap();
        common::records::acquire(
            &*store,
            &identity,
            None,
            Duration::from_millis(50),
            Duration::from_secs(3600),
        )
        .await;
    }
    let send = |key: &'static str| {
        reqwest::Client::new()
            .post(format!("{base}/charges"))
            .header("x-account-id", &account)
            .header("idempotency-key", key)
            .send()
    };
    let answer = |r: reqwest::Response| async move {
        let replayed = r.headers().contains_key("idempotent-replayed");
        (r.status().as_u16(), replayed, r.text().await.expect("body"))
    };

    // The retries wait (the layer's default) until the dead owner's lease ran out.
    let recovered = answer(send("k-charged").await.unwrap()).await;
    assert_eq!(
        recovered,
        (201, false, "charge found at the provider".to_owned())
    );
    let again = answer(send("k-charged").await.unwrap()).await;
    assert_eq!(
        again,
        (201, true, "charge found at the provider".to_owned())
    );

    let ran = answer(send("k-not-charged").await.unwrap()).await;
    assert_eq!(ran, (201, false, "charged by the handler".to_owned()));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only Run runs the handler");

    // Not recorded, so it says to send the request again.
    let refused = send("k-down").await.unwrap();
    assert_eq!(
        refused.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let refused = answer(refused).await;
    assert_eq!(refused, (503, false, "provider unreachable".to_owned()));
    gateway_down.store(false, Ordering::SeqCst);
    let asked_again = answer(send("k-down").await.unwrap()).await;
    assert_eq!(
        asked_again,
        (201, false, "found on the second ask".to_owned())
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // A found answer the layer cannot record: a 500 the client may retry
    // (not `response-not-recorded`, which it takes for final), and the
    // record stays for the next retry to ask again; the handler never runs.
    for _ in 0..2 {
        let r = send("k-huge").await.unwrap();
        assert_eq!(
            r.headers().get("retry-after").map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        let problem = expect_problem(r, 500, types::SERVER_ERROR).await;
        assert!(
            problem["detail"].as_str().unwrap().contains("asks again"),
            "{problem}"
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    assert_eq!(
        *asked.lock().unwrap(),
        [
            ("k-charged".to_owned(), 2),
            ("k-not-charged".to_owned(), 2),
            ("k-down".to_owned(), 2),
            ("k-down".to_owned(), 3),
            ("k-huge".to_owned(), 2),
            ("k-huge".to_owned(), 3),
        ],
        "asked once per takeover, never on a replay"
    );
}

/// A layer that records 5xx answers (`.record_server_errors(true)`) never
/// records the framework's own "retry later" answers a handler gives with
/// `?`: a store that could not be reached (503) or a lost lease (500) say the
/// request was not answered, and recorded they were replayed to every retry
/// for the record's ttl.
#[tokio::test]
async fn a_layer_recording_5xx_never_records_a_store_outage_or_a_lost_lease() {
    for (scope, error) in [
        (
            "edges.rec5xx_store",
            (|| {
                idempotent_runtime::Error::Store(idempotent_runtime::StoreError::new(
                    "postgres",
                    "reserve",
                    "connection refused",
                ))
            }) as fn() -> idempotent_runtime::Error,
        ),
        ("edges.rec5xx_lease", || {
            idempotent_runtime::Error::LeaseLost(idempotent_runtime::RecordContext {
                scope: "inner.call".into(),
                key_digest: "0".into(),
            })
        }),
    ] {
        let layer = IdempotencyLayer::builder(scope, MemoryStore::new())
            .tenant_from_extension::<AccountId>()
            .record_server_errors(true)
            .build()
            .expect("layer");
        let (base, calls, _task) =
            counting_route("/charges", layer, move || error().into_response()).await;
        let tenant = fresh_tenant();
        for attempt in 1..=2 {
            let r = reqwest::Client::new()
                .post(format!("{base}/charges"))
                .header("x-account-id", &tenant)
                .header("idempotency-key", "k")
                .send()
                .await
                .expect("request");
            assert!(r.status().is_server_error(), "{scope}");
            assert_eq!(r.headers()["retry-after"], "1", "{scope}");
            assert!(
                r.headers().get("idempotent-replayed").is_none(),
                "{scope}: attempt {attempt} was not a replay"
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2, "{scope}: the retry ran");
    }
}

/// A route behind a layer on `store` whose recover hook counts its calls and
/// answers `Completed(answer())`, and a crashed instance's record of key `k`
/// for a fresh account (its 1 ms lease run out by the store's clock). The
/// base URL, the handler's run count, the hook's call count and the account.
async fn recovering_route<S: idempotent_runtime::Store + 'static>(
    scope: &'static str,
    store: Arc<S>,
    answer: fn() -> axum::response::Response,
) -> (
    String,
    Arc<AtomicUsize>,
    Arc<AtomicUsize>,
    String,
    tokio::task::JoinHandle<()>,
) {
    use idempotent_runtime::{Identity, Recovery};
    let asked = Arc::new(AtomicUsize::new(0));
    let hook = {
        let asked = asked.clone();
        move |_: idempotent_runtime::Takeover| {
            let asked = asked.clone();
            async move {
                asked.fetch_add(1, Ordering::SeqCst);
                Ok(Recovery::Completed(answer()))
            }
        }
    };
    let layer = IdempotencyLayer::builder(scope, store.clone())
        .tenant_from_extension::<AccountId>()
        .recover(hook)
        .build()
        .expect("layer");
    let (base, calls, task) = counting_route("/charges", layer, || {
        (StatusCode::CREATED, "charged by the handler").into_response()
    })
    .await;
    let account = fresh_tenant();
    let identity = Identity::new(account.clone(), scope, "k").unwrap();
    common::records::acquire(
        &*store,
        &identity,
        None,
        Duration::from_millis(1),
        Duration::from_secs(3600),
    )
    .await;
    (base, calls, asked, account, task)
}

/// A recover hook that answers `Completed` with an answer the layer does not
/// record (here a 502, under the default rule) has not given the request's
/// answer: it is sent as "send it again" (`Retry-After: 1`, not a replay),
/// the handler does not run, and the record is kept, so the next retry
/// takes it over and asks the hook again. Running the handler instead would
/// charge a second time what the crashed instance may have charged.
#[tokio::test]
async fn a_recover_hooks_unrecorded_completed_answer_never_runs_the_handler() {
    let store = Arc::new(MemoryStore::new());
    let (base, calls, asked, account, _task) = recovering_route("edges.recover_5xx", store, || {
        (StatusCode::BAD_GATEWAY, "the provider could not say").into_response()
    })
    .await;
    for attempt in 1..=2 {
        let r = reqwest::Client::new()
            .post(format!("{base}/charges"))
            .header("x-account-id", &account)
            .header("idempotency-key", "k")
            .send()
            .await
            .expect("request");
        assert_eq!(r.status(), 502, "attempt {attempt}");
        assert_eq!(r.headers()["retry-after"], "1", "attempt {attempt}");
        assert!(r.headers().get("idempotent-replayed").is_none());
        assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never runs");
        assert_eq!(
            asked.load(Ordering::SeqCst),
            attempt,
            "asked on every takeover"
        );
    }
}

/// Completions fail at once (the detached completion the engine then hands
/// over does record).
struct CompletionsFail;

#[async_trait::async_trait]
impl common::hooked::Intercept for CompletionsFail {
    async fn complete(
        &self,
        _: &MemoryStore,
        _: idempotent_runtime::Completion<'_>,
    ) -> Result<idempotent_runtime::Fenced, idempotent_runtime::StoreError> {
        Err(idempotent_runtime::StoreError::new(
            "hooked",
            "complete",
            "connection reset",
        ))
    }
}

/// A recover hook's `Completed` answer whose recording fails is the request's
/// answer all the same: the client is told it was processed and to retry
/// with the same key (503 `answer-not-recorded-yet`), as after a handler's
/// run, never `store-unavailable` as if the store failed before anything
/// was decided; the retry replays the hook's answer, and the handler never runs.
#[tokio::test]
async fn a_recover_hooks_answer_whose_recording_fails_is_answer_not_recorded_yet() {
    let store = Arc::new(common::hooked::Hooked::new(CompletionsFail));
    let (base, calls, asked, account, _task) =
        recovering_route("edges.recover_unrecorded", store, || {
            (StatusCode::CREATED, "charge found at the provider").into_response()
        })
        .await;
    let send = || {
        reqwest::Client::new()
            .post(format!("{base}/charges"))
            .header("x-account-id", &account)
            .header("idempotency-key", "k")
            .send()
    };
    let r = send().await.expect("request");
    assert_eq!(r.headers()["retry-after"], "1");
    expect_problem(r, 503, types::ANSWER_NOT_RECORDED_YET).await;
    let retry = send().await.expect("request");
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().get("idempotent-replayed").is_some());
    assert_eq!(
        retry.text().await.expect("body"),
        "charge found at the provider"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never runs");
    assert_eq!(asked.load(Ordering::SeqCst), 1);
}

/// Rules 14 and 20 through the layer, on every store: on a layer with a
/// recover hook, a handler that panics after its side effect does not free
/// the key (a retry would run it again blind) nor leave it held for a lease
/// (the retry would be refused): its lease is ended, so the retry takes the
/// record over at once (`reject_in_progress`: no wait hides a live lease)
/// and asks the hook, which finds the side effect; the handler does not run
/// again, and the hook's answer is recorded and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_behind_a_hook_is_asked_about_not_run_again_on_every_store() {
    use idempotent_runtime::Recovery;
    for (name, store) in crate::http_retry_contract::every_store().await {
        let scope = "edges.recover_panic";
        // The side effects the handler made, by key: what the hook looks at.
        let made: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
        let asked: Arc<std::sync::Mutex<Vec<u32>>> = Arc::default();
        let hook = {
            let (made, asked) = (made.clone(), asked.clone());
            move |takeover: idempotent_runtime::Takeover| {
                let (made, asked) = (made.clone(), asked.clone());
                async move {
                    asked.lock().unwrap().push(takeover.attempt());
                    if made.lock().unwrap().iter().any(|k| k == takeover.key()) {
                        Ok(Recovery::Completed(
                            (StatusCode::CREATED, "found at the provider").into_response(),
                        ))
                    } else {
                        Ok(Recovery::Run)
                    }
                }
            }
        };
        let layer = IdempotencyLayer::builder(scope, store.clone())
            .tenant_from_extension::<AccountId>()
            .reject_in_progress()
            .recover(hook)
            .build()
            .expect("layer");
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = {
            let (made, runs) = (made.clone(), runs.clone());
            move |headers: axum::http::HeaderMap| {
                let (made, runs) = (made.clone(), runs.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                    made.lock().unwrap().push(key);
                    if runs.load(Ordering::SeqCst) == 1 {
                        panic!("the handler panics after its side effect");
                    }
                    (StatusCode::CREATED, "charged by the handler")
                }
            }
        };
        let app = Router::new()
            .route("/charges", post(handler))
            .route_layer(layer)
            .layer(middleware::from_fn(authenticate));
        let (base, task) = serve(app).await;
        let account = fresh_tenant();
        let send = || {
            reqwest::Client::new()
                .post(format!("{base}/charges"))
                .header("x-account-id", &account)
                .header("idempotency-key", "k")
                .send()
        };
        let first = send().await;
        assert!(
            first
                .as_ref()
                .map_or(true, |r| r.status().is_server_error()),
            "{name}: the panic is no answer: {first:?}"
        );
        let retry = send().await.expect("an answer");
        let answer = (
            retry.status().as_u16(),
            retry.headers().contains_key("idempotent-replayed"),
            retry.text().await.expect("body"),
        );
        assert_eq!(
            answer,
            (201, false, "found at the provider".to_owned()),
            "{name}: the retry took the record over at once and asked the hook"
        );
        let again = send().await.expect("an answer");
        assert!(
            again.headers().contains_key("idempotent-replayed"),
            "{name}"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{name}: the handler ran once"
        );
        assert_eq!(
            *asked.lock().unwrap(),
            [2],
            "{name}: asked once, as attempt 2"
        );
        task.abort();
    }
}

/// Rules 14 and 20 through the layer, on every store: a layer's recover
/// hook that panics (the takeover's attempt 2) takes its request down with
/// it, and the record is kept as for a handler that panics: not released (a
/// retry would run the handler blind) and not held for a lease. The next
/// retry takes it over as attempt 3 and asks the hook again, whose answer is
/// recorded and replayed; the handler ran once, before the first panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_recover_hook_is_asked_again_and_the_handler_not_run_on_every_store() {
    use idempotent_runtime::Recovery;
    for (name, store) in crate::http_retry_contract::every_store().await {
        let asked: Arc<std::sync::Mutex<Vec<u32>>> = Arc::default();
        let hook = {
            let asked = asked.clone();
            move |takeover: idempotent_runtime::Takeover| {
                let asked = asked.clone();
                async move {
                    asked.lock().unwrap().push(takeover.attempt());
                    if takeover.attempt() == 2 {
                        panic!("the provider's client panics while the hook asks it");
                    }
                    Ok(Recovery::Completed(
                        (StatusCode::CREATED, "found at the provider").into_response(),
                    ))
                }
            }
        };
        let layer = IdempotencyLayer::builder("edges.recover_hook_panic", store.clone())
            .tenant_from_extension::<AccountId>()
            .recover(hook)
            .build()
            .expect("layer");
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = {
            let runs = runs.clone();
            move || {
                let runs = runs.clone();
                async move {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        panic!("the handler panics after its side effect");
                    }
                    (StatusCode::CREATED, "charged by the handler")
                }
            }
        };
        let app = Router::new()
            .route("/charges", post(handler))
            .route_layer(layer)
            .layer(middleware::from_fn(authenticate));
        let (base, task) = serve(app).await;
        let account = fresh_tenant();
        let send = || {
            reqwest::Client::new()
                .post(format!("{base}/charges"))
                .header("x-account-id", &account)
                .header("idempotency-key", "k")
                .send()
        };
        for what in ["the handler's panic", "the hook's panic"] {
            let answer = send().await;
            assert!(
                answer
                    .as_ref()
                    .map_or(true, |r| r.status().is_server_error()),
                "{name}: {what} is no answer: {answer:?}"
            );
        }
        let retry = send().await.expect("an answer");
        let answer = (
            retry.status().as_u16(),
            retry.headers().contains_key("idempotent-replayed"),
            retry.text().await.expect("body"),
        );
        assert_eq!(
            answer,
            (201, false, "found at the provider".to_owned()),
            "{name}: the retry took the record over and asked the hook again"
        );
        let again = send().await.expect("an answer");
        assert!(
            again.headers().contains_key("idempotent-replayed"),
            "{name}"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{name}: the handler ran once"
        );
        assert_eq!(
            *asked.lock().unwrap(),
            [2, 3],
            "{name}: asked at each takeover"
        );
        task.abort();
    }
}

/// Rule 20 at the client (client hunt): a `recover` hook that cannot tell
/// yet whether the earlier attempt's side effect happened answers `Err`,
/// here with a 4xx of its choosing; the layer sends it with `Retry-After: 1`,
/// keeps the record and asks again at the next retry. The client returned
/// that 424 as final after one attempt: an operation whose outcome was
/// unknown reported as a refusal (a caller would charge again under a new
/// intent), while the retry got the charge the hook then found. Now a 4xx
/// with `Retry-After` is retried, and `send` ends with the hook's answer;
/// the handler never runs.
#[tokio::test]
async fn the_client_retries_a_recover_hooks_4xx_that_asks_to_come_back() {
    use idempotent_runtime::{Identity, Recovery};
    let store = Arc::new(MemoryStore::new());
    let asks = Arc::new(AtomicUsize::new(0));
    let hook = {
        let asks = asks.clone();
        move |_takeover: idempotent_runtime::Takeover| {
            let asks = asks.clone();
            async move {
                if asks.fetch_add(1, Ordering::SeqCst) == 0 {
                    Err(
                        (StatusCode::FAILED_DEPENDENCY, "the provider did not answer")
                            .into_response(),
                    )
                } else {
                    Ok(Recovery::Completed(
                        (StatusCode::CREATED, "charge found at the provider").into_response(),
                    ))
                }
            }
        }
    };
    let layer = IdempotencyLayer::builder("edges.hook_4xx", store.clone())
        .tenant_from_extension::<AccountId>()
        .recover(hook)
        .build()
        .expect("layer");
    let (base, calls, _task) = counting_route("/charges", layer, || {
        (StatusCode::CREATED, "charged by the handler").into_response()
    })
    .await;
    let account = fresh_tenant();
    // What a crashed instance leaves: a record in progress whose lease runs out.
    let identity = Identity::new(account.clone(), "edges.hook_4xx", "k-hook").unwrap();
    common::records::acquire(
        &*store,
        &identity,
        None,
        Duration::from_millis(50),
        Duration::from_secs(3600),
    )
    .await;
    let answer = fast_retrying_client(4)
        .intent_with_key(Method::POST, &format!("{base}/charges"), "k-hook")
        .unwrap()
        .header("x-account-id", &account)
        .unwrap()
        .send()
        .await
        .expect("an answer");
    assert_eq!(
        (answer.status().as_u16(), answer.body().as_ref()),
        (201, &b"charge found at the provider"[..]),
        "after {} attempt(s)",
        answer.attempts()
    );
    assert_eq!(answer.attempts(), 2, "the 424 was retried once");
    assert_eq!(asks.load(Ordering::SeqCst), 2, "the hook was asked again");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never ran");
}

/// Rule 20 at the client, for a `recover` hook's answer that is not recorded
/// (an `Err`, or a `Completed` answer marked `NotFinal`) and has a status
/// clients take for final: a 202 ("still checking"), a redirect to a status
/// page (which reqwest follows to its 200), a 408. Sent as it is, a client
/// would take it for the operation's answer after one attempt: a charge
/// whose outcome is unknown reported accepted (or done), and never asked
/// about again, while the retry gets the charge the hook then finds. Such
/// an answer is sent as a 503 problem, and the client comes back; the
/// handler never runs. On SQLite.
#[tokio::test]
async fn a_recover_hooks_unrecorded_answer_of_a_final_status_still_brings_the_client_back() {
    use axum::routing::get;
    use idempotent_runtime::http::problem::NotFinal;
    use idempotent_runtime::{Identity, Recovery};
    // The scope, the hook's first answer, and whether it is given as a
    // `Completed` answer marked `NotFinal` (else as `Err`).
    type FirstAnswer = (&'static str, fn() -> axum::response::Response, bool);
    let first_answers: [FirstAnswer; 4] = [
        (
            "edges.hook_err_202",
            || (StatusCode::ACCEPTED, "checking with the provider").into_response(),
            false,
        ),
        (
            "edges.hook_err_303",
            || axum::response::Redirect::to("/charges/status").into_response(),
            false,
        ),
        (
            "edges.hook_err_408",
            || (StatusCode::REQUEST_TIMEOUT, "the provider timed out").into_response(),
            false,
        ),
        (
            "edges.hook_not_final_202",
            || (StatusCode::ACCEPTED, "pending at the provider").into_response(),
            true,
        ),
    ];
    for (scope, first_answer, completed_not_final) in first_answers {
        let store = crate::http_app::sqlite_file_store().await;
        let asks = Arc::new(AtomicUsize::new(0));
        let hook = {
            let asks = asks.clone();
            move |_takeover: idempotent_runtime::Takeover| {
                let asks = asks.clone();
                async move {
                    if asks.fetch_add(1, Ordering::SeqCst) == 0 {
                        let mut answer = first_answer();
                        if !completed_not_final {
                            return Err(answer);
                        }
                        answer.extensions_mut().insert(NotFinal);
                        Ok(Recovery::Completed(answer))
                    } else {
                        Ok(Recovery::Completed(
                            (StatusCode::CREATED, "charge found at the provider").into_response(),
                        ))
                    }
                }
            }
        };
        let layer = IdempotencyLayer::builder(scope, store.clone())
            .tenant_from_extension::<AccountId>()
            .recover(hook)
            .build()
            .expect("layer");
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let app = Router::new()
            .route(
                "/charges",
                post(move || {
                    let counted = counted.clone();
                    async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        (StatusCode::CREATED, "charged by the handler")
                    }
                })
                .route_layer(layer),
            )
            .route(
                "/charges/status",
                get(|| async { (StatusCode::OK, "checking") }),
            )
            .layer(middleware::from_fn(authenticate));
        let (base, _task) = serve(app).await;
        let account = fresh_tenant();
        // What a crashed instance leaves: a record in progress whose lease runs out.
        let identity = Identity::new(account.clone(), scope, "k-hook").unwrap();
        common::records::acquire(
            &*store,
            &identity,
            None,
            Duration::from_millis(50),
            Duration::from_secs(3600),
        )
        .await;
        let answer = fast_retrying_client(4)
            .intent_with_key(Method::POST, &format!("{base}/charges"), "k-hook")
            .unwrap()
            .header("x-account-id", &account)
            .unwrap()
            .send()
            .await
            .expect("an answer");
        assert_eq!(
            (answer.status().as_u16(), answer.body().as_ref()),
            (201, &b"charge found at the provider"[..]),
            "{scope}: after {} attempt(s)",
            answer.attempts()
        );
        assert_eq!(
            answer.attempts(),
            2,
            "{scope}: the hook's first answer was retried once"
        );
        assert_eq!(
            asks.load(Ordering::SeqCst),
            2,
            "{scope}: the hook was asked again"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            0,
            "{scope}: the handler never ran"
        );
    }
}
