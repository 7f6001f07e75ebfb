//! Spacing normalisation shared by every source.
//!
//! Whitespace runs (including non-breaking and other Unicode spaces) become one space;
//! zero-width characters, soft hyphens and control characters are removed; no space is left
//! before `,` `.` `;` `:` `)` `!` `?` or after `(`; and the debris that removed markup leaves in
//! parentheses is mended: `()`, `(, )`, `(; )` disappear and `(; born 1809)` becomes
//! `(born 1809)`.

/// Whitespace collapse, invisible characters out, template debris mended.
pub fn normalise_spacing(s: &str) -> String {
    let mut collapsed = String::with_capacity(s.len());
    let mut pending_space = false;
    for c in s.chars() {
        if c.is_whitespace() {
            pending_space = !collapsed.is_empty();
            continue;
        }
        let invisible = matches!(
            c,
            '\u{200B}' | '\u{200C}' | '\u{200D}' | '\u{2060}' | '\u{FEFF}' | '\u{00AD}'
        );
        if invisible || c.is_control() {
            continue;
        }
        if pending_space {
            // No space before closing punctuation or after an opening parenthesis.
            if !matches!(c, ',' | '.' | ';' | ':' | ')' | '!' | '?') && !collapsed.ends_with('(') {
                collapsed.push(' ');
            }
            pending_space = false;
        }
        collapsed.push(c);
    }
    remove_empty_parentheses(&collapsed)
}

/// Mends what removed templates leave inside parentheses: `()`, `(, )` and `(; )` are dropped
/// (with the space before them), and `(; born 1809)` becomes `(born 1809)`.
fn remove_empty_parentheses(s: &str) -> String {
    if !s.contains('(') {
        return s.trim().to_string();
    }
    let debris = |c: char| c == ' ' || c == ',' || c == ';';
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(open) = rest.find('(') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find([')', '(']) {
            Some(close) if after.as_bytes()[close] == b')' => {
                let content = after[..close].trim_matches(debris);
                if content.chars().all(|c| c.is_ascii_punctuation()) {
                    if out.ends_with(' ') {
                        out.pop();
                    }
                } else {
                    out.push('(');
                    out.push_str(content);
                    out.push(')');
                }
                rest = &after[close + 1..];
            }
            _ => {
                out.push('(');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapses_and_mends() {
        assert_eq!(
            normalise_spacing("  a\u{00A0}\u{2009}b\u{200B}c ,d ( e ) () f\t"),
            "a bc,d (e) f"
        );
        assert_eq!(normalise_spacing("x (; y;)"), "x (y)");
        assert_eq!(normalise_spacing("lawn ?"), "lawn?");
    }
}
