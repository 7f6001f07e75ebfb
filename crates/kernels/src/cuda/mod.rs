//! The fused kernels on CUDA (the `cuda` feature): LayerNorm with the end of a sublayer
//! (dropout, residual), a linear layer's bias with its GELU, and attention within the sequences
//! of a packed batch, each with its backward written out (no autograd inside a fused op).
//!
//! The device code is `kernels.cu`, compiled to PTX by the crate's build script and loaded on
//! candle's device the first time a kernel runs; launches go on candle's stream. Every kernel
//! reads f32, bf16 or f16 and computes in f32. Products stay in cuBLAS (candle's `matmul`); around
//! them a kernel does what candle's generic ops did in several launches, each writing a tensor.
//!
//! The twins: each op computes what its `kernels::cpu` namesake (or the composed ops) computes,
//! dropout masks included: a CUDA kernel recomputes each element's keep from the mask's keys
//! exactly as the CPU draws it ([`DeviceDropout`]). `bertkit check kernels --device cuda`
//! ([`super::check`]) runs each against its CPU twin, values and gradients.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, DeviceId, WrapErr};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result,
    Shape, Storage, Tensor, bail,
};

use crate::dropout::DropoutSource;
use crate::packing::Packing;
use crate::tape;

/// The kernels' PTX (build.rs).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
/// The module's name in candle's cache of loaded modules.
const MODULE: &str = "bertkit-kernels";

/// Rows a backward kernel's grid covers at most at once: the blocks' partial column sums are
/// `[blocks, columns]` f32, summed by a second launch.
const MAX_BACKWARD_BLOCKS: usize = 512;
/// Shared memory a kernel may take without opting in (48 KiB), in f32s.
const SHARED_FLOATS: usize = 48 * 1024 / 4;
/// The longest sequence the attention softmax holds in registers (16 keys a lane).
pub(crate) const MAX_SEQ: usize = 512;

/// A dropout mask's keys as the kernels take them (`struct Dropout` in `kernels.cu`): element
/// `j` of the line keyed from `(key, first_row + row, indices)` keeps when its 24-bit uniform is
/// at least `threshold`, as `dropout::keeps` draws it on the CPU.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DeviceDropout {
    key: u64,
    first_row: u64,
    threshold: u64,
    scale: f32,
    on: i32,
}

// SAFETY: a plain `#[repr(C)]` value, laid out as the kernels' `struct Dropout`.
unsafe impl DeviceRepr for DeviceDropout {}

impl DeviceDropout {
    /// The next mask's keys from `source` at probability `p` (none when `p` is 0), taking a
    /// mask number as the CPU kernels do.
    pub(crate) fn next(source: &DropoutSource, p: f64) -> Self {
        match source.next_keys(p) {
            Some(keys) => DeviceDropout {
                key: keys.key,
                first_row: keys.first_row,
                threshold: keys.threshold,
                scale: keys.scale,
                on: 1,
            },
            None => DeviceDropout::default(),
        }
    }
}

/// The element types the kernels take, with their entry points' suffix.
trait Element: CudaDType + DeviceRepr + ValidAsZeroBits + Copy + 'static {
    const SUFFIX: &'static str;
    /// Its place among the three ([`function`]'s cache).
    const INDEX: usize;
}

impl Element for f32 {
    const SUFFIX: &'static str = "f32";
    const INDEX: usize = 0;
}

impl Element for half::bf16 {
    const SUFFIX: &'static str = "bf16";
    const INDEX: usize = 1;
}

impl Element for half::f16 {
    const SUFFIX: &'static str = "f16";
    const INDEX: usize = 2;
}

/// Each device's kernel functions by name, one per element type, once looked up.
type Functions = HashMap<String, [Option<CudaFunction>; 3]>;

/// The functions looked up so far, per device.
static FUNCTIONS: Mutex<Vec<(DeviceId, Functions)>> = Mutex::new(Vec::new());

/// Kernel `name`'s function for element type `T` on `dev`: looked up in the module (loaded on
/// the device at the first call, by candle) the first time, then kept. candle's lookup, which
/// each launch used to make, formats the name, takes its modules' lock and asks the driver
/// for the function again (`cuModuleGetFunction`) every time.
fn function<T: Element>(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    // candle's lookup of the function.
    let lookup = || -> Result<CudaFunction> {
        let full = format!("{name}_{}", T::SUFFIX);
        Ok(dev
            .get_or_load_custom_func(&full, MODULE, PTX)?
            .into_cuda_function())
    };
    let mut devices = FUNCTIONS.lock().map_err(|_| {
        candle_core::Error::Msg("the CUDA kernels' functions: a poisoned lock".into())
    })?;
    let functions = device_entry(&mut devices, dev, || Ok(HashMap::new()))?;
    if let Some(Some(f)) = functions.get(name).map(|f| &f[T::INDEX]) {
        return Ok(f.clone());
    }
    let f = lookup()?;
    functions.entry(name.to_string()).or_default()[T::INDEX] = Some(f.clone());
    Ok(f)
}

/// `dev`'s entry of a per-device cache, made by `make` the first time.
fn device_entry<'a, V>(
    cache: &'a mut Vec<(DeviceId, V)>,
    dev: &CudaDevice,
    make: impl FnOnce() -> Result<V>,
) -> Result<&'a mut V> {
    let at = match cache.iter().position(|(id, _)| *id == dev.id()) {
        Some(at) => at,
        None => {
            cache.push((dev.id(), make()?));
            cache.len() - 1
        }
    };
    Ok(&mut cache[at].1)
}

/// Whether the CUDA kernels take `dtype`: f32, bf16 and f16 (computing in f32).
pub(crate) fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// Launches kernel `$name` for element type `$T` on candle's stream, the arguments pushed by
/// `$body` through `$b`.
macro_rules! launch {
    ($T:ty, $dev:expr, $name:expr, $cfg:expr, |$b:ident| $body:block $(,)?) => {{
        let func = function::<$T>($dev, &$name)?;
        let stream = $dev.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        {
            let $b = &mut builder;
            $body
        }
        // SAFETY: each caller pushes the arguments `kernels.cu` declares, in order, with
        // buffers of the sizes its launch covers.
        unsafe { builder.launch($cfg) }.w().map(|_| ())
    }};
}

fn config(blocks: usize, threads: usize, shared_floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: (shared_floats * 4) as u32,
    }
}

/// Answers about kernels kept per device, keyed by a kernel's name and element type and a size.
type Answers<V> = Mutex<Vec<(DeviceId, HashMap<(String, usize), V>)>>;

/// `dev`'s answer in `answers` (`what` they are, for a poisoned lock's error) for kernel `name`
/// (for `T`) at `size`: asked (`ask`) the first time, then kept.
fn answer_once<T: Element, V: Copy>(
    answers: &Answers<V>,
    what: &str,
    dev: &CudaDevice,
    (name, size): (&str, usize),
    ask: impl FnOnce() -> Result<V>,
) -> Result<V> {
    let mut devices = answers.lock().map_err(|_| {
        candle_core::Error::Msg(format!("the CUDA kernels' {what}: a poisoned lock"))
    })?;
    let kept = device_entry(&mut devices, dev, || Ok(HashMap::new()))?;
    let key = (format!("{name}_{}", T::SUFFIX), size);
    if let Some(&answer) = kept.get(&key) {
        return Ok(answer);
    }
    let answer = ask()?;
    kept.insert(key, answer);
    Ok(answer)
}

/// How many blocks of `threads` of kernel `name` (for `T`) the whole device holds at once: its
/// multiprocessors times the blocks of it one holds (the driver's occupancy, from the kernel's
/// registers and shared memory), asked once a kernel and device. The grid of a kernel whose
/// blocks should all be resident, each taking its share of rows.
fn resident_blocks<T: Element>(dev: &CudaDevice, name: &str, threads: usize) -> Result<usize> {
    static RESIDENT: Answers<usize> = Mutex::new(Vec::new());
    answer_once::<T, _>(&RESIDENT, "occupancies", dev, (name, threads), || {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
        let multiprocessors = dev
            .cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .w()?;
        let per_multiprocessor = function::<T>(dev, name)?
            .occupancy_max_active_blocks_per_multiprocessor(threads as u32, 0, None)
            .w()?;
        Ok((usize::try_from(multiprocessors).unwrap_or(1) * per_multiprocessor as usize).max(1))
    })
}

/// Whether `dev` gives a block of kernel `name` (for `T`) `bytes` of dynamic shared memory
/// beside its static shared memory, and if so the function allowed them: above 48 KB a kernel
/// must ask (`cuFuncSetAttribute`). Asked and allowed once a kernel, size and device, as
/// [`function`] keeps the handles (the attribute stays with the function).
/// (sm_80 and sm_90 give a block up to 163 and 227 KB; sm_86 and sm_89, 99.)
fn allow_dynamic_shared<T: Element>(dev: &CudaDevice, name: &str, bytes: usize) -> Result<bool> {
    static ALLOWED: Answers<bool> = Mutex::new(Vec::new());
    let ask = || {
        use candle_core::cuda_backend::cudarc::driver::sys::{
            CUdevice_attribute, CUfunction_attribute,
        };
        let most = dev
            .cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .w()?;
        let func = function::<T>(dev, name)?;
        let fixed = func.shared_size_bytes().w()?;
        let (Ok(most), Ok(fixed), Ok(asked)) = (
            usize::try_from(most),
            usize::try_from(fixed),
            i32::try_from(bytes),
        ) else {
            return Ok(false);
        };
        if fixed + bytes > most {
            return Ok(false);
        }
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            asked,
        )
        .w()?;
        Ok(true)
    };
    answer_once::<T, _>(&ALLOWED, "shared memory", dev, (name, bytes), ask)
}

/// A block's threads for rows of `width`: about four elements a thread, a whole number of
/// warps, 32 to 1024.
fn row_threads(width: usize) -> usize {
    width.div_ceil(4).next_multiple_of(32).clamp(32, 1024)
}

/// The contiguous elements of an input.
fn view<'a, T: CudaDType + DeviceRepr>(
    op: &str,
    what: &str,
    storage: &'a CudaStorage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{op}: contiguous {what} expected")
    };
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// Whether tensor `t` starts on a 16-byte boundary of its buffer (the buffers themselves are
/// aligned): what a 16-byte load of it, or a cuBLASLt operand told so, needs.
fn starts_on_16_bytes(t: &Tensor) -> bool {
    (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
}

/// Whether rows of `cols` elements of `T` are whole 16-byte pieces and every input starting at
/// the elements `starts` of its buffer (the buffers themselves are aligned) lies on a 16-byte
/// boundary: what the kernels 16 bytes a thread need.
fn in_16_byte_pieces<T>(cols: usize, starts: impl IntoIterator<Item = usize>) -> bool {
    let size = std::mem::size_of::<T>();
    cols.is_multiple_of(piece_elements::<T>())
        && starts.into_iter().all(|s| (s * size).is_multiple_of(16))
}

/// Elements of `T` in a 16-byte piece, the unit of the kernels' vector loads (`Vec16<T>::N` in
/// `kernels.cu`).
fn piece_elements<T>() -> usize {
    16 / std::mem::size_of::<T>()
}

/// Runs `f` on the contiguous elements of `t`, a tensor held by an op (not one of its inputs).
fn with_view<T: CudaDType + DeviceRepr, R>(
    op: &str,
    what: &str,
    t: &Tensor,
    f: impl FnOnce(CudaView<'_, T>) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(view(op, what, s, layout)?),
        _ => bail!("{op}: {what} on the CUDA device expected"),
    }
}

/// Runs `f` for the storage's element type.
macro_rules! by_dtype {
    ($op:expr, $storage:expr, $f:ident ( $($arg:expr),* )) => {
        match candle_core::backend::BackendStorage::dtype($storage) {
            DType::F32 => $f::<f32>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            other => bail!("{}: f32, bf16 or f16 expected, got {other:?}", $op),
        }
    };
}

fn wrap<T: Element>(slice: CudaSlice<T>, dev: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(slice, dev.clone())
}

fn cpu_refused(op: &str) -> Result<(CpuStorage, Shape)> {
    bail!("{op}: a CUDA kernel, given CPU tensors")
}

/// A CUDA op's `cpu_fwd` for one, two or three inputs: refused (the CPU has its own kernels,
/// `kernels::cpu`; these ops are built only for CUDA tensors).
macro_rules! cuda_only {
    (1) => {
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            cpu_refused(CustomOp1::name(self))
        }
    };
    (2) => {
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            cpu_refused(CustomOp2::name(self))
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            cpu_refused(CustomOp3::name(self))
        }
    };
}

/// The null pointer, for a kernel's optional buffer.
const NULL: u64 = 0;

// ---------------------------------------------------------------------------------------------
// Column sums of the backward kernels' per-block partial sums.

fn column_sums<T: Element>(
    dev: &CudaDevice,
    partial: &CudaSlice<f32>,
    parts: usize,
    out: &mut candle_core::cuda_backend::cudarc::driver::CudaViewMut<'_, T>,
    cols: usize,
) -> Result<()> {
    let (parts_i, cols_i) = (parts as i32, cols as i32);
    // 32 lanes a column, a block per 32 columns.
    let cfg = config(cols.div_ceil(32), 1024, 0);
    launch!(T, dev, "column_sums_lanes", cfg, |b| {
        b.arg(partial).arg(out).arg(&parts_i).arg(&cols_i);
    })
}

mod add;
mod attention;
mod bias_act;
mod embeddings;
mod flash;
mod gather;
mod join;
mod keyed_dropout;
mod linear;
mod loss;
mod lt;
mod norm;

pub(crate) use add::add;
pub(crate) use attention::attention;
pub(crate) use embeddings::{embeddings, embeddings_fit};
pub(crate) use gather::gather_rows;
pub(crate) use join::{join, join_takes};
pub(crate) use keyed_dropout::{keyed_dropout_rows, keyed_dropout_tokens};
pub(crate) use linear::{activation, gelu_linear, linear, linear_into};
pub(crate) use loss::nll;
pub(crate) use lt::gelu_epilogue;
pub(crate) use norm::{layer_norm, residual_layer_norm};

/// Whether a row of `hidden` fits a LayerNorm backward block's shared memory.
pub(crate) fn norm_fits(hidden: usize) -> bool {
    3 * hidden + 32 <= SHARED_FLOATS
}

/// The most columns one block of the bias's backward sums (`BIAS_CHUNK` in `kernels.cu`: its
/// shared memory); wider rows take a block per chunk.
const BIAS_CHUNK: usize = SHARED_FLOATS;

/// A packing's device tensors the attention and dropout kernels read: each padded place's token
/// and each token's place.
#[derive(Debug, Clone)]
pub(crate) struct Places {
    scatter: Tensor,
    gather: Tensor,
    tokens: usize,
    batch: usize,
    seq: usize,
}

impl Places {
    pub(crate) fn of(packing: &Packing) -> Self {
        let (batch, seq) = packing.padded_dims();
        Places {
            scatter: packing.scatter_places().clone(),
            gather: packing.gather_places().clone(),
            tokens: packing.tokens(),
            batch,
            seq,
        }
    }
}

/// What an op hands from its forward to its backward once, then lets go: a tensor, or a
/// buffer the forward's kernel filled (`put` there, as the op's forward takes `&self`).
#[derive(Debug)]
struct Handoff<T = Tensor>(Mutex<Option<T>>);

impl<T> Handoff<T> {
    fn new(t: T) -> Self {
        Handoff(Mutex::new(Some(t)))
    }

    /// Nothing yet: the forward [`Handoff::put`]s it.
    fn empty() -> Self {
        Handoff(Mutex::new(None))
    }

    fn put(&self, op: &str, t: T) -> Result<()> {
        match self.0.lock() {
            Ok(mut held) => {
                *held = Some(t);
                Ok(())
            }
            Err(_) => bail!("{op}: a poisoned lock"),
        }
    }

    /// What was handed over, if anything (a forward that may not hand over).
    fn take_any(&self) -> Option<T> {
        self.0.lock().ok()?.take()
    }

    fn take(&self, op: &str) -> Result<T> {
        match self.0.lock() {
            Ok(mut t) => match t.take() {
                Some(t) => Ok(t),
                None => bail!("{op}: run twice, or before what it takes was handed over"),
            },
            Err(_) => bail!("{op}: a poisoned lock"),
        }
    }
}

impl Handoff {
    /// The tensor, kept for a later [`Handoff::take`].
    fn peek(&self, op: &str) -> Result<Tensor> {
        match self.0.lock() {
            Ok(t) => match &*t {
                Some(t) => Ok(t.clone()),
                None => bail!("{op}: already handed over"),
            },
            Err(_) => bail!("{op}: a poisoned lock"),
        }
    }
}
