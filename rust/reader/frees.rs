//! Which code objects were freed: the interpreter tells us, so the code cache drops
//! just those addresses instead of re-reading every cached code object each tick (two
//! ranges per code object, a third of a busy pandas worker's tick).
//!
//! A cached address can only come to hold another code object after the one cached
//! there was freed, and on 3.11 every free goes through a wrapper around
//! `PyCode_Type.tp_dealloc`, which records the address before the memory is
//! released, so a stack copied after the reuse finds the free already logged. It is
//! looked up at run time (the abi3 module must load anywhere).
//!
//! 3.12+ check every cached object each tick instead. A code watcher
//! (`PyCode_AddWatcher`, per interpreter) would see the same frees at the same
//! moment: `PY_CODE_EVENT_DESTROY` comes from `code_dealloc`, the type's only
//! deallocator (no free list; free-threaded builds free code in a collection, through
//! it too), with the object resurrected, before any field or its memory is released.
//! A missed event is not needed to explain the reuse a watcher let through once on
//! 3.14 (`churned_0057` read as `churned_0056`); the order of a tick is enough: copy
//! the stacks, read the log, fetch the code objects not cached. A function that
//! returns and is freed between the copy and the log read is in the copy; the log
//! drops it, then the fetch reads the dead object (type, names and line table stay
//! until the memory is reused) and caches it with its free already consumed, so the
//! next object at that address shows the old name. The per-tick check heals that a
//! tick later; a log does not, so the cache now drops what it fetched at an address
//! freed since its last look at the log (`CodeCache::refresh`). 3.11's log had the
//! same window (found by reading the code, not seen: the exec-churn test passed 20
//! times in a row here before and after, and 750 churned functions never hit the
//! drop). Watchers can come on once the exec-churn test passes 20 times in a row
//! with them on 3.13, 3.14 and 3.15: not run yet.
//! (3.14+ also count frees in the interpreter's `code_object_generation`, published
//! in `_Py_DebugOffsets`: it says that some code object was freed, not which.)

use nix::libc;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Frees remembered; a reader that falls further behind checks every cached object.
const RING: u64 = 4096;
/// `tp_dealloc` in `PyTypeObject` (after the header, name, basic and item sizes).
const TP_DEALLOC: usize = 48;

static FREED: [AtomicU64; RING as usize] = [const { AtomicU64::new(0) }; RING as usize];
/// Frees logged so far; slot `n % RING` holds the n-th.
static LOGGED: AtomicU64 = AtomicU64::new(0);
static WRITING: AtomicBool = AtomicBool::new(false);
static ORIGINAL_DEALLOC: AtomicUsize = AtomicUsize::new(0);
/// Where the 3.11 wrapper is installed, to see that nobody replaced it since.
static DEALLOC_SLOT: AtomicUsize = AtomicUsize::new(0);
/// Whether the hook is in place, once tried.
static WATCHING: OnceLock<bool> = OnceLock::new();

fn log_free(addr: u64) {
    // Frees hold the GIL; the flag only guards against a second interpreter's thread.
    while WRITING.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        std::hint::spin_loop();
    }
    let n = LOGGED.load(Ordering::Relaxed);
    FREED[(n % RING) as usize].store(addr, Ordering::Relaxed);
    LOGGED.store(n + 1, Ordering::Release);
    WRITING.store(false, Ordering::Release);
}

unsafe extern "C" fn logged_dealloc(code: *mut c_void) {
    log_free(code as u64);
    // SAFETY: set once to PyCode_Type's own tp_dealloc before this wrapper was installed.
    let original: unsafe extern "C" fn(*mut c_void) =
        unsafe { std::mem::transmute(ORIGINAL_DEALLOC.load(Ordering::Acquire)) };
    unsafe { original(code) }
}

fn symbol(name: &std::ffi::CStr) -> *mut c_void {
    // SAFETY: dlsym with RTLD_DEFAULT only looks a name up.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

/// Installs the hook once per process; false where it cannot be.
/// SAFETY: the GIL must be held (it rewrites a type slot).
pub unsafe fn watch(version: (u8, u8)) -> bool {
    *WATCHING.get_or_init(|| unsafe { install(version) })
}

unsafe fn install(version: (u8, u8)) -> bool {
    if version != (3, 11) {
        return false;
    }
    let code_type = symbol(c"PyCode_Type");
    if code_type.is_null() {
        return false;
    }
    // SAFETY: the slot of a static type object, rewritten with the GIL held.
    let slot = unsafe { code_type.cast::<u8>().add(TP_DEALLOC).cast::<usize>() };
    ORIGINAL_DEALLOC.store(unsafe { slot.read() }, Ordering::Release);
    unsafe { slot.write(logged_dealloc as *const () as usize) };
    DEALLOC_SLOT.store(slot as usize, Ordering::Release);
    true
}

/// False once another library replaced the 3.11 wrapper: frees may go unseen.
fn intact() -> bool {
    let slot = DEALLOC_SLOT.load(Ordering::Acquire) as *const usize;
    // SAFETY: a slot of a static type object, mapped for the life of the process.
    slot.is_null() || unsafe { slot.read_volatile() } == logged_dealloc as *const () as usize
}

/// One reader's place in the log of frees.
pub struct FreeLog {
    seen: Option<u64>,
}

impl FreeLog {
    /// Starts at the current end of the log, or reports nothing if there is no hook.
    pub fn new(watching: bool) -> FreeLog {
        FreeLog { seen: watching.then(|| LOGGED.load(Ordering::Acquire)) }
    }

    /// Code objects freed since the last call; None if they are not known (no hook, or
    /// more frees than the log holds): then every cached object must be checked.
    pub fn since_last(&mut self) -> Option<Vec<u64>> {
        let seen = self.seen.filter(|_| intact())?;
        let end = LOGGED.load(Ordering::Acquire);
        let freed: Vec<u64> = (seen..end).map(|n| FREED[(n % RING) as usize].load(Ordering::Relaxed)).collect();
        self.seen = Some(end);
        // Slots read while being overwritten belong to a lap that was missed.
        (LOGGED.load(Ordering::Acquire) - seen <= RING).then_some(freed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_gives_each_free_once_and_owns_up_to_an_overrun() {
        let mut log = FreeLog { seen: Some(LOGGED.load(Ordering::Acquire)) };
        log_free(0x1000);
        log_free(0x2000);
        assert_eq!(log.since_last(), Some(vec![0x1000, 0x2000]));
        assert_eq!(log.since_last(), Some(vec![]));
        for n in 0..=RING {
            log_free(n);
        }
        assert_eq!(log.since_last(), None, "more frees than the log holds");
        assert_eq!(FreeLog::new(false).since_last(), None, "no hook, nothing known");
    }
}
