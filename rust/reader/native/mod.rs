//! Native (C, C++, Rust) frames of this process's threads, without ptrace: a timer
//! on each busy thread's CPU clock (`timers`) sends it a real-time signal whose
//! handler copies its registers and the top of its stack (`signal`); at its next
//! tick the sampling thread unwinds the copy (`unwind`, over the modules' tables in
//! `modules`), names the addresses (`symbols`, `resolve`), merges them with the
//! thread's Python frames (`merge`) and lends them to the Python frames the tick read
//! (`lend`).

mod elf;
mod lend;
mod merge;
mod modules;
mod realigned;
mod resolve;
mod signal;
mod symbols;
mod timers;
mod unwind;

pub use merge::NATIVE;

use crate::profile::model::Frame;
use crate::reader::{Copied, FramePointer, Run, StackReader};
use framehop::x86_64::CacheX86_64;
use lend::NativeCalls;
use merge::{merge, Mismatch, Named};
use modules::Modules;
use resolve::{Kind, Resolver};
use rustc_hash::FxHashMap;
use serde::Serialize;
use signal::{Armed, Capture, Regs};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};
use timers::{Timers, Unarmed};
use unwind::{return_addresses, unwind, unwind_from, word_at, End, NativeFrame};

/// Stack copied from a thread at first; doubled for a thread whose stack went on past it.
const FIRST_COPY: usize = 32 << 10;
/// How long a capture's copy of its thread's Python frames is walked after it, in
/// intervals of the thread's CPU time: its timer fires at the kernel's first tick
/// after each interval of it. A thread sharing a core is captured only every few ticks.
const STANDS_FOR: u64 = 2;
/// Timer periods per sampling interval of a thread's CPU: the kernel fires a timer
/// at its first scheduler tick after the period (every 4 ms at HZ=250), so a period of
/// a whole interval leaves a busy thread without a capture at one tick in five or so.
const TIMERS_PER_INTERVAL: u32 = 2;
/// How often the loader's module counts are checked, for modules loaded or unloaded
/// at addresses already seen.
const LIST_EVERY: Duration = Duration::from_secs(1);
/// Per-capture costs kept for the medians in the stats.
const COSTS_KEPT: usize = 1024;
/// Ticks after which a capture is unwound even where the budget has no room for it, so
/// the lines' lessons (`lend`) stay fresh: about 25 a second at 100 Hz, 0.1% of a core.
const REFRESH_TICKS: u32 = 4;
/// A capture's cost, assumed until one was measured (us on an AMD EPYC VM: 20-30).
const FIRST_CAPTURE_NS: i64 = 30_000;
/// Before 4.19 a signal restarts a `fork` in progress, and a large process's fork
/// can restart for as long as its threads are signalled.
const LEAST_KERNEL: (u32, u32) = (4, 19);

/// The process (by pid, so a forked child starts over) whose sampler captures native stacks.
static OWNER: AtomicI32 = AtomicI32::new(0);

/// Why native capture cannot run here at all, or None.
pub fn unsupported() -> Option<String> {
    if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        return Some("native frames are read on Linux x86-64 only".into());
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    too_old(release.trim()).then(|| {
        format!(
            "native frames need Linux 4.19 or later (before it a signal restarts a fork); this is {}",
            release.trim()
        )
    })
}

/// A capture's costs (unwind, and the rest), summed.
fn total_ns(costs: &[u32; 2]) -> i64 {
    costs.iter().map(|&ns| i64::from(ns)).sum()
}

/// Whether a kernel `release` ("4.14.0-1-amd64") is older than `LEAST_KERNEL`.
fn too_old(release: &str) -> bool {
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) < LEAST_KERNEL
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct NativeStats {
    pub signal: i32,
    /// Why capture stopped, if it did.
    pub off: Option<String>,
    /// Threads with a timer on their CPU clock now.
    pub armed: usize,
    /// Captures unwound (those left unread are `spared`).
    pub captures: u64,
    /// Captures left unread where unwinding them would have cost the rate its budget:
    /// their samples were lent native frames (`lent`), as their lines were known.
    pub spared: u64,
    /// Captures merged with the Python frames their signal copied, of the same
    /// instant; the others (a task or activity begun since, a frame the reader could
    /// not walk) with the frames the tick read. Either way a sample shows the
    /// Python frames the tick read (`lend`).
    pub exact: u64,
    /// Samples of threads on a CPU given no native frame: no capture of their own
    /// at that tick, and none learned for their lines (a thread that blocks the
    /// signal, or runs Python only).
    pub no_capture: u64,
    /// Threads left unarmed because every slot was taken.
    pub no_slot: u64,
    /// Samples of threads on a CPU that were not armed: seen lately in a call a
    /// signal would end with `EINTR` (see `timers`).
    pub not_signalled: u64,
    /// Signals that found their thread's slot still being read or written.
    pub busy: u64,
    /// Samples of threads on a CPU given native frames (`lent`: with no capture of
    /// their own at that tick), those that their Python frames' lines last ran in
    /// (see `lend`).
    pub merged: u64,
    pub lent: u64,
    /// Captures whose halves disagreed: nothing is learned from them, and their
    /// samples are lent as if not captured.
    pub mismatched: u64,
    /// Captures not `exact` taken in another innermost Python frame than the one the
    /// tick's read found: mismatched, unless taken in the interpreter's own code
    /// (running Python), where the native half had nothing to add.
    pub moved: u64,
    /// Unwinds that ended where no unwind information led further.
    pub lost_unwinds: u64,
    /// Samples merged only once their stack was scanned past a frame without unwind
    /// information (hand-written assembly: BLAS kernels).
    pub scanned: u64,
    /// Median cost per capture, in microseconds: unwind, and symbols and merge (with
    /// any scan past assembly).
    pub median_us: [f64; 2],
    pub modules: modules::ModuleStats,
    pub unknown_addresses: u64,
}

impl NativeStats {
    /// Capture that could not start, and why.
    pub fn off(why: String) -> NativeStats {
        NativeStats { off: Some(why), ..Default::default() }
    }
}

pub struct Native {
    signal: i32,
    interval: Duration,
    timers: Timers,
    modules: Modules,
    listed: Instant,
    cache: Box<CacheX86_64>,
    resolver: Resolver,
    copy: FxHashMap<u64, usize>,
    /// Per thread, where its last scan past assembly found the return address that
    /// merged, above the frame it stopped at.
    scanned_at: FxHashMap<u64, u64>,
    calls: NativeCalls,
    costs: VecDeque<[u32; 2]>,
    /// A capture's recent cost, ns (a moving mean).
    capture_ns: i64,
    /// Ticks since the last capture taken; and the position of the thread after the
    /// one whose capture was last unwound, which goes first at the next tick.
    since_capture: u32,
    turn: usize,
    stats: NativeStats,
    unwound: Vec<NativeFrame>,
    named: Vec<Named>,
    merged: Vec<u64>,
}

/// The CPU a tick may still spend on unwinding captures and leave the next tick on
/// time: `ns` less the wall time since the tick `began`, taken when first asked. Wall
/// time is at least the tick's CPU, so the budget is never overspent; a tick the
/// sampler was preempted in only lends more. Its own CPU clock would be a system call
/// a tick (4-7 us on a nested AMD EPYC VM, a fifth of native capture's cost).
pub struct Spare {
    ns: i64,
    began: Option<Instant>,
}

impl Spare {
    pub fn new(ns: i64, began: Instant) -> Spare {
        Spare { ns, began: Some(began) }
    }

    /// What is left now.
    fn left(&mut self) -> i64 {
        if let Some(began) = self.began.take() {
            let used = began.elapsed().as_nanos();
            self.ns = self.ns.saturating_sub(used.min(i64::MAX as u128) as i64);
        }
        self.ns
    }
}

/// A thread whose native frames are wanted: its kernel id, Python frame ids and eval
/// runs; the merged stack replaces its frames.
pub struct Wanted<'a> {
    pub tid: u64,
    pub frames: &'a mut Vec<u64>,
    pub evals: Option<&'a [Run]>,
    /// Where its innermost frame pointer lives, and what the Python read found there.
    pub pointer: Option<FramePointer>,
    /// Its CPU clock at the Python read, where read.
    pub clock_ns: Option<u64>,
    /// On a CPU or waiting for one: its native frames are merged into its sample.
    pub on_cpu: bool,
    /// Not seen lately in a wait a signal would interrupt (see `timers`): it may be
    /// signalled.
    pub may_signal: bool,
    /// When its task or activity last changed, on the monotonic clock (None: they
    /// changed during the read).
    pub marks_since_ns: Option<u64>,
}

/// One half of a merge: a thread's Python frame ids and the eval runs holding them.
#[derive(Clone, Copy)]
struct Python<'a> {
    frames: &'a [u64],
    runs: Option<&'a [Run]>,
}

impl Native {
    /// Takes this process's native capture, with a timer every `interval` of a busy
    /// thread's CPU: installs the handler on a free real-time signal (never one the
    /// application handles).
    pub fn start(interval: Duration) -> Result<Native, String> {
        if let Some(why) = unsupported() {
            return Err(why);
        }
        let pid = std::process::id() as i32;
        let owner = OWNER.load(Ordering::Acquire);
        if owner == pid || OWNER.compare_exchange(owner, pid, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return Err("another sampler in this process reads native frames".into());
        }
        signal::prepare();
        let Some(sig) = signal::install() else {
            OWNER.store(0, Ordering::Release);
            return Err("every real-time signal has a handler of the application's".into());
        };
        Ok(Native {
            signal: sig,
            interval,
            timers: Timers::new(sig, interval / TIMERS_PER_INTERVAL),
            modules: Modules::new(),
            listed: Instant::now(),
            cache: Box::new(CacheX86_64::new()),
            resolver: Resolver::new(),
            copy: FxHashMap::default(),
            scanned_at: FxHashMap::default(),
            calls: NativeCalls::default(),
            costs: VecDeque::new(),
            capture_ns: FIRST_CAPTURE_NS,
            since_capture: 0,
            turn: 0,
            stats: NativeStats { signal: sig, ..Default::default() },
            unwound: Vec::new(),
            named: Vec::new(),
            merged: Vec::new(),
        })
    }

    /// Changes when earlier native frame ids may mean other frames.
    pub fn epoch(&self) -> u64 {
        self.resolver.epoch
    }

    /// The frame behind a native id (`NATIVE` set).
    pub fn frame(&self, id: u64) -> Frame {
        let id = (id & !NATIVE) as u32;
        self.resolver.frame(id).cloned().unwrap_or_else(|| Frame::native("?".into(), "?".into()))
    }

    /// Arms the threads that may be signalled (and disarms the others), and merges
    /// the native frames of each thread on a CPU into its frames (walking the Python
    /// frames a signal copied with `reader`). Captures are unwound while `spare`
    /// lasts; past it, a thread whose lines are known is lent their native frames
    /// instead, so native frames cost captures before they cost rate. Threads take
    /// turns at going first: the one after the thread last unwound.
    pub fn capture(&mut self, threads: &mut [Wanted<'_>], reader: &mut dyn StackReader, mut spare: Spare) {
        if self.stats.off.is_some() {
            return;
        }
        if !signal::is_ours(self.signal) {
            self.stats.off = Some(format!(
                "the application put a handler of its own on signal {}: native frames are off",
                self.signal
            ));
            self.timers.disarm_all();
            return;
        }
        if self.listed.elapsed() >= LIST_EVERY {
            self.modules.refresh();
            self.listed = Instant::now();
        }
        self.since_capture += 1;
        let first = self.turn;
        for i in 0..threads.len() {
            let at = (first + i) % threads.len();
            let w = &mut threads[at];
            if let Some(slot) = self.armed(w) {
                if w.on_cpu && self.merge_capture(slot, w, reader, &mut spare) {
                    self.turn = at + 1;
                }
            }
        }
    }

    /// `w`'s slot, with its request brought up to date; None if it may not be signalled.
    fn armed(&mut self, w: &Wanted<'_>) -> Option<Armed> {
        if !w.may_signal {
            self.timers.disarm(w.tid);
            self.stats.not_signalled += u64::from(w.on_cpu);
            return None;
        }
        match self.timers.arm(w.tid) {
            Ok(slot) => {
                slot.ask(self.copy_size(w.tid), w.pointer);
                Some(slot)
            }
            Err(Unarmed::NoSlot) => {
                self.stats.no_slot += 1;
                None
            }
            Err(Unarmed::Refused) => None,
        }
    }

    /// Merges the capture waiting in `slot` into `w`'s frames, or else lends them the
    /// native frames earlier captures showed under their Python frames. A capture is
    /// unwound if `spare` pays for it, if none was for `REFRESH_TICKS` ticks, if its
    /// lines were never learned, or on py-spy's reader; else it is left unread. Whether
    /// one was unwound.
    fn merge_capture(
        &mut self,
        slot: Armed,
        w: &mut Wanted<'_>,
        reader: &mut dyn StackReader,
        spare: &mut Spare,
    ) -> bool {
        let Some(capture) = slot.capture() else {
            self.lend_or_none(w, reader);
            return false;
        };
        // py-spy's reader walks no copy, so no capture teaches an innermost line (`take`):
        // there only a sample's own capture gives it its C callees.
        let affordable = w.pointer.is_none() || spare.left() >= self.capture_ns || self.since_capture >= REFRESH_TICKS;
        if !affordable && self.lend_counted(w, reader) {
            slot.release();
            self.stats.spared += 1;
            return false;
        }
        let merged = self.take(&capture, w, reader);
        slot.release();
        spare.ns -= self.costs.back().map_or(0, total_ns);
        self.since_capture = 0;
        if !merged {
            self.lend_or_none(w, reader);
        }
        true
    }

    /// `lend_counted`, or counted as given no native frame.
    fn lend_or_none(&mut self, w: &mut Wanted<'_>, reader: &dyn StackReader) {
        if !self.lend_counted(w, reader) {
            self.stats.no_capture += 1;
        }
    }

    /// `lend_to`, counted as a lent sample where it lent.
    fn lend_counted(&mut self, w: &mut Wanted<'_>, reader: &dyn StackReader) -> bool {
        let lent = self.lend_to(w, reader);
        self.stats.lent += u64::from(lent);
        self.stats.merged += u64::from(lent);
        lent
    }

    /// Gives the Python frames just read the native frames their lines last ran in;
    /// false if none.
    fn lend_to(&mut self, w: &mut Wanted<'_>, reader: &dyn StackReader) -> bool {
        let epochs = (self.resolver.epoch, reader.epoch());
        if self.calls.lend(w.frames, epochs, |id| reader.frame(id), &mut self.merged) == 0 {
            return false;
        }
        std::mem::swap(w.frames, &mut self.merged);
        true
    }

    /// Forgets what was kept per thread for threads not in `live` (sorted): they exited.
    pub fn keep_threads(&mut self, live: &[u64]) {
        let alive = |tid: &u64| live.binary_search(tid).is_ok();
        self.timers.keep(live);
        self.copy.retain(|tid, _| alive(tid));
        self.scanned_at.retain(|tid, _| alive(tid));
    }

    /// Whether a capture taken at the thread's CPU clock `then` still stands for it at
    /// `now`: the thread used at most `STANDS_FOR` intervals of CPU in between.
    fn still_stands(&self, now: u64, then: u64) -> bool {
        now.saturating_sub(then) <= STANDS_FOR * self.interval.as_nanos() as u64
    }

    /// A capture unwound and merged with the Python frames it copied where the reader
    /// can walk them, else with those the tick read if the thread was still in the
    /// frame it was captured in; learned from (`lend`), and lent to `w`'s frames.
    /// False if the halves disagreed.
    fn take(&mut self, c: &Capture, w: &mut Wanted<'_>, reader: &mut dyn StackReader) -> bool {
        self.stats.captures += 1;
        let t0 = Instant::now();
        let mut end = self.unwind_copy(c.regs, c.stack, None);
        let t1 = Instant::now();
        let copied = self.copied_python(c, w, reader);
        self.stats.exact += u64::from(copied.is_some());
        let python = match &copied {
            Some((frames, runs)) => Python { frames, runs: Some(runs) },
            None => Python { frames: w.frames, runs: w.evals },
        };
        // Read at the tick, a frame pointer that differs: the thread was in another
        // Python frame when captured than when read, the halves are of two moments.
        let moved = copied.is_none() && w.pointer.is_some_and(|p| c.pointer != Some(p.seen));
        let copy_end = self.copy_end(w.tid, c.regs, c.stack);
        let mut merged = !moved && self.merge_into(python, end, copy_end).is_ok();
        if !moved && !merged && end != End::Cut {
            let scan = self.scan_past_assembly(w.tid, python, c.regs, c.stack, copy_end);
            (end, merged) = scan.unwrap_or((end, false));
        }
        self.after_unwind(w.tid, end, c.stack.len(), !merged && !moved);
        let mut shown = merged;
        if merged {
            let epochs = (self.resolver.epoch, reader.epoch());
            self.calls.learn(&self.merged, copied.is_some(), epochs, |id| reader.frame(id));
            // The sample keeps the read's Python frames, with what the captures taught.
            // Merged with those, a capture may be of another line of the same innermost
            // frame; py-spy's reader tells not even the frame: the merge stands.
            shown = if w.pointer.is_some() {
                self.lend_to(w, reader)
            } else {
                std::mem::swap(w.frames, &mut self.merged);
                true
            };
        }
        self.stats.merged += u64::from(shown);
        // Captured in the interpreter's own code, the native half had nothing to add.
        self.stats.mismatched += u64::from(!(merged || moved && self.in_interpreter()));
        self.stats.moved += u64::from(moved);
        self.keep_costs([t1 - t0, t1.elapsed()].map(|d| d.as_nanos().min(u32::MAX as u128) as u32));
        merged
    }

    /// The Python frames and eval runs `c` copied, walked by `reader`; None where it
    /// cannot walk them, where the thread's task or activity changed since (the
    /// tick's marks are not the capture's), or where the capture is older than a
    /// capture stands for.
    fn copied_python(&self, c: &Capture, w: &Wanted<'_>, reader: &mut dyn StackReader) -> Option<(Vec<u64>, Vec<Run>)> {
        let at = w.pointer?;
        let same_marks = w.marks_since_ns.is_some_and(|since| since <= c.time_ns);
        let recent = w.clock_ns.is_none_or(|now| c.cpu_ns == 0 || self.still_stands(now, c.cpu_ns));
        if !(same_marks && recent) {
            return None;
        }
        let copy = Copied { pointer: c.pointer?, chunk: c.chunk, stack: (c.regs.sp, c.stack), time_ns: c.time_ns };
        reader.copied_frames(&at, &copy)
    }

    /// Whether the capture just unwound was in the interpreter's own code (running
    /// Python), where a merge shows no native frame.
    fn in_interpreter(&mut self) -> bool {
        let leaf = self.unwound.first().map(|f| self.resolver.resolve(f.pc, &mut self.modules).1);
        leaf.is_some_and(|kind| kind != Kind::Shown)
    }

    /// An unwind that stopped short of the eval loops may have met assembly without
    /// unwind information: tries the return addresses above the frame it stopped at,
    /// nearest first, until the halves merge. Stale ones (a stack keeps what earlier
    /// calls left) lead nowhere or to halves that disagree.
    fn scan_past_assembly(
        &mut self,
        tid: u64,
        python: Python<'_>,
        regs: Regs,
        stack: &[u8],
        copy_end: u64,
    ) -> Option<(End, bool)> {
        let (from, kept) = (self.unwound.last()?.sp, self.unwound.len());
        // The thread's last scan that merged, first, and alone if it merges (a scan
        // reads every word of a stack its kernel realigned): a kernel called from the
        // same place keeps its caller's return address as far above its stack pointer.
        let last = (self.scanned_at.get(&tid))
            .and_then(|&off| Some((from + off, word_at(stack, regs.sp, from + off)?)))
            .filter(|&(_, ra)| self.modules.after_call(ra));
        if let Some(at) = last {
            if let Some(end) = self.merge_from((tid, python), regs, stack, copy_end, (kept, from), at) {
                return Some((end, true));
            }
        }
        let modules = &mut self.modules;
        let found = return_addresses(regs, stack, from, |a| modules.after_call(a));
        let end = found
            .into_iter()
            .filter(|&f| Some(f) != last)
            .find_map(|at| self.merge_from((tid, python), regs, stack, copy_end, (kept, from), at))?;
        Some((end, true))
    }

    /// Unwinds again from the return address `at` (above the `kept` frames, the last
    /// of them at `from`) and merges; how the unwind ended, if the halves agree.
    fn merge_from(
        &mut self,
        (tid, python): (u64, Python<'_>),
        regs: Regs,
        stack: &[u8],
        copy_end: u64,
        (kept, from): (usize, u64),
        at: (u64, u64),
    ) -> Option<End> {
        let end = self.unwind_copy(regs, stack, Some((kept, at)));
        self.merge_into(python, end, copy_end).ok()?;
        self.stats.scanned += 1;
        self.scanned_at.insert(tid, at.0 - from);
        Some(end)
    }

    /// Unwinds the copy `stack`, or (`from`) again from a return address above the frames
    /// kept; and again each time it met a module read only then, whose tables lead on.
    fn unwind_copy(&mut self, regs: Regs, stack: &[u8], from: Option<(usize, (u64, u64))>) -> End {
        loop {
            let (modules, cache, out) = (&self.modules, &mut self.cache, &mut self.unwound);
            let end = match from {
                None => unwind(modules, cache, regs, stack, out),
                Some((kept, at)) => {
                    out.truncate(kept);
                    unwind_from(modules, cache, regs, stack, at, out)
                }
            };
            if !self.modules.read_tables(self.unwound.iter().map(|f| f.pc)) {
                return end;
            }
        }
    }

    /// The bytes of stack a signal asks `tid` to copy.
    fn copy_size(&self, tid: u64) -> usize {
        *self.copy.get(&tid).unwrap_or(&FIRST_COPY)
    }

    /// Where the thread's stack may end: where its copy stopped short, at the end of
    /// the stack; a copy that took all it asked for may have stopped inside it.
    fn copy_end(&self, tid: u64, regs: Regs, stack: &[u8]) -> u64 {
        if stack.len() >= self.copy_size(tid).min(signal::MAX_COPY) {
            u64::MAX
        } else {
            regs.sp + stack.len() as u64
        }
    }

    /// Grows the copy of a thread whose stack went on past it, or whose halves did not
    /// merge (`short`) from a full copy: a caller past the copy can read as the root.
    fn after_unwind(&mut self, tid: u64, end: End, copied: usize, short: bool) {
        if end == End::Lost {
            self.stats.lost_unwinds += 1;
        }
        if end == End::Cut || short {
            if self.copy.len() > 4096 {
                self.copy.clear();
            }
            let now = self.copy_size(tid);
            if copied >= now {
                self.copy.insert(tid, (now * 2).min(signal::MAX_COPY));
            }
        }
    }

    /// Merges the native frames unwound (from a copy of the stack up to `copy_end`)
    /// with `python` into `merged`, unless the halves disagree.
    fn merge_into(&mut self, python: Python<'_>, end: End, copy_end: u64) -> Result<(), Mismatch> {
        self.named.clear();
        for &at in &self.unwound {
            let (id, kind) = self.resolver.resolve(at.pc, &mut self.modules);
            self.named.push(Named { id, kind, at });
        }
        merge(python.frames, python.runs, &self.named, end, copy_end, &mut self.merged)
    }

    /// A capture's costs, kept for the medians and the moving mean.
    fn keep_costs(&mut self, costs: [u32; 2]) {
        if self.costs.len() >= COSTS_KEPT {
            self.costs.pop_front();
        }
        self.costs.push_back(costs);
        self.capture_ns += (total_ns(&costs) - self.capture_ns) / 8;
    }

    /// The counters, with the medians of the recent costs.
    pub fn stats(&self) -> NativeStats {
        let mut stats = NativeStats {
            armed: self.timers.count(),
            busy: self.timers.busy(),
            unknown_addresses: self.resolver.unknown,
            modules: self.modules.stats(),
            ..self.stats.clone()
        };
        if !self.costs.is_empty() {
            stats.median_us = [0, 1].map(|k| {
                let mut v: Vec<u32> = self.costs.iter().map(|c| c[k]).collect();
                v.sort_unstable();
                v[v.len() / 2] as f64 / 1000.0
            });
        }
        stats
    }
}

impl Drop for Native {
    fn drop(&mut self) {
        let _ = OWNER.compare_exchange(std::process::id() as i32, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::too_old;

    #[test]
    fn kernels_before_4_19_are_refused() {
        assert!(too_old("4.14.336-1-amd64"));
        assert!(too_old("3.10.0-1160.el7.x86_64"));
        assert!(!too_old("4.19.0-27-amd64"));
        assert!(!too_old("6.18.0"));
        assert!(!too_old("5.4.0-generic"));
    }
}
