//! The signal that captures a running thread's native stack, and its handler.
//!
//! Each busy thread gets a timer on its own CPU clock (`timers`), which the kernel
//! fires only while the thread runs, so a busy thread is captured where it runs,
//! without waiting for a CPU to answer a request. The handler only copies: the
//! interrupted registers, a bounded slice of the thread's stack, its innermost
//! Python frame pointer and the top of its live datastack chunk (by
//! `process_vm_readv` on our own pid, which stops short at an unmapped page instead
//! of faulting), into the thread's slot, published with one atomic store. Only the
//! thread itself pushes and pops its frames, and it is stopped in the handler, so
//! both halves are of one instant. No allocation, lock or unwinding runs in it: the
//! sampling thread walks and unwinds the copy at its next tick.
//!
//! A slot's state word holds its arming's generation beside its phase, and the
//! timer's signal carries that generation: a signal still pending from an earlier
//! arming (or an earlier sampler in this process) never fills a newer one. The
//! handler stays installed for the life of the process, so no signal of ours can
//! ever meet the default disposition, which would end the process.

use crate::reader::{clock_ns, FramePointer};
use nix::libc;
use std::ops::Range;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU64, Ordering};

/// Slots, so threads captured at once.
pub const SLOTS: usize = 64;
/// The most stack a slot holds.
pub const MAX_COPY: usize = 256 << 10;
/// The most of a live datastack chunk a slot holds, from its top: the innermost
/// frames, where a thread's frames change; older ones are read when walked.
const MAX_CHUNK: u64 = 64 << 10;
/// A live chunk's top further than this from its start is taken for a torn read.
const MAX_LIVE: u64 = 64 << 20;
const PAGE: u64 = 4096;
const MAX_IOVECS: usize = MAX_COPY / PAGE as usize + 1;

/// Phases: armed and empty, the handler writing, a capture waiting, the sampler reading.
const EMPTY: u64 = 0;
const WRITING: u64 = 1;
const DONE: u64 = 2;
const READING: u64 = 3;
/// A slot no timer fills (generation 0).
const FREE: u64 = 0;

/// A frame pointer the handler could not read.
const UNREAD: u64 = u64::MAX;

/// What the handler saw: the interrupted instruction, stack and frame pointers, and
/// the other registers a callee keeps for its caller (rbx, r12-r15), where assembly
/// without unwind information often keeps its caller's stack pointer.
#[derive(Clone, Copy, Debug, Default)]
pub struct Regs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    pub kept: [u64; 5],
}

/// The registers of `Regs::kept`, as the kernel's context names them.
const KEPT: [libc::c_int; 5] = [libc::REG_RBX, libc::REG_R12, libc::REG_R13, libc::REG_R14, libc::REG_R15];

pub struct Slot {
    /// `generation << 2 | phase`.
    state: AtomicU64,
    /// Bytes to copy.
    want: AtomicU64,
    /// Where the thread's frame pointer is (`at` 0: none; `via` + 1, 0: none).
    pointer_at: AtomicU64,
    pointer_via: AtomicU64,
    /// Where its thread state's live chunk and that chunk's top are (0: none).
    datastack_at: AtomicU64,
    /// The frame pointer found there (`UNREAD`: none).
    pointer: AtomicU64,
    /// The copy of the live chunk's top: its address and length.
    chunk_from: AtomicU64,
    chunk_copied: AtomicU64,
    /// When the handler ran: the monotonic clock and the thread's CPU clock.
    time_ns: AtomicU64,
    cpu_ns: AtomicU64,
    ip: AtomicU64,
    sp: AtomicU64,
    bp: AtomicU64,
    kept: [AtomicU64; 5],
    copied: AtomicU64,
    /// Signals that found the slot being read, or still being written.
    busy: AtomicU64,
    buf: AtomicPtr<u8>,
    chunk_buf: AtomicPtr<u8>,
}

#[allow(clippy::declare_interior_mutable_const)] // one value per slot of the table
const UNUSED: Slot = Slot {
    state: AtomicU64::new(FREE),
    want: AtomicU64::new(0),
    pointer_at: AtomicU64::new(0),
    pointer_via: AtomicU64::new(0),
    datastack_at: AtomicU64::new(0),
    pointer: AtomicU64::new(UNREAD),
    chunk_from: AtomicU64::new(0),
    chunk_copied: AtomicU64::new(0),
    time_ns: AtomicU64::new(0),
    cpu_ns: AtomicU64::new(0),
    ip: AtomicU64::new(0),
    sp: AtomicU64::new(0),
    bp: AtomicU64::new(0),
    kept: [const { AtomicU64::new(0) }; 5],
    copied: AtomicU64::new(0),
    busy: AtomicU64::new(0),
    buf: AtomicPtr::new(std::ptr::null_mut()),
    chunk_buf: AtomicPtr::new(std::ptr::null_mut()),
};
static TABLE: [Slot; SLOTS] = [UNUSED; SLOTS];
/// The process the table belongs to: a forked child starts it over.
static PID: AtomicI32 = AtomicI32::new(0);
/// Armings so far in this process: each arming's generation is new.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Frees the slots no handler is writing (every one, in a process new to the table).
/// A slot a handler never finishes writing (its thread was cancelled in it) stays
/// taken. Buffers are allocated once per process and never freed.
pub fn prepare() {
    let pid = std::process::id() as i32;
    let new_process = PID.swap(pid, Ordering::AcqRel) != pid;
    for slot in &TABLE {
        for (buf, len) in [(&slot.buf, MAX_COPY), (&slot.chunk_buf, MAX_CHUNK as usize)] {
            if buf.load(Ordering::Acquire).is_null() {
                buf.store(Box::leak(vec![0u8; len].into_boxed_slice()).as_mut_ptr(), Ordering::Release);
            }
        }
        if new_process || slot.state.load(Ordering::Acquire) & 3 != WRITING {
            slot.state.store(FREE, Ordering::Release);
        }
    }
}

/// A slot armed for one thread: its index and generation, as the timer's signal
/// carries them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Armed {
    pub index: usize,
    pub generation: u64,
}

impl Armed {
    /// Takes a free slot; None if every one is taken.
    pub fn take() -> Option<Armed> {
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed) + 1;
        let index = TABLE.iter().position(|s| {
            s.state.compare_exchange(FREE, generation << 2 | EMPTY, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        })?;
        TABLE[index].busy.store(0, Ordering::Relaxed);
        Some(Armed { index, generation })
    }

    /// The signal's value: the slot and its generation.
    pub fn value(self) -> u64 {
        self.generation << 8 | self.index as u64
    }

    fn slot(self) -> &'static Slot {
        &TABLE[self.index]
    }

    /// What the handler copies: up to `want` bytes of stack, and the thread's Python
    /// frames as `pointer` says where they are.
    pub fn ask(self, want: usize, pointer: Option<FramePointer>) {
        let slot = self.slot();
        slot.want.store(want.min(MAX_COPY) as u64, Ordering::Relaxed);
        slot.pointer_at.store(pointer.map_or(0, |p| p.at), Ordering::Relaxed);
        slot.pointer_via.store(pointer.and_then(|p| p.via).map_or(0, |v| v + 1), Ordering::Relaxed);
        slot.datastack_at.store(pointer.map_or(0, |p| p.datastack), Ordering::Relaxed);
    }

    /// The capture waiting in the slot, held until `release`; None if there is none,
    /// or the handler is writing one.
    pub fn capture(self) -> Option<Capture> {
        let slot = self.slot();
        let g = self.generation << 2;
        slot.state.compare_exchange(g | DONE, g | READING, Ordering::AcqRel, Ordering::Relaxed).ok()?;
        let regs = Regs {
            ip: slot.ip.load(Ordering::Relaxed),
            sp: slot.sp.load(Ordering::Relaxed),
            bp: slot.bp.load(Ordering::Relaxed),
            kept: slot.kept.each_ref().map(|r| r.load(Ordering::Relaxed)),
        };
        let pointer = Some(slot.pointer.load(Ordering::Relaxed)).filter(|&p| p != UNREAD);
        // SAFETY: the buffers are never freed; the handler wrote the lengths it
        // published before publishing DONE, and writes none while it is READING.
        let bytes = |buf: &AtomicPtr<u8>, len: &AtomicU64, most: usize| unsafe {
            std::slice::from_raw_parts(buf.load(Ordering::Acquire), (len.load(Ordering::Relaxed) as usize).min(most))
        };
        Some(Capture {
            regs,
            stack: bytes(&slot.buf, &slot.copied, MAX_COPY),
            pointer,
            chunk: (
                slot.chunk_from.load(Ordering::Relaxed),
                bytes(&slot.chunk_buf, &slot.chunk_copied, MAX_CHUNK as usize),
            ),
            time_ns: slot.time_ns.load(Ordering::Relaxed),
            cpu_ns: slot.cpu_ns.load(Ordering::Relaxed),
        })
    }

    /// Ends a `capture`: the handler may fill the slot again.
    pub fn release(self) {
        let g = self.generation << 2;
        let _ = self.slot().state.compare_exchange(g | READING, g | EMPTY, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// Signals that found the slot busy.
    pub fn busy(self) -> u64 {
        self.slot().busy.load(Ordering::Relaxed)
    }

    /// Frees the slot once its timer is deleted; false while a handler is still
    /// writing into it (then try again later: a handler that never finishes keeps it).
    pub fn retire(self) -> bool {
        let state = &self.slot().state;
        let now = state.load(Ordering::Acquire);
        if now >> 2 != self.generation {
            return true;
        }
        now & 3 != WRITING && state.compare_exchange(now, FREE, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }
}

/// What a signal copied from its thread, held in its slot until `Armed::release`.
pub struct Capture {
    pub regs: Regs,
    /// The stack from `regs.sp`.
    pub stack: &'static [u8],
    /// The innermost Python frame pointer (None: not read).
    pub pointer: Option<u64>,
    /// The top of the live datastack chunk, from the address given (empty: not copied).
    pub chunk: (u64, &'static [u8]),
    /// When it was taken: the monotonic clock, and the thread's CPU clock (0: unread).
    pub time_ns: u64,
    pub cpu_ns: u64,
}

/// The kernel's `siginfo_t` for `SI_TIMER` on x86-64: 128 bytes, the value at 24.
#[repr(C)]
struct TimerInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    timer: i32,
    overrun: i32,
    value: u64,
    _rest: [u64; 13],
}

/// Whether `signal`'s handler is ours.
pub fn is_ours(signal: i32) -> bool {
    current(signal).is_some_and(|a| a.sa_sigaction == handler as *const () as usize)
}

fn current(signal: i32) -> Option<libc::sigaction> {
    // SAFETY: a query of the disposition into a zeroed struct.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(signal, std::ptr::null(), &mut old) == 0).then_some(old)
    }
}

/// Installs the handler on the highest real-time signal nobody handles, or keeps it
/// where it already is; None if every one is taken. It is never uninstalled.
pub fn install() -> Option<i32> {
    let (low, high) = (libc::SIGRTMIN(), libc::SIGRTMAX());
    if let Some(sig) = (low..=high).find(|&s| is_ours(s)) {
        return Some(sig);
    }
    (low..=high).rev().find(|&sig| {
        // SAFETY: sigaction swaps atomically; a disposition found taken is put back.
        unsafe {
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = handler as *const () as usize;
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, &ours, &mut old) != 0 {
                return false;
            }
            if old.sa_sigaction != libc::SIG_DFL {
                libc::sigaction(sig, &old, std::ptr::null_mut());
                return false;
            }
            true
        }
    })
}

extern "C" fn handler(_signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: errno is this thread's; the kernel passes valid info and context.
    unsafe {
        let errno = *libc::__errno_location();
        answer(info, context);
        *libc::__errno_location() = errno;
    }
}

/// Async-signal-safe: atomics, reads of the context, one or two system calls.
unsafe fn answer(info: *const libc::siginfo_t, context: *const libc::c_void) {
    if info.is_null() || context.is_null() {
        return;
    }
    let info = &*(info as *const TimerInfo);
    if info.code != libc::SI_TIMER {
        return;
    }
    let (index, generation) = ((info.value & 0xff) as usize, info.value >> 8);
    let Some(slot) = TABLE.get(index) else { return };
    let g = generation << 2;
    let now = slot.state.load(Ordering::Acquire);
    if now >> 2 != generation {
        return; // an earlier arming's signal
    }
    if !matches!(now & 3, EMPTY | DONE)
        || slot.state.compare_exchange(now, g | WRITING, Ordering::AcqRel, Ordering::Relaxed).is_err()
    {
        slot.busy.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let gregs = &(*(context as *const libc::ucontext_t)).uc_mcontext.gregs;
    let (ip, sp, bp) = (
        gregs[libc::REG_RIP as usize] as u64,
        gregs[libc::REG_RSP as usize] as u64,
        gregs[libc::REG_RBP as usize] as u64,
    );
    let buf = slot.buf.load(Ordering::Acquire);
    let chunk_buf = slot.chunk_buf.load(Ordering::Acquire);
    if buf.is_null() || chunk_buf.is_null() {
        let _ = slot.state.compare_exchange(g | WRITING, g | EMPTY, Ordering::AcqRel, Ordering::Relaxed);
        return; // not prepared
    }
    let pid = PID.load(Ordering::Relaxed);
    let [word, chunk, top] =
        read_words(pid, slot.pointer_at.load(Ordering::Relaxed), slot.datastack_at.load(Ordering::Relaxed));
    let live =
        chunk.zip(top).filter(|&(c, t)| t > c && t - c <= MAX_LIVE).map(|(c, t)| t.saturating_sub(MAX_CHUNK).max(c)..t);
    let want = slot.want.load(Ordering::Relaxed);
    let (chunk_from, chunk_copied, copied) = copy_stack(pid, live, sp, want, chunk_buf, buf);
    let via = slot.pointer_via.load(Ordering::Relaxed).checked_sub(1);
    let pointer = match (word, via) {
        (Some(p), None) => Some(p),
        (Some(s), Some(off)) => word_in(s.wrapping_add(off), sp, buf, copied),
        (None, _) => None,
    };
    slot.pointer.store(pointer.unwrap_or(UNREAD), Ordering::Relaxed);
    slot.ip.store(ip, Ordering::Relaxed);
    slot.sp.store(sp, Ordering::Relaxed);
    slot.bp.store(bp, Ordering::Relaxed);
    for (kept, reg) in slot.kept.iter().zip(KEPT) {
        kept.store(gregs[reg as usize] as u64, Ordering::Relaxed);
    }
    slot.copied.store(copied, Ordering::Relaxed);
    slot.chunk_from.store(chunk_from, Ordering::Relaxed);
    slot.chunk_copied.store(chunk_copied, Ordering::Relaxed);
    slot.time_ns.store(clock_ns(libc::CLOCK_MONOTONIC).unwrap_or(0), Ordering::Relaxed);
    slot.cpu_ns.store(clock_ns(libc::CLOCK_THREAD_CPUTIME_ID).unwrap_or(0), Ordering::Relaxed);
    // Retired while writing: the slot is no longer this arming's.
    let _ = slot.state.compare_exchange(g | WRITING, g | DONE, Ordering::AcqRel, Ordering::Relaxed);
}

/// The word at `addr` (where a frame pointer lives): from the stack copy `buf` of
/// `copied` bytes from `sp` when it lies there, else read. Async-signal-safe.
unsafe fn word_in(addr: u64, sp: u64, buf: *const u8, copied: u64) -> Option<u64> {
    match addr.checked_sub(sp) {
        Some(off) if off.saturating_add(8) <= copied => Some((buf.add(off as usize) as *const u64).read_unaligned()),
        _ => read_word(addr),
    }
}

/// The word of this process's memory at `addr`, read through the kernel: None where
/// nothing is mapped, never a fault. Async-signal-safe (one system call).
pub fn read_word(addr: u64) -> Option<u64> {
    let mut word = 0u64;
    let local = libc::iovec { iov_base: &mut word as *mut u64 as *mut libc::c_void, iov_len: 8 };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 8 };
    // SAFETY: reads our own memory into a local word.
    let read =
        unsafe { libc::syscall(libc::SYS_process_vm_readv, libc::getpid(), &local, 1usize, &remote, 1usize, 0usize) };
    (read == 8).then_some(word)
}

/// `len` bytes of this process's memory at `addr`, read through the kernel: None where
/// any is not mapped, or is a file's page past its end, never a fault.
pub fn read_memory(addr: u64, len: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: len };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
    // SAFETY: reads our own memory into `buf`, `len` bytes long.
    let read =
        unsafe { libc::syscall(libc::SYS_process_vm_readv, libc::getpid(), &local, 1usize, &remote, 1usize, 0usize) };
    (read == len as i64).then_some(buf)
}

/// The word at `pointer_at` and the two at `datastack_at` (0: none; a frame pointer,
/// a live chunk and its top), in one system call; None for a word not read.
/// Async-signal-safe.
unsafe fn read_words(pid: i32, pointer_at: u64, datastack_at: u64) -> [Option<u64>; 3] {
    let mut words = [0u64; 3];
    let asked = [(pointer_at, 0, 8), (datastack_at, 1, 16)];
    let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
    let (mut local, mut remote, mut n) = ([empty; 2], [empty; 2], 0);
    for &(at, i, len) in asked.iter().filter(|a| a.0 != 0) {
        local[n] = libc::iovec { iov_base: words.as_mut_ptr().add(i) as *mut libc::c_void, iov_len: len };
        remote[n] = libc::iovec { iov_base: at as *mut libc::c_void, iov_len: len };
        n += 1;
    }
    if n == 0 {
        return [None; 3];
    }
    let read = libc::syscall(libc::SYS_process_vm_readv, pid, local.as_ptr(), n, remote.as_ptr(), n, 0usize);
    // A read stops at an iovec it cannot read: those before it are whole.
    let (mut left, mut got) = (read.max(0) as usize, [false; 3]);
    for &(_, i, len) in asked.iter().filter(|a| a.0 != 0) {
        if left >= len {
            got[i..i + len / 8].fill(true);
        }
        left = left.saturating_sub(len);
    }
    [0, 1, 2].map(|i| got[i].then_some(words[i]))
}

/// Copies the `live` range of a datastack chunk into `chunk_buf` and `[sp, sp + want)`
/// into `buf` in one system call, one iovec per stack page so the read stops at the
/// first unmapped page with what came before it. The chunk goes first: it is always
/// mapped, and the stack's end may not be; a chunk that cannot be read is left out.
/// Gives where the chunk's copy starts, its bytes and the stack's bytes copied.
unsafe fn copy_stack(
    pid: i32,
    live: Option<Range<u64>>,
    sp: u64,
    want: u64,
    chunk_buf: *mut u8,
    buf: *mut u8,
) -> (u64, u64, u64) {
    let end = sp.saturating_add(want.min(MAX_COPY as u64));
    let mut remote = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOVECS + 1];
    let (from, chunk_len) = live.as_ref().map_or((0, 0), |r| (r.start, r.end - r.start));
    let first = usize::from(chunk_len > 0);
    if first == 1 {
        remote[0] = libc::iovec { iov_base: from as *mut libc::c_void, iov_len: chunk_len as usize };
    }
    let (mut at, mut n) = (sp, first);
    while at < end && n < MAX_IOVECS + first {
        let next = ((at / PAGE) + 1) * PAGE;
        let stop = next.min(end);
        remote[n] = libc::iovec { iov_base: at as *mut libc::c_void, iov_len: (stop - at) as usize };
        (at, n) = (stop, n + 1);
    }
    let local = [
        libc::iovec { iov_base: chunk_buf as *mut libc::c_void, iov_len: chunk_len as usize },
        libc::iovec { iov_base: buf as *mut libc::c_void, iov_len: (at - sp) as usize },
    ];
    let read = libc::syscall(libc::SYS_process_vm_readv, pid, local.as_ptr(), 2usize, remote.as_ptr(), n, 0usize);
    let read = read.max(0) as u64;
    if read < chunk_len {
        return copy_stack(pid, None, sp, want, chunk_buf, buf);
    }
    (from, chunk_len, read - chunk_len)
}
