// `crate = path` names where the runtime is; a path that names nothing is
// refused at the path.
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, crate = ::no_such_runtime)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
