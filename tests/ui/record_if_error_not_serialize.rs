// `errors = record_if(...)` records some errors, so E must serialize, as with
// `errors = record` (in type_bounds.rs).
use idempotent_runtime::{idempotent, Error};

#[derive(Debug)]
enum ChargeError {
    Declined,
    Unavailable,
}

impl From<Error> for ChargeError {
    fn from(_: Error) -> Self {
        ChargeError::Unavailable
    }
}

fn is_final(e: &ChargeError) -> bool {
    matches!(e, ChargeError::Declined)
}

#[idempotent(scope = "payments.charge", key = key, tenant = shared, errors = record_if(is_final))]
async fn charge(key: &str) -> Result<u8, ChargeError> {
    Err(ChargeError::Declined)
}

fn main() {}
