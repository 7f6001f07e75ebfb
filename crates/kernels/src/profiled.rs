//! [`Profiled`]: any kernel set, with each call timed; and the fused ops' backward passes,
//! timed while a profile is taken ([`time_backwards`]), by either [`Clock`].

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{Device, Result, Tensor};

use super::{Gelu, Kernels, Mode};
use crate::packing::Packing;

/// How a profile reads the time a call takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Clock {
    /// The device synchronised before and after each call, the host's clock read: a GPU's
    /// queued work is counted to the call that launched it, and so is whatever the host does
    /// while the GPU waits (launching, allocating), which training hides by running ahead.
    Synchronised,
    /// Events recorded on the device's stream around each call, read once the passes have
    /// run: the GPU's own time between them, the host launching ahead as in training (one
    /// synchronisation a pass). Where the device has no queue (the CPU: each op runs as it is
    /// called), the host's clock. The default: what a training step sees.
    #[default]
    Events,
}

impl std::str::FromStr for Clock {
    type Err = String;

    fn from_str(name: &str) -> std::result::Result<Self, String> {
        match name {
            "synchronised" | "synchronized" | "sync" => Ok(Clock::Synchronised),
            "events" => Ok(Clock::Events),
            other => Err(format!("clock {other:?}: synchronised or events")),
        }
    }
}

/// A point in a device's work as a [`Clock`] reads it.
pub enum Mark {
    /// The host's clock (after synchronising the device, with [`Clock::Synchronised`]).
    Host(Instant),
    /// An event recorded on candle's CUDA stream, timing on.
    #[cfg(feature = "cuda")]
    Event(candle_core::cuda_backend::cudarc::driver::CudaEvent),
}

impl Mark {
    /// The point `device` has reached by `clock`.
    pub fn now(device: &Device, clock: Clock) -> Result<Mark> {
        match (clock, device) {
            #[cfg(feature = "cuda")]
            (Clock::Events, Device::Cuda(dev)) => {
                use candle_core::cuda_backend::WrapErr;
                use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
                // `CU_EVENT_DEFAULT`: an event that keeps its time (cudarc's own default
                // turns timing off).
                let event = dev
                    .cuda_stream()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?;
                Ok(Mark::Event(event))
            }
            (Clock::Events, _) => Ok(Mark::Host(Instant::now())),
            (Clock::Synchronised, _) => {
                device.synchronize()?;
                Ok(Mark::Host(Instant::now()))
            }
        }
    }

    /// Seconds from this point to `end` (for events, once the device has reached both).
    pub fn seconds_to(&self, end: &Mark) -> Result<f64> {
        match (self, end) {
            (Mark::Host(start), Mark::Host(end)) => {
                Ok(end.saturating_duration_since(*start).as_secs_f64())
            }
            #[cfg(feature = "cuda")]
            (Mark::Event(start), Mark::Event(end)) => {
                use candle_core::cuda_backend::WrapErr;
                Ok(f64::from(start.elapsed_ms(end).w()?) / 1e3)
            }
            #[cfg(feature = "cuda")]
            _ => candle_core::bail!("a span's ends were read by two clocks"),
        }
    }
}

/// One timed call, read when the profile is taken.
struct Span {
    name: &'static str,
    start: Mark,
    end: Mark,
    /// The host's time in the call (its clock read around it, apart from the marks').
    host: f64,
    /// The call's matrix products' floating-point operations (0 where none are counted).
    flops: f64,
}

/// `call`'s result and the host's seconds in it.
fn host_timed<T>(call: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let started = Instant::now();
    let out = call()?;
    Ok((out, started.elapsed().as_secs_f64()))
}

/// Each name's calls, seconds and counted operations.
fn read(spans: Vec<Span>) -> Result<BTreeMap<&'static str, KernelTime>> {
    let mut times = BTreeMap::<&'static str, KernelTime>::new();
    for span in spans {
        let seconds = span.start.seconds_to(&span.end)?;
        let t = times.entry(span.name).or_default();
        t.calls += 1;
        t.seconds += seconds;
        t.host_seconds += span.host;
        t.flops += span.flops;
    }
    Ok(times)
}

/// The floating-point operations of `x · weightᵀ` (`weight` `[out, in]`): two a multiply-add.
fn product_flops(x: &Tensor, weight: &Tensor) -> f64 {
    match weight.dims() {
        [out, inner] if *inner > 0 => 2.0 * (x.elem_count() / inner * inner * out) as f64,
        _ => 0.0,
    }
}

/// The floating-point operations of attention's two products within each sequence of
/// `packing` (`q · kᵀ` and `p · v`, over the tokens of a row, not its padding) at `hidden`
/// (the heads' widths together).
fn attention_flops(packing: &Packing, hidden: usize) -> f64 {
    let starts = packing.starts();
    starts
        .windows(2)
        .map(|w| {
            let len = (w[1] - w[0]) as f64;
            4.0 * len * len * hidden as f64
        })
        .sum()
}

/// The kernels `inner` with each call timed per method by a [`Clock`]. The forward passes
/// only: a backward pass runs in candle's autograd (or by hand over the tape), which calls
/// the fused ops' backward passes (timed apart by `time_backwards`) between its own
/// operations.
#[derive(Debug)]
pub struct Profiled {
    inner: Arc<dyn Kernels>,
    clock: Clock,
    spans: Mutex<Vec<Span>>,
}

impl std::fmt::Debug for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// What the calls of one kernel took.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KernelTime {
    /// Calls.
    pub calls: u64,
    /// Seconds in them, by the profile's [`Clock`].
    pub seconds: f64,
    /// The host's seconds in them: with [`Clock::Events`] on a GPU, what issuing them took
    /// (launches, allocations, the ops' own host work), the device's time apart; on the CPU,
    /// or with [`Clock::Synchronised`], the calls' whole time.
    pub host_seconds: f64,
    /// The floating-point operations of their matrix products (the linear layers' and
    /// attention's within each sequence; 0 for a kernel without products): with
    /// [`KernelTime::seconds`], the rate the products ran at, kernel time around them included.
    pub flops: f64,
}

impl Profiled {
    /// `inner`, timed by `clock`.
    pub fn new(inner: Arc<dyn Kernels>, clock: Clock) -> Self {
        Profiled {
            inner,
            clock,
            spans: Mutex::new(Vec::new()),
        }
    }

    /// Each kernel's calls and time since the start or the last [`Profiled::take`], by name
    /// (with [`Clock::Events`], once the device has run them); the count starts again.
    pub fn take(&self) -> Result<BTreeMap<&'static str, KernelTime>> {
        read(std::mem::take(
            &mut *self.spans.lock().expect("not poisoned"),
        ))
    }

    fn timed(
        &self,
        name: &'static str,
        on: &Tensor,
        call: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.timed_flops(name, on, 0.0, call)
    }

    /// [`Profiled::timed`] for a call whose products make `flops` operations.
    fn timed_flops(
        &self,
        name: &'static str,
        on: &Tensor,
        flops: f64,
        call: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let start = Mark::now(on.device(), self.clock)?;
        let outer = CALLER.with(|c| c.replace(Some(name)));
        let called = host_timed(call);
        CALLER.with(|c| c.set(outer));
        let (out, host) = called?;
        let end = Mark::now(out.device(), self.clock)?;
        self.spans.lock().expect("not poisoned").push(Span {
            name,
            start,
            end,
            host,
            flops,
        });
        Ok(out)
    }
}

thread_local! {
    /// The [`Kernels`] method a [`Profiled`] set is running on this thread, if any.
    static CALLER: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Which [`Kernels`] method an op is made in, to count its backward pass to that method: an op
/// may serve several (the linear op makes a feed-forward block's layers as well as a plain
/// linear layer), and a profile reads best when each method's backward is its own calls'.
/// Outside a profile, none (the op's own name for it then).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Caller(Option<&'static str>);

impl Caller {
    /// The method a [`Profiled`] set is running on this thread now, if any.
    pub(crate) fn now() -> Self {
        Caller(CALLER.with(std::cell::Cell::get))
    }

    /// The method's name, else `own` (the op's name for its backward).
    pub(crate) fn or(self, own: &'static str) -> &'static str {
        self.0.unwrap_or(own)
    }
}

thread_local! {
    /// The fused ops' backward passes timed on this thread, and by which clock, while
    /// [`time_backwards`] is on. Per thread because candle's autograd calls an op's backward
    /// on the thread that called `backward()`: a profile taken on one thread never counts
    /// another's passes.
    static BACKWARDS: RefCell<Option<(Clock, Vec<Span>)>> = const { RefCell::new(None) };
}

/// Starts (`Some`, from zero, by that clock) or stops timing the fused ops' backward passes on
/// this thread; returns what was timed since the last start.
pub fn time_backwards(clock: Option<Clock>) -> Result<BTreeMap<&'static str, KernelTime>> {
    let taken = BACKWARDS.with(|b| {
        let mut b = b.borrow_mut();
        let taken = b.take().map(|(_, spans)| spans).unwrap_or_default();
        *b = clock.map(|c| (c, Vec::new()));
        taken
    });
    read(taken)
}

/// Runs the backward pass of a fused op of kernel `name` (the [`Kernels`] method whose op it
/// is); while [`time_backwards`] is on, timed by its clock (synchronised: the autograd's own
/// queued work, its zeroed gradients and additions and the backward passes of candle's ops,
/// is not counted to the op).
pub(crate) fn backward<T>(
    name: &'static str,
    device: &Device,
    call: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let Some(clock) = BACKWARDS.with(|b| b.borrow().as_ref().map(|(c, _)| *c)) else {
        return call();
    };
    let start = Mark::now(device, clock)?;
    let (out, host) = host_timed(call)?;
    let end = Mark::now(device, clock)?;
    BACKWARDS.with(|b| {
        if let Some((_, spans)) = b.borrow_mut().as_mut() {
            spans.push(Span {
                name,
                start,
                end,
                host,
                flops: 0.0,
            });
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

    fn embeddings(
        &self,
        lookups: [(&Tensor, &crate::packing::RowIndex); 3],
        packing: &Packing,
        mode: Mode,
        dropout: f64,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        self.timed("embeddings", weight, || {
            self.inner
                .embeddings(lookups, packing, mode, dropout, weight, bias, eps)
        })
    }

    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        self.timed("layer_norm", x, || {
            self.inner.layer_norm(x, weight, bias, eps)
        })
    }

    fn linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.timed_flops("linear", x, product_flops(x, weight), || {
            self.inner.linear(x, weight, bias)
        })
    }

    fn linear_into(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        sink: &super::GradientSink,
    ) -> Result<Tensor> {
        self.timed_flops("linear", x, product_flops(x, weight), || {
            self.inner.linear_into(x, weight, bias, sink)
        })
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
        self.timed_flops("linear_gelu", x, product_flops(x, weight), || {
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
        // Two products of the same size: `[rows, h]` by `[h, i]`, then `[rows, i]` by `[i, h]`.
        self.timed_flops("feed_forward", x, 2.0 * product_flops(x, first.0), || {
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
        let hidden = qkv.dims().last().copied().unwrap_or(0) / 3;
        self.timed_flops("attention", qkv, attention_flops(packing, hidden), || {
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
