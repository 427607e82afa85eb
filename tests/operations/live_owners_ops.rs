//! Operator actions against an owner that is alive (DESIGN rules 10, 16 and
//! 20; the README's "Auditing and retention" and `idempotent release`), on
//! memory, a SQLite file, PostgreSQL and MariaDB. Every step is a handshake:
//! a body (or a renewal) says when it is reached and waits to be let go.
//!
//! - `release --end-lease --even-if-running` on a running body in a scope
//!   with a `recover` hook: the next call takes the record over as attempt 2
//!   and asks the hook (never a blind re-run); the first owner, finishing
//!   afterwards, is fenced and the hook's answer stays the key's.
//! - `release --even-if-running` (the record deleted), then a new owner: the
//!   first owner's failure releases nothing of the new owner's record, and
//!   its token ends, renews, completes and releases nothing there either.
//! - A renewal held up while its owner's lease runs out: a purge and an
//!   audit leave the record (its retention runs from the end of the lease),
//!   the renewal then lands, and the owner's answer is recorded once.

use crate::common;

use idempotent_runtime::purge::purge_all;
use idempotent_runtime::{
    idempotent, Completion, Error, Fenced, ForcedRelease, Identity, MemoryStore, OwnerToken,
    RecordSnapshot, RecordState, Recovery, Reservation, ReserveRequest, ScopeStats, SqliteStore,
    Store, StoreError, StoredOutcome, Takeover,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// How long a step may wait for its handshake: reached only when it never
/// comes.
const BOUND: Duration = Duration::from_secs(60);

/// The bodies' shared state: how often they ran, and a hold for the first.
#[derive(Default)]
struct Gate {
    runs: AtomicU32,
    reached: Notify,
    go: Notify,
}

/// The attempts the hook was asked about, per tenant.
static ASKED: LazyLock<Mutex<HashMap<String, Vec<u32>>>> = LazyLock::new(Default::default);

fn asked(tenant: &str) -> Vec<u32> {
    ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(tenant)
        .cloned()
        .unwrap_or_default()
}

/// The hook finds the side effect done and answers `500 + attempt`.
async fn found_it(takeover: &Takeover) -> Result<Recovery<u32>, Error> {
    ASKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(takeover.tenant().to_owned())
        .or_default()
        .push(takeover.attempt());
    Ok(Recovery::Completed(500 + takeover.attempt()))
}

#[idempotent(scope = "ops_alive.hooked", key = key, tenant = tenant, store = store,
             skip(gate, hold), lease = "30s", ttl = "1h", in_progress = reject,
             recover = found_it)]
async fn hooked(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
    hold: bool,
) -> Result<u32, Error> {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if hold {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    Ok(run)
}

/// The plain body's error: its own failure, or the library's.
#[derive(Debug)]
enum PlainError {
    Failed,
    Idempotent(#[allow(dead_code, reason = "shown by Debug")] Error),
}

impl From<Error> for PlainError {
    fn from(e: Error) -> Self {
        PlainError::Idempotent(e)
    }
}

/// Fails (releasing its record, the default) when `fail`.
#[idempotent(scope = "ops_alive.plain", key = key, tenant = tenant, store = store,
             skip(gate, hold, fail), lease = "30s", ttl = "1h", in_progress = reject)]
async fn plain(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
    hold: bool,
    fail: bool,
) -> Result<u32, PlainError> {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if hold {
        gate.reached.notify_one();
        gate.go.notified().await;
    }
    if fail {
        return Err(PlainError::Failed);
    }
    Ok(run)
}

/// A short lease (renewed every 300 ms) and a long retention.
#[idempotent(scope = "ops_alive.renewed", key = key, tenant = tenant, store = store,
             skip(gate), lease = "900ms", ttl = "1h", in_progress = reject)]
async fn renewed(store: &dyn Store, tenant: &str, key: &str, gate: &Gate) -> Result<u32, Error> {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    gate.reached.notify_one();
    gate.go.notified().await;
    Ok(run)
}

fn fresh() -> (String, String) {
    (
        common::servers::fresh_tenant(),
        format!("k-{}", uuid::Uuid::new_v4().simple()),
    )
}

/// Drives `call` until its body has started (`gate.reached`).
async fn until_the_body_runs<F: std::future::Future + Unpin>(call: &mut F, gate: &Gate)
where
    F::Output: std::fmt::Debug,
{
    tokio::time::timeout(BOUND, async {
        tokio::select! {
            () = gate.reached.notified() => {}
            answer = call => panic!("the body holds until let go, yet the call ended: {answer:?}"),
        }
    })
    .await
    .expect("the call reached its body");
}

async fn snapshot(store: &dyn Store, identity: &Identity) -> RecordSnapshot {
    store
        .fetch(identity)
        .await
        .expect("fetch")
        .expect("the record is there")
}

/// The owner's token as the store has it (what `release --end-lease` reads).
async fn owner_of(store: &dyn Store, identity: &Identity) -> OwnerToken {
    let s = snapshot(store, identity).await;
    assert_eq!(s.state, RecordState::InProgress);
    OwnerToken::from_stored(s.owner_token.expect("an owner token"))
}

/// `release --end-lease --even-if-running` on a running body: the next call
/// takes the record over as attempt 2 and asks the hook, whose answer is
/// recorded (the body does not run again); the first owner's late answer is
/// fenced.
async fn end_lease_on_a_running_body_then_the_takeover_asks_the_hook(store: &dyn Store) {
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, "ops_alive.hooked", &key).expect("identity");
    let gate = Gate::default();
    let mut first = Box::pin(hooked(store, &tenant, &key, &gate, true));
    until_the_body_runs(&mut first, &gate).await;

    let token = owner_of(store, &identity).await;
    assert_eq!(
        store
            .heartbeat(&identity, &token, Duration::ZERO)
            .await
            .expect("end the lease"),
        Fenced::Written
    );
    let second = hooked(store, &tenant, &key, &gate, false).await;
    assert_eq!(
        second.expect("the takeover is answered by the hook"),
        502,
        "{}",
        store.name()
    );
    assert_eq!(
        asked(&tenant),
        vec![2],
        "the hook is asked once, as attempt 2"
    );
    let s = snapshot(store, &identity).await;
    assert_eq!(
        (s.state, s.attempt, s.recovered),
        (RecordState::Complete, 2, true)
    );

    gate.go.notify_one();
    let first = tokio::time::timeout(BOUND, first).await.expect("ended");
    assert!(
        matches!(first, Err(Error::LeaseLost(_))),
        "the first owner's completion is fenced: {first:?}"
    );
    assert_eq!(
        hooked(store, &tenant, &key, &gate, false)
            .await
            .expect("replay"),
        502,
        "the hook's answer stays the key's ({})",
        store.name()
    );
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "{}", store.name());
}

/// `release --even-if-running` deletes the record of a running body; a new
/// call reserves the key and runs. The first owner then fails: its release
/// leaves the new owner's record, and its token (as an operator read it
/// before the release) ends, renews, completes and releases nothing there.
/// The new owner's answer is the key's.
async fn a_released_owner_touches_nothing_of_the_next_owner(store: &dyn Store) {
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, "ops_alive.plain", &key).expect("identity");
    let (first_gate, second_gate) = (Gate::default(), Gate::default());
    let mut first = Box::pin(plain(store, &tenant, &key, &first_gate, true, true));
    until_the_body_runs(&mut first, &first_gate).await;
    let stale = owner_of(store, &identity).await;

    assert!(matches!(
        store
            .force_release(&identity, false)
            .await
            .expect("release"),
        ForcedRelease::Released { attempt: 1 }
    ));
    let mut second = Box::pin(plain(store, &tenant, &key, &second_gate, true, false));
    until_the_body_runs(&mut second, &second_gate).await;
    let current = owner_of(store, &identity).await;
    assert_ne!(current, stale);

    // The first owner fails: its release is fenced.
    first_gate.go.notify_one();
    let first = tokio::time::timeout(BOUND, first).await.expect("ended");
    assert!(matches!(first, Err(PlainError::Failed)), "{first:?}");
    assert_eq!(
        owner_of(store, &identity).await,
        current,
        "the failed first owner released the new owner's record ({})",
        store.name()
    );
    // Its token, written with directly, changes nothing either.
    let hour = Duration::from_secs(3600);
    for fenced in [
        store.heartbeat(&identity, &stale, Duration::ZERO).await,
        store.heartbeat(&identity, &stale, hour).await,
        store.release(&identity, &stale).await,
        store
            .complete(Completion::by_body(
                &identity,
                &stale,
                &StoredOutcome {
                    is_error: false,
                    payload: b"999".to_vec(),
                },
                hour,
            ))
            .await,
    ] {
        assert_eq!(fenced.expect("answered"), Fenced::NotOwner);
    }
    let s = snapshot(store, &identity).await;
    assert_eq!(s.state, RecordState::InProgress);
    assert!(
        s.lease_expires_at_ms.expect("a lease") > s.now_ms + 20_000,
        "the new owner's lease is untouched ({})",
        store.name()
    );

    second_gate.go.notify_one();
    let second = tokio::time::timeout(BOUND, second).await.expect("ended");
    assert_eq!(second.expect("the new owner records its answer"), 1);
    assert_eq!(
        plain(store, &tenant, &key, &second_gate, false, false)
            .await
            .expect("replay"),
        1,
        "{}",
        store.name()
    );
}

/// A store whose next renewal with a lease (not an ended lease) waits to be
/// let go before it is sent.
struct HeldRenewal<S> {
    inner: S,
    hold_next: AtomicBool,
    held: Notify,
    let_go: Notify,
}

#[async_trait::async_trait]
impl<S: Store> Store for HeldRenewal<S> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn max_result_bytes(&self) -> usize {
        self.inner.max_result_bytes()
    }
    fn database_id(&self) -> Option<&str> {
        self.inner.database_id()
    }
    fn records_in_process_memory(&self) -> bool {
        self.inner.records_in_process_memory()
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.inner.reserve(r).await
    }
    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        self.inner.complete(completion).await
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        self.inner.release(i, t).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        if !lease.is_zero() && self.hold_next.swap(false, Ordering::SeqCst) {
            self.held.notify_one();
            self.let_go.notified().await;
        }
        self.inner.heartbeat(i, t, lease).await
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.release_detached(i, t)
    }
    fn complete_detached(&self, completion: Completion<'_>) {
        self.inner.complete_detached(completion)
    }
    fn end_lease_detached(&self, i: Identity, t: OwnerToken) {
        self.inner.end_lease_detached(i, t)
    }
    async fn finish_background_work(&self, within: Duration) -> usize {
        self.inner.finish_background_work(within).await
    }
    async fn force_release(
        &self,
        i: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        self.inner.force_release(i, require_expired_lease).await
    }
    async fn wait_for_change(&self, i: &Identity, max_wait: Duration, round: u32) {
        self.inner.wait_for_change(i, max_wait, round).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }
    async fn fetch(&self, i: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        self.inner.fetch(i).await
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.inner.scope_stats().await
    }
}

fn stats_of(stats: &[ScopeStats], scope: &str) -> ScopeStats {
    stats
        .iter()
        .find(|s| s.scope == scope)
        .cloned()
        .unwrap_or_default()
}

/// The owner's renewal is held up until its lease has run out by the
/// store's clock (the owner is alive, its renewal late). Meanwhile a purge
/// leaves the record (its retention runs from the end of the lease), an
/// audit counts it stuck and changes nothing; then the renewal lands (no
/// other call took the record over), and the owner's answer is recorded and
/// replayed, the body run once.
async fn a_late_renewal_outlives_a_purge_and_an_audit(store: Arc<dyn Store>) {
    let store = HeldRenewal {
        inner: store,
        hold_next: AtomicBool::new(true),
        held: Notify::new(),
        let_go: Notify::new(),
    };
    let (tenant, key) = fresh();
    let identity = Identity::new(&tenant, "ops_alive.renewed", &key).expect("identity");
    let gate = Gate::default();
    let mut first = Box::pin(renewed(&store, &tenant, &key, &gate));
    until_the_body_runs(&mut first, &gate).await;
    tokio::time::timeout(BOUND, async {
        tokio::select! {
            () = store.held.notified() => {}
            answer = &mut first => panic!("the body holds, yet the call ended: {answer:?}"),
        }
    })
    .await
    .expect("the owner renews");

    // Until the lease has run out by the store's clock (bounded).
    let mut ended = false;
    for _ in 0..2_000 {
        let s = snapshot(&store, &identity).await;
        if s.lease_expires_at_ms.expect("in progress") <= s.now_ms {
            ended = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(ended, "the lease ran out");

    let before = snapshot(&store, &identity).await;
    purge_all(&store, 1000).await.expect("purge");
    let stats = stats_of(
        &store.scope_stats().await.expect("audit"),
        "ops_alive.renewed",
    );
    assert!(stats.stuck >= 1, "{stats:?}");
    let after = snapshot(&store, &identity).await;
    assert_eq!(
        (
            after.state,
            &after.owner_token,
            after.lease_expires_at_ms,
            after.expires_at_ms
        ),
        (
            before.state,
            &before.owner_token,
            before.lease_expires_at_ms,
            before.expires_at_ms
        ),
        "a purge and an audit leave the record of an owner whose lease just ran out ({})",
        store.name()
    );

    store.let_go.notify_one();
    gate.go.notify_one();
    let first = tokio::time::timeout(BOUND, first).await.expect("ended");
    assert_eq!(
        first.expect("the owner, never taken over, records its answer"),
        1,
        "{}",
        store.name()
    );
    let s = snapshot(&store, &identity).await;
    assert_eq!((s.state, s.attempt), (RecordState::Complete, 1));
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1);
}

async fn all(store: Arc<dyn Store>) {
    end_lease_on_a_running_body_then_the_takeover_asks_the_hook(&*store).await;
    a_released_owner_touches_nothing_of_the_next_owner(&*store).await;
    a_late_renewal_outlives_a_purge_and_an_audit(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_meet_live_owners_on_memory() {
    all(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_meet_live_owners_on_sqlite() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("ops-alive"))
        .await
        .expect("sqlite");
    all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_meet_live_owners_on_postgres() {
    if let Some(store) = common::servers::pg_store_or_skip().await {
        all(Arc::new(store)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_meet_live_owners_on_mariadb() {
    if let Some(store) = common::servers::mysql_store_or_skip().await {
        all(Arc::new(store)).await;
    }
}

// ------------------------------------------ an end of lease that was refused

/// `release --end-lease --even-if-running` meets a record another
/// transaction holds (here a `SELECT ... FOR UPDATE` left open; a
/// `LOCK TABLE` or a transactional-mode call holds it as well): the command
/// gives up and says the lease was not ended. Once that transaction ends,
/// the lease is as the command said: live, its owner's, not ended by a
/// statement the command gave up on.
async fn a_refused_end_of_lease_ends_nothing_later<Hold, HoldFut, Free, FreeFut>(
    url: &str,
    store: &dyn Store,
    hold: Hold,
    free: Free,
) where
    Hold: Fn(Identity) -> HoldFut,
    HoldFut: std::future::Future<Output = ()>,
    Free: Fn() -> FreeFut,
    FreeFut: std::future::Future<Output = ()>,
{
    let (tenant, key) = fresh();
    let scope = "ops_alive.held";
    let identity = Identity::new(&tenant, scope, &key).expect("identity");
    let hour = Duration::from_secs(3600);
    let token = common::records::acquire(store, &identity, None, hour, hour).await;
    hold(identity.clone()).await;

    let refused = idempotent_runtime::cli::run_from([
        "idempotent",
        "release",
        "--database-url",
        url,
        "--scope",
        scope,
        "--tenant",
        &tenant,
        "--key",
        &key,
        "--reason",
        "a refused end of lease",
        "--end-lease",
        "--even-if-running",
    ])
    .await;
    let said = format!("{refused:?}");
    assert!(
        refused.is_err() && said.contains("transaction"),
        "the command gives up on the held record, saying why: {said}"
    );
    free().await;
    // Held once more: a statement still waiting for the row (the command's,
    // had it been left on the server) gets it first and has run when this
    // gets it.
    hold(identity.clone()).await;
    free().await;
    let s = snapshot(store, &identity).await;
    assert_eq!(s.owner_token.as_deref(), Some(token.as_str()));
    assert!(
        s.lease_expires_at_ms.expect("in progress") > s.now_ms,
        "the command said the lease was not ended, yet its statement ended it once the \
         lock was gone ({}): {s:?}",
        store.name()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_end_of_lease_ends_nothing_later_on_postgres() {
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    use sqlx::Connection;
    let url = common::servers::pg_url();
    let locker = Arc::new(tokio::sync::Mutex::new(
        sqlx::PgConnection::connect(&url).await.expect("connect"),
    ));
    let (l1, l2) = (locker.clone(), locker.clone());
    a_refused_end_of_lease_ends_nothing_later(
        &url,
        &store,
        |identity| {
            let l1 = l1.clone();
            async move {
            let mut c = l1.lock().await;
            sqlx::query("BEGIN").execute(&mut *c).await.expect("begin");
            sqlx::query(
                "SELECT 1 FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE",
            )
            .bind(identity.tenant().to_owned())
            .bind(identity.scope().to_owned())
            .bind(identity.key().to_owned())
            .fetch_one(&mut *c)
            .await
            .expect("hold the row");
            }
        },
        || {
            let l2 = l2.clone();
            async move {
                let mut c = l2.lock().await;
                sqlx::query("COMMIT").execute(&mut *c).await.expect("commit");
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_end_of_lease_ends_nothing_later_on_mariadb() {
    let Some(store) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    use sqlx::Connection;
    let url = common::servers::mysql_url();
    let locker = Arc::new(tokio::sync::Mutex::new(
        sqlx::MySqlConnection::connect(&url).await.expect("connect"),
    ));
    let (l1, l2) = (locker.clone(), locker.clone());
    a_refused_end_of_lease_ends_nothing_later(
        &url,
        &store,
        |identity| {
            let l1 = l1.clone();
            async move {
            let mut c = l1.lock().await;
            sqlx::query("BEGIN").execute(&mut *c).await.expect("begin");
            sqlx::query(
                "SELECT 1 FROM idempotency_records WHERE tenant = ? AND scope = ? AND `key` = ? FOR UPDATE",
            )
            .bind(identity.tenant().as_bytes().to_vec())
            .bind(identity.scope().as_bytes().to_vec())
            .bind(identity.key().as_bytes().to_vec())
            .fetch_one(&mut *c)
            .await
            .expect("hold the row");
            }
        },
        || {
            let l2 = l2.clone();
            async move {
                let mut c = l2.lock().await;
                sqlx::query("COMMIT").execute(&mut *c).await.expect("commit");
            }
        },
    )
    .await;
}
