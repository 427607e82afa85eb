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

#[tokio::test]
async fn a_result_over_the_limit_is_refused_and_leaves_no_record() {
    let Some(store) = mysql_store_or_skip().await else {
        return;
    };
    wire::over_the_limit_is_refused_and_leaves_no_record(&store).await;
}
