//! The behaviour contract on [`SqliteStore`], a fresh database file per test.
contract_tests!(async {
    let path =
        std::env::temp_dir().join(format!("idempotent-contract-{}.db", uuid::Uuid::new_v4()));
    Some(
        idempotent_runtime::SqliteStore::connect(&format!("sqlite://{}?mode=rwc", path.display()))
            .await
            .expect("open a SQLite file"),
    )
});
