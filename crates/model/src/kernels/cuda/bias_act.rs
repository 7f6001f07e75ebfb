//! A linear layer's end on CUDA: the bias added and the activation (none, or GELU in either
//! form) in one pass after cuBLAS's product, the bias's gradient summed in the backward's same
//! pass; the twins of `cpu::Linear`'s bias and `cpu::LinearGelu`/`cpu::GeluOp`'s GELU.

use super::*;
use crate::config::Gelu;

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
        bail!("{op}: an input with a non-empty last dimension expected, got {:?}", y.dims())
    }
    if let Some(b) = bias
        && b.dims() != [cols]
    {
        bail!("{op}: a bias of [{cols}] expected, got {:?}", b.dims())
    }
    Ok((y.shape().elem_count() / cols, cols))
}

fn forward<T: Element>(
    dev: &CudaDevice,
    y: &CudaView<'_, T>,
    bias: Option<&CudaView<'_, T>>,
    (rows, cols): (usize, usize),
    act: i32,
) -> Result<CudaSlice<T>> {
    // SAFETY: every element is written by the kernel.
    let mut out = unsafe { dev.alloc::<T>(rows * cols)? };
    let (rows_i, cols_i) = (rows as i32, cols as i32);
    launch!(T, dev, "bias_act_forward", config(rows, 256, 0), |b| {
        b.arg(y);
        match bias {
            Some(bias) => b.arg(bias),
            None => b.arg(&NULL),
        };
        b.arg(&mut out).arg(&rows_i).arg(&cols_i).arg(&act);
    })?;
    Ok(out)
}

/// The backward, packed: `y`'s gradient (`rows · cols`, only with an activation), then the
/// bias's (`cols`, only with a bias).
fn backward<T: Element>(
    dev: &CudaDevice,
    y: &CudaView<'_, T>,
    bias: Option<&CudaView<'_, T>>,
    grad: &CudaView<'_, T>,
    (rows, cols): (usize, usize),
    act: i32,
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
    {
        let (mut grad_y, _) = out.split_at_mut(n);
        let shared = if bias.is_some() { cols } else { 0 };
        launch!(T, dev, "bias_act_backward", config(blocks, 256, shared), |b| {
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

/// `act(y + bias)`: `y` and `bias` in one dtype.
struct BiasActOp {
    act: Option<Gelu>,
}

impl CustomOp2 for BiasActOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-bias-activation"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_refused(self.name())
    }

    fn cuda_fwd(
        &self,
        y: &CudaStorage,
        yl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &BiasActOp,
            (y, yl): (&CudaStorage, &Layout),
            (b, bl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let dims = rows_cols(name, yl, Some(bl))?;
            let dev = &y.device;
            let out = forward::<T>(
                dev,
                &view(name, "input", y, yl)?,
                Some(&view(name, "bias", b, bl)?),
                dims,
                code(op.act),
            )?;
            Ok((wrap(out, dev), yl.shape().clone()))
        }
        by_dtype!(self.name(), y, run(self, (y, yl), (b, bl)))
    }

    fn bwd(
        &self,
        y: &Tensor,
        bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let packed = y.apply_op3_no_bwd(bias, &grad, &BiasActBackwardOp { act: self.act })?;
        let cols = bias.elem_count();
        let (grad_y, at) = match self.act {
            Some(_) => (
                packed.narrow(0, 0, y.elem_count())?.reshape(y.shape())?,
                y.elem_count(),
            ),
            // Without an activation `y`'s gradient is the output's.
            None => (grad, 0),
        };
        Ok((Some(grad_y), Some(packed.narrow(0, at, cols)?)))
    }
}

/// The backward of [`BiasActOp`] from `y`, the bias and the output's gradient.
struct BiasActBackwardOp {
    act: Option<Gelu>,
}

impl CustomOp3 for BiasActBackwardOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-bias-activation-backward"
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
        cpu_refused(self.name())
    }

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

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_refused(self.name())
    }

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
            )?;
            Ok((wrap(out, dev), yl.shape().clone()))
        }
        by_dtype!(self.name(), y, run(self, (y, yl)))
    }

    fn bwd(&self, y: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad_y = y.apply_op2_no_bwd(&grad.contiguous()?, &ActBackwardOp { act: self.act })?;
        Ok(Some(grad_y.reshape(y.shape())?))
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

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_refused(self.name())
    }

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
            )?;
            Ok((wrap(out, dev), yl.shape().clone()))
        }
        by_dtype!(self.name(), y, run(self, (y, yl), (g, gl)))
    }
}

/// `act(y + bias)` on CUDA in `y`'s dtype: a linear layer's end after its product (`act`
/// `None`: the bias alone).
pub(crate) fn bias_activation(y: &Tensor, bias: &Tensor, act: Option<Gelu>) -> Result<Tensor> {
    y.contiguous()?
        .apply_op2(&bias.to_dtype(y.dtype())?, BiasActOp { act })
}

/// GELU on CUDA in `y`'s dtype.
pub(crate) fn activation(y: &Tensor, act: Gelu) -> Result<Tensor> {
    y.contiguous()?.apply_op1(ActOp { act })
}
