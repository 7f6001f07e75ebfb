//! Reading documents from formatted text: one sentence per line, documents separated by one or
//! more blank lines (a line that is empty or only whitespace). Plain `.txt` or zstd-compressed
//! `.txt.zst` (recognised by the zstd magic number, not the name). Trailing `\r` is removed, so
//! CRLF files read like LF files. A line that is not UTF-8 is an error naming the file and line.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use bertkit_stage_io::HashingReader;

use crate::error::ShardError;

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

/// The first four bytes of a zstd frame.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

impl DocumentReader {
    /// Opens an input (plain or zstd).
    pub fn open(path: &Path) -> Result<Self, ShardError> {
        let mut file = File::open(path).map_err(|e| ShardError::io(path, e))?;
        let mut magic = [0u8; 4];
        let n = file.read(&mut magic).map_err(|e| ShardError::io(path, e))?;
        let hashing = HashingReader::new(File::open(path).map_err(|e| ShardError::io(path, e))?);
        let lines = if n == 4 && magic == ZSTD_MAGIC {
            let decoder =
                zstd::stream::read::Decoder::new(hashing).map_err(|e| ShardError::io(path, e))?;
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
        })
    }

    /// The next document, or `None` at the end of the file.
    pub fn next_document(&mut self) -> Result<Option<Document>, ShardError> {
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
                .map_err(|e| ShardError::io(&self.path, e))?;
            if n == 0 {
                return Ok((doc.sentences > 0).then_some(doc));
            }
            self.line_number += 1;
            let line_offset = self.offset;
            self.offset += n as u64;
            let mut line = self.buf.as_slice();
            while let Some((last, rest)) = line.split_last() {
                if *last == b'\n' || *last == b'\r' {
                    line = rest;
                } else {
                    break;
                }
            }
            if std::str::from_utf8(line).is_err() {
                return Err(ShardError::InvalidUtf8 {
                    path: self.path.clone(),
                    line: self.line_number,
                    offset: line_offset,
                });
            }
            if line.iter().all(u8::is_ascii_whitespace) {
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

    /// Reads to the end of the file and returns the SHA-256 of its (compressed) bytes.
    pub fn finish(self) -> Result<String, ShardError> {
        self.lines
            .into_hashing()
            .finish()
            .map_err(|e| ShardError::io(&self.path, e))
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
            let expected = bertkit_stage_io::hex(&<sha2::Sha256 as sha2::Digest>::digest(
                std::fs::read(path).unwrap(),
            ));
            assert_eq!(sha, expected);
        }
    }

    #[test]
    fn invalid_utf8_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.txt");
        std::fs::write(&path, b"ok\nstill ok\n\nbad \xff here\n").unwrap();
        let mut r = DocumentReader::open(&path).unwrap();
        r.next_document().unwrap();
        let err = r.next_document().unwrap_err();
        assert!(
            matches!(
                err,
                ShardError::InvalidUtf8 {
                    line: 4,
                    offset: 13,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("bad.txt: line 4"));
    }
}
