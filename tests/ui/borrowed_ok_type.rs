// A borrowed `Ok` type cannot come back from a replay (the recorded answer is
// decoded into a new value): refused with a message saying what to return
// instead, in place of rustc's "`Deserialize` is not general enough".
use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "payments.label", key = key, tenant = shared)]
async fn label(key: &str) -> Result<&'static str, Error> {
    Ok("charged")
}

#[idempotent(scope = "payments.labels", key = key, tenant = shared)]
async fn labels(key: &str) -> std::io::Result<Vec<(u8, &'static [u8])>> {
    Ok(Vec::new())
}

// Not borrowed data: passes this check.
#[idempotent(scope = "payments.marker", key = key, tenant = shared)]
async fn marker(key: &str) -> Result<std::marker::PhantomData<&'static str>, Error> {
    Ok(std::marker::PhantomData)
}

fn main() {}
