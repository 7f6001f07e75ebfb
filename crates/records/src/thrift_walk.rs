//! Bounded walks over the Thrift parts of a records file (the footer, each column chunk's page
//! headers), run before the parquet crate reads them.
//!
//! The parquet crate (60.1) skips the Thrift fields it does not read, and its skipping trusts
//! the bytes: a skipped list of booleans consumes no bytes per element, so a list declaring two
//! billion of them spins for a second or more doing nothing; and in a page header, read from a
//! stream, a skipped `double` or `binary` running past the end of the file is not an error, so a
//! list of two billion doubles spins too. The `records_parquet` fuzz target found both, in the
//! footer (a list of booleans where the column's path is) and in a page header. Each part is
//! therefore walked here first, in its own bytes, and refused unless:
//! - it parses inside its bytes, every declared length and element count fitting in the bytes
//!   left (so the walk is linear in their size);
//! - no collection holds booleans (the case where parquet's skipping and the protocol differ),
//!   nothing nests deeper than [`MAX_DEPTH`], and no varint is longer than ten bytes.
//!
//! Page headers are checked further, so that parquet reads each one exactly as walked here:
//! - every field parquet reads by its id (the page header, the data, dictionary and v2 data
//!   page headers, the page statistics) has the wire type the Parquet format gives it, since
//!   parquet reads those fields by id whatever their wire type;
//! - each page's data (its compressed size) lies inside the chunk, the last page ending at the
//!   chunk's end.
//!
//! The footer is walked by wire types alone: its structs are many, and a footer whose field
//! has another wire type than parquet reads it as could still lead parquet's reading elsewhere
//! than this walk went. Such a footer is hostile (digests guard against damage only past the
//! footer); the cost parquet can be led into is then bounded by a second or so per list the
//! footer declares.

/// Thrift compact protocol type codes.
mod wire {
    pub const BOOL_TRUE: u8 = 1;
    pub const BOOL_FALSE: u8 = 2;
    pub const BYTE: u8 = 3;
    pub const I16: u8 = 4;
    pub const I32: u8 = 5;
    pub const I64: u8 = 6;
    pub const DOUBLE: u8 = 7;
    pub const BINARY: u8 = 8;
    pub const LIST: u8 = 9;
    pub const SET: u8 = 10;
    pub const MAP: u8 = 11;
    pub const STRUCT: u8 = 12;
    pub const UUID: u8 = 13;
}

/// Deepest nesting of values accepted (page headers nest three deep, footers about eight; the
/// parquet crate skips values up to 64 deep).
const MAX_DEPTH: usize = 32;

/// The structs of a page header the parquet crate reads field by field: for each field id it
/// knows, the wire type it reads that field as.
#[derive(Clone, Copy)]
enum Known {
    PageHeader,
    DataPageHeader,
    DictionaryPageHeader,
    DataPageHeaderV2,
    IndexPageHeader,
    Statistics,
}

impl Known {
    /// The wire type of field `id`, and the struct it is when it is one; `None` for a field
    /// parquet skips.
    fn field(self, id: i16) -> Option<(u8, Option<Known>)> {
        use wire::*;
        let plain = |t| Some((t, None));
        match (self, id) {
            (Known::PageHeader, 1..=4) => plain(I32),
            (Known::PageHeader, 5) => Some((STRUCT, Some(Known::DataPageHeader))),
            (Known::PageHeader, 6) => Some((STRUCT, Some(Known::IndexPageHeader))),
            (Known::PageHeader, 7) => Some((STRUCT, Some(Known::DictionaryPageHeader))),
            (Known::PageHeader, 8) => Some((STRUCT, Some(Known::DataPageHeaderV2))),
            (Known::DataPageHeader, 1..=4) => plain(I32),
            (Known::DataPageHeader, 5) | (Known::DataPageHeaderV2, 8) => {
                Some((STRUCT, Some(Known::Statistics)))
            }
            (Known::DictionaryPageHeader, 1 | 2) => plain(I32),
            (Known::DictionaryPageHeader, 3) | (Known::DataPageHeaderV2, 7) => plain(BOOL_TRUE),
            (Known::DataPageHeaderV2, 1..=6) => plain(I32),
            (Known::Statistics, 1 | 2 | 5 | 6) => plain(BINARY),
            (Known::Statistics, 3 | 4 | 9) => plain(I64),
            (Known::Statistics, 7 | 8) => plain(BOOL_TRUE),
            _ => None,
        }
    }
}

/// The sizes a page header gives.
#[derive(Debug, Default, PartialEq, Eq)]
struct Sizes {
    uncompressed: Option<i32>,
    compressed: Option<i32>,
    page_type: bool,
}

/// Walks the page headers of `chunk` (one column chunk's bytes); see the module notes. The
/// error names the byte offset in the chunk.
pub(crate) fn check_column_chunk(chunk: &[u8]) -> Result<(), String> {
    let mut at = 0;
    while at < chunk.len() {
        let mut walk = Walk {
            bytes: &chunk[at..],
            pos: 0,
        };
        let mut sizes = Sizes::default();
        walk.known_struct(Known::PageHeader, &mut sizes, 0)
            .map_err(|(pos, what)| format!("page header at byte {}: {what}", at + pos))?;
        let (Some(compressed), Some(_), true) =
            (sizes.compressed, sizes.uncompressed, sizes.page_type)
        else {
            return Err(format!(
                "page header at byte {at}: a type, an uncompressed and a compressed size are required"
            ));
        };
        let data = usize::try_from(compressed)
            .ok()
            .filter(|&c| c <= walk.bytes.len() - walk.pos)
            .ok_or_else(|| {
                format!(
                    "page header at byte {at}: a page of {compressed} bytes, with {} left in \
                     the column chunk",
                    walk.bytes.len() - walk.pos
                )
            })?;
        at += walk.pos + data;
    }
    Ok(())
}

/// Walks a file's footer (its `FileMetaData`, the bytes before the footer's length and the
/// closing magic); see the module notes. The error names the byte offset in the footer.
pub(crate) fn check_footer(footer: &[u8]) -> Result<(), String> {
    let mut walk = Walk {
        bytes: footer,
        pos: 0,
    };
    walk.value(wire::STRUCT, 0)
        .map_err(|(pos, what)| format!("byte {pos} of the footer: {what}"))
}

/// A failure: the byte offset (in the header) and what is wrong.
type Failure = (usize, String);

struct Walk<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Walk<'_> {
    fn fail<T>(&self, what: impl Into<String>) -> Result<T, Failure> {
        Err((self.pos, what.into()))
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn byte(&mut self) -> Result<u8, Failure> {
        let Some(&b) = self.bytes.get(self.pos) else {
            return self.fail("it runs past the end");
        };
        self.pos += 1;
        Ok(b)
    }

    fn skip(&mut self, n: usize) -> Result<(), Failure> {
        if n > self.left() {
            return self.fail(format!("{n} bytes declared, {} left", self.left()));
        }
        self.pos += n;
        Ok(())
    }

    /// An unsigned LEB128 varint, decoded as the parquet crate decodes it; at most ten bytes.
    fn varint(&mut self) -> Result<u64, Failure> {
        let mut value = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.byte()?;
            value |= u64::from(b & 0x7f).wrapping_shl(shift);
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        self.fail("a varint longer than ten bytes")
    }

    fn zigzag(&mut self) -> Result<i64, Failure> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    /// A declared count or length, refused when it cannot fit in the bytes left (each element
    /// takes at least `min_bytes`).
    fn count(&mut self, value: u64, min_bytes: usize) -> Result<usize, Failure> {
        match usize::try_from(value) {
            Ok(n) if i32::try_from(n).is_ok() && n.saturating_mul(min_bytes) <= self.left() => {
                Ok(n)
            }
            _ => self.fail(format!(
                "{value} elements or bytes declared, {} bytes left",
                self.left()
            )),
        }
    }

    /// A field header: `None` at the struct's end, else the field's id and wire type.
    fn field_header(&mut self, last_id: i16) -> Result<Option<(i16, u8)>, Failure> {
        let b = self.byte()?;
        let wire_type = b & 0x0f;
        if wire_type == 0 {
            return Ok(None);
        }
        if wire_type > wire::UUID {
            return self.fail(format!("field type {wire_type}"));
        }
        let delta = b >> 4;
        let id = if delta != 0 {
            match last_id.checked_add(i16::from(delta)) {
                Some(id) => id,
                None => return self.fail("a field id past 32767"),
            }
        } else {
            self.zigzag()? as i16
        };
        Ok(Some((id, wire_type)))
    }

    /// One of the structs parquet reads by field id, collecting the page's sizes from the
    /// page header itself.
    fn known_struct(
        &mut self,
        known: Known,
        sizes: &mut Sizes,
        depth: usize,
    ) -> Result<(), Failure> {
        let mut last_id = 0;
        while let Some((id, wire_type)) = self.field_header(last_id)? {
            match known.field(id) {
                None => self.value(wire_type, depth + 1)?,
                Some((expected, nested)) => {
                    let matches = expected == wire_type
                        || (expected == wire::BOOL_TRUE && wire_type == wire::BOOL_FALSE);
                    if !matches {
                        return self.fail(format!(
                            "field {id} has wire type {wire_type}, the Parquet format gives it {expected}"
                        ));
                    }
                    match nested {
                        Some(inner) => self.known_struct(inner, sizes, depth + 1)?,
                        None if expected == wire::I32 => {
                            let value = self.zigzag()? as i32;
                            if let Known::PageHeader = known {
                                match id {
                                    1 => sizes.page_type = true,
                                    2 => sizes.uncompressed = Some(value),
                                    3 => sizes.compressed = Some(value),
                                    _ => {}
                                }
                            }
                        }
                        None => self.value(wire_type, depth + 1)?,
                    }
                }
            }
            last_id = id;
        }
        Ok(())
    }

    /// Skips one value of `wire_type`.
    fn value(&mut self, wire_type: u8, depth: usize) -> Result<(), Failure> {
        use wire::*;
        if depth > MAX_DEPTH {
            return self.fail(format!("values nested over {MAX_DEPTH} deep"));
        }
        match wire_type {
            BOOL_TRUE | BOOL_FALSE => Ok(()),
            BYTE => self.skip(1),
            I16 | I32 | I64 => self.varint().map(drop),
            DOUBLE => self.skip(8),
            UUID => self.skip(16),
            BINARY => {
                let len = self.varint()?;
                let len = self.count(len, 1)?;
                self.skip(len)
            }
            LIST | SET => {
                let at = self.pos;
                let header = self.byte()?;
                if header == 0 {
                    return Ok(());
                }
                let size = match header >> 4 {
                    15 => self.varint()?,
                    small => u64::from(small),
                };
                let element = element_type(at, header & 0x0f)?;
                let size = self.count(size, 1)?;
                for _ in 0..size {
                    self.value(element, depth + 1)?;
                }
                Ok(())
            }
            MAP => {
                let at = self.pos;
                let size = self.varint()?;
                let size = self.count(size, 2)?;
                if size == 0 {
                    return Ok(());
                }
                let kv = self.byte()?;
                let (key, val) = (element_type(at, kv >> 4)?, element_type(at, kv & 0x0f)?);
                for _ in 0..size {
                    self.value(key, depth + 1)?;
                    self.value(val, depth + 1)?;
                }
                Ok(())
            }
            STRUCT => {
                while let Some((_, field_type)) = self.field_header(0)? {
                    self.value(field_type, depth + 1)?;
                }
                Ok(())
            }
            other => self.fail(format!("field type {other}")),
        }
    }
}

/// The element type of the collection at byte `at`: booleans are refused (see the module
/// notes).
fn element_type(at: usize, t: u8) -> Result<u8, Failure> {
    match t {
        wire::BYTE..=wire::UUID => Ok(t),
        wire::BOOL_TRUE | wire::BOOL_FALSE => Err((at, "a collection of booleans".into())),
        other => Err((at, format!("a collection of element type {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zigzag(v: i64) -> Vec<u8> {
        varint(((v << 1) ^ (v >> 63)) as u64)
    }

    fn varint(mut v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return out;
            }
            out.push(b | 0x80);
        }
    }

    /// A data page header as Parquet writers write it: type, sizes, a data page header with
    /// its four fields; `extra` goes in before the closing stop byte.
    fn header(compressed: i32, extra: &[u8]) -> Vec<u8> {
        let mut h = vec![0x15];
        h.extend(zigzag(0)); // type DATA_PAGE
        h.push(0x15);
        h.extend(zigzag(i64::from(compressed) + 4)); // uncompressed size
        h.push(0x15);
        h.extend(zigzag(compressed.into()));
        h.push(0x2c); // field 5 (delta 2): data page header
        for v in [7, 0, 3, 3] {
            h.push(0x15);
            h.extend(zigzag(v));
        }
        h.push(0);
        h.extend_from_slice(extra);
        h.push(0);
        h
    }

    fn page(compressed: usize, extra: &[u8]) -> Vec<u8> {
        let mut p = header(compressed as i32, extra);
        p.extend(std::iter::repeat_n(0xab, compressed));
        p
    }

    #[test]
    fn well_formed_pages_pass() {
        let mut chunk = page(10, &[]);
        chunk.extend(page(0, &[]));
        // A field parquet does not know (id 20, written in full), a binary: skipped.
        let mut extra = vec![0x08];
        extra.extend(zigzag(20));
        extra.extend(varint(3));
        extra.extend(b"abc");
        chunk.extend(page(5, &extra));
        assert_eq!(check_column_chunk(&chunk), Ok(()));
        assert_eq!(check_column_chunk(&[]), Ok(()));
    }

    /// The fuzz target's finding: an unknown field holding a list of 2^31 - 1 doubles.
    #[test]
    fn a_huge_declared_list_is_refused_at_once() {
        let mut extra = vec![0x09];
        extra.extend(zigzag(20));
        extra.push(0xf7); // size follows, element type double
        extra.extend(varint(i32::MAX as u64));
        let chunk = page(4, &extra);
        let start = std::time::Instant::now();
        let err = check_column_chunk(&chunk).unwrap_err();
        assert!(
            err.contains("2147483647 elements or bytes declared"),
            "{err}"
        );
        assert!(start.elapsed().as_secs_f64() < 0.5);
    }

    #[test]
    fn each_kind_of_damage_is_named() {
        let bool_list = {
            let mut e = vec![0x09];
            e.extend(zigzag(20));
            e.extend([0x31, 1, 1, 1]);
            e
        };
        let long_binary = {
            let mut e = vec![0x08];
            e.extend(zigzag(20));
            e.extend(varint(1 << 40));
            e
        };
        let wrong_type = {
            // field 4 (crc) declared a binary: parquet would read its length as the crc.
            let mut e = vec![0x08];
            e.extend(zigzag(4));
            e.extend([1, b'x']);
            e
        };
        let deep = {
            let mut e = vec![0x0c];
            e.extend(zigzag(20));
            e.extend(std::iter::repeat_n(0x1c, 40));
            e
        };
        let cases: [(Vec<u8>, &str); 6] = [
            (page(4, &bool_list), "a collection of booleans"),
            (
                page(4, &long_binary),
                "1099511627776 elements or bytes declared",
            ),
            (page(4, &wrong_type), "field 4 has wire type 8"),
            (page(4, &deep), "nested over 32 deep"),
            (page(4, &[])[..10].to_vec(), "runs past the end"),
            (
                {
                    let mut p = page(4, &[]);
                    p.truncate(p.len() - 1);
                    p
                },
                "a page of 4 bytes, with 3 left",
            ),
        ];
        for (chunk, message) in cases {
            let err = check_column_chunk(&chunk).unwrap_err();
            assert!(err.contains(message), "{err} lacks {message}");
            assert!(err.starts_with("page header at byte "), "{err}");
        }
        let mut negative = header(-1, &[]);
        negative.extend([0; 4]);
        assert!(
            check_column_chunk(&negative)
                .unwrap_err()
                .contains("a page of -1 bytes")
        );
        let mut no_sizes = vec![0x15];
        no_sizes.extend(zigzag(0));
        no_sizes.push(0);
        assert!(
            check_column_chunk(&no_sizes)
                .unwrap_err()
                .contains("are required")
        );
    }
}
