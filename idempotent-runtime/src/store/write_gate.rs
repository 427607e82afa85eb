//! The SQLite store's in-process write gate.
//!
//! SQLite lets one connection write at a time. Within one process the
//! store's writes take turns here, on an async mutex, instead of spinning in
//! SQLite's busy handler; other processes are handled by the busy timeout.
//!
//! The gate is only a queue, never what makes a write correct: every
//! statement is decided by SQLite under its own write lock. So a turn that is
//! not given back does not get to stop the process's writes. A call future
//! kept alive but no longer polled (parked in a `select!` loop, leaked) keeps
//! its turn for as long as it lives. Once one holder has kept the turn for
//! [`STALLED_AFTER`], the writers behind it stop waiting and write at once,
//! with SQLite's busy handler as their only queue, as writers in another
//! process would. A queue that moves, however long, is waited for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{Mutex, MutexGuard};
use tokio::time::Instant;

/// How long one holder may keep the write turn before the writers behind it
/// write without it. Far longer than a write takes (well under a millisecond,
/// or one flush); a holder that keeps it longer is waiting on another
/// process's lock (the busy handler) or is not being polled.
pub(crate) const STALLED_AFTER: Duration = Duration::from_secs(1);

/// This process's queue of writes to one SQLite database.
#[derive(Debug)]
pub(crate) struct WriteGate {
    turn: Mutex<()>,
    opened: Instant,
    /// When the current holder took its turn, in ms since `opened`, plus
    /// one; 0 while nobody holds it.
    held_since: AtomicU64,
}

/// One write's turn at the gate, given back when dropped. A turn taken
/// past a stalled holder holds nothing.
#[derive(Debug)]
pub(crate) struct WriteTurn<'a> {
    gate: &'a WriteGate,
    guard: Option<MutexGuard<'a, ()>>,
}

impl Drop for WriteTurn<'_> {
    fn drop(&mut self) {
        if self.guard.is_some() {
            // Before the mutex is released (the field drops after this), so
            // the next holder's mark is never overwritten.
            self.gate.held_since.store(0, Ordering::Release);
        }
    }
}

impl WriteTurn<'_> {
    /// Whether this turn is the gate's (false: taken past a stalled holder).
    #[cfg(test)]
    fn holds_the_gate(&self) -> bool {
        self.guard.is_some()
    }
}

impl Default for WriteGate {
    fn default() -> Self {
        WriteGate {
            turn: Mutex::new(()),
            opened: Instant::now(),
            held_since: AtomicU64::new(0),
        }
    }
}

impl WriteGate {
    /// The turn, at once when nobody holds it.
    pub(crate) fn try_turn(&self) -> Option<WriteTurn<'_>> {
        self.turn.try_lock().ok().map(|guard| self.taken(guard))
    }

    /// Waits for the turn: for as long as the queue moves, and no longer
    /// than until one holder has kept it for [`STALLED_AFTER`].
    pub(crate) async fn turn(&self) -> WriteTurn<'_> {
        self.turn_with_patience(STALLED_AFTER).await
    }

    /// [`turn`](Self::turn) for a write that must land within `deadline`
    /// (a heartbeat renewing a short lease): a holder that keeps the turn
    /// for a quarter of it is written past (at least 10 ms, at most
    /// [`STALLED_AFTER`]), so a stalled holder cannot cost a running body
    /// its lease.
    pub(crate) async fn turn_within(&self, deadline: Duration) -> WriteTurn<'_> {
        self.turn_with_patience((deadline / 4).clamp(Duration::from_millis(10), STALLED_AFTER))
            .await
    }

    async fn turn_with_patience(&self, patience: Duration) -> WriteTurn<'_> {
        if let Some(turn) = self.try_turn() {
            return turn;
        }
        // One acquisition for the whole wait: it keeps its place in the
        // mutex's first-come queue while the holders are checked on.
        let lock = self.turn.lock();
        tokio::pin!(lock);
        loop {
            let held_for = self.held_for().unwrap_or(Duration::ZERO);
            if held_for >= patience {
                tracing::warn!(target: "idempotent",
                    held_for_ms = u64::try_from(held_for.as_millis()).unwrap_or(u64::MAX),
                    "sqlite: a write has kept this store's write turn for over {patience:?}: a call \
                     future kept alive but no longer polled, or another process holding the \
                     database's write lock; writing without waiting for it (SQLite's busy \
                     handler orders the writes)");
                return WriteTurn {
                    gate: self,
                    guard: None,
                };
            }
            if let Ok(guard) = tokio::time::timeout(patience - held_for, lock.as_mut()).await {
                return self.taken(guard);
            }
        }
    }

    fn taken<'a>(&'a self, guard: MutexGuard<'a, ()>) -> WriteTurn<'a> {
        self.held_since.store(self.now_ms() + 1, Ordering::Release);
        WriteTurn {
            gate: self,
            guard: Some(guard),
        }
    }

    /// How long the current holder has held the turn; `None` while it is free.
    fn held_for(&self) -> Option<Duration> {
        match self.held_since.load(Ordering::Acquire) {
            0 => None,
            since => Some(Duration::from_millis(
                self.now_ms().saturating_sub(since - 1),
            )),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_free_gate_is_taken_at_once_and_given_back_on_drop() {
        let gate = WriteGate::default();
        let turn = gate.try_turn().expect("free");
        assert!(turn.holds_the_gate());
        assert!(gate.try_turn().is_none(), "held");
        drop(turn);
        assert!(gate.held_for().is_none());
        assert!(gate.try_turn().is_some(), "given back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_holder_that_never_gives_the_turn_back_stops_blocking_after_the_patience() {
        let gate = WriteGate::default();
        let stalled = gate.try_turn().expect("free");
        let past = gate.turn_with_patience(Duration::from_millis(50)).await;
        assert!(!past.holds_the_gate(), "written past the stalled holder");
        drop(past);
        // The stalled holder's turn is untouched, and given back when it goes.
        assert!(gate.try_turn().is_none());
        drop(stalled);
        assert!(gate.try_turn().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_heartbeat_writes_past_a_stalled_holder_within_a_quarter_of_its_lease() {
        let gate = WriteGate::default();
        let _stalled = gate.try_turn().expect("free");
        let asked = Instant::now();
        let past = gate.turn_within(Duration::from_millis(400)).await;
        assert!(!past.holds_the_gate());
        // tokio's clock, paused: exactly the patience, no real waiting.
        assert_eq!(asked.elapsed(), Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_that_moves_is_waited_for_however_long_it_is() {
        // 40 writers of 20 ms each (tokio's clock, paused: no real waiting):
        // the last waits 800 ms, longer than the patience of 500 ms, but no
        // one holder keeps the turn that long.
        let gate = Arc::new(WriteGate::default());
        let first = gate.try_turn().expect("free");
        let bypassed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut writers = Vec::new();
        for _ in 0..40 {
            let (gate, bypassed) = (gate.clone(), bypassed.clone());
            writers.push(tokio::spawn(async move {
                let turn = gate.turn_with_patience(Duration::from_millis(500)).await;
                if !turn.holds_the_gate() {
                    bypassed.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }));
        }
        drop(first);
        for w in writers {
            w.await.expect("writer");
        }
        assert_eq!(
            bypassed.load(Ordering::SeqCst),
            0,
            "a moving queue is never bypassed"
        );
    }
}
