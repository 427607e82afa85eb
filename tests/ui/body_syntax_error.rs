use idempotent_runtime::{idempotent, Error};

// A syntax error inside the body is rustc's to report, at its place; the
// macro does not parse the body, so it does not turn it into its own error.
#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
async fn charge(key: &str) -> Result<u8, Error> {
    let = 1;
    Ok(1)
}

fn main() {}
