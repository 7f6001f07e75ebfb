//! What each command does: runs its library with the parsed flags and prints the summary.

pub(crate) mod data;
pub(crate) mod pipeline;
pub(crate) mod tasks;
pub(crate) mod train;
