//! The embeddings' end on CUDA ([`crate::Kernels::embeddings`]): each token's word, token-type and position rows summed,
//! LayerNorm and dropout in one launch (`embeddings_forward` in `kernels.cu`), where the composed
//! path gathers three `[tokens, hidden]` f32 tensors, adds them with two of candle's additions,
//! normalises, casts and drops in passes of their own, and candle's autograd adds a zeroed
//! gradient and a sum at every edge of that graph on the way back. The backward recomputes the
//! rows from the tables (the forward keeps nothing), writes the sum's gradient in f32 and the
//! norm's parameters' (`embeddings_backward`), and the tables' gradients are the lookup's
//! backward of that one gradient (`gather.rs`), table by table. The twin is the composed path
//! on the CPU (the same lookups, sums, norm and dropout masks).

use super::gather::GatherRowsBackward;
use super::*;
use crate::packing::RowIndex;

/// The most elements of a row the kernels take (`EMBED_LANE_ELEMENTS` in `kernels.cu` a lane,
/// 32 lanes).
const MAX_HIDDEN: usize = 32 * 32;

/// A block's threads: four warps, a warp a token.
const THREADS: usize = 128;

/// The backward's blocks at most: each block's partial sums of the parameters' gradients are a
/// `[2, hidden]` row that the column sums then add (at BERT-large's 8,192 tokens, eight tokens a
/// warp).
const BACKWARD_BLOCKS: usize = 256;

/// What the forward and the backward read besides their tensors.
#[derive(Clone)]
struct EmbeddingsEnd {
    /// The rows each token reads: words, token types, positions.
    rows: [RowIndex; 3],
    /// How many rows of the small tables' stack are token types (the positions follow).
    types: usize,
    eps: f32,
    dropout: DeviceDropout,
    places: Places,
}

/// The shape: `(tokens, hidden)`, checked as on every device (`kernels::embeddings_shape`), and
/// rows the kernels take, every input on a 16-byte boundary, a token's place for each token.
fn shape<T>(
    op: &str,
    end: &EmbeddingsEnd,
    (wl, sl, pl): (&Layout, &Layout, &Layout),
) -> Result<(usize, usize)> {
    let rows = end.rows.each_ref().map(RowIndex::host_rows);
    let (tokens, hidden) = super::super::embeddings_shape(op, rows, end.types, (wl, sl, pl))?;
    if !fits::<T>(hidden) {
        bail!("{op}: rows of {hidden} elements")
    }
    let starts = [wl, sl, pl].map(Layout::start_offset);
    if !in_16_byte_pieces::<f32>(hidden, starts[..2].iter().copied())
        || !in_16_byte_pieces::<T>(hidden, [starts[2], starts[2] + hidden])
    {
        bail!("{op}: inputs off a 16-byte boundary")
    }
    if end.dropout.on != 0 && tokens != end.places.tokens {
        bail!(
            "{op}: {tokens} tokens for a packing of {}",
            end.places.tokens
        )
    }
    Ok((tokens, hidden))
}

/// An op's inputs as the kernels read them.
struct Operands<'a, T> {
    tokens: usize,
    hidden: usize,
    words: CudaView<'a, f32>,
    types: CudaView<'a, f32>,
    positions: CudaView<'a, f32>,
    params: CudaView<'a, T>,
}

/// The inputs of op `name` (the word table, the small tables' stack, the parameters), checked
/// ([`shape`]), as the kernels read them.
fn operands<'a, T: Element>(
    name: &str,
    end: &EmbeddingsEnd,
    (w, wl): (&'a CudaStorage, &Layout),
    (s, sl): (&'a CudaStorage, &Layout),
    (p, pl): (&'a CudaStorage, &Layout),
) -> Result<Operands<'a, T>> {
    let (tokens, hidden) = shape::<T>(name, end, (wl, sl, pl))?;
    let small = view::<f32>(name, "small tables", s, sl)?;
    let (types, positions) = small.split_at(end.types * hidden);
    Ok(Operands {
        tokens,
        hidden,
        words: view::<f32>(name, "word table", w, wl)?,
        types,
        positions,
        params: view::<T>(name, "parameters", p, pl)?,
    })
}

/// Whether the kernels take rows of `hidden` elements of `T`: whole 16-byte pieces of `T` (and
/// so of the f32 tables), at most [`MAX_HIDDEN`].
fn fits<T>(hidden: usize) -> bool {
    hidden > 0 && hidden <= MAX_HIDDEN && hidden.is_multiple_of(piece_elements::<T>())
}

/// Runs `f` with the device views of the three lookups' rows and the tokens' places.
fn with_rows<R>(
    op: &str,
    end: &EmbeddingsEnd,
    f: impl FnOnce([&CudaView<'_, u32>; 4]) -> Result<R>,
) -> Result<R> {
    let [words, types, positions] = &end.rows;
    with_view::<u32, _>(op, "word rows", words.rows(), |w| {
        with_view::<u32, _>(op, "token type rows", types.rows(), |t| {
            with_view::<u32, _>(op, "position rows", positions.rows(), |p| {
                with_view::<u32, _>(op, "token places", &end.places.gather, |places| {
                    f([&w, &t, &p, &places])
                })
            })
        })
    })
}

/// The forward: `[tokens, hidden]` in the parameters' dtype.
struct EmbeddingsOp(EmbeddingsEnd);

impl CustomOp3 for EmbeddingsOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-embeddings"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        w: &CudaStorage,
        wl: &Layout,
        s: &CudaStorage,
        sl: &Layout,
        p: &CudaStorage,
        pl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &EmbeddingsOp,
            (w, wl): (&CudaStorage, &Layout),
            (s, sl): (&CudaStorage, &Layout),
            (p, pl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let end = &op.0;
            let o = operands::<T>(name, end, (w, wl), (s, sl), (p, pl))?;
            let (tokens, hidden) = (o.tokens, o.hidden);
            let dev = &w.device;
            // SAFETY: every element is written by the kernel.
            let mut y = unsafe { dev.alloc::<T>(tokens * hidden)? };
            let (rows_i, hidden_i, seq) = (tokens as i32, hidden as i32, end.places.seq as i32);
            with_rows(name, end, |[wr, tr, pr, places]| {
                launch!(
                    T,
                    dev,
                    "embeddings_forward",
                    config(tokens.div_ceil(THREADS / 32), THREADS, 0),
                    |b| {
                        b.arg(&o.words).arg(&o.types).arg(&o.positions);
                        b.arg(wr).arg(tr).arg(pr).arg(&o.params).arg(&mut y);
                        b.arg(&rows_i)
                            .arg(&hidden_i)
                            .arg(&end.eps)
                            .arg(&end.dropout);
                        b.arg(places).arg(&seq);
                    }
                )
            })?;
            Ok((wrap(y, dev), Shape::from((tokens, hidden))))
        }
        by_dtype!(self.name(), p, run(self, (w, wl), (s, sl), (p, pl)))
    }

    fn bwd(
        &self,
        words: &Tensor,
        small: &Tensor,
        params: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        crate::profiled_backward("embeddings", grad.device(), || {
            let end = &self.0;
            let op = EmbeddingsBackwardOp {
                end: end.clone(),
                grad: Handoff::new(grad.contiguous()?),
            };
            let packed = words.apply_op3_no_bwd(small, params, &op)?;
            let (rows, hidden) = (packed.dim(0)? - 2, packed.dim(1)?);
            let grad_sum = packed.narrow(0, 0, rows)?;
            let grad_params = packed.narrow(0, rows, 2)?.to_dtype(params.dtype())?;
            // Each table's gradient from the sum's, as the lookup's backward sums it.
            let table = |index: &RowIndex, table_rows: usize| {
                let op = GatherRowsBackward {
                    index: index.clone(),
                    rows: table_rows,
                };
                grad_sum.apply_op1_no_bwd(&op)
            };
            let grad_words = table(&end.rows[0], words.dim(0)?)?;
            let positions = small.dim(0)? - end.types;
            let grad_small = Tensor::cat(
                &[
                    &table(&end.rows[1], end.types)?,
                    &table(&end.rows[2], positions)?,
                ],
                0,
            )?;
            debug_assert_eq!(grad_small.dims(), [end.types + positions, hidden]);
            Ok((Some(grad_words), Some(grad_small), Some(grad_params)))
        })
    }
}

/// The backward: `[tokens + 2, hidden]` f32, the sum's gradient, then the weight's and the
/// bias's.
struct EmbeddingsBackwardOp {
    end: EmbeddingsEnd,
    grad: Handoff,
}

impl CustomOp3 for EmbeddingsBackwardOp {
    fn name(&self) -> &'static str {
        "bertkit-cuda-embeddings-backward"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        w: &CudaStorage,
        wl: &Layout,
        s: &CudaStorage,
        sl: &Layout,
        p: &CudaStorage,
        pl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &EmbeddingsBackwardOp,
            (w, wl): (&CudaStorage, &Layout),
            (s, sl): (&CudaStorage, &Layout),
            (p, pl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let end = &op.end;
            let o = operands::<T>(name, end, (w, wl), (s, sl), (p, pl))?;
            let (tokens, hidden) = (o.tokens, o.hidden);
            let grad = op.grad.take(name)?;
            if grad.dims() != [tokens, hidden]
                || !in_16_byte_pieces::<T>(hidden, [grad.layout().start_offset()])
            {
                bail!(
                    "{name}: a gradient of {:?} for {tokens} tokens",
                    grad.dims()
                )
            }
            let dev = &w.device;
            let blocks = tokens.div_ceil(THREADS / 32).clamp(1, BACKWARD_BLOCKS);
            // SAFETY: the kernel writes the sum's every element and every block's partial row;
            // the column sums write the parameters' rows.
            let mut out = unsafe { dev.alloc::<f32>((tokens + 2) * hidden)? };
            let mut partial = unsafe { dev.alloc::<f32>(blocks * 2 * hidden)? };
            let (rows_i, hidden_i, seq) = (tokens as i32, hidden as i32, end.places.seq as i32);
            {
                let (mut grad_sum, mut rest) = out.split_at_mut(tokens * hidden);
                with_view::<T, _>(name, "gradient", &grad, |g| {
                    with_rows(name, end, |[wr, tr, pr, places]| {
                        launch!(
                            T,
                            dev,
                            "embeddings_backward",
                            config(blocks, THREADS, 0),
                            |b| {
                                b.arg(&o.words).arg(&o.types).arg(&o.positions);
                                b.arg(wr).arg(tr).arg(pr).arg(&o.params).arg(&g);
                                b.arg(&mut grad_sum).arg(&mut partial);
                                b.arg(&rows_i)
                                    .arg(&hidden_i)
                                    .arg(&end.eps)
                                    .arg(&end.dropout);
                                b.arg(places).arg(&seq);
                            }
                        )
                    })
                })?;
                column_sums::<f32>(dev, &partial, blocks, &mut rest, 2 * hidden)?;
            }
            Ok((wrap(out, dev), Shape::from((tokens + 2, hidden))))
        }
        by_dtype!(self.name(), p, run(self, (w, wl), (s, sl), (p, pl)))
    }
}

/// Whether the fused embeddings' end takes `lookups` (words, token types, positions) and the
/// norm's `weight`: f32 tables of the weight's width on one CUDA device, rows the kernels take.
pub(crate) fn embeddings_fit(lookups: &[(&Tensor, &RowIndex); 3], weight: &Tensor) -> bool {
    let hidden = weight.elem_count();
    let fits = match weight.dtype() {
        DType::F32 => fits::<f32>(hidden),
        DType::BF16 | DType::F16 => fits::<half::bf16>(hidden),
        _ => false,
    };
    fits && lookups.iter().all(|(table, _)| {
        table.dtype() == DType::F32
            && table.device().same_device(weight.device())
            && table.dims().get(1) == Some(&hidden)
    })
}

/// [`crate::Kernels::embeddings`] on CUDA: the word table, the small tables' stack and
/// the parameters' (`crate::embeddings_operands`) of `lookups` as [`embeddings_fit`]
/// takes them; the output in the parameters' dtype.
pub(crate) fn embeddings(
    [words, small, params]: [Tensor; 3],
    lookups: &[(&Tensor, &RowIndex); 3],
    packing: &Packing,
    dropout: DeviceDropout,
    eps: f64,
) -> Result<Tensor> {
    let op = EmbeddingsOp(EmbeddingsEnd {
        rows: lookups.map(|(_, rows)| rows.clone()),
        types: lookups[1].0.dim(0)?,
        eps: eps as f32,
        dropout,
        places: Places::of(packing),
    });
    tape::apply_op3(&words, &small, &params, op)
}
