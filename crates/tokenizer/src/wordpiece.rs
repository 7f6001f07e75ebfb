//! WordPiece: Google's `WordpieceTokenizer.tokenize` for one word, straight to vocabulary ids.
//!
//! Greedy longest match first: from the start of the word, the longest prefix in the vocabulary
//! is the first piece; from there on, the longest substring whose `##`-prefixed form is in the
//! vocabulary is the next piece. A word of more than [`MAX_INPUT_CHARS_PER_WORD`] characters, or
//! one where no piece matches at some point, is one `[UNK]`.
//!
//! Continuation pieces are kept in their own map without the `##`, so no prefixed string is
//! built per try, and a try never starts longer than the longest piece of the vocabulary.

use hashbrown::HashTable;

/// Longest word WordPiece tries to split; longer words become `[UNK]`.
pub const MAX_INPUT_CHARS_PER_WORD: usize = 200;

/// A vocabulary prepared for WordPiece: every token's text in one buffer, and two hash tables
/// of ids keyed by that text (a few allocations for any vocabulary, where a map of owned
/// strings makes one per token).
#[derive(Debug, Clone)]
pub struct WordPieceVocab {
    /// Every token, in id order, one after the other.
    text: String,
    /// End of each id's token in `text`.
    ends: Vec<u32>,
    /// Ids by their token (a repeated token: its last id).
    tokens: HashTable<u32>,
    /// Ids of the tokens that start with `##`, by their text without it.
    continuations: HashTable<u32>,
    hasher: ahash::RandomState,
    /// The id of `[UNK]`.
    unk: u32,
    /// Byte length of the longest token.
    longest_token: usize,
    /// Byte length of the longest continuation (without `##`).
    longest_continuation: usize,
}

/// Bytes a continuation's text skips: `##`.
const CONTINUATION_PREFIX: usize = 2;

/// The token of `id` in the arena.
fn token_text<'a>(text: &'a str, ends: &[u32], id: u32) -> &'a str {
    let id = id as usize;
    let start = if id == 0 { 0 } else { ends[id - 1] as usize };
    &text[start..ends[id] as usize]
}

impl WordPieceVocab {
    /// From the tokens in id order (the lines of a `vocab.txt`) and the id of `[UNK]`.
    pub fn new<'a>(tokens: impl IntoIterator<Item = &'a str>, unk: u32) -> Self {
        let tokens = tokens.into_iter();
        // Sized up front: a BERT vocabulary is 30,000 tokens, a quarter of them `##` pieces.
        let size = tokens.size_hint().0;
        let mut vocab = WordPieceVocab {
            text: String::with_capacity(8 * size),
            ends: Vec::with_capacity(size),
            tokens: HashTable::with_capacity(size),
            continuations: HashTable::with_capacity(size / 3),
            // Fixed keys: the tables only hold the vocabulary, never untrusted input.
            hasher: ahash::RandomState::with_seeds(1, 2, 3, 4),
            unk,
            longest_token: 0,
            longest_continuation: 0,
        };
        for token in tokens {
            let id = vocab.ends.len() as u32;
            vocab.text.push_str(token);
            vocab.ends.push(vocab.text.len() as u32);
            vocab.longest_token = vocab.longest_token.max(token.len());
            let hash = vocab.hasher.hash_one(token);
            let (text, ends) = (&vocab.text, &vocab.ends);
            match vocab.tokens.entry(
                hash,
                |&other| token_text(text, ends, other) == token,
                |&other| vocab.hasher.hash_one(token_text(text, ends, other)),
            ) {
                hashbrown::hash_table::Entry::Occupied(mut entry) => *entry.get_mut() = id,
                hashbrown::hash_table::Entry::Vacant(entry) => {
                    entry.insert(id);
                }
            }
            if let Some(rest) = token.strip_prefix("##") {
                vocab.longest_continuation = vocab.longest_continuation.max(rest.len());
                let hash = vocab.hasher.hash_one(rest);
                let continuation = |other| &token_text(text, ends, other)[CONTINUATION_PREFIX..];
                match vocab.continuations.entry(
                    hash,
                    |&other| continuation(other) == rest,
                    |&other| vocab.hasher.hash_one(continuation(other)),
                ) {
                    hashbrown::hash_table::Entry::Occupied(mut entry) => *entry.get_mut() = id,
                    hashbrown::hash_table::Entry::Vacant(entry) => {
                        entry.insert(id);
                    }
                }
            }
        }
        vocab
    }

    /// The id of a token (a repeated token: its last id).
    pub fn id(&self, token: &str) -> Option<u32> {
        self.find(&self.tokens, token, 0)
    }

    fn find(&self, table: &HashTable<u32>, piece: &str, skip: usize) -> Option<u32> {
        table
            .find(self.hasher.hash_one(piece), |&id| {
                token_text(&self.text, &self.ends, id).get(skip..) == Some(piece)
            })
            .copied()
    }

    /// The token of an id.
    pub fn token(&self, id: u32) -> Option<&str> {
        (id < self.ends.len() as u32).then(|| token_text(&self.text, &self.ends, id))
    }

    /// Ids (lines of the vocabulary, repeated tokens included).
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Distinct tokens.
    pub fn distinct_tokens(&self) -> usize {
        self.tokens.len()
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
            let (pieces, skip, longest) = if start == 0 {
                (&self.tokens, 0, self.longest_token)
            } else {
                (
                    &self.continuations,
                    CONTINUATION_PREFIX,
                    self.longest_continuation,
                )
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
                if let Some(id) = self.find(pieces, &word[start..end], skip) {
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
        WordPieceVocab::new(tokens, 0)
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
