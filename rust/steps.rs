//! Activities as Python sees them: a named activity, entering and leaving it in the
//! calling thread, and `Steps`, which keeps a coroutine's activity across its awaits.
//!
//! An event loop interleaves coroutines, so an activity is the thread's only while
//! one of its coroutine's steps runs: `Steps` enters it before each step and leaves
//! it after, and whatever runs between steps is not counted as the coroutine's.

use crate::names::choose;
use crate::reader::tags::{Activity, Level, ThreadTags};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use pyo3::{intern, PyTraverseError, PyVisit};
use std::sync::Arc;

/// The thread `threading.get_ident()` names: CPython's ident is `pthread_self()`.
pub fn ident() -> u64 {
    nix::sys::pthread::pthread_self() as u64
}

const LEVELS: [(&str, Level); 3] =
    [("connection", Level::Connection), ("dispatch", Level::Dispatch), ("state-machine", Level::StateMachine)];

#[pyclass(name = "Activity", module = "dask_pyspy._native", frozen)]
pub struct PyActivity {
    pub inner: Arc<Activity>,
}

#[pymethods]
impl PyActivity {
    #[new]
    fn new(name: &str, level: &str) -> PyResult<PyActivity> {
        let level = choose("level", level, &LEVELS)?;
        Ok(PyActivity { inner: Arc::new(Activity { name: name.into(), level }) })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn __repr__(&self) -> String {
        format!("Activity({:?})", &*self.inner.name)
    }
}

/// Enters `activity` in the calling thread; returns what `leave` goes back to.
pub fn enter(tags: &ThreadTags, activity: &PyActivity) -> Option<PyActivity> {
    tags.enter(ident(), &activity.inner).map(|inner| PyActivity { inner })
}

/// The activity the calling thread is in.
pub fn current(tags: &ThreadTags) -> Option<PyActivity> {
    tags.activity(ident()).map(|inner| PyActivity { inner })
}

pub fn leave(tags: &ThreadTags, previous: Option<&PyActivity>) {
    tags.leave(ident(), previous.map(|p| p.inner.clone()))
}

/// A coroutine run in an activity, step by step: awaiting it awaits the coroutine.
///
/// `activity` is an `Activity`, or a callable that returns the one for the next step
/// (or None for none), for a loop whose work changes from one message to the next.
#[pyclass(module = "dask_pyspy._native")]
pub struct Steps {
    tags: Arc<ThreadTags>,
    coro: Py<PyAny>,
    activity: Py<PyAny>,
}

impl Steps {
    pub fn new(tags: Arc<ThreadTags>, coro: Py<PyAny>, activity: Py<PyAny>) -> Steps {
        Steps { tags, coro, activity }
    }

    /// Runs one step of the coroutine inside the activity.
    fn step<'py>(
        &self,
        py: Python<'py>,
        run: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let activity = self.activity.bind(py);
        let now = match activity.cast::<PyActivity>() {
            Ok(a) => Some(a.clone()),
            Err(_) => {
                let chosen = activity.call0()?;
                if chosen.is_none() {
                    None
                } else {
                    Some(chosen.cast_into::<PyActivity>()?)
                }
            }
        };
        let ident = ident();
        let previous = now.as_ref().map(|a| self.tags.enter(ident, &a.get().inner));
        let result = run(self.coro.bind(py));
        if let Some(previous) = previous {
            self.tags.leave(ident, previous);
        }
        result
    }
}

#[pymethods]
impl Steps {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.step(py, |c| c.call_method1(intern!(py, "send"), (py.None(),)))
    }

    fn send<'py>(&self, py: Python<'py>, value: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.step(py, |c| c.call_method1(intern!(py, "send"), (value,)))
    }

    #[pyo3(signature = (*args))]
    fn throw<'py>(&self, py: Python<'py>, args: Bound<'py, PyTuple>) -> PyResult<Bound<'py, PyAny>> {
        self.step(py, |c| c.call_method1(intern!(py, "throw"), args))
    }

    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.step(py, |c| c.call_method0(intern!(py, "close")))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.coro)?;
        visit.call(&self.activity)
    }
}
