//! The store conformance suite against [`MemoryStore`]: a fresh store per test.

store_conformance_tests!(async { Some(idempotent_runtime::MemoryStore::new()) });
