//! The one error type every idempotent call can return.

use std::time::Duration;

/// Why a key or a tenant was refused before anything ran.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyProblem {
    /// The value is the empty string.
    #[error("it is empty; send a non-empty value")]
    Empty,
    /// The value is longer than the 255-byte limit.
    #[error("it is {len} bytes long; the limit is {limit} bytes")]
    TooLong {
        /// Length in bytes.
        len: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// The value contains a control character (e.g. NUL, newline, tab).
    #[error("it contains a control character (U+{code:04X}) at byte {position}; control characters are not allowed")]
    ControlCharacter {
        /// Byte offset of the character.
        position: usize,
        /// The character's code point.
        code: u32,
    },
}

/// Where in the store a refusal happened: the scope and a short digest of the
/// (tenant, scope, key) identity. Never the raw key: keys can be guessable
/// secrets and must not leak into logs or error reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordContext {
    /// The scope named in the attribute, e.g. `payments.charge`.
    pub scope: String,
    /// A short hex digest of the identity, the same one the logs carry.
    pub key_digest: String,
}

impl std::fmt::Display for RecordContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "scope `{}`, key digest {}", self.scope, self.key_digest)
    }
}

/// A failure of the backing store (database unreachable, connection killed,
/// migration failed, ...). The message names the store and the operation.
#[derive(Debug, thiserror::Error)]
#[error("{store} store failed while trying to {operation}: {source}{advice}",
        advice = advice_for(.source.as_ref()))]
pub struct StoreError {
    /// Which store: `memory`, `sqlite`, `postgres`, `mysql`.
    pub store: &'static str,
    /// What the store was doing: `reserve`, `complete`, `release`, ...
    pub operation: &'static str,
    /// The underlying error.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

/// What a store failure whose cause the user can act on adds to its
/// message: a SQL store's pool that handed out no connection within its
/// `acquire_timeout` (sqlx says only "pool timed out while waiting for an
/// open connection").
fn advice_for(source: &(dyn std::error::Error + Send + Sync + 'static)) -> &'static str {
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    if let Some(sqlx::Error::PoolTimedOut) = source.downcast_ref::<sqlx::Error>() {
        return NO_CONNECTION_ADVICE;
    }
    let _ = source;
    ""
}

/// [`advice_for`] a pool that handed out no connection in time.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
const NO_CONNECTION_ADVICE: &str = " (no connection of the store's pool came free, or could be \
     opened, within the pool's acquire_timeout: every connection stayed in use, by bodies or \
     transactions holding the pool's connections while calls ran, by duplicates waiting behind a \
     transactional-mode owner, or by more calls at once than the pool has connections; or the \
     server could not be reached. Give the pool more connections (max_connections), hold its \
     connections for less time (a body's transaction, a transactional-mode caller's), or give \
     the store a pool of its own (its connect, not from_pool))";

impl StoreError {
    /// Wraps an underlying error with the store's name and the operation.
    pub fn new(
        store: &'static str,
        operation: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        StoreError {
            store,
            operation,
            source: source.into(),
        }
    }
}

/// Everything an idempotent call can fail with, besides the function's own errors.
///
/// Annotated functions return `Result<T, E>` with `E: From<Error>`, so these
/// arrive in the caller's own error type. The table in the README says what
/// each means for a caller.
///
/// ```
/// use idempotent_runtime::Error;
/// use std::time::Duration;
/// let e = Error::InProgress { scope: "payments.charge".into(), retry_after: Duration::from_secs(2) };
/// assert!(e.to_string().contains("retry after"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The idempotency key was refused before anything ran (HTTP: 400).
    #[error(
        "invalid idempotency key: {0} (a good key is a UUID made once per operation, when the \
         intent was formed, and sent again with every retry)"
    )]
    InvalidKey(KeyProblem),

    /// The tenant value was refused before anything ran (HTTP: 400).
    #[error("invalid tenant: {0}")]
    InvalidTenant(KeyProblem),

    /// The scope of an [`Identity`](crate::Identity) built by hand is longer
    /// than a scope may be (the attribute and the HTTP layer check theirs
    /// before anything runs). A store column keeps scopes of up to `limit`
    /// bytes apart; a longer one could be cut and share a record with another.
    #[error(
        "invalid scope: {len} bytes, more than the {limit} a scope may have; use a shorter \
         name (the attribute refuses such a scope when it compiles)"
    )]
    ScopeTooLong {
        /// The scope's length in bytes.
        len: usize,
        /// The longest scope, in bytes.
        limit: usize,
    },

    /// Another call with the same identity is running and this one did not wait
    /// (or waited its bound). Retry after `retry_after` (HTTP: 409 + Retry-After).
    #[error("a call with the same idempotency key is still in progress in scope `{scope}`; retry after {retry_after:?}")]
    InProgress {
        /// The scope of the call.
        scope: String,
        /// How long until the running call's lease runs out: a sensible moment to retry.
        retry_after: Duration,
    },

    /// The key was used before with different arguments. This is a client bug:
    /// a new operation needs a new key (HTTP: 422). The record is untouched.
    #[error(
        "idempotency key reused with different arguments ({0}); use a new key for a new operation"
    )]
    FingerprintMismatch(RecordContext),

    /// The key's record was made by a newer version of this crate, with a
    /// fingerprint this version cannot compare (during a rolling deploy, or
    /// after a rollback). Nothing ran and the record is untouched. Retry
    /// later with the same key: an instance of the newer version answers it
    /// (HTTP: 503 + `Retry-After`; a message consumer naks the delivery a
    /// few times, then terminates it, see `consumer::Verdict::RecordedByNewerVersion`).
    #[error(
        "the record for this idempotency key ({context}) was made by a newer version of \
         idempotent, whose fingerprint (version `{version}`) this version cannot compare; nothing \
         ran. Retry later with the same key: instances of the newer version answer it (finish \
         the deploy; after a rollback, this version answers so until the record expires)"
    )]
    RecordedByNewerVersion {
        /// Where: the scope and the key's digest.
        context: RecordContext,
        /// The stored fingerprint's version label, e.g. `v3`.
        version: String,
    },

    /// This call's lease ran out while the body ran and another caller took the
    /// record over (or an operator released it: `idempotent release
    /// --even-if-running`); this call's result was not recorded. The work may
    /// have run twice: check the side effects, and give bodies a lease that
    /// covers them.
    #[error("lease lost ({0}): another caller took the record over (its lease had run out: a body, a recover hook or a store write outlasting it, a paused process) or an operator released it, so nothing this call did was recorded and the work may have run twice: check its side effects, and if bodies outlive their lease, give the scope a longer one")]
    LeaseLost(RecordContext),

    /// The store failed. The record is left for a retry to resolve (HTTP: 503).
    #[error(transparent)]
    Store(#[from] StoreError),

    /// A fingerprinted argument could not be serialized.
    #[error("argument `{argument}` could not be fingerprinted: {message}; nothing ran. Fix the value or its Serialize implementation, or leave the argument out with skip({argument}) if it is not part of the request")]
    Fingerprint {
        /// The parameter's name.
        argument: String,
        /// The serializer's message.
        message: String,
    },

    /// The function's result could not be serialized; nothing was recorded and the key was released.
    #[error("the result in scope `{scope}` could not be serialized for recording: {message}; nothing was recorded, and the key was released (a retry runs the body again; for a recover hook's answer the record is kept and the next call asks the hook again): fix the result type's Serialize implementation")]
    ResultEncoding {
        /// The scope of the call.
        scope: String,
        /// The serializer's message.
        message: String,
    },

    /// A recorded result could not be turned back into the function's return
    /// type (the type changed since it was recorded?). The record is kept.
    #[error("the recorded result in scope `{scope}` could not be replayed: {message}; nothing ran and the record is kept. If the result type changed, make the new type read what the old one recorded (#[serde(default)], #[serde(alias)], an untagged enum of both): a new scope, or waiting for the records to expire, runs the body again for calls that already ran")]
    ReplayDecoding {
        /// The scope of the call.
        scope: String,
        /// The deserializer's message.
        message: String,
    },

    /// The serialized result is larger than the store accepts
    /// ([`Store::max_result_bytes`](crate::Store::max_result_bytes)): nothing
    /// was recorded. The body's answer: the key was released, so a retry runs
    /// the body again (with `errors = record`, this error replaces the body's
    /// own). A `recover` hook's answer: the record stays in progress, and the
    /// next call asks the hook again.
    #[error("the result in scope `{scope}` is {size} bytes; the store's limit is {limit} bytes, so nothing was recorded: record a reference (an id) instead of the whole payload")]
    ResultTooLarge {
        /// The scope of the call.
        scope: String,
        /// Serialized size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },

    /// Transactional mode (`tx = ...`) was given a connection that is not inside
    /// a transaction (autocommit). The reservation would commit at once with
    /// nothing renewing its lease, so the call is refused before anything runs.
    #[error("scope `{scope}`: `tx = ...` was given a {store} connection that is not inside a transaction; \
             begin one (`pool.begin()` or `conn.begin()`) and pass it, or leave out `tx = ...` to use store mode")]
    NotInTransaction {
        /// The scope of the call.
        scope: String,
        /// Which store's connection: `postgres`, `mysql`, `sqlite`.
        store: &'static str,
    },

    /// Transactional mode: the caller's transaction can never write this
    /// call's record, because of what it saw before. Nothing ran, and the
    /// transaction is still usable; retrying inside it cannot help, a new
    /// transaction replays the record (or runs the call).
    ///
    /// * SQLite: the transaction read the database before it tried to write,
    ///   and another connection wrote since its snapshot
    ///   (`SQLITE_BUSY_SNAPSHOT`), or, without WAL, another writer waits for
    ///   its read lock; or the record is in progress, its owner a call of
    ///   this process still at work, and the lease ran out while this
    ///   transaction held the database's write lock, which keeps the owner
    ///   from renewing it or recording its result.
    /// * PostgreSQL: the transaction runs at REPEATABLE READ or SERIALIZABLE,
    ///   and writing the record failed with SQLSTATE 40001: another
    ///   transaction committed this record after its snapshot was taken, so
    ///   it can neither see nor write it; or, under SERIALIZABLE, the
    ///   transaction's reads and writes conflict with concurrent
    ///   transactions' (PostgreSQL may then refuse even a key no one has
    ///   recorded).
    /// * Any SQL store: the record is another caller's, in progress, whose
    ///   owner (a store-mode call of this process, still at work) is still
    ///   writing a renewal or its result and its lease may have run out:
    ///   this transaction may hold the connection of the pool that the
    ///   owner waits for (a pool of one connection given to the store, or
    ///   every connection held by open transactions). Taking it over could
    ///   run the body beside the live owner.
    /// * MySQL/MariaDB: the record is another caller's, in progress, and this
    ///   transaction may be what keeps its owner from renewing its lease:
    ///   the lease ran out after the transaction began (its snapshot may
    ///   predate the renewals), or this call had to lock the record (InnoDB
    ///   keeps the lock until the transaction ends). Taking it over could run
    ///   the body beside a live owner.
    #[error("scope `{scope}`: the {store} transaction passed as `tx = ...` cannot write this call's record: {}; \
             nothing ran. Roll it back and retry in a new transaction, and {}",
             stale_snapshot_cause(store), stale_snapshot_advice(store))]
    StaleSnapshot {
        /// The scope of the call.
        scope: String,
        /// Which store's connection: `postgres`, `mysql` or `sqlite`.
        store: &'static str,
    },

    /// The result (or recorded error) would not come back equal from the
    /// store, e.g. it holds a non-finite float, which JSON cannot represent.
    /// Nothing was recorded and the key was released (rule 12).
    #[error("the result in scope `{scope}` cannot be recorded faithfully: {message}; nothing was recorded, and the key was released (a retry runs the body again; for a recover hook's answer the record is kept and the next call asks the hook again): change the type (e.g. Option<f64>, or a string) or its serde attributes")]
    ResultNotFaithful {
        /// The scope of the call.
        scope: String,
        /// What would not survive the round trip, and where.
        message: String,
    },

    /// No `store = ...` was given and no default store was set.
    #[error("no idempotency store for scope `{scope}`: call idempotent_runtime::set_default_store(...) at startup, or pass `store = ...` in the attribute")]
    NoDefaultStore {
        /// The scope of the call.
        scope: String,
    },

    /// The call was polled outside a tokio runtime (e.g. by
    /// `futures::executor::block_on` on a thread of its own), or in one built
    /// without its timer: the lease's heartbeat, a duplicate's wait and the
    /// SQL stores' connections need tokio's timer and I/O. Refused before
    /// anything was reserved or run. (tokio answers a timer made without one
    /// with a panic, which is how it is found: under `panic = "abort"` the
    /// first call on such a runtime ends the process instead.)
    #[error(
        "scope `{scope}`: an idempotent call needs a tokio runtime with its timer and I/O enabled \
             (its lease heartbeat, waits and store connections use them), and this one was polled \
             outside any, or in one without a timer; nothing ran. Call it from within one: \
             #[tokio::main], or a Runtime built with enable_all(), through block_on"
    )]
    NoRuntime {
        /// The scope of the call.
        scope: String,
    },
}

impl Error {
    /// The answer this error is about can never be recorded, whatever the
    /// store does (`ResultNotFaithful`, `ResultTooLarge`, `ResultEncoding`):
    /// a limit of the value, not a failure of the store.
    pub(crate) fn answer_can_never_be_recorded(&self) -> bool {
        matches!(
            self,
            Error::ResultNotFaithful { .. }
                | Error::ResultTooLarge { .. }
                | Error::ResultEncoding { .. }
        )
    }
}

/// Lets `#[idempotent]` functions return `std::io::Result<T>`: the error keeps
/// its message and is reachable through `io::Error::get_ref` / `into_inner`.
///
/// ```
/// let io: std::io::Error = idempotent_runtime::Error::NoDefaultStore { scope: "a.b".into() }.into();
/// assert!(io.to_string().contains("set_default_store"));
/// assert!(io.get_ref().is_some_and(|e| e.is::<idempotent_runtime::Error>()));
/// ```
impl From<Error> for std::io::Error {
    fn from(e: Error) -> Self {
        std::io::Error::other(e)
    }
}

/// Why a transaction cannot write the record ([`Error::StaleSnapshot`]).
fn stale_snapshot_cause(store: &str) -> &'static str {
    match store {
        "postgres" => {
            "writing the record failed with a serialization failure (40001): at REPEATABLE READ or \
             SERIALIZABLE its snapshot is older than the record another transaction committed, so it \
             can neither see nor write it, or, at SERIALIZABLE, its reads and writes conflict with a \
             concurrent transaction's (even for a key no one has recorded), or the record is another \
             caller's, in progress, whose owner (a call of this process, still at work) could not renew \
             its lease or record its result, perhaps waiting for a pooled connection this transaction \
             holds, so it must not take the record over"
        }
        "mysql" => {
            "the record was another caller's, in progress, when this transaction began (its lease ran out \
             since, InnoDB's clock counting in whole seconds), or an earlier call in it locked the record, \
             or its owner (a call of this process) is still writing, perhaps waiting for a pooled \
             connection this transaction holds, and this transaction may be what kept its owner from renewing its lease, so it must not take \
             the record over"
        }
        _ => {
            "it read the database before writing, and SQLite will not let it write any more \
             (another connection wrote since, or waits for its read lock), or the record is another \
             caller's, in progress, whose owner (a call of this process, still at work) could not \
             renew its lease or record its result while this transaction held the database's write \
             lock, so it must not take the record over"
        }
    }
}

/// What to do about it ([`Error::StaleSnapshot`]).
fn stale_snapshot_advice(store: &str) -> &'static str {
    match store {
        "postgres" => {
            "run transactions that call idempotent functions at READ COMMITTED (PostgreSQL's default); \
             leave the store's pool a connection that no transaction holds"
        }
        "mysql" => {
            "end a transaction soon after a call in it answers `InProgress` rather than calling again in it"
        }
        _ => {
            "begin transactions that call idempotent functions with `BEGIN IMMEDIATE` \
             (`pool.begin_with(\"BEGIN IMMEDIATE\")`); end one that holds the write lock \
             promptly, so that an owner can write"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key's message says what a good key is; a tenant's does not talk
    /// about keys.
    #[test]
    fn an_empty_tenant_is_not_told_to_send_a_key() {
        let key = Error::InvalidKey(KeyProblem::Empty).to_string();
        assert!(key.contains("it is empty") && key.contains("UUID"), "{key}");
        let tenant = Error::InvalidTenant(KeyProblem::Empty).to_string();
        assert!(tenant.contains("it is empty"), "{tenant}");
        assert!(
            !tenant.contains("UUID") && !tenant.contains("key"),
            "{tenant}"
        );
    }
}
