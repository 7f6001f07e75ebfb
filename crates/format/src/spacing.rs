//! Spacing normalisation shared by every source.
//!
//! Whitespace runs (including non-breaking and other Unicode spaces) become one space;
//! zero-width characters, soft hyphens and control characters are removed; no space is left
//! before `,` `.` `;` `:` `)` `!` `?` or after `(`; and the debris that removed markup leaves in
//! parentheses is mended: `()`, `(, )`, `(; )` disappear and `(; born 1809)` becomes
//! `(born 1809)`.

/// Whitespace collapse, invisible characters out, template debris mended.
pub fn normalise_spacing(s: &str) -> String {
    let b = s.as_bytes();
    let mut collapsed = String::with_capacity(s.len());
    let mut pending_space = false;
    let mut i = 0;
    while i < b.len() {
        // Fast path: a run of printable ASCII is copied as it is. Single spaces inside the run
        // are kept where the general rule below would keep them: after something that is not
        // `(` and before something that is not closing punctuation.
        let run_start = i;
        loop {
            while i < b.len() && is_graphic(b[i]) {
                i += 1;
            }
            let plain_space = i > run_start
                && i + 1 < b.len()
                && b[i] == b' '
                && b[i - 1] != b'('
                && is_graphic(b[i + 1])
                && !matches!(b[i + 1], b',' | b'.' | b';' | b':' | b')' | b'!' | b'?');
            if !plain_space {
                break;
            }
            i += 1;
        }
        if i > run_start {
            if pending_space {
                push_space_before(&mut collapsed, b[run_start] as char);
                pending_space = false;
            }
            collapsed.push_str(&s[run_start..i]);
            continue;
        }
        let c = s[i..].chars().next().expect("i is on a char boundary");
        i += c.len_utf8();
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
            push_space_before(&mut collapsed, c);
            pending_space = false;
        }
        collapsed.push(c);
    }
    remove_empty_parentheses(&collapsed)
}

/// Printable ASCII other than space.
fn is_graphic(c: u8) -> bool {
    c > b' ' && c < 0x7F
}

/// Pushes the space that preceded `next`, unless `next` is closing punctuation or the space
/// would follow an opening parenthesis.
fn push_space_before(out: &mut String, next: char) {
    if !matches!(next, ',' | '.' | ';' | ':' | ')' | '!' | '?') && !out.ends_with('(') {
        out.push(' ');
    }
}

/// Mends what removed templates leave inside parentheses: `()`, `(, )` and `(; )` are dropped
/// (with the space before them), and `(; born 1809)` becomes `(born 1809)`.
fn remove_empty_parentheses(s: &str) -> String {
    if memchr::memchr(b'(', s.as_bytes()).is_none() {
        return s.trim().to_string();
    }
    let debris = |c: char| c == ' ' || c == ',' || c == ';';
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(open) = memchr::memchr(b'(', rest.as_bytes()) {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match memchr::memchr2(b')', b'(', after.as_bytes()) {
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
