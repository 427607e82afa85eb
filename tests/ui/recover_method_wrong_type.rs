// `recover = self.<method>`: the method must exist and answer with the
// function's own T and E (for a free function hook: recover_wrong_type.rs).
use idempotent_runtime::{idempotent, Error, MemoryStore, Recovery, Takeover};

struct Payments {
    store: MemoryStore,
}

#[derive(Debug)]
struct OtherError;

impl Payments {
    async fn wrong_error(&self, _: &Takeover) -> Result<Recovery<u8>, OtherError> {
        Ok(Recovery::Run)
    }

    #[idempotent(scope = "payments.charge", key = key, tenant = shared, store = self.store,
                 recover = self.wrong_error)]
    async fn charge(&self, key: &str) -> Result<u8, Error> {
        Ok(1)
    }

    #[idempotent(scope = "payments.refund", key = key, tenant = shared, store = self.store,
                 recover = self.no_such_hook)]
    async fn refund(&self, key: &str) -> Result<u8, Error> {
        Ok(1)
    }
}

fn main() {}
