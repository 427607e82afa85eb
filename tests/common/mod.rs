//! Shared helpers for the integration tests.
#![allow(dead_code)]

pub mod counting;
pub mod hooked;
pub mod proxy;
pub mod records;
pub mod scratch;
pub mod servers;
pub mod wire;
