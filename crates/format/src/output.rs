//! Writing formatted text: numbered files of at most `max_bytes`, written atomically.
//!
//! Each file is written as a hidden `.NAME.partial` and renamed to `NAME` only when the whole
//! run succeeds ([`ShardedTextWriter::commit`]), so an interrupted run never leaves a file that
//! looks finished. Documents are never split across files; a single document larger than
//! `max_bytes` gets a file of its own (the only way a file exceeds the limit).

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::FormatError;
use crate::manifest::OutputFile;

/// One formatted document: its sentences, each followed by `\n`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Document {
    /// Sentences, one per line, each line ending in `\n`.
    pub text: String,
    /// Number of lines in `text`.
    pub sentences: u64,
}

impl Document {
    /// Builds a document from sentences (none may contain a newline).
    pub fn from_sentences<'a>(sentences: impl IntoIterator<Item = &'a str>) -> Self {
        let mut doc = Document::default();
        for s in sentences {
            doc.push_sentence(s);
        }
        doc
    }

    /// Appends one sentence as a line.
    pub fn push_sentence(&mut self, sentence: &str) {
        debug_assert!(!sentence.contains('\n'));
        self.text.push_str(sentence);
        self.text.push('\n');
        self.sentences += 1;
    }

    /// Whether the document has no sentence.
    pub fn is_empty(&self) -> bool {
        self.sentences == 0
    }

    /// Bytes this document takes in a file, with its separating blank line.
    pub fn written_len(&self) -> u64 {
        self.text.len() as u64 + 1
    }
}

struct OpenFile {
    name: String,
    partial: PathBuf,
    out: BufWriter<File>,
    hasher: Sha256,
    bytes: u64,
    documents: u64,
    sentences: u64,
}

/// Writes documents into `PREFIX_00000.txt`, `PREFIX_00001.txt`, … in a directory.
pub struct ShardedTextWriter {
    dir: PathBuf,
    prefix: String,
    max_bytes: u64,
    current: Option<OpenFile>,
    done: Vec<(PathBuf, OutputFile)>,
    committed: bool,
}

impl ShardedTextWriter {
    /// Starts writing into `dir` (created if needed). Leftover `.partial` files of an
    /// interrupted run with the same prefix are removed.
    pub fn new(dir: &Path, prefix: &str, max_bytes: u64) -> Result<Self, FormatError> {
        if max_bytes == 0 {
            return Err(FormatError::Usage("--max-bytes must be at least 1".into()));
        }
        fs::create_dir_all(dir).map_err(|e| FormatError::io(dir, e))?;
        for entry in fs::read_dir(dir).map_err(|e| FormatError::io(dir, e))? {
            let entry = entry.map_err(|e| FormatError::io(dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!(".{prefix}_")) && name.ends_with(".partial") {
                fs::remove_file(entry.path()).map_err(|e| FormatError::io(entry.path(), e))?;
            }
        }
        Ok(ShardedTextWriter {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            max_bytes,
            current: None,
            done: Vec::new(),
            committed: false,
        })
    }

    /// Appends a document (and the blank line after it). Empty documents are ignored.
    pub fn write(&mut self, doc: &Document) -> Result<(), FormatError> {
        if doc.is_empty() {
            return Ok(());
        }
        let len = doc.written_len();
        if let Some(cur) = &self.current
            && cur.bytes > 0
            && cur.bytes + len > self.max_bytes
        {
            self.close_current()?;
        }
        if self.current.is_none() {
            let name = format!("{}_{:05}.txt", self.prefix, self.done.len());
            let partial = self.dir.join(format!(".{name}.partial"));
            let file = File::create(&partial).map_err(|e| FormatError::io(&partial, e))?;
            self.current = Some(OpenFile {
                name,
                partial,
                out: BufWriter::with_capacity(1 << 20, file),
                hasher: Sha256::new(),
                bytes: 0,
                documents: 0,
                sentences: 0,
            });
        }
        let cur = self.current.as_mut().expect("opened above");
        for chunk in [doc.text.as_bytes(), b"\n"] {
            cur.out
                .write_all(chunk)
                .map_err(|e| FormatError::io(&cur.partial, e))?;
            cur.hasher.update(chunk);
        }
        cur.bytes += len;
        cur.documents += 1;
        cur.sentences += doc.sentences;
        Ok(())
    }

    fn close_current(&mut self) -> Result<(), FormatError> {
        if let Some(cur) = self.current.take() {
            let file = cur
                .out
                .into_inner()
                .map_err(|e| FormatError::io(&cur.partial, e.into_error()))?;
            file.sync_all()
                .map_err(|e| FormatError::io(&cur.partial, e))?;
            let info = OutputFile {
                file: cur.name,
                bytes: cur.bytes,
                sha256: hex(&cur.hasher.finalize()),
                documents: cur.documents,
                sentences: cur.sentences,
            };
            self.done.push((cur.partial, info));
        }
        Ok(())
    }

    /// Renames every file into place and removes files of this prefix that an earlier run wrote
    /// but this one did not (so a rebuild with fewer files leaves no stale ones).
    pub fn commit(mut self) -> Result<Vec<OutputFile>, FormatError> {
        self.close_current()?;
        let mut files = Vec::with_capacity(self.done.len());
        for (partial, info) in std::mem::take(&mut self.done) {
            let target = self.dir.join(&info.file);
            fs::rename(&partial, &target).map_err(|e| FormatError::io(&target, e))?;
            files.push(info);
        }
        self.committed = true;
        let keep: std::collections::HashSet<&str> = files.iter().map(|f| f.file.as_str()).collect();
        for entry in fs::read_dir(&self.dir).map_err(|e| FormatError::io(&self.dir, e))? {
            let entry = entry.map_err(|e| FormatError::io(&self.dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if is_shard_name(&name, &self.prefix) && !keep.contains(name.as_str()) {
                fs::remove_file(entry.path()).map_err(|e| FormatError::io(entry.path(), e))?;
            }
        }
        Ok(files)
    }
}

impl Drop for ShardedTextWriter {
    fn drop(&mut self) {
        if !self.committed {
            if let Some(cur) = self.current.take() {
                drop(cur.out);
                let _ = fs::remove_file(&cur.partial);
            }
            for (partial, _) in &self.done {
                let _ = fs::remove_file(partial);
            }
        }
    }
}

/// `PREFIX_NNNNN.txt`
fn is_shard_name(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('_'))
        .and_then(|r| r.strip_suffix(".txt"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
}

pub(crate) use bertkit_stage_io::hex;

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(lines: &[&str]) -> Document {
        Document::from_sentences(lines.iter().copied())
    }

    #[test]
    fn splits_at_document_boundaries_and_commits_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardedTextWriter::new(dir.path(), "wiki", 20).unwrap();
        w.write(&doc(&["aaaa", "bbbb"])).unwrap(); // 11 bytes
        w.write(&doc(&["cccc"])).unwrap(); // 6 bytes -> 17
        w.write(&doc(&["dddddddddddddddddddddddd"])).unwrap(); // 26 bytes alone
        // Nothing visible before commit.
        let visible: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.'))
            .collect();
        assert!(visible.is_empty(), "{visible:?}");
        let files = w.commit().unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(
            fs::read_to_string(dir.path().join("wiki_00000.txt")).unwrap(),
            "aaaa\nbbbb\n\ncccc\n\n"
        );
        assert_eq!(files[0].documents, 2);
        assert_eq!(files[0].sentences, 3);
        assert_eq!(files[1].bytes, 26);
    }

    #[test]
    fn dropped_writer_leaves_nothing_and_commit_removes_stale_files() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("wiki_00007.txt"), "stale").unwrap();
        fs::write(dir.path().join("other.txt"), "keep").unwrap();
        {
            let mut w = ShardedTextWriter::new(dir.path(), "wiki", 100).unwrap();
            w.write(&doc(&["x"])).unwrap();
        }
        assert!(!dir.path().join(".wiki_00000.txt.partial").exists());
        let mut w = ShardedTextWriter::new(dir.path(), "wiki", 100).unwrap();
        w.write(&doc(&["x"])).unwrap();
        w.commit().unwrap();
        assert!(!dir.path().join("wiki_00007.txt").exists());
        assert!(dir.path().join("other.txt").exists());
        assert!(dir.path().join("wiki_00000.txt").exists());
    }
}
