//! The shared fine-tuning loop: gradient accumulation gives the same update as one big batch
//! (f64, no dropout, micro-batches padded to different lengths), and fp16 runs with loss scaling.

use bertkit_model::bert::{BertForQuestionAnswering, Loaded, init};
use bertkit_model::{BertConfig, Mode};
use bertkit_tasks::batch::pad;
use bertkit_tasks::squad::finetune::qa_loss;
use bertkit_tasks::training::{TrainLog, TrainSettings, train};
use candle_core::{DType, Device, Tensor};

struct Example {
    ids: Vec<u32>,
    segments: Vec<u32>,
    start: u32,
    end: u32,
}

fn examples(n: usize) -> Vec<Example> {
    (0..n)
        .map(|i| {
            let len = 6 + (i * 7) % 11;
            let ids: Vec<u32> = (0..len)
                .map(|j| ((i * 31 + j * 17) % 90 + 5) as u32)
                .collect();
            let segments = (0..len).map(|j| u32::from(j >= len / 2)).collect();
            let start = (i % (len - 1)) as u32;
            Example {
                ids,
                segments,
                start,
                end: start + 1,
            }
        })
        .collect()
}

fn model(dtype: DType) -> Loaded<BertForQuestionAnswering> {
    let mut config = BertConfig::tiny(100);
    config.hidden_dropout_prob = 0.0;
    config.attention_probs_dropout_prob = 0.0;
    init::<BertForQuestionAnswering>(&config, dtype, &Device::Cpu, 5).unwrap()
}

fn run(m: &Loaded<BertForQuestionAnswering>, data: &[Example], accumulation: usize) -> TrainLog {
    let settings = TrainSettings {
        epochs: 1.0,
        lr: 1e-3,
        batch: 8,
        accumulation,
        warmup: 0.0,
        seed: 9,
        max_steps: None,
        ..TrainSettings::glue()
    };
    train(
        &m.params,
        data.len(),
        &settings,
        &bertkit_train::step::Local,
        &mut |indices, mode: Mode, weight, step| {
            let seqs: Vec<(&[u32], &[u32])> = indices
                .iter()
                .map(|&i| (data[i].ids.as_slice(), data[i].segments.as_slice()))
                .collect();
            let (inputs, mask) = pad(&seqs, &m.config, &Device::Cpu)?;
            let t = |v: Vec<u32>| Tensor::from_vec(v, indices.len(), &Device::Cpu).unwrap();
            let starts = t(indices.iter().map(|&i| data[i].start).collect());
            let ends = t(indices.iter().map(|&i| data[i].end).collect());
            let qa = &m.model;
            step.through_encoder(&qa.bert, &inputs, mode, 0, |top, _| {
                let (s, e) = qa.head(top, &inputs)?;
                Ok((qa_loss(&s, &e, &mask, &starts, &ends)? * weight)?)
            })?;
            Ok(())
        },
        bertkit_tasks::training::Watch::none(),
        &mut |_| {},
    )
    .unwrap()
}

fn max_difference(
    a: &Loaded<BertForQuestionAnswering>,
    b: &Loaded<BertForQuestionAnswering>,
) -> f64 {
    let b = b.params.tensors();
    a.params
        .tensors()
        .iter()
        .map(|(name, t)| {
            (t - &b[name])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        })
        .fold(0.0, f64::max)
}

#[test]
fn accumulation_equals_one_big_batch() {
    let data = examples(16);
    let (whole, split, untouched) = (model(DType::F64), model(DType::F64), model(DType::F64));
    let a = run(&whole, &data, 1);
    let b = run(&split, &data, 3); // micro-batches of 3, 3 and 2
    assert_eq!(a.steps, 2);
    for (x, y) in a.losses.iter().zip(&b.losses) {
        assert!((x - y).abs() < 1e-10, "{x} vs {y}");
    }
    let moved = max_difference(&whole, &untouched);
    assert!(moved > 1e-4, "training moved nothing ({moved})");
    let d = max_difference(&whole, &split);
    assert!(d < 1e-10, "accumulated update differs by {d}");
}

#[test]
fn fp16_trains_with_loss_scaling() {
    let data = examples(24);
    let (m, start) = (model(DType::F16), model(DType::F16));
    let log = run(&m, &data, 2);
    assert_eq!(log.steps, 3);
    assert!(log.losses.iter().all(|l| l.is_finite()), "{:?}", log.losses);
    assert!(log.skipped < log.steps, "every fp16 step overflowed");
    assert!(max_difference(&m, &start) > 0.0);
}
