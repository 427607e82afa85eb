//! What the two server stores, PostgreSQL and MySQL/MariaDB, share: opening
//! their pool on a URL, and the background worker that finishes dropped
//! calls' records on a small pool of its own.

use super::detached::{Detached, Work};
use crate::error::StoreError;
use crate::identity::Identity;
use crate::store::{Fenced, OwnerToken, StoredOutcome};
use futures_util::future::BoxFuture;
use sqlx::pool::PoolOptions;
use sqlx::{Database, Pool};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// How long `connect` and every statement wait for a pooled connection.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// The connect options of a database's connections (`PgConnectOptions`, ...).
type ConnectOptions<DB> = <<DB as Database>::Connection as sqlx::Connection>::Options;

/// Connects a pool of 16 connections to the server `url` names, waiting at
/// most [`ACQUIRE_TIMEOUT`]. A bad URL, or a server that does not answer in
/// time, is a `StoreError` of `store` naming the `server` and its
/// `address(options)` (host and port), never a hang.
pub(crate) async fn connect<DB: Database>(
    store: &'static str,
    server: &str,
    url: &str,
    address: impl FnOnce(&ConnectOptions<DB>) -> String,
) -> Result<Pool<DB>, StoreError> {
    let options = ConnectOptions::<DB>::from_str(url)
        .map_err(|e| StoreError::new(store, "connect", format!("bad database URL: {e}")))?;
    let address = address(&options);
    PoolOptions::<DB>::new()
        .max_connections(16)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| {
            StoreError::new(
                store,
                "connect",
                format!(
                    "could not connect to the {server} server at {address} \
                     within {ACQUIRE_TIMEOUT:?}: {e}"
                ),
            )
        })
}

/// One of a store's fenced writes, run on the worker's pool for a dropped
/// call: `Ok(Fenced::Written)` when done, `Ok(Fenced::NotOwner)` when the token owns nothing.
type Written = BoxFuture<'static, Result<Fenced, StoreError>>;

/// The worker that finishes dropped calls' records: its own small pool (two
/// connections) on its own runtime, with the store pool's connection
/// options. `release` frees a dropped call's record; `end_lease` ends its
/// lease and keeps it (a call in a scope with a recover hook, dropped while
/// its reservation was in flight); `complete` records the
/// outcome of one dropped while its result was being recorded (marked
/// recovered when a recover hook gave it).
pub(crate) fn background_worker<DB: Database>(
    store: &'static str,
    pool: &Pool<DB>,
    release: fn(Pool<DB>, Identity, OwnerToken) -> Written,
    end_lease: fn(Pool<DB>, Identity, OwnerToken) -> Written,
    complete: fn(Pool<DB>, Identity, OwnerToken, StoredOutcome, Duration, bool) -> Written,
) -> Detached {
    let options = pool.connect_options();
    Detached::new(
        store,
        Box::new(move || {
            let pool = PoolOptions::<DB>::new()
                .max_connections(2)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .connect_lazy_with((*options).clone());
            Arc::new(move |identity, token, work| match work {
                Work::Release => release(pool.clone(), identity, token),
                Work::EndLease => end_lease(pool.clone(), identity, token),
                Work::Complete(outcome, ttl, recovered) => {
                    complete(pool.clone(), identity, token, outcome, ttl, recovered)
                }
            })
        }),
    )
}
