//! 50 optimiser steps against PyTorch: the same small BERT (every parameter set to the shared
//! reference values), the same batches, dropout 0, AdamW and LAMB, in f64 and f32. Every
//! step's loss and gradient norm and every parameter's final norm must agree with the run
//! `fixtures/trajectory/make_reference.py` made with transformers' `BertForPreTraining`,
//! `torch.optim.AdamW` and a small implementation of NVIDIA's LAMB (its README says how).
//!
//! bertkit's side runs what training runs: the model in training mode, each step's batch as two
//! micro-batches through [`Step`] (losses normalised by the step's masked tokens and sequences,
//! as the trainer does), clipping and the update in [`Optimizer`], the rates from [`Schedule`].

use std::collections::BTreeMap;
use std::sync::Arc;

use bertkit_model::bert::{BertForPreTraining, init};
use bertkit_model::kernels::{Composed, Kernels};
use bertkit_model::{BertConfig, DropoutSource, Inputs, MaskedPositions, Mode, loss};
use bertkit_test_support::{reference_values, repo_root};
use bertkit_train::optim::{Optimizer, OptimizerConfig, Rule};
use bertkit_train::schedule::{Decay, Schedule};
use bertkit_train::step::{Local, Step};
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

#[derive(Deserialize)]
struct Batch {
    input_ids: Vec<Vec<u32>>,
    segment_ids: Vec<Vec<u32>>,
    attention_mask: Vec<Vec<u32>>,
    masked_positions: Vec<Vec<u32>>,
    masked_ids: Vec<Vec<u32>>,
    masked_weights: Vec<Vec<f64>>,
    nsp_labels: Vec<u32>,
}

#[derive(Deserialize)]
struct Run {
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    lrs: Vec<f64>,
    final_norms: BTreeMap<String, f64>,
}

#[derive(Deserialize)]
struct ScheduleRef {
    lr: f64,
    warmup: f64,
    power: f64,
    total_steps: u64,
}

#[derive(Deserialize)]
struct Reference {
    config: serde_json::Value,
    optimizer: serde_json::Value,
    schedules: BTreeMap<String, ScheduleRef>,
    batches: Vec<Batch>,
    runs: BTreeMap<String, Run>,
}

fn reference() -> Reference {
    let path = repo_root().join("crates/train/tests/fixtures/trajectory/trajectory.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// candle's GELU backward writes 1/√(2π) as 0.398942 (candle-core 0.11 `backprop.rs`), a
/// relative error of 7e-7 in one term of the derivative: the one place bertkit's f64 gradients
/// differ from PyTorch's beyond rounding (~1e-8 relative in the gradient norms). These
/// kernels compute GELU as `x·(1 + erf(x/√2))/2`, whose ops' backward passes are exact, so the
/// f64 comparison can pin everything else to rounding.
#[derive(Debug)]
struct ExactGelu;

impl Kernels for ExactGelu {
    fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> candle_core::Result<Tensor> {
        Composed.layer_norm(x, weight, bias, eps)
    }
    fn gelu(&self, x: &Tensor, _form: bertkit_model::Gelu) -> candle_core::Result<Tensor> {
        let cdf = (x / std::f64::consts::SQRT_2)?.erf()?.affine(0.5, 0.5)?;
        x * cdf
    }
    fn softmax_last_dim(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Composed.softmax_last_dim(x)
    }
}

/// Rows `rows` of `b` as one micro-batch on the CPU: inputs, masked positions, labels,
/// weights, next-sentence labels.
fn micro_batch(
    config: &BertConfig,
    b: &Batch,
    rows: std::ops::Range<usize>,
) -> (Inputs, MaskedPositions, Tensor, Tensor, Tensor) {
    let n = rows.len();
    let seq = b.input_ids[0].len();
    let predictions = b.masked_positions[0].len();
    let flat = |v: &[Vec<u32>]| v[rows.clone()].concat();
    let cpu = &Device::Cpu;
    let inputs = Inputs::from_host(
        config,
        (n, seq),
        &flat(&b.input_ids),
        Some(&flat(&b.segment_ids)),
        Some(&flat(&b.attention_mask)),
        cpu,
    )
    .unwrap();
    let positions =
        MaskedPositions::from_host((n, predictions), &flat(&b.masked_positions), seq, cpu).unwrap();
    let labels = loss::labels(&flat(&b.masked_ids), config.vocab_size, "labels", cpu).unwrap();
    let weights: Vec<f64> = b.masked_weights[rows.clone()].concat();
    let weights = Tensor::from_vec(weights, n * predictions, cpu).unwrap();
    let nsp = loss::labels(&b.nsp_labels[rows], 2, "nsp", cpu).unwrap();
    (inputs, positions, labels, weights, nsp)
}

/// Relative difference, against 1 for values near 0.
fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1.0)
}

/// Runs `rule` in `dtype` over the reference batches (with [`ExactGelu`] when `exact_gelu`);
/// returns the largest relative differences of the losses, the gradient norms and the final
/// parameter norms.
fn trajectory(rule: Rule, dtype: DType, exact_gelu: bool) -> (f64, f64, f64) {
    let r = reference();
    let key = match rule {
        Rule::Lamb => "lamb",
        Rule::Adamw => "adamw",
    };
    let run = &r.runs[&format!("{key}_{}", if dtype == DType::F64 { "f64" } else { "f32" })];
    let c = &r.config;
    let int = |k: &str| c[k].as_u64().unwrap() as usize;
    let config = BertConfig {
        vocab_size: int("vocab_size"),
        hidden_size: int("hidden_size"),
        num_hidden_layers: int("num_hidden_layers"),
        num_attention_heads: int("num_attention_heads"),
        intermediate_size: int("intermediate_size"),
        max_position_embeddings: int("max_position_embeddings"),
        hidden_dropout_prob: 0.0,
        attention_probs_dropout_prob: 0.0,
        ..BertConfig::tiny(2)
    };
    let mut loaded = init::<BertForPreTraining>(&config, dtype, &Device::Cpu, 0).unwrap();
    if exact_gelu {
        loaded.model.bert.set_kernels(Arc::new(ExactGelu));
    }
    for (name, var) in loaded.params.vars() {
        let values = reference_values(name, var.elem_count());
        let t = Tensor::from_vec(values, var.dims(), &Device::Cpu).unwrap();
        var.set(&t.to_dtype(var.dtype()).unwrap()).unwrap();
    }
    let o = &r.optimizer;
    let optimizer_config = OptimizerConfig {
        rule,
        beta1: o["beta1"].as_f64().unwrap(),
        beta2: o["beta2"].as_f64().unwrap(),
        eps: o["eps"].as_f64().unwrap(),
        weight_decay: o["weight_decay"].as_f64().unwrap(),
        max_grad_norm: o["max_grad_norm"].as_f64().unwrap(),
    };
    let mut optimizer = Optimizer::new(optimizer_config, loaded.params.vars()).unwrap();
    let s = &r.schedules[key];
    let schedule = Schedule {
        lr: s.lr,
        warmup: s.warmup,
        total_steps: s.total_steps,
        decay: if s.power == 1.0 {
            Decay::Linear
        } else {
            Decay::Poly
        },
        power: s.power,
    };
    let dropout = DropoutSource::new(0);
    let (mut loss_diff, mut norm_diff) = (0f64, 0f64);
    for (i, (want_loss, want_norm)) in run.losses.iter().zip(&run.grad_norms).enumerate() {
        let b = &r.batches[i % r.batches.len()];
        let lr = schedule.lr_at(i as u64);
        assert!(
            rel(lr, run.lrs[i]) < 1e-14,
            "step {i}: lr {lr} vs {}",
            run.lrs[i]
        );
        let masked: f64 = b.masked_weights.iter().flatten().sum();
        let sequences = b.nsp_labels.len() as f64;
        let mut step = Step::begin(loaded.params.vars(), &optimizer, None);
        for rows in [0..2, 2..sequences as usize] {
            let (inputs, positions, labels, weights, nsp) = micro_batch(&config, b, rows);
            let out = loaded
                .model
                .forward(&inputs, &positions, Mode::Train(&dropout))
                .unwrap();
            let (bs, p, v) = out.mlm_logits.dims3().unwrap();
            let nll =
                loss::nll_per_row(&out.mlm_logits.reshape((bs * p, v)).unwrap(), &labels).unwrap();
            let mlm = (&nll * weights.to_dtype(nll.dtype()).unwrap())
                .unwrap()
                .sum_all()
                .unwrap();
            let nsp = loss::nll_per_row(&out.nsp_logits, &nsp)
                .unwrap()
                .sum_all()
                .unwrap();
            let micro = ((mlm / masked).unwrap() + (nsp / sequences).unwrap()).unwrap();
            step.backward(&micro).unwrap();
        }
        let outcome = step
            .finish(&Local, &mut optimizer, None, lr, i as u64 + 1)
            .unwrap();
        assert!(outcome.applied);
        loss_diff = loss_diff.max(rel(outcome.loss, *want_loss));
        norm_diff = norm_diff.max(rel(outcome.grad_norm, *want_norm));
    }
    let mut final_diff = 0f64;
    let masters = optimizer.master_tensors().unwrap();
    assert_eq!(masters.len(), run.final_norms.len());
    for (name, want) in &run.final_norms {
        let norm = masters[name]
            .to_dtype(DType::F64)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        final_diff = final_diff.max(rel(norm, *want));
    }
    eprintln!(
        "{key} {dtype:?} (exact GELU backward: {exact_gelu}): losses {loss_diff:.1e}, gradient norms {norm_diff:.1e}, final parameter norms {final_diff:.1e} (relative)"
    );
    (loss_diff, norm_diff, final_diff)
}

/// Runs `rule` in `dtype` and checks every difference against `bound`.
fn check(rule: Rule, dtype: DType, exact_gelu: bool, bound: f64) {
    let (losses, norms, finals) = trajectory(rule, dtype, exact_gelu);
    assert!(
        losses < bound && norms < bound && finals < bound,
        "{rule:?} {dtype:?} (exact GELU: {exact_gelu}): losses {losses:e}, gradient norms {norms:e}, final norms {finals:e} against {bound:e}"
    );
}

/// The bounds: f32 as shipped within 2e-6 of PyTorch's f32 run (both round at every op,
/// differently; measured 1.9e-7); f64 as shipped within 1e-7 (candle's GELU constant, see
/// [`ExactGelu`]; measured 1.6e-8); f64 with an exact GELU backward within 1e-12 (measured
/// 4e-15: rounding alone). (Tried: the bias correction with the step count stuck at 1, LAMB's
/// trust ratio applied to the parameters without weight decay too, clipping skipped: each
/// fails the f64 check by 7e-3 or more.)
fn check_all(rule: Rule) {
    check(rule, DType::F64, true, 1e-12);
    check(rule, DType::F64, false, 1e-7);
    check(rule, DType::F32, false, 2e-6);
}

#[test]
fn adamw_follows_pytorch_for_50_steps() {
    check_all(Rule::Adamw);
}

#[test]
fn lamb_follows_nvidias_lamb_in_pytorch_for_50_steps() {
    check_all(Rule::Lamb);
}

#[test]
fn the_fixtures_carry_their_sha256_in_their_readmes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    assert_eq!(bertkit_test_support::check_fixture_digests(&root), 1);
}
