//! Rule 12: a result is recorded only if it will come back equal.

use super::encoder::{Encoder, Mode};
use serde::Serialize;

/// Checks that `value` survives a JSON round trip through serde_json, as a
/// recorded result must (DESIGN rule 12), without writing anything.
///
/// serde_json writes a non-finite `f32`/`f64` (`inf`, `-inf`, `NaN`) as
/// `null`, so a result holding one would replay as something else, or fail
/// to decode on every retry. The error names the value and where it is, as
/// a path of fields, indices (`[2]`) and map entries by place (`[entry #0]`,
/// never the key: it may be personal data).
///
/// Failures of the value's own `Serialize` are not this check's business:
/// it answers `Ok(())` and leaves them to the serializer that records.
///
/// ```
/// use idempotent_runtime::fingerprint::check_faithful_json;
/// #[derive(serde::Serialize)]
/// struct Receipt { amount: f64, lines: Vec<f32> }
///
/// assert!(check_faithful_json(&Receipt { amount: 1.5, lines: vec![-0.0] }).is_ok());
/// let err = check_faithful_json(&Receipt { amount: f64::INFINITY, lines: vec![] }).unwrap_err();
/// assert_eq!(
///     err,
///     "`amount` is the non-finite float inf, which JSON cannot represent (it would replay as null)"
/// );
/// let err = check_faithful_json(&Receipt { amount: 0.0, lines: vec![1.0, f32::NAN] }).unwrap_err();
/// assert!(err.starts_with("`lines[1]` is the non-finite float NaN"));
/// ```
pub fn check_faithful_json<T: Serialize + ?Sized>(value: &T) -> Result<(), String> {
    let mut walker = Encoder::new(Mode::Check);
    match value.serialize(&mut walker) {
        Err(e) if e.is_not_faithful() => Err(e.to_string()),
        _ => Ok(()),
    }
}
