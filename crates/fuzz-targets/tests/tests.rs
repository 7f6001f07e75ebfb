//! The integration tests of `bertkit-fuzz-targets`: one test binary, a module per subject.

mod replay;
