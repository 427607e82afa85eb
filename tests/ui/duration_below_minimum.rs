// `ttl` and `wait(...)` have a minimum of 1ms (the lease's 10ms is in
// bad_duration.rs).
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.ttl", key = key, tenant = shared, ttl = "500us")]
async fn ttl_too_short(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.wait", key = key, tenant = shared, in_progress = wait("999us"))]
async fn wait_too_short(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
