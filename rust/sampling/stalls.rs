//! The stalls of a process's event loops, kept as long as the history (a day) in
//! 12 bytes each: 1 MiB holds a stall a second for a day. Past that, older stalls are
//! thinned to the longest per step (a second, then longer), the rest counted.

use crate::profile::stalls::Stall;
use std::collections::VecDeque;

/// Records kept at most: a day at one a second.
pub const MOST: usize = 86_400;
const LOOP_BITS: u32 = 3;
const CALL_BITS: u32 = 9;
const START_BITS: u32 = 64 - LOOP_BITS - CALL_BITS;
/// A loop's thread after this many is not told apart from the last.
pub const MOST_LOOPS: usize = 1 << LOOP_BITS;

/// One stall: `at` packs its start (Unix microseconds), its loop's index and the system
/// call the loop was blocked in most (its number + 1; 0: none).
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
struct Record {
    at: u64,
    duration_us: u32,
}

const _: () = assert!(std::mem::size_of::<Record>() == 12);

#[derive(Default)]
pub struct Stalls {
    records: VecDeque<Record>,
    loops: Vec<u64>,
    /// Stalls thinned out, and their time.
    pub dropped: u64,
    pub dropped_ns: u64,
    /// The threshold of the loops watched last; None: none ever was.
    pub threshold_ns: Option<u64>,
    /// Stalls of loops no longer watched that their ring had no room for.
    pub lost: u64,
    /// Seconds a step of thinning spans now: doubles each time the records fill up.
    thin_step_us: u64,
}

impl Stalls {
    pub fn add(&mut self, stall: Stall, keep_ns: u64) {
        let start_us = stall.start_ns / 1000;
        while self.records.front().is_some_and(|r| start_us.saturating_sub(unpack(r.at).0) * 1000 > keep_ns) {
            self.records.pop_front();
        }
        if self.records.len() >= MOST {
            self.thin();
        } else if self.records.len() == self.records.capacity() {
            // Doubling, but never past `MOST`: the records' whole buffer stays in 1 MiB.
            let len = self.records.len();
            self.records.reserve_exact(len.clamp(16, MOST - len));
        }
        let index = match self.loops.iter().position(|&l| l == stall.ident) {
            Some(i) => i,
            None if self.loops.len() < MOST_LOOPS => {
                self.loops.push(stall.ident);
                self.loops.len() - 1
            }
            None => MOST_LOOPS - 1,
        };
        let call = stall.call.map_or(0, |c| u64::from(c) + 1).min((1 << CALL_BITS) - 1);
        let duration_us = (stall.duration_ns() / 1000).min(u64::from(u32::MAX)) as u32;
        let at = (start_us & ((1 << START_BITS) - 1)) | (index as u64) << START_BITS | call << (START_BITS + LOOP_BITS);
        self.records.push_back(Record { at, duration_us });
    }

    /// The stalls that overlap `[start_ns, stop_ns]`, oldest first.
    pub fn window(&self, start_ns: u64, stop_ns: u64) -> Vec<Stall> {
        let decode = |r: &Record| {
            let (start_us, index, call) = unpack(r.at);
            let start_ns = start_us * 1000;
            let ident = self.loops.get(index).copied().unwrap_or(0);
            Stall { start_ns, end_ns: start_ns + u64::from(r.duration_us) * 1000, ident, call }
        };
        self.records.iter().map(decode).filter(|s| s.end_ns >= start_ns && s.start_ns <= stop_ns).collect()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Keeps the longest stall per step in the older half, at a step that leaves at
    /// most a quarter of `MOST` there.
    fn thin(&mut self) {
        let half = self.records.len() / 2;
        self.thin_step_us = (self.thin_step_us * 2).max(1_000_000);
        loop {
            let kept = self.longest_per_step(half);
            if kept.len() <= MOST / 4 {
                let gone = self.records.drain(..half).collect::<Vec<_>>();
                self.dropped += (gone.len() - kept.len()) as u64;
                let time = |rs: &[Record]| rs.iter().map(|r| u64::from(r.duration_us) * 1000).sum::<u64>();
                self.dropped_ns += time(&gone) - time(&kept);
                for r in kept.into_iter().rev() {
                    self.records.push_front(r);
                }
                return;
            }
            self.thin_step_us *= 2;
        }
    }

    fn longest_per_step(&self, n: usize) -> Vec<Record> {
        let mut kept: Vec<Record> = Vec::new();
        for r in self.records.iter().take(n) {
            let step = |r: &Record| unpack(r.at).0 / self.thin_step_us;
            match kept.last_mut() {
                Some(last) if step(last) == step(r) => {
                    if r.duration_us > last.duration_us {
                        *last = *r;
                    }
                }
                _ => kept.push(*r),
            }
        }
        kept
    }
}

/// (start in Unix microseconds, loop index, system call).
fn unpack(at: u64) -> (u64, usize, Option<u16>) {
    let start = at & ((1 << START_BITS) - 1);
    let index = (at >> START_BITS) as usize & (MOST_LOOPS - 1);
    let call = (at >> (START_BITS + LOOP_BITS)) as u16;
    (start, index, call.checked_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const DAY: u64 = 86_400 * S;

    fn stall(start_s: u64, ms: u64) -> Stall {
        let start_ns = 1_800_000_000 * S + start_s * S;
        Stall { start_ns, end_ns: start_ns + ms * 1_000_000, ident: 77, call: Some(230) }
    }

    #[test]
    fn a_stall_comes_back_as_it_went_in() {
        let mut stalls = Stalls::default();
        stalls.add(stall(5, 1234), DAY);
        let other = Stall { ident: 99, call: None, ..stall(9, 200) };
        stalls.add(other, DAY);
        assert_eq!(stalls.window(0, u64::MAX), vec![stall(5, 1234), other]);
        assert_eq!(stalls.window(stall(7, 0).start_ns, u64::MAX), vec![other]);
    }

    #[test]
    fn a_day_of_one_stall_a_second_fits_in_a_mebibyte() {
        let mut stalls = Stalls::default();
        for s in 0..86_400 {
            stalls.add(stall(s, 150), DAY);
        }
        assert_eq!((stalls.len(), stalls.dropped), (86_400, 0));
        assert!(stalls.records.capacity() * std::mem::size_of::<Record>() <= 1 << 20);
    }

    #[test]
    fn past_the_most_the_older_half_keeps_the_longest_per_step() {
        let mut stalls = Stalls::default();
        for s in 0..MOST as u64 + 1 {
            stalls.add(stall(s, if s == 11 { 900 } else { 150 }), 2 * DAY);
        }
        assert!(stalls.len() <= MOST / 2 + MOST / 4 + 1);
        assert_eq!(stalls.dropped as usize, MOST + 1 - stalls.len());
        assert_eq!(stalls.dropped_ns, stalls.dropped * 150_000_000);
        let kept = stalls.window(0, u64::MAX);
        assert!(kept.contains(&stall(11, 900)), "the longest of its step stays");
        assert!(!kept.contains(&stall(10, 150)), "its step's others go");
    }

    #[test]
    fn stalls_older_than_the_history_go() {
        let mut stalls = Stalls::default();
        stalls.add(stall(0, 150), 10 * S);
        stalls.add(stall(20, 150), 10 * S);
        assert_eq!(stalls.window(0, u64::MAX), vec![stall(20, 150)]);
    }
}
