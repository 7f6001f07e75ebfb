//! BERT: embeddings, encoder and pooler here; the pre-training, question-answering and
//! sequence-classification heads in `heads`, the checked inputs in `inputs`, building, loading
//! and saving in `loading`.
//!
//! Inputs are `[batch, seq]` tensors of token ids, segment (token type) ids and an attention
//! mask (1 for tokens, 0 for padding), as integers (`u32` or `i64`). Inside the encoder the
//! batch is unpadded: activations are `[tokens, hidden]`, the tokens of every row end to end
//! ([`Packing`]), so nothing is computed for padding; the outputs are padded back
//! (`[batch, seq, ...]`, zeros at padding). [`Mode::Train`] turns the dropouts on, with masks
//! from a [`DropoutSource`](crate::DropoutSource). Every hot op goes through [`Kernels`].

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::config::Gelu;
pub use crate::kernels::Mode;
use crate::kernels::tape::{self, Tape};
use crate::kernels::{Fused, Kernels};
use crate::packing::Packing;
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

pub(crate) use bertkit_kernels::backward_from;

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

mod heads;
mod inputs;
mod loading;

pub use heads::{
    BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification, PreTrainingOutput,
};
pub use inputs::{Inputs, MaskedPositions};
pub use loading::{Loaded, init, init_frozen, load, load_frozen, load_with, model_files, save};
