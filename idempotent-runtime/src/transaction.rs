//! Transactional mode (`tx = param`): the reservation and the recorded result
//! are statements in the caller's own transaction, so they commit or roll back
//! together with the business writes.
//!
//! No lease heartbeat runs in this mode: the uncommitted row is locked by the
//! caller's transaction, which is the lease. A concurrent duplicate waits on the
//! row lock (bounded by `in_progress = wait(...)`) or is refused (`reject`).
//! If the process dies, the database rolls the transaction back and the
//! reservation disappears with the business writes.
//!
//! That only holds inside a transaction. On a connection in autocommit mode the
//! reservation would commit at once and nothing would renew its lease, so a
//! body outliving the lease could run twice (DESIGN.md rule 15). Such a call is
//! refused with [`Error::NotInTransaction`] before anything is written.

use crate::engine::{
    decode_replay, outcome_to_record, report, reserve, ErrorHandling, IdempotentReturn, Outcome,
    Reserved, Reserver,
};
use crate::error::{Error, StoreError};
use crate::fingerprint::Fingerprint;
use crate::identity::Identity;
use crate::metrics::METRICS;
use crate::registry::ScopeInfo;
use crate::store::{OwnerToken, Reservation, ReserveRequest, StoredOutcome};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A connection or transaction that can hold idempotency records in the
/// caller's transaction. Implemented for the sqlx connection and transaction
/// types of each SQL store.
#[async_trait::async_trait]
pub trait TransactionalConnection: Send {
    /// The store the records belong to, for messages: `postgres`, `mysql`, `sqlite`.
    fn store_name(&self) -> &'static str;

    /// Whether the connection is inside a transaction now: one begun through
    /// sqlx (`pool.begin()`, `conn.begin()`) or with a plain `BEGIN`.
    async fn in_transaction(&mut self) -> Result<bool, StoreError>;

    /// Like [`Store::reserve`](crate::Store::reserve), in this transaction.
    /// Waits at most `lock_wait` for a row locked by another transaction;
    /// when that runs out, answers `InProgress`. Errors are
    /// [`Error::Store`], or an error saying why this transaction cannot hold
    /// a reservation (e.g. [`Error::StaleSnapshot`] on SQLite).
    async fn reserve_in_transaction(
        &mut self,
        request: ReserveRequest<'_>,
        lock_wait: Duration,
    ) -> Result<Reservation, Error>;

    /// Like [`Store::complete`](crate::Store::complete), in this transaction.
    async fn complete_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError>;

    /// Like [`Store::release`](crate::Store::release), in this transaction.
    async fn release_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<bool, StoreError>;
}

/// A sqlx transaction holds idempotency records wherever its connection can:
/// `tx = tx` works for `&mut sqlx::Transaction<'_, DB>` as well as for the
/// connection itself.
#[async_trait::async_trait]
impl<DB> TransactionalConnection for sqlx::Transaction<'_, DB>
where
    DB: sqlx::Database,
    DB::Connection: TransactionalConnection,
{
    fn store_name(&self) -> &'static str {
        (**self).store_name()
    }

    async fn in_transaction(&mut self) -> Result<bool, StoreError> {
        (**self).in_transaction().await
    }

    async fn reserve_in_transaction(
        &mut self,
        request: ReserveRequest<'_>,
        lock_wait: Duration,
    ) -> Result<Reservation, Error> {
        (**self).reserve_in_transaction(request, lock_wait).await
    }

    async fn complete_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        (**self)
            .complete_in_transaction(identity, token, outcome, ttl)
            .await
    }

    async fn release_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<bool, StoreError> {
        (**self).release_in_transaction(identity, token).await
    }
}

struct InTransaction<'c, C: ?Sized>(&'c mut C);

impl<C: TransactionalConnection + ?Sized> Reserver for InTransaction<'_, C> {
    fn reserve_once<'a>(
        &'a mut self,
        request: ReserveRequest<'a>,
        lock_wait: Duration,
    ) -> futures_util::future::BoxFuture<'a, Result<Reservation, Error>> {
        self.0.reserve_in_transaction(request, lock_wait)
    }
}

/// What the generated code prepares for a transactional call.
pub struct TransactionalCall {
    /// What the attribute declared.
    pub spec: &'static ScopeInfo,
    /// The validated identity.
    pub identity: Result<Identity, Error>,
    /// The arguments' fingerprint.
    pub fingerprint: Result<Option<Fingerprint>, Error>,
}

/// A reservation held in the caller's transaction, waiting for the body's result.
pub struct HeldInTransaction {
    spec: &'static ScopeInfo,
    identity: Identity,
    token: OwnerToken,
}

/// The first half of a transactional call.
pub enum TransactionStep<R> {
    /// Return this at once (a replay, or a refusal); the body must not run.
    Return(R),
    /// Run the body, then pass its result to [`finish_in_transaction`].
    Run(HeldInTransaction),
}

/// Reserves in the caller's transaction.
pub async fn begin_in_transaction<R, H, C>(
    call: TransactionalCall,
    errors: &H,
    connection: &mut C,
) -> TransactionStep<R>
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
    C: TransactionalConnection + ?Sized,
{
    let spec = call.spec;
    let prepared = call.identity.and_then(|id| Ok((id, call.fingerprint?)));
    let (identity, fingerprint) = match prepared {
        Ok(v) => v,
        Err(e) => return TransactionStep::Return(R::from_result(Err(e.into()))),
    };
    match connection.in_transaction().await {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.key_digest(),
                "refused: tx = ... was given a connection that is not inside a transaction");
            return TransactionStep::Return(R::from_result(Err(Error::NotInTransaction {
                scope: spec.scope.to_owned(),
                store: connection.store_name(),
            }
            .into())));
        }
        Err(e) => return TransactionStep::Return(R::from_result(Err(Error::Store(e).into()))),
    }
    let token = OwnerToken::new();
    let request = ReserveRequest {
        identity: &identity,
        fingerprint: fingerprint.as_ref(),
        token: &token,
        lease: spec.lease,
        ttl: spec.ttl,
    };
    match reserve(InTransaction(connection), request, spec, None).await {
        Ok(Reserved::Acquired { .. }) => TransactionStep::Run(HeldInTransaction {
            spec,
            identity,
            token,
        }),
        Ok(Reserved::Replay(outcome)) => {
            METRICS.replayed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(target: "idempotent", scope = spec.scope, key = %identity.key_digest(), "replayed (transactional)");
            report(Outcome::Replayed);
            TransactionStep::Return(R::from_result(decode_replay::<R, H>(spec, errors, outcome)))
        }
        Err(e) => TransactionStep::Return(R::from_result(Err(e.into()))),
    }
}

/// Records the body's result in the caller's transaction (or, for a released
/// error, deletes the reservation) and returns the result.
pub async fn finish_in_transaction<R, H, C>(
    held: HeldInTransaction,
    errors: &H,
    connection: &mut C,
    result: R,
) -> R
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
    C: TransactionalConnection + ?Sized,
{
    let HeldInTransaction {
        spec,
        identity,
        token,
    } = held;
    METRICS.executed.fetch_add(1, Ordering::Relaxed);
    report(Outcome::Executed);
    let result = result.into_result();
    let stored = match outcome_to_record::<R, H>(spec, &result, errors) {
        Ok(Some(stored)) => stored,
        refused => {
            // Release: the key is free whether the caller commits or rolls back.
            if let Err(e) = connection.release_in_transaction(&identity, &token).await {
                return R::from_result(Err(Error::Store(e).into()));
            }
            return R::from_result(match refused {
                Err(e) => Err(e.into()),
                Ok(_) => result,
            });
        }
    };
    match connection
        .complete_in_transaction(&identity, &token, &stored, spec.ttl)
        .await
    {
        Ok(true) => R::from_result(result),
        Ok(false) => R::from_result(Err(Error::LeaseLost(identity.context()).into())),
        Err(e) => R::from_result(Err(Error::Store(e).into())),
    }
}
