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

use crate::heap::live;
use crate::priority;
use crate::profile::model::Frame;
use crate::profile::sample::{Sample, State, FLAG_BLOCKS_LOOP};
use crate::reader::native::{Native, NativeStats, Spare, Wanted, NATIVE};
use crate::reader::tags::{Marks, ThreadTags};
use crate::reader::{Chosen, PySpyReader, RawStack, Read, StackReader, ThreadStack, Want};
use crate::sampling::backlog::{Backlog, Taken};
use crate::sampling::calls::Pending;
use crate::sampling::charge::Charge;
use crate::sampling::config::SamplerConfig;
use crate::sampling::cpu::{own_cpu_ns, Clocks, ProcessCpu};
use crate::sampling::lateness::Lateness;
use crate::sampling::loops::LoopWatch;
use crate::sampling::phases::{Phase, Phases};
use crate::sampling::series::Series;
use crate::sampling::stalls::Stalls;
use crate::sampling::states::{StateStats, States};
use crate::sampling::store::{Recorded, Store};
use crate::sampling::watching::{LoopsNow, Watching};
use crate::sync::{Condvar, Mutex};
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;
use serde_json::Value;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Wall time for which unspent CPU budget is kept: long enough that an occasional
/// costly tick does not cost rate, short enough that a burst stays small.
const CREDIT_S: f64 = 1.0;
/// Ticks between refreshes of the reader's counters in the stats.
const READER_STATS_EVERY: u64 = 10;

#[derive(Clone, Debug, Default, Serialize)]
pub struct RunStats {
    pub running: bool,
    pub started_ns: Option<u64>,
    pub ticks: u64,
    pub failed_ticks: u64,
    pub throttled_ticks: u64,
    /// Ticks at which nothing ran since one at which nothing ran: its samples, again.
    pub repeated_ticks: u64,
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
    /// Native capture's counters, when asked for.
    pub native: Option<NativeStats>,
    pub lateness: Lateness,
    /// Samples kept aside while an export held the store, recorded a tick later.
    pub deferred_samples: u64,
    /// Where the ticks' time went, by phase.
    pub phases: Phases,
    /// The slice the kernel gives the sampling thread (ns), if it keeps a short one.
    pub slice_ns: Option<u64>,
}

/// One thread of a live dump.
pub struct DumpThread {
    pub stack: ThreadStack,
    pub state: State,
    pub frames: Vec<Frame>,
}

/// Every thread's stack at the last tick that read them all, for live dumps.
pub struct LastTick {
    pub time_ns: u64,
    pub threads: Vec<DumpThread>,
}

pub struct Shared {
    /// Changes only while stopped (`configure`); a run reads its own copy.
    pub config: Mutex<SamplerConfig>,
    pub tags: Arc<ThreadTags>,
    pub store: Mutex<Store>,
    /// Calls counted since the last tick, which folds them into the store.
    pub calls: Mutex<Pending>,
    /// CPU and memory per second of the whole process.
    pub series: Mutex<Series>,
    /// The event loops watched for stalls, and the stalls they had.
    pub loops: Mutex<Vec<Arc<LoopWatch>>>,
    pub stalls: Mutex<Stalls>,
    pub stats: Mutex<RunStats>,
    pub last: Mutex<Option<LastTick>>,
    pub dumped: Condvar,
    /// A dump asks the next tick to read every thread, idle ones too.
    pub want_all: AtomicBool,
    pub stop: Mutex<bool>,
    pub wake: Condvar,
    pub inject_panic: AtomicBool,
}

impl Shared {
    /// Moves the calls counted so far into `store`.
    pub fn fold_calls(&self, store: &mut Store) {
        store.fold_calls(&mut self.calls.lock());
    }
}

pub fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

fn weight_us(weight: Duration) -> u32 {
    weight.as_micros().min(u32::MAX as u128) as u32
}

fn cpu_us(t: &ThreadStack) -> u32 {
    (t.cpu_ns / 1000).min(u32::MAX as u64) as u32
}

pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// The frame behind an id of the reader's, or of native capture's.
fn frame_of(reader: &dyn StackReader, native: Option<&Native>, id: u64) -> Frame {
    match native {
        Some(native) if id & NATIVE != 0 => native.frame(id),
        _ => reader.frame(id),
    }
}

pub fn run(shared: Arc<Shared>, chosen: Chosen, ready: mpsc::Sender<std::result::Result<(), String>>) {
    shared.stats.lock().running = true;
    let config = shared.config.lock().clone();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let reader: Box<dyn StackReader> = match chosen {
            Chosen::Fast(fast) => fast,
            Chosen::PySpy { fallback } => match PySpyReader::new(config.lines, config.function, fallback) {
                Ok(spy) => Box::new(spy),
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            },
        };
        let slice_ns = priority::short_slice(reader.slice_ns());
        let mut stats = shared.stats.lock();
        stats.reader = Some(reader.name());
        stats.reader_stats = reader.stats();
        stats.slice_ns = slice_ns;
        drop(stats);
        // Started before `start` returns, so its stats (or why it is off) are there then.
        let interval = Duration::from_secs_f64(config.interval_secs());
        let native = config.native.then(|| Native::start(interval)).and_then(|started| {
            let stats = started.as_ref().map_or_else(|off| NativeStats::off(off.clone()), Native::stats);
            shared.stats.lock().native = Some(stats);
            started.ok()
        });
        let mut ticks = Loop::new(&shared, config, reader, native);
        ticks.open_thread_files();
        let _ = ready.send(Ok(()));
        ticks.run();
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
    /// Native capture, when asked for and possible here.
    native: Option<Native>,
    base: Duration,
    interval: Duration,
    /// CPU seconds the budget allows that ticks have not spent (negative: overdrawn).
    credit_s: f64,
    stacks: Vec<ThreadStack>,
    /// The state of each of `stacks`.
    states: Vec<State>,
    kernel: States,
    cpu: ProcessCpu,
    rng: fastrand::Rng,
    /// Reader (or native) frame id -> store frame id, valid for `ids_valid_for`
    /// (reader epoch, native epoch, store generation).
    store_ids: FxHashMap<u64, u32>,
    /// Per thread, the frame ids of its last sample and their store ids, valid as
    /// `store_ids`: a thread whose stack stands (most, most ticks) needs no lookups.
    last_stack: FxHashMap<u64, (Vec<u64>, Vec<u32>)>,
    ids_valid_for: (u64, u64, u64),
    backlog: Backlog,
    /// Process and native CPU ns not yet in the series.
    cpu_pending: (u64, u64),
    watching: Watching,
    loops_now: LoopsNow,
    phases: Phases,
    /// The samples of the last tick, one at which nothing ran, and the store generation
    /// they belong to.
    repeat: Option<(u64, Vec<Sample>)>,
}

impl<'a> Loop<'a> {
    fn new(shared: &'a Shared, config: SamplerConfig, reader: Box<dyn StackReader>, native: Option<Native>) -> Self {
        let base = Duration::from_secs_f64(config.interval_secs());
        Loop {
            shared,
            config,
            reader,
            native,
            base,
            interval: base,
            credit_s: 0.0,
            stacks: Vec::new(),
            states: Vec::new(),
            kernel: States::new(),
            cpu: ProcessCpu::new(),
            rng: fastrand::Rng::new(),
            store_ids: FxHashMap::default(),
            last_stack: FxHashMap::default(),
            ids_valid_for: (0, 0, 0),
            backlog: Backlog::default(),
            cpu_pending: (0, 0),
            watching: Watching::default(),
            loops_now: LoopsNow::default(),
            phases: Phases::default(),
            repeat: None,
        }
    }

    fn run(&mut self) {
        let started = Instant::now();
        // Time is cut into slots of one interval, so ticks / elapsed is the rate.
        let mut slot = started;
        // The sleep and the wake between ticks cost the thread CPU too (40-75 us on a
        // nested AMD EPYC VM, more than a tick): each is charged as the next tick
        // begins. Left out, they let the budget be overspent unseen.
        let mut charge = Charge::new();
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
            // Charged by its own clock, not wall time: a tick preempted on a busy machine
            // took milliseconds of wall time, and charging those swung the interval wildly.
            let clocks = self.cpu.at_start(self.reader.may_stand_still());
            let (mut spent, wake) = charge.at_start(clocks.own_ns);
            self.adapt(spent, weight);
            if let Some(wake) = wake {
                self.phases.add_wake(wake);
            }
            self.tick(weight, clocks, now);
            let cost = charge.at_end(clocks.own_ns);
            self.adapt(cost, Duration::ZERO);
            spent += cost;
            let mut stats = self.shared.stats.lock();
            stats.lateness.add(now.saturating_duration_since(at));
            stats.cpu_ns += spent;
            stats.wall_ns = started.elapsed().as_nanos() as u64;
            stats.interval_s = self.interval.as_secs_f64();
            stats.throttled_ticks += (self.interval > self.base) as u64;
            if stats.ticks % READER_STATS_EVERY == 1 {
                self.copy_counters(&mut stats);
                stats.states = self.kernel.stats();
                stats.phases = self.phases.clone();
            }
            drop(stats);
            // A late tick's weight reached `now`: the next slot starts there, and a
            // stall never leads to a burst of ticks.
            slot = (slot + length).max(now);
        }
        self.backlog.flush(&mut self.shared.store.lock());
        self.watching.flush(&self.shared.stalls);
        let mut stats = self.shared.stats.lock();
        stats.cpu_ns += charge.uncharged(own_cpu_ns());
        stats.wall_ns = started.elapsed().as_nanos() as u64;
        self.copy_counters(&mut stats);
    }

    /// The reader's and native capture's counters, into the stats.
    fn copy_counters(&self, stats: &mut RunStats) {
        stats.reader_stats = self.reader.stats();
        stats.deferred_samples = self.backlog.deferred;
        if let Some(native) = &self.native {
            stats.native = Some(native.stats());
        }
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
    fn adapt(&mut self, spent_ns: u64, weight: Duration) {
        let budget = self.config.cpu_budget;
        let earned = budget * weight.as_secs_f64();
        self.credit_s = (self.credit_s + earned - spent_ns as f64 / 1e9).min(budget * CREDIT_S);
        self.interval = Duration::from_secs_f64((-self.credit_s / budget).max(0.0)).max(self.base);
    }

    /// `clocks`: those read at the tick's start; `began`: when it woke.
    fn tick(&mut self, weight: Duration, clocks: Clocks, began: Instant) {
        if self.shared.inject_panic.swap(false, Ordering::SeqCst) {
            panic!("injected by the test switch");
        }
        let all = self.shared.want_all.swap(false, Ordering::SeqCst);
        let config = &self.config;
        let time_ns = now_ns();
        // A stalling loop's thread is read blocked too: the stall's explanation needs it.
        let late = self.shared.loops.lock().iter().any(|w| w.stalling(time_ns));
        let want = Want { idle: config.idle || all || late, gil_only: config.gil_only && !all, quiet: clocks.quiet };
        let mut lap = Instant::now();
        let listed = self.reader.list_ns();
        let read = self.read(want, all);
        self.phases.add(Phase::Stacks, &mut lap);
        self.phases.move_ns(Phase::Stacks, Phase::Threads, self.reader.list_ns() - listed);
        match read {
            Ok(read) => {
                self.track_threads();
                self.kernel.count_tick();
                self.record_cpu(time_ns, &clocks);
                let again = read == Read::Again && self.repeat.is_some();
                if !again {
                    self.read_states();
                }
                self.phases.add(Phase::States, &mut lap);
                let now = (&self.stacks[..], &self.states[..], &self.kernel);
                let weight_us = weight.as_micros() as u64;
                let shared = self.shared;
                self.loops_now = self.watching.tick(&shared.loops, &shared.stalls, now, time_ns, weight_us);
                self.phases.add(Phase::Loops, &mut lap);
                if again {
                    self.record_again(time_ns, weight);
                } else {
                    self.capture_native(began);
                    self.phases.add(Phase::Native, &mut lap);
                    self.record(time_ns, weight, read);
                }
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
        self.name_allocation_sites();
        if let Some(mut store) = self.shared.store.try_lock() {
            self.shared.fold_calls(&mut store); // else the next tick, or the export, folds them
        }
        self.phases.add(Phase::Record, &mut lap);
        self.phases.tick();
        self.shared.stats.lock().ticks += 1;
    }

    /// Names the stacks of the allocation sites memory tracking found since the last tick.
    fn name_allocation_sites(&mut self) {
        let (start, pending) = live::unnamed();
        if pending.is_empty() {
            return;
        }
        let stacks: Vec<&RawStack> = pending.iter().map(|(_, stack)| stack).collect();
        let named = self.reader.name_stacks(&stacks);
        live::name(start, pending.iter().map(|&(id, _)| id).zip(named));
    }

    /// Reads the stacks; when nothing ran since a tick at which nothing ran either,
    /// keeps that tick's stacks, states and samples (`repeat`), reading nothing more.
    fn read(&mut self, want: Want, all: bool) -> Result<Read, String> {
        let tags = &self.shared.tags;
        if !(want.quiet && !all && self.repeat.is_some()) {
            return self.reader.read(want, tags, &mut self.stacks);
        }
        if self.reader.stands_still(want)? {
            return Ok(Read::Again);
        }
        self.repeat = None;
        self.reader.read(Want { quiet: false, ..want }, tags, &mut self.stacks)
    }

    /// Opens the files of the threads alive now, before `start` returns: a server's
    /// descriptor count taken once it started is then the one it comes back to.
    fn open_thread_files(&mut self) {
        let all = Want { idle: true, gil_only: false, quiet: false };
        if self.reader.read(all, &self.shared.tags, &mut self.stacks).is_ok() {
            self.track_threads();
        }
    }

    /// A thread's files come and go with it: the read listed every live thread.
    fn track_threads(&mut self) {
        let live = self.reader.live_tids();
        self.kernel.track_threads(live);
        if let Some(native) = self.native.as_mut() {
            native.keep_threads(live);
        }
    }

    /// The CPU the process and its native threads used since the last tick.
    fn record_cpu(&mut self, time_ns: u64, clocks: &Clocks) {
        if let Some((process, native)) = self.cpu.after_read(self.reader.python_cpu_ns(), clocks) {
            let (p, n) = &mut self.cpu_pending;
            (*p, *n) = (*p + process, *n + native);
            // An export may be reading the series: its CPU waits for the next tick, not the sampler.
            if let Some(mut series) = self.shared.series.try_lock() {
                series.record(time_ns, std::mem::take(p), std::mem::take(n));
            }
        }
    }

    /// Each stack's state.
    fn read_states(&mut self) {
        let gil = self.reader.gil(&self.stacks);
        let native = self.cpu.native_busy();
        self.states.clear();
        for t in &self.stacks {
            self.states.push(self.kernel.state(t, &gil, self.rng.f64(), native));
        }
    }

    /// Merges the native stacks of threads on a CPU (or waiting for one) into their
    /// Python stacks; which threads get a timer is native capture's choice.
    /// `began_cpu_ns`: the sampler's clock as the tick began.
    fn capture_native(&mut self, began: Instant) {
        let spare = Spare::new(self.native_spare_ns(), began);
        let Some(native) = self.native.as_mut() else { return };
        let on_cpu = |s: &State| matches!(s, State::Cpu | State::CpuGil | State::CpuWait);
        let kernel = &self.kernel;
        let mut wanted: Vec<Wanted<'_>> = (self.stacks.iter_mut().zip(&self.states))
            .filter(|(t, _)| !t.frames.is_empty())
            .filter_map(|(t, s)| {
                let tid = t.native_tid?;
                Some(Wanted {
                    tid,
                    frames: &mut t.frames,
                    evals: t.evals.as_deref(),
                    pointer: t.pointer,
                    clock_ns: t.clock_ns,
                    on_cpu: on_cpu(s),
                    may_signal: kernel.may_be_signalled(tid),
                    marks_since_ns: t.marks.as_ref().ok().map(|m| m.since_ns),
                })
            })
            .collect();
        native.capture(&mut wanted, &mut *self.reader, spare);
    }

    /// The CPU (ns) a tick may spend and leave the next tick on time, less its record
    /// phase and the wake before the next: the credit and what the next slot earns.
    fn native_spare_ns(&self) -> i64 {
        let earned = self.config.cpu_budget * self.base.as_secs_f64();
        let to_come = self.phases.mean_ns(Phase::Record) + self.phases.mean_ns(Phase::Wake);
        ((self.credit_s + earned) * 1e9) as i64 - to_come as i64
    }

    /// Records the samples of the tick before again, as `repeat` keeps them; where the
    /// store moved on since or an export holds it, reads the states and records anew.
    fn record_again(&mut self, time_ns: u64, weight: Duration) {
        let store = self.shared.store.try_lock();
        let repeatable =
            self.repeat.as_ref().zip(store).filter(|((generation, _), store)| *generation == store.generation());
        match repeatable {
            Some(((_, samples), mut store)) if self.backlog.is_empty() => {
                store.repeat(samples, time_ns, weight_us(weight));
                drop(store);
                self.shared.stats.lock().repeated_ticks += 1;
            }
            _ => {
                self.read_states();
                self.record(time_ns, weight, Read::Again);
            }
        }
    }

    /// Records the tick's samples; while an export holds the store, keeps them in the
    /// backlog instead of waiting, and records them first at the next tick that gets it.
    /// Samples read `Again` are kept in `repeat` for the next tick at which nothing ran.
    fn record(&mut self, time_ns: u64, weight: Duration, read: Read) {
        self.repeat = None;
        let weight_us = weight_us(weight);
        let mut boundary = 0;
        let kept = self.kept(&mut boundary);
        self.shared.stats.lock().boundary_samples += boundary;
        let store = self.shared.store.try_lock();
        let mut store = match store {
            Some(store) => store,
            None if self.backlog.is_full() => self.shared.store.lock(),
            None => {
                for (i, marks) in kept {
                    let taken = self.taken(i, marks, time_ns, weight_us);
                    self.backlog.push(taken);
                }
                return;
            }
        };
        self.backlog.flush(&mut store);
        if self.last_stack.len() > 2 * self.stacks.len() + 64 {
            let live: FxHashSet<u64> = self.stacks.iter().map(|t| t.ident).collect();
            self.last_stack.retain(|ident, _| live.contains(ident));
        }
        let recorded = kept.len();
        for (i, marks) in kept {
            let valid_for = (self.reader.epoch(), self.native.as_ref().map_or(0, Native::epoch), store.generation());
            if valid_for != self.ids_valid_for {
                self.store_ids.clear();
                self.last_stack.clear();
                self.ids_valid_for = valid_for;
            }
            let (flags, t) = (self.flags(i), &self.stacks[i]);
            let name = self.shared.tags.name(t.ident).or_else(|| t.name.clone());
            let (frames, ids) = self.last_stack.entry(t.ident).or_default();
            if *frames != t.frames {
                frames.clone_from(&t.frames);
                ids.clear();
                for &f in t.frames.iter().rev() {
                    let frame = || store.frame_id(frame_of(&*self.reader, self.native.as_ref(), f));
                    ids.push(*self.store_ids.entry(f).or_insert_with(frame));
                }
            }
            store.record_ids(Recorded {
                time_ns,
                ident: t.ident,
                name,
                frames: ids,
                tag: marks.task.as_deref(),
                activity: marks.activity.as_ref().map(|a| &*a.name),
                weight_us,
                cpu_us: cpu_us(t),
                flags,
            });
        }
        if read == Read::Again {
            self.repeat = store.newest(recorded).map(|samples| (store.generation(), samples));
        }
    }

    /// Stack `i`'s flags: its state, and whether it held the GIL a loop waited for
    /// (known on the fast reader only).
    fn flags(&self, i: usize) -> u8 {
        let t = &self.stacks[i];
        let blocks = self.loops_now.gil_waited && t.holds_gil && self.reader.name() == "fast";
        self.states[i].flags(t.holds_gil) | if blocks { FLAG_BLOCKS_LOOP } else { 0 }
    }

    /// The stacks the options keep, by index, with their marks; counts in `boundary`
    /// those whose marks changed during the read (a task's at selection: left untagged).
    fn kept(&self, boundary: &mut u64) -> Vec<(usize, Marks)> {
        let config = &self.config;
        let keep = Want { idle: config.idle, gil_only: config.gil_only, quiet: false };
        let mut kept = Vec::new();
        for (i, t) in self.stacks.iter().enumerate() {
            let in_task = t.marks.as_ref().map_or(true, |m| m.task.is_some());
            // A late loop's thread is kept blocked too: that is part of the stall.
            let keeps = keep.keeps(t.active, t.runs_python, in_task) || self.loops_now.is_late(t.ident);
            if !keeps || t.frames.is_empty() {
                continue;
            }
            let marks = t.marks.clone().unwrap_or_else(|()| {
                *boundary += 1;
                Marks::default()
            });
            kept.push((i, marks));
        }
        kept
    }

    /// Stack `i`'s sample, its frames resolved, for the backlog.
    fn taken(&self, i: usize, marks: Marks, time_ns: u64, weight_us: u32) -> Taken {
        let t = &self.stacks[i];
        Taken {
            time_ns,
            ident: t.ident,
            name: self.shared.tags.name(t.ident).or_else(|| t.name.clone()),
            frames: t.frames.iter().rev().map(|&f| frame_of(&*self.reader, self.native.as_ref(), f)).collect(),
            marks,
            weight_us,
            cpu_us: cpu_us(t),
            flags: self.flags(i),
        }
    }

    fn keep_for_dump(&self, time_ns: u64) {
        let threads = self
            .stacks
            .iter()
            .zip(&self.states)
            .map(|(s, &state)| DumpThread {
                stack: s.clone(),
                state,
                frames: s.frames.iter().map(|&f| frame_of(&*self.reader, self.native.as_ref(), f)).collect(),
            })
            .collect();
        *self.shared.last.lock() = Some(LastTick { time_ns, threads });
        self.shared.dumped.notify_all();
    }
}
