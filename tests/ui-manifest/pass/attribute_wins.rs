// A ttl or lease written in the attribute overrides the manifest's default.
use idempotent_runtime::{idempotent, registry, Error};
use std::time::Duration;

#[idempotent(scope = "orders.cancel", key = key, tenant = shared, ttl = "1h")]
async fn cancel(key: &str) -> Result<u8, Error> {
    Ok(2)
}

fn main() {
    let cancel = registry::scopes()
        .into_iter()
        .find(|s| s.scope == "orders.cancel")
        .expect("registered");
    assert_eq!(cancel.ttl, Duration::from_secs(3600), "the attribute wins");
    assert_eq!(
        cancel.lease,
        Duration::from_secs(5),
        "the manifest's default"
    );
}
