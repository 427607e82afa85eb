//! Calls whose bodies make further calls: a service's handler calling an
//! idempotent step that calls another, six levels deep. Each level must cost
//! the same few kilobytes, so nesting cannot overflow a worker thread's
//! stack and abort the process in the middle of a body (the record then
//! waits out its lease, and every retry meets the same overflow).
//!
//! The engine moves a call's body through several layers of futures; a body
//! kept by value in each grew every level of nesting several times over
//! (a call future three levels deep took 91 KiB and about 1.2 MiB of a debug
//! build's stack; four levels overflowed tokio's 2 MiB worker stack).

use idempotent_runtime::{idempotent, Error, MemoryStore};
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Steps {
    store: MemoryStore,
    innermost_runs: AtomicUsize,
}

impl Steps {
    #[idempotent(scope = "nested.level1", key = key, tenant = shared, store = self.store)]
    async fn level1(&self, key: &str) -> Result<u64, Error> {
        Ok(self.level2(&format!("{key}/2")).await? + 1)
    }

    #[idempotent(scope = "nested.level2", key = key, tenant = shared, store = self.store)]
    async fn level2(&self, key: &str) -> Result<u64, Error> {
        Ok(self.level3(&format!("{key}/3")).await? + 1)
    }

    #[idempotent(scope = "nested.level3", key = key, tenant = shared, store = self.store)]
    async fn level3(&self, key: &str) -> Result<u64, Error> {
        Ok(self.level4(&format!("{key}/4")).await? + 1)
    }

    #[idempotent(scope = "nested.level4", key = key, tenant = shared, store = self.store)]
    async fn level4(&self, key: &str) -> Result<u64, Error> {
        Ok(self.level5(&format!("{key}/5")).await? + 1)
    }

    #[idempotent(scope = "nested.level5", key = key, tenant = shared, store = self.store)]
    async fn level5(&self, key: &str) -> Result<u64, Error> {
        Ok(self.level6(&format!("{key}/6")).await? + 1)
    }

    #[idempotent(scope = "nested.level6", key = key, tenant = shared, store = self.store)]
    async fn level6(&self, key: &str) -> Result<u64, Error> {
        self.innermost_runs.fetch_add(1, Ordering::SeqCst);
        Ok(1)
    }
}

/// Six levels run on a tokio worker thread with its default stack (what a
/// service's handlers get), twice: the first runs every body once, the retry
/// replays the outermost answer.
#[test]
fn six_nested_calls_run_on_a_worker_threads_default_stack() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let steps = std::sync::Arc::new(Steps {
        store: MemoryStore::new(),
        innermost_runs: AtomicUsize::new(0),
    });
    for _ in 0..2 {
        let steps = steps.clone();
        let answer = runtime
            .block_on(runtime.spawn(async move { steps.level1("order-1").await }))
            .expect("the task ran to its end");
        assert_eq!(answer.expect("the call's answer"), 6);
    }
    assert_eq!(steps.innermost_runs.load(Ordering::SeqCst), 1);
}

/// A call's future is as large whatever its body holds: the body is kept
/// out of line, so a call six levels deep is the size of one with none.
#[test]
fn a_calls_future_does_not_grow_with_the_calls_its_body_makes() {
    let steps = Steps {
        store: MemoryStore::new(),
        innermost_runs: AtomicUsize::new(0),
    };
    let innermost = std::mem::size_of_val(&steps.level6("k"));
    let outermost = std::mem::size_of_val(&steps.level1("k"));
    assert_eq!(
        outermost, innermost,
        "a call six levels deep takes {outermost} bytes, one with no call in its body {innermost}"
    );
}
