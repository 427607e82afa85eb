// The hook must answer with the function's own T and E.
use idempotent_runtime::{idempotent, Error, Recovery, Takeover};

async fn wrong_value(_: &Takeover) -> Result<Recovery<String>, Error> {
    Ok(Recovery::Run)
}

#[idempotent(scope = "payments.charge", key = key, tenant = shared, recover = wrong_value)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.refund", key = key, tenant = shared, recover = no_such_hook)]
async fn refund(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
