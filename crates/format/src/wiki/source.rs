//! Reading a dump into page-aligned segments of decompressed XML.
//!
//! Three inputs are recognised by their first bytes (not their names):
//! - plain XML, read in blocks;
//! - single-stream bzip2, decoded sequentially on the producer thread (while parsing and
//!   cleaning run on the worker pool);
//! - multistream bzip2 (many concatenated bzip2 streams, as Wikipedia publishes
//!   `pages-articles-multistream.xml.bz2`), recognised by a second stream header within the
//!   first [`MULTISTREAM_PROBE_BYTES`]. Stream boundaries are found by scanning for the stream
//!   header (`BZh1`–`BZh9` followed by the block magic `0x314159265359`) as the file is read;
//!   each stream is decoded as its own task on the worker pool by an independent decoder that
//!   must end exactly where the next stream starts, up to `3 × threads` streams ahead of the
//!   one being consumed (a sliding window, so no core waits for a batch to finish).
//!
//! Decompressed bytes are cut into segments just before a `<page>` tag (which cannot occur
//! unescaped inside text), so every segment holds whole pages and segments can be parsed
//! independently. Segment boundaries never change the output: pages are cleaned one by one and
//! written in dump order.
//!
//! The producer runs on its own thread and hands segments over a bounded channel, so memory
//! holds at most `queue` segments plus the batch being decoded; see the crate docs for the bound.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use bertkit_stage_io::HashingReader;
use memchr::memmem;

use crate::error::FormatError;

/// How far into a bzip2 file a second stream header is looked for.
pub const MULTISTREAM_PROBE_BYTES: usize = 16 << 20;

/// A multistream stream larger than this (compressed) switches the rest of the file to
/// sequential decoding, which keeps memory bounded whatever the stream sizes.
const MAX_PARALLEL_STREAM_BYTES: usize = 64 << 20;

/// Streams decoded ahead of the one being consumed, per worker thread.
const MULTISTREAM_WINDOW_PER_THREAD: usize = 3;

/// The block magic that follows `BZh1`..`BZh9` at the start of every bzip2 stream.
const BLOCK_MAGIC: &[u8] = &[0x31, 0x41, 0x59, 0x26, 0x53, 0x59];

/// What kind of input a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputKind {
    /// Uncompressed XML.
    Xml,
    /// One bzip2 stream (or several, decoded one after the other).
    Bzip2,
    /// Many bzip2 streams, decoded in parallel.
    Bzip2Multistream,
}

/// A run of decompressed XML holding whole `<page>` elements.
#[derive(Debug)]
pub struct Segment {
    /// Byte offset of `bytes[0]` in the decompressed XML.
    pub offset: u64,
    /// The XML.
    pub bytes: Vec<u8>,
}

/// What the producer sends.
#[derive(Debug)]
pub enum SourceMessage {
    /// The next segment, in dump order.
    Segment(Segment),
    /// The input has been read completely.
    Done {
        /// SHA-256 of the file's bytes.
        sha256: String,
        /// Decompressed bytes.
        xml_bytes: u64,
    },
    /// Reading stopped with an error.
    Failed(FormatError),
}

fn bzip2_header_at(b: &[u8], i: usize) -> bool {
    b.len() >= i + 10
        && &b[i..i + 3] == b"BZh"
        && (b'1'..=b'9').contains(&b[i + 3])
        && &b[i + 4..i + 10] == BLOCK_MAGIC
}

/// Offsets of bzip2 stream headers in `b` at or after `from`.
fn stream_starts(b: &[u8], from: usize) -> impl Iterator<Item = usize> + '_ {
    memmem::find_iter(&b[from..], BLOCK_MAGIC)
        .map(move |i| from + i)
        .filter(|&i| i >= 4 && bzip2_header_at(b, i - 4))
        .map(|i| i - 4)
        .filter(move |&start| start >= from)
}

/// Recognises the input kind from the file's first bytes. Reads a few KB, and for bzip2 input
/// as far as the second stream header (at most [`MULTISTREAM_PROBE_BYTES`]).
pub fn detect(path: &Path) -> Result<InputKind, FormatError> {
    let mut f = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let mut head = Vec::new();
    let mut read_up_to = |head: &mut Vec<u8>, limit: usize| -> Result<bool, FormatError> {
        let want = (limit - head.len()) as u64;
        let n = (&mut f)
            .take(want)
            .read_to_end(head)
            .map_err(|e| FormatError::io(path, e))?;
        Ok(n as u64 == want)
    };
    read_up_to(&mut head, 4096)?;
    if head.starts_with(b"BZh") {
        if !bzip2_header_at(&head, 0) {
            return Err(FormatError::Bzip2 {
                path: path.into(),
                offset: 0,
                message: "bad stream header".into(),
            });
        }
        let mut probed = 4096;
        loop {
            if stream_starts(&head, 1).next().is_some() {
                return Ok(InputKind::Bzip2Multistream);
            }
            if probed >= MULTISTREAM_PROBE_BYTES
                || !read_up_to(&mut head, (probed * 4).min(MULTISTREAM_PROBE_BYTES))?
            {
                return Ok(InputKind::Bzip2);
            }
            probed = head.len();
        }
    }
    let text = head.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&head);
    let first = text.iter().position(|c| !c.is_ascii_whitespace());
    match first.map(|i| &text[i..]) {
        Some(t) if t.starts_with(b"<") => Ok(InputKind::Xml),
        _ => Err(FormatError::Unsupported {
            path: path.into(),
            message: "not a Wikipedia XML dump: expected XML (starting with '<') or bzip2 data"
                .into(),
        }),
    }
}

/// Cuts decompressed XML into page-aligned segments.
struct PageCutter {
    carry: Vec<u8>,
    offset: u64,
    target: usize,
    /// How far `carry` has been searched for a page start after its first byte without one
    /// being found: later searches look only at what came after (less the tag's length).
    searched: usize,
    /// The most bytes one page (or the text before the first) may take: see [`MAX_PAGE_BYTES`].
    max_page: usize,
    finder: memmem::FinderRev<'static>,
}

/// The tag segments are cut before.
const PAGE_TAG: &[u8] = b"<page>";

/// The most XML bytes from one page start to the next (or before the first) that the cutter
/// gathers before it gives up: enwiki's largest pages are a few MB (MediaWiki caps a page's
/// text at 2 MB, and escaping at most triples it), so a run this long without a page start is
/// not a dump's, and gathering it would hold all of it in memory.
const MAX_PAGE_BYTES: usize = 256 << 20;

impl PageCutter {
    fn new(target: usize) -> Self {
        Self::with_max_page(target, MAX_PAGE_BYTES)
    }

    fn with_max_page(target: usize, max_page: usize) -> Self {
        PageCutter {
            carry: Vec::new(),
            offset: 0,
            target,
            searched: 0,
            max_page,
            finder: memmem::FinderRev::new(PAGE_TAG),
        }
    }

    /// Appends bytes; returns a segment when enough whole pages have gathered, or an error
    /// (naming the XML offset where the overlong page starts) when one page passes
    /// `max_page` bytes.
    fn push(&mut self, data: &[u8]) -> Result<Option<Segment>, FormatErrorAt> {
        self.carry.extend_from_slice(data);
        if self.carry.len() < self.target {
            return Ok(None);
        }
        // Searching the whole carry again each time would be quadratic in a page larger than
        // the target (the fuzzer found a small bzip2 stream decoding to megabytes without one).
        let from = self.searched.saturating_sub(PAGE_TAG.len() - 1);
        match self.finder.rfind(&self.carry[from..]).map(|i| from + i) {
            Some(cut) if cut > 0 => {
                let rest = self.carry[cut..].to_vec();
                self.carry.truncate(cut);
                // `cut` is the last page start: the rest holds none after its first byte.
                self.searched = rest.len();
                let bytes = std::mem::replace(&mut self.carry, rest);
                let seg = Segment {
                    offset: self.offset,
                    bytes,
                };
                self.offset += cut as u64;
                Ok(Some(seg))
            }
            // One page larger than the target: keep gathering until it ends.
            _ => {
                self.searched = self.carry.len();
                if self.carry.len() > self.max_page {
                    return Err(FormatErrorAt {
                        offset: self.offset,
                        message: format!(
                            "no page starts in the {} MiB from here (a <page> tag), and no \
                             Wikipedia page is that large: is this a MediaWiki XML dump?",
                            self.max_page >> 20
                        ),
                    });
                }
                Ok(None)
            }
        }
    }

    fn finish(self) -> Option<Segment> {
        (!self.carry.is_empty()).then_some(Segment {
            offset: self.offset,
            bytes: self.carry,
        })
    }

    fn total(&self) -> u64 {
        self.offset + self.carry.len() as u64
    }
}

/// Where in the decompressed XML the cutter stopped, and why (made a [`FormatError::Xml`] by
/// the caller, which knows the path).
#[derive(Debug)]
struct FormatErrorAt {
    offset: u64,
    message: String,
}

impl FormatErrorAt {
    fn at(self, path: &Path) -> FormatError {
        FormatError::Xml {
            path: path.into(),
            offset: self.offset,
            message: self.message,
        }
    }
}

/// Reads `path` and sends its segments, then `Done` (or `Failed`), over `tx`. Runs on the
/// calling thread; parallel decoding of multistream input uses `pool`.
pub fn produce(
    path: PathBuf,
    kind: InputKind,
    segment_bytes: usize,
    pool: Arc<rayon::ThreadPool>,
    tx: SyncSender<SourceMessage>,
) {
    let result = match kind {
        InputKind::Xml | InputKind::Bzip2 => produce_sequential(&path, kind, segment_bytes, &tx),
        InputKind::Bzip2Multistream => produce_multistream(&path, segment_bytes, &pool, &tx),
    };
    let message = match result {
        Ok(Some((sha256, xml_bytes))) => SourceMessage::Done { sha256, xml_bytes },
        Ok(None) => return, // the consumer hung up
        Err(e) => SourceMessage::Failed(e),
    };
    let _ = tx.send(message);
}

/// Sends a segment; `false` when the consumer is gone.
fn send(tx: &SyncSender<SourceMessage>, seg: Option<Segment>) -> bool {
    match seg {
        Some(s) => tx.send(SourceMessage::Segment(s)).is_ok(),
        None => true,
    }
}

type Produced = Result<Option<(String, u64)>, FormatError>;

/// Multistream streams being decoded, in file order: (file offset, where the text will arrive).
type InFlight = VecDeque<(u64, Receiver<Result<Vec<u8>, String>>)>;

fn produce_sequential(
    path: &Path,
    kind: InputKind,
    segment_bytes: usize,
    tx: &SyncSender<SourceMessage>,
) -> Produced {
    let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let mut hashing = HashingReader::new(file);
    let count = hashing.counter();
    let cutter = PageCutter::new(segment_bytes);
    if kind == InputKind::Xml {
        let Some(total) = pump(path, &mut hashing, cutter, tx, |e, _| {
            FormatError::io(path, e)
        })?
        else {
            return Ok(None);
        };
        return Ok(Some((
            hashing.finish().map_err(|e| FormatError::io(path, e))?,
            total,
        )));
    }
    let mut decoder = bzip2::read::MultiBzDecoder::new(BufReader::with_capacity(1 << 20, hashing));
    let bzip2_error = |e: io::Error, xml: u64| FormatError::Bzip2 {
        path: path.into(),
        offset: count.get(),
        message: format!("{e} (after {xml} bytes of XML)"),
    };
    let Some(total) = pump(path, &mut decoder, cutter, tx, bzip2_error)? else {
        return Ok(None);
    };
    // `finish` also hashes any bytes the decoder did not need (there are none in a valid file).
    let sha256 = decoder
        .into_inner()
        .into_inner()
        .finish()
        .map_err(|e| FormatError::io(path, e))?;
    Ok(Some((sha256, total)))
}

/// Reads `reader` (the XML of `path`) to its end, cutting what it yields into segments for
/// `tx`. Returns the number of XML bytes, or `None` when the consumer hung up; a read error
/// becomes `error(error, XML bytes so far)`.
fn pump(
    path: &Path,
    reader: &mut impl Read,
    mut cutter: PageCutter,
    tx: &SyncSender<SourceMessage>,
    error: impl Fn(io::Error, u64) -> FormatError,
) -> Result<Option<u64>, FormatError> {
    let mut block = vec![0u8; 1 << 20];
    loop {
        let n = read_retrying(reader, &mut block).map_err(|e| error(e, cutter.total()))?;
        if n == 0 {
            break;
        }
        if !send(tx, cutter.push(&block[..n]).map_err(|e| e.at(path))?) {
            return Ok(None);
        }
    }
    let total = cutter.total();
    Ok(send(tx, cutter.finish()).then_some(total))
}

fn read_retrying(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match r.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Decodes exactly one bzip2 stream occupying all of `data`.
pub(crate) fn decode_stream(data: &[u8]) -> Result<Vec<u8>, String> {
    let mut d = bzip2::Decompress::new(false);
    let mut out = Vec::with_capacity(data.len().saturating_mul(5).max(1 << 16));
    loop {
        let consumed = d.total_in() as usize;
        let produced = out.len();
        let status = d
            .decompress_vec(&data[consumed..], &mut out)
            .map_err(|e| e.to_string())?;
        if let bzip2::Status::StreamEnd = status {
            let used = d.total_in() as usize;
            if used != data.len() {
                return Err(format!(
                    "{} unexpected bytes after the end of the stream",
                    data.len() - used
                ));
            }
            return Ok(out);
        }
        if out.len() == out.capacity() {
            out.reserve(out.capacity());
        } else if d.total_in() as usize == data.len() && out.len() == produced {
            return Err("the stream ends without an end-of-stream marker (truncated file?)".into());
        }
    }
}

fn produce_multistream(
    path: &Path,
    segment_bytes: usize,
    pool: &rayon::ThreadPool,
    tx: &SyncSender<SourceMessage>,
) -> Produced {
    let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let mut reader = HashingReader::new(file);
    let count = reader.counter();
    let mut cutter = PageCutter::new(segment_bytes);
    // Streams being decoded on the pool, in file order: (file offset, result).
    let window = pool.current_num_threads() * MULTISTREAM_WINDOW_PER_THREAD;
    let mut in_flight: InFlight = VecDeque::new();
    // Takes the oldest stream's text and cuts it into segments; `false` when the consumer is gone.
    let take_oldest =
        |in_flight: &mut InFlight, cutter: &mut PageCutter| -> Result<bool, FormatError> {
            let (offset, rx) = in_flight.pop_front().expect("a stream is in flight");
            let result = rx
                .recv()
                .unwrap_or_else(|_| Err("the decoding task stopped".into()));
            match result {
                Ok(xml) => Ok(send(tx, cutter.push(&xml).map_err(|e| e.at(path))?)),
                Err(message) => Err(FormatError::Bzip2 {
                    path: path.into(),
                    offset,
                    message: format!("in the stream starting here: {message}"),
                }),
            }
        };
    // Compressed bytes not yet dispatched; `pending[0]` is a stream start at file offset `base`.
    let mut pending: Vec<u8> = Vec::new();
    let mut base = 0u64;
    let mut scan_from = 1usize;
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = read_retrying(&mut reader, &mut chunk).map_err(|e| FormatError::io(path, e))?;
        let eof = n == 0;
        pending.extend_from_slice(&chunk[..n]);
        // Dispatch every whole stream: those followed by another header, and at EOF the last.
        let mut ends: Vec<usize> = stream_starts(&pending, scan_from).collect();
        if eof && !pending.is_empty() {
            ends.push(pending.len());
        }
        let mut start = 0;
        for end in ends {
            let data = pending[start..end].to_vec();
            let (result_tx, result_rx) = sync_channel(1);
            pool.spawn(move || {
                let _ = result_tx.send(decode_stream(&data));
            });
            in_flight.push_back((base + start as u64, result_rx));
            start = end;
        }
        pending.drain(..start);
        base += start as u64;
        scan_from = pending.len().saturating_sub(BLOCK_MAGIC.len() + 4).max(1);
        while in_flight.len() > window || (eof && !in_flight.is_empty()) {
            if !take_oldest(&mut in_flight, &mut cutter)? {
                return Ok(None);
            }
        }
        if eof {
            break;
        }
        if pending.len() > MAX_PARALLEL_STREAM_BYTES {
            // A huge stream: finish what is in flight, then decode the rest sequentially.
            while !in_flight.is_empty() {
                if !take_oldest(&mut in_flight, &mut cutter)? {
                    return Ok(None);
                }
            }
            return finish_sequentially(path, pending, base, reader, cutter, tx, count);
        }
    }
    let total = cutter.total();
    if !send(tx, cutter.finish()) {
        return Ok(None);
    }
    Ok(Some((
        reader.finish().map_err(|e| FormatError::io(path, e))?,
        total,
    )))
}

/// Continues a multistream file with one sequential decoder from `pending` (which starts at a
/// stream header at file offset `base`).
fn finish_sequentially(
    path: &Path,
    pending: Vec<u8>,
    base: u64,
    reader: HashingReader<File>,
    cutter: PageCutter,
    tx: &SyncSender<SourceMessage>,
    count: std::rc::Rc<std::cell::Cell<u64>>,
) -> Produced {
    let pending_len = pending.len() as u64;
    let read_before = count.get();
    let chained = io::Cursor::new(pending).chain(reader);
    let mut decoder = bzip2::read::MultiBzDecoder::new(BufReader::with_capacity(1 << 20, chained));
    let bzip2_error = |e: io::Error, _| FormatError::Bzip2 {
        path: path.into(),
        offset: base + pending_len + (count.get() - read_before),
        message: e.to_string(),
    };
    let Some(total) = pump(path, &mut decoder, cutter, tx, bzip2_error)? else {
        return Ok(None);
    };
    let (_, reader) = decoder.into_inner().into_inner().into_inner();
    Ok(Some((
        reader.finish().map_err(|e| FormatError::io(path, e))?,
        total,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cutter_cuts_before_page_tags_only() {
        let mut c = PageCutter::new(10);
        assert!(c.push(b"<mediawiki>").unwrap().is_none()); // no <page> yet
        let seg = c.push(b"<page>a</page><page>b</page>").unwrap().unwrap();
        assert_eq!(seg.bytes, b"<mediawiki><page>a</page>");
        assert_eq!(seg.offset, 0);
        let last = c.finish().unwrap();
        assert_eq!(last.offset, 25);
        assert_eq!(last.bytes, b"<page>b</page>");
    }

    /// The cutter searches only what is new since its last search, and cuts exactly where a
    /// search of everything it holds would (the last page start, when the target is reached),
    /// for pushes of every size, tags split across pushes included.
    #[test]
    fn cutter_cuts_where_a_full_search_would() {
        let mut rng = bertkit_rng::SplitMix64::new(7);
        let mut next = move |n: u64| rng.next_u64() % n;
        for round in 0..200 {
            let target = 1 + next(64) as usize;
            let mut xml = Vec::new();
            while xml.len() < 2000 {
                match next(4) {
                    0 => xml.extend_from_slice(PAGE_TAG),
                    1 => xml.extend_from_slice(b"<pa"),
                    _ => xml.extend(std::iter::repeat_n(b'a' + next(3) as u8, next(40) as usize)),
                }
            }
            let (mut fast, mut full) = (PageCutter::new(target), Vec::<u8>::new());
            let (mut got, mut want) = (Vec::new(), Vec::new());
            let mut full_offset = 0;
            let mut at = 0;
            while at < xml.len() {
                let n = (1 + next(50) as usize).min(xml.len() - at);
                let data = &xml[at..at + n];
                at += n;
                if let Some(seg) = fast.push(data).unwrap() {
                    got.push((seg.offset, seg.bytes));
                }
                full.extend_from_slice(data);
                if full.len() >= target {
                    let last = memchr::memmem::rfind(&full, PAGE_TAG);
                    if let Some(cut) = last.filter(|&c| c > 0) {
                        let rest = full.split_off(cut);
                        want.push((full_offset, std::mem::replace(&mut full, rest)));
                        full_offset += cut as u64;
                    }
                }
            }
            assert_eq!(got, want, "round {round}");
            assert_eq!(fast.finish().map(|s| s.bytes).unwrap_or_default(), full);
        }
    }

    /// A page start missing for longer than the cutter's limit is an error at the offset where
    /// the overlong page began, not memory growing with the input.
    #[test]
    fn cutter_refuses_a_page_past_its_limit() {
        let mut c = PageCutter::with_max_page(10, 100);
        assert!(c.push(b"<page>one</page><page>two").unwrap().is_some());
        for _ in 0..9 {
            assert!(c.push(&[b'x'; 10]).unwrap().is_none());
        }
        let err = c.push(&[b'x'; 10]).unwrap_err();
        assert_eq!(err.offset, 16);
        assert!(
            err.message.starts_with("no page starts in the 0 MiB"),
            "{}",
            err.message
        );
    }

    #[test]
    fn stream_header_scan() {
        let mut data = b"BZh9".to_vec();
        data.extend_from_slice(BLOCK_MAGIC);
        data.extend_from_slice(b"xxxxBZh1");
        data.extend_from_slice(BLOCK_MAGIC);
        data.extend_from_slice(b"BZhX");
        data.extend_from_slice(BLOCK_MAGIC);
        assert_eq!(stream_starts(&data, 1).collect::<Vec<_>>(), vec![14]);
    }

    #[test]
    fn decode_stream_rejects_truncation_and_trailing_bytes() {
        use std::io::Write;
        let mut enc = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::best());
        enc.write_all(b"hello world, hello world").unwrap();
        let stream = enc.finish().unwrap();
        assert_eq!(decode_stream(&stream).unwrap(), b"hello world, hello world");
        assert!(decode_stream(&stream[..stream.len() - 5]).is_err());
        let mut extra = stream.clone();
        extra.extend_from_slice(b"junk");
        assert!(
            decode_stream(&extra)
                .unwrap_err()
                .contains("unexpected bytes")
        );
    }
}
