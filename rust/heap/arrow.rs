//! arrow's memory pool (mimalloc or jemalloc in pyarrow's wheels) bypasses Python's
//! allocators and numpy's handler, and only Python can ask for its total
//! (`pyarrow.total_allocated_bytes()`). `live` charges the pool's growth between two
//! readings to the tasks running in between: it is read as tracking starts, as tasks
//! start and end, and once a second on each server's event loop, where pyarrow is
//! imported; the series keeps that last reading beside resident memory.

use pyo3::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};

const NONE: u64 = u64::MAX;
static NOTED: AtomicU64 = AtomicU64::new(NONE);

/// arrow's total now (None: unreadable). A process that has not imported pyarrow holds
/// nothing in its pool (and it is not ours to import).
pub fn read(py: Python<'_>) -> Option<u64> {
    let Some(pyarrow) = super::imported(py, "pyarrow") else { return Some(0) };
    pyarrow.call_method0("total_allocated_bytes").ok()?.extract().ok()
}

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
