//! Releases of dropped calls, carried out by something the store owns
//! (DESIGN.md rule 14).
//!
//! A call dropped mid-way (its future cancelled: a client gone, a timeout, a
//! runtime shutting down) cannot await its own release. Spawning the release
//! on the caller's runtime loses it when that runtime is shutting down, which
//! is exactly when many calls are dropped. So each SQL store owns a
//! [`Releaser`]: one background thread with a runtime of its own, started on
//! first use and stopped when the last handle to the store is dropped, which
//! opens its own connections (a connection belongs to the runtime that opened
//! it) and carries the releases out.
//!
//! A call may be dropped while its reservation statement is still in flight:
//! the statement may land after the first release attempt has found nothing.
//! A release that finds nothing (fenced by the owner token, so it can never
//! free someone else's record) is therefore tried again a few times over
//! [`RETRY_AFTER`]. A release that could not be made is logged and counted;
//! the lease bounds the damage.

use crate::error::StoreError;
use crate::identity::Identity;
use crate::metrics::METRICS;
use crate::store::OwnerToken;
use futures_util::future::BoxFuture;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Pauses before each further attempt when a release found nothing to release
/// (the reservation may still be in flight) or failed: about 9 s in all.
pub(crate) const RETRY_AFTER: [Duration; 4] = [
    Duration::from_millis(100),
    Duration::from_millis(400),
    Duration::from_millis(1_600),
    Duration::from_millis(6_400),
];

/// Releases one record: `Ok(true)` when it was released, `Ok(false)` when this
/// token owns nothing (never reserved, already released, or taken over).
pub(crate) type ReleaseFn =
    Arc<dyn Fn(Identity, OwnerToken) -> BoxFuture<'static, Result<bool, StoreError>> + Send + Sync>;

/// Opens what the releaser needs on its own runtime (e.g. a small pool) and
/// returns the release to run. Called once, on the releaser's thread.
pub(crate) type OpenFn = Box<dyn FnOnce() -> ReleaseFn + Send>;

type Job = (Identity, OwnerToken);

/// A store's background releaser. Cheap to create: the thread starts with the
/// first release handed to it.
pub(crate) struct Releaser {
    store: &'static str,
    state: Mutex<State>,
}

enum State {
    Idle(Option<OpenFn>),
    Running(mpsc::UnboundedSender<Job>),
}

impl std::fmt::Debug for Releaser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Releaser")
            .field("store", &self.store)
            .finish()
    }
}

impl Releaser {
    /// A releaser for `store` whose connections `open` makes on its thread.
    pub(crate) fn new(store: &'static str, open: OpenFn) -> Self {
        Releaser {
            store,
            state: Mutex::new(State::Idle(Some(open))),
        }
    }

    /// Hands the release of `identity` (owned by `token`) to the background
    /// thread. Never blocks and never needs the caller's runtime.
    pub(crate) fn release(&self, identity: Identity, token: OwnerToken) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let State::Idle(open) = &mut *state {
            match open.take().map(|open| start(self.store, open)) {
                Some(Ok(sender)) => *state = State::Running(sender),
                Some(Err(e)) => {
                    // Leave it idle without an opener: every later release is logged as lost.
                    tracing::error!(target: "idempotent", store = self.store, error = %e,
                        "could not start the background releaser thread");
                }
                None => {}
            }
        }
        let sent = match &*state {
            State::Running(sender) => sender.send((identity, token)).map_err(|e| e.0 .0),
            State::Idle(_) => Err(identity),
        };
        if let Err(identity) = sent {
            lost(
                self.store,
                &identity,
                "the background releaser is not running",
            );
        }
    }
}

fn start(store: &'static str, open: OpenFn) -> std::io::Result<mpsc::UnboundedSender<Job>> {
    let (sender, mut jobs) = mpsc::unbounded_channel::<Job>();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(format!("idempotent-{store}-releaser"))
        .spawn(move || {
            runtime.block_on(async move {
                let release = open();
                let mut running = tokio::task::JoinSet::new();
                while let Some((identity, token)) = jobs.recv().await {
                    running.spawn(release_with_retries(
                        store,
                        release.clone(),
                        identity,
                        token,
                    ));
                    while running.try_join_next().is_some() {}
                }
                // Every handle to the store is gone: finish what was handed over.
                while running.join_next().await.is_some() {}
            });
        })?;
    Ok(sender)
}

async fn release_with_retries(
    store: &'static str,
    release: ReleaseFn,
    identity: Identity,
    token: OwnerToken,
) {
    let mut last_error = None;
    for pause in std::iter::once(Duration::ZERO).chain(RETRY_AFTER) {
        tokio::time::sleep(pause).await;
        match release(identity.clone(), token.clone()).await {
            Ok(true) => {
                tracing::info!(target: "idempotent", store, scope = %identity.scope,
                    key = %identity.key_digest(), "released a dropped call's record");
                return;
            }
            Ok(false) => last_error = None,
            Err(e) => {
                tracing::warn!(target: "idempotent", store, scope = %identity.scope,
                    key = %identity.key_digest(), error = %e,
                    "releasing a dropped call's record failed; trying again");
                last_error = Some(e);
            }
        }
    }
    match last_error {
        // Nothing to release: the dropped call's reservation never landed, or
        // its record was already released or taken over.
        None => tracing::debug!(target: "idempotent", store, scope = %identity.scope,
            key = %identity.key_digest(), "a dropped call held no record; nothing to release"),
        Some(e) => lost(store, &identity, &e.to_string()),
    }
}

fn lost(store: &'static str, identity: &Identity, why: &str) {
    METRICS.release_failures.fetch_add(1, Ordering::Relaxed);
    tracing::error!(target: "idempotent", store, scope = %identity.scope, key = %identity.key_digest(),
        reason = why, "could not release a dropped call's record; it stays reserved until its lease runs out");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// The release happens on the releaser's own runtime even when the runtime
    /// that handed it over is gone, and is tried again while it finds nothing.
    #[test]
    fn releases_after_the_callers_runtime_is_gone_and_retries_while_nothing_is_found() {
        let attempts = Arc::new(AtomicUsize::new(0));
        let (done_tx, done_rx) = std::sync::mpsc::channel::<usize>();
        let counted = attempts.clone();
        let releaser = Releaser::new(
            "test",
            Box::new(move || {
                let done_tx = Mutex::new(done_tx);
                Arc::new(move |_, _| {
                    let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    let done = done_tx.lock().ok().map(|tx| tx.clone());
                    Box::pin(async move {
                        // The reservation "lands" before the second attempt.
                        let released = n >= 2;
                        if let (true, Some(tx)) = (released, done) {
                            let _ = tx.send(n);
                        }
                        Ok(released)
                    })
                })
            }),
        );
        let caller = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        caller.block_on(async {
            let id = Identity::new("t", "releaser.test", "k").expect("identity");
            releaser.release(id, OwnerToken::new());
        });
        drop(caller);
        let n = done_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("released in the background");
        assert_eq!(n, 2, "one empty attempt, then the release");
    }
}
