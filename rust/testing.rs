//! `_native._testing`: hooks for dask-pyspy's own tests and benchmarks, not an API.

use crate::{detached, no_panic, PyProfile, PySampler};
use pyo3::prelude::*;

/// A panic inside a call, to prove it reaches Python as a RuntimeError.
#[pyfunction]
fn panic_in_call() -> PyResult<()> {
    no_panic(|| panic!("injected by the test switch"))
}

/// The sampler's next tick panics, to prove a panic is contained and reported.
#[pyfunction]
fn inject_panic(sampler: PyRef<'_, PySampler>) {
    sampler.inner.inject_panic()
}

/// A hash of every table and sample, equal only for equal profiles (in any process
/// running this build).
#[pyfunction]
fn digest(py: Python<'_>, profile: PyRef<'_, PyProfile>) -> PyResult<String> {
    let data = profile.data.clone();
    detached(py, || data.digest())
}

/// A copy as another process named `name`, its task keys suffixed with `key_suffix`.
#[pyfunction]
fn as_process(py: Python<'_>, profile: PyRef<'_, PyProfile>, name: &str, key_suffix: &str) -> PyResult<PyProfile> {
    let data = profile.data.clone();
    Ok(PyProfile::new(detached(py, || data.as_process(name, key_suffix))?))
}

pub fn module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    let m = PyModule::new(py, "_testing")?;
    m.add_function(wrap_pyfunction!(panic_in_call, &m)?)?;
    m.add_function(wrap_pyfunction!(inject_panic, &m)?)?;
    m.add_function(wrap_pyfunction!(digest, &m)?)?;
    m.add_function(wrap_pyfunction!(as_process, &m)?)?;
    Ok(m)
}
