//! # bertkit-kernels: BERT's hot operations, behind one small interface
//!
//! The model calls linear layers, LayerNorm, GELU, softmax and attention only through
//! [`Kernels`], so that a fused implementation can replace one without touching the model code.
//! Two implementations:
//!
//! - [`Composed`] (`composed.rs`), the reference: every op composed of candle primitives that
//!   have a backward pass, so gradients flow through all of them, on every device and dtype.
//! - [`Fused`], the default: on the CPU our own fused kernels with fused backward passes
//!   (`cpu/`, a file per op), for training and inference alike; on CUDA ours too (`cuda/`,
//!   f32 and bf16); elsewhere candle's fused
//!   LayerNorm and softmax where nothing tracks gradients. (candle's fused `softmax_last_dim`,
//!   `layer_norm`, `rms_norm` and `candle_nn::LayerNorm` have no backward and would silently
//!   stop gradients, so they are never used where gradients are tracked.)
//!
//! In half precision, LayerNorm and softmax are computed in f32 and cast back on every path;
//! f64 (tests) always takes the composed ops.
//!
//! The arrows run one way: the model (`bert`) calls these kernels; [`Fused`] picks a device
//! family's op (`cpu/`, `cuda/`: each CUDA kernel has a CPU twin, and [`check`] compares the
//! two); the families use the leaves `packing` (where a batch's
//! tokens are) and `dropout` (the masks, drawn and applied), and `host` (vector dispatch,
//! storage views). [`Mode`] (training with a dropout source, or evaluation) lives here because
//! every kernel that drops takes it.

#![deny(missing_docs)]

use std::cell::Cell;
use std::fmt::Debug;
use std::sync::Arc;

use candle_core::{D, DType, Layout, Result, Tensor};

use crate::dropout::DropoutSource;
use crate::packing::{Packing, RowIndex};

pub mod check;
mod composed;
pub(crate) mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod device;
pub mod dropout;
mod host;
mod nll;
pub mod packing;
mod profiled;
pub mod tape;

pub use composed::Composed;
use composed::{
    composed_attention, composed_embeddings, composed_linear, composed_residual_layer_norm,
};
pub use nll::{log_softmax, nll_per_row};
pub(crate) use profiled::{Caller, backward as profiled_backward};
pub use profiled::{Mark, time_backwards};

/// Candle's gradients of everything `output` depends on, for an upstream gradient `grad` of
/// its shape (the backward of `sum(output · grad)`).
pub fn backward_from(output: &Tensor, grad: &Tensor) -> Result<candle_core::backprop::GradStore> {
    (output * grad)?.sum_all()?.backward()
}
pub use profiled::{Clock, KernelTime, Profiled};

/// Which GELU a model computes, from its `hidden_act`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gelu {
    /// The exact GELU, `x · Φ(x)` (`hidden_act` `gelu`, `gelu_python`).
    #[default]
    Erf,
    /// The tanh approximation, `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`, as
    /// google-research/bert computes it (`gelu_new`, `gelu_pytorch_tanh`). It differs from
    /// the exact form by up to ~1e-3 at a unit; a model keeps the form it was trained with.
    Tanh,
}

impl Gelu {
    /// The form a `hidden_act` names, if it is a GELU this crate computes.
    pub fn from_hidden_act(name: &str) -> Option<Self> {
        match name {
            "gelu" | "gelu_python" => Some(Gelu::Erf),
            "gelu_new" | "gelu_pytorch_tanh" => Some(Gelu::Tanh),
            _ => None,
        }
    }

    /// The `hidden_act` transformers reads as this form.
    pub fn hidden_act(self) -> &'static str {
        match self {
            Gelu::Erf => "gelu",
            Gelu::Tanh => "gelu_new",
        }
    }
}

/// A parameter's gradient handed over by an op outside candle's graph
/// ([`Kernels::linear_into`]): the masked-LM decoder's weight, the word embeddings it is tied
/// to. Through the graph, candle's backward zeroes a gradient of the parameter's size and adds
/// the op's into it, then the lookup's is added (for BERT-large's `[30522, 1024]` f32 table
/// 125 MB zeroed and 375 MB added by an element a thread on CUDA, and in half precision the
/// cast's node the same again in bf16); handed over, the decoder's gradient is the sum's first
/// term as made. Whoever asks for one adds it where the parameter's gradients are summed
/// ([`GradientSink::add_to`]) after the backward pass: an op that hands over returns no
/// gradient for the parameter to the graph. An op hands it over in the dtype it made it in
/// (the CUDA linear op: its product's, bf16 for the f32 table), cast to the parameter's when
/// taken or added.
#[derive(Debug, Clone)]
pub struct GradientSink {
    of: candle_core::TensorId,
    dtype: DType,
    grad: Arc<std::sync::Mutex<Option<Tensor>>>,
}

impl GradientSink {
    /// A sink for `parameter`'s gradient (kept in its dtype).
    pub fn new(parameter: &Tensor) -> Self {
        GradientSink {
            of: parameter.id(),
            dtype: parameter.dtype(),
            grad: Arc::default(),
        }
    }

    /// Hands over an op's gradient of the parameter, in the dtype the op made it in; added to
    /// one handed over before (in that one's dtype).
    pub(crate) fn put(&self, grad: &Tensor) -> Result<()> {
        let Ok(mut held) = self.grad.lock() else {
            candle_core::bail!("a gradient sink: a poisoned lock")
        };
        *held = Some(match held.take() {
            Some(have) => add_gradients(&have, grad)?,
            None => grad.clone(),
        });
        Ok(())
    }

    /// The gradient handed over since the last take, in the parameter's dtype, with the
    /// parameter's id (`None` if no op handed one over: the graph holds it, or no backward pass
    /// ran; an error where the cast to the parameter's dtype fails).
    pub fn take(&self) -> Result<Option<(candle_core::TensorId, Tensor)>> {
        let Ok(mut held) = self.grad.lock() else {
            candle_core::bail!("a gradient sink: a poisoned lock")
        };
        held.take()
            .map(|grad| Ok((self.of, grad.to_dtype(self.dtype)?)))
            .transpose()
    }

    /// Adds the gradient handed over since the last take (or add) to `store`'s gradient of the
    /// parameter, the sum in the store's dtype (where it holds one; else the gradient cast to
    /// the parameter's), and empties the sink.
    pub fn add_to(&self, store: &mut candle_core::backprop::GradStore) -> Result<()> {
        let Ok(mut held) = self.grad.lock() else {
            candle_core::bail!("a gradient sink: a poisoned lock")
        };
        let Some(grad) = held.take() else {
            return Ok(());
        };
        let sum = match store.get_id(self.of) {
            Some(have) => add_gradients(have, &grad)?,
            None => grad.to_dtype(self.dtype)?,
        };
        store.insert_id(self.of, sum);
        Ok(())
    }
}

/// Inference, or training with dropout masks from a source.
#[derive(Debug, Clone, Copy)]
pub enum Mode<'a> {
    /// No dropout.
    Eval,
    /// Dropout on, masks drawn from the source.
    Train(&'a DropoutSource),
}

impl Mode<'_> {
    /// Applies dropout with probability `p` in training mode.
    pub fn dropout(&self, x: &Tensor, p: f64) -> candle_core::Result<Tensor> {
        match self {
            Mode::Train(source) if p > 0.0 => {
                #[cfg(feature = "cuda")]
                if x.rank() == 2 && on_cuda(&[x]) {
                    return cuda::keyed_dropout_rows(x, cuda::DeviceDropout::next(source, p));
                }
                source.apply(x, p)
            }
            _ => Ok(x.clone()),
        }
    }

    /// As [`Mode::dropout`] for a packed `[tokens, width]` tensor: each token drops what its
    /// place in the padded batch would.
    pub fn dropout_tokens(
        &self,
        x: &Tensor,
        p: f64,
        packing: &Packing,
    ) -> candle_core::Result<Tensor> {
        match self {
            Mode::Train(source) if p > 0.0 => {
                #[cfg(feature = "cuda")]
                if x.rank() == 2 && on_cuda(&[x]) {
                    return cuda::keyed_dropout_tokens(
                        x,
                        packing,
                        cuda::DeviceDropout::next(source, p),
                    );
                }
                source.apply_to_tokens(x, packing, p)
            }
            _ => Ok(x.clone()),
        }
    }
}

/// The hot operations the model uses.
pub trait Kernels: Send + Sync + Debug {
    /// Whether these kernels write their ops on a [`tape`] while one records, for tensors of
    /// `dtype` on `device`, so that a backward pass can be run by hand over them
    /// (the model's `BertModel::encode_taped`). Kernels that say no are run under candle's
    /// autograd; a kernel that says yes and then falls back to candle's ops for a shape
    /// (`tape::unrecorded`) makes the tape refuse the pass, which then runs again under
    /// autograd.
    fn records(&self, dtype: DType, device: &candle_core::Device) -> bool {
        let _ = (dtype, device);
        false
    }

    /// The rows of `table` (`[rows, width]`) the tokens read (an embedding lookup):
    /// `[tokens, width]`. Its backward sums each row's gradients in token order, whichever
    /// kernel runs it.
    fn gather_rows(&self, table: &Tensor, index: &RowIndex) -> Result<Tensor> {
        table.index_select(index.rows(), 0)
    }

    /// The embeddings' end on a packed batch: `dropout(LayerNorm(Σ table[rows]))` over the
    /// three `lookups` (words, token types, positions: each table `[rows, hidden]` and the rows
    /// its tokens read), summed in that order in the tables' dtype (f32 in a half-precision
    /// model), normalised as [`Kernels::layer_norm`] does and cast to `weight`'s dtype; the
    /// dropout drops what each token's place in the padded batch would
    /// ([`Mode::dropout_tokens`]). `[tokens, hidden]`.
    #[allow(clippy::too_many_arguments)]
    fn embeddings(
        &self,
        lookups: [(&Tensor, &RowIndex); 3],
        packing: &Packing,
        mode: Mode,
        dropout: f64,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        let norm = (weight, bias, eps);
        composed_embeddings(self, lookups, packing, mode, dropout, norm)
    }

    /// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * weight + bias`.
    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor>;

    /// A linear layer, `x · weightᵀ + bias`, for `x` `[..., in]` and a `[out, in]` weight
    /// (PyTorch's layout). The weight may be kept in another dtype than `x` (the masked-LM
    /// decoder's, the f32 word embeddings it is tied to): the product is in `x`'s dtype, the
    /// weight's gradient in its own.
    fn linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        composed_linear(x, weight, bias)
    }

    /// [`Kernels::linear`] whose weight's gradient goes to `sink` ([`GradientSink`]) and not
    /// to candle's graph, where an op of the kernel set can hand it over; elsewhere (the
    /// default: candle's ops) the graph holds it as [`Kernels::linear`]'s and `sink` stays
    /// empty. The same values either way.
    fn linear_into(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        sink: &GradientSink,
    ) -> Result<Tensor> {
        let _ = sink;
        self.linear(x, weight, bias)
    }

    /// The masked-LM decoder: [`Kernels::linear_into`] where `sink` is given, else
    /// [`Kernels::linear`], with a bias.
    fn decoder(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        sink: Option<&GradientSink>,
    ) -> Result<Tensor> {
        match sink {
            Some(sink) => self.linear_into(x, weight, Some(bias), sink),
            None => self.linear(x, weight, Some(bias)),
        }
    }

    /// GELU in the `form` the model's config names: exact, `x * Φ(x)` with the error function,
    /// or Google's tanh approximation.
    fn gelu(&self, x: &Tensor, form: Gelu) -> Result<Tensor>;

    /// A linear layer followed by GELU: [`Kernels::gelu`] of [`Kernels::linear`].
    fn linear_gelu(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        form: Gelu,
    ) -> Result<Tensor> {
        self.gelu(&self.linear(x, weight, bias)?, form)
    }

    /// A feed-forward block, `GELU(x · first.weightᵀ + first.bias) · second.weightᵀ +
    /// second.bias`: [`Kernels::linear`] of [`Kernels::linear_gelu`]. A kernel set may keep
    /// less for the backward pass than the two calls would (the fused kernels can keep the
    /// first product alone and recompute its activation, not hold both).
    fn feed_forward(
        &self,
        x: &Tensor,
        first: (&Tensor, Option<&Tensor>),
        second: (&Tensor, Option<&Tensor>),
        form: Gelu,
    ) -> Result<Tensor> {
        let inner = self.linear_gelu(x, first.0, first.1, form)?;
        self.linear(&inner, second.0, second.1)
    }

    /// Softmax over the last dimension.
    fn softmax_last_dim(&self, x: &Tensor) -> Result<Tensor>;

    /// Scaled dot-product attention within each sequence of a packed batch, from the query,
    /// key and value projections side by side: `qkv` is `[tokens, 3 · hidden]` (queries,
    /// keys, values, each with `heads` heads side by side), `packing` says which tokens form
    /// each sequence; `dropout` is applied to the attention probabilities in training `mode`.
    /// Returns `[tokens, hidden]`.
    fn attention(
        &self,
        qkv: &Tensor,
        packing: &Packing,
        heads: usize,
        mode: Mode,
        dropout: f64,
    ) -> Result<Tensor> {
        composed_attention(self, qkv, packing, heads, mode, dropout)
    }

    /// The end of a sublayer on a packed batch, `LayerNorm(dropout(x) + residual)`: `x` and
    /// `residual` are `[tokens, hidden]`, the dropout (probability `dropout`, in training
    /// `mode`) drops what each token's place in the padded batch would
    /// ([`Mode::dropout_tokens`]), and the norm is [`Kernels::layer_norm`]'s.
    #[allow(clippy::too_many_arguments)]
    fn residual_layer_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        packing: &Packing,
        mode: Mode,
        dropout: f64,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        let norm = (weight, bias, eps);
        composed_residual_layer_norm(self, x, residual, packing, mode, dropout, norm)
    }
}

/// The rows of a LayerNorm's input `x` and its hidden size, with each of `params` (its weight
/// and bias, or the weight alone) checked to be `[hidden]`: the same check on every device.
fn norm_shape(op: &str, x: &Layout, params: &[&Layout]) -> Result<(usize, usize)> {
    let hidden = x.dims().last().copied().unwrap_or(0);
    if hidden == 0 {
        candle_core::bail!(
            "{op}: an input with a non-empty last dimension expected, got {:?}",
            x.dims()
        )
    }
    for p in params {
        if p.dims() != [hidden] {
            candle_core::bail!("{op}: [{hidden}] parameters expected, got {:?}", p.dims())
        }
    }
    Ok((x.shape().elem_count() / hidden, hidden))
}

/// The rows and hidden size of a sublayer's end: `x` and `residual` of one shape, the
/// parameters `[2, hidden]` (weight, then bias); the same check on every device.
fn residual_norm_shape(
    op: &str,
    x: &Layout,
    residual: &Layout,
    params: &Layout,
) -> Result<(usize, usize)> {
    crate::host::same_shape(op, x, residual)?;
    let hidden = x.dims().last().copied().unwrap_or(0);
    if hidden == 0 || params.dims() != [2, hidden] {
        candle_core::bail!(
            "{op}: an input [.., hidden] and parameters [2, hidden] expected, got {:?} and {:?}",
            x.dims(),
            params.dims()
        )
    }
    Ok((x.shape().elem_count() / hidden, hidden))
}

/// The tokens and hidden size of the fused embeddings' op: the word table `[vocab, hidden]`, the
/// small tables' stack `[types + positions, hidden]` (`types` rows of token types first), the
/// norm's parameters `[2, hidden]`, and each lookup's `rows` (words, token types, positions: one
/// per token) within its table; the same check on every device.
fn embeddings_shape(
    op: &str,
    rows: [&[u32]; 3],
    types: usize,
    (words, small, params): (&Layout, &Layout, &Layout),
) -> Result<(usize, usize)> {
    let (vocab, hidden) = words.shape().dims2()?;
    let (small_rows, small_hidden) = small.shape().dims2()?;
    if small_hidden != hidden || params.dims() != [2, hidden] || types > small_rows {
        candle_core::bail!(
            "{op}: words {:?}, small tables {:?} ({types} token types), parameters {:?}",
            words.dims(),
            small.dims(),
            params.dims()
        )
    }
    let tokens = rows[0].len();
    for (r, (name, table)) in rows.iter().zip([
        ("word", vocab),
        ("token type", types),
        ("position", small_rows - types),
    ]) {
        if r.len() != tokens {
            candle_core::bail!("{op}: {} {name} rows for {tokens} tokens", r.len())
        }
        if let Some(&row) = r.iter().find(|&&row| row as usize >= table) {
            candle_core::bail!("{op}: {name} row {row} of a table of {table}")
        }
    }
    Ok((tokens, hidden))
}

/// The fused embeddings' three inputs (candle's custom ops take three): the word table, the
/// token-type and position tables stacked, and the norm's weight and bias stacked in the
/// weight's dtype, each step recorded where a tape records; the same on every device.
fn embeddings_operands(
    [(words, _), (types, _), (positions, _)]: &[(&Tensor, &RowIndex); 3],
    weight: &Tensor,
    bias: &Tensor,
) -> Result<[Tensor; 3]> {
    let small = tape::cat_rows(&[&tape::contiguous(types)?, &tape::contiguous(positions)?])?;
    let params = tape::stack_rows(&[weight, &tape::to_dtype(bias, weight.dtype())?])?;
    Ok([tape::contiguous(words)?, small, params])
}

/// The three gradients of a LayerNorm from its backward kernel's `[rows + 2, hidden]` output
/// (the input's rows, then the weight's and the bias's), as a custom op's `bwd` returns them;
/// the same packing on every device.
type NormGradients = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

fn norm_gradients(packed: &Tensor, x: &Tensor, hidden: usize) -> Result<NormGradients> {
    let rows = x.elem_count() / hidden.max(1);
    let grad_x = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
    let grad_weight = packed.narrow(0, rows, 1)?.reshape(hidden)?;
    let grad_bias = packed.narrow(0, rows + 1, 1)?.reshape(hidden)?;
    Ok((Some(grad_x), Some(grad_weight), Some(grad_bias)))
}

/// A fused CPU kernel's dropout in training `mode`: the keep bytes `draw` takes from the
/// source (it returns `None` when `p` is 0) and the scale of a kept element, `1 / (1 - p)`;
/// `None` in evaluation.
fn cpu_dropout(
    mode: Mode,
    p: f64,
    draw: impl FnOnce(&DropoutSource) -> Option<Vec<u8>>,
) -> Option<(Arc<Vec<u8>>, f32)> {
    match mode {
        Mode::Train(source) => draw(source).map(|keep| (Arc::new(keep), (1.0 / (1.0 - p)) as f32)),
        Mode::Eval => None,
    }
}

/// The negative log-likelihood of each row of `logits` (`[rows, width]`) for `labels`
/// (`[rows]` u32) through our CUDA kernel, where it takes them: `None` elsewhere.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_nll(logits: &Tensor, labels: &Tensor) -> Option<Result<Tensor>> {
    (on_cuda(&[logits]) && labels.dtype() == DType::U32).then(|| cuda::nll(logits, labels))
}

/// The rows and classes of the negative log-likelihood's operands, for `op`'s errors: logits
/// `[..., classes]` (every dimension but the last a row's: the masked-LM logits come as
/// `[batch, predictions, vocabulary]`, where a reshape to two dimensions would cost candle's
/// backward a zeroed tensor and an addition over all of them) and labels `[rows]`. The CPU's
/// kernel and the CUDA one's launcher both read them here.
pub(crate) fn nll_rows(op: &str, logits: &[usize], labels: &[usize]) -> Result<(usize, usize)> {
    let Some((&classes, leading)) = logits.split_last().filter(|(_, l)| !l.is_empty()) else {
        candle_core::bail!("{op}: [rows, classes] logits expected, got {logits:?}")
    };
    let rows: usize = leading.iter().product();
    if labels != [rows] {
        candle_core::bail!("{op}: [{rows}] labels for logits {logits:?} expected, got {labels:?}")
    }
    Ok((rows, classes))
}

/// `parts` as one tensor of `shape` (their concatenation along dimension 0, or their stack:
/// the same elements in order) by our CUDA kernel where it takes them;
/// `None` elsewhere, for the caller to join them with candle's ops (the twin).
pub(crate) fn joined_on_device(parts: &[&Tensor], shape: &[usize]) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if on_cuda(parts) && cuda::join_takes(parts) {
        return cuda::join(parts, shape.into()).map(Some);
    }
    let _ = (parts, shape);
    Ok(None)
}

/// `a + b`: two gradients of one tensor where they meet ([`tape`]), through our CUDA addition
/// where it takes them, candle's elsewhere (the CPU: the twin).
pub fn add_gradients(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dtype() != b.dtype() {
        // A gradient handed over in half precision into an f32 one ([`GradientSink`]).
        return add_gradients(a, &b.to_dtype(a.dtype())?);
    }
    #[cfg(feature = "cuda")]
    if on_cuda(&[a, b]) && a.dtype() == b.dtype() && a.dims() == b.dims() {
        return cuda::add(a, b);
    }
    a + b
}

/// Whether the fused CUDA kernels take `tensors` (on a CUDA device, in f32, bf16 or f16).
#[cfg(feature = "cuda")]
fn on_cuda(tensors: &[&Tensor]) -> bool {
    tensors
        .iter()
        .all(|t| t.device().is_cuda() && cuda::takes(t.dtype()))
}

/// The keys of a CUDA kernel's dropout in training `mode` (none in evaluation or at 0).
#[cfg(feature = "cuda")]
fn cuda_dropout(mode: Mode, p: f64) -> cuda::DeviceDropout {
    match mode {
        Mode::Train(source) => cuda::DeviceDropout::next(source, p),
        Mode::Eval => cuda::DeviceDropout::default(),
    }
}

thread_local! {
    static FUSED_CALLS: Cell<u64> = const { Cell::new(0) };
}

/// How many LayerNorm and softmax calls on this thread took a fused op ([`Fused`]'s CPU kernels
/// or candle's).
/// The model's forward pass runs its kernels on the calling thread, so a test can compare the
/// count before and after a forward pass.
pub fn fused_calls_on_this_thread() -> u64 {
    FUSED_CALLS.with(Cell::get)
}

/// Whether candle's fused ops (which have no backward) may replace the composed ones: nothing
/// among `inputs` tracks gradients, and the dtype is one candle's fused kernels take (not f64).
fn may_fuse(inputs: &[&Tensor]) -> bool {
    !trains(inputs) && inputs.iter().all(|t| t.dtype() != DType::F64)
}

/// Whether a gradient will be asked of an op on `inputs`: one of them tracks gradients for
/// candle's autograd, or a [`tape`] records the pass.
fn trains(inputs: &[&Tensor]) -> bool {
    tape::recording() || inputs.iter().any(|t| t.track_op())
}

fn count_fused() {
    FUSED_CALLS.with(|c| c.set(c.get() + 1));
}

fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `x` in f32 if it is in half precision (LayerNorm and softmax are computed in f32).
fn widened(x: &Tensor) -> Result<Tensor> {
    if is_half(x.dtype()) {
        tape::to_dtype(x, DType::F32)
    } else {
        Ok(x.clone())
    }
}

/// The default kernels: fused ops wherever one serves, [`Composed`] ones elsewhere.
///
/// - On the CPU, for f32 (and for half precision, computed in f32): our own fused linear
///   layers (bias added in the product; f32 only), LayerNorm,
///   attention (per sequence and head of the packed batch in one task: `q·kᵀ`, scale,
///   softmax, dropout and `·v`, the probabilities recomputed in the backward rather than
///   kept), a sublayer's end (dropout, residual and LayerNorm in one pass) and GELU (also
///   fused into the linear layer before it)
///   (a vectorised error function), each with a fused backward, so training and inference
///   take them alike (`kernels::cpu`).
/// - On CUDA (the `cuda` feature), in f32 and bf16: our CUDA kernels (`kernels::cuda`), each
///   with its backward: LayerNorm, a sublayer's end, a linear layer's bias with its GELU after
///   cuBLAS's product, and attention within packed sequences up to 512 positions (products in
///   cuBLAS, the scale, padding, softmax and dropout in one kernel, the probabilities
///   recomputed in the backward). Dropout drops what the CPU kernels drop. Checked against
///   the CPU kernels by `bertkit check kernels --device cuda`. Elsewhere (longer sequences,
///   rows wider than a block's shared memory) the rules below.
/// - On other devices: candle's fused LayerNorm and softmax where nothing tracks gradients (a
///   frozen inference model: the model's `ParamBuilder::frozen`); they have no
///   backward, so a trainable model takes the composed ops there.
/// - f64 (tests) always takes the composed ops.
///
/// [`fused_calls_on_this_thread`] counts the fused LayerNorm and softmax calls, so a test can
/// tell which path ran.
///
/// Its [`KernelOptions`] are the choices a caller makes (the memory plan, the checks), passed
/// down as a value: [`Fused::with`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Fused {
    options: KernelOptions,
}

/// The choices among [`Fused`]'s CUDA forms that a caller makes, each where two forms serve
/// different needs; the default is what a run takes unless its memory plan says otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelOptions {
    /// Attention in one pass over key tiles where it applies (bf16, heads of 64, compute
    /// capability 8.0 on: the products on tensor cores, the scores never written to memory);
    /// else, and at other shapes, the kernels around cuBLAS's products. On by default; the
    /// checks turn it off to check the kernels around cuBLAS at the same shapes.
    pub one_pass_attention: bool,
    /// The feed-forward keeping its first product alone, its GELU recomputed by the second
    /// layer's backward (the CPU's way), instead of the product and its activation both kept:
    /// less memory (BERT-large: ~1.4 GiB at phase 1's micro-batch of 64) for a slower training
    /// pass. On by default (inference keeps neither); the memory plan of a training run turns it
    /// off where the full form fits.
    pub lean_feed_forward: bool,
}

impl Default for KernelOptions {
    fn default() -> Self {
        KernelOptions {
            one_pass_attention: true,
            lean_feed_forward: true,
        }
    }
}

impl Fused {
    /// The fused kernels with `options`.
    pub fn with(options: KernelOptions) -> Self {
        Fused { options }
    }

    /// Their options.
    pub fn options(&self) -> KernelOptions {
        self.options
    }
}

/// Whether `x` (after widening from half precision) takes our fused CPU kernels.
fn on_cpu_in_f32(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

impl Kernels for Fused {
    fn records(&self, dtype: DType, device: &candle_core::Device) -> bool {
        match device {
            // The fused CPU linear layers take f32 only (half precision runs candle's).
            candle_core::Device::Cpu => dtype == DType::F32,
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(_) => cuda::takes(dtype),
            _ => false,
        }
    }

    fn gather_rows(&self, table: &Tensor, index: &RowIndex) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if on_cuda(&[table]) {
            return cuda::gather_rows(table, index);
        }
        table.index_select(index.rows(), 0)
    }

    fn embeddings(
        &self,
        lookups: [(&Tensor, &RowIndex); 3],
        packing: &Packing,
        mode: Mode,
        dropout: f64,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if on_cuda(&[weight, bias]) && cuda::embeddings_fit(&lookups, weight) {
            count_fused();
            let operands = embeddings_operands(&lookups, weight, bias)?;
            let keys = cuda_dropout(mode, dropout);
            return cuda::embeddings(operands, &lookups, packing, keys, eps);
        }
        if [weight, bias].into_iter().all(on_cpu_in_f32)
            && lookups.iter().all(|(table, _)| on_cpu_in_f32(table))
        {
            count_fused();
            let [words, small, params] = embeddings_operands(&lookups, weight, bias)?;
            let keep = cpu_dropout(mode, dropout, |source| {
                source.next_cpu_token_keep_mask(packing, weight.elem_count(), dropout)
            });
            let op = cpu::Embeddings {
                rows: lookups.map(|(_, rows)| rows.clone()),
                types: lookups[1].0.dim(0)?,
                eps: eps as f32,
                keep,
            };
            return tape::apply_op3(&words, &small, &params, op);
        }
        let norm = (weight, bias, eps);
        composed_embeddings(self, lookups, packing, mode, dropout, norm)
    }

    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if on_cuda(&[x]) && cuda::norm_fits(x.dim(D::Minus1)?) {
            count_fused();
            return cuda::layer_norm(x, weight, bias, eps);
        }
        let dtype = x.dtype();
        let wide = widened(x)?;
        let f32 = |t: &Tensor| tape::to_dtype(t, DType::F32);
        if on_cpu_in_f32(&wide) {
            count_fused();
            let op = cpu::LayerNorm { eps: eps as f32 };
            let normed =
                tape::apply_op3(&tape::contiguous(&wide)?, &f32(weight)?, &f32(bias)?, op)?;
            return tape::to_dtype(&normed, dtype);
        }
        if may_fuse(&[&wide, weight, bias]) {
            count_fused();
            let normed = candle_nn::ops::layer_norm(
                &wide.contiguous()?,
                &f32(weight)?,
                &f32(bias)?,
                eps as f32,
            )?;
            return normed.to_dtype(dtype);
        }
        Composed.layer_norm(x, weight, bias, eps)
    }

    fn linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(bias) = bias
            && on_cuda(&[x, weight])
        {
            return cuda::linear(x, weight, bias, None);
        }
        if weight.dtype() != x.dtype() {
            // A weight kept in another dtype: cast (a node of its own), then the layer.
            return self.linear(x, &tape::to_dtype(weight, x.dtype())?, bias);
        }
        match bias {
            Some(bias) if on_cpu_in_f32(x) && weight.dtype() == DType::F32 => {
                tape::apply_op3(&tape::contiguous(x)?, weight, bias, cpu::Linear::new())
            }
            // Half precision on the CPU: candle's product, and the bias whose gradient is
            // summed in f32.
            Some(bias)
                if x.device().is_cpu() && is_half(x.dtype()) && bias.dtype() == x.dtype() =>
            {
                let product = composed_linear(x, weight, None)?;
                let dims = product.dims().to_vec();
                let out = weight.dim(0)?;
                product
                    .reshape(((), out))?
                    .apply_op2(bias, cpu::HalfBias)?
                    .reshape(dims)
            }
            _ => composed_linear(x, weight, bias),
        }
    }

    fn linear_into(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        sink: &GradientSink,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(bias) = bias
            && on_cuda(&[x, weight])
        {
            return cuda::linear_into(x, weight, bias, sink);
        }
        match bias {
            Some(bias) if on_cpu_in_f32(x) && weight.dtype() == DType::F32 => tape::apply_op3(
                &tape::contiguous(x)?,
                weight,
                bias,
                cpu::Linear::handing_to(sink),
            ),
            _ => self.linear(x, weight, bias),
        }
    }

    fn linear_gelu(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        form: Gelu,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(bias) = bias
            && on_cuda(&[x, weight])
        {
            return cuda::linear(x, weight, bias, Some(form));
        }
        match bias {
            Some(bias) if on_cpu_in_f32(x) && weight.dtype() == DType::F32 => {
                let op = cpu::LinearGelu::new(trains(&[x, weight, bias]), form);
                tape::apply_op3(&tape::contiguous(x)?, weight, bias, op)
            }
            _ => self.gelu(&self.linear(x, weight, bias)?, form),
        }
    }

    fn feed_forward(
        &self,
        x: &Tensor,
        (w1, b1): (&Tensor, Option<&Tensor>),
        (w2, b2): (&Tensor, Option<&Tensor>),
        form: Gelu,
    ) -> Result<Tensor> {
        // Where gradients are tracked, the first product is kept alone: the second layer's
        // op applies GELU to its input itself and recomputes it in the backward pass, so the
        // activation (`[tokens, intermediate]`, a quarter of a BERT layer's kept bytes) is
        // not held beside it. Inference takes the pair with GELU in place.
        let inputs: Vec<&Tensor> = [Some(x), Some(w1), b1, Some(w2), b2]
            .into_iter()
            .flatten()
            .collect();
        if let (Some(b1), Some(b2), true) = (b1, b2, trains(&inputs)) {
            #[cfg(feature = "cuda")]
            if self.options.lean_feed_forward && on_cuda(&[x, w1, w2]) {
                return cuda::gelu_linear(&self.linear(x, w1, Some(b1))?, w2, b2, form);
            }
            if on_cpu_in_f32(x) && [w1, b1, w2, b2].iter().all(|t| t.dtype() == DType::F32) {
                let pre = self.linear(x, w1, Some(b1))?;
                return tape::apply_op3(&pre, w2, b2, cpu::GeluLinear::new(form));
            }
        }
        let inner = self.linear_gelu(x, w1, b1, form)?;
        self.linear(&inner, w2, b2)
    }

    fn gelu(&self, x: &Tensor, form: Gelu) -> Result<Tensor> {
        // Not counted with LayerNorm and softmax: candle has no fused GELU to stand in for.
        #[cfg(feature = "cuda")]
        if on_cuda(&[x]) {
            return cuda::activation(x, form);
        }
        if on_cpu_in_f32(x) {
            return tape::apply_op1(&tape::contiguous(x)?, cpu::GeluOp { form });
        }
        Composed.gelu(x, form)
    }

    fn attention(
        &self,
        qkv: &Tensor,
        packing: &Packing,
        heads: usize,
        mode: Mode,
        dropout: f64,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if on_cuda(&[qkv]) && packing.padded_dims().1 <= cuda::MAX_SEQ {
            count_fused();
            let dropout = cuda_dropout(mode, dropout);
            return cuda::attention(
                qkv,
                packing,
                heads,
                dropout,
                self.options.one_pass_attention,
            );
        }
        let dtype = qkv.dtype();
        if !(qkv.device().is_cpu() && (dtype == DType::F32 || is_half(dtype))) {
            return composed_attention(self, qkv, packing, heads, mode, dropout);
        }
        count_fused();
        let keep = cpu_dropout(mode, dropout, |source| {
            source.next_cpu_attention_keep_mask(packing, heads, dropout)
        });
        let head = qkv.dim(D::Minus1)? / 3 / heads.max(1);
        let op = cpu::Attention {
            heads,
            scale: (1.0 / (head as f64).sqrt()) as f32,
            starts: packing.shared_starts(),
            keep,
        };
        let qkv = tape::contiguous(&tape::to_dtype(qkv, DType::F32)?)?;
        tape::to_dtype(&tape::apply_op1(&qkv, op)?, dtype)
    }

    fn residual_layer_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        packing: &Packing,
        mode: Mode,
        dropout: f64,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if on_cuda(&[x, residual]) && cuda::norm_fits(x.dim(D::Minus1)?) {
            count_fused();
            let keys = cuda_dropout(mode, dropout);
            return cuda::residual_layer_norm(x, residual, packing, keys, (weight, bias, eps));
        }
        if ![x, residual, weight, bias].into_iter().all(on_cpu_in_f32) {
            let norm = (weight, bias, eps);
            return composed_residual_layer_norm(self, x, residual, packing, mode, dropout, norm);
        }
        count_fused();
        let width = x.dim(D::Minus1)?;
        let keep = cpu_dropout(mode, dropout, |source| {
            source.next_cpu_token_keep_mask(packing, width, dropout)
        });
        let op = cpu::ResidualLayerNorm {
            eps: eps as f32,
            keep,
        };
        tape::apply_op3(
            &tape::contiguous(x)?,
            &tape::contiguous(residual)?,
            &tape::stack_rows(&[weight, bias])?,
            op,
        )
    }

    fn softmax_last_dim(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let wide = widened(x)?;
        if may_fuse(&[&wide]) {
            count_fused();
            return candle_nn::ops::softmax_last_dim(&wide.contiguous()?)?.to_dtype(dtype);
        }
        Composed.softmax_last_dim(x)
    }
}
