// `skip(...)` lists parameter names; anything else is refused.
// (Its expected message is in the .stderr beside this file.)
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "review.skip", key = key, tenant = shared, skip(req.trace_id))]
async fn charge(key: &str, req: u8) -> Result<u8, Error> {
    Ok(req)
}

fn main() {}
