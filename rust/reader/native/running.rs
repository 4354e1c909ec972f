//! Which threads may be sent the signal: one running now that has not blocked since
//! it was last looked at, or whose waits seen lately were all on futexes. A signal
//! makes `poll`, `epoll_wait`, `select` and `nanosleep` return `EINTR` whatever
//! `SA_RESTART` says, and C code may not retry; a thread that blocked in such a call
//! in the last interval may be back in one before the signal lands (a round trip
//! takes tens of microseconds). Futex waits (the GIL, locks, conditions) are retried
//! by glibc and CPython, so threads that only contend for the GIL stay eligible. The
//! state, voluntary context switches (one per block) and pending signals come from
//! one read of `/proc/self/task/TID/status`.

use rustc_hash::FxHashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// A thread not looked at for this long is forgotten (most have exited), its file closed.
const FORGET_AFTER: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ask,
    /// Asleep or in a system call now.
    Blocked,
    /// Blocked since it was last looked at (or never looked at): not this time.
    BlockedLately,
    /// Our signal is still pending for it.
    Pending,
}

struct Seen {
    status: File,
    voluntary: u64,
    at: Instant,
}

#[derive(Default)]
pub struct Running {
    seen: FxHashMap<u64, Seen>,
}

impl Running {
    /// `futexes_only`: every wait of the thread seen lately was on a futex.
    pub fn check(&mut self, tid: u64, signal: i32, futexes_only: bool, now: Instant) -> Verdict {
        let seen = match self.seen.entry(tid) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let Ok(status) = File::open(format!("/proc/self/task/{tid}/status")) else {
                    return Verdict::Blocked; // gone
                };
                e.insert(Seen { status, voluntary: u64::MAX, at: now })
            }
        };
        let mut buf = [0u8; 2048];
        let Ok(n) = seen.status.read_at(&mut buf, 0) else { return Verdict::Blocked };
        let status = Status::parse(&buf[..n]);
        let before = std::mem::replace(&mut seen.voluntary, status.voluntary);
        seen.at = now;
        if status.pending >> (signal - 1) & 1 == 1 {
            Verdict::Pending
        } else if status.state != b'R' {
            Verdict::Blocked
        } else if before != status.voluntary && !futexes_only {
            Verdict::BlockedLately
        } else {
            Verdict::Ask
        }
    }

    /// Closes the files of threads not looked at lately, and of those not in `live`
    /// (sorted): they exited.
    pub fn forget(&mut self, live: &[u64], now: Instant) {
        self.seen.retain(|tid, s| now.duration_since(s.at) < FORGET_AFTER && live.binary_search(tid).is_ok());
    }

    pub fn open(&self) -> usize {
        self.seen.len()
    }
}

/// The fields of a thread's status file that matter here.
#[derive(Debug, PartialEq, Eq)]
struct Status {
    state: u8,
    pending: u64,
    voluntary: u64,
}

impl Status {
    fn parse(text: &[u8]) -> Status {
        let mut s = Status { state: b'?', pending: 0, voluntary: u64::MAX };
        for line in text.split(|&b| b == b'\n') {
            let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
            let value = std::str::from_utf8(&line[colon + 1..]).unwrap_or("").trim();
            match &line[..colon] {
                b"State" => s.state = value.bytes().next().unwrap_or(b'?'),
                b"SigPnd" => s.pending = u64::from_str_radix(value, 16).unwrap_or(0),
                b"voluntary_ctxt_switches" => s.voluntary = value.parse().unwrap_or(u64::MAX),
                _ => {}
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_state_pending_and_switches() {
        let text = b"Name:\tpython\nState:\tS (sleeping)\nSigPnd:\t8000000000000000\nShdPnd:\t0\n\
            voluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t5\n";
        let s = Status::parse(text);
        assert_eq!(s, Status { state: b'S', pending: 1 << 63, voluntary: 1234 });
    }

    #[test]
    fn a_thread_that_blocked_lately_is_not_asked() {
        let mut running = Running::default();
        let tid = nix::unistd::gettid().as_raw() as u64;
        let now = Instant::now();
        // This thread is running while it reads its own status.
        assert_eq!(running.check(tid, 64, false, now), Verdict::BlockedLately, "never looked at");
        assert_eq!(running.check(tid, 64, false, now), Verdict::Ask);
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(running.check(tid, 64, false, now), Verdict::BlockedLately);
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(running.check(tid, 64, true, now), Verdict::Ask, "its waits were futex waits");
        running.forget(&[tid], now + FORGET_AFTER);
        assert_eq!(running.open(), 0);
    }
}
