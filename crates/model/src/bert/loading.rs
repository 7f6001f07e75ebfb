//! Building and loading a model: initialised weights, or a model folder's
//! (`config.json`, `model.safetensors`), and saving one.

use super::*;

/// A model with its parameters and config.
#[derive(Debug, Clone)]
pub struct Loaded<M> {
    /// The model.
    pub model: M,
    /// Its parameters (for optimisers and saving).
    pub params: ParamStore,
    /// Its configuration.
    pub config: BertConfig,
}

/// Where a model directory keeps its files.
pub fn model_files(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    (dir.join("config.json"), dir.join("model.safetensors"))
}

/// Loads `M` from a transformers model directory (`config.json` + `model.safetensors`).
/// Parameters the checkpoint lacks are initialised with `seed` and listed in
/// `params.initialised`.
pub fn load<M: BertArchitecture>(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Loaded<M>, ModelError> {
    load_with(dir, dtype, device, seed, &|_| {})
}

/// As [`load`], for inference: parameters are plain tensors (no gradients), so the kernels use
/// fused LayerNorm and softmax.
pub fn load_frozen<M: BertArchitecture>(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
) -> Result<Loaded<M>, ModelError> {
    load_inner(dir, dtype, device, 0, &|_| {}, true)
}

/// As [`load`], with the directory's config adjusted first (for example the dropout
/// probabilities of a training run).
pub fn load_with<M: BertArchitecture>(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
    seed: u64,
    adjust: &dyn Fn(&mut BertConfig),
) -> Result<Loaded<M>, ModelError> {
    load_inner(dir, dtype, device, seed, adjust, false)
}

fn load_inner<M: BertArchitecture>(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
    seed: u64,
    adjust: &dyn Fn(&mut BertConfig),
    frozen: bool,
) -> Result<Loaded<M>, ModelError> {
    let (config_path, weights) = model_files(dir);
    let mut config = BertConfig::load(&config_path)?;
    adjust(&mut config);
    config.validate().map_err(ModelError::Config)?;
    if !weights.is_file() {
        return Err(ModelError::Weights(format!(
            "{}: not found (a model directory holds config.json and model.safetensors)",
            weights.display()
        )));
    }
    let mut p =
        ParamBuilder::from_safetensors(&weights, dtype, device, config.initializer_range, seed)?;
    if frozen {
        p = p.frozen();
    }
    let model = M::build(&config, &mut p).map_err(|e| match e {
        ModelError::Weights(m) => ModelError::Weights(format!("{}: {m}", weights.display())),
        other => other,
    })?;
    Ok(Loaded {
        model,
        params: p.finish(),
        config,
    })
}

/// A freshly initialised `M` (seeded).
pub fn init<M: BertArchitecture>(
    config: &BertConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Loaded<M>, ModelError> {
    init_inner(config, dtype, device, seed, false)
}

/// As [`init`], for inference: parameters are plain tensors (no gradients tracked), as
/// [`load_frozen`] makes them.
pub fn init_frozen<M: BertArchitecture>(
    config: &BertConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Loaded<M>, ModelError> {
    init_inner(config, dtype, device, seed, true)
}

fn init_inner<M: BertArchitecture>(
    config: &BertConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
    frozen: bool,
) -> Result<Loaded<M>, ModelError> {
    let mut p = ParamBuilder::fresh(dtype, device, config.initializer_range, seed);
    if frozen {
        p = p.frozen();
    }
    let model = M::build(config, &mut p)?;
    Ok(Loaded {
        model,
        params: p.finish(),
        config: config.clone(),
    })
}

/// Saves a model directory transformers can load: `config.json` and `model.safetensors`
/// (each written atomically) with the tensors in `dtype`.
pub fn save<M: BertArchitecture>(
    loaded: &Loaded<M>,
    dir: &std::path::Path,
    dtype: DType,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::Io {
        path: dir.into(),
        source: e,
    })?;
    let (config_path, weights) = model_files(dir);
    loaded.params.save_safetensors(&weights, dtype)?;
    let torch_dtype = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let json = loaded
        .config
        .to_hf_json(M::ARCHITECTURE, &[("torch_dtype", torch_dtype.into())]);
    bertkit_stage_io::write_atomically(&config_path, json.as_bytes()).map_err(|e| ModelError::Io {
        path: config_path,
        source: e,
    })
}
