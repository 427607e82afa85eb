//! Rule 20 (`recover = ...`) on [`SqliteStore`](idempotent_runtime::SqliteStore),
//! a fresh database file per test.
recovery_tests!(async {
    let path =
        std::env::temp_dir().join(format!("idempotent-recovery-{}.db", uuid::Uuid::new_v4()));
    Some(
        idempotent_runtime::SqliteStore::connect(&format!("sqlite://{}?mode=rwc", path.display()))
            .await
            .expect("open a SQLite file"),
    )
});
