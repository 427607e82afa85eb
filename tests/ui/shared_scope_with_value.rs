use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "refunds.order", key = key, tenant = shared, shared_scope = true)]
async fn refund(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.other", key = key, tenant = shared, shared_scope(yes))]
async fn other(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
