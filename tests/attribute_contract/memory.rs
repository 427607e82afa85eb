//! The behaviour contract on [`MemoryStore`].
contract_tests!(async { Some(idempotent_runtime::MemoryStore::new()) });
