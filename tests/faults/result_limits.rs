//! A store that can record less than `MAX_RESULT_BYTES` (a MySQL server's
//! `max_allowed_packet`): a larger answer is refused before it is written,
//! with the store's own limit, and the key is released, as for any answer
//! too large to record; one within the limit is recorded and replayed.

use crate::common::hooked::{Hooked, Intercept};
use idempotent_runtime::{idempotent, with_outcome, Error, Identity, MemoryStore, Outcome, Store};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A store that records answers of at most 1000 bytes.
struct SmallAnswers;

impl Intercept for SmallAnswers {
    fn max_result_bytes(&self, _: &MemoryStore) -> usize {
        1000
    }
}

#[idempotent(scope = "faults.small_answers", key = key, tenant = shared, store = store, skip(runs))]
async fn answer(
    store: &dyn Store,
    key: &str,
    bytes: usize,
    runs: &AtomicUsize,
) -> Result<String, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok("x".repeat(bytes))
}

#[tokio::test]
async fn an_answer_over_the_stores_limit_is_refused_before_it_is_written() {
    let store = Hooked::new(SmallAnswers);
    let runs = AtomicUsize::new(0);
    match answer(&store, "big", 2000, &runs).await {
        Err(Error::ResultTooLarge { size, limit, .. }) => {
            assert_eq!(limit, 1000, "the store's limit");
            assert!(size > limit);
        }
        other => panic!("expected ResultTooLarge, got {other:?}"),
    }
    let id = Identity::shared("faults.small_answers", "big").expect("identity");
    assert_eq!(store.fetch(&id).await.expect("fetch"), None, "released");
    assert!(answer(&store, "big", 2000, &runs).await.is_err());
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the key was free again");

    let (first, o) = with_outcome(answer(&store, "small", 900, &runs)).await;
    assert_eq!(
        (first.expect("recorded").len(), o),
        (900, Some(Outcome::Executed))
    );
    let (again, o) = with_outcome(answer(&store, "small", 900, &runs)).await;
    assert_eq!(
        (again.expect("replayed").len(), o),
        (900, Some(Outcome::Replayed))
    );
}
