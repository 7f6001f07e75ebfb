//! The integration tests of `bertkit-tokenizer` on real data: one test binary (less linking and disk than one
//! per file), a module per subject.

mod vocab_train;
mod wordpiece_reference;
