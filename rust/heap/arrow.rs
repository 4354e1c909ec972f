//! arrow's memory pool (mimalloc or jemalloc in pyarrow's wheels) bypasses Python's
//! allocators and numpy's handler. Only Python can ask for its total
//! (`pyarrow.total_allocated_bytes()`): a server's event loop notes it each second
//! while memory is tracked, and the series keeps the last noted beside resident memory.

use std::sync::atomic::{AtomicU64, Ordering};

const NONE: u64 = u64::MAX;
static NOTED: AtomicU64 = AtomicU64::new(NONE);

pub fn note(bytes: u64) {
    NOTED.store(bytes.min(NONE - 1), Ordering::Relaxed);
}

/// The last total noted since tracking started (None: none, pyarrow not imported).
pub fn noted() -> Option<u64> {
    Some(NOTED.load(Ordering::Relaxed)).filter(|&b| b != NONE)
}

/// Forgets the last total: tracking starts afresh.
pub fn forget() {
    NOTED.store(NONE, Ordering::Relaxed);
}
