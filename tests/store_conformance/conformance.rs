//! The store conformance suite: every store-level rule of the behaviour
//! contract (DESIGN.md §4), checked against the [`Store`] trait alone.
//!
//! A test file runs it against one store with
//!
//! ```ignore
//! mod conformance;
//! store_conformance_tests!(async { Some(MyStore::connect(url).await.unwrap()) });
//! ```
//!
//! The factory is an `async` block giving `Option<S>` for some
//! `S: Store + Clone + 'static`; `None` means the store's server is
//! unreachable, and each test then prints a loud `SKIPPED:` line and returns.
//!
//! The suite runs unchanged against a database shared with other tests running
//! in parallel and with earlier runs: every test works under its own random
//! tenant (and, where it counts per scope, its own random scope), asserts only
//! on its own identities, and never on global counts. Expiry is tested with
//! short leases and ttls and real sleeps with wide margins; nothing asserts how
//! long an operation took.

#![allow(dead_code)]

use idempotent_runtime::{
    AnsweredBy, Completion, Fenced, Fingerprint, ForcedRelease, Identity, OwnerToken,
    RecordSnapshot, RecordState, Reservation, ReserveRequest, Store, StoredOutcome,
};
use std::time::Duration;

/// A lease or ttl meant to run out during the test.
pub const SHORT: Duration = Duration::from_millis(250);
/// How long to sleep for a [`SHORT`] lease or ttl to have run out, with margin.
pub const PAST_SHORT: Duration = Duration::from_millis(700);
/// A lease or ttl that must not run out during the test.
pub const LONG: Duration = Duration::from_secs(300);

/// Concurrent tasks per round in the atomicity tests.
pub const TASKS: usize = 50;
/// Rounds in the atomicity tests.
pub const ROUNDS: usize = 12;

/// Prints the loud line a skipped test leaves in the output.
pub fn skipped(test: &str) {
    let line = format!(
        "SKIPPED: store conformance test `{test}` did not run: the store factory returned None \
         (its database server is unreachable)"
    );
    println!("{line}");
    eprintln!("{line}");
}

/// A tenant no other test (or earlier run) uses.
pub fn fresh_tenant() -> String {
    format!("conf-{}", uuid::Uuid::new_v4().simple())
}

/// A scope no other test (or earlier run) uses.
pub fn fresh_scope(prefix: &str) -> String {
    format!("{prefix}.{}", uuid::Uuid::new_v4().simple())
}

pub fn id(tenant: &str, scope: &str, key: &str) -> Identity {
    Identity::new(tenant, scope, key).expect("a valid identity")
}

pub fn fp(value: &str) -> Fingerprint {
    Fingerprint::of(value).expect("a string fingerprints")
}

pub fn ok(payload: &[u8]) -> StoredOutcome {
    StoredOutcome {
        is_error: false,
        payload: payload.to_vec(),
    }
}

pub async fn reserve<S: Store + ?Sized>(
    store: &S,
    identity: &Identity,
    fingerprint: Option<&Fingerprint>,
    token: &OwnerToken,
    lease: Duration,
    ttl: Duration,
) -> Reservation {
    store
        .reserve(ReserveRequest {
            identity,
            fingerprint,
            token,
            lease,
            ttl,
        })
        .await
        .expect("reserve succeeds")
}

/// Reserves a free identity and asserts a fresh acquire; returns the owner's token.
pub async fn acquire<S: Store + ?Sized>(
    store: &S,
    identity: &Identity,
    fingerprint: Option<&Fingerprint>,
    lease: Duration,
    ttl: Duration,
) -> OwnerToken {
    let token = OwnerToken::new();
    let got = reserve(store, identity, fingerprint, &token, lease, ttl).await;
    assert_eq!(
        got,
        Reservation::FRESH,
        "a free identity is acquired fresh: {identity:?}"
    );
    token
}

/// Asserts a takeover (rule 10) as attempt `attempt` (rule 20): `took_over`,
/// the attempt number, and when the previous attempt started.
pub fn assert_takeover(got: &Reservation, attempt: u32) {
    match got {
        Reservation::Acquired {
            took_over: true,
            attempt: a,
            previous_attempt_started_at_ms: Some(started),
        } if *a == attempt && *started > 0 => {}
        other => panic!("expected a takeover as attempt {attempt}, got {other:?}"),
    }
}

/// Acquires and completes an identity with `payload`; returns the token it had.
pub async fn record<S: Store + ?Sized>(
    store: &S,
    identity: &Identity,
    fingerprint: Option<&Fingerprint>,
    outcome: &StoredOutcome,
    ttl: Duration,
) -> OwnerToken {
    let token = acquire(store, identity, fingerprint, LONG, ttl).await;
    assert_eq!(
        store
            .complete(Completion::by_body(identity, &token, outcome, ttl))
            .await
            .expect("complete succeeds"),
        Fenced::Written,
        "the owner completes its record"
    );
    token
}

pub async fn fetch<S: Store + ?Sized>(store: &S, identity: &Identity) -> Option<RecordSnapshot> {
    store.fetch(identity).await.expect("fetch succeeds")
}

/// Asserts two snapshots show the same record (the clock reading aside).
pub fn assert_same_record(before: &RecordSnapshot, after: &RecordSnapshot, what: &str) {
    let strip = |s: &RecordSnapshot| RecordSnapshot {
        now_ms: 0,
        ..s.clone()
    };
    assert_eq!(
        strip(before),
        strip(after),
        "{what}: the record must be untouched"
    );
}

// ---------------------------------------------------------------- rule 1

/// Rule 1: the same scope and key under two tenants are two records.
pub async fn identity_separated_by_tenant<S: Store + Clone + 'static>(store: S) {
    let (t1, t2) = (fresh_tenant(), fresh_tenant());
    let a = id(&t1, "conformance.identity", "same-key");
    let b = id(&t2, "conformance.identity", "same-key");
    let fa = fp("request a");
    let fb = fp("request b");
    let ta = acquire(&store, &a, Some(&fa), LONG, LONG).await;
    // The other tenant is not in progress, and its fingerprint does not clash.
    let tb = acquire(&store, &b, Some(&fb), LONG, LONG).await;
    assert_eq!(
        store
            .complete(Completion::by_body(&a, &ta, &ok(b"\"for a\""), LONG))
            .await
            .unwrap(),
        Fenced::Written
    );
    assert_eq!(
        store
            .complete(Completion::by_body(&b, &tb, &ok(b"\"for b\""), LONG))
            .await
            .unwrap(),
        Fenced::Written
    );
    let again = OwnerToken::new();
    assert_eq!(
        reserve(&store, &a, Some(&fa), &again, LONG, LONG).await,
        Reservation::Completed(ok(b"\"for a\""))
    );
    assert_eq!(
        reserve(&store, &b, Some(&fb), &again, LONG, LONG).await,
        Reservation::Completed(ok(b"\"for b\""))
    );
    // Releasing or purging one never touches the other.
    assert_eq!(store.release(&b, &ta).await.unwrap(), Fenced::NotOwner);
    assert!(fetch(&store, &b).await.is_some());
}

/// Rule 1: the same tenant and key in two scopes are two records.
pub async fn identity_separated_by_scope<S: Store + Clone + 'static>(store: S) {
    let t = fresh_tenant();
    let a = id(&t, "conformance.scope_a", "same-key");
    let b = id(&t, "conformance.scope_b", "same-key");
    let ta = acquire(&store, &a, Some(&fp("x")), LONG, LONG).await;
    let tb = acquire(&store, &b, Some(&fp("y")), LONG, LONG).await;
    assert_eq!(
        store
            .complete(Completion::by_body(&a, &ta, &ok(b"1"), LONG))
            .await
            .unwrap(),
        Fenced::Written
    );
    // b is still in progress although a is complete.
    assert!(matches!(
        reserve(&store, &b, Some(&fp("y")), &OwnerToken::new(), LONG, LONG).await,
        Reservation::InProgress { .. }
    ));
    assert_eq!(
        store
            .complete(Completion::by_body(&b, &tb, &ok(b"2"), LONG))
            .await
            .unwrap(),
        Fenced::Written
    );
    assert_eq!(fetch(&store, &a).await.unwrap().outcome, Some(ok(b"1")));
    assert_eq!(fetch(&store, &b).await.unwrap().outcome, Some(ok(b"2")));
    // A scope that is a prefix of another is not the same scope.
    let c = id(&t, "conformance.scope", "same-key");
    assert!(fetch(&store, &c).await.is_none());
}

/// Rule 1: the shared namespace (`tenant = shared`) is distinct from every
/// tenant, including tenants a padded or trimmed comparison would take for
/// the empty one it is stored as (spaces, a no-break space, an ideographic
/// space) and a tenant spelled `shared`: each gets a record of its own, in
/// either order, and the shared record keeps its answer.
pub async fn shared_namespace_is_distinct_from_every_tenant<S: Store + Clone + 'static>(store: S) {
    let scope = fresh_scope("conformance.shared");
    let shared = Identity::shared(scope.clone(), "same-key").expect("identity");
    let tenants = [" ", "  ", "\u{a0}", "\u{3000}", "shared", "0"];
    // One tenant written before the shared record, the rest after it.
    let early = id(tenants[0], &scope, "same-key");
    record(&store, &early, Some(&fp("early")), &ok(b"\"early\""), LONG).await;
    assert!(
        fetch(&store, &shared).await.is_none(),
        "the shared identity is not the tenant {:?}",
        tenants[0]
    );
    record(
        &store,
        &shared,
        Some(&fp("shared")),
        &ok(b"\"shared\""),
        LONG,
    )
    .await;
    for tenant in &tenants[1..] {
        let identity = id(tenant, &scope, "same-key");
        assert!(
            fetch(&store, &identity).await.is_none(),
            "tenant {tenant:?} must not see the shared record"
        );
        let payload = format!("{tenant:?}");
        record(
            &store,
            &identity,
            Some(&fp(tenant)),
            &ok(payload.as_bytes()),
            LONG,
        )
        .await;
    }
    assert_eq!(
        reserve(
            &store,
            &shared,
            Some(&fp("shared")),
            &OwnerToken::new(),
            LONG,
            LONG
        )
        .await,
        Reservation::Completed(ok(b"\"shared\"")),
        "the shared record keeps its own answer"
    );
    assert_eq!(
        fetch(&store, &early).await.expect("recorded").outcome,
        Some(ok(b"\"early\""))
    );
    for tenant in &tenants[1..] {
        let identity = id(tenant, &scope, "same-key");
        let payload = format!("{tenant:?}");
        assert_eq!(
            reserve(
                &store,
                &identity,
                Some(&fp(tenant)),
                &OwnerToken::new(),
                LONG,
                LONG
            )
            .await,
            Reservation::Completed(ok(payload.as_bytes())),
            "tenant {tenant:?} replays its own record"
        );
    }
}

// ---------------------------------------------------------------- rule 3

async fn race<S: Store + Clone + 'static>(
    store: &S,
    identity: &Identity,
    fingerprints: &[Option<Fingerprint>],
    lease: Duration,
) -> Vec<(Option<Fingerprint>, OwnerToken, Reservation)> {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut tasks = Vec::with_capacity(TASKS);
    for i in 0..TASKS {
        let (store, identity, barrier) = (store.clone(), identity.clone(), barrier.clone());
        let fingerprint = fingerprints[i % fingerprints.len()].clone();
        tasks.push(tokio::spawn(async move {
            let token = OwnerToken::new();
            barrier.wait().await;
            let got = reserve(&store, &identity, fingerprint.as_ref(), &token, lease, LONG).await;
            (fingerprint, token, got)
        }));
    }
    let mut out = Vec::with_capacity(TASKS);
    for t in tasks {
        out.push(t.await.expect("reserving task"));
    }
    out
}

/// Rule 3: of 50 concurrent reservations of one identity exactly one acquires;
/// the others see it in progress (or, with another fingerprint, a mismatch).
/// Repeated over many rounds.
/// A token is a caller's, but a store cannot tell callers apart by it: a
/// second reservation presenting the owner's token (after the record is made,
/// or racing it) is judged like any other request, in progress, never a
/// second acquire (rule 3). The engine makes a fresh token per call; a Store
/// user may not.
pub async fn a_token_presented_twice_acquires_once<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let f = fp("same");
    let token = OwnerToken::new();
    let identity = id(&tenant, "conformance.token_twice", "after");
    assert_eq!(
        reserve(&store, &identity, Some(&f), &token, LONG, LONG).await,
        Reservation::FRESH
    );
    let again = reserve(&store, &identity, Some(&f), &token, LONG, LONG).await;
    assert!(
        matches!(again, Reservation::InProgress { .. }),
        "the same token again: {again:?}"
    );
    for round in 0..ROUNDS {
        let identity = id(&tenant, "conformance.token_twice", &format!("race-{round}"));
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let (store, identity, f, token) =
                    (store.clone(), identity.clone(), f.clone(), token.clone());
                tokio::spawn(async move {
                    reserve(&store, &identity, Some(&f), &token, LONG, LONG).await
                })
            })
            .collect();
        let mut acquired = 0;
        for task in tasks {
            match task.await.expect("task") {
                Reservation::Acquired { .. } => acquired += 1,
                Reservation::InProgress { .. } => {}
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(acquired, 1, "round {round}: one token, one acquire");
    }
}

pub async fn reserve_is_atomic_under_concurrency<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    for round in 0..ROUNDS {
        let identity = id(&tenant, "conformance.race", &format!("round-{round}"));
        // Even rounds: one fingerprint. Odd rounds: two fingerprints racing.
        let fingerprints = if round % 2 == 0 {
            vec![Some(fp("same"))]
        } else {
            vec![Some(fp("left")), Some(fp("right"))]
        };
        let results = race(&store, &identity, &fingerprints, LONG).await;
        let winners: Vec<_> = results
            .iter()
            .filter(|(_, _, r)| matches!(r, Reservation::Acquired { .. }))
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: exactly one acquires");
        let (winner_fp, winner_token, winner) = winners[0];
        assert_eq!(*winner, Reservation::FRESH);
        for (f, _, r) in &results {
            if matches!(r, Reservation::Acquired { .. }) {
                continue;
            }
            if f == winner_fp {
                assert!(
                    matches!(r, Reservation::InProgress { .. }),
                    "round {round}: a duplicate sees the winner in progress, got {r:?}"
                );
            } else {
                assert_eq!(
                    *r,
                    Reservation::FingerprintMismatch,
                    "round {round}: another fingerprint is a mismatch"
                );
            }
        }
        let snap = fetch(&store, &identity).await.expect("the record exists");
        assert_eq!(snap.owner_token.as_deref(), Some(winner_token.as_str()));
        assert_eq!(
            snap.fingerprint.as_deref(),
            winner_fp.as_ref().map(|f| f.as_str())
        );
        assert_eq!(
            store
                .complete(Completion::by_body(
                    &identity,
                    winner_token,
                    &ok(b"\"done\""),
                    LONG
                ))
                .await
                .unwrap(),
            Fenced::Written
        );
        assert_eq!(
            reserve(
                &store,
                &identity,
                winner_fp.as_ref(),
                &OwnerToken::new(),
                LONG,
                LONG
            )
            .await,
            Reservation::Completed(ok(b"\"done\""))
        );
    }
}

/// Rules 3 and 10: when a lease has run out, of 50 concurrent callers exactly
/// one takes the record over; when a record has expired, exactly one acquires it.
pub async fn takeover_is_atomic_under_concurrency<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let rounds = ROUNDS / 2;
    let mut identities = Vec::new();
    for round in 0..rounds {
        let identity = id(
            &tenant,
            "conformance.takeover_race",
            &format!("round-{round}"),
        );
        let token = OwnerToken::new();
        let got = reserve(&store, &identity, Some(&fp("f")), &token, SHORT, LONG).await;
        assert_eq!(got, Reservation::FRESH);
        identities.push(identity);
    }
    tokio::time::sleep(PAST_SHORT).await;
    for (round, identity) in identities.iter().enumerate() {
        let results = race(&store, identity, &[Some(fp("f")), None], LONG).await;
        let winners: Vec<_> = results
            .iter()
            .filter(|(_, _, r)| matches!(r, Reservation::Acquired { .. }))
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: exactly one takes over");
        assert_takeover(&winners[0].2, 2);
        assert!(results.iter().all(|(_, _, r)| matches!(
            r,
            Reservation::Acquired { .. } | Reservation::InProgress { .. }
        )));
        let snap = fetch(&store, identity).await.unwrap();
        assert_eq!(snap.owner_token.as_deref(), Some(winners[0].1.as_str()));
    }
}

/// What the stale owner sends while the takeovers race it.
#[derive(Debug, Clone, Copy)]
enum StaleWrite {
    Complete,
    Heartbeat,
}

/// Rules 3 and 10 at the moment a lease has run out: the owner's fenced
/// write (its completion, or a renewal that comes late) races the callers
/// that would take the record over. Exactly one side wins, never both: a
/// completion written is what every racing caller replays (none runs the
/// body again); a renewal written keeps the record its owner's (every
/// racing caller finds it in progress); a write refused leaves one caller
/// holding the record as attempt 2, its lease and its token untouched by
/// the stale owner.
pub async fn a_stale_owners_write_racing_takeovers_has_one_winner<S: Store + Clone + 'static>(
    store: S,
) {
    const TAKERS: usize = 8;
    let tenant = fresh_tenant();
    let f = fp("f");
    let mut owned = Vec::new();
    for round in 0..ROUNDS {
        let write = if round % 2 == 0 {
            StaleWrite::Complete
        } else {
            StaleWrite::Heartbeat
        };
        let identity = id(&tenant, "conformance.stale_race", &format!("round-{round}"));
        let token = acquire(&store, &identity, Some(&f), SHORT, LONG).await;
        owned.push((identity, token, write));
    }
    tokio::time::sleep(PAST_SHORT).await;
    for (round, (identity, stale, write)) in owned.into_iter().enumerate() {
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(TAKERS + 1));
        let owner = {
            let (store, identity, barrier) = (store.clone(), identity.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                match write {
                    StaleWrite::Complete => store
                        .complete(Completion::by_body(
                            &identity,
                            &stale,
                            &ok(b"\"stale\""),
                            LONG,
                        ))
                        .await
                        .expect("complete"),
                    StaleWrite::Heartbeat => store
                        .heartbeat(&identity, &stale, LONG)
                        .await
                        .expect("heartbeat"),
                }
            })
        };
        let takers: Vec<_> = (0..TAKERS)
            .map(|_| {
                let (store, identity, barrier, f) =
                    (store.clone(), identity.clone(), barrier.clone(), f.clone());
                tokio::spawn(async move {
                    let token = OwnerToken::new();
                    barrier.wait().await;
                    let got = reserve(&store, &identity, Some(&f), &token, LONG, LONG).await;
                    (token, got)
                })
            })
            .collect();
        let written = owner.await.expect("owner task");
        let mut answers = Vec::new();
        for t in takers {
            answers.push(t.await.expect("taker task"));
        }
        let winners: Vec<_> = answers
            .iter()
            .filter(|(_, r)| matches!(r, Reservation::Acquired { .. }))
            .collect();
        let snap = fetch(&store, &identity).await.expect("the record");
        match written {
            Fenced::Written => {
                assert!(
                    winners.is_empty(),
                    "round {round} ({write:?}): the stale owner's write and a takeover both won: \
                     {answers:?}"
                );
                for (_, r) in &answers {
                    match write {
                        StaleWrite::Complete => assert_eq!(
                            *r,
                            Reservation::Completed(ok(b"\"stale\"")),
                            "round {round}: after the completion every caller replays it"
                        ),
                        StaleWrite::Heartbeat => assert!(
                            matches!(r, Reservation::InProgress { .. }),
                            "round {round}: a renewed lease is in progress, got {r:?}"
                        ),
                    }
                }
            }
            Fenced::NotOwner => {
                assert_eq!(
                    winners.len(),
                    1,
                    "round {round} ({write:?}): refused, so one caller took over: {answers:?}"
                );
                let (winner, got) = winners[0];
                assert_takeover(got, 2);
                assert_eq!(snap.state, RecordState::InProgress);
                assert_eq!(snap.owner_token.as_deref(), Some(winner.as_str()));
                assert!(
                    snap.lease_expires_at_ms
                        .is_some_and(|end| end > snap.now_ms),
                    "round {round}: the winner's lease is live"
                );
                for (_, r) in &answers {
                    assert!(
                        matches!(
                            r,
                            Reservation::Acquired { .. } | Reservation::InProgress { .. }
                        ),
                        "round {round}: {r:?}"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------- rules 4, 5, 12, 13

/// Rule 4: a duplicate finding a live lease is told how long the lease has left.
pub async fn in_progress_reports_lease_remaining<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.in_progress", "k");
    let lease = Duration::from_secs(60);
    let owner = acquire(&store, &identity, Some(&fp("a")), lease, LONG).await;
    for fingerprint in [Some(fp("a")), None] {
        match reserve(
            &store,
            &identity,
            fingerprint.as_ref(),
            &OwnerToken::new(),
            lease,
            LONG,
        )
        .await
        {
            Reservation::InProgress { lease_remaining } => {
                assert!(lease_remaining > Duration::ZERO, "{lease_remaining:?}");
                assert!(lease_remaining <= lease, "{lease_remaining:?}");
            }
            other => panic!("expected InProgress, got {other:?}"),
        }
    }
    // Asking changed nothing: the owner still owns it.
    let snap = fetch(&store, &identity).await.unwrap();
    assert_eq!(snap.state, RecordState::InProgress);
    assert_eq!(snap.owner_token.as_deref(), Some(owner.as_str()));
    assert_eq!(snap.fingerprint.as_deref(), Some(fp("a").as_str()));
}

/// Rules 5 and 12: a completed record replays an equal outcome to any later
/// caller, and cannot be completed, released or heartbeaten again.
pub async fn complete_then_replay<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.replay", "k");
    let f = fp("charge 500");
    let payload = br#"{"charge_id":42,"note":"caf\u00e9 \"quoted\""}"#;
    let token = acquire(&store, &identity, Some(&f), LONG, LONG).await;
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &token, &ok(payload), LONG))
            .await
            .unwrap(),
        Fenced::Written
    );
    for _ in 0..3 {
        assert_eq!(
            reserve(&store, &identity, Some(&f), &OwnerToken::new(), LONG, LONG).await,
            Reservation::Completed(ok(payload))
        );
    }
    let snap = fetch(&store, &identity).await.unwrap();
    assert_eq!(snap.state, RecordState::Complete);
    assert_eq!(snap.outcome, Some(ok(payload)));
    assert_eq!(snap.fingerprint.as_deref(), Some(f.as_str()));
    assert!(snap.expires_at_ms > snap.now_ms);
    assert!(!snap.is_expired());
    // The owner's token no longer owns anything: the record is complete.
    assert_eq!(
        store
            .complete(Completion::by_body(
                &identity,
                &token,
                &ok(b"\"overwrite\""),
                LONG
            ))
            .await
            .unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        store.heartbeat(&identity, &token, LONG).await.unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        store.release(&identity, &token).await.unwrap(),
        Fenced::NotOwner
    );
    assert_same_record(
        &snap,
        &fetch(&store, &identity).await.unwrap(),
        "after the owner is done",
    );
}

/// Rule 13: a recorded error replays as a recorded error.
pub async fn recorded_error_round_trips<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.recorded_error", "k");
    let failed = StoredOutcome {
        is_error: true,
        payload: br#"{"CardDeclined":{"code":"insufficient_funds"}}"#.to_vec(),
    };
    record(&store, &identity, None, &failed, LONG).await;
    assert_eq!(
        reserve(&store, &identity, None, &OwnerToken::new(), LONG, LONG).await,
        Reservation::Completed(failed.clone())
    );
    assert_eq!(
        fetch(&store, &identity).await.unwrap().outcome,
        Some(failed)
    );
    // And an Ok outcome next to it is not an error.
    let other = id(identity.tenant(), "conformance.recorded_error", "k2");
    record(&store, &other, None, &ok(b"null"), LONG).await;
    assert_eq!(
        reserve(&store, &other, None, &OwnerToken::new(), LONG, LONG).await,
        Reservation::Completed(ok(b"null"))
    );
}

/// Rule 13: release frees the key; a retry acquires it fresh.
pub async fn release_frees_the_key<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.release", "k");
    let first = acquire(&store, &identity, Some(&fp("a")), LONG, LONG).await;
    assert_eq!(
        store.release(&identity, &first).await.unwrap(),
        Fenced::Written
    );
    assert!(fetch(&store, &identity).await.is_none());
    assert_eq!(
        store.release(&identity, &first).await.unwrap(),
        Fenced::NotOwner,
        "released twice"
    );
    // Free for anyone, even with another fingerprint: nothing is recorded.
    let second = acquire(&store, &identity, Some(&fp("b")), LONG, LONG).await;
    assert_eq!(
        store.release(&identity, &first).await.unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        store.heartbeat(&identity, &first, LONG).await.unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &first, &ok(b"1"), LONG))
            .await
            .unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        fetch(&store, &identity)
            .await
            .unwrap()
            .owner_token
            .as_deref(),
        Some(second.as_str())
    );
}

/// Rule 14: a detached release (a cancelled call) frees the key soon, and only
/// for the current owner.
pub async fn release_detached_frees_the_key<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let identity = id(&tenant, "conformance.release_detached", "k");
    let token = acquire(&store, &identity, None, LONG, LONG).await;
    store.release_detached(identity.clone(), token);
    let mut freed = false;
    for _ in 0..250 {
        if fetch(&store, &identity).await.is_none() {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(freed, "a detached release frees the key");

    let kept = id(&tenant, "conformance.release_detached", "kept");
    let owner = acquire(&store, &kept, None, LONG, LONG).await;
    store.release_detached(kept.clone(), OwnerToken::new());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let snap = fetch(&store, &kept)
        .await
        .expect("a stranger's release deletes nothing");
    assert_eq!(snap.owner_token.as_deref(), Some(owner.as_str()));
}

/// Rules 10 and 14: a detached completion (a call dropped while recording its
/// result) records the outcome for the current owner, and one presented with
/// a token that does not own the record changes nothing.
pub async fn complete_detached_records_and_is_fenced<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let identity = id(&tenant, "conformance.complete_detached", "k");
    let owner = acquire(&store, &identity, None, LONG, LONG).await;
    let stranger = OwnerToken::new();
    store.complete_detached(Completion::by_body(
        &identity,
        &stranger,
        &ok(b"\"stranger\""),
        LONG,
    ));
    store.complete_detached(Completion::by_body(
        &identity,
        &owner,
        &ok(b"\"owner\""),
        LONG,
    ));
    let mut recorded = None;
    for _ in 0..250 {
        match fetch(&store, &identity).await {
            Some(snap) if snap.state == RecordState::Complete => {
                recorded = snap.outcome;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(
        recorded,
        Some(ok(b"\"owner\"")),
        "the owner's detached completion is recorded; the stranger's is not"
    );
}

/// Rule 20 with rule 14: a call in a scope with a recover hook, dropped while
/// its reservation was in flight, has the store end its lease without
/// deleting the record; the next call takes it over at once (attempt 2). A
/// stranger's token ends nothing.
pub async fn end_lease_detached_keeps_the_record_for_a_takeover<S: Store + Clone + 'static>(
    store: S,
) {
    let tenant = fresh_tenant();
    let identity = id(&tenant, "conformance.end_lease_detached", "k");
    let owner = acquire(&store, &identity, None, LONG, LONG).await;
    store.end_lease_detached(identity.clone(), OwnerToken::new());
    store.end_lease_detached(identity.clone(), owner.clone());
    let mut ended = None;
    for _ in 0..250 {
        match fetch(&store, &identity).await {
            Some(snap) if snap.lease_expires_at_ms.is_some_and(|l| l <= snap.now_ms) => {
                ended = Some(snap);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let ended = ended.expect("the owner's lease was ended");
    assert_eq!(ended.state, RecordState::InProgress, "the record is kept");
    assert_eq!(ended.owner_token.as_deref(), Some(owner.as_str()));
    let got = reserve(&store, &identity, None, &OwnerToken::new(), LONG, LONG).await;
    assert!(
        matches!(
            got,
            Reservation::Acquired {
                took_over: true,
                attempt: 2,
                ..
            }
        ),
        "the next call takes the record over: {got:?}"
    );
}

/// Rule 20 with rule 14: a recover hook's answer handed to the store's
/// background completion is recorded marked *recovered*, as
/// `complete` with `AnsweredBy::RecoverHook` marks it, and a plain detached completion is not.
pub async fn a_detached_recover_hook_answer_keeps_the_mark<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    for (key, recovered) in [("recovered", true), ("plain", false)] {
        let identity = id(&tenant, "conformance.detached_recovered", key);
        let owner = acquire(&store, &identity, None, LONG, LONG).await;
        if recovered {
            store.complete_detached(Completion {
                identity: &identity,
                token: &owner,
                outcome: &ok(b"1"),
                ttl: LONG,
                by: AnsweredBy::RecoverHook,
            });
        } else {
            store.complete_detached(Completion::by_body(&identity, &owner, &ok(b"1"), LONG));
        }
        let mut done = None;
        for _ in 0..250 {
            match fetch(&store, &identity).await {
                Some(snap) if snap.state == RecordState::Complete => {
                    done = Some(snap);
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        let done = done.expect("the detached completion is recorded");
        assert_eq!(done.recovered, recovered, "{key}: {done:?}");
    }
}

// ---------------------------------------------------------------- rules 7, 8

/// Rule 7: a complete record and another fingerprint: mismatch, record untouched.
pub async fn fingerprint_mismatch_on_complete_record<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.mismatch", "k");
    record(
        &store,
        &identity,
        Some(&fp("amount=500")),
        &ok(b"\"r\""),
        LONG,
    )
    .await;
    let before = fetch(&store, &identity).await.unwrap();
    for _ in 0..2 {
        assert_eq!(
            reserve(
                &store,
                &identity,
                Some(&fp("amount=900")),
                &OwnerToken::new(),
                LONG,
                LONG
            )
            .await,
            Reservation::FingerprintMismatch
        );
    }
    assert_same_record(
        &before,
        &fetch(&store, &identity).await.unwrap(),
        "after a mismatch",
    );
    // The original request still replays.
    assert_eq!(
        reserve(
            &store,
            &identity,
            Some(&fp("amount=500")),
            &OwnerToken::new(),
            LONG,
            LONG
        )
        .await,
        Reservation::Completed(ok(b"\"r\""))
    );
}

/// Rule 7: an in-progress record and another fingerprint: mismatch, record
/// untouched — whether its lease is live or has run out (a stuck record is not
/// taken over by a different request).
pub async fn fingerprint_mismatch_on_in_progress_record<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let live = id(&tenant, "conformance.mismatch_in_progress", "live");
    let stuck = id(&tenant, "conformance.mismatch_in_progress", "stuck");
    acquire(&store, &live, Some(&fp("a")), LONG, LONG).await;
    acquire(&store, &stuck, Some(&fp("a")), SHORT, LONG).await;
    tokio::time::sleep(PAST_SHORT).await;
    for identity in [&live, &stuck] {
        let before = fetch(&store, identity).await.unwrap();
        assert_eq!(
            reserve(
                &store,
                identity,
                Some(&fp("b")),
                &OwnerToken::new(),
                LONG,
                LONG
            )
            .await,
            Reservation::FingerprintMismatch,
            "{}",
            identity.key()
        );
        assert_same_record(
            &before,
            &fetch(&store, identity).await.unwrap(),
            identity.key(),
        );
    }
}

/// Rule 8: a record without a fingerprint is not contradicted by a
/// fingerprinted request, and a fingerprinted record not by a request without one.
pub async fn missing_fingerprint_is_not_contradicted<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let bare = id(&tenant, "conformance.no_fingerprint", "bare");
    let printed = id(&tenant, "conformance.no_fingerprint", "printed");
    record(&store, &bare, None, &ok(b"\"bare\""), LONG).await;
    record(&store, &printed, Some(&fp("a")), &ok(b"\"printed\""), LONG).await;
    assert_eq!(
        reserve(
            &store,
            &bare,
            Some(&fp("anything")),
            &OwnerToken::new(),
            LONG,
            LONG
        )
        .await,
        Reservation::Completed(ok(b"\"bare\""))
    );
    assert_eq!(
        reserve(&store, &printed, None, &OwnerToken::new(), LONG, LONG).await,
        Reservation::Completed(ok(b"\"printed\""))
    );
    // Same for records still in progress: in progress, not a mismatch.
    let running = id(&tenant, "conformance.no_fingerprint", "running");
    acquire(&store, &running, None, LONG, LONG).await;
    assert!(matches!(
        reserve(
            &store,
            &running,
            Some(&fp("x")),
            &OwnerToken::new(),
            LONG,
            LONG
        )
        .await,
        Reservation::InProgress { .. }
    ));
    // Nothing was rewritten by those questions.
    assert_eq!(fetch(&store, &bare).await.unwrap().fingerprint, None);
    assert_eq!(fetch(&store, &running).await.unwrap().fingerprint, None);
    assert_eq!(
        fetch(&store, &printed)
            .await
            .unwrap()
            .fingerprint
            .as_deref(),
        Some(fp("a").as_str())
    );
}

// ---------------------------------------------------------------- rules 10, 11

/// Rule 10: an expired lease is taken over with a new token; the stale owner's
/// complete, release and heartbeat are refused and change nothing.
pub async fn expired_lease_is_taken_over<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.takeover", "k");
    let f = fp("a");
    let stale = acquire(&store, &identity, Some(&f), SHORT, LONG).await;
    tokio::time::sleep(PAST_SHORT).await;
    let fresh = OwnerToken::new();
    assert_takeover(
        &reserve(&store, &identity, Some(&f), &fresh, LONG, LONG).await,
        2,
    );
    let taken = fetch(&store, &identity).await.unwrap();
    assert_eq!(taken.state, RecordState::InProgress);
    assert_eq!(taken.owner_token.as_deref(), Some(fresh.as_str()));
    assert!(
        taken.lease_expires_at_ms.unwrap() > taken.now_ms,
        "a fresh lease"
    );

    assert_eq!(
        store
            .complete(Completion::by_body(
                &identity,
                &stale,
                &ok(b"\"stale\""),
                LONG
            ))
            .await
            .unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        store.heartbeat(&identity, &stale, LONG).await.unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        store.release(&identity, &stale).await.unwrap(),
        Fenced::NotOwner
    );
    assert_same_record(
        &taken,
        &fetch(&store, &identity).await.unwrap(),
        "after the stale owner",
    );

    assert_eq!(
        store
            .complete(Completion::by_body(
                &identity,
                &fresh,
                &ok(b"\"fresh\""),
                LONG
            ))
            .await
            .unwrap(),
        Fenced::Written
    );
    assert_eq!(
        reserve(&store, &identity, Some(&f), &OwnerToken::new(), LONG, LONG).await,
        Reservation::Completed(ok(b"\"fresh\""))
    );
    // A takeover without a fingerprint is allowed too (rule 8).
    let other = id(identity.tenant(), "conformance.takeover", "k2");
    acquire(&store, &other, Some(&f), SHORT, LONG).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_takeover(
        &reserve(&store, &other, None, &OwnerToken::new(), LONG, LONG).await,
        2,
    );
}

/// Rule 11 (lease renewal): a heartbeat moves the lease forward, so the record
/// is not taken over after its first lease would have run out.
pub async fn heartbeat_extends_the_lease<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.heartbeat", "k");
    let token = acquire(&store, &identity, None, SHORT, LONG).await;
    let before = fetch(&store, &identity).await.unwrap();
    assert_eq!(
        store.heartbeat(&identity, &token, LONG).await.unwrap(),
        Fenced::Written
    );
    let after = fetch(&store, &identity).await.unwrap();
    let lease_left = after.lease_expires_at_ms.unwrap() - after.now_ms;
    assert!(
        lease_left > (LONG.as_millis() / 2) as i64,
        "lease left after a heartbeat of {LONG:?}: {lease_left} ms"
    );
    assert!(after.lease_expires_at_ms > before.lease_expires_at_ms);
    tokio::time::sleep(PAST_SHORT).await;
    assert!(
        matches!(
            reserve(&store, &identity, None, &OwnerToken::new(), LONG, LONG).await,
            Reservation::InProgress { .. }
        ),
        "the renewed lease still holds after the first one would have run out"
    );
    assert_eq!(
        fetch(&store, &identity)
            .await
            .unwrap()
            .owner_token
            .as_deref(),
        Some(token.as_str())
    );
    // Renewing again still works, and the owner can finish.
    assert_eq!(
        store.heartbeat(&identity, &token, LONG).await.unwrap(),
        Fenced::Written
    );
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &token, &ok(b"1"), LONG))
            .await
            .unwrap(),
        Fenced::Written
    );
}

/// Rules 16 and 20: a renewal moves the record's retention with its lease,
/// keeping their distance, and never moves it back. A body that outlives its
/// ttl under a renewed lease and then dies leaves a record to take over (the
/// recover hook is asked), not one that counts as absent the moment its lease
/// runs out.
pub async fn heartbeat_moves_the_retention_with_the_lease<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.heartbeat_retention", "k");
    let lease = Duration::from_secs(60);
    let ttl = Duration::from_secs(120);
    let token = acquire(&store, &identity, None, lease, ttl).await;
    let first = fetch(&store, &identity).await.expect("the record");
    let distance = first.expires_at_ms - first.lease_expires_at_ms.expect("a lease");
    assert_eq!(
        store.heartbeat(&identity, &token, LONG).await.unwrap(),
        Fenced::Written
    );
    let renewed = fetch(&store, &identity).await.expect("the record");
    let lease_end = renewed.lease_expires_at_ms.expect("a lease");
    assert!(lease_end > first.lease_expires_at_ms.unwrap());
    assert_eq!(
        renewed.expires_at_ms - lease_end,
        distance,
        "the retention keeps its distance from the lease's end"
    );
    // A shorter renewal (the engine ends a lease with a zero one) leaves the
    // retention where it was.
    assert_eq!(
        store
            .heartbeat(&identity, &token, Duration::ZERO)
            .await
            .unwrap(),
        Fenced::Written
    );
    let ended = fetch(&store, &identity).await.expect("the record");
    assert_eq!(ended.expires_at_ms, renewed.expires_at_ms);
    // The lease ran out, the ttl did not: a takeover, not a fresh acquire.
    let got = reserve(&store, &identity, None, &OwnerToken::new(), LONG, LONG).await;
    assert_takeover(&got, 2);
}

// ---------------------------------------------------------------- rule 16

/// Rule 16: an expired record counts as absent: complete records after their
/// ttl, in-progress records once both lease and ttl ran out (a fresh acquire,
/// not a takeover, and any fingerprint may take it).
pub async fn expired_record_counts_as_absent<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let complete = id(&tenant, "conformance.ttl", "complete");
    let abandoned = id(&tenant, "conformance.ttl", "abandoned");
    let held = id(&tenant, "conformance.ttl", "held");
    record(&store, &complete, Some(&fp("a")), &ok(b"\"old\""), SHORT).await;
    acquire(&store, &abandoned, Some(&fp("a")), SHORT, SHORT).await;
    let holder = acquire(&store, &held, Some(&fp("a")), LONG, SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    // On a shared database another test's purge may already have deleted it:
    // absent and expired are the same answer (rule 16).
    assert!(fetch(&store, &complete)
        .await
        .is_none_or(|snap| snap.is_expired()));
    for identity in [&complete, &abandoned] {
        let token = OwnerToken::new();
        assert_eq!(
            reserve(&store, identity, Some(&fp("b")), &token, LONG, LONG).await,
            Reservation::FRESH,
            "{}",
            identity.key()
        );
        let snap = fetch(&store, identity).await.unwrap();
        assert_eq!(snap.state, RecordState::InProgress);
        assert_eq!(snap.outcome, None, "nothing of the old record is replayed");
        assert_eq!(snap.fingerprint.as_deref(), Some(fp("b").as_str()));
        assert!(!snap.is_expired());
    }
    // ttl over but the lease is live: still in progress, not free, with
    // what is left of the lease (not a made-up zero that sends the caller
    // straight back).
    let got = reserve(
        &store,
        &held,
        Some(&fp("a")),
        &OwnerToken::new(),
        LONG,
        LONG,
    )
    .await;
    assert!(
        matches!(got, Reservation::InProgress { lease_remaining } if lease_remaining > LONG / 2),
        "{got:?}"
    );
    let still_held = fetch(&store, &held).await.unwrap();
    assert_eq!(still_held.owner_token.as_deref(), Some(holder.as_str()));
    assert!(
        !still_held.is_expired(),
        "a live lease keeps the record from counting as absent: {still_held:?}"
    );
}

/// Rule 16: a completed record's retention counts from its completion, by
/// the ttl the completion gives, not from when the record was reserved: the
/// answer of a body that ran for a while is kept for the whole ttl after it
/// was recorded.
pub async fn retention_counts_from_the_completion<S: Store + Clone + 'static>(store: S) {
    let identity = id(
        &fresh_tenant(),
        "conformance.retention_from_completion",
        "k",
    );
    let token = acquire(&store, &identity, None, LONG, LONG).await;
    // The body runs a while: until the store's own clock has moved on from
    // the reservation (bounded; a look every few ms).
    let mut running = None;
    for _ in 0..500 {
        let snap = fetch(&store, &identity).await.expect("the record");
        if snap.now_ms >= snap.attempt_started_at_ms + 50 {
            running = Some(snap);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let running = running.expect("the store's clock moves on");
    let ttl_ms = i64::try_from(LONG.as_millis()).expect("ms");
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &token, &ok(b"7"), LONG))
            .await
            .unwrap(),
        Fenced::Written
    );
    let done = fetch(&store, &identity)
        .await
        .expect("the completed record");
    assert!(
        done.expires_at_ms >= running.now_ms + ttl_ms,
        "kept for the ttl from its completion (after {}), not from its reservation ({}): {done:?}",
        running.now_ms,
        running.attempt_started_at_ms
    );
    // And no longer: the completion was made before this read, on the same
    // clock, so what is left of its retention is at most the ttl.
    assert!(
        done.expires_at_ms <= done.now_ms + ttl_ms,
        "kept for at most the ttl from its completion (read at {}): {done:?}",
        done.now_ms
    );
    assert!(!done.is_expired());
    assert_eq!(
        reserve(&store, &identity, None, &OwnerToken::new(), LONG, LONG).await,
        Reservation::Completed(ok(b"7"))
    );
}

/// Rule 16: purge deletes expired records in bounded batches — in-progress
/// ones only when both lease and ttl ran out — and never a live record.
pub async fn purge_deletes_only_expired_records<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let key = |k: &str| id(&tenant, "conformance.purge", k);
    // The live records are written first, so a purge that walks records in
    // insertion order meets them before the expired ones.
    let live_complete = key("live-complete");
    record(&store, &live_complete, None, &ok(b"2"), LONG).await;
    let stuck = key("stuck"); // lease over, ttl live
    acquire(&store, &stuck, None, SHORT, LONG).await;
    let held = key("held"); // ttl over, lease live
    acquire(&store, &held, None, LONG, SHORT).await;
    let live = [&live_complete, &stuck, &held];
    let mut doomed = Vec::new();
    for i in 0..7 {
        let identity = key(&format!("expired-complete-{i}"));
        record(&store, &identity, None, &ok(b"1"), SHORT).await;
        doomed.push(identity);
    }
    for i in 0..2 {
        let identity = key(&format!("abandoned-{i}"));
        acquire(&store, &identity, None, SHORT, SHORT).await;
        doomed.push(identity);
    }
    tokio::time::sleep(PAST_SHORT).await;

    // Small batches first (the bound must hold), then large ones, so a
    // database shared with earlier runs' expired records still drains.
    let batch_for = |call: usize| if call < 3 { 3 } else { 1_000 };
    let mut gone = false;
    // On a shared server another test's purge may hold this test's expired
    // records (SKIP LOCKED) while ours runs: there a purge that deletes
    // nothing is a defect only when it keeps happening for seconds. A store
    // of this test's own (memory, SQLite) must make progress on every call.
    let private = matches!(store.name(), "memory" | "sqlite");
    let mut last_progress = std::time::Instant::now();
    let mut remaining_before = doomed.len();
    for call in 0..1_000 {
        let batch = batch_for(call);
        let deleted = store.purge_expired(batch).await.expect("purge succeeds");
        assert!(
            deleted <= u64::from(batch),
            "purged {deleted} in a batch of {batch}"
        );
        let mut remaining = 0;
        for identity in &doomed {
            if fetch(&store, identity).await.is_some() {
                remaining += 1;
            }
        }
        // The bound is on what is deleted, not only on what is reported. On
        // a store of this test's own nothing else deletes its records.
        if private {
            let gone = remaining_before - remaining;
            assert!(
                gone as u64 <= deleted && gone <= batch as usize,
                "one purge with a batch of {batch} (reporting {deleted}) deleted {gone} records"
            );
        }
        remaining_before = remaining;
        if remaining == 0 {
            gone = true;
            break;
        }
        if deleted > 0 {
            last_progress = std::time::Instant::now();
        } else {
            assert!(
                !private && last_progress.elapsed() < Duration::from_secs(10),
                "{remaining} of this test's expired records remain but purge deleted nothing{}",
                if private { "" } else { " for 10 s" }
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(gone, "purge removes every expired record eventually");
    // Keep purging until a batch comes back short (nothing more was eligible
    // then), so the live records below have been walked past; bounded, for
    // databases where other tests keep expiring records.
    for _ in 0..50 {
        if store.purge_expired(1_000).await.expect("purge succeeds") < 1_000 {
            break;
        }
    }
    for identity in live {
        assert!(
            fetch(&store, identity).await.is_some(),
            "purge must not delete the live record {}",
            identity.key()
        );
    }
    assert_eq!(
        store.purge_expired(0).await.unwrap(),
        0,
        "a batch of 0 deletes nothing"
    );
}

// ---------------------------------------------------------------- bad input

/// Bad input never loses data: a several-megabyte payload round-trips exactly.
pub async fn big_payload_round_trips<S: Store + Clone + 'static>(store: S) {
    let identity = id(&fresh_tenant(), "conformance.big", "k");
    // 6 MiB of every byte value in a pseudo-random order (not just JSON text).
    let mut state: u32 = 0x9e37_79b9;
    let payload: Vec<u8> = (0..6 * 1024 * 1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 24) as u8
        })
        .collect();
    let outcome = ok(&payload);
    record(&store, &identity, Some(&fp("big")), &outcome, LONG).await;
    match reserve(
        &store,
        &identity,
        Some(&fp("big")),
        &OwnerToken::new(),
        LONG,
        LONG,
    )
    .await
    {
        Reservation::Completed(got) => {
            assert_eq!(got.payload.len(), payload.len());
            assert!(
                got.payload == payload,
                "the payload comes back byte for byte"
            );
            assert!(!got.is_error);
        }
        other => panic!("expected a replay, got {other:?}"),
    }
}

/// Bad input: tenants and keys with quotes, `%`, `_`, backslashes, trailing
/// spaces, case differences and multi-byte UTF-8 are stored exactly and
/// matched exactly (no LIKE, no case folding, no trailing-space padding, no
/// Unicode normalization).
pub async fn unusual_keys_and_tenants_are_exact<S: Store + Clone + 'static>(store: S) {
    let base = fresh_tenant();
    let tenants: Vec<String> = [
        "a%", "ab", "a_", "a'b", "a\"b", "a\\b", "A%", "a% ", "ключ", "🔑",
    ]
    .iter()
    .map(|t| format!("{base}-{t}"))
    .collect();
    let keys = [
        "k_",
        "kx",
        "k%",
        "k%%",
        "k'",
        "k''",
        "k\"",
        "k\\",
        "k\\\\",
        "K_",
        "k_ ",
        "k;--",
        "caf\u{e9}",
        "cafe\u{301}",
        "日本語キー",
        "🔑🗝️",
    ];
    let scope = "conformance.unusual";
    let mut n = 0u32;
    for tenant in &tenants {
        for key in keys {
            let identity = id(tenant, scope, key);
            record(
                &store,
                &identity,
                Some(&fp(&n.to_string())),
                &ok(n.to_string().as_bytes()),
                LONG,
            )
            .await;
            n += 1;
        }
    }
    // A key at the 255-byte limit made of multi-byte characters.
    let long_key: String = "ü".repeat(127);
    assert_eq!(long_key.len(), 254);
    let long = id(&tenants[0], scope, &long_key);
    record(&store, &long, None, &ok(b"\"long\""), LONG).await;

    let mut n = 0u32;
    for tenant in &tenants {
        for key in keys {
            let identity = id(tenant, scope, key);
            let snap = fetch(&store, &identity).await.expect("recorded");
            assert_eq!(
                snap.outcome,
                Some(ok(n.to_string().as_bytes())),
                "tenant {tenant:?} key {key:?} holds its own record"
            );
            assert_eq!(
                reserve(
                    &store,
                    &identity,
                    Some(&fp(&n.to_string())),
                    &OwnerToken::new(),
                    LONG,
                    LONG
                )
                .await,
                Reservation::Completed(ok(n.to_string().as_bytes())),
                "tenant {tenant:?} key {key:?} replays its own record"
            );
            n += 1;
        }
    }
    assert_eq!(
        fetch(&store, &long).await.unwrap().outcome,
        Some(ok(b"\"long\""))
    );
    // Look-alikes that were never written are absent: no pattern matching.
    for (tenant, key) in [
        (format!("{base}-aZ"), "k_"),
        (format!("{base}-a"), "k_"),
        (format!("{base}-a%"), "kY"),
        (format!("{base}-a%"), "k"),
        (format!("{base}-a%"), "K%"),
        (format!("{base}-ab"), "k_  "),
        (format!("{base}-a\\\\b"), "k_"),
    ] {
        assert!(
            fetch(&store, &id(&tenant, scope, key)).await.is_none(),
            "tenant {tenant:?} key {key:?} was never written"
        );
    }
}

/// Bad input: extreme leases and ttls neither fail nor overflow. `Duration::MAX`
/// means "practically forever"; a zero lease or ttl has already run out.
pub async fn extreme_durations_are_accepted<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let forever = id(&tenant, "conformance.durations", "forever");
    let token = OwnerToken::new();
    assert_eq!(
        reserve(&store, &forever, None, &token, Duration::MAX, Duration::MAX).await,
        Reservation::FRESH
    );
    match reserve(&store, &forever, None, &OwnerToken::new(), LONG, LONG).await {
        Reservation::InProgress { lease_remaining } => {
            assert!(lease_remaining > Duration::from_secs(365 * 24 * 3600))
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert_eq!(
        store
            .heartbeat(&forever, &token, Duration::MAX)
            .await
            .unwrap(),
        Fenced::Written
    );
    assert_eq!(
        store
            .complete(Completion::by_body(
                &forever,
                &token,
                &ok(b"1"),
                Duration::MAX
            ))
            .await
            .unwrap(),
        Fenced::Written
    );
    let snap = fetch(&store, &forever).await.unwrap();
    assert!(!snap.is_expired());
    assert!(snap.expires_at_ms > snap.now_ms);
    store.purge_expired(1_000).await.expect("purge succeeds");
    assert!(
        fetch(&store, &forever).await.is_some(),
        "a forever record is not purged"
    );

    // A zero lease has run out at once: the next caller takes over.
    let zero = id(&tenant, "conformance.durations", "zero-lease");
    acquire(&store, &zero, None, Duration::ZERO, LONG).await;
    assert_takeover(
        &reserve(&store, &zero, None, &OwnerToken::new(), LONG, LONG).await,
        2,
    );
    // A zero ttl: the completed record is expired at once and counts as absent.
    let gone = id(&tenant, "conformance.durations", "zero-ttl");
    record(&store, &gone, None, &ok(b"2"), Duration::ZERO).await;
    assert_eq!(
        reserve(&store, &gone, None, &OwnerToken::new(), LONG, LONG).await,
        Reservation::FRESH
    );
}

// ---------------------------------------------------------------- audit raw material

/// Rules 16 and 19: scope statistics count this test's own scope by state:
/// live complete, in progress with a live lease, stuck (lease over, ttl live),
/// expired (past retention).
pub async fn scope_stats_count_by_state<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let scope = fresh_scope("conformance.stats");
    let key = |k: &str| id(&tenant, &scope, k);
    record(&store, &key("complete-1"), None, &ok(b"1"), LONG).await;
    record(&store, &key("complete-2"), None, &ok(b"2"), LONG).await;
    // Two running, one stuck: counts that differ, so no column is read for another.
    acquire(&store, &key("running-1"), None, LONG, LONG).await;
    acquire(&store, &key("running-2"), None, LONG, LONG).await;
    acquire(&store, &key("stuck"), None, SHORT, LONG).await;
    let expired = [key("expired-complete"), key("abandoned")];
    record(&store, &expired[0], None, &ok(b"3"), SHORT).await;
    acquire(&store, &expired[1], None, SHORT, SHORT).await;
    // Another tenant in the same scope counts too: stats are per scope.
    let other_tenant = id(&fresh_tenant(), &scope, "complete-1");
    record(&store, &other_tenant, None, &ok(b"4"), LONG).await;
    tokio::time::sleep(PAST_SHORT).await;

    let before = fetch(&store, &key("stuck"))
        .await
        .expect("the stuck record");
    let stats = store.scope_stats().await.expect("scope stats");
    assert!(
        stats.windows(2).all(|w| w[0].scope < w[1].scope),
        "sorted by scope, one entry per scope"
    );
    let mine = stats
        .iter()
        .find(|s| s.scope == scope)
        .unwrap_or_else(|| panic!("no stats for {scope}"));
    assert_eq!(mine.complete, 3, "{mine:?}");
    assert_eq!(mine.in_progress, 2, "{mine:?}");
    assert_eq!(mine.stuck, 1, "{mine:?}");
    // A purge running elsewhere against a shared database may already have
    // removed an expired record; it may never count one that is still there.
    let mut still_there = 0;
    for identity in &expired {
        if fetch(&store, identity).await.is_some() {
            still_there += 1;
        }
    }
    assert!(
        mine.expired >= still_there && mine.expired <= 2,
        "{mine:?}, {still_there} expired records present"
    );
    let oldest = mine.oldest_created_at_ms.expect("an oldest record");
    let now = fetch(&store, &key("complete-1")).await.unwrap().now_ms;
    assert!(
        oldest <= now,
        "oldest {oldest} is not in the future (now {now})"
    );
    assert!(
        oldest > now - 3_600_000,
        "oldest {oldest} is from this test (now {now})"
    );
    // How long: the one stuck record's lease ran out `longest_stuck_ms` ago
    // by the store's clock, read between the two reads around the stats.
    let lease_end = before.lease_expires_at_ms.expect("a lease");
    let stuck_for = mine
        .longest_stuck_ms
        .expect("how long the stuck record has been stuck");
    assert!(
        (before.now_ms - lease_end..=now - lease_end).contains(&stuck_for),
        "stuck for {stuck_for} ms: its lease ended at {lease_end}, read at {} and {now}",
        before.now_ms
    );
    // The expired records became purgeable when their retention (and, in
    // progress, their lease) ran out, both before `before`; one a purge
    // elsewhere left is counted from then.
    assert_eq!(
        mine.longest_unpurged_ms.is_some(),
        mine.expired > 0,
        "{mine:?}"
    );
    if let Some(unpurged_for) = mine.longest_unpurged_ms {
        assert!(
            unpurged_for <= now - oldest,
            "unpurged for {unpurged_for} ms: {mine:?}, now {now}"
        );
        // A record still here after the stats was there when they were read.
        for identity in &expired {
            if let Some(record) = fetch(&store, identity).await {
                let purgeable = match record.state {
                    RecordState::Complete => record.expires_at_ms,
                    RecordState::InProgress => record
                        .expires_at_ms
                        .max(record.lease_expires_at_ms.unwrap_or(0)),
                };
                assert!(
                    unpurged_for >= before.now_ms - purgeable,
                    "unpurged for {unpurged_for} ms, but {identity:?} has waited since {purgeable} \
                     (read at {})",
                    before.now_ms
                );
            }
        }
    }
}

/// Rules 16 and 19: an expired in-progress record becomes purgeable only when
/// both its retention and its lease have run out, so the audit's "expired,
/// not purged for …" counts from the later of the two. A record whose ttl ran
/// out before its lease is reported unpurged since its lease ended, never since
/// its retention alone (which would overstate how long the purge has been
/// behind, and page an operator for a record that was live a moment ago).
pub async fn unpurged_time_of_an_abandoned_record_counts_from_its_lease_end<
    S: Store + Clone + 'static,
>(
    store: S,
) {
    // On a shared database another test's purge (of every expired record)
    // may take the record between its lease's end and the reads below: the
    // test then starts again with a new record, a few times at most.
    for _ in 0..5 {
        if abandoned_record_checked(&store).await {
            return;
        }
    }
    panic!("a purge elsewhere took the abandoned record every time, before it was read");
}

/// One try of the test above: `false` when a purge elsewhere took the
/// record before it could be read twice.
async fn abandoned_record_checked<S: Store + Clone + 'static>(store: &S) -> bool {
    let tenant = fresh_tenant();
    let scope = fresh_scope("conformance.unpurged");
    let abandoned = id(&tenant, &scope, "abandoned");
    // Retention first, then the lease, a good while apart.
    let lease = Duration::from_millis(1_500);
    acquire(store, &abandoned, None, lease, SHORT).await;
    tokio::time::sleep(lease + PAST_SHORT).await;

    let Some(before) = fetch(store, &abandoned).await else {
        return false;
    };
    assert!(before.is_expired(), "{before:?}");
    let lease_end = before.lease_expires_at_ms.expect("a lease");
    assert!(
        before.expires_at_ms < lease_end,
        "the retention ran out before the lease: {before:?}"
    );
    let stats = store.scope_stats().await.expect("scope stats");
    let Some(after) = fetch(store, &abandoned).await else {
        return false;
    };
    let mine = stats
        .iter()
        .find(|s| s.scope == scope)
        .unwrap_or_else(|| panic!("no stats for {scope}"));
    assert_eq!(
        (mine.expired, mine.stuck, mine.in_progress),
        (1, 0, 0),
        "{mine:?}"
    );
    let unpurged_for = mine
        .longest_unpurged_ms
        .expect("how long the expired record has waited for the purge");
    assert!(
        (before.now_ms - lease_end..=after.now_ms - lease_end).contains(&unpurged_for),
        "unpurged for {unpurged_for} ms: its lease ended at {lease_end} (its retention at {}), \
         read at {} and {}",
        before.expires_at_ms,
        before.now_ms,
        after.now_ms
    );
    true
}

// ---------------------------------------------------------------- rule 20

/// Rule 20: a record keeps its attempt number. Attempt 1 on a fresh record,
/// 2 on the first takeover of an expired lease (with when attempt 1 started),
/// 3 on the next, and back to 1 when an expired record is replaced or a
/// released key is reserved again. The number stays with the completed record.
pub async fn attempts_are_counted_in_the_record<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let identity = id(&tenant, "conformance.attempts", "k");
    let f = fp("a");
    acquire(&store, &identity, Some(&f), SHORT, LONG).await;
    let first = fetch(&store, &identity).await.unwrap();
    assert_eq!(first.attempt, 1, "a fresh record is attempt 1: {first:?}");
    assert!(first.attempt_started_at_ms <= first.now_ms);
    assert_eq!(first.created_at_ms, first.attempt_started_at_ms);

    tokio::time::sleep(PAST_SHORT).await;
    let second = OwnerToken::new();
    let got = reserve(&store, &identity, Some(&f), &second, SHORT, LONG).await;
    assert_takeover(&got, 2);
    let Reservation::Acquired {
        previous_attempt_started_at_ms: Some(previous),
        ..
    } = got
    else {
        unreachable!("checked by assert_takeover");
    };
    assert_eq!(
        previous, first.attempt_started_at_ms,
        "the takeover reports when attempt 1 started"
    );
    let taken = fetch(&store, &identity).await.unwrap();
    assert_eq!(taken.attempt, 2, "{taken:?}");
    assert!(taken.attempt_started_at_ms > first.attempt_started_at_ms);
    assert_eq!(
        taken.created_at_ms, first.created_at_ms,
        "still the same record"
    );

    tokio::time::sleep(PAST_SHORT).await;
    let third = OwnerToken::new();
    let got = reserve(&store, &identity, None, &third, LONG, LONG).await;
    assert_takeover(&got, 3);
    assert!(matches!(
        got,
        Reservation::Acquired { previous_attempt_started_at_ms: Some(p), .. }
            if p == taken.attempt_started_at_ms
    ));
    // Completion keeps the attempt that completed it; replays do not count.
    assert_eq!(
        store
            .complete(Completion::by_body(&identity, &third, &ok(b"3"), SHORT))
            .await
            .unwrap(),
        Fenced::Written
    );
    assert_eq!(
        reserve(&store, &identity, Some(&f), &OwnerToken::new(), LONG, LONG).await,
        Reservation::Completed(ok(b"3"))
    );
    let done = fetch(&store, &identity).await.unwrap();
    assert_eq!((done.state, done.attempt), (RecordState::Complete, 3));
    assert!(!done.recovered);

    // The record expires (ttl SHORT): replacing it starts again at attempt 1.
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        reserve(&store, &identity, Some(&f), &OwnerToken::new(), LONG, LONG).await,
        Reservation::FRESH,
        "an expired record is replaced, not taken over"
    );
    assert_eq!(fetch(&store, &identity).await.unwrap().attempt, 1);

    // An abandoned reservation (lease and ttl both run out) is replaced too.
    let abandoned = id(&tenant, "conformance.attempts", "abandoned");
    acquire(&store, &abandoned, None, SHORT, SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        reserve(&store, &abandoned, None, &OwnerToken::new(), LONG, LONG).await,
        Reservation::FRESH
    );

    // A released key starts again at attempt 1.
    let released = id(&tenant, "conformance.attempts", "released");
    acquire(&store, &released, None, SHORT, LONG).await;
    tokio::time::sleep(PAST_SHORT).await;
    let owner = OwnerToken::new();
    assert_takeover(
        &reserve(&store, &released, None, &owner, LONG, LONG).await,
        2,
    );
    assert_eq!(
        store.release(&released, &owner).await.unwrap(),
        Fenced::Written
    );
    assert_eq!(
        reserve(&store, &released, None, &OwnerToken::new(), LONG, LONG).await,
        Reservation::FRESH
    );
}

/// Rule 20: `complete` with `AnsweredBy::RecoverHook` is fenced the same way, and marks
/// the record recovered; scope statistics count taken-over and recovered records.
pub async fn recovered_completions_are_marked_and_counted<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let scope = fresh_scope("conformance.recovered");
    let key = |k: &str| id(&tenant, &scope, k);
    // Taken over, then completed by a recover hook.
    acquire(&store, &key("recovered"), None, SHORT, LONG).await;
    // Taken over, then completed by the body.
    acquire(&store, &key("rerun"), None, SHORT, LONG).await;
    // Never taken over.
    record(&store, &key("plain"), None, &ok(b"1"), LONG).await;
    tokio::time::sleep(PAST_SHORT).await;
    let (t1, t2) = (OwnerToken::new(), OwnerToken::new());
    assert_takeover(
        &reserve(&store, &key("recovered"), None, &t1, LONG, LONG).await,
        2,
    );
    assert_takeover(
        &reserve(&store, &key("rerun"), None, &t2, LONG, LONG).await,
        2,
    );
    // Fenced like complete: a stale token changes nothing.
    assert_eq!(
        store
            .complete(Completion {
                identity: &key("recovered"),
                token: &OwnerToken::new(),
                outcome: &ok(b"\"x\""),
                ttl: LONG,
                by: AnsweredBy::RecoverHook
            })
            .await
            .unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        store
            .complete(Completion {
                identity: &key("recovered"),
                token: &t1,
                outcome: &ok(b"\"found\""),
                ttl: LONG,
                by: AnsweredBy::RecoverHook
            })
            .await
            .unwrap(),
        Fenced::Written
    );
    assert_eq!(
        store
            .complete(Completion::by_body(
                &key("rerun"),
                &t2,
                &ok(b"\"ran\""),
                LONG
            ))
            .await
            .unwrap(),
        Fenced::Written
    );
    let recovered = fetch(&store, &key("recovered")).await.unwrap();
    assert_eq!(
        (recovered.state, recovered.attempt, recovered.recovered),
        (RecordState::Complete, 2, true)
    );
    assert_eq!(recovered.outcome, Some(ok(b"\"found\"")));
    assert!(!fetch(&store, &key("rerun")).await.unwrap().recovered);
    // A second completion is refused: the record is complete.
    assert_eq!(
        store
            .complete(Completion {
                identity: &key("recovered"),
                token: &t1,
                outcome: &ok(b"\"again\""),
                ttl: LONG,
                by: AnsweredBy::RecoverHook
            })
            .await
            .unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        reserve(
            &store,
            &key("recovered"),
            None,
            &OwnerToken::new(),
            LONG,
            LONG
        )
        .await,
        Reservation::Completed(ok(b"\"found\""))
    );

    let stats = store.scope_stats().await.expect("scope_stats succeeds");
    let mine = stats
        .iter()
        .find(|s| s.scope == scope)
        .unwrap_or_else(|| panic!("no stats for {scope}"));
    assert_eq!(mine.complete, 3, "{mine:?}");
    assert_eq!(mine.taken_over, 2, "{mine:?}");
    assert_eq!(mine.recovered, 1, "{mine:?}");
}

/// The operator's release (`idempotent release`): an in-progress record is
/// deleted without its owner's token; a complete record never is; with
/// `require_expired_lease`, neither is one whose lease is live.
pub async fn force_release_frees_only_in_progress_records<S: Store + Clone + 'static>(store: S) {
    let tenant = fresh_tenant();
    let stuck = id(&tenant, "conformance.force_release", "stuck");
    let running = id(&tenant, "conformance.force_release", "running");
    let done = id(&tenant, "conformance.force_release", "done");
    let absent = id(&tenant, "conformance.force_release", "absent");
    acquire(&store, &stuck, None, SHORT, LONG).await;
    let owner = acquire(&store, &running, None, LONG, LONG).await;
    record(&store, &done, None, &ok(b"\"kept\""), LONG).await;
    tokio::time::sleep(PAST_SHORT).await;
    // A stuck record taken over once (attempt 2), then stuck again.
    assert_takeover(
        &reserve(&store, &stuck, None, &OwnerToken::new(), SHORT, LONG).await,
        2,
    );
    tokio::time::sleep(PAST_SHORT).await;

    let before = fetch(&store, &done).await.unwrap();
    for require in [true, false] {
        assert_eq!(
            store.force_release(&done, require).await.unwrap(),
            ForcedRelease::Complete,
            "a complete record is refused"
        );
    }
    assert_same_record(
        &before,
        &fetch(&store, &done).await.unwrap(),
        "refused release",
    );
    assert_eq!(
        store.force_release(&absent, true).await.unwrap(),
        ForcedRelease::Absent
    );
    match store.force_release(&running, true).await.unwrap() {
        ForcedRelease::LeaseLive { lease_remaining } => {
            assert!(lease_remaining > LONG / 2, "{lease_remaining:?}")
        }
        other => panic!("a live lease is refused when it must have run out: {other:?}"),
    }
    assert_eq!(
        fetch(&store, &running)
            .await
            .unwrap()
            .owner_token
            .as_deref(),
        Some(owner.as_str())
    );
    assert_eq!(
        store.force_release(&stuck, true).await.unwrap(),
        ForcedRelease::Released { attempt: 2 }
    );
    assert!(fetch(&store, &stuck).await.is_none());
    assert_eq!(
        store.force_release(&running, false).await.unwrap(),
        ForcedRelease::Released { attempt: 1 },
        "without the requirement a live lease is released too"
    );
    // The owner's own operations now find nothing; the key is fresh.
    assert_eq!(
        store.heartbeat(&running, &owner, LONG).await.unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        store
            .complete(Completion::by_body(&running, &owner, &ok(b"1"), LONG))
            .await
            .unwrap(),
        Fenced::NotOwner
    );
    assert_eq!(
        reserve(&store, &stuck, None, &OwnerToken::new(), LONG, LONG).await,
        Reservation::FRESH
    );
}

/// Rules 1 and 20: an operator's release frees one identity only. The same
/// scope and key under another tenant (in progress or complete), and the same
/// tenant and key in another scope, are other records: each is left exactly
/// as it was, with or without the expired-lease requirement.
pub async fn force_release_touches_one_identity_only<S: Store + Clone + 'static>(store: S) {
    let (mine, theirs, third) = (fresh_tenant(), fresh_tenant(), fresh_tenant());
    let scope = "conformance.force_release_one";
    let stuck = id(&mine, scope, "same-key");
    let their_running = id(&theirs, scope, "same-key");
    let their_done = id(&third, scope, "same-key");
    let my_other_scope = id(&mine, "conformance.force_release_two", "same-key");
    acquire(&store, &stuck, None, SHORT, LONG).await;
    let their_owner = acquire(&store, &their_running, None, LONG, LONG).await;
    record(&store, &their_done, None, &ok(b"\"theirs\""), LONG).await;
    let my_other_owner = acquire(&store, &my_other_scope, None, LONG, LONG).await;
    tokio::time::sleep(PAST_SHORT).await;
    let untouched = [&their_running, &their_done, &my_other_scope];
    let mut before = Vec::new();
    for identity in untouched {
        before.push(fetch(&store, identity).await.expect("planted"));
    }

    assert_eq!(
        store.force_release(&stuck, true).await.unwrap(),
        ForcedRelease::Released { attempt: 1 }
    );
    // Again, without the requirement, on a key that is now fresh and then
    // in progress under a live lease.
    acquire(&store, &stuck, None, LONG, LONG).await;
    assert_eq!(
        store.force_release(&stuck, false).await.unwrap(),
        ForcedRelease::Released { attempt: 1 }
    );
    assert!(fetch(&store, &stuck).await.is_none());
    for (identity, before) in untouched.into_iter().zip(&before) {
        let after = fetch(&store, identity).await.unwrap_or_else(|| {
            panic!(
                "releasing ({}, {scope}, same-key) deleted {identity:?}",
                stuck.tenant()
            )
        });
        assert_same_record(before, &after, "another identity's record");
    }
    // Their owners still own their records.
    assert_eq!(
        store
            .complete(Completion::by_body(
                &their_running,
                &their_owner,
                &ok(b"1"),
                LONG
            ))
            .await
            .unwrap(),
        Fenced::Written
    );
    assert_eq!(
        store
            .heartbeat(&my_other_scope, &my_other_owner, LONG)
            .await
            .unwrap(),
        Fenced::Written
    );
}

// ---------------------------------------------------------------- the macro

/// Generates one `#[tokio::test]` per rule for the store made by `$make`, an
/// `async` block evaluating to `Option<S>` (`None`: skipped, loudly).
#[macro_export]
macro_rules! store_conformance_tests {
    ($make:expr) => {
        $crate::store_conformance_tests!(@tests $make;
            identity_separated_by_tenant,
            identity_separated_by_scope,
            shared_namespace_is_distinct_from_every_tenant,
            reserve_is_atomic_under_concurrency,
            a_token_presented_twice_acquires_once,
            takeover_is_atomic_under_concurrency,
            in_progress_reports_lease_remaining,
            complete_then_replay,
            recorded_error_round_trips,
            release_frees_the_key,
            release_detached_frees_the_key,
            complete_detached_records_and_is_fenced,
            a_detached_recover_hook_answer_keeps_the_mark,
            end_lease_detached_keeps_the_record_for_a_takeover,
            fingerprint_mismatch_on_complete_record,
            fingerprint_mismatch_on_in_progress_record,
            missing_fingerprint_is_not_contradicted,
            expired_lease_is_taken_over,
            heartbeat_extends_the_lease,
            heartbeat_moves_the_retention_with_the_lease,
            expired_record_counts_as_absent,
            retention_counts_from_the_completion,
            purge_deletes_only_expired_records,
            big_payload_round_trips,
            unusual_keys_and_tenants_are_exact,
            extreme_durations_are_accepted,
            scope_stats_count_by_state,
            unpurged_time_of_an_abandoned_record_counts_from_its_lease_end,
            attempts_are_counted_in_the_record,
            recovered_completions_are_marked_and_counted,
            force_release_frees_only_in_progress_records,
            force_release_touches_one_identity_only,
            a_stale_owners_write_racing_takeovers_has_one_winner,
        );
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                match $make.await {
                    Some(store) => $crate::conformance::$name(store).await,
                    None => $crate::conformance::skipped(stringify!($name)),
                }
            }
        )*
    };
}
