use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "orders.place_v1", key = key, tenant = shared)]
async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
