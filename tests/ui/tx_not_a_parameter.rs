use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, tx = transaction)]
async fn charge(tx: &mut u8, key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
