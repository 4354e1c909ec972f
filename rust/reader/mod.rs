//! Readers of this process's Python stacks, both working without the GIL.
//!
//! `fast` is our own: it copies each thread's live frames in one read and caches
//! code objects. `pyspy` is py-spy's library reader: ~8 syscalls per frame, but it
//! knows every CPython it supports; it is the fallback and the tests' oracle.

mod check;
mod code;
mod fast;
mod frames;
mod frees;
mod guarded;
mod layout;
mod linetable;
mod memory;
pub mod native;
mod own;
mod pyspy;
pub mod tags;
mod threads;

use check::open_fast;
pub use code::LineMode;
pub use fast::FastReader;
pub use frames::RawStack;
pub use own::OwnFrames;
pub use pyspy::PySpyReader;
pub use threads::{clock_ns, thread_cpu_ns};

use crate::error::Error;
use crate::profile::model::Frame;
use serde_json::Value;
use std::ops::Range;
use tags::{ReadMarks, ThreadTags};

/// Which threads a tick reads.
#[derive(Clone, Copy, Debug)]
pub struct Want {
    /// Waiting threads too (idle samples, live dumps).
    pub idle: bool,
    /// Only threads running Python: the one holding the GIL, or on a free-threaded
    /// build every thread attached to the interpreter.
    pub gil_only: bool,
    /// The process's clock says no thread but the sampler used CPU since the last read:
    /// if every thread also stands where that read left it, the read can be given again.
    pub quiet: bool,
}

impl Want {
    /// A thread working (on a CPU or holding the GIL), or running a task, or else
    /// waiting, as these options ask. A task's waits are its wall time: a task
    /// blocked on I/O is kept, so it shows as wall time without CPU.
    pub fn keeps(&self, active: bool, runs_python: bool, in_task: bool) -> bool {
        (active || in_task || self.idle) && (runs_python || !self.gil_only)
    }
}

/// One run of the interpreter's eval loop in a thread's stack: how many of the
/// thread's Python frames it holds, and where its entry frame lies on the C stack,
/// inside the eval loop's own native frame (0 where the version has none: 3.9-3.11).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Run {
    pub frames: u32,
    pub entry: u64,
}

/// Where a thread's innermost Python frame pointer lives: the word at `at` (in its
/// thread state) or, with `via`, the word at that offset in the struct `at` points to
/// (3.11 and 3.12 keep it in a struct on the thread's C stack); `seen` is what a read
/// found there. Native capture walks the frames its signal copied from there, or
/// else merges its stack only with a read that saw the pointer its signal saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FramePointer {
    pub at: u64,
    pub via: Option<u64>,
    pub seen: u64,
    /// Where its thread state keeps its live datastack chunk, and after it the
    /// chunk's top (0: unknown).
    pub datastack: u64,
}

/// A thread's Python frames as a signal handler copied them, in one instant: its
/// innermost frame pointer, the top of its live datastack chunk, and its C stack
/// (where 3.12+ keep each eval loop's entry frame), each as (address, bytes).
pub struct Copied<'a> {
    pub pointer: u64,
    pub chunk: (u64, &'a [u8]),
    pub stack: (u64, &'a [u8]),
    /// When the signal copied them (CLOCK_MONOTONIC ns).
    pub time_ns: u64,
}

/// One thread's stack at one tick.
#[derive(Clone, Debug)]
pub struct ThreadStack {
    pub ident: u64,
    pub name: Option<String>,
    /// Frame ids of the reader (see `StackReader::frame`), innermost first.
    pub frames: Vec<u64>,
    /// The runs of the interpreter's eval loop that hold `frames`, innermost first
    /// (native stacks are merged there); None where the reader cannot tell.
    pub evals: Option<Vec<Run>>,
    /// On a CPU or holding the GIL.
    pub active: bool,
    pub holds_gil: bool,
    /// Holds the GIL, or on a free-threaded build is attached to the interpreter.
    pub runs_python: bool,
    /// CPU time the thread used since the previous tick.
    pub cpu_ns: u64,
    /// Its CPU clock at this read, where read.
    pub clock_ns: Option<u64>,
    /// The share of the wall time since the previous tick the thread was on a CPU;
    /// None where the reader does not know it.
    pub ran: Option<f64>,
    /// Held no GIL, used little CPU and its innermost frame stood at one instruction
    /// since the previous tick: it ran no Python meanwhile, as far as its position
    /// tells (false where the reader cannot tell).
    pub stood: bool,
    /// The kernel's id of the thread, for its `/proc/self/task` files.
    pub native_tid: Option<u64>,
    /// Where its innermost frame pointer lives and what the read found there; None
    /// where the reader cannot tell.
    pub pointer: Option<FramePointer>,
    /// The task or activity the thread was in during the read.
    pub marks: ReadMarks,
}

/// Where the GIL is, to tell its waits from other locks'.
pub enum GilAt {
    /// The bytes of the GIL's state: its condition variables and mutexes.
    Range(Range<u64>),
    /// Unknown (py-spy's reader): a futex wait counts as the GIL's while another thread holds it.
    HeldElsewhere(bool),
}

/// What a read gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    Fresh,
    /// Nothing ran since the last read (asked for the same threads): its stacks again.
    Again,
}

pub trait StackReader {
    /// "fast" or "pyspy".
    fn name(&self) -> &'static str;
    /// Whether nothing ran since the last read, which asked for the same threads, and
    /// every thread stands where it left them (asked when the process's clock says
    /// no other thread used CPU): that read's stacks hold now.
    fn stands_still(&mut self, _want: Want) -> Result<bool, String> {
        Ok(false)
    }
    /// Whether `stands_still` may say yes at the next tick: every thread stood still
    /// at the last read. Where not, a tick needs no process clock to tell it is quiet.
    fn may_stand_still(&self) -> bool {
        false
    }
    /// Reads the stacks `want` asks for into `out`; Err when the whole tick failed.
    fn read(&mut self, want: Want, tags: &ThreadTags, out: &mut Vec<ThreadStack>) -> Result<Read, String>;
    /// The frame ids and eval runs of a thread whose frames `at` says where, walked
    /// from a signal's copy; None where the reader cannot walk it (a frame torn, or
    /// a code object not cached).
    fn copied_frames(&mut self, _at: &FramePointer, _copy: &Copied<'_>) -> Option<(Vec<u64>, Vec<Run>)> {
        None
    }
    /// The Python frames of stacks a thread walked itself (`OwnFrames`), each as
    /// `frame` names them, innermost first; None for one this reader cannot name.
    fn name_stacks(&mut self, stacks: &[&RawStack]) -> Vec<Option<Vec<Frame>>> {
        vec![None; stacks.len()]
    }
    /// The frame behind an id this reader handed out.
    fn frame(&self, id: u64) -> Frame;
    /// Changes when earlier frame ids may mean other frames.
    fn epoch(&self) -> u64;
    /// Counters for the sampler's stats.
    fn stats(&self) -> Value;
    /// CPU time all Python threads used in the last read, sampled or not.
    fn python_cpu_ns(&self) -> u64;
    /// Where the GIL is, given the threads of the last read.
    fn gil(&self, stacks: &[ThreadStack]) -> GilAt;
    /// Native ids of every thread of the last read, sampled or not, sorted: the live
    /// ones, whose files the sampler may keep open.
    fn live_tids(&self) -> &[u64];
    /// Wall ns spent reading the thread list and the threads' clocks, over all reads.
    fn list_ns(&self) -> u64 {
        0
    }
    /// The scheduler slice a tick with this reader needs (see `priority::short_slice`).
    fn slice_ns(&self) -> u64;
}

/// The reader a sampler was asked for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReaderChoice {
    Auto,
    Fast,
    Pyspy,
}

impl std::str::FromStr for ReaderChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let names = [("auto", ReaderChoice::Auto), ("fast", ReaderChoice::Fast), ("pyspy", ReaderChoice::Pyspy)];
        crate::names::choose("reader", s, &names)
    }
}

/// What `start` settled on, checked with the GIL held; py-spy's reader is made in
/// the sampling thread (it cannot move between threads).
pub enum Chosen {
    Fast(Box<FastReader>),
    PySpy { fallback: Option<Fallback> },
}

impl Chosen {
    /// A walker of a thread's own frames, where this reader can name what it walks.
    pub fn own_frames(&self) -> Option<OwnFrames> {
        match self {
            Chosen::Fast(r) => Some(OwnFrames::new(r.layout().clone())),
            Chosen::PySpy { .. } => None,
        }
    }
}

/// Why py-spy's reader runs where `auto` was asked for; `expected` where it is this
/// interpreter's reader by design (3.9 and 3.10, which the fast reader never reads),
/// not a failure.
pub struct Fallback {
    pub reason: String,
    pub expected: bool,
}

/// The reader for `choice`, opened (and self-checked) with the GIL held. py-spy's
/// reader does not read free-threaded builds, so there it is no fallback.
pub fn choose(py: pyo3::Python<'_>, choice: ReaderChoice, mode: LineMode) -> Result<Chosen, Error> {
    let no_pyspy = free_threaded(py).then_some("py-spy's reader does not read free-threaded (no-GIL) builds");
    match (choice, no_pyspy) {
        (ReaderChoice::Pyspy, Some(why)) => Err(Error::Broken(format!("reader='pyspy' cannot be used: {why}"))),
        (ReaderChoice::Pyspy, None) => Ok(Chosen::PySpy { fallback: None }),
        (ReaderChoice::Fast, _) => open_fast(py, mode)
            .map(|r| Chosen::Fast(Box::new(r)))
            .map_err(|e| Error::Broken(format!("reader='fast' cannot be used: {e}"))),
        (ReaderChoice::Auto, _) => match (open_fast(py, mode), no_pyspy) {
            (Ok(r), _) => Ok(Chosen::Fast(Box::new(r))),
            (Err(e), Some(why)) => Err(Error::Broken(format!("no reader reads this interpreter: {e}; {why}"))),
            (Err(reason), None) => {
                Ok(Chosen::PySpy { fallback: Some(Fallback { reason, expected: py.version_info() < (3, 11) }) })
            }
        },
    }
}

/// Whether this interpreter is a free-threaded build (whether or not its GIL is on).
pub fn free_threaded(py: pyo3::Python<'_>) -> bool {
    use pyo3::types::PyAnyMethods;
    let flag = py.import("sysconfig").and_then(|s| s.call_method1("get_config_var", ("Py_GIL_DISABLED",)));
    flag.and_then(|f| f.is_truthy()).unwrap_or(false)
}
