//! The behaviour contract on [`SqliteStore`], a fresh database file per test.
contract_tests!(async {
    Some(
        idempotent_runtime::SqliteStore::connect(&crate::common::scratch::sqlite_url("contract"))
            .await
            .expect("open a SQLite file"),
    )
});
