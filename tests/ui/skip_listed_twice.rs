use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, skip(note, note))]
async fn charge(key: &str, note: String) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
