//! Thread states from the kernel. Each sample stands for a random moment of its slot,
//! and takes the state of its thread there, so states add up without bias as the
//! sample times do:
//! - on a CPU with the probability its CPU clock gives for the interval (the share it
//!   ran since the last tick). Not from a look at that moment: the sampler, just woken,
//!   has often preempted it then.
//! - otherwise, what it waits in now: a system call (`/proc/self/task/TID/syscall`,
//!   kept open and read with `pread`), where a futex inside the GIL's own state is a
//!   wait for the GIL. A thread in none is running or runnable now, and was in the run
//!   queue for the share of its time off a CPU its `schedstat` gives (the kernel's count
//!   of run-queue waits that ended since it was last read), else in its last wait. Not
//!   from its look now: a thread read only when it wakes shares a core with the
//!   sampler, which has just preempted it. Without the file: the run queue if its CPU
//!   clock stands still between two readings a few microseconds apart. A thread
//!   attached to a free-threaded interpreter runs Python and waits in no call: unread.

use crate::profile::sample::State;
use crate::reader::{thread_cpu_ns, GilAt, ThreadStack};
use nix::libc;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Instant;

/// A thread that ran at least this share of the time since the last tick was on a CPU
/// throughout: it is not read further.
const RAN_THROUGHOUT: f64 = 0.97;
/// Threads whose files are kept open at most.
const MAX_OPEN: usize = 256;
/// How often a runnable thread's `schedstat` is read at most: each tick, it cost one
/// `pread` (1-12 us on an AMD EPYC VM) per thread drawn runnable, 6 of a 3.13t tick's
/// 8 spinning threads. The waits it counts carry over to the next reading.
const SCHEDSTAT_EVERY: std::time::Duration = std::time::Duration::from_millis(50);
/// A thread found waiting for the GIL that since stood at one instruction, holding no
/// GIL and using little CPU (`ThreadStack::stood`), waits for it still: what CPU it used
/// was the wait's own (CPython's waiters wake each switch interval to ask for the GIL),
/// as taking it would have run Python. Its file is read anyway after this many ticks.
const GIL_WAIT_KEPT: u64 = 4;
/// A wait read at one tick stands for the next, unread, in a thread holding no GIL: a
/// thread that ran part of each interval (GIL contention, an event loop, tasks sharing
/// cores) had its file read at most ticks, the costliest read of a dask worker's tick
/// (19% of its sampler's CPU on an AMD EPYC VM). The wait then drawn is the thread's at
/// a moment one tick earlier, so drawn as often as it is seen: unbiased, a change of
/// wait seen one tick late.
const WAIT_STANDS_TICKS: u64 = 1;
/// How long a wait seen stays in a thread's record (`blocks_on_futexes_only`).
const WAITS_LATELY: std::time::Duration = std::time::Duration::from_secs(5);

/// What a thread waits in, from its current system call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    /// A futex inside the GIL's own state.
    Gil,
    /// Another futex: a lock, a condition, a pool's queue.
    Lock,
    /// Anything else: I/O, a sleep.
    Other,
    /// Not in a system call: on a CPU or waiting for one.
    Running,
}

struct Files {
    syscall: File,
    /// The wait last read, and the CPU clock then: a thread whose clock has not moved
    /// since has not left that system call.
    wait: Option<(u64, Wait)>,
    /// What it was last seen blocked in (`Running`: never), and the system call's number.
    blocked_in: Wait,
    call: Option<u16>,
    /// When it was last seen blocked in a call that a signal ends with `EINTR`.
    eintr_at: Option<Instant>,
    /// The tick that last drew its state: `wait` holds for a tick only if the one
    /// before drew it too, as a thread not read meanwhile (idle) may have run.
    drawn_at: u64,
    /// The tick at which the file was last read.
    read_at: u64,
    /// Whether the last draw took the wait read at the draw before (`WAIT_STANDS_TICKS`).
    reused: bool,
    /// The call that draw found it blocked in, where one was read.
    drawn_call: Option<u16>,
    /// Its `schedstat`, opened with `syscall` so that a thread's descriptors do not
    /// depend on whether it was read; None where the kernel has none.
    schedstat: Option<File>,
    /// Its CPU time and the run-queue delay drawn so far, in ns, at the last reading,
    /// and when.
    queued: Option<(u64, u64, Instant)>,
    /// The share that reading gave, drawn from until `SCHEDSTAT_EVERY` has passed.
    last_share: Option<f64>,
}

impl Files {
    fn open(tid: u64) -> Option<Files> {
        let syscall = File::open(format!("/proc/self/task/{tid}/syscall")).ok()?;
        Some(Files {
            syscall,
            wait: None,
            blocked_in: Wait::Running,
            call: None,
            eintr_at: None,
            drawn_at: 0,
            read_at: 0,
            reused: false,
            drawn_call: None,
            schedstat: File::open(format!("/proc/self/task/{tid}/schedstat")).ok(),
            queued: None,
            last_share: None,
        })
    }

    /// What the thread waits in, and whether its syscall file was read for it at `tick`;
    /// `holds_gil`: it holds the GIL now, so it waits in no wait read before.
    fn wait(&mut self, cpu_ns: u64, gil: &GilAt, tick: u64, holds_gil: bool) -> (Wait, bool) {
        if let Some((_, wait)) = self.wait.filter(|(at, _)| *at == cpu_ns) {
            return (wait, false);
        }
        if let Some((_, wait)) = self.wait.filter(|_| !holds_gil && tick - self.read_at <= WAIT_STANDS_TICKS) {
            self.reused = true;
            return (wait, false);
        }
        self.read_at = tick;
        let mut buf = [0u8; 160];
        let line = self.syscall.read_at(&mut buf, 0).ok().and_then(|n| std::str::from_utf8(&buf[..n]).ok());
        let (wait, call) = line.map_or((Wait::Running, None), |l| classify(l, gil));
        self.wait = Some((cpu_ns, wait));
        if call.is_some() {
            self.call = call;
        }
        if wait == Wait::Other && call.is_some_and(ends_with_eintr) {
            self.eintr_at = Some(Instant::now());
        }
        (wait, true)
    }

    /// Whether `t`, found waiting for the GIL at the tick before, waits for it still
    /// at `tick` without a read (`GIL_WAIT_KEPT`); kept as read then if so.
    fn still_waits_for_gil(&mut self, t: &ThreadStack, tick: u64) -> bool {
        let waited = self.wait.is_some_and(|(_, w)| w == Wait::Gil) && tick - self.read_at < GIL_WAIT_KEPT;
        let Some(clock) = t.clock_ns.filter(|_| waited && t.stood) else {
            return false;
        };
        self.wait = Some((clock, Wait::Gil));
        true
    }

    /// The share of its time off a CPU since its last reading the thread spent in the
    /// run queue: waits that ended, so not one the sampler may be causing now. A wait longer
    /// than that time (one that ended as the thread ran most of the interval) carries
    /// over to the next reading, so every wait the kernel counted is drawn. None at the
    /// first reading, or where the kernel keeps no count (no file, or zeros). Read at
    /// most every `SCHEDSTAT_EVERY`; the share stands for the ticks in between.
    fn queued_share(&mut self) -> Option<f64> {
        if self.queued.is_some_and(|(_, _, at)| at.elapsed() < SCHEDSTAT_EVERY) {
            return self.last_share;
        }
        self.last_share = self.read_queued_share();
        self.last_share
    }

    fn read_queued_share(&mut self) -> Option<f64> {
        let mut buf = [0u8; 80];
        let n = self.schedstat.as_ref()?.read_at(&mut buf, 0).ok()?;
        let mut fields = std::str::from_utf8(&buf[..n]).ok()?.split_ascii_whitespace().map(|f| f.parse::<u64>().ok());
        let (ran, queued) = (fields.next()??, fields.next()??);
        let now = Instant::now();
        let (ran_before, counted, at) = self.queued.replace((ran, queued, now)).filter(|_| ran > 0)?;
        let off_cpu = now.duration_since(at).as_nanos().saturating_sub(ran.saturating_sub(ran_before).into());
        let off_cpu = u64::try_from(off_cpu).unwrap_or(u64::MAX);
        let drawn = queued.saturating_sub(counted).min(off_cpu);
        self.queued = Some((ran, counted + drawn, now));
        (off_cpu > 0).then(|| drawn as f64 / off_cpu as f64)
    }
}

/// The wait a syscall file's line says, and the call's number.
fn classify(line: &str, gil: &GilAt) -> (Wait, Option<u16>) {
    if line.starts_with("running") {
        return (Wait::Running, None);
    }
    let mut fields = line.split_ascii_whitespace();
    let nr = fields.next().and_then(|f| f.parse::<i64>().ok());
    let addr = fields.next().and_then(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16).ok());
    let wait = match (nr, addr) {
        (Some(nr), Some(addr)) if nr == libc::SYS_futex => match gil {
            GilAt::Range(r) if r.contains(&addr) => Wait::Gil,
            GilAt::HeldElsewhere(true) => Wait::Gil,
            _ => Wait::Lock,
        },
        _ => Wait::Other,
    };
    (wait, nr.and_then(|n| u16::try_from(n).ok()))
}

/// Whether a signal ends system call `nr` with `EINTR` even under `SA_RESTART`
/// (signal(7)): sleeps, polls and waits with a timeout. Reads, writes, socket calls
/// without a timeout and futex waits (the GIL, locks) are restarted.
fn ends_with_eintr(nr: u16) -> bool {
    const CALLS: [libc::c_long; 18] = [
        libc::SYS_poll,
        libc::SYS_ppoll,
        libc::SYS_select,
        libc::SYS_pselect6,
        libc::SYS_epoll_wait,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_pwait2,
        libc::SYS_nanosleep,
        libc::SYS_clock_nanosleep,
        libc::SYS_pause,
        libc::SYS_rt_sigsuspend,
        libc::SYS_rt_sigtimedwait,
        libc::SYS_semop,
        libc::SYS_semtimedop,
        libc::SYS_msgrcv,
        libc::SYS_msgsnd,
        libc::SYS_io_getevents,
        libc::SYS_io_uring_enter,
    ];
    CALLS.contains(&libc::c_long::from(nr))
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StateStats {
    pub syscall_reads: u64,
    /// GIL waits drawn again without a read, the thread having stood in them (`GIL_WAIT_KEPT`).
    pub gil_waits_kept: u64,
    /// Waits drawn as read at the tick before, unread (`WAIT_STANDS_TICKS`).
    pub waits_reused: u64,
    /// Threads past `MAX_OPEN` at a tick, whose states fell back to their CPU clock alone.
    pub unopened: u64,
    /// Threads whose files (`syscall`, `schedstat`) are open now: each live thread.
    pub syscall_files: usize,
}

pub struct States {
    files: FxHashMap<u64, Files>,
    /// Ticks so far (`count_tick` counts them).
    ticks: u64,
    pub stats: StateStats,
    /// The live threads whose files were last opened, all of them; threads past `MAX_OPEN` then.
    tracked: Vec<u64>,
    past_cap: u64,
}

impl States {
    pub fn new() -> States {
        States { files: FxHashMap::default(), ticks: 0, stats: StateStats::default(), tracked: Vec::new(), past_cap: 0 }
    }

    /// Call once a tick, before its states are drawn.
    pub fn count_tick(&mut self) {
        self.ticks += 1;
    }

    /// The state of `t` at a moment drawn by `u` (uniform in [0, 1)); `native`: the
    /// threads Python does not know are busy.
    pub fn state(&mut self, t: &ThreadStack, gil: &GilAt, u: f64, native: bool) -> State {
        if t.ran.is_some_and(|r| r >= RAN_THROUGHOUT) {
            return if t.holds_gil { State::CpuGil } else { State::Cpu };
        }
        let Some(tid) = t.native_tid else { return guess(t) };
        let Some(files) = self.files.get_mut(&tid) else { return guess(t) };
        // One that has not run since it was seen blocked, at the tick before, is still
        // in the same call.
        let drawn_before = std::mem::replace(&mut files.drawn_at, self.ticks) + 1 == self.ticks;
        files.drawn_call = None;
        // A wait taken from the draw before was not seen: one not run since is read.
        let reused = std::mem::take(&mut files.reused);
        let seen = drawn_before && !reused;
        let still = seen && t.cpu_ns == 0 && t.ran.is_some();
        if let Some((_, wait)) = files.wait.filter(|(_, w)| still && *w != Wait::Running) {
            files.drawn_call = files.call;
            return blocked(wait, native);
        }
        if seen && files.still_waits_for_gil(t, self.ticks) {
            files.drawn_call = files.call;
            self.stats.gil_waits_kept += 1;
            // What CPU it used, it used in the wait, without the GIL.
            return if u < t.ran.unwrap_or(0.0) { State::Cpu } else { State::GilWait };
        }
        // Holding the GIL, it ran Python for its share of the interval: a moment drawn
        // there needs no look at its wait, which then no longer holds.
        if t.holds_gil && t.ran.is_some_and(|r| u < r) {
            files.wait = None;
            return State::CpuGil;
        }
        // Attached with no GIL (free-threaded): running Python, so in no blocking call
        // (CPython detaches before one). Its file would say "running"; not read, as
        // every such thread's would be each tick.
        let (wait, before) = if t.runs_python && !t.holds_gil {
            (Wait::Running, None)
        } else {
            let Some(before) = t.clock_ns.or_else(|| thread_cpu_ns(tid)) else { return guess(t) };
            let (wait, read) = files.wait(before, gil, self.ticks, t.holds_gil);
            self.stats.syscall_reads += read as u64;
            self.stats.waits_reused += files.reused as u64;
            (wait, Some(before))
        };
        if wait != Wait::Running {
            files.blocked_in = wait;
        }
        let ran = t.ran.unwrap_or(if t.active { 1.0 } else { 0.0 });
        if u < ran {
            // A thread waiting for the GIL now ran Python, holding it, until it had to let go.
            return if t.holds_gil || wait == Wait::Gil { State::CpuGil } else { State::Cpu };
        }
        match wait {
            // Running or runnable now: the rest of the interval was the run queue, for the
            // share of its time off a CPU the kernel counted, then its last wait (a wait
            // not seen for one never seen blocked). Which call that wait was in is not
            // known: it may be long ago (a thread not read meanwhile).
            Wait::Running => match files.queued_share() {
                Some(queued) if u < ran + queued * (1.0 - ran) => State::CpuWait,
                Some(_) => blocked(files.blocked_in, native),
                // Without the kernel's count: off a CPU and runnable now, its clock stands still.
                None if files.blocked_in != Wait::Running && on_cpu_now(tid, before) => {
                    blocked(files.blocked_in, native)
                }
                None => State::CpuWait,
            },
            blocked_in => {
                files.drawn_call = files.call;
                blocked(blocked_in, native)
            }
        }
    }

    /// The system call, by number, `tid` was in at this tick's draw of its state, if
    /// it was drawn blocked in one it was read in.
    pub fn call(&self, tid: u64) -> Option<u16> {
        self.files.get(&tid).filter(|f| f.drawn_at == self.ticks).and_then(|f| f.drawn_call)
    }

    /// Whether `tid` was watched and not seen lately in a call that a signal ends
    /// with `EINTR`, which C code may not retry.
    pub fn may_be_signalled(&self, tid: u64) -> bool {
        let lately = |at: Option<Instant>| at.is_some_and(|t| t.elapsed() < WAITS_LATELY);
        self.files.get(&tid).is_some_and(|f| !lately(f.eintr_at))
    }

    /// Keeps the files of each thread of `live` (sorted) open, and only those: a
    /// thread's files open at the first tick that lists it and close at the first that
    /// does not, so a process holds two per thread, whether they were read.
    pub fn track_threads(&mut self, live: &[u64]) {
        // Most ticks see the threads of the last: nothing to open or close.
        if live != self.tracked {
            self.files.retain(|tid, _| live.binary_search(tid).is_ok());
            self.past_cap = 0;
            for &tid in live {
                if self.files.contains_key(&tid) {
                    continue;
                }
                if self.files.len() >= MAX_OPEN {
                    self.past_cap += 1;
                } else if let Some(files) = Files::open(tid) {
                    self.files.insert(tid, files);
                }
            }
            // One whose files failed to open is tried again at the next tick.
            self.tracked.clear();
            if self.files.len() + self.past_cap as usize == live.len() {
                self.tracked.extend_from_slice(live);
            }
        }
        self.stats.unopened += self.past_cap;
    }

    pub fn stats(&self) -> StateStats {
        StateStats { syscall_files: self.files.len(), ..self.stats }
    }
}

/// The state of a thread blocked in `wait`; `native`: threads Python does not know are busy.
fn blocked(wait: Wait, native: bool) -> State {
    match wait {
        Wait::Gil => State::GilWait,
        Wait::Lock if native => State::Native,
        Wait::Lock | Wait::Other | Wait::Running => State::Blocked,
    }
}

/// Whether the CPU clock of `tid` moves past `before` (read now if None): on a CPU now.
fn on_cpu_now(tid: u64, before: Option<u64>) -> bool {
    let Some(before) = before.or_else(|| thread_cpu_ns(tid)) else { return false };
    thread_cpu_ns(tid).is_some_and(|after| after > before)
}

/// Without the kernel's figures: on a CPU if the reader saw it work.
fn guess(t: &ThreadStack) -> State {
    match (t.active, t.holds_gil) {
        (true, true) => State::CpuGil,
        (true, false) => State::Cpu,
        (false, _) => State::Blocked,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_futex_wait_is_the_gils_only_inside_its_state() {
        let gil = GilAt::Range(0x1000..0x10e0);
        let futex = |addr: u64| format!("{} 0x{addr:x} 0x89 0x0 0x0 0x0 0xffffffff 0x7ffd 0x7f12\n", libc::SYS_futex);
        assert_eq!(classify(&futex(0x1030), &gil).0, Wait::Gil);
        assert_eq!(classify(&futex(0x2000), &gil).0, Wait::Lock);
        assert_eq!(classify("running\n", &gil).0, Wait::Running);
        assert_eq!(classify("0 0x3 0x7f 0x20000 0x0 0x0 0x0 0x7ffd 0x7f12\n", &gil).0, Wait::Other, "read(2): I/O");
        assert_eq!(classify("0 0x3 0x7f 0x20000 0x0 0x0 0x0 0x7ffd 0x7f12\n", &gil).1, Some(0), "the call's number");
        assert_eq!(classify(&futex(0x2000), &GilAt::HeldElsewhere(true)).0, Wait::Gil);
        assert_eq!(classify(&futex(0x2000), &GilAt::HeldElsewhere(false)).0, Wait::Lock);
    }

    fn drawn(tid: u64) -> ThreadStack {
        let (active, holds_gil, runs_python) = (false, false, false);
        let (frames, evals, marks) = (Vec::new(), None, Ok(Default::default()));
        ThreadStack {
            ident: 1,
            name: None,
            frames,
            evals,
            active,
            holds_gil,
            runs_python,
            cpu_ns: 0,
            clock_ns: None,
            ran: Some(0.0),
            stood: false,
            native_tid: Some(tid),
            pointer: None,
            marks,
        }
    }

    #[test]
    fn a_call_seen_before_a_gap_is_not_named_in_a_later_interval() {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let (tid, spinning, stop) =
            (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (t, s, x) = (tid.clone(), spinning.clone(), stop.clone());
        let napper = std::thread::spawn(move || {
            t.store(nix::unistd::gettid().as_raw() as u64, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(300));
            s.store(true, Ordering::SeqCst);
            while !x.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        while tid.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let (tid, gil) = (tid.load(Ordering::SeqCst), GilAt::HeldElsewhere(false));
        let in_call = || {
            std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).is_ok_and(|l| !l.starts_with("running"))
        };
        while !in_call() {
            std::thread::yield_now();
        }
        let mut states = States::new();
        states.track_threads(&[tid]);
        states.count_tick();
        assert_eq!(states.state(&drawn(tid), &gil, 0.5, false), State::Blocked, "asleep");
        assert!(states.call(tid).is_some(), "in the call it was read in");
        while !spinning.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        // A tick that does not draw it, then one that does: the rest of the interval
        // may be drawn as its last wait, but not in that call.
        states.count_tick();
        states.count_tick();
        states.state(&drawn(tid), &gil, 0.99, false);
        assert_eq!(states.call(tid), None, "its nap's call is old news");
        stop.store(true, Ordering::Relaxed);
        napper.join().unwrap();
    }

    #[test]
    fn a_wait_read_stands_for_one_tick_and_never_for_a_thread_still_since() {
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (wake, waiting) = std::sync::mpsc::channel::<()>();
        let waiter = std::thread::spawn(move || {
            tid_tx.send(nix::unistd::gettid().as_raw() as u64).unwrap();
            waiting.recv().unwrap();
        });
        let tid = tid_rx.recv().unwrap();
        let in_call = || {
            std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).is_ok_and(|l| !l.starts_with("running"))
        };
        while !in_call() {
            std::thread::yield_now();
        }
        let (mut states, gil) = (States::new(), GilAt::HeldElsewhere(false));
        states.track_threads(&[tid]);
        // Each tick: its CPU clock, what it ran since the tick before, whether it holds
        // the GIL; then the reads and reuses counted so far.
        let ticks = [
            (100, 0, false, 1, 0),   // read: a lock's futex
            (200, 100, false, 1, 1), // ran a little: the wait read at the tick before stands
            (200, 0, false, 2, 1),   // still since, but its wait was not seen: read
            (300, 100, false, 2, 2),
            (300, 0, false, 3, 2),
            (400, 100, true, 4, 2), // holding the GIL it is in no wait read before
        ];
        for (clock, ran_ns, holds_gil, reads, reused) in ticks {
            states.count_tick();
            let t = ThreadStack {
                clock_ns: Some(clock),
                cpu_ns: ran_ns,
                ran: Some(ran_ns as f64 / 10_000.0),
                holds_gil,
                ..drawn(tid)
            };
            let state = states.state(&t, &gil, 0.5, false);
            assert_eq!(state, State::Blocked, "at clock {clock}");
            assert_eq!((states.stats.syscall_reads, states.stats.waits_reused), (reads, reused), "at clock {clock}");
        }
        wake.send(()).unwrap();
        waiter.join().unwrap();
    }

    #[test]
    fn the_run_queue_share_is_the_kernels_since_the_last_reading_and_stands_a_while() {
        let tid = nix::unistd::gettid().as_raw() as u64;
        let mut files = Files::open(tid).unwrap();
        assert_eq!(files.queued_share(), None, "nothing to count from at the first reading");
        // Off a CPU past the reading's span, so a share.
        std::thread::sleep(SCHEDSTAT_EVERY + std::time::Duration::from_millis(10));
        let share = files.queued_share().expect("this kernel keeps schedstat");
        assert!((0.0..=1.0).contains(&share), "{share}");
        let read_at = files.queued.map(|(_, _, at)| at);
        assert_eq!(files.queued_share(), Some(share));
        assert_eq!(files.queued.map(|(_, _, at)| at), read_at, "not read again so soon");
    }

    #[test]
    fn a_threads_file_is_open_while_reads_list_the_thread() {
        let mut states = States::new();
        let tid = nix::unistd::gettid().as_raw() as u64;
        let gone = u64::from(i32::MAX as u32); // no such thread: its file cannot open
        states.track_threads(&[tid, gone]);
        assert_eq!(states.stats().syscall_files, 1);
        states.track_threads(&[tid]);
        assert_eq!(states.stats().syscall_files, 1, "opened once");
        states.track_threads(&[]);
        assert_eq!(states.stats().syscall_files, 0, "closed once not listed");
    }
}
