//! Linear layers on CUDA: cuBLAS's product, then the bias and the activation (none, or GELU
//! in either form) in one pass; in the backward the activation's slope and the bias's
//! gradient in one pass, then two products. The twins of `cpu::Linear`, `cpu::LinearGelu` and
//! `cpu::GeluOp`.

use candle_core::cuda_backend::cudarc::cublaslt::{CudaBlasLT, Matmul};

use super::bias_act::{backward, code, forward, rows_cols, vector_end};
use super::lt::{LtGradient, bias_gradient_start, lt_backward_takes, lt_linear};
use super::*;
use crate::Gelu;
use crate::GradientSink;

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
    /// The [`crate::Kernels`] method that made it, its backward counted there.
    caller: crate::Caller,
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
        crate::profiled_backward(
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
        crate::profiled_backward("gelu", grad.device(), || {
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

/// [`crate::Kernels::linear`] (`act` `None`) and
/// [`crate::Kernels::linear_gelu`] on CUDA, in `x`'s dtype: `x` `[..., in]`, `weight`
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
/// ([`crate::Kernels::linear_into`]). A weight in another dtype than `x` (the f32
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
/// [`crate::Kernels::feed_forward`]). The twin of `cpu::GeluLinear`.
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
            caller: crate::Caller::now(),
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
        caller: crate::Caller::now(),
    };
    tape::apply_op3(&x, weight, &bias, op)
}

/// GELU on CUDA in `y`'s dtype.
pub(crate) fn activation(y: &Tensor, act: Gelu) -> Result<Tensor> {
    tape::apply_op1(&tape::contiguous(y)?, ActOp { act })
}
