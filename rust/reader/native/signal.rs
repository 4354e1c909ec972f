//! The signal that captures a running thread's native stack, and its handler.
//!
//! Each busy thread gets a timer on its own CPU clock (`timers`), which the kernel
//! fires only while the thread runs, so a busy thread is captured where it runs,
//! without waiting for a CPU to answer a request. The handler only copies: the
//! interrupted registers, a bounded slice of the thread's stack and the thread's
//! innermost Python frame pointer (by `process_vm_readv` on our own pid, which stops
//! short at an unmapped page instead of faulting), into the thread's slot, published
//! with one atomic store. No allocation, lock or unwinding runs in it: the sampling
//! thread unwinds the copy at its next tick, and merges it only with a Python read
//! that saw the same frame pointer.
//!
//! A slot's state word holds its arming's generation beside its phase, and the
//! timer's signal carries that generation: a signal still pending from an earlier
//! arming (or an earlier sampler in this process) never fills a newer one. The
//! handler stays installed for the life of the process, so no signal of ours can
//! ever meet the default disposition, which would end the process.

use crate::reader::FramePointer;
use nix::libc;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU64, Ordering};

/// Slots, so threads captured at once.
pub const SLOTS: usize = 64;
/// The most stack a slot holds.
pub const MAX_COPY: usize = 256 << 10;
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
    /// The frame pointer found there (`UNREAD`: none).
    pointer: AtomicU64,
    ip: AtomicU64,
    sp: AtomicU64,
    bp: AtomicU64,
    kept: [AtomicU64; 5],
    copied: AtomicU64,
    /// Signals that found the slot being read, or still being written.
    busy: AtomicU64,
    buf: AtomicPtr<u8>,
}

#[allow(clippy::declare_interior_mutable_const)] // one value per slot of the table
const UNUSED: Slot = Slot {
    state: AtomicU64::new(FREE),
    want: AtomicU64::new(0),
    pointer_at: AtomicU64::new(0),
    pointer_via: AtomicU64::new(0),
    pointer: AtomicU64::new(UNREAD),
    ip: AtomicU64::new(0),
    sp: AtomicU64::new(0),
    bp: AtomicU64::new(0),
    kept: [const { AtomicU64::new(0) }; 5],
    copied: AtomicU64::new(0),
    busy: AtomicU64::new(0),
    buf: AtomicPtr::new(std::ptr::null_mut()),
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
        if slot.buf.load(Ordering::Acquire).is_null() {
            let buf = Box::leak(vec![0u8; MAX_COPY].into_boxed_slice());
            slot.buf.store(buf.as_mut_ptr(), Ordering::Release);
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

    /// What the handler copies: up to `want` bytes of stack, and the frame pointer at `pointer`.
    pub fn ask(self, want: usize, pointer: Option<FramePointer>) {
        let slot = self.slot();
        slot.want.store(want.min(MAX_COPY) as u64, Ordering::Relaxed);
        slot.pointer_at.store(pointer.map_or(0, |p| p.at), Ordering::Relaxed);
        slot.pointer_via.store(pointer.and_then(|p| p.via).map_or(0, |v| v + 1), Ordering::Relaxed);
    }

    /// The capture waiting in the slot, held until `release`: registers, stack bytes
    /// and frame pointer (None: not read). None if there is none, or the handler is
    /// writing one.
    pub fn capture(self) -> Option<(Regs, &'static [u8], Option<u64>)> {
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
        let len = slot.copied.load(Ordering::Relaxed) as usize;
        let buf = slot.buf.load(Ordering::Acquire);
        // SAFETY: the buffer is MAX_COPY bytes and never freed; the handler wrote
        // `len` of them before publishing DONE, and writes none while it is READING.
        Some((regs, unsafe { std::slice::from_raw_parts(buf, len.min(MAX_COPY)) }, pointer))
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
    let want = slot.want.load(Ordering::Relaxed);
    let buf = slot.buf.load(Ordering::Acquire);
    let at = slot.pointer_at.load(Ordering::Relaxed);
    let (word, copied) =
        if buf.is_null() { (None, 0) } else { copy_stack(PID.load(Ordering::Relaxed), at, sp, want, buf) };
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

/// Reads the word at `word_at` (none at 0) and copies `[sp, sp + want)` into `buf` in
/// one system call, one iovec per stack page so the read stops at the first unmapped
/// page with what came before it. The word goes first: a stack read stopping short
/// must not lose it. Gives the word (None: not read) and the stack bytes copied.
unsafe fn copy_stack(pid: i32, word_at: u64, sp: u64, want: u64, buf: *mut u8) -> (Option<u64>, u64) {
    let end = sp.saturating_add(want.min(MAX_COPY as u64));
    let mut word = 0u64;
    let mut remote = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOVECS + 1];
    let first = usize::from(word_at != 0);
    if word_at != 0 {
        remote[0] = libc::iovec { iov_base: word_at as *mut libc::c_void, iov_len: 8 };
    }
    let (mut at, mut n) = (sp, first);
    while at < end && n < MAX_IOVECS + first {
        let next = ((at / PAGE) + 1) * PAGE;
        let stop = next.min(end);
        remote[n] = libc::iovec { iov_base: at as *mut libc::c_void, iov_len: (stop - at) as usize };
        (at, n) = (stop, n + 1);
    }
    let local = [
        libc::iovec { iov_base: &mut word as *mut u64 as *mut libc::c_void, iov_len: 8 * first },
        libc::iovec { iov_base: buf as *mut libc::c_void, iov_len: (at - sp) as usize },
    ];
    let read = libc::syscall(libc::SYS_process_vm_readv, pid, local.as_ptr(), 2usize, remote.as_ptr(), n, 0usize);
    let read = read.max(0) as u64;
    let skip = 8 * first as u64;
    ((first == 1 && read >= 8).then_some(word), read.saturating_sub(skip))
}
