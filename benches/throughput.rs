//! Throughput of an annotated function with a trivial body, next to the same
//! function unannotated and next to hand-written sqlx doing the same job
//! (insert-or-read to reserve, one update to complete).
//!
//! ```text
//! cargo bench --bench throughput            # every store reachable
//! cargo bench --bench throughput -- sqlite  # only scenarios whose name contains "sqlite"
//! ```
//!
//! PostgreSQL also compares transactional mode (`tx = tx`, inside the caller's
//! transaction) with separate mode (`store = ...`) for a body writing a business
//! row. MySQL/MariaDB compares the annotated function, at 1 and 16 callers,
//! with the floors: for fresh keys the two hand-written statements
//! (`INSERT IGNORE`, then the completing `UPDATE`), for replays one
//! hand-written primary-key `SELECT`; beside them the reservation procedure
//! called by hand for every reservation (what the store did before its plain
//! read came first).
//!
//! Each scenario runs a bounded number of calls (and at most a few seconds);
//! the figures are calls per second and ratios against the baseline named on
//! the same line. Absolute numbers depend on the machine; the ratios are the point.

use idempotent_runtime::{
    idempotent, Error, MemoryStore, MySqlStore, PgStore, SqliteStore, Store, StoreError,
};
use sqlx::{MySqlPool, PgPool, Postgres, SqlitePool};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[idempotent(scope = "bench.trivial", key = key, tenant = shared, store = store)]
async fn annotated(store: &dyn Store, key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount + 1)
}

async fn unannotated(_key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount + 1)
}

// ---- transactional mode vs separate mode: a body that writes a business row ----------

const PG_CHARGES: &str =
    "CREATE TABLE IF NOT EXISTS bench_charges (key TEXT NOT NULL, amount BIGINT NOT NULL)";

fn business(e: sqlx::Error) -> Error {
    StoreError::new("bench", "business write", e).into()
}

/// Transactional mode: the reservation, the business row and the recorded
/// result are statements in the caller's transaction (one commit).
#[idempotent(scope = "bench.pg_tx", key = key, tenant = shared, tx = tx)]
async fn charge_in_tx(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    key: &str,
    amount: i64,
) -> Result<i64, Error> {
    sqlx::query("INSERT INTO bench_charges (key, amount) VALUES ($1, $2)")
        .bind(key)
        .bind(amount)
        .execute(&mut **tx)
        .await
        .map_err(business)?;
    Ok(amount)
}

/// Separate mode: the records go through the store, the body writes through
/// the pool (three statements, three commits).
#[idempotent(scope = "bench.pg_separate", key = key, tenant = shared, store = store, skip(pool))]
async fn charge_separate(
    store: &dyn Store,
    pool: &PgPool,
    key: &str,
    amount: i64,
) -> Result<i64, Error> {
    sqlx::query("INSERT INTO bench_charges (key, amount) VALUES ($1, $2)")
        .bind(key)
        .bind(amount)
        .execute(pool)
        .await
        .map_err(business)?;
    Ok(amount)
}

// ---- hand-written baselines -------------------------------------------------------

const SQLITE_NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

async fn sqlite_schema(pool: &SqlitePool) -> sqlx::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_records (key TEXT PRIMARY KEY, state TEXT NOT NULL, \
         owner TEXT, lease_expires_at INTEGER, expires_at INTEGER NOT NULL, result BLOB)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// What a careful engineer writes by hand on SQLite: reserve (insert, or read
/// what is there) in one write transaction, run the body, complete with one update.
async fn hand_sqlite(pool: &SqlitePool, key: &str, amount: u64) -> sqlx::Result<u64> {
    let owner = uuid::Uuid::new_v4().simple().to_string();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let inserted = sqlx::query(&format!(
        "INSERT INTO bench_records (key, state, owner, lease_expires_at, expires_at) \
         VALUES (?1, 'in_progress', ?2, {SQLITE_NOW} + 30000, {SQLITE_NOW} + 86400000) \
         ON CONFLICT (key) DO NOTHING"
    ))
    .bind(key)
    .bind(&owner)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if !inserted {
        let result: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT result FROM bench_records WHERE key = ?1")
                .bind(key)
                .fetch_one(&mut *tx)
                .await?;
        tx.commit().await?;
        return Ok(serde_json::from_slice(&result.unwrap_or_default()).unwrap_or(0));
    }
    tx.commit().await?;
    let value = amount + 1;
    sqlx::query(&format!(
        "UPDATE bench_records SET state = 'complete', owner = NULL, result = ?1, \
         expires_at = {SQLITE_NOW} + 86400000 WHERE key = ?2 AND owner = ?3"
    ))
    .bind(serde_json::to_vec(&value).unwrap_or_default())
    .bind(key)
    .bind(&owner)
    .execute(pool)
    .await?;
    Ok(value)
}

const PG_NOW: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

async fn pg_schema(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_records (key TEXT PRIMARY KEY, state TEXT NOT NULL, \
         owner TEXT, lease_expires_at BIGINT, expires_at BIGINT NOT NULL, result BYTEA)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The same by hand on PostgreSQL: insert-or-nothing, read on conflict, update to complete.
async fn hand_pg(pool: &PgPool, key: &str, amount: u64) -> sqlx::Result<u64> {
    let owner = uuid::Uuid::new_v4().simple().to_string();
    let inserted = sqlx::query(&format!(
        "INSERT INTO bench_records (key, state, owner, lease_expires_at, expires_at) \
         VALUES ($1, 'in_progress', $2, {PG_NOW} + 30000, {PG_NOW} + 86400000) \
         ON CONFLICT (key) DO NOTHING"
    ))
    .bind(key)
    .bind(&owner)
    .execute(pool)
    .await?
    .rows_affected()
        == 1;
    if !inserted {
        let result: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT result FROM bench_records WHERE key = $1")
                .bind(key)
                .fetch_one(pool)
                .await?;
        return Ok(serde_json::from_slice(&result.unwrap_or_default()).unwrap_or(0));
    }
    let value = amount + 1;
    sqlx::query(&format!(
        "UPDATE bench_records SET state = 'complete', owner = NULL, result = $1, \
         expires_at = {PG_NOW} + 86400000 WHERE key = $2 AND owner = $3"
    ))
    .bind(serde_json::to_vec(&value).unwrap_or_default())
    .bind(key)
    .bind(&owner)
    .execute(pool)
    .await?;
    Ok(value)
}

const MY_NOW: &str = "(UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000))";

/// A table shaped like `idempotency_records` (the store's migrations made it).
async fn mysql_schema(pool: &MySqlPool) -> sqlx::Result<()> {
    sqlx::query("CREATE TABLE IF NOT EXISTS bench_my_records LIKE idempotency_records")
        .execute(pool)
        .await?;
    Ok(())
}

/// The floor for fresh keys on MySQL/MariaDB: the two statements a
/// hand-written reservation needs at the least, `INSERT IGNORE` to reserve and
/// an `UPDATE` fenced by the owner to complete (a duplicate would read instead).
async fn hand_mysql_fresh(pool: &MySqlPool, key: &str, amount: u64) -> sqlx::Result<u64> {
    let owner = uuid::Uuid::new_v4().simple().to_string();
    let inserted = sqlx::query(&format!(
        "INSERT IGNORE INTO bench_my_records (tenant, scope, `key`, state, owner_token, \
         lease_expires_at, expires_at, created_at, updated_at, attempt, attempt_started_at) \
         VALUES ('', 'bench.hand', ?, 'in_progress', ?, {MY_NOW} + 30000, {MY_NOW} + 86400000, \
         {MY_NOW}, {MY_NOW}, 1, {MY_NOW})"
    ))
    .bind(key)
    .bind(&owner)
    .execute(pool)
    .await?
    .rows_affected()
        == 1;
    assert!(inserted, "fresh keys are fresh");
    let value = amount + 1;
    sqlx::query(&format!(
        "UPDATE bench_my_records SET state = 'complete', owner_token = NULL, is_error = 0, \
         result = ?, lease_expires_at = NULL, expires_at = {MY_NOW} + 86400000, \
         updated_at = {MY_NOW} \
         WHERE tenant = '' AND scope = 'bench.hand' AND `key` = ? \
         AND state = 'in_progress' AND owner_token = ?"
    ))
    .bind(serde_json::to_vec(&value).unwrap_or_default())
    .bind(key)
    .bind(&owner)
    .execute(pool)
    .await?;
    Ok(value)
}

/// The floor for replays: one hand-written primary-key `SELECT`.
async fn hand_mysql_replay(pool: &MySqlPool, key: &str) -> sqlx::Result<u64> {
    let result: Option<Vec<u8>> = sqlx::query_scalar(
        "SELECT result FROM bench_my_records WHERE tenant = '' AND scope = 'bench.hand' AND `key` = ?",
    )
    .bind(key)
    .fetch_one(pool)
    .await?;
    Ok(serde_json::from_slice(&result.unwrap_or_default()).unwrap_or(0))
}

/// What every reservation cost before the plain read came first: the
/// reservation procedure by hand (then, for a fresh key, the completing
/// `UPDATE`), on the store's own table.
async fn hand_mysql_procedure(pool: &MySqlPool, key: &str, amount: u64) -> sqlx::Result<u64> {
    use sqlx::Row;
    let owner = uuid::Uuid::new_v4().simple().to_string();
    let row = sqlx::query(
        "CALL idempotency_reserve_v4(?, ?, ?, NULL, ?, 30000, 86400000, 1, 1, 1, \
         @b1, @b2, @b3, @b4, @b5, @b6, @b7)",
    )
    .bind(&b""[..])
    .bind(&b"bench.hand_procedure"[..])
    .bind(key.as_bytes())
    .bind(owner.as_bytes())
    .fetch_one(pool)
    .await?;
    let outcome: Vec<u8> = row.try_get_unchecked(0)?;
    if outcome != b"acquired" {
        let result: Option<Vec<u8>> = row.try_get_unchecked(3)?;
        return Ok(serde_json::from_slice(&result.unwrap_or_default()).unwrap_or(0));
    }
    let value = amount + 1;
    sqlx::query(&format!(
        "UPDATE idempotency_records SET state = 'complete', owner_token = NULL, is_error = 0, \
         result = ?, lease_expires_at = NULL, expires_at = {MY_NOW} + 86400000, \
         updated_at = {MY_NOW}, recovered = 0 \
         WHERE tenant = '' AND scope = 'bench.hand_procedure' AND `key` = ? \
         AND state = 'in_progress' AND owner_token = ?"
    ))
    .bind(serde_json::to_vec(&value).unwrap_or_default())
    .bind(key.as_bytes())
    .bind(owner.as_bytes())
    .execute(pool)
    .await?;
    Ok(value)
}

/// The store's fallback statements, written by hand: the reservation function
/// `idempotency_reserve_autocommit` (which the store calls only for what needs
/// the row lock: an expired record, a takeover, a race) and the fenced
/// completing `UPDATE` on `idempotency_records`. The store's own first
/// statement (a primary-key read that inserts only when there is no record)
/// is cheaper than this function, most of all for replays.
async fn hand_pg_store_statements(pool: &PgPool, key: &str, amount: u64) -> sqlx::Result<u64> {
    use sqlx::Row;
    let owner = uuid::Uuid::new_v4().simple().to_string();
    let row = sqlx::query(
        "SELECT outcome, took_over, is_error, result, lease_remaining_ms \
         FROM idempotency_reserve_autocommit($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind("")
    .bind("bench.hand_same")
    .bind(key)
    .bind(None::<String>)
    .bind(&owner)
    .bind(30_000i64)
    .bind(86_400_000i64)
    .bind(100i64)
    .fetch_one(pool)
    .await?;
    let outcome: String = row.try_get("outcome")?;
    if outcome != "acquired" {
        let result: Option<Vec<u8>> = row.try_get("result")?;
        return Ok(serde_json::from_slice(&result.unwrap_or_default()).unwrap_or(0));
    }
    let value = amount + 1;
    sqlx::query(
        "UPDATE idempotency_records SET state = 'complete', owner_token = NULL, \
         is_error = $5, result = $6, lease_expires_at = NULL, \
         expires_at = idempotency_now_ms() + $7, updated_at = idempotency_now_ms() \
         WHERE tenant = $1 AND scope = $2 AND key = $3 \
         AND state = 'in_progress' AND owner_token = $4",
    )
    .bind("")
    .bind("bench.hand_same")
    .bind(key)
    .bind(&owner)
    .bind(false)
    .bind(serde_json::to_vec(&value).unwrap_or_default())
    .bind(86_400_000i64)
    .execute(pool)
    .await?;
    Ok(value)
}

/// The same statements on a table shaped like `idempotency_records` (primary
/// key (tenant, scope, key), an index on `expires_at`): what the schema costs,
/// apart from what the framework costs.
async fn pg_full_schema(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_records_full (LIKE idempotency_records INCLUDING ALL)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

async fn hand_pg_full(pool: &PgPool, key: &str, amount: u64) -> sqlx::Result<u64> {
    let owner = uuid::Uuid::new_v4().simple().to_string();
    let inserted = sqlx::query(&format!(
        "INSERT INTO bench_records_full (tenant, scope, key, state, owner_token, \
         lease_expires_at, expires_at, created_at, updated_at) \
         VALUES ('', 'bench.hand', $1, 'in_progress', $2, {PG_NOW} + 30000, \
         {PG_NOW} + 86400000, {PG_NOW}, {PG_NOW}) \
         ON CONFLICT (tenant, scope, key) DO NOTHING"
    ))
    .bind(key)
    .bind(&owner)
    .execute(pool)
    .await?
    .rows_affected()
        == 1;
    if !inserted {
        let result: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT result FROM bench_records_full \
             WHERE tenant = '' AND scope = 'bench.hand' AND key = $1",
        )
        .bind(key)
        .fetch_one(pool)
        .await?;
        return Ok(serde_json::from_slice(&result.unwrap_or_default()).unwrap_or(0));
    }
    let value = amount + 1;
    sqlx::query(&format!(
        "UPDATE bench_records_full SET state = 'complete', owner_token = NULL, result = $1, \
         lease_expires_at = NULL, expires_at = {PG_NOW} + 86400000, updated_at = {PG_NOW} \
         WHERE tenant = '' AND scope = 'bench.hand' AND key = $2 \
         AND state = 'in_progress' AND owner_token = $3"
    ))
    .bind(serde_json::to_vec(&value).unwrap_or_default())
    .bind(key)
    .bind(&owner)
    .execute(pool)
    .await?;
    Ok(value)
}

/// How many keys the PostgreSQL replay scenarios cycle through.
const PG_REPLAY_KEYS: usize = 100;

/// The replay floor: a hand-written primary-key `SELECT` of a recorded result
/// on the records-shaped table (what DESIGN.md §5 says a replay should cost).
async fn pg_pk_select(pool: &PgPool, key: &str) -> sqlx::Result<u64> {
    let result: Option<Vec<u8>> = sqlx::query_scalar(
        "SELECT result FROM bench_records_full \
         WHERE tenant = '' AND scope = 'bench.hand' AND key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await?;
    Ok(serde_json::from_slice(&result.unwrap_or_default()).unwrap_or(0))
}

/// The store's own reservation statement, sent by hand through the same kind
/// of pool as the floor, for a replay of one of the annotated function's
/// records: what the statement costs without the rest of the call.
async fn pg_reservation_by_hand(pool: &PgPool, key: &str) -> sqlx::Result<u64> {
    use sqlx::Row;
    let row = sqlx::query(idempotent_runtime::store::postgres::RESERVE_STORE_SQL)
        .bind("")
        .bind("bench.trivial")
        .bind(key)
        .bind(None::<String>)
        .bind("bench-owner")
        .bind(30_000i64)
        .bind(86_400_000i64)
        .bind(100i64)
        .fetch_one(pool)
        .await?;
    // A record was there (`acquired` is NULL), complete and not expired.
    assert_eq!(row.try_get::<Option<bool>, _>("acquired")?, None);
    assert_eq!(row.try_get::<String, _>("state")?, "complete");
    assert!(!row.try_get::<bool, _>("expired")?);
    let result: Option<Vec<u8>> = row.try_get("result")?;
    Ok(serde_json::from_slice(&result.unwrap_or_default()).unwrap_or(0))
}

// ---- the harness ------------------------------------------------------------------

const MAX_TIME: Duration = Duration::from_secs(4);

/// Runs `call(i)` for i in 0..calls across `concurrency` tasks (bounded by
/// `MAX_TIME`); returns calls per second.
async fn measure<F, Fut>(calls: usize, concurrency: usize, call: F) -> f64
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let call = Arc::new(call);
    let started = Instant::now();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let (call, done) = (call.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = worker;
            while i < calls && started.elapsed() < MAX_TIME {
                call(i).await;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                i += concurrency;
            }
        }));
    }
    for t in tasks {
        t.await.expect("bench task");
    }
    done.load(std::sync::atomic::Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

struct Report {
    filter: Option<String>,
    /// (scenario, calls per second), in the order measured.
    rows: Vec<(String, f64)>,
}

impl Report {
    fn wants(&self, name: &str) -> bool {
        self.filter.as_deref().is_none_or(|f| name.contains(f))
    }
    fn add(&mut self, name: &str, per_sec: f64, baseline: Option<&str>) {
        let base = baseline.and_then(|b| {
            self.rows
                .iter()
                .find(|r| r.0 == b)
                .map(|r| (b.to_owned(), r.1))
        });
        match &base {
            Some((b, v)) => println!(
                "{name:<44} {per_sec:>12.0} calls/s   {:>6.2}x of {b}",
                per_sec / v
            ),
            None => println!("{name:<44} {per_sec:>12.0} calls/s"),
        }
        self.rows.push((name.to_owned(), per_sec));
    }
    /// One more ratio between two rows already measured.
    fn ratio(&self, name: &str, baseline: &str) {
        let get = |n: &str| self.rows.iter().find(|r| r.0 == n).map(|r| r.1);
        if let (Some(a), Some(b)) = (get(name), get(baseline)) {
            println!("  -> {:.2}x: {name} / {baseline}", a / b);
        }
    }
}

fn fresh(prefix: &str, i: usize) -> String {
    format!("{prefix}-{i}")
}

#[tokio::main]
async fn main() {
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .filter(|a| a != "throughput");
    let mut r = Report {
        filter,
        rows: Vec::new(),
    };
    let run = uuid::Uuid::new_v4().simple().to_string();

    // In-process: what the framework costs with a store that costs nothing.
    if r.wants("memory") {
        let n = 200_000;
        let v = measure(n, 1, |i| async move {
            let _ = unannotated(&fresh("k", i), i as u64).await;
        })
        .await;
        r.add("memory: unannotated fn", v, None);
        let store = Arc::new(MemoryStore::new());
        let s = store.clone();
        let v = measure(n, 1, move |i| {
            let s = s.clone();
            async move {
                let _ = annotated(&*s, &fresh("m", i), i as u64).await;
            }
        })
        .await;
        r.add(
            "memory: annotated, fresh keys",
            v,
            Some("memory: unannotated fn"),
        );
        let s = store.clone();
        let v = measure(n, 1, move |i| {
            let s = s.clone();
            async move {
                let _ = annotated(&*s, &fresh("m", i % 1000), (i % 1000) as u64).await;
            }
        })
        .await;
        r.add(
            "memory: annotated, replays",
            v,
            Some("memory: unannotated fn"),
        );
    }

    // SQLite at equal durability: the store and the hand-written baseline
    // run with the same `synchronous` level (FULL: every commit is fsynced;
    // NORMAL in WAL mode: commits reach the OS, synced at checkpoints), on
    // pools of the same size, each level on a file of its own.
    if r.wants("sqlite") {
        use idempotent_runtime::store::sqlite::Synchronous;
        use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteSynchronous};
        use std::str::FromStr;
        for (level, hand_level, label) in [
            (Synchronous::Full, SqliteSynchronous::Full, "FULL"),
            (Synchronous::Normal, SqliteSynchronous::Normal, "NORMAL"),
        ] {
            let path = std::env::temp_dir().join(format!("idempotent-bench-{run}-{label}.db"));
            let url = format!("sqlite://{}?mode=rwc", path.display());
            let store = SqliteStore::builder(&url)
                .synchronous(level)
                .connect()
                .await
                .expect("open sqlite");
            let options = SqliteConnectOptions::from_str(&url)
                .expect("sqlite url")
                .busy_timeout(Duration::from_secs(10))
                .synchronous(hand_level);
            // As many connections as the store's pool (8).
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .connect_with(options)
                .await
                .expect("open sqlite pool");
            sqlite_schema(&pool).await.expect("schema");
            for concurrency in [1usize, 16] {
                let n = if concurrency == 1 { 3_000 } else { 8_000 };
                let tag = |what: &str| format!("sqlite {label} x{concurrency}: {what}");
                let (hand_fresh, hand_replay) = (
                    tag("hand-written sqlx, fresh keys"),
                    tag("hand-written sqlx, replays"),
                );
                let p = pool.clone();
                let pre = format!("h{concurrency}");
                let v = measure(n, concurrency, move |i| {
                    let (p, k) = (p.clone(), fresh(&pre, i));
                    async move {
                        hand_sqlite(&p, &k, i as u64).await.expect("hand sqlite");
                    }
                })
                .await;
                r.add(&hand_fresh, v, None);
                let s = store.clone();
                let pre = format!("a{concurrency}");
                let v = measure(n, concurrency, move |i| {
                    let (s, k) = (s.clone(), fresh(&pre, i));
                    async move {
                        annotated(&s, &k, i as u64).await.expect("annotated sqlite");
                    }
                })
                .await;
                r.add(&tag("annotated, fresh keys"), v, Some(&hand_fresh));
                let p = pool.clone();
                let pre = format!("h{concurrency}");
                let v = measure(n, concurrency, move |i| {
                    let (p, k) = (p.clone(), fresh(&pre, i % 500));
                    async move {
                        hand_sqlite(&p, &k, 0).await.expect("hand sqlite");
                    }
                })
                .await;
                r.add(&hand_replay, v, None);
                let s = store.clone();
                let pre = format!("a{concurrency}");
                let v = measure(n, concurrency, move |i| {
                    let (s, k) = (s.clone(), fresh(&pre, i % 500));
                    async move {
                        annotated(&s, &k, (i % 500) as u64)
                            .await
                            .expect("annotated sqlite replay");
                    }
                })
                .await;
                r.add(&tag("annotated, replays"), v, Some(&hand_replay));
            }
            drop((store, pool));
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
        }
    }

    if r.wants("postgres") {
        let url = std::env::var("IDEMPOTENT_PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        // The baseline's pool is as large as the store's (16), so both get the same parallelism.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await;
        match (PgStore::connect(&url).await, pool) {
            (Ok(store), Ok(pool)) => {
                pg_schema(&pool).await.expect("schema");
                pg_full_schema(&pool).await.expect("schema");
                // 1 caller and 16 (the store's pool size): the annotated function
                // against the floors measured in the same run (DESIGN.md §5).
                for concurrency in [1usize, 16] {
                    let n = if concurrency == 1 { 3_000 } else { 20_000 };
                    let tag = |what: &str| format!("postgres x{concurrency}: {what}");
                    let (hand_fresh, hand_replay) = (
                        tag("hand-written sqlx, fresh keys"),
                        tag("hand-written sqlx, replays"),
                    );
                    let p = pool.clone();
                    let pre = format!("{run}-h{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i));
                        async move {
                            hand_pg(&p, &k, i as u64).await.expect("hand pg");
                        }
                    })
                    .await;
                    r.add(&hand_fresh, v, None);
                    let s = store.clone();
                    let pre = format!("{run}-a{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (s, k) = (s.clone(), fresh(&pre, i));
                        async move {
                            annotated(&s, &k, i as u64).await.expect("annotated pg");
                        }
                    })
                    .await;
                    r.add(&tag("annotated, fresh keys"), v, Some(&hand_fresh));
                    let p = pool.clone();
                    let pre = format!("{run}-f{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i));
                        async move {
                            hand_pg_full(&p, &k, i as u64).await.expect("hand pg");
                        }
                    })
                    .await;
                    // The fresh floor: INSERT … ON CONFLICT DO NOTHING + UPDATE on
                    // a table shaped like idempotency_records.
                    r.add(
                        &tag("hand-written, records' schema, fresh"),
                        v,
                        Some(&hand_fresh),
                    );
                    r.ratio(
                        &tag("annotated, fresh keys"),
                        &tag("hand-written, records' schema, fresh"),
                    );
                    let same = tag("hand-written sqlx, the reserve function + update, fresh");
                    let p = pool.clone();
                    let pre = format!("{run}-s{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i));
                        async move {
                            hand_pg_store_statements(&p, &k, i as u64)
                                .await
                                .expect("hand pg, store statements");
                        }
                    })
                    .await;
                    r.add(&same, v, Some(&hand_fresh));
                    r.ratio(&tag("annotated, fresh keys"), &same);
                    // Every replayed key exists, whatever the fresh runs managed
                    // in their time bound (on a loaded machine, fewer than this).
                    for i in 0..PG_REPLAY_KEYS {
                        hand_pg(&pool, &fresh(&format!("{run}-h{concurrency}"), i), i as u64)
                            .await
                            .expect("warm hand pg");
                        hand_pg_full(&pool, &fresh(&format!("{run}-f{concurrency}"), i), i as u64)
                            .await
                            .expect("warm hand pg full");
                        hand_pg_store_statements(
                            &pool,
                            &fresh(&format!("{run}-s{concurrency}"), i),
                            i as u64,
                        )
                        .await
                        .expect("warm store statements");
                        annotated(
                            &store,
                            &fresh(&format!("{run}-a{concurrency}"), i),
                            i as u64,
                        )
                        .await
                        .expect("warm annotated");
                    }
                    let p = pool.clone();
                    let pre = format!("{run}-h{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i % PG_REPLAY_KEYS));
                        async move {
                            hand_pg(&p, &k, 0).await.expect("hand pg");
                        }
                    })
                    .await;
                    r.add(&hand_replay, v, None);
                    let s = store.clone();
                    let pre = format!("{run}-a{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (s, k) = (s.clone(), fresh(&pre, i % PG_REPLAY_KEYS));
                        async move {
                            annotated(&s, &k, (i % PG_REPLAY_KEYS) as u64)
                                .await
                                .expect("annotated pg replay");
                        }
                    })
                    .await;
                    r.add(&tag("annotated, replays"), v, Some(&hand_replay));
                    let floor = tag("floor: hand-written PK SELECT, replays");
                    let p = pool.clone();
                    let pre = format!("{run}-f{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i % PG_REPLAY_KEYS));
                        async move {
                            pg_pk_select(&p, &k).await.expect("pk select");
                        }
                    })
                    .await;
                    r.add(&floor, v, Some(&hand_replay));
                    r.ratio(&tag("annotated, replays"), &floor);
                    // The store's statement alone, by hand: the statement's
                    // share of the gap, and the rest of the call's.
                    let by_hand = tag("the store's reservation statement by hand, replays");
                    let p = pool.clone();
                    let pre = format!("{run}-a{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i % PG_REPLAY_KEYS));
                        async move {
                            pg_reservation_by_hand(&p, &k)
                                .await
                                .expect("the store's statement");
                        }
                    })
                    .await;
                    r.add(&by_hand, v, Some(&floor));
                    r.ratio(&tag("annotated, replays"), &by_hand);
                    let same = tag("hand-written sqlx, the reserve function, replays");
                    let p = pool.clone();
                    let pre = format!("{run}-s{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i % PG_REPLAY_KEYS));
                        async move {
                            hand_pg_store_statements(&p, &k, 0)
                                .await
                                .expect("hand pg, store statements");
                        }
                    })
                    .await;
                    r.add(&same, v, Some(&hand_replay));
                    r.ratio(&tag("annotated, replays"), &same);
                }

                // Transactional mode vs separate mode, with a body that writes a
                // business row: fresh keys, both on the store's pool.
                sqlx::query(PG_CHARGES)
                    .execute(&pool)
                    .await
                    .expect("schema");
                for concurrency in [1usize, 32] {
                    let n = if concurrency == 1 { 2_000 } else { 10_000 };
                    let tag = |what: &str| format!("postgres x{concurrency}: {what}");
                    let separate = tag("separate mode, business row");
                    let s = store.clone();
                    let pre = format!("{run}-s{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (s, k) = (s.clone(), fresh(&pre, i));
                        async move {
                            charge_separate(&s, s.pool(), &k, i as i64)
                                .await
                                .expect("separate mode");
                        }
                    })
                    .await;
                    r.add(&separate, v, None);
                    let p = store.pool().clone();
                    let pre = format!("{run}-t{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i));
                        async move {
                            let mut tx = p.begin().await.expect("begin");
                            charge_in_tx(&mut tx, &k, i as i64)
                                .await
                                .expect("transactional mode");
                            tx.commit().await.expect("commit");
                        }
                    })
                    .await;
                    r.add(
                        &tag("tx = tx (transactional), business row"),
                        v,
                        Some(&separate),
                    );
                }
            }
            (Err(e), _) => println!("postgres: SKIPPED ({e})"),
            (_, Err(e)) => println!("postgres: SKIPPED ({e})"),
        }
    }

    if r.wants("mysql") {
        let url = std::env::var("IDEMPOTENT_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        match (
            MySqlStore::connect(&url).await,
            sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(16)
                .connect(&url)
                .await,
        ) {
            (Ok(store), Ok(pool)) => {
                mysql_schema(&pool).await.expect("schema");
                for concurrency in [1usize, 16] {
                    let n = if concurrency == 1 { 2_000 } else { 10_000 };
                    let tag = |what: &str| format!("mysql x{concurrency}: {what}");
                    let (floor_fresh, floor_replay) = (
                        tag("floor: insert-ignore + update, fresh"),
                        tag("floor: PK select, replays"),
                    );
                    let p = pool.clone();
                    let pre = format!("{run}-h{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i));
                        async move {
                            hand_mysql_fresh(&p, &k, i as u64)
                                .await
                                .expect("hand mysql");
                        }
                    })
                    .await;
                    r.add(&floor_fresh, v, None);
                    let s = store.clone();
                    let pre = format!("{run}-a{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (s, k) = (s.clone(), fresh(&pre, i));
                        async move {
                            annotated(&s, &k, i as u64).await.expect("annotated mysql");
                        }
                    })
                    .await;
                    r.add(&tag("annotated, fresh keys"), v, Some(&floor_fresh));
                    let p = pool.clone();
                    let pre = format!("{run}-p{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i));
                        async move {
                            hand_mysql_procedure(&p, &k, i as u64)
                                .await
                                .expect("procedure mysql");
                        }
                    })
                    .await;
                    r.add(&tag("procedure + update, fresh"), v, Some(&floor_fresh));
                    // Replays of the first 50 keys each scenario recorded above.
                    let p = pool.clone();
                    let pre = format!("{run}-h{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i % 50));
                        async move {
                            hand_mysql_replay(&p, &k).await.expect("hand mysql replay");
                        }
                    })
                    .await;
                    r.add(&floor_replay, v, None);
                    let s = store.clone();
                    let pre = format!("{run}-a{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (s, k) = (s.clone(), fresh(&pre, i % 50));
                        async move {
                            annotated(&s, &k, (i % 50) as u64)
                                .await
                                .expect("annotated mysql replay");
                        }
                    })
                    .await;
                    r.add(&tag("annotated, replays"), v, Some(&floor_replay));
                    let p = pool.clone();
                    let pre = format!("{run}-p{concurrency}");
                    let v = measure(n, concurrency, move |i| {
                        let (p, k) = (p.clone(), fresh(&pre, i % 50));
                        async move {
                            hand_mysql_procedure(&p, &k, 0)
                                .await
                                .expect("procedure mysql replay");
                        }
                    })
                    .await;
                    r.add(&tag("procedure, replays"), v, Some(&floor_replay));
                }
            }
            (Err(e), _) => println!("mysql: SKIPPED ({e})"),
            (_, Err(e)) => println!("mysql: SKIPPED ({e})"),
        }
    }
}
