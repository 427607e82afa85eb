use idempotent_runtime::{idempotent, Error};

#[idempotent]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
