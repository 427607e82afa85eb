use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", tenant = account)]
async fn charge(account: &str, key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
