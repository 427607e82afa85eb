//! `examples/http_payments.rs` as a binary target, so that tests can start it
//! as a separate OS process (`CARGO_BIN_EXE_idempotent-http-payments`), kill
//! it and start it again (tests/http/http_crash.rs). The code is the example's own.

#[path = "../../examples/http_payments.rs"]
mod example;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    example::main()
}
