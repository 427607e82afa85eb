use idempotent_runtime::{idempotent, Error, MemoryStore};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, tx = tx, store = store)]
async fn charge(tx: &mut u8, store: &MemoryStore, key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
