//! Bad input on the wire, against any store: awkward bytes in keys and
//! tenants match exactly, large results round-trip or are refused whole.
#![allow(dead_code)]

use idempotent_runtime::{
    idempotent, Completion, Error, Fenced, Identity, KeyProblem, OwnerToken, Reservation,
    ReserveRequest, Store, StoredOutcome, MAX_RESULT_BYTES,
};
use std::time::Duration;

fn request<'a>(identity: &'a Identity, token: &'a OwnerToken) -> ReserveRequest<'a> {
    ReserveRequest {
        identity,
        fingerprint: None,
        token,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    }
}

/// Keys and tenants with SQL metacharacters, pattern characters, backslashes,
/// quotes, trailing spaces, case and Unicode normalization variants: each is
/// its own record, and each replays exactly its own outcome.
pub async fn awkward_identities_match_exactly(store: &dyn Store) {
    let run = uuid::Uuid::new_v4().simple().to_string();
    let keys = [
        "plain",
        "Plain",
        "pla%",
        "pla_n",
        "p_a%n",
        "it's",
        "it''s",
        "\"quoted\"",
        "back\\slash",
        "back\\\\slash",
        "trailing ",
        "trailing",
        "Ünïcødé ключ 鍵 🔑",
        "e\u{301}",
        "\u{e9}",
        "'; DROP TABLE idempotency_records; --",
    ];
    let tenants = [
        format!("t-{run}"),
        format!("t-{run}%"),
        format!("t-{run}_'\\ü"),
    ];
    for tenant in &tenants {
        for key in keys {
            let id = Identity::new(tenant.as_str(), "wire.exact", key).expect("valid identity");
            let token = OwnerToken::new();
            let answer = store.reserve(request(&id, &token)).await.expect("reserve");
            assert_eq!(answer, Reservation::FRESH, "fresh: {tenant:?} {key:?}");
            let payload = serde_json::to_vec(&(tenant, key)).expect("json");
            let outcome = StoredOutcome {
                is_error: false,
                payload,
            };
            assert_eq!(
                store
                    .complete(Completion::by_body(
                        &id,
                        &token,
                        &outcome,
                        Duration::from_secs(3600)
                    ))
                    .await
                    .expect("complete"),
                Fenced::Written
            );
        }
    }
    for tenant in &tenants {
        for key in keys {
            let id = Identity::new(tenant.as_str(), "wire.exact", key).expect("valid identity");
            let token = OwnerToken::new();
            let expected = serde_json::to_vec(&(tenant, key)).expect("json");
            match store.reserve(request(&id, &token)).await.expect("reserve") {
                Reservation::Completed(o) => assert_eq!(o.payload, expected, "{tenant:?} {key:?}"),
                other => panic!("{tenant:?} {key:?}: expected its own record, got {other:?}"),
            }
            let snapshot = store.fetch(&id).await.expect("fetch").expect("record");
            assert_eq!(snapshot.outcome.map(|o| o.payload), Some(expected));
        }
    }
}

/// NUL and other control characters never reach a store: validation refuses them.
pub fn control_characters_are_refused() {
    for bad in [
        "a\0b",
        "\0",
        "line\nbreak",
        "tab\t",
        "bell\u{7}",
        "del\u{7f}",
        "c1\u{85}",
    ] {
        assert!(
            matches!(
                Identity::new("tenant", "wire.exact", bad),
                Err(Error::InvalidKey(KeyProblem::ControlCharacter { .. }))
            ),
            "key {bad:?}"
        );
        assert!(
            matches!(
                Identity::new(bad, "wire.exact", "key"),
                Err(Error::InvalidTenant(KeyProblem::ControlCharacter { .. }))
            ),
            "tenant {bad:?}"
        );
    }
}

/// A result of several megabytes (every byte value) round-trips exactly.
pub async fn several_megabytes_round_trip(store: &dyn Store) {
    let id = Identity::new(
        format!("t-{}", uuid::Uuid::new_v4()),
        "wire.big",
        "six-megabytes",
    )
    .expect("identity");
    let payload: Vec<u8> = (0..6 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let token = OwnerToken::new();
    assert!(matches!(
        store.reserve(request(&id, &token)).await.expect("reserve"),
        Reservation::Acquired { .. }
    ));
    let outcome = StoredOutcome {
        is_error: false,
        payload: payload.clone(),
    };
    assert_eq!(
        store
            .complete(Completion::by_body(
                &id,
                &token,
                &outcome,
                Duration::from_secs(3600)
            ))
            .await
            .expect("complete"),
        Fenced::Written
    );
    match store
        .reserve(request(&id, &OwnerToken::new()))
        .await
        .expect("reserve")
    {
        Reservation::Completed(o) => {
            assert_eq!(o.payload.len(), payload.len(), "never truncated");
            assert!(o.payload == payload, "byte for byte");
        }
        other => panic!("expected a replay, got {other:?}"),
    }
}

#[idempotent(scope = "wire.too_big", key = key, tenant = tenant, store = store)]
async fn too_big(store: &dyn Store, tenant: &str, key: &str) -> Result<String, Error> {
    Ok("x".repeat(MAX_RESULT_BYTES + 1))
}

/// A result over `MAX_RESULT_BYTES` is refused whole, through the engine, and leaves no record.
pub async fn over_the_limit_is_refused_and_leaves_no_record(store: &dyn Store) {
    let tenant = format!("t-{}", uuid::Uuid::new_v4());
    match too_big(store, &tenant, "k").await {
        Err(Error::ResultTooLarge { size, limit, .. }) => {
            assert_eq!(limit, MAX_RESULT_BYTES);
            assert!(size > limit);
        }
        other => panic!("expected ResultTooLarge, got {:?}", other.map(|s| s.len())),
    }
    let id = Identity::new(tenant.as_str(), "wire.too_big", "k").expect("identity");
    assert_eq!(
        store.fetch(&id).await.expect("fetch"),
        None,
        "no record left"
    );
}
