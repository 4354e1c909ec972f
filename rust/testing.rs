//! `_native._testing`: hooks for dask-pyspy's own tests and benchmarks, not an API.

use crate::bind::profile::PyProfile;
use crate::bind::sampler::PySampler;
use crate::bind::{detached, no_panic};
use crate::profile::model::{ProfileData, Tag};
use crate::profile::sample::State;
use crate::sampling::store::{Recorded, Store};
use pyo3::prelude::*;
use std::collections::HashMap;

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

/// Holds `sampler`'s store for `seconds`, as a slow export would.
#[pyfunction]
fn hold_store(py: Python<'_>, sampler: PyRef<'_, PySampler>, seconds: f64) -> PyResult<()> {
    let sampler = &sampler.inner;
    detached(py, || sampler.with_store(|_| std::thread::sleep(std::time::Duration::from_secs_f64(seconds))))
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

/// The samples of threads in one of `states` (`State::name`: "cpu", "gil-wait", ...):
/// the running ones, to compare with a profiler that leaves waiting threads out.
#[pyfunction]
fn only_states(py: Python<'_>, profile: PyRef<'_, PyProfile>, states: Vec<String>) -> PyResult<PyProfile> {
    let data = profile.data.clone();
    Ok(PyProfile::new(detached(py, || data.filtered(|s| states.iter().any(|n| n == State::of(s.flags).name())))?))
}

/// Empties `sampler`'s store, which must not be sampling, and records `profile`'s
/// samples into it, round and round, as if sampled at `rate` per thread for `seconds`
/// from `start` (Unix seconds): a day of history in a minute, for the retention
/// benchmark. Task keys get the minute as a suffix, as new
/// tasks would. Returns the seconds recorded per task prefix ("" outside tasks).
#[pyfunction]
fn replay(
    py: Python<'_>,
    sampler: PyRef<'_, PySampler>,
    profile: PyRef<'_, PyProfile>,
    start: f64,
    seconds: f64,
    rate: f64,
) -> PyResult<HashMap<String, f64>> {
    let data = profile.data.clone();
    let sampler = &sampler.inner;
    let ticks = (seconds * rate) as u64;
    let interval_ns = 1e9 / rate;
    let mut replay = Replay { data: &data, next: 0, frames: Vec::new(), generation: u64::MAX, seconds: HashMap::new() };
    detached(py, || {
        sampler.with_store(Store::clear);
        const CHUNK: u64 = 1_000; // ticks per hold of the store's lock
        for first in (0..ticks).step_by(CHUNK as usize) {
            sampler.with_store(|store| {
                for tick in first..(first + CHUNK).min(ticks) {
                    replay.tick(store, (start * 1e9 + tick as f64 * interval_ns) as u64, (1e6 / rate) as u32);
                }
            });
        }
        replay.seconds
    })
}

struct Replay<'a> {
    data: &'a ProfileData,
    next: usize,
    /// The store's id of each of the profile's frames, while its generation holds.
    frames: Vec<Option<u32>>,
    generation: u64,
    seconds: HashMap<String, f64>,
}

impl Replay<'_> {
    /// One sample per thread of the profile at `time_ns`, its next ones in turn.
    fn tick(&mut self, store: &mut Store, time_ns: u64, weight_us: u32) {
        if store.generation() != self.generation {
            self.frames = vec![None; self.data.frames.len()];
            self.generation = store.generation();
        }
        let minute = time_ns / 60_000_000_000;
        for _ in 0..self.data.threads.len() {
            let s = &self.data.samples[self.next % self.data.samples.len()];
            self.next += 1;
            let ids: Vec<u32> = self.data.stacks[s.stack as usize]
                .iter()
                .map(|&f| {
                    *self.frames[f as usize].get_or_insert_with(|| store.frame_id(self.data.frames[f as usize].clone()))
                })
                .collect();
            let tag = s
                .tag
                .map(|t| &self.data.tags[t as usize])
                .map(|t| Tag { key: format!("{}-{minute}", t.key), ..t.clone() });
            *self.seconds.entry(tag.as_ref().map_or(String::new(), |t| t.prefix.clone())).or_default() +=
                f64::from(weight_us) / 1e6;
            store.record_ids(Recorded {
                time_ns,
                ident: self.data.threads[s.thread as usize].ident,
                name: None,
                frames: &ids,
                tag: tag.as_ref(),
                activity: s.activity.map(|a| self.data.activities[a as usize].as_str()),
                weight_us,
                cpu_us: (u64::from(weight_us) * u64::from(s.cpu_us.min(s.weight_us)) / u64::from(s.weight_us.max(1)))
                    as u32,
                flags: s.flags,
            });
        }
    }
}

/// Native code for the native-frames tests: `rounds` times, spins for `spin_s`
/// seconds, then calls `callback`, so a thread's stack reads Python -> this -> Python.
#[pyfunction]
fn native_caller(rounds: u32, spin_s: f64, callback: Bound<'_, PyAny>) -> PyResult<()> {
    native_caller_frame(rounds, spin_s, &mut || callback.call0().map(drop))
}

#[inline(never)]
fn native_caller_frame(rounds: u32, spin_s: f64, call: &mut dyn FnMut() -> PyResult<()>) -> PyResult<()> {
    for _ in 0..rounds {
        native_spin(spin_s);
        call()?;
    }
    Ok(())
}

#[inline(never)]
fn native_spin(seconds: f64) {
    let end = std::time::Instant::now() + std::time::Duration::from_secs_f64(seconds);
    while std::time::Instant::now() < end {
        std::hint::spin_loop();
    }
}

pub fn module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    let m = PyModule::new(py, "_testing")?;
    m.add_function(wrap_pyfunction!(panic_in_call, &m)?)?;
    m.add_function(wrap_pyfunction!(inject_panic, &m)?)?;
    m.add_function(wrap_pyfunction!(hold_store, &m)?)?;
    m.add_function(wrap_pyfunction!(digest, &m)?)?;
    m.add_function(wrap_pyfunction!(as_process, &m)?)?;
    m.add_function(wrap_pyfunction!(only_states, &m)?)?;
    m.add_function(wrap_pyfunction!(replay, &m)?)?;
    m.add_function(wrap_pyfunction!(native_caller, &m)?)?;
    Ok(m)
}
