// Rule 21 (and 3): claimants of a shared scope either all keep one namespace
// for every tenant (`tenant = shared`) or all name the tenant: otherwise one
// event through both is two records, and its body runs twice.
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "refunds.namespaced", key = order, tenant = shop, shared_scope)]
async fn refund_http(shop: &str, order: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.namespaced", key = order, tenant = shared, shared_scope)]
async fn refund_queue(order: &str) -> Result<u8, Error> {
    Ok(2)
}

fn main() {}
