//! Memory per task: allocations of Python's allocators, sampled by bytes and charged
//! to the task prefix running on the allocating thread, with frees of sampled blocks
//! matched, so that what a process holds gets the names of the tasks that allocated it.
//!
//! `hooks` wraps the allocators, `countdown` picks the sampled allocations, `live`
//! keeps the sampled blocks still held and the totals per prefix (`filter` spares
//! frees of the others the lock), `sites` the totals per prefix and Python stack, and
//! `numpy` counts array buffers, which bypass Python's allocators before numpy 2.5;
//! `arrow` reads the total of arrow's pool, which bypasses both.

pub mod arrow;
pub mod countdown;
pub mod filter;
pub mod hooks;
pub mod live;
pub mod numpy;
pub mod sites;

use crate::reader::OwnFrames;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

/// Counts allocations from now, afresh, for the whole process; `running`: the tasks
/// running now (thread ident, prefix); `walker`: walks an allocating thread's stack
/// (None: blocks get no stacks).
pub fn start<'a>(py: Python<'_>, running: impl IntoIterator<Item = (u64, &'a str)>, walker: Option<OwnFrames>) {
    live::start(countdown::MEAN_BYTES, running, walker, arrow::read(py));
    arrow::forget();
    hooks::install(!crate::reader::free_threaded(py));
}

/// Stops counting; the totals stay readable. With the GIL.
pub fn stop() {
    live::stop();
    hooks::uninstall();
}

/// The calling thread (`ident`, if it is the caller) starts a task of `prefix`, or ends
/// its task (None): its allocations are charged to that prefix, and numpy's handler is
/// set in the task's context (where that fails, its buffers go uncounted: the task
/// must start all the same). With the GIL.
pub fn task(py: Python<'_>, ident: u64, prefix: Option<&str>) {
    // SAFETY: no preconditions.
    if !live::tracking() || ident != unsafe { nix::libc::pthread_self() } as u64 {
        return;
    }
    live::set_task(prefix, arrow::read(py));
    if prefix.is_some() && numpy::set_in_context(py).is_err() {
        live::count_numpy_failure();
    }
}

/// arrow's pool holds `total` bytes now: the series notes it, and its growth since the
/// last reading is charged to the tasks running.
pub fn arrow_read(total: u64) {
    arrow::note(total);
    live::read_arrow(total);
}

/// The module `name`, where it is imported (numpy and pyarrow are not ours to import).
/// Asked as each task starts and ends: `sys.modules` is kept, and a missing name raises
/// nothing.
fn imported<'py>(py: Python<'py>, name: &str) -> Option<Bound<'py, PyAny>> {
    static MODULES: PyOnceLock<Option<Py<PyDict>>> = PyOnceLock::new();
    let modules = MODULES.get_or_init(py, || {
        let modules = py.import("sys").and_then(|sys| sys.getattr("modules")).ok()?;
        Some(modules.cast_into::<PyDict>().ok()?.unbind())
    });
    modules.as_ref()?.bind(py).get_item(name).ok().flatten()
}
