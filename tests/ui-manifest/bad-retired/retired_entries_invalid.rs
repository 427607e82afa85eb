use idempotent_runtime::{idempotent, Error};

// `orders.place` is both declared and retired; the manifest is refused as a
// whole (with its other [retired] problem), not just this scope.
#[idempotent(scope = "orders.place", key = key, tenant = shared)]
async fn place(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
