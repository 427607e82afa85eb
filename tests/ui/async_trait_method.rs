use idempotent_runtime::{idempotent, Error};

#[async_trait::async_trait]
trait Charge {
    async fn charge(&self, key: &str, amount: u64) -> Result<u64, Error>;
}

struct Gateway;

// `#[async_trait]` on the impl rewrites the method into one returning a boxed
// future before `#[idempotent]` sees it.
#[async_trait::async_trait]
impl Charge for Gateway {
    #[idempotent(scope = "payments.charge", key = key, tenant = shared)]
    async fn charge(&self, key: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount)
    }
}

fn main() {}
