//! The store conformance suite against [`PgStore`](idempotent_runtime::PgStore) on
//! the server at `IDEMPOTENT_PG_URL` (default: the local PostgreSQL).
use crate::common;
store_conformance_tests!(common::servers::pg_store_or_skip());
