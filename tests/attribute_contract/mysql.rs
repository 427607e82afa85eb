//! The behaviour contract on [`MySqlStore`](idempotent_runtime::MySqlStore), against the
//! server at `IDEMPOTENT_MYSQL_URL` (default: the local MariaDB).
use crate::common;
contract_tests!(common::servers::mysql_store_or_skip());
