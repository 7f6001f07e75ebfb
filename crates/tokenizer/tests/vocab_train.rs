//! Training a vocabulary on real text, then tokenizing with it.

use bertkit_test_support::require;
use bertkit_tokenizer::FullTokenizer;
use bertkit_tokenizer::vocab::{SPECIAL_TOKENS, train_vocab};

#[test]
fn trained_vocabulary_has_bert_layout_and_tokenizes_its_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("vocab.txt");
    let n = train_vocab(&[require("gutenberg/austen-emma.txt")], 2000, true, &out).unwrap();
    let lines: Vec<String> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), n);
    assert!((1000..=2000).contains(&n), "{n} tokens");
    assert_eq!(&lines[..5], &SPECIAL_TOKENS);
    assert!(
        lines.iter().any(|t| t.starts_with("##")),
        "continuation pieces"
    );
    assert!(lines.contains(&"emma".to_string()) && lines.contains(&"the".to_string()));
    assert!(
        !lines[SPECIAL_TOKENS.len()..]
            .iter()
            .any(|t| t.chars().any(char::is_uppercase)),
        "uncased vocabulary (beyond the special tokens)"
    );

    let tokenizer = FullTokenizer::from_vocab_file(&out, true).unwrap();
    let tokens =
        tokenizer.tokenize("Emma Woodhouse, handsome, clever, and rich, with a comfortable home.");
    assert!(tokens.contains(&"emma".to_string()), "{tokens:?}");
    assert!(!tokens.contains(&"[UNK]".to_string()), "{tokens:?}");

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    assert!(train_vocab(&[empty], 100, true, &dir.path().join("v2.txt")).is_err());
}
