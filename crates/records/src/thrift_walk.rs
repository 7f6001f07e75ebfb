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
//! So that parquet reads each part exactly as walked here, two more checks:
//! - every field parquet reads by its id (in a page header: the page header, the data,
//!   dictionary and v2 data page headers, the statistics; in the footer: the file metadata,
//!   schema elements and their logical types, row groups, column chunks and their metadata,
//!   statistics, encoding and size statistics, sort orders, key-values) has the wire type the
//!   Parquet format gives it, and so do the elements of its lists: parquet reads those fields
//!   by id whatever their wire type, and a field of another wire type would lead its reading
//!   elsewhere than this walk went (the fuzz target found that too, in the footer);
//! - in a column chunk, each page's data (its compressed size) lies inside the chunk, the last
//!   page ending at the chunk's end.
//!
//! A column chunk's pages are also held to [`MAX_PAGE_BYTES`] uncompressed, which bounds the
//! memory parquet takes for a page.
//!
//! Wherever parquet goes on reading, it then reads what was walked, each value as the type it
//! was walked as; where it stops first with an error of its own, that is fine too. The table
//! of fields ([`Known::field`]) follows parquet 60.1's readers: a parquet upgrade that reads a
//! new field by id needs it added there.

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

    /// A type code's name, for errors.
    pub fn name(t: u8) -> &'static str {
        match t {
            BOOL_TRUE | BOOL_FALSE => "bool",
            BYTE => "byte",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            DOUBLE => "double",
            BINARY => "binary",
            LIST => "list",
            SET => "set",
            MAP => "map",
            STRUCT => "struct",
            UUID => "uuid",
            _ => "unknown type",
        }
    }
}

/// The largest uncompressed page accepted. The parquet crate reserves a page's declared
/// uncompressed size before decompressing it (up to 2 GiB), and a hostile zstd page can truly
/// expand that far; a records page holds one column of one row group (2048 rows: 4 MiB of ids
/// at sequences of 512), so this bounds the memory a page can take at 64 times that.
pub(crate) const MAX_PAGE_BYTES: i32 = 256 << 20;

/// Deepest nesting of values accepted (page headers nest three deep, footers about eight; the
/// parquet crate skips values up to 64 deep).
const MAX_DEPTH: usize = 32;

/// How the parquet crate reads a field it knows: as the Parquet format's Thrift definitions
/// type it, whatever wire type the field header gives.
#[derive(Clone, Copy)]
enum Ty {
    Bool,
    Byte,
    I16,
    /// Also the format's enums.
    I32,
    I64,
    Double,
    /// Also strings.
    Binary,
    /// Parquet checks a known list's element type, so its elements are read as walked.
    List(&'static Ty),
    /// Structs and unions alike (a union is a struct of one field).
    Struct(Known),
}

impl Ty {
    /// The wire type a field of this type has (booleans: either of their two).
    fn wire(self) -> u8 {
        use wire::*;
        match self {
            Ty::Bool => BOOL_TRUE,
            Ty::Byte => BYTE,
            Ty::I16 => I16,
            Ty::I32 => I32,
            Ty::I64 => I64,
            Ty::Double => DOUBLE,
            Ty::Binary => BINARY,
            Ty::List(_) => LIST,
            Ty::Struct(_) => STRUCT,
        }
    }

    fn is(self, wire_type: u8) -> bool {
        let expected = self.wire();
        expected == wire_type || (expected == wire::BOOL_TRUE && wire_type == wire::BOOL_FALSE)
    }
}

/// The structs the parquet crate reads field by field, in a page header and in the footer
/// (`FileMetaData`), as parquet 60.1 reads them (`file/metadata/thrift/mod.rs`, `basic.rs`;
/// without its `encryption` feature, which this workspace does not enable, the encryption
/// fields are skipped and so left to the generic walk here).
#[derive(Clone, Copy, Debug)]
enum Known {
    PageHeader,
    DataPageHeader,
    DictionaryPageHeader,
    DataPageHeaderV2,
    IndexPageHeader,
    /// Page and column chunk statistics (the same fields).
    Statistics,
    FileMetaData,
    SchemaElement,
    /// A union.
    LogicalType,
    DecimalType,
    /// `TimeType` and `TimestampType` (the same fields).
    TimestampType,
    /// A union of empty structs.
    TimeUnit,
    IntType,
    VariantType,
    GeometryType,
    GeographyType,
    KeyValue,
    /// A union of empty structs.
    ColumnOrder,
    RowGroup,
    SortingColumn,
    ColumnChunk,
    ColumnMetaData,
    PageEncodingStats,
    SizeStatistics,
    GeospatialStatistics,
    BoundingBox,
    /// The empty structs of unions' variants.
    Empty,
}

impl Known {
    /// The type of field `id`; `None` for a field parquet skips.
    fn field(self, id: i16) -> Option<Ty> {
        use Known as K;
        use Ty::*;
        Some(match (self, id) {
            (K::PageHeader, 1..=4) => I32,
            (K::PageHeader, 5) => Struct(K::DataPageHeader),
            (K::PageHeader, 6) => Struct(K::IndexPageHeader),
            (K::PageHeader, 7) => Struct(K::DictionaryPageHeader),
            (K::PageHeader, 8) => Struct(K::DataPageHeaderV2),
            (K::DataPageHeader, 1..=4) => I32,
            (K::DataPageHeader, 5) | (K::DataPageHeaderV2, 8) | (K::ColumnMetaData, 12) => {
                Struct(K::Statistics)
            }
            (K::DictionaryPageHeader, 1 | 2) => I32,
            (K::DictionaryPageHeader, 3) | (K::DataPageHeaderV2, 7) => Bool,
            (K::DataPageHeaderV2, 1..=6) => I32,
            (K::Statistics, 1 | 2 | 5 | 6) => Binary,
            (K::Statistics, 3 | 4 | 9) => I64,
            (K::Statistics, 7 | 8) => Bool,

            (K::FileMetaData, 1) => I32,
            (K::FileMetaData, 2) => List(&Struct(K::SchemaElement)),
            (K::FileMetaData, 3) => I64,
            (K::FileMetaData, 4) => List(&Struct(K::RowGroup)),
            (K::FileMetaData, 5) | (K::ColumnMetaData, 8) => List(&Struct(K::KeyValue)),
            (K::FileMetaData, 6) => Binary,
            (K::FileMetaData, 7) => List(&Struct(K::ColumnOrder)),
            (K::SchemaElement, 1..=3 | 5..=9) => I32,
            (K::SchemaElement, 4) => Binary,
            (K::SchemaElement, 10) => Struct(K::LogicalType),
            (K::LogicalType, 1..=4 | 6 | 11..=15 | 19) => Struct(K::Empty),
            (K::LogicalType, 5) => Struct(K::DecimalType),
            (K::LogicalType, 7 | 8) => Struct(K::TimestampType),
            (K::LogicalType, 10) => Struct(K::IntType),
            (K::LogicalType, 16) => Struct(K::VariantType),
            (K::LogicalType, 17) => Struct(K::GeometryType),
            (K::LogicalType, 18) => Struct(K::GeographyType),
            (K::DecimalType, 1 | 2) => I32,
            (K::TimestampType, 1) => Bool,
            (K::TimestampType, 2) => Struct(K::TimeUnit),
            (K::TimeUnit | K::ColumnOrder, 1..=3) => Struct(K::Empty),
            (K::IntType, 1) | (K::VariantType, 1) => Byte,
            (K::IntType, 2) => Bool,
            (K::GeometryType, 1) | (K::GeographyType, 1) | (K::KeyValue, 1 | 2) => Binary,
            (K::GeographyType, 2) => I32,
            (K::RowGroup, 1) => List(&Struct(K::ColumnChunk)),
            (K::RowGroup, 2 | 3 | 5 | 6) => I64,
            (K::RowGroup, 4) => List(&Struct(K::SortingColumn)),
            (K::RowGroup, 7) => I16,
            (K::SortingColumn, 1) => I32,
            (K::SortingColumn, 2 | 3) => Bool,
            (K::ColumnChunk, 1) => Binary,
            (K::ColumnChunk, 2 | 4 | 6) => I64,
            (K::ColumnChunk, 3) => Struct(K::ColumnMetaData),
            (K::ColumnChunk, 5 | 7) => I32,
            (K::ColumnMetaData, 1 | 4 | 15) => I32,
            (K::ColumnMetaData, 2) => List(&I32),
            (K::ColumnMetaData, 3) => List(&Binary),
            (K::ColumnMetaData, 5..=7 | 9..=11 | 14) => I64,
            (K::ColumnMetaData, 13) => List(&Struct(K::PageEncodingStats)),
            (K::ColumnMetaData, 16) => Struct(K::SizeStatistics),
            (K::ColumnMetaData, 17) => Struct(K::GeospatialStatistics),
            (K::PageEncodingStats, 1..=3) => I32,
            (K::SizeStatistics, 1) => I64,
            (K::SizeStatistics, 2 | 3) => List(&I64),
            (K::GeospatialStatistics, 1) => Struct(K::BoundingBox),
            (K::GeospatialStatistics, 2) => List(&I32),
            (K::BoundingBox, 1..=8) => Double,
            _ => return None,
        })
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
        let (Some(compressed), Some(uncompressed), true) =
            (sizes.compressed, sizes.uncompressed, sizes.page_type)
        else {
            return Err(format!(
                "page header at byte {at}: a type, an uncompressed and a compressed size are required"
            ));
        };
        if uncompressed > MAX_PAGE_BYTES {
            return Err(format!(
                "page header at byte {at}: a page of {uncompressed} bytes uncompressed, over \
                 the {} MiB a records page may hold",
                MAX_PAGE_BYTES >> 20
            ));
        }
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
    walk.known_struct(Known::FileMetaData, &mut Sizes::default(), 0)
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
                Some(ty) if !ty.is(wire_type) => {
                    return self.fail(format!(
                        "{known:?} field {id} has wire type {}, the Parquet format types it {}",
                        wire::name(wire_type),
                        wire::name(ty.wire())
                    ));
                }
                Some(Ty::I32) => {
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
                Some(ty) => self.typed(ty, sizes, depth + 1)?,
            }
            last_id = id;
        }
        Ok(())
    }

    /// A value of a known type, whose wire type has been checked.
    fn typed(&mut self, ty: Ty, sizes: &mut Sizes, depth: usize) -> Result<(), Failure> {
        if depth > MAX_DEPTH {
            return self.fail(format!("values nested over {MAX_DEPTH} deep"));
        }
        match ty {
            Ty::Struct(known) => self.known_struct(known, sizes, depth),
            Ty::List(element) => {
                let at = self.pos;
                let Some((element_wire, size)) = self.list_header()? else {
                    return Ok(());
                };
                if !element.is(element_wire) {
                    return Err((
                        at,
                        format!(
                            "a list of {} elements, the Parquet format types them {}",
                            wire::name(element_wire),
                            wire::name(element.wire())
                        ),
                    ));
                }
                for _ in 0..size {
                    self.typed(*element, sizes, depth + 1)?;
                }
                Ok(())
            }
            plain => self.value(plain.wire(), depth),
        }
    }

    /// A list's or set's header: `None` for an empty one, else its element type (never
    /// booleans) and its size, which fits in the bytes left.
    fn list_header(&mut self) -> Result<Option<(u8, usize)>, Failure> {
        let at = self.pos;
        let header = self.byte()?;
        if header == 0 {
            return Ok(None);
        }
        let size = match header >> 4 {
            15 => self.varint()?,
            small => u64::from(small),
        };
        let element = element_type(at, header & 0x0f)?;
        let size = self.count(size, 1)?;
        Ok(Some((element, size)))
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
                if let Some((element, size)) = self.list_header()? {
                    for _ in 0..size {
                        self.value(element, depth + 1)?;
                    }
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

    /// A field header in the long form (the id written out).
    fn field(wire_type: u8, id: i16) -> Vec<u8> {
        let mut f = vec![wire_type];
        f.extend(zigzag(id.into()));
        f
    }

    fn binary(bytes: &[u8]) -> Vec<u8> {
        let mut b = varint(bytes.len() as u64);
        b.extend_from_slice(bytes);
        b
    }

    /// A data page header as Parquet writers write it: type, sizes, a data page header with
    /// its four fields; `extra` goes in before the closing stop byte.
    fn header(compressed: i32, extra: &[u8]) -> Vec<u8> {
        sized_header(compressed, compressed + 4, extra)
    }

    fn sized_header(compressed: i32, uncompressed: i32, extra: &[u8]) -> Vec<u8> {
        let mut h = vec![0x15];
        h.extend(zigzag(0)); // type DATA_PAGE
        h.push(0x15);
        h.extend(zigzag(uncompressed.into()));
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
        let mut extra = field(wire::BINARY, 20);
        extra.extend(binary(b"abc"));
        chunk.extend(page(5, &extra));
        assert_eq!(check_column_chunk(&chunk), Ok(()));
        assert_eq!(check_column_chunk(&[]), Ok(()));
    }

    /// The fuzz target's finding: an unknown field holding a list of 2^31 - 1 doubles.
    #[test]
    fn a_huge_declared_list_is_refused_at_once() {
        let mut extra = field(wire::LIST, 20);
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
            let mut e = field(wire::LIST, 20);
            e.extend([0x31, 1, 1, 1]);
            e
        };
        let long_binary = {
            let mut e = field(wire::BINARY, 20);
            e.extend(varint(1 << 40));
            e
        };
        let wrong_type = {
            // field 4 (crc) declared a binary: parquet would read its length as the crc.
            let mut e = field(wire::BINARY, 4);
            e.extend(binary(b"x"));
            e
        };
        let deep = {
            let mut e = field(wire::STRUCT, 20);
            e.extend(std::iter::repeat_n(0x1c, 40));
            e
        };
        let cases: [(Vec<u8>, &str); 6] = [
            (page(4, &bool_list), "a collection of booleans"),
            (
                page(4, &long_binary),
                "1099511627776 elements or bytes declared",
            ),
            (
                page(4, &wrong_type),
                "PageHeader field 4 has wire type binary, the Parquet format types it i32",
            ),
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
        let mut huge = sized_header(4, MAX_PAGE_BYTES + 1, &[]);
        huge.extend([0; 4]);
        assert!(
            check_column_chunk(&huge)
                .unwrap_err()
                .contains("a page of 268435457 bytes uncompressed, over the 256 MiB")
        );
        let mut largest = sized_header(4, MAX_PAGE_BYTES, &[]);
        largest.extend([0; 4]);
        assert_eq!(check_column_chunk(&largest), Ok(()));
        let mut no_sizes = vec![0x15];
        no_sizes.extend(zigzag(0));
        no_sizes.push(0);
        assert!(
            check_column_chunk(&no_sizes)
                .unwrap_err()
                .contains("are required")
        );
    }

    /// A footer as Parquet writers write it: version, a schema of a root and one `i64`
    /// column annotated by `logical_type` (a `LogicalType` union's bytes), the row count, one
    /// row group of one column chunk, and `extra` fields last. Every field carries its id in
    /// full, so that a test can change one field's wire type in place.
    fn footer(logical_type: &[u8], extra: &[u8]) -> Vec<u8> {
        use wire::*;
        let mut f = field(I32, 1);
        f.extend(zigzag(2));
        f.extend(field(LIST, 2));
        f.push(0x2c); // two structs
        f.extend(field(BINARY, 4));
        f.extend(binary(b"schema"));
        f.extend(field(I32, 5));
        f.extend(zigzag(1));
        f.push(0);
        f.extend(field(I32, 1));
        f.extend(zigzag(2)); // INT64
        f.extend(field(I32, 3));
        f.extend(zigzag(0)); // REQUIRED
        f.extend(field(BINARY, 4));
        f.extend(binary(b"x"));
        f.extend(field(STRUCT, 10));
        f.extend_from_slice(logical_type);
        f.push(0);
        f.extend(field(I64, 3));
        f.extend(zigzag(10));
        f.extend(field(LIST, 4));
        f.push(0x1c); // one row group
        f.extend(field(LIST, 1));
        f.push(0x1c); // one column chunk
        f.extend(field(I64, 2));
        f.extend(zigzag(4));
        f.extend(field(STRUCT, 3)); // its metadata
        f.extend(field(I32, 1));
        f.extend(zigzag(2));
        f.extend(field(LIST, 2));
        f.push(0x15); // encodings: PLAIN
        f.extend(zigzag(0));
        f.extend(field(LIST, 3));
        f.push(0x18); // path: "x"
        f.extend(binary(b"x"));
        for (id, v) in [(4, 0), (5, 10), (6, 84), (7, 84), (9, 4)] {
            f.extend(field(if id == 4 { I32 } else { I64 }, id));
            f.extend(zigzag(v));
        }
        f.push(0);
        f.push(0); // end of the column chunk
        f.extend(field(I64, 2));
        f.extend(zigzag(84));
        f.extend(field(I64, 3));
        f.extend(zigzag(10));
        f.push(0); // end of the row group
        f.extend_from_slice(extra);
        f.push(0);
        f
    }

    /// `LogicalType`: an `INTEGER(64, signed)`.
    fn integer_type() -> Vec<u8> {
        let mut t = field(wire::STRUCT, 10);
        t.extend(field(wire::BYTE, 1));
        t.push(64);
        t.extend(field(wire::BOOL_TRUE, 2));
        t.extend([0, 0]);
        t
    }

    #[test]
    fn well_formed_footers_pass() {
        assert_eq!(check_footer(&footer(&integer_type(), &[])), Ok(()));
        // Key-values, a created-by string, column orders; a field parquet does not know (id
        // 20, a list of i64) is skipped whatever it holds.
        let mut extra = field(wire::LIST, 5);
        extra.push(0x1c);
        extra.extend(field(wire::BINARY, 1));
        extra.extend(binary(b"k"));
        extra.extend(field(wire::BINARY, 2));
        extra.extend(binary(b"v"));
        extra.push(0);
        extra.extend(field(wire::BINARY, 6));
        extra.extend(binary(b"parquet-rs"));
        extra.extend(field(wire::LIST, 7));
        extra.push(0x1c);
        extra.extend(field(wire::STRUCT, 1));
        extra.extend([0, 0]);
        extra.extend(field(wire::LIST, 20));
        extra.push(0x26);
        extra.extend(zigzag(-5));
        extra.extend(zigzag(1 << 40));
        assert_eq!(check_footer(&footer(&integer_type(), &extra)), Ok(()));
        // They are footers parquet reads (so the cases below change real footers).
        use parquet::file::metadata::ParquetMetaDataReader;
        for f in [
            footer(&integer_type(), &[]),
            footer(&integer_type(), &extra),
        ] {
            let metadata = ParquetMetaDataReader::decode_metadata(&f).unwrap();
            assert_eq!(metadata.file_metadata().num_rows(), 10);
            assert_eq!(metadata.row_group(0).column(0).num_values(), 10);
        }
    }

    /// The fuzz target's finding, by hand: a field parquet reads by its id given another wire
    /// type, at each level of the footer, is refused naming the struct and the field.
    #[test]
    fn footer_fields_of_another_wire_type_are_refused() {
        let good = footer(&integer_type(), &[]);
        let at = |from: usize, pattern: &[u8]| {
            from + good[from..]
                .windows(pattern.len())
                .position(|w| w == pattern)
                .unwrap()
        };
        // Each case: where a field header is (found after a marker), the wire type it gets,
        // what the error says.
        let column_path = at(0, &[wire::LIST, 6]); // ColumnMetaData field 3
        let cases: [(usize, u8, &str); 6] = [
            (
                0,
                wire::I64,
                "FileMetaData field 1 has wire type i64, the Parquet format types it i32",
            ),
            (
                at(0, &[wire::I32, 6]),
                wire::BOOL_FALSE,
                "SchemaElement field 3 has wire type bool",
            ),
            (
                at(0, &[wire::BYTE, 2]),
                wire::I32,
                "IntType field 1 has wire type i32, the Parquet format types it byte",
            ),
            (
                at(0, &[wire::BOOL_TRUE, 4]),
                wire::BYTE,
                "IntType field 2 has wire type byte, the Parquet format types it bool",
            ),
            (
                column_path,
                wire::BINARY,
                "ColumnMetaData field 3 has wire type binary, the Parquet format types it list",
            ),
            (
                at(column_path, &[wire::I32, 8]),
                wire::I64,
                "ColumnMetaData field 4 has wire type i64",
            ),
        ];
        for (pos, wire_type, message) in cases {
            let mut bad = good.clone();
            bad[pos] = wire_type;
            let err = check_footer(&bad).unwrap_err();
            assert!(err.contains(message), "{err} lacks {message}");
            assert!(
                err.starts_with(&format!("byte {} of the footer", pos + 2)),
                "{err}"
            );
        }
        // A known list of another element type: the column's encodings as i64.
        let encodings = at(0, &[wire::LIST, 4, 0x15]) + 2;
        let mut bad = good.clone();
        bad[encodings] = 0x16;
        let err = check_footer(&bad).unwrap_err();
        assert!(
            err.contains(&format!(
                "byte {encodings} of the footer: a list of i64 elements, the Parquet format types them i32"
            )),
            "{err}"
        );
        // Inside a union: a geography's algorithm given as a string.
        let mut geography = field(wire::STRUCT, 18);
        geography.extend(field(wire::BINARY, 2));
        geography.extend(binary(b"SPHERICAL"));
        geography.extend([0, 0]);
        let err = check_footer(&footer(&geography, &[])).unwrap_err();
        assert!(
            err.contains(
                "GeographyType field 2 has wire type binary, the Parquet format types it i32"
            ),
            "{err}"
        );
    }

    /// The field table follows parquet 60.1's readers: an upgrade of the parquet crate must
    /// come with a look at what its footer and page-header readers read by id (see
    /// [`Known::field`]), then a new version here.
    #[test]
    fn the_field_table_matches_the_locked_parquet_version() {
        let lock =
            std::fs::read_to_string(bertkit_test_support::repo_root().join("Cargo.lock")).unwrap();
        let version = lock
            .split("[[package]]")
            .find(|p| p.contains("\nname = \"parquet\"\n"))
            .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
            .unwrap();
        assert_eq!(
            version, "\"60.1.0\"",
            "parquet was upgraded: check Known::field against its Thrift readers"
        );
    }
}
