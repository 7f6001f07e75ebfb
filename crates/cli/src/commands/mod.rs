//! What each command does: runs its library with the parsed flags and prints the summary.

pub(crate) mod bench;
pub(crate) mod data;
pub(crate) mod model;
pub(crate) mod pipeline;
pub(crate) mod reference;
pub(crate) mod tasks;
pub(crate) mod train;

use std::rc::Rc;

use bertkit_stage_io::Ranks;
use bertkit_train::step::GradientReducer;

/// Runs `work` as this process's rank of the launcher's data-parallel world for a run on
/// `device` (one process: the local reducer). An error on one of several ranks is printed and
/// stops every rank, which would otherwise wait for this one in their next all-reduce.
pub(crate) fn as_rank<T>(
    ranks: Ranks,
    device: &str,
    work: impl FnOnce(Rc<dyn GradientReducer>) -> Result<T, Box<dyn std::error::Error>>,
) -> Result<T, Box<dyn std::error::Error>> {
    let reducer = bertkit_train::distributed::join(ranks, device)?;
    let result = work(reducer.clone());
    if let Err(e) = &result
        && ranks.world_size > 1
    {
        eprintln!("error: {ranks}: {e}; stopping every rank");
        reducer.abort(1);
    }
    result
}

/// The device a rank computes on: the reducer's (NCCL binds each rank to its GPU), else `name`.
pub(crate) fn rank_device(
    reducer: &dyn GradientReducer,
    name: &str,
) -> Result<candle_core::Device, bertkit_model::ModelError> {
    match reducer.device() {
        Some(device) => Ok(device),
        None => bertkit_model::parse_device(name),
    }
}
