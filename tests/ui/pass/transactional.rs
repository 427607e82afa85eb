// `tx = tx`: reservation and completion go through the caller's connection,
// and the connection is usable again after the body. The connection here is a
// test-only stand-in over MemoryStore (the SQL stores provide real ones).
use idempotent_runtime::__private::TransactionalConnection;
use idempotent_runtime::error::StoreError;
use idempotent_runtime::{AnsweredBy, Fenced, 
    idempotent, Error, Identity, MemoryStore, OwnerToken, Reservation, ReserveRequest, Store,
    StoredOutcome,
};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// What `futures::future::BoxFuture` is.
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub struct FakeTx {
    store: MemoryStore,
    statements: u32,
}

// What `#[async_trait]` would generate.
impl TransactionalConnection for FakeTx {
    fn store_name(&self) -> &'static str {
        "fake"
    }

    fn in_transaction<'a, 't>(&'a mut self) -> BoxFuture<'t, Result<bool, StoreError>>
    where
        'a: 't,
        Self: 't,
    {
        Box::pin(async { Ok(true) })
    }

    fn reserve_in_transaction<'a, 'b, 't>(
        &'a mut self,
        request: ReserveRequest<'b>,
        _lock_wait: Duration,
    ) -> BoxFuture<'t, Result<Reservation, Error>>
    where
        'a: 't,
        'b: 't,
        Self: 't,
    {
        Box::pin(async move {
            self.statements += 1;
            Ok(self.store.reserve(request).await?)
        })
    }

    fn complete_in_transaction<'a, 'b, 'c, 'd, 't>(
        &'a mut self,
        identity: &'b Identity,
        token: &'c OwnerToken,
        outcome: &'d StoredOutcome,
        ttl: Duration,
        by: AnsweredBy,
    ) -> BoxFuture<'t, Result<Fenced, StoreError>>
    where
        'a: 't,
        'b: 't,
        'c: 't,
        'd: 't,
        Self: 't,
    {
        Box::pin(async move {
            self.statements += 1;
            self.store.complete(identity, token, outcome, ttl, by).await
        })
    }

    fn release_in_transaction<'a, 'b, 'c, 't>(
        &'a mut self,
        identity: &'b Identity,
        token: &'c OwnerToken,
    ) -> BoxFuture<'t, Result<Fenced, StoreError>>
    where
        'a: 't,
        'b: 't,
        'c: 't,
        Self: 't,
    {
        Box::pin(async move {
            self.statements += 1;
            self.store.release(identity, token).await
        })
    }
}

#[idempotent(scope = "orders.place", key = key, tenant = tenant, tx = tx)]
pub async fn place(tx: &mut FakeTx, tenant: &str, key: &str, amount: u64) -> Result<u64, Error> {
    tx.statements += 100; // the body uses the transaction too
    Ok(amount)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut tx = FakeTx {
        store: MemoryStore::new(),
        statements: 0,
    };
    assert_eq!(place(&mut tx, "t", "k", 3).await.unwrap(), 3);
    assert_eq!(tx.statements, 102); // reserve + body + complete
    assert_eq!(place(&mut tx, "t", "k", 3).await.unwrap(), 3); // replayed
    assert_eq!(tx.statements, 103); // one reserve answered it; the body did not run
    assert!(matches!(
        place(&mut tx, "t", "k", 4).await,
        Err(Error::FingerprintMismatch(_))
    ));
    tx.statements = 0; // still ours after the calls
}
