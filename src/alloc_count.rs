//! The library's tests count the heap bytes each thread holds, to bound the peak a callback
//! reaches: a wasm VM's memory never shrinks, so its largest transient peak stays for good.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Bytes this thread allocated and has not freed (negative when it freed others').
    static LIVE: Cell<isize> = const { Cell::new(0) };
    /// The most `LIVE` reached since the last [`peak_during`] began.
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn grow(bytes: usize) {
    let bytes = isize::try_from(bytes).unwrap_or(isize::MAX);
    let live = LIVE.with(|live| {
        live.set(live.get().saturating_add(bytes));
        live.get()
    });
    PEAK.with(|peak| peak.set(peak.get().max(live)));
}

fn shrink(bytes: usize) {
    let bytes = isize::try_from(bytes).unwrap_or(isize::MAX);
    LIVE.with(|live| live.set(live.get().saturating_sub(bytes)));
}

// SAFETY: every call is passed on to the system allocator as it came.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        // SAFETY: the caller's pointer and layout, as given.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Counted as a move: the old block and the new one, both held for a moment.
        grow(new_size);
        // SAFETY: the caller's pointer, layout and size, as given.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        shrink(layout.size());
        moved
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// What `f` returns, and the most heap bytes this thread held during `f` beyond those it held
/// before.
pub fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(before));
    let result = f();
    let peak = PEAK.with(Cell::get).saturating_sub(before);
    (result, usize::try_from(peak).unwrap_or(0))
}
