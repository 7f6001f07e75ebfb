//! Linear layers on CUDA: cuBLAS's product, then the bias and the activation (none, or GELU
//! in either form) in one pass; in the backward the activation's slope and the bias's
//! gradient in one pass, then two products. The twins of `cpu::Linear`, `cpu::LinearGelu` and
//! `cpu::GeluOp`.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublaslt::result::{self as lt_result, CublasError};
use candle_core::cuda_backend::cudarc::cublaslt::sys as lt_sys;
use candle_core::cuda_backend::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig, MatmulShared};
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, DevicePtr, DevicePtrMut};

use super::*;
use crate::config::Gelu;
use crate::kernels::GradientSink;

/// The activation as the kernels number it.
fn code(act: Option<Gelu>) -> i32 {
    match act {
        None => 0,
        Some(Gelu::Erf) => 1,
        Some(Gelu::Tanh) => 2,
    }
}

fn rows_cols(op: &str, y: &Layout, bias: Option<&Layout>) -> Result<(usize, usize)> {
    let cols = y.dims().last().copied().unwrap_or(0);
    if cols == 0 {
        bail!(
            "{op}: an input with a non-empty last dimension expected, got {:?}",
            y.dims()
        )
    }
    if let Some(b) = bias
        && b.dims() != [cols]
    {
        bail!("{op}: a bias of [{cols}] expected, got {:?}", b.dims())
    }
    Ok((y.shape().elem_count() / cols, cols))
}

/// Whether a linear layer's end takes its kernels 16 bytes a thread for rows of `cols` elements
/// of `T`, its inputs laid out as `layouts` (whole 16-byte pieces, every row aligned); other
/// rows take the kernels an element a thread.
fn vector_end<T>(cols: usize, layouts: &[&Layout]) -> bool {
    in_16_byte_pieces::<T>(cols, layouts.iter().map(|l| l.start_offset()))
}

/// Rows a thread of `bias_act_rows_forward` takes its piece of (the grid's rows a quarter of
/// the matrix's: BERT-large's `[8192, 4096]` in 4,096 blocks of 256 threads).
const ROWS_A_THREAD: usize = 4;

fn forward<T: Element>(
    dev: &CudaDevice,
    y: &CudaView<'_, T>,
    bias: Option<&CudaView<'_, T>>,
    (rows, cols): (usize, usize),
    act: i32,
    vector: bool,
) -> Result<CudaSlice<T>> {
    // SAFETY: every element is written by the kernel.
    let mut out = unsafe { dev.alloc::<T>(rows * cols)? };
    let (rows_i, cols_i) = (rows as i32, cols as i32);
    let (name, cfg) = if vector {
        // A thread a piece of a row at every ROWS_A_THREAD-th row (its bias read once); a
        // block's threads no more than a row's pieces (whole warps).
        let pieces = cols / piece_elements::<T>();
        let threads = pieces.next_multiple_of(32).min(256);
        let cfg = LaunchConfig {
            grid_dim: (
                rows.div_ceil(ROWS_A_THREAD).max(1) as u32,
                pieces.div_ceil(threads) as u32,
                1,
            ),
            ..config(1, threads, 0)
        };
        ("bias_act_rows_forward", cfg)
    } else {
        ("bias_act_forward", config(rows, 256, 0))
    };
    launch!(T, dev, name, cfg, |b| {
        b.arg(y);
        match bias {
            Some(bias) => b.arg(bias),
            None => b.arg(&NULL),
        };
        b.arg(&mut out).arg(&rows_i).arg(&cols_i).arg(&act);
    })?;
    Ok(out)
}

/// Threads of a block of `bias_sums_vec` (`BIAS_SUMS_THREADS` in `kernels.cu`: its launch
/// bounds, which a larger block would exceed).
const BIAS_SUMS_THREADS: usize = 128;

/// The backward, packed: `y`'s gradient (`rows · cols`, only with an activation), then the
/// bias's (`cols`, only with a bias).
fn backward<T: Element>(
    dev: &CudaDevice,
    y: &CudaView<'_, T>,
    bias: Option<&CudaView<'_, T>>,
    grad: &CudaView<'_, T>,
    (rows, cols): (usize, usize),
    act: i32,
    vector: bool,
) -> Result<CudaSlice<T>> {
    let n = if act != 0 { rows * cols } else { 0 };
    let b_len = if bias.is_some() { cols } else { 0 };
    // SAFETY: every element is written: `y`'s gradient by the first kernel, the bias's by the
    // column sums.
    let mut out = unsafe { dev.alloc::<T>(n + b_len)? };
    let blocks = rows.clamp(1, MAX_BACKWARD_BLOCKS);
    let partial = if bias.is_some() {
        Some(dev.alloc_zeros::<f32>(blocks * cols)?)
    } else {
        None
    };
    let (rows_i, cols_i) = (rows as i32, cols as i32);
    // 16 bytes a thread, the sums kept in registers (`bias_sums_vec`), a thread a piece of
    // columns, blocks of `BIAS_SUMS_THREADS` over them; else an element a thread.
    let registers_cfg = || LaunchConfig {
        grid_dim: (
            blocks as u32,
            (cols / piece_elements::<T>()).div_ceil(BIAS_SUMS_THREADS) as u32,
            1,
        ),
        ..config(blocks, BIAS_SUMS_THREADS, 0)
    };
    if vector
        && act == 0
        && let Some(partial) = &partial
    {
        // The bias's sums alone.
        launch!(T, dev, "bias_sums_vec", registers_cfg(), |b| {
            b.arg(grad).arg(partial).arg(&rows_i).arg(&cols_i);
        })?;
    } else if vector && act != 0 {
        // The activation's slope, and the bias's sums where there is a bias.
        let (mut grad_y, _) = out.split_at_mut(n);
        launch!(T, dev, "bias_act_sums_vec", registers_cfg(), |b| {
            b.arg(y);
            match bias {
                Some(bias) => b.arg(bias),
                None => b.arg(&NULL),
            };
            b.arg(grad).arg(&mut grad_y);
            match &partial {
                Some(p) => b.arg(p),
                None => b.arg(&NULL),
            };
            b.arg(&rows_i).arg(&cols_i).arg(&act);
        })?;
    } else if !vector {
        let (mut grad_y, _) = out.split_at_mut(n);
        // Rows wider than a block's shared memory holds bias sums for: a block per chunk of
        // BIAS_CHUNK columns as well (`bias_act_backward`).
        let shared = if bias.is_some() {
            cols.min(BIAS_CHUNK)
        } else {
            0
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, cols.div_ceil(BIAS_CHUNK) as u32, 1),
            ..config(blocks, 256, shared)
        };
        launch!(T, dev, "bias_act_backward", cfg, |b| {
            b.arg(y);
            match bias {
                Some(bias) => b.arg(bias),
                None => b.arg(&NULL),
            };
            b.arg(grad);
            if act != 0 {
                b.arg(&mut grad_y);
            } else {
                b.arg(&NULL);
            }
            match &partial {
                Some(p) => b.arg(p),
                None => b.arg(&NULL),
            };
            b.arg(&rows_i).arg(&cols_i).arg(&act);
        })?;
    }
    if let Some(partial) = &partial {
        let mut grad_bias = out.slice_mut(n..);
        column_sums::<T>(dev, partial, blocks, &mut grad_bias, cols)?;
    }
    Ok(out)
}

/// A linear layer on CUDA, `act(x · weightᵀ + bias)`, as one node of the autograd graph: its
/// product (`pre`, computed by cuBLAS outside the graph and handed over) gets the bias and the
/// activation in one kernel, and its backward is written out: the activation's slope and the
/// bias's gradient in one kernel, then `x`'s and the weight's gradients as two products. One
/// node with three gradient edges where the composition had six or more (reshapes, the
/// transposed weight, the product, the bias), each of which candle's autograd pays with a
/// zeroed buffer and an addition. `pre` is kept for the backward only with an activation.
struct LinearOp {
    act: Option<Gelu>,
    /// The activation applied to the input before the product (`gelu_linear`): the product
    /// handed over is of `input_act(x)`, recomputed in the backward pass, so that only `x` is
    /// kept.
    input_act: Option<Gelu>,
    /// The product handed over (none with `epilogue`).
    pre: Handoff,
    /// The op computes `x · weightᵀ + bias` itself in one cuBLASLt call ([`epilogue_takes`]):
    /// no activation, no product handed over.
    epilogue: bool,
    /// Where the weight's gradient goes instead of the graph ([`linear_into`]).
    sink: Option<GradientSink>,
    /// The [`crate::kernels::Kernels`] method that made it, its backward counted there.
    caller: crate::kernels::Caller,
}

/// Whether a linear layer without an activation on either side takes cuBLASLt's product with
/// the bias added in its epilogue: bf16 or f16 (f32 keeps cuBLAS's product, whose TF32 the
/// process sets), some rows,
/// widths of whole 16-byte pieces (every row aligned: the masked-LM decoder's 30,522 words
/// keep the product and our bias kernel), and every input starting on a 16-byte boundary.
fn epilogue_takes(x: &Tensor, weight: &Tensor, bias: &Tensor, rows: usize) -> bool {
    let whole = |n: usize| n.is_multiple_of(8);
    matches!(x.dtype(), DType::BF16 | DType::F16)
        && rows > 0
        && weight
            .dims2()
            .is_ok_and(|(out, inner)| whole(out) && whole(inner))
        && x.is_contiguous()
        && weight.is_contiguous()
        && bias.is_contiguous()
        && [x, weight, bias].into_iter().all(starts_on_16_bytes)
}

/// The cuBLASLt handle of each device (with its workspace: 32 MiB on Hopper, 4 MiB before),
/// made at the first product that takes it.
static LT_HANDLES: Mutex<Vec<(DeviceId, Arc<CudaBlasLT>)>> = Mutex::new(Vec::new());

fn lt_handle(dev: &CudaDevice) -> Result<Arc<CudaBlasLT>> {
    let mut handles = LT_HANDLES
        .lock()
        .map_err(|_| candle_core::Error::Msg("the cuBLASLt handles' lock".into()))?;
    let handle = device_entry(&mut handles, dev, || {
        Ok(Arc::new(
            CudaBlasLT::new(dev.cuda_stream()).map_err(lt_error)?,
        ))
    })?;
    Ok(handle.clone())
}

fn lt_error(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt: {e:?}"))
}

/// One column-major cuBLASLt product `C = op(A) · op(B)`, `C` `[m, n]` (its leading
/// dimension `m`), `op` transposing where `(transa, transb)` say, with the leading dimensions
/// `(lda, ldb)` of A and B as stored: no batch, alpha 1, beta 0.
fn lt_product(
    (transa, transb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    (lda, ldb): (usize, usize),
) -> MatmulConfig {
    MatmulConfig {
        transa,
        transb,
        transc: false,
        m: m as u64,
        n: n as u64,
        k: k as u64,
        alpha: 1.0,
        lda: lda as i64,
        ldb: ldb as i64,
        beta: 0.0,
        ldc: m as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    }
}

/// A cuBLASLt object (a product's description, a matrix's layout, the algorithm search's
/// preferences), destroyed when dropped.
struct LtObject<H: Copy> {
    handle: H,
    destroy: unsafe fn(H) -> std::result::Result<(), CublasError>,
}

impl<H: Copy> LtObject<H> {
    fn new(
        made: std::result::Result<H, CublasError>,
        destroy: unsafe fn(H) -> std::result::Result<(), CublasError>,
    ) -> Result<Self> {
        Ok(LtObject {
            handle: made.map_err(lt_error)?,
            destroy,
        })
    }
}

impl<H: Copy> Drop for LtObject<H> {
    fn drop(&mut self) {
        // SAFETY: made by its create function, destroyed once, here (a failure would leak a
        // few bytes of host memory: nothing a drop can do about it).
        let _ = unsafe { (self.destroy)(self.handle) };
    }
}

/// Sets `attribute` of a product's description to `value` (of the attribute's type).
fn set_description<V>(
    description: &LtObject<lt_sys::cublasLtMatmulDesc_t>,
    attribute: lt_sys::cublasLtMatmulDescAttributes_t,
    value: &V,
) -> Result<()> {
    // SAFETY: cuBLASLt copies the value's `size_of::<V>()` bytes, which the callers give as
    // the attribute's type.
    unsafe {
        lt_result::set_matmul_desc_attribute(
            description.handle,
            attribute,
            (value as *const V).cast(),
            std::mem::size_of::<V>(),
        )
    }
    .map_err(lt_error)
}

/// Sets `attribute` of the algorithm search's preferences to `value` (of its type).
fn set_preference<V>(
    preference: &LtObject<lt_sys::cublasLtMatmulPreference_t>,
    attribute: lt_sys::cublasLtMatmulPreferenceAttributes_t,
    value: &V,
) -> Result<()> {
    // SAFETY: as in `set_description`.
    unsafe {
        lt_result::set_matmul_pref_attribute(
            preference.handle,
            attribute,
            (value as *const V).cast(),
            std::mem::size_of::<V>(),
        )
    }
    .map_err(lt_error)
}

/// The most workspace the products through [`lt_raw`] offer cuBLASLt's search: NVIDIA's
/// recommendation for Hopper (32 MiB, cudarc's handle's own).
const LT_MAX_WORKSPACE: usize = 32 << 20;

/// The column-major cuBLASLt product `cfg` lays out ([`lt_product`]: `D` `[m, n]` (ld m) =
/// `op(A) · op(B)`, `op` transposing where `transa`, `transb` say, A and B stored with leading
/// dimensions `lda`, `ldb`) with cuBLASLt's `BGRADB` epilogue (the sums of `op(B)`'s columns
/// over `k`, `n` of them, written to `bias`), through cuBLASLt's own API where cudarc's
/// `matmul` has none (its epilogues are the forward's), f32 accumulation, each result rounded
/// once to `T`. `Ok(false)` without launching anything
/// where cuBLASLt's search finds no algorithm (the caller then takes another way). The
/// operands start on 16-byte boundaries with leading dimensions of whole 16-byte pieces
/// (`lt_backward_takes`), as the preferences tell the search; the workspace is what the
/// algorithm found needs, from the pool, for this product alone (cudarc keeps its handle's
/// out of reach, and one kept for these would count against every step's memory).
fn lt_raw<T: Element>(
    dev: &CudaDevice,
    lt: &CudaBlasLT,
    cfg: &MatmulConfig,
    (a, b): (&CudaView<'_, T>, &CudaView<'_, T>),
    d: &mut CudaViewMut<'_, T>,
    bias: &mut CudaViewMut<'_, T>,
) -> Result<bool>
where
    CudaBlasLT: Matmul<T>,
{
    let (m, n, k) = (cfg.m, cfg.n, cfg.k);
    use lt_sys::cublasLtMatmulDescAttributes_t as Description;
    use lt_sys::cublasLtMatmulPreferenceAttributes_t as Preference;
    // cuBLAS's operations: as stored (0), or transposed (1).
    let operation = |transposed: bool| i32::from(transposed);
    let element = <CudaBlasLT as Matmul<T>>::matrix_type();
    let description = LtObject::new(
        lt_result::create_matmul_desc(
            <CudaBlasLT as Matmul<T>>::compute_type(),
            lt_sys::cudaDataType_t::CUDA_R_32F,
        ),
        lt_result::destroy_matmul_desc,
    )?;
    set_description(
        &description,
        Description::CUBLASLT_MATMUL_DESC_TRANSA,
        &operation(cfg.transa),
    )?;
    set_description(
        &description,
        Description::CUBLASLT_MATMUL_DESC_TRANSB,
        &operation(cfg.transb),
    )?;
    let stream = lt.stream();
    set_description(
        &description,
        Description::CUBLASLT_MATMUL_DESC_EPILOGUE,
        &lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB,
    )?;
    let (bias_ptr, _bias_used) = bias.device_ptr_mut(stream);
    set_description(
        &description,
        Description::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
        &bias_ptr,
    )?;
    let beta = 0.0f32;
    let layout = |rows: u64, cols: u64, ld: i64| {
        LtObject::new(
            lt_result::create_matrix_layout(element, rows, cols, ld),
            lt_result::destroy_matrix_layout,
        )
    };
    let a_layout = if cfg.transa {
        layout(k, m, cfg.lda)?
    } else {
        layout(m, k, cfg.lda)?
    };
    let b_layout = if cfg.transb {
        layout(n, k, cfg.ldb)?
    } else {
        layout(k, n, cfg.ldb)?
    };
    let d_layout = layout(m, n, cfg.ldc)?;
    let preference = LtObject::new(
        lt_result::create_matmul_pref(),
        lt_result::destroy_matmul_pref,
    )?;
    set_preference(
        &preference,
        Preference::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &(LT_MAX_WORKSPACE as u64),
    )?;
    for alignment in [
        Preference::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        Preference::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        Preference::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        Preference::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
    ] {
        set_preference(&preference, alignment, &16u32)?;
    }
    // SAFETY: the objects are live; the search reads only them.
    let found = unsafe {
        lt_result::get_matmul_algo_heuristic(
            *lt.handle(),
            description.handle,
            a_layout.handle,
            b_layout.handle,
            d_layout.handle,
            d_layout.handle,
            preference.handle,
        )
    };
    let heuristic = match found {
        Ok(heuristic) => heuristic,
        Err(CublasError(lt_sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => return Ok(false),
        Err(e) => return Err(lt_error(e)),
    };
    // SAFETY: a workspace, written by cuBLASLt before it reads it (at least one byte: a
    // pointer to hand over where the algorithm needs none).
    let workspace = unsafe { dev.alloc::<u8>(heuristic.workspaceSize.max(1))? };
    let alpha = 1.0f32;
    let (a_ptr, _a_used) = a.device_ptr(stream);
    let (b_ptr, _b_used) = b.device_ptr(stream);
    let (d_ptr, _d_used) = d.device_ptr_mut(stream);
    let (w_ptr, _w_used) = workspace.device_ptr(stream);
    // (Beta 0: C is not read; D stands in for it.)
    let c_ptr = d_ptr;
    // SAFETY: the layouts are those of the buffers (the caller's sizes: `a` and `b` as laid
    // out above, `d` and `C` m x n, the bias gradient n elements), the workspace as large as
    // the algorithm needs, on the handle's stream (the workspace's freeing ordered after the
    // product on the same stream).
    unsafe {
        lt_result::matmul(
            *lt.handle(),
            description.handle,
            (&alpha as *const f32).cast(),
            (&beta as *const f32).cast(),
            a_ptr as *const _,
            a_layout.handle,
            b_ptr as *const _,
            b_layout.handle,
            c_ptr as *const _,
            d_layout.handle,
            d_ptr as *mut _,
            d_layout.handle,
            &heuristic.algo,
            w_ptr as *mut _,
            heuristic.workspaceSize,
            stream.cu_stream() as *mut _,
        )
    }
    .map_err(lt_error)?;
    Ok(true)
}

/// `x · weightᵀ + bias` (`x` `[rows, in]`, `weight` `[out, in]`, `bias` `[out]`, all
/// row-major) in one cuBLASLt product, the bias added by its epilogue: in cuBLAS's
/// column-major terms the output's transpose, `weight · xᵀ` (`m` = out, `n` = rows, `k` = in),
/// the bias one value per row of it.
fn lt_linear<T: Element>(
    dev: &CudaDevice,
    x: &CudaView<'_, T>,
    weight: &CudaView<'_, T>,
    bias: &CudaView<'_, T>,
    (rows, in_features, out_features): (usize, usize, usize),
) -> Result<CudaSlice<T>>
where
    CudaBlasLT: Matmul<T>,
{
    let lt = lt_handle(dev)?;
    // SAFETY: the product writes every element (beta 0).
    let mut out = unsafe { dev.alloc::<T>(rows * out_features)? };
    let cfg = lt_product(
        (true, false),
        (out_features, rows, in_features),
        (in_features, in_features),
    );
    // SAFETY: the layouts above are those of the buffers' sizes: `weight` in_features x
    // out_features, `x` in_features x rows, `out` out_features x rows (column-major), `bias`
    // out_features.
    unsafe { lt.matmul(cfg, weight, x, &mut out, Some(bias), None) }.map_err(lt_error)?;
    Ok(out)
}

/// Whether a linear layer's backward takes its two products through cuBLASLt (else candle's
/// `matmul`) for these operands: half precision, each
/// contiguous from a 16-byte boundary with rows of whole 16-byte pieces (the products' leading
/// dimensions; the token count, a packed batch's, may be any).
fn lt_backward_takes(tensors: &[&Tensor]) -> bool {
    tensors.iter().all(|t| {
        matches!(t.dtype(), DType::BF16 | DType::F16)
            && t.is_contiguous()
            && starts_on_16_bytes(t)
            && t.dims().last().is_some_and(|d| d.is_multiple_of(8))
    })
}

/// A linear layer's gradients as cuBLASLt products, laid
/// out in cuBLAS's column-major terms as the input's gradient `[rows, in]` = `weight · grad`
/// (`[in, out] · [out, rows]`, neither transposed) and the weight's `[out, in]` = `x · gradᵀ`
/// (`[in, rows] · [rows, out]`, the right one transposed), through the handle and heuristics
/// the forward's epilogue products use, where candle's `matmul` takes `grad · weight` and
/// `gradᵀ · x` through cuBLAS's strided batched product.
#[derive(Debug, Clone, Copy)]
enum LtGradient {
    /// `grad` `[rows, out]` and `weight` `[out, in]`: the input's gradient `[rows, in]`.
    Input,
    /// `x` `[rows, in]` and `grad` `[rows, out]`: the weight's gradient `[out, in]`.
    Weight,
    /// As `Weight`, with the bias's gradient (`grad`'s column sums, `[out]`) from the same
    /// product's epilogue ([`lt_raw`]): packed, the weight's `out · in` elements,
    /// then the bias's from [`bias_gradient_start`].
    WeightAndBias,
}

/// Where a packed [`LtGradient::WeightAndBias`] puts the bias's gradient: after the weight's
/// `elements` (of `element_bytes` each), on a 256-byte boundary (as an allocation of its own
/// would start).
fn bias_gradient_start(elements: usize, element_bytes: usize) -> usize {
    elements.next_multiple_of(256 / element_bytes)
}

impl CustomOp2 for LtGradient {
    fn name(&self) -> &'static str {
        "bertkit-cuda-linear-gradient"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: LtGradient,
            (a, al): (&CudaStorage, &Layout),
            (b, bl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)>
        where
            CudaBlasLT: Matmul<T>,
        {
            let name = op.name();
            let ((ar, ac), (br, bc)) = (al.shape().dims2()?, bl.shape().dims2()?);
            let dev = &a.device;
            let lt = lt_handle(dev)?;
            let (left, right) = (view::<T>(name, "a", a, al)?, view::<T>(name, "b", b, bl)?);
            // Column-major: cuBLASLt's A and B, the product, the result's row-major shape.
            let (first, second, cfg, shape) = match op {
                LtGradient::Input => {
                    // `a` the gradient [rows, out], `b` the weight [out, in]: the weight [in,
                    // out] (ld in) times the gradient [out, rows] (ld out), [in, rows].
                    let ((rows, out), (out_w, inner)) = ((ar, ac), (br, bc));
                    if out != out_w {
                        bail!(
                            "{name}: a gradient {:?} for a weight {:?}",
                            al.dims(),
                            bl.dims()
                        )
                    }
                    let cfg = lt_product((false, false), (inner, rows, out), (inner, out));
                    (&right, &left, cfg, (rows, inner))
                }
                LtGradient::Weight | LtGradient::WeightAndBias => {
                    // `a` the layer's input [rows, in], `b` the gradient [rows, out]: the input
                    // [in, rows] (ld in) times the gradient [out, rows] (ld out) read
                    // transposed, [in, out].
                    let ((rows, inner), (rows_g, out)) = ((ar, ac), (br, bc));
                    if rows != rows_g {
                        bail!(
                            "{name}: an input {:?} for a gradient {:?}",
                            al.dims(),
                            bl.dims()
                        )
                    }
                    let cfg = lt_product((false, true), (inner, out, rows), (inner, out));
                    (&left, &right, cfg, (out, inner))
                }
            };
            if let LtGradient::WeightAndBias = op {
                let (out, inner) = shape;
                let rows = ar;
                let start = bias_gradient_start(out * inner, std::mem::size_of::<T>());
                // SAFETY: the product writes the weight's elements and the epilogue (or the
                // column sums) the bias's; the padding between them is never read.
                let mut packed = unsafe { dev.alloc::<T>(start + out)? };
                let (mut weight, mut rest) = packed.split_at_mut(start);
                let mut weight = weight.slice_mut(..out * inner);
                let mut bias = rest.slice_mut(..out);
                // The product as `LtGradient::Weight` lays it out, its epilogue summing the
                // gradient's rows (`op(B)`'s columns over the tokens) into the bias's.
                if !lt_raw::<T>(dev, &lt, &cfg, (first, second), &mut weight, &mut bias)? {
                    // No algorithm with the epilogue for this shape: the product alone, and
                    // the gradient's column sums by our kernel (which, without an activation,
                    // reads neither the product nor the bias: the gradient stands for both).
                    // SAFETY: as below.
                    unsafe { lt.matmul(cfg, first, second, &mut weight, None, None) }
                        .map_err(lt_error)?;
                    let sums = backward::<T>(
                        dev,
                        &right,
                        Some(&right.slice(..out)),
                        &right,
                        (rows, out),
                        0,
                        vector_end::<T>(out, &[bl]),
                    )?;
                    dev.memcpy_dtod(&sums, &mut bias)?;
                }
                return Ok((wrap(packed, dev), Shape::from(start + out)));
            }
            // SAFETY: the product writes every element (beta 0).
            let mut c = unsafe { dev.alloc::<T>(shape.0 * shape.1)? };
            // SAFETY: the layouts above are those of the buffers' sizes.
            unsafe { lt.matmul(cfg, first, second, &mut c, None, None) }.map_err(lt_error)?;
            Ok((wrap(c, dev), Shape::from(shape)))
        }
        by_dtype!(self.name(), a, run(*self, (a, al), (b, bl)))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-linear"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &LinearOp,
            (x, xl): (&CudaStorage, &Layout),
            (w, wl): (&CudaStorage, &Layout),
            (b, bl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)>
        where
            CudaBlasLT: Matmul<T>,
        {
            let name = op.name();
            if op.epilogue {
                // The product and the bias in one cuBLASLt call (`epilogue_takes`).
                let (out_features, in_features) = wl.shape().dims2()?;
                if xl.dims().last() != Some(&in_features) || bl.dims() != [out_features] {
                    bail!(
                        "{name}: an input {:?} for a weight {:?} and a bias {:?}",
                        xl.dims(),
                        wl.dims(),
                        bl.dims()
                    )
                }
                let rows = xl.shape().elem_count() / in_features.max(1);
                let dev = &x.device;
                let out = lt_linear::<T>(
                    dev,
                    &view(name, "input", x, xl)?,
                    &view(name, "weight", w, wl)?,
                    &view(name, "bias", b, bl)?,
                    (rows, in_features, out_features),
                )?;
                let mut shape = xl.dims().to_vec();
                *shape.last_mut().expect("checked above") = out_features;
                return Ok((wrap(out, dev), Shape::from(shape)));
            }
            let pre = if op.act.is_some() {
                op.pre.peek(name)?
            } else {
                op.pre.take(name)?
            };
            let (storage, pl) = pre.storage_and_layout();
            let Storage::Cuda(p) = &*storage else {
                bail!("{name}: the product on the CUDA device expected")
            };
            let dims = rows_cols(name, pl, Some(bl))?;
            let (out_features, in_features) = wl.shape().dims2()?;
            if xl.dims().last() != Some(&in_features) || dims.1 != out_features {
                bail!(
                    "{name}: an input {:?} for a weight {:?}",
                    xl.dims(),
                    wl.dims()
                )
            }
            let dev = &x.device;
            let out = forward::<T>(
                dev,
                &view(name, "product", p, pl)?,
                Some(&view(name, "bias", b, bl)?),
                dims,
                code(op.act),
                vector_end::<T>(dims.1, &[pl, bl]),
            )?;
            let mut shape = xl.dims().to_vec();
            *shape.last_mut().expect("checked above") = out_features;
            Ok((wrap(out, dev), Shape::from(shape)))
        }
        by_dtype!(self.name(), x, run(self, (x, xl), (w, wl), (b, bl)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        crate::kernels::profiled_backward(
            self.caller.or(match (self.act, self.input_act) {
                (Some(_), _) => "linear_gelu",
                (None, Some(_)) => "feed_forward",
                (None, None) => "linear",
            }),
            grad.device(),
            || {
                let (out_features, in_features) = weight.dims2()?;
                let rows = x.elem_count() / in_features.max(1);
                let grad = grad.contiguous()?.reshape((rows, out_features))?;
                let x_rows = x.detach().reshape((rows, in_features))?;
                // A weight kept in another dtype: cast again for the input's gradient, and its
                // own gradient cast back to it.
                let weight_dtype = weight.dtype();
                let weight = weight.detach().to_dtype(x.dtype())?;
                // Without an activation the product's gradient is the output's, and its
                // column sums (the bias's gradient) may come out of the weight gradient's
                // product (`lt_raw`).
                let bias_in_product =
                    self.act.is_none() && lt_backward_takes(&[&grad, &x_rows, &weight]);
                let (grad_pre, grad_bias) = match self.act {
                    Some(_) => {
                        let pre = self.pre.take(self.name())?;
                        let op = BiasActBackwardOp { act: self.act };
                        let packed = pre.apply_op3_no_bwd(bias, &grad, &op)?;
                        let n = rows * out_features;
                        (
                            packed.narrow(0, 0, n)?.reshape((rows, out_features))?,
                            Some(packed.narrow(0, n, out_features)?),
                        )
                    }
                    None if bias_in_product => (grad, None),
                    None => {
                        let op = BiasActBackwardOp { act: None };
                        // The kernel sums the bias's gradient (it reads `y`, here the output,
                        // only for an activation).
                        let y = out.reshape((rows, out_features))?;
                        let packed = y.apply_op3_no_bwd(bias, &grad, &op)?;
                        (grad, Some(packed))
                    }
                };
                let lt = lt_backward_takes(&[&grad_pre, &x_rows, &weight]);
                let grad_x = if lt {
                    grad_pre.apply_op2_no_bwd(&weight, &LtGradient::Input)?
                } else {
                    grad_pre.matmul(&weight)?
                };
                let (input, grad_x) = match self.input_act {
                    // The product's input was `act(x)`: recomputed, and the gradient taken
                    // through it.
                    Some(act) => (
                        x_rows.apply_op1_no_bwd(&ActOp { act })?,
                        x_rows.apply_op2_no_bwd(&grad_x, &ActBackwardOp { act })?,
                    ),
                    None => (x_rows, grad_x),
                };
                let (grad_weight, grad_bias) = match grad_bias {
                    Some(grad_bias) if lt => (
                        input.apply_op2_no_bwd(&grad_pre, &LtGradient::Weight)?,
                        grad_bias,
                    ),
                    Some(grad_bias) => (grad_pre.t()?.matmul(&input)?, grad_bias),
                    None => {
                        let packed =
                            input.apply_op2_no_bwd(&grad_pre, &LtGradient::WeightAndBias)?;
                        let elements = out_features * in_features;
                        let start = bias_gradient_start(elements, packed.dtype().size_in_bytes());
                        (
                            packed
                                .narrow(0, 0, elements)?
                                .reshape((out_features, in_features))?,
                            packed.narrow(0, start, out_features)?,
                        )
                    }
                };
                // Handed over in the product's dtype (cast, or added into the parameter's
                // gradient without a cast copy, where the sink's gradient is added), else cast
                // back to the weight's.
                let grad_weight = match &self.sink {
                    Some(sink) => {
                        sink.put(&grad_weight)?;
                        None
                    }
                    None => Some(grad_weight.to_dtype(weight_dtype)?),
                };
                Ok((
                    Some(grad_x.reshape(x.shape())?),
                    grad_weight,
                    Some(grad_bias),
                ))
            },
        )
    }
}

/// The backward of a linear layer's end from its product `y`, the bias and the output's
/// gradient (see [`backward`]).
struct BiasActBackwardOp {
    act: Option<Gelu>,
}

impl CustomOp3 for BiasActBackwardOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-bias-activation-backward"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        y: &CudaStorage,
        yl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &BiasActBackwardOp,
            (y, yl): (&CudaStorage, &Layout),
            (b, bl): (&CudaStorage, &Layout),
            (g, gl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let (rows, cols) = rows_cols(name, yl, Some(bl))?;
            crate::host::same_shape(name, yl, gl)?;
            let dev = &y.device;
            let out = backward::<T>(
                dev,
                &view(name, "input", y, yl)?,
                Some(&view(name, "bias", b, bl)?),
                &view(name, "gradient", g, gl)?,
                (rows, cols),
                code(op.act),
                vector_end::<T>(cols, &[yl, bl, gl]),
            )?;
            let len = out.len();
            Ok((wrap(out, dev), Shape::from(len)))
        }
        by_dtype!(self.name(), y, run(self, (y, yl), (b, bl), (g, gl)))
    }
}

/// `act(y)` without a bias.
struct ActOp {
    act: Gelu,
}

impl CustomOp1 for ActOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-activation"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, y: &CudaStorage, yl: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &ActOp,
            (y, yl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let dims = rows_cols(name, yl, None)?;
            let dev = &y.device;
            let out = forward::<T>(
                dev,
                &view(name, "input", y, yl)?,
                None,
                dims,
                code(Some(op.act)),
                vector_end::<T>(dims.1, &[yl]),
            )?;
            Ok((wrap(out, dev), yl.shape().clone()))
        }
        by_dtype!(self.name(), y, run(self, (y, yl)))
    }

    fn bwd(&self, y: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        crate::kernels::profiled_backward("gelu", grad.device(), || {
            let grad_y =
                y.apply_op2_no_bwd(&grad.contiguous()?, &ActBackwardOp { act: self.act })?;
            Ok(Some(grad_y.reshape(y.shape())?))
        })
    }
}

/// The backward of [`ActOp`] from `y` and the output's gradient.
struct ActBackwardOp {
    act: Gelu,
}

impl CustomOp2 for ActBackwardOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-activation-backward"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        y: &CudaStorage,
        yl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &ActBackwardOp,
            (y, yl): (&CudaStorage, &Layout),
            (g, gl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let dims = rows_cols(name, yl, None)?;
            crate::host::same_shape(name, yl, gl)?;
            let dev = &y.device;
            let out = backward::<T>(
                dev,
                &view(name, "input", y, yl)?,
                None,
                &view(name, "gradient", g, gl)?,
                dims,
                code(Some(op.act)),
                vector_end::<T>(dims.1, &[yl, gl]),
            )?;
            Ok((wrap(out, dev), yl.shape().clone()))
        }
        by_dtype!(self.name(), y, run(self, (y, yl), (g, gl)))
    }
}

/// [`crate::kernels::Kernels::linear`] (`act` `None`) and
/// [`crate::kernels::Kernels::linear_gelu`] on CUDA, in `x`'s dtype: `x` `[..., in]`, `weight`
/// `[out, in]`, `bias` `[out]`.
pub(crate) fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    act: Option<Gelu>,
) -> Result<Tensor> {
    linear_node(x, weight, bias, act, None, None)
}

/// [`linear`] (no activation) with the weight's gradient handed to `sink`
/// ([`crate::kernels::Kernels::linear_into`]). A weight in another dtype than `x` (the f32
/// word embeddings) goes into the op, which casts it for the product and its gradient back
/// (the op's gradient, in `x`'s dtype, cast to the weight's by the sink).
pub(crate) fn linear_into(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    sink: &GradientSink,
) -> Result<Tensor> {
    linear_node(x, weight, bias, None, None, Some(sink.clone()))
}

/// GELU then a linear layer on CUDA, `GELU(x) · weightᵀ + bias`, in `x`'s dtype, as one node
/// that keeps `x` alone: the activation is a temporary for cuBLAS's product and is recomputed
/// in the backward pass (the feed-forward's second layer,
/// [`crate::kernels::Kernels::feed_forward`]). The twin of `cpu::GeluLinear`.
pub(crate) fn gelu_linear(x: &Tensor, weight: &Tensor, bias: &Tensor, act: Gelu) -> Result<Tensor> {
    linear_node(x, weight, bias, None, Some(act), None)
}

/// `act(input_act(x) · weightᵀ + bias)` as one [`LinearOp`]: the product by cuBLAS outside
/// the graph, handed over.
fn linear_node(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    act: Option<Gelu>,
    input_act: Option<Gelu>,
    sink: Option<GradientSink>,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = tape::contiguous(x)?;
    let (_, in_features) = weight.dims2()?;
    let rows = x.elem_count() / in_features.max(1);
    let bias = tape::to_dtype(bias, dtype)?;
    let same = weight.dtype() == dtype;
    if same && act.is_none() && input_act.is_none() && epilogue_takes(&x, weight, &bias, rows) {
        let op = LinearOp {
            act,
            input_act,
            pre: Handoff::empty(),
            epilogue: true,
            sink,
            caller: crate::kernels::Caller::now(),
        };
        return tape::apply_op3(&x, weight, &bias, op);
    }
    let input = x.detach().reshape((rows, in_features))?;
    let input = match input_act {
        Some(act) => input.apply_op1_no_bwd(&ActOp { act })?,
        None => input,
    };
    // A weight kept in another dtype: a cast copy for the product, dropped after it.
    let product_weight = weight.detach().to_dtype(dtype)?;
    let pre = input.matmul(&product_weight.t()?)?;
    drop((input, product_weight));
    let op = LinearOp {
        act,
        input_act,
        pre: Handoff::new(pre),
        epilogue: false,
        sink,
        caller: crate::kernels::Caller::now(),
    };
    tape::apply_op3(&x, weight, &bias, op)
}

/// GELU on CUDA in `y`'s dtype.
pub(crate) fn activation(y: &Tensor, act: Gelu) -> Result<Tensor> {
    tape::apply_op1(&tape::contiguous(y)?, ActOp { act })
}

/// cuBLASLt's own GELU (`CUBLASLT_EPILOGUE_GELU`, through cudarc's `matmul`) of each of `x`'s
/// elements: `x` (`[n, k]` f32, row-major) times a `[k, k]` identity, the epilogue applied to
/// the product. Where every element of `x` has at most 8 significant bits (TF32, cudarc's f32
/// product, keeps 11) each output is the epilogue's GELU of that element exactly, so comparing
/// it with GELU's erf form and its tanh approximation tells which one the epilogue computes
/// (`check::cuda_gelu_epilogue`): whether its gradient's epilogue (`DGELU_BGRAD`) could take
/// BERT's GELU backward and bias sums into the input gradient's product.
pub(crate) fn gelu_epilogue(x: &Tensor, identity: &Tensor) -> Result<Tensor> {
    x.apply_op2_no_bwd(identity, &GeluEpilogue)
}

struct GeluEpilogue;

impl CustomOp2 for GeluEpilogue {
    fn name(&self) -> &'static str {
        "bertkit-cuda-gelu-epilogue"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        identity: &CudaStorage,
        il: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let name = CustomOp2::name(self);
        let ((n, k), (rows, cols)) = (xl.shape().dims2()?, il.shape().dims2()?);
        if (rows, cols) != (k, k) {
            bail!(
                "{name}: a [{k}, {k}] identity expected, got {:?}",
                il.dims()
            )
        }
        let (x_view, identity_view) = (
            view::<f32>(name, "x", x, xl)?,
            view::<f32>(name, "the identity", identity, il)?,
        );
        let dev = &x.device;
        let lt = lt_handle(dev)?;
        // Column-major: the identity [k, k] times x's transpose [k, n] (x row-major), [k, n]:
        // x's elements in x's order.
        let cfg = lt_product((false, false), (k, n, k), (k, k));
        // SAFETY: the product writes every element (beta 0).
        let mut out = unsafe { dev.alloc::<f32>(n * k)? };
        let gelu = candle_core::cuda_backend::cudarc::cublaslt::Activation::Gelu;
        // SAFETY: the layouts are those of the buffers: the identity k x k, x k x n and the
        // output k x n (column-major), no bias.
        unsafe { lt.matmul(cfg, &identity_view, &x_view, &mut out, None, Some(&gelu)) }
            .map_err(lt_error)?;
        Ok((wrap(out, dev), Shape::from((n, k))))
    }
}
