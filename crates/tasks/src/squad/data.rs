//! The official SQuAD JSON (`{"version", "data": [{"title", "paragraphs": [{"context",
//! "qas": [{"id", "question", "answers": [{"text", "answer_start"}], "is_impossible"}]}]}]}`).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::TaskError;

/// One answer span.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    /// The answer text.
    pub text: String,
    /// Character offset in the context.
    pub answer_start: usize,
}

/// One question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Question {
    /// Unique id.
    pub id: String,
    /// The question.
    pub question: String,
    /// Gold answers (several in dev sets).
    #[serde(default)]
    pub answers: Vec<Answer>,
    /// v2.0: no answer in the context.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_impossible: bool,
}

/// A context paragraph and its questions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Paragraph {
    /// The context.
    pub context: String,
    /// Its questions.
    pub qas: Vec<Question>,
}

/// An article.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Article {
    /// Title.
    #[serde(default)]
    pub title: String,
    /// Paragraphs.
    pub paragraphs: Vec<Paragraph>,
}

/// A SQuAD file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Dataset {
    /// `1.1` or `v2.0`.
    #[serde(default)]
    pub version: String,
    /// Articles, in file order.
    pub data: Vec<Article>,
}

impl Dataset {
    /// Reads a SQuAD JSON file; a malformed one is an error naming the line and column.
    pub fn load(path: &Path) -> Result<Self, TaskError> {
        let text = bertkit_stage_io::read_text(path).map_err(|e| TaskError::Io {
            path: path.into(),
            source: e,
        })?;
        serde_json::from_str(&text).map_err(|e| TaskError::Format {
            path: path.into(),
            message: format!("not SQuAD JSON: {e}"),
        })
    }

    /// Articles of SQuAD v1.1 dev in the training half of the documented offline split (8,582
    /// questions; the last 10 articles, 1,988 questions, are the evaluation half).
    pub const OFFLINE_TRAIN_ARTICLES: usize = 38;

    /// Splits off the first `train_articles` articles (for offline runs on a dev set only:
    /// train on the head, evaluate on the tail). Both halves keep the version.
    pub fn split_articles(&self, train_articles: usize) -> Result<(Dataset, Dataset), TaskError> {
        if train_articles == 0 || train_articles >= self.data.len() {
            return Err(TaskError::Settings(format!(
                "cannot split {} articles after article {train_articles}: both halves need one",
                self.data.len()
            )));
        }
        let half = |data: &[Article]| Dataset {
            version: self.version.clone(),
            data: data.to_vec(),
        };
        Ok((
            half(&self.data[..train_articles]),
            half(&self.data[train_articles..]),
        ))
    }

    /// Writes the dataset as SQuAD JSON (temp file, then renamed into place).
    pub fn save(&self, path: &Path) -> Result<(), TaskError> {
        let json = serde_json::to_vec(self).map_err(|e| TaskError::Format {
            path: path.into(),
            message: e.to_string(),
        })?;
        bertkit_stage_io::write_atomically(path, &json).map_err(|e| TaskError::Io {
            path: path.into(),
            source: e,
        })
    }

    /// Questions in the dataset.
    pub fn question_count(&self) -> usize {
        self.questions().count()
    }

    /// Every question with its paragraph's context, in file order.
    pub fn questions(&self) -> impl Iterator<Item = (&Paragraph, &Question)> {
        self.data
            .iter()
            .flat_map(|a| a.paragraphs.iter())
            .flat_map(|p| p.qas.iter().map(move |q| (p, q)))
    }
}
