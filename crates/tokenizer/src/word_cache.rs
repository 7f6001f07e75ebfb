//! A bounded cache of words to their WordPiece ids, for bulk tokenization.
//!
//! Real text repeats a small set of words, so most words are split once and then looked up. A
//! word of up to 16 bytes (99.9% of words in English text) is keyed by its bytes packed into a
//! `u128`: no word holds a NUL (cleaning drops it), so zero padding is unambiguous, and a lookup
//! hashes and compares one integer instead of a string. Longer words are keyed by their text.
//! An entry holds up to [`INLINE_IDS`] ids itself (all but a few words in practice), so a hit
//! reads nothing but the table; longer id lists live in one shared arena.
//!
//! Packed words live in an open-addressing table of 32-byte slots (key and entry, linear
//! probing, at most 3/4 full) whose slot for a key is known from its hash alone, so a caller
//! with a line's words at hand can [`WordCache::prefetch`] their slots before looking them up:
//! a shard's tens of thousands of distinct words outgrow the L2 cache, and the lookups of rare
//! words then wait on memory one after another unless their loads overlap. The cache is
//! emptied when it holds [`WORD_CACHE_ENTRIES`] words, which bounds its memory (16 MiB of
//! slots at most).

/// Words a [`WordCache`] holds before it is emptied.
pub const WORD_CACHE_ENTRIES: usize = 1 << 18;

/// Longest word kept under a packed key, and the bytes [`pack_ascii`] loads at once.
pub const PACKED_WORD_BYTES: usize = 16;

/// Ids an entry holds itself.
pub const INLINE_IDS: usize = 3;

/// A word's ids: `len` of them, in `ids` when they fit, else at offset `ids[0]` of the arena.
#[derive(Clone, Copy)]
struct Entry {
    ids: [u32; INLINE_IDS],
    len: u32,
}

/// A slot of [`PackedTable`]: key 0 (no word packs to it) marks an empty slot.
#[derive(Clone, Copy)]
struct Slot {
    key: u128,
    entry: Entry,
}

/// Packed words to entries: open addressing with linear probing (see the module documentation).
struct PackedTable {
    slots: Vec<Slot>,
    len: usize,
}

/// The hash of a packed word: a folded 128-bit multiply of its halves, mixed with constants.
#[inline]
pub fn key_hash(key: u128) -> u64 {
    let product = u128::from((key as u64) ^ 0x243F_6A88_85A3_08D3)
        * u128::from(((key >> 64) as u64) ^ 0x1319_8A2E_0370_7344);
    let folded = (product as u64) ^ ((product >> 64) as u64);
    folded.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl PackedTable {
    /// Room for `words` (a power of two of slots, at most 3/4 full).
    fn with_room(words: usize) -> Self {
        let slots = (words * 4 / 3 + 1).next_power_of_two();
        PackedTable {
            slots: vec![
                Slot {
                    key: 0,
                    entry: Entry {
                        ids: [0; INLINE_IDS],
                        len: 0
                    }
                };
                slots
            ],
            len: 0,
        }
    }

    #[inline]
    fn index(&self, hash: u64) -> usize {
        // The high bits: the multiply leaves them best mixed.
        (hash >> (64 - self.slots.len().trailing_zeros())) as usize
    }

    #[inline]
    fn prefetch(&self, hash: u64) {
        bertkit_stage_io::prefetch::prefetch(&self.slots[self.index(hash)..self.index(hash) + 1]);
    }

    #[inline]
    fn get(&self, key: u128, hash: u64) -> Option<&Entry> {
        let mask = self.slots.len() - 1;
        let mut i = self.index(hash);
        loop {
            let slot = &self.slots[i];
            if slot.key == key {
                return Some(&slot.entry);
            }
            if slot.key == 0 {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    /// Inserts a key that is not in the table.
    fn insert(&mut self, key: u128, hash: u64, entry: Entry) {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            let mut bigger = PackedTable::with_room(2 * self.slots.len());
            for slot in self.slots.iter().filter(|s| s.key != 0) {
                bigger.insert(slot.key, key_hash(slot.key), slot.entry);
            }
            *self = bigger;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.index(hash);
        while self.slots[i].key != 0 {
            i = (i + 1) & mask;
        }
        self.slots[i] = Slot { key, entry };
        self.len += 1;
    }
}

/// Words to WordPiece ids (see the module documentation).
pub struct WordCache {
    packed: PackedTable,
    long: ahash::AHashMap<Box<[u8]>, Entry>,
    /// Id lists longer than [`INLINE_IDS`].
    arena: Vec<u32>,
}

/// `word` (at most [`PACKED_WORD_BYTES`] bytes) as a zero-padded little-endian integer.
pub fn pack(word: &[u8]) -> u128 {
    let mut bytes = [0u8; PACKED_WORD_BYTES];
    bytes[..word.len()].copy_from_slice(word);
    u128::from_le_bytes(bytes)
}

/// [`pack`] of `text[start..end]` (at most [`PACKED_WORD_BYTES`] bytes), with one 16-byte load
/// when `text` holds 16 bytes from `start`.
#[inline]
pub fn pack_ascii(text: &[u8], start: usize, end: usize) -> u128 {
    let len = end - start;
    debug_assert!(len <= PACKED_WORD_BYTES);
    let Some(window) = text.get(start..start + PACKED_WORD_BYTES) else {
        return pack(&text[start..end]);
    };
    let value = u128::from_le_bytes(window.try_into().expect("a 16-byte window"));
    if len == PACKED_WORD_BYTES {
        value
    } else {
        value & ((1u128 << (8 * len)) - 1)
    }
}

/// ASCII lower-casing of the bytes packed in `key` (all below 0x80), 16 at once.
#[inline]
pub fn ascii_lowercase_packed(key: u128) -> u128 {
    const ONES: u128 = u128::MAX / 0xFF;
    // Bytes are below 0x80, so adding at most 0x3F never carries into the next byte: bit 7 of
    // a byte is set when it is at least 'A', and in the second sum when it is past 'Z'.
    let at_least_a = key + ONES * u128::from(0x80 - b'A');
    let past_z = key + ONES * u128::from(0x80 - b'Z' - 1);
    let upper = at_least_a & !past_z & (ONES * 0x80);
    key | (upper >> 2)
}

/// Words a new cache has room for: a shard's distinct words are tens of thousands, and
/// growing the table by doubling rehashes it into fresh pages each time (2 MiB at most; pages
/// are only touched as words arrive).
const INITIAL_WORDS: usize = 1 << 15;

impl Default for WordCache {
    fn default() -> Self {
        WordCache {
            packed: PackedTable::with_room(INITIAL_WORDS),
            long: ahash::AHashMap::default(),
            arena: Vec::new(),
        }
    }
}

impl WordCache {
    /// Words held.
    pub fn len(&self) -> usize {
        self.packed.len + self.long.len()
    }

    /// Asks the CPU to fetch the slot of a packed word with this [`key_hash`].
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        self.packed.prefetch(hash);
    }

    /// Appends the ids of `word` to `out`: from the cache, or from `split` (which appends the
    /// word's WordPiece ids to the vector it is given), remembered for next time. `key` is
    /// `Some(pack(word))` when the caller has it at hand.
    #[inline]
    pub fn extend_ids(
        &mut self,
        word: &[u8],
        key: Option<u128>,
        out: &mut Vec<u32>,
        split: impl FnOnce(&[u8], &mut Vec<u32>),
    ) {
        let key = key.or_else(|| (word.len() <= PACKED_WORD_BYTES).then(|| pack(word)));
        match key {
            // (Only an empty word packs to 0, the empty slot's mark: it goes by its text.)
            Some(key) if key != 0 => self.extend_ids_packed(word, key, key_hash(key), out, split),
            _ => {
                if let Some(entry) = self.long.get(word) {
                    self.push_entry(entry, out);
                    return;
                }
                let entry = self.split_entry(word, out, split);
                self.long.insert(word.into(), entry);
            }
        }
    }

    /// [`WordCache::extend_ids`] of a word of at most [`PACKED_WORD_BYTES`] bytes, given its
    /// packed `key` and that key's [`key_hash`].
    #[inline]
    pub fn extend_ids_packed(
        &mut self,
        word: &[u8],
        key: u128,
        hash: u64,
        out: &mut Vec<u32>,
        split: impl FnOnce(&[u8], &mut Vec<u32>),
    ) {
        debug_assert!(key != 0 && key == pack(word) && hash == key_hash(key));
        if let Some(entry) = self.packed.get(key, hash) {
            self.push_entry(entry, out);
            return;
        }
        let entry = self.split_entry(word, out, split);
        self.packed.insert(key, hash, entry);
    }

    #[inline]
    fn push_entry(&self, entry: &Entry, out: &mut Vec<u32>) {
        let len = entry.len as usize;
        if len == 1 {
            out.push(entry.ids[0]);
        } else if len <= INLINE_IDS {
            out.extend_from_slice(&entry.ids[..len]);
        } else {
            let start = entry.ids[0] as usize;
            out.extend_from_slice(&self.arena[start..start + len]);
        }
    }

    /// Splits a word not in the cache (appending its ids to `out`) and makes its entry,
    /// emptying the cache first when it is full.
    fn split_entry(
        &mut self,
        word: &[u8],
        out: &mut Vec<u32>,
        split: impl FnOnce(&[u8], &mut Vec<u32>),
    ) -> Entry {
        let first = out.len();
        split(word, out);
        if self.len() >= WORD_CACHE_ENTRIES {
            *self = WordCache::default();
        }
        let ids = &out[first..];
        let mut entry = Entry {
            ids: [0; INLINE_IDS],
            len: ids.len() as u32,
        };
        if ids.len() <= INLINE_IDS {
            entry.ids[..ids.len()].copy_from_slice(ids);
        } else {
            entry.ids[0] = self.arena.len() as u32;
            self.arena.extend_from_slice(ids);
        }
        entry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_with_one_load_equals_packing_a_copy() {
        let text = b"abcdefghijklmnopqrstuvwxyz";
        for start in 0..26 {
            for end in start..=(start + 16).min(26) {
                assert_eq!(pack_ascii(text, start, end), pack(&text[start..end]));
            }
        }
        assert_ne!(pack(b"a"), pack(b"b"));
        assert_ne!(pack(b"ab"), pack(b"ba"));
    }

    #[test]
    fn packed_lowercasing_equals_byte_lowercasing() {
        // Every ASCII byte at every position, next to every other.
        for b in 0u8..0x80 {
            for at in 0..PACKED_WORD_BYTES {
                for fill in [b'A', b'Z', b'a', b'@', b'[', 0x7F, 0] {
                    let mut word = [fill; PACKED_WORD_BYTES];
                    word[at] = b;
                    let lower = word.map(|c| c.to_ascii_lowercase());
                    assert_eq!(
                        ascii_lowercase_packed(u128::from_le_bytes(word)),
                        u128::from_le_bytes(lower),
                        "{word:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_word_is_split_once_and_cleared_past_the_bound() {
        let mut cache = WordCache::default();
        let mut calls = 0;
        let mut out = Vec::new();
        let words = [
            &b"hello"[..],
            b"hello",
            b"a-word-longer-than-sixteen",
            b"a-word-longer-than-sixteen",
            b"one",
            b"one",
            b"twelve-bytes",
            b"twelve-bytes",
            b"thirteen-byte",
            b"thirteen-byte",
        ];
        for word in words {
            cache.extend_ids(word, None, &mut out, |w, o| {
                calls += 1;
                o.push(w.len() as u32);
                if w != b"one" {
                    o.push(7);
                }
                // Past the inline capacity: the arena.
                if w.starts_with(b"twelve") {
                    o.extend_from_slice(&[8, 9, 10]);
                }
            });
        }
        assert_eq!(calls, 5);
        assert_eq!(
            out,
            [
                5, 7, 5, 7, 26, 7, 26, 7, 3, 3, 12, 7, 8, 9, 10, 12, 7, 8, 9, 10, 13, 7, 13, 7
            ]
        );
        // Past the table's first room: every word is still found after it grows.
        let mut cache = WordCache::default();
        let words = |i: u32| (i + 1).to_le_bytes();
        for i in 0..100_000u32 {
            cache.extend_ids(&words(i), None, &mut Vec::new(), |_, o| o.push(i));
        }
        assert_eq!(cache.len(), 100_000);
        let mut out = Vec::new();
        for i in 0..100_000u32 {
            cache.extend_ids(&words(i), None, &mut out, |_, _| panic!("split again"));
        }
        assert_eq!(out, (0..100_000).collect::<Vec<u32>>());
        for i in 0..WORD_CACHE_ENTRIES as u32 + 10 {
            cache.extend_ids(&i.to_le_bytes(), None, &mut Vec::new(), |_, o| o.push(i));
        }
        assert!(cache.len() <= WORD_CACHE_ENTRIES);
        assert!(cache.arena.len() <= WORD_CACHE_ENTRIES * 8);
    }
}
