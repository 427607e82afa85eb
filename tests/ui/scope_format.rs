use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "Payments.charge", key = key, tenant = shared)]
async fn uppercase(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments..charge", key = key, tenant = shared)]
async fn empty_segment(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.charge.", key = key, tenant = shared)]
async fn trailing_dot(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments/charge", key = key, tenant = shared)]
async fn bad_character(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "", key = key, tenant = shared)]
async fn empty(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(
    scope = "a.very.long.scope.name.that.keeps.going.and.going.well.past.the.limit.of.one.hundred.and.twenty.eight.bytes.which.is.plenty.really",
    key = key,
    tenant = shared
)]
async fn too_long(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
