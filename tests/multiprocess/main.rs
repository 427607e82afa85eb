//! Layer: several OS processes. Many workers on one identity and workers
//! SIGKILLed holding a lease (`multiprocess`), and the bounded soak with
//! SIGKILLs (`soak`; `.config/nextest.toml` runs it alone).

#[path = "../common/mod.rs"]
mod common;

mod multiprocess;
mod soak;
