// The attribute written twice is found whatever path names it: here the
// second is `idempotent_runtime::idempotent`, not the imported name.
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "ui.outer", key = key, tenant = shared)]
#[idempotent_runtime::idempotent(scope = "ui.inner", key = key, tenant = shared)]
async fn charge(key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
