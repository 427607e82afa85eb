use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "ui.outer", key = key, tenant = shared)]
#[idempotent(scope = "ui.inner", key = key, tenant = shared)]
async fn charge(key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
