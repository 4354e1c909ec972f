//! `_native.LoopWatch`: an event loop's selector `select`, timed for stalls.

use crate::sampling::loops::LoopWatch;
use crate::sampling::thread::now_ns;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};
use std::sync::Arc;

/// Called by the loop in place of its selector's `select(timeout)`: the same call,
/// with the clock read around it (see `sampling/loops.rs`).
#[pyclass(name = "LoopWatch", module = "dask_pyspy._native", frozen)]
pub struct PyLoopWatch {
    pub(crate) watch: Arc<LoopWatch>,
    select: Py<PyAny>,
}

impl PyLoopWatch {
    pub(crate) fn new(watch: Arc<LoopWatch>, select: Py<PyAny>) -> PyLoopWatch {
        PyLoopWatch { watch, select }
    }
}

#[pymethods]
impl PyLoopWatch {
    #[pyo3(signature = (timeout=None))]
    fn __call__(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let timeout_ns = timeout.map(|t| (t.max(0.0) * 1e9) as u64);
        self.watch.polling(now_ns(), timeout_ns);
        let events = self.select.call1(py, (timeout,));
        self.watch.woke(now_ns());
        events
    }

    /// The selector holds the watch and the watch its bound `select`: a cycle the
    /// collector must see, for a selector dropped without its watch removed.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.select)
    }

    /// The `select` it times.
    #[getter]
    fn select(&self, py: Python<'_>) -> Py<PyAny> {
        self.select.clone_ref(py)
    }
}
