//! The interpreter's thread states, the GIL, and each thread's CPU clock.
//!
//! The thread list is re-read in one batch each tick and walked again only when its
//! links changed. Whether a thread works comes from the GIL (held now) and its CPU
//! clock (ran for most of the time since the last tick), never from `/proc`.

use super::layout::{CurrentFrame, GilAt, Layout, THREAD_ATTACHED};
use super::memory::{u32_at, u64_at, Batch, Memory};
use nix::libc;
use rustc_hash::FxHashMap;
use std::time::Instant;

/// A thread that used at least this share of the wall time since the last tick ran.
const RUNNING_SHARE: f64 = 0.5;
/// More thread states than this in one walk means a torn or looping list.
const MAX_THREADS: usize = 10_000;
/// A thread that used less than this share of the time since the last reading, holds no
/// GIL and stands at the instruction it stood at then ran no Python meanwhile, as far
/// as its position tells (`ThreadState::stood`): what it used went to a wait's own
/// wake-ups, or to native code.
const STOOD_RAN: f64 = 0.02;

#[derive(Clone, Debug)]
pub struct ThreadState {
    pub addr: u64,
    pub ident: u64,
    /// The innermost frame (3.13+), or the C-stack struct that holds it (3.11, 3.12).
    pub frame_ref: u64,
    pub chunk: u64,
    pub top: u64,
    pub holds_gil: bool,
    /// Attached to the interpreter (free-threaded builds): running Python, on a CPU or
    /// waiting for one; there no GIL tells a working thread from a waiting one.
    pub attached: bool,
    pub on_cpu: bool,
    pub cpu_ns: u64,
    /// The share of the wall time since the last reading it was on a CPU.
    pub ran: Option<f64>,
    /// Its CPU clock at this reading (None: first reading, or gone).
    pub clock_ns: Option<u64>,
    pub native_tid: u64,
    /// Used no CPU since the last tick and holds no GIL: its frames cannot have changed.
    pub still: bool,
    /// Holds no GIL, used little CPU (`STOOD_RAN`), and its innermost frame is at the
    /// instruction where the last reading found it: it ran no Python since, as far as
    /// its position tells (a wait left and entered again stands where it stood).
    pub stood: bool,
}

impl ThreadState {
    /// Working for Python: on a CPU, holding the GIL, or attached (free-threaded).
    pub fn working(&self) -> bool {
        self.on_cpu || self.runs_python()
    }

    /// Running Python code: the one thread holding the GIL, or on a free-threaded build
    /// every attached thread.
    pub fn runs_python(&self) -> bool {
        self.holds_gil || self.attached
    }

    /// Where the thread's frames are, from its thread state's bytes.
    fn set_stack(&mut self, bytes: &[u8], layout: &Layout) {
        [self.frame_ref, self.chunk, self.top] = stack_of(bytes, layout);
    }
}

/// A thread state's innermost frame reference, live chunk and chunk top.
fn stack_of(bytes: &[u8], layout: &Layout) -> [u64; 3] {
    let frame_ref = match layout.current_frame {
        CurrentFrame::Direct(o) | CurrentFrame::ViaCFrame { cframe: o, .. } => u64_at(bytes, o),
    };
    [frame_ref, u64_at(bytes, layout.tstate_datastack_chunk), u64_at(bytes, layout.tstate_datastack_top)]
}

/// Whether a thread state's bytes say it is attached to a free-threaded interpreter.
fn attached(bytes: &[u8], layout: &Layout) -> bool {
    layout.tstate_state.is_some_and(|o| u32_at(bytes, o) == THREAD_ATTACHED)
}

/// Where a thread's Python code stands: its innermost frame (0: none) and that
/// frame's instruction; None where they could not be read.
type Position = Option<(u64, u64)>;

/// The position of each thread state marked in `asked`, from its bytes and two small
/// reads; None for the others.
fn positions(
    states: &[Vec<u8>],
    asked: &[bool],
    layout: &Layout,
    mem: &mut Memory,
    batch: &mut Batch,
) -> Result<Vec<Position>, String> {
    let kept = states.iter().zip(asked).map(|(b, &asked)| asked.then(|| stack_of(b, layout)[0]));
    let frames = match layout.current_frame {
        CurrentFrame::Direct(_) => kept.collect(),
        CurrentFrame::ViaCFrame { current_frame, .. } => {
            words_at(kept.map(|c| c.filter(|&c| c != 0).map(|c| c + current_frame)), mem, batch)?
        }
    };
    let instr_at: Vec<Option<u64>> =
        frames.iter().map(|f| f.filter(|&f| f != 0).map(|f| f + layout.frame_instr)).collect();
    let instrs = words_at(instr_at.iter().copied(), mem, batch)?;
    Ok((frames.iter().zip(instr_at.iter().zip(instrs)))
        .map(|(f, (at, instr))| {
            let instr = if at.is_some() { instr? } else { 0 };
            Some(((*f)?, instr))
        })
        .collect())
}

/// The words at `addrs` in one read; None where there is no address or it could not be read.
fn words_at(
    addrs: impl Iterator<Item = Option<u64>>,
    mem: &mut Memory,
    batch: &mut Batch,
) -> Result<Vec<Option<u64>>, String> {
    batch.clear();
    let at: Vec<Option<usize>> = addrs.map(|a| a.map(|a| batch.push(a, 8))).collect();
    mem.read(batch)?;
    Ok(at.iter().map(|i| i.and_then(|i| batch.get(i)).map(|b| u64_at(b, 0))).collect())
}

pub struct Threads {
    interp: u64,
    gil_locked: u64,
    gil_holder: u64,
    gil_enabled_at: Option<u64>,
    /// Whether the GIL was in use at the last reading: a free-threaded build runs
    /// without it unless something turned it on.
    pub gil_enabled: bool,
    list: Vec<u64>,
    /// Per native thread: CPU clock and wall time at the last reading.
    clocks: FxHashMap<u64, (u64, Instant)>,
    /// CPU time all threads used between the last two readings.
    pub cpu_ns: u64,
    /// Native ids of the threads of the last reading, sorted.
    pub live: Vec<u64>,
    pub walks: u64,
    /// Threads' CPU clocks read, over all readings (one system call each).
    pub clock_reads: u64,
    /// Where each thread of `list` stood at the last reading, if it used no CPU then.
    positions: Vec<Position>,
    /// Where each thread of `list` that may have stood (`read`) stood at the last reading.
    stood_at: Vec<Position>,
}

/// The GIL's state spans its `interval`, holder, `locked` and switch fields, then two
/// condition variables and two mutexes (48 bytes each at most with glibc).
const GIL_STATE_BYTES: u64 = 4 * 8 + 4 * 48;

impl Threads {
    pub fn new(interp: u64, runtime: u64, layout: &Layout, mem: &mut Memory) -> Result<Threads, String> {
        let (gil_locked, gil_holder, gil_enabled_at) = match layout.gil {
            GilAt::Runtime { locked, holder } => (runtime + locked, runtime + holder, None),
            GilAt::Interp { pointer, locked, holder, enabled } => {
                let gil = super::memory::read_u64(mem, interp + pointer).filter(|&g| g != 0);
                let gil = gil.ok_or("the interpreter's GIL state cannot be read")?;
                (gil + locked, gil + holder, enabled.map(|e| gil + e))
            }
        };
        Ok(Threads {
            interp,
            gil_locked,
            gil_holder,
            gil_enabled_at,
            gil_enabled: true,
            list: Vec::new(),
            clocks: FxHashMap::default(),
            cpu_ns: 0,
            live: Vec::new(),
            walks: 0,
            clock_reads: 0,
            positions: Vec::new(),
            stood_at: Vec::new(),
        })
    }

    /// The bytes of the GIL's state, which starts one word before its holder.
    pub fn gil_range(&self) -> std::ops::Range<u64> {
        let start = self.gil_holder - 8;
        start..start + GIL_STATE_BYTES
    }

    /// Every thread state of the interpreter, with its GIL and CPU state.
    pub fn read(&mut self, layout: &Layout, mem: &mut Memory, batch: &mut Batch) -> Result<Vec<ThreadState>, String> {
        let walks = self.walks;
        let (holder, states) = self.snapshot(layout, mem, batch)?;
        if walks != self.walks {
            // The list changed: where its threads stood is by index, so forgotten.
            self.positions.clear();
            self.stood_at.clear();
        }
        let now = Instant::now();
        let list = self.list.clone();
        let mut threads: Vec<ThreadState> =
            list.iter().zip(&states).map(|(&addr, bytes)| self.state(addr, bytes, holder, now, layout)).collect();
        // Where the threads that may have stood stand: still ones (`stood_still`) and those
        // that used little CPU, holding no GIL (a GIL wait's own wake-ups).
        let idle = |t: &ThreadState| t.still || (t.addr != holder && t.ran.is_some_and(|r| r < STOOD_RAN));
        let asked: Vec<bool> = threads.iter().map(idle).collect();
        let at = positions(&states, &asked, layout, mem, batch)?;
        for (i, t) in threads.iter_mut().enumerate() {
            t.stood = at[i].is_some() && self.stood_at.get(i) == Some(&at[i]) && !t.attached;
        }
        self.positions = (threads.iter().zip(&at)).map(|(t, at)| at.filter(|_| t.still)).collect();
        self.stood_at = at;
        self.cpu_ns = threads.iter().map(|t| t.cpu_ns).sum();
        self.live.clear();
        self.live.extend(threads.iter().map(|t| t.native_tid).filter(|&t| t != 0));
        self.live.sort_unstable();
        self.forget_dead_clocks();
        Ok(threads)
    }

    /// Whether every thread stood still at the last reading (`stood_still` may say yes).
    pub fn all_still(&self) -> bool {
        !self.positions.is_empty() && self.positions.iter().all(Option::is_some)
    }

    /// Whether every thread stands where the last reading left it: the GIL is free (on
    /// a free-threaded build, no thread is attached) and each thread's innermost frame
    /// is at the same instruction. Asked when the process's clock says no other thread
    /// used CPU since: that clock counts a thread's running only at a context switch or
    /// the kernel's tick, so a thread woken since the tick can be running unseen. The
    /// Python code it runs holds the GIL, and reaching native code moves its frame's
    /// instruction (a frame it returned from or called into moves it too).
    pub fn stood_still(&mut self, layout: &Layout, mem: &mut Memory, batch: &mut Batch) -> Result<bool, String> {
        // Allocates nothing: at a quiet tick this is most of what is done.
        if !self.all_still() {
            return Ok(false);
        }
        let attached = layout.tstate_state.filter(|_| !self.gil_enabled);
        batch.clear();
        batch.push(self.gil_locked, 4);
        if let Some(o) = attached {
            self.list.iter().for_each(|&t| _ = batch.push(t + o, 4));
        }
        for &(f, _) in self.positions.iter().flatten().filter(|(f, _)| *f != 0) {
            batch.push(f + layout.frame_instr, 8);
        }
        mem.read(batch)?;
        let flag = |i: usize| batch.get(i).map(|b| u32_at(b, 0));
        if self.gil_enabled && flag(0) != Some(0) {
            return Ok(false);
        }
        let mut next = 1;
        if attached.is_some() {
            let states = next..next + self.list.len();
            if states.clone().any(|i| flag(i).is_none_or(|s| s == THREAD_ATTACHED)) {
                return Ok(false);
            }
            next = states.end;
        }
        for &(f, instr) in self.positions.iter().flatten() {
            let now = if f == 0 { Some(0) } else { batch.get(next).map(|b| u64_at(b, 0)) };
            next += (f != 0) as usize;
            if now != Some(instr) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The GIL's holder (0: none) and every thread state's bytes, walking the list
    /// again only when its links changed.
    fn snapshot(
        &mut self,
        layout: &Layout,
        mem: &mut Memory,
        batch: &mut Batch,
    ) -> Result<(u64, Vec<Vec<u8>>), String> {
        batch.clear();
        let head_at = batch.push(self.interp + layout.interp_threads_head, 8);
        let locked_at = batch.push(self.gil_locked, 4);
        let holder_at = batch.push(self.gil_holder, 8);
        let enabled_at = self.gil_enabled_at.map(|e| batch.push(e, 4));
        let first = batch.len();
        let len = layout.tstate_len() as usize;
        for &t in &self.list {
            batch.push(t, len);
        }
        mem.read(batch)?;
        let head = batch.get(head_at).map(|b| u64_at(b, 0)).ok_or("the thread list head cannot be read")?;
        self.gil_enabled = enabled_at.is_none_or(|i| batch.get(i).is_some_and(|e| u32_at(e, 0) != 0));
        let holder = match (batch.get(locked_at), batch.get(holder_at)) {
            (Some(l), Some(h)) if self.gil_enabled && u32_at(l, 0) != 0 => u64_at(h, 0),
            _ => 0,
        };
        let cached: Option<Vec<Vec<u8>>> =
            (0..self.list.len()).map(|i| batch.get(first + i).map(<[u8]>::to_vec)).collect();
        let states = match cached.filter(|s| self.links_match(head, s, layout)) {
            Some(states) => states,
            None => self.walk(head, layout, mem)?,
        };
        Ok((holder, states))
    }

    /// The cached list still describes the interpreter: same head, same links.
    fn links_match(&self, head: u64, states: &[Vec<u8>], layout: &Layout) -> bool {
        let mut expected = head;
        for (addr, bytes) in self.list.iter().zip(states) {
            if *addr != expected {
                return false;
            }
            expected = u64_at(bytes, layout.tstate_next);
        }
        expected == 0
    }

    fn walk(&mut self, head: u64, layout: &Layout, mem: &mut Memory) -> Result<Vec<Vec<u8>>, String> {
        self.walks += 1;
        self.list.clear();
        let mut states = Vec::new();
        let mut next = head;
        let mut one = Batch::default();
        while next != 0 {
            if self.list.len() >= MAX_THREADS {
                return Err("the thread list does not end (torn read)".into());
            }
            one.clear();
            one.push(next, layout.tstate_len() as usize);
            mem.read(&mut one)?;
            let bytes = one.get(0).ok_or("a thread state cannot be read (torn read)")?.to_vec();
            self.list.push(next);
            next = u64_at(&bytes, layout.tstate_next);
            states.push(bytes);
        }
        Ok(states)
    }

    fn state(&mut self, addr: u64, bytes: &[u8], holder: u64, now: Instant, layout: &Layout) -> ThreadState {
        let native_tid = u64_at(bytes, layout.tstate_native_thread_id);
        let clock = self.clock(native_tid, now);
        let (ran, cpu_ns, clock_ns) = clock.map_or((None, 0, None), |(ran, used, cpu)| (Some(ran), used, Some(cpu)));
        let on_cpu = ran.is_some_and(|r| r >= RUNNING_SHARE);
        let mut state = ThreadState {
            addr,
            ident: u64_at(bytes, layout.tstate_thread_id),
            frame_ref: 0,
            chunk: 0,
            top: 0,
            holds_gil: holder == addr,
            attached: attached(bytes, layout),
            on_cpu,
            cpu_ns,
            ran,
            clock_ns,
            native_tid,
            still: holder != addr && cpu_ns == 0 && clock.is_some(),
            stood: false,
        };
        state.set_stack(bytes, layout);
        state
    }

    /// A reading skipped as no thread ran: every clock stood still until now.
    pub fn stand_still(&mut self) {
        let now = Instant::now();
        self.clocks.values_mut().for_each(|(_, at)| *at = now);
        self.cpu_ns = 0;
    }

    /// Reads the thread states of `threads` again, for their current stack pointers.
    pub fn reread(
        threads: &mut [ThreadState],
        layout: &Layout,
        mem: &mut Memory,
        batch: &mut Batch,
    ) -> Result<(), String> {
        batch.clear();
        for t in threads.iter() {
            batch.push(t.addr, layout.tstate_len() as usize);
        }
        mem.read(batch)?;
        for (i, t) in threads.iter_mut().enumerate() {
            if let Some(bytes) = batch.get(i) {
                t.set_stack(bytes, layout);
            }
        }
        Ok(())
    }

    /// (share of the wall time since the last reading on a CPU, CPU ns used since
    /// then, the clock now); None for a thread read for the first time or gone.
    fn clock(&mut self, native_tid: u64, now: Instant) -> Option<(f64, u64, u64)> {
        self.clock_reads += 1;
        let cpu = thread_cpu_ns(native_tid)?;
        match self.clocks.insert(native_tid, (cpu, now)) {
            Some((before, at)) if cpu >= before => {
                let used = cpu - before;
                let wall = now.duration_since(at).as_nanos() as f64;
                Some((if wall > 0.0 { used as f64 / wall } else { 0.0 }, used, cpu))
            }
            _ => None,
        }
    }

    fn forget_dead_clocks(&mut self) {
        if self.clocks.len() > 2 * self.list.len() + 64 {
            let now = Instant::now();
            self.clocks.retain(|_, (_, at)| now.duration_since(*at).as_secs() < 10);
        }
    }
}

/// CPU time of another thread of this process, by its native id; None once it exited.
pub fn thread_cpu_ns(native_tid: u64) -> Option<u64> {
    if native_tid == 0 || native_tid > i32::MAX as u64 {
        return None;
    }
    // The kernel's per-thread CPU clock id: (~tid << 3) | CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED.
    clock_ns(((!(native_tid as i32)) << 3) | 6)
}

/// A clock's time in ns; None for a clock that is not there (a thread that exited).
pub fn clock_ns(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer; an invalid clock id only returns EINVAL.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}
