//! BERT WordPiece tokenization, identical to Google's `FullTokenizer` (google-research/bert
//! `tokenization.py`, the spec).
//!
//! The basic tokenizer is written here to follow that file step by step, because the
//! `tokenizers` crate's stock BERT normalizer and pre-tokenizer differ from it on edge cases:
//! 1. clean: drop U+0000, U+FFFD and control/format characters (Cc, Cf) other than `\t \n \r`;
//!    `\t \n \r`, space and every Zs character become a space;
//! 2. put spaces around CJK ideographs (the code-point blocks of `_is_chinese_char`; not
//!    Hangul, Hiragana or Katakana);
//! 3. split on whitespace; for uncased vocabularies, lower-case each token as Python's
//!    `str.lower()` does (full Unicode case mapping, final sigma included), decompose it (NFD)
//!    and drop combining marks (Mn);
//! 4. split off every punctuation character: ASCII 33–47, 58–64, 91–96, 123–126 and every
//!    Unicode P* character;
//! 5. WordPiece (straight to ids): greedy longest match with `##`
//!    continuations; a word of more than 200 characters, or one with a piece not in the
//!    vocabulary, becomes `[UNK]`. (Tests check it against the `tokenizers` crate's WordPiece
//!    model as well as against Google's output.)
//!
//! Text such as "[CLS]" is not a special token: it is split like any other text. Unicode
//! character data is version 16 here and 14 in the reference's Python 3.11. The two can
//! differ only on characters assigned since then.

use std::path::Path;

use unicode_general_category::{GeneralCategory, get_general_category};
use unicode_normalization::UnicodeNormalization;

use crate::ascii_scan::{AsciiToken, LineScan};
use crate::word_cache::{
    PACKED_WORD_BYTES, WordCache, ascii_lowercase_packed, key_hash, pack_ascii,
};
use crate::wordpiece::WordPieceVocab;

/// Why a vocabulary could not be used.
#[derive(Debug, thiserror::Error)]
pub enum VocabError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The vocabulary file.
        path: std::path::PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The vocabulary lacks a token the tokenizer needs.
    #[error("{path}: the vocabulary has no {token} token")]
    Missing {
        /// The vocabulary file.
        path: std::path::PathBuf,
        /// The token.
        token: &'static str,
    },
}

/// What bulk tokenization keeps between texts: the [`WordCache`] and reusable buffers (see
/// [`FullTokenizer::extend_ids`]).
#[derive(Default)]
struct TokenizerCache {
    words: WordCache,
    scan: LineScan,
    /// An ASCII line with controls, cleaned.
    cleaned: Vec<u8>,
    /// A word too long for a packed key, lower-cased.
    long_word: Vec<u8>,
    /// A line's tokens between finding them and looking them up.
    pending: Vec<PendingToken>,
    buffers: BasicBuffers,
}

/// A token of an ASCII line, found and not yet looked up.
#[derive(Clone, Copy)]
enum PendingToken {
    /// Punctuation: its id.
    Id(u32),
    /// A word with a packed key (lower-cased when the tokenizer is) and the key's hash.
    Packed { key: u128, hash: u64, len: usize },
    /// A longer word, at these bytes of the line.
    Long(usize, usize),
}

/// Gives every tokenizer a distinct id, so a thread's cache is never used with another one.
static NEXT_TOKENIZER_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    /// Each thread's cache, with the id of the tokenizer that filled it (none until the thread
    /// first tokenizes: a cache's table is 2 MiB of memory to touch).
    static THREAD_CACHE: std::cell::RefCell<Option<(u64, TokenizerCache)>> =
        const { std::cell::RefCell::new(None) };
}

pub use crate::wordpiece::MAX_INPUT_CHARS_PER_WORD;

/// Google's `FullTokenizer`: basic tokenization, then WordPiece.
pub struct FullTokenizer {
    id: u64,
    lower_case: bool,
    wordpiece: WordPieceVocab,
    /// The id of each ASCII punctuation character as a word (itself, or `[UNK]`).
    ascii_punctuation: [u32; 128],
}

impl FullTokenizer {
    /// Loads a `vocab.txt` (one token per line, id = line number; each line is stripped of
    /// surrounding whitespace, and a repeated token keeps its last id, as `load_vocab` does).
    pub fn from_vocab_file(path: &Path, lower_case: bool) -> Result<Self, VocabError> {
        let text = bertkit_stage_io::read_text(path).map_err(|e| VocabError::Io {
            path: path.into(),
            source: e,
        })?;
        Self::from_vocab_text(path, &text, lower_case)
    }

    /// [`FullTokenizer::from_vocab_file`] of a file's text already read (`path` names it in
    /// errors).
    pub fn from_vocab_text(path: &Path, text: &str, lower_case: bool) -> Result<Self, VocabError> {
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        let unk = lines
            .iter()
            .rposition(|&t| t == "[UNK]")
            .ok_or_else(|| VocabError::Missing {
                path: path.into(),
                token: "[UNK]",
            })?;
        // Inserted in file order, so a repeated token keeps its last id.
        let wordpiece = WordPieceVocab::new(lines.iter().copied(), unk as u32);
        let id = NEXT_TOKENIZER_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut tokenizer = FullTokenizer {
            id,
            lower_case,
            wordpiece,
            ascii_punctuation: [0; 128],
        };
        for b in (0u8..128).filter(u8::is_ascii_punctuation) {
            let mut ids = Vec::new();
            tokenizer.word_ids(std::str::from_utf8(&[b]).expect("ASCII"), &mut ids);
            // One character is one piece: itself, or [UNK].
            tokenizer.ascii_punctuation[b as usize] = ids[0];
        }
        Ok(tokenizer)
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.wordpiece.len()
    }

    /// The id of a token, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.wordpiece.id(token)
    }

    /// The token of an id, if in range.
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.wordpiece.token(id)
    }

    /// WordPiece tokens of `text`.
    pub fn tokenize(&self, text: &str) -> Vec<String> {
        self.tokenize_ids(text)
            .into_iter()
            .map(|id| {
                self.wordpiece
                    .token(id)
                    .expect("an id of the vocabulary")
                    .to_string()
            })
            .collect()
    }

    /// Vocabulary ids of `text` (the ids of [`FullTokenizer::tokenize`]).
    pub fn tokenize_ids(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        for word in basic_tokenize(text, self.lower_case) {
            self.word_ids(&word, &mut ids);
        }
        ids
    }

    /// [`FullTokenizer::tokenize_ids`] with a cache of word pieces, for bulk work: real text
    /// repeats a small set of words, so most words are split once (see [`WordCache`], which
    /// bounds its memory). A text made of ASCII only takes a fast path over bytes: cleaning,
    /// lower-casing, splitting on spaces and punctuation give the same words as the general
    /// rules there, and punctuation ids come from a table.
    #[cfg(test)]
    fn tokenize_ids_cached(&self, text: &str, cache: &mut TokenizerCache) -> Vec<u32> {
        let mut ids = Vec::new();
        self.extend_ids_cached(text, cache, &mut ids);
        ids
    }

    /// The ids of `text` through `cache`, appended to `ids`.
    fn extend_ids_cached(&self, text: &str, cache: &mut TokenizerCache, ids: &mut Vec<u32>) {
        if self.ascii_line_ids(text, cache, ids) {
            return;
        }
        // A line with other characters: ASCII spaces, tabs and line breaks split it whatever
        // their neighbours (cleaning makes them spaces, and every rule after that works within
        // what spaces delimit), so each run between them is tokenized on its own: ASCII runs
        // by the fast path, the others by the general rules.
        let mut buffers = std::mem::take(&mut cache.buffers);
        for run in text.split([' ', '\t', '\n', '\r']) {
            if run.is_empty() || self.ascii_line_ids(run, cache, ids) {
                continue;
            }
            for_each_basic_token(run, self.lower_case, &mut buffers, &mut |word| {
                cache
                    .words
                    .extend_ids(word.as_bytes(), None, ids, |w, out| {
                        self.word_bytes_ids(w, out)
                    });
            });
        }
        cache.buffers = buffers;
    }

    /// The ids of an ASCII `text` (appended to `ids`); `false`, with nothing appended, when
    /// `text` is not ASCII.
    fn ascii_line_ids(&self, text: &str, cache: &mut TokenizerCache, ids: &mut Vec<u32>) -> bool {
        if cache.scan.scan(text.as_bytes()) {
            self.ascii_ids(text.as_bytes(), cache, ids);
            return true;
        }
        if !text.is_ascii() {
            return false;
        }
        // _clean_text: tabs and line breaks become spaces, other controls are dropped.
        let mut line = std::mem::take(&mut cache.cleaned);
        line.clear();
        line.extend(text.as_bytes().iter().filter_map(|&b| match b {
            b'\t' | b'\n' | b'\r' => Some(b' '),
            0..=0x1F | 0x7F => None,
            _ => Some(b),
        }));
        let clean = cache.scan.scan(&line);
        debug_assert!(clean);
        self.ascii_ids(&line, cache, ids);
        cache.cleaned = line;
        true
    }

    /// The ASCII fast path of `extend_ids_cached`, for a `text` of printable
    /// ASCII just scanned into `cache.scan`. Words are lower-cased as their keys are made
    /// (accent stripping changes nothing in ASCII); only words longer than a key, and words
    /// not in the cache, need their lower-cased bytes.
    fn ascii_ids(&self, text: &[u8], cache: &mut TokenizerCache, ids: &mut Vec<u32>) {
        let lower_case = self.lower_case;
        // First the line's tokens, asking for each word's cache slot as it is found; then the
        // lookups, whose memory loads have had the time to overlap.
        let pending = &mut cache.pending;
        pending.clear();
        let words = &cache.words;
        cache.scan.for_each_token(|token| match token {
            AsciiToken::Punctuation(at) => {
                pending.push(PendingToken::Id(self.ascii_punctuation[text[at] as usize]))
            }
            AsciiToken::Word(start, end) if end - start <= PACKED_WORD_BYTES => {
                let mut key = pack_ascii(text, start, end);
                if lower_case {
                    key = ascii_lowercase_packed(key);
                }
                let hash = key_hash(key);
                words.prefetch(hash);
                pending.push(PendingToken::Packed {
                    key,
                    hash,
                    len: end - start,
                });
            }
            AsciiToken::Word(start, end) => pending.push(PendingToken::Long(start, end)),
        });
        for &token in pending.iter() {
            match token {
                PendingToken::Id(id) => ids.push(id),
                PendingToken::Packed { key, hash, len } => {
                    let bytes = key.to_le_bytes();
                    cache
                        .words
                        .extend_ids_packed(&bytes[..len], key, hash, ids, |w, out| {
                            self.word_bytes_ids(w, out)
                        });
                }
                PendingToken::Long(start, end) => {
                    let long = &mut cache.long_word;
                    long.clear();
                    long.extend_from_slice(&text[start..end]);
                    if lower_case {
                        long.make_ascii_lowercase();
                    }
                    cache
                        .words
                        .extend_ids(long, None, ids, |w, out| self.word_bytes_ids(w, out));
                }
            }
        }
    }

    /// Appends the ids of `text` (those of [`FullTokenizer::tokenize_ids`]) to `ids`, for bulk
    /// work: through the calling thread's cache of word pieces, which lives as long as the
    /// thread (rayon's workers keep theirs across files and shards), and the fast path over
    /// ASCII text (see `extend_ids_cached`).
    pub fn extend_ids(&self, text: &str, ids: &mut Vec<u32>) {
        THREAD_CACHE.with(|cell| {
            let mut cell = cell.borrow_mut();
            let cache = match &mut *cell {
                Some((id, cache)) if *id == self.id => cache,
                other => &mut other.insert((self.id, TokenizerCache::default())).1,
            };
            self.extend_ids_cached(text, cache, ids)
        })
    }

    /// [`FullTokenizer::word_ids`] of a word given as bytes (always UTF-8: a whole word of the
    /// basic tokenizer).
    fn word_bytes_ids(&self, word: &[u8], ids: &mut Vec<u32>) {
        self.word_ids(std::str::from_utf8(word).expect("a word is UTF-8"), ids)
    }

    fn word_ids(&self, word: &str, ids: &mut Vec<u32>) {
        self.wordpiece.split(word, ids)
    }

    /// The reference script's `vocab_words` as ids: every distinct token in the order of its
    /// first line, with the id of its last line (what `load_vocab`'s dict gives). For a
    /// vocabulary without repeated lines this is `0..vocab_size`.
    pub fn vocab_word_ids(&self) -> Vec<u32> {
        let ids = 0..self.wordpiece.len() as u32;
        if self.wordpiece.distinct_tokens() == self.wordpiece.len() {
            return ids.collect();
        }
        let mut seen = ahash::AHashSet::new();
        ids.map(|id| self.wordpiece.token(id).expect("an id of the vocabulary"))
            .filter(|t| seen.insert(*t))
            .map(|t| self.wordpiece.id(t).expect("a vocabulary token"))
            .collect()
    }

    /// Tokens and ids of many texts, in parallel, in order.
    pub fn tokenize_batch<S: AsRef<str> + Sync>(
        &self,
        texts: &[S],
    ) -> Vec<(Vec<String>, Vec<u32>)> {
        use rayon::prelude::*;
        texts
            .par_iter()
            .map(|t| {
                let tokens = self.tokenize(t.as_ref());
                let ids = self.convert_tokens_to_ids(&tokens);
                (tokens, ids)
            })
            .collect()
    }

    /// Ids of tokens (every token from [`FullTokenizer::tokenize`] is in the vocabulary).
    pub fn convert_tokens_to_ids(&self, tokens: &[String]) -> Vec<u32> {
        tokens
            .iter()
            .map(|t| self.wordpiece.id(t).unwrap_or(self.wordpiece.unk()))
            .collect()
    }
}

fn is_whitespace(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
        || get_general_category(c) == GeneralCategory::SpaceSeparator
}

fn is_control(c: char) -> bool {
    if matches!(c, '\t' | '\n' | '\r') {
        return false;
    }
    matches!(
        get_general_category(c),
        GeneralCategory::Control | GeneralCategory::Format
    )
}

/// ASCII 33–47, 58–64, 91–96, 123–126, and every Unicode P* character.
pub fn is_punctuation(c: char) -> bool {
    let cp = c as u32;
    if (33..=47).contains(&cp)
        || (58..=64).contains(&cp)
        || (91..=96).contains(&cp)
        || (123..=126).contains(&cp)
    {
        return true;
    }
    matches!(
        get_general_category(c),
        GeneralCategory::ConnectorPunctuation
            | GeneralCategory::DashPunctuation
            | GeneralCategory::OpenPunctuation
            | GeneralCategory::ClosePunctuation
            | GeneralCategory::InitialPunctuation
            | GeneralCategory::FinalPunctuation
            | GeneralCategory::OtherPunctuation
    )
}

/// The CJK Unified Ideograph blocks of `_is_chinese_char`.
pub fn is_chinese_char(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF
            | 0x3400..=0x4DBF
            | 0x20000..=0x2A6DF
            | 0x2A700..=0x2B73F
            | 0x2B740..=0x2B81F
            | 0x2B820..=0x2CEAF
            | 0xF900..=0xFAFF
            | 0x2F800..=0x2FA1F)
}

/// Whitespace as Python's `str.split()` sees it (after cleaning, only these remain).
fn is_split_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1C}'..='\u{1F}').contains(&c)
}

/// Google's `BasicTokenizer.tokenize`: cleaning, CJK spacing, lower-casing and accent
/// stripping (uncased), punctuation splitting.
pub fn basic_tokenize(text: &str, lower_case: bool) -> Vec<String> {
    let mut words = Vec::new();
    for_each_basic_token(text, lower_case, &mut BasicBuffers::default(), &mut |w| {
        words.push(w.to_string())
    });
    words
}

/// Reusable buffers for [`for_each_basic_token`].
#[derive(Default)]
pub struct BasicBuffers {
    cleaned: String,
    word: String,
}

/// Calls `f` with each word of Google's basic tokenization of `text`, in order, without
/// allocating per word. ASCII tokens take a fast path (ASCII lower-casing and the ASCII
/// punctuation table give the same result as the general rules on ASCII); any other token goes
/// through the general rules: Python-style lower-casing of the token, NFD, dropping Mn, and
/// splitting on Unicode punctuation.
pub fn for_each_basic_token(
    text: &str,
    lower_case: bool,
    buffers: &mut BasicBuffers,
    f: &mut dyn FnMut(&str),
) {
    // _clean_text and _tokenize_chinese_chars.
    let cleaned = &mut buffers.cleaned;
    cleaned.clear();
    for c in text.chars() {
        if c.is_ascii() {
            match c {
                ' ' | '\t' | '\n' | '\r' => cleaned.push(' '),
                // NUL and the other C0 controls and DEL are Cc: dropped.
                '\u{0}'..='\u{1F}' | '\u{7F}' => {}
                _ => cleaned.push(c),
            }
        } else if c == '\u{FFFD}' || is_control(c) {
        } else if is_whitespace(c) {
            cleaned.push(' ');
        } else if is_chinese_char(c) {
            cleaned.push(' ');
            cleaned.push(c);
            cleaned.push(' ');
        } else {
            cleaned.push(c);
        }
    }
    let word = &mut buffers.word;
    for token in cleaned.split(is_split_space).filter(|t| !t.is_empty()) {
        if token.is_ascii() {
            word.clear();
            word.push_str(token);
            if lower_case {
                word.make_ascii_lowercase();
            }
            let bytes = word.as_bytes();
            let mut start = 0;
            for (i, &b) in bytes.iter().enumerate() {
                if b.is_ascii_punctuation() {
                    if start < i {
                        f(&word[start..i]);
                    }
                    f(&word[i..i + 1]);
                    start = i + 1;
                }
            }
            if start < bytes.len() {
                f(&word[start..]);
            }
            continue;
        }
        let token = if lower_case {
            strip_accents(&token.to_lowercase())
        } else {
            token.to_string()
        };
        // _run_split_on_punc, then whitespace_tokenize of the joined result.
        let mut current = String::new();
        for c in token.chars() {
            if is_punctuation(c) {
                if !current.is_empty() {
                    f(&current);
                    current.clear();
                }
                let mut utf8 = [0u8; 4];
                f(c.encode_utf8(&mut utf8));
            } else if is_split_space(c) {
                if !current.is_empty() {
                    f(&current);
                    current.clear();
                }
            } else {
                current.push(c);
            }
        }
        if !current.is_empty() {
            f(&current);
        }
    }
}

/// NFD, then drop combining marks (Mn).
fn strip_accents(s: &str) -> String {
    s.nfd()
        .filter(|&c| get_general_category(c) != GeneralCategory::NonspacingMark)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cached path (ASCII fast path, word cache, punctuation table) gives the ids of the
    /// general path on every ASCII byte, controls included, and on mixed text.
    #[test]
    fn cached_fast_path_equals_the_general_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vocab.txt");
        let mut vocab = String::from("[PAD]\n[UNK]\n!\n.\n,\n#\né\nab\nabc\n##c\n##bc\n");
        for c in ('a'..='z').chain('0'..='9') {
            vocab.push_str(&format!("{c}\n##{c}\n"));
        }
        std::fs::write(&path, vocab).unwrap();
        let alphabet: Vec<char> = (0u8..128)
            .map(char::from)
            .chain("aAbBcC   éÉ\u{a0}\u{2028}中–ΣΑ\u{301}\u{200b}\u{fffd}İ’\u{3000}".chars())
            .collect();
        let mut state = 0x1234_5678_9ABC_DEF0u64;
        for lower_case in [true, false] {
            let t = FullTokenizer::from_vocab_file(&path, lower_case).unwrap();
            let mut cache = TokenizerCache::default();
            for n in 0..20_000 {
                let len = n % 40;
                let text: String = (0..len)
                    .map(|_| {
                        state = bertkit_rng::splitmix64(state);
                        // Mostly letters and spaces, so words repeat and hit the cache.
                        match state % 4 {
                            0 | 1 => ['a', 'b', 'c', ' '][(state >> 8) as usize % 4],
                            _ => alphabet[(state >> 8) as usize % alphabet.len()],
                        }
                    })
                    .collect();
                assert_eq!(
                    t.tokenize_ids_cached(&text, &mut cache),
                    t.tokenize_ids(&text),
                    "{text:?}"
                );
            }
            // Words longer than the packed key and than WordPiece's limit; a final sigma decided
            // by what follows the ASCII punctuation after it; ASCII words beside others.
            for text in [
                "ΑΣ.Β ΑΣ. aΣ'b aΣ,b",
                "café au lait\u{a0}x naïve—ok",
                "abcabcabcabcabcabcabc x",
                &"ab".repeat(101),
                &"a".repeat(200),
            ] {
                for _ in 0..2 {
                    assert_eq!(
                        t.tokenize_ids_cached(text, &mut cache),
                        t.tokenize_ids(text)
                    );
                }
            }
        }
    }

    /// `load_vocab`'s dict: a repeated token keeps its last id, and `vocab_words` lists each
    /// distinct token once, in the order of its first line.
    #[test]
    fn repeated_vocabulary_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vocab.txt");
        std::fs::write(&path, "[PAD]\n[UNK]\nhello\n##s\n hello \nworld\n").unwrap();
        let t = FullTokenizer::from_vocab_file(&path, true).unwrap();
        assert_eq!(t.token_to_id("hello"), Some(4));
        assert_eq!(t.vocab_word_ids(), [0, 1, 4, 3, 5]);
        assert_eq!(t.tokenize_ids("Hellos world"), [4, 3, 5]);
        std::fs::write(&path, "[PAD]\n[UNK]\nhello\n").unwrap();
        let t = FullTokenizer::from_vocab_file(&path, true).unwrap();
        assert_eq!(t.vocab_word_ids(), [0, 1, 2]);
    }

    #[test]
    fn basic_rules() {
        assert_eq!(
            basic_tokenize("Héllo, [CLS] wörld!", true),
            vec!["hello", ",", "[", "cls", "]", "world", "!"]
        );
        assert_eq!(basic_tokenize("Héllo", false), vec!["Héllo"]);
        assert_eq!(
            basic_tokenize("a\u{0}b\u{FFFD}c\u{200B}d\u{00A0}e", true),
            vec!["abcd", "e"]
        );
        // NFD decomposes Hangul syllables into conjoining jamo (Lo, kept), as Python does.
        let hangul: String = "한국".nfd().collect();
        assert_eq!(
            basic_tokenize("力加勝北区한국", true),
            vec!["力", "加", "勝", "北", "区", hangul.as_str()]
        );
        assert_eq!(basic_tokenize("ΟΔΟΣ.", true), vec!["οδος", "."]);
        assert_eq!(basic_tokenize("a\u{2028}b\tc", true), vec!["a", "b", "c"]);
    }
}
