//! The integration tests of The `bertkit` binary end to end: one test binary (less linking and disk than one
//! per file), a module per subject.

mod bad_input;
mod bad_input_model;
mod chain;
mod cli;
mod commands;
mod damaged_checkpoints;
mod disk_full;
#[cfg(feature = "mpi")]
mod distributed;
mod evaluate;
mod forward;
mod kills;
mod memory;
mod pipeline;
mod pretrain;
mod settings;
mod util;
