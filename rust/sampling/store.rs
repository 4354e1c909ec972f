//! The live sample store of one process: interned tables plus a time-ordered ring
//! of samples, kept under a memory cap by evicting the oldest samples and, when
//! the tables themselves grow (thread churn, many task keys), compacting them to
//! what the remaining samples still use.

use crate::profile::build::{Aggregator, Builder, Remap};
use crate::profile::model::{Frame, Metadata, Process, ProfileData, Sample, Tag, Thread};
use rustc_hash::FxHashSet;
use serde::Serialize;
use std::collections::VecDeque;

pub const SAMPLE_BYTES: usize = std::mem::size_of::<Sample>();

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StoreStats {
    pub samples_recorded: u64,
    pub samples_evicted: u64,
    pub samples_held: usize,
    pub compactions: u64,
    pub bytes: usize,
    pub max_bytes: usize,
    pub oldest_ns: Option<u64>,
}

/// Which samples an export takes: those captured in `[start_ns, stop_ns]`, aggregated
/// into one profile with `aggregate` (see `Aggregator`).
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub start_ns: u64,
    pub stop_ns: u64,
    pub aggregate: bool,
}

/// What a window export would hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct WindowSize {
    /// Samples taken in the window.
    pub samples: u64,
    /// Approximate memory of the exported profile.
    pub bytes: u64,
}

/// One sample to record, its frames already interned (root first).
pub struct Recorded<'a> {
    pub time_ns: u64,
    pub ident: u64,
    pub name: Option<String>,
    pub frames: &'a [u32],
    pub tag: Option<&'a Tag>,
    pub activity: Option<&'a str>,
    pub weight_us: u32,
    pub cpu_us: u32,
    pub flags: u8,
}

pub struct Store {
    tables: Builder,
    ring: VecDeque<Sample>,
    max_bytes: usize,
    recorded: u64,
    evicted: u64,
    compactions: u64,
}

impl Store {
    pub fn new(max_bytes: usize) -> Store {
        Store { tables: Builder::default(), ring: VecDeque::new(), max_bytes, recorded: 0, evicted: 0, compactions: 0 }
    }

    /// Records one thread's stack (frames root first).
    #[cfg(test)]
    pub fn record(
        &mut self,
        time_ns: u64,
        ident: u64,
        frames: impl Iterator<Item = Frame>,
        tag: Option<&Tag>,
        weight_us: u32,
        flags: u8,
    ) {
        let ids: Vec<u32> = frames.map(|f| self.frame_id(f)).collect();
        let activity = None;
        self.record_ids(Recorded {
            time_ns,
            ident,
            name: None,
            frames: &ids,
            tag,
            activity,
            weight_us,
            cpu_us: 0,
            flags,
        });
    }

    /// A new cap; the oldest samples go at once if the store is over it.
    pub fn set_max_bytes(&mut self, max_bytes: usize) {
        self.max_bytes = max_bytes;
        self.enforce_cap();
    }

    /// The id of `frame` in the tables; valid until `generation` changes.
    pub fn frame_id(&mut self, frame: Frame) -> u32 {
        match self.tables.frames.find(&frame) {
            Some(id) => id,
            None => self.tables.frames.intern(frame),
        }
    }

    /// Changes whenever compaction renumbers the tables.
    pub fn generation(&self) -> u64 {
        self.compactions
    }

    /// Records one sample whose frames are ids from `frame_id`.
    pub fn record_ids(&mut self, r: Recorded<'_>) {
        let t = &mut self.tables;
        let stack = t.stacks.intern_slice(r.frames);
        let tag = r.tag.map(|tag| t.tags.find(tag).unwrap_or_else(|| t.tags.intern(tag.clone())));
        let activity = r.activity.map(|a| t.activities.find_str(a).unwrap_or_else(|| t.activities.intern(a.into())));
        let thread = Thread { process: 0, ident: r.ident, name: r.name };
        let thread = t.threads.find(&thread).unwrap_or_else(|| t.threads.intern(thread));
        let (time_ns, weight_us, cpu_us, flags) = (r.time_ns, r.weight_us, r.cpu_us, r.flags);
        self.ring.push_back(Sample { time_ns, thread, stack, tag, activity, weight_us, cpu_us, count: 1, flags });
        self.recorded += 1;
        self.enforce_cap();
    }

    fn tables_bytes(&self) -> usize {
        let t = &self.tables;
        t.frames.bytes() + t.stacks.bytes() + t.tags.bytes() + t.activities.bytes() + t.threads.bytes()
    }

    pub fn bytes(&self) -> usize {
        self.tables_bytes() + self.ring.len() * SAMPLE_BYTES
    }

    fn enforce_cap(&mut self) {
        while self.bytes() > self.max_bytes {
            if self.tables_bytes() > self.max_bytes / 2 {
                self.evict((self.ring.len() / 2).max(1));
                self.compact();
            } else {
                // Evict in batches so the cost amortises over many pushes.
                let excess = (self.bytes() - self.max_bytes).div_ceil(SAMPLE_BYTES);
                self.evict(excess.max(self.ring.len() / 64));
            }
        }
    }

    fn evict(&mut self, n: usize) {
        let n = n.min(self.ring.len());
        self.ring.drain(..n);
        self.evicted += n as u64;
    }

    /// Rebuilds the tables from the samples still held, dropping what nothing uses.
    fn compact(&mut self) {
        let mut fresh = Builder::default();
        let mut map = Remap::for_source(&self.tables);
        for s in &self.ring {
            fresh.copy_sample(&self.tables, &mut map, s, None);
        }
        self.ring = std::mem::take(&mut fresh.samples).into();
        self.tables = fresh;
        self.compactions += 1;
    }

    /// The samples of `window`, with just the tables they use.
    pub fn window(&self, window: Window, process: Process, metadata: Metadata) -> ProfileData {
        let mut out = Builder::default();
        let mut map = Remap::for_source(&self.tables);
        let mut aggregator = Aggregator::default();
        for s in self.range(window) {
            if window.aggregate {
                out.aggregate_sample(&self.tables, &mut map, s, &mut aggregator);
            } else {
                out.copy_sample(&self.tables, &mut map, s, None);
            }
        }
        out.finish(vec![process], metadata)
    }

    /// Roughly the memory an export of `window` would take: its samples and at most
    /// the tables; and the samples it stands for.
    pub fn window_size(&self, window: Window) -> WindowSize {
        let samples = self.range(window);
        let taken = samples.len() as u64;
        let kept = if window.aggregate {
            let prefix = |t: Option<u32>| t.map(|t| self.tables.tags.get(t)).map(|t| (&t.prefix, &t.span));
            samples.map(|s| (s.thread, s.stack, prefix(s.tag), s.activity, s.flags)).collect::<FxHashSet<_>>().len()
        } else {
            samples.len()
        };
        // Interners hold each item twice; a profile's tables once.
        WindowSize { samples: taken, bytes: (kept * SAMPLE_BYTES + self.tables_bytes() / 2) as u64 }
    }

    fn range(&self, window: Window) -> std::collections::vec_deque::Iter<'_, Sample> {
        let lo = self.ring.partition_point(|s| s.time_ns < window.start_ns);
        let hi = self.ring.partition_point(|s| s.time_ns <= window.stop_ns);
        self.ring.range(lo..hi.max(lo))
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats {
            samples_recorded: self.recorded,
            samples_evicted: self.evicted,
            samples_held: self.ring.len(),
            compactions: self.compactions,
            bytes: self.bytes(),
            max_bytes: self.max_bytes,
            oldest_ns: self.ring.front().map(|s| s.time_ns),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::build::Tables;
    use crate::profile::model::tests::frame;
    use serde_json::Value;

    fn proc() -> Process {
        Process { name: "p".into(), pid: 1, host: "h".into(), token: "t".into(), stats: Value::Null }
    }

    fn all(start_ns: u64, stop_ns: u64) -> Window {
        Window { start_ns, stop_ns, aggregate: false }
    }

    fn push(store: &mut Store, t: u64, names: &[&str], key: Option<&str>) {
        let tag = key.map(|k| Tag { key: k.into(), prefix: k.into(), span: None });
        store.record(t, 1, names.iter().map(|n| frame(n)), tag.as_ref(), 10_000, 1);
    }

    #[test]
    fn interns_stacks_once() {
        let mut s = Store::new(1 << 20);
        for t in 0..100 {
            push(&mut s, t, &["main", "work"], Some("k"));
        }
        assert_eq!(s.tables.counts(), [2, 1, 1, 0, 1]);
        assert_eq!(s.stats().samples_held, 100);
    }

    #[test]
    fn ring_evicts_oldest_under_cap() {
        let cap = 64 * 1024;
        let mut s = Store::new(cap);
        for t in 0..100_000 {
            push(&mut s, t, &["main", "work"], None);
        }
        let st = s.stats();
        assert!(st.bytes <= cap, "{} > {cap}", st.bytes);
        assert!(st.samples_evicted > 90_000);
        assert_eq!(st.samples_held as u64 + st.samples_evicted, 100_000);
        assert_eq!(st.oldest_ns, Some(100_000 - st.samples_held as u64));
    }

    #[test]
    fn a_lower_cap_evicts_the_oldest_at_once() {
        let mut s = Store::new(1 << 20);
        for t in 0..20_000 {
            push(&mut s, t, &["main", "work"], None);
        }
        let cap = 64 * 1024;
        s.set_max_bytes(cap);
        let st = s.stats();
        assert!(st.bytes <= cap && st.samples_held > 0, "{st:?}");
        assert_eq!(st.oldest_ns, Some(20_000 - st.samples_held as u64), "the newest samples stay");
    }

    #[test]
    fn churn_of_distinct_keys_compacts_tables() {
        let cap = 256 * 1024;
        let mut s = Store::new(cap);
        for t in 0..50_000u64 {
            let key = format!("task-{t}-{}", "x".repeat(40));
            push(&mut s, t, &["main", &format!("f{}", t % 5000)], Some(&key));
        }
        let st = s.stats();
        assert!(st.bytes <= cap);
        assert!(st.compactions > 0);
        // Tables only hold what live samples use.
        assert_eq!(s.tables.counts()[2], st.samples_held);
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(w.samples.len(), st.samples_held);
        assert!(w.tags.iter().all(|t| t.key.starts_with("task-")));
    }

    #[test]
    fn window_selects_time_range() {
        let mut s = Store::new(1 << 20);
        for t in 0..10 {
            push(&mut s, t * 100, &["main", if t < 5 { "early" } else { "late" }], None);
        }
        let w = s.window(all(500, 900), proc(), Metadata::default());
        assert_eq!(w.samples.len(), 5);
        assert_eq!(w.frames.len(), 2, "only the frames the window uses");
        assert!(w.frames.iter().any(|f| f.name == "late"));
        assert!(s.window(all(2000, 3000), proc(), Metadata::default()).samples.is_empty());
    }

    #[test]
    fn aggregated_window_sums_per_stack_and_prefix() {
        let mut s = Store::new(1 << 20);
        for t in 0..10 {
            let key = format!("load-{}", t % 5);
            let tag = Tag { key: key.clone(), prefix: "load".into(), span: None };
            let leaf = if t % 2 == 0 { "read" } else { "parse" };
            s.record(t, 1, ["main", leaf].iter().map(|n| frame(n)), Some(&tag), 10_000 + t as u32, 1);
        }
        push(&mut s, 10, &["main", "idle"], None);
        let aggregated = Window { start_ns: 0, stop_ns: 100, aggregate: true };
        let w = s.window(aggregated, proc(), Metadata::default());
        assert_eq!(w.samples.len(), 3, "read and parse under prefix load, and the untagged one");
        assert_eq!((w.n_samples(), w.total_us()), (11, 10 * 10_000 + 45 + 10_000));
        assert!(w.tags.iter().all(|t| t.key == "load"), "keys merge into their prefix");
        assert_eq!(s.window_size(aggregated).samples, 11);
        assert!(s.window_size(aggregated).bytes < s.window_size(all(0, 100)).bytes);
    }
}
