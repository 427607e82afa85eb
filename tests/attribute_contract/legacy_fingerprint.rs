//! The legacy (v1) fingerprint is only a way to *compare* with a record an
//! older version made (rule 6). After a mismatch the engine tries it once;
//! when the conflicting record went away between the two statements (its
//! owner's body failed and released it), that reservation creates a record,
//! and it must carry the current fingerprint: with the order-dependent v1
//! fingerprint of one HashSet instance, a legitimate retry of the same
//! request (the same set, iterated in another order: another process,
//! another instance) was refused as a mismatch.

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Fenced, Fingerprint, Identity, MemoryStore,
    Outcome, OwnerToken, RecordState, Reservation, ReserveRequest, Store, StoreError,
    TransactionalConnection,
};
use std::collections::hash_map::RandomState;
use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

/// A memory store where a rival owns the record with other arguments and
/// releases it (its body failed) right after our first reservation was
/// answered "mismatch".
struct RivalReleases {
    rival: Mutex<Option<(Identity, OwnerToken)>>,
}

#[async_trait::async_trait]
impl Intercept for RivalReleases {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let answer = inner.reserve(r).await?;
        if answer == Reservation::FingerprintMismatch {
            let rival = self.rival.lock().unwrap().take();
            if let Some((identity, token)) = rival {
                assert_eq!(inner.release(&identity, &token).await?, Fenced::Written);
            }
        }
        Ok(answer)
    }
}

#[idempotent(scope = "review5.legacy", key = key, tenant = tenant, store = store)]
async fn subscribe(
    store: &Hooked<RivalReleases>,
    tenant: &str,
    key: &str,
    topics: HashSet<u32, RandomState>,
) -> Result<usize, Error> {
    Ok(topics.len())
}

/// The fingerprint the functions here make of their `topics` argument.
fn fingerprint_of_topics(topics: &HashSet<u32, RandomState>) -> Fingerprint {
    let mut b = idempotent_runtime::FingerprintBuilder::new();
    b.argument("topics", topics);
    b.finish().unwrap().unwrap()
}

fn topics() -> HashSet<u32, RandomState> {
    let mut s = HashSet::with_hasher(RandomState::new());
    s.extend(0..32);
    s
}

#[tokio::test]
async fn a_record_made_after_a_legacy_retry_carries_the_current_fingerprint() {
    let store = Hooked::new(RivalReleases {
        rival: Mutex::new(None),
    });
    let id = Identity::new("t1", "review5.legacy", "k1").unwrap();
    // The rival: same identity, other arguments, in progress.
    let rival_fp = Fingerprint::of(&"other arguments").unwrap();
    let rival_token = OwnerToken::new();
    let r = store
        .inner
        .reserve(ReserveRequest {
            identity: &id,
            fingerprint: Some(&rival_fp),
            token: &rival_token,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        })
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Acquired { .. }));
    *store.rival.lock().unwrap() = Some((id.clone(), rival_token));

    let first = topics();
    assert_eq!(
        subscribe(&store, "t1", "k1", first.clone()).await.unwrap(),
        32
    );

    // The same request again, with the set iterated in another order.
    let again = (0..100)
        .map(|_| topics())
        .find(|s| s.iter().ne(first.iter()))
        .expect("another iteration order");
    assert_eq!(again, first);
    let retry = subscribe(&store, "t1", "k1", again).await;
    assert!(
        matches!(retry, Ok(32)),
        "a legitimate retry was refused: {retry:?}"
    );
    let stored = store
        .fetch(&id)
        .await
        .unwrap()
        .unwrap()
        .fingerprint
        .unwrap();
    assert!(
        stored.starts_with("v2:"),
        "the new record was made with the legacy v1 fingerprint: {stored}"
    );
}

/// A memory store holding an older version's in-progress record (v1
/// fingerprint). Right after our first reservation is answered "mismatch",
/// that old owner's body fails (it releases), and a *new-version* caller with
/// exactly our arguments reserves: the record now carries our current (v2)
/// fingerprint.
struct OldOwnerReplaced {
    old_owner: Mutex<Option<(Identity, OwnerToken)>>,
    /// The new caller's fingerprint (ours) and token.
    newcomer: Mutex<Option<(Fingerprint, OwnerToken)>>,
}

#[async_trait::async_trait]
impl Intercept for OldOwnerReplaced {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let answer = inner.reserve(r).await?;
        if answer == Reservation::FingerprintMismatch {
            let old = self.old_owner.lock().unwrap().take();
            if let Some((identity, token)) = old {
                assert_eq!(inner.release(&identity, &token).await?, Fenced::Written);
                let (fp, token) = self.newcomer.lock().unwrap().take().expect("newcomer");
                let b = inner
                    .reserve(ReserveRequest {
                        identity: &identity,
                        fingerprint: Some(&fp),
                        token: &token,
                        lease: Duration::from_secs(30),
                        ttl: Duration::from_secs(3600),
                    })
                    .await?;
                assert!(matches!(b, Reservation::Acquired { .. }), "{b:?}");
            }
        }
        Ok(answer)
    }
}

#[idempotent(scope = "contract_edges.legacy_replaced", key = key, tenant = tenant, store = store,
             in_progress = reject)]
async fn subscribe_once(
    store: &Hooked<OldOwnerReplaced>,
    tenant: &str,
    key: &str,
    topics: HashSet<u32, RandomState>,
) -> Result<usize, Error> {
    Ok(topics.len())
}

/// Rule 7 (and 6): a mismatch needs two fingerprints that differ. During a
/// rolling upgrade an old version's call holds the record with its v1
/// fingerprint; our call (same arguments, new version) is answered
/// "mismatch" for its v2 fingerprint and retries with the legacy (v1) one.
/// Between the two statements the old owner's body fails and releases, and
/// a new-version duplicate with *our exact arguments* reserves (v2). The
/// legacy try now meets a record carrying our own current fingerprint, and
/// the engine, having used up its one legacy try, answers
/// `FingerprintMismatch` for a request equal to the one running: a
/// legitimate duplicate is refused as a different request (422 / poison
/// message) instead of being answered in progress (here: `reject`).
#[tokio::test]
async fn a_legacy_retry_that_meets_our_own_current_fingerprint_is_not_a_mismatch() {
    let topics = topics();
    let current = fingerprint_of_topics(&topics);
    let legacy = current.legacy().expect("a set has a legacy fingerprint");
    let store = Hooked::new(OldOwnerReplaced {
        old_owner: Mutex::new(None),
        newcomer: Mutex::new(Some((current.clone(), OwnerToken::new()))),
    });
    let id = Identity::new("t-rb", "contract_edges.legacy_replaced", "k-rb").unwrap();
    // The old version's call: same arguments, v1 fingerprint, in progress.
    let old_token = OwnerToken::new();
    let r = store
        .inner
        .reserve(ReserveRequest {
            identity: &id,
            fingerprint: Some(&legacy),
            token: &old_token,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        })
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Acquired { .. }));
    // Our arguments' v2 form differs from the stored v1 form: the first try
    // is a mismatch, so the engine tries the legacy form next.
    assert_ne!(current, legacy);
    *store.old_owner.lock().unwrap() = Some((id.clone(), old_token));

    let answer = subscribe_once(&store, "t-rb", "k-rb", topics.clone()).await;
    let stored = store.fetch(&id).await.unwrap().unwrap().fingerprint;
    assert_eq!(
        stored.as_deref(),
        Some(current.as_str()),
        "the record holds our own fingerprint"
    );
    assert!(
        matches!(answer, Err(Error::InProgress { .. })),
        "an identical request is running; expected InProgress, got {answer:?}"
    );
}

#[idempotent(scope = "contract_edges.mismatch_released", key = key, tenant = tenant, store = store)]
async fn pay(
    store: &Hooked<RivalReleases>,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    Ok(amount)
}

/// Rule 7's refusal needs a record that contradicts the call when it is
/// answered. A rival owner holds the key with other arguments and releases
/// it (its body failed) right after our reservation was refused as a
/// mismatch: the read made after a mismatch finds the key free, and the call
/// reserves again and runs, instead of being refused with nothing in its way
/// (a message consumer would have terminated the message).
#[tokio::test]
async fn a_mismatch_whose_record_was_released_meanwhile_reserves_again() {
    let store = Hooked::new(RivalReleases {
        rival: Mutex::new(None),
    });
    let id = Identity::new("t1", "contract_edges.mismatch_released", "k1").unwrap();
    let rival_fp = Fingerprint::of(&"other arguments").unwrap();
    let rival_token = crate::common::records::acquire(
        &store.inner,
        &id,
        Some(&rival_fp),
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
    .await;
    *store.rival.lock().unwrap() = Some((id.clone(), rival_token));
    let answer = pay(&store, "t1", "k1", 42).await;
    assert!(
        matches!(answer, Ok(42)),
        "refused with the key free: {answer:?}"
    );
    assert!(store.rival.lock().unwrap().is_none(), "the rival released");
    let record = store.fetch(&id).await.unwrap().expect("our record");
    assert_ne!(record.fingerprint.as_deref(), Some(rival_fp.as_str()));
}

/// A rival with other arguments holds the record; after our third refusal
/// (current, legacy, current) it releases, and an older version's call with
/// our exact arguments (our legacy fingerprint) reserves.
struct RivalThenOldVersion {
    refusals: Mutex<u32>,
    rival: Mutex<Option<(Identity, OwnerToken)>>,
    legacy: Fingerprint,
}

#[async_trait::async_trait]
impl Intercept for RivalThenOldVersion {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let answer = inner.reserve(r).await?;
        if answer == Reservation::FingerprintMismatch {
            let refusals = {
                let mut n = self.refusals.lock().unwrap();
                *n += 1;
                *n
            };
            if refusals == 3 {
                let (identity, token) = self.rival.lock().unwrap().take().expect("the rival");
                assert_eq!(inner.release(&identity, &token).await?, Fenced::Written);
                crate::common::records::acquire(
                    inner,
                    &identity,
                    Some(&self.legacy),
                    Duration::from_secs(30),
                    Duration::from_secs(3600),
                )
                .await;
            }
        }
        Ok(answer)
    }
}

#[idempotent(scope = "contract_edges.reread_legacy", key = key, tenant = tenant, store = store,
             in_progress = reject)]
async fn subscribe_after_rival(
    store: &Hooked<RivalThenOldVersion>,
    tenant: &str,
    key: &str,
    topics: HashSet<u32, RandomState>,
) -> Result<usize, Error> {
    Ok(topics.len())
}

/// The read after a mismatch finds the record now holding our own legacy
/// fingerprint (an older version's identical call took the key the rival
/// freed): the reservation made again tries every form, the legacy one
/// included, and meets the identical request in progress, instead of being
/// refused as a reused key because its one legacy try was spent before.
#[tokio::test]
async fn a_reread_tries_the_legacy_form_again() {
    let topics = topics();
    let current = fingerprint_of_topics(&topics);
    let legacy = current.legacy().expect("a set has a legacy fingerprint");
    let store = Hooked::new(RivalThenOldVersion {
        refusals: Mutex::new(0),
        rival: Mutex::new(None),
        legacy,
    });
    let id = Identity::new("t-rr", "contract_edges.reread_legacy", "k-rr").unwrap();
    let rival_fp = Fingerprint::of(&"other arguments").unwrap();
    let rival_token = crate::common::records::acquire(
        &store.inner,
        &id,
        Some(&rival_fp),
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
    .await;
    *store.rival.lock().unwrap() = Some((id.clone(), rival_token));
    let answer = subscribe_after_rival(&store, "t-rr", "k-rr", topics).await;
    assert!(
        matches!(answer, Err(Error::InProgress { .. })),
        "an identical request is running; expected InProgress, got {answer:?}"
    );
}

/// A rival with other arguments that keeps taking the key and freeing it
/// (a fast-failing body retried in a loop): every reservation of ours is
/// refused by it, and every read after finds the key free.
struct ChurningRival {
    fingerprint: Fingerprint,
    held: Mutex<Option<OwnerToken>>,
}

#[async_trait::async_trait]
impl Intercept for ChurningRival {
    async fn reserve(
        &self,
        inner: &MemoryStore,
        r: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let identity = r.identity.clone();
        if self.held.lock().unwrap().is_none() {
            let token = crate::common::records::acquire(
                inner,
                &identity,
                Some(&self.fingerprint),
                Duration::from_secs(30),
                Duration::from_secs(3600),
            )
            .await;
            *self.held.lock().unwrap() = Some(token);
        }
        let answer = inner.reserve(r).await?;
        if answer == Reservation::FingerprintMismatch {
            let token = self.held.lock().unwrap().take().expect("held");
            assert_eq!(inner.release(&identity, &token).await?, Fenced::Written);
        }
        Ok(answer)
    }
}

#[idempotent(scope = "contract_edges.churn", key = key, tenant = tenant, store = store)]
async fn pay_amid_churn(
    store: &Hooked<ChurningRival>,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    Ok(amount)
}

/// Refused every time by records of other arguments that are gone when
/// read: the call ends as a mismatch (rule 7), but a message consumer looks
/// again shortly (in progress) rather than terminating a message whose key
/// was never held by a finished record.
#[tokio::test]
async fn refusals_by_records_that_keep_coming_and_going_are_not_poison() {
    use idempotent_runtime::consumer::{handle, Disposition, Verdict};
    let store = Hooked::new(ChurningRival {
        fingerprint: Fingerprint::of(&"other arguments").unwrap(),
        held: Mutex::new(None),
    });
    let handled = handle(Some("k-churn"), |key| {
        pay_amid_churn(&store, "t-churn", key, 7)
    })
    .await;
    assert!(
        matches!(
            handled.idempotency_error(),
            Some(Error::FingerprintMismatch(_))
        ),
        "{:?}",
        handled.result
    );
    assert_eq!(
        (handled.verdict, handled.disposition()),
        (
            Verdict::InProgress {
                retry_after: Duration::from_secs(1)
            },
            Disposition::Nak(Some(Duration::from_secs(1)))
        )
    );
}

/// A transaction stand-in over a memory store: every statement goes to the
/// store (so a statement "in the transaction" is visible at once, as on a
/// connection that reads its own writes), and the rival of
/// [`RivalReleases`] releases its record right after our first reservation
/// was answered "mismatch". Counts the releases made in the transaction.
struct MemoryTransaction {
    store: MemoryStore,
    rival: Mutex<Option<(Identity, OwnerToken)>>,
    releases: u32,
}

#[async_trait::async_trait]
impl TransactionalConnection for MemoryTransaction {
    fn store_name(&self) -> &'static str {
        "memory"
    }

    async fn in_transaction(&mut self) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn reserve_in_transaction(
        &mut self,
        request: ReserveRequest<'_>,
        _lock_wait: Duration,
    ) -> Result<Reservation, Error> {
        let answer = self.store.reserve(request).await?;
        if answer == Reservation::FingerprintMismatch {
            let rival = self.rival.lock().unwrap().take();
            if let Some((identity, token)) = rival {
                assert_eq!(
                    self.store.release(&identity, &token).await?,
                    Fenced::Written
                );
            }
        }
        Ok(answer)
    }

    async fn complete_in_transaction(
        &mut self,
        completion: Completion<'_>,
    ) -> Result<Fenced, StoreError> {
        self.store.complete(completion).await
    }

    async fn release_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<Fenced, StoreError> {
        self.releases += 1;
        self.store.release(identity, token).await
    }

    async fn end_lease_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<Fenced, StoreError> {
        self.store.heartbeat(identity, token, Duration::ZERO).await
    }
}

#[idempotent(scope = "contract_edges.legacy_tx", key = key, tenant = tenant, tx = tx)]
async fn subscribe_in_transaction(
    tx: &mut MemoryTransaction,
    tenant: &str,
    key: &str,
    topics: HashSet<u32, RandomState>,
) -> Result<usize, Error> {
    Ok(topics.len())
}

/// Rule 6 in transactional mode: the record a mismatch's legacy retry
/// creates, because the conflicting record went away between the two
/// statements, is freed in the caller's transaction and made again with
/// the current fingerprint, so a retry of the same request (the same set
/// in another iteration order) replays it instead of being refused.
#[tokio::test]
async fn in_a_transaction_a_record_made_after_a_legacy_retry_carries_the_current_fingerprint() {
    let mut tx = MemoryTransaction {
        store: MemoryStore::new(),
        rival: Mutex::new(None),
        releases: 0,
    };
    let id = Identity::new("t-tx", "contract_edges.legacy_tx", "k-tx").unwrap();
    let rival_fp = Fingerprint::of(&"other arguments").unwrap();
    let rival_token = crate::common::records::acquire(
        &tx.store,
        &id,
        Some(&rival_fp),
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
    .await;
    *tx.rival.lock().unwrap() = Some((id.clone(), rival_token));

    let first = topics();
    let answer = subscribe_in_transaction(&mut tx, "t-tx", "k-tx", first.clone()).await;
    assert!(matches!(answer, Ok(32)), "{answer:?}");
    assert!(
        tx.rival.lock().unwrap().is_none(),
        "the rival's record went away after the first mismatch"
    );
    assert_eq!(
        tx.releases, 1,
        "the record the legacy retry made was freed in the transaction"
    );
    let stored = tx.store.fetch(&id).await.unwrap().unwrap();
    assert_eq!(stored.state, RecordState::Complete);
    assert_eq!(
        stored.fingerprint.as_deref(),
        Some(fingerprint_of_topics(&first).as_str()),
        "the record carries the current fingerprint, not the legacy one"
    );

    // The same request again, the set iterated in another order: a replay.
    let again = (0..100)
        .map(|_| topics())
        .find(|s| s.iter().ne(first.iter()))
        .expect("another iteration order");
    let retry = subscribe_in_transaction(&mut tx, "t-tx", "k-tx", again).await;
    assert!(
        matches!(retry, Ok(32)),
        "a legitimate retry was refused: {retry:?}"
    );
    assert_eq!(
        with_outcome(subscribe_in_transaction(&mut tx, "t-tx", "k-tx", topics()))
            .await
            .1,
        Some(Outcome::Replayed)
    );
}
