//! [`Profiled`]: any kernel set, with each call timed; and the fused ops' backward passes,
//! timed while a profile is taken ([`time_backwards`]).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{Device, Result, Tensor};

use super::{Gelu, Kernels, Mode};
use crate::packing::Packing;

/// The kernels `inner` with each call timed per method: the device is synchronised before and
/// after each call, so that a GPU's queued work is counted to the call that launched it (which
/// slows the pass a little; for profiling, never for training). The forward passes only: a
/// backward pass runs in candle's autograd, which calls the fused ops' backward passes (timed
/// apart by [`time_backwards`]) between its own operations.
#[derive(Debug)]
pub struct Profiled {
    inner: Arc<dyn Kernels>,
    times: Mutex<BTreeMap<&'static str, KernelTime>>,
}

/// What the calls of one kernel took.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KernelTime {
    /// Calls.
    pub calls: u64,
    /// Seconds in them, the device synchronised.
    pub seconds: f64,
}

impl Profiled {
    /// `inner`, timed.
    pub fn new(inner: Arc<dyn Kernels>) -> Self {
        Profiled {
            inner,
            times: Mutex::new(BTreeMap::new()),
        }
    }

    /// Each kernel's calls and time since the start or the last [`Profiled::take`], by name;
    /// the count starts again.
    pub fn take(&self) -> BTreeMap<&'static str, KernelTime> {
        std::mem::take(&mut *self.times.lock().expect("not poisoned"))
    }

    fn timed(
        &self,
        name: &'static str,
        on: &Tensor,
        call: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        on.device().synchronize()?;
        let started = Instant::now();
        let out = call()?;
        out.device().synchronize()?;
        let seconds = started.elapsed().as_secs_f64();
        let mut times = self.times.lock().expect("not poisoned");
        let t = times.entry(name).or_default();
        t.calls += 1;
        t.seconds += seconds;
        Ok(out)
    }
}

thread_local! {
    /// The fused ops' backward passes timed on this thread, while [`time_backwards`] is on.
    /// Per thread because candle's autograd calls an op's backward on the thread that called
    /// `backward()`: a profile taken on one thread never counts another's passes.
    static BACKWARDS: RefCell<Option<BTreeMap<&'static str, KernelTime>>> =
        const { RefCell::new(None) };
}

/// Starts (`true`, from zero) or stops timing the fused ops' backward passes on this thread;
/// returns what was timed since the last start.
pub(crate) fn time_backwards(on: bool) -> BTreeMap<&'static str, KernelTime> {
    BACKWARDS.with(|b| {
        let mut b = b.borrow_mut();
        let taken = b.take().unwrap_or_default();
        if on {
            *b = Some(BTreeMap::new());
        }
        taken
    })
}

/// Runs the backward pass of a fused op of kernel `name` (the [`Kernels`] method whose op it
/// is); while [`time_backwards`] is on, timed with `device` synchronised around it, so that the
/// autograd's own queued work (its zeroed gradients and additions, the backward passes of
/// candle's ops) is not counted to the op.
pub(crate) fn backward<T>(
    name: &'static str,
    device: &Device,
    call: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if !BACKWARDS.with(|b| b.borrow().is_some()) {
        return call();
    }
    device.synchronize()?;
    let started = Instant::now();
    let out = call()?;
    device.synchronize()?;
    let seconds = started.elapsed().as_secs_f64();
    BACKWARDS.with(|b| {
        if let Some(times) = b.borrow_mut().as_mut() {
            let t = times.entry(name).or_default();
            t.calls += 1;
            t.seconds += seconds;
        }
    });
    Ok(out)
}

impl Kernels for Profiled {
    fn records(&self, dtype: candle_core::DType, device: &Device) -> bool {
        self.inner.records(dtype, device)
    }

    fn gather_rows(&self, table: &Tensor, index: &crate::packing::RowIndex) -> Result<Tensor> {
        self.timed("gather_rows", table, || {
            self.inner.gather_rows(table, index)
        })
    }

    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        self.timed("layer_norm", x, || {
            self.inner.layer_norm(x, weight, bias, eps)
        })
    }

    fn linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.timed("linear", x, || self.inner.linear(x, weight, bias))
    }

    fn gelu(&self, x: &Tensor, form: Gelu) -> Result<Tensor> {
        self.timed("gelu", x, || self.inner.gelu(x, form))
    }

    fn linear_gelu(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        form: Gelu,
    ) -> Result<Tensor> {
        self.timed("linear_gelu", x, || {
            self.inner.linear_gelu(x, weight, bias, form)
        })
    }

    fn feed_forward(
        &self,
        x: &Tensor,
        first: (&Tensor, Option<&Tensor>),
        second: (&Tensor, Option<&Tensor>),
        form: Gelu,
    ) -> Result<Tensor> {
        self.timed("feed_forward", x, || {
            self.inner.feed_forward(x, first, second, form)
        })
    }

    fn softmax_last_dim(&self, x: &Tensor) -> Result<Tensor> {
        self.timed("softmax_last_dim", x, || self.inner.softmax_last_dim(x))
    }

    fn attention(
        &self,
        qkv: &Tensor,
        packing: &Packing,
        heads: usize,
        mode: Mode,
        dropout: f64,
    ) -> Result<Tensor> {
        self.timed("attention", qkv, || {
            self.inner.attention(qkv, packing, heads, mode, dropout)
        })
    }

    fn residual_layer_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        packing: &Packing,
        mode: Mode,
        dropout: f64,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        self.timed("residual_layer_norm", x, || {
            self.inner
                .residual_layer_norm(x, residual, packing, mode, dropout, weight, bias, eps)
        })
    }
}
