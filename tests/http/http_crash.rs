//! The example server (`examples/http_payments.rs`, built as the bin
//! `idempotent-http-payments`) is SIGKILLed while a slow charge is waiting on
//! the gateway, before anything is charged. After a restart, the client's
//! retry with the same key waits out the lease (409 + Retry-After), takes the
//! record over and charges exactly once; the takeover is in the new server's
//! log. On a SQLite file and, when reachable, on PostgreSQL.

use crate::common;

use common::servers::{fresh_tenant, pg_url, servers_required};
use idempotent_runtime::http::{IdempotentClient, RetryPolicy};
use reqwest::Method;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

const WAIT_LIMIT: Duration = Duration::from_secs(120);

/// A running example server and everything it printed.
struct Server {
    child: Child,
    base: String,
    lines: Arc<Mutex<Vec<String>>>,
    seen: watch::Receiver<usize>,
}

impl Server {
    async fn start(tmp: &Path, database_url: Option<&str>) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idempotent-http-payments"));
        command
            .env("IDEMPOTENT_HTTP_ADDR", "127.0.0.1:0")
            .env("IDEMPOTENT_LEASE_MS", "1500")
            .env("TMPDIR", tmp)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("DATABASE_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(url) = database_url {
            command.env("DATABASE_URL", url);
        }
        let mut child = command.spawn().expect("start the example server");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, seen) = watch::channel(0usize);
        let tx = Arc::new(tx);
        for stream in [
            Box::new(child.stdout.take().expect("stdout"))
                as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let (lines, tx) = (lines.clone(), tx.clone());
            tokio::spawn(async move {
                let mut reader = BufReader::new(stream).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    eprintln!("[server] {line}");
                    lines.lock().expect("lines").push(line);
                    tx.send_modify(|n| *n += 1);
                }
            });
        }
        let mut server = Server {
            child,
            base: String::new(),
            lines,
            seen,
        };
        let line = server.wait_line("listening on http://").await;
        server.base = line
            .split("listening on ")
            .nth(1)
            .expect("address")
            .trim()
            .to_owned();
        server
    }

    /// Waits for a printed line containing `needle` and returns it.
    async fn wait_line(&mut self, needle: &str) -> String {
        let lines = self.lines.clone();
        let found = tokio::time::timeout(
            WAIT_LIMIT,
            self.seen.wait_for(|_| {
                lines
                    .lock()
                    .expect("lines")
                    .iter()
                    .any(|l| l.contains(needle))
            }),
        )
        .await;
        assert!(
            matches!(found, Ok(Ok(_))),
            "the server never printed {needle:?}; it printed:\n{}",
            self.lines.lock().expect("lines").join("\n")
        );
        let all = self.lines.lock().expect("lines");
        all.iter()
            .find(|l| l.contains(needle))
            .cloned()
            .unwrap_or_default()
    }

    fn printed(&self, needle: &str) -> bool {
        self.lines
            .lock()
            .expect("lines")
            .iter()
            .any(|l| l.contains(needle))
    }

    async fn kill(&mut self) {
        self.child.start_kill().expect("SIGKILL");
        let status = tokio::time::timeout(WAIT_LIMIT, self.child.wait())
            .await
            .expect("the server exits")
            .expect("wait");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9), "killed by SIGKILL");
    }
}

async fn charges_of(database_url: &str, account: &str) -> i64 {
    let q = if database_url.starts_with("sqlite") {
        "SELECT COUNT(*) FROM http_charges WHERE account = ?"
    } else {
        "SELECT COUNT(*) FROM http_charges WHERE account = $1"
    };
    if database_url.starts_with("sqlite") {
        let pool = sqlx::SqlitePool::connect(database_url)
            .await
            .expect("open the SQLite file");
        sqlx::query_scalar(q)
            .bind(account)
            .fetch_one(&pool)
            .await
            .expect("count")
    } else {
        let pool = sqlx::PgPool::connect(database_url)
            .await
            .expect("PostgreSQL");
        sqlx::query_scalar(q)
            .bind(account)
            .fetch_one(&pool)
            .await
            .expect("count")
    }
}

async fn crash_before_the_charge_then_retry(database_url: Option<&str>) {
    let tmp = std::env::temp_dir().join(format!(
        "idempotent-http-crash-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&tmp).expect("temp dir");
    let count_url = match database_url {
        Some(url) => url.to_owned(),
        None => format!(
            "sqlite://{}",
            tmp.join("idempotent-http-payments.db").display()
        ),
    };
    let account = fresh_tenant();
    // Slow enough that the kill lands while the gateway waits.
    let body = serde_json::json!({"amount_cents": 1234, "currency": "EUR", "delay_ms": 4000});

    let mut first = Server::start(&tmp, database_url).await;
    // The application gives up after one attempt (its outcome is unknown)
    // but keeps the key, as an app saves it with the order.
    let impatient = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 1,
        ..RetryPolicy::default()
    });
    let intent = impatient
        .intent(Method::POST, &format!("{}/payments", first.base))
        .unwrap()
        .header("x-account-id", &account)
        .unwrap()
        .json(&body)
        .unwrap();
    let saved_key = intent.key().to_owned();
    let attempt = tokio::spawn(async move { intent.send().await });
    first.wait_line("gateway: charging").await;
    first.kill().await;
    let lost = tokio::time::timeout(WAIT_LIMIT, attempt)
        .await
        .expect("attempt ends")
        .expect("task");
    assert!(
        lost.is_err(),
        "the connection died with the server: {lost:?}"
    );
    assert_eq!(
        charges_of(&count_url, &account).await,
        0,
        "killed before anything was charged"
    );

    let mut second = Server::start(&tmp, database_url).await;
    let patient = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 30,
        ..RetryPolicy::default()
    });
    let resumed = patient
        .intent_with_key(
            Method::POST,
            &format!("{}/payments", second.base),
            saved_key,
        )
        .unwrap()
        .header("x-account-id", &account)
        .unwrap()
        .json(&body)
        .unwrap();
    let answer = tokio::time::timeout(WAIT_LIMIT, resumed.send())
        .await
        .expect("the retry is answered")
        .expect("the retry succeeds");
    assert_eq!(answer.status(), 201);
    assert!(
        !answer.is_replayed(),
        "nothing was recorded before the crash: the retry ran"
    );
    assert_eq!(
        charges_of(&count_url, &account).await,
        1,
        "exactly one charge"
    );
    let takeover = second
        .wait_line("took over a record whose lease had expired")
        .await;
    assert!(
        takeover.contains("attempt=2"),
        "the takeover is logged with its attempt number: {takeover}"
    );
    assert!(second.printed("gateway: charged"));

    // And from now on it replays.
    let again = resumed.send().await.expect("replay");
    assert!(again.is_replayed());
    assert_eq!(again.body(), answer.body());
    assert_eq!(charges_of(&count_url, &account).await, 1);
    // What operators see: the example exposes the runtime's metrics.
    let metrics = reqwest::get(format!("{}/metrics", second.base))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    assert!(
        metrics.contains("idempotent_calls_total") && metrics.contains("payments.charge"),
        "{metrics}"
    );
    assert!(!metrics.contains(&account), "no tenant in metrics labels");
    second.kill().await;
    let _ = std::fs::remove_dir_all(&tmp);
}

#[tokio::test]
async fn sigkill_during_a_slow_charge_then_retry_after_restart_charges_once_sqlite() {
    crash_before_the_charge_then_retry(None).await;
}

#[tokio::test]
async fn sigkill_during_a_slow_charge_then_retry_after_restart_charges_once_postgres() {
    let url = pg_url();
    if let Err(e) = sqlx::PgPool::connect(&url).await {
        assert!(!servers_required(), "PostgreSQL unreachable at {url}: {e}");
        eprintln!("\n!!!!!!!! SKIPPED: PostgreSQL is unreachable at {url} ({e}); set IDEMPOTENT_PG_URL or start the server.\n");
        return;
    }
    crash_before_the_charge_then_retry(Some(&url)).await;
}

/// The example on a PostgreSQL schema of its own whose database refuses one
/// fresh account's charges (a constraint added once the example made its
/// tables) until [`lift`](Self::lift): a charge the gateway made whose row
/// cannot be written. `None` when PostgreSQL is unreachable (skipped).
struct UnrecordedCharges {
    admin: sqlx::PgConnection,
    schema: String,
    schema_url: String,
    tmp: std::path::PathBuf,
    server: Server,
    account: String,
}

impl UnrecordedCharges {
    async fn start(label: &str) -> Option<Self> {
        let url = pg_url();
        if let Err(e) = sqlx::PgPool::connect(&url).await {
            assert!(!servers_required(), "PostgreSQL unreachable at {url}: {e}");
            eprintln!("\n!!!!!!!! SKIPPED: PostgreSQL is unreachable at {url} ({e}); set IDEMPOTENT_PG_URL or start the server.\n");
            return None;
        }
        let (mut admin, schema, schema_url) = common::servers::pg_schema_of_its_own(label).await;
        let tmp = std::env::temp_dir().join(format!(
            "idempotent-{label}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&tmp).expect("temp dir");
        let account = fresh_tenant();
        let server = Server::start(&tmp, Some(&schema_url)).await;
        sqlx::query(&format!(
            "ALTER TABLE {schema}.http_charges ADD CONSTRAINT refuse_the_row CHECK (account <> '{account}')"
        ))
        .execute(&mut admin)
        .await
        .expect("the database refuses this account's charges");
        Some(UnrecordedCharges {
            admin,
            schema,
            schema_url,
            tmp,
            server,
            account,
        })
    }

    /// The database records this account's charges again.
    async fn lift(&mut self) {
        sqlx::query(&format!(
            "ALTER TABLE {}.http_charges DROP CONSTRAINT refuse_the_row",
            self.schema
        ))
        .execute(&mut self.admin)
        .await
        .expect("lift the refusal");
    }

    /// The charges the gateway made for the account (its log lines).
    fn gateway_charges(&self) -> usize {
        self.server
            .lines
            .lock()
            .expect("lines")
            .iter()
            .filter(|l| l.contains("gateway: charged") && l.contains(&self.account))
            .count()
    }

    async fn finish(mut self) {
        self.server.kill().await;
        sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .execute(&mut self.admin)
            .await
            .expect("drop schema");
        let _ = std::fs::remove_dir_all(&self.tmp);
    }
}

/// The example as a user copies it (the example hunt's lead): the gateway
/// charged the card, then the charge could not be written to the database.
/// The handler answered 503, which releases the key, and the client's retry
/// ran the handler again: a second charge at the gateway for one request,
/// one more per retry. The gateway is asked with the request's key, so a
/// retry gets the charge already made. Here the database refuses the row
/// (a constraint added once the example made its tables) until it is lifted;
/// then the same intent, sent again, records the one charge.
#[tokio::test]
async fn a_charge_the_database_cannot_record_is_not_charged_again_by_the_retry_postgres() {
    let Some(mut example) = UnrecordedCharges::start("http_example_unrecorded").await else {
        return;
    };
    let client = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(20),
        ..RetryPolicy::default()
    });
    let intent = client
        .intent(Method::POST, &format!("{}/payments", example.server.base))
        .unwrap()
        .header("x-account-id", &example.account)
        .unwrap()
        .json(&serde_json::json!({"amount_cents": 777, "currency": "EUR"}))
        .unwrap();
    let failed = intent.send().await;
    assert!(
        failed.is_err(),
        "every attempt was answered 503: {failed:?}"
    );
    assert_eq!(
        example.gateway_charges(),
        1,
        "one request, charged at the gateway once (3 attempts were made)"
    );
    example.lift().await;
    let answer = intent
        .send()
        .await
        .expect("answered once the database is back");
    assert_eq!(answer.status(), 201);
    assert_eq!(
        example.gateway_charges(),
        1,
        "still one charge at the gateway"
    );
    assert_eq!(charges_of(&example.schema_url, &example.account).await, 1);
    example.finish().await;
}

/// The example as a user copies it: a charge whose row the database refused
/// was answered 503, which releases the key; a later request under that key
/// with another amount ran the handler again, and the simulated gateway,
/// remembering only the key, answered with the first charge's id, which was
/// then recorded with the new amount: an answer describing a charge the
/// gateway never made. Like a real gateway (Stripe refuses a key reused with
/// other parameters), it now refuses that request (422), and nothing is
/// recorded or charged; the first request's own retry then records the
/// charge the card saw.
#[tokio::test]
async fn a_key_reused_with_another_amount_after_a_failed_charge_is_refused_postgres() {
    let Some(mut example) = UnrecordedCharges::start("http_example_key_reused").await else {
        return;
    };
    let client = IdempotentClient::new(reqwest::Client::new()).with_policy(RetryPolicy {
        max_attempts: 1,
        ..RetryPolicy::default()
    });
    let payments = format!("{}/payments", example.server.base);
    let first = client
        .intent(Method::POST, &payments)
        .unwrap()
        .header("x-account-id", &example.account)
        .unwrap()
        .json(&serde_json::json!({"amount_cents": 777, "currency": "EUR"}))
        .unwrap();
    assert!(
        first.send().await.is_err(),
        "the charge could not be recorded: 503, the key released"
    );
    example.lift().await;
    let other_amount = client
        .intent_with_key(Method::POST, &payments, first.key())
        .unwrap()
        .header("x-account-id", &example.account)
        .unwrap()
        .json(&serde_json::json!({"amount_cents": 900, "currency": "EUR"}))
        .unwrap();
    let answer = other_amount.send().await.expect("an answer");
    assert_eq!(
        answer.status(),
        422,
        "another amount under a key the gateway charged 777 for"
    );
    assert_eq!(
        charges_of(&example.schema_url, &example.account).await,
        0,
        "no charge recorded"
    );
    assert_eq!(
        example.gateway_charges(),
        1,
        "the card was charged once, for 777"
    );
    // The refusal is not the key's recorded answer (a 4xx releases it in the
    // example): recorded, it held the key for the refused body, and the first
    // request's own retry, whose charge the card saw, was refused as a key
    // reused with another body, its charge never recorded.
    let retry = first
        .send()
        .await
        .expect("the first request's retry answers");
    assert_eq!(
        retry.status(),
        201,
        "the first request sent again records the charge the gateway made"
    );
    assert_eq!(
        charges_of(&example.schema_url, &example.account).await,
        1,
        "the card's charge recorded"
    );
    assert_eq!(example.gateway_charges(), 1, "and not charged again");
    example.finish().await;
}

/// The example as a user copies it (the example hunt's lead): a refund is
/// idempotent per key, but nothing kept a charge from being refunded twice
/// under two keys (a second click on "refund" makes a second intent, with a
/// key of its own): the second refund was made too, and the account paid
/// back twice. A charge is refunded once; a second refund of it is refused
/// (422), and the first key's retry still replays its refund.
#[tokio::test]
async fn a_charge_is_refunded_once_whatever_the_keys_sqlite() {
    let tmp = std::env::temp_dir().join(format!(
        "idempotent-http-refund-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&tmp).expect("temp dir");
    let count_url = format!(
        "sqlite://{}",
        tmp.join("idempotent-http-payments.db").display()
    );
    let account = fresh_tenant();
    let mut server = Server::start(&tmp, None).await;
    let client = IdempotentClient::new(reqwest::Client::new());
    let charge = client
        .intent(Method::POST, &format!("{}/payments", server.base))
        .unwrap()
        .header("x-account-id", &account)
        .unwrap()
        .json(&serde_json::json!({"amount_cents": 450, "currency": "EUR"}))
        .unwrap()
        .send()
        .await
        .expect("charged");
    assert_eq!(charge.status(), 201);
    let charge_id = charge.json::<serde_json::Value>().expect("json")["charge_id"]
        .as_str()
        .expect("charge_id")
        .to_owned();
    let refund = || {
        client
            .intent(Method::POST, &format!("{}/refunds", server.base))
            .unwrap()
            .header("x-account-id", &account)
            .unwrap()
            .json(&serde_json::json!({ "charge_id": charge_id }))
            .unwrap()
    };
    let first = refund();
    assert_eq!(first.send().await.expect("refunded").status(), 201);
    let second = refund().send().await.expect("answered");
    assert_eq!(
        second.status(),
        422,
        "a second refund of one charge, under another key: {:?}",
        second.body()
    );
    let again = first.send().await.expect("replayed");
    assert_eq!((again.status().as_u16(), again.is_replayed()), (201, true));
    let pool = sqlx::SqlitePool::connect(&count_url).await.expect("open");
    let refunds: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM http_refunds WHERE charge_id = ?")
        .bind(&charge_id)
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(refunds, 1, "one refund of one charge");
    pool.close().await;
    server.kill().await;
    let _ = std::fs::remove_dir_all(&tmp);
}
