//! The sampler a Python `Sampler` holds: starts and stops the sampling thread
//! (`thread.rs`), changes its options, and reads its samples, stats and stacks.

use crate::error::{Error, Result};
use crate::heap::live::{self, Counted, PrefixTotals};
use crate::profile::model::{Frame, Metadata, Process, ProfileData};
use crate::profile::stalls::{Explained, Stall};
use crate::reader::tags::{Activity, ThreadTags};
use crate::reader::Chosen;
use crate::sampling::calls::NS_PER_S;
use crate::sampling::config::SamplerConfig;
use crate::sampling::loops::LoopWatch;
use crate::sampling::series::Series;
use crate::sampling::store::Store;
use crate::sampling::thread::{now_ns, run, RunStats, Shared};
use crate::sampling::watching::KEEP_NS;
use crate::sampling::window::{Window, WindowSize};
use crate::sync::{Condvar, Mutex};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const ALREADY_RUNNING: &str = "the sampler is already running: call stop() before start()";
pub const CONFIGURE_RUNNING: &str = "the sampler is running: call stop() before configure()";
const FORKED: &str = "this sampler was copied into a forked child, where its thread does not exist: make a new one";
/// How long a live dump waits for the sampling thread to read every thread.
const DUMP_WAIT: Duration = Duration::from_secs(2);
/// Stalls a window explains at most per process, the longest.
pub const EXPLAINED: usize = 100;
/// Allocation sites a window's export keeps apart (the report's graph of bytes in use):
/// the graph draws no site under 0.5% of it, and a site of a deep stack is ~5 KB.
const EXPORTED_SITES: usize = 64;
/// The series' name for the prefixes holding least, summed (`live::OTHER`).
const OTHER_PREFIXES: &str = "(other prefixes)";
/// Stalls whose start and duration a window carries at most per process, the longest:
/// a timeline draws about as many marks, and a day of a stall a second stays small.
const RECORDS: usize = 2_000;

pub struct Sampler {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    token: String,
    /// The process that made it: in a child forked from that one its sampling thread
    /// is gone and its locks may stay held forever (see `forked`).
    pid: u32,
}

/// As Python's `socket.gethostname()` gives it.
pub fn hostname() -> String {
    nix::unistd::gethostname().map_or_else(|_| String::new(), |h| h.to_string_lossy().into_owned())
}

fn new_token() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!("{}-{}-{}", std::process::id(), now_ns(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Sampler> {
        config.validate()?;
        let mut store = Store::new(config.max_memory);
        store.set_retention(config.retention());
        let shared = Shared {
            config: Mutex::new(config),
            tags: Arc::default(),
            store: Mutex::new(store),
            calls: Mutex::default(),
            series: Mutex::new(Series::default()),
            loops: Mutex::default(),
            stalls: Mutex::default(),
            stats: Mutex::new(RunStats::default()),
            last: Mutex::new(None),
            dumped: Condvar::new(),
            want_all: AtomicBool::new(false),
            stop: Mutex::new(false),
            wake: Condvar::new(),
            inject_panic: AtomicBool::new(false),
        };
        Ok(Sampler { shared: Arc::new(shared), thread: Mutex::new(None), token: new_token(), pid: std::process::id() })
    }

    /// True in a child forked from the process that made this sampler: a copy that must
    /// not be used, since a lock the vanished sampling thread held is never released.
    fn forked(&self) -> bool {
        self.pid != std::process::id()
    }

    pub fn tags(&self) -> &Arc<ThreadTags> {
        &self.shared.tags
    }

    pub fn config(&self) -> SamplerConfig {
        self.shared.config.lock().clone()
    }

    /// New options for a stopped sampler. The samples taken so far stay, evicted down
    /// to the new `max_memory`, so changing options never loses history.
    pub fn configure(&self, config: SamplerConfig) -> Result<()> {
        config.validate()?;
        if self.forked() {
            return Err(Error::Broken(FORKED.into()));
        }
        let _no_start = self.thread.lock();
        if self.is_running() {
            return Err(Error::Broken(CONFIGURE_RUNNING.into()));
        }
        let mut store = self.shared.store.lock();
        store.set_max_bytes(config.max_memory);
        store.set_retention(config.retention());
        drop(store);
        *self.shared.config.lock() = config;
        Ok(())
    }

    /// Starts the sampling thread with `reader`; returns once it reads (or failed to).
    pub fn start(&self, reader: Chosen) -> Result<()> {
        if self.forked() {
            return Err(Error::Broken(FORKED.into()));
        }
        let mut handle = self.thread.lock();
        if self.is_running() {
            return Err(Error::Broken(ALREADY_RUNNING.into()));
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
            .spawn(move || run(shared, reader, ready_tx))
            .map_err(|e| Error::Broken(format!("could not start the sampling thread: {e}")))?;
        let ready = ready_rx.recv();
        *handle = Some(thread);
        match ready {
            Ok(result) => result.map_err(Error::Broken),
            Err(_) => Err(Error::Broken(
                self.shared.stats.lock().panic.clone().unwrap_or_else(|| "the sampling thread died".into()),
            )),
        }
    }

    pub fn stop(&self) {
        if self.forked() {
            return;
        }
        *self.shared.stop.lock() = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }

    pub fn is_running(&self) -> bool {
        !self.forked() && self.shared.stats.lock().running
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
        let config = self.config();
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
            "repeated_ticks": run.repeated_ticks,
            "boundary_samples": run.boundary_samples,
            "deferred_samples": run.deferred_samples,
            "requested_rate": config.rate,
            "achieved_rate": per_sec(run.ticks),
            "interval_s": run.interval_s,
            "tick_lateness_s": run.lateness,
            "slice_us": run.slice_ns.map(|ns| ns / 1000),
            "cpu_s": run.cpu_ns as f64 / 1e9,
            "cpu_fraction": per_sec(run.cpu_ns) / 1e9,
            "last_error": run.last_error,
            "panic": run.panic,
            "reader": run.reader,
            "reader_stats": run.reader_stats,
            "states": run.states,
            "native": run.native,
            "phases_us": run.phases,
            "cores": std::thread::available_parallelism().map_or(0, usize::from),
            "store": store,
            "config": config,
        })
    }

    /// Counts one dispatched call of `activity`: a short lock of its own, never the store's.
    pub fn count_call(&self, activity: &Arc<Activity>) {
        self.shared.calls.lock().count(now_ns() / NS_PER_S, activity);
    }

    /// `f` on the store, as the sampling thread fills it (tests and benchmarks replay
    /// recorded samples through it).
    pub fn with_store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        f(&mut self.shared.store.lock())
    }

    /// The samples of `window` as a profile of this process.
    pub fn profile(&self, window: Window<'_>, process_name: String, metadata: Metadata) -> ProfileData {
        let mut process = Process {
            name: process_name,
            pid: std::process::id(),
            host: hostname(),
            token: self.token.clone(),
            stats: self.stats(),
        };
        let series = self.shared.series.lock();
        process.stats["window_cpu"] = json!(series.totals(window.start_ns, window.stop_ns));
        if let Some(resources) = series.window(window.start_ns, window.stop_ns, prefix_name) {
            process.stats["series"] = resources;
        }
        drop(series);
        let within = Some((window.start_ns, window.stop_ns));
        if let Some(memory) = self.memory(within, EXPORTED_SITES).map(|m| json!(m)) {
            process.stats["memory"] = memory;
        }
        let stalls = self.shared.stalls.lock().window(window.start_ns, window.stop_ns);
        let window = Window { stalls: &stalls, ..window };
        let mut store = self.shared.store.lock();
        self.shared.fold_calls(&mut store);
        let explained = store.explain_stalls(&stalls, EXPLAINED);
        let mut data = store.window(window, process, metadata);
        drop(store);
        data.processes[0].stats["stalls"] = self.stalls_stats(&stalls, explained);
        data.resolve_thread_names(|ident| self.shared.tags.name(ident));
        data
    }

    /// Watches the calling thread's event loop for stalls of at least `threshold_ns`.
    pub fn watch_loop(&self, ident: u64, threshold_ns: u64) -> Arc<LoopWatch> {
        let watch = Arc::new(LoopWatch::new(ident, threshold_ns));
        self.shared.loops.lock().push(watch.clone());
        self.shared.stalls.lock().threshold_ns = Some(threshold_ns);
        watch
    }

    pub fn unwatch_loop(&self, watch: &Arc<LoopWatch>) {
        self.shared.loops.lock().retain(|w| !Arc::ptr_eq(w, watch));
        // Off the list, no tick drains its ring again: the stalls it still holds are kept
        // here (without the system call a tick would have seen).
        let mut stalls = self.shared.stalls.lock();
        let ident = watch.ident;
        watch.drain(|start_ns, end_ns| stalls.add(Stall { start_ns, end_ns, ident, call: None }, KEEP_NS));
        stalls.lost += watch.lost.load(Ordering::Relaxed);
    }

    /// The stalls in `[start_ns, stop_ns]` of at least `min_ns`, the `most` longest
    /// explained, as a window's `stats["stalls"]` gives them.
    pub fn stalls(&self, start_ns: u64, stop_ns: u64, min_ns: u64, most: usize) -> Value {
        let mut stalls = self.shared.stalls.lock().window(start_ns, stop_ns);
        stalls.retain(|s| s.duration_ns() >= min_ns);
        let explained = self.shared.store.lock().explain_stalls(&stalls, most);
        self.stalls_stats(&stalls, explained)
    }

    /// A window's stalls: how many and how long in all, when the longest began and
    /// how long each lasted, the longest of them explained.
    fn stalls_stats(&self, stalls: &[Stall], explained: Vec<Explained>) -> Value {
        let watched: u64 = self.shared.loops.lock().iter().map(|w| w.lost.load(Ordering::Relaxed)).sum();
        let kept = self.shared.stalls.lock();
        let threshold = kept.threshold_ns.map(|t| t as f64 / 1e9);
        let (dropped, dropped_s, lost) = (kept.dropped, kept.dropped_ns as f64 / 1e9, kept.lost + watched);
        drop(kept);
        let stats = self.shared.stats.lock();
        let holders = match (stats.reader, stats.reader_stats.get("gil_enabled")) {
            (Some("fast"), Some(Value::Bool(true))) => "known",
            (Some("fast"), _) => "no GIL: free-threaded",
            _ => "unknown on py-spy's reader",
        };
        drop(stats);
        let seconds = |ns: u64| ns as f64 / 1e9;
        let mut longest: Vec<&Stall> = stalls.iter().collect();
        longest.sort_by_key(|s| std::cmp::Reverse(s.duration_ns()));
        longest.truncate(RECORDS);
        longest.sort_by_key(|s| s.start_ns);
        let records: Vec<[f64; 2]> = longest.iter().map(|s| [seconds(s.start_ns), seconds(s.duration_ns())]).collect();
        json!({
            "count": stalls.len(),
            "stalled_s": seconds(stalls.iter().map(Stall::duration_ns).sum()),
            "watched": threshold.is_some(),
            "threshold": threshold,
            "holders": holders,
            "records": records,
            "explained": explained,
            "dropped": dropped,
            "dropped_s": dropped_s,
            "lost": lost,
        })
    }

    pub fn window_size(&self, window: Window<'_>) -> WindowSize {
        let mut size = self.shared.store.lock().window_size(window);
        // Its allocation sites' stacks can outweigh a short window's samples.
        let memory = self.memory(Some((window.start_ns, window.stop_ns)), EXPORTED_SITES);
        size.bytes += memory.map_or(0, |m| json!(m).to_string().len() as u64);
        size
    }

    /// What memory tracking counted (None where it never ran), its prefixes narrowed to
    /// `window` (ns; to the second) where given, with at most `most_sites` sites (always
    /// since tracking started).
    pub fn memory(&self, window: Option<(u64, u64)>, most_sites: usize) -> Option<Counted> {
        let mut counted = live::counted(most_sites);
        if !counted.tracking && counted.prefixes.is_empty() {
            return None;
        }
        if let (Some((start_ns, stop_ns)), Some((start, now))) = (window, live::now()) {
            let rows = self.shared.series.lock().memory_window(start_ns, stop_ns, start, &now);
            let rows = rows.into_iter().map(|(id, totals)| PrefixTotals { prefix: live::prefix_name(id), totals });
            counted.prefixes = rows.collect();
            counted.window = Some((start_ns as f64 / 1e9, stop_ns.min(now_ns()) as f64 / 1e9));
        }
        Some(counted)
    }

    /// Every thread's stack (leaf first), with its task and state: asks the sampling
    /// thread for a tick that reads them all, and waits for it a little.
    pub fn dump(&self) -> Value {
        let asked = now_ns();
        let mut last = self.shared.last.lock();
        if self.is_running() {
            self.shared.want_all.store(true, Ordering::SeqCst);
            self.shared.wake.notify_all();
            let deadline = Instant::now() + DUMP_WAIT;
            while last.as_ref().is_none_or(|l| l.time_ns < asked) && self.is_running() {
                if self.shared.dumped.wait_until(&mut last, deadline).timed_out() {
                    break;
                }
            }
        }
        let Some(last) = last.as_ref() else { return json!({"time": null, "reader": null, "threads": []}) };
        let threads: Vec<Value> = last
            .threads
            .iter()
            .map(|t| {
                let s = &t.stack;
                json!({
                    "ident": s.ident,
                    "name": self.shared.tags.name(s.ident).or_else(|| s.name.clone()),
                    "active": s.active,
                    "owns_gil": s.holds_gil,
                    "state": t.state.name(),
                    "task": s.marks.as_ref().ok().and_then(|m| m.task.as_ref()).map(|t| &t.key),
                    "frames": t.frames.iter().map(frame_json).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({"time": last.time_ns as f64 / 1e9, "reader": self.shared.stats.lock().reader, "threads": threads})
    }
}

/// One frame of a live dump.
fn frame_json(f: &Frame) -> Value {
    json!({"name": f.name, "file": f.file, "line": f.line, "native": f.native})
}

impl Drop for Sampler {
    fn drop(&mut self) {
        if self.forked() {
            // Nothing to stop, join or free: the thread does not exist here, and the
            // state it shared may be mid-change. Leak both rather than touch them.
            std::mem::forget(self.thread.get_mut().take());
            std::mem::forget(self.shared.clone());
            return;
        }
        self.stop();
    }
}

/// How the series names a task prefix id of `live::in_use`.
fn prefix_name(id: u32) -> Value {
    match id {
        live::OTHER => json!(OTHER_PREFIXES),
        _ => json!(live::prefix_name(id)),
    }
}
