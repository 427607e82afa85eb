//! Repro of a documented limitation (README, "Upgrades and rolling deploys":
//! "in transactional mode (`tx = ...`) no read is made and the answer stays
//! `FingerprintMismatch`"), kept ignored: a delivery handled in
//! transactional mode that meets a record of other arguments still running
//! (its owner in store mode, alive, renewing its lease: the older consumer
//! of a rolling deploy that changed the handler's arguments, or moved it to
//! transactional mode), or a newer version's running record, is terminated
//! at its first delivery as poison, where store mode naks it while that
//! record runs. The running delivery may yet fail and release the key; the
//! term leaves the message processed by nobody (the test shows the
//! redelivery it cut off would have run).

use crate::common;
use common::servers::fresh_tenant;
use idempotent_runtime::consumer::{handle, Disposition, Verdict};
use idempotent_runtime::{idempotent, Error, Identity, SqliteStore, Store};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[idempotent(scope = "nats.txmismatch.billing", key = msg_id, tenant = tenant, tx = tx,
             skip(runs), in_progress = reject)]
async fn bill_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    runs: &AtomicUsize,
    tenant: &str,
    msg_id: &str,
    amount_cents: u64,
) -> Result<u64, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(amount_cents)
}

/// One delivery: the call in a transaction, committed on `Ok`.
async fn deliver(
    pool: &sqlx::SqlitePool,
    runs: &AtomicUsize,
    tenant: &str,
    msg_id: &str,
) -> Result<u64, Error> {
    let db = |e: sqlx::Error| Error::Store(idempotent_runtime::StoreError::new("test", "tx", e));
    let mut tx = pool.begin().await.map_err(db)?;
    let r = bill_in(&mut tx, runs, tenant, msg_id, 500).await?;
    tx.commit().await.map_err(db)?;
    Ok(r)
}

#[tokio::test]
#[ignore = "known limitation (README: a mismatch in transactional mode is terminated): a \
            transactional call does not read the record that refused it; run with --run-ignored"]
async fn a_transactional_delivery_meeting_a_running_record_of_other_arguments_is_nakd() {
    let dir = common::scratch::dir("nats-txmismatch");
    let store = SqliteStore::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.join("txmismatch.db").display()
    ))
    .await
    .expect("sqlite");
    let pool = store.pool().clone();
    let tenant = fresh_tenant();
    let identity = Identity::new(&tenant, "nats.txmismatch.billing", "m-1").expect("identity");
    // The other version's delivery of this message, running (lease an hour).
    let other_arguments = idempotent_runtime::Fingerprint::from_stored(format!(
        "v2:{}",
        "0123456789abcdef".repeat(4)
    ));
    let hour = Duration::from_secs(3600);
    common::records::acquire(&store, &identity, Some(&other_arguments), hour, hour).await;

    let runs = AtomicUsize::new(0);
    let handled = handle(Some("m-1"), |k| deliver(&pool, &runs, &tenant, k)).await;
    let (verdict, disposition) = (handled.verdict, handled.disposition());
    println!("transactional delivery against a running record: {verdict:?} -> {disposition}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    // The running delivery fails, and its key is released: had this
    // delivery been nak'd, its redelivery would now run.
    store
        .force_release(&identity, false)
        .await
        .expect("release");
    let redelivered = handle(Some("m-1"), |k| deliver(&pool, &runs, &tenant, k)).await;
    assert_eq!(redelivered.verdict, Verdict::Executed);

    // The same for a newer version's record, still running: terminated
    // once the message was delivered DELIVERIES_BEFORE_TERM times (as store
    // mode did before it read the record).
    let newer = Identity::new(&tenant, "nats.txmismatch.billing", "m-2").expect("identity");
    let newer_version = idempotent_runtime::Fingerprint::from_stored(format!(
        "v99:{}",
        "0123456789abcdef".repeat(4)
    ));
    common::records::acquire(&store, &newer, Some(&newer_version), hour, hour).await;
    let late = handle(Some("m-2"), |k| deliver(&pool, &runs, &tenant, k))
        .await
        .with_deliveries(idempotent_runtime::consumer::DELIVERIES_BEFORE_TERM + 1);
    println!(
        "transactional delivery against a newer version's running record: {:?} -> {}",
        late.verdict,
        late.disposition()
    );
    let newer_disposition = late.disposition();

    assert!(
        matches!(newer_disposition, Disposition::Nak(Some(_))),
        "a late delivery refused by a newer version's running record was terminated: {newer_disposition}"
    );
    assert!(
        matches!(disposition, Disposition::Nak(Some(_))),
        "a delivery refused by a record that was still running was {verdict:?} -> {disposition}: \
         terminated, the message would never have been processed"
    );
    pool.close().await;
}
