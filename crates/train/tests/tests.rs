//! The integration tests of `bertkit-train` on real data: one test binary (less linking and disk than one
//! per file), a module per subject.

mod host_reads;
mod loader;
mod pretrain;
mod trajectory;
