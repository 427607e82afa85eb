use idempotent_runtime::{idempotent, Error};

// `shared` is both the opt-out and a parameter: refused, never a silent merge.
#[idempotent(scope = "ui.shared_param", key = key, tenant = shared)]
async fn charge(shared: &str, key: &str) -> Result<u64, Error> {
    Ok(1)
}

fn main() {}
