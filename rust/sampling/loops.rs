//! Event loops watched for stalls. The loop's own thread calls `polling` and `woke`
//! around each poll of its selector; a stall is a stretch of at least the threshold
//! from when the loop was due back at work to when it polled again:
//! - it woke and ran its callbacks for that long (a handler, a state-machine step);
//! - or it overran its poll's deadline, woken on time by the kernel but kept from
//!   returning, by the GIL another thread held.
//!
//! The loop thread only reads the clock and stores atomics: it never waits for the
//! sampler, which drains finished stalls from a small ring at each tick.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Finished stalls a loop can hold between two ticks: far more than a tick can see,
/// since each lasts at least the threshold.
const RING: usize = 64;
/// `since_ns` of a loop polling with no deadline: it is never late.
const NEVER: u64 = u64::MAX;

pub struct LoopWatch {
    /// The thread running the loop (Python's `threading.get_ident()`).
    pub ident: u64,
    threshold_ns: u64,
    /// From when the loop is late: its poll's deadline while it polls, when it was due
    /// back once it returned.
    since_ns: AtomicU64,
    /// When the current iteration was due to start (0: none yet).
    due_ns: AtomicU64,
    /// The current poll's deadline (`NEVER`: none).
    deadline_ns: AtomicU64,
    ring: [(AtomicU64, AtomicU64); RING],
    /// Written by the loop thread only, and `taken` by the sampler only.
    pushed: AtomicUsize,
    taken: AtomicUsize,
    pub lost: AtomicU64,
}

impl LoopWatch {
    pub fn new(ident: u64, threshold_ns: u64) -> LoopWatch {
        LoopWatch {
            ident,
            threshold_ns,
            since_ns: AtomicU64::new(NEVER),
            due_ns: AtomicU64::new(0),
            deadline_ns: AtomicU64::new(NEVER),
            ring: std::array::from_fn(|_| (AtomicU64::new(0), AtomicU64::new(0))),
            pushed: AtomicUsize::new(0),
            taken: AtomicUsize::new(0),
            lost: AtomicU64::new(0),
        }
    }

    /// The loop is about to poll for at most `timeout_ns` (None: until an event):
    /// the iteration that ends here is a stall if it ran long enough.
    pub fn polling(&self, now_ns: u64, timeout_ns: Option<u64>) {
        let due = self.due_ns.load(Ordering::Relaxed);
        if due != 0 && now_ns.saturating_sub(due) >= self.threshold_ns {
            self.push(due, now_ns);
        }
        let deadline = timeout_ns.map_or(NEVER, |t| now_ns.saturating_add(t));
        self.deadline_ns.store(deadline, Ordering::Relaxed);
        self.since_ns.store(deadline, Ordering::Release);
    }

    /// The poll returned: the loop was due back at the poll's deadline, or now if earlier.
    pub fn woke(&self, now_ns: u64) {
        let due = now_ns.min(self.deadline_ns.load(Ordering::Relaxed));
        self.due_ns.store(due, Ordering::Relaxed);
        self.since_ns.store(due, Ordering::Release);
    }

    /// When the loop became late, if it is late at `now_ns`: busy, or past its poll's deadline.
    pub fn late_since(&self, now_ns: u64) -> Option<u64> {
        let since = self.since_ns.load(Ordering::Acquire);
        (since <= now_ns).then_some(since)
    }

    /// Whether the loop has been late at `now_ns` for long enough that its thread is
    /// worth reading even when it waits: a quarter of the threshold, so loops merely
    /// running their callbacks at a tick cost no extra reads.
    pub fn stalling(&self, now_ns: u64) -> bool {
        self.late_since(now_ns).is_some_and(|since| now_ns - since >= self.threshold_ns / 4)
    }

    fn push(&self, start_ns: u64, end_ns: u64) {
        let pushed = self.pushed.load(Ordering::Relaxed);
        if pushed - self.taken.load(Ordering::Acquire) >= RING {
            self.lost.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let (start, end) = &self.ring[pushed % RING];
        start.store(start_ns, Ordering::Relaxed);
        end.store(end_ns, Ordering::Relaxed);
        self.pushed.store(pushed + 1, Ordering::Release);
    }

    /// The stalls finished since the last call, oldest first.
    pub fn drain(&self, mut each: impl FnMut(u64, u64)) {
        let pushed = self.pushed.load(Ordering::Acquire);
        let mut taken = self.taken.load(Ordering::Relaxed);
        while taken < pushed {
            let (start, end) = &self.ring[taken % RING];
            each(start.load(Ordering::Relaxed), end.load(Ordering::Relaxed));
            taken += 1;
        }
        self.taken.store(taken, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn drained(w: &LoopWatch) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        w.drain(|s, e| out.push((s, e)));
        out
    }

    #[test]
    fn a_long_iteration_is_a_stall_and_short_ones_are_not() {
        let w = LoopWatch::new(1, 100 * MS);
        w.polling(1_000 * MS, Some(20 * MS));
        w.woke(1_010 * MS);
        w.polling(1_050 * MS, Some(20 * MS)); // 40 ms of work
        w.woke(1_060 * MS);
        assert_eq!(w.late_since(1_100 * MS), Some(1_060 * MS));
        assert!(!w.stalling(1_080 * MS) && w.stalling(1_085 * MS), "late for a quarter of the threshold");
        w.polling(1_400 * MS, None); // 340 ms of work
        assert_eq!(w.late_since(1_500 * MS), None, "polling with no deadline is never late");
        assert_eq!(drained(&w), vec![(1_060 * MS, 1_400 * MS)]);
        assert!(drained(&w).is_empty());
    }

    #[test]
    fn a_poll_that_overran_its_deadline_counts_from_the_deadline() {
        let w = LoopWatch::new(1, 100 * MS);
        w.polling(1_000 * MS, Some(20 * MS));
        assert_eq!(w.late_since(1_010 * MS), None);
        assert_eq!(w.late_since(1_500 * MS), Some(1_020 * MS), "kept from returning: late");
        w.woke(2_000 * MS); // the GIL came back 1 s late
        w.polling(2_001 * MS, Some(20 * MS));
        assert_eq!(drained(&w), vec![(1_020 * MS, 2_001 * MS)]);
    }

    #[test]
    fn a_full_ring_counts_what_it_loses() {
        let w = LoopWatch::new(1, MS);
        let mut t = 1_000 * MS;
        for _ in 0..RING + 3 {
            w.polling(t, Some(0));
            w.woke(t);
            t += 10 * MS;
        }
        w.polling(t, Some(0));
        assert_eq!(drained(&w).len(), RING);
        assert_eq!(w.lost.load(Ordering::Relaxed), 3);
    }
}
