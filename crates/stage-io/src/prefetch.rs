//! A memory hint for reads that go all over memory (shuffled rows, hash table slots): asking
//! for the data a few steps ahead lets the loads overlap instead of waiting one after another.

/// Hints the CPU to fetch the first cache lines of `items` (no effect on the result).
#[inline]
pub fn prefetch<T>(items: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let start = items.as_ptr() as *const i8;
        let bytes = std::mem::size_of_val(items);
        let mut offset = 0;
        while offset < bytes.min(256) {
            // SAFETY: a prefetch is a hint: it never faults, even on an invalid address, and
            // `start + offset` stays inside `items`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(offset)) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = items;
}
