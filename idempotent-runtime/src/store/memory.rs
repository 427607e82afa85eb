//! [`MemoryStore`]: records in a map inside this process.
//!
//! Every operation takes the map's lock once. A waiting duplicate
//! ([`Store::wait_for_change`]) listens on a `Notify` kept in the record it
//! waits on: a completion, release or takeover replaces or removes the record
//! and wakes its waiters in the same critical section, so there is nothing to
//! poll and nothing left behind when the record goes.

use super::*;
use foldhash::fast::SeedableRandomState;
use foldhash::SharedSeed;
use hashbrown::hash_table::{Entry, HashTable};
use std::hash::BuildHasher;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;

#[derive(Debug)]
struct Record {
    state: RecordState,
    fingerprint: Option<Text<FINGERPRINT_BYTES>>,
    owner_token: Option<Text<TOKEN_BYTES>>,
    outcome: Option<StoredOutcome>,
    lease_expires_at_ms: i64,
    expires_at_ms: i64,
    created_at_ms: i64,
    /// Rule 20: 1, +1 per takeover of an expired lease.
    attempt: u32,
    attempt_started_at_ms: i64,
    recovered: bool,
    /// The duplicates waiting for this record to change, made by the first of
    /// them. Taken (and woken) by every change that could end their wait.
    waiters: Option<Arc<Notify>>,
}

/// A fingerprint as this build makes it: `v1:`, `v2:` or `v3:` and 64 hex digits.
const FINGERPRINT_BYTES: usize = 67;
/// An owner token as the engine makes it: 32 hex digits.
const TOKEN_BYTES: usize = 32;

/// Text kept in the record itself when it is at most `N` bytes (a token, a
/// fingerprint: two allocations less per reservation), on the heap otherwise.
#[derive(Debug, Clone)]
enum Text<const N: usize> {
    Inline { len: u8, bytes: [u8; N] },
    Heap(Box<str>),
}

impl<const N: usize> Text<N> {
    fn new(text: &str) -> Self {
        match u8::try_from(text.len()) {
            Ok(len) if text.len() <= N => {
                let mut bytes = [0; N];
                bytes[..text.len()].copy_from_slice(text.as_bytes());
                Text::Inline { len, bytes }
            }
            _ => Text::Heap(text.into()),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            Text::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Text::Heap(text) => text.as_bytes(),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            // Copied from a `&str` whole, so always UTF-8.
            Text::Inline { .. } => std::str::from_utf8(self.as_bytes()).unwrap_or_default(),
            Text::Heap(text) => text,
        }
    }
}

impl Record {
    /// Wakes (and forgets) the duplicates waiting on this record.
    fn wake_waiters(&mut self) {
        if let Some(waiters) = self.waiters.take() {
            waiters.notify_waiters();
        }
    }
}

/// One record with its identity, and the identity's hash (computed once per
/// operation, before the lock is taken; the table never hashes again, not
/// even when it grows). The record is boxed: a slot of 48 bytes rather than
/// some 250 makes the table's growth (every slot moved into fresh pages)
/// cheaper than the allocation, under a load of fresh keys.
#[derive(Debug)]
struct Slot {
    hash: u64,
    identity: StoredIdentity,
    record: Box<Record>,
}

/// An identity as the store keeps it: tenant, scope and key back to back in
/// one allocation (one heap object to compare on a lookup, not three).
#[derive(Debug)]
struct StoredIdentity {
    tenant_len: usize,
    scope_len: usize,
    text: Box<str>,
}

impl StoredIdentity {
    fn new(identity: &Identity) -> Self {
        let (tenant, scope, key) = (&identity.tenant, &identity.scope, &identity.key);
        let mut text = String::with_capacity(tenant.len() + scope.len() + key.len());
        for part in [tenant, scope, key] {
            text.push_str(part);
        }
        StoredIdentity {
            tenant_len: tenant.len(),
            scope_len: scope.len(),
            text: text.into_boxed_str(),
        }
    }

    /// Whether this is `identity` (all three parts equal).
    fn is(&self, identity: &Identity) -> bool {
        let (t, s) = (self.tenant_len, self.tenant_len + self.scope_len);
        let text = self.text.as_bytes();
        t == identity.tenant.len()
            && s - t == identity.scope.len()
            && text.len() - s == identity.key.len()
            && text[s..] == *identity.key.as_bytes()
            && text[t..s] == *identity.scope.as_bytes()
            && text[..t] == *identity.tenant.as_bytes()
    }

    fn scope(&self) -> &str {
        // The parts were whole `str`s, so their bounds are character bounds.
        self.text
            .get(self.tenant_len..self.tenant_len + self.scope_len)
            .unwrap_or_default()
    }
}

#[derive(Debug)]
struct Inner {
    records: Mutex<HashTable<Slot>>,
    /// No record counts as absent before this (ms on the store's clock):
    /// lowered under the records' lock by every write that can make a
    /// record purgeable sooner, raised by a purge that looked at them all.
    /// A purge before it looks at nothing, so a purge that has nothing to
    /// delete does not hold the lock for a scan of the whole table.
    earliest_purgeable: std::sync::atomic::AtomicI64,
    /// Keyed per store from the OS's randomness (identities are client
    /// input: their hashes must not be predictable).
    hasher: SeedableRandomState,
    epoch_ms: i64,
    /// tokio's clock, which the heartbeats follow too (see [`MemoryStore`]).
    started: tokio::time::Instant,
    /// [`Store::database_id`]: each store made by [`MemoryStore::new`] is a
    /// database of its own (its clones share it), so two of them (a store
    /// per region in a test) are never taken for one.
    database_id: Box<str>,
}

/// An in-process store: for tests, and for single-process programs that only
/// need protection against concurrent duplicates while they run. Nothing
/// survives a restart. Cloning gives another handle to the same records.
///
/// Its clock is tokio's (`tokio::time::Instant`), the clock the lease's
/// heartbeat runs on: in a test whose runtime has a paused clock
/// (`start_paused`, `tokio::time::advance`) leases and retention follow the
/// paused clock, in step with the heartbeats (with the real clock, a body
/// blocked in `spawn_blocking`, which holds a paused clock still, lost its
/// lease while its heartbeat waited). Share one store only between runtimes
/// whose clocks agree: not a paused test runtime and a real one (a global
/// `set_default_store` used by tests of both kinds); a store made on a
/// paused clock that was advanced stands still elsewhere until the real
/// clock catches up.
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
                records: Mutex::new(HashTable::new()),
                earliest_purgeable: std::sync::atomic::AtomicI64::new(i64::MAX),
                hasher: SeedableRandomState::with_seed(
                    uuid::Uuid::new_v4().as_u64_pair().0,
                    SharedSeed::global_random(),
                ),
                epoch_ms,
                started: tokio::time::Instant::now(),
                database_id: format!("memory:{}", uuid::Uuid::new_v4().simple()).into(),
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

    /// The store's clock: tokio's monotonic clock, anchored at the wall time
    /// the store was made.
    fn now_ms(&self) -> i64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.inner.started);
        self.inner.epoch_ms + elapsed.as_millis() as i64
    }

    fn hash(&self, identity: &Identity) -> u64 {
        self.inner.hasher.hash_one(identity)
    }

    fn records(&self) -> MutexGuard<'_, HashTable<Slot>> {
        // A panic while the lock was held cannot leave a record half-written
        // (every update is a single assignment), so a poisoned lock is usable.
        self.inner
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Renews (or, with a shorter lease, ends early) the lease `token` owns.
    fn heartbeat_now(&self, identity: &Identity, token: &OwnerToken, lease: Duration) -> bool {
        let now = self.now_ms();
        let hash = self.hash(identity);
        let mut records = self.records();
        match find_mut(&mut records, hash, identity) {
            Some(r) if r.owned_by(token) => {
                let until = now.saturating_add(duration_to_millis(lease));
                let shortened = until < r.lease_expires_at_ms;
                // The retention moves with the lease (`Store::heartbeat`).
                let retention = r.expires_at_ms.saturating_sub(r.lease_expires_at_ms);
                r.expires_at_ms = r.expires_at_ms.max(until.saturating_add(retention));
                r.lease_expires_at_ms = until;
                self.purgeable_from(r);
                if shortened {
                    // A lease ended early (the engine ends one so the next
                    // call takes over at once): waiters sleep until the old
                    // end, so they look again now.
                    r.wake_waiters();
                }
                true
            }
            _ => false,
        }
    }

    /// `r` (just written, the records' lock held) counts as absent from
    /// [`purgeable_at`] on: the purge must look by then.
    fn purgeable_from(&self, r: &Record) {
        self.inner
            .earliest_purgeable
            .fetch_min(purgeable_at(r), Ordering::Relaxed);
    }

    fn release_now(&self, identity: &Identity, token: &OwnerToken) -> bool {
        let hash = self.hash(identity);
        let mut records = self.records();
        match records.find_entry(hash, |s| s.hash == hash && s.identity.is(identity)) {
            Ok(slot) if slot.get().record.owned_by(token) => {
                slot.remove().0.record.wake_waiters();
                true
            }
            _ => false,
        }
    }

    fn complete_now(&self, completion: Completion<'_>) -> bool {
        let now = self.now_ms();
        let hash = self.hash(completion.identity);
        let mut records = self.records();
        match find_mut(&mut records, hash, completion.identity) {
            Some(r) if r.owned_by(completion.token) => {
                r.state = RecordState::Complete;
                r.owner_token = None;
                r.outcome = Some(completion.outcome.clone());
                r.expires_at_ms = now.saturating_add(duration_to_millis(completion.ttl));
                r.lease_expires_at_ms = now;
                self.purgeable_from(r);
                r.recovered = completion.marks_recovered();
                r.wake_waiters();
                true
            }
            _ => false,
        }
    }
}

impl Record {
    /// In progress and owned by `token` (fencing, rule 10).
    fn owned_by(&self, token: &OwnerToken) -> bool {
        self.state == RecordState::InProgress
            && self
                .owner_token
                .as_ref()
                .is_some_and(|t| t.as_bytes() == token.as_str().as_bytes())
    }
}

fn find<'a>(records: &'a HashTable<Slot>, hash: u64, identity: &Identity) -> Option<&'a Record> {
    records
        .find(hash, |s| s.hash == hash && s.identity.is(identity))
        .map(|s| &*s.record)
}

fn find_mut<'a>(
    records: &'a mut HashTable<Slot>,
    hash: u64,
    identity: &Identity,
) -> Option<&'a mut Record> {
    records
        .find_mut(hash, |s| s.hash == hash && s.identity.is(identity))
        .map(|s| &mut *s.record)
}

/// [`fingerprints_conflict`] (rule 8: both exist and differ), on the stored
/// bytes without reading them back as text.
fn conflict(stored: Option<&Text<FINGERPRINT_BYTES>>, incoming: Option<&str>) -> bool {
    matches!((stored, incoming), (Some(a), Some(b)) if a.as_bytes() != b.as_bytes())
}

/// When `r` starts to count as absent ([`is_expired`]).
fn purgeable_at(r: &Record) -> i64 {
    match r.state {
        RecordState::Complete => r.expires_at_ms,
        RecordState::InProgress => r.expires_at_ms.max(r.lease_expires_at_ms),
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

    fn records_in_process_memory(&self) -> bool {
        true
    }

    fn database_id(&self) -> Option<&str> {
        Some(&self.inner.database_id)
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let now = self.now_ms();
        let lease_expires_at_ms = now.saturating_add(duration_to_millis(request.lease));
        let expires_at_ms = now.saturating_add(duration_to_millis(request.ttl));
        let fingerprint = request.fingerprint.map(Fingerprint::as_str);
        let identity = request.identity;
        let hash = self.hash(identity);
        let mut records = self.records();
        let r = match records.entry(
            hash,
            |s| s.hash == hash && s.identity.is(identity),
            |s| s.hash,
        ) {
            Entry::Occupied(slot) => &mut *slot.into_mut().record,
            Entry::Vacant(slot) => {
                slot.insert(Slot {
                    hash,
                    identity: StoredIdentity::new(identity),
                    record: Box::new(Record {
                        state: RecordState::InProgress,
                        fingerprint: fingerprint.map(Text::new),
                        owner_token: Some(Text::new(request.token.as_str())),
                        outcome: None,
                        lease_expires_at_ms,
                        expires_at_ms,
                        created_at_ms: now,
                        attempt: 1,
                        attempt_started_at_ms: now,
                        recovered: false,
                        waiters: None,
                    }),
                });
                self.inner
                    .earliest_purgeable
                    .fetch_min(expires_at_ms.max(lease_expires_at_ms), Ordering::Relaxed);
                return Ok(Reservation::FRESH);
            }
        };
        // `taken_over`: the attempt whose lease ran out, and when it started
        // (rule 20 counts the attempts); `None` for an expired record, which
        // counts as absent and is replaced by attempt 1.
        let taken_over = if is_expired(r, now) {
            None
        } else if conflict(r.fingerprint.as_ref(), fingerprint) {
            return Ok(Reservation::FingerprintMismatch);
        } else if r.state == RecordState::Complete {
            let outcome = r.outcome.clone().unwrap_or(StoredOutcome {
                is_error: false,
                payload: b"null".to_vec(),
            });
            return Ok(Reservation::Completed(outcome));
        } else if r.lease_expires_at_ms > now {
            return Ok(Reservation::InProgress {
                lease_remaining: millis_to_duration(r.lease_expires_at_ms - now),
            });
        } else {
            Some((r.attempt, r.attempt_started_at_ms))
        };
        // Replaced in place: the identity stays the map's key, no clone.
        let attempt = taken_over.map_or(1, |(a, _)| a.saturating_add(1));
        if taken_over.is_none() {
            r.created_at_ms = now;
        }
        r.state = RecordState::InProgress;
        r.fingerprint = fingerprint.map(Text::new);
        r.owner_token = Some(Text::new(request.token.as_str()));
        r.outcome = None;
        r.lease_expires_at_ms = lease_expires_at_ms;
        r.expires_at_ms = expires_at_ms;
        self.purgeable_from(r);
        r.attempt = attempt;
        r.attempt_started_at_ms = now;
        r.recovered = false;
        // Whoever waited on the old lease re-checks (and finds the new one).
        r.wake_waiters();
        Ok(Reservation::acquired(
            attempt,
            taken_over.map(|(_, started)| started),
        ))
    }

    async fn complete(&self, completion: Completion<'_>) -> Result<Fenced, StoreError> {
        Ok(Fenced::from_owned(self.complete_now(completion)))
    }

    async fn force_release(
        &self,
        identity: &Identity,
        require_expired_lease: bool,
    ) -> Result<ForcedRelease, StoreError> {
        let now = self.now_ms();
        let hash = self.hash(identity);
        let mut records = self.records();
        let answer = match find(&records, hash, identity) {
            None => ForcedRelease::Absent,
            Some(r) if r.state == RecordState::Complete => ForcedRelease::Complete,
            Some(r) if require_expired_lease && r.lease_expires_at_ms > now => {
                ForcedRelease::LeaseLive {
                    lease_remaining: millis_to_duration(r.lease_expires_at_ms - now),
                }
            }
            Some(r) => ForcedRelease::Released { attempt: r.attempt },
        };
        if matches!(answer, ForcedRelease::Released { .. })
            && let Ok(slot) =
                records.find_entry(hash, |s| s.hash == hash && s.identity.is(identity))
        {
            slot.remove().0.record.wake_waiters();
        }
        Ok(answer)
    }

    async fn release(&self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError> {
        Ok(Fenced::from_owned(self.release_now(identity, token)))
    }

    async fn heartbeat(
        &self,
        identity: &Identity,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        Ok(Fenced::from_owned(
            self.heartbeat_now(identity, token, lease),
        ))
    }

    fn end_lease_detached(&self, identity: Identity, token: OwnerToken) {
        self.heartbeat_now(&identity, &token, Duration::ZERO);
    }

    fn release_detached(&self, identity: Identity, token: OwnerToken) {
        self.release_now(&identity, &token);
    }

    fn complete_detached(&self, completion: Completion<'_>) {
        self.complete_now(completion);
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let now = self.now_ms();
        let mut records = self.records();
        // Read under the lock every write that lowers it holds.
        if now < self.inner.earliest_purgeable.load(Ordering::Relaxed) {
            return Ok(0);
        }
        let mut left = batch;
        let mut earliest = i64::MAX;
        records.retain(|slot| {
            let r = &mut slot.record;
            if left == 0 || !is_expired(r, now) {
                earliest = earliest.min(purgeable_at(r));
                return true;
            }
            left -= 1;
            r.wake_waiters();
            false
        });
        self.inner
            .earliest_purgeable
            .store(earliest, Ordering::Relaxed);
        Ok(u64::from(batch - left))
    }

    /// Waits until the record is completed, released, taken over or
    /// purged (woken by that change, at once), or until its lease runs out or
    /// `max_wait` passes, whichever comes first. Every change is made in this
    /// process, so there is no polling: `round` is not used.
    ///
    /// The check of the record and the registration as a waiter happen under
    /// the same lock as every change, so no change is missed in between.
    async fn wait_for_change(&self, identity: &Identity, max_wait: Duration, round: u32) {
        let _ = round;
        let now = self.now_ms();
        let waiters: Arc<Notify>;
        let remaining: Duration;
        let notified;
        {
            let hash = self.hash(identity);
            let mut records = self.records();
            match find_mut(&mut records, hash, identity) {
                Some(r)
                    if r.state == RecordState::InProgress
                        && r.lease_expires_at_ms > now
                        && !is_expired(r, now) =>
                {
                    remaining = millis_to_duration(r.lease_expires_at_ms - now);
                    waiters = r.waiters.get_or_insert_with(Default::default).clone();
                }
                // Changed since the caller looked: reserve again now.
                _ => return,
            }
            // Made while the lock is held: `notify_waiters` wakes every
            // `Notified` made before it, and a change calls it only under
            // this lock.
            notified = waiters.notified();
        }
        let _ = tokio::time::timeout(max_wait.min(remaining), notified).await;
    }

    async fn fetch(&self, identity: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        let now = self.now_ms();
        let hash = self.hash(identity);
        Ok(
            find(&self.records(), hash, identity).map(|r| RecordSnapshot {
                state: r.state,
                fingerprint: r.fingerprint.as_ref().map(|t| t.as_str().to_owned()),
                owner_token: r.owner_token.as_ref().map(|t| t.as_str().to_owned()),
                outcome: r.outcome.clone(),
                lease_expires_at_ms: (r.state == RecordState::InProgress)
                    .then_some(r.lease_expires_at_ms),
                expires_at_ms: r.expires_at_ms,
                now_ms: now,
                created_at_ms: r.created_at_ms,
                attempt: r.attempt,
                attempt_started_at_ms: r.attempt_started_at_ms,
                recovered: r.recovered,
            }),
        )
    }

    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        let now = self.now_ms();
        let mut by_scope: std::collections::BTreeMap<String, ScopeStats> = Default::default();
        for slot in self.records().iter() {
            let (id, r) = (&slot.identity, &slot.record);
            let s = by_scope
                .entry(id.scope().to_owned())
                .or_insert_with(|| ScopeStats {
                    scope: id.scope().to_owned(),
                    ..Default::default()
                });
            if !is_expired(r, now) {
                s.taken_over += u64::from(r.attempt > 1);
                s.recovered += u64::from(r.recovered && r.state == RecordState::Complete);
            }
            let longest = |so_far: Option<i64>, since: i64| {
                Some(so_far.map_or(now - since, |l| l.max(now - since)))
            };
            if is_expired(r, now) {
                s.expired += 1;
                let purgeable_since = match r.state {
                    RecordState::Complete => r.expires_at_ms,
                    RecordState::InProgress => r.expires_at_ms.max(r.lease_expires_at_ms),
                };
                s.longest_unpurged_ms = longest(s.longest_unpurged_ms, purgeable_since);
            } else if r.state == RecordState::Complete {
                s.complete += 1;
            } else if r.lease_expires_at_ms > now {
                s.in_progress += 1;
            } else {
                s.stuck += 1;
                s.longest_stuck_ms = longest(s.longest_stuck_ms, r.lease_expires_at_ms);
            }
            s.oldest_created_at_ms = Some(
                s.oldest_created_at_ms
                    .map_or(r.created_at_ms, |o| o.min(r.created_at_ms)),
            );
        }
        Ok(by_scope.into_values().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A purge looks at the records only once one may count as absent; each
    /// write that makes a record purgeable sooner (a reservation, a takeover,
    /// a completion, a lease ended early) tells it so. Every record made
    /// purgeable by one of them is purged.
    #[tokio::test(start_paused = true)]
    async fn a_purge_finds_what_every_kind_of_write_made_purgeable() {
        let store = MemoryStore::new();
        let ms = Duration::from_millis;
        let hour = Duration::from_secs(3600);
        let reserve = |key: &'static str, token: &OwnerToken, lease, ttl| {
            let (store, token) = (store.clone(), token.clone());
            async move {
                let id = Identity::new("t", "memory.purge", key).expect("identity");
                let request = ReserveRequest {
                    identity: &id,
                    fingerprint: None,
                    token: &token,
                    lease,
                    ttl,
                };
                let answer = store.reserve(request).await.expect("reserve");
                assert!(matches!(answer, Reservation::Acquired { .. }), "{answer:?}");
                id
            }
        };
        let purge = || async { store.purge_expired(100).await.expect("purge") };

        // Live for an hour: nothing to purge (and nothing looked at).
        let token = OwnerToken::new();
        let completed = reserve("completed", &token, hour, hour).await;
        assert_eq!(purge().await, 0);
        // A completion with a short ttl.
        let outcome = StoredOutcome {
            is_error: false,
            payload: b"1".to_vec(),
        };
        let done = store.complete_now(Completion {
            identity: &completed,
            token: &token,
            outcome: &outcome,
            ttl: ms(1),
            by: AnsweredBy::Body,
        });
        assert!(done);
        tokio::time::advance(ms(5)).await;
        assert_eq!(purge().await, 1, "completed with a short ttl");
        // A lease ended early, on a record with a short ttl.
        let token = OwnerToken::new();
        let ended = reserve("ended", &token, hour, ms(1)).await;
        assert_eq!(purge().await, 0);
        assert!(store.heartbeat_now(&ended, &token, Duration::ZERO));
        tokio::time::advance(ms(5)).await;
        assert_eq!(purge().await, 1, "a lease ended early");
        // A new record with a short lease and ttl.
        reserve("fresh", &OwnerToken::new(), ms(1), ms(1)).await;
        tokio::time::advance(ms(5)).await;
        assert_eq!(purge().await, 1, "a fresh record");
        // A takeover of a record kept for an hour, with a short ttl.
        reserve("taken", &OwnerToken::new(), ms(1), hour).await;
        tokio::time::advance(ms(5)).await;
        assert_eq!(purge().await, 0, "kept for an hour after its lease");
        reserve("taken", &OwnerToken::new(), ms(1), ms(1)).await;
        tokio::time::advance(ms(5)).await;
        assert_eq!(purge().await, 1, "taken over with a short ttl");
        assert!(store.is_empty());
    }

    /// A duplicate waits at most until the owner's lease runs out, however
    /// long it may wait: then it reserves again and takes over a crashed
    /// owner's record, rather than sleeping through its whole wait bound.
    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_when_the_lease_runs_out() {
        let store = MemoryStore::new();
        let id = Identity::new("t", "memory.wait", "k").expect("identity");
        let lease = Duration::from_secs(2);
        let request = |token| ReserveRequest {
            identity: &id,
            fingerprint: None,
            token,
            lease,
            ttl: Duration::from_secs(3600),
        };
        let crashed = OwnerToken::new();
        let first = store.reserve(request(&crashed)).await.expect("reserve");
        assert_eq!(first, Reservation::FRESH);
        let started = tokio::time::Instant::now();
        store
            .wait_for_change(&id, Duration::from_secs(3600), 0)
            .await;
        assert!(
            started.elapsed() <= lease,
            "waited {:?} for a lease of {lease:?}",
            started.elapsed()
        );
        let next = store
            .reserve(request(&OwnerToken::new()))
            .await
            .expect("reserve");
        assert!(
            matches!(next, Reservation::Acquired { attempt: 2, .. }),
            "{next:?}"
        );
    }

    #[test]
    fn a_stored_identity_is_its_identity_only() {
        let parts = [
            ("", "s", "k"),
            ("t", "s", "k"),
            ("ts", "", "k"),
            ("t", "sk", ""),
            ("t", "s", "kk"),
            // Same lengths, other bytes: each part is compared, not only measured.
            ("u", "s", "k"),
            ("t", "z", "k"),
            ("t", "s", "j"),
        ];
        let ids: Vec<Identity> = parts
            .iter()
            .map(|(t, s, k)| Identity {
                tenant: (*t).to_owned(),
                scope: (*s).to_owned(),
                key: (*k).to_owned(),
            })
            .collect();
        for (i, a) in ids.iter().enumerate() {
            let stored = StoredIdentity::new(a);
            assert_eq!(stored.scope(), a.scope);
            for (j, b) in ids.iter().enumerate() {
                assert_eq!(stored.is(b), i == j, "{a:?} / {b:?}");
            }
        }
        let id = Identity::new("アカウント", "payments.charge", "ключ-🔑").expect("identity");
        let stored = StoredIdentity::new(&id);
        assert!(stored.is(&id));
        assert_eq!(stored.scope(), "payments.charge");
    }

    #[test]
    fn text_keeps_what_it_was_given_inline_or_not() {
        for text in [
            "",
            "a",
            "ключ-🔑",
            &"x".repeat(4),
            &"y".repeat(5),
            &"z".repeat(300),
        ] {
            let t = Text::<4>::new(text);
            assert_eq!(t.as_str(), text);
            assert_eq!(t.as_bytes(), text.as_bytes());
            assert_eq!(matches!(t, Text::Inline { .. }), text.len() <= 4);
        }
        let token = OwnerToken::new();
        assert!(matches!(
            Text::<TOKEN_BYTES>::new(token.as_str()),
            Text::Inline { .. }
        ));
        let fp = Fingerprint::of(&1u8).expect("fingerprint");
        assert!(matches!(
            Text::<FINGERPRINT_BYTES>::new(fp.as_str()),
            Text::Inline { .. }
        ));
        let other = Fingerprint::of(&2u8).expect("fingerprint");
        for stored in [None, Some(fp.as_str()), Some(other.as_str())] {
            for incoming in [None, Some(fp.as_str()), Some(other.as_str())] {
                assert_eq!(
                    conflict(stored.map(Text::new).as_ref(), incoming),
                    fingerprints_conflict(stored, incoming)
                );
            }
        }
    }

    /// The `Notify` a waiter put in the record goes with the change that
    /// woke it; a finished wait leaves nothing behind.
    #[tokio::test]
    async fn a_completion_wakes_the_waiter_and_forgets_it() {
        let store = MemoryStore::new();
        let id = Identity::new("t", "unit.wait", "k").expect("identity");
        let token = OwnerToken::new();
        let request = ReserveRequest {
            identity: &id,
            fingerprint: None,
            token: &token,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        };
        assert_eq!(store.reserve(request).await.ok(), Some(Reservation::FRESH));
        let has_waiters =
            || find(&store.records(), store.hash(&id), &id).is_some_and(|r| r.waiters.is_some());
        let waiter = store.wait_for_change(&id, Duration::from_secs(10), 0);
        let complete = async {
            while !has_waiters() {
                tokio::task::yield_now().await;
            }
            let outcome = StoredOutcome {
                is_error: false,
                payload: b"1".to_vec(),
            };
            assert!(store.complete_now(Completion::by_body(
                &id,
                &token,
                &outcome,
                Duration::from_secs(60)
            )));
        };
        tokio::join!(waiter, complete);
        assert!(!has_waiters(), "the completion took the waiters' Notify");
    }

    /// Rules 10 and 20: a lease has run out from the millisecond it ends
    /// (`lease_expires_at <= now`, as the SQL stores compare). At that
    /// moment a reservation takes the record over, and so the operator's
    /// release that requires an ended lease frees it too: one definition of
    /// "ran out" for both, not a record a duplicate may take over while the
    /// operator is told its lease is still live.
    #[tokio::test(start_paused = true)]
    async fn a_lease_has_run_out_at_the_millisecond_it_ends() {
        let lease = Duration::from_secs(30);
        let hour = Duration::from_secs(3600);
        let reserve = |store: MemoryStore, id: Identity| async move {
            let token = OwnerToken::new();
            let request = ReserveRequest {
                identity: &id,
                fingerprint: None,
                token: &token,
                lease,
                ttl: hour,
            };
            store.reserve(request).await.expect("reserve")
        };
        let store = MemoryStore::new();
        let taken = Identity::new("t", "memory.boundary", "taken").expect("identity");
        let released = Identity::new("t", "memory.boundary", "released").expect("identity");
        for id in [&taken, &released] {
            let first = reserve(store.clone(), id.clone()).await;
            assert!(matches!(first, Reservation::Acquired { .. }), "{first:?}");
        }
        // One millisecond before the lease ends: still live for both.
        tokio::time::advance(lease - Duration::from_millis(1)).await;
        let early = reserve(store.clone(), taken.clone()).await;
        assert!(matches!(early, Reservation::InProgress { .. }), "{early:?}");
        let refused = store.force_release(&released, true).await.expect("release");
        assert!(
            matches!(refused, ForcedRelease::LeaseLive { .. }),
            "{refused:?}"
        );
        // The millisecond it ends: run out for both.
        tokio::time::advance(Duration::from_millis(1)).await;
        let takeover = reserve(store.clone(), taken.clone()).await;
        assert!(
            matches!(takeover, Reservation::Acquired { .. }),
            "a duplicate may take the record over now: {takeover:?}"
        );
        assert_eq!(
            store.force_release(&released, true).await.expect("release"),
            ForcedRelease::Released { attempt: 1 },
            "the operator's release of an ended lease is refused while a duplicate may take over"
        );
    }
}
