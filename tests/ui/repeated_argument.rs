use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, key = other)]
async fn charge(key: &str, other: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
