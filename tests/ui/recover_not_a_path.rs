use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, recover = "charge_happened")]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.refund", key = key, tenant = shared, recover)]
async fn refund(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
