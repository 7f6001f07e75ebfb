//! Linear layers, optionally with GELU, and their backward passes.

use super::gelu::{gelu_all, gelu_backward_all, gelu_in_place};
use super::*;
use crate::Gelu;
use crate::host::{contiguous, cpu_slice};
use crate::vectorised;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// Linear layers.

/// `x · Wᵀ + b` for `x` `[..., in]`, `W` `[out, in]` (PyTorch's layout) and `b` `[out]`: one
/// multi-threaded matrix product into rows that already hold the bias. The backward is two
/// products and the bias's column sums. One op where candle's composition has five (reshape,
/// transpose, product, bias broadcast, reshape), each of which costs its backward a zeroed
/// gradient buffer and an addition over the whole tensor. With a sink
/// ([`crate::Kernels::linear_into`]) the weight's gradient is handed over there,
/// not to the graph.
pub(crate) struct Linear {
    sink: Option<crate::GradientSink>,
    caller: crate::Caller,
}

impl Linear {
    /// The layer, its weight's gradient to the graph (its backward counted to the kernel
    /// method making it now, [`crate::Caller`]).
    pub(crate) fn new() -> Self {
        Linear {
            sink: None,
            caller: crate::Caller::now(),
        }
    }

    /// The layer whose weight's gradient goes to `sink`.
    pub(crate) fn handing_to(sink: &crate::GradientSink) -> Self {
        Linear {
            sink: Some(sink.clone()),
            ..Linear::new()
        }
    }
}

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
pub(super) struct View {
    pub(super) offset: usize,
    pub(super) row: usize,
    pub(super) col: usize,
}

impl View {
    /// A row-major matrix of rows of `width` from the slice's start.
    pub(super) fn rows(width: usize) -> Self {
        View {
            offset: 0,
            row: width,
            col: 1,
        }
    }

    /// The transposed matrix, in place.
    pub(super) fn t(self) -> Self {
        View {
            offset: self.offset,
            row: self.col,
            col: self.row,
        }
    }

    /// One past the last element a `rows × cols` matrix of this view addresses.
    pub(super) fn reach(self, rows: usize, cols: usize) -> usize {
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
pub(super) unsafe fn product_into(
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
pub(super) struct Shared {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: `Shared` only hands its pointer to `product_into`, whose callers guarantee that the
// tasks' views are disjoint.
unsafe impl Sync for Shared {}

impl Shared {
    pub(super) fn new(buffer: &mut [f32]) -> Self {
        Shared {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
        }
    }

    /// The buffer with a view into it, for [`product_into`].
    pub(super) fn at(&self, view: View) -> (*mut f32, usize, View) {
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
        crate::profiled_backward(self.caller.or("linear"), grad.device(), || {
            let op = "bertkit-linear-backward";
            let grad = grad.contiguous()?;
            let (g_storage, g_layout) = grad.storage_and_layout();
            let g = cpu_slice(op, "gradient", &g_storage, g_layout)?;
            let (grad_x, grad_weight, grad_bias) = linear_backward(op, x, weight, bias, g)?;
            match (&self.sink, grad_weight) {
                (Some(sink), Some(grad_weight)) => {
                    sink.put(&grad_weight)?;
                    Ok((grad_x, None, grad_bias))
                }
                (_, grad_weight) => Ok((grad_x, grad_weight, grad_bias)),
            }
        })
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
    caller: crate::Caller,
}

impl LinearGelu {
    /// The op, keeping the pre-activation when `trains` (a gradient will be asked for).
    pub(crate) fn new(trains: bool, form: Gelu) -> Self {
        LinearGelu {
            keep_pre_activation: trains,
            pre_activation: std::sync::OnceLock::new(),
            form,
            caller: crate::Caller::now(),
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
        crate::profiled_backward(self.caller.or("linear_gelu"), grad.device(), || {
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
        })
    }
}

/// GELU followed by a linear layer, `GELU(x) · Wᵀ + b`: the second layer of a feed-forward
/// block taking the first's product `x` itself. The activation is computed into a temporary
/// for the product and again in the backward pass (one element-wise pass), so the graph keeps
/// `x` alone where [`LinearGelu`] then [`Linear`] keep `x` and its activation both. The same
/// values as that pair to the bit, forward and backward.
pub(crate) struct GeluLinear {
    form: Gelu,
    caller: crate::Caller,
}

impl GeluLinear {
    /// The op with GELU in `form`.
    pub(crate) fn new(form: Gelu) -> Self {
        GeluLinear {
            form,
            caller: crate::Caller::now(),
        }
    }
}

impl CustomOp3 for GeluLinear {
    fn name(&self) -> &'static str {
        "bertkit-gelu-linear"
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
        let activated = CpuStorage::F32(gelu_all(contiguous(op, "input", x, x_layout)?, self.form));
        let (out, shape) = linear_forward(
            op,
            (&activated, &Layout::contiguous(x_layout.shape())),
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
        crate::profiled_backward(self.caller.or("feed_forward"), grad.device(), || {
            let op = "bertkit-gelu-linear-backward";
            let (activated, grad_activated, weight_and_bias) = {
                let (x_storage, x_layout) = x.storage_and_layout();
                let xs = cpu_slice(op, "input", &x_storage, x_layout)?;
                let activated = Tensor::from_vec(gelu_all(xs, self.form), x.shape(), x.device())?;
                let grad = grad.contiguous()?;
                let (g_storage, g_layout) = grad.storage_and_layout();
                let g = cpu_slice(op, "gradient", &g_storage, g_layout)?;
                let (grad_activated, grad_weight, grad_bias) =
                    linear_backward(op, &activated, weight, bias, g)?;
                (activated, grad_activated, (grad_weight, grad_bias))
            };
            drop(activated);
            let Some(grad_activated) = grad_activated else {
                bail!("{op}: no gradient for the activation")
            };
            let grad_x = {
                let (x_storage, x_layout) = x.storage_and_layout();
                let xs = cpu_slice(op, "input", &x_storage, x_layout)?;
                let (a_storage, a_layout) = grad_activated.storage_and_layout();
                let ga = cpu_slice(op, "gradient", &a_storage, a_layout)?;
                gelu_backward_all(xs, ga, self.form)
            };
            let (grad_weight, grad_bias) = weight_and_bias;
            Ok((
                Some(Tensor::from_vec(grad_x, x.shape(), x.device())?),
                grad_weight,
                grad_bias,
            ))
        })
    }
}

/// The sums of the columns of the row-major `[rows, columns]` matrix `g`: partial sums over
/// fixed blocks of rows in parallel, then added in order (the same result on any number of
/// threads).
/// `y + b`, row by row, for `y` `[rows, out]` and `b` `[out]` in half precision on the CPU,
/// each sum in f32 and rounded once, as candle's broadcast addition makes it; but its backward
/// sums the bias's gradient over the rows in f32, where candle's sums a half-precision tensor
/// in its own dtype (at the check's 308 and 778 rows of bf16, 3-7% of the gradient's largest
/// magnitude off: `bertkit check kernels --device cpu --dtype bf16`). The CPU's half-precision
/// linear layers (candle's product, then this) take it; f32 takes [`Linear`].
pub(crate) struct HalfBias;

impl CustomOp2 for HalfBias {
    fn name(&self) -> &'static str {
        "bertkit-half-bias"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        y_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let dtype = y.dtype();
        let (rows, out) = y_layout.shape().dims2()?;
        if !matches!(dtype, DType::BF16 | DType::F16) || b.dtype() != dtype {
            bail!(
                "{op}: half-precision rows and bias of one dtype expected, got {dtype:?} and {:?}",
                b.dtype()
            )
        }
        if b_layout.dims() != [out] {
            bail!("{op}: a bias of {out} expected, got {:?}", b_layout.dims())
        }
        // Widened (and made contiguous) by candle's own conversion, then added in place.
        let (CpuStorage::F32(mut sums), CpuStorage::F32(bias)) = (
            y.to_dtype(y_layout, DType::F32)?,
            b.to_dtype(b_layout, DType::F32)?,
        ) else {
            bail!("{op}: f32 values expected from the widening")
        };
        if out > 0 {
            sums.par_chunks_mut(out)
                .for_each(|row| add_into(row, &bias));
        }
        let shape = Shape::from((rows, out));
        let sums = CpuStorage::F32(sums).to_dtype(&Layout::contiguous(&shape), dtype)?;
        Ok((sums, shape))
    }

    fn bwd(
        &self,
        _y: &Tensor,
        b: &Tensor,
        _sums: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let out = b.elem_count();
        let wide = grad.to_dtype(DType::F32)?.contiguous()?;
        let grad_bias = {
            let (storage, layout) = wide.storage_and_layout();
            let g = cpu_slice(self.name(), "gradient", &storage, layout)?;
            column_sums(g, out)
        };
        let grad_bias = Tensor::from_vec(grad_bias, out, b.device())?.to_dtype(b.dtype())?;
        Ok((Some(grad.clone()), Some(grad_bias)))
    }
}

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
    pub(super) fn add_into(sums: &mut [f32], row: &[f32]) = add_into_portable
}

#[inline(always)]
fn add_into_portable(sums: &mut [f32], row: &[f32]) {
    for (s, &r) in sums.iter_mut().zip(row) {
        *s += r;
    }
}
