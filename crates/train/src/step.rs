//! One optimiser step, shared by pre-training ([`crate::trainer`]) and fine-tuning (the tasks
//! crate): gradient accumulation over micro-batches, loss scaling, the reduction across
//! data-parallel ranks, the finiteness checks and the optimiser update.
//!
//! A micro-batch's forward and backward passes through a BERT encoder and a task's head are
//! [`Step::through_encoder`] ([`bertkit_model::BertModel::encoder_pass`]: the encoder's backward
//! by hand over the fused kernels' recorded ops, the embeddings and head in candle's
//! autograd, activation checkpointing by segments), which runs moves 2 below itself.
//!
//! A step is used in three moves:
//! 1. [`Step::begin`] takes the loss scale of the run's fp16 [`LossScaler`] (1 otherwise);
//! 2. [`Step::backward`] once per micro-batch: the caller's loss (already normalised so that the
//!    micro-batches' losses add up to the step's loss) is multiplied by the loss scale, and its
//!    gradients are divided by it again and added up in the optimiser's master dtype (f32).
//!    Activation checkpointing runs further backward passes from the returned gradients and
//!    adds them with [`Step::accumulate`];
//! 3. [`Step::finish`] flattens the gradients into one bucket, has the [`GradientReducer`]
//!    replace it by its sum over the ranks, measures the global norm, lets the scaler skip an
//!    overflowing fp16 step (or stops a run whose loss or gradients are not finite) and
//!    applies the optimiser. (One micro-batch on one process may go without the bucket,
//!    where the optimiser allows: [`Optimizer::hold_gradients`].)
//!
//! With data-parallel ranks, each rank's micro-batch losses are normalised by the whole
//! step's counts over all ranks (masked tokens, sequences), so the sum of the ranks'
//! gradients is the gradient of the global batch, exactly as one process with all the
//! micro-batches would compute it (the mean of per-rank means would weigh a token by how many
//! masked tokens its rank happened to hold). Every rank then applies the same update to the
//! same weights.

use std::collections::BTreeMap;

use bertkit_model::{BertModel, GradientSink, Gradients, Inputs, Mode};
use bertkit_stage_io::Ranks;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::TrainError;
use crate::bucket::{GradientSums, StepGradients};
use crate::optim::Optimizer;
use crate::scaler::LossScaler;

/// Combines the gradients of data-parallel ranks: one process needs nothing ([`Local`]);
/// MPI's all-reduce ([`crate::distributed`]) plugs in here, for pre-training and fine-tuning
/// at once. Collectives are called in the same order on every rank.
pub trait GradientReducer: std::fmt::Debug {
    /// Replaces the flat gradient bucket (every parameter's gradient, one 1-D tensor in the
    /// optimiser's layout, the same on every rank) by its sum over the ranks.
    fn all_reduce_sum(&self, bucket: &mut Tensor) -> Result<(), TrainError>;
    /// Replaces figures on the host (counts, loss sums) by their sums over the ranks.
    fn all_reduce_sum_host(&self, values: &mut [f64]) -> Result<(), TrainError>;
    /// This process's place and the number of ranks.
    fn ranks(&self) -> Ranks;
    /// The device this rank must compute on when the reducer is bound to one (NCCL: the GPU of
    /// the rank's local rank, whose stream the collectives run on); `None`: the run's own.
    fn device(&self) -> Option<candle_core::Device> {
        None
    }
    /// Stops every rank at once after an error on this one (a rank that stopped alone would
    /// leave the others waiting in a collective). One process: returns.
    fn abort(&self, code: i32);
}

/// The single-process reducer.
#[derive(Debug, Default, Clone, Copy)]
pub struct Local;

impl GradientReducer for Local {
    fn all_reduce_sum(&self, _bucket: &mut Tensor) -> Result<(), TrainError> {
        Ok(())
    }
    fn all_reduce_sum_host(&self, _values: &mut [f64]) -> Result<(), TrainError> {
        Ok(())
    }
    fn ranks(&self) -> Ranks {
        Ranks::single()
    }
    fn abort(&self, _code: i32) {}
}

/// One optimiser step's gradients, being accumulated.
///
/// Nothing is read back to the host until [`Step::finish`]: the loss of each micro-batch and
/// the caller's figures ([`Step::track`]) are added up on the device and read in one transfer
/// with the gradient norm. On CUDA that is the step's only wait for the device.
pub struct Step {
    /// The trainable parameters (cheap handles on the same storage).
    vars: BTreeMap<String, Var>,
    loss_scale: f64,
    grads: GradientSums,
    /// The step's loss so far (f64, on the device).
    loss: Option<Tensor>,
    /// The caller's figures so far (f64, on the device).
    figures: Option<Tensor>,
    /// Gradients ops hand over outside the graph ([`Step::hand_over`]), added to the next
    /// backward pass's.
    handed_over: Vec<GradientSink>,
}

/// What [`Step::finish`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// The step's loss: the sum of the micro-batches' losses given to [`Step::backward`].
    pub loss: f64,
    /// The caller's figures ([`Step::track`]), summed over the micro-batches.
    pub figures: Vec<f64>,
    /// Global gradient norm (after the reduction, before clipping).
    pub grad_norm: f64,
    /// The loss scale the step used (1 unless fp16).
    pub loss_scale: f64,
    /// Whether the optimiser applied the step (false: an fp16 overflow, skipped).
    pub applied: bool,
    /// Seconds the host waited at the step's one read-back for the device to finish the
    /// passes (on a GPU: the device's work the host had not caught up with; on the CPU, where
    /// each op runs as it is called, about nothing).
    pub wait_seconds: f64,
}

/// `sum + x`, starting from nothing.
/// A line where the device's pool grew (`BERTKIT_CUDA_POOL_TRACE=on`,
/// [`bertkit_model::trace_device_pool`]), at the step's stage `at`, on `on`'s device.
fn trace_pool(on: &Tensor, at: &str) {
    bertkit_model::trace_device_pool(on.device(), || at.to_string());
}

fn add_up(sum: Option<Tensor>, x: Tensor) -> Result<Tensor, TrainError> {
    Ok(match sum {
        Some(sum) => (sum + x)?,
        None => x,
    })
}

impl Step {
    /// Starts a step on the trainable `vars` (their names as the optimiser knows them).
    pub fn begin(
        vars: &BTreeMap<String, Var>,
        optimizer: &Optimizer,
        scaler: Option<&LossScaler>,
    ) -> Self {
        let loss_scale = scaler.map_or(1.0, |s| s.scale);
        Step {
            vars: vars.clone(),
            loss_scale,
            grads: optimizer.gradient_sums(loss_scale),
            loss: None,
            figures: None,
            handed_over: Vec::new(),
        }
    }

    /// Has the next backward pass ([`Step::backward`], [`Step::through_encoder`]) add what
    /// ops hand to `sink` to its gradients (the masked-LM decoder's of the word embeddings,
    /// [`bertkit_model::BertForPreTraining::heads_handing_over`]).
    pub fn hand_over(&mut self, sink: GradientSink) {
        self.handed_over.push(sink);
    }

    /// The loss scale of this step.
    pub fn loss_scale(&self) -> f64 {
        self.loss_scale
    }

    /// Back-propagates `loss` (a scalar: this micro-batch's share of the step's loss) times the
    /// loss scale, and adds the trainable parameters' gradients. Returns the whole gradient
    /// store (scaled), for callers that go on back-propagating by hand.
    pub fn backward(&mut self, loss: &Tensor) -> Result<GradStore, TrainError> {
        self.grads.settle()?;
        let store = self.scaled_backward(loss)?;
        self.accumulate(&store)?;
        Ok(store)
    }

    /// As [`Step::backward`], without adding the gradients to the step's.
    fn scaled_backward(&mut self, loss: &Tensor) -> Result<GradStore, TrainError> {
        let value = loss.detach().to_dtype(DType::F64)?.reshape(1)?;
        self.loss = Some(add_up(self.loss.take(), value)?);
        let mut store = if self.loss_scale != 1.0 {
            (loss * self.loss_scale)?.backward()?
        } else {
            loss.backward()?
        };
        for sink in self.handed_over.drain(..) {
            sink.add_to(&mut store)?;
        }
        Ok(store)
    }

    /// Adds a micro-batch's figures (a 1-D tensor of the same length each time: loss parts,
    /// counts of right predictions, …) to the step's; [`Step::finish`] reads their sums back
    /// with the gradient norm.
    pub fn track(&mut self, figures: &Tensor) -> Result<(), TrainError> {
        let value = figures.detach().to_dtype(DType::F64)?.flatten_all()?;
        self.figures = Some(add_up(self.figures.take(), value)?);
        Ok(())
    }

    /// Adds the trainable parameters' gradients in `store` (computed from the scaled loss).
    ///
    /// A micro-batch's gradients are kept as backward made them (in the compute dtype, scaled)
    /// and go into the flat bucket all at once, cast to the master dtype and unscaled, when the
    /// next micro-batch begins or the step ends (`crate::bucket`), not here, while the
    /// micro-batch's activations are still alive: with one micro-batch a step the f32 copies
    /// (4 bytes a parameter) are never held beside the activations, and one pass over the
    /// gradients leaves the step's traffic. The sums are the same values either way. (On the
    /// CPU the step's peak comes earlier, inside the backward pass, and did not move:
    /// BENCHMARKS.md.)
    pub fn accumulate(&mut self, store: &GradStore) -> Result<(), TrainError> {
        self.add_gradients(|t| store.get(t))
    }

    /// As [`Step::accumulate`], for gradients handed back by a backward pass run by hand
    /// ([`bertkit_model::EncoderBackward`]).
    pub fn accumulate_gradients(&mut self, grads: &Gradients) -> Result<(), TrainError> {
        self.add_gradients(|t| grads.get(t))
    }

    fn add_gradients<'g>(
        &mut self,
        grad_of: impl Fn(&Tensor) -> Option<&'g Tensor>,
    ) -> Result<(), TrainError> {
        for (name, var) in &self.vars {
            if let Some(g) = grad_of(var.as_tensor()) {
                self.grads.add(name, g)?;
            }
        }
        Ok(())
    }

    /// One micro-batch's forward and backward passes through `bert` and a head
    /// ([`BertModel::encoder_pass`]): the embeddings, the encoder layers, then `head`, which
    /// takes the last layer's output for the batch's tokens (`[tokens, hidden]`) and returns
    /// this micro-batch's share of the step's loss (it may [`Step::track`] figures); its
    /// backward (scaled, [`Step::backward`]), then the layers' (by hand over the kernels'
    /// tape where they record) and the embeddings'. Every gradient is added to the step's.
    /// `checkpoint_every` > 0 checkpoints segments of that many layers (0: every activation
    /// kept).
    pub fn through_encoder(
        &mut self,
        bert: &BertModel,
        inputs: &Inputs,
        mode: Mode,
        checkpoint_every: usize,
        head: impl FnOnce(&Tensor, &mut Step) -> Result<Tensor, TrainError>,
    ) -> Result<(), TrainError> {
        // The last micro-batch's gradients into the sums before this one's activations exist.
        self.grads.settle()?;
        let pass = bert.encoder_pass(inputs, mode, checkpoint_every)?;
        let loss = head(pass.top(), self)?;
        trace_pool(&loss, "the head and the loss");
        let mut store = self.scaled_backward(&loss)?;
        trace_pool(&loss, "the head's backward");
        drop(loss);
        let embeddings = pass.backward(&store, |grads| self.accumulate_gradients(&grads))?;
        // The head's and the embeddings' gradients as one graph's backward sums them (the
        // tied word embeddings get one from each), then added to the step's at once.
        if let Some(embeddings) = embeddings {
            embeddings.add_to(&mut store)?;
        }
        self.accumulate(&store)
    }

    /// The gradients so far (unscaled, in the master dtype), without stepping.
    pub fn into_gradients(self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        self.grads.into_gradients()
    }

    /// Ends the step: flattens the gradients into one bucket, has the reducer sum it over the
    /// ranks, measures the global norm, reads the norm, the loss and the tracked figures back
    /// in one transfer (then sums the loss and figures over the ranks), and applies the
    /// optimiser at learning rate `lr`. `step` (from 1)
    /// names the step in a divergence message. With fp16 the scaler decides whether the step
    /// is applied (and stops a run that keeps overflowing); otherwise a non-finite loss or
    /// gradient stops the run.
    pub fn finish(
        self,
        reducer: &dyn GradientReducer,
        optimizer: &mut Optimizer,
        scaler: Option<&mut LossScaler>,
        lr: f64,
        step: u64,
    ) -> Result<StepOutcome, TrainError> {
        let Step {
            grads,
            loss,
            figures,
            loss_scale,
            handed_over,
            ..
        } = self;
        if !handed_over.is_empty() {
            return Err(TrainError::Candle(candle_core::Error::Msg(format!(
                "{} gradient sink(s) handed over with no backward pass after them: the step \
                 would miss their gradients",
                handed_over.len()
            ))));
        }
        // One process has nothing to reduce: its one micro-batch's gradients may go to the
        // norm and the update as the backward made them, without the bucket
        // ([`Optimizer::hold_gradients`]).
        let hold = reducer.ranks().world_size == 1 && optimizer.holds_gradients();
        let mut gradients = optimizer.step_gradients(grads, hold)?;
        if let StepGradients::Bucket(bucket) = &mut gradients {
            reducer.all_reduce_sum(bucket)?;
            trace_pool(bucket, "the gradient bucket");
        }
        let squared_norm = optimizer.squared_norm_of(&gradients)?.reshape(1)?;
        let loss = match loss {
            Some(loss) => loss,
            None => Tensor::zeros(1, DType::F64, squared_norm.device())?,
        };
        let mut read = vec![loss, squared_norm];
        read.extend(figures);
        // The step's one read-back.
        let read = Tensor::cat(&read, 0)?;
        let waiting = std::time::Instant::now();
        let mut host = read.to_vec1::<f64>()?;
        let wait_seconds = waiting.elapsed().as_secs_f64();
        let grad_norm = host.remove(1).sqrt();
        reducer.all_reduce_sum_host(&mut host)?;
        let (loss, figures) = (host[0], host[1..].to_vec());
        let applied = match scaler {
            Some(s) => s.update(grad_norm.is_finite(), step)?,
            None => {
                if !grad_norm.is_finite() || !loss.is_finite() {
                    return Err(TrainError::Diverged(format!(
                        "step {step}: loss {loss} and gradient norm {grad_norm} are not finite"
                    )));
                }
                true
            }
        };
        if applied {
            optimizer.update(&gradients, lr, optimizer.clip_factor(grad_norm))?;
            trace_pool(&read, "the optimiser's update");
        }
        Ok(StepOutcome {
            loss,
            figures,
            grad_norm,
            loss_scale,
            applied,
            wait_seconds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TrainError;
    use crate::optim::{OptimizerConfig, Rule};
    use candle_core::Device;

    fn setup() -> (BTreeMap<String, Var>, Optimizer) {
        setup_with(Rule::Adamw)
    }

    fn setup_with(rule: Rule) -> (BTreeMap<String, Var>, Optimizer) {
        let mut vars = BTreeMap::new();
        vars.insert(
            "encoder.weight".to_string(),
            Var::from_tensor(&Tensor::new(&[1f32, -2., 3.], &Device::Cpu).unwrap()).unwrap(),
        );
        let config = OptimizerConfig {
            rule,
            ..OptimizerConfig::lamb()
        };
        let optimizer = Optimizer::new(config, &vars).unwrap();
        (vars, optimizer)
    }

    fn weights(vars: &BTreeMap<String, Var>) -> Vec<f32> {
        vars["encoder.weight"].as_tensor().to_vec1::<f32>().unwrap()
    }

    /// A loss whose gradient is `factor` times the weights (`factor / 2 · Σ w²`).
    fn loss(vars: &BTreeMap<String, Var>, factor: f64) -> Tensor {
        let w = vars["encoder.weight"].as_tensor();
        ((w * w).unwrap().sum_all().unwrap() * (factor / 2.0)).unwrap()
    }

    /// A step of one micro-batch on one process without the bucket
    /// ([`Optimizer::hold_gradients`]) takes the bucket's step: the same loss, gradient norm
    /// and weights, bit for bit, at fp16's loss scale (the gradients read times its inverse),
    /// clipped or not, with either rule; and a step of two micro-batches makes the bucket as
    /// before. (Tried: the held norm without the unscale
    /// factor fails here.)
    #[test]
    fn a_step_without_the_bucket_is_the_buckets_step() {
        for rule in [Rule::Adamw, Rule::Lamb] {
            let (bucket_vars, mut bucket) = setup_with(rule);
            let (held_vars, mut held) = setup_with(rule);
            bucket.hold_gradients(false);
            held.hold_gradients(true);
            let (mut bucket_scaler, mut held_scaler) = (LossScaler::new(3), LossScaler::new(3));
            for (n, factor, micro_batches) in
                [(1, 1.0, 1), (2, -300.0, 1), (3, 0.5, 2), (4, 2.0, 1)]
            {
                let mut outcomes = Vec::new();
                for (vars, optimizer, scaler) in [
                    (&bucket_vars, &mut bucket, &mut bucket_scaler),
                    (&held_vars, &mut held, &mut held_scaler),
                ] {
                    let mut step = Step::begin(vars, optimizer, Some(scaler));
                    for _ in 0..micro_batches {
                        step.backward(&loss(vars, factor / micro_batches as f64))
                            .unwrap();
                    }
                    let outcome = step.finish(&Local, optimizer, Some(scaler), 1e-2, n);
                    outcomes.push(outcome.unwrap());
                }
                let (b, h) = (&outcomes[0], &outcomes[1]);
                assert!(b.applied && h.applied && b.loss_scale > 1.0, "{b:?}");
                assert_eq!((b.loss, b.grad_norm), (h.loss, h.grad_norm), "step {n}");
                assert_eq!(
                    weights(&held_vars),
                    weights(&bucket_vars),
                    "{rule:?} step {n}"
                );
                assert_ne!(weights(&held_vars), [1.0, -2.0, 3.0]);
            }
        }
    }

    /// fp16 overflow: an infinite gradient leaves the weights unchanged, counts the skip and
    /// halves the scale; a finite step then applies; `max_skipped_in_row` overflows in a row
    /// stop the run with its message. (Tried: `finish` stepping the optimiser even when the
    /// scaler skips fails here.)
    #[test]
    fn an_overflowing_step_is_skipped_and_a_streak_of_them_stops_the_run() {
        let (vars, mut optimizer) = setup();
        let mut scaler = LossScaler::new(3);
        let start = weights(&vars);
        let mut step = Step::begin(&vars, &optimizer, Some(&scaler));
        assert_eq!(step.loss_scale(), 65536.0);
        step.backward(&loss(&vars, f64::INFINITY)).unwrap();
        let outcome = step
            .finish(&Local, &mut optimizer, Some(&mut scaler), 1e-2, 1)
            .unwrap();
        assert!(!outcome.applied);
        assert!(!outcome.grad_norm.is_finite());
        assert_eq!(outcome.loss_scale, 65536.0);
        assert_eq!(
            weights(&vars),
            start,
            "a skipped step must not move the weights"
        );
        assert_eq!(
            (scaler.scale, scaler.skipped, scaler.skipped_in_row),
            (32768.0, 1, 1)
        );

        // A finite step at the halved scale applies, with the gradients unscaled: the norm is
        // that of the weights themselves (factor 1).
        let mut step = Step::begin(&vars, &optimizer, Some(&scaler));
        step.backward(&loss(&vars, 1.0)).unwrap();
        let outcome = step
            .finish(&Local, &mut optimizer, Some(&mut scaler), 1e-2, 2)
            .unwrap();
        assert!(outcome.applied);
        assert!(
            (outcome.grad_norm - 14f64.sqrt()).abs() < 1e-6,
            "{}",
            outcome.grad_norm
        );
        assert_ne!(weights(&vars), start);
        assert_eq!(scaler.skipped_in_row, 0);

        let mut result = Ok(outcome);
        for n in 3..=5 {
            let mut step = Step::begin(&vars, &optimizer, Some(&scaler));
            step.backward(&loss(&vars, f64::INFINITY)).unwrap();
            result = step.finish(&Local, &mut optimizer, Some(&mut scaler), 1e-2, n);
            if result.is_err() {
                break;
            }
        }
        match result {
            Err(TrainError::Diverged(message)) => {
                assert!(message.contains("3 steps in a row"), "{message}");
                assert!(message.contains("step 5"), "{message}");
            }
            other => panic!("expected the run to stop, got {other:?}"),
        }
        assert_eq!((scaler.skipped, scaler.scale), (4, 4096.0));
    }

    /// Without a scaler (f32, bf16) a non-finite loss or gradient stops the run at once.
    #[test]
    fn a_non_finite_step_without_a_scaler_stops_the_run() {
        let (vars, mut optimizer) = setup();
        let start = weights(&vars);
        let mut step = Step::begin(&vars, &optimizer, None);
        step.backward(&loss(&vars, f64::NAN)).unwrap();
        let err = step
            .finish(&Local, &mut optimizer, None, 1e-2, 1)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("step 1") && err.contains("not finite"),
            "{err}"
        );
        assert_eq!(weights(&vars), start);
    }

    /// A gradient sink handed over after the last backward pass would be lost: the step
    /// refuses to finish, the weights untouched. Handed over before one, its gradient is
    /// added (an empty sink, as candle's ops leave it, adds nothing).
    #[test]
    fn a_sink_handed_over_after_the_last_backward_pass_stops_the_step() {
        let (vars, mut optimizer) = setup();
        let start = weights(&vars);
        let mut step = Step::begin(&vars, &optimizer, None);
        step.hand_over(GradientSink::new(vars["encoder.weight"].as_tensor()));
        step.backward(&loss(&vars, 1.0)).unwrap();
        step.hand_over(GradientSink::new(vars["encoder.weight"].as_tensor()));
        let err = step
            .finish(&Local, &mut optimizer, None, 1e-2, 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no backward pass after them"), "{err}");
        assert_eq!(weights(&vars), start);
    }

    /// Micro-batches add up: two halves of a loss give the gradient of the whole.
    #[test]
    fn micro_batches_accumulate() {
        let (vars, optimizer) = setup();
        let mut halves = Step::begin(&vars, &optimizer, None);
        halves.backward(&loss(&vars, 0.5)).unwrap();
        halves.backward(&loss(&vars, 0.5)).unwrap();
        let mut whole = Step::begin(&vars, &optimizer, None);
        whole.backward(&loss(&vars, 1.0)).unwrap();
        let g = |s: Step| {
            s.into_gradients().unwrap()["encoder.weight"]
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(g(halves), vec![1.0, -2.0, 3.0]);
        assert_eq!(g(whole), vec![1.0, -2.0, 3.0]);
    }

    /// In half precision a micro-batch's gradients stay in the compute dtype until the next
    /// micro-batch begins (then they go into the f32 bucket, and the new ones are held)
    /// or the bucket is made: one micro-batch holds no f32 copies, and the values are those
    /// of casting first, in both forms of the sums (the flat bucket, by name).
    #[test]
    fn half_precision_gradients_are_cast_when_they_meet() {
        let cpu = &Device::Cpu;
        let w = [0.1f32, -0.7, 2.5, 3.3];
        let mut vars = BTreeMap::new();
        vars.insert(
            "encoder.weight".to_string(),
            Var::from_tensor(&Tensor::new(&w, cpu).unwrap().to_dtype(DType::BF16).unwrap())
                .unwrap(),
        );
        let optimizer = Optimizer::new(OptimizerConfig::lamb(), &vars).unwrap();
        // The bf16 gradient of one micro-batch, as f32.
        let gradient = |factor: f64| -> Vec<f32> {
            let store = loss(&vars, factor)
                .to_dtype(DType::BF16)
                .unwrap()
                .backward()
                .unwrap();
            let g = store.get(vars["encoder.weight"].as_tensor()).unwrap();
            assert_eq!(g.dtype(), DType::BF16);
            g.to_dtype(DType::F32).unwrap().to_vec1().unwrap()
        };
        let (first, second) = (gradient(0.3), gradient(0.9));
        let by_name = GradientSums::ByName {
            master: DType::F32,
            loss_scale: 1.0,
            sums: BTreeMap::new(),
        };
        for sums in [optimizer.gradient_sums(1.0), by_name] {
            let flat = matches!(sums, GradientSums::Flat(_));
            let mut step = Step::begin(&vars, &optimizer, None);
            step.grads = sums;
            step.backward(&loss(&vars, 0.3).to_dtype(DType::BF16).unwrap())
                .unwrap();
            assert_eq!(step.grads.held_dtype("encoder.weight"), Some(DType::BF16));
            step.backward(&loss(&vars, 0.9).to_dtype(DType::BF16).unwrap())
                .unwrap();
            // The flat sums hold the second micro-batch's as made, the first in the bucket.
            let held = if flat { DType::BF16 } else { DType::F32 };
            assert_eq!(step.grads.held_dtype("encoder.weight"), Some(held));
            let sum: Vec<f32> = step.into_gradients().unwrap()["encoder.weight"]
                .to_vec1()
                .unwrap();
            for i in 0..w.len() {
                assert_eq!(sum[i], first[i] + second[i], "element {i}, flat {flat}");
            }
        }
        // The bucket casts what is still in the compute dtype.
        let mut one = Step::begin(&vars, &optimizer, None);
        one.backward(&loss(&vars, 0.3).to_dtype(DType::BF16).unwrap())
            .unwrap();
        let bucket = optimizer.bucket(one.grads).unwrap();
        assert_eq!(bucket.dtype(), DType::F32);
        assert_eq!(bucket.to_vec1::<f32>().unwrap(), first);
    }

    /// The encoder pass (the heads under candle's autograd, the embeddings' and the layers'
    /// backward by hand over the fused kernels' tape, with or without checkpointed segments)
    /// gives the gradients of candle's autograd over the whole graph, bit for bit but for one
    /// sum's order, for every parameter, with dropout on.
    #[test]
    fn the_encoder_pass_gives_the_whole_graphs_gradients() {
        use bertkit_model::bert::{BertForPreTraining, init};
        use bertkit_model::{BertConfig, DropoutSource, Inputs, MaskedPositions, loss};

        let cpu = &Device::Cpu;
        let config = BertConfig::tiny(60);
        let loaded = init::<BertForPreTraining>(&config, DType::F32, cpu, 5).unwrap();
        let model = &loaded.model;
        let vars = loaded.params.vars();
        let optimizer = Optimizer::new(OptimizerConfig::lamb(), vars).unwrap();
        let ids = Tensor::new(
            &[
                [2u32, 11, 12, 13, 3, 21, 22, 3, 0],
                [2, 31, 32, 33, 34, 35, 3, 41, 3],
            ],
            cpu,
        )
        .unwrap();
        let mask = ids.ne(0u32).unwrap().to_dtype(DType::U32).unwrap();
        let inputs = Inputs::new(&config, &ids, None, Some(&mask)).unwrap();
        let positions = MaskedPositions::from_host((2, 2), &[1, 6, 2, 7], 9, cpu).unwrap();
        let labels = Tensor::new(&[[11u32, 22], [32, 41]], cpu).unwrap();
        let weights = Tensor::new(&[[1f32, 1.], [1., 1.]], cpu).unwrap();
        let nsp = Tensor::new(&[0u32, 1], cpu).unwrap();
        let objective = |out: bertkit_model::PreTrainingOutput| {
            loss::pretraining_loss(&out.mlm_logits, &labels, &weights, &out.nsp_logits, &nsp)
        };
        let source = DropoutSource::new(9);

        source.start_batch(4, 0);
        let out = model
            .forward(&inputs, &positions, Mode::Train(&source))
            .unwrap();
        let mut whole = Step::begin(vars, &optimizer, None);
        whole.backward(&objective(out).unwrap()).unwrap();
        let whole = whole.into_gradients().unwrap();
        assert_eq!(whole.len(), vars.len());

        for every in [0, 1, 2] {
            source.start_batch(4, 0);
            let mut step = Step::begin(vars, &optimizer, None);
            step.through_encoder(
                &model.bert,
                &inputs,
                Mode::Train(&source),
                every,
                |top, step| {
                    // The decoder's gradient of the tied table handed over (the fused CPU
                    // linear hands it): the step adds it, as the trainer's does.
                    let (out, sink) = model.heads_handing_over(top, &inputs, &positions)?;
                    step.hand_over(sink);
                    Ok(objective(out)?)
                },
            )
            .unwrap();
            let ours = step.into_gradients().unwrap();
            assert_eq!(ours.len(), vars.len(), "checkpointing every {every}");
            for (name, g) in &whole {
                let (a, b) = (
                    ours[name].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                assert!(scale > 0.0, "{name}: a zero gradient");
                let worst = a
                    .iter()
                    .zip(&b)
                    .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                // The same ops in the same order give the same bits, but for the tied word
                // embeddings: the whole graph adds the lookup's rows into the decoder's
                // gradient one by one, the pass adds the two gradients once made (the
                // decoder's handed over outside the graph).
                let bound = if name == "embeddings.word_embeddings.weight" {
                    1e-6 * scale
                } else {
                    0.0
                };
                assert!(
                    worst <= bound,
                    "{name}, checkpointing every {every}: {worst} of {scale}"
                );
            }
        }
        // Both backwards ran by hand.
        assert_eq!(model.bert.tape_refused(), None);
        assert_eq!(model.bert.embeddings_tape_refused(), None);

        // Kernels that do not record, every activation kept: the pass is the whole graph,
        // the same bits for every parameter.
        let mut composed = model.clone();
        composed
            .bert
            .set_kernels(std::sync::Arc::new(bertkit_model::Composed));
        source.start_batch(4, 0);
        let out = composed
            .forward(&inputs, &positions, Mode::Train(&source))
            .unwrap();
        let mut whole = Step::begin(vars, &optimizer, None);
        whole.backward(&objective(out).unwrap()).unwrap();
        source.start_batch(4, 0);
        let mut step = Step::begin(vars, &optimizer, None);
        step.through_encoder(
            &composed.bert,
            &inputs,
            Mode::Train(&source),
            0,
            |top, _| Ok(objective(composed.heads(top, &inputs, &positions)?)?),
        )
        .unwrap();
        let (ours, whole) = (
            step.into_gradients().unwrap(),
            whole.into_gradients().unwrap(),
        );
        assert_eq!(ours.len(), vars.len());
        for (name, g) in &whole {
            let same = (&ours[name] - g).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(same.to_scalar::<f32>().unwrap(), 0.0, "{name}");
        }
    }
}
