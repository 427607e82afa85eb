// A retired scope whose [retired] entry gives no reason (with one: retired.rs).
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "orders.cancel_v1", key = key, tenant = shared)]
async fn cancel(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
