use idempotent_runtime::{idempotent, Error};

// The manifest has a misspelt key (`tll`): refused, naming the key and the
// ones allowed, rather than compiled with the default ttl.
#[idempotent(scope = "orders.place", key = key, tenant = shared)]
async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
