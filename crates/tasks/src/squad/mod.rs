//! SQuAD: the data format and the official evaluation.

pub mod data;
pub mod eval;
