//! Tests only: see `tests/ui.rs` (what `#[idempotent]` refuses to compile)
//! and `tests/manifest_defaults.rs` (what it takes from the scope manifest
//! beside this package's `Cargo.toml`). Nothing here is annotated: trybuild
//! builds this library, with the cases' manifests, as a dependency of every
//! case.
