//! The answers this process's calls produced and has not recorded yet.
//!
//! A body that ran has an answer; recording it is the last write of the call
//! (rule 12). When that write fails or hangs (an outage, a failover, a
//! connection that went silent), the store's background worker goes on
//! trying it (`store/detached.rs`), fenced by the call's owner token. Nothing
//! renews the record's lease meanwhile, so once the lease has run out the
//! next call of the key takes the record over (rule 10) and, without this,
//! runs the body a second time, although this process still holds the
//! answer the first run produced.
//!
//! So every answer is noted here, by identity, while it is being recorded
//! and for as long as the store's worker tries it. A call of this process
//! that takes a record over looks here first: an answer of its key is
//! recorded under the new owner's token and replayed, and the body does not
//! run again. This holds whichever store object (a second one opened on the
//! same database, the HTTP layer's, a consumer's) or mode (`tx = ...`) takes
//! the record over. A call in another process cannot see it: there the
//! takeover is rule 20's uncertain outcome, which a `recover` hook answers.
//!
//! A takeover is only ever granted to a call whose fingerprint the record
//! accepts (rule 7), so an answer noted for the identity answers the same
//! request.

use crate::identity::Identity;
use crate::store::{Answer, OwnerToken};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long an answer is kept here at most: as long as the store's worker
/// tries to record it ([`COMPLETE_TRIED_FOR`](crate::store::detached)), and
/// never past its record's ttl (an expired record counts as absent: the next
/// call is a new request).
const KEPT_FOR_AT_MOST: Duration = Duration::from_secs(3600);

/// How often a note looks at every identity's answers for ones past their
/// time (answers whose store forgot to say they ended: a store of one's own).
const SWEEP_EVERY: usize = 1024;

struct Noted {
    token: OwnerToken,
    answer: Answer,
    until: Instant,
}

#[derive(Default)]
struct Unrecorded {
    /// How many identities have answers here: a takeover reads only this
    /// while there are none.
    count: AtomicUsize,
    /// Notes so far: every [`SWEEP_EVERY`]th drops all answers past their
    /// time (each note drops its own identity's).
    notes: AtomicUsize,
    answers: Mutex<HashMap<Identity, Vec<Noted>>>,
}

static UNRECORDED: LazyLock<Unrecorded> = LazyLock::new(Unrecorded::default);

impl Unrecorded {
    fn answers(&self) -> MutexGuard<'_, HashMap<Identity, Vec<Noted>>> {
        self.answers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Notes `answer`, which the call owning `identity`'s record with `token` is
/// about to record. Answers past their time are dropped on the way.
pub(crate) fn note(identity: &Identity, token: &OwnerToken, answer: &Answer) {
    let now = Instant::now();
    let until = now + answer.ttl.min(KEPT_FOR_AT_MOST);
    let sweep = UNRECORDED
        .notes
        .fetch_add(1, Ordering::Relaxed)
        .is_multiple_of(SWEEP_EVERY);
    let mut answers = UNRECORDED.answers();
    if sweep {
        answers.retain(|_, noted| {
            noted.retain(|n| n.until > now);
            !noted.is_empty()
        });
    }
    let noted = answers.entry(identity.clone()).or_default();
    noted.retain(|n| n.until > now);
    noted.push(Noted {
        token: token.clone(),
        answer: answer.clone(),
        until,
    });
    UNRECORDED.count.store(answers.len(), Ordering::SeqCst);
}

/// The answer `token` noted for `identity` is recorded, or will never be
/// (its record was taken over, or the store gave up): forgets it.
pub(crate) fn forget(identity: &Identity, token: &OwnerToken) {
    if UNRECORDED.count.load(Ordering::SeqCst) == 0 {
        return;
    }
    let mut answers = UNRECORDED.answers();
    if let Some(noted) = answers.get_mut(identity) {
        noted.retain(|n| &n.token != token);
        if noted.is_empty() {
            answers.remove(identity);
        }
    }
    UNRECORDED.count.store(answers.len(), Ordering::SeqCst);
}

/// For a call that has just taken `identity`'s record over: the latest
/// answer this process produced for it and has not recorded yet, if any.
pub(crate) fn for_takeover(identity: &Identity) -> Option<Answer> {
    if UNRECORDED.count.load(Ordering::SeqCst) == 0 {
        return None;
    }
    let now = Instant::now();
    UNRECORDED
        .answers()
        .get(identity)?
        .iter()
        .rev()
        .find(|n| n.until > now)
        .map(|n| n.answer.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{AnsweredBy, StoredOutcome};

    fn answer(payload: &[u8], ttl: Duration) -> Answer {
        Answer {
            outcome: StoredOutcome {
                is_error: false,
                payload: payload.to_vec(),
            },
            ttl,
            by: AnsweredBy::Body,
        }
    }

    fn identity(key: &str) -> Identity {
        Identity::new("unrecorded-tests", "unrecorded.tests", key).expect("identity")
    }

    #[test]
    fn the_latest_answer_of_the_identity_is_found_until_it_is_forgotten() {
        let (id, other) = (identity("latest"), identity("latest-other"));
        let (first, second) = (OwnerToken::new(), OwnerToken::new());
        note(&id, &first, &answer(b"1", Duration::from_secs(60)));
        note(&id, &second, &answer(b"2", Duration::from_secs(60)));
        let found = |id: &Identity| for_takeover(id).map(|a| a.outcome.payload);
        assert_eq!(found(&id), Some(b"2".to_vec()));
        assert_eq!(found(&other), None, "another identity has none");
        forget(&id, &second);
        assert_eq!(found(&id), Some(b"1".to_vec()), "the older one stays");
        forget(&id, &OwnerToken::new());
        assert_eq!(
            found(&id),
            Some(b"1".to_vec()),
            "another token forgets nothing"
        );
        forget(&id, &first);
        assert_eq!(found(&id), None);
    }

    #[test]
    fn an_answer_past_its_ttl_is_not_found() {
        let id = identity("expired");
        note(&id, &OwnerToken::new(), &answer(b"1", Duration::ZERO));
        assert_eq!(for_takeover(&id).map(|a| a.outcome.payload), None);
    }
}
