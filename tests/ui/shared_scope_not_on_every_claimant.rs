// Rule 21: sharing a scope needs `shared_scope` on every claimant; one without
// it is the duplicate-scope error, naming all sites.
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope)]
async fn refund_http(order: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope)]
async fn refund_queue(order: &str) -> Result<u8, Error> {
    Ok(2)
}

#[idempotent(scope = "refunds.order", key = order, tenant = shared)]
async fn refund_cron(order: &str) -> Result<u8, Error> {
    Ok(3)
}

fn main() {}
