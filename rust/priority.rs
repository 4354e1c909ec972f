//! Heavy work (export, merge, render) runs in a thread 10 nicer than its caller's.
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
    fn a_panic_reaches_the_caller() {
        let caught = std::panic::catch_unwind(|| nicer(|| panic!("in the heavy thread")));
        assert!(caught.is_err());
    }
}
