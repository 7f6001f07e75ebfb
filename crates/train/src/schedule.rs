//! Learning-rate schedules.
//!
//! NVIDIA's `PolyWarmUpScheduler`: with `progress = step / total_steps`, the rate rises linearly
//! to `lr` over the first `warmup` share of the steps, then decays as
//! `lr · ((progress − 1) / (warmup − 1))^power` (power 0.5 in the BERT recipe) down to 0 at the
//! last step. `Linear` is the same with power 1 (transformers' linear schedule with warmup).

use serde::{Deserialize, Serialize};

use crate::TrainError;

/// The decay after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    /// Polynomial decay with `power`.
    Poly,
    /// Linear decay.
    Linear,
}

/// A warmup + decay schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Peak learning rate.
    pub lr: f64,
    /// Share of `total_steps` spent warming up, in [0, 1).
    pub warmup: f64,
    /// Steps of the whole schedule.
    pub total_steps: u64,
    /// The decay.
    #[serde(default = "default_decay")]
    pub decay: Decay,
    /// Power of the polynomial decay.
    #[serde(default = "default_power")]
    pub power: f64,
}

fn default_decay() -> Decay {
    Decay::Poly
}
fn default_power() -> f64 {
    0.5
}

impl Schedule {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), TrainError> {
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(TrainError::Config(format!(
                "[schedule] lr {} must be positive",
                self.lr
            )));
        }
        if !(0.0..1.0).contains(&self.warmup) {
            return Err(TrainError::Config(format!(
                "[schedule] warmup {} is a share of the steps, in [0, 1)",
                self.warmup
            )));
        }
        if self.total_steps == 0 {
            return Err(TrainError::Config(
                "[schedule] total_steps must be at least 1".into(),
            ));
        }
        // A power at or below 0 makes the "decay" hold or climb (at -2 the rate reaches
        // hundreds of times its peak by the end).
        if self.decay == Decay::Poly && !(self.power > 0.0 && self.power.is_finite()) {
            return Err(TrainError::Config(format!(
                "[schedule] power {} must be positive (0.5 in NVIDIA's recipes, 1 a linear decay)",
                self.power
            )));
        }
        Ok(())
    }

    /// The rate for optimiser step `step` (counting from 0).
    pub fn lr_at(&self, step: u64) -> f64 {
        let progress = step as f64 / self.total_steps as f64;
        if progress < self.warmup {
            return self.lr * progress / self.warmup;
        }
        let power = match self.decay {
            Decay::Poly => self.power,
            Decay::Linear => 1.0,
        };
        let remaining = ((progress - 1.0) / (self.warmup - 1.0)).max(0.0);
        self.lr * remaining.powf(power)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay() {
        let s = Schedule {
            lr: 6e-3,
            warmup: 0.2843,
            total_steps: 7038,
            decay: Decay::Poly,
            power: 0.5,
        };
        assert_eq!(s.lr_at(0), 0.0);
        let peak = (0.2843f64 * 7038.0).ceil() as u64;
        assert!((s.lr_at(1000) - 6e-3 * (1000.0 / 7038.0) / 0.2843).abs() < 1e-12);
        assert!(s.lr_at(peak) <= 6e-3 && s.lr_at(peak) > 5.99e-3);
        let p: f64 = 5000.0 / 7038.0;
        assert!((s.lr_at(5000) - 6e-3 * ((p - 1.0) / (0.2843 - 1.0)).sqrt()).abs() < 1e-12);
        assert_eq!(s.lr_at(7038), 0.0);
        let linear = Schedule {
            decay: Decay::Linear,
            warmup: 0.0,
            total_steps: 10,
            ..s
        };
        assert!((linear.lr_at(5) - 3e-3).abs() < 1e-12);
    }
}
