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
    count_answer, failure_outcome, hook_answer, record_unrecorded_answer, replay, reserve,
    reserve_label, reserve_request, settle, within_a_runtime, ErrorHandling, IdempotentReturn,
    RecordSink, Recover, Reserved, Reserver,
};
use crate::error::{Error, StoreError};
use crate::fingerprint::Fingerprint;
use crate::identity::Identity;
use crate::metrics::CallOutcome;
use crate::registry::ScopeInfo;
use crate::store::{
    Answer, AnsweredBy, Completion, Fenced, OwnerToken, Reservation, ReserveRequest,
};
use futures_util::future::BoxFuture;
use std::future::Future;
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

    /// Whether a duplicate that waits (`in_progress = wait(...)`) may ask
    /// again in this transaction after a reservation answered `InProgress`
    /// for a record another session committed in progress (a store-mode
    /// owner's). Only where every statement sees what others committed since,
    /// and an in-progress answer leaves no lock behind: otherwise asking again
    /// cannot see the owner finish (the transaction's snapshot is older), and
    /// a lock the look took (InnoDB keeps the locks of a failed write until
    /// commit) would keep the owner from renewing its lease, so a later look
    /// could take the record over beside the live owner. The default, `false`,
    /// refuses the duplicate at once with `Error::InProgress` (its
    /// `retry_after` is the lease left), so the caller ends the transaction
    /// and retries in a new one. A duplicate of an owner whose transaction is
    /// still open waits on its row lock either way, within the one statement.
    async fn may_wait_in_transaction(&mut self) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// The largest answer (serialized bytes) this connection can record, as
    /// [`Store::max_result_bytes`](crate::Store::max_result_bytes). Asked
    /// only for an answer larger than 64 KiB. The default is
    /// [`MAX_RESULT_BYTES`](crate::MAX_RESULT_BYTES); MySQL reads the
    /// session's `max_allowed_packet`. A connection type that wraps another
    /// must forward this method too.
    async fn max_result_bytes_in_transaction(&mut self) -> Result<usize, StoreError> {
        Ok(crate::engine::MAX_RESULT_BYTES)
    }

    /// What tells the database this connection's records are in apart from
    /// any other, as [`Store::database_id`](crate::Store::database_id) (the
    /// same text for a store and a connection on one database). Asked only
    /// when a call takes a record over while this process holds an answer
    /// of its request unrecorded: the answer is recorded only on the
    /// database it was given for. The default, `None`, names no database:
    /// answers held for a built-in store's records (each names its
    /// database) are not recorded through such a connection, whose
    /// takeovers ask their `recover` hook or run the body. An error (a
    /// session that may not read it) names no database too, as for a store
    /// that could not read it when it opened: such a store's answers are
    /// matched by its transactions'. A connection type that wraps another
    /// must forward this method too.
    async fn database_id_in_transaction(&mut self) -> Result<Option<String>, StoreError> {
        Ok(None)
    }

    /// Like [`Store::complete`](crate::Store::complete), in this transaction
    /// (`by`: the body's answer, or a `recover` hook's, marked recovered).
    async fn complete_in_transaction(
        &mut self,
        completion: Completion<'_>,
    ) -> Result<Fenced, StoreError>;

    /// Like [`Store::release`](crate::Store::release), in this transaction.
    async fn release_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<Fenced, StoreError>;

    /// Ends the lease of the record `token` owns, in this transaction, and
    /// keeps the record in progress (a [`Store::heartbeat`](crate::Store::heartbeat)
    /// with a zero lease): used when a `recover` hook's answer is not
    /// recorded, so the next call takes the record over at once and asks
    /// again (rule 20) instead of waiting out the takeover's lease.
    async fn end_lease_in_transaction(
        &mut self,
        identity: &Identity,
        token: &OwnerToken,
    ) -> Result<Fenced, StoreError>;
}

/// Implements [`TransactionalConnection`] for a SQL store's sqlx connection
/// type from the store's own functions, so every store maps the trait the
/// same way: `in_transaction(conn)` tells an open transaction,
/// `reserve(conn, request, lock_wait)` reserves in it, and the store's fenced
/// writes, `complete(conn, completion)`, `release(conn, identity, token)` and
/// `heartbeat(conn, identity, token, lease)` (the ones it also runs on its
/// pool), record, release or end the lease on the connection itself;
/// `database_id(conn)` reads what the store reads when it opens.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! transactional_connection {
    (
        $(#[$attr:meta])*
        impl for $conn:ty {
            store: $store:expr,
            in_transaction: $in_transaction:path,
            reserve: $reserve:path,
            complete: $complete:path,
            release: $release:path,
            heartbeat: $heartbeat:path,
            database_id: $database_id:path
            $(, may_wait: $may_wait:path)?
            $(, max_result_bytes: $max_result_bytes:path)? $(,)?
        }
    ) => {
        $(#[$attr])*
        #[async_trait::async_trait]
        impl $crate::transaction::TransactionalConnection for $conn {
            fn store_name(&self) -> &'static str {
                $store
            }

            async fn in_transaction(&mut self) -> Result<bool, $crate::error::StoreError> {
                $in_transaction(self).await
            }

            async fn reserve_in_transaction(
                &mut self,
                request: $crate::store::ReserveRequest<'_>,
                lock_wait: std::time::Duration,
            ) -> Result<$crate::store::Reservation, $crate::error::Error> {
                // An owner of this record, at work in this process, whose
                // lease may have run out while one of its writes waits: the
                // caller's transaction may hold the connection of the pool
                // it waits for (the application's pool given to the store,
                // every connection of it held by open transactions), so the
                // lease may have run out because of it. Taking the record
                // over would run the body beside the live owner (rules 3,
                // 10); refused before anything is written, no round trip.
                let kept = $crate::store::live_owners::may_be_kept_from_writing(request.identity);
                if !kept.is_empty()
                    && $crate::store::live_owners::kept_in(
                        &kept,
                        // Only now: which database the caller's connection
                        // is on (one identity's owners in other databases
                        // are not this record's); not known, it may be any.
                        $database_id(self).await.ok().flatten().as_deref(),
                    )
                {
                    let id = request.identity;
                    tracing::warn!(target: "idempotent", scope = %id.scope, key = %id.key_digest(),
                        "refused: an in-progress record's owner, at work in this process, is still writing (perhaps waiting for a connection the caller's transaction holds) and its lease may have run out; not taken over");
                    return Err($crate::error::Error::StaleSnapshot {
                        scope: id.scope.clone(),
                        store: $store,
                    });
                }
                $reserve(self, request, lock_wait).await
            }

            async fn database_id_in_transaction(
                &mut self,
            ) -> Result<Option<String>, $crate::error::StoreError> {
                $database_id(self).await
            }

            $(
                async fn may_wait_in_transaction(
                    &mut self,
                ) -> Result<bool, $crate::error::StoreError> {
                    $may_wait(self).await
                }
            )?

            $(
                async fn max_result_bytes_in_transaction(
                    &mut self,
                ) -> Result<usize, $crate::error::StoreError> {
                    $max_result_bytes(self).await
                }
            )?

            async fn complete_in_transaction(
                &mut self,
                completion: $crate::store::Completion<'_>,
            ) -> Result<$crate::store::Fenced, $crate::error::StoreError> {
                $complete(self, completion).await
            }

            async fn release_in_transaction(
                &mut self,
                identity: &$crate::identity::Identity,
                token: &$crate::store::OwnerToken,
            ) -> Result<$crate::store::Fenced, $crate::error::StoreError> {
                $release(self, identity, token).await
            }

            async fn end_lease_in_transaction(
                &mut self,
                identity: &$crate::identity::Identity,
                token: &$crate::store::OwnerToken,
            ) -> Result<$crate::store::Fenced, $crate::error::StoreError> {
                $heartbeat(self, identity, token, std::time::Duration::ZERO).await
            }
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) use transactional_connection;

/// Implements [`TransactionalConnection`] for `sqlx::Transaction` from the
/// methods' signatures: each one (those with a default included) is the
/// transaction's connection's (`**self`).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! forward_to_the_connection {
    ($(async fn $method:ident(&mut self $(, $arg:ident: $ty:ty)*) -> $out:ty;)*) => {
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

            $(async fn $method(&mut self $(, $arg: $ty)*) -> $out {
                (**self).$method($($arg),*).await
            })*
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
forward_to_the_connection! {
    async fn in_transaction(&mut self) -> Result<bool, StoreError>;
    async fn reserve_in_transaction(&mut self, request: ReserveRequest<'_>, lock_wait: Duration) -> Result<Reservation, Error>;
    async fn may_wait_in_transaction(&mut self) -> Result<bool, StoreError>;
    async fn max_result_bytes_in_transaction(&mut self) -> Result<usize, StoreError>;
    async fn database_id_in_transaction(&mut self) -> Result<Option<String>, StoreError>;
    async fn complete_in_transaction(&mut self, completion: Completion<'_>) -> Result<Fenced, StoreError>;
    async fn release_in_transaction(&mut self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError>;
    async fn end_lease_in_transaction(&mut self, identity: &Identity, token: &OwnerToken) -> Result<Fenced, StoreError>;
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

    fn release_acquired<'a>(
        &'a mut self,
        identity: &'a Identity,
        token: &'a OwnerToken,
    ) -> futures_util::future::BoxFuture<'a, Result<Fenced, Error>> {
        Box::pin(async move { Ok(self.0.release_in_transaction(identity, token).await?) })
    }

    fn may_wait<'a>(&'a mut self) -> futures_util::future::BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move { Ok(self.0.may_wait_in_transaction().await?) })
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
    /// Times the body for its duration's histogram.
    body_timer: BodyTimer,
}

/// Times a transactional call's body, as store mode does: `ok` or `err` when
/// it answers ([`finish`](Self::finish)), `panic` when the body itself
/// panicked ([`in_span`]); a call dropped mid-way records nothing.
#[derive(Clone, Copy)]
struct BodyTimer {
    scope: &'static str,
    started: std::time::Instant,
}

impl BodyTimer {
    fn start(scope: &'static str) -> Self {
        BodyTimer {
            scope,
            started: std::time::Instant::now(),
        }
    }

    fn finish(self, outcome: &'static str) {
        crate::metrics::body_time(self.scope, outcome, self.started.elapsed());
    }
}

/// Runs the body of a transactional call inside the call's tracing span; a
/// panic of the body is timed as `panic`, and goes on unwinding.
pub fn in_span<F: Future>(held: &HeldInTransaction, body: F) -> impl Future<Output = F::Output> {
    let timer = held.body_timer;
    let body = std::panic::AssertUnwindSafe(body.instrument(held.span.clone()));
    async move {
        match futures_util::FutureExt::catch_unwind(body).await {
            Ok(answer) => answer,
            Err(panic) => {
                timer.finish("panic");
                std::panic::resume_unwind(panic)
            }
        }
    }
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
/// record in progress with its lease ended, in the caller's transaction (the
/// next call takes it over at once and asks again), never deleted.
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
    crate::registry::report_conflicts_once();
    let spec = call.spec;
    let span = tracing::info_span!(target: "idempotent", "idempotent_call",
        scope = spec.scope, key = tracing::field::Empty, store = connection.store_name(),
        attempt = tracing::field::Empty, outcome = tracing::field::Empty, transactional = true);
    let steps = async {
        let fail = |e: Error| {
            let outcome = failure_outcome(&e);
            early::<R>(spec, &span, Err(e.into()), outcome)
        };
        if let Err(e) = within_a_runtime(spec) {
            return fail(e);
        }
        let prepared = call.identity.and_then(|id| Ok((id, call.fingerprint?)));
        let (identity, fingerprint) = match prepared {
            Ok(v) => v,
            Err(e) => return fail(e),
        };
        if !span.is_disabled() {
            span.record("key", identity.key_digest().as_str());
        }
        match connection.in_transaction().await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.log_digest(),
                    "refused: tx = ... was given a connection that is not inside a transaction");
                return fail(Error::NotInTransaction {
                    scope: spec.scope.to_owned(),
                    store: connection.store_name(),
                });
            }
            Err(e) => return fail(Error::Store(e)),
        }
        let token = OwnerToken::new();
        let request = reserve_request(spec, &identity, fingerprint.as_ref(), &token);
        let reserving = std::time::Instant::now();
        let reserved = reserve(InTransaction(&mut *connection), request, spec, None).await;
        crate::metrics::reserve_time(spec.scope, reserve_label(&reserved), reserving.elapsed());
        let acquired = match reserved {
            Ok(Reserved::Acquired(acquired)) => acquired,
            Ok(Reserved::Replay(outcome)) => {
                let (replayed, outcome) =
                    replay::<R, H>(spec, errors, &identity, connection.store_name(), outcome);
                return early::<R>(spec, &span, replayed, outcome);
            }
            Err(e) => return fail(e),
        };
        span.record("attempt", acquired.attempt);
        // The connection's database is read (a statement in the caller's
        // transaction) only when this process holds an answer of the identity.
        let database = if acquired.took_over && crate::unrecorded::holds_any(&identity) {
            match connection.database_id_in_transaction().await {
                Ok(database) => Some(database),
                Err(e) => {
                    // A session that may not read it names no database, as a
                    // store opened by one does (`Store::database_id`): an
                    // application whose role was granted the records table
                    // alone has its store and its transactions name none, so
                    // its transactions' takeovers still record its store's held
                    // answers (matched by the store's kind alone) instead of
                    // running the body again.
                    tracing::warn!(target: "idempotent", scope = spec.scope, key = %identity.log_digest(),
                        error = %e, "could not read which database the connection is on; \
                                     an answer this process holds for the key is matched by the \
                                     store's kind alone: grant SELECT on idempotency_database to \
                                     tell two databases apart");
                    Some(None)
                }
            }
        } else {
            None
        };
        let known = database.and_then(|database| {
            let request = crate::unrecorded::Request::new(
                (connection.store_name(), database.as_deref()),
                fingerprint.as_ref(),
            );
            crate::unrecorded::for_takeover(&identity, &request).map(|known| (known, request))
        });
        let takeover = acquired.takeover(spec, &identity, known.is_some());
        if let Some((known, request)) = known {
            let mut sink = TransactionSink {
                connection,
                identity: &identity,
                token: &token,
            };
            // Written in the caller's transaction, which may yet roll back.
            let answered = record_unrecorded_answer::<R, H>(
                spec,
                (errors, &identity, &request),
                &mut sink,
                known,
                false,
            )
            .await;
            return early::<R>(spec, &span, answered.0, answered.1);
        }
        if let Some(takeover) = takeover
            && let Some(hook) = recover.ask(takeover)
            && let Some(result) = hook_answer(hook.await)
        {
            count_answer(AnsweredBy::RecoverHook);
            let mut sink = TransactionSink {
                connection,
                identity: &identity,
                token: &token,
            };
            let (result, outcome) = settle::<R, H>(
                spec,
                &identity,
                &mut sink,
                errors,
                result,
                AnsweredBy::RecoverHook,
            )
            .await;
            return early::<R>(spec, &span, result, outcome);
        }
        TransactionStep::Run(HeldInTransaction {
            spec,
            identity,
            token,
            span: span.clone(),
            body_timer: BodyTimer::start(spec.scope),
        })
    };
    steps.instrument(span.clone()).await
}

/// Transactional mode's [`RecordSink`]: writes in the caller's transaction.
/// Nothing is finished on drop: a transaction that is not committed takes
/// the reservation with it.
struct TransactionSink<'c, C: ?Sized> {
    connection: &'c mut C,
    identity: &'c Identity,
    token: &'c OwnerToken,
}

impl<C: TransactionalConnection + ?Sized> RecordSink for TransactionSink<'_, C> {
    fn known_limit(&self) -> Option<usize> {
        None
    }

    fn store_name(&self) -> &'static str {
        self.connection.store_name()
    }

    fn ask_limit(&mut self) -> BoxFuture<'_, Result<usize, crate::error::StoreError>> {
        self.connection.max_result_bytes_in_transaction()
    }

    fn release(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            // The key is free whether the caller commits or rolls back.
            self.connection
                .release_in_transaction(self.identity, self.token)
                .await
                .map(|_| ())
                .map_err(Error::Store)
        })
    }

    fn keep_for_takeover(&mut self) -> BoxFuture<'_, ()> {
        // The record stays in progress with its lease ended, in the caller's
        // transaction: once it commits, the next call takes the record over
        // at once and asks the hook again (a rollback undoes the takeover
        // too). Not ended, the takeover's fresh lease would refuse every
        // retry for a whole lease.
        Box::pin(async move {
            let (identity, token) = (self.identity, self.token);
            match self
                .connection
                .end_lease_in_transaction(identity, token)
                .await
            {
                Ok(Fenced::Written) => {}
                Ok(Fenced::NotOwner) => {
                    tracing::warn!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(),
                        "ending the lease found the record owned by someone else; left it alone");
                }
                Err(e) => {
                    tracing::error!(target: "idempotent", scope = %identity.scope, key = %identity.log_digest(), error = %e,
                        "ending the lease in the caller's transaction failed; the record stays in \
                         progress until its lease runs out");
                }
            }
        })
    }

    fn record(&mut self, answer: Answer) -> BoxFuture<'_, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let completion = answer.completing(self.identity, self.token);
            self.connection.complete_in_transaction(completion).await
        })
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
    let steps = async {
        let HeldInTransaction {
            spec,
            identity,
            token,
            body_timer,
            ..
        } = held;
        let result = result.into_result();
        body_timer.finish(if result.is_ok() { "ok" } else { "err" });
        count_answer(AnsweredBy::Body);
        let mut sink = TransactionSink {
            connection,
            identity: &identity,
            token: &token,
        };
        settle::<R, H>(spec, &identity, &mut sink, errors, result, AnsweredBy::Body).await
    };
    let (result, outcome) = steps.instrument(span.clone()).await;
    crate::metrics::call(scope, outcome);
    span.record("outcome", outcome.as_str());
    R::from_result(result)
}
