//! Layer: waiting duplicates (rule 4). A duplicate that finds the record in
//! progress is woken by the change it waits for, not by polling: in-process
//! notification for the memory, SQLite and MySQL/MariaDB stores
//! (`in_process`), and PostgreSQL's `LISTEN/NOTIFY` (`postgres`). Each test
//! counts the store round trips made during the wait;
//! `every_store` runs the scenarios every store must answer alike.

#[path = "../common/mod.rs"]
mod common;

mod every_store;
mod in_process;
mod postgres;
mod postgres_listener;
