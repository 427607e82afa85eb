// `errors = record_if(path)`: the predicate is a `fn(&E) -> bool` for the
// function's own E. One that takes another type, returns something else or
// does not exist is refused.
use idempotent_runtime::{idempotent, Error};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
enum ChargeError {
    Declined,
    Unavailable,
}

impl From<Error> for ChargeError {
    fn from(_: Error) -> Self {
        ChargeError::Unavailable
    }
}

fn is_final_io(_: &std::io::Error) -> bool {
    true
}

fn is_final_text(e: &ChargeError) -> &'static str {
    match e {
        ChargeError::Declined => "yes",
        ChargeError::Unavailable => "no",
    }
}

#[idempotent(scope = "payments.charge", key = key, tenant = shared, errors = record_if(is_final_io))]
async fn charge(key: &str) -> Result<u8, ChargeError> {
    Err(ChargeError::Declined)
}

#[idempotent(scope = "payments.refund", key = key, tenant = shared, errors = record_if(is_final_text))]
async fn refund(key: &str) -> Result<u8, ChargeError> {
    Err(ChargeError::Declined)
}

#[idempotent(scope = "payments.void", key = key, tenant = shared, errors = record_if(no_such_predicate))]
async fn void(key: &str) -> Result<u8, ChargeError> {
    Err(ChargeError::Declined)
}

fn main() {}
