use idempotent_runtime::{idempotent, Error};

// The manifest exists but cannot be read (it is not UTF-8).
#[idempotent(scope = "orders.place", key = key, tenant = shared)]
async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
