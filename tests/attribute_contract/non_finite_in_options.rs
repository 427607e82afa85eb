//! Rule 12 where the non-finite float sits in an `Option`: serde_json writes
//! `Some(NaN)` / `Some(inf)` as `null`, which reads back as `None` and is
//! written again as the same bytes, so only the non-finite check tells it
//! apart. Such an answer must be refused when it is recorded, naming the
//! scope (never recorded as `None`): for a result, for an error recorded
//! with `errors = record`, and for one `errors = record_if(..)` records.
//! Nothing is recorded and the key is free (a retry runs again).
//! (`contract::a_non_finite_result_is_refused_not_recorded_as_null` uses a
//! bare `f64`, which the read-back check refuses as well.)

use idempotent_runtime::{idempotent, Error, Identity, MemoryStore, Store};
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Quote {
    pub rate: Option<f64>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub enum QuoteError {
    Declined { rate: Option<f64> },
    Library(String),
}

impl From<Error> for QuoteError {
    fn from(e: Error) -> Self {
        QuoteError::Library(e.to_string())
    }
}

fn is_declined(e: &QuoteError) -> bool {
    matches!(e, QuoteError::Declined { .. })
}

#[idempotent(scope = "contract.optional_rate", key = key, tenant = shared, store = store, skip(runs))]
async fn quote(store: &MemoryStore, key: &str, runs: &AtomicUsize) -> Result<Quote, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Quote {
        rate: Some(f64::NAN),
    })
}

#[idempotent(scope = "contract.optional_rate_recorded", key = key, tenant = shared, store = store,
             skip(runs), errors = record)]
async fn quote_recorded(
    store: &MemoryStore,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u8, QuoteError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(QuoteError::Declined {
        rate: Some(f64::INFINITY),
    })
}

#[idempotent(scope = "contract.optional_rate_record_if", key = key, tenant = shared, store = store,
             skip(runs), errors = record_if(is_declined))]
async fn quote_record_if(
    store: &MemoryStore,
    key: &str,
    runs: &AtomicUsize,
) -> Result<u8, QuoteError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Err(QuoteError::Declined {
        rate: Some(f64::NEG_INFINITY),
    })
}

async fn nothing_recorded(store: &MemoryStore, scope: &str, key: &str) {
    let identity = Identity::shared(scope, key).expect("identity");
    assert!(
        store.fetch(&identity).await.expect("fetch").is_none(),
        "{scope}: nothing recorded, the key is free"
    );
}

#[tokio::test]
async fn a_non_finite_float_in_an_option_result_is_refused_not_recorded_as_none() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    for round in 1..=2 {
        let answer = quote(&store, "k", &runs).await;
        match &answer {
            Err(e @ Error::ResultNotFaithful { scope, .. }) => {
                assert_eq!(scope, "contract.optional_rate");
                assert!(e.to_string().contains("non-finite"), "{e}");
            }
            other => panic!("expected ResultNotFaithful, got {other:?}"),
        }
        nothing_recorded(&store, "contract.optional_rate", "k").await;
        assert_eq!(runs.load(Ordering::SeqCst), round, "the retry ran again");
    }
}

#[tokio::test]
async fn a_non_finite_float_in_an_option_of_a_recorded_error_is_refused() {
    let store = MemoryStore::new();
    for (scope, record_if) in [
        ("contract.optional_rate_recorded", false),
        ("contract.optional_rate_record_if", true),
    ] {
        let runs = AtomicUsize::new(0);
        for round in 1..=2 {
            let answer = if record_if {
                quote_record_if(&store, "k", &runs).await
            } else {
                quote_recorded(&store, "k", &runs).await
            };
            match &answer {
                Err(QuoteError::Library(message)) => {
                    assert!(
                        message.contains(scope) && message.contains("non-finite"),
                        "{scope}: {message}"
                    );
                }
                other => panic!("{scope}: expected the refusal (ResultNotFaithful), got {other:?}"),
            }
            nothing_recorded(&store, scope, "k").await;
            assert_eq!(
                runs.load(Ordering::SeqCst),
                round,
                "{scope}: the retry ran again"
            );
        }
    }
}
