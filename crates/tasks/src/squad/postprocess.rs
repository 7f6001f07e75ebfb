//! From start/end logits to answer texts, as Google's `run_squad.py` `write_predictions`.
//!
//! For each example, over all its features: the `n_best` highest start and end logits
//! (stable order on ties) are paired; a pair is kept when both ends are context tokens, the
//! start is scored in this window (max context), `end >= start` and the span is at most
//! `max_answer_length` tokens. Candidates are ranked by start + end logit. Each becomes text by
//! joining its WordPiece tokens (`##` glued back) and mapping that onto the original words
//! ([`final_text`], Google's `get_final_text`); duplicates are dropped, and the first `n_best`
//! are kept with softmax probabilities. SQuAD v2.0 also scores "no answer" (the smallest
//! `[CLS]` start + end over the features) and answers `""` when its score beats the best
//! non-empty answer by more than `null_score_diff_threshold`.
//!
//! One deliberate difference: Google's script looks for the best start/end positions among all
//! `max_seq_length` positions, padding included (padding cannot win but takes places among the
//! `n_best`); here only the feature's own tokens compete, so results do not depend on padding.

use std::collections::HashSet;

use bertkit_tokenizer::FullTokenizer;
use bertkit_tokenizer::basic_tokenize;

use crate::squad::features::{Examples, Feature};

/// Post-processing settings (Google's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PostprocessOptions {
    /// Candidates kept per example.
    pub n_best: usize,
    /// Longest answer, in tokens.
    pub max_answer_length: usize,
    /// The model's vocabulary is uncased.
    pub lower_case: bool,
    /// SQuAD v2.0: "no answer" competes.
    pub version_2: bool,
    /// v2.0: answer "" when null score − best answer score exceeds this.
    pub null_score_diff_threshold: f64,
}

impl Default for PostprocessOptions {
    fn default() -> Self {
        PostprocessOptions {
            n_best: 20,
            max_answer_length: 30,
            lower_case: true,
            version_2: false,
            null_score_diff_threshold: 0.0,
        }
    }
}

/// The model's logits for one feature (over its unpadded tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct FeatureLogits {
    /// Start logits.
    pub start: Vec<f32>,
    /// End logits.
    pub end: Vec<f32>,
}

/// One n-best entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Answer text ("" for no answer).
    pub text: String,
    /// Softmax of start + end logit over the n-best.
    pub probability: f64,
    /// Start logit.
    pub start_logit: f64,
    /// End logit.
    pub end_logit: f64,
}

/// One example's prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Question id.
    pub id: String,
    /// The answer.
    pub text: String,
    /// The n-best list, best first.
    pub n_best: Vec<Candidate>,
    /// v2.0: null score − best non-null score (the null odds).
    pub null_score_diff: Option<f64>,
}

/// The `n` indexes with the highest values, highest first; ties keep index order.
fn best_indexes(logits: &[f32], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    order.truncate(n);
    order
}

fn strip_spaces(text: &[char]) -> (Vec<char>, Vec<usize>) {
    let mut chars = Vec::with_capacity(text.len());
    let mut to_original = Vec::with_capacity(text.len());
    for (i, &c) in text.iter().enumerate() {
        if c != ' ' {
            to_original.push(i);
            chars.push(c);
        }
    }
    (chars, to_original)
}

fn find(haystack: &[char], needle: &[char]) -> Option<usize> {
    if needle.is_empty() {
        return Some(0);
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Google's `get_final_text`: the part of `original` (the answer's original words joined by
/// spaces) that `predicted` (the normalised WordPiece text) covers, found by aligning the two
/// without spaces; `original` whole when they cannot be aligned.
pub fn final_text(predicted: &str, original: &str, lower_case: bool) -> String {
    let orig: Vec<char> = original.chars().collect();
    let tokenized: Vec<char> = basic_tokenize(original, lower_case)
        .join(" ")
        .chars()
        .collect();
    let pred: Vec<char> = predicted.chars().collect();
    let Some(start) = find(&tokenized, &pred) else {
        return original.to_string();
    };
    let Some(end) = (start + pred.len()).checked_sub(1) else {
        return original.to_string();
    };
    let (orig_ns, orig_ns_to_s) = strip_spaces(&orig);
    let (tok_ns, tok_ns_to_s) = strip_spaces(&tokenized);
    if orig_ns.len() != tok_ns.len() {
        return original.to_string();
    }
    let mut tok_s_to_ns = vec![None; tokenized.len()];
    for (ns, &s) in tok_ns_to_s.iter().enumerate() {
        tok_s_to_ns[s] = Some(ns);
    }
    let map = |p: usize| {
        tok_s_to_ns
            .get(p)
            .copied()
            .flatten()
            .and_then(|ns| orig_ns_to_s.get(ns).copied())
    };
    match (map(start), map(end)) {
        (Some(s), Some(e)) if s <= e => orig[s..=e].iter().collect(),
        _ => original.to_string(),
    }
}

/// `_compute_softmax` over the candidates' total scores.
fn softmax(scores: &[f64]) -> Vec<f64> {
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = exps.iter().sum();
    exps.iter().map(|e| e / total).collect()
}

struct Preliminary {
    feature: usize,
    start: usize,
    end: usize,
    start_logit: f64,
    end_logit: f64,
}

/// The WordPiece text of `ids`: tokens joined by spaces, `##` continuations glued, whitespace
/// collapsed.
fn wordpiece_text(tokenizer: &FullTokenizer, ids: &[u32]) -> String {
    let joined = ids
        .iter()
        .map(|&id| tokenizer.id_to_token(id).unwrap_or("[UNK]"))
        .collect::<Vec<_>>()
        .join(" ");
    let glued = joined.replace(" ##", "").replace("##", "");
    glued.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Predictions for every example that has features, in example order. `logits[i]` belongs to
/// `features[i]`.
pub fn predict(
    examples: &Examples,
    features: &[Feature],
    logits: &[FeatureLogits],
    tokenizer: &FullTokenizer,
    options: &PostprocessOptions,
) -> Vec<Prediction> {
    assert_eq!(features.len(), logits.len(), "one logits row per feature");
    let mut by_example: Vec<Vec<usize>> = vec![Vec::new(); examples.examples.len()];
    for (i, f) in features.iter().enumerate() {
        by_example[f.example_index].push(i);
    }
    let mut out = Vec::new();
    for (example_index, feature_ids) in by_example.iter().enumerate() {
        if feature_ids.is_empty() {
            continue;
        }
        let example = &examples.examples[example_index];
        let words = &examples.contexts[example.context].words;
        let mut prelim = Vec::new();
        let mut null: Option<Preliminary> = None;
        for &fi in feature_ids {
            let (feature, l) = (&features[fi], &logits[fi]);
            let n = feature.input_ids.len().min(l.start.len()).min(l.end.len());
            if options.version_2 && n > 0 {
                let score = l.start[0] as f64 + l.end[0] as f64;
                if null
                    .as_ref()
                    .is_none_or(|p| score < p.start_logit + p.end_logit)
                {
                    null = Some(Preliminary {
                        feature: fi,
                        start: 0,
                        end: 0,
                        start_logit: l.start[0] as f64,
                        end_logit: l.end[0] as f64,
                    });
                }
            }
            let starts = best_indexes(&l.start[..n], options.n_best);
            let ends = best_indexes(&l.end[..n], options.n_best);
            for &s in &starts {
                for &e in &ends {
                    if feature.token_to_word[s].is_none()
                        || feature.token_to_word[e].is_none()
                        || !feature.max_context[s]
                        || e < s
                        || e - s + 1 > options.max_answer_length
                    {
                        continue;
                    }
                    prelim.push(Preliminary {
                        feature: fi,
                        start: s,
                        end: e,
                        start_logit: l.start[s] as f64,
                        end_logit: l.end[e] as f64,
                    });
                }
            }
        }
        let null_scores = null.as_ref().map(|p| (p.start_logit, p.end_logit));
        prelim.extend(null);
        // Stable: equal scores keep the order they were found in.
        prelim.sort_by(|a, b| {
            (b.start_logit + b.end_logit).total_cmp(&(a.start_logit + a.end_logit))
        });

        let mut seen = HashSet::new();
        let mut n_best: Vec<Candidate> = Vec::new();
        for p in &prelim {
            if n_best.len() >= options.n_best {
                break;
            }
            let text = if p.start > 0 {
                let feature = &features[p.feature];
                let tok_text = wordpiece_text(tokenizer, &feature.input_ids[p.start..=p.end]);
                let (w0, w1) = (
                    feature.token_to_word[p.start].expect("checked above"),
                    feature.token_to_word[p.end].expect("checked above"),
                );
                let orig_text = words[w0..=w1].join(" ");
                let text = final_text(&tok_text, &orig_text, options.lower_case);
                if !seen.insert(text.clone()) {
                    continue;
                }
                text
            } else {
                seen.insert(String::new());
                String::new()
            };
            n_best.push(Candidate {
                text,
                probability: 0.0,
                start_logit: p.start_logit,
                end_logit: p.end_logit,
            });
        }
        if let Some((s, e)) = null_scores
            && !seen.contains("")
        {
            n_best.push(Candidate {
                text: String::new(),
                probability: 0.0,
                start_logit: s,
                end_logit: e,
            });
        }
        if n_best.is_empty() {
            n_best.push(Candidate {
                text: "empty".into(),
                probability: 0.0,
                start_logit: 0.0,
                end_logit: 0.0,
            });
        }
        let scores: Vec<f64> = n_best.iter().map(|c| c.start_logit + c.end_logit).collect();
        for (c, p) in n_best.iter_mut().zip(softmax(&scores)) {
            c.probability = p;
        }
        let best_non_null = n_best.iter().find(|c| !c.text.is_empty());
        let (text, null_score_diff) = match null_scores {
            None => (n_best[0].text.clone(), None),
            Some((s, e)) => match best_non_null {
                Some(best) => {
                    let diff = s + e - best.start_logit - best.end_logit;
                    let text = if diff > options.null_score_diff_threshold {
                        String::new()
                    } else {
                        best.text.clone()
                    };
                    (text, Some(diff))
                }
                // Only "no answer" survived (Google's script fails here).
                None => (String::new(), Some(f64::INFINITY)),
            },
        };
        out.push(Prediction {
            id: example.id.clone(),
            text,
            n_best,
            null_score_diff,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_text_follows_get_final_text() {
        // The docstring's case: the prediction "steve smith" inside "Steve Smith's".
        assert_eq!(
            final_text("steve smith", "Steve Smith's", true),
            "Steve Smith"
        );
        // Punctuation split by the basic tokenizer aligns back onto the original.
        assert_eq!(final_text("1895", "(1895-1943).", true), "1895");
        assert_eq!(final_text("1895 - 1943", "(1895-1943).", true), "1895-1943");
        // Not found: the original words.
        assert_eq!(final_text("cat", "Denver Broncos", true), "Denver Broncos");
        // Accent stripping changes the length: the original words.
        assert_eq!(final_text("cafe", "Café\u{301}", true), "Café\u{301}");
        assert_eq!(final_text("Broncos", "Denver Broncos", false), "Broncos");
    }

    #[test]
    fn best_indexes_are_stable_on_ties() {
        assert_eq!(best_indexes(&[1.0, 3.0, 3.0, 2.0], 3), vec![1, 2, 3]);
    }

    #[test]
    fn softmax_sums_to_one() {
        let p = softmax(&[1.0, 2.0, 3.0]);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(p[2] > p[1] && p[1] > p[0]);
    }
}
