//! The process's CPU beside its Python threads': what the series records, whether a
//! tick may be quiet (no thread but the sampler used CPU), and how busy the threads
//! Python does not know are (BLAS, arrow).
//!
//! Each clock is a system call (1-7 us cold on an AMD EPYC VM), so a tick asks only
//! what it needs. The sampler's own clock, which the budget is charged by, at every
//! tick. The process's: where the tick may be quiet (every thread stood still at the
//! last read), and else every `PROCESS_EVERY`, which counts all the CPU of the time
//! between. A quiet interval's CPU is the sampler's own, so there the process's clock
//! stands in for the sampler's (`QUIET_SLACK`), at most `DERIVED_AT_MOST` ticks in a
//! row: a parked process's tick asks the kernel for its sleep and one clock.

use crate::reader::clock_ns;
use nix::libc;
use std::time::{Duration, Instant};

/// How often the process's clock is read at least.
const PROCESS_EVERY: Duration = Duration::from_millis(100);
/// CPU the rest of the process may use between two ticks and still count as idle:
/// the sampler's own clock is read just after the process's, so the two deltas differ
/// by its CPU between the reads, up to a cold read's price (~5 us on an AMD EPYC VM;
/// at 2 us, 1 quiet tick in 10 was read in full there). Whether a thread moved is then
/// the reader's to check (`Want::quiet`), so a larger margin costs no truth.
const QUIET_NS: u64 = 10_000;
/// The process's CPU over an interval is taken for the sampler's alone (and its own
/// clock left unread) up to this many times the sampler's CPU over the last quiet
/// interval its clock was read for, plus `QUIET_NS`. What else ran then (a timer's
/// wake) is charged to the budget, which is then overcharged, never overspent; a thread
/// that ran that little and came back to the very instruction it stood at (a wait
/// left and entered again) is seen at the next tick that reads the sampler's clock.
const QUIET_SLACK: u64 = 2;
const DERIVED_AT_MOST: u32 = 3;
/// Threads Python does not know using at least this share of a core, on average over
/// about `NATIVE_SECONDS`, are busy. Averaged because on a loaded machine a pool's
/// threads get the CPU in slices of a few milliseconds: many ticks see none of it.
const NATIVE_BUSY: f64 = 0.1;
const NATIVE_SECONDS: f64 = 0.1;

/// The clocks read at a tick's start.
#[derive(Clone, Copy, Debug)]
pub struct Clocks {
    /// The sampler's CPU clock, or the process's standing in for it in a quiet interval.
    pub own_ns: u64,
    /// The process's CPU clock, where read.
    pub process_ns: Option<u64>,
    /// No thread but the sampler used CPU since the last tick, as far as the process's
    /// clock tells: the reader is to check whether any thread moved.
    pub quiet: bool,
}

pub struct ProcessCpu {
    /// The process's clock and the sampler's at the last reading of the process's, and when.
    last: Option<(u64, u64, Instant)>,
    /// What the Python threads used since, by their own clocks.
    python_ns: u64,
    /// The sampler's CPU over the last quiet interval of one tick its own clock was read for.
    quiet_own_ns: Option<u64>,
    /// Whether the tick before read the process's clock: an interval since is one tick.
    read_at_last_tick: bool,
    /// Ticks in a row whose own CPU the process's clock stood in for.
    derived: u32,
    /// Cores the threads Python does not know used, a moving average over about
    /// `NATIVE_SECONDS`; their CPU is what the process's clock counts and the Python
    /// threads' and the sampler's do not.
    native_cores: f64,
}

impl ProcessCpu {
    pub fn new() -> ProcessCpu {
        ProcessCpu {
            last: None,
            python_ns: 0,
            quiet_own_ns: None,
            read_at_last_tick: false,
            derived: 0,
            native_cores: 0.0,
        }
    }

    /// The clocks at a tick's start; `may_be_quiet`: every thread stood still at the last read.
    pub fn at_start(&mut self, may_be_quiet: bool) -> Clocks {
        let due = self.last.is_none_or(|(_, _, at)| at.elapsed() >= PROCESS_EVERY);
        let one_tick = std::mem::replace(&mut self.read_at_last_tick, may_be_quiet || due);
        if !(may_be_quiet || due) {
            return Clocks { own_ns: own_cpu_ns(), process_ns: None, quiet: false };
        }
        let process = process_cpu_ns();
        let Some((process_before, own_before, _)) = self.last else {
            return Clocks { own_ns: own_cpu_ns(), process_ns: Some(process), quiet: false };
        };
        let used = process.saturating_sub(process_before);
        let derive = may_be_quiet && one_tick && !due && self.derived < DERIVED_AT_MOST;
        if let Some(own) = self.quiet_own_ns.filter(|_| derive) {
            if used <= QUIET_SLACK * own + QUIET_NS {
                self.derived += 1;
                return Clocks { own_ns: own_before + used, process_ns: Some(process), quiet: true };
            }
        }
        self.derived = 0;
        let own_ns = own_cpu_ns();
        let own_used = own_ns.saturating_sub(own_before);
        let quiet = used.saturating_sub(own_used) <= QUIET_NS;
        if quiet && one_tick {
            self.quiet_own_ns = Some(own_used);
        }
        Clocks { own_ns, process_ns: Some(process), quiet }
    }

    /// Call once a tick, after the read, with the tick's `clocks` and the CPU the Python
    /// threads used since the last read: where the process's clock was read, the CPU ns
    /// the process and the threads Python does not know used since its last reading.
    pub fn after_read(&mut self, python_ns: u64, clocks: &Clocks) -> Option<(u64, u64)> {
        self.python_ns += python_ns;
        let process = clocks.process_ns?;
        let now = Instant::now();
        let python_ns = std::mem::take(&mut self.python_ns);
        let (process_before, own_before, at) = self.last.replace((process, clocks.own_ns, now))?;
        let process_used = process.saturating_sub(process_before);
        let own_used = clocks.own_ns.saturating_sub(own_before);
        // Signed: the process's clock lags a running thread's by up to a kernel tick,
        // which a later reading gives back; clamped at 0 each time, that skew would add up.
        let unread = process_used as f64 - python_ns as f64 - own_used as f64;
        let native = process_used.saturating_sub(python_ns).saturating_sub(own_used);
        let wall = now.duration_since(at).as_secs_f64();
        // A process without busy native threads skips the `exp` (a cold call into libm
        // was ~4% of a quiet tick on an AMD EPYC VM); `QUIET_NS` is the clocks' skew.
        if native < QUIET_NS && self.native_cores < 1e-6 {
            self.native_cores = 0.0;
        } else if wall > 0.0 {
            let weight = 1.0 - (-wall / NATIVE_SECONDS).exp();
            self.native_cores += weight * (unread / 1e9 / wall - self.native_cores);
        }
        Some((process_used, native))
    }

    /// Whether the threads Python does not know are busy.
    pub fn native_busy(&self) -> bool {
        self.native_cores >= NATIVE_BUSY
    }
}

fn process_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID).unwrap_or(0)
}

/// The calling thread's CPU clock, in ns.
pub fn own_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID).unwrap_or(0)
}
