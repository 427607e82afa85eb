// A return type the attribute cannot tell from a `Result` alias by its name
// is checked by the compiler: an alias of something else is refused, with a
// message that says what the function must return.
use idempotent_runtime::idempotent;

type Answer = Option<u8>;

#[idempotent(scope = "payments.answer", key = key, tenant = shared)]
async fn returns_an_alias_of_option(key: &str) -> Answer {
    Some(1)
}

fn main() {}
