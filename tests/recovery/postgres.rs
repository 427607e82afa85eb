//! Rule 20 (`recover = ...`) on [`PgStore`](idempotent_runtime::PgStore), against
//! the server at `IDEMPOTENT_PG_URL` (default: the local PostgreSQL).
use crate::common;
recovery_tests!(common::servers::pg_store_or_skip());
