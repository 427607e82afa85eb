use idempotent_runtime::idempotent;

#[idempotent(scope = "payments.charge", key = key, tenant = shared)]
struct Charge {
    key: String,
}

trait Charger {
    #[idempotent(scope = "payments.refund", key = key, tenant = shared)]
    async fn refund(&self, key: &str) -> Result<u8, idempotent_runtime::Error>;
}

fn main() {}
