//! The optimiser update of one parameter group in two passes over its state, in place, for
//! f32 state on the CPU: where the composed update makes about fifteen element-wise passes
//! (each a fresh tensor) over the weights, moments and gradients, this reads the gradients
//! once and writes the moments and then the weights where they are. The arithmetic is the composed update's, op for op in f32;
//! LAMB's per-parameter norms are summed in f64 over fixed blocks, added in order (the same
//! result on any number of threads).

use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Tensor, bail};
use rayon::prelude::*;

/// The step's scalars.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scalars {
    pub(crate) clip: f64,
    pub(crate) beta1: f64,
    pub(crate) beta2: f64,
    /// `1 / (1 - β1^t)` and `1 / (1 - β2^t)`.
    pub(crate) inverse_corrections: (f64, f64),
    pub(crate) eps: f64,
    /// The weight decay of this group (0 for biases and LayerNorm).
    pub(crate) decay: f64,
    pub(crate) lr: f64,
    /// LAMB's trust ratio per parameter (with decay only, as the composed update).
    pub(crate) trust_ratio: bool,
}

/// Elements per parallel task.
const BLOCK: usize = 1 << 15;

/// The step's scalars in f32, as the update uses them (laid out as the CUDA twin's
/// `struct Constants`, `cuda_update.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Constants {
    clip: f32,
    b1: f32,
    one_b1: f32,
    b2: f32,
    one_b2: f32,
    inv_bc1: f32,
    inv_bc2: f32,
    eps: f32,
    decay: f32,
    /// 1 with weight decay.
    decayed: i32,
    /// 1 when LAMB's trust ratio applies (LAMB, with decay, as the composed update).
    pub(crate) trust_ratio: i32,
}

impl Constants {
    /// The f32 constants of a step's scalars (the same conversions on every device).
    pub(crate) fn of(s: Scalars) -> Self {
        let f = |x: f64| x as f32;
        Constants {
            clip: f(s.clip),
            b1: f(s.beta1),
            one_b1: f(1.0 - s.beta1),
            b2: f(s.beta2),
            one_b2: f(1.0 - s.beta2),
            inv_bc1: f(s.inverse_corrections.0),
            inv_bc2: f(s.inverse_corrections.1),
            eps: f(s.eps),
            decay: f(s.decay),
            decayed: i32::from(s.decay > 0.0),
            trust_ratio: i32::from(s.trust_ratio && s.decay > 0.0),
        }
    }
}

/// f64 partial sums the squared norms keep (vectorisable), added in order at the end.
const NORM_LANES: usize = 8;

/// The group's `[3, rows, numel]` f32 state (weights, first and second moments) updated in
/// place by its `[rows, numel]` gradients, without new state buffers a group a step (the form
/// that returned three new buffers gave the same values, bit for bit, when this replaced it).
/// `scratch` holds each parameter's update between the two passes; it grows to the largest
/// parameter once and is kept by the caller for the next step.
pub(crate) fn update_in_place(
    state: &Tensor,
    gradients: &Tensor,
    s: Scalars,
    scratch: &mut Vec<f32>,
) -> Result<()> {
    let op = InPlace {
        scalars: s,
        scratch: std::cell::RefCell::new(std::mem::take(scratch)),
    };
    let out = state.inplace_op2(&gradients.contiguous()?, &op);
    *scratch = op.scratch.into_inner();
    out
}

struct InPlace {
    scalars: Scalars,
    scratch: std::cell::RefCell<Vec<f32>>,
}

impl InplaceOp2 for InPlace {
    fn name(&self) -> &'static str {
        "bertkit-optimizer-update-in-place"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let name = self.name();
        let (parts, rows, numel) = l1.shape().dims3()?;
        if parts != 3 || l2.dims() != [rows, numel] {
            bail!(
                "{name}: a [3, rows, numel] state and [rows, numel] gradients expected, got {:?} and {:?}",
                l1.dims(),
                l2.dims()
            )
        }
        let (CpuStorage::F32(state), Some((start, end))) = (s1, l1.contiguous_offsets()) else {
            bail!("{name}: the state is not contiguous f32")
        };
        let (CpuStorage::F32(g), Some((g_start, g_end))) = (s2, l2.contiguous_offsets()) else {
            bail!("{name}: the gradients are not contiguous f32")
        };
        let g = &g[g_start..g_end];
        let total = rows * numel;
        let (w, moments) = state[start..end].split_at_mut(total);
        let (m, v) = moments.split_at_mut(total);
        let mut u = self.scratch.borrow_mut();
        if u.len() < numel {
            u.resize(numel, 0.0);
        }
        for row in 0..rows {
            let span = row * numel..(row + 1) * numel;
            update_row_in_place(
                (
                    &mut w[span.clone()],
                    &mut m[span.clone()],
                    &mut v[span.clone()],
                ),
                &g[span],
                &mut u[..numel],
                self.scalars,
            );
        }
        Ok(())
    }
}

/// One parameter in place: the moments, the update `u` (into `u`) and the norms of w and u;
/// then the weights. The norms are summed in f64 over fixed blocks in a fixed order (the same
/// result on any number of threads).
fn update_row_in_place(
    (w, m, v): (&mut [f32], &mut [f32], &mut [f32]),
    g: &[f32],
    u: &mut [f32],
    s: Scalars,
) {
    let f = |x: f64| x as f32;
    let c = Constants::of(s);
    let trust_ratio = c.trust_ratio != 0;
    let w_read: &[f32] = w;
    let norms: Vec<(f64, f64)> = u
        .par_chunks_mut(BLOCK)
        .zip(m.par_chunks_mut(BLOCK).zip(v.par_chunks_mut(BLOCK)))
        .enumerate()
        .map(|(block, (u, (m, v)))| {
            let span = block * BLOCK..block * BLOCK + u.len();
            let w = &w_read[span.clone()];
            moments(w, &g[span], (m, v), u, c);
            if trust_ratio {
                squared_norms(w, u)
            } else {
                (0.0, 0.0)
            }
        })
        .collect();
    let ratio = if trust_ratio {
        let (w2, u2) = norms
            .iter()
            .fold((0f64, 0f64), |(a, b), &(w2, u2)| (a + w2, b + u2));
        let (wn, un) = (w2.sqrt(), u2.sqrt());
        if wn > 0.0 && un > 0.0 {
            f(wn / un)
        } else {
            1.0
        }
    } else {
        1.0
    };
    let lr = f(s.lr);
    w.par_chunks_mut(BLOCK)
        .zip(u.par_chunks(BLOCK))
        .for_each(|(w, u)| weights(w, u, ratio, lr));
}

bertkit_model::vectorised! {
    /// A block's moments in place and its update into `u`, element by element. (The
    /// gradient times a clip of 1, or the update times a trust ratio of 1, is exactly itself.)
    fn moments(w: &[f32], g: &[f32], mv: (&mut [f32], &mut [f32]), u: &mut [f32], c: Constants) = moments_portable
}

#[inline(always)]
fn moments_portable(
    w: &[f32],
    g: &[f32],
    (m, v): (&mut [f32], &mut [f32]),
    u: &mut [f32],
    c: Constants,
) {
    let n = u.len();
    let (w, g, m, v) = (&w[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let gi = g[i] * c.clip;
        let mi = m[i] * c.b1 + gi * c.one_b1;
        let vi = v[i] * c.b2 + gi * gi * c.one_b2;
        let denominator = (vi * c.inv_bc2).sqrt() + c.eps;
        let ui = (mi * c.inv_bc1) / denominator;
        u[i] = if c.decayed != 0 {
            ui + w[i] * c.decay
        } else {
            ui
        };
        m[i] = mi;
        v[i] = vi;
    }
}

bertkit_model::vectorised! {
    /// `(Σ w², Σ u²)` in f64 over a block, in [`NORM_LANES`] partial sums added in order.
    fn squared_norms(w: &[f32], u: &[f32]) -> (f64, f64) = squared_norms_portable
}

#[inline(always)]
fn squared_norms_portable(w: &[f32], u: &[f32]) -> (f64, f64) {
    let (mut w2, mut u2) = ([0f64; NORM_LANES], [0f64; NORM_LANES]);
    for (w, u) in w.chunks(NORM_LANES).zip(u.chunks(NORM_LANES)) {
        for lane in 0..w.len().min(u.len()) {
            w2[lane] += f64::from(w[lane]) * f64::from(w[lane]);
            u2[lane] += f64::from(u[lane]) * f64::from(u[lane]);
        }
    }
    (w2.iter().sum(), u2.iter().sum())
}

bertkit_model::vectorised! {
    /// `Σ x²` in f64 over a block, in [`NORM_LANES`] partial sums added in order.
    fn squared_norm(x: &[f32]) -> f64 = squared_norm_portable
}

#[inline(always)]
fn squared_norm_portable(x: &[f32]) -> f64 {
    let mut sums = [0f64; NORM_LANES];
    for x in x.chunks(NORM_LANES) {
        for (sum, &x) in sums.iter_mut().zip(x) {
            *sum += f64::from(x) * f64::from(x);
        }
    }
    sums.iter().sum()
}

/// `Σ x²` of a flat f32 buffer in f64, over fixed blocks in parallel added in order (the same
/// result on any number of threads).
pub(crate) fn sum_of_squares(x: &[f32]) -> f64 {
    let blocks: Vec<f64> = x.par_chunks(BLOCK).map(squared_norm).collect();
    blocks.iter().sum()
}

/// `Σ value(x)²` of a flat buffer of any element type in f64, over the same fixed blocks as
/// [`sum_of_squares`] (each block's values made in f32 first, then summed as it sums them).
pub(crate) fn sum_of_squares_of<S: Copy + Sync>(x: &[S], value: impl Fn(S) -> f32 + Sync) -> f64 {
    let blocks: Vec<f64> = x
        .par_chunks(BLOCK)
        .map(|block| squared_norm(&block.iter().map(|&x| value(x)).collect::<Vec<f32>>()))
        .collect();
    blocks.iter().sum()
}

bertkit_model::vectorised! {
    /// A block's new weights in place: `w - (u · ratio) · lr`.
    fn weights(w: &mut [f32], u: &[f32], ratio: f32, lr: f32) = weights_portable
}

#[inline(always)]
fn weights_portable(w: &mut [f32], u: &[f32], ratio: f32, lr: f32) {
    for (w, &u) in w.iter_mut().zip(u) {
        *w -= u * ratio * lr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// The in-place update against a scalar reference (element by element in f32 as the
    /// composed update, norms in f64), over rows spanning several parallel blocks: the moments
    /// exactly, the weights to an f32 rounding of the trust ratio.
    #[test]
    fn the_update_in_place_matches_a_scalar_reference() {
        let (rows, numel) = (2, 70_000);
        let r = |seed: u64, scale: f64| {
            bertkit_model::kernels::check::values(&[rows, numel], scale, seed, DType::F32).unwrap()
        };
        let (w, m, v, g) = (r(1, 0.5), r(2, 0.01), r(3, 0.001).abs().unwrap(), r(4, 0.1));
        let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (w0, m0, v0, g0) = (host(&w), host(&m), host(&v), host(&g));
        for (decay, trust_ratio) in [(0.01, true), (0.0, false), (0.01, false)] {
            let s = Scalars {
                clip: 0.7,
                beta1: 0.9,
                beta2: 0.999,
                inverse_corrections: (1.0 / 0.1, 1.0 / 0.001),
                eps: 1e-6,
                decay,
                lr: 1e-2,
                trust_ratio,
            };
            let state = Tensor::stack(&[&w, &m, &v], 0).unwrap();
            update_in_place(&state, &g, s, &mut Vec::new()).unwrap();
            let got = host(&state);
            let c = Constants::of(s);
            let n = rows * numel;
            for row in 0..rows {
                let span = row * numel..(row + 1) * numel;
                let (mut u, mut w2, mut u2) = (vec![0f32; numel], 0f64, 0f64);
                for (k, i) in span.clone().enumerate() {
                    let gi = g0[i] * c.clip;
                    let mi = m0[i] * c.b1 + gi * c.one_b1;
                    let vi = v0[i] * c.b2 + gi * gi * c.one_b2;
                    assert_eq!((got[n + i], got[2 * n + i]), (mi, vi), "moments at {i}");
                    let mut ui = (mi * c.inv_bc1) / ((vi * c.inv_bc2).sqrt() + c.eps);
                    if decay > 0.0 {
                        ui += w0[i] * c.decay;
                    }
                    u[k] = ui;
                    w2 += f64::from(w0[i]).powi(2);
                    u2 += f64::from(ui).powi(2);
                }
                let ratio = if trust_ratio && decay > 0.0 {
                    (w2.sqrt() / u2.sqrt()) as f32
                } else {
                    1.0
                };
                for (k, i) in span.enumerate() {
                    let want = w0[i] - u[k] * ratio * s.lr as f32;
                    assert!(
                        (got[i] - want).abs() <= 1e-6 * want.abs().max(1e-3),
                        "weight {i}: {} against {want}",
                        got[i]
                    );
                }
            }
        }
    }
}
