//! Layer: the SQL stores at their edges. MariaDB's locking (`mysql_edges`),
//! PostgreSQL reservations meeting a short-lived row lock (`postgres_edges`),
//! SQLite's opening, locking and pools (`sqlite_edges`, `sqlite_store`), and
//! transactional mode given a connection outside a transaction
//! (`transactional_edges`), and what a transactional body does to its
//! session that outlives the call (`transactional_hostile`), a transaction
//! that goes on calling after a refusal beside a live store-mode owner
//! (`transactional_retries`), and what code sharing a store's pool leaves on
//! its connections (`pool_session_state`).
//!
//! `sqlite_edges` installs the one global tracing subscriber of this binary
//! and re-runs this binary as child processes
//! (`sqlite_edges::child_process_opens_the_shared_file`).

#[path = "../common/mod.rs"]
mod common;

mod mysql_edges;
mod operator_release;
mod pool_exhausted;
mod pool_session_state;
mod postgres_edges;
mod sqlite_edges;
mod sqlite_sharing;
mod sqlite_store;
mod transactional_edges;
mod transactional_hostile;
mod transactional_retries;
