// `store = self.store` on a method that owns `self` (`self: Arc<Self>`, or
// `self` by value) whose body uses it: the body (an `async move` block)
// takes `self` while the store is borrowed from it for the whole call.
// rustc's own error was E0505 "cannot move out of `self` because it is
// borrowed", pointed at the whole attribute; the attribute says it at
// `store = ...`, with the way out. A body using only other fields of a
// by-value `self` compiles (fields are captured apart), and so does
// `store = self.store.clone()` (tests/attribute_contract/send_and_receivers.rs).
use idempotent_runtime::{idempotent, Error, MemoryStore};
use std::sync::Arc;

pub struct Service {
    store: MemoryStore,
    runs: u8,
}

impl Service {
    #[idempotent(scope = "owned_self.arc", key = key, tenant = shared, store = self.store)]
    pub async fn arc(self: Arc<Self>, key: &str) -> Result<u8, Error> {
        Ok(self.runs)
    }

    #[idempotent(scope = "owned_self.by_value", key = key, tenant = shared, store = self.store,
                 skip(self))]
    pub async fn by_value(self, key: &str) -> Result<u8, Error> {
        Ok(self.count())
    }

    fn count(&self) -> u8 {
        self.runs
    }
}

fn main() {}
