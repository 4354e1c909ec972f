//! The sampling thread: reads this process's Python stacks at random times, one in
//! each slot of `1 / rate`, tags each sample with the task its thread runs, and
//! stretches the slots so its own CPU use stays within budget.
//!
//! Where a tick falls in its slot is drawn uniformly: work that repeats at (or near)
//! the sampling period cannot lock onto fixed sample times and always be seen in
//! the same phase, while the rate stays exact and each sample stands for one slot's
//! wall time (a stratified sample: less noise than independent random times).
//!
//! It never touches the GIL: the readers read interpreter memory directly.

use crate::sampling::config::SamplerConfig;
use crate::profile::model::{Frame, Process, ProfileData, State};
use crate::reader::{Chosen, PySpyReader, StackReader, ThreadStack, Want};
use crate::sampling::states::{CpuSeries, StateStats, States};
use crate::sampling::store::{Recorded, Store, Window, WindowSize};
use crate::sync::{Condvar, Mutex};
use crate::reader::tags::ThreadTags;
use nix::time::{clock_gettime, ClockId};
use rustc_hash::FxHashMap;
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Wall time for which unspent CPU budget is kept: long enough that an occasional
/// costly tick does not cost rate, short enough that a burst stays small.
const CREDIT_S: f64 = 1.0;
/// Ticks between refreshes of the reader's counters in the stats.
const READER_STATS_EVERY: u64 = 10;
pub const ALREADY_RUNNING: &str = "the sampler is already running: call stop() before start()";
pub const CONFIGURE_RUNNING: &str = "the sampler is running: call stop() before configure()";
const FORKED: &str = "this sampler was copied into a forked child, where its thread does not exist: make a new one";
/// How long a live dump waits for the sampling thread to read every thread.
const DUMP_WAIT: Duration = Duration::from_secs(2);

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
    pub reader: Option<&'static str>,
    pub reader_stats: Value,
    pub states: StateStats,
}

/// One thread of a live dump.
struct DumpThread {
    stack: ThreadStack,
    state: State,
    frames: Vec<Frame>,
}

/// Every thread's stack at the last tick that read them all, for live dumps.
struct LastTick {
    time_ns: u64,
    threads: Vec<DumpThread>,
}

struct Shared {
    /// Changes only while stopped (`configure`); a run reads its own copy.
    config: Mutex<SamplerConfig>,
    tags: ThreadTags,
    store: Mutex<Store>,
    /// CPU per second of the whole process and of its threads Python does not know.
    cpu: Mutex<CpuSeries>,
    stats: Mutex<RunStats>,
    last: Mutex<Option<LastTick>>,
    dumped: Condvar,
    /// A dump asks the next tick to read every thread, idle ones too.
    want_all: AtomicBool,
    stop: Mutex<bool>,
    wake: Condvar,
    inject_panic: AtomicBool,
}

pub struct Sampler {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    token: String,
    /// The process that made it: in a child forked from that one its sampling thread
    /// is gone and its locks may stay held forever (see `forked`).
    pid: u32,
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

pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
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
            config: Mutex::new(config),
            tags: ThreadTags::default(),
            store: Mutex::new(store),
            cpu: Mutex::new(CpuSeries::default()),
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

    pub fn tags(&self) -> &ThreadTags {
        &self.shared.tags
    }

    pub fn config(&self) -> SamplerConfig {
        self.shared.config.lock().clone()
    }

    /// New options for a stopped sampler. The samples taken so far stay, evicted down
    /// to the new `max_memory`, so changing options never loses history.
    pub fn configure(&self, config: SamplerConfig) -> Result<(), String> {
        config.validate()?;
        if self.forked() {
            return Err(FORKED.into());
        }
        let _no_start = self.thread.lock();
        if self.is_running() {
            return Err(CONFIGURE_RUNNING.into());
        }
        self.shared.store.lock().set_max_bytes(config.max_memory);
        *self.shared.config.lock() = config;
        Ok(())
    }

    /// Starts the sampling thread with `reader`; returns once it reads (or failed to).
    pub fn start(&self, reader: Chosen) -> Result<(), String> {
        if self.forked() {
            return Err(FORKED.into());
        }
        let mut handle = self.thread.lock();
        if self.is_running() {
            return Err(ALREADY_RUNNING.into());
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
            .map_err(|e| format!("could not start the sampling thread: {e}"))?;
        let ready = ready_rx.recv();
        *handle = Some(thread);
        match ready {
            Ok(result) => result,
            Err(_) => Err(self.shared.stats.lock().panic.clone().unwrap_or_else(|| "the sampling thread died".into())),
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
            "boundary_samples": run.boundary_samples,
            "requested_rate": config.rate,
            "achieved_rate": per_sec(run.ticks),
            "interval_s": run.interval_s,
            "cpu_s": run.cpu_ns as f64 / 1e9,
            "cpu_fraction": per_sec(run.cpu_ns) / 1e9,
            "last_error": run.last_error,
            "panic": run.panic,
            "reader": run.reader,
            "reader_stats": run.reader_stats,
            "states": run.states,
            "cores": std::thread::available_parallelism().map_or(0, usize::from),
            "store": store,
            "config": config,
        })
    }

    /// The samples of `window` as a profile of this process.
    pub fn profile(&self, window: Window, process_name: String, host: String, metadata: Map<String, Value>) -> ProfileData {
        let mut process = Process {
            name: process_name,
            pid: std::process::id(),
            host,
            token: self.token.clone(),
            stats: self.stats(),
        };
        let cpu = self.shared.cpu.lock().totals(window.start_ns, window.stop_ns);
        process.stats["window_cpu"] = json!(cpu);
        let mut data = self.shared.store.lock().window(window, process, metadata);
        data.resolve_thread_names(|ident| self.shared.tags.name(ident));
        data
    }

    pub fn window_size(&self, window: Window) -> WindowSize {
        self.shared.store.lock().window_size(window)
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
                    "task": s.tag.as_ref().ok().and_then(|t| t.as_ref()).map(|t| &t.key),
                    "frames": t.frames.iter().map(|f| json!({"name": f.name, "file": f.file, "line": f.line})).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({"time": last.time_ns as f64 / 1e9, "reader": self.shared.stats.lock().reader, "threads": threads})
    }
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

fn run(shared: Arc<Shared>, chosen: Chosen, ready: mpsc::Sender<Result<(), String>>) {
    shared.stats.lock().running = true;
    let config = shared.config.lock().clone();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let reader: Box<dyn StackReader> = match chosen {
            Chosen::Fast(fast) => fast,
            Chosen::PySpy { reason } => match PySpyReader::new(config.lines, config.function, reason) {
                Ok(spy) => Box::new(spy),
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            },
        };
        let mut stats = shared.stats.lock();
        stats.reader = Some(reader.name());
        stats.reader_stats = reader.stats();
        drop(stats);
        let _ = ready.send(Ok(()));
        Loop::new(&shared, config, reader).run();
    }));
    let mut stats = shared.stats.lock();
    if let Err(panic) = outcome {
        stats.panic = Some(format!("the sampling thread panicked and stopped: {}", panic_message(&*panic)));
    }
    stats.running = false;
    drop(stats);
    shared.dumped.notify_all();
}

struct Loop<'a> {
    shared: &'a Shared,
    config: SamplerConfig,
    reader: Box<dyn StackReader>,
    base: Duration,
    interval: Duration,
    /// CPU seconds the budget allows that ticks have not spent (negative: overdrawn).
    credit_s: f64,
    stacks: Vec<ThreadStack>,
    /// The state of each of `stacks`.
    states: Vec<State>,
    kernel: States,
    rng: fastrand::Rng,
    /// Reader frame id -> store frame id, valid for `ids_valid_for` (reader epoch, store generation).
    store_ids: FxHashMap<u64, u32>,
    ids_valid_for: (u64, u64),
}

impl<'a> Loop<'a> {
    fn new(shared: &'a Shared, config: SamplerConfig, reader: Box<dyn StackReader>) -> Self {
        let base = Duration::from_secs_f64(config.interval_secs());
        Loop {
            shared,
            config,
            reader,
            base,
            interval: base,
            credit_s: 0.0,
            stacks: Vec::new(),
            states: Vec::new(),
            kernel: States::new(),
            rng: fastrand::Rng::new(),
            store_ids: FxHashMap::default(),
            ids_valid_for: (0, 0),
        }
    }

    fn run(&mut self) {
        let started = Instant::now();
        // Time is cut into slots of one interval, so ticks / elapsed is the rate.
        let mut slot = started;
        loop {
            let length = self.interval;
            let at = slot + length.mul_f64(self.rng.f64());
            if self.wait_until(at) {
                break;
            }
            let now = Instant::now();
            // A sample stands for its slot; a tick that a stall pushed past its slot
            // also for the time it came late, up to one more slot.
            let weight = (now - slot).clamp(length, 2 * length);
            let cpu0 = thread_cpu_ns();
            self.tick(weight);
            let cost = thread_cpu_ns().saturating_sub(cpu0);
            self.adapt(cost, weight);
            let mut stats = self.shared.stats.lock();
            stats.cpu_ns += cost;
            stats.wall_ns = started.elapsed().as_nanos() as u64;
            stats.interval_s = self.interval.as_secs_f64();
            stats.throttled_ticks += (self.interval > self.base) as u64;
            if stats.ticks % READER_STATS_EVERY == 1 {
                stats.reader_stats = self.reader.stats();
                stats.states = self.kernel.stats;
            }
            drop(stats);
            // A late tick's weight reached `now`: the next slot starts there, and a
            // stall never leads to a burst of ticks.
            slot = (slot + length).max(now);
        }
        let mut stats = self.shared.stats.lock();
        stats.wall_ns = started.elapsed().as_nanos() as u64;
        stats.reader_stats = self.reader.stats();
    }

    /// Sleeps until `deadline` or until a dump asks for a tick; true when asked to stop.
    fn wait_until(&self, deadline: Instant) -> bool {
        let mut stop = self.shared.stop.lock();
        while !*stop && !self.shared.want_all.load(Ordering::SeqCst) {
            if self.shared.wake.wait_until(&mut stop, deadline).timed_out() {
                return false;
            }
        }
        *stop
    }

    /// Keeps the sampler's CPU within the budget on average: the budget accrues CPU
    /// time as wall time passes, each tick spends its cost, and the interval stretches
    /// only while the account is overdrawn, until it is paid back. Unused budget is
    /// kept for `CREDIT_S` of wall time, so a costly tick among cheap ones costs no
    /// rate; the first tick (cold, the costliest) is paid for before any other, so a
    /// process too costly to read is never read at full rate first.
    fn adapt(&mut self, cost_ns: u64, weight: Duration) {
        let budget = self.config.cpu_budget;
        let earned = budget * weight.as_secs_f64();
        self.credit_s = (self.credit_s + earned - cost_ns as f64 / 1e9).min(budget * CREDIT_S);
        self.interval = Duration::from_secs_f64((-self.credit_s / budget).max(0.0)).max(self.base);
    }

    fn tick(&mut self, weight: Duration) {
        if self.shared.inject_panic.swap(false, Ordering::SeqCst) {
            panic!("injected by the test switch");
        }
        let all = self.shared.want_all.swap(false, Ordering::SeqCst);
        let config = &self.config;
        let want = Want { idle: config.idle || all, gil_only: config.gil_only && !all };
        let time_ns = now_ns();
        match self.reader.read(want, &self.shared.tags, &mut self.stacks) {
            Ok(()) => {
                self.read_states(time_ns);
                self.record(time_ns, weight);
                if all {
                    self.keep_for_dump(time_ns);
                }
            }
            Err(e) => {
                // Torn reads of a live process happen; one bad tick is skipped, not fatal.
                let mut stats = self.shared.stats.lock();
                stats.failed_ticks += 1;
                stats.last_error = Some(e);
            }
        }
        self.shared.stats.lock().ticks += 1;
    }

    /// Each stack's state, and the CPU the process and its native threads used.
    fn read_states(&mut self, time_ns: u64) {
        if let Some((process, native)) = self.kernel.cpu_since_last_tick(self.reader.python_cpu_ns(), thread_cpu_ns()) {
            self.shared.cpu.lock().record(time_ns, process, native);
        }
        let gil = self.reader.gil(&self.stacks);
        self.states.clear();
        for t in &self.stacks {
            self.states.push(self.kernel.state(t, &gil, self.rng.f64()));
        }
    }

    fn record(&mut self, time_ns: u64, weight: Duration) {
        let weight_us = weight.as_micros().min(u32::MAX as u128) as u32;
        let config = &self.config;
        let keep = Want { idle: config.idle, gil_only: config.gil_only };
        let mut boundary = 0;
        let mut store = self.shared.store.lock();
        let mut ids = Vec::new();
        for (t, state) in self.stacks.iter().zip(&self.states) {
            // A tag that changed during the read (Err) was a task's at selection.
            let in_task = !matches!(t.tag, Ok(None));
            if !keep.keeps(t.active, t.holds_gil, in_task) || t.frames.is_empty() {
                continue;
            }
            let tag = t.tag.clone().unwrap_or_else(|()| {
                boundary += 1;
                None
            });
            let valid_for = (self.reader.epoch(), store.generation());
            if valid_for != self.ids_valid_for {
                self.store_ids.clear();
                self.ids_valid_for = valid_for;
            }
            ids.clear();
            for &f in t.frames.iter().rev() {
                let reader = &self.reader;
                ids.push(*self.store_ids.entry(f).or_insert_with(|| store.frame_id(reader.frame(f))));
            }
            let flags = state.flags(t.holds_gil);
            let cpu_us = (t.cpu_ns / 1000).min(u32::MAX as u64) as u32;
            store.record_ids(Recorded {
                time_ns,
                ident: t.ident,
                name: self.shared.tags.name(t.ident).or_else(|| t.name.clone()),
                frames: &ids,
                tag: tag.as_deref(),
                weight_us,
                cpu_us,
                flags,
            });
        }
        drop(store);
        self.shared.stats.lock().boundary_samples += boundary;
    }

    fn keep_for_dump(&self, time_ns: u64) {
        let threads = self
            .stacks
            .iter()
            .zip(&self.states)
            .map(|(s, &state)| DumpThread { stack: s.clone(), state, frames: s.frames.iter().map(|&f| self.reader.frame(f)).collect() })
            .collect();
        *self.shared.last.lock() = Some(LastTick { time_ns, threads });
        self.shared.dumped.notify_all();
    }
}
