//! py-spy's library reader: the fallback for interpreters the fast reader does not
//! know, and the oracle it is tested against.

use super::threads::thread_cpu_ns;
use super::{Fallback, Read, Run, StackReader, ThreadStack, Want};
use crate::profile::model::Frame;
use crate::reader::tags::ThreadTags;
use crate::reader::GilAt;
use py_spy::config::{LineNo, LockingStrategy};
use py_spy::{PythonSpy, StackTrace};
use rustc_hash::FxHashMap;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

pub struct PySpyReader {
    spy: PythonSpy,
    /// OS thread id last seen behind each Python thread ident, to notice ident reuse.
    os_tids: HashMap<u64, Option<u64>>,
    /// CPU clock per OS thread at the previous tick.
    clocks: FxHashMap<u64, (u64, Instant)>,
    /// CPU time all Python threads used between the last two reads.
    cpu_ns: u64,
    /// Native ids of the threads of the last read, sorted.
    live: Vec<u64>,
    frames: Vec<Frame>,
    frame_ids: HashMap<Frame, u64>,
    epoch: u64,
    fallback: Option<Fallback>,
}

/// Frames interned by the adapter are forgotten past this many.
const MAX_FRAMES: usize = 500_000;

impl PySpyReader {
    /// Attaches py-spy to this process; `fallback` says why the fast reader is not used.
    pub fn new(lines: bool, function: bool, fallback: Option<Fallback>) -> Result<PySpyReader, String> {
        let config = py_spy::Config {
            // Locking our own process would suspend the sampling thread too.
            blocking: LockingStrategy::NonBlocking,
            // Cached by py-spy; looked up again only for new threads, at most once a second.
            collect_thread_names: true,
            lineno: match (lines, function) {
                (_, true) => LineNo::First,
                (true, false) => LineNo::LastInstruction,
                (false, false) => LineNo::NoLine,
            },
            ..py_spy::Config::default()
        };
        let pid = std::process::id() as py_spy::Pid;
        let spy = PythonSpy::retry_new(pid, &config, 3)
            .map_err(|e| format!("py-spy cannot read this Python process: {e:#}"))?;
        Ok(PySpyReader {
            spy,
            os_tids: HashMap::new(),
            clocks: FxHashMap::default(),
            cpu_ns: 0,
            live: Vec::new(),
            frames: Vec::new(),
            frame_ids: HashMap::new(),
            epoch: 0,
            fallback,
        })
    }

    /// A new thread can get a dead one's ident; py-spy would keep the old name for it.
    fn forget_reused_names(&mut self, traces: &mut [StackTrace], tags: &ThreadTags) {
        if self.os_tids.len() > 4 * traces.len() + 64 {
            let live: HashSet<u64> = traces.iter().map(|t| t.thread_id).collect();
            self.os_tids.retain(|ident, _| live.contains(ident));
            self.clocks.clear();
        }
        for t in traces {
            let native_tid = native_tid(t, tags);
            let previous = self.os_tids.insert(t.thread_id, native_tid);
            if previous.is_some_and(|p| p != native_tid) {
                self.spy.python_thread_names.remove(&t.thread_id);
                t.thread_name = None;
            }
        }
    }

    fn frame_id(&mut self, f: &py_spy::Frame) -> u64 {
        let frame = Frame::python(f.name.clone(), f.filename.clone(), f.line);
        if let Some(&id) = self.frame_ids.get(&frame) {
            return id;
        }
        if self.frames.len() >= MAX_FRAMES {
            self.frames.clear();
            self.frame_ids.clear();
            self.epoch += 1;
        }
        let id = self.frames.len() as u64;
        self.frames.push(frame.clone());
        self.frame_ids.insert(frame, id);
        id
    }

    /// (CPU ns used since the last tick, its share of the wall time since then).
    fn cpu_since_last_tick(&mut self, os_tid: Option<u64>) -> (u64, Option<f64>) {
        let Some(tid) = os_tid else { return (0, None) };
        let Some(cpu) = thread_cpu_ns(tid) else { return (0, None) };
        let now = Instant::now();
        match self.clocks.insert(tid, (cpu, now)) {
            Some((before, at)) => {
                let used = cpu.saturating_sub(before);
                let wall = now.duration_since(at).as_nanos().max(1) as f64;
                (used, Some(used as f64 / wall))
            }
            None => (0, None),
        }
    }
}

impl StackReader for PySpyReader {
    fn name(&self) -> &'static str {
        "pyspy"
    }

    /// Its ticks take ~340 us (AMD EPYC): with a shorter slice a burst on the sampler's
    /// CPU preempted it mid-read and ran on unseen (20-36% of 1 ms bursts seen, 80-94%
    /// with this one).
    fn slice_ns(&self) -> u64 {
        400_000
    }

    fn read(&mut self, want: Want, tags: &ThreadTags, out: &mut Vec<ThreadStack>) -> Result<Read, String> {
        out.clear();
        let before = tags.snapshot();
        let mut traces = self.spy.get_stack_traces().map_err(|e| format!("{e:#}"))?;
        self.forget_reused_names(&mut traces, tags);
        self.cpu_ns = 0;
        self.live.clear();
        for t in &traces {
            let native_tid = native_tid(t, tags);
            self.live.extend(native_tid);
            let (cpu_ns, ran) = self.cpu_since_last_tick(native_tid);
            let stack = ThreadStack {
                ident: t.thread_id,
                name: t.thread_name.clone(),
                frames: Vec::new(),
                evals: None,
                // py-spy's `active` means on a CPU; a thread holding the GIL is working too.
                active: t.active || t.owns_gil,
                holds_gil: t.owns_gil,
                runs_python: t.owns_gil,
                cpu_ns,
                clock_ns: None,
                ran,
                stood: false,
                native_tid,
                pointer: None,
                marks: tags.stable_tag(before.get(&t.thread_id), t.thread_id),
            };
            self.cpu_ns += stack.cpu_ns;
            let in_task = before.get(&t.thread_id).is_some_and(|b| b.marks.task.is_some());
            if want.keeps(stack.active, stack.runs_python, in_task) && !t.frames.is_empty() {
                let frames: Vec<u64> = t.frames.iter().map(|f| self.frame_id(f)).collect();
                // Before 3.11 every Python call ran its own eval loop; after, py-spy does not say.
                let evals = (self.spy.version.minor < 11).then(|| vec![Run { frames: 1, entry: 0 }; frames.len()]);
                out.push(ThreadStack { frames, evals, ..stack });
            }
        }
        self.live.sort_unstable();
        Ok(Read::Fresh)
    }

    fn frame(&self, id: u64) -> Frame {
        self.frames[id as usize].clone()
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn python_cpu_ns(&self) -> u64 {
        self.cpu_ns
    }

    /// py-spy does not say where the GIL is; a thread holds it or none does.
    fn gil(&self, stacks: &[ThreadStack]) -> GilAt {
        GilAt::HeldElsewhere(stacks.iter().any(|s| s.holds_gil))
    }

    fn live_tids(&self) -> &[u64] {
        &self.live
    }

    fn stats(&self) -> Value {
        let (reason, expected) = self.fallback.as_ref().map(|f| (&f.reason, f.expected)).unzip();
        json!({"fallback_reason": reason, "fallback_expected": expected.unwrap_or(false)})
    }
}

/// py-spy reads no native id on 3.9 and 3.10; Python told us each thread's as it
/// started (and forgets it as it ends).
fn native_tid(t: &StackTrace, tags: &ThreadTags) -> Option<u64> {
    t.os_thread_id.or_else(|| tags.native_id(t.thread_id))
}
