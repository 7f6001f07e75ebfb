//! The flat gradient bucket: every trainable parameter's gradient in one 1-D tensor in the
//! optimiser's order (what one all-reduce call takes, what the update reads group by group).
//! [`Layout`] says where each parameter sits; [`FlatSums`] adds a step's gradients into it,
//! micro-batch by micro-batch, every parameter in one pass ([`Gather`]: one launch on CUDA,
//! its CPU twin a loop over the parameters in parallel).
//!
//! A micro-batch's gradients are held as the backward made them (the compute dtype, times the
//! loss scale) until the next micro-batch begins (or its gradients meet them, or the step
//! ends): then all of them go into the bucket at once, cast to the master dtype and unscaled
//! on the way. So one
//! micro-batch a step never holds the master-dtype copies beside its activations, and from the
//! second on the sums are the bucket itself, added to in place (where the sums by name made a
//! cast and an addition per parameter per micro-batch: on CUDA two launches and a fresh f32
//! tensor each, ~800 launches a BERT-large micro-batch, and the bucket made at the end by as
//! many again).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use candle_core::{CpuStorage, DType, InplaceOp1, Tensor, WithDType, bail};

use crate::TrainError;

/// One parameter's place in the bucket.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    /// Where its gradient starts in the bucket.
    pub(crate) offset: usize,
}

impl Entry {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where each trainable parameter's gradient sits in the flat bucket: one after another, in
/// the optimiser's order (groups by shape and weight decay, members by name), the same on
/// every rank.
#[derive(Debug)]
pub(crate) struct Layout {
    entries: Vec<Entry>,
    by_name: HashMap<String, usize>,
    elements: usize,
}

impl Layout {
    /// The layout of `entries`, which must follow one another from offset 0.
    pub(crate) fn new(entries: Vec<Entry>) -> Result<Self, TrainError> {
        let mut elements = 0;
        for e in &entries {
            if e.offset != elements {
                return Err(TrainError::Config(format!(
                    "the gradient bucket: {} at {}, where the one before ends at {elements}",
                    e.name, e.offset
                )));
            }
            elements += e.numel();
        }
        let by_name = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        Ok(Layout {
            entries,
            by_name,
            elements,
        })
    }

    /// Scalars in the bucket.
    pub(crate) fn elements(&self) -> usize {
        self.elements
    }

    /// Parameters in the bucket.
    pub(crate) fn entries(&self) -> usize {
        self.entries.len()
    }

    /// The entry of parameter `name`, whose gradient `g` must have its shape.
    pub(crate) fn index_of(&self, name: &str, g: &Tensor) -> Result<usize, TrainError> {
        let Some(&i) = self.by_name.get(name) else {
            return Err(TrainError::Config(format!(
                "a gradient for {name}, which the optimiser does not hold"
            )));
        };
        let shape = &self.entries[i].shape;
        if g.dims() != shape.as_slice() {
            return Err(TrainError::Config(format!(
                "the gradient of {name} has shape {:?}, the parameter {shape:?}",
                g.dims(),
            )));
        }
        Ok(i)
    }
}

/// A step's gradient sums as the flat bucket (see the module's documentation).
#[derive(Debug)]
pub(crate) struct FlatSums {
    layout: Arc<Layout>,
    /// The bucket's dtype (the optimiser's master dtype).
    dtype: DType,
    /// What the gradients are multiplied by on their way in: 1 / the loss scale.
    unscale: f64,
    /// The sums of the micro-batches already added; `None` until a second one arrives.
    bucket: Option<Tensor>,
    /// The gradients not yet added, by entry.
    pending: Vec<Option<Tensor>>,
    pending_count: usize,
    /// The entries that have had a gradient this step.
    seen: Vec<bool>,
}

impl FlatSums {
    /// Sums in `dtype` over `layout`, of gradients computed at loss scale `loss_scale`.
    pub(crate) fn new(layout: Arc<Layout>, dtype: DType, loss_scale: f64) -> Self {
        let entries = layout.entries.len();
        FlatSums {
            layout,
            dtype,
            unscale: 1.0 / loss_scale,
            bucket: None,
            pending: vec![None; entries],
            pending_count: 0,
            seen: vec![false; entries],
        }
    }

    /// Adds parameter `name`'s gradient `g` (as the backward made it): held, and added to the
    /// bucket with the others when the next gradient of the same parameter arrives (the next
    /// micro-batch) or the sums are taken.
    pub(crate) fn add(&mut self, name: &str, g: &Tensor) -> Result<(), TrainError> {
        let i = self.layout.index_of(name, g)?;
        if self.pending[i].is_some() {
            self.flush()?;
        }
        self.pending[i] = Some(g.clone());
        self.pending_count += 1;
        self.seen[i] = true;
        Ok(())
    }

    /// Adds the held gradients to the bucket in one pass (the first time: makes it, zeros
    /// where a parameter has no gradient). A step calls it as a micro-batch begins
    /// ([`GradientSums::settle`]), so that the last one's gradients are not held beside the
    /// bucket through this one's passes.
    fn flush(&mut self) -> Result<(), TrainError> {
        if self.pending_count == 0 {
            return Ok(());
        }
        self.pending_count = 0;
        let pending = std::mem::replace(&mut self.pending, vec![None; self.layout.entries.len()]);
        let accumulate = self.bucket.is_some();
        let mut pieces = Vec::with_capacity(pending.len());
        for (entry, gradient) in self.layout.entries.iter().zip(pending) {
            if gradient.is_none() && accumulate {
                continue; // adds nothing
            }
            pieces.push(Piece {
                gradient,
                offset: entry.offset,
                numel: entry.numel(),
            });
        }
        let bucket = match self.bucket.take() {
            Some(bucket) => bucket,
            None => {
                let device = pieces
                    .iter()
                    .find_map(|p| p.gradient.as_ref())
                    .map(|g| g.device().clone())
                    .expect("a gradient is pending");
                // SAFETY: every element is written by the gather below (its pieces are every
                // entry, which tile the bucket).
                unsafe { Tensor::empty(self.layout.elements, self.dtype, &device)? }
            }
        };
        bucket.inplace_op1(&Gather {
            pieces,
            unscale: self.unscale,
            accumulate,
        })?;
        self.bucket = Some(bucket);
        Ok(())
    }

    /// The step's gradients as its norm and update read them: with `hold` and one
    /// micro-batch's gradients (none yet in a bucket), those gradients as the backward made
    /// them ([`StepGradients::Held`]); otherwise the bucket ([`FlatSums::into_bucket`]).
    pub(crate) fn into_step_gradients(
        self,
        device: &candle_core::Device,
        hold: bool,
    ) -> Result<StepGradients, TrainError> {
        if hold && self.bucket.is_none() && self.pending_count > 0 {
            return Ok(StepGradients::Held {
                gradients: self.pending,
                unscale: self.unscale,
            });
        }
        Ok(StepGradients::Bucket(self.into_bucket(device)?))
    }

    /// The bucket of the step's sums (zeros if no gradient arrived), on `device`.
    pub(crate) fn into_bucket(
        mut self,
        device: &candle_core::Device,
    ) -> Result<Tensor, TrainError> {
        self.flush()?;
        Ok(match self.bucket {
            Some(bucket) => bucket,
            None => Tensor::zeros(self.layout.elements, self.dtype, device)?,
        })
    }

    /// The sums by parameter (views of the bucket), for the parameters that had a gradient.
    pub(crate) fn into_gradients(mut self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let mut out = BTreeMap::new();
        self.flush()?;
        let Some(bucket) = self.bucket else {
            return Ok(out);
        };
        for (entry, &seen) in self.layout.entries.iter().zip(&self.seen) {
            if seen {
                let g = bucket
                    .narrow(0, entry.offset, entry.numel())?
                    .reshape(entry.shape.as_slice())?;
                out.insert(entry.name.clone(), g);
            }
        }
        Ok(out)
    }
}

/// A step's gradients as the optimiser's norm and update read them.
#[derive(Debug)]
pub(crate) enum StepGradients {
    /// The flat bucket: the micro-batches' sums, over the ranks once reduced.
    Bucket(Tensor),
    /// One micro-batch's gradients on one process as the backward made them (the compute
    /// dtype, times the loss scale), by the layout's entry (`None`: no gradient), each element
    /// read times `unscale`: the values the bucket would hold, without the bucket
    /// (where the optimiser holds gradients).
    Held {
        gradients: Vec<Option<Tensor>>,
        unscale: f64,
    },
}

/// The `[rows, numel]` f32 (or `dtype`) rows of held gradients `gradients` (a group's: the
/// `rows` parameters of `numel` elements, in order; `None`: zeros), each element times
/// `unscale`: the bucket's gather on the group alone, into a new tensor
/// ([`StepGradients::Held`] where the update reads a group's rows from one buffer).
pub(crate) fn held_rows(
    gradients: &[Option<Tensor>],
    unscale: f64,
    numel: usize,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor, TrainError> {
    let rows = gradients.len();
    let pieces = gradients
        .iter()
        .enumerate()
        .map(|(i, g)| Piece {
            gradient: g.clone(),
            offset: i * numel,
            numel,
        })
        .collect();
    // SAFETY: every element is written by the gather (its pieces tile the rows).
    let out = unsafe { Tensor::empty(rows * numel, dtype, device)? };
    out.inplace_op1(&Gather {
        pieces,
        unscale,
        accumulate: false,
    })?;
    Ok(out.reshape((rows, numel))?)
}

/// `Σ (x · unscale)²` in f64 over held gradients' elements (`StepGradients::Held`), a scalar
/// on `device` (nothing read back): the squared norm of the bucket they would make, each
/// element's value in f32 as the bucket's gather writes it. On CUDA `pieces_squares_partial`
/// and `sum_partials` (`cuda_update.cu`); the CPU twin sums each gradient in f64 in parallel,
/// the gradients in order.
pub(crate) fn held_squared_norm(
    gradients: &[Option<Tensor>],
    unscale: f64,
    device: &candle_core::Device,
) -> Result<Tensor, TrainError> {
    let present: Vec<Tensor> = gradients.iter().flatten().cloned().collect();
    let Some(first) = present.first().cloned() else {
        return Ok(Tensor::zeros((), DType::F64, device)?);
    };
    // The op reads the gradients it holds; the first is only what it is applied to.
    Ok(first.apply_op1_no_bwd(&HeldSquaredNorm {
        gradients: present,
        unscale,
    })?)
}

struct HeldSquaredNorm {
    gradients: Vec<Tensor>,
    unscale: f64,
}

impl HeldSquaredNorm {
    /// One CPU gradient's `Σ (x · unscale)²`: each element cast to f32 and multiplied in f32
    /// (the bucket's value), squared and added in f64, over fixed blocks in parallel
    /// (`cpu_update::sum_of_squares`'s).
    fn cpu_sum(&self, g: &Tensor) -> candle_core::Result<f64> {
        let unscale = self.unscale as f32;
        let (storage, layout) = g.storage_and_layout();
        let candle_core::Storage::Cpu(storage) = &*storage else {
            bail!("the held gradients' squared norm: a gradient off the CPU")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("the held gradients' squared norm: a strided gradient")
        };
        use crate::cpu_update::{sum_of_squares, sum_of_squares_of};
        let scaled = |x: f32| if unscale == 1.0 { x } else { x * unscale };
        Ok(match storage {
            CpuStorage::F32(g) if unscale == 1.0 => sum_of_squares(&g[start..end]),
            CpuStorage::F32(g) => sum_of_squares_of(&g[start..end], scaled),
            CpuStorage::BF16(g) => sum_of_squares_of(&g[start..end], |x| scaled(x.to_f32())),
            CpuStorage::F16(g) => sum_of_squares_of(&g[start..end], |x| scaled(x.to_f32())),
            other => {
                use candle_core::backend::BackendStorage;
                bail!(
                    "the held gradients' squared norm: a {:?} gradient (f32, bf16 or f16 held)",
                    other.dtype()
                )
            }
        })
    }
}

impl candle_core::CustomOp1 for HeldSquaredNorm {
    fn name(&self) -> &'static str {
        "bertkit-held-gradients-squared-norm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, candle_core::Shape)> {
        // Each gradient over blocks in parallel, the gradients added in order: the same figure
        // on any number of threads.
        let sums = self
            .gradients
            .iter()
            .map(|g| self.cpu_sum(g))
            .collect::<candle_core::Result<Vec<f64>>>()?;
        let sum = sums.iter().sum();
        Ok((CpuStorage::F64(vec![sum]), candle_core::Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let gradients: Vec<&Tensor> = self.gradients.iter().collect();
        Ok((
            crate::cuda_update::held_squared_norm(
                &storage.device,
                &gradients,
                self.unscale as f32,
            )?,
            candle_core::Shape::from(()),
        ))
    }
}

/// A parameter's gradient and its place in the bucket (`None`: no gradient, zeros).
struct Piece {
    gradient: Option<Tensor>,
    offset: usize,
    numel: usize,
}

/// The bucket's gather as an in-place op on it: `pieces`' gradients times `unscale` copied (or,
/// `accumulate`, added) into the bucket, cast to its dtype, in one pass: on CUDA
/// `pieces_to_flat` (`cuda_update.cu`), on the CPU its twin.
struct Gather {
    pieces: Vec<Piece>,
    unscale: f64,
    accumulate: bool,
}

impl Gather {
    /// The CPU twin: each piece's elements (any float type, cast to the bucket's `T` as read)
    /// times `unscale`, into or onto its part of `flat`, the pieces in parallel.
    fn cpu<T: WithDType>(&self, flat: &mut [T]) -> candle_core::Result<()> {
        use rayon::prelude::*;
        // Each piece's part of `flat`, split off in order (the pieces are in bucket order).
        let mut parts = Vec::with_capacity(self.pieces.len());
        let mut rest = flat;
        let mut at = 0;
        for p in &self.pieces {
            if p.offset < at || p.offset + p.numel - at > rest.len() {
                bail!(
                    "the gradient bucket's gather: a piece at {} out of order",
                    p.offset
                )
            }
            let (_, tail) = rest.split_at_mut(p.offset - at);
            let (part, tail) = tail.split_at_mut(p.numel);
            parts.push((p, part));
            rest = tail;
            at = p.offset + p.numel;
        }
        parts.into_par_iter().try_for_each(|(p, out)| {
            let Some(g) = &p.gradient else {
                if !self.accumulate {
                    out.fill(T::from_f64(0.0));
                }
                return Ok(());
            };
            let (storage, layout) = g.storage_and_layout();
            let candle_core::Storage::Cpu(storage) = &*storage else {
                bail!("the gradient bucket's gather: a gradient off the CPU")
            };
            let Some((start, end)) = layout.contiguous_offsets() else {
                bail!("the gradient bucket's gather: a strided gradient")
            };
            // Each gradient as the backward pass made it, cast as it is read (as the CUDA
            // kernel does): no cast copy of the gradients beside the bucket.
            // (Through f32 where the type is narrower: the compiler folds f32 -> f64 -> f32
            // away, and the loops vectorise.)
            match storage {
                CpuStorage::F32(g) => {
                    self.piece(out, &g[start..end], |x| T::from_f64(f64::from(x)))
                }
                CpuStorage::BF16(g) => {
                    self.piece(out, &g[start..end], |x| T::from_f64(f64::from(x.to_f32())))
                }
                CpuStorage::F16(g) => {
                    self.piece(out, &g[start..end], |x| T::from_f64(f64::from(x.to_f32())))
                }
                CpuStorage::F64(g) => self.piece(out, &g[start..end], T::from_f64),
                other => {
                    use candle_core::backend::BackendStorage;
                    bail!(
                        "the gradient bucket's gather: a {:?} gradient",
                        other.dtype()
                    )
                }
            }
            Ok(())
        })
    }

    /// One gradient `g` times the unscale factor into or onto `out`, each element first
    /// cast to the bucket's `T` (`cast`: exact from a narrower type), then multiplied and
    /// added in `T`: what casting the gradient and then copying it gave, bit for bit.
    fn piece<S: Copy, T: WithDType>(&self, out: &mut [T], g: &[S], cast: impl Fn(S) -> T) {
        let unscale = T::from_f64(self.unscale);
        match (self.accumulate, self.unscale == 1.0) {
            (false, true) => out.iter_mut().zip(g).for_each(|(o, &x)| *o = cast(x)),
            (false, false) => out
                .iter_mut()
                .zip(g)
                .for_each(|(o, &x)| *o = cast(x) * unscale),
            (true, true) => out.iter_mut().zip(g).for_each(|(o, &x)| *o += cast(x)),
            (true, false) => out
                .iter_mut()
                .zip(g)
                .for_each(|(o, &x)| *o += cast(x) * unscale),
        }
    }
}

impl InplaceOp1 for Gather {
    fn name(&self) -> &'static str {
        "bertkit-gradient-bucket-gather"
    }

    fn cpu_fwd(
        &self,
        storage: &mut CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{}: a contiguous bucket expected", self.name())
        };
        match storage {
            CpuStorage::F32(flat) => self.cpu(&mut flat[start..end]),
            CpuStorage::F64(flat) => self.cpu(&mut flat[start..end]),
            other => {
                use candle_core::backend::BackendStorage;
                bail!(
                    "{}: an f32 or f64 bucket expected, got {:?}",
                    self.name(),
                    other.dtype()
                )
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let pieces: Vec<_> = self
            .pieces
            .iter()
            .map(|p| (p.gradient.as_ref(), p.offset, p.numel))
            .collect();
        crate::cuda_update::gather(
            storage,
            layout,
            &pieces,
            self.unscale as f32,
            self.accumulate,
        )
    }
}

/// The squared L2 norm of the flat bucket, an f64 scalar on its device (nothing read back): in
/// f64 over fixed blocks, in two launches on CUDA (`squares_partial`, `sum_partials`), its CPU
/// twin in parallel over the same kind of blocks, so that no squared copy of the bucket is
/// made and a step repeats its figure.
pub(crate) fn squared_norm(bucket: &Tensor) -> Result<Tensor, TrainError> {
    Ok(bucket.apply_op1_no_bwd(&SquaredNorm)?)
}

struct SquaredNorm;

impl candle_core::CustomOp1 for SquaredNorm {
    fn name(&self) -> &'static str {
        "bertkit-gradient-bucket-squared-norm"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, candle_core::Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{}: a contiguous bucket expected", self.name())
        };
        let sum = match storage {
            CpuStorage::F32(x) => crate::cpu_update::sum_of_squares(&x[start..end]),
            CpuStorage::F64(x) => x[start..end].iter().map(|x| x * x).sum(),
            other => {
                use candle_core::backend::BackendStorage;
                bail!(
                    "{}: an f32 or f64 bucket expected, got {:?}",
                    self.name(),
                    other.dtype()
                )
            }
        };
        Ok((CpuStorage::F64(vec![sum]), candle_core::Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        Ok((
            crate::cuda_update::squared_norm(storage, layout)?,
            candle_core::Shape::from(()),
        ))
    }
}

/// A step's gradient sums: the flat bucket ([`FlatSums`]), or by parameter (where the update
/// is the composed one: on CUDA with master weights other than f32, on devices with no update
/// of ours):
/// each first gradient kept as the backward made it unless it must be unscaled, cast to the
/// master dtype and added when a second arrives; the bucket made group by group at the end.
#[derive(Debug)]
pub(crate) enum GradientSums {
    Flat(FlatSums),
    ByName {
        master: DType,
        loss_scale: f64,
        sums: BTreeMap<String, Tensor>,
    },
}

impl GradientSums {
    /// Adds parameter `name`'s gradient `g`, computed at the step's loss scale.
    pub(crate) fn add(&mut self, name: &str, g: &Tensor) -> Result<(), TrainError> {
        match self {
            GradientSums::Flat(flat) => flat.add(name, g),
            GradientSums::ByName {
                master,
                loss_scale,
                sums,
            } => {
                let g = if *loss_scale != 1.0 {
                    (g.to_dtype(*master)? / *loss_scale)?
                } else {
                    g.clone()
                };
                let sum = match sums.remove(name) {
                    None => g,
                    Some(sum) => (sum.to_dtype(*master)? + g.to_dtype(*master)?)?,
                };
                sums.insert(name.to_string(), sum);
                Ok(())
            }
        }
    }

    /// As a micro-batch begins: the gradients held from the last one go into the bucket now,
    /// before this one's activations exist, rather than when this one's first gradient meets
    /// them (which would hold them, 2–4 bytes a parameter, through its whole forward and
    /// backward beside the bucket). Nothing to do for the sums by name, nor before the first.
    pub(crate) fn settle(&mut self) -> Result<(), TrainError> {
        match self {
            GradientSums::Flat(flat) => flat.flush(),
            GradientSums::ByName { .. } => Ok(()),
        }
    }

    /// The sums by parameter (unscaled, in the master dtype), for the parameters that had a
    /// gradient.
    pub(crate) fn into_gradients(self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        match self {
            GradientSums::Flat(flat) => flat.into_gradients(),
            GradientSums::ByName { master, sums, .. } => sums
                .into_iter()
                .map(|(name, g)| Ok((name, g.to_dtype(master)?)))
                .collect(),
        }
    }

    /// The dtype parameter `name`'s gradient is held in now (a test's view of when casts
    /// happen): the compute dtype while held as made, the master dtype once added.
    #[cfg(test)]
    pub(crate) fn held_dtype(&self, name: &str) -> Option<DType> {
        match self {
            GradientSums::Flat(flat) => {
                let i = flat.layout.by_name[name];
                match &flat.pending[i] {
                    Some(g) => Some(g.dtype()),
                    None => flat.bucket.as_ref().map(Tensor::dtype),
                }
            }
            GradientSums::ByName { sums, .. } => sums.get(name).map(Tensor::dtype),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn layout() -> Arc<Layout> {
        let entries = [
            ("a", vec![3, 2]),
            ("b", vec![5]),
            ("c", vec![1]),
            ("d", vec![4, 4]),
        ];
        let mut offset = 0;
        let entries = entries
            .into_iter()
            .map(|(name, shape)| {
                let e = Entry {
                    name: name.to_string(),
                    shape,
                    offset,
                };
                offset += e.numel();
                e
            })
            .collect();
        Arc::new(Layout::new(entries).unwrap())
    }

    fn gradient(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|i| ((seed * 31 + i as u64 * 7) % 23) as f32 * 0.37 - 4.0)
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// Three micro-batches, a parameter missing from some, gradients in f32 and bf16, at a loss
    /// scale: the flat bucket holds the bits of the sums by name (cast and added one
    /// parameter at a time), in an f32 and an f64 bucket; only the parameters that had a
    /// gradient come back by name, and the bucket has zeros for the others.
    #[test]
    fn the_flat_sums_are_the_sums_by_name() {
        let layout = layout();
        for (master, loss_scale) in [(DType::F32, 1.0), (DType::F32, 1024.0), (DType::F64, 8.0)] {
            let mut flat = GradientSums::Flat(FlatSums::new(layout.clone(), master, loss_scale));
            let mut by_name = GradientSums::ByName {
                master,
                loss_scale,
                sums: BTreeMap::new(),
            };
            for micro in 0..3u64 {
                for (i, e) in layout.entries.iter().enumerate() {
                    // "c" never has one; "b" only from the second micro-batch on.
                    if e.name == "c" || (e.name == "b" && micro == 0) {
                        continue;
                    }
                    let dtype = if i % 2 == 0 { DType::BF16 } else { DType::F32 };
                    let g = gradient(&e.shape, micro * 10 + i as u64, dtype);
                    flat.add(&e.name, &g).unwrap();
                    by_name.add(&e.name, &g).unwrap();
                }
            }
            let want = by_name.into_gradients().unwrap();
            let got = flat.into_gradients().unwrap();
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                ["a", "b", "d"],
                "{master:?} {loss_scale}"
            );
            for (name, w) in &want {
                let (g, w) = (&got[name], w);
                assert_eq!(g.dims(), w.dims());
                assert_eq!(g.dtype(), master);
                let f64s = |t: &Tensor| -> Vec<f64> {
                    let t = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
                    t.to_vec1().unwrap()
                };
                let (g, w) = (f64s(g), f64s(w));
                assert_eq!(g, w, "{name} {master:?} {loss_scale}");
                assert!(g.iter().any(|&x| x != 0.0));
            }
        }
    }

    /// A micro-batch's gradients wait until the next one's meet them, then go in together:
    /// the bucket appears with the second micro-batch, and a step of one micro-batch makes it
    /// only at the end, zeros where a parameter had none.
    #[test]
    fn gradients_wait_for_the_next_micro_batch() {
        let layout = layout();
        let mut sums = FlatSums::new(layout.clone(), DType::F32, 1.0);
        let a = gradient(&[3, 2], 1, DType::F32);
        let d = gradient(&[4, 4], 2, DType::F32);
        sums.add("a", &a).unwrap();
        sums.add("d", &d).unwrap();
        assert!(sums.bucket.is_none());
        sums.add("a", &a).unwrap();
        assert!(sums.bucket.is_some());
        assert_eq!(sums.pending_count, 1);
        let bucket: Vec<f32> = sums.into_bucket(&Device::Cpu).unwrap().to_vec1().unwrap();
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let d: Vec<f32> = d.flatten_all().unwrap().to_vec1().unwrap();
        let mut want: Vec<f32> = a.iter().map(|x| x + x).collect();
        want.extend([0.0; 6]); // b and c: no gradient
        want.extend(&d);
        assert_eq!(bucket, want);
        let empty = FlatSums::new(layout, DType::F32, 1.0);
        let zeros: Vec<f32> = empty.into_bucket(&Device::Cpu).unwrap().to_vec1().unwrap();
        assert_eq!(zeros, vec![0.0; 28]);
    }

    /// The bucket's squared norm in f64 over blocks, against the squares added one by one in
    /// f64 (f32 and f64 buckets, several blocks and a part of one; an empty bucket is 0).
    #[test]
    fn the_squared_norm_is_summed_in_f64() {
        for n in [0usize, 5, 3 * 4096 + 17, 100_003] {
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 37) % 101) as f32 * 0.013 - 0.6)
                .collect();
            let want: f64 = values.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            for dtype in [DType::F32, DType::F64] {
                let bucket = Tensor::new(values.as_slice(), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let got = squared_norm(&bucket).unwrap();
                assert_eq!(got.dtype(), DType::F64);
                let got = got.to_scalar::<f64>().unwrap();
                assert!(
                    (got - want).abs() <= 1e-12 * want,
                    "{n} {dtype:?}: {got} {want}"
                );
            }
        }
    }

    /// A micro-batch's beginning settles the last one's gradients into the bucket: none held
    /// afterwards; the sums are the same as when the next gradients meet them.
    #[test]
    fn a_micro_batch_begins_with_the_last_ones_gradients_in_the_bucket() {
        let a = gradient(&[3, 2], 1, DType::BF16);
        let mut settled = GradientSums::Flat(FlatSums::new(layout(), DType::F32, 2.0));
        let mut met = GradientSums::Flat(FlatSums::new(layout(), DType::F32, 2.0));
        settled.settle().unwrap(); // nothing yet
        for sums in [&mut settled, &mut met] {
            sums.add("a", &a).unwrap();
        }
        settled.settle().unwrap();
        let GradientSums::Flat(flat) = &settled else {
            unreachable!()
        };
        assert_eq!(flat.pending_count, 0);
        assert!(flat.pending.iter().all(Option::is_none) && flat.bucket.is_some());
        assert_eq!(settled.held_dtype("a"), Some(DType::F32));
        for sums in [&mut settled, &mut met] {
            sums.add("a", &a).unwrap();
        }
        let f32s = |sums: GradientSums| -> Vec<f32> {
            let g = sums.into_gradients().unwrap().remove("a").unwrap();
            g.flatten_all().unwrap().to_vec1().unwrap()
        };
        let (settled, met) = (f32s(settled), f32s(met));
        assert_eq!(settled, met);
        let a: Vec<f32> = a
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(
            settled,
            a.iter().map(|x| x / 2.0 + x / 2.0).collect::<Vec<_>>()
        );
    }

    /// Gradients the layout does not hold, or of the wrong shape, and layouts with gaps are
    /// refused with the parameter's name.
    #[test]
    fn bad_gradients_and_layouts_are_refused() {
        let mut sums = FlatSums::new(layout(), DType::F32, 1.0);
        let err = sums.add("e", &gradient(&[1], 0, DType::F32)).unwrap_err();
        assert!(err.to_string().contains("a gradient for e"), "{err}");
        let err = sums
            .add("a", &gradient(&[2, 3], 0, DType::F32))
            .unwrap_err();
        assert!(
            err.to_string().contains("gradient of a has shape [2, 3]"),
            "{err}"
        );
        let gap = vec![
            Entry {
                name: "x".into(),
                shape: vec![2],
                offset: 0,
            },
            Entry {
                name: "y".into(),
                shape: vec![2],
                offset: 3,
            },
        ];
        let err = Layout::new(gap).unwrap_err();
        assert!(err.to_string().contains("y at 3"), "{err}");
    }
}
