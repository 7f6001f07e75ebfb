//! The official SQuAD v2.0 evaluation (`evaluate-v2.0.py`), reimplemented.
//!
//! - A question's gold answers are its answers whose normalised text is not empty; a question
//!   with none (unanswerable) has the single gold answer `""`.
//! - Exact match as in v1.1; F1 as in v1.1 except that when either side has no tokens, F1 is 1
//!   if both are empty and 0 otherwise. Max over gold answers.
//! - With no-answer probabilities (`na_probs`), a question whose probability exceeds
//!   `na_prob_thresh` (default 1.0) counts as answered "no answer" (1 if it has none, else 0).
//! - Output: `exact`, `f1`, `total`, then `HasAns_*` and `NoAns_*` over the questions with and
//!   without answers, and with `na_probs` the best achievable `best_exact`/`best_f1` and their
//!   thresholds (questions sorted by probability, stable). Sums run in file order with plain
//!   float addition (CPython 3.11's `sum`; 3.12 and later compensate and may differ in the
//!   last digit).
//!
//! One difference: the script stops with a `KeyError` when a prediction is missing; here a
//! missing prediction scores 0 and is listed in [`ScoresV2::unanswered`].

use std::collections::HashMap;

use crate::squad::data::Dataset;
use crate::squad::eval::{normalize_answer, overlap_f1};

fn tokens(text: &str) -> Vec<String> {
    if text.is_empty() {
        return Vec::new();
    }
    normalize_answer(text)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// `compute_exact`.
pub fn exact(gold: &str, prediction: &str) -> f64 {
    f64::from(u8::from(
        normalize_answer(gold) == normalize_answer(prediction),
    ))
}

/// `compute_f1`.
pub fn f1(gold: &str, prediction: &str) -> f64 {
    let g = tokens(gold);
    let p = tokens(prediction);
    if g.is_empty() || p.is_empty() {
        return f64::from(u8::from(g == p));
    }
    let g: Vec<&str> = g.iter().map(String::as_str).collect();
    let p: Vec<&str> = p.iter().map(String::as_str).collect();
    overlap_f1(&p, &g)
}

/// Reads no-answer probabilities (or run_squad's `null_odds.json`): a JSON object
/// `{question id: number}`, kept in file order (the best-threshold search is a stable sort
/// over it, as the script's).
pub fn read_na_probs(path: &std::path::Path) -> Result<Vec<(String, f64)>, crate::TaskError> {
    let text = bertkit_stage_io::read_text(path).map_err(|e| crate::TaskError::Io {
        path: path.into(),
        source: e,
    })?;
    let bad = |m: String| crate::TaskError::Format {
        path: path.into(),
        message: m,
    };
    let mut de = serde_json::Deserializer::from_str(&text);
    let entries = serde::Deserializer::deserialize_map(&mut de, OrderedNumbers)
        .map_err(|e| bad(format!("not a JSON object of question id to number: {e}")))?;
    de.end().map_err(|e| bad(e.to_string()))?;
    Ok(entries)
}

/// Visits a JSON object of numbers, keeping the entries' order.
struct OrderedNumbers;

impl<'de> serde::de::Visitor<'de> for OrderedNumbers {
    type Value = Vec<(String, f64)>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of question id to number")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(entry) = map.next_entry::<String, f64>()? {
            out.push(entry);
        }
        Ok(out)
    }
}

/// The v2.0 results, in the script's key order.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoresV2 {
    /// (key, value) in output order; values are `Int` for totals.
    pub entries: Vec<(String, Number)>,
    /// Questions without a prediction (scored 0).
    pub unanswered: Vec<String>,
}

/// A printed number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    /// A float, printed as Python prints it.
    Float(f64),
    /// An integer.
    Int(usize),
}

impl ScoresV2 {
    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| match v {
                Number::Float(f) => *f,
                Number::Int(i) => *i as f64,
            })
    }

    /// The script's output: `json.dumps(out_eval, indent=2)`.
    pub fn to_json(&self) -> String {
        let body: Vec<String> = self
            .entries
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Number::Float(f) => crate::pyfloat::repr(*f),
                    Number::Int(i) => i.to_string(),
                };
                format!("  \"{k}\": {v}")
            })
            .collect();
        format!("{{\n{}\n}}", body.join(",\n"))
    }
}

/// Scores `predictions` on `dataset`; `na_probs` are the model's no-answer probabilities
/// (question id → probability), as the script's `--na-prob-file`.
pub fn evaluate_v2(
    dataset: &Dataset,
    predictions: &HashMap<String, String>,
    na_probs: Option<&[(String, f64)]>,
    na_prob_thresh: f64,
) -> ScoresV2 {
    let mut has_answer: Vec<(String, bool)> = Vec::new();
    let mut raw: Vec<(String, f64, f64)> = Vec::new();
    let mut unanswered = Vec::new();
    for (_, q) in dataset.questions() {
        has_answer.push((q.id.clone(), !q.answers.is_empty()));
        let mut gold: Vec<&str> = q
            .answers
            .iter()
            .map(|a| a.text.as_str())
            .filter(|t| !normalize_answer(t).is_empty())
            .collect();
        if gold.is_empty() {
            gold.push("");
        }
        let Some(p) = predictions.get(&q.id) else {
            unanswered.push(q.id.clone());
            raw.push((q.id.clone(), 0.0, 0.0));
            continue;
        };
        let e = gold.iter().map(|g| exact(g, p)).fold(f64::MIN, f64::max);
        let f = gold.iter().map(|g| f1(g, p)).fold(f64::MIN, f64::max);
        raw.push((q.id.clone(), e, f));
    }
    let has: HashMap<&str, bool> = has_answer.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let prob_of: HashMap<&str, f64> = match na_probs {
        Some(p) => p.iter().map(|(k, v)| (k.as_str(), *v)).collect(),
        // The script's default: 0.0 for every predicted question.
        None => predictions.keys().map(|k| (k.as_str(), 0.0)).collect(),
    };
    let thresholded: Vec<(String, f64, f64)> = raw
        .iter()
        .map(|(id, e, f)| {
            let no_answer = prob_of
                .get(id.as_str())
                .is_some_and(|&p| p > na_prob_thresh);
            if no_answer {
                let v = f64::from(u8::from(!has[id.as_str()]));
                (id.clone(), v, v)
            } else {
                (id.clone(), *e, *f)
            }
        })
        .collect();
    let by_id: HashMap<&str, (f64, f64)> = thresholded
        .iter()
        .map(|(id, e, f)| (id.as_str(), (*e, *f)))
        .collect();

    let mut entries = Vec::new();
    let mut add_block = |prefix: &str, ids: &[&str]| {
        let total = ids.len();
        let (mut e, mut f) = (0f64, 0f64);
        for id in ids {
            let (ei, fi) = by_id[id];
            e += ei;
            f += fi;
        }
        let name = |k: &str| {
            if prefix.is_empty() {
                k.to_string()
            } else {
                format!("{prefix}_{k}")
            }
        };
        entries.push((name("exact"), Number::Float(100.0 * e / total as f64)));
        entries.push((name("f1"), Number::Float(100.0 * f / total as f64)));
        entries.push((name("total"), Number::Int(total)));
    };
    let all: Vec<&str> = thresholded.iter().map(|(id, _, _)| id.as_str()).collect();
    if !all.is_empty() {
        add_block("", &all);
    }
    let with: Vec<&str> = has_answer
        .iter()
        .filter(|(_, h)| *h)
        .map(|(k, _)| k.as_str())
        .collect();
    let without: Vec<&str> = has_answer
        .iter()
        .filter(|(_, h)| !*h)
        .map(|(k, _)| k.as_str())
        .collect();
    if !with.is_empty() {
        add_block("HasAns", &with);
    }
    if !without.is_empty() {
        add_block("NoAns", &without);
    }
    if let Some(probs) = na_probs {
        let raw_by_id: HashMap<&str, (f64, f64)> = raw
            .iter()
            .map(|(id, e, f)| (id.as_str(), (*e, *f)))
            .collect();
        let num_no_ans = without.len() as f64;
        let mut sorted: Vec<&(String, f64)> = probs.iter().collect();
        sorted.sort_by(|a, b| a.1.total_cmp(&b.1));
        for (key, pick) in [("exact", 0usize), ("f1", 1usize)] {
            let (mut current, mut best, mut best_thresh) = (num_no_ans, num_no_ans, 0.0);
            for (id, p) in &sorted {
                let Some(&(e, f)) = raw_by_id.get(id.as_str()) else {
                    continue;
                };
                let diff = if has.get(id.as_str()).copied().unwrap_or(false) {
                    if pick == 0 { e } else { f }
                } else if predictions.get(id).is_some_and(|t| !t.is_empty()) {
                    -1.0
                } else {
                    0.0
                };
                current += diff;
                if current > best {
                    best = current;
                    best_thresh = *p;
                }
            }
            entries.push((
                format!("best_{key}"),
                Number::Float(100.0 * best / raw.len().max(1) as f64),
            ));
            entries.push((format!("best_{key}_thresh"), Number::Float(best_thresh)));
        }
    }
    ScoresV2 {
        entries,
        unanswered,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_answers_score_by_agreement() {
        assert_eq!(f1("", ""), 1.0);
        assert_eq!(f1("", "Paris"), 0.0);
        assert_eq!(f1("the", ""), 1.0, "'the' normalises to nothing");
        assert_eq!(exact("", ""), 1.0);
        assert!((f1("the cat sat", "a cat sat down") - 0.8).abs() < 1e-12);
    }
}
