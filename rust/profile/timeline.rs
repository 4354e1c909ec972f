//! What ran when: wall and CPU seconds per time step, per process kind (scheduler or
//! worker), for each task prefix (or span), each event-loop activity outside tasks,
//! and "(no task)". Each sample's time goes to the steps it went in (`spread.rs`), so
//! the steps add up to the profile's totals; each process's CPU and memory where its
//! sampler kept them (`resources.rs`).

use crate::error::{Error, Result};
use crate::names::choose;
use crate::profile::model::{Process, ProfileData};
use crate::profile::resources::{resources, Resources};
use crate::profile::sample::Sample;
use crate::profile::spread::{extent, shares, Timed};
use crate::profile::views::{Weight, NO_SPAN, NO_TASK};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;

/// Steps the default picks from, in seconds: the first giving at most `MOST_STEPS`.
const STEPS: [f64; 18] = [
    1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0, 10800.0, 21600.0,
    43200.0, 86400.0,
];
const MOST_STEPS: f64 = 300.0;
/// A given step finer than this many steps over the profile is refused: series x steps
/// floats must stay small.
pub const MAX_STEPS: usize = 20_000;

/// The process kind of a scheduler, whose process name starts with it; every other
/// process is a worker.
pub const SCHEDULER: &str = "scheduler";
pub const WORKER: &str = "worker";
const KINDS: [&str; 2] = [SCHEDULER, WORKER];

fn kind(process: &Process) -> &'static str {
    if process.name.starts_with(SCHEDULER) {
        SCHEDULER
    } else {
        WORKER
    }
}

/// What task time is split by: its task prefix, or its span path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeriesBy {
    Prefix,
    Span,
}

impl FromStr for SeriesBy {
    type Err = Error;
    fn from_str(s: &str) -> Result<SeriesBy> {
        choose("by", s, &[("prefix", SeriesBy::Prefix), ("span", SeriesBy::Span)])
    }
}

/// Seconds per step of one process kind, or one series of it.
#[derive(Serialize, Debug, Clone, Default)]
pub struct Steps {
    pub wall: Vec<f64>,
    pub cpu: Vec<f64>,
}

#[derive(Serialize, Debug)]
pub struct KindTimes {
    pub processes: usize,
    #[serde(flatten)]
    pub steps: Steps,
}

#[derive(Serialize, Debug)]
pub struct Series {
    pub name: String,
    pub kind: &'static str,
    /// "prefix" or "span" for task time, "activity" outside tasks (with "(no task)").
    pub group: &'static str,
    /// Total wall seconds, which orders the series (largest first).
    pub seconds: f64,
    #[serde(flatten)]
    pub steps: Steps,
}

#[derive(Serialize, Debug)]
pub struct Timeline {
    /// Seconds per step.
    pub step: f64,
    /// Unix seconds where the first step starts: a multiple of `step`.
    pub start: f64,
    pub steps: usize,
    /// Totals per kind present: its processes and every sample's seconds per step.
    pub kinds: BTreeMap<&'static str, KindTimes>,
    pub series: Vec<Series>,
    /// Each process's CPU and memory per step, where its sampler kept them.
    pub processes: Vec<Resources>,
}

/// The step for a profile spanning `span` seconds: `given` checked, or the default, no
/// finer than `least` (a timeline cell's step: finer steps would only repeat its value).
fn choose_step(given: Option<f64>, span: f64, least: f64) -> Result<f64> {
    let Some(step) = given else {
        let fits = |s: &f64| span / s <= MOST_STEPS && *s >= least;
        return Ok(STEPS.into_iter().find(fits).unwrap_or(STEPS[STEPS.len() - 1]));
    };
    if !(step.is_finite() && step > 0.0) {
        return Err(Error::BadInput(format!("step must be a number of seconds above 0, got {step}")));
    }
    if span / step > MAX_STEPS as f64 {
        return Err(Error::BadInput(format!(
            "step must give at most {MAX_STEPS} steps over the profile's {span:.0} s, got step={step} ({:.0} steps)",
            (span / step).ceil()
        )));
    }
    Ok(step)
}

/// Where a series goes: one per kind, group and name, found once per tag and activity.
struct SeriesIndex<'a> {
    data: &'a ProfileData,
    by: SeriesBy,
    /// Per process: its kind's index in `KINDS`.
    kind_of_process: Vec<usize>,
    named: HashMap<(usize, &'static str, String), usize>,
    series: Vec<Series>,
    by_tag: Vec<[Option<usize>; 2]>,
    by_activity: Vec<[Option<usize>; 2]>,
    no_task: [Option<usize>; 2],
    steps: usize,
}

impl<'a> SeriesIndex<'a> {
    fn new(data: &'a ProfileData, by: SeriesBy, steps: usize) -> SeriesIndex<'a> {
        SeriesIndex {
            data,
            by,
            kind_of_process: data.processes.iter().map(|p| (kind(p) == WORKER) as usize).collect(),
            named: HashMap::new(),
            series: Vec::new(),
            by_tag: vec![[None; 2]; data.tags.len()],
            by_activity: vec![[None; 2]; data.activities.len()],
            no_task: [None; 2],
            steps,
        }
    }

    fn kind(&self, s: &Sample) -> usize {
        self.kind_of_process[self.data.threads[s.thread as usize].process as usize]
    }

    /// The series of `s`, made on first use.
    fn of(&mut self, s: &Sample) -> usize {
        let kind = self.kind(s);
        let cached = match (s.tag, s.activity) {
            (Some(t), _) => self.by_tag[t as usize][kind],
            (None, Some(a)) => self.by_activity[a as usize][kind],
            (None, None) => self.no_task[kind],
        };
        if let Some(index) = cached {
            return index;
        }
        let (group, name) = self.name(s);
        let next = self.series.len();
        let index = *self.named.entry((kind, group, name.clone())).or_insert(next);
        if index == next {
            let steps = Steps { wall: vec![0.0; self.steps], cpu: vec![0.0; self.steps] };
            self.series.push(Series { name, kind: KINDS[kind], group, seconds: 0.0, steps });
        }
        let slot = match (s.tag, s.activity) {
            (Some(t), _) => &mut self.by_tag[t as usize][kind],
            (None, Some(a)) => &mut self.by_activity[a as usize][kind],
            (None, None) => &mut self.no_task[kind],
        };
        *slot = Some(index);
        index
    }

    fn name(&self, s: &Sample) -> (&'static str, String) {
        let data = self.data;
        match (s.tag.map(|t| &data.tags[t as usize]), s.activity, self.by) {
            (Some(tag), _, SeriesBy::Prefix) => ("prefix", tag.prefix.clone()),
            (Some(tag), _, SeriesBy::Span) => {
                let path = data.span_names(tag);
                ("span", if path.is_empty() { NO_SPAN.into() } else { path.join(" / ") })
            }
            (None, Some(a), _) => ("activity", data.activities[a as usize].clone()),
            (None, None, _) => ("activity", NO_TASK.into()),
        }
    }
}

/// The timeline of `data` with steps of `step` seconds (None: 100 to 300 steps over
/// the profile), covering at least `bounds` (Unix seconds) where given.
pub fn timeline(data: &ProfileData, step: Option<f64>, by: SeriesBy, bounds: Option<(f64, f64)>) -> Result<Timeline> {
    let timed = Timed::of(data);
    let (mut lo, mut hi) =
        extent(&timed).map_or((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi)| (lo as f64 / 1e9, hi as f64 / 1e9));
    if let Some((start, stop)) = bounds {
        (lo, hi) = (lo.min(start), hi.max(stop));
    }
    if lo > hi {
        (lo, hi) = (0.0, 0.0);
    }
    let least = timed.least_us.iter().max().map_or(0.0, |&us| us as f64 / 1e6); // cells' step, if any
    let step = choose_step(step, hi - lo, least)?;
    let start = (lo / step).floor() * step;
    let steps = (((hi - start) / step).ceil() as usize).max(1);
    let (first_ns, step_ns) = ((start * 1e9) as u64, step * 1e9);
    let mut index = SeriesIndex::new(data, by, steps);
    let mut kinds: Vec<Steps> = vec![Steps { wall: vec![0.0; steps], cpu: vec![0.0; steps] }; 2];
    let last = steps - 1;
    timed.for_each_instant(|time_ns, cover_us, samples| {
        shares(time_ns.max(first_ns), cover_us, first_ns, step_ns, |at, share| {
            let at = at.min(last); // float rounding at the very end
            for &i in samples {
                let s = &timed.samples[i];
                let (wall, cpu) = (s.weight_us as f64 * share / 1e6, Weight::Cpu.of(s) as f64 * share / 1e6);
                let at_series = index.of(s);
                let series = &mut index.series[at_series].steps;
                series.wall[at] += wall;
                series.cpu[at] += cpu;
                let kind = &mut kinds[index.kind(s)];
                kind.wall[at] += wall;
                kind.cpu[at] += cpu;
            }
        })
    });
    let mut processes = [0usize; 2];
    index.kind_of_process.iter().for_each(|&k| processes[k] += 1);
    let mut series = index.series;
    for s in &mut series {
        s.seconds = s.steps.wall.iter().sum();
    }
    series.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| (a.kind, &a.name).cmp(&(b.kind, &b.name))));
    let kinds = KINDS
        .into_iter()
        .zip(kinds)
        .zip(processes)
        .filter(|&(_, n)| n > 0)
        .map(|((kind, steps), processes)| (kind, KindTimes { processes, steps }))
        .collect();
    let processes = resources(&data.processes, kind, start, step, steps);
    Ok(Timeline { step, start, steps, kinds, series, processes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;
    use crate::profile::model::Span;
    use crate::profile::summary::summarize;

    const S: u64 = 1_000_000_000;

    /// Unix seconds the test samples start at: a multiple of every step they use.
    const BASE: u64 = 1200;

    /// Samples of `(thread, seconds after BASE, tag)`, 10 ms each with 4 ms CPU.
    fn timed(samples: &[(u64, f64, Option<&str>)]) -> ProfileData {
        let shaped: Vec<(u64, &[&str], Option<&str>)> =
            samples.iter().map(|&(t, _, tag)| (t, &["f"][..], tag)).collect();
        let mut data = profile("tcp://w:1", &shaped);
        for (s, &(_, at, _)) in data.samples.iter_mut().zip(samples) {
            s.time_ns = BASE * S + (at * 1e9) as u64;
            s.cpu_us = 4_000;
        }
        data
    }

    fn series<'t>(t: &'t Timeline, name: &str) -> &'t Series {
        t.series.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no series {name}"))
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn default_steps_fit_the_span() {
        assert_eq!(choose_step(None, 5.0, 0.0).unwrap(), 1.0);
        assert_eq!(choose_step(None, 600.0, 0.0).unwrap(), 2.0);
        assert_eq!(choose_step(None, 3600.0, 0.0).unwrap(), 15.0);
        assert_eq!(choose_step(None, 86400.0, 0.0).unwrap(), 300.0);
        assert_eq!(choose_step(None, 1e9, 0.0).unwrap(), 86400.0);
        assert_eq!(choose_step(None, 5.0, 10.0).unwrap(), 10.0);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(choose_step(Some(bad), 10.0, 0.0).unwrap_err().to_string().starts_with("step must"), "{bad}");
        }
        assert!(choose_step(Some(0.001), 86400.0, 0.0).unwrap_err().to_string().contains("at most 20000 steps"));
        assert!("task".parse::<SeriesBy>().unwrap_err().to_string().contains("'prefix', 'span'"));
    }

    #[test]
    fn steps_add_up_to_the_summary_and_a_prefix_stays_in_its_interval() {
        let mut samples: Vec<(u64, f64, Option<&str>)> = (0..50).map(|i| (1, i as f64 * 0.1, Some("load-1"))).collect();
        samples.extend((50..100).map(|i| (1, i as f64 * 0.1, Some("sum-1"))));
        samples.extend((0..100).map(|i| (2, i as f64 * 0.1, None)));
        let data = timed(&samples);
        let t = timeline(&data, Some(1.0), SeriesBy::Prefix, None).unwrap();
        assert_eq!((t.step, t.start, t.steps), (1.0, 1200.0, 10));
        let load = series(&t, "load");
        assert!(load.steps.wall[..5].iter().all(|&w| close(w, 0.1)) && load.steps.wall[5..].iter().all(|&w| w == 0.0));
        let sum = series(&t, "sum");
        assert!(sum.steps.wall[..5].iter().all(|&w| w == 0.0) && sum.steps.wall[5..].iter().all(|&w| close(w, 0.1)));
        assert_eq!((load.kind, load.group, series(&t, NO_TASK).group), (WORKER, "prefix", "activity"));
        let summary = summarize(&data);
        for p in &summary.prefixes {
            let s = series(&t, &p.prefix);
            assert!(close(s.seconds, p.group.seconds) && close(s.steps.cpu.iter().sum(), p.group.split.cpu));
        }
        let kind = &t.kinds[WORKER];
        assert!(close(kind.steps.wall.iter().sum(), summary.all.seconds) && kind.processes == 1);
        assert!(!t.kinds.contains_key(SCHEDULER));
    }

    #[test]
    fn coarse_samples_spread_over_their_bucket() {
        // One thread's minute folded into two samples at its start: 45 s of load, 15 s of sum.
        let mut data = timed(&[(1, 0.0, Some("load-1")), (1, 0.0, Some("sum-1")), (1, 60.0, Some("load-1"))]);
        (data.samples[0].weight_us, data.samples[1].weight_us) = (45_000_000, 15_000_000);
        data.samples[0].cpu_us = 30_000_000;
        let t = timeline(&data, Some(15.0), SeriesBy::Prefix, None).unwrap();
        assert_eq!(t.steps, 5, "the last sample's 10 ms runs into a fifth step");
        let load = series(&t, "load");
        assert!(load.steps.wall[..4].iter().all(|&w| close(w, 11.25)), "{:?}", load.steps.wall);
        assert!(load.steps.cpu[..4].iter().all(|&c| close(c, 7.5)));
        assert!(close(load.steps.wall[4], 0.01));
        assert!(series(&t, "sum").steps.wall[..4].iter().all(|&w| close(w, 3.75)));
        let whole = timeline(&data, Some(60.0), SeriesBy::Prefix, None).unwrap();
        assert!(close(series(&whole, "load").steps.wall[0], 45.0), "a step as coarse as the bucket holds it whole");
        let total: f64 = t.kinds[WORKER].steps.wall.iter().sum();
        assert!(close(total, data.total_seconds()));
    }

    #[test]
    fn a_folded_rows_part_spreads_over_where_it_ran() {
        // A history row's part: 15 s of load that ran 20 to 35 s after BASE.
        let mut data = timed(&[(1, 20.0, Some("load-1")), (2, 0.0, None)]);
        (data.samples[0].weight_us, data.samples[0].cover) = (15_000_000, 150);
        let t = timeline(&data, Some(5.0), SeriesBy::Prefix, None).unwrap();
        let load = &series(&t, "load").steps.wall;
        assert!(
            load.iter().enumerate().all(|(i, &w)| close(w, if (4..7).contains(&i) { 5.0 } else { 0.0 })),
            "{load:?}"
        );
        // Aggregated, it goes to the 10 s cells it ran in: 10 s in 20..30, 5 s in 30..40.
        let aggregated = data.aggregated(false);
        let load =
            series(&timeline(&aggregated, Some(10.0), SeriesBy::Prefix, None).unwrap(), "load").steps.wall.clone();
        assert!(close(load[2], 10.0) && close(load[3], 5.0) && close(load.iter().sum(), 15.0), "{load:?}");
    }

    #[test]
    fn an_aggregated_profile_keeps_its_timeline_in_cells() {
        // load for the first 30 s, sum for the next 30 s, every 100 ms on two threads.
        let samples: Vec<(u64, f64, Option<&str>)> = (0..600)
            .flat_map(|i| {
                let tag = if i < 300 { "load-1" } else { "sum-1" };
                [(1, i as f64 * 0.1, Some(tag)), (2, i as f64 * 0.1, None)]
            })
            .collect();
        let raw = timed(&samples);
        let aggregated = raw.aggregated(false);
        assert!(aggregated.samples.len() < 5 && aggregated.timeline.len() == 2 * 6, "{}", aggregated.timeline.len());
        let again = crate::formats::wire::decode(&crate::formats::wire::encode(&aggregated.aggregated(false))).unwrap();
        let merged = ProfileData::merge(&[&again], Default::default());
        for data in [&aggregated, &merged, &merged.only_process(0)] {
            let [want, got] = [&raw, data].map(|d| timeline(d, Some(10.0), SeriesBy::Prefix, None).unwrap());
            for name in ["load", "sum", NO_TASK] {
                let (w, g) = (series(&want, name), series(&got, name));
                assert!(w.steps.wall.iter().zip(&g.steps.wall).all(|(a, b)| close(*a, *b)), "{name}: {g:?}");
                assert!(w.steps.cpu.iter().zip(&g.steps.cpu).all(|(a, b)| close(*a, *b)), "{name}: {g:?}");
            }
        }
        let load = series(&timeline(&merged, Some(30.0), SeriesBy::Prefix, None).unwrap(), "load").steps.wall.clone();
        assert!(close(load[0], 3.0) && load[1] == 0.0, "load ran in the first 30 s only: {load:?}");
    }

    #[test]
    fn a_merge_of_raw_and_aggregated_processes_draws_both() {
        let samples: Vec<(u64, f64, Option<&str>)> = (0..300).map(|i| (1, i as f64 * 0.1, Some("load-1"))).collect();
        let raw = timed(&samples);
        let aggregated = raw.as_process("tcp://w:2", "-2").aggregated(false);
        let mixed = ProfileData::merge(&[&raw, &aggregated], Default::default());
        for data in [&mixed, &mixed.aggregated(false)] {
            let load = series(&timeline(data, Some(10.0), SeriesBy::Prefix, None).unwrap(), "load").steps.wall.clone();
            assert!(load.len() == 3 && load.iter().all(|&w| close(w, 2.0)), "1 s a step from each process: {load:?}");
        }
    }

    #[test]
    fn kinds_activities_spans_and_bounds() {
        let mut data = timed(&[(1, 0.0, None), (1, 1.0, Some("f-1")), (2, 1.0, None)]);
        data.processes[0].name = "scheduler tcp://s:1".into();
        data.activities = vec!["scheduler: task-finished".into()];
        data.samples[0].activity = Some(0);
        let mut worker = profile("tcp://w:2", &[(1, &["f"], Some("f-1"))]);
        worker.samples[0].time_ns = (BASE + 1) * S;
        worker.spans.insert("a".into(), Span { names: vec!["load".into()], ids: vec!["a".into()] });
        worker.tags[0].span = Some("a".into());
        let merged = ProfileData::merge(&[&data, &worker], Default::default());
        let t = timeline(&merged, None, SeriesBy::Span, Some((1190.0, 1210.0))).unwrap();
        assert_eq!((t.start, t.steps), (1190.0, 20), "the bounds widen the profile's own span");
        let finished = series(&t, "scheduler: task-finished");
        assert_eq!((finished.kind, finished.group), (SCHEDULER, "activity"));
        assert!(close(finished.steps.wall[10], 0.01));
        let spans: Vec<(&str, &str)> =
            t.series.iter().filter(|s| s.group == "span").map(|s| (s.kind, s.name.as_str())).collect();
        assert!(spans.contains(&(WORKER, "load")) && spans.contains(&(SCHEDULER, NO_SPAN)), "{spans:?}");
        assert_eq!((t.kinds[SCHEDULER].processes, t.kinds[WORKER].processes), (1, 1));
        let empty = timeline(&ProfileData::default(), None, SeriesBy::Prefix, None).unwrap();
        assert!(empty.series.is_empty() && empty.kinds.is_empty() && empty.steps == 1);
    }
}
