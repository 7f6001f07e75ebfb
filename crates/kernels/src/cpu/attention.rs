//! Attention per sequence and head of a packed batch, and its softmax rows.

use super::linear::{Shared, View, product_into};
use super::*;
use crate::dropout::apply_keep_in_place;
use crate::host::{contiguous, cpu_slice};
use crate::vectorised;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// Attention's softmax rows.

vectorised! {
    /// One row of the softmax of scaled scores, `softmax(row · scale)`, in place.
    fn softmax_row(row: &mut [f32], scale: f32) = softmax_row_portable
}

#[inline(always)]
fn softmax_row_portable(row: &mut [f32], scale: f32) {
    let n = row.len();
    let max = lane_max(row);
    for x in row.iter_mut() {
        *x = exp((*x - max) * scale);
    }
    let inv = 1.0 / lane_sum(n, |i| row[i]);
    for x in row.iter_mut() {
        *x *= inv;
    }
}

vectorised! {
    /// One row of the softmax's backward: the probabilities' gradient `g` becomes the scaled
    /// scores' gradient, in place.
    fn softmax_backward_row(p: &[f32], g: &mut [f32], scale: f32) = softmax_backward_row_portable
}

#[inline(always)]
fn softmax_backward_row_portable(p: &[f32], g: &mut [f32], scale: f32) {
    let n = g.len();
    let p = &p[..n];
    let dot = lane_sum(n, |i| p[i] * g[i]);
    for (g, &p) in g.iter_mut().zip(p) {
        *g = scale * p * (*g - dot);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention.

/// Scaled dot-product attention within each sequence of a packed batch, from the query, key
/// and value projections side by side: the input is `[tokens, 3 · hidden]` (queries, keys,
/// values, each `hidden` wide with the heads side by side, as one linear layer writes them),
/// sequence `b` being tokens `starts[b]..starts[b + 1]`; the output is `[tokens, hidden]`,
/// `dropout(softmax(q·kᵀ · scale)) · v` per sequence and head. One (sequence, head) per
/// parallel task, reading its queries, keys and values in place by strides and writing its
/// columns of the output (no head split or merge copies), with single-threaded matrix
/// products; no `[batch, heads, q, k]` tensor exists: each task's probabilities live in its
/// scratch, and the backward recomputes them, keeping only the dropout mask (a byte per
/// probability).
pub(crate) struct Attention {
    pub(crate) heads: usize,
    pub(crate) scale: f32,
    /// Where each sequence's tokens start, and the end of the last.
    pub(crate) starts: Arc<Vec<usize>>,
    /// The dropout mask (1: kept) in `len × len` blocks per sequence and head in order, and the
    /// scale of kept probabilities.
    pub(crate) keep: Option<(Arc<Vec<u8>>, f32)>,
}

/// The attention's dimensions.
#[derive(Clone, Copy)]
struct AttentionShape {
    hidden: usize,
    head: usize,
}

/// One (sequence, head) of the attention.
struct HeadTask {
    /// The sequence's first token and its length.
    start: usize,
    len: usize,
    head: usize,
    /// Where its block of the dropout mask starts.
    keep_at: usize,
}

/// The queries, keys and values: which third of the input's columns.
#[derive(Clone, Copy)]
enum Part {
    Queries = 0,
    Keys = 1,
    Values = 2,
}

impl AttentionShape {
    /// The task's queries, keys or values (or their gradients) in a `[tokens, 3 · hidden]`
    /// buffer.
    fn input(self, t: &HeadTask, part: Part) -> View {
        View {
            offset: t.start * 3 * self.hidden + part as usize * self.hidden + t.head * self.head,
            row: 3 * self.hidden,
            col: 1,
        }
    }

    /// The task's output (or its gradient) in a `[tokens, hidden]` buffer.
    fn output(self, t: &HeadTask) -> View {
        View {
            offset: t.start * self.hidden + t.head * self.head,
            row: self.hidden,
            col: 1,
        }
    }
}

impl Attention {
    fn shape(&self, qkv: &Layout) -> Result<AttentionShape> {
        let [tokens, width] = *qkv.dims() else {
            bail!(
                "attention: [tokens, 3 x hidden] projections expected, got {:?}",
                qkv.dims()
            )
        };
        let hidden = width / 3;
        if self.heads == 0 || width % 3 != 0 || hidden % self.heads != 0 {
            bail!(
                "attention: {width} columns do not split into queries, keys and values of {} heads",
                self.heads
            )
        }
        if self.starts.last() != Some(&tokens) || self.starts.windows(2).any(|w| w[0] > w[1]) {
            bail!(
                "attention: sequence starts {:?} for {tokens} tokens",
                self.starts
            )
        }
        if let Some((keep, _)) = &self.keep {
            let probabilities = crate::packing::attention_probabilities(&self.starts, self.heads);
            if keep.len() != probabilities {
                bail!(
                    "attention: a dropout mask of {} values for {probabilities} probabilities",
                    keep.len()
                )
            }
        }
        Ok(AttentionShape {
            hidden,
            head: hidden / self.heads,
        })
    }

    /// Every (sequence, head), longest sequences first (the longest tasks start first, so
    /// rayon's stealing evens out the ends).
    fn tasks(&self) -> Vec<HeadTask> {
        let mut tasks = Vec::with_capacity((self.starts.len() - 1) * self.heads);
        let mut keep_at = 0;
        for w in self.starts.windows(2) {
            let (start, len) = (w[0], w[1] - w[0]);
            for head in 0..self.heads {
                tasks.push(HeadTask {
                    start,
                    len,
                    head,
                    keep_at,
                });
                keep_at += len * len;
            }
        }
        tasks.sort_by_key(|t| std::cmp::Reverse(t.len));
        tasks
    }

    /// The task's probabilities into `probs` (`len × len`, resized), before dropout.
    fn probabilities(&self, s: AttentionShape, t: &HeadTask, qkv: &[f32], probs: &mut Vec<f32>) {
        probs.resize(t.len * t.len, 0.0);
        let out = (probs.as_mut_ptr(), probs.len(), View::rows(t.len));
        // SAFETY: `probs` is this task's own scratch.
        unsafe {
            product_into(
                (t.len, t.len, s.head),
                (qkv, s.input(t, Part::Queries)),
                (qkv, s.input(t, Part::Keys).t()),
                out,
                false,
                gemm::Parallelism::None,
            )
        }
        for row in probs.chunks_mut(t.len.max(1)) {
            softmax_row(row, self.scale);
        }
    }

    /// The task's dropout mask and scale, if any.
    fn keep(&self, t: &HeadTask) -> Option<(&[u8], f32)> {
        self.keep
            .as_ref()
            .map(|(keep, scale)| (&keep[t.keep_at..t.keep_at + t.len * t.len], *scale))
    }

    /// The output, `[tokens, hidden]`.
    fn forward(&self, s: AttentionShape, qkv: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; qkv.len() / 3];
        let shared = Shared::new(&mut out);
        self.tasks().par_iter().for_each_init(Vec::new, |probs, t| {
            self.probabilities(s, t, qkv, probs);
            if let Some((keep, scale)) = self.keep(t) {
                apply_keep_in_place(probs, keep, scale);
            }
            // SAFETY: each task writes only its own sequence's rows and head's columns.
            unsafe {
                product_into(
                    (t.len, s.head, t.len),
                    (probs, View::rows(t.len)),
                    (qkv, s.input(t, Part::Values)),
                    shared.at(s.output(t)),
                    false,
                    gemm::Parallelism::None,
                )
            }
        });
        out
    }

    /// The gradient of the projections (`[tokens, 3 · hidden]`) from the output's gradient
    /// `g`, task by task: with `P` the probabilities, `D` the dropout mask and `P' = P∘D`:
    /// `dv = P'ᵀ·g`, `dP = (g·vᵀ)∘D`, `dS = scale · P∘(dP - rowsum(dP∘P))`, `dq = dS·k`,
    /// `dk = dSᵀ·q`.
    fn backward(&self, s: AttentionShape, qkv: &[f32], g: &[f32]) -> Vec<f32> {
        let mut grad = vec![0f32; qkv.len()];
        let out = Shared::new(&mut grad);
        let single = gemm::Parallelism::None;
        self.tasks().par_iter().for_each_init(
            || (Vec::new(), Vec::new()),
            |(probs, scratch): &mut (Vec<f32>, Vec<f32>), t| {
                let len = t.len;
                let square = View::rows(len);
                let (q, k, v) = (
                    s.input(t, Part::Queries),
                    s.input(t, Part::Keys),
                    s.input(t, Part::Values),
                );
                self.probabilities(s, t, qkv, probs);
                scratch.resize(len * len, 0.0);
                let keep = self.keep(t);
                let dropped: &[f32] = match keep {
                    Some((keep, scale)) => {
                        scratch.copy_from_slice(probs);
                        apply_keep_in_place(scratch, keep, scale);
                        scratch
                    }
                    None => probs,
                };
                // SAFETY (each `product_into` below): a task writes only its own sequence's
                // rows and head's columns of the gradient, or its own scratch.
                unsafe {
                    product_into(
                        (len, s.head, len),
                        (dropped, square.t()),
                        (g, s.output(t)),
                        out.at(v),
                        false,
                        single,
                    );
                    product_into(
                        (len, len, s.head),
                        (g, s.output(t)),
                        (qkv, v.t()),
                        (scratch.as_mut_ptr(), scratch.len(), square),
                        false,
                        single,
                    );
                }
                if let Some((keep, scale)) = keep {
                    apply_keep_in_place(scratch, keep, scale);
                }
                for (p, g) in probs.chunks(len).zip(scratch.chunks_mut(len)) {
                    softmax_backward_row(p, g, self.scale);
                }
                unsafe {
                    product_into(
                        (len, s.head, len),
                        (scratch, square),
                        (qkv, k),
                        out.at(q),
                        false,
                        single,
                    );
                    product_into(
                        (len, s.head, len),
                        (scratch, square.t()),
                        (qkv, q),
                        out.at(k),
                        false,
                        single,
                    );
                }
            },
        );
        grad
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "bertkit-attention"
    }

    fn cpu_fwd(&self, qkv: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let s = self.shape(layout)?;
        let out = self.forward(s, contiguous(self.name(), "projections", qkv, layout)?);
        let tokens = layout.dims()[0];
        Ok((CpuStorage::F32(out), Shape::from((tokens, s.hidden))))
    }

    fn bwd(&self, qkv: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        crate::profiled_backward("attention", grad.device(), || {
            let op = "bertkit-attention-backward";
            let grad = grad.contiguous()?;
            let dqkv = {
                let (storage, layout) = qkv.storage_and_layout();
                let (g_storage, g_layout) = grad.storage_and_layout();
                let s = self.shape(layout)?;
                if g_layout.dims() != [layout.dims()[0], s.hidden] {
                    bail!("{op}: a gradient of shape {:?}", g_layout.dims())
                }
                self.backward(
                    s,
                    cpu_slice(op, "projections", &storage, layout)?,
                    cpu_slice(op, "gradient", &g_storage, g_layout)?,
                )
            };
            Ok(Some(Tensor::from_vec(dqkv, qkv.shape(), qkv.device())?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{D, DType, Device, Tensor};

    #[test]
    fn the_softmax_row_equals_the_f64_softmax() {
        let cpu = &Device::Cpu;
        // Rows of 37 (not a multiple of the vector lanes), one far from zero.
        let scores = (Tensor::randn(0f32, 3.0, (5, 37), cpu).unwrap() + 40.0).unwrap();
        let scale = 0.176_776_69_f32;
        let mut fused: Vec<f32> = scores.flatten_all().unwrap().to_vec1().unwrap();
        for row in fused.chunks_mut(37) {
            softmax_row(row, scale);
        }
        let x = (scores.to_dtype(DType::F64).unwrap() * scale as f64).unwrap();
        let max = x.max_keepdim(D::Minus1).unwrap();
        let e = x.broadcast_sub(&max).unwrap().exp().unwrap();
        let reference: Vec<f64> = e
            .broadcast_div(&e.sum_keepdim(D::Minus1).unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let diff = fused
            .iter()
            .zip(&reference)
            .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b).abs()));
        assert!(diff < 1e-6, "{diff:e}");
    }

    #[test]
    fn attention_rejects_sequences_that_do_not_cover_the_tokens() {
        let qkv = Tensor::zeros((5, 24), DType::F32, &Device::Cpu).unwrap();
        let op = |starts: Vec<usize>, heads| Attention {
            heads,
            scale: 0.5,
            starts: Arc::new(starts),
            keep: None,
        };
        let out = qkv.apply_op1_no_bwd(&op(vec![0, 2, 5], 2)).unwrap();
        assert_eq!(out.dims(), [5, 8]);
        for (starts, heads) in [(vec![0, 2, 4], 2), (vec![0, 3, 2, 5], 2), (vec![0, 5], 3)] {
            let err = qkv.apply_op1_no_bwd(&op(starts, heads)).unwrap_err();
            assert!(err.to_string().contains("attention:"), "{err}");
        }
        let wrong = Tensor::zeros((5, 25), DType::F32, &Device::Cpu).unwrap();
        assert!(wrong.apply_op1_no_bwd(&op(vec![0, 5], 1)).is_err());
    }
}
