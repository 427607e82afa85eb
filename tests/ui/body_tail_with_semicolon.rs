use idempotent_runtime::{idempotent, Error};

// The tail ends in `;`: the body's type is `()`, reported at the body.
#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
async fn charge(key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount);
}

fn main() {}
