//! The live sample store of one process: interned tables plus a time-ordered ring
//! of samples, kept under a memory cap by evicting the oldest samples and, when
//! the tables themselves grow (thread churn, many task keys), compacting them to
//! what the remaining samples still use.

use crate::profile::build::{Aggregator, Builder, Remap};
use crate::profile::model::{Frame, Metadata, Process, ProfileData, Sample, Tag, Thread};
use crate::sampling::calls::{Buckets, Pending, NS_PER_S};
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

/// Which samples an export takes: those captured in `[start_ns, stop_ns]` and, with
/// `spans`, tagged with one of those span ids; aggregated into one profile with
/// `aggregate` (see `Aggregator`).
#[derive(Clone, Copy, Debug)]
pub struct Window<'a> {
    pub start_ns: u64,
    pub stop_ns: u64,
    pub aggregate: bool,
    pub spans: Option<&'a FxHashSet<String>>,
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
    /// Calls per activity and second, kept as long as samples of their seconds.
    calls: Buckets,
    max_bytes: usize,
    recorded: u64,
    evicted: u64,
    compactions: u64,
}

impl Store {
    pub fn new(max_bytes: usize) -> Store {
        Store {
            tables: Builder::default(),
            ring: VecDeque::new(),
            calls: Buckets::default(),
            max_bytes,
            recorded: 0,
            evicted: 0,
            compactions: 0,
        }
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

    /// Takes the calls counted since the last fold.
    pub fn fold_calls(&mut self, pending: &mut Pending) {
        self.calls.fold(pending);
        self.enforce_cap();
    }

    fn tables_bytes(&self) -> usize {
        let t = &self.tables;
        t.frames.bytes() + t.stacks.bytes() + t.tags.bytes() + t.activities.bytes() + t.threads.bytes()
    }

    pub fn bytes(&self) -> usize {
        self.tables_bytes() + self.ring.len() * SAMPLE_BYTES + self.calls.bytes()
    }

    fn enforce_cap(&mut self) {
        while self.bytes() > self.max_bytes {
            if self.ring.is_empty() {
                // Only calls are left (counted while nothing was sampled): the oldest go.
                if !self.calls.evict_oldest() {
                    break;
                }
            } else if self.tables_bytes() > self.max_bytes / 2 {
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
        let last_evicted = n.checked_sub(1).map(|i| self.ring[i].time_ns);
        self.ring.drain(..n);
        self.evicted += n as u64;
        // Calls go with the seconds the ring no longer holds any sample of.
        if let Some(kept_from) = self.ring.front().map(|s| s.time_ns).or(last_evicted) {
            self.calls.evict_before(kept_from / NS_PER_S);
        }
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
    pub fn window(&self, window: Window<'_>, process: Process, metadata: Metadata) -> ProfileData {
        let mut out = Builder::default();
        let mut map = Remap::for_source(&self.tables);
        let mut aggregator = Aggregator::default();
        for s in self.samples(window) {
            if window.aggregate {
                out.aggregate_sample(&self.tables, &mut map, s, &mut aggregator);
            } else {
                out.copy_sample(&self.tables, &mut map, s, None);
            }
        }
        for (name, calls) in self.calls.window(window.start_ns, window.stop_ns) {
            // Zero calls are worth keeping only for an activity the window sampled.
            if calls > 0 || out.activities.find_str(name).is_some() {
                out.add_calls(name, calls);
            }
        }
        out.finish(vec![process], metadata)
    }

    /// Roughly the memory an export of `window` would take: its samples and at most
    /// the tables; and the samples it stands for.
    pub fn window_size(&self, window: Window<'_>) -> WindowSize {
        let taken = self.samples(window).count() as u64;
        let kept = if window.aggregate {
            let prefix = |t: Option<u32>| t.map(|t| self.tables.tags.get(t)).map(|t| (&t.prefix, &t.span));
            let keys = self.samples(window).map(|s| (s.thread, s.stack, prefix(s.tag), s.activity, s.flags));
            keys.collect::<FxHashSet<_>>().len()
        } else {
            taken as usize
        };
        // Interners hold each item twice; a profile's tables once.
        WindowSize { samples: taken, bytes: (kept * SAMPLE_BYTES + self.tables_bytes() / 2) as u64 }
    }

    /// The samples `window` takes: its time range, narrowed to its spans' tags.
    fn samples<'s>(&'s self, window: Window<'_>) -> impl Iterator<Item = &'s Sample> + 's {
        let lo = self.ring.partition_point(|s| s.time_ns < window.start_ns);
        let hi = self.ring.partition_point(|s| s.time_ns <= window.stop_ns);
        // Decided once per tag, not per sample: a window holds far more samples than tags.
        let kept_tags: Option<Vec<bool>> = window.spans.map(|ids| {
            let tags = &self.tables.tags;
            (0..tags.len() as u32).map(|t| tags.get(t).span.as_ref().is_some_and(|id| ids.contains(id))).collect()
        });
        let keeps = move |s: &&Sample| match &kept_tags {
            None => true,
            Some(kept) => s.tag.is_some_and(|t| kept[t as usize]),
        };
        self.ring.range(lo..hi.max(lo)).filter(keeps)
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
    use crate::reader::tags::Activity;
    use crate::sampling::calls::tests::dispatch;
    use serde_json::Value;
    use std::sync::Arc;

    fn proc() -> Process {
        Process { name: "p".into(), pid: 1, host: "h".into(), token: "t".into(), stats: Value::Null }
    }

    fn all(start_ns: u64, stop_ns: u64) -> Window<'static> {
        Window { start_ns, stop_ns, aggregate: false, spans: None }
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
    fn a_window_of_spans_takes_only_their_samples() {
        let mut s = Store::new(1 << 20);
        for t in 0..12u64 {
            let span = ["a", "b", "c"][t as usize % 3];
            let tag = Tag { key: format!("k-{t}"), prefix: "k".into(), span: Some(span.into()) };
            s.record(t, 1, ["main", span].iter().map(|n| frame(n)), Some(&tag), 10_000, 1);
        }
        push(&mut s, 12, &["main", "untagged"], None);
        let ids: FxHashSet<String> = ["a", "c"].map(String::from).into_iter().collect();
        let spans = Window { spans: Some(&ids), ..all(0, 100) };
        let w = s.window(spans, proc(), Metadata::default());
        assert_eq!(w.samples.len(), 8);
        assert!(w.tags.iter().all(|t| t.span.as_deref() != Some("b")), "{:?}", w.tags);
        assert_eq!(s.window_size(spans).samples, 8);
        let aggregated = Window { aggregate: true, ..spans };
        assert_eq!(
            (s.window_size(aggregated).samples, s.window(aggregated, proc(), Metadata::default()).n_samples()),
            (8, 8)
        );
        let none = FxHashSet::default();
        assert!(s.window(Window { spans: Some(&none), ..spans }, proc(), Metadata::default()).samples.is_empty());
    }

    fn count(store: &mut Store, second: u64, activity: &Arc<Activity>, n: u64) {
        let mut pending = Pending::default();
        (0..n).for_each(|_| pending.count(second, activity));
        store.fold_calls(&mut pending);
    }

    fn in_activity(store: &mut Store, t: u64, activity: &str) {
        let frames = [store.frame_id(frame("loop"))];
        let r = Recorded {
            time_ns: t,
            ident: 1,
            name: None,
            frames: &frames,
            tag: None,
            activity: Some(activity),
            weight_us: 10_000,
            cpu_us: 0,
            flags: 1,
        };
        store.record_ids(r);
    }

    #[test]
    fn windows_carry_the_calls_of_their_seconds() {
        let (get, gather) = (dispatch("w: get_data"), dispatch("w: gather"));
        let mut s = Store::new(1 << 20);
        in_activity(&mut s, 10 * NS_PER_S, "w: get_data");
        in_activity(&mut s, 11 * NS_PER_S, "w: reading");
        count(&mut s, 10, &get, 7);
        count(&mut s, 12, &gather, 2);
        let calls = |w: &ProfileData| -> Vec<(String, Option<u64>)> {
            w.activities.iter().cloned().zip(w.activity_calls.iter().copied()).collect()
        };
        let w = s.window(all(0, 20 * NS_PER_S), proc(), Metadata::default());
        let (get_data, gather, reading) =
            (String::from("w: get_data"), String::from("w: gather"), String::from("w: reading"));
        assert_eq!(calls(&w), [(get_data.clone(), Some(7)), (reading.clone(), None), (gather, Some(2))]);
        let later = s.window(all(11 * NS_PER_S, 11 * NS_PER_S), proc(), Metadata::default());
        assert_eq!((later.activities, later.activity_calls), (vec![reading], vec![]), "none known: none kept");
        let first = s.window(all(10 * NS_PER_S, 10 * NS_PER_S), proc(), Metadata::default());
        assert_eq!(calls(&first), [(get_data, Some(7))]);
        assert!(s.window(all(0, NS_PER_S), proc(), Metadata::default()).activity_calls.is_empty());
    }

    #[test]
    fn calls_are_evicted_with_their_seconds_samples() {
        let get = dispatch("w: get_data");
        let cap = 64 * 1024;
        let mut s = Store::new(cap);
        for second in 0..2_000 {
            count(&mut s, second, &get, 1);
            push(&mut s, second * NS_PER_S, &["main", "work"], None);
        }
        let oldest = s.stats().oldest_ns.unwrap() / NS_PER_S;
        assert!(oldest > 0 && s.bytes() <= cap, "{oldest} {}", s.bytes());
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(w.activity_calls, [Some(2_000 - oldest)], "calls of seconds the ring still holds");
        let mut unsampled = Store::new(4096);
        (0..1_000).for_each(|second| count(&mut unsampled, second, &get, 1));
        assert!(unsampled.bytes() <= 4096, "calls alone stay under the cap too");
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
        let aggregated = Window { start_ns: 0, stop_ns: 100, aggregate: true, spans: None };
        let w = s.window(aggregated, proc(), Metadata::default());
        assert_eq!(w.samples.len(), 3, "read and parse under prefix load, and the untagged one");
        assert_eq!((w.n_samples(), w.total_us()), (11, 10 * 10_000 + 45 + 10_000));
        assert!(w.tags.iter().all(|t| t.key == "load"), "keys merge into their prefix");
        assert_eq!(s.window_size(aggregated).samples, 11);
        assert!(s.window_size(aggregated).bytes < s.window_size(all(0, 100)).bytes);
    }
}
