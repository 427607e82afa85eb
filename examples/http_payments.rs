//! A payment API over HTTP, made safe to retry by `IdempotencyLayer`.
//!
//! ```text
//! cargo run --example http_payments
//! ```
//!
//! * Store: a SQLite file (`$TMPDIR/idempotent-http-payments.db`), or
//!   PostgreSQL when `DATABASE_URL` is set. Charges are rows in the same
//!   database (`http_charges`, `http_refunds`).
//! * Address: `IDEMPOTENT_HTTP_ADDR` (default `127.0.0.1:3000`); prints
//!   `listening on http://ADDR` once it accepts connections.
//! * `IDEMPOTENT_LEASE_MS`: the lease of a running charge (default 30000),
//!   to try a crash by hand: kill the server during a slow charge, restart
//!   it, and retry after the lease.
//!
//! Routes (the tenant is the `X-Account-Id` header, standing in for real
//! authentication; without it the answer is 401):
//!
//! * `POST /payments` `{"amount_cents": 450, "currency": "EUR", "delay_ms": 0}`
//!   with `Idempotency-Key` → 201, `Location: /payments/<charge_id>`;
//!   `delay_ms` makes the simulated gateway slow. The gateway is asked with
//!   the request's key: a charge it made whose row could not be written
//!   (a 503, which releases the key) is not made again by the retry, and
//!   the key sent again with another amount or currency is refused (422).
//! * `GET /payments/<charge_id>` → the charge, to its own account only.
//! * `POST /refunds` `{"charge_id": "..."}` with `Idempotency-Key`: the
//!   extractor style — the handler calls an `#[idempotent]` function. A
//!   charge is refunded once: a second refund of it, under another key, is
//!   422 `already-refunded`.
//! * `GET /metrics` → the runtime's metrics in Prometheus text (no auth).

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idempotent_runtime::http::problem::Problem;
use idempotent_runtime::http::{IdempotencyKey, IdempotencyLayer, MarkReplayed};
use idempotent_runtime::purge::{Purger, PurgerConfig};
use idempotent_runtime::{
    carry_outcome, idempotent, with_outcome, Error, PgStore, SqliteStore, Store,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::Instrument;

/// The authenticated caller (here: whatever `X-Account-Id` says).
#[derive(Debug, Clone)]
struct AccountId(String);

impl std::fmt::Display for AccountId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Deserialize)]
struct ChargeRequest {
    amount_cents: u64,
    currency: String,
    /// How long the simulated gateway takes, in milliseconds.
    #[serde(default)]
    delay_ms: u64,
}

#[derive(Debug, Serialize)]
struct Charge {
    charge_id: String,
    amount_cents: u64,
    currency: String,
}

#[derive(Debug, Deserialize, Serialize)]
struct RefundRequest {
    charge_id: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Refund {
    refund_id: String,
    charge_id: String,
    amount_cents: u64,
}

/// The database of the charges: the same one the idempotency records live in.
#[derive(Clone)]
enum Db {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

const SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS http_charges (charge_id TEXT PRIMARY KEY, account TEXT NOT NULL, \
     amount_cents BIGINT NOT NULL, currency TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS http_refunds (refund_id TEXT PRIMARY KEY, charge_id TEXT NOT NULL, \
     account TEXT NOT NULL)",
    // A charge is refunded once, whatever the keys: two clicks on "refund"
    // are two intents with two keys, and the idempotency key only makes each
    // of them run once.
    "CREATE UNIQUE INDEX IF NOT EXISTS http_refunds_one_per_charge ON http_refunds (charge_id)",
];

impl Db {
    async fn migrate(&self) -> Result<(), sqlx::Error> {
        for statement in SCHEMA {
            match self {
                Db::Sqlite(p) => sqlx::query(statement).execute(p).await.map(drop)?,
                Db::Postgres(p) => sqlx::query(statement).execute(p).await.map(drop)?,
            }
        }
        Ok(())
    }

    async fn insert_charge(&self, account: &str, charge: &Charge) -> Result<(), sqlx::Error> {
        let amount = i64::try_from(charge.amount_cents).unwrap_or(i64::MAX);
        match self {
            // The charge's id is the gateway's: a retry after a failure
            // here writes the same row, once.
            Db::Sqlite(p) => sqlx::query(
                "INSERT INTO http_charges VALUES (?, ?, ?, ?) ON CONFLICT (charge_id) DO NOTHING",
            )
                .bind(&charge.charge_id)
                .bind(account)
                .bind(amount)
                .bind(&charge.currency)
                .execute(p)
                .await
                .map(drop),
            Db::Postgres(p) => sqlx::query(
                "INSERT INTO http_charges VALUES ($1, $2, $3, $4) ON CONFLICT (charge_id) DO NOTHING",
            )
                .bind(&charge.charge_id)
                .bind(account)
                .bind(amount)
                .bind(&charge.currency)
                .execute(p)
                .await
                .map(drop),
        }
    }

    async fn charge(&self, account: &str, charge_id: &str) -> Result<Option<Charge>, sqlx::Error> {
        let row: Option<(String, i64, String)> = match self {
            Db::Sqlite(p) => {
                sqlx::query_as("SELECT charge_id, amount_cents, currency FROM http_charges WHERE account = ? AND charge_id = ?")
                    .bind(account).bind(charge_id).fetch_optional(p).await?
            }
            Db::Postgres(p) => {
                sqlx::query_as("SELECT charge_id, amount_cents, currency FROM http_charges WHERE account = $1 AND charge_id = $2")
                    .bind(account).bind(charge_id).fetch_optional(p).await?
            }
        };
        Ok(row.map(|(charge_id, amount, currency)| Charge {
            charge_id,
            amount_cents: u64::try_from(amount).unwrap_or_default(),
            currency,
        }))
    }

    async fn insert_refund(
        &self,
        refund_id: &str,
        charge_id: &str,
        account: &str,
    ) -> Result<(), sqlx::Error> {
        match self {
            Db::Sqlite(p) => sqlx::query("INSERT INTO http_refunds VALUES (?, ?, ?)")
                .bind(refund_id)
                .bind(charge_id)
                .bind(account)
                .execute(p)
                .await
                .map(drop),
            Db::Postgres(p) => sqlx::query("INSERT INTO http_refunds VALUES ($1, $2, $3)")
                .bind(refund_id)
                .bind(charge_id)
                .bind(account)
                .execute(p)
                .await
                .map(drop),
        }
    }
}

struct App {
    db: Db,
    store: Arc<dyn Store>,
    gateway: Gateway,
}

type Shared = Arc<App>;

fn problem(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Response {
    Problem::new(
        status,
        &format!("urn:example:payments:{slug}"),
        title,
        detail,
    )
    .into_response()
}

/// Stands in for authentication: `X-Account-Id` names the caller.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get("x-account-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned);
    match account {
        Some(account) => {
            request.extensions_mut().insert(AccountId(account));
            next.run(request).await
        }
        None => problem(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "Not authenticated",
            "Send an X-Account-Id header naming your account.",
        ),
    }
}

/// The simulated card gateway. Like a real one (Stripe, Adyen, ...), it
/// takes an idempotency key of its own, and the handler passes the request's:
/// a request whose charge went through but could not be written here (the
/// database failed after the gateway answered) is answered 503, which
/// releases the key, and the client's retry runs the handler again; asked
/// with the same key, the gateway answers with the charge it made instead of
/// charging the card a second time. A key reused for another amount or
/// currency is refused, as a real gateway refuses it: answering with the
/// charge made would record a charge the card never saw. (This one keeps its
/// keys in memory, so a restart forgets them; a real gateway keeps them,
/// Stripe for 24 hours.)
#[derive(Default)]
struct Gateway {
    /// The charge made for each (account, key).
    charges: Mutex<HashMap<(String, String), GatewayCharge>>,
}

/// A charge the gateway made: its id, and what it charged.
#[derive(Clone)]
struct GatewayCharge {
    id: String,
    amount_cents: u64,
    currency: String,
}

/// The gateway's refusal of a key it charged other parameters under.
struct KeyReusedAtGateway;

impl Gateway {
    /// Charges once per (account, key); answers the charge's id, or refuses
    /// a key reused for another amount or currency.
    async fn charge(
        &self,
        account: &str,
        key: &IdempotencyKey,
        amount_cents: u64,
        currency: &str,
        delay: Duration,
    ) -> Result<String, KeyReusedAtGateway> {
        let made = (account.to_owned(), key.as_str().to_owned());
        let same = |charge: &GatewayCharge| {
            charge.amount_cents == amount_cents && charge.currency == currency
        };
        if let Some(charge) = self.made(&made) {
            if !same(&charge) {
                tracing::warn!(
                    account,
                    "gateway: key reused for another amount or currency"
                );
                return Err(KeyReusedAtGateway);
            }
            tracing::info!(account, charge_id = %charge.id, "gateway: already charged for this key");
            return Ok(charge.id);
        }
        // The raw key is never logged.
        tracing::info!(
            account,
            amount_cents,
            currency,
            delay_ms = delay.as_millis() as u64,
            "gateway: charging"
        );
        tokio::time::sleep(delay).await;
        let charge = {
            let mut charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
            charges
                .entry(made)
                .or_insert_with(|| GatewayCharge {
                    id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
                    amount_cents,
                    currency: currency.to_owned(),
                })
                .clone()
        };
        if !same(&charge) {
            return Err(KeyReusedAtGateway);
        }
        tracing::info!(account, amount_cents, currency, "gateway: charged");
        Ok(charge.id)
    }

    fn made(&self, made: &(String, String)) -> Option<GatewayCharge> {
        let charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
        charges.get(made).cloned()
    }
}

async fn create_payment(
    State(app): State<Shared>,
    Extension(account): Extension<AccountId>,
    key: IdempotencyKey,
    Json(request): Json<ChargeRequest>,
) -> Response {
    if request.amount_cents == 0 {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-amount",
            "Invalid amount",
            "amount_cents must be a positive whole number of cents.",
        );
    }
    if request.currency.len() != 3 || !request.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-currency",
            "Invalid currency",
            "currency must be an ISO 4217 code of three capital letters, e.g. \"EUR\".",
        );
    }
    let delay = Duration::from_millis(request.delay_ms.min(600_000));
    // The request's key goes to the gateway: past this point the card is
    // charged, and a failure below releases the key (a 503).
    let Ok(charge_id) = app
        .gateway
        .charge(
            &account.0,
            &key,
            request.amount_cents,
            &request.currency,
            delay,
        )
        .await
    else {
        // Only after a failure released the key (a 5xx): here a reused key
        // is refused before the handler runs.
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "key-reused-at-gateway",
            "Idempotency key reused",
            "This Idempotency-Key was charged for another amount or currency. \
             Retry that charge with its own request, or use a new key for this one.",
        );
    };
    let charge = Charge {
        charge_id,
        amount_cents: request.amount_cents,
        currency: request.currency,
    };
    if let Err(e) = app.db.insert_charge(&account.0, &charge).await {
        tracing::error!(error = %e, "could not record the charge");
        // A 5xx releases the idempotency key: the client's retry runs the
        // handler again, and the gateway, asked with the same key, answers
        // with this charge instead of making a second one.
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database",
            "Database unavailable",
            "The charge could not be recorded. Retry with the same Idempotency-Key.",
        );
    }
    tracing::info!(account = %account, charge_id = %charge.charge_id, "charge recorded");
    let mut headers = HeaderMap::new();
    if let Ok(location) = format!("/payments/{}", charge.charge_id).parse() {
        headers.insert(header::LOCATION, location);
    }
    (StatusCode::CREATED, headers, Json(charge)).into_response()
}

async fn get_payment(
    State(app): State<Shared>,
    Extension(account): Extension<AccountId>,
    Path(charge_id): Path<String>,
) -> Response {
    match app.db.charge(&account.0, &charge_id).await {
        Ok(Some(charge)) => Json(charge).into_response(),
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "No such charge",
            "This account has no charge with that id.",
        ),
        Err(e) => {
            tracing::error!(error = %e, "could not read the charge");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "database",
                "Database unavailable",
                "Try again later.",
            )
        }
    }
}

/// Why a refund failed.
#[derive(Debug, thiserror::Error)]
enum RefundError {
    #[error("no charge {0} on this account")]
    NoSuchCharge(String),
    #[error("charge {0} is already refunded")]
    AlreadyRefunded(String),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Idempotency(#[from] Error),
    #[error("the server is shutting down")]
    ShuttingDown,
}

impl IntoResponse for RefundError {
    fn into_response(self) -> Response {
        match self {
            RefundError::NoSuchCharge(id) => problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "No such charge",
                format!("This account has no charge {id}; refund one of your own charges."),
            ),
            RefundError::AlreadyRefunded(id) => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "already-refunded",
                "Already refunded",
                format!("Charge {id} is already refunded; a charge is refunded once."),
            ),
            RefundError::Database(e) => {
                tracing::error!(error = %e, "refund failed");
                problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database",
                    "Database unavailable",
                    "Retry with the same Idempotency-Key.",
                )
            }
            // Rule 22's statuses: 409 + Retry-After, 422, 400, 503, ...
            RefundError::Idempotency(e) => e.into_response(),
            RefundError::ShuttingDown => problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting-down",
                "Shutting down",
                "Retry with the same Idempotency-Key.",
            ),
        }
    }
}

/// Refunds a charge once per (account, key): the extractor style, where the
/// handler passes the key to an `#[idempotent]` function.
#[idempotent(scope = "payments.refund", key = key, tenant = account, store = app.store, skip(app))]
async fn refund(
    app: &App,
    account: &str,
    key: &str,
    charge_id: &str,
) -> Result<Refund, RefundError> {
    let charge = app
        .db
        .charge(account, charge_id)
        .await?
        .ok_or_else(|| RefundError::NoSuchCharge(charge_id.to_owned()))?;
    let refund_id = format!("re_{}", uuid::Uuid::new_v4().simple());
    app.db
        .insert_refund(&refund_id, charge_id, account)
        .await
        .map_err(|e| match e {
            sqlx::Error::Database(d) if d.is_unique_violation() => {
                RefundError::AlreadyRefunded(charge_id.to_owned())
            }
            e => RefundError::Database(e),
        })?;
    Ok(Refund {
        refund_id,
        charge_id: charge.charge_id,
        amount_cents: charge.amount_cents,
    })
}

async fn create_refund(
    State(app): State<Shared>,
    Extension(account): Extension<AccountId>,
    key: IdempotencyKey,
    Json(request): Json<RefundRequest>,
) -> Result<(StatusCode, MarkReplayed, Json<Refund>), RefundError> {
    // Run to its end in a task of its own: a client that hangs up drops this
    // handler, and a refund dropped halfway would be released (rule 14) and
    // run again by the retry. `carry_outcome` lets the spawned call still tell
    // `with_outcome` whether it replayed.
    let (joined, outcome) = with_outcome(async move {
        let call = async move { refund(&app, &account.0, key.as_str(), &request.charge_id).await };
        // The request's span goes with it, so its logs stay under the request.
        tokio::spawn(carry_outcome(call).in_current_span()).await
    })
    .await;
    let result = match joined {
        Ok(result) => result,
        // A panic in the refund goes on as the handler's own.
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            // Cancelled: only when the runtime shuts down.
            Err(_) => return Err(RefundError::ShuttingDown),
        },
    };
    Ok((StatusCode::CREATED, MarkReplayed(outcome), Json(result?)))
}

async fn open_store() -> Result<(Db, Arc<dyn Store>, String), Box<dyn std::error::Error>> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => {
            let store = PgStore::connect(&url).await?;
            let db = Db::Postgres(store.pool().clone());
            Ok((db, Arc::new(store), "PostgreSQL (DATABASE_URL)".to_owned()))
        }
        _ => {
            let path = std::env::temp_dir().join("idempotent-http-payments.db");
            let store = SqliteStore::connect(&format!("sqlite://{}", path.display())).await?;
            let db = Db::Sqlite(store.pool().clone());
            Ok((db, Arc::new(store), format!("SQLite ({})", path.display())))
        }
    }
}

/// Builds the application: the routes, the idempotency layer, authentication.
fn router(
    app: Shared,
    lease: Duration,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
) -> Result<Router, Box<dyn std::error::Error>> {
    let payments = IdempotencyLayer::builder("payments.charge", app.store.clone())
        .tenant_from_extension::<AccountId>()
        .lease(lease)
        // Only a charge's answer is recorded: a 4xx releases the key. A
        // recorded 422 for a key the gateway refused (reused for another
        // amount after a 503) would hold the key for that request's body,
        // and the first request's own retry, whose charge the card saw,
        // would be refused as a reused key, its charge never recorded. The
        // other 4xx (a body that does not validate) answer the same again.
        .record_when(|status| status.is_success() || status.is_redirection())
        .build()?;
    Ok(Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/{charge_id}", get(get_payment))
        .route_layer(payments)
        .route("/refunds", post(create_refund))
        // Authentication runs first (outermost), so the layer sees the tenant.
        .layer(middleware::from_fn(authenticate))
        // Operators' view, outside authentication: the runtime's counters and
        // histograms (by scope and outcome, never key or tenant) for Prometheus.
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        )
        .with_state(app))
}

#[tokio::main]
pub async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let addr =
        std::env::var("IDEMPOTENT_HTTP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let lease = match std::env::var("IDEMPOTENT_LEASE_MS") {
        Ok(ms) => Duration::from_millis(
            ms.parse()
                .map_err(|e| format!("IDEMPOTENT_LEASE_MS={ms:?}: {e}"))?,
        ),
        Err(_) => Duration::from_secs(30),
    };

    let (db, store, described) = open_store().await?;
    db.migrate().await?;
    tracing::info!("store: {described}; lease {lease:?}");
    // Retention really runs: expired records are deleted in the background.
    let purger = Purger::spawn(
        store.clone(),
        PurgerConfig {
            interval: Duration::from_secs(60),
            batch: 1000,
        },
    );
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let app = router(
        Arc::new(App {
            db,
            store,
            gateway: Gateway::default(),
        }),
        lease,
        metrics,
    )?;

    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e} (set IDEMPOTENT_HTTP_ADDR)"))?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    purger.shutdown().await;
    Ok(())
}
