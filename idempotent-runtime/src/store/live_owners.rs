//! This process's store-mode owners of records, on every SQL store, by
//! owner token and by identity in each database: which are still at work
//! (their body running, a renewal or their completion being written).
//!
//! A caller's transaction may keep an owner from renewing its lease or
//! recording its result: on SQLite it holds the one write lock (or the one
//! connection of a database in memory); on any store it may hold the only
//! connection of the application's pool that the store was given
//! (`from_pool`), or every one of them, so the owner's writes wait for the
//! pool. A lease that runs out meanwhile may run out *because of* that
//! transaction, its owner alive. No store can say which connection a
//! transaction holds, nor whether an owner in another process is alive;
//! this process knows its own owners, and transactional mode asks here
//! before it reserves (see [`may_be_kept_from_writing`]), and SQLite's
//! before it takes a record over from a transaction that held the lock
//! before the call (see `sqlite::live_owner_answer`).
//!
//! An owner counts as alive while one of its writes is under way (a renewal
//! or its completion, waiting for a connection, for the write turn or for
//! another connection's lock; a renewal, asked for in the owner's own
//! call, only while that call is polled: see `renewal`), and
//! for its lease after it last reserved or renewed (from when that
//! statement was sent) or after a write of its that failed ended: exactly
//! as long as the record's lease for an owner that never wrote again. A
//! call dropped without telling the store stops counting a lease after it
//! last wrote; a dropped call tells the store, which ends the owner (a
//! completion handed to the store's worker keeps it
//! at work until it is written or fenced out).

use super::OwnerToken;
use crate::identity::Identity;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The database an owner's record is in
/// ([`Store::database_id`](crate::Store::database_id); `None`: one its store
/// could not name, which may be any).
type Database = Option<Arc<str>>;

/// The owners, the latest listed for each identity in each database, and
/// how many there may be before those no longer alive are dropped.
struct Owners {
    by_token: HashMap<String, Owner>,
    /// The token of the owner of each identity listed last, per database:
    /// an older owner of the same identity in the same database was taken
    /// over from (its record is no longer its own). One identity's records
    /// in two databases have an owner each.
    by_identity: HashMap<Identity, Vec<(Database, String)>>,
    /// How many renewal statements of each owner are on their way, each
    /// sent after it saw its owner listed (see [`renewal_statement`]).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    renewing: HashMap<String, usize>,
    prune_at: usize,
}

/// When an owner last showed it is alive, for how long that counts, how
/// many of its writes are under way, and until when its record's lease
/// surely runs.
struct Owner {
    identity: Option<(Identity, Database)>,
    last: Instant,
    lease: Duration,
    writing: usize,
    /// The record's lease runs at least until then: from when its last
    /// reservation or renewal written was sent, for that lease (`None`:
    /// past any instant, a lease of centuries).
    leased_until: Option<Instant>,
    /// Its completion has begun: its body has run, and its answer is held
    /// for a takeover of this process (`unrecorded`), which records it
    /// instead of running the body again.
    completing: bool,
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
        by_identity: HashMap::new(),
        renewing: HashMap::new(),
        prune_at: PRUNE_AT_LEAST,
    })
});

fn owners() -> MutexGuard<'static, Owners> {
    OWNERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How far the database's clock may read behind this process's when a
/// statement runs: SQLite's `'now'` and MySQL's lease arithmetic are in
/// whole milliseconds, so a record's lease may end up to this much before
/// `sent + lease`.
const DATABASE_CLOCK_RESOLUTION: Duration = Duration::from_millis(1);

/// When a statement sent at `sent` or later, giving a lease of `lease`,
/// leaves the lease running until at least.
fn lease_from(sent: Instant) -> Instant {
    sent.checked_sub(DATABASE_CLOCK_RESOLUTION).unwrap_or(sent)
}

impl Owners {
    /// `token`'s owner, listed (of `identity`, with `lease`) if it was not:
    /// a renewal's owner is at work in this process (one dropped from the
    /// list while its lease had lapsed, its thread blocked past it, renews
    /// again), and its end must be seen by a renewal still on its way. It
    /// stands for its identity only if no other owner of it is listed: one
    /// listed is newer (it took the record over after this one was
    /// dropped from the list), and the old one's end would otherwise take
    /// the identity's listing with it.
    fn listed_for_a_renewal(
        &mut self,
        (identity, database): (&Identity, Option<&str>),
        token: &OwnerToken,
        lease: Duration,
        now: Instant,
    ) -> &mut Owner {
        if !self.by_token.contains_key(token.as_str())
            && !self
                .listed(identity, database)
                .is_some_and(|listed| self.by_token.contains_key(listed))
        {
            self.list(identity, database, token.as_str());
        }
        self.by_token
            .entry(token.as_str().to_owned())
            .or_insert_with(|| Owner {
                identity: Some((identity.clone(), database.map(Arc::from))),
                last: now,
                lease,
                writing: 0,
                // Not known: the lease may be over.
                leased_until: Some(now),
                completing: false,
            })
    }

    /// The token listed last for `identity` in `database`.
    fn listed(&self, identity: &Identity, database: Option<&str>) -> Option<&String> {
        self.by_identity
            .get(identity)?
            .iter()
            .find(|(listed, _)| listed.as_deref() == database)
            .map(|(_, token)| token)
    }

    /// Lists `token` as the owner of `identity` in `database`.
    fn list(&mut self, identity: &Identity, database: Option<&str>, token: &str) {
        let listed = self.by_identity.entry(identity.clone()).or_default();
        match listed.iter_mut().find(|(d, _)| d.as_deref() == database) {
            Some((_, listed)) => token.clone_into(listed),
            None => listed.push((database.map(Arc::from), token.to_owned())),
        }
    }

    fn remove(&mut self, token: &str) {
        if let Some(owner) = self.by_token.remove(token)
            && let Some((identity, database)) = owner.identity
            && let Some(listed) = self.by_identity.get_mut(&identity)
        {
            listed.retain(|(d, t)| !(d == &database && t == token));
            if listed.is_empty() {
                self.by_identity.remove(&identity);
            }
        }
    }
}

/// `token`'s owner reserved `identity` with `lease`, by a statement sent at
/// `sent` or later (so it counts no longer than the record's lease: from
/// [`DATABASE_CLOCK_RESOLUTION`] before `sent`; otherwise a transaction
/// taking over a crashed owner the moment its lease ran out was refused for
/// up to that long).
pub(super) fn reserved(
    (identity, database): (&Identity, Option<&str>),
    token: &OwnerToken,
    lease: Duration,
    sent: Instant,
) {
    let sent = lease_from(sent);
    let mut owners = owners();
    if owners.by_token.len() >= owners.prune_at {
        let now = Instant::now();
        owners.by_token.retain(|_, owner| owner.alive_at(now));
        let Owners {
            by_token,
            by_identity,
            ..
        } = &mut *owners;
        by_identity.retain(|_, listed| {
            listed.retain(|(_, token)| by_token.contains_key(token));
            !listed.is_empty()
        });
        // Pruned again only once as many more have come (amortized).
        owners.prune_at = (owners.by_token.len() * 2).max(PRUNE_AT_LEAST);
    }
    owners.by_token.insert(
        token.as_str().to_owned(),
        Owner {
            identity: Some((identity.clone(), database.map(Arc::from))),
            last: sent,
            lease,
            writing: 0,
            leased_until: sent.checked_add(lease),
            completing: false,
        },
    );
    owners.list(identity, database, token.as_str());
}

/// A store-mode reservation of a server store (PostgreSQL, MySQL):
/// `reserve`, its statement, sent now; an acquired record's owner is
/// listed, its lease counted from now (see [`reserved`]).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(super) async fn reservation<F, E>(
    (request, database): (&super::ReserveRequest<'_>, Option<&str>),
    reserve: F,
) -> Result<super::Reservation, E>
where
    F: std::future::Future<Output = Result<super::Reservation, E>>,
{
    let sent = Instant::now();
    let answer = reserve.await;
    if let Ok(super::Reservation::Acquired { .. }) = answer {
        reserved(
            (request.identity, database),
            request.token,
            request.lease,
            sent,
        );
    }
    answer
}

/// A store-mode completion of a server store (PostgreSQL, MySQL): `write`,
/// its statement. The owner is at work while it is written (its body has
/// run: see [`Writing`]), and done once it is written or fenced out; after
/// one that failed it counts for a lease (it is tried again).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(super) async fn completed<F, E>(token: &OwnerToken, write: F) -> Result<super::Fenced, E>
where
    F: std::future::Future<Output = Result<super::Fenced, E>>,
{
    let writing = Writing::completion(token);
    let done = write.await;
    drop(writing);
    if done.is_ok() {
        ended(token);
    }
    done
}

/// `token`'s owner renewed its lease (`lease`, not zero) by a statement
/// sent at `sent` or later, and it was written: the record's lease runs
/// until at least `sent + lease`, and the owner counts as alive that long
/// (not a lease after the write ended: an owner that never writes again is
/// taken over once the record's lease is over).
pub(super) fn renewed(token: &OwnerToken, lease: Duration, sent: Instant) {
    let sent = lease_from(sent);
    if let Some(owner) = owners().by_token.get_mut(token.as_str()) {
        owner.leased_until = sent.checked_add(lease);
        owner.lease = lease;
        if owner.writing == 0 {
            owner.last = sent;
        }
    }
}

/// `token`'s owner is done: completed, released, its lease ended on purpose
/// or lost.
pub(crate) fn ended(token: &OwnerToken) {
    owners().remove(token.as_str());
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
        Some(Box::new(Writing::completion(token)))
    } else {
        ended(token);
        None
    }
}

/// Whether `token`'s owner is listed: a renewal, which lists its owner as
/// it begins (see [`renewal`]), finds it no longer listed once it has been
/// ended (completed, released, its lease ended on purpose or lost): it then
/// has nothing left to renew (SQLite asks [`renewal_statement`], which
/// also counts the statement for the end of the lease to wait for).
#[cfg(test)]
pub(super) fn listed(token: &OwnerToken) -> bool {
    owners().by_token.contains_key(token.as_str())
}

/// Woken whenever a renewal statement of any owner has answered (see
/// [`renewals_landed`]).
#[cfg(feature = "sqlite")]
static RENEWAL_ANSWERED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// A renewal statement of a listed owner on its way (see
/// [`renewal_statement`]): counted until dropped.
#[cfg(feature = "sqlite")]
pub(super) struct RenewalStatement(String);

/// A renewal's statement of `token`'s owner may be sent, if the owner is
/// still listed (`None`: it was ended, completed, released or its lease
/// ended on purpose, and there is nothing left to renew). Until the answer
/// (dropped), the end of the owner's lease waits for it
/// ([`renewals_landed`]): a renewal that looked before the owner was ended
/// and sent its statement after the end was written gave the record a whole
/// lease again. Looking and counting are one step, so an end that ended
/// the owner before waiting sees every renewal that found it listed.
#[cfg(feature = "sqlite")]
pub(super) fn renewal_statement(token: &OwnerToken) -> Option<RenewalStatement> {
    let mut owners = owners();
    if !owners.by_token.contains_key(token.as_str()) {
        return None;
    }
    *owners
        .renewing
        .entry(token.as_str().to_owned())
        .or_insert(0) += 1;
    Some(RenewalStatement(token.as_str().to_owned()))
}

#[cfg(feature = "sqlite")]
impl Drop for RenewalStatement {
    fn drop(&mut self) {
        let mut owners = owners();
        if let Some(n) = owners.renewing.get_mut(&self.0) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                owners.renewing.remove(&self.0);
            }
        }
        drop(owners);
        RENEWAL_ANSWERED.notify_waiters();
    }
}

/// Waits until no renewal statement of `token`'s owner is on its way
/// ([`renewal_statement`]), `most` at most: `false` if one still was.
/// Asked by the end of a lease, after its owner was ended.
#[cfg(feature = "sqlite")]
pub(super) async fn renewals_landed(token: &OwnerToken, most: Duration) -> bool {
    let landed = async {
        loop {
            let notified = RENEWAL_ANSWERED.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if !owners().renewing.contains_key(token.as_str()) {
                return;
            }
            notified.await;
        }
    };
    tokio::time::timeout(most, landed).await.is_ok()
}

/// The lease of `token`'s owner, if listed.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(super) fn lease(token: &OwnerToken) -> Option<Duration> {
    owners()
        .by_token
        .get(token.as_str())
        .map(|owner| owner.lease)
}

/// Whether this process lists any owner (at work or not yet forgotten): when
/// it lists none, no record can have an owner at work here.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(super) fn any_listed() -> bool {
    !owners().by_token.is_empty()
}

/// Whether `token` names an owner of this process that is still at work.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(super) fn alive(token: &str) -> bool {
    owners()
        .by_token
        .get(token)
        .is_some_and(|owner| owner.alive_at(Instant::now()))
}

/// The databases in which `identity`'s record has an owner in this process
/// still at work, its body not yet answered, whose lease may have run out:
/// a renewal waiting (for a connection of a pool that the caller's
/// transaction may be holding), or its last renewal failed. A
/// transactional-mode reservation in the caller's transaction must not take
/// such a record over (the body would run twice, beside the live owner);
/// the lease may have run out because of that transaction, so it is refused
/// with `StaleSnapshot` (rolled back, it lets the owner write) when its
/// connection is on one of these databases ([`kept_in`]). No round trip:
/// asked before every transactional reservation, and empty (nothing
/// allocated) unless such an owner is listed; only then is the connection
/// asked which database it is on. An owner whose lease surely runs is left
/// to the store, which answers it (in progress, or its answer once
/// recorded); so is one whose completion has begun: a takeover records the
/// answer it holds (`unrecorded`), and the body does not run again.
pub(crate) fn may_be_kept_from_writing(identity: &Identity) -> Vec<Database> {
    let owners = owners();
    if owners.by_token.is_empty() {
        return Vec::new();
    }
    let now = Instant::now();
    let Some(listed) = owners.by_identity.get(identity) else {
        return Vec::new();
    };
    listed
        .iter()
        .filter(|(_, token)| {
            owners.by_token.get(token).is_some_and(|owner| {
                owner.alive_at(now)
                    && !owner.completing
                    && owner.leased_until.is_some_and(|until| now >= until)
            })
        })
        .map(|(database, _)| database.clone())
        .collect()
}

/// Whether a connection on `database` may be on one of the databases
/// `kept` ([`may_be_kept_from_writing`]; a database not known on either
/// side may be any: [`may_be_one_database`](super::may_be_one_database)).
pub(crate) fn kept_in(kept: &[Database], database: Option<&str>) -> bool {
    kept.iter()
        .any(|k| super::may_be_one_database(k.as_deref(), database))
}

/// A renewal of a listed owner's lease, asked for in the owner's own call
/// (its future): `write`, the renewal's statement, answers whether it was
/// written (on PostgreSQL and MySQL, and on SQLite on a current-thread
/// runtime, it is written in that very future; on SQLite on a
/// multi-threaded one, in a task the call waits for). While the call
/// drives it (waiting perhaps for a connection of the pool that a caller's
/// transaction holds), the owner is touched every third of its lease and
/// counts as alive; with a zero lease (ended on purpose) the owner is done
/// at once. A call no longer polled (a starved task, a future set aside:
/// rule 10's paused owner) touches nothing: its owner counts as alive for a
/// lease after the renewal began, and then a transactional caller may take
/// the record over, as any other caller may. (Counted alive for as long as
/// the renewal was under way, such an owner made every transactional call
/// of this process on its record `StaleSnapshot` for as long as its call
/// stayed unpolled.)
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(super) async fn renewal<F, E>(
    identity: (&Identity, Option<&str>),
    token: &OwnerToken,
    lease: Duration,
    write: F,
) -> Result<super::Fenced, E>
where
    F: std::future::Future<Output = Result<super::Fenced, E>>,
{
    if lease.is_zero() {
        ended(token);
        return write.await;
    }
    let sent = Instant::now();
    let under_way = RenewalUnderWay::begins(identity, token, lease, sent);
    let mut write = std::pin::pin!(write);
    let done = loop {
        tokio::select! {
            biased;
            done = &mut write => break done,
            () = tokio::time::sleep(lease / 3) => touch(token.as_str()),
        }
    };
    under_way.answered();
    match &done {
        Ok(super::Fenced::Written) => renewed(token, lease, sent),
        Ok(_) => ended(token),
        // Alive for a lease after the failed write ended.
        Err(_) => touch(token.as_str()),
    }
    done
}

/// A completion of `token`'s listed owner (its body has run) in SQLite,
/// asked for in the owner's own call: `write`, the completion's statement,
/// is written in that very future on a current-thread runtime (in a task
/// the call waits for on a multi-threaded one). The owner is marked
/// completing (see [`may_be_kept_from_writing`]) and, as for a [`renewal`],
/// counts as alive while the call polls the write (waiting perhaps for the
/// lock a caller's transaction holds), touched every third of its lease,
/// and for a lease after it was last touched or after the write ended. A
/// call no longer polled (rule 10's paused owner) touches nothing: counted
/// alive for as long as its completion was under way, it made every call
/// in a transaction that had written `StaleSnapshot` on its record for as
/// long as it stayed unpolled. An owner not listed is not listed by its
/// completion.
#[cfg(feature = "sqlite")]
pub(super) async fn completion<F: std::future::Future>(token: &OwnerToken, write: F) -> F::Output {
    let period = match owners().by_token.get_mut(token.as_str()) {
        Some(owner) => {
            owner.completing = true;
            owner.last = owner.last.max(Instant::now());
            (owner.lease / 3).max(Duration::from_millis(1))
        }
        None => Duration::ZERO,
    };
    if period.is_zero() {
        return write.await;
    }
    // Touched when dropped, answered or not: alive for a lease after.
    let _under_way = RenewalUnderWay(Some(token.as_str().to_owned()));
    let mut write = std::pin::pin!(write);
    loop {
        tokio::select! {
            biased;
            done = &mut write => return done,
            () = tokio::time::sleep(period) => touch(token.as_str()),
        }
    }
}

/// A renewal under way: dropped unanswered (its call dropped), the owner
/// counts as alive for a lease after.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
struct RenewalUnderWay(Option<String>);

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl RenewalUnderWay {
    fn begins(
        identity: (&Identity, Option<&str>),
        token: &OwnerToken,
        lease: Duration,
        now: Instant,
    ) -> Self {
        let mut owners = owners();
        let owner = owners.listed_for_a_renewal(identity, token, lease, now);
        owner.last = now;
        owner.lease = lease;
        RenewalUnderWay(Some(token.as_str().to_owned()))
    }

    fn answered(mut self) {
        self.0 = None;
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl Drop for RenewalUnderWay {
    fn drop(&mut self) {
        if let Some(token) = self.0.take() {
            touch(&token);
        }
    }
}

/// `token`'s owner, if listed, shows it is alive now.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
fn touch(token: &str) {
    if let Some(owner) = owners().by_token.get_mut(token) {
        owner.last = owner.last.max(Instant::now());
    }
}

/// A completion of a listed owner under way (its body has run), written
/// where the caller's polling does not matter (PostgreSQL and MySQL, whose
/// completing owners are never refused; the store's worker): the owner is
/// marked completing and counts as alive until it is dropped, and for its
/// lease after. (Renewals are [`renewal`]s, and SQLite's completions
/// [`completion`]s: counted only while their call polls them.)
pub(super) struct Writing(Option<String>);

impl Writing {
    /// A completion of `token`'s owner begins; an owner not listed is not
    /// listed by it.
    pub(super) fn completion(token: &OwnerToken) -> Self {
        let mut owners = owners();
        let Some(owner) = owners.by_token.get_mut(token.as_str()) else {
            return Writing(None);
        };
        owner.writing += 1;
        owner.last = Instant::now();
        owner.completing = true;
        Writing(Some(token.as_str().to_owned()))
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

    /// Whether an owner of `id`, in any database, may be kept from writing.
    fn kept(id: &Identity) -> bool {
        !may_be_kept_from_writing(id).is_empty()
    }

    /// An identity of its own (a fresh key).
    fn identity() -> Identity {
        Identity::new(
            "live_owners",
            "live_owners.unit",
            OwnerToken::new().as_str(),
        )
        .expect("identity")
    }

    /// A record's lease, on the database's millisecond clock, may end up to
    /// a millisecond before `sent + lease`: the owner never counts longer.
    #[test]
    fn a_reserved_owner_counts_no_longer_than_its_records_lease() {
        let token = OwnerToken::new();
        let lease = Duration::from_secs(1);
        let sent = Instant::now()
            .checked_sub(lease - Duration::from_micros(500))
            .expect("a second ago");
        reserved((&identity(), None), &token, lease, sent);
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
        reserved(
            (&identity(), None),
            &token,
            Duration::from_secs(1),
            long_ago,
        );
        assert!(any_listed(), "a reserved owner is listed, alive or not");
        assert!(
            !alive(token.as_str()),
            "its lease ran out, and it never wrote"
        );
        let writing = Writing::completion(&token);
        assert!(alive(token.as_str()), "a completion is under way");
        drop(writing);
        assert!(alive(token.as_str()), "for a lease after it wrote");
        let writing = Writing::completion(&token);
        ended(&token);
        drop(writing);
        assert!(!alive(token.as_str()), "ended stays ended");
        let unknown = OwnerToken::new();
        let writing = Writing::completion(&unknown);
        assert!(!alive(unknown.as_str()), "not listed by a completion alone");
        drop(writing);
        // A renewal of an owner no longer listed (dropped while its lease had
        // lapsed) lists it, and sees it ended while it waits.
        let writing = RenewalUnderWay::begins(
            (&identity(), None),
            &unknown,
            Duration::from_secs(60),
            Instant::now(),
        );
        assert!(alive(unknown.as_str()), "a renewal is under way");
        assert!(listed(&unknown));
        ended(&unknown);
        assert!(!listed(&unknown), "ended while the renewal waited");
        drop(writing);
        assert!(!alive(unknown.as_str()), "ended stays ended");
    }

    /// One identity's owners in two databases are listed apart: a newer
    /// owner in one database does not hide an older one in the other that
    /// may be kept from writing, and only the kept one's database is named
    /// ([`kept_in`]: a database not known may be any).
    #[test]
    fn owners_of_one_identity_in_two_databases_are_listed_apart() {
        let id = identity();
        let (kept_owner, other) = (OwnerToken::new(), OwnerToken::new());
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("a minute ago");
        reserved(
            (&id, Some("db-a")),
            &kept_owner,
            Duration::from_secs(1),
            long_ago,
        );
        let writing = RenewalUnderWay::begins(
            (&id, Some("db-a")),
            &kept_owner,
            Duration::from_secs(1),
            Instant::now(),
        );
        reserved(
            (&id, Some("db-b")),
            &other,
            Duration::from_secs(60),
            Instant::now(),
        );
        let databases = may_be_kept_from_writing(&id);
        assert_eq!(databases, vec![Some(Arc::from("db-a"))]);
        assert!(kept_in(&databases, Some("db-a")));
        assert!(
            !kept_in(&databases, Some("db-b")),
            "another database's record"
        );
        assert!(
            kept_in(&databases, None),
            "a connection that cannot name its database"
        );
        assert!(
            kept_in(&[None], Some("db-b")),
            "an owner whose database is not known"
        );
        ended(&other);
        assert_eq!(may_be_kept_from_writing(&id), vec![Some(Arc::from("db-a"))]);
        drop(writing);
        ended(&kept_owner);
        assert!(!kept(&id));
    }

    /// An owner whose write is under way after its lease may have run out
    /// may be kept from writing by the caller's transaction; one whose
    /// lease surely runs is left to the store; one ended, or never
    /// writing again after its lease, is not.
    #[test]
    fn an_owner_writing_past_its_lease_may_be_kept_from_writing() {
        let id = identity();
        let token = OwnerToken::new();
        assert!(!kept(&id), "never listed");
        reserved((&id, None), &token, Duration::from_secs(60), Instant::now());
        assert!(!kept(&id), "its lease surely runs");
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("a minute ago");
        reserved((&id, None), &token, Duration::from_secs(1), long_ago);
        assert!(!kept(&id), "crashed: its lease ran out");
        let writing =
            RenewalUnderWay::begins((&id, None), &token, Duration::from_secs(1), Instant::now());
        assert!(kept(&id), "its renewal waits");
        drop(writing);
        renewed(&token, Duration::from_secs(60), Instant::now());
        assert!(!kept(&id), "renewed: its lease surely runs");
        renewed(&token, Duration::from_secs(1), long_ago);
        assert!(!kept(&id), "alive no longer than its lease");
        let renewing =
            RenewalUnderWay::begins((&id, None), &token, Duration::from_secs(1), Instant::now());
        let writing = Writing::completion(&token);
        assert!(
            !kept(&id),
            "its completion waits: a takeover records the answer it holds"
        );
        ended(&token);
        assert!(!kept(&id), "ended");
        drop((writing, renewing));
        assert!(!kept(&id), "ended stays ended");
        // A newer owner of the identity is the one asked about.
        let newer = OwnerToken::new();
        reserved((&id, None), &token, Duration::from_secs(1), long_ago);
        let writing =
            RenewalUnderWay::begins((&id, None), &token, Duration::from_secs(1), Instant::now());
        assert!(kept(&id), "listed again, renewing");
        reserved((&id, None), &newer, Duration::from_secs(60), Instant::now());
        assert!(!kept(&id), "the record is the newer owner's");
        drop(writing);
        ended(&token);
        ended(&newer);
        // A lease of centuries never ends, and never overflows the clock.
        reserved((&id, None), &token, Duration::MAX, Instant::now());
        let writing = RenewalUnderWay::begins((&id, None), &token, Duration::MAX, Instant::now());
        renewed(&token, Duration::MAX, Instant::now());
        assert!(!kept(&id), "its lease surely runs");
        drop(writing);
        ended(&token);
    }

    /// A server store's renewal, made in the owner's call: while the call
    /// polls it (waiting for a connection, say), the owner counts as alive
    /// past its lease; set aside unpolled, for a lease after it began; its
    /// answer says what follows.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[tokio::test]
    async fn a_renewal_keeps_its_owner_alive_only_while_its_call_polls_it() {
        let id = identity();
        let token = OwnerToken::new();
        let lease = Duration::from_millis(600);
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("a minute ago");
        reserved((&id, None), &token, lease, long_ago);
        assert!(!kept(&id), "crashed: its lease ran out");
        let pool = tokio::sync::Notify::new();
        // Woken often meanwhile (as by its own timers), which must not keep
        // the owner from being touched.
        let waiting = async {
            loop {
                tokio::select! {
                    () = pool.notified() => break,
                    () = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
            Ok::<_, ()>(super::super::Fenced::Written)
        };
        let mut polled = std::pin::pin!(renewal((&id, None), &token, lease, waiting));
        // Polled for two leases: touched every third of one.
        let within = tokio::time::timeout(lease * 2, &mut polled).await;
        assert!(within.is_err(), "the write still waits");
        assert!(
            kept(&id),
            "its renewal waits while its call polls it, past a lease"
        );
        // Set aside: alive a lease after it was last touched, then not.
        tokio::time::sleep(lease + lease / 2).await;
        assert!(
            !kept(&id),
            "a paused owner's renewal does not keep it alive"
        );
        pool.notify_one();
        let written = polled.await;
        assert_eq!(written, Ok(super::super::Fenced::Written));
        assert!(
            !kept(&id),
            "written: counted from when it began, the store answers for it"
        );
        let renewed = renewal((&id, None), &token, lease, async {
            Ok::<_, ()>(super::super::Fenced::Written)
        })
        .await;
        assert_eq!(renewed, Ok(super::super::Fenced::Written));
        assert!(alive(token.as_str()), "renewed: alive for a lease");
        assert!(!kept(&id), "its lease surely runs");
        let fenced = renewal((&id, None), &token, lease, async {
            Ok::<_, ()>(super::super::Fenced::NotOwner)
        })
        .await;
        assert_eq!(fenced, Ok(super::super::Fenced::NotOwner));
        assert!(!alive(token.as_str()), "not the owner any more: ended");
    }

    /// SQLite's completion, asked for in the owner's call: marked
    /// completing; while the call polls it (waiting for the lock, say), the
    /// owner counts as alive past its lease; set aside unpolled, for a lease
    /// after it was last touched. An owner not listed stays unlisted.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_completion_keeps_its_owner_alive_only_while_its_call_polls_it() {
        let token = OwnerToken::new();
        let lease = Duration::from_millis(600);
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("a minute ago");
        reserved((&identity(), None), &token, lease, long_ago);
        assert!(!alive(token.as_str()), "crashed: its lease ran out");
        let lock = tokio::sync::Notify::new();
        let waiting = async {
            lock.notified().await;
            7
        };
        let mut polled = std::pin::pin!(completion(&token, waiting));
        let within = tokio::time::timeout(lease * 2, &mut polled).await;
        assert!(within.is_err(), "the write still waits");
        assert!(alive(token.as_str()), "polled: alive past a lease");
        tokio::time::sleep(lease + lease / 2).await;
        assert!(!alive(token.as_str()), "set aside: not alive a lease after");
        lock.notify_one();
        assert_eq!(polled.await, 7);
        assert!(alive(token.as_str()), "for a lease after the write ended");
        ended(&token);
        let unknown = OwnerToken::new();
        assert_eq!(completion(&unknown, async { 8 }).await, 8);
        assert!(!listed(&unknown), "not listed by a completion alone");
    }

    /// A SQLite renewal's statement is sent only while its owner is listed,
    /// and the end of the lease (its owner ended first) waits until every
    /// statement that saw it listed has answered; none is left counted.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn the_end_of_a_lease_waits_for_the_renewals_that_saw_their_owner_listed() {
        let token = OwnerToken::new();
        assert!(renewal_statement(&token).is_none(), "never listed");
        reserved(
            (&identity(), None),
            &token,
            Duration::from_secs(60),
            Instant::now(),
        );
        let statement = renewal_statement(&token).expect("listed");
        ended(&token);
        assert!(
            renewal_statement(&token).is_none(),
            "ended: nothing to renew"
        );
        assert!(
            !renewals_landed(&token, Duration::from_millis(50)).await,
            "a statement that saw its owner listed is on its way"
        );
        let landing = tokio::spawn({
            let token = token.clone();
            async move { renewals_landed(&token, Duration::from_secs(60)).await }
        });
        tokio::task::yield_now().await;
        drop(statement);
        assert!(landing.await.expect("task"), "answered: the end goes on");
        assert!(
            !owners().renewing.contains_key(token.as_str()),
            "nothing left counted"
        );
    }

    /// A renewal of an owner no longer listed (pruned while its lease had
    /// lapsed: its call paused past it) lists it again, but never in place
    /// of a newer owner of its identity listed meanwhile (one of this
    /// process that took the record over): the paused owner's renewal, once
    /// answered that the record is not its own any more, ended it and took
    /// the identity's listing with it, and the newer owner, its renewal
    /// waiting past its lease for a connection a caller's transaction held,
    /// was no longer known to be kept from writing: the transaction took
    /// the record over beside it.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    #[test]
    fn a_pruned_owners_renewal_never_hides_a_newer_owner_of_its_identity() {
        let id = identity();
        let (paused, newer) = (OwnerToken::new(), OwnerToken::new());
        let lease = Duration::from_secs(1);
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("a minute ago");
        reserved((&id, None), &paused, lease, long_ago);
        // Enough other owners at work that the lapsed one is pruned.
        let mut n = 0;
        while listed(&paused) {
            assert!(n < 10 * PRUNE_AT_LEAST, "the lapsed owner is pruned");
            reserved(
                (&identity(), None),
                &OwnerToken::new(),
                Duration::from_secs(600),
                Instant::now(),
            );
            n += 1;
        }
        // The newer owner took the record over; its renewal waits past its lease.
        reserved((&id, None), &newer, lease, long_ago);
        let renewing = RenewalUnderWay::begins((&id, None), &newer, lease, Instant::now());
        assert!(kept(&id));
        // The paused owner resumes: its renewal begins, and is told the
        // record is not its own.
        let resumed = RenewalUnderWay::begins((&id, None), &paused, lease, Instant::now());
        resumed.answered();
        ended(&paused);
        assert!(
            kept(&id),
            "the newer owner, still renewing past its lease, is still known"
        );
        drop(renewing);
        ended(&newer);
    }
}
