//! The few protocol-buffer messages of a tensor bundle's index, decoded and encoded by hand
//! (`BundleHeaderProto`, `BundleEntryProto`, `TensorShapeProto`, `VersionDef`): a handful of
//! fields, so no protobuf compiler or runtime. Unknown fields are skipped, as protobuf does.

/// Reads a base-128 varint at `*at`, advancing it.
pub(crate) fn read_varint(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(&b) = bytes.get(*at) else {
            return Err(format!("a varint runs past the end at byte {at}"));
        };
        *at += 1;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(format!("a varint longer than 10 bytes ending at byte {at}"))
}

/// Appends `value` as a varint.
pub(crate) fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// One field of a message: its number and value.
enum Field<'a> {
    Varint(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
}

/// Calls `each` with every field of the message `bytes`.
fn fields<'a>(
    bytes: &'a [u8],
    mut each: impl FnMut(u64, Field<'a>) -> Result<(), String>,
) -> Result<(), String> {
    let mut at = 0;
    while at < bytes.len() {
        let tag = read_varint(bytes, &mut at)?;
        let (number, wire) = (tag >> 3, tag & 7);
        let field = match wire {
            0 => Field::Varint(read_varint(bytes, &mut at)?),
            1 => {
                let end = at + 8;
                if end > bytes.len() {
                    return Err(format!("field {number}: 8 bytes past the end"));
                }
                at = end;
                continue;
            }
            2 => {
                let len = read_varint(bytes, &mut at)? as usize;
                let end = at
                    .checked_add(len)
                    .filter(|&e| e <= bytes.len())
                    .ok_or_else(|| format!("field {number}: {len} bytes past the end"))?;
                let value = &bytes[at..end];
                at = end;
                Field::Bytes(value)
            }
            5 => {
                let end = at + 4;
                let Some(b) = bytes.get(at..end) else {
                    return Err(format!("field {number}: 4 bytes past the end"));
                };
                at = end;
                Field::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            other => return Err(format!("field {number}: unknown wire type {other}")),
        };
        each(number, field)?;
    }
    Ok(())
}

/// `BundleHeaderProto`: how many data shards, which byte order.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Header {
    pub num_shards: u32,
    /// 0: little-endian, 1: big-endian.
    pub endianness: u64,
    pub producer: u64,
}

impl Header {
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut h = Header::default();
        fields(bytes, |number, field| {
            match (number, field) {
                (1, Field::Varint(v)) => h.num_shards = v as u32,
                (2, Field::Varint(v)) => h.endianness = v,
                (3, Field::Bytes(version)) => fields(version, |n, f| {
                    if let (1, Field::Varint(v)) = (n, f) {
                        h.producer = v;
                    }
                    Ok(())
                })?,
                _ => {}
            }
            Ok(())
        })?;
        Ok(h)
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.push(1 << 3);
        write_varint(&mut out, u64::from(self.num_shards));
        if self.endianness != 0 {
            out.push(2 << 3);
            write_varint(&mut out, self.endianness);
        }
        let mut version = vec![1 << 3];
        write_varint(&mut version, self.producer);
        out.push((3 << 3) | 2);
        write_varint(&mut out, version.len() as u64);
        out.extend_from_slice(&version);
        out
    }
}

/// `BundleEntryProto`: where one tensor's bytes are and what they hold.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct EntryProto {
    pub dtype: u64,
    pub shape: Vec<i64>,
    pub unknown_rank: bool,
    pub shard_id: u32,
    pub offset: u64,
    pub size: u64,
    /// Masked CRC-32C of the bytes.
    pub crc32c: u32,
    /// Whether the entry is a partitioned variable (its slices stored as separate entries).
    pub sliced: bool,
}

impl EntryProto {
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut e = EntryProto::default();
        fields(bytes, |number, field| {
            match (number, field) {
                (1, Field::Varint(v)) => e.dtype = v,
                (2, Field::Bytes(shape)) => fields(shape, |n, f| {
                    match (n, f) {
                        (2, Field::Bytes(dim)) => {
                            let mut size = 0i64;
                            fields(dim, |n, f| {
                                if let (1, Field::Varint(v)) = (n, f) {
                                    size = v as i64;
                                }
                                Ok(())
                            })?;
                            e.shape.push(size);
                        }
                        (3, Field::Varint(v)) => e.unknown_rank = v != 0,
                        _ => {}
                    }
                    Ok(())
                })?,
                (3, Field::Varint(v)) => e.shard_id = v as u32,
                (4, Field::Varint(v)) => e.offset = v,
                (5, Field::Varint(v)) => e.size = v,
                (6, Field::Fixed32(v)) => e.crc32c = v,
                (7, Field::Bytes(_)) => e.sliced = true,
                _ => {}
            }
            Ok(())
        })?;
        Ok(e)
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = vec![1 << 3];
        write_varint(&mut out, self.dtype);
        let mut shape = Vec::new();
        for &d in &self.shape {
            let mut dim = vec![1 << 3];
            write_varint(&mut dim, d as u64);
            shape.push((2 << 3) | 2);
            write_varint(&mut shape, dim.len() as u64);
            shape.extend_from_slice(&dim);
        }
        out.push((2 << 3) | 2);
        write_varint(&mut out, shape.len() as u64);
        out.extend_from_slice(&shape);
        if self.shard_id != 0 {
            out.push(3 << 3);
            write_varint(&mut out, u64::from(self.shard_id));
        }
        if self.offset != 0 {
            out.push(4 << 3);
            write_varint(&mut out, self.offset);
        }
        out.push(5 << 3);
        write_varint(&mut out, self.size);
        out.push((6 << 3) | 5);
        out.extend_from_slice(&self.crc32c.to_le_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_and_headers_round_trip() {
        let e = EntryProto {
            dtype: 1,
            shape: vec![30522, 768],
            unknown_rank: false,
            shard_id: 0,
            offset: 123_456_789,
            size: 30522 * 768 * 4,
            crc32c: 0xdead_beef,
            sliced: false,
        };
        assert_eq!(EntryProto::decode(&e.encode()).unwrap(), e);
        let scalar = EntryProto {
            dtype: 9,
            size: 8,
            ..EntryProto::default()
        };
        assert_eq!(EntryProto::decode(&scalar.encode()).unwrap(), scalar);
        let h = Header {
            num_shards: 1,
            endianness: 0,
            producer: 1,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn truncated_messages_are_errors() {
        let e = EntryProto {
            dtype: 1,
            shape: vec![4, 3],
            size: 48,
            ..EntryProto::default()
        }
        .encode();
        for cut in 1..e.len() {
            // Every cut either fails or decodes a prefix; none panics.
            let _ = EntryProto::decode(&e[..cut]);
        }
        assert!(EntryProto::decode(&[0x12, 0x05, 0x12]).is_err());
        assert!(read_varint(&[0x80; 11], &mut 0).is_err());
    }
}
