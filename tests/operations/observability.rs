//! What operators see: the `metrics` facade's counters and histograms after a
//! scripted run (read back with metrics-util's debugging recorder), and one
//! `idempotent_call` tracing span per call (read with a capturing layer).
//!
//! The scripted run covers every counter: executed, replayed, recovered,
//! mismatch, an in-progress refusal, a lost lease, takeovers as attempts 2 and
//! 3, a heartbeat failure and a purge. Crashes are in-process: the call's
//! future is leaked at its crash point (nothing after it runs), and the retry
//! waits out the lease on the store's clock. Every scope here is used by this
//! file only, and every assertion is about those scopes (the recorder is
//! process-wide).

use crate::common::readings::{counter, readings, samples, Readings};
use idempotent_runtime::{
    idempotent, purge, with_outcome, Error, ForcedRelease, Identity, MemoryStore, Outcome,
    Recovery, Store, Takeover,
};
use metrics_util::debugging::DebuggingRecorder;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// A call in transactional mode (on an in-memory SQLite database): its
/// reservation and its body are timed like a store-mode call's.
#[idempotent(scope = "obs.tx", key = key, tenant = tenant, tx = tx)]
async fn in_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    assert!(amount != 0, "the body panics on a zero amount");
    Ok(amount)
}

/// A transactional call whose body stops at `crash` until it is dropped.
#[idempotent(scope = "obs.tx_cancelled", key = key, tenant = tenant, tx = tx, skip(crash))]
async fn in_tx_until_dropped(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
    crash: &Crash,
) -> Result<u64, Error> {
    crash_here(Some(crash)).await;
    Ok(1)
}

/// Where a body stops for good (the in-process crash).
#[derive(Default)]
struct Crash {
    reached: Notify,
}

async fn crash_here(crash: Option<&Crash>) {
    if let Some(c) = crash {
        c.reached.notify_one();
        std::future::pending::<()>().await;
    }
}

/// Polls `call` until its body reaches the crash point, then leaks it.
async fn crash<F: Future>(call: F, at: &Crash) {
    let mut call = Box::pin(call);
    tokio::select! {
        _ = &mut call => panic!("the call finished instead of crashing"),
        _ = at.reached.notified() => {}
    }
    std::mem::forget(call);
}

/// The recover hook: the charge "happened" (it answers the amount).
async fn found(_: &Takeover) -> Result<Recovery<u64>, Error> {
    Ok(Recovery::Completed(4242))
}

#[idempotent(scope = "obs.charge", key = key, tenant = tenant, store = store, skip(crash),
             lease = "300ms", in_progress = wait("30s"), recover = found)]
async fn charge(
    store: &MemoryStore,
    tenant: &str,
    key: &str,
    amount: u64,
    crash: Option<&Crash>,
) -> Result<u64, Error> {
    crash_here(crash).await;
    Ok(amount)
}

#[idempotent(scope = "obs.blind", key = key, tenant = tenant, store = store, skip(crash),
             lease = "300ms", in_progress = wait("30s"))]
async fn blind(
    store: &MemoryStore,
    tenant: &str,
    key: &str,
    crash: Option<&Crash>,
) -> Result<u64, Error> {
    crash_here(crash).await;
    Ok(1)
}

#[idempotent(scope = "obs.gated", key = key, tenant = tenant, store = store, skip(gate, entered),
             lease = "300ms", in_progress = reject)]
async fn gated(
    store: &MemoryStore,
    tenant: &str,
    key: &str,
    gate: &Notify,
    entered: &Notify,
) -> Result<u64, Error> {
    entered.notify_one();
    gate.notified().await;
    Ok(2)
}

/// Told when the `run_after_gate` hook is asked, and what lets it answer.
static HOOK_ASKED: Notify = Notify::const_new();
static HOOK_GATE: Notify = Notify::const_new();

/// Answers `Run`, once let through.
async fn run_after_gate(_: &Takeover) -> Result<Recovery<u64>, Error> {
    HOOK_ASKED.notify_one();
    HOOK_GATE.notified().await;
    Ok(Recovery::Run)
}

#[idempotent(scope = "obs.run_lost", key = key, tenant = tenant, store = store,
             lease = "30s", recover = run_after_gate)]
async fn run_lost(store: &MemoryStore, tenant: &str, key: &str) -> Result<u64, Error> {
    Ok(5)
}

/// Answers `Completed(6)`, once let through.
async fn found_after_gate(_: &Takeover) -> Result<Recovery<u64>, Error> {
    HOOK_ASKED.notify_one();
    HOOK_GATE.notified().await;
    Ok(Recovery::Completed(6))
}

#[idempotent(scope = "obs.found_lost", key = key, tenant = tenant, store = store,
             lease = "30s", recover = found_after_gate)]
async fn found_lost(store: &MemoryStore, tenant: &str, key: &str) -> Result<u64, Error> {
    Ok(5)
}

/// Leaves the record of key `k` of `scope` as a crashed owner would (its
/// lease run out), calls `call`, whose hook is gated, releases the record
/// as an operator would while the hook is asked, then lets the hook answer.
async fn hook_answers_after_an_operator_release(
    store: &MemoryStore,
    tenant: &str,
    scope: &str,
    call: impl FnOnce(
        MemoryStore,
        String,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<u64, Error>> + Send>>,
) -> Result<u64, Error> {
    let id = Identity::new(tenant, scope, "k").unwrap();
    crate::common::records::acquire(
        store,
        &id,
        None,
        Duration::from_millis(1),
        Duration::from_secs(3600),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let asked = HOOK_ASKED.notified();
    let call = tokio::spawn(call(store.clone(), tenant.to_owned()));
    asked.await;
    store.force_release(&id, false).await.unwrap();
    HOOK_GATE.notify_one();
    call.await.unwrap()
}

#[idempotent(scope = "obs.undecodable", key = key, tenant = tenant, store = store)]
async fn undecodable(store: &MemoryStore, tenant: &str, key: &str) -> Result<u64, Error> {
    Ok(4)
}

#[idempotent(scope = "obs.short_ttl", key = key, tenant = tenant, store = store, ttl = "1ms")]
async fn short_ttl(store: &MemoryStore, tenant: &str, key: &str) -> Result<u64, Error> {
    Ok(3)
}

fn tenant() -> String {
    format!("obs-{}", uuid::Uuid::new_v4().simple())
}

/// Every counter and histogram after a scripted run.
#[test]
fn metrics_count_every_event_by_scope_and_outcome() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let t = tenant();
    rt.block_on(async {
        let store = MemoryStore::new();

        // obs.charge: executed, replayed, mismatch, then a crash and a recovery.
        assert_eq!(charge(&store, &t, "k1", 5, None).await.unwrap(), 5);
        let (_, replayed) = with_outcome(charge(&store, &t, "k1", 5, None)).await;
        assert_eq!(replayed, Some(Outcome::Replayed));
        assert!(matches!(
            charge(&store, &t, "k1", 6, None).await,
            Err(Error::FingerprintMismatch(_))
        ));
        let c = Crash::default();
        crash(charge(&store, &t, "k2", 7, Some(&c)), &c).await;
        let (got, recovered) = with_outcome(charge(&store, &t, "k2", 7, None)).await;
        assert_eq!((got.unwrap(), recovered), (4242, Some(Outcome::Recovered)));

        // obs.blind: two crashes in a row, then attempt 3 runs the body.
        let (c1, c2) = (Crash::default(), Crash::default());
        crash(blind(&store, &t, "k3", Some(&c1)), &c1).await;
        crash(blind(&store, &t, "k3", Some(&c2)), &c2).await;
        let (got, executed) = with_outcome(blind(&store, &t, "k3", None)).await;
        assert_eq!((got.unwrap(), executed), (1, Some(Outcome::Executed)));

        // obs.gated: a refused duplicate, then the lease is taken away from a
        // running body (an operator's release): its heartbeat fails and its
        // result is not recorded.
        let (gate, entered) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let running = {
            let (store, t, gate, entered) =
                (store.clone(), t.clone(), gate.clone(), entered.clone());
            tokio::spawn(async move { gated(&store, &t, "g1", &gate, &entered).await })
        };
        entered.notified().await;
        assert!(matches!(
            gated(&store, &t, "g1", &Notify::new(), &Notify::new()).await,
            Err(Error::InProgress { .. })
        ));
        let before = idempotent_runtime::metrics::snapshot().heartbeat_failures;
        let id = Identity::new(t.as_str(), "obs.gated", "g1").unwrap();
        assert_eq!(
            store.force_release(&id, false).await.unwrap(),
            ForcedRelease::Released { attempt: 1 }
        );
        // The next heartbeat (every lease/3) finds the record gone: poll for it.
        for _ in 0..1000 {
            if idempotent_runtime::metrics::snapshot().heartbeat_failures > before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(idempotent_runtime::metrics::snapshot().heartbeat_failures > before);
        gate.notify_one();
        assert!(matches!(running.await.unwrap(), Err(Error::LeaseLost(_))));

        // obs.tx: executed, then replayed, each in a transaction of its own.
        let sqlite = idempotent_runtime::SqliteStore::connect("sqlite::memory:")
            .await
            .expect("sqlite");
        for expected in [Outcome::Executed, Outcome::Replayed] {
            let mut tx = sqlite.pool().begin().await.expect("begin");
            let (got, outcome) = with_outcome(in_tx(&mut tx, &t, "x1", 3)).await;
            tx.commit().await.expect("commit");
            assert_eq!((got.unwrap(), outcome), (3, Some(expected)));
        }
        // A body that panics in transactional mode is timed as `panic`.
        let mut tx = sqlite.pool().begin().await.expect("begin");
        let t2 = t.clone();
        let panicked = tokio::spawn(async move { in_tx(&mut tx, &t2, "x2", 0).await }).await;
        assert!(panicked.expect_err("the body panics").is_panic());
        // A call dropped while something else panics is a cancelled call,
        // not a panicking body: no `panic` sample.
        let mut tx = sqlite.pool().begin().await.expect("begin");
        let t3 = t.clone();
        let sibling_panics = tokio::spawn(async move {
            let reached = Crash::default();
            tokio::join!(in_tx_until_dropped(&mut tx, &t3, "x3", &reached), async {
                reached.reached.notified().await;
                panic!("a sibling of the call panics");
            })
        })
        .await;
        assert!(sibling_panics.expect_err("the sibling panics").is_panic());

        // obs.run_lost: the hook answers Run after an operator released the
        // record: the body does not run, and that is no `lease_lost` (a body
        // that ran, its answer not recorded).
        let lost = hook_answers_after_an_operator_release(&store, &t, "obs.run_lost", |s, t| {
            Box::pin(async move { run_lost(&s, &t, "k").await })
        })
        .await;
        assert!(matches!(lost, Err(Error::LeaseLost(_))));
        // obs.found_lost: the same for a hook's Completed answer, whose
        // recording finds the record gone.
        let lost = hook_answers_after_an_operator_release(&store, &t, "obs.found_lost", |s, t| {
            Box::pin(async move { found_lost(&s, &t, "k").await })
        })
        .await;
        assert!(matches!(lost, Err(Error::LeaseLost(_))));

        // obs.undecodable: a recorded answer that no longer decodes is not
        // counted as a replay (it is no recorded result the caller got).
        let uid = Identity::new(t.as_str(), "obs.undecodable", "u1").unwrap();
        crate::common::records::recorded(&store, &uid, None, br#""not a number""#).await;
        assert!(matches!(
            undecodable(&store, &t, "u1").await,
            Err(Error::ReplayDecoding { .. })
        ));

        // obs.short_ttl: one record that expires at once, purged.
        let purge_store = MemoryStore::new();
        short_ttl(&purge_store, &t, "p1").await.unwrap();
        let pid = Identity::new(t.as_str(), "obs.short_ttl", "p1").unwrap();
        for _ in 0..1000 {
            if purge_store.fetch(&pid).await.unwrap().unwrap().is_expired() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(purge::purge_all(&purge_store, 10).await.unwrap(), 1);
    });

    let readings: Readings = readings(&snapshotter);
    let calls = |scope: &str, outcome: &str| {
        counter(
            &readings,
            "idempotent_calls_total",
            &[("scope", scope), ("outcome", outcome)],
        )
    };
    assert_eq!(calls("obs.charge", "executed"), 1, "{readings:#?}");
    assert_eq!(calls("obs.charge", "replayed"), 1);
    assert_eq!(calls("obs.charge", "mismatch"), 1);
    assert_eq!(calls("obs.charge", "recovered"), 1);
    assert_eq!(calls("obs.blind", "executed"), 1);
    assert_eq!(calls("obs.gated", "in_progress"), 1);
    assert_eq!(calls("obs.gated", "lease_lost"), 1);
    assert_eq!(calls("obs.gated", "executed"), 0);
    assert_eq!(calls("obs.short_ttl", "executed"), 1);
    assert_eq!(calls("obs.run_lost", "lease_lost"), 0);
    assert_eq!(calls("obs.run_lost", "failed"), 1);
    assert_eq!(calls("obs.found_lost", "lease_lost"), 0);
    assert_eq!(calls("obs.found_lost", "failed"), 1);
    assert_eq!(calls("obs.undecodable", "replayed"), 0);
    assert_eq!(calls("obs.undecodable", "failed"), 1);

    let takeovers = |scope: &str, attempt: &str| {
        counter(
            &readings,
            "idempotent_takeovers_total",
            &[("scope", scope), ("attempt", attempt)],
        )
    };
    assert_eq!(takeovers("obs.charge", "2"), 1);
    assert_eq!(takeovers("obs.blind", "2"), 1);
    assert_eq!(takeovers("obs.blind", "3"), 1);
    assert_eq!(takeovers("obs.gated", "2"), 0);
    assert!(
        counter(
            &readings,
            "idempotent_heartbeat_failures_total",
            &[("scope", "obs.gated")]
        ) >= 1
    );
    // Labelled by store, not scope: other tests of this binary that purge a
    // memory store count here too when they share its process (`cargo test`).
    assert!(counter(&readings, "idempotent_purged_total", &[("store", "memory")]) >= 1);

    let reserve = |scope: &str, outcome: &str| {
        samples(
            &readings,
            "idempotent_reserve_duration_seconds",
            &[("scope", scope), ("outcome", outcome)],
        )
    };
    // k1 fresh and k2's crashed first attempt; the replay; the mismatch; the recovery's takeover.
    assert_eq!(reserve("obs.charge", "acquired"), 2);
    assert_eq!(reserve("obs.charge", "replayed"), 1);
    assert_eq!(reserve("obs.charge", "mismatch"), 1);
    assert_eq!(reserve("obs.charge", "took_over"), 1);
    assert_eq!(reserve("obs.gated", "in_progress"), 1);
    let body = |scope: &str, outcome: &str| {
        samples(
            &readings,
            "idempotent_body_duration_seconds",
            &[("scope", scope), ("outcome", outcome)],
        )
    };
    // Transactional mode too.
    assert_eq!(reserve("obs.tx", "acquired"), 2); // x1, and x2 that panics
    assert_eq!(reserve("obs.tx", "replayed"), 1);
    assert_eq!(body("obs.tx", "ok"), 1);
    assert_eq!(body("obs.tx", "panic"), 1);
    assert_eq!(body("obs.tx_cancelled", "panic"), 0);
    assert_eq!(
        reserve("obs.tx_cancelled", "acquired"),
        1,
        "the call did run"
    );
    assert_eq!(calls("obs.tx", "executed"), 1);
    assert_eq!(calls("obs.tx", "replayed"), 1);
    // Crashed bodies never finish; a recovered call has no body.
    assert_eq!(body("obs.charge", "ok"), 1);
    assert_eq!(body("obs.blind", "ok"), 1);
    assert_eq!(body("obs.gated", "ok"), 1);

    // Never a key or a tenant in a label.
    for (name, labels) in readings.keys() {
        for (label, value) in labels {
            assert!(
                ["scope", "outcome", "attempt", "store"].contains(&label.as_str()),
                "{name}: label {label}"
            );
            assert!(
                !value.contains(&t) && !["k1", "k2", "k3", "g1", "p1"].contains(&value.as_str()),
                "{name}: {label}={value}"
            );
        }
    }
}

// ---------------------------------------------------------------- spans

/// The fields of each `idempotent_call` span in the order they were opened,
/// and every event with the index of the span it was in. (Span ids are
/// reused once a span closes, so spans are told apart by their index.)
/// One event: its level, the index of its span, its fields.
type CapturedEvent = (tracing::Level, Option<usize>, BTreeMap<String, String>);

#[derive(Clone, Default)]
struct Captured {
    spans: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
    open: Arc<Mutex<HashMap<u64, usize>>>,
    events: Arc<Mutex<Vec<CapturedEvent>>>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
}

impl<S> tracing_subscriber::Layer<S> for Captured
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() == "idempotent_call" {
            let mut fields = BTreeMap::new();
            attrs.record(&mut Fields(&mut fields));
            let mut spans = self.spans.lock().unwrap();
            spans.push(fields);
            self.open
                .lock()
                .unwrap()
                .insert(id.into_u64(), spans.len() - 1);
        }
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(&i) = self.open.lock().unwrap().get(&id.into_u64()) {
            values.record(&mut Fields(&mut self.spans.lock().unwrap()[i]));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let span = ctx
            .event_span(event)
            .and_then(|s| self.open.lock().unwrap().get(&s.id().into_u64()).copied());
        self.events
            .lock()
            .unwrap()
            .push((*event.metadata().level(), span, fields));
    }
}

static RECOVER_ASKED: AtomicBool = AtomicBool::new(false);

async fn found_once(_: &Takeover) -> Result<Recovery<u64>, Error> {
    RECOVER_ASKED.store(true, Ordering::SeqCst);
    Ok(Recovery::Completed(99))
}

#[idempotent(scope = "obs.spans", key = key, tenant = tenant, store = store, skip(crash),
             lease = "300ms", in_progress = wait("30s"), recover = found_once)]
async fn traced(
    store: &MemoryStore,
    tenant: &str,
    key: &str,
    crash: Option<&Crash>,
) -> Result<u64, Error> {
    tracing::info!("inside the body");
    crash_here(crash).await;
    Ok(1)
}

/// One span per call, with scope, key digest (never the key), store,
/// attempt and outcome; the body's events and the takeover's warning (with
/// its attempt number) are inside it.
#[test]
fn every_call_has_a_span_with_scope_key_digest_attempt_and_outcome() {
    use tracing_subscriber::layer::SubscriberExt;
    let captured = Captured::default();
    let subscriber = tracing_subscriber::registry().with(captured.clone());
    let t = tenant();
    tracing::subscriber::with_default(subscriber, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let store = MemoryStore::new();
            assert_eq!(traced(&store, &t, "secret-key-1", None).await.unwrap(), 1);
            assert_eq!(traced(&store, &t, "secret-key-1", None).await.unwrap(), 1);
            let c = Crash::default();
            crash(traced(&store, &t, "secret-key-2", Some(&c)), &c).await;
            assert_eq!(traced(&store, &t, "secret-key-2", None).await.unwrap(), 99);
        });
    });
    assert!(RECOVER_ASKED.load(Ordering::SeqCst));

    let digest = |key: &str| {
        Identity::new(t.as_str(), "obs.spans", key)
            .unwrap()
            .key_digest()
    };
    let spans = captured.spans.lock().unwrap().clone();
    let calls: Vec<(usize, BTreeMap<String, String>)> = spans
        .into_iter()
        .enumerate()
        .filter(|(_, f)| f.get("scope").map(String::as_str) == Some("obs.spans"))
        .collect();
    assert_eq!(calls.len(), 4, "one span per call: {calls:#?}");
    let field = |i: usize, name: &str| calls[i].1.get(name).cloned();
    let (d1, d2) = (digest("secret-key-1"), digest("secret-key-2"));
    // Executed, replayed, the crashed call (never finished: no outcome), recovered.
    let expected = [
        (d1.as_str(), Some("1"), Some("executed")),
        (d1.as_str(), None, Some("replayed")),
        (d2.as_str(), Some("1"), None),
        (d2.as_str(), Some("2"), Some("recovered")),
    ];
    for (i, (key, attempt, outcome)) in expected.iter().enumerate() {
        assert_eq!(
            field(i, "key").as_deref(),
            Some(*key),
            "span {i}: {:?}",
            calls[i]
        );
        assert_eq!(
            field(i, "attempt").as_deref(),
            *attempt,
            "span {i}: {:?}",
            calls[i]
        );
        assert_eq!(
            field(i, "outcome").as_deref(),
            *outcome,
            "span {i}: {:?}",
            calls[i]
        );
        assert_eq!(field(i, "store").as_deref(), Some("memory"));
    }
    for (_, fields) in &calls {
        assert!(
            fields.values().all(|v| !v.contains("secret-key")),
            "a raw key in a span: {fields:?}"
        );
    }

    let events = captured.events.lock().unwrap().clone();
    // The body ran in the first call and in the crashed one, inside their spans.
    let body_spans: Vec<Option<usize>> = events
        .iter()
        .filter(|(_, _, f)| f.get("message").map(String::as_str) == Some("inside the body"))
        .map(|(_, span, _)| *span)
        .collect();
    assert_eq!(body_spans, [Some(calls[0].0), Some(calls[2].0)]);
    let (level, span, fields) = events
        .iter()
        .find(|(_, _, f)| {
            f.get("message")
                .is_some_and(|m| m.starts_with("took over a record whose lease had expired"))
        })
        .expect("the takeover is logged");
    assert_eq!(*level, tracing::Level::WARN);
    assert_eq!(fields.get("attempt").map(String::as_str), Some("2"));
    assert_eq!(
        fields.get("recover").map(String::as_str),
        Some("found_once")
    );
    assert_eq!(*span, Some(calls[3].0), "inside the retry's span");
}
