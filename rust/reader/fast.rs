//! Our own reader: per tick, one read for the thread list and the GIL, one for
//! every sampled thread's live frames, one to check the cached code objects; more
//! only for frames outside the live chunks and for code objects not seen before.

use super::code::{CodeCache, Found, LineMode};
use super::frames::{frame_pointer, read_stacks, walk_copied, RawStack};
use super::frees::FreeLog;
use super::layout::Layout;
use super::memory::{Batch, Memory};
use super::threads::{ThreadState, Threads};
use super::{Copied, FramePointer, Read, Run, StackReader, ThreadStack, Want};
use crate::profile::model::Frame;
use crate::reader::tags::{ReadMarks, ThreadTag, ThreadTags};
use crate::reader::GilAt;
use rustc_hash::{FxHashMap, FxHashSet};
use serde_json::{json, Value};

/// Further reads of a thread whose copy tore, in the same tick.
const RETRIES: usize = 3;

/// Copies of a thread that may have run, taken back to back in one read: two agree
/// for most threads; one running many small calls changes its stack every few hundred
/// nanoseconds, and some consecutive pair of three is likelier to agree.
fn copies(attempt: usize) -> usize {
    if attempt == 0 {
        2
    } else {
        3
    }
}

/// A thread's frame ids, innermost first, and the runs of the eval loop that hold
/// them, innermost run first.
#[derive(Clone, Debug, Default)]
pub struct Ids {
    pub frames: Vec<u64>,
    pub evals: Vec<Run>,
    /// The frame pointer the walk began at.
    pub pointer: u64,
}

/// A thread read: its state, its frame ids (Err: lost) and its marks during the read.
pub struct ReadThread {
    pub state: ThreadState,
    pub frames: Result<Ids, ()>,
    pub marks: ReadMarks,
}

struct Kept {
    frame_ref: u64,
    chunk: u64,
    top: u64,
    ids: Ids,
    epoch: u64,
}

pub struct FastReader {
    layout: Layout,
    mem: Memory,
    batch: Batch,
    round: Batch,
    threads: Threads,
    /// Per thread state: what it looked like at its last read, and the frame ids read.
    last: FxHashMap<u64, Kept>,
    codes: CodeCache,
    mode: LineMode,
    thread_reads: u64,
    /// Reads made again because the thread ran while its frames were copied.
    retried_reads: u64,
    /// Threads read again because their marks changed during a read.
    retried_marks: u64,
    /// Threads that could not be read consistently even then: their samples are lost.
    lost_reads: u64,
    /// Wall ns spent in the thread list and clocks (`StackReader::list_ns`).
    list_ns: u64,
    /// The last read's stacks, and the (idle, gil_only) it asked for: what a read when
    /// nothing else ran gives again.
    last_read: Option<((bool, bool), Vec<ThreadStack>)>,
    /// Reads answered that way.
    quiet_reads: u64,
}

impl FastReader {
    pub fn new(
        layout: Layout,
        mut mem: Memory,
        runtime: u64,
        interp: u64,
        code_type: u64,
        frees: FreeLog,
        mode: LineMode,
    ) -> Result<FastReader, String> {
        let threads = Threads::new(interp, runtime, &layout, &mut mem)?;
        Ok(FastReader {
            layout,
            mem,
            batch: Batch::default(),
            round: Batch::default(),
            threads,
            last: FxHashMap::default(),
            codes: CodeCache::new(code_type, frees),
            mode,
            thread_reads: 0,
            retried_reads: 0,
            retried_marks: 0,
            lost_reads: 0,
            list_ns: 0,
            last_read: None,
            quiet_reads: 0,
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether the GIL was in use at the last read (not on a free-threaded build, unless
    /// something turned it on).
    pub fn gil_enabled(&self) -> bool {
        self.threads.gil_enabled
    }

    pub fn memory(&mut self) -> &mut Memory {
        &mut self.mem
    }

    /// Reads the threads `select` picks; tags are read before the thread states and
    /// after the last copy of their frames, so a tag covers the frame pointer each copy
    /// follows as well as the copy: a pointer read before a task ended and its frame
    /// copied after the next task's tag was set read the old task's popped frame under
    /// the new task's tag (free-threaded 3.13t, 1 sample in ~1,500).
    pub fn read_where(
        &mut self,
        select: impl Fn(&ThreadState) -> bool,
        tags: &ThreadTags,
    ) -> Result<Vec<ReadThread>, String> {
        let marked = tags.snapshot();
        let began = std::time::Instant::now();
        let states = self.threads.read(&self.layout, &mut self.mem, &mut self.batch);
        self.list_ns += began.elapsed().as_nanos() as u64;
        let states = states?;
        for t in states.iter().filter(|t| !t.still) {
            self.last.remove(&t.addr); // it ran: what it held may be gone, read or not
        }
        let mut chosen: Vec<ThreadState> = states.iter().filter(|t| select(t)).cloned().collect();
        if chosen.is_empty() {
            return Ok(Vec::new());
        }
        let idents: Vec<u64> = chosen.iter().map(|t| t.ident).collect();
        // A thread that did not run keeps its frames: its ids from last time still hold.
        let mut frames: Vec<Result<Ids, ()>> = chosen.iter().map(|t| self.unchanged(t).ok_or(())).collect();
        let before: Vec<Option<ThreadTag>> = idents.iter().map(|i| marked.get(i).cloned()).collect();
        self.read_frames(&mut chosen, &mut frames)?;
        let mut after = tags.stable_tags(&before, &idents);
        self.reread_torn_marks(&mut chosen, &mut frames, &mut after, tags)?;
        self.thread_reads += chosen.len() as u64;
        self.lost_reads += frames.iter().filter(|f| f.is_err()).count() as u64;
        let mut out = Vec::with_capacity(chosen.len());
        for ((state, marks), frames) in chosen.into_iter().zip(after).zip(frames) {
            if let Ok(ids) = &frames {
                let epoch = self.codes.epoch;
                self.last.insert(
                    state.addr,
                    Kept { frame_ref: state.frame_ref, chunk: state.chunk, top: state.top, ids: ids.clone(), epoch },
                );
            }
            out.push(ReadThread { state, frames, marks });
        }
        if self.last.len() > 2 * states.len() + 64 {
            let live: FxHashSet<u64> = states.iter().map(|t| t.addr).collect();
            self.last.retain(|addr, _| live.contains(addr));
        }
        Ok(out)
    }

    /// Reads the frames of every thread whose `frames` is still Err. A thread whose
    /// copy tore (it ran while copied) is read again from its current thread state,
    /// up to `RETRIES` times: dropping it would bias the profile against code that
    /// changes its stack often, i.e. code making many small calls.
    fn read_frames(&mut self, threads: &mut [ThreadState], frames: &mut [Result<Ids, ()>]) -> Result<(), String> {
        let mut pending: Vec<usize> = (0..threads.len()).filter(|&i| frames[i].is_err()).collect();
        for attempt in 0..=RETRIES {
            if pending.is_empty() {
                break;
            }
            let mut reading: Vec<ThreadState> = pending.iter().map(|&i| threads[i].clone()).collect();
            if attempt > 0 {
                self.retried_reads += pending.len() as u64;
                Threads::reread(&mut reading, &self.layout, &mut self.mem, &mut self.batch)?;
            }
            // Only a first read may trust `still`: a torn thread ran.
            let copies: Vec<usize> =
                reading.iter().map(|t| if attempt == 0 && t.still { 1 } else { copies(attempt) }).collect();
            let refs: Vec<&ThreadState> = reading.iter().collect();
            let stacks = read_stacks(&refs, &copies, &self.layout, &mut self.mem, &mut self.batch, &mut self.round)?;
            let codes: FxHashSet<u64> = stacks.iter().flatten().flat_map(|s| &s.frames).map(|f| f.code).collect();
            self.codes.refresh(&codes, &self.layout, &mut self.mem, &mut self.batch)?;
            for ((&i, state), raw) in pending.iter().zip(reading).zip(stacks) {
                frames[i] = raw.and_then(|raw| self.frame_ids(&raw));
                threads[i] = state;
            }
            pending.retain(|&i| frames[i].is_err());
        }
        Ok(())
    }

    /// Reads again, up to `RETRIES` times, each thread whose marks changed while its
    /// frames were read: an event loop enters and leaves activities every few
    /// microseconds, and leaving such reads unmarked would bias its profile against the
    /// work that switches most.
    fn reread_torn_marks(
        &mut self,
        threads: &mut [ThreadState],
        frames: &mut [Result<Ids, ()>],
        marks: &mut [ReadMarks],
        tags: &ThreadTags,
    ) -> Result<(), String> {
        for _ in 0..RETRIES {
            let torn: Vec<usize> = (0..threads.len()).filter(|&i| marks[i].is_err() && frames[i].is_ok()).collect();
            if torn.is_empty() {
                break;
            }
            self.retried_marks += torn.len() as u64;
            let idents: Vec<u64> = torn.iter().map(|&i| threads[i].ident).collect();
            let mut again: Vec<ThreadState> = torn.iter().map(|&i| threads[i].clone()).collect();
            let before = tags.versions(&idents);
            Threads::reread(&mut again, &self.layout, &mut self.mem, &mut self.batch)?;
            again.iter_mut().for_each(|t| t.still = false); // it ran: its old frames do not hold
            let mut read = vec![Err(()); torn.len()];
            self.read_frames(&mut again, &mut read)?;
            let now = tags.stable_tags(&before, &idents);
            for (((&i, state), f), m) in torn.iter().zip(again).zip(read).zip(now) {
                (threads[i], frames[i], marks[i]) = (state, f, m);
            }
        }
        Ok(())
    }

    /// When no thread but the sampler ran since the last read and every thread stands
    /// where that read left it, nothing it saw can have changed: its stacks stand, none
    /// of them ran, and those only working then are not kept. False if the last read
    /// asked for other threads, or a thread moved.
    fn reuse_last(&mut self, want: Want, out: &mut Vec<ThreadStack>) -> Result<bool, String> {
        if !self.stands_still(want)? {
            return Ok(false);
        }
        let Some((_, last)) = self.last_read.as_ref() else { return Ok(false) };
        for t in last {
            let in_task = t.marks.as_ref().map_or(true, |m| m.task.is_some());
            if want.keeps(t.runs_python, t.runs_python, in_task) {
                out.push(ThreadStack { active: t.runs_python, cpu_ns: 0, ran: Some(0.0), ..t.clone() });
            }
        }
        Ok(true)
    }

    /// The frame ids read last time, if `t` did not run since and still has the same frames.
    fn unchanged(&self, t: &ThreadState) -> Option<Ids> {
        let k = self.last.get(&t.addr)?;
        let same = (k.frame_ref, k.chunk, k.top, k.epoch) == (t.frame_ref, t.chunk, t.top, self.codes.epoch);
        (t.still && same).then(|| k.ids.clone())
    }

    /// Frame ids of a raw stack; Err if any frame does not hold together.
    fn frame_ids(&mut self, raw: &RawStack) -> Result<Ids, ()> {
        let mut ids = Ids { frames: Vec::with_capacity(raw.frames.len()), evals: Vec::new(), pointer: raw.pointer };
        let mut run = 0;
        for f in &raw.frames {
            let offset = f.instr as i64 - (f.code + self.layout.code_bytecode) as i64;
            // 3.11 and 3.12 start a frame one code unit before its code: not yet running.
            let not_started = offset == -2 && self.layout.version < (3, 13);
            match self.codes.frame_id(f.code, offset, self.mode) {
                Found::Frame(id) if !not_started => {
                    ids.frames.push(id);
                    run += 1;
                }
                Found::Frame(_) | Found::NotCode => {} // NotCode: an entry frame's executable
                Found::Torn => return Err(()),
            }
            if f.entry {
                ids.evals.push(Run { frames: std::mem::take(&mut run), entry: f.shim });
            }
        }
        if run > 0 {
            ids.evals.push(Run { frames: run, entry: 0 });
        }
        Ok(ids)
    }
}

impl StackReader for FastReader {
    fn name(&self) -> &'static str {
        "fast"
    }

    /// The kernel's floor: ticks take 20-150 us (AMD EPYC).
    fn slice_ns(&self) -> u64 {
        100_000
    }

    fn may_stand_still(&self) -> bool {
        self.last_read.is_some() && self.threads.all_still()
    }

    fn stands_still(&mut self, want: Want) -> Result<bool, String> {
        self.mem.check_handler();
        if self.last_read.as_ref().is_none_or(|(asked, _)| *asked != (want.idle, want.gil_only)) {
            return Ok(false);
        }
        let began = std::time::Instant::now();
        let still = self.threads.stood_still(&self.layout, &mut self.mem, &mut self.batch);
        self.list_ns += began.elapsed().as_nanos() as u64;
        if still? {
            self.threads.stand_still();
            self.quiet_reads += 1;
            return Ok(true);
        }
        Ok(false)
    }

    fn read(&mut self, want: Want, tags: &ThreadTags, out: &mut Vec<ThreadStack>) -> Result<Read, String> {
        out.clear();
        if !want.quiet {
            self.mem.check_handler(); // else `stands_still` did
        } else if self.reuse_last(want, out)? {
            return Ok(Read::Again);
        }
        self.last_read = None; // a read that fails leaves nothing to give again
        let in_task = tags.tagged();
        let select = |t: &ThreadState| want.keeps(t.working(), t.runs_python(), in_task.contains(&t.ident));
        for r in self.read_where(select, tags)? {
            let Ok(ids) = r.frames else { continue };
            out.push(ThreadStack {
                ident: r.state.ident,
                name: None,
                frames: ids.frames,
                evals: Some(ids.evals),
                active: r.state.working(),
                holds_gil: r.state.holds_gil,
                runs_python: r.state.runs_python(),
                cpu_ns: r.state.cpu_ns,
                clock_ns: r.state.clock_ns,
                ran: r.state.ran,
                stood: r.state.stood,
                native_tid: Some(r.state.native_tid).filter(|&t| t != 0),
                pointer: Some(frame_pointer(&r.state, &self.layout, ids.pointer)),
                marks: r.marks,
            });
        }
        // Kept only where the next tick may give it again (`may_stand_still`), not
        // cloned stack by stack at every busy tick.
        self.last_read = self.threads.all_still().then(|| ((want.idle, want.gil_only), out.clone()));
        Ok(Read::Fresh)
    }

    /// Only code objects already cached, and read before the copy, name the frames:
    /// refreshing the cache here could begin a new epoch under the ids the read gave.
    /// Where the frees are not known (3.12+), one the tick's read did not check is
    /// checked first (`CodeCache::confirm`).
    fn copied_frames(&mut self, at: &FramePointer, copy: &Copied<'_>) -> Option<(Vec<u64>, Vec<Run>)> {
        let tstate = at.datastack.checked_sub(self.layout.tstate_datastack_chunk)?;
        let base_frame = self.layout.tstate_base_frame.map(|o| tstate + o);
        let raw = walk_copied(copy, base_frame, &self.layout, &mut self.mem, &mut self.round)?;
        let codes: FxHashSet<u64> = raw.frames.iter().map(|f| f.code).collect();
        if !self.codes.confirm(&codes, copy.time_ns, &self.layout, &mut self.mem, &mut self.batch) {
            return None;
        }
        let ids = self.frame_ids(&raw).ok()?;
        Some((ids.frames, ids.evals))
    }

    /// Code objects not cached are fetched now: a thread's own walk saw them alive
    /// (its frames held them) at most a tick ago.
    fn name_stacks(&mut self, stacks: &[&RawStack]) -> Vec<Option<Vec<Frame>>> {
        let codes: FxHashSet<u64> = stacks.iter().flat_map(|s| s.frames.iter().map(|f| f.code)).collect();
        if self.codes.refresh(&codes, &self.layout, &mut self.mem, &mut self.batch).is_err() {
            return vec![None; stacks.len()];
        }
        let mut named = Vec::with_capacity(stacks.len());
        for stack in stacks {
            let ids = self.frame_ids(stack).ok();
            named.push(ids.map(|ids| ids.frames.iter().map(|&id| self.codes.frame(id).clone()).collect()));
        }
        named
    }

    fn frame(&self, id: u64) -> Frame {
        self.codes.frame(id).clone()
    }

    fn epoch(&self) -> u64 {
        self.codes.epoch
    }

    fn python_cpu_ns(&self) -> u64 {
        self.threads.cpu_ns
    }

    fn gil(&self, _stacks: &[ThreadStack]) -> GilAt {
        GilAt::Range(self.threads.gil_range())
    }

    fn live_tids(&self) -> &[u64] {
        &self.threads.live
    }

    fn list_ns(&self) -> u64 {
        self.list_ns
    }

    fn stats(&self) -> Value {
        json!({
            "python": format!("{}.{}", self.layout.version.0, self.layout.version.1),
            "free_threaded": self.layout.free_threaded,
            "gil_enabled": self.threads.gil_enabled,
            "thread_reads": self.thread_reads,
            "retried_reads": self.retried_reads,
            "retried_marks": self.retried_marks,
            "lost_reads": self.lost_reads,
            "syscalls": self.mem.calls,
            "ranges_read": self.mem.ranges,
            "bytes_read": self.mem.bytes,
            "proc_mem_fallback": self.mem.uses_proc_mem(),
            "reads_by": self.mem.method(),
            "thread_list_walks": self.threads.walks,
            "clock_reads": self.threads.clock_reads,
            "quiet_reads": self.quiet_reads,
            "code_objects_reused": self.codes.reused,
            "code_objects_unreadable": self.codes.unreadable,
        })
    }
}
