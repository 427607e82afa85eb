use idempotent_runtime::{idempotent, Error};

const SCOPE: &str = "payments.charge";

#[idempotent(scope = SCOPE, key = key, tenant = shared)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
