//! One training instance: owned ([`TrainingInstance`]) or borrowed from the columns
//! ([`InstanceRef`]), with the reference script's JSON fields.

use serde::{Deserialize, Serialize};

use bertkit_tokenizer::FullTokenizer;

/// One training instance, as the reference script's `TrainingInstance`, in vocabulary ids
/// (owned; runs keep instances in [`super::InstanceColumns`] and hand out [`InstanceRef`]s).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingInstance {
    /// `[CLS] A [SEP] B [SEP]`, after masking.
    pub input_ids: Vec<u32>,
    /// Tokens of segment 0 (`[CLS]`, A and the first `[SEP]`); the rest are segment 1.
    pub first_segment_len: usize,
    /// Whether B came from another document.
    pub is_random_next: bool,
    /// Masked positions, ascending.
    pub masked_lm_positions: Vec<u32>,
    /// The original ids at those positions.
    pub masked_lm_ids: Vec<u32>,
}

impl TrainingInstance {
    /// The instance borrowed as an [`InstanceRef`].
    pub fn as_ref(&self) -> InstanceRef<'_> {
        InstanceRef {
            input_ids: &self.input_ids,
            first_segment_len: self.first_segment_len,
            is_random_next: self.is_random_next,
            masked_lm_positions: &self.masked_lm_positions,
            masked_lm_ids: &self.masked_lm_ids,
        }
    }
}

/// One training instance, borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceRef<'a> {
    /// `[CLS] A [SEP] B [SEP]`, after masking.
    pub input_ids: &'a [u32],
    /// Tokens of segment 0 (`[CLS]`, A and the first `[SEP]`); the rest are segment 1.
    pub first_segment_len: usize,
    /// Whether B came from another document.
    pub is_random_next: bool,
    /// Masked positions, ascending.
    pub masked_lm_positions: &'a [u32],
    /// The original ids at those positions.
    pub masked_lm_ids: &'a [u32],
}

impl InstanceRef<'_> {
    /// Segment ids: 0 for the first segment, 1 for the rest.
    pub fn segment_ids(&self) -> Vec<u8> {
        let len = self.input_ids.len();
        let mut ids = vec![0u8; len];
        ids[self.first_segment_len.min(len)..].fill(1);
        ids
    }

    /// An owned copy.
    pub fn to_owned(&self) -> TrainingInstance {
        TrainingInstance {
            input_ids: self.input_ids.to_vec(),
            first_segment_len: self.first_segment_len,
            is_random_next: self.is_random_next,
            masked_lm_positions: self.masked_lm_positions.to_vec(),
            masked_lm_ids: self.masked_lm_ids.to_vec(),
        }
    }

    /// The instance with tokens, in the reference script's JSON fields (`tokens`,
    /// `segment_ids`, `is_random_next`, `masked_lm_positions`, `masked_lm_labels`).
    pub fn to_reference_json(&self, tokenizer: &FullTokenizer) -> serde_json::Value {
        let tokens = |ids: &[u32]| -> Vec<&str> {
            ids.iter()
                .map(|&i| tokenizer.id_to_token(i).unwrap_or("[UNK]"))
                .collect()
        };
        serde_json::json!({
            "tokens": tokens(self.input_ids),
            "segment_ids": self.segment_ids(),
            "is_random_next": self.is_random_next,
            "masked_lm_positions": self.masked_lm_positions,
            "masked_lm_labels": tokens(self.masked_lm_ids),
        })
    }
}
