//! Reproducible dropout.
//!
//! candle's CPU random generator cannot be seeded, so its dropout masks differ from run to run.
//! Training needs them reproducible: a resumed run must draw the masks the uninterrupted run
//! drew, and activation checkpointing recomputes a layer with the masks of its first pass.
//!
//! A [`DropoutSource`] numbers its masks and draws them in *streams*: a stream starts at a
//! marked position ([`DropoutSource::mark`], [`DropoutSource::set_position`]) and continues
//! while masks are drawn in order. Callers mark where they may later rewind to: the start of
//! each micro-batch's forward pass and of each checkpointed segment. On CUDA a stream is the
//! device generator seeded once with a hash of `(seed, position)` and then drawn from without
//! reseeding (seeding builds a new cuRAND generator, far too costly for every one of a
//! forward pass's ~37–73 masks); on the CPU mask `n` is a counter-based function of
//! `(seed, n)` alone (splitmix64 of the seed, the mask number and the element index). Either
//! way, rewinding to a marked position replays the same masks, and the stream bookkeeping is
//! the same code on every device ([`DropoutSource::streams_started`] counts the streams).
//!
//! Training keys the masks by the optimiser step and by each sequence's place in the step's
//! global batch ([`DropoutSource::start_batch`]), not by rank or micro-batch: on the CPU an
//! element's draw is a function of `(seed, step, mask number in the pass, the row's place in
//! the step, the element's index in each further dimension)`, so a step split over any number
//! of ranks, micro-batches and padded lengths drops the same elements of the same sequences.
//! On CUDA the stream of a micro-batch is seeded with its first row's place, so the masks are
//! the same for every split that keeps the micro-batch size.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

use bertkit_rng::splitmix64 as splitmix;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, bail};

use crate::host::{ELEMENTWISE_CHUNK, contiguous};
use crate::packing::Packing;
use crate::vectorised;

/// Mask numbers set aside for each optimiser step ([`DropoutSource::start_batch`]): far more
/// than a step's passes draw (a forward pass draws 2–3 per layer).
pub const MASKS_PER_STEP: u64 = 1 << 20;

/// Where training-mode dropout masks come from.
#[derive(Debug)]
pub struct DropoutSource {
    seed: u64,
    position: AtomicU64,
    /// The place of the current batch's first row in its step (see [`DropoutSource::start_batch`]).
    first_row: AtomicU64,
    /// The mask number the current stream draws next (`None`: the next mask starts a stream).
    stream_next: Mutex<Option<u64>>,
    streams: AtomicU64,
}

impl DropoutSource {
    /// Masks drawn from `seed`, starting at mask 0.
    pub fn new(seed: u64) -> Self {
        DropoutSource {
            seed,
            position: AtomicU64::new(0),
            first_row: AtomicU64::new(0),
            stream_next: Mutex::new(None),
            streams: AtomicU64::new(0),
        }
    }

    /// How many masks were drawn.
    pub fn position(&self) -> u64 {
        self.position.load(Ordering::SeqCst)
    }

    /// Continues from mask number `position` (to replay or resume), starting a new stream
    /// there. Replays are exact when `position` was marked (or set) when first drawn from.
    pub fn set_position(&self, position: u64) {
        self.position.store(position, Ordering::SeqCst);
        *self.stream_next.lock().expect("dropout stream lock") = None;
    }

    /// Marks the current position as one a later pass may rewind to (a new stream starts
    /// here) and returns it.
    pub fn mark(&self) -> u64 {
        let position = self.position();
        self.set_position(position);
        position
    }

    /// Starts the masks of a micro-batch of optimiser step `step` (from 0) whose first row is
    /// row `first_row` of the step's global batch: a new stream at the step's first mask
    /// number. Masks drawn from here depend on the step, the pass's mask count and each row's
    /// place in the step, never on how the step is split into ranks and micro-batches.
    pub fn start_batch(&self, step: u64, first_row: u64) {
        self.first_row.store(first_row, Ordering::SeqCst);
        self.set_position(step * MASKS_PER_STEP);
    }

    /// Streams started so far: on CUDA, how many times the device generator was seeded.
    pub fn streams_started(&self) -> u64 {
        self.streams.load(Ordering::SeqCst)
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Takes mask number `n`; returns whether it starts a stream.
    fn take(&self, n: u64) -> bool {
        let mut next = self.stream_next.lock().expect("dropout stream lock");
        let starts = *next != Some(n);
        *next = Some(n + 1);
        if starts {
            self.streams.fetch_add(1, Ordering::SeqCst);
        }
        starts
    }

    /// Takes the next mask number: its key, the batch's first row, and whether it starts a
    /// stream.
    fn next_draw(&self) -> Draw {
        let n = self.position.fetch_add(1, Ordering::SeqCst);
        Draw {
            starts_stream: self.take(n),
            first_row: self.first_row.load(Ordering::SeqCst),
            key: splitmix(self.seed ^ splitmix(n)),
        }
    }

    /// The next mask for packed attention probabilities ([`Packing`]: the row's tokens only),
    /// one byte per probability (1: kept), in blocks of `len × len` for each row and head in
    /// order: the padded `[batch, heads, seq, seq]` mask at the tokens' columns, so the same
    /// elements drop as in the padded computation. `None` when `p` is 0.
    pub(crate) fn next_cpu_attention_keep_mask(
        &self,
        packing: &Packing,
        heads: usize,
        p: f64,
    ) -> Option<Vec<u8>> {
        if p <= 0.0 {
            return None;
        }
        let draw = self.next_draw();
        Some(cpu_attention_keep_mask(packing, heads, &draw, p))
    }

    /// The next mask for a packed `[tokens, width]` tensor, one byte per element (1: kept):
    /// the mask [`DropoutSource::apply_to_tokens`] draws on the CPU, for a kernel that applies
    /// it itself. `None` when `p` is 0.
    pub(crate) fn next_cpu_token_keep_mask(
        &self,
        packing: &Packing,
        width: usize,
        p: f64,
    ) -> Option<Vec<u8>> {
        if p <= 0.0 {
            return None;
        }
        let draw = self.next_draw();
        Some(cpu_token_keep_mask(packing, width, &draw, p))
    }

    /// The next mask's keys for a kernel that draws each element itself as [`keeps`] does
    /// (the CUDA kernels): the same mask number, keys and threshold as the CPU masks. `None`
    /// when `p` is 0.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn next_keys(&self, p: f64) -> Option<MaskKeys> {
        if p <= 0.0 {
            return None;
        }
        let draw = self.next_draw();
        Some(MaskKeys {
            key: draw.key,
            first_row: draw.first_row,
            threshold: threshold(p),
            scale: (1.0 / (1.0 - p)) as f32,
        })
    }

    /// `x` with each element zeroed with probability `p` and the rest scaled by `1 / (1 - p)`.
    pub fn apply(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        self.apply_drawn(x, p, |draw| {
            cpu_keep_mask(x.dims(), draw.key, draw.first_row, p)
        })
    }

    /// As [`DropoutSource::apply`] for a packed `[tokens, width]` tensor: on the CPU each
    /// token draws what its place in the padded `[batch, seq, width]` tensor would have.
    pub fn apply_to_tokens(&self, x: &Tensor, packing: &Packing, p: f64) -> Result<Tensor> {
        self.apply_drawn(x, p, |draw| {
            cpu_token_keep_mask(packing, x.dims().last().copied().unwrap_or(1), draw, p)
        })
    }

    /// Dropout of `x` with the next mask: on the CPU the one `cpu_keep` draws.
    fn apply_drawn(
        &self,
        x: &Tensor,
        p: f64,
        cpu_keep: impl FnOnce(&Draw) -> Vec<u8>,
    ) -> Result<Tensor> {
        if p <= 0.0 {
            return Ok(x.clone());
        }
        let scale = 1.0 / (1.0 - p);
        let draw = self.next_draw();
        let mask = match x.device() {
            Device::Cpu => {
                let keep = cpu_keep(&draw);
                if keep.len() != x.elem_count() {
                    candle_core::bail!(
                        "dropout: a mask of {} values for {:?}",
                        keep.len(),
                        x.dims()
                    )
                }
                if x.dtype() == DType::F32 {
                    // Applied (and its backward) in one pass with a byte per element.
                    let op = KeepMask {
                        keep: Arc::new(keep),
                        scale: scale as f32,
                    };
                    return x.contiguous()?.apply_op1(op);
                }
                let values: Vec<f32> = keep
                    .into_iter()
                    .map(|k| f32::from(k) * scale as f32)
                    .collect();
                Tensor::from_vec(values, x.shape(), &Device::Cpu)?
            }
            device => {
                if draw.starts_stream {
                    device.set_seed(splitmix(draw.key ^ splitmix(draw.first_row)))?;
                }
                let uniform = Tensor::rand(0f32, 1f32, x.shape(), device)?;
                (uniform.ge(p)?.to_dtype(DType::F32)? * scale)?
            }
        };
        x.mul(&mask.to_dtype(x.dtype())?)
    }
}

/// A mask's keys: row `i` of the batch is keyed by `row_key(key, first_row, i)`, an element
/// keeps when its 24-bit uniform is at least `threshold`, a kept element is scaled by `scale`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct MaskKeys {
    pub(crate) key: u64,
    pub(crate) first_row: u64,
    pub(crate) threshold: u64,
    pub(crate) scale: f32,
}

/// One mask number taken from a [`DropoutSource`].
struct Draw {
    key: u64,
    first_row: u64,
    starts_stream: bool,
}

/// The uniform below which an element drops at probability `p`, on the 24-bit scale.
fn threshold(p: f64) -> u64 {
    (p * (1u64 << 24) as f64) as u64
}

/// The key of row `row` of a batch whose first row is row `first_row` of its step.
fn row_key(key: u64, first_row: u64, row: usize) -> u64 {
    splitmix(key ^ splitmix(first_row + row as u64))
}

/// The key of the line at `index` (one index per dimension between the row and the last) of
/// the row keyed `row_key`.
fn line_key(row_key: u64, index: &[usize]) -> u64 {
    index
        .iter()
        .fold(row_key, |k, &i| splitmix(k ^ splitmix(i as u64 + 1)))
}

/// Whether element `j` of the line keyed `line_key` keeps (1) or drops (0): its 24-bit uniform
/// is at least `threshold`.
#[inline(always)]
pub(crate) fn keeps(line_key: u64, j: u64, threshold: u64) -> u8 {
    u8::from((splitmix(line_key.wrapping_add(j)) >> 40) >= threshold)
}

/// Which elements of a tensor of `dims` (rows first) mask `key` keeps at drop probability
/// `p` (1: kept, 0: dropped), row `i` being row `first_row + i` of its step. An element keeps
/// when its 24-bit uniform is at least `p`; the uniform hashes the row's place and the
/// element's index in each further dimension separately, so it does not move when the batch
/// is padded longer. Rows are drawn in parallel (each draw is a function of its indices alone).
fn cpu_keep_mask(dims: &[usize], key: u64, first_row: u64, p: f64) -> Vec<u8> {
    let threshold = threshold(p);
    let (rows, rest) = match dims.split_first() {
        Some((&rows, rest)) => (rows, rest),
        None => (1, &[][..]),
    };
    let (last, middle) = match rest.split_last() {
        Some((&last, middle)) => (last, middle),
        None => (1, &[][..]),
    };
    let lines: usize = middle.iter().product();
    let mut keep = vec![0u8; rows * lines * last];
    if keep.is_empty() {
        return keep;
    }
    keep.par_chunks_mut(lines * last)
        .enumerate()
        .for_each(|(row, keep)| {
            let row_key = row_key(key, first_row, row);
            let mut index = vec![0usize; middle.len()];
            for line in keep.chunks_mut(last) {
                fill_keeps(line, line_key(row_key, &index), 0, threshold);
                // The next index of the middle dimensions, last fastest.
                for (i, &d) in index.iter_mut().zip(middle).rev() {
                    *i += 1;
                    if *i < d {
                        break;
                    }
                    *i = 0;
                }
            }
        });
    keep
}

/// The mask of a packed `[tokens, width]` tensor: each token's line is the line of its place
/// (row, column) in the padded `[batch, seq, width]` tensor.
fn cpu_token_keep_mask(packing: &Packing, width: usize, draw: &Draw, p: f64) -> Vec<u8> {
    let threshold = threshold(p);
    let mut keep = vec![0u8; packing.tokens() * width];
    if width == 0 {
        return keep;
    }
    let starts = packing.starts();
    keep.par_chunks_mut(width)
        .zip(packing.columns().par_iter())
        .enumerate()
        .for_each(|(t, (line, &column))| {
            let row = starts.partition_point(|&s| s <= t) - 1;
            let line_key = line_key(row_key(draw.key, draw.first_row, row), &[column as usize]);
            fill_keeps(line, line_key, 0, threshold);
        });
    keep
}

/// The mask of packed attention probabilities, in `len × len` blocks per row and head: the
/// padded `[batch, heads, seq, seq]` mask's elements at the row's token columns.
fn cpu_attention_keep_mask(packing: &Packing, heads: usize, draw: &Draw, p: f64) -> Vec<u8> {
    let threshold = threshold(p);
    let mut blocks: Vec<(usize, usize, &mut [u8])> = Vec::new();
    let mut keep = vec![0u8; crate::packing::attention_probabilities(packing.starts(), heads)];
    let mut rest = &mut keep[..];
    for b in 0..packing.padded_dims().0 {
        let len = packing.row(b).len();
        for h in 0..heads {
            let (block, tail) = rest.split_at_mut(len * len);
            blocks.push((b, h, block));
            rest = tail;
        }
    }
    blocks.into_par_iter().for_each(|(b, h, block)| {
        let columns = &packing.columns()[packing.row(b)];
        let key = row_key(draw.key, draw.first_row, b);
        // The usual row: its tokens in consecutive columns (padding only at the end).
        let consecutive = columns
            .first()
            .zip(columns.last())
            .is_some_and(|(&f, &l)| (l - f) as usize + 1 == columns.len());
        for (line, &i) in block.chunks_mut(columns.len().max(1)).zip(columns) {
            let line_key = line_key(key, &[h, i as usize]);
            if consecutive {
                fill_keeps(line, line_key, u64::from(columns[0]), threshold);
            } else {
                for (k, &j) in line.iter_mut().zip(columns) {
                    *k = keeps(line_key, u64::from(j), threshold);
                }
            }
        }
    });
    keep
}

/// Multiplies by a dropout mask kept as one byte per element (1: kept, scaled by `scale`;
/// 0: dropped); the backward multiplies the gradient by the same mask. A quarter of the memory
/// of an f32 mask tensor, and no gradient computed for the mask.
pub(crate) struct KeepMask {
    pub(crate) keep: Arc<Vec<u8>>,
    pub(crate) scale: f32,
}

impl CustomOp1 for KeepMask {
    fn name(&self) -> &'static str {
        "bertkit-dropout"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(self.name(), "input", storage, layout)?;
        if x.len() != self.keep.len() {
            bail!(
                "dropout: a mask of {} elements for {} values",
                self.keep.len(),
                x.len()
            )
        }
        let mut out = x.to_vec();
        out.par_chunks_mut(ELEMENTWISE_CHUNK)
            .zip(self.keep.par_chunks(ELEMENTWISE_CHUNK))
            .for_each(|(out, keep)| apply_keep_in_place(out, keep, self.scale));
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let same = KeepMask {
            keep: Arc::clone(&self.keep),
            scale: self.scale,
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&same)?))
    }
}

vectorised! {
    /// Dropout's keep bytes for elements `first..first + keep.len()` of a mask's line
    /// ([`keeps`], several lanes at a time).
    fn fill_keeps(keep: &mut [u8], line_key: u64, first: u64, threshold: u64) = fill_keeps_portable
}

#[inline(always)]
fn fill_keeps_portable(keep: &mut [u8], line_key: u64, first: u64, threshold: u64) {
    for (j, k) in keep.iter_mut().enumerate() {
        *k = keeps(line_key, first + j as u64, threshold);
    }
}

vectorised! {
    /// Values times their mask, in place.
    pub(crate) fn apply_keep_in_place(x: &mut [f32], keep: &[u8], scale: f32) = apply_keep_in_place_portable
}

#[inline(always)]
fn apply_keep_in_place_portable(x: &mut [f32], keep: &[u8], scale: f32) {
    for (x, &k) in x.iter_mut().zip(keep) {
        *x *= f32::from(k) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_replay_from_a_position_and_keep_the_expected_share() {
        let x = Tensor::ones((200, 50), DType::F32, &Device::Cpu).unwrap();
        let d = DropoutSource::new(42);
        let a = d.apply(&x, 0.1).unwrap();
        let b = d.apply(&x, 0.1).unwrap();
        d.set_position(0);
        let a2 = d.apply(&x, 0.1).unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v(&a), v(&a2));
        assert_ne!(v(&a), v(&b));
        let kept = v(&a).iter().filter(|&&x| x > 0.0).count() as f64 / 10_000.0;
        assert!((kept - 0.9).abs() < 0.02, "{kept}");
        // Kept values are scaled so the expectation is unchanged.
        assert!((v(&a).iter().sum::<f32>() / 10_000.0 - 1.0).abs() < 0.03);
    }

    /// On the CPU in f32 the mask is applied by a fused op with a backward: the gradient is
    /// the upstream gradient times the same mask (scale where kept, 0 where dropped), exactly.
    #[test]
    fn the_fused_cpu_dropout_passes_gradients_through_its_mask() {
        let cpu = &Device::Cpu;
        let x = candle_core::Var::from_tensor(
            &Tensor::arange(1f32, 1.0 + 12.0 * 37.0, cpu)
                .unwrap()
                .reshape((12, 37))
                .unwrap(),
        )
        .unwrap();
        let d = DropoutSource::new(5);
        let y = d.apply(x.as_tensor(), 0.25).unwrap();
        let upstream = Tensor::arange(0f32, 12.0 * 37.0, cpu)
            .unwrap()
            .reshape((12, 37))
            .unwrap()
            .affine(0.01, -1.0)
            .unwrap();
        let grads = (&y * &upstream)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let grad = grads.get(x.as_tensor()).unwrap().flatten_all().unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (xs, ys, gs, us) = (v(x.as_tensor()), v(&y), v(&grad), v(&upstream));
        let scale = (1.0 / (1.0 - 0.25f64)) as f32;
        let mut dropped = 0;
        for i in 0..xs.len() {
            let factor = if ys[i] == 0.0 { 0.0 } else { scale };
            dropped += usize::from(factor == 0.0);
            assert_eq!(ys[i], xs[i] * factor, "element {i}");
            assert_eq!(gs[i], us[i] * factor, "element {i}");
        }
        assert!((80..=150).contains(&dropped), "{dropped} of 444 dropped");
        // The same masks as the f64 path (which multiplies by a mask tensor).
        d.set_position(0);
        let y64 = d
            .apply(&x.as_tensor().to_dtype(DType::F64).unwrap(), 0.25)
            .unwrap();
        assert_eq!(v(&y64.to_dtype(DType::F32).unwrap()), ys);
    }

    /// A batch's masks depend on each row's place in its step and the element's place in the
    /// row, not on the batch's split or padded length: rows 2..4 of one batch of 4 are the
    /// rows of a batch of 2 starting at row 2, and padding the last two dimensions longer
    /// keeps the masks of the original elements. (Tried: keying rows by their index in the
    /// batch, or elements by their flat index, fails it.)
    #[test]
    fn masks_follow_the_rows_place_in_the_step_not_the_split_or_padding() {
        let d = DropoutSource::new(9);
        let draw = |dims: &[usize], step: u64, first_row: u64| {
            d.start_batch(step, first_row);
            let x = Tensor::ones(dims, DType::F32, &Device::Cpu).unwrap();
            d.apply(&x, 0.3).unwrap().to_vec3::<f32>().unwrap()
        };
        let whole = draw(&[4, 6, 5], 3, 0);
        let half = draw(&[2, 6, 5], 3, 2);
        assert_eq!(&whole[2..], &half[..]);
        let padded = draw(&[2, 9, 7], 3, 2);
        for (a, b) in half.iter().zip(&padded) {
            for (ra, rb) in a.iter().zip(b) {
                assert_eq!(ra[..], rb[..5]);
            }
        }
        assert_ne!(
            draw(&[4, 6, 5], 4, 0),
            whole,
            "another step draws other masks"
        );
        assert_eq!(d.position(), 4 * MASKS_PER_STEP + 1);
    }

    /// A packed batch drops what the padded batch drops at its tokens: hidden dropout at each
    /// token's place, attention dropout at each (query, key) pair of a row's token columns.
    /// (Tried: keying packed tokens by their index in the packing fails it.)
    #[test]
    fn packed_masks_are_the_padded_masks_at_the_tokens() {
        let cpu = &Device::Cpu;
        let (batch, seq, width, heads) = (3, 7, 5, 2);
        let mask: Vec<u32> = (0..batch * seq)
            .map(|i| u32::from(!matches!(i, 5 | 6 | 9 | 14)))
            .collect();
        let packing = Packing::from_mask((batch, seq), &mask, cpu).unwrap();
        let d = DropoutSource::new(11);
        d.start_batch(2, 4);
        let padded = d
            .apply(
                &Tensor::ones((batch, seq, width), DType::F32, cpu).unwrap(),
                0.4,
            )
            .unwrap();
        d.start_batch(2, 4);
        let packed = d
            .apply_to_tokens(
                &Tensor::ones((packing.tokens(), width), DType::F32, cpu).unwrap(),
                &packing,
                0.4,
            )
            .unwrap();
        let packed_from_padded = packing.pack(&padded).unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v(&packed), v(&packed_from_padded));
        assert!(v(&packed).contains(&0.0));

        let draw = Draw {
            key: 77,
            first_row: 4,
            starts_stream: false,
        };
        let dense = cpu_keep_mask(&[batch, heads, seq, seq], draw.key, draw.first_row, 0.4);
        let blocks = cpu_attention_keep_mask(&packing, heads, &draw, 0.4);
        let mut at = 0;
        for b in 0..batch {
            let columns = &packing.columns()[packing.row(b)];
            for h in 0..heads {
                for &i in columns {
                    for &j in columns {
                        let place = ((b * heads + h) * seq + i as usize) * seq + j as usize;
                        assert_eq!(blocks[at], dense[place], "row {b} head {h} ({i}, {j})");
                        at += 1;
                    }
                }
            }
        }
        assert_eq!(at, blocks.len());
    }

    /// The keys a device kernel takes ([`DropoutSource::next_keys`]) give the CPU's masks
    /// when each element is drawn as the CUDA kernels draw it: a token from its place
    /// `b · seq + column` (hidden dropout), a probability from its row, head, query column and
    /// key column (attention dropout). The CUDA kernels' index arithmetic, replayed here.
    #[test]
    fn device_keys_draw_the_cpu_masks() {
        let cpu = &Device::Cpu;
        let (batch, seq, width, heads, p) = (3, 9, 6, 2, 0.3);
        let mask: Vec<u32> = (0..batch * seq)
            .map(|i| u32::from(!matches!(i, 7 | 8 | 12 | 13 | 14 | 15 | 16 | 17)))
            .collect();
        let packing = Packing::from_mask((batch, seq), &mask, cpu).unwrap();
        let places: Vec<u32> = packing.gather_places().to_vec1::<u32>().unwrap();
        let d = DropoutSource::new(21);
        d.start_batch(5, 8);
        let tokens = d.next_cpu_token_keep_mask(&packing, width, p).unwrap();
        let attention = d.next_cpu_attention_keep_mask(&packing, heads, p).unwrap();
        d.start_batch(5, 8);
        let keys = d.next_keys(p).unwrap();
        let row = |b: u64| row_key(keys.key, keys.first_row, b as usize);
        for (t, &place) in places.iter().enumerate() {
            let (b, c) = (u64::from(place) / seq as u64, u64::from(place) % seq as u64);
            let line = line_key(row(b), &[c as usize]);
            for j in 0..width {
                let want = tokens[t * width + j];
                assert_eq!(
                    keeps(line, j as u64, keys.threshold),
                    want,
                    "token {t} element {j}"
                );
            }
        }
        let keys = d.next_keys(p).unwrap();
        let row = |b: usize| row_key(keys.key, keys.first_row, b);
        let mut at = 0;
        for b in 0..batch {
            let columns = &packing.columns()[packing.row(b)];
            for h in 0..heads {
                for &i in columns {
                    let line = line_key(row(b), &[h, i as usize]);
                    for &j in columns {
                        let got = keeps(line, u64::from(j), keys.threshold);
                        assert_eq!(got, attention[at], "row {b} head {h} ({i}, {j})");
                        at += 1;
                    }
                }
            }
        }
        assert_eq!(at, attention.len());
        assert!(tokens.contains(&0) && attention.contains(&0));
        assert_eq!(keys.scale, (1.0 / (1.0 - p)) as f32);
        assert!(d.next_keys(0.0).is_none());
    }

    /// Masks drawn in order continue one stream; marking or rewinding starts the next.
    #[test]
    fn streams_start_only_where_a_pass_may_rewind_to() {
        let x = Tensor::ones(8, DType::F32, &Device::Cpu).unwrap();
        let d = DropoutSource::new(1);
        for _ in 0..5 {
            d.apply(&x, 0.1).unwrap();
        }
        assert_eq!((d.position(), d.streams_started()), (5, 1));
        assert_eq!(d.mark(), 5);
        d.apply(&x, 0.1).unwrap();
        d.apply(&x, 0.1).unwrap();
        assert_eq!(d.streams_started(), 2);
        d.set_position(5);
        d.apply(&x, 0.1).unwrap();
        assert_eq!((d.position(), d.streams_started()), (6, 3));
        // p = 0 draws nothing.
        d.apply(&x, 0.0).unwrap();
        assert_eq!((d.position(), d.streams_started()), (6, 3));
    }
}
