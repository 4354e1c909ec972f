//! What a tick learns of the watched event loops: which loop threads are late (their
//! samples are kept, whatever the options say of idle threads), whether one waits for
//! the GIL (its holder is marked), the system calls a late loop is blocked in, and the
//! stalls finished since the last tick.

use crate::profile::sample::State;
use crate::profile::stalls::Stall;
use crate::reader::ThreadStack;
use crate::sampling::loops::LoopWatch;
use crate::sampling::stalls::Stalls;
use crate::sampling::states::States;
use crate::sync::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// How long stalls are kept: as long as a default history.
pub const KEEP_NS: u64 = 86_400 * 1_000_000_000;

/// This tick's view of the loops.
#[derive(Default)]
pub struct LoopsNow {
    /// Threads of loops late at this tick.
    pub late: Vec<u64>,
    /// A loop's thread waits for the GIL.
    pub gil_waited: bool,
}

impl LoopsNow {
    pub fn is_late(&self, ident: u64) -> bool {
        self.late.contains(&ident)
    }
}

/// The system calls a loop's thread was seen blocked in while late since one moment:
/// wall microseconds by call number.
type Calls = (u64, FxHashMap<u16, u64>);

#[derive(Default)]
pub struct Watching {
    /// Per loop thread: the calls of its current lateness and of the one before,
    /// which a stall that ended just before this tick still needs.
    calls: FxHashMap<u64, [Calls; 2]>,
    /// Stalls finished while the store of stalls was busy.
    pending: Vec<Stall>,
}

impl Watching {
    /// Reads the loops at a tick at `time_ns` standing for `weight_us`, after the states.
    pub fn tick(
        &mut self,
        loops: &Mutex<Vec<Arc<LoopWatch>>>,
        stalls: &Mutex<Stalls>,
        now: (&[ThreadStack], &[State], &States),
        time_ns: u64,
        weight_us: u64,
    ) -> LoopsNow {
        let (stacks, states, kernel) = now;
        let mut out = LoopsNow::default();
        let loops = loops.lock();
        for watch in loops.iter() {
            let i = stacks.iter().position(|t| t.ident == watch.ident);
            let state = i.map(|i| states[i]);
            out.gil_waited |= state == Some(State::GilWait);
            if let Some(since) = watch.late_since(time_ns) {
                out.late.push(watch.ident);
                let [current, before] = self.calls.entry(watch.ident).or_default();
                if current.0 != since {
                    *before = std::mem::replace(current, (since, FxHashMap::default()));
                }
                let call = i.and_then(|i| stacks[i].native_tid).and_then(|tid| kernel.call(tid));
                if let (Some(State::Blocked), Some(call)) = (state, call) {
                    *current.1.entry(call).or_default() += weight_us;
                }
            }
            watch.drain(|start_ns, end_ns| {
                let seen = self.calls.get(&watch.ident).into_iter().flatten();
                let calls = seen.filter(|(since, _)| *since == start_ns).flat_map(|(_, calls)| calls.iter());
                let call = calls.max_by_key(|(_, us)| **us).map(|(c, _)| *c);
                self.pending.push(Stall { start_ns, end_ns, ident: watch.ident, call });
            });
        }
        drop(loops);
        if !self.pending.is_empty() {
            if let Some(mut stalls) = stalls.try_lock() {
                for stall in self.pending.drain(..) {
                    stalls.add(stall, KEEP_NS);
                }
            }
        }
        out
    }

    /// Stores the stalls still pending: sampling stops.
    pub fn flush(&mut self, stalls: &Mutex<Stalls>) {
        let mut stalls = stalls.lock();
        for stall in self.pending.drain(..) {
            stalls.add(stall, KEEP_NS);
        }
    }
}
