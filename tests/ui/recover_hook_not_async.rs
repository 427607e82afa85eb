// The hook is an `async fn`: the generated code awaits what it returns. A
// plain `fn` returning the answer directly is refused at the hook's path.
use idempotent_runtime::{idempotent, Error, Recovery, Takeover};

fn charge_happened(_: &Takeover) -> Result<Recovery<u8>, Error> {
    Ok(Recovery::Run)
}

#[idempotent(scope = "payments.charge", key = key, tenant = shared, recover = charge_happened)]
async fn charge(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
