//! Rule 20's last sentence on every store (memory, SQLite, PostgreSQL,
//! MariaDB): every takeover is logged (a warning with the scope and its
//! attempt, not the raw key) and counted (`idempotent_takeovers_total`,
//! labelled `scope` and `attempt`: `2`, `3`, `4`, then `5+`), through a chain
//! of takeovers of one record whose hook keeps answering an error (so the
//! record is kept, its lease ended, and each call takes it over at once).

use crate::common::servers::{fresh_tenant, mysql_store_or_skip, pg_store_or_skip};
use idempotent_runtime::{
    idempotent, Error, Identity, MemoryStore, RecordState, Recovery, SqliteStore, Store,
    StoreError, Takeover,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

async fn cannot_tell(_: &Takeover) -> Result<Recovery<u32>, Error> {
    Err(Error::Store(StoreError::new(
        "gateway",
        "look the charge up",
        "timed out",
    )))
}

#[idempotent(scope = "huntb.takeovers_counted", key = key, tenant = tenant, store = store,
             in_progress = wait("30s"), recover = cannot_tell)]
async fn charge(store: &dyn Store, tenant: &str, key: &str) -> Result<u32, Error> {
    Ok(1)
}

#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn every_store() -> Vec<(&'static str, Box<dyn Store>)> {
    let mut stores: Vec<(&'static str, Box<dyn Store>)> = vec![
        ("memory", Box::new(MemoryStore::new())),
        (
            "sqlite",
            Box::new(
                SqliteStore::connect(&crate::common::scratch::sqlite_url("takeovers_counted"))
                    .await
                    .expect("SQLite file"),
            ),
        ),
    ];
    if let Some(pg) = pg_store_or_skip().await {
        stores.push(("postgres", Box::new(pg)));
    }
    if let Some(my) = mysql_store_or_skip().await {
        stores.push(("mariadb", Box::new(my)));
    }
    stores
}

/// The counter's value per attempt label for the scope.
fn takeovers(recorder: &DebuggingRecorder) -> HashMap<String, u64> {
    let mut counts = HashMap::new();
    for (ck, _, _, value) in recorder.snapshotter().snapshot().into_vec() {
        let (_, k) = ck.into_parts();
        if k.name() != "idempotent_takeovers_total" {
            continue;
        }
        let labels: HashMap<&str, &str> = k.labels().map(|l| (l.key(), l.value())).collect();
        if labels.get("scope") != Some(&"huntb.takeovers_counted") {
            continue;
        }
        if let DebugValue::Counter(n) = value {
            counts.insert(labels["attempt"].to_owned(), n);
        }
    }
    counts
}

// A current-thread runtime: the recorder and the log subscriber set for
// this thread see every call.
#[tokio::test]
async fn a_chain_of_takeovers_is_logged_and_counted_by_attempt_on_every_store() {
    let recorder = DebuggingRecorder::new();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    let _logs = tracing::subscriber::set_default(subscriber);
    for (stores_done, (name, store)) in every_store().await.into_iter().enumerate() {
        // A snapshot takes the counts since the last one: start afresh.
        let _ = takeovers(&recorder);
        let mut expected: HashMap<String, u64> = HashMap::new();
        let tenant = fresh_tenant();
        let key = format!("SECRET-{}", uuid::Uuid::new_v4().simple());
        let identity = Identity::new(tenant.as_str(), "huntb.takeovers_counted", key.as_str())
            .expect("identity");
        // What a crashed owner leaves: in progress, its lease over.
        crate::common::records::acquire(
            &*store,
            &identity,
            None,
            Duration::from_millis(1),
            Duration::from_secs(3600),
        )
        .await;
        for attempt in 2..=7u32 {
            let got = tokio::time::timeout(Duration::from_secs(60), charge(&*store, &tenant, &key))
                .await
                .expect("a call ends");
            assert!(
                matches!(got, Err(Error::Store(_))),
                "{name} {attempt}: {got:?}"
            );
            let s = store.fetch(&identity).await.unwrap().expect("kept");
            assert_eq!(
                (s.state, s.attempt),
                (RecordState::InProgress, attempt),
                "{name}"
            );
            let label = if attempt >= 5 {
                "5+".to_owned()
            } else {
                attempt.to_string()
            };
            *expected.entry(label).or_default() += 1;
        }
        assert_eq!(takeovers(&recorder), expected, "{name}");
        let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
        for attempt in 2..=7 {
            let lines = text
                .lines()
                .filter(|l| {
                    l.contains("WARN")
                        && l.contains("took over")
                        && l.contains("huntb.takeovers_counted")
                        && l.contains(&format!("attempt={attempt}"))
                })
                .count();
            // One line per takeover of that attempt: one per store so far.
            assert_eq!(lines, stores_done + 1, "{name} {attempt}: {text}");
        }
        assert!(!text.contains(&key), "{name}: the raw key was logged");
    }
}
