use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, skip(amout))]
async fn charge(key: &str, amount: u64) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
