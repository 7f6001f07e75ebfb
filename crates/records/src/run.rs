//! A records run: formatted text or shards in, Parquet (and optionally JSONL) out.
//!
//! - **File mode** (output ends in `.parquet`): every input is read, in order, as one corpus.
//!   With `--compat google`, one CPython generator seeded with `seed` makes the instances, exactly
//!   as Google's `create_pretraining_data.py` does with the same inputs, vocabulary and flags.
//!   By default, documents are processed in parallel, each (pass, document) with its own
//!   generator: the same algorithm and statistics, and a result that depends on the seed but
//!   not on the thread count.
//! - **Directory mode** (any other output): every input shard becomes
//!   `OUTPUT/<shard name>.parquet`, shards in parallel (memory: one shard per worker). Each
//!   shard is an independent run. With `--compat google` its seed is `seed`, which is what running
//!   Google's script on each shard gives (NVIDIA's recipe does that). By default the seed is
//!   derived from `seed` and the shard's name, so shards draw independent masks. Either way the
//!   output does not depend on the thread count. An output whose metadata records the same
//!   input (path and size, and modification time or else contents: see
//!   `bertkit_stage_io::InputFile::same_file_as`), vocabulary and parameters is skipped.

use std::path::{Path, PathBuf};

use bertkit_stage_io::stage::{Event, Outcome, Reporter};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::corpus::Corpus;
use crate::instances::{
    InstanceOptions, Instances, VocabIds, create_instances, create_instances_google,
};
use bertkit_tokenizer::FullTokenizer;

/// How seeds are given to shards in directory mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compat {
    /// Each shard's seed is derived from the seed and the shard's name.
    None,
    /// Each shard is seeded with the seed itself, as Google's script run per shard.
    Google,
}

/// Everything that determines a records file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordsOptions {
    /// Instance generation.
    pub instances: InstanceOptions,
    /// Uncased vocabulary (lower-casing and accent stripping).
    pub lower_case: bool,
    /// Seeding of shards in directory mode.
    pub compat: Compat,
}

/// Why a records run failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordsError {
    /// Reading an input failed (unreadable, or a line not UTF-8).
    #[error(transparent)]
    Read(#[from] bertkit_stage_io::text::TextError),
    /// An input could not be looked at.
    #[error("{path}: {source}")]
    Input {
        /// The input.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The vocabulary is unusable.
    #[error(transparent)]
    Vocab(#[from] bertkit_tokenizer::VocabError),
    /// Writing an output failed.
    #[error("{path}: {source}")]
    Write {
        /// The output.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Bad arguments or an input without documents.
    #[error("{0}")]
    Usage(String),
}

impl FileSummary {
    /// Tells `reporter` the file is finished: what it holds and where the time went.
    pub fn report(&self, reporter: &dyn Reporter) {
        let summary = if self.skipped {
            "up to date, skipped".to_string()
        } else {
            format!(
                "{} instances from {} documents (tokenize {:.3} s, instances {:.3} s, write {:.3} s)",
                self.instances,
                self.documents,
                self.seconds.tokenize,
                self.seconds.instances,
                self.seconds.write
            )
        };
        reporter.report(&Event::Finished {
            task: &self.output.display().to_string(),
            summary: &summary,
            up_to_date: self.skipped,
        });
    }
}

/// What one output file holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileSummary {
    /// The Parquet file.
    pub output: PathBuf,
    /// Documents read.
    pub documents: usize,
    /// Instances written.
    pub instances: usize,
    /// Tokens in all instances.
    pub tokens: usize,
    /// Whether the file was already complete and was skipped.
    pub skipped: bool,
    /// Where the time went (zero when skipped).
    pub seconds: StepSeconds,
}

/// Seconds spent in each step of making one output (wall clock; in file mode the reading and
/// tokenizing of all inputs counts once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepSeconds {
    /// Reading, checking and tokenizing the input text.
    pub tokenize: f64,
    /// Making the instances (packing, pairing, masking, shuffling).
    pub instances: f64,
    /// Writing the Parquet file (and JSONL when asked).
    pub write: f64,
}

/// Reads documents (one sentence per line, blank lines between documents; `.txt` or
/// `.txt.zst`) and tokenizes them; sentences that tokenize to nothing are dropped, as Google's
/// script drops them. Returns the documents and the input's fingerprint.
pub fn read_tokenized(
    path: &Path,
    tokenizer: &FullTokenizer,
) -> Result<(Corpus, bertkit_stage_io::InputFile), RecordsError> {
    let mut corpus = Corpus::default();
    let fingerprint = read_tokenized_into(path, tokenizer, &mut corpus)?;
    Ok((corpus, fingerprint))
}

/// Bytes of text per parallel tokenization task.
const TOKENIZE_CHUNK_BYTES: usize = 256 << 10;

/// [`read_tokenized`], appending the documents to `corpus`.
pub fn read_tokenized_into(
    path: &Path,
    tokenizer: &FullTokenizer,
    corpus: &mut Corpus,
) -> Result<bertkit_stage_io::InputFile, RecordsError> {
    let (chunks, fingerprint) = tokenize_file(path, tokenizer, &mut String::new())?;
    append_chunks(corpus, vec![chunks]);
    Ok(fingerprint)
}

/// A chunk of a file's lines, tokenized: all their sentences' ids, each sentence's end in
/// them, and the number of sentences before each blank line (document boundary).
#[derive(Default)]
struct TokenizedChunk {
    ids: Vec<u32>,
    ends: Vec<usize>,
    breaks: Vec<usize>,
}

/// Takes a file whole (a plain file memory-mapped, a compressed one read into `text`, whose
/// buffer is reused from file to file), cuts it at line
/// starts into chunks of about [`TOKENIZE_CHUNK_BYTES`] and tokenizes the chunks in parallel
/// (a book is one document of thousands of lines). The shard's tokens are held anyway, and
/// take about as much memory as its text.
fn tokenize_file(
    path: &Path,
    tokenizer: &FullTokenizer,
    text: &mut String,
) -> Result<(Vec<TokenizedChunk>, bertkit_stage_io::InputFile), RecordsError> {
    let mut fingerprint =
        bertkit_stage_io::InputFile::stat(path).map_err(|source| RecordsError::Input {
            path: path.into(),
            source,
        })?;
    let (whole, sha256) = bertkit_stage_io::text::DocumentReader::open(path)?.whole_text(text)?;
    fingerprint.sha256 = sha256;
    let text = whole.as_str();
    let mut chunks = Vec::with_capacity(text.len() / TOKENIZE_CHUNK_BYTES + 1);
    let mut rest = text;
    while rest.len() > TOKENIZE_CHUNK_BYTES {
        let cut = rest.as_bytes()[TOKENIZE_CHUNK_BYTES..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(rest.len(), |i| TOKENIZE_CHUNK_BYTES + i + 1);
        let (chunk, after) = rest.split_at(cut);
        chunks.push(chunk);
        rest = after;
    }
    chunks.push(rest);
    let tokenized = chunks
        .par_iter()
        .map(|chunk| {
            let mut out = TokenizedChunk {
                // About one token per four bytes of English text.
                ids: Vec::with_capacity(chunk.len() / 4),
                ..TokenizedChunk::default()
            };
            for line in bertkit_stage_io::text::lines(chunk) {
                match line {
                    Some(line) => {
                        tokenizer.extend_ids(line, &mut out.ids);
                        // A sentence that tokenizes to nothing is dropped.
                        if out.ids.len() > out.ends.last().copied().unwrap_or(0) {
                            out.ends.push(out.ids.len());
                        }
                    }
                    None => out.breaks.push(out.ends.len()),
                }
            }
            out
        })
        .collect();
    Ok((tokenized, fingerprint))
}

/// Appends the documents of tokenized files (each file's chunks in order) to `corpus`; each
/// file starts a new document.
fn append_chunks(corpus: &mut Corpus, files: Vec<Vec<TokenizedChunk>>) {
    // Room for all at once, so the corpus does not grow by doubling (each growth copies into
    // fresh pages, and page faults are a large share of this stage's time).
    let chunks = || files.iter().flatten();
    corpus.reserve(
        chunks().map(|c| c.ids.len()).sum(),
        chunks().map(|c| c.ends.len()).sum(),
        chunks().map(|c| c.breaks.len() + 1).sum(),
    );
    for file in files {
        corpus.end_document();
        for chunk in file {
            let mut breaks = chunk.breaks.iter().peekable();
            let mut start = 0;
            for (sentence, &end) in chunk.ends.iter().enumerate() {
                while breaks.next_if(|&&b| b <= sentence).is_some() {
                    corpus.end_document();
                }
                corpus.push_sentence(&chunk.ids[start..end]);
                start = end;
            }
            if breaks.next().is_some() {
                corpus.end_document();
            }
        }
    }
    corpus.end_document();
}

fn metadata(
    options: &RecordsOptions,
    vocab: &Vocabulary,
    inputs: &[bertkit_stage_io::InputFile],
) -> Vec<(String, String)> {
    vec![
        (
            "bertkit.parameters".into(),
            serde_json::to_string(options).expect("options serialise"),
        ),
        ("bertkit.vocab_sha256".into(), vocab.sha256.clone()),
        (crate::reader::VOCAB_KEY.into(), vocab.text.clone()),
        (
            "bertkit.inputs".into(),
            serde_json::to_string(inputs).expect("inputs serialise"),
        ),
    ]
}

/// Whether `output` is a complete records file for these inputs, vocabulary and options.
fn is_current(
    output: &Path,
    options: &RecordsOptions,
    vocab_sha256: &str,
    inputs: &[bertkit_stage_io::InputFile],
) -> bool {
    let Some(kv) = crate::parquet_file::read_metadata(output) else {
        return false;
    };
    let get = |k: &str| kv.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    let recorded: Option<Vec<bertkit_stage_io::InputFile>> =
        get("bertkit.inputs").and_then(|v| serde_json::from_str(v).ok());
    get("bertkit.layout") == Some(crate::parquet_file::LAYOUT)
        && get("bertkit.parameters")
            == Some(
                serde_json::to_string(options)
                    .expect("options serialise")
                    .as_str(),
            )
        && get("bertkit.vocab_sha256") == Some(vocab_sha256)
        && get(crate::reader::VOCAB_KEY).is_some()
        && recorded.is_some_and(|r| bertkit_stage_io::same_inputs(&r, inputs))
}

fn write_outputs(
    output: &Path,
    jsonl: Option<&Path>,
    instances: &Instances,
    tokenizer: &FullTokenizer,
    metadata: &[(String, String)],
) -> Result<(), RecordsError> {
    crate::parquet_file::write_instances(output, instances, metadata).map_err(|e| {
        RecordsError::Write {
            path: output.into(),
            source: e.into(),
        }
    })?;
    if let Some(path) = jsonl {
        let mut text = String::new();
        instances.for_each(|i| {
            text.push_str(&i.to_reference_json(tokenizer).to_string());
            text.push('\n');
        });
        bertkit_stage_io::write_atomically(path, text.as_bytes()).map_err(|e| {
            RecordsError::Write {
                path: path.into(),
                source: e.into(),
            }
        })?;
    }
    Ok(())
}

/// Instances in the run's mode: the reference script's exact algorithm, or the parallel default.
fn generate<'a>(
    corpus: &'a Corpus,
    vocab: &'a VocabIds,
    options: &RecordsOptions,
) -> Instances<'a> {
    match options.compat {
        Compat::Google => create_instances_google(corpus, vocab, &options.instances),
        Compat::None => create_instances(corpus, vocab, &options.instances),
    }
}

/// The vocabulary of a run: its tokenizer, the ids instance generation needs, and its hash.
struct Vocabulary {
    tokenizer: FullTokenizer,
    ids: VocabIds,
    sha256: String,
    /// The file's text, stored in every output's metadata so the records name their vocabulary.
    text: String,
}

impl Vocabulary {
    fn load(path: &Path, lower_case: bool) -> Result<Self, RecordsError> {
        let text = bertkit_stage_io::read_text(path).map_err(|source| {
            bertkit_tokenizer::VocabError::Io {
                path: path.into(),
                source,
            }
        })?;
        let sha256 = bertkit_stage_io::hex(&Sha256::digest(text.as_bytes()));
        let tokenizer = FullTokenizer::from_vocab_text(path, &text, lower_case)?;
        let ids = VocabIds::new(&tokenizer).ok_or_else(|| {
            RecordsError::Usage(format!(
                "{}: the vocabulary lacks [CLS], [SEP] or [MASK]",
                path.display()
            ))
        })?;
        Ok(Vocabulary {
            tokenizer,
            ids,
            sha256,
            text,
        })
    }
}

/// What file and folder modes share once a corpus is read: makes its instances and writes them
/// (and the JSONL when asked), timing both steps.
fn instances_to_file(
    corpus: &Corpus,
    tokenize_seconds: f64,
    vocab: &Vocabulary,
    options: &RecordsOptions,
    output: &Path,
    jsonl: Option<&Path>,
    inputs: &[bertkit_stage_io::InputFile],
) -> Result<FileSummary, RecordsError> {
    let mut seconds = StepSeconds {
        tokenize: tokenize_seconds,
        ..StepSeconds::default()
    };
    let clock = std::time::Instant::now();
    let instances = generate(corpus, &vocab.ids, options);
    seconds.instances = clock.elapsed().as_secs_f64();
    let clock = std::time::Instant::now();
    write_outputs(
        output,
        jsonl,
        &instances,
        &vocab.tokenizer,
        &metadata(options, vocab, inputs),
    )?;
    seconds.write = clock.elapsed().as_secs_f64();
    Ok(FileSummary {
        output: output.into(),
        documents: corpus.len(),
        instances: instances.len(),
        tokens: instances.tokens(),
        skipped: false,
        seconds,
    })
}

/// File mode: all inputs as one corpus into one Parquet file (and optionally a JSONL file with
/// the reference script's instance fields). The file is always written: a single output is
/// what a comparison with the reference script asks for.
pub fn records_to_file(
    inputs: &[PathBuf],
    vocab: &Path,
    output: &Path,
    jsonl: Option<&Path>,
    options: &RecordsOptions,
) -> Result<Outcome<FileSummary>, RecordsError> {
    options.instances.validate().map_err(RecordsError::Usage)?;
    let vocab = Vocabulary::load(vocab, options.lower_case)?;
    let files = bertkit_stage_io::text::expand_text_inputs(inputs)?;
    let clock = std::time::Instant::now();
    let mut text = String::new();
    let mut tokenized = Vec::with_capacity(files.len());
    let mut fingerprints = Vec::with_capacity(files.len());
    for path in &files {
        let (chunks, fingerprint) = tokenize_file(path, &vocab.tokenizer, &mut text)?;
        tokenized.push(chunks);
        fingerprints.push(fingerprint);
    }
    drop(text);
    let mut documents = Corpus::default();
    append_chunks(&mut documents, tokenized);
    if documents.is_empty() {
        return Err(RecordsError::Usage("the inputs hold no document".into()));
    }
    let summary = instances_to_file(
        &documents,
        clock.elapsed().as_secs_f64(),
        &vocab,
        options,
        output,
        jsonl,
        &fingerprints,
    )?;
    Ok(Outcome::Ran(summary))
}

/// The seed of one shard in directory mode.
pub fn shard_seed(seed: u64, shard_name: &str, compat: Compat) -> u64 {
    match compat {
        Compat::Google => seed,
        Compat::None => {
            // FNV-1a of the name, mixed with the seed.
            let mut h = 0xCBF2_9CE4_8422_2325u64;
            for b in shard_name.bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3);
            }
            (seed ^ h) % (1 << 63)
        }
    }
}

/// Directory mode: every input shard into `output_dir/<name>.parquet`, in parallel.
pub fn records_to_dir(
    inputs: &[PathBuf],
    vocab: &Path,
    output_dir: &Path,
    options: &RecordsOptions,
    reporter: &dyn Reporter,
) -> Result<Outcome<Vec<FileSummary>>, RecordsError> {
    options.instances.validate().map_err(RecordsError::Usage)?;
    let vocab = Vocabulary::load(vocab, options.lower_case)?;
    let files = bertkit_stage_io::text::expand_text_inputs(inputs)?;
    std::fs::create_dir_all(output_dir).map_err(|e| RecordsError::Write {
        path: output_dir.into(),
        source: e.into(),
    })?;
    let mut names = std::collections::HashSet::new();
    for f in &files {
        if !names.insert(stem(f)) {
            return Err(RecordsError::Usage(format!(
                "two inputs are named {}: outputs would collide",
                stem(f)
            )));
        }
    }
    let summaries = files
        .par_iter()
        .map(|path| {
            let name = stem(path);
            let output = output_dir.join(format!("{name}.parquet"));
            let mut shard_options = options.clone();
            shard_options.instances.seed =
                shard_seed(options.instances.seed, &name, options.compat);
            let stat =
                bertkit_stage_io::InputFile::stat(path).map_err(|source| RecordsError::Input {
                    path: path.clone(),
                    source,
                })?;
            if is_current(
                &output,
                &shard_options,
                &vocab.sha256,
                std::slice::from_ref(&stat),
            ) {
                let summary = FileSummary {
                    output,
                    documents: 0,
                    instances: 0,
                    tokens: 0,
                    skipped: true,
                    seconds: StepSeconds::default(),
                };
                summary.report(reporter);
                return Ok(summary);
            }
            let clock = std::time::Instant::now();
            let (documents, fingerprint) = read_tokenized(path, &vocab.tokenizer)?;
            if documents.is_empty() {
                return Err(RecordsError::Usage(format!(
                    "{}: no document",
                    path.display()
                )));
            }
            let summary = instances_to_file(
                &documents,
                clock.elapsed().as_secs_f64(),
                &vocab,
                &shard_options,
                &output,
                None,
                std::slice::from_ref(&fingerprint),
            )?;
            summary.report(reporter);
            Ok(summary)
        })
        .collect::<Result<Vec<_>, RecordsError>>()?;
    Ok(if summaries.iter().all(|s| s.skipped) {
        Outcome::UpToDate(summaries)
    } else {
        Outcome::Ran(summaries)
    })
}

/// A shard's name without `.txt` / `.txt.zst`.
fn stem(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.strip_suffix(".txt.zst")
        .or_else(|| name.strip_suffix(".txt"))
        .unwrap_or(&name)
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reading whole and tokenizing in chunks gives the documents that reading document by
    /// document gives, with documents and blank-line runs across chunk edges, CRLF, and lines
    /// that tokenize to nothing.
    #[test]
    fn chunked_reading_equals_reading_document_by_document() {
        let dir = tempfile::tempdir().unwrap();
        let vocab_path = dir.path().join("vocab.txt");
        let mut vocab = String::from("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n.\n");
        for c in 'a'..='z' {
            vocab.push_str(&format!("{c}\n##{c}\n"));
        }
        std::fs::write(&vocab_path, vocab).unwrap();
        let tokenizer = FullTokenizer::from_vocab_file(&vocab_path, true).unwrap();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move |n: u64| {
            state = bertkit_rng::splitmix64(state);
            state % n
        };
        // The first chunk ends just after a blank line.
        let mut text = "ab ".repeat(TOKENIZE_CHUNK_BYTES / 3);
        text.truncate(TOKENIZE_CHUNK_BYTES - 1);
        text.push_str("\n\n");
        while text.len() < 3 * TOKENIZE_CHUNK_BYTES + 1000 {
            match next(20) {
                0 => text.push('\n'),
                1 => text.push_str(" \t\r\n"),
                2 => text.push_str("\u{1}\n"),
                3 => text.push_str("Crlf line.\r\n"),
                // A line that is not ASCII (the general path, between ASCII lines).
                4 => text.push_str("Caf\u{e9} na\u{ef}ve, xxxxxxxxxxxxxxxxxxxx.\n"),
                // Long documents: some span whole chunks.
                _ => {
                    let bound = if next(50) == 0 { 20_000 } else { 30 };
                    for _ in 0..1 + next(bound) {
                        text.push_str(["Word ", "two words. ", "x", "Ab cd."][next(4) as usize]);
                    }
                    text.push('\n');
                }
            }
        }
        let path = dir.path().join("shard.txt");
        std::fs::write(&path, &text).unwrap();

        let (corpus, fingerprint) = read_tokenized(&path, &tokenizer).unwrap();
        let mut reader = bertkit_stage_io::text::DocumentReader::open(&path).unwrap();
        let mut documents = Vec::new();
        while let Some(doc) = reader.next_document().unwrap() {
            let doc = String::from_utf8(doc.text).unwrap();
            documents.push(
                doc.lines()
                    .map(|line| tokenizer.tokenize_ids(line))
                    .collect::<Vec<_>>(),
            );
        }
        let expected = Corpus::from_documents(documents);
        assert!(expected.len() > 50, "{} documents", expected.len());
        assert_eq!(corpus, expected);
        assert_eq!(fingerprint.sha256, reader.finish().unwrap());

        // Appending a second file starts a new document.
        let mut both = corpus.clone();
        read_tokenized_into(&path, &tokenizer, &mut both).unwrap();
        assert_eq!(both.len(), 2 * corpus.len());
        assert_eq!(
            both.to_documents(),
            [corpus.to_documents(), corpus.to_documents()].concat()
        );
    }
}
