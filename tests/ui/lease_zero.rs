// A zero `lease` is refused (a zero `ttl` and a zero `wait(...)` are in
// bad_duration.rs).
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, lease = "0s")]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
