//! The calling thread's own Python frames, walked by that thread: from inside an
//! allocator call its frames cannot change, so they are walked where they live (copied
//! by guarded reads, a few microseconds), as a signal's copies are walked. The code
//! objects they point to are named later by the sampling thread (`StackReader::name_stacks`).

use super::frames::{walk_copied, RawStack};
use super::layout::{CurrentFrame, Layout};
use super::memory::{read_u64, Batch, Memory};
use super::threads::clock_ns;
use super::Copied;
use std::ffi::c_void;

/// Live chunks larger than this are taken for a misread (see `frames.rs`).
const MAX_CHUNK: u64 = 64 << 20;

extern "C" {
    fn PyGILState_GetThisThreadState() -> *mut c_void;
}

/// A walker of the calling thread's frames, with the fast reader's layout.
pub struct OwnFrames {
    layout: Layout,
    mem: Memory,
    chunk: Batch,
    round: Batch,
}

impl OwnFrames {
    pub fn new(layout: Layout) -> OwnFrames {
        OwnFrames { layout, mem: Memory::new(), chunk: Batch::default(), round: Batch::default() }
    }

    /// The calling thread's Python frames, innermost first; None where it has no thread
    /// state or a read failed.
    pub fn walk(&mut self) -> Option<RawStack> {
        // SAFETY: reads the thread's own slot; no other precondition.
        let tstate = unsafe { PyGILState_GetThisThreadState() } as u64;
        if tstate == 0 {
            return None;
        }
        let l = &self.layout;
        let at = match l.current_frame {
            CurrentFrame::Direct(o) => tstate + o,
            CurrentFrame::ViaCFrame { cframe, current_frame } => {
                read_u64(&mut self.mem, tstate + cframe)? + current_frame
            }
        };
        let pointer = read_u64(&mut self.mem, at)?;
        let chunk = read_u64(&mut self.mem, tstate + l.tstate_datastack_chunk)?;
        let top = read_u64(&mut self.mem, tstate + l.tstate_datastack_top)?;
        let live = top.wrapping_sub(chunk);
        self.chunk.clear();
        if chunk != 0 && live <= MAX_CHUNK {
            self.chunk.push(chunk, live as usize);
            self.mem.read(&mut self.chunk).ok()?;
        }
        let bytes = self.chunk.get(0).unwrap_or_default();
        let time_ns = clock_ns(nix::libc::CLOCK_MONOTONIC).unwrap_or(0);
        let copy = Copied { pointer, chunk: (chunk, bytes), stack: (0, &[]), time_ns };
        let base_frame = l.tstate_base_frame.map(|o| tstate + o);
        walk_copied(&copy, base_frame, l, &mut self.mem, &mut self.round)
    }
}
