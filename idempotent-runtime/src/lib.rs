//! # idempotent
//!
//! Make an async service function safe to retry. Put `#[idempotent]` on it and
//! a retry with the same key gets the recorded result instead of a second
//! execution; the same key with different arguments is refused; a duplicate
//! arriving while the first call runs waits or is refused; a crashed owner's
//! lease expires and the key can be taken over.
//!
//! ```
//! use idempotent_runtime::{idempotent, set_default_store, Error, MemoryStore};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize, Debug, PartialEq)]
//! struct Receipt { charge_id: u64 }
//!
//! #[idempotent(scope = "payments.charge", key = key, tenant = account)]
//! async fn charge(account: &str, key: &str, amount_cents: u64) -> Result<Receipt, Error> {
//!     Ok(Receipt { charge_id: amount_cents * 7 })   // runs once per (tenant, scope, key)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Error> {
//! set_default_store(MemoryStore::new());
//! let first = charge("acct_1", "key-1", 500).await?;
//! let retry = charge("acct_1", "key-1", 500).await?;          // replayed, body not run
//! assert_eq!(first, retry);
//! assert!(matches!(charge("acct_1", "key-1", 900).await,     // same key, other amount
//!                  Err(Error::FingerprintMismatch(_))));
//! # Ok(()) }
//! ```
//!
//! See the README for the attribute's arguments, the stores and the errors.
#![warn(missing_docs)]

pub mod audit;
#[cfg(feature = "cli")]
pub mod cli;
pub mod connect;
pub mod consumer;
mod engine;
pub mod error;
pub mod fingerprint;
#[cfg(feature = "http")]
pub mod http;
pub mod identity;
#[cfg(feature = "manifest")]
pub mod manifest;
pub mod metrics;
pub mod purge;
pub mod recovery;
pub mod registry;
pub mod store;
mod table;
mod transaction;
mod unrecorded;

#[doc(hidden)]
pub mod __private;

pub use connect::connect_url;
pub use engine::{
    carry_outcome, default_store, set_default_store, with_outcome, Outcome, MAX_RESULT_BYTES,
};
pub use error::{Error, KeyProblem, RecordContext, StoreError};
pub use fingerprint::{check_faithful_json, Fingerprint, FingerprintBuilder};
pub use idempotent_macros::idempotent;
pub use identity::{validate_key, validate_tenant, Identity};
pub use recovery::{Recovery, Takeover};
pub use registry::{ErrorPolicy, InProgressPolicy, ScopeInfo};
pub use store::memory::MemoryStore;
#[cfg(feature = "mysql")]
pub use store::mysql::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::postgres::PgStore;
#[cfg(feature = "sqlite")]
pub use store::sqlite::SqliteStore;
pub use store::{
    AnsweredBy, Completion, Fenced, ForcedRelease, OwnerToken, RecordSnapshot, RecordState,
    Reservation, ReserveRequest, ScopeStats, Store, StoredOutcome,
};
pub use transaction::TransactionalConnection;
