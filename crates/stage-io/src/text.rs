//! Reading documents from formatted text, the hand-off format of the format, shard and records
//! stages: one sentence per line, documents separated by one or
//! more blank lines (a line that is empty or only whitespace). Plain `.txt` or zstd-compressed
//! `.txt.zst` (recognised by the zstd magic number, not the name). Trailing `\r` is removed, so
//! CRLF files read like LF files. A line that is not UTF-8 is an error naming the file and line,
//! and so is a NUL byte: UTF-8 allows it, but no text holds one, and a UTF-16 file (ASCII text
//! with a NUL beside every letter) would otherwise read as text with its NULs dropped by the
//! tokenizer.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::HashingReader;

/// Why formatted text could not be read.
#[derive(Debug)]
pub enum TextError {
    /// Reading a file failed.
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Compressed input that does not decode: corrupt, or cut short (an interrupted copy).
    Decompress {
        /// The input.
        path: PathBuf,
        /// Bytes of text decoded before the error.
        offset: u64,
        /// The decoder's error.
        source: std::io::Error,
    },
    /// A line is not UTF-8.
    InvalidUtf8 {
        /// The input.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// Byte offset of the line's start in the (decompressed) text.
        offset: u64,
    },
    /// A line holds a NUL byte: not text (UTF-16, or a binary file).
    Nul {
        /// The input.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// Byte offset of the NUL in the (decompressed) text.
        offset: u64,
    },
    /// No input file was found.
    NoInputs,
}

/// What a NUL byte in a text file most likely means, and what to do.
pub const NUL_HINT: &str = "not text: a binary file, or UTF-16 (convert that first, e.g. `iconv \
                            -f UTF-16 -t UTF-8 IN > OUT`)";

/// What a reader says of a NUL byte at (1-based) `line`, byte `offset` (`of` what the offset
/// counts in, e.g. ` of the decompressed text`, or empty).
pub fn nul_message(line: u64, offset: u64, of: &str) -> String {
    format!("line {line} holds a NUL byte (byte offset {offset}{of}): {NUL_HINT}")
}

/// Where a NUL byte in `text` is, if any: as (1-based line, byte offset).
pub fn find_nul(text: &[u8]) -> Option<(u64, u64)> {
    let at = memchr::memchr(0, text)?;
    let line = 1 + memchr::memchr_iter(b'\n', &text[..at]).count() as u64;
    Some((line, at as u64))
}

impl std::fmt::Display for TextError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TextError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            TextError::Decompress {
                path,
                offset,
                source,
            } => write!(
                f,
                "{}: zstd data is corrupt or truncated after byte offset {offset} of the \
                 decompressed text: {source}",
                path.display()
            ),
            TextError::InvalidUtf8 { path, line, offset } => write!(
                f,
                "{}: line {line} (byte offset {offset} of the decompressed text) is not valid UTF-8",
                path.display()
            ),
            TextError::Nul { path, line, offset } => write!(
                f,
                "{}: {}",
                path.display(),
                nul_message(*line, *offset, " of the decompressed text")
            ),
            TextError::NoInputs => {
                f.write_str("no input files: give .txt or .txt.zst files or folders holding them")
            }
        }
    }
}

impl std::error::Error for TextError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TextError::Io { source, .. } | TextError::Decompress { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl TextError {
    fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TextError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Expands folders into their `.txt` and `.txt.zst` files (sorted, hidden files skipped);
/// files are kept as given. No file at all is an error.
pub fn expand_text_inputs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, TextError> {
    let files = crate::expand_inputs(inputs, |name| {
        name.ends_with(".txt") || name.ends_with(".txt.zst")
    })
    .map_err(|(path, e)| TextError::io(path, e))?;
    if files.is_empty() {
        return Err(TextError::NoInputs);
    }
    Ok(files)
}

/// One document: its sentences, each followed by `\n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// The sentences, one per line, each ending in `\n`.
    pub text: Vec<u8>,
    /// Number of lines.
    pub sentences: u32,
}

/// Streams the documents of one input file.
pub struct DocumentReader {
    path: PathBuf,
    lines: Lines,
    line_number: u64,
    offset: u64,
    buf: Vec<u8>,
    /// The file's size when it is plain text.
    plain_size: Option<u64>,
}

/// The decoded text of an input, with the hashing reader underneath.
enum Lines {
    Plain(BufReader<HashingReader<File>>),
    Zstd(BufReader<zstd::stream::read::Decoder<'static, BufReader<HashingReader<File>>>>),
}

impl Lines {
    fn reader(&mut self) -> &mut dyn BufRead {
        match self {
            Lines::Plain(r) => r,
            Lines::Zstd(r) => r,
        }
    }

    fn into_hashing(self) -> HashingReader<File> {
        match self {
            Lines::Plain(r) => r.into_inner(),
            Lines::Zstd(r) => r.into_inner().finish().into_inner(),
        }
    }
}

/// A line without its line break (a trailing `\r` or `\n`, any number of them).
fn trim_line_end(mut line: &[u8]) -> &[u8] {
    while let Some((last, rest)) = line.split_last() {
        if *last == b'\n' || *last == b'\r' {
            line = rest;
        } else {
            break;
        }
    }
    line
}

/// Whether a line is blank (empty or only ASCII whitespace): a document boundary.
pub fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

/// The lines of a text read whole ([`DocumentReader::read_text`]), line breaks removed:
/// `Some(sentence)`, or `None` for a blank line (a document boundary), as
/// [`DocumentReader::next_document`] reads them.
pub fn lines(text: &str) -> impl Iterator<Item = Option<&str>> + '_ {
    text.split_terminator('\n').map(|line| {
        // (A piece holds no `\n`: what `trim_line_end` strips here is the `\r`s.)
        let line = line.trim_end_matches('\r');
        (!is_blank(line.as_bytes())).then_some(line)
    })
}

/// An input's whole text ([`DocumentReader::whole_text`]): a plain file mapped into memory,
/// or a compressed one read into a buffer. Valid UTF-8 either way.
pub struct WholeText<'a>(WholeTextInner<'a>);

enum WholeTextInner<'a> {
    /// Checked to be UTF-8 when mapped.
    Mapped(memmap2::Mmap),
    Read(&'a str),
}

impl WholeText<'_> {
    /// The text.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            // SAFETY: checked to be UTF-8 when mapped, and the map is read-only.
            WholeTextInner::Mapped(map) => unsafe { std::str::from_utf8_unchecked(map) },
            WholeTextInner::Read(text) => text,
        }
    }
}

/// The first four bytes of a zstd frame.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

impl DocumentReader {
    /// Opens an input (plain or zstd).
    pub fn open(path: &Path) -> Result<Self, TextError> {
        let mut file = File::open(path).map_err(|e| TextError::io(path, e))?;
        let mut magic = [0u8; 4];
        let n = file.read(&mut magic).map_err(|e| TextError::io(path, e))?;
        let hashing = HashingReader::new(File::open(path).map_err(|e| TextError::io(path, e))?);
        let zstd = n == 4 && magic == ZSTD_MAGIC;
        let plain_size = if zstd {
            None
        } else {
            file.metadata().ok().map(|m| m.len())
        };
        let lines = if zstd {
            let decoder =
                zstd::stream::read::Decoder::new(hashing).map_err(|e| TextError::io(path, e))?;
            Lines::Zstd(BufReader::with_capacity(1 << 20, decoder))
        } else {
            Lines::Plain(BufReader::with_capacity(1 << 20, hashing))
        };
        Ok(DocumentReader {
            path: path.to_path_buf(),
            lines,
            line_number: 0,
            offset: 0,
            buf: Vec::new(),
            plain_size,
        })
    }

    /// The next document, or `None` at the end of the file.
    pub fn next_document(&mut self) -> Result<Option<Document>, TextError> {
        let mut doc = Document {
            text: Vec::new(),
            sentences: 0,
        };
        loop {
            self.buf.clear();
            let n = self
                .lines
                .reader()
                .read_until(b'\n', &mut self.buf)
                .map_err(|e| self.read_error(self.offset, e))?;
            if n == 0 {
                return Ok((doc.sentences > 0).then_some(doc));
            }
            self.line_number += 1;
            let line_offset = self.offset;
            self.offset += n as u64;
            let line = trim_line_end(self.buf.as_slice());
            if let Some(at) = memchr::memchr(0, line) {
                return Err(TextError::Nul {
                    path: self.path.clone(),
                    line: self.line_number,
                    offset: line_offset + at as u64,
                });
            }
            if std::str::from_utf8(line).is_err() {
                return Err(TextError::InvalidUtf8 {
                    path: self.path.clone(),
                    line: self.line_number,
                    offset: line_offset,
                });
            }
            if is_blank(line) {
                if doc.sentences > 0 {
                    return Ok(Some(doc));
                }
                continue;
            }
            doc.text.extend_from_slice(line);
            doc.text.push(b'\n');
            doc.sentences += 1;
        }
    }

    /// Reads the rest of the input at once: its decoded text, checked to be UTF-8 (the error
    /// names the first bad line), and the SHA-256 of the file's (compressed) bytes. For callers
    /// that hold a whole shard anyway: one read and one UTF-8 check instead of a copy per line;
    /// [`lines`] then walks it as [`DocumentReader::next_document`] would.
    pub fn read_text(self) -> Result<(String, String), TextError> {
        let mut text = String::new();
        let sha256 = self.read_text_into(&mut text)?;
        Ok((text, sha256))
    }

    /// [`DocumentReader::read_text`] into `text` (replacing what it held, reusing its buffer:
    /// a caller reading several files touches fresh memory once); returns the SHA-256.
    pub fn read_text_into(mut self, text: &mut String) -> Result<String, TextError> {
        let mut bytes = std::mem::take(text).into_bytes();
        bytes.clear();
        // A plain file's text is its size: read into room for exactly that (growing by
        // doubling would copy it into fresh pages several times).
        bytes.reserve(self.plain_size.map_or(0, |n| n as usize + 1));
        if let Err(e) = self.lines.reader().read_to_end(&mut bytes) {
            return Err(self.read_error(self.offset + bytes.len() as u64, e));
        }
        if let Some(e) = self.nul_error(&bytes) {
            return Err(e);
        }
        *text = match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => return Err(self.utf8_error(&e.as_bytes()[..e.utf8_error().valid_up_to()])),
        };
        self.finish()
    }

    /// The error for a read that failed after `decoded` bytes of text: the decoder's, for
    /// compressed input, with where it stopped.
    fn read_error(&self, decoded: u64, source: std::io::Error) -> TextError {
        match self.lines {
            Lines::Zstd(_) => TextError::Decompress {
                path: self.path.clone(),
                offset: decoded,
                source,
            },
            Lines::Plain(_) => TextError::io(&self.path, source),
        }
    }

    /// The error for a NUL byte in `text` (read from where the reader stands), if it holds one.
    fn nul_error(&self, text: &[u8]) -> Option<TextError> {
        let (line, at) = find_nul(text)?;
        Some(TextError::Nul {
            path: self.path.clone(),
            line: self.line_number + line,
            offset: self.offset + at,
        })
    }

    /// The error for text that is valid UTF-8 up to the end of `valid` (read from where the
    /// reader stands): it names the line and the offset where that line starts.
    fn utf8_error(&self, valid: &[u8]) -> TextError {
        let line_start = valid.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let newlines = valid.iter().filter(|&&b| b == b'\n').count() as u64;
        TextError::InvalidUtf8 {
            path: self.path.clone(),
            line: self.line_number + newlines + 1,
            offset: self.offset + line_start as u64,
        }
    }

    /// The whole text of the input, checked to be UTF-8 as [`DocumentReader::read_text_into`]
    /// checks it, with the SHA-256 of the file's bytes. A plain file is memory-mapped instead
    /// of read: no copy, and the kernel maps its cached pages many at a time, where reading
    /// into fresh memory faults in one page at a time (about 4 ms for a 5 MB shard on a
    /// 2-core VM). A compressed file, or one already partly read, is read into `buffer`.
    ///
    /// The map assumes the file does not change while it is in use (as with any input of a
    /// running stage): a file truncated meanwhile can stop the process.
    pub fn whole_text(self, buffer: &mut String) -> Result<(WholeText<'_>, String), TextError> {
        if self.plain_size.is_some_and(|n| n > 0) && self.line_number == 0 {
            let file = File::open(&self.path).map_err(|e| TextError::io(&self.path, e))?;
            // SAFETY: the map is read-only, and the caller's inputs are not written while the
            // stage runs (see above).
            let map =
                unsafe { memmap2::Mmap::map(&file) }.map_err(|e| TextError::io(&self.path, e))?;
            if let Some(e) = self.nul_error(&map) {
                return Err(e);
            }
            // A SIMD check first (several times faster); std's finds where a bad text goes bad.
            if simdutf8::basic::from_utf8(&map).is_err() {
                let valid_up_to =
                    std::str::from_utf8(&map).map_or_else(|e| e.valid_up_to(), str::len);
                return Err(self.utf8_error(&map[..valid_up_to]));
            }
            use sha2::Digest;
            let sha256 = crate::hex(&sha2::Sha256::digest(&map[..]));
            return Ok((WholeText(WholeTextInner::Mapped(map)), sha256));
        }
        let sha256 = self.read_text_into(buffer)?;
        Ok((WholeText(WholeTextInner::Read(buffer.as_str())), sha256))
    }

    /// Reads to the end of the file and returns the SHA-256 of its (compressed) bytes.
    pub fn finish(self) -> Result<String, TextError> {
        self.lines
            .into_hashing()
            .finish()
            .map_err(|e| TextError::io(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(path: &Path) -> Vec<Document> {
        let mut r = DocumentReader::open(path).unwrap();
        let mut docs = Vec::new();
        while let Some(d) = r.next_document().unwrap() {
            docs.push(d);
        }
        docs
    }

    #[test]
    fn documents_plain_and_zstd_with_crlf_and_blank_runs() {
        let dir = tempfile::tempdir().unwrap();
        let text = b"\n\nA one.\r\nA two.\r\n\r\n\r\n  \nB one.\nB two.\nB three.";
        let plain = dir.path().join("a.txt");
        std::fs::write(&plain, text).unwrap();
        let zst = dir.path().join("a.txt.zst");
        std::fs::write(&zst, zstd::encode_all(&text[..], 3).unwrap()).unwrap();
        for path in [&plain, &zst] {
            let docs = read_all(path);
            assert_eq!(docs.len(), 2);
            assert_eq!(docs[0].text, b"A one.\nA two.\n");
            assert_eq!(docs[1].sentences, 3);
            let mut r = DocumentReader::open(path).unwrap();
            while r.next_document().unwrap().is_some() {}
            let sha = r.finish().unwrap();
            let expected = crate::hex(&<sha2::Sha256 as sha2::Digest>::digest(
                std::fs::read(path).unwrap(),
            ));
            assert_eq!(sha, expected);
            // Read whole, then split into lines: the same documents and the same hash.
            let (whole, sha_whole) = DocumentReader::open(path).unwrap().read_text().unwrap();
            assert_eq!(sha_whole, expected);
            assert_eq!(documents_of_lines(&whole), docs);
            // Mapped (plain) or read (zstd) whole: the same.
            let mut buffer = String::new();
            let (text, sha_text) = DocumentReader::open(path)
                .unwrap()
                .whole_text(&mut buffer)
                .unwrap();
            assert_eq!(
                (text.as_str(), sha_text.as_str()),
                (whole.as_str(), &*expected)
            );
        }
    }

    /// Documents made from [`lines`], as `next_document` makes them.
    fn documents_of_lines(text: &str) -> Vec<Document> {
        let mut docs = Vec::new();
        let mut doc = Document {
            text: Vec::new(),
            sentences: 0,
        };
        for line in lines(text).chain([None]) {
            match line {
                Some(line) => {
                    doc.text.extend_from_slice(line.as_bytes());
                    doc.text.push(b'\n');
                    doc.sentences += 1;
                }
                None if doc.sentences > 0 => docs.push(std::mem::replace(
                    &mut doc,
                    Document {
                        text: Vec::new(),
                        sentences: 0,
                    },
                )),
                None => {}
            }
        }
        docs
    }

    /// A NUL byte is refused with its line and offset by each way of reading, plain or
    /// compressed: line by line, read whole, mapped whole; and by `read_text`.
    #[test]
    fn a_nul_byte_is_named_by_every_reader() {
        let dir = tempfile::tempdir().unwrap();
        let text = b"one\n\ntwo t\0o\n";
        let plain = dir.path().join("t.txt");
        std::fs::write(&plain, text).unwrap();
        let packed = dir.path().join("t.txt.zst");
        std::fs::write(&packed, zstd::encode_all(&text[..], 3).unwrap()).unwrap();
        let is_nul = |e: TextError| {
            assert!(
                matches!(
                    e,
                    TextError::Nul {
                        line: 3,
                        offset: 10,
                        ..
                    }
                ),
                "{e:?}"
            );
            assert!(e.to_string().contains("or UTF-16"), "{e}");
        };
        for path in [&plain, &packed] {
            let mut reader = DocumentReader::open(path).unwrap();
            assert!(reader.next_document().unwrap().is_some());
            is_nul(reader.next_document().unwrap_err());
            is_nul(DocumentReader::open(path).unwrap().read_text().unwrap_err());
            let mut buffer = String::new();
            let whole = DocumentReader::open(path).unwrap().whole_text(&mut buffer);
            is_nul(whole.err().unwrap());
        }
        let err = crate::read_text(&plain).unwrap_err().to_string();
        assert!(
            err.contains("line 3 holds a NUL byte (byte offset 10)"),
            "{err}"
        );
    }

    #[test]
    fn whole_text_lines_equal_streamed_documents() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.txt");
        let texts: [&[u8]; 6] = [
            b"",
            b"one line without a break",
            b"a\r\r\n\t \n\nb\n\r\nc\n",
            b"\n\n\n",
            b"x\n \x0b\ny\n",
            "caf\u{e9}\n\u{a0}\nna\u{ef}ve\n".as_bytes(),
        ];
        for text in texts {
            std::fs::write(&path, text).unwrap();
            let streamed = read_all(&path);
            let (whole, _) = DocumentReader::open(&path).unwrap().read_text().unwrap();
            assert_eq!(documents_of_lines(&whole), streamed, "{text:?}");
            // The mapped text (the read one for the empty file, which cannot be mapped).
            let mut buffer = String::new();
            let reader = DocumentReader::open(&path).unwrap();
            let (mapped, _) = reader.whole_text(&mut buffer).unwrap();
            assert_eq!(mapped.as_str(), whole, "{text:?}");
        }
    }

    #[test]
    fn invalid_utf8_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.txt");
        std::fs::write(&path, b"ok\nstill ok\n\nbad \xff here\n").unwrap();
        let mut r = DocumentReader::open(&path).unwrap();
        r.next_document().unwrap();
        let streamed = r.next_document().unwrap_err();
        assert!(streamed.to_string().contains("bad.txt: line 4"));
        // Read whole, the same line and offset.
        let whole = DocumentReader::open(&path)
            .unwrap()
            .read_text()
            .unwrap_err();
        let mapped = DocumentReader::open(&path)
            .unwrap()
            .whole_text(&mut String::new())
            .err()
            .unwrap();
        for err in [streamed, whole, mapped] {
            assert!(
                matches!(
                    err,
                    TextError::InvalidUtf8 {
                        line: 4,
                        offset: 13,
                        ..
                    }
                ),
                "{err}"
            );
        }
    }
}
