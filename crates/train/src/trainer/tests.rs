use super::*;

/// The formula against the model's products listed one by one (forward, `2·m·k·n` each;
/// training three times that). (Tried: without the sequence length in attention's term,
/// as the trainer counted before, this fails.)
#[test]
fn training_flops_count_every_product_of_the_model() {
    let c = bertkit_model::BertConfig::tiny(60);
    let (h, i, v, heads) = (32, 64, 60, c.num_attention_heads);
    let d = h / heads;
    let (seq, predictions) = (10, 3);
    let mut products: Vec<(usize, usize, usize)> = Vec::new();
    for _ in 0..c.num_hidden_layers {
        products.extend([(seq, h, h); 4]);
        products.extend([(seq, h, i), (seq, i, h)]);
        for _ in 0..heads {
            products.extend([(seq, d, seq), (seq, seq, d)]);
        }
    }
    products.extend([
        (predictions, h, h),
        (predictions, h, v),
        (1, h, h),
        (1, h, 2),
    ]);
    let forward: usize = products.iter().map(|&(m, k, n)| 2 * m * k * n).sum();
    assert_eq!(
        training_flops_per_sequence(&c, seq, predictions),
        3.0 * forward as f64
    );
}

/// A run the plan says will not fit stops before the first step, with the numbers and the
/// micro-batch that would fit; one that fits passes.
#[test]
fn a_run_that_will_not_fit_is_refused_with_a_micro_batch_that_would() {
    let recipe = bertkit_test_support::repo_root().join("pipelines/pretrain-phase1.toml");
    let config = PretrainConfig::load(&recipe).unwrap();
    let model = config.bert_config().unwrap();
    let gib = 1u64 << 30;
    // Phase 1 on an 80 GB GPU: its state (4.4 GiB) and the CUDA runtime (1.2 GiB) are
    // allocated, ~30 GiB more to go.
    assert!(check_memory(&config, &model, 128, 70 * gib, 1024).is_ok());
    let err = check_memory(&config, &model, 128, 12 * gib, 1024)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("micro-batch 256 of 128-token sequences"),
        "{err}"
    );
    assert!(err.contains("GiB free on cuda"), "{err}");
    assert!(
        err.contains("[data] micro_batch = 64 fits (accumulation 1024"),
        "{err}"
    );
    assert!(err.contains("activation_checkpointing = 1"), "{err}");
}

/// On CUDA the memory check picks the feed-forward: the full one (its activation kept)
/// where its peak fits in the plan's share of the memory, else the lean one, and a run
/// that fits only with the lean one passes with it. On the CPU there is nothing to pick.
#[test]
fn the_memory_check_keeps_the_feed_forwards_activation_where_it_fits() {
    let recipe = bertkit_test_support::repo_root().join("pipelines/pretrain-phase1.toml");
    let mut config = PretrainConfig::load(&recipe).unwrap();
    let model = config.bert_config().unwrap();
    let gib = 1u64 << 30;
    let roomy = check_memory(&config, &model, 128, 70 * gib, 1024)
        .unwrap()
        .unwrap();
    assert!(
        !roomy.lean && roomy.setting == crate::plan::FeedForward::Auto,
        "{roomy:?}"
    );
    assert!(roomy.full_peak <= roomy.usable);
    assert_eq!(roomy.prediction.total(), roomy.full_peak);
    // The full form keeps one more intermediate activation a token a layer, in bf16.
    let extra = 256.0 * 128.0 * 24.0 * 4096.0 * 2.0;
    let tight = (roomy.full_peak
        - extra / 2.0
        - roomy.prediction.state_bytes
        - roomy.prediction.runtime_bytes) as u64;
    let lean = check_memory(&config, &model, 128, tight, 1024)
        .unwrap()
        .unwrap();
    assert!(
        lean.lean && lean.setting == crate::plan::FeedForward::Auto,
        "{lean:?}"
    );
    assert!(lean.full_peak > lean.usable);
    assert!((lean.full_peak - lean.prediction.total() - extra).abs() < 1.0);
    config.train.device = "cpu".into();
    assert_eq!(
        check_memory(&config, &model, 128, 1024 * gib, 1024).unwrap(),
        None
    );
}
