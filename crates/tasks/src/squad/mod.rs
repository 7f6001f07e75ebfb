//! SQuAD: the data format, features, post-processing, fine-tuning and the official
//! evaluations.

pub mod data;
pub mod eval;
pub mod eval_v2;
pub mod features;
pub mod finetune;
pub mod postprocess;
