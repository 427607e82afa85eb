//! Requests per second through `IdempotencyLayer`, against the same handler
//! without it, from a load generator on loopback in the same run.
//!
//! ```text
//! cargo bench --bench http_layer             # memory, SQLite, PostgreSQL (when reachable)
//! cargo bench --bench http_layer -- sqlite   # only scenarios whose name contains "sqlite"
//! ```
//!
//! One axum server in process with two routes on the same trivial handler
//! (a 201 with a small JSON body): `/plain` without the layer, `/idem` with
//! it. The load generator (reqwest, 16 concurrent connections) posts the same
//! JSON body to both. Per store, three scenarios: the handler alone, the layer
//! with a fresh key per request (reserve + complete: two store round trips)
//! and the layer replaying one recorded key per connection (one round trip).
//! Each scenario is bounded in requests and in time, and the rounds alternate
//! (plain, fresh, replay, plain, ...) so machine noise hits all alike.

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::{MemoryStore, PgStore, SqliteStore, Store};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CONNECTIONS: usize = 16;
const MAX_REQUESTS: u64 = 6_000;
const MAX_TIME: Duration = Duration::from_secs(6);
const ROUNDS: usize = 2;
const BODY: &str = r#"{"amount_cents":450,"currency":"EUR","note":"bench"}"#;

async fn handler() -> impl IntoResponse {
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::LOCATION, "/payments/ch_1"),
        ],
        r#"{"charge_id":"ch_1","amount_cents":450,"currency":"EUR"}"#,
    )
}

async fn serve(store: Arc<dyn Store>, scope: &str) -> String {
    let layer = IdempotencyLayer::builder(scope, store)
        .tenant_from(|parts| {
            parts
                .headers
                .get("x-account-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/idem", post(handler).route_layer(layer))
        .route("/plain", post(handler));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    Fresh,
    Replay,
}

/// Requests per second of `CONNECTIONS` loops posting to `url`.
async fn load(client: &reqwest::Client, url: &str, keys: Keys, run: &str) -> f64 {
    let sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + MAX_TIME;
    let mut tasks = Vec::new();
    for conn in 0..CONNECTIONS {
        let (client, url, sent) = (client.clone(), url.to_owned(), sent.clone());
        let replay_key = format!("{run}-replay-{conn}");
        let prefix = format!("{run}-fresh-{conn}");
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline && sent.fetch_add(1, Ordering::Relaxed) < MAX_REQUESTS {
                let key = match keys {
                    Keys::Fresh => format!("{prefix}-{i}"),
                    Keys::Replay => replay_key.clone(),
                };
                i += 1;
                let r = client
                    .post(&url)
                    .header("x-account-id", "acct_bench")
                    .header("idempotency-key", key)
                    .header("content-type", "application/json")
                    .body(BODY)
                    .send()
                    .await
                    .expect("request");
                assert_eq!(r.status(), 201, "bench request failed");
                r.bytes().await.expect("body");
            }
            i
        }));
    }
    let mut done = 0;
    for t in tasks {
        done += t.await.expect("load task");
    }
    done as f64 / start.elapsed().as_secs_f64()
}

async fn scenario(name: &str, store: Arc<dyn Store>, rows: &mut Vec<String>) {
    let run = uuid::Uuid::new_v4().simple().to_string();
    let base = serve(store, &format!("bench.http.{name}")).await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CONNECTIONS)
        .build()
        .expect("client");
    let (plain, idem) = (format!("{base}/plain"), format!("{base}/idem"));
    // Warm up, and record the replay keys.
    load(&client, &plain, Keys::Fresh, &run).await;
    load(&client, &idem, Keys::Replay, &run).await;
    let (mut p, mut f, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        p.push(load(&client, &plain, Keys::Fresh, &run).await);
        f.push(load(&client, &idem, Keys::Fresh, &format!("{run}-{round}")).await);
        r.push(load(&client, &idem, Keys::Replay, &run).await);
    }
    let range = |v: &[f64], base: &[f64]| {
        let ratios: Vec<f64> = v.iter().zip(base).map(|(a, b)| a / b).collect();
        let lo = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().cloned().fold(0.0, f64::max);
        format!("{lo:.2}–{hi:.2}×")
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let line = format!(
        "{name:<9} handler alone {:>7.0} req/s | layer, fresh keys {:>7.0} req/s ({}) | layer, replays {:>7.0} req/s ({})",
        mean(&p),
        mean(&f),
        range(&f, &p),
        mean(&r),
        range(&r, &p)
    );
    println!("{line}");
    rows.push(line);
}

#[tokio::main(worker_threads = 2)]
async fn main() {
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .filter(|a| a != "http_layer");
    let wants = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    println!(
        "{CONNECTIONS} connections on loopback, at most {MAX_REQUESTS} requests or {MAX_TIME:?} per scenario, {ROUNDS} rounds; ratios against the handler alone"
    );
    let mut rows = Vec::new();
    if wants("memory") {
        scenario("memory", Arc::new(MemoryStore::new()), &mut rows).await;
    }
    if wants("sqlite") {
        let path = std::env::temp_dir().join(format!(
            "idempotent-bench-http-{}.db",
            uuid::Uuid::new_v4().simple()
        ));
        let store = SqliteStore::connect(&format!("sqlite://{}", path.display()))
            .await
            .expect("SQLite");
        scenario("sqlite", Arc::new(store), &mut rows).await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }
    if wants("postgres") {
        let url = std::env::var("IDEMPOTENT_PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        match PgStore::connect(&url).await {
            Ok(store) => scenario("postgres", Arc::new(store), &mut rows).await,
            Err(e) => println!("postgres  SKIPPED: unreachable at {url} ({e})"),
        }
    }
}
