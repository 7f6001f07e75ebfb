//! The sorted string table a bundle's `.index` file is (TensorFlow's copy of LevelDB's table
//! format): data blocks of prefix-compressed key/value entries with restart points, an index
//! block of handles to them, a meta-index block, and a 48-byte footer ending in a magic number.
//! Every block carries a type byte (0: uncompressed) and a masked CRC-32C. TensorFlow writes
//! bundle indexes uncompressed; a compressed block is refused by name.

use crate::proto::{read_varint, write_varint};
use bertkit_stage_io::crc32c::{crc32c, mask, unmask};

const MAGIC: u64 = 0xdb47_7524_8b80_fb57;
const FOOTER_LEN: usize = 48;
const BLOCK_TRAILER_LEN: usize = 5;
/// Entries between restart points (LevelDB's and TensorFlow's default).
const RESTART_INTERVAL: usize = 16;

/// A table's keys and values, in order.
pub type Rows = Vec<(Vec<u8>, Vec<u8>)>;

/// A block's place in the file.
#[derive(Debug, Clone, Copy)]
struct Handle {
    offset: u64,
    size: u64,
}

impl Handle {
    fn decode(bytes: &[u8], at: &mut usize) -> Result<Self, String> {
        Ok(Handle {
            offset: read_varint(bytes, at)?,
            size: read_varint(bytes, at)?,
        })
    }

    fn encode(&self, out: &mut Vec<u8>) {
        write_varint(out, self.offset);
        write_varint(out, self.size);
    }
}

/// Every key and value of the table in `file`, in the table's (sorted) order.
pub(crate) fn read(file: &[u8]) -> Result<Rows, String> {
    if file.len() < FOOTER_LEN {
        return Err(format!(
            "{} bytes, shorter than a table's {FOOTER_LEN}-byte footer (truncated?)",
            file.len()
        ));
    }
    let footer = &file[file.len() - FOOTER_LEN..];
    let magic = u64::from_le_bytes(footer[40..].try_into().expect("8 bytes"));
    if magic != MAGIC {
        return Err(format!(
            "no table magic number at the end (found {magic:#018x}): not a checkpoint index, or truncated"
        ));
    }
    let mut at = 0;
    let _meta_index = Handle::decode(footer, &mut at)?;
    let index = Handle::decode(footer, &mut at)?;
    let mut out = Vec::new();
    for (_, value) in block_entries(file, index, "index block")? {
        let handle = Handle::decode(&value, &mut 0)?;
        let label = format!("data block at byte {}", handle.offset);
        out.extend(block_entries(file, handle, &label)?);
    }
    Ok(out)
}

/// The entries of the block at `handle`, its checksum checked.
fn block_entries(file: &[u8], handle: Handle, label: &str) -> Result<Rows, String> {
    let start = usize::try_from(handle.offset).map_err(|_| format!("{label}: offset too large"))?;
    let size = usize::try_from(handle.size).map_err(|_| format!("{label}: size too large"))?;
    let end = start
        .checked_add(size)
        .and_then(|e| e.checked_add(BLOCK_TRAILER_LEN))
        .filter(|&e| e <= file.len().saturating_sub(FOOTER_LEN))
        .ok_or_else(|| {
            format!(
                "{label}: {size} bytes at {start} run past the end of the file's {} (truncated?)",
                file.len()
            )
        })?;
    let contents = &file[start..start + size];
    let kind = file[start + size];
    let stored = u32::from_le_bytes(file[start + size + 1..end].try_into().expect("4 bytes"));
    let mut checked = contents.to_vec();
    checked.push(kind);
    let computed = crc32c(&checked);
    if unmask(stored) != computed {
        return Err(format!(
            "{label}: CRC-32C mismatch (stored {:#010x}, computed {computed:#010x}): the file is damaged",
            unmask(stored)
        ));
    }
    if kind != 0 {
        return Err(format!(
            "{label}: compression type {kind} (TensorFlow writes checkpoint indexes uncompressed; only those are read)"
        ));
    }
    entries(contents).map_err(|e| format!("{label}: {e}"))
}

fn entries(block: &[u8]) -> Result<Rows, String> {
    if block.len() < 4 {
        return Err("shorter than its restart count".into());
    }
    let restarts =
        u32::from_le_bytes(block[block.len() - 4..].try_into().expect("4 bytes")) as usize;
    let data_end = restarts
        .checked_mul(4)
        .and_then(|r| block.len().checked_sub(4 + r))
        .ok_or_else(|| {
            format!(
                "{restarts} restart points do not fit in {} bytes",
                block.len()
            )
        })?;
    let data = &block[..data_end];
    let mut out: Rows = Vec::new();
    let mut key: Vec<u8> = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let shared = read_varint(data, &mut at)? as usize;
        let unshared = read_varint(data, &mut at)? as usize;
        let value_len = read_varint(data, &mut at)? as usize;
        if shared > key.len() {
            return Err(format!(
                "an entry at byte {at} shares {shared} bytes of a {}-byte key",
                key.len()
            ));
        }
        let end = at
            .checked_add(unshared)
            .and_then(|e| e.checked_add(value_len))
            .filter(|&e| e <= data.len())
            .ok_or_else(|| format!("an entry at byte {at} runs past the block's end"))?;
        key.truncate(shared);
        key.extend_from_slice(&data[at..at + unshared]);
        let value = data[at + unshared..end].to_vec();
        at = end;
        if let Some((previous, _)) = out.last()
            && previous.as_slice() >= key.as_slice()
        {
            return Err(format!(
                "keys out of order: {:?} after {:?}",
                String::from_utf8_lossy(&key),
                String::from_utf8_lossy(previous)
            ));
        }
        out.push((key.clone(), value));
    }
    Ok(out)
}

/// A block of `entries` (sorted), with its restart points.
fn build_block(entries: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut restarts = Vec::new();
    let mut previous: &[u8] = &[];
    for (i, (key, value)) in entries.iter().enumerate() {
        let shared = if i % RESTART_INTERVAL == 0 {
            restarts.push(out.len() as u32);
            0
        } else {
            previous
                .iter()
                .zip(key.iter())
                .take_while(|(a, b)| a == b)
                .count()
        };
        write_varint(&mut out, shared as u64);
        write_varint(&mut out, (key.len() - shared) as u64);
        write_varint(&mut out, value.len() as u64);
        out.extend_from_slice(&key[shared..]);
        out.extend_from_slice(value);
        previous = key;
    }
    if restarts.is_empty() {
        restarts.push(0);
    }
    for r in &restarts {
        out.extend_from_slice(&r.to_le_bytes());
    }
    out.extend_from_slice(&(restarts.len() as u32).to_le_bytes());
    out
}

/// Appends `block` with its trailer (uncompressed, masked CRC-32C); returns its handle.
fn append_block(file: &mut Vec<u8>, block: &[u8]) -> Handle {
    let handle = Handle {
        offset: file.len() as u64,
        size: block.len() as u64,
    };
    file.extend_from_slice(block);
    let mut checked = block.to_vec();
    checked.push(0);
    file.push(0);
    file.extend_from_slice(&mask(crc32c(&checked)).to_le_bytes());
    handle
}

/// A table of `entries`, which must be sorted by key with no key twice: one data block (a
/// checkpoint index is a few hundred small entries), an empty meta-index, the index, the footer.
pub(crate) fn write(entries: &[(&[u8], &[u8])]) -> Vec<u8> {
    debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
    let mut file = Vec::new();
    let data = append_block(&mut file, &build_block(entries));
    let meta_index = append_block(&mut file, &build_block(&[]));
    let mut data_handle = Vec::new();
    data.encode(&mut data_handle);
    // The index key only has to sort at or after the block's last key.
    let last_key: &[u8] = entries.last().map_or(&[], |(k, _)| k);
    let index = append_block(&mut file, &build_block(&[(last_key, &data_handle)]));
    let mut footer = Vec::with_capacity(FOOTER_LEN);
    meta_index.encode(&mut footer);
    index.encode(&mut footer);
    footer.resize(FOOTER_LEN - 8, 0);
    footer.extend_from_slice(&MAGIC.to_le_bytes());
    file.extend_from_slice(&footer);
    file
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_round_trip_with_shared_prefixes() {
        let keys: Vec<String> = std::iter::once(String::new())
            .chain(
                (0..40).map(|i| format!("bert/encoder/layer_{i:02}/attention/self/query/kernel")),
            )
            .collect();
        let entries: Vec<(&[u8], &[u8])> =
            keys.iter().map(|k| (k.as_bytes(), k.as_bytes())).collect();
        let file = write(&entries);
        let back = read(&file).unwrap();
        assert_eq!(back.len(), 41);
        for ((k, v), key) in back.iter().zip(&keys) {
            assert_eq!(k, key.as_bytes());
            assert_eq!(v, key.as_bytes());
        }
    }

    #[test]
    fn damage_is_found() {
        let entries: Vec<(&[u8], &[u8])> = vec![(b"", b"h"), (b"a", b"1"), (b"b", b"2")];
        let file = write(&entries);
        let mut flipped = file.clone();
        flipped[3] ^= 1;
        assert!(read(&flipped).unwrap_err().contains("CRC-32C mismatch"));
        assert!(read(&file[..file.len() - 1]).unwrap_err().contains("magic"));
        assert!(read(&file[..10]).unwrap_err().contains("truncated"));
        for cut in 0..file.len() {
            assert!(read(&file[..cut]).is_err());
        }
    }
}
