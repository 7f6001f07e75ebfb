//! A batch's inputs, checked on the host before they reach the device (on CUDA an
//! out-of-range index is a device-side assert that kills the context): token ids, token types,
//! the attention mask, and the masked-LM positions.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::packing::{Packing, RowIndex};
use crate::{BertConfig, ModelError};

/// Checked model inputs: where the tokens are and the embedding rows they read.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The tokens (the attention mask's 1s) laid end to end, as the encoder runs them.
    pub packing: Packing,
    /// The word embeddings' rows the tokens read (their ids, packed).
    pub(super) word_rows: RowIndex,
    /// The segment embeddings' rows the tokens read.
    pub(super) type_rows: RowIndex,
    /// The position embeddings' rows the tokens read (their columns).
    pub(super) position_rows: RowIndex,
}

/// Host-side row-major integers: every value below `limit`, or an error naming the first one
/// that is not by its row and position (`width` values per row).
fn check_below(
    values: &[u32],
    width: usize,
    limit: usize,
    name: &str,
    what: &str,
) -> Result<(), ModelError> {
    match values.iter().position(|&v| v as usize >= limit) {
        None => Ok(()),
        Some(i) => Err(ModelError::Input(format!(
            "{name} row {} position {} holds {}, outside 0..{limit} ({what})",
            i / width,
            i % width,
            values[i]
        ))),
    }
}

/// A tensor's integers on the host, for checking (`u8`, `u32` or `i64`; a value outside u32's
/// range is an error naming its place).
fn host_integers(t: &Tensor, name: &str) -> Result<Vec<u32>, ModelError> {
    let width = t.dims().last().copied().unwrap_or(1).max(1);
    let values: Vec<i64> = match t.dtype() {
        DType::U32 | DType::I64 | DType::U8 => t.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?,
        other => {
            return Err(ModelError::Input(format!(
                "{name} must hold integers (u32 or i64), not {other:?}"
            )));
        }
    };
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            u32::try_from(v).map_err(|_| {
                let why = if v < 0 {
                    "below 0"
                } else {
                    "above u32's range"
                };
                ModelError::Input(format!(
                    "{name} row {} position {} holds {v}, {why}",
                    i / width,
                    i % width
                ))
            })
        })
        .collect()
}

impl Inputs {
    /// Checks `[batch, seq]` inputs held on the host (row-major) against `config` and uploads
    /// them to `device`: ids below the vocabulary size, segments below `type_vocab_size`, a
    /// mask of 0s and 1s with at least one 1 per row, at most `max_position_embeddings`
    /// positions. `token_type_ids` defaults to zeros, `attention_mask` to ones. Every check
    /// runs here, before anything reaches the device: an out-of-range id on CUDA would be a
    /// device-side assert that kills the context, not an error.
    pub fn from_host(
        config: &BertConfig,
        (batch, seq): (usize, usize),
        input_ids: &[u32],
        token_type_ids: Option<&[u32]>,
        attention_mask: Option<&[u32]>,
        device: &Device,
    ) -> Result<Self, ModelError> {
        if seq > config.max_position_embeddings {
            return Err(ModelError::Input(format!(
                "sequence length {seq} exceeds max_position_embeddings {}",
                config.max_position_embeddings
            )));
        }
        if seq == 0 || batch == 0 {
            return Err(ModelError::Input("empty input_ids".into()));
        }
        for (name, values) in [
            ("input_ids", Some(input_ids)),
            ("token_type_ids", token_type_ids),
            ("attention_mask", attention_mask),
        ] {
            if let Some(values) = values
                && values.len() != batch * seq
            {
                return Err(ModelError::Input(format!(
                    "{name} holds {} values, [batch, seq] = [{batch}, {seq}] needs {}",
                    values.len(),
                    batch * seq
                )));
            }
        }
        check_below(input_ids, seq, config.vocab_size, "input_ids", "vocab_size")?;
        if let Some(types) = token_type_ids {
            check_below(
                types,
                seq,
                config.type_vocab_size,
                "token_type_ids",
                "type_vocab_size",
            )?;
        }
        if let Some(mask) = attention_mask {
            check_below(
                mask,
                seq,
                2,
                "attention_mask",
                "1 for a token, 0 for padding",
            )?;
            if let Some(row) = mask.chunks(seq).position(|row| !row.contains(&1)) {
                return Err(ModelError::Input(format!(
                    "attention_mask row {row} masks every position"
                )));
            }
        }
        let shape = (batch, seq);
        let packing = match attention_mask {
            Some(m) => Packing::from_mask(shape, m, device)?,
            None => Packing::from_mask(shape, &vec![1; batch * seq], device)?,
        };
        let word_rows = RowIndex::from_host(packing.pack_host(input_ids), device)?;
        let type_rows = match token_type_ids {
            Some(t) => RowIndex::from_host(packing.pack_host(t), device)?,
            None => RowIndex::from_host(vec![0; packing.tokens()], device)?,
        };
        Ok(Inputs {
            position_rows: packing.position_rows(),
            packing,
            word_rows,
            type_rows,
        })
    }

    /// As [`Inputs::from_host`], from `[batch, seq]` tensors of integers (`u32`, `i64`; a mask
    /// may also be a float tensor of 0s and 1s). The tensors are read back to the host to be
    /// checked: on a GPU, build inputs from host data with [`Inputs::from_host`] instead.
    pub fn new(
        config: &BertConfig,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<Self, ModelError> {
        let (batch, seq) = input_ids.dims2().map_err(|_| {
            ModelError::Input(format!(
                "input_ids must be [batch, seq], got shape {:?}",
                input_ids.dims()
            ))
        })?;
        for (name, t) in [
            ("token_type_ids", token_type_ids),
            ("attention_mask", attention_mask),
        ] {
            if let Some(t) = t
                && t.dims() != input_ids.dims()
            {
                return Err(ModelError::Input(format!(
                    "{name} has shape {:?}, input_ids has {:?}",
                    t.dims(),
                    input_ids.dims()
                )));
            }
        }
        let ids = host_integers(input_ids, "input_ids")?;
        let types = token_type_ids
            .map(|t| host_integers(t, "token_type_ids"))
            .transpose()?;
        let mask = match attention_mask {
            Some(m) if m.dtype().is_float() => {
                let values: Vec<f64> = m.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
                let integers = values
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| {
                        if v == 0.0 || v == 1.0 {
                            Ok(v as u32)
                        } else {
                            Err(ModelError::Input(format!(
                                "attention_mask row {} position {} holds {v}, not 0 or 1",
                                i / seq,
                                i % seq
                            )))
                        }
                    })
                    .collect::<Result<Vec<u32>, _>>()?;
                Some(integers)
            }
            Some(m) => Some(host_integers(m, "attention_mask")?),
            None => None,
        };
        Self::from_host(
            config,
            (batch, seq),
            &ids,
            types.as_deref(),
            mask.as_deref(),
            input_ids.device(),
        )
    }
}

/// Masked-LM prediction positions, `[batch, predictions]` u32, checked on the host to lie
/// inside the sequence (a position past it would be a device-side assert on CUDA).
#[derive(Debug, Clone)]
pub struct MaskedPositions {
    pub(super) positions: Tensor,
    /// The same on the host.
    pub(super) host: Arc<Vec<u32>>,
    /// The sequence length the positions were checked against.
    pub(super) seq: usize,
}

impl MaskedPositions {
    /// Checks `positions` (row-major `[batch, predictions]`) against the sequence length `seq`
    /// and uploads them.
    pub fn from_host(
        (batch, predictions): (usize, usize),
        positions: &[u32],
        seq: usize,
        device: &Device,
    ) -> Result<Self, ModelError> {
        if positions.len() != batch * predictions {
            return Err(ModelError::Input(format!(
                "masked positions hold {} values, [batch, predictions] = [{batch}, {predictions}] needs {}",
                positions.len(),
                batch * predictions
            )));
        }
        check_below(
            positions,
            predictions.max(1),
            seq,
            "masked positions",
            "the sequence length",
        )?;
        Ok(MaskedPositions {
            positions: Tensor::from_slice(positions, (batch, predictions), device)?,
            host: Arc::new(positions.to_vec()),
            seq,
        })
    }

    /// The positions, `[batch, predictions]`.
    pub fn tensor(&self) -> &Tensor {
        &self.positions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An i64 id below 0 or beyond u32's range, and a mask value other than 0 and 1, are errors
    /// naming the tensor, the row, the position and the value.
    #[test]
    fn out_of_range_integers_are_named() {
        let config = BertConfig::tiny(30);
        let device = Device::Cpu;
        let ids = |v: i64| Tensor::new(&[[1i64, v]], &device).unwrap();
        let err = Inputs::new(&config, &ids(-3), None, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("input_ids row 0 position 1 holds -3, below 0"),
            "{err}"
        );
        let big = (1i64 << 32) + 5;
        let err = Inputs::new(&config, &ids(big), None, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!(
                "input_ids row 0 position 1 holds {big}, above u32's range"
            )),
            "{err}"
        );
        let mask = Tensor::new(&[[1i64, 7]], &device).unwrap();
        let err = Inputs::new(&config, &ids(2), None, Some(&mask))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("attention_mask row 0 position 1 holds 7"),
            "{err}"
        );
    }
}
