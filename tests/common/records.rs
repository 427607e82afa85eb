//! Records planted directly through the `Store` trait, for the operator tests
//! (audit, CLI, purge): no annotated function, just the states they inspect.

use idempotent_runtime::{
    Completion, Fenced, Identity, OwnerToken, Reservation, ReserveRequest, Store, StoredOutcome,
};
use std::time::Duration;

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
    let token = OwnerToken::new();
    let r = store
        .reserve(ReserveRequest {
            identity: &identity,
            fingerprint: None,
            token: &token,
            lease,
            ttl,
        })
        .await
        .expect("reserve");
    assert!(matches!(r, Reservation::Acquired { .. }), "{r:?}");
    if let Some(ttl) = complete_ttl {
        let outcome = StoredOutcome {
            is_error: false,
            payload: b"\"ok\"".to_vec(),
        };
        assert_eq!(
            store
                .complete(Completion::by_body(&identity, &token, &outcome, ttl))
                .await
                .expect("complete"),
            Fenced::Written
        );
    }
    identity
}
