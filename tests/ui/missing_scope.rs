use idempotent_runtime::{idempotent, Error};

#[idempotent(key = key, tenant = shared)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
