//! What the whole process used, second by second, for a day: its CPU (all of it,
//! and that of threads Python does not know), its resident memory and, where memory
//! per task is tracked, the bytes each task prefix holds; kept beside the samples and
//! exported with each window, resampled to a bounded number of steps.

use crate::heap::arrow;
use crate::heap::live::{self, Change, SecondRead, Totals};
use rustc_hash::FxHashMap;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::VecDeque;

/// Seconds kept: a day.
const SECONDS: usize = 86_400;
/// Steps a window's series is resampled to at most.
const MOST_STEPS: u64 = 1_440;
/// Steps in seconds a window's series may take: the first giving at most `MOST_STEPS`.
const STEPS: [u64; 13] = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];
const NS: u64 = 1_000_000_000;

#[derive(Clone, Copy, Debug)]
struct Second {
    second: u64,
    process_ns: u64,
    native_ns: u64,
    /// Resident memory at the first tick of the second.
    rss: u64,
}

/// What the first tick of a second reads of the process's memory.
struct Memory {
    rss: u64,
    /// Bytes in use by task prefix id and changed totals, where tracked.
    tracked: Option<SecondRead>,
    /// arrow's pool, as last noted (`heap::arrow`).
    arrow: Option<u64>,
}

/// A second's read of memory per task (`live::read_second`); kept apart from `Second`,
/// so a process that does not track memory keeps no room for it.
struct Held {
    second: u64,
    read: SecondRead,
    arrow: Option<u64>,
}

#[derive(Default)]
pub struct Series {
    seconds: VecDeque<Second>,
    held: VecDeque<Held>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CpuTotals {
    pub process_cpu_s: f64,
    pub native_cpu_s: f64,
}

/// The resident memory of this process, from `/proc/self/statm` (0 if unreadable).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { nix::libc::sysconf(nix::libc::_SC_PAGESIZE) }.max(0) as u64
}

impl Series {
    /// Adds a tick's CPU to its second; the first tick of a second reads the memory.
    pub fn record(&mut self, time_ns: u64, process_ns: u64, native_ns: u64) {
        self.add(time_ns, process_ns, native_ns, || Memory {
            rss: resident_bytes(),
            tracked: live::read_second(),
            arrow: arrow::noted(),
        });
    }

    fn add(&mut self, time_ns: u64, process_ns: u64, native_ns: u64, memory: impl FnOnce() -> Memory) {
        let second = time_ns / NS;
        match self.seconds.back_mut() {
            Some(last) if last.second == second => {
                last.process_ns += process_ns;
                last.native_ns += native_ns;
            }
            _ => {
                if self.seconds.len() >= SECONDS {
                    let gone = self.seconds.pop_front().map_or(0, |s| s.second);
                    while self.held.front().is_some_and(|h| h.second <= gone) {
                        self.held.pop_front();
                    }
                }
                let Memory { rss, tracked, arrow } = memory();
                self.seconds.push_back(Second { second, process_ns, native_ns, rss });
                self.held.extend(tracked.map(|read| Held { second, read, arrow }));
            }
        }
    }

    /// The seconds that overlap `[start_ns, stop_ns]`.
    fn within(&self, start_ns: u64, stop_ns: u64) -> impl Iterator<Item = &Second> {
        let first = self.seconds.partition_point(|s| s.second < start_ns / NS);
        let last = self.seconds.partition_point(|s| s.second <= stop_ns / NS);
        self.seconds.range(first..last.max(first))
    }

    /// CPU totals over the seconds that overlap `[start_ns, stop_ns]`.
    pub fn totals(&self, start_ns: u64, stop_ns: u64) -> CpuTotals {
        let (process, native) =
            self.within(start_ns, stop_ns).fold((0, 0), |(p, n), s| (p + s.process_ns, n + s.native_ns));
        CpuTotals { process_cpu_s: process as f64 / 1e9, native_cpu_s: native as f64 / 1e9 }
    }

    /// The window's seconds in at most `MOST_STEPS` steps, for a process's stats:
    /// `start` (Unix seconds, a multiple of `step`), `step`, and per step the CPU
    /// seconds used (`cpu`) and the most resident memory seen (`rss`, bytes); null
    /// where no second of the step was seen. Where memory per task was tracked,
    /// `in_use`: per task prefix (named by `name`), the bytes it held at each step's
    /// last tracked second, largest first; and `arrow`, the most arrow's pool held in
    /// each step, where noted. None if the window holds no second.
    pub fn window(&self, start_ns: u64, stop_ns: u64, name: impl Fn(u32) -> Value) -> Option<Value> {
        let (first, last) = {
            let mut seen = self.within(start_ns, stop_ns);
            let first = seen.next()?.second;
            (first, seen.last().map_or(first, |s| s.second))
        };
        let step = STEPS.into_iter().find(|s| (last - first) / s < MOST_STEPS).unwrap_or(STEPS[STEPS.len() - 1]);
        let start = first - first % step;
        let steps = ((last - start) / step + 1) as usize;
        let (mut cpu, mut rss, mut held, mut arrow) =
            (vec![None; steps], vec![None; steps], vec![None; steps], vec![None; steps]);
        for s in self.within(start_ns, stop_ns) {
            let at = ((s.second - start) / step) as usize;
            *cpu[at].get_or_insert(0.0) += s.process_ns as f64 / 1e9;
            rss[at] = rss[at].max(Some(s.rss));
        }
        let kept = self.held.partition_point(|h| h.second < first);
        for h in self.held.range(kept..).take_while(|h| h.second <= last) {
            let at = ((h.second - start) / step) as usize;
            held[at] = Some(&*h.read.in_use);
            arrow[at] = arrow[at].max(h.arrow);
        }
        let mut out = json!({"start": start, "step": step, "cpu": cpu, "rss": rss});
        if held.iter().any(Option::is_some) {
            out["in_use"] = in_use_by_prefix(&held, name);
        }
        if arrow.iter().any(Option::is_some) {
            out["arrow"] = json!(arrow);
        }
        Some(out)
    }

    /// Per task prefix id of tracking start `start`, what the window `[start_ns,
    /// stop_ns]` saw, to the second: bytes allocated in it, in use at its end and the
    /// most in use in it. `now` (`live::now`) ends a window that reaches past the last
    /// second read.
    pub fn memory_window(&self, start_ns: u64, stop_ns: u64, start: u32, now: &[Change]) -> Vec<(u32, Totals)> {
        let (first, last) = (start_ns / NS, stop_ns.div_ceil(NS));
        let mut before: FxHashMap<u32, Change> = FxHashMap::default();
        let mut after: FxHashMap<u32, (Change, f32)> = FxHashMap::default();
        let mut end = |c: &Change| {
            let (at_end, peak) = after.entry(c.prefix).or_insert((*c, 0.0));
            (*at_end, *peak) = (*c, peak.max(c.peak));
        };
        let reads = self.held.iter().filter(|h| h.read.start == start).take_while(|h| h.second <= last);
        for h in reads {
            for c in h.read.changes.iter() {
                if h.second <= first {
                    before.insert(c.prefix, *c);
                } else {
                    end(c);
                }
            }
        }
        if self.held.back().is_none_or(|h| h.second < last) {
            now.iter().for_each(&mut end);
        }
        let prefixes: rustc_hash::FxHashSet<u32> = before.keys().chain(after.keys()).copied().collect();
        let mut out: Vec<(u32, Totals)> = prefixes
            .into_iter()
            .map(|p| {
                let was = before.get(&p).map_or((0.0, 0.0), |c| (c.allocated, c.in_use as f64));
                let (is, peak) =
                    after.get(&p).map_or((was, 0.0), |(c, peak)| ((c.allocated, c.in_use as f64), *peak as f64));
                (p, Totals::new(is.0 - was.0, is.1, peak.max(was.1).max(is.1)))
            })
            .filter(|(_, t)| t.allocated > 0.0 || t.in_use > 0.0)
            .collect();
        out.sort_by_key(|&(p, _)| p);
        out
    }
}

/// Per prefix in any step, its bytes at each step (0 where a tracked step did not list
/// it, null where no second of the step was tracked), largest first.
fn in_use_by_prefix(held: &[Option<&[(u32, f32)]>], name: impl Fn(u32) -> Value) -> Value {
    let mut ids: Vec<u32> = held.iter().flatten().flat_map(|h| h.iter().map(|&(id, _)| id)).collect();
    ids.sort_unstable();
    ids.dedup();
    let bytes_of = |id: u32| -> Vec<Option<f32>> {
        held.iter().map(|h| h.map(|h| h.iter().find(|(i, _)| *i == id).map_or(0.0, |&(_, b)| b))).collect()
    };
    let mut rows: Vec<(f32, Value)> = ids
        .into_iter()
        .map(|id| {
            let bytes = bytes_of(id);
            let most = bytes.iter().flatten().fold(0.0f32, |m, &b| m.max(b));
            (most, json!({"prefix": name(id), "bytes": bytes}))
        })
        .collect();
    rows.sort_by(|a, b| b.0.total_cmp(&a.0));
    Value::Array(rows.into_iter().map(|(_, row)| row).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn only_rss(rss: u64) -> Memory {
        Memory { rss, tracked: None, arrow: None }
    }

    fn no_name(id: u32) -> Value {
        json!(id)
    }

    #[test]
    fn sums_the_seconds_of_a_window() {
        let mut s = Series::default();
        for i in 0..30u64 {
            s.add(i * 100_000_000, 10_000_000, 4_000_000, || only_rss(1)); // 3 s at 10 ticks a second
        }
        let all = s.totals(0, 3 * NS);
        assert!((all.process_cpu_s - 0.3).abs() < 1e-9 && (all.native_cpu_s - 0.12).abs() < 1e-9);
        assert!((s.totals(NS, NS + NS / 2).process_cpu_s - 0.1).abs() < 1e-9);
        assert_eq!(s.totals(10 * NS, 20 * NS), CpuTotals::default());
    }

    #[test]
    fn a_window_keeps_cpu_and_the_most_memory_per_step() {
        let mut s = Series::default();
        for second in 100..100 + 3_600u64 {
            if second != 107 {
                s.add(second * NS, NS / 2, 0, || only_rss(second * 1000)); // half a core; memory growing
            }
        }
        let w = s.window(0, u64::MAX, no_name).unwrap();
        assert_eq!((w["start"].as_u64(), w["step"].as_u64()), (Some(100), Some(5)), "at most 1,440 steps");
        let (cpu, rss) = (w["cpu"].as_array().unwrap(), w["rss"].as_array().unwrap());
        assert_eq!((cpu.len(), rss.len()), (720, 720));
        assert_eq!((cpu[0].as_f64(), rss[0].as_u64()), (Some(2.5), Some(104_000)), "seconds 100-104");
        assert_eq!(cpu[1].as_f64(), Some(2.0), "second 107 was not seen");
        let short = s.window(200 * NS, 209 * NS, no_name).unwrap();
        assert_eq!(
            (short["start"].as_u64(), short["step"].as_u64(), short["cpu"].as_array().unwrap().len()),
            (Some(200), Some(1), 10)
        );
        assert!(s.window(0, 50 * NS, no_name).is_none());
        let mut gaps = Series::default();
        gaps.add(10 * NS, NS, 0, || only_rss(5));
        gaps.add(13 * NS, NS, 0, || only_rss(6));
        let w = gaps.window(0, u64::MAX, no_name).unwrap();
        assert_eq!(w["rss"], json!([5, null, null, 6]), "a second not seen is null");
    }

    #[test]
    fn bytes_in_use_by_prefix_are_those_of_each_steps_last_tracked_second() {
        let mut s = Series::default();
        let held = |h: &[(u32, f32)]| Memory {
            rss: 1,
            tracked: Some(SecondRead { in_use: h.into(), start: 1, changes: [].into() }),
            arrow: Some(h.len() as u64),
        };
        s.add(NS, NS, 0, || held(&[(1, 10.0)]));
        s.add(2 * NS, NS, 0, || held(&[(2, 30.0), (1, 20.0)]));
        s.add(3 * NS, NS, 0, || only_rss(1)); // tracking stopped
        let w = s.window(0, u64::MAX, no_name).unwrap();
        assert_eq!(
            w["in_use"],
            json!([{"prefix": 2, "bytes": [0.0, 30.0, null]}, {"prefix": 1, "bytes": [10.0, 20.0, null]}])
        );
        assert_eq!(w["arrow"], json!([1, 2, null]), "arrow's pool where tracked");
        let mut untracked = Series::default();
        untracked.add(NS, NS, 0, || only_rss(1));
        assert!(untracked.window(0, u64::MAX, no_name).unwrap().get("in_use").is_none());
    }

    #[test]
    fn a_memory_window_counts_what_was_allocated_in_it_and_held_at_its_end() {
        let mut s = Series::default();
        let change = |prefix, allocated, in_use, peak| Change { prefix, allocated, in_use, peak };
        let read = |start, changes: &[Change]| {
            let changes = changes.into();
            move || Memory { rss: 1, tracked: Some(SecondRead { in_use: [].into(), start, changes }), arrow: None }
        };
        s.add(NS, NS, 0, read(1, &[change(1, 50.0, 40.0, 40.0)])); // a start before this one
        s.add(10 * NS, NS, 0, read(2, &[change(1, 100.0, 80.0, 90.0)]));
        s.add(11 * NS, NS, 0, read(2, &[change(1, 300.0, 20.0, 250.0), change(2, 10.0, 10.0, 10.0)]));
        s.add(12 * NS, NS, 0, read(2, &[]));
        s.add(13 * NS, NS, 0, read(2, &[change(2, 60.0, 0.0, 30.0)]));
        let now = [change(1, 400.0, 120.0, 120.0), change(2, 60.0, 0.0, 0.0)];
        // Seconds 11-12: what second 11's and 12's reads saw past second 10's.
        let w = s.memory_window(10 * NS, 12 * NS, 2, &now);
        assert_eq!(w, [(1, Totals::new(200.0, 20.0, 250.0)), (2, Totals::new(10.0, 10.0, 10.0))]);
        // Reaching the present: ends at `now`.
        let w = s.memory_window(12 * NS, 20 * NS, 2, &now);
        assert_eq!(w, [(1, Totals::new(100.0, 120.0, 120.0)), (2, Totals::new(50.0, 0.0, 30.0))]);
        assert!(s.memory_window(0, 5 * NS, 3, &[]).is_empty(), "another start's reads are not these");
    }
}
