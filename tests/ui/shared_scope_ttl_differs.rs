// Rule 21: claimants of a shared scope must keep records for the same ttl.
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope, ttl = "7d")]
async fn refund_http(order: &str, amount: u64) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope)]
async fn refund_queue(order: &str, amount: u64) -> Result<u8, Error> {
    Ok(2)
}

fn main() {}
