//! A timer on each busy thread's own CPU clock, whose signal makes the thread copy
//! its stack (`signal`). The kernel fires such a timer only while its thread runs
//! (checked at the scheduler's tick), so a thread is captured where it runs, every
//! interval of CPU it uses, and a thread that sleeps is never signalled.
//!
//! A signal that lands while a thread is entering a system call that would sleep
//! (`poll`, `select`, `nanosleep`) makes it return `EINTR`, which C code may not
//! retry. So only threads not seen in such a call lately are armed; the handler's
//! `SA_RESTART` restarts the rest (reads, writes, futex waits: the GIL, locks).

use super::signal::Armed;
use nix::libc;
use rustc_hash::FxHashMap;
use std::time::Duration;

struct Timer {
    id: libc::timer_t,
    slot: Armed,
}

pub struct Timers {
    signal: i32,
    interval: Duration,
    by_tid: FxHashMap<u64, Timer>,
    /// Slots of deleted timers that a handler was still writing into.
    draining: Vec<Armed>,
    /// Signals that found a slot busy, of timers deleted since.
    busy_before: u64,
}

/// Why a thread could not be armed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unarmed {
    NoSlot,
    /// The thread is gone, or the kernel refused the timer.
    Refused,
}

impl Timers {
    pub fn new(signal: i32, interval: Duration) -> Timers {
        Timers { signal, interval, by_tid: FxHashMap::default(), draining: Vec::new(), busy_before: 0 }
    }

    /// `tid`'s slot, arming a timer on its CPU clock if it has none.
    pub fn arm(&mut self, tid: u64) -> Result<Armed, Unarmed> {
        if let Some(t) = self.by_tid.get(&tid) {
            return Ok(t.slot);
        }
        let slot = Armed::take().ok_or(Unarmed::NoSlot)?;
        match create(tid, self.signal, slot.value(), self.interval) {
            Some(id) => {
                self.by_tid.insert(tid, Timer { id, slot });
                Ok(slot)
            }
            None => {
                self.retire(slot);
                Err(Unarmed::Refused)
            }
        }
    }

    /// Deletes `tid`'s timer, if it has one.
    pub fn disarm(&mut self, tid: u64) {
        if let Some(t) = self.by_tid.remove(&tid) {
            delete(t.id);
            self.busy_before += t.slot.busy();
            self.retire(t.slot);
        }
    }

    /// Deletes the timers of threads not in `live` (sorted): they exited.
    pub fn keep(&mut self, live: &[u64]) {
        self.disarm_where(|tid| live.binary_search(&tid).is_err());
        self.draining.retain(|s| !s.retire());
    }

    /// Deletes every timer.
    pub fn disarm_all(&mut self) {
        self.disarm_where(|_| true);
    }

    fn disarm_where(&mut self, gone: impl Fn(u64) -> bool) {
        let tids: Vec<u64> = self.by_tid.keys().copied().filter(|&t| gone(t)).collect();
        for tid in tids {
            self.disarm(tid);
        }
    }

    pub fn count(&self) -> usize {
        self.by_tid.len()
    }

    /// Signals that found a slot busy.
    pub fn busy(&self) -> u64 {
        self.busy_before + self.by_tid.values().map(|t| t.slot.busy()).sum::<u64>()
    }

    fn retire(&mut self, slot: Armed) {
        if !slot.retire() {
            self.draining.push(slot);
        }
    }
}

impl Drop for Timers {
    fn drop(&mut self) {
        for t in self.by_tid.values() {
            delete(t.id);
            t.slot.retire(); // else the next sampler's `prepare` frees it
        }
    }
}

/// A timer on `tid`'s CPU clock that sends it `signal` with `value` every `interval`
/// of its CPU time; None if the thread is gone.
fn create(tid: u64, signal: i32, value: u64, interval: Duration) -> Option<libc::timer_t> {
    // The kernel's per-thread CPU clock id: (~tid << 3) | CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED.
    let clock = ((!(tid as i32)) << 3) | 6;
    // SAFETY: plain calls on zeroed structs that outlive them.
    unsafe {
        let mut event: libc::sigevent = std::mem::zeroed();
        event.sigev_notify = libc::SIGEV_THREAD_ID;
        event.sigev_signo = signal;
        event.sigev_value = libc::sigval { sival_ptr: value as *mut libc::c_void };
        event.sigev_notify_thread_id = tid as i32;
        let mut id: libc::timer_t = std::mem::zeroed();
        if libc::timer_create(clock, &mut event, &mut id) != 0 {
            return None;
        }
        let every = libc::timespec { tv_sec: interval.as_secs() as _, tv_nsec: interval.subsec_nanos() as _ };
        let spec = libc::itimerspec { it_interval: every, it_value: every };
        if libc::timer_settime(id, 0, &spec, std::ptr::null_mut()) != 0 {
            libc::timer_delete(id);
            return None;
        }
        Some(id)
    }
}

fn delete(id: libc::timer_t) {
    // SAFETY: a timer this process created and has not deleted.
    unsafe {
        libc::timer_delete(id);
    }
}
