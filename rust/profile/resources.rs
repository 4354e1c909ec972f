//! Each process's CPU and resident memory over time (with, where memory per task was
//! tracked, the bytes each prefix held and arrow's pool), as its sampler kept them each
//! second (`stats["series"]`, see `sampling/series.rs`), resampled to a timeline's steps.

use crate::profile::model::Process;
use serde::Serialize;
use serde_json::Value;

/// One process's resources per timeline step; None where it was not seen.
#[derive(Serialize, Debug, PartialEq)]
pub struct Resources {
    pub name: String,
    pub kind: &'static str,
    /// CPU seconds used in the step: all of the process's threads.
    pub cpu: Vec<Option<f64>>,
    /// The most resident memory seen in the step, bytes.
    pub rss: Vec<Option<f64>>,
    /// Where memory per task was tracked: per task prefix (None: outside tasks), the
    /// most bytes it held in the step.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub in_use: Vec<Held>,
    /// Where noted, the most arrow's pool held in the step (empty: never noted).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub arrow: Vec<Option<f64>>,
}

#[derive(Serialize, Debug, PartialEq)]
pub struct Held {
    pub prefix: Option<String>,
    pub bytes: Vec<Option<f64>>,
}

/// A process's series as kept: start and step in seconds, and a value per step.
struct Kept<'a> {
    start: f64,
    step: f64,
    cpu: &'a [Value],
    rss: &'a [Value],
    in_use: &'a [Value],
    arrow: &'a [Value],
}

impl Kept<'_> {
    fn of(stats: &Value) -> Option<Kept<'_>> {
        let series = stats.get("series")?;
        let kept = Kept {
            start: series.get("start")?.as_f64()?,
            step: series.get("step")?.as_f64().filter(|s| *s > 0.0)?,
            cpu: series.get("cpu")?.as_array()?,
            rss: series.get("rss")?.as_array()?,
            in_use: series.get("in_use").and_then(Value::as_array).map_or(&[], Vec::as_slice),
            arrow: series.get("arrow").and_then(Value::as_array).map_or(&[], Vec::as_slice),
        };
        (kept.cpu.len() == kept.rss.len()).then_some(kept)
    }

    /// Each kept step `i` with the timeline steps it overlaps and by how many seconds.
    fn overlaps(&self, timeline: Steps) -> impl Iterator<Item = (usize, usize, f64)> + '_ {
        (0..self.cpu.len()).flat_map(move |i| {
            let (from, to) = (self.start + i as f64 * self.step, self.start + (i + 1) as f64 * self.step);
            let first = ((from - timeline.start) / timeline.step).floor().max(0.0) as usize;
            (first..timeline.steps)
                .map(move |at| (at, timeline.start + at as f64 * timeline.step))
                .take_while(move |&(_, lo)| lo < to)
                .map(move |(at, lo)| (i, at, (lo + timeline.step).min(to) - lo.max(from)))
                .filter(|&(_, _, overlap)| overlap > 0.0)
        })
    }

    /// The most of `values` (one per kept step) over each timeline step.
    fn most(&self, values: &[Value], timeline: Steps) -> Vec<Option<f64>> {
        let mut out = vec![None; timeline.steps];
        for (i, at, _) in self.overlaps(timeline) {
            if let Some(v) = values.get(i).and_then(Value::as_f64) {
                out[at] = Some(out[at].map_or(v, |m: f64| m.max(v)));
            }
        }
        out
    }

    /// CPU seconds per timeline step: each kept step's spread in proportion to overlap.
    fn spread_cpu(&self, timeline: Steps) -> Vec<Option<f64>> {
        let mut out = vec![None; timeline.steps];
        for (i, at, overlap) in self.overlaps(timeline) {
            if let Some(c) = self.cpu[i].as_f64() {
                *out[at].get_or_insert(0.0) += c * overlap / self.step;
            }
        }
        out
    }

    fn held(&self, timeline: Steps) -> Vec<Held> {
        let row = |r: &Value| {
            let bytes = r.get("bytes")?.as_array()?;
            Some(Held { prefix: r.get("prefix")?.as_str().map(str::to_owned), bytes: self.most(bytes, timeline) })
        };
        self.in_use.iter().filter_map(row).collect()
    }
}

/// A timeline's steps: `steps` of `step` seconds from `start`.
#[derive(Clone, Copy)]
struct Steps {
    start: f64,
    step: f64,
    steps: usize,
}

/// The resources of every process that kept them, over `steps` steps of `step`
/// seconds from `start`: CPU spread over the steps a kept step overlaps, in
/// proportion; memory the most of the kept steps each overlaps.
pub fn resources(
    processes: &[Process],
    kind: impl Fn(&Process) -> &'static str,
    start: f64,
    step: f64,
    steps: usize,
) -> Vec<Resources> {
    let timeline = Steps { start, step, steps };
    let resources = |p: &Process| {
        let kept = Kept::of(&p.stats)?;
        Some(Resources {
            name: p.name.clone(),
            kind: kind(p),
            cpu: kept.spread_cpu(timeline),
            rss: kept.most(kept.rss, timeline),
            in_use: kept.held(timeline),
            arrow: if kept.arrow.is_empty() { Vec::new() } else { kept.most(kept.arrow, timeline) },
        })
    };
    processes.iter().filter_map(resources).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn process(name: &str, series: Value) -> Process {
        Process { name: name.into(), pid: 1, host: "h".into(), token: name.into(), stats: json!({"series": series}) }
    }

    #[test]
    fn kept_steps_spread_over_the_timelines() {
        let p = process("w", json!({"start": 100, "step": 5, "cpu": [2.5, null, 1.0], "rss": [10, null, 30]}));
        let plain = Process { stats: json!({}), ..p.clone() };
        let coarse = resources(&[p.clone(), plain], |_| "worker", 100.0, 10.0, 2);
        assert_eq!(coarse.len(), 1, "a process that kept none is left out");
        assert_eq!(
            (coarse[0].cpu.clone(), coarse[0].rss.clone()),
            (vec![Some(2.5), Some(1.0)], vec![Some(10.0), Some(30.0)])
        );
        let fine = &resources(&[p], |_| "worker", 98.0, 2.0, 9)[0];
        assert_eq!(fine.cpu[..4], [None, Some(1.0), Some(1.0), Some(0.5)], "2.5 s over 100-105: 1 s a 2 s step");
        assert_eq!(fine.rss[..6], [None, Some(10.0), Some(10.0), Some(10.0), None, None]);
        assert_eq!(fine.rss[6..], [Some(30.0), Some(30.0), Some(30.0)]);
        assert!(fine.in_use.is_empty() && fine.arrow.is_empty());
    }

    #[test]
    fn bytes_held_by_prefix_keep_the_most_of_each_step() {
        let in_use = json!([{"prefix": "load", "bytes": [1, 4, null]}, {"prefix": null, "bytes": [2, 0, null]}]);
        let arrow = json!([3, 5, null]);
        let series =
            json!({"start": 100, "step": 5, "cpu": [1, 1, 1], "rss": [9, 9, 9], "in_use": in_use, "arrow": arrow});
        let got = &resources(&[process("w", series)], |_| "worker", 100.0, 10.0, 2)[0];
        assert_eq!(got.in_use[0], Held { prefix: Some("load".into()), bytes: vec![Some(4.0), None] });
        assert_eq!(got.in_use[1], Held { prefix: None, bytes: vec![Some(2.0), None] });
        assert_eq!(got.arrow, [Some(5.0), None], "arrow's pool: the most of each step too");
    }
}
