//! A store that can record less than `MAX_RESULT_BYTES` (a MySQL server's
//! `max_allowed_packet`): a larger answer is refused before it is written,
//! with the store's own limit, and the key is released, as for any answer
//! too large to record; one within the limit is recorded and replayed. The
//! same in transactional mode, where the connection is asked.

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Fenced, Identity, MemoryStore, Outcome,
    OwnerToken, Reservation, ReserveRequest, Store, StoreError, TransactionalConnection,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A store that records answers of at most 100 000 bytes.
struct SmallAnswers;

impl Intercept for SmallAnswers {
    fn max_result_bytes(&self, _: &MemoryStore) -> usize {
        100_000
    }
}

#[idempotent(scope = "faults.small_answers", key = key, tenant = shared, store = store, skip(runs))]
async fn answer(
    store: &dyn Store,
    key: &str,
    bytes: usize,
    runs: &AtomicUsize,
) -> Result<String, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok("x".repeat(bytes))
}

/// A store that records answers of at most 1000 bytes: a store's limit is
/// known without asking anyone, so every answer is held to it, also a small one.
struct TinyAnswers;

impl Intercept for TinyAnswers {
    fn max_result_bytes(&self, _: &MemoryStore) -> usize {
        1000
    }
}

#[tokio::test]
async fn a_small_answer_over_a_small_stores_limit_is_refused_too() {
    let store = Hooked::new(TinyAnswers);
    let runs = AtomicUsize::new(0);
    match answer(&store, "small", 2000, &runs).await {
        Err(Error::ResultTooLarge { limit, .. }) => assert_eq!(limit, 1000),
        other => panic!("expected ResultTooLarge, got {:?}", other.map(|s| s.len())),
    }
    let id = Identity::shared("faults.small_answers", "small").expect("identity");
    assert_eq!(store.fetch(&id).await.expect("fetch"), None, "released");
}

#[tokio::test]
async fn an_answer_over_the_stores_limit_is_refused_before_it_is_written() {
    let store = Hooked::new(SmallAnswers);
    let runs = AtomicUsize::new(0);
    match answer(&store, "big", 200_000, &runs).await {
        Err(Error::ResultTooLarge { size, limit, .. }) => {
            assert_eq!(limit, 100_000, "the store's limit");
            assert!(size > limit);
        }
        other => panic!("expected ResultTooLarge, got {other:?}"),
    }
    let id = Identity::shared("faults.small_answers", "big").expect("identity");
    assert_eq!(store.fetch(&id).await.expect("fetch"), None, "released");
    assert!(answer(&store, "big", 200_000, &runs).await.is_err());
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the key was free again");

    let (first, o) = with_outcome(answer(&store, "small", 70_000, &runs)).await;
    assert_eq!(
        (first.expect("recorded").len(), o),
        (70_000, Some(Outcome::Executed))
    );
    let (again, o) = with_outcome(answer(&store, "small", 70_000, &runs)).await;
    assert_eq!(
        (again.expect("replayed").len(), o),
        (70_000, Some(Outcome::Replayed))
    );
}

/// Transactional mode on a test connection (over a memory store) that can
/// record answers of at most 100 000 bytes.
struct SmallTx {
    store: MemoryStore,
}

#[async_trait::async_trait]
impl TransactionalConnection for SmallTx {
    fn store_name(&self) -> &'static str {
        "small"
    }
    async fn in_transaction(&mut self) -> Result<bool, StoreError> {
        Ok(true)
    }
    async fn reserve_in_transaction(
        &mut self,
        request: ReserveRequest<'_>,
        _: Duration,
    ) -> Result<Reservation, Error> {
        Ok(self.store.reserve(request).await?)
    }
    async fn max_result_bytes_in_transaction(&mut self) -> Result<usize, StoreError> {
        Ok(100_000)
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

#[idempotent(scope = "faults.small_tx", key = key, tenant = shared, tx = tx)]
async fn answer_in_tx(tx: &mut SmallTx, key: &str, bytes: usize) -> Result<String, Error> {
    Ok("x".repeat(bytes))
}

/// Transactional mode asks its connection for the limit (a MySQL session's
/// `max_allowed_packet`) when an answer is large, and refuses a larger one
/// before the write, releasing the reservation in the transaction.
#[tokio::test]
async fn transactional_mode_refuses_an_answer_over_its_connections_limit() {
    let mut tx = SmallTx {
        store: MemoryStore::new(),
    };
    match answer_in_tx(&mut tx, "big", 200_000).await {
        Err(Error::ResultTooLarge { size, limit, .. }) => {
            assert_eq!(limit, 100_000, "the connection's limit");
            assert!(size > limit);
        }
        other => panic!("expected ResultTooLarge, got {:?}", other.map(|s| s.len())),
    }
    let id = Identity::shared("faults.small_tx", "big").expect("identity");
    assert_eq!(tx.store.fetch(&id).await.expect("fetch"), None, "released");
    let (first, o) = with_outcome(answer_in_tx(&mut tx, "within", 70_000)).await;
    assert_eq!(
        (first.expect("recorded").len(), o),
        (70_000, Some(Outcome::Executed))
    );
    let (again, o) = with_outcome(answer_in_tx(&mut tx, "within", 70_000)).await;
    assert_eq!(
        (again.expect("replayed").len(), o),
        (70_000, Some(Outcome::Replayed))
    );
}

#[idempotent(scope = "faults.mysql_tx_answer", key = key, tenant = tenant, tx = tx)]
async fn answer_in_mysql_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    tenant: &str,
    key: &str,
    bytes: usize,
) -> Result<String, Error> {
    Ok("x".repeat(bytes))
}

/// On MariaDB, a large answer in transactional mode reads the session's
/// `max_allowed_packet` and, within it, is recorded and replayed.
#[tokio::test]
async fn a_large_answer_in_a_mysql_transaction_within_the_servers_limit_is_recorded() {
    let Some(store) = crate::common::servers::mysql_store_or_skip().await else {
        return;
    };
    let tenant = crate::common::servers::fresh_tenant();
    for expected in [Outcome::Executed, Outcome::Replayed] {
        let mut tx = store.pool().begin().await.expect("begin");
        let (got, o) = with_outcome(answer_in_mysql_tx(&mut tx, &tenant, "k", 1 << 20)).await;
        tx.commit().await.expect("commit");
        assert_eq!((got.expect("answer").len(), o), (1 << 20, Some(expected)));
    }
}
