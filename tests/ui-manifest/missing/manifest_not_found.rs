use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "orders.place", key = key, tenant = shared)]
async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
