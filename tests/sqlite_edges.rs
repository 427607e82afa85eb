//! SQLite at its edges: opening one brand-new file from many tasks and many
//! OS processes at the same moment (DESIGN.md §5: migrations apply themselves
//! "also when several processes open a brand-new database at the same
//! moment"), and transactional mode in a caller's transaction that SQLite
//! will never let write (rule 15).

use idempotent_runtime::SqliteStore;
use std::path::{Path, PathBuf};

// ------------------------------------------------------------------ helpers

/// A fresh database file path (the file does not exist yet).
fn fresh_path() -> PathBuf {
    let dir = std::env::temp_dir().join("idempotent-sqlite-edges-tests");
    std::fs::create_dir_all(&dir).expect("create the temp dir");
    dir.join(format!("{}.db", uuid::Uuid::new_v4().simple()))
}

fn url(path: &Path) -> String {
    format!("sqlite://{}", path.display())
}

fn remove(path: &Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

// ------------------------------------------------ (1) opening a new file at once

/// `connect` and `from_pool` can be spawned: their futures are `Send` (the
/// migration runner used to hold a non-`Send` sqlx future, which made
/// `tokio::spawn(SqliteStore::connect(..))` fail to compile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_and_from_pool_can_be_spawned() {
    let path = fresh_path();
    let u = url(&path);
    let store = tokio::spawn(async move { SqliteStore::connect(&u).await })
        .await
        .expect("task")
        .expect("connect in a spawned task");
    let pool = store.pool().clone();
    let again = tokio::spawn(async move { SqliteStore::from_pool(pool).await })
        .await
        .expect("task")
        .expect("from_pool in a spawned task");
    again.pool().close().await;
    remove(&path);
}
