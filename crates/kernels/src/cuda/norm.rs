//! LayerNorm and a sublayer's end (`LayerNorm(dropout(x) + residual)`) on CUDA: a block per
//! row, the row's statistics recomputed in the backward rather than stored; the twins of
//! `cpu::LayerNorm` and `cpu::ResidualLayerNorm`.

use super::*;

/// What the norm kernels read besides `x` and the parameters.
#[derive(Debug, Clone, Copy)]
struct NormShape {
    rows: usize,
    hidden: usize,
    eps: f32,
    dropout: DeviceDropout,
    /// The packing's padded row length (the dropout keys' places), or 1.
    seq: usize,
    /// Whether the kernels 16 bytes a thread run ([`vector_form`]).
    vector: bool,
}

/// Whether LayerNorm's kernels 16 bytes a thread take rows of `hidden` elements of `T` whose
/// inputs start at the elements `starts` of their buffers (the buffers themselves are aligned):
/// whole 16-byte pieces, at most 1,024 of them a row (a thread each), every row on a 16-byte
/// boundary. Other rows take the kernels a block a row, an element a thread.
fn vector_form<T>(hidden: usize, starts: &[usize]) -> bool {
    in_16_byte_pieces::<T>(hidden, starts.iter().copied()) && pieces::<T>(hidden) <= 1024
}

/// The most 16-byte pieces a lane of the kernels a warp a row holds (`WARP_ROW_PIECES` in
/// `kernels.cu`).
const WARP_ROW_PIECES: usize = 4;

/// A block's threads for the kernels 16 bytes a thread: one per piece of the row, whole warps.
fn vector_threads<T>(hidden: usize) -> usize {
    pieces::<T>(hidden).next_multiple_of(32)
}

/// A row's 16-byte pieces: the threads of the kernels 16 bytes a thread, the keep bytes a row.
fn pieces<T>(hidden: usize) -> usize {
    hidden / piece_elements::<T>()
}

/// The forward kernel: `y = norm(dropout(x) + residual) · weight + bias`; `keep`: where the
/// dropout's keep bytes go ([`keeps_bits`]).
#[allow(clippy::too_many_arguments)]
fn forward<T: Element>(
    dev: &CudaDevice,
    x: &CudaView<'_, T>,
    residual: Option<&CudaView<'_, T>>,
    weight: &CudaView<'_, T>,
    bias: &CudaView<'_, T>,
    places: Option<&CudaView<'_, u32>>,
    s: NormShape,
    keep: Option<&mut CudaSlice<u8>>,
) -> Result<CudaSlice<T>> {
    // SAFETY: every element is written by the kernel.
    let mut y = unsafe { dev.alloc::<T>(s.rows * s.hidden)? };
    let (rows, hidden, seq) = (s.rows as i32, s.hidden as i32, s.seq as i32);
    let warp = warp_rows::<T>(&s);
    let keep = keep.filter(|_| warp);
    let (name, cfg) = if warp {
        // Four warps a block, a warp a row.
        let name = if keep.is_some() {
            "layer_norm_warp_forward_bits"
        } else {
            "layer_norm_warp_forward"
        };
        (name, config(s.rows.div_ceil(4), 128, 0))
    } else if s.vector {
        (
            "layer_norm_vec_forward",
            config(s.rows, vector_threads::<T>(s.hidden), 0),
        )
    } else {
        (
            "layer_norm_forward",
            config(s.rows, row_threads(s.hidden), s.hidden + 32),
        )
    };
    launch!(T, dev, name, cfg, |b| {
        b.arg(x);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&NULL),
        };
        b.arg(weight).arg(bias).arg(&mut y).arg(&rows).arg(&hidden);
        b.arg(&s.eps).arg(&s.dropout);
        match places {
            Some(p) => b.arg(p),
            None => b.arg(&NULL),
        };
        b.arg(&seq);
        if let Some(keep) = keep {
            b.arg(keep);
        }
    })?;
    Ok(y)
}

/// Whether the forward and the backward take a warp a row (its loads all in flight, its sums
/// by warp shuffles): the rows 16 bytes a thread of at most [`WARP_ROW_PIECES`] pieces a lane.
fn warp_rows<T>(s: &NormShape) -> bool {
    s.vector && pieces::<T>(s.hidden) <= WARP_ROW_PIECES * 32
}

/// Whether a sublayer end's forward writes its dropout's keep bytes for its backward (a byte a
/// 16-byte piece, read where the keeps would be drawn again): with dropout, a warp a row.
fn keeps_bits<T>(s: &NormShape) -> bool {
    s.dropout.on != 0 && warp_rows::<T>(s)
}

/// The keep bytes of a sublayer end: one a 16-byte piece of a row.
fn keep_bytes<T>(s: &NormShape) -> usize {
    s.rows * pieces::<T>(s.hidden)
}

/// Blocks of the backward kernels a block a row: four rows a block at BERT-large's 8,192
/// tokens (at 512, each block's 16 rows one after the other, each four block-wide sums).
const NORM_BACKWARD_BLOCKS: usize = 2048;
/// The most threads a block of the backward 16 bytes a thread with each row's loads at once
/// takes (its launch bounds, which hold it to the registers of six blocks of 128 an SM): rows
/// of up to 2,048 bf16 or 1,024 f32 elements; wider ones load the gradient after the row's
/// statistics.
const AHEAD_THREADS: usize = 256;

/// Warps a block of the backward a warp a row (`NORM_WARP_BACKWARD_WARPS` in `kernels.cu`).
const WARP_BACKWARD_WARPS: usize = 4;
/// Its block's threads.
const WARP_BACKWARD_THREADS: usize = 32 * WARP_BACKWARD_WARPS;

/// The backward kernel, packed as `[rows + rows (with `grad_x`) + 2, hidden]`: the sum's
/// gradient, `x`'s through the dropout when asked, then the weight's and the bias's.
#[allow(clippy::too_many_arguments)]
fn backward<T: Element>(
    dev: &CudaDevice,
    x: &CudaView<'_, T>,
    residual: Option<&CudaView<'_, T>>,
    weight: &CudaView<'_, T>,
    grad: &CudaView<'_, T>,
    places: Option<&CudaView<'_, u32>>,
    s: NormShape,
    grad_x: bool,
    keep: Option<&CudaSlice<u8>>,
) -> Result<CudaSlice<T>> {
    let (n, h) = (s.rows * s.hidden, s.hidden);
    let parts = if grad_x { 2 } else { 1 };
    // SAFETY: every element is written: the gradients by the first kernel, the parameters' by
    // the column sums.
    let mut out = unsafe { dev.alloc::<T>(parts * n + 2 * h)? };
    let warp = warp_rows::<T>(&s);
    let blocks = if warp {
        // Every block resident at once (five an SM on sm_90 under its launch bounds: 94
        // registers, 32 KiB of shared memory; the form reading keep bytes has the same
        // bounds), each warp its share of the rows.
        let resident =
            resident_blocks::<T>(dev, "layer_norm_warp_backward", WARP_BACKWARD_THREADS)?;
        s.rows.div_ceil(WARP_BACKWARD_WARPS).clamp(1, resident)
    } else {
        s.rows.clamp(1, NORM_BACKWARD_BLOCKS)
    };
    let partial = if s.vector {
        // SAFETY: every block writes its whole `[2, hidden]` (its threads cover the row).
        unsafe { dev.alloc::<f32>(blocks * 2 * h)? }
    } else {
        dev.alloc_zeros::<f32>(blocks * 2 * h)?
    };
    let (rows, hidden, seq) = (s.rows as i32, s.hidden as i32, s.seq as i32);
    {
        let (mut grad_sum, mut rest) = out.split_at_mut(n);
        let mut grad_x_view = rest.slice_mut(0..if grad_x { n } else { 0 });
        // (The keep bytes only a warp a row, as the forward wrote them.)
        let keep = keep.filter(|_| warp);
        let (name, cfg) = if warp {
            let name = if keep.is_some() {
                "layer_norm_warp_backward_bits"
            } else {
                "layer_norm_warp_backward"
            };
            (name, config(blocks, WARP_BACKWARD_THREADS, 0))
        } else if s.vector {
            let name = if vector_threads::<T>(s.hidden) <= AHEAD_THREADS {
                "layer_norm_vec_backward_ahead"
            } else {
                "layer_norm_vec_backward"
            };
            (name, config(blocks, vector_threads::<T>(s.hidden), 0))
        } else {
            (
                "layer_norm_backward",
                config(blocks, row_threads(s.hidden), 3 * s.hidden + 32),
            )
        };
        launch!(T, dev, name, cfg, |b| {
            b.arg(x);
            match residual {
                Some(r) => b.arg(r),
                None => b.arg(&NULL),
            };
            b.arg(weight).arg(grad).arg(&mut grad_sum);
            if grad_x {
                b.arg(&mut grad_x_view);
            } else {
                b.arg(&NULL);
            }
            b.arg(&partial)
                .arg(&rows)
                .arg(&hidden)
                .arg(&s.eps)
                .arg(&s.dropout);
            match places {
                Some(p) => b.arg(p),
                None => b.arg(&NULL),
            };
            b.arg(&seq);
            if let Some(keep) = keep {
                b.arg(keep);
            }
        })?;
    }
    let mut params = out.slice_mut(parts * n..);
    column_sums::<T>(dev, &partial, blocks, &mut params, 2 * h)?;
    Ok(out)
}

/// `cpu::LayerNorm` on CUDA: `x`, `weight`, `bias` (the parameters in `x`'s dtype).
struct LayerNormOp {
    eps: f32,
}

/// A plain LayerNorm's shape (no residual, no dropout), its parameters checked as on the CPU;
/// the inputs' layouts (`x`, the parameters, the gradient's) say whether the kernels 16 bytes a
/// thread take it.
fn plain_shape<T>(
    op: &str,
    x: &Layout,
    params: &[&Layout],
    eps: f32,
    grad: Option<&Layout>,
) -> Result<NormShape> {
    let (rows, hidden) = super::super::norm_shape(op, x, params)?;
    let starts: Vec<usize> = std::iter::once(x)
        .chain(params.iter().copied())
        .chain(grad)
        .map(Layout::start_offset)
        .collect();
    Ok(NormShape {
        rows,
        hidden,
        eps,
        dropout: DeviceDropout::default(),
        seq: 1,
        vector: vector_form::<T>(hidden, &starts),
    })
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-layer-norm"
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
            op: &LayerNormOp,
            (x, xl): (&CudaStorage, &Layout),
            (w, wl): (&CudaStorage, &Layout),
            (b, bl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let s = plain_shape::<T>(name, xl, &[wl, bl], op.eps, None)?;
            let dev = &x.device;
            let y = forward::<T>(
                dev,
                &view(name, "input", x, xl)?,
                None,
                &view(name, "weight", w, wl)?,
                &view(name, "bias", b, bl)?,
                None,
                s,
                None,
            )?;
            Ok((wrap(y, dev), xl.shape().clone()))
        }
        by_dtype!(self.name(), x, run(self, (x, xl), (w, wl), (b, bl)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        crate::profiled_backward("layer_norm", grad.device(), || {
            let packed = x.apply_op3_no_bwd(
                weight,
                &grad.contiguous()?,
                &LayerNormBackwardOp { eps: self.eps },
            )?;
            super::super::norm_gradients(&packed, x, weight.elem_count())
        })
    }
}

/// LayerNorm's backward from `x`, `weight` and the output's gradient: `[rows + 2, hidden]`.
struct LayerNormBackwardOp {
    eps: f32,
}

impl CustomOp3 for LayerNormBackwardOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-layer-norm-backward"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &LayerNormBackwardOp,
            (x, xl): (&CudaStorage, &Layout),
            (w, wl): (&CudaStorage, &Layout),
            (g, gl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let s = plain_shape::<T>(name, xl, &[wl], op.eps, Some(gl))?;
            crate::host::same_shape(name, xl, gl)?;
            let dev = &x.device;
            let out = backward::<T>(
                dev,
                &view(name, "input", x, xl)?,
                None,
                &view(name, "weight", w, wl)?,
                &view(name, "gradient", g, gl)?,
                None,
                s,
                false,
                None,
            )?;
            Ok((wrap(out, dev), Shape::from((s.rows + 2, s.hidden))))
        }
        by_dtype!(self.name(), x, run(self, (x, xl), (w, wl), (g, gl)))
    }
}

/// [`crate::Kernels::layer_norm`] on CUDA, in `x`'s dtype (f32 or bf16).
pub(crate) fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    tape::apply_op3(
        &tape::contiguous(x)?,
        &tape::to_dtype(weight, dtype)?,
        &tape::to_dtype(bias, dtype)?,
        LayerNormOp { eps: eps as f32 },
    )
}

/// `cpu::ResidualLayerNorm` on CUDA: `x`, `residual` (`[tokens, hidden]`) and the parameters
/// `[2, hidden]` (weight, then bias), the dropout's keys per token place.
struct ResidualLayerNormOp {
    eps: f32,
    dropout: DeviceDropout,
    places: Places,
    /// The dropout's keep bytes, from the forward to the backward, where it writes them
    /// ([`keeps_bits`]).
    keep: Handoff<CudaSlice<u8>>,
}

impl ResidualLayerNormOp {
    /// The sublayer end's shape; `grad` the gradient's start where the backward reads one (the
    /// inputs' starts say whether the kernels 16 bytes a thread take it).
    fn shape<T>(
        &self,
        op: &str,
        (xl, rl, pl): (&Layout, &Layout, &Layout),
        grad: Option<usize>,
    ) -> Result<NormShape> {
        let (rows, hidden) = super::super::residual_norm_shape(op, xl, rl, pl)?;
        let starts: Vec<usize> = [xl, rl, pl]
            .map(Layout::start_offset)
            .into_iter()
            .chain([pl.start_offset() + hidden])
            .chain(grad)
            .collect();
        if self.dropout.on != 0 && rows != self.places.tokens {
            bail!(
                "{op}: {rows} rows for a packing of {} tokens",
                self.places.tokens
            )
        }
        Ok(NormShape {
            rows,
            hidden,
            eps: self.eps,
            dropout: self.dropout,
            seq: self.places.seq,
            vector: vector_form::<T>(hidden, &starts),
        })
    }
}

impl CustomOp3 for ResidualLayerNormOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-residual-layer-norm"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        r: &CudaStorage,
        rl: &Layout,
        p: &CudaStorage,
        pl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &ResidualLayerNormOp,
            (x, xl): (&CudaStorage, &Layout),
            (r, rl): (&CudaStorage, &Layout),
            (p, pl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let s = op.shape::<T>(name, (xl, rl, pl), None)?;
            let dev = &x.device;
            let params = view::<T>(name, "parameters", p, pl)?;
            // SAFETY: the forward writes every row's byte of every piece.
            let mut keep = if keeps_bits::<T>(&s) {
                Some(unsafe { dev.alloc::<u8>(keep_bytes::<T>(&s))? })
            } else {
                None
            };
            let y = with_view::<u32, _>(name, "token places", &op.places.gather, |places| {
                forward::<T>(
                    dev,
                    &view(name, "input", x, xl)?,
                    Some(&view(name, "residual", r, rl)?),
                    &params.slice(0..s.hidden),
                    &params.slice(s.hidden..2 * s.hidden),
                    Some(&places),
                    s,
                    keep.as_mut(),
                )
            })?;
            if let Some(keep) = keep {
                op.keep.put(name, keep)?;
            }
            Ok((wrap(y, dev), xl.shape().clone()))
        }
        by_dtype!(self.name(), x, run(self, (x, xl), (r, rl), (p, pl)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        residual: &Tensor,
        params: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        crate::profiled_backward("residual_layer_norm", grad.device(), || {
            let dropped = self.dropout.on != 0;
            let op = ResidualLayerNormBackwardOp {
                forward: ResidualLayerNormOp {
                    eps: self.eps,
                    dropout: self.dropout,
                    places: self.places.clone(),
                    keep: Handoff::empty(),
                },
                grad: Handoff::new(grad.contiguous()?),
                // (The bytes where the forward wrote them: else the backward draws the same
                // keeps from the keys.)
                keep: self.keep.take_any(),
            };
            let packed = x.apply_op3_no_bwd(residual, params, &op)?;
            let hidden = params.dim(1)?;
            let rows = x.elem_count() / hidden;
            let grad_residual = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
            let (grad_x, at) = if dropped {
                (packed.narrow(0, rows, rows)?.reshape(x.shape())?, 2 * rows)
            } else {
                (grad_residual.clone(), rows)
            };
            let grad_params = packed.narrow(0, at, 2)?;
            Ok((Some(grad_x), Some(grad_residual), Some(grad_params)))
        })
    }
}

/// The sublayer end's backward: `[rows (+ rows with dropout) + 2, hidden]`.
struct ResidualLayerNormBackwardOp {
    forward: ResidualLayerNormOp,
    grad: Handoff,
    /// The forward's keep bytes, where it wrote them.
    keep: Option<CudaSlice<u8>>,
}

impl CustomOp3 for ResidualLayerNormBackwardOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-residual-layer-norm-backward"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        r: &CudaStorage,
        rl: &Layout,
        p: &CudaStorage,
        pl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &ResidualLayerNormBackwardOp,
            (x, xl): (&CudaStorage, &Layout),
            (r, rl): (&CudaStorage, &Layout),
            (p, pl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let grad = op.grad.take(name)?;
            let s =
                op.forward
                    .shape::<T>(name, (xl, rl, pl), Some(grad.layout().start_offset()))?;
            let dev = &x.device;
            let params = view::<T>(name, "parameters", p, pl)?;
            let dropped = s.dropout.on != 0;
            let out = with_view::<T, _>(name, "gradient", &grad, |g| {
                with_view::<u32, _>(name, "token places", &op.forward.places.gather, |places| {
                    backward::<T>(
                        dev,
                        &view(name, "input", x, xl)?,
                        Some(&view(name, "residual", r, rl)?),
                        &params.slice(0..s.hidden),
                        &g,
                        Some(&places),
                        s,
                        dropped,
                        op.keep.as_ref(),
                    )
                })
            })?;
            let rows = if dropped { 2 * s.rows } else { s.rows };
            Ok((wrap(out, dev), Shape::from((rows + 2, s.hidden))))
        }
        by_dtype!(self.name(), x, run(self, (x, xl), (r, rl), (p, pl)))
    }
}

/// [`crate::Kernels::residual_layer_norm`] on CUDA: `dropout` drawn from `source` in
/// training (the CPU kernel's mask), in `x`'s dtype.
pub(crate) fn residual_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    packing: &Packing,
    dropout: DeviceDropout,
    (weight, bias, eps): (&Tensor, &Tensor, f64),
) -> Result<Tensor> {
    let dtype = x.dtype();
    let params = tape::stack_rows(&[
        &tape::to_dtype(weight, dtype)?,
        &tape::to_dtype(bias, dtype)?,
    ])?;
    tape::apply_op3(
        &tape::contiguous(x)?,
        &tape::contiguous(&tape::to_dtype(residual, dtype)?)?,
        &params,
        ResidualLayerNormOp {
            eps: eps as f32,
            dropout,
            places: Places::of(packing),
            keep: Handoff::empty(),
        },
    )
}
