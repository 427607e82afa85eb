//! `IdempotencyLayer` over real HTTP on loopback (DESIGN.md rule 22): every
//! case with its status, headers and problem+json body; 50 concurrent
//! duplicates; tenant isolation; the extractor and `IntoResponse`.

use crate::common;
use crate::http_app;

use common::hooked::{Hooked, Intercept};
use common::servers::{fresh_tenant, pg_store_or_skip};
use http_app::{bounded, expect_problem, Charge, TestServer};
use idempotent_runtime::http::problem::types;
use idempotent_runtime::store::{
    OwnerToken, RecordSnapshot, Reservation, ReserveRequest, ScopeStats,
};
use idempotent_runtime::{Completion, Fenced, Identity, MemoryStore, Store, StoreError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const BODY: &str = r#"{"amount_cents":450,"currency":"EUR"}"#;

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .expect("client")
}

async fn post(
    server: &TestServer,
    path: &str,
    account: Option<&str>,
    key: Option<&str>,
    body: &str,
) -> reqwest::Response {
    let mut request = client()
        .post(server.url(path))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(account) = account {
        request = request.header("x-account-id", account);
    }
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.send().await.expect("request")
}

async fn json(response: reqwest::Response) -> serde_json::Value {
    serde_json::from_slice(&response.bytes().await.expect("body")).expect("JSON body")
}

fn memory() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new())
}

/// Memory, a SQLite file and PostgreSQL (when reachable).
async fn every_store() -> Vec<(&'static str, Arc<dyn Store>)> {
    let mut stores = vec![
        ("memory", memory()),
        ("sqlite", http_app::sqlite_file_store().await),
    ];
    if let Some(pg) = pg_store_or_skip().await {
        stores.push(("postgres", Arc::new(pg)));
    }
    stores
}

fn replayed(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

// ---------------------------------------------------------------- keys

#[tokio::test]
async fn missing_key_is_400_with_a_problem_and_nothing_runs() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let r = post(&server, "/payments", Some(&a), None, BODY).await;
    let p = expect_problem(r, 400, types::MISSING_KEY).await;
    assert!(p["detail"].as_str().unwrap().contains("Idempotency-Key"));
    assert_eq!(server.shop.gateway.calls(), 0);
}

#[tokio::test]
async fn malformed_and_invalid_keys_are_400() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let long = "k".repeat(256);
    for bad in [
        r#""unterminated"#,
        "two words",
        r#""a";p=1"#,
        r#""""#,
        long.as_str(),
        "a,b",
    ] {
        let r = post(&server, "/payments", Some(&a), Some(bad), BODY).await;
        let p = expect_problem(r, 400, types::INVALID_KEY).await;
        assert!(
            !p["detail"].as_str().unwrap().contains(&long),
            "the raw key is not echoed"
        );
    }
    // The header twice.
    let r = client()
        .post(server.url("/payments"))
        .header("x-account-id", &a)
        .header("content-type", "application/json")
        .header("idempotency-key", "one")
        .header("idempotency-key", "two")
        .body(BODY)
        .send()
        .await
        .expect("request");
    let p = expect_problem(r, 400, types::INVALID_KEY).await;
    assert!(p["detail"].as_str().unwrap().contains("exactly once"));
    assert_eq!(server.shop.gateway.calls(), 0);
}

#[tokio::test]
async fn a_bare_key_and_the_same_key_quoted_are_one_key() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let first = post(&server, "/payments", Some(&a), Some("key-1"), BODY).await;
    assert_eq!(first.status(), 201);
    let quoted = post(&server, "/payments", Some(&a), Some(r#""key-1""#), BODY).await;
    assert_eq!(quoted.status(), 201);
    assert!(replayed(&quoted));
    assert_eq!(server.shop.gateway.calls(), 1);
}

// ---------------------------------------------------------------- record and replay

#[tokio::test]
async fn a_retry_replays_status_body_and_allow_listed_headers() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let first = post(&server, "/payments", Some(&a), Some("k1"), BODY).await;
    assert_eq!(first.status(), 201);
    assert!(!replayed(&first));
    assert_eq!(first.headers()["x-live-only"], "first answer");
    let location = first.headers()["location"].clone();
    let content_type = first.headers()["content-type"].clone();
    let body = first.bytes().await.unwrap();
    let charge: Charge = serde_json::from_slice(&body).unwrap();
    assert_eq!(location, format!("/payments/{}", charge.charge_id).as_str());

    let retry = post(&server, "/payments", Some(&a), Some("k1"), BODY).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.headers()["location"], location);
    assert_eq!(retry.headers()["content-type"], content_type);
    assert!(
        retry.headers().get("x-live-only").is_none(),
        "only allow-listed headers are recorded"
    );
    assert_eq!(retry.bytes().await.unwrap(), body);
    assert_eq!(server.shop.gateway.calls(), 1);
    assert_eq!(server.shop.charges_of(&a).len(), 1);
}

#[tokio::test]
async fn same_key_with_a_different_amount_is_422_and_the_record_is_untouched() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let first = json(post(&server, "/payments", Some(&a), Some("k1"), BODY).await).await;
    let other = r#"{"amount_cents":50000,"currency":"EUR"}"#;
    let r = post(&server, "/payments", Some(&a), Some("k1"), other).await;
    let p = expect_problem(r, 422, types::KEY_REUSED).await;
    assert!(p["detail"].as_str().unwrap().contains("new key"));
    // Another route with the same key is another request too.
    let r = post(&server, "/status/201", Some(&a), Some("k1"), BODY).await;
    expect_problem(r, 422, types::KEY_REUSED).await;
    // The original still replays.
    let retry = post(&server, "/payments", Some(&a), Some("k1"), BODY).await;
    assert!(replayed(&retry));
    assert_eq!(json(retry).await, first);
    assert_eq!(server.shop.gateway.calls(), 1);
}

/// Rule 22: the same key, route and bytes under another media type is
/// another request (a `…charge+json` and a `…refund+json` command, or text
/// and binary): refused, not answered with the first one's recorded answer.
#[tokio::test]
async fn same_key_and_bytes_under_another_media_type_is_422() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let send = |content_type: &'static str, key: &'static str| {
        let (url, a) = (server.url("/status/201"), a.clone());
        async move {
            client()
                .post(url)
                .header("content-type", content_type)
                .header("x-account-id", a)
                .header("idempotency-key", key)
                .body(BODY)
                .send()
                .await
                .expect("request")
        }
    };
    for (first, other) in [
        (
            "application/vnd.acme.charge+json",
            "application/vnd.acme.refund+json",
        ),
        ("text/plain", "application/octet-stream"),
        ("application/json", "application/merge-patch+json"),
    ] {
        let key: &'static str = Box::leak(format!("k-{first}").into_boxed_str());
        assert_eq!(send(first, key).await.status(), 201, "{first}");
        let again = send(first, key).await;
        assert!(replayed(&again), "{first}: a retry is replayed");
        expect_problem(send(other, key).await, 422, types::KEY_REUSED).await;
    }
}

/// A request recorded before the media type counted (`http1`) still answers
/// its retries after the upgrade: the `http2` fingerprint carries the
/// `http1` form as its legacy one. (Such an old record compares as `http1`
/// did, so it also answers the same bytes under another media type, until
/// it expires.) The old record is made by rewriting a new one's fingerprint
/// to its `http1` form, in the store's own database.
#[tokio::test]
async fn a_request_recorded_as_http1_is_replayed_to_its_retries() {
    use idempotent_runtime::http::request_fingerprint;
    let store = http_app::sqlite_file().await;
    let pool = store.pool().clone();
    let server = TestServer::start(Arc::new(store), |b| b).await;
    let a = fresh_tenant();
    let send = |content_type: &'static str| {
        let (url, a) = (server.url("/status/201"), a.clone());
        async move {
            client()
                .post(url)
                .header("content-type", content_type)
                .header("x-account-id", a)
                .header("idempotency-key", "k-old")
                .body("x")
                .send()
                .await
                .expect("request")
        }
    };
    assert_eq!(send("text/plain").await.status(), 201);
    let mut headers = axum::http::HeaderMap::new();
    headers.insert("content-type", "text/plain".parse().unwrap());
    let current = request_fingerprint(&axum::http::Method::POST, "/status/201", &headers, b"x");
    let old = current.legacy().expect("an http1 form");
    let rewritten =
        sqlx::query("UPDATE idempotency_records SET fingerprint = ? WHERE fingerprint = ?")
            .bind(old.as_str())
            .bind(current.as_str())
            .execute(&pool)
            .await
            .expect("make the record an http1 one")
            .rows_affected();
    assert_eq!(rewritten, 1, "the layer stored the http2 fingerprint");
    let retry = send("text/plain").await;
    assert_eq!(retry.status(), 201);
    assert!(replayed(&retry), "the old record answers its retry");
    assert_eq!(server.shop.status_calls.load(Ordering::SeqCst), 1);
}

/// A request a newer version of the server recorded, with a fingerprint
/// form this one does not know (`http9:`, made here by rewriting the stored
/// one), is not refused as a reused key (a client takes a 422 as final):
/// this instance answers 503 with `Retry-After: 1`, runs nothing and leaves
/// the record as it is, so a retry that reaches the newer version replays it.
#[tokio::test]
async fn a_request_a_newer_version_recorded_is_answered_retry_later_not_key_reused() {
    let store = http_app::sqlite_file().await;
    let pool = store.pool().clone();
    let server = TestServer::start(Arc::new(store), |b| b).await;
    let a = fresh_tenant();
    let send = || {
        client()
            .post(server.url("/status/201"))
            .header("content-type", "text/plain")
            .header("x-account-id", &a)
            .header("idempotency-key", "k-newer")
            .body("x")
            .send()
    };
    assert_eq!(send().await.expect("request").status(), 201);
    let newer = format!("http9:{}", "ab".repeat(32));
    let rewritten = sqlx::query(
        "UPDATE idempotency_records SET fingerprint = ? WHERE fingerprint LIKE 'http2:%'",
    )
    .bind(&newer)
    .execute(&pool)
    .await
    .expect("make the record a newer version's")
    .rows_affected();
    assert_eq!(rewritten, 1, "the layer stored one http2 fingerprint");
    let retry = send().await.expect("request");
    assert_eq!(retry.headers()["retry-after"], "1");
    expect_problem(retry, 503, types::RECORDED_BY_NEWER_VERSION).await;
    assert_eq!(
        server.shop.status_calls.load(Ordering::SeqCst),
        1,
        "nothing ran again"
    );
    let stored: (String, String) =
        sqlx::query_as("SELECT fingerprint, state FROM idempotency_records")
            .fetch_one(&pool)
            .await
            .expect("the record");
    assert_eq!(
        stored,
        (newer, "complete".to_owned()),
        "the record is untouched"
    );
}

#[tokio::test]
async fn json_bodies_differing_only_in_key_order_or_whitespace_are_one_request() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let first = json(post(&server, "/payments", Some(&a), Some("k1"), BODY).await).await;
    for same in [
        "{ \"currency\" : \"EUR\",\n  \"amount_cents\" : 450 }",
        "\t{\"currency\":\"EUR\",\"amount_cents\":450.0}\r\n",
        r#"{"amount_cents":4.5e2,"currency":"\u0045UR"}"#,
    ] {
        let r = post(&server, "/payments", Some(&a), Some("k1"), same).await;
        assert_eq!(r.status(), 201, "{same}");
        assert!(replayed(&r), "{same}");
        assert_eq!(json(r).await, first);
    }
    let changed = r#"{"currency":"EUR","amount_cents":451}"#;
    let r = post(&server, "/payments", Some(&a), Some("k1"), changed).await;
    expect_problem(r, 422, types::KEY_REUSED).await;
    assert_eq!(server.shop.gateway.calls(), 1);
}

#[tokio::test]
async fn other_bodies_are_fingerprinted_as_raw_bytes() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let send = |body: &'static str| {
        client()
            .post(server.url("/status/201"))
            .header("x-account-id", &a)
            .header("idempotency-key", "raw")
            .header("content-type", "text/plain")
            .body(body)
            .send()
    };
    assert_eq!(send("a b").await.unwrap().status(), 201);
    assert!(replayed(&send("a b").await.unwrap()));
    expect_problem(send("a  b").await.unwrap(), 422, types::KEY_REUSED).await;
}

// ---------------------------------------------------------------- the client hangs up

/// A client that hangs up while its request runs (its own timeout, a proxy's)
/// does not stop the handler: it runs to its end and its answer is recorded,
/// so the client's retry with the same key replays it. Were the handler
/// dropped with the connection, the key would be released and the retry
/// would run the charge a second time. On every store.
#[tokio::test]
async fn a_client_that_hangs_up_mid_request_gets_the_answer_on_its_retry_not_a_second_run() {
    for (name, store) in every_store().await {
        let server = TestServer::start(store, |b| b).await;
        let a = fresh_tenant();
        server.shop.gateway.hold();
        let first = {
            let (url, a) = (server.url("/payments"), a.clone());
            tokio::spawn(async move {
                client()
                    .post(url)
                    .header("x-account-id", a)
                    .header("idempotency-key", "k")
                    .header("content-type", "application/json")
                    .body(BODY)
                    .send()
                    .await
            })
        };
        server.shop.gateway.wait_entered(1).await;
        // The client hangs up; the server sees the connection end.
        first.abort();
        let _ = first.await;
        server.wait_ended(1).await;
        server.shop.gateway.release();
        let retry = post(&server, "/payments", Some(&a), Some("k"), BODY).await;
        assert_eq!(retry.status(), 201, "{name}");
        assert!(
            replayed(&retry),
            "{name}: the retry replays the first run's answer"
        );
        assert_eq!(server.shop.gateway.calls(), 1, "{name}: charged once");
        assert_eq!(server.shop.charges_of(&a).len(), 1, "{name}");
    }
}

/// The idempotent handling runs in a task of its own, and still under the
/// request's span: a handler's logs keep the request's trace (a request id
/// from `TraceLayer`, an OpenTelemetry context).
#[tokio::test]
async fn the_handling_stays_under_the_requests_span() {
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::registry::LookupSpan;

    /// Records each `idempotent_call` span's parent's name.
    struct Parents(Arc<std::sync::Mutex<Vec<Option<String>>>>);
    impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Parents {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            id: &tracing::span::Id,
            cx: Context<'_, S>,
        ) {
            if attrs.metadata().name() != "idempotent_call" {
                return;
            }
            let parent = cx
                .span(id)
                .and_then(|span| span.parent().map(|p| p.name().to_owned()));
            self.0.lock().unwrap().push(parent);
        }
    }

    let parents = Arc::new(std::sync::Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Parents(parents.clone()));
    // The test's runtime has one thread: the server's tasks run on it.
    let _default = tracing::subscriber::set_default(subscriber);
    let app = axum::Router::new()
        .route("/charges", axum::routing::post(|| async { "charged" }))
        .route_layer(
            idempotent_runtime::http::IdempotencyLayer::builder("test.spans", memory())
                .tenant_from(|_| Some("t".to_owned()))
                .build()
                .expect("layer"),
        )
        .layer(axum::middleware::from_fn(
            |request: axum::extract::Request, next: axum::middleware::Next| {
                let span = tracing::info_span!("http_request");
                tracing::Instrument::instrument(next.run(request), span)
            },
        ));
    let (base, task) = http_app::serve(app).await;
    let r = client()
        .post(format!("{base}/charges"))
        .header("idempotency-key", "k")
        .body("{}")
        .send()
        .await
        .expect("answer");
    assert_eq!(r.status(), 200);
    task.abort();
    assert_eq!(
        *parents.lock().unwrap(),
        [Some("http_request".to_owned())],
        "the call's span is the request's child"
    );
}

/// Rule 14 through the layer: a handler that panics releases its key and
/// the panic propagates (the connection ends without an answer), also now
/// that the handling runs in a task of its own; the retry runs the handler
/// again.
#[tokio::test]
async fn a_handler_that_panics_releases_the_key_and_the_panic_propagates() {
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move || async move {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("the first call panics");
            }
            "charged"
        }
    };
    let app = axum::Router::new()
        .route("/charges", axum::routing::post(handler))
        .route_layer(
            idempotent_runtime::http::IdempotencyLayer::builder("test.panics", memory())
                .tenant_from(|_| Some("t".to_owned()))
                .build()
                .expect("layer"),
        );
    let (base, task) = http_app::serve(app).await;
    let send = || {
        client()
            .post(format!("{base}/charges"))
            .header("idempotency-key", "k")
            .body("{}")
            .send()
    };
    let first = bounded("the panicking request", send()).await;
    assert!(
        first
            .as_ref()
            .map_or(true, |r| r.status().is_server_error()),
        "the panic reached the server, not an answer: {first:?}"
    );
    let retry = bounded("the retry", send()).await.expect("an answer");
    assert_eq!(retry.status(), 200);
    assert!(!replayed(&retry), "the key was released: the retry ran");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    task.abort();
}

// ---------------------------------------------------------------- in progress

#[tokio::test]
async fn still_running_after_the_wait_bound_is_409_with_retry_after() {
    let server = TestServer::start(memory(), |b| b.wait(Duration::from_millis(20))).await;
    let a = fresh_tenant();
    server.shop.gateway.hold();
    let first = tokio::spawn({
        let (url, a) = (server.url("/payments"), a.clone());
        async move {
            client()
                .post(url)
                .header("x-account-id", a)
                .header("idempotency-key", "slow")
                .header("content-type", "application/json")
                .body(BODY)
                .send()
                .await
                .expect("first request")
        }
    });
    server.shop.gateway.wait_entered(1).await;
    let r = post(&server, "/payments", Some(&a), Some("slow"), BODY).await;
    let retry_after: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry_after), "Retry-After {retry_after}");
    let p = expect_problem(r, 409, types::IN_PROGRESS).await;
    assert_eq!(p["retry_after"], retry_after);

    server.shop.gateway.release();
    let first = bounded("the first request", first).await.unwrap();
    assert_eq!(first.status(), 201);
    let first = json(first).await;
    let retry = post(&server, "/payments", Some(&a), Some("slow"), BODY).await;
    assert!(replayed(&retry));
    assert_eq!(json(retry).await, first);
    assert_eq!(server.shop.gateway.calls(), 1);
}

#[tokio::test]
async fn retry_after_is_whole_seconds_and_at_least_one() {
    let server = TestServer::start(memory(), |b| {
        b.reject_in_progress().lease(Duration::from_millis(600))
    })
    .await;
    let a = fresh_tenant();
    server.shop.gateway.hold();
    let first = tokio::spawn({
        let (url, a) = (server.url("/payments"), a.clone());
        async move {
            client()
                .post(url)
                .header("x-account-id", a)
                .header("idempotency-key", "short-lease")
                .header("content-type", "application/json")
                .body(BODY)
                .send()
                .await
                .expect("first request")
        }
    });
    server.shop.gateway.wait_entered(1).await;
    let r = post(&server, "/payments", Some(&a), Some("short-lease"), BODY).await;
    assert_eq!(r.headers()["retry-after"], "1");
    expect_problem(r, 409, types::IN_PROGRESS).await;
    server.shop.gateway.release();
    assert_eq!(
        bounded("the first request", first).await.unwrap().status(),
        201
    );
}

// ---------------------------------------------------------------- statuses

#[tokio::test]
async fn handler_4xx_is_recorded_and_5xx_releases_the_key() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let first = post(&server, "/status/404", Some(&a), Some("k404"), "{}").await;
    assert_eq!(first.status(), 404);
    let first = json(first).await;
    let again = post(&server, "/status/404", Some(&a), Some("k404"), "{}").await;
    assert_eq!(again.status(), 404);
    assert!(replayed(&again));
    assert_eq!(json(again).await, first);

    let before = server.shop.status_calls.load(Ordering::SeqCst);
    let r = post(&server, "/status/503", Some(&a), Some("k503"), "{}").await;
    assert_eq!(r.status(), 503);
    assert!(!replayed(&r));
    let r = post(&server, "/status/503", Some(&a), Some("k503"), "{}").await;
    assert_eq!(r.status(), 503);
    assert!(
        !replayed(&r),
        "a 5xx released the key: the retry ran the handler again"
    );
    assert_eq!(server.shop.status_calls.load(Ordering::SeqCst), before + 2);

    // 408, 423, 425 and 429 say "not processed, try again", and a 401
    // "authenticate, then try again": never recorded by the default rule, or
    // every retry would get them for the ttl.
    for code in ["401", "408", "423", "425", "429"] {
        let path = format!("/status/{code}");
        post(&server, &path, Some(&a), Some(code), "{}").await;
        let r = post(&server, &path, Some(&a), Some(code), "{}").await;
        assert!(!replayed(&r), "{code} is not recorded");
    }
}

/// A 1xx answer (101 Switching Protocols) hands the connection over: there
/// is nothing a replay could give again, so it is never recorded, whatever
/// the rule (it was, like a 2xx).
#[tokio::test]
async fn an_informational_answer_is_never_recorded() {
    let server = TestServer::start(memory(), |b| b.record_when(|_| true)).await;
    let a = fresh_tenant();
    let before = server.shop.status_calls.load(Ordering::SeqCst);
    for _ in 0..2 {
        let r = post(&server, "/status/101", Some(&a), Some("k101"), "{}").await;
        assert!(!replayed(&r));
    }
    assert_eq!(
        server.shop.status_calls.load(Ordering::SeqCst),
        before + 2,
        "the retry ran the handler again"
    );
}

#[tokio::test]
async fn which_statuses_are_recorded_is_configurable() {
    let server = TestServer::start(memory(), |b| {
        b.record_server_errors(true).record_client_errors(false)
    })
    .await;
    let a = fresh_tenant();
    post(&server, "/status/500", Some(&a), Some("k500"), "{}").await;
    let r = post(&server, "/status/500", Some(&a), Some("k500"), "{}").await;
    assert_eq!(r.status(), 500);
    assert!(replayed(&r), "5xx recorded when asked");
    post(&server, "/status/400", Some(&a), Some("k400"), "{}").await;
    let r = post(&server, "/status/400", Some(&a), Some("k400"), "{}").await;
    assert!(!replayed(&r), "4xx released when asked");

    let custom = TestServer::start(memory(), |b| b.record_when(|s| s.as_u16() == 202)).await;
    post(&custom, "/status/201", Some(&a), Some("c"), "{}").await;
    assert!(!replayed(
        &post(&custom, "/status/201", Some(&a), Some("c"), "{}").await
    ));
    post(&custom, "/status/202", Some(&a), Some("d"), "{}").await;
    assert!(replayed(
        &post(&custom, "/status/202", Some(&a), Some("d"), "{}").await
    ));
}

// ---------------------------------------------------------------- pass-through

#[tokio::test]
async fn safe_methods_pass_through() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let charge: Charge = serde_json::from_value(
        json(post(&server, "/payments", Some(&a), Some("k1"), BODY).await).await,
    )
    .unwrap();
    let url = server.url(&format!("/payments/{}", charge.charge_id));
    for _ in 0..2 {
        // No key needed, and a key does not make a GET replay.
        let r = client()
            .get(&url)
            .header("x-account-id", &a)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let r = client()
            .get(&url)
            .header("x-account-id", &a)
            .header("idempotency-key", "k1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(!replayed(&r));
        assert_eq!(
            serde_json::from_value::<Charge>(json(r).await).unwrap(),
            charge
        );
    }
    let head = client()
        .head(&url)
        .header("x-account-id", &a)
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    // Another account cannot read it.
    let r = client()
        .get(&url)
        .header("x-account-id", fresh_tenant())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn a_route_with_an_optional_key_passes_requests_without_one_through() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    for _ in 0..2 {
        let r = post(&server, "/notes", Some(&a), None, "{}").await;
        assert_eq!(r.status(), 201);
        assert!(!replayed(&r));
    }
    assert_eq!(server.shop.notes_calls.load(Ordering::SeqCst), 2);
    post(&server, "/notes", Some(&a), Some("n1"), "{}").await;
    assert!(replayed(
        &post(&server, "/notes", Some(&a), Some("n1"), "{}").await
    ));
    assert_eq!(server.shop.notes_calls.load(Ordering::SeqCst), 3);
    // A malformed key is refused even where keys are optional.
    let r = post(&server, "/notes", Some(&a), Some(r#""open"#), "{}").await;
    expect_problem(r, 400, types::INVALID_KEY).await;
}

// ---------------------------------------------------------------- tenant

#[tokio::test]
async fn a_request_without_a_tenant_is_refused_with_401() {
    let server = TestServer::start(memory(), |b| b).await;
    let r = post(&server, "/payments", None, Some("k1"), BODY).await;
    let p = expect_problem(r, 401, types::MISSING_TENANT).await;
    assert!(p["detail"].as_str().unwrap().contains("Authenticate"));
    let r = post(
        &server,
        "/payments",
        Some(&"a".repeat(300)),
        Some("k1"),
        BODY,
    )
    .await;
    expect_problem(r, 400, types::INVALID_TENANT).await;
    // A principal that displays as nothing (an anonymous caller) is refused
    // too, never served from the namespace of `tenant = shared`, which is
    // the empty tenant: two such callers would share every key.
    for _ in 0..2 {
        let r = post(&server, "/payments", Some(""), Some("k1"), BODY).await;
        expect_problem(r, 400, types::INVALID_TENANT).await;
    }
    assert_eq!(server.shop.gateway.calls(), 0);
}

#[tokio::test]
async fn the_same_key_from_two_accounts_is_two_charges_on_every_store() {
    for (name, store) in every_store().await {
        let server = TestServer::start(store, |b| b).await;
        let (a, b) = (fresh_tenant(), fresh_tenant());
        let ra = post(&server, "/payments", Some(&a), Some("order-1"), BODY).await;
        let a_location = ra.headers()["location"].clone();
        let a_body = ra.bytes().await.unwrap();
        let rb = post(&server, "/payments", Some(&b), Some("order-1"), BODY).await;
        assert_eq!(rb.status(), 201, "{name}");
        assert!(
            !replayed(&rb),
            "{name}: B's request ran, it is not A's replay"
        );
        assert_ne!(rb.headers()["location"], a_location, "{name}");
        let b_body = rb.bytes().await.unwrap();
        assert_ne!(b_body, a_body, "{name}");
        let (ca, cb): (Charge, Charge) = (
            serde_json::from_slice(&a_body).unwrap(),
            serde_json::from_slice(&b_body).unwrap(),
        );
        assert_eq!(
            (ca.account.as_str(), cb.account.as_str()),
            (a.as_str(), b.as_str())
        );
        // Each account's retry replays its own answer, never the other's.
        for (account, body, location) in [
            (&a, &a_body, &a_location),
            (
                &b,
                &b_body,
                &format!("/payments/{}", cb.charge_id).parse().unwrap(),
            ),
        ] {
            let r = post(&server, "/payments", Some(account), Some("order-1"), BODY).await;
            assert!(replayed(&r), "{name}");
            assert_eq!(&r.headers()["location"], location, "{name}");
            assert_eq!(&r.bytes().await.unwrap(), body, "{name}");
        }
        // B with the key and a different amount: a mismatch against B's record only.
        let other = r#"{"amount_cents":1,"currency":"EUR"}"#;
        expect_problem(
            post(&server, "/payments", Some(&b), Some("order-1"), other).await,
            422,
            types::KEY_REUSED,
        )
        .await;
        assert_eq!(server.shop.charges_of(&a).len(), 1, "{name}");
        assert_eq!(server.shop.charges_of(&b).len(), 1, "{name}");
        assert_eq!(server.shop.gateway.calls(), 2, "{name}");
    }
}

// ---------------------------------------------------------------- the seeds' scenario

#[tokio::test]
async fn fifty_concurrent_identical_posts_make_one_charge_on_every_store() {
    const N: usize = 50;
    for (name, store) in every_store().await {
        // The wait bound only has to outlast the test's own handshakes.
        let server = TestServer::start(store, |b| b.wait(Duration::from_secs(120))).await;
        let a = fresh_tenant();
        server.shop.gateway.hold();
        let http = client();
        let mut tasks = Vec::new();
        for _ in 0..N {
            let request = http
                .post(server.url("/payments"))
                .header("x-account-id", &a)
                .header("idempotency-key", "checkout-42")
                .header("content-type", "application/json")
                .body(BODY);
            tasks.push(tokio::spawn(async move {
                let r = request.send().await.expect("request");
                let replayed = replayed(&r);
                let status = r.status().as_u16();
                let location = r.headers().get("location").cloned();
                (status, replayed, location, r.bytes().await.expect("body"))
            }));
        }
        // Every request reached the server and one is at the gateway: let it charge.
        server.wait_arrivals(N).await;
        server.shop.gateway.wait_entered(1).await;
        server.shop.gateway.release();
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(bounded("an answer", t).await.expect("task"));
        }
        assert_eq!(server.shop.gateway.calls(), 1, "{name}: one gateway call");
        assert_eq!(
            server.shop.charges_of(&a).len(),
            1,
            "{name}: one charge row"
        );
        let (status, _, location, body) = answers[0].clone();
        for (s, _, l, b) in &answers {
            assert_eq!(
                (*s, l, b),
                (status, &location, &body),
                "{name}: all answers alike"
            );
        }
        assert_eq!(status, 201, "{name}");
        let executed = answers.iter().filter(|(_, r, ..)| !r).count();
        assert_eq!(executed, 1, "{name}: one executed, {} replayed", N - 1);
    }
}

// ---------------------------------------------------------------- body cap

#[tokio::test]
async fn a_body_over_the_cap_is_413_with_or_without_a_content_length() {
    let server = TestServer::start(memory(), |b| b.max_body_bytes(1024)).await;
    let a = fresh_tenant();
    let big = format!(
        r#"{{"amount_cents":1,"currency":"EUR","pad":"{}"}}"#,
        "x".repeat(2000)
    );
    let r = post(&server, "/payments", Some(&a), Some("big"), &big).await;
    let p = expect_problem(r, 413, types::BODY_TOO_LARGE).await;
    assert!(p["detail"].as_str().unwrap().contains("1024"));

    // Chunked, no Content-Length: written by hand on a raw connection.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let head = format!(
        "POST /payments HTTP/1.1\r\nhost: x\r\nx-account-id: {a}\r\nidempotency-key: chunked\r\n\
         content-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    for _ in 0..3 {
        let chunk = "y".repeat(600);
        conn.write_all(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes())
            .await
            .unwrap();
    }
    conn.write_all(b"0\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    bounded("the 413 answer", conn.read_to_end(&mut answer))
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert_eq!(server.shop.gateway.calls(), 0);
    // Under the cap is fine.
    assert_eq!(
        post(&server, "/payments", Some(&a), Some("small"), BODY)
            .await
            .status(),
        201
    );
}

/// The cap is the largest body accepted: a body of exactly that many bytes
/// is processed (its retry replayed), one byte more is refused.
#[tokio::test]
async fn a_body_of_exactly_the_cap_is_accepted() {
    let server = TestServer::start(memory(), |b| b.max_body_bytes(BODY.len())).await;
    let a = fresh_tenant();
    let r = post(&server, "/payments", Some(&a), Some("at-cap"), BODY).await;
    assert_eq!(r.status(), 201);
    assert!(replayed(
        &post(&server, "/payments", Some(&a), Some("at-cap"), BODY).await
    ));
    let over = format!("{BODY} ");
    let r = post(&server, "/payments", Some(&a), Some("over"), &over).await;
    expect_problem(r, 413, types::BODY_TOO_LARGE).await;
    assert_eq!(server.shop.gateway.calls(), 1);
}

// ---------------------------------------------------------------- store

/// A store that is down: every operation fails.
struct DownStore;

fn down(operation: &'static str) -> StoreError {
    StoreError::new("down", operation, "connection refused")
}

#[async_trait::async_trait]
impl Store for DownStore {
    fn name(&self) -> &'static str {
        "down"
    }
    async fn force_release(
        &self,
        _: &Identity,
        _: bool,
    ) -> Result<idempotent_runtime::ForcedRelease, StoreError> {
        Err(down("release"))
    }
    async fn reserve(&self, _: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        Err(down("reserve"))
    }
    async fn complete(&self, _: Completion<'_>) -> Result<Fenced, StoreError> {
        Err(down("complete"))
    }
    async fn release(&self, _: &Identity, _: &OwnerToken) -> Result<Fenced, StoreError> {
        Err(down("release"))
    }
    async fn heartbeat(
        &self,
        _: &Identity,
        _: &OwnerToken,
        _: Duration,
    ) -> Result<Fenced, StoreError> {
        Err(down("heartbeat"))
    }
    fn release_detached(&self, _: Identity, _: OwnerToken) {}
    fn complete_detached(&self, _: Completion<'_>) {}
    async fn purge_expired(&self, _: u32) -> Result<u64, StoreError> {
        Err(down("purge"))
    }
    async fn fetch(&self, _: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        Err(down("fetch"))
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        Err(down("stats"))
    }
}

#[tokio::test]
async fn a_store_that_is_down_is_503_and_nothing_runs() {
    let server = TestServer::start(Arc::new(DownStore), |b| b).await;
    let r = post(&server, "/payments", Some(&fresh_tenant()), Some("k"), BODY).await;
    let p = expect_problem(r, 503, types::STORE_UNAVAILABLE).await;
    assert!(
        !p["detail"].as_str().unwrap().contains("connection refused"),
        "internals stay in the logs"
    );
    assert_eq!(server.shop.gateway.calls(), 0);
}

/// A store whose completions fail while it answers everything else: the
/// handler runs, then its answer cannot be recorded at once (the detached
/// completion the engine hands over does record it).
struct CompletionsFail;

#[async_trait::async_trait]
impl Intercept for CompletionsFail {
    async fn complete(&self, _: &MemoryStore, _: Completion<'_>) -> Result<Fenced, StoreError> {
        Err(down("complete"))
    }
}

/// A handler that ran is never reported as "not processed": the client is
/// told its request was processed and to retry with the same key, and that
/// retry replays the answer (recorded in the background) without a second run.
#[tokio::test]
async fn an_answer_that_could_not_be_recorded_yet_is_503_saying_the_request_was_processed() {
    let server = TestServer::start(Arc::new(Hooked::new(CompletionsFail)), |b| b).await;
    let a = fresh_tenant();
    let r = post(&server, "/payments", Some(&a), Some("k"), BODY).await;
    assert_eq!(r.headers()["retry-after"], "1");
    let p = expect_problem(r, 503, types::ANSWER_NOT_RECORDED_YET).await;
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.contains("was processed"), "{detail}");
    assert!(detail.contains("same Idempotency-Key"), "{detail}");
    assert!(
        !detail.contains("connection refused"),
        "internals stay in the logs"
    );
    assert_eq!(server.shop.gateway.calls(), 1);

    let retry = post(&server, "/payments", Some(&a), Some("k"), BODY).await;
    assert_eq!(retry.status(), 201);
    assert!(replayed(&retry));
    assert_eq!(
        server.shop.gateway.calls(),
        1,
        "the retry did not run the handler again"
    );
}

/// Counts the store operations the layer makes.
#[derive(Default)]
struct Counting {
    inner: MemoryStore,
    reserve: AtomicUsize,
    complete: AtomicUsize,
    other: AtomicUsize,
}

#[async_trait::async_trait]
impl Store for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    async fn force_release(
        &self,
        i: &Identity,
        require_expired_lease: bool,
    ) -> Result<idempotent_runtime::ForcedRelease, StoreError> {
        self.inner.force_release(i, require_expired_lease).await
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.reserve.fetch_add(1, Ordering::SeqCst);
        self.inner.reserve(r).await
    }
    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        self.complete.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(completion).await
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        self.other.fetch_add(1, Ordering::SeqCst);
        self.inner.release(i, t).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        l: Duration,
    ) -> Result<Fenced, StoreError> {
        self.other.fetch_add(1, Ordering::SeqCst);
        self.inner.heartbeat(i, t, l).await
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.other.fetch_add(1, Ordering::SeqCst);
        self.inner.release_detached(i, t)
    }
    fn complete_detached(&self, completion: Completion<'_>) {
        self.other.fetch_add(1, Ordering::SeqCst);
        self.inner.complete_detached(completion)
    }
    async fn purge_expired(&self, b: u32) -> Result<u64, StoreError> {
        self.inner.purge_expired(b).await
    }
    async fn fetch(&self, i: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        self.other.fetch_add(1, Ordering::SeqCst);
        self.inner.fetch(i).await
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.inner.scope_stats().await
    }
}

#[tokio::test]
async fn the_layer_costs_one_reservation_and_one_completion_and_a_replay_one_reservation() {
    let store = Arc::new(Counting::default());
    let server = TestServer::start(store.clone(), |b| b).await;
    let a = fresh_tenant();
    let counts = || {
        (
            store.reserve.load(Ordering::SeqCst),
            store.complete.load(Ordering::SeqCst),
            store.other.load(Ordering::SeqCst),
        )
    };
    post(&server, "/payments", Some(&a), Some("k1"), BODY).await;
    assert_eq!(counts(), (1, 1, 0), "fresh: reserve + complete");
    post(&server, "/payments", Some(&a), Some("k1"), BODY).await;
    assert_eq!(counts(), (2, 1, 0), "replay: one reservation");
    client()
        .get(server.url("/payments/ch_1"))
        .header("x-account-id", &a)
        .send()
        .await
        .unwrap();
    assert_eq!(counts(), (2, 1, 0), "a GET touches no store");
}

// ---------------------------------------------------------------- registry

#[tokio::test]
async fn the_layer_registers_its_scope() {
    let server = TestServer::start(memory(), |b| b.lease(Duration::from_secs(7))).await;
    let info = server.layer.scope_info();
    assert_eq!(info.scope, "test.payments");
    assert_eq!(info.lease, Duration::from_secs(7));
    assert!(info.file.ends_with("http.rs"), "{}", info.file);
    assert!(idempotent_runtime::registry::scopes()
        .iter()
        .any(|s| std::ptr::eq(*s, info)));
}

/// Rule 21 for layers: two layers built apart with one scope are two
/// claimants of it. Unless each says it shares the scope on purpose
/// (`shared_scope()`), `registry::validate` reports the scope as claimed
/// twice, naming both sites; when both say so (and agree), it passes.
#[test]
fn two_layers_built_apart_with_one_scope_must_both_say_they_share_it() {
    use idempotent_runtime::http::IdempotencyLayer;
    use idempotent_runtime::registry::{validate_infos, RegistryError};
    // Each `build()` on a line of its own: a layer's site is where it was built.
    let builder = || {
        IdempotencyLayer::builder("test.shared_routes", MemoryStore::new()).tenant_from(|_| None)
    };
    let public = builder().build().expect("a valid layer");
    let partner = builder().build().expect("a valid layer");
    match validate_infos(&[public.scope_info(), partner.scope_info()]) {
        Err(RegistryError::DuplicateScopes(duplicates)) => {
            assert_eq!(duplicates.len(), 1, "{duplicates:?}");
            assert_eq!(duplicates[0].scope, "test.shared_routes");
            assert_eq!(
                duplicates[0].sites.len(),
                2,
                "both sites named: {duplicates:?}"
            );
        }
        other => panic!("two unshared claimants must be a duplicate: {other:?}"),
    }
    let shared = builder().shared_scope().build().expect("a valid layer");
    assert!(
        matches!(
            validate_infos(&[shared.scope_info(), partner.scope_info()]),
            Err(RegistryError::DuplicateScopes(_))
        ),
        "one claimant saying so is not enough"
    );
    let also_shared = builder().shared_scope().build().expect("a valid layer");
    assert!(shared.scope_info().shared_scope);
    validate_infos(&[shared.scope_info(), also_shared.scope_info()])
        .expect("two layers that both share the scope, and agree, pass");
}

/// What `shared_scope()` can share a layer's scope with, as `validate()`
/// decides it (the builder's documentation must say the same): a layer
/// fingerprints the request's method, target and body, so an annotated
/// function (a message consumer's handler) sharing its scope is reported as a
/// disagreement on what they fingerprint; layers with different recover
/// hooks, or different rules for which answers they record, are not
/// (`validate()` compares whether there is a hook, and a layer may always
/// record an answer).
#[test]
fn a_shared_layer_scope_is_compared_on_its_fingerprint_and_whether_it_has_a_hook() {
    use idempotent_runtime::http::IdempotencyLayer;
    use idempotent_runtime::registry::{
        validate_infos, Disagreement, ErrorPolicy, InProgressPolicy, RegistryError, ScopeInfo,
        ScopeSpec,
    };
    use idempotent_runtime::Recovery;
    let builder = || {
        IdempotencyLayer::builder("test.shared_with_a_consumer", MemoryStore::new())
            .tenant_from(|_| None)
            .shared_scope()
    };
    let route = builder().build().expect("a valid layer");
    // The consumer's handler, as its attribute registers it, with the
    // layer's ttl and error policy's kind.
    let consumer: &'static ScopeInfo = Box::leak(Box::new(ScopeInfo::new(ScopeSpec {
        scope: "test.shared_with_a_consumer",
        function: "orders::on_order_created",
        file: file!(),
        line: line!(),
        ttl: route.scope_info().ttl,
        lease: Duration::from_secs(30),
        in_progress: InProgressPolicy::Wait(Duration::from_secs(10)),
        errors: ErrorPolicy::Record,
        transactional: false,
        fingerprinted: true,
        fingerprinted_parameters: &["order"],
        shared_tenant: false,
        recover: None,
        shared_scope: true,
    })));
    match validate_infos(&[route.scope_info(), consumer]) {
        Err(RegistryError::SharedScopeConflicts(conflicts)) => {
            assert_eq!(conflicts.len(), 1, "{conflicts:?}");
            assert!(
                matches!(conflicts[0].disagreement, Disagreement::Fingerprint { .. }),
                "{conflicts:?}"
            );
        }
        other => panic!("a layer and a consumer's function cannot agree: {other:?}"),
    }
    // Two layers: one records 4xx answers, the other has a recover hook of
    // its own name and records none; only the hook's presence is compared.
    let records_4xx = builder()
        .record_client_errors(true)
        .recover(|_| async { Ok(Recovery::Run) })
        .build()
        .expect("a valid layer");
    let releases_all = builder()
        .record_client_errors(false)
        .recover(|_| async { Ok(Recovery::Run) })
        .build()
        .expect("a valid layer");
    assert_ne!(
        records_4xx.scope_info().errors,
        releases_all.scope_info().errors
    );
    validate_infos(&[records_4xx.scope_info(), releases_all.scope_info()])
        .expect("layers differing in which answers they record share a scope");
    match validate_infos(&[records_4xx.scope_info(), route.scope_info()]) {
        Err(RegistryError::SharedScopeConflicts(conflicts)) => assert!(
            matches!(conflicts[0].disagreement, Disagreement::Recover { .. }),
            "{conflicts:?}"
        ),
        other => panic!("a hook beside none is a disagreement: {other:?}"),
    }
}

/// Rule 21: a layer's fingerprint is its own canonical form of the HTTP
/// request, not the canonical form of named arguments, so no annotated
/// function can make the same fingerprint for the same event. One whose
/// fingerprinted parameters happen to be called `method`, `target` and
/// `body` (a relay of queued HTTP requests) agreed with the layer on every
/// term `validate()` compared, so sharing the scope passed, and every
/// request through one path was then refused (422) after the other, or
/// replayed an answer of the other's type. `validate()` reports it as a
/// disagreement on what they fingerprint, as for any other function.
#[test]
fn a_function_whose_parameters_are_named_like_a_layers_request_parts_cannot_share_its_scope() {
    use idempotent_runtime::http::IdempotencyLayer;
    use idempotent_runtime::registry::{
        validate_infos, Disagreement, ErrorPolicy, InProgressPolicy, RegistryError, ScopeInfo,
        ScopeSpec,
    };
    let route = IdempotencyLayer::builder("test.shared_with_a_relay", MemoryStore::new())
        .tenant_from(|_| None)
        .shared_scope()
        .build()
        .expect("a valid layer");
    // `async fn relay(tenant, key, method: String, target: String, body: Vec<u8>)`,
    // as its attribute registers it, agreeing with the layer on the rest.
    let relay: &'static ScopeInfo = Box::leak(Box::new(ScopeInfo::new(ScopeSpec {
        scope: "test.shared_with_a_relay",
        function: "outbox::relay",
        file: file!(),
        line: line!(),
        ttl: route.scope_info().ttl,
        lease: Duration::from_secs(30),
        in_progress: InProgressPolicy::Wait(Duration::from_secs(10)),
        errors: ErrorPolicy::Record,
        transactional: false,
        fingerprinted: true,
        fingerprinted_parameters: &["method", "target", "body"],
        shared_tenant: false,
        recover: None,
        shared_scope: true,
    })));
    match validate_infos(&[route.scope_info(), relay]) {
        Err(RegistryError::SharedScopeConflicts(conflicts)) => assert!(
            matches!(conflicts[0].disagreement, Disagreement::Fingerprint { .. }),
            "{conflicts:?}"
        ),
        other => panic!("a layer and an annotated function cannot agree: {other:?}"),
    }
}

#[test]
fn a_layer_without_a_tenant_or_with_a_bad_scope_is_refused_at_build() {
    use idempotent_runtime::http::{IdempotencyLayer, LayerConfigError};
    let e = IdempotencyLayer::builder("x.y", MemoryStore::new())
        .build()
        .unwrap_err();
    assert!(matches!(e, LayerConfigError::NoTenant { .. }));
    assert!(e.to_string().contains("tenant_from_extension"));
    let e = IdempotencyLayer::builder("Bad Scope", MemoryStore::new())
        .tenant_from(|_| None)
        .build()
        .unwrap_err();
    assert!(matches!(e, LayerConfigError::InvalidScope { .. }));
}

/// A layer's durations follow the attribute's rules: a zero ttl (which
/// recorded nothing a retry could replay: every retry ran the handler again,
/// and another request under the same key was not refused) and a lease under
/// the attribute's 10 ms minimum are refused when the layer is built.
#[test]
fn a_layer_whose_durations_the_attribute_would_refuse_is_refused_at_build() {
    use idempotent_runtime::http::{IdempotencyLayer, LayerConfigError};
    let build = |ttl: Duration, lease: Duration| {
        IdempotencyLayer::builder("x.durations", MemoryStore::new())
            .tenant_from(|_| None)
            .ttl(ttl)
            .lease(lease)
            .build()
    };
    let (hour, second) = (Duration::from_secs(3600), Duration::from_secs(1));
    for (ttl, lease, says) in [
        (Duration::ZERO, second, "`ttl` must be longer than zero"),
        (
            hour,
            Duration::from_millis(5),
            "`lease` is 5ms, below the minimum of 10ms",
        ),
    ] {
        let e = build(ttl, lease)
            .err()
            .unwrap_or_else(|| panic!("{ttl:?} / {lease:?}"));
        assert!(matches!(e, LayerConfigError::InvalidDuration { .. }), "{e}");
        assert!(e.to_string().contains(says), "{e}");
        assert!(e.to_string().contains("x.durations"), "{e}");
    }
    assert!(matches!(
        build(hour, Duration::ZERO),
        Err(LayerConfigError::ZeroLease { .. })
    ));
    assert!(build(Duration::from_millis(1), Duration::from_millis(10)).is_ok());
    // `wait(...)` too: zero would be `reject_in_progress()` by another name
    // (the attribute refuses `wait("0s")`), and under a millisecond rounds to it.
    let wait = |bound: Duration| {
        IdempotencyLayer::builder("x.durations", MemoryStore::new())
            .tenant_from(|_| None)
            .wait(bound)
            .build()
    };
    for (bound, says) in [
        (Duration::ZERO, "must be longer than zero"),
        (Duration::from_micros(500), "below the minimum of 1ms"),
    ] {
        let e = wait(bound).err().unwrap_or_else(|| panic!("{bound:?}"));
        assert!(matches!(e, LayerConfigError::InvalidDuration { .. }), "{e}");
        assert!(e.to_string().contains(says), "{e}");
    }
    assert!(wait(Duration::from_millis(1)).is_ok());
    assert!(wait(Duration::MAX).is_ok(), "as long as a wait may be");
}

/// A response limit over what a record can hold (4 MiB) is refused when the
/// layer is built. It was lowered to 4 MiB without a word: a route given
/// `max_response_bytes(16 MiB)` for its 5 MiB answers had every answer
/// refused for recording (500, the key released), so each retry and each
/// waiting duplicate ran the handler again.
#[test]
fn a_response_limit_over_what_a_record_holds_is_refused_at_build() {
    use idempotent_runtime::http::{
        IdempotencyLayer, LayerConfigError, DEFAULT_MAX_RESPONSE_BYTES,
    };
    let build = |limit: usize| {
        IdempotencyLayer::builder("x.limits", MemoryStore::new())
            .tenant_from(|_| None)
            .max_response_bytes(limit)
            .build()
    };
    let e = build(16 << 20).expect_err("a 16 MiB limit is refused");
    assert!(
        matches!(e, LayerConfigError::ResponseLimitTooLarge { limit, max, .. }
            if limit == 16 << 20 && max == DEFAULT_MAX_RESPONSE_BYTES),
        "{e:?}"
    );
    let said = e.to_string();
    assert!(
        said.contains("x.limits")
            && said.contains("max_response_bytes")
            && said.contains(&DEFAULT_MAX_RESPONSE_BYTES.to_string()),
        "the error names the scope, the setting and the most it may be: {said}"
    );
    assert!(build(DEFAULT_MAX_RESPONSE_BYTES + 1).is_err());
    assert!(build(DEFAULT_MAX_RESPONSE_BYTES).is_ok());
    assert!(build(64).is_ok());
}

// ---------------------------------------------------------------- extractor and IntoResponse

#[tokio::test]
async fn the_extractor_route_answers_like_the_layer() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let body = r#"{"charge_id":"ch_1"}"#;
    let r = post(&server, "/refunds", Some(&a), None, body).await;
    expect_problem(r, 400, types::MISSING_KEY).await;
    let r = post(&server, "/refunds", Some(&a), Some(r#""bad"#), body).await;
    expect_problem(r, 400, types::INVALID_KEY).await;

    let first = post(&server, "/refunds", Some(&a), Some(r#""refund-1""#), body).await;
    assert_eq!(first.status(), 201);
    assert!(!replayed(&first));
    let first = json(first).await;
    let again = post(&server, "/refunds", Some(&a), Some("refund-1"), body).await;
    assert_eq!(again.status(), 201);
    assert!(replayed(&again), "MarkReplayed sets the header");
    assert_eq!(json(again).await, first);
    assert_eq!(server.shop.refund_calls.load(Ordering::SeqCst), 1);

    // `?` on Error::FingerprintMismatch answers 422 problem+json.
    let r = post(
        &server,
        "/refunds",
        Some(&a),
        Some("refund-1"),
        r#"{"charge_id":"ch_2"}"#,
    )
    .await;
    expect_problem(r, 422, types::KEY_REUSED).await;
    // ... and on Error::InvalidTenant, 400.
    let r = post(&server, "/refunds", None, Some("refund-2"), body).await;
    expect_problem(r, 400, types::INVALID_TENANT).await;
}

#[test]
fn every_error_has_its_status() {
    use axum::response::IntoResponse;
    use idempotent_runtime::{Error, KeyProblem, RecordContext};
    let ctx = RecordContext {
        scope: "a.b".into(),
        key_digest: "0123456789abcdef".into(),
    };
    let cases: Vec<(Error, u16)> = vec![
        (Error::InvalidKey(KeyProblem::Empty), 400),
        (Error::InvalidTenant(KeyProblem::Empty), 400),
        (Error::FingerprintMismatch(ctx.clone()), 422),
        (
            Error::InProgress {
                scope: "a.b".into(),
                retry_after: Duration::from_millis(10),
            },
            409,
        ),
        (Error::Store(down("reserve")), 503),
        (
            Error::StaleSnapshot {
                scope: "a.b".into(),
                store: "sqlite",
            },
            503,
        ),
        (Error::LeaseLost(ctx), 500),
        (
            Error::ResultTooLarge {
                scope: "a.b".into(),
                size: 9,
                limit: 8,
            },
            500,
        ),
        (
            Error::NoDefaultStore {
                scope: "a.b".into(),
            },
            500,
        ),
    ];
    for (error, status) in cases {
        let text = error.to_string();
        // The answers that say "send it again" (never recorded by a layer).
        let not_final = matches!(
            error,
            Error::InProgress { .. }
                | Error::StaleSnapshot { .. }
                | Error::Store(_)
                | Error::LeaseLost(_)
        );
        let r = error.into_response();
        assert_eq!(r.status().as_u16(), status, "{text}");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        assert_eq!(r.headers().contains_key("retry-after"), not_final, "{text}");
    }
}
// Append to tests/http/http_server.rs (next to
// `a_request_recorded_as_http1_is_replayed_to_its_retries`).

/// Rules 6, 7 and 22 across versions: a record an earlier version made with
/// the `http1` form, for *another* request, is a reused key (422, final), not
/// "recorded by a newer version" (503, retry later): this build knows the
/// `http1` form, compares by it (the retry of the same request replays, see
/// above), and a request that differs in both forms is a mismatch. Answering
/// 503 would have clients retry, for the record's whole ttl, a request that
/// can never succeed with that key. The record is untouched and nothing runs.
#[tokio::test]
async fn another_request_on_an_http1_record_is_a_reused_key_not_retry_later() {
    use idempotent_runtime::http::request_fingerprint;
    let store = http_app::sqlite_file().await;
    let pool = store.pool().clone();
    let server = TestServer::start(Arc::new(store), |b| b).await;
    let a = fresh_tenant();
    let send = |body: &'static str| {
        let (url, a) = (server.url("/status/201"), a.clone());
        async move {
            client()
                .post(url)
                .header("content-type", "text/plain")
                .header("x-account-id", a)
                .header("idempotency-key", "k-old-other")
                .body(body)
                .send()
                .await
                .expect("request")
        }
    };
    assert_eq!(send("x").await.status(), 201);
    let mut headers = axum::http::HeaderMap::new();
    headers.insert("content-type", "text/plain".parse().unwrap());
    let current = request_fingerprint(&axum::http::Method::POST, "/status/201", &headers, b"x");
    let old = current.legacy().expect("an http1 form");
    assert_eq!(old.version(), "http1");
    let rewritten =
        sqlx::query("UPDATE idempotency_records SET fingerprint = ? WHERE fingerprint = ?")
            .bind(old.as_str())
            .bind(current.as_str())
            .execute(&pool)
            .await
            .expect("make the record an http1 one")
            .rows_affected();
    assert_eq!(rewritten, 1, "the layer stored the http2 fingerprint");
    // Not 503 `recorded-by-newer-version`: 422 `key-reused`, problem+json.
    expect_problem(send("y").await, 422, types::KEY_REUSED).await;
    assert_eq!(
        server.shop.status_calls.load(Ordering::SeqCst),
        1,
        "nothing ran again"
    );
    let stored: Option<String> =
        sqlx::query_scalar("SELECT fingerprint FROM idempotency_records WHERE fingerprint = ?")
            .bind(old.as_str())
            .fetch_optional(&pool)
            .await
            .expect("read the record");
    assert_eq!(
        stored.as_deref(),
        Some(old.as_str()),
        "the record is untouched"
    );
}
