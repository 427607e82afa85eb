// `&self` methods, generic functions with `store = store`, `&dyn Store`,
// `tenant = shared`, `fingerprint = false`, and a method in a trait impl.
use idempotent_runtime::{idempotent, Error, MemoryStore, Store};

pub struct Service {
    store: MemoryStore,
    tenant: String,
}

impl Service {
    #[idempotent(scope = "svc.method", key = key, tenant = self.tenant, store = self.store)]
    pub async fn method(&self, key: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount + self.tenant.len() as u64)
    }
}

#[idempotent(scope = "svc.generic", key = key, tenant = shared, store = store)]
pub async fn generic<S: Store>(store: &S, key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount)
}

#[idempotent(scope = "svc.dyn", key = key, tenant = shared, store = store, fingerprint = false)]
pub async fn dynamic(store: &dyn Store, key: &str, amount: u64) -> Result<u64, Error> {
    Ok(amount)
}

pub trait Refunds {
    async fn refund(&self, key: &str) -> Result<u64, Error>;
}

impl Refunds for Service {
    #[idempotent(scope = "svc.refund", key = key, tenant = shared, store = self.store, in_progress = reject)]
    async fn refund(&self, key: &str) -> Result<u64, Error> {
        Ok(0)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let service = Service {
        store: MemoryStore::new(),
        tenant: "t".into(),
    };
    assert_eq!(service.method("k", 1).await.unwrap(), 2);
    assert_eq!(generic(&service.store, "k", 3).await.unwrap(), 3);
    assert_eq!(dynamic(&service.store, "k", 4).await.unwrap(), 4);
    assert_eq!(service.refund("k").await.unwrap(), 0);
}
