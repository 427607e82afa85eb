//! Layer: several OS processes. Many workers on one identity and workers
//! SIGKILLed holding a lease (`multiprocess`), and the bounded soak with
//! SIGKILLs (`soak`; `.config/nextest.toml` runs it alone), and processes
//! stopped with SIGSTOP and resumed (`pause`).

#[path = "../common/mod.rs"]
mod common;

mod multiprocess;
mod pause;
mod soak;
