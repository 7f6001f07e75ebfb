//! What a training forward pass asks of a device, counted on any device: the operations of its
//! autograd graph and the bytes of their outputs.
//!
//! Every node of candle's graph that is not a parameter is one operation. A view (a reshape, a
//! transpose, a narrow) shares its input's buffer and launches nothing; every other operation
//! writes a buffer of its own, and on CUDA is at least one kernel launch (a copy that makes a
//! view contiguous included). Every buffer stays alive until the backward pass has used it, so
//! the graph's buffers are the activations a step holds (besides what a fused op keeps inside
//! itself, such as a dropout mask or a pre-activation). Counting the same forward pass with the [`Composed`](crate::Composed)
//! kernels (what CUDA trains with while it has no fused kernels) and with the
//! [`Fused`](crate::Fused) ones shows what fusion removes, per encoder layer and outside the
//! layers, without the device. [`profile`] times the same pass, each kernel call timed
//! ([`Profiled`]), on the device it runs on: where a step's time goes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use crate::bert::{BertForPreTraining, Loaded, init, init_frozen};
use crate::kernels::{Clock, KernelTime, Mark, Profiled};
use crate::{BertConfig, DropoutSource, Inputs, Kernels, MaskedPositions, Mode, ModelError, loss};

/// Operations and the bytes they write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Census {
    /// Nodes of the graph that are not parameters (each an operation; views included).
    pub nodes: usize,
    /// Operations that wrote a buffer of their own (the nodes less the views of another
    /// node's buffer): on CUDA, kernel launches.
    pub ops: usize,
    /// Bytes of those buffers (held until the backward pass).
    pub bytes: u64,
}

impl std::ops::Sub for Census {
    type Output = Census;
    fn sub(self, other: Census) -> Census {
        Census {
            nodes: self.nodes.saturating_sub(other.nodes),
            ops: self.ops.saturating_sub(other.ops),
            bytes: self.bytes.saturating_sub(other.bytes),
        }
    }
}

/// The operations and bytes of the graph that computes `output` (parameters and views of
/// their buffers not counted). A buffer several nodes view (a reshape, a transpose, a narrow)
/// is one operation's and counted once, at its largest view.
pub fn of_graph(output: &Tensor) -> Census {
    let mut buffers: std::collections::HashMap<usize, u64> = std::collections::HashMap::new();
    let mut parameters = std::collections::HashSet::new();
    let mut nodes = 0;
    for node in output.sorted_nodes() {
        let (storage, _) = node.storage_and_layout();
        let buffer = &*storage as *const candle_core::Storage as usize;
        if node.is_variable() {
            parameters.insert(buffer);
            continue;
        }
        nodes += 1;
        let bytes = (node.elem_count() * node.dtype().size_in_bytes()) as u64;
        let held = buffers.entry(buffer).or_insert(0);
        *held = (*held).max(bytes);
    }
    buffers.retain(|b, _| !parameters.contains(b));
    Census {
        nodes,
        ops: buffers.len(),
        bytes: buffers.values().sum(),
    }
}

/// A pre-training forward pass counted per encoder layer and outside the layers
/// (embeddings, heads and loss).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreTrainingCensus {
    /// One encoder layer.
    pub layer: Census,
    /// Everything but the encoder layers.
    pub outside_layers: Census,
    /// The whole pass of the config's layer count.
    pub total: Census,
}

/// The shape of the batch a census runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CensusBatch {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence (no padding).
    pub seq: usize,
    /// Masked-LM predictions per sequence.
    pub predictions: usize,
}

/// Counts a training-mode pre-training forward pass and its loss for `config` with `kernels`
/// in `dtype` on `device`: built with one and with two encoder layers (seeded weights and
/// inputs), the difference is one layer; the total is for the config's layer count.
pub fn pretraining(
    config: &BertConfig,
    kernels: Arc<dyn Kernels>,
    dtype: DType,
    device: &Device,
    shape: CensusBatch,
) -> Result<PreTrainingCensus, ModelError> {
    let count = |layers: usize| -> Result<Census, ModelError> {
        let mut c = config.clone();
        c.num_hidden_layers = layers;
        pass(&c, kernels.clone(), dtype, device, shape)
    };
    let (one, two) = (count(1)?, count(2)?);
    let layer = two - one;
    let outside_layers = one - layer;
    let layers = config.num_hidden_layers as u64;
    Ok(PreTrainingCensus {
        layer,
        outside_layers,
        total: Census {
            nodes: outside_layers.nodes + layer.nodes * layers as usize,
            ops: outside_layers.ops + layer.ops * layers as usize,
            bytes: outside_layers.bytes + layer.bytes * layers,
        },
    })
}

fn pass(
    config: &BertConfig,
    kernels: Arc<dyn Kernels>,
    dtype: DType,
    device: &Device,
    shape: CensusBatch,
) -> Result<Census, ModelError> {
    let mut pass = PreTrainingPass::build(config, dtype, device, shape, false)?;
    pass.loaded.model.bert.set_kernels(kernels);
    Ok(of_graph(&pass.loss()?))
}

/// A seeded pre-training model and batch, for measuring a pass.
struct PreTrainingPass {
    loaded: Loaded<BertForPreTraining>,
    inputs: Inputs,
    masked: MaskedPositions,
    labels: Tensor,
    weights: Tensor,
    next: Tensor,
    dropout: DropoutSource,
}

impl PreTrainingPass {
    /// A seeded model (`frozen`: plain tensors, as inference loads them) and batch.
    fn build(
        config: &BertConfig,
        dtype: DType,
        device: &Device,
        shape: CensusBatch,
        frozen: bool,
    ) -> Result<Self, ModelError> {
        let CensusBatch {
            batch,
            seq,
            predictions,
        } = shape;
        let loaded = if frozen {
            init_frozen::<BertForPreTraining>(config, dtype, device, 1)?
        } else {
            init::<BertForPreTraining>(config, dtype, device, 1)?
        };
        let mut rng = bertkit_rng::SplitMix64::new(7);
        let mut below = |n: usize| (rng.next_u64() % n as u64) as u32;
        let ids: Vec<u32> = (0..batch * seq).map(|_| below(config.vocab_size)).collect();
        let types: Vec<u32> = (0..batch * seq)
            .map(|i| u32::from(i % seq >= seq / 2))
            .collect();
        let inputs = Inputs::from_host(config, (batch, seq), &ids, Some(&types), None, device)?;
        let positions: Vec<u32> = (0..batch * predictions)
            .map(|i| ((i % predictions) * seq / predictions.max(1)) as u32)
            .collect();
        let masked = MaskedPositions::from_host((batch, predictions), &positions, seq, device)?;
        let labels: Vec<u32> = (0..batch * predictions)
            .map(|_| below(config.vocab_size))
            .collect();
        let labels = loss::labels(&labels, config.vocab_size, "labels", device)?
            .reshape((batch, predictions))?;
        let weights = Tensor::ones((batch, predictions), DType::F32, device)?;
        let next: Vec<u32> = (0..batch).map(|i| (i % 2) as u32).collect();
        let next = loss::labels(&next, 2, "next-sentence labels", device)?;
        Ok(PreTrainingPass {
            loaded,
            inputs,
            masked,
            labels,
            weights,
            next,
            dropout: DropoutSource::new(3),
        })
    }

    /// The training-mode forward pass and its loss.
    fn loss(&self) -> Result<Tensor, ModelError> {
        self.loss_in(Mode::Train(&self.dropout))
    }

    /// The forward pass in `mode` and its loss.
    fn loss_in(&self, mode: Mode) -> Result<Tensor, ModelError> {
        let top = self.loaded.model.bert.encode_tokens(&self.inputs, mode)?;
        self.loss_from(&top)
    }

    /// The heads and the loss on the encoder's output `top`.
    fn loss_from(&self, top: &Tensor) -> Result<Tensor, ModelError> {
        self.loss_of(&self.loaded.model.heads(top, &self.inputs, &self.masked)?)
    }

    /// The loss of the heads' outputs `out`.
    fn loss_of(&self, out: &crate::bert::PreTrainingOutput) -> Result<Tensor, ModelError> {
        Ok(loss::pretraining_loss(
            &out.mlm_logits,
            &self.labels,
            &self.weights,
            &out.nsp_logits,
            &self.next,
        )?)
    }
}

/// Where a training pass's time goes, per pass (the mean over the timed passes).
#[derive(Debug, Clone, PartialEq)]
pub struct PassProfile {
    /// How the times were read.
    pub clock: Clock,
    /// The forward pass and loss.
    pub forward_seconds: f64,
    /// The backward pass.
    pub backward_seconds: f64,
    /// The host's time in the forward pass and loss, and in the backward pass: with
    /// [`Clock::Events`] on a GPU, what issuing them took (the device running behind); where
    /// it nears the device's own time, the pass is bound by the host. On the CPU, or with
    /// [`Clock::Synchronised`], the passes' whole time.
    pub host_seconds: (f64, f64),
    /// Each kernel of the forward pass (see [`Profiled`]), by name.
    pub kernels: BTreeMap<&'static str, KernelTime>,
    /// The backward passes of the fused ops, by the name of the kernel whose op each is (and
    /// `loss` for the fused loss). The pass is training's ([`crate::bert::BertModel::encoder_pass`]):
    /// the rest of its backward is the encoder's gradients added where two meet (by hand over
    /// the tape, where the kernels record) and candle's autograd for the embeddings, the heads
    /// and the loss (a zeroed gradient and an addition for every edge of their graph, and the
    /// backward passes of candle's own operations; the decoder's weight gradient handed over
    /// and added to the word embeddings' as the step adds it); where the kernels do not
    /// record, the encoder's backward is candle's autograd too.
    pub backward_kernels: BTreeMap<&'static str, KernelTime>,
}

/// Times `passes` training passes (forward, loss, backward) of `config` with `kernels`, after
/// one untimed pass, each kernel call timed by `clock` ([`Profiled`]; the device synchronised
/// once between passes, as a training step reads its loss back once): where a step's time
/// goes, on any device. With `inference`, the passes are inference's instead: parameters that
/// track no gradients (the kernels' inference paths), no dropout, the forward pass and loss
/// only.
#[allow(clippy::too_many_arguments)]
pub fn profile(
    config: &BertConfig,
    kernels: Arc<dyn Kernels>,
    dtype: DType,
    device: &Device,
    shape: CensusBatch,
    passes: usize,
    inference: bool,
    clock: Clock,
) -> Result<PassProfile, ModelError> {
    let mut pass = PreTrainingPass::build(config, dtype, device, shape, inference)?;
    let profiled = Arc::new(Profiled::new(kernels, clock));
    pass.loaded.model.bert.set_kernels(profiled.clone());
    let passes = passes.max(1);
    // Each timed pass's start, end of forward and end of backward, read at the end; and the
    // host's time in its forward and backward.
    let mut marks = Vec::with_capacity(passes);
    let mut host = (0.0, 0.0);
    for i in 0..=passes {
        if i == 1 {
            profiled.take()?;
            crate::kernels::time_backwards(Some(clock))?;
        }
        device.synchronize()?;
        let started = Mark::now(device, clock)?;
        let host_started = Instant::now();
        let host_forwarded;
        let forwarded;
        if inference {
            pass.loss_in(Mode::Eval)?;
            host_forwarded = Instant::now();
            forwarded = Mark::now(device, clock)?;
        } else {
            // A training pass as training runs it (`train::step`): the encoder's backward by
            // hand where the kernels record, the rest in candle's autograd.
            // The heads hand the decoder's gradient over as training's do
            // (`heads_handing_over`), added where the step adds it.
            let model = &pass.loaded.model;
            let encoder = model
                .bert
                .encoder_pass(&pass.inputs, Mode::Train(&pass.dropout), 0)?;
            let (out, sink) =
                model.heads_handing_over(encoder.top(), &pass.inputs, &pass.masked)?;
            let total = pass.loss_of(&out)?;
            host_forwarded = Instant::now();
            forwarded = Mark::now(device, clock)?;
            let mut store = total.backward()?;
            sink.add_to(&mut store)?;
            drop(encoder.backward(&store, |_| Ok::<(), ModelError>(()))?);
        }
        let host_ended = Instant::now();
        let ended = Mark::now(device, clock)?;
        if i > 0 {
            marks.push((started, forwarded, ended));
            host.0 += (host_forwarded - host_started).as_secs_f64();
            host.1 += (host_ended - host_forwarded).as_secs_f64();
        }
    }
    device.synchronize()?;
    let (mut forward, mut backward) = (0.0, 0.0);
    for (started, forwarded, ended) in &marks {
        forward += started.seconds_to(forwarded)?;
        backward += forwarded.seconds_to(ended)?;
    }
    let n = passes as f64;
    let per_pass = |times: BTreeMap<&'static str, KernelTime>| {
        times
            .into_iter()
            .map(|(name, t)| {
                let per_pass = KernelTime {
                    calls: t.calls / passes as u64,
                    seconds: t.seconds / n,
                    host_seconds: t.host_seconds / n,
                    flops: t.flops / n,
                };
                (name, per_pass)
            })
            .collect()
    };
    Ok(PassProfile {
        clock,
        forward_seconds: forward / n,
        backward_seconds: backward / n,
        host_seconds: (host.0 / n, host.1 / n),
        kernels: per_pass(profiled.take()?),
        backward_kernels: per_pass(crate::kernels::time_backwards(None)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Composed, Fused};

    #[test]
    fn fused_kernels_leave_fewer_operations_and_bytes_than_composed_ones() {
        let config = BertConfig {
            max_position_embeddings: 64,
            ..BertConfig::tiny(60)
        };
        let shape = CensusBatch {
            batch: 2,
            seq: 16,
            predictions: 3,
        };
        let cpu = &Device::Cpu;
        let composed = pretraining(&config, Arc::new(Composed), DType::F32, cpu, shape).unwrap();
        let fused =
            pretraining(&config, Arc::new(Fused::default()), DType::F32, cpu, shape).unwrap();
        eprintln!("composed {composed:?}\nfused {fused:?}");
        assert!(
            composed.layer.ops > 2 * fused.layer.ops,
            "{composed:?} {fused:?}"
        );
        assert!(composed.layer.bytes > fused.layer.bytes);
        assert!(
            fused.layer.ops > 5,
            "a layer is several operations: {fused:?}"
        );
        assert_eq!(
            composed.total.ops,
            composed.outside_layers.ops + 2 * composed.layer.ops
        );
        let timed_by = |inference, clock| {
            profile(
                &config,
                Arc::new(Fused::default()),
                DType::F32,
                cpu,
                shape,
                2,
                inference,
                clock,
            )
            .unwrap()
        };
        // Every kernel the fused pass calls is timed, twice a pass for the two layers' norms.
        let timed = timed_by(false, Clock::Synchronised);
        assert!(timed.forward_seconds > 0.0 && timed.backward_seconds > 0.0);
        assert_eq!(timed.kernels["residual_layer_norm"].calls, 4, "{timed:?}");
        assert_eq!(timed.kernels["attention"].calls, 2, "{timed:?}");
        // The masked-LM head's transform; the layers' feed-forward blocks are calls of their own.
        assert_eq!(timed.kernels["linear_gelu"].calls, 1, "{timed:?}");
        assert_eq!(timed.kernels["feed_forward"].calls, 2, "{timed:?}");
        let in_kernels: f64 = timed.kernels.values().map(|k| k.seconds).sum();
        assert!(in_kernels < timed.forward_seconds, "{timed:?}");
        // The products' operations a pass: each layer's feed-forward block two products of
        // `[tokens, h]` by `[h, i]`'s size, attention `4·len²·h` a sequence (all full here).
        let (tokens, h, i) = (
            (shape.batch * shape.seq) as f64,
            config.hidden_size as f64,
            config.intermediate_size as f64,
        );
        assert_eq!(
            timed.kernels["feed_forward"].flops,
            2.0 * 2.0 * 2.0 * tokens * h * i
        );
        let attention = 2.0 * shape.batch as f64 * 4.0 * (shape.seq as f64).powi(2) * h;
        assert_eq!(timed.kernels["attention"].flops, attention);
        assert_eq!(timed.kernels["layer_norm"].flops, 0.0);
        // Each fused op's backward pass is timed once per op, under the name of the kernel
        // (the `Kernels` method) that made it: a feed-forward block's two ops (its first
        // product a linear op) both under `feed_forward`, so that each method's backward is
        // its own calls'; together they are part of the backward pass, not all of it.
        for name in ["residual_layer_norm", "attention", "linear_gelu", "linear"] {
            assert_eq!(
                timed.backward_kernels[name].calls, timed.kernels[name].calls,
                "{name}: {timed:?}"
            );
        }
        assert_eq!(
            timed.backward_kernels["feed_forward"].calls,
            2 * timed.kernels["feed_forward"].calls,
            "{timed:?}"
        );
        // (The loss is not a kernel of the set: its ops are the heads'.)
        assert!(
            timed
                .backward_kernels
                .keys()
                .all(|name| *name == "loss" || timed.kernels.contains_key(name)),
            "a backward counted to a kernel the forward did not call: {timed:?}"
        );
        assert_eq!(timed.backward_kernels["loss"].calls, 2, "{timed:?}");
        let in_backwards: f64 = timed.backward_kernels.values().map(|k| k.seconds).sum();
        assert!(
            in_backwards > 0.0 && in_backwards < timed.backward_seconds,
            "{timed:?}"
        );
        // The host's time: within each call's by the same clock (on the CPU the host's, the
        // marks read around the host's own), and each part's kernels' within the part's.
        for k in timed
            .kernels
            .values()
            .chain(timed.backward_kernels.values())
        {
            assert!(
                k.host_seconds > 0.0 && k.host_seconds <= k.seconds,
                "{timed:?}"
            );
        }
        let host_in = |t: &BTreeMap<&'static str, KernelTime>| -> f64 {
            t.values().map(|k| k.host_seconds).sum()
        };
        assert!(host_in(&timed.kernels) <= timed.host_seconds.0, "{timed:?}");
        assert!(timed.host_seconds.0 <= timed.forward_seconds, "{timed:?}");
        assert!(
            host_in(&timed.backward_kernels) <= timed.host_seconds.1,
            "{timed:?}"
        );
        // Outside a profile nothing is timed.
        assert!(crate::kernels::time_backwards(None).unwrap().is_empty());
        // By the other clock (on the CPU the host's, without synchronising), the same calls.
        let by_events = timed_by(false, Clock::Events);
        assert_eq!(by_events.clock, Clock::Events);
        let calls = |t: &BTreeMap<&'static str, KernelTime>| {
            t.iter().map(|(n, k)| (*n, k.calls)).collect::<Vec<_>>()
        };
        assert_eq!(calls(&by_events.kernels), calls(&timed.kernels));
        assert_eq!(
            calls(&by_events.backward_kernels),
            calls(&timed.backward_kernels)
        );
        let in_kernels: f64 = by_events.kernels.values().map(|k| k.seconds).sum();
        assert!(
            in_kernels > 0.0 && in_kernels < by_events.forward_seconds,
            "{by_events:?}"
        );
        assert!(crate::kernels::time_backwards(None).unwrap().is_empty());
        // Inference's passes: the same kernels called, nothing tracked, no backward pass.
        let inference = timed_by(true, Clock::Synchronised);
        assert_eq!(inference.kernels["attention"].calls, 2, "{inference:?}");
        assert!(inference.backward_kernels.is_empty(), "{inference:?}");
        assert!(inference.backward_seconds < 1e-3, "{inference:?}");
        // The count is the graph's: the same pass counted twice gives the same figures.
        assert_eq!(
            pretraining(&config, Arc::new(Fused::default()), DType::F32, cpu, shape).unwrap(),
            fused
        );
    }
}
