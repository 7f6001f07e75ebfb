//! Wikipedia dumps to formatted text: the driver that ties reading, parsing, cleaning and
//! writing together.
//!
//! Data flow for each input, in dump order:
//! `source` (producer thread: read, decompress, cut into page-aligned segments)
//! → bounded channel → batches of segments parsed and cleaned in parallel on a rayon pool
//! (`pages`, `markup`, sentence splitting) → documents written in order by the
//! [`ShardedTextWriter`](crate::output::ShardedTextWriter). Output is byte-identical whatever
//! the thread count and whatever the compression of the input.

pub mod markup;
pub mod pages;
pub mod source;

use std::path::{Path, PathBuf};
use std::sync::mpsc::{TryRecvError, sync_channel};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::FormatError;
use bertkit_stage_io::stage::{Event, Outcome, Reporter};

use crate::manifest::FormatManifest;
use crate::progress::Snapshot;
use crate::run::Run;
pub use markup::CleanOptions;
pub use pages::WikiCounts;
pub use source::InputKind;

/// Name prefix of wiki output files and manifest.
pub const KIND: &str = "wiki";

/// Options of a wiki run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WikiOptions {
    /// What markup-bearing content to keep.
    pub clean: CleanOptions,
    /// Keep disambiguation pages (skipped by default).
    pub keep_disambiguation: bool,
    /// Largest output file, in bytes (a single larger document gets a file of its own).
    pub max_bytes: u64,
    /// Worker threads (0: one per core).
    #[serde(skip)]
    pub threads: usize,
    /// Fail on a page with invalid UTF-8 instead of skipping it.
    pub strict: bool,
    /// Target size of the page-aligned segments handed to workers.
    #[serde(skip)]
    pub segment_bytes: usize,
}

impl Default for WikiOptions {
    fn default() -> Self {
        WikiOptions {
            clean: CleanOptions::default(),
            keep_disambiguation: false,
            max_bytes: crate::DEFAULT_MAX_BYTES,
            threads: 0,
            strict: false,
            segment_bytes: 1 << 20,
        }
    }
}

/// Formats Wikipedia dumps (`.xml`, `.xml.bz2`, multistream `.xml.bz2`, in any mix) into
/// `output_dir/wiki_NNNNN.txt` and `output_dir/wiki.manifest.json`.
///
/// Skips the work (returning [`Outcome::UpToDate`]) when the manifest there records the same
/// inputs and options and its files are in place.
pub fn format_wiki(
    inputs: &[PathBuf],
    output_dir: &Path,
    options: &WikiOptions,
    reporter: &dyn Reporter,
) -> Result<Outcome<FormatManifest>, FormatError> {
    if inputs.is_empty() {
        return Err(FormatError::Usage("no input dump given".into()));
    }
    let kinds = inputs
        .iter()
        .map(|p| source::detect(p))
        .collect::<Result<Vec<_>, _>>()?;
    let parameters = serde_json::to_value(options).expect("options serialise");
    let mut run = match Run::begin(
        KIND,
        inputs,
        output_dir,
        parameters,
        options.threads,
        options.max_bytes,
    )? {
        Ok(run) => run,
        Err(up_to_date) => return Ok(Outcome::UpToDate(up_to_date)),
    };
    let mut counts = WikiCounts::default();
    let batch = run.threads * 2;
    for (index, (path, kind)) in inputs.iter().zip(&kinds).enumerate() {
        reporter.report(&Event::Message(&format!(
            "reading {} ({})",
            path.display(),
            kind_name(*kind)
        )));
        let (tx, rx) = sync_channel(batch * 2);
        let producer = {
            let (path, kind, pool, segment_bytes) =
                (path.clone(), *kind, run.pool.clone(), options.segment_bytes);
            std::thread::Builder::new()
                .name("bertkit-format-reader".into())
                .spawn(move || source::produce(path, kind, segment_bytes, pool, tx))
                .map_err(|e| FormatError::io(&inputs[index], e))?
        };
        let mut done = None;
        let mut saw_root_end = false;
        while done.is_none() {
            // Block for one segment, then take what is ready, up to a batch.
            let mut segments = Vec::with_capacity(batch);
            let mut next = rx.recv().ok();
            while let Some(message) = next.take() {
                match message {
                    source::SourceMessage::Segment(s) => segments.push(s),
                    source::SourceMessage::Done { sha256, xml_bytes } => {
                        done = Some((sha256, xml_bytes))
                    }
                    source::SourceMessage::Failed(e) => return Err(e),
                }
                if segments.len() < batch && done.is_none() {
                    next = match rx.try_recv() {
                        Ok(m) => Some(m),
                        Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => None,
                    };
                }
            }
            if segments.is_empty() && done.is_none() {
                // The producer ended without saying so: it panicked.
                return Err(FormatError::Usage(format!(
                    "the reader of {} stopped unexpectedly",
                    path.display()
                )));
            }
            let outcomes: Vec<_> = run.pool.install(|| {
                segments
                    .par_iter()
                    .map(|s| pages::process_segment(path, s.offset, &s.bytes, options))
                    .collect()
            });
            for outcome in outcomes {
                let outcome = outcome?;
                if saw_root_end && outcome.counts.pages_seen > 0 {
                    return Err(FormatError::Xml {
                        path: path.clone(),
                        offset: counts.xml_bytes,
                        message: "pages after the closing </mediawiki>".into(),
                    });
                }
                saw_root_end |= outcome.saw_root_end;
                for doc in &outcome.documents {
                    run.writer.write(doc)?;
                }
                for w in outcome.warnings {
                    run.warn(reporter, w);
                }
                counts.add(&outcome.counts);
            }
            Snapshot {
                input: index,
                inputs: inputs.len(),
                items: counts.pages_seen,
                unit: "pages",
                documents: counts.articles_written,
                input_bytes: counts.xml_bytes,
                output_bytes: counts.bytes,
            }
            .report(reporter);
        }
        let _ = producer.join();
        let (sha256, xml_bytes) = done.expect("loop ends on Done");
        if !saw_root_end {
            return Err(FormatError::Xml {
                path: path.clone(),
                offset: xml_bytes,
                message: "truncated XML: the dump ends without its closing </mediawiki> tag".into(),
            });
        }
        run.inputs[index].sha256 = sha256;
    }
    run.finish(counts)
}

fn kind_name(kind: InputKind) -> &'static str {
    match kind {
        InputKind::Xml => "XML",
        InputKind::Bzip2 => "bzip2, single stream: decoding on one thread",
        InputKind::Bzip2Multistream => "bzip2 multistream: decoding in parallel",
    }
}
