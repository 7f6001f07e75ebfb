//! The hot operations, behind one small interface.
//!
//! The model calls linear layers, LayerNorm, GELU, softmax and attention only through
//! [`Kernels`], so that a fused implementation can replace one without touching the model code.
//! Two implementations:
//!
//! - [`Composed`] (`composed.rs`), the reference: every op composed of candle primitives that
//!   have a backward pass, so gradients flow through all of them, on every device and dtype.
//! - [`Fused`], the default: on the CPU our own fused kernels with fused backward passes
//!   (`cpu/`, a file per op), for training and inference alike; on CUDA ours too (`cuda/`,
//!   f32 and bf16, [`set_cuda_kernels`]); elsewhere candle's fused
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

use std::cell::Cell;
use std::fmt::Debug;
use std::sync::Arc;

use candle_core::{D, DType, Layout, Result, Tensor};

pub use crate::config::Gelu;
use crate::dropout::DropoutSource;
use crate::packing::{Packing, RowIndex};
use crate::switch::Switch;

pub mod check;
mod composed;
pub(crate) mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod profiled;
pub mod tape;

pub use composed::Composed;
use composed::{
    composed_attention, composed_embeddings, composed_linear, composed_residual_layer_norm,
};
pub(crate) use profiled::{Caller, Mark, backward as profiled_backward, time_backwards};
pub use profiled::{Clock, KernelTime, Profiled};

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
                if cuda_keyed_dropout() && x.rank() == 2 && on_cuda(&[x]) {
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
                if cuda_keyed_dropout() && x.rank() == 2 && on_cuda(&[x]) {
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
    /// ([`crate::bert::BertModel::encode_taped`]). Kernels that say no are run under candle's
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

/// Whether [`Fused`] takes its CUDA kernels on a CUDA device.
static CUDA_KERNELS: Switch = Switch::opt_out("BERTKIT_CUDA_KERNELS", "composed");

/// Turns [`Fused`]'s CUDA kernels on or off for this process (the `cuda` feature; without it
/// there are none and this changes nothing). Unset, they are on unless the environment says
/// `BERTKIT_CUDA_KERNELS=composed` (candle's ops, the reference, as before the kernels); they
/// passed their check (`bertkit check kernels --device cuda`) on an H200 (BENCHMARKS.md).
pub fn set_cuda_kernels(on: bool) {
    CUDA_KERNELS.set(on);
}

/// Whether [`Fused`] takes its CUDA kernels on a CUDA device (see [`set_cuda_kernels`]).
pub fn cuda_kernels() -> bool {
    CUDA_KERNELS.get()
}

/// Whether the CUDA feed-forward keeps only its first product.
pub(crate) static LEAN_CUDA_FEED_FORWARD: Switch =
    Switch::opt_out("BERTKIT_CUDA_FEED_FORWARD", "full");

/// Turns the lean feed-forward on CUDA on or off for this process: the first product kept
/// alone and its GELU recomputed by the second layer's backward ([`Kernels::feed_forward`]),
/// the CPU's way, instead of the product and its activation both kept (BERT-large: 1.5 GiB
/// less at phase 1's micro-batch of 64: 11.2 GiB against 12.6 measured on an H200, for ~4 ms
/// more a pass: the GELU recomputed). Unset, it is on unless `BERTKIT_CUDA_FEED_FORWARD=full`
/// (`=lean` chooses it); both forms passed their check on an H200 (BENCHMARKS.md,
/// 2026-11-27). A pre-training run that finds it unchosen ([`lean_cuda_feed_forward_chosen`])
/// takes the full form when its memory plan says that fits.
pub fn set_lean_cuda_feed_forward(on: bool) {
    LEAN_CUDA_FEED_FORWARD.set(on);
}

/// Whether the CUDA feed-forward is the lean one (see [`set_lean_cuda_feed_forward`]).
pub fn lean_cuda_feed_forward() -> bool {
    LEAN_CUDA_FEED_FORWARD.get()
}

/// The feed-forward form someone chose (`BERTKIT_CUDA_FEED_FORWARD`, or
/// [`set_lean_cuda_feed_forward`]): `Some(lean)`; `None` while the default stands, free for a
/// caller that knows the memory to choose.
pub fn lean_cuda_feed_forward_chosen() -> Option<bool> {
    LEAN_CUDA_FEED_FORWARD.chosen()
}

/// Whether the encoder's backward pass on CUDA runs by hand over the kernels' tape.
pub(crate) static CUDA_TAPE: Switch = Switch::opt_out("BERTKIT_CUDA_BACKWARD", "autograd");

/// Turns the encoder's backward pass by hand ([`tape`]) on or off for CUDA in this process.
/// It calls the CUDA kernels' own backward passes, which passed their check, in the order
/// candle's autograd calls them, and gives the same bits on the CPU. Unset, it is on unless
/// `BERTKIT_CUDA_BACKWARD=autograd`; it passed its check (`bertkit check kernels --device
/// cuda` compares it with autograd) on an H200 (BENCHMARKS.md, 2026-11-27). On the CPU it is
/// always on.
pub fn set_cuda_tape(on: bool) {
    CUDA_TAPE.set(on);
}

/// Whether the encoder's backward pass on CUDA runs by hand (see [`set_cuda_tape`]).
pub fn cuda_tape() -> bool {
    CUDA_TAPE.get()
}

/// Whether attention on CUDA runs in one pass over key tiles.
pub(crate) static CUDA_FLASH_ATTENTION: Switch =
    Switch::opt_out("BERTKIT_CUDA_ATTENTION", "cublas");

/// Turns attention in one pass over key tiles on CUDA on or off for this process (bf16, heads
/// of 64, GPUs of compute capability 8.0 and later: the products on tensor cores, the scores
/// never written to memory, the queries, keys and values read from the tokens where they are).
/// Other shapes and dtypes keep the kernels around cuBLAS. Unset, it is on unless
/// `BERTKIT_CUDA_ATTENTION=cublas` (the kernels around cuBLAS everywhere); it passed its check
/// (`bertkit check kernels --device cuda`, its `attention flash` rows) on an H200
/// (BENCHMARKS.md, 2026-11-27).
pub fn set_cuda_flash_attention(on: bool) {
    CUDA_FLASH_ATTENTION.set(on);
}

/// Whether attention on CUDA takes the one-pass kernels where they apply (see
/// [`set_cuda_flash_attention`]).
pub fn cuda_flash_attention() -> bool {
    CUDA_FLASH_ATTENTION.get()
}

/// Whether the losses on CUDA take our kernel.
pub(crate) static CUDA_LOSS: Switch = Switch::opt_out("BERTKIT_CUDA_LOSS", "composed");

/// Turns our CUDA loss kernel on or off for this process: the negative log-likelihood of each
/// row of logits (the masked-LM head's `[slots, vocabulary]`, the classifiers') in one pass
/// over f32 or bf16 logits as they are, keeping only each row's log-sum-exp, and its backward
/// in one more, where candle's ops take the logits to f32 and through a log-softmax whose
/// every intermediate autograd keeps. Unset, it is on unless `BERTKIT_CUDA_LOSS=composed`; it
/// passed its check (`bertkit check kernels --device cuda`, its `nll` rows) on an H200
/// (BENCHMARKS.md, 2026-11-27).
pub fn set_cuda_loss(on: bool) {
    CUDA_LOSS.set(on);
}

/// Whether the losses on CUDA take our kernel (see [`set_cuda_loss`]).
pub fn cuda_loss() -> bool {
    CUDA_LOSS.get()
}

/// The negative log-likelihood of each row of `logits` (`[rows, width]`) for `labels`
/// (`[rows]` u32) through our CUDA kernel, where it takes them (see [`set_cuda_loss`]):
/// `None` elsewhere.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_nll(logits: &Tensor, labels: &Tensor) -> Option<Result<Tensor>> {
    (cuda_loss() && on_cuda(&[logits]) && labels.dtype() == DType::U32)
        .then(|| cuda::nll(logits, labels))
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

/// Whether embedding lookups on CUDA take our kernel.
pub(crate) static CUDA_EMBEDDINGS: Switch = Switch::opt_out("BERTKIT_CUDA_EMBEDDINGS", "composed");

/// Turns our CUDA embedding lookup ([`Kernels::gather_rows`]) on or off for this process:
/// the forward gathers the rows in parallel and the backward sums each table row's gradients
/// apart (in pieces, [`set_cuda_embeddings_in_pieces`]; by row, in token order, the bits of
/// candle's backward), where candle's backward walks every token of the batch in one block of
/// threads (one thread per column), one after the other.
/// Unset, it is on unless `BERTKIT_CUDA_EMBEDDINGS=composed`; it passed its check (`bertkit
/// check kernels --device cuda`) on an H200 (BENCHMARKS.md, 2026-11-27).
pub fn set_cuda_embeddings(on: bool) {
    CUDA_EMBEDDINGS.set(on);
}

/// Whether embedding lookups on CUDA take our kernel (see [`set_cuda_embeddings`]).
pub fn cuda_embeddings() -> bool {
    CUDA_EMBEDDINGS.get()
}

/// Whether our CUDA embedding lookup's backward sums each row's tokens in pieces.
pub(crate) static CUDA_EMBEDDINGS_IN_PIECES: Switch =
    Switch::opt_out("BERTKIT_CUDA_EMBEDDINGS", "by-row");

/// Turns the lookup's backward in pieces on or off for this process: each table row's tokens
/// summed in pieces of at most 64 by as many blocks, then each row's pieces in order, in f32
/// (two launches), where the backward by row gives each row one block that adds its tokens
/// one after the other (on an H200 the token types of a BERT-large batch, two rows of 4,096
/// tokens each, took 1.3 ms; in pieces the lookups' backward fell from 3.57 to 0.27 ms a
/// BERT-large phase-1 pass). Unset, it is on unless `BERTKIT_CUDA_EMBEDDINGS=by-row`; it
/// passed its check on an H200 (BENCHMARKS.md, 2026-11-27).
pub fn set_cuda_embeddings_in_pieces(on: bool) {
    CUDA_EMBEDDINGS_IN_PIECES.set(on);
}

/// Whether the lookup's backward runs in pieces (see [`set_cuda_embeddings_in_pieces`]).
pub fn cuda_embeddings_in_pieces() -> bool {
    CUDA_EMBEDDINGS_IN_PIECES.get()
}

/// Whether a CUDA linear layer casts a weight of another dtype itself.
pub(crate) static CUDA_LINEAR_CAST: Switch = Switch::opt_out("BERTKIT_CUDA_LINEAR_CAST", "outside");

/// Turns on or off, for this process, a CUDA linear layer taking a weight kept in another dtype
/// than its input as it is (the masked-LM decoder's: the f32 word embeddings it is tied to, in a
/// bf16 or f16 model): the op casts a copy for its product and, in its backward, the weight's
/// gradient back to the weight's dtype, one node in candle's autograd. Without it the weight is
/// cast first, a node of its own (`[30522, 1024]` in bf16 for BERT-large, kept until the backward),
/// whose gradient candle's autograd zeroes and adds into (62 MB and 186 MB through candle's
/// addition, an element a thread) before its cast's backward. The same products and casts. Checked
/// by `bertkit check kernels --device cuda` (its `linear (f32 weight)` rows); it passed its check
/// on an H200, where with the linear layers' backward through cuBLASLt and their end's forward by
/// rows a phase-1 pass took what it took without (48.7 ms against 48.9, the cast's time moving from
/// candle's ops to the linear layers') (BENCHMARKS.md, H200, 2026-11-27, evening): on with them, as
/// the measured defaults; unset, it is on unless `BERTKIT_CUDA_LINEAR_CAST=outside`.
pub fn set_cuda_linear_cast(on: bool) {
    CUDA_LINEAR_CAST.set(on);
}

/// Whether a CUDA linear layer casts a weight of another dtype itself (see
/// [`set_cuda_linear_cast`]).
pub fn cuda_linear_cast() -> bool {
    CUDA_LINEAR_CAST.get()
}

/// Whether the embeddings' end on CUDA takes our fused kernel.
pub(crate) static CUDA_EMBEDDINGS_END: Switch =
    Switch::opt_out("BERTKIT_CUDA_EMBEDDINGS_END", "composed");

/// Turns our CUDA kernel for the embeddings' end ([`Kernels::embeddings`]) on or off for this
/// process: each token's word, token-type and position rows summed, LayerNorm and dropout in one
/// launch (a warp a token), its backward recomputing the rows from the tables and handing the
/// sum's gradient to the lookup's backward, table by table. The composed path writes the three
/// rows gathered as `[tokens, hidden]` f32 tensors, adds them with two of candle's additions
/// (an element a thread), normalises in f32, casts and drops in passes of their own, and
/// candle's autograd adds a zeroed gradient and a sum at each of that graph's edges on the way
/// back: a dozen passes over f32 tensors of a BERT-large batch's 33.5 MB, forward and backward,
/// where the kernel reads each row once and writes the output once. The dropout draws the
/// CPU's masks (the composed path's candle dropout does not, [`set_cuda_keyed_dropout`]).
/// Checked by `bertkit check kernels --device cuda` (its `embeddings` rows, against the
/// composed path on the CPU) and emulated on the CPU (`bench/gpu/emulate`); it passed its
/// check on an H200, where a phase-1 pass's embeddings took 0.17 ms where they took 0.94
/// (inference 0.11 where 0.35) (BENCHMARKS.md, H200, 2026-11-27, evening): unset, it is on unless
/// `BERTKIT_CUDA_EMBEDDINGS_END=composed`.
pub fn set_cuda_embeddings_end(on: bool) {
    CUDA_EMBEDDINGS_END.set(on);
}

/// Whether the embeddings' end takes our fused kernel on CUDA (see
/// [`set_cuda_embeddings_end`]).
pub fn cuda_embeddings_end() -> bool {
    CUDA_EMBEDDINGS_END.get()
}

/// Whether the embeddings' and the pooler's dropout on CUDA take our keyed kernel.
pub(crate) static CUDA_KEYED_DROPOUT: Switch = Switch::opt_out("BERTKIT_CUDA_DROPOUT", "candle");

/// Turns our CUDA kernel for the dropout outside the fused kernels (the embeddings', on a packed
/// `[tokens, width]` tensor, and the pooler's) on or off for this process: the CPU's keyed masks, a
/// block per row, the backward the same mask on the gradient, each kept element scaled in f32.
/// Without it these go through candle (a cuRAND uniform per element, a comparison, two casts and a
/// product: on an H200 ~0.4 ms of a BERT-large phase-1 pass; BENCHMARKS.md, 2026-11-27), with masks
/// other than the CPU's for the same keys, and in bf16 the scale rounded to bf16 (1.109 for 1.111).
/// Checked by `bertkit check kernels --device cuda` (its `dropout` rows, against the CPU's masks);
/// it passed its check on an H200 (BENCHMARKS.md, H200, 2026-11-27, evening): unset, it is on
/// unless `BERTKIT_CUDA_DROPOUT=candle`.
pub fn set_cuda_keyed_dropout(on: bool) {
    CUDA_KEYED_DROPOUT.set(on);
}

/// Whether the dropout outside the fused kernels takes our keyed kernel on CUDA (see
/// [`set_cuda_keyed_dropout`]).
pub fn cuda_keyed_dropout() -> bool {
    CUDA_KEYED_DROPOUT.get()
}

/// Whether the tape's gradient sums on CUDA take our addition.
pub(crate) static CUDA_ADD: Switch = Switch::opt_out("BERTKIT_CUDA_ADD", "composed");

/// Turns our CUDA addition for the backward pass's gradient sums ([`tape`]: where a tensor's
/// gradients from two ops meet, a layer's input and a residual's) on or off for this process:
/// 16 bytes a thread where candle's addition takes one element a thread (on an H200, 70 µs for
/// a BERT-large batch's `[8192, 1024]` bf16 sum, about 0.7 TB/s, two such a layer; ours 13
/// µs). Unset, it is on unless `BERTKIT_CUDA_ADD=composed`; it passed its check (its `add`
/// rows, and the encoder's backward by hand, which sums through it) on an H200 (BENCHMARKS.md,
/// 2026-11-27).
pub fn set_cuda_add(on: bool) {
    CUDA_ADD.set(on);
}

/// Whether the gradient sums on CUDA take our addition (see [`set_cuda_add`]).
pub fn cuda_add() -> bool {
    CUDA_ADD.get()
}

/// Whether LayerNorm's backward on CUDA spreads its rows over more blocks.
pub(crate) static CUDA_NORM_WIDE_GRID: Switch = Switch::opt_out("BERTKIT_CUDA_NORM_GRID", "narrow");

/// Turns LayerNorm's backward on CUDA (and a sublayer's end's) over a wider grid on or off for
/// this process: up to 2,048 blocks, four rows a block at BERT-large's 8,192 tokens, where 512
/// blocks take 16 rows each, one after the other, each row waiting on four block-wide sums (on
/// an H200 that backward took 102 µs for `[8192, 1024]` bf16, about a quarter of the card's
/// bandwidth). The same kernel; more partial sums of the weight's and bias's gradients, added
/// by the same second launch. It passed its check (`bertkit check kernels --device cuda`, its
/// norm rows at 778 tokens) on an H200 (BENCHMARKS.md, 2026-11-27): unset, it is on unless
/// `BERTKIT_CUDA_NORM_GRID=narrow`.
pub fn set_cuda_norm_wide_grid(on: bool) {
    CUDA_NORM_WIDE_GRID.set(on);
}

/// Whether LayerNorm's backward on CUDA takes the wider grid (see
/// [`set_cuda_norm_wide_grid`]).
pub fn cuda_norm_wide_grid() -> bool {
    CUDA_NORM_WIDE_GRID.get()
}

/// Whether LayerNorm on CUDA takes its kernels 16 bytes a thread.
pub(crate) static CUDA_NORM_VECTOR: Switch = Switch::opt_out("BERTKIT_CUDA_NORM", "block");

/// Turns LayerNorm's (and a sublayer's end's) kernels 16 bytes a thread on or off for this
/// process: a block per row still, each thread holding 16 bytes of the row (8 bf16 or f16, 4
/// f32) in registers, read and written with one access each, the dropout's keeps drawn once a
/// row (the backward reuses them) and `a` and `b` of the backward summed in one block-wide
/// pass, where the block-per-row kernels read and write an element a thread at a time through
/// a row kept in shared memory (on an H200 their backward took 102 µs for `[8192, 1024]` bf16,
/// about a quarter of the card's bandwidth; the forward 54 µs; BENCHMARKS.md, 2026-11-27). For
/// rows of a whole number of 16-byte pieces, at most 1,024 of them, each input starting on a
/// 16-byte boundary; others keep the block-per-row kernels. The same sums in another order:
/// `bench/gpu/emulate` compares the two forms (f32 within 2.4e-7; bf16 and f16 the same
/// elements but where a sum straddles a rounding) and `bertkit check kernels --device cuda`
/// each against the CPU (its `vector` norm rows); on an H200 it passed, and with the lanes'
/// sums and the wider grid took a phase-1 pass's sublayer ends from 2.56 + 6.80 ms to 1.57 +
/// 4.16 (BENCHMARKS.md, 2026-11-27): unset, it is on unless `BERTKIT_CUDA_NORM=block`.
pub fn set_cuda_norm_vector(on: bool) {
    CUDA_NORM_VECTOR.set(on);
}

/// Whether LayerNorm on CUDA takes its kernels 16 bytes a thread (see
/// [`set_cuda_norm_vector`]).
pub fn cuda_norm_vector() -> bool {
    CUDA_NORM_VECTOR.get()
}

/// Whether a linear layer's end's forward on CUDA fixes each thread's columns.
pub(crate) static CUDA_BIAS_ACT_ROWS: Switch =
    Switch::opt_out("BERTKIT_CUDA_BIAS_ACT_FORWARD", "pieces");

/// Turns a linear layer's end's forward with each thread's columns fixed on or off for this process
/// (with [`set_cuda_bias_act_vector`]'s 16 bytes a thread): a thread takes one 16-byte piece of a
/// row at every fourth row, its bias read and widened once, where the form in use takes one piece
/// of the whole matrix and finds its bias by a 64-bit remainder and reads and widens it each time.
/// The pass is issue-bound on `erff` (the feed-forward's GELU for `[8192, 4096]` bf16 took 49.6 µs
/// on an H200, the SM at 68%): compiled for sm_90, a thread's path for 8 bf16 elements with a bias
/// and GELU is ~247 instructions where it is ~310. The same arithmetic on each element: the same
/// bits (`bench/gpu/emulate`). Checked by `bertkit check kernels --device cuda` (the linear, GELU
/// and feed-forward rows); it passed its check on an H200, where an inference pass's feed-forward
/// took 5.72 ms where it took 5.89 (BENCHMARKS.md, H200, 2026-11-27, evening): unset, it is on
/// unless `BERTKIT_CUDA_BIAS_ACT_FORWARD=pieces`.
pub fn set_cuda_bias_act_rows(on: bool) {
    CUDA_BIAS_ACT_ROWS.set(on);
}

/// Whether a linear layer's end's forward fixes each thread's columns (see
/// [`set_cuda_bias_act_rows`]).
pub fn cuda_bias_act_rows() -> bool {
    CUDA_BIAS_ACT_ROWS.get()
}

/// Whether a linear layer's end on CUDA takes its kernels 16 bytes a thread.
pub(crate) static CUDA_BIAS_ACT_VECTOR: Switch = Switch::opt_out("BERTKIT_CUDA_BIAS_ACT", "scalar");

/// Turns a linear layer's end on CUDA 16 bytes a thread on or off for this process: the bias
/// and the activation (the feed-forward's GELU) after cuBLAS's product, and in the backward the
/// activation's slope with the bias's partial sums, each thread reading and writing 16 bytes of
/// a row at a time where the kernels in use take an element a thread (on an H200 they ran at
/// ~2.6 and ~2.8 TB/s for BERT-large's `[8192, 4096]`: 52 and 68 µs a call, a layer's forward
/// and backward; BENCHMARKS.md, 2026-11-27). The same arithmetic per element and the same order
/// of each column's sum: the same bits (`bench/gpu/emulate` compares them). For rows of whole
/// 16-byte pieces with every input on a 16-byte boundary; others keep the kernels an element a
/// thread. It passed its check (`bertkit check kernels --device cuda`, the linear, GELU and
/// feed-forward rows) on an H200, where a phase-1 step went from 63 to 56 ms (the linear
/// layers' backward 15.8 -> 12.2 ms a pass, the feed-forward's 6.8 + 11.3 -> 5.9 + 8.1;
/// BENCHMARKS.md, 2026-11-27): unset, it is on unless `BERTKIT_CUDA_BIAS_ACT=scalar`.
pub fn set_cuda_bias_act_vector(on: bool) {
    CUDA_BIAS_ACT_VECTOR.set(on);
}

/// Whether a linear layer's end on CUDA takes its kernels 16 bytes a thread (see
/// [`set_cuda_bias_act_vector`]).
pub fn cuda_bias_act_vector() -> bool {
    CUDA_BIAS_ACT_VECTOR.get()
}

/// Whether LayerNorm's forward on CUDA takes a warp per row.
pub(crate) static CUDA_NORM_WARP_FORWARD: Switch =
    Switch::opt_out("BERTKIT_CUDA_NORM_FORWARD", "block");

/// Turns LayerNorm's (and a sublayer's end's) forward a warp per row on or off for this
/// process: a lane holds up to four 16-byte pieces of the row with all of its loads in flight,
/// the statistics are warp sums without a block-wide barrier, the weight and bias read from
/// the cache where a piece needs them. The forward 16 bytes a thread (a block per row) waits
/// on its loads and then on four barriers a row: on an H200 it moved BERT-large's `[8192,
/// 1024]` bf16 in 27 µs (1.9 TB/s) at half occupancy (BENCHMARKS.md, 2026-11-27). For rows the
/// 16-byte form takes of at most 128 pieces (1,024 bf16); the backward is unchanged. The same
/// sums in another order: `bench/gpu/emulate` compares it with the block-per-row forward
/// (bf16 within 5.8e-5 of the largest magnitude) and `bertkit check kernels --device cuda`
/// with the CPU (its `warp forward` norm rows). ptxas (sm_90): 75 registers, no spills, six
/// blocks of four warps an SM. It passed on an H200, where an inference pass's sublayer ends
/// went from 1.30 to 1.02 ms (27 to 24 µs a call with dropout, its hashing then the bound;
/// BENCHMARKS.md, 2026-11-27): unset, it is on unless `BERTKIT_CUDA_NORM_FORWARD=block`.
pub fn set_cuda_norm_warp_forward(on: bool) {
    CUDA_NORM_WARP_FORWARD.set(on);
}

/// Whether LayerNorm's forward on CUDA takes a warp per row (see
/// [`set_cuda_norm_warp_forward`]).
pub fn cuda_norm_warp_forward() -> bool {
    CUDA_NORM_WARP_FORWARD.get()
}

/// Whether LayerNorm's backward on CUDA (16 bytes a thread) loads a row's inputs at once.
pub(crate) static CUDA_NORM_BACKWARD_AHEAD: Switch =
    Switch::opt_out("BERTKIT_CUDA_NORM_BACKWARD", "after");

/// Turns LayerNorm's (and a sublayer's end's) backward with each row's loads at once on or off for
/// this process (its 16-byte form, [`set_cuda_norm_vector`]): a thread's pieces of the row's input,
/// residual and output gradient loaded together at the row's start, where the backward in use loads
/// the gradient only after the statistics' two block-wide sums: two trips to memory a row that
/// nothing overlaps (a block's rows come one after the other, four a block at BERT-large's 8,192
/// tokens; 48 such backwards a pass), one. The same arithmetic in the same order: the same bits
/// (`bench/gpu/emulate` compares it with the backward in use: f32, bf16, f16, with and without a
/// residual and dropout). ptxas (sm_90): 79 registers (the form in use 80), held there by its
/// launch bounds (92 unbounded: five blocks an SM, not six), no spills. Checked by `bertkit check
/// kernels --device cuda` (its `backward ahead` norm rows); it passed its check on an H200, where
/// with the keep bits ([`set_cuda_norm_keep_bits`]) a phase-1 pass's sublayer ends' backward took
/// 3.41 ms where it took 4.09 (BENCHMARKS.md, H200, 2026-11-27, evening): unset, it is on unless
/// `BERTKIT_CUDA_NORM_BACKWARD=after`.
pub fn set_cuda_norm_backward_ahead(on: bool) {
    CUDA_NORM_BACKWARD_AHEAD.set(on);
}

/// Whether LayerNorm's backward on CUDA loads each row's inputs at once (see
/// [`set_cuda_norm_backward_ahead`]).
pub fn cuda_norm_backward_ahead() -> bool {
    CUDA_NORM_BACKWARD_AHEAD.get()
}

/// Whether LayerNorm's backward on CUDA takes a warp per row.
pub(crate) static CUDA_NORM_BACKWARD_WARP: Switch =
    Switch::opt_out("BERTKIT_CUDA_NORM_BACKWARD_ROWS", "block");

/// Turns on or off, for this process, LayerNorm's (and a sublayer end's) backward a warp per row
/// (`layer_norm_warp_backward`, the forward a warp per row's twin, for the rows it takes: up to
/// 1,024 bf16 or 512 f32 elements), where the form in use ([`set_cuda_norm_backward_ahead`])
/// gives a row a block of 128 threads and four block-wide sums (eight barriers) between its
/// loads and its stores: on an H200 60 µs a BERT-large sublayer end at phase 1's 8,192 tokens
/// (~1.4 TB/s; 48 a pass, ~2.9 ms), its grid four rows a block. Here a lane loads its four
/// pieces of the row's input, residual and gradient at once, the row's sums are warp shuffles,
/// and each warp adds the weight's and bias's gradients of its rows into its own slice of the
/// block's shared memory (the block adds its four warps' in order: the parameters' partial sums
/// are `[blocks, 2, hidden]` as before, with as many blocks as the device holds at once (the
/// driver's occupancy: five an SM on an H200) rather than 2,048 of them: 2.6 MiB where 16 MiB
/// at BERT-large's width). It reads the forward's keep bytes
/// where they are written ([`set_cuda_norm_keep_bits`]). ptxas (sm_90): 94 registers under its
/// launch bounds (five blocks of four warps an SM), no spills; in registers the parameter sums
/// took 165 (three blocks). The same arithmetic an element; the row's sums and the parameters'
/// in another order: `bench/gpu/emulate` compares it with the backward in use (f32, bf16, f16,
/// with and without a residual and dropout: bf16 within 1.4e-4 of the largest magnitude, the
/// keep bytes' and the drawn keeps' gradients the same bits). Checked by `bertkit check kernels
/// --device cuda` (its `backward a warp a row` norm rows); it passed its check on an H200, where
/// a BERT-large phase-1 training pass's sublayer ends' backward took 1.71 ms where 3.39
/// (BENCHMARKS.md, H200, 2026-11-28, evening): unset, it is on unless
/// `BERTKIT_CUDA_NORM_BACKWARD_ROWS=block`.
pub fn set_cuda_norm_backward_warp(on: bool) {
    CUDA_NORM_BACKWARD_WARP.set(on);
}

/// Whether LayerNorm's backward on CUDA takes a warp per row (see
/// [`set_cuda_norm_backward_warp`]).
pub fn cuda_norm_backward_warp() -> bool {
    CUDA_NORM_BACKWARD_WARP.get()
}

/// Whether a sublayer end's forward on CUDA hands its dropout's keep bits to its backward.
pub(crate) static CUDA_NORM_KEEP_BITS: Switch =
    Switch::opt_out("BERTKIT_CUDA_NORM_DROPOUT", "drawn");

/// Turns a sublayer end's keep bits on or off for this process (with LayerNorm's forward a warp per
/// row, [`set_cuda_norm_warp_forward`], whose form writes them; its backward then takes the form
/// with a row's loads at once, [`set_cuda_norm_backward_ahead`], reading them): in training the
/// forward writes which elements its dropout keeps (a byte a 16-byte piece: a bit an element in
/// bf16, 1 MiB a BERT-large sublayer end at phase 1's 8,192 tokens, 48 MiB a pass), and the
/// backward reads them where it drew every keep again from the keys (a splitmix64 an element, and
/// the row's line in every thread). The same masks, so the same bits (`bench/gpu/emulate`: the
/// forward's output and the backward's gradients against the forms without, f32, bf16, f16).
/// Compiled for sm_90, the bf16 backward's row loop has 484 instructions where the form without has
/// 794; the forward's 1,820 where 1,710 (its stores). The forward with dropout took 24 µs a call on
/// an H200 where it took 12.7 without (its hashing the bound; BENCHMARKS.md, 2026-11-27): the
/// forward still draws them. Checked by `bertkit check kernels --device cuda` (its `keep bits` norm
/// row); it passed its check on an H200 (with the backward above: 3.41 ms where 4.09,
/// BENCHMARKS.md, H200, 2026-11-27, evening): unset, it is on unless
/// `BERTKIT_CUDA_NORM_DROPOUT=drawn`.
pub fn set_cuda_norm_keep_bits(on: bool) {
    CUDA_NORM_KEEP_BITS.set(on);
}

/// Whether a sublayer end's forward on CUDA hands its dropout's keep bits to its backward (see
/// [`set_cuda_norm_keep_bits`]).
pub fn cuda_norm_keep_bits() -> bool {
    CUDA_NORM_KEEP_BITS.get()
}

/// Whether the sublayer ends, where they drop, hand the keep bits from their forward to their
/// backward: [`set_cuda_norm_keep_bits`] with the kernels 16 bytes a thread and the forward a
/// warp per row ([`set_cuda_norm_vector`], [`set_cuda_norm_warp_forward`]), whose form writes
/// them (rows of up to 2,048 bf16 elements take it).
pub fn cuda_norm_keeps_bits() -> bool {
    cuda_norm_keep_bits() && cuda_norm_vector() && cuda_norm_warp_forward()
}

/// Whether the CUDA kernels' partial column sums are added by 32 lanes a column.
pub(crate) static CUDA_COLUMN_SUMS_LANES: Switch =
    Switch::opt_out("BERTKIT_CUDA_COLUMN_SUMS", "serial");

/// Turns the lanes' column sums on or off for this process: the blocks' partial sums of a
/// LayerNorm's weight and bias gradients and of a linear layer's bias gradient (`[blocks,
/// columns]` f32) added by a block of 1,024 threads per 32 columns, 32 lanes a column, in a
/// fixed order, where one thread a column adds all of its parts one after the other (for
/// LayerNorm's 512 partial rows of 2,048 columns, eight blocks on the whole GPU, 512 dependent
/// additions each). Checked by `bench/gpu/emulate` (with the LayerNorm rows) and by `bertkit
/// check kernels --device cuda` (the norm and linear rows); it passed on an H200
/// (BENCHMARKS.md, 2026-11-27): unset, it is on unless `BERTKIT_CUDA_COLUMN_SUMS=serial`.
pub fn set_cuda_column_sums_lanes(on: bool) {
    CUDA_COLUMN_SUMS_LANES.set(on);
}

/// Whether the partial column sums are added by lanes (see [`set_cuda_column_sums_lanes`]).
pub fn cuda_column_sums_lanes() -> bool {
    CUDA_COLUMN_SUMS_LANES.get()
}

/// Whether linear layers on CUDA add their bias in cuBLASLt's epilogue.
pub(crate) static CUDA_LINEAR_EPILOGUE: Switch =
    Switch::opt_out("BERTKIT_CUDA_LINEAR_BIAS", "kernel");

/// Turns cuBLASLt's product with the bias added in its epilogue on or off for this process,
/// for the linear layers without an activation whose widths are whole 16-byte pieces (the
/// attention's projections, the feed-forward's products where no GELU is fused, the pooler;
/// not the 30,522-word decoder): `x · weightᵀ + bias` in one call, where
/// cuBLAS's product writes `x · weightᵀ` and our kernel reads it back and writes it again with
/// the bias (on an H200 the queries', keys' and values' projection of a BERT-large batch
/// moves 100 MB through that second pass, ~25 µs a layer). bf16 and f16 (f32 keeps cuBLAS's
/// product and TF32 as set); the backward is unchanged. It passed its check (`bertkit check
/// kernels --device cuda`, the linear rows) on an H200, where a phase-1 pass's linear layers'
/// forward went from 4.8 to 3.0 ms (BENCHMARKS.md, 2026-11-27): unset, it is on unless
/// `BERTKIT_CUDA_LINEAR_BIAS=kernel`.
pub fn set_cuda_linear_epilogue(on: bool) {
    CUDA_LINEAR_EPILOGUE.set(on);
}

/// Whether linear layers on CUDA add their bias in cuBLASLt's epilogue (see
/// [`set_cuda_linear_epilogue`]).
pub fn cuda_linear_epilogue() -> bool {
    CUDA_LINEAR_EPILOGUE.get()
}

/// Whether a linear layer's backward on CUDA takes its products through cuBLASLt.
pub(crate) static CUDA_LINEAR_BACKWARD_LT: Switch =
    Switch::opt_out("BERTKIT_CUDA_LINEAR_BACKWARD", "matmul");

/// Turns a linear layer's backward products through cuBLASLt on or off for this process (bf16
/// and f16, operands of whole 16-byte pieces): the input's gradient and the weight's through
/// the handle the forward's epilogue products use, where candle's `matmul` takes them (on an
/// H200 the linear layers' backward took 12.1 ms of a BERT-large phase-1 pass for ~3.3 TFLOP,
/// ~270 TFLOP/s, their forward ~580 and the feed-forward's backward ~800; BENCHMARKS.md,
/// 2026-11-27; whether the products or the host's gaps make it, the next run will say). The
/// same products in f32 accumulation, another kernel's order of the sums. cuBLASLt cannot run
/// on the CPU: checked by `bertkit check kernels --device cuda` (the linear, GELU and
/// feed-forward rows' gradients); it passed its check on an H200, and with the decoder's cast
/// inside and the end's forward by rows a phase-1 pass took what it took without (the earlier
/// ~270 TFLOP/s was the events' accounting, which counts the first feed-forward layer's
/// backward but not its products; by ncu the products run at ~650-820 either way;
/// BENCHMARKS.md, H200, 2026-11-27, evening): on with them, as the measured defaults; unset,
/// it is on unless `BERTKIT_CUDA_LINEAR_BACKWARD=matmul`.
pub fn set_cuda_linear_backward_lt(on: bool) {
    CUDA_LINEAR_BACKWARD_LT.set(on);
}

/// Whether a linear layer's backward on CUDA takes its products through cuBLASLt (see
/// [`set_cuda_linear_backward_lt`]).
pub fn cuda_linear_backward_lt() -> bool {
    CUDA_LINEAR_BACKWARD_LT.get()
}

/// Whether a linear layer's bias gradient on CUDA comes out of its weight gradient's product.
pub(crate) static CUDA_BIAS_GRADIENT_EPILOGUE: Switch =
    Switch::opt_out("BERTKIT_CUDA_BIAS_GRADIENT", "kernel");

/// Turns on or off, for this process, a linear layer's bias gradient (without an activation:
/// the QKV projection's, the attention output's, both feed-forward layers'; four a BERT-large
/// layer) written by the weight gradient's cuBLASLt product itself (its `BGRADB` epilogue: the
/// sums of the output's gradient over the tokens, which that product reads anyway), where our
/// kernel reads the whole gradient once more for them (`bias_act_vec_backward` and its column
/// sums: on an H200 12.5 + 3.7 µs for `[8192, 1024]` bf16, 24.6 + 4.4 for the QKV's 3,072
/// columns, 30.1 + 5.0 for the feed-forward's 4,096; ~2.3 ms of a BERT-large phase-1 pass;
/// BENCHMARKS.md, 2026-11-27, evening). Where its backward takes its products through cuBLASLt
/// ([`set_cuda_linear_backward_lt`]); the same sums in f32 in another order, rounded once to
/// the gradient's dtype. A shape cuBLASLt has no such algorithm for gets the product and our
/// sums as before. cuBLASLt cannot run on the CPU: checked by `bertkit check kernels --device
/// cuda` (the linear and feed-forward rows' bias gradients); it passed its check on an H200,
/// where a BERT-large phase-1 training pass's linear layers' backward took 11.06 ms where 11.91
/// (BENCHMARKS.md, H200, 2026-11-28, evening): unset, it is on unless
/// `BERTKIT_CUDA_BIAS_GRADIENT=kernel`.
pub fn set_cuda_bias_gradient_epilogue(on: bool) {
    CUDA_BIAS_GRADIENT_EPILOGUE.set(on);
}

/// Whether a linear layer's bias gradient on CUDA comes out of its weight gradient's product
/// (see [`set_cuda_bias_gradient_epilogue`]).
pub fn cuda_bias_gradient_epilogue() -> bool {
    CUDA_BIAS_GRADIENT_EPILOGUE.get()
}

/// Whether tensors joined along their rows on CUDA take our kernel.
pub(crate) static CUDA_JOIN: Switch = Switch::opt_out("BERTKIT_CUDA_JOIN", "candle");

/// Turns on or off, for this process, tensors joined along their rows on CUDA by our kernel
/// (`join_rows`: every part's bytes in one launch, 16 a thread): a layer's query, key and value
/// weights and biases joined for their one product at every training pass, a LayerNorm's
/// weight and bias stacked for its kernel (two a layer), the embeddings' small tables and
/// parameters, where candle's concatenation launches a copy a part, an element a thread (on
/// an H200 5.6 µs a BERT-large `[1024, 1024]` bf16 weight, 2.3 a bias or a LayerNorm's
/// parameter: ~30 µs a layer, ~0.7 ms a BERT-large training forward; BENCHMARKS.md,
/// 2026-11-27, evening). Parts of whole 16-byte pieces, two or three of them; the same bytes
/// (`bench/gpu/emulate`). Checked by `bertkit check kernels --device cuda` (the join lines,
/// and the sublayer ends' and embeddings' that stack their parameters); it passed its check on
/// an H200, where a BERT-large phase-1 training forward took 12.43 ms where 13.11
/// (BENCHMARKS.md, H200, 2026-11-28, evening): unset, it is on unless
/// `BERTKIT_CUDA_JOIN=candle`.
pub fn set_cuda_join(on: bool) {
    CUDA_JOIN.set(on);
}

/// Whether tensors joined along their rows on CUDA take our kernel (see [`set_cuda_join`]).
pub fn cuda_join() -> bool {
    CUDA_JOIN.get()
}

/// `parts` as one tensor of `shape` (their concatenation along dimension 0, or their stack:
/// the same elements in order) by our CUDA kernel where it takes them ([`set_cuda_join`]);
/// `None` elsewhere, for the caller to join them with candle's ops (the twin).
pub(crate) fn joined_on_device(parts: &[&Tensor], shape: &[usize]) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if cuda_join() && on_cuda(parts) && cuda::join_takes(parts) {
        return cuda::join(parts, shape.into()).map(Some);
    }
    let _ = (parts, shape);
    Ok(None)
}

/// Whether the CUDA linear kernels take outputs wider than a block's bias sums.
pub(crate) static CUDA_WIDE_LINEAR: Switch = Switch::opt_out("BERTKIT_CUDA_LINEAR", "narrow");

/// Turns our CUDA linear layer on or off for this process for outputs wider than 12,288
/// columns (the masked-LM decoder's 30,522 words): the bias's gradient summed by a block per
/// chunk of columns. Without it such a layer is candle's product, broadcast addition and
/// autograd, whose bias gradient is a reduction of one block per column (on an H200, 0.39 ms a
/// BERT-large phase-1 pass, in bf16). Unset, it is on unless `BERTKIT_CUDA_LINEAR=narrow`;
/// it passed its check (its `linear (wide)` rows) on an H200 (BENCHMARKS.md, 2026-11-27).
pub fn set_cuda_wide_linear(on: bool) {
    CUDA_WIDE_LINEAR.set(on);
}

/// Whether the CUDA linear kernels take wide outputs (see [`set_cuda_wide_linear`]).
pub fn cuda_wide_linear() -> bool {
    CUDA_WIDE_LINEAR.get()
}

/// `a + b`: two gradients of one tensor where they meet ([`tape`]), through our CUDA addition
/// where it takes them ([`set_cuda_add`]), candle's elsewhere (the CPU: the twin).
pub(crate) fn add_gradients(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dtype() != b.dtype() {
        // A gradient handed over in half precision into an f32 one ([`GradientSink`]).
        return add_gradients(a, &b.to_dtype(a.dtype())?);
    }
    #[cfg(feature = "cuda")]
    if cuda_add() && on_cuda(&[a, b]) && a.dtype() == b.dtype() && a.dims() == b.dims() {
        return cuda::add(a, b);
    }
    a + b
}

/// Whether a linear layer's bias gradient alone (no activation) is summed in registers.
pub(crate) static CUDA_BIAS_SUMS_REGISTERS: Switch =
    Switch::opt_out("BERTKIT_CUDA_BIAS_SUMS", "shared");

/// Turns on or off, for this process, the bias gradient of a linear layer without an
/// activation (the QKV projection's, the attention output's, both feed-forward layers': four a
/// BERT-large layer) by its own kernel (`bias_sums_vec`): a thread one 16-byte piece of columns
/// over a block's rows, its sums in registers, four rows' loads issued together (ptxas keeps
/// them so under the kernel's launch bounds: 40 registers), where the kernel in use
/// (`bias_act_vec_backward`, which also takes the activations' slopes) gives a block 2,048
/// columns with 256 threads (half of them idle at BERT-large's 1,024), adds each element into
/// shared memory and waits on each row's loads in turn: on an H200 12.5 µs for `[8192, 1024]`
/// bf16 (~1.3 TB/s), 24.6 for the QKV's 3,072 columns, 30.1 for the feed-forward's 4,096
/// (BENCHMARKS.md, 2026-11-27, evening), ~2.3 ms a pass with their column sums. The same rows
/// in the same order: the same partial sums to the bit (`bench/gpu/emulate`). With it, a
/// linear layer's end with GELU (the feed-forward's first layer where its activation is kept,
/// as `pretrain` keeps it where the plan says it fits; the masked-LM head's transform) and
/// GELU's backward alone (the lean feed-forward's) take the same kernel's form with the
/// activation (`bias_act_sums_vec`): each row's gradient and product loaded four rows ahead
/// (eight 16-byte loads in flight a thread where that kernel has two), the slope applied and
/// written, the bias's sums in registers; on an H200 the GELU backward alone took 80.6 µs for
/// `[8192, 4096]` bf16 (~2.5 TB/s). The same slopes and sums to the bit (`bench/gpu/emulate`);
/// ptxas (sm_90): 95 registers, no spills, five blocks an SM. Checked by `bertkit check kernels
/// --device cuda` (the linear, GELU and feed-forward rows); it passed its check on an H200,
/// where a BERT-large phase-1 training pass's linear layers' backward took 11.38 ms where
/// 11.91, the masked-LM head transform's 6.03 where 6.54 (BENCHMARKS.md, H200, 2026-11-28,
/// evening; where the bias gradient comes out of the product,
/// [`set_cuda_bias_gradient_epilogue`], the layers with GELU take it): unset, it is on unless
/// `BERTKIT_CUDA_BIAS_SUMS=shared`.
pub fn set_cuda_bias_sums_registers(on: bool) {
    CUDA_BIAS_SUMS_REGISTERS.set(on);
}

/// Whether a linear layer's bias gradient alone is summed in registers (see
/// [`set_cuda_bias_sums_registers`]).
pub fn cuda_bias_sums_registers() -> bool {
    CUDA_BIAS_SUMS_REGISTERS.get()
}

/// Whether the CUDA kernels' function handles are kept once looked up (`kernels::cuda`'s
/// `function`): on unless `BERTKIT_CUDA_FUNCTIONS=lookup`, which asks candle for every launch's
/// function as before (the same handles; a way out should keeping them ever misbehave on a
/// device, before it has run on one).
#[cfg(feature = "cuda")]
pub(crate) static CUDA_FUNCTIONS_KEPT: Switch = Switch::opt_out("BERTKIT_CUDA_FUNCTIONS", "lookup");

/// Whether the CUDA kernels take f16 tensors.
pub(crate) static CUDA_FP16: Switch = Switch::opt_out("BERTKIT_CUDA_FP16", "composed");

/// Turns the CUDA kernels' f16 forms on or off for this process: fp16 runs (GPUs without bf16,
/// before compute capability 8.0: V100, T4) take the fused kernels as bf16 runs do, computing
/// in f32, instead of candle's ops. The same code as the f32 and bf16 forms that passed their
/// check, another element type. Unset, it is on unless `BERTKIT_CUDA_FP16=composed`; it
/// passed its check (`bertkit check kernels --device cuda --dtype f16`) on an H200, where
/// BERT-large's fp16 phase-1 step went from 1.03 s to 0.158 s (BENCHMARKS.md, 2026-11-27).
/// (The one-pass attention stays bf16 only.)
pub fn set_cuda_fp16(on: bool) {
    CUDA_FP16.set(on);
}

/// Whether the CUDA kernels take f16 tensors (see [`set_cuda_fp16`]).
pub fn cuda_fp16() -> bool {
    CUDA_FP16.get()
}

/// Every setting of the model's CUDA kernels, in one list: what a check turns on
/// ([`turn_cuda_kernels_on`]).
static CUDA_SWITCHES: [&Switch; 27] = [
    &CUDA_KERNELS,
    &LEAN_CUDA_FEED_FORWARD,
    &CUDA_TAPE,
    &CUDA_EMBEDDINGS,
    &CUDA_EMBEDDINGS_IN_PIECES,
    &CUDA_EMBEDDINGS_END,
    &CUDA_ADD,
    &CUDA_JOIN,
    &CUDA_KEYED_DROPOUT,
    &CUDA_WIDE_LINEAR,
    &CUDA_LINEAR_EPILOGUE,
    &CUDA_LINEAR_BACKWARD_LT,
    &CUDA_BIAS_GRADIENT_EPILOGUE,
    &CUDA_LINEAR_CAST,
    &CUDA_NORM_WIDE_GRID,
    &CUDA_NORM_VECTOR,
    &CUDA_NORM_WARP_FORWARD,
    &CUDA_NORM_BACKWARD_AHEAD,
    &CUDA_NORM_BACKWARD_WARP,
    &CUDA_NORM_KEEP_BITS,
    &CUDA_COLUMN_SUMS_LANES,
    &CUDA_BIAS_ACT_VECTOR,
    &CUDA_BIAS_ACT_ROWS,
    &CUDA_BIAS_SUMS_REGISTERS,
    &CUDA_FLASH_ATTENTION,
    &CUDA_LOSS,
    &CUDA_FP16,
];

/// Turns every CUDA kernel setting on for the process: what the checks compare (`check::check_kernels`, `encoder_check`), whatever the
/// environment says.
pub(crate) fn turn_cuda_kernels_on() {
    for s in &CUDA_SWITCHES {
        s.set(true);
    }
}

/// Whether the fused CUDA kernels take `tensors` (on a CUDA device, in f32 or bf16, with the
/// kernels turned on).
#[cfg(feature = "cuda")]
fn on_cuda(tensors: &[&Tensor]) -> bool {
    tensors
        .iter()
        .all(|t| t.device().is_cuda() && cuda::takes(t.dtype()))
        && cuda_kernels()
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
///   the CPU kernels by `bertkit check kernels --device cuda`; [`set_cuda_kernels`] or
///   `BERTKIT_CUDA_KERNELS=composed` turns them off. Elsewhere (f16, longer sequences, a bias
///   wider than a block's shared memory) the rules below.
/// - On other devices: candle's fused LayerNorm and softmax where nothing tracks gradients (a
///   frozen inference model, see [`crate::params::ParamBuilder::frozen`]); they have no
///   backward, so a trainable model takes the composed ops there.
/// - f64 (tests) always takes the composed ops.
///
/// [`fused_calls_on_this_thread`] counts the fused LayerNorm and softmax calls, so a test can
/// tell which path ran.
#[derive(Debug, Default, Clone, Copy)]
pub struct Fused;

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
            candle_core::Device::Cuda(_) => cuda_tape() && cuda_kernels() && cuda::takes(dtype),
            _ => false,
        }
    }

    fn gather_rows(&self, table: &Tensor, index: &RowIndex) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if cuda_embeddings() && on_cuda(&[table]) {
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
        if cuda_embeddings_end()
            && on_cuda(&[weight, bias])
            && cuda::embeddings_fit(&lookups, weight)
        {
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
            && cuda::bias_fits(weight.dim(0)?)
            && (weight.dtype() == x.dtype() || cuda_linear_cast())
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
            && cuda::bias_fits(weight.dim(0)?)
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
            && cuda::bias_fits(weight.dim(0)?)
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
            if lean_cuda_feed_forward()
                && on_cuda(&[x, w1, w2])
                && cuda::bias_fits(w1.dim(0)?)
                && cuda::bias_fits(w2.dim(0)?)
            {
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
            return cuda::attention(qkv, packing, heads, cuda_dropout(mode, dropout));
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
