//! WordPiece: Google's `WordpieceTokenizer.tokenize` for one word, straight to vocabulary ids.
//!
//! Greedy longest match first: from the start of the word, the longest prefix in the vocabulary
//! is the first piece; from there on, the longest substring whose `##`-prefixed form is in the
//! vocabulary is the next piece. A word of more than [`MAX_INPUT_CHARS_PER_WORD`] characters, or
//! one where no piece matches at some point, is one `[UNK]`.
//!
//! Continuation pieces are kept in their own map without the `##`, so no prefixed string is
//! built per try, and a try never starts longer than the longest piece of the vocabulary.

use ahash::AHashMap;

/// Longest word WordPiece tries to split; longer words become `[UNK]`.
pub const MAX_INPUT_CHARS_PER_WORD: usize = 200;

/// A vocabulary prepared for WordPiece.
#[derive(Debug, Clone)]
pub struct WordPieceVocab {
    /// Every token of the vocabulary (a piece at the start of a word is looked up here).
    tokens: AHashMap<Box<str>, u32>,
    /// Tokens that start with `##`, without it.
    continuations: AHashMap<Box<str>, u32>,
    /// The id of `[UNK]`.
    unk: u32,
    /// Byte length of the longest token.
    longest_token: usize,
    /// Byte length of the longest continuation (without `##`).
    longest_continuation: usize,
}

impl WordPieceVocab {
    /// From (token, id) pairs and the id of `[UNK]`.
    pub fn new<'a>(tokens: impl IntoIterator<Item = (&'a str, u32)>, unk: u32) -> Self {
        let tokens = tokens.into_iter();
        // Sized up front: a BERT vocabulary is 30,000 tokens, a quarter of them `##` pieces.
        let size = tokens.size_hint().0;
        let mut vocab = WordPieceVocab {
            tokens: AHashMap::with_capacity(size),
            continuations: AHashMap::with_capacity(size / 3),
            unk,
            longest_token: 0,
            longest_continuation: 0,
        };
        for (token, id) in tokens {
            vocab.longest_token = vocab.longest_token.max(token.len());
            vocab.tokens.insert(token.into(), id);
            if let Some(rest) = token.strip_prefix("##") {
                vocab.longest_continuation = vocab.longest_continuation.max(rest.len());
                vocab.continuations.insert(rest.into(), id);
            }
        }
        vocab
    }

    /// The id of a token.
    pub fn id(&self, token: &str) -> Option<u32> {
        self.tokens.get(token).copied()
    }

    /// Distinct tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the vocabulary is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The id of `[UNK]`.
    pub fn unk(&self) -> u32 {
        self.unk
    }

    /// Appends the ids of `word`'s pieces to `out`.
    pub fn split(&self, word: &str, out: &mut Vec<u32>) {
        // Characters are at most bytes: count them only for long words.
        if word.len() > MAX_INPUT_CHARS_PER_WORD && word.chars().count() > MAX_INPUT_CHARS_PER_WORD
        {
            out.push(self.unk);
            return;
        }
        let first = out.len();
        let mut start = 0;
        while start < word.len() {
            let (pieces, longest) = if start == 0 {
                (&self.tokens, self.longest_token)
            } else {
                (&self.continuations, self.longest_continuation)
            };
            let mut end = word.len().min(start + longest);
            while !word.is_char_boundary(end) {
                end -= 1;
            }
            loop {
                if end <= start {
                    out.truncate(first);
                    out.push(self.unk);
                    return;
                }
                if let Some(&id) = pieces.get(&word[start..end]) {
                    out.push(id);
                    start = end;
                    break;
                }
                end -= 1;
                while !word.is_char_boundary(end) {
                    end -= 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> WordPieceVocab {
        let tokens = [
            "[UNK]", "un", "##aff", "##able", "a", "##b", "##é", "é", "##",
        ];
        WordPieceVocab::new(tokens.iter().enumerate().map(|(i, t)| (*t, i as u32)), 0)
    }

    #[test]
    fn greedy_longest_match_first() {
        let v = vocab();
        let split = |w: &str| {
            let mut out = vec![99];
            v.split(w, &mut out);
            out[1..].to_vec()
        };
        assert_eq!(split("unaffable"), [1, 2, 3]);
        assert_eq!(split("ab"), [4, 5]);
        assert_eq!(split("aé"), [4, 6]);
        assert_eq!(split("éb"), [7, 5]);
        // One unmatched piece makes the whole word [UNK], keeping what came before.
        assert_eq!(split("unx"), [0]);
        assert_eq!(split("x"), [0]);
        // A word of 200 characters is split; 201 is [UNK] (characters, not bytes).
        assert_eq!(split(&format!("a{}", "b".repeat(199))).len(), 200);
        assert_eq!(split(&format!("a{}", "é".repeat(199))).len(), 200);
        assert_eq!(split(&format!("a{}", "b".repeat(200))), [0]);
        assert_eq!(split(&format!("a{}", "é".repeat(200))), [0]);
    }
}
