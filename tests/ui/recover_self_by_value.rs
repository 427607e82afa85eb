// `recover = self.<method>` needs a method taking `&self`; one that consumes
// `self` is refused (`&mut self`, `self: Box<Self>` and no `self` at all are
// in recover_self_needs_ref_self.rs).
use idempotent_runtime::{idempotent, Error, MemoryStore, Recovery, Takeover};

#[derive(serde::Serialize)]
struct Refund {
    order: String,
    #[serde(skip)]
    store: MemoryStore,
}

impl Refund {
    async fn refund_happened(&self, _: &Takeover) -> Result<Recovery<u8>, Error> {
        Ok(Recovery::Run)
    }

    #[idempotent(scope = "refunds.order", key = key, tenant = shared, store = self.store,
                 recover = self.refund_happened)]
    async fn execute(self, key: &str) -> Result<u8, Error> {
        Ok(1)
    }
}

fn main() {}
