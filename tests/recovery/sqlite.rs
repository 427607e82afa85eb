//! Rule 20 (`recover = ...`) on [`SqliteStore`](idempotent_runtime::SqliteStore),
//! a fresh database file per test.
recovery_tests!(async {
    Some(
        idempotent_runtime::SqliteStore::connect(&crate::common::scratch::sqlite_url("recovery"))
            .await
            .expect("open a SQLite file"),
    )
});
