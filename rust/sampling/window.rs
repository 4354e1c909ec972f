//! What an export takes from the store: the samples of a time window (the parts of
//! folded rows that lie in it, then raw samples), narrowed to spans, with just the
//! tables they use; and what such an export would hold, before any is made.

use crate::profile::build::{Aggregator, Builder, Remap};
use crate::profile::model::{Metadata, Process, ProfileData};
use crate::profile::sample::{Sample, FLAG_BLOCKS_LOOP, FLAG_STALL};
use crate::profile::stalls::{explain, Explained, Stall};
use crate::sampling::history::Resolution;
use crate::sampling::stalls::MOST_LOOPS;
use crate::sampling::store::{Store, SAMPLE_BYTES};
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;
use serde_json::json;

/// Which samples an export takes: those captured in `[start_ns, stop_ns]` and, with
/// `spans`, tagged with one of those span ids; aggregated into one profile with
/// `aggregate` (see `Aggregator`). Samples inside `stalls` (oldest first) are marked.
#[derive(Clone, Copy, Debug)]
pub struct Window<'a> {
    pub start_ns: u64,
    pub stop_ns: u64,
    pub aggregate: bool,
    pub spans: Option<&'a FxHashSet<String>>,
    pub stalls: &'a [Stall],
}

/// What a window export would hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct WindowSize {
    /// Samples taken in the window.
    pub samples: u64,
    /// Approximate memory of the exported profile.
    pub bytes: u64,
}

impl Store {
    /// The samples of `window`, folded where the history holds them, with just the
    /// tables they use; the process's `stats["resolution"]` says which stretch is which.
    pub fn window(&self, window: Window<'_>, mut process: Process, metadata: Metadata) -> ProfileData {
        let mut out = Builder::default();
        let mut map = Remap::for_source(&self.tables);
        let mut aggregator = Aggregator::default();
        aggregator.folded_step_ns = self.retention.step_ns;
        process.stats["resolution"] = json!(self.resolution(window));
        for mut s in self.samples(window) {
            if self.in_stall(&s, window.stalls) {
                s.flags |= FLAG_STALL;
            }
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

    /// Whether `s` (a store's) lies in one of `stalls` as its loop's thread, or as a
    /// thread holding the GIL the loop waited for.
    fn in_stall(&self, s: &Sample, stalls: &[Stall]) -> bool {
        if stalls.is_empty() {
            return false;
        }
        let (from, to) = s.extent().unwrap_or((s.time_ns, s.time_ns + 1));
        let ident = self.tables.threads.get(s.thread).ident;
        let after = stalls.partition_point(|st| st.start_ns < to);
        // Loops' stalls do not overlap their own: at most one per loop reaches `from`.
        stalls[after.saturating_sub(MOST_LOOPS)..after]
            .iter()
            .any(|st| st.end_ns > from && (st.ident == ident || s.flags & FLAG_BLOCKS_LOOP != 0))
    }

    /// The `most` longest of `stalls`, longest first, each explained by its samples.
    pub fn explain_stalls(&self, stalls: &[Stall], most: usize) -> Vec<Explained> {
        let mut longest: Vec<&Stall> = stalls.iter().collect();
        longest.sort_by_key(|s| std::cmp::Reverse(s.duration_ns()));
        longest.truncate(most);
        let inside =
            |s: &Stall| Window { start_ns: s.start_ns, stop_ns: s.end_ns, aggregate: false, spans: None, stalls: &[] };
        longest.into_iter().map(|s| explain(&self.tables, s, self.samples(inside(s)))).collect()
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

    /// Roughly the memory an export of `window` would take, at most: its samples and at
    /// most the tables; and the samples it stands for. Buckets the window holds whole are
    /// counted as they are (a day's window would cut millions of rows for its size, then
    /// again for its export); a window of spans looks at each row for its tag.
    pub fn window_size(&self, window: Window<'_>) -> WindowSize {
        let (taken, kept) = if window.spans.is_some() {
            self.counted(self.samples(window), window.aggregate)
        } else {
            let folded = self.history.size(window.start_ns, window.stop_ns, self.retention.step_ns);
            let (taken, kept) = self.counted(self.range(window).copied(), window.aggregate);
            let folded_kept = if window.aggregate { folded.keys + folded.cells } else { folded.rows };
            (folded.taken + taken, folded_kept + kept)
        };
        // Interners hold each item twice; a profile's tables once.
        WindowSize { samples: taken, bytes: (kept * SAMPLE_BYTES + self.tables_bytes() / 2) as u64 }
    }

    /// The samples `samples` stand for, and how many an export keeps: each, or
    /// aggregated, its samples and timeline cells (`Builder::aggregate_sample`).
    fn counted(&self, samples: impl Iterator<Item = Sample>, aggregate: bool) -> (u64, usize) {
        let prefix = self.prefix_ids();
        let (mut taken, mut rows) = (0, 0);
        let (mut keys, mut cells) = (FxHashSet::default(), FxHashSet::default());
        for s in samples {
            taken += u64::from(s.count);
            if aggregate {
                let s = Sample { tag: s.tag.map(|t| prefix[t as usize]), ..s };
                keys.insert(Aggregator::kept(&s));
                cells.insert(Aggregator::cell(&s, self.retention.step_ns));
            } else {
                rows += 1;
            }
        }
        (taken, rows + keys.len() + cells.len())
    }

    /// Per tag, the id of the first tag of its prefix and span: what aggregating keeps apart.
    fn prefix_ids(&self) -> Vec<u32> {
        let tags = &self.tables.tags;
        let mut first = FxHashMap::default();
        (0..tags.len() as u32)
            .map(|t| {
                let tag = tags.get(t);
                *first.entry((&tag.prefix, &tag.span)).or_insert(t)
            })
            .collect()
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::frame;
    use crate::profile::model::Tag;
    use crate::sampling::calls::tests::dispatch;
    use crate::sampling::calls::NS_PER_S;
    use crate::sampling::store::tests::*;
    use crate::sampling::store::Retention;

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
        // Half the phase, to a unit of the bucket (0.23 s of a minute): its row began 0.08 s early.
        assert!((early["early"] - 20.0).abs() < 0.5 && !early.contains_key("late"), "{early:?}");
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
    fn an_aggregated_window_of_folded_history_is_no_bigger_than_announced() {
        // An hour of 4 threads in 6 prefixes x 20 stacks at 10 Hz, all folded: the part,
        // timeline cells included, must not outgrow what `window_size` announced.
        let mut s = Store::new(64 << 20);
        s.set_retention(Retention { recent_ns: 0, step_ns: 60 * NS_PER_S });
        for tick in 0..36_000u64 {
            for thread in 0..4 {
                let (prefix, leaf) = (format!("p{}", (tick / 50 + thread) % 6), format!("f{}", (tick + thread) % 20));
                let tag = Tag { key: format!("{prefix}-1"), prefix, span: None };
                s.record(
                    tick * NS_PER_S / 10,
                    thread,
                    ["main", &leaf].iter().map(|n| frame(n)),
                    Some(&tag),
                    100_000,
                    1,
                );
            }
        }
        let window = Window { aggregate: true, ..all(0, u64::MAX) };
        let announced = s.window_size(window).bytes as usize;
        let data = s.window(window, proc(), Metadata::default());
        assert!(data.memory_bytes() <= announced, "{} > {announced}", data.memory_bytes());
        // A cell per thread, prefix and bucket, and one per thread for the newest samples, still raw.
        assert!(data.timeline.len() <= 60 * 4 * 6 + 4, "{} cells", data.timeline.len());
    }

    #[test]
    fn a_windows_size_counts_its_samples_and_bounds_its_export() {
        // 3 threads, 4 prefixes, 30 stacks, new task keys every second, 10 Hz for 2 hours,
        // in a store small enough that buckets merge, tables compact and the oldest go.
        let mut s = Store::new(64 * 1024);
        s.set_retention(Retention { recent_ns: 60 * NS_PER_S, step_ns: 10 * NS_PER_S });
        let end = 7_200 * NS_PER_S;
        for tick in 0..end / (NS_PER_S / 10) {
            for thread in 0..3 {
                let (prefix, leaf) =
                    (format!("p{}", (tick / 70 + thread) % 4), format!("f{}", (tick * 7 + thread) % 30));
                let tag = Tag { key: format!("{prefix}-{}", tick / 10), prefix, span: None };
                let t = tick * NS_PER_S / 10;
                s.record(t, thread, ["main", &leaf].iter().map(|n| frame(n)), Some(&tag), 100_000, 1);
            }
        }
        let st = s.stats();
        assert!(st.bucket_merges > 0 && st.compactions > 0 && st.samples_evicted > 0, "{st:?}");
        let oldest = st.oldest_ns.unwrap();
        let cuts = [0, oldest + 3 * NS_PER_S, oldest + 3_600 * NS_PER_S + 7, end - 90 * NS_PER_S, end - NS_PER_S, end];
        for (start, stop) in cuts.iter().flat_map(|&a| cuts.iter().filter(move |&&b| b > a).map(move |&b| (a, b))) {
            for aggregate in [false, true] {
                let window = Window { aggregate, ..all(start, stop) };
                let size = s.window_size(window);
                let data = s.window(window, proc(), Metadata::default());
                assert_eq!(size.samples, data.n_samples(), "{start}..{stop} aggregate={aggregate}");
                assert!(data.memory_bytes() as u64 <= size.bytes, "{start}..{stop} aggregate={aggregate}");
            }
        }
    }

    #[test]
    fn a_buckets_rows_make_one_cell_from_the_first_start_to_the_last_end() {
        // One thread runs prefix "a" in seconds 12-20 and 41-50 of a folded minute, under
        // two stacks: one timeline cell, over 12-50 s, not one per 10 s a row began in.
        let mut s = Store::new(1 << 20);
        s.set_retention(Retention { recent_ns: 0, step_ns: 60 * NS_PER_S });
        let minute = 1_000 * 60 * NS_PER_S;
        let tag = Tag { key: "a-1".into(), prefix: "a".into(), span: None };
        for ms in (12_000..20_000).chain(41_000..50_000).step_by(10) {
            let leaf = if ms % 20 == 0 { "f" } else { "g" };
            s.record(minute + ms * 1_000_000, 1, ["main", leaf].iter().map(|n| frame(n)), Some(&tag), 10_000, 1);
        }
        push(&mut s, minute + 61 * NS_PER_S, &["main"], None); // closes the minute's bucket
        let data =
            s.window(Window { aggregate: true, ..all(0, minute + 60 * NS_PER_S - 1) }, proc(), Metadata::default());
        assert_eq!(data.timeline.len(), 1, "{:?}", data.timeline);
        let (from, to) = data.timeline[0].extent().expect("a folded cell has an extent");
        let near = |ns: u64, s: u64| ns.abs_diff(minute + s * NS_PER_S) < NS_PER_S / 2;
        assert!(near(from, 12) && near(to, 50), "{:?}", ((from - minute) as f64 / 1e9, (to - minute) as f64 / 1e9));
        assert_eq!(data.timeline[0].weight_us, 1_700 * 10_000);
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
        let aggregated = Window { start_ns: 0, stop_ns: 100, aggregate: true, spans: None, stalls: &[] };
        let w = s.window(aggregated, proc(), Metadata::default());
        assert_eq!(w.samples.len(), 3, "read and parse under prefix load, and the untagged one");
        assert_eq!((w.n_samples(), w.total_us()), (11, 10 * 10_000 + 45 + 10_000));
        assert!(w.tags.iter().all(|t| t.key == "load"), "keys merge into their prefix");
        assert_eq!(s.window_size(aggregated).samples, 11);
        assert!(s.window_size(aggregated).bytes < s.window_size(all(0, 100)).bytes);
    }
}
