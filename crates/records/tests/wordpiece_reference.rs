//! Every line of the reference file (Google's `FullTokenizer` on 3,031 lines of real text:
//! BERT's sample text, Emma, SQuAD questions) must tokenize identically.

use bertkit_records::FullTokenizer;
use bertkit_shared_data::require;

#[test]
fn all_reference_lines_match_googles_full_tokenizer() {
    let tokenizer = FullTokenizer::from_vocab_file(&require("minilm/vocab.txt"), true).unwrap();
    assert_eq!(tokenizer.vocab_size(), 30522);
    let reference =
        std::fs::read_to_string(require("reference/wordpiece_reference.jsonl")).unwrap();
    let mut lines = 0;
    let mut cache = bertkit_records::tokenizer::WordCache::default();
    let mut mismatches = Vec::new();
    for line in reference.lines() {
        let case: serde_json::Value = serde_json::from_str(line).unwrap();
        let text = case["text"].as_str().unwrap();
        let expected: Vec<String> = serde_json::from_value(case["tokens"].clone()).unwrap();
        let expected_ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let tokens = tokenizer.tokenize(text);
        // The id paths (plain and cached) agree with the token path.
        assert_eq!(tokenizer.tokenize_ids(text), expected_ids, "{text:?}");
        assert_eq!(
            tokenizer.tokenize_ids_cached(text, &mut cache),
            expected_ids,
            "{text:?}"
        );
        if tokens != expected || tokenizer.convert_tokens_to_ids(&tokens) != expected_ids {
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
