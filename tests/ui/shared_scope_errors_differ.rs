// Rule 21 (and 13): claimants of a shared scope either all may record errors
// (`errors = record` or `record_if`) or all release them: otherwise a retry
// through the releasing one of an event whose error the other recorded could
// neither replay it nor run.
use idempotent_runtime::{idempotent, Error};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
enum RefundError {
    Declined,
    Unavailable,
}

impl From<Error> for RefundError {
    fn from(_: Error) -> Self {
        RefundError::Unavailable
    }
}

#[idempotent(scope = "refunds.errors", key = order, tenant = shop, shared_scope, errors = record)]
async fn refund_http(shop: &str, order: &str) -> Result<u8, RefundError> {
    Err(RefundError::Declined)
}

#[idempotent(scope = "refunds.errors", key = order, tenant = shop, shared_scope)]
async fn refund_queue(shop: &str, order: &str) -> Result<u8, RefundError> {
    Ok(2)
}

fn main() {}
