use idempotent_runtime::idempotent;

// Every mistake is reported in one go, each at its own token.
#[idempotent(
    scope = "Payments..charge",
    kye = key,
    skip(amout),
    ttl = "0s",
    lease = "soon",
    errors = sometimes,
    scope = "payments.charge"
)]
fn charge(key: &str, amount: u64) -> u64 {
    amount
}

fn main() {}

#[idempotent(scope = "payments.refund", key = key, tenant = shared)]
async fn refund(key: &str) -> Result<u8, idempotent_runtime::Error> {
    Ok(1)
}

// A second claimant of one scope, with mistakes of its own: the duplicate is
// reported together with them, in one round.
#[idempotent(
    scope = "payments.refund",
    key = key,
    tenant = shared,
    lease = "5ms",
    skip(nope)
)]
async fn refund_again(key: &str) -> Result<u8, idempotent_runtime::Error> {
    Ok(2)
}
