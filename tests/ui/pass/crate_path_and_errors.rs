// `crate = path` for a re-exported runtime, `errors = record` and
// `errors = record_if(path)`, and `Result` aliases like `pay::Result<T>`
// (the return type's last path segment must be `Result`).
mod rt {
    pub use idempotent_runtime::*;
}

use rt::{idempotent, MemoryStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
pub enum PayError {
    Declined,
    Other(String),
}

impl From<rt::Error> for PayError {
    fn from(e: rt::Error) -> Self {
        PayError::Other(e.to_string())
    }
}

impl PayError {
    pub fn is_final(&self) -> bool {
        matches!(self, PayError::Declined)
    }
}

pub mod pay {
    pub type Result<T> = std::result::Result<T, super::PayError>;
}

#[idempotent(scope = "pay.record", key = key, tenant = shared, store = store, errors = record, crate = crate::rt)]
pub async fn record(store: &MemoryStore, key: &str) -> pay::Result<u8> {
    Err(PayError::Declined)
}

#[idempotent(scope = "pay.record_if", key = key, tenant = shared, store = store, errors = record_if(PayError::is_final))]
pub async fn record_if(store: &MemoryStore, key: &str) -> pay::Result<u8> {
    Ok(1)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = MemoryStore::new();
    assert!(record(&store, "k").await.is_err());
    assert_eq!(record_if(&store, "k").await.unwrap(), 1);
}
