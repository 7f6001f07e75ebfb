//! # bertkit-tf-checkpoint: TensorFlow checkpoints without TensorFlow
//!
//! google-research/bert, NVIDIA's TensorFlow BERT and every `run_pretraining.py` run leave
//! their weights as a TensorFlow checkpoint in the V2 *tensor bundle* format:
//!
//! - `<prefix>.index`: a sorted string table (LevelDB's format, blocks checked by CRC-32C) whose
//!   first entry (key `""`) is the bundle header (number of data shards, byte order) and whose
//!   other entries map each variable's name to its dtype, shape, data shard, offset, size and
//!   the CRC-32C of its bytes;
//! - `<prefix>.data-00000-of-0000N`: the tensors' bytes, little-endian, row-major, end to end.
//!
//! [`Checkpoint`] reads one (every tensor's checksum checked as it is read; a truncated index,
//! a damaged block or tensor, a missing shard or a size unlike the shape is an error naming the
//! file and tensor); [`Writer`] writes one that TensorFlow's `tf.train.load_checkpoint`,
//! `init_from_checkpoint` and `Saver.restore` read. Numeric dtypes only (float, double, half,
//! bfloat16, int32, int64); string tensors and partitioned variables are refused by name.
//!
//! Memory: the reader holds the index (a few kB per tensor) and one tensor at a time; the
//! writer streams tensors to the data file and holds only their index entries.

#![deny(missing_docs)]

mod proto;
mod table;

pub use table::Rows;

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use bertkit_stage_io::crc32c::{self, crc32c};

/// Why a checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not a valid checkpoint index (or is damaged).
    #[error("{path}: {detail}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        detail: String,
    },
    /// One tensor's entry or bytes are wrong.
    #[error("{path}: tensor {tensor:?}: {detail}")]
    Tensor {
        /// The file holding it (the index, or the data shard).
        path: PathBuf,
        /// The variable's name.
        tensor: String,
        /// What is wrong.
        detail: String,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A tensor's element type, with TensorFlow's `DataType` numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// `DT_FLOAT` (1).
    F32,
    /// `DT_DOUBLE` (2).
    F64,
    /// `DT_INT32` (3).
    I32,
    /// `DT_INT64` (9).
    I64,
    /// `DT_BFLOAT16` (14).
    BF16,
    /// `DT_HALF` (19).
    F16,
    /// Any other (strings, booleans, complex, quantised): listed, never read.
    Other(u64),
}

impl DType {
    fn from_proto(code: u64) -> Self {
        match code {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::I32,
            9 => DType::I64,
            14 => DType::BF16,
            19 => DType::F16,
            other => DType::Other(other),
        }
    }

    fn to_proto(self) -> u64 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::I32 => 3,
            DType::I64 => 9,
            DType::BF16 => 14,
            DType::F16 => 19,
            DType::Other(code) => code,
        }
    }

    /// Bytes per element (`None` for types this crate does not read).
    pub fn size(self) -> Option<usize> {
        match self {
            DType::F32 | DType::I32 => Some(4),
            DType::F64 | DType::I64 => Some(8),
            DType::BF16 | DType::F16 => Some(2),
            DType::Other(_) => None,
        }
    }
}

/// One variable of a checkpoint: its name, type, shape, and where its bytes are.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The variable's name (`bert/encoder/layer_0/attention/self/query/kernel`).
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its shape (empty for a scalar).
    pub shape: Vec<usize>,
    shard: u32,
    offset: u64,
    size: u64,
    crc32c: u32,
}

impl Entry {
    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A TensorFlow checkpoint opened for reading: its entries, and the tensors on demand.
#[derive(Debug)]
pub struct Checkpoint {
    prefix: PathBuf,
    shards: u32,
    entries: Vec<Entry>,
}

/// The checkpoint prefix `path` names: `<prefix>.index` given whole, the prefix itself
/// (`bert_model.ckpt`), or a folder (its `checkpoint` file's `model_checkpoint_path`, else its
/// one `.index` file).
pub fn resolve_prefix(path: &Path) -> Result<PathBuf, Error> {
    let text = path.to_string_lossy();
    if let Some(prefix) = text.strip_suffix(".index") {
        return Ok(PathBuf::from(prefix));
    }
    if path.is_dir() {
        let state = path.join("checkpoint");
        if state.is_file() {
            let text = std::fs::read_to_string(&state).map_err(io_error(&state))?;
            let named = text.lines().find_map(|l| {
                let rest = l.trim().strip_prefix("model_checkpoint_path:")?;
                Some(rest.trim().trim_matches('"').to_string())
            });
            if let Some(named) = named {
                let named = PathBuf::from(named);
                return Ok(if named.is_absolute() {
                    named
                } else {
                    path.join(named)
                });
            }
        }
        let mut indexes: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io_error(path))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "index"))
            .collect();
        indexes.sort();
        return match indexes.as_slice() {
            [one] => Ok(one.with_extension("")),
            [] => Err(Error::Format {
                path: path.into(),
                detail: "a folder with no checkpoint (no `checkpoint` file, no .index file)".into(),
            }),
            several => Err(Error::Format {
                path: path.into(),
                detail: format!(
                    "{} checkpoints here and no `checkpoint` file naming one: name its prefix (e.g. {})",
                    several.len(),
                    several[0].with_extension("").display()
                ),
            }),
        };
    }
    Ok(path.to_path_buf())
}

/// An index table holding `rows` (key and value each; sorted by key, no key twice), laid out as
/// [`Writer`] lays one out, checksums and all: for tests and fuzzing, which need well-formed
/// tables around arbitrary entries. Rows out of order or repeated are sorted and the first of
/// each key kept.
pub fn index_table(rows: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut rows = rows.to_vec();
    rows.sort_by(|a, b| a.0.cmp(b.0));
    rows.dedup_by(|b, a| a.0 == b.0);
    table::write(&rows)
}

/// The rows (key, value) of the index table `bytes`, its blocks' checksums checked: what
/// [`index_table`] takes.
pub fn index_rows(bytes: &[u8]) -> Result<table::Rows, String> {
    table::read(bytes)
}

/// `<prefix>.index`.
pub fn index_path(prefix: &Path) -> PathBuf {
    PathBuf::from(format!("{}.index", prefix.display()))
}

/// The data shard `shard` of `shards` beside `prefix`.
pub fn data_path(prefix: &Path, shard: u32, shards: u32) -> PathBuf {
    PathBuf::from(format!(
        "{}.data-{shard:05}-of-{shards:05}",
        prefix.display()
    ))
}

impl Checkpoint {
    /// Opens the checkpoint `path` names (see [`resolve_prefix`]) and reads its index.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let prefix = resolve_prefix(path)?;
        let index = index_path(&prefix);
        let bytes = std::fs::read(&index).map_err(io_error(&index))?;
        Self::from_index(prefix, &bytes)
    }

    /// The checkpoint whose index holds `bytes` (data shards beside `prefix`).
    pub fn from_index(prefix: PathBuf, bytes: &[u8]) -> Result<Self, Error> {
        let index = index_path(&prefix);
        let format = |detail: String| Error::Format {
            path: index.clone(),
            detail,
        };
        let table = table::read(bytes).map_err(format)?;
        let mut rows = table.into_iter();
        let header = match rows.next() {
            Some((key, value)) if key.is_empty() => {
                proto::Header::decode(&value).map_err(|e| format(format!("bundle header: {e}")))?
            }
            _ => {
                return Err(format(
                    "no bundle header (the entry with the empty key)".into(),
                ));
            }
        };
        if header.endianness != 0 {
            return Err(format(
                "a big-endian bundle (only little-endian ones are read)".into(),
            ));
        }
        if header.num_shards == 0 {
            return Err(format("the header says 0 data shards".into()));
        }
        let mut entries = Vec::new();
        for (key, value) in rows {
            let name = String::from_utf8(key).map_err(|e| {
                format(format!(
                    "a tensor name that is not UTF-8: {:?}",
                    e.as_bytes()
                ))
            })?;
            let tensor_error = |detail: String| Error::Tensor {
                path: index.clone(),
                tensor: name.clone(),
                detail,
            };
            let e = proto::EntryProto::decode(&value).map_err(tensor_error)?;
            if e.sliced {
                return Err(tensor_error(
                    "a partitioned variable (slices): not supported".into(),
                ));
            }
            if e.unknown_rank || e.shape.iter().any(|&d| d < 0) {
                return Err(tensor_error(format!("an unknown shape {:?}", e.shape)));
            }
            if e.shard_id >= header.num_shards {
                return Err(tensor_error(format!(
                    "in data shard {} of {}",
                    e.shard_id, header.num_shards
                )));
            }
            let entry = Entry {
                name: name.clone(),
                dtype: DType::from_proto(e.dtype),
                shape: e.shape.iter().map(|&d| d as usize).collect(),
                shard: e.shard_id,
                offset: e.offset,
                size: e.size,
                crc32c: e.crc32c,
            };
            if let Some(size) = entry.dtype.size() {
                let expected = entry
                    .shape
                    .iter()
                    .try_fold(size as u64, |n, &d| n.checked_mul(d as u64));
                if expected != Some(entry.size) {
                    return Err(tensor_error(format!(
                        "{} bytes for shape {:?} of {:?} ({} expected)",
                        entry.size,
                        entry.shape,
                        entry.dtype,
                        expected.map_or("too many".into(), |e| e.to_string())
                    )));
                }
            }
            entries.push(entry);
        }
        Ok(Checkpoint {
            prefix,
            shards: header.num_shards,
            entries,
        })
    }

    /// The checkpoint's prefix (`…/bert_model.ckpt`).
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// Every variable, sorted by name.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The variable `name`, if there.
    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries
            .binary_search_by(|e| e.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.entries[i])
    }

    /// The raw (little-endian) bytes of `entry`, their CRC-32C checked.
    pub fn read_bytes(&self, entry: &Entry) -> Result<Vec<u8>, Error> {
        let path = data_path(&self.prefix, entry.shard, self.shards);
        let tensor_error = |detail: String| Error::Tensor {
            path: path.clone(),
            tensor: entry.name.clone(),
            detail,
        };
        let mut file = File::open(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source: std::io::Error::new(
                source.kind(),
                format!("data shard {} of {}: {source}", entry.shard, self.shards),
            ),
        })?;
        let len = file.metadata().map_err(io_error(&path))?.len();
        if entry
            .offset
            .checked_add(entry.size)
            .is_none_or(|end| end > len)
        {
            return Err(tensor_error(format!(
                "{} bytes at offset {} run past the file's {len} (truncated?)",
                entry.size, entry.offset
            )));
        }
        let size = usize::try_from(entry.size).map_err(|_| tensor_error("too large".into()))?;
        let mut bytes = vec![0u8; size];
        file.seek(SeekFrom::Start(entry.offset))
            .and_then(|_| file.read_exact(&mut bytes))
            .map_err(io_error(&path))?;
        let computed = crc32c(&bytes);
        let stored = crc32c::unmask(entry.crc32c);
        if computed != stored {
            return Err(tensor_error(format!(
                "CRC-32C mismatch (stored {stored:#010x}, computed {computed:#010x}): the data file is damaged"
            )));
        }
        Ok(bytes)
    }

    /// `entry`'s values as f32 (from float, double, half or bfloat16), checked as
    /// [`Checkpoint::read_bytes`] checks them.
    pub fn read_f32(&self, entry: &Entry) -> Result<Vec<f32>, Error> {
        let bytes = self.read_bytes(entry)?;
        let values = match entry.dtype {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::F64 => bytes
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
            other => {
                return Err(Error::Tensor {
                    path: index_path(&self.prefix),
                    tensor: entry.name.clone(),
                    detail: format!("{other:?} is not a floating-point type"),
                });
            }
        };
        Ok(values)
    }
}

/// IEEE half precision to f32 (exact).
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exponent = u32::from((h >> 10) & 0x1f);
    let mantissa = u32::from(h & 0x3ff);
    let bits = match (exponent, mantissa) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m · 2^-24, exact in f32.
            let value = m as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -value } else { value };
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Writes a checkpoint: tensors streamed to the one data shard in the order added, the index
/// written (sorted) at [`Writer::finish`]. Both files appear under their names only when
/// finished (written under partial names, synced, renamed, the data file first).
pub struct Writer {
    prefix: PathBuf,
    data_partial: PathBuf,
    data: BufWriter<File>,
    offset: u64,
    entries: Vec<(String, proto::EntryProto)>,
}

impl Writer {
    /// Starts the checkpoint `prefix` (`<folder>/bert_model.ckpt`); the folder must exist.
    pub fn create(prefix: &Path) -> Result<Self, Error> {
        let data_partial = bertkit_stage_io::partial_path(&data_path(prefix, 0, 1));
        let file = File::create(&data_partial).map_err(io_error(&data_partial))?;
        Ok(Writer {
            prefix: prefix.to_path_buf(),
            data_partial,
            data: BufWriter::with_capacity(1 << 20, file),
            offset: 0,
            entries: Vec::new(),
        })
    }

    /// Adds a tensor of `dtype` and `shape` whose little-endian bytes are `bytes`.
    pub fn add(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<(), Error> {
        let tensor_error = |detail: String| Error::Tensor {
            path: self.prefix.clone(),
            tensor: name.to_string(),
            detail,
        };
        let Some(size) = dtype.size() else {
            return Err(tensor_error(format!("{dtype:?} cannot be written")));
        };
        if name.is_empty() {
            return Err(tensor_error("an empty name (the key of the header)".into()));
        }
        if shape.iter().product::<usize>() * size != bytes.len() {
            return Err(tensor_error(format!(
                "{} bytes for shape {shape:?} of {dtype:?}",
                bytes.len()
            )));
        }
        if self.entries.iter().any(|(n, _)| n == name) {
            return Err(tensor_error("added twice".into()));
        }
        self.data
            .write_all(bytes)
            .map_err(io_error(&self.data_partial))?;
        self.entries.push((
            name.to_string(),
            proto::EntryProto {
                dtype: dtype.to_proto(),
                shape: shape.iter().map(|&d| d as i64).collect(),
                unknown_rank: false,
                shard_id: 0,
                offset: self.offset,
                size: bytes.len() as u64,
                crc32c: crc32c::mask(crc32c(bytes)),
                sliced: false,
            },
        ));
        self.offset += bytes.len() as u64;
        Ok(())
    }

    /// Adds an f32 tensor.
    pub fn add_f32(&mut self, name: &str, shape: &[usize], values: &[f32]) -> Result<(), Error> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add(name, DType::F32, shape, &bytes)
    }

    /// Writes the index and puts both files in place; returns the checkpoint's prefix.
    pub fn finish(mut self) -> Result<PathBuf, Error> {
        self.data.flush().map_err(io_error(&self.data_partial))?;
        let file = self
            .data
            .into_inner()
            .map_err(|e| io_error(&self.data_partial)(e.into_error()))?;
        file.sync_all().map_err(io_error(&self.data_partial))?;
        let data = data_path(&self.prefix, 0, 1);
        std::fs::rename(&self.data_partial, &data).map_err(io_error(&data))?;
        self.entries.sort_by(|a, b| a.0.cmp(&b.0));
        let header = proto::Header {
            num_shards: 1,
            endianness: 0,
            // TensorFlow's kTensorBundleVersion.
            producer: 1,
        }
        .encode();
        let values: Vec<Vec<u8>> = self.entries.iter().map(|(_, e)| e.encode()).collect();
        let mut rows: Vec<(&[u8], &[u8])> = vec![(&[], &header)];
        rows.extend(
            self.entries
                .iter()
                .zip(&values)
                .map(|((name, _), value)| (name.as_bytes(), value.as_slice())),
        );
        let index = index_path(&self.prefix);
        bertkit_stage_io::write_atomically(&index, &table::write(&rows))
            .map_err(io_error(&index))?;
        Ok(self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_checkpoints_read_back_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("model.ckpt");
        let mut w = Writer::create(&prefix).unwrap();
        let a: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        w.add_f32("bert/b", &[3, 4], &a).unwrap();
        w.add("global_step", DType::I64, &[], &42i64.to_le_bytes())
            .unwrap();
        w.add_f32("bert/a", &[2], &[f32::MIN_POSITIVE, -0.0])
            .unwrap();
        assert!(w.add_f32("bert/a", &[2], &[1.0, 2.0]).is_err());
        assert!(w.add_f32("bert/c", &[3], &[1.0, 2.0]).is_err());
        w.finish().unwrap();
        let ckpt = Checkpoint::open(&dir.path().join("model.ckpt.index")).unwrap();
        let names: Vec<&str> = ckpt.entries().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["bert/a", "bert/b", "global_step"]);
        let b = ckpt.entry("bert/b").unwrap();
        assert_eq!(b.shape, [3, 4]);
        assert_eq!(ckpt.read_f32(b).unwrap(), a);
        let step = ckpt.entry("global_step").unwrap();
        assert_eq!(step.dtype, DType::I64);
        assert_eq!(ckpt.read_bytes(step).unwrap(), 42i64.to_le_bytes());
        assert!(
            ckpt.read_f32(step)
                .unwrap_err()
                .to_string()
                .contains("not a floating")
        );
        // The folder resolves to its one checkpoint.
        assert_eq!(Checkpoint::open(dir.path()).unwrap().entries().len(), 3);
    }

    #[test]
    fn damage_names_the_file_and_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("m.ckpt");
        let mut w = Writer::create(&prefix).unwrap();
        w.add_f32("x", &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        w.add_f32("y", &[2], &[5.0, 6.0]).unwrap();
        w.finish().unwrap();
        let data = data_path(&prefix, 0, 1);
        let mut bytes = std::fs::read(&data).unwrap();
        bytes[17] ^= 0x40;
        std::fs::write(&data, &bytes).unwrap();
        let ckpt = Checkpoint::open(&prefix).unwrap();
        let err = ckpt
            .read_f32(ckpt.entry("y").unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"y\"") && err.contains("CRC-32C") && err.contains("data-00000-of-00001"),
            "{err}"
        );
        assert!(ckpt.read_f32(ckpt.entry("x").unwrap()).is_ok());
        std::fs::write(&data, &bytes[..20]).unwrap();
        let err = ckpt
            .read_f32(ckpt.entry("y").unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("truncated"), "{err}");
        std::fs::remove_file(&data).unwrap();
        let err = ckpt
            .read_f32(ckpt.entry("x").unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("data shard 0 of 1"), "{err}");
        let index = index_path(&prefix);
        let bytes = std::fs::read(&index).unwrap();
        std::fs::write(&index, &bytes[..bytes.len() - 3]).unwrap();
        let err = Checkpoint::open(&prefix).unwrap_err().to_string();
        assert!(
            err.contains("m.ckpt.index") && err.contains("magic"),
            "{err}"
        );
    }

    #[test]
    fn half_precision_widens_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
        assert!(f16_to_f32(0x7c00).is_infinite());
        assert!(f16_to_f32(0x7e00).is_nan());
    }
}
