//! The integration tests of `bertkit-format` on real data: one test binary (less linking and disk than one
//! per file), a module per subject.

mod books_real;
mod wiki_real_dump;
