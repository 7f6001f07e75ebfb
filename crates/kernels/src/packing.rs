//! Unpadded batches: the tokens of a padded `[batch, seq]` batch laid end to end.
//!
//! Inside the encoder every activation is `[tokens, width]`, the batch's tokens (its attention
//! mask's 1s) row after row, so no linear layer, LayerNorm, GELU or dropout spends anything on
//! padding; attention runs within each row's tokens ([`Packing::starts`], the boundaries the
//! attention kernel takes). A row's tokens keep the positions (columns) they have in the padded
//! batch, so position embeddings, dropout masks and results are those of the padded
//! computation: attention over a row's tokens alone is exactly attention with the padding
//! masked out, whose weights are 0.
//!
//! The layout is computed on the host from the mask when [`crate::Inputs`] are built, so
//! nothing is read back from the device to use it.

/// The additive attention bias of padding: large enough that its softmax weight is exactly 0
/// in f32, small enough for f16.
pub const MASK_BIAS: f64 = -10_000.0;

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Result, Tensor};

/// Where each token of a padded batch sits in the packed layout.
#[derive(Debug, Clone)]
pub struct Packing {
    batch: usize,
    seq: usize,
    /// Row `b`'s tokens are `starts[b]..starts[b + 1]` (`batch + 1` values).
    starts: Arc<Vec<usize>>,
    /// Each token's column (position) in its row: on the host, and on the device as the rows
    /// the position embeddings read.
    positions: RowIndex,
    /// `[tokens]` u32: each token's place `b · seq + column` in the flattened padded batch.
    gather: Tensor,
    /// Each padded place's token, or `tokens` (a zero row) for padding (`[batch · seq]`): the
    /// rows a padded output reads from the tokens and a zero row.
    scatter: RowIndex,
    /// Each row's column 0, in [`Packing::scatter`]'s numbering (the token, or the zero row).
    firsts: RowIndex,
    /// Whether some row's column 0 is padding (its first place is then the zero row).
    first_is_padding: bool,
    /// `[batch, 1, 1, seq]` f32: 0 for tokens, [`MASK_BIAS`] for padding.
    mask_bias: Tensor,
}

impl Packing {
    /// The packing of a `[batch, seq]` attention mask held on the host (row-major, 1 for a
    /// token, anything else for padding); tensors on `device`.
    pub fn from_mask((batch, seq): (usize, usize), mask: &[u32], device: &Device) -> Result<Self> {
        if mask.len() != batch * seq {
            candle_core::bail!(
                "packing: a mask of {} values for [{batch}, {seq}]",
                mask.len()
            )
        }
        let mut starts = Vec::with_capacity(batch + 1);
        let mut columns = Vec::with_capacity(mask.len());
        let mut gather = Vec::with_capacity(mask.len());
        for b in 0..batch {
            let row = &mask[b * seq..(b + 1) * seq];
            starts.push(columns.len());
            for (c, _) in row.iter().enumerate().filter(|&(_, &m)| m == 1) {
                columns.push(c as u32);
                gather.push((b * seq + c) as u32);
            }
        }
        starts.push(columns.len());
        let tokens = columns.len();
        let mut scatter = vec![tokens as u32; batch * seq];
        for (t, &place) in gather.iter().enumerate() {
            scatter[place as usize] = t as u32;
        }
        let firsts: Vec<u32> = (0..batch).map(|b| scatter[b * seq]).collect();
        let first_is_padding = firsts.iter().any(|&t| t as usize == tokens);
        let bias: Vec<f32> = mask
            .iter()
            .map(|&m| if m == 1 { 0.0 } else { MASK_BIAS as f32 })
            .collect();
        Ok(Packing {
            mask_bias: Tensor::from_vec(bias, (batch, 1, 1, seq), device)?,
            batch,
            seq,
            gather: Tensor::from_slice(&gather, tokens, device)?,
            positions: RowIndex::from_host(columns, device)?,
            scatter: RowIndex::from_host(scatter, device)?,
            firsts: RowIndex::from_host(firsts, device)?,
            first_is_padding,
            starts: Arc::new(starts),
        })
    }

    /// The padded batch's `(batch, seq)`.
    pub fn padded_dims(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }

    /// The number of tokens.
    pub fn tokens(&self) -> usize {
        self.columns().len()
    }

    /// Where each row's tokens start, and the end of the last (`batch + 1` values).
    pub fn starts(&self) -> &[usize] {
        &self.starts
    }

    /// Row `b`'s tokens.
    pub fn row(&self, b: usize) -> Range<usize> {
        self.starts[b]..self.starts[b + 1]
    }

    /// Each token's column as a `[tokens]` u32 tensor (its position id).
    pub fn positions(&self) -> &Tensor {
        self.positions.rows()
    }

    /// [`Packing::starts`], shared (for a kernel to keep).
    pub(crate) fn shared_starts(&self) -> Arc<Vec<usize>> {
        Arc::clone(&self.starts)
    }

    /// The padded batch's additive attention bias, `[batch, 1, 1, seq]` f32: 0 for tokens,
    /// [`MASK_BIAS`] for padding.
    pub fn mask_bias(&self) -> &Tensor {
        &self.mask_bias
    }

    /// `[batch · seq]` u32: each padded place's token, or [`Packing::tokens`] for padding
    /// (the CUDA attention kernels' way from tokens to padded heads).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn scatter_places(&self) -> &Tensor {
        self.scatter.rows()
    }

    /// `[tokens]` u32: each token's place `b · seq + column` in the flattened padded batch
    /// (the CUDA kernels' way back, and their dropout keys).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn gather_places(&self) -> &Tensor {
        &self.gather
    }

    /// Each token's column (position) in its padded row.
    pub fn columns(&self) -> &[u32] {
        self.positions.host_rows()
    }

    /// The rows of the position embeddings the tokens read (their columns).
    pub fn position_rows(&self) -> RowIndex {
        self.positions.clone()
    }

    /// The values of a padded `[batch, seq]` array held on the host (row-major) at the
    /// tokens, in token order.
    pub fn pack_host(&self, values: &[u32]) -> Vec<u32> {
        (0..self.batch)
            .flat_map(|b| {
                self.row(b)
                    .map(move |t| values[b * self.seq + self.columns()[t] as usize])
            })
            .collect()
    }

    /// The tokens' values of a padded `[batch, seq, ...]` tensor, `[tokens, ...]`.
    pub fn pack(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        if dims.len() < 2 || dims[..2] != [self.batch, self.seq] {
            candle_core::bail!(
                "packing: a [{}, {}, ...] tensor expected, got {dims:?}",
                self.batch,
                self.seq
            )
        }
        let mut flat = vec![self.batch * self.seq];
        flat.extend_from_slice(&dims[2..]);
        let flat = x.reshape(flat)?;
        if self.is_dense() {
            return Ok(flat);
        }
        flat.index_select(&self.gather, 0)
    }

    /// A packed `[tokens, width]` tensor padded back to `[batch, seq, width]`, zeros at padding.
    pub fn unpack(&self, x: &Tensor) -> Result<Tensor> {
        self.unpack_with(x, |t, rows| t.index_select(rows.rows(), 0))
    }

    /// As [`Packing::unpack`], the rows gathered by `gather` (a kernel set's
    /// [`crate::Kernels::gather_rows`], whose backward may be faster than `index_select`'s).
    pub fn unpack_with(
        &self,
        x: &Tensor,
        gather: impl FnOnce(&Tensor, &RowIndex) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let width = self.width(x)?;
        if self.is_dense() {
            // No padding: the tokens are the padded batch's places in order, a view of them.
            return x.reshape((self.batch, self.seq, width));
        }
        gather(&with_zero_row(x)?, &self.scatter)?.reshape((self.batch, self.seq, width))
    }

    /// Whether the batch has no padding: every place a token, the packed tokens the padded
    /// batch's places in order (packing and unpacking are reshapes).
    pub fn is_dense(&self) -> bool {
        self.tokens() == self.batch * self.seq
    }

    /// The rows of packed `x` (`[tokens, width]`) at `places` (places `b · seq + column` of the
    /// padded batch, on the host), `[n, width]`; zeros where a place is padding.
    pub fn select(&self, x: &Tensor, places: &[u32]) -> Result<Tensor> {
        self.select_with(x, places, |t, rows| t.index_select(rows.rows(), 0))
    }

    /// As [`Packing::select`], the rows gathered by `gather` (a kernel set's
    /// [`crate::Kernels::gather_rows`]).
    pub fn select_with(
        &self,
        x: &Tensor,
        places: &[u32],
        gather: impl FnOnce(&Tensor, &RowIndex) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.width(x)?;
        let scatter = self.scatter.host_rows();
        let tokens = places
            .iter()
            .map(|&place| match scatter.get(place as usize) {
                Some(&t) => Ok(t),
                None => candle_core::bail!(
                    "packing: place {place} of a [{}, {}] batch",
                    self.batch,
                    self.seq
                ),
            })
            .collect::<Result<Vec<u32>>>()?;
        // A zero row to read only where a place is padding: otherwise the rows come from `x`
        // itself, not from a copy of it (the whole `[tokens, width]`, and in training a copy's
        // gradient too).
        let padding = tokens.iter().any(|&t| t as usize == self.tokens());
        let rows = RowIndex::from_host(tokens, self.positions.rows().device())?;
        if padding {
            gather(&with_zero_row(x)?, &rows)
        } else {
            gather(x, &rows)
        }
    }

    /// Each row's column 0 (the `[CLS]` token) of packed `x`, `[batch, width]`; zeros for a
    /// row whose column 0 is padding.
    pub fn firsts(&self, x: &Tensor) -> Result<Tensor> {
        self.firsts_with(x, |t, rows| t.index_select(rows.rows(), 0))
    }

    /// As [`Packing::firsts`], the rows gathered by `gather` (a kernel set's
    /// [`crate::Kernels::gather_rows`]).
    pub fn firsts_with(
        &self,
        x: &Tensor,
        gather: impl FnOnce(&Tensor, &RowIndex) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.width(x)?;
        if self.first_is_padding {
            gather(&with_zero_row(x)?, &self.firsts)
        } else {
            gather(x, &self.firsts)
        }
    }

    /// The width of packed `x`, checked to be `[tokens, width]`.
    fn width(&self, x: &Tensor) -> Result<usize> {
        match *x.dims() {
            [t, width] if t == self.tokens() => Ok(width),
            ref dims => candle_core::bail!(
                "packing: a [{}, width] tensor of tokens expected, got {dims:?}",
                self.tokens()
            ),
        }
    }
}

/// Which row of a table each token reads (an embedding lookup): the rows in token order on the
/// device, and, built from the host's copy when a backward pass first asks, the tokens grouped
/// by the row they read. candle's backward of a row lookup sums a table row's gradients one
/// token after the other for every row at once (one thread per column: on CUDA a single block
/// walks all of a batch's tokens); grouped, each row's sum can run apart, still in token
/// order, so the bits are the same.
#[derive(Debug, Clone)]
pub struct RowIndex {
    /// `[tokens]` u32 on the device.
    rows: Tensor,
    /// The same rows on the host.
    host: Arc<Vec<u32>>,
    groups: Arc<std::sync::OnceLock<RowGroups>>,
}

/// A [`RowIndex`]'s tokens grouped by row, on the device (all u32).
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct RowGroups {
    /// The tokens, ordered by the row they read (and by token within a row).
    pub(crate) order: Tensor,
    /// The distinct rows read, ascending.
    pub(crate) distinct: Tensor,
    /// How many distinct rows.
    pub(crate) count: usize,
    /// Each row's tokens cut into pieces of at most [`ROW_PIECE`] (in `order`): where each
    /// piece starts, and the end of the last (`pieces + 1` values).
    pub(crate) piece_starts: Tensor,
    /// Where each distinct row's pieces start, and the end of the last (`count + 1` values).
    pub(crate) row_pieces: Tensor,
    /// How many pieces.
    pub(crate) pieces: usize,
}

/// The most tokens of a row one piece of a lookup's backward sums ([`RowGroups::piece_starts`]):
/// enough that a piece's block has work, few enough that a row read by thousands of tokens is
/// summed by many blocks.
pub(crate) const ROW_PIECE: usize = 64;

impl RowIndex {
    /// The rows `rows` (one per token, in token order), uploaded to `device`.
    pub fn from_host(rows: Vec<u32>, device: &Device) -> Result<Self> {
        Ok(RowIndex {
            rows: Tensor::from_slice(&rows, rows.len(), device)?,
            host: Arc::new(rows),
            groups: Arc::new(std::sync::OnceLock::new()),
        })
    }

    /// `[tokens]` u32: the row each token reads.
    pub fn rows(&self) -> &Tensor {
        &self.rows
    }

    /// The row each token reads, on the host.
    pub fn host_rows(&self) -> &[u32] {
        &self.host
    }

    /// The tokens grouped by row (built and uploaded on the first call).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn groups(&self) -> Result<&RowGroups> {
        if let Some(groups) = self.groups.get() {
            return Ok(groups);
        }
        let (order, starts, distinct) = group_by_row(&self.host);
        let (piece_starts, row_pieces) = split_rows(&starts, ROW_PIECE);
        let device = self.rows.device();
        let groups = RowGroups {
            count: distinct.len(),
            pieces: piece_starts.len() - 1,
            piece_starts: Tensor::from_slice(&piece_starts, piece_starts.len(), device)?,
            row_pieces: Tensor::from_slice(&row_pieces, row_pieces.len(), device)?,
            order: Tensor::from_slice(&order, order.len(), device)?,
            distinct: Tensor::from_slice(&distinct, distinct.len(), device)?,
        };
        Ok(self.groups.get_or_init(|| groups))
    }
}

/// `rows`' tokens ordered by row (stable: by token within a row), where each distinct row's
/// tokens start (and the end), and the distinct rows ascending.
fn group_by_row(rows: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut order: Vec<u32> = (0..rows.len() as u32).collect();
    order.sort_by_key(|&t| rows[t as usize]);
    let (mut starts, mut distinct) = (Vec::new(), Vec::new());
    for (i, &t) in order.iter().enumerate() {
        let row = rows[t as usize];
        if distinct.last() != Some(&row) {
            distinct.push(row);
            starts.push(i as u32);
        }
    }
    starts.push(order.len() as u32);
    (order, starts, distinct)
}

/// Each row's tokens (between consecutive `starts`, [`group_by_row`]'s) cut into pieces of at
/// most `piece`: where each piece starts (and the end of the last), and where each row's
/// pieces start (and the end of the last).
fn split_rows(starts: &[u32], piece: usize) -> (Vec<u32>, Vec<u32>) {
    let (mut piece_starts, mut row_pieces) = (Vec::new(), Vec::new());
    for w in starts.windows(2) {
        row_pieces.push(piece_starts.len() as u32);
        piece_starts.extend((w[0]..w[1]).step_by(piece));
    }
    row_pieces.push(piece_starts.len() as u32);
    piece_starts.push(*starts.last().unwrap_or(&0));
    (piece_starts, row_pieces)
}

/// How many attention probabilities the sequences starting at `starts` (a [`Packing`]'s, the
/// end of the last one included) have with `heads` heads: `len × len` per sequence and head.
/// The CPU attention's dropout mask holds one byte per probability, in that order.
pub(crate) fn attention_probabilities(starts: &[usize], heads: usize) -> usize {
    starts
        .windows(2)
        .map(|w| heads * (w[1] - w[0]).pow(2))
        .sum()
}

/// `x` (`[tokens, width]`) with a row of zeros after its last.
fn with_zero_row(x: &Tensor) -> Result<Tensor> {
    let zero = Tensor::zeros((1, x.dim(1)?), x.dtype(), x.device())?;
    Tensor::cat(&[x, &zero], 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens grouped by the row they read: by row ascending, by token within a row.
    #[test]
    fn rows_group_by_row_then_token() {
        let (order, starts, distinct) = group_by_row(&[5, 2, 5, 0, 2, 5]);
        assert_eq!(order, [3, 1, 4, 0, 2, 5]);
        assert_eq!(starts, [0, 1, 3, 6]);
        assert_eq!(distinct, [0, 2, 5]);
        assert_eq!(group_by_row(&[]), (vec![], vec![0], vec![]));
    }

    /// Rows of 1, 2 and 7 tokens in pieces of at most 3: one, one and three pieces, in order,
    /// covering every token once.
    #[test]
    fn rows_split_into_pieces_in_order() {
        let (pieces, rows) = split_rows(&[0, 1, 3, 10], 3);
        assert_eq!(pieces, [0, 1, 3, 6, 9, 10]);
        assert_eq!(rows, [0, 1, 2, 5]);
        assert_eq!(split_rows(&[0], 3), (vec![0], vec![0]));
    }

    #[test]
    fn tokens_keep_their_columns_and_padding_unpacks_to_zeros() {
        let cpu = &Device::Cpu;
        // Row 0: 3 tokens then padding; row 1: a hole at column 1; row 2: padding first.
        let mask = [1, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 0];
        let p = Packing::from_mask((3, 4), &mask, cpu).unwrap();
        assert_eq!(p.tokens(), 8);
        assert_eq!(p.starts(), &[0, 3, 6, 8]);
        assert_eq!(p.columns(), &[0, 1, 2, 0, 2, 3, 1, 2]);
        let x = Tensor::arange(0f32, 12.0, cpu)
            .unwrap()
            .reshape((3, 4, 1))
            .unwrap();
        let packed = p.pack(&x).unwrap();
        assert_eq!(
            packed.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0., 1., 2., 4., 6., 7., 9., 10.]
        );
        let back = p.unpack(&packed).unwrap();
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0., 1., 2., 0., 4., 0., 6., 7., 0., 9., 10., 0.]
        );
        assert!(p.select(&packed, &[12]).is_err());
        assert_eq!(
            p.select(&packed, &[2, 5, 8, 11])
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            vec![2., 0., 0., 0.]
        );
        // No place in padding: the rows straight from the tokens.
        assert_eq!(
            p.select(&packed, &[9, 0, 4, 9])
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            vec![9., 0., 4., 9.]
        );
        assert_eq!(
            p.firsts(&packed)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            vec![0., 4., 0.]
        );
        assert!(p.unpack(&x).is_err());
    }

    /// A batch without padding packs and unpacks as views of the same buffer, with the values
    /// a gather would give; its shapes are still checked.
    #[test]
    fn a_batch_without_padding_packs_and_unpacks_as_views() {
        let cpu = &Device::Cpu;
        let p = Packing::from_mask((2, 3), &[1; 6], cpu).unwrap();
        assert!(p.is_dense());
        assert!(
            !Packing::from_mask((2, 3), &[1, 1, 1, 1, 1, 0], cpu)
                .unwrap()
                .is_dense()
        );
        let x = Tensor::arange(0f32, 12.0, cpu)
            .unwrap()
            .reshape((2, 3, 2))
            .unwrap();
        let packed = p.pack(&x).unwrap();
        assert_eq!(packed.dims(), [6, 2]);
        let back = p.unpack(&packed).unwrap();
        assert_eq!(back.dims(), [2, 3, 2]);
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            (0..12).map(|v| v as f32).collect::<Vec<_>>()
        );
        let buffer = |t: &Tensor| &*t.storage_and_layout().0 as *const candle_core::Storage;
        assert_eq!(buffer(&x), buffer(&packed));
        assert_eq!(buffer(&x), buffer(&back));
        assert_eq!(
            p.unpack_with(&packed, |t, rows| t.index_select(rows.rows(), 0))
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            (0..12).map(|v| v as f32).collect::<Vec<_>>()
        );
        assert!(p.unpack(&x).is_err());
        assert!(p.pack(&packed).is_err());
    }
}
