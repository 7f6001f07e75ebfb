//! Every line of the reference file (Google's `FullTokenizer` on 3,031 lines of real text:
//! BERT's sample text, Emma, SQuAD questions) must tokenize identically.

use bertkit_test_support::require;
use bertkit_tokenizer::FullTokenizer;

#[test]
fn all_reference_lines_match_googles_full_tokenizer() {
    let tokenizer = FullTokenizer::from_vocab_file(&require("minilm/vocab.txt"), true).unwrap();
    assert_eq!(tokenizer.vocab_size(), 30522);
    let reference =
        std::fs::read_to_string(require("reference/wordpiece_reference.jsonl")).unwrap();
    let mut lines = 0;
    let mut mismatches = Vec::new();
    for line in reference.lines() {
        let case: serde_json::Value = serde_json::from_str(line).unwrap();
        let text = case["text"].as_str().unwrap();
        let expected: Vec<String> = serde_json::from_value(case["tokens"].clone()).unwrap();
        let expected_ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let tokens = tokenizer.tokenize(text);
        // The id paths (plain, and the bulk path with its cache) agree with the token path.
        assert_eq!(tokenizer.tokenize_ids(text), expected_ids, "{text:?}");
        let mut bulk = Vec::new();
        tokenizer.extend_ids(text, &mut bulk);
        assert_eq!(bulk, expected_ids, "{text:?}");
        let ids: Vec<u32> = tokens
            .iter()
            .map(|t| tokenizer.token_to_id(t).unwrap_or(u32::MAX))
            .collect();
        if tokens != expected || ids != expected_ids {
            mismatches.push(format!(
                "{text:?}\n  got      {tokens:?}\n  expected {expected:?}"
            ));
        }
        lines += 1;
    }
    assert_eq!(lines, 3031);
    assert!(
        mismatches.is_empty(),
        "{} mismatches, first:\n{}",
        mismatches.len(),
        mismatches[..mismatches.len().min(5)].join("\n")
    );
}

/// bertkit's WordPiece splits every word of the reference texts, and made-up words with
/// unknown pieces, accents and more than 200 characters, as the `tokenizers` crate's WordPiece
/// model does (the same greedy longest-match algorithm). A word the basic tokenizer has made
/// is one word again for a cased tokenizer, so its ids are its WordPiece split.
#[test]
fn wordpiece_splits_words_as_the_tokenizers_crate_does() {
    use tokenizers::Model;
    use tokenizers::models::wordpiece::WordPiece;
    let vocab_path = require("minilm/vocab.txt");
    let lines: Vec<String> = std::fs::read_to_string(&vocab_path)
        .unwrap()
        .lines()
        .map(|l| l.trim().to_string())
        .collect();
    let unk = lines.iter().position(|t| t == "[UNK]").unwrap() as u32;
    let ours = FullTokenizer::from_vocab_file(&vocab_path, false).unwrap();
    let model = WordPiece::from_file(vocab_path.to_str().unwrap())
        .unk_token("[UNK]".into())
        .max_input_chars_per_word(200)
        .build()
        .unwrap();
    let reference =
        std::fs::read_to_string(require("reference/wordpiece_reference.jsonl")).unwrap();
    let mut words = std::collections::BTreeSet::new();
    for line in reference.lines() {
        let case: serde_json::Value = serde_json::from_str(line).unwrap();
        for cased in [true, false] {
            words.extend(bertkit_tokenizer::basic_tokenize(
                case["text"].as_str().unwrap(),
                cased,
            ));
        }
    }
    let made_up = [
        "a".repeat(200),
        "a".repeat(201),
        "é".repeat(150),
        format!("{}xq", "un".repeat(99)),
        "unaffablezzzqqq".into(),
        "ünïcödé".into(),
    ];
    words.extend(made_up);
    assert!(words.len() > 6_000, "{}", words.len());
    for word in &words {
        let expected: Vec<u32> = match model.tokenize(word) {
            Ok(pieces) => pieces.into_iter().map(|t| t.id).collect(),
            Err(_) => vec![unk],
        };
        assert_eq!(ours.tokenize_ids(word), expected, "{word:?}");
    }
}
