//! The reservation state machine against a reference model (DESIGN.md §6):
//! random sequences of `reserve` / `complete` / `release` / `heartbeat` /
//! `purge_expired` / `fetch` / `scope_stats` over three identities, run on a
//! real store and on the model in `model/spec.rs`, compared at every step.
//!
//! Leases and ttls are either zero (run out by the next statement, on the
//! store's clock) or an hour (never run out here), so expiry is exact without
//! sleeping or reading any clock in the test.
//!
//! Size: `IDEMPOTENT_MODEL_CASES` sequences per store (default 128) of 1 to
//! `IDEMPOTENT_MODEL_STEPS` steps (default 60); `IDEMPOTENT_MODEL_SEED` replays
//! a run whose seed a failure printed. A failure prints the shortest sequence
//! proptest shrank it to, as Rust for a regression test below.

mod common;
#[path = "model/runner.rs"]
mod runner;
#[path = "model/spec.rs"]
mod spec;

use idempotent_runtime::{MemoryStore, SqliteStore};
use runner::run_model;
use std::path::PathBuf;

/// A fresh SQLite file under the system temp dir; the guard removes it (and
/// its WAL files) when the test ends.
struct TempDb(PathBuf);

impl TempDb {
    fn new() -> Self {
        let dir = std::env::temp_dir().join("idempotent-model-sqlite");
        std::fs::create_dir_all(&dir).expect("create the temp dir");
        TempDb(dir.join(format!("{}.db", uuid::Uuid::new_v4().simple())))
    }

    fn url(&self) -> String {
        format!("sqlite://{}", self.0.display())
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.0.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

#[test]
fn model_memory() {
    run_model("memory", || async { Some(MemoryStore::new()) });
}

#[test]
fn model_sqlite_file() {
    let db = TempDb::new();
    run_model("sqlite file", || async {
        Some(
            SqliteStore::connect(&db.url())
                .await
                .expect("open a fresh SQLite file"),
        )
    });
}

#[test]
fn model_sqlite_in_memory() {
    run_model("sqlite::memory:", || async {
        Some(
            SqliteStore::connect("sqlite::memory:")
                .await
                .expect("open an in-memory SQLite database"),
        )
    });
}

#[test]
fn model_postgres() {
    run_model("postgres", common::servers::pg_store_or_skip);
}

#[test]
fn model_mysql() {
    run_model("mysql", common::servers::mysql_store_or_skip);
}
