//! A linear layer's end on CUDA: the bias and the activation (none, or GELU in either form)
//! after the product in one pass, and in the backward the activation's slope and the bias's
//! partial sums in one pass (16 bytes a thread where the rows allow, else an element a thread).

use super::*;
use crate::Gelu;

/// The activation as the kernels number it.
pub(super) fn code(act: Option<Gelu>) -> i32 {
    match act {
        None => 0,
        Some(Gelu::Erf) => 1,
        Some(Gelu::Tanh) => 2,
    }
}

pub(super) fn rows_cols(op: &str, y: &Layout, bias: Option<&Layout>) -> Result<(usize, usize)> {
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
pub(super) fn vector_end<T>(cols: usize, layouts: &[&Layout]) -> bool {
    in_16_byte_pieces::<T>(cols, layouts.iter().map(|l| l.start_offset()))
}

/// Rows a thread of `bias_act_rows_forward` takes its piece of (the grid's rows a quarter of
/// the matrix's: BERT-large's `[8192, 4096]` in 4,096 blocks of 256 threads).
const ROWS_A_THREAD: usize = 4;

pub(super) fn forward<T: Element>(
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
pub(super) fn backward<T: Element>(
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
