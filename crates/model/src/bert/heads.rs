//! The heads over the encoder: pre-training (masked LM and next sentence), question answering
//! and sequence classification, each a [`BertArchitecture`].

use candle_core::{IndexOp, Tensor};

use super::*;

/// What the pre-training heads compute.
#[derive(Debug, Clone)]
pub struct PreTrainingOutput {
    /// Masked-LM logits at the asked positions, `[batch, predictions, vocab]`.
    pub mlm_logits: Tensor,
    /// Next-sentence logits (0 = is next, 1 = random), `[batch, 2]`.
    pub nsp_logits: Tensor,
}

/// BERT with the masked-LM and next-sentence heads (transformers' `BertForPreTraining`).
#[derive(Debug, Clone)]
pub struct BertForPreTraining {
    /// The encoder.
    pub bert: BertModel,
    transform: Linear,
    transform_norm: LayerNorm,
    output_bias: Tensor,
    seq_relationship: Linear,
}

impl BertArchitecture for BertForPreTraining {
    const ARCHITECTURE: &'static str = "BertForPreTraining";
    fn build(c: &BertConfig, p: &mut ParamBuilder) -> Result<Self, ModelError> {
        let bert = BertModel::build(c, p, true)?;
        let h = c.hidden_size;
        Ok(BertForPreTraining {
            bert,
            transform: Linear::build(p, "cls.predictions.transform.dense", h, h)?,
            transform_norm: LayerNorm::build(
                p,
                "cls.predictions.transform.LayerNorm",
                h,
                c.layer_norm_eps,
            )?,
            output_bias: p.get("cls.predictions.bias", &[c.vocab_size], Init::Zeros)?,
            seq_relationship: Linear::build(p, "cls.seq_relationship", h, 2)?,
        })
    }
}

impl BertForPreTraining {
    /// Runs the encoder and both heads. `masked_positions` (`[batch, predictions]`, u32)
    /// selects where the masked-LM logits are computed (the decoder is the costliest matmul,
    /// so only masked positions pay for it).
    pub fn forward(
        &self,
        inputs: &Inputs,
        masked_positions: &MaskedPositions,
        mode: Mode,
    ) -> Result<PreTrainingOutput, ModelError> {
        let x = self.bert.encode_tokens(inputs, mode)?;
        self.heads(&x, inputs, masked_positions)
    }

    /// The masked-LM and next-sentence heads on the encoder's output for the tokens `x`
    /// (`[tokens, hidden]`). A masked position in padding reads a hidden state of zeros.
    pub fn heads(
        &self,
        x: &Tensor,
        inputs: &Inputs,
        masked_positions: &MaskedPositions,
    ) -> Result<PreTrainingOutput, ModelError> {
        self.heads_into(x, inputs, masked_positions, None)
    }

    /// [`BertForPreTraining::heads`], the masked-LM decoder's gradient of the word embeddings
    /// (tied to it) handed to the sink returned where the kernels can
    /// ([`crate::kernels::Kernels::linear_into`]) rather than to the graph: the caller adds
    /// it to the word embeddings' gradient after the backward pass (the trainer's step does,
    /// `bertkit_train::Step::hand_over`), saving candle's backward a zeroed gradient of the
    /// table's size and an addition over it.
    pub fn heads_handing_over(
        &self,
        x: &Tensor,
        inputs: &Inputs,
        masked_positions: &MaskedPositions,
    ) -> Result<(PreTrainingOutput, crate::kernels::GradientSink), ModelError> {
        let sink = crate::kernels::GradientSink::new(self.bert.word_embeddings());
        let out = self.heads_into(x, inputs, masked_positions, Some(&sink))?;
        Ok((out, sink))
    }

    fn heads_into(
        &self,
        x: &Tensor,
        inputs: &Inputs,
        masked_positions: &MaskedPositions,
        sink: Option<&crate::kernels::GradientSink>,
    ) -> Result<PreTrainingOutput, ModelError> {
        let (batch, seq) = inputs.packing.padded_dims();
        let positions = masked_positions.tensor();
        let (pb, predictions) = positions.dims2()?;
        if pb != batch || masked_positions.seq > seq {
            return Err(ModelError::Input(format!(
                "masked positions for {pb} rows of {} positions, the batch is {batch} rows of {seq}",
                masked_positions.seq
            )));
        }
        // Each masked position's place in the padded batch, `row · seq + position`.
        let places: Vec<u32> = masked_positions
            .host
            .iter()
            .enumerate()
            .map(|(i, &p)| ((i / predictions.max(1)) * seq) as u32 + p)
            .collect();
        let k = self.bert.kernels.as_ref();
        let picked = inputs
            .packing
            .select_with(x, &places, |t, rows| k.gather_rows(t, rows))?;
        let t = self
            .transform
            .forward_gelu(k, &picked, self.bert.config().gelu())?;
        let t = self.transform_norm.forward(k, &t)?;
        // The decoder: the word embeddings (`[vocab, hidden]`, a linear layer's layout, kept in
        // f32: the kernels cast them for the product) and the output bias, over the slots
        // reshaped to `[batch, predictions, hidden]` first, not the logits after: the losses
        // take the logits as the decoder gives them, and a reshape of the logits costs
        // candle's backward a zeroed tensor and an addition over all of them, where one of
        // `t` costs them over a thirtieth as much.
        let decoder = self.bert.word_embeddings();
        let bias = self.output_bias.to_dtype(t.dtype())?;
        let t = t.reshape((batch, predictions, ()))?;
        let logits = k.decoder(&t, decoder, &bias, sink)?;
        let pooled = self
            .bert
            .pool(x, inputs)?
            .expect("the pre-training model has a pooler");
        Ok(PreTrainingOutput {
            mlm_logits: logits,
            nsp_logits: self.seq_relationship.forward(k, &pooled)?,
        })
    }
}

/// BERT with a span head for extractive question answering (transformers'
/// `BertForQuestionAnswering`: no pooler).
#[derive(Debug, Clone)]
pub struct BertForQuestionAnswering {
    /// The encoder.
    pub bert: BertModel,
    qa_outputs: Linear,
}

impl BertArchitecture for BertForQuestionAnswering {
    const ARCHITECTURE: &'static str = "BertForQuestionAnswering";
    fn build(c: &BertConfig, p: &mut ParamBuilder) -> Result<Self, ModelError> {
        Ok(BertForQuestionAnswering {
            bert: BertModel::build(c, p, false)?,
            qa_outputs: Linear::build(p, "qa_outputs", c.hidden_size, 2)?,
        })
    }
}

impl BertForQuestionAnswering {
    /// Start and end logits, each `[batch, seq]` (0 at padding).
    pub fn forward(&self, inputs: &Inputs, mode: Mode) -> Result<(Tensor, Tensor), ModelError> {
        self.head(&self.bert.encode_tokens(inputs, mode)?, inputs)
    }

    /// The span head on the encoder's output for the tokens `x` (`[tokens, hidden]`): start
    /// and end logits, each `[batch, seq]` (0 at padding).
    pub fn head(&self, x: &Tensor, inputs: &Inputs) -> Result<(Tensor, Tensor), ModelError> {
        let k = self.bert.kernels.as_ref();
        let logits = inputs
            .packing
            .unpack_with(&self.qa_outputs.forward(k, x)?, |t, rows| {
                k.gather_rows(t, rows)
            })?;
        Ok((
            logits.i((.., .., 0))?.contiguous()?,
            logits.i((.., .., 1))?.contiguous()?,
        ))
    }
}

/// BERT with a classifier on the pooled output (transformers' `BertForSequenceClassification`).
#[derive(Debug, Clone)]
pub struct BertForSequenceClassification {
    /// The encoder.
    pub bert: BertModel,
    classifier: Linear,
    dropout: f64,
}

impl BertArchitecture for BertForSequenceClassification {
    const ARCHITECTURE: &'static str = "BertForSequenceClassification";
    fn build(c: &BertConfig, p: &mut ParamBuilder) -> Result<Self, ModelError> {
        Ok(BertForSequenceClassification {
            bert: BertModel::build(c, p, true)?,
            classifier: Linear::build(p, "classifier", c.hidden_size, c.num_labels())?,
            dropout: c.hidden_dropout_prob,
        })
    }
}

impl BertForSequenceClassification {
    /// Class logits, `[batch, num_labels]` (one column: a regression score).
    pub fn forward(&self, inputs: &Inputs, mode: Mode) -> Result<Tensor, ModelError> {
        self.head(&self.bert.encode_tokens(inputs, mode)?, inputs, mode)
    }

    /// The pooler and classifier on the encoder's output for the tokens `x` (`[tokens,
    /// hidden]`), with the classifier's dropout in training `mode`: `[batch, num_labels]`.
    pub fn head(&self, x: &Tensor, inputs: &Inputs, mode: Mode) -> Result<Tensor, ModelError> {
        let pooled = self
            .bert
            .pool(x, inputs)?
            .expect("the classification model has a pooler");
        Ok(self.classifier.forward(
            self.bert.kernels.as_ref(),
            &dropout(&pooled, self.dropout, mode)?,
        )?)
    }
}
