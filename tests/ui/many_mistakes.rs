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
