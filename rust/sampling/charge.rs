//! What the budget is charged for each tick: the sampling thread's CPU by its own clock,
//! the sleep and wake between ticks included. Where reading that clock is dear next to a
//! tick (a quiet tick asks the kernel two things), one read at each tick's start charges
//! the tick before, its sleep and its wake; a costly tick (py-spy's reader, native
//! unwinds) is charged as it ends, so the sleep after it is stretched at once. Mixing the
//! two for one tick would charge it into one sleep and leave the next unstretched.

use crate::sampling::cpu::own_cpu_ns;

/// One tick in this many reads the clock at its end too, to time the sleep and wake
/// after it apart from the ticks.
const WAKE_MEASURED_EVERY: u64 = 8;
/// Ticks charged with their sleep and wake above this are charged as they end from then
/// on, until one costs under half of it: there the end read is a small share.
const COSTLY_NS: u64 = 250_000;

pub struct Charge {
    /// The sampler's clock up to which it was charged.
    charged_to: u64,
    /// The sampler's clock at the end of the last tick, where read to time the wake.
    ended: Option<u64>,
    /// Whether ticks are charged as they end.
    at_end: bool,
    ticks: u64,
}

impl Charge {
    /// From now; the first tick, the costliest, is charged as it ends.
    pub fn new() -> Charge {
        Charge { charged_to: own_cpu_ns(), ended: None, at_end: true, ticks: 0 }
    }

    /// At a tick's start, with the sampler's clock then: what to charge (the tick before
    /// unless charged already, the sleep and the wake), and the sleep and wake alone
    /// where they were timed.
    pub fn at_start(&mut self, own_ns: u64) -> (u64, Option<u64>) {
        let spent = self.uncharged(own_ns);
        self.at_end |= spent > COSTLY_NS;
        (spent, self.ended.take().map(|end| own_ns.saturating_sub(end)))
    }

    /// At a tick's end, given the sampler's clock at its start: the tick's CPU where it
    /// is charged now, else 0 (the next start charges it).
    pub fn at_end(&mut self, began_ns: u64) -> u64 {
        let timed = self.ticks % WAKE_MEASURED_EVERY == 0;
        self.ticks += 1;
        if !(self.at_end || timed) {
            return 0;
        }
        let end = own_cpu_ns();
        self.ended = timed.then_some(end);
        if !self.at_end {
            return 0;
        }
        let cost = end.saturating_sub(began_ns);
        self.charged_to = end;
        self.at_end = cost > COSTLY_NS / 2;
        cost
    }

    /// The CPU not charged yet, given the sampler's clock now; charged from here on.
    pub fn uncharged(&mut self, own_ns: u64) -> u64 {
        own_ns.saturating_sub(std::mem::replace(&mut self.charged_to, own_ns))
    }
}
