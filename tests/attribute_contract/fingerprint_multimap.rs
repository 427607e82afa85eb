//! The fingerprint of a map of unknown length (serde's `serialize_map(None)`,
//! what `collect_map` writes for an iterator without an exact length) does not
//! depend on a *set's* iteration order (rule 6). Such a map's repeated keys
//! keep their arrival order only when they come from different sources
//! (`#[serde(flatten)]`); a multimap written as repeated entries (one per value
//! of a `HashSet`) is one source, so two equal sets that iterate differently
//! fingerprint equal, as with a known length.

use idempotent_runtime::Fingerprint;
use serde::{Serialize, Serializer};
use std::collections::HashSet;

/// One key with a set of values, written as repeated entries `k: v` (a
/// multimap); `exact` says whether the map's length is given.
struct Multi<'a> {
    key: &'a str,
    values: &'a HashSet<String>,
    exact: bool,
}

impl Serialize for Multi<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let entries = self.values.iter().map(|v| (self.key, v));
        if self.exact {
            let entries: Vec<_> = entries.collect();
            s.collect_map(entries)
        } else {
            // An iterator without an exact length: serde passes `None`.
            s.collect_map(entries.filter(|_| true))
        }
    }
}

fn values() -> HashSet<String> {
    (0..8).map(|i| format!("v{i}")).collect()
}

#[test]
fn a_sets_iteration_order_does_not_change_a_map_of_unknown_length() {
    let one = values();
    let order = |s: &HashSet<String>| s.iter().cloned().collect::<Vec<_>>();
    // Another set with the same members and another iteration order (each
    // HashSet has its own hasher keys).
    let other = (0..1000)
        .map(|_| values())
        .find(|s| order(s) != order(&one))
        .expect("two equal sets that iterate differently");
    assert_eq!(one, other, "the same value");
    let fp = |values, exact| {
        Fingerprint::of(&Multi {
            key: "tag",
            values,
            exact,
        })
        .expect("fingerprint")
        .to_string()
    };
    assert_eq!(
        fp(&one, true),
        fp(&other, true),
        "control: with a known length the set's order does not count"
    );
    assert_eq!(
        fp(&one, false),
        fp(&other, false),
        "rule 6: the same set must fingerprint equal however it iterates"
    );
}
