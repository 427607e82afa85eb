//! This process's store-mode owners of SQLite records, by owner token: which
//! are still at work (their body running, a renewal or their completion
//! being written).
//!
//! While a caller's transaction holds SQLite's one write lock, no owner can
//! renew its lease or record its result: a lease that runs out meanwhile may
//! run out *because of* that transaction, its owner alive. SQLite cannot say
//! when a transaction took the lock, nor whether an owner in another process
//! is alive; this process knows its own owners, and transactional mode asks
//! here before it takes a record over from a transaction that held the lock
//! before the call (see `sqlite::live_owner_answer`).
//!
//! An owner counts as alive while one of its writes is under way (a renewal
//! or its completion, waiting for the write turn or for another
//! connection's lock), and for its lease after it last reserved or wrote:
//! exactly as long as the record's lease for an owner that never wrote
//! again. A call dropped without telling the store stops counting a lease
//! after it last wrote.

use super::OwnerToken;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The owners, and how many there may be before those no longer alive are
/// dropped.
struct Owners {
    by_token: HashMap<String, Owner>,
    prune_at: usize,
}

/// When an owner last showed it is alive, for how long that counts, and how
/// many of its writes are under way.
#[derive(Clone, Copy)]
struct Owner {
    last: Instant,
    lease: Duration,
    writing: usize,
}

impl Owner {
    fn alive_at(&self, now: Instant) -> bool {
        self.writing > 0 || now.saturating_duration_since(self.last) < self.lease
    }
}

/// The fewest owners kept before pruning.
const PRUNE_AT_LEAST: usize = 1024;

static OWNERS: std::sync::LazyLock<Mutex<Owners>> = std::sync::LazyLock::new(|| {
    Mutex::new(Owners {
        by_token: HashMap::new(),
        prune_at: PRUNE_AT_LEAST,
    })
});

fn owners() -> MutexGuard<'static, Owners> {
    OWNERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How far the database's clock may read behind this process's when a
/// statement runs: SQLite's `'now'` is in whole milliseconds, so a record's
/// lease may end up to this much before `sent + lease`.
const DATABASE_CLOCK_RESOLUTION: Duration = Duration::from_millis(1);

/// `token`'s owner reserved its record with `lease`, by a statement sent at
/// `sent` or later (so it counts no longer than the record's lease: from
/// [`DATABASE_CLOCK_RESOLUTION`] before `sent`; otherwise a transaction
/// taking over a crashed owner the moment its lease ran out was refused for
/// up to that long).
pub(super) fn reserved(token: &OwnerToken, lease: Duration, sent: Instant) {
    let sent = sent.checked_sub(DATABASE_CLOCK_RESOLUTION).unwrap_or(sent);
    let mut owners = owners();
    if owners.by_token.len() >= owners.prune_at {
        let now = Instant::now();
        owners.by_token.retain(|_, owner| owner.alive_at(now));
        // Pruned again only once as many more have come (amortized).
        owners.prune_at = (owners.by_token.len() * 2).max(PRUNE_AT_LEAST);
    }
    owners.by_token.insert(
        token.as_str().to_owned(),
        Owner {
            last: sent,
            lease,
            writing: 0,
        },
    );
}

/// `token`'s owner is done: completed, released, its lease ended on purpose
/// or lost.
pub(crate) fn ended(token: &OwnerToken) {
    owners().by_token.remove(token.as_str());
}

/// `token`'s owner handed its record to the store's background worker (its
/// call was dropped, or its completion could not be written). A completion
/// (`completing`: its body has run) keeps the owner at work for as long as
/// the worker tries to write it (the answer, a [`Writing`], is kept with the
/// job; the worker ends the owner once it is written or fenced out); a
/// release or an ended lease ends it.
pub(crate) fn handed_over(
    token: &OwnerToken,
    completing: bool,
) -> super::detached::KeepWhileRunning {
    if completing {
        Some(Box::new(Writing::begins(token, None)))
    } else {
        ended(token);
        None
    }
}

/// Whether this process lists any owner (at work or not yet forgotten): when
/// it lists none, no record can have an owner at work here.
pub(super) fn any_listed() -> bool {
    !owners().by_token.is_empty()
}

/// Whether `token` names an owner of this process that is still at work.
pub(super) fn alive(token: &str) -> bool {
    owners()
        .by_token
        .get(token)
        .is_some_and(|owner| owner.alive_at(Instant::now()))
}

/// One write of a listed owner under way (a renewal, its completion): the
/// owner counts as alive until it is dropped, and for its lease after.
/// Keep it in the task that makes the write, so that it ends with the
/// write, whether or not the caller still polls.
pub(super) struct Writing(Option<String>);

impl Writing {
    /// A write of `token`'s owner begins; `lease`, when given, is its lease
    /// from now on (a renewal's). A renewal lists an owner not listed: it is
    /// at work in this process (one dropped from the list while its lease
    /// had lapsed, its thread blocked past it, renews again), and its end
    /// must be seen by a renewal still on its way (see [`owner_ended`]).
    /// A completion alone lists nobody.
    ///
    /// [`owner_ended`]: Writing::owner_ended
    pub(super) fn begins(token: &OwnerToken, lease: Option<Duration>) -> Self {
        let mut owners = owners();
        let now = Instant::now();
        let owner = match (owners.by_token.get_mut(token.as_str()), lease) {
            (Some(owner), _) => owner,
            (None, None) => return Writing(None),
            (None, Some(lease)) => {
                owners
                    .by_token
                    .entry(token.as_str().to_owned())
                    .or_insert(Owner {
                        last: now,
                        lease,
                        writing: 0,
                    })
            }
        };
        owner.writing += 1;
        owner.last = now;
        if let Some(lease) = lease {
            owner.lease = lease;
        }
        Writing(Some(token.as_str().to_owned()))
    }
}

impl Writing {
    /// Whether this write's owner, listed when the write began, has been
    /// ended since (completed, released, its lease ended on purpose or
    /// lost): a renewal then has nothing left to renew.
    pub(super) fn owner_ended(&self) -> bool {
        self.0
            .as_deref()
            .is_some_and(|token| !owners().by_token.contains_key(token))
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        let Some(token) = self.0.take() else {
            return;
        };
        // An owner ended meanwhile stays ended.
        if let Some(owner) = owners().by_token.get_mut(&token) {
            owner.writing = owner.writing.saturating_sub(1);
            owner.last = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record's lease, on the database's millisecond clock, may end up to
    /// a millisecond before `sent + lease`: the owner never counts longer.
    #[test]
    fn a_reserved_owner_counts_no_longer_than_its_records_lease() {
        let token = OwnerToken::new();
        let lease = Duration::from_secs(1);
        let sent = Instant::now()
            .checked_sub(lease - Duration::from_micros(500))
            .expect("a second ago");
        reserved(&token, lease, sent);
        assert!(
            !alive(token.as_str()),
            "half a millisecond before sent + lease, the record's lease may be over"
        );
        ended(&token);
    }

    #[test]
    fn an_owner_counts_while_it_writes_and_for_its_lease_after() {
        let token = OwnerToken::new();
        assert!(!alive(token.as_str()), "never listed");
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("a minute ago");
        reserved(&token, Duration::from_secs(1), long_ago);
        assert!(any_listed(), "a reserved owner is listed, alive or not");
        assert!(
            !alive(token.as_str()),
            "its lease ran out, and it never wrote"
        );
        let writing = Writing::begins(&token, None);
        assert!(alive(token.as_str()), "a renewal is under way");
        drop(writing);
        assert!(alive(token.as_str()), "for a lease after it wrote");
        let writing = Writing::begins(&token, None);
        ended(&token);
        drop(writing);
        assert!(!alive(token.as_str()), "ended stays ended");
        let unknown = OwnerToken::new();
        let writing = Writing::begins(&unknown, None);
        assert!(!alive(unknown.as_str()), "not listed by a completion alone");
        drop(writing);
        // A renewal of an owner no longer listed (dropped while its lease had
        // lapsed) lists it, and sees it ended while it waits.
        let writing = Writing::begins(&unknown, Some(Duration::from_secs(60)));
        assert!(alive(unknown.as_str()), "a renewal is under way");
        assert!(!writing.owner_ended());
        ended(&unknown);
        assert!(writing.owner_ended(), "ended while the renewal waited");
        drop(writing);
        assert!(!alive(unknown.as_str()), "ended stays ended");
    }
}
