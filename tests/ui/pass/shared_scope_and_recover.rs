// Rule 21: an HTTP handler and a queue consumer share one deduplication
// boundary on purpose, and agree on what they fingerprint, their ttl and
// asking a recover hook.
// Rule 20: `recover = path` on a free function, a method and in
// transactional mode.
use idempotent_runtime::{idempotent, Error, MemoryStore, Recovery, Takeover};

async fn refund_happened(_: &Takeover) -> Result<Recovery<u64>, Error> {
    Ok(Recovery::Run)
}

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope,
             ttl = "7d", recover = refund_happened)]
pub async fn refund_http(order: &str, amount: u64, _trace: &str) -> Result<u64, Error> {
    Ok(amount)
}

#[idempotent(scope = "refunds.order", key = order, tenant = shared, shared_scope,
             ttl = "7d", skip(delivery), recover = refund_happened)]
pub async fn refund_from_queue(order: &str, amount: u64, delivery: u32, _trace: &str) -> Result<u64, Error> {
    let _ = delivery;
    Ok(amount)
}

pub struct Service {
    store: MemoryStore,
}

impl Service {
    async fn charge_happened(t: &Takeover) -> Result<Recovery<String>, Error> {
        Ok(Recovery::Completed(format!("attempt {}", t.attempt())))
    }

    #[idempotent(scope = "payments.charge", key = key, tenant = shared, store = self.store,
                 recover = Self::charge_happened)]
    pub async fn charge(&self, key: &str) -> Result<String, Error> {
        Ok(key.to_owned())
    }
}

fn main() {
    let service = Service { store: MemoryStore::new() };
    drop(service.charge("k"));
    drop(refund_http("o", 1, "t"));
    drop(refund_from_queue("o", 1, 2, "t"));
}
