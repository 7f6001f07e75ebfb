//! Where the tokens of a cleaned ASCII line are, found 16 bytes at a time.
//!
//! On cleaned ASCII text (controls dropped, tabs and line breaks made spaces) the basic
//! tokenizer's rules reduce to byte classes: a space separates, every ASCII punctuation
//! character is a token of its own, and a maximal run of the other bytes (letters and digits)
//! is a word. [`LineScan`] computes two bitmaps of a line, its word bytes and its punctuation
//! bytes (with SSE2 compares on x86-64, a byte loop elsewhere), then walks the tokens in order
//! with bit tricks: no branch per byte, which is what a byte-at-a-time loop pays at every word
//! boundary.

/// A token of an ASCII line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsciiToken {
    /// A punctuation character at this byte offset.
    Punctuation(usize),
    /// A word: letters and digits at `start..end`.
    Word(usize, usize),
}

/// Bitmaps of a line, reused from line to line.
#[derive(Default)]
pub struct LineScan {
    /// Bit `i % 64` of word `i / 64`: byte `i` is a letter or digit.
    word: Vec<u64>,
    /// Same layout: byte `i` is ASCII punctuation.
    punctuation: Vec<u64>,
    len: usize,
}

/// Word, punctuation and "other" bits of 64 bytes: other is anything but printable ASCII
/// (0x20..=0x7E). Zeros (the padding past a line's end) are neither word nor punctuation.
#[inline]
fn block_masks(block: &[u8; 64]) -> (u64, u64, u64) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{
            __m128i, _mm_cmpeq_epi8, _mm_cmplt_epi8, _mm_loadu_si128, _mm_min_epu8,
            _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8, _mm_sub_epi8,
        };
        let mut word = 0u64;
        let mut space_or_nul = 0u64;
        let mut other = 0u64;
        for k in 0..4 {
            // SAFETY: SSE2 is part of x86-64; the 16 bytes read lie inside `block`.
            let (w, s, o) = unsafe {
                let v = _mm_loadu_si128(block.as_ptr().add(16 * k) as *const __m128i);
                // Unsigned range tests: x - lo <= hi - lo, as min(x - lo, hi - lo) == x - lo.
                let digit = _mm_sub_epi8(v, _mm_set1_epi8(b'0' as i8));
                let digit = _mm_cmpeq_epi8(_mm_min_epu8(digit, _mm_set1_epi8(9)), digit);
                let letter = _mm_sub_epi8(
                    _mm_or_si128(v, _mm_set1_epi8(0x20)),
                    _mm_set1_epi8(b'a' as i8),
                );
                let letter = _mm_cmpeq_epi8(_mm_min_epu8(letter, _mm_set1_epi8(25)), letter);
                let space = _mm_or_si128(
                    _mm_cmpeq_epi8(v, _mm_set1_epi8(b' ' as i8)),
                    _mm_cmpeq_epi8(v, _mm_set1_epi8(0)),
                );
                // Signed: below 0x20 or from 0x80 on; and DEL.
                let other = _mm_or_si128(
                    _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)),
                    _mm_cmpeq_epi8(v, _mm_set1_epi8(0x7F)),
                );
                (
                    _mm_movemask_epi8(_mm_or_si128(digit, letter)) as u16,
                    _mm_movemask_epi8(space) as u16,
                    _mm_movemask_epi8(other) as u16,
                )
            };
            word |= u64::from(w) << (16 * k);
            space_or_nul |= u64::from(s) << (16 * k);
            other |= u64::from(o) << (16 * k);
        }
        (word, !word & !space_or_nul, other)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut word = 0u64;
        let mut punctuation = 0u64;
        let mut other = 0u64;
        for (i, &b) in block.iter().enumerate() {
            word |= u64::from(b.is_ascii_alphanumeric()) << i;
            punctuation |= u64::from(b != b' ' && b != 0 && !b.is_ascii_alphanumeric()) << i;
            other |= u64::from(!(0x20..0x7F).contains(&b)) << i;
        }
        (word, punctuation, other)
    }
}

impl LineScan {
    /// Scans `line`; returns whether it is clean printable ASCII (bytes 0x20..=0x7E), the
    /// only kind of line whose tokens [`LineScan::for_each_token`] then gives.
    pub fn scan(&mut self, line: &[u8]) -> bool {
        let mut other = 0u64;
        self.word.clear();
        self.punctuation.clear();
        self.len = line.len();
        let mut blocks = line.chunks_exact(64);
        for block in blocks.by_ref() {
            let (w, p, o) = block_masks(block.try_into().expect("64 bytes"));
            self.word.push(w);
            self.punctuation.push(p);
            other |= o;
        }
        let rest = blocks.remainder();
        if !rest.is_empty() {
            let mut block = [0u8; 64];
            block[..rest.len()].copy_from_slice(rest);
            let (w, p, o) = block_masks(&block);
            self.word.push(w);
            self.punctuation.push(p);
            other |= o & ((1u64 << rest.len()) - 1);
        }
        other == 0
    }

    /// Calls `f` with each token of the scanned line, in order.
    #[inline]
    pub fn for_each_token(&self, mut f: impl FnMut(AsciiToken)) {
        let blocks = self.word.len();
        // Whether the byte before the current block is a word byte.
        let mut word_before = 0u64;
        for k in 0..blocks {
            let word = self.word[k];
            let punctuation = self.punctuation[k];
            let starts = word & !((word << 1) | word_before);
            word_before = word >> 63;
            let mut tokens = starts | punctuation;
            while tokens != 0 {
                let bit = tokens.trailing_zeros() as usize;
                tokens &= tokens - 1;
                let at = 64 * k + bit;
                if (punctuation >> bit) & 1 == 1 {
                    f(AsciiToken::Punctuation(at));
                    continue;
                }
                // The word ends at the first non-word byte from here.
                let mut j = k;
                let mut rest = !word & (u64::MAX << bit);
                while rest == 0 {
                    j += 1;
                    if j == blocks {
                        break;
                    }
                    rest = !self.word[j];
                }
                let end = if j == blocks {
                    self.len
                } else {
                    64 * j + rest.trailing_zeros() as usize
                };
                f(AsciiToken::Word(at, end));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tokens of a byte-at-a-time reading of the rules.
    fn tokens_by_bytes(line: &[u8]) -> Vec<AsciiToken> {
        let mut tokens = Vec::new();
        let mut start = None;
        for (i, &b) in line.iter().enumerate() {
            if b.is_ascii_alphanumeric() {
                start.get_or_insert(i);
                continue;
            }
            if let Some(s) = start.take() {
                tokens.push(AsciiToken::Word(s, i));
            }
            if b != b' ' {
                tokens.push(AsciiToken::Punctuation(i));
            }
        }
        if let Some(s) = start {
            tokens.push(AsciiToken::Word(s, line.len()));
        }
        tokens
    }

    #[test]
    fn tokens_equal_a_byte_at_a_time_scan() {
        let mut scan = LineScan::default();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state = bertkit_rng::splitmix64(state);
            state
        };
        let alphabet: Vec<u8> = (0x20..0x7F).collect();
        let mut checked = 0;
        for case in 0..5000 {
            // Lengths around block edges, and words that cross blocks or fill whole ones.
            let len = (next() % 300) as usize;
            let line: Vec<u8> = (0..len)
                .map(|_| match case % 3 {
                    0 => alphabet[(next() % alphabet.len() as u64) as usize],
                    1 => [b'a', b'Z', b'7', b' ', b'.'][(next() % 5) as usize],
                    _ => {
                        if next() % 40 == 0 {
                            b' '
                        } else {
                            b'q'
                        }
                    }
                })
                .collect();
            assert!(scan.scan(&line));
            let mut got = Vec::new();
            scan.for_each_token(|t| got.push(t));
            assert_eq!(
                got,
                tokens_by_bytes(&line),
                "{:?}",
                String::from_utf8_lossy(&line)
            );
            checked += got.len();
        }
        assert!(checked > 100_000);
        for line in [
            &b""[..],
            b" ",
            b"a",
            b"!",
            &[b'x'; 64],
            &[b'x'; 128],
            &[b'.'; 65],
        ] {
            assert!(scan.scan(line));
            let mut got = Vec::new();
            scan.for_each_token(|t| got.push(t));
            assert_eq!(got, tokens_by_bytes(line));
        }
    }

    #[test]
    fn lines_with_other_bytes_are_not_clean() {
        let mut scan = LineScan::default();
        let mut line = vec![b'a'; 130];
        assert!(scan.scan(&line));
        for at in [0, 63, 64, 127, 129] {
            for bad in [0u8, 0x09, 0x0A, 0x1F, 0x7F, 0x80, 0xC3, 0xFF] {
                line[at] = bad;
                assert!(!scan.scan(&line), "byte {bad:#x} at {at}");
                line[at] = b'a';
            }
        }
        assert!(scan.scan(b"~ !\\"));
    }
}
