//! Layer: the store. The store conformance suite (`conformance`, DESIGN.md §4
//! at the `Store` trait) run against every store, one module per store, so
//! test names read `store_conformance::postgres::reserve_is_atomic_under_concurrency`.

#[path = "../common/mod.rs"]
mod common;
#[macro_use]
mod conformance;

mod memory;
mod mysql;
mod postgres;
mod sqlite;
