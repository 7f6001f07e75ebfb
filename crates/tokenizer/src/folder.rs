//! What a model folder keeps of its tokenizer, in the transformers layout: `vocab.txt` (one
//! WordPiece token a line, the id its line number) and `tokenizer_config.json` (whether the
//! vocabulary is uncased: `do_lower_case`). transformers' `BertTokenizer` loads a folder with
//! these two files, and every bertkit command that takes a model folder reads its casing from
//! the second, so a model is tokenized as it was trained without a flag.

use std::io;
use std::path::{Path, PathBuf};

/// The vocabulary file of a model folder.
pub const VOCAB_FILE: &str = "vocab.txt";
/// The tokenizer settings file of a model folder.
pub const CONFIG_FILE: &str = "tokenizer_config.json";

/// A tokenizer as a model folder stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerFiles {
    /// The text of `vocab.txt`.
    pub vocab: String,
    /// Uncased (lower-casing and accent stripping before WordPiece), Google's `do_lower_case`.
    pub lower_case: bool,
}

/// A tokenizer file that could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// `tokenizer_config.json` is not JSON, or its `do_lower_case` is not a boolean.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl TokenizerFiles {
    /// Writes `vocab.txt` and `tokenizer_config.json` into `dir`, each atomically.
    pub fn write_into(&self, dir: &Path) -> Result<(), FolderError> {
        let config = serde_json::json!({
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": self.lower_case,
            "unk_token": "[UNK]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "cls_token": "[CLS]",
            "mask_token": "[MASK]",
        });
        let config = serde_json::to_string_pretty(&config).expect("a JSON value serialises");
        for (file, text) in [(VOCAB_FILE, self.vocab.as_str()), (CONFIG_FILE, &config)] {
            let path = dir.join(file);
            bertkit_stage_io::write_atomically(&path, text.as_bytes())
                .map_err(|source| FolderError::Io { path, source })?;
        }
        Ok(())
    }

    /// Reads the tokenizer of the model folder `dir`: its `vocab.txt` (required) and the casing
    /// of its `tokenizer_config.json` (uncased where the file or the key is absent, as
    /// transformers' `BertTokenizer` defaults).
    pub fn read(dir: &Path) -> Result<Self, FolderError> {
        let path = dir.join(VOCAB_FILE);
        let vocab = bertkit_stage_io::read_text(&path)
            .map_err(|source| FolderError::Io { path, source })?;
        Ok(TokenizerFiles {
            vocab,
            lower_case: lower_case_of(dir)?.unwrap_or(true),
        })
    }
}

/// The `do_lower_case` of the model folder `dir`'s `tokenizer_config.json`: `None` where the
/// folder has no such file or the file no such key.
pub fn lower_case_of(dir: &Path) -> Result<Option<bool>, FolderError> {
    let path = dir.join(CONFIG_FILE);
    let text = match bertkit_stage_io::read_text(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(FolderError::Io { path, source }),
    };
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| FolderError::Config {
            path: path.clone(),
            message: format!("not JSON: {e}"),
        })?;
    match config.get("do_lower_case") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(FolderError::Config {
            path,
            message: format!("do_lower_case is {other}: true or false"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_keeps_its_vocabulary_and_casing() {
        let dir = tempfile::tempdir().unwrap();
        let cased = TokenizerFiles {
            vocab: "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nThe\n".into(),
            lower_case: false,
        };
        cased.write_into(dir.path()).unwrap();
        assert_eq!(TokenizerFiles::read(dir.path()).unwrap(), cased);
        assert_eq!(lower_case_of(dir.path()).unwrap(), Some(false));
    }

    #[test]
    fn a_folder_without_settings_is_uncased_and_bad_settings_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(VOCAB_FILE), "[UNK]\n").unwrap();
        assert_eq!(lower_case_of(dir.path()).unwrap(), None);
        assert!(TokenizerFiles::read(dir.path()).unwrap().lower_case);
        std::fs::write(dir.path().join(CONFIG_FILE), r#"{"do_lower_case": "yes"}"#).unwrap();
        let err = lower_case_of(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("true or false"),
            "{err}"
        );
        std::fs::write(dir.path().join(CONFIG_FILE), "{").unwrap();
        assert!(
            lower_case_of(dir.path())
                .unwrap_err()
                .to_string()
                .contains("not JSON")
        );
        let empty = tempfile::tempdir().unwrap();
        let err = TokenizerFiles::read(empty.path()).unwrap_err().to_string();
        assert!(err.contains("vocab.txt"), "{err}");
    }
}
