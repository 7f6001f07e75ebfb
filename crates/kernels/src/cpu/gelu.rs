//! GELU in both forms, and its backward.

use super::*;
use crate::host::{ELEMENTWISE_CHUNK, contiguous, same_shape};
use crate::vectorised;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::Gelu;
// ---------------------------------------------------------------------------------------------
// GELU.

/// GELU in either form, elementwise on f32 (any shape, contiguous).
pub(crate) struct GeluOp {
    pub(crate) form: Gelu,
}

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "bertkit-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(self.name(), "input", storage, layout)?;
        Ok((
            CpuStorage::F32(gelu_all(x, self.form)),
            layout.shape().clone(),
        ))
    }

    fn bwd(&self, x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        crate::profiled_backward("gelu", grad.device(), || {
            let backward = GeluBackward { form: self.form };
            Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &backward)?))
        })
    }
}

/// GELU's backward: `g · GELU'(x)`.
struct GeluBackward {
    form: Gelu,
}

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "bertkit-gelu-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        same_shape(op, x_layout, grad_layout)?;
        let x = contiguous(op, "input", x, x_layout)?;
        let grad = contiguous(op, "gradient", grad, grad_layout)?;
        Ok((
            CpuStorage::F32(gelu_backward_all(x, grad, self.form)),
            x_layout.shape().clone(),
        ))
    }
}

/// GELU of every element of `x`, in parallel chunks.
pub(super) fn gelu_all(x: &[f32], form: Gelu) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(x.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(out, x)| match form {
            Gelu::Erf => gelu_chunk(x, out),
            Gelu::Tanh => gelu_tanh_chunk(x, out),
        });
    out
}

/// GELU of every element of `x`, in place, in parallel chunks.
pub(super) fn gelu_in_place(x: &mut [f32], form: Gelu) {
    x.par_chunks_mut(ELEMENTWISE_CHUNK)
        .for_each(|x| match form {
            Gelu::Erf => gelu_chunk_in_place(x),
            Gelu::Tanh => gelu_tanh_chunk_in_place(x),
        });
}

/// GELU's backward for every element, `g · GELU'(x)`, in parallel chunks.
pub(super) fn gelu_backward_all(x: &[f32], g: &[f32], form: Gelu) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(
            x.par_chunks(ELEMENTWISE_CHUNK)
                .zip(g.par_chunks(ELEMENTWISE_CHUNK)),
        )
        .for_each(|(out, (x, g))| match form {
            Gelu::Erf => gelu_backward_chunk(x, g, out),
            Gelu::Tanh => gelu_tanh_backward_chunk(x, g, out),
        });
    out
}

vectorised! {
    /// The tanh GELU over a chunk.
    fn gelu_tanh_chunk(x: &[f32], out: &mut [f32]) = gelu_tanh_chunk_portable
}

#[inline(always)]
fn gelu_tanh_chunk_portable(x: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o = x * tanh_gelu_gate(x).0;
    }
}

vectorised! {
    /// The tanh GELU over a chunk, in place.
    fn gelu_tanh_chunk_in_place(x: &mut [f32]) = gelu_tanh_chunk_in_place_portable
}

#[inline(always)]
fn gelu_tanh_chunk_in_place_portable(x: &mut [f32]) {
    for x in x.iter_mut() {
        *x *= tanh_gelu_gate(*x).0;
    }
}

vectorised! {
    /// The tanh GELU's backward over a chunk.
    fn gelu_tanh_backward_chunk(x: &[f32], g: &[f32], out: &mut [f32]) = gelu_tanh_backward_chunk_portable
}

#[inline(always)]
fn gelu_tanh_backward_chunk_portable(x: &[f32], g: &[f32], out: &mut [f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const CUBIC: f32 = 0.044_715;
    for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
        let (gate, e) = tanh_gelu_gate(x);
        // gate = σ(2u), so gate' = 2u' · gate · (1 - gate), and 1 - gate = e · gate.
        let du = SQRT_2_OVER_PI * (3.0 * CUBIC * x).mul_add(x, 1.0);
        *o = g * (2.0 * x * du * (e * gate) * gate + gate);
    }
}

/// The tanh GELU's gate, `(1 + tanh(u)) / 2` with `u = √(2/π) · (x + 0.044715 x³)`, written as
/// the logistic `1 / (1 + e^(-2u))` so that both tails keep their relative precision (`1 + tanh`
/// would cancel for negative `x`); also returns `e^(-2u)` for the backward.
#[inline(always)]
fn tanh_gelu_gate(x: f32) -> (f32, f32) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const CUBIC: f32 = 0.044_715;
    let u = SQRT_2_OVER_PI * (CUBIC * x * x).mul_add(x, x);
    let e = exp(-2.0 * u);
    (1.0 / (1.0 + e), e)
}

vectorised! {
    /// GELU over a chunk.
    fn gelu_chunk(x: &[f32], out: &mut [f32]) = gelu_chunk_portable
}

#[inline(always)]
fn gelu_chunk_portable(x: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o = gelu(x);
    }
}

/// The exact GELU, `x · Φ(x)`.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    x * 0.5 * twice_phi(x)
}

vectorised! {
    /// GELU over a chunk, in place.
    fn gelu_chunk_in_place(x: &mut [f32]) = gelu_chunk_in_place_portable
}

#[inline(always)]
fn gelu_chunk_in_place_portable(x: &mut [f32]) {
    for x in x.iter_mut() {
        *x = gelu(*x);
    }
}

vectorised! {
    /// GELU's backward over a chunk.
    fn gelu_backward_chunk(x: &[f32], g: &[f32], out: &mut [f32]) = gelu_backward_chunk_portable
}

#[inline(always)]
fn gelu_backward_chunk_portable(x: &[f32], g: &[f32], out: &mut [f32]) {
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
        let density = FRAC_1_SQRT_2PI * exp(-0.5 * x * x);
        *o = g * (0.5 * twice_phi(x) + x * density);
    }
}

/// `2 Φ(x)` with `Φ(x) = erfc(-x/√2) / 2`, and `erfc` from the Chebyshev fit in Numerical
/// Recipes (`erfcc`: relative error below 1.2e-7 for every argument), so the negative tail,
/// where `Φ` is tiny, keeps its relative precision too.
#[inline(always)]
fn twice_phi(x: f32) -> f32 {
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = 0.170_872_77_f32;
    p = p.mul_add(t, -0.822_152_23);
    p = p.mul_add(t, 1.488_515_9);
    p = p.mul_add(t, -1.135_204);
    p = p.mul_add(t, 0.278_868_07);
    p = p.mul_add(t, -0.186_288_06);
    p = p.mul_add(t, 0.096_784_18);
    p = p.mul_add(t, 0.374_091_96);
    p = p.mul_add(t, 1.000_023_7);
    p = p.mul_add(t, -1.265_512_2);
    let erfc = t * exp((-z).mul_add(z, p));
    if x < 0.0 { erfc } else { 2.0 - erfc }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn tanh_gelu_and_its_backward_to_f32_precision() {
        let cpu = &Device::Cpu;
        let xs: Vec<f32> = (0..=40_000).map(|i| -20.0 + i as f32 * 0.001).collect();
        let x = Tensor::new(xs.as_slice(), cpu).unwrap();
        let op = GeluOp { form: Gelu::Tanh };
        let ours = x.apply_op1_no_bwd(&op).unwrap().to_vec1::<f32>().unwrap();
        let ones = Tensor::ones(xs.len(), DType::F32, cpu).unwrap();
        let slopes = x
            .apply_op2_no_bwd(&ones, &GeluBackward { form: Gelu::Tanh })
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let (mut worst, mut worst_slope) = (0f64, 0f64);
        for ((&x, &y), &dy) in xs.iter().zip(&ours).zip(&slopes) {
            let x = x as f64;
            let u = c * (x + 0.044715 * x.powi(3));
            // The gate as a logistic keeps the negative tail's relative precision.
            let gate = 1.0 / (1.0 + (-2.0 * u).exp());
            let want = x * gate;
            let slope = gate + x * 2.0 * gate * (1.0 - gate) * c * (1.0 + 3.0 * 0.044715 * x * x);
            worst = worst.max((y as f64 - want).abs() / want.abs().max(1e-6));
            // Absolute: the slope crosses zero near x = -0.75.
            worst_slope = worst_slope.max((dy as f64 - slope).abs());
        }
        eprintln!("tanh gelu: relative {worst:e}, slope absolute {worst_slope:e}");
        assert!(worst < 3e-6, "relative {worst:e}");
        assert!(worst_slope < 1e-6, "slope {worst_slope:e}");
    }

    #[test]
    fn gelu_is_the_exact_gelu_to_f32_precision() {
        let cpu = &Device::Cpu;
        let xs: Vec<f32> = (0..=40_000).map(|i| -20.0 + i as f32 * 0.001).collect();
        let ours = Tensor::new(xs.as_slice(), cpu)
            .unwrap()
            .apply_op1_no_bwd(&GeluOp { form: Gelu::Erf })
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
        assert!(m.apply_op1_no_bwd(&GeluOp { form: Gelu::Erf }).is_err());
    }
}
