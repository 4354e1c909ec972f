//! Python bindings only: every piece of logic lives in its own module.
//!
//! The pipeline, one folder per stage: `reader` reads stacks, `sampling` samples
//! and stores them, `profile` holds the model and what is computed from it, and
//! `formats` turns profiles into bytes and back.

mod error;
mod formats;
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

use error::Error;
use formats::flamegraph::Only;
use formats::{diff, files, flamegraph, limits, pprof, speedscope, speedscope_read, wire};
use profile::model::{Metadata, ProfileData, Span, Tag};
use profile::spans::SpanFilter;
use profile::summary;
use profile::timeline::{self, SeriesBy};
use profile::views::{By, Shown};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};
use rustc_hash::FxHashSet;
use sampling::config::SamplerConfig;
use sampling::sampler::{self, Sampler};
use sampling::thread::panic_message;
use sampling::window::Window;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// pyo3 turns a panic into PanicException, a BaseException that `except Exception`
/// lets through with a Rust backtrace: ours become RuntimeErrors.
fn internal_error(panic: Box<dyn std::any::Any + Send>) -> PyErr {
    Error::Bug(panic_message(&*panic)).into()
}

/// `f`, a panic in it a RuntimeError.
fn no_panic<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| Err(internal_error(panic)))
}

/// `f` without the GIL, a panic in it a RuntimeError.
fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    py.detach(|| catch_unwind(AssertUnwindSafe(f))).map_err(internal_error)
}

/// Heavy `f` (export, merge, render) without the GIL, at low priority (`priority.rs`).
fn heavy<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    detached(py, || priority::nicer(f))
}

/// `(start, stop)` in Unix seconds, aggregated or not, narrowed to `spans` if given.
fn window((start, stop): (f64, f64), aggregate: bool, spans: Option<&FxHashSet<String>>) -> Window<'_> {
    let ns = |t: f64| (t.max(0.0) * 1e9) as u64;
    Window { start_ns: ns(start), stop_ns: ns(stop), aggregate, spans }
}

fn metadata_arg(dict: Option<&Bound<'_, PyDict>>) -> PyResult<Metadata> {
    dict.map_or(Ok(Metadata::default()), |d| values::typed(d, "metadata"))
}

/// `{id: {"names": [...], "ids": [...]}}`, outermost first.
fn spans_arg(dict: Option<&Bound<'_, PyDict>>) -> PyResult<BTreeMap<String, Span>> {
    dict.map_or(Ok(BTreeMap::new()), |d| values::typed(d, "spans"))
}

fn shown(by: &str, weight: &str) -> PyResult<Shown> {
    Ok(Shown { by: by.parse()?, weight: weight.parse()? })
}

#[pyclass(name = "Sampler", module = "dask_pyspy._native", frozen)]
struct PySampler {
    inner: Sampler,
}

#[pymethods]
impl PySampler {
    /// `options`: an object with the attributes of `SamplerConfig` (None: defaults).
    #[new]
    #[pyo3(signature = (options=None))]
    fn new(options: Option<SamplerConfig>) -> PyResult<Self> {
        Ok(PySampler { inner: Sampler::new(options.unwrap_or_default())? })
    }

    /// New options for a stopped sampler, keeping its samples (see `Sampler::configure`).
    fn configure(&self, options: SamplerConfig) -> PyResult<()> {
        no_panic(|| Ok(self.inner.configure(options)?))
    }

    /// Opens the stack reader (its self-check needs the GIL), then samples without it.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        if self.inner.is_running() {
            return Err(Error::Broken(sampler::ALREADY_RUNNING.into()).into());
        }
        no_panic(|| {
            let config = self.inner.config();
            let chosen = reader::choose(py, config.reader_choice(), config.line_mode())?;
            Ok(detached(py, || self.inner.start(chosen))??)
        })
    }

    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.inner.stop())
    }

    #[getter]
    fn is_running(&self) -> bool {
        self.inner.is_running()
    }

    #[getter]
    fn has_started(&self) -> bool {
        self.inner.has_started()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        no_panic(|| values::to_py(py, &self.inner.stats()))
    }

    fn dump<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let dump = detached(py, || self.inner.dump())?;
        values::to_py(py, &dump)
    }

    /// Lossy: a key with lone surrogates must not fail the task that is starting.
    #[pyo3(signature = (ident, key, prefix, span=None))]
    fn set_thread_tag(
        &self,
        ident: u64,
        key: &Bound<'_, PyString>,
        prefix: &Bound<'_, PyString>,
        span: Option<&Bound<'_, PyString>>,
    ) {
        let text = |s: &Bound<'_, PyString>| s.to_string_lossy().into_owned();
        self.inner.tags().set_tag(ident, Tag { key: text(key), prefix: text(prefix), span: span.map(text) })
    }

    fn clear_thread_tag(&self, ident: u64) {
        self.inner.tags().clear_tag(ident)
    }

    /// Puts the calling thread in `activity`; returns what `leave_activity` goes back to.
    fn enter_activity(&self, activity: &Bound<'_, steps::PyActivity>) -> Option<steps::PyActivity> {
        steps::enter(self.inner.tags(), activity.get())
    }

    #[pyo3(signature = (previous))]
    fn leave_activity(&self, previous: Option<&Bound<'_, steps::PyActivity>>) {
        steps::leave(self.inner.tags(), previous.map(|p| p.get()))
    }

    /// Counts one dispatched call of `activity`, for the calls of `summary()["activities"]`.
    fn count_call(&self, activity: &Bound<'_, steps::PyActivity>) {
        self.inner.count_call(&activity.get().inner)
    }

    /// The activity the calling thread is in.
    fn current_activity(&self) -> Option<steps::PyActivity> {
        steps::current(self.inner.tags())
    }

    /// `coro` run in `activity` (an Activity, or a callable giving each step's).
    fn steps(&self, coro: Py<PyAny>, activity: Py<PyAny>) -> steps::Steps {
        steps::Steps::new(self.inner.tags().clone(), coro, activity)
    }

    #[pyo3(signature = (ident, name, native_id=None))]
    fn set_thread_name(&self, ident: u64, name: &Bound<'_, PyString>, native_id: Option<u64>) {
        self.inner.tags().set_name(ident, name.to_string_lossy().into_owned(), native_id)
    }

    fn clear_thread_name(&self, ident: u64) {
        self.inner.tags().clear_name(ident)
    }

    /// Names threads that nothing named yet (the fast reader reads no names).
    fn name_threads(&self, names: Vec<(u64, Bound<'_, PyString>, Option<u64>)>) {
        for (ident, name, native_id) in names {
            self.inner.tags().set_name_if_unnamed(ident, name.to_string_lossy().into_owned(), native_id)
        }
    }

    /// The samples captured in `bounds` (Unix seconds), as process `process_name`.
    fn profile(&self, py: Python<'_>, bounds: (f64, f64), process_name: String) -> PyResult<PyProfile> {
        let data = heavy(py, || self.inner.profile(window(bounds, false, None), process_name, Metadata::default()))?;
        Ok(PyProfile::new(data))
    }

    /// The samples in `bounds` (aggregated if `aggregate`; only those tagged with one
    /// of `span_ids` if given) in the wire format, with `metadata` and `spans`: one
    /// copy of the window, straight to bytes.
    #[pyo3(signature = (bounds, aggregate, process_name, metadata=None, spans=None, span_ids=None))]
    #[allow(clippy::too_many_arguments)] // Python's keywords
    fn export<'py>(
        &self,
        py: Python<'py>,
        bounds: (f64, f64),
        aggregate: bool,
        process_name: String,
        metadata: Option<&Bound<'py, PyDict>>,
        spans: Option<&Bound<'py, PyDict>>,
        span_ids: Option<Vec<String>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (metadata, spans) = (metadata_arg(metadata)?, spans_arg(spans)?);
        let span_ids = span_ids.map(FxHashSet::from_iter);
        let bytes = heavy(py, || {
            let mut data = self.inner.profile(window(bounds, aggregate, span_ids.as_ref()), process_name, metadata);
            data.spans = spans;
            wire::encode(&data)
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// What `export` would hold: (samples taken, approximate memory in bytes).
    #[pyo3(signature = (bounds, aggregate, span_ids=None))]
    fn window_size(
        &self,
        py: Python<'_>,
        bounds: (f64, f64),
        aggregate: bool,
        span_ids: Option<Vec<String>>,
    ) -> PyResult<(u64, u64)> {
        let span_ids = span_ids.map(FxHashSet::from_iter);
        let size = heavy(py, || self.inner.window_size(window(bounds, aggregate, span_ids.as_ref())))?;
        Ok((size.samples, size.bytes))
    }
}

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
struct PyProfile {
    data: Arc<ProfileData>,
}

impl PyProfile {
    fn new(data: ProfileData) -> PyProfile {
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

// Declared safe without the GIL: on a free-threaded build, a module that is not turns
// the GIL back on for the whole process when imported.
#[pymodule(name = "_native", gil_used = false)]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySampler>()?;
    m.add_class::<PyProfile>()?;
    m.add_class::<steps::PyActivity>()?;
    m.add_class::<steps::Steps>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_submodule(&testing::module(m.py())?)?;
    Ok(())
}
