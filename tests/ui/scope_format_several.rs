use idempotent_runtime::{idempotent, Error};

// A scope that breaks several rules of the format gets every one reported in
// one round, not the first alone (one rule at a time: scope_format.rs).
#[idempotent(scope = "Payments..charge/v1", key = key, tenant = shared)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
