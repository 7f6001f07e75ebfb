//! Optimisers with f32 master weights: LAMB (NVIDIA's BERT recipe) and AdamW (fine-tuning).
//!
//! Whatever the compute dtype of the model, the optimiser keeps an f32 (or f64, in f64 runs)
//! master copy of every parameter and its two moments; after each step the model's parameters
//! are overwritten with the master weights cast to the compute dtype.
//!
//! Both optimisers, per step:
//! 1. the global gradient norm over all parameters; gradients scaled by
//!    `1 / max(1, norm / max_grad_norm)` (clipping before the moment updates, as NVIDIA's LAMB);
//! 2. `m = β1·m + (1-β1)·g`, `v = β2·v + (1-β2)·g²`, bias-corrected `m̂ = m / (1-β1ᵗ)`,
//!    `v̂ = v / (1-β2ᵗ)`;
//! 3. `u = m̂ / (√v̂ + ε) + λ·w`, with weight decay `λ` 0 for biases and LayerNorm parameters;
//! 4. AdamW: `w -= lr·u`. LAMB: `w -= lr·r·u` with the trust ratio `r = ‖w‖ / ‖u‖` (1 when either
//!    norm is 0) for parameters with weight decay, and `r = 1` for the excluded ones, as apex's
//!    FusedLAMB does by default (NVIDIA's BERT scripts).

use std::collections::BTreeMap;

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::TrainError;

/// Which update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rule {
    /// Layer-wise adaptive moments (pre-training).
    Lamb,
    /// Adam with decoupled weight decay (fine-tuning).
    Adamw,
}

/// Optimiser hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// The rule.
    pub rule: Rule,
    /// β1.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// β2.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// ε.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay (not applied to biases and LayerNorm).
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Global gradient-norm clipping (0 = none).
    #[serde(default = "default_max_grad_norm")]
    pub max_grad_norm: f64,
}

fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-6
}
fn default_weight_decay() -> f64 {
    0.01
}
fn default_max_grad_norm() -> f64 {
    1.0
}

impl OptimizerConfig {
    /// NVIDIA's LAMB settings.
    pub fn lamb() -> Self {
        OptimizerConfig {
            rule: Rule::Lamb,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
        }
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(format!("[optimizer] {m}")));
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return bad(format!(
                "beta1 {} and beta2 {} must be in [0, 1)",
                self.beta1, self.beta2
            ));
        }
        if self.eps <= 0.0 || self.weight_decay < 0.0 || self.max_grad_norm < 0.0 {
            return bad("eps must be positive, weight_decay and max_grad_norm not negative".into());
        }
        Ok(())
    }
}

/// Whether weight decay applies to a parameter (not to biases and LayerNorm).
pub fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.contains("LayerNorm") || name.ends_with("predictions.bias"))
}

/// One parameter's optimiser state.
#[derive(Debug)]
struct Slot {
    var: Var,
    master: Tensor,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
}

/// The optimiser over a model's parameters.
#[derive(Debug)]
pub struct Optimizer {
    config: OptimizerConfig,
    slots: BTreeMap<String, Slot>,
    step: u64,
    master_dtype: DType,
}

impl Optimizer {
    /// State for `vars`; master weights and moments in f32 (f64 if the model is f64).
    pub fn new(config: OptimizerConfig, vars: &BTreeMap<String, Var>) -> Result<Self, TrainError> {
        config.validate()?;
        let master_dtype = match vars.values().next().map(|v| v.dtype()) {
            Some(DType::F64) => DType::F64,
            _ => DType::F32,
        };
        let mut slots = BTreeMap::new();
        for (name, var) in vars {
            let master = var.as_tensor().detach().to_dtype(master_dtype)?.copy()?;
            slots.insert(
                name.clone(),
                Slot {
                    var: var.clone(),
                    m: master.zeros_like()?,
                    v: master.zeros_like()?,
                    master,
                    decay: decays(name),
                },
            );
        }
        Ok(Optimizer {
            config,
            slots,
            step: 0,
            master_dtype,
        })
    }

    /// Optimiser steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The dtype of master weights, moments and gradient accumulators.
    pub fn master_dtype(&self) -> DType {
        self.master_dtype
    }

    /// The global L2 norm of `grads`.
    pub fn global_norm(grads: &BTreeMap<String, Tensor>) -> Result<f64, TrainError> {
        let mut sum = 0f64;
        for g in grads.values() {
            sum += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        Ok(sum.sqrt())
    }

    /// One step with learning rate `lr` on `grads` (by parameter name, any dtype; parameters
    /// without a gradient are left alone).
    pub fn step(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
    ) -> Result<StepStats, TrainError> {
        let c = &self.config;
        let grad_norm = Self::global_norm(grads)?;
        let clip = if c.max_grad_norm > 0.0 && grad_norm > c.max_grad_norm {
            c.max_grad_norm / grad_norm
        } else {
            1.0
        };
        self.step += 1;
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
        for (name, slot) in self.slots.iter_mut() {
            let Some(g) = grads.get(name) else { continue };
            let g = (g.to_dtype(self.master_dtype)? * clip)?;
            slot.m = ((&slot.m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            slot.v = ((&slot.v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let m_hat = (&slot.m / bc1)?;
            let v_hat = (&slot.v / bc2)?;
            let mut update = m_hat.div(&(v_hat.sqrt()? + c.eps)?)?;
            let decay = if slot.decay { c.weight_decay } else { 0.0 };
            if decay > 0.0 {
                update = (update + (&slot.master * decay)?)?;
            }
            let ratio = match c.rule {
                Rule::Adamw => 1.0,
                Rule::Lamb if decay > 0.0 => {
                    let w_norm = slot
                        .master
                        .to_dtype(DType::F64)?
                        .sqr()?
                        .sum_all()?
                        .to_scalar::<f64>()?
                        .sqrt();
                    let u_norm = update
                        .to_dtype(DType::F64)?
                        .sqr()?
                        .sum_all()?
                        .to_scalar::<f64>()?
                        .sqrt();
                    if w_norm > 0.0 && u_norm > 0.0 {
                        w_norm / u_norm
                    } else {
                        1.0
                    }
                }
                Rule::Lamb => 1.0,
            };
            slot.master = (&slot.master - (update * (lr * ratio))?)?;
            slot.var.set(&slot.master.to_dtype(slot.var.dtype())?)?;
        }
        Ok(StepStats { grad_norm })
    }

    /// The moments by name, for checkpoints: `m.<name>`, `v.<name>` (on the CPU).
    pub fn moment_tensors(&self) -> Result<std::collections::HashMap<String, Tensor>, TrainError> {
        let mut out = std::collections::HashMap::new();
        for (name, s) in &self.slots {
            out.insert(
                format!("m.{name}"),
                s.m.to_device(&candle_core::Device::Cpu)?,
            );
            out.insert(
                format!("v.{name}"),
                s.v.to_device(&candle_core::Device::Cpu)?,
            );
        }
        Ok(out)
    }

    /// The master weights by parameter name (on the CPU): what a checkpoint's model file holds.
    pub fn master_tensors(&self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        self.slots
            .iter()
            .map(|(name, s)| Ok((name.clone(), s.master.to_device(&candle_core::Device::Cpu)?)))
            .collect()
    }

    /// Restores the moments (`m.<name>`, `v.<name>`), the master weights (by parameter name;
    /// the model's parameters are set from them) and the step count.
    pub fn restore(
        &mut self,
        moments: &std::collections::HashMap<String, Tensor>,
        masters: &std::collections::HashMap<String, Tensor>,
        step: u64,
    ) -> Result<(), TrainError> {
        for (name, s) in self.slots.iter_mut() {
            let get = |map: &std::collections::HashMap<String, Tensor>,
                       key: String|
             -> Result<Tensor, TrainError> {
                let t = map.get(&key).ok_or_else(|| {
                    TrainError::Checkpoint(format!("the checkpoint has no {key}"))
                })?;
                if t.dims() != s.master.dims() {
                    return Err(TrainError::Checkpoint(format!(
                        "{key} has shape {:?}, the model needs {:?}",
                        t.dims(),
                        s.master.dims()
                    )));
                }
                Ok(t.to_dtype(self.master_dtype)?
                    .to_device(s.master.device())?)
            };
            s.m = get(moments, format!("m.{name}"))?;
            s.v = get(moments, format!("v.{name}"))?;
            s.master = get(masters, name.clone())?;
            s.var.set(&s.master.to_dtype(s.var.dtype())?)?;
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn vars() -> BTreeMap<String, Var> {
        let mut v = BTreeMap::new();
        v.insert(
            "layer.weight".to_string(),
            Var::from_tensor(&Tensor::new(&[0.5f64, -1.0, 2.0], &Device::Cpu).unwrap()).unwrap(),
        );
        v.insert(
            "layer.bias".to_string(),
            Var::from_tensor(&Tensor::new(&[0.1f64, 0.2], &Device::Cpu).unwrap()).unwrap(),
        );
        v
    }

    fn grads(scale: f64) -> BTreeMap<String, Tensor> {
        let mut g = BTreeMap::new();
        g.insert(
            "layer.weight".to_string(),
            Tensor::new(&[0.3f64 * scale, -0.4 * scale, 1.2 * scale], &Device::Cpu).unwrap(),
        );
        g.insert(
            "layer.bias".to_string(),
            Tensor::new(&[0.5f64 * scale, -0.1 * scale], &Device::Cpu).unwrap(),
        );
        g
    }

    fn values(v: &Var) -> Vec<f64> {
        v.as_tensor().to_vec1().unwrap()
    }

    /// The rule written out by hand for one step from zero moments.
    fn expected(rule: Rule, w: &[f64], g: &[f64], clip: f64, decay: f64, lr: f64) -> Vec<f64> {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-6);
        let u: Vec<f64> = w
            .iter()
            .zip(g)
            .map(|(&w, &g)| {
                let g = g * clip;
                let m_hat = (1.0 - b1) * g / (1.0 - b1);
                let v_hat = (1.0 - b2) * g * g / (1.0 - b2);
                m_hat / (v_hat.sqrt() + eps) + decay * w
            })
            .collect();
        let ratio = if rule == Rule::Lamb && decay > 0.0 {
            let wn = w.iter().map(|x| x * x).sum::<f64>().sqrt();
            let un = u.iter().map(|x| x * x).sum::<f64>().sqrt();
            wn / un
        } else {
            1.0
        };
        w.iter().zip(&u).map(|(w, u)| w - lr * ratio * u).collect()
    }

    #[test]
    fn one_lamb_and_one_adamw_step_by_hand() {
        for rule in [Rule::Lamb, Rule::Adamw] {
            for scale in [1.0, 10.0] {
                let v = vars();
                let config = OptimizerConfig {
                    rule,
                    ..OptimizerConfig::lamb()
                };
                let mut opt = Optimizer::new(config, &v).unwrap();
                let g = grads(scale);
                let stats = opt.step(&g, 0.01).unwrap();
                let norm = (0.09f64 + 0.16 + 1.44 + 0.25 + 0.01).sqrt() * scale;
                assert!((stats.grad_norm - norm).abs() < 1e-12);
                let clip = if norm > 1.0 { 1.0 / norm } else { 1.0 };
                let w = expected(
                    rule,
                    &[0.5, -1.0, 2.0],
                    &[0.3 * scale, -0.4 * scale, 1.2 * scale],
                    clip,
                    0.01,
                    0.01,
                );
                let b = expected(
                    rule,
                    &[0.1, 0.2],
                    &[0.5 * scale, -0.1 * scale],
                    clip,
                    0.0,
                    0.01,
                );
                for (got, want) in values(&v["layer.weight"]).iter().zip(&w) {
                    assert!(
                        (got - want).abs() < 1e-12,
                        "{rule:?} weight {got} vs {want}"
                    );
                }
                for (got, want) in values(&v["layer.bias"]).iter().zip(&b) {
                    assert!((got - want).abs() < 1e-12, "{rule:?} bias {got} vs {want}");
                }
            }
        }
    }

    /// Both rules written out by hand with their moments, over several steps: gradients that
    /// change sign and size (some steps clipped, some not) and a learning rate that changes.
    /// (Tried: bias correction stuck at step 1 passes the one-step test and fails here.)
    #[test]
    fn lamb_and_adamw_over_several_steps_by_hand() {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-6);
        let gradient = |step: usize, base: &[f64]| -> Vec<f64> {
            let scale = [2.0, -0.3, 0.7, -1.5, 0.05, 3.0][step];
            base.iter().map(|g| g * scale).collect()
        };
        let base_w = [0.3, -0.4, 1.2];
        let base_b = [0.5, -0.1];
        for rule in [Rule::Lamb, Rule::Adamw] {
            let v = vars();
            let config = OptimizerConfig {
                rule,
                ..OptimizerConfig::lamb()
            };
            let mut opt = Optimizer::new(config, &v).unwrap();
            // The reference: (weights, m, v, decay) per parameter.
            let mut reference = [
                (vec![0.5, -1.0, 2.0], vec![0.0; 3], vec![0.0; 3], 0.01),
                (vec![0.1, 0.2], vec![0.0; 2], vec![0.0; 2], 0.0),
            ];
            for step in 0..6 {
                let (gw, gb) = (gradient(step, &base_w), gradient(step, &base_b));
                let mut g = BTreeMap::new();
                g.insert(
                    "layer.weight".to_string(),
                    Tensor::new(gw.as_slice(), &Device::Cpu).unwrap(),
                );
                g.insert(
                    "layer.bias".to_string(),
                    Tensor::new(gb.as_slice(), &Device::Cpu).unwrap(),
                );
                let lr = 0.01 * (step + 1) as f64 / 3.0;
                opt.step(&g, lr).unwrap();

                let norm = gw.iter().chain(&gb).map(|x| x * x).sum::<f64>().sqrt();
                let clip = if norm > 1.0 { 1.0 / norm } else { 1.0 };
                let t = (step + 1) as i32;
                for ((w, m, vv, decay), grad) in reference.iter_mut().zip([&gw, &gb]) {
                    let mut u = Vec::new();
                    for i in 0..w.len() {
                        let g = grad[i] * clip;
                        m[i] = b1 * m[i] + (1.0 - b1) * g;
                        vv[i] = b2 * vv[i] + (1.0 - b2) * g * g;
                        let m_hat = m[i] / (1.0 - b1.powi(t));
                        let v_hat = vv[i] / (1.0 - b2.powi(t));
                        u.push(m_hat / (v_hat.sqrt() + eps) + *decay * w[i]);
                    }
                    let ratio = if rule == Rule::Lamb && *decay > 0.0 {
                        let wn = w.iter().map(|x| x * x).sum::<f64>().sqrt();
                        let un = u.iter().map(|x| x * x).sum::<f64>().sqrt();
                        wn / un
                    } else {
                        1.0
                    };
                    for i in 0..w.len() {
                        w[i] -= lr * ratio * u[i];
                    }
                }
                for (name, (want, ..)) in ["layer.weight", "layer.bias"].iter().zip(&reference) {
                    for (got, want) in values(&v[*name]).iter().zip(want) {
                        assert!(
                            (got - want).abs() < 1e-12,
                            "{rule:?} step {} {name}: {got} vs {want}",
                            step + 1
                        );
                    }
                }
            }
            assert_eq!(opt.steps(), 6);
        }
    }

    #[test]
    fn weight_decay_skips_biases_and_layer_norm() {
        assert!(decays("encoder.layer.0.attention.self.query.weight"));
        assert!(!decays("encoder.layer.0.attention.self.query.bias"));
        assert!(!decays("embeddings.LayerNorm.weight"));
        assert!(!decays("cls.predictions.bias"));
        assert!(decays("embeddings.word_embeddings.weight"));
    }
}
