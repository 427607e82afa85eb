//! The behaviour contract on [`MemoryStore`].
mod contract;
contract_tests!(async { Some(idempotent_runtime::MemoryStore::new()) });
