//! The store conformance suite against [`SqliteStore`]: a fresh database file
//! per test (under the system temp dir), and the whole suite again on
//! `sqlite::memory:`.

use idempotent_runtime::SqliteStore;

/// A new database file, removed when the test process exits.
fn fresh_db_url() -> String {
    crate::common::scratch::sqlite_url("conformance")
}

store_conformance_tests!(async {
    Some(
        SqliteStore::connect(&fresh_db_url())
            .await
            .expect("open a fresh SQLite file"),
    )
});

/// The same suite on a private in-memory database.
mod in_memory {
    use super::*;

    store_conformance_tests!(async {
        Some(
            SqliteStore::connect("sqlite::memory:")
                .await
                .expect("open an in-memory SQLite database"),
        )
    });
}
