//! Optimisers with f32 master weights: LAMB (NVIDIA's BERT recipe) and AdamW (fine-tuning).
//!
//! Whatever the compute dtype of the model, the optimiser keeps an f32 (or f64, in f64 runs)
//! master copy of every parameter and its two moments; after each step the model's parameters
//! are overwritten with the master weights cast to the compute dtype.
//!
//! Both optimisers, per step:
//! 1. the global gradient norm over all parameters; gradients scaled by
//!    `1 / max(1, norm / max_grad_norm)` (clipping before the moment updates, as NVIDIA's LAMB);
//! 2. `m = β1·m + (1-β1)·g`, `v = β2·v + (1-β2)·g²`, bias-corrected `m̂ = m / (1-β1ᵗ)`,
//!    `v̂ = v / (1-β2ᵗ)`;
//! 3. `u = m̂ / (√v̂ + ε) + λ·w`, with weight decay `λ` 0 for biases and LayerNorm parameters;
//! 4. AdamW: `w -= lr·u`. LAMB: `w -= lr·r·u` with the trust ratio `r = ‖w‖ / ‖u‖` (1 when either
//!    norm is 0) for parameters with weight decay, and `r = 1` for the excluded ones, as apex's
//!    FusedLAMB does by default (NVIDIA's BERT scripts).
//!
//! Gradients arrive as one flat bucket (the layout [`Optimizer::flatten`] makes); the update
//! reads nothing back to the host, so on CUDA a step queues its kernels without waiting.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::bucket::{Entry, FlatSums, GradientSums, Layout, StepGradients};

/// Which update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rule {
    /// Layer-wise adaptive moments (pre-training).
    Lamb,
    /// Adam with decoupled weight decay (fine-tuning).
    Adamw,
}

/// Optimiser hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// The rule.
    pub rule: Rule,
    /// β1.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// β2.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// ε.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay (not applied to biases and LayerNorm).
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Global gradient-norm clipping (0 = none).
    #[serde(default = "default_max_grad_norm")]
    pub max_grad_norm: f64,
}

fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-6
}
fn default_weight_decay() -> f64 {
    0.01
}
fn default_max_grad_norm() -> f64 {
    1.0
}

impl OptimizerConfig {
    /// NVIDIA's LAMB settings.
    pub fn lamb() -> Self {
        OptimizerConfig {
            rule: Rule::Lamb,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
        }
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(format!("[optimizer] {m}")));
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return bad(format!(
                "beta1 {} and beta2 {} must be in [0, 1)",
                self.beta1, self.beta2
            ));
        }
        if self.eps <= 0.0 || self.weight_decay < 0.0 || self.max_grad_norm < 0.0 {
            return bad("eps must be positive, weight_decay and max_grad_norm not negative".into());
        }
        Ok(())
    }
}

/// Whether weight decay applies to a parameter (not to biases and LayerNorm).
pub fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.contains("LayerNorm") || name.ends_with("predictions.bias"))
}

/// Most elements one group holds, so that the update's temporaries stay small (128 MB in f32)
/// whatever the model's size; a single larger parameter is a group of its own.
pub const GROUP_ELEMENTS: usize = 1 << 25;

/// Parameters of one shape and one weight-decay setting, kept as the rows of `[count, numel]`
/// buffers: the master weights and both moments of a group are three tensors, its gradients a
/// slice of the flat gradient bucket, and every per-parameter figure (the LAMB norms) one row
/// reduction, all on the device.
#[derive(Debug)]
struct Group {
    names: Vec<String>,
    vars: Vec<Var>,
    shape: Vec<usize>,
    decay: bool,
    /// Where the group's gradients start in the flat bucket.
    offset: usize,
    /// Its first parameter's place among the layout's entries.
    first_entry: usize,
    master: Tensor,
    m: Tensor,
    v: Tensor,
    /// The in-place update's `[3, rows, numel]` buffer (the CPU's; CUDA's when turned on), of
    /// which `master`, `m` and `v` are then views: made with the group where the update runs
    /// in place (`fresh_state`), else at the first in-place update; `None` once any other
    /// update has replaced them.
    packed: Option<Tensor>,
}

impl Group {
    fn count(&self) -> usize {
        self.vars.len()
    }

    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// This group's rows of the flat gradient bucket (a view).
    fn gradients(&self, bucket: &Tensor) -> Result<Tensor, TrainError> {
        let (count, numel) = (self.count(), self.numel());
        Ok(bucket
            .narrow(0, self.offset, count * numel)?
            .reshape((count, numel))?)
    }

    /// This group's `[count, numel]` gradients of a step, in the master's dtype: its rows of
    /// the bucket, or its held gradients gathered.
    fn step_gradients(&self, gradients: &StepGradients) -> Result<Tensor, TrainError> {
        match gradients {
            StepGradients::Bucket(bucket) => self.gradients(bucket),
            StepGradients::Held { gradients, unscale } => crate::bucket::held_rows(
                self.own(gradients),
                *unscale,
                self.numel(),
                self.master.dtype(),
                self.master.device(),
            ),
        }
    }

    /// This group's entries of `held` (every parameter's, in the layout's order): one a row.
    fn own<'g>(&self, held: &'g [Option<Tensor>]) -> &'g [Option<Tensor>] {
        &held[self.first_entry..self.first_entry + self.count()]
    }

    /// Row `i` in the parameter's shape (a view).
    fn row(&self, buffer: &Tensor, i: usize) -> Result<Tensor, TrainError> {
        Ok(buffer.get(i)?.reshape(self.shape.as_slice())?)
    }

    /// `[count]` sums of squares of the rows of `x` (`[count, numel]`), in f64: squared in the
    /// master dtype, added along the parameter's last dimension, then in f64 (a plain sum of
    /// millions of f32 squares would lose digits).
    fn row_squares(&self, x: &Tensor) -> Result<Tensor, TrainError> {
        let inner = self.shape.last().copied().unwrap_or(1).max(1);
        let outer = self.numel() / inner;
        Ok(x.reshape((self.count(), outer, inner))?
            .sqr()?
            .sum(2)?
            .to_dtype(DType::F64)?
            .sum(1)?)
    }

    /// The group's state as one `[3, rows, numel]` buffer (weights, first and second moments)
    /// that `master`, `m` and `v` view: packed once, then updated in place.
    fn packed_state(&mut self) -> Result<Tensor, TrainError> {
        if let Some(state) = &self.packed {
            return Ok(state.clone());
        }
        let state = Tensor::stack(&[&self.master, &self.m, &self.v], 0)?;
        (self.master, self.m, self.v) = (state.get(0)?, state.get(1)?, state.get(2)?);
        self.packed = Some(state.clone());
        Ok(state)
    }

    /// Sets the model's parameters from the master weights (cast to each one's dtype). Members
    /// of one dtype are cast together, the whole buffer at once (one launch on CUDA where one
    /// per member took hundreds a step), then each is set from its row.
    fn write_back(&self) -> Result<(), TrainError> {
        let mut cast: Option<(DType, Tensor)> = None;
        for (i, var) in self.vars.iter().enumerate() {
            let dtype = var.dtype();
            if cast.as_ref().is_none_or(|(d, _)| *d != dtype) {
                cast = Some((dtype, self.master.to_dtype(dtype)?));
            }
            let (_, buffer) = cast.as_ref().expect("set above");
            var.set(&self.row(buffer, i)?)?;
        }
        Ok(())
    }
}

/// Whether the update of `master_dtype` state on `device` runs in place on a packed
/// `[3, rows, numel]` buffer a group (the CPU's f32 update, and CUDA's), on the flat gradient
/// bucket; the composed update (other dtypes and devices) by parameter.
fn updates_in_place(device: &candle_core::Device, master_dtype: DType) -> bool {
    master_dtype == DType::F32 && (device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda()))
}

/// A new group's state from its master weights: `(master, m, v, packed)`, the moments zeros.
/// Where the update runs in place (`in_place`), the three are views of one `[3, rows, numel]`
/// buffer made here, at the start, rather than at the first step's update: there the packing
/// copied all the state (BERT-large: 4 GB) into new buffers group by group while the old ones
/// were still held, on a GPU after the backward had scattered its gradients over what the
/// activations freed, and left the old state's buffers as holes in the device pool.
fn fresh_state(
    master: Tensor,
    in_place: bool,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>), TrainError> {
    if !in_place {
        let (m, v) = (master.zeros_like()?, master.zeros_like()?);
        return Ok((master, m, v, None));
    }
    let (rows, numel) = master.dims2()?;
    let state = Tensor::zeros((3, rows, numel), master.dtype(), master.device())?;
    state.slice_set(&master.unsqueeze(0)?, 0, 0)?;
    Ok((state.get(0)?, state.get(1)?, state.get(2)?, Some(state)))
}

/// The optimiser over a model's parameters.
///
/// Its state lives in a few buffers per parameter shape (see `Group`), and a step reads
/// nothing back to the host: the gradient norm comes in (computed by [`Optimizer::squared_norm`]
/// and read once per step by the caller, [`crate::step::Step::finish`]), and LAMB's trust
/// ratios are computed and applied on the device.
#[derive(Debug)]
pub struct Optimizer {
    config: OptimizerConfig,
    groups: Vec<Group>,
    /// Where each parameter's gradient sits in the flat bucket (the groups' members in order).
    layout: Arc<Layout>,
    /// The CPU update's room for one parameter's update between its two passes, kept across
    /// steps (see `cpu_update::update_in_place`).
    scratch: Vec<f32>,
    step: u64,
    master_dtype: DType,
    /// Whether a step of one micro-batch on one process may go without the bucket
    /// ([`Optimizer::hold_gradients`]).
    holds_gradients: bool,
}

impl Optimizer {
    /// State for `vars`; master weights and moments in f32 (f64 if the model is f64).
    pub fn new(config: OptimizerConfig, vars: &BTreeMap<String, Var>) -> Result<Self, TrainError> {
        config.validate()?;
        let master_dtype = if vars.values().any(|v| v.dtype() == DType::F64) {
            DType::F64
        } else {
            DType::F32
        };
        // Groups in (shape, decay) order, members in name order: the same layout on every
        // process, so a data-parallel all-reduce of the flat bucket lines up.
        type Kind = (Vec<usize>, bool);
        let mut by_kind: BTreeMap<Kind, Vec<(&String, &Var)>> = BTreeMap::new();
        for (name, var) in vars {
            by_kind
                .entry((var.dims().to_vec(), decays(name)))
                .or_default()
                .push((name, var));
        }
        let mut groups = Vec::new();
        let mut entries = Vec::new();
        let mut offset = 0;
        let in_place = vars
            .values()
            .next()
            .is_some_and(|v| updates_in_place(v.device(), master_dtype));
        for ((shape, decay), members) in by_kind {
            let numel: usize = shape.iter().product::<usize>().max(1);
            let per_group = (GROUP_ELEMENTS / numel).max(1);
            for chunk in members.chunks(per_group) {
                let rows = chunk
                    .iter()
                    .map(|(_, var)| {
                        var.as_tensor()
                            .detach()
                            .to_dtype(master_dtype)?
                            .flatten_all()
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                let master = Tensor::stack(&rows, 0)?;
                drop(rows);
                let (master, m, v, packed) = fresh_state(master, in_place)?;
                let first_entry = entries.len();
                for (i, (name, _)) in chunk.iter().enumerate() {
                    entries.push(Entry {
                        name: (*name).clone(),
                        shape: shape.clone(),
                        offset: offset + i * numel,
                    });
                }
                groups.push(Group {
                    names: chunk.iter().map(|(n, _)| (*n).clone()).collect(),
                    vars: chunk.iter().map(|(_, v)| (*v).clone()).collect(),
                    shape: shape.clone(),
                    decay,
                    offset,
                    first_entry,
                    m,
                    v,
                    master,
                    packed,
                });
                offset += chunk.len() * numel;
            }
        }
        Ok(Optimizer {
            config,
            groups,
            layout: Arc::new(Layout::new(entries)?),
            scratch: Vec::new(),
            step: 0,
            master_dtype,
            holds_gradients: true,
        })
    }

    /// Lets a step go without the flat gradient bucket where it needs none (the default): one
    /// micro-batch a step on one process (nothing to add up, nothing to all-reduce), the sums
    /// on the flat bucket's path (an f32 update on the CPU or CUDA). The gradients stay as the
    /// backward made
    /// them (the compute dtype, times the loss scale); the global norm is summed over them
    /// (`pieces_squares_partial` on CUDA) and the update's first launch reads each parameter's
    /// own (`update_moments_in_place_held`, `update_in_place_one_pass_held`), unscaling as it
    /// reads: the values the bucket would have held, bit for bit. On the CPU each group's rows
    /// are gathered in turn (at most [`GROUP_ELEMENTS`] at once) for the CPU's update.
    ///
    /// BERT-large's bucket is 1.34 GB of f32 found at each step's end, after the backward has
    /// scattered the parameters' gradients over what the activations freed, and 4.7 GB of the
    /// step's traffic (the gradients read and the bucket written, then read by its norm and by
    /// the update), where the held gradients are read twice in bf16 (1.3 GB). The same steps
    /// either way: off, for the tests and checks that compare them.
    pub fn hold_gradients(&mut self, on: bool) {
        self.holds_gradients = on;
    }

    /// Optimiser steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The dtype of master weights, moments and gradient accumulators.
    pub fn master_dtype(&self) -> DType {
        self.master_dtype
    }

    /// Scalars in the flat gradient bucket (every trainable parameter's).
    pub fn elements(&self) -> usize {
        self.layout.elements()
    }

    /// The flat gradient bucket: every parameter's gradient in the optimiser's order, in the
    /// master dtype, one 1-D tensor (what one all-reduce call takes). A parameter without a
    /// gradient contributes zeros. The gradients are added as a step adds them
    /// (`Optimizer::gradient_sums`).
    pub fn flatten(&self, grads: BTreeMap<String, Tensor>) -> Result<Tensor, TrainError> {
        let mut sums = self.gradient_sums(1.0);
        for (name, g) in grads {
            sums.add(&name, &g)?;
        }
        self.bucket(sums)
    }

    /// A step's gradient `sums` as its norm and update read them: held as the backward made
    /// them where `hold` allows and the sums are one micro-batch's on the flat bucket's path
    /// ([`crate::bucket::FlatSums::into_step_gradients`]), else the flat bucket.
    pub(crate) fn step_gradients(
        &self,
        sums: GradientSums,
        hold: bool,
    ) -> Result<StepGradients, TrainError> {
        match sums {
            GradientSums::Flat(flat) => flat.into_step_gradients(&self.device(), hold),
            by_name => Ok(StepGradients::Bucket(self.bucket(by_name)?)),
        }
    }

    /// The flat bucket of a step's gradient `sums` ([`Optimizer::flatten`]'s layout).
    pub(crate) fn bucket(&self, sums: GradientSums) -> Result<Tensor, TrainError> {
        match sums {
            GradientSums::Flat(flat) => flat.into_bucket(&self.device()),
            GradientSums::ByName { sums, .. } => self.flatten_by_name(sums),
        }
    }

    /// A step's gradient sums for gradients computed at `loss_scale`: the flat bucket for an f32
    /// update on the CPU or CUDA; by parameter otherwise (the composed update).
    pub(crate) fn gradient_sums(&self, loss_scale: f64) -> GradientSums {
        if self.on_flat_bucket() {
            GradientSums::Flat(FlatSums::new(
                self.layout.clone(),
                self.master_dtype,
                loss_scale,
            ))
        } else {
            GradientSums::ByName {
                master: self.master_dtype,
                loss_scale,
                sums: BTreeMap::new(),
            }
        }
    }

    /// The device the state lives on.
    pub(crate) fn device(&self) -> candle_core::Device {
        self.groups
            .first()
            .map_or(candle_core::Device::Cpu, |g| g.master.device().clone())
    }

    /// The flat gradient bucket from gradients by name, group by group: each group's gradients
    /// are taken and let go once the group is in the bucket, so the peak here is the bucket,
    /// the gradients not yet copied and one group in flight (putting all groups side by side
    /// first, then joining them, held every gradient three times over: measured as the step's
    /// peak on BERT-large with activation checkpointing, BENCHMARKS.md).
    pub(crate) fn flatten_by_name(
        &self,
        mut grads: BTreeMap<String, Tensor>,
    ) -> Result<Tensor, TrainError> {
        let Some(first) = self.groups.first() else {
            return Err(TrainError::Config("an optimiser without parameters".into()));
        };
        let bucket = Tensor::zeros(
            self.layout.elements(),
            self.master_dtype,
            first.master.device(),
        )?;
        for group in &self.groups {
            // A group's gradients are put side by side in their own dtype and cast together
            // (one launch on CUDA, not one per parameter) when they share one.
            let mut members = Vec::with_capacity(group.count());
            let mut offsets = Vec::with_capacity(group.count());
            for (i, name) in group.names.iter().enumerate() {
                let Some(g) = grads.remove(name) else {
                    continue; // left as the bucket's zeros
                };
                self.layout.index_of(name, &g)?;
                members.push(g.flatten_all()?);
                offsets.push(group.offset + i * group.numel());
            }
            let dtype = members.first().map(Tensor::dtype);
            let contiguous_run = offsets.windows(2).all(|w| w[1] == w[0] + group.numel());
            if !members.is_empty()
                && contiguous_run
                && members.iter().all(|m| Some(m.dtype()) == dtype)
            {
                let part = Tensor::cat(&members, 0)?.to_dtype(self.master_dtype)?;
                drop(members);
                bucket.slice_set(&part, 0, offsets[0])?;
            } else {
                for (m, offset) in members.into_iter().zip(offsets) {
                    let part = m.to_dtype(self.master_dtype)?.contiguous()?;
                    bucket.slice_set(&part, 0, offset)?;
                }
            }
        }
        Ok(bucket)
    }

    /// Whether the step's gradients are summed and measured on the flat bucket
    /// (`crate::bucket`): on the CPU, and on CUDA for an f32 update.
    fn on_flat_bucket(&self) -> bool {
        let device = self.device();
        device.is_cpu()
            || (cfg!(feature = "cuda") && device.is_cuda() && self.master_dtype == DType::F32)
    }

    /// The squared L2 norm of a flat gradient bucket, as an f64 scalar on the device (nothing
    /// is read back): summed in f64 over the whole bucket on the flat bucket's path; otherwise
    /// group by group, each parameter's squares
    /// summed along its last dimension in the master dtype, then in f64.
    pub fn squared_norm(&self, bucket: &Tensor) -> Result<Tensor, TrainError> {
        if self.on_flat_bucket() {
            // Over the whole bucket at once (`bucket::squared_norm`).
            return crate::bucket::squared_norm(bucket);
        }
        let per_group = self
            .groups
            .iter()
            .map(|g| g.row_squares(&g.gradients(bucket)?))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Tensor::cat(&per_group, 0)?.sum_all()?)
    }

    /// Whether a step on one process may hand its one micro-batch's gradients to the norm and
    /// the update as the backward made them ([`Optimizer::hold_gradients`]).
    pub(crate) fn holds_gradients(&self) -> bool {
        // (f32 masters: the held gradients' norm reads each element as the f32 bucket holds it.)
        self.holds_gradients && self.master_dtype == DType::F32 && self.on_flat_bucket()
    }

    /// The squared L2 norm of a step's gradients, as an f64 scalar on the device: the bucket's
    /// ([`Optimizer::squared_norm`]), or over the held gradients' values times their unscale
    /// factor (`bucket::held_squared_norm`).
    pub(crate) fn squared_norm_of(&self, gradients: &StepGradients) -> Result<Tensor, TrainError> {
        match gradients {
            StepGradients::Bucket(bucket) => self.squared_norm(bucket),
            StepGradients::Held { gradients, unscale } => {
                crate::bucket::held_squared_norm(gradients, *unscale, &self.device())
            }
        }
    }

    /// The factor clipping scales gradients by at global norm `grad_norm`:
    /// `1 / max(1, grad_norm / max_grad_norm)` (1 without clipping).
    pub fn clip_factor(&self, grad_norm: f64) -> f64 {
        let max = self.config.max_grad_norm;
        if max > 0.0 && grad_norm > max {
            max / grad_norm
        } else {
            1.0
        }
    }

    /// One step with learning rate `lr` on a flat gradient bucket (see [`Optimizer::flatten`]),
    /// its gradients first scaled by `clip` (see [`Optimizer::clip_factor`]). Everything runs on
    /// the device; the model's parameters are then set from the master weights.
    pub fn step(&mut self, bucket: &Tensor, lr: f64, clip: f64) -> Result<(), TrainError> {
        self.update(&StepGradients::Bucket(bucket.clone()), lr, clip)
    }

    /// [`Optimizer::step`] on a step's gradients: the bucket, or one micro-batch's held as
    /// the backward made them ([`Optimizer::hold_gradients`]).
    pub(crate) fn update(
        &mut self,
        gradients: &StepGradients,
        lr: f64,
        clip: f64,
    ) -> Result<(), TrainError> {
        match gradients {
            StepGradients::Bucket(bucket) if bucket.dims() != [self.layout.elements()] => {
                return Err(TrainError::Config(format!(
                    "a gradient bucket of shape {:?} for {} parameters",
                    bucket.dims(),
                    self.layout.elements()
                )));
            }
            StepGradients::Held { gradients, .. } if gradients.len() != self.layout.entries() => {
                return Err(TrainError::Config(format!(
                    "{} held gradients for {} parameters",
                    gradients.len(),
                    self.layout.entries()
                )));
            }
            _ => {}
        }
        let c = &self.config;
        self.step += 1;
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
        for group in self.groups.iter_mut() {
            let decay = if group.decay { c.weight_decay } else { 0.0 };
            let scalars = crate::cpu_update::Scalars {
                clip,
                beta1: c.beta1,
                beta2: c.beta2,
                inverse_corrections: (1.0 / bc1, 1.0 / bc2),
                eps: c.eps,
                decay,
                lr,
                trust_ratio: c.rule == Rule::Lamb,
            };
            #[cfg(feature = "cuda")]
            if group.master.device().is_cuda() && self.master_dtype == DType::F32 {
                // In place; the parameters are set by the update's kernel.
                let state = group.packed_state()?;
                match gradients {
                    StepGradients::Held { gradients, unscale } => {
                        // Each parameter's gradient read where the backward left it.
                        let rows: Vec<Option<&Tensor>> =
                            group.own(gradients).iter().map(Option::as_ref).collect();
                        crate::cuda_update::update_held(
                            &state,
                            &rows,
                            *unscale,
                            scalars,
                            &group.vars,
                        )?;
                    }
                    StepGradients::Bucket(_) => {
                        let g = group.step_gradients(gradients)?;
                        crate::cuda_update::update(&state, &g, scalars, &group.vars)?;
                    }
                }
                continue;
            }
            let g = group.step_gradients(gradients)?;
            if group.master.device().is_cpu() && self.master_dtype == DType::F32 {
                // One pass over the state instead of the composed update's fifteen, in place:
                // no new state a group a step (fresh pages the kernel must zero and map).
                let state = group.packed_state()?;
                crate::cpu_update::update_in_place(&state, &g, scalars, &mut self.scratch)?;
                group.write_back()?;
                continue;
            }
            group.packed = None;
            let g = if clip != 1.0 { g.affine(clip, 0.0)? } else { g };
            group.m = (group.m.affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?;
            group.v = (group.v.affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?;
            let denominator = group.v.affine(1.0 / bc2, 0.0)?.sqrt()?.affine(1.0, c.eps)?;
            let mut update = group.m.affine(1.0 / bc1, 0.0)?.div(&denominator)?;
            if decay > 0.0 {
                update = (update + group.master.affine(decay, 0.0)?)?;
            }
            if c.rule == Rule::Lamb && decay > 0.0 {
                // Trust ratio ‖w‖ / ‖u‖ per parameter (1 when either norm is 0), on the device.
                let w_norm = group.row_squares(&group.master)?.sqrt()?;
                let u_norm = group.row_squares(&update)?.sqrt()?;
                let both = w_norm.gt(0.0)?.mul(&u_norm.gt(0.0)?)?;
                let ratio = both.where_cond(&w_norm.div(&u_norm)?, &w_norm.ones_like()?)?;
                update = update.broadcast_mul(&ratio.to_dtype(self.master_dtype)?.unsqueeze(1)?)?;
            }
            group.master = (&group.master - update.affine(lr, 0.0)?)?;
            group.write_back()?;
        }
        Ok(())
    }

    /// Every parameter's row of one of a group's buffers, by name (on the CPU).
    ///
    /// Each buffer crosses to the host once and the rows are views of that copy: candle's
    /// `to_device` copies a view's whole storage, so taking each row across on its own moved
    /// the group's buffer once per member, and held every copy until the file was written
    /// (BENCHMARKS.md).
    fn by_name(
        &self,
        prefix: &str,
        buffer: impl Fn(&Group) -> &Tensor,
    ) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let mut out = BTreeMap::new();
        for group in &self.groups {
            let buffer = buffer(group);
            // A device buffer may be a view of a larger one (the CUDA update's `[3, rows,
            // numel]`): compacted on the device first, so only its own elements cross.
            let compact = if buffer.device().is_cpu() {
                buffer.clone()
            } else {
                buffer.force_contiguous()?
            };
            let on_host = compact.to_device(&candle_core::Device::Cpu)?;
            for (i, name) in group.names.iter().enumerate() {
                out.insert(format!("{prefix}{name}"), group.row(&on_host, i)?);
            }
        }
        Ok(out)
    }

    /// The moments by name, for checkpoints: `m.<name>`, `v.<name>` (on the CPU).
    pub fn moment_tensors(&self) -> Result<std::collections::HashMap<String, Tensor>, TrainError> {
        let mut out: std::collections::HashMap<String, Tensor> =
            self.by_name("m.", |g| &g.m)?.into_iter().collect();
        out.extend(self.by_name("v.", |g| &g.v)?);
        Ok(out)
    }

    /// The master weights by parameter name (on the CPU): what a checkpoint's model file holds.
    pub fn master_tensors(&self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        self.by_name("", |g| &g.master)
    }

    /// Restores the moments (`m.<name>`, `v.<name>`), the master weights (by parameter name;
    /// the model's parameters are set from them) and the step count.
    pub fn restore(
        &mut self,
        moments: &std::collections::HashMap<String, Tensor>,
        masters: &std::collections::HashMap<String, Tensor>,
        step: u64,
    ) -> Result<(), TrainError> {
        let dtype = self.master_dtype;
        for group in self.groups.iter_mut() {
            let device = group.master.device().clone();
            let stacked = |map: &std::collections::HashMap<String, Tensor>,
                           prefix: &str|
             -> Result<Tensor, TrainError> {
                let rows = group
                    .names
                    .iter()
                    .map(|name| {
                        let key = format!("{prefix}{name}");
                        let t = map.get(&key).ok_or_else(|| {
                            TrainError::Checkpoint(format!("the checkpoint has no {key}"))
                        })?;
                        if t.dims() != group.shape.as_slice() {
                            return Err(TrainError::Checkpoint(format!(
                                "{key} has shape {:?}, the model needs {:?}",
                                t.dims(),
                                group.shape
                            )));
                        }
                        Ok(t.to_dtype(dtype)?.to_device(&device)?.flatten_all()?)
                    })
                    .collect::<Result<Vec<_>, TrainError>>()?;
                Ok(Tensor::stack(&rows, 0)?)
            };
            let (m, v, master) = (
                stacked(moments, "m.")?,
                stacked(moments, "v.")?,
                stacked(masters, "")?,
            );
            (group.m, group.v, group.master) = (m, v, master);
            group.packed = None;
            if updates_in_place(&device, dtype) {
                // Packed now, before a step's activations exist (see `fresh_state`).
                group.packed_state()?;
            }
            group.write_back()?;
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
