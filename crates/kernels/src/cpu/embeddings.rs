//! The embeddings' end: each token's word, token-type and position rows summed, LayerNorm and
//! dropout in one op ([`crate::Kernels::embeddings`]), the twin of the CUDA kernel
//! (`kernels/cuda/embeddings.rs`, the same inputs). The composed path writes the three rows
//! gathered, the two sums, the norm and the dropped values as tensors of their own, and
//! candle's autograd adds a zeroed gradient and a sum at each of that graph's edges on the way
//! back; here the sum is recomputed a row at a time (forward and backward) and each table's
//! gradient is summed from the sum's in token order, as the lookup's backward sums it. The
//! values are the composition's to the bit: the same f32 operations in the same order (the
//! sum `(word + type) + position`, the norm's rows, the dropout's product).

use super::layer_norm::{NormInput, layer_norm_backward_rows, layer_norm_rows};
use crate::dropout::{KeepMask, apply_keep_in_place};
use crate::host::{ELEMENTWISE_CHUNK, cpu_slice, same_shape};
use crate::packing::RowIndex;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

/// `dropout(LayerNorm(words[w] + types[t] + positions[p]))` for each token, from the word
/// table `[vocab, hidden]`, the token-type and position tables stacked (`[types + positions,
/// hidden]`, [`Embeddings::types`] rows of token types) and the norm's weight and bias
/// stacked (`[2, hidden]`), all f32; the dropout by a mask of keep bytes as [`KeepMask`]'s (or
/// none).
pub(crate) struct Embeddings {
    /// The rows each token reads: words, token types, positions.
    pub(crate) rows: [RowIndex; 3],
    /// How many rows of the small tables' stack are token types (the positions follow).
    pub(crate) types: usize,
    pub(crate) eps: f32,
    /// The dropout's keep bytes and the scale of a kept element.
    pub(crate) keep: Option<(Arc<Vec<u8>>, f32)>,
}

/// The tables and rows an [`Embeddings`] op sums, checked against each other.
pub(super) struct EmbeddingRows<'a> {
    words: &'a [f32],
    types: &'a [f32],
    positions: &'a [f32],
    rows: [&'a [u32]; 3],
    hidden: usize,
}

impl EmbeddingRows<'_> {
    pub(super) fn tokens(&self) -> usize {
        self.rows[0].len()
    }

    /// Token `t`'s sum of rows into `sum` (`hidden` values).
    pub(super) fn sum_row(&self, t: usize, sum: &mut [f32]) {
        let h = self.hidden;
        fn row(table: &[f32], r: u32, h: usize) -> &[f32] {
            let at = r as usize * h;
            &table[at..at + h]
        }
        let w = row(self.words, self.rows[0][t], h);
        let ty = row(self.types, self.rows[1][t], h);
        let p = row(self.positions, self.rows[2][t], h);
        for i in 0..h {
            sum[i] = (w[i] + ty[i]) + p[i];
        }
    }
}

impl Embeddings {
    /// The checked operands, and the norm's weight and bias.
    fn operands<'a>(
        &'a self,
        op: &str,
        (words, wl): (&'a [f32], &Layout),
        (small, sl): (&'a [f32], &Layout),
        (params, pl): (&'a [f32], &Layout),
    ) -> Result<(EmbeddingRows<'a>, &'a [f32], &'a [f32])> {
        let rows = self.rows.each_ref().map(RowIndex::host_rows);
        let (tokens, hidden) = super::super::embeddings_shape(op, rows, self.types, (wl, sl, pl))?;
        if let Some((keep, _)) = &self.keep
            && keep.len() != tokens * hidden
        {
            bail!(
                "{op}: a dropout mask of {} elements for {tokens} tokens of {hidden}",
                keep.len()
            )
        }
        let (types, positions) = small.split_at(self.types * hidden);
        let (weight, bias) = params.split_at(hidden);
        let e = EmbeddingRows {
            words,
            types,
            positions,
            rows,
            hidden,
        };
        Ok((e, weight, bias))
    }
}

impl CustomOp3 for Embeddings {
    fn name(&self) -> &'static str {
        "bertkit-embeddings"
    }

    fn cpu_fwd(
        &self,
        words: &CpuStorage,
        wl: &Layout,
        small: &CpuStorage,
        sl: &Layout,
        params: &CpuStorage,
        pl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let w = crate::host::contiguous(op, "word table", words, wl)?;
        let s = crate::host::contiguous(op, "small tables", small, sl)?;
        let p = crate::host::contiguous(op, "parameters", params, pl)?;
        let (e, weight, bias) = self.operands(op, (w, wl), (s, sl), (p, pl))?;
        let mut out = layer_norm_rows(NormInput::Embeddings(&e), e.hidden, weight, bias, self.eps);
        if let Some((keep, scale)) = &self.keep {
            out.par_chunks_mut(ELEMENTWISE_CHUNK)
                .zip(keep.par_chunks(ELEMENTWISE_CHUNK))
                .for_each(|(out, keep)| apply_keep_in_place(out, keep, *scale));
        }
        Ok((CpuStorage::F32(out), Shape::from((e.tokens(), e.hidden))))
    }

    fn bwd(
        &self,
        words: &Tensor,
        small: &Tensor,
        params: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        crate::profiled_backward("embeddings", grad.device(), || {
            let op = self.name();
            // The dropout's backward first: the same mask on the gradient.
            let grad = match &self.keep {
                Some((keep, scale)) => grad.contiguous()?.apply_op1_no_bwd(&KeepMask {
                    keep: Arc::clone(keep),
                    scale: *scale,
                })?,
                None => grad.contiguous()?,
            };
            let (w_storage, wl) = words.storage_and_layout();
            let (s_storage, sl) = small.storage_and_layout();
            let (p_storage, pl) = params.storage_and_layout();
            let (g_storage, gl) = grad.storage_and_layout();
            same_shape(op, out.layout(), gl)?;
            let (e, weight, _) = self.operands(
                op,
                (cpu_slice(op, "word table", &w_storage, wl)?, wl),
                (cpu_slice(op, "small tables", &s_storage, sl)?, sl),
                (cpu_slice(op, "parameters", &p_storage, pl)?, pl),
            )?;
            let g = cpu_slice(op, "gradient", &g_storage, gl)?;
            let h = e.hidden;
            let mut grad_sum = vec![0f32; e.tokens() * h];
            let input = NormInput::Embeddings(&e);
            let grad_params =
                layer_norm_backward_rows(input, h, weight, g, self.eps, &mut grad_sum);
            // Each table's gradient: its rows' sums of the tokens' gradients, in token order.
            let scatter = |rows: &[u32], table_rows: usize| {
                let mut table = vec![0f32; table_rows * h];
                for (t, &r) in rows.iter().enumerate() {
                    let row = &mut table[r as usize * h..(r as usize + 1) * h];
                    for (a, b) in row.iter_mut().zip(&grad_sum[t * h..(t + 1) * h]) {
                        *a += b;
                    }
                }
                table
            };
            let small_rows = small.dim(0)?;
            let mut grad_small = scatter(e.rows[1], self.types);
            grad_small.extend(scatter(e.rows[2], small_rows - self.types));
            let device = words.device();
            Ok((
                Some(Tensor::from_vec(
                    scatter(e.rows[0], words.dim(0)?),
                    words.shape(),
                    device,
                )?),
                Some(Tensor::from_vec(grad_small, small.shape(), device)?),
                Some(Tensor::from_vec(grad_params, params.shape(), device)?),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dropout::DropoutSource;
    use crate::packing::Packing;
    use crate::{Fused, Kernels, Mode, composed_embeddings};
    use candle_core::{DType, Device, Var};

    /// The fused op gives the composed path's values to the bit, and the same gradients (the
    /// same sums in the same order; a zero's sign aside), with dropout and without.
    #[test]
    fn the_fused_embeddings_are_the_composed_paths_bits() {
        let device = Device::Cpu;
        let (batch, seq, hidden) = (3, 9, 24);
        let mask: Vec<u32> = (0..batch * seq)
            .map(|i| u32::from(i % seq < [9, 4, 7][i / seq]))
            .collect();
        let packing = Packing::from_mask((batch, seq), &mask, &device).unwrap();
        let tokens = packing.tokens();
        let values = |n: usize, seed: u64| {
            crate::check::values(&[n, hidden], 1.0, seed, DType::F32).unwrap()
        };
        let vars = [
            values(11, 1),
            values(2, 2),
            values(seq, 3),
            (values(1, 4).reshape(hidden).unwrap() + 1.0).unwrap(),
            values(1, 5).reshape(hidden).unwrap(),
        ]
        .map(|t| Var::from_tensor(&t).unwrap());
        let word_rows: Vec<u32> = (0..tokens).map(|t| (t * 5 % 11) as u32).collect();
        let type_rows: Vec<u32> = (0..tokens).map(|t| (t % 3 == 0) as u32).collect();
        let rows = [
            RowIndex::from_host(word_rows, &device).unwrap(),
            RowIndex::from_host(type_rows, &device).unwrap(),
            packing.position_rows(),
        ];
        let upstream = values(tokens, 6);
        for p in [0.0, 0.1] {
            let run = |fused: bool| {
                let source = DropoutSource::new(7);
                source.start_batch(0, 0);
                let t = |i: usize| vars[i].as_tensor();
                let lookups = [(t(0), &rows[0]), (t(1), &rows[1]), (t(2), &rows[2])];
                let mode = Mode::Train(&source);
                let y = if fused {
                    Fused::default().embeddings(lookups, &packing, mode, p, t(3), t(4), 1e-12)
                } else {
                    let norm = (t(3), t(4), 1e-12);
                    composed_embeddings(&Fused::default(), lookups, &packing, mode, p, norm)
                }
                .unwrap();
                let grads = crate::backward_from(&y, &upstream).unwrap();
                let mut out = vec![y.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
                for v in &vars {
                    let g = grads.get(v.as_tensor()).unwrap();
                    out.push(g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
                }
                out
            };
            let (fused, composed) = (run(true), run(false));
            let bits = |v: &[f32]| v.iter().map(|x| (x + 0.0).to_bits()).collect::<Vec<_>>();
            for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
                assert_eq!(bits(a), bits(b), "p {p}: output or gradient {i}");
            }
            // Not vacuous: every table got a gradient, and the dropout dropped.
            assert!(fused[1..].iter().all(|g| g.iter().any(|&x| x != 0.0)));
            let zeros = fused[0].iter().filter(|&&x| x == 0.0).count();
            assert_eq!(zeros > 0, p > 0.0, "p {p}: {zeros} zeros");
        }
    }
}
