//! `create_pretraining_data.py` compatibility: on `bert/sample_text.txt` with the reference's
//! flags and seed, the instances equal the reference script's, one for one, in order.

use bertkit_records::instances::{InstanceOptions, VocabIds, create_instances_google_with};
use bertkit_records::pyrandom::PyRandom;
use bertkit_test_support::require;
use bertkit_tokenizer::FullTokenizer;

fn check(reference_dir: &str, words_drawn: u64) {
    let params: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(require(format!("reference/{reference_dir}/params.json")))
            .unwrap(),
    )
    .unwrap();
    let options = InstanceOptions {
        max_seq_length: params["max_seq_length"].as_u64().unwrap() as usize,
        max_predictions_per_seq: params["max_predictions_per_seq"].as_u64().unwrap() as usize,
        masked_lm_prob: params["masked_lm_prob"].as_f64().unwrap(),
        short_seq_prob: params["short_seq_prob"].as_f64().unwrap(),
        dupe_factor: params["dupe_factor"].as_u64().unwrap() as usize,
        whole_word_mask: params["do_whole_word_mask"].as_bool().unwrap(),
        seed: params["random_seed"].as_u64().unwrap(),
    };
    let tokenizer = FullTokenizer::from_vocab_file(&require("minilm/vocab.txt"), true).unwrap();
    // The production reader (what `bertkit records` uses) must give the script's documents.
    let (corpus, _) =
        bertkit_records::run::read_tokenized(&require("bert/sample_text.txt"), &tokenizer).unwrap();
    assert_eq!(corpus.len(), 3);
    let mut rng = PyRandom::new(options.seed);
    let vocab = VocabIds::new(&tokenizer).unwrap();
    let instances = create_instances_google_with(&corpus, &vocab, &options, &mut rng);
    // The exact number of MT19937 words the reference run drew (REFERENCE.md).
    assert_eq!(rng.words, words_drawn);

    let expected: Vec<serde_json::Value> = std::fs::read_to_string(require(format!(
        "reference/{reference_dir}/instances.jsonl"
    )))
    .unwrap()
    .lines()
    .map(|l| serde_json::from_str(l).unwrap())
    .collect();
    assert_eq!(
        instances.len(),
        params["num_instances"].as_u64().unwrap() as usize
    );
    assert_eq!(instances.len(), expected.len());
    for (n, (got, want)) in instances.to_vec().iter().zip(&expected).enumerate() {
        let got_json = got.as_ref().to_reference_json(&tokenizer);
        for key in [
            "tokens",
            "segment_ids",
            "is_random_next",
            "masked_lm_positions",
            "masked_lm_labels",
        ] {
            assert_eq!(
                got_json[key], want[key],
                "{reference_dir}: instance {n}, {key}"
            );
        }
        let ids: Vec<u32> = serde_json::from_value(want["input_ids"].clone()).unwrap();
        let masked: Vec<u32> = serde_json::from_value(want["masked_lm_ids"].clone()).unwrap();
        assert_eq!(got.input_ids, ids, "{reference_dir}: instance {n} ids");
        assert_eq!(
            got.masked_lm_ids, masked,
            "{reference_dir}: instance {n} masked ids"
        );
    }
}

#[test]
fn sample_text_msl128_matches_the_reference_instance_for_instance() {
    check("cpd_sample_text_msl128", 8248);
}

#[test]
fn sample_text_msl128_whole_word_mask_matches_the_reference_instance_for_instance() {
    check("cpd_sample_text_msl128_wwm", 7775);
}
