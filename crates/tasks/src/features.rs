//! Feature extraction as google-research/bert's `extract_features.py` does it: lines of text in
//! (a line `A ||| B` is a sentence pair, split at its last ` ||| `), each token's hidden states
//! from chosen encoder layers out.
//!
//! Encoding is `run_classifier.py`'s ([`crate::glue::finetune::encode`]): WordPiece,
//! `[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]`, a pair truncated from its longer side to
//! `max_seq_length`. Layers are indexed as Google indexes the encoder's layers: `-1` the last,
//! `0` the first (the embeddings are not a layer). Batches are padded to their longest line.
//!
//! Two outputs:
//! - [`FeatureFormat::Jsonl`]: Google's layout, one JSON object per line:
//!   `{"linex_index": i, "features": [{"token": "[CLS]", "layers": [{"index": -1, "values":
//!   [...]}, ...]}, ...]}`, values rounded to 6 decimals as Google rounds them;
//! - [`FeatureFormat::Npy`]: a folder for large runs, full f32: `layer_<index>.npy` per layer
//!   (`[tokens, hidden]`, every line's tokens end to end), `token_ids.npy` (`[tokens]`, i32)
//!   and `offsets.npy` (`[lines + 1]`, i64: line `i` is rows `offsets[i]..offsets[i + 1]`).
//!
//! Memory: one batch of lines and its hidden states; outputs are streamed to partial files and
//! renamed into place when complete.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use bertkit_model::Mode;
use bertkit_model::bert::{BertModel, load_frozen};
use candle_core::{DType, Device};
use rayon::prelude::*;

use crate::TaskError;
use crate::glue::data::Example;
use crate::glue::finetune::encode;
use crate::model_dir::load_tokenizer;

/// Google's default layers.
pub const DEFAULT_LAYERS: [i64; 4] = [-1, -2, -3, -4];
/// Google's default `max_seq_length` for feature extraction.
pub const DEFAULT_MAX_SEQ_LENGTH: usize = 128;
/// Lines per forward pass.
pub const DEFAULT_BATCH: usize = 32;

/// How the features are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureFormat {
    /// Google's JSON lines.
    Jsonl,
    /// A folder of `.npy` files, full f32.
    Npy,
}

/// What to extract, and how.
#[derive(Debug, Clone)]
pub struct FeatureOptions {
    /// Encoder layers, Google's indexing (`-1` the last).
    pub layers: Vec<i64>,
    /// Longest sequence, `[CLS]` and `[SEP]` included; `None`: [`DEFAULT_MAX_SEQ_LENGTH`], or
    /// the model's `max_position_embeddings` if that is shorter.
    pub max_seq_length: Option<usize>,
    /// Lines per forward pass.
    pub batch: usize,
    /// Lower-case (an uncased vocabulary).
    pub lower_case: bool,
    /// Compute dtype.
    pub dtype: DType,
    /// Device.
    pub device: Device,
    /// Output layout.
    pub format: FeatureFormat,
}

impl FeatureOptions {
    /// Google's defaults on `device`: layers -1..-4, 128 positions (at most the model's),
    /// lower-cased, f32, JSONL.
    pub fn new(device: Device) -> Self {
        FeatureOptions {
            layers: DEFAULT_LAYERS.to_vec(),
            max_seq_length: None,
            batch: DEFAULT_BATCH,
            lower_case: true,
            dtype: DType::F32,
            device,
            format: FeatureFormat::Jsonl,
        }
    }
}

/// What [`extract_features`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct FeatureSummary {
    /// Lines read (one example each).
    pub lines: usize,
    /// Tokens written (with `[CLS]` and `[SEP]`).
    pub tokens: usize,
    /// Lines cut to `max_seq_length`.
    pub truncated: usize,
    /// The layers written, as asked.
    pub layers: Vec<i64>,
    /// Width of each vector.
    pub hidden: usize,
    /// The longest sequence used.
    pub max_seq_length: usize,
}

/// Parses Google's `--layers` list (`-1,-2,-3,-4`).
pub fn parse_layers(text: &str) -> Result<Vec<i64>, String> {
    let layers: Vec<i64> = text
        .split(',')
        .map(|p| {
            p.trim()
                .parse::<i64>()
                .map_err(|_| format!("layer {p:?} is not an integer"))
        })
        .collect::<Result<_, _>>()?;
    if layers.is_empty() {
        return Err("no layers".into());
    }
    Ok(layers)
}

/// Runs the model folder `model` (its `vocab.txt` for the tokenizer) on every line of `input`
/// and writes the features to `output` (a file for JSONL, a folder for npy); `progress` is
/// called with the lines done after each batch.
pub fn extract_features(
    model: &Path,
    input: &Path,
    output: &Path,
    options: &FeatureOptions,
    progress: &mut dyn FnMut(usize),
) -> Result<FeatureSummary, TaskError> {
    // An output of the wrong kind is refused before any work (it was found only at the
    // rename, after computing everything).
    let wrong_kind = match options.format {
        FeatureFormat::Jsonl if output.is_dir() => Some("a folder: --format jsonl writes a file"),
        FeatureFormat::Npy if output.is_file() => Some("a file: --format npy writes a folder"),
        _ => None,
    };
    if let Some(message) = wrong_kind {
        return Err(TaskError::Format {
            path: output.to_path_buf(),
            message: format!("the output is {message}"),
        });
    }
    let model = &crate::model_dir::resolve(model)?;
    let loaded = load_frozen::<BertModel>(model, options.dtype, &options.device)?;
    let tokenizer = load_tokenizer(model, options.lower_case)?;
    let layer_count = loaded.config.num_hidden_layers as i64;
    let bad_option = |message: String| TaskError::Format {
        path: model.to_path_buf(),
        message,
    };
    let picks: Vec<usize> = options
        .layers
        .iter()
        .map(|&l| {
            let i = if l < 0 { layer_count + l } else { l };
            if (0..layer_count).contains(&i) {
                // hidden_states[0] is the embeddings' output.
                Ok(i as usize + 1)
            } else {
                Err(bad_option(format!(
                    "layer {l}: the model has {layer_count} encoder layers (-{layer_count}..{})",
                    layer_count - 1
                )))
            }
        })
        .collect::<Result<_, _>>()?;
    let positions = loaded.config.max_position_embeddings;
    let max_seq_length = options
        .max_seq_length
        .unwrap_or(DEFAULT_MAX_SEQ_LENGTH.min(positions));
    if !(3..=positions).contains(&max_seq_length) {
        return Err(bad_option(format!(
            "max_seq_length {max_seq_length} is not in 3..={positions} (the model's max_position_embeddings)"
        )));
    }
    let hidden = loaded.config.hidden_size;
    let mut sink: Box<dyn Sink> = match options.format {
        FeatureFormat::Jsonl => Box::new(JsonlSink::create(output, &options.layers)?),
        FeatureFormat::Npy => Box::new(NpySink::create(output, &options.layers, hidden)?),
    };
    let file = File::open(input).map_err(|source| TaskError::Io {
        path: input.into(),
        source,
    })?;
    let mut reader = BufReader::new(file);
    let mut summary = FeatureSummary {
        lines: 0,
        tokens: 0,
        truncated: 0,
        layers: options.layers.clone(),
        hidden,
        max_seq_length,
    };
    let mut bytes = Vec::new();
    let mut batch: Vec<(Vec<u32>, Vec<u32>)> = Vec::with_capacity(options.batch);
    let mut at_end = false;
    // Bytes of the input before the current line.
    let mut offset = 0u64;
    while !at_end {
        bytes.clear();
        let read = reader
            .read_until(b'\n', &mut bytes)
            .map_err(|source| TaskError::Io {
                path: input.into(),
                source,
            })?;
        at_end = read == 0;
        if !at_end {
            let line_number = summary.lines + batch.len() + 1;
            if let Some((_, at)) = bertkit_stage_io::text::find_nul(&bytes) {
                return Err(TaskError::Format {
                    path: input.into(),
                    message: bertkit_stage_io::text::nul_message(
                        line_number as u64,
                        offset + at,
                        "",
                    ),
                });
            }
            let text = std::str::from_utf8(&bytes).map_err(|e| TaskError::Format {
                path: input.into(),
                message: format!(
                    "line {line_number} (byte offset {}) is not valid UTF-8",
                    offset + e.valid_up_to() as u64
                ),
            })?;
            offset += read as u64;
            let text = text.trim();
            let (a, b) = match text.rsplit_once(" ||| ") {
                Some((a, b)) => (a.to_string(), Some(b.to_string())),
                None => (text.to_string(), None),
            };
            let example = Example {
                text_a: a,
                text_b: b,
                label: 0,
            };
            // The encoding is cut exactly when the whole line is longer than the limit; only
            // then is it encoded again, cut.
            let mut encoded = encode(&tokenizer, &example, usize::MAX).map_err(bad_option)?;
            if encoded.ids.len() > max_seq_length {
                summary.truncated += 1;
                encoded = encode(&tokenizer, &example, max_seq_length).map_err(bad_option)?;
            }
            batch.push((encoded.ids, encoded.segments));
        }
        if batch.len() == options.batch.max(1) || (at_end && !batch.is_empty()) {
            let rows: Vec<(&[u32], &[u32])> = batch
                .iter()
                .map(|(i, s)| (i.as_slice(), s.as_slice()))
                .collect();
            let (inputs, _) = crate::batch::pad(&rows, &loaded.config, &options.device)?;
            let out = loaded.model.forward(&inputs, Mode::Eval, true)?;
            let states: Vec<Vec<Vec<Vec<f32>>>> = picks
                .iter()
                .map(|&p| {
                    out.hidden_states[p]
                        .to_dtype(DType::F32)?
                        .to_device(&Device::Cpu)?
                        .to_vec3::<f32>()
                })
                .collect::<candle_core::Result<_>>()?;
            let lines: Vec<Line> = batch
                .iter()
                .enumerate()
                .map(|(row, (ids, _))| Line {
                    ids,
                    tokens: ids
                        .iter()
                        .map(|&id| tokenizer.id_to_token(id).unwrap_or("[UNK]"))
                        .collect(),
                    layers: states
                        .iter()
                        .map(|layer| &layer[row][..ids.len()])
                        .collect(),
                })
                .collect();
            sink.lines(summary.lines, &lines)?;
            summary.lines += lines.len();
            summary.tokens += lines.iter().map(|l| l.ids.len()).sum::<usize>();
            batch.clear();
            progress(summary.lines);
        }
    }
    sink.finish()?;
    Ok(summary)
}

/// One line's features: its ids, tokens and each asked layer's `[tokens][hidden]` vectors.
struct Line<'a> {
    ids: &'a [u32],
    tokens: Vec<&'a str>,
    layers: Vec<&'a [Vec<f32>]>,
}

/// Where extracted lines go.
trait Sink {
    /// A batch of lines, the first of them line `first` of the input.
    fn lines(&mut self, first: usize, lines: &[Line]) -> Result<(), TaskError>;
    /// Completes the output (renamed into place).
    fn finish(self: Box<Self>) -> Result<(), TaskError>;
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TaskError + '_ {
    move |source| TaskError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A buffered file under its partial name, renamed to its name when finished; removed when
/// dropped unfinished (a run that fails leaves nothing behind).
struct PartialFile {
    path: PathBuf,
    partial: PathBuf,
    /// The open file, until [`PartialFile::finish`] takes it.
    file: Option<BufWriter<File>>,
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

impl PartialFile {
    fn create(path: &Path) -> Result<Self, TaskError> {
        let partial = bertkit_stage_io::partial_path(path);
        let file = File::create(&partial).map_err(io(&partial))?;
        Ok(PartialFile {
            path: path.to_path_buf(),
            partial,
            file: Some(BufWriter::with_capacity(1 << 20, file)),
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), TaskError> {
        let file = self
            .file
            .as_mut()
            .expect("a partial file is open until finished");
        file.write_all(bytes).map_err(io(&self.partial))
    }

    /// Flushes, lets `fix` rewrite the start of the file, syncs and renames.
    fn finish(mut self, header: Option<&[u8]>) -> Result<(), TaskError> {
        let writer = self.file.take().expect("a partial file is finished once");
        let partial = &self.partial;
        let done = (|| {
            let mut file = writer
                .into_inner()
                .map_err(|e| io(partial)(e.into_error()))?;
            if let Some(header) = header {
                file.seek(SeekFrom::Start(0))
                    .and_then(|_| file.write_all(header))
                    .map_err(io(partial))?;
            }
            file.sync_all().map_err(io(partial))?;
            std::fs::rename(partial, &self.path).map_err(io(&self.path))
        })();
        if done.is_err() {
            let _ = std::fs::remove_file(partial);
        }
        done
    }
}

struct JsonlSink {
    out: PartialFile,
    layers: Vec<i64>,
}

impl JsonlSink {
    fn create(path: &Path, layers: &[i64]) -> Result<Self, TaskError> {
        Ok(JsonlSink {
            out: PartialFile::create(path)?,
            layers: layers.to_vec(),
        })
    }
}

/// Appends `x` rounded to 6 decimals as Python's `round(x, 6)` rounds it (the decimal
/// correctly rounded, then the nearest double), printed as `json.dumps` prints it.
fn push_rounded(out: &mut String, x: f32, scratch: &mut String) {
    use std::fmt::Write as _;
    scratch.clear();
    let _ = write!(scratch, "{:.6}", x as f64);
    let six: f64 = scratch.parse().expect("a decimal");
    out.push_str(&crate::pyfloat::repr(six));
}

/// `x` rounded and printed as [`push_rounded`] does.
#[cfg(test)]
fn rounded(x: f32) -> String {
    let mut out = String::new();
    push_rounded(&mut out, x, &mut String::new());
    out
}

/// Line `index` in Google's layout (without the newline).
fn json_line(index: usize, asked: &[i64], line: &Line) -> String {
    use std::fmt::Write as _;
    let values: usize = line
        .layers
        .iter()
        .map(|l| l.len() * l.first().map_or(0, Vec::len))
        .sum();
    let mut t = String::with_capacity(64 + values * 12);
    let mut scratch = String::new();
    let _ = write!(t, "{{\"linex_index\": {index}, \"features\": [");
    for (i, token) in line.tokens.iter().enumerate() {
        if i > 0 {
            t.push_str(", ");
        }
        let token = serde_json::to_string(token).expect("a string serialises");
        let _ = write!(t, "{{\"token\": {token}, \"layers\": [");
        for (j, (layer, vectors)) in asked.iter().zip(&line.layers).enumerate() {
            if j > 0 {
                t.push_str(", ");
            }
            let _ = write!(t, "{{\"index\": {layer}, \"values\": [");
            for (k, &v) in vectors[i].iter().enumerate() {
                if k > 0 {
                    t.push_str(", ");
                }
                push_rounded(&mut t, v, &mut scratch);
            }
            t.push_str("]}");
        }
        t.push_str("]}");
    }
    t.push_str("]}");
    t
}

impl Sink for JsonlSink {
    fn lines(&mut self, first: usize, lines: &[Line]) -> Result<(), TaskError> {
        // Printing a value costs more than computing it on small models: the batch's lines
        // are printed in parallel, then written in order.
        let texts: Vec<String> = lines
            .par_iter()
            .enumerate()
            .map(|(i, line)| json_line(first + i, &self.layers, line))
            .collect();
        for text in texts {
            self.out.write(text.as_bytes())?;
            self.out.write(b"\n")?;
        }
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<(), TaskError> {
        self.out.finish(None)
    }
}

/// Bytes reserved for an npy header (magic, version, length, the dict padded with spaces):
/// room for any shape, so the header can be written last.
const NPY_HEADER: usize = 128;

/// An npy (version 1.0) header of `NPY_HEADER` bytes for a little-endian `descr` of `shape`.
fn npy_header(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    let mut header = b"\x93NUMPY\x01\x00".to_vec();
    header.extend_from_slice(&((NPY_HEADER - 10) as u16).to_le_bytes());
    header.extend_from_slice(dict.as_bytes());
    header.resize(NPY_HEADER - 1, b' ');
    header.push(b'\n');
    header
}

struct NpySink {
    folder: PathBuf,
    layers: Vec<(PartialFile, i64)>,
    ids: PartialFile,
    offsets: Vec<i64>,
    hidden: usize,
    tokens: usize,
}

impl NpySink {
    fn create(folder: &Path, layers: &[i64], hidden: usize) -> Result<Self, TaskError> {
        std::fs::create_dir_all(folder).map_err(io(folder))?;
        let placeholder = [0u8; NPY_HEADER];
        let mut files = Vec::new();
        for &l in layers {
            let mut f = PartialFile::create(&folder.join(format!("layer_{l}.npy")))?;
            f.write(&placeholder)?;
            files.push((f, l));
        }
        let mut ids = PartialFile::create(&folder.join("token_ids.npy"))?;
        ids.write(&placeholder)?;
        Ok(NpySink {
            folder: folder.to_path_buf(),
            layers: files,
            ids,
            offsets: vec![0],
            hidden,
            tokens: 0,
        })
    }
}

impl Sink for NpySink {
    fn lines(&mut self, _first: usize, lines: &[Line]) -> Result<(), TaskError> {
        for line in lines {
            for ((file, _), vectors) in self.layers.iter_mut().zip(&line.layers) {
                let bytes: Vec<u8> = vectors
                    .iter()
                    .flat_map(|row| row.iter().flat_map(|v| v.to_le_bytes()))
                    .collect();
                file.write(&bytes)?;
            }
            let bytes: Vec<u8> = line
                .ids
                .iter()
                .flat_map(|&i| (i as i32).to_le_bytes())
                .collect();
            self.ids.write(&bytes)?;
            self.tokens += line.ids.len();
            self.offsets.push(self.tokens as i64);
        }
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<(), TaskError> {
        let NpySink {
            folder,
            layers,
            ids,
            offsets,
            hidden,
            tokens,
        } = *self;
        for (file, _) in layers {
            file.finish(Some(&npy_header("<f4", &[tokens, hidden])))?;
        }
        ids.finish(Some(&npy_header("<i4", &[tokens])))?;
        let mut file = PartialFile::create(&folder.join("offsets.npy"))?;
        file.write(&npy_header("<i8", &[offsets.len()]))?;
        let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        file.write(&bytes)?;
        file.finish(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_and_rounding_as_google() {
        assert_eq!(parse_layers("-1,-2, -3,-4").unwrap(), [-1, -2, -3, -4]);
        assert_eq!(parse_layers("0").unwrap(), [0]);
        assert!(parse_layers("-1,x").unwrap_err().contains("\"x\""));
        assert_eq!(rounded(0.123_456_79), "0.123457");
        assert_eq!(rounded(-1.5), "-1.5");
        assert_eq!(rounded(2.0), "2.0");
        assert_eq!(rounded(-0.000_000_1), "-0.0");
        assert_eq!(rounded(0.000_012_3), "1.2e-05");
    }

    #[test]
    fn npy_headers_are_numpys() {
        let h = npy_header("<f4", &[12, 384]);
        assert_eq!(h.len(), NPY_HEADER);
        assert_eq!(&h[..8], b"\x93NUMPY\x01\x00");
        let text = std::str::from_utf8(&h[10..]).unwrap();
        assert!(text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (12, 384), }"));
        assert!(text.ends_with('\n'));
        assert!(
            std::str::from_utf8(&npy_header("<i8", &[5])[10..])
                .unwrap()
                .contains("'shape': (5,)")
        );
    }
}
