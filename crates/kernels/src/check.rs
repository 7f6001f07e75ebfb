//! Each fused kernel against its twin, values and gradients (`bertkit check kernels`).
//!
//! A kernel runs on the device being checked ([`Fused`] there, in the dtype asked for) and on
//! its reference on the CPU, from the same inputs (rounded to the dtype first) and the same
//! dropout masks; a fixed upstream gradient is pulled back through both. On a CUDA device the
//! reference is the twin, [`Fused`] on the CPU in f32 (the kernels the CPU tests prove against
//! the composed ops); on the CPU it is [`Composed`] in f64. Each line reports the largest
//! difference relative to the reference's largest magnitude, against a tolerance for the
//! dtype. It needs no Rust toolchain, so a GPU machine (or a user's) runs it from the binary.

use candle_core::{DType, Device, Result, Tensor, Var};

use super::{Composed, Fused, Gelu, KernelOptions, Kernels, Mode};
use crate::dropout::DropoutSource;
use crate::packing::{Packing, RowIndex};

/// One compared tensor of one kernel.
#[derive(Debug, Clone)]
pub struct KernelCheck {
    /// The kernel (and its mode).
    pub kernel: String,
    /// The shape it ran at ([`CheckShape::name`]).
    pub shape: &'static str,
    /// The output, or which input's gradient (or, for a check of state, which state).
    pub value: &'static str,
    /// Whether `value` names an input whose gradient was compared.
    pub gradient: bool,
    /// The largest absolute difference over the reference's largest magnitude.
    pub worst: f64,
    /// The most [`KernelCheck::worst`] may be.
    pub tolerance: f64,
    /// Why the kernel could not run, where it could not ([`KernelCheck::not_run`]; the line
    /// fails).
    pub error: Option<String>,
}

impl KernelCheck {
    /// Whether the difference is within the tolerance (a NaN fails).
    pub fn passed(&self) -> bool {
        self.worst <= self.tolerance
    }

    /// The line of a kernel that failed to run (an error where its values would be): a failed
    /// line.
    pub fn not_run(kernel: String, shape: &'static str, error: &dyn std::fmt::Display) -> Self {
        KernelCheck {
            kernel,
            shape,
            value: "(error)",
            gradient: false,
            worst: f64::NAN,
            tolerance: f64::NAN,
            error: Some(error.to_string()),
        }
    }
}

/// Whether `device` still runs work, after a kernel's error: an error that breaks a GPU's
/// context (an illegal address, say) fails every later call there, so a check stops at it
/// rather than report every later kernel as failed (and so leave off settings it never
/// checked). The device's error where it is broken.
pub fn device_broken(device: &Device) -> Option<String> {
    device.synchronize().err().map(|e| e.to_string())
}

/// A batch the kernels are checked at.
#[derive(Debug, Clone)]
pub struct CheckShape {
    /// Its name in the report.
    pub name: &'static str,
    /// Each row's length (tokens, then padding up to `seq`).
    pub lengths: Vec<usize>,
    /// The padded length.
    pub seq: usize,
    /// The hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// The feed-forward size.
    pub intermediate: usize,
}

impl CheckShape {
    /// The shapes `bertkit check kernels` runs: a small one with odd lengths (a row of one
    /// token, a length not a multiple of a warp), BERT-base's widths at 128 positions, and the
    /// longest rows (512: eight tiles of the one-pass attention, rows ending inside a tile).
    pub fn defaults() -> Vec<CheckShape> {
        vec![
            CheckShape {
                name: "small",
                lengths: vec![37, 20, 1],
                seq: 37,
                hidden: 64,
                heads: 4,
                intermediate: 256,
            },
            CheckShape {
                name: "base-128",
                lengths: vec![128, 100, 77, 3],
                seq: 128,
                hidden: 768,
                heads: 12,
                intermediate: 3072,
            },
            CheckShape {
                name: "long-512",
                lengths: vec![512, 200, 65, 1],
                seq: 512,
                hidden: 128,
                heads: 2,
                intermediate: 512,
            },
        ]
    }

    /// The batch's tokens (the lengths' sum).
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// The `[batch, seq]` attention mask, row-major: 1 for a token.
    pub fn mask(&self) -> Vec<u32> {
        self.lengths
            .iter()
            .flat_map(|&len| (0..self.seq).map(move |c| u32::from(c < len)))
            .collect()
    }
}

/// The tolerance of [`KernelCheck::worst`] in `dtype`: f32 rounding through a few reductions,
/// or half precision's 8 (bf16) or 11 (f16) bits through the same.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F64 => 2e-4,
        _ => 4e-2,
    }
}

/// The dropout probability of the checks that drop.
const DROPOUT: f64 = 0.1;
/// The dropout masks' seed.
const SEED: u64 = 1234;

/// Which of a kernel's CUDA forms a case runs (the [`KernelOptions`] its kernels take).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// The attention around cuBLAS, LayerNorm a block per row (and every other case).
    Plain,
    /// The one-pass attention (`flash.cu`).
    Flash,
    /// A form of CUDA's own (LayerNorm's kernels by row width): on CUDA only, where the
    /// other devices would repeat the plain rows under another name.
    Cuda,
}

impl Form {
    /// Whether the form runs where the kernels are `on_cuda` in `dtype` at `shape`: the
    /// one-pass attention in bf16 with heads of 64, CUDA's own forms on CUDA.
    fn runs(self, on_cuda: bool, dtype: DType, shape: &CheckShape) -> bool {
        match self {
            Form::Plain => true,
            Form::Flash => on_cuda && dtype == DType::BF16 && shape.hidden == 64 * shape.heads,
            Form::Cuda => on_cuda,
        }
    }

    /// The fused kernels the form runs: the one-pass attention for its own rows only (the
    /// others check the kernels around cuBLAS), the feed-forward in its lean form (its full
    /// form is the linear rows' kernels, checked there).
    fn kernels(self) -> Fused {
        Fused::with(KernelOptions {
            one_pass_attention: self == Form::Flash,
            lean_feed_forward: true,
        })
    }
}

type Run = fn(&dyn Kernels, &[Tensor], &Packing, Mode, &CheckShape) -> Result<Tensor>;

struct Case {
    kernel: &'static str,
    /// The inputs' names (gradients are reported under them) and shapes.
    inputs: Vec<(&'static str, Vec<usize>, f64)>,
    run: Run,
    train: bool,
    /// Which of its op's CUDA forms the case runs ([`Form::runs`] says where).
    form: Form,
}

fn cases(s: &CheckShape) -> Vec<Case> {
    let (t, h, i) = (s.tokens(), s.hidden, s.intermediate);
    let w = 1.0 / (h as f64).sqrt();
    // LayerNorm at rows of `width`: on CUDA the rows decide the kernels (a warp a row at the
    // shapes' widths; 16 bytes a thread a block a row, each row's loads at once up to 256
    // pieces (1,536 in half precision), after its statistics beyond (4,096, and 1,536 in f32);
    // an element a thread where a row is not whole 16-byte pieces, 1,001).
    let norm = |kernel, width, form| Case {
        kernel,
        inputs: vec![
            ("x", vec![t, width], 2.0),
            ("weight", vec![width], 1.0),
            ("bias", vec![width], 0.5),
        ],
        run: |k, x, _, _, _| k.layer_norm(&x[0], &x[1], &x[2], 1e-12),
        train: false,
        form,
    };
    let residual_norm = |kernel, width, form| Case {
        kernel,
        inputs: vec![
            ("x", vec![t, width], 2.0),
            ("residual", vec![t, width], 2.0),
            ("weight", vec![width], 1.0),
            ("bias", vec![width], 0.5),
        ],
        run: |k, x, p, mode, _| {
            k.residual_layer_norm(&x[0], &x[1], p, mode, DROPOUT, &x[2], &x[3], 1e-12)
        },
        train: true,
        form,
    };
    let linear = |kernel, run: Run| Case {
        kernel,
        inputs: vec![
            ("x", vec![t, h], 1.0),
            ("weight", vec![i, h], w),
            ("bias", vec![i], 0.5),
        ],
        run,
        train: false,
        form: Form::Plain,
    };
    let attention = |kernel, train, form| Case {
        kernel,
        inputs: vec![("qkv", vec![t, 3 * h], 1.0)],
        run: |k, x, p, mode, s| k.attention(&x[0], p, s.heads, mode, DROPOUT),
        train,
        form,
    };
    vec![
        Case {
            kernel: "gather_rows",
            // A table of 50 rows read by every token, rows repeated (as words are), one row
            // read by none.
            inputs: vec![("table", vec![50, h], 1.0)],
            run: |k, x, p, _, _| {
                let rows = (0..p.tokens())
                    .map(|t| ((t * 7 + t / 3) % 49) as u32)
                    .collect();
                k.gather_rows(&x[0], &RowIndex::from_host(rows, x[0].device())?)
            },
            train: false,
            form: Form::Plain,
        },
        Case {
            kernel: "embeddings",
            // The embeddings' end ([`Kernels::embeddings`]): words repeated (one row read by
            // none), both token types, each token's position; the tables in f32 (f64 in the
            // CPU's reference) as the model keeps them, the norm's parameters in the dtype.
            inputs: vec![
                ("words", vec![50, h], 1.0),
                ("token types", vec![2, h], 1.0),
                ("positions", vec![s.seq, h], 1.0),
                ("weight", vec![h], 1.0),
                ("bias", vec![h], 0.5),
            ],
            run: |k, x, p, mode, _| {
                let device = x[0].device();
                let table = |t: &Tensor| match t.dtype() {
                    DType::F64 => Ok(t.clone()),
                    _ => t.to_dtype(DType::F32),
                };
                let (words, types, positions) = (table(&x[0])?, table(&x[1])?, table(&x[2])?);
                let tokens = p.tokens();
                let word_rows = (0..tokens).map(|t| ((t * 7 + t / 3) % 49) as u32);
                let word_rows = RowIndex::from_host(word_rows.collect(), device)?;
                let half = p.padded_dims().1 / 2;
                let type_rows = p.columns().iter().map(|&c| u32::from(c as usize >= half));
                let type_rows = RowIndex::from_host(type_rows.collect(), device)?;
                let position_rows = p.position_rows();
                let lookups = [
                    (&words, &word_rows),
                    (&types, &type_rows),
                    (&positions, &position_rows),
                ];
                k.embeddings(lookups, p, mode, DROPOUT, &x[3], &x[4], 1e-12)
            },
            train: true,
            form: Form::Plain,
        },
        Case {
            kernel: "join (three parts)",
            // Tensors joined along their rows ([`super::tape::cat_rows`]: a layer's query, key
            // and value weights): parts of uneven rows.
            inputs: vec![
                ("first", vec![t, h], 1.0),
                ("second", vec![3, h], 1.0),
                ("third", vec![1, h], 1.0),
            ],
            run: |_, x, _, _, _| super::tape::cat_rows(&[&x[0], &x[1], &x[2]]),
            train: false,
            form: Form::Plain,
        },
        Case {
            kernel: "join (stacked)",
            // Two stacked ([`super::tape::stack_rows`]: a LayerNorm's weight and bias).
            inputs: vec![("weight", vec![h], 1.0), ("bias", vec![h], 0.5)],
            run: |_, x, _, _, _| super::tape::stack_rows(&[&x[0], &x[1]]),
            train: false,
            form: Form::Plain,
        },
        Case {
            kernel: "add",
            // The tape's gradient sums ([`super::add_gradients`]), at a layer's width.
            inputs: vec![("a", vec![t, h], 1.0), ("b", vec![t, h], 1.0)],
            run: |_, x, _, _, _| super::add_gradients(&x[0], &x[1]),
            train: false,
            form: Form::Plain,
        },
        Case {
            kernel: "dropout (tokens)",
            // The embeddings' dropout of a packed tensor ([`super::Mode::dropout_tokens`]):
            // each token's line keyed by its place, the CPU's masks on every device.
            inputs: vec![("x", vec![t, h], 1.0)],
            run: |_, x, p, mode, _| mode.dropout_tokens(&x[0], DROPOUT, p),
            train: true,
            form: Form::Plain,
        },
        Case {
            kernel: "dropout (rows)",
            // The pooler's ([`super::Mode::dropout`]): each row's line keyed by the row.
            inputs: vec![("x", vec![t, h], 1.0)],
            run: |_, x, _, mode, _| mode.dropout(&x[0], DROPOUT),
            train: true,
            form: Form::Plain,
        },
        norm("layer_norm", h, Form::Plain),
        norm("layer_norm (rows of 1,001)", 1001, Form::Cuda),
        norm("layer_norm (rows of 1,536)", 1536, Form::Cuda),
        norm("layer_norm (rows of 4,096)", 4096, Form::Cuda),
        linear("linear", |k, x, _, _, _| {
            k.linear(&x[0], &x[1], Some(&x[2]))
        }),
        Case {
            kernel: "linear (wide)",
            // Wider than a block's bias sums (the masked-LM decoder's rows): two chunks. On
            // rows of 64 at every shape, to keep the CPU's reference products small.
            inputs: vec![
                ("x", vec![t, 64], 1.0),
                ("weight", vec![12_300, 64], 0.125),
                ("bias", vec![12_300], 0.5),
            ],
            run: |k, x, _, _, _| k.linear(&x[0], &x[1], Some(&x[2])),
            train: false,
            form: Form::Plain,
        },
        Case {
            kernel: "linear (f32 weight)",
            // A weight kept in f32 (f64 in the CPU's reference) whatever the dtype: the
            // masked-LM decoder's, tied to the word embeddings. Not whole 16-byte rows (a
            // vocabulary's width), as the decoder's 30,522.
            inputs: vec![
                ("x", vec![t, h], 1.0),
                ("weight", vec![i + 4, h], w),
                ("bias", vec![i + 4], 0.5),
            ],
            run: |k, x, _, _, _| {
                let weight = kept_in_f32(&x[1])?;
                k.linear(&x[0], &weight, Some(&x[2]))
            },
            train: false,
            form: Form::Plain,
        },
        linear("linear_gelu (erf)", |k, x, _, _, _| {
            k.linear_gelu(&x[0], &x[1], Some(&x[2]), Gelu::Erf)
        }),
        linear("linear_gelu (tanh)", |k, x, _, _, _| {
            k.linear_gelu(&x[0], &x[1], Some(&x[2]), Gelu::Tanh)
        }),
        Case {
            kernel: "gelu (erf)",
            inputs: vec![("x", vec![t, i], 3.0)],
            run: |k, x, _, _, _| k.gelu(&x[0], Gelu::Erf),
            train: false,
            form: Form::Plain,
        },
        Case {
            kernel: "feed_forward (erf)",
            inputs: vec![
                ("x", vec![t, h], 1.0),
                ("weight 1", vec![i, h], w),
                ("bias 1", vec![i], 0.5),
                ("weight 2", vec![h, i], 1.0 / (i as f64).sqrt()),
                ("bias 2", vec![h], 0.5),
            ],
            run: |k, x, _, _, _| {
                k.feed_forward(&x[0], (&x[1], Some(&x[2])), (&x[3], Some(&x[4])), Gelu::Erf)
            },
            train: false,
            form: Form::Plain,
        },
        attention("attention (eval)", false, Form::Plain),
        attention("attention (dropout)", true, Form::Plain),
        attention("attention one pass (eval)", false, Form::Flash),
        attention("attention one pass (dropout)", true, Form::Flash),
        Case {
            kernel: "nll",
            // A row of logits per token over 517 classes, labels spread over them.
            inputs: vec![("logits", vec![t, 517], 4.0)],
            run: |_, x, _, _, _| {
                let rows = x[0].dim(0)?;
                let labels: Vec<u32> = (0..rows).map(|r| ((r * 31 + 7) % 517) as u32).collect();
                let labels = Tensor::from_vec(labels, rows, x[0].device())?;
                crate::nll_per_row(&x[0], &labels)
            },
            train: false,
            form: Form::Plain,
        },
        residual_norm("residual_layer_norm (dropout)", h, Form::Plain),
        residual_norm(
            "residual_layer_norm (dropout, rows of 1,001)",
            1001,
            Form::Cuda,
        ),
        residual_norm(
            "residual_layer_norm (dropout, rows of 1,536)",
            1536,
            Form::Cuda,
        ),
        residual_norm(
            "residual_layer_norm (dropout, rows of 4,096)",
            4096,
            Form::Cuda,
        ),
    ]
}

/// A weight as the model keeps the word table whatever the dtype (the masked-LM decoder's, tied
/// to it): f32, or f64 in the CPU's reference.
fn kept_in_f32(weight: &Tensor) -> Result<Tensor> {
    match weight.dtype() {
        DType::F64 => Ok(weight.clone()),
        _ => weight.to_dtype(DType::F32),
    }
}

/// Uniform values in `[-scale, scale)` from a seed (the same on every device), rounded to
/// `dtype`, as f32 on the CPU: the inputs of every check (the optimiser's too,
/// `bertkit_train::check`).
pub fn values(dims: &[usize], scale: f64, seed: u64, dtype: DType) -> Result<Tensor> {
    let mut rng = bertkit_rng::SplitMix64::new(seed);
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) * scale) as f32)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_dtype(DType::F32)
}

/// One side's output and input gradients, in f64 on the CPU.
fn run_side(
    case: &Case,
    shape: &CheckShape,
    inputs: &[Tensor],
    kernels: &dyn Kernels,
    device: &Device,
    dtype: DType,
) -> Result<Vec<Tensor>> {
    let vars = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(device)?.to_dtype(dtype)?))
        .collect::<Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let packing = Packing::from_mask((shape.lengths.len(), shape.seq), &shape.mask(), device)?;
    let source = DropoutSource::new(SEED);
    source.start_batch(0, 0);
    let mode = if case.train {
        Mode::Train(&source)
    } else {
        Mode::Eval
    };
    let y = (case.run)(kernels, &tensors, &packing, mode, shape)?;
    let upstream = values(y.dims(), 1.0, SEED + 99, dtype)?
        .to_device(device)?
        .to_dtype(y.dtype())?;
    let grads = crate::backward_from(&y, &upstream)?;
    let mut out = vec![y.to_device(&Device::Cpu)?.to_dtype(DType::F64)?];
    for (v, (name, _, _)) in vars.iter().zip(&case.inputs) {
        let Some(g) = grads.get(v.as_tensor()) else {
            candle_core::bail!("{}: no gradient for {name}", case.kernel)
        };
        out.push(g.to_device(&Device::Cpu)?.to_dtype(DType::F64)?);
    }
    Ok(out)
}

/// The largest `|a - b|` over the largest `|b|` (NaN if either holds a NaN): what a
/// [`KernelCheck`] reports, `b` the reference.
pub fn worst(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.flatten_all()?.to_vec1::<f64>()?;
    let b = b.flatten_all()?.to_vec1::<f64>()?;
    let mut diff = 0f64;
    let mut scale = f64::MIN_POSITIVE;
    for (&x, &y) in a.iter().zip(&b) {
        if x.is_nan() || y.is_nan() {
            return Ok(f64::NAN);
        }
        diff = diff.max((x - y).abs());
        scale = scale.max(y.abs());
    }
    Ok(diff / scale)
}

/// Checks every fused kernel on `device` in `dtype` against its reference at each of `shapes`
/// (see the module's documentation), each case with its form's kernels ([`Form::kernels`]). On
/// a CUDA device this turns TF32 off for the process ([`crate::device::set_tf32`]). A kernel that
/// fails to run gives a failed line with
/// its error ([`KernelCheck::not_run`]) and the check goes on, unless the error broke the
/// device ([`device_broken`]): then the lines end there.
pub fn check_kernels(
    device: &Device,
    dtype: DType,
    shapes: &[CheckShape],
) -> Result<Vec<KernelCheck>> {
    if device.is_cuda() {
        // f32 products in full f32, as the twin's: TF32's 10-bit inputs would hide a kernel's
        // error behind the product's.
        crate::device::set_tf32(false);
    }
    let (reference, ref_dtype): (&dyn Kernels, DType) = if device.is_cpu() {
        (&Composed, DType::F64)
    } else {
        (&Fused::default(), DType::F32)
    };
    let mut checks = Vec::new();
    for shape in shapes {
        for (c, case) in cases(shape).iter().enumerate() {
            // A form only where it runs: elsewhere its rows would repeat the plain form's under
            // another name.
            if !case.form.runs(device.is_cuda(), dtype, shape) {
                continue;
            }
            let kernels = case.form.kernels();
            let run = || -> Result<Vec<KernelCheck>> {
                let inputs = case
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(i, (_, dims, scale))| values(dims, *scale, (c * 16 + i) as u64, dtype))
                    .collect::<Result<Vec<_>>>()?;
                let want = run_side(case, shape, &inputs, reference, &Device::Cpu, ref_dtype)?;
                let got = run_side(case, shape, &inputs, &kernels, device, dtype)?;
                let names = std::iter::once("output").chain(case.inputs.iter().map(|(n, _, _)| *n));
                names
                    .zip(&got)
                    .zip(&want)
                    .map(|((value, got), want)| {
                        Ok(KernelCheck {
                            kernel: case.kernel.to_string(),
                            shape: shape.name,
                            value,
                            gradient: value != "output",
                            worst: worst(got, want)?,
                            tolerance: tolerance(dtype),
                            error: None,
                        })
                    })
                    .collect()
            };
            match run() {
                Ok(lines) => checks.extend(lines),
                Err(e) => {
                    checks.push(KernelCheck::not_run(
                        case.kernel.to_string(),
                        shape.name,
                        &e,
                    ));
                    if device_broken(device).is_some() {
                        return Ok(checks);
                    }
                }
            }
        }
    }
    Ok(checks)
}

/// How far cuBLASLt's GELU epilogue lies from GELU's two forms (the largest absolute
/// difference over values in [-6, 6], f32): [`cuda_gelu_epilogue`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GeluEpilogue {
    /// From `x · Φ(x)` by erf (BERT's GELU, [`Gelu::Erf`]).
    pub from_erf: f64,
    /// From its tanh approximation ([`Gelu::Tanh`]).
    pub from_tanh: f64,
}

impl GeluEpilogue {
    /// The form the epilogue computes: the one it lies at least four times closer to (the
    /// forms differ by up to 4.7e-4 over these values, at 2.69; an f32 epilogue with accurate
    /// functions lies within ~1e-6 of its own, one with `tanh.approx` up to ~1e-3); `None`
    /// where neither is.
    pub fn form(&self) -> Option<Gelu> {
        if 4.0 * self.from_erf < self.from_tanh {
            Some(Gelu::Erf)
        } else if 4.0 * self.from_tanh < self.from_erf {
            Some(Gelu::Tanh)
        } else {
            None
        }
    }
}

/// On a CUDA device, which GELU cuBLASLt's own epilogue computes: values `j / 32` for `j` in
/// `-192..=192` (each at most 8 significant bits, carried exactly by the f32 product's TF32
/// inputs) times an identity with `CUBLASLT_EPILOGUE_GELU`, against GELU's erf form and its
/// tanh approximation in f64 on the CPU. NVIDIA's documentation says only "GELU"; the answer
/// decides whether the epilogue's gradient form (`DGELU_BGRAD`) could take BERT's GELU backward
/// and its bias sums into a product. `None` off CUDA.
pub fn cuda_gelu_epilogue(device: &Device) -> Result<Option<GeluEpilogue>> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let x = gelu_probe_values()?;
        let identity = Tensor::eye(x.dim(1)?, DType::F32, &Device::Cpu)?;
        let got = super::cuda::gelu_epilogue(&x.to_device(device)?, &identity.to_device(device)?)?;
        return Ok(Some(gelu_distances(&x, &got.to_device(&Device::Cpu)?)?));
    }
    let _ = device;
    Ok(None)
}

/// The probe's values, `[64, 64]` f32: `j / 32` for `j` in `-192..=192`, over and over.
// (Without the `cuda` feature only the CPU test of the probe's method takes this and the next.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn gelu_probe_values() -> Result<Tensor> {
    const K: usize = 64;
    let values: Vec<f32> = (0..K * K)
        .map(|i| ((i % 385) as f32 - 192.0) / 32.0)
        .collect();
    Tensor::from_vec(values, (K, K), &Device::Cpu)
}

/// How far `got`, some GELU of `x` (on the CPU), lies from GELU's two forms in f64.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn gelu_distances(x: &Tensor, got: &Tensor) -> Result<GeluEpilogue> {
    let x = x.to_dtype(DType::F64)?;
    let got = got.to_dtype(DType::F64)?;
    let distance = |want: Tensor| -> Result<f64> {
        got.sub(&want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()
    };
    Ok(GeluEpilogue {
        from_erf: distance(x.gelu_erf()?)?,
        from_tanh: distance(x.gelu()?)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe tells the forms apart: the CPU's f32 GELUs of its values (each form computed
    /// as an epilogue in f32 would) are each named as their own form, the distances between
    /// the forms in f64 near 4.7e-4; off CUDA there is nothing to probe.
    #[test]
    fn the_gelu_probe_tells_erf_from_tanh() {
        let x = gelu_probe_values().unwrap();
        let erf = gelu_distances(&x, &x.gelu_erf().unwrap()).unwrap();
        assert_eq!(erf.form(), Some(Gelu::Erf), "{erf:?}");
        assert!(erf.from_erf < 1e-6 && erf.from_tanh > 4e-4, "{erf:?}");
        let tanh = gelu_distances(&x, &x.gelu().unwrap()).unwrap();
        assert_eq!(tanh.form(), Some(Gelu::Tanh), "{tanh:?}");
        assert!(tanh.from_tanh < 1e-6 && tanh.from_erf > 4e-4, "{tanh:?}");
        // Halfway between the forms: neither.
        let halfway = ((x.gelu_erf().unwrap() + x.gelu().unwrap()).unwrap() / 2.0).unwrap();
        assert_eq!(gelu_distances(&x, &halfway).unwrap().form(), None);
        assert_eq!(cuda_gelu_epilogue(&Device::Cpu).unwrap(), None);
    }
}
