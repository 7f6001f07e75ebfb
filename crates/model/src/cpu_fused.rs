//! Fused kernels of our own for f32 on the CPU, each with a fused backward, where candle's
//! composition runs several passes (each with its own backward node) and scalar C-library
//! math: linear layers ([`Linear`]), attention per sequence and head of a packed batch
//! ([`Attention`]), LayerNorm ([`LayerNorm`]), the exact GELU with a
//! vectorised error function ([`Gelu`]), the negative log-likelihood
//! ([`NegativeLogLikelihood`]) and dropout by a mask kept as bytes ([`KeepMask`]).
//! [`crate::kernels::Fused`] takes them for f32 on the CPU, whether or not gradients are
//! tracked; a backward pass is itself one op of ours, computed from the forward op's inputs
//! and output (which candle keeps anyway) and, for attention, the dropout mask.
//!
//! Every loop runs rows (or fixed blocks) in parallel and sums within a row in a fixed order of
//! lanes, so results do not depend on the number of threads: training stays bit-reproducible.
//! Exponentials are computed several lanes at a time (a polynomial within 2 ulp of `expf`),
//! with the loops compiled for AVX-512 or AVX2 where the CPU has them (chosen at run time).

use crate::config::Gelu;
use std::sync::Arc;

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, bail,
};
use rayon::prelude::*;

/// Defines `$name`, which runs `$portable` compiled for AVX-512 or AVX2 + FMA when the CPU has
/// them (checked at run time, so the binary still runs on CPUs without them). `$portable` is
/// `#[inline(always)]`, so its loops are vectorised for each target. (Floating-point
/// operations are not contracted into fused multiply-adds, so every target computes the same
/// values.) The CPU kernels here and the optimiser's update use it.
#[macro_export]
macro_rules! vectorised {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $portable:ident) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $portable($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $portable($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $portable($($arg),*)
        }
    };
}

/// The f32 elements of a contiguous CPU tensor's storage.
fn contiguous<'a>(
    op: &str,
    what: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> Result<&'a [f32]> {
    let CpuStorage::F32(values) = storage else {
        bail!(
            "{op}: f32 {what} expected, got {:?}",
            candle_core::backend::BackendStorage::dtype(storage)
        )
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{op}: contiguous {what} expected")
    };
    Ok(&values[start..end])
}

/// Checks that `b` has `a`'s shape.
fn same_shape(op: &str, a: &Layout, b: &Layout) -> Result<()> {
    if a.dims() != b.dims() {
        bail!("{op}: shapes {:?} and {:?} differ", a.dims(), b.dims())
    }
    Ok(())
}

/// Lanes the row loops keep separate maxima and sums in: in-order float reductions cannot be
/// vectorised, per-lane ones can (16 f32 fill one AVX-512 register). The lanes are summed in
/// one fixed order, so a row's sum does not depend on the machine.
const LANES: usize = 16;

/// `Σ f(i)` over `0..n` in [`LANES`] partial sums (vectorisable), then in order.
#[inline(always)]
fn lane_sum(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let whole = n - n % LANES;
    let mut lanes = [0f32; LANES];
    for base in (0..whole).step_by(LANES) {
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane += f(base + l);
        }
    }
    let mut sum = 0f32;
    for lane in lanes {
        sum += lane;
    }
    for i in whole..n {
        sum += f(i);
    }
    sum
}

/// The largest of `values`, by [`LANES`] running maxima (vectorisable), then in order.
#[inline(always)]
fn lane_max(values: &[f32]) -> f32 {
    let whole = values.len() - values.len() % LANES;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in values[..whole].chunks_exact(LANES) {
        for l in 0..LANES {
            lanes[l] = if chunk[l] > lanes[l] {
                chunk[l]
            } else {
                lanes[l]
            };
        }
    }
    values[whole..]
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// Rows of `row_len` per parallel task: about 16k elements, at least one row.
fn rows_per_task(row_len: usize) -> usize {
    (16_384 / row_len.max(1)).max(1)
}

// ---------------------------------------------------------------------------------------------
// Attention's softmax rows.

vectorised! {
    /// One row of the softmax of scaled scores, `softmax(row · scale)`, in place.
    fn softmax_row(row: &mut [f32], scale: f32) = softmax_row_portable
}

#[inline(always)]
fn softmax_row_portable(row: &mut [f32], scale: f32) {
    let n = row.len();
    let max = lane_max(row);
    for x in row.iter_mut() {
        *x = exp((*x - max) * scale);
    }
    let inv = 1.0 / lane_sum(n, |i| row[i]);
    for x in row.iter_mut() {
        *x *= inv;
    }
}

vectorised! {
    /// One row of the softmax's backward: the probabilities' gradient `g` becomes the scaled
    /// scores' gradient, in place.
    fn softmax_backward_row(p: &[f32], g: &mut [f32], scale: f32) = softmax_backward_row_portable
}

#[inline(always)]
fn softmax_backward_row_portable(p: &[f32], g: &mut [f32], scale: f32) {
    let n = g.len();
    let p = &p[..n];
    let dot = lane_sum(n, |i| p[i] * g[i]);
    for (g, &p) in g.iter_mut().zip(p) {
        *g = scale * p * (*g - dot);
    }
}

// ---------------------------------------------------------------------------------------------
// Linear layers.

/// `x · Wᵀ + b` for `x` `[..., in]`, `W` `[out, in]` (PyTorch's layout) and `b` `[out]`: one
/// multi-threaded matrix product into rows that already hold the bias. The backward is two
/// products and the bias's column sums. One op where candle's composition has five (reshape,
/// transpose, product, bias broadcast, reshape), each of which costs its backward a zeroed
/// gradient buffer and an addition over the whole tensor.
pub(crate) struct Linear;

/// `(rows, in, out)` of a linear layer's operands.
fn linear_shape(
    op: &str,
    x: &Layout,
    weight: &Layout,
    bias: &Layout,
) -> Result<(usize, usize, usize)> {
    let [out, input] = *weight.dims() else {
        bail!(
            "{op}: an [out, in] weight expected, got {:?}",
            weight.dims()
        )
    };
    if x.dims().last() != Some(&input) || bias.dims() != [out] {
        bail!(
            "{op}: input {:?}, weight {:?} and bias {:?} do not fit",
            x.dims(),
            weight.dims(),
            bias.dims()
        )
    }
    Ok((x.shape().elem_count() / input.max(1), input, out))
}

/// Threads for the linear layers' products: candle's own count (rayon's pool).
fn product_parallelism() -> gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// Where a matrix's elements lie in a slice: element `(i, j)` at `offset + i·row + j·col`.
#[derive(Debug, Clone, Copy)]
struct View {
    offset: usize,
    row: usize,
    col: usize,
}

impl View {
    /// A row-major matrix of rows of `width` from the slice's start.
    fn rows(width: usize) -> Self {
        View {
            offset: 0,
            row: width,
            col: 1,
        }
    }

    /// The transposed matrix, in place.
    fn t(self) -> Self {
        View {
            offset: self.offset,
            row: self.col,
            col: self.row,
        }
    }

    /// One past the last element a `rows × cols` matrix of this view addresses.
    fn reach(self, rows: usize, cols: usize) -> usize {
        if rows == 0 || cols == 0 {
            self.offset
        } else {
            self.offset + (rows - 1) * self.row + (cols - 1) * self.col + 1
        }
    }
}

/// `out = a · b` (`out += a · b` when `accumulate`) through gemm, the library candle's CPU
/// products call: `a` is `m × k` and `b` `k × n` at the given `(row, column)` strides, `out`
/// is `m × n`, row-major.
#[allow(clippy::too_many_arguments)]
fn product(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    (a_row, a_col): (usize, usize),
    b: &[f32],
    (b_row, b_col): (usize, usize),
    out: &mut [f32],
    accumulate: bool,
    parallelism: gemm::Parallelism,
) {
    let view = |row, col| View {
        offset: 0,
        row,
        col,
    };
    // SAFETY: `out` is borrowed mutably, so nothing else reads or writes it.
    unsafe {
        product_into(
            (m, n, k),
            (a, view(a_row, a_col)),
            (b, view(b_row, b_col)),
            (out.as_mut_ptr(), out.len(), View::rows(n)),
            accumulate,
            parallelism,
        )
    }
}

/// `out = a · b` (`out += a · b` when `accumulate`) for an `m × k` matrix `a` and a `k × n`
/// matrix `b`, each a view into its slice, into the `m × n` view of the `len` elements at `out`.
///
/// # Safety
/// `out` points to `len` writable elements, and while the product runs nothing else reads or
/// writes the ones the view addresses (other threads may use the rest), nor are they inside
/// `a` or `b`.
unsafe fn product_into(
    (m, n, k): (usize, usize, usize),
    (a, av): (&[f32], View),
    (b, bv): (&[f32], View),
    (out, len, ov): (*mut f32, usize, View),
    accumulate: bool,
    parallelism: gemm::Parallelism,
) {
    assert!(
        a.len() >= av.reach(m, k) && b.len() >= bv.reach(k, n) && len >= ov.reach(m, n),
        "product: views out of their slices for {m}x{k} by {k}x{n}"
    );
    // SAFETY: every element the views address lies inside its slice or `out`'s `len`
    // elements (checked above), and the caller guarantees `out`'s view is ours alone.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.add(ov.offset),
            ov.col as isize,
            ov.row as isize,
            accumulate,
            a.as_ptr().add(av.offset),
            av.col as isize,
            av.row as isize,
            b.as_ptr().add(bv.offset),
            bv.col as isize,
            bv.row as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// A buffer parallel tasks write disjoint parts of through [`product_into`].
struct Shared {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: `Shared` only hands its pointer to `product_into`, whose callers guarantee that the
// tasks' views are disjoint.
unsafe impl Sync for Shared {}

impl Shared {
    fn new(buffer: &mut [f32]) -> Self {
        Shared {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
        }
    }

    /// The buffer with a view into it, for [`product_into`].
    fn at(&self, view: View) -> (*mut f32, usize, View) {
        (self.ptr, self.len, view)
    }
}

/// `x · Wᵀ + b` into a new buffer, and the output's shape ([`Linear`]'s forward).
fn linear_forward(
    op: &str,
    (x, x_layout): (&CpuStorage, &Layout),
    (weight, weight_layout): (&CpuStorage, &Layout),
    (bias, bias_layout): (&CpuStorage, &Layout),
) -> Result<(Vec<f32>, Shape)> {
    let (rows, input, output) = linear_shape(op, x_layout, weight_layout, bias_layout)?;
    let x = contiguous(op, "input", x, x_layout)?;
    let weight = contiguous(op, "weight", weight, weight_layout)?;
    let bias = contiguous(op, "bias", bias, bias_layout)?;
    // Every row starts as the bias, copied row by row into fresh memory (not zero-filled
    // first: the product is added to it).
    let len = rows * output;
    let mut out = Vec::with_capacity(len);
    if output > 0 {
        out.spare_capacity_mut()[..len]
            .par_chunks_mut(rows_per_task(output) * output)
            .for_each(|rows| {
                for row in rows.chunks_mut(output) {
                    for (o, &b) in row.iter_mut().zip(bias) {
                        o.write(b);
                    }
                }
            });
    }
    // SAFETY: the loop above wrote all `len` elements (`rows` rows of `output`; none when
    // `output` is 0).
    unsafe { out.set_len(len) };
    // W stored [out, in] read as Wᵀ [in, out]: element (p, j) at j·in + p.
    let threads = product_parallelism();
    product(
        (rows, output, input),
        x,
        (input, 1),
        weight,
        (1, input),
        &mut out,
        true,
        threads,
    );
    let mut dims = x_layout.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = output;
    }
    Ok((out, Shape::from(dims)))
}

/// The gradients of `x`, the weight and the bias of a linear layer from its output's
/// gradient `g` (contiguous, `[rows, out]`): `g · W`, `gᵀ · x` and the columns' sums of `g`.
fn linear_backward(
    op: &str,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    g: &[f32],
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (grad_x, grad_weight, grad_bias) = {
        let (x_storage, x_layout) = x.storage_and_layout();
        let (w_storage, w_layout) = weight.storage_and_layout();
        let (rows, input, output) = linear_shape(op, x_layout, w_layout, bias.layout())?;
        if g.len() != rows * output {
            bail!(
                "{op}: a gradient of {} values for {rows} x {output}",
                g.len()
            )
        }
        let x = cpu_slice(op, "input", &x_storage, x_layout)?;
        let w = cpu_slice(op, "weight", &w_storage, w_layout)?;
        let threads = product_parallelism();
        let mut grad_x = vec![0f32; rows * input];
        let dims = (rows, input, output);
        product(
            dims,
            g,
            (output, 1),
            w,
            (input, 1),
            &mut grad_x,
            false,
            threads,
        );
        let mut grad_weight = vec![0f32; output * input];
        let dims = (output, input, rows);
        product(
            dims,
            g,
            (1, output),
            x,
            (input, 1),
            &mut grad_weight,
            false,
            threads,
        );
        (grad_x, grad_weight, column_sums(g, output))
    };
    let device = x.device();
    Ok((
        Some(Tensor::from_vec(grad_x, x.shape(), device)?),
        Some(Tensor::from_vec(grad_weight, weight.shape(), device)?),
        Some(Tensor::from_vec(grad_bias, bias.shape(), device)?),
    ))
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "bertkit-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (out, shape) = linear_forward(
            self.name(),
            (x, x_layout),
            (weight, weight_layout),
            (bias, bias_layout),
        )?;
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = "bertkit-linear-backward";
        let grad = grad.contiguous()?;
        let (g_storage, g_layout) = grad.storage_and_layout();
        let g = cpu_slice(op, "gradient", &g_storage, g_layout)?;
        linear_backward(op, x, weight, bias, g)
    }
}

/// A linear layer followed by the exact GELU, `GELU(x · Wᵀ + b)` ([`Linear`], [`Gelu`]): the
/// activation computed in place on the product when nothing needs the gradient, and otherwise
/// beside it, the pre-activation kept by the op for its backward (`GELU'` needs it), so the
/// backward is one op where the two ops' take two, with a gradient buffer fewer. The same
/// values as the two ops to the bit.
pub(crate) struct LinearGelu {
    /// Whether a backward pass may follow (then the pre-activation is kept).
    keep_pre_activation: bool,
    pre_activation: std::sync::OnceLock<Vec<f32>>,
    form: Gelu,
}

impl LinearGelu {
    /// The op, keeping the pre-activation when `trains` (a gradient will be asked for).
    pub(crate) fn new(trains: bool, form: Gelu) -> Self {
        LinearGelu {
            keep_pre_activation: trains,
            pre_activation: std::sync::OnceLock::new(),
            form,
        }
    }
}

impl CustomOp3 for LinearGelu {
    fn name(&self) -> &'static str {
        "bertkit-linear-gelu"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (pre, shape) = linear_forward(
            op,
            (x, x_layout),
            (weight, weight_layout),
            (bias, bias_layout),
        )?;
        if !self.keep_pre_activation {
            let mut out = pre;
            gelu_in_place(&mut out, self.form);
            return Ok((CpuStorage::F32(out), shape));
        }
        let out = gelu_all(&pre, self.form);
        if self.pre_activation.set(pre).is_err() {
            bail!("{op}: one op ran forward twice")
        }
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = "bertkit-linear-gelu-backward";
        let Some(pre) = self.pre_activation.get() else {
            bail!("{op}: no pre-activation kept (the op was built for inference)")
        };
        let grad = grad.contiguous()?;
        let (g_storage, g_layout) = grad.storage_and_layout();
        let g = cpu_slice(op, "gradient", &g_storage, g_layout)?;
        if g.len() != pre.len() {
            bail!("{op}: a gradient of {} values for {}", g.len(), pre.len())
        }
        linear_backward(op, x, weight, bias, &gelu_backward_all(pre, g, self.form))
    }
}

/// The sums of the columns of the row-major `[rows, columns]` matrix `g`: partial sums over
/// fixed blocks of rows in parallel, then added in order (the same result on any number of
/// threads).
fn column_sums(g: &[f32], columns: usize) -> Vec<f32> {
    let partials: Vec<Vec<f32>> = g
        .par_chunks(ROWS_PER_PARTIAL * columns)
        .map(|block| {
            let mut sums = vec![0f32; columns];
            for row in block.chunks(columns) {
                add_into(&mut sums, row);
            }
            sums
        })
        .collect();
    let mut sums = vec![0f32; columns];
    for partial in &partials {
        add_into(&mut sums, partial);
    }
    sums
}

vectorised! {
    /// `sums += row`, element by element.
    fn add_into(sums: &mut [f32], row: &[f32]) = add_into_portable
}

#[inline(always)]
fn add_into_portable(sums: &mut [f32], row: &[f32]) {
    for (s, &r) in sums.iter_mut().zip(row) {
        *s += r;
    }
}

// ---------------------------------------------------------------------------------------------
// Attention.

/// Scaled dot-product attention within each sequence of a packed batch, from the query, key
/// and value projections side by side: the input is `[tokens, 3 · hidden]` (queries, keys,
/// values, each `hidden` wide with the heads side by side, as one linear layer writes them),
/// sequence `b` being tokens `starts[b]..starts[b + 1]`; the output is `[tokens, hidden]`,
/// `dropout(softmax(q·kᵀ · scale)) · v` per sequence and head. One (sequence, head) per
/// parallel task, reading its queries, keys and values in place by strides and writing its
/// columns of the output (no head split or merge copies), with single-threaded matrix
/// products; no `[batch, heads, q, k]` tensor exists: each task's probabilities live in its
/// scratch, and the backward recomputes them, keeping only the dropout mask (a byte per
/// probability).
pub(crate) struct Attention {
    pub(crate) heads: usize,
    pub(crate) scale: f32,
    /// Where each sequence's tokens start, and the end of the last.
    pub(crate) starts: Arc<Vec<usize>>,
    /// The dropout mask (1: kept) in `len × len` blocks per sequence and head in order, and the
    /// scale of kept probabilities.
    pub(crate) keep: Option<(Arc<Vec<u8>>, f32)>,
}

/// The attention's dimensions.
#[derive(Clone, Copy)]
struct AttentionShape {
    hidden: usize,
    head: usize,
}

/// One (sequence, head) of the attention.
struct HeadTask {
    /// The sequence's first token and its length.
    start: usize,
    len: usize,
    head: usize,
    /// Where its block of the dropout mask starts.
    keep_at: usize,
}

/// The queries, keys and values: which third of the input's columns.
#[derive(Clone, Copy)]
enum Part {
    Queries = 0,
    Keys = 1,
    Values = 2,
}

impl AttentionShape {
    /// The task's queries, keys or values (or their gradients) in a `[tokens, 3 · hidden]`
    /// buffer.
    fn input(self, t: &HeadTask, part: Part) -> View {
        View {
            offset: t.start * 3 * self.hidden + part as usize * self.hidden + t.head * self.head,
            row: 3 * self.hidden,
            col: 1,
        }
    }

    /// The task's output (or its gradient) in a `[tokens, hidden]` buffer.
    fn output(self, t: &HeadTask) -> View {
        View {
            offset: t.start * self.hidden + t.head * self.head,
            row: self.hidden,
            col: 1,
        }
    }
}

impl Attention {
    fn shape(&self, qkv: &Layout) -> Result<AttentionShape> {
        let [tokens, width] = *qkv.dims() else {
            bail!(
                "attention: [tokens, 3 x hidden] projections expected, got {:?}",
                qkv.dims()
            )
        };
        let hidden = width / 3;
        if self.heads == 0 || width % 3 != 0 || hidden % self.heads != 0 {
            bail!(
                "attention: {width} columns do not split into queries, keys and values of {} heads",
                self.heads
            )
        }
        if self.starts.last() != Some(&tokens) || self.starts.windows(2).any(|w| w[0] > w[1]) {
            bail!(
                "attention: sequence starts {:?} for {tokens} tokens",
                self.starts
            )
        }
        if let Some((keep, _)) = &self.keep {
            let probabilities = crate::packing::attention_probabilities(&self.starts, self.heads);
            if keep.len() != probabilities {
                bail!(
                    "attention: a dropout mask of {} values for {probabilities} probabilities",
                    keep.len()
                )
            }
        }
        Ok(AttentionShape {
            hidden,
            head: hidden / self.heads,
        })
    }

    /// Every (sequence, head), longest sequences first (the longest tasks start first, so
    /// rayon's stealing evens out the ends).
    fn tasks(&self) -> Vec<HeadTask> {
        let mut tasks = Vec::with_capacity((self.starts.len() - 1) * self.heads);
        let mut keep_at = 0;
        for w in self.starts.windows(2) {
            let (start, len) = (w[0], w[1] - w[0]);
            for head in 0..self.heads {
                tasks.push(HeadTask {
                    start,
                    len,
                    head,
                    keep_at,
                });
                keep_at += len * len;
            }
        }
        tasks.sort_by_key(|t| std::cmp::Reverse(t.len));
        tasks
    }

    /// The task's probabilities into `probs` (`len × len`, resized), before dropout.
    fn probabilities(&self, s: AttentionShape, t: &HeadTask, qkv: &[f32], probs: &mut Vec<f32>) {
        probs.resize(t.len * t.len, 0.0);
        let out = (probs.as_mut_ptr(), probs.len(), View::rows(t.len));
        // SAFETY: `probs` is this task's own scratch.
        unsafe {
            product_into(
                (t.len, t.len, s.head),
                (qkv, s.input(t, Part::Queries)),
                (qkv, s.input(t, Part::Keys).t()),
                out,
                false,
                gemm::Parallelism::None,
            )
        }
        for row in probs.chunks_mut(t.len.max(1)) {
            softmax_row(row, self.scale);
        }
    }

    /// The task's dropout mask and scale, if any.
    fn keep(&self, t: &HeadTask) -> Option<(&[u8], f32)> {
        self.keep
            .as_ref()
            .map(|(keep, scale)| (&keep[t.keep_at..t.keep_at + t.len * t.len], *scale))
    }

    /// The output, `[tokens, hidden]`.
    fn forward(&self, s: AttentionShape, qkv: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; qkv.len() / 3];
        let shared = Shared::new(&mut out);
        self.tasks().par_iter().for_each_init(Vec::new, |probs, t| {
            self.probabilities(s, t, qkv, probs);
            if let Some((keep, scale)) = self.keep(t) {
                apply_keep_in_place(probs, keep, scale);
            }
            // SAFETY: each task writes only its own sequence's rows and head's columns.
            unsafe {
                product_into(
                    (t.len, s.head, t.len),
                    (probs, View::rows(t.len)),
                    (qkv, s.input(t, Part::Values)),
                    shared.at(s.output(t)),
                    false,
                    gemm::Parallelism::None,
                )
            }
        });
        out
    }

    /// The gradient of the projections (`[tokens, 3 · hidden]`) from the output's gradient
    /// `g`, task by task: with `P` the probabilities, `D` the dropout mask and `P' = P∘D`:
    /// `dv = P'ᵀ·g`, `dP = (g·vᵀ)∘D`, `dS = scale · P∘(dP - rowsum(dP∘P))`, `dq = dS·k`,
    /// `dk = dSᵀ·q`.
    fn backward(&self, s: AttentionShape, qkv: &[f32], g: &[f32]) -> Vec<f32> {
        let mut grad = vec![0f32; qkv.len()];
        let out = Shared::new(&mut grad);
        let single = gemm::Parallelism::None;
        self.tasks().par_iter().for_each_init(
            || (Vec::new(), Vec::new()),
            |(probs, scratch): &mut (Vec<f32>, Vec<f32>), t| {
                let len = t.len;
                let square = View::rows(len);
                let (q, k, v) = (
                    s.input(t, Part::Queries),
                    s.input(t, Part::Keys),
                    s.input(t, Part::Values),
                );
                self.probabilities(s, t, qkv, probs);
                scratch.resize(len * len, 0.0);
                let keep = self.keep(t);
                let dropped: &[f32] = match keep {
                    Some((keep, scale)) => {
                        scratch.copy_from_slice(probs);
                        apply_keep_in_place(scratch, keep, scale);
                        scratch
                    }
                    None => probs,
                };
                // SAFETY (each `product_into` below): a task writes only its own sequence's
                // rows and head's columns of the gradient, or its own scratch.
                unsafe {
                    product_into(
                        (len, s.head, len),
                        (dropped, square.t()),
                        (g, s.output(t)),
                        out.at(v),
                        false,
                        single,
                    );
                    product_into(
                        (len, len, s.head),
                        (g, s.output(t)),
                        (qkv, v.t()),
                        (scratch.as_mut_ptr(), scratch.len(), square),
                        false,
                        single,
                    );
                }
                if let Some((keep, scale)) = keep {
                    apply_keep_in_place(scratch, keep, scale);
                }
                for (p, g) in probs.chunks(len).zip(scratch.chunks_mut(len)) {
                    softmax_backward_row(p, g, self.scale);
                }
                unsafe {
                    product_into(
                        (len, s.head, len),
                        (scratch, square),
                        (qkv, k),
                        out.at(q),
                        false,
                        single,
                    );
                    product_into(
                        (len, s.head, len),
                        (scratch, square.t()),
                        (qkv, q),
                        out.at(k),
                        false,
                        single,
                    );
                }
            },
        );
        grad
    }
}

/// The f32 elements of a contiguous CPU tensor's storage (any device's storage: others are an
/// error).
fn cpu_slice<'a>(
    op: &str,
    what: &str,
    storage: &'a candle_core::Storage,
    layout: &Layout,
) -> Result<&'a [f32]> {
    match storage {
        candle_core::Storage::Cpu(storage) => contiguous(op, what, storage, layout),
        _ => bail!("{op}: {what} on the CPU expected"),
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "bertkit-attention"
    }

    fn cpu_fwd(&self, qkv: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let s = self.shape(layout)?;
        let out = self.forward(s, contiguous(self.name(), "projections", qkv, layout)?);
        let tokens = layout.dims()[0];
        Ok((CpuStorage::F32(out), Shape::from((tokens, s.hidden))))
    }

    fn bwd(&self, qkv: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = "bertkit-attention-backward";
        let grad = grad.contiguous()?;
        let dqkv = {
            let (storage, layout) = qkv.storage_and_layout();
            let (g_storage, g_layout) = grad.storage_and_layout();
            let s = self.shape(layout)?;
            if g_layout.dims() != [layout.dims()[0], s.hidden] {
                bail!("{op}: a gradient of shape {:?}", g_layout.dims())
            }
            self.backward(
                s,
                cpu_slice(op, "projections", &storage, layout)?,
                cpu_slice(op, "gradient", &g_storage, g_layout)?,
            )
        };
        Ok(Some(Tensor::from_vec(dqkv, qkv.shape(), qkv.device())?))
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm.

/// LayerNorm over the last dimension of `x`, `(x - mean) / sqrt(var + eps) · weight + bias`,
/// with the (biased) variance of the row; `weight` and `bias` are `[hidden]`.
pub(crate) struct LayerNorm {
    pub(crate) eps: f32,
}

/// The rows of `x` and the hidden size, with `weight` and `bias` checked against it.
fn norm_shape(op: &str, x: &Layout, params: &[&Layout]) -> Result<(usize, usize)> {
    let hidden = x.dims().last().copied().unwrap_or(0);
    if hidden == 0 {
        bail!(
            "{op}: an input with a non-empty last dimension expected, got {:?}",
            x.dims()
        )
    }
    for p in params {
        if p.dims() != [hidden] {
            bail!("{op}: [{hidden}] parameters expected, got {:?}", p.dims())
        }
    }
    Ok((x.shape().elem_count() / hidden, hidden))
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "bertkit-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, hidden) = norm_shape(op, x_layout, &[weight_layout, bias_layout])?;
        let x = contiguous(op, "input", x, x_layout)?;
        let weight = contiguous(op, "weight", weight, weight_layout)?;
        let bias = contiguous(op, "bias", bias, bias_layout)?;
        let out = layer_norm_rows(NormInput::Rows(x), hidden, weight, bias, self.eps);
        Ok((CpuStorage::F32(out), x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let packed = x.apply_op3_no_bwd(
            weight,
            &grad.contiguous()?,
            &LayerNormBackward { eps: self.eps },
        )?;
        let hidden = weight.elem_count();
        let rows = x.elem_count() / hidden;
        let grad_x = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let grad_weight = packed.narrow(0, rows, 1)?.reshape(hidden)?;
        let grad_bias = packed.narrow(0, rows + 1, 1)?.reshape(hidden)?;
        Ok((Some(grad_x), Some(grad_weight), Some(grad_bias)))
    }
}

/// LayerNorm's backward from its input `x`, `weight` and the output's gradient `g`, as one
/// `[rows + 2, hidden]` tensor: the input's gradient (rows), then the weight's and the bias's.
struct LayerNormBackward {
    eps: f32,
}

/// Rows whose weight and bias gradients one task sums; the partial sums are then added in
/// order, so the result does not depend on how rayon splits the work.
const ROWS_PER_PARTIAL: usize = 32;

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "bertkit-layer-norm-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (rows, hidden) = norm_shape(op, x_layout, &[weight_layout])?;
        same_shape(op, x_layout, grad_layout)?;
        let x = contiguous(op, "input", x, x_layout)?;
        let weight = contiguous(op, "weight", weight, weight_layout)?;
        let grad = contiguous(op, "gradient", grad, grad_layout)?;
        let mut out = vec![0f32; (rows + 2) * hidden];
        let (grad_x, params) = out.split_at_mut(rows * hidden);
        params.copy_from_slice(&layer_norm_backward_rows(
            NormInput::Rows(x),
            hidden,
            weight,
            grad,
            self.eps,
            grad_x,
        ));
        Ok((CpuStorage::F32(out), Shape::from((rows + 2, hidden))))
    }
}

/// Where a LayerNorm's input rows come from: stored rows, or a sublayer's end recomputing the
/// sum `dropout(x) + residual` a row at a time ([`ResidualLayerNorm`]).
#[derive(Clone, Copy)]
enum NormInput<'a> {
    Rows(&'a [f32]),
    Residual(&'a ResidualOperands<'a>),
}

impl NormInput<'_> {
    /// The input row of `hidden` values starting at element `start` (`scratch` holds a
    /// recomputed one).
    fn row<'s>(&'s self, start: usize, hidden: usize, scratch: &'s mut Vec<f32>) -> &'s [f32] {
        match self {
            NormInput::Rows(x) => &x[start..start + hidden],
            NormInput::Residual(o) => {
                scratch.resize(hidden, 0.0);
                o.sum_row(start, scratch);
                scratch
            }
        }
    }
}

/// LayerNorm of every input row (rows of `hidden`), blocks of rows in parallel.
fn layer_norm_rows(
    input: NormInput,
    hidden: usize,
    weight: &[f32],
    bias: &[f32],
    eps: f32,
) -> Vec<f32> {
    let len = match input {
        NormInput::Rows(x) => x.len(),
        NormInput::Residual(o) => o.x.len(),
    };
    let task = rows_per_task(hidden) * hidden;
    let mut out = vec![0f32; len];
    out.par_chunks_mut(task)
        .enumerate()
        .for_each_init(Vec::new, |scratch, (t, out)| {
            for (r, out) in out.chunks_mut(hidden).enumerate() {
                let x = input.row(t * task + r * hidden, hidden, scratch);
                layer_norm_row(x, weight, bias, eps, out);
            }
        });
    out
}

/// LayerNorm's backward for every input row, from the output's gradient `g`: the input's
/// gradient into `grad_x`, and the weight's then the bias's gradient returned (`2 · hidden`
/// values), summed per [`ROWS_PER_PARTIAL`] rows and the partial sums added in order.
fn layer_norm_backward_rows(
    input: NormInput,
    hidden: usize,
    weight: &[f32],
    g: &[f32],
    eps: f32,
    grad_x: &mut [f32],
) -> Vec<f32> {
    let task = ROWS_PER_PARTIAL * hidden;
    let partials: Vec<Vec<f32>> = grad_x
        .par_chunks_mut(task)
        .zip(g.par_chunks(task))
        .enumerate()
        .map(|(t, (grad_x, g))| {
            let mut partial = vec![0f32; 2 * hidden];
            let (grad_weight, grad_bias) = partial.split_at_mut(hidden);
            let mut scratch = Vec::new();
            for (r, (gx, g)) in grad_x.chunks_mut(hidden).zip(g.chunks(hidden)).enumerate() {
                let x = input.row(t * task + r * hidden, hidden, &mut scratch);
                layer_norm_backward_row(x, weight, g, eps, gx, grad_weight, grad_bias);
            }
            partial
        })
        .collect();
    let mut params = vec![0f32; 2 * hidden];
    for partial in &partials {
        add_into(&mut params, partial);
    }
    params
}

/// A row's mean and `1 / sqrt(var + eps)`, the variance from the centred values (two passes:
/// no cancellation for rows far from zero).
#[inline(always)]
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len();
    let mean = lane_sum(n, |i| x[i]) / n as f32;
    let var = lane_sum(n, |i| (x[i] - mean) * (x[i] - mean)) / n as f32;
    (mean, 1.0 / (var + eps).sqrt())
}

vectorised! {
    /// One row of LayerNorm.
    fn layer_norm_row(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) = layer_norm_row_portable
}

#[inline(always)]
fn layer_norm_row_portable(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    let n = out.len();
    let (x, weight, bias) = (&x[..n], &weight[..n], &bias[..n]);
    let (mean, rstd) = row_stats(x, eps);
    for i in 0..n {
        out[i] = (x[i] - mean) * rstd * weight[i] + bias[i];
    }
}

vectorised! {
    /// One row of LayerNorm's backward: the input's gradient into `grad_x`, the weight's and
    /// bias's added to `grad_weight` and `grad_bias`.
    fn layer_norm_backward_row(
        x: &[f32],
        weight: &[f32],
        g: &[f32],
        eps: f32,
        grad_x: &mut [f32],
        grad_weight: &mut [f32],
        grad_bias: &mut [f32]
    ) = layer_norm_backward_row_portable
}

/// With `x̂ = (x - mean) · rstd` and `gy = g · weight`:
/// `dx = rstd · (gy - mean(gy) - x̂ · mean(gy · x̂))`, `dweight += g · x̂`, `dbias += g`.
#[inline(always)]
fn layer_norm_backward_row_portable(
    x: &[f32],
    weight: &[f32],
    g: &[f32],
    eps: f32,
    grad_x: &mut [f32],
    grad_weight: &mut [f32],
    grad_bias: &mut [f32],
) {
    let n = grad_x.len();
    let (x, weight, g) = (&x[..n], &weight[..n], &g[..n]);
    let (grad_weight, grad_bias) = (&mut grad_weight[..n], &mut grad_bias[..n]);
    let (mean, rstd) = row_stats(x, eps);
    let mean_gy = lane_sum(n, |i| g[i] * weight[i]) / n as f32;
    let mean_gy_xhat = lane_sum(n, |i| g[i] * weight[i] * (x[i] - mean) * rstd) / n as f32;
    for i in 0..n {
        let xhat = (x[i] - mean) * rstd;
        grad_x[i] = rstd * (g[i] * weight[i] - mean_gy - xhat * mean_gy_xhat);
        grad_weight[i] += g[i] * xhat;
        grad_bias[i] += g[i];
    }
}

// ---------------------------------------------------------------------------------------------
// The end of a sublayer: dropout, the residual connection and LayerNorm.

/// `LayerNorm(dropout(x) + residual)` over the last dimension, for `x` and `residual`
/// `[..., hidden]` and `params` `[2, hidden]` (the norm's weight, then its bias), the dropout
/// by a mask of keep bytes as [`KeepMask`]'s (or none). One pass where the composition takes
/// three (dropout, the addition, the norm, each writing a tensor), and one backward where
/// theirs take three, each with a gradient buffer of its own. The sum is not kept: the
/// backward recomputes it a row at a time. Values are the composition's to the bit (the same
/// f32 operations in the same order).
pub(crate) struct ResidualLayerNorm {
    pub(crate) eps: f32,
    /// The dropout's keep bytes and the scale of a kept element.
    pub(crate) keep: Option<(Arc<Vec<u8>>, f32)>,
}

/// The operands of a [`ResidualLayerNorm`]: `x`, `residual`, the weight and the bias, with the
/// mask (if any) checked against them; and the hidden size.
struct ResidualOperands<'a> {
    x: &'a [f32],
    residual: &'a [f32],
    weight: &'a [f32],
    bias: &'a [f32],
    keep: Option<(&'a [u8], f32)>,
    hidden: usize,
}

impl ResidualLayerNorm {
    fn operands<'a>(
        &'a self,
        x: &'a [f32],
        x_layout: &Layout,
        residual: &'a [f32],
        residual_layout: &Layout,
        params: &'a [f32],
        params_layout: &Layout,
    ) -> Result<ResidualOperands<'a>> {
        let op = "bertkit-residual-layer-norm";
        same_shape(op, x_layout, residual_layout)?;
        let hidden = x_layout.dims().last().copied().unwrap_or(0);
        if hidden == 0 || params_layout.dims() != [2, hidden] {
            bail!(
                "{op}: an input [.., hidden] and parameters [2, hidden] expected, got {:?} and {:?}",
                x_layout.dims(),
                params_layout.dims()
            )
        }
        let keep = match &self.keep {
            Some((keep, _)) if keep.len() != x.len() => bail!(
                "{op}: a dropout mask of {} elements for {} values",
                keep.len(),
                x.len()
            ),
            Some((keep, scale)) => Some((keep.as_slice(), *scale)),
            None => None,
        };
        let (weight, bias) = params.split_at(hidden);
        Ok(ResidualOperands {
            x,
            residual,
            weight,
            bias,
            keep,
            hidden,
        })
    }
}

impl ResidualOperands<'_> {
    /// The sum `dropout(x) + residual` of the rows starting at element `start`, one row into
    /// `sum`.
    fn sum_row(&self, start: usize, sum: &mut [f32]) {
        let at = start..start + self.hidden;
        let keep = self.keep.map(|(keep, scale)| (&keep[at.clone()], scale));
        residual_sum_row(&self.x[at.clone()], &self.residual[at], keep, sum);
    }
}

vectorised! {
    /// One row of `x · (keep · scale) + residual` (without a mask, `x + residual`): the
    /// dropout's and the addition's arithmetic, in their order.
    fn residual_sum_row(x: &[f32], residual: &[f32], keep: Option<(&[u8], f32)>, sum: &mut [f32]) = residual_sum_row_portable
}

#[inline(always)]
fn residual_sum_row_portable(
    x: &[f32],
    residual: &[f32],
    keep: Option<(&[u8], f32)>,
    sum: &mut [f32],
) {
    let n = sum.len();
    let (x, residual) = (&x[..n], &residual[..n]);
    match keep {
        Some((keep, scale)) => {
            let keep = &keep[..n];
            for i in 0..n {
                sum[i] = x[i] * (f32::from(keep[i]) * scale) + residual[i];
            }
        }
        None => {
            for i in 0..n {
                sum[i] = x[i] + residual[i];
            }
        }
    }
}

impl CustomOp3 for ResidualLayerNorm {
    fn name(&self) -> &'static str {
        "bertkit-residual-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        residual: &CpuStorage,
        residual_layout: &Layout,
        params: &CpuStorage,
        params_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let x = contiguous(op, "input", x, x_layout)?;
        let residual = contiguous(op, "residual", residual, residual_layout)?;
        let params = contiguous(op, "parameters", params, params_layout)?;
        let o = self.operands(
            x,
            x_layout,
            residual,
            residual_layout,
            params,
            params_layout,
        )?;
        let out = layer_norm_rows(
            NormInput::Residual(&o),
            o.hidden,
            o.weight,
            o.bias,
            self.eps,
        );
        Ok((CpuStorage::F32(out), x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        residual: &Tensor,
        params: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = self.name();
        let grad = grad.contiguous()?;
        let (grad_sum, grad_params) = {
            let (x_storage, x_layout) = x.storage_and_layout();
            let (r_storage, r_layout) = residual.storage_and_layout();
            let (p_storage, p_layout) = params.storage_and_layout();
            let (g_storage, g_layout) = grad.storage_and_layout();
            same_shape(op, x_layout, g_layout)?;
            let o = self.operands(
                cpu_slice(op, "input", &x_storage, x_layout)?,
                x_layout,
                cpu_slice(op, "residual", &r_storage, r_layout)?,
                r_layout,
                cpu_slice(op, "parameters", &p_storage, p_layout)?,
                p_layout,
            )?;
            let g = cpu_slice(op, "gradient", &g_storage, g_layout)?;
            let mut grad_sum = vec![0f32; o.x.len()];
            let input = NormInput::Residual(&o);
            let grad_params =
                layer_norm_backward_rows(input, o.hidden, o.weight, g, self.eps, &mut grad_sum);
            (grad_sum, grad_params)
        };
        let device = x.device();
        let grad_residual = Tensor::from_vec(grad_sum, x.shape(), device)?;
        // The dropout's backward: the same mask on the sum's gradient. Without one, `x` and
        // the residual share the one gradient.
        let grad_x = match &self.keep {
            Some((keep, scale)) => grad_residual.apply_op1_no_bwd(&KeepMask {
                keep: Arc::clone(keep),
                scale: *scale,
            })?,
            None => grad_residual.clone(),
        };
        let grad_params = Tensor::from_vec(grad_params, params.shape(), device)?;
        Ok((Some(grad_x), Some(grad_residual), Some(grad_params)))
    }
}

// ---------------------------------------------------------------------------------------------
// GELU.

/// GELU in either form, elementwise on f32 (any shape, contiguous).
pub(crate) struct GeluOp {
    pub(crate) form: Gelu,
}

/// Elements per parallel task of the elementwise ops.
const ELEMENTWISE_CHUNK: usize = 1 << 14;

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "bertkit-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(self.name(), "input", storage, layout)?;
        Ok((
            CpuStorage::F32(gelu_all(x, self.form)),
            layout.shape().clone(),
        ))
    }

    fn bwd(&self, x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let backward = GeluBackward { form: self.form };
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &backward)?))
    }
}

/// GELU's backward: `g · GELU'(x)`.
struct GeluBackward {
    form: Gelu,
}

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "bertkit-gelu-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        same_shape(op, x_layout, grad_layout)?;
        let x = contiguous(op, "input", x, x_layout)?;
        let grad = contiguous(op, "gradient", grad, grad_layout)?;
        Ok((
            CpuStorage::F32(gelu_backward_all(x, grad, self.form)),
            x_layout.shape().clone(),
        ))
    }
}

/// GELU of every element of `x`, in parallel chunks.
fn gelu_all(x: &[f32], form: Gelu) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(x.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(out, x)| match form {
            Gelu::Erf => gelu_chunk(x, out),
            Gelu::Tanh => gelu_tanh_chunk(x, out),
        });
    out
}

/// GELU of every element of `x`, in place, in parallel chunks.
fn gelu_in_place(x: &mut [f32], form: Gelu) {
    x.par_chunks_mut(ELEMENTWISE_CHUNK)
        .for_each(|x| match form {
            Gelu::Erf => gelu_chunk_in_place(x),
            Gelu::Tanh => gelu_tanh_chunk_in_place(x),
        });
}

/// GELU's backward for every element, `g · GELU'(x)`, in parallel chunks.
fn gelu_backward_all(x: &[f32], g: &[f32], form: Gelu) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(
            x.par_chunks(ELEMENTWISE_CHUNK)
                .zip(g.par_chunks(ELEMENTWISE_CHUNK)),
        )
        .for_each(|(out, (x, g))| match form {
            Gelu::Erf => gelu_backward_chunk(x, g, out),
            Gelu::Tanh => gelu_tanh_backward_chunk(x, g, out),
        });
    out
}

vectorised! {
    /// The tanh GELU over a chunk.
    fn gelu_tanh_chunk(x: &[f32], out: &mut [f32]) = gelu_tanh_chunk_portable
}

#[inline(always)]
fn gelu_tanh_chunk_portable(x: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o = x * tanh_gelu_gate(x).0;
    }
}

vectorised! {
    /// The tanh GELU over a chunk, in place.
    fn gelu_tanh_chunk_in_place(x: &mut [f32]) = gelu_tanh_chunk_in_place_portable
}

#[inline(always)]
fn gelu_tanh_chunk_in_place_portable(x: &mut [f32]) {
    for x in x.iter_mut() {
        *x *= tanh_gelu_gate(*x).0;
    }
}

vectorised! {
    /// The tanh GELU's backward over a chunk.
    fn gelu_tanh_backward_chunk(x: &[f32], g: &[f32], out: &mut [f32]) = gelu_tanh_backward_chunk_portable
}

#[inline(always)]
fn gelu_tanh_backward_chunk_portable(x: &[f32], g: &[f32], out: &mut [f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const CUBIC: f32 = 0.044_715;
    for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
        let (gate, e) = tanh_gelu_gate(x);
        // gate = σ(2u), so gate' = 2u' · gate · (1 - gate), and 1 - gate = e · gate.
        let du = SQRT_2_OVER_PI * (3.0 * CUBIC * x).mul_add(x, 1.0);
        *o = g * (2.0 * x * du * (e * gate) * gate + gate);
    }
}

/// The tanh GELU's gate, `(1 + tanh(u)) / 2` with `u = √(2/π) · (x + 0.044715 x³)`, written as
/// the logistic `1 / (1 + e^(-2u))` so that both tails keep their relative precision (`1 + tanh`
/// would cancel for negative `x`); also returns `e^(-2u)` for the backward.
#[inline(always)]
fn tanh_gelu_gate(x: f32) -> (f32, f32) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const CUBIC: f32 = 0.044_715;
    let u = SQRT_2_OVER_PI * (CUBIC * x * x).mul_add(x, x);
    let e = exp(-2.0 * u);
    (1.0 / (1.0 + e), e)
}

vectorised! {
    /// GELU over a chunk.
    fn gelu_chunk(x: &[f32], out: &mut [f32]) = gelu_chunk_portable
}

#[inline(always)]
fn gelu_chunk_portable(x: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o = gelu(x);
    }
}

/// The exact GELU, `x · Φ(x)`.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    x * 0.5 * twice_phi(x)
}

vectorised! {
    /// GELU over a chunk, in place.
    fn gelu_chunk_in_place(x: &mut [f32]) = gelu_chunk_in_place_portable
}

#[inline(always)]
fn gelu_chunk_in_place_portable(x: &mut [f32]) {
    for x in x.iter_mut() {
        *x = gelu(*x);
    }
}

vectorised! {
    /// GELU's backward over a chunk.
    fn gelu_backward_chunk(x: &[f32], g: &[f32], out: &mut [f32]) = gelu_backward_chunk_portable
}

#[inline(always)]
fn gelu_backward_chunk_portable(x: &[f32], g: &[f32], out: &mut [f32]) {
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
        let density = FRAC_1_SQRT_2PI * exp(-0.5 * x * x);
        *o = g * (0.5 * twice_phi(x) + x * density);
    }
}

/// `2 Φ(x)` with `Φ(x) = erfc(-x/√2) / 2`, and `erfc` from the Chebyshev fit in Numerical
/// Recipes (`erfcc`: relative error below 1.2e-7 for every argument), so the negative tail,
/// where `Φ` is tiny, keeps its relative precision too.
#[inline(always)]
fn twice_phi(x: f32) -> f32 {
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = 0.170_872_77_f32;
    p = p.mul_add(t, -0.822_152_23);
    p = p.mul_add(t, 1.488_515_9);
    p = p.mul_add(t, -1.135_204);
    p = p.mul_add(t, 0.278_868_07);
    p = p.mul_add(t, -0.186_288_06);
    p = p.mul_add(t, 0.096_784_18);
    p = p.mul_add(t, 0.374_091_96);
    p = p.mul_add(t, 1.000_023_7);
    p = p.mul_add(t, -1.265_512_2);
    let erfc = t * exp((-z).mul_add(z, p));
    if x < 0.0 { erfc } else { 2.0 - erfc }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy.

/// The negative log-likelihood of each row's label, `log Σ exp(x) - x[label]`, for `logits`
/// `[rows, classes]` (f32) and `labels` `[rows]` (u32). The backward recomputes each row's
/// softmax from the logits: `g · (softmax(x) - onehot(label))`, one pass.
pub(crate) struct NegativeLogLikelihood;

impl NegativeLogLikelihood {
    fn operands<'a>(
        op: &str,
        logits: &'a CpuStorage,
        logits_layout: &Layout,
        labels: &'a CpuStorage,
        labels_layout: &Layout,
    ) -> Result<(&'a [f32], &'a [u32], usize)> {
        let [rows, classes] = *logits_layout.dims() else {
            bail!(
                "{op}: [rows, classes] logits expected, got {:?}",
                logits_layout.dims()
            )
        };
        if labels_layout.dims() != [rows] {
            bail!(
                "{op}: [{rows}] labels expected, got {:?}",
                labels_layout.dims()
            )
        }
        let logits = contiguous(op, "logits", logits, logits_layout)?;
        let (CpuStorage::U32(labels), Some((start, end))) =
            (labels, labels_layout.contiguous_offsets())
        else {
            bail!("{op}: contiguous u32 labels expected")
        };
        let labels = &labels[start..end];
        if let Some(i) = labels.iter().position(|&l| l as usize >= classes) {
            bail!(
                "{op}: label {} of row {i} is outside 0..{classes}",
                labels[i]
            )
        }
        Ok((logits, labels, classes))
    }
}

impl CustomOp2 for NegativeLogLikelihood {
    fn name(&self) -> &'static str {
        "bertkit-nll"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_layout: &Layout,
        labels: &CpuStorage,
        labels_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (logits, labels, classes) =
            Self::operands(self.name(), logits, logits_layout, labels, labels_layout)?;
        let nll: Vec<f32> = logits
            .par_chunks(classes)
            .zip(labels.par_iter())
            .map(|(row, &label)| log_sum_exp(row) - row[label as usize])
            .collect();
        Ok((CpuStorage::F32(nll), Shape::from(labels.len())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        _nll: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let op = "bertkit-nll-backward";
        let grad = grad.contiguous()?;
        let grad_logits = {
            let (l_storage, l_layout) = logits.storage_and_layout();
            let (y_storage, y_layout) = labels.storage_and_layout();
            let (g_storage, g_layout) = grad.storage_and_layout();
            let (candle_core::Storage::Cpu(l_storage), candle_core::Storage::Cpu(y_storage)) =
                (&*l_storage, &*y_storage)
            else {
                bail!("{op}: CPU tensors expected")
            };
            let (x, labels, classes) =
                Self::operands(op, l_storage, l_layout, y_storage, y_layout)?;
            let grad = cpu_slice(op, "gradient", &g_storage, g_layout)?;
            if grad.len() != labels.len() {
                bail!(
                    "{op}: a gradient of {} values for {} rows",
                    grad.len(),
                    labels.len()
                )
            }
            let mut out = vec![0f32; x.len()];
            out.par_chunks_mut(classes)
                .zip(x.par_chunks(classes))
                .zip(labels.par_iter().zip(grad.par_iter()))
                .for_each(|((out, row), (&label, &g))| {
                    softmax_times(row, log_sum_exp(row), g, out);
                    out[label as usize] -= g;
                });
            out
        };
        Ok((
            Some(Tensor::from_vec(
                grad_logits,
                logits.shape(),
                logits.device(),
            )?),
            None,
        ))
    }
}

vectorised! {
    /// `log Σ exp(row)`, the row's maximum taken out first.
    fn log_sum_exp(row: &[f32]) -> f32 = log_sum_exp_portable
}

#[inline(always)]
fn log_sum_exp_portable(row: &[f32]) -> f32 {
    // The sum of [`lane_sum`] in its order, but with the exponentials computed a block at a
    // time into a buffer first: a plain loop over a slice is vectorised, while `exp` inside
    // `lane_sum`'s closure is not (it compiles to one lane at a time).
    const BLOCK: usize = 64 * LANES;
    let max = lane_max(row);
    let n = row.len();
    let whole = n - n % LANES;
    let mut lanes = [0f32; LANES];
    let mut buffer = [0f32; BLOCK];
    for block in row[..whole].chunks(BLOCK) {
        let exps = &mut buffer[..block.len()];
        for (e, &x) in exps.iter_mut().zip(block) {
            *e = exp(x - max);
        }
        for chunk in exps.chunks_exact(LANES) {
            for l in 0..LANES {
                lanes[l] += chunk[l];
            }
        }
    }
    let mut sum = 0f32;
    for lane in lanes {
        sum += lane;
    }
    for &x in &row[whole..] {
        sum += exp(x - max);
    }
    max + sum.ln()
}

vectorised! {
    /// `out = g · exp(row - log_sum_exp)`: the row's softmax times `g`.
    fn softmax_times(row: &[f32], log_sum_exp: f32, g: f32, out: &mut [f32]) = softmax_times_portable
}

#[inline(always)]
fn softmax_times_portable(row: &[f32], log_sum_exp: f32, g: f32, out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(row) {
        *o = g * exp(x - log_sum_exp);
    }
}

// ---------------------------------------------------------------------------------------------
// Dropout.

/// Multiplies by a dropout mask kept as one byte per element (1: kept, scaled by `scale`;
/// 0: dropped); the backward multiplies the gradient by the same mask. A quarter of the memory
/// of an f32 mask tensor, and no gradient computed for the mask.
pub(crate) struct KeepMask {
    pub(crate) keep: Arc<Vec<u8>>,
    pub(crate) scale: f32,
}

impl CustomOp1 for KeepMask {
    fn name(&self) -> &'static str {
        "bertkit-dropout"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(self.name(), "input", storage, layout)?;
        if x.len() != self.keep.len() {
            bail!(
                "dropout: a mask of {} elements for {} values",
                self.keep.len(),
                x.len()
            )
        }
        let mut out = x.to_vec();
        out.par_chunks_mut(ELEMENTWISE_CHUNK)
            .zip(self.keep.par_chunks(ELEMENTWISE_CHUNK))
            .for_each(|(out, keep)| apply_keep_in_place(out, keep, self.scale));
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let same = KeepMask {
            keep: Arc::clone(&self.keep),
            scale: self.scale,
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&same)?))
    }
}

vectorised! {
    /// Dropout's keep bytes for elements `first..first + keep.len()` of a mask's line
    /// ([`crate::dropout`]'s draws, several lanes at a time).
    pub(crate) fn fill_keeps(keep: &mut [u8], line_key: u64, first: u64, threshold: u64) = fill_keeps_portable
}

#[inline(always)]
fn fill_keeps_portable(keep: &mut [u8], line_key: u64, first: u64, threshold: u64) {
    for (j, k) in keep.iter_mut().enumerate() {
        *k = crate::dropout::keeps(line_key, first + j as u64, threshold);
    }
}

vectorised! {
    /// Values times their mask, in place.
    fn apply_keep_in_place(x: &mut [f32], keep: &[u8], scale: f32) = apply_keep_in_place_portable
}

#[inline(always)]
fn apply_keep_in_place_portable(x: &mut [f32], keep: &[u8], scale: f32) {
    for (x, &k) in x.iter_mut().zip(keep) {
        *x *= f32::from(k) * scale;
    }
}

// ---------------------------------------------------------------------------------------------

/// `e^x` for `x` up to 88 (a softmax row minus its maximum is at most 0): Cody–Waite reduction to
/// `r` in [-ln2/2, ln2/2], a degree-6 polynomial (Cephes' `expf` coefficients), and `2^n` built
/// in the exponent bits. Below -87.3 it returns about the smallest normal f32 (~1.2e-38)
/// instead of 0, which changes no sum a softmax row makes and no GELU value. Multiply-adds are
/// explicit `mul_add`s: one fused instruction on AVX2 and AVX-512, and correctly rounded on
/// every target, so every target computes the same bits (as in `twice_phi`).
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    let n = x.mul_add(LOG2E, 0.5).floor();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p = 1.987_569_1e-4_f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
    // `n` is a whole number in [-126, 128] here (x is clamped above). Rust's saturating `as`
    // cast compiles to a scalar conversion and NaN check per lane, which keeps the loops
    // calling this from being vectorised; the unchecked conversion is one vector instruction.
    // SAFETY: `n` is finite and well inside i32's range.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    y * f32::from_bits(((n + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{D, DType, Device, Tensor};

    #[test]
    fn exp_is_within_2_ulp_of_the_c_librarys() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let (ours, libm) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max((ours - libm).abs() / libm);
        }
        // 2 ulp of f32 is 2.4e-7 relative.
        assert!(worst < 2.4e-7, "{worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-10_000.0) < 1.3e-38);
    }

    #[test]
    fn the_softmax_row_equals_the_f64_softmax() {
        let cpu = &Device::Cpu;
        // Rows of 37 (not a multiple of the vector lanes), one far from zero.
        let scores = (Tensor::randn(0f32, 3.0, (5, 37), cpu).unwrap() + 40.0).unwrap();
        let scale = 0.176_776_69_f32;
        let mut fused: Vec<f32> = scores.flatten_all().unwrap().to_vec1().unwrap();
        for row in fused.chunks_mut(37) {
            softmax_row(row, scale);
        }
        let x = (scores.to_dtype(DType::F64).unwrap() * scale as f64).unwrap();
        let max = x.max_keepdim(D::Minus1).unwrap();
        let e = x.broadcast_sub(&max).unwrap().exp().unwrap();
        let reference: Vec<f64> = e
            .broadcast_div(&e.sum_keepdim(D::Minus1).unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let diff = fused
            .iter()
            .zip(&reference)
            .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b).abs()));
        assert!(diff < 1e-6, "{diff:e}");
    }

    #[test]
    fn log_sum_exp_sums_in_lane_order_and_matches_f64() {
        // Lengths below a lane, across the block boundary, and a BERT vocabulary's row.
        for n in [1, 15, 16, 1023, 1024, 1025, 1037, 30_522] {
            let row: Vec<f32> = Tensor::randn(0f32, 4.0, n, &Device::Cpu)
                .unwrap()
                .to_vec1()
                .unwrap();
            let max = lane_max(&row);
            let in_lane_order = max + lane_sum(n, |i| exp(row[i] - max)).ln();
            assert_eq!(
                log_sum_exp(&row).to_bits(),
                in_lane_order.to_bits(),
                "n = {n}"
            );
            let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let f64_sum: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
            let reference = m + f64_sum.ln();
            assert!(
                (log_sum_exp(&row) as f64 - reference).abs() < 1e-5,
                "n = {n}"
            );
        }
    }

    #[test]
    fn attention_rejects_sequences_that_do_not_cover_the_tokens() {
        let qkv = Tensor::zeros((5, 24), DType::F32, &Device::Cpu).unwrap();
        let op = |starts: Vec<usize>, heads| Attention {
            heads,
            scale: 0.5,
            starts: Arc::new(starts),
            keep: None,
        };
        let out = qkv.apply_op1_no_bwd(&op(vec![0, 2, 5], 2)).unwrap();
        assert_eq!(out.dims(), [5, 8]);
        for (starts, heads) in [(vec![0, 2, 4], 2), (vec![0, 3, 2, 5], 2), (vec![0, 5], 3)] {
            let err = qkv.apply_op1_no_bwd(&op(starts, heads)).unwrap_err();
            assert!(err.to_string().contains("attention:"), "{err}");
        }
        let wrong = Tensor::zeros((5, 25), DType::F32, &Device::Cpu).unwrap();
        assert!(wrong.apply_op1_no_bwd(&op(vec![0, 5], 1)).is_err());
    }

    #[test]
    fn tanh_gelu_and_its_backward_to_f32_precision() {
        let cpu = &Device::Cpu;
        let xs: Vec<f32> = (0..=40_000).map(|i| -20.0 + i as f32 * 0.001).collect();
        let x = Tensor::new(xs.as_slice(), cpu).unwrap();
        let op = GeluOp { form: Gelu::Tanh };
        let ours = x.apply_op1_no_bwd(&op).unwrap().to_vec1::<f32>().unwrap();
        let ones = Tensor::ones(xs.len(), DType::F32, cpu).unwrap();
        let slopes = x
            .apply_op2_no_bwd(&ones, &GeluBackward { form: Gelu::Tanh })
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let (mut worst, mut worst_slope) = (0f64, 0f64);
        for ((&x, &y), &dy) in xs.iter().zip(&ours).zip(&slopes) {
            let x = x as f64;
            let u = c * (x + 0.044715 * x.powi(3));
            // The gate as a logistic keeps the negative tail's relative precision.
            let gate = 1.0 / (1.0 + (-2.0 * u).exp());
            let want = x * gate;
            let slope = gate + x * 2.0 * gate * (1.0 - gate) * c * (1.0 + 3.0 * 0.044715 * x * x);
            worst = worst.max((y as f64 - want).abs() / want.abs().max(1e-6));
            // Absolute: the slope crosses zero near x = -0.75.
            worst_slope = worst_slope.max((dy as f64 - slope).abs());
        }
        eprintln!("tanh gelu: relative {worst:e}, slope absolute {worst_slope:e}");
        assert!(worst < 3e-6, "relative {worst:e}");
        assert!(worst_slope < 1e-6, "slope {worst_slope:e}");
    }

    #[test]
    fn gelu_is_the_exact_gelu_to_f32_precision() {
        let cpu = &Device::Cpu;
        let xs: Vec<f32> = (0..=40_000).map(|i| -20.0 + i as f32 * 0.001).collect();
        let ours = Tensor::new(xs.as_slice(), cpu)
            .unwrap()
            .apply_op1_no_bwd(&GeluOp { form: Gelu::Erf })
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // The reference in f64 from erfc (1 + erf would cancel in the negative tail).
        let reference: Vec<f64> = xs
            .iter()
            .map(|&x| {
                let x = x as f64;
                0.5 * x * candle_core::cpu::erf::erfc_f64(-x / std::f64::consts::SQRT_2)
            })
            .collect();
        let (mut worst_abs, mut worst_rel) = (0f64, 0f64);
        for ((&x, &a), &b) in xs.iter().zip(&ours).zip(&reference) {
            let d = (a as f64 - b).abs();
            worst_abs = worst_abs.max(d);
            // Relative down to x = -5 (GELU -1.4e-6). Further out `exp(p - z²)` inherits the
            // rounding of z², ~1.2e-7·z² relative, on values below 1.4e-6 (candle's f32
            // `0.5·x·(1 + erf)` loses all digits there to cancellation).
            if x >= -5.0 {
                worst_rel = worst_rel.max(d / b.abs().max(f64::MIN_POSITIVE));
            }
        }
        eprintln!("gelu: absolute {worst_abs:e}, relative {worst_rel:e}");
        assert!(worst_abs < 5e-7, "absolute {worst_abs:e}");
        assert!(worst_rel < 3e-6, "relative {worst_rel:e}");
        // Strided input is an error, not a panic.
        let m = Tensor::zeros((3, 4), DType::F32, cpu).unwrap().t().unwrap();
        assert!(m.apply_op1_no_bwd(&GeluOp { form: Gelu::Erf }).is_err());
    }
}
