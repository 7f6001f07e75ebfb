//! The optimiser update of one parameter group on CUDA (the `cuda` feature), the twin of
//! `cpu_update`: the group's weights and moments packed once into one `[3, rows, numel]` f32
//! buffer and updated where they are (`cuda_update.cu`), in three launches for LAMB (the
//! moments, each row's trust ratio, the weights) and one for AdamW, where the composed update
//! makes about fifteen element-wise passes, each a fresh tensor; each parameter is set from its
//! new weights as the kernel writes them (no cast of the group, no copy per parameter). The
//! copies around the update take one launch each too, however many parameters: [`gather`]
//! makes or adds to the flat gradient bucket from every gradient (`crate::bucket`), and
//! [`squared_norm`] and [`held_squared_norm`] sum its squares. `bertkit check kernels --device
//! cuda` compares it with the CPU's update ([`crate::check::check_update`]).

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, DType, InplaceOp2, Layout, Result, Storage, Tensor, Var,
    backend::BackendStorage, bail,
};

use crate::cpu_update::{Constants, Scalars};

/// The kernels' PTX (build.rs).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/update.ptx"));
/// The module's name in candle's cache of loaded modules.
const MODULE: &str = "bertkit-optimizer";
/// Elements a block covers in a row (`CHUNK` in `cuda_update.cu`).
const CHUNK: usize = 4096;
/// Threads a block (a multiple of 32, as the kernels' reductions need).
const THREADS: u32 = 256;

/// Each row's trust ratio from its blocks' partial norms, a block a row (`trust_ratios` in
/// `cuda_update.cu`): `[rows]` f32 for the weights' launch.
fn trust_ratios(
    dev: &candle_core::cuda_backend::CudaDevice,
    norms: &CudaSlice<f64>,
    rows: usize,
    blocks: usize,
) -> Result<CudaSlice<f32>> {
    // SAFETY: the launch writes every row's ratio.
    let mut ratios = unsafe { dev.alloc::<f32>(rows)? };
    let func = dev.get_or_load_custom_func("trust_ratios", MODULE, PTX)?;
    let mut b = func.builder();
    let (rows_i, blocks_i) = (rows as i32, blocks as i32);
    b.arg(norms).arg(&rows_i).arg(&blocks_i).arg(&mut ratios);
    let cfg = LaunchConfig {
        grid_dim: (rows.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments `trust_ratios` declares, in order; `norms` holds `rows · blocks · 2`
    // values and `ratios` `rows`.
    unsafe { b.launch(cfg) }.w()?;
    Ok(ratios)
}

// SAFETY: a plain `#[repr(C)]` value, laid out as the kernels' `struct Constants`.
unsafe impl DeviceRepr for Constants {}

/// The update of a group whose weights and moments are one `[3, rows, numel]` f32 `state`
/// (weights, first and second moments), from the bucket's rows `gradients`, written in place:
/// no state allocated per group per step; `params` (the group's parameters, one a row, in
/// their own dtype) set from the new weights.
pub(crate) fn update(state: &Tensor, gradients: &Tensor, s: Scalars, params: &[Var]) -> Result<()> {
    let op = UpdateInPlace::new(s, params, None)?;
    state.inplace_op2(&gradients.contiguous()?, &op)
}

/// As [`update`], from each row's gradient as the backward made it (`rows`, one a parameter in
/// the group's order: f32, bf16 or f16, `None` for zeros) times `unscale`, read by the moments'
/// launch itself (`update_moments_held`, `update_one_pass_held`): no flat gradient bucket. The
/// values the bucket's form reads, bit for bit (`pieces_to_flat` makes them with the same two
/// f32 operations).
pub(crate) fn update_held(
    state: &Tensor,
    rows: &[Option<&Tensor>],
    unscale: f64,
    s: Scalars,
    params: &[Var],
) -> Result<()> {
    let name = "the optimiser's update from held gradients";
    let numel = params.first().map_or(0, |p| p.elem_count());
    if rows.len() != params.len() {
        bail!(
            "{name}: {} gradients for {} parameters",
            rows.len(),
            params.len()
        )
    }
    // Held until the launch is queued (see `DeviceTensor::of`).
    let mut sources = Vec::with_capacity(rows.len());
    let mut table = Vec::with_capacity(rows.len());
    for &g in rows {
        table.push(device_gradient(name, g, numel, &mut sources)?);
    }
    let op = UpdateInPlace::new(s, params, Some((table, unscale as f32)))?;
    state.inplace_op1(&op)?;
    drop(sources);
    Ok(())
}

struct UpdateInPlace {
    constants: Constants,
    lr: f32,
    /// Where each row's parameter is, and its size.
    params: Vec<DeviceTensor>,
    numel: Vec<usize>,
    /// Each row's gradient as the backward made it and the factor it is read times
    /// ([`update_held`]); `None`: the bucket's rows, the op's second tensor.
    held: Option<(Vec<DeviceTensor>, f32)>,
}

/// Where the moments' launch reads the gradients (`BucketGradients`, `HeldGradients` in
/// `cuda_update.cu`).
enum Gradients<'a> {
    Bucket(CudaView<'a, f32>),
    Held(CudaSlice<DeviceTensor>, f32),
}

impl Gradients<'_> {
    /// The kernels' arguments for them, in order.
    fn push<'b>(&'b self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'b>) {
        match self {
            Gradients::Bucket(view) => b.arg(view),
            Gradients::Held(rows, unscale) => b.arg(rows).arg(unscale),
        };
    }
}

impl candle_core::InplaceOp1 for UpdateInPlace {
    fn name(&self) -> &'static str {
        "bertkit-cuda-optimizer-update-in-place-held"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        let name = candle_core::InplaceOp1::name(self);
        bail!("{name}: a CUDA kernel, given CPU tensors")
    }

    fn cuda_fwd(&self, state: &mut CudaStorage, sl: &Layout) -> Result<()> {
        let Some((table, unscale)) = &self.held else {
            let name = candle_core::InplaceOp1::name(self);
            bail!("{name}: no gradients")
        };
        let rows = upload(&state.device, table)?;
        self.launch(state, sl, &Gradients::Held(rows, *unscale))
    }
}

impl InplaceOp2 for UpdateInPlace {
    fn name(&self) -> &'static str {
        "bertkit-cuda-optimizer-update-in-place"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        let name = InplaceOp2::name(self);
        bail!("{name}: a CUDA kernel, given CPU tensors")
    }

    fn cuda_fwd(
        &self,
        state: &mut CudaStorage,
        sl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let (_, rows, numel) = sl.shape().dims3()?;
        let g_view = view(InplaceOp2::name(self), g, gl, (rows, numel), "gradients")?;
        self.launch(state, sl, &Gradients::Bucket(g_view))
    }
}

impl UpdateInPlace {
    /// The update with scalars `s` setting `params` (one a row), from `held` gradients or the
    /// bucket's rows (`None`).
    fn new(s: Scalars, params: &[Var], held: Option<(Vec<DeviceTensor>, f32)>) -> Result<Self> {
        Ok(UpdateInPlace {
            constants: Constants::of(s),
            lr: s.lr as f32,
            params: params
                .iter()
                .map(|p| DeviceTensor::of(p.as_tensor()))
                .collect::<Result<_>>()?,
            numel: params.iter().map(|p| p.elem_count()).collect(),
            held,
        })
    }

    /// The update's launches over `state` from `gradients`.
    fn launch(&self, state: &mut CudaStorage, sl: &Layout, gradients: &Gradients) -> Result<()> {
        let name = "bertkit-cuda-optimizer-update-in-place";
        let (parts, rows, numel) = sl.shape().dims3()?;
        let Some((start, end)) = sl.contiguous_offsets() else {
            bail!("{name}: a contiguous state expected")
        };
        if parts != 3 || state.dtype() != candle_core::DType::F32 {
            bail!(
                "{name}: a [3, rows, numel] f32 state expected, got {:?} {:?}",
                sl.dims(),
                state.dtype()
            )
        }
        if self.params.len() != rows || self.numel.iter().any(|&n| n != numel) {
            bail!(
                "{name}: {rows} parameters of {numel} elements expected, got {:?}",
                self.numel
            )
        }
        let dev = state.device.clone();
        let params = upload(&dev, &self.params)?;
        let (cfg, blocks) = grid(rows, numel);
        let (rows_i, numel_i) = (rows as i32, numel as i32);
        let mut state = state.as_cuda_slice_mut::<f32>()?.slice_mut(start..end);
        let held = matches!(gradients, Gradients::Held(..));
        if self.constants.trust_ratio == 0 {
            // No trust ratio: the moments, the update and the weights in one launch.
            let one_pass = if held {
                "update_one_pass_held"
            } else {
                "update_one_pass"
            };
            let func = dev.get_or_load_custom_func(one_pass, MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&mut state);
            gradients.push(&mut b);
            b.arg(&rows_i).arg(&numel_i);
            b.arg(&self.lr).arg(&self.constants).arg(&params);
            // SAFETY: the arguments `update_one_pass` declares, in order; `state`
            // holds `3 · rows · numel` values, `params` a row's parameter each (as below).
            unsafe { b.launch(cfg) }.w()?;
            return Ok(());
        }
        let norms = partial_norms(&dev, rows, blocks)?;
        let moments = if held {
            "update_moments_held"
        } else {
            "update_moments"
        };
        {
            let func = dev.get_or_load_custom_func(moments, MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&mut state);
            gradients.push(&mut b);
            b.arg(&norms);
            b.arg(&rows_i).arg(&numel_i).arg(&self.constants);
            unsafe { b.launch(cfg) }.w()?;
        }
        let ratios = trust_ratios(&dev, &norms, rows, blocks)?;
        {
            let func = dev.get_or_load_custom_func("update_weights", MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&mut state).arg(&rows_i).arg(&numel_i);
            b.arg(&self.lr)
                .arg(&self.constants)
                .arg(&params)
                .arg(&ratios);
            // SAFETY: the arguments `update_weights` declares, in order; `params`
            // holds a row's parameter each, of `numel` elements (checked above), which the
            // optimiser holds past the launch (it owns the variables); on candle's one stream
            // the writes come after every earlier use of the parameters, before any later.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    }
}

/// The launch shape: a block per `CHUNK` elements of a row (rows along y, strided
/// past 65,535), and the blocks a row.
fn grid(rows: usize, numel: usize) -> (LaunchConfig, usize) {
    let blocks = numel.div_ceil(CHUNK).max(1);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, rows.clamp(1, 65_535) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, blocks)
}

/// Each block's partial norms (`[rows, blocks, 2]` f64), zeroed: what the moments' launch
/// writes and the weights' launch (or `trust_ratios`) reads.
fn partial_norms(
    dev: &candle_core::cuda_backend::CudaDevice,
    rows: usize,
    blocks: usize,
) -> Result<CudaSlice<f64>> {
    dev.alloc_zeros::<f64>(rows * blocks * 2)
}

/// The contiguous f32 elements of one of the group's `[rows, numel]` buffers.
fn view<'a>(
    name: &str,
    s: &'a CudaStorage,
    l: &Layout,
    (rows, numel): (usize, usize),
    what: &str,
) -> Result<CudaView<'a, f32>> {
    if l.dims() != [rows, numel] || s.dtype() != candle_core::DType::F32 {
        bail!(
            "{name}: {what} of [{rows}, {numel}] f32 expected, got {:?} {:?}",
            l.dims(),
            s.dtype()
        )
    }
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{name}: contiguous {what} expected")
    };
    Ok(s.as_cuda_slice::<f32>()?.slice(start..end))
}

/// Element types as the copies take them (`ELEMENT_*` in `cuda_update.cu`).
fn element(dtype: DType) -> Result<(i32, u64)> {
    Ok(match dtype {
        DType::F32 => (0, 4),
        DType::BF16 => (1, 2),
        DType::F16 => (2, 2),
        other => bail!("the optimiser's copies take f32, bf16 or f16 tensors, not {other:?}"),
    })
}

/// A tensor on the device as the copies take it (`struct DeviceTensor` in `cuda_update.cu`):
/// the address of its first element and its element type; address 0 is none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DeviceTensor {
    address: u64,
    dtype: i32,
    unused: i32,
}

// SAFETY: a plain `#[repr(C)]` value, laid out as the kernels' `struct DeviceTensor`.
unsafe impl DeviceRepr for DeviceTensor {}

impl DeviceTensor {
    /// Where the elements of `t` (contiguous, f32, bf16 or f16, on a CUDA device) are. The
    /// address is good while `t`'s storage lives: the caller keeps `t` until its launch is
    /// queued (a storage freed before then could be handed, in stream order, to an allocation
    /// that writes it before the launch reads it).
    fn of(t: &Tensor) -> Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            bail!("the optimiser's copies: a tensor on the CUDA device expected")
        };
        let Some((start, _)) = layout.contiguous_offsets() else {
            bail!("the optimiser's copies: a contiguous tensor expected")
        };
        let (dtype, size) = element(s.dtype())?;
        let stream = s.device.cuda_stream();
        let base = match &s.slice {
            CudaStorageSlice::F32(slice) => slice.device_ptr(&stream).0,
            CudaStorageSlice::BF16(slice) => slice.device_ptr(&stream).0,
            CudaStorageSlice::F16(slice) => slice.device_ptr(&stream).0,
            _ => bail!("the optimiser's copies: {:?} storage", s.dtype()),
        };
        Ok(DeviceTensor {
            address: base + start as u64 * size,
            dtype,
            unused: 0,
        })
    }
}

/// A tensor's piece of a flat f32 buffer (`struct Piece` in `cuda_update.cu`): its `numel`
/// elements are the f32s at `flat`, starting at `start` of the pieces' one index.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Piece {
    tensor: DeviceTensor,
    flat: u64,
    start: u64,
    numel: u64,
}

// SAFETY: a plain `#[repr(C)]` value, laid out as the kernels' `struct Piece`.
unsafe impl DeviceRepr for Piece {}

/// `gradient` (of `numel` elements; `None`: none, zeros) as the kernels take it, its
/// contiguous form kept in `sources` until the caller's launch is queued (see
/// [`DeviceTensor::of`]).
fn device_gradient(
    name: &str,
    gradient: Option<&Tensor>,
    numel: usize,
    sources: &mut Vec<Tensor>,
) -> Result<DeviceTensor> {
    let Some(g) = gradient else {
        return Ok(DeviceTensor::default());
    };
    if g.elem_count() != numel {
        bail!(
            "{name}: a gradient of {} elements for {numel}",
            g.elem_count()
        )
    }
    let g = g.contiguous()?;
    let tensor = DeviceTensor::of(&g)?;
    sources.push(g);
    Ok(tensor)
}

/// Elements of the pieces' index a block copies (`PIECES_CHUNK` in `cuda_update.cu`).
const PIECES_CHUNK: usize = 8192;

/// `values` copied to the device (a small table a launch reads).
fn upload<T: DeviceRepr + 'static>(
    dev: &candle_core::CudaDevice,
    values: &[T],
) -> Result<CudaSlice<T>> {
    // SAFETY: every element is written by the copy (at least one, so the slice is a real one).
    let mut slice = unsafe { dev.alloc::<T>(values.len().max(1))? };
    if !values.is_empty() {
        dev.memcpy_htod(values, &mut slice)?;
    }
    Ok(slice)
}

/// The gradient bucket's gather on CUDA (`bucket::Gather`, whose CPU twin is a loop): each of
/// `pieces` (a gradient, or `None` for zeros; its offset in the bucket and size) times
/// `unscale` cast into (`accumulate`: added onto) its part of the f32 `bucket`, in one launch.
/// Copying, the pieces tile the bucket; adding, they are the gradients to add, in order.
pub(crate) fn gather(
    bucket: &mut CudaStorage,
    layout: &Layout,
    pieces: &[(Option<&Tensor>, usize, usize)],
    unscale: f32,
    accumulate: bool,
) -> Result<()> {
    let name = "the gradient bucket's gather";
    let Some((first, end)) = layout.contiguous_offsets() else {
        bail!("{name}: a contiguous bucket expected")
    };
    if bucket.dtype() != DType::F32 {
        bail!("{name}: an f32 bucket expected, got {:?}", bucket.dtype())
    }
    let dev = bucket.device.clone();
    let elements = end - first;
    let flat = {
        let stream = dev.cuda_stream();
        bucket.as_cuda_slice::<f32>()?.device_ptr(&stream).0 + 4 * first as u64
    };
    // Held until the launch is queued (see `DeviceTensor::of`).
    let mut sources = Vec::with_capacity(pieces.len());
    let mut table = Vec::with_capacity(pieces.len());
    let (mut start, mut next) = (0usize, 0usize);
    for &(gradient, offset, numel) in pieces {
        if offset < next || offset + numel > elements || (!accumulate && offset != next) {
            bail!("{name}: a piece of {numel} at {offset} after {next}, in a bucket of {elements}")
        }
        let tensor = device_gradient(name, gradient, numel, &mut sources)?;
        table.push(Piece {
            tensor,
            flat: flat + 4 * offset as u64,
            start: start as u64,
            numel: numel as u64,
        });
        start += numel;
        next = offset + numel;
    }
    if !accumulate && next != elements {
        bail!("{name}: pieces of {next} elements for a bucket of {elements}")
    }
    if table.is_empty() || start == 0 {
        return Ok(());
    }
    let table = upload(&dev, &table)?;
    let (count, total, accumulate) = (pieces.len() as i32, start as u64, accumulate as i32);
    let func = dev.get_or_load_custom_func("pieces_to_flat", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&table)
        .arg(&count)
        .arg(&total)
        .arg(&unscale)
        .arg(&accumulate);
    let cfg = LaunchConfig {
        grid_dim: (start.div_ceil(PIECES_CHUNK).min(1 << 16) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments `pieces_to_flat` declares, in order; the table's pieces lie
    // inside the bucket (checked above) and follow one another in the kernel's index, each
    // reading a live gradient (`sources`) of its size.
    unsafe { b.launch(cfg) }.w()?;
    drop(sources);
    Ok(())
}

/// Blocks of the squared norm's first launch (a fixed grid: the same sums run to run).
const SQUARES_BLOCKS: usize = 1024;

/// The launch of a squared norm's first kernel (`squares_partial`, `pieces_squares_partial`):
/// `SQUARES_BLOCKS` blocks, a partial each.
const SQUARES_LAUNCH: LaunchConfig = LaunchConfig {
    grid_dim: (SQUARES_BLOCKS as u32, 1, 1),
    block_dim: (THREADS, 1, 1),
    shared_mem_bytes: 0,
};

/// `Σ x²` of an f32 bucket in f64 (`[1]` on the device), in two launches: each block's share,
/// then their sum (`bucket::squared_norm`, whose CPU twin sums fixed blocks too).
pub(crate) fn squared_norm(bucket: &CudaStorage, layout: &Layout) -> Result<CudaStorage> {
    let name = "the gradient bucket's squared norm";
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{name}: a contiguous bucket expected")
    };
    if bucket.dtype() != DType::F32 {
        bail!("{name}: an f32 bucket expected, got {:?}", bucket.dtype())
    }
    let dev = &bucket.device;
    let flat = bucket.as_cuda_slice::<f32>()?.slice(start..end);
    let n = (end - start) as u64;
    // SAFETY: each written by its block of the launch below.
    let partials = unsafe { dev.alloc::<f64>(SQUARES_BLOCKS)? };
    {
        let func = dev.get_or_load_custom_func("squares_partial", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&flat).arg(&n).arg(&partials);
        // SAFETY: the arguments `squares_partial` declares, in order; `partials` holds a value
        // per block of the grid.
        unsafe { b.launch(SQUARES_LAUNCH) }.w()?;
    }
    sum_of_partials(dev, &partials)
}

/// `[Σ partials]` on the device (`sum_partials`, one block).
fn sum_of_partials(
    dev: &candle_core::cuda_backend::CudaDevice,
    partials: &CudaSlice<f64>,
) -> Result<CudaStorage> {
    // SAFETY: written by the launch.
    let mut out = unsafe { dev.alloc::<f64>(1)? };
    let count = partials.len() as i32;
    let func = dev.get_or_load_custom_func("sum_partials", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(partials).arg(&count).arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments `sum_partials` declares, in order: `count` partials in, one value
    // out.
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// `Σ (x · unscale)²` in f64 over the elements of `gradients` (each f32, bf16 or f16, as the
/// backward made them; `[1]` on `dev`): the squared norm of the bucket they would make
/// (`pieces_to_flat`'s values), without the bucket, in two launches (`pieces_squares_partial`
/// on a fixed grid, then `sum_partials`). `bucket::held_squared_norm`'s CUDA half.
pub(crate) fn held_squared_norm(
    dev: &candle_core::cuda_backend::CudaDevice,
    gradients: &[&Tensor],
    unscale: f32,
) -> Result<CudaStorage> {
    let name = "the held gradients' squared norm";
    // Held until the launch is queued (see `DeviceTensor::of`).
    let mut sources = Vec::with_capacity(gradients.len());
    let mut table = Vec::with_capacity(gradients.len());
    let mut start = 0u64;
    for &g in gradients {
        let numel = g.elem_count();
        table.push(Piece {
            tensor: device_gradient(name, Some(g), numel, &mut sources)?,
            flat: 0,
            start,
            numel: numel as u64,
        });
        start += numel as u64;
    }
    if start == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(
            dev.alloc_zeros::<f64>(1)?,
            dev.clone(),
        ));
    }
    // SAFETY: each written by its block of the launch below (a block that finds no elements
    // writes its zero).
    let partials = unsafe { dev.alloc::<f64>(SQUARES_BLOCKS)? };
    let table = upload(dev, &table)?;
    let count = gradients.len() as i32;
    {
        let func = dev.get_or_load_custom_func("pieces_squares_partial", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&table)
            .arg(&count)
            .arg(&start)
            .arg(&unscale)
            .arg(&partials);
        // SAFETY: the arguments `pieces_squares_partial` declares, in order; the pieces follow
        // one another in the kernel's index, each reading a live gradient (`sources`) of its
        // size; `partials` holds a value per block of the grid.
        unsafe { b.launch(SQUARES_LAUNCH) }.w()?;
    }
    let out = sum_of_partials(dev, &partials);
    drop(sources);
    out
}
