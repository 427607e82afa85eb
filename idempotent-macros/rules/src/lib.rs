//! The rules `#[idempotent]` (when the code compiles) and `idempotent-runtime`
//! (at run time, and its `idempotent` command line) share, written once:
//!
//! - [`scope`]: the scope format (DESIGN.md §3): lowercase segments
//!   `[a-z0-9_-]+` joined by single dots, at most [`scope::MAX_SCOPE_BYTES`] bytes;
//! - [`duration`]: how `ttl`, `lease` and `wait(...)` are written, their
//!   minimums and defaults;
//! - [`manifest`]: the scope manifest `idempotent.toml` (declared and retired
//!   scopes, per-scope `ttl` and `lease`) and the one order in which it is
//!   looked for;
//! - [`shared_scope`]: what every claimant of a shared scope must agree on.
//!
//! Every check returns a typed error whose message says what to change. Use it
//! through `idempotent-runtime` (`idempotent_runtime::manifest`); this crate
//! exists so the proc macro can depend on it too.

pub mod duration;
pub mod manifest;
pub mod scope;
pub mod shared_scope;
