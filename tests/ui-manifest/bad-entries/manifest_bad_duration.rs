use idempotent_runtime::{idempotent, Error};

// The scope itself is declared; the manifest is refused for its other entries.
#[idempotent(scope = "orders.place", key = key, tenant = shared)]
async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
