// The hook takes one `&Takeover`; one that takes something else, or nothing,
// is refused at the hook's path.
use idempotent_runtime::{idempotent, Error, Recovery, Takeover};

async fn by_value(_: Takeover) -> Result<Recovery<u8>, Error> {
    Ok(Recovery::Run)
}

async fn no_parameter() -> Result<Recovery<u8>, Error> {
    Ok(Recovery::Run)
}

#[idempotent(scope = "payments.charge", key = key, tenant = shared, recover = by_value)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.refund", key = key, tenant = shared, recover = no_parameter)]
async fn refund(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
