//! A counting global allocator: exact live heap bytes, for measurements (`warren-bench conns
//! --socketless`, the `warren` binary's test of the heap per idle connection over sockets).
//! Only those binaries install it (`#[global_allocator]`): `warren serve` uses the system
//! allocator.
//!
//! Counting is off until [`enable`] is called, so the load generators pay one relaxed load
//! per allocation and no shared-counter traffic on their hot path.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::Relaxed};

/// The allocator: `System`'s, counted.
#[derive(Debug)]
pub struct Counting;

static ENABLED: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicI64 = AtomicI64::new(0);

/// Starts counting. Blocks freed later that were allocated before this call are subtracted
/// too, so only differences between two [`live`] readings after it are meaningful.
pub fn enable() {
    ENABLED.store(true, Relaxed);
}

/// Live heap bytes allocated since [`enable`] (may be negative, see there).
pub fn live() -> i64 {
    LIVE.load(Relaxed)
}

fn add(bytes: usize) {
    if ENABLED.load(Relaxed) {
        LIVE.fetch_add(bytes as i64, Relaxed);
    }
}

fn sub(bytes: usize) {
    if ENABLED.load(Relaxed) {
        LIVE.fetch_sub(bytes as i64, Relaxed);
    }
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the counter
// has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            add(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) };
        sub(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            add(new_size);
            sub(layout.size());
        }
        p
    }
}
