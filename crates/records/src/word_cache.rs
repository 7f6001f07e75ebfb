//! A bounded cache of words to their WordPiece ids, for bulk tokenization.
//!
//! Real text repeats a small set of words, so most words are split once and then looked up. A
//! word of up to 16 bytes (99.9% of words in English text) is keyed by its bytes packed into a
//! `u128`: no word holds a NUL (cleaning drops it), so zero padding is unambiguous, and a lookup
//! hashes and compares one integer instead of a string. Longer words are keyed by their text.
//! Ids live in one shared arena, so an entry is an (offset, length) pair and a hit copies a
//! short slice. (An open-addressing table of 16-byte slots for words of up to 12 bytes was
//! measured 20% slower than this on the bench input.) The cache is emptied when it holds
//! [`WORD_CACHE_ENTRIES`] words, which bounds its memory (about 10 MB).

/// Words a [`WordCache`] holds before it is emptied.
pub const WORD_CACHE_ENTRIES: usize = 1 << 18;

/// Longest word kept under a packed key, and the bytes [`pack_padded`] loads at once (a
/// caller's buffer needs this much room after a word).
pub const PACKED_WORD_BYTES: usize = 16;

/// Where a word's ids are in the arena.
#[derive(Clone, Copy)]
struct Span {
    start: u32,
    len: u32,
}

/// Words to WordPiece ids (see the module documentation).
#[derive(Default)]
pub struct WordCache {
    packed: ahash::AHashMap<u128, Span>,
    long: ahash::AHashMap<Box<[u8]>, Span>,
    ids: Vec<u32>,
}

/// `word` (at most [`PACKED_WORD_BYTES`] bytes) as a zero-padded little-endian integer.
pub fn pack(word: &[u8]) -> u128 {
    let mut bytes = [0u8; PACKED_WORD_BYTES];
    bytes[..word.len()].copy_from_slice(word);
    u128::from_le_bytes(bytes)
}

/// [`pack`] of `buffer[start..end]` with one 16-byte load; `buffer` must hold at least
/// `start + 16` bytes and `end - start` must be at most [`PACKED_WORD_BYTES`].
#[inline]
pub fn pack_padded(buffer: &[u8], start: usize, end: usize) -> u128 {
    let window: [u8; PACKED_WORD_BYTES] = buffer[start..start + PACKED_WORD_BYTES]
        .try_into()
        .expect("a 16-byte window");
    let len = end - start;
    let value = u128::from_le_bytes(window);
    if len == PACKED_WORD_BYTES {
        value
    } else {
        value & ((1u128 << (8 * len)) - 1)
    }
}

impl WordCache {
    /// Words held.
    pub fn len(&self) -> usize {
        self.packed.len() + self.long.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
        let found = match key {
            Some(k) => self.packed.get(&k),
            None => self.long.get(word),
        };
        if let Some(span) = found {
            out.extend_from_slice(&self.ids[span.start as usize..(span.start + span.len) as usize]);
            return;
        }
        let first = out.len();
        split(word, out);
        if self.len() >= WORD_CACHE_ENTRIES {
            *self = WordCache::default();
        }
        let span = Span {
            start: self.ids.len() as u32,
            len: (out.len() - first) as u32,
        };
        self.ids.extend_from_slice(&out[first..]);
        match key {
            Some(k) => self.packed.insert(k, span),
            None => self.long.insert(word.into(), span),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_with_one_load_equals_packing_a_copy() {
        let text = b"abcdefghijklmnopqrstuvwxyz\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
        for start in 0..26 {
            for end in start..=(start + 16).min(26) {
                assert_eq!(pack_padded(text, start, end), pack(&text[start..end]));
            }
        }
        assert_ne!(pack(b"a"), pack(b"b"));
        assert_ne!(pack(b"ab"), pack(b"ba"));
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
            });
        }
        assert_eq!(calls, 5);
        assert_eq!(
            out,
            [5, 7, 5, 7, 26, 7, 26, 7, 3, 3, 12, 7, 12, 7, 13, 7, 13, 7]
        );
        for i in 0..WORD_CACHE_ENTRIES as u32 + 10 {
            cache.extend_ids(&i.to_le_bytes(), None, &mut Vec::new(), |_, o| o.push(i));
        }
        assert!(cache.len() <= WORD_CACHE_ENTRIES);
        assert!(cache.ids.len() <= WORD_CACHE_ENTRIES);
    }
}
