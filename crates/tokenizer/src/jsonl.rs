//! Tokenizing a stream of lines to JSON Lines: what `bertkit tokenize` does with stdin.
//!
//! Lines are read in batches of [`BATCH_LINES`] and each batch is tokenized in parallel, so
//! memory holds one batch whatever the input size; the output keeps the input's order, one
//! `{"tokens": [...], "ids": [...]}` object per line.

use std::io::{BufRead, Write};

use crate::FullTokenizer;

/// Lines tokenized together (in parallel) before their output is written.
pub const BATCH_LINES: usize = 4096;

/// Why a stream could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum JsonlError {
    /// Reading the input or writing the output failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// An input line is unusable.
    #[error("line {line}: {message}")]
    Line {
        /// 1-based line number of the input.
        line: u64,
        /// What is wrong with it.
        message: String,
    },
}

/// How input lines are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineFormat {
    /// Each line is a text.
    Text,
    /// Each line is a JSON object whose string field `"text"` is the text (so a text may hold
    /// newlines).
    Jsonl,
}

/// Tokenizes every line of `input` with `tokenizer`, writing one JSON object per line to
/// `output`. Returns the number of lines.
pub fn tokenize_lines(
    tokenizer: &FullTokenizer,
    input: impl BufRead,
    format: LineFormat,
    mut output: impl Write,
) -> Result<u64, JsonlError> {
    let mut lines = input.split(b'\n');
    let mut line = 0u64;
    loop {
        let mut batch = Vec::with_capacity(BATCH_LINES);
        for raw in lines.by_ref().take(BATCH_LINES) {
            line += 1;
            let bad = |message: String| JsonlError::Line { line, message };
            let text = String::from_utf8(raw?).map_err(|_| bad("not valid UTF-8".into()))?;
            batch.push(match format {
                LineFormat::Text => text,
                LineFormat::Jsonl => text_field(&text).map_err(bad)?,
            });
        }
        if batch.is_empty() {
            break;
        }
        for (tokens, ids) in tokenizer.tokenize_batch(&batch) {
            write_json_line(&mut output, &tokens, &ids)?;
        }
    }
    output.flush()?;
    Ok(line)
}

/// The `"text"` string of a JSON object.
fn text_field(line: &str) -> Result<String, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    value
        .get("text")
        .and_then(|t| t.as_str())
        .map(str::to_string)
        .ok_or_else(|| "no string \"text\" field".to_string())
}

fn write_json_line(output: &mut impl Write, tokens: &[String], ids: &[u32]) -> std::io::Result<()> {
    serde_json::to_writer(
        &mut *output,
        &serde_json::json!({ "tokens": tokens, "ids": ids }),
    )?;
    output.write_all(b"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> FullTokenizer {
        let vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\n,\n";
        FullTokenizer::from_vocab_text(std::path::Path::new("vocab.txt"), vocab, true).unwrap()
    }

    #[test]
    fn lines_become_json_objects_in_order_and_bad_lines_are_named() {
        let mut out = Vec::new();
        let n = tokenize_lines(
            &tokenizer(),
            &b"Hello, world\nxyz\n"[..],
            LineFormat::Text,
            &mut out,
        )
        .unwrap();
        assert_eq!(n, 2);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"ids\":[5,7,6],\"tokens\":[\"hello\",\",\",\"world\"]}\n\
             {\"ids\":[1],\"tokens\":[\"[UNK]\"]}\n"
        );
        let mut out = Vec::new();
        let jsonl = &b"{\"text\": \"hello\\nworld\"}\n{\"txt\": 1}\n"[..];
        let err = tokenize_lines(&tokenizer(), jsonl, LineFormat::Jsonl, &mut out).unwrap_err();
        assert_eq!(err.to_string(), "line 2: no string \"text\" field");
        let err = tokenize_lines(
            &tokenizer(),
            &b"ok\n\xff\n"[..],
            LineFormat::Text,
            Vec::new(),
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "line 2: not valid UTF-8");
    }
}
