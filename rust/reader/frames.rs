//! Stacks: each thread's live datastack chunk is copied in one read and its frames
//! are walked from the copy. Frames outside it (generator and coroutine frames,
//! entry frames on the C stack, frames in older chunks) are read on demand, in
//! rounds: one batch per round for every thread that needs one.
//!
//! A thread that runs while its chunk is copied can leave a copy that mixes two
//! call chains. So the frame pointer and live chunk of threads that may run are
//! copied several times, a few microseconds apart, and a chain is taken only from a
//! copy that the next one agrees with; else it is torn (and the reader reads that
//! thread again).

use super::layout::{CurrentFrame, Layout, CHUNK_HEADER, CHUNK_PREVIOUS};
use super::memory::{u64_at, u8_at, Batch, Memory};
use super::threads::ThreadState;
use super::{Copied, FramePointer};
use std::borrow::Cow;

/// A chain longer than this (counting every frame, Python or not) is taken for a
/// loop in a torn copy.
const MAX_DEPTH: usize = 5_000;
const MAX_ROUNDS: usize = 200;
/// Larger live chunks are taken for a torn read.
const MAX_CHUNK: u64 = 64 << 20;
/// Every chunk is at least this large (CPython's `DATA_STACK_CHUNK_SIZE`), so an
/// older chunk can be copied whole before its header is known.
const MIN_CHUNK: u64 = 16 << 10;
/// Bytes copied past a live chunk's top: room for the frames of a few calls made
/// since the thread state was read.
const PAST_TOP: u64 = 1 << 10;
/// Threads copied together, round by round: the rounds of a few threads take about
/// `APART`, so waiting for it costs little.
const GROUP: usize = 4;
/// Least time between two copies of one thread's stack (see `Memory::read_spaced`).
const APART: std::time::Duration = std::time::Duration::from_micros(2);

/// A frame as found: its code object (or other executable) and instruction pointer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawFrame {
    pub code: u64,
    pub instr: u64,
    /// The outermost frame of one run of the interpreter's eval loop (a C caller
    /// called into Python there): where native stacks are merged.
    pub entry: bool,
    /// The address of that run's entry frame (a shim on the C stack; 0: none, 3.11).
    pub shim: u64,
}

/// A thread's frames as walked, innermost first, and the frame pointer the walk began at.
#[derive(Clone, Debug, PartialEq)]
pub struct RawStack {
    pub pointer: u64,
    pub frames: Vec<RawFrame>,
}

/// Memory copied for one thread: its live chunk stays in the first batch; frames
/// and older chunks read on demand are kept here, and so are a signal's copies.
struct Region<'a> {
    start: u64,
    bytes: Cow<'a, [u8]>,
}

struct Walker<'a> {
    /// Index of the live chunk's copy in the first batch.
    chunk: Option<(u64, usize)>,
    /// The innermost frame, where the walk began.
    start: u64,
    regions: Vec<Region<'a>>,
    base_frame: Option<u64>,
    next: u64,
    older_chunk: u64,
    frames: Vec<RawFrame>,
    /// Frames stepped through, kept or not: a loop of shim frames keeps none.
    walked: usize,
    /// Addresses of the frames walked in the live chunk, innermost first.
    live: Vec<u64>,
    torn: bool,
}

fn slice_at(start: u64, bytes: &[u8], addr: u64, len: u64) -> Option<&[u8]> {
    let off = addr.checked_sub(start)?;
    bytes.get(off as usize..(off + len) as usize)
}

impl<'a> Walker<'a> {
    /// A walk of `t`'s frames from one copy of its frame pointer and live chunk.
    fn new(t: &ThreadState, copy: Snapshot, batch: &Batch, layout: &Layout) -> Walker<'a> {
        let next = batch.get(copy.pointer).map(|b| u64_at(b, 0));
        let chunk = copy.chunk.filter(|&i| batch.get(i).is_some()).map(|i| (t.chunk, i));
        Walker {
            older_chunk: chunk.and_then(|(_, i)| batch.get(i)).map_or(0, |b| u64_at(b, CHUNK_PREVIOUS)),
            chunk,
            start: next.unwrap_or(0),
            regions: Vec::new(),
            base_frame: layout.tstate_base_frame.map(|o| t.addr + o),
            next: next.unwrap_or(0),
            frames: Vec::new(),
            walked: 0,
            live: Vec::new(),
            torn: next.is_none(),
        }
    }

    /// A walk from a signal's copy of the thread's frames.
    fn from_copy(copy: &Copied<'a>, base_frame: Option<u64>) -> Walker<'a> {
        let region = |(start, bytes): (u64, &'a [u8])| Region { start, bytes: Cow::Borrowed(bytes) };
        Walker {
            chunk: None,
            start: copy.pointer,
            regions: vec![region(copy.chunk), region(copy.stack)],
            base_frame,
            next: copy.pointer,
            older_chunk: 0,
            frames: Vec::new(),
            walked: 0,
            live: Vec::new(),
            torn: false,
        }
    }

    fn find<'b>(&'b self, chunks: &'b Batch, addr: u64, len: u64) -> Option<&'b [u8]> {
        let live = self.chunk.and_then(|(start, i)| slice_at(start, chunks.get(i)?, addr, len));
        live.or_else(|| self.regions.iter().find_map(|r| slice_at(r.start, &r.bytes, addr, len)))
    }

    /// Follows the chain from the local copies; stops at the end or at a frame not copied.
    fn advance(&mut self, layout: &Layout, chunks: &Batch) {
        while self.next != 0 && !self.torn {
            if Some(self.next) == self.base_frame {
                self.next = 0;
                break;
            }
            if self.next % 8 != 0 || self.walked >= MAX_DEPTH {
                self.torn = true;
                break;
            }
            let in_live = self
                .chunk
                .and_then(|(start, i)| slice_at(start, chunks.get(i)?, self.next, layout.frame_size))
                .is_some();
            let Some(f) = self.find(chunks, self.next, layout.frame_size) else { break };
            let (code, instr) = (u64_at(f, layout.frame_code) & !7, u64_at(f, layout.frame_instr));
            let owner = u8_at(f, layout.frame_owner);
            let previous = u64_at(f, layout.frame_previous);
            let entry = layout.frame_is_entry.is_some_and(|o| u8_at(f, o) != 0);
            self.walked += 1;
            if in_live {
                self.live.push(self.next);
            }
            if Some(owner) == layout.owner_not_python {
                // An eval loop's shim: the frame walked before it began that run.
                if let Some(last) = self.frames.last_mut() {
                    (last.entry, last.shim) = (true, self.next);
                }
            } else if code != 0 {
                self.frames.push(RawFrame { code, instr, entry, shim: 0 });
            }
            self.next = previous;
        }
    }
}

/// Indices in the first batch of one copy of a thread's innermost frame pointer and
/// live chunk.
#[derive(Clone, Copy)]
struct Snapshot {
    pointer: usize,
    chunk: Option<usize>,
}

/// Where the thread's innermost frame pointer lives.
fn frame_pointer_at(t: &ThreadState, layout: &Layout) -> u64 {
    match layout.current_frame {
        CurrentFrame::Direct(o) => t.addr + o,
        CurrentFrame::ViaCFrame { current_frame, .. } => t.frame_ref + current_frame,
    }
}

/// Where a signal handler finds `t`'s innermost frame pointer from its thread state,
/// with the pointer a walk of its frames began at.
pub fn frame_pointer(t: &ThreadState, layout: &Layout, seen: u64) -> FramePointer {
    let (at, via) = match layout.current_frame {
        CurrentFrame::Direct(o) => (t.addr + o, None),
        CurrentFrame::ViaCFrame { cframe, current_frame } => (t.addr + cframe, Some(current_frame)),
    };
    // The handler reads the chunk and its top as one pair.
    let paired = layout.tstate_datastack_top == layout.tstate_datastack_chunk + 8;
    FramePointer { at, via, seen, datastack: if paired { t.addr + layout.tstate_datastack_chunk } else { 0 } }
}

/// Queues the frame pointer, then the live chunk up to its top and a little past it
/// (frames pushed since the thread state was read), within the chunk's least size.
fn push_copy(batch: &mut Batch, t: &ThreadState, layout: &Layout) -> Snapshot {
    let pointer = batch.push(frame_pointer_at(t, layout), 8);
    let live = t.top.wrapping_sub(t.chunk);
    let extent = if live < MIN_CHUNK { (live + PAST_TOP).min(MIN_CHUNK) } else { live };
    let chunk =
        (t.chunk != 0 && live > CHUNK_HEADER && live <= MAX_CHUNK).then(|| batch.push(t.chunk, extent as usize));
    Snapshot { pointer, chunk }
}

/// Copies each thread's frame pointer and live chunk `copies[i]` times, for a few
/// threads at a time round by round, each round at least `APART` after the last.
fn push_copies(
    threads: &[&ThreadState],
    copies: &[usize],
    layout: &Layout,
    mem: &mut Memory,
    batch: &mut Batch,
) -> Result<Vec<Vec<Snapshot>>, String> {
    batch.clear();
    let mut snapshots: Vec<Vec<Snapshot>> = copies.iter().map(|&n| Vec::with_capacity(n)).collect();
    let mut rounds = Vec::new();
    for first in (0..threads.len()).step_by(GROUP) {
        let group = first..(first + GROUP).min(threads.len());
        let most = copies[group.clone()].iter().copied().max().unwrap_or(0);
        for round in 0..most {
            rounds.push((batch.len(), round > 0));
            for i in group.clone().filter(|&i| copies[i] > round) {
                snapshots[i].push(push_copy(batch, threads[i], layout));
            }
        }
    }
    mem.read_spaced(batch, &rounds, APART)?;
    Ok(snapshots)
}

/// The frames of each thread, innermost first; Err for a thread whose chain was torn.
/// `batch` receives the live chunks, `round` the reads made on demand. Thread i is
/// copied `copies[i]` times (see `push_copies`): once for a thread that cannot
/// have run since its stack was last read; else its chain is walked from the first
/// copy that the next one agrees with (see `agrees`), and is torn if there is none.
pub fn read_stacks(
    threads: &[&ThreadState],
    copies: &[usize],
    layout: &Layout,
    mem: &mut Memory,
    batch: &mut Batch,
    round: &mut Batch,
) -> Result<Vec<Result<RawStack, ()>>, String> {
    let copies = push_copies(threads, copies, layout, mem, batch)?;
    // The copy each walk uses, and the one that must agree with it.
    let mut checked: Vec<Option<Snapshot>> = Vec::with_capacity(threads.len());
    let mut walkers: Vec<Walker> = Vec::with_capacity(threads.len());
    for (t, copies) in threads.iter().zip(&copies) {
        let agreeing = copies.windows(2).find_map(|pair| {
            let mut w = Walker::new(t, pair[0], batch, layout);
            w.advance(layout, batch);
            agrees(&w, pair[1], batch, layout).then_some((w, pair[1]))
        });
        let (w, again) = match agreeing {
            Some((w, again)) => (w, Some(again)),
            None => {
                let mut w = Walker::new(t, copies[0], batch, layout);
                w.torn |= copies.len() > 1;
                (w, None)
            }
        };
        walkers.push(w);
        checked.push(again);
    }
    read_on_demand(&mut walkers, layout, mem, batch, round)?;
    // Frames walked after frames read on demand are checked too.
    for (w, again) in walkers.iter_mut().zip(checked) {
        if let Some(again) = again {
            w.torn |= !agrees(w, again, batch, layout);
        }
    }
    Ok(walkers
        .into_iter()
        .map(|w| if w.torn || w.next != 0 { Err(()) } else { Ok(RawStack { pointer: w.start, frames: w.frames }) })
        .collect())
}

/// Walks each walker on, reading in rounds the frames (and older chunks) its copies
/// do not hold: one batch per round for every walker that needs one.
fn read_on_demand(
    walkers: &mut [Walker<'_>],
    layout: &Layout,
    mem: &mut Memory,
    batch: &Batch,
    round: &mut Batch,
) -> Result<(), String> {
    for _ in 0..MAX_ROUNDS {
        round.clear();
        let mut wanted = Vec::new();
        for (n, w) in walkers.iter_mut().enumerate() {
            w.advance(layout, batch);
            if w.next != 0 && !w.torn {
                let frame = round.push(w.next, layout.frame_size as usize);
                let older =
                    (w.older_chunk != 0).then(|| (w.older_chunk, round.push(w.older_chunk, MIN_CHUNK as usize)));
                wanted.push((n, frame, older));
            }
        }
        if wanted.is_empty() {
            break;
        }
        mem.read(round)?;
        for (n, frame, older) in wanted {
            let w = &mut walkers[n];
            if let Some((at, i)) = older {
                w.older_chunk = 0;
                if let Some(b) = round.get(i) {
                    w.older_chunk = u64_at(b, CHUNK_PREVIOUS);
                    w.regions.push(Region { start: at, bytes: Cow::Owned(b.to_vec()) });
                }
            }
            match round.get(frame) {
                Some(b) => w.regions.push(Region { start: w.next, bytes: Cow::Owned(b.to_vec()) }),
                None => w.torn = true,
            }
        }
    }
    Ok(())
}

/// A thread's frames walked from a signal handler's copy of them (see `Copied`),
/// with the frames it does not hold read now; None if the walk tore.
pub fn walk_copied(
    copy: &Copied<'_>,
    base_frame: Option<u64>,
    layout: &Layout,
    mem: &mut Memory,
    round: &mut Batch,
) -> Option<RawStack> {
    let mut walker = [Walker::from_copy(copy, base_frame)];
    read_on_demand(&mut walker, layout, mem, &Batch::default(), round).ok()?;
    let [w] = walker;
    (!w.torn && w.next == 0).then_some(RawStack { pointer: w.start, frames: w.frames })
}

/// Whether a later copy agrees with the walk of an earlier one: the walk's innermost
/// frame is still on the later copy's chain (else its slot may have held a stale
/// frame under a new caller), and every frame walked in the chunk has the same code
/// and caller, and the same instruction below the leaf (the leaf's moves on as it runs).
fn agrees(w: &Walker, again: Snapshot, batch: &Batch, layout: &Layout) -> bool {
    let Some(innermost) = batch.get(again.pointer).map(|b| u64_at(b, 0)) else { return false };
    let Some((start, i)) = w.chunk else { return innermost == w.start };
    let (Some(a), Some(b)) = (batch.get(i), again.chunk.and_then(|j| batch.get(j))) else { return false };
    let fields = |leaf: bool| {
        [layout.frame_code, layout.frame_previous].into_iter().chain((!leaf).then_some(layout.frame_instr))
    };
    reaches(start, b, innermost, w.start, layout)
        && w.live.iter().enumerate().all(|(depth, &addr)| {
            fields(depth == 0).all(|f| u64_at(a, addr - start + f) == u64_at(b, addr - start + f))
        })
}

/// Whether the chain from `from`, followed in one chunk copy, passes through `target`
/// (the same frame, or a caller of a deeper one: frames grow upwards in a chunk).
fn reaches(start: u64, bytes: &[u8], mut from: u64, target: u64, layout: &Layout) -> bool {
    for _ in 0..MAX_DEPTH {
        if from == target {
            return true;
        }
        let Some(frame) = (from > target).then(|| slice_at(start, bytes, from, layout.frame_size)).flatten() else {
            return false;
        };
        from = u64_at(frame, layout.frame_previous);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A torn copy can link frames that hold no Python code into a loop: the walk
    /// must give up as torn rather than spin (it once grew `live` until the OOM killer came).
    #[test]
    fn a_loop_of_shim_frames_is_torn() {
        let layout = Layout::find((3, 12), false, 0, &mut Memory::new()).unwrap();
        let (fs, not_python) = (layout.frame_size as usize, layout.owner_not_python.unwrap());
        let mut chunk = vec![0u8; CHUNK_HEADER as usize + 2 * fs];
        let base = chunk.as_ptr() as u64;
        let (a, b) = (base + CHUNK_HEADER, base + CHUNK_HEADER + fs as u64);
        for (at, previous) in [(a, b), (b, a)] {
            let off = (at - base) as usize;
            chunk[off + layout.frame_previous as usize..][..8].copy_from_slice(&previous.to_le_bytes());
            chunk[off + layout.frame_owner as usize] = not_python;
        }
        let CurrentFrame::ViaCFrame { current_frame, .. } = layout.current_frame else { unreachable!() };
        let cframe = a; // 3.12's `_PyCFrame.current_frame`
        let t = ThreadState {
            addr: 0,
            ident: 1,
            frame_ref: &cframe as *const u64 as u64 - current_frame,
            chunk: base,
            top: base + chunk.len() as u64,
            holds_gil: false,
            attached: false,
            on_cpu: false,
            cpu_ns: 0,
            ran: None,
            clock_ns: None,
            native_tid: 0,
            still: true,
            stood: true,
        };
        let (mut batch, mut round) = (Batch::default(), Batch::default());
        let stacks = read_stacks(&[&t], &[1], &layout, &mut Memory::new(), &mut batch, &mut round).unwrap();
        assert_eq!(stacks, vec![Err(())]);
    }

    /// Frames `(code, instr, caller slot)` in slots 0.. of a chunk whose addresses
    /// are `base`'s, whatever buffer holds the bytes.
    fn chunk_at(base: u64, layout: &Layout, frames: &[(u64, u64, Option<usize>)]) -> Vec<u8> {
        let fs = layout.frame_size as usize;
        let mut bytes = vec![0u8; CHUNK_HEADER as usize + frames.len() * fs];
        for (k, &(code, instr, caller)) in frames.iter().enumerate() {
            let at = CHUNK_HEADER as usize + k * fs;
            let previous = caller.map_or(0, |c| base + CHUNK_HEADER + (c * fs) as u64);
            for (field, value) in
                [(layout.frame_code, code), (layout.frame_instr, instr), (layout.frame_previous, previous)]
            {
                bytes[at + field as usize..][..8].copy_from_slice(&value.to_le_bytes());
            }
        }
        bytes
    }

    /// Whether copy `b` (innermost frame in slot `b_leaf`) agrees with the walk of
    /// copy `a` from slot `a_leaf`; both copies stand for one chunk at `a`'s address.
    fn copies_agree(
        layout: &Layout,
        a: &[(u64, u64, Option<usize>)],
        a_leaf: usize,
        b: &[(u64, u64, Option<usize>)],
        b_leaf: usize,
    ) -> bool {
        let mut first = vec![0u8; CHUNK_HEADER as usize + a.len().max(b.len()) * layout.frame_size as usize];
        let base = first.as_ptr() as u64;
        let filled = chunk_at(base, layout, a);
        first[..filled.len()].copy_from_slice(&filled);
        let second = chunk_at(base, layout, b);
        let slot = |k: usize| base + CHUNK_HEADER + k as u64 * layout.frame_size;
        let (pointer_a, pointer_b) = (slot(a_leaf), slot(b_leaf));
        let mut batch = Batch::default();
        let copy_a = Snapshot {
            pointer: batch.push(&pointer_a as *const u64 as u64, 8),
            chunk: Some(batch.push(base, first.len())),
        };
        let copy_b = Snapshot {
            pointer: batch.push(&pointer_b as *const u64 as u64, 8),
            chunk: Some(batch.push(second.as_ptr() as u64, second.len())),
        };
        Memory::new().read(&mut batch).unwrap();
        let t = ThreadState {
            addr: 0,
            ident: 1,
            frame_ref: 0,
            chunk: base,
            top: base,
            holds_gil: true,
            attached: false,
            on_cpu: true,
            cpu_ns: 0,
            ran: None,
            clock_ns: None,
            native_tid: 0,
            still: false,
            stood: false,
        };
        let mut w = Walker::new(&t, copy_a, &batch, layout);
        w.advance(layout, &batch);
        assert!(!w.torn && w.next == 0, "copy a walks whole");
        agrees(&w, copy_b, &batch, layout)
    }

    #[test]
    fn a_copy_is_taken_only_if_a_later_one_still_holds_its_chain() {
        let layout = Layout::find((3, 12), false, 0, &mut Memory::new()).unwrap();
        // main (slot 0) -> f (slot 1) -> g (slot 2); codes 0x100, 0x200, 0x300.
        let chain = [(0x100, 0x110, None), (0x200, 0x210, Some(0)), (0x300, 0x310, Some(1))];
        assert!(copies_agree(&layout, &chain, 2, &chain, 2), "unchanged");
        let moved_on = [(0x100, 0x110, None), (0x200, 0x210, Some(0)), (0x300, 0x318, Some(1))];
        assert!(copies_agree(&layout, &chain, 2, &moved_on, 2), "the leaf's own instruction moves as it runs");
        let deeper = [(0x100, 0x110, None), (0x200, 0x210, Some(0)), (0x300, 0x314, Some(1)), (0x400, 0x410, Some(2))];
        assert!(copies_agree(&layout, &chain, 2, &deeper, 3), "g called on: its frame is still on the chain");
        assert!(!copies_agree(&layout, &chain, 2, &chain, 1), "g returned: its slot may be reused");
        let caller_moved = [(0x100, 0x110, None), (0x200, 0x214, Some(0)), (0x300, 0x310, Some(1))];
        assert!(!copies_agree(&layout, &chain, 2, &caller_moved, 2), "f went on: g is another call");
        // g returned and f called h in its slot: a walk from the old pointer read g over f.
        let replaced = [(0x100, 0x110, None), (0x200, 0x218, Some(0)), (0x500, 0x510, Some(1))];
        assert!(!copies_agree(&layout, &chain, 2, &replaced, 2), "another function in the leaf's slot");
    }
}
