use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
async fn charge(key: &str) -> Result<Vec<impl serde::Serialize>, Error> {
    Ok(vec![1u8])
}

fn main() {}
