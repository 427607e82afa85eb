//! Layer: what operators run and see. The registry of this binary
//! (`registry`, `registry_shared`), the audit (`audit`), the command line
//! (`cli`), retention (`purge`), metrics and spans (`observability`), and what
//! the engine asks of its store and writes to its logs (`engine_accounting`).
//!
//! The registry is per binary (every `#[idempotent]` here is listed): every
//! scope in this binary is claimed once or shared in agreement, so
//! `registry::validate()` passes. The cross-crate duplicate that must fail it
//! has its own binary (`tests/registry_duplicate.rs`).
//! Process-wide state: `observability` installs the one metrics recorder and
//! `engine_accounting` the one global tracing subscriber of this binary.

#[path = "../common/mod.rs"]
mod common;

mod audit;
mod cli;
mod engine_accounting;
mod hook_races;
mod key_in_logs;
mod live_owners_ops;
mod live_races;
mod observability;
mod ops_hunt;
mod purge;
mod registry;
mod registry_shared;
