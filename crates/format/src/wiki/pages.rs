//! Pages out of a segment of dump XML, and articles out of pages.
//!
//! A segment is parsed with `quick-xml` as a fragment (end-name checks off, because the first
//! segment opens `<mediawiki>` and the last closes it). Only `page/title`, `page/ns`, `page/id`,
//! `page/redirect` and `revision/text` are read; `<siteinfo>` and everything else is skipped.
//!
//! A page is an *article* when it is in the main namespace (0) and is not a redirect
//! (`<redirect …/>` element, or text starting with `#REDIRECT`). Disambiguation pages (title
//! ending in "(disambiguation)" or a disambiguation template such as `{{disambiguation}}`,
//! `{{dab}}`, `{{hndis}}`, `{{geodis}}`) are articles too, but they are lists of links rather
//! than prose and are skipped unless `keep_disambiguation` is set.
//!
//! Text that is not valid UTF-8 makes its page a counted skip (or an error in strict mode).

use std::borrow::Cow;
use std::path::Path;

use memchr::memmem;
use quick_xml::Reader;
use quick_xml::events::Event;

use super::WikiOptions;
use super::markup::{CleanStats, wikitext_to_paragraphs};
use crate::error::FormatError;
use crate::output::Document;
use crate::sentences::split_sentences;

/// Counters of a wiki run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WikiCounts {
    /// `<page>` elements read.
    pub pages_seen: u64,
    /// Main-namespace pages that are not redirects.
    pub articles: u64,
    /// Articles written as documents.
    pub articles_written: u64,
    /// Redirect pages skipped (any namespace).
    pub redirects_skipped: u64,
    /// Non-redirect pages outside the main namespace skipped.
    pub non_article_pages_skipped: u64,
    /// Disambiguation pages skipped.
    pub disambiguation_skipped: u64,
    /// Articles with no sentence left after cleaning.
    pub empty_articles_skipped: u64,
    /// Pages skipped because their bytes are not valid UTF-8.
    pub invalid_utf8_pages_skipped: u64,
    /// Unclosed `{{` / `{|` constructs met (their line was dropped).
    pub unterminated_markup: u64,
    /// Stray `}}`, `]]`, `[[` removed.
    pub stray_markup: u64,
    /// Sentences written.
    pub sentences: u64,
    /// Bytes of text written.
    pub bytes: u64,
    /// Decompressed XML bytes read.
    pub xml_bytes: u64,
    /// Items skipped because of bad input (invalid UTF-8 pages).
    pub errors: u64,
}

impl WikiCounts {
    /// Adds another segment's counters.
    pub fn add(&mut self, o: &WikiCounts) {
        self.pages_seen += o.pages_seen;
        self.articles += o.articles;
        self.articles_written += o.articles_written;
        self.redirects_skipped += o.redirects_skipped;
        self.non_article_pages_skipped += o.non_article_pages_skipped;
        self.disambiguation_skipped += o.disambiguation_skipped;
        self.empty_articles_skipped += o.empty_articles_skipped;
        self.invalid_utf8_pages_skipped += o.invalid_utf8_pages_skipped;
        self.unterminated_markup += o.unterminated_markup;
        self.stray_markup += o.stray_markup;
        self.sentences += o.sentences;
        self.bytes += o.bytes;
        self.xml_bytes += o.xml_bytes;
        self.errors += o.errors;
    }
}

/// What parsing one segment produced.
#[derive(Debug, Default)]
pub struct SegmentOutcome {
    /// Articles as documents, in dump order.
    pub documents: Vec<Document>,
    /// Counters.
    pub counts: WikiCounts,
    /// Skipped-page messages.
    pub warnings: Vec<String>,
    /// Whether the closing `</mediawiki>` tag was in this segment.
    pub saw_root_end: bool,
}

/// Maps positions in a buffer with some byte ranges removed back to original offsets.
struct OffsetMap {
    base: u64,
    /// (position in the kept buffer, bytes removed before it in total)
    removals: Vec<(usize, u64)>,
}

impl OffsetMap {
    fn original(&self, pos: usize) -> u64 {
        let removed = self
            .removals
            .iter()
            .take_while(|(at, _)| *at <= pos)
            .last()
            .map_or(0, |r| r.1);
        self.base + pos as u64 + removed
    }
}

/// The title of the page in `page_bytes`, for messages.
fn title_of(page_bytes: &[u8]) -> String {
    let Some(s) = memmem::find(page_bytes, b"<title>") else {
        return "(no title)".into();
    };
    let rest = &page_bytes[s + 7..];
    let e = memmem::find(rest, b"</title>").unwrap_or(rest.len().min(200));
    String::from_utf8_lossy(&rest[..e]).into_owned()
}

/// Removes pages containing invalid UTF-8 from a segment, counting them.
fn drop_invalid_pages<'a>(
    path: &Path,
    seg_offset: u64,
    bytes: &'a [u8],
    strict: bool,
    outcome: &mut SegmentOutcome,
) -> Result<(Cow<'a, str>, OffsetMap), FormatError> {
    let mut map = OffsetMap {
        base: seg_offset,
        removals: Vec::new(),
    };
    let first_error = match simdutf8::compat::from_utf8(bytes) {
        Ok(s) => return Ok((Cow::Borrowed(s), map)),
        Err(e) => e.valid_up_to(),
    };
    let mut kept: Vec<u8> = Vec::with_capacity(bytes.len());
    let mut pos = 0usize;
    let mut bad = Some(first_error);
    let mut removed_total = 0u64;
    while let Some(bad_at) = bad {
        let offset = seg_offset + bad_at as u64;
        let page_start = memmem::rfind(&bytes[pos..bad_at], b"<page>").map(|i| pos + i);
        let page_end =
            memmem::find(&bytes[bad_at..], b"</page>").map(|i| bad_at + i + "</page>".len());
        let (Some(start), Some(end)) = (page_start, page_end) else {
            return Err(FormatError::InvalidUtf8 {
                path: path.into(),
                offset,
                context: " (outside any page)".into(),
            });
        };
        let title = title_of(&bytes[start..end]);
        if strict {
            return Err(FormatError::InvalidUtf8 {
                path: path.into(),
                offset,
                context: format!(" in page '{title}'"),
            });
        }
        outcome.warnings.push(format!(
            "{}: page '{title}' skipped: invalid UTF-8 at byte offset {offset} of the decompressed XML",
            path.display()
        ));
        outcome.counts.pages_seen += 1;
        outcome.counts.invalid_utf8_pages_skipped += 1;
        outcome.counts.errors += 1;
        kept.extend_from_slice(&bytes[pos..start]);
        removed_total += (end - start) as u64;
        map.removals.push((kept.len(), removed_total));
        pos = end;
        bad = simdutf8::compat::from_utf8(&bytes[pos..])
            .err()
            .map(|e| pos + e.valid_up_to());
    }
    kept.extend_from_slice(&bytes[pos..]);
    let text = String::from_utf8(kept).expect("every invalid range was removed");
    Ok((Cow::Owned(text), map))
}

#[derive(Default)]
struct PageFields<'a> {
    start: usize,
    title: Cow<'a, str>,
    ns: Option<i64>,
    redirect: bool,
    text: Option<Cow<'a, str>>,
}

/// Parses one segment and cleans its articles.
pub fn process_segment(
    path: &Path,
    seg_offset: u64,
    bytes: &[u8],
    options: &WikiOptions,
) -> Result<SegmentOutcome, FormatError> {
    let mut outcome = SegmentOutcome::default();
    outcome.counts.xml_bytes = bytes.len() as u64;
    let (text, map) = drop_invalid_pages(path, seg_offset, bytes, options.strict, &mut outcome)?;
    let xml_error = |pos: u64, message: String| FormatError::Xml {
        path: path.into(),
        offset: map.original(pos as usize),
        message,
    };
    let mut reader = Reader::from_str(&text);
    reader.config_mut().check_end_names = false;
    reader.config_mut().allow_unmatched_ends = true;
    let mut page: Option<PageFields> = None;
    let mut in_revision = false;
    // The dump's first element must be MediaWiki's export root: other XML (an RSS feed, an
    // XHTML page) is refused as not a dump rather than read as one with no pages.
    let mut root_checked = seg_offset != 0;
    let not_a_dump = |name: &str| FormatError::Unsupported {
        path: path.into(),
        message: format!("not a Wikipedia XML dump: the root element is <{name}>, not <mediawiki>"),
    };
    loop {
        let before = reader.buffer_position();
        let event = reader
            .read_event()
            .map_err(|e| xml_error(reader.error_position(), e.to_string()))?;
        if !root_checked && let Event::Start(e) | Event::Empty(e) = &event {
            if e.name().as_ref() != "mediawiki" {
                return Err(not_a_dump(e.name().as_ref()));
            }
            root_checked = true;
        }
        match event {
            Event::Start(e) => {
                let name = e.name();
                match name.as_ref() {
                    "page" => {
                        if let Some(open) = &page {
                            return Err(xml_error(
                                open.start as u64,
                                format!(
                                    "page '{}' is not closed before the next <page>",
                                    open.title
                                ),
                            ));
                        }
                        page = Some(PageFields {
                            start: before as usize,
                            ..Default::default()
                        });
                        in_revision = false;
                    }
                    "siteinfo" => {
                        reader
                            .read_to_end(name)
                            .map_err(|e| xml_error(before, format!("in <siteinfo>: {e}")))?;
                    }
                    "revision" => in_revision = true,
                    "title" | "ns" | "text" => {
                        // The span is in positions of `text`, which is already valid UTF-8.
                        let span = reader.read_to_end(name).map_err(|e| {
                            xml_error(before, format!("in <{}>: {e}", name.as_ref()))
                        })?;
                        let raw = &text[span.start as usize..span.end as usize];
                        let Some(p) = page.as_mut() else { continue };
                        let bad_escape = |e: quick_xml::escape::EscapeError| {
                            xml_error(before, format!("bad escape in <{}>: {e}", name.as_ref()))
                        };
                        let value = quick_xml::escape::unescape(raw).map_err(bad_escape)?;
                        match name.as_ref() {
                            "title" => p.title = value,
                            "ns" => p.ns = value.trim().parse().ok(),
                            _ if in_revision || p.text.is_none() => p.text = Some(value),
                            _ => {}
                        }
                    }
                    "redirect" => {
                        if let Some(p) = page.as_mut() {
                            p.redirect = true;
                        }
                    }
                    _ => {}
                }
            }
            Event::Empty(e) => {
                if e.name().as_ref() == "redirect"
                    && let Some(p) = page.as_mut()
                {
                    p.redirect = true;
                }
            }
            Event::End(e) => match e.name().as_ref() {
                "page" => {
                    let Some(p) = page.take() else {
                        return Err(xml_error(before, "</page> without <page>".into()));
                    };
                    handle_page(p, options, &mut outcome);
                }
                "revision" => in_revision = false,
                "mediawiki" => outcome.saw_root_end = true,
                _ => {}
            },
            Event::Eof => break,
            _ => {}
        }
    }
    if let Some(p) = page {
        return Err(FormatError::Xml {
            path: path.into(),
            offset: map.original(p.start),
            message: format!(
                "truncated XML: page '{}' starting here is not closed",
                p.title
            ),
        });
    }
    Ok(outcome)
}

/// Disambiguation templates (compared case-insensitively on the template name).
fn is_disambiguation(title: &str, wikitext: &str) -> bool {
    if title.ends_with("(disambiguation)") {
        return true;
    }
    let b = wikitext.as_bytes();
    for at in memmem::find_iter(b, b"{{") {
        let rest = &wikitext[at + 2..];
        let end = rest.find(['|', '}']).unwrap_or(rest.len()).min(60);
        let Some(name) = rest.get(..end) else {
            continue;
        };
        let name = name.trim().to_ascii_lowercase();
        if matches!(
            name.as_str(),
            "dab" | "disamb" | "disambig" | "disambiguation" | "hndis" | "geodis" | "numberdis"
        ) || name.ends_with(" disambiguation")
            || name.starts_with("disambiguation ")
        {
            return true;
        }
    }
    false
}

fn handle_page(p: PageFields<'_>, options: &WikiOptions, outcome: &mut SegmentOutcome) {
    let c = &mut outcome.counts;
    c.pages_seen += 1;
    let text = p.text.as_deref().unwrap_or("");
    let text_redirect = text
        .trim_start()
        .get(..9)
        .is_some_and(|s| s.eq_ignore_ascii_case("#redirect"));
    if p.redirect || text_redirect {
        c.redirects_skipped += 1;
        return;
    }
    if p.ns.unwrap_or(0) != 0 {
        c.non_article_pages_skipped += 1;
        return;
    }
    c.articles += 1;
    if !options.keep_disambiguation && is_disambiguation(&p.title, text) {
        c.disambiguation_skipped += 1;
        return;
    }
    let mut stats = CleanStats::default();
    let paragraphs = wikitext_to_paragraphs(text, &options.clean, &mut stats);
    c.unterminated_markup += stats.unterminated;
    c.stray_markup += stats.stray;
    let mut doc = Document::default();
    for paragraph in &paragraphs {
        for sentence in split_sentences(paragraph) {
            doc.push_sentence(sentence);
        }
    }
    if doc.is_empty() {
        c.empty_articles_skipped += 1;
        return;
    }
    c.articles_written += 1;
    c.sentences += doc.sentences;
    c.bytes += doc.written_len();
    outcome.documents.push(doc);
}
