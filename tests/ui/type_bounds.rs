// The types the attribute needs, each refused by the compiler with a message
// that points at the user's code: a key and a tenant the identity can be
// built from (`Display`), a success value that can be recorded and replayed
// (`Serialize + DeserializeOwned`), an error type a refusal converts into
// (`From<idempotent_runtime::Error>`), a recorded error that can be stored
// (`errors = record` needs `E: Serialize + DeserializeOwned`), and a `store`
// and a `tx` of the right kind.
use idempotent_runtime::{idempotent, Error};

pub struct NoDisplay;

#[idempotent(scope = "bounds.key", key = key, tenant = shared)]
async fn key_not_display(key: NoDisplay) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "bounds.tenant", key = key, tenant = tenant)]
async fn tenant_not_display(tenant: NoDisplay, key: &str) -> Result<u8, Error> {
    Ok(1)
}

pub struct Unrecordable;

#[idempotent(scope = "bounds.value", key = key, tenant = shared)]
async fn value_not_serialize(key: &str) -> Result<Unrecordable, Error> {
    Ok(Unrecordable)
}

#[derive(Debug)]
pub struct OwnError;

#[idempotent(scope = "bounds.error", key = key, tenant = shared)]
async fn error_without_from(key: &str) -> Result<u8, OwnError> {
    Ok(1)
}

#[derive(Debug)]
pub struct PlainError;

impl From<Error> for PlainError {
    fn from(_: Error) -> Self {
        PlainError
    }
}

#[idempotent(scope = "bounds.recorded", key = key, tenant = shared, errors = record)]
async fn recorded_error_not_serialize(key: &str) -> Result<u8, PlainError> {
    Ok(1)
}

#[idempotent(scope = "bounds.store", key = key, tenant = shared, store = store)]
async fn store_not_a_store(store: &str, key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "bounds.tx", key = key, tenant = shared, tx = tx)]
async fn tx_not_a_connection(tx: &mut u8, key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
