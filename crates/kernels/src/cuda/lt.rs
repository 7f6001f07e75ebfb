//! cuBLASLt's products for the linear layers on CUDA: the forward with the bias in its
//! epilogue, the backward's two products (the bias gradient from the weight gradient's
//! `BGRADB` epilogue), each through a per-device handle; and a probe of which GELU its own
//! epilogue computes.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublaslt::result::{self as lt_result, CublasError};
use candle_core::cuda_backend::cudarc::cublaslt::sys as lt_sys;
use candle_core::cuda_backend::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig, MatmulShared};
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, DevicePtr, DevicePtrMut};

use super::bias_act::{backward, vector_end};
use super::*;

/// The cuBLASLt handle of each device (with the workspace cudarc sizes for the device), made at
/// the first product that takes it.
static LT_HANDLES: Mutex<Vec<(DeviceId, Arc<CudaBlasLT>)>> = Mutex::new(Vec::new());

pub(super) fn lt_handle(dev: &CudaDevice) -> Result<Arc<CudaBlasLT>> {
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

pub(super) fn lt_error(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt: {e:?}"))
}

/// One column-major cuBLASLt product `C = op(A) · op(B)`, `C` `[m, n]` (its leading
/// dimension `m`), `op` transposing where `(transa, transb)` say, with the leading dimensions
/// `(lda, ldb)` of A and B as stored: no batch, alpha 1, beta 0.
pub(super) fn lt_product(
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

/// The most workspace the products through [`lt_raw`] offer cuBLASLt's search: the largest
/// cudarc's handle allocates (NVIDIA's recommendation for the newest cards).
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
pub(super) fn lt_linear<T: Element>(
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
pub(super) fn lt_backward_takes(tensors: &[&Tensor]) -> bool {
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
pub(super) enum LtGradient {
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
pub(super) fn bias_gradient_start(elements: usize, element_bytes: usize) -> usize {
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
