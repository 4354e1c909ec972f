//! Stacks: each thread's live datastack chunk is copied in one read and its frames
//! are walked from the copy. Frames outside it (generator and coroutine frames,
//! entry frames on the C stack, frames in older chunks) are read on demand, in
//! rounds: one batch per round for every thread that needs one.
//!
//! A thread that runs while its chunk is copied can leave a copy that mixes two
//! call chains. So the live chunks of threads that may run are copied twice, and a
//! chain whose frames differ between the copies is torn.

use super::layout::{CurrentFrame, Layout, CHUNK_HEADER, CHUNK_PREVIOUS};
use super::memory::{u64_at, u8_at, Batch, Memory};
use super::threads::ThreadState;

/// A chain longer than this (counting every frame, Python or not) is taken for a
/// loop in a torn copy.
const MAX_DEPTH: usize = 5_000;
const MAX_ROUNDS: usize = 200;
/// Larger live chunks are taken for a torn read.
const MAX_CHUNK: u64 = 64 << 20;
/// Every chunk is at least this large (CPython's `DATA_STACK_CHUNK_SIZE`), so an
/// older chunk can be copied whole before its header is known.
const MIN_CHUNK: u64 = 16 << 10;

/// A frame as found: its code object (or other executable) and instruction pointer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawFrame {
    pub code: u64,
    pub instr: u64,
}

/// Memory copied for one thread: its live chunk stays in the first batch; frames
/// and older chunks read on demand are kept here.
struct Region {
    start: u64,
    bytes: Vec<u8>,
}

struct Walker {
    /// Index of the live chunk's copy in the first batch.
    chunk: Option<(u64, usize)>,
    regions: Vec<Region>,
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

impl Walker {
    fn find<'a>(&'a self, chunks: &'a Batch, addr: u64, len: u64) -> Option<&'a [u8]> {
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
            let in_live = self.chunk.and_then(|(start, i)| slice_at(start, chunks.get(i)?, self.next, layout.frame_size)).is_some();
            let Some(f) = self.find(chunks, self.next, layout.frame_size) else { break };
            let (code, instr) = (u64_at(f, layout.frame_code) & !7, u64_at(f, layout.frame_instr));
            let owner = u8_at(f, layout.frame_owner);
            let previous = u64_at(f, layout.frame_previous);
            self.walked += 1;
            if in_live {
                self.live.push(self.next);
            }
            if Some(owner) != layout.owner_not_python && code != 0 {
                self.frames.push(RawFrame { code, instr });
            }
            self.next = previous;
        }
    }
}

/// The frames of each thread, innermost first; Err for a thread whose chain was torn.
/// `batch` receives the live chunks, `round` the reads made on demand; `still[i]`
/// says thread i cannot have run since its stack was last read.
pub fn read_stacks(
    threads: &[&ThreadState],
    still: &[bool],
    layout: &Layout,
    mem: &mut Memory,
    batch: &mut Batch,
    round: &mut Batch,
) -> Result<Vec<Result<Vec<RawFrame>, ()>>, String> {
    batch.clear();
    let mut first = Vec::with_capacity(threads.len());
    for t in threads {
        let frame = match layout.current_frame {
            CurrentFrame::Direct(_) => None,
            CurrentFrame::ViaCFrame { current_frame, .. } => Some(batch.push(t.frame_ref + current_frame, 8)),
        };
        let live = t.top.wrapping_sub(t.chunk);
        let chunk = (t.chunk != 0 && live > CHUNK_HEADER && live <= MAX_CHUNK).then(|| batch.push(t.chunk, live as usize));
        first.push((frame, chunk));
    }
    mem.read(batch)?;
    let mut walkers: Vec<Walker> = threads
        .iter()
        .zip(first)
        .map(|(t, (frame, chunk))| {
            let next = match frame {
                None => Some(t.frame_ref),
                Some(i) => batch.get(i).map(|b| u64_at(b, 0)),
            };
            let chunk = chunk.filter(|&i| batch.get(i).is_some()).map(|i| (t.chunk, i));
            Walker {
                older_chunk: chunk.and_then(|(_, i)| batch.get(i)).map_or(0, |b| u64_at(b, CHUNK_PREVIOUS)),
                chunk,
                regions: Vec::new(),
                base_frame: layout.tstate_base_frame.map(|o| t.addr + o),
                next: next.unwrap_or(0),
                frames: Vec::new(),
                walked: 0,
                live: Vec::new(),
                torn: next.is_none(),
            }
        })
        .collect();
    for _ in 0..MAX_ROUNDS {
        round.clear();
        let mut wanted = Vec::new();
        for (n, w) in walkers.iter_mut().enumerate() {
            w.advance(layout, batch);
            if w.next != 0 && !w.torn {
                let frame = round.push(w.next, layout.frame_size as usize);
                let older = (w.older_chunk != 0).then(|| (w.older_chunk, round.push(w.older_chunk, MIN_CHUNK as usize)));
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
                    w.regions.push(Region { start: at, bytes: b.to_vec() });
                }
            }
            match round.get(frame) {
                Some(b) => w.regions.push(Region { start: w.next, bytes: b.to_vec() }),
                None => w.torn = true,
            }
        }
    }
    recheck(&mut walkers, still, layout, mem, batch, round)?;
    Ok(walkers.into_iter().map(|w| if w.torn || w.next != 0 { Err(()) } else { Ok(w.frames) }).collect())
}

/// Copies the live chunks of threads that may run again and tears every chain
/// whose frames changed: code and caller everywhere, the instruction below the leaf
/// (the leaf's own instruction moves on as it runs).
fn recheck(
    walkers: &mut [Walker],
    still: &[bool],
    layout: &Layout,
    mem: &mut Memory,
    first: &Batch,
    again: &mut Batch,
) -> Result<(), String> {
    again.clear();
    let mut checks = Vec::new();
    for (n, w) in walkers.iter().enumerate() {
        if let (false, false, Some((start, i))) = (w.torn, still[n], w.chunk) {
            checks.push((n, start, i, again.push(start, first.get(i).map_or(0, <[u8]>::len))));
        }
    }
    if checks.is_empty() {
        return Ok(());
    }
    mem.read(again)?;
    for (n, start, i, j) in checks {
        let w = &mut walkers[n];
        let (Some(a), Some(b)) = (first.get(i), again.get(j)) else {
            w.torn = true;
            continue;
        };
        let fields = |leaf: bool| [layout.frame_code, layout.frame_previous].into_iter().chain((!leaf).then_some(layout.frame_instr));
        w.torn = w.live.iter().enumerate().any(|(depth, &addr)| {
            fields(depth == 0).any(|f| u64_at(a, addr - start + f) != u64_at(b, addr - start + f))
        });
    }
    Ok(())
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
            on_cpu: false,
            cpu_ns: 0,
            still: true,
        };
        let (mut batch, mut round) = (Batch::default(), Batch::default());
        let stacks = read_stacks(&[&t], &[true], &layout, &mut Memory::new(), &mut batch, &mut round).unwrap();
        assert_eq!(stacks, vec![Err(())]);
    }
}
