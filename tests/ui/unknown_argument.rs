use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, tll = "1h")]
async fn typo(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.refund", key = key, tenant = shared, retries = 3)]
async fn unrelated(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
