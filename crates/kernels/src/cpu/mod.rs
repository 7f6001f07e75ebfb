//! Fused kernels of our own for f32 on the CPU, each with a fused backward, where candle's
//! composition runs several passes (each with its own backward node) and scalar C-library
//! math: linear layers ([`Linear`]), attention per sequence and head of a packed batch
//! ([`Attention`]), LayerNorm alone, at a sublayer's end with the dropout and residual
//! ([`LayerNorm`], [`ResidualLayerNorm`]) and at the embeddings' end ([`Embeddings`]), GELU in both forms, the exact one with a vectorised
//! error function ([`GeluOp`]), and the negative log-likelihood ([`NegativeLogLikelihood`]);
//! one file each, its tests beside it. Dropout's byte masks and the op that applies them are
//! [`crate::dropout`]'s; the loops' vector dispatch and storage views are `crate::host`'s.
//! [`crate::Fused`] takes them for f32 on the CPU, whether or not gradients are
//! tracked; a backward pass is itself one op of ours, computed from the forward op's inputs
//! and output (which candle keeps anyway) and, for attention, the dropout mask.
//!
//! Every loop runs rows (or fixed blocks) in parallel and sums within a row in a fixed order of
//! lanes, so results do not depend on the number of threads: training stays bit-reproducible.
//! Exponentials are computed several lanes at a time (a polynomial within 2 ulp of `expf`),
//! with the loops compiled for AVX-512 or AVX2 where the CPU has them (chosen at run time).

mod attention;
mod embeddings;
mod gelu;
mod layer_norm;
mod linear;
mod nll;

pub(crate) use attention::Attention;
pub(crate) use embeddings::Embeddings;
pub(crate) use gelu::GeluOp;
pub(crate) use layer_norm::{LayerNorm, ResidualLayerNorm};
pub(crate) use linear::{GeluLinear, HalfBias, Linear, LinearGelu};
pub(crate) use nll::NegativeLogLikelihood;

/// Lanes the row loops keep separate maxima and sums in: in-order float reductions cannot be
/// vectorised, per-lane ones can (16 f32 fill one AVX-512 register). The lanes are summed in
/// one fixed order, so a row's sum does not depend on the machine.
const LANES: usize = 16;

/// `Σ f(i)` over `0..n` in [`LANES`] partial sums (vectorisable), then in order.
#[inline(always)]
fn lane_sum(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let whole = n - n % LANES;
    let mut lanes = [0f32; LANES];
    for base in (0..whole).step_by(LANES) {
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane += f(base + l);
        }
    }
    let mut sum = 0f32;
    for lane in lanes {
        sum += lane;
    }
    for i in whole..n {
        sum += f(i);
    }
    sum
}

/// The largest of `values`, by [`LANES`] running maxima (vectorisable), then in order.
#[inline(always)]
fn lane_max(values: &[f32]) -> f32 {
    let whole = values.len() - values.len() % LANES;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in values[..whole].chunks_exact(LANES) {
        for l in 0..LANES {
            lanes[l] = if chunk[l] > lanes[l] {
                chunk[l]
            } else {
                lanes[l]
            };
        }
    }
    values[whole..]
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// Rows whose weight and bias gradients one task sums; the partial sums are then added in
/// order, so the result does not depend on how rayon splits the work.
const ROWS_PER_PARTIAL: usize = 32;

/// Rows of `row_len` per parallel task: about 16k elements, at least one row.
fn rows_per_task(row_len: usize) -> usize {
    (16_384 / row_len.max(1)).max(1)
}

// ---------------------------------------------------------------------------------------------

/// `e^x` for `x` up to 88 (a softmax row minus its maximum is at most 0): Cody–Waite reduction to
/// `r` in [-ln2/2, ln2/2], a degree-6 polynomial (Cephes' `expf` coefficients), and `2^n` built
/// in the exponent bits. Below -87.3 it returns about the smallest normal f32 (~1.2e-38)
/// instead of 0, which changes no sum a softmax row makes and no GELU value. Multiply-adds are
/// explicit `mul_add`s: one fused instruction on AVX2 and AVX-512, and correctly rounded on
/// every target, so every target computes the same bits (as in `twice_phi`).
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    let n = x.mul_add(LOG2E, 0.5).floor();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p = 1.987_569_1e-4_f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
    // `n` is a whole number in [-126, 128] here (x is clamped above). Rust's saturating `as`
    // cast compiles to a scalar conversion and NaN check per lane, which keeps the loops
    // calling this from being vectorised; the unchecked conversion is one vector instruction.
    // SAFETY: `n` is finite and well inside i32's range.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    y * f32::from_bits(((n + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_2_ulp_of_the_c_librarys() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let (ours, libm) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max((ours - libm).abs() / libm);
        }
        // 2 ulp of f32 is 2.4e-7 relative.
        assert!(worst < 2.4e-7, "{worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-10_000.0) < 1.3e-38);
    }
}
