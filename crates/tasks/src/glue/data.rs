//! GLUE task files as `download_glue_data.py` lays them out (`<TASK>/train.tsv`, `dev.tsv`).
//!
//! Rows are tab-separated with no quote processing (as Google's and transformers' readers do:
//! MRPC sentences hold bare `"` characters). A UTF-8 byte-order mark is dropped. Columns:
//! - MRPC: header `Quality, #1 ID, #2 ID, #1 String, #2 String`; label 0/1.
//! - CoLA: no header; `source, label, original label, sentence`.
//! - SST-2: header `sentence, label`.
//! - MNLI: header; `sentence1`, `sentence2`, `gold_label` found by name (train and dev differ in
//!   column count); labels contradiction, entailment, neutral (Google's order).

use std::path::Path;

use crate::TaskError;

/// A GLUE task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Paraphrase (sentence pairs), accuracy and F1.
    Mrpc,
    /// Acceptability (single sentences), Matthews correlation.
    Cola,
    /// Sentiment (single sentences), accuracy.
    Sst2,
    /// Entailment (pairs, 3 classes), accuracy.
    Mnli,
}

/// One labelled example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// First (or only) sentence.
    pub text_a: String,
    /// Second sentence of a pair.
    pub text_b: Option<String>,
    /// Class index.
    pub label: usize,
}

impl Task {
    /// From `mrpc`, `cola`, `sst-2`/`sst2`, `mnli` (any case).
    pub fn parse(name: &str) -> Result<Self, String> {
        match name.to_ascii_lowercase().as_str() {
            "mrpc" => Ok(Task::Mrpc),
            "cola" => Ok(Task::Cola),
            "sst-2" | "sst2" => Ok(Task::Sst2),
            "mnli" => Ok(Task::Mnli),
            other => Err(format!(
                "GLUE task {other:?}: expected mrpc, cola, sst-2 or mnli"
            )),
        }
    }

    /// The folder name in the GLUE layout.
    pub fn folder(self) -> &'static str {
        match self {
            Task::Mrpc => "MRPC",
            Task::Cola => "CoLA",
            Task::Sst2 => "SST-2",
            Task::Mnli => "MNLI",
        }
    }

    /// The class names, by index.
    pub fn labels(self) -> &'static [&'static str] {
        match self {
            Task::Mnli => &["contradiction", "entailment", "neutral"],
            _ => &["0", "1"],
        }
    }

    /// The dev file's name.
    pub fn dev_file(self) -> &'static str {
        match self {
            Task::Mnli => "dev_matched.tsv",
            _ => "dev.tsv",
        }
    }
}

/// Reads a labelled GLUE file of `task`; a row that does not parse is an error naming the file
/// and line.
pub fn read(task: Task, path: &Path) -> Result<Vec<Example>, TaskError> {
    let text = bertkit_stage_io::read_text(path).map_err(|e| TaskError::Io {
        path: path.into(),
        source: e,
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let bad = |line: usize, message: String| TaskError::Format {
        path: path.into(),
        message: format!("line {line}: {message}"),
    };
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r')));
    let header: Vec<String> = match task {
        Task::Cola => Vec::new(),
        _ => lines
            .next()
            .map(|(_, l)| l.split('\t').map(str::to_string).collect())
            .unwrap_or_default(),
    };
    let column = |name: &str| -> Result<usize, TaskError> {
        header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| bad(1, format!("no column {name:?} in the header")))
    };
    let (a, b, label) = match task {
        Task::Mrpc => (3, Some(4), 0),
        Task::Cola => (3, None, 1),
        Task::Sst2 => (column("sentence")?, None, column("label")?),
        Task::Mnli => (
            column("sentence1")?,
            Some(column("sentence2")?),
            column("gold_label")?,
        ),
    };
    let names = task.labels();
    let mut out = Vec::new();
    for (n, line) in lines {
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').collect();
        let get = |i: usize| {
            fields.get(i).copied().ok_or_else(|| {
                bad(
                    n,
                    format!("{} columns, expected more than {i}", fields.len()),
                )
            })
        };
        let label_text = get(label)?.trim();
        let label = names
            .iter()
            .position(|l| *l == label_text)
            .ok_or_else(|| bad(n, format!("label {label_text:?} is not one of {names:?}")))?;
        out.push(Example {
            text_a: get(a)?.to_string(),
            text_b: b.map(get).transpose()?.map(str::to_string),
            label,
        });
    }
    if out.is_empty() {
        return Err(TaskError::Format {
            path: path.into(),
            message: "no examples: the file is empty or holds only a header".into(),
        });
    }
    Ok(out)
}
