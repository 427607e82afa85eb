// Where an argument's name is expected, something else: a doubled comma, or a
// value with no name. The rest of the attribute is not guessed at (no
// "missing `key`").
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge",, key = key, tenant = shared)]
async fn doubled_comma(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.refund", = 1, key = key, tenant = shared)]
async fn value_without_a_name(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
