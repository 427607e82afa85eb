//! One process, two databases of one kind (two regions, a migration from an
//! old database to a new one), the same function, tenant and key in both.
//! An answer this process could not record in one database is not the
//! answer of the other database's record: a takeover there asks its own
//! `recover` hook (rule 20) and, told to, runs the body, instead of
//! recording the first database's answer without either.
//!
//! Nor is an owner at work in one database the other's: it does not refuse a
//! transaction's call of the same identity in another. Stores and
//! transactional connections on one database name it alike
//! (`Store::database_id`), and no other.
//!
//! On PostgreSQL and MySQL/MariaDB (the test database and a fresh one,
//! dropped at the end; PostgreSQL schemas) and on SQLite files.

use crate::common;

use common::servers::fresh_tenant;
use idempotent_runtime::{
    idempotent, with_outcome, Completion, Error, Fenced, ForcedRelease, Identity, Outcome,
    OwnerToken, PgStore, RecordSnapshot, RecordState, Recovery, Reservation, ReserveRequest,
    ScopeStats, SqliteStore, Store, StoreError, Takeover,
};
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

const SCOPE: &str = "recovery.two_databases.invoice";

/// The attempts the hook was asked about, and the bodies run.
type Seen = (Vec<u32>, u32);

/// Per tenant.
static SEEN: LazyLock<Mutex<HashMap<String, Seen>>> = LazyLock::new(Default::default);

fn seen(tenant: &str) -> Seen {
    SEEN.lock()
        .unwrap()
        .get(tenant)
        .cloned()
        .unwrap_or_default()
}

/// Nothing was invoiced by the attempt taken over: run the body.
async fn nothing_invoiced(t: &Takeover) -> Result<Recovery<u64>, Error> {
    SEEN.lock()
        .unwrap()
        .entry(t.tenant().to_owned())
        .or_default()
        .0
        .push(t.attempt());
    Ok(Recovery::Run)
}

#[idempotent(scope = "recovery.two_databases.invoice", key = key, tenant = tenant, store = store,
             shared_scope, lease = "1s", recover = nothing_invoiced)]
async fn invoice(store: &dyn Store, tenant: &str, key: &str, amount: u64) -> Result<u64, Error> {
    SEEN.lock().unwrap().entry(tenant.to_owned()).or_default().1 += 1;
    Ok(amount)
}

/// [`invoice`] in the caller's transaction (the same request: the same
/// scope, key and arguments).
#[idempotent(scope = "recovery.two_databases.invoice", key = key, tenant = tenant, tx = tx,
             shared_scope, lease = "1s", recover = nothing_invoiced)]
async fn invoice_in(
    tx: &mut sqlx::PgConnection,
    tenant: &str,
    key: &str,
    amount: u64,
) -> Result<u64, Error> {
    SEEN.lock().unwrap().entry(tenant.to_owned()).or_default().1 += 1;
    Ok(amount)
}

/// A store whose answers cannot be written: `complete` fails and
/// the store's background writes are lost (the database unreachable for
/// this process's writes until the test ends).
struct UnwritableAnswers<'s>(&'s dyn Store);

#[async_trait::async_trait]
impl Store for UnwritableAnswers<'_> {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn max_result_bytes(&self) -> usize {
        self.0.max_result_bytes()
    }
    fn database_id(&self) -> Option<&str> {
        self.0.database_id()
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.0.reserve(r).await
    }
    async fn complete(&self, _: Completion<'_>) -> Result<Fenced, StoreError> {
        Err(StoreError::new(
            self.0.name(),
            "complete",
            "connection reset",
        ))
    }
    async fn release(&self, i: &Identity, t: &OwnerToken) -> Result<Fenced, StoreError> {
        self.0.release(i, t).await
    }
    async fn heartbeat(
        &self,
        i: &Identity,
        t: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        self.0.heartbeat(i, t, lease).await
    }
    fn release_detached(&self, i: Identity, t: OwnerToken) {
        self.0.release_detached(i, t)
    }
    fn complete_detached(&self, _: Completion<'_>) {}
    fn end_lease_detached(&self, i: Identity, t: OwnerToken) {
        self.0.end_lease_detached(i, t)
    }
    async fn force_release(&self, i: &Identity, r: bool) -> Result<ForcedRelease, StoreError> {
        self.0.force_release(i, r).await
    }
    async fn wait_for_change(&self, i: &Identity, max_wait: Duration, round: u32) {
        self.0.wait_for_change(i, max_wait, round).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.0.purge_expired(batch).await
    }
    async fn fetch(&self, i: &Identity) -> Result<Option<RecordSnapshot>, StoreError> {
        self.0.fetch(i).await
    }
    async fn scope_stats(&self) -> Result<Vec<ScopeStats>, StoreError> {
        self.0.scope_stats().await
    }
}

/// Waits (bounded) until the record's lease has run out, on the database's clock.
async fn lease_ran_out(store: &dyn Store, identity: &Identity) {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match store.fetch(identity).await.expect("fetch") {
                Some(r) if r.lease_expires_at_ms.is_some_and(|ends| ends < r.now_ms) => break,
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await
    .expect("the lease runs out");
}

/// The answer held for the first database is not recorded by the second
/// database's takeover (which would replay it without asking its hook or
/// running its body there): the held answer is matched by the store's
/// database (`Store::database_id`), not only by its kind.
async fn unrecorded_in_one_answers_the_other(first: &dyn Store, second: &dyn Store) {
    let first = UnwritableAnswers(first);
    let tenant = fresh_tenant();
    let identity = Identity::new(tenant.as_str(), SCOPE, "inv-1").unwrap();

    // The first database: the body ran, its answer could not be written
    // (this process holds it, for a takeover of that record).
    let got = invoice(&first, &tenant, "inv-1", 100).await;
    assert!(matches!(got, Err(Error::Store(_))), "{got:?}");
    assert_eq!(seen(&tenant), (vec![], 1));

    // The second database: the same identity's record, left in progress
    // by an attempt (of another process) that died before it invoiced.
    common::records::acquire(
        second,
        &identity,
        None,
        Duration::from_millis(1),
        Duration::from_secs(3600),
    )
    .await;
    lease_ran_out(second, &identity).await;

    let (got, outcome) = with_outcome(invoice(second, &tenant, "inv-1", 100)).await;
    assert_eq!(got.expect("answered"), 100);
    assert_eq!(
        (outcome, seen(&tenant)),
        (Some(Outcome::Executed), (vec![2], 2)),
        "the second database's takeover asks its hook and runs the body, \
         not record the first database's answer"
    );
    let r = second.fetch(&identity).await.unwrap().expect("record");
    assert_eq!(
        (r.state, r.attempt, r.recovered),
        (RecordState::Complete, 2, false)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_answer_unrecorded_in_one_database_does_not_answer_a_takeover_in_another() {
    let Some(first) = common::servers::pg_store_or_skip().await else {
        return;
    };
    common::servers::pg_with_fresh_database("two_databases", |url| async move {
        let second = PgStore::connect(&url).await.expect("the new database");
        unrecorded_in_one_answers_the_other(&first, &second).await;
    })
    .await;
}

/// The same with one SQLite file per customer (`tenant = shared` in each
/// file would collide the same way; here one tenant in two files).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_answer_unrecorded_in_one_file_does_not_answer_a_takeover_in_another() {
    let first = SqliteStore::connect(&common::scratch::sqlite_url("h-cons-first"))
        .await
        .expect("first file");
    let second = SqliteStore::connect(&common::scratch::sqlite_url("h-cons-second"))
        .await
        .expect("second file");
    unrecorded_in_one_answers_the_other(&first, &second).await;
}

/// The same on one database, for two tenants with one key: tenant A's
/// answer, unrecorded, is A's alone. Tenant B's takeover asks its hook (with
/// B's tenant) and runs the body; A's takeover records A's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_unrecorded_for_one_tenant_does_not_answer_another_tenants_takeover() {
    let store = SqliteStore::connect(&common::scratch::sqlite_url("h-cons-tenants"))
        .await
        .expect("file");
    let (a, b) = (fresh_tenant(), fresh_tenant());
    let got = invoice(&UnwritableAnswers(&store), &a, "inv-1", 100).await;
    assert!(matches!(got, Err(Error::Store(_))), "{got:?}");
    let b_id = Identity::new(b.as_str(), SCOPE, "inv-1").unwrap();
    common::records::acquire(
        &store,
        &b_id,
        None,
        Duration::from_millis(1),
        Duration::from_secs(3600),
    )
    .await;
    lease_ran_out(&store, &b_id).await;
    let (got, outcome) = with_outcome(invoice(&store, &b, "inv-1", 100)).await;
    assert_eq!(got.expect("answered"), 100);
    assert_eq!((outcome, seen(&b)), (Some(Outcome::Executed), (vec![2], 1)));

    let a_id = Identity::new(a.as_str(), SCOPE, "inv-1").unwrap();
    lease_ran_out(&store, &a_id).await;
    let (got, outcome) = with_outcome(invoice(&store, &a, "inv-1", 100)).await;
    assert_eq!(got.expect("answered"), 100);
    assert_eq!(
        (outcome, seen(&a)),
        (Some(Outcome::Replayed), (vec![], 1)),
        "A's own answer, recorded by A's takeover: no hook, no second body"
    );
}

/// The same in transactional mode: a takeover in a transaction on the
/// second database runs the body (its hook asked); one on the first
/// database records the answer held for it, so the connection names its
/// database as the store does.
async fn unrecorded_in_one_answers_a_transaction_in_the_other(first: &PgStore, second: &PgStore) {
    let tenant = fresh_tenant();
    let identity = Identity::new(tenant.as_str(), SCOPE, "inv-1").unwrap();
    let got = invoice(&UnwritableAnswers(first), &tenant, "inv-1", 100).await;
    assert!(matches!(got, Err(Error::Store(_))), "{got:?}");
    assert_eq!(seen(&tenant), (vec![], 1));

    common::records::acquire(
        second,
        &identity,
        None,
        Duration::from_millis(1),
        Duration::from_secs(3600),
    )
    .await;
    lease_ran_out(second, &identity).await;
    let mut tx = second.pool().begin().await.expect("begin");
    let (got, outcome) = with_outcome(invoice_in(&mut tx, &tenant, "inv-1", 100)).await;
    tx.commit().await.expect("commit");
    assert_eq!(got.expect("answered"), 100);
    assert_eq!(
        (outcome, seen(&tenant)),
        (Some(Outcome::Executed), (vec![2], 2)),
        "the second database's takeover in a transaction asks its hook and runs the body"
    );

    lease_ran_out(first, &identity).await;
    let mut tx = first.pool().begin().await.expect("begin");
    let (got, outcome) = with_outcome(invoice_in(&mut tx, &tenant, "inv-1", 100)).await;
    tx.commit().await.expect("commit");
    assert_eq!(got.expect("answered"), 100);
    assert_eq!(
        (outcome, seen(&tenant)),
        (Some(Outcome::Replayed), (vec![2], 2)),
        "the first database's takeover in a transaction records the answer held for it"
    );
    let r = first.fetch(&identity).await.unwrap().expect("record");
    assert_eq!((r.state, r.recovered), (RecordState::Complete, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_answer_unrecorded_in_one_database_answers_only_its_own_transactions() {
    let Some(first) = common::servers::pg_store_or_skip().await else {
        return;
    };
    common::servers::pg_with_fresh_database("two_databases", |url| async move {
        let second = PgStore::connect(&url).await.expect("the new database");
        unrecorded_in_one_answers_a_transaction_in_the_other(&first, &second).await;
    })
    .await;
}

/// The same with two MySQL/MariaDB databases on one server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_an_answer_unrecorded_in_one_database_does_not_answer_a_takeover_in_another() {
    let Some(admin) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let db = common::servers::mysql_create_database(&admin, "two_databases").await;
    let url = common::servers::mysql_url_of(&common::servers::mysql_url(), &db);
    let checked = tokio::spawn(async move {
        let first = idempotent_runtime::MySqlStore::connect(&common::servers::mysql_url())
            .await
            .expect("the test database");
        let second = idempotent_runtime::MySqlStore::connect(&url)
            .await
            .expect("the new database");
        unrecorded_in_one_answers_the_other(&first, &second).await;
        second.pool().close().await;
    })
    .await;
    common::servers::mysql_drop_then_check(&admin, &[&db], checked).await;
}

/// The same on PostgreSQL: a database restored from another's dump under
/// another name carries the other's id, and is named apart by its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_copy_of_a_database_under_another_name_is_another_database() {
    let Some(pg) = common::servers::pg_store_or_skip().await else {
        return;
    };
    let original = pg
        .database_id()
        .expect("postgres names its database")
        .to_owned();
    common::servers::pg_with_fresh_database("two_databases", |url| async move {
        let id = original.split('/').next().expect("an id").to_owned();
        let made = PgStore::connect(&url).await.expect("the new database");
        sqlx::query("UPDATE idempotency_database SET id = $1")
            .bind(&id)
            .execute(made.pool())
            .await
            .expect("copy the id");
        made.pool().close().await;
        let copy = PgStore::connect(&url).await.expect("the copy");
        let named = copy.database_id().map(str::to_owned);
        copy.pool().close().await;
        assert!(
            named
                .as_deref()
                .is_some_and(|c| c.starts_with(&id) && c != original),
            "the copy {named:?} carries the id and is named apart from {original:?}"
        );
    })
    .await;
}

/// A MySQL/MariaDB database restored from another's backup under another
/// name carries the other's id (it is data): the database's name still
/// tells the two apart, or an answer held for one would be recorded by a
/// takeover in the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_copy_of_a_database_under_another_name_is_another_database() {
    let Some(admin) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let id = admin
        .database_id()
        .and_then(|d| d.split('/').next())
        .expect("mysql names its database")
        .to_owned();
    let db = common::servers::mysql_create_database(&admin, "two_databases").await;
    let url = common::servers::mysql_url_of(&common::servers::mysql_url(), &db);
    let copy = async {
        let made = idempotent_runtime::MySqlStore::connect(&url).await?;
        sqlx::query("UPDATE idempotency_database SET id = ?")
            .bind(&id)
            .execute(made.pool())
            .await?;
        made.pool().close().await;
        let copy = idempotent_runtime::MySqlStore::connect(&url).await?;
        let named = copy.database_id().map(str::to_owned);
        copy.pool().close().await;
        Ok::<_, Box<dyn std::error::Error>>(named)
    }
    .await;
    common::servers::mysql_drop_then_check(&admin, &[&db], Ok(())).await;
    let copy = copy.expect("the copy");
    assert!(
        copy.as_deref()
            .is_some_and(|c| c.starts_with(&id) && Some(c) != admin.database_id()),
        "the copy {copy:?} carries the id and is named apart from {:?}",
        admin.database_id()
    );
}

/// What names a database (`Store::database_id`) is the same for every store
/// and every transactional connection on it, and differs between
/// databases: on PostgreSQL, MySQL/MariaDB and SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_and_connections_on_one_database_name_it_alike_and_no_other() {
    use idempotent_runtime::TransactionalConnection;
    // PostgreSQL: the test database twice, a fresh one.
    let (Some(pg), Some(pg_again)) = (
        common::servers::pg_store_or_skip().await,
        common::servers::pg_store_or_skip().await,
    ) else {
        return;
    };
    common::servers::pg_with_fresh_database("two_databases", |url| async move {
        let pg_other = PgStore::connect(&url).await.expect("the new database");
        let mut conn = pg.pool().acquire().await.expect("connection");
        let on_connection = conn.database_id_in_transaction().await.expect("read");
        drop(conn);
        assert!(pg.database_id().is_some(), "postgres names its database");
        let id = pg.database_id();
        assert_eq!(
            id,
            pg_again.database_id(),
            "postgres: two stores on one database"
        );
        assert_eq!(
            id,
            on_connection.as_deref(),
            "postgres: a connection names it alike"
        );
        assert_ne!(id, pg_other.database_id(), "postgres: another database");
    })
    .await;

    // MySQL/MariaDB: the test database twice, a fresh one.
    let (Some(my), Some(my_again)) = (
        common::servers::mysql_store_or_skip().await,
        common::servers::mysql_store_or_skip().await,
    ) else {
        return;
    };
    let db = common::servers::mysql_create_database(&my, "two_databases").await;
    let url = common::servers::mysql_url_of(&common::servers::mysql_url(), &db);
    let my_other = idempotent_runtime::MySqlStore::connect(&url).await;
    let mut conn = my.pool().acquire().await.expect("connection");
    let on_connection = conn.database_id_in_transaction().await.expect("read");
    drop(conn);
    let other_id = my_other
        .as_ref()
        .ok()
        .and_then(|s| s.database_id().map(str::to_owned));
    if let Ok(other) = &my_other {
        other.pool().close().await;
    }
    common::servers::mysql_drop_then_check(&my, &[&db], Ok(())).await;
    my_other.expect("the new database");
    assert!(my.database_id().is_some(), "mysql names its database");
    assert_eq!(
        my.database_id(),
        my_again.database_id(),
        "mysql: two stores on one database"
    );
    assert_eq!(
        my.database_id(),
        on_connection.as_deref(),
        "mysql: a connection names it alike"
    );
    assert_ne!(
        my.database_id(),
        other_id.as_deref(),
        "mysql: another database"
    );

    // SQLite: one file twice, another file, two databases in memory.
    let url = common::scratch::sqlite_url("ids-first");
    let file = SqliteStore::connect(&url).await.expect("file");
    let file_again = SqliteStore::connect(&url).await.expect("file again");
    let other_file = SqliteStore::connect(&common::scratch::sqlite_url("ids-second"))
        .await
        .expect("other file");
    let memory = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("memory");
    let other_memory = SqliteStore::connect("sqlite::memory:")
        .await
        .expect("memory");
    let mut conn = file.pool().acquire().await.expect("connection");
    let on_connection = conn.database_id_in_transaction().await.expect("read");
    drop(conn);
    assert!(file.database_id().is_some(), "sqlite names its database");
    assert_eq!(
        file.database_id(),
        file_again.database_id(),
        "sqlite: one file twice"
    );
    assert_eq!(
        file.database_id(),
        on_connection.as_deref(),
        "sqlite: a connection names it alike"
    );
    assert_ne!(
        file.database_id(),
        other_file.database_id(),
        "sqlite: another file"
    );
    assert!(memory.database_id().is_some());
    assert_ne!(
        memory.database_id(),
        other_memory.database_id(),
        "sqlite: two in memory"
    );
}

/// PostgreSQL's store reads its database's id in the schema it found its
/// records in (the name quoted into the statement, its text bound), and a
/// transactional connection through its `search_path` (the schema's name as
/// the catalog holds it): for a schema whose name must be quoted (capitals,
/// a space, a quote) both name the one database alike, or a takeover in a
/// transaction would not record the answer the store holds for it, and would
/// take over a record whose owner the transaction keeps from renewing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_schema_whose_name_is_quoted_is_named_alike_by_its_store_and_its_connections() {
    use idempotent_runtime::TransactionalConnection;
    let Some(_reachable) = common::servers::pg_store_or_skip().await else {
        return;
    };
    common::servers::pg_with_fresh_database("two_databases", |url| async move {
        let public = PgStore::connect(&url).await.expect("the new database");
        const SCHEMA: &str = r#""Region ""B"" Records""#;
        sqlx::query(&format!("CREATE SCHEMA {SCHEMA}"))
            .execute(public.pool())
            .await
            .expect("schema");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(conn, format!("SET search_path = {SCHEMA}").as_str())
                        .await
                        .map(drop)
                })
            })
            .connect(&url)
            .await
            .expect("pool");
        let store = PgStore::from_pool(pool.clone())
            .await
            .expect("the quoted schema's store");
        let in_schema: String = sqlx::query_scalar(
            "SELECT n.nspname::TEXT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE c.relname = 'idempotency_database' AND n.nspname <> 'public'",
        )
        .fetch_one(public.pool())
        .await
        .expect("the table, in the quoted schema");
        assert_eq!(in_schema, r#"Region "B" Records"#);
        let mut tx = pool.begin().await.expect("begin");
        let on_connection = tx.database_id_in_transaction().await.expect("read");
        tx.rollback().await.expect("rollback");
        assert!(
            store.database_id().is_some(),
            "the store names its database"
        );
        assert_eq!(
            store.database_id(),
            on_connection.as_deref(),
            "the store and a transaction on the quoted schema name it alike"
        );
        assert_ne!(
            store.database_id(),
            public.database_id(),
            "another schema of the database is another place for the records"
        );
        pool.close().await;
        public.pool().close().await;
    })
    .await;
}

/// SQLite: an application whose connections open a file of its own and
/// attach the records' file (`ATTACH ... AS idem`) reaches the records
/// unqualified, so its transactions use the store's records: they name
/// that file's database as a store opened on the file does, not the
/// application's own file. Otherwise a takeover in such a transaction would
/// not record the answer the store holds for the key, and would take over a
/// record whose owner in this process the transaction keeps from writing.
#[tokio::test]
async fn sqlite_a_connection_that_attaches_the_records_file_names_it_as_its_store_does() {
    use idempotent_runtime::TransactionalConnection;
    use sqlx::Connection;
    let records = common::scratch::sqlite_path("ids-attached-records");
    let store = SqliteStore::connect(&format!("sqlite://{}?mode=rwc", records.display()))
        .await
        .expect("the records' file");
    let mut app = sqlx::SqliteConnection::connect(&common::scratch::sqlite_url("ids-attached-app"))
        .await
        .expect("the application's file");
    sqlx::query("ATTACH DATABASE ? AS idem")
        .bind(records.display().to_string())
        .execute(&mut app)
        .await
        .expect("attach the records' file");
    let mut tx = app.begin().await.expect("begin");
    let on_connection = tx.database_id_in_transaction().await.expect("read");
    tx.rollback().await.expect("rollback");
    assert!(
        store.database_id().is_some(),
        "the store names its database"
    );
    assert_eq!(
        store.database_id(),
        on_connection.as_deref(),
        "a connection that reaches the records through ATTACH names their file"
    );
}

/// On PostgreSQL a statement that fails aborts the caller's transaction: a
/// role that may not read `idempotency_database` is told so without one,
/// and its transaction goes on (the takeover then asks its hook or runs the
/// body, as another process's would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_role_that_may_not_read_the_database_id_keeps_its_transaction() {
    use idempotent_runtime::TransactionalConnection;
    const ROLE: &str = "idempotent_records_only";
    let Some(store) = common::servers::pg_store_or_skip().await else {
        return;
    };
    // Roles are the cluster's: made once, granted again each run.
    let _ = sqlx::query(&format!("CREATE ROLE {ROLE} LOGIN"))
        .execute(store.pool())
        .await;
    sqlx::query(&format!("GRANT SELECT ON idempotency_records TO {ROLE}"))
        .execute(store.pool())
        .await
        .expect("grant");
    let mut tx = store.pool().begin().await.expect("begin");
    sqlx::query(&format!("SET LOCAL ROLE {ROLE}"))
        .execute(&mut *tx)
        .await
        .expect("set role");
    let read = tx.database_id_in_transaction().await;
    assert!(read.is_err(), "{read:?}");
    let still: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *tx)
        .await
        .expect("the transaction goes on");
    assert_eq!(still, 1);
    tx.rollback().await.expect("rollback");
}

// ---- an owner at work in one database, a transaction in another -----------

const LIVE_SCOPE: &str = "recovery.two_databases.live";

/// Where a body stops until it is let go.
#[derive(Default)]
struct Gate {
    entered: tokio::sync::Notify,
    go: tokio::sync::Notify,
}

#[idempotent(scope = "recovery.two_databases.live", key = key, tenant = tenant, store = store,
             skip(gate), lease = "600ms", shared_scope)]
async fn live_in_store_mode(
    store: &dyn Store,
    tenant: &str,
    key: &str,
    gate: &Gate,
) -> Result<u64, Error> {
    gate.entered.notify_one();
    gate.go.notified().await;
    Ok(1)
}

#[idempotent(scope = "recovery.two_databases.live", key = key, tenant = tenant, tx = tx,
             lease = "600ms", shared_scope)]
async fn live_in_a_transaction(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    Ok(2)
}

#[idempotent(scope = "recovery.two_databases.live", key = key, tenant = tenant, tx = tx,
             lease = "600ms", shared_scope)]
async fn live_in_a_pg_transaction(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    key: &str,
) -> Result<u64, Error> {
    Ok(3)
}

/// A store-mode call of `tenant`'s key `k` at work on `pg`, whose lease
/// renewals wait, past its lease, for a row lock that the returned
/// connection's open transaction holds (`ROLLBACK` on it lets them land).
async fn an_owner_kept_from_renewing(
    pg: &PgStore,
    tenant: &str,
) -> (
    tokio::task::JoinHandle<Result<u64, Error>>,
    std::sync::Arc<Gate>,
    sqlx::PgConnection,
) {
    use sqlx::Connection;
    let gate = std::sync::Arc::new(Gate::default());
    let owner = {
        let (pg, tenant, gate) = (pg.clone(), tenant.to_owned(), gate.clone());
        tokio::spawn(async move { live_in_store_mode(&pg, &tenant, "k", &gate).await })
    };
    gate.entered.notified().await;
    let mut locker = sqlx::PgConnection::connect(&common::servers::pg_url())
        .await
        .expect("a connection of its own");
    sqlx::query("BEGIN")
        .execute(&mut locker)
        .await
        .expect("begin");
    sqlx::query(
        "SELECT 1 FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE",
    )
    .bind(tenant)
    .bind(LIVE_SCOPE)
    .bind("k")
    .fetch_one(&mut locker)
    .await
    .expect("lock the owner's record");
    let identity = Identity::new(tenant, LIVE_SCOPE, "k").unwrap();
    lease_ran_out(pg, &identity).await;
    (owner, gate, locker)
}

/// Lets the owner of [`an_owner_kept_from_renewing`] renew and answer.
async fn let_the_owner_go(
    owner: tokio::task::JoinHandle<Result<u64, Error>>,
    gate: &Gate,
    mut locker: sqlx::PgConnection,
) {
    sqlx::query("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("let the owner renew");
    gate.go.notify_one();
    // Its own answer (perhaps `LeaseLost`: its lease ran out) is its
    // database's business; the call ends.
    let _answer = owner.await.expect("the owner's call ends");
}

/// Rule 1 across databases: a store-mode owner at work in one database
/// (PostgreSQL), whose lease renewal waits for a row lock past its lease, is
/// that database's business. A transactional-mode call of the same tenant,
/// scope and key on another database (a SQLite file that has never seen the
/// key) runs its body there: the check that keeps a transaction from taking
/// over an owner it may have starved is about that owner's record only, and
/// must not refuse this one with `StaleSnapshot`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_at_work_in_one_database_does_not_refuse_a_transaction_in_another() {
    let Some(pg) = common::servers::pg_store_or_skip().await else {
        return;
    };
    let sqlite = SqliteStore::connect(&common::scratch::sqlite_url("two_databases_live"))
        .await
        .expect("sqlite");
    let tenant = fresh_tenant();
    let (owner, gate, locker) = an_owner_kept_from_renewing(&pg, &tenant).await;

    let mut tx = sqlite
        .pool()
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("begin");
    let (got, outcome) = with_outcome(live_in_a_transaction(&mut tx, &tenant, "k")).await;
    tx.commit().await.expect("commit");
    let_the_owner_go(owner, &gate, locker).await;
    assert_eq!(
        (got.map_err(|e| e.to_string()), outcome),
        (Ok(2), Some(Outcome::Executed)),
        "the SQLite file's record is its own"
    );
}

/// The same with two PostgreSQL databases (two regions on one server): the
/// second database's record, in progress for an owner of another process
/// whose lease ran out, is taken over there; while the first database's
/// owner of the same identity, in this process, cannot renew, its record
/// alone is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_at_work_in_one_postgres_database_does_not_refuse_a_transaction_in_another() {
    let Some(pg) = common::servers::pg_store_or_skip().await else {
        return;
    };
    common::servers::pg_with_fresh_database("two_databases", |url| async move {
        let other = PgStore::connect(&url).await.expect("the other database");
        let tenant = fresh_tenant();
        let identity = Identity::new(tenant.as_str(), LIVE_SCOPE, "k").unwrap();
        // The other database: the record of an attempt that died.
        common::records::acquire(
            &other,
            &identity,
            None,
            Duration::from_millis(1),
            Duration::from_secs(3600),
        )
        .await;
        lease_ran_out(&other, &identity).await;
        let (owner, gate, locker) = an_owner_kept_from_renewing(&pg, &tenant).await;

        let mut tx = other.pool().begin().await.expect("begin");
        let (there, there_outcome) =
            with_outcome(live_in_a_pg_transaction(&mut tx, &tenant, "k")).await;
        tx.commit().await.expect("commit");
        // The owner's own database: its record is refused.
        let mut tx = pg.pool().begin().await.expect("begin");
        let here = live_in_a_pg_transaction(&mut tx, &tenant, "k").await;
        tx.rollback().await.expect("rollback");
        let_the_owner_go(owner, &gate, locker).await;
        let r = other.fetch(&identity).await.unwrap().expect("record");
        other.pool().close().await;
        assert_eq!(
            (there.map_err(|e| e.to_string()), there_outcome),
            (Ok(3), Some(Outcome::Executed)),
            "the other database's record is taken over there"
        );
        assert!(
            matches!(here, Err(Error::StaleSnapshot { .. })),
            "the owner's own record is not taken over: {here:?}"
        );
        assert_eq!((r.state, r.attempt), (RecordState::Complete, 2));
    })
    .await;
}

/// An application whose role was granted the records table (and the
/// migration history) one by one, the migrations being applied by another
/// role: after the upgrade it may not read `idempotency_database`, its store
/// names no database and so does its connection. The answer its store holds
/// unrecorded is the answer of its own database's record, and a takeover of
/// that record in one of its transactions records it: the hook is not
/// asked, the body does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_role_that_may_not_read_the_database_id_still_records_its_held_answer_in_a_transaction(
) {
    const ROLE: &str = "idempotent_app_records_only";
    let Some(_reachable) = common::servers::pg_store_or_skip().await else {
        return;
    };
    common::servers::pg_with_fresh_database("two_databases", |url| async move {
        let owner = PgStore::connect(&url).await.expect("the new database");
        let app_url = {
            let (scheme, rest) = url.split_once("://").expect("url");
            let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
            format!("{scheme}://{ROLE}@{rest}")
        };
        // Roles are the cluster's: made once, granted again each run.
        let _ = sqlx::query(&format!("CREATE ROLE {ROLE} LOGIN"))
            .execute(owner.pool())
            .await;
        sqlx::query(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_records TO {ROLE}"
        ))
        .execute(owner.pool())
        .await
        .expect("grant the records");
        sqlx::query(&format!(
            "GRANT SELECT ON idempotency_schema_migrations TO {ROLE}"
        ))
        .execute(owner.pool())
        .await
        .expect("grant the history");
        let app = PgStore::connect(&app_url)
            .await
            .expect("the application's store");
        assert_eq!(app.database_id(), None, "the role may not read the id");

        let tenant = fresh_tenant();
        let identity = Identity::new(tenant.as_str(), SCOPE, "inv-1").unwrap();
        let got = invoice(&UnwritableAnswers(&app), &tenant, "inv-1", 100).await;
        assert!(matches!(got, Err(Error::Store(_))), "{got:?}");
        assert_eq!(seen(&tenant), (vec![], 1));

        lease_ran_out(&app, &identity).await;
        let mut tx = app.pool().begin().await.expect("begin");
        let (got, outcome) = with_outcome(invoice_in(&mut tx, &tenant, "inv-1", 100)).await;
        tx.commit().await.expect("commit");
        assert_eq!(got.expect("answered"), 100);
        assert_eq!(
            (outcome, seen(&tenant)),
            (Some(Outcome::Replayed), (vec![], 1)),
            "the takeover in the application's transaction records the answer held for it"
        );
    })
    .await;
}

/// A store names the database of the schema its records are in, whatever
/// `search_path` the connection it reads that on has. Code that switches
/// schemas per request leaves `SET search_path = shadow` on a connection of
/// the pool the store opens on (here: the pool's `n`th connection handed
/// out, for each `n` in turn), `shadow` holding a store of its own. Read
/// unqualified on that connection, the id would be `shadow`'s while the
/// records go to `public`: an answer held for one would be recorded by a
/// takeover in the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_store_names_the_schema_its_records_are_in_whatever_the_pool_left() {
    use sqlx::Executor;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let Some(_reachable) = common::servers::pg_store_or_skip().await else {
        return;
    };
    common::servers::pg_with_fresh_database("two_databases", |url| async move {
        let public = PgStore::connect(&url).await.expect("the new database");
        public
            .pool()
            .execute("CREATE SCHEMA shadow")
            .await
            .expect("schema");
        let options = url
            .parse::<sqlx::postgres::PgConnectOptions>()
            .expect("url");
        let shadow = PgStore::from_pool(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect_with(options.clone().options([("search_path", "shadow")]))
                .await
                .expect("pool"),
        )
        .await
        .expect("the shadow schema's store");
        let ids = |schema: &str| match schema {
            "public" => public.database_id(),
            _ => shadow.database_id(),
        };
        assert!(ids("public").is_some() && ids("public") != ids("shadow"));
        for dirty in 0..24 {
            let handed_out = Arc::new(AtomicUsize::new(0));
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .before_acquire(move |conn, _| {
                    let n = handed_out.fetch_add(1, Ordering::SeqCst);
                    Box::pin(async move {
                        if n == dirty {
                            conn.execute("SET search_path = shadow").await?;
                        }
                        Ok(true)
                    })
                })
                .connect_with(options.clone())
                .await
                .expect("pool");
            let Ok(store) = PgStore::from_pool(pool.clone()).await else {
                pool.close().await;
                continue;
            };
            let tenant = fresh_tenant();
            let identity = Identity::new(tenant.as_str(), SCOPE, "inv-1").unwrap();
            common::records::acquire(
                &store,
                &identity,
                None,
                Duration::from_secs(60),
                Duration::from_secs(3600),
            )
            .await;
            let schema: String = sqlx::query_scalar(
                "SELECT 'public' FROM public.idempotency_records WHERE tenant = $1
                 UNION ALL SELECT 'shadow' FROM shadow.idempotency_records WHERE tenant = $1",
            )
            .bind(&tenant)
            .fetch_one(public.pool())
            .await
            .expect("the record, in one schema");
            assert_eq!(
                store.database_id(),
                ids(&schema),
                "the store names the schema its records went to ({schema}; connection {dirty} left in shadow)"
            );
            drop(store);
            pool.close().await;
        }
    })
    .await;
}

/// On MySQL/MariaDB too: an account granted the records table and the
/// migration history alone (the migrations applied by another) opens its
/// store, naming no database, rather than failing to open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_an_account_that_may_not_read_the_database_id_opens_naming_none() {
    const ACCOUNT: &str = "idempotent_app_records_only";
    let Some(admin) = common::servers::mysql_store_or_skip().await else {
        return;
    };
    let database: String = sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(admin.pool())
        .await
        .expect("the test database's name");
    // Accounts are the server's: made once, granted again each run.
    for grant in [
        format!("CREATE USER IF NOT EXISTS '{ACCOUNT}'@'%'"),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON `{database}`.idempotency_records TO '{ACCOUNT}'@'%'"
        ),
        format!("GRANT SELECT ON `{database}`.idempotency_schema_migrations TO '{ACCOUNT}'@'%'"),
    ] {
        sqlx::query(&grant)
            .execute(admin.pool())
            .await
            .unwrap_or_else(|e| panic!("{grant}: {e}"));
    }
    let url = common::servers::mysql_url();
    let (scheme, rest) = url.split_once("://").expect("a mysql:// URL");
    let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
    let app = idempotent_runtime::MySqlStore::connect(&format!("{scheme}://{ACCOUNT}@{rest}"))
        .await
        .expect("the account's store opens");
    assert!(admin.database_id().is_some());
    assert_eq!(app.database_id(), None, "the account may not read the id");
}
