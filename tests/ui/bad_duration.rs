use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.one", key = key, tenant = shared, ttl = "one day")]
async fn unparseable(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.two", key = key, tenant = shared, ttl = "0s")]
async fn zero(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.three", key = key, tenant = shared, lease = "2ms")]
async fn lease_too_short(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.four", key = key, tenant = shared, in_progress = wait("0s"))]
async fn zero_wait(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.five", key = key, tenant = shared, lease = 30)]
async fn not_a_string(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
