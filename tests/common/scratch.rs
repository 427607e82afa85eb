//! Scratch files of the tests, removed when the test process exits.
//!
//! A test that opens a SQLite store on a file of its own cannot remove the
//! file itself while the store (or a worker process, or a task it left
//! running) may still use it, and a test that fails never reaches its own
//! clean-up. Every path made here is removed, with SQLite's `-wal`, `-shm`
//! and `-journal` beside it, when the process exits (an `atexit` handler:
//! it runs after the test harness is done, passed or failed). Without it a
//! run of the whole suite left a few thousand files in the temp dir.

use std::path::PathBuf;
use std::sync::{Mutex, Once};

static MADE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static REMOVE_AT_EXIT: Once = Once::new();

extern "C" fn remove_made() {
    let made = std::mem::take(&mut *MADE.lock().unwrap_or_else(|p| p.into_inner()));
    for path in made {
        if path.is_dir() {
            let _ = std::fs::remove_dir_all(&path);
            continue;
        }
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut file = path.clone().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
    }
}

fn removed_at_exit(path: PathBuf) -> PathBuf {
    REMOVE_AT_EXIT.call_once(|| {
        // SAFETY: `remove_made` is a plain `extern "C" fn` that lives as long
        // as the process; `atexit` only stores the pointer.
        let registered = unsafe { libc::atexit(remove_made) };
        assert_eq!(registered, 0, "register the scratch files' removal");
    });
    MADE.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(path.clone());
    path
}

/// A path for a new SQLite database, `<temp dir>/idempotent-<what>-<uuid>.db`
/// (no file yet), removed with its journal files at exit.
pub fn sqlite_path(what: &str) -> PathBuf {
    removed_at_exit(std::env::temp_dir().join(format!(
        "idempotent-{what}-{}.db",
        uuid::Uuid::new_v4().simple()
    )))
}

/// The URL of a new SQLite database file ([`sqlite_path`]), created when
/// first opened.
pub fn sqlite_url(what: &str) -> String {
    format!("sqlite://{}?mode=rwc", sqlite_path(what).display())
}

/// A new, empty folder `<temp dir>/idempotent-<what>-<uuid>`, removed with
/// everything in it at exit.
pub fn dir(what: &str) -> PathBuf {
    let dir = removed_at_exit(std::env::temp_dir().join(format!(
        "idempotent-{what}-{}",
        uuid::Uuid::new_v4().simple()
    )));
    std::fs::create_dir_all(&dir).expect("create a scratch folder");
    dir
}
