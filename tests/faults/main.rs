//! Layer: faults. Connections cut, stalled and killed (`connection_faults`,
//! `postgres_faults`, `mysql_faults`), bad input on the wire
//! (`postgres_wire`, `mysql_wire`), calls dropped mid-flight
//! (`cancellation`), stores used from runtimes other than their own
//! (`runtimes`), and calls polled outside any runtime or on a paused clock
//! (`executors`).

#[path = "../common/mod.rs"]
mod common;

mod cancellation;
mod connection_faults;
mod drop_sweep;
mod executors;
mod first_renewal;
mod held_answers;
mod late_renewal;
mod late_reservation;
mod late_takeover;
mod mysql_faults;
mod mysql_wire;
mod postgres_faults;
mod postgres_session_settings;
mod postgres_wire;
mod release_outage;
mod result_limits;
mod runtime_pools;
mod runtimes;
mod small_pools;
mod stuck_heartbeat;
