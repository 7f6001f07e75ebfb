//! The optimiser update of one parameter group on CUDA (the `cuda` feature), the twin of
//! `cpu_update`: two launches over the group's `[rows, numel]` f32 state (`cuda_update.cu`)
//! where the composed update makes about fifteen element-wise passes, each a fresh tensor. The
//! new weights and moments come back as one `[3, rows, numel]` buffer whose rows the group
//! keeps as views. `bertkit check kernels --device cuda` compares it with the CPU's update
//! ([`crate::check::check_update`]); on by default since that passed on an H200
//! (`BERTKIT_CUDA_OPTIMIZER=composed` turns it off).

use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, InplaceOp2, Layout, Result, Shape, Storage, Tensor,
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

// SAFETY: a plain `#[repr(C)]` value, laid out as the kernels' `struct Constants`.
unsafe impl DeviceRepr for Constants {}

/// The update of one group from its master weights, moments and gradients (each
/// `[rows, numel]` f32 on the device): `[3, rows, numel]` holding the new weights, first and
/// second moments.
pub(crate) fn update(
    master: &Tensor,
    m: &Tensor,
    v: &Tensor,
    gradients: &Tensor,
    s: Scalars,
) -> Result<Tensor> {
    let op = Update {
        gradients: gradients.contiguous()?,
        constants: Constants::of(s),
        lr: s.lr as f32,
    };
    master
        .contiguous()?
        .apply_op3_no_bwd(&m.contiguous()?, &v.contiguous()?, &op)
}

/// The update of a group whose weights and moments are one `[3, rows, numel]` f32 `state`
/// (weights, first and second moments), written in place: no state allocated per group per
/// step. Two launches, as [`update`]'s; the second recomputes each element's update from the
/// new moments instead of reading it from a buffer.
pub(crate) fn update_in_place(state: &Tensor, gradients: &Tensor, s: Scalars) -> Result<()> {
    let op = UpdateInPlace {
        constants: Constants::of(s),
        lr: s.lr as f32,
    };
    state.inplace_op2(&gradients.contiguous()?, &op)
}

struct UpdateInPlace {
    constants: Constants,
    lr: f32,
}

impl InplaceOp2 for UpdateInPlace {
    fn name(&self) -> &'static str {
        "bertkit-cuda-optimizer-update-in-place"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("{}: a CUDA kernel, given CPU tensors", self.name())
    }

    fn cuda_fwd(
        &self,
        state: &mut CudaStorage,
        sl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let name = self.name();
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
        let g_view = view(name, g, gl, (rows, numel), "gradients")?;
        let dev = state.device.clone();
        let Grid { cfg, norms, blocks } = grid(&dev, rows, numel)?;
        let (rows_i, numel_i, blocks_i) = (rows as i32, numel as i32, blocks as i32);
        let mut state = state.as_cuda_slice_mut::<f32>()?.slice_mut(start..end);
        {
            let func = dev.get_or_load_custom_func("update_moments_in_place", MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&mut state).arg(&g_view).arg(&norms);
            b.arg(&rows_i).arg(&numel_i).arg(&self.constants);
            unsafe { b.launch(cfg) }.w()?;
        }
        {
            let func = dev.get_or_load_custom_func("update_weights_in_place", MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&mut state).arg(&norms).arg(&rows_i).arg(&numel_i);
            b.arg(&blocks_i).arg(&self.lr).arg(&self.constants);
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    }
}

struct Update {
    gradients: Tensor,
    constants: Constants,
    lr: f32,
}

impl CustomOp3 for Update {
    fn name(&self) -> &'static str {
        "bertkit-cuda-optimizer-update"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("{}: a CUDA kernel, given CPU tensors", self.name())
    }

    fn cuda_fwd(
        &self,
        w: &CudaStorage,
        wl: &Layout,
        m: &CudaStorage,
        ml: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let (rows, numel) = wl.shape().dims2()?;
        let (gs, gl) = self.gradients.storage_and_layout();
        let Storage::Cuda(g) = &*gs else {
            bail!("{name}: gradients on the CUDA device expected")
        };
        let shape = (rows, numel);
        let w_view = view(name, w, wl, shape, "weights")?;
        let m_view = view(name, m, ml, shape, "first moments")?;
        let v_view = view(name, v, vl, shape, "second moments")?;
        let g_view = view(name, g, gl, shape, "gradients")?;
        let dev = &w.device;
        // SAFETY: every element is written by the two launches.
        let mut state = unsafe { dev.alloc::<f32>(3 * rows * numel)? };
        let Grid { cfg, norms, blocks } = grid(dev, rows, numel)?;
        let (rows_i, numel_i, blocks_i) = (rows as i32, numel as i32, blocks as i32);
        let trust = self.constants.trust_ratio;
        {
            let func = dev.get_or_load_custom_func("update_moments", MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&w_view).arg(&m_view).arg(&v_view).arg(&g_view);
            b.arg(&mut state).arg(&norms).arg(&rows_i).arg(&numel_i);
            b.arg(&self.constants);
            // SAFETY: the arguments `update_moments` declares, in order; `state` holds
            // `3 · rows · numel` and `norms` `rows · blocks · 2` values, what the grid covers.
            unsafe { b.launch(cfg) }.w()?;
        }
        {
            let func = dev.get_or_load_custom_func("update_weights", MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&w_view)
                .arg(&mut state)
                .arg(&norms)
                .arg(&rows_i)
                .arg(&numel_i);
            b.arg(&blocks_i).arg(&self.lr).arg(&trust);
            // SAFETY: as above, for `update_weights`.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(state, dev.clone()),
            Shape::from((3, rows, numel)),
        ))
    }
}

/// Both forms' launch shape: a block per `CHUNK` elements of a row (rows along y, strided
/// past 65,535), and each block's partial norms, zeroed.
struct Grid {
    cfg: LaunchConfig,
    norms: candle_core::cuda_backend::cudarc::driver::CudaSlice<f64>,
    blocks: usize,
}

fn grid(dev: &candle_core::cuda_backend::CudaDevice, rows: usize, numel: usize) -> Result<Grid> {
    let blocks = numel.div_ceil(CHUNK).max(1);
    Ok(Grid {
        cfg: LaunchConfig {
            grid_dim: (blocks as u32, rows.clamp(1, 65_535) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
        norms: dev.alloc_zeros::<f64>(rows * blocks * 2)?,
        blocks,
    })
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
