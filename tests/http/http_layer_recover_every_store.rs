//! Rules 20 and 22 through the layer's `recover` hook on every store
//! (memory, SQLite, PostgreSQL, MariaDB): the hook is told the tenant from
//! the authenticated principal, the layer's scope, the key, the attempt
//! number and when the previous attempt started; its `Completed` answer is
//! recorded and replayed with `Idempotent-Replayed: true` and the recorded
//! headers, never to another tenant; its `Err` answer is sent, the record is
//! kept, and the next retry asks again as the next attempt, told when the
//! attempt it takes over started. The handler never runs for a record a
//! hook answered.

use crate::common::logs::Logs;
use crate::http_app::{authenticate, serve, AccountId};
use crate::http_retry_contract::every_store;
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::{Identity, RecordState, Recovery, Takeover};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A handler that counts its runs (the counter it answers with) and
/// answers `answer(n)`, `n` the number of its run, from 1.
fn counting_handler<R: Send + 'static>(
    answer: impl Fn(usize) -> R + Clone + Send + Sync + 'static,
) -> (
    Arc<AtomicUsize>,
    impl Fn() -> std::future::Ready<R> + Clone + Send + Sync + 'static,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = move || std::future::ready(answer(counter.fetch_add(1, Ordering::SeqCst) + 1));
    (runs, handler)
}

/// Serves `POST /charges` by `handler` behind `layer`, the caller
/// authenticated; the base URL and the server's task.
async fn serve_charges<H, T>(
    handler: H,
    layer: IdempotencyLayer,
) -> (String, tokio::task::JoinHandle<()>)
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    let app = Router::new()
        .route("/charges", post(handler))
        .route_layer(layer)
        .layer(middleware::from_fn(authenticate));
    serve(app).await
}

/// A `POST {base}/charges` of `{}` as `account` with `key`: its status,
/// whether it was a replay, and its body.
async fn post_charge(base: String, account: String, key: &str) -> (u16, bool, String) {
    let r = reqwest::Client::new()
        .post(format!("{base}/charges"))
        .header("x-account-id", &account)
        .header("idempotency-key", key)
        .body("{}")
        .send()
        .await
        .expect("request");
    let replayed = r.headers().contains_key("idempotent-replayed");
    (r.status().as_u16(), replayed, r.text().await.expect("body"))
}

/// What the hook was told: tenant, scope, key, attempt, previous start (ms).
type Asked = (String, String, String, u32, i64);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layers_hook_is_told_the_takeover_and_its_answers_follow_rule_22_on_every_store() {
    const SCOPE: &str = "huntb.layer_recover";
    for (name, store) in every_store().await {
        let asked: Arc<Mutex<Vec<Asked>>> = Arc::default();
        let provider_down = Arc::new(AtomicBool::new(true));
        let hook = {
            let (asked, provider_down) = (asked.clone(), provider_down.clone());
            move |t: Takeover| {
                let (asked, provider_down) = (asked.clone(), provider_down.clone());
                async move {
                    asked.lock().unwrap().push((
                        t.tenant().to_owned(),
                        t.scope().to_owned(),
                        t.key().to_owned(),
                        t.attempt(),
                        t.previous_attempt_started_at_ms(),
                    ));
                    if t.key() == "k-down" && provider_down.load(Ordering::SeqCst) {
                        return Err(
                            (StatusCode::BAD_GATEWAY, "provider unreachable").into_response()
                        );
                    }
                    Ok(Recovery::Completed(
                        (
                            StatusCode::CREATED,
                            [(header::LOCATION, format!("/charges/{}", t.key()))],
                            format!("found {} at the provider", t.key()),
                        )
                            .into_response(),
                    ))
                }
            }
        };
        let layer = IdempotencyLayer::builder(SCOPE, store.clone())
            .tenant_from_extension::<AccountId>()
            .recover(hook)
            .build()
            .expect("layer");
        let (runs, handler) = counting_handler(|_| (StatusCode::CREATED, "charged by the handler"));
        let (base, task) = serve_charges(handler, layer).await;
        let account = crate::common::servers::fresh_tenant();
        let other = crate::common::servers::fresh_tenant();

        // What a crashed instance leaves: records in progress whose 1 ms
        // lease has run out by the time a retry comes.
        let mut planted_start = std::collections::HashMap::new();
        for key in ["k-found", "k-down"] {
            let identity = Identity::new(account.clone(), SCOPE, key).unwrap();
            crate::common::records::crashed(&*store, &identity).await;
            let snapshot = store.fetch(&identity).await.unwrap().expect("record");
            planted_start.insert(key, snapshot.attempt_started_at_ms);
        }
        let send = |who: &str, key: &str| {
            reqwest::Client::new()
                .post(format!("{base}/charges"))
                .header("x-account-id", who)
                .header("idempotency-key", key)
                .body("{}")
                .send()
        };
        let answer = |r: reqwest::Response| async move {
            let replayed = r
                .headers()
                .get("idempotent-replayed")
                .map(|v| v.to_str().unwrap().to_owned());
            let location = r
                .headers()
                .get("location")
                .map(|v| v.to_str().unwrap().to_owned());
            (
                r.status().as_u16(),
                replayed,
                location,
                r.text().await.expect("body"),
            )
        };

        // Completed: recorded and sent; the retry replays status, body and
        // the recorded Location with Idempotent-Replayed: true.
        let first = answer(send(&account, "k-found").await.unwrap()).await;
        assert_eq!(
            first,
            (
                201,
                None,
                Some("/charges/k-found".to_owned()),
                "found k-found at the provider".to_owned()
            ),
            "{name}"
        );
        let replay = answer(send(&account, "k-found").await.unwrap()).await;
        assert_eq!(
            replay,
            (
                201,
                Some("true".to_owned()),
                Some("/charges/k-found".to_owned()),
                "found k-found at the provider".to_owned()
            ),
            "{name}"
        );
        let identity = Identity::new(account.clone(), SCOPE, "k-found").unwrap();
        let snapshot = store.fetch(&identity).await.unwrap().expect("record");
        assert_eq!(
            (snapshot.state, snapshot.attempt, snapshot.recovered),
            (RecordState::Complete, 2, true),
            "{name}"
        );

        // Another tenant with the same key: its own request, run by the
        // handler (nothing to take over, the hook is not asked).
        let theirs = answer(send(&other, "k-found").await.unwrap()).await;
        assert_eq!(
            theirs,
            (201, None, None, "charged by the handler".to_owned()),
            "{name}: another tenant's recovered answer"
        );

        // Err: sent, the record kept; the next retry is attempt 3, told
        // when attempt 2 started.
        let refused = send(&account, "k-down").await.unwrap();
        assert!(refused.headers().get("retry-after").is_some(), "{name}");
        let refused = answer(refused).await;
        assert_eq!(
            (refused.0, refused.1, refused.3.as_str()),
            (502, None, "provider unreachable"),
            "{name}"
        );
        let down = Identity::new(account.clone(), SCOPE, "k-down").unwrap();
        let kept = store.fetch(&down).await.unwrap().expect("kept");
        assert_eq!(
            (kept.state, kept.attempt),
            (RecordState::InProgress, 2),
            "{name}"
        );
        let second_start = kept.attempt_started_at_ms;
        provider_down.store(false, Ordering::SeqCst);
        let found = answer(send(&account, "k-down").await.unwrap()).await;
        assert_eq!(
            (found.0, found.1, found.3.as_str()),
            (201, None, "found k-down at the provider"),
            "{name}"
        );
        let replay = answer(send(&account, "k-down").await.unwrap()).await;
        assert_eq!(replay.1.as_deref(), Some("true"), "{name}");

        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{name}: only the other tenant's ran"
        );
        let tell = |key: &str, attempt: u32, previous: i64| {
            (
                account.clone(),
                SCOPE.to_owned(),
                key.to_owned(),
                attempt,
                previous,
            )
        };
        assert_eq!(
            *asked.lock().unwrap(),
            [
                tell("k-found", 2, planted_start["k-found"]),
                tell("k-down", 2, planted_start["k-down"]),
                tell("k-down", 3, second_start),
            ],
            "{name}: asked once per takeover, with the principal as tenant"
        );
        task.abort();
    }
}

/// `HEAD` and `OPTIONS` with an `Idempotency-Key`, even one that is
/// malformed, pass through on every store: the handler runs each time,
/// nothing is reserved, recorded or replayed, and a later `POST` with the
/// same key is a fresh request.
#[tokio::test]
async fn head_and_options_with_a_key_pass_through_on_every_store() {
    for (name, store) in every_store().await {
        let (runs, handler) = counting_handler(|n| {
            (
                StatusCode::OK,
                [("x-run", n.to_string())],
                format!("run {n}"),
            )
        });
        let layer = IdempotencyLayer::builder("huntb.safe_with_key", store.clone())
            .tenant_from_extension::<AccountId>()
            .build()
            .expect("layer");
        let app = Router::new()
            .route(
                "/things",
                axum::routing::on(
                    axum::routing::MethodFilter::HEAD
                        .or(axum::routing::MethodFilter::OPTIONS)
                        .or(axum::routing::MethodFilter::POST),
                    handler,
                ),
            )
            .route_layer(layer)
            .layer(middleware::from_fn(authenticate));
        let (base, task) = serve(app).await;
        let account = crate::common::servers::fresh_tenant();
        let client = reqwest::Client::new();
        let mut expected = 0;
        for method in [reqwest::Method::HEAD, reqwest::Method::OPTIONS] {
            for key in ["k-safe", "k-safe", "\"unterminated"] {
                let r = client
                    .request(method.clone(), format!("{base}/things"))
                    .header("x-account-id", &account)
                    .header("idempotency-key", key)
                    .send()
                    .await
                    .expect("request");
                expected += 1;
                assert_eq!(r.status(), 200, "{name} {method} {key}");
                assert!(
                    r.headers().get("idempotent-replayed").is_none(),
                    "{name} {method} {key}"
                );
                assert_eq!(
                    r.headers()["x-run"].to_str().unwrap(),
                    expected.to_string(),
                    "{name} {method} {key}: the handler ran"
                );
            }
        }
        let identity = Identity::new(account.clone(), "huntb.safe_with_key", "k-safe").unwrap();
        assert!(
            store.fetch(&identity).await.unwrap().is_none(),
            "{name}: a safe method left a record"
        );
        let post = client
            .post(format!("{base}/things"))
            .header("x-account-id", &account)
            .header("idempotency-key", "k-safe")
            .send()
            .await
            .expect("post");
        assert_eq!(post.status(), 200, "{name}");
        assert!(
            post.headers().get("idempotent-replayed").is_none(),
            "{name}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), expected + 1, "{name}");
        task.abort();
    }
}

/// Rule 20's last sentence through the layer, on every store: every
/// takeover is logged (a warning naming the scope and the attempt, not the
/// raw key) and counted (`idempotent_takeovers_total{scope, attempt}`), by a
/// layer with a hook (attempts 2 and 3: its first answer was an `Err`, so
/// the record was kept) and by one without (attempt 2, the handler runs
/// again).
#[tokio::test]
async fn every_takeover_by_a_layer_is_logged_and_counted_with_its_attempt_on_every_store() {
    use crate::common::readings::{counter, readings};
    use metrics_util::debugging::DebuggingRecorder;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let (logs, _logs) = Logs::capture(tracing::Level::WARN);

    let stores = every_store().await;
    for (name, store) in &stores {
        let hooked_scope: &'static str =
            Box::leak(format!("huntb.takeover_count.hooked_{name}").into_boxed_str());
        let blind_scope: &'static str =
            Box::leak(format!("huntb.takeover_count.blind_{name}").into_boxed_str());
        let asks = Arc::new(AtomicUsize::new(0));
        let hook = {
            let asks = asks.clone();
            move |_: Takeover| {
                let asks = asks.clone();
                async move {
                    if asks.fetch_add(1, Ordering::SeqCst) == 0 {
                        Err((StatusCode::SERVICE_UNAVAILABLE, "cannot tell").into_response())
                    } else {
                        Ok(Recovery::Completed(
                            (StatusCode::CREATED, "found").into_response(),
                        ))
                    }
                }
            }
        };
        let hooked = IdempotencyLayer::builder(hooked_scope, store.clone())
            .tenant_from_extension::<AccountId>()
            .recover(hook)
            .build()
            .expect("layer");
        let blind = IdempotencyLayer::builder(blind_scope, store.clone())
            .tenant_from_extension::<AccountId>()
            .build()
            .expect("layer");
        let (runs, handler) = counting_handler(|_| (StatusCode::CREATED, "charged by the handler"));
        let app = Router::new()
            .route("/hooked", post(handler.clone()).route_layer(hooked))
            .route("/blind", post(handler).route_layer(blind))
            .layer(middleware::from_fn(authenticate));
        let (base, task) = serve(app).await;
        let account = crate::common::servers::fresh_tenant();
        for scope in [hooked_scope, blind_scope] {
            let identity = Identity::new(account.clone(), scope, "SECRET-takeover-key").unwrap();
            crate::common::records::crashed(&**store, &identity).await;
        }
        let send = |path: &str| {
            reqwest::Client::new()
                .post(format!("{base}{path}"))
                .header("x-account-id", &account)
                .header("idempotency-key", "SECRET-takeover-key")
                .send()
        };
        assert_eq!(send("/hooked").await.unwrap().status(), 503, "{name}");
        assert_eq!(send("/hooked").await.unwrap().status(), 201, "{name}");
        assert_eq!(send("/blind").await.unwrap().status(), 201, "{name}");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{name}: the blind takeover ran it"
        );
        task.abort();

        let readings = readings(&snapshotter);
        let takeovers = |scope: &str, attempt: &str| {
            counter(
                &readings,
                "idempotent_takeovers_total",
                &[("scope", scope), ("attempt", attempt)],
            )
        };
        assert_eq!(
            (
                takeovers(hooked_scope, "2"),
                takeovers(hooked_scope, "3"),
                takeovers(blind_scope, "2"),
                takeovers(blind_scope, "3"),
            ),
            (1, 1, 1, 0),
            "{name}: {readings:#?}"
        );
        let text = logs.text();
        let took_over = |scope: &str, attempt: u32| {
            text.lines()
                .filter(|l| {
                    l.contains("WARN")
                        && l.contains("took over")
                        && l.contains(scope)
                        && l.contains(&format!("attempt={attempt}"))
                })
                .count()
        };
        assert_eq!(
            (
                took_over(hooked_scope, 2),
                took_over(hooked_scope, 3),
                took_over(blind_scope, 2),
            ),
            (1, 1, 1),
            "{name}: {text}"
        );
        assert!(
            !text.contains("SECRET-takeover-key"),
            "{name}: the raw key was logged"
        );
    }
}

/// Rule 22's "5xx answers release the key" after a long wait, on every
/// store: the first request's handler runs for longer than its lease (the
/// heartbeat renews it) while a duplicate waits; the handler then answers
/// 503. The duplicate is not answered with the 503, nor with 409: the key
/// was released, so it runs the handler itself as a fresh attempt (not a
/// takeover: the lease never lapsed), and its answer is what a retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_after_more_than_a_lease_while_a_duplicate_waits_lets_the_duplicate_run_on_every_store(
) {
    const SCOPE: &str = "huntb.long_5xx";
    let lease = Duration::from_secs(3);
    for (name, store) in every_store().await {
        let runs = Arc::new(AtomicUsize::new(0));
        let entered = tokio::sync::watch::channel(0usize).0;
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let handler = {
            let (runs, entered, gate) = (runs.clone(), entered.clone(), gate.clone());
            move || {
                let (runs, entered, gate) = (runs.clone(), entered.clone(), gate.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    entered.send_modify(|e| *e += 1);
                    if n == 1 {
                        let _permit = gate.acquire().await.expect("gate");
                        return (StatusCode::SERVICE_UNAVAILABLE, "try later".to_owned());
                    }
                    (StatusCode::CREATED, format!("run {n}"))
                }
            }
        };
        let layer = IdempotencyLayer::builder(SCOPE, store.clone())
            .tenant_from_extension::<AccountId>()
            .lease(lease)
            .wait(Duration::from_secs(60))
            .build()
            .expect("layer");
        let (base, task) = serve_charges(handler, layer).await;
        let account = crate::common::servers::fresh_tenant();
        let send = || post_charge(base.clone(), account.clone(), "k-long");
        let first = tokio::spawn(send());
        let mut rx = entered.subscribe();
        tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|&e| e >= 1))
            .await
            .expect("the first handler started")
            .expect("alive");
        let duplicate = tokio::spawn(send());
        // Until the store's clock shows more than a lease since the first
        // attempt started (bounded): the record is kept by renewals only.
        let identity = Identity::new(account.clone(), SCOPE, "k-long").unwrap();
        let mut polls = 0;
        loop {
            let s = store.fetch(&identity).await.unwrap().expect("record");
            assert_eq!(s.state, RecordState::InProgress, "{name}");
            assert_eq!(s.attempt, 1, "{name}: the duplicate took the record over");
            if s.now_ms - s.attempt_started_at_ms > lease.as_millis() as i64 + 500 {
                break;
            }
            polls += 1;
            assert!(polls < 600, "{name}: the store's clock did not move on");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            !duplicate.is_finished(),
            "{name}: the duplicate did not wait"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
        gate.add_permits(1);
        let first = tokio::time::timeout(Duration::from_secs(60), first)
            .await
            .expect("first")
            .expect("task");
        assert_eq!((first.0, first.1), (503, false), "{name}");
        let duplicate = tokio::time::timeout(Duration::from_secs(60), duplicate)
            .await
            .expect("duplicate")
            .expect("task");
        assert_eq!(duplicate, (201, false, "run 2".to_owned()), "{name}");
        let s = store.fetch(&identity).await.unwrap().expect("record");
        assert_eq!(
            (s.state, s.attempt),
            (RecordState::Complete, 1),
            "{name}: a fresh attempt after the release, not a takeover"
        );
        let retry = send().await;
        assert_eq!(retry, (201, true, "run 2".to_owned()), "{name}");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");
        task.abort();
    }
}

/// Rule 21 through the layer, on every store: two layers built apart with
/// one scope, each saying `.shared_scope()` (a public and a partner server
/// accepting the same request), share one deduplication boundary. A request
/// running on one and its duplicate on the other run the handler once: the
/// duplicate waits and replays the first's answer, as do later retries on
/// either server. The registry lists both claimants, both shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shared_layers_on_two_servers_run_one_handler_per_request_on_every_store() {
    const SCOPE: &str = "huntb.shared_layers";
    for (name, store) in every_store().await {
        let runs = Arc::new(AtomicUsize::new(0));
        let entered = tokio::sync::watch::channel(0usize).0;
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let handler = {
            let (runs, entered, gate) = (runs.clone(), entered.clone(), gate.clone());
            move |server: axum::extract::State<&'static str>| {
                let (runs, entered, gate) = (runs.clone(), entered.clone(), gate.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    entered.send_modify(|e| *e += 1);
                    let _permit = gate.acquire().await.expect("gate");
                    (StatusCode::CREATED, format!("refund {n} by {}", server.0))
                }
            }
        };
        let public = IdempotencyLayer::builder(SCOPE, store.clone())
            .tenant_from_extension::<AccountId>()
            .shared_scope()
            .wait(Duration::from_secs(60))
            .build()
            .expect("layer");
        let partner = IdempotencyLayer::builder(SCOPE, store.clone())
            .tenant_from_extension::<AccountId>()
            .shared_scope()
            .wait(Duration::from_secs(60))
            .build()
            .expect("layer");
        let mut bases = Vec::new();
        let mut tasks = Vec::new();
        for (server, layer) in [("public", public), ("partner", partner)] {
            let app = Router::new()
                .route("/refunds", post(handler.clone()))
                .route_layer(layer)
                .layer(middleware::from_fn(authenticate))
                .with_state(server);
            let (base, task) = serve(app).await;
            bases.push(base);
            tasks.push(task);
        }
        let account = crate::common::servers::fresh_tenant();
        let send = |base: String, key: &'static str| {
            let account = account.clone();
            async move {
                let r = reqwest::Client::new()
                    .post(format!("{base}/refunds"))
                    .header("x-account-id", &account)
                    .header("idempotency-key", key)
                    .header("content-type", "application/json")
                    .body(r#"{"order":8891}"#)
                    .send()
                    .await
                    .expect("request");
                let replayed = r.headers().contains_key("idempotent-replayed");
                (r.status().as_u16(), replayed, r.text().await.expect("body"))
            }
        };
        for (key, (first_on, then_on)) in [("k-1", (0, 1)), ("k-2", (1, 0))] {
            let before = *entered.borrow();
            let first = tokio::spawn(send(bases[first_on].clone(), key));
            let mut rx = entered.subscribe();
            tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|&e| e > before))
                .await
                .expect("the first handler started")
                .expect("alive");
            let duplicate = tokio::spawn(send(bases[then_on].clone(), key));
            gate.add_permits(1);
            let first = tokio::time::timeout(Duration::from_secs(60), first)
                .await
                .expect("first")
                .expect("task");
            assert_eq!((first.0, first.1), (201, false), "{name} {key}");
            // Were the duplicate to run the handler, it would not hang.
            gate.add_permits(1);
            let duplicate = tokio::time::timeout(Duration::from_secs(60), duplicate)
                .await
                .expect("duplicate")
                .expect("task");
            assert_eq!(duplicate, (201, true, first.2.clone()), "{name} {key}");
            for base in &bases {
                let retry = send(base.clone(), key).await;
                assert_eq!(retry, (201, true, first.2.clone()), "{name} {key}");
            }
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            2,
            "{name}: one run per request"
        );
        for task in tasks {
            task.abort();
        }
    }
    let claimants: Vec<_> = idempotent_runtime::registry::scopes()
        .into_iter()
        .filter(|i| i.scope == SCOPE)
        .collect();
    assert!(claimants.len() >= 2, "{claimants:?}");
    assert!(claimants.iter().all(|i| i.shared_scope), "{claimants:?}");
    let mut lines: Vec<u32> = claimants.iter().map(|i| i.line).collect();
    lines.sort_unstable();
    lines.dedup();
    assert_eq!(lines.len(), 2, "both build sites listed: {claimants:?}");
}

/// Rule 22's "5xx answers release the key" holds on a layer with a recover
/// hook too, on every store: the hook covers an instance that died, not the
/// handler's own answers. A handler's 503 releases the key; the retry is a
/// fresh request that runs the handler without asking the hook. After a
/// takeover whose hook answered `Run`, the handler's 503 releases the key
/// the same way, and the next retry runs the handler as a fresh attempt 1,
/// not asking again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_5xx_behind_a_hook_releases_the_key_and_the_retry_does_not_ask_on_every_store() {
    const SCOPE: &str = "huntb.hook_5xx";
    for (name, store) in every_store().await {
        let asked: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
        let hook = {
            let asked = asked.clone();
            move |t: Takeover| {
                let asked = asked.clone();
                async move {
                    asked
                        .lock()
                        .unwrap()
                        .push((t.key().to_owned(), t.attempt()));
                    Ok(Recovery::Run)
                }
            }
        };
        let (_runs, handler) = counting_handler(|n| {
            // Odd runs fail: each key's first run answers 503.
            if n % 2 == 1 {
                (StatusCode::SERVICE_UNAVAILABLE, format!("run {n} failed"))
            } else {
                (StatusCode::CREATED, format!("run {n}"))
            }
        });
        let layer = IdempotencyLayer::builder(SCOPE, store.clone())
            .tenant_from_extension::<AccountId>()
            .recover(hook)
            .build()
            .expect("layer");
        let (base, task) = serve_charges(handler, layer).await;
        let account = crate::common::servers::fresh_tenant();
        let send = |key: &'static str| post_charge(base.clone(), account.clone(), key);
        // A fresh request whose handler answers 503: released.
        assert_eq!(
            send("k-fresh").await,
            (503, false, "run 1 failed".into()),
            "{name}"
        );
        let gone = Identity::new(account.clone(), SCOPE, "k-fresh").unwrap();
        assert!(
            store.fetch(&gone).await.unwrap().is_none(),
            "{name}: released"
        );
        assert_eq!(
            send("k-fresh").await,
            (201, false, "run 2".into()),
            "{name}"
        );
        assert_eq!(send("k-fresh").await, (201, true, "run 2".into()), "{name}");

        // A takeover (hook: Run) whose handler answers 503: released too.
        let crashed = Identity::new(account.clone(), SCOPE, "k-crashed").unwrap();
        crate::common::records::crashed(&*store, &crashed).await;
        assert_eq!(
            send("k-crashed").await,
            (503, false, "run 3 failed".into()),
            "{name}"
        );
        assert!(
            store.fetch(&crashed).await.unwrap().is_none(),
            "{name}: released"
        );
        assert_eq!(
            send("k-crashed").await,
            (201, false, "run 4".into()),
            "{name}"
        );
        let s = store.fetch(&crashed).await.unwrap().expect("record");
        assert_eq!((s.state, s.attempt), (RecordState::Complete, 1), "{name}");
        assert_eq!(
            send("k-crashed").await,
            (201, true, "run 4".into()),
            "{name}"
        );
        assert_eq!(
            *asked.lock().unwrap(),
            [("k-crashed".to_owned(), 2)],
            "{name}: asked on the takeover only"
        );
        task.abort();
    }
}
