//! Writer for speedscope's file format (https://www.speedscope.app/file-format-schema.json):
//! weights in seconds (wall or CPU), stacks root first. Merged profiles come first,
//! as `by` asks: one per task prefix and one of the event loops, or the whole cluster
//! by task, span or activity, with task stacks cut to the task's own code. Then one
//! profile per thread with its raw stacks under their task's or activity's root frames,
//! which is what `speedscope_read.rs` loads back.

use crate::formats::compress::Kept;
use crate::profile::model::{Metadata, Process, ProfileData, Thread};
use crate::profile::sample::Sample;
use crate::profile::views::{By, Shown, View, Weight, NO_TASK};
use serde::{Deserialize, Serialize, Serializer};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufWriter, Write};

#[derive(Serialize)]
struct File<'a> {
    #[serde(rename = "$schema")]
    schema: &'static str,
    shared: Shared<'a>,
    profiles: Vec<Profile<'a>>,
    name: &'a str,
    #[serde(rename = "activeProfileIndex")]
    active_profile_index: usize,
    exporter: String,
    /// Not read by speedscope; keeps the run's facts with the file.
    #[serde(rename = "x-dask-pyspy")]
    extension: Extension,
}

/// What speedscope's format has no place for: the run's facts, which profiles are
/// which threads, and what the synthetic root frames stand for.
#[derive(Serialize, Deserialize)]
pub struct Extension {
    pub metadata: Metadata,
    pub processes: Vec<Process>,
    /// The grouping: the root frames of thread profiles are task keys or prefixes.
    /// This and `threads` are missing from files of earlier versions.
    pub by: Option<String>,
    pub threads: Option<Vec<ThreadProfile>>,
    /// By task: each key's prefix.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prefixes: BTreeMap<String, String>,
}

/// The thread whose raw stacks the profile at index `profile` holds.
#[derive(Serialize, Deserialize)]
pub struct ThreadProfile {
    pub profile: usize,
    #[serde(flatten)]
    pub thread: Thread,
}

#[derive(Serialize)]
struct Shared<'a> {
    frames: Vec<SFrame<'a>>,
}

#[derive(Serialize)]
struct SFrame<'a> {
    name: &'a str,
    file: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    line: Option<i32>,
}

/// A sample's stack, root first: its synthetic roots, then its frames; joined as it is
/// written rather than copied per sample (a 1000-worker profile has millions).
struct Stack<'a> {
    roots: &'a [u32],
    frames: &'a [u32],
}

impl Serialize for Stack<'_> {
    fn serialize<S: Serializer>(&self, out: S) -> Result<S::Ok, S::Error> {
        out.collect_seq(self.roots.iter().chain(self.frames))
    }
}

#[derive(Serialize)]
struct Profile<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    name: String,
    unit: &'static str,
    #[serde(rename = "startValue")]
    start_value: f64,
    #[serde(rename = "endValue")]
    end_value: f64,
    samples: Vec<Stack<'a>>,
    weights: Vec<f64>,
    /// Seconds of tagged samples: the file opens on the profile with the most.
    #[serde(skip)]
    task_seconds: f64,
}

/// The files of synthetic root frames, which are not code: task keys or prefixes,
/// the span names above them, and event-loop activities (or, by activity, the kind
/// of work above a task's prefix).
pub const TASK_FILE: &str = "dask task";
pub const SPAN_FILE: &str = "dask span";
pub const ACTIVITY_FILE: &str = "dask activity";

/// Synthetic root frames, appended after the real frames: per tag and per activity,
/// the frames `by` roots its samples at; and in merged views, those of samples in
/// neither (threads keep those stacks as they are).
struct Roots {
    by_tag: Vec<Vec<u32>>,
    by_activity: Vec<Vec<u32>>,
    untagged: Vec<u32>,
    /// The root of samples in no activity among the event loops' (not a task frame,
    /// so readers of task roots do not count them).
    no_activity: Vec<u32>,
}

impl Roots {
    fn new<'a>(data: &'a ProfileData, view: &View<'a>, by: By, frames: &mut Vec<SFrame<'a>>) -> Roots {
        let mut ids: HashMap<(&str, &str), u32> = HashMap::new();
        // The last root of a task is its key or prefix; those above it group it.
        let group = if by == By::Span { SPAN_FILE } else { ACTIVITY_FILE };
        let mut ids_of = |names: Vec<&'a str>, last: &'static str, above: &'static str| -> Vec<u32> {
            let n = names.len();
            names
                .into_iter()
                .enumerate()
                .map(|(i, name)| {
                    let file = if i + 1 == n { last } else { above };
                    *ids.entry((name, file)).or_insert_with(|| {
                        frames.push(SFrame { name, file, line: None });
                        frames.len() as u32 - 1
                    })
                })
                .collect()
        };
        let by_tag =
            (0..data.tags.len() as u32).map(|t| ids_of(view.roots(Some(t), None, by), TASK_FILE, group)).collect();
        let by_activity = (0..data.activities.len() as u32)
            .map(|a| ids_of(view.roots(None, Some(a), by), ACTIVITY_FILE, ACTIVITY_FILE))
            .collect();
        let untagged = match by {
            By::Thread => Vec::new(),
            _ => ids_of(view.roots(None, None, by), TASK_FILE, TASK_FILE),
        };
        let no_activity = ids_of(vec![NO_TASK], ACTIVITY_FILE, ACTIVITY_FILE);
        Roots { by_tag, by_activity, untagged, no_activity }
    }

    fn of(&self, s: &Sample, merged: bool) -> &[u32] {
        match (s.tag, s.activity) {
            (Some(t), _) => &self.by_tag[t as usize],
            (None, Some(a)) => &self.by_activity[a as usize],
            (None, None) if merged => &self.untagged,
            (None, None) => &[],
        }
    }
}

/// Builds one sampled profile; consecutive identical samples merge into one longer
/// one (same picture, smaller file).
#[derive(Default)]
struct Sampled<'a> {
    samples: Vec<Stack<'a>>,
    weights: Vec<f64>,
    last: Option<(&'a [u32], u32)>,
    task_seconds: f64,
}

impl<'a> Sampled<'a> {
    fn add(&mut self, s: &Sample, weight: Weight, roots: &'a [u32], frames: &'a [u32]) {
        let weight = weight.of(s) as f64 / 1e6;
        if weight == 0.0 {
            return;
        }
        if s.tag.is_some() {
            self.task_seconds += weight;
        }
        if matches!(self.last, Some((r, stack)) if r == roots && stack == s.stack) {
            *self.weights.last_mut().unwrap() += weight;
            return;
        }
        self.last = Some((roots, s.stack));
        self.samples.push(Stack { roots, frames });
        self.weights.push(weight);
    }

    fn finish(self, name: String) -> Profile<'a> {
        let total: f64 = self.weights.iter().sum();
        Profile {
            kind: "sampled",
            name,
            unit: "seconds",
            start_value: 0.0,
            end_value: total,
            samples: self.samples,
            weights: self.weights,
            task_seconds: self.task_seconds,
        }
    }
}

/// Samples of every thread in time order.
fn time_order(data: &ProfileData) -> Vec<&Sample> {
    let mut order: Vec<&Sample> = data.samples.iter().collect();
    order.sort_by_key(|s| s.time_ns);
    order
}

/// The merged profiles `shown.by` asks for, largest first: samples of every thread in time order.
fn merged<'a>(data: &'a ProfileData, view: &View<'a>, shown: Shown, roots: &'a Roots) -> Vec<Profile<'a>> {
    let weight = shown.weight;
    let mut out: Vec<Profile> = match shown.by {
        By::Thread => return Vec::new(),
        By::Task | By::Span | By::Activity => {
            let mut all = Sampled::default();
            for s in time_order(data) {
                all.add(s, weight, roots.of(s, true), view.frames(s.stack, s.tag.is_some()));
            }
            vec![all.finish(format!("whole cluster by {} (task code only)", shown.by.as_str()))]
        }
        By::Prefix => {
            let mut per_prefix: HashMap<&str, Sampled> = HashMap::new();
            for s in time_order(data) {
                if let Some(t) = s.tag {
                    per_prefix.entry(&data.tags[t as usize].prefix).or_default().add(
                        s,
                        weight,
                        &[],
                        view.frames(s.stack, true),
                    );
                }
            }
            let mut loops = Sampled::default();
            for s in time_order(data).into_iter().filter(|s| s.tag.is_none()) {
                let root = if s.activity.is_some() { roots.of(s, true) } else { &roots.no_activity };
                loops.add(s, weight, root, view.frames(s.stack, false));
            }
            per_prefix
                .into_iter()
                .map(|(prefix, p)| p.finish(format!("{prefix} (all threads, task code only)")))
                .chain([loops.finish("outside tasks: event loops by activity (all processes)".into())])
                .collect()
        }
    };
    out.sort_by(|a, b| b.end_value.total_cmp(&a.end_value).then_with(|| a.name.cmp(&b.name)));
    out.retain(|p| !p.samples.is_empty());
    out
}

fn thread_profile<'a>(
    data: &'a ProfileData,
    thread: u32,
    samples: &[&Sample],
    weight: Weight,
    roots: &'a Roots,
) -> Profile<'a> {
    let mut p = Sampled::default();
    for s in samples {
        p.add(s, weight, roots.of(s, false), &data.stacks[s.stack as usize]);
    }
    p.finish(data.thread_label(thread))
}

/// Each thread's samples, in their order: one pass, however many threads.
fn per_thread(data: &ProfileData) -> Vec<Vec<&Sample>> {
    let mut out = vec![Vec::new(); data.threads.len()];
    data.samples.iter().for_each(|s| out[s.thread as usize].push(s));
    out
}

/// The profile to open: the one with the most task time among the merged profiles
/// (what `by` asked for) if any, else among the threads; without tasks, the busiest.
fn active(profiles: &[Profile], merged: usize) -> usize {
    let candidates = if merged > 0 { 0..merged } else { 0..profiles.len() };
    let key = |i: &usize| (profiles[*i].task_seconds, profiles[*i].end_value);
    candidates.max_by(|a, b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal)).unwrap_or(0)
}

/// The document; it holds no profile when `data` holds no samples (or, weighted by
/// CPU, none with CPU time).
pub fn write(data: &ProfileData, shown: Shown, name: &str) -> Vec<u8> {
    let mut out = Vec::new();
    write_to(data, shown, name, &mut out).expect("writing to a Vec cannot fail");
    out
}

/// The document gzipped as it is written (see `compress::Kept`): a 1000-worker one
/// (~570 MB of JSON) never sits whole in memory.
pub fn gzipped(data: &ProfileData, shown: Shown, name: &str) -> Vec<u8> {
    let mut out = BufWriter::new(Kept::default());
    write_to(data, shown, name, &mut out).expect("writing to a Vec cannot fail");
    out.into_inner().map_err(|e| e.into_error()).expect("writing to a Vec cannot fail").finish()
}

fn write_to(data: &ProfileData, shown: Shown, name: &str, out: impl Write) -> serde_json::Result<()> {
    let mut frames: Vec<SFrame> = data
        .frames
        .iter()
        .map(|f| SFrame { name: &f.name, file: &f.file, line: (f.line > 0).then_some(f.line) })
        .collect();
    let view = View::new(data);
    let roots = Roots::new(data, &view, shown.by, &mut frames);
    let mut profiles = merged(data, &view, shown, &roots);
    let n_merged = profiles.len();
    let mut threads: Vec<u32> = (0..data.threads.len() as u32).collect();
    threads.sort_by_cached_key(|&t| data.thread_label(t));
    let samples = per_thread(data);
    let mut thread_profiles = Vec::new();
    for t in threads {
        let p = thread_profile(data, t, &samples[t as usize], shown.weight, &roots);
        if !p.samples.is_empty() {
            thread_profiles.push(ThreadProfile { profile: profiles.len(), thread: data.threads[t as usize].clone() });
            profiles.push(p);
        }
    }
    let prefixes = match shown.by {
        By::Task => data.tags.iter().map(|t| (t.key.clone(), t.prefix.clone())).collect(),
        _ => BTreeMap::new(),
    };
    let file = File {
        schema: "https://www.speedscope.app/file-format-schema.json",
        shared: Shared { frames },
        active_profile_index: active(&profiles, n_merged),
        profiles,
        name,
        exporter: format!("dask-pyspy {}", env!("CARGO_PKG_VERSION")),
        extension: Extension {
            metadata: data.metadata.clone(),
            processes: data.processes.clone(),
            by: Some(shown.by.as_str().into()),
            threads: Some(thread_profiles),
            prefixes,
        },
    };
    serde_json::to_writer(out, &file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;
    use crate::profile::model::Span;
    use serde_json::{json, Value};

    fn wall(by: By) -> Shown {
        Shown { by, weight: Weight::Wall }
    }

    fn doc(by: By) -> Value {
        let data = profile(
            "w1",
            &[
                (1, &["main", "f"], Some("f-1")),
                (1, &["main", "f"], Some("f-1")),
                (1, &["main", "g"], Some("g-2")),
                (2, &["main", "h"], None),
                (2, &["main", "i"], None),
                (2, &["main", "h"], None),
                (2, &["main", "i"], None),
            ],
        );
        serde_json::from_slice(&write(&data, wall(by), "test")).unwrap()
    }

    fn names(d: &Value, profile: usize) -> Vec<Vec<String>> {
        let frames = d["shared"]["frames"].as_array().unwrap();
        d["profiles"][profile]["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                s.as_array()
                    .unwrap()
                    .iter()
                    .map(|f| frames[f.as_u64().unwrap() as usize]["name"].as_str().unwrap().to_string())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn structure_matches_the_format() {
        let d = doc(By::Thread);
        assert_eq!(d["$schema"], "https://www.speedscope.app/file-format-schema.json");
        let profiles = d["profiles"].as_array().unwrap();
        assert_eq!(profiles.len(), 2, "one per thread, no merged profile by thread");
        let p = &profiles[0];
        assert_eq!(p["type"], "sampled");
        assert_eq!(p["unit"], "seconds");
        assert_eq!(p["name"], "w1 T1 (0x1)");
        // Two identical consecutive samples merged; weights add up.
        assert_eq!(p["samples"].as_array().unwrap().len(), 2);
        assert_eq!(p["weights"][0], 0.02);
        assert_eq!(p["endValue"], 0.03);
        assert_eq!(names(&d, 0)[0], ["main", "f"], "stacks are root first");
        assert_eq!(d["activeProfileIndex"], 0, "opens on the thread with the most task time, not the busiest");
    }

    #[test]
    fn threads_keep_a_root_frame_per_task_or_prefix() {
        for (by, expect) in [(By::Task, ["f-1", "g-2"]), (By::Prefix, ["f", "g"])] {
            let d = doc(by);
            let n = d["profiles"].as_array().unwrap().len();
            let roots: Vec<String> = names(&d, n - 2).into_iter().map(|s| s[0].clone()).collect();
            assert_eq!(roots, expect);
            assert_eq!(names(&d, n - 1)[0][0], "main", "the untagged thread keeps its own root");
        }
    }

    #[test]
    fn merged_profiles_show_task_code_and_open_first() {
        let mut data = profile(
            "w",
            &[
                (1, &["pool", "f"], Some("f-1")),
                (2, &["pool", "g"], Some("g-2")),
                (1, &["pool", "g"], Some("g-3")),
                (3, &["pool", "h"], None),
            ],
        );
        data.frames[0].file = "/usr/lib/python3/threading.py".into();
        let d: Value = serde_json::from_slice(&write(&data, wall(By::Prefix), "t")).unwrap();
        assert_eq!(d["profiles"][0]["name"], "g (all threads, task code only)", "largest prefix first");
        assert_eq!(names(&d, 0), [["g"]], "cut to the task's code; consecutive samples of one stack merge");
        assert_eq!(names(&d, 1), [["f"]]);
        assert_eq!(d["profiles"][2]["name"], "outside tasks: event loops by activity (all processes)");
        assert_eq!(names(&d, 2), [["(no task)", "pool", "h"]], "with their whole stacks");
        assert_eq!(names(&d, 3), [["f", "pool", "f"], ["g", "pool", "g"]], "threads keep raw stacks");
        assert_eq!(d["activeProfileIndex"], 0);
        let d: Value = serde_json::from_slice(&write(&data, wall(By::Task), "t")).unwrap();
        assert_eq!(
            names(&d, 0),
            [vec!["f-1", "f"], vec!["g-2", "g"], vec!["g-3", "g"], vec!["(no task)", "pool", "h"]]
        );
        assert_eq!(d["activeProfileIndex"], 0);
    }

    #[test]
    fn span_view_roots_at_the_span_path_and_cpu_weights() {
        let mut data = profile(
            "w",
            &[(1, &["pool", "f"], Some("f-1")), (2, &["pool", "g"], Some("g-2")), (3, &["pool", "h"], None)],
        );
        data.tags[0].span = Some("id-parse".into());
        data.tags[1].span = Some("gone".into());
        let span = Span { names: vec!["load".into(), "parse".into()], ids: vec!["id-load".into(), "id-parse".into()] };
        data.spans.insert("id-parse".into(), span);
        data.samples[0].cpu_us = 4_000;
        let d: Value = serde_json::from_slice(&write(&data, wall(By::Span), "t")).unwrap();
        assert_eq!(d["profiles"][0]["name"], "whole cluster by span (task code only)");
        let stacks = names(&d, 0);
        assert_eq!(stacks[0][..3], ["load", "parse", "f"], "span path, then the prefix");
        assert_eq!(stacks[1][..2], ["gone", "g"], "a span the scheduler forgot keeps its id as name");
        assert_eq!(stacks[2][0], "(no task)");
        let d: Value = serde_json::from_slice(&write(&data, Shown { by: By::Span, weight: Weight::Cpu }, "t")).unwrap();
        assert_eq!(d["profiles"][0]["weights"], json!([0.004]), "only CPU time counts");
    }
}
