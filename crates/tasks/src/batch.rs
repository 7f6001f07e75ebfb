//! Padding encoded sequences into model inputs.

use bertkit_model::{BertConfig, Inputs};
use candle_core::{Device, Tensor};

use crate::TaskError;

/// Pads `(ids, segments)` pairs to the longest with id 0, segment 0 and attention mask 0, and
/// returns the checked inputs and the `[batch, longest]` attention mask (1 = token).
pub fn pad(
    sequences: &[(&[u32], &[u32])],
    config: &BertConfig,
    device: &Device,
) -> Result<(Inputs, Tensor), TaskError> {
    let longest = sequences.iter().map(|(i, _)| i.len()).max().unwrap_or(1);
    let rows = sequences.len();
    let (mut ids, mut segs, mut mask) = (
        Vec::with_capacity(rows * longest),
        Vec::with_capacity(rows * longest),
        Vec::with_capacity(rows * longest),
    );
    for (i, s) in sequences {
        let padding = longest - i.len();
        ids.extend(i.iter().copied().chain(std::iter::repeat_n(0, padding)));
        segs.extend(s.iter().copied().chain(std::iter::repeat_n(0, padding)));
        mask.extend(std::iter::repeat_n(1u32, i.len()).chain(std::iter::repeat_n(0, padding)));
    }
    let inputs = Inputs::from_host(
        config,
        (rows, longest),
        &ids,
        Some(&segs),
        Some(&mask),
        device,
    )?;
    Ok((inputs, Tensor::from_vec(mask, (rows, longest), device)?))
}
