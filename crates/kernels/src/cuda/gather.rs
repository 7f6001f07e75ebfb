//! Embedding lookups on CUDA ([`crate::Kernels::gather_rows`]): the rows each token
//! reads gathered in one launch, and a backward that sums each table row's gradients apart (a
//! block per distinct row read) in token order. candle's backward of `index_select` gives each
//! of a table's columns one thread, which walks every token of the batch in turn. Here a row's
//! tokens are summed in pieces of 64 by as many blocks and the pieces added in order, in f32:
//! a row read by thousands of tokens (the two token types) does not wait on one block. The
//! twin is candle's `index_select` on the CPU (the same sums, in another order: within the
//! check's bound).

use super::*;
use crate::packing::RowIndex;

/// `table`'s rows at `index`, `[tokens, width]`.
struct GatherRows {
    index: RowIndex,
}

fn table_dims(op: &str, layout: &Layout) -> Result<(usize, usize)> {
    match *layout.dims() {
        [rows, cols] if cols > 0 => Ok((rows, cols)),
        ref dims => bail!("{op}: a [rows, width] table expected, got {dims:?}"),
    }
}

impl CustomOp1 for GatherRows {
    fn name(&self) -> &'static str {
        "bertkit-cuda-gather-rows"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, table: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &GatherRows,
            (table, layout): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let (rows, cols) = table_dims(name, layout)?;
            if let Some(&row) = op.index.host_rows().iter().find(|&&r| r as usize >= rows) {
                bail!("{name}: row {row} of a table of {rows}")
            }
            let tokens = op.index.host_rows().len();
            let dev = &table.device;
            let src = view::<T>(name, "table", table, layout)?;
            // SAFETY: every element is written by the kernel.
            let mut out = unsafe { dev.alloc::<T>(tokens * cols)? };
            let (tokens_i, cols_i) = (tokens as i32, cols as i32);
            with_view::<u32, _>(name, "rows", op.index.rows(), |ids| {
                launch!(
                    T,
                    dev,
                    "gather_rows",
                    config((tokens * cols).div_ceil(256).min(65_535), 256, 0),
                    |b| {
                        b.arg(&src)
                            .arg(&ids)
                            .arg(&mut out)
                            .arg(&tokens_i)
                            .arg(&cols_i);
                    }
                )
            })?;
            Ok((wrap(out, dev), Shape::from((tokens, cols))))
        }
        by_dtype!(self.name(), table, run(self, (table, layout)))
    }

    fn bwd(&self, table: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        crate::profiled_backward("gather_rows", grad.device(), || {
            let op = GatherRowsBackward {
                index: self.index.clone(),
                rows: table.dim(0)?,
            };
            Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&op)?))
        })
    }
}

/// The table's gradient, `[rows, width]`, from the gathered rows' (`[tokens, width]`).
pub(super) struct GatherRowsBackward {
    pub(super) index: RowIndex,
    pub(super) rows: usize,
}

impl CustomOp1 for GatherRowsBackward {
    fn name(&self) -> &'static str {
        "bertkit-cuda-gather-rows-backward"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, grad: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: Element>(
            op: &GatherRowsBackward,
            (grad, layout): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let name = op.name();
            let (tokens, cols) = table_dims(name, layout)?;
            if tokens != op.index.host_rows().len() {
                bail!(
                    "{name}: the gradient of {tokens} rows for {} tokens",
                    op.index.host_rows().len()
                )
            }
            let groups = op.index.groups()?;
            let dev = &grad.device;
            let src = view::<T>(name, "gradient", grad, layout)?;
            // Rows no token read keep a zero gradient.
            let mut out = dev.alloc_zeros::<T>(op.rows * cols)?;
            let (groups_i, cols_i) = (groups.count as i32, cols as i32);
            // Each piece's sum, then each row's pieces in order (`kernels.cu`).
            // SAFETY: the first launch writes every piece's row.
            let mut partial = unsafe { dev.alloc::<f32>(groups.pieces * cols)? };
            let pieces_i = groups.pieces as i32;
            with_view::<u32, _>(name, "order", &groups.order, |order| {
                with_view::<u32, _>(name, "pieces", &groups.piece_starts, |pieces| {
                    launch!(
                        T,
                        dev,
                        "gather_rows_backward_pieces",
                        config(groups.pieces.min(65_535), row_threads(cols), 0),
                        |b| {
                            b.arg(&src)
                                .arg(&order)
                                .arg(&pieces)
                                .arg(&mut partial)
                                .arg(&pieces_i)
                                .arg(&cols_i);
                        }
                    )
                })
            })?;
            with_view::<u32, _>(name, "row pieces", &groups.row_pieces, |row_pieces| {
                with_view::<u32, _>(name, "distinct", &groups.distinct, |distinct| {
                    launch!(
                        T,
                        dev,
                        "gather_rows_backward_rows",
                        config(groups.count.min(65_535), row_threads(cols), 0),
                        |b| {
                            b.arg(&partial)
                                .arg(&row_pieces)
                                .arg(&distinct)
                                .arg(&mut out)
                                .arg(&groups_i)
                                .arg(&cols_i);
                        }
                    )
                })
            })?;
            Ok((wrap(out, dev), Shape::from((op.rows, cols))))
        }
        by_dtype!(self.name(), grad, run(self, (grad, layout)))
    }
}

/// [`crate::Kernels::gather_rows`] on CUDA (f32 or bf16 tables).
pub(crate) fn gather_rows(table: &Tensor, index: &RowIndex) -> Result<Tensor> {
    let op = GatherRows {
        index: index.clone(),
    };
    tape::apply_op1(&tape::contiguous(table)?, op)
}
