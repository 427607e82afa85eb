//! Rule 20's last sentence on every store (memory, SQLite, PostgreSQL,
//! MariaDB): every takeover is logged (a warning with the scope and its
//! attempt, not the raw key) and counted (`idempotent_takeovers_total`,
//! labelled `scope` and `attempt`: `2`, `3`, `4`, then `5+`), through a chain
//! of takeovers of one record whose hook keeps answering an error (so the
//! record is kept, its lease ended, and each call takes it over at once).

use crate::common::logs::Logs;
use crate::common::readings::readings;
use crate::common::servers::{every_store, fresh_tenant};
use idempotent_runtime::{
    idempotent, Error, Identity, RecordState, Recovery, Store, StoreError, Takeover,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::collections::HashMap;
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

/// The counter's value per attempt label for the scope.
fn takeovers(recorder: &DebuggingRecorder) -> HashMap<String, u64> {
    readings(&recorder.snapshotter())
        .into_iter()
        .filter_map(|((name, labels), value)| {
            let label = |k: &str| labels.iter().find(|(l, _)| l == k).map(|(_, v)| v.clone());
            match value {
                DebugValue::Counter(n)
                    if name == "idempotent_takeovers_total"
                        && label("scope").as_deref() == Some("huntb.takeovers_counted") =>
                {
                    Some((label("attempt").expect("an attempt label"), n))
                }
                _ => None,
            }
        })
        .collect()
}

// A current-thread runtime: the recorder and the log subscriber set for
// this thread see every call.
#[tokio::test]
async fn a_chain_of_takeovers_is_logged_and_counted_by_attempt_on_every_store() {
    let recorder = DebuggingRecorder::new();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let (logs, _logs) = Logs::capture(tracing::Level::WARN);
    for (stores_done, (name, store)) in every_store("takeovers_counted")
        .await
        .into_iter()
        .enumerate()
    {
        // A snapshot takes the counts since the last one: start afresh.
        let _ = takeovers(&recorder);
        let mut expected: HashMap<String, u64> = HashMap::new();
        let tenant = fresh_tenant();
        let key = format!("SECRET-{}", uuid::Uuid::new_v4().simple());
        let identity = Identity::new(tenant.as_str(), "huntb.takeovers_counted", key.as_str())
            .expect("identity");
        // What a crashed owner leaves: in progress, its lease over.
        crate::common::records::crashed(&*store, &identity).await;
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
        let text = logs.text();
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
