//! Memory per task's files and graph (`formats::memory`), from `MemoryProfile.processes`.

use super::{heavy, no_panic};
use crate::formats::{compress, memory};
use crate::values;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

fn processes(dict: &Bound<'_, PyDict>) -> PyResult<memory::Processes> {
    values::typed(dict, "processes")
}

/// The speedscope document of `processes` (name: what it counted), gzipped if asked.
#[pyfunction]
pub fn memory_speedscope<'py>(dict: &Bound<'py, PyDict>, name: &str, compress: bool) -> PyResult<Bound<'py, PyBytes>> {
    let py = dict.py();
    let processes = no_panic(|| processes(dict))?;
    let bytes = heavy(py, || {
        let doc = memory::speedscope(&processes, name);
        if compress {
            compress::kept(&doc)
        } else {
            doc
        }
    })?;
    Ok(PyBytes::new(py, &bytes))
}

/// The gzipped pprof profile of `processes`.
#[pyfunction]
pub fn memory_pprof<'py>(dict: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyBytes>> {
    let py = dict.py();
    let processes = no_panic(|| processes(dict))?;
    let bytes = heavy(py, || memory::pprof(&processes))?;
    Ok(PyBytes::new(py, &bytes))
}

/// A flame graph (SVG) of the bytes `processes` hold; None where they hold none.
#[pyfunction]
pub fn memory_flamegraph(dict: &Bound<'_, PyDict>, title: &str) -> PyResult<Option<String>> {
    let processes = no_panic(|| processes(dict))?;
    heavy(dict.py(), || memory::flamegraph_svg(&processes, title))
}
