//! Heavy work (export, merge, render) runs in a thread 10 nicer than its caller's;
//! the sampling thread asks for a short slice, so it is not kept waiting for a CPU.
//!
//! A collection exports in every worker at once, and on a busy machine the event
//! loops then waited for a CPU behind that work. Only work done without the GIL is
//! lowered: a low-priority thread holding the GIL, preempted by busier threads, kept
//! the event loop from the GIL for tens of ms (a priority inversion). The caller's
//! thread keeps its priority, since an unprivileged thread may not raise it again.

use crate::sync::Mutex;
use nix::libc;
use std::panic::resume_unwind;

/// How much nicer than its caller the thread doing heavy work is: weight 110 against
/// 1024, so it gives way to a woken event-loop thread.
const NICE: libc::c_int = 10;

/// `f` in a scoped thread 10 nicer than this one; in this one if no thread can be
/// started (a thread limit), rather than failing. A panic in `f` panics here.
pub fn nicer<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    let job = Mutex::new(Some(f));
    let take = || job.lock().take();
    std::thread::scope(|scope| {
        let run = || {
            lower_priority();
            take().map(|f| f())
        };
        let spawned = std::thread::Builder::new().name("pyspy-heavy".into()).spawn_scoped(scope, run);
        let done = spawned.ok().and_then(|thread| thread.join().unwrap_or_else(|panic| resume_unwind(panic)));
        done.unwrap_or_else(|| take().expect("a job not run by the thread is still here")())
    })
}

/// On Linux nice is per thread (`setpriority` of 0 is the calling thread). A refusal
/// (a sandbox) leaves it as it was: the work still runs.
fn lower_priority() {
    // SAFETY: nice() only changes the calling thread's priority; its result is
    // ignored on purpose (see above).
    unsafe {
        libc::nice(NICE);
    }
}

/// `struct sched_attr` of sched_setattr(2), first version (48 bytes).
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// Asks a slice of `ns` for the calling thread (the sampling thread: long enough for
/// a tick, far shorter than the default ~1.4 ms), keeping its policy and nice value;
/// returns the slice the kernel now reports, or None where it keeps none (before 6.12,
/// a policy other than the default, a sandbox that refuses the calls).
///
/// Since Linux 6.12 (EEVDF custom slices) a woken thread with a shorter slice than the
/// running one preempts it. Without it the sampler woke behind a busy thread on its CPU
/// and read its stack only after that thread's burst: a process pinned to one CPU
/// showed 2% of 1 ms native bursts (AMD EPYC VM, 6.18), 84% with it. Fairness is
/// unchanged: the thread's CPU share is its budget's; a short slice orders who runs first.
pub fn short_slice(ns: u64) -> Option<u64> {
    let mut attr = SchedAttr { size: std::mem::size_of::<SchedAttr>() as u32, ..SchedAttr::default() };
    let size = attr.size;
    // SAFETY: `attr` is a valid sched_attr of `size` bytes; thread 0 is the caller.
    let got = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut attr as *mut SchedAttr, size, 0) };
    if got != 0 || attr.policy != libc::SCHED_OTHER as u32 {
        return None;
    }
    attr.runtime = ns;
    // SAFETY: as above; only the calling thread's scheduling changes.
    let set = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    // SAFETY: as above.
    let read = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut attr as *mut SchedAttr, size, 0) };
    (set == 0 && read == 0 && attr.runtime == ns).then_some(ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own_nice() -> libc::c_int {
        // SAFETY: reads the calling thread's priority.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
    }

    #[test]
    fn runs_nicer_and_leaves_the_caller_as_it_was() {
        let before = own_nice();
        let inside = nicer(own_nice);
        assert_eq!(inside, (before + NICE).min(19));
        assert_eq!(own_nice(), before);
    }

    #[test]
    fn a_short_slice_keeps_the_nice_value() {
        let nice = std::thread::spawn(|| {
            // SAFETY: changes only this test thread's priority.
            unsafe { libc::nice(3) };
            let before = own_nice();
            short_slice(100_000);
            (before, own_nice())
        });
        let (before, after) = nice.join().unwrap();
        assert_eq!(before, after);
    }

    #[test]
    fn a_panic_reaches_the_caller() {
        let caught = std::panic::catch_unwind(|| nicer(|| panic!("in the heavy thread")));
        assert!(caught.is_err());
    }
}
