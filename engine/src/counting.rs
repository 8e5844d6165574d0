//! A counting allocator for the engine's tests: each thread counts the
//! buffers it allocates (1 KiB or more), so a test can ask the
//! communication thread what a step's gathers and reduce-scatters took.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Allocations of at least this many bytes are counted.
pub const COUNTED: usize = 1024;

/// Sizes of the last buffers a thread allocated, as a ring.
const KEPT: usize = 256;

thread_local! {
    static COUNT: Cell<usize> = const { Cell::new(0) };
    static SIZES: Cell<[u64; KEPT]> = const { Cell::new([0; KEPT]) };
}

pub struct Counting;

fn count(size: usize) {
    if size >= COUNTED {
        let _ = COUNT.try_with(|n| {
            let at = n.get();
            n.set(at + 1);
            let _ = SIZES.try_with(|s| {
                let mut sizes = s.get();
                sizes[at % KEPT] = size as u64;
                s.set(sizes);
            });
        });
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            count(new_size);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// What a thread allocated so far: how many buffers, and the sizes of the
/// last [`KEPT`].
pub struct Counted {
    count: usize,
    sizes: [u64; KEPT],
}

/// This thread's allocations so far.
pub fn counted() -> Counted {
    Counted {
        count: COUNT.with(Cell::get),
        sizes: SIZES.with(Cell::get),
    }
}

impl Counted {
    /// The sizes of the buffers allocated since `before` (all of them,
    /// when there were at most [`KEPT`]).
    pub fn sizes_since(&self, before: &Counted) -> Vec<u64> {
        let first = before.count.max(self.count.saturating_sub(KEPT));
        (first..self.count).map(|i| self.sizes[i % KEPT]).collect()
    }
}
