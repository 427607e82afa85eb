use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "orders.refund", key = key, tenant = shared)]
async fn refund(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
