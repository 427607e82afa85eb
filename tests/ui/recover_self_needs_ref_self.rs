use idempotent_runtime::{idempotent, Error, MemoryStore, Recovery, Takeover};

#[idempotent(scope = "payments.charge", key = key, tenant = shared, store = store,
             recover = self.charge_happened)]
async fn charge(store: &MemoryStore, key: &str) -> Result<u8, Error> {
    Ok(1)
}

struct Payments {
    store: MemoryStore,
}

impl Payments {
    async fn charge_happened(&self, _: &Takeover) -> Result<Recovery<u8>, Error> {
        Ok(Recovery::Run)
    }

    #[idempotent(scope = "payments.refund", key = key, tenant = shared, store = self.store,
                 recover = self.charge_happened)]
    async fn refund(&mut self, key: &str) -> Result<u8, Error> {
        Ok(1)
    }

    #[idempotent(scope = "payments.void", key = key, tenant = shared, store = self.store,
                 recover = self.charge_happened)]
    async fn void(self: Box<Self>, key: &str) -> Result<u8, Error> {
        Ok(1)
    }

    #[idempotent(scope = "payments.capture", key = key, tenant = shared, store = self.store,
                 recover = self.0)]
    async fn capture(&self, key: &str) -> Result<u8, Error> {
        Ok(1)
    }
}

fn main() {}
