//! A test store that forwards every call to a [`MemoryStore`], except the
//! ones a test intercepts: a test writes only what it changes ([`Intercept`]),
//! not a whole `Store` impl.

use idempotent_runtime::{
    Completion, Fenced, ForcedRelease, Identity, MemoryStore, OwnerToken, RecordSnapshot,
    Reservation, ReserveRequest, ScopeStats, Store, StoreError,
};
use std::time::Duration;

/// What a test store does differently from the memory store it wraps; each
/// method forwards by default.
#[async_trait::async_trait]
pub trait Intercept: Send + Sync + 'static {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        inner.reserve(r).await
    }

    async fn heartbeat(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        inner.heartbeat(i, t, lease).await
    }

    async fn complete(
        &self,
        inner: &MemoryStore,
        completion: Completion<'_>,
    ) -> Result<Fenced, StoreError> {
        inner.complete(completion).await
    }

    async fn release(
        &self,
        inner: &MemoryStore,
        i: &Identity,
        t: &OwnerToken,
    ) -> Result<Fenced, StoreError> {
        inner.release(i, t).await
    }

    async fn purge_expired(&self, inner: &MemoryStore, batch: u32) -> Result<u64, StoreError> {
        inner.purge_expired(batch).await
    }

    async fn scope_stats(&self, inner: &MemoryStore) -> Result<Vec<ScopeStats>, StoreError> {
        inner.scope_stats().await
    }

    async fn fetch(
        &self,
        inner: &MemoryStore,
        i: &Identity,
    ) -> Result<Option<RecordSnapshot>, StoreError> {
        inner.fetch(i).await
    }

    fn max_result_bytes(&self, inner: &MemoryStore) -> usize {
        inner.max_result_bytes()
    }
}

/// A [`MemoryStore`] with a test's [`Intercept`] in front of it.
pub struct Hooked<I> {
    pub inner: MemoryStore,
    pub intercept: I,
}

impl<I: Intercept> Hooked<I> {
    pub fn new(intercept: I) -> Self {
        Hooked {
            inner: MemoryStore::new(),
            intercept,
        }
    }
}

impl<I> std::ops::Deref for Hooked<I> {
    type Target = I;
    fn deref(&self) -> &I {
        &self.intercept
    }
}

#[async_trait::async_trait]
impl<I: Intercept> Store for Hooked<I> {
    fn name(&self) -> &'static str {
        "hooked"
    }
    fn max_result_bytes(&self) -> usize {
        self.intercept.max_result_bytes(&self.inner)
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.intercept.reserve(&self.inner, r).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        self.intercept.heartbeat(&self.inner, i, t, lease).await
    }
    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        self.intercept.complete(&self.inner, completion).await
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        self.intercept.release(&self.inner, i, t).await
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
    async fn force_release(&self, i: &Identity, r: bool) -> Result<ForcedRelease, StoreError> {
        self.inner.force_release(i, r).await
    }
    async fn wait_for_change(&self, i: &Identity, max_wait: Duration, round: u32) {
        self.inner.wait_for_change(i, max_wait, round).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.intercept.purge_expired(&self.inner, batch).await
    }
    async fn fetch(&self, i: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        self.intercept.fetch(&self.inner, i).await
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.intercept.scope_stats(&self.inner).await
    }
}
