//! The retrying client (`IdempotentClient`, `Intent`) against the layer on
//! loopback: flaky servers (503s, connections cut before the request or after
//! the charge) end in exactly one charge; a new intent is a new charge; 409
//! is retried after `Retry-After`; other 4xx are not retried.

use crate::common;
use crate::http_app;

use common::logs::Logs;
use common::proxy::FaultProxy;
use common::servers::fresh_tenant;
use http_app::{bounded, TestServer};
use idempotent_runtime::http::client::LastAttempt;
use idempotent_runtime::http::{ClientError, IdempotentClient, Intent, RetryPolicy};
use idempotent_runtime::{MemoryStore, Store};
use reqwest::Method;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

fn fast() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 5,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        ..RetryPolicy::default()
    }
}

fn client() -> IdempotentClient {
    IdempotentClient::new(reqwest::Client::new()).with_policy(fast())
}

fn charge(client: &IdempotentClient, base: &str, account: &str) -> Intent {
    client
        .intent(Method::POST, &format!("{base}/payments"))
        .expect("intent")
        .header("x-account-id", account)
        .expect("header")
        .json(&serde_json::json!({"amount_cents": 450, "currency": "EUR"}))
        .expect("body")
}

fn memory() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new())
}

#[tokio::test]
async fn first_attempts_answered_503_end_in_exactly_one_charge() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    server.shop.fail_next.store(3, Ordering::SeqCst);
    let intent = charge(&client(), &server.base, &a);
    let answer = intent.send().await.expect("answered");
    assert_eq!(answer.status(), 201);
    assert_eq!(answer.attempts(), 4);
    assert!(!answer.is_replayed());
    assert_eq!(server.shop.charges_of(&a).len(), 1);
    let keys = server.shop.seen_keys.lock().unwrap().clone();
    assert_eq!(
        keys,
        vec![intent.key().to_owned(); 4],
        "every attempt carried the intent's key"
    );
}

#[tokio::test]
async fn a_connection_cut_after_the_charge_is_retried_and_replayed() {
    let server = TestServer::start(memory(), |b| b).await;
    let proxy = FaultProxy::start(&server.addr.to_string())
        .await
        .expect("proxy");
    let base = format!("http://{}", proxy.addr());
    let a = fresh_tenant();
    // The server charges and answers; the answer never reaches the client.
    let trip = proxy.cut_on_next_response_containing("POST /payments");
    let intent = charge(&client(), &base, &a);
    let answer = intent.send().await.expect("answered");
    assert!(trip.has_cut(), "the first answer was cut");
    assert_eq!(answer.status(), 201);
    assert!(
        answer.is_replayed(),
        "the retry got the recorded answer of the first attempt"
    );
    assert!(answer.attempts() >= 2);
    assert_eq!(server.shop.charges_of(&a).len(), 1, "exactly one charge");
    assert_eq!(server.shop.gateway.calls(), 1);
}

#[tokio::test]
async fn a_connection_cut_before_the_request_arrives_is_retried_and_runs_once() {
    let server = TestServer::start(memory(), |b| b).await;
    let proxy = FaultProxy::start(&server.addr.to_string())
        .await
        .expect("proxy");
    let base = format!("http://{}", proxy.addr());
    let a = fresh_tenant();
    let trip = proxy.cut_on_next_request_containing("POST /payments");
    let answer = charge(&client(), &base, &a).send().await.expect("answered");
    assert!(trip.has_cut());
    assert_eq!(answer.status(), 201);
    assert!(
        !answer.is_replayed(),
        "the first attempt never reached the server"
    );
    assert_eq!(server.shop.charges_of(&a).len(), 1);
}

#[tokio::test]
async fn a_new_intent_is_a_new_key_and_a_second_charge() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let c = client();
    let first = charge(&c, &server.base, &a);
    let r1 = first.send().await.unwrap();
    // Sending the same intent again is a retry: replayed.
    let r1_again = first.send().await.unwrap();
    assert!(r1_again.is_replayed());
    assert_eq!(r1_again.body(), r1.body());
    // A second intent (the user pressed "pay" again): a second charge.
    let second = charge(&c, &server.base, &a);
    assert_ne!(second.key(), first.key());
    let r2 = second.send().await.unwrap();
    assert!(!r2.is_replayed());
    assert_ne!(r2.body(), r1.body());
    assert_eq!(server.shop.charges_of(&a).len(), 2);
}

#[tokio::test]
async fn a_409_is_retried_after_its_retry_after_and_ends_in_the_replay() {
    // Duplicates are refused at once, and the lease (hence Retry-After) is 1 s.
    let server = TestServer::start(memory(), |b| {
        b.reject_in_progress().lease(Duration::from_secs(1))
    })
    .await;
    let a = fresh_tenant();
    server.shop.gateway.hold();
    let intent = charge(&client(), &server.base, &a);
    let first = tokio::spawn({
        let intent = intent.clone();
        async move { intent.send().await }
    });
    server.shop.gateway.wait_entered(1).await;
    // The same operation sent again while the first attempt still runs.
    let duplicate = tokio::spawn({
        let intent = intent.clone();
        async move { intent.send().await }
    });
    server.wait_conflicts(1).await;
    server.shop.gateway.release();
    let first = bounded("the first send", first).await.unwrap().unwrap();
    let duplicate = bounded("the duplicate send", duplicate)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(duplicate.status(), 201);
    assert!(duplicate.attempts() >= 2, "the 409 was retried");
    assert!(duplicate.is_replayed());
    assert_eq!(duplicate.body(), first.body());
    assert_eq!(server.shop.charges_of(&a).len(), 1);
}

#[tokio::test]
async fn other_4xx_answers_are_final_and_not_retried() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let c = client();
    let intent = c
        .intent(Method::POST, &server.url("/status/404"))
        .unwrap()
        .header("x-account-id", &a)
        .unwrap()
        .json(&serde_json::json!({}))
        .unwrap();
    let r = intent.send().await.unwrap();
    assert_eq!((r.status().as_u16(), r.attempts()), (404, 1));

    // The same key for a different request: 422, with its problem, once.
    let reused = c
        .intent_with_key(Method::POST, &server.url("/status/404"), intent.key())
        .unwrap()
        .header("x-account-id", &a)
        .unwrap()
        .json(&serde_json::json!({"other": true}))
        .unwrap();
    let r = reused.send().await.unwrap();
    assert_eq!((r.status().as_u16(), r.attempts()), (422, 1));
    let problem = r.problem().expect("problem+json");
    assert_eq!(
        problem.problem_type,
        idempotent_runtime::http::problem::types::KEY_REUSED
    );
    assert_eq!(server.shop.status_calls.load(Ordering::SeqCst), 1);
}

/// 423, 425 and 429 say "not processed, try again" (the layer does not
/// record them): retried with the same key, as a 5xx is, within the bound.
/// A 408 is final: timeout middleware answers it after dropping a handler
/// halfway, which may have done its work.
#[tokio::test]
async fn try_again_answers_are_retried() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let c = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 2,
        ..fast()
    });
    let calls = || server.shop.status_calls.load(Ordering::SeqCst);
    for code in ["408", "423", "425", "429"] {
        let before = calls();
        let intent = c
            .intent(Method::POST, &server.url(&format!("/status/{code}")))
            .unwrap()
            .header("x-account-id", &a)
            .unwrap()
            .json(&serde_json::json!({}))
            .unwrap();
        let answer = intent.send().await;
        if code == "408" {
            let r = answer.expect("a final answer");
            assert_eq!((r.status().as_u16(), r.attempts()), (408, 1));
            assert_eq!(calls(), before + 1, "408: tried once");
            continue;
        }
        let e = answer.unwrap_err();
        assert!(
            matches!(e, ClientError::RetriesExhausted { attempts: 2, .. }),
            "{code}: {e:?}"
        );
        assert_eq!(calls(), before + 2, "{code}: tried twice");
    }
}

#[tokio::test]
async fn retries_are_bounded_and_the_error_says_to_keep_the_key() {
    let server = TestServer::start(memory(), |b| b).await;
    let a = fresh_tenant();
    let c = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 3,
        ..fast()
    });
    let intent = c
        .intent(Method::POST, &server.url("/status/503"))
        .unwrap()
        .header("x-account-id", &a)
        .unwrap()
        .json(&serde_json::json!({}))
        .unwrap();
    let e = intent.send().await.unwrap_err();
    match &e {
        ClientError::RetriesExhausted {
            attempts: 3,
            last: LastAttempt::Status { status, .. },
        } => {
            assert_eq!(status.as_u16(), 503)
        }
        other => panic!("expected RetriesExhausted after 3 attempts, got {other:?}"),
    }
    assert!(e.to_string().contains("same intent"), "{e}");
    assert_eq!(
        server.shop.status_calls.load(Ordering::SeqCst),
        3,
        "5xx released the key each time"
    );

    // Nothing listening: connection errors are retried, then reported.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let e = charge(&c, &dead, &a).send().await.unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::RetriesExhausted {
                attempts: 3,
                last: LastAttempt::Transport(_)
            }
        ),
        "{e:?}"
    );
}

/// Rule 2 on the client: the idempotency key it sends is in no log line at
/// any level (TRACE included: the client's, reqwest's and hyper's, and the
/// layer's on the server, which runs on this test's thread), nor in the
/// `Display` or `Debug` of the error it gives up with, nor in `Debug` of the
/// intent.
#[tokio::test]
async fn the_clients_key_is_in_no_log_line_at_any_level_nor_its_error() {
    let server = TestServer::start(memory(), |b| b).await;
    let (logs, _guard) = Logs::capture(tracing::Level::TRACE);
    let c = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 2,
        ..fast()
    });
    let key = format!("sk_live_KEYLEAK-client-{}", uuid::Uuid::new_v4());
    let intent = c
        .intent_with_key(Method::POST, &server.url("/status/503"), key.clone())
        .unwrap()
        .header("x-account-id", &fresh_tenant())
        .unwrap();
    let shown = format!("{intent:?}");
    let e = intent.send().await.unwrap_err();
    assert!(matches!(
        e,
        ClientError::RetriesExhausted { attempts: 2, .. }
    ));
    let written = logs.text();
    assert!(written.contains("giving up"), "{written}");
    for text in [written, shown, e.to_string(), format!("{e:?}")] {
        let leaked: Vec<&str> = text.lines().filter(|l| l.contains("KEYLEAK")).collect();
        assert!(
            leaked.is_empty(),
            "the raw key is shown:\n{}",
            leaked.join("\n")
        );
    }
}

/// Rule 2: the retry and give-up lines name the URL as `Debug` does,
/// without its user, password or query.
#[tokio::test]
async fn retry_logs_show_no_password_or_query_of_the_url() {
    let server = TestServer::start(memory(), |b| b).await;
    let (logs, _guard) = Logs::capture(tracing::Level::INFO);
    let c = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 2,
        ..fast()
    });
    let url = server.url("/status/503?api_token=SECRET-TOKEN").replacen(
        "http://",
        "http://alice:SECRET-PASS@",
        1,
    );
    let e = c
        .intent(Method::POST, &url)
        .unwrap()
        .header("x-account-id", &fresh_tenant())
        .unwrap()
        .send()
        .await
        .unwrap_err();
    assert!(matches!(
        e,
        ClientError::RetriesExhausted { attempts: 2, .. }
    ));
    // Nothing listening: reqwest's own error names the URL, in the logs and
    // in the error's text.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!(
        "http://alice:SECRET-PASS@{}/payments?api_token=SECRET-TOKEN",
        closed.local_addr().unwrap()
    );
    drop(closed);
    let e = c
        .intent(Method::POST, &dead)
        .unwrap()
        .send()
        .await
        .unwrap_err();
    assert!(matches!(
        &e,
        ClientError::RetriesExhausted {
            last: LastAttempt::Transport(_),
            ..
        }
    ));
    assert!(!e.to_string().contains("SECRET"), "{e}");
    let written = logs.text();
    assert!(written.contains("/payments"), "{written}");
    assert!(
        written.contains("retrying with the same idempotency key")
            && written.contains("giving up")
            && written.contains("/status/503"),
        "{written}"
    );
    assert!(!written.contains("SECRET"), "{written}");
}

/// An `https://` URL on a build whose reqwest has no TLS can never be sent:
/// refused at once as a request error, not retried and then reported as an
/// unknown outcome.
#[tokio::test]
async fn an_https_url_without_tls_is_refused_at_once() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}/payments", listener.local_addr().unwrap());
    let e = client()
        .intent(Method::POST, &url)
        .unwrap()
        .send()
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::NoTls(_)), "{e:?}");
    assert!(e.to_string().contains("enable a TLS feature"), "{e}");
    let with_query = format!("{url}?api_token=SECRET-TOKEN");
    let e = client()
        .intent(Method::POST, &with_query)
        .unwrap()
        .send()
        .await
        .unwrap_err();
    assert!(!e.to_string().contains("SECRET"), "{e}");
}

/// A redirect the client cannot follow comes after the request itself was
/// answered, so the operation may have run: the error says so, never
/// "nothing was sent" (client hunt: a processed POST answered 303 to an
/// `https://` location was reported as `NoTls`, "nothing was sent", and a
/// redirect loop, and one to another scheme (review), as a request reqwest
/// refused to send).
#[tokio::test]
async fn a_redirect_that_cannot_be_followed_says_the_request_was_sent() {
    use axum::http::{header::LOCATION, StatusCode};
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let app = axum::Router::new()
        .route(
            "/pay",
            axum::routing::post(move || {
                let counted = counted.clone();
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    (
                        StatusCode::SEE_OTHER,
                        [(LOCATION, "https://127.0.0.1:1/receipt")],
                    )
                }
            }),
        )
        .route(
            "/ftp",
            axum::routing::post(|| async {
                (
                    StatusCode::SEE_OTHER,
                    [(LOCATION, "ftp://127.0.0.1:1/receipt")],
                )
            }),
        )
        .route(
            "/loop",
            axum::routing::post(|| async {
                (StatusCode::TEMPORARY_REDIRECT, [(LOCATION, "/loop")])
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    for path in ["/pay", "/ftp", "/loop"] {
        let e = bounded(
            "the intent",
            client()
                .intent(Method::POST, &format!("{base}{path}"))
                .unwrap()
                .send(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(e, ClientError::RedirectNotFollowed(_)),
            "{path}: {e:?}"
        );
        let text = e.to_string();
        assert!(text.contains("may have run"), "{path}: {text}");
        assert!(!text.contains("nothing was sent"), "{path}: {text}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the POST ran, once");
    server.abort();
}

/// An answer body larger than the client reads (here 1 KiB) is not read
/// whole: it is `AnswerTooLarge`, final after one attempt (the request was
/// answered, so the operation may have run), whether the server announced
/// its length or sends it in chunks without end; one at the limit is read;
/// one the client retries whatever its body (a balancer's 503 page) is
/// retried unread.
#[tokio::test]
async fn an_answer_larger_than_the_client_reads_is_final_and_not_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const LIMIT: usize = 1024;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = requests.clone();
    let big_503 = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let (seen, big_503) = (seen.clone(), big_503.clone());
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                // The request's head and its (small) body.
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                seen.fetch_add(1, Ordering::SeqCst);
                let head = String::from_utf8_lossy(&request).to_string();
                let answer = if head.starts_with("POST /announced ") {
                    let mut a = format!(
                        "HTTP/1.1 201 Created\r\ncontent-length: {}\r\n\r\n",
                        LIMIT + 1
                    )
                    .into_bytes();
                    a.extend(std::iter::repeat_n(b'x', LIMIT + 1));
                    a
                } else if head.starts_with("POST /big-503 ") {
                    // A balancer's error page past the limit, then the answer.
                    if big_503.fetch_add(1, Ordering::SeqCst) == 0 {
                        let mut a = format!(
                            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/html\r\n\
                             content-length: {}\r\n\r\n",
                            LIMIT + 1
                        )
                        .into_bytes();
                        a.extend(std::iter::repeat_n(b'z', LIMIT + 1));
                        a
                    } else {
                        b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok".to_vec()
                    }
                } else if head.starts_with("POST /at-the-limit ") {
                    let mut a = format!("HTTP/1.1 201 Created\r\ncontent-length: {LIMIT}\r\n\r\n")
                        .into_bytes();
                    a.extend(std::iter::repeat_n(b'x', LIMIT));
                    a
                } else {
                    // Chunks without end (bounded here: 64 of 512 bytes).
                    let mut a =
                        b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
                    for _ in 0..64 {
                        a.extend_from_slice(b"200\r\n");
                        a.extend(std::iter::repeat_n(b'y', 512));
                        a.extend_from_slice(b"\r\n");
                    }
                    a.extend_from_slice(b"0\r\n\r\n");
                    a
                };
                let _ = socket.write_all(&answer).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    let client = client().with_max_answer_bytes(LIMIT);
    for path in ["/announced", "/chunked"] {
        let before = requests.load(Ordering::SeqCst);
        let e = bounded(
            "the intent",
            client
                .intent(Method::POST, &format!("{base}{path}"))
                .unwrap()
                .body("{}")
                .send(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(
                e,
                ClientError::AnswerTooLarge {
                    limit: LIMIT,
                    status
                } if status == reqwest::StatusCode::CREATED
            ),
            "{path}: {e:?}"
        );
        assert!(e.to_string().contains("may have run"), "{path}: {e}");
        assert_eq!(
            requests.load(Ordering::SeqCst) - before,
            1,
            "{path}: not retried"
        );
    }
    let read = bounded(
        "the intent",
        client
            .intent(Method::POST, &format!("{base}/at-the-limit"))
            .unwrap()
            .body("{}")
            .send(),
    )
    .await
    .expect("an answer at the limit is read");
    assert_eq!(read.body().len(), LIMIT);
    // A retryable answer past the limit (a balancer's 503 page) is retried
    // as before, not read.
    let retried = bounded(
        "the intent",
        client
            .intent(Method::POST, &format!("{base}/big-503"))
            .unwrap()
            .body("{}")
            .send(),
    )
    .await
    .expect("the 503 is retried");
    assert_eq!(
        (retried.status(), retried.attempts()),
        (reqwest::StatusCode::CREATED, 2)
    );
    server.abort();
}

/// A request as [`Scripted`] received it.
#[derive(Debug, Clone)]
struct Received {
    key: Option<String>,
    body: Vec<u8>,
    /// On tokio's clock (paused in the tests that read it).
    at: tokio::time::Instant,
}

/// An HTTP/1.1 server on loopback that answers the n-th request with
/// `answer(n)` (a whole response, from its status line on) and closes the
/// connection, keeping each request's `Idempotency-Key`, body and arrival.
/// No timers: it runs under tokio's paused clock.
struct Scripted {
    base: String,
    received: Arc<std::sync::Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Scripted {
    async fn start(answer: impl Fn(usize) -> String + Send + Sync + 'static) -> Scripted {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let received = Arc::new(std::sync::Mutex::new(Vec::<Received>::new()));
        let kept = received.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                let head_end = loop {
                    if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        break at + 4;
                    }
                    match socket.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&request[..head_end]).to_ascii_lowercase();
                let header = |name: &str| {
                    head.lines()
                        .find_map(|l| l.strip_prefix(&format!("{name}:")))
                        .map(|v| v.trim().to_owned())
                };
                let length: usize = header("content-length").map_or(0, |v| v.parse().unwrap());
                while request.len() < head_end + length {
                    match socket.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let n = {
                    let mut received = kept.lock().unwrap();
                    received.push(Received {
                        key: header("idempotency-key"),
                        body: request[head_end..head_end + length].to_vec(),
                        at: tokio::time::Instant::now(),
                    });
                    received.len()
                };
                let _ = socket.write_all(answer(n).as_bytes()).await;
                let _ = socket.shutdown().await;
            }
        });
        Scripted {
            base,
            received,
            task,
        }
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A response with `status_line` (e.g. `503 Service Unavailable`), extra
/// header lines, and `body`.
fn response(status_line: &str, headers: &[&str], body: &str) -> String {
    let mut r = format!("HTTP/1.1 {status_line}\r\nconnection: close\r\n");
    for h in headers {
        r.push_str(h);
        r.push_str("\r\n");
    }
    r.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    r
}

/// A client whose own backoff is at most 10 ms and whose attempts have no
/// timeout, and whose connections have no idle timer: no timer under the
/// paused clock but the client's own pauses.
fn paused_clock_client(max_attempts: u32) -> IdempotentClient {
    let http = reqwest::Client::builder()
        .pool_idle_timeout(None)
        .build()
        .unwrap();
    IdempotentClient::new(http).with_policy(RetryPolicy {
        max_attempts,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(10),
        max_retry_after: Duration::from_secs(20),
        attempt_timeout: None,
    })
}

/// `Retry-After` says how long to wait before the next attempt: a 503 or a
/// fresh 409 with `Retry-After: 7` is retried 7 s later (on tokio's paused
/// clock), not after the client's own 10 ms backoff; one longer than
/// `max_retry_after` (20 s here) waits that long only. Every attempt carries
/// the intent's key and its body.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retry_after_sets_the_pause_before_the_next_attempt() {
    let body = serde_json::json!({"amount_cents": 450});
    for (refusal, waited) in [
        ("503 Service Unavailable", "7"),
        ("409 Conflict", "7"),
        ("429 Too Many Requests", "3600"),
    ] {
        let server = Scripted::start(move |n| {
            if n == 1 {
                response(refusal, &[&format!("retry-after: {waited}")], "")
            } else {
                response("201 Created", &[], "ok")
            }
        })
        .await;
        let intent = paused_clock_client(3)
            .intent(Method::POST, &format!("{}/payments", server.base))
            .unwrap()
            .json(&body)
            .unwrap();
        let answer = intent.send().await.expect("answered");
        assert_eq!((answer.status().as_u16(), answer.attempts()), (201, 2));
        let received = server.received();
        assert_eq!(received.len(), 2, "{refusal}");
        let pause = received[1].at - received[0].at;
        let expected = Duration::from_secs(waited.parse::<u64>().unwrap().min(20));
        assert!(
            pause >= expected && pause < expected + Duration::from_secs(1),
            "{refusal} with Retry-After {waited}: the next attempt came {pause:?} later"
        );
        for r in &received {
            assert_eq!(r.key.as_deref(), Some(intent.key()), "{refusal}");
            assert_eq!(r.body, serde_json::to_vec(&body).unwrap(), "{refusal}");
        }
    }
}

/// Which answers are final (returned after one attempt) and which are tried
/// again, from any server: a 428 (the server wants a precondition) or a 422
/// is final like any 4xx without `Retry-After`; a replay
/// (`Idempotent-Replayed: true`) is final whatever its status; a 500
/// `response-not-recorded` problem is final (the handler ran); a 408 is final
/// whatever its headers; a fresh 409, 423, 425, 429, any other fresh 4xx
/// with `Retry-After` and every other 5xx are retried.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn final_and_retried_answers_from_any_server() {
    let not_recorded = format!(
        r#"{{"type":"{}","title":"t","status":500,"detail":"d"}}"#,
        idempotent_runtime::http::problem::types::RESPONSE_NOT_RECORDED
    );
    let problem = "content-type: application/problem+json";
    let replayed = "idempotent-replayed: true";
    let cases: Vec<(&str, Vec<&str>, String, bool)> = vec![
        ("400 Bad Request", vec![], String::new(), false),
        ("408 Request Timeout", vec![], String::new(), false),
        (
            "422 Unprocessable Content",
            vec![problem],
            "{}".into(),
            false,
        ),
        (
            "428 Precondition Required",
            vec![problem],
            "{}".into(),
            false,
        ),
        ("409 Conflict", vec![replayed], String::new(), false),
        (
            "503 Service Unavailable",
            vec![replayed],
            String::new(),
            false,
        ),
        (
            "502 Bad Gateway",
            vec!["idempotent-replayed:  TRUE "],
            String::new(),
            false,
        ),
        (
            "500 Internal Server Error",
            vec![problem],
            not_recorded,
            false,
        ),
        // The server asks for the request again (a recover hook that
        // could not tell yet): retried; never a 408, nor a replay.
        (
            "424 Failed Dependency",
            vec!["retry-after: 1"],
            String::new(),
            true,
        ),
        (
            "400 Bad Request",
            vec!["retry-after: 1"],
            String::new(),
            true,
        ),
        (
            "408 Request Timeout",
            vec!["retry-after: 1"],
            String::new(),
            false,
        ),
        (
            "403 Forbidden",
            vec![replayed, "retry-after: 1"],
            String::new(),
            false,
        ),
        ("409 Conflict", vec![], String::new(), true),
        ("423 Locked", vec![], String::new(), true),
        ("425 Too Early", vec![], String::new(), true),
        ("429 Too Many Requests", vec![], String::new(), true),
        ("500 Internal Server Error", vec![], String::new(), true),
        ("502 Bad Gateway", vec![], String::new(), true),
        ("504 Gateway Timeout", vec![], String::new(), true),
        (
            "500 Internal Server Error",
            vec![problem],
            r#"{"type":"about:blank"}"#.into(),
            true,
        ),
    ];
    for (status_line, headers, body, retried) in cases {
        let answer = response(status_line, &headers, &body);
        let server = Scripted::start(move |_| answer.clone()).await;
        let sent = paused_clock_client(3)
            .intent(Method::POST, &format!("{}/payments", server.base))
            .unwrap()
            .json(&serde_json::json!({}))
            .unwrap()
            .send()
            .await;
        let what = format!("{status_line} {headers:?}");
        let status = status_line[..3].parse::<u16>().unwrap();
        if retried {
            assert!(
                matches!(
                    &sent,
                    Err(ClientError::RetriesExhausted {
                        attempts: 3,
                        last: LastAttempt::Status { status: s, .. },
                    }) if s.as_u16() == status
                ),
                "{what}: {sent:?}"
            );
            assert_eq!(server.received().len(), 3, "{what}");
        } else {
            let answer = sent.unwrap_or_else(|e| panic!("{what}: {e:?}"));
            assert_eq!(
                (answer.status().as_u16(), answer.attempts()),
                (status, 1),
                "{what}"
            );
            assert_eq!(server.received().len(), 1, "{what}");
        }
    }
}

/// A 5xx problem+json body is read before the client decides: it may be a
/// `response-not-recorded` problem (the handler ran; final). One larger than
/// the client reads cannot be told apart, so it is `AnswerTooLarge` after
/// one attempt, not retried unread (which would run the handler again).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_5xx_problem_too_large_to_read_is_not_retried() {
    let detail = "x".repeat(2048);
    let not_recorded = format!(
        r#"{{"type":"{}","title":"t","status":500,"detail":"{detail}"}}"#,
        idempotent_runtime::http::problem::types::RESPONSE_NOT_RECORDED
    );
    let answer = response(
        "500 Internal Server Error",
        &["content-type: application/problem+json"],
        &not_recorded,
    );
    let server = Scripted::start(move |_| answer.clone()).await;
    let sent = paused_clock_client(3)
        .with_max_answer_bytes(1024)
        .intent(Method::POST, &format!("{}/payments", server.base))
        .unwrap()
        .json(&serde_json::json!({}))
        .unwrap()
        .send()
        .await;
    assert!(
        matches!(
            &sent,
            Err(ClientError::AnswerTooLarge { status, limit: 1024 })
                if status.as_u16() == 500
        ),
        "{sent:?}"
    );
    assert_eq!(server.received().len(), 1, "tried once");
}

/// An intent's key is pinned to its request (the client hunt's lead: Stripe's
/// clients pin the key to the exact request). A request set up once and
/// cloned per order (`template.clone().json(&order)`) carried one key for
/// every order: a second order of the same amount was answered with the
/// first order's recorded charge (never charged, yet reported as paid). And
/// an intent changed after it was sent sent another request under its key.
/// A changed request is refused before anything is sent, or goes out as an
/// operation of its own; never as a replay of another's.
#[tokio::test]
async fn a_request_changed_after_its_intent_was_cloned_or_sent_never_goes_out_under_its_key() {
    let Some(pg) = common::servers::pg_store_or_skip().await else {
        return;
    };
    let server = TestServer::start(Arc::new(pg), |b| b).await;
    let a = fresh_tenant();
    let c = client();
    let order = serde_json::json!({"amount_cents": 450, "currency": "EUR"});
    let refused = |e: &ClientError| {
        assert!(
            e.to_string().contains("nothing was sent"),
            "the refusal says what happened: {e}"
        );
    };
    // Two orders of the same amount from one template.
    let template = c
        .intent(Method::POST, &server.url("/payments"))
        .expect("intent")
        .header("x-account-id", &a)
        .expect("header");
    let mut charged = 0;
    for n in 1..=2 {
        match template.clone().json(&order).expect("body").send().await {
            Err(e) => refused(&e),
            Ok(r) => {
                assert!(
                    !r.is_replayed(),
                    "order {n} was answered with another order's charge: {:?}",
                    r.body()
                );
                assert_eq!(r.status(), 201, "order {n}");
                charged += 1;
            }
        }
    }
    assert_eq!(server.shop.charges_of(&a).len(), charged);

    // An intent changed after it was sent.
    let sent = c
        .intent(Method::POST, &server.url("/payments"))
        .expect("intent")
        .header("x-account-id", &a)
        .expect("header")
        .json(&order)
        .expect("body");
    assert_eq!(sent.send().await.expect("sent").status(), 201);
    charged += 1;
    let changed = sent
        .json(&serde_json::json!({"amount_cents": 99999, "currency": "EUR"}))
        .expect("body");
    match changed.send().await {
        Err(e) => refused(&e),
        Ok(r) => {
            assert!(
                r.status() == 201 && !r.is_replayed(),
                "a changed request went out under a sent intent's key: {} {:?}",
                r.status(),
                r.body()
            );
            charged += 1;
        }
    }
    assert_eq!(server.shop.charges_of(&a).len(), charged);
}
