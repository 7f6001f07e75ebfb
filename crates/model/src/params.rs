//! Parameters: loading Hugging Face checkpoints, initialising what a checkpoint lacks, saving.
//!
//! Inside the model every parameter has its Hugging Face name without the `bert.` prefix of
//! the base model (`embeddings.word_embeddings.weight`, `encoder.layer.0.attention.self.query.weight`,
//! `pooler.dense.bias`), and the heads keep theirs (`cls.predictions.bias`,
//! `cls.seq_relationship.weight`, `qa_outputs.weight`, `classifier.weight`).
//!
//! Loading accepts names with or without `bert.`, TensorFlow-era `gamma`/`beta` for LayerNorm,
//! and `cls.predictions.decoder.bias` for the output bias. The decoder weight is tied to the word
//! embeddings, so a stored `cls.predictions.decoder.weight` is not read, and `position_ids`
//! buffers are skipped. A parameter the checkpoint lacks is initialised as BERT does (truncated
//! normal with std `initializer_range`, cut at two std; zero bias; LayerNorm ones and zeros) and
//! listed in [`ParamStore::initialised`]. A tensor of the wrong shape is an error naming it.
//!
//! Saving writes the same layout transformers writes: `bert.`-prefixed base names when the
//! model has a head, the tied decoder weight left out (transformers re-ties it on load).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};

use crate::ModelError;

/// How a parameter missing from a checkpoint starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Truncated normal, std `initializer_range`, resampled beyond two std (weights, embeddings).
    TruncatedNormal,
    /// Zeros (biases, LayerNorm bias).
    Zeros,
    /// Ones (LayerNorm weight).
    Ones,
}

/// Maps a checkpoint name onto the model's name, or `None` for entries that are not parameters.
pub fn canonical_name(name: &str) -> Option<String> {
    let name = name.strip_prefix("bert.").unwrap_or(name);
    if name.ends_with("position_ids") || name == "cls.predictions.decoder.weight" {
        return None;
    }
    let name = if name == "cls.predictions.decoder.bias" {
        "cls.predictions.bias".to_string()
    } else if let Some(stem) = name.strip_suffix(".gamma") {
        format!("{stem}.weight")
    } else if let Some(stem) = name.strip_suffix(".beta") {
        format!("{stem}.bias")
    } else {
        name.to_string()
    };
    Some(name)
}

/// The name transformers stores a parameter under, for a model with or without a head.
pub fn hf_name(name: &str, has_head: bool) -> String {
    let is_head = name.starts_with("cls.")
        || name.starts_with("qa_outputs.")
        || name.starts_with("classifier.");
    if has_head && !is_head {
        format!("bert.{name}")
    } else {
        name.to_string()
    }
}

/// Builds the model's parameters from a checkpoint (or from scratch).
pub struct ParamBuilder {
    checkpoint: HashMap<String, Tensor>,
    used: HashSet<String>,
    vars: BTreeMap<String, Var>,
    initialised: Vec<String>,
    dtype: DType,
    device: Device,
    std: f64,
    rng: bertkit_rng::SplitMix64,
    frozen: Option<BTreeMap<String, Tensor>>,
}

impl ParamBuilder {
    /// Builds plain tensors instead of trainable variables: no gradients are tracked, so the
    /// kernels may use fused inference ops (see [`crate::kernels`]). For inference only.
    pub fn frozen(mut self) -> Self {
        self.frozen = Some(BTreeMap::new());
        self
    }

    /// No checkpoint: every parameter is initialised (seeded, so runs repeat).
    pub fn fresh(dtype: DType, device: &Device, initializer_range: f64, seed: u64) -> Self {
        ParamBuilder {
            checkpoint: HashMap::new(),
            used: HashSet::new(),
            vars: BTreeMap::new(),
            initialised: Vec::new(),
            dtype,
            device: device.clone(),
            std: initializer_range,
            rng: bertkit_rng::SplitMix64::new(seed ^ bertkit_rng::SPLITMIX_INCREMENT),
            frozen: None,
        }
    }

    /// Parameters from a safetensors checkpoint; what it lacks is initialised.
    pub fn from_safetensors(
        path: &Path,
        dtype: DType,
        device: &Device,
        initializer_range: f64,
        seed: u64,
    ) -> Result<Self, ModelError> {
        let raw = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
        let mut builder = Self::fresh(dtype, device, initializer_range, seed);
        for (name, tensor) in raw {
            if let Some(canonical) = canonical_name(&name)
                && builder
                    .checkpoint
                    .insert(canonical.clone(), tensor)
                    .is_some()
            {
                return Err(ModelError::Weights(format!(
                    "{}: two tensors map to {canonical} (with and without the bert. prefix?)",
                    path.display()
                )));
            }
        }
        Ok(builder)
    }

    /// Parameters from tensors already under the model's names (see [`canonical_name`]), as
    /// a converter hands them over; what they lack is initialised.
    pub fn from_tensors(
        tensors: HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
        initializer_range: f64,
        seed: u64,
    ) -> Self {
        let mut builder = Self::fresh(dtype, device, initializer_range, seed);
        builder.checkpoint = tensors;
        builder
    }

    /// `n` values of the truncated normal, continuing the builder's stream: Box-Muller on
    /// pairs of uniforms, values beyond two std drawn again (as TensorFlow's
    /// `truncated_normal`), in order, so the values are those of one sequential draw. The
    /// stream is cut into blocks of pairs drawn in parallel (splitmix64 skips ahead in one
    /// addition); the block that reaches `n` is replayed to find where the sequential draw
    /// stopped, and the stream continues from there. (Drawn one value at a time, the
    /// initialisation was most of a GPU run's start-up: BENCHMARKS.md.)
    fn truncated_normal(&mut self, n: usize) -> Vec<f32> {
        use rayon::prelude::*;
        /// Pairs of uniforms a block draws.
        const PAIRS: usize = 1 << 14;
        let start = self.rng.clone();
        let std = self.std;
        let block = |b: usize, limit: usize, out: &mut Vec<f32>| -> usize {
            // Values into `out` until it holds `limit`; returns the pairs drawn.
            let mut rng = start.clone();
            rng.skip((b * PAIRS * 2) as u64);
            for pair in 0..PAIRS {
                for z in box_muller(uniform(&mut rng), uniform(&mut rng)) {
                    if z.abs() <= 2.0 && out.len() < limit {
                        out.push((z * std) as f32);
                    }
                }
                if out.len() == limit {
                    return pair + 1;
                }
            }
            PAIRS
        };
        let mut out = Vec::with_capacity(n);
        let mut next = 0;
        while out.len() < n {
            // Enough blocks for what is left at the acceptance rate (~95%), a few spare.
            let blocks = (n - out.len()).div_ceil(PAIRS * 2 * 9 / 10).max(1);
            let drawn: Vec<Vec<f32>> = (next..next + blocks)
                .into_par_iter()
                .map(|b| {
                    let mut values = Vec::with_capacity(PAIRS * 2);
                    block(b, usize::MAX, &mut values);
                    values
                })
                .collect();
            for (i, values) in drawn.into_iter().enumerate() {
                let b = next + i;
                if out.len() + values.len() < n {
                    out.extend(values);
                    continue;
                }
                // The block where the sequential draw stopped: replayed to the value.
                let pairs = block(b, n, &mut out);
                self.rng = start.clone();
                self.rng.skip(((b * PAIRS + pairs) * 2) as u64);
                return out;
            }
            next += blocks;
        }
        // n == 0: nothing drawn.
        out
    }

    /// The parameter `name` of `shape`: from the checkpoint if there, else initialised.
    pub fn get(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor, ModelError> {
        self.get_in(name, shape, init, self.dtype)
    }

    /// An embedding table: as [`ParamBuilder::get`], but kept in f32 (f64 in an f64 model)
    /// whatever the compute dtype. Its gradient is a scatter-add of one row per token (candle's
    /// `index_add`, summed serially in the table's dtype): `[CLS]`, `[SEP]` or segment 0 collect
    /// ~10^4 terms a batch, far too many for bf16's 8 bits or fp16's range at a loss scale.
    /// The model casts the looked-up rows to the compute dtype.
    pub fn get_table(
        &mut self,
        name: &str,
        shape: &[usize],
        init: Init,
    ) -> Result<Tensor, ModelError> {
        let dtype = if self.dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        self.get_in(name, shape, init, dtype)
    }

    fn get_in(
        &mut self,
        name: &str,
        shape: &[usize],
        init: Init,
        dtype: DType,
    ) -> Result<Tensor, ModelError> {
        if let Some(var) = self.vars.get(name) {
            return Ok(var.as_tensor().clone());
        }
        if let Some(t) = self.frozen.as_ref().and_then(|f| f.get(name)) {
            return Ok(t.clone());
        }
        let tensor = match self.checkpoint.get(name) {
            Some(t) => {
                if t.dims() != shape {
                    return Err(ModelError::Weights(format!(
                        "{name}: the checkpoint has shape {:?}, the config needs {shape:?}",
                        t.dims()
                    )));
                }
                self.used.insert(name.to_string());
                t.to_dtype(dtype)?.to_device(&self.device)?
            }
            None => {
                self.initialised.push(name.to_string());
                let n: usize = shape.iter().product();
                let values = match init {
                    Init::TruncatedNormal => self.truncated_normal(n),
                    Init::Zeros => vec![0.0; n],
                    Init::Ones => vec![1.0; n],
                };
                Tensor::from_vec(values, shape, &self.device)?.to_dtype(dtype)?
            }
        };
        if let Some(frozen) = &mut self.frozen {
            frozen.insert(name.to_string(), tensor.clone());
            return Ok(tensor);
        }
        let var = Var::from_tensor(&tensor)?;
        let t = var.as_tensor().clone();
        self.vars.insert(name.to_string(), var);
        Ok(t)
    }

    /// For a frozen model, the parameters `names` (built already, each `[rows, ...]` with the
    /// same trailing dimensions) joined along their rows into one tensor, made once: each
    /// named parameter becomes a view of its rows of it (no second copy of their memory), and
    /// the joined tensor is returned, for a product that takes them together. `None` for
    /// trainable parameters (which the optimiser updates apart; joined at each pass instead).
    pub fn join_rows(&mut self, names: &[String]) -> Result<Option<Tensor>, ModelError> {
        let Some(frozen) = &mut self.frozen else {
            return Ok(None);
        };
        let parts = names
            .iter()
            .map(|n| {
                frozen
                    .get(n)
                    .cloned()
                    .ok_or_else(|| ModelError::Weights(format!("{n}: joined before it was built")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let joined = Tensor::cat(&parts, 0)?;
        let mut start = 0;
        for (name, part) in names.iter().zip(&parts) {
            let rows = part.dim(0)?;
            frozen.insert(name.clone(), joined.narrow(0, start, rows)?);
            start += rows;
        }
        Ok(Some(joined))
    }

    /// The built parameters. Checkpoint tensors the model did not use are listed in
    /// [`ParamStore::unused`].
    pub fn finish(self) -> ParamStore {
        let mut unused: Vec<String> = self
            .checkpoint
            .keys()
            .filter(|k| !self.used.contains(*k))
            .cloned()
            .collect();
        unused.sort();
        ParamStore {
            vars: self.vars,
            frozen: self.frozen.unwrap_or_default(),
            initialised: self.initialised,
            unused,
        }
    }
}

/// A model's parameters by name.
#[derive(Debug, Clone)]
pub struct ParamStore {
    vars: BTreeMap<String, Var>,
    /// Parameters of a frozen (inference) model.
    frozen: BTreeMap<String, Tensor>,
    /// Parameters the checkpoint lacked, initialised as BERT does.
    pub initialised: Vec<String>,
    /// Checkpoint tensors the model has no place for (a head it was not built with).
    pub unused: Vec<String>,
}

impl ParamStore {
    /// Every trainable parameter, by name (sorted; empty for a frozen model).
    pub fn vars(&self) -> &BTreeMap<String, Var> {
        &self.vars
    }

    /// One parameter.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars.get(name)
    }

    /// Number of scalar parameters.
    pub fn count(&self) -> usize {
        self.vars.values().map(|v| v.elem_count()).sum::<usize>()
            + self.frozen.values().map(|t| t.elem_count()).sum::<usize>()
    }

    /// Every parameter as a tensor, by name, trainable or frozen.
    pub fn tensors(&self) -> BTreeMap<String, Tensor> {
        let mut all: BTreeMap<String, Tensor> = self.frozen.clone();
        all.extend(
            self.vars
                .iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().clone())),
        );
        all
    }

    /// Whether a head (pre-training, QA or classification) is among the parameters.
    pub fn has_head(&self) -> bool {
        self.tensors().keys().any(|k| {
            k.starts_with("cls.") || k.starts_with("qa_outputs.") || k.starts_with("classifier.")
        })
    }

    /// The tensors under their transformers names, in `dtype`.
    pub fn hf_tensors(&self, dtype: DType) -> Result<HashMap<String, Tensor>, ModelError> {
        let head = self.has_head();
        self.tensors()
            .iter()
            .map(|(k, v)| {
                Ok((
                    hf_name(k, head),
                    v.to_dtype(dtype)?.to_device(&Device::Cpu)?,
                ))
            })
            .collect()
    }

    /// Writes `model.safetensors` (atomically) in the transformers layout.
    pub fn save_safetensors(&self, path: &Path, dtype: DType) -> Result<(), ModelError> {
        let tensors = self.hf_tensors(dtype)?;
        let partial = bertkit_stage_io::partial_path(path);
        candle_core::safetensors::save(&tensors, &partial)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", partial.display())))?;
        let io = |e| ModelError::Io {
            path: path.into(),
            source: e,
        };
        bertkit_stage_io::give_created_mode(&partial).map_err(io)?;
        std::fs::rename(&partial, path).map_err(|e| ModelError::Io {
            path: path.into(),
            source: e,
        })
    }
}

/// A uniform in (0, 1) from 53 random bits, centred in its step (never 0: `ln` takes it).
fn uniform(rng: &mut bertkit_rng::SplitMix64) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Box-Muller: two standard normals from two uniforms.
fn box_muller(u1: f64, u2: f64) -> [f64; 2] {
    let r = (-2.0 * u1.ln()).sqrt();
    [
        r * (std::f64::consts::TAU * u2).cos(),
        r * (std::f64::consts::TAU * u2).sin(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The truncated normal drawn one value at a time, as the builder drew it before its
    /// blocks were drawn in parallel: the reference the parallel draw must equal.
    fn sequential(rng: &mut bertkit_rng::SplitMix64, std: f64, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            for z in box_muller(uniform(rng), uniform(rng)) {
                if z.abs() <= 2.0 && out.len() < n {
                    out.push((z * std) as f32);
                }
            }
        }
        out
    }

    /// Parameters drawn in parallel blocks are the values of the sequential draw, and the
    /// stream continues where the sequential draw left it (each parameter after the first
    /// starts where the one before stopped): sizes around a block's end, a zero, a one and
    /// several blocks.
    #[test]
    fn the_parallel_truncated_normal_is_the_sequential_draw() {
        let sizes = [
            1,
            0,
            7,
            32_768,
            32_767,
            32_769,
            31_000,
            100_003,
            2,
            65_536 * 3 + 5,
        ];
        let mut builder = ParamBuilder::fresh(DType::F32, &Device::Cpu, 0.02, 42);
        let mut reference = builder.rng.clone();
        for &n in &sizes {
            let got = builder.truncated_normal(n);
            let want = sequential(&mut reference, 0.02, n);
            assert_eq!(got.len(), n);
            assert!(got == want, "{n} values differ");
        }
        assert_eq!(
            builder.rng.next_u64(),
            reference.next_u64(),
            "the stream continues"
        );
        // Truncated at two std.
        let values = builder.truncated_normal(50_000);
        assert!(values.iter().all(|v| v.abs() <= 0.04));
        assert!(values.iter().any(|v| v.abs() > 0.035));
    }

    /// A frozen model's joined rows are the parts in order, the parts become views of them
    /// (the store lists the same values, one buffer behind them), and trainable parameters are
    /// not joined.
    #[test]
    fn frozen_parameters_join_into_one_tensor_their_parts_view() {
        let names = ["a", "b", "c"].map(String::from);
        let rows = [2, 3, 1];
        let build = |p: &mut ParamBuilder| {
            for (name, r) in names.iter().zip(rows) {
                p.get(name, &[r, 4], Init::TruncatedNormal).unwrap();
            }
        };
        let mut trainable = ParamBuilder::fresh(DType::F32, &Device::Cpu, 0.02, 7);
        build(&mut trainable);
        assert!(trainable.join_rows(&names).unwrap().is_none());
        let mut p = ParamBuilder::fresh(DType::F32, &Device::Cpu, 0.02, 7).frozen();
        build(&mut p);
        let before: Vec<Vec<Vec<f32>>> = names
            .iter()
            .map(|n| p.get(n, &[0], Init::Zeros).unwrap().to_vec2().unwrap())
            .collect();
        let joined = p
            .join_rows(&names)
            .unwrap()
            .expect("frozen parameters join");
        assert_eq!(joined.dims(), [6, 4]);
        let want: Vec<Vec<f32>> = before.iter().flatten().cloned().collect();
        assert_eq!(joined.to_vec2::<f32>().unwrap(), want);
        let (joined_storage, _) = joined.storage_and_layout();
        let joined_storage = &*joined_storage as *const candle_core::Storage;
        let mut start = 0;
        for ((name, r), values) in names.iter().zip(rows).zip(&before) {
            // (The shape is not asked again: the built tensor is handed back.)
            let part = p.get(name, &[0], Init::Zeros).unwrap();
            assert_eq!(&part.to_vec2::<f32>().unwrap(), values, "{name}");
            assert_eq!(part.layout().start_offset(), start * 4, "{name}");
            let (storage, _) = part.storage_and_layout();
            assert!(
                std::ptr::eq(&*storage, joined_storage),
                "{name} views the joined rows"
            );
            start += r;
        }
        // The store lists the parts by name, as built.
        let all = p.finish().tensors();
        assert_eq!(all.len(), 3);
        assert_eq!(all["b"].to_vec2::<f32>().unwrap(), before[1]);
        // A name not built is an error, not a panic.
        let mut q = ParamBuilder::fresh(DType::F32, &Device::Cpu, 0.02, 7).frozen();
        assert!(q.join_rows(&["missing".to_string()]).is_err());
    }
}
