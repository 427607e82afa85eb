// `in_progress = wait(...)` takes one duration.
// (Its expected message is in the .stderr beside this file.)
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "review.wait", key = key, tenant = shared, in_progress = wait("1s", "2s"))]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
