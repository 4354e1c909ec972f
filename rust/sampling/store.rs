//! The live sample store of one process: interned tables, a time-ordered ring of
//! the recent window's raw samples, and older ones folded into a coarse history
//! (`history.rs`), all under one memory cap (`cap.rs` keeps it). Windows are taken
//! from it in `window.rs`.

use crate::profile::build::Builder;
use crate::profile::model::{Frame, Tag, Thread};
use crate::profile::sample::Sample;
use crate::sampling::calls::{Buckets, Pending, NS_PER_S};
use crate::sampling::history::History;
use serde::Serialize;
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
    pub(super) tables: Builder,
    /// Raw samples of the recent window.
    pub(super) ring: VecDeque<Sample>,
    pub(super) history: History,
    pub(super) retention: Retention,
    /// Calls per activity and second, kept as long as samples of their seconds, and
    /// coarsened with them.
    pub(super) calls: Buckets,
    pub(super) max_bytes: usize,
    /// The tables' bytes right after the last compaction: growth past it is mostly task
    /// keys that only folded samples had, which compacting drops.
    pub(super) compacted_tables: usize,
    recorded: u64,
    pub(super) evicted: u64,
    pub(super) compactions: u64,
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
        let count = 1;
        self.push(Sample { time_ns, thread, stack, tag, activity, weight_us, cpu_us, count, flags, cover: 0 });
    }

    /// The `n` newest samples, if the store still holds them all as recorded.
    pub fn newest(&self, n: usize) -> Option<Vec<Sample>> {
        let start = self.ring.len().checked_sub(n)?;
        Some(self.ring.range(start..).copied().collect())
    }

    /// Records `samples` (of this generation) again, at `time_ns` with `weight_us`: a
    /// tick at which nothing ran sees what the tick before it saw.
    pub fn repeat(&mut self, samples: &[Sample], time_ns: u64, weight_us: u32) {
        for &s in samples {
            self.push(Sample { time_ns, weight_us, ..s });
        }
    }

    fn push(&mut self, sample: Sample) {
        let time_ns = sample.time_ns;
        self.ring.push_back(sample);
        self.recorded += 1;
        self.fold_older_than(time_ns.saturating_sub(self.retention.recent_ns));
        self.enforce_cap();
    }

    fn fold_older_than(&mut self, cutoff_ns: u64) {
        // The oldest first: most calls fold none, and look at one sample (a binary
        // search would touch ~17 cold ones per sample recorded).
        let n = self.ring.iter().take_while(|s| s.time_ns < cutoff_ns).count();
        self.fold_oldest(n);
    }

    /// Moves the `n` oldest raw samples into the history, their task keys made prefixes.
    /// Popped one by one: most calls fold none or one, and a drain would need a copy to
    /// let the history and the tables be borrowed meanwhile.
    pub(super) fn fold_oldest(&mut self, n: usize) {
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

    pub(super) fn tables_bytes(&self) -> usize {
        let t = &self.tables;
        t.frames.bytes() + t.stacks.bytes() + t.tags.bytes() + t.activities.bytes() + t.threads.bytes()
    }

    pub fn bytes(&self) -> usize {
        self.tables_bytes() + self.ring.len() * SAMPLE_BYTES + self.history.bytes() + self.calls.bytes()
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
pub mod tests {
    use super::*;
    use crate::profile::build::Tables;
    use crate::profile::model::tests::frame;
    use crate::profile::model::{Metadata, Process, ProfileData};
    use crate::reader::tags::Activity;
    use crate::sampling::calls::tests::dispatch;
    use crate::sampling::window::Window;
    use serde_json::json;
    use serde_json::Value;
    use std::sync::Arc;

    pub fn proc() -> Process {
        Process { name: "p".into(), pid: 1, host: "h".into(), token: "t".into(), stats: Value::Null }
    }

    pub fn all(start_ns: u64, stop_ns: u64) -> Window<'static> {
        Window { start_ns, stop_ns, aggregate: false, spans: None, stalls: &[] }
    }

    pub fn push(store: &mut Store, t: u64, names: &[&str], key: Option<&str>) {
        let tag = key.map(|k| Tag { key: k.into(), prefix: k.into(), span: None });
        store.record(t, 1, names.iter().map(|n| frame(n)), tag.as_ref(), 10_000, 1);
    }

    pub fn push_task(store: &mut Store, t: u64, leaf: &str, key: &str) {
        let tag = Tag { key: key.into(), prefix: key.split('-').next().unwrap().into(), span: None };
        store.record(t, 1, ["main", leaf].iter().map(|n| frame(n)), Some(&tag), 10_000, 1);
    }

    pub fn in_activity(store: &mut Store, t: u64, activity: &str) {
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

    pub fn count(store: &mut Store, second: u64, activity: &Arc<Activity>, n: u64) {
        let mut pending = Pending::default();
        (0..n).for_each(|_| pending.count(second, activity));
        store.fold_calls(&mut pending);
    }

    /// Seconds of each leaf in `w`.
    pub fn seconds_by_leaf(w: &ProfileData) -> std::collections::BTreeMap<String, f64> {
        let mut by = std::collections::BTreeMap::new();
        for s in &w.samples {
            let leaf = &w.frames[*w.stacks[s.stack as usize].last().unwrap() as usize].name;
            *by.entry(leaf.clone()).or_insert(0.0) += f64::from(s.weight_us) / 1e6;
        }
        by
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
    fn samples_repeat_at_a_new_time_with_their_ids() {
        let mut s = Store::new(1 << 20);
        push_task(&mut s, 1, "a", "x-1");
        push_task(&mut s, 1, "b", "y-1");
        let last = s.newest(2).unwrap();
        assert!(s.newest(3).is_none(), "only what the store holds");
        s.repeat(&last, 2, 20_000);
        let again = s.newest(2).unwrap();
        for (a, b) in last.iter().zip(&again) {
            assert_eq!((b.time_ns, b.weight_us), (2, 20_000));
            assert_eq!(Sample { time_ns: 1, weight_us: 10_000, ..*b }, *a);
        }
        assert_eq!(s.stats().samples_recorded, 4);
    }

    pub fn total_us(w: &ProfileData) -> u64 {
        w.samples.iter().map(|s| u64::from(s.weight_us)).sum()
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
}
