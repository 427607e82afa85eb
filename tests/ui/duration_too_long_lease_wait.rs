// `lease` and `wait(...)` too long to be stored (beyond u64::MAX milliseconds)
// are refused, as `ttl` is (duration_too_long.rs).
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.lease", key = key, tenant = shared, lease = "600000000years")]
async fn lease_too_long(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.wait", key = key, tenant = shared, in_progress = wait("600000000years"))]
async fn wait_too_long(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
