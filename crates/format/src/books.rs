//! Project Gutenberg books to formatted text: one book, one document.
//!
//! For each book (a `.txt` file; directories are expanded to their `.txt` files, sorted):
//! - bytes: a UTF-8 byte-order mark is dropped; a file that is not UTF-8 is read as
//!   Windows-1252/Latin-1 (older Gutenberg files are) and counted in `latin1_fallbacks`;
//!   CRLF and CR line ends become LF;
//! - the Project Gutenberg licence header and footer are cut: everything up to the
//!   `*** START OF THE/THIS PROJECT GUTENBERG EBOOK … ***` line (or the older
//!   `*END*THE SMALL PRINT!` line) and from the `*** END OF …` line or an
//!   `End of (the) Project Gutenberg…` line on;
//! - paragraphs are blocks separated by blank lines; hard-wrapped lines are re-joined with a
//!   space (without one after a line ending in `--` or a hyphenated word part);
//! - dropped: bracketed blocks and lines (`[Emma by Jane Austen 1816]`, `[Illustration: …]`),
//!   `[Illustration…]`/`[Footnote…]` marks inside paragraphs, headings (blocks without a
//!   lower-case letter, such as `CHAPTER I` or `THE TWO POETS OF SAFFRON PARK`, and short
//!   blocks starting with Chapter/Book/Part/Volume/Section), the short title line that follows a
//!   chapter heading (`Loomings.`), and `_` emphasis marks;
//! - each paragraph is split into sentences.
//!
//! Memory: one book per worker thread is held at a time.

use std::fs;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::FormatError;
use crate::output::{Document, hex};
use bertkit_stage_io::stage::{Outcome, Reporter};

use crate::manifest::FormatManifest;
use crate::progress::Snapshot;
use crate::run::Run;
use crate::sentences::split_sentences;
use crate::spacing::normalise_spacing;

/// Name prefix of books output files and manifest.
pub const KIND: &str = "books";

/// Options of a books run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookOptions {
    /// Largest output file, in bytes.
    pub max_bytes: u64,
    /// Worker threads (0: one per core).
    #[serde(skip)]
    pub threads: usize,
}

impl Default for BookOptions {
    fn default() -> Self {
        BookOptions {
            max_bytes: crate::DEFAULT_MAX_BYTES,
            threads: 0,
        }
    }
}

/// Counters of a books run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookCounts {
    /// Book files read.
    pub books_seen: u64,
    /// Books written as documents.
    pub books_written: u64,
    /// Books with no text left (skipped).
    pub empty_books_skipped: u64,
    /// Books whose Gutenberg licence header or footer was cut.
    pub license_blocks_stripped: u64,
    /// Books read as Latin-1 because they are not UTF-8.
    pub latin1_fallbacks: u64,
    /// Files skipped because they are not text (they hold a NUL byte: an image, an archive,
    /// UTF-16), which Latin-1 would otherwise turn into a document of noise.
    #[serde(default)]
    pub binary_skipped: u64,
    /// Heading, title and marker blocks dropped.
    pub blocks_dropped: u64,
    /// Paragraphs kept.
    pub paragraphs: u64,
    /// Sentences written.
    pub sentences: u64,
    /// Bytes of text written.
    pub bytes: u64,
    /// Bytes of input read.
    pub input_bytes: u64,
    /// Items skipped because of bad input (none so far: every file is readable as Latin-1).
    pub errors: u64,
}

impl BookCounts {
    fn add(&mut self, o: &BookCounts) {
        self.books_seen += o.books_seen;
        self.books_written += o.books_written;
        self.empty_books_skipped += o.empty_books_skipped;
        self.license_blocks_stripped += o.license_blocks_stripped;
        self.latin1_fallbacks += o.latin1_fallbacks;
        self.binary_skipped += o.binary_skipped;
        self.blocks_dropped += o.blocks_dropped;
        self.paragraphs += o.paragraphs;
        self.sentences += o.sentences;
        self.bytes += o.bytes;
        self.input_bytes += o.input_bytes;
        self.errors += o.errors;
    }
}

/// Expands directories into their `.txt` files (sorted), keeping files as given.
pub fn expand_inputs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, FormatError> {
    let files = bertkit_stage_io::expand_inputs(inputs, |name| {
        std::path::Path::new(name)
            .extension()
            .is_some_and(|x| x.eq_ignore_ascii_case("txt"))
    })
    .map_err(|(path, e)| FormatError::io(path, e))?;
    if files.is_empty() {
        return Err(FormatError::Usage(
            "no book files found in the inputs".into(),
        ));
    }
    Ok(files)
}

/// Formats books into `output_dir/books_NNNNN.txt` and `output_dir/books.manifest.json`.
pub fn format_books(
    inputs: &[PathBuf],
    output_dir: &Path,
    options: &BookOptions,
    reporter: &dyn Reporter,
) -> Result<Outcome<FormatManifest>, FormatError> {
    let files = expand_inputs(inputs)?;
    let parameters = serde_json::to_value(options).expect("options serialise");
    let mut run = match Run::begin(
        KIND,
        &files,
        output_dir,
        parameters,
        options.threads,
        options.max_bytes,
    )? {
        Ok(run) => run,
        Err(up_to_date) => return Ok(Outcome::UpToDate(up_to_date)),
    };
    let mut counts = BookCounts::default();
    let per_batch = run.threads.max(1);
    for (batch_index, batch) in files.chunks(per_batch).enumerate() {
        // Each book's document, counts, SHA-256 and first NUL byte (a file that is not text).
        type Read = (Document, BookCounts, String, Option<usize>);
        let results: Vec<Result<Read, FormatError>> = run.pool.install(|| {
            batch
                .par_iter()
                .map(|path| {
                    let bytes = fs::read(path).map_err(|e| FormatError::io(path, e))?;
                    let sha = hex(&Sha256::digest(&bytes));
                    let (doc, c) = format_book(&bytes);
                    Ok((doc, c, sha, memchr::memchr(0, &bytes)))
                })
                .collect()
        });
        for (i, result) in results.into_iter().enumerate() {
            let (doc, c, sha, nul) = result?;
            let index = batch_index * per_batch + i;
            run.inputs[index].sha256 = sha;
            if let Some(nul) = nul {
                run.warn(
                    reporter,
                    format!(
                        "{}: not text (a NUL byte at byte offset {nul}); skipped",
                        files[index].display()
                    ),
                );
            } else if c.latin1_fallbacks > 0 {
                run.warn(
                    reporter,
                    format!("{}: not UTF-8; read as Latin-1", files[index].display()),
                );
            }
            if c.empty_books_skipped > 0 {
                run.warn(
                    reporter,
                    format!(
                        "{}: no text left after cleaning; skipped",
                        files[index].display()
                    ),
                );
            }
            run.writer.write(&doc)?;
            counts.add(&c);
        }
        Snapshot {
            input: ((batch_index + 1) * per_batch).min(files.len()) - 1,
            inputs: files.len(),
            items: counts.books_seen,
            unit: "books",
            documents: counts.books_written,
            input_bytes: counts.input_bytes,
            output_bytes: counts.bytes,
        }
        .report(reporter);
    }
    run.finish(counts)
}

/// Decodes a book's bytes: UTF-8 (BOM dropped) or, failing that, Windows-1252/Latin-1.
fn decode(bytes: &[u8], counts: &mut BookCounts) -> String {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => {
            counts.latin1_fallbacks += 1;
            bytes.iter().map(|&b| windows_1252(b)).collect()
        }
    }
}

/// Windows-1252 (a superset of Latin-1's printable range) to Unicode.
fn windows_1252(b: u8) -> char {
    const HIGH: [char; 32] = [
        '€', '\u{81}', '‚', 'ƒ', '„', '…', '†', '‡', 'ˆ', '‰', 'Š', '‹', 'Œ', '\u{8D}', 'Ž',
        '\u{8F}', '\u{90}', '‘', '’', '“', '”', '•', '–', '—', '˜', '™', 'š', '›', 'œ', '\u{9D}',
        'ž', 'Ÿ',
    ];
    match b {
        0x80..=0x9F => HIGH[(b - 0x80) as usize],
        _ => b as char,
    }
}

/// Cuts the Project Gutenberg licence header and footer, if present.
fn strip_license(text: &str, counts: &mut BookCounts) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let is_start = |l: &str| {
        let u = l.trim().to_ascii_uppercase();
        (u.starts_with("***") && u.contains("START OF") && u.contains("PROJECT GUTENBERG"))
            || u.starts_with("*END*THE SMALL PRINT")
    };
    let is_end = |l: &str| {
        let u = l.trim().to_ascii_uppercase();
        (u.starts_with("***") && u.contains("END OF") && u.contains("PROJECT GUTENBERG"))
            || u.starts_with("END OF THE PROJECT GUTENBERG")
            || u.starts_with("END OF PROJECT GUTENBERG")
    };
    let start = lines.iter().position(|l| is_start(l)).map_or(0, |i| i + 1);
    let end = lines[start..]
        .iter()
        .position(|l| is_end(l))
        .map_or(lines.len(), |i| start + i);
    if start > 0 || end < lines.len() {
        counts.license_blocks_stripped += 1;
    }
    lines[start..end].join("\n")
}

fn is_heading_word(w: &str) -> bool {
    [
        "chapter", "book", "part", "volume", "section", "canto", "act", "scene", "letter",
    ]
    .iter()
    .any(|h| w.eq_ignore_ascii_case(h))
}

/// Removes `[Illustration…]`, `[Footnote…]` and `[Sidenote…]` marks inside a paragraph.
fn strip_marks(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    let mut rest = p;
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        let is_mark = ["Illustration", "Footnote", "Sidenote", "Transcriber"]
            .iter()
            .any(|m| after.starts_with(m));
        match after.find(']') {
            Some(close) if is_mark => {
                out.push_str(&rest[..open]);
                rest = &after[close + 1..];
            }
            _ => {
                out.push_str(&rest[..open + 1]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Formats one book's bytes into a document.
pub fn format_book(bytes: &[u8]) -> (Document, BookCounts) {
    let mut counts = BookCounts {
        books_seen: 1,
        input_bytes: bytes.len() as u64,
        ..Default::default()
    };
    if memchr::memchr(0, bytes).is_some() {
        counts.binary_skipped = 1;
        return (Document::default(), counts);
    }
    let text = decode(bytes, &mut counts)
        .replace("\r\n", "\n")
        .replace('\r', "\n");
    let text = strip_license(&text, &mut counts);
    let mut doc = Document::default();
    let mut after_chapter_heading = false;
    for block in text.split("\n\n").map(str::trim).filter(|b| !b.is_empty()) {
        let mut lines: Vec<&str> = block
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        // A bracketed line inside a block (`[To Mrs. Weston.]` above a letter) is a marker too.
        if lines.len() > 1 {
            let before = lines.len();
            lines.retain(|l| !(l.starts_with('[') && l.ends_with(']')));
            counts.blocks_dropped += (before - lines.len()) as u64;
        }
        let mut joined = String::with_capacity(block.len());
        for line in &lines {
            let glue = joined.ends_with("--")
                || (joined.ends_with('-')
                    && joined[..joined.len() - 1].ends_with(|c: char| c.is_alphabetic()));
            if !joined.is_empty() && !glue {
                joined.push(' ');
            }
            joined.push_str(line);
        }
        let words = joined.split_whitespace().count();
        let bracketed = joined.starts_with('[') && joined.ends_with(']');
        let no_lowercase = !joined.chars().any(char::is_lowercase);
        let first_word = joined.split_whitespace().next().unwrap_or("");
        let chapter_heading =
            words <= 8 && is_heading_word(first_word.trim_end_matches(['.', ':']));
        let chapter_title = after_chapter_heading
            && lines.len() == 1
            && words <= 6
            && !joined.starts_with(['"', '\'', '“', '‘']);
        after_chapter_heading = chapter_heading || (after_chapter_heading && no_lowercase);
        if bracketed || no_lowercase || chapter_heading || chapter_title {
            counts.blocks_dropped += 1;
            continue;
        }
        let cleaned = normalise_spacing(&strip_marks(&joined).replace('_', ""));
        if cleaned.is_empty() {
            continue;
        }
        counts.paragraphs += 1;
        for sentence in split_sentences(&cleaned) {
            doc.push_sentence(sentence);
        }
    }
    if doc.is_empty() {
        counts.empty_books_skipped += 1;
    } else {
        counts.books_written += 1;
        counts.sentences += doc.sentences;
        counts.bytes += doc.written_len();
    }
    (doc, counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn license_headings_wrapping_and_marks() {
        let book = "\u{FEFF}The Project Gutenberg EBook of X\r\n\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n\r\n\
                    [Illustration: a ship]\r\n\r\nCHAPTER 1\r\n\r\nLoomings.\r\n\r\nCall me Ishmael. Some years\r\nago--never mind \
                    how long--I went to\r\nsea. It was _very_ wet [Illustration] indeed.\r\n\r\nTHE END\r\n\r\n\
                    *** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nLicence text here.\r\n";
        let (doc, counts) = format_book(book.as_bytes());
        assert_eq!(
            doc.text,
            "Call me Ishmael.\nSome years ago--never mind how long--I went to sea.\nIt was very wet indeed.\n"
        );
        assert_eq!(counts.license_blocks_stripped, 1);
        assert_eq!(counts.blocks_dropped, 4);
    }

    #[test]
    fn latin1_is_decoded() {
        let (doc, counts) = format_book(b"Caf\xe9 au lait is \x93good\x94.");
        assert_eq!(doc.text, "Café au lait is “good”.\n");
        assert_eq!(counts.latin1_fallbacks, 1);
    }
}
