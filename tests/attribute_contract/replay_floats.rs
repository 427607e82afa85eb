//! Rule 12: a recorded `f64` replays as the same value, to the bit. The
//! result is recorded as JSON (serde_json writes the shortest text that reads
//! back as the same `f64`) and replayed by parsing it; without serde_json's
//! `float_roundtrip` feature, which the runtime turns on, that parser rounded
//! some of those texts to a neighbouring `f64`.

use idempotent_runtime::{idempotent, with_outcome, Error, MemoryStore, Outcome};

#[idempotent(scope = "contract.rate", key = key, tenant = shared, store = store)]
async fn rate(store: &MemoryStore, key: &str, value: f64) -> Result<f64, Error> {
    Ok(value)
}

#[tokio::test]
async fn a_recorded_float_replays_to_the_bit() {
    let store = MemoryStore::new();
    for (i, text) in [
        "1.0715660391465826e-75",
        "0.1",
        "2.2250738585072014e-308",
        "-1.5e300",
    ]
    .into_iter()
    .enumerate()
    {
        let value: f64 = text.parse().expect("a float");
        let key = format!("rate-{i}");
        let first = rate(&store, &key, value).await.expect("first call");
        let (replayed, outcome) = with_outcome(rate(&store, &key, value)).await;
        assert_eq!(outcome, Some(Outcome::Replayed));
        let replayed = replayed.expect("replay");
        assert_eq!(first.to_bits(), value.to_bits());
        assert_eq!(
            replayed.to_bits(),
            value.to_bits(),
            "recorded {value:e}, replayed {replayed:e}"
        );
    }
}
