//! A small aligned-text table, shared by the registry, the audit, the
//! manifest listing and the purge report.

/// Renders `rows` under `header` as left-aligned columns separated by two
/// spaces, with a dashed rule under the header. Widths count characters, not
/// bytes. Trailing spaces are trimmed from every line.
///
/// A control character in a cell is written escaped (`\n`, `\u{1b}`), and so
/// is a line separator or a bidirectional control (`\u{202e}`): cells
/// can hold text from a store (a scope name any program wrote there), which
/// must neither break a row into lines that read as other rows or a summary,
/// nor drive the operator's terminal.
pub(crate) fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<std::borrow::Cow<'_, str>>> = rows
        .iter()
        .map(|row| row.iter().map(|cell| printable(cell)).collect())
        .collect();
    let columns = header.len();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, cell) in cells.enumerate().take(columns) {
            if i > 0 {
                text.push_str("  ");
            }
            text.push_str(cell);
            let pad = widths[i].saturating_sub(cell.chars().count());
            text.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    line(&mut rule.iter().map(String::as_str));
    for row in &rows {
        line(&mut row.iter().map(|cell| &**cell));
    }
    out
}

/// Whether `c` is written escaped: a control character, or one that breaks
/// or reorders the line it is in without being one (the line and paragraph
/// separators; the bidirectional marks, embeddings, overrides and isolates,
/// which turn the rest of a row around wherever the table is shown by a
/// renderer applying the Unicode bidirectional algorithm: a browser, a bidi
/// terminal). Right-to-left letters themselves are left as they are.
fn escaped(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// `cell` with the characters [`escaped`] names escaped (as
/// `char::escape_default` writes them); as it is when it has none.
fn printable(cell: &str) -> std::borrow::Cow<'_, str> {
    if !cell.chars().any(escaped) {
        return std::borrow::Cow::Borrowed(cell);
    }
    let mut out = String::with_capacity(cell.len() + 8);
    for c in cell.chars() {
        if escaped(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_line_up() {
        let out = super::render(
            &["scope", "n"],
            &[
                vec!["a.b".into(), "1".into()],
                vec!["orders.place".into(), "12".into()],
            ],
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "scope         n");
        assert_eq!(lines[1], "------------  --");
        assert_eq!(lines[2], "a.b           1");
        assert_eq!(lines[3], "orders.place  12");
    }
}
