//! The crate: its modules, and the Python module `_native` (the bindings are in `bind/`).
//! Every piece of logic lives in its own module.
//!
//! The pipeline, one folder per stage: `reader` reads stacks, `sampling` samples
//! and stores them, `profile` holds the model and what is computed from it, and
//! `formats` turns profiles into bytes and back. Beside it, `heap` samples allocations
//! for memory per task.

mod bind;
mod error;
mod formats;
mod heap;
mod names;
mod priority;
mod profile;
mod reader;
mod sampling;
mod steps;
mod sync;
mod testing;
mod values;

#[cfg(test)]
mod hostile_tests;

use bind::loops::PyLoopWatch;
use bind::profile::PyProfile;
use bind::sampler::PySampler;
use pyo3::prelude::*;

// Declared safe without the GIL: on a free-threaded build, a module that is not turns
// the GIL back on for the whole process when imported.
#[pymodule(name = "_native", gil_used = false)]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySampler>()?;
    m.add_class::<PyProfile>()?;
    m.add_class::<PyLoopWatch>()?;
    m.add_class::<steps::PyActivity>()?;
    m.add_class::<steps::Steps>()?;
    m.add_function(wrap_pyfunction!(bind::memory::memory_speedscope, m)?)?;
    m.add_function(wrap_pyfunction!(bind::memory::memory_pprof, m)?)?;
    m.add_function(wrap_pyfunction!(bind::memory::memory_flamegraph, m)?)?;
    m.add("OUTSIDE_TASKS", formats::memory::OUTSIDE)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_submodule(&testing::module(m.py())?)?;
    Ok(())
}
