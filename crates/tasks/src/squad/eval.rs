//! The official SQuAD v1.1 evaluation (`evaluate-v1.1.py`), reimplemented to give the same
//! numbers to the last printed digit.
//!
//! - Normalisation: lower-case (Python's `str.lower`), drop ASCII punctuation
//!   (`string.punctuation`), replace the whole words `a`, `an` and `the` by a space (regex
//!   `\b(a|an|the)\b`, Unicode word characters), then join the whitespace-split tokens with one
//!   space.
//! - Exact match: the normalised strings are equal. F1: token overlap (multiset intersection)
//!   of the normalised strings; 0 when nothing is shared.
//! - Each question scores the maximum over its gold answers; a question without a prediction
//!   scores 0 (and is reported, as the script prints it). Totals are percentages of all
//!   questions, summed in file order as the script does.

use std::collections::HashMap;

use crate::squad::data::Dataset;

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `remove_articles`: each whole word `a`, `an` or `the` becomes a space.
fn remove_articles(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let boundary_before = i == 0 || !is_word_char(chars[i - 1]);
        if boundary_before {
            let matched = ["the", "an", "a"].iter().find_map(|w| {
                let n = w.chars().count();
                let fits = i + n <= chars.len()
                    && chars[i..i + n].iter().copied().eq(w.chars())
                    && (i + n == chars.len() || !is_word_char(chars[i + n]));
                fits.then_some(n)
            });
            if let Some(n) = matched {
                out.push(' ');
                i += n;
                continue;
            }
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

/// The official `normalize_answer`.
pub fn normalize_answer(text: &str) -> String {
    let lower = text.to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let no_articles = remove_articles(&no_punct);
    no_articles.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The official `exact_match_score`.
pub fn exact_match(prediction: &str, gold: &str) -> bool {
    normalize_answer(prediction) == normalize_answer(gold)
}

/// The official `f1_score`.
pub fn f1(prediction: &str, gold: &str) -> f64 {
    let p = normalize_answer(prediction);
    let g = normalize_answer(gold);
    let p: Vec<&str> = p.split_whitespace().collect();
    let g: Vec<&str> = g.split_whitespace().collect();
    overlap_f1(&p, &g)
}

/// F1 of the token overlap (multiset intersection) of two token lists; 0 when they share
/// nothing.
pub(crate) fn overlap_f1(prediction: &[&str], gold: &[&str]) -> f64 {
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for t in gold {
        *counts.entry(t).or_default() += 1;
    }
    let mut same = 0i64;
    for t in prediction {
        if let Some(c) = counts.get_mut(t)
            && *c > 0
        {
            *c -= 1;
            same += 1;
        }
    }
    if same == 0 {
        return 0.0;
    }
    let precision = same as f64 / prediction.len() as f64;
    let recall = same as f64 / gold.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// Reads a predictions file: a JSON object `{question id: answer text}`.
pub fn read_predictions(
    path: &std::path::Path,
) -> Result<HashMap<String, String>, crate::TaskError> {
    let text = bertkit_stage_io::read_text(path).map_err(|e| crate::TaskError::Io {
        path: path.into(),
        source: e,
    })?;
    serde_json::from_str(&text).map_err(|e| crate::TaskError::Format {
        path: path.into(),
        message: format!("not a JSON object of question id to answer text: {e}"),
    })
}

/// One question's scores.
#[derive(Debug, Clone, PartialEq)]
pub struct QuestionScore {
    /// Question id.
    pub id: String,
    /// Best exact match over the gold answers (None: no prediction).
    pub exact_match: Option<bool>,
    /// Best F1 over the gold answers.
    pub f1: Option<f64>,
}

/// The totals, as the script prints them.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    /// Percentage of exact matches.
    pub exact_match: f64,
    /// Mean F1, in percent.
    pub f1: f64,
    /// Questions in the data set.
    pub total: usize,
    /// Questions without a prediction (scored 0).
    pub unanswered: Vec<String>,
    /// Per-question scores, in file order.
    pub per_question: Vec<QuestionScore>,
}

impl Scores {
    /// The script's output line: `{"exact_match": …, "f1": …}`.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"exact_match\": {}, \"f1\": {}}}",
            crate::pyfloat::repr(self.exact_match),
            crate::pyfloat::repr(self.f1)
        )
    }
}

/// Scores `predictions` (question id → answer text) on `dataset`.
pub fn evaluate(dataset: &Dataset, predictions: &HashMap<String, String>) -> Scores {
    let (mut em_sum, mut f1_sum, mut total) = (0f64, 0f64, 0usize);
    let mut unanswered = Vec::new();
    let mut per_question = Vec::new();
    for (_, q) in dataset.questions() {
        total += 1;
        let Some(prediction) = predictions.get(&q.id) else {
            unanswered.push(q.id.clone());
            per_question.push(QuestionScore {
                id: q.id.clone(),
                exact_match: None,
                f1: None,
            });
            continue;
        };
        let em = q.answers.iter().any(|a| exact_match(prediction, &a.text));
        let f = q
            .answers
            .iter()
            .map(|a| f1(prediction, &a.text))
            .fold(f64::NEG_INFINITY, f64::max);
        // Python's max() over an empty list raises; a question without answers scores 0 here.
        let f = if q.answers.is_empty() { 0.0 } else { f };
        em_sum += if em { 1.0 } else { 0.0 };
        f1_sum += f;
        per_question.push(QuestionScore {
            id: q.id.clone(),
            exact_match: Some(em),
            f1: Some(f),
        });
    }
    let total_f = total.max(1) as f64;
    Scores {
        exact_match: 100.0 * em_sum / total_f,
        f1: 100.0 * f1_sum / total_f,
        total,
        unanswered,
        per_question,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_like_the_script() {
        assert_eq!(normalize_answer("The  Denver Broncos!"), "denver broncos");
        assert_eq!(
            normalize_answer("an apple a day, theory"),
            "apple day theory"
        );
        assert_eq!(normalize_answer("A-team"), "ateam");
        assert_eq!(normalize_answer("the_the"), "thethe");
        assert_eq!(normalize_answer("Café the"), "café");
        assert!((f1("the cat sat", "a cat sat down") - 0.8).abs() < 1e-12);
        assert_eq!(f1("", ""), 0.0);
        assert!(exact_match("The Eiffel Tower.", "eiffel tower"));
    }
}
