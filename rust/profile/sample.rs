//! One sample: a thread's stack at a moment (or a stretch of time, once folded),
//! its state, and the columns samples travel in.

/// A sample's state at its moment, drawn in proportion to what the kernel says the
/// thread did over the tick (see `states.rs`). None of the state bits: blocked.
pub const FLAG_ACTIVE: u8 = 1;
/// Holding the GIL; with no other bit, blocked while holding it (a C call that kept it).
pub const FLAG_GIL: u8 = 2;
pub const FLAG_CPU_WAIT: u8 = 4;
pub const FLAG_GIL_WAIT: u8 = 8;
pub const FLAG_NATIVE: u8 = 16;
/// Holding the GIL while an event loop's thread waited for it (recorded at the tick).
pub const FLAG_BLOCKS_LOOP: u8 = 32;
/// Inside one of its process's event-loop stalls: the loop's thread, or a thread
/// holding the GIL the loop waited for (set by a window, from the stalls it overlaps).
pub const FLAG_STALL: u8 = 64;

/// What a thread was doing when sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// On a CPU, holding the GIL: running Python (or C that kept the GIL).
    CpuGil,
    /// On a CPU without the GIL: a C kernel, compression, I/O in C.
    Cpu,
    /// Runnable, waiting for a CPU: more busy threads than cores.
    CpuWait,
    /// Waiting to take the GIL from another thread.
    GilWait,
    /// Waiting on a lock while threads Python does not know (BLAS, arrow) used the CPU.
    Native,
    /// Blocked: I/O, a lock, a sleep.
    Blocked,
}

impl State {
    pub const ALL: [State; 6] =
        [State::CpuGil, State::Cpu, State::CpuWait, State::GilWait, State::Native, State::Blocked];

    pub fn of(flags: u8) -> State {
        if flags & FLAG_ACTIVE != 0 {
            if flags & FLAG_GIL != 0 {
                State::CpuGil
            } else {
                State::Cpu
            }
        } else if flags & FLAG_CPU_WAIT != 0 {
            State::CpuWait
        } else if flags & FLAG_GIL_WAIT != 0 {
            State::GilWait
        } else if flags & FLAG_NATIVE != 0 {
            State::Native
        } else {
            State::Blocked
        }
    }

    /// The flags of this state, with the GIL bit where the thread held it.
    pub fn flags(self, holds_gil: bool) -> u8 {
        let gil = if holds_gil { FLAG_GIL } else { 0 };
        match self {
            State::CpuGil => FLAG_ACTIVE | FLAG_GIL,
            State::Cpu => FLAG_ACTIVE,
            State::CpuWait => FLAG_CPU_WAIT | gil,
            State::GilWait => FLAG_GIL_WAIT,
            State::Native => FLAG_NATIVE,
            State::Blocked => gil,
        }
    }

    /// The name in dumps and pprof labels.
    pub fn name(self) -> &'static str {
        match self {
            State::CpuGil => "cpu-gil",
            State::Cpu => "cpu",
            State::CpuWait => "cpu-wait",
            State::GilWait => "gil-wait",
            State::Native => "native",
            State::Blocked => "blocked",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Capture time, nanoseconds since the Unix epoch.
    pub time_ns: u64,
    pub thread: u32,
    pub stack: u32,
    pub tag: Option<u32>,
    /// What the thread's event loop was doing, where it ran no task.
    pub activity: Option<u32>,
    /// The wall time this sample stands for.
    pub weight_us: u32,
    /// CPU time the thread used since the previous tick (0 where not measured).
    pub cpu_us: u32,
    /// Samples this one stands for: 1, or more in an aggregated profile (see `Aggregator`).
    pub count: u32,
    pub flags: u8,
    /// How long after `time_ns` the sample's time went, in `COVER_NS` units, for one
    /// that stands for a stretch (a folded history row); 0: its weight says, from
    /// `time_ns` on, as for a raw sample. Fits the struct's padding.
    pub cover: u16,
}

/// The unit of `Sample::cover`: 65,535 of them hold the longest folded bucket (an hour).
pub const COVER_NS: u64 = 100_000_000;

/// `v * num / den` rounded down, without overflow.
fn scaled(v: u32, num: u64, den: u64) -> u64 {
    (u128::from(v) * u128::from(num) / u128::from(den)) as u64
}

impl Sample {
    /// Where this sample's time went: `[time_ns, time_ns + cover)`, or None for a raw one.
    pub fn extent(&self) -> Option<(u64, u64)> {
        (self.cover > 0).then(|| (self.time_ns, self.time_ns + u64::from(self.cover) * COVER_NS))
    }

    /// The part of this sample's time that fell in `[lo, hi)`, where its time went
    /// evenly over `[from, to)`; None if none did. Parts are cut at the same points of
    /// one running total, so the parts of adjacent ranges add up to the whole exactly.
    pub fn part(&self, (from, to): (u64, u64), (lo, hi): (u64, u64)) -> Option<Sample> {
        let (lo, hi) = (lo.max(from), hi.min(to));
        if lo >= hi {
            return None;
        }
        let cover = ((hi - lo) / COVER_NS).min(u64::from(u16::MAX)) as u16;
        if (lo, hi) == (from, to) {
            // Whole (most rows of a long window): no division.
            return (self.weight_us > 0 || self.count > 0).then_some(Sample { time_ns: lo, cover, ..*self });
        }
        let len = to - from;
        let cut = |v: u32| (scaled(v, hi - from, len) - scaled(v, lo - from, len)) as u32;
        let part = Sample {
            time_ns: lo,
            weight_us: cut(self.weight_us),
            cpu_us: cut(self.cpu_us),
            count: cut(self.count),
            cover,
            ..*self
        };
        (part.weight_us > 0 || part.count > 0).then_some(part)
    }
}

/// Samples travel as columns, times as differences: most samples of a tick share
/// its time, so the wire carries a 0 instead of a 19-digit timestamp.
pub mod columns {
    use super::Sample;
    use serde::{de::Error, Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Columns {
        time_delta_ns: Vec<i64>,
        thread: Vec<u32>,
        stack: Vec<u32>,
        /// -1: no task.
        tag: Vec<i64>,
        /// -1: no activity; empty: none has one.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        activity: Vec<i64>,
        weight_us: Vec<u32>,
        cpu_us: Vec<u32>,
        /// Empty: every sample counts once.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        count: Vec<u32>,
        flags: Vec<u8>,
        /// Empty: no sample stands for a stretch.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cover: Vec<u16>,
    }

    pub fn serialize<S: Serializer>(samples: &[Sample], s: S) -> Result<S::Ok, S::Error> {
        let mut last = 0i64;
        let columns = Columns {
            time_delta_ns: samples
                .iter()
                .map(|x| {
                    let t = x.time_ns as i64;
                    let d = t - last;
                    last = t;
                    d
                })
                .collect(),
            thread: samples.iter().map(|x| x.thread).collect(),
            stack: samples.iter().map(|x| x.stack).collect(),
            tag: samples.iter().map(|x| x.tag.map_or(-1, i64::from)).collect(),
            activity: if samples.iter().all(|x| x.activity.is_none()) {
                Vec::new()
            } else {
                samples.iter().map(|x| x.activity.map_or(-1, i64::from)).collect()
            },
            weight_us: samples.iter().map(|x| x.weight_us).collect(),
            cpu_us: samples.iter().map(|x| x.cpu_us).collect(),
            count: if samples.iter().all(|x| x.count == 1) {
                Vec::new()
            } else {
                samples.iter().map(|x| x.count).collect()
            },
            flags: samples.iter().map(|x| x.flags).collect(),
            cover: if samples.iter().all(|x| x.cover == 0) {
                Vec::new()
            } else {
                samples.iter().map(|x| x.cover).collect()
            },
        };
        columns.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Sample>, D::Error> {
        let c = Columns::deserialize(d)?;
        let n = c.time_delta_ns.len();
        let columns = [c.thread.len(), c.stack.len(), c.tag.len(), c.weight_us.len(), c.cpu_us.len(), c.flags.len()];
        let optional = [c.count.len(), c.activity.len(), c.cover.len()];
        if columns.iter().any(|&l| l != n) || optional.iter().any(|&l| l != 0 && l != n) {
            return Err(D::Error::custom("sample columns differ in length"));
        }
        let mut time = 0i64;
        Ok((0..n)
            .map(|i| {
                time += c.time_delta_ns[i];
                Sample {
                    time_ns: time as u64,
                    thread: c.thread[i],
                    stack: c.stack[i],
                    tag: u32::try_from(c.tag[i]).ok(),
                    activity: c.activity.get(i).and_then(|&a| u32::try_from(a).ok()),
                    weight_us: c.weight_us[i],
                    cpu_us: c.cpu_us[i],
                    count: c.count.get(i).copied().unwrap_or(1),
                    flags: c.flags[i],
                    cover: c.cover.get(i).copied().unwrap_or(0),
                }
            })
            .collect())
    }
}
