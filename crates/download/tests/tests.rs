//! The integration tests of `bertkit-download` on real data: one test binary (less linking and disk than one
//! per file), a module per subject.

mod http;
mod sources;
mod url_list;
