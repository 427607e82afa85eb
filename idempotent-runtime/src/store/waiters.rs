//! The duplicates of this process waiting for a record to change, woken by
//! the store's own writes (SQLite and MySQL/MariaDB: stores that are not told
//! of other processes' changes), and the wait they share: look at the record,
//! then sleep until a change in this process wakes the waiter or the next
//! fallback look is due (DESIGN.md rule 4).

use super::{millis_to_duration, Identity, StoreError};
use std::collections::HashMap;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// Shards of [`Waiters`]: waits on different identities rarely share a lock.
const WAITER_SHARDS: usize = 16;

/// The duplicates of this process waiting for a record to change, per
/// identity. An entry lives while someone waits on it: the last waiter to
/// leave removes it.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    shards: [std::sync::Mutex<HashMap<Identity, WaitSlot>>; WAITER_SHARDS],
    hasher: std::collections::hash_map::RandomState,
}

#[derive(Debug)]
struct WaitSlot {
    notify: Arc<Notify>,
    waiting: usize,
}

impl Waiters {
    fn shard(&self, identity: &Identity) -> std::sync::MutexGuard<'_, HashMap<Identity, WaitSlot>> {
        let i = (self.hasher.hash_one(identity) as usize) % WAITER_SHARDS;
        // The maps are only ever changed by single inserts, removals and
        // counter updates, so a poisoned lock still holds a usable map.
        self.shards[i]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Wakes everyone waiting on `identity` (called after the change is
    /// committed). Costs one uncontended lock when no one waits.
    pub(crate) fn notify(&self, identity: &Identity) {
        if let Some(slot) = self.shard(identity).get(identity) {
            slot.notify.notify_waiters();
        }
    }

    /// Wakes everyone waiting on `identity` when `done` wrote: a fenced
    /// write that completed, released, renewed or ended the lease of the
    /// record (a renewal may have shortened it: the waiters look again).
    #[cfg(feature = "mysql")]
    pub(crate) fn notify_written(
        &self,
        identity: &Identity,
        done: &Result<super::Fenced, StoreError>,
    ) {
        if done.as_ref().is_ok_and(|d| d.is_written()) {
            self.notify(identity);
        }
    }

    /// Joins the waiters of `identity`; the answer's `Notify` is to be
    /// listened on, and [`leave`](Self::leave) called when done.
    pub(crate) fn join(&self, identity: &Identity) -> Arc<Notify> {
        let mut shard = self.shard(identity);
        let slot = match shard.get_mut(identity) {
            Some(slot) => slot,
            None => shard.entry(identity.clone()).or_insert_with(|| WaitSlot {
                notify: Arc::new(Notify::new()),
                waiting: 0,
            }),
        };
        slot.waiting += 1;
        slot.notify.clone()
    }

    pub(crate) fn leave(&self, identity: &Identity) {
        let mut shard = self.shard(identity);
        if let Some(slot) = shard.get_mut(identity) {
            slot.waiting = slot.waiting.saturating_sub(1);
            if slot.waiting == 0 {
                shard.remove(identity);
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().map_or(0, |m| m.len()))
            .sum()
    }
}

/// Leaves [`Waiters`] when dropped, also when the waiting call is cancelled.
pub(crate) struct Waiting<'a> {
    waiters: &'a Waiters,
    identity: &'a Identity,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.waiters.leave(self.identity);
    }
}

/// What a waiting duplicate's look at a record found: `None` when the record
/// is not in progress (completed, released, gone); otherwise its owner's
/// token and what is left of its lease in ms (by the store's clock).
pub(crate) type Held = Option<(Option<String>, Option<i64>)>;

/// [`Store::wait_for_change`](super::Store::wait_for_change) of a store whose
/// own writes notify `waiters`: joins the waiters of `identity` first (a
/// change made between the reservation that found the record in progress and
/// this wait is then not missed: the look sees it, or its notification wakes
/// the waiter), then looks at the record with `look`, and sleeps until a
/// notification, the next look (`pause(look_number)`), the end of the lease
/// it saw, or `max_wait`, whichever comes first. Returns when the record is
/// no longer held by the owner first seen (completed, released, taken over),
/// when its lease runs out, when a look fails (after the pause a look makes:
/// the reservation that follows reports the store's trouble), or after
/// `max_wait`; the caller reserves only then.
pub(crate) async fn wait_looking<F, Fut>(
    store: &'static str,
    waiters: &Waiters,
    identity: &Identity,
    (max_wait, round): (Duration, u32),
    pause: fn(u32) -> Duration,
    mut look: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Held, StoreError>>,
{
    // A bound too long for the clock (`Duration::MAX`) is no bound.
    let deadline = tokio::time::Instant::now().checked_add(max_wait);
    let notify = waiters.join(identity);
    let _waiting = Waiting { waiters, identity };
    let notified = notify.notified();
    tokio::pin!(notified);
    notified.as_mut().enable();
    let mut owner: Option<String> = None;
    let mut looks = round;
    loop {
        let lease_left = match look().await {
            // Completed or released: reserve again now.
            Ok(None) => return,
            Ok(Some((token, remaining))) => {
                let remaining = remaining.unwrap_or(0);
                // Its lease ran out, or a new owner took it: reserve again.
                if remaining <= 0 || (owner.is_some() && owner != token) {
                    return;
                }
                owner = token;
                millis_to_duration(remaining)
            }
            Err(e) => {
                tracing::debug!(target: "idempotent", store, scope = %identity.scope, error = %e,
                    "could not look at a record while waiting");
                // The reservation that follows reports the store's trouble,
                // after the pause a look would have made (a change in this
                // process still ends it): a look that keeps failing while
                // the reservations answer in progress (on another session
                // of the pool) never makes the wait go round without one.
                let left =
                    deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
                if left != Some(Duration::ZERO) {
                    let pause = pause(looks).min(left.unwrap_or(Duration::MAX));
                    let _ = tokio::time::timeout(pause, notified.as_mut()).await;
                }
                return;
            }
        };
        let left = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(tokio::time::Instant::now())
        });
        if left.is_zero() {
            return;
        }
        let pause = pause(looks)
            .min(left)
            .min(lease_left.max(Duration::from_millis(1)));
        if tokio::time::timeout(pause, notified.as_mut()).await.is_ok() {
            return;
        }
        looks = looks.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity::new("t", "waiters.unit", "k").expect("identity")
    }

    /// A look that fails ends the wait after the pause a look makes, not at
    /// once: one that kept failing while the reservations answered in
    /// progress made the wait go round without a pause (paused clock: the
    /// time is the runtime's, moved only by the wait's own timers).
    #[tokio::test(start_paused = true)]
    async fn a_failing_look_still_pauses_before_the_wait_ends() {
        let waiters = Waiters::default();
        let identity = identity();
        let looks = std::sync::atomic::AtomicUsize::new(0);
        let started = tokio::time::Instant::now();
        let fifty_ms = |_| Duration::from_millis(50);
        wait_looking(
            "unit",
            &waiters,
            &identity,
            (Duration::from_secs(10), 0),
            fifty_ms,
            || {
                looks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Err(StoreError::new("unit", "look", "the store failed")) }
            },
        )
        .await;
        assert_eq!(looks.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(started.elapsed(), Duration::from_millis(50), "no pause");
        assert_eq!(waiters.len(), 0, "the waiter left");
    }

    /// A bound too long for the clock (`Duration::MAX`, as a caller of
    /// `Store::wait_for_change` may pass) is no bound: the wait still looks,
    /// sleeps until the lease it saw ends, and is woken by a change.
    #[tokio::test(start_paused = true)]
    async fn a_bound_too_long_for_the_clock_still_waits_and_is_woken() {
        let waiters = Waiters::default();
        let identity = identity();
        let started = tokio::time::Instant::now();
        // The lease has 40 ms left at the first look, none at the next.
        let looks = std::sync::atomic::AtomicI64::new(0);
        let held = || {
            let first = looks.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
            async move {
                Ok(Some((
                    Some("owner".to_owned()),
                    Some(if first { 40 } else { 0 }),
                )))
            }
        };
        let fifty_ms = |_| Duration::from_millis(50);
        wait_looking(
            "unit",
            &waiters,
            &identity,
            (Duration::MAX, 0),
            fifty_ms,
            held,
        )
        .await;
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(40),
            "the lease seen"
        );

        let held_long = || async { Ok(Some((Some("owner".to_owned()), Some(i64::MAX)))) };
        let wait = wait_looking(
            "unit",
            &waiters,
            &identity,
            (Duration::MAX, 0),
            |_| Duration::MAX,
            held_long,
        );
        ends_at_a_change(&waiters, &identity, wait).await;
        assert_eq!(waiters.len(), 0, "the waiter left");
    }

    /// 60 waiters on 20 identities, one of each three dropped mid-wait: a change
    /// of each identity still wakes the others on it (none waits out its
    /// bound), and once all are gone no entry is left behind.
    #[tokio::test(start_paused = true)]
    async fn dropped_waiters_leave_nothing_and_lose_no_wakeup_for_the_others() {
        let waiters = Waiters::default();
        let identities: Vec<Identity> = (0..20)
            .map(|i| Identity::new("t", "waiters.unit", format!("k{i}")).expect("identity"))
            .collect();
        let held = || async { Ok(Some((Some("owner".to_owned()), Some(3_600_000)))) };
        let bound = (Duration::from_secs(3600), 0);
        let started = tokio::time::Instant::now();
        let mut kept = Vec::new();
        let mut dropped = Vec::new();
        for (n, identity) in identities.iter().cycle().take(60).enumerate() {
            let wait = Box::pin(wait_looking(
                "unit",
                &waiters,
                identity,
                bound,
                |_| Duration::from_secs(600),
                held,
            ));
            if n % 3 != 0 {
                kept.push(wait)
            } else {
                dropped.push(wait)
            }
        }
        // Every waiter joins and looks (its first poll), then one on each
        // identity goes away.
        for wait in kept.iter_mut().chain(dropped.iter_mut()) {
            let pending = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(wait.as_mut().poll(cx).is_pending())
            })
            .await;
            assert!(pending, "a waiter answered before any change");
        }
        assert_eq!(waiters.len(), 20);
        drop(dropped);
        assert_eq!(waiters.len(), 20, "kept waiters remain on every identity");
        for identity in &identities {
            waiters.notify(identity);
        }
        futures_util::future::join_all(kept).await;
        assert_eq!(started.elapsed(), Duration::ZERO, "woken, not timed out");
        assert_eq!(waiters.len(), 0, "no entry left behind");
    }

    /// The same pause is bounded by the wait and ended by a change made in
    /// this process.
    #[tokio::test(start_paused = true)]
    async fn a_failing_looks_pause_keeps_to_the_bound_and_is_woken() {
        let waiters = Waiters::default();
        let identity = identity();
        let failing = || async { Err(StoreError::new("unit", "look", "the store failed")) };
        let long = |_| Duration::from_secs(60);
        let started = tokio::time::Instant::now();
        wait_looking(
            "unit",
            &waiters,
            &identity,
            (Duration::from_millis(30), 0),
            long,
            failing,
        )
        .await;
        assert_eq!(started.elapsed(), Duration::from_millis(30), "the bound");

        let wait = wait_looking(
            "unit",
            &waiters,
            &identity,
            (Duration::from_secs(10), 0),
            long,
            failing,
        );
        ends_at_a_change(&waiters, &identity, wait).await;
    }

    /// Runs `wait` while a change of `identity` comes 7 ms in (the clock
    /// paused): the wait ends at the change.
    async fn ends_at_a_change(
        waiters: &Waiters,
        identity: &Identity,
        wait: impl std::future::Future,
    ) {
        let started = tokio::time::Instant::now();
        let change = async {
            tokio::time::sleep(Duration::from_millis(7)).await;
            waiters.notify(identity);
        };
        tokio::join!(wait, change);
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(7),
            "woken by the change"
        );
    }
}
