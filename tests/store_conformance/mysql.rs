//! The store conformance suite against [`MySqlStore`](idempotent_runtime::MySqlStore)
//! on the server at `IDEMPOTENT_MYSQL_URL` (default: the local MariaDB).
use crate::common;
store_conformance_tests!(common::servers::mysql_store_or_skip());
