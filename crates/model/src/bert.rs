//! BERT: embeddings, encoder, pooler, and the pre-training, question-answering and
//! sequence-classification heads, in one file (as candle-transformers lays models out).
//!
//! Inputs are `[batch, seq]` tensors of token ids, segment (token type) ids and an attention
//! mask (1 for tokens, 0 for padding), as integers (`u32` or `i64`). Inside the encoder the
//! batch is unpadded: activations are `[tokens, hidden]`, the tokens of every row end to end
//! ([`Packing`]), so nothing is computed for padding; the outputs are padded back
//! (`[batch, seq, ...]`, zeros at padding). [`Mode::Train`] turns the dropouts on, with masks
//! from a [`DropoutSource`](crate::DropoutSource). Every hot op goes through [`Kernels`].

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, IndexOp, Tensor, Var};

use crate::config::Gelu;
pub use crate::kernels::Mode;
use crate::kernels::tape::{self, Tape};
use crate::kernels::{Fused, Kernels};
use crate::packing::{Packing, RowIndex};
use crate::params::{Init, ParamBuilder, ParamStore};
use crate::{BertConfig, ModelError};

pub use crate::packing::MASK_BIAS;

/// `x · Wᵀ + b`, with PyTorch's `[out, in]` weight layout.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    fn build(
        p: &mut ParamBuilder,
        name: &str,
        input: usize,
        output: usize,
    ) -> Result<Self, ModelError> {
        Ok(Linear {
            weight: p.get(
                &format!("{name}.weight"),
                &[output, input],
                Init::TruncatedNormal,
            )?,
            bias: Some(p.get(&format!("{name}.bias"), &[output], Init::Zeros)?),
        })
    }

    /// Applies the layer to `[..., in]` with the kernels' linear layer.
    pub fn forward(&self, k: &dyn Kernels, x: &Tensor) -> candle_core::Result<Tensor> {
        k.linear(x, &self.weight, self.bias.as_ref())
    }

    /// The layer followed by GELU in `form`, with the kernels' fused pair.
    pub fn forward_gelu(
        &self,
        k: &dyn Kernels,
        x: &Tensor,
        form: Gelu,
    ) -> candle_core::Result<Tensor> {
        k.linear_gelu(x, &self.weight, self.bias.as_ref(), form)
    }
}

/// LayerNorm parameters; the computation is the kernels'.
#[derive(Debug, Clone)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    fn build(p: &mut ParamBuilder, name: &str, size: usize, eps: f64) -> Result<Self, ModelError> {
        Ok(LayerNorm {
            weight: p.get(&format!("{name}.weight"), &[size], Init::Ones)?,
            bias: p.get(&format!("{name}.bias"), &[size], Init::Zeros)?,
            eps,
        })
    }

    fn forward(&self, k: &dyn Kernels, x: &Tensor) -> candle_core::Result<Tensor> {
        k.layer_norm(x, &self.weight, &self.bias, self.eps)
    }

    /// The norm of a sublayer's packed output `x` after its dropout, plus the `residual`.
    fn residual_forward(
        &self,
        k: &dyn Kernels,
        x: &Tensor,
        residual: &Tensor,
        packing: &Packing,
        mode: Mode,
        dropout: f64,
    ) -> candle_core::Result<Tensor> {
        let (weight, bias) = (&self.weight, &self.bias);
        k.residual_layer_norm(x, residual, packing, mode, dropout, weight, bias, self.eps)
    }
}

fn dropout(x: &Tensor, p: f64, mode: Mode) -> candle_core::Result<Tensor> {
    mode.dropout(x, p)
}

/// Checked model inputs: where the tokens are and the embedding rows they read.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The tokens (the attention mask's 1s) laid end to end, as the encoder runs them.
    pub packing: Packing,
    /// The word embeddings' rows the tokens read (their ids, packed).
    word_rows: RowIndex,
    /// The segment embeddings' rows the tokens read.
    type_rows: RowIndex,
    /// The position embeddings' rows the tokens read (their columns).
    position_rows: RowIndex,
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

/// A tensor's integers on the host, for checking (`u8`, `u32` or `i64`; a negative value is an
/// error naming its place).
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
                ModelError::Input(format!(
                    "{name} row {} position {} holds {v}, below 0",
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
    positions: Tensor,
    /// The same on the host.
    host: Arc<Vec<u32>>,
    /// The sequence length the positions were checked against.
    seq: usize,
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

#[derive(Debug, Clone)]
struct Embeddings {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    norm: LayerNorm,
    dropout: f64,
}

impl Embeddings {
    fn build(c: &BertConfig, p: &mut ParamBuilder) -> Result<Self, ModelError> {
        let h = c.hidden_size;
        Ok(Embeddings {
            word: p.get_table(
                "embeddings.word_embeddings.weight",
                &[c.vocab_size, h],
                Init::TruncatedNormal,
            )?,
            position: p.get_table(
                "embeddings.position_embeddings.weight",
                &[c.max_position_embeddings, h],
                Init::TruncatedNormal,
            )?,
            token_type: p.get_table(
                "embeddings.token_type_embeddings.weight",
                &[c.type_vocab_size, h],
                Init::TruncatedNormal,
            )?,
            norm: LayerNorm::build(p, "embeddings.LayerNorm", h, c.layer_norm_eps)?,
            dropout: c.hidden_dropout_prob,
        })
    }

    /// The embeddings with their parameters detached, for a pass recorded on a tape: as
    /// [`EncoderLayer::detached`].
    fn detached(&self, seen: &mut Vec<(Tensor, Tensor)>) -> Embeddings {
        let mut embeddings = self.clone();
        for t in [
            &mut embeddings.word,
            &mut embeddings.position,
            &mut embeddings.token_type,
            &mut embeddings.norm.weight,
            &mut embeddings.norm.bias,
        ] {
            let own = t.clone();
            *t = own.detach();
            seen.push((t.clone(), own));
        }
        embeddings
    }

    /// The embeddings of the batch's tokens, `[tokens, hidden]`.
    fn forward(&self, k: &dyn Kernels, inputs: &Inputs, mode: Mode) -> candle_core::Result<Tensor> {
        // The tables are f32 (see `ParamBuilder::get_table`): the sum and its LayerNorm run in
        // f32, and the result is cast to the compute dtype (the LayerNorm's), so the tables'
        // gradients arrive and accumulate in f32.
        let lookups = [
            (&self.word, &inputs.word_rows),
            (&self.token_type, &inputs.type_rows),
            (&self.position, &inputs.position_rows),
        ];
        let norm = &self.norm;
        k.embeddings(
            lookups,
            &inputs.packing,
            mode,
            self.dropout,
            &norm.weight,
            &norm.bias,
            norm.eps,
        )
    }
}

#[derive(Debug, Clone)]
struct EncoderLayer {
    query: Linear,
    key: Linear,
    value: Linear,
    /// A frozen model's query, key and value projections joined once at load
    /// ([`ParamBuilder::join_rows`]; the three are views of it), where a trainable model joins
    /// them at every pass.
    projection: Option<Linear>,
    attention_output: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
    heads: usize,
    hidden_dropout: f64,
    attention_dropout: f64,
    gelu: Gelu,
}

impl EncoderLayer {
    fn build(c: &BertConfig, p: &mut ParamBuilder, i: usize) -> Result<Self, ModelError> {
        let h = c.hidden_size;
        let n = |s: &str| format!("encoder.layer.{i}.{s}");
        let projections = ["query", "key", "value"].map(|s| n(&format!("attention.self.{s}")));
        for name in &projections {
            Linear::build(p, name, h, h)?;
        }
        let joined = |p: &mut ParamBuilder, part: &str| {
            p.join_rows(&projections.clone().map(|name| format!("{name}.{part}")))
        };
        let projection = match (joined(p, "weight")?, joined(p, "bias")?) {
            (Some(weight), bias) => Some(Linear { weight, bias }),
            (None, _) => None,
        };
        // (Built again: a frozen model's three are now views of the joined tensors.)
        let [query, key, value] = projections.map(|name| Linear::build(p, &name, h, h));
        Ok(EncoderLayer {
            query: query?,
            key: key?,
            value: value?,
            projection,
            attention_output: Linear::build(p, &n("attention.output.dense"), h, h)?,
            attention_norm: LayerNorm::build(
                p,
                &n("attention.output.LayerNorm"),
                h,
                c.layer_norm_eps,
            )?,
            intermediate: Linear::build(p, &n("intermediate.dense"), h, c.intermediate_size)?,
            output: Linear::build(p, &n("output.dense"), c.intermediate_size, h)?,
            output_norm: LayerNorm::build(p, &n("output.LayerNorm"), h, c.layer_norm_eps)?,
            heads: c.num_attention_heads,
            hidden_dropout: c.hidden_dropout_prob,
            attention_dropout: c.attention_probs_dropout_prob,
            gelu: c.gelu(),
        })
    }

    /// The query, key and value projections of `x` as one product (one pass over `x`, and a
    /// wider product runs faster): `[tokens, 3 · hidden]`. The weights stay three parameters
    /// (transformers' layout); their gradients come back through the concatenation, made at
    /// each pass (on CUDA six copies a layer) unless the model is frozen: then once, at load.
    fn projections(&self, k: &dyn Kernels, x: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(joined) = &self.projection {
            return joined.forward(k, x);
        }
        let layers = [&self.query, &self.key, &self.value];
        let weight = tape::cat_rows(&layers.map(|l| &l.weight))?;
        let biases: Option<Vec<&Tensor>> = layers.iter().map(|l| l.bias.as_ref()).collect();
        let bias = biases.map(|b| tape::cat_rows(&b)).transpose()?;
        k.linear(x, &weight, bias.as_ref())
    }

    /// The layer with its parameters detached (the same storage, tracking nothing), for a
    /// pass recorded on a tape; each detached parameter is pushed on `seen` beside the
    /// model's own, so that its gradient can be handed back under the model's.
    fn detached(&self, seen: &mut Vec<(Tensor, Tensor)>) -> EncoderLayer {
        let mut layer = self.clone();
        let mut detach = |t: &mut Tensor| {
            let own = t.clone();
            *t = own.detach();
            seen.push((t.clone(), own));
        };
        for linear in [
            &mut layer.query,
            &mut layer.key,
            &mut layer.value,
            &mut layer.attention_output,
            &mut layer.intermediate,
            &mut layer.output,
        ] {
            detach(&mut linear.weight);
            if let Some(bias) = linear.bias.as_mut() {
                detach(bias);
            }
        }
        for norm in [&mut layer.attention_norm, &mut layer.output_norm] {
            detach(&mut norm.weight);
            detach(&mut norm.bias);
        }
        layer
    }

    /// The layer on packed `x`, `[tokens, hidden]`.
    fn forward(
        &self,
        k: &dyn Kernels,
        x: &Tensor,
        packing: &Packing,
        mode: Mode,
    ) -> candle_core::Result<Tensor> {
        let context = k.attention(
            &self.projections(k, x)?,
            packing,
            self.heads,
            mode,
            self.attention_dropout,
        )?;
        let x = self.attention_norm.residual_forward(
            k,
            &self.attention_output.forward(k, &context)?,
            x,
            packing,
            mode,
            self.hidden_dropout,
        )?;
        let out = k.feed_forward(
            &x,
            (&self.intermediate.weight, self.intermediate.bias.as_ref()),
            (&self.output.weight, self.output.bias.as_ref()),
            self.gelu,
        )?;
        self.output_norm
            .residual_forward(k, &out, &x, packing, mode, self.hidden_dropout)
    }
}

/// A training pass through the embeddings and the encoder, waiting for its head's gradients
/// ([`BertModel::encoder_pass`]): the caller runs a head on [`EncoderPass::top`] and its
/// loss's backward, then [`EncoderPass::backward`] takes the gradient on from there.
#[derive(Debug)]
pub struct EncoderPass<'a> {
    bert: &'a BertModel,
    inputs: &'a Inputs,
    mode: Mode<'a>,
    /// The embeddings' output, and how their backward runs.
    embedded: Embedded,
    /// The last layer's output, where the head starts.
    top: Top,
    /// The layers' backward when every activation is kept.
    kept: Option<EncoderBackward>,
    /// With checkpointing: each segment's input, its first dropout mask and its layers.
    segments: Vec<(Tensor, u64, std::ops::Range<usize>)>,
}

/// The embeddings' output in a training pass, and how their backward runs.
#[derive(Debug)]
enum Embedded {
    /// Tracked: their backward runs in candle's autograd.
    Graph(Tensor),
    /// Recorded on a tape over detached parameters (each beside the model's own), the output
    /// tracking nothing: their backward runs by hand.
    Tape {
        tape: Tape,
        output: Tensor,
        params: Vec<(Tensor, Tensor)>,
    },
}

impl Embedded {
    /// The output.
    fn output(&self) -> &Tensor {
        match self {
            Embedded::Graph(t) => t,
            Embedded::Tape { output, .. } => output,
        }
    }

    /// The parameters' gradients from the output's gradient `grad`, under the model's own
    /// parameter tensors.
    fn backward(self, grad: &Tensor) -> Result<Gradients, ModelError> {
        match self {
            Embedded::Graph(output) => Ok(Gradients::from(&backward_from(&output, grad)?)),
            Embedded::Tape {
                tape,
                output,
                params,
            } => own_gradients(tape.backward(&output, grad.clone())?, params, "embeddings"),
        }
    }
}

/// The gradients a tape's backward left for `params`' detached tensors, under the model's own
/// (`params`: each detached tensor beside its own); a gradient left for any other tensor is an
/// error (an op outside the tape in `what`).
fn own_gradients(
    mut leaves: tape::LeafGradients,
    params: Vec<(Tensor, Tensor)>,
    what: &str,
) -> Result<Gradients, ModelError> {
    let mut store = Gradients::default();
    for (seen, own) in params {
        if let Some(g) = leaves.remove(&seen.id()) {
            store.0.insert(own.id(), g);
        }
    }
    if !leaves.is_empty() {
        return Err(ModelError::Input(format!(
            "the {what}' recorded backward left {} gradients for tensors that are neither its \
             input nor its parameters (an op outside the tape)",
            leaves.len()
        )));
    }
    Ok(store)
}

/// Where a head starts.
#[derive(Debug)]
enum Top {
    /// A variable: the layers' backward runs apart from the head's, from the gradient the
    /// head's backward hands back.
    Var(Var),
    /// The layers' tracked output: one graph from the embeddings to the loss, whose backward
    /// is the whole pass's (kernels that do not record, every activation kept).
    Graph(Tensor),
}

impl EncoderPass<'_> {
    /// The last layer's output for the batch's tokens, `[tokens, hidden]`, where the head
    /// starts.
    pub fn top(&self) -> &Tensor {
        match &self.top {
            Top::Var(v) => v.as_tensor(),
            Top::Graph(t) => t,
        }
    }

    /// Back-propagates from the head's gradients `store` (the backward of a loss computed from
    /// [`EncoderPass::top`]) through the layers (each checkpointed segment recomputed first,
    /// its dropout masks replayed), handing each segment's parameter gradients to `sink` as
    /// they are made (the last layers' first), and through the embeddings (by hand where they
    /// were recorded, else in candle's autograd), whose gradients it returns: the word
    /// embeddings may have a gradient in `store` too (a decoder tied to them), and adding the
    /// two before anything else ([`Gradients::add_to`]) sums them as one graph's backward
    /// does, so that a micro-batch's gradient is the same bits however the caller goes on
    /// (accumulated, or summed over data-parallel ranks). `None` when the pass was one graph:
    /// `store` holds every gradient already.
    pub fn backward<E>(
        self,
        store: &GradStore,
        mut sink: impl FnMut(Gradients) -> Result<(), E>,
    ) -> Result<Option<Gradients>, E>
    where
        E: From<ModelError> + From<candle_core::Error>,
    {
        let EncoderPass {
            bert,
            inputs,
            mode,
            embedded,
            top,
            kept,
            segments,
        } = self;
        // Where the forward pass (the head's dropout included) left the masks.
        let end = position(mode);
        let top = match top {
            Top::Var(top) => top,
            Top::Graph(_) => return Ok(None),
        };
        let mut upstream = store
            .get(top.as_tensor())
            .cloned()
            .ok_or_else(|| ModelError::Input("no gradient reached the encoder's output".into()))?;
        drop(top);
        if let Some(backward) = kept {
            let (grad_input, grads) = backward.backward(&upstream)?;
            sink(grads)?;
            upstream = grad_input;
        }
        for (input, position, range) in segments.into_iter().rev() {
            rewind(mode, position);
            let (_, backward) = bert.encode_taped(&input, inputs, range, mode)?;
            let (grad_input, grads) = backward.backward(&upstream)?;
            sink(grads)?;
            upstream = grad_input;
        }
        let embeddings = embedded.backward(&upstream)?;
        rewind(mode, end);
        Ok(Some(embeddings))
    }
}

/// candle's backward from `output` given its gradient `grad`: the backward of the loss
/// `Σ output · grad`, whose gradient with respect to `output` is `grad`.
pub(crate) fn backward_from(output: &Tensor, grad: &Tensor) -> candle_core::Result<GradStore> {
    (output * grad)?.sum_all()?.backward()
}

/// Where the dropout masks are in training `mode` (0 in evaluation, which draws none).
fn position(mode: Mode) -> u64 {
    match mode {
        Mode::Train(source) => source.position(),
        Mode::Eval => 0,
    }
}

/// Sets the dropout masks back to `position` in training `mode`.
fn rewind(mode: Mode, position: u64) {
    if let Mode::Train(source) = mode {
        source.set_position(position)
    }
}

/// What the base model computes.
#[derive(Debug, Clone)]
pub struct BertOutput {
    /// The embedding output and every layer's output (`num_hidden_layers + 1` tensors of
    /// `[batch, seq, hidden]`), when asked for.
    pub hidden_states: Vec<Tensor>,
    /// The last layer's output, `[batch, seq, hidden]`.
    pub last_hidden_state: Tensor,
    /// `tanh(dense(h[:, 0]))`, `[batch, hidden]`, for models with a pooler.
    pub pooler_output: Option<Tensor>,
}

/// The BERT encoder (embeddings, layers, optional pooler).
#[derive(Debug, Clone)]
pub struct BertModel {
    config: BertConfig,
    embeddings: Embeddings,
    layers: Vec<EncoderLayer>,
    pooler: Option<Linear>,
    kernels: Arc<dyn Kernels>,
    /// Why the encoder's backward cannot be run by hand with these kernels, once a
    /// recording found out ([`BertModel::encode_taped`]).
    tape_refused: std::sync::OnceLock<String>,
    /// The same for the embeddings ([`BertModel::embed_for_training`]).
    embeddings_tape_refused: std::sync::OnceLock<String>,
}

/// Gradients by the tensor they belong to (the model's parameters), as candle's
/// [`GradStore`] holds them; what [`EncoderBackward::backward`] hands back.
#[derive(Debug, Default, Clone)]
pub struct Gradients(std::collections::HashMap<candle_core::TensorId, Tensor>);

impl Gradients {
    /// The gradient of `tensor`, if it has one.
    pub fn get(&self, tensor: &Tensor) -> Option<&Tensor> {
        self.0.get(&tensor.id())
    }

    /// Adds these gradients to `store`'s: each tensor's sum where both have one (`store`'s
    /// plus these, through the kernels' addition of gradients: on CUDA 16 bytes a thread, where
    /// `GradStore::extend` takes candle's, an element a thread), moved in where only these do.
    pub fn add_to(self, store: &mut GradStore) -> candle_core::Result<()> {
        for (id, grad) in self.0 {
            let sum = match store.get_id(id) {
                Some(have) => crate::kernels::add_gradients(have, &grad)?,
                None => grad,
            };
            store.insert_id(id, sum);
        }
        Ok(())
    }
}

impl From<&GradStore> for Gradients {
    fn from(store: &GradStore) -> Self {
        let grads = store
            .get_ids()
            .filter_map(|&id| Some((id, store.get_id(id)?.clone())));
        Gradients(grads.collect())
    }
}

/// Encoder layers' forward pass, kept for its backward pass ([`BertModel::encode_taped`]).
#[derive(Debug)]
pub struct EncoderBackward {
    how: Backward,
}

#[derive(Debug)]
enum Backward {
    /// By hand, over the kernels' ops recorded on a tape; the layers' detached parameters
    /// beside the model's own.
    Tape {
        tape: Tape,
        input: Tensor,
        output: Tensor,
        params: Vec<(Tensor, Tensor)>,
    },
    /// candle's autograd, from the layers' output to their input (a variable) and the
    /// model's parameters.
    Autograd { input: Var, output: Tensor },
}

impl EncoderBackward {
    /// Whether the backward pass runs by hand over the kernels' recorded ops (rather than in
    /// candle's autograd).
    pub fn by_hand(&self) -> bool {
        matches!(self.how, Backward::Tape { .. })
    }

    /// Back-propagates `grad`, the gradient of the layers' output: the gradient of their
    /// input, and each parameter's gradient under the model's own parameter tensors.
    pub fn backward(self, grad: &Tensor) -> Result<(Tensor, Gradients), ModelError> {
        match self.how {
            Backward::Tape {
                tape,
                input,
                output,
                params,
            } => {
                let mut leaves = tape.backward(&output, grad.clone())?;
                let grad_input = leaves.remove(&input.id()).ok_or_else(|| {
                    ModelError::Input("no gradient reached the encoder layers' input".into())
                })?;
                Ok((grad_input, own_gradients(leaves, params, "encoder layers")?))
            }
            Backward::Autograd { input, output } => {
                let store = backward_from(&output, grad)?;
                let grad_input = store.get(input.as_tensor()).cloned().ok_or_else(|| {
                    ModelError::Input("no gradient reached the encoder layers' input".into())
                })?;
                Ok((grad_input, Gradients::from(&store)))
            }
        }
    }
}

impl BertModel {
    /// Builds the encoder's parameters from `p` (with the pooler when `pooler`).
    pub fn build(
        config: &BertConfig,
        p: &mut ParamBuilder,
        pooler: bool,
    ) -> Result<Self, ModelError> {
        config.validate().map_err(ModelError::Config)?;
        let embeddings = Embeddings::build(config, p)?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| EncoderLayer::build(config, p, i))
            .collect::<Result<Vec<_>, _>>()?;
        let pooler = if pooler {
            Some(Linear::build(
                p,
                "pooler.dense",
                config.hidden_size,
                config.hidden_size,
            )?)
        } else {
            None
        };
        Ok(BertModel {
            config: config.clone(),
            embeddings,
            layers,
            pooler,
            kernels: Arc::new(Fused::default()),
            tape_refused: std::sync::OnceLock::new(),
            embeddings_tape_refused: std::sync::OnceLock::new(),
        })
    }

    /// Replaces the kernels (for example with fused CUDA ones).
    pub fn set_kernels(&mut self, kernels: Arc<dyn Kernels>) {
        self.kernels = kernels;
        self.tape_refused = std::sync::OnceLock::new();
        self.embeddings_tape_refused = std::sync::OnceLock::new();
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The word embedding matrix, `[vocab, hidden]` (the MLM decoder is tied to it), in f32
    /// whatever the compute dtype (f64 in an f64 model).
    pub fn word_embeddings(&self) -> &Tensor {
        &self.embeddings.word
    }

    /// Number of encoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The embedding stage: word + position + token type, LayerNorm, dropout, for the batch's
    /// tokens: `[tokens, hidden]` (see [`Packing`]).
    pub fn embed(&self, inputs: &Inputs, mode: Mode) -> Result<Tensor, ModelError> {
        Ok(self
            .embeddings
            .forward(self.kernels.as_ref(), inputs, mode)?)
    }

    /// The embeddings in a training pass whose layers run apart from them: recorded on a tape
    /// (their backward then runs by hand: no zeroed gradient and addition at each edge, no
    /// product with the gradient to start candle's autograd from) where the kernels record in
    /// the model's dtype on its device and the embeddings' kernel records (the fused ones, on
    /// the CPU in f32 and on CUDA where turned on; the composed path does not, and after its
    /// first refusal is not asked again), else tracked by candle's autograd. The same masks
    /// either way.
    fn embed_for_training(&self, inputs: &Inputs, mode: Mode) -> Result<Embedded, ModelError> {
        let norm = &self.embeddings.norm.weight;
        if self.kernels.records(norm.dtype(), norm.device())
            && self.embeddings_tape_refused.get().is_none()
        {
            let start = position(mode);
            let mut params = Vec::new();
            let detached = self.embeddings.detached(&mut params);
            let k = self.kernels.as_ref();
            let (output, tape) = tape::record(|| detached.forward(k, inputs, mode))?;
            match tape {
                Ok(tape) => {
                    return Ok(Embedded::Tape {
                        tape,
                        output,
                        params,
                    });
                }
                Err(why) => {
                    let _ = self.embeddings_tape_refused.set(why);
                    rewind(mode, start);
                }
            }
        }
        Ok(Embedded::Graph(self.embed(inputs, mode)?))
    }

    /// Encoder layers `layers` (a range of layer indices) on the tokens `x` (`[tokens,
    /// hidden]`). Running the ranges in order is the whole encoder; activation checkpointing
    /// runs them one segment at a time.
    pub fn encode(
        &self,
        x: &Tensor,
        inputs: &Inputs,
        layers: std::ops::Range<usize>,
        mode: Mode,
    ) -> Result<Tensor, ModelError> {
        let k = self.kernels.as_ref();
        let mut x = x.clone();
        for layer in &self.layers[layers] {
            x = layer.forward(k, &x, &inputs.packing, mode)?;
        }
        Ok(x)
    }

    /// Encoder layers `layers` on the tokens `x`, as [`BertModel::encode`] computes them, with
    /// what their backward pass needs: the output (tracking nothing) and an
    /// [`EncoderBackward`] that takes the output's gradient back to `x` and to the layers'
    /// parameters.
    ///
    /// With kernels that record ([`Kernels::records`]: the fused ones) the backward pass runs
    /// by hand over the ops the forward pass wrote on a [`Tape`] (no zeroed gradient and
    /// addition per edge as in candle's autograd, each layer's saved tensors freed as its
    /// backward ends); with others, or where a kernel falls back to candle's ops (the tape
    /// refuses; the model then stops trying), in candle's autograd from a copy of `x`.
    pub fn encode_taped(
        &self,
        x: &Tensor,
        inputs: &Inputs,
        layers: std::ops::Range<usize>,
        mode: Mode,
    ) -> Result<(Tensor, EncoderBackward), ModelError> {
        let k = self.kernels.as_ref();
        if self.backward_by_hand(x) {
            let start = position(mode);
            let mut params = Vec::new();
            let detached: Vec<EncoderLayer> = self.layers[layers.clone()]
                .iter()
                .map(|l| l.detached(&mut params))
                .collect();
            let input = x.detach();
            let (output, tape) = tape::record(|| {
                let mut x = input.clone();
                for layer in &detached {
                    x = layer.forward(k, &x, &inputs.packing, mode)?;
                }
                Ok(x)
            })?;
            match tape {
                Ok(tape) => {
                    let how = Backward::Tape {
                        tape,
                        input,
                        output: output.clone(),
                        params,
                    };
                    return Ok((output, EncoderBackward { how }));
                }
                Err(why) => {
                    // The pass is run again under candle's autograd, with the same masks.
                    let _ = self.tape_refused.set(why);
                    rewind(mode, start);
                }
            }
        }
        let input = Var::from_tensor(&x.detach())?;
        let output = self.encode(input.as_tensor(), inputs, layers, mode)?;
        let how = Backward::Autograd {
            input,
            output: output.clone(),
        };
        Ok((output.detach(), EncoderBackward { how }))
    }

    /// The forward half of a training pass: the embeddings, then the encoder layers, their
    /// output handed to the caller's head as a variable ([`EncoderPass::top`]); after the
    /// head's loss and its backward, [`EncoderPass::backward`] goes on through the layers
    /// (by hand over the kernels' tape where they record, [`BertModel::encode_taped`]) and
    /// the embeddings (by hand too where their kernel records,
    /// [`BertModel::embeddings_tape_refused`]). The head runs under candle's autograd.
    ///
    /// With `checkpoint_every` > 0 (activation checkpointing) only the input of each segment
    /// of that many layers is kept, and the backward pass recomputes each segment (replaying
    /// its dropout masks) before back-propagating through it; 0 keeps every activation. With
    /// kernels that do not record and every activation kept, the pass is one graph and its
    /// backward candle's, whole.
    pub fn encoder_pass<'a>(
        &'a self,
        inputs: &'a Inputs,
        mode: Mode<'a>,
        checkpoint_every: usize,
    ) -> Result<EncoderPass<'a>, ModelError> {
        let layers = self.layers.len();
        let every = if checkpoint_every == 0 {
            layers.max(1)
        } else {
            checkpoint_every
        };
        if checkpoint_every == 0 && !self.backward_by_hand(&self.embeddings.norm.weight) {
            // Nothing to run apart: one graph, as candle's autograd takes it.
            let embedded = self.embed(inputs, mode)?;
            let top = self.encode(&embedded, inputs, 0..layers, mode)?;
            return Ok(EncoderPass {
                bert: self,
                inputs,
                mode,
                embedded: Embedded::Graph(embedded),
                top: Top::Graph(top),
                kept: None,
                segments: Vec::new(),
            });
        }
        let embedded = self.embed_for_training(inputs, mode)?;
        let mut x = embedded.output().detach();
        let (mut kept, mut segments) = (None, Vec::new());
        for start in (0..layers).step_by(every) {
            let range = start..(start + every).min(layers);
            if checkpoint_every == 0 {
                let (y, backward) = self.encode_taped(&x, inputs, range, mode)?;
                (x, kept) = (y, Some(backward));
            } else {
                let position = match mode {
                    Mode::Train(source) => source.mark(),
                    Mode::Eval => 0,
                };
                segments.push((x.clone(), position, range.clone()));
                x = self.encode(&x, inputs, range, mode)?.detach();
            }
        }
        Ok(EncoderPass {
            bert: self,
            inputs,
            mode,
            embedded,
            top: Top::Var(Var::from_tensor(&x)?),
            kept,
            segments,
        })
    }

    /// Whether the layers' backward on tensors like `x` is tried by hand: the kernels record
    /// in `x`'s dtype on its device and no recording was refused.
    fn backward_by_hand(&self, x: &Tensor) -> bool {
        self.kernels.records(x.dtype(), x.device()) && self.tape_refused.get().is_none()
    }

    /// Why the encoder's backward pass is not run by hand with these kernels, if a recording
    /// found out ([`BertModel::encode_taped`]).
    pub fn tape_refused(&self) -> Option<&str> {
        self.tape_refused.get().map(String::as_str)
    }

    /// Why the embeddings' backward pass is not run by hand with these kernels, if a recording
    /// found out ([`BertModel::encoder_pass`]: the composed path does not record).
    pub fn embeddings_tape_refused(&self) -> Option<&str> {
        self.embeddings_tape_refused.get().map(String::as_str)
    }

    /// The embeddings and every layer: the last layer's output for the batch's tokens,
    /// `[tokens, hidden]`.
    pub fn encode_tokens(&self, inputs: &Inputs, mode: Mode) -> Result<Tensor, ModelError> {
        let x = self.embed(inputs, mode)?;
        self.encode(&x, inputs, 0..self.layers.len(), mode)
    }

    /// The pooler on each row's `[CLS]` token (column 0) of the tokens `x`, if the model has
    /// one: `[batch, hidden]`.
    pub fn pool(&self, x: &Tensor, inputs: &Inputs) -> Result<Option<Tensor>, ModelError> {
        Ok(match &self.pooler {
            Some(dense) => {
                let k = self.kernels.as_ref();
                let firsts = inputs
                    .packing
                    .firsts_with(x, |t, rows| k.gather_rows(t, rows))?;
                Some(dense.forward(k, &firsts)?.tanh()?)
            }
            None => None,
        })
    }

    /// Runs the encoder; `all_hidden_states` keeps every layer's output. Outputs are padded
    /// (`[batch, seq, hidden]`) with zeros at padding.
    pub fn forward(
        &self,
        inputs: &Inputs,
        mode: Mode,
        all_hidden_states: bool,
    ) -> Result<BertOutput, ModelError> {
        let padded = |x: &Tensor| inputs.packing.unpack(x);
        let mut x = self.embed(inputs, mode)?;
        let mut hidden_states = Vec::new();
        for i in 0..self.layers.len() {
            if all_hidden_states {
                hidden_states.push(padded(&x)?);
            }
            x = self.encode(&x, inputs, i..i + 1, mode)?;
        }
        if all_hidden_states {
            hidden_states.push(padded(&x)?);
        }
        let pooler_output = self.pool(&x, inputs)?;
        Ok(BertOutput {
            hidden_states,
            last_hidden_state: padded(&x)?,
            pooler_output,
        })
    }
}

/// A model that can be built from parameters, loaded and saved.
pub trait BertArchitecture: Sized {
    /// The class name transformers knows it by (`architectures` in config.json).
    const ARCHITECTURE: &'static str;
    /// Builds the model's parameters from `p`.
    fn build(config: &BertConfig, p: &mut ParamBuilder) -> Result<Self, ModelError>;
}

impl BertArchitecture for BertModel {
    const ARCHITECTURE: &'static str = "BertModel";
    fn build(config: &BertConfig, p: &mut ParamBuilder) -> Result<Self, ModelError> {
        BertModel::build(config, p, true)
    }
}

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

/// A model with its parameters and config.
#[derive(Debug, Clone)]
pub struct Loaded<M> {
    /// The model.
    pub model: M,
    /// Its parameters (for optimisers and saving).
    pub params: ParamStore,
    /// Its configuration.
    pub config: BertConfig,
}

/// Where a model directory keeps its files.
pub fn model_files(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    (dir.join("config.json"), dir.join("model.safetensors"))
}

/// Loads `M` from a transformers model directory (`config.json` + `model.safetensors`).
/// Parameters the checkpoint lacks are initialised with `seed` and listed in
/// `params.initialised`.
pub fn load<M: BertArchitecture>(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Loaded<M>, ModelError> {
    load_with(dir, dtype, device, seed, &|_| {})
}

/// As [`load`], for inference: parameters are plain tensors (no gradients), so the kernels use
/// fused LayerNorm and softmax.
pub fn load_frozen<M: BertArchitecture>(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
) -> Result<Loaded<M>, ModelError> {
    load_inner(dir, dtype, device, 0, &|_| {}, true)
}

/// As [`load`], with the directory's config adjusted first (for example the dropout
/// probabilities of a training run).
pub fn load_with<M: BertArchitecture>(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
    seed: u64,
    adjust: &dyn Fn(&mut BertConfig),
) -> Result<Loaded<M>, ModelError> {
    load_inner(dir, dtype, device, seed, adjust, false)
}

fn load_inner<M: BertArchitecture>(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
    seed: u64,
    adjust: &dyn Fn(&mut BertConfig),
    frozen: bool,
) -> Result<Loaded<M>, ModelError> {
    let (config_path, weights) = model_files(dir);
    let mut config = BertConfig::load(&config_path)?;
    adjust(&mut config);
    config.validate().map_err(ModelError::Config)?;
    if !weights.is_file() {
        return Err(ModelError::Weights(format!(
            "{}: not found (a model directory holds config.json and model.safetensors)",
            weights.display()
        )));
    }
    let mut p =
        ParamBuilder::from_safetensors(&weights, dtype, device, config.initializer_range, seed)?;
    if frozen {
        p = p.frozen();
    }
    let model = M::build(&config, &mut p).map_err(|e| match e {
        ModelError::Weights(m) => ModelError::Weights(format!("{}: {m}", weights.display())),
        other => other,
    })?;
    Ok(Loaded {
        model,
        params: p.finish(),
        config,
    })
}

/// A freshly initialised `M` (seeded).
pub fn init<M: BertArchitecture>(
    config: &BertConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Loaded<M>, ModelError> {
    init_inner(config, dtype, device, seed, false)
}

/// As [`init`], for inference: parameters are plain tensors (no gradients tracked), as
/// [`load_frozen`] makes them.
pub fn init_frozen<M: BertArchitecture>(
    config: &BertConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Loaded<M>, ModelError> {
    init_inner(config, dtype, device, seed, true)
}

fn init_inner<M: BertArchitecture>(
    config: &BertConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
    frozen: bool,
) -> Result<Loaded<M>, ModelError> {
    let mut p = ParamBuilder::fresh(dtype, device, config.initializer_range, seed);
    if frozen {
        p = p.frozen();
    }
    let model = M::build(config, &mut p)?;
    Ok(Loaded {
        model,
        params: p.finish(),
        config: config.clone(),
    })
}

/// Saves a model directory transformers can load: `config.json` and `model.safetensors`
/// (each written atomically) with the tensors in `dtype`.
pub fn save<M: BertArchitecture>(
    loaded: &Loaded<M>,
    dir: &std::path::Path,
    dtype: DType,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::Io {
        path: dir.into(),
        source: e,
    })?;
    let (config_path, weights) = model_files(dir);
    loaded.params.save_safetensors(&weights, dtype)?;
    let torch_dtype = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let json = loaded
        .config
        .to_hf_json(M::ARCHITECTURE, &[("torch_dtype", torch_dtype.into())]);
    bertkit_stage_io::write_atomically(&config_path, json.as_bytes()).map_err(|e| ModelError::Io {
        path: config_path,
        source: e,
    })
}
