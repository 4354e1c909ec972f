//! The sampling thread: reads this process's Python stacks with py-spy at a steady
//! rate, tags each sample with the task its thread runs, and stretches its interval
//! so its own CPU use stays within budget.
//!
//! It never touches the GIL: py-spy reads interpreter memory directly.

use crate::config::SamplerConfig;
use crate::model::{Frame, Process, ProfileData, FLAG_ACTIVE, FLAG_GIL};
use crate::store::Store;
use crate::tags::{ThreadTag, ThreadTags};
use nix::time::{clock_gettime, ClockId};
use parking_lot::{Condvar, Mutex};
use py_spy::{PythonSpy, StackTrace};
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Smoothing of the per-tick cost estimate that drives the budget.
const COST_SMOOTHING: f64 = 0.2;

#[derive(Clone, Debug, Default, Serialize)]
pub struct RunStats {
    pub running: bool,
    pub started_ns: Option<u64>,
    pub ticks: u64,
    pub failed_ticks: u64,
    pub throttled_ticks: u64,
    /// Samples whose thread started or ended a task while its stack was read: left untagged.
    pub boundary_samples: u64,
    pub cpu_ns: u64,
    pub wall_ns: u64,
    pub interval_s: f64,
    pub last_error: Option<String>,
    pub panic: Option<String>,
}

/// The last tick's raw stacks, kept for live dumps.
struct LastTick {
    time_ns: u64,
    traces: Vec<StackTrace>,
    tags: HashMap<u64, ThreadTag>,
}

struct Shared {
    config: SamplerConfig,
    tags: ThreadTags,
    store: Mutex<Store>,
    stats: Mutex<RunStats>,
    last: Mutex<Option<LastTick>>,
    stop: Mutex<bool>,
    wake: Condvar,
    inject_panic: AtomicBool,
}

pub struct Sampler {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    token: String,
}

pub fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

fn thread_cpu_ns() -> u64 {
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map_or(0, |t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
}

fn new_token() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!("{}-{}-{}", std::process::id(), now_ns(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Sampler, String> {
        config.validate()?;
        let store = Store::new(config.max_memory);
        let shared = Shared {
            config,
            tags: ThreadTags::default(),
            store: Mutex::new(store),
            stats: Mutex::new(RunStats::default()),
            last: Mutex::new(None),
            stop: Mutex::new(false),
            wake: Condvar::new(),
            inject_panic: AtomicBool::new(false),
        };
        Ok(Sampler { shared: Arc::new(shared), thread: Mutex::new(None), token: new_token() })
    }

    pub fn tags(&self) -> &ThreadTags {
        &self.shared.tags
    }

    /// Starts the sampling thread; returns once py-spy has attached (or failed to).
    pub fn start(&self) -> Result<(), String> {
        let mut handle = self.thread.lock();
        if self.is_running() {
            return Err("the sampler is already running: call stop() before start()".into());
        }
        if let Some(old) = handle.take() {
            let _ = old.join();
        }
        *self.shared.stop.lock() = false;
        *self.shared.stats.lock() = RunStats { started_ns: Some(now_ns()), ..RunStats::default() };
        let (ready_tx, ready_rx) = mpsc::channel();
        let shared = self.shared.clone();
        let thread = std::thread::Builder::new()
            .name("dask-pyspy-sampler".into())
            .spawn(move || run(shared, ready_tx))
            .map_err(|e| format!("could not start the sampling thread: {e}"))?;
        let ready = ready_rx.recv();
        *handle = Some(thread);
        match ready {
            Ok(result) => result,
            Err(_) => Err(self.shared.stats.lock().panic.clone().unwrap_or_else(|| "the sampling thread died".into())),
        }
    }

    pub fn stop(&self) {
        *self.shared.stop.lock() = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }

    pub fn is_running(&self) -> bool {
        self.shared.stats.lock().running
    }

    pub fn has_started(&self) -> bool {
        self.shared.stats.lock().started_ns.is_some()
    }

    /// Test switch: the next tick panics, to prove a panic is contained and reported.
    pub fn inject_panic(&self) {
        self.shared.inject_panic.store(true, Ordering::SeqCst);
    }

    pub fn stats(&self) -> Value {
        let run = self.shared.stats.lock().clone();
        let store = self.shared.store.lock().stats();
        let wall = run.wall_ns as f64 / 1e9;
        let per_sec = |n: u64| if wall > 0.0 { n as f64 / wall } else { 0.0 };
        json!({
            "token": self.token,
            "pid": std::process::id(),
            "running": run.running,
            "started": run.started_ns.map(|t| t as f64 / 1e9),
            "duration_s": wall,
            "ticks": run.ticks,
            "failed_ticks": run.failed_ticks,
            "throttled_ticks": run.throttled_ticks,
            "boundary_samples": run.boundary_samples,
            "requested_rate": self.shared.config.rate,
            "achieved_rate": per_sec(run.ticks),
            "interval_s": run.interval_s,
            "cpu_s": run.cpu_ns as f64 / 1e9,
            "cpu_fraction": per_sec(run.cpu_ns) / 1e9,
            "last_error": run.last_error,
            "panic": run.panic,
            "store": store,
            "config": self.shared.config,
        })
    }

    /// The samples of `[start_ns, stop_ns]` as a profile of this process.
    pub fn profile(&self, start_ns: u64, stop_ns: u64, process_name: String, host: String) -> ProfileData {
        let process = Process {
            name: process_name,
            pid: std::process::id(),
            host,
            token: self.token.clone(),
            stats: self.stats(),
        };
        let mut data = self.shared.store.lock().window(start_ns, stop_ns, process, Map::new());
        data.resolve_thread_names(|ident| self.shared.tags.name(ident));
        data
    }

    /// Every thread's stack at the last tick (leaf first), with its task and state.
    pub fn dump(&self) -> Value {
        let last = self.shared.last.lock();
        let Some(last) = last.as_ref() else { return json!({"time": null, "threads": []}) };
        let threads: Vec<Value> = last
            .traces
            .iter()
            .map(|t| {
                let tag = last.tags.get(&t.thread_id).and_then(|e| e.tag.clone());
                json!({
                    "ident": t.thread_id,
                    "name": self.shared.tags.name(t.thread_id).or_else(|| t.thread_name.clone()),
                    "active": t.active,
                    "owns_gil": t.owns_gil,
                    "task": tag.as_ref().map(|t| &t.key),
                    "frames": t.frames.iter().map(|f| json!({"name": f.name, "file": f.filename, "line": f.line})).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({"time": last.time_ns as f64 / 1e9, "threads": threads})
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(shared: Arc<Shared>, ready: mpsc::Sender<Result<(), String>>) {
    shared.stats.lock().running = true;
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let pid = std::process::id() as py_spy::Pid;
        match PythonSpy::retry_new(pid, &shared.config.pyspy(), 3) {
            Ok(spy) => {
                let _ = ready.send(Ok(()));
                Loop::new(&shared, spy).run();
            }
            Err(e) => {
                let _ = ready.send(Err(format!("py-spy cannot read this Python process: {e:#}")));
            }
        }
    }));
    let mut stats = shared.stats.lock();
    if let Err(panic) = outcome {
        stats.panic = Some(format!("the sampling thread panicked and stopped: {}", panic_message(&*panic)));
    }
    stats.running = false;
}

struct Loop<'a> {
    shared: &'a Shared,
    spy: PythonSpy,
    base: Duration,
    interval: Duration,
    cost_s: Option<f64>,
    /// OS thread id last seen behind each Python thread ident, to notice ident reuse.
    os_tids: HashMap<u64, Option<u64>>,
}

impl<'a> Loop<'a> {
    fn new(shared: &'a Shared, spy: PythonSpy) -> Self {
        let base = Duration::from_secs_f64(shared.config.interval_secs());
        Loop { shared, spy, base, interval: base, cost_s: None, os_tids: HashMap::new() }
    }

    fn run(&mut self) {
        let started = Instant::now();
        // The first tick comes one interval in, so ticks / elapsed is the rate.
        let mut next = started + self.base;
        let mut last_tick: Option<Instant> = None;
        while !self.wait_until(next) {
            let now = Instant::now();
            // A sample stands for the wall time since the previous one, so a
            // stretched interval does not bias the profile.
            let weight = last_tick.map_or(self.base, |t| (now - t).min(self.interval * 2));
            last_tick = Some(now);
            let cpu0 = thread_cpu_ns();
            self.tick(weight);
            let cost = thread_cpu_ns().saturating_sub(cpu0);
            self.adapt(cost);
            let mut stats = self.shared.stats.lock();
            stats.cpu_ns += cost;
            stats.wall_ns = started.elapsed().as_nanos() as u64;
            stats.interval_s = self.interval.as_secs_f64();
            stats.throttled_ticks += (self.interval > self.base) as u64;
            drop(stats);
            next += self.interval;
            // After a stall, resume the rhythm instead of firing a burst of ticks.
            let now = Instant::now();
            if next + self.interval < now {
                next = now;
            }
        }
        self.shared.stats.lock().wall_ns = started.elapsed().as_nanos() as u64;
    }

    /// Sleeps until `deadline`; true when asked to stop.
    fn wait_until(&self, deadline: Instant) -> bool {
        let mut stop = self.shared.stop.lock();
        while !*stop {
            if self.shared.wake.wait_until(&mut stop, deadline).timed_out() {
                return false;
            }
        }
        true
    }

    /// Stretches the interval so that (cost per tick / interval) stays within the budget.
    fn adapt(&mut self, cost_ns: u64) {
        let cost = cost_ns as f64 / 1e9;
        let smoothed = self.cost_s.map_or(cost, |c| c + COST_SMOOTHING * (cost - c));
        self.cost_s = Some(smoothed);
        let needed = Duration::from_secs_f64(smoothed / self.shared.config.cpu_budget);
        self.interval = needed.max(self.base);
    }

    fn tick(&mut self, weight: Duration) {
        if self.shared.inject_panic.swap(false, Ordering::SeqCst) {
            panic!("injected by the test switch");
        }
        let before = self.shared.tags.snapshot();
        let time_ns = now_ns();
        match self.spy.get_stack_traces() {
            Ok(mut traces) => {
                self.forget_reused_names(&mut traces);
                self.record(&traces, &before, time_ns, weight);
                *self.shared.last.lock() = Some(LastTick { time_ns, traces, tags: before });
            }
            Err(e) => {
                // Torn reads of a live process happen; one bad tick is skipped, not fatal.
                let mut stats = self.shared.stats.lock();
                stats.failed_ticks += 1;
                stats.last_error = Some(format!("{e:#}"));
            }
        }
        self.shared.stats.lock().ticks += 1;
    }

    /// A new thread can get a dead one's ident; py-spy would keep the old name for it.
    fn forget_reused_names(&mut self, traces: &mut [StackTrace]) {
        if self.os_tids.len() > 4 * traces.len() + 64 {
            let live: std::collections::HashSet<u64> = traces.iter().map(|t| t.thread_id).collect();
            self.os_tids.retain(|ident, _| live.contains(ident));
        }
        for t in traces {
            let previous = self.os_tids.insert(t.thread_id, t.os_thread_id);
            if previous.is_some_and(|p| p != t.os_thread_id) {
                self.spy.python_thread_names.remove(&t.thread_id);
                t.thread_name = None;
            }
        }
    }

    fn record(&self, traces: &[StackTrace], before: &HashMap<u64, ThreadTag>, time_ns: u64, weight: Duration) {
        let weight_us = weight.as_micros().min(u32::MAX as u128) as u32;
        let mut boundary = 0;
        let mut store = self.shared.store.lock();
        for t in traces {
            // py-spy's `active` means on a CPU; a thread holding the GIL is working too.
            let active = t.active || t.owns_gil;
            if (!active && !self.shared.config.idle) || t.frames.is_empty() {
                continue;
            }
            let tag = self.shared.tags.stable_tag(before, t.thread_id).unwrap_or_else(|()| {
                boundary += 1;
                None
            });
            let flags = if active { FLAG_ACTIVE } else { 0 } | if t.owns_gil { FLAG_GIL } else { 0 };
            let frames = t.frames.iter().rev().map(|f| Frame { name: f.name.clone(), file: f.filename.clone(), line: f.line });
            store.record(time_ns, t.thread_id, t.thread_name.clone(), frames, tag.as_deref(), weight_us, flags);
        }
        drop(store);
        self.shared.stats.lock().boundary_samples += boundary;
    }
}
