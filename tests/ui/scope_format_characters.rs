// More of the scope format (the other rules are in scope_format.rs): a leading
// dot, a space, a control character (here a tab written as `\t`).
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = ".payments.charge", key = key, tenant = shared)]
async fn leading_dot(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments charge", key = key, tenant = shared)]
async fn space(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.\tcharge", key = key, tenant = shared)]
async fn control_character(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
