//! Where a tick's time goes: wall time per phase, summed over the run, and the CPU
//! the wake before it cost. Read from the time-stamp counter (vDSO), so timing a phase
//! asks the kernel nothing.

use serde::{Serialize, Serializer};
use serde_json::{Map, Value};
use std::time::Instant;

/// A tick's phases, in the order it runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The sleep before the tick and the wake: CPU the kernel charges the sampling
    /// thread between ticks (CPU time, not wall time), measured on some ticks only.
    Wake,
    /// The interpreter's thread list, the GIL and which threads ran.
    Threads,
    /// The frames of the threads read, and code objects not cached.
    Stacks,
    /// Each sampled thread's state from the kernel, and the process's CPU.
    States,
    /// The watched event loops.
    Loops,
    /// Native capture.
    Native,
    /// Samples into the store, and calls counted since the last tick.
    Record,
}

const PHASES: [(Phase, &str); 7] = [
    (Phase::Wake, "wake"),
    (Phase::Threads, "threads"),
    (Phase::Stacks, "stacks"),
    (Phase::States, "states"),
    (Phase::Loops, "loops"),
    (Phase::Native, "native"),
    (Phase::Record, "record"),
];

#[derive(Clone, Debug, Default)]
pub struct Phases {
    ns: [u64; PHASES.len()],
    ticks: u64,
    /// Ticks whose wake was measured: one in a few (see `Loop::run`).
    wakes: u64,
}

impl Phases {
    /// Adds the time since `*since` to `phase`, and restarts `*since` now.
    pub fn add(&mut self, phase: Phase, since: &mut Instant) {
        let now = Instant::now();
        self.ns[phase as usize] += now.duration_since(*since).as_nanos() as u64;
        *since = now;
    }

    /// The CPU charged for one measured sleep and wake.
    pub fn add_wake(&mut self, ns: u64) {
        self.ns[Phase::Wake as usize] += ns;
        self.wakes += 1;
    }

    /// Moves `ns` of what `from` was given to `to` (a phase timed inside another).
    pub fn move_ns(&mut self, from: Phase, to: Phase, ns: u64) {
        let ns = ns.min(self.ns[from as usize]);
        self.ns[from as usize] -= ns;
        self.ns[to as usize] += ns;
    }

    pub fn tick(&mut self) {
        self.ticks += 1;
    }

    /// Mean ns per tick (per measured wake) spent in `phase` so far.
    pub fn mean_ns(&self, phase: Phase) -> u64 {
        self.ns[phase as usize] / self.times(phase)
    }

    /// How many times `phase` was timed (at least 1).
    fn times(&self, phase: Phase) -> u64 {
        if phase == Phase::Wake { self.wakes } else { self.ticks }.max(1)
    }
}

/// Mean microseconds per tick, by phase.
impl Serialize for Phases {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let per_tick = PHASES
            .iter()
            .map(|&(p, name)| (name.to_string(), Value::from(self.ns[p as usize] as f64 / 1e3 / self.times(p) as f64)));
        Map::from_iter(per_tick).serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_phase_gets_the_time_since_the_last() {
        let mut phases = Phases::default();
        let mut since = Instant::now() - std::time::Duration::from_micros(30);
        phases.add(Phase::Stacks, &mut since);
        phases.add(Phase::Record, &mut since);
        phases.tick();
        phases.tick();
        phases.add_wake(40_000);
        let json = serde_json::to_value(&phases).unwrap();
        assert_eq!(json["wake"], 40.0, "per measured wake, not per tick");
        assert!(json["stacks"].as_f64().unwrap() >= 15.0, "per tick, of 2: {json}");
        assert!(json["record"].as_f64().unwrap() < 15.0, "{json}");
        assert_eq!(json["threads"], 0.0);
    }
}
