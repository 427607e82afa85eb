//! Layer: rule 20, uncertain outcomes (`recover = ...`). The suite
//! (`recovery`) on every store, one module per store, and transactional mode
//! (`transactional`).

#[path = "../common/mod.rs"]
mod common;
#[macro_use]
mod recovery;

mod memory;
mod mysql;
mod postgres;
mod sqlite;

mod transactional;

mod lost_answers;

mod lost_answer_lease;

mod long_bodies;

mod hook_outlives_lease;

// A body dropped or panicking in a scope with a recover hook.
mod dropped_bodies;

// Paused owners resumed after a takeover, attempt chains, pool-starved renewals.
mod takeover_edges;

// A crowd taking over one stuck record; an owner that lost its record, then panicked.
mod concurrent_takeovers;

// A call in a scope with a hook, its runtime shut down mid-body.
mod shutdown;

// Dropped and panicking calls in a storm, in a scope with a hook.
mod storm;

// Owners whose leases lapse under a storm: one answer per key.
mod lapse_storm;

// One process, two databases: an answer unrecorded in one is not another's.
mod two_databases;

// A recover hook's answer that cannot be recorded keeps the record for the next takeover.
mod unrecordable_hook_answers;

// Many transactions at once on one stuck record of a scope with a hook.
mod transactional_crowd;

// A retry made as soon as a body's panic was caught, in a scope with a hook.
mod panic_then_retry_at_once;

// Two claimants of one shared scope, both with a hook, on every store.
mod shared_claimants;

// A hook's answer recorded in a MariaDB transaction.
mod transactional_mysql_recovered;

// A hook panicking in a caller's transaction, on SQLite and MariaDB.
mod transactional_hook_panics;

// A chain of takeovers logged and counted by attempt, on every store.
mod takeovers_counted;

// A hook that takes longer than its lease keeps the record, on every store.
mod patient_hooks;
