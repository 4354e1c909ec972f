//! Each process's CPU and resident memory over time, as its sampler kept them each
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
}

/// A process's series as kept: start and step in seconds, and a value per step.
struct Kept<'a> {
    start: f64,
    step: f64,
    cpu: &'a [Value],
    rss: &'a [Value],
}

impl Kept<'_> {
    fn of(stats: &Value) -> Option<Kept<'_>> {
        let series = stats.get("series")?;
        let kept = Kept {
            start: series.get("start")?.as_f64()?,
            step: series.get("step")?.as_f64().filter(|s| *s > 0.0)?,
            cpu: series.get("cpu")?.as_array()?,
            rss: series.get("rss")?.as_array()?,
        };
        (kept.cpu.len() == kept.rss.len()).then_some(kept)
    }
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
    let mut out = Vec::new();
    for p in processes {
        let Some(kept) = Kept::of(&p.stats) else { continue };
        let (mut cpu, mut rss) = (vec![None; steps], vec![None; steps]);
        for (i, (c, r)) in kept.cpu.iter().zip(kept.rss).enumerate() {
            let (from, to) = (kept.start + i as f64 * kept.step, kept.start + (i + 1) as f64 * kept.step);
            let first = ((from - start) / step).floor().max(0.0) as usize;
            for at in first..steps {
                let (lo, hi) = (start + at as f64 * step, start + (at + 1) as f64 * step);
                if lo >= to {
                    break;
                }
                let overlap = hi.min(to) - lo.max(from);
                if overlap <= 0.0 {
                    continue;
                }
                if let Some(c) = c.as_f64() {
                    *cpu[at].get_or_insert(0.0) += c * overlap / kept.step;
                }
                if let Some(r) = r.as_f64() {
                    rss[at] = Some(rss[at].map_or(r, |m: f64| m.max(r)));
                }
            }
        }
        out.push(Resources { name: p.name.clone(), kind: kind(p), cpu, rss });
    }
    out
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
    }
}
