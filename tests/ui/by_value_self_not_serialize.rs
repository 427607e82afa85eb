use idempotent_runtime::{idempotent, Error, MemoryStore};

/// A service taken by value: `self` is fingerprinted (a by-value `self` is
/// the request), so a type that is not `Serialize` must be skipped.
#[derive(Clone)]
struct Mailer {
    store: MemoryStore,
}

impl Mailer {
    #[idempotent(scope = "mail.send", key = key, tenant = shared, store = self.store)]
    async fn send(self, key: &str, to: String) -> Result<(), Error> {
        let _ = to;
        Ok(())
    }
}

fn main() {}
