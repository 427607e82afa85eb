use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "ui.body_type", key = key, tenant = shared)]
async fn charge(key: &str) -> Result<u32, Error> {
    Ok("a receipt")
}

fn main() {}
