//! Column chunks of a records file, encoded here rather than by the parquet crate's generic
//! column writer.
//!
//! The schema is fixed (lists of non-null int32 and two required int32 columns), so a column
//! chunk is one data page whose parts can be made straight from the instances:
//! - repetition and definition levels (lists: a level pair per value, a single `(0, 0)` for an
//!   empty list) as runs of the RLE/bit-packed hybrid encoding: one run per list boundary,
//!   instead of a level per value pushed through a generic encoder;
//! - values as `BYTE_STREAM_SPLIT` (four byte streams; ids below 2^16 leave two of them zero,
//!   which zstd compresses almost for free), except `segment_ids`, which are dictionary-encoded
//!   (the dictionary is `[0, 1]`; each list is two RLE runs, a few bytes instead of four per
//!   token);
//! - zstd level [`ZSTD_LEVEL`], with contexts reused for every page (the generic writer sets
//!   one up per page); the input ids with a sparse match search and Huffman-coded literals.
//!
//! Page headers, column chunk metadata and the file footer still come from the parquet crate
//! (the page writer and [`SerializedRowGroupWriter::append_column`]), so the Thrift parts
//! are the crate's own. The data pages are format v1, readable by any Parquet reader that
//! reads `BYTE_STREAM_SPLIT` integers (pyarrow 16 and later).

use bytes::Bytes;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::column::page::{CompressedPage, Page, PageWriter};
use parquet::column::writer::ColumnCloseResult;
use parquet::errors::{ParquetError, Result};
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::writer::{SerializedPageWriter, SerializedRowGroupWriter, TrackedWrite};
use parquet::schema::types::ColumnDescPtr;

/// zstd level of every page (level 3 made files 8% smaller and the whole stage 15-25% slower).
pub const ZSTD_LEVEL: i32 = 1;

/// Acceleration of zstd's match search (its `targetLength` parameter for the fast strategy):
/// 64 skips ahead faster and faster through data without repeats. See [`ChunkEncoder::new`].
const ZSTD_SEARCH_ACCELERATION: u32 = 64;

/// Appends `value` as an unsigned LEB128 varint (the hybrid encoding's run headers).
fn push_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Writes runs of 0/1 values (bit width 1) in the RLE/bit-packed hybrid encoding, as RLE runs
/// only: a run is its length (header `length << 1`) and its value in one byte. Adjacent runs
/// of the same value are merged.
struct BitRuns<'a> {
    out: &'a mut Vec<u8>,
    value: u8,
    count: u64,
}

impl<'a> BitRuns<'a> {
    fn new(out: &'a mut Vec<u8>) -> Self {
        BitRuns {
            out,
            value: 0,
            count: 0,
        }
    }

    #[inline]
    fn push(&mut self, value: u8, count: usize) {
        if count == 0 {
            return;
        }
        if value != self.value {
            self.flush();
            self.value = value;
        }
        self.count += count as u64;
    }

    fn flush(&mut self) {
        if self.count > 0 {
            push_varint(self.out, self.count << 1);
            self.out.push(self.value);
            self.count = 0;
        }
    }

    fn finish(mut self) {
        self.flush();
    }
}

/// Appends a v1 level block: a 4-byte little-endian length, then the runs `write` pushes.
fn push_level_block(out: &mut Vec<u8>, write: impl FnOnce(&mut BitRuns<'_>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    let mut runs = BitRuns::new(out);
    write(&mut runs);
    runs.finish();
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// Appends the repetition then the definition levels of lists of `lengths` values; returns
/// the number of levels (the page's value count, empty lists included).
fn push_list_levels(out: &mut Vec<u8>, lengths: &[u32]) -> usize {
    // Repetition: 0 at each list's start (an empty list is just that 0), 1 for the rest.
    push_level_block(out, |runs| {
        for &len in lengths {
            runs.push(0, 1);
            runs.push(1, (len as usize).saturating_sub(1));
        }
    });
    // Definition: 1 for each value, 0 for an empty list.
    push_level_block(out, |runs| {
        for &len in lengths {
            if len == 0 {
                runs.push(0, 1);
            } else {
                runs.push(1, len as usize);
            }
        }
    });
    lengths.iter().map(|&len| (len as usize).max(1)).sum()
}

/// Writes bytes 0 and 1 of the first `16 * (values.len() / 16)` values into `b0` and `b1`;
/// returns how many values that is and the OR of them.
#[cfg(target_arch = "x86_64")]
fn split_low_bytes_x16(values: &[u32], b0: &mut [u8], b1: &mut [u8]) -> (usize, u32) {
    use std::arch::x86_64::*;
    let whole = values.len() - values.len() % 16;
    assert!(b0.len() >= whole && b1.len() >= whole);
    // SAFETY: SSE2 is part of x86-64; every load reads values[i..i + 16] and every store
    // writes b0/b1[i..i + 16] with i + 16 <= whole, within all three slices (checked above).
    unsafe {
        let byte = _mm_set1_epi32(0xFF);
        let mut or = _mm_setzero_si128();
        let mut i = 0;
        while i < whole {
            let p = values.as_ptr().add(i) as *const __m128i;
            let v = [
                _mm_loadu_si128(p),
                _mm_loadu_si128(p.add(1)),
                _mm_loadu_si128(p.add(2)),
                _mm_loadu_si128(p.add(3)),
            ];
            or = _mm_or_si128(
                or,
                _mm_or_si128(_mm_or_si128(v[0], v[1]), _mm_or_si128(v[2], v[3])),
            );
            // Each lane masked to one byte, so the signed packs never saturate.
            let pack = |shift: bool| {
                let lane = |x: __m128i| {
                    _mm_and_si128(if shift { _mm_srli_epi32::<8>(x) } else { x }, byte)
                };
                _mm_packus_epi16(
                    _mm_packs_epi32(lane(v[0]), lane(v[1])),
                    _mm_packs_epi32(lane(v[2]), lane(v[3])),
                )
            };
            _mm_storeu_si128(b0.as_mut_ptr().add(i) as *mut __m128i, pack(false));
            _mm_storeu_si128(b1.as_mut_ptr().add(i) as *mut __m128i, pack(true));
            i += 16;
        }
        let mut lanes = [0u32; 4];
        _mm_storeu_si128(lanes.as_mut_ptr() as *mut __m128i, or);
        (whole, lanes[0] | lanes[1] | lanes[2] | lanes[3])
    }
}

/// Elsewhere: the caller's byte loop does all values.
#[cfg(not(target_arch = "x86_64"))]
fn split_low_bytes_x16(_values: &[u32], _b0: &mut [u8], _b1: &mut [u8]) -> (usize, u32) {
    (0, 0)
}

/// Appends `values` as `BYTE_STREAM_SPLIT` int32: byte 0 of every value, then byte 1, ...
fn push_byte_stream_split(out: &mut Vec<u8>, values: &[u32]) {
    let n = values.len();
    let start = out.len();
    out.resize(start + 4 * n, 0);
    let (low, high) = out[start..].split_at_mut(2 * n);
    let (b0, b1) = low.split_at_mut(n);
    // Sixteen values at a time; the OR of all values tells whether the two high streams are
    // needed.
    let (whole, mut any_high) = split_low_bytes_x16(values, b0, b1);
    for i in whole..n {
        b0[i] = values[i] as u8;
        b1[i] = (values[i] >> 8) as u8;
        any_high |= values[i];
    }
    // Vocabulary ids and positions are below 2^16: the two high streams stay zero.
    if any_high >> 16 != 0 {
        let (b2, b3) = high.split_at_mut(n);
        for ((v, x2), x3) in values.iter().zip(b2).zip(b3) {
            *x2 = (*v >> 16) as u8;
            *x3 = (*v >> 24) as u8;
        }
    }
}

/// What one column of a row group holds, gathered from the instances.
pub enum ColumnValues<'a> {
    /// `list<int32>`: the values of all lists, and each list's length.
    IntLists {
        values: &'a [u32],
        lengths: &'a [u32],
        /// Whether the values are token ids in no particular order (the input ids): their
        /// byte streams hold few repeats worth searching for (see [`ChunkEncoder::new`]).
        token_ids: bool,
    },
    /// `list<int8>` of 0s then 1s (segment ids): each list's length and its count of 0s.
    ZeroOneLists {
        lengths: &'a [u32],
        zeros: &'a [u32],
    },
    /// Required `int32`, one per row.
    Ints(&'a [u32]),
}

/// A column chunk encoded by [`ChunkEncoder::encode`]: its pages (with headers), and what the
/// row group writer records of it.
pub struct EncodedChunk {
    bytes: Bytes,
    close: ColumnCloseResult,
}

impl EncodedChunk {
    /// The bytes the chunk adds to the file (its pages, headers included).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Appends the chunk to `group` as its next column.
    pub fn append_to<W: std::io::Write + Send>(
        self,
        group: &mut SerializedRowGroupWriter<'_, W>,
    ) -> Result<()> {
        group.append_column(&self.bytes, self.close)
    }
}

/// Encodes and compresses column chunks, reusing its buffers and zstd contexts.
pub struct ChunkEncoder {
    compressor: zstd::bulk::Compressor<'static>,
    /// For the input ids: a sparse match search (see [`ChunkEncoder::new`]).
    sparse_compressor: zstd::bulk::Compressor<'static>,
    page: Vec<u8>,
}

impl ChunkEncoder {
    pub fn new() -> Result<Self> {
        use zstd::zstd_safe::{CParameter, ParamSwitch};
        // The byte streams of token ids are mostly literals: repeats long enough to pay are
        // rare, and level 1's search spends its time finding short ones (the second stream of
        // the bench's input ids: 18 ms to compress, 6.6 ms with a sparse search, and 0.6%
        // smaller). A target length (the fast strategy's acceleration) makes the search
        // sparse; it would also turn off the Huffman coding of literals, which does most of
        // the compression of these streams, so that is asked for explicitly. The other
        // columns (positions, levels) hold repeats and keep the full search.
        let mut sparse_compressor = zstd::bulk::Compressor::new(ZSTD_LEVEL)?;
        sparse_compressor.set_parameter(CParameter::TargetLength(ZSTD_SEARCH_ACCELERATION))?;
        sparse_compressor.set_parameter(CParameter::LiteralCompressionMode(ParamSwitch::Enable))?;
        Ok(ChunkEncoder {
            compressor: zstd::bulk::Compressor::new(ZSTD_LEVEL)?,
            sparse_compressor,
            page: Vec::new(),
        })
    }

    /// Compresses `self.page` (with the sparse search if `sparse`) into a [`CompressedPage`]
    /// built by `page`.
    fn compress(
        &mut self,
        sparse: bool,
        page: impl FnOnce(Bytes) -> Page,
    ) -> Result<CompressedPage> {
        let compressor = if sparse {
            &mut self.sparse_compressor
        } else {
            &mut self.compressor
        };
        let compressed = compressor.compress(&self.page)?;
        Ok(CompressedPage::new(
            page(Bytes::from(compressed)),
            self.page.len(),
        ))
    }

    /// Encodes `column` as a column chunk of `rows` rows, to be appended to a row group later
    /// (row groups can so be encoded in parallel and written in order).
    pub fn encode(
        &mut self,
        descr: &ColumnDescPtr,
        rows: usize,
        column: ColumnValues<'_>,
    ) -> Result<EncodedChunk> {
        let mut pages = Vec::with_capacity(2);
        self.page.clear();
        let (num_values, encodings) = match column {
            ColumnValues::IntLists {
                values,
                lengths,
                token_ids,
            } => {
                let levels = push_list_levels(&mut self.page, lengths);
                push_byte_stream_split(&mut self.page, values);
                pages.push(self.data_page(levels, Encoding::BYTE_STREAM_SPLIT, token_ids)?);
                (levels, vec![Encoding::RLE, Encoding::BYTE_STREAM_SPLIT])
            }
            ColumnValues::ZeroOneLists { lengths, zeros } => {
                // The dictionary: 0 and 1, plain int32.
                self.page.extend_from_slice(&0i32.to_le_bytes());
                self.page.extend_from_slice(&1i32.to_le_bytes());
                pages.push(self.compress(false, |buf| Page::DictionaryPage {
                    buf,
                    num_values: 2,
                    encoding: Encoding::PLAIN,
                    is_sorted: true,
                })?);
                self.page.clear();
                let levels = push_list_levels(&mut self.page, lengths);
                // Dictionary indices: their bit width, then runs (no length prefix).
                self.page.push(1);
                let mut runs = BitRuns::new(&mut self.page);
                for (&len, &zeros) in lengths.iter().zip(zeros) {
                    let zeros = zeros.min(len) as usize;
                    runs.push(0, zeros);
                    runs.push(1, len as usize - zeros);
                }
                runs.finish();
                pages.push(self.data_page(levels, Encoding::RLE_DICTIONARY, false)?);
                (
                    levels,
                    vec![Encoding::PLAIN, Encoding::RLE, Encoding::RLE_DICTIONARY],
                )
            }
            ColumnValues::Ints(values) => {
                push_byte_stream_split(&mut self.page, values);
                pages.push(self.data_page(values.len(), Encoding::BYTE_STREAM_SPLIT, false)?);
                (
                    values.len(),
                    vec![Encoding::RLE, Encoding::BYTE_STREAM_SPLIT],
                )
            }
        };

        // Page headers and pages into one buffer, then spliced into the file.
        let mut chunk = TrackedWrite::new(Vec::new());
        let mut writer = SerializedPageWriter::new(&mut chunk);
        let mut specs = Vec::with_capacity(pages.len());
        for page in pages {
            specs.push(writer.write_page(page)?);
        }
        writer.close()?;
        let data_page = specs.last().expect("one data page at least");
        let metadata = ColumnChunkMetaData::builder(descr.clone())
            .set_compression(Compression::ZSTD(ZstdLevel::try_new(ZSTD_LEVEL)?))
            .set_encodings(encodings)
            .set_num_values(num_values as i64)
            .set_total_compressed_size(specs.iter().map(|s| s.compressed_size as i64).sum())
            .set_total_uncompressed_size(specs.iter().map(|s| s.uncompressed_size as i64).sum())
            .set_data_page_offset(data_page.offset as i64)
            .set_dictionary_page_offset((specs.len() > 1).then_some(specs[0].offset as i64))
            .build()?;
        let bytes_written = chunk.bytes_written() as u64;
        Ok(EncodedChunk {
            bytes: Bytes::from(chunk.into_inner()?),
            close: ColumnCloseResult {
                bytes_written,
                rows_written: rows as u64,
                metadata,
                bloom_filter: None,
                column_index: None,
                offset_index: None,
            },
        })
    }

    fn data_page(
        &mut self,
        num_values: usize,
        encoding: Encoding,
        sparse: bool,
    ) -> Result<CompressedPage> {
        let num_values = u32::try_from(num_values)
            .map_err(|_| ParquetError::General("more than 2^32 values in a page".into()))?;
        self.compress(sparse, |buf| Page::DataPage {
            buf,
            num_values,
            encoding,
            def_level_encoding: Encoding::RLE,
            rep_level_encoding: Encoding::RLE,
            statistics: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_and_use_leb128_headers() {
        let mut out = Vec::new();
        let mut runs = BitRuns::new(&mut out);
        runs.push(1, 3);
        runs.push(1, 2);
        runs.push(0, 0);
        runs.push(0, 200);
        runs.finish();
        // 5 ones: header 10; 200 zeros: header 400 = 0x90 0x03.
        assert_eq!(out, vec![10, 1, 0x90, 0x03, 0]);
    }

    #[test]
    fn list_levels_cover_empty_lists() {
        let mut out = Vec::new();
        let levels = push_list_levels(&mut out, &[2, 0, 1]);
        assert_eq!(levels, 4);
        // Repetition 0 1 0 0: runs (0,1) (1,1) (0,2); definition 1 1 0 1: (1,2) (0,1) (1,1).
        assert_eq!(
            out,
            vec![6, 0, 0, 0, 2, 0, 2, 1, 4, 0, 6, 0, 0, 0, 4, 1, 2, 0, 2, 1]
        );
    }

    #[test]
    fn byte_streams_hold_every_byte() {
        let mut out = Vec::new();
        push_byte_stream_split(&mut out, &[0x0403_0201, 0x0000_0605]);
        assert_eq!(out, vec![1, 5, 2, 6, 3, 0, 4, 0]);
        out.clear();
        push_byte_stream_split(&mut out, &[0x0201, 0xffff]);
        assert_eq!(out, vec![1, 0xff, 2, 0xff, 0, 0, 0, 0]);
        // Lengths around the vector width, values with every byte set and a high one late.
        for n in [15, 16, 17, 33, 100] {
            let mut values: Vec<u32> = (0..n as u64)
                .map(|i| bertkit_rng::splitmix64(i) as u32 & 0xffff)
                .collect();
            for high in [false, true] {
                if high {
                    values[n - 2] |= 0x8f00_0000;
                }
                out.clear();
                push_byte_stream_split(&mut out, &values);
                let expected: Vec<u8> = (0..4)
                    .flat_map(|b| values.iter().map(move |v| (v >> (8 * b)) as u8))
                    .collect();
                assert_eq!(out, expected, "{n} values, high bytes {high}");
            }
        }
    }
}
