//! Fused kernels of our own for the CPU's inference path, where candle's run as several passes
//! with scalar C-library math: attention's scale, padding mask and softmax in one pass
//! ([`MaskedSoftmax`]), and the exact GELU with a vectorised error function ([`Gelu`]). Neither
//! has a backward: [`crate::kernels::Composed`] takes them only where nothing tracks gradients,
//! like candle's fused LayerNorm, and only for f32 on the CPU.
//!
//! Exponentials are computed several lanes at a time (a polynomial within 2 ulp of `expf`),
//! with the loops compiled for AVX-512 or AVX2 where the CPU has them (chosen at run time).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, bail};
use rayon::prelude::*;

/// `softmax(scores · scale + mask)` over the last dimension; `scores` `[batch, heads, q, k]`,
/// `mask` `[batch, 1, 1, k]` (additive: 0 or a large negative number), both f32.
pub(crate) struct MaskedSoftmax {
    pub(crate) scale: f32,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "bertkit-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        scores: &CpuStorage,
        scores_layout: &Layout,
        mask: &CpuStorage,
        mask_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(scores), CpuStorage::F32(mask)) = (scores, mask) else {
            bail!("masked softmax: f32 scores and mask expected")
        };
        let (Some((s0, s1)), Some((m0, m1))) = (
            scores_layout.contiguous_offsets(),
            mask_layout.contiguous_offsets(),
        ) else {
            bail!("masked softmax: contiguous scores and mask expected")
        };
        let (scores, mask) = (&scores[s0..s1], &mask[m0..m1]);
        let dims = scores_layout.dims();
        let [batch, heads, queries, keys] = *dims else {
            bail!("masked softmax: [batch, heads, q, k] scores expected, got {dims:?}")
        };
        if mask_layout.dims() != [batch, 1, 1, keys] {
            bail!(
                "masked softmax: a [{batch}, 1, 1, {keys}] mask expected, got {:?}",
                mask_layout.dims()
            )
        }
        let mut out = vec![0f32; scores.len()];
        let per_batch = heads * queries * keys;
        out.par_chunks_mut(keys)
            .zip(scores.par_chunks(keys))
            .enumerate()
            .for_each(|(row, (out, x))| {
                let b = row * keys / per_batch;
                softmax_row(x, &mask[b * keys..(b + 1) * keys], self.scale, out);
            });
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

/// One row, compiled for the widest vector unit the CPU has.
fn softmax_row(x: &[f32], mask: &[f32], scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { softmax_row_avx512(x, mask, scale, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { softmax_row_avx2(x, mask, scale, out) };
        }
    }
    softmax_row_portable(x, mask, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn softmax_row_avx512(x: &[f32], mask: &[f32], scale: f32, out: &mut [f32]) {
    softmax_row_portable(x, mask, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_row_avx2(x: &[f32], mask: &[f32], scale: f32, out: &mut [f32]) {
    softmax_row_portable(x, mask, scale, out)
}

/// Lanes the row loops keep separate maxima and sums in: in-order float reductions cannot be
/// vectorised, per-lane ones can (16 f32 fill one AVX-512 register).
const LANES: usize = 16;

/// The row's arithmetic in loops the compiler vectorises (inlined into each target-feature
/// variant above).
#[inline(always)]
fn softmax_row_portable(x: &[f32], mask: &[f32], scale: f32, out: &mut [f32]) {
    let n = out.len();
    let (x, mask) = (&x[..n], &mask[..n]);
    let whole = n - n % LANES;
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    for ((o, x), m) in out[..whole]
        .chunks_exact_mut(LANES)
        .zip(x[..whole].chunks_exact(LANES))
        .zip(mask[..whole].chunks_exact(LANES))
    {
        for l in 0..LANES {
            o[l] = x[l] * scale + m[l];
            lane_max[l] = if o[l] > lane_max[l] {
                o[l]
            } else {
                lane_max[l]
            };
        }
    }
    let mut max = lane_max.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for i in whole..n {
        out[i] = x[i] * scale + mask[i];
        max = max.max(out[i]);
    }
    let mut lane_sum = [0f32; LANES];
    for o in out[..whole].chunks_exact_mut(LANES) {
        for l in 0..LANES {
            o[l] = exp(o[l] - max);
            lane_sum[l] += o[l];
        }
    }
    let mut sum: f32 = lane_sum.iter().sum();
    for o in &mut out[whole..] {
        *o = exp(*o - max);
        sum += *o;
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// The exact GELU, `x · Φ(x)`, elementwise on f32 (any shape, contiguous).
pub(crate) struct Gelu;

/// Elements per parallel task.
const GELU_CHUNK: usize = 1 << 14;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "bertkit-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(x) = storage else {
            bail!("gelu: f32 input expected")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("gelu: contiguous input expected")
        };
        let x = &x[start..end];
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(GELU_CHUNK)
            .zip(x.par_chunks(GELU_CHUNK))
            .for_each(|(out, x)| gelu_chunk(x, out));
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }
}

fn gelu_chunk(x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { gelu_chunk_avx512(x, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { gelu_chunk_avx2(x, out) };
        }
    }
    gelu_chunk_portable(x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn gelu_chunk_avx512(x: &[f32], out: &mut [f32]) {
    gelu_chunk_portable(x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn gelu_chunk_avx2(x: &[f32], out: &mut [f32]) {
    gelu_chunk_portable(x, out)
}

#[inline(always)]
fn gelu_chunk_portable(x: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o = gelu(x);
    }
}

/// `x · Φ(x)` with `Φ(x) = erfc(-x/√2) / 2`, and `erfc` from the Chebyshev fit in Numerical
/// Recipes (`erfcc`: relative error below 1.2e-7 for every argument), so the negative tail,
/// where `Φ` is tiny, keeps its relative precision too.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = 0.170_872_77_f32;
    p = p * t - 0.822_152_23;
    p = p * t + 1.488_515_9;
    p = p * t - 1.135_204;
    p = p * t + 0.278_868_07;
    p = p * t - 0.186_288_06;
    p = p * t + 0.096_784_18;
    p = p * t + 0.374_091_96;
    p = p * t + 1.000_023_7;
    p = p * t - 1.265_512_2;
    let erfc = t * exp(p - z * z);
    let phi_times_2 = if x < 0.0 { erfc } else { 2.0 - erfc };
    0.5 * x * phi_times_2
}

/// `e^x` for `x` up to 88 (a softmax row minus its maximum is at most 0): Cody–Waite reduction to
/// `r` in [-ln2/2, ln2/2], a degree-6 polynomial (Cephes' `expf` coefficients), and `2^n` built
/// in the exponent bits. Below -87.3 it returns about the smallest normal f32 (~1.2e-38)
/// instead of 0, which changes no sum a softmax row makes and no GELU value.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let bits = ((n as i32 + 127) as u32) << 23;
    y * f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{D, DType, Device, Tensor};

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

    #[test]
    fn the_fused_row_equals_the_composed_softmax_in_f64() {
        let (b, h, q, k) = (3, 4, 5, 37);
        let cpu = &Device::Cpu;
        let scores = Tensor::randn(0f32, 3.0, (b, h, q, k), cpu).unwrap();
        // Row 0 of the batch pads its last 10 keys, row 1 its last one, row 2 none.
        let mask: Vec<f32> = (0..b * k)
            .map(|i| {
                let (row, key) = (i / k, i % k);
                let padded = (row == 0 && key >= k - 10) || (row == 1 && key == k - 1);
                if padded { -10_000.0 } else { 0.0 }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (b, 1, 1, k), cpu).unwrap();
        let scale = 0.17677669f32;
        let fused = scores
            .apply_op2_no_bwd(&mask, &MaskedSoftmax { scale })
            .unwrap();
        let x = (scores.to_dtype(DType::F64).unwrap() * scale as f64)
            .unwrap()
            .broadcast_add(&mask.to_dtype(DType::F64).unwrap())
            .unwrap();
        let max = x.max_keepdim(D::Minus1).unwrap();
        let e = x.broadcast_sub(&max).unwrap().exp().unwrap();
        let reference = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
        let diff = (fused.to_dtype(DType::F64).unwrap() - reference)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(diff < 1e-6, "{diff:e}");
        // Padded keys get (next to) nothing.
        let row: Vec<f32> = fused
            .get(0)
            .unwrap()
            .get(0)
            .unwrap()
            .get(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(row[k - 10..].iter().all(|&p| p < 1e-30), "{row:?}");
        // A wrongly shaped mask is an error, not a panic.
        let bad = Tensor::zeros((b, 1, 1, k - 1), DType::F32, cpu).unwrap();
        assert!(
            scores
                .apply_op2_no_bwd(&bad, &MaskedSoftmax { scale })
                .is_err()
        );
    }

    #[test]
    fn gelu_is_the_exact_gelu_to_f32_precision() {
        let cpu = &Device::Cpu;
        let xs: Vec<f32> = (0..=40_000).map(|i| -20.0 + i as f32 * 0.001).collect();
        let ours = Tensor::new(xs.as_slice(), cpu)
            .unwrap()
            .apply_op1_no_bwd(&Gelu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // The reference in f64 from erfc (1 + erf would cancel in the negative tail).
        let reference: Vec<f64> = xs
            .iter()
            .map(|&x| {
                let x = x as f64;
                0.5 * x * candle_core::cpu::erf::erfc_f64(-x / std::f64::consts::SQRT_2)
            })
            .collect();
        let (mut worst_abs, mut worst_rel) = (0f64, 0f64);
        for ((&x, &a), &b) in xs.iter().zip(&ours).zip(&reference) {
            let d = (a as f64 - b).abs();
            worst_abs = worst_abs.max(d);
            // Relative down to x = -5 (GELU -1.4e-6). Further out `exp(p - z²)` inherits the
            // rounding of z², ~1.2e-7·z² relative, on values below 1.4e-6 (candle's f32
            // `0.5·x·(1 + erf)` loses all digits there to cancellation).
            if x >= -5.0 {
                worst_rel = worst_rel.max(d / b.abs().max(f64::MIN_POSITIVE));
            }
        }
        eprintln!("gelu: absolute {worst_abs:e}, relative {worst_rel:e}");
        assert!(worst_abs < 5e-7, "absolute {worst_abs:e}");
        assert!(worst_rel < 3e-6, "relative {worst_rel:e}");
        // Strided input is an error, not a panic.
        let m = Tensor::zeros((3, 4), DType::F32, cpu).unwrap().t().unwrap();
        assert!(m.apply_op1_no_bwd(&Gelu).is_err());
    }
}
