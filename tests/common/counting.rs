//! `Counting` wraps a real store, forwards every call to it, counts `reserve`
//! calls and reports when a duplicate enters `wait_for_change`: a test's
//! handshake with waiting duplicates, and its count of round trips.

use idempotent_runtime::{
    Completion, Fenced, ForcedRelease, Identity, OwnerToken, RecordSnapshot, Reservation,
    ReserveRequest, ScopeStats, Store, StoreError,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::watch;

pub struct Counting<S> {
    pub inner: S,
    reserves: AtomicUsize,
    /// How many times a duplicate has entered `wait_for_change`.
    pub waits: watch::Sender<usize>,
    /// The time spent in `wait_for_change`, every wait's added up.
    waiting: std::sync::Mutex<Duration>,
}

impl<S> Counting<S> {
    pub fn new(inner: S) -> Self {
        Counting {
            inner,
            reserves: AtomicUsize::new(0),
            waits: watch::Sender::new(0),
            waiting: std::sync::Mutex::new(Duration::ZERO),
        }
    }
    pub fn reserves(&self) -> usize {
        self.reserves.load(Ordering::SeqCst)
    }
    /// The time duplicates have spent in `wait_for_change` so far (waits
    /// that have returned), added up.
    pub fn time_waiting(&self) -> Duration {
        *self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Until duplicates have entered `wait_for_change` `n` times in all.
    pub async fn waited(&self, n: usize) {
        let _ = self.waits.subscribe().wait_for(|w| *w >= n).await;
    }
}

#[async_trait::async_trait]
impl<S: Store> Store for Counting<S> {
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
        self.reserves.fetch_add(1, Ordering::SeqCst);
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
        self.waits.send_modify(|w| *w += 1);
        let started = tokio::time::Instant::now();
        self.inner.wait_for_change(i, max_wait, round).await;
        *self.waiting.lock().unwrap_or_else(|p| p.into_inner()) += started.elapsed();
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
