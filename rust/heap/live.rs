//! The sampled blocks still held, and per task prefix the bytes allocated, in use and
//! in use at most. A sampled block stands for `S / (1 - e^(-S/R))` bytes held (S its
//! size, R the mean distance between samples): the chance a block of S bytes is
//! sampled is `1 - e^(-S/R)`, so the sum over held sampled blocks is unbiased.
//!
//! Each sampled block is also charged to its site (`sites.rs`): its task prefix and
//! the Python stack that allocated it.
//!
//! arrow's pool has no hooks: its growth between two readings of its total is charged
//! to the tasks running in between, split evenly by thread (outside tasks where none
//! ran); a fall shrinks each prefix's share in proportion, since who freed is unknown.
//!
//! A free reads `filter` first: nearly all are of blocks never sampled.

use super::countdown;
use super::filter;
use super::sites::{SiteRow, Sites};
use crate::profile::model::Frame;
use crate::reader::{OwnFrames, RawStack};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::cell::{Cell, UnsafeCell};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Once};

/// Sampled blocks kept at most; past it, samples are dropped and counted.
const MAX_BLOCKS: usize = 1 << 16;

static TRACKING: AtomicBool = AtomicBool::new(false);
/// Counts starts: a thread's `TASK` set under an earlier one is not this one's.
static STARTS: AtomicU32 = AtomicU32::new(0);
static HELD: Shared = Shared { locked: AtomicBool::new(false), held: UnsafeCell::new(None) };
/// Set as a site waits to be named: the sampling thread takes the lock only then.
static TO_NAME: AtomicBool = AtomicBool::new(false);
/// Set in a forked child: what the parent counted may have been torn by the fork.
static FORKED: AtomicBool = AtomicBool::new(false);

/// The sampled blocks and totals, behind a lock a forked child can take back: a task
/// that forks (multiprocessing) while another thread holds it must not hang its child.
/// Held for microseconds, by sampled allocations and frees only.
struct Shared {
    locked: AtomicBool,
    held: UnsafeCell<Option<Held>>,
}

// SAFETY: `held` is only reached through `with_held`, under `locked`.
unsafe impl Sync for Shared {}

fn with_held<T>(f: impl FnOnce(&mut Option<Held>) -> T) -> T {
    while HELD.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        std::thread::yield_now();
    }
    // SAFETY: this thread holds the lock.
    let out = f(unsafe { &mut *HELD.held.get() });
    HELD.locked.store(false, Ordering::Release);
    out
}

/// In a forked child: stop counting, forget which blocks were sampled (frees then take
/// no lock), and take the lock back; what the parent counted is never read or dropped.
extern "C" fn in_child() {
    TRACKING.store(false, Ordering::Relaxed);
    FORKED.store(true, Ordering::Relaxed);
    filter::clear();
    HELD.locked.store(false, Ordering::Release);
}

thread_local! {
    /// The prefix id of the task this thread runs (0: none), and the start of tracking
    /// it was set under. Const-initialised and without a destructor, so a hook called
    /// while the thread exits still reads it.
    static TASK: Cell<(u32, u32)> = const { Cell::new((0, 0)) };
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Totals {
    pub allocated: f64,
    pub in_use: f64,
    pub peak: f64,
    /// The most in use since the last `read_second`.
    #[serde(skip)]
    recent_peak: f64,
    /// Of `allocated` and `in_use`, what arrow's pool grew by while the prefix ran.
    #[serde(skip)]
    pub arrow_allocated: f64,
    #[serde(skip)]
    pub arrow_in_use: f64,
    /// Changed since the last `read_second`.
    #[serde(skip)]
    changed: bool,
}

impl Totals {
    pub fn new(allocated: f64, in_use: f64, peak: f64) -> Totals {
        Totals { allocated, in_use, peak, ..Totals::default() }
    }

    /// `allocated` bytes more were allocated, and what is in use changed by `held`.
    fn hold(&mut self, allocated: f64, held: f64) {
        self.allocated += allocated;
        self.in_use = (self.in_use + held).max(0.0);
        self.peak = self.peak.max(self.in_use);
        self.recent_peak = self.recent_peak.max(self.in_use);
    }
}

/// A prefix's totals as a second's read found them, where they changed since the last:
/// allocated so far, in use now, and the most in use since the last read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Change {
    pub prefix: u32,
    pub allocated: f64,
    pub in_use: f32,
    pub peak: f32,
}

/// What the sampling thread reads once a second while tracking: the bytes in use by
/// prefix for the series' chart, and the prefixes whose totals changed, with the start
/// of tracking their ids belong to.
pub struct SecondRead {
    pub in_use: Box<[(u32, f32)]>,
    pub start: u32,
    pub changes: Box<[Change]>,
}

struct Block {
    held_bytes: f64,
    /// The objects the block stands for: `held_bytes` over its size.
    objects: f64,
    prefix: u32,
    site: u32,
}

#[derive(Default)]
struct Held {
    blocks: FxHashMap<usize, Block>,
    /// Prefix names by id - 1, and ids by name.
    names: Vec<Arc<str>>,
    ids: FxHashMap<Arc<str>, u32>,
    /// By prefix id; 0 is "no task".
    totals: Vec<Totals>,
    dropped: u64,
    /// Tasks whose numpy handler could not be set.
    numpy_failures: u64,
    /// The prefix ids of the tasks running, by thread (`pthread_self`): those running
    /// when tracking started, then as threads set their tasks.
    running: FxHashMap<u64, u32>,
    /// arrow's total at its last reading.
    arrow_read: Option<f64>,
    sites: Sites,
    may_hold: filter::Counts,
    /// Prefix ids whose totals changed since the last `read_second`.
    changed: Vec<u32>,
}

impl Held {
    /// The id of `prefix`, a new one if it is new.
    fn id(&mut self, prefix: &str) -> u32 {
        if let Some(&id) = self.ids.get(prefix) {
            return id;
        }
        let name: Arc<str> = prefix.into();
        self.names.push(name.clone());
        let id = self.names.len() as u32;
        self.ids.insert(name, id);
        id
    }

    /// The prefix id of the task the calling thread runs: one whose task was set under
    /// an earlier start runs what `running` says.
    fn running_task(&self) -> u32 {
        // SAFETY: no preconditions.
        let ident = unsafe { nix::libc::pthread_self() } as u64;
        self.running.get(&ident).copied().unwrap_or(0)
    }

    fn totals(&mut self, prefix: u32) -> &mut Totals {
        let i = prefix as usize;
        if self.totals.len() <= i {
            self.totals.resize(i + 1, Totals::default());
        }
        &mut self.totals[i]
    }

    /// The totals of `prefix`, about to change: listed for the next `read_second`.
    fn changing(&mut self, prefix: u32) -> &mut Totals {
        if !self.totals(prefix).changed {
            self.changed.push(prefix);
        }
        let t = self.totals(prefix);
        t.changed = true;
        t
    }

    fn add(&mut self, addr: usize, block: Block, allocated: f64) {
        self.changing(block.prefix).hold(allocated, block.held_bytes);
        self.sites.add(block.site, allocated, block.held_bytes, block.objects);
        self.may_hold.add(addr);
        self.blocks.insert(addr, block);
    }

    /// arrow's pool holds `total` bytes now (see the module's notes).
    fn read_arrow(&mut self, total: f64) {
        let Some(last) = self.arrow_read.replace(total) else { return };
        if total > last {
            let mut running: Vec<u32> = self.running.values().copied().collect();
            if running.is_empty() {
                running.push(0);
            }
            let share = (total - last) / running.len() as f64;
            for prefix in running {
                let t = self.changing(prefix);
                t.hold(share, share);
                (t.arrow_allocated, t.arrow_in_use) = (t.arrow_allocated + share, t.arrow_in_use + share);
            }
        } else if total < last {
            let held: f64 = self.totals.iter().map(|t| t.arrow_in_use).sum();
            let kept = (1.0 - (last - total) / held).max(0.0);
            for prefix in 0..self.totals.len() as u32 {
                let fall = self.totals[prefix as usize].arrow_in_use * (1.0 - kept);
                if fall > 0.0 {
                    let t = self.changing(prefix);
                    t.hold(0.0, -fall);
                    t.arrow_in_use -= fall;
                }
            }
        }
    }

    fn remove(&mut self, addr: usize) -> Option<Block> {
        let block = self.blocks.remove(&addr)?;
        self.may_hold.remove(addr);
        self.changing(block.prefix).hold(0.0, -block.held_bytes);
        self.sites.remove(block.site, block.held_bytes, block.objects);
        Some(block)
    }
}

/// Starts tracking from nothing: blocks sampled before are forgotten. `running`: the
/// tasks running now (thread ident, prefix), whose allocations are theirs until their
/// threads start or end a task; `walker`: walks an allocating thread's stack; `arrow`:
/// arrow's total now, from which its growth is charged.
pub fn start<'a>(
    mean_bytes: u64,
    running: impl IntoIterator<Item = (u64, &'a str)>,
    walker: Option<OwnFrames>,
    arrow: Option<u64>,
) {
    static AT_FORK: Once = Once::new();
    // SAFETY: registers a handler that only stores atomics.
    AT_FORK.call_once(|| _ = unsafe { nix::libc::pthread_atfork(None, None, Some(in_child)) });
    countdown::set_mean(mean_bytes);
    let mut fresh = Held::default();
    fresh.running = running.into_iter().map(|(ident, prefix)| (ident, fresh.id(prefix))).collect();
    fresh.sites = Sites::new(walker);
    fresh.arrow_read = arrow.map(|total| total as f64);
    with_held(|held| {
        filter::clear();
        let before = held.replace(fresh);
        if FORKED.swap(false, Ordering::Relaxed) {
            std::mem::forget(before); // perhaps torn by the fork
        }
        STARTS.fetch_add(1, Ordering::Relaxed);
    });
    TRACKING.store(true, Ordering::Release);
}

/// Stops counting; the totals stay readable until the next start.
pub fn stop() {
    TRACKING.store(false, Ordering::Release);
    // The walker holds the fast reader's fault handler, which goes with the sampler.
    with_held(|held| held.as_mut().map(|held| held.sites.stop_walking()));
}

pub fn tracking() -> bool {
    TRACKING.load(Ordering::Relaxed)
}

/// The calling thread runs a task of `prefix` from now (None: no task); `arrow`:
/// arrow's total now, where pyarrow is imported.
pub fn set_task(prefix: Option<&str>, arrow: Option<u64>) {
    // SAFETY: no preconditions.
    let me = unsafe { nix::libc::pthread_self() } as u64;
    let id = with_held(|held| {
        let Some(held) = held.as_mut() else { return 0 };
        if let Some(total) = arrow {
            held.read_arrow(total as f64); // the tasks running until now grew it
        }
        let id = prefix.map_or(0, |p| held.id(p));
        _ = if id == 0 { held.running.remove(&me) } else { held.running.insert(me, id) };
        id
    });
    _ = TASK.try_with(|t| t.set((STARTS.load(Ordering::Relaxed), id)));
}

/// arrow's pool holds `total` bytes now.
pub fn read_arrow(total: u64) {
    if tracking() {
        with_held(|held| held.as_mut().map(|held| held.read_arrow(total as f64)));
    }
}

/// `size` bytes were allocated at `addr` by this thread (`UNDER_GIL`: see `countdown`).
#[inline(always)]
pub fn allocated<const UNDER_GIL: bool>(addr: usize, size: usize) {
    if !tracking() {
        return;
    }
    if let Some(counted) = countdown::take::<UNDER_GIL>(size) {
        sampled(addr, size, counted);
    }
}

#[cold]
#[inline(never)]
fn sampled(addr: usize, size: usize, counted: u64) {
    let (set_under, task) = TASK.try_with(Cell::get).unwrap_or_default();
    let mean = countdown::mean() as f64;
    let chance = -(-(size as f64) / mean).exp_m1();
    let held_bytes = if chance > 0.0 { size as f64 / chance } else { mean };
    with_held(|held| {
        let Some(held) = held.as_mut() else { return };
        let starts = STARTS.load(Ordering::Relaxed);
        let prefix = if set_under == starts { task } else { held.running_task() };
        _ = TASK.try_with(|t| t.set((starts, prefix)));
        if held.blocks.len() >= MAX_BLOCKS {
            held.dropped += 1;
            held.changing(prefix).allocated += counted as f64;
            return;
        }
        let site = held.sites.here(prefix);
        if held.sites.waiting() {
            TO_NAME.store(true, Ordering::Relaxed);
        }
        let block = Block { held_bytes, objects: held_bytes / size.max(1) as f64, prefix, site };
        held.add(addr, block, counted as f64);
    })
}

/// The block at `addr` is about to be freed (or moved by `realloc`): called before the
/// allocator's own free, so that no other thread can have been given `addr` yet.
#[inline]
pub fn freeing(addr: usize) -> Option<Taken> {
    if !filter::may_hold(addr) {
        return None;
    }
    take(addr)
}

/// A sampled block taken out of the table, to put back if a `realloc` fails.
pub struct Taken {
    addr: usize,
    block: Block,
}

#[cold]
#[inline(never)]
fn take(addr: usize) -> Option<Taken> {
    let block = with_held(|held| held.as_mut()?.remove(addr))?;
    Some(Taken { addr, block })
}

/// A `realloc` of the block at `addr` (null: none) to `size` bytes, made by `call`, which
/// returns the new block and whether it is to be counted. The old block leaves the table
/// first; a failed call leaves it where it was (unless asked for 0 bytes, which freed it).
pub fn reallocated(addr: *mut c_void, size: usize, call: impl FnOnce() -> (*mut c_void, bool)) -> *mut c_void {
    let taken = if addr.is_null() { None } else { freeing(addr as usize) };
    let (moved, counts) = call();
    if moved.is_null() {
        if let Some(taken) = taken.filter(|_| size != 0) {
            with_held(|held| held.as_mut().map(|held| held.add(taken.addr, taken.block, 0.0)));
        }
    } else if counts {
        allocated::<false>(moved as usize, size);
    }
    moved
}

pub fn count_numpy_failure() {
    with_held(|held| held.as_mut().map(|held| held.numpy_failures += 1));
}

/// The sites whose stacks wait to be named, each with its stack (taken out), and the
/// start of tracking they belong to.
pub fn unnamed() -> (u32, Vec<(u32, RawStack)>) {
    if !TO_NAME.swap(false, Ordering::Relaxed) {
        return (STARTS.load(Ordering::Relaxed), Vec::new()); // the lock untaken, tick after tick
    }
    with_held(|held| {
        let starts = STARTS.load(Ordering::Relaxed);
        let Some(held) = held.as_mut() else { return (starts, Vec::new()) };
        (starts, held.sites.take_unnamed())
    })
}

/// Names the sites `unnamed` gave under `start`, frames innermost first (None: they
/// could not be named); ignored where tracking started again since.
pub fn name(start: u32, named: impl IntoIterator<Item = (u32, Option<Vec<Frame>>)>) {
    with_held(|held| {
        let Some(held) = held.as_mut().filter(|_| STARTS.load(Ordering::Relaxed) == start) else { return };
        held.sites.name(named);
    })
}

/// One task prefix's totals (`prefix` None: outside tasks).
#[derive(Debug, Serialize)]
pub struct PrefixTotals {
    pub prefix: Option<Arc<str>>,
    #[serde(flatten)]
    pub totals: Totals,
}

/// What was counted since the last start (prefixes: in `window` where one is given).
#[derive(Debug, Default, Serialize)]
pub struct Counted {
    pub prefixes: Vec<PrefixTotals>,
    /// The window `prefixes` cover, in Unix seconds (None: since tracking started).
    pub window: Option<(f64, f64)>,
    /// Samples dropped at the cap of sampled blocks.
    pub dropped: u64,
    pub numpy_failures: u64,
    pub mean_bytes: u64,
    pub tracking: bool,
    /// Sampled blocks by site (see `Sites::rows`).
    pub sites: Vec<SiteRow>,
}

/// What was counted, with at most `most_sites` sites apart.
pub fn counted(most_sites: usize) -> Counted {
    if FORKED.load(Ordering::Relaxed) {
        return Counted::default();
    }
    with_held(|held| {
        let Some(held) = held.as_ref() else { return Counted::default() };
        let name = |id: usize| (id > 0).then(|| held.names[id - 1].clone());
        let totals = held.totals.iter().enumerate().filter(|(_, t)| t.allocated > 0.0);
        let totals = totals.map(|(i, t)| PrefixTotals { prefix: name(i), totals: *t });
        Counted {
            prefixes: totals.collect(),
            window: None,
            dropped: held.dropped,
            numpy_failures: held.numpy_failures,
            mean_bytes: countdown::mean(),
            tracking: tracking(),
            sites: held.sites.rows(most_sites, &held.totals, |id| name(id as usize)),
        }
    })
}

/// Prefixes a second of the series keeps apart, at most; the rest are summed as `OTHER`.
const MOST_PREFIXES: usize = 8;
/// The prefix id standing for the prefixes past `MOST_PREFIXES`.
pub const OTHER: u32 = u32::MAX;

/// The second's read (None while not tracking): bytes in use by prefix id, largest
/// first, at most `MOST_PREFIXES` (the rest summed as `OTHER`); and the changed totals.
pub fn read_second() -> Option<SecondRead> {
    if !tracking() {
        return None;
    }
    let (mut in_use, changes) = with_held(|held| {
        let held = held.as_mut()?;
        let in_use: Vec<(u32, f32)> = (held.totals.iter().enumerate())
            .filter(|(_, t)| t.in_use > 0.0)
            .map(|(i, t)| (i as u32, t.in_use as f32))
            .collect();
        let changed = std::mem::take(&mut held.changed);
        let changes = changed.into_iter().map(|prefix| {
            let t = held.totals(prefix);
            let change = Change { prefix, allocated: t.allocated, in_use: t.in_use as f32, peak: t.recent_peak as f32 };
            (t.recent_peak, t.changed) = (t.in_use, false);
            change
        });
        Some((in_use, changes.collect()))
    })?;
    in_use.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
    if in_use.len() > MOST_PREFIXES {
        let rest: f32 = in_use.drain(MOST_PREFIXES - 1..).map(|(_, bytes)| bytes).sum();
        in_use.push((OTHER, rest));
    }
    Some(SecondRead { in_use: in_use.into_boxed_slice(), start: STARTS.load(Ordering::Relaxed), changes })
}

/// Every prefix's totals now, as changes, with the start they belong to (None while
/// nothing was counted since a start): the end of a window that reaches the present.
pub fn now() -> Option<(u32, Vec<Change>)> {
    with_held(|held| {
        let held = held.as_ref()?;
        let totals = held.totals.iter().enumerate().filter(|(_, t)| t.allocated > 0.0);
        let changes = totals.map(|(i, t)| Change {
            prefix: i as u32,
            allocated: t.allocated,
            in_use: t.in_use as f32,
            peak: t.recent_peak as f32,
        });
        Some((STARTS.load(Ordering::Relaxed), changes.collect()))
    })
}

/// The name of prefix id `id` (None: outside tasks, or not known since a restart).
pub fn prefix_name(id: u32) -> Option<Arc<str>> {
    let i = (id as usize).checked_sub(1)?;
    with_held(|held| held.as_ref()?.names.get(i).cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_bytes_follow_allocations_and_frees_by_prefix() {
        std::thread::spawn(|| {
            // SAFETY: no preconditions.
            let me = unsafe { nix::libc::pthread_self() } as u64;
            // Blocks of 128 times the mean: every one is sampled, and stands for itself.
            const SIZE: usize = 64 << 20;
            start(countdown::MEAN_BYTES, [(me, "early"), (me + 1, "elsewhere")], None, None);
            allocated::<false>(1 << 20, SIZE); // a task running since before the start
            set_task(Some("load"), None);
            let blocks: Vec<usize> = (1..=100).map(|i| i << 32).collect();
            blocks.iter().for_each(|&b| allocated::<false>(b, SIZE));
            set_task(None, None);
            blocks[..60].iter().for_each(|&b| assert!(freeing(b).is_some()));
            assert!(freeing(blocks[0]).is_none(), "a block is freed once");
            assert!(freeing(12345 << 32).is_none(), "never sampled");
            let Counted { prefixes: totals, dropped, .. } = counted(0);
            let of = |prefix: &str| totals.iter().find(|p| p.prefix.as_deref() == Some(prefix)).map(|p| p.totals);
            assert_eq!(of("early").map(|t| t.in_use), Some(SIZE as f64), "charged to the task running at the start");
            assert_eq!(of("elsewhere"), None, "another thread's");
            let load = of("load").unwrap();
            let close = |a: f64, b: f64| (a / b - 1.0).abs() < 0.02;
            assert!(close(load.allocated, 100.0 * SIZE as f64), "{load:?}");
            assert!(close(load.in_use, 40.0 * SIZE as f64), "{load:?}");
            assert!(close(load.peak, 100.0 * SIZE as f64), "{load:?}");
            assert_eq!(dropped, 0);
            stop();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn arrow_growth_is_charged_to_the_tasks_running_and_falls_in_proportion() {
        let mut held = Held::default();
        let (load, join) = (held.id("load"), held.id("join"));
        held.read_arrow(100.0); // what the pool held before: no one's
        held.running.insert(1, load);
        held.read_arrow(160.0);
        held.running.insert(2, join);
        held.read_arrow(200.0); // two threads ran: half each
        held.running.clear();
        held.read_arrow(230.0); // outside tasks
        let arrow =
            |held: &Held, p: u32| (held.totals[p as usize].arrow_allocated, held.totals[p as usize].arrow_in_use);
        assert_eq!(arrow(&held, load), (80.0, 80.0));
        assert_eq!(arrow(&held, join), (20.0, 20.0));
        assert_eq!(arrow(&held, 0), (30.0, 30.0));
        held.read_arrow(165.0); // half of what was charged is freed, by whoever
        assert_eq!(arrow(&held, load), (80.0, 40.0));
        assert_eq!(held.totals[load as usize].in_use, 40.0);
        assert_eq!(held.totals[load as usize].peak, 80.0);
        assert_eq!(arrow(&held, 0), (30.0, 15.0));
    }
}
