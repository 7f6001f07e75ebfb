//! The integration tests of `bertkit-model` on real data: one test binary (less linking and disk than one
//! per file), a module per subject.

mod google_checkpoint;
mod gradients;
mod heads;
mod minilm_forward;
mod tape;
mod weights;
