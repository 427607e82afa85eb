//! Layer: message consumers on NATS JetStream (`nats_consumer`).

#[path = "../common/mod.rs"]
mod common;

mod nats_consumer;
