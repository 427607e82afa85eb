// A free function with the default store, skip and every optional argument.
use idempotent_runtime::{idempotent, set_default_store, Error, MemoryStore};
use serde::{Deserialize, Serialize};

#[derive(Serialize)]
pub struct ChargeRequest {
    amount: u64,
}

#[derive(Serialize, Deserialize)]
pub struct Receipt {
    id: u64,
}

pub struct Account {
    id: u32,
}

#[idempotent(
    scope = "payments.charge",
    key = key,
    tenant = account.id,
    skip(account, trace),
    ttl = "7d",
    lease = "45s",
    in_progress = wait("2s"),
    errors = release
)]
/// Doc comments and other attributes are kept.
#[allow(clippy::needless_lifetimes)]
pub async fn charge<'a>(
    account: &'a Account,
    key: &str,
    req: &ChargeRequest,
    trace: Option<&'a str>,
) -> Result<Receipt, Error> {
    let _ = trace;
    Ok(Receipt { id: req.amount })
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    set_default_store(MemoryStore::new());
    let account = Account { id: 1 };
    let req = ChargeRequest { amount: 5 };
    let receipt = charge(&account, "k", &req, None).await.unwrap();
    assert_eq!(receipt.id, 5);
}
