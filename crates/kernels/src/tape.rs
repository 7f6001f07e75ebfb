//! A backward pass run by hand over the fused kernels, without candle's autograd.
//!
//! candle's autograd pays for every edge of its graph: a tensor of zeros the size of the
//! gradient, then an addition into it, even where the gradient is the only one the tensor
//! will get; and the whole graph stays alive until the backward pass ends. An encoder layer
//! of the fused kernels is a short chain of our own ops, each with its backward written out,
//! so its backward can be run by hand instead:
//!
//! - while [`record`] runs a forward pass, every fused op is applied outside candle's graph
//!   and written on a [`Tape`] with what its backward needs (its inputs, its output and the
//!   op itself, which may hold saved state such as a dropout mask); so are the few tensors
//!   the layer glues its parameters with (a concatenation, a stack, a cast, a copy);
//! - [`Tape::backward`] calls the ops' backward passes in reverse order, moves a tensor's first
//!   gradient into place and adds only where two meet (a residual's input), and drops each
//!   op's saved tensors as soon as its backward has run.
//!
//! What the tape cannot follow, it refuses, never silently: a kernel that falls back to
//! candle's composed ops while recording marks the recording refused (`unrecorded`; the
//! caller then runs the pass with candle's autograd), and a gradient that reaches a tensor the
//! tape neither produced nor was told about is an error.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{CustomOp1, CustomOp3, DType, Result, Tensor, TensorId};

/// How a recorded node's inputs get their gradients from its output's.
enum Grad {
    /// One of our one-input ops: its backward pass.
    Op1(Arc<dyn CustomOp1 + Send + Sync>),
    /// One of our three-input ops: its backward pass.
    Op3(Arc<dyn CustomOp3 + Send + Sync>),
    /// The output's rows (dimension 0) are the inputs', in order, each reshaped: a
    /// concatenation or a stack. Each input's gradient is its rows of the output's.
    Rows,
    /// A copy, maybe cast: the gradient cast back to the input's dtype.
    Copy,
}

/// One recorded application.
struct Node {
    inputs: Vec<Tensor>,
    output: Tensor,
    grad: Grad,
}

impl Node {
    /// The inputs' gradients from the output's `grad`, in the inputs' order.
    fn backward(&self, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let i = &self.inputs;
        Ok(match &self.grad {
            Grad::Op1(op) => vec![op.bwd(&i[0], &self.output, grad)?],
            Grad::Op3(op) => {
                let (a, b, c) = op.bwd(&i[0], &i[1], &i[2], &self.output, grad)?;
                vec![a, b, c]
            }
            Grad::Rows => {
                let mut offset = 0;
                let mut grads = Vec::with_capacity(i.len());
                for input in i {
                    let rows = rows_of(input, &self.output)?;
                    grads.push(Some(grad.narrow(0, offset, rows)?.reshape(input.shape())?));
                    offset += rows;
                }
                grads
            }
            Grad::Copy => vec![Some(grad.reshape(i[0].shape())?.to_dtype(i[0].dtype())?)],
        })
    }

    fn name(&self) -> &'static str {
        match &self.grad {
            Grad::Op1(op) => op.name(),
            Grad::Op3(op) => op.name(),
            Grad::Rows => "rows",
            Grad::Copy => "copy",
        }
    }
}

/// How many rows of `output`'s dimension 0 the input `part` fills: its own first dimension
/// when it has as many dimensions as `output` (a concatenation), one otherwise (a stack).
fn rows_of(part: &Tensor, output: &Tensor) -> Result<usize> {
    if part.rank() == output.rank() {
        part.dim(0)
    } else {
        Ok(1)
    }
}

/// The fused ops of a forward pass, recorded by [`record`], in the order they ran.
pub struct Tape {
    nodes: Vec<Node>,
}

impl std::fmt::Debug for Tape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.nodes.iter().map(Node::name).collect();
        f.debug_struct("Tape").field("nodes", &names).finish()
    }
}

/// The gradients a [`Tape::backward`] leaves: those of the tensors no recorded op produced
/// (the pass's inputs and parameters), by the tensor's id.
pub type LeafGradients = HashMap<TensorId, Tensor>;

impl Tape {
    /// Back-propagates `grad`, the gradient of `output` (what the recorded pass returned):
    /// each op's backward in reverse order, freeing the op's saved tensors after it. Returns
    /// the gradients of the tensors the recorded ops took but did not produce. A gradient that
    /// does not have its tensor's shape is an error naming the op.
    pub fn backward(self, output: &Tensor, grad: Tensor) -> Result<LeafGradients> {
        let mut grads: LeafGradients = HashMap::new();
        add_into(&mut grads, output, grad, "the output")?;
        let mut nodes = self.nodes;
        while let Some(node) = nodes.pop() {
            let Some(g) = grads.remove(&node.output.id()) else {
                continue;
            };
            let inputs = node.backward(&g)?;
            crate::device::trace_device_pool(g.device(), || {
                format!(
                    "the backward of {} (the tape's op {})",
                    node.name(),
                    nodes.len()
                )
            });
            for (input, g) in node.inputs.iter().zip(inputs) {
                if let Some(g) = g {
                    add_into(&mut grads, input, g, node.name())?;
                }
            }
        }
        Ok(grads)
    }
}

/// Adds `grad` to `tensor`'s gradient: moved in when it is the first.
fn add_into(grads: &mut LeafGradients, tensor: &Tensor, grad: Tensor, from: &str) -> Result<()> {
    if grad.dims() != tensor.dims() {
        candle_core::bail!(
            "tape: the gradient from {from} is {:?} for a tensor of {:?}",
            grad.dims(),
            tensor.dims()
        )
    }
    let sum = match grads.remove(&tensor.id()) {
        Some(sum) => super::add_gradients(&sum, &grad)?,
        None => grad,
    };
    grads.insert(tensor.id(), sum);
    Ok(())
}

/// What is being recorded on this thread.
struct Recording {
    nodes: Vec<Node>,
    /// Why the tape cannot follow the pass (the first kernel that fell back), if one did.
    refused: Option<String>,
}

thread_local! {
    /// The recording on this thread, while [`record`] runs. Per thread because the model runs
    /// its kernels on the calling thread.
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// Whether a recording is under way on this thread.
pub(crate) fn recording() -> bool {
    RECORDING.with(|r| r.borrow().is_some())
}

fn push(node: Node) {
    RECORDING.with(|r| {
        if let Some(r) = r.borrow_mut().as_mut() {
            crate::device::trace_device_pool(node.output.device(), || {
                format!(
                    "the forward of {} (the tape's op {})",
                    node.name(),
                    r.nodes.len()
                )
            });
            r.nodes.push(node);
        }
    });
}

/// Ends the recording when [`record`] returns or unwinds.
struct Stop;

impl Drop for Stop {
    fn drop(&mut self) {
        RECORDING.with(|r| r.borrow_mut().take());
    }
}

/// Runs `forward` with the fused ops written on a tape: its value, and the tape, or why the
/// tape cannot follow the pass (a kernel fell back to candle's ops: the value is right, but
/// only candle's autograd could take its gradient). The inputs and parameters `forward` uses
/// must not track gradients (detached), or candle would record its own graph beside the
/// tape. Recordings do not nest.
pub fn record<T>(
    forward: impl FnOnce() -> Result<T>,
) -> Result<(T, std::result::Result<Tape, String>)> {
    RECORDING.with(|r| {
        let mut r = r.borrow_mut();
        if r.is_some() {
            candle_core::bail!("tape: a recording is already under way on this thread")
        }
        *r = Some(Recording {
            nodes: Vec::new(),
            refused: None,
        });
        Ok(())
    })?;
    let stop = Stop;
    let value = forward()?;
    let recording = RECORDING.with(|r| r.borrow_mut().take());
    drop(stop);
    let recording = recording.expect("the recording ends here");
    let tape = match recording.refused {
        Some(why) => Err(why),
        None => Ok(Tape {
            nodes: recording.nodes,
        }),
    };
    Ok((value, tape))
}

/// Marks the recording (if one is under way) as one the tape cannot follow: `what` ran on
/// candle's ops. Kernels call it where they fall back.
pub(crate) fn unrecorded(what: &str) {
    RECORDING.with(|r| {
        if let Some(r) = r.borrow_mut().as_mut() {
            r.refused.get_or_insert_with(|| what.to_string());
        }
    });
}

/// `x.apply_op1(op)`, recorded while a recording is under way.
pub(crate) fn apply_op1<C: CustomOp1 + Send + Sync + 'static>(x: &Tensor, op: C) -> Result<Tensor> {
    if !recording() {
        return x.apply_op1(op);
    }
    let op = Arc::new(op);
    let output = x.apply_op1_no_bwd(op.as_ref())?;
    push(Node {
        inputs: vec![x.clone()],
        output: output.clone(),
        grad: Grad::Op1(op),
    });
    Ok(output)
}

/// `a.apply_op3(b, c, op)`, recorded while a recording is under way.
pub(crate) fn apply_op3<C: CustomOp3 + Send + Sync + 'static>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    op: C,
) -> Result<Tensor> {
    if !recording() {
        return a.apply_op3(b, c, op);
    }
    let op = Arc::new(op);
    let output = a.apply_op3_no_bwd(b, c, op.as_ref())?;
    push(Node {
        inputs: vec![a.clone(), b.clone(), c.clone()],
        output: output.clone(),
        grad: Grad::Op3(op),
    });
    Ok(output)
}

fn rows(parts: &[&Tensor], output: Tensor) -> Result<Tensor> {
    if recording() {
        push(Node {
            inputs: parts.iter().map(|&t| t.clone()).collect(),
            output: output.clone(),
            grad: Grad::Rows,
        });
    }
    Ok(output)
}

/// `Tensor::cat(parts, 0)` (by the device's own kernel where it has one,
/// [`super::joined_on_device`]), recorded while a recording is under way.
pub fn cat_rows(parts: &[&Tensor]) -> Result<Tensor> {
    rows(parts, joined(parts, false)?)
}

/// `Tensor::stack(parts, 0)` (as [`cat_rows`]), recorded while a recording is under way.
pub(crate) fn stack_rows(parts: &[&Tensor]) -> Result<Tensor> {
    rows(parts, joined(parts, true)?)
}

/// `parts` stacked (`stack`) or concatenated along dimension 0: by the device's own kernel
/// where it takes them, else by candle.
fn joined(parts: &[&Tensor], stack: bool) -> Result<Tensor> {
    if let Some(shape) = joined_shape(parts, stack)
        && let Some(joined) = super::joined_on_device(parts, &shape)?
    {
        return Ok(joined);
    }
    if stack {
        Tensor::stack(parts, 0)
    } else {
        Tensor::cat(parts, 0)
    }
}

/// The shape of `parts` stacked (`stack`) or concatenated along dimension 0, where candle
/// would join them (one dtype and device, the same shape or the same trailing dimensions);
/// `None` otherwise (candle's own join then says why).
fn joined_shape(parts: &[&Tensor], stack: bool) -> Option<Vec<usize>> {
    let first = parts.first()?;
    let alike = |t: &&Tensor| {
        t.dtype() == first.dtype()
            && t.device().same_device(first.device())
            && if stack {
                t.dims() == first.dims()
            } else {
                t.rank() == first.rank() && t.rank() > 0 && t.dims()[1..] == first.dims()[1..]
            }
    };
    if !parts.iter().all(alike) {
        return None;
    }
    let mut shape = first.dims().to_vec();
    if stack {
        shape.insert(0, parts.len());
    } else {
        shape[0] = parts.iter().map(|t| t.dims()[0]).sum();
    }
    Some(shape)
}

fn copied(x: &Tensor, output: Tensor) -> Result<Tensor> {
    if recording() && output.id() != x.id() {
        push(Node {
            inputs: vec![x.clone()],
            output: output.clone(),
            grad: Grad::Copy,
        });
    }
    Ok(output)
}

/// `x.to_dtype(dtype)`, recorded (when it makes a new tensor) while a recording is under way.
pub(crate) fn to_dtype(x: &Tensor, dtype: DType) -> Result<Tensor> {
    copied(x, x.to_dtype(dtype)?)
}

/// `x.contiguous()`, recorded (when it makes a new tensor) while a recording is under way.
pub(crate) fn contiguous(x: &Tensor) -> Result<Tensor> {
    copied(x, x.contiguous()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{CpuStorage, Device, Layout, Shape};

    /// `x · factor`, its backward `grad · factor`.
    struct Scale(f32);

    impl CustomOp1 for Scale {
        fn name(&self) -> &'static str {
            "scale"
        }

        fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            let (start, end) = l.contiguous_offsets().expect("contiguous");
            let x = &s.as_slice::<f32>()?[start..end];
            let y = x.iter().map(|v| v * self.0).collect();
            Ok((CpuStorage::F32(y), l.shape().clone()))
        }

        fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
            Ok(Some((grad * self.0 as f64)?))
        }
    }

    /// A tensor two recorded ops took gets the sum of their gradients, through their outputs
    /// joined.
    #[test]
    fn a_tensor_two_ops_took_gets_the_sum_of_their_gradients() {
        let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
        let (out, tape) = record(|| {
            let a = apply_op1(&x, Scale(2.0))?;
            let b = apply_op1(&x, Scale(3.0))?;
            cat_rows(&[&a, &b])
        })
        .unwrap();
        let upstream =
            Tensor::new(&[1f32, 10., 100., 1000., 10000., 100000.], &Device::Cpu).unwrap();
        let mut grads = tape.unwrap().backward(&out, upstream).unwrap();
        let got: Vec<f32> = grads.remove(&x.id()).unwrap().to_vec1().unwrap();
        assert_eq!(got, [2. + 3000., 20. + 30000., 200. + 300000.]);
    }
}
