//! Layer: the attribute. The behaviour contract through `#[idempotent]`
//! functions (`contract`) on every store, one module per store, and the
//! shapes and arguments the attribute accepts (`macro_shapes`,
//! `macro_rules_args`) and transactional mode (`transactional`; the
//! contract's answers, errors, keys and clock on each SQL store alike:
//! `transactional_answers`), and the
//! public API at its documented limits on every store (`public_api_edges`),
//! and as a service spells it, with results and waits at their edges, on
//! every store (`independent_edges`), and the README's recipes for testing
//! a service on `MemoryStore` under a paused clock (`paused_clock_recipes`).
//!
//! `macro_shapes` sets the process-wide default store, so tests that need
//! none set (`operations::engine_accounting`, `http::http_server`) live in
//! other binaries.

#[path = "../common/mod.rs"]
mod common;
#[macro_use]
mod contract;

mod memory;
mod mysql;
mod postgres;
mod sqlite;

mod consumer_verdicts;
mod expiry_edges;
mod fingerprint_multimap;
mod fingerprint_sweep;
mod generics;
mod heartbeat_pool;
mod independent_edges;
mod legacy_fingerprint;
mod macro_rules_args;
mod macro_shapes;
mod nested_calls;
mod non_finite_in_options;
mod paused_clock_recipes;
mod pg_rollback_isolation;
mod public_api_edges;
mod recorded_error_limits;
mod replay_floats;
mod replay_shapes;
mod send_and_receivers;
mod transactional;
mod transactional_answers;
mod transactional_connections;
mod transactional_nesting;
mod transactional_races;
mod tx_fixtures;
mod tx_longest_durations;
