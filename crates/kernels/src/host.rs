//! Host-side helpers the CPU kernels share with dropout's byte masks: loops compiled for the
//! CPU's vector width ([`vectorised!`](crate::vectorised)), and f32 views of CPU storage.

use candle_core::{CpuStorage, Layout, Result, bail};

/// Defines `$name`, which runs `$portable` compiled for AVX-512 or AVX2 + FMA when the CPU has
/// them (checked at run time, so the binary still runs on CPUs without them). `$portable` is
/// `#[inline(always)]`, so its loops are vectorised for each target. (Floating-point
/// operations are not contracted into fused multiply-adds, so every target computes the same
/// values.) The CPU kernels here and the optimiser's update use it.
#[macro_export]
macro_rules! vectorised {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $portable:ident) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $portable($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $portable($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $portable($($arg),*)
        }
    };
}

/// Elements per parallel task of the elementwise ops.
pub(crate) const ELEMENTWISE_CHUNK: usize = 1 << 14;

/// The f32 elements of a contiguous CPU tensor's storage.
pub(crate) fn contiguous<'a>(
    op: &str,
    what: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> Result<&'a [f32]> {
    let CpuStorage::F32(values) = storage else {
        bail!(
            "{op}: f32 {what} expected, got {:?}",
            candle_core::backend::BackendStorage::dtype(storage)
        )
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{op}: contiguous {what} expected")
    };
    Ok(&values[start..end])
}

/// Checks that `b` has `a`'s shape.
pub(crate) fn same_shape(op: &str, a: &Layout, b: &Layout) -> Result<()> {
    if a.dims() != b.dims() {
        bail!("{op}: shapes {:?} and {:?} differ", a.dims(), b.dims())
    }
    Ok(())
}

/// The f32 elements of a contiguous CPU tensor's storage (any device's storage: others are an
/// error).
pub(crate) fn cpu_slice<'a>(
    op: &str,
    what: &str,
    storage: &'a candle_core::Storage,
    layout: &Layout,
) -> Result<&'a [f32]> {
    match storage {
        candle_core::Storage::Cpu(storage) => contiguous(op, what, storage, layout),
        _ => bail!("{op}: {what} on the CPU expected"),
    }
}
