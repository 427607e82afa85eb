//! What one `Idempotency-Key` stands for (rule 22): every method that may
//! change state is protected as `POST` is, and the method and the query
//! string are part of the request, so a retry that differs in either is a
//! reused key (422), never the other request's replay. On the memory store,
//! a SQLite file, PostgreSQL and MariaDB (when reachable).

use crate::common;
use crate::http_app::{authenticate, expect_problem, serve, sqlite_file_store, AccountId};

use axum::extract::{Extension, OriginalUri};
use axum::http::{Method, StatusCode};
use axum::middleware;
use axum::routing::post;
use axum::Router;
use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::http::problem::types;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::{MemoryStore, Store};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

async fn every_store() -> Vec<(&'static str, Arc<dyn Store>)> {
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

/// `/items` for `POST`, `PUT`, `PATCH` and `DELETE` behind the layer (and the
/// test authentication): each run is counted and answers with its method,
/// the target it saw and its run number, so a replay of another request's
/// answer shows. The base URL and the run count.
async fn items(store: Arc<dyn Store>, scope: &str) -> (String, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |method: Method,
              OriginalUri(uri): OriginalUri,
              Extension(AccountId(a)): Extension<AccountId>| {
            let runs = runs.clone();
            async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                (StatusCode::OK, format!("{method} {uri} for {a}: run {n}"))
            }
        }
    };
    let layer = IdempotencyLayer::builder(scope, store)
        .tenant_from_extension::<AccountId>()
        .build()
        .expect("layer");
    let app = Router::new()
        .route(
            "/items",
            post(handler.clone())
                .put(handler.clone())
                .patch(handler.clone())
                .delete(handler),
        )
        .route_layer(layer)
        .layer(middleware::from_fn(authenticate));
    let (base, _task) = serve(app).await;
    (base, runs)
}

async fn send(
    base: &str,
    method: Method,
    target: &str,
    tenant: &str,
    key: Option<&str>,
) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .request(method, format!("{base}{target}"))
        .header("x-account-id", tenant)
        .header("content-type", "application/json")
        .body(r#"{"qty":1}"#);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.send().await.expect("request")
}

fn replayed(r: &reqwest::Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// `PUT`, `PATCH` and `DELETE` change state as `POST` does: each needs a
/// key, runs once for it, and its retry replays the first answer. Were one
/// of them passed through like a safe method, its retry would run the
/// handler again.
#[tokio::test]
async fn put_patch_and_delete_are_protected_like_post() {
    for (name, store) in every_store().await {
        let (base, runs) = items(store, "identity.methods").await;
        let tenant = fresh_tenant();
        for method in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE] {
            let before = runs.load(Ordering::SeqCst);
            let r = send(&base, method.clone(), "/items", &tenant, None).await;
            expect_problem(r, 400, types::MISSING_KEY).await;
            assert_eq!(runs.load(Ordering::SeqCst), before, "{name} {method}");

            let key = format!("k-{method}");
            let first = send(&base, method.clone(), "/items", &tenant, Some(&key)).await;
            assert_eq!(first.status(), 200, "{name} {method}");
            assert!(!replayed(&first), "{name} {method}");
            let first = first.text().await.expect("body");
            let retry = send(&base, method.clone(), "/items", &tenant, Some(&key)).await;
            assert!(replayed(&retry), "{name} {method}: the retry is a replay");
            assert_eq!(retry.text().await.expect("body"), first, "{name} {method}");
            assert_eq!(
                runs.load(Ordering::SeqCst),
                before + 1,
                "{name} {method}: the handler ran once for the key"
            );
        }
    }
}

/// One key, one request: the same key on the same path with another method,
/// or with another query string, is refused with 422 and nothing runs; the
/// original request's retry is still answered from its record.
#[tokio::test]
async fn the_same_key_with_another_method_or_query_is_a_reused_key() {
    for (name, store) in every_store().await {
        let (base, runs) = items(store, "identity.requests").await;
        let tenant = fresh_tenant();
        let first = send(&base, Method::POST, "/items?qty=1", &tenant, Some("k")).await;
        assert_eq!(first.status(), 200, "{name}");
        let first = first.text().await.expect("body");
        for (method, target) in [
            (Method::PUT, "/items?qty=1"),
            (Method::DELETE, "/items?qty=1"),
            (Method::POST, "/items?qty=100"),
            (Method::POST, "/items"),
        ] {
            let r = send(&base, method.clone(), target, &tenant, Some("k")).await;
            expect_problem(r, 422, types::KEY_REUSED).await;
            assert_eq!(
                runs.load(Ordering::SeqCst),
                1,
                "{name}: {method} {target} ran"
            );
        }
        let retry = send(&base, Method::POST, "/items?qty=1", &tenant, Some("k")).await;
        assert!(replayed(&retry), "{name}");
        assert_eq!(retry.text().await.expect("body"), first, "{name}");
    }
}

/// Keys are compared byte for byte: keys that differ only in case, or in a
/// trailing space (inside quotes), are different operations, and tenants
/// that differ only in case are different callers. Each runs the handler
/// and none is answered with another's record (a store that compared keys
/// case-insensitively, or padded them, would replay one caller's answer to
/// another).
#[tokio::test]
async fn keys_and_tenants_that_differ_in_case_or_a_trailing_space_are_distinct() {
    for (name, store) in every_store().await {
        let (base, runs) = items(store, "identity.bytes").await;
        let tenant = fresh_tenant();
        let upper = tenant.to_uppercase();
        let mut answers = Vec::new();
        for (tenant, key) in [
            (&tenant, "order-a"),
            (&tenant, "ORDER-A"),
            (&tenant, r#""order-a ""#),
            (&upper, "order-a"),
        ] {
            let r = send(&base, Method::POST, "/items", tenant, Some(key)).await;
            assert_eq!(r.status(), 200, "{name} {tenant} {key}");
            assert!(!replayed(&r), "{name}: {tenant} {key} was another's replay");
            answers.push(r.text().await.expect("body"));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 4, "{name}");
        // Each one's retry is answered from its own record.
        for ((tenant, key), answer) in [
            (&tenant, "order-a"),
            (&tenant, "ORDER-A"),
            (&tenant, r#""order-a ""#),
            (&upper, "order-a"),
        ]
        .into_iter()
        .zip(&answers)
        {
            let r = send(&base, Method::POST, "/items", tenant, Some(key)).await;
            assert!(replayed(&r), "{name} {tenant} {key}");
            assert_eq!(
                &r.text().await.expect("body"),
                answer,
                "{name} {tenant} {key}"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 4, "{name}");
    }
}

/// The framing is not the request: the same bytes sent chunked, then with a
/// `Content-Length` (a retry through another client or proxy), and with the
/// headers in another order, are one request, and the retry replays the
/// first answer instead of being refused as a reused key.
#[tokio::test]
async fn the_same_body_chunked_or_with_a_length_is_one_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (base, runs) = items(Arc::new(MemoryStore::new()), "identity.framing").await;
    let tenant = fresh_tenant();
    let mut stream = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .expect("connect");
    let head = format!(
        "POST /items HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
         idempotency-key: framing-1\r\nx-account-id: {tenant}\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    stream
        .write_all(b"4\r\n{\"qt\r\n5\r\ny\":1}\r\n0\r\n\r\n")
        .await
        .expect("write");
    let mut first = Vec::new();
    crate::http_app::bounded(
        "the chunked request's answer",
        stream.read_to_end(&mut first),
    )
    .await
    .expect("read");
    let first = String::from_utf8_lossy(&first);
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let retry = reqwest::Client::new()
        .post(format!("{base}/items"))
        .header("x-account-id", &tenant)
        .header("idempotency-key", "framing-1")
        .header("content-type", "application/json")
        .body(r#"{"qty":1}"#)
        .send()
        .await
        .expect("request");
    assert_eq!(retry.status(), 200);
    assert!(
        replayed(&retry),
        "the retry with a Content-Length ran again"
    );
    assert!(
        first.ends_with(&retry.text().await.expect("body")),
        "the replay is the chunked request's answer: {first}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A seeded sweep of requests over a few tenants (some that run into a key
/// when joined: `t` + `x:k` and `t:x` + `k`), keys (bare and quoted
/// spellings of one key, keys that differ in case or hold a `:`), methods,
/// query strings (one pair in two orders) and bodies whose handler answers
/// 201, a 400 (recorded) or a 500 (released), checked against a model of
/// rule 22: the first request for a (tenant, key) runs; while its answer is
/// recorded, the same request replays it (same status and body, with
/// `Idempotent-Replayed: true`) and any other is 422 `key-reused` and runs
/// nothing; a 5xx leaves the key free. The handler's answer names the
/// caller, the request and the run, so a replay of another caller's or
/// another request's answer shows.
#[tokio::test]
async fn a_seeded_sweep_of_tenants_keys_and_requests_follows_the_model() {
    use std::collections::HashMap;
    for (name, store) in every_store().await {
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = {
            let runs = runs.clone();
            move |method: Method,
                  OriginalUri(uri): OriginalUri,
                  Extension(AccountId(a)): Extension<AccountId>,
                  body: String| {
                let runs = runs.clone();
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    let status = match body.as_str() {
                        "bad" => StatusCode::BAD_REQUEST,
                        "boom" => StatusCode::INTERNAL_SERVER_ERROR,
                        _ => StatusCode::CREATED,
                    };
                    (status, format!("{method} {uri} {body} for {a}: run {n}"))
                }
            }
        };
        let layer = IdempotencyLayer::builder("identity.sweep", store)
            .tenant_from_extension::<AccountId>()
            .build()
            .expect("layer");
        let app = Router::new()
            .route("/items", post(handler.clone()).put(handler))
            .route_layer(layer)
            .layer(middleware::from_fn(authenticate));
        let (base, _task) = serve(app).await;
        let prefix = fresh_tenant();
        let tenants = [
            format!("{prefix}-t"),
            format!("{prefix}-t:x"),
            format!("{prefix}-T"),
        ];
        // Header value, and the key it stands for.
        let keys: [(&str, &str); 6] = [
            ("k", "k"),
            (r#""k""#, "k"),
            ("x:k", "x:k"),
            ("K", "K"),
            (r#""x:k""#, "x:k"),
            (r#""k ""#, "k "),
        ];
        let methods = [Method::POST, Method::PUT];
        let targets = ["/items", "/items?x=1&y=2", "/items?y=2&x=1"];
        let bodies = ["ok", "ok2", "bad", "boom"];
        // (tenant, key) -> (request, status, body) of the recorded answer.
        type Recorded<'a> = ((Method, &'a str, &'a str), u16, String);
        let mut model: HashMap<(usize, &str), Recorded> = HashMap::new();
        let mut expected_runs = 0;
        let (mut replays, mut reused) = (0, 0);
        let mut seed: u64 = 0x5eed_1234_abcd_0042;
        let mut next = |n: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as usize) % n
        };
        let client = reqwest::Client::new();
        for step in 0..160 {
            let tenant = next(tenants.len());
            let (header_value, key) = keys[next(keys.len())];
            let method = methods[next(methods.len())].clone();
            let target = targets[next(targets.len())];
            let body = bodies[next(bodies.len())];
            let r = client
                .request(method.clone(), format!("{base}{target}"))
                .header("x-account-id", &tenants[tenant])
                .header("idempotency-key", header_value)
                .header("content-type", "text/plain")
                .body(body)
                .send()
                .await
                .expect("request");
            let status = r.status().as_u16();
            let was_replayed = replayed(&r);
            let text = r.text().await.expect("body");
            let what = format!(
                "{name} step {step}: {method} {target} {body:?} tenant {tenant} key {header_value}"
            );
            let request = (method.clone(), target, body);
            match model.get(&(tenant, key)) {
                None => {
                    expected_runs += 1;
                    assert!(!was_replayed, "{what}: {text}");
                    let expected_status = match body {
                        "bad" => 400,
                        "boom" => 500,
                        _ => 201,
                    };
                    assert_eq!(status, expected_status, "{what}: {text}");
                    assert!(
                        text.starts_with(&format!(
                            "{method} {target} {body} for {}: run ",
                            tenants[tenant]
                        )),
                        "{what}: {text}"
                    );
                    if status != 500 {
                        model.insert((tenant, key), (request, status, text));
                    }
                }
                Some((recorded, recorded_status, recorded_body)) if *recorded == request => {
                    replays += 1;
                    assert!(was_replayed, "{what}: {text}");
                    assert_eq!(status, *recorded_status, "{what}");
                    assert_eq!(&text, recorded_body, "{what}");
                }
                Some(_) => {
                    reused += 1;
                    assert_eq!(status, 422, "{what}: {text}");
                    assert!(text.contains(types::KEY_REUSED), "{what}: {text}");
                }
            }
            assert_eq!(runs.load(Ordering::SeqCst), expected_runs, "{what}");
        }
        // The sweep reaches every branch of the model.
        assert!(
            expected_runs >= 10 && replays >= 10 && reused >= 10,
            "{name}: {expected_runs} runs, {replays} replays, {reused} reused"
        );
    }
}

/// Twenty requests at once with one tenant and one key, half with one body
/// and half with another: one runs. While it runs (its handler held),
/// every request with the other body is refused with 422 `key-reused`
/// without waiting for it; once it answers, every request with its body
/// replays its answer. None runs a second time or gets the other body's
/// answer, on any store.
#[tokio::test]
async fn a_burst_of_two_requests_on_one_key_runs_one_and_refuses_the_other() {
    use crate::http_app::bounded;
    for (name, store) in every_store().await {
        let runs = Arc::new(AtomicUsize::new(0));
        let (won, mut first_body) = tokio::sync::watch::channel(String::new());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let handler = {
            let (runs, gate) = (runs.clone(), gate.clone());
            move |Extension(AccountId(a)): Extension<AccountId>, body: String| {
                let (runs, gate, won) = (runs.clone(), gate.clone(), won.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    won.send_replace(body.clone());
                    gate.acquire().await.expect("gate").forget();
                    (StatusCode::CREATED, format!("{body} for {a}: run {n}"))
                }
            }
        };
        let layer = IdempotencyLayer::builder("identity.burst-two", store)
            .tenant_from_extension::<AccountId>()
            .build()
            .expect("layer");
        let app = Router::new()
            .route("/items", post(handler))
            .route_layer(layer)
            .layer(middleware::from_fn(authenticate));
        let (base, _task) = serve(app).await;
        let tenant = fresh_tenant();
        let client = reqwest::Client::new();
        let mut requests = Vec::new();
        for i in 0..20 {
            let body = if i % 2 == 0 { "blue" } else { "green" };
            let send = client
                .post(format!("{base}/items"))
                .header("x-account-id", &tenant)
                .header("idempotency-key", "burst")
                .header("content-type", "text/plain")
                .body(body)
                .send();
            requests.push((body, tokio::spawn(send)));
        }
        bounded(
            "the first request in its handler",
            first_body.wait_for(|b| !b.is_empty()),
        )
        .await
        .expect("handler alive");
        let winner = first_body.borrow().clone();
        let mut waiting = Vec::new();
        for (body, request) in requests {
            if body == winner {
                waiting.push(request);
                continue;
            }
            let r = bounded("a refused request", request)
                .await
                .expect("task")
                .expect("request");
            assert_eq!(r.status(), 422, "{name}: {body} while {winner} runs");
            assert!(
                r.text().await.expect("body").contains(types::KEY_REUSED),
                "{name}"
            );
        }
        gate.add_permits(1);
        let mut fresh = 0;
        for request in waiting {
            let r = bounded("a request with the winning body", request)
                .await
                .expect("task")
                .expect("request");
            assert_eq!(r.status(), 201, "{name}");
            fresh += usize::from(!replayed(&r));
            assert_eq!(
                r.text().await.expect("body"),
                format!("{winner} for {tenant}: run 1"),
                "{name}"
            );
        }
        assert_eq!(
            fresh, 1,
            "{name}: one answer is the run's own, the others replays"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
    }
}
