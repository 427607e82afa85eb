use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
async fn charge(key: &str, (amount, currency): (u64, String), _: u8) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
