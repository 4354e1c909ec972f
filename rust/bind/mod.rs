//! The Python bindings: what crosses the boundary and how (the GIL released for any
//! work, heavy work at low priority, a panic a RuntimeError), the `Sampler` and
//! `Profile` classes and memory per task's functions in their own files.

pub mod loops;
pub mod memory;
pub mod profile;
pub mod sampler;

use crate::error::Error;
use crate::priority;
use crate::profile::model::{Metadata, Span};
use crate::profile::views::Shown;
use crate::sampling::thread::panic_message;
use crate::sampling::window::Window;
use crate::values;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rustc_hash::FxHashSet;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// pyo3 turns a panic into PanicException, a BaseException that `except Exception`
/// lets through with a Rust backtrace: ours become RuntimeErrors.
pub fn internal_error(panic: Box<dyn std::any::Any + Send>) -> PyErr {
    Error::Bug(panic_message(&*panic)).into()
}

/// `f`, a panic in it a RuntimeError.
pub fn no_panic<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| Err(internal_error(panic)))
}

/// `f` without the GIL, a panic in it a RuntimeError.
pub fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    py.detach(|| catch_unwind(AssertUnwindSafe(f))).map_err(internal_error)
}

/// Heavy `f` (export, merge, render) without the GIL, at low priority (`priority.rs`).
pub fn heavy<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    detached(py, || priority::nicer(f))
}

/// `(start, stop)` in Unix seconds, aggregated or not, narrowed to `spans` if given.
pub fn window((start, stop): (f64, f64), aggregate: bool, spans: Option<&FxHashSet<String>>) -> Window<'_> {
    let ns = |t: f64| (t.max(0.0) * 1e9) as u64;
    Window { start_ns: ns(start), stop_ns: ns(stop), aggregate, spans, stalls: &[] }
}

pub fn metadata_arg(dict: Option<&Bound<'_, PyDict>>) -> PyResult<Metadata> {
    dict.map_or(Ok(Metadata::default()), |d| values::typed(d, "metadata"))
}

/// `{id: {"names": [...], "ids": [...]}}`, outermost first.
pub fn spans_arg(dict: Option<&Bound<'_, PyDict>>) -> PyResult<BTreeMap<String, Span>> {
    dict.map_or(Ok(BTreeMap::new()), |d| values::typed(d, "spans"))
}

pub fn shown(by: &str, weight: &str) -> PyResult<Shown> {
    Ok(Shown { by: by.parse()?, weight: weight.parse()? })
}
