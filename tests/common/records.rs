//! Records planted directly through the `Store` trait, for the operator tests
//! (audit, CLI, purge): no annotated function, just the states they inspect.

use idempotent_runtime::{
    Completion, Fenced, Fingerprint, Identity, OwnerToken, Reservation, ReserveRequest, Store,
    StoredOutcome,
};
use std::time::Duration;

/// Reserves `identity` through the store for a new owner, which must acquire
/// it (a fresh key); returns the owner's token.
pub async fn acquire(
    store: &dyn Store,
    identity: &Identity,
    fingerprint: Option<&Fingerprint>,
    lease: Duration,
    ttl: Duration,
) -> OwnerToken {
    let token = OwnerToken::new();
    let reserved = store
        .reserve(ReserveRequest {
            identity,
            fingerprint,
            token: &token,
            lease,
            ttl,
        })
        .await
        .expect("reserve");
    assert!(
        matches!(reserved, Reservation::Acquired { .. }),
        "{reserved:?}"
    );
    token
}

/// What a crashed owner leaves: `identity` (a fresh key) in progress, its
/// lease of 1 ms soon over, kept for an hour; returns the owner's token.
pub async fn crashed(store: &dyn Store, identity: &Identity) -> OwnerToken {
    acquire(
        store,
        identity,
        None,
        Duration::from_millis(1),
        Duration::from_secs(3600),
    )
    .await
}

/// Reserves a fresh key of `scope` under `tenant` with `lease` and `ttl`, and
/// completes it (kept for `complete_ttl`) when that is given. Returns its identity.
pub async fn plant(
    store: &dyn Store,
    tenant: &str,
    scope: &str,
    lease: Duration,
    ttl: Duration,
    complete_ttl: Option<Duration>,
) -> Identity {
    let identity =
        Identity::new(tenant, scope, uuid::Uuid::new_v4().to_string()).expect("valid identity");
    let token = acquire(store, &identity, None, lease, ttl).await;
    if let Some(ttl) = complete_ttl {
        complete(store, &identity, &token, b"\"ok\"", ttl).await;
    }
    identity
}

/// Stores a complete record of `identity` (a fresh key) made with
/// `fingerprint` and holding the result `payload` (JSON), kept for an hour:
/// what a call of an older build, or of another process, leaves.
pub async fn recorded(
    store: &dyn Store,
    identity: &Identity,
    fingerprint: Option<&Fingerprint>,
    payload: &[u8],
) {
    let hour = Duration::from_secs(3600);
    let token = acquire(store, identity, fingerprint, Duration::from_secs(30), hour).await;
    complete(store, identity, &token, payload, hour).await;
}

/// Completes `identity`'s record, held by `token`, with the result `payload`.
async fn complete(
    store: &dyn Store,
    identity: &Identity,
    token: &OwnerToken,
    payload: &[u8],
    ttl: Duration,
) {
    let outcome = StoredOutcome {
        is_error: false,
        payload: payload.to_vec(),
    };
    assert_eq!(
        store
            .complete(Completion::by_body(identity, token, &outcome, ttl))
            .await
            .expect("complete"),
        Fenced::Written
    );
}

/// Begins a transaction on `conn` and locks the record's row in it
/// (PostgreSQL): a reservation of the record waits for it until the
/// transaction ends.
pub async fn pg_lock_row_in_transaction(conn: &mut sqlx::PgConnection, identity: &Identity) {
    sqlx::query("BEGIN")
        .execute(&mut *conn)
        .await
        .expect("begin");
    sqlx::query(
        "SELECT 1 FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE",
    )
    .bind(identity.tenant())
    .bind(identity.scope())
    .bind(identity.key())
    .fetch_one(&mut *conn)
    .await
    .expect("lock the row");
}
