//! Rule 20 (`recover = ...`) on [`MySqlStore`](idempotent_runtime::MySqlStore),
//! against the server at `IDEMPOTENT_MYSQL_URL` (default: the local MariaDB).
use crate::common;
recovery_tests!(common::servers::mysql_store_or_skip());
