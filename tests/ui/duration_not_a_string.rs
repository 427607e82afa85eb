// A duration is written in a string literal, for `ttl` and inside `wait(...)`
// too (`lease = 30` is in bad_duration.rs); the `wait` message shows how
// `wait` is written.
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.ttl", key = key, tenant = shared, ttl = 24)]
async fn ttl_not_a_string(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.wait", key = key, tenant = shared, in_progress = wait(10))]
async fn wait_not_a_string(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
