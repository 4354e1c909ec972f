//! `_native.Profile`: a profile's views, files and merges.

use super::{detached, heavy, metadata_arg, no_panic, shown, spans_arg};
use crate::error::Error;
use crate::formats::flamegraph::Only;
use crate::formats::{diff, files, flamegraph, limits, pprof, speedscope, speedscope_read, wire};
use crate::profile::model::ProfileData;
use crate::profile::spans::SpanFilter;
use crate::profile::summary;
use crate::profile::timeline::{self, SeriesBy};
use crate::profile::views::By;
use crate::values;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::Arc;

/// `span=` from Python: a str names one span (by name or id), a list a name path.
#[derive(FromPyObject)]
enum SpanArg {
    One(String),
    Path(Vec<String>),
}

impl From<SpanArg> for SpanFilter {
    fn from(arg: SpanArg) -> SpanFilter {
        match arg {
            SpanArg::One(one) => SpanFilter::One(one),
            SpanArg::Path(path) => SpanFilter::Path(path),
        }
    }
}

/// The keyword arguments of `flamegraph_svg` that narrow its samples.
fn only_arg(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Only> {
    let mut only = Only::default();
    for (key, value) in kwargs.into_iter().flat_map(|d| d.iter()) {
        match key.extract::<String>()?.as_str() {
            "prefix" => only.prefix = value.extract()?,
            "process" => only.process = value.extract()?,
            "tasks" => only.tasks = value.extract()?,
            "span" => only.span = value.extract::<Option<SpanArg>>()?.map(SpanFilter::from),
            "activity" => only.activity = value.extract()?,
            "stalls" => only.stalls = value.extract()?,
            other => {
                return Err(PyTypeError::new_err(format!(
                    "flamegraph_svg() got an unexpected keyword argument '{other}'"
                )))
            }
        }
    }
    Ok(only)
}

#[pyclass(name = "Profile", module = "dask_pyspy._native", frozen)]
pub struct PyProfile {
    pub(crate) data: Arc<ProfileData>,
}

impl PyProfile {
    pub(crate) fn new(data: ProfileData) -> PyProfile {
        PyProfile { data: Arc::new(data) }
    }
}

#[pymethods]
impl PyProfile {
    /// Reads a profile sent by another process (`wire.rs`).
    #[staticmethod]
    fn from_wire(py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        Ok(PyProfile::new(heavy(py, || wire::decode(data))??))
    }

    fn to_wire<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &heavy(py, || wire::encode(&self.data))?))
    }

    /// The head of wire bytes: what they hold, without the samples.
    #[staticmethod]
    fn wire_head<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyAny>> {
        let head = detached(py, || wire::read_head(data))??;
        no_panic(|| values::to_py(py, &head))
    }

    /// One profile of the named parts in wire bytes, merged as each is decoded, with
    /// `metadata` and `spans`. A part that does not decode is left out and named, with
    /// why, under the metadata's `missing`.
    #[staticmethod]
    #[pyo3(signature = (parts, metadata=None, spans=None))]
    fn merge_wire(
        py: Python<'_>,
        parts: Vec<(String, Bound<'_, PyBytes>)>,
        metadata: Option<&Bound<'_, PyDict>>,
        spans: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let (metadata, spans) = (metadata_arg(metadata)?, spans_arg(spans)?);
        let parts: Vec<(String, &[u8])> = parts.iter().map(|(name, b)| (name.clone(), b.as_bytes())).collect();
        Ok(PyProfile::new(heavy(py, || wire::merge(&parts, metadata, spans))?))
    }

    /// Our lossless file (`.pyspy.gz`, see `files.rs`), recording the grouping `by`.
    fn to_file<'py>(&self, py: Python<'py>, by: &str) -> PyResult<Bound<'py, PyBytes>> {
        let by: By = by.parse()?;
        let bytes = heavy(py, || files::write(&self.data, by))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// A profile and its grouping from the bytes of a `.pyspy.gz` file (`speedscope`
    /// False) or of a speedscope file dask-pyspy wrote (True), refused if it might
    /// take more than twice `max_result` bytes (see `limits.rs`).
    #[staticmethod]
    fn from_file(py: Python<'_>, data: &[u8], speedscope: bool, max_result: usize) -> PyResult<(Self, &'static str)> {
        let read = if speedscope { speedscope_read::read } else { files::read };
        let (data, by) = heavy(py, || read(data, limits::Limits::new(max_result)))??;
        Ok((PyProfile::new(data), by.as_str()))
    }

    /// What changed from `base` to this profile: graphs and tables (`diff.rs`).
    fn diff<'py>(&self, py: Python<'py>, base: PyRef<'_, PyProfile>) -> PyResult<Bound<'py, PyAny>> {
        let base = base.data.clone();
        let diff = heavy(py, || diff::diff(&base, &self.data))?;
        values::to_py(py, &diff)
    }

    /// One profile of several processes; the same process twice is kept once. The
    /// spans in `spans` name the parts' spans, over what the parts knew.
    #[staticmethod]
    #[pyo3(signature = (parts, metadata=None, spans=None))]
    fn merge(
        py: Python<'_>,
        parts: Vec<PyRef<'_, PyProfile>>,
        metadata: Option<&Bound<'_, PyDict>>,
        spans: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let (metadata, spans) = (metadata_arg(metadata)?, spans_arg(spans)?);
        let parts: Vec<Arc<ProfileData>> = parts.iter().map(|p| p.data.clone()).collect();
        let data = heavy(py, || {
            let owned: Vec<&ProfileData> = parts.iter().map(|p| &**p).collect();
            let mut merged = ProfileData::merge(&owned, metadata);
            merged.spans.extend(spans);
            merged
        })?;
        Ok(PyProfile::new(data))
    }

    #[pyo3(signature = (by="thread", weight="wall", name="dask-pyspy", compress=false))]
    fn speedscope<'py>(
        &self,
        py: Python<'py>,
        by: &str,
        weight: &str,
        name: &str,
        compress: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let shown = shown(by, weight)?;
        let bytes = heavy(py, || {
            if compress {
                speedscope::gzipped(&self.data, shown, name)
            } else {
                speedscope::write(&self.data, shown, name)
            }
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The profile in pprof's format, gzipped (see `pprof.rs`).
    fn pprof<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &heavy(py, || pprof::write(&self.data))?))
    }

    /// Flame graph of the samples `only` keeps: `prefix=`, `process=` and `span=`
    /// narrow them to one task prefix, process or span, `tasks=` to task samples
    /// (True) or the rest (False); None or absent keeps all.
    #[pyo3(signature = (title, by="thread", weight="wall", **only))]
    fn flamegraph_svg(
        &self,
        py: Python<'_>,
        title: &str,
        by: &str,
        weight: &str,
        only: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Option<String>> {
        let shown = shown(by, weight)?;
        let only = only_arg(only)?;
        heavy(py, || flamegraph::svg_of(&self.data, title, shown, &only))
    }

    /// `flamegraph_svg(title, by, weight, process=index)` of each (index, title), the
    /// indices distinct, from one pass over the samples.
    #[pyo3(signature = (processes, by="thread", weight="wall"))]
    fn process_flamegraph_svgs(
        &self,
        py: Python<'_>,
        processes: Vec<(u32, String)>,
        by: &str,
        weight: &str,
    ) -> PyResult<Vec<Option<String>>> {
        let shown = shown(by, weight)?;
        heavy(py, || flamegraph::process_svgs(&self.data, shown, &processes))
    }

    /// The same totals in fewer samples, one per thread, stack, tag and thread state,
    /// without their order; `keys` False merges task keys into their prefix.
    fn aggregated(&self, py: Python<'_>, keys: bool) -> PyResult<Self> {
        Ok(PyProfile::new(heavy(py, || self.data.aggregated(keys))?))
    }

    /// The same samples without their native frames: the Python-only picture.
    fn python_only(&self, py: Python<'_>) -> PyResult<Self> {
        Ok(PyProfile::new(heavy(py, || self.data.python_only())?))
    }

    /// Whether any sample has native frames.
    #[getter]
    fn has_native(&self) -> bool {
        self.data.stacks.iter().flatten().any(|&f| self.data.frames[f as usize].native)
    }

    /// The samples of a span (a name or id, or a name path outermost first) and the spans in it.
    fn only_span(&self, py: Python<'_>, span: SpanArg) -> PyResult<Self> {
        let filter = SpanFilter::from(span);
        Ok(PyProfile::new(heavy(py, || filter.select(&self.data))?))
    }

    /// The samples of the process at `index` in `processes()`.
    fn only_process(&self, py: Python<'_>, index: u32) -> PyResult<Self> {
        let n = self.data.processes.len();
        if index as usize >= n {
            return Err(Error::BadInput(format!("index must be below {n}, got {index}")).into());
        }
        Ok(PyProfile::new(heavy(py, || self.data.only_process(index))?))
    }

    /// Totals for reports (see `summary.rs`).
    fn summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let summary = heavy(py, || summary::summarize(&self.data))?;
        values::to_py(py, &summary)
    }

    /// Seconds per time step by process kind and series (see `timeline.rs`), the steps
    /// covering at least `bounds` (Unix seconds) where given.
    #[pyo3(signature = (step=None, by="prefix", bounds=None))]
    fn timeline<'py>(
        &self,
        py: Python<'py>,
        step: Option<f64>,
        by: &str,
        bounds: Option<(f64, f64)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let by: SeriesBy = by.parse()?;
        let timeline = heavy(py, || timeline::timeline(&self.data, step, by, bounds))??;
        values::to_py(py, &timeline)
    }

    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        values::to_py(py, &self.data.metadata)
    }

    fn processes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        values::to_py(py, &self.data.processes)
    }

    /// A copy with `metadata` merged into the metadata.
    fn with_metadata(&self, metadata: &Bound<'_, PyDict>) -> PyResult<Self> {
        let extra = metadata_arg(Some(metadata))?;
        let mut data = (*self.data).clone();
        data.metadata.extend(extra);
        Ok(PyProfile::new(data))
    }

    /// A copy that knows the spans in `spans` ({id: {"names": [...], "ids": [...]}}).
    fn with_spans(&self, spans: &Bound<'_, PyDict>) -> PyResult<Self> {
        let spans = spans_arg(Some(spans))?;
        let mut data = (*self.data).clone();
        data.spans.extend(spans);
        Ok(PyProfile::new(data))
    }

    /// Ids of the spans the samples' tags name.
    fn span_ids(&self) -> Vec<String> {
        self.data.span_ids()
    }

    /// Whether the profile holds an aggregated profile's timeline cells.
    #[getter]
    fn has_timeline(&self) -> bool {
        !self.data.timeline.is_empty()
    }

    #[getter]
    fn n_samples(&self) -> u64 {
        self.data.n_samples()
    }

    #[getter]
    fn total_seconds(&self) -> f64 {
        self.data.total_seconds()
    }
}
