//! A bounded soak with SIGKILLs, on PostgreSQL and on MariaDB, in store mode
//! and in transactional mode (DESIGN.md §4 rules 3, 9, 10, 14, 15; §6).
//!
//! The test keeps several `idempotent-soak-worker` processes (tests/bin/soak_worker.rs)
//! running against one fresh tenant. Each loops over a small hot set of keys,
//! and its body writes an effect row naming the key and a fresh attempt id,
//! which is the function's result. Every so often the test SIGKILLs a worker:
//! either right after the worker reports a chosen phase (a reader thread per
//! worker watches its stdout and kills on the first matching line), or at a
//! random moment; then it starts a replacement. Each kill is logged with the
//! key and the last phase the killed process reported (its stdout is drained
//! to the end, so that is where it really died, not where the test aimed).
//!
//! Afterwards the records and the effect rows are compared:
//! * transactional mode: a complete record has exactly one effect row, the one
//!   its result names; no effect row exists without a complete record (a
//!   killed transaction rolls back both); no in-progress record survives.
//! * store mode (the effect is an autocommit statement outside the store): a
//!   complete record's result names an existing effect row; every other effect
//!   row belongs to an attempt whose process was killed inside that attempt's
//!   body (after `reserved` or after `effect`, before `executed`): that is
//!   the one way a second execution is allowed. Anything else fails.
//! * in both: every `executed`/`replayed` answer a worker printed names the
//!   recorded attempt, and a record's attempt reached its end (printed
//!   `executed`, or was killed while its completion/commit was in flight).
//!
//! Bounds (per run; there are four runs): `IDEMPOTENT_SOAK_CALLS` calls
//! (default 300), `IDEMPOTENT_SOAK_KILLS` kills (default max(10, calls/30)),
//! `IDEMPOTENT_SOAK_SECONDS` for the kill phase (default 8; workers stop at
//! that deadline too), `IDEMPOTENT_SOAK_WORKERS` processes at once (default 6),
//! `IDEMPOTENT_SOAK_KEYS` hot keys per one-second epoch (default 8).
//! No assertion depends on timing; the counts are printed at the end of each run.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{Identity, RecordState, Store};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const WORKER: &str = env!("CARGO_BIN_EXE_idempotent-soak-worker");

// ------------------------------------------------------------------ setup

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Pg,
    MySql,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Store,
    Tx,
}

impl Mode {
    fn arg(self) -> &'static str {
        match self {
            Mode::Store => "store",
            Mode::Tx => "tx",
        }
    }
    /// The phases a targeted kill aims at, in the order they are tried.
    fn phases(self) -> &'static [&'static str] {
        match self {
            Mode::Store => &["reserved", "effect", "call", "completed"],
            Mode::Tx => &["reserved", "effect", "recorded", "call", "completed"],
        }
    }
}

fn scope(backend: Backend, mode: Mode) -> &'static str {
    match (backend, mode) {
        (_, Mode::Store) => "soak.store",
        (Backend::Pg, Mode::Tx) => "soak.tx_pg",
        (Backend::MySql, Mode::Tx) => "soak.tx_mysql",
    }
}

struct Bounds {
    workers: usize,
    calls: usize,
    calls_per_worker: usize,
    kills: usize,
    seconds: u64,
    keys: usize,
    epoch_ms: u64,
}

fn env_number(name: &str) -> Option<usize> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} is not a number")),
    )
}

impl Bounds {
    fn from_env() -> Self {
        let calls = env_number("IDEMPOTENT_SOAK_CALLS").unwrap_or(300);
        Bounds {
            workers: env_number("IDEMPOTENT_SOAK_WORKERS").unwrap_or(6).max(1),
            calls,
            calls_per_worker: 40,
            kills: env_number("IDEMPOTENT_SOAK_KILLS").unwrap_or((calls / 30).max(10)),
            seconds: env_number("IDEMPOTENT_SOAK_SECONDS").unwrap_or(8) as u64,
            keys: env_number("IDEMPOTENT_SOAK_KEYS").unwrap_or(8).max(1),
            epoch_ms: 1000,
        }
    }
}

/// A small xorshift generator seeded from a v4 UUID.
struct Rng(u64);

impl Rng {
    fn new() -> Self {
        Rng(uuid::Uuid::new_v4().as_u64_pair().0 | 1)
    }
    fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x % n.max(1)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

// ------------------------------------------------------------- the fleet

/// The phase a worker's output line reports: its first word, with both
/// answers (`executed`, `replayed`) named `completed`.
fn phase_of(line: &str) -> &str {
    match line.split(' ').next().unwrap_or("") {
        "executed" | "replayed" => "completed",
        other => other,
    }
}

/// What the test and a worker's reader thread share.
struct Shared {
    /// A targeted kill order: the next worker to print a line of this phase is killed.
    order: Mutex<Option<&'static str>>,
}

/// One running worker.
struct Slot {
    pid: u32,
    child: Mutex<Child>,
    /// Why it was killed (set before the kill is sent), if it was.
    cause: Mutex<Option<String>>,
    /// `call` lines seen so far.
    calls: AtomicUsize,
    /// The calls it was given.
    assigned: usize,
    /// The last line it printed, and when it started: for a diagnosis if it hangs.
    last: Mutex<String>,
    started: Instant,
}

/// Reads a worker's stdout to the end, executing a targeted kill order when a
/// line of the ordered phase shows up.
fn read_worker(slot: Arc<Slot>, shared: Arc<Shared>, stdout: ChildStdout) -> Vec<String> {
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        let phase = phase_of(&line);
        if phase == "call" {
            slot.calls.fetch_add(1, Ordering::Relaxed);
        }
        {
            let mut order = lock(&shared.order);
            if *order == Some(phase) {
                let mut cause = lock(&slot.cause);
                if cause.is_none() {
                    *order = None;
                    *cause = Some(format!("targeted after {phase}"));
                    let _ = lock(&slot.child).kill();
                }
            }
        }
        lock(&slot.last).clone_from(&line);
        lines.push(line);
    }
    lines
}

/// A worker that has exited (or was killed) and was reaped.
struct Finished {
    pid: u32,
    lines: Vec<String>,
    status: ExitStatus,
    cause: Option<String>,
}

struct Running {
    slot: Arc<Slot>,
    reader: JoinHandle<Vec<String>>,
}

/// The worker processes of one run. Dropping it kills and reaps every worker
/// still running, so a failing test leaves no process behind.
struct Fleet {
    backend: Backend,
    url: String,
    mode: Mode,
    tenant: String,
    run_start_ms: u64,
    deadline_ms: u64,
    shared: Arc<Shared>,
    running: Vec<Running>,
    finished: Vec<Finished>,
}

impl Fleet {
    /// Calls not yet given to any worker.
    fn unassigned(&self, bounds: &Bounds) -> usize {
        let used: usize = self
            .finished
            .iter()
            .map(|f| f.lines.iter().filter(|l| phase_of(l) == "call").count())
            .sum::<usize>()
            + self.running.iter().map(|r| r.slot.assigned).sum::<usize>();
        bounds.calls.saturating_sub(used)
    }

    fn spawn(&mut self, bounds: &Bounds, calls: usize) {
        let backend = match self.backend {
            Backend::Pg => "pg",
            Backend::MySql => "mysql",
        };
        let mut child = Command::new(WORKER)
            .args([
                backend,
                &self.url,
                self.mode.arg(),
                &self.tenant,
                &self.run_start_ms.to_string(),
                &bounds.epoch_ms.to_string(),
                &bounds.keys.to_string(),
                &calls.to_string(),
                &self.deadline_ms.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start a soak worker");
        let stdout = child.stdout.take().expect("piped stdout");
        let slot = Arc::new(Slot {
            pid: child.id(),
            child: Mutex::new(child),
            cause: Mutex::new(None),
            calls: AtomicUsize::new(0),
            assigned: calls,
            last: Mutex::new(String::new()),
            started: Instant::now(),
        });
        let (s, shared) = (slot.clone(), self.shared.clone());
        let reader = std::thread::spawn(move || read_worker(s, shared, stdout));
        self.running.push(Running { slot, reader });
    }

    /// Starts workers until `bounds.workers` run or the calls are all given
    /// out; none once the deadline has passed. A worker stops at the deadline
    /// with the rest of its calls unused (they count as not given out), and a
    /// worker started after it stops at once: starting replacements then
    /// never ends, and the run would end as a "hang" at `run_fleet`'s hard stop.
    fn fill(&mut self, bounds: &Bounds) {
        if now_ms() >= self.deadline_ms {
            return;
        }
        while self.running.len() < bounds.workers {
            let calls = self.unassigned(bounds).min(bounds.calls_per_worker);
            if calls == 0 {
                break;
            }
            self.spawn(bounds, calls);
        }
    }

    /// Reaps every worker that has exited.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let status = lock(&self.running[i].slot.child)
                .try_wait()
                .expect("poll a worker");
            let Some(status) = status else {
                i += 1;
                continue;
            };
            let Running { slot, reader } = self.running.swap_remove(i);
            let lines = reader.join().expect("the reader thread");
            let cause = lock(&slot.cause).clone();
            if let Some(cause) = &cause {
                let last = lines.last().map(String::as_str).unwrap_or("");
                let key = match phase_of(last) {
                    "" | "done" => "-",
                    _ => last.split(' ').nth(1).unwrap_or("-"),
                };
                println!(
                    "kill pid={} key={key} phase={} ({cause}; last line: {last:?})",
                    slot.pid,
                    kill_phase(last)
                );
            }
            self.finished.push(Finished {
                pid: slot.pid,
                lines,
                status,
                cause,
            });
        }
    }

    /// SIGKILLs a random running worker now. Returns whether one was killed.
    fn kill_random(&mut self, rng: &mut Rng) -> bool {
        if self.running.is_empty() {
            return false;
        }
        let slot = &self.running[rng.below(self.running.len() as u64) as usize].slot;
        let mut cause = lock(&slot.cause);
        if cause.is_some() {
            return false;
        }
        let mut child = lock(&slot.child);
        if matches!(child.try_wait(), Ok(Some(_))) {
            return false;
        }
        *cause = Some("at a random moment".into());
        let _ = child.kill();
        true
    }

    /// Orders a kill right after some worker prints a line of `phase`, and
    /// waits (bounded) for it to happen. Returns whether it happened.
    fn kill_after(&mut self, phase: &'static str, within: Duration) -> bool {
        *lock(&self.shared.order) = Some(phase);
        let until = Instant::now() + within;
        while Instant::now() < until {
            if lock(&self.shared.order).is_none() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        // Withdraw the order; a reader may have taken it meanwhile.
        lock(&self.shared.order).take().is_none()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for r in &self.running {
            let mut child = lock(&r.slot.child);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The phase a killed worker died in, from the last line it printed.
fn kill_phase(last: &str) -> &str {
    match phase_of(last) {
        "" => "startup",
        other => other,
    }
}

/// Runs the workers: keeps `bounds.workers` of them running until the calls
/// are used up, killing `bounds.kills` of them along the way. `Err` names the
/// workers still running well past their deadline (a hang); they are left
/// running, so that what they wait for can be looked at before the fleet drops.
fn run_fleet(fleet: &mut Fleet, bounds: &Bounds) -> Result<(usize, usize), String> {
    let mut rng = Rng::new();
    let kill_until = Instant::now() + Duration::from_secs(bounds.seconds);
    // A call waits at most a few seconds (wait("3s") plus statements); past
    // the workers' own deadline this is a hang, and the fleet is torn down.
    let hard_stop = kill_until + Duration::from_secs(30);
    let (mut targeted, mut random) = (0, 0);
    let mut hit: BTreeSet<String> = BTreeSet::new();
    let mut turn = 0usize;
    loop {
        fleet.reap();
        for f in &fleet.finished {
            if f.cause.is_some() {
                hit.insert(kill_phase(f.lines.last().map(String::as_str).unwrap_or("")).into());
            }
        }
        fleet.fill(bounds);
        if fleet.running.is_empty() {
            break;
        }
        if Instant::now() >= hard_stop {
            let stuck: Vec<String> = fleet
                .running
                .iter()
                .map(|r| {
                    format!(
                        "pid {} (started {:.1}s ago), last line {:?}",
                        r.slot.pid,
                        r.slot.started.elapsed().as_secs_f64(),
                        lock(&r.slot.last)
                    )
                })
                .collect();
            return Err(format!(
                "soak workers still running {}s after the deadline (the fleet is killed):\n{}",
                (hard_stop - kill_until).as_secs(),
                stuck.join("\n")
            ));
        }
        if targeted + random >= bounds.kills || Instant::now() >= kill_until {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        std::thread::sleep(Duration::from_millis(50 + rng.below(200)));
        turn += 1;
        if turn.is_multiple_of(3) {
            random += usize::from(fleet.kill_random(&mut rng));
        } else {
            // Aim first at the phases no kill has landed in yet.
            let phases = fleet.mode.phases();
            let phase = phases
                .iter()
                .find(|p| !hit.contains(**p))
                .copied()
                .unwrap_or(phases[turn % phases.len()]);
            if fleet.kill_after(phase, Duration::from_millis(1500)) {
                targeted += 1;
            } else {
                random += usize::from(fleet.kill_random(&mut rng));
            }
        }
    }
    Ok((targeted, random))
}

// ------------------------------------------------------------ the checks

/// A killed worker, by the last line it printed.
struct Kill {
    phase: String,
    key: Option<String>,
    /// The attempt it was inside (`reserved`, `effect`, `recorded`).
    attempt: Option<String>,
}

/// What the workers printed, gathered over one run.
#[derive(Default)]
struct Printed {
    calls: usize,
    executed: Vec<(String, String)>,
    replayed: Vec<(String, String)>,
    refused: usize,
    errors: BTreeMap<String, usize>,
    error_keys: BTreeSet<String>,
    /// Every error line's key and kind.
    error_lines: Vec<(String, String)>,
    error_samples: BTreeMap<String, String>,
    keys: BTreeSet<String>,
    kills: Vec<Kill>,
    /// What became of each attempt: the worker's answer line after it, or the kill.
    attempt_fate: BTreeMap<String, String>,
}

fn gather(finished: &[Finished]) -> Printed {
    let mut p = Printed::default();
    for f in finished {
        if f.cause.is_none() {
            assert!(
                f.status.success() && f.lines.last().map(String::as_str) == Some("done"),
                "worker {} ended on its own without finishing ({}); its output:\n{}",
                f.pid,
                f.status,
                f.lines.join("\n")
            );
        }
        let mut open: Option<String> = None;
        for line in &f.lines {
            let words: Vec<&str> = line.splitn(4, ' ').collect();
            let word = |i: usize| words.get(i).map(|s| s.to_string()).unwrap_or_default();
            match words[0] {
                "call" => {
                    p.calls += 1;
                    p.keys.insert(word(1));
                }
                "reserved" => open = Some(word(2)),
                "executed" => p.executed.push((word(1), word(2))),
                "replayed" => p.replayed.push((word(1), word(2))),
                "refused" => p.refused += 1,
                "error" => {
                    *p.errors.entry(word(2)).or_default() += 1;
                    p.error_keys.insert(word(1));
                    p.error_lines.push((word(1), word(2)));
                    p.error_samples
                        .entry(word(2))
                        .or_insert_with(|| line.clone());
                }
                _ => {}
            }
            if matches!(words[0], "executed" | "replayed" | "refused" | "error") {
                if let Some(a) = open.take() {
                    p.attempt_fate.insert(a, format!("pid {}: {line}", f.pid));
                }
            }
        }
        if f.cause.is_some() {
            let last = f.lines.last().cloned().unwrap_or_default();
            let words: Vec<&str> = last.split(' ').collect();
            let phase = kill_phase(&last).to_owned();
            let key = (words.len() > 1 && phase != "done").then(|| words[1].to_owned());
            let attempt = matches!(phase.as_str(), "reserved" | "effect" | "recorded")
                .then(|| words.get(2).map(|s| s.to_string()))
                .flatten();
            if let Some(a) = open.take() {
                p.attempt_fate
                    .insert(a, format!("pid {} killed after {last:?}", f.pid));
            }
            p.kills.push(Kill {
                phase,
                key,
                attempt,
            });
        }
    }
    p
}

/// What the database holds for one key.
struct Found {
    record: Option<(RecordState, Option<String>)>,
    effects: Vec<String>,
}

async fn ensure_effects_table(store: &dyn AnyPool) {
    // Two runs may create the table at the same moment: on PostgreSQL the
    // creation takes an advisory lock (`pg_create_tables`).
    store
        .create_effects_table()
        .await
        .expect("create idempotent_soak_effects");
}

/// The two databases' pools, behind one face.
trait AnyPool {
    fn create_effects_table(&self) -> futures::future::BoxFuture<'_, Result<(), sqlx::Error>>;
    fn effects(
        &self,
        tenant: &str,
    ) -> futures::future::BoxFuture<'_, Result<Vec<(String, String)>, sqlx::Error>>;
    /// One line per session of the database (besides this one): what it runs
    /// and what it waits for. Printed when the fleet hangs.
    fn activity(&self) -> futures::future::BoxFuture<'_, Result<Vec<String>, sqlx::Error>>;
}

impl AnyPool for sqlx::PgPool {
    fn create_effects_table(&self) -> futures::future::BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(common::servers::pg_create_tables(
            self,
            "CREATE TABLE IF NOT EXISTS idempotent_soak_effects (
                 tenant TEXT NOT NULL, idem_key TEXT NOT NULL,
                 attempt TEXT NOT NULL, pid BIGINT NOT NULL)",
        ))
    }
    fn effects(
        &self,
        tenant: &str,
    ) -> futures::future::BoxFuture<'_, Result<Vec<(String, String)>, sqlx::Error>> {
        let tenant = tenant.to_owned();
        Box::pin(async move {
            sqlx::query_as(
                "SELECT idem_key, attempt FROM idempotent_soak_effects WHERE tenant = $1",
            )
            .bind(tenant)
            .fetch_all(self)
            .await
        })
    }
    fn activity(&self) -> futures::future::BoxFuture<'_, Result<Vec<String>, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_scalar(
                "SELECT format('pid %s app %s state %s wait %s/%s xact %s s blocked by %s: %s',
                        pid, application_name, state, wait_event_type, wait_event,
                        round(extract(epoch FROM now() - xact_start)::numeric, 1),
                        pg_blocking_pids(pid), left(query, 300))
                   FROM pg_stat_activity
                  WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_all(self)
            .await
        })
    }
}

impl AnyPool for sqlx::MySqlPool {
    fn create_effects_table(&self) -> futures::future::BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS idempotent_soak_effects (
                     tenant VARCHAR(100) NOT NULL, idem_key VARCHAR(255) NOT NULL,
                     attempt VARCHAR(64) NOT NULL, pid BIGINT NOT NULL) ENGINE = InnoDB",
            )
            .execute(self)
            .await
            .map(drop)
        })
    }
    fn effects(
        &self,
        tenant: &str,
    ) -> futures::future::BoxFuture<'_, Result<Vec<(String, String)>, sqlx::Error>> {
        let tenant = tenant.to_owned();
        Box::pin(async move {
            sqlx::query_as("SELECT idem_key, attempt FROM idempotent_soak_effects WHERE tenant = ?")
                .bind(tenant)
                .fetch_all(self)
                .await
        })
    }
    fn activity(&self) -> futures::future::BoxFuture<'_, Result<Vec<String>, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_scalar(
                "SELECT CONCAT_WS(' ', 'id', ID, 'command', COMMAND, 'time', TIME, 'state', \
                        IFNULL(STATE, '-'), 'trx', IFNULL(t.trx_state, '-'), \
                        IFNULL(t.trx_started, '-'), ':', LEFT(IFNULL(INFO, ''), 300)) \
                   FROM information_schema.PROCESSLIST p \
                   LEFT JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = p.ID \
                  WHERE p.DB = DATABASE() AND p.ID <> CONNECTION_ID()",
            )
            .fetch_all(self)
            .await
        })
    }
}

async fn found(
    store: &dyn Store,
    pool: &dyn AnyPool,
    tenant: &str,
    scope: &str,
    keys: &BTreeSet<String>,
) -> BTreeMap<String, Found> {
    let mut all: BTreeMap<String, Found> = BTreeMap::new();
    for (key, attempt) in pool.effects(tenant).await.expect("read the effect rows") {
        all.entry(key)
            .or_insert_with(|| Found {
                record: None,
                effects: Vec::new(),
            })
            .effects
            .push(attempt);
    }
    for key in keys {
        all.entry(key.clone()).or_insert_with(|| Found {
            record: None,
            effects: Vec::new(),
        });
    }
    for (key, f) in all.iter_mut() {
        let identity = Identity::new(tenant, scope, key).expect("identity");
        f.record = store
            .fetch(&identity)
            .await
            .expect("fetch a record")
            .map(|r| {
                let result = r.outcome.map(|o| {
                    serde_json::from_slice::<String>(&o.payload)
                        .unwrap_or_else(|e| panic!("key {key}: the recorded result: {e}"))
                });
                (r.state, result)
            });
    }
    all
}

/// Extra effects the rules allow (store mode): each belongs to an attempt
/// whose process was killed inside the body.
#[derive(Debug, Default, PartialEq, Eq)]
struct Extras {
    /// Keys with a complete record and more effects than that one.
    keys: usize,
    /// Their effects beyond the recorded one.
    effects: usize,
    /// Effects of keys left without a complete record (the record in progress or absent).
    unrecorded: usize,
}

/// Checks the invariants; returns the violations and the allowed extra effects.
fn check(mode: Mode, printed: &Printed, found: &BTreeMap<String, Found>) -> (Vec<String>, Extras) {
    let mut violations = Vec::new();
    let mut extras = Extras::default();
    let fate = |a: &str| {
        printed
            .attempt_fate
            .get(a)
            .cloned()
            .unwrap_or_else(|| "no worker reported this attempt".into())
    };
    for (key, f) in found {
        // Attempts whose process died inside the body, by phase.
        let killed_in = |phases: &[&str]| -> BTreeSet<&str> {
            printed
                .kills
                .iter()
                .filter(|k| k.key.as_deref() == Some(key) && phases.contains(&k.phase.as_str()))
                .filter_map(|k| k.attempt.as_deref())
                .collect()
        };
        let recorded = match &f.record {
            Some((RecordState::Complete, Some(a))) => Some(a.as_str()),
            Some((RecordState::Complete, None)) => {
                violations.push(format!("key {key}: a complete record without a result"));
                None
            }
            Some((RecordState::InProgress, _)) => {
                match mode {
                    Mode::Tx => violations.push(format!(
                        "key {key}: an in-progress record survived in transactional mode \
                         (a killed transaction must roll its reservation back); effects {:?}",
                        f.effects
                    )),
                    Mode::Store => {
                        let by_kill = printed.kills.iter().any(|k| {
                            k.key.as_deref() == Some(key)
                                && matches!(k.phase.as_str(), "call" | "reserved" | "effect")
                        });
                        if !by_kill && !printed.error_keys.contains(key) {
                            violations.push(format!(
                                "key {key}: an in-progress record left behind, and no owner of \
                                 this key was killed mid-call nor did a call on it fail"
                            ));
                        }
                    }
                }
                None
            }
            None => None,
        };
        // The recorded attempt ran to its end.
        if let Some(a) = recorded {
            let reported = printed.executed.iter().any(|(k, x)| k == key && x == a);
            let in_flight = match mode {
                Mode::Tx => killed_in(&["recorded"]).contains(a),
                Mode::Store => killed_in(&["effect"]).contains(a),
            };
            if !reported && !in_flight {
                violations.push(format!(
                    "key {key}: the record names attempt {a}, which never reached its end \
                     (not answered `executed`, not killed while completing); its fate: {}",
                    fate(a)
                ));
            }
        }
        // The answers the workers printed name the recorded attempt.
        for (what, list) in [
            ("executed", &printed.executed),
            ("replayed", &printed.replayed),
        ] {
            for (_, x) in list.iter().filter(|(k, _)| k == key) {
                if Some(x.as_str()) != recorded {
                    violations.push(format!(
                        "key {key}: a worker answered `{what} {x}` but the record is {:?}",
                        f.record
                    ));
                }
            }
        }
        match mode {
            Mode::Tx => match recorded {
                Some(a) => {
                    if f.effects != [a] {
                        violations.push(format!(
                            "key {key}: the complete record names {a}; effect rows {:?} \
                             (exactly that one is expected)",
                            f.effects
                        ));
                    }
                }
                None => {
                    if !f.effects.is_empty() {
                        violations.push(format!(
                            "key {key}: effect rows without a complete record: {:?} \
                             (record {:?}); fates: {:?}",
                            f.effects,
                            f.record,
                            f.effects.iter().map(|a| fate(a)).collect::<Vec<_>>()
                        ));
                    }
                }
            },
            Mode::Store => {
                let distinct: BTreeSet<&String> = f.effects.iter().collect();
                if distinct.len() != f.effects.len() {
                    violations.push(format!(
                        "key {key}: one attempt wrote more than one effect row: {:?}",
                        f.effects
                    ));
                }
                if let Some(a) = recorded {
                    if !f.effects.iter().any(|e| e == a) {
                        violations.push(format!(
                            "key {key}: the complete record names attempt {a}, which wrote no \
                             effect row; effect rows {:?}",
                            f.effects
                        ));
                    }
                }
                // Extra effects are allowed only for attempts killed inside the
                // body: after `effect` (or after `reserved`: the effect row can
                // commit before its marker is printed); and for an owner told
                // `LeaseLost` (rule 10: its body outlived its lease, e.g. the
                // machine stalled, and the loss was reported, never silent).
                let explained = killed_in(&["reserved", "effect"]);
                let mut extras_here = 0;
                for e in f.effects.iter().filter(|e| Some(e.as_str()) != recorded) {
                    let reported_lost = fate(e).contains(" LeaseLost");
                    if explained.contains(e.as_str()) || reported_lost {
                        extras_here += 1;
                    } else {
                        violations.push(format!(
                            "key {key}: extra effect of attempt {e} not explained by a kill \
                             (record {:?}); its fate: {}",
                            f.record,
                            fate(e)
                        ));
                    }
                }
                if recorded.is_none() {
                    extras.unrecorded += extras_here;
                } else if extras_here > 0 {
                    extras.keys += 1;
                    extras.effects += extras_here;
                }
            }
        }
    }
    (violations, extras)
}

// --------------------------------------------------------------- the runs

fn soak(backend: Backend, mode: Mode) {
    soak_with(backend, mode, Bounds::from_env());
}

fn soak_with(backend: Backend, mode: Mode, bounds: Bounds) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let (store, pool, url): (Box<dyn Store>, Box<dyn AnyPool>, String) =
        match runtime.block_on(async {
            match backend {
                Backend::Pg => pg_store_or_skip().await.map(|s| {
                    let pool = s.pool().clone();
                    (
                        Box::new(s) as Box<dyn Store>,
                        Box::new(pool) as Box<dyn AnyPool>,
                        common::servers::pg_url(),
                    )
                }),
                Backend::MySql => mysql_store_or_skip().await.map(|s| {
                    let pool = s.pool().clone();
                    (
                        Box::new(s) as Box<dyn Store>,
                        Box::new(pool) as Box<dyn AnyPool>,
                        common::servers::mysql_url(),
                    )
                }),
            }
        }) {
            Some(x) => x,
            None => return,
        };
    runtime.block_on(ensure_effects_table(&*pool));

    let label = format!(
        "{}/{}",
        match backend {
            Backend::Pg => "postgres",
            Backend::MySql => "mariadb",
        },
        mode.arg()
    );
    let started = Instant::now();
    let run_start_ms = now_ms();
    let mut fleet = Fleet {
        backend,
        url,
        mode,
        tenant: fresh_tenant(),
        run_start_ms,
        deadline_ms: run_start_ms + bounds.seconds * 1000,
        shared: Arc::new(Shared {
            order: Mutex::new(None),
        }),
        running: Vec::new(),
        finished: Vec::new(),
    };
    println!(
        "soak {label}: tenant {} — {} calls, {} workers, {} kills, {}s",
        fleet.tenant, bounds.calls, bounds.workers, bounds.kills, bounds.seconds
    );
    let (targeted, random) = match run_fleet(&mut fleet, &bounds) {
        Ok(kills) => kills,
        Err(hang) => {
            // What the database sessions are doing and waiting for, while the
            // stuck workers still hold them.
            let activity = runtime.block_on(pool.activity()).unwrap_or_else(|e| {
                vec![format!("(the server's activity could not be read: {e})")]
            });
            panic!("{hang}\nthe server's sessions:\n{}", activity.join("\n"));
        }
    };
    let printed = gather(&fleet.finished);
    let found = runtime.block_on(found(
        &*store,
        &*pool,
        &fleet.tenant,
        scope(backend, mode),
        &printed.keys,
    ));
    let (violations, extras) = check(mode, &printed, &found);

    let mut kills_by_phase: BTreeMap<&str, usize> = BTreeMap::new();
    for kill in &printed.kills {
        *kills_by_phase.entry(&kill.phase).or_default() += 1;
    }
    let effects: usize = found.values().map(|f| f.effects.len()).sum();
    let complete = found
        .values()
        .filter(|f| matches!(f.record, Some((RecordState::Complete, _))))
        .count();
    let in_progress = found
        .values()
        .filter(|f| matches!(f.record, Some((RecordState::InProgress, _))))
        .count();
    println!(
        "soak {label}: {:.1}s, {} workers started; calls {}, executed {}, replayed {}, \
         in-progress refusals {}, errors {:?}; kills {} ({targeted} targeted, {random} random) \
         by phase {kills_by_phase:?}; keys {}, effects {effects}, complete records {complete}, \
         in-progress records left {in_progress}, keys with explained extra effects {} \
         ({} extra effects; {} more on keys left without a complete record)",
        started.elapsed().as_secs_f64(),
        fleet.finished.len(),
        printed.calls,
        printed.executed.len(),
        printed.replayed.len(),
        printed.refused,
        printed.errors,
        printed.kills.len(),
        found.len(),
        extras.keys,
        extras.effects,
        extras.unrecorded,
    );
    for sample in printed.error_samples.values() {
        println!("soak {label}: error sample: {sample}");
    }
    if !printed.error_lines.is_empty() {
        // Whether an error came on a key one of whose owners was killed mid-call
        // (mid-transaction in transactional mode): the rollback that a waiting
        // duplicate saw.
        let after_kill = printed
            .error_lines
            .iter()
            .filter(|(key, _)| {
                printed.kills.iter().any(|k| {
                    k.key.as_deref() == Some(key.as_str())
                        && matches!(
                            k.phase.as_str(),
                            "call" | "reserved" | "effect" | "recorded"
                        )
                })
            })
            .count();
        println!(
            "soak {label}: {after_kill} of {} errors came on a key whose owner was killed mid-call",
            printed.error_lines.len()
        );
    }
    assert!(
        violations.is_empty(),
        "soak {label}: {} invariant violation(s) (tenant {}):\n{}",
        violations.len(),
        fleet.tenant,
        violations.join("\n")
    );
}

#[test]
fn soak_postgres_transactional() {
    soak(Backend::Pg, Mode::Tx);
}

#[test]
fn soak_postgres_store() {
    soak(Backend::Pg, Mode::Store);
}

#[test]
fn soak_mariadb_transactional() {
    soak(Backend::MySql, Mode::Tx);
}

#[test]
fn soak_mariadb_store() {
    soak(Backend::MySql, Mode::Store);
}

/// More calls than the deadline leaves time for (a loaded machine): the
/// workers stop at the deadline with calls left over, and the fleet stops with
/// them. Failed before: a replacement was started for the calls left over,
/// stopped at once (past its deadline), was replaced again, and so on until
/// the run failed as "workers still running 30s after the deadline".
#[test]
fn soak_stops_at_the_deadline_with_calls_left() {
    let bounds = Bounds {
        calls: 100_000,
        seconds: 2,
        ..Bounds::from_env()
    };
    soak_with(Backend::MySql, Mode::Tx, bounds);
}

/// The checks themselves, on made-up outcomes: each kind of violation is caught,
/// and what the rules allow passes.
#[test]
fn the_checks_catch_violations() {
    let complete = |a: &str| Some((RecordState::Complete, Some(a.to_owned())));
    let found = |record, effects: &[&str]| Found {
        record,
        effects: effects.iter().map(|s| s.to_string()).collect(),
    };
    let kill = |phase: &str, key: &str, attempt: Option<&str>| Kill {
        phase: phase.to_owned(),
        key: Some(key.to_owned()),
        attempt: attempt.map(str::to_owned),
    };
    let mut printed = Printed::default();
    printed.executed.push(("k".into(), "a1".into()));
    printed.replayed.push(("k".into(), "a1".into()));

    // One execution, one effect: fine in both modes.
    let one = BTreeMap::from([("k".to_owned(), found(complete("a1"), &["a1"]))]);
    assert!(check(Mode::Tx, &printed, &one).0.is_empty());
    assert!(check(Mode::Store, &printed, &one).0.is_empty());

    // A second effect: transactional mode never allows it; store mode only
    // when that attempt's process was killed inside the body.
    let two = BTreeMap::from([("k".to_owned(), found(complete("a1"), &["a1", "a0"]))]);
    assert_eq!(check(Mode::Tx, &printed, &two).0.len(), 1);
    assert_eq!(check(Mode::Store, &printed, &two).0.len(), 1);
    let mut killed = Printed {
        executed: printed.executed.clone(),
        replayed: printed.replayed.clone(),
        ..Printed::default()
    };
    killed.kills.push(kill("effect", "k", Some("a0")));
    assert_eq!(
        check(Mode::Store, &killed, &two),
        (
            vec![],
            Extras {
                keys: 1,
                effects: 1,
                unrecorded: 0
            }
        )
    );
    let mut elsewhere = Printed {
        executed: printed.executed.clone(),
        ..Printed::default()
    };
    elsewhere.kills.push(kill("effect", "other", Some("a0")));
    assert_eq!(check(Mode::Store, &elsewhere, &two).0.len(), 1);

    let twice = BTreeMap::from([("k".to_owned(), found(complete("a1"), &["a1", "a1"]))]);
    assert_eq!(check(Mode::Store, &printed, &twice).0.len(), 1);

    // An effect without a complete record.
    let orphan = BTreeMap::from([("k".to_owned(), found(None, &["a0"]))]);
    assert_eq!(check(Mode::Tx, &Printed::default(), &orphan).0.len(), 1);

    // A record naming an attempt that wrote nothing, or that never got to its end.
    let no_effect = BTreeMap::from([("k".to_owned(), found(complete("a1"), &[]))]);
    assert_eq!(check(Mode::Store, &printed, &no_effect).0.len(), 1);
    assert_eq!(
        check(Mode::Store, &Printed::default(), &one).0.len(),
        1,
        "nobody answered `executed a1`"
    );
    let mut committing = Printed::default();
    committing.kills.push(kill("recorded", "k", Some("a1")));
    assert!(check(Mode::Tx, &committing, &one).0.is_empty());

    // A worker's answer that disagrees with the record.
    let mut wrong = Printed::default();
    wrong.executed.push(("k".into(), "a1".into()));
    wrong.replayed.push(("k".into(), "a9".into()));
    assert_eq!(check(Mode::Tx, &wrong, &one).0.len(), 1);

    // A reservation left in progress: never in transactional mode; in store
    // mode only after a kill mid-call on that key.
    let stuck = BTreeMap::from([(
        "k".to_owned(),
        found(Some((RecordState::InProgress, None)), &[]),
    )]);
    assert_eq!(check(Mode::Tx, &Printed::default(), &stuck).0.len(), 1);
    assert_eq!(check(Mode::Store, &Printed::default(), &stuck).0.len(), 1);
    let mut mid_call = Printed::default();
    mid_call.kills.push(kill("call", "k", None));
    assert!(check(Mode::Store, &mid_call, &stuck).0.is_empty());
}
