use idempotent_runtime::{idempotent, Error};

struct Request {
    amount: u64,
}

#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
async fn charge(key: &str, request: &Request) -> Result<u64, Error> {
    Ok(request.amount)
}

fn main() {}
