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
//! and for as long as the store's worker tries it; and when its write finds
//! the record taken over by a call that did not record it, until its time is
//! up ([`found_taken_over`]). A call of this process that takes a record
//! over looks here first: an answer of its key is recorded under the new
//! owner's token and replayed, and the body does not run again. A call whose
//! reservation may have landed and that ends without an answer (failed,
//! dropped) keeps a record of a request answered here rather than releasing
//! it ([`holds_answer`]), so the next call takes it over and finds the
//! answer instead of making a new record and running the body. This holds whichever store object (a second one opened on the
//! same database, the HTTP layer's, a consumer's) or mode (`tx = ...`) takes
//! the record over. A call in another process cannot see it: there the
//! takeover is rule 20's uncertain outcome, which a `recover` hook answers.
//!
//! An answer is used only for a call of the same request: the same identity,
//! the same arguments (fingerprint), the same kind of store. The record taken
//! over may not be the one the answer was noted for (it was released or
//! deleted meanwhile, and made again by another call), but a record of that
//! request is answered by any answer the request produced.

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
    /// What identifies the request besides the identity: the store's kind
    /// and the arguments' fingerprint (its current form).
    request: Request,
    answer: Answer,
    until: Instant,
    /// A takeover of this process recorded it (under its own token).
    recorded_by_takeover: bool,
}

/// What identifies a request besides its identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    /// The store's name ([`Store::name`](crate::Store::name)).
    pub(crate) store: &'static str,
    /// The arguments' fingerprint, `None` for a scope without one.
    pub(crate) fingerprint: Option<String>,
}

impl Request {
    pub(crate) fn new(
        store: &'static str,
        fingerprint: Option<&crate::fingerprint::Fingerprint>,
    ) -> Self {
        Request {
            store,
            fingerprint: fingerprint.map(|f| f.as_str().to_owned()),
        }
    }
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

/// Notes `answer` to `request`, which the call owning `identity`'s record
/// with `token` is about to record. Answers past their time are dropped on
/// the way.
pub(crate) fn note(identity: &Identity, token: &OwnerToken, request: &Request, answer: &Answer) {
    let now = Instant::now();
    let until = now + answer.ttl.min(KEPT_FOR_AT_MOST);
    let sweep = UNRECORDED
        .notes
        .fetch_add(1, Ordering::Relaxed)
        .is_multiple_of(SWEEP_EVERY);
    // Copied before the lock is taken: an answer may be megabytes.
    let note = Noted {
        token: token.clone(),
        request: request.clone(),
        answer: answer.clone(),
        until,
        recorded_by_takeover: false,
    };
    let identity = identity.clone();
    let mut answers = UNRECORDED.answers();
    if sweep {
        answers.retain(|_, noted| {
            noted.retain(|n| n.until > now);
            !noted.is_empty()
        });
    }
    let noted = answers.entry(identity).or_default();
    noted.retain(|n| n.until > now);
    noted.push(note);
    UNRECORDED.count.store(answers.len(), Ordering::SeqCst);
}

/// The answer `token` noted for `identity` is recorded: forgets it. Whether
/// a takeover of this process had recorded it ([`recorded_by_takeover`]).
pub(crate) fn forget(identity: &Identity, token: &OwnerToken) -> bool {
    if UNRECORDED.count.load(Ordering::SeqCst) == 0 {
        return false;
    }
    let mut answers = UNRECORDED.answers();
    let mut recorded = false;
    if let Some(noted) = answers.get_mut(identity) {
        noted.retain(|n| {
            let it = &n.token == token;
            recorded |= it && n.recorded_by_takeover;
            !it
        });
        if noted.is_empty() {
            answers.remove(identity);
        }
    }
    UNRECORDED.count.store(answers.len(), Ordering::SeqCst);
    recorded
}

/// The write of the answer `token` noted for `identity` found its record no
/// longer its own. When a takeover of this process recorded that answer, it
/// is forgotten, and true. Otherwise it is kept until its time is up, and
/// false: the record's new owner may be a call of this process that has not
/// looked here yet, or one whose reservation landed as it failed or was
/// dropped, which kept the record for the next call ([`holds_answer`]); that
/// call's takeover finds the answer here (NATS hunt: it was forgotten, and
/// the next takeover ran the body again).
pub(crate) fn found_taken_over(identity: &Identity, token: &OwnerToken) -> bool {
    if UNRECORDED.count.load(Ordering::SeqCst) == 0 {
        return false;
    }
    let mut answers = UNRECORDED.answers();
    let Some(noted) = answers.get_mut(identity) else {
        return false;
    };
    let before = noted.len();
    noted.retain(|n| !(&n.token == token && n.recorded_by_takeover));
    let recorded = noted.len() < before;
    if noted.is_empty() {
        answers.remove(identity);
    }
    UNRECORDED.count.store(answers.len(), Ordering::SeqCst);
    recorded
}

/// Whether this process holds an answer of `request` to `identity` that is
/// not recorded yet: a record of that request that a call holds (or may
/// hold) and ends without an answer is kept for a takeover, which records
/// this answer, rather than released for a new record whose call would run
/// the body again.
pub(crate) fn holds_answer(identity: &Identity, request: &Request) -> bool {
    if UNRECORDED.count.load(Ordering::SeqCst) == 0 {
        return false;
    }
    let now = Instant::now();
    UNRECORDED
        .answers()
        .get(identity)
        .is_some_and(|noted| noted.iter().any(|n| n.until > now && &n.request == request))
}

/// A takeover recorded the answer `token` noted for `identity`: the call
/// still writing it under `token` is told so when its write finds the record
/// taken over ([`forget`]), instead of that its answer was lost.
pub(crate) fn recorded_by_takeover(identity: &Identity, token: &OwnerToken) {
    if let Some(noted) = UNRECORDED.answers().get_mut(identity) {
        for n in noted.iter_mut().filter(|n| &n.token == token) {
            n.recorded_by_takeover = true;
        }
    }
}

/// For a call of `request` that has just taken `identity`'s record over: the
/// latest answer this process produced for that request and has not
/// recorded yet, if any, with the token it was noted under.
pub(crate) fn for_takeover(identity: &Identity, request: &Request) -> Option<(OwnerToken, Answer)> {
    if UNRECORDED.count.load(Ordering::SeqCst) == 0 {
        return None;
    }
    let now = Instant::now();
    UNRECORDED
        .answers()
        .get(identity)?
        .iter()
        .rev()
        .find(|n| n.until > now && &n.request == request)
        .map(|n| (n.token.clone(), n.answer.clone()))
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

    fn request(store: &'static str, fingerprint: &str) -> Request {
        Request {
            store,
            fingerprint: Some(fingerprint.to_owned()),
        }
    }

    #[test]
    fn the_latest_answer_of_the_request_is_found_until_it_is_forgotten() {
        let (id, other) = (identity("latest"), identity("latest-other"));
        let charge = request("postgres", "v3:100");
        let (first, second) = (OwnerToken::new(), OwnerToken::new());
        note(&id, &first, &charge, &answer(b"1", Duration::from_secs(60)));
        note(
            &id,
            &second,
            &charge,
            &answer(b"2", Duration::from_secs(60)),
        );
        let found = |id: &Identity| for_takeover(id, &charge).map(|(_, a)| a.outcome.payload);
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

    /// An answer is another request's when its arguments or its store's kind
    /// differ (review: a record made again for other arguments, or one of
    /// another database, was answered with it).
    #[test]
    fn an_answer_of_other_arguments_or_another_store_is_not_found() {
        let id = identity("other-request");
        let token = OwnerToken::new();
        note(
            &id,
            &token,
            &request("postgres", "v3:100"),
            &answer(b"1", Duration::from_secs(60)),
        );
        assert!(for_takeover(&id, &request("postgres", "v3:200")).is_none());
        assert!(for_takeover(&id, &request("sqlite", "v3:100")).is_none());
        let unfingerprinted = Request {
            store: "postgres",
            fingerprint: None,
        };
        assert!(for_takeover(&id, &unfingerprinted).is_none());
        assert!(for_takeover(&id, &request("postgres", "v3:100")).is_some());
        forget(&id, &token);
    }

    #[test]
    fn forgetting_says_whether_a_takeover_recorded_the_answer() {
        let id = identity("recorded-by-takeover");
        let charge = request("postgres", "v3:100");
        let (hanging, other) = (OwnerToken::new(), OwnerToken::new());
        note(
            &id,
            &hanging,
            &charge,
            &answer(b"1", Duration::from_secs(60)),
        );
        note(&id, &other, &charge, &answer(b"2", Duration::from_secs(60)));
        let (token, _) = for_takeover(&id, &charge).expect("the latest");
        assert_eq!(token, other);
        recorded_by_takeover(&id, &token);
        assert!(!forget(&id, &hanging), "not the one a takeover recorded");
        assert!(forget(&id, &other), "the one a takeover recorded");
        assert!(!forget(&id, &other), "forgotten already");
    }

    /// A write that found its record taken over keeps its answer unless a
    /// takeover of this process recorded it: the new owner may not have
    /// looked yet, or may have kept the record for the next call.
    #[test]
    fn an_answer_whose_record_was_taken_over_is_kept_unless_a_takeover_recorded_it() {
        let id = identity("taken-over");
        let charge = request("postgres", "v3:100");
        let (first, second) = (OwnerToken::new(), OwnerToken::new());
        note(&id, &first, &charge, &answer(b"1", Duration::from_secs(60)));
        note(
            &id,
            &second,
            &charge,
            &answer(b"2", Duration::from_secs(60)),
        );
        assert!(!found_taken_over(&id, &first), "no takeover recorded it");
        assert!(holds_answer(&id, &charge), "kept for the next takeover");
        recorded_by_takeover(&id, &second);
        assert!(found_taken_over(&id, &second), "a takeover recorded it");
        let found = for_takeover(&id, &charge).map(|(t, _)| t);
        assert_eq!(
            found,
            Some(first.clone()),
            "only the one a takeover recorded is forgotten"
        );
        assert!(!holds_answer(&id, &request("postgres", "v3:200")));
        assert!(!holds_answer(&id, &request("mysql", "v3:100")));
        forget(&id, &first);
        assert!(!holds_answer(&id, &charge));
    }

    #[test]
    fn an_answer_past_its_ttl_is_not_found() {
        let id = identity("expired");
        let charge = request("postgres", "v3:100");
        note(
            &id,
            &OwnerToken::new(),
            &charge,
            &answer(b"1", Duration::ZERO),
        );
        assert_eq!(
            for_takeover(&id, &charge).map(|(_, a)| a.outcome.payload),
            None
        );
    }
}
