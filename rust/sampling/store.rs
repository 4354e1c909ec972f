//! The live sample store of one process: interned tables, a time-ordered ring of
//! the recent window's raw samples, and older ones folded into a coarse history
//! (`history.rs`), all under one memory cap. Past the cap the history's oldest
//! buckets merge into coarser ones first, then the raw window shrinks (its samples
//! folded early), then the oldest buckets go; when the tables themselves grow
//! (thread churn, task keys that only folded samples had), they are compacted to
//! what the remaining samples still use.

use crate::profile::build::{Aggregator, Builder, Remap};
use crate::profile::model::{Frame, Metadata, Process, ProfileData, Tag, Thread};
use crate::profile::sample::Sample;
use crate::sampling::calls::{Buckets, Pending, NS_PER_S};
use crate::sampling::history::{History, Resolution};
use rustc_hash::FxHashSet;
use serde::Serialize;
use serde_json::json;
use std::collections::VecDeque;

pub const SAMPLE_BYTES: usize = std::mem::size_of::<Sample>();

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StoreStats {
    pub samples_recorded: u64,
    /// Samples dropped, raw or folded (each folded sample counts what it stands for).
    pub samples_evicted: u64,
    /// Raw samples, of the recent window.
    pub samples_held: usize,
    /// Folded samples of the history, the raw samples they stand for, and its buckets.
    pub folded_held: usize,
    pub samples_folded: u64,
    pub buckets: usize,
    /// Pairs of buckets merged into coarser ones.
    pub bucket_merges: u64,
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

/// How long samples stay raw, and the step they are folded at after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    pub recent_ns: u64,
    pub step_ns: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { recent_ns: 600 * NS_PER_S, step_ns: 60 * NS_PER_S }
    }
}

pub struct Store {
    tables: Builder,
    /// Raw samples of the recent window.
    ring: VecDeque<Sample>,
    history: History,
    retention: Retention,
    /// Calls per activity and second, kept as long as samples of their seconds, and
    /// coarsened with them.
    calls: Buckets,
    max_bytes: usize,
    /// The tables' bytes right after the last compaction: growth past it is mostly task
    /// keys that only folded samples had, which compacting drops.
    compacted_tables: usize,
    recorded: u64,
    evicted: u64,
    compactions: u64,
}

impl Store {
    pub fn new(max_bytes: usize) -> Store {
        Store {
            tables: Builder::default(),
            ring: VecDeque::new(),
            history: History::default(),
            retention: Retention::default(),
            calls: Buckets::default(),
            max_bytes,
            compacted_tables: 0,
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

    /// How long samples stay raw and the step they fold into; applies to samples
    /// folded from now on.
    pub fn set_retention(&mut self, retention: Retention) {
        self.retention = retention;
        if let Some(&newest) = self.ring.back().map(|s| &s.time_ns) {
            self.fold_older_than(newest.saturating_sub(retention.recent_ns));
        }
        self.enforce_cap();
    }

    /// Empties the store, keeping its cap and retention; the generation moves on, so
    /// frame ids taken before are not used after.
    pub fn clear(&mut self) {
        let (max_bytes, retention, compactions) = (self.max_bytes, self.retention, self.compactions + 1);
        *self = Store { retention, compactions, ..Store::new(max_bytes) };
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
        self.ring.push_back(Sample {
            time_ns,
            thread,
            stack,
            tag,
            activity,
            weight_us,
            cpu_us,
            count: 1,
            flags,
            cover: 0,
        });
        self.recorded += 1;
        self.fold_older_than(time_ns.saturating_sub(self.retention.recent_ns));
        self.enforce_cap();
    }

    fn fold_older_than(&mut self, cutoff_ns: u64) {
        let n = self.ring.partition_point(|s| s.time_ns < cutoff_ns);
        self.fold_oldest(n);
    }

    /// Moves the `n` oldest raw samples into the history, their task keys made prefixes.
    /// Popped one by one: most calls fold none or one, and a drain would need a copy to
    /// let the history and the tables be borrowed meanwhile.
    fn fold_oldest(&mut self, n: usize) {
        for _ in 0..n {
            let Some(s) = self.ring.pop_front() else { break };
            let tag = s.tag.map(|t| self.prefix_tag(t));
            if let Some((from, to)) = self.history.fold(Sample { tag, ..s }, self.retention.step_ns) {
                self.calls.coarsen(from, to);
            }
        }
    }

    fn prefix_tag(&mut self, tag: u32) -> u32 {
        let tags = &mut self.tables.tags;
        let t = tags.get(tag);
        if t.key == t.prefix {
            return tag;
        }
        let folded = Tag { key: t.prefix.clone(), ..t.clone() };
        tags.find(&folded).unwrap_or_else(|| tags.intern(folded))
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
        self.tables_bytes() + self.ring.len() * SAMPLE_BYTES + self.history.bytes() + self.calls.bytes()
    }

    fn enforce_cap(&mut self) {
        while self.bytes() > self.max_bytes {
            let tables = self.tables_bytes();
            if tables > self.max_bytes / 2 || tables > self.compacted_tables + self.max_bytes / 32 {
                // Folded samples leave task keys behind: compacting drops them. Only if the
                // samples left still need more does the oldest half of them go.
                self.compact();
                if self.tables_bytes() > self.max_bytes / 2 {
                    self.shed_oldest_half();
                    self.compact();
                }
            } else if let Some((from, to)) = self.history.merge_oldest() {
                self.calls.coarsen(from, to);
            } else if !self.ring.is_empty() {
                // In batches, so the cost amortises over many pushes.
                let excess = (self.bytes() - self.max_bytes).div_ceil(SAMPLE_BYTES);
                self.fold_oldest(excess.max(self.ring.len() / 64));
            } else if let Some(end) = self.drop_oldest_bucket() {
                self.calls.evict_before(end / NS_PER_S);
            } else if !self.calls.evict_oldest() {
                break; // only calls were left (counted while nothing was sampled), and they went
            }
        }
    }

    fn drop_oldest_bucket(&mut self) -> Option<u64> {
        let before = self.history.dropped_samples;
        let end = self.history.drop_oldest()?;
        self.evicted += self.history.dropped_samples - before;
        Some(end)
    }

    /// Drops the oldest half of the history's buckets, or of the raw samples if there is none.
    fn shed_oldest_half(&mut self) {
        let buckets = self.history.buckets();
        let kept_from = if buckets > 0 {
            (0..buckets.div_ceil(2)).filter_map(|_| self.drop_oldest_bucket()).last()
        } else {
            let n = self.ring.len().div_ceil(2);
            let last = n.checked_sub(1).map(|i| self.ring[i].time_ns + 1);
            self.ring.drain(..n);
            self.evicted += n as u64;
            last
        };
        if let Some(kept_from) = kept_from {
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
        self.history.renumber(|s| {
            fresh.copy_sample(&self.tables, &mut map, &s, None);
            fresh.samples.pop().expect("just copied")
        });
        self.tables = fresh;
        self.compacted_tables = self.tables_bytes();
        self.compactions += 1;
    }

    /// The samples of `window`, folded where the history holds them, with just the
    /// tables they use; the process's `stats["resolution"]` says which stretch is which.
    pub fn window(&self, window: Window<'_>, mut process: Process, metadata: Metadata) -> ProfileData {
        let mut out = Builder::default();
        let mut map = Remap::for_source(&self.tables);
        let mut aggregator = Aggregator::default();
        process.stats["resolution"] = json!(self.resolution(window));
        for s in self.samples(window) {
            let s = &s;
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

    /// The stretches of `window` at each resolution, oldest first: folded, then raw.
    fn resolution(&self, window: Window<'_>) -> Vec<serde_json::Value> {
        let mut stretches = self.history.resolution(window.start_ns, window.stop_ns);
        let raw = self.range(window);
        if let (Some(first), Some(last)) = (raw.clone().next(), raw.last()) {
            stretches.push(Resolution { from_ns: first.time_ns, to_ns: last.time_ns, step_ns: 0 });
        }
        let seconds = |ns: u64| ns as f64 / 1e9;
        stretches
            .iter()
            .map(|r| json!({"from": seconds(r.from_ns), "to": seconds(r.to_ns), "step": seconds(r.step_ns)}))
            .collect()
    }

    /// Roughly the memory an export of `window` would take: its samples and at most
    /// the tables; and the samples it stands for.
    pub fn window_size(&self, window: Window<'_>) -> WindowSize {
        let taken = self.samples(window).map(|s| u64::from(s.count)).sum();
        let kept = if window.aggregate {
            let prefix = |t: Option<u32>| t.map(|t| self.tables.tags.get(t)).map(|t| (&t.prefix, &t.span));
            let keys = self.samples(window).map(|s| (s.thread, s.stack, prefix(s.tag), s.activity, s.flags));
            keys.collect::<FxHashSet<_>>().len()
        } else {
            self.samples(window).count()
        };
        // Interners hold each item twice; a profile's tables once.
        WindowSize { samples: taken, bytes: (kept * SAMPLE_BYTES + self.tables_bytes() / 2) as u64 }
    }

    /// The samples `window` takes: folded where the history holds them, raw after,
    /// narrowed to its spans' tags.
    fn samples(&self, window: Window<'_>) -> impl Iterator<Item = Sample> + '_ {
        // Decided once per tag, not per sample: a window holds far more samples than tags.
        let kept_tags: Option<Vec<bool>> = window.spans.map(|ids| {
            let tags = &self.tables.tags;
            (0..tags.len() as u32).map(|t| tags.get(t).span.as_ref().is_some_and(|id| ids.contains(id))).collect()
        });
        let keeps = move |s: &Sample| match &kept_tags {
            None => true,
            Some(kept) => s.tag.is_some_and(|t| kept[t as usize]),
        };
        let folded = self.history.range(window.start_ns, window.stop_ns);
        folded.chain(self.range(window).copied()).filter(keeps)
    }

    /// The raw samples captured in `window`'s time range.
    fn range(&self, window: Window<'_>) -> std::collections::vec_deque::Iter<'_, Sample> {
        let lo = self.ring.partition_point(|s| s.time_ns < window.start_ns);
        let hi = self.ring.partition_point(|s| s.time_ns <= window.stop_ns);
        self.ring.range(lo..hi.max(lo))
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats {
            samples_recorded: self.recorded,
            samples_evicted: self.evicted,
            samples_held: self.ring.len(),
            folded_held: self.history.samples_held(),
            samples_folded: self.history.standing,
            buckets: self.history.buckets(),
            bucket_merges: self.history.merges,
            compactions: self.compactions,
            bytes: self.bytes(),
            max_bytes: self.max_bytes,
            oldest_ns: self.history.oldest_ns().or(self.ring.front().map(|s| s.time_ns)),
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

    fn push_task(store: &mut Store, t: u64, leaf: &str, key: &str) {
        let tag = Tag { key: key.into(), prefix: key.split('-').next().unwrap().into(), span: None };
        store.record(t, 1, ["main", leaf].iter().map(|n| frame(n)), Some(&tag), 10_000, 1);
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

    fn total_us(w: &ProfileData) -> u64 {
        w.samples.iter().map(|s| u64::from(s.weight_us)).sum()
    }

    #[test]
    fn past_the_cap_the_oldest_raw_samples_fold_before_any_go() {
        let cap = 64 * 1024;
        let mut s = Store::new(cap);
        for t in 0..100_000 {
            push(&mut s, t, &["main", "work"], None);
        }
        let st = s.stats();
        assert!(st.bytes <= cap, "{} > {cap}", st.bytes);
        assert_eq!(st.samples_evicted, 0, "one stack folds into one sample: nothing had to go");
        assert!(st.folded_held > 0 && st.samples_held < 100_000);
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(total_us(&w), 100_000 * 10_000);
        assert_eq!(w.samples.iter().map(|s| u64::from(s.count)).sum::<u64>(), 100_000);
        assert_eq!(w.samples.last().unwrap().time_ns, 99_999, "the newest stay raw");
    }

    #[test]
    fn the_oldest_buckets_go_when_folding_is_not_enough() {
        let cap = 256 * 1024;
        let mut s = Store::new(cap);
        s.set_retention(Retention { recent_ns: 10 * NS_PER_S, step_ns: NS_PER_S });
        for t in 0..20_000u64 {
            push(&mut s, t * NS_PER_S / 10, &["main", &format!("f{t}")], None);
        }
        let st = s.stats();
        assert!(st.bytes <= cap && st.samples_evicted > 0, "{st:?}");
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(w.samples.iter().map(|s| u64::from(s.count)).sum::<u64>() + st.samples_evicted, 20_000);
        assert_eq!(w.samples.last().unwrap().time_ns, 19_999 * NS_PER_S / 10, "the newest stay raw");
    }

    #[test]
    fn buckets_merge_into_coarser_ones_before_any_go() {
        let cap = 48 * 1024;
        let mut s = Store::new(cap);
        s.set_retention(Retention { recent_ns: 10 * NS_PER_S, step_ns: NS_PER_S });
        for t in 0..20_000u64 {
            push(&mut s, t * NS_PER_S / 10, &["main", &format!("f{}", t % 20)], None);
        }
        let st = s.stats();
        assert!(st.bytes <= cap && st.bucket_merges > 0 && st.samples_evicted == 0, "{st:?}");
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(total_us(&w), 20_000 * 10_000, "every microsecond kept");
        let steps: Vec<f64> = w.processes[0].stats["resolution"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["step"].as_f64().unwrap())
            .collect();
        assert!(steps.first() > steps.get(1), "the oldest are the coarsest: {steps:?}");
    }

    #[test]
    fn a_lower_cap_folds_the_oldest_at_once() {
        let mut s = Store::new(1 << 20);
        for t in 0..20_000 {
            push(&mut s, t, &["main", "work"], None);
        }
        let cap = 64 * 1024;
        s.set_max_bytes(cap);
        let st = s.stats();
        assert!(st.bytes <= cap && st.samples_held > 0 && st.samples_evicted == 0, "{st:?}");
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        let first_raw = w.samples.iter().find(|s| s.count == 1).unwrap();
        assert_eq!(first_raw.time_ns, 20_000 - st.samples_held as u64, "the newest stay raw");
    }

    #[test]
    fn older_samples_fold_into_steps_with_prefix_tags_and_their_totals() {
        let mut s = Store::new(1 << 20);
        let minute = 60 * NS_PER_S;
        for t in 0..30 * 60 {
            push_task(&mut s, t * NS_PER_S, if t % 2 == 0 { "read" } else { "parse" }, &format!("load-{t}"));
        }
        let st = s.stats();
        assert_eq!((st.samples_held, st.buckets), (601, 20), "the last 10 minutes raw, 20 minutes folded");
        assert_eq!(st.folded_held, 20 * 2, "per minute, one sample per stack");
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(total_us(&w), 30 * 60 * 10_000);
        let folded = s.window(all(0, 5 * minute - 1), proc(), Metadata::default());
        assert_eq!(total_us(&folded), 5 * 60 * 10_000, "five whole buckets");
        assert!(folded.tags.iter().all(|t| t.key == "load" && t.prefix == "load"), "keys fold into their prefix");
        let resolution = &folded.processes[0].stats["resolution"];
        assert_eq!(resolution, &json!([{"from": 0.0, "to": 300.0, "step": 60.0}]));
        let straddling = s.window(all(15 * minute, 25 * minute), proc(), Metadata::default());
        assert_eq!(total_us(&straddling), (10 * 60 + 1) * 10_000, "buckets by their start, raw by their time");
        assert_eq!(straddling.processes[0].stats["resolution"].as_array().unwrap().len(), 2);
    }

    /// Seconds of each leaf in `w`.
    fn seconds_by_leaf(w: &ProfileData) -> std::collections::BTreeMap<String, f64> {
        let mut by = std::collections::BTreeMap::new();
        for s in &w.samples {
            let leaf = &w.frames[*w.stacks[s.stack as usize].last().unwrap() as usize].name;
            *by.entry(leaf.clone()).or_insert(0.0) += f64::from(s.weight_us) / 1e6;
        }
        by
    }

    #[test]
    fn windows_over_folded_buckets_are_right_at_their_edges() {
        // 4 threads at 1000 Hz: 10 s of early, then 40 s of late, starting 20 s into a
        // minute, in a store too small to keep them raw.
        let mut s = Store::new(512 * 1024);
        let t0 = 1_000 * 60 * NS_PER_S + 20 * NS_PER_S;
        let (t1, t2) = (t0 + 10 * NS_PER_S, t0 + 50 * NS_PER_S);
        for t in (t0..t2).step_by(1_000_000) {
            for thread in 0..4 {
                let leaf = if t < t1 { "early" } else { "late" };
                s.record(t, thread, ["main", leaf].iter().map(|n| frame(n)), None, 1_000, 1);
            }
        }
        assert!(s.stats().buckets > 0, "{:?}", s.stats());
        let padded = seconds_by_leaf(&s.window(all(t0 - NS_PER_S, t2 + NS_PER_S), proc(), Metadata::default()));
        assert!((padded["early"] - 40.0).abs() < 0.1 && (padded["late"] - 160.0).abs() < 0.1, "{padded:?}");
        let cuts = [t0 - NS_PER_S, t0 + 3 * NS_PER_S, t1, t0 + 35 * NS_PER_S + 7, t2 + NS_PER_S];
        let mut parts = std::collections::BTreeMap::new();
        for w in cuts.windows(2) {
            for (leaf, seconds) in seconds_by_leaf(&s.window(all(w[0], w[1] - 1), proc(), Metadata::default())) {
                *parts.entry(leaf).or_insert(0.0) += seconds;
            }
        }
        assert!(parts.iter().all(|(leaf, &sum)| (sum - padded[leaf]).abs() < 1e-6), "{parts:?} != {padded:?}");
        let early = seconds_by_leaf(&s.window(all(t0, t0 + 5 * NS_PER_S - 1), proc(), Metadata::default()));
        assert!((early["early"] - 20.0).abs() < 0.1 && !early.contains_key("late"), "{early:?}");
    }

    #[test]
    fn an_aggregated_window_keeps_when_its_time_went() {
        use crate::profile::timeline::{timeline, SeriesBy};
        let mut s = Store::new(1 << 20);
        for t in 0..30 * 60 {
            let key = if t < 20 * 60 { format!("load-{t}") } else { format!("sum-{t}") };
            push_task(&mut s, (999_960 + t) * NS_PER_S, "f", &key); // minutes from a whole minute
        }
        assert!(s.stats().buckets > 0);
        let whole = all(0, u64::MAX);
        let raw = s.window(whole, proc(), Metadata::default());
        let aggregated = s.window(Window { aggregate: true, ..whole }, proc(), Metadata::default());
        assert!(aggregated.samples.len() < 10, "{}", aggregated.samples.len());
        let [want, got] = [&raw, &aggregated].map(|d| timeline(d, Some(60.0), SeriesBy::Prefix, None).unwrap());
        assert_eq!(got.steps, 30);
        for (w, g) in want.series.iter().zip(&got.series) {
            assert_eq!(w.name, g.name);
            assert!(w.steps.wall.iter().zip(&g.steps.wall).all(|(a, b)| (a - b).abs() < 1e-9), "{g:?}");
        }
        let sum = got.series.iter().find(|s| s.name == "sum").unwrap();
        assert!(sum.steps.wall[..20].iter().all(|&w| w == 0.0) && sum.steps.wall[20..].iter().all(|&w| w > 0.5));
    }

    #[test]
    fn compaction_keeps_the_history() {
        let mut s = Store::new(1 << 20);
        s.set_retention(Retention { recent_ns: NS_PER_S, step_ns: NS_PER_S });
        for t in 0..100u64 {
            push_task(&mut s, t * NS_PER_S / 10, &format!("f{}", t % 3), &format!("load-{t}"));
        }
        let before = s.window(all(0, u64::MAX), proc(), Metadata::default());
        s.compact();
        let after = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(before.digest(), after.digest());
        assert!(s.tables.tags.len() < 100, "the folded samples' keys went");
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

    #[test]
    fn a_window_of_spans_takes_their_folded_samples_too() {
        let mut s = Store::new(1 << 20);
        s.set_retention(Retention { recent_ns: NS_PER_S, step_ns: NS_PER_S });
        for t in 0..60u64 {
            let span = ["a", "b", "c"][t as usize % 3];
            let tag = Tag { key: format!("k-{t}"), prefix: "k".into(), span: Some(span.into()) };
            s.record(t * NS_PER_S / 10, 1, ["main", span].iter().map(|n| frame(n)), Some(&tag), 10_000, 1);
        }
        assert!(s.stats().buckets > 0, "the older samples folded");
        let ids: FxHashSet<String> = ["a"].map(String::from).into_iter().collect();
        let spans = Window { spans: Some(&ids), ..all(0, u64::MAX) };
        let w = s.window(spans, proc(), Metadata::default());
        assert_eq!((w.n_samples(), total_us(&w)), (20, 20 * 10_000), "raw and folded, span a only");
        assert!(w.tags.iter().all(|t| t.span.as_deref() == Some("a")), "{:?}", w.tags);
        assert_eq!(s.window_size(spans).samples, 20);
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
    fn calls_fold_and_go_with_their_seconds_samples() {
        let get = dispatch("w: get_data");
        let mut s = Store::new(1 << 20);
        for second in 0..2_000 {
            count(&mut s, second, &get, 1);
            push(&mut s, second * NS_PER_S, &["main", "work"], None);
        }
        let calls = |s: &Store, from: u64, to: u64| s.window(all(from, to), proc(), Metadata::default()).activity_calls;
        assert_eq!(calls(&s, 0, u64::MAX), [Some(2_000)]);
        assert_eq!(calls(&s, 0, 59 * NS_PER_S), [Some(60)], "a folded minute's calls count at its start");
        let cap = 64 * 1024;
        let mut s = Store::new(cap);
        s.set_retention(Retention { recent_ns: 10 * NS_PER_S, step_ns: NS_PER_S });
        for second in 0..2_000 {
            count(&mut s, second, &get, 1);
            push(&mut s, second * NS_PER_S, &["main", &format!("f{second}")], None);
        }
        let oldest = s.stats().oldest_ns.unwrap() / NS_PER_S;
        assert!(oldest > 0 && s.bytes() <= cap, "{oldest} {}", s.bytes());
        assert_eq!(calls(&s, 0, u64::MAX), [Some(2_000 - oldest)], "calls of seconds the store still holds");
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
