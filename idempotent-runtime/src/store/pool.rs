//! How the SQL stores set up the connection pools they open themselves.
//!
//! sqlx's pool pings a connection when it is handed out (`test_before_acquire`,
//! on by default) and again when it comes back. The ping on the way out is a
//! whole round trip on the caller's path, in front of every statement: a
//! replay would cost two round trips instead of one, a fresh key four instead
//! of two. The ping on the way back stays (it runs after the caller has its
//! answer, and it is what finds a connection broken by a cut or a cancelled
//! statement before anyone else gets it). So the stores' pools ping on the way
//! out only a connection that sat idle for [`PING_AFTER_IDLE`] or longer (the
//! server may have closed it meanwhile), the way HikariCP skips its check for
//! a connection used within the last half second.
//!
//! A pool the application hands over (`from_pool`) keeps the application's
//! own settings.

use sqlx::pool::PoolOptions;
use sqlx::{Connection, Database};
use std::time::Duration;

/// A connection idle for this long is pinged before a statement uses it.
pub(crate) const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Pool options with the hand-out ping limited to connections idle for
/// [`PING_AFTER_IDLE`] or longer; the caller adds its sizes and timeouts.
pub(crate) fn options<DB: Database>() -> PoolOptions<DB> {
    PoolOptions::<DB>::new()
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_AFTER_IDLE {
                    // An error closes this connection; the pool hands out another.
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
}
