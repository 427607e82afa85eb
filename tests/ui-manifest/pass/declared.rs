// Declared scopes compile; the manifest's ttl/lease are defaults the attribute overrides.
use idempotent_runtime::{idempotent, registry, Error};
use std::time::Duration;

#[idempotent(scope = "orders.place", key = key, tenant = shared)]
async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "orders.cancel", key = key, tenant = shared)]
async fn cancel(key: &str) -> Result<u8, Error> {
    Ok(2)
}

mod overriding {
    use super::*;

    // Another crate could declare the same scope differently; here the attribute wins.
    #[idempotent(scope = "orders.cancel", key = key, tenant = shared, lease = "9s")]
    #[cfg(any())] // never compiled: only shows that cfg'd twins are not duplicates
    pub async fn cancel_v2(key: &str) -> Result<u8, Error> {
        Ok(3)
    }
}

fn main() {
    let find = |scope: &str| {
        registry::scopes()
            .into_iter()
            .find(|s| s.scope == scope)
            .unwrap_or_else(|| panic!("{scope} not registered"))
    };
    let place = find("orders.place");
    assert_eq!(
        place.ttl,
        Duration::from_secs(24 * 3600),
        "built-in default"
    );
    assert_eq!(place.lease, Duration::from_secs(30), "built-in default");
    let cancel = find("orders.cancel");
    assert_eq!(
        cancel.ttl,
        Duration::from_secs(48 * 3600),
        "manifest default"
    );
    assert_eq!(cancel.lease, Duration::from_secs(5), "manifest default");
}
