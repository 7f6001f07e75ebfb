//! Inference throughput: the encoder's forward pass at given sequence lengths and batch sizes.
//!
//! For each (sequence length, batch) the model runs two warm-up passes, then timed passes
//! until `min_seconds` have passed (at least five). Inputs are seeded pseudo-random token ids
//! (no padding). The model is loaded frozen with the fused kernels unless `composed` asks for
//! the composed reference kernels. Reported: sequences per second at the median latency, and
//! latency percentiles.
//!
//! [`forward_file`] runs a model folder on the token ids of a safetensors file and writes the
//! hidden states as transformers names them (`bertkit forward`).

use std::path::Path;
use std::time::Instant;

use bertkit_model::bert::{BertModel, load_frozen};
use bertkit_model::{Inputs, Mode};
use candle_core::{DType, Device, Tensor};

use crate::TaskError;

/// One measured setting.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRow {
    /// Sequence length.
    pub seq: usize,
    /// Batch size.
    pub batch: usize,
    /// Timed passes.
    pub runs: usize,
    /// Sequences per second at the median latency.
    pub sequences_per_s: f64,
    /// Latency percentiles, milliseconds: p50, p90, p99.
    pub latency_ms: [f64; 3],
    /// The median milliseconds the host took to issue a pass, before it waited for the result:
    /// on a GPU its launches (the device runs behind them; a pass whose issue takes as long as
    /// its latency is bound by the host, not the device), on the CPU the whole pass.
    pub issue_ms: f64,
}

/// The `q` quantile (nearest rank) of sorted `values`.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchSettings {
    /// Sequence lengths.
    pub seqs: Vec<usize>,
    /// Batch sizes.
    pub batches: Vec<usize>,
    /// Weights and activations.
    pub dtype: DType,
    /// Timed seconds per setting (at least five passes).
    pub min_seconds: f64,
    /// The composed reference kernels (candle primitives, as a model on another device trains
    /// with) instead of the fused ones.
    pub composed: bool,
}

/// Measures the forward pass of the model in `dir`.
pub fn bench(
    dir: &Path,
    settings: &BenchSettings,
    device: &Device,
    report: &mut dyn FnMut(&BenchRow),
) -> Result<Vec<BenchRow>, TaskError> {
    let BenchSettings {
        seqs,
        batches,
        dtype,
        min_seconds,
        composed,
    } = settings.clone();
    // Frozen parameters let the kernels use fused inference ops on every device; `composed`
    // measures the composed reference kernels on a trainable model instead.
    let loaded = if composed {
        let mut loaded = bertkit_model::bert::load::<BertModel>(dir, dtype, device, 0)?;
        loaded
            .model
            .set_kernels(std::sync::Arc::new(bertkit_model::Composed));
        loaded
    } else {
        load_frozen::<BertModel>(dir, dtype, device)?
    };
    let vocab = loaded.config.vocab_size as u64;
    let mut rows = Vec::new();
    for &seq in &seqs {
        for &batch in &batches {
            let mut draws = bertkit_rng::SplitMix64::new((seq * 31 + batch) as u64);
            let ids: Vec<u32> = (0..seq * batch)
                .map(|_| (1000 + draws.next_u64() % (vocab - 1000)) as u32)
                .collect();
            let inputs = Inputs::from_host(&loaded.config, (batch, seq), &ids, None, None, device)?;
            // (seconds to issue the pass, seconds to its result)
            let run = || -> Result<(f64, f64), TaskError> {
                let t = Instant::now();
                let out = loaded.model.forward(&inputs, Mode::Eval, false)?;
                let issued = t.elapsed().as_secs_f64();
                // Reading one value waits for the device to finish.
                out.last_hidden_state
                    .flatten_all()
                    .and_then(|t| t.get(0))
                    .and_then(|t| t.to_dtype(DType::F32))
                    .and_then(|t| t.to_scalar::<f32>())?;
                Ok((issued, t.elapsed().as_secs_f64()))
            };
            run()?;
            run()?;
            let started = Instant::now();
            let (mut issues, mut times) = (Vec::new(), Vec::new());
            while times.len() < 5 || started.elapsed().as_secs_f64() < min_seconds {
                let (issued, done) = run()?;
                issues.push(issued);
                times.push(done);
            }
            times.sort_by(f64::total_cmp);
            issues.sort_by(f64::total_cmp);
            let median = quantile(&times, 0.5);
            let row = BenchRow {
                seq,
                batch,
                runs: times.len(),
                sequences_per_s: batch as f64 / median,
                latency_ms: [
                    median * 1e3,
                    quantile(&times, 0.9) * 1e3,
                    quantile(&times, 0.99) * 1e3,
                ],
                issue_ms: quantile(&issues, 0.5) * 1e3,
            };
            report(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// What [`forward_file`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardSummary {
    /// Tensors written: `last_hidden_state`, `pooler_output`, `hidden_states.0…N`.
    pub tensors: usize,
    /// Sequences in the input.
    pub batch: usize,
    /// Their length.
    pub seq: usize,
    /// Encoder layers of the model.
    pub layers: usize,
    /// Parameters the model folder lacked (initialised at random).
    pub initialised: Vec<String>,
}

/// Runs the model folder `model` on `input` (a safetensors file with `input_ids` and
/// optionally `token_type_ids` and `attention_mask`, all `[batch, seq]`) and writes
/// `last_hidden_state`, `pooler_output` and `hidden_states.0…N` in f32 to `output`
/// (atomically).
pub fn forward_file(
    model: &Path,
    input: &Path,
    output: &Path,
    dtype: DType,
    device: &Device,
) -> Result<ForwardSummary, TaskError> {
    let loaded = load_frozen::<BertModel>(&crate::model_dir::resolve(model)?, dtype, device)?;
    let bad_input = |message: String| TaskError::Format {
        path: input.to_path_buf(),
        message,
    };
    let inputs =
        candle_core::safetensors::load(input, device).map_err(|e| bad_input(e.to_string()))?;
    let input_ids = inputs
        .get("input_ids")
        .ok_or_else(|| bad_input("no input_ids tensor".into()))?;
    let model_inputs = Inputs::new(
        &loaded.config,
        input_ids,
        inputs.get("token_type_ids"),
        inputs.get("attention_mask"),
    )
    .map_err(|e| bad_input(e.to_string()))?;
    let out = loaded.model.forward(&model_inputs, Mode::Eval, true)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.to_device(&Device::Cpu);
    let mut tensors = std::collections::HashMap::new();
    tensors.insert(
        "last_hidden_state".to_string(),
        f32(&out.last_hidden_state)?,
    );
    if let Some(p) = &out.pooler_output {
        tensors.insert("pooler_output".to_string(), f32(p)?);
    }
    for (i, h) in out.hidden_states.iter().enumerate() {
        tensors.insert(format!("hidden_states.{i}"), f32(h)?);
    }
    let partial = bertkit_stage_io::partial_path(output);
    candle_core::safetensors::save(&tensors, &partial)?;
    bertkit_stage_io::give_created_mode(&partial).map_err(|source| TaskError::Io {
        path: output.to_path_buf(),
        source,
    })?;
    std::fs::rename(&partial, output).map_err(|source| TaskError::Io {
        path: output.to_path_buf(),
        source,
    })?;
    let (batch, seq) = input_ids.dims2()?;
    Ok(ForwardSummary {
        tensors: tensors.len(),
        batch,
        seq,
        layers: loaded.config.num_hidden_layers,
        initialised: loaded.params.initialised.clone(),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn nearest_rank_quantiles() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
        assert_eq!(super::quantile(&v, 0.5), 5.0);
        assert_eq!(super::quantile(&v, 0.9), 9.0);
        assert_eq!(super::quantile(&v, 0.99), 10.0);
    }
}
