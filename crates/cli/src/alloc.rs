//! The binary's allocator: mimalloc, with an optional count of the bytes allocated.
//!
//! `bertkit bench memory` turns the count on to measure the peak bytes a training step holds
//! (the figure `bertkit plan` predicts): tensors on the CPU are heap buffers, so the peak of
//! live heap bytes is what a device would have to hold, without RSS's noise (freed pages the
//! allocator keeps, mapped files, the binary). Off, the count costs one relaxed load per
//! allocation.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// mimalloc, counting live bytes while [`start_counting`] is in effect.
pub(crate) struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);

/// Counts allocations from now on (live bytes start at 0).
pub(crate) fn start_counting() {
    LIVE.store(0, Ordering::SeqCst);
    PEAK.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
}

/// The most bytes live at once since [`start_counting`] (or since the last reset), and the
/// bytes live now.
pub(crate) fn peak_and_live() -> (u64, u64) {
    let clamp = |v: i64| v.max(0) as u64;
    (
        clamp(PEAK.load(Ordering::SeqCst)),
        clamp(LIVE.load(Ordering::SeqCst)),
    )
}

fn grew(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        let now = LIVE.fetch_add(bytes as i64, Ordering::Relaxed) + bytes as i64;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

fn shrank(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_sub(bytes as i64, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to mimalloc unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { mimalloc::MiMalloc.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator with `layout`, as the caller guarantees.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as the caller guarantees for `GlobalAlloc::realloc`.
        let p = unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}
