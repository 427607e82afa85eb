//! Rule 20 (`recover = ...`) on [`MemoryStore`](idempotent_runtime::MemoryStore).
recovery_tests!(async { Some(idempotent_runtime::MemoryStore::new()) });
