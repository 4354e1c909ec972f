//! Folded history: samples older than the store's recent window, summed into buckets
//! of one step (a minute by default) per thread, stack, task prefix and span,
//! activity and state. Each row keeps where in its bucket its samples fell (the
//! first's start and the last's end, in 256ths of the bucket, coarsened as
//! buckets merge), so a window takes the share of a row that lies inside it, and
//! the row's samples say where their time went (`Sample::cover`): a phase that ran
//! in one corner of a bucket is placed there, not smeared over it nor dropped. When
//! memory is tight, the oldest pairs of buckets merge into buckets twice as long
//! before anything is dropped.

use crate::profile::build::{sum_into, Aggregator, Summed};
use crate::profile::sample::{Sample, FLAG_BLOCKS_LOOP};
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;
use std::cell::Cell;
use std::collections::VecDeque;

/// The longest a bucket gets by merging: its samples' weights (u32 microseconds)
/// then still hold a busy thread's whole bucket.
pub const MAX_STEP_NS: u64 = 3_600 * 1_000_000_000;

/// What a bucket keeps apart: thread, stack, tag (a prefix's), activity and flags.
type Key = (u32, u32, Option<u32>, Option<u32>, u8);

const INDEX_ENTRY_BYTES: usize = std::mem::size_of::<(Key, usize)>() + 8;
const KEY_ROWS_BYTES: usize = std::mem::size_of::<(Key, u32)>() + 8;
pub const FOLDED_BYTES: usize = std::mem::size_of::<Folded>();

const NONE: u32 = u32::MAX;
/// Activity ids from this on lose their activity when folded (a process names a few
/// dozen): an activity shares 16 bits with the flags' 6, so a row stays 28 bytes.
const NO_ACTIVITY: u16 = (1 << 10) - 1;
const FLAG_BITS: u16 = 6;
const _: () = assert!((FLAG_BLOCKS_LOOP as u16) < 1 << FLAG_BITS, "a sample's flags fit in FLAG_BITS");
/// A bucket's length in the units a row's extent is kept in.
const UNITS: u64 = 1 << 8;

/// A folded sample without its time: its bucket's, and the units of it its samples
/// fell in, `first..=last`.
#[derive(Clone, Copy, Debug)]
struct Folded {
    thread: u32,
    stack: u32,
    tag: u32,
    weight_us: u32,
    cpu_us: u32,
    count: u32,
    /// Activity id << FLAG_BITS | flags.
    activity_flags: u16,
    first: u8,
    last: u8,
}

impl Summed for Folded {
    fn sums(&mut self) -> [&mut u32; 3] {
        [&mut self.weight_us, &mut self.cpu_us, &mut self.count]
    }

    fn widen(&mut self, other: &Folded) {
        (self.first, self.last) = (self.first.min(other.first), self.last.max(other.last));
    }
}

impl Folded {
    /// `s` folded, its samples in units `first..=last` of its bucket.
    fn of(s: &Sample, (first, last): (u8, u8)) -> Folded {
        let activity = s.activity.and_then(|a| u16::try_from(a).ok()).filter(|&a| a < NO_ACTIVITY);
        Folded {
            thread: s.thread,
            stack: s.stack,
            tag: s.tag.unwrap_or(NONE),
            weight_us: s.weight_us,
            cpu_us: s.cpu_us.min(s.weight_us), // as views cap it, per raw sample
            count: s.count,
            activity_flags: activity.unwrap_or(NO_ACTIVITY) << FLAG_BITS | u16::from(s.flags),
            first,
            last,
        }
    }

    fn at(&self, time_ns: u64) -> Sample {
        Sample {
            time_ns,
            thread: self.thread,
            stack: self.stack,
            tag: (self.tag != NONE).then_some(self.tag),
            activity: Some(self.activity_flags >> FLAG_BITS).filter(|&a| a != NO_ACTIVITY).map(u32::from),
            weight_us: self.weight_us,
            cpu_us: self.cpu_us,
            count: self.count,
            flags: (self.activity_flags & ((1 << FLAG_BITS) - 1)) as u8,
            cover: 0,
        }
    }

    fn key(&self) -> Key {
        let s = self.at(0);
        (s.thread, s.stack, s.tag, s.activity, s.flags)
    }

    /// The extent as a bucket twice as long has it, this one its `half` (0 or 1).
    fn coarsened(self, half: u8) -> Folded {
        let (first, last) = (self.first / 2 + half * (UNITS / 2) as u8, self.last / 2 + half * (UNITS / 2) as u8);
        Folded { first, last, ..self }
    }
}

pub struct Bucket {
    pub start_ns: u64,
    pub step_ns: u64,
    samples: Vec<Folded>,
    /// The raw samples its rows stand for.
    count: u64,
    /// Its rows' timeline cells, once counted, and the step they were counted at.
    cells: Cell<Option<(u64, usize)>>,
}

impl Bucket {
    fn new(start_ns: u64, step_ns: u64) -> Bucket {
        Bucket { start_ns, step_ns, samples: Vec::new(), count: 0, cells: Cell::new(None) }
    }

    fn end_ns(&self) -> u64 {
        self.start_ns + self.step_ns
    }

    /// Sums `s` into the sample of its key, or a new one when that one is full; true
    /// when it took a new row.
    fn add(&mut self, index: &mut FxHashMap<Key, usize>, s: Folded) -> bool {
        let before = self.samples.len();
        self.count += u64::from(s.count);
        self.cells.set(None);
        sum_into(&mut self.samples, index.entry(s.key()).or_insert(usize::MAX), s);
        self.samples.len() > before
    }

    /// Its rows' timeline cells in an aggregated window (`Aggregator::cell`), counted
    /// once per step.
    fn cells(&self, folded_step_ns: u64) -> usize {
        match self.cells.get() {
            Some((step, n)) if step == folded_step_ns => n,
            _ => {
                let parts = self.parts(self.start_ns, self.end_ns());
                let n = parts.map(|s| Aggregator::cell(&s, folded_step_ns)).collect::<FxHashSet<_>>().len();
                self.cells.set(Some((folded_step_ns, n)));
                n
            }
        }
    }

    /// The time `units` into the bucket.
    fn time_at(&self, units: u64) -> u64 {
        self.start_ns + (u128::from(units) * u128::from(self.step_ns) / u128::from(UNITS)) as u64
    }

    /// The units of the bucket `[time_ns, time_ns + weight)` falls in.
    fn units_of(&self, time_ns: u64, weight_us: u32) -> (u8, u8) {
        let units = |ns: u64| u128::from(ns.min(self.step_ns)) * u128::from(UNITS);
        let step = u128::from(self.step_ns);
        let from = time_ns.saturating_sub(self.start_ns);
        let first = (units(from) / step).min(u128::from(UNITS - 1)) as u64;
        let end = (units(from + u64::from(weight_us) * 1000).div_ceil(step) as u64).max(first + 1);
        (first as u8, (end - 1).min(UNITS - 1) as u8)
    }

    /// Its rows' parts in `[lo, hi)`, each placed where its samples fell.
    fn parts(&self, lo: u64, hi: u64) -> impl Iterator<Item = Sample> + Clone + '_ {
        self.samples.iter().filter_map(move |f| {
            let extent = (self.time_at(f.first.into()), self.time_at(u64::from(f.last) + 1));
            f.at(extent.0).part(extent, (lo, hi))
        })
    }
}

/// A stretch of time at one resolution, for a profile's metadata.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Resolution {
    pub from_ns: u64,
    pub to_ns: u64,
    /// 0: raw samples.
    pub step_ns: u64,
}

/// What the buckets a window overlaps would add to its export (see `History::size`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FoldedSize {
    /// The samples their parts in the window stand for.
    pub taken: u64,
    /// Their parts in the window.
    pub rows: usize,
    /// Aggregated: at most this many samples and this many timeline cells.
    pub keys: usize,
    pub cells: usize,
}

#[derive(Default)]
pub struct History {
    buckets: VecDeque<Bucket>,
    /// Where the newest bucket keeps each key's sample (the only one still filling).
    open: FxHashMap<Key, usize>,
    /// How many rows hold each key, in all buckets: a bound on an aggregated window's samples.
    keys: FxHashMap<Key, u32>,
    held: usize,
    /// The raw samples the held ones stand for.
    pub standing: u64,
    pub merges: u64,
    pub dropped_samples: u64,
}

/// `[start_ns, stop_ns]` as a half-open range.
fn half_open(start_ns: u64, stop_ns: u64) -> (u64, u64) {
    (start_ns, stop_ns.saturating_add(1))
}

impl History {
    /// Folds `s` (its tag already a prefix's) into the bucket of `step_ns` its time
    /// falls in; returns the bucket it closed by opening a newer one, as (start, end).
    pub fn fold(&mut self, s: Sample, step_ns: u64) -> Option<(u64, u64)> {
        let start = s.time_ns - s.time_ns % step_ns;
        let mut closed = None;
        // A sample older than the newest bucket (a clock step back) joins it.
        if self.buckets.back().is_none_or(|b| start >= b.end_ns()) {
            // Its cells counted as it closes, so that no window's size has to.
            closed = self.buckets.back().map(|b| {
                b.cells(step_ns);
                (b.start_ns, b.end_ns())
            });
            self.open.clear();
            self.buckets.push_back(Bucket::new(start, step_ns));
        }
        let newest = self.buckets.back_mut().expect("just made");
        self.standing += u64::from(s.count);
        let folded = Folded::of(&s, newest.units_of(s.time_ns, s.weight_us));
        if newest.add(&mut self.open, folded) {
            self.held += 1;
            *self.keys.entry(folded.key()).or_default() += 1;
        }
        closed
    }

    /// One row fewer holds `key`.
    fn forget(&mut self, key: Key) {
        if let Some(rows) = self.keys.get_mut(&key) {
            *rows -= 1;
            if *rows == 0 {
                self.keys.remove(&key);
            }
        }
    }

    pub fn samples_held(&self) -> usize {
        self.held
    }

    pub fn bytes(&self) -> usize {
        self.held * FOLDED_BYTES + self.open.len() * INDEX_ENTRY_BYTES + self.keys.len() * KEY_ROWS_BYTES
    }

    pub fn oldest_ns(&self) -> Option<u64> {
        self.buckets.front().map(|b| b.start_ns)
    }

    /// Merges the oldest two neighbouring buckets of one step that make an aligned
    /// bucket twice as long, and counts its timeline cells at `cell_step_ns` (the step
    /// buckets open at); returns its span, or None if no pair can merge.
    pub fn merge_oldest(&mut self, cell_step_ns: u64) -> Option<(u64, u64)> {
        let closed = self.buckets.len().saturating_sub(1); // the newest is still filling
        let i = (0..closed.saturating_sub(1)).find(|&i| {
            let (a, b) = (&self.buckets[i], &self.buckets[i + 1]);
            let step = a.step_ns * 2;
            step <= MAX_STEP_NS && a.start_ns % step == 0 && b.step_ns == a.step_ns && b.start_ns == a.end_ns()
        })?;
        let second = self.buckets.remove(i + 1).expect("found");
        let first = &mut self.buckets[i];
        first.step_ns *= 2;
        first.count = 0;
        let mut index = FxHashMap::default();
        let samples = std::mem::take(&mut first.samples);
        let halves = samples.into_iter().map(|s| s.coarsened(0));
        let mut summed = Vec::new(); // rows summed into another: one fewer holds their key
        for s in halves.chain(second.samples.into_iter().map(|s| s.coarsened(1))) {
            if !first.add(&mut index, s) {
                summed.push(s.key());
            }
        }
        first.cells(cell_step_ns);
        let span = (first.start_ns, first.end_ns());
        self.held -= summed.len();
        summed.into_iter().for_each(|key| self.forget(key));
        self.merges += 1;
        Some(span)
    }

    /// Drops the oldest bucket; returns its end, or None if there was none.
    pub fn drop_oldest(&mut self) -> Option<u64> {
        let oldest = self.buckets.pop_front()?;
        if self.buckets.is_empty() {
            self.open.clear();
        }
        self.held -= oldest.samples.len();
        oldest.samples.iter().for_each(|s| self.forget(s.key()));
        self.standing -= oldest.count;
        self.dropped_samples += oldest.count;
        Some(oldest.end_ns())
    }

    /// The parts of the rows that lie in `[start_ns, stop_ns]`, each at where its
    /// samples began in the window and covering where they went (`Sample::cover`).
    pub fn range(&self, start_ns: u64, stop_ns: u64) -> impl Iterator<Item = Sample> + Clone + '_ {
        let (lo, hi) = half_open(start_ns, stop_ns);
        self.in_range(start_ns, stop_ns).flat_map(move |b| b.parts(lo, hi))
    }

    /// What the buckets overlapping `[start_ns, stop_ns]` would add to a window's export,
    /// without cutting the rows of those it holds whole: samples and rows exact; an
    /// aggregated window's samples at most the keys of all buckets, and its cells at most
    /// those of each bucket whole (`folded_step_ns`: `Aggregator::folded_step_ns`).
    pub fn size(&self, start_ns: u64, stop_ns: u64, folded_step_ns: u64) -> FoldedSize {
        let (lo, hi) = half_open(start_ns, stop_ns);
        let mut size = FoldedSize::default();
        for b in self.in_range(start_ns, stop_ns) {
            if lo <= b.start_ns && b.end_ns() <= hi {
                (size.taken, size.rows) = (size.taken + b.count, size.rows + b.samples.len());
            } else {
                for s in b.parts(lo, hi) {
                    size.taken += u64::from(s.count);
                    size.rows += 1;
                }
            }
            size.cells += b.cells(folded_step_ns);
        }
        size.keys = self.keys.len().min(size.rows);
        size
    }

    /// The buckets that overlap `[start_ns, stop_ns]`.
    fn in_range(&self, start_ns: u64, stop_ns: u64) -> impl Iterator<Item = &Bucket> + Clone {
        self.buckets.iter().filter(move |b| b.start_ns <= stop_ns && b.end_ns() > start_ns)
    }

    /// The stretches of `[start_ns, stop_ns]` the buckets cover, one per run of one
    /// step: there, a row's time is placed in proportion to where its samples fell.
    pub fn resolution(&self, start_ns: u64, stop_ns: u64) -> Vec<Resolution> {
        let (lo, hi) = half_open(start_ns, stop_ns);
        let mut out: Vec<Resolution> = Vec::new();
        for b in self.in_range(start_ns, stop_ns) {
            let (from_ns, to_ns) = (b.start_ns.max(lo), b.end_ns().min(hi));
            match out.last_mut() {
                Some(last) if last.step_ns == b.step_ns && last.to_ns == from_ns => last.to_ns = to_ns,
                _ => out.push(Resolution { from_ns, to_ns, step_ns: b.step_ns }),
            }
        }
        out
    }

    /// Every sample through `renumber`, after the store compacts its tables.
    pub fn renumber(&mut self, mut renumber: impl FnMut(Sample) -> Sample) {
        self.open.clear(); // keys change: the newest bucket starts a fresh index
        self.keys.clear();
        for b in &mut self.buckets {
            for f in &mut b.samples {
                *f = Folded::of(&renumber(f.at(b.start_ns)), (f.first, f.last));
                *self.keys.entry(f.key()).or_default() += 1;
            }
        }
    }

    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 60 * 1_000_000_000;

    fn sample(time_ns: u64, stack: u32) -> Sample {
        Sample {
            time_ns,
            thread: 0,
            stack,
            tag: None,
            activity: None,
            weight_us: 10_000,
            cpu_us: 20_000,
            count: 1,
            flags: 1,
            cover: 0,
        }
    }

    fn weight(h: &History) -> u64 {
        h.range(0, u64::MAX).map(|s| u64::from(s.weight_us)).sum()
    }

    #[test]
    fn samples_sum_per_key_into_their_step() {
        let mut h = History::default();
        assert_eq!(h.fold(sample(MIN + 5, 1), MIN), None);
        h.fold(sample(MIN + 7, 1), MIN);
        h.fold(sample(MIN + 9, 2), MIN);
        assert_eq!(h.fold(sample(2 * MIN, 1), MIN), Some((MIN, 2 * MIN)), "a newer step closes the bucket");
        let first: Vec<Sample> = h.range(MIN, 2 * MIN - 1).collect();
        assert_eq!(first.len(), 2);
        assert_eq!((first[0].time_ns, first[0].weight_us, first[0].count), (MIN, 20_000, 2));
        assert_eq!(first[0].cpu_us, 20_000, "CPU capped per sample at its wall time");
        assert_eq!(h.samples_held(), 3);
        assert_eq!(weight(&h), 40_000);
    }

    #[test]
    fn the_oldest_pairs_merge_first_and_keep_every_microsecond() {
        let mut h = History::default();
        for minute in 0..5 {
            h.fold(sample(minute * MIN, minute as u32 % 2), MIN);
            h.fold(sample(minute * MIN + 1, 7), MIN);
        }
        assert_eq!(h.merge_oldest(MIN), Some((0, 2 * MIN)));
        assert_eq!(h.merge_oldest(MIN), Some((2 * MIN, 4 * MIN)));
        assert_eq!(h.merge_oldest(MIN), Some((0, 4 * MIN)), "then the merged ones, oldest first");
        assert_eq!(h.merge_oldest(MIN), None, "the newest bucket is still filling");
        assert_eq!(weight(&h), 100_000);
        assert_eq!(h.samples_held(), 3 + 2, "stacks 0, 1 and 7 in the first four minutes, 0 and 7 in the fifth");
        let res = h.resolution(0, u64::MAX);
        assert_eq!(
            res,
            [
                Resolution { from_ns: 0, to_ns: 4 * MIN, step_ns: 4 * MIN },
                Resolution { from_ns: 4 * MIN, to_ns: 5 * MIN, step_ns: MIN }
            ]
        );
    }

    const SEC: u64 = 1_000_000_000;

    /// Seconds of `stack` the parts of `[lo, hi]` hold.
    fn seconds_of(h: &History, stack: u32, lo: u64, hi: u64) -> f64 {
        h.range(lo, hi).filter(|s| s.stack == stack).map(|s| u64::from(s.weight_us)).sum::<u64>() as f64 / 1e6
    }

    /// Stack 1 for the first 10 s of the minute from `MIN`, 100 samples a second; stack
    /// 2 once in the next minute, which closes the first.
    fn a_phase_in_a_corner() -> History {
        let mut h = History::default();
        (0..1000).for_each(|i| _ = h.fold(sample(MIN + i * SEC / 100, 1), MIN));
        h.fold(sample(2 * MIN, 2), MIN);
        h
    }

    #[test]
    fn a_window_takes_the_share_of_a_row_that_lies_in_it() {
        let h = a_phase_in_a_corner();
        assert_eq!(h.samples_held(), 2, "one row for the phase");
        assert_eq!(seconds_of(&h, 1, 0, u64::MAX), 10.0);
        assert_eq!(seconds_of(&h, 1, MIN - SEC, 3 * MIN), 10.0, "a padded window takes it whole");
        assert!((seconds_of(&h, 1, 0, MIN + 5 * SEC - 1) - 5.0).abs() < 0.1, "half of it ran by then, to a unit");
        assert_eq!(seconds_of(&h, 1, MIN + 11 * SEC, 2 * MIN - 1), 0.0, "none where it did not run");
        let part = h.range(MIN + 5 * SEC, u64::MAX).find(|s| s.stack == 1).unwrap();
        assert_eq!((part.time_ns, part.cover), (MIN + 5 * SEC, 50), "where it went on from there");
        // Windows that partition the run add up to it, to the microsecond and the sample.
        let cuts = [0, MIN + 1_234_567, MIN + 3 * SEC, MIN + 7 * SEC + 1, MIN + 9_999_999_999, 3 * MIN];
        let parts: Vec<Sample> = cuts.windows(2).flat_map(|w| h.range(w[0], w[1] - 1)).collect();
        let sum = |f: fn(&Sample) -> u32| parts.iter().filter(|s| s.stack == 1).map(|s| u64::from(f(s))).sum::<u64>();
        assert_eq!((sum(|s| s.weight_us), sum(|s| s.cpu_us), sum(|s| s.count)), (10_000_000, 10_000_000, 1000));
    }

    #[test]
    fn merged_buckets_keep_where_their_rows_ran() {
        // Stack 1 in the last 10 s of minute 2; minutes 3 and 4 hold stack 2 at their starts.
        let mut h = History::default();
        (0..1000).for_each(|i| _ = h.fold(sample(2 * MIN + 50 * SEC + i * SEC / 100, 1), MIN));
        (3..5).for_each(|m| _ = h.fold(sample(m * MIN, 2), MIN));
        assert_eq!(h.merge_oldest(MIN), Some((2 * MIN, 4 * MIN)));
        let before = seconds_of(&h, 1, 2 * MIN, 2 * MIN + 50 * SEC - 1);
        assert!(before < 0.5, "not smeared over the merged bucket: {before} s (at most a unit of it)");
        assert!((seconds_of(&h, 1, 2 * MIN + 55 * SEC, 4 * MIN) - 5.0).abs() < 0.3);
        assert_eq!(seconds_of(&h, 2, 2 * MIN, 3 * MIN - 1), 0.0, "the second half's rows stay in it");
        assert_eq!(seconds_of(&h, 2, 3 * MIN, 3 * MIN + SEC), 0.01);
    }

    #[test]
    fn a_row_takes_28_bytes() {
        assert_eq!(FOLDED_BYTES, 28, "a day of history at one-minute steps fits in 64 MiB (retention benchmark)");
        let mut s = sample(0, 1);
        (s.activity, s.flags) = (Some(NO_ACTIVITY as u32 - 1), 63);
        let back = Folded::of(&s, (0, 0)).at(0);
        assert_eq!((back.activity, back.flags), (s.activity, s.flags));
        s.activity = Some(NO_ACTIVITY.into());
        assert_eq!(Folded::of(&s, (0, 0)).at(0).activity, None, "past the ids a row holds");
    }

    #[test]
    fn the_rows_of_each_key_are_counted_through_merges_drops_and_renumbering() {
        let mut h = History::default();
        for minute in 0..9 {
            (0..minute % 4 + 1).for_each(|stack| _ = h.fold(sample(minute * MIN + stack, stack as u32), MIN));
        }
        let counted = |h: &History| {
            let mut rows: FxHashMap<Key, u32> = FxHashMap::default();
            h.buckets.iter().flat_map(|b| &b.samples).for_each(|f| *rows.entry(f.key()).or_default() += 1);
            rows
        };
        assert_eq!(h.keys, counted(&h));
        while h.merge_oldest(MIN).is_some() {
            assert_eq!(h.keys, counted(&h));
        }
        h.drop_oldest();
        assert_eq!(h.keys, counted(&h));
        h.renumber(|s| Sample { stack: s.stack + 10, ..s });
        assert_eq!(h.keys, counted(&h));
        let size = h.size(0, u64::MAX, MIN);
        assert_eq!((size.taken, size.rows, size.keys), (h.standing, h.held, counted(&h).len()));
    }

    #[test]
    fn dropping_counts_what_went() {
        let mut h = History::default();
        h.fold(sample(0, 1), MIN);
        h.fold(sample(1, 1), MIN);
        h.fold(sample(MIN, 1), MIN);
        assert_eq!(h.drop_oldest(), Some(MIN));
        assert_eq!((h.dropped_samples, h.samples_held(), h.oldest_ns()), (2, 1, Some(MIN)));
        assert_eq!(h.standing, 1);
        assert_eq!(h.drop_oldest(), Some(2 * MIN));
        assert_eq!(h.drop_oldest(), None);
    }
}
