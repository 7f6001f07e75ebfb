//! The integration tests of `bertkit-records` on real data: one test binary (less linking and disk than one
//! per file), a module per subject.

mod google_compat;
mod reader;
mod records_parquet;
