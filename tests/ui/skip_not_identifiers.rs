// `skip(...)` lists parameter names; anything else is refused, every such
// entry at once, each at the entry (a parameter's field names the parameter
// to skip instead).
// (Its expected message is in the .stderr beside this file.)
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "review.skip", key = key, tenant = shared, skip(req.trace_id, note, req.span_id, 7))]
async fn charge(key: &str, req: u8, note: String) -> Result<u8, Error> {
    Ok(req)
}

fn main() {}
