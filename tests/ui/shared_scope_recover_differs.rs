// Rule 21 (and 20): claimants of a shared scope either all ask a recover hook or none does.
use idempotent_runtime::{idempotent, Error, Recovery, Takeover};

async fn look_up(_: &Takeover) -> Result<Recovery<u8>, Error> {
    Ok(Recovery::Run)
}

#[idempotent(scope = "refunds.hooked", key = order, tenant = shared, shared_scope, recover = look_up)]
async fn refund_http(order: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "refunds.hooked", key = order, tenant = shared, shared_scope)]
async fn refund_queue(order: &str) -> Result<u8, Error> {
    Ok(2)
}

fn main() {}
