use idempotent_runtime::idempotent;

#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
async fn returns_option(key: &str) -> Option<u8> {
    Some(1)
}

#[idempotent(scope = "payments.notify", key = key, tenant = shared)]
async fn returns_nothing(key: &str) {}

fn main() {}
