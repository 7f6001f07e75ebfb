//! The integration tests of Cross-crate hand-offs between the stages: one test binary (less linking and disk than one
//! per file), a module per subject.

mod format_handoff;
mod makefile;
