//! Native (C, C++, Rust) frames of this process's threads, without ptrace: the sampler
//! sends each running thread a real-time signal whose handler copies its registers and
//! the top of its stack (`signal`); the sampling thread then unwinds the copy
//! (`unwind`, over the modules' tables in `modules`), names the addresses (`symbols`,
//! `resolve`) and merges them with the thread's Python frames (`merge`).

mod merge;
mod modules;
mod resolve;
mod running;
mod signal;
mod symbols;
mod unwind;

pub use merge::NATIVE;

use crate::profile::model::Frame;
use crate::reader::{FramePointer, Run};
use framehop::x86_64::CacheX86_64;
use merge::{merge, Mismatch, Named};
use modules::Modules;
use resolve::Resolver;
use running::{Running, Verdict};
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;
use signal::{Regs, Slot, SLOTS};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};
use unwind::{return_addresses, unwind, unwind_from, word_at, End, NativeFrame};

/// How long a tick waits for threads to answer: a thread that blocks the signal, or
/// waits for a CPU, gets a Python-only sample.
const ANSWER_WITHIN: Duration = Duration::from_millis(5);
/// Stack copied from a thread at first; doubled for a thread whose stack went on past it.
const FIRST_COPY: usize = 32 << 10;
/// How often the loader's module counts are checked, for modules loaded or unloaded
/// at addresses already seen.
const LIST_EVERY: Duration = Duration::from_secs(1);
/// How often the modules' file pages read are given back: the pages of the tables
/// in use come back at once, the rest (names looked up once) stay out of the RSS.
const RELEASE_EVERY: Duration = Duration::from_secs(30);
/// Per-sample costs kept for the medians in the stats.
const COSTS_KEPT: usize = 1024;

/// The process (by pid, so a forked child starts over) whose sampler captures native stacks.
static OWNER: AtomicI32 = AtomicI32::new(0);

/// Why native capture cannot run here at all, or None.
pub fn unsupported() -> Option<&'static str> {
    (!cfg!(all(target_os = "linux", target_arch = "x86_64"))).then_some("native frames are read on Linux x86-64 only")
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct NativeStats {
    pub signal: i32,
    /// Why capture stopped, if it did.
    pub off: Option<String>,
    /// Threads asked for their native stack.
    pub asked: u64,
    pub answered: u64,
    /// Asked threads that did not answer in time (blocked the signal, or waited for a CPU).
    pub timed_out: u64,
    /// Threads not asked because an earlier signal to them is still pending.
    pub still_pending: u64,
    /// Threads not asked because they were asleep or in a system call when their turn came.
    pub blocked: u64,
    /// Threads not asked because they blocked since last looked at (see `running.rs`).
    pub blocked_lately: u64,
    /// Threads whose status file is open.
    pub status_files: usize,
    /// Samples merged with their native frames.
    pub merged: u64,
    /// Samples whose halves disagreed: kept with their Python frames only.
    pub mismatched: u64,
    /// Of those, samples whose thread was in another Python frame when signalled than
    /// when its Python frames were read.
    pub moved: u64,
    /// Unwinds that ended where no unwind information led further.
    pub lost_unwinds: u64,
    /// Samples merged only once their stack was scanned past a frame without unwind
    /// information (hand-written assembly: BLAS kernels).
    pub scanned: u64,
    /// Median cost per native thread-sample, in microseconds: signal round trip
    /// (shared by the threads asked together), unwind, and symbols and merge (with
    /// any scan past assembly).
    pub median_us: [f64; 3],
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
    seq: u64,
    modules: Modules,
    listed: Instant,
    released: Instant,
    cache: Box<CacheX86_64>,
    resolver: Resolver,
    copy: FxHashMap<u64, usize>,
    /// Per thread, where its last scan past assembly found the return address that
    /// merged, above the frame it stopped at.
    scanned_at: FxHashMap<u64, u64>,
    running: Running,
    /// Threads whose signal went unanswered and may still be pending.
    unanswered: FxHashSet<u64>,
    costs: VecDeque<[u32; 3]>,
    stats: NativeStats,
    unwound: Vec<NativeFrame>,
    named: Vec<Named>,
    merged: Vec<u64>,
}

/// A thread to capture: its kernel id, Python frame ids and eval runs; the merged
/// stack replaces its frames.
pub struct Wanted<'a> {
    pub tid: u64,
    pub frames: &'a mut Vec<u64>,
    pub evals: Option<&'a [Run]>,
    /// Where its innermost frame pointer lives, and what the Python read found there.
    pub pointer: Option<FramePointer>,
    /// Every wait of the thread seen lately was on a futex (see `running.rs`).
    pub futexes_only: bool,
}

impl Native {
    /// Takes this process's native capture: installs the handler on a free real-time
    /// signal (never one the application handles).
    pub fn start() -> Result<Native, String> {
        if let Some(why) = unsupported() {
            return Err(why.into());
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
            seq: 0,
            modules: Modules::new(),
            listed: Instant::now(),
            released: Instant::now(),
            cache: Box::new(CacheX86_64::new()),
            resolver: Resolver::new(),
            copy: FxHashMap::default(),
            scanned_at: FxHashMap::default(),
            running: Running::default(),
            unanswered: FxHashSet::default(),
            costs: VecDeque::new(),
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

    /// Captures the native stacks of `threads`, merging each into its frames; only
    /// those `running.rs` finds computing are asked.
    pub fn capture(&mut self, threads: &mut [Wanted<'_>]) {
        if self.stats.off.is_some() {
            return;
        }
        if !signal::is_ours(self.signal) {
            self.stats.off = Some(format!(
                "the application put a handler of its own on signal {}: native frames are off",
                self.signal
            ));
            return;
        }
        if self.listed.elapsed() >= LIST_EVERY {
            self.modules.refresh();
            self.listed = Instant::now();
        }
        if self.released.elapsed() >= RELEASE_EVERY {
            self.modules.release();
            self.released = Instant::now();
        }
        for batch in threads.chunks_mut(SLOTS) {
            self.capture_batch(batch);
        }
    }

    /// Forgets what was kept per thread for threads not in `live` (sorted): they exited,
    /// so no signal of ours can still be pending for them.
    pub fn keep_threads(&mut self, live: &[u64]) {
        let alive = |tid: &u64| live.binary_search(tid).is_ok();
        self.running.forget(live, Instant::now());
        self.copy.retain(|tid, _| alive(tid));
        self.scanned_at.retain(|tid, _| alive(tid));
        self.unanswered.retain(alive);
    }

    fn capture_batch(&mut self, batch: &mut [Wanted<'_>]) {
        let started = Instant::now();
        let asked = self.ask(batch, started);
        if asked.is_empty() {
            return;
        }
        wait_for_answers(&asked, started + ANSWER_WITHIN);
        let round_trip = started.elapsed();
        for (s, &(i, seq)) in asked.iter().enumerate() {
            self.take(Slot::at(s), seq, &mut batch[i], round_trip);
        }
    }

    /// Signals the threads of `batch` that may be asked: (index in `batch`, request) per slot.
    fn ask(&mut self, batch: &[Wanted<'_>], now: Instant) -> Vec<(usize, u64)> {
        let mut asked = Vec::with_capacity(batch.len());
        for (i, w) in batch.iter().enumerate() {
            let verdict = self.running.check(w.tid, self.signal, w.futexes_only, now);
            if verdict != Verdict::Pending {
                self.unanswered.remove(&w.tid);
            }
            match verdict {
                Verdict::Ask => {}
                Verdict::Pending => self.stats.still_pending += 1,
                Verdict::Blocked => self.stats.blocked += 1,
                Verdict::BlockedLately => self.stats.blocked_lately += 1,
            }
            if verdict != Verdict::Ask {
                continue;
            }
            if !signal::is_ours(self.signal) {
                break; // the application took the signal since the tick began
            }
            self.seq += 1;
            let slot = Slot::at(asked.len());
            slot.ask(self.seq, self.copy_size(w.tid), w.pointer);
            if signal::send(self.signal, w.tid, asked.len(), self.seq) {
                asked.push((i, self.seq));
            } else {
                slot.release();
            }
        }
        self.stats.asked += asked.len() as u64;
        asked
    }

    /// The answer in `slot` to request `seq`, unwound and merged into `w`'s frames;
    /// an unanswered request is withdrawn and its thread remembered.
    fn take(&mut self, slot: &Slot, seq: u64, w: &mut Wanted<'_>, round_trip: Duration) {
        if !slot.answered(seq) && slot.withdraw(seq) {
            self.stats.timed_out += 1;
            self.unanswered.insert(w.tid);
            return;
        }
        while !slot.answered(seq) {
            std::thread::yield_now(); // the handler is writing: it finishes without blocking
        }
        self.stats.answered += 1;
        let t0 = Instant::now();
        let (regs, stack, pointer) = slot.answer();
        let mut end = unwind(&self.modules.unwinder, &mut self.cache, regs, stack, &mut self.unwound);
        let t1 = Instant::now();
        // A frame pointer that differs: the thread ran on between its Python read and the
        // signal, the halves are of two moments (a frame it returned from would sit
        // above the native callee).
        let moved = w.pointer.is_some_and(|p| pointer != Some(p.seen));
        let copy_end = self.copy_end(w.tid, regs, stack);
        let mut merged = !moved && self.merge_into(w, end, copy_end).is_ok();
        if !moved && !merged && end != End::Cut {
            (end, merged) = self.scan_past_assembly(w, regs, stack, copy_end).unwrap_or((end, false));
        }
        let copied = stack.len();
        slot.release();
        self.after_unwind(w.tid, end, copied, !merged && !moved);
        self.stats.merged += u64::from(merged);
        self.stats.mismatched += u64::from(!merged);
        self.stats.moved += u64::from(moved);
        self.keep_costs([round_trip, t1 - t0, t1.elapsed()].map(|d| d.as_nanos().min(u32::MAX as u128) as u32));
    }

    /// An unwind that stopped short of the eval loops may have met assembly without
    /// unwind information: tries the return addresses above the frame it stopped at,
    /// nearest first, until the halves merge. Stale ones (a stack keeps what earlier
    /// calls left) lead nowhere or to halves that disagree.
    fn scan_past_assembly(
        &mut self,
        w: &mut Wanted<'_>,
        regs: Regs,
        stack: &[u8],
        copy_end: u64,
    ) -> Option<(End, bool)> {
        let (from, kept) = (self.unwound.last()?.sp, self.unwound.len());
        let modules = &mut self.modules;
        // The thread's last scan that merged, first: a kernel called from the same
        // place keeps its caller's return address as far above its stack pointer.
        let last = (self.scanned_at.get(&w.tid))
            .and_then(|&off| Some((from + off, word_at(stack, regs.sp, from + off)?)))
            .filter(|&(_, ra)| modules.after_call(ra));
        let found = return_addresses(regs, stack, from, |a| modules.after_call(a));
        for at in last.into_iter().chain(found.into_iter().filter(|&f| Some(f) != last)) {
            self.unwound.truncate(kept);
            let end = unwind_from(&self.modules.unwinder, &mut self.cache, regs, stack, at, &mut self.unwound);
            if self.merge_into(w, end, copy_end).is_ok() {
                self.stats.scanned += 1;
                self.scanned_at.insert(w.tid, at.0 - from);
                return Some((end, true));
            }
        }
        None
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
    /// into `w`'s, unless the halves disagree.
    fn merge_into(&mut self, w: &mut Wanted<'_>, end: End, copy_end: u64) -> Result<(), Mismatch> {
        self.named.clear();
        for &at in &self.unwound {
            let (id, kind) = self.resolver.resolve(at.pc, &mut self.modules);
            self.named.push(Named { id, kind, at });
        }
        merge(w.frames, w.evals, &self.named, end, copy_end, &mut self.merged)?;
        std::mem::swap(w.frames, &mut self.merged);
        Ok(())
    }

    fn keep_costs(&mut self, costs: [u32; 3]) {
        if self.costs.len() >= COSTS_KEPT {
            self.costs.pop_front();
        }
        self.costs.push_back(costs);
    }

    /// The counters, with the medians of the recent costs.
    pub fn stats(&self) -> NativeStats {
        let mut stats = NativeStats {
            status_files: self.running.open(),
            unknown_addresses: self.resolver.unknown,
            modules: self.modules.stats,
            ..self.stats.clone()
        };
        if !self.costs.is_empty() {
            stats.median_us = [0, 1, 2].map(|k| {
                let mut v: Vec<u32> = self.costs.iter().map(|c| c[k]).collect();
                v.sort_unstable();
                v[v.len() / 2] as f64 / 1000.0
            });
        }
        stats
    }
}

/// Sleeps until every request in `asked` (slot order) is answered, or `deadline`.
fn wait_for_answers(asked: &[(usize, u64)], deadline: Instant) {
    loop {
        let seen = signal::answers();
        let now = Instant::now();
        if asked.iter().enumerate().all(|(s, &(_, seq))| Slot::at(s).answered(seq)) || now >= deadline {
            return;
        }
        signal::wait_for_answer(seen, deadline - now);
    }
}

impl Drop for Native {
    fn drop(&mut self) {
        // A signal still pending would end the process under the default disposition.
        if self.unanswered.is_empty() {
            signal::uninstall(self.signal);
        }
        let _ = OWNER.compare_exchange(std::process::id() as i32, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}
