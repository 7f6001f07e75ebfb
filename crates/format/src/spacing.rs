//! Spacing normalisation shared by every source.
//!
//! Whitespace runs (including non-breaking and other Unicode spaces) become one space;
//! zero-width characters, soft hyphens and control characters are removed; no space is left
//! before `,` `.` `;` `:` `)` `!` `?` or after `(`; and the debris that removed markup leaves in
//! parentheses is mended: `()`, `(, )`, `(; )` disappear and `(; born 1809)` becomes
//! `(born 1809)`.

/// Whitespace collapse, invisible characters out, template debris mended.
pub fn normalise_spacing(s: &str) -> String {
    if is_already_normal(s.as_bytes()) {
        remove_empty_parentheses(s)
    } else {
        remove_empty_parentheses(&collapse(s))
    }
}

/// The general (per-character) spacing rules.
fn collapse(s: &str) -> String {
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
    collapsed
}

/// Byte classes for [`is_already_normal`]: a control character (always needs work), a space,
/// `(`, and the lead bytes of the few multi-byte characters the normaliser changes.
const CONTROL: u8 = 1;
const SPACE: u8 = 2;
const OPEN: u8 = 4;
const LEAD: u8 = 8;

/// Class of each byte (what it is).
const CLASS: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut c = 0;
    while c < 0x20 {
        t[c] = CONTROL;
        c += 1;
    }
    t[0x7F] = CONTROL;
    t[b' ' as usize] = SPACE;
    t[b'(' as usize] = OPEN;
    // U+0080–U+00A0 and U+00AD (C2 ..), U+1680 (E1), U+2000–U+206F (E2), U+3000 (E3), U+FEFF (EF).
    t[0xC2] = LEAD;
    t[0xE1] = LEAD;
    t[0xE2] = LEAD;
    t[0xE3] = LEAD;
    t[0xEF] = LEAD;
    t
};

/// Which classes a following byte makes a problem: a space before a space or closing
/// punctuation, `(` before a space; controls and lead bytes always are.
const NEXT: [u8; 256] = {
    let mut t = [CONTROL | LEAD; 256];
    let closers = [b' ', b',', b'.', b';', b':', b')', b'!', b'?'];
    let mut i = 0;
    while i < closers.len() {
        t[closers[i] as usize] |= SPACE;
        i += 1;
    }
    t[b' ' as usize] |= OPEN;
    t
};

/// Whether `b` is certainly unchanged by the collapse step: no control character, no space
/// at either end, no space before a space or closing punctuation, no space after `(`, and no
/// multi-byte whitespace or invisible character. Branch-free over 64-byte blocks, so the
/// common clean paragraph costs about a cycle per byte.
fn is_already_normal(b: &[u8]) -> bool {
    let n = b.len();
    if n == 0 {
        return true;
    }
    if b[0] == b' ' || b[n - 1] == b' ' || CLASS[b[n - 1] as usize] & (CONTROL | LEAD) != 0 {
        return false;
    }
    let mut leads = false;
    let mut start = 0;
    while start + 1 < n {
        let end = (start + 64).min(n - 1);
        let mut flags = 0u8;
        for (&c, &next) in b[start..end].iter().zip(&b[start + 1..end + 1]) {
            flags |= CLASS[c as usize] & NEXT[next as usize];
        }
        if flags & (CONTROL | SPACE | OPEN) != 0 {
            return false;
        }
        leads |= flags & LEAD != 0;
        start = end;
    }
    !leads || !has_changed_multibyte(b)
}

/// Whether `b` holds a multi-byte character that the collapse step removes or turns into a
/// space: C1 controls, NBSP, soft hyphen, U+1680, U+2000–U+200F, U+2028–U+202F, U+205F,
/// U+2060, U+3000, U+FEFF.
fn has_changed_multibyte(b: &[u8]) -> bool {
    let at = |i: usize| b.get(i).copied().unwrap_or(0);
    b.iter().enumerate().any(|(i, &c)| match c {
        0xC2 => matches!(at(i + 1), 0x80..=0xA0 | 0xAD),
        0xE1 => at(i + 1) == 0x9A && at(i + 2) == 0x80,
        0xE2 => match at(i + 1) {
            0x80 => matches!(at(i + 2), 0x80..=0x8F | 0xA8..=0xAF),
            0x81 => matches!(at(i + 2), 0x9F | 0xA0),
            _ => false,
        },
        0xE3 => at(i + 1) == 0x80 && at(i + 2) == 0x80,
        0xEF => at(i + 1) == 0xBB && at(i + 2) == 0xBF,
        _ => false,
    })
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
        assert_eq!(
            normalise_spacing("a\u{2028}b\u{FEFF}c\u{00AD}d – e"),
            "a bcd – e"
        );
    }

    /// The fast check must never call a string normal that the general rules would change.
    #[test]
    fn fast_check_is_sound_on_random_text() {
        let alphabet = [
            "a", "Z", "1", " ", "  ", ",", ".", ";", ":", ")", "(", "!", "?", "\t", "\n", "\u{7F}",
            "é", "–", "—", "°", "\u{00A0}", "\u{00AD}", "\u{0085}", "\u{1680}", "\u{2009}",
            "\u{200B}", "\u{2028}", "\u{202F}", "\u{205F}", "\u{2060}", "\u{3000}", "\u{FEFF}",
            "€", "™", "中",
        ];
        let mut rng = bertkit_rng::SplitMix64::new(7);
        let mut next = || rng.next_u64();
        let mut normal = 0;
        for _ in 0..200_000 {
            let len = (next() % 12) as usize;
            // Mostly letters, so that many samples are normal.
            let s: String = (0..len)
                .map(|_| {
                    let r = next();
                    if r % 3 == 0 {
                        alphabet[(r / 3 % alphabet.len() as u64) as usize]
                    } else {
                        "b"
                    }
                })
                .collect();
            if is_already_normal(s.as_bytes()) {
                normal += 1;
                assert_eq!(collapse(&s), s, "{s:?} was called normal");
            }
        }
        assert!(normal > 10_000, "only {normal} normal samples");
    }
}
