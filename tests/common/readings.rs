//! The `metrics` facade's counters and histograms read back from
//! metrics-util's debugging recorder.

use metrics_util::debugging::{DebugValue, Snapshotter};
use std::collections::HashMap;

/// (metric name, sorted labels) → the value.
pub type Readings = HashMap<(String, Vec<(String, String)>), DebugValue>;

/// Everything recorded since the last snapshot (a snapshot takes the
/// counters' values since the previous one).
pub fn readings(snapshotter: &Snapshotter) -> Readings {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(ck, _, _, value)| {
            let (_, k) = ck.into_parts();
            let mut labels: Vec<(String, String)> = k
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            ((k.name().to_owned(), labels), value)
        })
        .collect()
}

/// The key of a metric in [`Readings`]: its name and its labels, sorted.
pub fn key(name: &str, labels: &[(&str, &str)]) -> (String, Vec<(String, String)>) {
    let mut labels: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    labels.sort();
    (name.to_owned(), labels)
}

/// A counter's value; 0 when it was not recorded.
pub fn counter(readings: &Readings, name: &str, labels: &[(&str, &str)]) -> u64 {
    match readings.get(&key(name, labels)) {
        Some(DebugValue::Counter(n)) => *n,
        None => 0,
        Some(other) => panic!("{name} {labels:?} is not a counter: {other:?}"),
    }
}

/// How many samples a histogram holds; 0 when it was not recorded.
pub fn samples(readings: &Readings, name: &str, labels: &[(&str, &str)]) -> usize {
    match readings.get(&key(name, labels)) {
        Some(DebugValue::Histogram(values)) => values.len(),
        None => 0,
        Some(other) => panic!("{name} {labels:?} is not a histogram: {other:?}"),
    }
}
