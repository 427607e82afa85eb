//! An attacker's hunt on rule 22 (DESIGN.md §4) and the README's HTTP
//! section, written from the contract only. A request body that stalls
//! before the layer has it whole holds no key. A duplicate waiting for a
//! request whose handler panics is answered as soon as that request is gone
//! (it runs the handler, or takes the kept record over and asks the recover
//! hook), on the same server or on another one with a store of its own on
//! the same database. A record kept for a takeover belongs to its request:
//! another request under its key is 422, a burst of its retries over two
//! servers takes it over once. Records of another version left in progress:
//! an `http1` one is taken over by its retry, a newer one is left alone
//! (503). Look-alike principals over two servers never share an answer, and
//! waiting duplicates on two servers run once after a released 5xx.

use crate::common::servers::fresh_tenant;
use crate::http_app::{bounded, serve, serve_on_loopback};
use crate::http_retry_contract::{every_store, Observed};

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use futures::future::BoxFuture;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::{Recovery, Store, Takeover};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};

/// An HTTP/1.1 answer read to the end of its connection.
struct Answer {
    status: u16,
    replayed: bool,
    body: Vec<u8>,
}

/// The attempts a recover hook was asked at, in order.
type Asked = Arc<std::sync::Mutex<Vec<u32>>>;

/// A recover hook that notes the attempt it is asked at in `asked` and
/// answers that the provider already did the work (201 "found at the provider").
fn found_at_the_provider(
    asked: &Asked,
) -> impl Fn(Takeover) -> BoxFuture<'static, Result<Recovery<Response>, Response>> + Send + Sync {
    let asked = asked.clone();
    move |takeover: Takeover| {
        let asked = asked.clone();
        Box::pin(async move {
            asked.lock().unwrap().push(takeover.attempt());
            Ok(Recovery::Completed(
                (StatusCode::CREATED, "found at the provider").into_response(),
            ))
        })
    }
}

/// Reads an answer from `stream` (sent with `connection: close`) to its end.
async fn read_answer(mut stream: TcpStream) -> Answer {
    let mut raw = Vec::new();
    bounded("the answer", stream.read_to_end(&mut raw))
        .await
        .expect("read");
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    Answer {
        status: head[9..12].parse().expect("status"),
        replayed: head.contains("\r\nidempotent-replayed: true"),
        body: raw[end + 4..].to_vec(),
    }
}

/// A request body that stalls halfway (its client has sent the head and
/// part of the body, and keeps the connection open) holds no key: the layer
/// reserves only once it has the whole body, so a duplicate with the whole
/// body runs at once (`reject_in_progress`: a key held would be 409), and
/// when the stalled body ends, that request replays the duplicate's answer.
/// The handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_stalls_holds_no_key_and_blocks_no_duplicate_on_every_store() {
    for (name, store) in every_store().await {
        // The handshake: the layer asked for the tenant, so it has the
        // request's head and is reading its body.
        let asked = Arc::new(watch::channel(0usize).0);
        let layer = IdempotencyLayer::builder("hunt.stalled_body", store)
            .tenant_from({
                let asked = asked.clone();
                move |parts| {
                    asked.send_modify(|n| *n += 1);
                    parts
                        .headers
                        .get("x-account")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                }
            })
            .reject_in_progress()
            .build()
            .expect("layer");
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = {
            let runs = runs.clone();
            move |body: Bytes| {
                let runs = runs.clone();
                async move {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    (
                        StatusCode::CREATED,
                        format!("run {run}: {} bytes", body.len()),
                    )
                }
            }
        };
        let app = Router::new()
            .route("/notes", post(handler))
            .route_layer(layer);
        let (addr, task) = serve_on_loopback(app).await;
        let account = fresh_tenant();
        let body = b"0123456789abcdef";
        let head = format!(
            "POST /notes HTTP/1.1\r\nhost: t\r\nconnection: close\r\nx-account: {account}\r\n\
             idempotency-key: stall-1\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let connect =
            |addr: SocketAddr| async move { TcpStream::connect(addr).await.expect("connect") };
        let mut stalled = connect(addr).await;
        stalled.write_all(head.as_bytes()).await.expect("head");
        stalled.write_all(&body[..5]).await.expect("part");
        let mut seen = asked.subscribe();
        bounded(
            "the stalled request in the layer",
            seen.wait_for(|&n| n >= 1),
        )
        .await
        .expect("layer alive");

        let mut duplicate = connect(addr).await;
        duplicate.write_all(head.as_bytes()).await.expect("head");
        duplicate.write_all(body).await.expect("body");
        let first = read_answer(duplicate).await;
        assert_eq!(
            (first.status, first.replayed, first.body.as_slice()),
            (201, false, &b"run 1: 16 bytes"[..]),
            "{name}: the stalled body held the key: {}",
            String::from_utf8_lossy(&first.body)
        );

        stalled.write_all(&body[5..]).await.expect("rest");
        let late = read_answer(stalled).await;
        assert_eq!(
            (late.status, late.replayed, late.body),
            (201, true, first.body),
            "{name}: the stalled request, once whole, replays"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{name}: the handler ran once"
        );
        task.abort();
    }
}

/// The first run of the handler waits at `gate`, then panics; every later
/// run answers 201 with its number (after waiting at `gate` too, once
/// `hold_later` is set).
struct PanicsFirst {
    runs: AtomicUsize,
    entered: watch::Sender<usize>,
    gate: Semaphore,
    hold_later: std::sync::atomic::AtomicBool,
}

impl PanicsFirst {
    fn new() -> Arc<Self> {
        Arc::new(PanicsFirst {
            runs: AtomicUsize::new(0),
            entered: watch::channel(0).0,
            gate: Semaphore::new(0),
            hold_later: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn route(self: &Arc<Self>, layer: IdempotencyLayer) -> Router {
        let state = self.clone();
        let handler = move || {
            let state = state.clone();
            async move {
                let run = state.runs.fetch_add(1, Ordering::SeqCst) + 1;
                state.entered.send_modify(|n| *n += 1);
                if run == 1 {
                    state.gate.acquire().await.expect("gate").forget();
                    panic!("the first run panics after its side effect");
                }
                if state.hold_later.load(Ordering::SeqCst) {
                    state.gate.acquire().await.expect("gate").forget();
                }
                (StatusCode::CREATED, format!("run {run}"))
            }
        };
        Router::new()
            .route("/charges", post(handler))
            .route_layer(layer)
    }
}

/// The bound a duplicate waits for: long enough that a duplicate left
/// waiting for a record nobody runs is answered 409 (the defect) rather
/// than by the handler or the hook. Under [`bounded`]'s limit.
const LONG_WAIT: Duration = Duration::from_secs(40);

/// Sends the first request (its handler held, then panicking) and a
/// duplicate that waits in the layer for it; lets the handler panic and
/// returns the duplicate's answer (status, replayed, body).
async fn duplicate_of_a_panicking_request(
    base: &str,
    store: &Observed,
    state: &PanicsFirst,
) -> (u16, bool, String) {
    let account = fresh_tenant();
    let send = {
        let (base, account) = (base.to_owned(), account.clone());
        move || {
            let (base, account) = (base.clone(), account.clone());
            async move {
                reqwest::Client::new()
                    .post(format!("{base}/charges"))
                    .header("x-account", account)
                    .header("idempotency-key", "panics-1")
                    .body("{}")
                    .send()
                    .await
            }
        }
    };
    let first = tokio::spawn(send());
    let mut entered = state.entered.subscribe();
    bounded(
        "the first run in the handler",
        entered.wait_for(|&n| n >= 1),
    )
    .await
    .expect("alive");
    let duplicate = tokio::spawn(send());
    store.wait_for_a_waiter().await;
    state.gate.add_permits(1);
    let first = bounded("the panicking request", first).await.expect("task");
    assert!(
        first
            .as_ref()
            .map_or(true, |r| r.status().is_server_error()),
        "the panic is no answer: {first:?}"
    );
    let answer = bounded("the duplicate", duplicate)
        .await
        .expect("task")
        .expect("an answer");
    (
        answer.status().as_u16(),
        answer.headers().contains_key("idempotent-replayed"),
        answer.text().await.expect("body"),
    )
}

fn account_of(parts: &axum::http::request::Parts) -> Option<String> {
    parts
        .headers
        .get("x-account")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Rules 4 and 14 through the layer: a duplicate waiting for a request
/// whose handler panics is not left waiting for a record nobody runs. The
/// panic releases the key, so the duplicate runs the handler itself (as a
/// waiting duplicate does behind a 5xx), well within its wait bound, and
/// gets that run's answer: not a 409 at the end of the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waiting_on_a_request_whose_handler_panics_runs_it_on_every_store() {
    for (name, store) in every_store().await {
        let observed = Observed::new(store);
        let layer =
            IdempotencyLayer::builder("hunt.panic_waiter", observed.clone() as Arc<dyn Store>)
                .tenant_from(account_of)
                .wait(LONG_WAIT)
                .lease(Duration::from_secs(120))
                .build()
                .expect("layer");
        let state = PanicsFirst::new();
        let (base, task) = serve(state.route(layer)).await;
        let answer = duplicate_of_a_panicking_request(&base, &observed, &state).await;
        assert_eq!(
            answer,
            (201, false, "run 2".to_owned()),
            "{name}: the waiting duplicate runs the handler once the panic released the key"
        );
        assert_eq!(state.runs(), 2, "{name}");
        task.abort();
    }
}

/// Rules 4, 14 and 20 through the layer: behind a recover hook, a handler
/// that panics keeps its record with its lease ended. A duplicate already
/// waiting for it takes the record over then (it is not left waiting for a
/// lease nobody renews, and is not answered 409 at the end of its bound),
/// asks the hook, and gets the hook's answer; the handler does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waiting_on_a_panicking_handler_behind_a_hook_asks_the_hook_on_every_store() {
    for (name, store) in every_store().await {
        let observed = Observed::new(store);
        let asked = Asked::default();
        let hook = found_at_the_provider(&asked);
        let layer =
            IdempotencyLayer::builder("hunt.panic_waiter_hook", observed.clone() as Arc<dyn Store>)
                .tenant_from(account_of)
                .wait(LONG_WAIT)
                .lease(Duration::from_secs(120))
                .recover(hook)
                .build()
                .expect("layer");
        let state = PanicsFirst::new();
        let (base, task) = serve(state.route(layer)).await;
        let answer = duplicate_of_a_panicking_request(&base, &observed, &state).await;
        assert_eq!(
            answer,
            (201, false, "found at the provider".to_owned()),
            "{name}: the waiting duplicate took the record over and asked the hook"
        );
        assert_eq!(state.runs(), 1, "{name}: the handler ran once");
        assert_eq!(
            *asked.lock().unwrap(),
            [2],
            "{name}: asked once, as attempt 2"
        );
        task.abort();
    }
}

/// Two stores on one database (two servers' pools): a SQLite file, the
/// PostgreSQL and the MariaDB test servers.
async fn store_pairs() -> Vec<(&'static str, Arc<dyn Store>, Arc<dyn Store>)> {
    let url = crate::common::scratch::sqlite_url("hunt-pair");
    let sqlite = || async {
        Arc::new(
            idempotent_runtime::SqliteStore::connect(&url)
                .await
                .expect("SQLite file"),
        ) as Arc<dyn Store>
    };
    let mut pairs = vec![("sqlite", sqlite().await, sqlite().await)];
    if let (Some(a), Some(b)) = (
        crate::common::servers::pg_store_or_skip().await,
        crate::common::servers::pg_store_or_skip().await,
    ) {
        pairs.push(("postgres", Arc::new(a), Arc::new(b)));
    }
    if let (Some(a), Some(b)) = (
        crate::common::servers::mysql_store_or_skip().await,
        crate::common::servers::mysql_store_or_skip().await,
    ) {
        pairs.push(("mariadb", Arc::new(a), Arc::new(b)));
    }
    pairs
}

/// The same as the two tests above, with the duplicate on another server
/// (another store on the same database, which no in-process notification
/// reaches): a duplicate waiting there for a request whose handler panics
/// on the first server runs the handler once the panic released the key,
/// or, behind a recover hook, takes the record over once its lease was
/// ended and asks the hook; in neither case is it answered 409 at the end of
/// its wait bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_on_another_server_waiting_on_a_panicking_handler_is_answered_on_every_sql_store(
) {
    for (name, here, there) in store_pairs().await {
        for hooked in [false, true] {
            let scope = if hooked {
                "hunt.panic_waiter_elsewhere_hook"
            } else {
                "hunt.panic_waiter_elsewhere"
            };
            let asked = Asked::default();
            let observed = Observed::new(there.clone());
            let layer = |store: Arc<dyn Store>| {
                let builder = IdempotencyLayer::builder(scope, store)
                    .tenant_from(account_of)
                    .wait(LONG_WAIT)
                    .lease(Duration::from_secs(120))
                    .shared_scope();
                let builder = if hooked {
                    builder.recover(found_at_the_provider(&asked))
                } else {
                    builder
                };
                builder.build().expect("layer")
            };
            let state = PanicsFirst::new();
            let (first_base, first_task) = serve(state.route(layer(here.clone()))).await;
            let (other_base, other_task) =
                serve(state.route(layer(observed.clone() as Arc<dyn Store>))).await;
            let account = fresh_tenant();
            let send = |base: String| {
                let account = account.clone();
                async move {
                    reqwest::Client::new()
                        .post(format!("{base}/charges"))
                        .header("x-account", account)
                        .header("idempotency-key", "panics-elsewhere")
                        .body("{}")
                        .send()
                        .await
                }
            };
            let first = tokio::spawn(send(first_base));
            let mut entered = state.entered.subscribe();
            bounded(
                "the first run in the handler",
                entered.wait_for(|&n| n >= 1),
            )
            .await
            .expect("alive");
            let duplicate = tokio::spawn(send(other_base));
            observed.wait_for_a_waiter().await;
            state.gate.add_permits(1);
            let first = bounded("the panicking request", first).await.expect("task");
            assert!(
                first
                    .as_ref()
                    .map_or(true, |r| r.status().is_server_error()),
                "{name}: the panic is no answer: {first:?}"
            );
            let answer = bounded("the duplicate", duplicate)
                .await
                .expect("task")
                .expect("an answer");
            let answer = (
                answer.status().as_u16(),
                answer.headers().contains_key("idempotent-replayed"),
                answer.text().await.expect("body"),
            );
            if hooked {
                assert_eq!(
                    answer,
                    (201, false, "found at the provider".to_owned()),
                    "{name}: the duplicate on the other server asked the hook"
                );
                assert_eq!(state.runs(), 1, "{name}");
                assert_eq!(*asked.lock().unwrap(), [2], "{name}");
            } else {
                assert_eq!(
                    answer,
                    (201, false, "run 2".to_owned()),
                    "{name}: the duplicate on the other server ran the handler"
                );
                assert_eq!(state.runs(), 2, "{name}");
            }
            first_task.abort();
            other_task.abort();
        }
    }
}

/// Rules 3 and 22 across two servers with stores of their own on one
/// database (two pools: no in-process notification or lock between them):
/// a burst of identical requests with one key from principals whose
/// spellings a careless store would merge (composed and decomposed `é`,
/// upper case, a trailing space, and two characters outside the Basic
/// Multilingual Plane, which a 3-byte `utf8` connection would both turn
/// into `?`), spread over both servers, runs the
/// handler once per principal; each principal's requests all get that
/// principal's answer, never another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_from_look_alike_principals_over_two_servers_runs_once_per_principal_on_every_sql_store(
) {
    const PER_PRINCIPAL: usize = 10;
    for (name, here, there) in store_pairs().await {
        let base = fresh_tenant();
        let principals: Vec<String> = [
            "caf\u{e9}",
            "cafe\u{301}",
            "CAF\u{c9}",
            "caf\u{e9} ",
            "\u{1f600}",
            "\u{1f601}",
        ]
        .iter()
        .map(|p| format!("{base}-{p}"))
        .collect();
        let tenant = {
            let principals = principals.clone();
            move |parts: &axum::http::request::Parts| {
                let i: usize = parts
                    .headers
                    .get("x-principal")?
                    .to_str()
                    .ok()?
                    .parse()
                    .ok()?;
                principals.get(i).cloned()
            }
        };
        let runs = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let entered = Arc::new(watch::channel(0usize).0);
        let gate = Arc::new(Semaphore::new(0));
        let handler = {
            let (runs, entered, gate, principals) = (
                runs.clone(),
                entered.clone(),
                gate.clone(),
                principals.clone(),
            );
            move |headers: axum::http::HeaderMap| {
                let (runs, entered, gate, principals) = (
                    runs.clone(),
                    entered.clone(),
                    gate.clone(),
                    principals.clone(),
                );
                async move {
                    let i: usize = headers["x-principal"].to_str().unwrap().parse().unwrap();
                    let run = {
                        let mut runs = runs.lock().unwrap();
                        runs.push(principals[i].clone());
                        runs.len()
                    };
                    entered.send_modify(|n| *n += 1);
                    gate.acquire().await.expect("gate").forget();
                    (
                        StatusCode::CREATED,
                        format!("run {run} for {:?}", principals[i]),
                    )
                }
            }
        };
        let observed = [Observed::new(here), Observed::new(there)];
        let mut bases = Vec::new();
        let mut tasks = Vec::new();
        for store in &observed {
            let layer =
                IdempotencyLayer::builder("hunt.look_alike_burst", store.clone() as Arc<dyn Store>)
                    .tenant_from(tenant.clone())
                    .wait(LONG_WAIT)
                    .shared_scope()
                    .build()
                    .expect("layer");
            let app = Router::new()
                .route("/charges", post(handler.clone()))
                .route_layer(layer);
            let (base, task) = serve(app).await;
            bases.push(base);
            tasks.push(task);
        }
        let send = |base: String, i: usize| async move {
            let r = reqwest::Client::new()
                .post(format!("{base}/charges"))
                .header("x-principal", i.to_string())
                .header("idempotency-key", "look-alike")
                .header("content-type", "application/json")
                .body(r#"{"amount":450}"#)
                .send()
                .await
                .expect("an answer");
            let replayed = r.headers().contains_key("idempotent-replayed");
            (
                i,
                r.status().as_u16(),
                replayed,
                r.text().await.expect("body"),
            )
        };
        let mut sent = Vec::new();
        for n in 0..PER_PRINCIPAL {
            for i in 0..principals.len() {
                sent.push(tokio::spawn(send(bases[(n + i) % 2].clone(), i)));
            }
        }
        let mut seen = entered.subscribe();
        bounded(
            "a run per principal",
            seen.wait_for(|&n| n >= principals.len()),
        )
        .await
        .expect("alive");
        for store in &observed {
            store.wait_for_a_waiter().await;
        }
        gate.add_permits(principals.len() * PER_PRINCIPAL);
        let mut answers: Vec<Vec<String>> = vec![Vec::new(); principals.len()];
        let mut fresh = 0;
        for r in sent {
            let (i, status, replayed, body) = bounded("a request", r).await.expect("task");
            assert_eq!(status, 201, "{name}: principal {i}: {body}");
            fresh += usize::from(!replayed);
            answers[i].push(body);
        }
        for (i, bodies) in answers.iter_mut().enumerate() {
            bodies.dedup();
            assert_eq!(bodies.len(), 1, "{name}: principal {i} got {bodies:?}");
            assert!(
                bodies[0].ends_with(&format!("for {:?}", principals[i])),
                "{name}: principal {i} got another's answer: {bodies:?}"
            );
        }
        assert_eq!(
            fresh,
            principals.len(),
            "{name}: one fresh answer per principal"
        );
        let mut ran = runs.lock().unwrap().clone();
        ran.sort();
        let mut expected = principals.clone();
        expected.sort();
        assert_eq!(ran, expected, "{name}: one run per principal");
        for task in tasks {
            task.abort();
        }
    }
}

/// Rules 7, 10 and 20 through the layer: a record kept for a takeover (its
/// handler panicked behind a recover hook, so its lease was ended) still
/// belongs to its request. Another request under its key (another amount)
/// is refused 422 `key-reused`: it does not take the record over, the hook
/// is not asked for it and the handler does not run. The first request's
/// own retry then takes the record over and asks the hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_kept_for_a_takeover_is_not_taken_over_by_another_request_on_every_store() {
    for (name, store) in every_store().await {
        let asked = Asked::default();
        let hook = found_at_the_provider(&asked);
        let layer = IdempotencyLayer::builder("hunt.kept_record_reused", store)
            .tenant_from(account_of)
            .reject_in_progress()
            .recover(hook)
            .build()
            .expect("layer");
        let state = PanicsFirst::new();
        state.gate.add_permits(1);
        let (base, task) = serve(state.route(layer)).await;
        let account = fresh_tenant();
        let send = |body: &'static str| {
            reqwest::Client::new()
                .post(format!("{base}/charges"))
                .header("x-account", &account)
                .header("idempotency-key", "kept-1")
                .header("content-type", "application/json")
                .body(body)
                .send()
        };
        let first = send(r#"{"amount":1}"#).await;
        assert!(
            first
                .as_ref()
                .map_or(true, |r| r.status().is_server_error()),
            "{name}: the panic is no answer: {first:?}"
        );
        let other = send(r#"{"amount":2}"#).await.expect("an answer");
        let status = other.status().as_u16();
        let text = other.text().await.expect("body");
        assert_eq!(
            status, 422,
            "{name}: another request under the kept record's key: {text}"
        );
        assert!(text.contains("key-reused"), "{name}: {text}");
        assert!(
            asked.lock().unwrap().is_empty(),
            "{name}: the hook was asked for it"
        );
        assert_eq!(state.runs(), 1, "{name}: the handler ran for it");
        let retry = send(r#"{ "amount" : 1.0 }"#).await.expect("an answer");
        assert_eq!(
            (retry.status().as_u16(), retry.text().await.expect("body")),
            (201, "found at the provider".to_owned()),
            "{name}: the first request's retry asks the hook"
        );
        assert_eq!(*asked.lock().unwrap(), [2], "{name}");
        assert_eq!(state.runs(), 1, "{name}");
        task.abort();
    }
}

/// A server on a SQLite file store whose layer (`scope`, duplicates refused
/// at once) has the [`found_at_the_provider`] hook noting into `asked`, in
/// front of a [`PanicsFirst`] handler; the store's pool, to look at and
/// rewrite its records.
async fn hooked_sqlite_server(
    scope: &'static str,
    asked: &Asked,
) -> (
    sqlx::SqlitePool,
    Arc<PanicsFirst>,
    String,
    tokio::task::JoinHandle<()>,
) {
    let store = crate::http_app::sqlite_file().await;
    let pool = store.pool().clone();
    let layer = IdempotencyLayer::builder(scope, Arc::new(store) as Arc<dyn Store>)
        .tenant_from(account_of)
        .reject_in_progress()
        .recover(found_at_the_provider(asked))
        .build()
        .expect("layer");
    let state = PanicsFirst::new();
    let (base, task) = serve(state.route(layer)).await;
    (pool, state, base, task)
}

/// The README's rolling deploy, through a takeover: a record an earlier
/// version (`http1` fingerprints) left in progress when its handler died
/// (here: panicked behind a recover hook, so its lease is ended; the record
/// is then rewritten to its `http1` form, as that version made it) is taken
/// over by the same request's retry reaching this version ("one it takes
/// over from an earlier version's owner that died keeps `http1`"): the hook
/// is asked and its answer recorded and replayed, not refused 422 as a
/// reused key (which the client takes for final, leaving the side effect
/// unrecorded). And while such a record's owner still runs, a duplicate is
/// told 409 in-progress, not 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_record_left_in_progress_is_taken_over_by_its_retry_not_refused() {
    use idempotent_runtime::http::request_fingerprint;
    let asked = Asked::default();
    let (pool, state, base, task) = hooked_sqlite_server("hunt.http1_takeover", &asked).await;
    let account = fresh_tenant();
    const BODY: &str = r#"{"amount":1}"#;
    let send = |key: &'static str| {
        reqwest::Client::new()
            .post(format!("{base}/charges"))
            .header("x-account", &account)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(BODY)
            .send()
    };
    let mut headers = axum::http::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    let current = request_fingerprint(
        &axum::http::Method::POST,
        "/charges",
        &headers,
        BODY.as_bytes(),
    );
    let old = current.legacy().expect("an http1 form").as_str().to_owned();
    let make_http1 = || async {
        sqlx::query("UPDATE idempotency_records SET fingerprint = ? WHERE fingerprint = ? AND state = 'in_progress'")
            .bind(&old)
            .bind(current.as_str())
            .execute(&pool)
            .await
            .expect("make the record an http1 one")
            .rows_affected()
    };

    // A record left in progress with its lease ended.
    let mut entered = state.entered.subscribe();
    let first = tokio::spawn(send("http1-died"));
    bounded("the first run", entered.wait_for(|&n| n >= 1))
        .await
        .expect("alive");
    state.gate.add_permits(1);
    let first = bounded("the panicking request", first).await.expect("task");
    assert!(
        first
            .as_ref()
            .map_or(true, |r| r.status().is_server_error()),
        "{first:?}"
    );
    assert_eq!(
        make_http1().await,
        1,
        "the kept record is rewritten as http1"
    );
    let retry = send("http1-died").await.expect("an answer");
    let answer = (retry.status().as_u16(), retry.text().await.expect("body"));
    assert_eq!(
        answer,
        (201, "found at the provider".to_owned()),
        "the retry of an http1 record left in progress takes it over and asks the hook"
    );
    let again = send("http1-died").await.expect("an answer");
    assert!(
        again.headers().contains_key("idempotent-replayed"),
        "{again:?}"
    );
    assert_eq!(*asked.lock().unwrap(), [2]);
    assert_eq!(state.runs(), 1);
    let kept: String =
        sqlx::query_scalar("SELECT fingerprint FROM idempotency_records WHERE \"key\" = ?")
            .bind("http1-died")
            .fetch_one(&pool)
            .await
            .expect("the record");
    assert_eq!(
        kept, old,
        "the record taken over keeps its http1 fingerprint"
    );

    // A live owner on an http1 record: a duplicate is 409, not 422.
    state.hold_later.store(true, Ordering::SeqCst);
    let second = tokio::spawn(send("http1-running"));
    bounded("the second run", entered.wait_for(|&n| n >= 2))
        .await
        .expect("alive");
    assert_eq!(
        make_http1().await,
        1,
        "the running record is rewritten as http1"
    );
    let duplicate = send("http1-running").await.expect("an answer");
    let status = duplicate.status().as_u16();
    let text = duplicate.text().await.expect("body");
    assert_eq!(status, 409, "a duplicate of a running http1 record: {text}");
    state.gate.add_permits(1);
    let second = bounded("the running request", second)
        .await
        .expect("task")
        .expect("an answer");
    assert_eq!(second.status(), 201);
    let retry = send("http1-running").await.expect("an answer");
    assert!(
        retry.headers().contains_key("idempotent-replayed"),
        "the http1 record, completed, replays to its retry: {retry:?}"
    );
    assert_eq!(state.runs(), 2);
    task.abort();
}

/// The other side of a rolling deploy: a record a newer version left in
/// progress when its handler died (a fingerprint form this version does
/// not know, `http9:`, its lease ended) cannot be compared with the request
/// at hand, so this version must not take it over: it answers 503
/// `recorded-by-newer-version` with `Retry-After: 1`, runs nothing, asks no
/// hook and leaves the record as it is (for the newer version to take over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_versions_record_left_in_progress_is_not_taken_over() {
    use idempotent_runtime::http::problem::types;
    let asked = Asked::default();
    let (pool, state, base, task) = hooked_sqlite_server("hunt.newer_takeover", &asked).await;
    state.gate.add_permits(1);
    let account = fresh_tenant();
    let send = || {
        reqwest::Client::new()
            .post(format!("{base}/charges"))
            .header("x-account", &account)
            .header("idempotency-key", "newer-died")
            .header("content-type", "application/json")
            .body(r#"{"amount":1}"#)
            .send()
    };
    let first = send().await;
    assert!(
        first
            .as_ref()
            .map_or(true, |r| r.status().is_server_error()),
        "{first:?}"
    );
    let newer = format!("http9:{}", "ab".repeat(32));
    let rewritten = sqlx::query(
        "UPDATE idempotency_records SET fingerprint = ? WHERE fingerprint LIKE 'http2:%' AND state = 'in_progress'",
    )
    .bind(&newer)
    .execute(&pool)
    .await
    .expect("make the record a newer version's")
    .rows_affected();
    assert_eq!(
        rewritten, 1,
        "the kept record is rewritten as a newer version's"
    );
    let retry = send().await.expect("an answer");
    let status = retry.status().as_u16();
    let retry_after = retry.headers().get("retry-after").cloned();
    let text = retry.text().await.expect("body");
    assert_eq!(status, 503, "{text}");
    assert!(text.contains(types::RECORDED_BY_NEWER_VERSION), "{text}");
    assert_eq!(retry_after.as_ref().map(|v| v.as_bytes()), Some(&b"1"[..]));
    assert!(asked.lock().unwrap().is_empty(), "the hook was asked");
    assert_eq!(state.runs(), 1, "the handler ran again");
    let stored: (String, String) =
        sqlx::query_as("SELECT fingerprint, state FROM idempotency_records WHERE \"key\" = ?")
            .bind("newer-died")
            .fetch_one(&pool)
            .await
            .expect("the record");
    assert_eq!(
        stored,
        (newer, "in_progress".to_owned()),
        "the record is untouched"
    );
    task.abort();
}

/// Rule 22's "5xx answers release the key", raced across two servers with
/// stores of their own on one database: duplicates wait on both servers
/// while the first request runs; it answers 500, which releases the key.
/// Exactly one waiting duplicate then runs the handler, and every other
/// one replays that run's answer: the release does not let two of them
/// run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_duplicates_on_two_servers_run_once_after_a_released_5xx_on_every_sql_store() {
    const DUPLICATES: usize = 8;
    for (name, here, there) in store_pairs().await {
        let runs = Arc::new(AtomicUsize::new(0));
        let entered = Arc::new(watch::channel(0usize).0);
        let gate = Arc::new(Semaphore::new(0));
        let handler = {
            let (runs, entered, gate) = (runs.clone(), entered.clone(), gate.clone());
            move || {
                let (runs, entered, gate) = (runs.clone(), entered.clone(), gate.clone());
                async move {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    entered.send_modify(|n| *n += 1);
                    if run == 1 {
                        gate.acquire().await.expect("gate").forget();
                        return (
                            StatusCode::INTERNAL_SERVER_ERROR,
                            format!("run {run} failed"),
                        );
                    }
                    (StatusCode::CREATED, format!("run {run}"))
                }
            }
        };
        let observed = [Observed::new(here), Observed::new(there)];
        let mut bases = Vec::new();
        let mut tasks = Vec::new();
        for store in &observed {
            let layer = IdempotencyLayer::builder(
                "hunt.released_5xx_two_servers",
                store.clone() as Arc<dyn Store>,
            )
            .tenant_from(account_of)
            .wait(LONG_WAIT)
            .shared_scope()
            .build()
            .expect("layer");
            let app = Router::new()
                .route("/charges", post(handler.clone()))
                .route_layer(layer);
            let (base, task) = serve(app).await;
            bases.push(base);
            tasks.push(task);
        }
        let account = fresh_tenant();
        let send = |base: String| {
            let account = account.clone();
            async move {
                let r = reqwest::Client::new()
                    .post(format!("{base}/charges"))
                    .header("x-account", account)
                    .header("idempotency-key", "released-5xx")
                    .body("{}")
                    .send()
                    .await
                    .expect("an answer");
                let replayed = r.headers().contains_key("idempotent-replayed");
                (r.status().as_u16(), replayed, r.text().await.expect("body"))
            }
        };
        let first = tokio::spawn(send(bases[0].clone()));
        let mut seen = entered.subscribe();
        bounded("the first run", seen.wait_for(|&n| n >= 1))
            .await
            .expect("alive");
        let duplicates: Vec<_> = (0..DUPLICATES)
            .map(|i| tokio::spawn(send(bases[i % 2].clone())))
            .collect();
        for store in &observed {
            store.wait_for_a_waiter().await;
        }
        gate.add_permits(1);
        let first = bounded("the first request", first).await.expect("task");
        assert_eq!(first, (500, false, "run 1 failed".to_owned()), "{name}");
        let mut fresh = 0;
        for d in duplicates {
            let (status, replayed, body) = bounded("a duplicate", d).await.expect("task");
            assert_eq!((status, body.as_str()), (201, "run 2"), "{name}");
            fresh += usize::from(!replayed);
        }
        assert_eq!(
            fresh, 1,
            "{name}: one duplicate ran, the others replayed it"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");
        for task in tasks {
            task.abort();
        }
    }
}

/// Rules 3, 10 and 20 across two servers with stores of their own on one
/// database: a record kept for a takeover (its handler panicked behind a
/// recover hook) met by a burst of retries on both servers at once is taken
/// over by exactly one of them. The hook is asked once (attempt 2), every
/// other retry waits for its answer and replays it, and the handler does
/// not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_retries_on_two_servers_takes_a_kept_record_over_once_on_every_sql_store() {
    const RETRIES: usize = 8;
    for (name, here, there) in store_pairs().await {
        let asked = Asked::default();
        let hook_entered = Arc::new(watch::channel(0usize).0);
        let hook_gate = Arc::new(Semaphore::new(0));
        let observed = [Observed::new(here), Observed::new(there)];
        let state = PanicsFirst::new();
        state.gate.add_permits(1);
        let mut bases = Vec::new();
        let mut tasks = Vec::new();
        for store in &observed {
            let hook = {
                let (asked, hook_entered, hook_gate) =
                    (asked.clone(), hook_entered.clone(), hook_gate.clone());
                move |takeover: Takeover| {
                    let (asked, hook_entered, hook_gate) =
                        (asked.clone(), hook_entered.clone(), hook_gate.clone());
                    async move {
                        asked.lock().unwrap().push(takeover.attempt());
                        hook_entered.send_modify(|n| *n += 1);
                        hook_gate.acquire().await.expect("gate").forget();
                        Ok(Recovery::Completed(
                            (StatusCode::CREATED, "found at the provider").into_response(),
                        ))
                    }
                }
            };
            let layer = IdempotencyLayer::builder(
                "hunt.kept_record_burst",
                store.clone() as Arc<dyn Store>,
            )
            .tenant_from(account_of)
            .wait(LONG_WAIT)
            .recover(hook)
            .shared_scope()
            .build()
            .expect("layer");
            let (base, task) = serve(state.route(layer)).await;
            bases.push(base);
            tasks.push(task);
        }
        let account = fresh_tenant();
        let send = |base: String| {
            let account = account.clone();
            async move {
                reqwest::Client::new()
                    .post(format!("{base}/charges"))
                    .header("x-account", account)
                    .header("idempotency-key", "kept-burst")
                    .body("{}")
                    .send()
                    .await
            }
        };
        let first = send(bases[0].clone()).await;
        assert!(
            first
                .as_ref()
                .map_or(true, |r| r.status().is_server_error()),
            "{name}: the panic is no answer: {first:?}"
        );
        let retries: Vec<_> = (0..RETRIES)
            .map(|i| tokio::spawn(send(bases[i % 2].clone())))
            .collect();
        let mut seen = hook_entered.subscribe();
        bounded("the hook asked", seen.wait_for(|&n| n >= 1))
            .await
            .expect("alive");
        for store in &observed {
            store.wait_for_a_waiter().await;
        }
        hook_gate.add_permits(RETRIES);
        let mut fresh = 0;
        for r in retries {
            let r = bounded("a retry", r)
                .await
                .expect("task")
                .expect("an answer");
            let replayed = r.headers().contains_key("idempotent-replayed");
            let answer = (r.status().as_u16(), r.text().await.expect("body"));
            assert_eq!(answer, (201, "found at the provider".to_owned()), "{name}");
            fresh += usize::from(!replayed);
        }
        assert_eq!(fresh, 1, "{name}: one retry took the record over");
        assert_eq!(
            *asked.lock().unwrap(),
            [2],
            "{name}: the hook was asked once"
        );
        assert_eq!(state.runs(), 1, "{name}: the handler ran once");
        for task in tasks {
            task.abort();
        }
    }
}
