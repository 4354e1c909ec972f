//! Totals for reports: time per process, per task prefix, per span and per event-loop
//! activity (each with its top functions), and the functions with the most self time. Every row splits its
//! wall time by thread state (see `model::State`), beside the CPU time its threads used.

use crate::profile::intern::Interner;
use crate::profile::model::ProfileData;
use crate::profile::sample::{Sample, State};
use crate::profile::views::{split_activity, Weight, NO_TASK};
use serde::Serialize;
use std::collections::HashMap;

const TOP_FUNCTIONS: usize = 8;

/// Where wall time went, in seconds, by thread state; the states add up to the row's
/// wall time.
#[derive(Serialize, Clone, Copy, Default, Debug)]
pub struct Split {
    /// CPU time the threads used (0 where the reader did not measure it).
    pub cpu: f64,
    /// On a CPU holding the GIL (running Python, or a C call that kept it).
    pub gil: f64,
    /// On a CPU without the GIL (a numpy kernel, compression).
    pub no_gil: f64,
    /// Runnable, waiting for a CPU: more busy threads than cores.
    pub cpu_wait: f64,
    /// Waiting for the GIL.
    pub gil_wait: f64,
    /// Waiting while threads Python does not know (BLAS, arrow) used the CPU.
    pub native: f64,
    /// Blocked on I/O, a lock or a sleep (tasks' threads; others with `idle`).
    pub blocked: f64,
}

impl Split {
    fn add(&mut self, s: &Sample) {
        let wall = s.weight_us as f64 / 1e6;
        self.cpu += Weight::Cpu.of(s) as f64 / 1e6;
        *self.state(State::of(s.flags)) += wall;
    }

    fn state(&mut self, state: State) -> &mut f64 {
        match state {
            State::CpuGil => &mut self.gil,
            State::Cpu => &mut self.no_gil,
            State::CpuWait => &mut self.cpu_wait,
            State::GilWait => &mut self.gil_wait,
            State::Native => &mut self.native,
            State::Blocked => &mut self.blocked,
        }
    }

    fn merge(&mut self, other: &Split) {
        let mut other = *other;
        self.cpu += other.cpu;
        for state in State::ALL {
            *self.state(state) += *other.state(state);
        }
    }
}

#[derive(Serialize, Clone)]
pub struct FunctionTime {
    pub name: String,
    /// The Python file, or a native function's library.
    pub file: String,
    /// Native code (`file` is its library); not `native`, the split's state of that name.
    pub is_native: bool,
    /// Self wall time.
    pub seconds: f64,
    #[serde(flatten)]
    pub split: Split,
}

#[derive(Serialize)]
pub struct ProcessTime {
    pub name: String,
    pub samples: usize,
    pub seconds: f64,
    pub threads: usize,
    /// Threads that ran a task in the window.
    pub task_threads: usize,
    #[serde(flatten)]
    pub split: Split,
}

/// A group of samples (a task prefix, a span, everything): its totals and the self
/// time of the functions at the top of its stacks.
#[derive(Serialize)]
pub struct Group {
    pub samples: usize,
    pub seconds: f64,
    #[serde(flatten)]
    pub split: Split,
    pub top: Vec<FunctionTime>,
}

#[derive(Serialize)]
pub struct PrefixTime {
    pub prefix: String,
    #[serde(flatten)]
    pub group: Group,
}

/// Time outside tasks in one activity ("scheduler: task-finished"); `kind` and `name`
/// are its two halves. Samples in none are the activity `NO_TASK`, of no kind.
#[derive(Serialize)]
pub struct ActivityTime {
    pub activity: String,
    pub kind: String,
    pub name: String,
    /// Times it was dispatched in the window; absent where not counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calls: Option<u64>,
    #[serde(flatten)]
    pub group: Group,
}

/// A span with the spans nested in it.
#[derive(Serialize)]
pub struct SpanTime {
    /// Names, outermost first; a span no one named is its id.
    pub path: Vec<String>,
    #[serde(flatten)]
    pub group: Group,
}

#[derive(Serialize)]
pub struct Summary {
    pub first: Option<f64>,
    pub last: Option<f64>,
    pub processes: Vec<ProcessTime>,
    pub prefixes: Vec<PrefixTime>,
    pub spans: Vec<SpanTime>,
    /// Samples outside tasks: event loops, communication, deserialising, the scheduler.
    pub untagged: Group,
    /// The same by activity, largest first.
    pub activities: Vec<ActivityTime>,
    /// Whether any sample carries CPU time.
    pub cpu_measured: bool,
    /// Every sample: `samples`, `seconds` and the rest at the top level.
    #[serde(flatten)]
    pub all: Group,
}

/// Samples added up, with self time (and its split) per leaf frame.
#[derive(Default)]
struct Tally {
    samples: usize,
    seconds: f64,
    split: Split,
    leaves: HashMap<u32, (f64, Split)>,
}

impl Tally {
    fn add(&mut self, data: &ProfileData, s: &Sample) {
        let wall = s.weight_us as f64 / 1e6;
        self.samples += s.count as usize;
        self.seconds += wall;
        self.split.add(s);
        if let Some(&leaf) = data.stacks[s.stack as usize].last() {
            let e = self.leaves.entry(leaf).or_default();
            e.0 += wall;
            e.1.add(s);
        }
    }

    /// Self time per function (name + file, any line), largest first.
    fn finish(self, data: &ProfileData) -> Group {
        let mut by_function: HashMap<(&str, &str, bool), (f64, Split)> = HashMap::new();
        // In frame order: a function's lines are added up in one order, so the same
        // profile sums to the same bits (a hash map's order varies per instance).
        let mut leaves: Vec<_> = self.leaves.into_iter().collect();
        leaves.sort_unstable_by_key(|&(frame, _)| frame);
        for (frame, (wall, split)) in leaves {
            let f = &data.frames[frame as usize];
            let e = by_function.entry((&f.name, &f.file, f.native)).or_default();
            e.0 += wall;
            e.1.merge(&split);
        }
        let mut top: Vec<FunctionTime> = by_function
            .into_iter()
            .map(|((name, file, native), (seconds, split))| FunctionTime {
                name: name.into(),
                file: file.into(),
                is_native: native,
                seconds,
                split,
            })
            .collect();
        top.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| (&a.name, &a.file).cmp(&(&b.name, &b.file))));
        top.truncate(TOP_FUNCTIONS);
        Group { samples: self.samples, seconds: self.seconds, split: self.split, top }
    }
}

/// Distinct thread idents with samples per process: all, and those in a task.
fn sampled_threads(data: &ProfileData) -> Vec<(usize, usize)> {
    let mut used = vec![(false, false); data.threads.len()];
    for s in &data.samples {
        let u = &mut used[s.thread as usize];
        *u = (true, u.1 || s.tag.is_some());
    }
    let mut idents: Vec<(u32, u64, bool)> = data
        .threads
        .iter()
        .zip(used)
        .filter(|(_, used)| used.0)
        .map(|(t, used)| (t.process, t.ident, used.1))
        .collect();
    idents.sort_unstable();
    let mut out = vec![(0, 0); data.processes.len()];
    for (i, &(process, ident, in_task)) in idents.iter().enumerate() {
        // Sorted: one ident's entries are adjacent, the one in a task (true) last.
        let last_of_ident = idents.get(i + 1).is_none_or(|n| (n.0, n.1) != (process, ident));
        if last_of_ident {
            out[process as usize].0 += 1;
            out[process as usize].1 += in_task as usize;
        }
    }
    out
}

/// Each tag's prefix and span paths (the span and every span around it) as indices into
/// `prefixes` and `spans`: found once per tag, not per sample, for profiles of millions.
struct TagGroups<'a> {
    prefixes: Vec<&'a str>,
    spans: Vec<Vec<&'a str>>,
    prefix_of: Vec<u32>,
    spans_of: Vec<Vec<u32>>,
}

impl<'a> TagGroups<'a> {
    fn new(data: &'a ProfileData) -> TagGroups<'a> {
        let mut prefixes: Interner<&str> = Interner::default();
        let mut spans: Interner<Vec<&str>> = Interner::default();
        let mut prefix_of = Vec::with_capacity(data.tags.len());
        let mut spans_of = Vec::with_capacity(data.tags.len());
        for tag in &data.tags {
            prefix_of.push(prefixes.intern(&tag.prefix));
            let path = data.span_names(tag);
            spans_of.push((1..=path.len()).map(|depth| spans.intern(path[..depth].to_vec())).collect());
        }
        TagGroups { prefixes: prefixes.into_items(), spans: spans.into_items(), prefix_of, spans_of }
    }
}

fn tallies(n: usize) -> Vec<Tally> {
    (0..n).map(|_| Tally::default()).collect()
}

pub fn summarize(data: &ProfileData) -> Summary {
    let mut per_process: Vec<(usize, f64, Split)> = vec![(0, 0.0, Split::default()); data.processes.len()];
    let groups = TagGroups::new(data);
    let mut per_prefix = tallies(groups.prefixes.len());
    let mut per_span = tallies(groups.spans.len());
    let mut all = Tally::default();
    let mut untagged = Tally::default();
    let mut per_activity: HashMap<Option<u32>, Tally> = HashMap::new();
    for s in &data.samples {
        let secs = s.weight_us as f64 / 1e6;
        let th = &data.threads[s.thread as usize];
        if let Some(p) = per_process.get_mut(th.process as usize) {
            p.0 += s.count as usize;
            p.1 += secs;
            p.2.add(s);
        }
        match s.tag {
            Some(t) => {
                per_prefix[groups.prefix_of[t as usize] as usize].add(data, s);
                for &span in &groups.spans_of[t as usize] {
                    per_span[span as usize].add(data, s);
                }
            }
            None => {
                untagged.add(data, s);
                per_activity.entry(s.activity).or_default().add(data, s);
            }
        }
        all.add(data, s);
    }
    let processes = data
        .processes
        .iter()
        .zip(per_process)
        .zip(sampled_threads(data))
        .map(|((p, (samples, seconds, split)), (threads, task_threads))| ProcessTime {
            name: p.name.clone(),
            samples,
            seconds,
            threads,
            task_threads,
            split,
        })
        .collect();
    // A prefix or span no sample is in (a tag only kept for its key) gets no row.
    let mut prefixes: Vec<PrefixTime> = groups
        .prefixes
        .into_iter()
        .zip(per_prefix)
        .filter(|(_, t)| t.samples > 0)
        .map(|(prefix, t)| PrefixTime { prefix: prefix.into(), group: t.finish(data) })
        .collect();
    prefixes.sort_by(|a, b| b.group.seconds.total_cmp(&a.group.seconds).then_with(|| a.prefix.cmp(&b.prefix)));
    let mut spans: Vec<SpanTime> = groups
        .spans
        .into_iter()
        .zip(per_span)
        .filter(|(_, t)| t.samples > 0)
        .map(|(path, t)| SpanTime { path: path.into_iter().map(String::from).collect(), group: t.finish(data) })
        .collect();
    // Outermost spans first, each followed by its nested ones.
    spans.sort_by(|a, b| a.path.cmp(&b.path));
    let mut activities: Vec<ActivityTime> = per_activity
        .into_iter()
        .map(|(a, t)| {
            let activity = a.map_or(NO_TASK, |a| data.activities[a as usize].as_str());
            let (kind, name) = if a.is_some() { split_activity(activity) } else { ("", activity) };
            let calls = a.and_then(|a| data.activity_calls.get(a as usize).copied().flatten());
            ActivityTime {
                activity: activity.into(),
                kind: kind.into(),
                name: name.into(),
                calls,
                group: t.finish(data),
            }
        })
        .collect();
    activities.sort_by(|a, b| b.group.seconds.total_cmp(&a.group.seconds).then_with(|| a.activity.cmp(&b.activity)));
    let times = data.samples.iter().map(|s| s.time_ns as f64 / 1e9);
    Summary {
        first: times.clone().reduce(f64::min),
        last: times.reduce(f64::max),
        processes,
        prefixes,
        spans,
        untagged: untagged.finish(data),
        activities,
        cpu_measured: data.samples.iter().any(|s| s.cpu_us > 0),
        all: all.finish(data),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;
    use crate::profile::model::Span;
    use crate::profile::sample::{FLAG_ACTIVE, FLAG_CPU_WAIT, FLAG_GIL};

    #[test]
    fn totals_by_prefix_state_and_function() {
        let data = profile(
            "w",
            &[
                (1, &["main", "f"], Some("f-1")),
                (1, &["main", "f"], Some("f-2")),
                (2, &["main", "g"], Some("g-1")),
                (2, &["main"], None),
            ],
        );
        let s = summarize(&data);
        assert_eq!(s.all.samples, 4);
        assert_eq!((s.processes[0].threads, s.processes[0].task_threads), (2, 2));
        assert_eq!(s.prefixes[0].prefix, "f");
        assert_eq!(s.prefixes[0].group.samples, 2);
        assert_eq!(s.prefixes[0].group.top[0].name, "f");
        assert!((s.untagged.seconds - 0.01).abs() < 1e-9);
        assert_eq!((s.untagged.split.no_gil, s.untagged.top[0].name.as_str()), (0.01, "main"));
        assert!((s.all.split.no_gil - 0.04).abs() < 1e-9);
        assert_eq!(s.all.top[0].name, "f");
        assert!(!s.cpu_measured);
    }

    #[test]
    fn wall_splits_by_state_beside_cpu() {
        let mut data = profile(
            "w",
            &[
                (1, &["read"], Some("io-1")),
                (2, &["dot"], Some("np-1")),
                (3, &["loop"], Some("py-1")),
                (4, &["loop"], Some("py-2")),
            ],
        );
        data.samples[0].flags = 0; // blocked on I/O
        data.samples[1].cpu_us = 9_000; // a kernel without the GIL
        data.samples[2].flags = FLAG_ACTIVE | FLAG_GIL;
        data.samples[2].cpu_us = 20_000; // more than the tick's share: capped
        data.samples[3].flags = FLAG_CPU_WAIT | FLAG_GIL; // preempted while holding the GIL
        let s = summarize(&data);
        let row = |p: &str| s.prefixes.iter().find(|r| r.prefix == p).unwrap().group.split;
        assert!(row("io").blocked == 0.01 && row("io").cpu == 0.0);
        assert!(
            row("py").cpu_wait == 0.01 && row("py").gil == 0.01,
            "waiting for a CPU, not running, though it holds the GIL"
        );
        assert!((s.processes[0].split.cpu_wait - 0.01).abs() < 1e-9);
        assert!(row("np").no_gil == 0.01 && (row("np").cpu - 0.009).abs() < 1e-9);
        assert!(row("py").cpu == 0.01);
        assert_eq!(s.all.top.iter().find(|f| f.name == "dot").unwrap().split.no_gil, 0.01);
        assert!(s.cpu_measured);
    }

    #[test]
    fn the_same_profile_sums_to_the_same_bits() {
        // One function at many lines, weights whose float sum depends on the order.
        let names: Vec<String> = (0..16).map(|i| format!("f{i}")).collect();
        let stacks: Vec<[&str; 1]> = names.iter().map(|n| [n.as_str()]).collect();
        let samples: Vec<(u64, &[&str], Option<&str>)> = stacks.iter().map(|s| (1, &s[..], None)).collect();
        let mut data = profile("w", &samples);
        for (i, f) in data.frames.iter_mut().enumerate() {
            (f.name, f.file, f.line) = ("f".into(), "f.py".into(), i as i32);
        }
        for (i, s) in data.samples.iter_mut().enumerate() {
            (s.weight_us, s.cpu_us) = (1_000 + 7_919 * i as u32 % 1_000, 3_001 * i as u32 % 997);
        }
        let bits = |s: Summary| (s.all.top[0].seconds.to_bits(), s.all.top[0].split.cpu.to_bits());
        let first = bits(summarize(&data));
        assert!((0..30).all(|_| bits(summarize(&data)) == first));
    }

    #[test]
    fn activity_rows_carry_calls_only_where_counted() {
        let mut data = profile("w", &[(1, &["a"], None), (1, &["b"], None), (1, &["c"], None)]);
        data.activities = vec!["w: get_data".into(), "w: reading".into()];
        data.samples[0].activity = Some(0);
        data.samples[1].activity = Some(1);
        data.activity_calls = vec![Some(25), None];
        let rows = serde_json::to_value(summarize(&data).activities).unwrap();
        let calls = |name: &str| rows.as_array().unwrap().iter().find(|r| r["name"] == name).unwrap().get("calls");
        assert_eq!(calls("get_data"), Some(&serde_json::json!(25)));
        assert_eq!((calls("reading"), calls(NO_TASK)), (None, None), "absent, not 0 or null");
        data.activity_calls.clear();
        assert!(summarize(&data).activities.iter().all(|r| r.calls.is_none()));
    }

    #[test]
    fn spans_count_their_nested_spans() {
        let mut data = profile("w", &[(1, &["f"], Some("f-1")), (1, &["g"], Some("g-1")), (1, &["h"], Some("h-1"))]);
        data.spans
            .insert("b".into(), Span { names: vec!["load".into(), "parse".into()], ids: vec!["a".into(), "b".into()] });
        data.spans.insert("a".into(), Span { names: vec!["load".into()], ids: vec!["a".into()] });
        data.tags[0].span = Some("a".into());
        data.tags[1].span = Some("b".into());
        let s = summarize(&data);
        let paths: Vec<(String, usize)> = s.spans.iter().map(|r| (r.path.join("/"), r.group.samples)).collect();
        assert_eq!(paths, [("load".to_string(), 2), ("load/parse".to_string(), 1)]);
    }
}
