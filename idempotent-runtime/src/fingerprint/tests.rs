use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

#[derive(Serialize)]
struct A {
    x: u32,
    y: String,
}
#[derive(Serialize)]
struct B {
    y: String,
    x: u32,
}

#[test]
fn field_order_does_not_matter() {
    let a = Fingerprint::of(&A {
        x: 1,
        y: "z".into(),
    })
    .unwrap();
    let b = Fingerprint::of(&B {
        y: "z".into(),
        x: 1,
    })
    .unwrap();
    assert_eq!(a, b);
    assert_eq!(a.version(), "v1");
}

#[test]
fn known_value_is_stable_across_builds() {
    // Pinned: if this changes, the canonical form changed and needs a new version.
    let f = Fingerprint::of(&A {
        x: 1,
        y: "z".into(),
    })
    .unwrap();
    let mut h = Sha256::new();
    h.update(br#"{"value":{"x":1,"y":"z"}}"#);
    assert_eq!(f.as_str(), format!("v1:{}", hex::encode(h.finalize())));
}

#[test]
fn no_arguments_means_no_fingerprint() {
    assert!(FingerprintBuilder::new().finish().unwrap().is_none());
}

#[test]
fn unserializable_argument_is_reported_by_name() {
    let mut m = HashMap::new();
    m.insert((1u8, 2u8), 3u8); // tuple keys cannot be JSON object keys
    let mut b = FingerprintBuilder::new();
    b.argument("weird", &m);
    match b.finish() {
        Err(Error::Fingerprint { argument, .. }) => assert_eq!(argument, "weird"),
        other => panic!("expected a fingerprint error, got {other:?}"),
    }
}

proptest! {
    #[test]
    fn map_iteration_order_does_not_matter(entries in proptest::collection::vec(("[a-z]{0,6}", any::<i64>()), 0..20)) {
        let hash: HashMap<String, i64> = entries.iter().cloned().collect();
        let tree: BTreeMap<String, i64> = entries.iter().cloned().collect();
        let mut rev: Vec<(String, i64)> = tree.clone().into_iter().collect();
        rev.reverse();
        // A HashMap built in reverse order iterates differently but is the same value.
        let hash_rev: HashMap<String, i64> = rev.into_iter().collect();
        let f1 = Fingerprint::of(&hash).unwrap();
        prop_assert_eq!(&f1, &Fingerprint::of(&tree).unwrap());
        prop_assert_eq!(&f1, &Fingerprint::of(&hash_rev).unwrap());
    }

    #[test]
    fn any_value_change_changes_the_fingerprint(
        x in any::<u32>(), y in ".{0,12}", dx in 1u32.., other in ".{0,12}"
    ) {
        let base = Fingerprint::of(&A { x, y: y.clone() }).unwrap();
        prop_assert_ne!(&base, &Fingerprint::of(&A { x: x.wrapping_add(dx), y: y.clone() }).unwrap());
        if other != y {
            prop_assert_ne!(&base, &Fingerprint::of(&A { x, y: other }).unwrap());
        }
    }

    #[test]
    fn argument_names_and_split_matter(a in any::<i32>(), b in any::<i32>()) {
        let mut one = FingerprintBuilder::new();
        one.argument("a", &a);
        one.argument("b", &b);
        let mut swapped = FingerprintBuilder::new();
        swapped.argument("a", &b);
        swapped.argument("b", &a);
        let one = one.finish().unwrap();
        if a != b {
            prop_assert_ne!(one, swapped.finish().unwrap());
        }
    }
}
