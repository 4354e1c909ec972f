//! When each sample's time went, for the timeline.
//!
//! A thread's samples at one instant together cover `[time, time + their summed
//! weight]`, and each is spread over the steps that interval overlaps in proportion to
//! its weight. Raw samples weigh one tick (milliseconds), so this is the step holding
//! their time; a coarse sample standing for a whole bucket (time at the bucket's start,
//! weight the thread's time in it) spreads over the bucket instead of piling up in the
//! step its start falls in, so a timeline finer than the buckets shows no comb of
//! spikes. A folded history row's part knows where its samples fell (`Sample::cover`)
//! and spreads over that alone. Either way every sample's time is counted once: the
//! steps add up to the profile's totals.

use crate::profile::build::CELL_NS;
use crate::profile::model::ProfileData;
use crate::profile::sample::Sample;
use std::borrow::Cow;

/// A thread's samples at one instant, gathered until its next instant: indices into
/// the samples, and their summed weight in microseconds.
#[derive(Default)]
pub struct Instant {
    time_ns: u64,
    weight_us: u64,
    samples: Vec<usize>,
}

/// The samples that say when time went: the timeline cells of aggregated processes,
/// the samples of raw ones (a thread's are all of one kind, in time order). Per thread,
/// the least an instant covers: a cell its whole step, since when in the step its time
/// went is not known.
pub struct Timed<'a> {
    pub samples: Cow<'a, [Sample]>,
    pub least_us: Vec<u64>,
}

impl Timed<'_> {
    pub fn of(data: &ProfileData) -> Timed<'_> {
        let celled = data.processes_with_cells();
        let in_cells = |thread: u32| celled[data.threads[thread as usize].process as usize];
        let least_us = (0..data.threads.len() as u32).map(|t| if in_cells(t) { CELL_NS / 1000 } else { 0 }).collect();
        let samples = if data.timeline.is_empty() {
            Cow::Borrowed(&data.samples[..])
        } else if data.samples.iter().all(|s| in_cells(s.thread)) {
            Cow::Borrowed(&data.timeline[..])
        } else {
            Cow::Owned(
                data.timeline.iter().chain(data.samples.iter().filter(|s| !in_cells(s.thread))).cloned().collect(),
            )
        };
        Timed { samples, least_us }
    }

    /// Calls `each(instant's time, the µs it covers, its samples)` once per thread and
    /// instant. A thread's instant ends where its next begins; where samples are out of
    /// time order, an instant is split, which only spreads its time less. An instant
    /// covers its weight, and at least its thread's least cover.
    pub fn for_each_instant(&self, mut each: impl FnMut(u64, u64, &[usize])) {
        let mut open: Vec<Instant> = self.least_us.iter().map(|_| Instant::default()).collect();
        let flush = |i: &mut Instant, least_us: u64, each: &mut dyn FnMut(u64, u64, &[usize])| {
            if !i.samples.is_empty() {
                each(i.time_ns, i.weight_us.max(least_us), &i.samples);
                i.samples.clear();
                i.weight_us = 0;
            }
        };
        for (index, s) in self.samples.iter().enumerate() {
            if let Some((from, to)) = s.extent() {
                // A folded row's part: its time went over its extent, on its own.
                each(from, ((to - from) / 1000).max(s.weight_us.into()), &[index]);
                continue;
            }
            let instant = &mut open[s.thread as usize];
            if instant.time_ns != s.time_ns {
                flush(instant, self.least_us[s.thread as usize], &mut each);
                instant.time_ns = s.time_ns;
            }
            instant.weight_us += s.weight_us as u64;
            instant.samples.push(index);
        }
        for (instant, &least_us) in open.iter_mut().zip(&self.least_us) {
            flush(instant, least_us, &mut each);
        }
    }
}

/// The steps `[start_ns, start_ns + cover_us]` overlaps, with the share of it in each.
pub fn shares(start_ns: u64, cover_us: u64, first_ns: u64, step_ns: f64, mut each: impl FnMut(usize, f64)) {
    let from = (start_ns - first_ns) as f64;
    let cover = cover_us as f64 * 1e3;
    let first = (from / step_ns) as usize;
    if cover == 0.0 || ((from + cover) / step_ns) as usize == first {
        return each(first, 1.0);
    }
    let to = from + cover;
    let mut step = first;
    while (step as f64) * step_ns < to {
        let lo = from.max(step as f64 * step_ns);
        let hi = to.min((step + 1) as f64 * step_ns);
        if hi > lo {
            each(step, (hi - lo) / cover);
        }
        step += 1;
    }
}

/// The profile's first instant and the end of its last cover, in ns.
pub fn extent(timed: &Timed) -> Option<(u64, u64)> {
    let mut bounds: Option<(u64, u64)> = None;
    timed.for_each_instant(|time_ns, cover_us, _| {
        let end = time_ns + cover_us * 1000;
        bounds = Some(bounds.map_or((time_ns, end), |(lo, hi)| (lo.min(time_ns), hi.max(end))));
    });
    bounds
}
