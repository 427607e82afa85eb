use idempotent_runtime::{idempotent, Error};

// A value argument written like `skip(...)`, in parentheses, instead of with
// `=`: refused at the argument's name, with how it is written.
#[idempotent(scope = "payments.ttl", key = key, tenant = shared, ttl("24h"))]
async fn ttl_in_parentheses(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "payments.errors", key = key, tenant = shared, errors(record))]
async fn errors_in_parentheses(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
