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
    decode_replay, failure_outcome, note_takeover, outcome_to_record, report, reserve,
    ErrorHandling, IdempotentReturn, Outcome, Recover, Reserved, Reserver,
};
use crate::error::{Error, StoreError};
use crate::fingerprint::Fingerprint;
use crate::identity::Identity;
use crate::metrics::{CallOutcome, METRICS};
use crate::recovery::{Recovery, Takeover};
use crate::registry::ScopeInfo;
use crate::store::{OwnerToken, Reservation, ReserveRequest, StoredOutcome};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tracing::Instrument;

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

    /// Like [`Store::complete_recovered`](crate::Store::complete_recovered),
    /// in this transaction: records a `recover` hook's answer (rule 20). The
    /// default records it like any outcome, without the recovered mark.
    async fn complete_recovered_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.complete_in_transaction(identity, token, outcome, ttl)
            .await
    }
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

    async fn complete_recovered_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        (**self)
            .complete_recovered_in_transaction(identity, token, outcome, ttl)
            .await
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
    span: tracing::Span,
}

/// Runs the body of a transactional call inside the call's tracing span.
pub fn in_span<F: Future>(
    held: &HeldInTransaction,
    body: F,
) -> tracing::instrument::Instrumented<F> {
    body.instrument(held.span.clone())
}

/// Ends a transactional call early: counts it and closes its span's outcome.
fn early<R: IdempotentReturn>(
    spec: &'static ScopeInfo,
    span: &tracing::Span,
    result: Result<R::Value, R::Failure>,
    outcome: CallOutcome,
) -> TransactionStep<R> {
    crate::metrics::call(spec.scope, outcome);
    span.record("outcome", outcome.as_str());
    TransactionStep::Return(R::from_result(result))
}

/// The first half of a transactional call.
pub enum TransactionStep<R> {
    /// Return this at once (a replay, or a refusal); the body must not run.
    Return(R),
    /// Run the body, then pass its result to [`finish_in_transaction`].
    Run(HeldInTransaction),
}

/// Reserves in the caller's transaction. On a takeover (rule 20) the
/// `recover` hook, if any, is asked here; its answer is recorded in the
/// transaction like a body's. A hook error that is not recorded leaves the
/// record as the takeover wrote it (its lease runs out; the next call asks
/// again), never deleted.
pub async fn begin_in_transaction<R, H, K, C>(
    call: TransactionalCall,
    errors: &H,
    recover: K,
    connection: &mut C,
) -> TransactionStep<R>
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
    K: Recover<R::Value, R::Failure>,
    C: TransactionalConnection + ?Sized,
{
    let spec = call.spec;
    let span = tracing::info_span!(target: "idempotent", "idempotent_call",
        scope = spec.scope, key = tracing::field::Empty, store = connection.store_name(),
        attempt = tracing::field::Empty, outcome = tracing::field::Empty, transactional = true);
    begin_inner(call, errors, recover, connection, span.clone())
        .instrument(span)
        .await
}

async fn begin_inner<R, H, K, C>(
    call: TransactionalCall,
    errors: &H,
    recover: K,
    connection: &mut C,
    span: tracing::Span,
) -> TransactionStep<R>
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
    K: Recover<R::Value, R::Failure>,
    C: TransactionalConnection + ?Sized,
{
    let spec = call.spec;
    let fail = |e: Error| {
        let outcome = failure_outcome(&e);
        early::<R>(spec, &span, Err(e.into()), outcome)
    };
    let prepared = call.identity.and_then(|id| Ok((id, call.fingerprint?)));
    let (identity, fingerprint) = match prepared {
        Ok(v) => v,
        Err(e) => return fail(e),
    };
    span.record("key", identity.key_digest().as_str());
    match connection.in_transaction().await {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.key_digest(),
                "refused: tx = ... was given a connection that is not inside a transaction");
            return fail(Error::NotInTransaction {
                scope: spec.scope.to_owned(),
                store: connection.store_name(),
            });
        }
        Err(e) => return fail(Error::Store(e)),
    }
    let token = OwnerToken::new();
    let request = ReserveRequest {
        identity: &identity,
        fingerprint: fingerprint.as_ref(),
        token: &token,
        lease: spec.lease,
        ttl: spec.ttl,
    };
    let acquired = match reserve(InTransaction(&mut *connection), request, spec, None).await {
        Ok(Reserved::Acquired(acquired)) => acquired,
        Ok(Reserved::Replay(outcome)) => {
            METRICS.replayed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(target: "idempotent", scope = spec.scope, key = %identity.key_digest(), "replayed (transactional)");
            report(Outcome::Replayed);
            let replay = decode_replay::<R, H>(spec, errors, outcome);
            return early::<R>(spec, &span, replay, CallOutcome::Replayed);
        }
        Err(e) => return fail(e),
    };
    span.record("attempt", acquired.attempt);
    if acquired.took_over {
        note_takeover(
            spec,
            &identity,
            acquired.attempt,
            acquired.previous_started_ms,
        );
        let takeover = Takeover::from_store(
            identity.clone(),
            acquired.attempt,
            acquired.previous_started_ms.unwrap_or(0),
        );
        if let Some(hook) = recover.ask(takeover) {
            let answer = match hook.await {
                Ok(Recovery::Run) => None,
                Ok(Recovery::Completed(v)) => Some(Ok(v)),
                Err(e) => Some(Err(e)),
            };
            if let Some(result) = answer {
                METRICS.recovered.fetch_add(1, Ordering::Relaxed);
                report(Outcome::Recovered);
                let (result, outcome) = record_recovered::<R, H, C>(
                    spec, errors, connection, &identity, &token, result,
                )
                .await;
                return early::<R>(spec, &span, result, outcome);
            }
        }
    }
    TransactionStep::Run(HeldInTransaction {
        spec,
        identity,
        token,
        span,
    })
}

/// Records a recover hook's answer in the caller's transaction.
async fn record_recovered<R, H, C>(
    spec: &'static ScopeInfo,
    errors: &H,
    connection: &mut C,
    identity: &Identity,
    token: &OwnerToken,
    result: Result<R::Value, R::Failure>,
) -> (Result<R::Value, R::Failure>, CallOutcome)
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
    C: TransactionalConnection + ?Sized,
{
    let stored = match outcome_to_record::<R, H>(spec, &result, errors) {
        Ok(Some(stored)) => stored,
        Ok(None) => {
            tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.key_digest(),
                "the recover hook answered an error that is not recorded; the record stays in progress \
                 so the next call asks the hook again");
            return (result, CallOutcome::Recovered);
        }
        Err(e) => return (Err(e.into()), CallOutcome::Failed),
    };
    match connection
        .complete_recovered_in_transaction(identity, token, &stored, spec.ttl)
        .await
    {
        Ok(true) => (result, CallOutcome::Recovered),
        Ok(false) => (
            Err(Error::LeaseLost(identity.context()).into()),
            CallOutcome::LeaseLost,
        ),
        Err(e) => (Err(Error::Store(e).into()), CallOutcome::Failed),
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
    let (span, scope) = (held.span.clone(), held.spec.scope);
    let (result, outcome) = finish_inner::<R, H, C>(held, errors, connection, result)
        .instrument(span.clone())
        .await;
    crate::metrics::call(scope, outcome);
    span.record("outcome", outcome.as_str());
    R::from_result(result)
}

async fn finish_inner<R, H, C>(
    held: HeldInTransaction,
    errors: &H,
    connection: &mut C,
    result: R,
) -> (Result<R::Value, R::Failure>, CallOutcome)
where
    R: IdempotentReturn,
    H: ErrorHandling<R::Failure>,
    C: TransactionalConnection + ?Sized,
{
    let HeldInTransaction {
        spec,
        identity,
        token,
        ..
    } = held;
    METRICS.executed.fetch_add(1, Ordering::Relaxed);
    report(Outcome::Executed);
    let result = result.into_result();
    let stored = match outcome_to_record::<R, H>(spec, &result, errors) {
        Ok(Some(stored)) => stored,
        refused => {
            // Release: the key is free whether the caller commits or rolls back.
            if let Err(e) = connection.release_in_transaction(&identity, &token).await {
                return (Err(Error::Store(e).into()), CallOutcome::Failed);
            }
            return match refused {
                Err(e) => (Err(e.into()), CallOutcome::Failed),
                Ok(_) => (result, CallOutcome::Executed),
            };
        }
    };
    match connection
        .complete_in_transaction(&identity, &token, &stored, spec.ttl)
        .await
    {
        Ok(true) => (result, CallOutcome::Executed),
        Ok(false) => (
            Err(Error::LeaseLost(identity.context()).into()),
            CallOutcome::LeaseLost,
        ),
        Err(e) => (Err(Error::Store(e).into()), CallOutcome::Failed),
    }
}
