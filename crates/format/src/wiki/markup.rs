//! Wikitext to plain paragraphs.
//!
//! The cleaner removes what WikiExtractor removes, in a fixed order of linear passes over the
//! article (each pass scans with `memchr` and copies what it keeps):
//!
//! 1. HTML comments `<!-- … -->` (an unclosed comment runs to the end of the article, as in
//!    MediaWiki).
//! 2. Tags. Dropped *with their content*: `ref`, `references`, `math`, `chem`, `ce`, `code`,
//!    `pre`, `syntaxhighlight`, `source`, `score`, `timeline`, `gallery`, `imagemap`, `graph`,
//!    `mapframe`, `maplink`, `templatedata`, `templatestyles`, `hiero`, `inputbox`,
//!    `categorytree`, `includeonly`, `noinclude`, `indicator`, `table`; self-closing forms (`<ref name=x />`,
//!    `<references/>`) too. Formulas and code are dropped, not replaced by a placeholder, so a
//!    sentence that held a formula reads without it. Every other tag (`<small>`, `<sup>`,
//!    `<span>`, `<blockquote>`, `<poem>`, `<nowiki>`, `<div>`, …) is removed and its content
//!    kept; `<br>` becomes a space.
//! 3. Templates `{{…}}` and template parameters `{{{…}}}`, nested to any depth and across lines
//!    (infoboxes, citations, parser functions).
//! 4. Tables `{| … |}`, nested.
//! 5. Links. `[[target|text]]` becomes `text`, `[[target]]` becomes `target`, the pipe trick
//!    `[[Foo (bar)|]]` becomes `Foo`. `[[File:…]]`, `[[Image:…]]` and `[[Media:…]]` are dropped
//!    with their captions (which may hold nested links), as are `[[Category:…]]` and
//!    interlanguage links (`[[de:…]]`). External links `[url text]` become `text`; a bare
//!    `[url]` is dropped.
//! 6. Lines. Section headings (`== … ==`) are dropped. List items (`*`, `#`, `;`) are dropped,
//!    as WikiExtractor does by default, unless [`CleanOptions::keep_lists`] is set, in which case
//!    their text is kept as a paragraph of its own. Indented lines (`:`) are kept as
//!    paragraphs without the colons. Table-row residue (lines starting with `|` or `!`) and
//!    horizontal rules are dropped. Consecutive text lines are joined into one paragraph, as
//!    MediaWiki renders them.
//! 7. Inside each paragraph: bold/italic quote runs (`''`, `'''`, `'''''`) and magic words
//!    (`__TOC__`) are removed, HTML entities (`&nbsp;`, `&ndash;`, `&#8212;`, …) decoded, and
//!    spacing normalised by [`crate::spacing::normalise_spacing`].
//!
//! Malformed markup never stops the cleaner. An unclosed `{{` or `{|` drops the rest of its
//! line and is counted in [`CleanStats::unterminated`]; a stray `}}`, `]]` or `[[` is removed
//! and counted in [`CleanStats::stray`]. After [`MAX_UNTERMINATED`] unclosed constructs in
//! one article the rest of that article is dropped (this bounds the cleaner's work on hostile
//! input to linear time).

use memchr::{memchr, memchr2, memchr3, memmem};

/// Unclosed `{{` / `{|` constructs tolerated in one article before its remainder is dropped.
pub const MAX_UNTERMINATED: u32 = 64;

/// What to keep from wikitext.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CleanOptions {
    /// Keep the text of list items (`*`, `#`, `;`) as paragraphs. Off by default, as in
    /// WikiExtractor.
    pub keep_lists: bool,
}

/// Malformed-markup counters for one or more articles.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CleanStats {
    /// Unclosed `{{` or `{|` constructs (their line was dropped).
    pub unterminated: u64,
    /// Stray closers `}}`, `]]` and unmatched `[[` that were removed.
    pub stray: u64,
}

/// Cleans one article's wikitext (already XML-unescaped) into plain-text paragraphs.
pub fn wikitext_to_paragraphs(
    wikitext: &str,
    options: &CleanOptions,
    stats: &mut CleanStats,
) -> Vec<String> {
    let mut a = String::with_capacity(wikitext.len());
    let mut b = String::with_capacity(wikitext.len());
    strip_comments(wikitext, &mut a);
    strip_tags(&a, &mut b);
    a.clear();
    strip_braced(&b, &mut a, Braces::Template, stats);
    b.clear();
    strip_braced(&a, &mut b, Braces::Table, stats);
    a.clear();
    rewrite_links(&b, &mut a, stats);
    paragraphs(&a, options)
}

/// Pass 1: removes `<!-- … -->`.
fn strip_comments(s: &str, out: &mut String) {
    let finder = memmem::Finder::new(b"<!--");
    let end = memmem::Finder::new(b"-->");
    let bytes = s.as_bytes();
    let mut pos = 0;
    while let Some(start) = finder.find(&bytes[pos..]).map(|i| pos + i) {
        out.push_str(&s[pos..start]);
        match end.find(&bytes[start + 4..]) {
            Some(e) => pos = start + 4 + e + 3,
            None => return,
        }
    }
    out.push_str(&s[pos..]);
}

/// Tags whose content is dropped along with the tag.
const DROPPED_ELEMENTS: &[&str] = &[
    "ref",
    "references",
    "math",
    "chem",
    "ce",
    "code",
    "pre",
    "syntaxhighlight",
    "source",
    "score",
    "timeline",
    "gallery",
    "imagemap",
    "graph",
    "mapframe",
    "maplink",
    "templatedata",
    "templatestyles",
    "hiero",
    "inputbox",
    "categorytree",
    "includeonly",
    "noinclude",
    "indicator",
    "table",
];

/// A parsed HTML-like tag at some position.
struct Tag<'a> {
    /// Lower-cased-on-compare name, as written.
    name: &'a str,
    closing: bool,
    self_closing: bool,
    /// Byte length of the whole tag `<…>`.
    len: usize,
}

/// Parses a tag starting at `s[0] == '<'`; `None` if this `<` does not start a tag.
fn parse_tag(s: &str) -> Option<Tag<'_>> {
    let b = s.as_bytes();
    let mut i = 1;
    let closing = b.get(1) == Some(&b'/');
    if closing {
        i += 1;
    }
    let name_start = i;
    while i < b.len() && (b[i].is_ascii_alphanumeric()) {
        i += 1;
    }
    if i == name_start || !b[name_start].is_ascii_alphabetic() {
        return None;
    }
    let name = &s[name_start..i];
    // After the name: '>', '/', or whitespace then attributes.
    match b.get(i) {
        Some(b'>') | Some(b'/') | Some(b' ') | Some(b'\t') | Some(b'\n') => {}
        _ => return None,
    }
    // Find the closing '>' on reasonable distance, honouring quoted attribute values.
    let mut quote: u8 = 0;
    let limit = b.len().min(i + 2048);
    while i < limit {
        let c = b[i];
        if quote != 0 {
            if c == quote {
                quote = 0;
            }
        } else if c == b'"' || c == b'\'' {
            // Only a quote that opens an attribute value (after '=') starts quoting.
            if b[i - 1] == b'=' {
                quote = c;
            }
        } else if c == b'>' {
            let self_closing = b[i - 1] == b'/';
            return Some(Tag {
                name,
                closing,
                self_closing,
                len: i + 1,
            });
        } else if c == b'<' {
            return None;
        }
        i += 1;
    }
    None
}

fn is_dropped_element(name: &str) -> bool {
    DROPPED_ELEMENTS
        .iter()
        .any(|d| d.eq_ignore_ascii_case(name))
}

/// Finds the end (exclusive) of the closing tag `</name>` for an element whose content starts
/// at `s[0]`, allowing nested elements of the same name.
fn find_element_end(s: &str, name: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut depth = 1usize;
    let mut pos = 0;
    while let Some(lt) = memchr(b'<', &b[pos..]).map(|i| pos + i) {
        if let Some(tag) = parse_tag(&s[lt..]) {
            if tag.name.eq_ignore_ascii_case(name) {
                if tag.closing {
                    depth -= 1;
                    if depth == 0 {
                        return Some(lt + tag.len);
                    }
                } else if !tag.self_closing {
                    depth += 1;
                }
            }
            pos = lt + tag.len;
        } else {
            pos = lt + 1;
        }
    }
    None
}

/// Pass 2: drops the dropped elements with their content, strips every other tag.
fn strip_tags(s: &str, out: &mut String) {
    let b = s.as_bytes();
    let mut pos = 0;
    let mut copied = 0;
    while let Some(lt) = memchr(b'<', &b[pos..]).map(|i| pos + i) {
        let Some(tag) = parse_tag(&s[lt..]) else {
            pos = lt + 1;
            continue;
        };
        out.push_str(&s[copied..lt]);
        let after = lt + tag.len;
        if tag.name.eq_ignore_ascii_case("br") {
            out.push(' ');
            pos = after;
        } else if is_dropped_element(tag.name) && !tag.closing && !tag.self_closing {
            // Drop through the matching close tag; an unclosed one drops just the tag.
            pos = match find_element_end(&s[after..], tag.name) {
                Some(end) => after + end,
                None => after,
            };
        } else {
            pos = after;
        }
        copied = pos;
    }
    out.push_str(&s[copied..]);
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Braces {
    /// `{{ … }}` and `{{{ … }}}`.
    Template,
    /// `{| … |}`.
    Table,
}

/// Passes 3 and 4: removes nested `{{…}}` (or `{|…|}`) regions.
fn strip_braced(s: &str, out: &mut String, kind: Braces, stats: &mut CleanStats) {
    let b = s.as_bytes();
    let mut pos = 0; // scan position
    let mut copied = 0; // start of text not yet copied
    let mut depth = 0usize;
    let mut region_start = 0;
    let mut unterminated = 0u32;
    loop {
        let next = match kind {
            Braces::Template => memchr2(b'{', b'}', &b[pos..]),
            Braces::Table => memchr2(b'{', b'|', &b[pos..]),
        };
        let Some(at) = next.map(|i| pos + i) else {
            if depth == 0 {
                break;
            }
            // Unclosed: drop the opener's line, rescan after it.
            stats.unterminated += 1;
            unterminated += 1;
            depth = 0;
            if unterminated >= MAX_UNTERMINATED {
                return;
            }
            let line_end = memchr(b'\n', &b[region_start..]).map_or(b.len(), |i| region_start + i);
            pos = line_end;
            copied = line_end;
            continue;
        };
        match kind {
            Braces::Template => {
                // Measure the run of identical braces.
                let c = b[at];
                let mut end = at;
                while end < b.len() && b[end] == c {
                    end += 1;
                }
                let run = end - at;
                let units = match run {
                    1 => 0,
                    3 => 1,
                    n => n / 2 + (n % 2),
                };
                if c == b'{' {
                    if units > 0 {
                        if depth == 0 {
                            out.push_str(&s[copied..at]);
                            region_start = at;
                        }
                        depth += units;
                    }
                } else if units > 0 {
                    if depth == 0 {
                        // Stray closer: drop it.
                        out.push_str(&s[copied..at]);
                        copied = end;
                        stats.stray += 1;
                    } else {
                        depth = depth.saturating_sub(units);
                        if depth == 0 {
                            copied = end;
                        }
                    }
                }
                pos = end;
            }
            Braces::Table => {
                if b[at] == b'{' && b.get(at + 1) == Some(&b'|') {
                    if depth == 0 {
                        out.push_str(&s[copied..at]);
                        region_start = at;
                    }
                    depth += 1;
                    pos = at + 2;
                } else if b[at] == b'|' && b.get(at + 1) == Some(&b'}') && depth > 0 {
                    depth -= 1;
                    pos = at + 2;
                    if depth == 0 {
                        copied = pos;
                    }
                } else {
                    pos = at + 1;
                }
            }
        }
    }
    out.push_str(&s[copied..]);
}

/// Namespaces whose links are embedded media or page metadata, not prose.
fn is_dropped_namespace(ns: &str) -> bool {
    ["file", "image", "media", "category"]
        .iter()
        .any(|n| n.eq_ignore_ascii_case(ns.trim()))
}

/// `de`, `fr`, `simple`, `zh-min-nan`, `be-x-old`: the shape of an interlanguage prefix.
fn looks_like_language_code(prefix: &str) -> bool {
    let mut parts = prefix.split('-');
    let first = parts.next().unwrap_or("");
    let first_ok = (2..=3).contains(&first.len()) && first.bytes().all(|c| c.is_ascii_lowercase())
        || first == "simple";
    first_ok && parts.all(|p| !p.is_empty() && p.bytes().all(|c| c.is_ascii_lowercase()))
}

/// Index of the `]]` matching a `[[` whose content starts at `s[0]`, honouring nesting.
fn find_link_end(s: &[u8]) -> Option<usize> {
    let mut depth = 1usize;
    let mut pos = 0;
    while let Some(i) = memchr2(b'[', b']', &s[pos..]).map(|i| pos + i) {
        if s[i] == b'[' && s.get(i + 1) == Some(&b'[') {
            depth += 1;
            pos = i + 2;
        } else if s[i] == b']' && s.get(i + 1) == Some(&b']') {
            depth -= 1;
            if depth == 0 {
                return Some(i);
            }
            pos = i + 2;
        } else {
            pos = i + 1;
        }
    }
    None
}

/// URL schemes MediaWiki turns into external links.
const URL_SCHEMES: &[&str] = &[
    "http://",
    "https://",
    "ftp://",
    "ftps://",
    "//",
    "mailto:",
    "news:",
    "irc://",
    "ircs://",
    "gopher://",
    "sftp://",
    "git://",
    "svn://",
    "telnet://",
    "urn:",
];

fn starts_with_url(s: &str) -> bool {
    URL_SCHEMES
        .iter()
        .any(|p| s.len() >= p.len() && s.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes()))
}

/// Pass 5: internal and external links to their text.
fn rewrite_links(s: &str, out: &mut String, stats: &mut CleanStats) {
    let b = s.as_bytes();
    let mut pos = 0;
    let mut copied = 0;
    while let Some(at) = memchr2(b'[', b']', &b[pos..]).map(|i| pos + i) {
        if b[at] == b']' {
            if b.get(at + 1) == Some(&b']') {
                out.push_str(&s[copied..at]);
                pos = at + 2;
                copied = pos;
                stats.stray += 1;
            } else {
                pos = at + 1;
            }
            continue;
        }
        if b.get(at + 1) == Some(&b'[') {
            out.push_str(&s[copied..at]);
            let inner_start = at + 2;
            match find_link_end(&b[inner_start..]) {
                Some(len) => {
                    internal_link_text(&s[inner_start..inner_start + len], out, stats);
                    pos = inner_start + len + 2;
                }
                None => {
                    stats.stray += 1;
                    pos = inner_start;
                }
            }
            copied = pos;
        } else if starts_with_url(&s[at + 1..]) {
            // External link: up to the next ']' on the same line.
            let rest = &b[at + 1..];
            match memchr3(b']', b'\n', b'[', rest) {
                Some(close) if rest[close] == b']' => {
                    out.push_str(&s[copied..at]);
                    let inner = &s[at + 1..at + 1 + close];
                    if let Some(sp) = inner.find([' ', '\t']) {
                        rewrite_links(inner[sp + 1..].trim(), out, stats);
                    }
                    pos = at + 1 + close + 1;
                    copied = pos;
                }
                _ => pos = at + 1,
            }
        } else {
            pos = at + 1;
        }
    }
    out.push_str(&s[copied..]);
}

/// Appends the visible text of the internal link whose content (between `[[` and `]]`) is
/// `inner`.
fn internal_link_text(inner: &str, out: &mut String, stats: &mut CleanStats) {
    // Split target | text at the first '|' outside nested links.
    let b = inner.as_bytes();
    let mut split = None;
    let mut depth = 0usize;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'[' if b.get(i + 1) == Some(&b'[') => {
                depth += 1;
                i += 1;
            }
            b']' if b.get(i + 1) == Some(&b']') => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            b'|' if depth == 0 => {
                split = Some(i);
                break;
            }
            _ => {}
        }
        i += 1;
    }
    let (target, text) = match split {
        Some(p) => (&inner[..p], Some(&inner[p + 1..])),
        None => (inner, None),
    };
    let target = target.trim();
    let (leading_colon, target) = match target.strip_prefix(':') {
        Some(t) => (true, t.trim_start()),
        None => (false, target),
    };
    if let Some(colon) = target.find(':') {
        let prefix = &target[..colon];
        if !leading_colon && is_dropped_namespace(prefix) {
            return;
        }
        if !leading_colon && text.is_none() && looks_like_language_code(prefix) {
            return;
        }
    }
    match text {
        Some(t) if !t.trim().is_empty() => rewrite_links(t, out, stats),
        Some(_) => {
            // Pipe trick: drop a namespace prefix and a trailing parenthetical or comma part.
            let mut shown = target;
            if let Some(colon) = shown.find(':') {
                shown = &shown[colon + 1..];
            }
            if let Some(paren) = shown.find(" (") {
                shown = &shown[..paren];
            } else if let Some(comma) = shown.find(", ") {
                shown = &shown[..comma];
            }
            out.push_str(shown.trim());
        }
        None => out.push_str(target),
    }
}

/// Pass 6 and 7: line structure to paragraphs, then inline cleanup of each paragraph.
fn paragraphs(s: &str, options: &CleanOptions) -> Vec<String> {
    let mut result = Vec::new();
    let mut current = String::new();
    let flush = |current: &mut String, result: &mut Vec<String>| {
        if !current.is_empty() {
            let cleaned = clean_inline(current);
            if !cleaned.is_empty() {
                result.push(cleaned);
            }
            current.clear();
        }
    };
    for line in s.split('\n') {
        let t = line.trim();
        let first = t.as_bytes().first().copied();
        match first {
            None => flush(&mut current, &mut result),
            Some(b'=') => flush(&mut current, &mut result),
            Some(b'|') | Some(b'!') => flush(&mut current, &mut result),
            Some(b'-') if t.starts_with("----") => flush(&mut current, &mut result),
            Some(b'*') | Some(b'#') | Some(b';') => {
                flush(&mut current, &mut result);
                if options.keep_lists {
                    let item = t.trim_start_matches(['*', '#', ';', ':']).trim();
                    // `; term : definition` keeps both parts.
                    current.push_str(item);
                    flush(&mut current, &mut result);
                }
            }
            Some(b':') => {
                flush(&mut current, &mut result);
                current.push_str(t.trim_start_matches(':').trim());
                flush(&mut current, &mut result);
            }
            Some(_) => {
                if !current.is_empty() {
                    current.push(' ');
                }
                current.push_str(t);
            }
        }
    }
    flush(&mut current, &mut result);
    result
}

/// Removes quote markup and magic words, decodes entities and normalises spacing.
fn clean_inline(s: &str) -> String {
    let mut no_quotes = String::with_capacity(s.len());
    strip_quote_markup(s, &mut no_quotes);
    let no_magic = strip_magic_words(&no_quotes);
    let decoded = html_escape::decode_html_entities(&no_magic);
    crate::spacing::normalise_spacing(&decoded)
}

/// Removes `''` (italic), `'''` (bold) and `'''''` runs; a run of 4 keeps one apostrophe, a
/// run of more than 5 keeps the extra apostrophes, as MediaWiki renders them.
fn strip_quote_markup(s: &str, out: &mut String) {
    let b = s.as_bytes();
    let mut pos = 0;
    let mut copied = 0;
    while let Some(at) = memchr(b'\'', &b[pos..]).map(|i| pos + i) {
        let mut end = at;
        while end < b.len() && b[end] == b'\'' {
            end += 1;
        }
        let run = end - at;
        if run >= 2 {
            out.push_str(&s[copied..at]);
            let keep = match run {
                2 | 3 | 5 => 0,
                4 => 1,
                n => n - 5,
            };
            for _ in 0..keep {
                out.push('\'');
            }
            copied = end;
        }
        pos = end;
    }
    out.push_str(&s[copied..]);
}

/// Removes behaviour switches such as `__TOC__`, `__NOTOC__`, `__NOEDITSECTION__`.
fn strip_magic_words(s: &str) -> std::borrow::Cow<'_, str> {
    let finder = memmem::Finder::new(b"__");
    let b = s.as_bytes();
    if finder.find(b).is_none() {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut pos = 0;
    let mut copied = 0;
    while let Some(at) = finder.find(&b[pos..]).map(|i| pos + i) {
        let mut end = at + 2;
        while end < b.len() && b[end].is_ascii_uppercase() {
            end += 1;
        }
        if end > at + 2 && b[end..].starts_with(b"__") {
            out.push_str(&s[copied..at]);
            copied = end + 2;
            pos = end + 2;
        } else {
            pos = at + 2;
        }
    }
    out.push_str(&s[copied..]);
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean(s: &str) -> Vec<String> {
        let mut stats = CleanStats::default();
        wikitext_to_paragraphs(s, &CleanOptions::default(), &mut stats)
    }

    #[test]
    fn templates_nested_and_multiline_are_removed() {
        let p = clean("A {{Infobox|name={{lang|x|y}}\n|b=c}}cat sat.{{cite web|url=u}} End.");
        assert_eq!(p, vec!["A cat sat. End."]);
    }

    #[test]
    fn triple_brace_parameters_and_single_braces_inside() {
        assert_eq!(clean("x{{foo|{{{1}}}|{a}}}y"), vec!["xy"]);
        assert_eq!(clean("x{{foo|a{b}}y"), vec!["xy"]);
    }

    #[test]
    fn refs_and_comments_are_removed() {
        let p = clean(
            "Fact.<ref name=\"a\">{{cite|x}}</ref> More<ref name=b /> text.<!-- hidden --> <references/>",
        );
        assert_eq!(p, vec!["Fact. More text."]);
    }

    #[test]
    fn links_become_their_text() {
        let p = clean(
            "[[Anarchism|anarchists]] and [[Peter Kropotkin]] and [[bus]]es, [[Paris (France)|]], \
             [http://example.org the site], see [http://example.org].",
        );
        assert_eq!(
            p,
            vec!["anarchists and Peter Kropotkin and buses, Paris, the site, see."]
        );
    }

    #[test]
    fn file_category_and_interlanguage_links_are_dropped() {
        let p = clean(
            "[[File:X.jpg|thumb|A [[nested|link]] caption]]Text here.[[Category:Things]]\n[[de:Ding]]\n\
             [[:Category:Things|the category]] [[wikt:word|word]]",
        );
        assert_eq!(p, vec!["Text here.", "the category word"]);
    }

    #[test]
    fn tables_headings_and_lists() {
        let p = clean(
            "Intro.\n{| class=\"wikitable\"\n|-\n| a || b\n{|\n|inner\n|}\n|}\n== Heading ==\nBody one\nline two.\n* item\n# item\n: indented quote.",
        );
        assert_eq!(p, vec!["Intro.", "Body one line two.", "indented quote."]);
        let mut stats = CleanStats::default();
        let kept = wikitext_to_paragraphs(
            "* first item\n# second",
            &CleanOptions { keep_lists: true },
            &mut stats,
        );
        assert_eq!(kept, vec!["first item", "second"]);
    }

    #[test]
    fn quotes_entities_magic_words() {
        let p = clean(
            "'''Bold''' and ''italic'' and '''''both'''''__TOC__ 1&nbsp;km&ndash;2&#160;km &amp; rock''''s.",
        );
        assert_eq!(p, vec!["Bold and italic and both 1 km–2 km & rock's."]);
    }

    #[test]
    fn math_and_code_are_dropped() {
        let p = clean("The sum <math>\\frac{{a}}{b}</math> holds; see <code>ls</code>.");
        assert_eq!(p, vec!["The sum holds; see."]);
    }

    #[test]
    fn template_debris_is_mended() {
        let p =
            clean("Abraham Lincoln ({{IPAc-en|ˈ|l|ɪ|ŋ}}; February 12, 1809) was born {{sfn|X}}.");
        assert_eq!(p, vec!["Abraham Lincoln (February 12, 1809) was born."]);
        let p = clean("He ({{lang|x}}, {{lang|y}}) left.");
        assert_eq!(p, vec!["He left."]);
    }

    #[test]
    fn unterminated_template_drops_its_line_only() {
        let mut stats = CleanStats::default();
        let p = wikitext_to_paragraphs(
            "Start {{broken|a=b\n\nSecond paragraph survives.\n\nThird {{ok}} too.",
            &CleanOptions::default(),
            &mut stats,
        );
        assert_eq!(p, vec!["Start", "Second paragraph survives.", "Third too."]);
        assert_eq!(stats.unterminated, 1);
    }

    #[test]
    fn stray_closers_are_removed_and_counted() {
        let mut stats = CleanStats::default();
        let p = wikitext_to_paragraphs("a }} b ]] c [[d", &CleanOptions::default(), &mut stats);
        assert_eq!(p, vec!["a b c d"]);
        assert_eq!(stats.stray, 3);
    }

    #[test]
    fn many_unterminated_openers_stay_linear_and_bounded() {
        let text = "{{x\n".repeat(10_000) + "tail";
        let mut stats = CleanStats::default();
        let p = wikitext_to_paragraphs(&text, &CleanOptions::default(), &mut stats);
        assert!(p.is_empty());
        assert_eq!(stats.unterminated, MAX_UNTERMINATED as u64);
    }
}
