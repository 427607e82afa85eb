//! Layer: message consumers on NATS JetStream (`nats_consumer`; `consumer_lifecycle`:
//! deliveries whose handler is dropped or panics, many copies of one message, ids
//! that are not keys, a copy waiting for a running copy, a server killed and restarted
//! mid-handler).

#[path = "../common/mod.rs"]
mod common;

mod consumer_lifecycle;
mod key_in_logs;
mod nats_consumer;
// An independent tester's probes: failing handlers, tenants from a header, long bodies,
// a store outage mid-body.
mod nats_hunt;
mod nested_handle;
mod progress_from_start;
mod stale_deliveries;
mod tx_mismatch;
// A delivery whose worker died mid-body, taken over and answered by the recover hook.
mod recovered_deliveries;
