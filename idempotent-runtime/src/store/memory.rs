//! [`MemoryStore`]: records in a map inside this process.

use super::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone)]
struct Record {
    state: RecordState,
    fingerprint: Option<String>,
    owner_token: Option<String>,
    outcome: Option<StoredOutcome>,
    lease_expires_at_ms: i64,
    expires_at_ms: i64,
    created_at_ms: i64,
    /// Rule 20: 1, +1 per takeover of an expired lease.
    attempt: u32,
    attempt_started_at_ms: i64,
    recovered: bool,
}

#[derive(Debug)]
struct Inner {
    records: Mutex<HashMap<Identity, Record>>,
    epoch_ms: i64,
    started: Instant,
}

/// An in-process store: for tests, and for single-process programs that only
/// need protection against concurrent duplicates while they run. Nothing
/// survives a restart. Cloning gives another handle to the same records.
///
/// ```
/// use idempotent_runtime::{MemoryStore, set_default_store};
/// set_default_store(MemoryStore::new());
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        let epoch_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        MemoryStore {
            inner: Arc::new(Inner {
                records: Mutex::new(HashMap::new()),
                epoch_ms,
                started: Instant::now(),
            }),
        }
    }

    /// Number of records held, expired ones included.
    pub fn len(&self) -> usize {
        self.records().len()
    }

    /// Whether the store holds no record at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The store's clock: a monotonic clock anchored at the wall time the store was made.
    fn now_ms(&self) -> i64 {
        self.inner.epoch_ms + self.inner.started.elapsed().as_millis() as i64
    }

    fn records(&self) -> MutexGuard<'_, HashMap<Identity, Record>> {
        // A panic while the lock was held cannot leave a record half-written
        // (every update is a single assignment), so a poisoned lock is usable.
        self.inner
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn release_now(&self, identity: &Identity, token: &OwnerToken) -> bool {
        let mut records = self.records();
        let owned = records.get(identity).is_some_and(|r| {
            r.state == RecordState::InProgress && r.owner_token.as_deref() == Some(token.as_str())
        });
        if owned {
            records.remove(identity);
        }
        owned
    }

    fn complete_now(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
        recovered: bool,
    ) -> bool {
        let now = self.now_ms();
        let mut records = self.records();
        match records.get_mut(identity) {
            Some(r)
                if r.state == RecordState::InProgress
                    && r.owner_token.as_deref() == Some(token.as_str()) =>
            {
                r.state = RecordState::Complete;
                r.owner_token = None;
                r.outcome = Some(outcome.clone());
                r.expires_at_ms = now.saturating_add(duration_to_millis(ttl));
                r.lease_expires_at_ms = now;
                r.recovered = recovered;
                true
            }
            _ => false,
        }
    }
}

fn is_expired(r: &Record, now: i64) -> bool {
    match r.state {
        RecordState::Complete => r.expires_at_ms <= now,
        RecordState::InProgress => r.expires_at_ms <= now && r.lease_expires_at_ms <= now,
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let now = self.now_ms();
        // `previous`: the record taken over (rule 20 counts the attempts).
        let fresh = |previous: Option<&Record>| {
            let attempt = previous.map_or(1, |p| p.attempt.saturating_add(1));
            (
                Record {
                    state: RecordState::InProgress,
                    fingerprint: request.fingerprint.map(|f| f.as_str().to_owned()),
                    owner_token: Some(request.token.as_str().to_owned()),
                    outcome: None,
                    lease_expires_at_ms: now + duration_to_millis(request.lease),
                    expires_at_ms: now.saturating_add(duration_to_millis(request.ttl)),
                    created_at_ms: previous.map_or(now, |p| p.created_at_ms),
                    attempt,
                    attempt_started_at_ms: now,
                    recovered: false,
                },
                Reservation::acquired(attempt, previous.map(|p| p.attempt_started_at_ms)),
            )
        };
        let mut records = self.records();
        let (record, answer) = match records.get(request.identity) {
            None => fresh(None),
            Some(r) if is_expired(r, now) => fresh(None),
            Some(r)
                if fingerprints_conflict(
                    r.fingerprint.as_deref(),
                    request.fingerprint.map(Fingerprint::as_str),
                ) =>
            {
                return Ok(Reservation::FingerprintMismatch)
            }
            Some(r) if r.state == RecordState::Complete => {
                let outcome = r.outcome.clone().unwrap_or(StoredOutcome {
                    is_error: false,
                    payload: b"null".to_vec(),
                });
                return Ok(Reservation::Completed(outcome));
            }
            Some(r) if r.lease_expires_at_ms > now => {
                return Ok(Reservation::InProgress {
                    lease_remaining: millis_to_duration(r.lease_expires_at_ms - now),
                })
            }
            Some(r) => fresh(Some(r)),
        };
        records.insert(request.identity.clone(), record);
        Ok(answer)
    }

    async fn complete(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.complete_now(identity, token, outcome, ttl, false))
    }

    async fn complete_recovered(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.complete_now(identity, token, outcome, ttl, true))
    }

    async fn force_release(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        let now = self.now_ms();
        let mut records = self.records();
        let answer = match records.get(identity) {
            None => ForcedRelease::Absent,
            Some(r) if r.state == RecordState::Complete => ForcedRelease::Complete,
            Some(r) if require_expired_lease && r.lease_expires_at_ms > now => {
                ForcedRelease::LeaseLive {
                    lease_remaining: millis_to_duration(r.lease_expires_at_ms - now),
                }
            }
            Some(r) => ForcedRelease::Released { attempt: r.attempt },
        };
        if matches!(answer, ForcedRelease::Released { .. }) {
            records.remove(identity);
        }
        Ok(answer)
    }

    async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<bool, StoreError> {
        Ok(self.release_now(identity, token))
    }

    async fn heartbeat(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.now_ms();
        let mut records = self.records();
        match records.get_mut(identity) {
            Some(r)
                if r.state == RecordState::InProgress
                    && r.owner_token.as_deref() == Some(token.as_str()) =>
            {
                r.lease_expires_at_ms = now + duration_to_millis(lease);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn release_detached(&self, identity: Identity, token: OwnerToken) {
        self.release_now(&identity, &token);
    }

    fn complete_detached(
        &self,
        identity: Identity,
        token: OwnerToken,
        outcome: StoredOutcome,
        ttl: Duration,
    ) {
        self.complete_now(&identity, &token, &outcome, ttl, false);
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let now = self.now_ms();
        let mut records = self.records();
        let doomed: Vec<Identity> = records
            .iter()
            .filter(|(_, r)| is_expired(r, now))
            .map(|(id, _)| id.clone())
            .take(batch as usize)
            .collect();
        for id in &doomed {
            records.remove(id);
        }
        Ok(doomed.len() as u64)
    }

    async fn fetch(&self, identity: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        let now = self.now_ms();
        Ok(self.records().get(identity).map(|r| RecordSnapshot {
            state: r.state,
            fingerprint: r.fingerprint.clone(),
            owner_token: r.owner_token.clone(),
            outcome: r.outcome.clone(),
            lease_expires_at_ms: (r.state == RecordState::InProgress)
                .then_some(r.lease_expires_at_ms),
            expires_at_ms: r.expires_at_ms,
            now_ms: now,
            created_at_ms: r.created_at_ms,
            attempt: r.attempt,
            attempt_started_at_ms: r.attempt_started_at_ms,
            recovered: r.recovered,
        }))
    }

    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        let now = self.now_ms();
        let mut by_scope: std::collections::BTreeMap<String, ScopeStats> = Default::default();
        for (id, r) in self.records().iter() {
            let s = by_scope
                .entry(id.scope.clone())
                .or_insert_with(|| ScopeStats {
                    scope: id.scope.clone(),
                    ..Default::default()
                });
            if !is_expired(r, now) {
                s.taken_over += u64::from(r.attempt > 1);
                s.recovered += u64::from(r.recovered && r.state == RecordState::Complete);
            }
            if is_expired(r, now) {
                s.expired += 1;
            } else if r.state == RecordState::Complete {
                s.complete += 1;
            } else if r.lease_expires_at_ms > now {
                s.in_progress += 1;
            } else {
                s.stuck += 1;
            }
            s.oldest_created_at_ms = Some(
                s.oldest_created_at_ms
                    .map_or(r.created_at_ms, |o| o.min(r.created_at_ms)),
            );
        }
        Ok(by_scope.into_values().collect())
    }
}
