//! SQuAD examples and model features, as Google's `run_squad.py` builds them.
//!
//! - **Examples** (`read_squad_examples`): the context is split into words on `' '`, `\t`,
//!   `\r`, `\n` and U+202F only; every character maps to the word it belongs to (whitespace to
//!   the word before it). A training answer becomes a word span from its character offset; one
//!   whose words do not contain the whitespace-normalised answer text is skipped and counted.
//!   Training uses each question's first answer (SQuAD train has one; the dev split has several).
//! - **Features** (`convert_examples_to_features`): the question's WordPiece tokens, cut to
//!   `max_query_length`; each context word tokenized on its own (so every sub-token knows its
//!   word); the answer's token span narrowed to the tokens of the answer text
//!   (`_improve_answer_span`); the context cut into windows of at most
//!   `max_seq_length - query - 3` tokens, each starting `doc_stride` after the previous one;
//!   each window is `[CLS] question [SEP] context [SEP]` with segment ids 0/1. A token seen in
//!   several windows is scored only in the window where it has the most context on both sides
//!   (`_check_is_max_context`). A training answer outside a window, or an impossible (v2.0)
//!   question, points at `[CLS]` (position 0).
//!
//! Features are kept unpadded; batches pad to their longest feature.

use bertkit_tokenizer::FullTokenizer;

use crate::TaskError;
use crate::squad::data::Dataset;

/// Feature-building settings (Google's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeatureOptions {
    /// Longest feature, in tokens.
    pub max_seq_length: usize,
    /// Step between context windows.
    pub doc_stride: usize,
    /// Longest question, in tokens.
    pub max_query_length: usize,
}

impl Default for FeatureOptions {
    fn default() -> Self {
        FeatureOptions {
            max_seq_length: 384,
            doc_stride: 128,
            max_query_length: 64,
        }
    }
}

impl FeatureOptions {
    /// Checks that a window can hold at least one context token.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_seq_length < self.max_query_length + 4 {
            return Err(format!(
                "max_seq_length {} leaves no room for context after a question of up to {} \
                 tokens plus [CLS] and two [SEP] (need at least {})",
                self.max_seq_length,
                self.max_query_length,
                self.max_query_length + 4
            ));
        }
        if self.doc_stride == 0 {
            return Err("doc_stride must be at least 1".into());
        }
        Ok(())
    }
}

/// A context split into words.
#[derive(Debug, Clone, PartialEq)]
pub struct Context {
    /// The words, in order.
    pub words: Vec<String>,
    /// For each character (code point) of the context, the index of its word.
    pub char_to_word: Vec<usize>,
}

/// Google's `is_whitespace` for contexts.
fn is_context_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n' | '\u{202F}')
}

impl Context {
    /// Splits `text` as `read_squad_examples` does.
    pub fn split(text: &str) -> Context {
        let mut words: Vec<String> = Vec::new();
        let mut char_to_word = Vec::with_capacity(text.len());
        let mut after_space = true;
        for c in text.chars() {
            if is_context_space(c) {
                after_space = true;
            } else {
                if after_space {
                    words.push(String::new());
                }
                words.last_mut().expect("a word was started").push(c);
                after_space = false;
            }
            // Leading whitespace maps to -1 in Python; it never starts an answer.
            char_to_word.push(words.len().saturating_sub(1));
        }
        Context {
            words,
            char_to_word,
        }
    }
}

/// A training answer as a word span.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerSpan {
    /// The answer text, as given.
    pub text: String,
    /// First word.
    pub start_word: usize,
    /// Last word (inclusive).
    pub end_word: usize,
}

/// One question over one context.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// Question id.
    pub id: String,
    /// The question.
    pub question: String,
    /// Index into [`Examples::contexts`].
    pub context: usize,
    /// Training: the answer span (None: predicting, or impossible).
    pub answer: Option<AnswerSpan>,
    /// v2.0: the question has no answer.
    pub is_impossible: bool,
}

/// Examples and the contexts they share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Examples {
    /// Contexts, one per paragraph.
    pub contexts: Vec<Context>,
    /// Examples, in file order.
    pub examples: Vec<Example>,
    /// Training questions skipped because the answer text is not at its offset.
    pub skipped: Vec<String>,
}

/// `str.strip().split()` joined with single spaces.
fn whitespace_normalised(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Reads examples. `training` resolves answer spans (first answer; impossible questions when
/// `version_2`); otherwise answers are ignored.
pub fn read_examples(
    dataset: &Dataset,
    training: bool,
    version_2: bool,
) -> Result<Examples, TaskError> {
    let mut out = Examples::default();
    for article in &dataset.data {
        for paragraph in &article.paragraphs {
            let context = Context::split(&paragraph.context);
            let context_index = out.contexts.len();
            for qa in &paragraph.qas {
                let is_impossible = version_2 && qa.is_impossible;
                let mut answer = None;
                if training && !is_impossible {
                    let Some(first) = qa.answers.first() else {
                        return Err(TaskError::Format {
                            path: "<squad>".into(),
                            message: format!(
                                "question {}: a training question needs an answer (or \
                                 is_impossible with --version-2)",
                                qa.id
                            ),
                        });
                    };
                    let length = first.text.chars().count();
                    let end_char = first.answer_start + length.max(1) - 1;
                    if end_char >= context.char_to_word.len() {
                        out.skipped.push(qa.id.clone());
                        continue;
                    }
                    let start_word = context.char_to_word[first.answer_start];
                    let end_word = context.char_to_word[end_char];
                    let actual = context.words[start_word..=end_word].join(" ");
                    if !actual.contains(&whitespace_normalised(&first.text)) {
                        out.skipped.push(qa.id.clone());
                        continue;
                    }
                    answer = Some(AnswerSpan {
                        text: first.text.clone(),
                        start_word,
                        end_word,
                    });
                }
                out.examples.push(Example {
                    id: qa.id.clone(),
                    question: qa.question.clone(),
                    context: context_index,
                    answer,
                    is_impossible,
                });
            }
            out.contexts.push(context);
        }
    }
    Ok(out)
}

/// One model input window over an example.
#[derive(Debug, Clone, PartialEq)]
pub struct Feature {
    /// Index into the examples.
    pub example_index: usize,
    /// Which window of the example.
    pub window: usize,
    /// `[CLS] question [SEP] context [SEP]`, unpadded.
    pub input_ids: Vec<u32>,
    /// 0 for `[CLS]`, the question and the first `[SEP]`; 1 after.
    pub segment_ids: Vec<u32>,
    /// For each position, the context word it comes from (None outside the context).
    pub token_to_word: Vec<Option<usize>>,
    /// For each position, whether this window is the one scoring it.
    pub max_context: Vec<bool>,
    /// Training target: answer start position (0 = `[CLS]`, no answer here).
    pub start_position: usize,
    /// Training target: answer end position.
    pub end_position: usize,
}

impl Feature {
    /// Token and segment ids, as [`crate::batch::pad`] takes them.
    pub fn sequence(&self) -> (&[u32], &[u32]) {
        (&self.input_ids, &self.segment_ids)
    }
}

/// A context tokenized word by word.
struct TokenizedContext {
    tokens: Vec<u32>,
    token_to_word: Vec<usize>,
    word_to_token: Vec<usize>,
}

fn tokenize_context(tokenizer: &FullTokenizer, context: &Context) -> TokenizedContext {
    let mut t = TokenizedContext {
        tokens: Vec::new(),
        token_to_word: Vec::new(),
        word_to_token: Vec::with_capacity(context.words.len()),
    };
    for (i, word) in context.words.iter().enumerate() {
        t.word_to_token.push(t.tokens.len());
        for id in tokenizer.tokenize_ids(word) {
            t.token_to_word.push(i);
            t.tokens.push(id);
        }
    }
    t
}

/// `_improve_answer_span`: the first sub-span of `[start, end]` whose tokens are exactly the
/// answer text's tokens, or `[start, end]` when none is.
///
/// run_squad.py tries every (start, end) pair; only those as long as the answer can match, so
/// this tries one end per start: the same answer in linear rather than quadratic time (a
/// context-long answer span made one example take seconds).
fn improve_answer_span(tokens: &[u32], start: usize, end: usize, answer: &[u32]) -> (usize, usize) {
    if answer.is_empty() {
        return (start, end);
    }
    (start..=end)
        .map(|new_start| (new_start, new_start + answer.len() - 1))
        .take_while(|&(_, new_end)| new_end <= end)
        .find(|&(new_start, new_end)| tokens[new_start..=new_end] == *answer)
        .unwrap_or((start, end))
}

/// A window over the context tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// First context token.
    pub start: usize,
    /// Tokens in the window.
    pub length: usize,
}

/// The windows over `tokens` context tokens, at most `max_tokens` long, `stride` apart.
pub fn windows(tokens: usize, max_tokens: usize, stride: usize) -> Vec<Window> {
    let mut spans = Vec::new();
    let mut start = 0;
    while start < tokens {
        let length = (tokens - start).min(max_tokens);
        spans.push(Window { start, length });
        if start + length == tokens {
            break;
        }
        start += length.min(stride);
    }
    spans
}

/// `_check_is_max_context`: whether window `current` gives token `position` the most context
/// (the smaller of its left and right context, plus 0.01 × window length; first window wins
/// ties).
///
/// `spans` are as [`windows`] makes them, in order of start and of end, so the windows holding
/// `position` are a run of consecutive ones: only those are scored (at most
/// window length ÷ stride of them), not every window of the context (quadratic in the
/// context's length).
pub fn is_max_context(spans: &[Window], current: usize, position: usize) -> bool {
    let first = spans.partition_point(|s| s.start + s.length <= position);
    let mut best: Option<(f64, usize)> = None;
    for (i, span) in spans.iter().enumerate().skip(first) {
        if span.start > position {
            break;
        }
        let end = span.start + span.length - 1;
        let left = position - span.start;
        let right = end - position;
        let score = left.min(right) as f64 + 0.01 * span.length as f64;
        if best.is_none_or(|(b, _)| score > b) {
            best = Some((score, i));
        }
    }
    best.map(|(_, i)| i) == Some(current)
}

/// Builds the features of `examples` (training targets when `training`).
pub fn build_features(
    examples: &Examples,
    tokenizer: &FullTokenizer,
    options: &FeatureOptions,
    training: bool,
) -> Result<Vec<Feature>, TaskError> {
    options.validate().map_err(|m| TaskError::Format {
        path: "<squad features>".into(),
        message: m,
    })?;
    let special = |t: &str| {
        tokenizer.token_to_id(t).ok_or_else(|| TaskError::Format {
            path: "<vocab>".into(),
            message: format!("the vocabulary has no {t}"),
        })
    };
    let (cls, sep) = (special("[CLS]")?, special("[SEP]")?);
    // Consecutive questions share a context: it is tokenized once for all of them.
    let mut current: Option<(usize, TokenizedContext)> = None;
    let mut features = Vec::new();
    for (example_index, example) in examples.examples.iter().enumerate() {
        let context = &examples.contexts[example.context];
        if current.as_ref().is_none_or(|(c, _)| *c != example.context) {
            current = Some((example.context, tokenize_context(tokenizer, context)));
        }
        let doc = &current.as_ref().expect("set above").1;
        let mut query = tokenizer.tokenize_ids(&example.question);
        query.truncate(options.max_query_length);

        let target = match (&example.answer, training && !example.is_impossible) {
            (Some(answer), true) => {
                let start = doc.word_to_token[answer.start_word];
                let end = if answer.end_word + 1 < context.words.len() {
                    doc.word_to_token[answer.end_word + 1] - 1
                } else {
                    doc.tokens.len() - 1
                };
                // A word that tokenizes to nothing can leave end < start.
                if end < start {
                    None
                } else {
                    let answer_tokens = tokenizer.tokenize_ids(&answer.text);
                    Some(improve_answer_span(&doc.tokens, start, end, &answer_tokens))
                }
            }
            _ => None,
        };

        let max_tokens = options.max_seq_length - query.len() - 3;
        let spans = windows(doc.tokens.len(), max_tokens, options.doc_stride);
        for (w, span) in spans.iter().enumerate() {
            let mut ids = Vec::with_capacity(query.len() + span.length + 3);
            ids.push(cls);
            ids.extend(&query);
            ids.push(sep);
            let offset = ids.len();
            let mut token_to_word = vec![None; offset];
            let mut max_context = vec![false; offset];
            for i in span.start..span.start + span.length {
                token_to_word.push(Some(doc.token_to_word[i]));
                max_context.push(is_max_context(&spans, w, i));
                ids.push(doc.tokens[i]);
            }
            ids.push(sep);
            token_to_word.push(None);
            max_context.push(false);
            let mut segment_ids = vec![0; offset];
            segment_ids.resize(ids.len(), 1);
            let (start_position, end_position) = match target {
                Some((s, e)) if s >= span.start && e < span.start + span.length => {
                    (s - span.start + offset, e - span.start + offset)
                }
                _ => (0, 0),
            };
            features.push(Feature {
                example_index,
                window: w,
                input_ids: ids,
                segment_ids,
                token_to_word,
                max_context,
                start_position,
                end_position,
            });
        }
    }
    Ok(features)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_words_and_character_map() {
        let c = Context::split(" The  cat\u{202F}sat.\u{00A0}x");
        assert_eq!(c.words, vec!["The", "cat", "sat.\u{00A0}x"]);
        assert_eq!(c.char_to_word[0], 0);
        assert_eq!(c.char_to_word[5], 0, "the second space stays with 'The'");
        assert_eq!(c.char_to_word[6], 1);
        assert_eq!(c.char_to_word[10], 2);
    }

    #[test]
    fn windows_as_run_squad() {
        assert_eq!(
            windows(10, 4, 3),
            vec![
                Window {
                    start: 0,
                    length: 4
                },
                Window {
                    start: 3,
                    length: 4
                },
                Window {
                    start: 6,
                    length: 4
                },
            ]
        );
        assert_eq!(
            windows(3, 4, 2),
            vec![Window {
                start: 0,
                length: 3
            }]
        );
        assert!(windows(0, 4, 2).is_empty());
    }

    #[test]
    fn max_context_follows_the_docstring_example() {
        // run_squad's example: spans "the man went to the", "to the store and bought",
        // "and bought a gallon of"; 'bought' (token 7) scores min(4, 0) + 0.05 in the second
        // span and min(1, 3) + 0.05 in the third, which wins.
        let spans = [
            Window {
                start: 0,
                length: 5,
            },
            Window {
                start: 3,
                length: 5,
            },
            Window {
                start: 6,
                length: 5,
            },
        ];
        let bought = 7;
        assert!(!is_max_context(&spans, 1, bought));
        assert!(is_max_context(&spans, 2, bought));
        // A tie (min(2, 1) and min(1, 2), equal lengths) goes to the first window.
        let spans = [
            Window {
                start: 0,
                length: 4,
            },
            Window {
                start: 1,
                length: 4,
            },
        ];
        assert!(is_max_context(&spans, 0, 2));
        assert!(!is_max_context(&spans, 1, 2));
    }

    #[test]
    fn improved_span_drops_surrounding_tokens() {
        // "(1895-1943)." tokenized as ( 1895 - 1943 ) . with the answer "1895".
        let tokens = [1, 1895, 2, 1943, 3, 4];
        assert_eq!(improve_answer_span(&tokens, 0, 5, &[1895]), (1, 1));
        assert_eq!(improve_answer_span(&tokens, 0, 5, &[7]), (0, 5));
    }

    /// run_squad.py's loops, transcribed: every (start, end) pair, every window.
    fn improve_answer_span_every_pair(
        tokens: &[u32],
        start: usize,
        end: usize,
        answer: &[u32],
    ) -> (usize, usize) {
        for new_start in start..=end {
            for new_end in (new_start..=end).rev() {
                if tokens[new_start..=new_end] == *answer {
                    return (new_start, new_end);
                }
            }
        }
        (start, end)
    }

    fn is_max_context_every_window(spans: &[Window], current: usize, position: usize) -> bool {
        let mut best: Option<(f64, usize)> = None;
        for (i, span) in spans.iter().enumerate() {
            let end = span.start + span.length - 1;
            if position < span.start || position > end {
                continue;
            }
            let score =
                (position - span.start).min(end - position) as f64 + 0.01 * span.length as f64;
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, i));
            }
        }
        best.map(|(_, i)| i) == Some(current)
    }

    #[test]
    fn fast_spans_and_max_context_equal_run_squads_loops() {
        // Few distinct ids, so answers repeat and overlap.
        let mut rng = bertkit_rng::SplitMix64::new(11);
        let mut next = |n: u64| rng.next_u64() % n;
        for _ in 0..300 {
            let len = 1 + next(60) as usize;
            let tokens: Vec<u32> = (0..len).map(|_| next(3) as u32).collect();
            let start = next(len as u64) as usize;
            let end = start + next((len - start) as u64) as usize;
            let a = next(4) as usize;
            let from = next(len as u64) as usize;
            let answer = &tokens[from..(from + a).min(len)];
            assert_eq!(
                improve_answer_span(&tokens, start, end, answer),
                improve_answer_span_every_pair(&tokens, start, end, answer),
                "{tokens:?} [{start}, {end}] {answer:?}"
            );
            let max_tokens = 1 + next(12) as usize;
            let stride = 1 + next(max_tokens as u64 + 2) as usize;
            let spans = windows(len, max_tokens, stride);
            for current in 0..spans.len() {
                for position in 0..len {
                    assert_eq!(
                        is_max_context(&spans, current, position),
                        is_max_context_every_window(&spans, current, position),
                        "{spans:?} window {current} token {position}"
                    );
                }
            }
        }
    }
}
