//! Writing shards: `train/shard_NNNNN.txt` and `test/shard_NNNNN.txt` (or `.txt.zst`).
//!
//! Documents are appended to hidden `.shard_NNNNN.txt.partial` files as they are assigned (one
//! 128 KiB buffer per shard). With `--compress zstd`, each finished shard is then compressed
//! into its own `.partial` file, in parallel over shards, one encoder per worker thread, so that
//! memory does not grow with the number of shards. Files are renamed into place only when every
//! shard is done; shards of an earlier run that this run does not write are removed.

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::balance::Split;
use crate::error::ShardError;
use crate::manifest::ShardFile;

/// Output compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", tag = "codec")]
pub enum Compression {
    /// Plain `.txt`.
    None,
    /// `.txt.zst` at this level.
    Zstd {
        /// zstd level (1–19).
        level: i32,
    },
}

impl Compression {
    /// The compression named `name` (`None` for plain text, `"zstd"`) at zstd `level`.
    pub fn from_name(name: Option<&str>, level: i32) -> Result<Self, ShardError> {
        match name {
            None => Ok(Compression::None),
            Some("zstd") => Ok(Compression::Zstd { level }),
            Some(other) => Err(ShardError::Usage(format!(
                "compression {other:?}: only \"zstd\" (or none)"
            ))),
        }
    }

    fn extension(&self) -> &'static str {
        match self {
            Compression::None => "txt",
            Compression::Zstd { .. } => "txt.zst",
        }
    }
}

/// The relative path of a shard file.
pub fn shard_file_name(split: Split, index: usize, compression: Compression) -> String {
    let dir = match split {
        Split::Train => "train",
        Split::Test => "test",
    };
    format!("{dir}/shard_{index:05}.{}", compression.extension())
}

struct OpenShard {
    out: Option<BufWriter<File>>,
    partial: PathBuf,
    content: Sha256,
    documents: u64,
    sentences: u64,
    bytes: u64,
}

/// The shards of one run (only those this rank writes are opened).
pub struct ShardSet {
    dir: PathBuf,
    compression: Compression,
    train: Vec<OpenShard>,
    test: Vec<OpenShard>,
    committed: bool,
}

impl ShardSet {
    /// Opens the shards; `owned(global_index)` says whether this rank writes a shard, where the
    /// global index counts train shards first, then test shards.
    pub fn create(
        dir: &Path,
        num_train: usize,
        num_test: usize,
        compression: Compression,
        owned: impl Fn(usize) -> bool,
    ) -> Result<Self, ShardError> {
        let open = |split: Split, index: usize, global: usize| -> Result<OpenShard, ShardError> {
            let name = shard_file_name(split, index, Compression::None);
            let path = dir.join(&name);
            let partial = bertkit_stage_io::partial_path(&path);
            let out = if owned(global) {
                let parent = path.parent().expect("shards live in a split folder");
                fs::create_dir_all(parent).map_err(|e| ShardError::io(parent, e))?;
                let file = File::create(&partial).map_err(|e| ShardError::io(&partial, e))?;
                Some(BufWriter::with_capacity(128 << 10, file))
            } else {
                None
            };
            Ok(OpenShard {
                out,
                partial,
                content: Sha256::new(),
                documents: 0,
                sentences: 0,
                bytes: 0,
            })
        };
        let train = (0..num_train)
            .map(|i| open(Split::Train, i, i))
            .collect::<Result<Vec<_>, _>>()?;
        let test = (0..num_test)
            .map(|i| open(Split::Test, i, num_train + i))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ShardSet {
            dir: dir.to_path_buf(),
            compression,
            train,
            test,
            committed: false,
        })
    }

    /// Appends a document (and its blank line) to a shard; counts it either way.
    pub fn write(
        &mut self,
        split: Split,
        index: usize,
        text: &[u8],
        sentences: u64,
    ) -> Result<(), ShardError> {
        let shard = match split {
            Split::Train => &mut self.train[index],
            Split::Test => &mut self.test[index],
        };
        if let Some(out) = shard.out.as_mut() {
            out.write_all(text)
                .and_then(|_| out.write_all(b"\n"))
                .map_err(|e| ShardError::io(&shard.partial, e))?;
            shard.content.update(text);
            shard.content.update(b"\n");
        }
        shard.documents += 1;
        shard.sentences += sentences;
        shard.bytes += text.len() as u64 + 1;
        Ok(())
    }

    /// Closes the shards, compresses them if asked (on `pool`), renames them into place and
    /// removes stale shard files. Returns every shard's record, train first.
    pub fn commit(mut self, pool: &rayon::ThreadPool) -> Result<Vec<ShardFile>, ShardError> {
        let compression = self.compression;
        let dir = self.dir.clone();
        let mut shards: Vec<(Split, usize, OpenShard)> = Vec::new();
        for (split, list) in [
            (Split::Train, std::mem::take(&mut self.train)),
            (Split::Test, std::mem::take(&mut self.test)),
        ] {
            shards.extend(list.into_iter().enumerate().map(|(i, s)| (split, i, s)));
        }
        let finished: Vec<Result<(ShardFile, Option<PathBuf>), ShardError>> = pool.install(|| {
            shards
                .into_par_iter()
                .map(|(split, index, shard)| finish_shard(&dir, split, index, shard, compression))
                .collect()
        });
        let mut records = Vec::with_capacity(finished.len());
        let mut to_rename = Vec::new();
        for f in finished {
            let (record, partial) = f?;
            if let Some(p) = partial {
                to_rename.push((p, dir.join(&record.file)));
            }
            records.push(record);
        }
        for (partial, target) in &to_rename {
            fs::rename(partial, target).map_err(|e| ShardError::io(target, e))?;
        }
        self.committed = true;
        remove_stale(&dir, &records)?;
        Ok(records)
    }
}

/// Flushes a shard, compresses it if asked, and returns its record and the partial file to
/// rename (none for shards this rank does not write).
fn finish_shard(
    dir: &Path,
    split: Split,
    index: usize,
    shard: OpenShard,
    compression: Compression,
) -> Result<(ShardFile, Option<PathBuf>), ShardError> {
    let file = shard_file_name(split, index, compression);
    let mut record = ShardFile {
        split,
        index,
        file: file.clone(),
        documents: shard.documents,
        sentences: shard.sentences,
        bytes: shard.bytes,
        file_bytes: None,
        sha256: None,
        content_sha256: None,
    };
    let Some(out) = shard.out else {
        return Ok((record, None));
    };
    let plain = out
        .into_inner()
        .map_err(|e| ShardError::io(&shard.partial, e.into_error()))?;
    plain
        .sync_all()
        .map_err(|e| ShardError::io(&shard.partial, e))?;
    drop(plain);
    let content_sha256 = bertkit_stage_io::hex(&shard.content.finalize());
    let (partial, file_bytes, sha256) = match compression {
        Compression::None => (shard.partial.clone(), shard.bytes, content_sha256.clone()),
        Compression::Zstd { level } => {
            let target = bertkit_stage_io::partial_path(&dir.join(&file));
            let err = |e| ShardError::io(&target, e);
            let input =
                File::open(&shard.partial).map_err(|e| ShardError::io(&shard.partial, e))?;
            let output = File::create(&target).map_err(err)?;
            let hashing = HashingWriter {
                inner: BufWriter::with_capacity(1 << 20, output),
                hasher: Sha256::new(),
                count: 0,
            };
            let mut encoder = zstd::stream::write::Encoder::new(hashing, level).map_err(err)?;
            std::io::copy(&mut BufReader::with_capacity(1 << 20, input), &mut encoder)
                .map_err(err)?;
            let hashing = encoder.finish().map_err(err)?;
            let out = hashing
                .inner
                .into_inner()
                .map_err(|e| ShardError::io(&target, e.into_error()))?;
            out.sync_all().map_err(err)?;
            fs::remove_file(&shard.partial).map_err(|e| ShardError::io(&shard.partial, e))?;
            (
                target,
                hashing.count,
                bertkit_stage_io::hex(&hashing.hasher.finalize()),
            )
        }
    };
    record.content_sha256 = Some(content_sha256);
    record.file_bytes = Some(file_bytes);
    record.sha256 = Some(sha256);
    Ok((record, Some(partial)))
}

/// A writer that hashes (SHA-256) and counts what passes through it.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    count: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Removes `shard_*.txt[.zst]` files in `train/` and `test/` that are not part of this run
/// (written by an earlier run with more shards or another compression).
fn remove_stale(dir: &Path, records: &[ShardFile]) -> Result<(), ShardError> {
    let keep: std::collections::HashSet<PathBuf> =
        records.iter().map(|r| dir.join(&r.file)).collect();
    for split in ["train", "test"] {
        let Ok(entries) = fs::read_dir(dir.join(split)) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let is_shard = name.starts_with("shard_")
                && (name.ends_with(".txt") || name.ends_with(".txt.zst"));
            if is_shard && !keep.contains(&entry.path()) {
                fs::remove_file(entry.path()).map_err(|e| ShardError::io(entry.path(), e))?;
            }
        }
    }
    Ok(())
}

impl Drop for ShardSet {
    fn drop(&mut self) {
        if !self.committed {
            for s in self.train.iter().chain(&self.test) {
                let _ = fs::remove_file(&s.partial);
            }
        }
    }
}
