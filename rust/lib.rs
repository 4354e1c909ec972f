//! Python bindings only: every piece of logic lives in its own module.

mod formats;
mod names;
mod profile;
mod reader;
mod sampling;
mod sync;

#[cfg(test)]
mod hostile_tests;

use flate2::Compression;
use formats::{compress, diff, files, flamegraph, limits, pprof, speedscope, speedscope_read, wire};
use profile::model::{Merger, ProfileData, Sample, Span, Tag};
use profile::{spans, summary, views};
use sampling::config::SamplerConfig;
use sampling::{sampler, store};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use serde_json::{Map, Value};
use spans::SpanFilter;
use views::{By, Shown};
use std::any::Any;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use store::Window;
use std::sync::Arc;

fn value_error(e: impl ToString) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// pyo3 turns a panic into PanicException, a BaseException that `except Exception`
/// lets through with a Rust backtrace: ours become RuntimeErrors.
fn internal_error(panic: Box<dyn Any + Send>) -> PyErr {
    PyRuntimeError::new_err(format!("dask-pyspy failed (a bug, please report it): {}", sampler::panic_message(&*panic)))
}

/// `f`, a panic in it a RuntimeError.
fn no_panic<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| Err(internal_error(panic)))
}

/// `f` without the GIL, a panic in it a RuntimeError.
fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    py.detach(|| catch_unwind(AssertUnwindSafe(f))).map_err(internal_error)
}

fn secs_to_ns(t: f64) -> u64 {
    (t.max(0.0) * 1e9) as u64
}

fn parse_object(json: &str, what: &str) -> PyResult<Map<String, Value>> {
    serde_json::from_str(json).map_err(|e| value_error(format!("{what} must be a JSON object: {e}")))
}

/// Checked sampler options: a bad one is a ValueError before anything changes.
#[allow(clippy::too_many_arguments)]
fn sampler_config(rate: f64, idle: bool, gil_only: bool, cpu_budget: f64, max_memory: usize, lines: bool, function: bool, reader: &str) -> PyResult<SamplerConfig> {
    let reader = reader.parse().map_err(value_error)?;
    let config = SamplerConfig { rate, idle, gil_only, cpu_budget, max_memory, lines, function, reader };
    config.validate().map_err(value_error)?;
    Ok(config)
}

#[pyclass(name = "Sampler", module = "dask_pyspy._native", frozen)]
struct PySampler {
    inner: sampler::Sampler,
}

#[pymethods]
impl PySampler {
    #[new]
    #[pyo3(signature = (rate=100.0, idle=false, gil_only=false, cpu_budget=0.01, max_memory=64 << 20, lines=true, function=false, reader="auto"))]
    #[allow(clippy::too_many_arguments)]
    fn new(rate: f64, idle: bool, gil_only: bool, cpu_budget: f64, max_memory: usize, lines: bool, function: bool, reader: &str) -> PyResult<Self> {
        let config = sampler_config(rate, idle, gil_only, cpu_budget, max_memory, lines, function, reader)?;
        Ok(PySampler { inner: sampler::Sampler::new(config).map_err(value_error)? })
    }

    /// New options for a stopped sampler, keeping its samples (see `Sampler::configure`).
    #[allow(clippy::too_many_arguments)]
    fn configure(&self, rate: f64, idle: bool, gil_only: bool, cpu_budget: f64, max_memory: usize, lines: bool, function: bool, reader: &str) -> PyResult<()> {
        let config = sampler_config(rate, idle, gil_only, cpu_budget, max_memory, lines, function, reader)?;
        no_panic(|| self.inner.configure(config).map_err(PyRuntimeError::new_err))
    }

    /// Opens the stack reader (its self-check needs the GIL), then samples without it.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        if self.inner.is_running() {
            return Err(PyRuntimeError::new_err(sampler::ALREADY_RUNNING));
        }
        no_panic(|| {
            let config = self.inner.config();
            let chosen = reader::choose(py, config.reader, config.line_mode()).map_err(PyRuntimeError::new_err)?;
            detached(py, || self.inner.start(chosen))?.map_err(PyRuntimeError::new_err)
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

    fn stats_json(&self) -> PyResult<String> {
        no_panic(|| Ok(self.inner.stats().to_string()))
    }

    fn dump_json(&self, py: Python<'_>) -> PyResult<String> {
        detached(py, || self.inner.dump().to_string())
    }

    /// Lossy: a key with lone surrogates must not fail the task that is starting.
    #[pyo3(signature = (ident, key, prefix, span=None))]
    fn set_thread_tag(&self, ident: u64, key: &Bound<'_, PyString>, prefix: &Bound<'_, PyString>, span: Option<&Bound<'_, PyString>>) {
        let text = |s: &Bound<'_, PyString>| s.to_string_lossy().into_owned();
        self.inner.tags().set_tag(ident, Tag { key: text(key), prefix: text(prefix), span: span.map(text) })
    }

    fn clear_thread_tag(&self, ident: u64) {
        self.inner.tags().clear_tag(ident)
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

    /// The samples captured between `start` and `stop` (Unix seconds).
    fn profile(&self, py: Python<'_>, start: f64, stop: f64, process_name: String, host: String) -> PyResult<PyProfile> {
        let window = Window { start_ns: secs_to_ns(start), stop_ns: secs_to_ns(stop), fold: false };
        let data = detached(py, || self.inner.profile(window, process_name, host, Map::new()))?;
        Ok(PyProfile { data: Arc::new(data) })
    }

    /// The samples between `start` and `stop` (aggregated with `fold`) in the wire
    /// format, with `metadata_json` and the spans of `spans_json`: one copy of the
    /// window, straight to bytes.
    #[allow(clippy::too_many_arguments)]
    fn export<'py>(
        &self,
        py: Python<'py>,
        start: f64,
        stop: f64,
        fold: bool,
        process_name: String,
        host: String,
        metadata_json: &str,
        spans_json: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let metadata = parse_object(metadata_json, "metadata_json")?;
        let spans = parse_spans(spans_json)?;
        let window = Window { start_ns: secs_to_ns(start), stop_ns: secs_to_ns(stop), fold };
        let bytes = detached(py, || {
            let mut data = self.inner.profile(window, process_name, host, metadata);
            data.spans = spans;
            wire::encode(&data)
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// What `export` would hold: (samples taken, approximate memory in bytes).
    fn window_size(&self, py: Python<'_>, start: f64, stop: f64, fold: bool) -> PyResult<(u64, u64)> {
        let window = Window { start_ns: secs_to_ns(start), stop_ns: secs_to_ns(stop), fold };
        let size = detached(py, || self.inner.window_size(window))?;
        Ok((size.samples, size.bytes))
    }

    fn _inject_panic(&self) {
        self.inner.inject_panic()
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

fn parse_spans(spans_json: &str) -> PyResult<BTreeMap<String, Span>> {
    serde_json::from_str(spans_json).map_err(|e| value_error(format!("spans_json: {e}")))
}

fn shown(by: &str, weight: &str) -> PyResult<Shown> {
    Ok(Shown { by: by.parse().map_err(value_error)?, weight: weight.parse().map_err(value_error)? })
}

#[pyclass(name = "Profile", module = "dask_pyspy._native", frozen)]
struct PyProfile {
    data: Arc<ProfileData>,
}

#[pymethods]
impl PyProfile {
    /// Reads a profile sent by another process (`wire.rs`).
    #[staticmethod]
    fn from_wire(py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        let data = detached(py, || wire::decode(data))?.map_err(|e| value_error(format!("not a dask-pyspy profile: {e}")))?;
        Ok(PyProfile { data: Arc::new(data) })
    }

    fn to_wire<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &detached(py, || wire::encode(&self.data))?))
    }

    /// The head of wire bytes (what they hold, without the samples), as JSON.
    #[staticmethod]
    fn wire_head(data: &[u8]) -> PyResult<String> {
        no_panic(|| {
            let head = wire::read_head(data).map_err(|e| value_error(format!("not a dask-pyspy profile: {e}")))?;
            Ok(serde_json::to_string(&head).expect("heads serialise"))
        })
    }

    /// One profile of the named parts in wire bytes, merged as each is decoded, with
    /// `metadata_json` and the spans of `spans_json`. A part that does not decode is
    /// left out and named, with why, under the metadata's `missing`.
    #[staticmethod]
    fn merge_wire(py: Python<'_>, parts: Vec<(String, Bound<'_, PyBytes>)>, metadata_json: &str, spans_json: &str) -> PyResult<Self> {
        let mut metadata = parse_object(metadata_json, "metadata_json")?;
        let spans = parse_spans(spans_json)?;
        let parts: Vec<(String, &[u8])> = parts.iter().map(|(name, b)| (name.clone(), b.as_bytes())).collect();
        let data = detached(py, || {
            let mut merger = Merger::default();
            let mut missing = match metadata.remove("missing") {
                Some(Value::Object(m)) => m,
                _ => Map::new(),
            };
            for (name, e) in wire::merge_parts(&parts, &mut merger) {
                missing.insert(name, Value::String(format!("an unreadable profile: {e}")));
            }
            metadata.insert("missing".into(), Value::Object(missing));
            let mut merged = merger.finish(metadata);
            merged.spans.extend(spans);
            merged
        })?;
        Ok(PyProfile { data: Arc::new(data) })
    }

    /// Our lossless file (`.pyspy.gz`, see `files.rs`), recording the grouping `by`.
    fn to_file<'py>(&self, py: Python<'py>, by: &str) -> PyResult<Bound<'py, PyBytes>> {
        let by: By = by.parse().map_err(value_error)?;
        let bytes = detached(py, || files::write(&self.data, by))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// A profile and its grouping from the bytes of a `.pyspy.gz` file (`speedscope`
    /// False) or of a speedscope file dask-pyspy wrote (True), refused if it might
    /// take more than twice `max_result` bytes (see `limits.rs`).
    #[staticmethod]
    fn from_file(py: Python<'_>, data: &[u8], speedscope: bool, max_result: usize) -> PyResult<(Self, &'static str)> {
        let read = if speedscope { speedscope_read::read } else { files::read };
        let (data, by) = detached(py, || read(data, limits::Limits::new(max_result)))?.map_err(value_error)?;
        Ok((PyProfile { data: Arc::new(data) }, by.as_str()))
    }

    /// A hash of every table and sample, equal only for equal profiles (in any
    /// process running this build).
    fn digest(&self, py: Python<'_>) -> PyResult<String> {
        detached(py, || {
            let mut hasher = std::hash::DefaultHasher::new();
            std::hash::Hasher::write(&mut hasher, &serde_json::to_vec(&*self.data).expect("profiles serialise"));
            format!("{:016x}", std::hash::Hasher::finish(&hasher))
        })
    }

    /// What changed from `base` to this profile: graphs and tables (`diff.rs`), as JSON.
    fn diff_json(&self, py: Python<'_>, base: PyRef<'_, PyProfile>) -> PyResult<String> {
        let base = base.data.clone();
        detached(py, || serde_json::to_string(&diff::diff(&base, &self.data)).expect("diffs serialise"))
    }

    /// One profile of several processes; the same process twice is kept once. The
    /// spans in `spans_json` name the parts' spans, over what the parts knew.
    #[staticmethod]
    #[pyo3(signature = (parts, metadata_json, spans_json="{}"))]
    fn merge(py: Python<'_>, parts: Vec<PyRef<'_, PyProfile>>, metadata_json: &str, spans_json: &str) -> PyResult<Self> {
        let metadata = parse_object(metadata_json, "metadata_json")?;
        let spans = parse_spans(spans_json)?;
        let parts: Vec<Arc<ProfileData>> = parts.iter().map(|p| p.data.clone()).collect();
        let data = detached(py, || {
            let owned: Vec<&ProfileData> = parts.iter().map(|p| &**p).collect();
            let mut merged = ProfileData::merge(&owned, metadata);
            merged.spans.extend(spans);
            merged
        })?;
        Ok(PyProfile { data: Arc::new(data) })
    }

    #[pyo3(signature = (by="thread", weight="wall", name="dask-pyspy", compress=false))]
    fn speedscope<'py>(&self, py: Python<'py>, by: &str, weight: &str, name: &str, compress: bool) -> PyResult<Bound<'py, PyBytes>> {
        let shown = shown(by, weight)?;
        let bytes = detached(py, || {
            let doc = speedscope::write(&self.data, shown, name);
            if compress { compress::gzip(&doc, Compression::default()) } else { doc }
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The profile in pprof's format, gzipped (see `pprof.rs`).
    fn pprof<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &detached(py, || pprof::write(&self.data))?))
    }

    /// Flame graph of the samples of one task prefix, one process and/or one span
    /// (None: all). `tasks`: None for every sample, True for task samples only, False
    /// for the rest.
    #[pyo3(signature = (title, by="thread", weight="wall", prefix=None, process=None, tasks=None, span=None))]
    #[allow(clippy::too_many_arguments)]
    fn flamegraph_svg(
        &self,
        py: Python<'_>,
        title: &str,
        by: &str,
        weight: &str,
        prefix: Option<&str>,
        process: Option<u32>,
        tasks: Option<bool>,
        span: Option<SpanArg>,
    ) -> PyResult<Option<String>> {
        let shown = shown(by, weight)?;
        let data = &self.data;
        let span = span.map(SpanFilter::from);
        detached(py, || {
            let in_span: Vec<bool> = data.tags.iter().map(|t| span.as_ref().is_none_or(|f| f.keeps(data, t))).collect();
            let keep = |s: &Sample| {
                let prefix_ok = prefix.is_none_or(|p| s.tag.is_some_and(|t| data.tags[t as usize].prefix == p));
                let process_ok = process.is_none_or(|p| data.threads[s.thread as usize].process == p);
                let span_ok = span.is_none() || s.tag.is_some_and(|t| in_span[t as usize]);
                prefix_ok && process_ok && span_ok && tasks.is_none_or(|t| t == s.tag.is_some())
            };
            flamegraph::svg(data, title, shown, &keep)
        })
    }

    /// The same totals in fewer samples, one per thread, stack, tag and thread state,
    /// without their order; `keys` False folds task keys into their prefix.
    fn folded(&self, py: Python<'_>, keys: bool) -> PyResult<Self> {
        Ok(PyProfile { data: Arc::new(detached(py, || self.data.folded(keys))?) })
    }

    /// The samples of a span (a name or id, or a name path outermost first) and the spans in it.
    fn only_span(&self, py: Python<'_>, span: SpanArg) -> PyResult<Self> {
        let filter = SpanFilter::from(span);
        Ok(PyProfile { data: Arc::new(detached(py, || filter.select(&self.data))?) })
    }

    /// The samples of the process at `index` in `processes_json()`.
    fn only_process(&self, py: Python<'_>, index: u32) -> PyResult<Self> {
        if index as usize >= self.data.processes.len() {
            return Err(value_error(format!("index must be below {}, got {index}", self.data.processes.len())));
        }
        Ok(PyProfile { data: Arc::new(detached(py, || self.data.only_process(index))?) })
    }

    /// Totals for reports (see `summary.rs`), as JSON.
    fn summary_json(&self, py: Python<'_>) -> PyResult<String> {
        detached(py, || serde_json::to_string(&summary::summarize(&self.data)).expect("summaries serialise"))
    }

    fn metadata_json(&self) -> String {
        serde_json::to_string(&self.data.metadata).expect("metadata serialises")
    }

    /// A copy with `metadata_json` (an object) merged into the metadata.
    fn with_metadata(&self, metadata_json: &str) -> PyResult<Self> {
        let extra = parse_object(metadata_json, "metadata_json")?;
        let mut data = (*self.data).clone();
        data.metadata.extend(extra);
        Ok(PyProfile { data: Arc::new(data) })
    }

    /// A copy that knows the spans in `spans_json` ({id: {"names": [...], "ids": [...]}}).
    fn with_spans(&self, spans_json: &str) -> PyResult<Self> {
        let spans = parse_spans(spans_json)?;
        let mut data = (*self.data).clone();
        data.spans.extend(spans);
        Ok(PyProfile { data: Arc::new(data) })
    }

    /// Ids of the spans the samples' tags name.
    fn span_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.data.tags.iter().filter_map(|t| t.span.clone()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// A copy as another process named `name`, its task keys suffixed with
    /// `key_suffix`: benchmarks build many workers' parts from one real part.
    fn _as_process(&self, py: Python<'_>, name: &str, key_suffix: &str) -> PyResult<Self> {
        let mut data = detached(py, || (*self.data).clone())?;
        for p in &mut data.processes {
            (p.name, p.token) = (name.to_owned(), format!("{}-{name}", p.token));
        }
        data.tags.iter_mut().for_each(|t| t.key.push_str(key_suffix));
        Ok(PyProfile { data: Arc::new(data) })
    }

    fn processes_json(&self) -> String {
        serde_json::to_string(&self.data.processes).expect("processes serialise")
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

/// Test switch: a panic inside a call, to prove it reaches Python as a RuntimeError.
#[pyfunction]
fn _panic_in_call() -> PyResult<()> {
    no_panic(|| panic!("injected by the test switch"))
}

#[pymodule(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_panic_in_call, m)?)?;
    m.add_class::<PySampler>()?;
    m.add_class::<PyProfile>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
