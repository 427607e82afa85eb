//! The store conformance suite against [`SqliteStore`]: a fresh database file
//! per test (under the system temp dir), and the whole suite again on
//! `sqlite::memory:`.

use idempotent_runtime::SqliteStore;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

/// Where this suite's database files go. Files older than an hour (left by
/// earlier runs) are removed when a new one is made.
fn fresh_db_url() -> String {
    let dir = std::env::temp_dir().join("idempotent-conformance-sqlite");
    std::fs::create_dir_all(&dir).expect("create the temp dir");
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| SystemTime::now().duration_since(t).ok())
                .is_some_and(|age| age > Duration::from_secs(3600));
            if old {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let path: PathBuf = dir.join(format!("{}.db", uuid::Uuid::new_v4().simple()));
    format!("sqlite://{}", path.display())
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
