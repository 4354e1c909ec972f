//! `_native.Sampler`: the process sampler's handle.

use super::{detached, heavy, metadata_arg, no_panic, spans_arg, window};
use crate::bind::loops::PyLoopWatch;
use crate::bind::profile::PyProfile;
use crate::error::Error;
use crate::formats::wire;
use crate::heap;
use crate::profile::model::{Metadata, Tag};
use crate::sampling::config::SamplerConfig;
use crate::sampling::sampler::{self, Sampler};
use crate::values;
use crate::{reader, steps};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};
use rustc_hash::FxHashSet;

#[pyclass(name = "Sampler", module = "dask_pyspy._native", frozen)]
pub struct PySampler {
    pub(crate) inner: Sampler,
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
            let walker = chosen.own_frames();
            detached(py, || self.inner.start(chosen))??;
            if config.memory {
                let tags = self.inner.tags().snapshot();
                heap::start(
                    py,
                    tags.iter().filter_map(|(&ident, t)| Some((ident, t.marks.task.as_ref()?.prefix.as_str()))),
                    walker,
                );
            }
            Ok(())
        })
    }

    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        if self.inner.config().memory {
            heap::stop();
        }
        detached(py, || self.inner.stop())
    }

    /// What memory tracking counted since it started (`memory=True`), for the whole
    /// process, its prefixes narrowed to `bounds` (Unix seconds) where given, with every
    /// site apart.
    #[pyo3(signature = (bounds=None))]
    fn memory<'py>(&self, py: Python<'py>, bounds: Option<(f64, f64)>) -> PyResult<Bound<'py, PyAny>> {
        let within = bounds.map(|b| window(b, false, None)).map(|w| (w.start_ns, w.stop_ns));
        let counted = detached(py, || self.inner.memory(within, usize::MAX))?;
        values::to_py(py, &counted.unwrap_or_else(|| heap::live::counted(0)))
    }

    /// The total arrow's pool holds now (`pyarrow.total_allocated_bytes()`), for the
    /// series beside resident memory and for the tasks running.
    fn note_arrow_bytes(&self, bytes: u64) {
        heap::arrow_read(bytes);
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
        let tag = Tag { key: text(key), prefix: text(prefix), span: span.map(text) };
        heap::task(key.py(), ident, Some(&tag.prefix));
        self.inner.tags().set_tag(ident, tag)
    }

    fn clear_thread_tag(&self, py: Python<'_>, ident: u64) {
        heap::task(py, ident, None);
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

    /// `select` timed for stalls of at least `threshold` seconds of the calling
    /// thread's event loop: the loop calls the watch in its place.
    fn watch_loop(&self, select: Py<PyAny>, threshold: f64) -> PyResult<PyLoopWatch> {
        if !(threshold.is_finite() && threshold > 0.0) {
            return Err(PyValueError::new_err(format!(
                "threshold must be a positive number of seconds, not {threshold}"
            )));
        }
        let ident = steps::ident();
        Ok(PyLoopWatch::new(self.inner.watch_loop(ident, (threshold * 1e9) as u64), select))
    }

    fn unwatch_loop(&self, watch: &Bound<'_, PyLoopWatch>) {
        self.inner.unwatch_loop(&watch.get().watch)
    }

    /// The stalls in `bounds` (Unix seconds) of at least `min_duration` seconds, the
    /// `most` longest explained (see `Sampler::stalls`).
    fn stalls<'py>(
        &self,
        py: Python<'py>,
        bounds: (f64, f64),
        min_duration: f64,
        most: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let w = window(bounds, false, None);
        let min_ns = (min_duration.max(0.0) * 1e9) as u64;
        let stalls = heavy(py, || self.inner.stalls(w.start_ns, w.stop_ns, min_ns, most))?;
        values::to_py(py, &stalls)
    }

    /// The samples captured in `bounds` (Unix seconds), as process `process_name`.
    fn profile(&self, py: Python<'_>, bounds: (f64, f64), process_name: String) -> PyResult<PyProfile> {
        let data = heavy(py, || self.inner.profile(window(bounds, false, None), process_name, Metadata::default()))?;
        Ok(PyProfile::new(data))
    }

    /// The samples in `bounds` (aggregated if `aggregate`; only those tagged with one
    /// of `span_ids` if given) in the wire format, with `metadata` and `spans`, and
    /// `process_stats` (what the server knows of its process) among the process's
    /// stats: one copy of the window, straight to bytes.
    #[pyo3(signature = (bounds, aggregate, process_name, metadata=None, spans=None, span_ids=None, process_stats=None))]
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
        process_stats: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (metadata, spans) = (metadata_arg(metadata)?, spans_arg(spans)?);
        let process_stats = process_stats.map(values::object).transpose()?.unwrap_or_default();
        let span_ids = span_ids.map(FxHashSet::from_iter);
        let bytes = heavy(py, || {
            let mut data = self.inner.profile(window(bounds, aggregate, span_ids.as_ref()), process_name, metadata);
            if let Some(stats) = data.processes[0].stats.as_object_mut() {
                stats.extend(process_stats);
            }
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
