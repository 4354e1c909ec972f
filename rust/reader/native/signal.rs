//! The signal that asks a thread for its native stack, and its handler.
//!
//! The handler only copies: the interrupted registers, a bounded slice of the
//! thread's stack and the thread's innermost Python frame pointer (by
//! `process_vm_readv` on our own pid, which stops short at an unmapped page instead
//! of faulting), into a slot the sampler set aside, published with one atomic store.
//! No allocation, lock or unwinding runs in it: the sampling thread unwinds the copy
//! afterwards, and merges it only with a Python read that saw the same frame pointer.
//!
//! A slot's state word holds the request's sequence number beside its phase, so a
//! late answer to an abandoned request can never fill a newer one.

use crate::reader::FramePointer;
use nix::libc;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Slots, so threads asked at once.
pub const SLOTS: usize = 16;
/// The most stack a slot holds.
pub const MAX_COPY: usize = 256 << 10;
const PAGE: u64 = 4096;
const MAX_IOVECS: usize = MAX_COPY / PAGE as usize + 1;

const FREE: u64 = 0;
const ASKED: u64 = 1;
const WRITING: u64 = 2;
const DONE: u64 = 3;

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
    /// `seq << 2 | phase`.
    state: AtomicU64,
    /// Bytes to copy, set with the request.
    want: AtomicU64,
    /// Where the request's frame pointer is (`at` 0: none; `via` + 1, 0: none).
    pointer_at: AtomicU64,
    pointer_via: AtomicU64,
    /// The frame pointer found there (`UNREAD`: none).
    pointer: AtomicU64,
    ip: AtomicU64,
    sp: AtomicU64,
    bp: AtomicU64,
    kept: [AtomicU64; 5],
    copied: AtomicU64,
    buf: AtomicPtr<u8>,
}

#[allow(clippy::declare_interior_mutable_const)] // one value per slot of the table
const EMPTY: Slot = Slot {
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
    buf: AtomicPtr::new(std::ptr::null_mut()),
};
static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
static PID: AtomicI32 = AtomicI32::new(0);
/// Answers given so far: the sampler sleeps on it (a futex) while threads answer.
static ANSWERS: AtomicU32 = AtomicU32::new(0);

/// The slots' buffers, allocated once per process and never freed: a handler may
/// still be writing into one when its sampler goes.
pub fn prepare() {
    PID.store(std::process::id() as i32, Ordering::Relaxed);
    for slot in &TABLE {
        if slot.buf.load(Ordering::Acquire).is_null() {
            let buf = Box::leak(vec![0u8; MAX_COPY].into_boxed_slice());
            slot.buf.store(buf.as_mut_ptr(), Ordering::Release);
        }
        slot.state.store(FREE, Ordering::Release);
    }
}

impl Slot {
    pub fn at(index: usize) -> &'static Slot {
        &TABLE[index]
    }

    /// Opens request `seq` for up to `want` bytes of stack and the frame pointer at `pointer`.
    pub fn ask(&self, seq: u64, want: usize, pointer: Option<FramePointer>) {
        self.want.store(want.min(MAX_COPY) as u64, Ordering::Relaxed);
        self.pointer_at.store(pointer.map_or(0, |p| p.at), Ordering::Relaxed);
        self.pointer_via.store(pointer.and_then(|p| p.via).map_or(0, |v| v + 1), Ordering::Relaxed);
        self.state.store(seq << 2 | ASKED, Ordering::Release);
    }

    pub fn answered(&self, seq: u64) -> bool {
        self.state.load(Ordering::Acquire) == seq << 2 | DONE
    }

    /// Withdraws an unanswered request; false if the handler is writing it (then
    /// wait for `answered`).
    pub fn withdraw(&self, seq: u64) -> bool {
        let asked = seq << 2 | ASKED;
        match self.state.compare_exchange(asked, FREE, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(now) => now != seq << 2 | WRITING,
        }
    }

    /// The registers, stack bytes and frame pointer (None: not read) of an answered request.
    pub fn answer(&self) -> (Regs, &[u8], Option<u64>) {
        let regs = Regs {
            ip: self.ip.load(Ordering::Relaxed),
            sp: self.sp.load(Ordering::Relaxed),
            bp: self.bp.load(Ordering::Relaxed),
            kept: self.kept.each_ref().map(|r| r.load(Ordering::Relaxed)),
        };
        let pointer = Some(self.pointer.load(Ordering::Relaxed)).filter(|&p| p != UNREAD);
        let len = self.copied.load(Ordering::Relaxed) as usize;
        let buf = self.buf.load(Ordering::Acquire);
        // SAFETY: the buffer is MAX_COPY bytes and never freed; the handler wrote
        // `len` of them before publishing DONE, and writes no more until asked again.
        (regs, unsafe { std::slice::from_raw_parts(buf, len.min(MAX_COPY)) }, pointer)
    }

    pub fn release(&self) {
        self.state.store(FREE, Ordering::Release);
    }
}

/// The kernel's `siginfo_t` for `SI_QUEUE` on x86-64: 128 bytes, the value at 24.
#[repr(C)]
struct QueueInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    pid: i32,
    uid: u32,
    value: u64,
    _rest: [u64; 13],
}

/// Sends request `seq` for slot `index` to thread `tid`; false if it could not be sent
/// (the thread is gone).
pub fn send(signal: i32, tid: u64, index: usize, seq: u64) -> bool {
    let pid = PID.load(Ordering::Relaxed);
    let info = QueueInfo {
        signo: signal,
        errno: 0,
        code: libc::SI_QUEUE,
        _pad: 0,
        pid,
        uid: unsafe { libc::getuid() },
        value: seq << 8 | index as u64,
        _rest: [0; 13],
    };
    // SAFETY: a plain system call on a value that outlives it.
    let rc = unsafe { libc::syscall(libc::SYS_rt_tgsigqueueinfo, pid, tid as i32, signal, &info as *const QueueInfo) };
    rc == 0
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
/// where it already is; None if every one is taken.
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

/// Gives `signal` back its default disposition, if it is still ours. Only when no
/// request is outstanding: a pending signal would then end the process.
pub fn uninstall(signal: i32) {
    if is_ours(signal) {
        // SAFETY: restores SIG_DFL, as found at install.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(signal, &dfl, std::ptr::null_mut());
        }
    }
}

extern "C" fn handler(_signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: errno is this thread's; the kernel passes valid info and context.
    unsafe {
        let errno = *libc::__errno_location();
        answer(info, context);
        *libc::__errno_location() = errno;
    }
}

/// Async-signal-safe: atomics, reads of the context, one system call.
unsafe fn answer(info: *const libc::siginfo_t, context: *const libc::c_void) {
    if info.is_null() || context.is_null() {
        return;
    }
    let info = &*(info as *const QueueInfo);
    let pid = PID.load(Ordering::Relaxed);
    if info.code != libc::SI_QUEUE || info.pid != pid {
        return;
    }
    let (index, seq) = ((info.value & 0xff) as usize, info.value >> 8);
    let Some(slot) = TABLE.get(index) else { return };
    let asked = seq << 2 | ASKED;
    if slot.state.compare_exchange(asked, seq << 2 | WRITING, Ordering::AcqRel, Ordering::Relaxed).is_err() {
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
    let (word, copied) = if buf.is_null() { (None, 0) } else { copy_stack(pid, at, sp, want, buf) };
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
    slot.state.store(seq << 2 | DONE, Ordering::Release);
    ANSWERS.fetch_add(1, Ordering::Release);
    libc::syscall(libc::SYS_futex, ANSWERS.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1, 0usize);
}

/// The count of answers, for `wait_for_answer`.
pub fn answers() -> u32 {
    ANSWERS.load(Ordering::Acquire)
}

/// Sleeps until an answer comes after `seen` answers, or `timeout` passes.
pub fn wait_for_answer(seen: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: a futex wait on our own counter; it returns at once if the count moved.
    unsafe {
        libc::syscall(libc::SYS_futex, ANSWERS.as_ptr(), libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG, seen, &ts);
    }
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
