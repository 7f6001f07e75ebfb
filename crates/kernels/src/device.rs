//! The device the kernels run on: opening it (`cpu`, `cuda`, `cuda:N`), TF32 in f32 matrix
//! products, and, on CUDA, the stream-ordered memory pool candle allocates from (kept warm
//! between steps, its peaks read, its growth traced on request).

use std::sync::atomic::{AtomicU8, Ordering};

/// Whether f32 matrix products on CUDA may use TF32 tensor cores (10-bit mantissa inputs,
/// f32 accumulation), as NVIDIA's BERT recipes run; `--no-tf32` on the commands that run a
/// model (`bertkit pretrain --no-tf32`) turns it off.
pub const DEFAULT_TF32: bool = true;

const TF32_UNSET: u8 = 2;
static TF32: AtomicU8 = AtomicU8::new(TF32_UNSET);

/// Allows (or forbids) TF32 in f32 matrix products on CUDA, for the whole process; without a
/// call, opening a CUDA device applies [`DEFAULT_TF32`]. No effect on the CPU.
pub fn set_tf32(on: bool) {
    TF32.store(u8::from(on), Ordering::Relaxed);
    candle_core::cuda::set_gemm_reduced_precision_f32(on);
}

/// Parses `cpu`, `cuda` or `cuda:N` and opens the device. A CUDA device runs every op on one
/// stream without per-allocation event tracking, with TF32 as [`set_tf32`] says.
pub fn parse_device(name: &str) -> Result<candle_core::Device, String> {
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        cuda if cuda == "cuda" || cuda.starts_with("cuda:") => {
            let index = match cuda.strip_prefix("cuda:") {
                Some(i) => i
                    .parse::<usize>()
                    .map_err(|_| format!("device {cuda:?}: bad GPU index"))?,
                None => 0,
            };
            let device = candle_core::Device::new_cuda(index).map_err(|e| {
                format!("device {cuda}: {e} (CUDA needs a build with --features cuda)")
            })?;
            #[cfg(feature = "cuda")]
            if let candle_core::Device::Cuda(gpu) = &device {
                // SAFETY: every tensor of ours lives on the device's one stream (candle's
                // default), so cudarc's per-allocation events, which order uses across streams,
                // have nothing to order; they cost an event record per use.
                unsafe { gpu.disable_event_tracking() };
                device_pool::keep_freed_memory(gpu);
                let trace = std::env::var("BERTKIT_CUDA_POOL_TRACE").ok();
                let trace = pool_trace_setting(trace.as_deref())?;
                POOL_TRACE.get_or_init(|| trace);
            }
            if TF32.load(Ordering::Relaxed) == TF32_UNSET {
                set_tf32(DEFAULT_TF32);
            }
            Ok(device)
        }
        other => Err(format!("device {other:?}: expected cpu, cuda or cuda:N")),
    }
}

/// The device's memory pool (CUDA's stream-ordered allocator, which candle's allocations go
/// through): its high-water mark of bytes in use, and keeping freed memory for reuse.
#[cfg(feature = "cuda")]
mod device_pool {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};

    /// The device's default pool (where `cuMemAllocAsync` allocates), with its context bound
    /// to this thread.
    fn default_pool(gpu: &candle_core::CudaDevice) -> Option<sys::CUmemoryPool> {
        let stream = gpu.cuda_stream();
        let context = stream.context();
        context.bind_to_thread().ok()?;
        // SAFETY: the device is the context's own.
        unsafe { result::device::get_default_mem_pool(context.cu_device()).ok() }
    }

    /// The pool's high-water mark of bytes in use since it was last reset.
    pub(super) fn peak(gpu: &candle_core::CudaDevice) -> Option<u64> {
        attribute(gpu, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// The pool's high-water mark of bytes it held from the driver (in use, and freed but
    /// kept for reuse) since the device opened.
    pub(super) fn reserved_peak(gpu: &candle_core::CudaDevice) -> Option<u64> {
        attribute(
            gpu,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        )
    }

    /// The bytes the pool holds from the driver now (in use, and freed but kept).
    pub(super) fn held(gpu: &candle_core::CudaDevice) -> Option<u64> {
        attribute(
            gpu,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        )
    }

    /// The bytes in use (tensors) now.
    pub(super) fn in_tensors(gpu: &candle_core::CudaDevice) -> Option<u64> {
        attribute(
            gpu,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        )
    }

    /// One of the pool's 64-bit attributes.
    fn attribute(gpu: &candle_core::CudaDevice, which: sys::CUmemPool_attribute) -> Option<u64> {
        let pool = default_pool(gpu)?;
        let mut bytes: u64 = 0;
        // SAFETY: the pool's memory attributes are cuuint64_t, written to `bytes`.
        unsafe { result::mem_pool::get_attribute(pool, which, (&mut bytes as *mut u64).cast()) }
            .ok()?;
        Some(bytes)
    }

    /// Resets the high-water mark to the bytes in use now.
    pub(super) fn reset_peak(gpu: &candle_core::CudaDevice) {
        if let Some(pool) = default_pool(gpu) {
            let mut zero: u64 = 0;
            // SAFETY: USED_MEM_HIGH is reset by setting it to 0 (a cuuint64_t).
            let _ = unsafe {
                result::mem_pool::set_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut zero as *mut u64).cast(),
                )
            };
        }
    }

    /// Keeps freed memory in the pool instead of returning it to the driver at each
    /// synchronisation (the pool's release threshold, 0 by default, raised to all of it), so a
    /// step reuses the last step's memory as PyTorch's caching allocator does (a step does not
    /// wait on the driver for memory it held a step before). A failure leaves the driver's
    /// default.
    pub(super) fn keep_freed_memory(gpu: &candle_core::CudaDevice) {
        if let Some(pool) = default_pool(gpu) {
            let mut threshold: u64 = u64::MAX;
            // SAFETY: RELEASE_THRESHOLD is a cuuint64_t.
            let _ = unsafe {
                result::mem_pool::set_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut threshold as *mut u64).cast(),
                )
            };
        }
    }
}

/// Whether the device pool's growth is traced ([`trace_device_pool`]): the environment's
/// `BERTKIT_CUDA_POOL_TRACE` (`on` or `off`; unset: off), read when a CUDA device opens.
static POOL_TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// `BERTKIT_CUDA_POOL_TRACE`'s `value` (`None`: unset): `on` or `off`, else an error naming the
/// variable and its values.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn pool_trace_setting(value: Option<&str>) -> Result<bool, String> {
    match value {
        None | Some("" | "off") => Ok(false),
        Some("on") => Ok(true),
        Some(other) => Err(format!(
            "BERTKIT_CUDA_POOL_TRACE={other:?}: on or off expected"
        )),
    }
}

/// The most bytes the device's tensors held at once since [`reset_device_peak`] (or since the
/// device opened): on CUDA the stream-ordered pool's high-water mark of bytes in use (what the
/// tensors asked for, without the CUDA context, cuBLAS's workspace or the pool's spare).
/// `None` on the CPU (its allocator counts instead) and where it cannot be told.
pub fn device_peak(device: &candle_core::Device) -> Option<u64> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(gpu) => device_pool::peak(gpu),
        _ => None,
    }
}

/// The most bytes the device's memory pool held from the driver at once (the tensors', and
/// what it kept after they were freed, for reuse): on CUDA its reserved high-water mark, which
/// [`device_peak`] is part of; the rest is the pool's spare, which nvidia-smi counts as used.
/// `None` on the CPU.
pub fn device_reserved_peak(device: &candle_core::Device) -> Option<u64> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(gpu) => device_pool::reserved_peak(gpu),
        _ => None,
    }
}

/// What the pool held from the driver at the last line [`trace_device_pool`] wrote (bytes).
static POOL_TRACED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A diagnostic of where a CUDA step's memory comes from (`BERTKIT_CUDA_POOL_TRACE=on`; off
/// otherwise, one atomic load): a line on stderr each time the device's pool holds 32 MiB or
/// more from the driver than at its last line, saying how much it holds, how much of it is in
/// tensors, and `at` (the tape's op whose forward or backward just allocated, the step's
/// stage). The pool grows where no freed stretch fits a new tensor: where its spare above the
/// tensors (what nvidia-smi counts beyond them) forms. The pool's own figures, asked of the
/// driver without waiting for the device (allocations are the pool's at the call). Nothing on
/// the CPU.
pub fn trace_device_pool(device: &candle_core::Device, at: impl FnOnce() -> String) {
    if !POOL_TRACE.get().copied().unwrap_or(false) {
        return;
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(gpu) = device
        && let Some(held) = device_pool::held(gpu)
    {
        let last = POOL_TRACED.load(Ordering::Relaxed);
        if held >= last + (32 << 20) {
            POOL_TRACED.store(held, Ordering::Relaxed);
            let in_tensors = device_pool::in_tensors(gpu).unwrap_or(0);
            let mib = |b: u64| b >> 20;
            eprintln!(
                "pool: holds {} MiB (+{}), {} MiB in tensors, at {}",
                mib(held),
                mib(held - last),
                mib(in_tensors),
                at()
            );
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (device, at, &POOL_TRACED);
}

/// Starts [`device_peak`]'s count again from the bytes held now.
pub fn reset_device_peak(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(gpu) = device {
        device_pool::reset_peak(gpu);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

/// Bytes free for tensors on `device`: the GPU's free memory (CUDA), or the memory Linux says
/// is available (`MemAvailable` in /proc/meminfo) on the CPU. `None` where it cannot be told.
pub fn free_memory(device: &candle_core::Device) -> Option<u64> {
    match device {
        candle_core::Device::Cpu => {
            let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        }
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(gpu) => gpu
            .cuda_stream()
            .context()
            .mem_get_info()
            .ok()
            .map(|(free, _total)| free as u64),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    /// `BERTKIT_CUDA_POOL_TRACE` is on or off (unset: off); another value is an error naming
    /// the variable and its values.
    #[test]
    fn the_pool_trace_setting_is_on_off_or_a_clear_error() {
        assert!(!super::pool_trace_setting(None).unwrap());
        assert!(!super::pool_trace_setting(Some("off")).unwrap());
        assert!(super::pool_trace_setting(Some("on")).unwrap());
        let e = super::pool_trace_setting(Some("yes"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("BERTKIT_CUDA_POOL_TRACE=\"yes\": on or off"),
            "{e}"
        );
    }
}
