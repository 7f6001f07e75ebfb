//! The integration tests of `bertkit-tasks` on real data: one test binary (less linking and disk than one
//! per file), a module per subject.

mod features;
mod fixtures_digests;
mod glue;
mod squad_eval;
mod squad_features;
mod squad_finetune;
mod squad_predictions;
mod squad_v2_eval;
mod training;
