//! Paused processes (a GC pause, a frozen VM: SIGSTOP, then SIGCONT), the
//! case fencing exists for (rules 9, 10, 14, 20), across OS processes on a
//! SQLite file shared by processes, PostgreSQL and MariaDB.
//!
//! Each test starts `idempotent-pause-worker` processes (see
//! `tests/bin/pause_worker.rs`), stops one where its output says it is, and
//! resumes it later. Body runs are counted by the effect files the bodies
//! write (one per run), and the record's answer by a later call's replay.
//! Every child is resumed and killed when its handle drops, so a failing
//! test leaves no stopped process behind.

use crate::common;

use common::servers::{fresh_tenant, mysql_store_or_skip, mysql_url, pg_store_or_skip, pg_url};
use idempotent_runtime::{Identity, RecordState, SqliteStore, Store};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const WORKER: &str = env!("CARGO_BIN_EXE_idempotent-pause-worker");

/// Longer than a 1 s lease plus the clock's slack: a holder stopped this
/// long after its last renewal has lost its lease.
const PAST_THE_LEASE: Duration = Duration::from_millis(2500);

/// The bound on any one answer the test waits for (a worker's waits are
/// 20 s at most, SQLite's busy timeout 10 s).
const ANSWER_WITHIN: Duration = Duration::from_secs(45);

#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Pg,
    MySql,
}

/// The store the test reads the records through, and the URL the workers open.
struct Db {
    backend: Backend,
    url: String,
    store: Box<dyn Store>,
}

async fn open(backend: Backend) -> Option<Db> {
    let (url, store): (String, Box<dyn Store>) = match backend {
        Backend::Sqlite => {
            let url = common::scratch::sqlite_url("pause");
            let store = SqliteStore::connect(&url).await.expect("sqlite");
            (url, Box::new(store))
        }
        Backend::Pg => (pg_url(), Box::new(pg_store_or_skip().await?)),
        Backend::MySql => (mysql_url(), Box::new(mysql_store_or_skip().await?)),
    };
    Some(Db {
        backend,
        url,
        store,
    })
}

impl Db {
    fn arg(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite => "sqlite",
            Backend::Pg => "pg",
            Backend::MySql => "mysql",
        }
    }
}

/// One worker process, its output lines as they come, resumed and killed on drop.
struct Worker {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

/// The last line a worker prints: its call's answer.
const ANSWERS: [&str; 6] = [
    "executed ",
    "replayed ",
    "recovered ",
    "in_progress",
    "lease_lost",
    "error ",
];

impl Worker {
    fn start(db: &Db, mode: &str, tenant: &str, key: &str, effects: &Path, body_ms: u64) -> Self {
        Self::start_with_hook(db, mode, (tenant, key), effects, body_ms, 0)
    }

    /// [`Worker::start`], its recover hook sleeping `hook_ms` after `asked`.
    fn start_with_hook(
        db: &Db,
        mode: &str,
        (tenant, key): (&str, &str),
        effects: &Path,
        body_ms: u64,
        hook_ms: u64,
    ) -> Self {
        let mut child = Command::new(WORKER)
            .env("IDEMPOTENT_PAUSE_HOOK_MS", hook_ms.to_string())
            .args([
                db.arg(),
                &db.url,
                mode,
                tenant,
                key,
                &effects.display().to_string(),
                &body_ms.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the pause worker");
        let stdout = child.stdout.take().expect("piped stdout");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Worker {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: `kill` with a pid this test started (and has not reaped:
        // the `Child` is waited for only on drop) and a valid signal number.
        let sent = unsafe { libc::kill(pid, signal) };
        assert_eq!(sent, 0, "signal {signal} to the worker {pid}");
    }

    /// SIGSTOP: the whole process freezes where it is.
    fn stop(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT.
    fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Stops the worker once it says `line`, and keeps it stopped until its
    /// lease has run out ([`PAST_THE_LEASE`]).
    fn stop_at_past_the_lease(&mut self, line: &str) {
        self.reached(line);
        self.stop();
        std::thread::sleep(PAST_THE_LEASE);
    }

    /// Reads lines until one starts with one of `prefixes`, within `within`.
    fn until(&mut self, prefixes: &[&str], within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if prefixes.iter().any(|p| line.starts_with(p)) {
                        return line;
                    }
                }
                Err(e) => panic!(
                    "worker {}: no line starting with {prefixes:?} within {within:?} ({e}); it said {:?}",
                    self.pid(),
                    self.seen
                ),
            }
        }
    }

    /// The line starting with `prefix` (the worker reached that point).
    fn reached(&mut self, prefix: &str) -> String {
        self.until(&[prefix], ANSWER_WITHIN)
    }

    /// The call's answer.
    fn answer(&mut self) -> String {
        self.until(&ANSWERS, ANSWER_WITHIN)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: as in `signal`; the child is not reaped yet.
        unsafe {
            libc::kill(pid, libc::SIGCONT);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How many times a body ran (its effect files).
fn body_runs(effects: &Path) -> usize {
    std::fs::read_dir(effects)
        .map(|entries| entries.count())
        .unwrap_or(0)
}

fn effects_dir() -> PathBuf {
    common::scratch::dir("pause-effects")
}

async fn snapshot(
    db: &Db,
    tenant: &str,
    scope: &str,
    key: &str,
) -> idempotent_runtime::RecordSnapshot {
    let identity = Identity::new(tenant, scope, key).expect("identity");
    db.store
        .fetch(&identity)
        .await
        .expect("fetch")
        .expect("the record")
}

/// One test per backend for a scenario: `scenario => Backend: test_name, ...`
/// (a backend left out where it cannot show the scenario).
macro_rules! on_each_backend {
    ($scenario:ident => $($backend:ident: $test:ident),+ $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            $scenario(Backend::$backend).await;
        }
    )+};
}

/// Rules 9 and 10: an owner stopped mid-body past its lease (no renewal
/// while it is stopped) is taken over by a call in another process, which
/// runs the body again (no recover hook: a takeover may) and records its
/// answer. Resumed, the stopped owner's completion is fenced: it gets
/// `LeaseLost`, the record keeps the second owner's answer, and a later call
/// replays it.
async fn stopped_owner_is_fenced(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    let (tenant, key, effects) = (fresh_tenant(), "stopped-owner", effects_dir());
    let mut holder = Worker::start(&db, "store", &tenant, key, &effects, 3000);
    holder.stop_at_past_the_lease("body ");

    // The owner is resumed while the takeover's body runs (the record in
    // progress under the new owner's token), so its renewals and its
    // completion meet the new owner's record, not a completed one.
    let mut taker = Worker::start(&db, "store", &tenant, key, &effects, 1500);
    taker.reached("body ");
    holder.resume();
    assert_eq!(
        holder.answer(),
        "lease_lost",
        "the resumed owner's completion is refused: {:?}",
        holder.seen
    );
    assert_eq!(
        taker.answer(),
        format!("executed {}", taker.pid()),
        "the stopped owner's lease ran out: the record is taken over and the body runs again"
    );
    assert_eq!(
        body_runs(&effects),
        2,
        "the stopped owner's run and the takeover's"
    );

    let record = snapshot(&db, &tenant, "pause.store", key).await;
    assert_eq!((record.state, record.attempt), (RecordState::Complete, 2));
    let mut later = Worker::start(&db, "store", &tenant, key, &effects, 0);
    assert_eq!(
        later.answer(),
        format!("replayed {}", taker.pid()),
        "the takeover's answer is the key's answer"
    );
    assert_eq!(body_runs(&effects), 2);
}

on_each_backend!(
    stopped_owner_is_fenced =>
        Sqlite: stopped_owner_is_fenced_after_a_takeover_sqlite,
        Pg: stopped_owner_is_fenced_after_a_takeover_postgres,
        MySql: stopped_owner_is_fenced_after_a_takeover_mariadb,
);

/// Rule 20 with a stopped owner: the takeover asks the hook (attempt 2),
/// which finds the stopped owner's effect and answers `Completed`: the body
/// runs once. Resumed, the stopped owner gets `LeaseLost` and its own
/// completion overwrites nothing: the hook's answer is replayed.
async fn stopped_owner_recovered(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    let (tenant, key, effects) = (fresh_tenant(), "stopped-recovered", effects_dir());
    let mut holder = Worker::start(&db, "recover", &tenant, key, &effects, 3000);
    holder.stop_at_past_the_lease("body ");

    let mut taker = Worker::start(&db, "recover", &tenant, key, &effects, 0);
    let answer = taker.answer();
    assert_eq!(
        answer,
        format!("recovered {}", holder.pid()),
        "the hook found the stopped owner's effect: {:?}",
        taker.seen
    );
    assert!(
        taker.seen.contains(&"asked 2".to_owned()),
        "asked once, as attempt 2: {:?}",
        taker.seen
    );
    holder.resume();
    assert_eq!(holder.answer(), "lease_lost", "{:?}", holder.seen);
    assert_eq!(
        body_runs(&effects),
        1,
        "the body ran once: the stopped owner's"
    );

    let record = snapshot(&db, &tenant, "pause.recover", key).await;
    assert_eq!(
        (record.state, record.attempt, record.recovered),
        (RecordState::Complete, 2, true)
    );
    let mut later = Worker::start(&db, "recover", &tenant, key, &effects, 0);
    assert_eq!(later.answer(), format!("replayed {}", holder.pid()));
    assert!(
        !later.seen.iter().any(|l| l.starts_with("asked")),
        "a replay asks no hook: {:?}",
        later.seen
    );
}

on_each_backend!(
    stopped_owner_recovered =>
        Sqlite: stopped_owner_is_fenced_after_a_recovered_takeover_sqlite,
        Pg: stopped_owner_is_fenced_after_a_recovered_takeover_postgres,
        MySql: stopped_owner_is_fenced_after_a_recovered_takeover_mariadb,
);

/// Rule 20 with an owner stopped inside its recover hook: a record left by
/// a crashed owner (no effect: the hooks answer `Run`) is taken over by A,
/// which is stopped while its hook runs; once A's lease has run out, B takes
/// it over (attempt 3), its hook answers `Run` and the body runs. Resumed
/// while B's body runs, A's hook answers `Run` too, but A no longer owns the
/// record: its fenced renewal says so and A's body never runs (`LeaseLost`). One body run, B's
/// answer replayed.
async fn stopped_in_the_recover_hook(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    let (tenant, key, effects) = (fresh_tenant(), "stopped-in-hook", effects_dir());
    let identity = Identity::new(tenant.as_str(), "pause.recover", key).expect("identity");
    let crashed = idempotent_runtime::OwnerToken::new();
    let planted = db
        .store
        .reserve(idempotent_runtime::ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &crashed,
            lease: Duration::ZERO,
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("plant a crashed owner's record");
    assert_eq!(planted, idempotent_runtime::Reservation::FRESH);

    let mut a = Worker::start_with_hook(&db, "recover", (&tenant, key), &effects, 0, 3000);
    assert_eq!(a.reached("asked "), "asked 2");
    a.stop();
    std::thread::sleep(PAST_THE_LEASE);
    // A is resumed while B's body runs: A's fenced renewal meets B's record
    // in progress under B's token.
    let mut b = Worker::start(&db, "recover", &tenant, key, &effects, 1500);
    b.reached("body ");
    assert!(b.seen.contains(&"asked 3".to_owned()), "{:?}", b.seen);
    a.resume();
    assert_eq!(a.answer(), "lease_lost", "{:?}", a.seen);
    assert!(
        a.seen.contains(&"hook answers 2 run".to_owned()),
        "{:?}",
        a.seen
    );
    assert_eq!(b.answer(), format!("executed {}", b.pid()), "{:?}", b.seen);
    assert!(
        !a.seen.iter().any(|l| l.starts_with("body ")),
        "the stopped hook's call never runs the body: {:?}",
        a.seen
    );
    assert_eq!(body_runs(&effects), 1, "B's run only");
    let record = snapshot(&db, &tenant, "pause.recover", key).await;
    assert_eq!(
        (record.state, record.attempt, record.recovered),
        (RecordState::Complete, 3, false)
    );
    let mut later = Worker::start(&db, "recover", &tenant, key, &effects, 0);
    assert_eq!(later.answer(), format!("replayed {}", b.pid()));
}

on_each_backend!(
    stopped_in_the_recover_hook =>
        Sqlite: stopped_in_the_recover_hook_sqlite,
        Pg: stopped_in_the_recover_hook_postgres,
        MySql: stopped_in_the_recover_hook_mariadb,
);

/// Stopped right after its body returned (the completion about to be sent,
/// or in flight): whichever landed first, there is one answer. Either the
/// completion was written before the stop (the takeover replays it and the
/// resumed owner says `executed`), or the takeover ran the body again and the
/// resumed owner is refused (`LeaseLost`), or (SQLite) the owner was stopped
/// inside its completion's write transaction, holding the file's write lock:
/// the takeover cannot write, waits out the busy timeout and is refused as
/// in progress, and the resumed owner's completion lands (`executed`).
async fn stopped_while_completing(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    let (tenant, key, effects) = (fresh_tenant(), "stopped-completing", effects_dir());
    let mut holder = Worker::start(&db, "store", &tenant, key, &effects, 0);
    holder.stop_at_past_the_lease("returning ");

    let mut taker = Worker::start(&db, "store", &tenant, key, &effects, 0);
    let taken = taker.answer();
    holder.resume();
    let held = holder.answer();
    eprintln!("{backend:?}: the takeover answered {taken}, the resumed owner {held}");
    let winner = if taken == format!("replayed {}", holder.pid()) {
        assert_eq!(held, format!("executed {}", holder.pid()));
        assert_eq!(body_runs(&effects), 1);
        holder.pid()
    } else if taken == "in_progress" {
        assert!(
            matches!(backend, Backend::Sqlite),
            "only a stopped SQLite writer holds others off: {:?}",
            taker.seen
        );
        assert_eq!(
            held,
            format!("executed {}", holder.pid()),
            "{:?}",
            holder.seen
        );
        assert_eq!(body_runs(&effects), 1);
        holder.pid()
    } else {
        assert_eq!(
            taken,
            format!("executed {}", taker.pid()),
            "{:?}",
            taker.seen
        );
        assert_eq!(held, "lease_lost", "{:?}", holder.seen);
        assert_eq!(body_runs(&effects), 2);
        taker.pid()
    };
    let mut later = Worker::start(&db, "store", &tenant, key, &effects, 0);
    assert_eq!(later.answer(), format!("replayed {winner}"));
}

on_each_backend!(
    stopped_while_completing =>
        Sqlite: stopped_while_completing_keeps_one_answer_sqlite,
        Pg: stopped_while_completing_keeps_one_answer_postgres,
        MySql: stopped_while_completing_keeps_one_answer_mariadb,
);

/// Rule 4 with a stopped owner whose lease (30 s) is live: a duplicate
/// waiting for it (`wait("2s")`) gives up within its bound with
/// `InProgress`; once the owner is resumed and has answered, a retry replays,
/// and so does a duplicate that was stopped while it waited.
async fn duplicate_waits_for_a_stopped_owner(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    let (tenant, key, effects) = (fresh_tenant(), "waited-for", effects_dir());
    let mut holder = Worker::start(&db, "wait", &tenant, key, &effects, 500);
    holder.reached("body ");
    holder.stop();

    let mut duplicate = Worker::start(&db, "wait", &tenant, key, &effects, 0);
    assert_eq!(duplicate.answer(), "in_progress", "{:?}", duplicate.seen);
    // A second duplicate, itself stopped while it waits, and resumed once
    // the owner has answered and its own bound has passed: it looks again
    // and replays, neither refused nor run.
    let mut waiter = Worker::start(&db, "wait", &tenant, key, &effects, 0);
    waiter.reached("connected");
    std::thread::sleep(Duration::from_millis(300));
    waiter.stop();
    holder.resume();
    assert_eq!(holder.answer(), format!("executed {}", holder.pid()));
    std::thread::sleep(PAST_THE_LEASE);
    waiter.resume();
    assert_eq!(
        waiter.answer(),
        format!("replayed {}", holder.pid()),
        "{:?}",
        waiter.seen
    );
    let mut retry = Worker::start(&db, "wait", &tenant, key, &effects, 0);
    assert_eq!(retry.answer(), format!("replayed {}", holder.pid()));
    assert_eq!(body_runs(&effects), 1);
}

on_each_backend!(
    duplicate_waits_for_a_stopped_owner =>
        Sqlite: duplicate_waiting_for_a_stopped_owner_is_bounded_sqlite,
        Pg: duplicate_waiting_for_a_stopped_owner_is_bounded_postgres,
        MySql: duplicate_waiting_for_a_stopped_owner_is_bounded_mariadb,
);

/// Transactional mode, the owner stopped mid-body inside its transaction
/// (on SQLite holding the database's write lock; on PostgreSQL and MariaDB
/// the uncommitted record's row): a duplicate's call ends within its bound
/// (`InProgress`, or a store error naming the lock), never runs the body,
/// and once the owner is resumed it commits its answer, which a retry replays.
async fn stopped_in_a_transaction(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    let (tenant, key, effects) = (fresh_tenant(), "stopped-in-tx", effects_dir());
    let mut holder = Worker::start(&db, "tx", &tenant, key, &effects, 500);
    holder.reached("body ");
    holder.stop();

    let mut duplicate = Worker::start(&db, "tx", &tenant, key, &effects, 0);
    let refused = duplicate.answer();
    eprintln!("{backend:?}: the duplicate of a stopped transaction answered {refused}");
    assert!(
        refused == "in_progress" || refused.starts_with("error "),
        "the duplicate is refused, not run: {:?}",
        duplicate.seen
    );
    assert_eq!(body_runs(&effects), 1);
    holder.resume();
    assert_eq!(
        holder.answer(),
        format!("executed {}", holder.pid()),
        "{:?}",
        holder.seen
    );
    let mut retry = Worker::start(&db, "tx", &tenant, key, &effects, 0);
    assert_eq!(retry.answer(), format!("replayed {}", holder.pid()));
    assert_eq!(body_runs(&effects), 1);
}

on_each_backend!(
    stopped_in_a_transaction =>
        Sqlite: stopped_in_a_transaction_sqlite,
        Pg: stopped_in_a_transaction_postgres,
        MySql: stopped_in_a_transaction_mariadb,
);

/// The lease runs out while the owner is stopped, and it is resumed at the
/// moment another process's takeover is sent: either the resumed owner's
/// renewal lands first (the lease lapsed but nobody took it: the owner keeps
/// it, the other call waits and replays its answer), or the takeover does
/// (the owner gets `LeaseLost`). Never two recorded answers, and a later
/// call replays the one there is.
async fn resumed_as_taken_over(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    for round in 0..2 {
        let (tenant, effects) = (fresh_tenant(), effects_dir());
        let key = format!("resumed-{round}");
        let mut holder = Worker::start(&db, "store", &tenant, &key, &effects, 1500);
        holder.stop_at_past_the_lease("body ");
        let mut taker = Worker::start(&db, "store", &tenant, &key, &effects, 0);
        taker.reached("connected");
        holder.resume();
        let (taken, held) = (taker.answer(), holder.answer());
        eprintln!(
            "{backend:?} round {round}: the takeover answered {taken}, the resumed owner {held}"
        );
        let winner = if held == format!("executed {}", holder.pid()) {
            assert_eq!(
                taken,
                format!("replayed {}", holder.pid()),
                "{:?}",
                taker.seen
            );
            assert_eq!(body_runs(&effects), 1);
            holder.pid()
        } else {
            assert_eq!(held, "lease_lost", "{:?}", holder.seen);
            assert_eq!(
                taken,
                format!("executed {}", taker.pid()),
                "{:?}",
                taker.seen
            );
            assert_eq!(body_runs(&effects), 2);
            taker.pid()
        };
        let mut later = Worker::start(&db, "store", &tenant, &key, &effects, 0);
        assert_eq!(later.answer(), format!("replayed {winner}"));
    }
}

on_each_backend!(
    resumed_as_taken_over =>
        Sqlite: resumed_as_its_record_is_taken_over_sqlite,
        Pg: resumed_as_its_record_is_taken_over_postgres,
        MySql: resumed_as_its_record_is_taken_over_mariadb,
);

/// Stopped while its reservation is in flight: a takeover that waits on
/// the server for a row lock (here the test's `SELECT … FOR UPDATE`) is
/// decided there while the process is stopped, with a lease that runs out
/// before the process can learn it owns the record. Another process takes
/// the record over and records its answer. Resumed, the stopped call learns
/// it had acquired the record: it must not run its body now (the key has
/// its answer, and the record is no longer its own); it gets `LeaseLost`.
/// PostgreSQL and MariaDB: their servers decide a statement whose client is
/// stopped (SQLite's lock waits run in the client, which is stopped too).
async fn stopped_while_its_reservation_lands(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    for round in 0..10 {
        let (tenant, effects) = (fresh_tenant(), effects_dir());
        let key = format!("reserving-{round}");
        let identity = Identity::new(tenant.as_str(), "pause.store", &key).expect("identity");
        let crashed = idempotent_runtime::OwnerToken::new();
        let planted = db
            .store
            .reserve(idempotent_runtime::ReserveRequest {
                identity: &identity,
                fingerprint: None,
                token: &crashed,
                lease: Duration::ZERO,
                ttl: Duration::from_secs(3600),
            })
            .await
            .expect("plant a crashed owner's record");
        assert_eq!(planted, idempotent_runtime::Reservation::FRESH);
        // The row is locked: the worker's takeover waits for it on the server.
        let lock = RowLock::take(&db, &tenant, &key).await;
        let mut stopped = Worker::start(&db, "store", &tenant, &key, &effects, 0);
        stopped.reached("connected");
        std::thread::sleep(Duration::from_millis(300));
        stopped.stop();
        lock.let_go().await;
        std::thread::sleep(Duration::from_millis(300));
        let record = snapshot(&db, &tenant, "pause.store", &key).await;
        if record.attempt != 2 {
            // Stopped between two statements: nothing landed. Again.
            eprintln!("round {round}: the stop fell between statements");
            continue;
        }
        std::thread::sleep(PAST_THE_LEASE);
        let mut taker = Worker::start(&db, "store", &tenant, &key, &effects, 0);
        assert_eq!(
            taker.answer(),
            format!("executed {}", taker.pid()),
            "{:?}",
            taker.seen
        );
        stopped.resume();
        assert_eq!(stopped.answer(), "lease_lost", "{:?}", stopped.seen);
        assert!(
            !stopped.seen.iter().any(|l| l.starts_with("body ")),
            "a call that learns of its reservation after losing it runs no body: {:?}",
            stopped.seen
        );
        assert_eq!(body_runs(&effects), 1, "the takeover's run only");
        let mut later = Worker::start(&db, "store", &tenant, &key, &effects, 0);
        assert_eq!(later.answer(), format!("replayed {}", taker.pid()));
        return;
    }
    panic!("the stop never fell while the reservation waited on the server");
}

on_each_backend!(
    stopped_while_its_reservation_lands =>
        Pg: stopped_while_its_reservation_lands_runs_no_body_postgres,
        MySql: stopped_while_its_reservation_lands_runs_no_body_mariadb,
);

/// A record's row locked by an open transaction of the test's.
enum RowLock {
    Pg(sqlx::Transaction<'static, sqlx::Postgres>),
    My(sqlx::Transaction<'static, sqlx::MySql>),
}

impl RowLock {
    async fn take(db: &Db, tenant: &str, key: &str) -> Self {
        match db.backend {
            Backend::Pg => {
                let pool = sqlx::PgPool::connect(&db.url).await.expect("connect");
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query(
                    "SELECT 1 FROM idempotency_records \
                     WHERE tenant = $1 AND scope = 'pause.store' AND key = $2 FOR UPDATE",
                )
                .bind(tenant)
                .bind(key)
                .execute(&mut *tx)
                .await
                .expect("lock the record");
                RowLock::Pg(tx)
            }
            Backend::MySql => {
                let pool = sqlx::MySqlPool::connect(&db.url).await.expect("connect");
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query(
                    "SELECT 1 FROM idempotency_records \
                     WHERE tenant = ? AND scope = 'pause.store' AND `key` = ? FOR UPDATE",
                )
                .bind(tenant)
                .bind(key)
                .execute(&mut *tx)
                .await
                .expect("lock the record");
                RowLock::My(tx)
            }
            Backend::Sqlite => unreachable!("SQLite's lock waits run in the stopped client"),
        }
    }

    async fn let_go(self) {
        match self {
            RowLock::Pg(tx) => tx.commit().await.expect("commit"),
            RowLock::My(tx) => tx.commit().await.expect("commit"),
        }
    }
}

/// Rule 20 with an owner killed inside its recover hook (SIGKILL): a record
/// left by a crashed owner is taken over by A, which dies while its hook
/// asks. The next caller, B, takes the record over as attempt 3 once A's
/// lease has run out and asks the hook again: never a blind run, never a
/// fresh attempt 1.
async fn killed_in_the_recover_hook(backend: Backend) {
    let Some(db) = open(backend).await else {
        return;
    };
    let (tenant, key, effects) = (fresh_tenant(), "killed-in-hook", effects_dir());
    let identity = Identity::new(tenant.as_str(), "pause.recover", key).expect("identity");
    let crashed = idempotent_runtime::OwnerToken::new();
    let planted = db
        .store
        .reserve(idempotent_runtime::ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &crashed,
            lease: Duration::ZERO,
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("plant a crashed owner's record");
    assert_eq!(planted, idempotent_runtime::Reservation::FRESH);

    let mut a = Worker::start_with_hook(&db, "recover", (&tenant, key), &effects, 0, 30_000);
    assert_eq!(a.reached("asked "), "asked 2");
    a.signal(libc::SIGKILL);
    let taken = snapshot(&db, &tenant, "pause.recover", key).await;
    assert_eq!((taken.state, taken.attempt), (RecordState::InProgress, 2));
    let mut b = Worker::start(&db, "recover", &tenant, key, &effects, 0);
    assert_eq!(b.answer(), format!("executed {}", b.pid()), "{:?}", b.seen);
    assert!(b.seen.contains(&"asked 3".to_owned()), "{:?}", b.seen);
    assert_eq!(body_runs(&effects), 1, "B's run only, after its hook");
    let record = snapshot(&db, &tenant, "pause.recover", key).await;
    assert_eq!((record.state, record.attempt), (RecordState::Complete, 3));
}

on_each_backend!(
    killed_in_the_recover_hook =>
        Sqlite: killed_in_the_recover_hook_sqlite,
        Pg: killed_in_the_recover_hook_postgres,
        MySql: killed_in_the_recover_hook_mariadb,
);
