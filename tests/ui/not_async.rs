use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
