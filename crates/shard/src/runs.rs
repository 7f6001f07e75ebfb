//! External shuffle: every document gets a pseudo-random key from `(seed, ordinal)`; documents
//! are gathered into runs of at most `run_bytes`, each run is sorted by key and spilled to a
//! temporary file, and a k-way merge of the runs yields all documents in key order. That order
//! is a seeded pseudo-random permutation of the corpus, produced in bounded memory: one run in
//! memory while gathering, then [`FAN_IN`] read buffers and one document per run while merging.
//! More than [`FAN_IN`] runs are brought down to [`FAN_IN`] by merging the fewest runs that
//! does it, so only those runs' documents are written twice (a full extra pass would rewrite
//! the whole corpus). A corpus that fits in one run never touches the disk.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::error::ShardError;
use bertkit_stage_io::text::Document;

/// Runs merged at once: with the default 64 MiB runs, one merge takes up to 16 GiB of text.
/// Each run is an open file while merging, beside the shards being written: 256 keeps the two
/// under the usual limit of 1,024 open files for a few hundred shards.
pub const FAN_IN: usize = 256;

/// Read buffer per run while merging: [`FAN_IN`] of them is 16 MiB.
const RUN_READ_BUFFER: usize = 64 << 10;

/// A document with its shuffle key and its position in the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyed {
    /// Pseudo-random sort key.
    pub key: u64,
    /// Position of the document in the inputs (0-based, across all inputs); breaks key ties.
    pub ordinal: u64,
    /// The document.
    pub doc: Document,
}

/// The shuffle key of the document at `ordinal` for `seed`.
pub fn shuffle_key(seed: u64, ordinal: u64) -> u64 {
    use bertkit_rng::splitmix64;
    splitmix64(splitmix64(seed) ^ splitmix64(ordinal))
}

/// Gathers documents into sorted runs.
pub struct RunWriter<'a> {
    dir: PathBuf,
    run_bytes: usize,
    pool: &'a rayon::ThreadPool,
    buffered: Vec<Keyed>,
    bytes: usize,
    runs: Vec<PathBuf>,
}

/// Where the shuffled documents are: still in memory (one run), or in run files.
pub enum Shuffled {
    /// Sorted documents.
    InMemory(Vec<Keyed>),
    /// Sorted run files.
    Runs(Vec<PathBuf>),
}

impl<'a> RunWriter<'a> {
    /// Runs are written into `dir` (which must exist).
    pub fn new(dir: &Path, run_bytes: usize, pool: &'a rayon::ThreadPool) -> Self {
        RunWriter {
            dir: dir.to_path_buf(),
            run_bytes,
            pool,
            buffered: Vec::new(),
            bytes: 0,
            runs: Vec::new(),
        }
    }

    /// Adds a document; spills a sorted run when the buffer is full.
    pub fn push(&mut self, keyed: Keyed) -> Result<(), ShardError> {
        self.bytes += keyed.doc.text.len() + std::mem::size_of::<Keyed>();
        self.buffered.push(keyed);
        if self.bytes >= self.run_bytes {
            self.spill()?;
        }
        Ok(())
    }

    fn sort(&mut self) {
        let buffered = &mut self.buffered;
        self.pool
            .install(|| buffered.par_sort_unstable_by_key(|k| (k.key, k.ordinal)));
    }

    fn spill(&mut self) -> Result<(), ShardError> {
        self.sort();
        let path = self.dir.join(format!("run_{:06}.bin", self.runs.len()));
        write_run(&path, self.buffered.drain(..))?;
        self.runs.push(path);
        self.bytes = 0;
        Ok(())
    }

    /// Sorts what is left; everything stays in memory if nothing was spilled.
    pub fn finish(mut self) -> Result<Shuffled, ShardError> {
        if self.runs.is_empty() {
            self.sort();
            return Ok(Shuffled::InMemory(std::mem::take(&mut self.buffered)));
        }
        if !self.buffered.is_empty() {
            self.spill()?;
        }
        Ok(Shuffled::Runs(std::mem::take(&mut self.runs)))
    }
}

/// Writes sorted documents to a run file.
fn write_run(path: &Path, docs: impl Iterator<Item = Keyed>) -> Result<(), ShardError> {
    let file = File::create(path).map_err(|e| ShardError::io(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    for k in docs {
        write_record(&mut w, &k).map_err(|e| ShardError::io(path, e))?;
    }
    w.flush().map_err(|e| ShardError::io(path, e))
}

/// Record layout: key u64, ordinal u64, sentences u32, text length u32 (all little-endian),
/// then the text. Documents longer than 4 GiB cannot be written.
fn write_record(w: &mut impl Write, k: &Keyed) -> std::io::Result<()> {
    let len = u32::try_from(k.doc.text.len()).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a document is larger than 4 GiB",
        )
    })?;
    w.write_all(&k.key.to_le_bytes())?;
    w.write_all(&k.ordinal.to_le_bytes())?;
    w.write_all(&k.doc.sentences.to_le_bytes())?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(&k.doc.text)
}

struct RunReader {
    path: PathBuf,
    r: BufReader<File>,
}

impl RunReader {
    fn open(path: &Path) -> Result<Self, ShardError> {
        let file = File::open(path).map_err(|e| ShardError::io(path, e))?;
        Ok(RunReader {
            path: path.to_path_buf(),
            r: BufReader::with_capacity(RUN_READ_BUFFER, file),
        })
    }

    fn next(&mut self) -> Result<Option<Keyed>, ShardError> {
        let mut header = [0u8; 24];
        match self.r.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(ShardError::io(&self.path, e)),
        }
        let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().expect("8 bytes"));
        let half = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().expect("4 bytes"));
        let mut text = vec![0u8; half(20) as usize];
        self.r
            .read_exact(&mut text)
            .map_err(|e| ShardError::io(&self.path, e))?;
        Ok(Some(Keyed {
            key: word(0),
            ordinal: word(8),
            doc: Document {
                text,
                sentences: half(16),
            },
        }))
    }
}

/// Merges sorted runs, calling `sink` with every document in key order.
fn merge_into(
    runs: &[PathBuf],
    mut sink: impl FnMut(Keyed) -> Result<(), ShardError>,
) -> Result<(), ShardError> {
    let mut readers = runs
        .iter()
        .map(|p| RunReader::open(p))
        .collect::<Result<Vec<_>, _>>()?;
    let mut heads: Vec<Option<Keyed>> = Vec::with_capacity(readers.len());
    let mut heap = BinaryHeap::new();
    for (i, r) in readers.iter_mut().enumerate() {
        let head = r.next()?;
        if let Some(k) = &head {
            heap.push(Reverse((k.key, k.ordinal, i)));
        }
        heads.push(head);
    }
    while let Some(Reverse((_, _, i))) = heap.pop() {
        let doc = heads[i].take().expect("a head for every heap entry");
        let next = readers[i].next()?;
        if let Some(k) = &next {
            heap.push(Reverse((k.key, k.ordinal, i)));
        }
        heads[i] = next;
        sink(doc)?;
    }
    Ok(())
}

/// Calls `sink` with every document in key order, deleting run files as they are used.
pub fn for_each_in_order(
    shuffled: Shuffled,
    dir: &Path,
    mut sink: impl FnMut(Keyed) -> Result<(), ShardError>,
) -> Result<(), ShardError> {
    let mut runs = match shuffled {
        Shuffled::InMemory(docs) => {
            for d in docs {
                sink(d)?;
            }
            return Ok(());
        }
        Shuffled::Runs(runs) => runs,
    };
    // Pre-merges until one merge can take all runs: each merges the fewest runs (up to FAN_IN)
    // that bring the count to FAN_IN, taking the first (original, smallest) runs and putting
    // the merged one last. The final order does not depend on the grouping.
    let mut premerges = 0;
    while runs.len() > FAN_IN {
        let take = (runs.len() - FAN_IN + 1).min(FAN_IN);
        let group: Vec<PathBuf> = runs.drain(..take).collect();
        let path = dir.join(format!("merge_{premerges:06}.bin"));
        let file = File::create(&path).map_err(|e| ShardError::io(&path, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        merge_into(&group, |k| {
            write_record(&mut w, &k).map_err(|e| ShardError::io(&path, e))
        })?;
        w.flush().map_err(|e| ShardError::io(&path, e))?;
        for r in &group {
            fs::remove_file(r).map_err(|e| ShardError::io(r, e))?;
        }
        runs.push(path);
        premerges += 1;
    }
    merge_into(&runs, &mut sink)?;
    for r in &runs {
        fs::remove_file(r).map_err(|e| ShardError::io(r, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(i: u64) -> Keyed {
        let text = format!("sentence {i}\n").into_bytes();
        Keyed {
            key: shuffle_key(7, i),
            ordinal: i,
            doc: Document { text, sentences: 1 },
        }
    }

    fn collect(run_bytes: usize, n: u64) -> Vec<u64> {
        let dir = tempfile::tempdir().unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let mut w = RunWriter::new(dir.path(), run_bytes, &pool);
        for i in 0..n {
            w.push(doc(i)).unwrap();
        }
        let mut order = Vec::new();
        for_each_in_order(w.finish().unwrap(), dir.path(), |k| {
            order.push(k.ordinal);
            Ok(())
        })
        .unwrap();
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            0,
            "run files left behind"
        );
        order
    }

    #[test]
    fn in_memory_single_pass_and_multi_pass_merges_give_the_same_order() {
        let n = 5000;
        let in_memory = collect(usize::MAX, n);
        let mut sorted = in_memory.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            (0..n).collect::<Vec<_>>(),
            "every document exactly once"
        );
        assert_ne!(in_memory[..10], sorted[..10], "the order is shuffled");
        // ~100 documents per run: 50 runs, one merge; ~16: ~312 runs, one pre-merge of ~57
        // runs first; ~2: ~2,500 runs, eight pre-merges of FAN_IN runs and one of the rest.
        for docs_per_run in [100, 16, 2] {
            let run_bytes = docs_per_run * (std::mem::size_of::<Keyed>() + 14);
            assert_eq!(collect(run_bytes, n), in_memory, "{docs_per_run} per run");
        }
    }
}
