use idempotent_runtime::{idempotent, Error, MemoryStore};

// A value of the wrong kind is reported over the whole value, from its first
// token to its last, not at its first token only.
#[idempotent(scope = "spans.ttl", key = key, tenant = shared, ttl = 24 * 3600)]
async fn ttl_computed(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "spans.errors", key = key, tenant = shared, errors = record_when(is_final))]
async fn errors_unknown_call(key: &str) -> Result<u8, Error> {
    Ok(1)
}

struct Payments {
    store: MemoryStore,
}

impl Payments {
    #[idempotent(scope = "spans.tx", key = key, tenant = shared, tx = self.conn, store = self.store)]
    async fn charge(&self, key: &str) -> Result<u8, Error> {
        Ok(1)
    }
}

fn main() {}
