use idempotent_runtime::idempotent;

// The manifest's verdict (an undeclared scope) comes in the same round as the
// argument and function mistakes, not after them are fixed.
#[idempotent(scope = "orders.plase", key = key, tenant = shared, lease = "5ms", skip(nope))]
fn place(key: &str) -> Result<u8, idempotent_runtime::Error> {
    Ok(1)
}

fn main() {}
