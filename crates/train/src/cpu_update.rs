//! The optimiser update of one parameter group in one pass over its state, for f32 state on
//! the CPU: where the composed update makes about fifteen element-wise passes (each a fresh
//! tensor) over the weights, moments and gradients, this reads each once and writes the new
//! weights and moments once. The arithmetic is the composed update's, op for op in f32;
//! LAMB's per-parameter norms are summed in f64 over fixed blocks, added in order (the same
//! result on any number of threads).

use candle_core::{Result, Storage, Tensor, bail};
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

/// The f32 values of a contiguous CPU tensor.
fn values<'a>(what: &str, storage: &'a Storage, tensor: &Tensor) -> Result<&'a [f32]> {
    match (storage, tensor.layout().contiguous_offsets()) {
        (Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((start, end))) => Ok(&v[start..end]),
        _ => bail!("optimiser update: the {what} are not contiguous f32 on the CPU"),
    }
}

/// The group's new `(master, m, v)` from its `[rows, numel]` master weights, moments and
/// gradients.
pub(crate) fn update(
    master: &Tensor,
    m: &Tensor,
    v: &Tensor,
    gradients: &Tensor,
    s: Scalars,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (rows, numel) = master.dims2()?;
    for t in [m, v, gradients] {
        if t.dims() != [rows, numel] {
            bail!(
                "optimiser update: state of shape {:?} for [{rows}, {numel}]",
                t.dims()
            )
        }
    }
    let (new_w, new_m, new_v) = {
        let (ws, _) = master.storage_and_layout();
        let (ms, _) = m.storage_and_layout();
        let (vs, _) = v.storage_and_layout();
        let (gs, _) = gradients.storage_and_layout();
        let w = values("weights", &ws, master)?;
        let m = values("first moments", &ms, m)?;
        let v = values("second moments", &vs, v)?;
        let g = values("gradients", &gs, gradients)?;
        let mut new_w = vec![0f32; w.len()];
        let mut new_m = vec![0f32; w.len()];
        let mut new_v = vec![0f32; w.len()];
        for row in 0..rows {
            let span = row * numel..(row + 1) * numel;
            update_row(
                (
                    &w[span.clone()],
                    &m[span.clone()],
                    &v[span.clone()],
                    &g[span.clone()],
                ),
                (
                    &mut new_w[span.clone()],
                    &mut new_m[span.clone()],
                    &mut new_v[span],
                ),
                s,
            );
        }
        (new_w, new_m, new_v)
    };
    let device = master.device();
    Ok((
        Tensor::from_vec(new_w, (rows, numel), device)?,
        Tensor::from_vec(new_m, (rows, numel), device)?,
        Tensor::from_vec(new_v, (rows, numel), device)?,
    ))
}

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

/// One parameter: the moments and the update (into `new_w`, as the step before the weights),
/// then the weights.
fn update_row(
    (w, m, v, g): (&[f32], &[f32], &[f32], &[f32]),
    (new_w, new_m, new_v): (&mut [f32], &mut [f32], &mut [f32]),
    s: Scalars,
) {
    let f = |x: f64| x as f32;
    let c = Constants::of(s);
    let trust_ratio = c.trust_ratio != 0;
    // Pass 1: moments and the update `u` (kept in `new_w`), and the squared norms of w and u.
    let norms: Vec<(f64, f64)> = new_w
        .par_chunks_mut(BLOCK)
        .zip(new_m.par_chunks_mut(BLOCK).zip(new_v.par_chunks_mut(BLOCK)))
        .enumerate()
        .map(|(block, (u_out, (m_out, v_out)))| {
            let span = block * BLOCK..block * BLOCK + u_out.len();
            let w = &w[span.clone()];
            moments(
                (w, &m[span.clone()], &v[span.clone()], &g[span]),
                (u_out, m_out, v_out),
                c,
            );
            if trust_ratio {
                squared_norms(w, u_out)
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
    // Pass 2: the weights.
    let lr = f(s.lr);
    new_w
        .par_chunks_mut(BLOCK)
        .zip(w.par_chunks(BLOCK))
        .for_each(|(out, w)| weights(out, w, ratio, lr));
}

bertkit_model::vectorised! {
    /// The moments and the update of a block, element by element. (The gradient times a clip
    /// of 1, or the update times a trust ratio of 1, is exactly itself.)
    fn moments(
        inputs: (&[f32], &[f32], &[f32], &[f32]),
        outputs: (&mut [f32], &mut [f32], &mut [f32]),
        c: Constants
    ) = moments_portable
}

#[inline(always)]
fn moments_portable(
    (w, m, v, g): (&[f32], &[f32], &[f32], &[f32]),
    (u_out, m_out, v_out): (&mut [f32], &mut [f32], &mut [f32]),
    c: Constants,
) {
    let n = u_out.len();
    let (w, m, v, g) = (&w[..n], &m[..n], &v[..n], &g[..n]);
    let (m_out, v_out) = (&mut m_out[..n], &mut v_out[..n]);
    for i in 0..n {
        let gi = g[i] * c.clip;
        let mi = m[i] * c.b1 + gi * c.one_b1;
        let vi = v[i] * c.b2 + gi * gi * c.one_b2;
        let denominator = (vi * c.inv_bc2).sqrt() + c.eps;
        let u = (mi * c.inv_bc1) / denominator;
        u_out[i] = if c.decayed != 0 {
            u + w[i] * c.decay
        } else {
            u
        };
        m_out[i] = mi;
        v_out[i] = vi;
    }
}

/// f64 partial sums the squared norms keep (vectorisable), added in order at the end.
const NORM_LANES: usize = 8;

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
    /// The new weights of a block: `w - (u · ratio) · lr`, with the update `u` in `out`.
    fn weights(out: &mut [f32], w: &[f32], ratio: f32, lr: f32) = weights_portable
}

#[inline(always)]
fn weights_portable(out: &mut [f32], w: &[f32], ratio: f32, lr: f32) {
    for (o, &w) in out.iter_mut().zip(w) {
        *o = w - *o * ratio * lr;
    }
}
