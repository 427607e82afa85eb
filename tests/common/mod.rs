//! Shared helpers for the integration tests.
#![allow(dead_code)]

pub mod counting;
pub mod hooked;
pub mod ledger;
pub mod logs;
pub mod proxy;
pub mod readings;
pub mod records;
pub mod scratch;
pub mod servers;
pub mod wire;
