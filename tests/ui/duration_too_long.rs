// A duration too long to be stored (beyond u64::MAX milliseconds) is refused.
// (Its expected message is in the .stderr beside this file.)
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "review.ttl", key = key, tenant = shared, ttl = "600000000years")]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
