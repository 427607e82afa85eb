//! Operations, their generation, and running one sequence on a real store and
//! on the model side by side, comparing every answer and, after every step,
//! the record(s) the step touched (`fetch`).
//!
//! A store is *private* when nothing but this test touches it (memory, SQLite):
//! then everything is exact, including purge counts. A *shared* store
//! (PostgreSQL, MariaDB) is a database other tests use at the same time; they
//! may purge our expired records whenever they like, so an expired record of
//! the model may be gone from the store: wherever the store's answer shows it
//! gone, the model follows (absent), and nothing that depends on it is
//! asserted beyond that. Live records are never allowed to vanish.

use super::spec::{out, Answer, Dur, Fp, Outcome, Rec, LONG};
use futures::future::BoxFuture;
use idempotent_runtime::{
    AnsweredBy, Completion, Fenced, Fingerprint, Identity, MemoryStore, MySqlStore, OwnerToken,
    PgStore, RecordSnapshot, RecordState, Reservation, ReserveRequest, SqliteStore, Store,
    StoredOutcome,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

/// The identities of one case: the same key under (tenant, scope),
/// (other tenant, scope) and (tenant, other scope) — rule 1 on both axes.
pub const IDS: usize = 3;

/// Large enough for every identity of a case (and, on a shared database, for
/// the other tests' expired records ahead of ours).
pub const PURGE_BATCH: u32 = 1_000;

/// Which token an operation presents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tok {
    /// The current owner's (or, when nobody owns the record, the last owner's).
    Current,
    /// One offered to an earlier reservation of this identity, not the current
    /// owner's (n-th of them, modulo); a never-seen one when there is none.
    Stale(u8),
    /// A token no reservation ever offered.
    Unseen,
    /// Another identity's current (or last) token: same key, other tenant or scope.
    Other(u8),
}

/// One step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Reserve {
        id: usize,
        fp: Fp,
        lease: Dur,
        ttl: Dur,
    },
    /// A reservation presenting a token already offered (the engine never
    /// does: each call makes a fresh one); the model's answer is the same as
    /// for a fresh token. Only generated with `IDEMPOTENT_MODEL_REUSE_TOKENS=1`.
    ReserveAs {
        id: usize,
        tok: Tok,
        fp: Fp,
        lease: Dur,
        ttl: Dur,
    },
    Complete {
        id: usize,
        tok: Tok,
        outcome: Outcome,
        ttl: Dur,
    },
    /// `AnsweredBy::RecoverHook`: a recover hook's answer (rule 20).
    CompleteRecovered {
        id: usize,
        tok: Tok,
        outcome: Outcome,
        ttl: Dur,
    },
    Release {
        id: usize,
        tok: Tok,
    },
    Heartbeat {
        id: usize,
        tok: Tok,
        lease: Dur,
    },
    Purge,
    Fetch {
        id: usize,
    },
    Stats,
}

fn ident() -> impl Strategy<Value = usize> {
    // Identity 0 is the busiest, so one record sees long histories.
    prop_oneof![3 => Just(0usize), 2 => Just(1usize), 1 => Just(2usize)]
}

fn dur() -> impl Strategy<Value = Dur> {
    prop_oneof![Just(Dur::Long), Just(Dur::Zero)]
}

fn fp() -> impl Strategy<Value = Fp> {
    prop_oneof![Just(Fp::A), Just(Fp::Nil), Just(Fp::B)]
}

fn tok() -> impl Strategy<Value = Tok> {
    prop_oneof![
        4 => Just(Tok::Current),
        2 => any::<u8>().prop_map(Tok::Stale),
        1 => Just(Tok::Unseen),
        1 => any::<u8>().prop_map(Tok::Other),
    ]
}

fn outcome() -> impl Strategy<Value = Outcome> {
    (any::<bool>(), proptest::collection::vec(any::<u8>(), 0..8))
        .prop_map(|(is_error, payload)| out(is_error, &payload))
}

/// One step: weighted towards reservations, where most of the rules are.
pub fn op(reuse_tokens: bool) -> impl Strategy<Value = Op> {
    prop_oneof![
        if reuse_tokens { 2 } else { 0 } => (ident(), tok(), fp(), dur(), dur())
            .prop_map(|(id, tok, fp, lease, ttl)| Op::ReserveAs { id, tok, fp, lease, ttl }),
        6 => (ident(), fp(), dur(), dur())
            .prop_map(|(id, fp, lease, ttl)| Op::Reserve { id, fp, lease, ttl }),
        3 => (ident(), tok(), outcome(), dur())
            .prop_map(|(id, tok, outcome, ttl)| Op::Complete { id, tok, outcome, ttl }),
        1 => (ident(), tok(), outcome(), dur())
            .prop_map(|(id, tok, outcome, ttl)| Op::CompleteRecovered { id, tok, outcome, ttl }),
        2 => (ident(), tok()).prop_map(|(id, tok)| Op::Release { id, tok }),
        2 => (ident(), tok(), dur()).prop_map(|(id, tok, lease)| Op::Heartbeat { id, tok, lease }),
        1 => Just(Op::Purge),
        1 => ident().prop_map(|id| Op::Fetch { id }),
        1 => Just(Op::Stats),
    ]
}

/// One case's store, model and bookkeeping.
pub struct World<'s> {
    store: &'s dyn Store,
    private: bool,
    ids: [Identity; IDS],
    /// Scope and the identities in it, for `Stats`.
    scopes: [(String, Vec<usize>); 2],
    recs: [Rec; IDS],
    /// Every token offered to a reservation of each identity, in order.
    offered: [Vec<OwnerToken>; IDS],
    /// The tokens that acquired each identity, in order.
    owners: [Vec<OwnerToken>; IDS],
    fp_a: Fingerprint,
    fp_b: Fingerprint,
}

fn store_err(what: &str) -> impl FnOnce(idempotent_runtime::StoreError) -> String + '_ {
    move |e| format!("{what} failed: {e}")
}

/// The fresh tenants and scopes of one case.
#[derive(Clone, Debug)]
pub struct Names {
    pub tenants: [String; 2],
    pub scopes: [String; 2],
}

impl Names {
    pub fn fresh() -> Self {
        let uid = || uuid::Uuid::new_v4().simple().to_string();
        Names {
            tenants: [format!("model-{}", uid()), format!("model-{}", uid())],
            scopes: [format!("model.{}", uid()), format!("model.{}", uid())],
        }
    }
}

impl<'s> World<'s> {
    pub fn new(store: &'s dyn Store, private: bool, names: &Names) -> Self {
        let [t1, t2] = &names.tenants;
        let [s1, s2] = &names.scopes;
        let id = |t: &str, s: &str| Identity::new(t, s, "k").expect("a valid identity");
        World {
            store,
            private,
            ids: [id(t1, s1), id(t2, s1), id(t1, s2)],
            scopes: [(s1.clone(), vec![0, 1]), (s2.clone(), vec![2])],
            recs: [Rec::Absent, Rec::Absent, Rec::Absent],
            offered: Default::default(),
            owners: Default::default(),
            fp_a: Fingerprint::of("model request a").expect("fingerprint"),
            fp_b: Fingerprint::of("model request b").expect("fingerprint"),
        }
    }

    pub fn recs(&self) -> &[Rec; IDS] {
        &self.recs
    }

    fn fingerprint(&self, fp: Fp) -> Option<&Fingerprint> {
        match fp {
            Fp::Nil => None,
            Fp::A => Some(&self.fp_a),
            Fp::B => Some(&self.fp_b),
        }
    }

    /// Whether the store may have lost this record to someone else's purge.
    fn may_vanish(&self, id: usize) -> bool {
        !self.private && self.recs[id].expired()
    }

    fn current_or_last(&self, id: usize) -> Option<OwnerToken> {
        match self.recs[id].owner() {
            Some(t) => Some(OwnerToken::from_stored(t)),
            None => self.owners[id].last().cloned(),
        }
    }

    fn token(&self, id: usize, tok: Tok) -> OwnerToken {
        let found = match tok {
            Tok::Current => self.current_or_last(id),
            Tok::Stale(n) => {
                let owner = self.recs[id].owner();
                let stale: Vec<&OwnerToken> = self.offered[id]
                    .iter()
                    .filter(|t| Some(t.as_str()) != owner)
                    .collect();
                (!stale.is_empty()).then(|| stale[n as usize % stale.len()].clone())
            }
            Tok::Unseen => None,
            Tok::Other(n) => self.current_or_last((id + 1 + n as usize % (IDS - 1)) % IDS),
        };
        found.unwrap_or_default()
    }

    pub async fn step(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Reserve { id, fp, lease, ttl } => {
                self.reserve(id, OwnerToken::new(), fp, lease, ttl).await
            }
            Op::ReserveAs {
                id,
                tok,
                fp,
                lease,
                ttl,
            } => {
                let token = self.token(id, tok);
                self.reserve(id, token, fp, lease, ttl).await
            }
            Op::Complete {
                id,
                tok,
                ref outcome,
                ttl,
            } => self.complete(id, tok, outcome, ttl, false).await,
            Op::CompleteRecovered {
                id,
                tok,
                ref outcome,
                ttl,
            } => self.complete(id, tok, outcome, ttl, true).await,
            Op::Release { id, tok } => {
                let token = self.token(id, tok);
                let got = self
                    .store
                    .release(&self.ids[id], &token)
                    .await
                    .map_err(store_err("release"))?;
                let mut after = self.recs[id].clone();
                let want = after.release(token.as_str());
                self.settle(id, after, want, got, "release")?;
                self.observe(id).await
            }
            Op::Heartbeat { id, tok, lease } => {
                let token = self.token(id, tok);
                let got = self
                    .store
                    .heartbeat(&self.ids[id], &token, lease.duration())
                    .await
                    .map_err(store_err("heartbeat"))?;
                let mut after = self.recs[id].clone();
                let want = after.heartbeat(token.as_str(), lease);
                self.settle(id, after, want, got, "heartbeat")?;
                self.observe(id).await
            }
            Op::Purge => self.purge().await,
            Op::Fetch { id } => self.observe(id).await,
            Op::Stats => self.stats().await,
        }
    }

    async fn complete(
        &mut self,
        id: usize,
        tok: Tok,
        outcome: &Outcome,
        ttl: Dur,
        recovered: bool,
    ) -> Result<(), String> {
        let token = self.token(id, tok);
        let stored = StoredOutcome {
            is_error: outcome.is_error,
            payload: outcome.payload.clone(),
        };
        let (identity, ttl_d) = (&self.ids[id], ttl.duration());
        let by = if recovered {
            AnsweredBy::RecoverHook
        } else {
            AnsweredBy::Body
        };
        let got = self
            .store
            .complete(Completion {
                identity,
                token: &token,
                outcome: &stored,
                ttl: ttl_d,
                by,
            })
            .await
            .map_err(store_err("complete"))?;
        let mut after = self.recs[id].clone();
        let want = after.complete(token.as_str(), outcome, ttl, recovered);
        self.settle(id, after, want, got, "complete")?;
        self.observe(id).await
    }

    async fn reserve(
        &mut self,
        id: usize,
        token: OwnerToken,
        fp: Fp,
        lease: Dur,
        ttl: Dur,
    ) -> Result<(), String> {
        if !self.offered[id].contains(&token) {
            self.offered[id].push(token.clone());
        }
        let got = self
            .store
            .reserve(ReserveRequest {
                identity: &self.ids[id],
                fingerprint: self.fingerprint(fp),
                token: &token,
                lease: lease.duration(),
                ttl: ttl.duration(),
            })
            .await
            .map_err(store_err("reserve"))?;
        let want = self.recs[id].reserve(token.as_str(), fp, lease, ttl);
        if matches!(want, Answer::Acquired { .. }) {
            self.owners[id].push(token);
        }
        check_answer(&want, &got)?;
        self.observe(id).await
    }

    /// Takes the model's answer when the store agrees; on a shared store, a
    /// `false` from an expired record means someone purged it meanwhile.
    fn settle(
        &mut self,
        id: usize,
        after: Rec,
        want: bool,
        got: Fenced,
        what: &str,
    ) -> Result<(), String> {
        if want == got.is_written() {
            self.recs[id] = after;
            Ok(())
        } else if !got.is_written() && self.may_vanish(id) {
            self.recs[id] = Rec::Absent;
            Ok(())
        } else {
            Err(format!(
                "{what} on identity {id} answered {got:?}, the model expects written = {want}"
            ))
        }
    }

    /// Fetches one identity and compares it with the model.
    async fn observe(&mut self, id: usize) -> Result<(), String> {
        let snap = self
            .store
            .fetch(&self.ids[id])
            .await
            .map_err(store_err("fetch"))?;
        if snap.is_none() && self.may_vanish(id) {
            self.recs[id] = Rec::Absent;
            return Ok(());
        }
        self.compare(id, snap.as_ref()).map_err(|e| {
            format!(
                "identity {id}: {e}; model {:?}; store {snap:?}",
                self.recs[id]
            )
        })
    }

    fn compare(&self, id: usize, snap: Option<&RecordSnapshot>) -> Result<(), String> {
        let rec = &self.recs[id];
        let Some(s) = snap else {
            return match rec {
                Rec::Absent => Ok(()),
                _ => Err("the store has no record".into()),
            };
        };
        let fp_str = |fp: Fp| self.fingerprint(fp).map(|f| f.as_str().to_owned());
        let ttl_out = s.expires_at_ms <= s.now_ms;
        let problem = match rec {
            Rec::Absent => Some("the store has a record, the model none"),
            Rec::InProgress {
                owner,
                fp,
                lease_expired,
                ttl_expired,
                attempt,
                ..
            } => {
                let lease_out = s.lease_expires_at_ms.map(|l| l <= s.now_ms);
                if s.state != RecordState::InProgress {
                    Some("state")
                } else if s.fingerprint != fp_str(*fp) {
                    Some("fingerprint")
                } else if s.owner_token.as_deref() != Some(owner.as_str()) {
                    Some("owner token")
                } else if s.outcome.is_some() {
                    Some("an in-progress record has an outcome")
                } else if lease_out != Some(*lease_expired) {
                    Some("lease expiry")
                } else if ttl_out != *ttl_expired {
                    Some("ttl expiry")
                } else if s.attempt != *attempt {
                    Some("attempt")
                } else if s.recovered {
                    Some("an in-progress record is marked recovered")
                } else {
                    None
                }
            }
            Rec::Complete {
                outcome,
                fp,
                ttl_expired,
                attempt,
                recovered,
            } => {
                if s.state != RecordState::Complete {
                    Some("state")
                } else if s.fingerprint != fp_str(*fp) {
                    Some("fingerprint")
                } else if s.owner_token.is_some() {
                    Some("a complete record has an owner token")
                } else if s.outcome.as_ref().map(|o| out(o.is_error, &o.payload))
                    != Some(outcome.clone())
                {
                    Some("outcome")
                } else if s.lease_expires_at_ms.is_some() {
                    Some("a complete record has a lease")
                } else if ttl_out != *ttl_expired {
                    Some("ttl expiry")
                } else if s.attempt != *attempt {
                    Some("attempt")
                } else if s.recovered != *recovered {
                    Some("recovered")
                } else {
                    None
                }
            }
        };
        let problem =
            problem.or_else(|| (s.is_expired() != rec.expired()).then_some("is_expired()"));
        match problem {
            None => Ok(()),
            Some(p) => Err(format!("fetch differs: {p}")),
        }
    }

    async fn purge(&mut self) -> Result<(), String> {
        let doomed: Vec<usize> = (0..IDS).filter(|&i| self.recs[i].expired()).collect();
        if self.private {
            let n = self
                .store
                .purge_expired(PURGE_BATCH)
                .await
                .map_err(store_err("purge"))?;
            if n != doomed.len() as u64 {
                return Err(format!(
                    "purge deleted {n} records; the model has {} expired ({doomed:?})",
                    doomed.len()
                ));
            }
        } else {
            // Other tests' expired records may come first in a batch: purge
            // until ours are gone, a bounded number of times.
            let mut left = doomed.clone();
            for _ in 0..10 {
                if left.is_empty() {
                    break;
                }
                let n = self
                    .store
                    .purge_expired(PURGE_BATCH)
                    .await
                    .map_err(store_err("purge"))?;
                if n > u64::from(PURGE_BATCH) {
                    return Err(format!("purge deleted {n} in a batch of {PURGE_BATCH}"));
                }
                let mut still = Vec::new();
                for &i in &left {
                    if self
                        .store
                        .fetch(&self.ids[i])
                        .await
                        .map_err(store_err("fetch"))?
                        .is_some()
                    {
                        still.push(i);
                    }
                }
                left = still;
            }
            if !left.is_empty() {
                return Err(format!("ten purges left the expired records {left:?}"));
            }
        }
        for rec in &mut self.recs {
            rec.purge();
        }
        for id in 0..IDS {
            self.observe(id).await?;
        }
        Ok(())
    }

    /// Rule 19's raw material: per-scope counts of this case's records.
    async fn stats(&mut self) -> Result<(), String> {
        let stats = self
            .store
            .scope_stats()
            .await
            .map_err(store_err("scope_stats"))?;
        for (scope, members) in &self.scopes {
            let got = stats.iter().find(|s| &s.scope == scope);
            let count = |f: &dyn Fn(&Rec) -> bool| {
                members.iter().filter(|&&i| f(&self.recs[i])).count() as u64
            };
            let complete = count(&|r| r.live() && matches!(r, Rec::Complete { .. }));
            let in_progress = count(&|r| {
                matches!(
                    r,
                    Rec::InProgress {
                        lease_expired: false,
                        ..
                    }
                )
            });
            let stuck = count(&|r| {
                r.live()
                    && matches!(
                        r,
                        Rec::InProgress {
                            lease_expired: true,
                            ..
                        }
                    )
            });
            let expired = count(&|r| r.expired());
            let taken_over = count(&|r| r.live() && r.attempt() > 1);
            let recovered = count(&|r| {
                r.live()
                    && matches!(
                        r,
                        Rec::Complete {
                            recovered: true,
                            ..
                        }
                    )
            });
            let (g_complete, g_in_progress, g_stuck, g_expired, g_oldest) =
                got.map_or((0, 0, 0, 0, None), |s| {
                    (
                        s.complete,
                        s.in_progress,
                        s.stuck,
                        s.expired,
                        s.oldest_created_at_ms,
                    )
                });
            let (g_taken_over, g_recovered) = got.map_or((0, 0), |s| (s.taken_over, s.recovered));
            let expired_ok = if self.private {
                g_expired == expired
            } else {
                g_expired <= expired
            };
            let present = complete + in_progress + stuck + g_expired;
            if g_complete != complete
                || g_in_progress != in_progress
                || g_stuck != stuck
                || !expired_ok
                || g_oldest.is_some() != (present > 0)
                || g_taken_over != taken_over
                || g_recovered != recovered
            {
                return Err(format!(
                    "scope_stats for {scope}: store {got:?}; model complete {complete}, \
                     in_progress {in_progress}, stuck {stuck}, expired {expired}, \
                     taken_over {taken_over}, recovered {recovered}"
                ));
            }
        }
        Ok(())
    }
}

fn check_answer(want: &Answer, got: &Reservation) -> Result<(), String> {
    let agrees = match (want, got) {
        (
            Answer::Acquired { attempt: want },
            Reservation::Acquired {
                took_over,
                attempt,
                previous_attempt_started_at_ms,
            },
        ) => {
            // Rule 20: the attempt number, and the previous start exactly on a takeover.
            want == attempt
                && *took_over == (*want > 1)
                && previous_attempt_started_at_ms.is_some() == *took_over
        }
        (Answer::Completed(o), Reservation::Completed(s)) => *o == out(s.is_error, &s.payload),
        (Answer::InProgress, Reservation::InProgress { lease_remaining }) => {
            !lease_remaining.is_zero() && *lease_remaining <= LONG
        }
        (Answer::Mismatch, Reservation::FingerprintMismatch) => true,
        _ => false,
    };
    if agrees {
        Ok(())
    } else {
        Err(format!(
            "reserve answered {got:?}, the model expects {want:?}"
        ))
    }
}

/// Runs one sequence on a fresh tenant and scopes. On a private store, first
/// purges what earlier cases left expired, so purge counts are exact.
pub async fn run_sequence(
    store: &dyn Store,
    private: bool,
    names: &Names,
    ops: &[Op],
) -> Result<(), String> {
    if private {
        store
            .purge_expired(u32::MAX)
            .await
            .map_err(store_err("the initial purge"))?;
    }
    let mut world = World::new(store, private, names);
    for (i, op) in ops.iter().enumerate() {
        let before = world.recs().clone();
        world
            .step(op)
            .await
            .map_err(|e| format!("step {i}, {op:?}: {e}\n  model before the step: {before:?}"))?;
    }
    Ok(())
}

fn env_u32(name: &str, default: u32) -> u32 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
        Err(_) => default,
    }
}

/// Sequences per store (`IDEMPOTENT_MODEL_CASES` overrides it).
pub const DEFAULT_CASES: u32 = 128;
/// The longest sequence (`IDEMPOTENT_MODEL_STEPS`, default 60; lengths are uniform in 1..=that).
pub const DEFAULT_MAX_STEPS: u32 = 60;

/// A store opened for the model test.
pub struct Fixture<S> {
    pub store: S,
    /// Nothing but this test uses the store's database, so every count is
    /// exact; otherwise (a database shared with other tests) our expired
    /// records may be purged by others at any time.
    pub private: bool,
    /// Runs after the test, once the store is dropped (drops a private database).
    pub teardown: Option<BoxFuture<'static, ()>>,
}

impl<S> Fixture<S> {
    pub fn private(store: S) -> Self {
        Fixture {
            store,
            private: true,
            teardown: None,
        }
    }
}

/// A store the model test runs on.
pub trait Target: Store + Sized + 'static {
    /// Deletes a finished case's records, so the database does not accumulate
    /// them (their ttl is an hour) and later cases cost what the first did.
    fn forget<'a>(&'a self, names: &'a Names) -> BoxFuture<'a, Result<(), String>> {
        let _ = names;
        Box::pin(async { Ok(()) })
    }
}

impl Target for MemoryStore {}

impl Target for SqliteStore {
    fn forget<'a>(&'a self, names: &'a Names) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            sqlx::query("DELETE FROM idempotency_records WHERE tenant IN (?1, ?2)")
                .bind(&names.tenants[0])
                .bind(&names.tenants[1])
                .execute(self.pool())
                .await
                .map(drop)
                .map_err(|e| format!("deleting the case's records: {e}"))
        })
    }
}

impl Target for PgStore {
    fn forget<'a>(&'a self, names: &'a Names) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            sqlx::query("DELETE FROM idempotency_records WHERE tenant = ANY($1)")
                .bind(&names.tenants[..])
                .execute(self.pool())
                .await
                .map(drop)
                .map_err(|e| format!("deleting the case's records: {e}"))
        })
    }
}

impl Target for MySqlStore {
    fn forget<'a>(&'a self, names: &'a Names) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            sqlx::query("DELETE FROM idempotency_records WHERE tenant IN (?, ?)")
                .bind(names.tenants[0].as_bytes())
                .bind(names.tenants[1].as_bytes())
                .execute(self.pool())
                .await
                .map(drop)
                .map_err(|e| format!("deleting the case's records: {e}"))
        })
    }
}

/// Runs one sequence on a fresh case of `store`, then deletes its records.
pub async fn run_case<S: Target>(store: &S, private: bool, ops: &[Op]) -> Result<(), String> {
    let names = Names::fresh();
    let result = run_sequence(store, private, &names, ops).await;
    let forgotten = store.forget(&names).await;
    result.and(forgotten)
}

/// The model test for one store: `open` opens it (inside the test's
/// runtime), `None` when its server is unreachable (after a loud SKIPPED line).
pub fn run_model<F, Fut, S>(name: &str, default_cases: u32, open: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Option<Fixture<S>>>,
    S: Target,
{
    let rt = runtime();
    let Some(fixture) = rt.block_on(open()) else {
        return;
    };
    let (store, private) = (fixture.store, fixture.private);
    let cases = env_u32("IDEMPOTENT_MODEL_CASES", default_cases);
    let max_steps = env_u32("IDEMPOTENT_MODEL_STEPS", DEFAULT_MAX_STEPS).max(1) as usize;
    let seed = match std::env::var("IDEMPOTENT_MODEL_SEED") {
        Ok(v) => v.parse().expect("IDEMPOTENT_MODEL_SEED is a u64"),
        Err(_) => rand_seed(),
    };
    let config = Config {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(seed),
        ..Config::default()
    };
    let steps = AtomicU64::new(0);
    let runs = AtomicU64::new(0);
    let started = std::time::Instant::now();
    let reuse_tokens = env_u32("IDEMPOTENT_MODEL_REUSE_TOKENS", 0) == 1;
    let strategy = proptest::collection::vec(op(reuse_tokens), 1..=max_steps);
    let result = TestRunner::new(config).run(&strategy, |ops| {
        runs.fetch_add(1, Ordering::Relaxed);
        steps.fetch_add(ops.len() as u64, Ordering::Relaxed);
        rt.block_on(run_case(&store, private, &ops))
            .map_err(TestCaseError::fail)
    });
    let elapsed = started.elapsed();
    rt.block_on(async move {
        drop(store);
        if let Some(teardown) = fixture.teardown {
            teardown.await;
        }
    });
    let (runs, steps) = (runs.into_inner(), steps.into_inner());
    let db = if private {
        "private store"
    } else {
        "shared database"
    };
    match result {
        Ok(()) => println!(
            "model[{name}, {db}]: {runs} sequences, {steps} steps agreed with the model \
             in {elapsed:.1?} (seed {seed})"
        ),
        Err(TestError::Fail(why, ops)) => panic!(
            "model[{name}, {db}]: the store disagrees with the model (seed {seed}, \
             {runs} sequences / {steps} steps run, shrinking included).\n\
             Shortest sequence found ({} ops):\n{}\n{why}",
            ops.len(),
            format_ops(&ops)
        ),
        Err(TestError::Abort(why)) => panic!("model[{name}]: aborted: {why}"),
    }
}

/// Runs one fixed sequence (a regression test) on a store.
pub fn replay<F, Fut, S>(open: F, ops: &[Op])
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Option<Fixture<S>>>,
    S: Target,
{
    let rt = runtime();
    let result = rt.block_on(async {
        let fixture = open().await?;
        let result = run_case(&fixture.store, fixture.private, ops).await;
        let name = fixture.store.name();
        drop(fixture.store);
        if let Some(teardown) = fixture.teardown {
            teardown.await;
        }
        Some(result.map_err(|e| format!("{name} disagrees with the model: {e}")))
    });
    if let Some(Err(e)) = result {
        panic!("{e}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a Tokio runtime")
}

/// A sequence as the Rust that rebuilds it (for a regression test).
pub fn format_ops(ops: &[Op]) -> String {
    let mut s = String::from("vec![\n");
    for op in ops {
        s.push_str(&format!("    {op:?},\n"));
    }
    s.push(']');
    s
}

fn rand_seed() -> u64 {
    let id = uuid::Uuid::new_v4();
    let b = id.as_bytes();
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}
