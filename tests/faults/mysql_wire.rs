//! Bad input on the wire against the mysql store: exact matching of awkward
//! keys and tenants, several-megabyte results, oversized results refused.

use crate::common;

use common::servers::mysql_store_or_skip;
use common::wire;

#[tokio::test]
async fn awkward_keys_and_tenants_match_exactly() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    wire::awkward_identities_match_exactly(&store).await;
}

#[test]
fn control_characters_never_reach_the_store() {
    wire::control_characters_are_refused();
}

#[tokio::test]
async fn several_megabytes_round_trip_exactly() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    wire::several_megabytes_round_trip(&store).await;
}

/// The server refuses a statement larger than its `max_allowed_packet` (and
/// drops the connection): an answer that could never be written is refused
/// before the write, not retried as an outage while the key runs again.
#[tokio::test]
async fn the_store_takes_answers_only_as_large_as_the_server_does() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    let packet: u64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS UNSIGNED)")
        .fetch_one(store.pool())
        .await
        .expect("max_allowed_packet");
    let room = usize::try_from(packet.saturating_sub(64 * 1024)).expect("fits");
    assert_eq!(
        idempotent_runtime::Store::max_result_bytes(&store),
        room.min(idempotent_runtime::MAX_RESULT_BYTES)
    );
}

#[tokio::test]
async fn a_result_over_the_limit_is_refused_and_leaves_no_record() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    wire::over_the_limit_is_refused_and_leaves_no_record(&store).await;
}
