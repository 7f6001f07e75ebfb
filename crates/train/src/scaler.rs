//! Dynamic loss scaling for fp16.
//!
//! fp16 gradients underflow unless the loss is multiplied by a large scale before backward
//! (and the gradients divided by it after). When any gradient is not finite the step is
//! skipped and the scale halved; after `growth_interval` good steps in a row it doubles. A run
//! whose steps keep overflowing is diverging, not unlucky: after `max_skipped_in_row` skipped
//! steps in a row the trainer stops with a message instead of spinning.

use serde::{Deserialize, Serialize};

use crate::TrainError;

/// The scaler's state (saved in checkpoints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// Current scale.
    pub scale: f64,
    /// Good steps since the last overflow.
    pub good_steps: u64,
    /// Double the scale after this many good steps.
    pub growth_interval: u64,
    /// Steps skipped in all.
    pub skipped: u64,
    /// Steps skipped in a row.
    pub skipped_in_row: u64,
    /// Stop after this many skipped steps in a row.
    pub max_skipped_in_row: u64,
}

impl LossScaler {
    /// Starting at `2^16`, doubling every 2000 good steps.
    pub fn new(max_skipped_in_row: u64) -> Self {
        LossScaler {
            scale: 65536.0,
            good_steps: 0,
            growth_interval: 2000,
            skipped: 0,
            skipped_in_row: 0,
            max_skipped_in_row,
        }
    }

    /// Records whether this step's gradients were finite; returns whether to apply the step.
    pub fn update(&mut self, finite: bool, step: u64) -> Result<bool, TrainError> {
        if finite {
            self.skipped_in_row = 0;
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale *= 2.0;
                self.good_steps = 0;
            }
            return Ok(true);
        }
        self.skipped += 1;
        self.skipped_in_row += 1;
        self.good_steps = 0;
        self.scale = (self.scale / 2.0).max(1.0);
        if self.skipped_in_row >= self.max_skipped_in_row {
            return Err(TrainError::Diverged(format!(
                "step {step}: {} steps in a row had non-finite fp16 gradients (loss scale down to \
                 {}); the run is diverging: lower the learning rate or use bf16",
                self.skipped_in_row, self.scale
            )));
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_halves_growth_doubles_and_a_streak_stops_the_run() {
        let mut s = LossScaler::new(3);
        s.growth_interval = 2;
        assert!(!s.update(false, 1).unwrap());
        assert_eq!((s.scale, s.skipped), (32768.0, 1));
        assert!(s.update(true, 2).unwrap());
        assert!(s.update(true, 3).unwrap());
        assert_eq!(s.scale, 65536.0);
        assert!(!s.update(false, 4).unwrap());
        assert!(!s.update(false, 5).unwrap());
        let err = s.update(false, 6).unwrap_err().to_string();
        assert!(
            err.contains("3 steps in a row") && err.contains("step 6"),
            "{err}"
        );
        assert_eq!(s.skipped, 4);
    }
}
