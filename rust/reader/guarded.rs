//! Plain copies of this process's own memory that survive a fault.
//!
//! A `process_vm_readv` of scattered ranges costs microseconds per range once the
//! kernel's caches are cold, as they are after a tick's sleep (11 ranges: ~63 us on an
//! AMD EPYC VM, where copying them costs ~2 us). So reads are plain copies, made by
//! one instruction (`rep movsb`) whose fault the handler here recognises by its
//! address: it resumes the copy's fault exit, which reports the range unread. Every
//! other fault goes to the handler installed before ours, as if ours were not there.
//!
//! The application's own handlers win: a handler installed after ours replaces it, and
//! `installed` then says so, so that reads go back to the system call.

use crate::sync::Mutex;
use nix::libc;
use std::mem::MaybeUninit;

std::arch::global_asm!(
    ".pushsection .text.dask_pyspy_guarded_copy,\"ax\",@progbits",
    ".globl dask_pyspy_guarded_copy",
    ".hidden dask_pyspy_guarded_copy",
    ".globl dask_pyspy_guarded_copy_at",
    ".hidden dask_pyspy_guarded_copy_at",
    ".globl dask_pyspy_guarded_copy_fault",
    ".hidden dask_pyspy_guarded_copy_fault",
    // rdi: destination, rsi: source, rdx: length; eax: 0 copied, 1 faulted.
    "dask_pyspy_guarded_copy:",
    "    mov rcx, rdx",
    "dask_pyspy_guarded_copy_at:",
    "    rep movsb",
    "    xor eax, eax",
    "    ret",
    "dask_pyspy_guarded_copy_fault:",
    "    mov eax, 1",
    "    ret",
    ".popsection",
);

extern "C" {
    fn dask_pyspy_guarded_copy(dst: *mut u8, src: *const u8, len: usize) -> u32;
    fn dask_pyspy_guarded_copy_at();
    fn dask_pyspy_guarded_copy_fault();
}

/// The signals a read of memory that is not there raises.
const SIGNALS: [libc::c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];

/// The handlers ours replaced, one per signal of `SIGNALS`: set before ours is
/// installed, read only by ours.
static mut PREVIOUS: [MaybeUninit<libc::sigaction>; 2] = [MaybeUninit::zeroed(), MaybeUninit::zeroed()];
/// Readers that want the handler: installed with the first, removed with the last.
static USERS: Mutex<usize> = Mutex::new(0);

/// Copies `dst.len()` bytes from `src` into `dst`; false if a page of them is not
/// mapped (then `dst` holds a part). Only while `installed()`.
pub fn copy(dst: &mut [u8], src: u64) -> bool {
    // SAFETY: `dst` is writable for its length; reading `src` either succeeds or
    // faults into our handler, which ends the copy.
    unsafe { dask_pyspy_guarded_copy(dst.as_mut_ptr(), src as *const u8, dst.len()) == 0 }
}

/// Whether our handler is the one installed for every signal a bad read raises.
pub fn installed() -> bool {
    SIGNALS.iter().all(|&signal| current(signal).is_some_and(|a| a.sa_sigaction == on_fault as *const () as usize))
}

/// Installs the handler for this user, unless another handler came after ours.
pub fn acquire() {
    let mut users = USERS.lock();
    *users += 1;
    if *users == 1 && !installed() {
        install();
    }
}

/// Gives the handler back once no user is left, where it is still ours.
pub fn release() {
    let mut users = USERS.lock();
    *users = users.saturating_sub(1);
    if *users == 0 && installed() {
        for (i, &signal) in SIGNALS.iter().enumerate() {
            // SAFETY: PREVIOUS[i] was filled by `install`, which put ours in its place.
            unsafe { libc::sigaction(signal, (*std::ptr::addr_of!(PREVIOUS))[i].as_ptr(), std::ptr::null_mut()) };
        }
    }
}

fn current(signal: libc::c_int) -> Option<libc::sigaction> {
    let mut now = MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: a query only: a null new action leaves the disposition alone.
    (unsafe { libc::sigaction(signal, std::ptr::null(), now.as_mut_ptr()) } == 0).then(|| unsafe { now.assume_init() })
}

fn install() {
    for (i, &signal) in SIGNALS.iter().enumerate() {
        // SAFETY: PREVIOUS is written here, under USERS' lock, before our handler (its
        // only reader) is installed for this signal.
        unsafe {
            let previous = &mut (*std::ptr::addr_of_mut!(PREVIOUS))[i];
            let Some(before) = current(signal) else { continue };
            previous.write(before);
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = on_fault as *const () as usize;
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            libc::sigaction(signal, &ours, std::ptr::null_mut());
        }
    }
}

/// A fault in the copy instruction resumes at the copy's fault exit; any other goes
/// to the handler before ours. Async-signal-safe: it reads and writes registers and
/// calls `sigaction` and `raise` only.
extern "C" fn on_fault(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let uc = context.cast::<libc::ucontext_t>();
    // SAFETY: with SA_SIGINFO the kernel passes the interrupted context.
    let rip = unsafe { &mut (*uc).uc_mcontext.gregs[libc::REG_RIP as usize] };
    if *rip as usize == dask_pyspy_guarded_copy_at as *const () as usize {
        *rip = dask_pyspy_guarded_copy_fault as *const () as i64;
        return;
    }
    let Some(i) = SIGNALS.iter().position(|&s| s == signal) else { return };
    // SAFETY: PREVIOUS[i] was written before this handler was installed.
    let previous = unsafe { (*std::ptr::addr_of!(PREVIOUS))[i].assume_init_ref() };
    match previous.sa_sigaction {
        libc::SIG_DFL | libc::SIG_IGN => unsafe {
            // The default action, as without us: the fault, or a sent signal, again.
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        },
        handler if previous.sa_flags & libc::SA_SIGINFO != 0 => {
            let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(handler) };
            handler(signal, info, context);
        }
        handler => {
            let handler: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
            handler(signal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_mapped_memory_and_survives_what_is_not() {
        acquire();
        assert!(installed());
        let data: Vec<u8> = (0..=255).collect();
        let mut out = [0u8; 256];
        assert!(copy(&mut out, data.as_ptr() as u64));
        assert_eq!(&out[..], &data[..]);
        assert!(!copy(&mut out[..8], 8), "the null page");
        // A page unmapped under a pointer that still points at it (a freed chunk).
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        unsafe { libc::munmap(page.cast::<u8>().add(4096).cast(), 4096) };
        let mut across = [0u8; 64];
        assert!(!copy(&mut across, page as u64 + 4096 - 32), "a range running into a gap");
        assert!(copy(&mut across, page as u64), "the mapped page");
        unsafe { libc::munmap(page, 4096) };
        release();
    }
}
