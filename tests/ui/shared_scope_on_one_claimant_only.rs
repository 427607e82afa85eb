// Rule 21: one claimant says `shared_scope`, the next does not: the
// duplicate-scope error, saying that sharing is meant (with two or more
// claimants saying it: shared_scope_not_on_every_claimant.rs). And the other
// way round: the flag on the second claimant only.
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope)]
async fn refund_http(order: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.order", key = order, tenant = shared)]
async fn refund_queue(order: &str) -> Result<u8, Error> {
    Ok(2)
}

#[idempotent(scope = "refunds.late", key = order, tenant = shared)]
async fn late_http(order: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.late", key = order, tenant = shared, shared_scope)]
async fn late_queue(order: &str) -> Result<u8, Error> {
    Ok(2)
}

fn main() {}
