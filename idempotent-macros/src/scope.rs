//! The scope string's format (DESIGN.md §3) and "did you mean" suggestions.

/// The longest scope, in bytes.
pub(crate) const MAX_SCOPE_BYTES: usize = 128;

/// Checks the scope format: lowercase segments `[a-z0-9_-]+` joined by single
/// dots, at most [`MAX_SCOPE_BYTES`] bytes. The error says which rule broke.
pub(crate) fn check_format(scope: &str) -> Result<(), String> {
    const EXAMPLE: &str = "e.g. `payments.charge`";
    if scope.is_empty() {
        return Err(format!(
            "the scope is empty; name the operation with lowercase segments joined by dots, {EXAMPLE}"
        ));
    }
    if scope.len() > MAX_SCOPE_BYTES {
        return Err(format!(
            "the scope is {} bytes long; the limit is {MAX_SCOPE_BYTES} bytes",
            scope.len()
        ));
    }
    for (index, segment) in scope.split('.').enumerate() {
        if segment.is_empty() {
            let place = if index == 0 {
                "starts with a dot".to_owned()
            } else if scope.ends_with('.') && index == scope.split('.').count() - 1 {
                "ends with a dot".to_owned()
            } else {
                "has two dots in a row".to_owned()
            };
            return Err(format!(
                "the scope {place}, leaving an empty segment; segments are joined by single dots, {EXAMPLE}"
            ));
        }
        if let Some(c) = segment.chars().find(|c| c.is_ascii_uppercase()) {
            let lower = scope.to_ascii_lowercase();
            let fix = if check_format(&lower).is_ok() {
                format!(": write `{lower}`")
            } else {
                String::new()
            };
            return Err(format!(
                "the scope contains the uppercase letter `{c}`; scopes are lowercase{fix}"
            ));
        }
        if let Some(c) = segment
            .chars()
            .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '_' | '-'))
        {
            return Err(format!(
                "the scope contains {}, which is not allowed; a segment uses only \
                 `a-z`, `0-9`, `_` and `-`, and segments are joined by `.`, {EXAMPLE}",
                describe_char(c)
            ));
        }
    }
    Ok(())
}

fn describe_char(c: char) -> String {
    if c == ' ' {
        "a space".to_owned()
    } else if c.is_control() {
        format!("the control character {c:?}")
    } else {
        format!("`{c}`")
    }
}

/// The candidate closest to `name` by edit distance, ties broken by order.
/// With `max_distance`, candidates further away than that are not offered.
pub(crate) fn nearest<'a, I>(
    name: &str,
    candidates: I,
    max_distance: Option<usize>,
) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    candidates
        .into_iter()
        .map(|c| (strsim::levenshtein(name, c), c))
        .filter(|(d, _)| max_distance.is_none_or(|m| *d <= m))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_well_formed_scopes() {
        for ok in [
            "payments.charge",
            "a",
            "orders.place_v2",
            "x-y.z_1.0",
            &"a".repeat(128),
        ] {
            assert_eq!(check_format(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn names_the_rule_that_broke() {
        let cases = [
            ("", "empty"),
            (".a", "starts with a dot"),
            ("a.", "ends with a dot"),
            ("a..b", "two dots in a row"),
            ("Payments.charge", "uppercase letter `P`"),
            ("payments charge", "a space"),
            ("payments/charge", "`/`"),
            ("pay\u{7}", "control character"),
            ("é", "`é`"),
        ];
        for (scope, expected) in cases {
            let message = check_format(scope).unwrap_err();
            assert!(message.contains(expected), "{scope:?}: {message}");
        }
        let long = "a".repeat(129);
        assert!(check_format(&long).unwrap_err().contains("129 bytes"));
    }

    #[test]
    fn nearest_picks_the_closest() {
        let names = ["orders.place", "orders.cancel", "payments.charge"];
        assert_eq!(nearest("orders.plac", names, None), Some("orders.place"));
        assert_eq!(
            nearest("payment.charge", names, None),
            Some("payments.charge")
        );
        assert_eq!(nearest("zzz", names, Some(2)), None);
        assert_eq!(nearest("x", [], None), None);
    }
}
