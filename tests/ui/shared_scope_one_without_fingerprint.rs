// Rule 21: claimants of a shared scope fingerprint the same parameters; one
// with `fingerprint = false`, or with no fingerprinted parameter, beside one
// that fingerprints some is refused (names against names:
// shared_scope_fingerprint_differs.rs).
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope)]
async fn refund_http(order: &str, amount: u64) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope, fingerprint = false)]
async fn refund_queue(order: &str, amount: u64) -> Result<u8, Error> {
    Ok(2)
}

#[idempotent(scope = "refunds.bare", key = order, tenant = shared, shared_scope)]
async fn bare_http(order: &str, amount: u64) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.bare", key = order, tenant = shared, shared_scope)]
async fn bare_queue(order: &str) -> Result<u8, Error> {
    Ok(2)
}

fn main() {}
