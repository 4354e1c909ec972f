//! Our own reader: per tick, one read for the thread list and the GIL, one for
//! every sampled thread's live frames, one to check the cached code objects; more
//! only for frames outside the live chunks and for code objects not seen before.

use super::code::{CodeCache, Found, LineMode};
use super::frames::{read_stacks, RawFrame};
use super::layout::Layout;
use super::memory::{Batch, Memory};
use super::threads::{ThreadState, Threads};
use super::{StackReader, ThreadStack, Want};
use crate::model::{Frame, Tag};
use crate::tags::ThreadTags;
use rustc_hash::FxHashSet;
use serde_json::{json, Value};
use std::sync::Arc;

/// A thread read: its state, its frame ids (Err: torn) and its task during the read.
pub struct ReadThread {
    pub state: ThreadState,
    pub frames: Result<Vec<u64>, ()>,
    pub tag: Result<Option<Arc<Tag>>, ()>,
}

pub struct FastReader {
    layout: Layout,
    mem: Memory,
    batch: Batch,
    round: Batch,
    threads: Threads,
    codes: CodeCache,
    mode: LineMode,
    thread_reads: u64,
    torn_reads: u64,
}

impl FastReader {
    pub fn new(layout: Layout, mut mem: Memory, runtime: u64, interp: u64, code_type: u64, mode: LineMode) -> Result<FastReader, String> {
        let threads = Threads::new(interp, runtime, &layout, &mut mem)?;
        Ok(FastReader {
            layout,
            mem,
            batch: Batch::default(),
            round: Batch::default(),
            threads,
            codes: CodeCache::new(code_type),
            mode,
            thread_reads: 0,
            torn_reads: 0,
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn memory(&mut self) -> &mut Memory {
        &mut self.mem
    }

    /// Reads the threads `select` picks; tags are read right before and after the
    /// one read that copies their frames.
    pub fn read_where(&mut self, select: impl Fn(&ThreadState) -> bool, tags: &ThreadTags) -> Result<Vec<ReadThread>, String> {
        let states = self.threads.read(&self.layout, &mut self.mem, &mut self.batch)?;
        let chosen: Vec<&ThreadState> = states.iter().filter(|t| select(t)).collect();
        if chosen.is_empty() {
            return Ok(Vec::new());
        }
        let idents: Vec<u64> = chosen.iter().map(|t| t.ident).collect();
        let before = tags.versions(&idents);
        let stacks = read_stacks(&chosen, &self.layout, &mut self.mem, &mut self.batch, &mut self.round)?;
        let after = tags.stable_tags(&before, &idents);
        let codes: FxHashSet<u64> = stacks.iter().flatten().flatten().map(|f| f.code).collect();
        self.codes.refresh(&codes, &self.layout, &mut self.mem, &mut self.batch)?;
        self.thread_reads += chosen.len() as u64;
        let out: Vec<ReadThread> = chosen
            .into_iter()
            .zip(stacks)
            .zip(after)
            .map(|((state, raw), tag)| ReadThread { state: state.clone(), frames: raw.and_then(|r| self.frame_ids(&r)), tag })
            .collect();
        self.torn_reads += out.iter().filter(|r| r.frames.is_err()).count() as u64;
        Ok(out)
    }

    /// Frame ids of a raw stack; Err if any frame does not hold together.
    fn frame_ids(&mut self, raw: &[RawFrame]) -> Result<Vec<u64>, ()> {
        let mut ids = Vec::with_capacity(raw.len());
        for f in raw {
            let offset = f.instr as i64 - (f.code + self.layout.code_bytecode) as i64;
            // 3.11 and 3.12 start a frame one code unit before its code: not yet running.
            let not_started = offset == -2 && self.layout.version < (3, 13);
            match self.codes.frame_id(f.code, offset, self.mode) {
                Found::Frame(id) if !not_started => ids.push(id),
                Found::Frame(_) | Found::NotCode => {} // NotCode: an entry frame's executable
                Found::Torn => return Err(()),
            }
        }
        Ok(ids)
    }
}

impl StackReader for FastReader {
    fn name(&self) -> &'static str {
        "fast"
    }

    fn read(&mut self, want: Want, tags: &ThreadTags, out: &mut Vec<ThreadStack>) -> Result<(), String> {
        out.clear();
        let select = |t: &ThreadState| (t.on_cpu || t.holds_gil || want.idle) && (t.holds_gil || !want.gil_only);
        for r in self.read_where(select, tags)? {
            let Ok(frames) = r.frames else { continue };
            out.push(ThreadStack {
                ident: r.state.ident,
                name: None,
                frames,
                active: r.state.on_cpu || r.state.holds_gil,
                holds_gil: r.state.holds_gil,
                cpu_ns: r.state.cpu_ns,
                tag: r.tag,
            });
        }
        Ok(())
    }

    fn frame(&self, id: u64) -> Frame {
        self.codes.frame(id).clone()
    }

    fn epoch(&self) -> u64 {
        self.codes.epoch
    }

    fn stats(&self) -> Value {
        json!({
            "python": format!("{}.{}", self.layout.version.0, self.layout.version.1),
            "thread_reads": self.thread_reads,
            "torn_reads": self.torn_reads,
            "syscalls": self.mem.calls,
            "proc_mem_fallback": self.mem.uses_proc_mem(),
            "thread_list_walks": self.threads.walks,
            "code_objects_reused": self.codes.reused,
            "code_objects_unreadable": self.codes.unreadable,
        })
    }
}
