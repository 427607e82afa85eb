//! The store conformance suite against [`MemoryStore`]: a fresh store per test.
mod conformance;

store_conformance_tests!(async { Some(idempotent_runtime::MemoryStore::new()) });
