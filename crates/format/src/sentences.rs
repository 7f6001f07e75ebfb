//! Rule-based English sentence segmentation.
//!
//! Why not a crate: the maintained Rust options are either heavy (`nlprule` ships multi-MB
//! rule binaries and is slow to build) or ports of NLTK's Punkt that need a trained model file.
//! BERT's data recipes only need good sentence boundaries on encyclopedic and literary English,
//! which a few rules with an abbreviation list give at hundreds of MB/s.
//!
//! A boundary is placed after `.`, `!`, `?`, `…` or `...` (plus any closing quotes and brackets)
//! when whitespace follows and the next word can start a sentence: an upper-case letter or a
//! digit, possibly behind an opening quote or bracket. Exceptions, for a `.`:
//! - titles and other abbreviations that always precede more of the sentence (`Mr.`, `Dr.`,
//!   `St.`, `Gen.`, `e.g.`, `i.e.`, `cf.`, `vs.`, `No.`, `c.` …) never end a sentence;
//! - abbreviations that may end one (`etc.`, `Inc.`, `Ltd.`, `Jr.`, `U.S.`, `a.m.` and every
//!   dotted acronym) and single-letter initials (`J. R. R. Tolkien`) end a sentence only when
//!   the next word is a common sentence opener (`The`, `In`, `He`, `This`, …);
//! - month and numbering abbreviations before a number (`Jan. 5`, `world no. 1`, `Vol. 2`) do
//!   not end a sentence.
//!
//! Decimals and version numbers (`3.14`, `v1.2.3`) never split because no space follows the
//! period; an ellipsis followed by a lower-case word does not split.

/// Abbreviations that never end a sentence (compared without the final period, case-sensitive).
const NEVER_FINAL: &[&str] = &[
    "Mr", "Mrs", "Ms", "Dr", "Prof", "St", "Ste", "Gen", "Gov", "Lt", "Col", "Capt", "Cpt", "Sgt",
    "Maj", "Cmdr", "Adm", "Rev", "Hon", "Sen", "Rep", "Pres", "Fr", "Mt", "Ft", "Messrs", "Mme",
    "Mlle", "Msgr", "Sr", "Supt", "Insp", "Brig", "Gens", "pp", "p", "cf", "Cf", "vs", "v", "viz",
    "approx", "ca", "c", "fl", "b", "d", "r", "ed", "eds", "Ed", "Eds", "trans", "Ave", "Blvd",
    "Rd", "Bros", "est", "Est", "lit", "al", "ibid", "Ibid", "Jos", "Wm", "Chas", "Geo", "Thos",
    "Jas",
];

/// Abbreviations that may end a sentence.
const MAYBE_FINAL: &[&str] = &[
    "etc", "Inc", "Ltd", "Co", "Corp", "Jr", "Bros", "Esq", "PhD", "Ph.D", "Mass", "Calif",
];

/// Abbreviations that are not final before a number: months (`Jan. 5`) and numbering
/// (`No. 1`, `world no. 1`, `Vol. 2`, `Fig. 3`, `Art. 7`).
const BEFORE_NUMBER: &[&str] = &[
    "Jan", "Feb", "Mar", "Apr", "Jun", "Jul", "Aug", "Sep", "Sept", "Oct", "Nov", "Dec", "No",
    "no", "Nos", "nos", "Nr", "nr", "Vol", "vol", "Vols", "Fig", "fig", "Figs", "Eq", "eq", "Ch",
    "ch", "Art", "art", "Sec", "sec", "Op", "op",
];

/// Words that commonly open a sentence; after a "maybe final" abbreviation they decide a split.
const OPENERS: &[&str] = &[
    "A",
    "After",
    "Although",
    "An",
    "And",
    "As",
    "At",
    "Because",
    "Before",
    "Both",
    "But",
    "By",
    "Despite",
    "During",
    "Each",
    "Following",
    "For",
    "From",
    "He",
    "Her",
    "His",
    "However",
    "I",
    "If",
    "In",
    "It",
    "Its",
    "Many",
    "Most",
    "Nevertheless",
    "No",
    "Not",
    "Now",
    "On",
    "One",
    "Other",
    "Over",
    "She",
    "Since",
    "Some",
    "Such",
    "That",
    "The",
    "Their",
    "There",
    "These",
    "They",
    "This",
    "Those",
    "Thus",
    "To",
    "Today",
    "Under",
    "Unlike",
    "We",
    "What",
    "When",
    "Where",
    "While",
    "Who",
    "With",
    "Yet",
    "You",
];

fn is_closing(c: char) -> bool {
    matches!(c, '"' | '\'' | ')' | ']' | '}' | '»' | '”' | '’' | '›')
}

fn is_opening(c: char) -> bool {
    matches!(
        c,
        '"' | '\'' | '(' | '[' | '«' | '“' | '‘' | '‹' | '¿' | '¡'
    )
}

/// Splits one paragraph (no newlines needed; any whitespace is fine) into trimmed sentences.
pub fn split_sentences(paragraph: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let b = paragraph.as_bytes();
    let mut start = 0;
    let ellipsis = memchr::memmem::Finder::new("…".as_bytes());
    let mut next_ellipsis = ellipsis.find(b);
    let mut i = 0;
    while i < b.len() {
        // Jump to the next terminator: '.', '!', '?' or '…'.
        if next_ellipsis.is_some_and(|e| e < i) {
            next_ellipsis = ellipsis.find(&b[i..]).map(|e| i + e);
        }
        let ascii = memchr::memchr3(b'.', b'!', b'?', &b[i..]).map(|t| i + t);
        i = match (ascii, next_ellipsis) {
            (Some(a), Some(e)) => a.min(e),
            (Some(a), None) => a,
            (None, Some(e)) => e,
            (None, None) => break,
        };
        // The whole run of terminators: "...", "?!", "…".
        let run_start = i;
        while i < b.len() {
            if b[i] == b'.' || b[i] == b'!' || b[i] == b'?' {
                i += 1;
            } else if b[i..].starts_with("…".as_bytes()) {
                i += "…".len();
            } else {
                break;
            }
        }
        let run = &paragraph[run_start..i];
        // Closing quotes and brackets belong to the sentence.
        let mut end = i;
        for ch in paragraph[i..].chars() {
            if is_closing(ch) {
                end += ch.len_utf8();
            } else {
                break;
            }
        }
        // Whitespace must follow.
        let after = &paragraph[end..];
        let trimmed = after.trim_start();
        if trimmed.len() == after.len() || trimmed.is_empty() {
            i = end.max(i);
            continue;
        }
        let next_word = first_word(trimmed);
        if starts_sentence(trimmed)
            && boundary_allowed(&paragraph[start..run_start], run, next_word)
        {
            let sentence = paragraph[start..end].trim();
            if !sentence.is_empty() {
                out.push(sentence);
            }
            start = paragraph.len() - trimmed.len();
            i = start;
        } else {
            i = end.max(i);
        }
    }
    let last = paragraph[start..].trim();
    if !last.is_empty() {
        out.push(last);
    }
    out
}

/// The next word without opening punctuation.
fn first_word(s: &str) -> &str {
    let s = s.trim_start_matches(is_opening);
    let end = s
        .char_indices()
        .find(|&(_, c)| !c.is_alphanumeric() && c != '-' && c != '\'')
        .map_or(s.len(), |(i, _)| i);
    &s[..end]
}

/// Whether the text after a terminator looks like a sentence start.
fn starts_sentence(s: &str) -> bool {
    let mut chars = s.chars();
    let mut c = chars.next();
    while let Some(ch) = c {
        if is_opening(ch) {
            c = chars.next();
        } else {
            break;
        }
    }
    c.is_some_and(|ch| ch.is_uppercase() || ch.is_ascii_digit())
}

/// Whether the text before the terminator (`before`, the sentence so far) may end at it.
fn boundary_allowed(before: &str, run: &str, next_word: &str) -> bool {
    if run != "." {
        // "!", "?", "...", "…": split only before an upper-case or numeric start (checked by the caller).
        return !run.starts_with("..") && !run.starts_with('…')
            || next_word.chars().next().is_some_and(|c| c.is_uppercase());
    }
    // The word that the period ends.
    let word = before
        .rsplit(|c: char| c.is_whitespace())
        .next()
        .unwrap_or("")
        .trim_start_matches(is_opening);
    if word.is_empty() {
        return true;
    }
    let opener = OPENERS.contains(&next_word);
    if NEVER_FINAL.contains(&word) {
        return false;
    }
    if BEFORE_NUMBER.contains(&word) {
        return !next_word.starts_with(|c: char| c.is_ascii_digit());
    }
    if MAYBE_FINAL.contains(&word) {
        return opener;
    }
    let mut chars = word.chars();
    let first = chars.next();
    let single_letter = first.is_some_and(|c| c.is_alphabetic()) && chars.next().is_none();
    if single_letter {
        return first.is_some_and(|c| c.is_uppercase()) && opener;
    }
    // Dotted abbreviations: "U.S", "e.g", "i.e", "a.m", "Ph.D".
    if word.contains('.') && word.chars().any(|c| c.is_alphabetic()) {
        let lower = word.to_ascii_lowercase();
        if matches!(lower.as_str(), "e.g" | "i.e" | "viz" | "cf" | "n.b") {
            return false;
        }
        let letters_and_dots = word.chars().all(|c| c.is_alphabetic() || c == '.');
        if letters_and_dots && word.split('.').all(|p| p.chars().count() <= 2) {
            return opener;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_sentences() {
        assert_eq!(
            split_sentences("The cat sat. The dog ran! Did it? Yes."),
            vec!["The cat sat.", "The dog ran!", "Did it?", "Yes."]
        );
    }

    #[test]
    fn titles_and_initials() {
        assert_eq!(
            split_sentences(
                "Mr. Woodhouse met Dr. Perry at St. Paul's. J. R. R. Tolkien wrote it."
            ),
            vec![
                "Mr. Woodhouse met Dr. Perry at St. Paul's.",
                "J. R. R. Tolkien wrote it."
            ]
        );
        assert_eq!(
            split_sentences("George W. Bush spoke. He left."),
            vec!["George W. Bush spoke.", "He left."]
        );
    }

    #[test]
    fn dotted_abbreviations() {
        assert_eq!(
            split_sentences(
                "Fruit, e.g. Apples and pears, etc. are sold in the U.S. Army stores. The end."
            ),
            vec![
                "Fruit, e.g. Apples and pears, etc. are sold in the U.S. Army stores.",
                "The end."
            ]
        );
        assert_eq!(
            split_sentences("He moved to the U.S. The move was hard."),
            vec!["He moved to the U.S.", "The move was hard."]
        );
    }

    #[test]
    fn numbers_and_versions() {
        assert_eq!(
            split_sentences(
                "Pi is 3.14 and v1.2.3 shipped in 1990. In 1991 it grew. No. 5 is next."
            ),
            vec![
                "Pi is 3.14 and v1.2.3 shipped in 1990.",
                "In 1991 it grew.",
                "No. 5 is next."
            ]
        );
        assert_eq!(
            split_sentences("It opened on Jan. 5 1990."),
            vec!["It opened on Jan. 5 1990."]
        );
    }

    #[test]
    fn quotes_parentheses_and_ellipses() {
        assert_eq!(
            split_sentences(
                "He said \"Stop.\" Then he left. (See above.) It ended… and yet... More came."
            ),
            vec![
                "He said \"Stop.\"",
                "Then he left.",
                "(See above.)",
                "It ended… and yet...",
                "More came."
            ]
        );
        assert_eq!(
            split_sentences("“Really?” she asked."),
            vec!["“Really?” she asked."]
        );
    }

    #[test]
    fn whitespace_only_and_empty() {
        assert!(split_sentences("   ").is_empty());
        assert_eq!(split_sentences("No terminator"), vec!["No terminator"]);
    }
}
