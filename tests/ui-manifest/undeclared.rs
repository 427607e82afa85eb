use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "orders.plase", key = key, tenant = shared)]
async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
