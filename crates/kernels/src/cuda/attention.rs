//! Attention within the sequences of a packed batch on CUDA, the twin of `cpu::Attention`.
//!
//! Forward: the tokens' queries, keys and values to padded heads in one launch, `q·kᵀ` in
//! cuBLAS, one launch for the scale, the padding, the softmax and the dropout (its mask
//! recomputed from its keys, as the CPU draws it), `·v` in cuBLAS, and one launch back to the
//! tokens. Only `qkv` is kept for the backward, which recomputes the scores and probabilities
//! (one product more) rather than holding a `[batch, heads, seq, seq]` tensor per layer until
//! the backward; the products of the backward are cuBLAS's and one launch each does the
//! softmax's backward and the way back to the tokens' `[tokens, 3 · hidden]` gradient.

use super::*;

/// The shapes every attention kernel takes.
#[derive(Debug, Clone)]
pub(super) struct Heads {
    pub(super) places: Places,
    pub(super) heads: usize,
    pub(super) head: usize,
    pub(super) scale: f32,
    pub(super) dropout: DeviceDropout,
}

impl Heads {
    pub(super) fn hidden(&self) -> usize {
        self.heads * self.head
    }
}

/// Tokens `[tokens, parts · hidden]` to padded heads `[parts, batch, heads, seq, head]`.
struct TokensToHeads<'a> {
    heads: &'a Heads,
    parts: usize,
}

impl CustomOp1 for TokensToHeads<'_> {
    fn name(&self) -> &'static str {
        "bertkit-cuda-tokens-to-heads"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &TokensToHeads,
            (s, l): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let h = op.heads;
            let p = &h.places;
            if l.dims() != [p.tokens, op.parts * h.hidden()] {
                bail!(
                    "{name}: [{}, {}] expected, got {:?}",
                    p.tokens,
                    op.parts * h.hidden(),
                    l.dims()
                )
            }
            let dev = &s.device;
            let src = view::<T>(name, "tokens", s, l)?;
            let n = op.parts * p.batch * h.heads * p.seq * h.head;
            // SAFETY: every element is written (padding with zeros).
            let mut dst = unsafe { dev.alloc::<T>(n)? };
            let args = [p.tokens, p.batch, p.seq, h.heads, h.head, op.parts].map(|v| v as i32);
            with_view::<u32, _>(name, "padded places", &p.scatter, |scatter| {
                let cfg = config(p.batch * p.seq, 256, 0);
                launch!(T, dev, "tokens_to_heads", cfg, |b| {
                    b.arg(&src).arg(&mut dst).arg(&scatter);
                    for a in &args {
                        b.arg(a);
                    }
                })
            })?;
            let shape = Shape::from((op.parts, p.batch, h.heads, p.seq, h.head));
            Ok((wrap(dst, dev), shape))
        }
        by_dtype!(self.name(), s, run(self, (s, l)))
    }
}

/// Padded heads (each of `parts` tensors `[batch, heads, seq, head]`) to tokens
/// `[tokens, parts · hidden]`.
fn heads_to_tokens<T: Element>(
    name: &str,
    h: &Heads,
    sources: &[(&CudaStorage, &Layout)],
) -> Result<(CudaStorage, Shape)> {
    let p = &h.places;
    let want = [p.batch, h.heads, p.seq, h.head];
    let mut views = Vec::with_capacity(3);
    for (s, l) in sources {
        if l.dims() != want {
            bail!("{name}: heads {want:?} expected, got {:?}", l.dims())
        }
        views.push(view::<T>(name, "heads", s, l)?);
    }
    let parts = views.len();
    let dev = &sources[0].0.device;
    // SAFETY: every element is written by the kernel.
    let mut dst = unsafe { dev.alloc::<T>(p.tokens * parts * h.hidden())? };
    let args = [p.tokens, p.seq, h.heads, h.head, parts].map(|v| v as i32);
    with_view::<u32, _>(name, "token places", &p.gather, |gather| {
        launch!(T, dev, "heads_to_tokens", config(p.tokens, 256, 0), |b| {
            for i in 0..3 {
                b.arg(&views[i.min(parts - 1)]);
            }
            b.arg(&mut dst).arg(&gather);
            for a in &args {
                b.arg(a);
            }
        })
    })?;
    Ok((wrap(dst, dev), Shape::from((p.tokens, parts * h.hidden()))))
}

/// The context `[batch, heads, seq, head]` (handed over once) to tokens `[tokens, hidden]`: the
/// attention's last op, whose backward is the whole attention's, to `qkv`.
struct AttentionOutput {
    heads: Heads,
    context: Handoff,
}

impl CustomOp1 for AttentionOutput {
    fn name(&self) -> &'static str {
        "bertkit-cuda-attention"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, qkv: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let context = self.context.take(name)?;
        let (storage, layout) = context.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            bail!("{name}: the context on the CUDA device expected")
        };
        by_dtype!(
            name,
            qkv,
            heads_to_tokens(name, &self.heads, &[(s, layout)])
        )
    }

    fn bwd(&self, qkv: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        crate::profiled_backward("attention", grad.device(), || {
            let h = &self.heads;
            let Probabilities {
                q,
                k,
                v,
                scores,
                probs,
            } = probabilities(h, &qkv.detach())?;
            let grad_context = grad
                .contiguous()?
                .apply_op1_no_bwd(&TokensToHeads { heads: h, parts: 1 })?
                .squeeze(0)?;
            let grad_probs = grad_context.matmul(&v.t()?)?;
            let grad_v = probs.t()?.matmul(&grad_context)?;
            drop(probs);
            let grad_scores =
                scores.apply_op2_no_bwd(&grad_probs, &SoftmaxBackward { heads: h })?;
            drop(grad_probs);
            let grad_q = grad_scores.matmul(&k)?;
            let grad_k = grad_scores.t()?.matmul(&q)?;
            let grad_qkv = grad_q.apply_op3_no_bwd(&grad_k, &grad_v, &GradToTokens { heads: h })?;
            Ok(Some(grad_qkv))
        })
    }
}

/// The gradients of the queries, keys and values to the tokens' `[tokens, 3 · hidden]`.
struct GradToTokens<'a> {
    heads: &'a Heads,
}

impl CustomOp3 for GradToTokens<'_> {
    fn name(&self) -> &'static str {
        "bertkit-cuda-heads-to-tokens"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let sources = [(q, ql), (k, kl), (v, vl)];
        by_dtype!(
            self.name(),
            q,
            heads_to_tokens(self.name(), self.heads, &sources)
        )
    }
}

/// The softmax of the scaled scores over each query's keys with the dropout: `[batch, heads,
/// seq, seq]`.
struct SoftmaxForward<'a> {
    heads: &'a Heads,
}

/// Checks scores `[batch, heads, seq, seq]` and returns the kernels' shape arguments.
fn score_args(name: &str, h: &Heads, l: &Layout) -> Result<[i32; 4]> {
    let p = &h.places;
    let want = [p.batch, h.heads, p.seq, p.seq];
    if l.dims() != want {
        bail!("{name}: scores {want:?} expected, got {:?}", l.dims())
    }
    Ok([p.tokens, p.batch, h.heads, p.seq].map(|v| v as i32))
}

impl CustomOp1 for SoftmaxForward<'_> {
    fn name(&self) -> &'static str {
        "bertkit-cuda-attention-softmax"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &SoftmaxForward,
            (s, l): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let h = op.heads;
            let args = score_args(name, h, l)?;
            let dev = &s.device;
            let scores = view::<T>(name, "scores", s, l)?;
            // SAFETY: every element is written by the kernel.
            let mut probs = unsafe { dev.alloc::<T>(l.shape().elem_count())? };
            let queries = l.shape().elem_count() / h.places.seq.max(1);
            with_view::<u32, _>(name, "padded places", &h.places.scatter, |scatter| {
                launch!(
                    T,
                    dev,
                    "attention_softmax_forward",
                    config(queries.div_ceil(8), 256, 0),
                    |b| {
                        b.arg(&scores).arg(&mut probs).arg(&scatter);
                        for a in &args {
                            b.arg(a);
                        }
                        b.arg(&h.scale).arg(&h.dropout);
                    },
                )
            })?;
            Ok((wrap(probs, dev), l.shape().clone()))
        }
        by_dtype!(self.name(), s, run(self, (s, l)))
    }
}

/// The softmax's backward from the scores and the dropped probabilities' gradient.
struct SoftmaxBackward<'a> {
    heads: &'a Heads,
}

impl CustomOp2 for SoftmaxBackward<'_> {
    fn name(&self) -> &'static str {
        "bertkit-cuda-attention-softmax-backward"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        sl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &SoftmaxBackward,
            (s, sl): (&CudaStorage, &Layout),
            (g, gl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let h = op.heads;
            let args = score_args(name, h, sl)?;
            crate::host::same_shape(name, sl, gl)?;
            let dev = &s.device;
            let scores = view::<T>(name, "scores", s, sl)?;
            let grad = view::<T>(name, "gradient", g, gl)?;
            // SAFETY: every element is written by the kernel.
            let mut out = unsafe { dev.alloc::<T>(sl.shape().elem_count())? };
            let queries = sl.shape().elem_count() / h.places.seq.max(1);
            with_view::<u32, _>(name, "padded places", &h.places.scatter, |scatter| {
                launch!(
                    T,
                    dev,
                    "attention_softmax_backward",
                    config(queries.div_ceil(8), 256, 0),
                    |b| {
                        b.arg(&scores).arg(&grad).arg(&mut out).arg(&scatter);
                        for a in &args {
                            b.arg(a);
                        }
                        b.arg(&h.scale).arg(&h.dropout);
                    },
                )
            })?;
            Ok((wrap(out, dev), sl.shape().clone()))
        }
        by_dtype!(self.name(), s, run(self, (s, sl), (g, gl)))
    }
}

/// What the forward computes from `qkv` and the backward computes again: the queries, keys and
/// values as padded heads `[batch, heads, seq, head]` (views of one tensor), the scores `q·kᵀ`
/// and the dropped probabilities (the same masks both times, from the op's keys).
struct Probabilities {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scores: Tensor,
    probs: Tensor,
}

fn probabilities(h: &Heads, qkv: &Tensor) -> Result<Probabilities> {
    let padded = qkv
        .contiguous()?
        .apply_op1_no_bwd(&TokensToHeads { heads: h, parts: 3 })?;
    let (q, k, v) = (padded.get(0)?, padded.get(1)?, padded.get(2)?);
    let scores = q.matmul(&k.t()?)?;
    let probs = scores.apply_op1_no_bwd(&SoftmaxForward { heads: h })?;
    Ok(Probabilities {
        q,
        k,
        v,
        scores,
        probs,
    })
}

/// [`crate::Kernels::attention`] on CUDA (f32, bf16 or f16, sequences up to
/// [`MAX_SEQ`]); in one pass over key tiles ([`super::flash`]) where `one_pass` and the kernels
/// take the shapes.
pub(crate) fn attention(
    qkv: &Tensor,
    packing: &Packing,
    heads: usize,
    dropout: DeviceDropout,
    one_pass: bool,
) -> Result<Tensor> {
    let hidden = qkv.dim(1)? / 3;
    let head = hidden / heads.max(1);
    let h = Heads {
        places: Places::of(packing),
        heads,
        head,
        scale: (1.0 / (head as f64).sqrt()) as f32,
        dropout,
    };
    if one_pass && super::flash::takes(qkv, &h) {
        return super::flash::attention(qkv, h);
    }
    let context = {
        let Probabilities { v, probs, .. } = probabilities(&h, &qkv.detach())?;
        probs.matmul(&v)?
    };
    let op = AttentionOutput {
        heads: h,
        context: Handoff::new(context),
    };
    tape::apply_op1(&tape::contiguous(qkv)?, op)
}
