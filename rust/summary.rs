//! Totals for reports: time per process, per task prefix (with its top functions),
//! per thread state, and the functions with the most self time.

use crate::model::{ProfileData, FLAG_ACTIVE, FLAG_GIL};
use serde::Serialize;
use std::collections::HashMap;

const TOP_FUNCTIONS: usize = 8;

#[derive(Serialize, Clone)]
pub struct FunctionTime {
    pub name: String,
    pub file: String,
    pub seconds: f64,
}

#[derive(Serialize)]
pub struct ProcessTime {
    pub name: String,
    pub samples: usize,
    pub seconds: f64,
    pub threads: usize,
}

#[derive(Serialize)]
pub struct PrefixTime {
    pub prefix: String,
    pub samples: usize,
    pub seconds: f64,
    /// Self time of the functions at the top of this prefix's stacks.
    pub top: Vec<FunctionTime>,
}

/// Seconds by thread state; "waiting" is only sampled with `idle=True`.
#[derive(Serialize, Default)]
pub struct States {
    pub running_with_gil: f64,
    pub running_without_gil: f64,
    pub waiting_holding_gil: f64,
    pub waiting: f64,
}

#[derive(Serialize)]
pub struct Summary {
    pub samples: usize,
    pub seconds: f64,
    pub first: Option<f64>,
    pub last: Option<f64>,
    pub processes: Vec<ProcessTime>,
    pub prefixes: Vec<PrefixTime>,
    pub untagged_seconds: f64,
    pub states: States,
    pub top: Vec<FunctionTime>,
}

/// Self time per function (name + file, any line), largest first.
#[derive(Default)]
struct SelfTime(HashMap<u32, f64>);

impl SelfTime {
    fn add(&mut self, data: &ProfileData, stack: u32, seconds: f64) {
        if let Some(&leaf) = data.stacks[stack as usize].last() {
            *self.0.entry(leaf).or_default() += seconds;
        }
    }

    fn top(&self, data: &ProfileData) -> Vec<FunctionTime> {
        let mut by_function: HashMap<(&str, &str), f64> = HashMap::new();
        for (&frame, &s) in &self.0 {
            let f = &data.frames[frame as usize];
            *by_function.entry((&f.name, &f.file)).or_default() += s;
        }
        let mut out: Vec<FunctionTime> = by_function
            .into_iter()
            .map(|((name, file), seconds)| FunctionTime { name: name.into(), file: file.into(), seconds })
            .collect();
        out.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| a.name.cmp(&b.name)));
        out.truncate(TOP_FUNCTIONS);
        out
    }
}

pub fn summarize(data: &ProfileData) -> Summary {
    let mut per_process: Vec<(usize, f64, Vec<u64>)> = vec![(0, 0.0, Vec::new()); data.processes.len()];
    let mut per_prefix: HashMap<&str, (usize, f64, SelfTime)> = HashMap::new();
    let mut all = SelfTime::default();
    let mut states = States::default();
    let mut untagged = 0.0;
    for s in &data.samples {
        let secs = s.weight_us as f64 / 1e6;
        let th = &data.threads[s.thread as usize];
        if let Some(p) = per_process.get_mut(th.process as usize) {
            p.0 += 1;
            p.1 += secs;
            p.2.push(th.ident);
        }
        match s.tag {
            Some(t) => {
                let e = per_prefix.entry(&data.tags[t as usize].prefix).or_default();
                e.0 += 1;
                e.1 += secs;
                e.2.add(data, s.stack, secs);
            }
            None => untagged += secs,
        }
        all.add(data, s.stack, secs);
        let slot = match (s.flags & FLAG_ACTIVE != 0, s.flags & FLAG_GIL != 0) {
            (true, true) => &mut states.running_with_gil,
            (true, false) => &mut states.running_without_gil,
            (false, true) => &mut states.waiting_holding_gil,
            (false, false) => &mut states.waiting,
        };
        *slot += secs;
    }
    let processes = data
        .processes
        .iter()
        .zip(per_process)
        .map(|(p, (samples, seconds, mut idents))| {
            idents.sort_unstable();
            idents.dedup();
            ProcessTime { name: p.name.clone(), samples, seconds, threads: idents.len() }
        })
        .collect();
    let mut prefixes: Vec<PrefixTime> = per_prefix
        .into_iter()
        .map(|(prefix, (samples, seconds, self_time))| PrefixTime {
            prefix: prefix.into(),
            samples,
            seconds,
            top: self_time.top(data),
        })
        .collect();
    prefixes.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| a.prefix.cmp(&b.prefix)));
    let times = data.samples.iter().map(|s| s.time_ns as f64 / 1e9);
    Summary {
        samples: data.samples.len(),
        seconds: data.total_seconds(),
        first: times.clone().reduce(f64::min),
        last: times.reduce(f64::max),
        processes,
        prefixes,
        untagged_seconds: untagged,
        states,
        top: all.top(data),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::profile;

    #[test]
    fn totals_by_prefix_state_and_function() {
        let data = profile(
            "w",
            &[(1, &["main", "f"], Some("f-1")), (1, &["main", "f"], Some("f-2")), (2, &["main", "g"], Some("g-1")), (2, &["main"], None)],
        );
        let s = summarize(&data);
        assert_eq!(s.samples, 4);
        assert_eq!(s.processes[0].threads, 2);
        assert_eq!(s.prefixes[0].prefix, "f");
        assert_eq!(s.prefixes[0].samples, 2);
        assert_eq!(s.prefixes[0].top[0].name, "f");
        assert!((s.untagged_seconds - 0.01).abs() < 1e-9);
        assert!((s.states.running_without_gil - 0.04).abs() < 1e-9);
        assert_eq!(s.top[0].name, "f");
    }
}
