//! GLUE: task files, metrics and fine-tuning.

pub mod data;
pub mod finetune;
pub mod metrics;
