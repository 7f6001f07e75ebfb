//! Dropout on CUDA with the CPU's keyed masks (`keyed_dropout` in `kernels.cu`): the
//! embeddings' dropout of a packed `[tokens, width]` tensor ([`crate::Mode::dropout_tokens`])
//! and the pooler's of a `[rows, width]` one ([`crate::Mode::dropout`]). Where the
//! fused kernels drop within their own passes, these two went through candle: a cuRAND
//! uniform per element, a comparison, two casts and a product, each a launch and a tensor, and
//! a mask other than the CPU's for the same keys. The twin is `DropoutSource::apply_to_tokens`
//! and `DropoutSource::apply` on the CPU: the same elements kept, each scaled in f32.

use super::*;

/// `x` times its mask (`x` contiguous, `[rows, width]`): the keys of one mask number, and
/// for a packed tensor its tokens' places (`seq`: the padded rows' length).
#[derive(Clone)]
struct KeyedDropout {
    dropout: DeviceDropout,
    places: Option<Tensor>,
    seq: usize,
}

impl CustomOp1 for KeyedDropout {
    fn name(&self) -> &'static str {
        "bertkit-cuda-keyed-dropout"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &KeyedDropout,
            (x, xl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let (rows, width) = xl.shape().dims2()?;
            let input = view::<T>(name, "input", x, xl)?;
            let dev = &x.device;
            // SAFETY: the kernel writes every element.
            let mut out = unsafe { dev.alloc::<T>(rows * width)? };
            let (rows_i, width_i, seq) = (rows as i32, width as i32, op.seq as i32);
            let cfg = config(rows.min(65_535), 256, 0);
            let mut launch = |places: Option<&CudaView<'_, u32>>| {
                launch!(T, dev, "keyed_dropout", cfg, |b| {
                    b.arg(&input).arg(&mut out).arg(&rows_i).arg(&width_i);
                    b.arg(&op.dropout);
                    match places {
                        Some(p) => b.arg(p),
                        None => b.arg(&NULL),
                    };
                    b.arg(&seq);
                })
            };
            match &op.places {
                Some(places) => {
                    with_view::<u32, _>(name, "token places", places, |p| launch(Some(&p)))?
                }
                None => launch(None)?,
            }
            Ok((wrap(out, dev), xl.shape().clone()))
        }
        by_dtype!(self.name(), x, run(self, (x, xl)))
    }

    /// The same mask on the gradient.
    fn bwd(&self, _x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(self)?))
    }
}

/// The dropout of a packed `[tokens, width]` tensor with `dropout`'s keys, each token's line
/// keyed by its place in `packing`'s padded batch.
pub(crate) fn keyed_dropout_tokens(
    x: &Tensor,
    packing: &Packing,
    dropout: DeviceDropout,
) -> Result<Tensor> {
    let places = Places::of(packing);
    let op = KeyedDropout {
        dropout,
        seq: places.seq,
        places: Some(places.gather),
    };
    tape::apply_op1(&tape::contiguous(x)?, op)
}

/// The dropout of a `[rows, width]` tensor with `dropout`'s keys, row by row.
pub(crate) fn keyed_dropout_rows(x: &Tensor, dropout: DeviceDropout) -> Result<Tensor> {
    let op = KeyedDropout {
        dropout,
        places: None,
        seq: 1,
    };
    tape::apply_op1(&tape::contiguous(x)?, op)
}
