use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

mod legacy {
    use super::*;

    #[idempotent(scope = "payments.charge", key = key, tenant = shared)]
    pub async fn charge_again(key: &str) -> Result<u8, Error> {
        Ok(2)
    }
}

fn main() {}
