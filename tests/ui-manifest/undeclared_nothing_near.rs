// An undeclared scope with no declared name near it: no "did you mean"
// (with one near it: undeclared.rs).
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "billing.invoice", key = key, tenant = shared)]
async fn invoice(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
