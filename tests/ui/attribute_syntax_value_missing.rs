// `key =` with nothing after it, at the end of the attribute.
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", tenant = shared, key =)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
