//! Gradients really flow: a pre-training loss reaches every parameter, embeddings included, and
//! the hand-composed ops (LayerNorm, attention with padding, GELU, the MLM and NSP losses)
//! agree with finite differences in f64.

use bertkit_model::bert::{BertForPreTraining, init};
use bertkit_model::kernels::{Composed, Fused, Kernels, fused_calls_on_this_thread};
use bertkit_model::{
    BertConfig, DropoutSource, Gelu, Inputs, MaskedPositions, Mode, Packing, loss,
};
use candle_core::{DType, Device, Tensor, Var};

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

fn tensor(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(values(n, seed), shape, &Device::Cpu).unwrap()
}

#[test]
fn a_pretraining_loss_reaches_every_parameter() {
    let config = BertConfig::tiny(60);
    let loaded = init::<BertForPreTraining>(&config, DType::F32, &Device::Cpu, 7).unwrap();
    let ids = Tensor::new(
        &[
            [2u32, 11, 12, 13, 3, 21, 22, 3, 0, 0],
            [2, 31, 32, 33, 34, 35, 3, 41, 42, 3],
            [2, 51, 52, 3, 53, 54, 55, 56, 57, 3],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let types = Tensor::new(
        &[
            [0u32, 0, 0, 0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
            [0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let mask = Tensor::new(
        &[
            [1u32, 1, 1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let inputs = Inputs::new(&config, &ids, Some(&types), Some(&mask)).unwrap();
    let positions =
        MaskedPositions::from_host((3, 3), &[1, 6, 0, 2, 4, 8, 1, 5, 7], 10, &Device::Cpu).unwrap();
    let labels = Tensor::new(&[[11u32, 22, 0], [32, 34, 42], [51, 55, 57]], &Device::Cpu).unwrap();
    let weights = Tensor::new(&[[1f32, 1., 0.], [1., 1., 1.], [1., 1., 1.]], &Device::Cpu).unwrap();
    let nsp_labels = Tensor::new(&[0u32, 1, 0], &Device::Cpu).unwrap();

    let out = loaded
        .model
        .forward(&inputs, &positions, Mode::Train(&DropoutSource::new(1)))
        .unwrap();
    assert_eq!(out.mlm_logits.dims(), &[3, 3, 60]);
    assert_eq!(out.nsp_logits.dims(), &[3, 2]);
    let total = loss::pretraining_loss(
        &out.mlm_logits,
        &labels,
        &weights,
        &out.nsp_logits,
        &nsp_labels,
    )
    .unwrap();
    // One tensor of the logits' size in the loss's graph, the decoder's output, which the loss
    // takes as it is: each view of it between the two (the heads' reshape to `[batch,
    // predictions, vocabulary]`, the loss's back to rows, as before) costs candle's backward a
    // zeroed tensor and an addition of that size (on an H200, 164 µs each for BERT-large's
    // `[1280, 30522]` bf16 logits).
    let logits_sized = total
        .sorted_nodes()
        .iter()
        .filter(|n| {
            !n.is_variable() && n.elem_count() == 3 * 3 * 60 && n.dims().last() == Some(&60)
        })
        .count();
    assert_eq!(logits_sized, 1);
    let value = total.to_scalar::<f32>().unwrap();
    // About ln(60) + ln(2) at initialisation.
    assert!((value - (60f32.ln() + 2f32.ln())).abs() < 1.0, "{value}");
    // Exactly, by hand in f64 from the logits: the masked-LM cross-entropy of the 8 real slots
    // (weight 1; the padding slot has weight 0) over Σ weights, plus the mean next-sentence
    // cross-entropy. Dividing by the 9 slots instead would make the masked-LM term 11% smaller
    // (tried in `loss::masked_lm_loss`: this assertion fails, the ±1.0 one above does not).
    let nll = |row: &[f32], label: u32| {
        let max = row.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
        let sum: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
        max + sum.ln() - f64::from(row[label as usize])
    };
    let mlm = out.mlm_logits.to_vec3::<f32>().unwrap();
    let (labels_v, weights_v) = (
        labels.to_vec2::<u32>().unwrap(),
        weights.to_vec2::<f32>().unwrap(),
    );
    let (mut weighted, mut weight_sum) = (0f64, 0f64);
    for b in 0..3 {
        for p in 0..3 {
            let w = f64::from(weights_v[b][p]);
            weighted += w * nll(&mlm[b][p], labels_v[b][p]);
            weight_sum += w;
        }
    }
    assert_eq!(weight_sum, 8.0);
    let nsp = out.nsp_logits.to_vec2::<f32>().unwrap();
    let nsp_mean = [0u32, 1, 0]
        .iter()
        .enumerate()
        .map(|(b, &l)| nll(&nsp[b], l))
        .sum::<f64>()
        / 3.0;
    let by_hand = weighted / (weight_sum + 1e-5) + nsp_mean;
    assert!(
        (f64::from(value) - by_hand).abs() < 1e-5 * by_hand,
        "loss {value}, by hand {by_hand}"
    );
    let mlm_only = loss::masked_lm_loss(&out.mlm_logits, &labels, &weights)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        (f64::from(mlm_only) - weighted / (weight_sum + 1e-5)).abs() < 1e-5 * by_hand,
        "masked-LM loss {mlm_only}"
    );
    let grads = total.backward().unwrap();

    let vars = loaded.params.vars();
    // 5 embedding tensors + 16 per layer + pooler 2 + heads 7.
    assert_eq!(vars.len(), 5 + 16 * 2 + 2 + 7);
    let mut failures = Vec::new();
    for (name, var) in vars {
        match grads.get(var.as_tensor()) {
            None => failures.push(format!("{name}: no gradient")),
            Some(g) => {
                let g = g.to_dtype(DType::F64).unwrap();
                let sum_abs = g
                    .abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                if !sum_abs.is_finite() || sum_abs == 0.0 {
                    failures.push(format!("{name}: gradient |sum| = {sum_abs}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Checks d(sum(f(x) * r))/dx against central differences, for each input of `f`.
fn finite_difference_check(inputs: &[Tensor], f: &dyn Fn(&[Tensor]) -> Tensor) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&tensors);
    let r = tensor(out.dims(), 99);
    let objective = |ts: &[Tensor]| -> f64 {
        (f(ts) * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let grads = (out * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let h = 1e-6;
    for (i, var) in vars.iter().enumerate() {
        let analytic: Vec<f64> = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("input {i}: no gradient"))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let base: Vec<f64> = inputs[i].flatten_all().unwrap().to_vec1().unwrap();
        for j in 0..base.len() {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                let mut ts = inputs.to_vec();
                ts[i] = Tensor::from_vec(v, inputs[i].dims(), &Device::Cpu).unwrap();
                objective(&ts)
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            let err = (numeric - analytic[j]).abs();
            assert!(
                err <= 1e-6 + 1e-5 * numeric.abs(),
                "input {i}[{j}]: analytic {} vs numeric {numeric}",
                analytic[j]
            );
        }
    }
}

#[test]
fn layer_norm_matches_finite_differences() {
    finite_difference_check(
        &[tensor(&[3, 5], 1), tensor(&[5], 2), tensor(&[5], 3)],
        &|t| Composed.layer_norm(&t[0], &t[1], &t[2], 1e-12).unwrap(),
    );
}

#[test]
fn masked_attention_matches_finite_differences() {
    // Two sequences of 4 positions, 2 heads of 3 (queries, keys and values side by side):
    // the first pads its last position.
    let packing = Packing::from_mask((2, 4), &[1, 1, 1, 0, 1, 1, 1, 1], &Device::Cpu).unwrap();
    finite_difference_check(&[tensor(&[7, 18], 4)], &|t| {
        Composed
            .attention(&t[0], &packing, 2, Mode::Eval, 0.0)
            .unwrap()
    });
    finite_difference_check(&[tensor(&[2, 7], 7)], &|t| {
        Composed.softmax_last_dim(&t[0]).unwrap()
    });
}

#[test]
fn tanh_gelu_matches_finite_differences_and_googles_formula() {
    let x = (tensor(&[11], 9) * 3.0).unwrap();
    finite_difference_check(std::slice::from_ref(&x), &|t| {
        Composed.gelu(&t[0], Gelu::Tanh).unwrap()
    });
    // Google's modeling.py: x · 0.5 · (1 + tanh(√(2/π) · (x + 0.044715 x³))).
    let points = [-6.0f64, -1.0, -0.1, 0.0, 0.5, 2.0, 7.5];
    let google = |x: f64| {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3));
        x * 0.5 * (1.0 + u.tanh())
    };
    let input = Tensor::new(&points, &Device::Cpu).unwrap();
    let composed: Vec<f64> = Composed
        .gelu(&input, Gelu::Tanh)
        .unwrap()
        .to_vec1()
        .unwrap();
    let fused: Vec<f32> = Fused::default()
        .gelu(&input.to_dtype(DType::F32).unwrap(), Gelu::Tanh)
        .unwrap()
        .to_vec1()
        .unwrap();
    for ((&x, c), f) in points.iter().zip(&composed).zip(&fused) {
        let want = google(x);
        assert!((c - want).abs() <= 1e-12, "{x}: composed {c} vs {want}");
        assert!(
            (*f as f64 - want).abs() <= 2e-7 * want.abs().max(1e-3),
            "{x}: fused {f} vs {want}"
        );
    }
    // The forms differ (by ~1e-3 near ±2): a model must keep the one it was trained with.
    let erf: Vec<f64> = Composed.gelu(&input, Gelu::Erf).unwrap().to_vec1().unwrap();
    assert!(composed.iter().zip(&erf).any(|(t, e)| (t - e).abs() > 1e-4));
}

#[test]
fn gelu_matches_finite_differences_and_the_erf_formula() {
    let x = (tensor(&[11], 8) * 3.0).unwrap();
    finite_difference_check(std::slice::from_ref(&x), &|t| {
        Composed.gelu(&t[0], Gelu::Erf).unwrap()
    });
    // Exact GELU at a few points: x * Φ(x).
    let y: Vec<f64> = Composed
        .gelu(
            &Tensor::new(&[-1f64, 0.5, 2.0], &Device::Cpu).unwrap(),
            Gelu::Erf,
        )
        .unwrap()
        .to_vec1()
        .unwrap();
    for (got, want) in y.iter().zip([
        -0.15865525393145707,
        0.34573123063700656,
        1.9544997361036416,
    ]) {
        assert!((got - want).abs() < 1e-7, "{got} vs {want}");
    }
}

/// The fused CPU kernels (f32, forward and backward each one op of ours) against the composed
/// reference in f64: values, and the gradient of `sum(f(x) · r)` for every input against
/// central differences of the f64 reference. `fused` is the count of fused LayerNorm/softmax
/// calls `f` makes, checked so the fused path is the one measured.
fn fused_against_f64(inputs: &[Tensor], fused: u64, f: &dyn Fn(&dyn Kernels, &[Tensor]) -> Tensor) {
    let to = |t: &Tensor, dtype| t.to_dtype(dtype).unwrap();
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&to(t, DType::F32)).unwrap())
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let before = fused_calls_on_this_thread();
    let out = f(&Fused::default(), &tensors);
    assert_eq!(fused_calls_on_this_thread() - before, fused);
    assert_eq!(out.dtype(), DType::F32);
    let reference = f(&Composed, inputs);
    let scale = reference
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let diff = (to(&out, DType::F64) - &reference)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert!(
        diff <= 1e-6 * scale.max(1.0),
        "values: {diff:e} (scale {scale})"
    );

    let r = tensor(out.dims(), 99);
    let grads = (out * to(&r, DType::F32))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let objective = |ts: &[Tensor]| -> f64 {
        (f(&Composed, ts) * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let h = 1e-6;
    for (i, var) in vars.iter().enumerate() {
        let analytic: Vec<f32> = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("input {i}: no gradient"))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let base: Vec<f64> = inputs[i].flatten_all().unwrap().to_vec1().unwrap();
        let numeric: Vec<f64> = (0..base.len())
            .map(|j| {
                let at = |delta: f64| {
                    let mut v = base.clone();
                    v[j] += delta;
                    let mut ts = inputs.to_vec();
                    ts[i] = Tensor::from_vec(v, inputs[i].dims(), &Device::Cpu).unwrap();
                    objective(&ts)
                };
                (at(h) - at(-h)) / (2.0 * h)
            })
            .collect();
        let largest = numeric.iter().fold(0f64, |m, x| m.max(x.abs()));
        for (j, (&a, &n)) in analytic.iter().zip(&numeric).enumerate() {
            // f32 rounding of values of about the gradient's largest.
            let err = (f64::from(a) - n).abs();
            assert!(
                err <= 2e-5 * largest.max(1e-3) + 1e-5 * n.abs(),
                "input {i}[{j}]: fused {a} vs numeric {n} (largest {largest})"
            );
        }
    }
}

#[test]
fn the_fused_cpu_kernels_match_the_f64_reference_and_finite_differences() {
    // LayerNorm with rows of 37 (not a multiple of the 16 vector lanes) and a row far from 0.
    let x = (tensor(&[6, 37], 11) * 3.0).unwrap();
    let x = (x.clone()
        + Tensor::new(&[[50f64], [0.], [0.], [-2.], [0.], [1.]], &Device::Cpu)
            .unwrap()
            .broadcast_as((6, 37))
            .unwrap())
    .unwrap();
    fused_against_f64(
        &[x, (tensor(&[37], 12) + 1.0).unwrap(), tensor(&[37], 13)],
        1,
        &|k, t| k.layer_norm(&t[0], &t[1], &t[2], 1e-12).unwrap(),
    );
    // Attention of a packed batch: the first sequence pads its last two positions, the
    // second has a hole at column 2 (3 heads of 4; queries, keys and values side by side).
    let packing =
        Packing::from_mask((2, 6), &[1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1], &Device::Cpu).unwrap();
    fused_against_f64(&[tensor(&[9, 36], 14)], 1, &|k, t| {
        k.attention(&t[0], &packing, 3, Mode::Eval, 0.0).unwrap()
    });
    // With attention dropout: the fused kernel applies the mask the composed ops' dropout
    // draws on the padded probabilities (a fresh source per pass, so every pass draws the
    // same masks).
    let train = |k: &dyn Kernels, t: &[Tensor]| {
        let source = DropoutSource::new(3);
        k.attention(&t[0], &packing, 3, Mode::Train(&source), 0.3)
            .unwrap()
    };
    fused_against_f64(&[tensor(&[9, 36], 18)], 1, &train);
    // A sublayer's end, LayerNorm(dropout(x) + residual), on the packed batch above, rows of
    // 37: without dropout, and with the token masks the composed dropout draws.
    let packing = &packing;
    let residual_norm = |mode: Option<u64>| {
        move |k: &dyn Kernels, t: &[Tensor]| {
            let source = DropoutSource::new(mode.unwrap_or(0));
            let mode = match mode {
                Some(_) => Mode::Train(&source),
                None => Mode::Eval,
            };
            k.residual_layer_norm(&t[0], &t[1], packing, mode, 0.3, &t[2], &t[3], 1e-12)
                .unwrap()
        }
    };
    let residual_inputs = |seed| {
        [
            (tensor(&[9, 37], seed) * 3.0).unwrap(),
            (tensor(&[9, 37], seed + 1) + 2.0).unwrap(),
            (tensor(&[37], seed + 2) + 1.0).unwrap(),
            tensor(&[37], seed + 3),
        ]
    };
    fused_against_f64(&residual_inputs(31), 1, &residual_norm(None));
    fused_against_f64(&residual_inputs(35), 1, &residual_norm(Some(5)));
    // A linear layer on a 3-d input (its rows flattened), bias added in the product.
    fused_against_f64(
        &[
            tensor(&[2, 3, 7], 21),
            tensor(&[5, 7], 22),
            tensor(&[5], 23),
        ],
        0,
        &|k, t| k.linear(&t[0], &t[1], Some(&t[2])).unwrap(),
    );
    // The negative log-likelihood (the masked-LM and next-sentence losses' core), logits of
    // rows of 37 classes.
    let labels = Tensor::new(&[3u32, 0, 36, 17], &Device::Cpu).unwrap();
    fused_against_f64(&[(tensor(&[4, 37], 24) * 4.0).unwrap()], 0, &|_, t| {
        loss::nll_per_row(&t[0], &labels).unwrap()
    });
    // A linear layer followed by GELU (one op of ours, the pre-activation kept).
    fused_against_f64(
        &[
            (tensor(&[2, 3, 7], 25) * 2.0).unwrap(),
            tensor(&[5, 7], 26),
            tensor(&[5], 27),
        ],
        0,
        &|k, t| k.linear_gelu(&t[0], &t[1], Some(&t[2]), Gelu::Erf).unwrap(),
    );
    // GELU over both tails and the middle, in both forms, and fused into the linear layer.
    for form in [Gelu::Erf, Gelu::Tanh] {
        fused_against_f64(&[(tensor(&[5, 41], 17) * 6.0).unwrap()], 0, &|k, t| {
            k.gelu(&t[0], form).unwrap()
        });
    }
    fused_against_f64(
        &[
            (tensor(&[2, 3, 7], 28) * 2.0).unwrap(),
            tensor(&[5, 7], 29),
            tensor(&[5], 30),
        ],
        0,
        &|k, t| {
            k.linear_gelu(&t[0], &t[1], Some(&t[2]), Gelu::Tanh)
                .unwrap()
        },
    );
    // A feed-forward block: the second layer's op applies GELU to the first product itself
    // (one op of ours, its activation recomputed in the backward pass).
    for (form, seed) in [(Gelu::Erf, 50), (Gelu::Tanh, 55)] {
        fused_against_f64(
            &[
                (tensor(&[2, 3, 7], seed) * 2.0).unwrap(),
                tensor(&[9, 7], seed + 1),
                tensor(&[9], seed + 2),
                tensor(&[6, 9], seed + 3),
                tensor(&[6], seed + 4),
            ],
            0,
            &|k, t| {
                k.feed_forward(&t[0], (&t[1], Some(&t[2])), (&t[3], Some(&t[4])), form)
                    .unwrap()
            },
        );
    }
}

/// `f(inputs)`'s values and the gradients of `sum(f · r)` for every input, in f32.
fn values_and_gradients(inputs: &[Tensor], f: &dyn Fn(&[Tensor]) -> Tensor) -> Vec<Vec<u32>> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(DType::F32).unwrap()).unwrap())
        .collect();
    let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&t);
    let r = tensor(out.dims(), 45).to_dtype(DType::F32).unwrap();
    let grads = (&out * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let bits = |t: &Tensor| {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    };
    let mut all = vec![bits(&out)];
    for v in &vars {
        all.push(bits(
            grads
                .get(v.as_tensor())
                .expect("a gradient for every input"),
        ));
    }
    all
}

/// The fused CPU ops that replaced a chain of ops compute what the chain does to the bit,
/// values and gradients, so fusing them changed no training run: a sublayer's end (the dropout
/// op, candle's addition, the fused LayerNorm), with and without dropout, the linear layer
/// with GELU (also on the inference path, which keeps no pre-activation), and the
/// feed-forward block that keeps only its first product.
#[test]
fn fused_chains_are_their_parts_to_the_bit() {
    let cpu = &Device::Cpu;
    let packing = Packing::from_mask(
        (2, 8),
        &[1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
        cpu,
    )
    .unwrap();
    let inputs = [
        tensor(&[13, 48], 41),
        (tensor(&[13, 48], 42) * 5.0).unwrap(),
        (tensor(&[48], 43) + 1.0).unwrap(),
        tensor(&[48], 44),
    ];
    for p in [0.0, 0.1] {
        let run = |fused: bool| {
            values_and_gradients(&inputs, &|t| {
                let source = DropoutSource::new(9);
                let mode = Mode::Train(&source);
                if fused {
                    Fused::default()
                        .residual_layer_norm(&t[0], &t[1], &packing, mode, p, &t[2], &t[3], 1e-12)
                        .unwrap()
                } else {
                    let dropped = mode.dropout_tokens(&t[0], p, &packing).unwrap();
                    Fused::default()
                        .layer_norm(&(dropped + &t[1]).unwrap(), &t[2], &t[3], 1e-12)
                        .unwrap()
                }
            })
        };
        let fused = run(true);
        assert_eq!(fused, run(false), "residual norm, p = {p}");
        if p > 0.0 {
            // The mask dropped something, and the dropped elements pass no gradient.
            assert!(
                fused[1]
                    .iter()
                    .filter(|&&g| f32::from_bits(g) == 0.0)
                    .count()
                    > 20
            );
        }
    }

    let inputs = [
        (tensor(&[3, 5, 24], 46) * 3.0).unwrap(),
        tensor(&[40, 24], 47),
        tensor(&[40], 48),
    ];
    for form in [Gelu::Erf, Gelu::Tanh] {
        let fused = values_and_gradients(&inputs, &|t| {
            Fused::default()
                .linear_gelu(&t[0], &t[1], Some(&t[2]), form)
                .unwrap()
        });
        let parts = values_and_gradients(&inputs, &|t| {
            Fused::default()
                .gelu(
                    &Fused::default().linear(&t[0], &t[1], Some(&t[2])).unwrap(),
                    form,
                )
                .unwrap()
        });
        assert_eq!(fused, parts, "linear + GELU ({form:?})");
        let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let inference = Fused::default()
            .linear_gelu(
                &f32(&inputs[0]),
                &f32(&inputs[1]),
                Some(&f32(&inputs[2])),
                form,
            )
            .unwrap();
        let bits: Vec<u32> = inference
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(bits, fused[0], "linear + GELU in place ({form:?})");
    }

    // The feed-forward block that keeps the first product alone computes what linear + GELU
    // then linear compute, values and every gradient.
    let inputs = [
        (tensor(&[3, 5, 24], 49) * 3.0).unwrap(),
        tensor(&[40, 24], 50),
        tensor(&[40], 51),
        tensor(&[24, 40], 52),
        tensor(&[24], 53),
    ];
    for form in [Gelu::Erf, Gelu::Tanh] {
        let lean = values_and_gradients(&inputs, &|t| {
            Fused::default()
                .feed_forward(&t[0], (&t[1], Some(&t[2])), (&t[3], Some(&t[4])), form)
                .unwrap()
        });
        let pair = values_and_gradients(&inputs, &|t| {
            let inner = Fused::default()
                .linear_gelu(&t[0], &t[1], Some(&t[2]), form)
                .unwrap();
            Fused::default().linear(&inner, &t[3], Some(&t[4])).unwrap()
        });
        assert_eq!(lean, pair, "feed-forward ({form:?})");
    }
}

#[test]
fn the_losses_match_finite_differences() {
    let labels = Tensor::new(&[[1u32, 4, 0], [5, 2, 3]], &Device::Cpu).unwrap();
    let weights = Tensor::new(&[[1f64, 1., 0.], [1., 1., 1.]], &Device::Cpu).unwrap();
    finite_difference_check(&[tensor(&[2, 3, 6], 9)], &|t| {
        loss::masked_lm_loss(&t[0], &labels, &weights).unwrap()
    });
    let nsp = Tensor::new(&[0u32, 1, 1], &Device::Cpu).unwrap();
    finite_difference_check(&[tensor(&[3, 2], 10)], &|t| {
        loss::cross_entropy(&t[0], &nsp).unwrap()
    });
    // The padded prediction slot (weight 0) does not count.
    let logits = tensor(&[2, 3, 6], 9);
    let a = loss::masked_lm_loss(&logits, &labels, &weights)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let other_labels = Tensor::new(&[[1u32, 4, 5], [5, 2, 3]], &Device::Cpu).unwrap();
    let b = loss::masked_lm_loss(&logits, &other_labels, &weights)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert_eq!(a, b);
}

/// The embedding tables stay f32 in a bf16 model, so the gradient of a row that thousands of
/// tokens look up (here one id at all 4096 positions of a batch, as `[CLS]` or "the") adds up
/// in f32: it equals the f64 model's within half a bf16 step of the row's largest value.
/// (Tried: with the tables in bf16, candle's `index_add` sums the 4096 terms serially in bf16
/// and the row's gradient is off by far more; this fails.)
#[test]
fn a_bf16_models_embedding_gradients_add_up_in_f32() {
    use bertkit_model::BertModel;
    use bertkit_model::bert::{load, save};
    let config = BertConfig::tiny(60);
    let (batch, seq) = (64, 64);
    let dir = tempfile::tempdir().unwrap();
    // One set of weights both models hold exactly: bf16 values (tables f32), written as f32.
    let made = init::<BertModel>(&config, DType::BF16, &Device::Cpu, 3).unwrap();
    assert_eq!(made.model.word_embeddings().dtype(), DType::F32);
    save(&made, dir.path(), DType::F32).unwrap();
    // An upstream gradient exact in bf16.
    let upstream: Vec<f64> = Tensor::new(values(batch * seq * 32, 9), &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::BF16))
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1())
        .unwrap();
    let gradient = |dtype: DType| -> Vec<Vec<f64>> {
        let loaded = load::<BertModel>(dir.path(), dtype, &Device::Cpu, 0).unwrap();
        let ids = vec![7u32; batch * seq];
        let inputs =
            Inputs::from_host(&config, (batch, seq), &ids, None, None, &Device::Cpu).unwrap();
        let out = loaded.model.embed(&inputs, Mode::Eval).unwrap();
        assert_eq!(out.dtype(), dtype);
        let c = Tensor::from_vec(upstream.clone(), (batch * seq, 32), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let grads = (out * c).unwrap().sum_all().unwrap().backward().unwrap();
        let row = |name: &str, row: usize| -> Vec<f64> {
            let var = loaded.params.get(name).unwrap();
            grads
                .get(var.as_tensor())
                .unwrap()
                .get(row)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        vec![
            row("embeddings.word_embeddings.weight", 7),
            row("embeddings.token_type_embeddings.weight", 0),
            row("embeddings.position_embeddings.weight", 5),
        ]
    };
    let (low, exact) = (gradient(DType::BF16), gradient(DType::F64));
    for ((got, want), name) in low
        .iter()
        .zip(&exact)
        .zip(["word 7", "segment 0", "position 5"])
    {
        let largest = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert!(largest > 0.0);
        let tolerance = largest * 2f64.powi(-9);
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= tolerance,
                "{name}: {g} vs {w} (tolerance {tolerance:.3e})"
            );
        }
    }
}

/// A linear layer asked to hand its weight's gradient over (`Kernels::linear_into`, the tied
/// masked-LM decoder's): the fused CPU kernel gives the same output and hands over the
/// gradient the graph would hold, to the bit, leaving none in the graph; candle's ops (the
/// default) keep it in the graph and the sink empty.
#[test]
fn a_linear_layer_hands_its_weights_gradient_over() {
    let x = Var::from_tensor(&tensor(&[5, 8], 31).to_dtype(DType::F32).unwrap()).unwrap();
    let w = Var::from_tensor(&tensor(&[11, 8], 32).to_dtype(DType::F32).unwrap()).unwrap();
    let b = Var::from_tensor(&tensor(&[11], 33).to_dtype(DType::F32).unwrap()).unwrap();
    let upstream = tensor(&[5, 11], 34).to_dtype(DType::F32).unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|f| f.to_bits()).collect()
    };
    let backward = |y: &Tensor| {
        (y * &upstream)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
    };
    let y = Fused::default().linear(&x, &w, Some(&b)).unwrap();
    let graph = backward(&y);
    for (kernels, hands_over) in [
        (&Fused::default() as &dyn Kernels, true),
        (&Composed, false),
    ] {
        let sink = bertkit_model::GradientSink::new(&w);
        let handed = kernels.linear_into(&x, &w, Some(&b), &sink).unwrap();
        assert_eq!(bits(&handed), bits(&y));
        let store = backward(&handed);
        for v in [&x, &b] {
            assert_eq!(bits(store.get(v).unwrap()), bits(graph.get(v).unwrap()));
        }
        let want = bits(graph.get(&w).unwrap());
        let got = match sink.take().unwrap() {
            Some((id, got)) => {
                assert_eq!(id, w.id());
                assert!(store.get(&w).is_none(), "handed over and in the graph");
                assert!(sink.take().unwrap().is_none(), "taken twice");
                got
            }
            None => store.get(&w).unwrap().clone(),
        };
        assert_eq!(bits(&got), want);
        assert_eq!(store.get(&w).is_none(), hands_over);
    }
}
